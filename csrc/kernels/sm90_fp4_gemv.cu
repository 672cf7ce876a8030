// FP4 GEMV path: one token on one rank, MXFP4 weights with FP8 tokens (UE8M0 scales per 32: w4a8, DeepSeek-V4's
// checkpoint format). heuristics::fp4_gemv chooses it; layouts and semantics: docs/plans/fp4-gemv.md.
//
// Why: at T=1 the tile walk runs 256-row tiles (V4-Flash: 96 per GEMM on 132 SMs, 36 of them idle) and its wgmmas use
// one of their 8-16 token columns; the walk is bound by tile granularity and per-SM issue (docs/perf-notes.md, thirty-
// ninth session). Here a CTA item is 64 weight rows of one slot's expert over the whole K, the K split by 128-K groups
// over the CTA's 8 warps (their partials summed in shared memory in warp order): V4-Flash L1 is 6 x 64 items of 32
// outputs, L2 6 x 64 items of 64 rows, and every SM streams.
// Each lane loads its 32-K block of two rows straight from global memory (16 bytes each), decodes them as the BF16
// tile path does (decode_rows_bf16), but relative to each row's largest scale byte (transform_weights' row exponents,
// as the FP8-wgmma path: e2m1 x 2^(s - e), exact in bf16 for every scale byte) into mma.sync m16n8k16 A fragments, and
// multiplies the token's B fragments (column 0; lanes 4-31 hold the zero columns): exact products, float32 sums on the
// tensor cores, then 2^(e - 127) per row: exact for every scale byte up to e - s = 125 binades below the row's largest
// (the FP8-wgmma walk: up to 14, rounded past that). Not the default walk's FP8 wgmmas on folded values: other
// roundings (within the tolerance of the reference, not bitwise), hence one rank only (EP's ranks must round alike
// whatever their token counts).
// L1 epilogue as the tile walk's (swiglu_value on the bf16-rounded gate and up; UE8M0 scale per 32 outputs,
// ceil_pow2(amax / 448); E4M3 by the exact reciprocal), not folded: L2 reads E4M3 bytes [slot][I] and scale bytes
// [slot][I / 32] in the pool's regions (nothing else reads them in this call). L2 stores bf16 rows into the combine
// area; launch_combine sums the slots. Bad ids go to the error word and valid slots to recv_stats, as routing does.
#include "kernels/sm90_fp4_grouped_gemm.cuh"

