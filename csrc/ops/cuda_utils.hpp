// Host helpers shared by the CUDA op registrations (cuda_ops.cpp: FP8, cuda_fp4_ops.cpp: FP4).
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <cstdlib>
#include <string>

#include "ops/ops.hpp"

namespace megamoe {

// NOTES: ATen/cuda/CUDAContext.h would pull cuBLAS/cuSPARSE headers into the build; the runtime
// attribute queries are all the ops need (and cheap: the driver caches them).
inline int device_attribute(const at::Tensor& t, cudaDeviceAttr attr) {
  int v = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&v, attr, t.device().index()));
  return v;
}

inline std::string arch_name(const at::Tensor& t) {
  return "sm_" + std::to_string(device_attribute(t, cudaDevAttrComputeCapabilityMajor)) +
         std::to_string(device_attribute(t, cudaDevAttrComputeCapabilityMinor));
}

// The kernels are compiled for sm_90a only; say which path another GPU would need.
inline void check_arch(const at::Tensor& t, const char* op) {
  TORCH_CHECK_NOT_IMPLEMENTED(device_attribute(t, cudaDevAttrComputeCapabilityMajor) == 9, op,
                              ": no CUDA kernel for ", arch_name(t), ": megamoe's kernels are built for sm_90a "
                              "(Hopper); other GPUs need the portable mma.sync path, which is not implemented yet");
}

inline int num_sms(const at::Tensor& t) { return device_attribute(t, cudaDevAttrMultiProcessorCount); }

inline uint8_t* buffer_ptr(at::Tensor& buffer) { return buffer.data_ptr<uint8_t>(); }

// MEGAMOE_POISON_WORKSPACES=1 (read per call; tests): the MXFP4 w4a4 fold's per-call workspace starts as 0xFF bytes
// (NaN as E4M3 and as float32), so that a result can only come from values the call itself wrote: the caching
// allocator hands a call the memory the previous one filled. (The other per-call tensors, the split-K partials and
// the NVFP4 scratch, are not poisoned here.)
inline bool poison_workspaces() {
  const char* env = std::getenv("MEGAMOE_POISON_WORKSPACES");
  return env != nullptr && env[0] == '1';
}

}  // namespace megamoe
