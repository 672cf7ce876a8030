// Grouped FP8 block-scaled GEMM for Hopper: one persistent launch walks (expert, token block, 256
// weight rows) tiles. Weights are the wgmma A operand (64-row slices, "swap AB"), so a decode step
// with a handful of tokens per expert still fills the 64-row MMA dimension with weights.
//
// Warp roles (384 threads): two producer warps that fill each stage in parallel, warp 0 its weight part (walks and
// claims the work tiles; lane 0: TMA of the weight tile, lanes 0-3: cp.async of the weight scales) and warp 1 its
// token part (lane 0: TMA of the token tile, all lanes: cp.async of the token scales; it alone waits for the token
// parts' dependencies), warpgroups 1-2 = consumers, each owning 128 weight rows = two 64-row slices. In L1 the
// slices are a gate chunk and its up chunk (transform_weights interleaves them), so SwiGLU happens in registers.
// Warp 0 hands every work tile to warp 1 (a 2-entry ring) and to the consumers (TileInfo beside the tile's first
// stage) and ends with an end marker, so only warp 0 knows the walk.
//
// Token blocks (block_m, the wgmma N) of 16, 32 or 64 tokens, or 128 (one partial accumulator per warpgroup instead
// of one per slice: one_partial_stage). At block_m 64 an expert's last block may hold 16 rows more (a wide last
// block: m64n80 wgmmas, heuristics::fp8_tail_rows).
//
// Per 128-K block: 4 wgmma k32 steps into a fresh partial accumulator, then promotion
// acc += partial * weight_scale(64-row chunk, k block) * token_scale(token, k block) in float32.
// NOTES: promoting once per scale block (as DeepGEMM does) also bounds the error of Hopper's
// reduced-precision FP8 accumulation (~14 bits after alignment, DeepSeek-V3 report).
// NOTES: the scales of a stage arrive with it (cp.async completing on the stage's full barrier), so
// promotion reads shared memory. Before, each consumer thread loaded its 2 + block_m / 4 scales from global
// memory at the top of the stage (~130 L2 requests per stage and SM at block_m 64), and promotion waited for
// them: the T=1 profile had 44 % of the L1 kernel's stall samples on that wait.
//
// Launch shapes (Gemms):
//  - kL1 / kL2: one GEMM, tiles walked statically (CTA b takes tiles b, b + grid, ...).
//  - kFused: L1 and L2 in one launch. The L2 tiles follow the L1 tiles in one list handed out by an atomic
//    counter, and an L2 tile's token part (pool rows and their scales) loads only once every L1 tile of its
//    expert has stored its outputs (per-expert completion counters). Because tiles are taken in list order,
//    every L1 tile is already held by a running CTA when an L2 tile waits for it, and L1 tiles wait for
//    nothing: no deadlock whatever number of CTAs is resident. Meanwhile the L2 tile's weights stream in
//    (they depend on nothing), so L2 overlaps L1's tail instead of following it.
//  - kFused with kPairs (prefill, block_m 64): the fused walk in clusters of two CTAs that share each weight tile.
//    Routing counts 128-row blocks, so a work unit is (expert, token-block pair, weight block); the cluster's rank 0
//    claims units and publishes them to rank 1 through a claim ring in rank 1's shared memory (kClaimDepth
//    entries, an mbarrier pair each). Rank r takes the pair's rows [64 r, 64 r + 64) and TMA-multicasts weight rows
//    [128 r, 128 r + 128) of the tile into both CTAs' stage, so each CTA-stage moves 16 + 8 KB from L2 instead of
//    32 + 8. Both CTAs issue the same stage sequence; a stage is rewritten only when the consumers of both CTAs have
//    released it (empty barriers count 16 consumer warps: 8 of them remote arrivals). A half past its expert's rows
//    (odd block count) is a phantom: it streams its weight half for the other CTA, loads no tokens, stores and
//    counts nothing. Both CTAs pass a cluster barrier before exit (no multicast or remote arrival may target an
//    exited CTA). Protocol model: docs/models/fused_fp8_cluster_protocol.py (tests/test_models.py). NOTES: built
//    because ncu (H100, 2026-11-24) read the unpaired walk at T=8192 as bound by L2 -> SM bandwidth; measured slower
//    (2026-11-25: per-tile main loop unchanged, phantom halves add CTA-tiles), so off unless MEGAMOE_FP8_PAIRS=1.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <type_traits>

#include "kernels/launch.hpp"
#include "kernels/sm90_common.cuh"
#include "megamoe/ptx/sm90.cuh"

