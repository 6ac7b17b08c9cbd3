// The model shape of the tests that run the CPU reference kernels (the layer runner, the
// worker's micro-batch runner): small enough that a layer takes milliseconds.
#ifndef SPARSEBALANCE_TESTS_SUPPORT_SMALL_SHAPE_H_
#define SPARSEBALANCE_TESTS_SUPPORT_SMALL_SHAPE_H_

#include "contract/layer_shape.h"

namespace sparsebalance::test_support {

// `layers` layers of 2 heads x 64, blocks of 64 tokens, one local block.
inline ModelShape SmallShape(int layers = 1) {
  return ModelShape{layers, /*heads=*/2, /*head_dim=*/64, /*block_size=*/64, /*local_blocks=*/1};
}

}  // namespace sparsebalance::test_support

#endif  // SPARSEBALANCE_TESTS_SUPPORT_SMALL_SHAPE_H_
