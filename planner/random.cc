#include "planner/random.h"

#include <cmath>

#include "planner/det_math.h"

namespace sparsebalance {

uint64_t Rng::NextU64() {
  uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

double Rng::Uniform() { return static_cast<double>(NextU64() >> 11) * 0x1.0p-53; }

double Rng::Normal() {
  while (true) {
    const double u = 2.0 * Uniform() - 1.0;
    const double v = 2.0 * Uniform() - 1.0;
    const double s = u * u + v * v;
    if (s > 0.0 && s < 1.0) return u * std::sqrt(-2.0 * DetLog(s) / s);
  }
}

uint64_t Rng::Mix(uint64_t a, uint64_t b) {
  Rng rng(a ^ (b * 0xd1b54a32d192ed03ULL + 0x8cb92ba72f3d8dd7ULL));
  return rng.NextU64();
}

}  // namespace sparsebalance
