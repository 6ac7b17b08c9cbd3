#include "kernels/attention_cpu.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/attention_cpu_tiles.h"
#include "kernels/parallel.h"

namespace sparsebalance {
namespace kernels {
namespace {

// Tensors to check: name and size (floats).
using NamedSizes = std::initializer_list<std::pair<const char*, size_t>>;

// Checks the index, head_dim and options, and that every token tensor in `tensors` holds
// total_tokens x heads x head_dim floats and `lse_size` is heads x total_tokens.
absl::Status ValidateArguments(const BlockIndex& index, int head_dim,
                               const AttentionOptions& options, NamedSizes tensors,
                               size_t lse_size) {
  if (absl::Status s = ValidateHeadDim(head_dim); !s.ok()) return s;
  if (absl::Status s = ValidateBlockIndex(index); !s.ok()) return s;
  if (absl::Status s = ValidateThreads(options.threads); !s.ok()) return s;
  if (!(options.softmax_scale >= 0.0f) || !std::isfinite(options.softmax_scale)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "softmax_scale=", options.softmax_scale, " must be positive (or 0 for 1/sqrt(head_dim))"));
  }
  const size_t elements = static_cast<size_t>(index.total_tokens()) * index.heads * head_dim;
  for (auto [name, size] : tensors) {
    if (absl::Status s = CheckSize(name, size, elements); !s.ok()) return s;
  }
  return CheckSize("lse", lse_size, static_cast<size_t>(index.total_tokens()) * index.heads);
}

// Runs `fn` on every (sequence, head), longest sequences first so that the last task to
// finish is a short one.
void RunHeads(const BlockIndex& index, int head_dim, const AttentionOptions& options, bool backward,
              const HeadTask& base, HeadFn fn) {
  const int heads = index.heads;
  std::vector<int> order(index.sequences());
  for (int s = 0; s < index.sequences(); ++s) order[s] = s;
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return index.length(a) > index.length(b); });
  // One workspace per worker that can run: never more workers than tasks (threads may be
  // any int, and each workspace is an object).
  const int64_t tasks = int64_t{index.sequences()} * heads;
  const int workers = static_cast<int>(
      std::min<int64_t>(ResolveThreads(options.threads), std::max<int64_t>(tasks, 1)));
  std::vector<TileWorkspace> workspaces(workers);
  const float scale = options.softmax_scale > 0.0f ? options.softmax_scale
                                                   : 1.0f / std::sqrt(static_cast<float>(head_dim));
  const int64_t stride = int64_t{heads} * head_dim;
  ParallelFor(tasks, workers, [&](int worker, int64_t id) {
    const int s = order[id / heads];
    const int h = static_cast<int>(id % heads);
    const int64_t row0 = index.RowId(s, h, 0);
    const int64_t token0 = index.cu_seqlens[s];
    const int64_t offset = token0 * stride + int64_t{h} * head_dim;
    const int64_t lse_offset = int64_t{h} * index.total_tokens() + token0;
    HeadTask task = base;
    task.block_size = index.block_size;
    task.head_dim = head_dim;
    task.length = index.length(s);
    task.blocks = index.blocks(s);
    task.key_blocks = task.blocks;
    task.scale = scale;
    task.token_stride = stride;
    task.row_ptr = index.row_ptr.data() + row0;
    task.col_idx = index.col_idx.data();
    task.flags = index.flags.data();
    task.col_ptr = index.col_ptr.data() + row0;
    task.row_idx = index.row_idx.data();
    task.col_flags = index.col_flags.data();
    task.SetTensors(base, offset, lse_offset);
    task.workspace = workspaces[worker].Get(
        WorkspaceFloats(index.block_size, head_dim, task.blocks, task.blocks, backward));
    fn(task);
  });
}

