#include "kernels/layer_profiler.h"

#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "contract/profile_format.h"
#include "kernels/block_index.h"
#include "kernels/layer_runner.h"

namespace sparsebalance {
namespace kernels {
namespace {

// Deterministic values in [-1, 1) (splitmix64), so that runs are comparable.
void Fill(uint64_t seed, std::vector<float>* values) {
  uint64_t state = seed * 0x9e3779b97f4a7c15ull + 1;
  for (float& x : *values) {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    x = static_cast<float>(static_cast<double>(z >> 40) / static_cast<double>(1ull << 23) - 1.0);
  }
}

// One document of `length` tokens with random q, k, v.
LayerBatch OneDocument(const ProfileOptions& o, int64_t length) {
  LayerBatch batch;
  batch.documents = {{length, 1.0}};
  const size_t n = static_cast<size_t>(length) * o.shape.heads * o.shape.head_dim;
  uint64_t seed = o.seed;
  for (std::vector<float>* t : {&batch.q, &batch.k, &batch.v}) {
    t->resize(n);
    Fill(seed++, t);
  }
  return batch;
}

}  // namespace

absl::Status ValidateProfileOptions(const ProfileOptions& o) {
  if (o.device != "cpu" && o.device != "cuda") {
    return absl::InvalidArgumentError(
        absl::StrCat("device=", o.device, " is not known; use cpu or cuda"));
  }
  if (absl::Status s = ValidateHeads(o.shape.heads); !s.ok()) return s;
  if (absl::Status s = ValidateHeadDim(o.shape.head_dim); !s.ok()) return s;
  if (absl::Status s = ValidateBlockSize(o.shape.block_size); !s.ok()) return s;
  if (o.shape.local_blocks < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("local_blocks=", o.shape.local_blocks, " must be non-negative"));
  }
  if (o.repeats < 1) {
    return absl::InvalidArgumentError(absl::StrCat("repeats=", o.repeats, " must be at least 1"));
  }
  if (absl::Status s = ValidateThreads(o.threads); !s.ok()) return s;
  if (o.lengths.empty() || o.densities.empty()) {
    return absl::InvalidArgumentError("lengths and densities each need at least one value");
  }
  for (size_t i = 0; i < o.lengths.size(); ++i) {
    if (o.lengths[i] < 1 || o.lengths[i] > (int64_t{1} << 30)) {
      return absl::InvalidArgumentError(
          absl::StrCat("lengths[", i, "]=", o.lengths[i], " must be in [1, 2^30] tokens"));
    }
  }
  for (size_t i = 0; i < o.densities.size(); ++i) {
    if (!(o.densities[i] > 0.0 && o.densities[i] <= 1.0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("densities[", i, "]=", o.densities[i], " is outside (0, 1]"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Profile> RunProfile(const ProfileOptions& options,
                                   const std::function<void(const ProfilePoint&)>& progress) {
  if (absl::Status s = ValidateProfileOptions(options); !s.ok()) return s;
  LayerRunnerOptions runner_options;
  runner_options.device = options.device;
  runner_options.threads = options.threads;
  absl::StatusOr<std::unique_ptr<LayerRunner>> runner =
      LayerRunner::Create(options.shape, runner_options);
  if (!runner.ok()) return runner.status();
  Profile profile;
  profile.options = options;
  profile.device_name = (*runner)->device_name();
  const bool on_cuda = options.device == "cuda";
  for (int64_t length : options.lengths) {
    if (absl::Status s = (*runner)->Load(OneDocument(options, length)); !s.ok()) return s;
    for (double density : options.densities) {
      if (absl::Status s = (*runner)->SetDensities({density}); !s.ok()) return s;
      // The GPU's first launch of each shape pays for module loading: one unmeasured run.
      const int runs = options.repeats + (on_cuda ? 1 : 0);
      std::vector<LayerMeasurement> measured;
      for (int r = 0; r < runs; ++r) {
        absl::StatusOr<LayerMeasurement> m = (*runner)->Run(/*exact_recall=*/false);
        if (!m.ok()) return m.status();
        if (on_cuda && r == 0) continue;
        measured.push_back(*std::move(m));
      }
      std::sort(measured.begin(), measured.end(),
                [](const LayerMeasurement& a, const LayerMeasurement& b) {
                  return a.seconds() < b.seconds();
                });
      const LayerMeasurement& median = measured[(measured.size() - 1) / 2];
      ProfilePoint point;
      point.length = length;
      point.density = density;
      point.attention_seconds = median.attention_seconds;
      point.linear_seconds = median.linear_seconds;
      point.seconds = median.seconds();
      point.active_blocks = median.active_blocks;
      profile.points.push_back(point);
      if (progress) progress(point);
    }
  }
  return profile;
}

std::string FormatProfile(const Profile& profile) {
  ProfileTable table;
  table.device = profile.device_name;
  table.shape = profile.options.shape;
  table.note = absl::StrCat("written by sb-profile: median of ", profile.options.repeats,
                            " run(s); selection + attention fwd/bwd + QKV/O/MLP GEMMs fwd/bwd");
  for (const ProfilePoint& p : profile.points) {
    table.rows.push_back({p.length, p.density, p.seconds});
    table.breakdown.push_back({p.attention_seconds, p.linear_seconds, p.active_blocks});
  }
  return FormatProfileTable(table);
}

}  // namespace kernels
}  // namespace sparsebalance