namespace megamoe::kernels {

constexpr int kBlockN = 256;           // weight rows per tile
constexpr int kBlockK = 128;           // K per stage (one scale block, one 128-byte swizzle row)
constexpr int kStagedL2RowBytes = heuristics::kStagedL2RowBytes;  // one token's staged L2 outputs (see the L2 epilogue)
static_assert(kStagedL2RowBytes == kBlockN * 2 + 16, "the heuristics' stage count assumes this epilogue");
constexpr int kNumThreads = 384;
constexpr int kNumConsumerThreads = 256;
constexpr int kClaimDepth = 2;  // pair walk: units rank 0 may claim ahead of rank 1
constexpr int kTileRingDepth = 2;  // tiles the weight producer may hand over ahead of the token producer

enum class Gemms { kL1, kL2, kFused };

// One GEMM's operands besides its tensor maps. L1: dispatch rows x w13 -> SwiGLU -> FP8 pool; L2: pool x w2
// -> bf16 rows in the combine area.
struct GemmOperand {
  const float* weights_sf;  // [E, n / 64, k / 128]
  const float* acts_sf;     // [k / 128, pool_rows] (K-block-major: a K block's token scales are contiguous)
  int n, k;
};

struct GemmParams {
  GemmOperand op[2];  // [0] L1, [1] L2; a split launch reads only its own
  uint8_t* buffer;
  layout::BufferLayout l;
  float activation_clamp;  // < 0: none
  bool fast_math;
  bool rotate_rounds;  // static walk (kL1 / kL2): round r's tiles rotated by r among the CTAs (rotated_tile)
};

#ifdef MEGAMOE_TILE_TRACE
// Diagnostic build only (TraceRecord in sm90_common.cuh): each CTA keeps the stamps of its first kTraceTiles tiles
// in registers / local memory and stores them at exit into g_fp8_trace; fp8_trace_print_kernel, launched after the
// GEMM, prints them.
__device__ TraceRecord g_fp8_trace[kTraceMaxCtas];

__global__ void fp8_trace_print_kernel(int num_ctas) {
  for (int b = 0; b < num_ctas && b < kTraceMaxCtas; ++b) trace_print(g_fp8_trace[b], b);
}
#endif

// A work tile as the producer hands it to the consumers: gemm 0 (L1) or 1 (L2); expert < 0 ends the walk.
struct WorkTile : TileInfo {
  int gemm;
};

// kTileCols: the widest token tile, heuristics::fp8_tile_cols (block_m, or block_m + a wide last block's tail rows).
template <int kTileCols, int kNumStages, Gemms kGemms>
struct GemmSmem {
  static constexpr int kTileA = kBlockN * kBlockK;       // bytes
  static constexpr int kTileB = kTileCols * kBlockK;     // bytes
  // FP8 outputs, per-warp token amax, the tile's per-token scales and their inverses.
  static constexpr int kEpilogueL1 = kTileCols * 128 + 8 * kTileCols * 4 + 2 * kTileCols * 4;
  static constexpr int kEpilogueL2 = kTileCols * kStagedL2RowBytes;     // bf16 outputs
  static constexpr int kEpilogue = kGemms == Gemms::kL1 ? kEpilogueL1
                                   : kGemms == Gemms::kL2 ? kEpilogueL2
                                   : (kEpilogueL1 > kEpilogueL2 ? kEpilogueL1 : kEpilogueL2);
  // Scales of one stage (float32): the tile's four 64-row weight chunks, then its token columns.
  static constexpr int kScales = (kBlockN / 64 + kTileCols) * 4;
  static_assert(kScales % 16 == 0 && kEpilogue % 16 == 0, "scale slots must stay 16-byte aligned");
  static constexpr int kBytes = 1024 /* alignment slack */ + kNumStages * (kTileA + kTileB) + kEpilogue +
                                2 * kNumStages * 8 + kNumStages * int(sizeof(WorkTile)) + kNumStages * kScales +
                                kClaimDepth * (2 * 8 + 4) +  // the pair walk's claim ring
                                kTileRingDepth * (2 * 8 + int(sizeof(WorkTile)));  // weight -> token producer
};

// One stage of a block_m 128 tile (the kernel's kOnePartial): per 64-row slice, its four k32 wgmmas into the one
// partial accumulator, then that slice's promotion as the two-partial loop does it (acc += part * (weight scale *
// token scale) in k order, one fused multiply-add each: the same bits). The token scales load from shared memory per
// fragment column pair (32 more live registers would not fit beside 128 + 64). Mma: m64n128, or m64n64 for a tail
// block of at most 64 tokens (it fills the first half of each fragment; the rest stays 0). a_lo / b_lo: the stage's
// descriptors for this warpgroup's first slice and the token tile; token_sf: the stage's token scales.
// NOTES: probe_mma.py --tile-only (H100, 2026-11-25) ran this loop, without scales, at 1,180 cycles per stage (2^22
// MACs) from shared memory and 1,198 refilled from L2 on 132 SMs, where the 256 x 64 tile's takes 1,280 and 2,446
// for the same MACs; in the kernel it takes ~1,840 (tile trace, V4-Flash T=8192), the consumers waiting ~80 of them
// for data. Taking turns between the warpgroups (named barriers, so one's wgmmas run while the other promotes) did
// not change that (A/B within noise: docs/perf-notes.md, sixteenth session). Hence block_m 128 only where it saves
// padding (heuristics: token_block_for).
template <typename Mma, int kRegs>
__device__ __forceinline__ void one_partial_stage(float (&acc0)[kRegs], float (&acc1)[kRegs], uint32_t a_lo,
                                                  uint32_t b_lo, const float* token_sf, float ws0, float ws1,
                                                  int lane) {
  constexpr int kR = Mma::kNumRegs;
  static_assert(kR <= kRegs, "the partial fills (part of) the accumulator fragment");
  float part[kR];
#pragma unroll
  for (int sl = 0; sl < 2; ++sl) {
    float* acc = sl == 0 ? acc0 : acc1;
    const float ws = sl == 0 ? ws0 : ws1;
#pragma unroll
    for (int i = 0; i < kR; ++i) ptx::fence_operand(part[i]);
    ptx::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kBlockK / 32; ++ks)
      Mma::run(part, ptx::smem_desc_sw128(a_lo + (sl * 64 * kBlockK + ks * 32) / 16),
               ptx::smem_desc_sw128(b_lo + ks * 2), ks > 0);
    ptx::wgmma_commit();
    ptx::wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < kR; ++i) ptx::fence_operand(part[i]);
#pragma unroll
    for (int j = 0; j < kR / 4; ++j) {
      const float2 v = *reinterpret_cast<const float2*>(token_sf + 8 * j + 2 * (lane % 4));
      const float s0 = ws * v.x, s1 = ws * v.y;
      acc[4 * j] = __fmaf_rn(part[4 * j], s0, acc[4 * j]);
      acc[4 * j + 1] = __fmaf_rn(part[4 * j + 1], s1, acc[4 * j + 1]);
      acc[4 * j + 2] = __fmaf_rn(part[4 * j + 2], s0, acc[4 * j + 2]);
      acc[4 * j + 3] = __fmaf_rn(part[4 * j + 3], s1, acc[4 * j + 3]);
    }
  }
}

// One stage of a block_m <= 64 tile: the two slices' four k32 wgmmas each into their own partial accumulator (two
// commit groups), then each slice's promotion acc += part * (weight scale * token scale), in k order. Mma: the tile's
// m64nN (N = block_m, or the wider N of a wide last block: its registers are the first of the fragment's kRegs).
// `released` releases the stage to the producers once both slices' wgmmas have read it.
// NOTES: the two slices are separate commit groups, so slice 0's promotion runs while slice 1's wgmmas are still in
// the tensor pipe (ncu, V4-Flash T=8192 L1: 14 % of all stall samples were consumers waiting on one wait_group for
// both). Each accumulator keeps its k order: same bits.
// Promotion. Fragment layout of m64nN: register 4j + {0,1} -> (row r, cols 8j + 2(lane%4) + {0,1}), 4j + {2,3} ->
// (row r + 8, same cols). NOTES: one explicit fused multiply-add per element, as in one_partial_stage: left to
// contraction, the compiler split some there into a multiply (to free the partial's registers for the next wgmma)
// and a later add, two roundings: outputs 1 bf16 ulp off block_m 64's.
template <typename Mma, int kRegs, typename Released>
__device__ __forceinline__ void two_partial_stage(float (&acc0)[kRegs], float (&acc1)[kRegs], uint32_t a_lo,
                                                  uint32_t b_lo, const float* token_sf, float ws0, float ws1, int lane,
                                                  Released&& released) {
  constexpr int kR = Mma::kNumRegs;
  static_assert(kR <= kRegs && kR % 4 == 0, "the partial fills (part of) the accumulator fragment");
  float col_sf[kR / 2];
#pragma unroll
  for (int j = 0; j < kR / 4; ++j) {
    const float2 v = *reinterpret_cast<const float2*>(token_sf + 8 * j + 2 * (lane % 4));
    col_sf[2 * j] = v.x, col_sf[2 * j + 1] = v.y;
  }
  float part0[kR], part1[kR];
#pragma unroll
  for (int i = 0; i < kR; ++i) ptx::fence_operand(part0[i]), ptx::fence_operand(part1[i]);
  ptx::wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < kBlockK / 32; ++ks)
    Mma::run(part0, ptx::smem_desc_sw128(a_lo + ks * 2), ptx::smem_desc_sw128(b_lo + ks * 2), ks > 0);
  ptx::wgmma_commit();