// What AttentionForward and AttentionBackward share: checks the arguments (ValidateArguments),
// then runs the forward or backward tiles on every head of `base`'s tensors.
absl::Status CheckAndRunHeads(const BlockIndex& index, int head_dim,
                              const AttentionOptions& options, NamedSizes tensors, size_t lse_size,
                              bool backward, const HeadTask& base) {
  if (absl::Status s = ValidateArguments(index, head_dim, options, tensors, lse_size); !s.ok()) {
    return s;
  }
  RunHeads(index, head_dim, options, backward, base, backward ? BackwardHeadFn() : ForwardHeadFn());
  return absl::OkStatus();
}

// A task with the inputs both passes read (q, k, v); the caller adds its own tensors.
HeadTask InputTask(absl::Span<const float> q, absl::Span<const float> k,
                   absl::Span<const float> v) {
  HeadTask task;
  task.q = q.data();
  task.k = k.data();
  task.v = v.data();
  return task;
}

}  // namespace

#if defined(SB_KERNELS_HAVE_AVX2_TILES)
namespace {

// Whether this CPU runs the AVX2 tile code (built on x86-64 only: kernels/CMakeLists.txt).
bool UseAvx2() {
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return avx2;
}

}  // namespace
#endif

HeadFn ForwardHeadFn() {
#if defined(SB_KERNELS_HAVE_AVX2_TILES)
  if (UseAvx2()) return &avx2::ForwardHead;
#endif
  return &generic::ForwardHead;
}

HeadFn BackwardHeadFn() {
#if defined(SB_KERNELS_HAVE_AVX2_TILES)
  if (UseAvx2()) return &avx2::BackwardHead;
#endif
  return &generic::BackwardHead;
}

int64_t WorkspaceFloats(int block_size, int head_dim, int32_t query_blocks, int32_t key_blocks,
                        bool backward) {
  auto align = [](int64_t n) { return (n + 15) / 16 * 16; };
  const int64_t b = block_size;
  const int64_t q_padded = int64_t{query_blocks} * b;
  const int64_t k_padded = int64_t{key_blocks} * b;
  if (!backward) {
    return 2 * align(k_padded * head_dim) + 2 * align(b * head_dim) + align(b * b) + 2 * align(b);
  }
  return 3 * align(q_padded * head_dim) + 3 * align(k_padded * head_dim) + 2 * align(q_padded) +
         2 * align(b * b) + 2 * align(b * head_dim);
}

absl::Status AttentionForward(const BlockIndex& index, int head_dim, absl::Span<const float> q,
                              absl::Span<const float> k, absl::Span<const float> v,
                              const AttentionOptions& options, absl::Span<float> out,
                              absl::Span<float> lse) {
  HeadTask base = InputTask(q, k, v);
  base.out_w = out.data();
  base.lse_w = lse.data();
  return CheckAndRunHeads(index, head_dim, options,
                          {{"q", q.size()}, {"k", k.size()}, {"v", v.size()}, {"out", out.size()}},
                          lse.size(), /*backward=*/false, base);
}

absl::Status AttentionBackward(const BlockIndex& index, int head_dim, absl::Span<const float> q,
                               absl::Span<const float> k, absl::Span<const float> v,
                               absl::Span<const float> out, absl::Span<const float> lse,
                               absl::Span<const float> dout, const AttentionOptions& options,
                               absl::Span<float> dq, absl::Span<float> dk, absl::Span<float> dv) {
  HeadTask base = InputTask(q, k, v);
  base.out = out.data();
  base.dout = dout.data();
  base.lse_in = lse.data();
  base.dq = dq.data();
  base.dk = dk.data();
  base.dv = dv.data();
  return CheckAndRunHeads(index, head_dim, options,
                          {{"q", q.size()},
                           {"k", k.size()},
                           {"v", v.size()},
                           {"out", out.size()},
                           {"dout", dout.size()},
                           {"dq", dq.size()},
                           {"dk", dk.size()},
                           {"dv", dv.size()}},
                          lse.size(), /*backward=*/true, base);
}

double ForwardFlopsPerBlock(int block_size, int head_dim) {
  return 4.0 * block_size * block_size * head_dim;
}

double BackwardFlopsPerBlock(int block_size, int head_dim) {
  return 2.5 * ForwardFlopsPerBlock(block_size, head_dim);
}

}  // namespace kernels
}  // namespace sparsebalance
