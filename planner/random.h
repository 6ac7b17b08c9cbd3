// A small deterministic random number generator (SplitMix64) with the same output on every
// platform, unlike the standard distributions, whose algorithms are implementation-defined.
//
//   Rng rng(seed);  double u = rng.Uniform();  double z = rng.Normal();
#ifndef SPARSEBALANCE_PLANNER_RANDOM_H_
#define SPARSEBALANCE_PLANNER_RANDOM_H_

#include <cstdint>

namespace sparsebalance {

class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}

  uint64_t NextU64();
  // Uniform in [0, 1), 53 random bits.
  double Uniform();
  // Standard normal (Marsaglia's polar method with DetLog).
  double Normal();
  // Derives an independent stream, e.g. one per step: Rng(Mix(seed, step)).
  static uint64_t Mix(uint64_t a, uint64_t b);

 private:
  uint64_t state_;
};

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_PLANNER_RANDOM_H_
