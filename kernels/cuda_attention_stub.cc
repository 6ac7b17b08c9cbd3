// kernels/cuda_attention.h for builds without CUDA (SB_WITH_CUDA=OFF or no nvcc): no device,
// and every call says how to get the CUDA kernels.
#include "kernels/cuda_attention.h"

namespace sparsebalance {
namespace kernels {
namespace cuda {
namespace {

absl::Status NotBuilt() {
  return absl::FailedPreconditionError(
      "SparseBalance::kernels was built without CUDA; reconfigure with nvcc on PATH (or "
      "-DSB_WITH_CUDA=ON) to get the GPU kernels, or use --device=cpu");
}

}  // namespace

bool Compiled() { return false; }

int DeviceCount(std::string* why) {
  if (why != nullptr) *why = "built without CUDA";
  return 0;
}

absl::StatusOr<std::string> DeviceName() { return NotBuilt(); }
absl::Status Synchronize(Stream) { return NotBuilt(); }

DeviceBuffer::~DeviceBuffer() = default;
DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept = default;
DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept = default;
absl::StatusOr<DeviceBuffer> DeviceBuffer::Allocate(size_t) { return NotBuilt(); }
absl::Status DeviceBuffer::CopyFromHost(const void*, size_t, Stream) { return NotBuilt(); }
absl::Status DeviceBuffer::CopyToHost(void*, size_t, Stream) const { return NotBuilt(); }
absl::Status DeviceBuffer::Zero(Stream) { return NotBuilt(); }

absl::StatusOr<DeviceBlockIndex> DeviceBlockIndex::Upload(const BlockIndex&, Stream) {
  return NotBuilt();
}

absl::StatusOr<DeviceSelection> SelectBlocks(absl::Span<const int32_t>, int, int, const void*,
                                             const void*, absl::Span<const double>,
                                             const SelectionOptions&, Stream) {
  return NotBuilt();
}

absl::StatusOr<BlockIndex> DeviceBlockIndex::Download(Stream) const { return NotBuilt(); }
absl::StatusOr<Selection> DeviceSelection::Download(Stream) const { return NotBuilt(); }
absl::Status DeviceSelection::DownloadCounts(std::vector<int64_t>*, std::vector<float>*,
                                             Stream) const {
  return NotBuilt();
}

absl::Status Forward(const DeviceBlockIndex&, int, const void*, const void*, const void*, float,
                     void*, float*, Stream, KernelPath) {
  return NotBuilt();
}

absl::Status Backward(const DeviceBlockIndex&, int, const void*, const void*, const void*,
                      const void*, const float*, const void*, float, float*, void*, void*, void*,
                      Stream, KernelPath) {
  return NotBuilt();
}

absl::StatusOr<RecallProbe> ProbeRecall(const DeviceBlockIndex&, int, const void*, const void*,
                                        const RecallRows&, Stream, float) {
  return NotBuilt();
}

absl::Status MatmulBf16(int64_t, int64_t, int64_t, const void*, bool, const void*, bool, void*,
                        Stream) {
  return NotBuilt();
}

}  // namespace cuda
}  // namespace kernels
}  // namespace sparsebalance
