#include "kernels/parallel.h"

#include <algorithm>
#include <atomic>
#include <thread>
#include <vector>

namespace sparsebalance {
namespace kernels {

int ResolveThreads(int threads) {
  if (threads > 0) return threads;
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

void ParallelFor(int64_t tasks, int threads,
                 const std::function<void(int worker, int64_t task)>& fn) {
  const int workers = static_cast<int>(std::min<int64_t>(ResolveThreads(threads), tasks));
  if (workers <= 1) {
    for (int64_t t = 0; t < tasks; ++t) fn(0, t);
    return;
  }
  std::atomic<int64_t> next{0};
  auto run = [&](int worker) {
    for (int64_t t = next.fetch_add(1); t < tasks; t = next.fetch_add(1)) fn(worker, t);
  };
  std::vector<std::thread> pool;
  pool.reserve(workers - 1);
  for (int w = 1; w < workers; ++w) pool.emplace_back(run, w);
  run(0);
  for (std::thread& t : pool) t.join();
}

}  // namespace kernels
}  // namespace sparsebalance
