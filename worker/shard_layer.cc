#include "worker/shard_layer.h"

#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace sparsebalance {
namespace {

// Accumulates the wall and thread CPU time of one exchange section.
class ExchangeTimer {
 public:
  explicit ExchangeTimer(ShardLayerResult* r)
      : r_(r), wall_(std::chrono::steady_clock::now()), cpu_(ThreadCpuSeconds()) {}
  ~ExchangeTimer() {
    r_->exchange_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_).count();
    r_->exchange_cpu_seconds += ThreadCpuSeconds() - cpu_;
  }

 private:
  ShardLayerResult* r_;
  std::chrono::steady_clock::time_point wall_;
  double cpu_;
};

template <typename T>
void Append(std::string* out, const T* data, size_t count) {
  out->append(reinterpret_cast<const char*>(data), count * sizeof(T));
}

// `count` values of T at `*offset` of `bytes`, advancing it; false when too short.
template <typename T>
bool Take(const std::string& bytes, size_t* offset, T* data, size_t count) {
  if (*offset > bytes.size() || bytes.size() - *offset < count * sizeof(T)) return false;
  std::memcpy(data, bytes.data() + *offset, count * sizeof(T));
  *offset += count * sizeof(T);
  return true;
}

absl::Status Malformed(const ShardLayerInput& in, int peer, ExchangeKind kind,
                       const std::string& why) {
  ExchangeKey key = in.key;
  key.kind = kind;
  return absl::DataLossError(absl::StrCat("shard exchange: ", key.ToString(), " from rank ", peer,
                                          " to rank ", in.group[in.shard_index], ": ", why));
}

}  // namespace

double ThreadCpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

uint64_t MaxShardPayloadBytes(int64_t max_document_tokens, int heads, int head_dim) {
  const uint64_t tokens = static_cast<uint64_t>(std::max<int64_t>(max_document_tokens, 0));
  const uint64_t stride =
      static_cast<uint64_t>(std::max(heads, 0)) * static_cast<uint64_t>(std::max(head_dim, 0));
  uint64_t bytes = 0;
  // Saturates rather than wraps: a bound too large refuses nothing a peer sends.
  if (__builtin_mul_overflow(tokens, stride, &bytes) ||
      __builtin_mul_overflow(bytes, 2 * sizeof(float), &bytes) ||
      __builtin_add_overflow(bytes, 2 * sizeof(int32_t), &bytes)) {
    return std::numeric_limits<uint64_t>::max();
  }
  return bytes;
}