namespace megamoe::kernels {

namespace {

using fp4::decode_rows_bf16;
using fp4::fp8_pair_bf16;

constexpr int kGemvWarps = 8;
constexpr int kGemvThreads = 32 * kGemvWarps;
constexpr int kGemvRows = 64;  // weight rows per CTA item: four m16 tiles
constexpr int kL1Outputs = 32;  // L1 outputs per item: one UE8M0 block (32 gate rows and their 32 up rows)

__device__ __forceinline__ void mma_m16n8k16_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint4 load_nc(const uint8_t* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

// Byte of (row r, 32-K block b) in one expert's UE8M0 scales of `kb` bytes a row: scale tiles (formats.hpp) or rows.
__device__ __forceinline__ int64_t scale_index(int r, int b, int kb, bool tiles) {
  if (!tiles) return int64_t(r) * kb + b;
  return (int64_t(r / kScaleTileRows) * (kb / kScaleTileBytes) + b / kScaleTileBytes) * (kScaleTileRows * kScaleTileBytes) +
         (r % kScaleTileRows) * kScaleTileBytes + b % kScaleTileBytes;
}

// The token's B fragments for 128-K group g: lane q < 4 (column 0) holds its 32-K block 4g + q (E4M3 bytes `x` [k],
// UE8M0 `x_sf` [k / 32]) as values, in decode_rows_bf16's K order (fp8_pair_bf16); the other lanes zeros. Exact in
// bf16 for every scale the quantizers write (>= 1e-4 / 448: normal), up to 2^119.
__device__ __forceinline__ void token_fragments(uint32_t (&b)[8][2], const uint8_t* x, const uint8_t* x_sf, int g,
                                                int lane) {
#pragma unroll
  for (int s = 0; s < 8; ++s) b[s][0] = b[s][1] = 0;
  if (lane >= 4) return;
  const int blk = 4 * g + lane;
  const uint4 lo = __ldcg(reinterpret_cast<const uint4*>(x + blk * 32));
  const uint4 hi = __ldcg(reinterpret_cast<const uint4*>(x + blk * 32 + 16));
  const uint32_t w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
  const float f = ue8m0_float(__ldcg(x_sf + blk));
#pragma unroll
  for (int t = 0; t < 4; ++t)
#pragma unroll
    for (int p = 0; p < 4; ++p) b[2 * t + p / 2][p % 2] = fp8_pair_bf16(w, t, p, f);
}

// Weight scale byte s of a row whose largest is e -> the bf16 pair factor 2^(s - e + 126), which turns e2m1x2_raw's
// e2m1 x 2^-126 into e2m1 x 2^(s - e) (exact: at most 6, and normal for s - e >= -125). The row's 2^(e - 127)
// multiplies its sums after the K (gemv_item), so every scale byte is exact, as on the FP8-wgmma path; s > e, which
// transform_weights never writes, reads as s = e - 252.
__device__ __forceinline__ uint32_t relative_factor(uint32_t s, uint32_t e) {
  const uint32_t h = (253u - min(e - s, 252u)) << 7;
  return h | (h << 16);
}

// The four m16 tiles of rows r0[m] .. r0[m] + 15 of one expert (packed rows of k / 2 bytes at `w`, scales at `sf`,
// the rows' largest scale bytes ea / eb) times the token, over the 128-K groups [g_begin, g_end), into acc[m] (m16n8
// accumulators: column 0 in lanes 4i, registers 0 (row r0 + i) and 2 (row r0 + i + 8)), relative to the rows' largest
// scales.
__device__ __forceinline__ void gemv_tiles(float (&acc)[4][4], const uint8_t* w, const uint8_t* sf, bool tiles, int k,
                                           const int (&r0)[4], const uint32_t (&ea)[4], const uint32_t (&eb)[4],
                                           const uint8_t* x, const uint8_t* x_sf, int g_begin, int g_end, int lane) {
  const int q = lane % 4, rr = lane / 4, kb = k / 32;
  const int64_t row_bytes = k / 2;
  for (int g = g_begin; g < g_end; ++g) {
    const int blk = 4 * g + q;
    // Every load of the group first (eight 16-byte rows a lane), then the decode and the mmas; lane q = 0 of each row
    // pair also asks L2 for the next group's 64 bytes of its two rows, so that a warp keeps two groups' bytes in flight
    // (212-216 registers a thread: one CTA of 8 warps per SM; capped at 128 for two, ptxas spilled 68-72 bytes).
    uint4 wa[4], wb[4];
    uint32_t sa[4], sb[4];
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const int ra = r0[m] + rr, rb = ra + 8;
      if (q == 0 && g + 1 < g_end) {
        ptx::prefetch_l2(w + ra * row_bytes + (blk + 4) * 16);
        ptx::prefetch_l2(w + rb * row_bytes + (blk + 4) * 16);
      }
      wa[m] = load_nc(w + ra * row_bytes + blk * 16);
      wb[m] = load_nc(w + rb * row_bytes + blk * 16);
      sa[m] = __ldg(sf + scale_index(ra, blk, kb, tiles));
      sb[m] = __ldg(sf + scale_index(rb, blk, kb, tiles));
    }
    uint32_t b[8][2];
    token_fragments(b, x, x_sf, g, lane);
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const uint32_t fa[2] = {relative_factor(sa[m], ea[m]), relative_factor(sa[m], ea[m])};
      const uint32_t fb[2] = {relative_factor(sb[m], eb[m]), relative_factor(sb[m], eb[m])};
      const uint32_t wa4[4] = {wa[m].x, wa[m].y, wa[m].z, wa[m].w}, wb4[4] = {wb[m].x, wb[m].y, wb[m].z, wb[m].w};
      uint32_t a[8][4];
      decode_rows_bf16(a, wa4, wb4, fa, fb);
#pragma unroll
      for (int s = 0; s < 8; ++s) mma_m16n8k16_bf16(acc[m], a[s], b[s][0], b[s][1]);
    }
  }
}

// One CTA item of 64 rows (four m16 tiles from r0) of expert `id` (n rows of k): every warp its share of the 128-K groups,
// each row's sums times 2^(e - 127) (its largest scale byte e; 255: NaN, as on the FP8-wgmma path), then the warps'
// partials in shared memory; returns after a barrier, part[w][i] = warp w's sum of item row i.
__device__ __forceinline__ void gemv_item(float (&part)[kGemvWarps][kGemvRows], const Fp4GemvLayer& layer, int id, int n,
                                          int k, const int (&r0)[4], const uint8_t* x, const uint8_t* x_sf) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int groups = k / 128;
  const uint8_t* row_exp = layer.row_exp + int64_t(id) * n;
  uint32_t ea[4], eb[4];
#pragma unroll
  for (int m = 0; m < 4; ++m) ea[m] = __ldg(row_exp + r0[m] + lane / 4), eb[m] = __ldg(row_exp + r0[m] + lane / 4 + 8);
  float acc[4][4] = {};
  gemv_tiles(acc, layer.weights + int64_t(id) * n * (k / 2), layer.weights_sf + int64_t(id) * n * (k / 32),
             layer.scale_tiles, k, r0, ea, eb, x, x_sf, warp * groups / kGemvWarps, (warp + 1) * groups / kGemvWarps,
             lane);
  if (lane % 4 == 0) {
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      part[warp][16 * m + lane / 4] = acc[m][0] * ue8m0_float(ea[m]);
      part[warp][16 * m + lane / 4 + 8] = acc[m][2] * ue8m0_float(eb[m]);
    }
  }
  __syncthreads();
}

