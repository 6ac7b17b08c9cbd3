#include "worker/nccl_sync.h"

#include <cstdlib>

#include "absl/strings/str_cat.h"

#ifdef SB_KERNELS_WITH_CUDA
#include <cuda_runtime.h>
#include <nccl.h>
#endif

namespace sparsebalance {

#ifdef SB_KERNELS_WITH_CUDA
namespace {

absl::Status NcclCheck(ncclResult_t result, const char* what) {
  if (result == ncclSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", ncclGetErrorString(result)));
}

class NcclSyncImpl : public NcclSync {
 public:
  ~NcclSyncImpl() override {
    if (comm_ != nullptr) ncclCommDestroy(comm_);
    if (gradients_ != nullptr) cudaFree(gradients_);
    if (scalar_ != nullptr) cudaFree(scalar_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  absl::Status Init(int rank, int ranks, int64_t gradient_bytes) {
    if (std::getenv("NCCL_COMM_ID") == nullptr) {
      return absl::FailedPreconditionError(
          "NCCL_COMM_ID is not set: set it to the same host:port on every rank");
    }
    ncclUniqueId id;
    if (absl::Status s = NcclCheck(ncclGetUniqueId(&id), "ncclGetUniqueId"); !s.ok()) return s;
    if (cudaStreamCreate(&stream_) != cudaSuccess ||
        cudaMalloc(&gradients_, static_cast<size_t>(gradient_bytes)) != cudaSuccess ||
        cudaMalloc(&scalar_, sizeof(double)) != cudaSuccess) {
      return absl::ResourceExhaustedError("NCCL sync: cannot allocate device buffers");
    }
    cudaMemset(gradients_, 0, static_cast<size_t>(gradient_bytes));
    elements_ = gradient_bytes / 2;  // bf16 gradients
    return NcclCheck(ncclCommInitRank(&comm_, ranks, id, rank), "ncclCommInitRank");
  }
  absl::StatusOr<double> AllReduceMax(double value) override {
    cudaMemcpyAsync(scalar_, &value, sizeof value, cudaMemcpyHostToDevice, stream_);
    if (absl::Status s =
            NcclCheck(ncclAllReduce(scalar_, scalar_, 1, ncclFloat64, ncclMax, comm_, stream_),
                      "ncclAllReduce");
        !s.ok()) {
      return s;
    }
    double out = 0.0;
    cudaMemcpyAsync(&out, scalar_, sizeof out, cudaMemcpyDeviceToHost, stream_);
    if (cudaStreamSynchronize(stream_) != cudaSuccess) {
      return absl::InternalError("NCCL sync: stream synchronize failed");
    }
    return out;
  }
  absl::Status AllReduceGradients() override {
    if (absl::Status s = NcclCheck(
            ncclAllReduce(gradients_, gradients_, elements_, ncclBfloat16, ncclSum, comm_, stream_),
            "ncclAllReduce");
        !s.ok()) {
      return s;
    }
    return cudaStreamSynchronize(stream_) == cudaSuccess
               ? absl::OkStatus()
               : absl::InternalError("NCCL sync: stream synchronize failed");
  }

 private:
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  void* gradients_ = nullptr;
  void* scalar_ = nullptr;
  size_t elements_ = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<NcclSync>> NcclSync::Create(int rank, int ranks,
                                                           int64_t gradient_bytes) {
  auto sync = std::make_unique<NcclSyncImpl>();
  if (absl::Status s = sync->Init(rank, ranks, gradient_bytes); !s.ok()) return s;
  return std::unique_ptr<NcclSync>(std::move(sync));
}

absl::Status NcclSync::SelectDevice(int rank) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    cudaGetLastError();
    return absl::FailedPreconditionError("no CUDA device for --device=cuda");
  }
  if (const cudaError_t e = cudaSetDevice(rank % devices); e != cudaSuccess) {
    return absl::InternalError(
        absl::StrCat("cudaSetDevice(", rank % devices, "): ", cudaGetErrorString(e)));
  }
  return absl::OkStatus();
}
#else
absl::StatusOr<std::unique_ptr<NcclSync>> NcclSync::Create(int, int, int64_t) {
  return absl::FailedPreconditionError("NCCL: this build has no CUDA (SB_WITH_CUDA=OFF)");
}

absl::Status NcclSync::SelectDevice(int) {
  return absl::FailedPreconditionError("--device=cuda: this build has no CUDA (SB_WITH_CUDA=OFF)");
}
#endif

}  // namespace sparsebalance
