// The CPU reference's tiles for any x86-64 (or other) CPU.
#define SB_TILE_NAMESPACE generic
#define SB_TILE_VECTOR_BYTES 16
#include "kernels/attention_cpu_tiles.inc"
