// The CPU reference's tiles for x86-64 CPUs with AVX2 and FMA; built with -mavx2 -mfma
// (kernels/CMakeLists.txt) and only called after a CPUID check (attention_cpu.cc).
#define SB_TILE_NAMESPACE avx2
#define SB_TILE_VECTOR_BYTES 32
#include "kernels/attention_cpu_tiles.inc"
