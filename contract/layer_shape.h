// The shape of one transformer layer's attention: what the planner's cost model, the profile
// table and the kernels' layer runner must agree on (heads, head_dim, block size, local window),
// plus the layer count a step runs. Bounds below are enforced by planner's ValidateConfig.
//
//   ModelShape shape;  shape.heads = 8;  shape.head_dim = 64;  shape.layers = 4;
//   int64_t blocks = ActiveBlocks(4096, 0.3, shape.block_size, shape.local_blocks);
#ifndef SPARSEBALANCE_CONTRACT_LAYER_SHAPE_H_
#define SPARSEBALANCE_CONTRACT_LAYER_SHAPE_H_

namespace sparsebalance {

// The attention shape that the cost model and the kernels share.
struct ModelShape {
  int layers = 32;
  int heads = 32;
  int head_dim = 128;
  int block_size = 64;   // tokens per attention block (64 or 128)
  int local_blocks = 1;  // key blocks before the diagonal that are always kept
};

// Transformer layers, attention heads and elements per head: 4096 each (2^12), an order of
// magnitude above the largest models (~128 layers, 128 heads, head_dim 256), and with
// B <= 128 keeps one block's dense work B^2 x head_dim x heads x layers <= 2^50.
inline constexpr int kMaxLayers = 4096;
inline constexpr int kMaxHeads = 4096;
inline constexpr int kMaxHeadDim = 4096;
// Key blocks before the diagonal that are always kept: 2^24 blocks of >= 64 tokens cover the
// longest document a micro-batch can hold (2^30 tokens); a wider window changes nothing.
inline constexpr int kMaxLocalBlocks = 1 << 24;

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_CONTRACT_LAYER_SHAPE_H_
