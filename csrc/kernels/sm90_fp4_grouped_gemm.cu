// Host side of the FP4 grouped GEMM (dispatch to the per-layer instantiation files) and the NVFP4
// requantization kernel between L1 and L2.
#include <cuda.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "kernels/sm90_fp4_grouped_gemm.cuh"
#include "kernels/sm90_fp4_grouped_gemm_layers.hpp"

namespace megamoe::kernels {

void launch_fp4_grouped_gemm(const Fp4GroupedGemmArgs& args, uint8_t* buffer, const layout::BufferLayout& layout,
                             int block_m, int num_sms, cudaStream_t stream) {
  fp4::Params p;
  p.weights_sf = args.weights_sf;
  p.weights_global_sf = args.weights_global_sf;
  p.acts_sf = args.acts_sf;
  p.acts_global_sf = args.acts_global_sf;
  p.scratch = args.scratch;
  p.buffer = buffer;
  p.l = layout;
  p.n = args.n;
  p.k = args.k;
  p.activation_clamp = args.activation_clamp;
  p.fast_math = args.fast_math;
  p.wide_scale_copies = args.k % 256 == 0 && reinterpret_cast<uintptr_t>(args.weights_sf) % 16 == 0;
  p.split_round = args.partials != nullptr ? args.split_round : 0;
  p.partials = args.partials;
  p.split_counters = args.split_counters;
  const bool nv = args.weight_format == WeightFormat::kNVFP4;
  if (nv && args.fp8_mma)
    throw std::runtime_error("megamoe: the FP8-wgmma FP4 path takes MXFP4 weights only (NVFP4 scales are not powers of two)");
  if (args.is_l1) {
    if (nv) fp4::launch_l1_nvfp4(args, p, block_m, num_sms, stream);
    else if (args.fp8_mma) fp4::launch_l1_mxfp4_fp8mma(args, p, block_m, num_sms, stream);
    else fp4::launch_l1_mxfp4(args, p, block_m, num_sms, stream);
  } else {
    if (nv) fp4::launch_l2_nvfp4(args, p, block_m, num_sms, stream);
    else if (args.fp8_mma) fp4::launch_l2_mxfp4_fp8mma(args, p, block_m, num_sms, stream);
    else fp4::launch_l2_mxfp4(args, p, block_m, num_sms, stream);
  }
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
}

// ------------------------------------------------------------------------------------------------
// NVFP4 requantization of the L1 outputs (the per-token global scale spans the whole I row)
// ------------------------------------------------------------------------------------------------
namespace {

constexpr int kRequantThreads = 256;

// One warp per pool row: row amax -> g = amax / (6 * 448); per 16: sf = e4m3(amax_blk / (6 g)),
// codes = e2m1(x / (sf * g)); exactly pre_dispatch's NVFP4 recipe (and the CPU op's).
__global__ void __launch_bounds__(kRequantThreads) nvfp4_requant_kernel(const float* scratch, uint8_t* buffer,
                                                                        layout::BufferLayout l) {
  ptx::grid_dependency_wait();
  ptx::launch_dependents();
  const int rows = __ldcg(reinterpret_cast<const int*>(buffer + l.expert_offset_offset) + l.num_local_experts);
  const int inter = static_cast<int>(l.intermediate);
  const int lane = threadIdx.x % 32;
  const int warps = gridDim.x * kRequantThreads / 32;
  uint8_t* pool = buffer + l.pool_offset;
  uint8_t* pool_sf = buffer + l.pool_sf_offset;
  float* pool_gsf = reinterpret_cast<float*>(buffer + l.pool_global_sf_offset);
  for (int row = (blockIdx.x * kRequantThreads + threadIdx.x) / 32; row < rows; row += warps) {
    const float* src = scratch + int64_t(row) * inter;
    float amax = 0.0f;
    for (int c = lane * 4; c < inter; c += 128) {
      const float4 v = __ldcg(reinterpret_cast<const float4*>(src + c));
      amax = max_nan(amax, max_nan(max_nan(fabsf(v.x), fabsf(v.y)), max_nan(fabsf(v.z), fabsf(v.w))));
    }
    amax = warp_reduce_max<32>(amax);
    const float g = max_nan(amax, kAmaxEps) / (kE2M1Max * kFP8Max);
    for (int b = lane; b < inter / 16; b += 32) {
      float v[16];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float4 x = __ldcg(reinterpret_cast<const float4*>(src + b * 16 + 4 * i));
        v[4 * i] = x.x, v[4 * i + 1] = x.y, v[4 * i + 2] = x.z, v[4 * i + 3] = x.w;
      }
      float bmax = 0.0f;
#pragma unroll
      for (int i = 0; i < 16; ++i) bmax = max_nan(bmax, fabsf(v[i]));
      const __nv_fp8_e4m3 sf(min_nan(bmax / (g * kE2M1Max), kFP8Max));
      const float denom = float(sf) * g;
      uint8_t* dst = pool + int64_t(row) * (inter / 2) + b * 8;
      store_e2m1x8(dst, v, denom);
      store_e2m1x8(dst + 4, v + 8, denom);
      pool_sf[int64_t(b) * l.pool_rows + row] = sf.__x;
    }
    if (lane == 0) pool_gsf[row] = g;
  }
}

}  // namespace

void launch_nvfp4_requant(const float* scratch, uint8_t* buffer, const layout::BufferLayout& layout, int max_rows,
                          int num_sms, cudaStream_t stream) {
  const int warps_per_block = kRequantThreads / 32;
  int blocks = (max_rows + warps_per_block - 1) / warps_per_block;
  blocks = blocks < 1 ? 1 : blocks > num_sms * 8 ? num_sms * 8 : blocks;
  launch_pdl(nvfp4_requant_kernel, dim3(blocks), dim3(kRequantThreads), 0, stream, scratch, buffer, layout);
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace megamoe::kernels