#pragma unroll
  for (int ks = 0; ks < kBlockK / 32; ++ks)
    Mma::run(part1, ptx::smem_desc_sw128(a_lo + (64 * kBlockK + ks * 32) / 16), ptx::smem_desc_sw128(b_lo + ks * 2),
             ks > 0);
  ptx::wgmma_commit();
  ptx::wgmma_wait<1>();
#pragma unroll
  for (int i = 0; i < kR; ++i) ptx::fence_operand(part0[i]);
#pragma unroll
  for (int i = 0; i < kR; ++i) acc0[i] = __fmaf_rn(part0[i], ws0 * col_sf[(i / 4) * 2 + (i % 2)], acc0[i]);
  ptx::wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < kR; ++i) ptx::fence_operand(part1[i]);
  released();
#pragma unroll
  for (int i = 0; i < kR; ++i) acc1[i] = __fmaf_rn(part1[i], ws1 * col_sf[(i / 4) * 2 + (i % 2)], acc1[i]);
}

template <int kBlockM, int kNumStages, Gemms kGemms, bool kPairs>
__global__ void __launch_bounds__(kNumThreads, 1)
    sm90_fp8_grouped_gemm_kernel(const __grid_constant__ CUtensorMap tmap_weights1,
                                 const __grid_constant__ CUtensorMap tmap_acts1,
                                 const __grid_constant__ CUtensorMap tmap_weights2,
                                 const __grid_constant__ CUtensorMap tmap_acts2,
                                 const __grid_constant__ CUtensorMap tmap_acts1_tail,
                                 const __grid_constant__ CUtensorMap tmap_acts2_tail, GemmParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // A wide last block (heuristics::fp8_tail_rows): up to kTileCols token columns, its rows past kBlockM loaded by the
  // tail tensor maps (box kTailRows) into the token tile after the first kBlockM, and multiplied on m64n(kTileCols)
  // wgmmas; the other tiles run m64n(kBlockM) into the first registers of the same fragment.
  constexpr int kTileCols = heuristics::fp8_tile_cols(kBlockM, kPairs);
  constexpr int kTailRows = kTileCols - kBlockM;
  using Smem = GemmSmem<kTileCols, kNumStages, kGemms>;
  using Mma = ptx::WgmmaFP8<kBlockM>;
  using MmaWide = ptx::WgmmaFP8<kTileCols>;
  constexpr int kRegs = MmaWide::kNumRegs;  // the accumulator fragment (a narrow tile leaves its last registers 0)
  constexpr bool kFused = kGemms == Gemms::kFused;
  static_assert(kBlockM % 8 == 0 && (kBlockM <= 64 || kBlockM == 128), "token block: a multiple of 8 to 64, or 128");
  // block_m 128 (the 256 x 128 tile): per consumer thread the two slices' accumulators take 128 registers, so there
  // is one partial accumulator, not one per slice (one_partial_stage).
  constexpr bool kOnePartial = kBlockM > 64;
  static_assert(!kPairs || kFused, "the pair walk is a fused walk");
  constexpr int kRoutingBlock = kPairs ? 2 * kBlockM : kBlockM;  // rows per routing block (a pair: two tiles)

  extern __shared__ uint8_t smem_raw[];
  // 128B-swizzled TMA tiles need 1024-byte alignment.
  // Offset arithmetic on the __shared__ array (not an integer round trip) keeps the address space known to
  // the compiler: shared-memory loads and stores (LDS/STS), not generic ones (LD/ST, long-scoreboard waits).
  uint8_t* smem = smem_raw + ((1024 - (ptx::smem_addr(smem_raw) & 1023)) & 1023);
  uint8_t* tile_a = smem;
  uint8_t* tile_b = tile_a + kNumStages * Smem::kTileA;
  uint8_t* epilogue = tile_b + kNumStages * Smem::kTileB;
  // [kNumStages][Smem::kScales / 4]; each stage's slot is 16-byte aligned (kScales and kEpilogue are multiples
  // of 16), so token-scale pairs load as float2.
  float* stage_scales = reinterpret_cast<float*>(epilogue + Smem::kEpilogue);
  uint64_t* full = reinterpret_cast<uint64_t*>(stage_scales + kNumStages * (Smem::kScales / 4));
  uint64_t* empty = full + kNumStages;
  uint64_t* claim_full = empty + kNumStages;            // pair walk, rank 1: claim_unit[i] written
  uint64_t* claim_empty = claim_full + kClaimDepth;     // pair walk, rank 0: rank 1 has read claim_unit[i]
  uint64_t* ring_full = claim_empty + kClaimDepth;      // tile_ring[i] written (weight producer)
  uint64_t* ring_empty = ring_full + kTileRingDepth;    // tile_ring[i] read (token producer)
  WorkTile* tile_infos = reinterpret_cast<WorkTile*>(ring_empty + kTileRingDepth);  // [kNumStages], see TileInfo
  WorkTile* tile_ring = tile_infos + kNumStages;                                    // [kTileRingDepth]
  int* claim_unit = reinterpret_cast<int*>(tile_ring + kTileRingDepth);             // [kClaimDepth], rank 1's
  const uint32_t rank = kPairs ? ptx::cluster_ctarank() : 0, peer = rank ^ 1;

  const int warpgroup = threadIdx.x / 128;
  const int lane = threadIdx.x % 32;
  const auto& l = p.l;
  const int num_experts = static_cast<int>(l.num_local_experts);
  const int* tile_offset = reinterpret_cast<const int*>(p.buffer + l.tile_offset_offset);
  const int* expert_offset = reinterpret_cast<const int*>(p.buffer + l.expert_offset_offset);
  // [0]: next work tile of the fused walk; [1 + e]: L1 tiles of expert e whose outputs are stored.
  int* sched = reinterpret_cast<int*>(p.buffer + l.sched_offset);

  if (threadIdx.x == 0) {
    for (int s = 0; s < kNumStages; ++s) {
      // Per producer warp: lane 0's expect_tx (or plain) arrival + its 32 scale-copy lanes.
      ptx::mbarrier_init(&full[s], 2 * (1 + 32));
      // One arrival per consumer thread (pair walk: plus one per consumer warp of the other CTA; a stage is
      // multicast into both).
      ptx::mbarrier_init(&empty[s], kNumConsumerThreads + (kPairs ? kNumConsumerThreads / 32 : 0));
    }
    if constexpr (kPairs)
      for (int i = 0; i < kClaimDepth; ++i)
        ptx::mbarrier_init(&claim_full[i], 1), ptx::mbarrier_init(&claim_empty[i], 1);
    // ring_empty: every token-producer lane arrives, releasing its own read of the entry (see the consumers' release).
    for (int i = 0; i < kTileRingDepth; ++i)
      ptx::mbarrier_init(&ring_full[i], 1), ptx::mbarrier_init(&ring_empty[i], 32);
    ptx::fence_barrier_init();
  }
  // Pair walk: the other CTA's barriers are initialised before any multicast or remote arrival reaches them.
  if constexpr (kPairs) ptx::cluster_sync();
  else __syncthreads();

  if (warpgroup == 0) {
    // ======================================================================== producer
    ptx::setmaxnreg_dec<40>();
    const int producer_warp = threadIdx.x / 32;  // 0: weights, 1: tokens (see the header)
    if (producer_warp < 2) {
      // NOTES: routing metadata (tile_offset, expert_offset, the zeroed sched words) is final before this grid
      // launches: the predecessor allows the launch only after its own dependency wait, which follows the
      // routing kernel. Reads bypass L1 (__ldcg) so no line cached by an earlier kernel on this SM can be stale.
      const int num_blocks = __ldcg(tile_offset + num_experts);  // routing blocks (pair walk: pairs of tiles)
      const int nblocks1 = (p.op[0].n + kBlockN - 1) / kBlockN, nblocks2 = (p.op[1].n + kBlockN - 1) / kBlockN;
      const int num_l1_tiles = kGemms == Gemms::kL2 ? 0 : num_blocks * nblocks1;
      const int num_tiles = num_l1_tiles + (kGemms == Gemms::kL1 ? 0 : num_blocks * nblocks2);
      // A stage is free once its consumers released it (pair walk: both CTAs' consumers, 8 warps remote).
      auto wait_empty = [&](int s, uint32_t parity) {
        if constexpr (kPairs) ptx::mbarrier_wait_cluster(&empty[s], parity);
        else ptx::mbarrier_wait(&empty[s], parity);
      };
      // The end of the walk: one more stage, no data, which the consumers read and stop at (each producer warp
      // arrives as it would for a stage: 32 lanes plus lane 0 in place of its expect_tx arrival).
      auto end_stage = [&](int s, uint32_t phase) {
        wait_empty(s, phase ^ 1);
        if (producer_warp == 0 && lane == 0) {
          WorkTile end{};
          end.expert = -1;
          tile_infos[s] = end;
        }
        __syncwarp();
        ptx::mbarrier_arrive(&full[s]);
        if (lane == 0) ptx::mbarrier_arrive(&full[s]);
      };
      int stage = 0;
      uint32_t phase = 0;
      if (producer_warp == 0) {
        // ==================================================================== weight producer (warp 0)
        // Walks the tiles (claims them in the fused walk), writes each tile's WorkTile beside its first stage,
        // hands it to the token producer, and loads every stage's weight tile and weight scales: nothing to
        // wait for but free stages.
        auto work_tile = [&](int tile) {
          WorkTile w;
          w.gemm = tile < num_l1_tiles ? 0 : 1;
          static_cast<TileInfo&>(w) = decode_tile_warp(tile - (w.gemm ? num_l1_tiles : 0), tile_offset, expert_offset,
                                                  num_experts, w.gemm ? nblocks2 : nblocks1, kRoutingBlock);
          if constexpr (kPairs) {  // this CTA's half of the pair; rows 0: a phantom half
            const int pair_rows = w.rows;
            w.row0 += static_cast<int>(rank) * kBlockM;
            w.rows = max(0, min(kBlockM, pair_rows - static_cast<int>(rank) * kBlockM));
          }
          return w;
        };
        // Pair walk: rank 0 claims from the global counter and publishes each unit in rank 1's claim ring; rank 1
        // reads them in order and frees the entry. Every lane returns the unit.
        int num_claims = 0;
        auto claim = [&] {
          int unit = 0;
          if (lane == 0) {
            if constexpr (kPairs) {
              const int i = num_claims % kClaimDepth;
              const uint32_t parity = (num_claims / kClaimDepth) & 1;
              if (rank == 0) {
                ptx::mbarrier_wait_cluster(&claim_empty[i], parity ^ 1);
                unit = atomicAdd(sched, 1);
                ptx::st_shared_cluster(ptx::mapa_shared(ptx::smem_addr(claim_unit + i), peer), unit);
                ptx::mbarrier_arrive_cluster(ptx::mapa_shared(ptx::smem_addr(claim_full + i), peer));
              } else {
                ptx::mbarrier_wait_cluster(&claim_full[i], parity);
                unit = *reinterpret_cast<volatile int*>(claim_unit + i);
                ptx::mbarrier_arrive_cluster(ptx::mapa_shared(ptx::smem_addr(claim_empty + i), peer));
              }
            } else {
              unit = atomicAdd(sched, 1);
            }
          }
          ++num_claims;
          return __shfl_sync(0xffffffffu, unit, 0);
        };
        // Hands tile number n of this CTA's walk (expert < 0: the end) to the token producer.
        int num_handed = 0;
        auto hand_over = [&](const WorkTile& w) {
          const int i = num_handed % kTileRingDepth;
          if (lane == 0) {
            ptx::mbarrier_wait(&ring_empty[i], ((num_handed / kTileRingDepth) & 1) ^ 1);
            tile_ring[i] = w;
            ptx::mbarrier_arrive(&ring_full[i]);
          }
          ++num_handed;
        };
        if (lane == 0) {  // the tensor maps this launch uses
          if constexpr (kGemms != Gemms::kL2) {
            ptx::prefetch_tensormap(&tmap_weights1);
            ptx::prefetch_tensormap(&tmap_acts1);
          }
          if constexpr (kGemms != Gemms::kL1) {
            ptx::prefetch_tensormap(&tmap_weights2);
            ptx::prefetch_tensormap(&tmap_acts2);
          }
        }
        int tile = 0, unit = static_cast<int>(blockIdx.x);  // static walk: CTA b takes units b, b + grid, ...
#ifdef MEGAMOE_TILE_TRACE
        int trace_n = 0, trace_cur = -1, trace_tile[kTraceTiles];  // trace_cur: the slot of the tile being issued
        uint64_t trace_claim[kTraceTiles], trace_issue[kTraceTiles];  // claimed; first weight load issued
        // Per tile: SM cycles this warp spent waiting for free stages, and from its first stage to its last issued.
        int64_t trace_pwait[kTraceTiles] = {}, trace_pspan[kTraceTiles] = {};
#endif
        for (bool first = true;; first = false) {
          if constexpr (kFused) {
            tile = claim();
          } else {
            if (!first) unit += static_cast<int>(gridDim.x);
            tile = p.rotate_rounds && unit < num_tiles ? rotated_tile(unit, num_tiles) : unit;
          }
#ifdef MEGAMOE_TILE_TRACE
          trace_cur = trace_n < kTraceTiles ? trace_n : -1;
          if (lane == 0 && trace_cur >= 0) trace_tile[trace_n] = tile, trace_claim[trace_n++] = ptx::globaltimer_ns();
#endif
          if (tile >= num_tiles) {
            WorkTile end{};
            end.expert = -1;
            hand_over(end);
            end_stage(stage, phase);
            break;
          }
          const WorkTile t = work_tile(tile);
          hand_over(t);
          const GemmOperand& op = p.op[t.gemm];
          const CUtensorMap* tmap_w = t.gemm ? &tmap_weights2 : &tmap_weights1;
          const int num_kblocks = op.k / kBlockK;
          const int weight_row = t.expert * op.n + t.n_block * kBlockN;
          const int first_chunk = weight_row / 64;
          const bool chunk_valid = lane < kBlockN / 64 && t.n_block * kBlockN + lane * 64 < op.n;
          for (int kb = 0; kb < num_kblocks; ++kb) {
#ifdef MEGAMOE_TILE_TRACE
            const int64_t trace_w0 = clock64();
            if (kb == 0 && trace_cur >= 0) trace_pspan[trace_cur] = -trace_w0;
#endif
            wait_empty(stage, phase ^ 1);
#ifdef MEGAMOE_TILE_TRACE
            if (trace_cur >= 0) trace_pwait[trace_cur] += clock64() - trace_w0;
#endif
            if (lane == 0) {
              if (kb == 0) tile_infos[stage] = t;
              // Both weight halves land here (pair walk: one of them multicast by the other CTA, maybe first:
              // bytes before this phase's expect_tx are allowed, and the slot was free in both CTAs).
              ptx::mbarrier_arrive_expect_tx(&full[stage], Smem::kTileA);
              if constexpr (kPairs)
                ptx::tma_load_2d_multicast(tile_a + stage * Smem::kTileA + rank * (Smem::kTileA / 2), tmap_w,
                                           &full[stage], kb * kBlockK,
                                           weight_row + static_cast<int>(rank) * (kBlockN / 2), 0x3);
              else
                ptx::tma_load_2d(tile_a + stage * Smem::kTileA, tmap_w, &full[stage], kb * kBlockK, weight_row);
#ifdef MEGAMOE_TILE_TRACE
              if (kb == 0 && trace_cur >= 0) trace_issue[trace_cur] = ptx::globaltimer_ns();
#endif
            }
            // Weight scales of the tile's four 64-row chunks (lanes 0-3; chunks past n are never read).
            if (chunk_valid)
              ptx::cp_async_4(stage_scales + stage * (Smem::kScales / 4) + lane,
                              op.weights_sf + int64_t(first_chunk + lane) * num_kblocks + kb);
            ptx::cp_async_mbarrier_arrive_noinc(&full[stage]);
            if (++stage == kNumStages) stage = 0, phase ^= 1;
#ifdef MEGAMOE_TILE_TRACE
            if (kb == num_kblocks - 1 && trace_cur >= 0) trace_pspan[trace_cur] += clock64();
#endif
          }
        }
#ifdef MEGAMOE_TILE_TRACE
        if (lane == 0 && blockIdx.x < kTraceMaxCtas) {
          TraceRecord& r = g_fp8_trace[blockIdx.x];
          r.producer_n = trace_n;
          for (int i = 0; i < trace_n; ++i) {
            r.tile[i] = trace_tile[i], r.claim[i] = trace_claim[i];
            r.issue[i] = trace_tile[i] < num_tiles ? trace_issue[i] : trace_claim[i];
            r.pwait[i] = trace_pwait[i], r.pspan[i] = trace_pspan[i];
          }
        }
#endif
      } else {
        // ==================================================================== token producer (warp 1)
        // Loads every stage's token tile and token scales, in the weight producer's tile order. Token parts wait
        // on the previous grid (gather or L1: programmatic launch) and a fused L2 tile's on its expert's L1 tiles;
        // this warp simply waits, while the weight producer streams ahead (it depends on nothing).
        // NOTES: one producer warp did both before (the token parts that had to wait were queued behind later
        // stages' weights): ncu and the tile trace (H100, V4-Flash T=8192, 2026-11-25) had its ~110 dependent
        // instructions per stage at ~8 cycles each bound the main loop (~1,000 of ~1,140 cycles per stage).
        // Every L1 tile of expert e has stored its pool rows and scales (their release, acquired here).
        auto l1_done = [&](int e) {
          // Pair walk: the expert's real 64-row halves (phantom halves count nothing).
          const int blocks =
              kPairs ? (__ldcg(expert_offset + e + 1) - __ldcg(expert_offset + e) + kBlockM - 1) / kBlockM
                     : __ldcg(tile_offset + e + 1) - __ldcg(tile_offset + e);
          return ptx::ld_acquire_gpu(sched + 1 + e) >= blocks * nblocks1;
        };
        bool grid_ready = false;
        for (int n = 0;; ++n) {
          const int i = n % kTileRingDepth;
          ptx::mbarrier_wait(&ring_full[i], (n / kTileRingDepth) & 1);
          const WorkTile t = tile_ring[i];
          ptx::mbarrier_arrive(&ring_empty[i]);
          if (t.expert < 0) {
            end_stage(stage, phase);
            break;
          }
          const GemmOperand& op = p.op[t.gemm];
          const int num_kblocks = op.k / kBlockK;
          // A phantom half (pair walk) has no token part: it streams its weight half for the other CTA.
          const bool has_tokens = !kPairs || t.rows > 0;
          if (has_tokens && !grid_ready) {
            ptx::grid_dependency_wait();
            ptx::launch_dependents();
            grid_ready = true;
          }
          if (kFused && has_tokens && t.gemm == 1) {
            // Warp-uniform (every lane's own acquire must have seen the count before any lane loads).
            while (!__all_sync(0xffffffffu, l1_done(t.expert))) __nanosleep(32);
            ptx::fence_proxy_async_global();  // the L1 tiles' generic stores, read next by TMA
          }
          const CUtensorMap* tmap_t = t.gemm ? &tmap_acts2 : &tmap_acts1;
          const bool wide = kTailRows > 0 && t.rows > kBlockM;  // a wide last block (see the consumers)
          const float* src_sf = op.acts_sf + t.row0;
          for (int kb = 0; kb < num_kblocks; ++kb) {
            wait_empty(stage, phase ^ 1);
            if (has_tokens) {
              if (lane == 0) {
                ptx::mbarrier_arrive_expect_tx(&full[stage], (wide ? kTileCols : kBlockM) * kBlockK);
                ptx::tma_load_2d(tile_b + stage * Smem::kTileB, tmap_t, &full[stage], kb * kBlockK, t.row0);
                // Rows kBlockM.. of a wide block: 64 rows = 8 swizzle atoms in, so the tile stays one K-major tile.
                if (wide)
                  ptx::tma_load_2d(tile_b + stage * Smem::kTileB + kBlockM * kBlockK,
                                   t.gemm ? &tmap_acts2_tail : &tmap_acts1_tail, &full[stage], kb * kBlockK,
                                   t.row0 + kBlockM);
              }
              // The tile's own token columns [row0, row0 + rows); the other slots keep old values (those columns
              // are never stored). NOTES: the columns past `rows` belong to the next expert, whose fused L1 tiles may
              // still be writing them; cp.async.ca would cache such lines in L1.
              float* dst = stage_scales + stage * (Smem::kScales / 4) + kBlockN / 64;
              const float* src = src_sf + int64_t(kb) * l.pool_rows;
#pragma unroll
              for (int c = lane; c < kTileCols; c += 32)
                if (c < t.rows) ptx::cp_async_4(dst + c, src + c);
              ptx::cp_async_mbarrier_arrive_noinc(&full[stage]);
            } else {
              ptx::mbarrier_arrive(&full[stage]);  // 32 lanes
              if (lane == 0) ptx::mbarrier_arrive(&full[stage]);  // in place of the expect_tx arrival
            }
            if (++stage == kNumStages) stage = 0, phase ^= 1;
          }
        }
      }
      ptx::cp_async_wait_all();
    }
    if constexpr (kPairs) ptx::cluster_sync();  // see the consumers' exit
    return;
  }

  // ========================================================================== consumers
  ptx::setmaxnreg_inc<232>();
#ifdef MEGAMOE_TILE_TRACE
  const uint64_t trace_launch = ptx::globaltimer_ns();  // before the grid dependency wait
#endif
  ptx::grid_dependency_wait();  // token tiles, scales and routing rows come from earlier kernels
  ptx::launch_dependents();
  const int consumer = warpgroup - 1;                 // owns weight rows [128 c, 128 c + 128) of the tile
  const int warp = (threadIdx.x / 32) % 4;            // warp within the warpgroup
  const int ctid = threadIdx.x - 128;                 // 0..255 over both consumers
  const int quad_row = warp * 16 + lane / 4;          // this thread's first row in a 64-row slice
  int stage = 0;
  uint32_t phase = 0;
#ifdef MEGAMOE_TILE_TRACE
  const uint64_t trace_entry = ptx::globaltimer_ns();  // after the grid dependency wait
  int trace_n = 0, trace_info[kTraceTiles][4];
  uint64_t trace_t[kTraceTiles][3], trace_e[kTraceTiles][4] = {};
  // SM clock at the main loop's start and end: cycles over the global timer's ns give the SM clock in situ (the
  // probes count cycles; the trace counts ns).
  int64_t trace_c[kTraceTiles][3];  // [2]: cycles the consumers waited for full stages in the main loop
  // Epilogue phases (L1: SwiGLU done, token amax shared, quantized, stored; L2: staged, copies issued).
  long long walk[2][8] = {};  // TraceRecord::walk
  uint64_t walk_mark = trace_entry;  // the previous tile's end, then this tile's first full stage, its later phases
  int walk_g = 0;                    // the tile's gemm
  auto trace_epilogue = [&](int i) {
    if (ctid == 0 && trace_n < kTraceTiles) trace_e[trace_n][i] = ptx::globaltimer_ns();
    if (ctid == 0) {
      const uint64_t now = ptx::globaltimer_ns();
      walk[walk_g][3 + i] += now - walk_mark, walk_mark = now;
    }
  };
#else
  auto trace_epilogue = [](int) {};
#endif
  const uint32_t tile_a_desc_lo = ptx::smem_desc_sw128_lo(tile_a), tile_b_desc_lo = ptx::smem_desc_sw128_lo(tile_b);
  // A consumed stage goes back to the producers that write it: this CTA's, and in the pair walk the other CTA's
  // (its multicast half lands here too).
  const uint32_t peer_empty = kPairs ? ptx::mapa_shared(ptx::smem_addr(empty), peer) : 0;
  // NOTES: every consumer thread arrives, each releasing its own reads of the stage's scales and WorkTile (an
  // arrive releases the arriving thread's accesses; one lane's arrive after __syncwarp covered the others only
  // through the warp barrier, which compute-sanitizer racecheck reports as write-after-read hazards once the ring
  // wraps within a tile).
  auto release = [&](int s) {
    ptx::mbarrier_arrive(&empty[s]);
    if constexpr (kPairs) {
      __syncwarp();
      if (lane == 0) ptx::mbarrier_arrive_remote(peer_empty + s * 8);
    }
  };

  // An L2 epilogue's bulk copies (issued by consumer threads < kTileCols) may still read the epilogue area.
  bool bulk_pending = false;
  for (;;) {
    ptx::mbarrier_wait(&full[stage], phase);  // the tile's first stage carries its WorkTile
    const WorkTile t = tile_infos[stage];
    if (t.expert < 0) break;  // the producer's end marker
    const bool is_l1 = kGemms == Gemms::kL1 || (kFused && t.gemm == 0);
    const int n = p.op[t.gemm].n, num_kblocks = p.op[t.gemm].k / kBlockK;
    // NOTES: n (= hidden in L2) is a multiple of 128, not always of 256: the last tile's upper half
    // then lies past this expert's rows; its scales are never read and its rows never stored.
    if (kPairs && t.rows == 0) {  // a phantom half: its stages carry the weight half the other CTA needs
      for (int kb = 0; kb < num_kblocks; ++kb) {
        ptx::mbarrier_wait(&full[stage], phase);
        release(stage);
        if (++stage == kNumStages) stage = 0, phase ^= 1;
      }
      continue;
    }
    const int first_row = t.n_block * kBlockN + consumer * 128;
    const bool valid0 = first_row < n, valid1 = first_row + 64 < n;

    // The epilogue's inputs from earlier kernels (final: the consumers waited for them at their start): L1 the rows'
    // top-k weights, L2 the rows' pool_src entries. At decode (block_m 16: at most 4 + 1 registers) they load when
    // the tile starts, so the epilogue does not wait for them; wider tiles load them in the epilogue (registers).
    // NOTES: tile trace (H100, 2026-11-24): the load cost the L1 epilogue ~0.9 µs at block_m 16, and at decode the
    // last L1 tiles' epilogues gate their expert's L2 tiles.
    constexpr bool kEarlyEpilogueInputs = kBlockM <= 16;
    const float* row_weight = reinterpret_cast<const float*>(p.buffer + l.dispatch_weight_offset);
    float col_w[kTileCols / 4];
    int row_src = -1;  // L2: thread ctid < t.rows copies out row ctid
    auto load_epilogue_inputs = [&] {
      if (is_l1) {
#pragma unroll
        for (int j = 0; j < kTileCols / 4; ++j) {
          const int col = 8 * (j / 2) + 2 * (lane % 4) + (j % 2);
          col_w[j] = col < t.rows ? row_weight[t.row0 + col] : 0.0f;
        }
      } else {
        if (ctid < t.rows) row_src = __ldcg(reinterpret_cast<const int*>(p.buffer + l.pool_src_offset) + t.row0 + ctid);
      }
    };
    if constexpr (kEarlyEpilogueInputs) load_epilogue_inputs();

    float acc0[kRegs], acc1[kRegs];
#pragma unroll
    for (int i = 0; i < kRegs; ++i) acc0[i] = 0.0f, acc1[i] = 0.0f;
#ifdef MEGAMOE_TILE_TRACE
    if (ctid == 0 && trace_n < kTraceTiles) {
      trace_info[trace_n][0] = t.gemm, trace_info[trace_n][1] = t.expert, trace_info[trace_n][2] = t.n_block;
      trace_info[trace_n][3] = t.rows;
      trace_t[trace_n][0] = ptx::globaltimer_ns();  // first stage full
      trace_c[trace_n][0] = clock64(), trace_c[trace_n][2] = 0;
    }
    if (ctid == 0) {
      const uint64_t now = ptx::globaltimer_ns();
      walk_g = is_l1 ? 0 : 1;
      walk[walk_g][0] += 1, walk[walk_g][1] += now - walk_mark, walk_mark = now;
    }
#endif

    for (int kb = 0; kb < num_kblocks; ++kb) {
#ifdef MEGAMOE_TILE_TRACE
      const int64_t trace_w0 = clock64();
#endif
      ptx::mbarrier_wait(&full[stage], phase);
#ifdef MEGAMOE_TILE_TRACE
      if (ctid == 0 && trace_n < kTraceTiles) trace_c[trace_n][2] += clock64() - trace_w0;
#endif
      // Scales of this stage from shared memory (read before the stage is released): this consumer's two
      // weight chunks (0 past n: those rows are never stored) and this thread's token columns.
      const float* sc = stage_scales + stage * (Smem::kScales / 4);
      const float ws0 = valid0 ? sc[consumer * 2] : 0.0f, ws1 = valid1 ? sc[consumer * 2 + 1] : 0.0f;
      const uint32_t a_lo = tile_a_desc_lo + (stage * Smem::kTileA + consumer * 128 * kBlockK) / 16;
      const uint32_t b_lo = tile_b_desc_lo + stage * (Smem::kTileB / 16);
      if constexpr (kOnePartial) {
        // An expert's last block of at most 64 / 96 rows runs m64n64 / m64n96: half / three quarters of the MMA
        // work. Each narrow fragment is the first registers of the m64n128 one (same columns; the rest stay 0 and are
        // never stored), so the epilogue does not change. NOTES: H100 A/B (2026-11-26, docs/perf-notes.md, 25th
        // session): n96 -2 % per replay and -6 % in a graph at V4-Flash T=3840 / 4096 (90 / 96 rows per expert),
        // -1.7 % at V4-Pro 6144; an m64n32 for blocks of at most 32 rows gained nothing there.
        if (t.rows <= 64)
          one_partial_stage<ptx::WgmmaFP8<64>>(acc0, acc1, a_lo, b_lo, sc + kBlockN / 64, ws0, ws1, lane);
        else if (t.rows <= 96)
          one_partial_stage<ptx::WgmmaFP8<96>>(acc0, acc1, a_lo, b_lo, sc + kBlockN / 64, ws0, ws1, lane);
        else
          one_partial_stage<Mma>(acc0, acc1, a_lo, b_lo, sc + kBlockN / 64, ws0, ws1, lane);
        release(stage);
        if (++stage == kNumStages) stage = 0, phase ^= 1;
        continue;
      }
      // A wide last block (more than kBlockM rows) on m64n(kTileCols), the others on m64n(kBlockM): same bits per
      // output (each output's k order is the same), as block_m 128's m64n64 tail (test_wide_tail_equals_narrow).
      auto released = [&] {
        release(stage);
        if (++stage == kNumStages) stage = 0, phase ^= 1;
      };
      if (kTailRows > 0 && t.rows > kBlockM)
        two_partial_stage<MmaWide>(acc0, acc1, a_lo, b_lo, sc + kBlockN / 64, ws0, ws1, lane, released);
      else
        two_partial_stage<Mma>(acc0, acc1, a_lo, b_lo, sc + kBlockN / 64, ws0, ws1, lane, released);
    }

#ifdef MEGAMOE_TILE_TRACE
    if (ctid == 0 && trace_n < kTraceTiles)
      trace_t[trace_n][1] = ptx::globaltimer_ns(), trace_c[trace_n][1] = clock64();  // main loop done
    if (ctid == 0) {
      const uint64_t now = ptx::globaltimer_ns();
      walk[walk_g][2] += now - walk_mark, walk_mark = now;
    }
#endif
    // ======================================================================== epilogue
    if constexpr (!kEarlyEpilogueInputs) load_epilogue_inputs();
    if (bulk_pending) {  // the last L2 epilogue's copies have read the area before anyone writes it
      if (ctid < kTileCols) ptx::bulk_wait_group_read<0>();
      ptx::named_barrier_sync(1, kNumConsumerThreads);
      bulk_pending = false;
    }
    // The epilogue over the fragment registers the tile's wgmmas wrote (kLive: all of them for a wide last block, the
    // narrow tile's first Mma::kNumRegs otherwise), each a compile-time loop bound.
    // NOTES: a runtime bound in these unrolled loops (a break per register pair) kept ptxas from interleaving the
    // elements' chains, as the fast_math branch once did in swiglu_fragment: +3 to +13 % at V4-Flash / V4-Pro
    // T=2048-8192 (H100 A/B, 2026-11-26, the wide-tail build with its tail off).
    auto epilogue_regs = [&](auto live) {
      constexpr int kLive = decltype(live)::value;
      constexpr int kCols = 2 * kLive;  // token columns those registers hold
      if (is_l1) {
        // SwiGLU in registers: acc0 = gate rows, acc1 = the matching up rows.
        float* amax_smem = reinterpret_cast<float*>(epilogue + kTileCols * 128);  // [8 warps][kTileCols]
        swiglu_fragment<false, kLive>(acc0, acc1, col_w, col_w, p.fast_math, p.activation_clamp);
        trace_epilogue(0);
        // Per-token amax over this tile's 128 outputs (= one L2 scale block): registers, then lanes
        // sharing a column (xor 4, 8, 16), then the 8 consumer warps through shared memory.
        store_token_amax<kCols>(acc0, amax_smem + (consumer * 4 + warp) * kTileCols, lane);
        ptx::named_barrier_sync(1, kNumConsumerThreads);
        // Each token's scale and its inverse, once: consumer thread c < kTileCols reduces token c's 8 warp partials
        // (warp order, so the result does not depend on timing) and stores the scale to the pool too.
        // NOTES: tile trace (H100, V4-Flash T=8192, 2026-11-25): with every thread reducing its own 16 tokens (128
        // loads, 16 divisions and reciprocals per thread) this phase took ~3 µs of a ~6.6 µs L1 epilogue; now ~1.2.
        float* token_scale = amax_smem + 8 * kTileCols;  // [kTileCols] scales, then [kTileCols] inverses
        if (ctid < kCols) {
          float amax = 0.0f;
#pragma unroll
          for (int w = 0; w < 8; ++w) amax = max_nan(amax, amax_smem[w * kTileCols + ctid]);
          const float scale = max_nan(amax, kAmaxEps) / kFP8Max;
          token_scale[ctid] = scale, token_scale[kTileCols + ctid] = 1.0f / scale;
          if (ctid < t.rows)
            reinterpret_cast<float*>(p.buffer + l.pool_sf_offset)[int64_t(t.n_block) * l.pool_rows + t.row0 + ctid] =
                scale;
        }
        ptx::named_barrier_sync(1, kNumConsumerThreads);
        trace_epilogue(1);
        uint8_t* out_tile = epilogue;  // [kTileCols tokens][128 outputs] E4M3
#pragma unroll
        for (int j = 0; j < kCols / 4; j += 2) {
          const int col = 8 * (j / 2) + 2 * (lane % 4);  // and col + 1 (j + 1)
          const float2 scale = *reinterpret_cast<const float2*>(token_scale + col);
          const float2 inv = *reinterpret_cast<const float2*>(token_scale + kTileCols + col);
          const int i0 = (j / 2) * 4;
          const int out = consumer * 64 + quad_row;
          const float v00 = p.fast_math ? acc0[i0] * inv.x : acc0[i0] / scale.x;
          const float v01 = p.fast_math ? acc0[i0 + 2] * inv.x : acc0[i0 + 2] / scale.x;
          const float v10 = p.fast_math ? acc0[i0 + 1] * inv.y : acc0[i0 + 1] / scale.y;
          const float v11 = p.fast_math ? acc0[i0 + 3] * inv.y : acc0[i0 + 3] / scale.y;
          out_tile[staged_offset<uint8_t, 128>(col, out)] = to_fp8(v00);
          out_tile[staged_offset<uint8_t, 128>(col, out + 8)] = to_fp8(v01);
          out_tile[staged_offset<uint8_t, 128>(col + 1, out)] = to_fp8(v10);
          out_tile[staged_offset<uint8_t, 128>(col + 1, out + 8)] = to_fp8(v11);
        }
        ptx::named_barrier_sync(1, kNumConsumerThreads);
        trace_epilogue(2);
        // Coalesced copy-out: 8 x 16 bytes per token row.
        const int inter = n / 2;
        for (int c = ctid; c < kCols * 8; c += kNumConsumerThreads) {
          const int col = c / 8, part = c % 8;
          if (col < t.rows)
            *reinterpret_cast<uint4*>(p.buffer + l.pool_offset + int64_t(t.row0 + col) * inter + t.n_block * 128 +
                                    part * 16) =
              reinterpret_cast<const uint4*>(out_tile)[col * 8 + staged_chunk(col, part)];
        }
        if constexpr (kFused) ptx::fence_proxy_async_global();  // this thread's pool stores, read by L2's TMA
        ptx::named_barrier_sync(1, kNumConsumerThreads);
        trace_epilogue(3);
        if constexpr (kFused) {
          // This L1 tile's outputs (rows and scales, every consumer thread's, ordered by the barrier) are
          // stored: count it for its expert; the expert's L2 tiles wait for the count (token producer).
          // NOTES: the release is cumulative (PTX memory model: the other threads' stores precede it through the
          // CTA barrier), so no fence before it; a __threadfence() there compiled to MEMBAR.SC.GPU and an L1
          // invalidate ahead of the release's own MEMBAR.ALL.GPU: ~1.6 µs per L1 tile on this thread, whose
          // warpgroup's next wgmmas wait for it (tile trace, H100, V4-Flash T=8192, 2026-11-25).
          if (ctid == 0) ptx::red_release_gpu_add(sched + 1 + t.expert, 1);
        }
      } else {
        // L2: bf16 rows into the combine area of the token's rank at (token, slot) (NVLink stores for a peer), one
        // bulk copy per row, which no consumer waits for until the next epilogue (bulk_pending).
        // NOTES: rows of kStagedL2RowBytes (256 outputs + 16 bytes): a fragment store's 4 token columns fall into
        // different banks (no conflict; 512-byte rows gave 4-way conflicts, ~0.8 µs per tile), and each row stays
        // contiguous for its bulk copy. Tile trace (H100, V4-Flash T=8192, 2026-11-25): the L2 epilogue was 3.4 µs per
        // tile, 1.7 of them the synchronous 16-byte stores of store_combine_tile.
        __nv_bfloat16* out_tile = reinterpret_cast<__nv_bfloat16*>(epilogue);  // [kTileCols][kStagedL2RowBytes / 2]
        constexpr int kRow = kStagedL2RowBytes / 2;
#pragma unroll
        for (int i = 0; i < kLive; ++i) {
          const int col = 8 * (i / 4) + 2 * (lane % 4) + (i % 2);
          const int row = consumer * 128 + quad_row + ((i / 2) % 2) * 8;
          out_tile[col * kRow + row] = __float2bfloat16_rn(acc0[i]);
          out_tile[col * kRow + row + 64] = __float2bfloat16_rn(acc1[i]);
        }
        ptx::fence_proxy_async_shared();  // generic-proxy writes -> the bulk copies (async proxy)
        ptx::named_barrier_sync(1, kNumConsumerThreads);
        trace_epilogue(0);
        if (ctid < kTileCols)
          bulk_store_combine_row<kBlockN>(row_src, out_tile + ctid * kRow, p.buffer, l, t.n_block, n);
        bulk_pending = true;
        trace_epilogue(1);
      }
    };
    if constexpr (kTailRows > 0) {
      if (t.rows > kBlockM) epilogue_regs(std::integral_constant<int, kRegs>{});
      else epilogue_regs(std::integral_constant<int, Mma::kNumRegs>{});
    } else {
      epilogue_regs(std::integral_constant<int, kRegs>{});
    }
#ifdef MEGAMOE_TILE_TRACE
    if (ctid == 0 && trace_n < kTraceTiles) trace_t[trace_n++][2] = ptx::globaltimer_ns();  // epilogue done
    if (ctid == 0) {
      const uint64_t now = ptx::globaltimer_ns();
      walk[walk_g][7] += now - walk_mark, walk_mark = now;
    }
#endif
  }
  // The combine kernel reads these rows after this grid completes (and, with peers, after every rank signalled).
  if (ctid < kTileCols) ptx::bulk_wait_group<0>();
  if constexpr (kPairs) ptx::cluster_sync();  // no multicast or remote arrival may reach an exited CTA
#ifdef MEGAMOE_TILE_TRACE
  if (ctid == 0 && blockIdx.x < kTraceMaxCtas) {
    TraceRecord& r = g_fp8_trace[blockIdx.x];
    r.sm = trace_smid(), r.entry = trace_entry, r.launch = trace_launch, r.consumer_n = trace_n;
    for (int i = 0; i < trace_n; ++i) {
      for (int j = 0; j < 4; ++j) r.info[i][j] = trace_info[i][j], r.e[i][j] = trace_e[i][j];
      for (int j = 0; j < 3; ++j) r.t[i][j] = trace_t[i][j];
      r.c[i][0] = trace_c[i][1] - trace_c[i][0], r.c[i][1] = trace_c[i][2];
    }
    for (int g = 0; g < 2; ++g)
      for (int j = 0; j < 8; ++j) r.walk[g][j] = walk[g][j];
    r.exit = ptx::globaltimer_ns();  // the walk's tiles end at entry + the sums; the rest waited for the end marker
  }
#endif
#else
  __trap();  // built for a GPU without wgmma: the host never launches this
#endif
}

}  // namespace megamoe::kernels
