// kernels/cuda_emulated.h: the kernels of kernels/cuda_attention_impl.inc built as host code,
// with `rt` on the emulator of kernels/cuda_emulator.h.
#include "kernels/cuda_emulated.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "contract/block_geometry.h"
#include "kernels/block_selection.h"
#include "kernels/cuda_portable.h"

namespace sparsebalance {
namespace kernels {
namespace cuda_emulated {
namespace rt {

using Dim3 = emu::Index3;

int DeviceCount(std::string* why) {
  if (why != nullptr) why->clear();
  return 1;
}

absl::StatusOr<std::string> DeviceName() {
  return std::string("host emulator (kernels/cuda_emulator.h)");
}

// The emulator runs every launch and copy to completion before returning.
absl::Status Synchronize(Stream) { return absl::OkStatus(); }

absl::Status Allocate(void** pointer, size_t bytes) {
  *pointer = emu::Allocate(bytes);
  if (*pointer == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("emulated cudaMalloc of ", bytes, " bytes"));
  }
  return absl::OkStatus();
}

void Free(void* pointer) { emu::Free(pointer); }

// Every launch has finished when it returns: stream order is program order.
absl::Status AllocateAsync(void** pointer, size_t bytes, Stream) {
  return Allocate(pointer, bytes);
}

void FreeAsync(void* pointer, Stream) { emu::Free(pointer); }

absl::Status CopyToDevice(void* dst, const void* src, size_t bytes, Stream) {
  emu::CopyToDevice(dst, src, bytes);
  return absl::OkStatus();
}

absl::Status CopyToHost(void* dst, const void* src, size_t bytes, Stream) {
  emu::CopyToHost(dst, src, bytes);
  return absl::OkStatus();
}

absl::Status Zero(void* pointer, size_t bytes, Stream) {
  std::fill_n(static_cast<unsigned char*>(pointer), bytes, 0);
  return absl::OkStatus();
}

// As the CUDA build's: raises the kernel's shared memory limit to `shared` bytes (the driver
// refuses more than 227 KiB), then runs it.
template <typename... Params, typename... Args>
absl::Status Launch(const char* name, void (*kernel)(Params...), Dim3 grid, Dim3 block,
                    size_t shared, Stream, Args... args) {
  emu::LaunchShape shape;
  shape.grid = grid;
  shape.block = block;
  shape.dynamic_shared = shared;
  shape.shared_limit = std::max<size_t>(48 * 1024, std::min(shared, emu::kMaxDynamicSharedMemory));
  return emu::Run(name, shape, [&] { kernel(args...); });
}

// cublasGemmEx's contract for bf16 inputs and output with fp32 accumulation, column-major:
// C (rows x cols, ldc) = op(A) (rows x depth) * op(B) (depth x cols).
absl::Status GemmColumnMajorBf16(bool a_transposed, bool b_transposed, int64_t rows, int64_t cols,
                                 int64_t depth, const void* a, int64_t lda, const void* b,
                                 int64_t ldb, void* c, int64_t ldc, Stream) {
  const auto* x = static_cast<const emu::Bf16*>(a);
  const auto* y = static_cast<const emu::Bf16*>(b);
  auto* z = static_cast<emu::Bf16*>(c);
  for (int64_t j = 0; j < cols; ++j) {
    for (int64_t i = 0; i < rows; ++i) {
      float sum = 0.0f;
      for (int64_t l = 0; l < depth; ++l) {
        const float av = emu::ToFloat(a_transposed ? x[l + i * lda] : x[i + l * lda]);
        const float bv = emu::ToFloat(b_transposed ? y[j + l * ldb] : y[l + j * ldb]);
        sum += av * bv;
      }
      z[i + j * ldc] = emu::ToBf16(sum);
    }
  }
  return absl::OkStatus();
}

}  // namespace rt

#include "kernels/cuda_attention_impl.inc"

}  // namespace cuda_emulated
}  // namespace kernels
}  // namespace sparsebalance
