// Launchers of the CUDA kernels, callable from host C++ without CUDA headers beyond the runtime types.
// Pointers are device pointers into the buffer / weights; every size was validated by the op.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "megamoe/formats.hpp"
#include "megamoe/layout/buffer.hpp"

namespace megamoe::kernels {

// pre_dispatch: quantize x and store it with the routing (int32 ids, out-of-range ones clamped) into the buffer.
void launch_pre_dispatch(const void* x, const void* topk_idx, bool topk_idx_is_int64, const float* topk_weights,
                         uint8_t* buffer, const layout::BufferLayout& layout, int rank, int num_tokens,
                         ActRecipe recipe, cudaStream_t stream);

// Routing: (EP: barrier 0, then) per-expert row lists (pool_src) over every rank's slots, offsets,
// token-block offsets for `block_m` (an expert's last block may hold `tail_rows` more: the GEMM's tiles must then
// hold block_m + tail_rows token columns: heuristics::fp8_tile_cols, fp4_tile_cols), recv_stats.
void launch_routing(uint8_t* buffer, const layout::BufferLayout& layout, int rank, int num_tokens, int block_m,
                    int* recv_stats, cudaStream_t stream, int tail_rows = 0);

// Gather: copy each pool row's token (packed row, scales K-block-major, NVFP4 per-token global scale)
// into the dispatch area, in the layout of `recipe`. fold (tokens with UE8M0 scales per 32 for the FP8-wgmma FP4 path):
// each 128-K group folded to one float factor, rows in the kernel's E4M3 tile order; FP8 tokens (fold_fp8_group) in
// place, MXFP4 tokens (fold_e2m1_quarter) into E4M3 rows [pool rows, hidden] at fold_dst, factors [hidden / 128,
// pool_rows] at fold_factors.
void launch_gather(uint8_t* buffer, const layout::BufferLayout& layout, ActRecipe recipe, int num_sms,
                   cudaStream_t stream, int* zero_words = nullptr, int num_zero_words = 0, bool fold = false,
                   uint8_t* fold_dst = nullptr, float* fold_factors = nullptr);

// Combine: (EP: barrier 1, then) y[t] = sum over valid slots of combine[t, k] (float32, slot order) -> bf16.
void launch_combine(void* y, uint8_t* buffer, const layout::BufferLayout& layout, int rank, int num_tokens,
                    int num_sms, cudaStream_t stream);

// Grouped FP8 GEMMs over (expert, token block, 256 weight rows) tiles: L1 (dispatch rows x w13 -> SwiGLU ->
// FP8 pool) and L2 (pool x w2 -> bf16 rows in the combine area), as one launch (fused) or two.
struct GroupedGemmArgs {     // one GEMM's operands
  CUtensorMap tmap_weights;  // fp8 [E * n, k], box {128, 256} (pair walk: {128, 128}), 128B swizzle
  CUtensorMap tmap_acts;     // fp8 [pool_rows, k], box {128, block_m}, 128B swizzle
  CUtensorMap tmap_acts_tail;  // the same, box {128, tail_rows}: a wide last block's rows past block_m (tail_rows > 0)
  const float* weights_sf;   // float32 [E, n / 64, k / 128]
  const float* acts_sf;      // float32 [k / 128, pool_rows]
  int n, k;
};
struct GroupedGemmLaunch {
  int block_m;
  bool fused;              // one launch for both GEMMs
  bool pairs = false;      // fused walk in CTA pairs sharing each weight tile (block_m 64; routing in 128-row blocks)
  bool rotate_rounds = false;  // two launches: each round's tiles rotated among the CTAs (heuristics::rotate_rounds)
  float activation_clamp;  // < 0: no clamp
  bool fast_math;
};
void launch_fp8_grouped_gemms(const GroupedGemmArgs& l1, const GroupedGemmArgs& l2, uint8_t* buffer,
                              const layout::BufferLayout& layout, const GroupedGemmLaunch& how, int num_sms,
                              cudaStream_t stream);

// 2D tensor map over a row-major byte matrix [outer, inner], 128-byte swizzled boxes {box_inner, box_outer} (swizzle
// false: boxes land row after row, box_inner bytes apart; box_inner up to 256). A box's innermost start coordinate must
// be a multiple of 16 bytes: an unaligned one trapped (illegal instruction; H100, 2026-11-28, docs/perf-notes.md).
CUtensorMap make_tensor_map_2d(const void* base, uint64_t inner, uint64_t outer, uint64_t row_stride_bytes,
                               uint32_t box_inner, uint32_t box_outer, bool swizzle = true);

// Grouped FP4-weight GEMM (MXFP4 / NVFP4 weights decoded on chip to bf16; sm90_fp4_grouped_gemm.cuh).
struct Fp4GroupedGemmArgs {
  CUtensorMap tmap_weights;        // packed E2M1 [E * n, k / 2] bytes, box {128, heuristics::fp4_tile_n}, 128B swizzle
  CUtensorMap tmap_acts;           // E4M3 [pool_rows, k] or packed E2M1 [pool_rows, k / 2], box {128, block_m}, 128B
  CUtensorMap tmap_acts_tail;      // the same, box {128, kFp4TailRows}: a wide last block's rows past block_m
  // [E * n, k / 32] UE8M0 (MXFP4) or [E * n, k / 16] UE4M3 (NVFP4) bytes, as scale tiles where scale_tiles
  // (formats.hpp: fp4_scale_tiles; 16-byte aligned, check_mega_moe), else row by row.
  const uint8_t* weights_sf;
  bool scale_tiles = false;
  bool scale_tma = false;  // scale_tiles only: a stage's scales by one bulk copy (heuristics::fp4_scale_tma)
  const float* weights_global_sf;  // [E] (NVFP4) or nullptr
  const uint8_t* weights_row_exp;  // MXFP4: [E * n] each row's largest UE8M0 scale (transform_weights), else nullptr
  const uint8_t* acts_sf;          // token scales [k / blk, pool_rows] bytes (K-block-major)
  const float* acts_global_sf;     // [pool_rows] (NVFP4 activations) or nullptr
  float* scratch;                  // L1 with NVFP4 activations: float32 [rows, n / 2]
  int n, k;
  bool is_l1;  // L1: SwiGLU + requant into the pool (or float32 scratch); L2: bf16 rows into combine
  WeightFormat weight_format;
  ActRecipe recipe;
  float activation_clamp;  // < 0: no clamp
  bool fast_math;
  bool fp8_mma = false;  // MXFP4 weights decoded to E4M3 for FP8 wgmmas (else to BF16)
  // Split K of the last round (heuristics::fp4_split_round; 0: off): partials holds split_round units of 256 x block_m
  // float32, split_counters split_round / 2 ints, zero at launch (launch_gather zeroes them).
  int split_round = 0;
  float* partials = nullptr;
  int* split_counters = nullptr;
  // The routing's tail rows (heuristics::fp4_tail_rows): > 0 launches the wide-tail build (an expert's last block of up
  // to block_m + tail_rows rows). It must be what launch_routing got, for both GEMMs.
  int tail_rows = 0;
  // Whole tiles rotated per round among the CTAs (heuristics::fp4_rotate_rounds; any assignment gives the same bits).
  bool rotate_rounds = false;
  // The FP8-wgmma path with FP8 tokens (heuristics::fp4_folded_tokens): the tokens arrive folded (L1: launch_gather's
  // fold; L2: L1's epilogue with fold_output, or at block_m 128 launch_pool_fold, whose factors are a per-call tensor):
  // acts_sf holds float factors [k / 128, pool_rows] and the rows are in the kernel's E4M3 tile order.
  bool folded_tokens = false;
  bool fold_output = false;  // L1: write L2's input (pool) folded the same way
  // L1 with MXFP4 tokens folded upstream (launch_gather's fold; recipe kFP8UE8M0Block32,
  // folded_tokens): the epilogue quantizes to MXFP4 (the w4a4 semantics), heuristics::fp4_fold_mxfp4_tokens.
  bool out_fp4 = false;
  // out_fp4 with fold_output (256-row tiles): L2's input leaves folded into these (Params::fold_out) instead of the pool.
  uint8_t* fold_out = nullptr;
  float* fold_out_factors = nullptr;
};
void launch_fp4_grouped_gemm(const Fp4GroupedGemmArgs& args, uint8_t* buffer, const layout::BufferLayout& layout,
                             int block_m, int num_sms, cudaStream_t stream);
// NVFP4 activations into L2: the float32 SwiGLU rows in `scratch` [rows, intermediate] -> packed E2M1, UE4M3
// block scales (K-block-major) and the per-row global scale in the pool (the pre_dispatch recipe).
void launch_nvfp4_requant(const float* scratch, uint8_t* buffer, const layout::BufferLayout& layout, int max_rows,
                          int num_sms, cudaStream_t stream);
// FP8 tokens into L2 on the FP8-wgmma path after a block_m 128 L1 (whose epilogue cannot fold): the pool's rows folded in
// place per 128-K group (fold_fp8_group), their float32 factors into `factors` [intermediate / 128, pool_rows].
void launch_pool_fold(uint8_t* buffer, const layout::BufferLayout& layout, float* factors, int num_sms,
                      cudaStream_t stream);
// MXFP4 tokens (packed E2M1 rows of k / 2 bytes at `src`, UE8M0 scales [k / 32, pool_rows] at `src_sf`) of the routed rows
// -> E4M3 rows [pool_rows, k] at `dst` in the FP8-wgmma path's token order, folded per 128-K group as its converters fold
// them (fold_token_unit: the same bits), and the groups' float32 factors [k / 128, pool_rows] at `factors`.
void launch_fold_mxfp4(const uint8_t* src, const uint8_t* src_sf, int64_t k, uint8_t* dst, float* factors,
                       const uint8_t* buffer, const layout::BufferLayout& layout, int num_sms, cudaStream_t stream);

// One token on one rank, MXFP4 weights with FP8 or MXFP4 tokens, or NVFP4 weights with FP8 or NVFP4 tokens: the experts
// of its top-k slots as GEMVs on mma.sync (sm90_fp4_gemv.cu; heuristics::fp4_gemv; persistent CTAs on num_sms), no
// routing or gather. L1 -> SwiGLU -> the L2 input (E4M3, or E2M1 with MXFP4 tokens, + UE8M0 per 32, in the pool; with
// NVFP4 tokens float32 [top_k, intermediate] and each 32 outputs' amax [top_k, intermediate / 32] in `scratch`, which
// L2 quantizes) -> L2 -> bf16 rows in the combine area (then launch_combine); reports bad ids and counts recv_stats as
// routing does.
struct Fp4GemvLayer {
  const uint8_t* weights;     // packed E2M1 [E, n, k / 2] (transform_weights' kernel layout)
  const uint8_t* weights_sf;  // UE8M0 [E, n, k / 32] (NVFP4: UE4M3 [E, n, k / 16]), as scale tiles where scale_tiles
  const uint8_t* row_exp;     // MXFP4 [E, n]: each row's largest scale byte (transform_weights' third tensor); NVFP4 null
  const float* global_sf;     // NVFP4 [E]: the per-expert global scale (third tensor); MXFP4 null
  bool scale_tiles;
  // k a multiple of heuristics::kFp4GemvChunkK: the weights as [E * n, k / 2] bytes, unswizzled boxes of
  // {chunk K / 2, 16 x heuristics::fp4_gemv_run_tiles rows} (the wgmma form's ring, produce_chunks: its kRun must be the
  // same function's value); else unused.
  CUtensorMap tmap_chunks;
};
void launch_fp4_gemv(const Fp4GemvLayer& l1, const Fp4GemvLayer& l2, uint8_t* buffer, const layout::BufferLayout& layout,
                     float activation_clamp, bool fast_math, int* recv_stats, float* scratch, int num_sms,
                     cudaStream_t stream);

}  // namespace megamoe::kernels