__device__ __forceinline__ float warps_sum(const float (&part)[kGemvWarps][kGemvRows], int i) {
  float s = part[0][i];
#pragma unroll
  for (int w = 1; w < kGemvWarps; ++w) s += part[w][i];
  return s;
}

// L1: CTA (slot, 32-output block ob). The 32 gate rows of outputs [32 ob, 32 ob + 32) and their up rows, 64 further
// (transform_weights' interleave: chunk 2j = gate rows [64j, 64j + 64), chunk 2j + 1 = the matching up rows).
template <bool kFast>
__global__ void __launch_bounds__(kGemvThreads) fp4_gemv_l1_kernel(Fp4GemvLayer w13, uint8_t* buffer,
                                                                   layout::BufferLayout l, float clamp,
                                                                   int* recv_stats) {
  ptx::grid_dependency_wait();  // pre_dispatch's token, ids and weights
  ptx::launch_dependents();
  const int inter = static_cast<int>(l.intermediate), hidden = static_cast<int>(l.hidden);
  const int blocks = inter / kL1Outputs;
  const int slot = blockIdx.x / blocks, ob = blockIdx.x % blocks;
  const int id = __ldcg(reinterpret_cast<const int*>(buffer + l.topk_idx_offset) + slot);  // token 0
  const bool valid = id >= 0 && id < l.num_experts;
  if (ob == 0 && threadIdx.x == 0) {  // as routing: bad ids reported, valid slots counted (a repeated id twice)
    if (!valid && id != -1) record_error(buffer, l, layout::kErrorExpertId, id, 0, slot);
    if (valid && recv_stats != nullptr) atomicAdd(recv_stats + id, 1);
  }
  if (!valid) return;  // block-uniform
  __shared__ float part[kGemvWarps][kGemvRows];
  const int i0 = ob * kL1Outputs, gate0 = 128 * (i0 / 64) + i0 % 64;
  const int r0[4] = {gate0, gate0 + 16, gate0 + 64, gate0 + 80};
  gemv_item(part, w13, id, 2 * inter, hidden, r0, buffer + l.x_offset, buffer + l.x_sf_offset);
  if (threadIdx.x >= 32) return;
  const int lane = threadIdx.x;
  const float g = __bfloat162float(__float2bfloat16_rn(warps_sum(part, lane)));
  const float u = __bfloat162float(__float2bfloat16_rn(warps_sum(part, kL1Outputs + lane)));
  const float a = swiglu_value<kFast>(g, u, __ldcg(reinterpret_cast<const float*>(buffer + l.topk_weights_offset) + slot),
                                      clamp);
  const float amax = warp_reduce_max<32>(fabsf(a));
  const float scale = ceil_pow2(max_nan(amax, kAmaxEps) / kFP8Max);
  buffer[l.pool_offset + int64_t(slot) * inter + i0 + lane] = to_fp8(a * pow2_reciprocal(scale));
  if (lane == 0) buffer[l.pool_sf_offset + int64_t(slot) * blocks + ob] = ue8m0_bits(scale);
}

