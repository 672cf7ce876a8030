// Device pieces shared by the sm90 kernels: error word, reductions, bit-exact quantization helpers
// (the same arithmetic as megamoe/formats.py and csrc/cpu/quant.cpp).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

#include "megamoe/layout/buffer.hpp"
#include "megamoe/ptx/sm90.cuh"

#define MEGAMOE_CUDA_CHECK(expr)                                                                   \
  do {                                                                                             \
    const cudaError_t err_ = (expr);                                                               \
    if (err_ != cudaSuccess)                                                                       \
      throw std::runtime_error(std::string("megamoe: CUDA error '") + cudaGetErrorString(err_) +   \
                               "' at " __FILE__ ":" + std::to_string(__LINE__) + ": " #expr);      \
  } while (0)

namespace megamoe::kernels {

// Launches with programmatic stream serialization: the kernel may start while its predecessor in the
// stream finishes, so every kernel launched this way calls ptx::grid_dependency_wait() before it reads
// anything a predecessor wrote. Captured into CUDA graphs as programmatic edges.
template <typename... KernelArgs, typename... Args>
void launch_pdl(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  config.numAttrs = 1;
  MEGAMOE_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

constexpr float kFP8Max = 448.0f;
constexpr float kE2M1Max = 6.0f;
constexpr float kAmaxEps = 1e-4f;

// First error wins: the CAS on the code word elects the writer of the other fields.
__device__ __forceinline__ void record_error(uint8_t* buffer, const layout::BufferLayout& l, int code,
                                             int64_t value, int token, int slot) {
  int* err = reinterpret_cast<int*>(buffer + l.error_offset);
  if (atomicCAS(err, 0, code) == 0) {
    err[1] = static_cast<int>(value < INT32_MIN ? INT32_MIN : value > INT32_MAX ? INT32_MAX : value);
    err[2] = token;
    err[3] = slot;
  }
}

// Max over groups of kLanes consecutive lanes (kLanes a power of two <= 32).
template <int kLanes>
__device__ __forceinline__ float warp_reduce_max(float v) {
#pragma unroll
  for (int m = kLanes / 2; m >= 1; m /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, m));
  return v;
}

__device__ __forceinline__ void load_bf16x8(const __nv_bfloat16* p, float* v) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat16* b = reinterpret_cast<const __nv_bfloat16*>(&raw);
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = __bfloat162float(b[i]);
}

// Positive float -> next power of two, by bits (exponent + 1 when the mantissa is non-zero).
__device__ __forceinline__ float ceil_pow2(float s) {
  uint32_t bits = __float_as_uint(s);
  uint32_t e = (bits >> 23) & 0xFF;
  e += (bits & 0x7FFFFF) != 0;
  return __uint_as_float(e << 23);
}
__device__ __forceinline__ uint8_t ue8m0_bits(float pow2) { return (__float_as_uint(pow2) >> 23) & 0xFF; }

__device__ __forceinline__ uint8_t to_fp8(float v) {
  v = fminf(fmaxf(v, -kFP8Max), kFP8Max);
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

// 8 values / scale -> 8 E4M3 bytes (true division: bit-exact with the CPU op).
__device__ __forceinline__ void store_fp8x8(uint8_t* dst, const float* v, float scale) {
  uint32_t lo = 0, hi = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) lo |= uint32_t(to_fp8(v[i] / scale)) << (8 * i);
#pragma unroll
  for (int i = 0; i < 4; ++i) hi |= uint32_t(to_fp8(v[4 + i] / scale)) << (8 * i);
  *reinterpret_cast<uint2*>(dst) = make_uint2(lo, hi);
}

// Nearest E2M1 code, ties to even, saturating; sign bit = (x < 0); NaN -> 0.
__device__ __forceinline__ uint32_t e2m1_code(float x) {
  const float m = fabsf(x);
  const uint32_t code = (m > 0.25f) + (m >= 0.75f) + (m > 1.25f) + (m >= 1.75f) + (m > 2.5f) + (m >= 3.5f) +
                        (m > 5.0f);
  return code | (x < 0.0f ? 8u : 0u);
}

// 8 values / scale -> 4 packed bytes (low nibble first); a zero scale gives zero codes.
__device__ __forceinline__ void store_e2m1x8(uint8_t* dst, const float* v, float scale) {
  uint32_t packed = 0;
  if (scale > 0.0f) {
#pragma unroll
    for (int i = 0; i < 8; ++i) packed |= e2m1_code(v[i] / scale) << (4 * i);
  }
  *reinterpret_cast<uint32_t*>(dst) = packed;
}

}  // namespace megamoe::kernels