absl::StatusOr<ShardLayerResult> RunShardLayer(ShardExchange& exchange, const ShardLayerInput& in) {
  const int shards = static_cast<int>(in.group.size());
  const int j = in.shard_index;
  if (shards < 2 || j < 0 || j >= shards) {
    return absl::InvalidArgumentError(absl::StrCat("shard_index=", j, " with a group of ", shards,
                                                   " ranks (a split document has 2 or more)"));
  }
  if (in.group[j] != exchange.rank()) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard_group[", j, "]=", in.group[j], " but this is rank ", exchange.rank()));
  }
  const int block_size = in.selection.block_size;
  if (absl::Status s =
          kernels::ValidateShardRange(in.document_length, in.shard_begin, in.shard_end, block_size);
      !s.ok()) {
    return s;
  }
  if ((j == 0) != (in.shard_begin == 0) ||
      (j == shards - 1) != (in.shard_end == in.document_length)) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard ", j, " of ", shards, " covers [", in.shard_begin, ", ", in.shard_end,
                     ") of a document of ", in.document_length,
                     " tokens: the first shard starts at 0, the last ends at the end"));
  }
  const int32_t tokens = in.shard_end - in.shard_begin;
  const int64_t stride = int64_t{in.heads} * in.head_dim;
  const size_t elements = static_cast<size_t>(tokens * stride);
  if (in.q.size() != elements || in.k.size() != elements || in.v.size() != elements ||
      (!in.dout.empty() && in.dout.size() != elements)) {
    return absl::InvalidArgumentError(absl::StrCat("q, k, v (and dout) must hold ", elements,
                                                   " values: ", tokens, " tokens x ", in.heads,
                                                   " heads x ", in.head_dim));
  }
  auto key_of = [&](ExchangeKind kind) {
    ExchangeKey key = in.key;
    key.kind = kind;
    return key;
  };
  ShardLayerResult r;

  // 1. Pooled keys: mine to the later shards, the earlier ones' from them, in rank order.
  absl::StatusOr<std::vector<float>> mine =
      kernels::PoolKeyBlocks(tokens, in.heads, in.head_dim, block_size, in.k);
  if (!mine.ok()) return mine.status();
  std::vector<int32_t> cuts = {0};  // cuts[o] for o <= j, then shard_end
  std::vector<float> pooled;
  {
    ExchangeTimer timer(&r);
    if (j + 1 < shards) {
      std::string payload;
      const int32_t range[2] = {in.shard_begin, in.shard_end};
      Append(&payload, range, 2);
      Append(&payload, mine->data(), mine->size());
      for (int o = j + 1; o < shards; ++o) {
        if (absl::Status s = exchange.Send(in.group[o], key_of(ExchangeKind::kPooledKeys), payload);
            !s.ok()) {
          return s;
        }
      }
    }
    for (int o = 0; o < j; ++o) {
      absl::StatusOr<std::string> got =
          exchange.Receive(in.group[o], key_of(ExchangeKind::kPooledKeys));
      if (!got.ok()) return got.status();
      size_t at = 0;
      int32_t range[2];
      if (!Take(*got, &at, range, 2) || range[0] != cuts.back() || range[1] <= range[0] ||
          range[1] > in.shard_begin) {
        return Malformed(in, in.group[o], ExchangeKind::kPooledKeys,
                         absl::StrCat("its token range does not continue at ", cuts.back()));
      }
      const size_t values = (got->size() - at) / sizeof(float);
      const size_t want =
          static_cast<size_t>((range[1] - range[0] + block_size - 1) / block_size * stride);
      if (values != want || (got->size() - at) % sizeof(float) != 0) {
        return Malformed(in, in.group[o], ExchangeKind::kPooledKeys,
                         absl::StrCat(values, " pooled values, expected ", want));
      }
      const size_t first = pooled.size();
      pooled.resize(first + values);
      Take(*got, &at, pooled.data() + first, values);
      cuts.push_back(range[1]);
    }
    if (cuts.back() != in.shard_begin) {
      return absl::InvalidArgumentError(absl::StrCat("shard ", j, " begins at ", in.shard_begin,
                                                     " but the earlier shards end at ",
                                                     cuts.back()));
    }
  }
  pooled.insert(pooled.end(), mine->begin(), mine->end());
  cuts.push_back(in.shard_end);
  absl::StatusOr<kernels::ShardSelection> selection =
      kernels::SelectShardBlocks(in.document_length, in.shard_begin, in.shard_end, in.heads,
                                 in.head_dim, in.q, pooled, in.density, in.selection);
  if (!selection.ok()) return selection.status();
  r.selection = *std::move(selection);

  // 2. Key/value blocks: ask the earlier owners, serve the later shards, receive.
  std::vector<std::vector<int32_t>> needed(j);
  for (int o = 0; o < j; ++o) {
    absl::StatusOr<std::vector<int32_t>> blocks =
        kernels::NeededKeyBlocks(r.selection, cuts[o], cuts[o + 1]);
    if (!blocks.ok()) return blocks.status();
    needed[o] = *std::move(blocks);
  }
  // The rows [first, last) of an owner's chunk [chunk_begin, chunk_end) that block b holds.
  auto rows_of = [&](int32_t b, int32_t chunk_begin, int32_t chunk_end) {
    const int64_t first = int64_t{b} * block_size - chunk_begin;
    const int64_t last = std::min<int64_t>(first + block_size, chunk_end - chunk_begin);
    return std::pair<int64_t, int64_t>(first, last);
  };
  std::vector<std::vector<int32_t>> served(shards);  // blocks each later shard asked of me
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<std::vector<float>> chunk_k(j), chunk_v(j);
  {
    ExchangeTimer timer(&r);
    for (int o = 0; o < j; ++o) {
      std::string payload;
      Append(&payload, needed[o].data(), needed[o].size());
      if (absl::Status s = exchange.Send(in.group[o], key_of(ExchangeKind::kKeyRequest), payload);
          !s.ok()) {
        return s;
      }
    }
    const int32_t my_first = in.shard_begin / block_size;
    const int32_t my_end = (in.shard_end + block_size - 1) / block_size;
    for (int o = j + 1; o < shards; ++o) {
      absl::StatusOr<std::string> got =
          exchange.Receive(in.group[o], key_of(ExchangeKind::kKeyRequest));
      if (!got.ok()) return got.status();
      if (got->size() % sizeof(int32_t) != 0) {
        return Malformed(in, in.group[o], ExchangeKind::kKeyRequest, "not a list of blocks");
      }
      std::vector<int32_t> blocks(got->size() / sizeof(int32_t));
      size_t at = 0;
      Take(*got, &at, blocks.data(), blocks.size());
      std::string payload;
      for (size_t x = 0; x < blocks.size(); ++x) {
        if (blocks[x] < my_first || blocks[x] >= my_end || (x > 0 && blocks[x] <= blocks[x - 1])) {
          return Malformed(in, in.group[o], ExchangeKind::kKeyRequest,
                           absl::StrCat("block ", blocks[x], " is not ascending in my blocks [",
                                        my_first, ", ", my_end, ")"));
        }
        const auto [first, last] = rows_of(blocks[x], in.shard_begin, in.shard_end);
        Append(&payload, in.k.data() + first * stride,
               static_cast<size_t>((last - first) * stride));
        Append(&payload, in.v.data() + first * stride,
               static_cast<size_t>((last - first) * stride));
      }
      served[o] = std::move(blocks);
      if (absl::Status s = exchange.Send(in.group[o], key_of(ExchangeKind::kKeyValues), payload);
          !s.ok()) {
        return s;
      }
    }
    for (int o = 0; o < j; ++o) {
      absl::StatusOr<std::string> got =
          exchange.Receive(in.group[o], key_of(ExchangeKind::kKeyValues));
      if (!got.ok()) return got.status();
      const size_t chunk = static_cast<size_t>((cuts[o + 1] - cuts[o]) * stride);
      chunk_k[o].assign(chunk, nan);
      chunk_v[o].assign(chunk, nan);
      size_t at = 0;
      for (int32_t b : needed[o]) {
        const auto [first, last] = rows_of(b, cuts[o], cuts[o + 1]);
        const size_t n = static_cast<size_t>((last - first) * stride);
        if (!Take(*got, &at, chunk_k[o].data() + first * stride, n) ||
            !Take(*got, &at, chunk_v[o].data() + first * stride, n)) {
          return Malformed(in, in.group[o], ExchangeKind::kKeyValues,
                           "too short for the blocks asked");
        }
      }
      if (at != got->size()) {
        return Malformed(in, in.group[o], ExchangeKind::kKeyValues, "longer than the blocks asked");
      }
      r.key_value_bytes_received += static_cast<int64_t>(got->size());
    }
  }
  auto k_of = [&](int o) { return o == j ? in.k : absl::MakeConstSpan(chunk_k[o]); };
  auto v_of = [&](int o) { return o == j ? in.v : absl::MakeConstSpan(chunk_v[o]); };

  // 3. Forward per chunk, merged; then backward per chunk.
  r.out.assign(elements, 0.0f);
  r.lse.assign(static_cast<size_t>(tokens) * in.heads, -std::numeric_limits<float>::infinity());
  std::vector<float> out_part(elements), lse_part(r.lse.size());
  for (int o = 0; o <= j; ++o) {
    if (absl::Status s = kernels::ShardForwardChunk(
            r.selection, in.head_dim, in.q, cuts[o], cuts[o + 1], k_of(o), v_of(o), in.attention,
            absl::MakeSpan(out_part), absl::MakeSpan(lse_part));
        !s.ok()) {
      return s;
    }
    if (absl::Status s =
            kernels::MergeAttentionPartial(tokens, in.heads, in.head_dim, out_part, lse_part,
                                           absl::MakeSpan(r.out), absl::MakeSpan(r.lse));
        !s.ok()) {
      return s;
    }
  }
  if (in.dout.empty()) {
    // Forward only: the later shards still ask for keys and values, served above.
    return r;
  }
  r.dq.assign(elements, 0.0f);
  r.dk.assign(elements, 0.0f);
  r.dv.assign(elements, 0.0f);
  std::vector<std::vector<float>> dk_sent(j), dv_sent(j);
  for (int o = 0; o <= j; ++o) {
    absl::Span<float> dk = absl::MakeSpan(r.dk), dv = absl::MakeSpan(r.dv);
    if (o != j) {
      dk_sent[o].assign(chunk_k[o].size(), 0.0f);
      dv_sent[o].assign(chunk_v[o].size(), 0.0f);
      dk = absl::MakeSpan(dk_sent[o]);
      dv = absl::MakeSpan(dv_sent[o]);
    }
    if (absl::Status s = kernels::ShardBackwardChunk(
            r.selection, in.head_dim, in.q, cuts[o], cuts[o + 1], k_of(o), v_of(o), r.out, r.lse,
            in.dout, in.attention, absl::MakeSpan(r.dq), dk, dv);
        !s.ok()) {
      return s;
    }
  }

  // 4. Gradients of the received blocks back to their owners; add the later shards' to mine.
  {
    ExchangeTimer timer(&r);
    for (int o = 0; o < j; ++o) {
      std::string payload;
      for (int32_t b : needed[o]) {
        const auto [first, last] = rows_of(b, cuts[o], cuts[o + 1]);
        const size_t n = static_cast<size_t>((last - first) * stride);
        Append(&payload, dk_sent[o].data() + first * stride, n);
        Append(&payload, dv_sent[o].data() + first * stride, n);
      }
      if (absl::Status s = exchange.Send(in.group[o], key_of(ExchangeKind::kGradients), payload);
          !s.ok()) {
        return s;
      }
    }
    std::vector<float> rows;
    for (int o = j + 1; o < shards; ++o) {
      absl::StatusOr<std::string> got =
          exchange.Receive(in.group[o], key_of(ExchangeKind::kGradients));
      if (!got.ok()) return got.status();
      size_t at = 0;
      for (int32_t b : served[o]) {
        const auto [first, last] = rows_of(b, in.shard_begin, in.shard_end);
        const size_t n = static_cast<size_t>((last - first) * stride);
        rows.resize(2 * n);
        if (!Take(*got, &at, rows.data(), 2 * n)) {
          return Malformed(in, in.group[o], ExchangeKind::kGradients,
                           "too short for the blocks sent");
        }
        float* dk = r.dk.data() + first * stride;
        float* dv = r.dv.data() + first * stride;
        for (size_t x = 0; x < n; ++x) {
          dk[x] += rows[x];
          dv[x] += rows[n + x];
        }
      }
      if (at != got->size()) {
        return Malformed(in, in.group[o], ExchangeKind::kGradients, "longer than the blocks sent");
      }
    }
  }
  return r;
}

}  // namespace sparsebalance
