// What sb-profile measures: one transformer layer, forward and backward, on one document of
// `length` tokens with block-sparse attention at `density`, on the local CPU or CUDA device,
// run by the same LayerRunner (kernels/layer_runner.h) that sb-worker runs micro-batches with.
// The result is a profile table (contract/profile_format.h); FormatProfile writes it.
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
#include "contract/layer_shape.h"

namespace sparsebalance {
namespace kernels {

// The shape sb-profile measures by default: 4 heads of 128, blocks of 64, one local block.
inline ModelShape DefaultProfileShape() {
  ModelShape shape;
  shape.layers = 1;  // unused: a profile measures one layer
  shape.heads = 4;
  return shape;
}

struct ProfileOptions {
  std::string device = "cpu";  // "cpu" or "cuda"
  // heads, head_dim (64 or 128), block_size (64 or 128), local_blocks; `layers` is unused.
  ModelShape shape = DefaultProfileShape();
  std::vector<int64_t> lengths = {2048, 4096, 8192};  // tokens
  std::vector<double> densities = {1.0, 0.3, 0.1};    // each in (0, 1]
  int repeats = 1;  // measurements per grid point; the median is reported
  // CPU threads; 0 means the hardware concurrency. With 1, times are the thread's CPU time
  // (what sb-worker measures); with more, the layer's wall time (kernels/layer_runner.h).
  int threads = 0;
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
  std::string device_name;  // e.g. "cpu Intel(R) Xeon(R) ... (2 threads, ...)" or the GPU's name
  ProfileOptions options;
  std::vector<ProfilePoint> points;
};

// Every field; errors name the flag-like field ("lengths[1]=0 ...").
absl::Status ValidateProfileOptions(const ProfileOptions& options);

// Measures every (length, density) of the grid; `progress`, if set, sees each point.
absl::StatusOr<Profile> RunProfile(
    const ProfileOptions& options,
    const std::function<void(const ProfilePoint&)>& progress = nullptr);

// The profile table (contract/profile_format.h), with a note on how it was measured and the
// attention/linear split of every point as comments.
std::string FormatProfile(const Profile& profile);

}  // namespace kernels
}  // namespace sparsebalance

#endif  // SPARSEBALANCE_KERNELS_LAYER_PROFILER_H_
