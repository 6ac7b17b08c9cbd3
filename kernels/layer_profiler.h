// What sb-profile measures: one transformer layer, forward and backward, on one document of
// `length` tokens with block-sparse attention at `density`, on the local CPU or CUDA device:
// block selection + attention forward/backward + the linear part (QKV and output projections
// and a 4x MLP as GEMMs: forward, input and weight gradients). The result is the profile table
// that planner/profile_table.h reads (FormatProfile writes exactly that format).
//
//   ProfileOptions options;
//   options.lengths = {2048, 4096};
//   absl::StatusOr<Profile> profile = RunProfile(options);
//   std::string text = FormatProfile(*profile);
#ifndef SPARSEBALANCE_KERNELS_LAYER_PROFILER_H_
#define SPARSEBALANCE_KERNELS_LAYER_PROFILER_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace sparsebalance {
namespace kernels {

struct ProfileOptions {
  std::string device = "cpu";  // "cpu" or "cuda"
  int heads = 4;
  int head_dim = 128;   // 64 or 128
  int block_size = 64;  // tokens per block: 64 or 128
  int local_blocks = 1;
  std::vector<int64_t> lengths = {2048, 4096, 8192};  // tokens
  std::vector<double> densities = {1.0, 0.3, 0.1};    // each in (0, 1]
  int repeats = 1;  // measurements per grid point; the median is reported
  int threads = 0;  // CPU threads; 0 means the hardware concurrency
  uint64_t seed = 1;
};

struct ProfilePoint {
  int64_t length = 0;              // tokens
  double density = 0.0;            // (0, 1]
  double seconds = 0.0;            // median of the repeats: one layer, forward + backward
  double attention_seconds = 0.0;  // selection + attention forward + backward (same repeat)
  double linear_seconds = 0.0;     // the GEMMs (same repeat)
  int64_t active_blocks = 0;       // kept blocks over all heads
};

struct Profile {
  std::string device_name;  // e.g. "cpu Intel(R) Xeon(R) ... x2 threads" or the GPU's name
  ProfileOptions options;
  std::vector<ProfilePoint> points;
};

// Every field; errors name the flag-like field ("lengths[1]=0 ...").
absl::Status ValidateProfileOptions(const ProfileOptions& options);

// Measures every (length, density) of the grid; `progress`, if set, sees each point.
absl::StatusOr<Profile> RunProfile(
    const ProfileOptions& options,
    const std::function<void(const ProfilePoint&)>& progress = nullptr);

// The profile table, version 1 (planner/profile_table.h):
//   sparsebalance-profile 1 / device NAME / shape heads=.. head_dim=.. block_size=..
//   local_blocks=.. / then "length density seconds" rows.
std::string FormatProfile(const Profile& profile);

}  // namespace kernels
}  // namespace sparsebalance

#endif  // SPARSEBALANCE_KERNELS_LAYER_PROFILER_H_
