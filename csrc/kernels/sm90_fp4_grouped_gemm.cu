// Host side of the FP4 grouped GEMM (dispatch to the per-layer instantiation files) and the NVFP4
// requantization kernel between L1 and L2.
#include <algorithm>

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
  p.weights_row_exp = args.weights_row_exp;
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
  p.scale_tiles = args.scale_tiles;
  p.scale_tma = args.scale_tma;
  p.narrow_mma = heuristics::fp4_narrow_mma();
  p.split_round = args.partials != nullptr ? args.split_round : 0;
  p.partials = args.partials;
  p.split_counters = args.split_counters;
  p.folded_tokens = args.folded_tokens;
  p.fold_output = args.fold_output;
  p.rotate_rounds = args.rotate_rounds;
  p.fold_out = args.fold_out;
  p.fold_out_factors = args.fold_out_factors;
  if (args.out_fp4 && args.fold_output && (args.fold_out == nullptr || args.fold_out_factors == nullptr))
    throw std::runtime_error("megamoe: L1's folded MXFP4 output needs its workspace (fold_out, fold_out_factors)");
  if ((args.folded_tokens || args.fold_output) && (!args.fp8_mma || args.recipe != ActRecipe::kFP8UE8M0Block32))
    throw std::runtime_error("megamoe: folded tokens are for the FP8-wgmma FP4 path with FP8 tokens");
  if (args.fold_output && !args.is_l1) throw std::runtime_error("megamoe: fold_output is for L1 (its epilogue)");
  const bool nv = args.weight_format == WeightFormat::kNVFP4;
  if (nv && args.fp8_mma)
    throw std::runtime_error("megamoe: the FP8-wgmma FP4 path takes MXFP4 weights only (NVFP4 scales are not powers of two)");
  if (args.fp8_mma && args.weights_row_exp == nullptr)
    throw std::runtime_error("megamoe: the FP8-wgmma FP4 path needs the weights' row exponents (transform_weights)");
  if (args.is_l1) {
    if (nv) fp4::launch_l1_nvfp4(args, p, block_m, num_sms, stream);
    else if (args.fp8_mma && args.out_fp4) fp4::launch_l1_mxfp4_fold(args, p, block_m, num_sms, stream);
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

constexpr int kRequantMaxThreads = 1024;

// Quantizes one 16-element block of a row (a thread's 16 floats) with the row's global scale g into the pool.
__device__ __forceinline__ void requant_block(const float (&v)[16], float g, uint8_t* pool_row, uint8_t* pool_sf,
                                              int b, int row, int pool_rows) {
  const __nv_fp8_e4m3 sf = nvfp4_block_scale(v, g);
  const float denom = float(sf) * g;
  store_e2m1x8(pool_row + b * 8, v, denom);
  store_e2m1x8(pool_row + b * 8 + 4, v + 8, denom);
  pool_sf[int64_t(b) * pool_rows + row] = sf.__x;
}

// One CTA per pool row, one thread per 16-element block: row amax (CTA reduction) -> g = amax / (6 * 448); per 16:
// sf = e4m3(amax_blk / (6 g)), codes = e2m1(x / (sf * g)); exactly pre_dispatch's NVFP4 recipe (and the CPU op's).
// NOTES: the earlier form (one warp per row, 64 elements per lane) was bound by each lane's serial chain of ~2,800
// instructions (16 IEEE divisions per block): ncu 11.2 µs alone at V4-Flash T=16 (96 rows, 2 warps per scheduler),
// and 35 µs from L1's end in a graph replay, where L2's weight prefetch runs beside it (H100, 2026-11-26). A whole
// row at once in one warp's registers did not help (-1 %): the chain per lane was the same.
__global__ void __launch_bounds__(kRequantMaxThreads) nvfp4_requant_kernel(const float* scratch, uint8_t* buffer,
                                                                           layout::BufferLayout l) {
  ptx::grid_dependency_wait();
  ptx::launch_dependents();
  __shared__ float warp_amax[2][kRequantMaxThreads / 32];
  const int rows = __ldcg(reinterpret_cast<const int*>(buffer + l.expert_offset_offset) + l.num_local_experts);
  const int inter = static_cast<int>(l.intermediate), blocks = inter / 16;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  uint8_t* pool = buffer + l.pool_offset;
  uint8_t* pool_sf = buffer + l.pool_sf_offset;
  float* pool_gsf = reinterpret_cast<float*>(buffer + l.pool_global_sf_offset);
  const int pool_rows = static_cast<int>(l.pool_rows);
  for (int row = blockIdx.x, it = 0; row < rows; row += gridDim.x, it ^= 1) {
    const float* src = scratch + int64_t(row) * inter;
    uint8_t* pool_row = pool + int64_t(row) * (inter / 2);
    const int b0 = threadIdx.x;
    float v[16] = {};
    if (b0 < blocks) load_floats_cg(src + b0 * 16, v);
    float amax = abs_max(v);
    for (int b = b0 + blockDim.x; b < blocks; b += blockDim.x) {  // rows past 16 x 1,024 elements only
      float w[16];
      load_floats_cg(src + b * 16, w);
      amax = abs_max(w, amax);
    }
    amax = warp_reduce_max<32>(amax);
    if (lane == 0) warp_amax[it][warp] = amax;
    __syncthreads();  // double-buffered by `it`: the next row's writes cannot race this row's reads
    amax = 0.0f;
    for (int w = 0; w < warps; ++w) amax = max_nan(amax, warp_amax[it][w]);
    const float g = nvfp4_global_scale(amax);
    if (b0 < blocks) requant_block(v, g, pool_row, pool_sf, b0, row, pool_rows);
    for (int b = b0 + blockDim.x; b < blocks; b += blockDim.x) {
      load_floats_cg(src + b * 16, v);
      requant_block(v, g, pool_row, pool_sf, b, row, pool_rows);
    }
    if (threadIdx.x == 0) pool_gsf[row] = g;
  }
}

// The 4 UE8M0 scale bytes of (row, 128-K group g) from K-block-major scales [k / 32, pool_rows], quarter q in byte q
// (the fold passes' scales4).
__device__ __forceinline__ uint32_t group_scales4(const uint8_t* sf, int g, int64_t pool_rows, int row) {
  uint32_t scales4 = 0;
#pragma unroll
  for (int q = 0; q < 4; ++q) scales4 |= uint32_t(__ldcg(sf + int64_t(4 * g + q) * pool_rows + row)) << (8 * q);
  return scales4;
}

// L2's FP8 input folded after a block_m 128 L1 (heuristics::fp4_tile_n: a 128-row tile writes 64 outputs, half of
// L2's 128-K group, so its epilogue cannot fold): a warp per row at a time folds its groups in place through its
// shared-memory stage (warp_fold_fp8_groups: the gather's fold_fp8_group, the same bits as the L1 epilogue's folded
// copy-out) and stores their factors 2^(T - 127) in factors [inter / 128, pool_rows].
// NOTES: a thread per (row, group), rows fastest, read and wrote 128 bytes per thread at the row stride (a warp
// instruction over 32 rows' lines). H100 graph timelines (2026-11-27, V4-Flash MXFP4 w4a8 T=8192: 49k rows of 2 KB):
// the pass ran ~139 µs after L1's end, ~107 with the stage. A/B of the stage (2 rounds, MXFP4 w4a8 / w4a4, both models,
// T = 2048-8192, over the direct build; docs/bench/h100-2026-11-27c-ab-pool-fold-staged.json): per replay 0.969-1.022,
// in a graph 0.983-1.015 (V4-Flash w4a4 8192 0.969 / 0.983). The scale bytes and factors (K-block-major: a row's
// are pool_rows apart) are now the strided accesses: a few MB, which L2 absorbs.
constexpr int kFoldPassThreads = 256;
__global__ void __launch_bounds__(kFoldPassThreads, 2) pool_fold_kernel(uint8_t* buffer, layout::BufferLayout l,
                                                                        float* factors) {
  __shared__ uint4 stage_all[kFoldPassThreads / 32][8 * kFoldStageGroups];
  uint4* stage = stage_all[threadIdx.x / 32];
  ptx::grid_dependency_wait();  // L1's outputs
  ptx::launch_dependents();
  const int rows = __ldcg(reinterpret_cast<const int*>(buffer + l.expert_offset_offset) + l.num_local_experts);
  const int groups = static_cast<int>(l.intermediate / 128), lane = threadIdx.x % 32;
  const uint8_t* pool_sf = buffer + l.pool_sf_offset;
  const int warps = gridDim.x * kFoldPassThreads / 32;
  for (int row = (blockIdx.x * kFoldPassThreads + threadIdx.x) / 32; row < rows; row += warps) {
    uint4* data = reinterpret_cast<uint4*>(buffer + l.pool_offset + int64_t(row) * l.pool_row_bytes);
    warp_fold_row<false>(
        data, data, 0, groups, [&](int g) { return group_scales4(pool_sf, g, l.pool_rows, row); },
        [&](int g, float f) { factors[int64_t(g) * l.pool_rows + row] = f; }, nullptr, stage, lane);
  }
}

// A warp per row, as pool_fold_kernel: the row's groups (4 quarters of 16 bytes of E2M1 each) folded by
// fold_mxfp4_group (warp_fold_mxfp4_groups) into 8 chunks of 16 bytes, the layout fold_token_unit writes into the
// kernel's tile (before its swizzle, which the TMA applies).
__global__ void __launch_bounds__(kFoldPassThreads, 2) fold_mxfp4_kernel(const uint8_t* src, const uint8_t* src_sf,
                                                                         int64_t k, uint8_t* dst, float* factors,
                                                                         const uint8_t* buffer,
                                                                         layout::BufferLayout l) {
  __shared__ uint2 tables[kNumFoldTables];
  __shared__ uint4 stage_all[kFoldPassThreads / 32][8 * kFoldStageGroups];
  uint4* stage = stage_all[threadIdx.x / 32];
  if (threadIdx.x < kNumFoldTables) tables[threadIdx.x] = make_fold_table(threadIdx.x - kFoldHeadroom);
  __syncthreads();
  ptx::grid_dependency_wait();  // the gather's rows (L1) or L1's outputs (L2)
  ptx::launch_dependents();
  const int rows = __ldcg(reinterpret_cast<const int*>(buffer + l.expert_offset_offset) + l.num_local_experts);
  const int groups = static_cast<int>(k / 128), lane = threadIdx.x % 32;
  const int warps = gridDim.x * kFoldPassThreads / 32;
  for (int row = (blockIdx.x * kFoldPassThreads + threadIdx.x) / 32; row < rows; row += warps) {
    const uint4* packed = reinterpret_cast<const uint4*>(src + int64_t(row) * (k / 2));
    uint4* folded = reinterpret_cast<uint4*>(dst + int64_t(row) * k);
    warp_fold_row<true>(
        packed, folded, 0, groups, [&](int g) { return group_scales4(src_sf, g, l.pool_rows, row); },
        [&](int g, float f) { factors[int64_t(g) * l.pool_rows + row] = f; }, tables, stage, lane);
  }
}

}  // namespace

