// sb-profile: measures one transformer layer (forward + backward, block-sparse attention and
// the linear part) on a grid of lengths and densities on this machine's CPU or CUDA GPU, and
// writes the profile table the planner's latency model starts from. `sb-profile --help`.
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "kernels/layer_profiler.h"
#include "tools/tool_support.h"

ABSL_FLAG(std::string, device, "cpu",
          "cpu (the fp32 reference, all cores) or cuda (device 0, bf16 kernels)");
ABSL_FLAG(int, heads, 4, "attention heads of the profiled layer (hidden size = heads x head_dim)");
ABSL_FLAG(int, head_dim, 128, "64 or 128");
ABSL_FLAG(int, block_size, 64, "tokens per attention block: 64 or 128");
ABSL_FLAG(int, local_blocks, 1, "key blocks before the diagonal that every query block keeps");
ABSL_FLAG(std::string, lengths, "2048,4096,8192", "comma-separated document lengths, tokens");
ABSL_FLAG(std::string, densities, "1,0.3,0.1", "comma-separated densities, each in (0, 1]");
ABSL_FLAG(int, repeats, 1, "measurements per grid point; the median is written");
ABSL_FLAG(int, threads, 0,
          "CPU threads (0 = all cores); with 1 the times are the thread's CPU time, as "
          "sb-worker measures, otherwise wall time");
ABSL_FLAG(std::string, out, "", "write the table to this file (default: standard output)");

namespace sparsebalance {
namespace kernels {
namespace {

template <typename T>
absl::StatusOr<std::vector<T>> ParseList(absl::string_view flag, absl::string_view text) {
  std::vector<T> values;
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    T value;
    bool ok;
    if constexpr (std::is_same_v<T, double>) {
      ok = absl::SimpleAtod(item, &value);
    } else {
      ok = absl::SimpleAtoi(item, &value);
    }
    if (!ok) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, ": \"", item, "\" is not a number"));
    }
    values.push_back(value);
  }
  return values;
}

int Main(int argc, char** argv) {
  tools::InitTool(
      argc, argv,
      "measure one transformer layer (forward + backward: block selection, block-sparse\n"
      "attention, QKV/output projections and a 4x MLP) on a grid of document lengths and\n"
      "densities on this machine, and write the profile table that sb-planner and sb-sim read\n"
      "(their --profile flag; format in contract/profile_format.h). The planner scales the\n"
      "figures to the model's shape, so a small --heads keeps CPU runs short.\n\n"
      "  sb-profile --device=cpu --heads=2 --lengths=1024,2048,4096 --out=cpu.profile\n"
      "  sb-profile --device=cuda --heads=32 --lengths=8192,32768,131072 --repeats=3 \\\n"
      "             --out=h100.profile");
  ProfileOptions options;
  options.device = absl::GetFlag(FLAGS_device);
  options.shape.heads = absl::GetFlag(FLAGS_heads);
  options.shape.head_dim = absl::GetFlag(FLAGS_head_dim);
  options.shape.block_size = absl::GetFlag(FLAGS_block_size);
  options.shape.local_blocks = absl::GetFlag(FLAGS_local_blocks);
  options.repeats = absl::GetFlag(FLAGS_repeats);
  options.threads = absl::GetFlag(FLAGS_threads);
  absl::StatusOr<std::vector<int64_t>> lengths =
      ParseList<int64_t>("lengths", absl::GetFlag(FLAGS_lengths));
  absl::StatusOr<std::vector<double>> densities =
      ParseList<double>("densities", absl::GetFlag(FLAGS_densities));
  for (const absl::Status& s : {lengths.status(), densities.status()}) {
    if (!s.ok()) tools::UsageError(s.message());
  }
  options.lengths = *lengths;
  options.densities = *densities;
  if (absl::Status s = ValidateProfileOptions(options); !s.ok()) tools::UsageError(s.message());
  absl::StatusOr<Profile> profile = RunProfile(options, [](const ProfilePoint& p) {
    std::cerr << absl::StrFormat(
        "sb-profile: length %d density %g: %.4f s (attention %.4f s, linear %.4f s, %d blocks)\n",
        p.length, p.density, p.seconds, p.attention_seconds, p.linear_seconds, p.active_blocks);
  });
  if (!profile.ok()) tools::Fatal(profile.status().message());
  const std::string text = FormatProfile(*profile);
  const std::string path = absl::GetFlag(FLAGS_out);
  if (path.empty()) {
    std::cout << text;
    return 0;
  }
  if (absl::Status s = tools::WriteFile(path, text); !s.ok()) {
    tools::Fatal(absl::StrCat("--out: ", s.message()));
  }
  std::cerr << "sb-profile: wrote " << path << "\n";
  return 0;
}

}  // namespace
}  // namespace kernels
}  // namespace sparsebalance

int main(int argc, char** argv) { return sparsebalance::kernels::Main(argc, argv); }
