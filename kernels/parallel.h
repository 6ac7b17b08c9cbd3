// Runs independent tasks on a few std::threads (the CPU reference parallelises over
// (sequence, head) pairs). Internal to kernels/.
#ifndef SPARSEBALANCE_KERNELS_PARALLEL_H_
#define SPARSEBALANCE_KERNELS_PARALLEL_H_

#include <cstdint>
#include <functional>

namespace sparsebalance {
namespace kernels {

// `threads` if positive, else the hardware concurrency (at least 1).
int ResolveThreads(int threads);

// Calls fn(worker, task) once for every task in [0, tasks), tasks taken in ascending order by
// min(threads, tasks) workers numbered from 0; returns when all are done.
void ParallelFor(int64_t tasks, int threads,
                 const std::function<void(int worker, int64_t task)>& fn);

}  // namespace kernels
}  // namespace sparsebalance

#endif  // SPARSEBALANCE_KERNELS_PARALLEL_H_
