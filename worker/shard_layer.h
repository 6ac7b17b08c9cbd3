// One layer's attention of one shard of a document split over a group of CPU ranks (context
// parallelism, issue 15), with the real exchange (worker/shard_exchange.h): the recipe of
// kernels::ShardedAttentionReference with each rank running only its own shard. Rank j of
// the group (shard j, tokens [shard_begin, shard_end) of the document):
//   1. pools its keys and sends them, with its token range, to the later shards; receives the
//      earlier shards' (ascending) and selects its blocks (SelectShardBlocks: the unsplit
//      selection's rows);
//   2. sends each earlier owner the key blocks of its chunk it keeps (NeededKeyBlocks),
//      answers the later shards' requests with its keys and values of those blocks, receives
//      the blocks it asked for;
//   3. forward per owner chunk, merged exactly (MergeAttentionPartial); backward per chunk;
//   4. sends the key/value gradients of the blocks it received back to their owners and adds
//      the ones the later shards send for its own tokens.
// Every send precedes the receives that depend on it, and receives are buffered by the
// exchange, so any ranks running the same sharded samples in the same order cannot deadlock.
// Exchange time is the wall time of steps' sends and receives (packing included).
//
//   ShardLayerInput in;  // key, group, shard_index, ranges, shape, density, q/k/v/dout rows
//   absl::StatusOr<ShardLayerResult> r = RunShardLayer(*exchange, in);
#ifndef SPARSEBALANCE_WORKER_SHARD_LAYER_H_
#define SPARSEBALANCE_WORKER_SHARD_LAYER_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/attention_cpu.h"
#include "kernels/block_selection.h"
#include "kernels/shard_attention.h"
#include "worker/shard_exchange.h"

namespace sparsebalance {

struct ShardLayerInput {
  ExchangeKey key;         // step, micro-batch, sample id and layer (the kind is set per message)
  std::vector<int> group;  // rank of each shard, ring order; group[shard_index] is this rank
  int shard_index = 0;
  int32_t document_length = 0;
  int32_t shard_begin = 0;  // a multiple of the block size
  int32_t shard_end = 0;
  int heads = 0;
  int head_dim = 0;
  double density = 1.0;
  kernels::SelectionOptions selection;
  kernels::AttentionOptions attention;
  // This shard's rows: [shard tokens, heads, head_dim]; dout empty: forward only.
  absl::Span<const float> q, k, v, dout;
};

struct ShardLayerResult {
  kernels::ShardSelection selection;
  std::vector<float> out;         // [shard tokens, heads, head_dim]
  std::vector<float> lse;         // [heads, shard tokens]
  std::vector<float> dq;          // like out (empty without dout)
  std::vector<float> dk, dv;      // of this rank's tokens, summed over every shard that sees them
  double exchange_seconds = 0.0;  // wall time of the exchange (sends, receives, packing)
  double exchange_cpu_seconds = 0.0;     // this thread's CPU time inside it
  int64_t key_value_bytes_received = 0;  // keys and values of other owners' blocks (fp32)
};

absl::StatusOr<ShardLayerResult> RunShardLayer(ShardExchange& exchange, const ShardLayerInput& in);

// The largest payload RunShardLayer sends for documents of at most `max_document_tokens`
// tokens of `heads` x `head_dim`, bytes: the fp32 keys and values (or their gradients) of a
// whole earlier chunk, 2 x tokens x heads x head_dim x 4, plus the 8 bytes of a token range
// (the other kinds are smaller). A job's exchange refuses frames beyond it
// (ShardExchangeOptions::max_payload_bytes).
uint64_t MaxShardPayloadBytes(int64_t max_document_tokens, int heads, int head_dim);

// The calling thread's CPU time, seconds.
double ThreadCpuSeconds();

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_WORKER_SHARD_LAYER_H_