// L2: CTA (slot, 64-row block rb) -> bf16 rows of the slot's combine row.
__global__ void __launch_bounds__(kGemvThreads) fp4_gemv_l2_kernel(Fp4GemvLayer w2, uint8_t* buffer,
                                                                   layout::BufferLayout l) {
  const int inter = static_cast<int>(l.intermediate), hidden = static_cast<int>(l.hidden);
  const int blocks = hidden / kGemvRows;
  const int slot = blockIdx.x / blocks, rb = blockIdx.x % blocks;
  // Before the dependency wait: pre_dispatch wrote the ids, and L1 triggered this grid only after its own wait for
  // pre_dispatch (every kernel of the chain triggers after its wait; see combine_kernel).
  const int id = __ldcg(reinterpret_cast<const int*>(buffer + l.topk_idx_offset) + slot);
  const int row0 = rb * kGemvRows;
  if (id >= 0 && id < l.num_experts) {
    // The item's weight rows (64 x inter / 2 contiguous bytes) asked of L2 while L1 finishes: this CTA became resident
    // as an L1 CTA left its SM. One 128-byte line per request.
    const uint8_t* rows = w2.weights + (int64_t(id) * hidden + row0) * (inter / 2);
    for (int line = threadIdx.x; line < kGemvRows * inter / 2 / 128; line += kGemvThreads)
      ptx::prefetch_l2(rows + int64_t(line) * 128);
  }
  ptx::grid_dependency_wait();  // L1's outputs
  ptx::launch_dependents();
  if (id < 0 || id >= l.num_experts) return;  // block-uniform; the combine skips the slot
  __shared__ float part[kGemvWarps][kGemvRows];
  const int r0[4] = {row0, row0 + 16, row0 + 32, row0 + 48};
  gemv_item(part, w2, id, hidden, inter, r0, buffer + l.pool_offset + int64_t(slot) * inter,
            buffer + l.pool_sf_offset + int64_t(slot) * (inter / 32));
  if (threadIdx.x >= kGemvRows) return;
  __nv_bfloat16* out = reinterpret_cast<__nv_bfloat16*>(buffer + l.combine_offset) + int64_t(slot) * hidden;  // token 0
  out[row0 + threadIdx.x] = __float2bfloat16_rn(warps_sum(part, threadIdx.x));
}

}  // namespace

void launch_fp4_gemv(const Fp4GemvLayer& l1, const Fp4GemvLayer& l2, uint8_t* buffer, const layout::BufferLayout& layout,
                     float activation_clamp, bool fast_math, int* recv_stats, cudaStream_t stream) {
  if (layout.num_ranks != 1 || layout.hidden % 128 != 0 || layout.intermediate % 128 != 0)
    throw std::runtime_error("megamoe: the FP4 GEMV path takes one rank and hidden, intermediate multiples of 128");
  const int top_k = static_cast<int>(layout.top_k);
  const dim3 l1_grid(top_k * static_cast<int>(layout.intermediate / kL1Outputs));
  if (fast_math)
    launch_pdl(fp4_gemv_l1_kernel<true>, l1_grid, dim3(kGemvThreads), 0, stream, l1, buffer, layout, activation_clamp,
               recv_stats);
  else
    launch_pdl(fp4_gemv_l1_kernel<false>, l1_grid, dim3(kGemvThreads), 0, stream, l1, buffer, layout, activation_clamp,
               recv_stats);
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
  launch_pdl(fp4_gemv_l2_kernel, dim3(top_k * static_cast<int>(layout.hidden / kGemvRows)), dim3(kGemvThreads), 0,
             stream, l2, buffer, layout);
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace megamoe::kernels