void launch_fold_mxfp4(const uint8_t* src, const uint8_t* src_sf, int64_t k, uint8_t* dst, float* factors,
                       const uint8_t* buffer, const layout::BufferLayout& layout, int num_sms, cudaStream_t stream) {
  launch_pdl(fold_mxfp4_kernel, dim3(num_sms * 2), dim3(kFoldPassThreads), 0, stream, src, src_sf, k, dst, factors,
             buffer, layout);
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
}

void launch_pool_fold(uint8_t* buffer, const layout::BufferLayout& layout, float* factors, int num_sms,
                      cudaStream_t stream) {
  // FP8 pool rows (pool_row_bytes == intermediate, a multiple of 128: the buffer checks it at creation).
  launch_pdl(pool_fold_kernel, dim3(num_sms * 2), dim3(kFoldPassThreads), 0, stream, buffer, layout, factors);
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
}

void launch_nvfp4_requant(const float* scratch, uint8_t* buffer, const layout::BufferLayout& layout, int max_rows,
                          int num_sms, cudaStream_t stream) {
  const int blocks16 = static_cast<int>(layout.intermediate / 16);
  const int threads = std::min((blocks16 + 31) / 32 * 32, kRequantMaxThreads);
  // A CTA per row (rows past the grid loop), at most 2048 threads' worth per SM. NOTES: at 50 registers fewer are
  // resident (~10 CTAs of 128 threads), so large calls run a second wave; not measured against a resident-only grid.
  const int ctas = std::max(1, std::min(max_rows, num_sms * (2048 / threads)));
  launch_pdl(nvfp4_requant_kernel, dim3(ctas), dim3(threads), 0, stream, scratch, buffer, layout);
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace megamoe::kernels
