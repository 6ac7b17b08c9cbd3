// The profile table's text format, read and write: measured one-layer times on a grid of
// length x density for one device. `sb-profile` (kernels/layer_profiler.h) writes it with
// FormatProfileTable; `sb-planner` and `sb-sim` read it with ParseProfileTable and fit the
// latency model's prior to it (planner/profile_table.h, FitProfile).
//
// File format (text, version 1; '#' starts a comment, blank lines are skipped):
//
//   sparsebalance-profile 1
//   device NVIDIA H100 80GB HBM3
//   shape heads=32 head_dim=128 block_size=64 local_blocks=1
//   # length(tokens)  density  seconds(one layer, forward+backward, attention + linear part)
//   8192    1.0   0.0123
//   8192    0.3   0.0071
//   ...
//
// Every data row is one document of `length` tokens run through one transformer layer
// (forward and backward) with block-sparse attention at `density`.
//
//   absl::StatusOr<ProfileTable> table = ParseProfileTable(text);
//   std::string again = FormatProfileTable(*table);  // == text, up to comments
#ifndef SPARSEBALANCE_CONTRACT_PROFILE_FORMAT_H_
#define SPARSEBALANCE_CONTRACT_PROFILE_FORMAT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "contract/layer_shape.h"

namespace sparsebalance {

struct ProfileRow {
  int64_t length = 0;    // tokens
  double density = 0.0;  // (0, 1]
  double seconds = 0.0;  // one layer, forward + backward
};

// Where one row's time went, for readers of the file: written as a commented block after the
// data rows, never read back.
struct ProfileBreakdown {
  double attention_seconds = 0.0;  // selection + attention forward + backward
  double linear_seconds = 0.0;     // the GEMMs
  int64_t active_blocks = 0;       // kept (query block, key block) pairs over all heads
};

struct ProfileTable {
  std::string device;
  ModelShape shape;  // `layers` is unused: rows are per layer
  // One comment line written after the shape line (how the rows were measured); not read back.
  std::string note;
  std::vector<ProfileRow> rows;
  // Empty, or one per row (same order); not read back (ParseProfileTable leaves it empty).
  std::vector<ProfileBreakdown> breakdown;
};

// Errors are INVALID_ARGUMENT and name the line ("profile line 4: ...").
absl::StatusOr<ProfileTable> ParseProfileTable(absl::string_view text);
// Times keep nine significant digits, densities six.
std::string FormatProfileTable(const ProfileTable& table);

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_CONTRACT_PROFILE_FORMAT_H_
