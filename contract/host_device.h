// SB_HOST_DEVICE marks the contract's inline functions that CUDA kernels call too
// (kernels/cuda_attention_impl.inc): one definition of a rule for the host and the device.
// Outside nvcc it is empty.
#ifndef SPARSEBALANCE_CONTRACT_HOST_DEVICE_H_
#define SPARSEBALANCE_CONTRACT_HOST_DEVICE_H_

#if defined(__CUDACC__)
#define SB_HOST_DEVICE __host__ __device__
#else
#define SB_HOST_DEVICE
#endif

#endif  // SPARSEBALANCE_CONTRACT_HOST_DEVICE_H_
