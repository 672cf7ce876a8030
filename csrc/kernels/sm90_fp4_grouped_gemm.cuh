// Grouped GEMM for FP4 expert weights (MXFP4 / NVFP4) on Hopper: one persistent launch walks
// (expert, token block, 256 weight rows) tiles, as the FP8 kernel does (swap AB: weights are the
// 64-row wgmma A operand, tokens the N dimension); block_m 128 (MXFP4 w4a8 only) walks 128-row tiles (Roles).
//
// Hopper has no FP4 MMA. Everything is decoded on chip to BF16 and multiplied by a BF16 wgmma with
// float32 accumulation over the whole K: E2M1 x UE8M0, E2M1 x UE4M3 (<= 6 significant bits),
// E4M3 x UE8M0 are all exact in bf16, so no per-block promotion is needed and the products are exact.
// Only the float32 factors (NVFP4 per-expert weight global scale, NVFP4 per-token activation global
// scale) are applied, once, in the epilogue.
//
// Warp roles (384 (block_m 128), 512 or 640 threads, see Roles): warpgroup 0 = producer: thread 0 issues the TMA loads (packed weights
// 256 rows x 128 bytes = 256 K, 128B-swizzled; the token tile), warp 1 copies the block scales with
// cp.async: the weights' (rows of K/32 or K/16 bytes: too narrow for TMA) and the tokens' (a 4-byte
// aligned window of block_m + 4 bytes per K block around the tile's first row, which has any alignment),
// warps 2-3 convert each stage's token tile into a 128B-swizzled bf16 tile (a ring of kNumBfTiles); with two
// consumer warpgroups (block_m 32 / 64) a last warpgroup of four more converter warps joins them.
// NOTES: the token scales were a plain (unswizzled) TMA box first; that load stopped the H100 with an
// illegal instruction (2026-11-22), so they take the same cp.async path as the weight scales.
// The other warpgroups = consumers: two owning 128 weight rows = two 64-row slices each (L1: gate chunk + up
// chunk), or, for decode block sizes, four owning one 64-row slice each (L1: the up consumer hands its
// values to the gate consumer in the epilogue).
// Each consumer decodes its weights from shared memory straight into the wgmma A fragment (registers)
// and issues m64nNk16 wgmmas whose B descriptor points at the bf16 tile. The consumers never wait for
// each other in the main loop (mbarriers only), and keep one wgmma group in flight across stages.
// NOTES: v1 had the consumers convert the token tile themselves, then a named barrier, then their
// wgmmas, then a full wgmma wait every stage; that lock step left the schedulers idle half the time
// (ncu, H100, V4-Flash T=16: 0.52 issued warps per scheduler per cycle, DRAM at 52%).
//
// K order. A dot product does not depend on the order of K, so the kernel uses its own order inside
// each 128-K group, the same for A and B: thread q = lane % 4 of a fragment row owns the 32 contiguous
// physical K [32q, 32q + 32) of the group (16 packed bytes: one uint4 shared-memory load, one MXFP4
// scale, two NVFP4 scales). Physical element j = 8t + p + 4e of that range (t: 32-bit word, p < 4,
// e < 2) sits at logical k16 step 2t + p/2, fragment column 2q + 8(p % 2) + e. With that order one
// E2M1 word yields four bf16 pairs (nibbles p, p + 4) with a few shifts and masks.
//
// Exponent split. A decoded E2M1 nibble is e2m1 x 2^-126 (its 3 magnitude bits placed at bf16 bits
// 6-8: subnormal for codes 0 and 1); one bf16 multiply by s x 2^94 (s = the block scale) gives
// A = w x 2^-32 exactly, and tokens are converted as B = x x 2^32, so A.B is the true product.
// Limits of that split: MXFP4 weight scales up to 2^33 and activations up to 2^95 (real weights have
// scales near 2^-7, activations are bf16 model values).
//
// FP8-wgmma path (kFP8Mma, MXFP4 weights; the default for them, heuristics::choose_mxfp4_fp8_mma): per row, E = the
// largest of its UE8M0 scales over the whole K (transform_weights' row exponents, Params::weights_row_exp); each 32-K
// sub-block's weights are decoded to the E4M3 bytes of e2m1 x 2^(6 - (E - e_j)) by one PRMT table lookup per 4 weights
// (exact while E - e_j <= 14, rounded to nearest even past that: kFoldHeadroom), the converters fold the tokens into an
// E4M3 tile relative to each group's largest scale (x x 2^-(T - t_j), T the token's largest scale of the 128-K group;
// FP8 tokens arrive folded instead, L1's by the gather and L2's by L1's epilogue (at block_m 128 by launch_pool_fold),
// heuristics::fp4_folded_tokens, and so do MXFP4 tokens into a workspace (the converters' fold; L2's after a block_m
// 128 L1 by launch_fold_mxfp4), heuristics::fp4_fold_mxfp4_tokens: the wgmmas read the stage's token tile as the TMA
// left it), four k32 wgmmas per
// group (as wide as the tile's rows: 16 / 32 / 48 / 64; block_m 128 also 96 / 128) go into a partial accumulator, and
// the promotion adds it times 2^(T - 127) (one FFMA per accumulator); the rows' 2^(E - 133) multiply the accumulators
// once, after the tile's K. Where a row's scales span at most 8 binades this gives the bits of the fold relative to
// each 128-K group's largest scale (until the thirtieth session; every step is exact or scales by a power of two).
// Half the wgmma instructions of the BF16 path at twice the tensor rate, 1.25 decode instructions per weight instead
// of ~2.5. Decode and K order: bit model docs/models/mxfp4_fp8_decode.py; error of the fold: benchmarks/fold_error.py
// (docs/perf-notes.md).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <stdexcept>
#include <string>
#include <type_traits>

#include "heuristics/sm90.hpp"
#include "kernels/launch.hpp"
#include "kernels/sm90_common.cuh"
#include "megamoe/ptx/sm90.cuh"

namespace megamoe::kernels::fp4 {

constexpr int kBlockK = 256;  // K per stage (128 packed bytes per weight row)

// Consumer warpgroups per block. Decode (block_m 16): four, one 64-row slice each, so that every
// scheduler has four consumer warps to switch between (the decode and the wgmma waits of one warp are
// latency-bound: ncu saw 2.5 active, 0.73 eligible warps per scheduler with two consumer warpgroups).
// block_m 32 and 64: two, two slices each. NOTES: block_m 32 with four (640 threads: 104 registers per consumer
// thread after setmaxnreg; L1 spilled 16-36 bytes, L2 none; two converter warps) ran 1-24 % slower than with two at
// 16-36 rows per expert and -2 to +7 % at 4-12 rows, every FP4 pair, both models (H100, 2026-11-26, both forced to
// block_m 32; docs/bench/h100-2026-11-26-ab-fp4-bm32-four-consumers-rejected.json).
// NOTES: four consumer warpgroups in L2 at block_m 32 / 64 (no spill there; 640 threads with two converter warps, or
// 768 with the converter warpgroup) were 3-7 % / 0-6 % slower at V4-Flash T=2048 and 8192 (H100, 2026-11-25, in a
// graph; docs/bench/h100-2026-11-25g-ab-l2-four-consumers-rejected.json): more consumer warps per scheduler did not
// hide the consumers' decode -> wgmma -> wait chain there.
// Converter warps (token tile -> bf16 / E4M3 tile): producer warps 2-3, and with two consumer warpgroups a fourth
// warpgroup of four more after the consumers. NOTES: at prefill block sizes the two converter warps bounded the
// stage: without any conversion (ablate.py fp4-no-convert) V4-Flash T=2048 ran 18-23 % faster (H100, 2026-11-25);
// with the converter warpgroup, 2-9 % faster at T=2048 / 8192 (same day, docs/bench/h100-2026-11-25g-ab-fp4-no-convert.json).
// Block_m 128 (the FP8-wgmma path with folded tokens only: a 128 x 128 tile, heuristics::fp4_tile_n): two consumer
// warpgroups of one 64-row slice each (L1: the gate slice and its up slice, exchanged as at block_m 16), and no
// converter warpgroup (producer warps 2-3 have nothing to convert): 384 threads, 224 registers per consumer thread.
template <int kBlockM>
struct Roles {
  static constexpr int kConsumers = kBlockM <= 16 ? 4 : 2;
  static constexpr int kSlices = kBlockM == 128 ? 1 : 4 / kConsumers;  // 64-row slices per consumer (L1: a gate + up pair when 2)
  static constexpr int kTileN = 64 * kConsumers * kSlices;           // weight rows per tile (heuristics::fp4_tile_n)
  static_assert(kTileN == heuristics::fp4_tile_n(kBlockM), "tile rows");
  static constexpr int kConsumerThreads = 128 * kConsumers;
  static constexpr int kConverterWarps = kConsumers == 2 && kBlockM != 128 ? 6 : 2;
  static constexpr int kConverterGroup = kConverterWarps > 2 ? 1 + kConsumers : -1;  // the fourth warpgroup, if any
  static constexpr int kThreads = 128 + kConsumerThreads + (kConverterWarps > 2 ? 128 : 0);
  // setmaxnreg: the launch gives every thread 65536 / kThreads registers (rounded down to 8); the producer
  // warpgroup (and the converter warpgroup) give part back. 512 threads: 128 -> 56 / 200; 640 threads: 96 -> 48 / 104.
  static constexpr int kLaunchRegs = (65536 / kThreads) / 8 * 8;
  static constexpr int kProducerRegs = kConsumers == 2 ? 56 : 48;
  static constexpr int kConsumerRegs =
      ((kLaunchRegs * kThreads - (kThreads - kConsumerThreads) * kProducerRegs) / kConsumerThreads) / 8 * 8;
  static_assert(kConsumerRegs >= kLaunchRegs && kConsumerRegs <= 256, "register split");
  static_assert(kProducerRegs <= kLaunchRegs &&
                    (kThreads - kConsumerThreads) * kProducerRegs + kConsumerThreads * kConsumerRegs <= 65536,
                "register split exceeds the register file");
  // The converters' thread index: producer warps 2-3 first (64 threads), then the converter warpgroup's 128.
  static_assert(kConverterWarps * 32 == 64 + (kConverterGroup >= 0 ? 128 : 0), "converter thread mapping");
};
// Weight scale bytes per row per stage in shared memory: NVFP4's 16 (one stage's); MXFP4's 8 per stage at byte 8 x (kb %
// 2) (a bulk copy of a scale tile brings stages 2j and 2j + 1: formats.hpp).
constexpr int kScaleWordsBytes = kScaleTileBytes;

struct Params {
  const uint8_t* weights_sf;       // [E * n, k / wblk] (UE8M0 per 32 or UE4M3 per 16)
  const float* weights_global_sf;  // [E] (NVFP4) or nullptr
  const uint8_t* acts_sf;          // token scales [k / blk, pool_rows] bytes
  const float* acts_global_sf;     // [pool_rows] (NVFP4 activations) or nullptr
  float* scratch;                  // L1 with NVFP4 activations: float32 [rows, n / 2] SwiGLU outputs
  uint8_t* buffer;
  layout::BufferLayout l;
  int n, k;
  float activation_clamp;  // < 0: none
  bool fast_math;
  bool wide_scale_copies;  // k % 256 == 0 and weights_sf 16-byte aligned: one copy per scale row and stage
  bool scale_tiles;        // weights_sf holds scale tiles (formats.hpp: fp4_scale_tiles; 16-byte aligned)
  bool scale_tma;          // scale_tiles: the TMA thread bulk-copies each stage's (heuristics::fp4_scale_tma)
  bool narrow_mma;         // BF16 path: wgmmas only as wide as the tile's rows (heuristics::fp4_narrow_mma)
  // FP8-wgmma path, FP8 tokens: they arrive folded (L1: launch_gather's fold; L2: L1's epilogue, fold_output): E4M3
  // rows in the tile's order, float factors [k / 128, pool_rows] at acts_sf, so the consumers multiply the token tile
  // as it lands and the converters have nothing to do (heuristics::fp4_folded_tokens).
  bool folded_tokens;
  // Split K of the last round (see SplitPlan); split_round 0: off (no workspace).
  int split_round;      // the tiles of one round (the grid; tests force fewer)
  // L1 on the FP8-wgmma path with FP8 tokens: the epilogue writes L2's input folded as the gather writes L1's, and L2
  // runs with folded_tokens. (Here, in the padding before `partials`: the other fields keep their offsets.)
  bool fold_output;
  bool rotate_rounds;   // whole tiles: round r's tiles rotated by r among the CTAs (split_unit)
  float* partials;      // [split_round units][kSlices * kRegs][consumer threads]: each split unit's accumulators
  int* split_counters;  // [split_round / 2]: a split tile's units that have finished; zero at launch (gather zeroes it)
  // FP8-wgmma path: [E * n] each weight row's largest UE8M0 scale over the whole K (transform_weights), the exponent its
  // weights are folded relative to. A unit's first stage carries its rows' bytes (Smem::kRowExpOffset).
  const uint8_t* weights_row_exp;
  // L1 reading MXFP4 tokens folded upstream (kOutFP4) with fold_output: L2's input, folded as the gather folds L1's,
  // E4M3 rows [pool rows, n / 2] and float factors [n / 256, pool_rows] (the caller's workspace; the E2M1 pool is not
  // written).
  uint8_t* fold_out;
  float* fold_out_factors;
};

// Split K of the last round: when the last of R >= 2 rounds of tiles holds L <= round / 2 tiles (few tokens: V4-Pro
// T=1 has 144 L1 tiles and 168 L2 tiles on 132 SMs, T=2 288 L1 tiles), those L tiles would keep L SMs busy for a
// whole tile while the others idle. Each of them is cut into s = min(round / L, K blocks, kMaxSplits) units of its K
// blocks, which run side by side on s CTAs: units [0, (R - 1) round) are the earlier rounds' tiles, whole; unit
// (R - 1) round + r is split r % s of tile (R - 1) round + r / s. A split unit's consumers store their float32
// accumulators; the tile's last unit to finish sums all of them in split order (the result does not depend on which
// one is last) and runs the epilogue.
// Compiled only where kSplitK (block_m 16; see launch_layer). kMaxSplits bounds the last unit's partial loads (8 x
// 256 x 16 floats at block_m 16); V4-Pro T=1 takes 8 in L1 (12 tiles left, 28 K blocks), 3 in L2 (36 left).
// NOTES: splitting every tile into 1-4 units (2026-11-26, commit 1515ebf: benchmarks/patches/fp4-split-k.patch) lost
// at V4-Flash T=1 (+27-38 %): each CTA ran three units, each ending in a join of all its consumers. Here a CTA runs
// at most one split unit, after its whole tiles. H100 A/B (2026-11-26, 2 rounds, every FP4 pair,
// docs/bench/h100-2026-11-26-ab-fp4-split-last-round.json, -split-last-of-3-rounds.json): V4-Pro T=1 0.77-0.80,
// T=2 0.89-0.90, V4-Flash T=2 0.94-0.97, T=3 0.90-0.93 per replay.
constexpr int kMaxSplits = 8;
struct SplitPlan {
  int whole, splits;  // units [0, whole) are whole tiles; the tiles after them take `splits` units each
  __device__ __forceinline__ int num_units(int num_tiles) const { return whole + (num_tiles - whole) * splits; }
};
__device__ __forceinline__ SplitPlan split_plan(int num_tiles, int round, int num_kblocks) {
  if (round <= 0 || num_tiles <= round) return {num_tiles, 1};
  const int whole = (num_tiles - 1) / round * round, rest = num_tiles - whole;  // rest: the last round's tiles
  if (2 * rest > round) return {num_tiles, 1};
  const int s = min(min(round / rest, num_kblocks), kMaxSplits);
  return s >= 2 ? SplitPlan{whole, s} : SplitPlan{num_tiles, 1};
}
struct SplitUnit {
  int tile, split, kb_begin, kb_end;  // split < 0: a whole tile
};
// Whole tiles: CTA b runs units b, b + grid, ... (round r = unit / grid); with `rotate` (Params::rotate_rounds,
// heuristics::fp4_rotate_rounds) round r's tiles are rotated by r among its CTAs: unit r grid + b is tile
// r grid + (b + r) mod (the round's whole tiles). Each round still holds the same tiles
// (the weight and token blocks a wave shares in L2), but a CTA no longer takes the same token block of every expert.
// NOTES: without it CTA b took tiles b + r grid; token blocks are innermost (decode_tile_warp) and an expert's tiles
// start at a multiple of its n-blocks, so with the grid (132) a multiple of the experts' token-block count (2, 3, 4)
// each CTA took the same token block throughout: at V4-Flash T=8192 (MXFP4, block_m 128, ~192 rows per expert) the even
// CTAs ran every full 128-row tile and the odd CTAs every ~64-row one (H100 tile trace, 2026-11-26: L1 23.8 against
// ~21 us per tile, L2 13.3 against ~11), and the odd half idled at the end of each GEMM.
template <bool kSplitK>
__device__ __forceinline__ SplitUnit split_unit(int unit, const SplitPlan& plan, int num_kblocks, bool rotate) {
  if (!kSplitK || unit < plan.whole) {
    // Past the walk's end (a CTA's first unit is computed before it is checked against the walk: a rank with no rows
    // has no whole tile) the unit maps to itself, as rotated_tile requires.
    if (!rotate || unit >= plan.whole) return {unit, -1, 0, num_kblocks};
    return {rotated_tile(unit, plan.whole), -1, 0, num_kblocks};
  }
  const int r = unit - plan.whole, s = plan.splits;
  SplitUnit u;
  u.tile = plan.whole + r / s, u.split = r % s;
  u.kb_begin = u.split * num_kblocks / s, u.kb_end = (u.split + 1) * num_kblocks / s;
  return u;
}

// kCols: token columns of the widest tile (block_m, or block_m + the wide last block's tail rows:
// heuristics::fp4_tile_cols).
template <int kBlockM, int kCols, bool kActFP4>
struct Smem {
  static constexpr int kNumBfTiles = heuristics::fp4_num_bf_tiles(kBlockM);
  static constexpr int kTileN = heuristics::fp4_tile_n(kBlockM);
  static constexpr int kTileA = kTileN * kBlockK / 2;
  static constexpr int kTileB = heuristics::fp4_round_1k(kCols * (kActFP4 ? 128 : 256));
  static constexpr int kTileSW = kTileN * kScaleWordsBytes;
  static constexpr int kSARow = kCols + 4;  // bytes per token-scale row (4-byte aligned window)
  static constexpr int kTileSA = heuristics::fp4_act_sf_bytes(kCols, kActFP4);
  // The rows' exponents (FP8-wgmma path) in the token-scale tile's last kTileN bytes, past its (kActFP4 ? 16 : 8) rows of
  // kSARow bytes (or the folded tokens' two rows of float factors): apart from the weight scale tile, which the TMA
  // writes whole.
  static constexpr int kRowExpOffset = kTileSA - kTileN;
  static_assert((kActFP4 ? 16 : 8) * kSARow <= kRowExpOffset, "the row exponents fit past the token scales");
  static constexpr int kStage = kTileA + kTileB + kTileSW + kTileSA;
  static_assert(kStage == heuristics::fp4_stage_bytes(kBlockM, kCols, kActFP4), "stage bytes as the heuristics count");
  static constexpr int kTileBF = heuristics::fp4_bf_tile_bytes(kBlockM, kCols);  // one bf16 token tile
  template <int kStages>
  static constexpr int bytes() {
    return 1024 /* alignment slack */ + kStages * kStage + kNumBfTiles * kTileBF + 256 /* barriers */ +
           256 /* FP8-wgmma path: fold tables */ + (kCols != kBlockM ? 512 : 0) /* wide tail: early epilogue inputs */;
  }
};

// Nibbles p and p + 4 of `w` -> a bf16 pair (low half: nibble p) holding e2m1 x 2^-126: magnitude bits
// to bf16 bits 6-8 (exponent bits 7-8, mantissa bit 6; exponent 0 = the E2M1 subnormal 0.5), sign to 15.
// One mask, one multiply, one mask: x * (2^a + 2^b) = (x << a) + (x << b), and the two shifted copies of the
// two nibbles never share a bit (no carries), so the sum places the magnitudes at 6-8 / 22-24 and the signs
// at 15 / 31 at once (the stray bits fall outside the final mask). Nibbles 2, 3 (and 6, 7) are taken from
// w >> 8, shared by both. Was two shifts and two masks per pair (checked equal for every nibble pair).
template <int p>
__device__ __forceinline__ uint32_t e2m1x2_raw(uint32_t w) {
  static_assert(p >= 0 && p < 4);
  constexpr int pp = p % 2;
  const uint32_t v = p >= 2 ? w >> 8 : w;
  const uint32_t x = v & (0x000F000Fu << (4 * pp));
  return (x * ((1u << (6 - 4 * pp)) + (1u << (12 - 4 * pp)))) & 0x81C081C0u;
}

constexpr uint32_t kBF16x2Pow2_126 = 0x7E807E80u;  // (2^126, 2^126)
constexpr int kSplit = 32;                          // A = w x 2^-32, B = x x 2^32

// Weight block scale -> the bf16 pair factor s x 2^(126 - kSplit) that turns a raw nibble into A.
__device__ __forceinline__ uint32_t weight_factor_mx(uint32_t b) {
  // 2^(b - 127 + 94): bf16 exponent field b + 94 (b = 255 is NaN; past the range: inf, never silent)
  const uint32_t e = b + 127 + 126 - kSplit - 127;
  const uint32_t h = b == 255 ? 0x7FC0u : e >= 255 ? 0x7F80u : e << 7;
  return h | (h << 16);
}
// NVFP4: a UE4M3 (E4M3 bits) block scale -> the bf16 bits of s x 2^(126 - kSplit), any byte (subnormal, zero, NaN and
// negative E4M3 values included).
__device__ __forceinline__ uint32_t weight_factor_nv_bits(uint32_t b) {
  const float s = __half2float(__half(__nv_cvt_fp8_to_halfraw(static_cast<uint8_t>(b), __NV_E4M3))) * 0x1p94f;  // exact
  return __float_as_uint(s) >> 16;  // exact: at most 4 significant bits
}
// True where every byte of t lies in [8, 0x7E] (the normal, finite, positive UE4M3 scales): a byte below 8 borrows
// (its difference byte >= 0xF8), 0x7F plus one becomes 0x80, and bytes from 0x80 on carry their own top bit; valid
// bytes neither borrow nor carry, so whatever an invalid byte does to its neighbours, the test holds only if none is.
__device__ __forceinline__ bool ue4m3_normal_bytes(uint32_t t) {
  return (((t - 0x08080808u) | (t + 0x01010101u) | t) & 0x80808080u) == 0u;
}
// The two 16-K block scales of rows r and r + 8 for this thread's 32 K (sa, sb: the first block's byte low) -> one
// register a row holding both factors (low half: the first block's), which decode_rows_bf16 broadcasts half by half.
// For a normal byte b = e << 3 | m, (b << 4) + (214 << 7) is the bf16 of 1.m x 2^(e - 7) x 2^94 (exponent field
// e - 7 + 94 + 127): one PRMT spreads a row's two bytes to the halves and one IMAD (a LEA in SASS) places both.
// Bytes outside [8, 0x7E] take weight_factor_nv_bits on a branch that real checkpoints take only for zero or tiny
// blocks (NOTES: was an F2FP, HADD2, FMUL and two bit operations per factor, plus its byte's extraction: 24
// instructions a 128-K group and thread against 4 and the range test's 5).
__device__ __forceinline__ void weight_factors_nv(uint32_t sa, uint32_t sb, uint32_t& fa, uint32_t& fb) {
  fa = ptx::prmt(sa, 0u, 0x4140u) * 16u + 0x6B006B00u;
  fb = ptx::prmt(sb, 0u, 0x4140u) * 16u + 0x6B006B00u;
  if (__builtin_expect(!ue4m3_normal_bytes(ptx::prmt(sa, sb, 0x5410u)), 0)) {
    fa = weight_factor_nv_bits(sa & 0xFFu) | weight_factor_nv_bits((sa >> 8) & 0xFFu) << 16;
    fb = weight_factor_nv_bits(sb & 0xFFu) | weight_factor_nv_bits((sb >> 8) & 0xFFu) << 16;
  }
}
// Token scales -> the factor for B = x x 2^kSplit.
__device__ __forceinline__ float act_factor_ue8m0_f32(uint32_t b) {
  const uint32_t e = b + kSplit;
  return __uint_as_float(b == 255 ? 0x7FC00000u : e >= 255 ? 0x7F800000u : e << 23);
}
__device__ __forceinline__ uint32_t act_factor_ue8m0_bf16x2(uint32_t b) {
  const uint32_t e = b + kSplit;
  const uint32_t h = b == 255 ? 0x7FC0u : e >= 255 ? 0x7F80u : e << 7;
  return h | (h << 16);
}
__device__ __forceinline__ float act_factor_ue4m3_f32(uint8_t b) {  // exact: 4 significant bits
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(b, __NV_E4M3))) * 0x1p32f;
}
__device__ __forceinline__ uint32_t act_factor_ue4m3_bf16x2(uint8_t b) {
  const uint32_t h = __float_as_uint(act_factor_ue4m3_f32(b)) >> 16;
  return h | (h << 16);
}

// FP8 (E4M3) bytes 8t + p and 8t + p + 4 of 32 (words w: bytes 4m .. 4m + 3), times f -> a bf16 pair (low half: byte
// 8t + p), the pair of K that e2m1x2_raw<p> decodes from weight word t. Exact where f is a power of two and the
// products stay in the bf16 range.
__device__ __forceinline__ uint32_t fp8_pair_bf16(const uint32_t (&w)[8], int t, int p, float f) {
  // bytes 8t + p and 8t + p + 4 of the 32: byte p of words 2t and 2t + 1
  const uint32_t pair = ptx::prmt(w[2 * t], w[2 * t + 1], p | ((4 + p) << 4));
  const __half2 h = __half2(__nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair & 0xFFFF), __NV_E4M3));
  const float2 v = __half22float2(h);
  const __nv_bfloat162 b = __floats2bfloat162_rn(v.x * f, v.y * f);
  return *reinterpret_cast<const uint32_t*>(&b);
}

// One conversion unit of the token tile: token n, 128-K group g, quarter q (32 physical K) -> 16 bf16
// pairs in the logical K order of the file comment, into the 128B-swizzled K-major bf16 tile
// ([4 atoms of 64 K][kBlockM rows][128 bytes]). sfa: the stage's token scales, rows of kBlockM + 4 bytes,
// already offset to the tile's first row.
template <int kBlockM, ActRecipe kRecipe>
__device__ __forceinline__ void convert_token_unit(const uint8_t* raw, const uint8_t* sfa, uint8_t* bf, int n, int g,
                                                   int q) {
  const int sw = n % 8;
  uint8_t* row = bf + n * 128 + 4 * q;
  auto store = [&](int t, int p, uint32_t v) {
    const int step = 2 * t + p / 2;  // k16 step within the group
    const int atom = 2 * g + t / 2;
    const int unit = 2 * (step % 4) + (p % 2);
    *reinterpret_cast<uint32_t*>(row + atom * kBlockM * 128 + ((unit ^ sw) << 4)) = v;
  };
  if constexpr (kRecipe == ActRecipe::kFP8UE8M0Block32) {
    const uint8_t* src = raw + g * kBlockM * 128 + n * 128;
    const uint4 lo = *reinterpret_cast<const uint4*>(src + (((2 * q) ^ sw) << 4));
    const uint4 hi = *reinterpret_cast<const uint4*>(src + (((2 * q + 1) ^ sw) << 4));
    const uint32_t w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    const float f = act_factor_ue8m0_f32(sfa[(4 * g + q) * (kBlockM + 4) + n]);
#pragma unroll
    for (int t = 0; t < 4; ++t)
#pragma unroll
      for (int p = 0; p < 4; ++p) store(t, p, fp8_pair_bf16(w, t, p, f));
  } else {
    const uint4 raw4 = *reinterpret_cast<const uint4*>(raw + n * 128 + (((4 * g + q) ^ sw) << 4));
    const uint32_t w[4] = {raw4.x, raw4.y, raw4.z, raw4.w};
    uint32_t f[2];
    if constexpr (kRecipe == ActRecipe::kMXFP4) {
      f[0] = f[1] = act_factor_ue8m0_bf16x2(sfa[(4 * g + q) * (kBlockM + 4) + n]);
    } else {
      f[0] = act_factor_ue4m3_bf16x2(sfa[(8 * g + 2 * q) * (kBlockM + 4) + n]);
      f[1] = act_factor_ue4m3_bf16x2(sfa[(8 * g + 2 * q + 1) * (kBlockM + 4) + n]);
    }
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      const uint32_t ft = f[t / 2];
      store(t, 0, ptx::mul_bf16x2(ptx::mul_bf16x2(e2m1x2_raw<0>(w[t]), kBF16x2Pow2_126), ft));
      store(t, 1, ptx::mul_bf16x2(ptx::mul_bf16x2(e2m1x2_raw<1>(w[t]), kBF16x2Pow2_126), ft));
      store(t, 2, ptx::mul_bf16x2(ptx::mul_bf16x2(e2m1x2_raw<2>(w[t]), kBF16x2Pow2_126), ft));
      store(t, 3, ptx::mul_bf16x2(ptx::mul_bf16x2(e2m1x2_raw<3>(w[t]), kBF16x2Pow2_126), ft));
    }
  }
}

// MXFP4 weight scale bytes of rows r and r + 8 -> their bf16 pair factors (weight_factor_mx).
// (b + 94) << 7 in both halves is b * 0x00800080 + 0x2F002F00, one IMAD, for every b <= 160; bytes past that (factors
// beyond the bf16 range, and 255 = NaN) take weight_factor_mx on a branch that real checkpoints never take (was 7
// instructions per scale on every path).
__device__ __forceinline__ void weight_factors_mx(uint32_t sa, uint32_t sb, uint32_t& fa, uint32_t& fb) {
  fa = sa * 0x00800080u + 0x2F002F00u;
  fb = sb * 0x00800080u + 0x2F002F00u;
  if (__builtin_expect(max(sa, sb) > 160u, 0)) fa = weight_factor_mx(sa), fb = weight_factor_mx(sb);
}

// Rows r and r + 8, 32 K each (four words a row, E2M1 in the kernel's K order), times their block factors (fa, fb:
// low half the first 16 K's, high half the last 16's; MXFP4 the same in both) -> the A fragments of 8 k16 steps (the
// layout of wgmma's register A and of mma.sync m16n8k16's A).
__device__ __forceinline__ void decode_rows_bf16(uint32_t (&a)[8][4], const uint32_t (&wa)[4], const uint32_t (&wb)[4],
                                                 uint32_t fa, uint32_t fb) {
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    // words 0-1: the first 16 K (the factors' low halves), words 2-3: the last 16
    auto mul = [t](uint32_t x, uint32_t f) {
      return t < 2 ? ptx::mul_bf16x2_by_half<0>(x, f) : ptx::mul_bf16x2_by_half<1>(x, f);
    };
    // step 2t: nibbles 0/4 (cols 2q..) and 1/5 (cols 2q + 8..); step 2t + 1: nibbles 2/6 and 3/7
    a[2 * t][0] = mul(e2m1x2_raw<0>(wa[t]), fa);
    a[2 * t][1] = mul(e2m1x2_raw<0>(wb[t]), fb);
    a[2 * t][2] = mul(e2m1x2_raw<1>(wa[t]), fa);
    a[2 * t][3] = mul(e2m1x2_raw<1>(wb[t]), fb);
    a[2 * t + 1][0] = mul(e2m1x2_raw<2>(wa[t]), fa);
    a[2 * t + 1][1] = mul(e2m1x2_raw<2>(wb[t]), fb);
    a[2 * t + 1][2] = mul(e2m1x2_raw<3>(wa[t]), fa);
    a[2 * t + 1][3] = mul(e2m1x2_raw<3>(wb[t]), fb);
  }
}

// Decodes this thread's part of one (128-K group, 64-row slice): rows r and r + 8 of the slice, 32 K each,
// into the A fragments of the group's 8 k16 steps.
template <bool kNV>
__device__ __forceinline__ void decode_weights(uint32_t (&a)[8][4], const uint8_t* tile_a, const uint8_t* tile_sw,
                                               int row, int g, int q) {
  const int unit = ((4 * g + q) ^ (row % 8)) << 4;  // rows r and r + 8 share the swizzle phase
  const uint4 ra = *reinterpret_cast<const uint4*>(tile_a + row * 128 + unit);
  const uint4 rb = *reinterpret_cast<const uint4*>(tile_a + (row + 8) * 128 + unit);
  const uint32_t wa[4] = {ra.x, ra.y, ra.z, ra.w}, wb[4] = {rb.x, rb.y, rb.z, rb.w};
  uint32_t fa, fb;
  if constexpr (kNV) {
    const uint16_t sa = *reinterpret_cast<const uint16_t*>(tile_sw + row * kScaleWordsBytes + 8 * g + 2 * q);
    const uint16_t sb = *reinterpret_cast<const uint16_t*>(tile_sw + (row + 8) * kScaleWordsBytes + 8 * g + 2 * q);
    weight_factors_nv(sa, sb, fa, fb);
  } else {
    weight_factors_mx(tile_sw[row * kScaleWordsBytes + 4 * g + q], tile_sw[(row + 8) * kScaleWordsBytes + 4 * g + q],
                      fa, fb);
  }
  decode_rows_bf16(a, wa, wb, fa, fb);
}

// Keeps a wgmma A fragment in its registers up to this point (see the consumer loop).
__device__ __forceinline__ void fence_fragment(uint32_t (&a)[8][4]) {
#pragma unroll
  for (int s = 0; s < 8; ++s)
#pragma unroll
    for (int r = 0; r < 4; ++r) ptx::fence_operand(a[s][r]);
}

// ------------------------------------------------------------------------------------------------
// FP8-wgmma path (file comment)
// ------------------------------------------------------------------------------------------------
// Decodes this thread's part of one (128-K group, 64-row slice) for the FP8-wgmma path: rows r and r + 8 of the slice,
// 32 K each (sub-block q of the group), into the register A fragments of the group's 4 k32 steps, each weight folded
// relative to its row's largest scale over the whole K (ra / rb: Params::weights_row_exp; fold table by the
// difference). The rows' factors 2^(ra - 127) / 2^(rb - 127) multiply the accumulators once, after the tile's K.
__device__ __forceinline__ void decode_weights_e4m3(uint32_t (&a8)[4][4], const uint8_t* tile_a, const uint8_t* tile_sw,
                                                    const uint2* fold_tables, int row, int g, int q, uint32_t ra,
                                                    uint32_t rb) {
  const int unit = ((4 * g + q) ^ (row % 8)) << 4;  // rows r and r + 8 share the swizzle phase
  const uint4 wra = *reinterpret_cast<const uint4*>(tile_a + row * 128 + unit);
  const uint4 wrb = *reinterpret_cast<const uint4*>(tile_a + (row + 8) * 128 + unit);
  // This thread's 32 K are sub-block q of the group: its scale, at most its row's largest (an unsigned minimum: a row
  // exponent below a scale, which transform_weights never writes, reads the all-zero table, not outside the tables).
  const uint32_t ea = tile_sw[row * kScaleWordsBytes + 4 * g + q];
  const uint32_t eb = tile_sw[(row + 8) * kScaleWordsBytes + 4 * g + q];
  const uint2 ta = fold_tables[min(ra - ea, uint32_t(kNumFoldTables - 1))];  // x 2^(6 - (ra - ea))
  const uint2 tb = fold_tables[min(rb - eb, uint32_t(kNumFoldTables - 1))];
  group_a_fragments(wra, wrb, ta, tb, a8);
}

// One token unit of the FP8-wgmma path: token n, 128-K group g, quarter q (32 K) -> folded E4M3 bytes in the
// wgmma K order (k32 step s: column 4q + i <- K 32q + 8s + i, column 16 + 4q + i <- 32q + 8s + 4 + i) into the
// 128B-swizzled K-major tile [2 groups][kBlockM rows][128 bytes]. The four lanes q of (n, g) agree on T (the
// largest of their scales; all 32 lanes shuffle, `active` only gates the stores); lane q = 0 stores 2^(T - 127)
// in factors[g][n]. FP8 tokens: the gather's fold (fold_fp8_group), both through fold_quarter_word (sm90_common.cuh;
// bit-equality: test_mxfp4_fp8_mma_gather_fold_equals_kernel_fold).
template <int kBlockM, ActRecipe kRecipe>
__device__ __forceinline__ void fold_token_unit(const uint8_t* raw, const uint8_t* sfa, uint8_t* tile8, float* factors,
                                                const uint2* tables, int n, int g, int q, bool active) {
  const uint32_t t = sfa[(4 * g + q) * (kBlockM + 4) + n];
  uint32_t tmax = max(t, __shfl_xor_sync(0xffffffffu, t, 1));
  tmax = max(tmax, __shfl_xor_sync(0xffffffffu, tmax, 2));
  if (!active) return;
  const int d = static_cast<int>(tmax - t);
  const int sw = n % 8;
  uint8_t* row = tile8 + (g * kBlockM + n) * 128 + 4 * q;
  auto store = [&](int chunk, uint32_t v) { *reinterpret_cast<uint32_t*>(row + ((chunk ^ sw) << 4)) = v; };
  if constexpr (kRecipe == ActRecipe::kFP8UE8M0Block32) {
    const uint8_t* src = raw + g * kBlockM * 128 + n * 128;
    const uint4 lo = *reinterpret_cast<const uint4*>(src + (((2 * q) ^ sw) << 4));
    const uint4 hi = *reinterpret_cast<const uint4*>(src + (((2 * q + 1) ^ sw) << 4));
    const uint32_t w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};  // word m: K 32q + 4m .. + 3
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      store(2 * s, fold_quarter_word(w[2 * s], d));
      store(2 * s + 1, fold_quarter_word(w[2 * s + 1], d));
    }
  } else {
    static_assert(kRecipe == ActRecipe::kMXFP4, "the FP8-wgmma path takes FP8 or MXFP4 tokens");
    const uint4 raw4 = *reinterpret_cast<const uint4*>(raw + n * 128 + (((4 * g + q) ^ sw) << 4));
    fold_e2m1_quarter(raw4, tables, d, [&](int s, uint32_t lo, uint32_t hi) { store(2 * s, lo), store(2 * s + 1, hi); });
  }
  if (q == 0) factors[g * kBlockM + n] = ue8m0_float(tmax);
}

#ifdef MEGAMOE_TILE_TRACE
// Diagnostic build only (TraceRecord in sm90_common.cuh): L1's and L2's records, one array per translation unit
// (static: several .cu files instantiate this kernel), printed by fp4_trace_print_kernel after each launch. L2's
// CTAs print as kTraceMaxCtas + block, and their tiles as gemm 1. The epilogue is one phase here (e[] = its end).
static __device__ TraceRecord g_fp4_trace[2][kTraceMaxCtas];
static __global__ void fp4_trace_print_kernel(int gemm, int num_ctas) {
  for (int b = 0; b < num_ctas && b < kTraceMaxCtas; ++b) trace_print(g_fp4_trace[gemm][b], gemm * kTraceMaxCtas + b);
}
#endif

// kRecipe: the tokens' recipe as the kernel reads them, and L1's output recipe; kOutFP4 (L1 on the FP8-wgmma path):
// MXFP4 tokens folded upstream (the gather's fold: read as folded FP8 tokens, kRecipe kFP8UE8M0Block32) whose L1 output
// is MXFP4 again (the w4a4 semantics; heuristics::fp4_fold_mxfp4_tokens), folded for L2 by 256-row tiles' epilogues.
template <int kBlockM, int kNumStages, bool kIsL1, bool kNV, ActRecipe kRecipe, bool kFP8Mma, bool kSplitK,
          bool kWideTail, bool kOutFP4 = false>
__global__ void __launch_bounds__(Roles<kBlockM>::kThreads, 1)
    sm90_fp4_grouped_gemm_kernel(const __grid_constant__ CUtensorMap tmap_weights,
                                 const __grid_constant__ CUtensorMap tmap_acts,
                                 const __grid_constant__ CUtensorMap tmap_acts_tail, Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr bool kActFP4 = kRecipe != ActRecipe::kFP8UE8M0Block32;
  static_assert(!kOutFP4 || (kIsL1 && kFP8Mma && kRecipe == ActRecipe::kFP8UE8M0Block32 && !kWideTail),
                "MXFP4 output from folded tokens: L1 on the FP8-wgmma path, no tail");
  constexpr ActRecipe kOut = kOutFP4 ? ActRecipe::kMXFP4 : kRecipe;  // L1's output recipe
  // Block_m 128 (Roles): folded FP8 tokens on the FP8-wgmma path only; the converters and the bf16 ring are not built.
  constexpr bool kFoldedOnly = kBlockM == 128;
  static_assert(!kFoldedOnly || (kFP8Mma && !kNV && kRecipe == ActRecipe::kFP8UE8M0Block32 && !kSplitK && !kWideTail),
                "block_m 128: MXFP4 weights on the FP8-wgmma path with folded FP8 tokens, no split, no tail");
  // Params::folded_tokens (the FP8-wgmma wide-tail build and block_m 128 take folded tokens only: launch_layer)
  const bool folded = kFP8Mma && !kActFP4 && (kWideTail || kFoldedOnly || p.folded_tokens);
  // Token columns of the widest tile: in the wide-tail build an expert's last block may hold kTail rows past block_m
  // (routing tail_rows, heuristics::fp4_tail_rows; tmap_acts_tail loads them).
  constexpr int kCols = heuristics::fp4_tile_cols(kBlockM, kWideTail);
  constexpr int kTail = kCols - kBlockM;
  static_assert(!kWideTail || (kBlockM == 16 && kRecipe != ActRecipe::kMXFP4 && !kSplitK),
                "the wide-tail build: block_m 16, NVFP4 or FP8 tokens (on the FP8-wgmma path: folded), no split");
  using S = Smem<kBlockM, kCols, kActFP4>;
  constexpr int kNumBfTiles = S::kNumBfTiles;
  using Mma = ptx::WgmmaBF16RS<kFoldedOnly ? 64 : kCols>;  // the BF16 path (not built at block_m 128)
  constexpr int kRegs = kCols / 2;                           // accumulator registers per 64-row slice
  static_assert(kFoldedOnly || Mma::kNumRegs == kRegs, "accumulator layout");
  using R = Roles<kBlockM>;
  constexpr int kNumConsumerThreads = R::kConsumerThreads;
  constexpr int kSlices = R::kSlices;
  constexpr int kTileN = R::kTileN;  // weight rows per tile
  constexpr int kWBlk = kNV ? 16 : 32;                            // weight scale block (K)
  constexpr int kABlk = kRecipe == ActRecipe::kNVFP4 ? 16 : 32;   // token scale block (K)
  constexpr int kABlocks = kBlockK / kABlk;                       // token scale rows per stage
  constexpr int kWWords = kBlockK / kWBlk / 4;                    // weight scale words per row per stage
  static_assert(kBlockM % 16 == 0 && (kBlockM <= 64 || kFoldedOnly), "token block must be 16, 32, 64 or 128");
  static_assert(kCols % 8 == 0 && kCols <= 128, "tile columns");
  static_assert(!kFP8Mma || !kNV, "the FP8-wgmma path is for MXFP4 weights (NVFP4 scales are not powers of two)");
  using MmaFP8 = ptx::WgmmaFP8RS<kFP8Mma ? kCols : 16>;
  static_assert(!kFP8Mma || MmaFP8::kNumRegs == kRegs, "one accumulator layout for both paths");

  extern __shared__ uint8_t smem_raw[];
  // Offset arithmetic on the __shared__ array (not an integer round trip) keeps the address space known to
  // the compiler: shared-memory loads and stores (LDS/STS), not generic ones (LD/ST, long-scoreboard waits).
  uint8_t* smem = smem_raw + ((1024 - (ptx::smem_addr(smem_raw) & 1023)) & 1023);
  uint8_t* stages = smem;
  uint8_t* bf_tiles = smem + kNumStages * S::kStage;  // kNumBfTiles bf16 token tiles, then reused by the epilogue
  uint64_t* full = reinterpret_cast<uint64_t*>(bf_tiles + kNumBfTiles * S::kTileBF);
  uint64_t* empty = full + kNumStages;
  uint64_t* bf_full = empty + kNumStages;  // [kNumBfTiles] a bf16 token tile is written
  uint64_t* bf_empty = bf_full + kNumBfTiles;  // [kNumBfTiles] its wgmmas (and, after a tile's last stage, the epilogue) are done
  TileInfo* tile_infos = reinterpret_cast<TileInfo*>(bf_empty + kNumBfTiles);  // [kNumStages], see TileInfo
  int* split_last = reinterpret_cast<int*>(tile_infos + kNumStages);           // split K: this unit is its tile's last
  static_assert((2 * kNumStages + 2 * kNumBfTiles) * 8 + kNumStages * sizeof(TileInfo) + 4 <= 256,
                "barrier area of Smem::bytes");
  // FP8-wgmma path: the fold tables (after the barrier area) and, in each ring tile, the E4M3 token tile
  // [2 groups][kBlockM][128 bytes] then the token factors float32 [2 groups][kBlockM].
  uint2* fold_tables = reinterpret_cast<uint2*>(reinterpret_cast<uint8_t*>(full) + 256);
  static_assert(kNumFoldTables * 8 <= 256, "fold table area of Smem::bytes");
  // The early epilogue inputs of the current tile (the wide-tail build; see issue_early_inputs), after the fold tables.
  struct EarlyInputs {
    float* g;  // [kCols] the rows' NVFP4 token global scales
    float* w;  // [kCols] L1: the rows' top-k weights
    int* src;  // [kCols] L2: the rows' pool_src entries (-1 past the rows)
  };
  float* early_base = reinterpret_cast<float*>(reinterpret_cast<uint8_t*>(full) + 512);
  const EarlyInputs early_in{early_base, early_base + kCols, reinterpret_cast<int*>(early_base + 2 * kCols)};
  static_assert(!kWideTail || 3 * kCols * 4 <= 512, "early input area of Smem::bytes (the wide-tail build only)");
  static_assert(kFoldedOnly || 2 * kCols * 128 + 2 * kCols * 4 <= S::kTileBF, "E4M3 token tile and factors in a ring tile");
  auto tile_a = [&](int s) { return stages + s * S::kStage; };
  auto tile_b = [&](int s) { return stages + s * S::kStage + S::kTileA; };
  auto tile_sw = [&](int s) { return stages + s * S::kStage + S::kTileA + S::kTileB; };
  auto tile_sa = [&](int s) { return stages + s * S::kStage + S::kTileA + S::kTileB + S::kTileSW; };
  auto tile_row_exp = [&](int s) { return tile_sa(s) + S::kRowExpOffset; };
  // Stage kb's weight scales in its scale tile (kScaleWordsBytes).
  auto stage_scales = [&](int s, int kb) { return tile_sw(s) + (kb * (kBlockK / kWBlk)) % kScaleWordsBytes; };
  // Scale tiles (p.scale_tiles; formats.hpp: n % 256 == 0, so experts never share one): the first byte of the weight
  // tile at `weight_row` (a multiple of kTileN) in the scale tiles of its rows' first 16 bytes of K; stage kb's are
  // scale_tile_step(kb) bytes further, kTileN rows of kScaleTileBytes.
  auto scale_tile_base = [&](int weight_row) {
    return p.weights_sf + int64_t(weight_row / kScaleTileRows) * (p.k / kWBlk) * kScaleTileRows +
           (weight_row % kScaleTileRows) * kScaleTileBytes;
  };
  auto scale_tile_step = [&](int kb) {
    return kb * (kBlockK / kWBlk) / kScaleTileBytes * (kScaleTileRows * kScaleTileBytes);
  };

  const int warpgroup = threadIdx.x / 128;
  const int lane = threadIdx.x % 32;
  const auto& l = p.l;
  const int num_experts = static_cast<int>(l.num_local_experts);
  const int* tile_offset = reinterpret_cast<const int*>(p.buffer + l.tile_offset_offset);
  const int* expert_offset = reinterpret_cast<const int*>(p.buffer + l.expert_offset_offset);
  const int num_nblocks = (p.n + kTileN - 1) / kTileN;
  const int num_kblocks = (p.k + kBlockK - 1) / kBlockK;
  // NOTES: routing metadata is final before this grid launches (see the FP8 kernel): the predecessor
  // allows the launch only after its own dependency wait, which follows the routing kernel.
  const int num_tiles = __ldcg(tile_offset + num_experts) * num_nblocks;
  const SplitPlan plan = kSplitK ? split_plan(num_tiles, p.split_round, num_kblocks) : SplitPlan{num_tiles, 1};
  const int num_units = plan.num_units(num_tiles);

  if (threadIdx.x == 0) {
    for (int s = 0; s < kNumStages; ++s) {
      ptx::mbarrier_init(&full[s], 1 + 32);  // TMA thread + the 32 scale-copy lanes
      // Every consumer and converter thread (no converters with folded tokens) releases a stage (as the FP8 kernel:
      // with one lane per warp after __syncwarp, compute-sanitizer's racecheck did not see the other lanes' reads
      // ordered before the producer's next writes to the slot; H100, 2026-11-26, 29 reports in the block_m 64 / 128
      // FP8-wgmma builds).
      ptx::mbarrier_init(&empty[s], kNumConsumerThreads + (kFoldedOnly || folded ? 0 : R::kConverterWarps * 32));
    }
    for (int b = 0; b < kNumBfTiles; ++b) {
      ptx::mbarrier_init(&bf_full[b], R::kConverterWarps * 32);
      ptx::mbarrier_init(&bf_empty[b], kNumConsumerThreads / 32);
    }
    ptx::fence_barrier_init();
  }
  if constexpr (kFP8Mma) {
    if (threadIdx.x >= 32 && threadIdx.x < 32 + kNumFoldTables)
      fold_tables[threadIdx.x - 32] = make_fold_table(threadIdx.x - 32 - kFoldHeadroom);
  }
  __syncthreads();

  if (warpgroup == 0 || warpgroup == R::kConverterGroup) {
    // ======================================================================== producer, converters
    ptx::setmaxnreg_dec<R::kProducerRegs>();
    const int warp = threadIdx.x / 32;
    // The CTA's first tile: the weights and weight scales of its first `early` stages load before the grid dependency
    // wait (they never come from an earlier kernel, and the routing metadata the tile search reads is final at launch,
    // see num_tiles), so that they stream while the predecessor finishes, as the FP8 kernel's weight producer does.
    // Those stages are free: no consumer has run yet. NOTES: at T=1 the L1 / L2 tiles' claim -> first full stage took
    // 5-6 us (H100 tile trace, 2026-11-26); with this, H100 A/B (V4-Flash, every FP4 format pair, 1 round,
    // docs/bench/h100-2026-11-26-ab-fp4-early-weights.json): T=1 -2 to -7 %, T=16 -2 to -4 % per replay and in a
    // graph; T=128 / 2048 within the run's noise.
    const SplitUnit first_unit = split_unit<kSplitK>(blockIdx.x, plan, num_kblocks, p.rotate_rounds);
    const int early = blockIdx.x < num_units ? min(kNumStages, first_unit.kb_end - first_unit.kb_begin) : 0;
    // The whole TMA warp finds each tile (decode_tile_warp: 3 L2 round trips, as the FP8 producer, instead of
    // a serial binary search's ~10 dependent loads); lane 0 issues.
    if (warp == 0) {
      if (lane == 0) {
        ptx::prefetch_tensormap(&tmap_weights);
        ptx::prefetch_tensormap(&tmap_acts);
        if constexpr (kTail > 0) ptx::prefetch_tensormap(&tmap_acts_tail);
      }
      int stage = 0;
      uint32_t phase = 0;
#ifdef MEGAMOE_TILE_TRACE
      int trace_n = 0, trace_cur = -1, trace_tile[kTraceTiles];    // trace_cur: the slot of the tile being issued
      uint64_t trace_claim[kTraceTiles], trace_issue[kTraceTiles];  // claimed; first weight load issued
#endif
      auto claim = [&](int tile) {
#ifdef MEGAMOE_TILE_TRACE
        // The claim before the tile search, as the FP8 producer stamps it (claim -> issue includes the search).
        trace_cur = trace_n < kTraceTiles ? trace_n : -1;
        if (lane == 0 && trace_cur >= 0) trace_tile[trace_n] = tile, trace_claim[trace_n] = ptx::globaltimer_ns();
        if (trace_cur >= 0) ++trace_n;
#endif
        return decode_tile_warp(tile, tile_offset, expert_offset, num_experts, num_nblocks, kBlockM);
      };
      // A wide tile (rows > block_m: an expert's last block with tail rows) loads kTail more token rows.
      auto stage_bytes = [&](int kb, int rows) {
        const int cols = kTail > 0 && rows > kBlockM ? kCols : kBlockM;
        uint32_t bytes = S::kTileA + (p.scale_tma ? S::kTileSW : 0);
        if constexpr (kActFP4) bytes += cols * 128;
        else bytes += ((kb + 1) * kBlockK <= p.k ? 2 : 1) * cols * 128;
        return bytes;
      };
      TileInfo first{};
      if (early > 0) {
        first = claim(first_unit.tile);
        if (lane == 0) {
          tile_infos[0] = first;
          for (int i = 0; i < early; ++i) {
            const int kb = first_unit.kb_begin + i;
            ptx::mbarrier_arrive_expect_tx(&full[i], stage_bytes(kb, first.rows));
            ptx::tma_load_2d(tile_a(i), &tmap_weights, &full[i], kb * (kBlockK / 2), first.expert * p.n + first.n_block * kTileN);
          }
          if (p.scale_tma)
            for (int i = 0; i < early; ++i)
              ptx::bulk_load(tile_sw(i),
                             scale_tile_base(first.expert * p.n + first.n_block * kTileN) +
                                 scale_tile_step(first_unit.kb_begin + i),
                             S::kTileSW, &full[i]);
#ifdef MEGAMOE_TILE_TRACE
          if (trace_cur >= 0) trace_issue[trace_cur] = ptx::globaltimer_ns();
#endif
        }
      }
      ptx::grid_dependency_wait();
      if (lane == 0) ptx::launch_dependents();
      for (int unit = blockIdx.x; unit < num_units; unit += gridDim.x) {
        const bool is_first = unit == blockIdx.x;
        const SplitUnit u = split_unit<kSplitK>(unit, plan, num_kblocks, p.rotate_rounds);
        const TileInfo t = is_first ? first : claim(u.tile);
        if (lane != 0) continue;  // lanes 1-31 take part in the search only
        const int weight_row = t.expert * p.n + t.n_block * kTileN;
        for (int kb = u.kb_begin; kb < u.kb_end; ++kb) {
          const bool full_stage = (kb + 1) * kBlockK <= p.k;
          if (!is_first || kb - u.kb_begin >= early) {
            ptx::mbarrier_wait(&empty[stage], phase ^ 1);
            if (kb == u.kb_begin) tile_infos[stage] = t;
            ptx::mbarrier_arrive_expect_tx(&full[stage], stage_bytes(kb, t.rows));
            ptx::tma_load_2d(tile_a(stage), &tmap_weights, &full[stage], kb * (kBlockK / 2), weight_row);
            if (p.scale_tma)
              ptx::bulk_load(tile_sw(stage), scale_tile_base(weight_row) + scale_tile_step(kb), S::kTileSW, &full[stage]);
#ifdef MEGAMOE_TILE_TRACE
            if (kb == u.kb_begin && trace_cur >= 0) trace_issue[trace_cur] = ptx::globaltimer_ns();
#endif
          }
          // Token rows [row0, row0 + block_m) and, in a wide tile, the tail rows after them (1024-byte aligned:
          // the 128B swizzle phase of a row is its index mod 8 either way). E4M3 tokens: two 128-K groups of kCols
          // rows.
          const bool wide = kTail > 0 && t.rows > kBlockM;
          if constexpr (kActFP4) {
            ptx::tma_load_2d(tile_b(stage), &tmap_acts, &full[stage], kb * (kBlockK / 2), t.row0);
            if (wide)
              ptx::tma_load_2d(tile_b(stage) + kBlockM * 128, &tmap_acts_tail, &full[stage], kb * (kBlockK / 2),
                               t.row0 + kBlockM);
          } else {
            ptx::tma_load_2d(tile_b(stage), &tmap_acts, &full[stage], kb * kBlockK, t.row0);
            if (wide)
              ptx::tma_load_2d(tile_b(stage) + kBlockM * 128, &tmap_acts_tail, &full[stage], kb * kBlockK,
                               t.row0 + kBlockM);
            if (full_stage) {
              ptx::tma_load_2d(tile_b(stage) + kCols * 128, &tmap_acts, &full[stage], kb * kBlockK + 128, t.row0);
              if (wide)
                ptx::tma_load_2d(tile_b(stage) + (kCols + kBlockM) * 128, &tmap_acts_tail, &full[stage],
                                 kb * kBlockK + 128, t.row0 + kBlockM);
            }
          }
          if (++stage == kNumStages) stage = 0, phase ^= 1;
        }
      }
#ifdef MEGAMOE_TILE_TRACE
      if (lane == 0 && blockIdx.x < kTraceMaxCtas) {
        if (trace_n < kTraceTiles) trace_tile[trace_n] = num_units, trace_claim[trace_n++] = ptx::globaltimer_ns();
        TraceRecord& r = g_fp4_trace[kIsL1 ? 0 : 1][blockIdx.x];
        r.producer_n = trace_n;
        for (int i = 0; i < trace_n; ++i) {
          r.tile[i] = trace_tile[i], r.claim[i] = trace_claim[i];
          r.issue[i] = trace_tile[i] < num_units ? trace_issue[i] : trace_claim[i];
          r.pwait[i] = -1, r.pspan[i] = -1;  // not recorded
        }
      }
#endif
    } else if (warp == 1) {
      // Weight block scales: rows of k / kWBlk bytes (4-byte multiples), kWWords words per row per stage.
      // Token scales: kABlocks rows of pool_rows bytes per stage; words [row0 & ~3, row0 + kBlockM + 4).
      const int row_bytes = p.k / kWBlk;
      const int act_blocks = p.k / kABlk;
      const int64_t pool_rows = l.pool_rows;  // a multiple of 128: every window word is 4-byte aligned
      const int64_t total_rows = int64_t(num_experts) * p.n;
      auto copy_weight_scales = [&](const TileInfo& t, int kb, int stage, bool unit_start) {
        const int64_t weight_row = int64_t(t.expert) * p.n + t.n_block * kTileN;
        if constexpr (kFP8Mma) {
          // The rows' exponents with the unit's first stage (n is a multiple of 128: 4 rows never straddle an expert).
          if (unit_start) {
#pragma unroll 1
            for (int m = lane; m < kTileN / 4; m += 32)
              if (weight_row + 4 * m < total_rows)
                ptx::cp_async_4(tile_row_exp(stage) + 4 * m, p.weights_row_exp + weight_row + 4 * m);
          }
        }
        if (p.scale_tma) return;  // the TMA thread's (with the weight tile)
        uint8_t* dst = stage_scales(stage, kb);
        if (p.scale_tiles) {
          // Row r's bytes at r x kScaleTileBytes in the tile, at the stage's offset within them (as in shared memory).
          const uint8_t* src =
              scale_tile_base(int(weight_row)) + scale_tile_step(kb) + (kb * (kBlockK / kWBlk)) % kScaleTileBytes;
#pragma unroll 1
          for (int r = lane; r < kTileN; r += 32) {
            if constexpr (kWWords == 4) ptx::cp_async_16(dst + r * kScaleWordsBytes, src + r * kScaleTileBytes);
            else ptx::cp_async_8(dst + r * kScaleWordsBytes, src + r * kScaleTileBytes);
          }
        } else if (p.wide_scale_copies && (kb + 1) * kBlockK <= p.k) {
          // One 8-byte (MXFP4) or 16-byte (NVFP4) copy per row: a quarter of the 4-byte copies, whose
          // count made this warp the limiter for NVFP4 (1,024 per stage).
          const int col = kb * (kBlockK / kWBlk);
#pragma unroll 1
          for (int r = lane; r < kTileN; r += 32) {
            if (weight_row + r >= total_rows) break;
            const uint8_t* src = p.weights_sf + (weight_row + r) * row_bytes + col;
            if constexpr (kWWords == 4) ptx::cp_async_16(dst + r * kScaleWordsBytes, src);
            else ptx::cp_async_8(dst + r * kScaleWordsBytes, src);
          }
        } else {
#pragma unroll 1
          for (int i = lane; i < kTileN * kWWords; i += 32) {
            const int r = i / kWWords, word = i % kWWords;
            const int col = kb * (kBlockK / kWBlk) + 4 * word;
            if (weight_row + r < total_rows && col < row_bytes)
              ptx::cp_async_4(dst + r * kScaleWordsBytes + 4 * word, p.weights_sf + (weight_row + r) * row_bytes + col);
          }
        }
      };
      // The first tile's early stages: weight scales before the grid dependency wait, as the TMA warp's weights.
      const TileInfo first = early > 0 ? decode_tile_warp(first_unit.tile, tile_offset, expert_offset, num_experts,
                                                          num_nblocks, kBlockM) : TileInfo{};
      for (int i = 0; i < early; ++i) copy_weight_scales(first, first_unit.kb_begin + i, i, i == 0);
      // The token scales come from the grid before this one (gather, or L1 for L2): wait for it as the
      // TMA thread does (without this wait L2's scales raced with L1's epilogue and runs differed).
      ptx::grid_dependency_wait();
      int stage = 0;
      uint32_t phase = 0;
      for (int unit = blockIdx.x; unit < num_units; unit += gridDim.x) {
        const bool is_first = unit == blockIdx.x;
        const SplitUnit u = split_unit<kSplitK>(unit, plan, num_kblocks, p.rotate_rounds);
        const TileInfo t = is_first ? first : decode_tile_warp(u.tile, tile_offset, expert_offset, num_experts, num_nblocks, kBlockM);
        for (int kb = u.kb_begin; kb < u.kb_end; ++kb) {
          if (!is_first || kb - u.kb_begin >= early) {
            ptx::mbarrier_wait(&empty[stage], phase ^ 1);
            copy_weight_scales(t, kb, stage, kb == u.kb_begin);
          }
          uint8_t* dst_a = tile_sa(stage);
          if (folded) {
            // The stage's two groups of float factors [2][kCols] (the tile's own rows).
            const float* src = reinterpret_cast<const float*>(p.acts_sf);
#pragma unroll 1
            for (int i = lane; i < 2 * kCols; i += 32) {
              const int blk = 2 * kb + i / kCols, c = i % kCols;
              if (c < t.rows && blk < p.k / 128)
                ptx::cp_async_4(dst_a + 4 * i, src + int64_t(blk) * pool_rows + t.row0 + c);
            }
            ptx::cp_async_mbarrier_arrive_noinc(&full[stage]);
            if (++stage == kNumStages) stage = 0, phase ^= 1;
            continue;
          }
          constexpr int kSAWords = S::kSARow / 4;
          const int first_word_row = t.row0 & ~3;
          // The window's words this tile's converters read (their units cover its rows rounded up to 4).
          const int words = kTail > 0 ? ((t.row0 & 3) + ((t.rows + 3) & ~3) + 3) / 4 : kSAWords;
#pragma unroll 1
          for (int i = lane; i < kABlocks * kSAWords; i += 32) {
            const int r = i / kSAWords, word = i % kSAWords;
            const int blk = kb * kABlocks + r, row = first_word_row + 4 * word;
            if (word < words && blk < act_blocks && row < pool_rows)
              ptx::cp_async_4(dst_a + r * S::kSARow + 4 * word, p.acts_sf + blk * pool_rows + row);
          }
          ptx::cp_async_mbarrier_arrive_noinc(&full[stage]);
          if (++stage == kNumStages) stage = 0, phase ^= 1;
        }
      }
      ptx::cp_async_wait_all();
    } else if (warp >= 2 && !kFoldedOnly && !folded) {
      // Folded tokens (the wgmmas read the stage's own token tile): no converters, no ring (the consumers keep its
      // tiles as the epilogue's scratch), as at block_m 128.
      // Token tile -> bf16 tile b (a ring of kNumBfTiles). Tile b is free once every consumer warp has finished
      // the wgmmas that read it; the stage is released to the producer once its token part is converted.
      const int ctid = warpgroup == 0 ? threadIdx.x - 64 : threadIdx.x - (128 + kNumConsumerThreads) + 64;
      int stage = 0, b = 0;
      uint32_t phase = 0, bphase = 0;
      for (int unit = blockIdx.x; unit < num_units; unit += gridDim.x) {
        const SplitUnit su = split_unit<kSplitK>(unit, plan, num_kblocks, p.rotate_rounds);
        int row0 = 0, units = kCols * 8;
#ifdef MEGAMOE_POISON_STALE_COLUMNS
        int rows = kCols;
#endif
        for (int kb = su.kb_begin; kb < su.kb_end; ++kb) {
          const int groups = (kb + 1) * kBlockK <= p.k ? 2 : 1;  // 128-K groups in this stage
          uint8_t* bf = bf_tiles + b * S::kTileBF;
          ptx::mbarrier_wait(&bf_empty[b], bphase ^ 1);
          ptx::mbarrier_wait(&full[stage], phase);
          if (kb == su.kb_begin) {
            row0 = tile_infos[stage].row0;
            // Only the tile's own tokens: the columns past them are never stored, so their stale contents (the
            // wgmma's columns are independent) do not matter. Whole warps, as fold_token_unit shuffles across the
            // warp (kCols * 8 is a multiple of 32).
            // NOTES: the converters bound the prefill stages: without any conversion (ablate.py fp4-no-convert)
            // V4-Flash T=2048 ran 18-23 % faster (H100, 2026-11-25), and its 48 rows per expert fill 64-row tiles
            // to ~75 %.
            units = (tile_infos[stage].rows * 8 + 31) / 32 * 32;
#ifdef MEGAMOE_POISON_STALE_COLUMNS
            rows = tile_infos[stage].rows;
#endif
          }
          for (int u = ctid; u < units; u += R::kConverterWarps * 32) {
            const int n = u / 8, g = (u / 4) % 2, uq = u % 4;  // uq = lane % 4: the quad of (n, g) is 4 lanes
#ifdef MEGAMOE_POISON_STALE_COLUMNS
            const bool live = n < rows;  // diagnostic build: the columns past the rows get NaN below
#else
            constexpr bool live = true;
#endif
            if constexpr (kFP8Mma) {
              fold_token_unit<kCols, kRecipe>(tile_b(stage), tile_sa(stage) + (row0 & 3), bf,
                                              reinterpret_cast<float*>(bf + 2 * kCols * 128), fold_tables, n, g, uq,
                                              g < groups && live);
            } else if (g < groups && live) {
              convert_token_unit<kCols, kRecipe>(tile_b(stage), tile_sa(stage) + (row0 & 3), bf, n, g, uq);
            }
          }
#ifdef MEGAMOE_POISON_STALE_COLUMNS
          // Diagnostic build (MEGAMOE_NVCC_DEFINES=MEGAMOE_POISON_STALE_COLUMNS, device_check.sh poison): every token
          // column past the tile's rows holds NaN (0xFF bytes: bf16 and E4M3 NaN; the fold factors float NaN), so the
          // GPU tests fail if any stored value depends on those columns (the stale-contents argument above).
          {
            constexpr int kRowBlocks = kFP8Mma ? 2 : 4;  // [2 groups] of E4M3 rows / [4 atoms] of bf16 rows
            for (int c = ctid; c < kRowBlocks * (kCols - rows) * 8; c += R::kConverterWarps * 32) {
              const int blk = c / ((kCols - rows) * 8), n = rows + (c / 8) % (kCols - rows);
              reinterpret_cast<uint4*>(bf + (blk * kCols + n) * 128)[c % 8] = make_uint4(~0u, ~0u, ~0u, ~0u);
            }
            if constexpr (kFP8Mma)
              for (int c = ctid; c < 2 * (kCols - rows); c += R::kConverterWarps * 32)
                reinterpret_cast<uint32_t*>(bf + 2 * kCols * 128)[(c / (kCols - rows)) * kCols + rows +
                                                                   c % (kCols - rows)] = ~0u;
          }
#endif
          ptx::fence_proxy_async_shared();  // generic-proxy writes -> the wgmmas (async proxy)
          ptx::mbarrier_arrive(&bf_full[b]);
          ptx::mbarrier_arrive(&empty[stage]);
          if (++stage == kNumStages) stage = 0, phase ^= 1;
          if (++b == kNumBfTiles) b = 0, bphase ^= 1;
        }
      }
    }
    return;
  }

  // ========================================================================== consumers
  ptx::setmaxnreg_inc<R::kConsumerRegs>();
#ifdef MEGAMOE_TILE_TRACE
  const uint64_t trace_launch = ptx::globaltimer_ns();  // before the grid dependency wait
#endif
  ptx::grid_dependency_wait();  // token tiles, scales and routing rows come from earlier kernels
  ptx::launch_dependents();
#ifdef MEGAMOE_TILE_TRACE
  const uint64_t trace_entry = ptx::globaltimer_ns();  // after the grid dependency wait
  int trace_n = 0, trace_info[kTraceTiles][4];
  uint64_t trace_t[kTraceTiles][3];
  uint64_t trace_e[kTraceTiles][3] = {};  // epilogue phase ends (see tile_trace.py: L1 joined, swiglu, quantize; L2 joined, staged)
  int64_t trace_c[kTraceTiles][2] = {};  // main-loop cycles, of which waiting for full stages
#endif
  const int consumer = warpgroup - 1;                 // owns the slices [kSlices c, kSlices c + kSlices)
  const int warp = (threadIdx.x / 32) % 4;            // warp within the warpgroup
  const int ctid = threadIdx.x - 128;                 // 0 .. kNumConsumerThreads - 1
  // Diagnostic builds: the end of epilogue phase j of the current tile (consumer 0's view).
  auto trace_phase = [&](int j) {
#ifdef MEGAMOE_TILE_TRACE
    if (ctid == 0 && trace_n < kTraceTiles) trace_e[trace_n][j] = ptx::globaltimer_ns();
#else
    (void)j;
#endif
  };
  const int q = lane % 4;
  const int quad_row = warp * 16 + lane / 4;          // this thread's first row in a 64-row slice
  int stage = 0, b = 0;
  uint32_t phase = 0, bphase = 0;
  const uint32_t bf_tiles_desc_lo = ptx::smem_desc_sw128_lo(bf_tiles);

  for (int unit = blockIdx.x; unit < num_units; unit += gridDim.x) {
    const SplitUnit u = split_unit<kSplitK>(unit, plan, num_kblocks, p.rotate_rounds);
    TileInfo t;  // read with the tile's first stage
    // The epilogue's inputs (final: the weights' scales, and outputs of earlier kernels, which the consumers waited for
    // at their start): the float32 factors (the expert's NVFP4 weight global scale x the rows' NVFP4 token global
    // scales), L1 the rows' top-k weights, L2 the rows' pool_src entries. At decode (block_m 16: 4 + 4 registers in L1,
    // 4 + 1 in L2) they load with the tile's first stage, so the epilogue does not wait for them; in the wide-tail
    // build by cp.async into `early_in` (issue_early_inputs; the expert's weight global scale into a register), read
    // into the registers below at the epilogue's start. Wider tiles load them in the epilogue, each where it is used
    // (registers).
    // NOTES: as the FP8 kernel (3cd2071). H100 A/B, V4-Flash, 2 rounds (docs/bench/
    // h100-2026-11-25-ab-fp4-early-inputs.json): T = 16-512 -2.5 to -8 % per replay for every MXFP4 / NVFP4 x FP8 /
    // FP4-token pair (in a graph -1 to -6 %, but NVFP4 T=512 +1-2 %), T=1 within +-2 %, 2048 within 2.5 %. In the
    // wide-tail build (24 columns) registers held through the main loop made ptxas spill 88 bytes in L1.
    constexpr bool kEarlyEpilogueInputs = kBlockM <= 16;
    constexpr bool kEarlyInSmem = kWideTail;
    float early_gw = 1.0f;  // the expert's weight global scale (early inputs)
    float col_f[kCols / 4];
    float col_w[kCols / 4];
    int src[combine_tile_iters<kCols, kTileN, kNumConsumerThreads>()];
    // Every load issues before the first product waits for one: the token scale is loaded outside the product's
    // condition (inside it ptxas branched per row, and each row's product waited for its load before the next load
    // issued: 1 + block_m / 4 round trips in a row with NVFP4 weights and tokens). The products are taken here, not
    // kept raw for the epilogue: that register more (the weight scale) spilled in L1 MXFP4 x MXFP4 tokens at block_m
    // 16; at the tile start their one round trip overlaps the converters' first stage.
    auto load_factors = [&](const TileInfo& ti) {
      if constexpr (kFoldedOnly) {  // MXFP4 weights, FP8 tokens: no global scales (32 registers fewer)
#pragma unroll
        for (int j = 0; j < kCols / 4; ++j) col_f[j] = 1.0f;
        return;
      }
      const float gw = p.weights_global_sf != nullptr ? __ldg(p.weights_global_sf + ti.expert) : 1.0f;
#pragma unroll
      for (int j = 0; j < kCols / 4; ++j) {
        const int col = 8 * (j / 2) + 2 * q + (j % 2);
        const float gt = p.acts_global_sf != nullptr && col < ti.rows ? p.acts_global_sf[ti.row0 + col] : 0.0f;
        col_f[j] = p.acts_global_sf != nullptr ? (col < ti.rows ? gw * gt : 0.0f) : gw;
      }
    };
    // Early inputs, by consumer threads ctid < kCols (one token column each), at the tile's first stage.
    auto issue_early_inputs = [&](const TileInfo& ti) {
      early_gw = p.weights_global_sf != nullptr ? __ldg(p.weights_global_sf + ti.expert) : 1.0f;
      if (ctid < kCols) {
        const int col = ctid;
        if (col < ti.rows) {
          const int row = ti.row0 + col;
          if constexpr (kRecipe == ActRecipe::kNVFP4) ptx::cp_async_4(early_in.g + col, p.acts_global_sf + row);
          if constexpr (kIsL1)
            ptx::cp_async_4(early_in.w + col,
                            reinterpret_cast<const float*>(p.buffer + l.dispatch_weight_offset) + row);
          else
            ptx::cp_async_4(early_in.src + col, reinterpret_cast<const int*>(p.buffer + l.pool_src_offset) + row);
        } else {
          early_in.g[col] = 0.0f, early_in.w[col] = 0.0f, early_in.src[col] = -1;  // columns past the rows
        }
      }
    };
    // ... and into this thread's registers, in the epilogue (after cp_async_wait_all and a consumer barrier).
    auto read_early_inputs = [&]() {
#pragma unroll
      for (int j = 0; j < kCols / 4; ++j) {
        const int col = 8 * (j / 2) + 2 * q + (j % 2);
        col_f[j] = kRecipe == ActRecipe::kNVFP4 ? early_gw * early_in.g[col] : early_gw;
        if constexpr (kIsL1) col_w[j] = early_in.w[col];
      }
      if constexpr (!kIsL1) {
        constexpr int kChunks = kCols * (kTileN / 8);
#pragma unroll
        for (int it = 0; it < combine_tile_iters<kCols, kTileN, kNumConsumerThreads>(); ++it) {
          const int c = ctid + it * kNumConsumerThreads;
          src[it] = c < kChunks ? early_in.src[c / (kTileN / 8)] : -1;
        }
      }
    };
    auto load_row_inputs = [&](const TileInfo& ti) {
      if constexpr (kIsL1) {
        const float* row_weight = reinterpret_cast<const float*>(p.buffer + l.dispatch_weight_offset);
#pragma unroll
        for (int j = 0; j < kCols / 4; ++j) {
          const int col = 8 * (j / 2) + 2 * q + (j % 2);
          col_w[j] = col < ti.rows ? row_weight[ti.row0 + col] : 0.0f;
        }
      } else {
        load_combine_srcs<kCols, kTileN, kNumConsumerThreads>(
            src, reinterpret_cast<const int*>(p.buffer + l.pool_src_offset) + ti.row0, ti.rows, ctid);
      }
    };
    float acc[kSlices][kRegs];  // slice ls of this consumer = tile rows [64 (kSlices c + ls), + 64)
#pragma unroll
    for (int ls = 0; ls < kSlices; ++ls)
#pragma unroll
      for (int i = 0; i < kRegs; ++i) acc[ls][i] = 0.0f;
    uint32_t a[8][4];  // the A fragments of one (128-K group, 64-row slice): 8 k16 steps
    uint32_t row_exp[kSlices][2];  // FP8-wgmma path: rows r and r + 8 of each slice, their largest UE8M0 scale
    int live_cols = kCols;  // the BF16 wgmmas' N for this tile (set with its first stage; heuristics::fp4_narrow_mma)
    int prev_b = 0;
    uint8_t* bf = bf_tiles;

    for (int kb = u.kb_begin; kb < u.kb_end; ++kb) {
      const int groups = (kb + 1) * kBlockK <= p.k ? 2 : 1;  // 128-K groups in this stage
      bf = bf_tiles + b * S::kTileBF;
      const uint32_t bf_desc_lo = bf_tiles_desc_lo + b * (S::kTileBF / 16);
      // FP8-wgmma path: the E4M3 token tile the wgmmas read (folded tokens: the stage's, as the TMA left it).
      const uint32_t tok_desc_lo = folded ? ptx::smem_desc_sw128_lo(tile_b(stage)) : bf_desc_lo;
#ifdef MEGAMOE_TILE_TRACE
      const int64_t trace_w0 = clock64();
#endif
      ptx::mbarrier_wait(&full[stage], phase);
#ifdef MEGAMOE_TILE_TRACE
      // From the tile's first full stage on, as the FP8 trace: the first wait is the tile's start, not loop time.
      if (kb > u.kb_begin && ctid == 0 && trace_n < kTraceTiles) trace_c[trace_n][1] += clock64() - trace_w0;
#endif
      if (kb == u.kb_begin) {
        t = tile_infos[stage];
        if constexpr (kBlockM > 16) live_cols = p.narrow_mma ? min(kBlockM, max(16, (t.rows + 7) / 8 * 8)) : kBlockM;
#ifdef MEGAMOE_TILE_TRACE
        if (ctid == 0 && trace_n < kTraceTiles) {
          trace_info[trace_n][0] = kIsL1 ? 0 : 1, trace_info[trace_n][1] = t.expert;
          trace_info[trace_n][2] = t.n_block, trace_info[trace_n][3] = t.rows;
          trace_t[trace_n][0] = ptx::globaltimer_ns();  // the tile's first stage is full
          trace_c[trace_n][0] = -clock64();
        }
#endif
        if constexpr (kFP8Mma) {
#pragma unroll
          for (int ls = 0; ls < kSlices; ++ls)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int row = (kSlices * consumer + ls) * 64 + quad_row + 8 * h;
              row_exp[ls][h] = tile_row_exp(stage)[row];
            }
        }
        if constexpr (kEarlyInSmem) {
          issue_early_inputs(t);
        } else if constexpr (kEarlyEpilogueInputs) {
          load_factors(t);
          load_row_inputs(t);
        }
      }
#ifdef MEGAMOE_TILE_TRACE
      const int64_t trace_w1 = clock64();
#endif
      if (!kFoldedOnly && !folded) ptx::mbarrier_wait(&bf_full[b], bphase);  // folded tokens: no converters, no ring
#ifdef MEGAMOE_TILE_TRACE
      if (ctid == 0 && trace_n < kTraceTiles) trace_c[trace_n][1] += clock64() - trace_w1;  // and the bf16 tile
#endif
#pragma unroll
      for (int ls = 0; ls < kSlices; ++ls)
#pragma unroll
        for (int i = 0; i < kRegs; ++i) ptx::fence_operand(acc[ls][i]);
      if constexpr (kFP8Mma) {
      // One stage at width kW, the tile's live token columns (its rows) rounded up to 16 (block_m 32: 16 / 32) or
      // 32 / 48 / 64 (block_m 64): narrow FP8 wgmmas, heuristics::fp4_narrow_mma. The partial holds the first kW / 2
      // registers of the accumulator layout (the same columns); the columns past them keep their zeros (never
      // stored). One body per width around the whole stage: a width branch around each group's wgmmas made ptxas
      // serialise them at block_m 64 (C7511: two slices' accumulators, the partial, a8 and the factors).
      auto fp8_stage = [&](auto width) {
      constexpr int kW = decltype(width)::value;
      using MmaW = ptx::WgmmaFP8RS<kW>;
      constexpr int kRegsW = MmaW::kNumRegs;
#pragma unroll
        for (int j = 0; j < 2 * kSlices; ++j) {
          const int g = j / kSlices, ls = j % kSlices;
          if (g >= groups) break;
          // Every wgmma of the previous stage has finished (each group waits for its own below).
          if (!kFoldedOnly && !folded && j == 0 && kb > u.kb_begin) {
            __syncwarp();
            if (lane == 0) ptx::mbarrier_arrive(&bf_empty[prev_b]);
          }
          uint32_t a8[4][4];  // k32 step s: word s of the 16 bytes (K 32q + 8s .. + 7)
          decode_weights_e4m3(a8, tile_a(stage), stage_scales(stage, kb), fold_tables, (kSlices * consumer + ls) * 64 + quad_row,
                              g, q, row_exp[ls][0], row_exp[ls][1]);
          // Folded tokens: the stage's own token tile and factors; else the converters' E4M3 tile and factors.
          const float* factors =
              reinterpret_cast<const float*>(folded ? tile_sa(stage) : bf + 2 * kCols * 128) + g * kCols;
          float fc[kW / 4];
#pragma unroll
          for (int jj = 0; jj < kW / 4; ++jj) fc[jj] = factors[8 * (jj / 2) + 2 * q + (jj % 2)];
          float part[kRegsW];
#pragma unroll
          for (int s = 0; s < 4; ++s)
#pragma unroll
            for (int r = 0; r < 4; ++r) ptx::fence_operand(a8[s][r]);
#pragma unroll
          for (int i = 0; i < kRegsW; ++i) ptx::fence_operand(part[i]);
          ptx::wgmma_fence();
#pragma unroll
          for (int s = 0; s < 4; ++s)
            MmaW::run(part, a8[s], ptx::smem_desc_sw128(tok_desc_lo + (g * kCols * 128 + s * 32) / 16), s > 0);
          ptx::wgmma_commit();
          // NOTES: waiting here (not before the next decode) keeps the promotion's accumulator index a
          // compile-time constant; the warp would wait before its next decode anyway (register-A wgmmas).
          ptx::wgmma_wait<0>();
#pragma unroll
          for (int i = 0; i < kRegsW; ++i) ptx::fence_operand(part[i]);
          // The tokens' factors only: the weights' (their rows', constant along K) multiply after the tile's K.
#pragma unroll
          for (int i = 0; i < kRegsW; ++i) acc[ls][i] = fmaf(part[i], fc[(i / 4) * 2 + (i % 2)], acc[ls][i]);
        }
      };
      if constexpr (kBlockM == 128) {
        if (live_cols <= 32) fp8_stage(std::integral_constant<int, 32>{});
        else if (live_cols <= 48) fp8_stage(std::integral_constant<int, 48>{});
        else if (live_cols <= 64) fp8_stage(std::integral_constant<int, 64>{});
        else if (live_cols <= 96) fp8_stage(std::integral_constant<int, 96>{});
        else fp8_stage(std::integral_constant<int, 128>{});
      } else if constexpr (kBlockM == 64) {
        if (live_cols <= 32) fp8_stage(std::integral_constant<int, 32>{});
        else if (live_cols <= 48) fp8_stage(std::integral_constant<int, 48>{});
        else fp8_stage(std::integral_constant<int, 64>{});
      } else if constexpr (kBlockM == 32) {
        if (live_cols <= 16) fp8_stage(std::integral_constant<int, 16>{});
        else fp8_stage(std::integral_constant<int, 32>{});
      } else {
        fp8_stage(std::integral_constant<int, kCols>{});
      }
      } else {
      // One stage's decode + wgmmas, at the tile's width: `fixed` > 0, or chosen inside the stage: 0 by live_cols
      // (block_m 32 / 64), -1 among 8 / 16 / 24 (block_m 16 with NVFP4 tokens, the wide-tail build included); the
      // wide-tail build with FP8 tokens runs every tile at 24.
      // NOTES: in the wide-tail build three stage bodies chosen per tile (8 / 16 / 24) made ptxas serialise the
      // wgmmas for want of registers (C7511); with FP8 tokens a 16 / 24 branch inside the stage made it serialise
      // L1's (C7520), and two bodies ran 7-22 % slower at T = 1-128 (heuristics::fp4_tail_rows).
      constexpr bool kNarrow8 = kRecipe == ActRecipe::kNVFP4 && !kSplitK;  // m64n8 for tiles of at most 8 rows
      auto bf16_stage = [&](auto fixed) {
      constexpr int kFixed = decltype(fixed)::value;
#pragma unroll
      for (int j = 0; j < 2 * kSlices; ++j) {
        const int g = j / kSlices, ls = j % kSlices;
        if (g >= groups) break;
        // NOTES: a warp writes A-fragment registers only when none of its wgmmas is in flight. ptxas
        // serializes every wgmma (a WARPGROUP.DEPBAR after each HGMMA, warning C7513) as soon as a wgmma input
        // register is written while an earlier wgmma may run, even a register of a later group and with the
        // wgmma that read it retired (tried: two alternating fragment sets behind wait_group 1). Waiting here
        // costs one wgmma latency per 8 wgmmas; the other consumer warps decode meanwhile.
        // NOTES: two sets, each kept live past the wait that retires its unit, compile without serialisation
        // and let a warp decode unit j + 1 while unit j's wgmmas run, but gained nothing (H100, 2026-11-25:
        // probe_fp4.py pipe 3,172 cycles per stage vs 3,204; the kernel 0-3 % slower at prefill, 459 tests
        // passed). Decode and register-A wgmmas share the SM's issue and register-file bandwidth: the loop is
        // bound by their sum, not by the wait.
        ptx::wgmma_wait<0>();  // unconditional: ptxas must see it on every path to the decode
        if (j == 0 && kb > u.kb_begin) {
          // Every wgmma of the previous stage has finished (waited above): its bf16 tile is free.
          __syncwarp();
          if (lane == 0) ptx::mbarrier_arrive(&bf_empty[prev_b]);
        }
        decode_weights<kNV>(a, tile_a(stage), stage_scales(stage, kb), (kSlices * consumer + ls) * 64 + quad_row, g, q);
        uint64_t desc_b[8];
#pragma unroll
        for (int s = 0; s < 8; ++s) {
          const int step = 8 * g + s;
          desc_b[s] = ptx::smem_desc_sw128(bf_desc_lo + ((step / 4) * kCols * 128 + (step % 4) * 32) / 16);
        }
        fence_fragment(a);
        ptx::wgmma_fence();
        // Only the tile's live token columns (live_cols: its rows rounded up to 8, at least 16; 8, 16 or 24 at block_m
        // 16): the wgmma's time scales with N (an expert's rows scatter around the mean: V4-Pro T=2048 puts ~32 rows in
        // a 64-row block), and the columns past them stay zero (never stored). The same products for the live columns.
        auto issue = [&](auto width) {
#pragma unroll
          for (int s = 0; s < 8; ++s) ptx::WgmmaBF16RS<decltype(width)::value>::run(acc[ls], a[s], desc_b[s]);
        };
        if constexpr (kBlockM == 64 && kFixed == 0) {
          if (live_cols > 48) {
            if (live_cols == 64) issue(std::integral_constant<int, 64>{});
            else issue(std::integral_constant<int, 56>{});
          } else if (live_cols > 32) {
            if (live_cols == 48) issue(std::integral_constant<int, 48>{});
            else issue(std::integral_constant<int, 40>{});
          } else if (live_cols > 16) {
            if (live_cols == 32) issue(std::integral_constant<int, 32>{});
            else issue(std::integral_constant<int, 24>{});
          } else {
            issue(std::integral_constant<int, 16>{});
          }
        } else if constexpr (kBlockM == 32 && kFixed == 0) {
          if (live_cols == 32) issue(std::integral_constant<int, 32>{});
          else if (live_cols == 24) issue(std::integral_constant<int, 24>{});
          else issue(std::integral_constant<int, 16>{});
        } else if constexpr (kFixed < 0) {
          if (kNarrow8 && p.narrow_mma && t.rows <= 8) issue(std::integral_constant<int, 8>{});
          else if (kTail == 0 || t.rows <= kBlockM) issue(std::integral_constant<int, kBlockM>{});
          else issue(std::integral_constant<int, kCols>{});
        } else {
          issue(fixed);
        }
        ptx::wgmma_commit();
      }
      };
      if constexpr (kBlockM > 16) {
        bf16_stage(std::integral_constant<int, 0>{});
      } else {
        // NVFP4 tokens only: with FP8 tokens m64n8 ran 2-7 % slower at T = 1-512 (MXFP4 and NVFP4 weights, both
        // models), with NVFP4 tokens 1-8 % faster at 128-512 (H100, 2026-11-26, 2 rounds; docs/bench/
        // h100-2026-11-26d-ab-fp4-n8-all-recipes.json; not explained). Not in the split builds: L1 then spilled 12
        // bytes, and in L2 ptxas serialised every wgmma (C7520: an injected warpgroup arrive in a divergent path).
        // A wide tile (an expert's last block past 16 rows, kTail > 0) runs m64n24 into the whole fragment.
        // FP8 tokens in the wide-tail build: every tile on m64n24 (the columns past its rows are never stored); a
        // width branch inside the stage made ptxas serialise the wgmmas (C7520), two stage bodies cost 7-22 %.
        if constexpr (kNarrow8) bf16_stage(std::integral_constant<int, -1>{});
        else bf16_stage(std::integral_constant<int, kCols>{});
      }
      }
      // The stage's weights and weight scales are in registers now: the producer may refill it.
      ptx::mbarrier_arrive(&empty[stage]);
      if (++stage == kNumStages) stage = 0, phase ^= 1;
      prev_b = b;
      if (++b == kNumBfTiles) b = 0, bphase ^= 1;
    }
    ptx::wgmma_wait<0>();
#pragma unroll
    for (int ls = 0; ls < kSlices; ++ls)
#pragma unroll
      for (int i = 0; i < kRegs; ++i) ptx::fence_operand(acc[ls][i]);
    if constexpr (kFP8Mma) {
      // The rows' weight factors 2^(row_exp - 127 - kFoldHeadroom), once per unit (exact: powers of two; a split unit's
      // partials carry them too).
      constexpr float kHeadroom = 1.0f / (1 << kFoldHeadroom);
#pragma unroll
      for (int ls = 0; ls < kSlices; ++ls) {
        const float fr[2] = {ue8m0_float(row_exp[ls][0]) * kHeadroom, ue8m0_float(row_exp[ls][1]) * kHeadroom};
#pragma unroll
        for (int i = 0; i < kRegs; ++i) acc[ls][i] *= fr[(i / 2) % 2];
      }
    }
#ifdef MEGAMOE_TILE_TRACE
    if (ctid == 0 && trace_n < kTraceTiles)
      trace_t[trace_n][1] = ptx::globaltimer_ns(), trace_c[trace_n][0] += clock64();  // main loop done
#endif
    // The last stage's bf16 tile is the epilogue's scratch; it is released (to the converters, if any) at the end of
    // the epilogue.
    uint8_t* epi = bf;

    if (kSplitK && u.split >= 0) {
      // A split unit (SplitPlan): its accumulators out (thread-contiguous rows of the unit's block), then the tile's
      // counter; the last unit sums every unit's block in split order and goes on to the epilogue.
      constexpr int kUnitFloats = kSlices * kRegs * kNumConsumerThreads;
      static_assert(!kSplitK || (kUnitFloats == kTileN * kBlockM && kCols == kBlockM),
                    "a unit's partials: 256 x block_m floats (the host's workspace)");
      const int first_unit = plan.whole + (u.tile - plan.whole) * plan.splits;  // the tile's split 0
      float* mine = p.partials + int64_t(unit - plan.whole) * kUnitFloats + ctid;
#pragma unroll
      for (int ls = 0; ls < kSlices; ++ls)
#pragma unroll
        for (int i = 0; i < kRegs; ++i) __stcg(mine + (ls * kRegs + i) * kNumConsumerThreads, acc[ls][i]);
      __threadfence();  // the stores before the count (the last unit reads them after its own fence)
      ptx::named_barrier_sync(1, kNumConsumerThreads);
      if (ctid == 0) *split_last = atomicAdd(p.split_counters + (u.tile - plan.whole), 1) == plan.splits - 1;
      ptx::named_barrier_sync(1, kNumConsumerThreads);
      if (!*split_last) {
        // Not the last: no epilogue; the bf16 tile is free (the stores above read registers only). The early inputs'
        // copies complete before the next unit's copies to the same words.
        if constexpr (kEarlyInSmem) ptx::cp_async_wait_all();
        if (!folded && lane == 0) ptx::mbarrier_arrive(&bf_empty[prev_b]);
#ifdef MEGAMOE_TILE_TRACE
        if (ctid == 0 && trace_n < kTraceTiles) trace_t[trace_n++][2] = ptx::globaltimer_ns();
#endif
        continue;
      }
      __threadfence();
      const float* tile_units = p.partials + int64_t(first_unit - plan.whole) * kUnitFloats + ctid;
      for (int sp = 0; sp < plan.splits; ++sp) {
#pragma unroll
        for (int ls = 0; ls < kSlices; ++ls)
#pragma unroll
          for (int i = 0; i < kRegs; ++i) {
            const float v = __ldcg(tile_units + int64_t(sp) * kUnitFloats + (ls * kRegs + i) * kNumConsumerThreads);
            acc[ls][i] = sp == 0 ? v : acc[ls][i] + v;
          }
      }
    }

    // ======================================================================== epilogue
    if constexpr (kEarlyInSmem) ptx::cp_async_wait_all();  // this thread's early-input copies
    ptx::named_barrier_sync(1, kNumConsumerThreads);  // every consumer's wgmmas on `epi` have finished (and the copies)
    trace_phase(0);
    if constexpr (kEarlyInSmem) read_early_inputs();
    else if constexpr (!kEarlyEpilogueInputs) load_factors(t);
    if constexpr (kIsL1) {
      // SwiGLU: gate rows (even slice) with the matching up rows (the next slice). With one slice per consumer
      // (block_m 16) the two consumers of a pair split the token columns: each hands the other the half of its fragment
      // that the other owns (same thread position, same layout), so both then hold gate and up values for their own
      // half (registers [h kOwn, h kOwn + kOwn) of the fragment, h = consumer % 2) and do the SwiGLU, amax and
      // quantize for it; the pair index replaces the consumer index below.
      // NOTES: the gate consumer did all of it before while the up consumer waited (H100 tile trace, 2026-11-26: swiglu
      // + amax ~1 us, quantize 1.4-2.1 us per block_m 16 tile). H100 A/B of the split (2026-11-26, 2 rounds, every FP4
      // pair, both models, T = 1 / 16 / 128 / 512; docs/bench/h100-2026-11-26-ab-fp4-l1-split-columns.json): median
      // 0.996 per replay (0.979-1.014), 0.996 in a graph (0.975-1.004); 29 / 28 of 32 rows at or below 1.000. Tests:
      // test_gpu_fp4 467 passed.
      // The fragment's 8-column groups (registers [4 g, 4 g + 4)): with one slice per consumer, half h finishes the
      // groups g = h, h + 2, ... (16 columns: one each; 24: groups 0 and 2 / group 1), kOwnGroups slots of 4 registers
      // (a slot past the fragment holds zeros, its columns past every tile's rows: never stored).
      const int pair = kSlices == 2 ? consumer : consumer / 2;
      const int half = kSlices == 2 ? 0 : consumer % 2;
      constexpr int kGroups = kRegs / 4;
      constexpr int kOwnGroups = kSlices == 2 ? kGroups : (kGroups + 1) / 2;
      constexpr int kOwn = 4 * kOwnGroups;  // registers this thread finishes
      // One slice per consumer: half h finishes the fragment's groups [h kOwnGroups, (h + 1) kOwnGroups) (an even group
      // count: the exchange below hands over contiguous halves), or the groups of parity h (the wide-tail build's 3).
      auto own_group = [&](int s) { return kSlices == 2 ? s : kGroups % 2 == 0 ? half * kOwnGroups + s : half + 2 * s; };
      auto own_live = [&](int s) { return kGroups % 2 == 0 || own_group(s) < kGroups; };  // a slot inside the fragment
      static_assert(kSlices == 2 || kEarlyEpilogueInputs || kFoldedOnly,
                    "one slice per consumer reads col_w / col_f before the epilogue (block_m 128: its own columns here)");
      float gate[kOwn], up[kOwn], own_w[kOwn / 2], own_f[kOwn / 2];
      if constexpr (kSlices == 2) {
#pragma unroll
        for (int r = 0; r < kOwn; ++r) gate[r] = acc[0][r], up[r] = acc[1][r];
        if constexpr (!kEarlyEpilogueInputs) load_row_inputs(t);
#pragma unroll
        for (int c = 0; c < kOwn / 2; ++c) own_w[c] = col_w[c], own_f[c] = col_f[c];  // every column is this thread's
      } else if constexpr (kFoldedOnly) {
        // Block_m 128: the gate consumer (half 0) and the up consumer (half 1) exchange halves of their 16 fragment
        // groups as below, in a [2 halves][kOwn][128 threads] layout (thread-contiguous: no bank conflicts), and each
        // loads the top-k weights of its own 32 columns (no global factors: own_f = 1).
        const float* row_weight = reinterpret_cast<const float*>(p.buffer + l.dispatch_weight_offset) + t.row0;
#pragma unroll
        for (int c = 0; c < kOwn / 2; ++c) {
          const int col = 8 * own_group(c / 2) + 2 * q + (c % 2);
          own_w[c] = col < t.rows ? row_weight[col] : 0.0f, own_f[c] = 1.0f;
        }
        float* xchg = reinterpret_cast<float*>(epi) + half * kOwn * 128 + (ctid % 128);
#pragma unroll
        for (int r = 0; r < kOwn; ++r) xchg[r * 128] = half ? acc[0][r] : acc[0][kOwn + r];  // the other's half
        ptx::named_barrier_sync(1, kNumConsumerThreads);
        const float* from = reinterpret_cast<const float*>(epi) + (1 - half) * kOwn * 128 + (ctid % 128);
#pragma unroll
        for (int r = 0; r < kOwn; ++r) {
          const float mine = half ? acc[0][kOwn + r] : acc[0][r], theirs = from[r * 128];
          gate[r] = half ? theirs : mine, up[r] = half ? mine : theirs;
        }
        ptx::named_barrier_sync(1, kNumConsumerThreads);  // `epi` is free again
        static_assert(!kFoldedOnly || 2 * kOwn * 128 * 4 <= S::kTileBF, "the exchange in the epilogue scratch");
      } else if constexpr (kGroups % 2 == 0) {
        // One group each: each thread hands the other the group it owns ([2 pairs][2 halves][128][kOwn] floats).
        float* xchg = reinterpret_cast<float*>(epi) + ((pair * 2 + half) * 128 + (ctid % 128)) * kOwn;
#pragma unroll
        for (int r = 0; r < kOwn; ++r) xchg[r] = half ? acc[0][r] : acc[0][kOwn + r];  // the other's half
        ptx::named_barrier_sync(1, kNumConsumerThreads);
        const float* from = reinterpret_cast<const float*>(epi) + ((pair * 2 + (1 - half)) * 128 + (ctid % 128)) * kOwn;
#pragma unroll
        for (int r = 0; r < kOwn; ++r) {
          const float mine = half ? acc[0][kOwn + r] : acc[0][r], theirs = from[r];
          gate[r] = half ? theirs : mine, up[r] = half ? mine : theirs;
        }
#pragma unroll
        for (int c = 0; c < kOwn / 2; ++c)
          own_w[c] = half ? col_w[kOwn / 2 + c] : col_w[c], own_f[c] = half ? col_f[kOwn / 2 + c] : col_f[c];
        ptx::named_barrier_sync(1, kNumConsumerThreads);  // `epi` is free again
      } else {
        // Groups by parity (the wide-tail build's 3): each thread of the pair writes the groups the other finishes into
        // one record per thread position ([2 pairs][128][kRegs] floats: exactly a bf16 tile), then reads its own
        // groups from the other's writes.
        float* xchg = reinterpret_cast<float*>(epi) + (pair * 128 + (ctid % 128)) * kRegs;
#pragma unroll
        for (int g = 0; g < kGroups; ++g)
          if (g % 2 != half)
#pragma unroll
            for (int r = 0; r < 4; ++r) xchg[4 * g + r] = acc[0][4 * g + r];
        ptx::named_barrier_sync(1, kNumConsumerThreads);
#pragma unroll
        for (int sl = 0; sl < kOwnGroups; ++sl) {
          const bool live = own_group(sl) < kGroups;  // compile-time indices below: half selects
          constexpr int kMaxG = kGroups - 1;
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const float mine = half ? (2 * sl + 1 <= kMaxG ? acc[0][min(4 * (2 * sl + 1) + r, kRegs - 1)] : 0.0f)
                                    : acc[0][4 * (2 * sl) + r];
            const float theirs = live ? xchg[4 * own_group(sl) + r] : 0.0f;
            gate[4 * sl + r] = half ? theirs : mine, up[4 * sl + r] = half ? mine : theirs;
          }
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int j0 = 2 * (2 * sl) + c, j1 = min(2 * (2 * sl + 1) + c, kCols / 4 - 1);
            const bool has1 = 2 * sl + 1 <= kMaxG;
            own_w[2 * sl + c] = half ? (has1 ? col_w[j1] : 0.0f) : col_w[j0];
            own_f[2 * sl + c] = half ? (has1 ? col_f[j1] : 0.0f) : col_f[j0];
          }
        }
        ptx::named_barrier_sync(1, kNumConsumerThreads);  // `epi` is free again
      }
      // Token column of own register r (fragment column 8 g + 2 q + r % 2 of its group g).
      auto own_col = [&](int r) { return 8 * own_group(r / 4) + 2 * q + (r % 2); };
      swiglu_fragment<true>(gate, up, own_w, own_f, p.fast_math, p.activation_clamp);
      const int inter = p.n / 2;
      if constexpr (kOut == ActRecipe::kNVFP4) {
        // The per-token global scale spans the whole I row, which no tile sees: store float32, the
        // requantization kernel runs after this grid.
#pragma unroll
        for (int r = 0; r < kOwn; ++r) {
          const int col = own_col(r);  // past the fragment (a zero slot): past the rows too
          const int out = t.n_block * (kTileN / 2) + pair * 64 + quad_row + ((r / 2) % 2) * 8;
          if (col < t.rows) p.scratch[int64_t(t.row0 + col) * inter + out] = gate[r];
        }
      } else {
        // Per-token amax over each 32 outputs (two warps of a consumer): registers, lanes sharing a column
        // (xor 4, 8, 16), then shared memory.
        float* amax_smem = reinterpret_cast<float*>(epi);             // [8 warps][kCols]
        uint8_t* out_tile = epi + 8 * kCols * 4;                      // [kCols][128] codes / E4M3
        float* inv_smem = reinterpret_cast<float*>(out_tile + kCols * 128);  // [4 blocks][kCols] 1 / scale
        uint8_t* scale_bits = reinterpret_cast<uint8_t*>(inv_smem + 4 * kCols);  // [kCols][4 blocks] UE8M0 (folded)
        static_assert(8 * kCols * 4 + kCols * 128 + 4 * kCols * 4 + 4 * kCols <= S::kTileBF, "L1 epilogue scratch");
        // FP8-wgmma path, FP8 tokens: L2's input leaves folded (Params::fold_output), as the gather folds L1's. (Only
        // in `if constexpr (kCanFoldOut)` blocks: the other builds' code stays as it was, register for register.)
        // (A 128-row tile writes 64 outputs, half of L2's 128-K group: block_m 128 leaves the fold to launch_pool_fold.)
        // kOutFP4 (MXFP4 tokens folded upstream) likewise: its MXFP4 outputs leave folded into the fold workspace.
        constexpr bool kCanFoldOut = kFP8Mma && (kOut == ActRecipe::kFP8UE8M0Block32 || kOutFP4) && kTileN == 256;
        constexpr int kOutBlocks = kTileN / 64;  // this tile's 32-output scale blocks (its kTileN / 2 outputs)
#pragma unroll
        for (int sl = 0; sl < kOwnGroups; ++sl)
          if (own_live(sl))  // warp-uniform
            store_token_amax<8>(gate + 4 * sl, amax_smem + (pair * 4 + warp) * kCols + 8 * own_group(sl), lane);
        ptx::named_barrier_sync(1, kNumConsumerThreads);
        trace_phase(1);
        // One thread per (32-output block, token) takes the block's scale from its two warps' amax, stores it (UE8M0)
        // and its exact reciprocal; the quantize below multiplies by that (== the division, bit for bit).
        // NOTES: every thread computed the scales of its own 4 (block_m 16) to 16 tokens before: a division chain with
        // slow-path branches per token, ~500 instructions of the quantize phase, which took 1.4-2.1 us per block_m 16
        // tile (H100 tile trace, 2026-11-26, docs/bench/h100-2026-11-26-trace-phases-*.txt). With this, H100 A/B (2
        // rounds, both models, T = 1-2048, docs/bench/h100-2026-11-26-ab-fp4-l1-scales-once.json): 0.950-1.000 per
        // replay, median 0.986, where the L1 quantizes (MXFP4 / FP8 tokens); NVFP4-token rows (no change) 0.986-1.004.
        static_assert(kOutBlocks * kCols <= kNumConsumerThreads, "a scale per consumer thread");
        if (ctid < kOutBlocks * kCols) {
          const int bl = ctid / kCols, col = ctid % kCols;  // bl = pair * 2 + warp / 2: warps 2 bl, 2 bl + 1
          const float amax = max_nan(amax_smem[(2 * bl) * kCols + col], amax_smem[(2 * bl + 1) * kCols + col]);
          constexpr float kCodeMax = kOut == ActRecipe::kFP8UE8M0Block32 ? kFP8Max : kE2M1Max;
          const float scale = ue8m0_block_scale(amax, kCodeMax);
          inv_smem[bl * kCols + col] = pow2_reciprocal(scale);
          auto store_scale = [&] {
            if (col < t.rows)
              p.buffer[l.pool_sf_offset + int64_t(t.n_block * kOutBlocks + bl) * l.pool_rows + t.row0 + col] =
                  ue8m0_bits(scale);
          };
          if constexpr (kCanFoldOut) {
            if (kOutFP4 || p.fold_output) scale_bits[col * 4 + bl] = ue8m0_bits(scale);
            else store_scale();
          } else {
            store_scale();
          }
        }
        ptx::named_barrier_sync(1, kNumConsumerThreads);
        {
          const float* inv_block = inv_smem + (pair * 2 + warp / 2) * kCols;
#pragma unroll
          for (int j = 0; j < kOwn / 2; ++j) {
            if (!own_live(j / 2)) continue;  // a zero slot (warp-uniform)
            const int i0 = (j / 2) * 4 + (j % 2);
            const int col = own_col(i0);
            const float inv = inv_block[col];
            const int out = pair * 64 + quad_row;
            uint8_t c0, c1;
            if constexpr (kOut == ActRecipe::kFP8UE8M0Block32) {
              c0 = to_fp8(gate[i0] * inv), c1 = to_fp8(gate[i0 + 2] * inv);
            } else {
              c0 = static_cast<uint8_t>(e2m1_code(gate[i0] * inv));
              c1 = static_cast<uint8_t>(e2m1_code(gate[i0 + 2] * inv));
            }
            out_tile[staged_offset<uint8_t, 128>(col, out)] = c0;
            out_tile[staged_offset<uint8_t, 128>(col, out + 8)] = c1;
          }
        }
        ptx::named_barrier_sync(1, kNumConsumerThreads);
        trace_phase(2);
        // Folded copy-out (the gather's fold, fold_fp8_group, one output chunk per thread): this tile's 128 outputs are
        // one 128-K group of L2; chunk c of a row takes word c of each 32-K quarter q, x 2^-(T - t_q), and the row's
        // factor 2^(T - 127) goes to the float factors [inter / 128, pool_rows] at pool_sf_offset.
        auto copy_out_folded = [&] {
          for (int c = ctid; c < kCols * 8; c += kNumConsumerThreads) {
            const int col = c / 8, chunk = c % 8;
            if (col < t.rows) {
              const uint32_t scales4 = *reinterpret_cast<const uint32_t*>(scale_bits + col * 4);
              uint32_t tq[4], tmax = 0;
#pragma unroll
              for (int qq = 0; qq < 4; ++qq) tq[qq] = (scales4 >> (8 * qq)) & 0xFF, tmax = max(tmax, tq[qq]);
              const uint32_t* words = reinterpret_cast<const uint32_t*>(out_tile);
              uint32_t o[4];
#pragma unroll
              for (int qq = 0; qq < 4; ++qq)  // K 32 qq + 4 chunk: staged 16-byte part 2 qq + chunk / 4, word chunk % 4
                o[qq] = fold_quarter_word(words[(col * 8 + staged_chunk(col, 2 * qq + chunk / 4)) * 4 + chunk % 4],
                                          static_cast<int>(tmax - tq[qq]));
              *reinterpret_cast<uint4*>(p.buffer + l.pool_offset + int64_t(t.row0 + col) * inter + t.n_block * 128 +
                                        chunk * 16) = make_uint4(o[0], o[1], o[2], o[3]);
              if (chunk == 0)
                reinterpret_cast<float*>(p.buffer + l.pool_sf_offset)[int64_t(t.n_block) * l.pool_rows + t.row0 + col] =
                    ue8m0_float(tmax);
            }
          }
        };
        // MXFP4 outputs: the 8 codes of part `part` (outputs 8 part .. + 7) packed, low nibble first (checkpoint packing).
        auto packed_codes = [&](int col, int part) {
          const uint2 codes = reinterpret_cast<const uint2*>(out_tile)[col * 16 + staged_chunk(col, part / 2) * 2 + part % 2];
          uint32_t packed = 0;
#pragma unroll
          for (int b = 0; b < 4; ++b) {
            packed |= ((codes.x >> (8 * b)) & 0xF) << (4 * b);
            packed |= ((codes.y >> (8 * b)) & 0xF) << (16 + 4 * b);
          }
          return packed;
        };
        // kOutFP4's folded copy-out (the converters' fold, fold_e2m1_quarter: the same bits as launch_fold_mxfp4), one
        // (token, 32-output quarter q) per thread: its 16 packed bytes folded by T - t_q into word q of the 8 chunks of
        // L2's E4M3 row (Params::fold_out), the factor 2^(T - 127) into Params::fold_out_factors [inter / 128,
        // pool_rows].
        auto copy_out_folded_fp4 = [&] {
          for (int c = ctid; c < kCols * 4; c += kNumConsumerThreads) {
            const int col = c / 4, qq = c % 4;
            if (col < t.rows) {
              const uint32_t scales4 = *reinterpret_cast<const uint32_t*>(scale_bits + col * 4);
              uint32_t tmax = 0;
#pragma unroll
              for (int b = 0; b < 4; ++b) tmax = max(tmax, (scales4 >> (8 * b)) & 0xFF);
              const uint32_t tq = (scales4 >> (8 * qq)) & 0xFF;
              const uint4 raw = make_uint4(packed_codes(col, 4 * qq), packed_codes(col, 4 * qq + 1),
                                           packed_codes(col, 4 * qq + 2), packed_codes(col, 4 * qq + 3));
              uint32_t* row = reinterpret_cast<uint32_t*>(p.fold_out + int64_t(t.row0 + col) * inter + t.n_block * 128);
              fold_e2m1_quarter(raw, fold_tables, static_cast<int>(tmax - tq), [&](int st, uint32_t lo, uint32_t hi) {
                row[(2 * st) * 4 + qq] = lo, row[(2 * st + 1) * 4 + qq] = hi;
              });
              if (qq == 0) p.fold_out_factors[int64_t(t.n_block) * l.pool_rows + t.row0 + col] = ue8m0_float(tmax);
            }
          }
        };
        auto copy_out = [&] {
          if constexpr (kOut == ActRecipe::kFP8UE8M0Block32) {
            // Coalesced copy-out: kParts x 16 bytes per token row (8; block_m 128: 4).
            constexpr int kParts = kTileN / 32;
            for (int c = ctid; c < kCols * kParts; c += kNumConsumerThreads) {
              const int col = c / kParts, part = c % kParts;
              if (col < t.rows)
                *reinterpret_cast<uint4*>(p.buffer + l.pool_offset + int64_t(t.row0 + col) * inter +
                                          t.n_block * (kTileN / 2) + part * 16) =
                    reinterpret_cast<const uint4*>(out_tile)[col * 8 + staged_chunk(col, part)];
            }
          } else {
            // Pack: 8 codes -> 4 bytes (low nibble first); kPackParts x 4 bytes per token row (16; block_m 128: 8).
            constexpr int kPackParts = kTileN / 16;
            for (int c = ctid; c < kCols * kPackParts; c += kNumConsumerThreads) {
              const int col = c / kPackParts, part = c % kPackParts;
              if (col < t.rows) {
                const uint32_t packed = packed_codes(col, part);
                *reinterpret_cast<uint32_t*>(p.buffer + l.pool_offset + int64_t(t.row0 + col) * (inter / 2) +
                                             t.n_block * (kTileN / 4) + part * 4) = packed;
              }
            }
          }
        };
        if constexpr (kCanFoldOut && kOutFP4) {
          copy_out_folded_fp4();  // launch_l1_mxfp4_fold: fold_output at every block_m with 256-row tiles
        } else if constexpr (kCanFoldOut) {
          if (p.fold_output) copy_out_folded();
          else copy_out();
        } else {
          copy_out();
        }
      }
      ptx::named_barrier_sync(1, kNumConsumerThreads);
    } else {
      // L2: bf16 rows into the combine area of the token's rank at (token, slot) (NVLink stores for a peer).
      __nv_bfloat16* out_tile = reinterpret_cast<__nv_bfloat16*>(epi);  // [kCols][kTileN]
#pragma unroll
      for (int ls = 0; ls < kSlices; ++ls) {
        const int base = staged_offset<__nv_bfloat16, kTileN>(2 * q, (kSlices * consumer + ls) * 64 + quad_row);
#pragma unroll
        for (int i = 0; i < kRegs; ++i) {
          const int j = (i / 4) * 2 + (i % 2);
          out_tile[base + staged_fragment_delta<kTileN>(i)] = __float2bfloat16_rn(acc[ls][i] * col_f[j]);
        }
      }
      ptx::named_barrier_sync(1, kNumConsumerThreads);
      trace_phase(1);
      if constexpr (!kEarlyEpilogueInputs) load_row_inputs(t);
      store_combine_tile<kCols, kTileN, kNumConsumerThreads>(src, out_tile, p.buffer, l, t.n_block, p.n, ctid);
      ptx::named_barrier_sync(1, kNumConsumerThreads);
    }
    // Every consumer is past the epilogue's last read of `epi` (the barrier above): the converters (ring mode) may
    // refill it.
    if (!kFoldedOnly && !folded && lane == 0) ptx::mbarrier_arrive(&bf_empty[prev_b]);
#ifdef MEGAMOE_TILE_TRACE
    if (ctid == 0 && trace_n < kTraceTiles) trace_t[trace_n++][2] = ptx::globaltimer_ns();  // epilogue done
#endif
  }
#ifdef MEGAMOE_TILE_TRACE
  if (ctid == 0 && blockIdx.x < kTraceMaxCtas) {
    TraceRecord& r = g_fp4_trace[kIsL1 ? 0 : 1][blockIdx.x];
    r.sm = trace_smid(), r.entry = trace_entry, r.launch = trace_launch, r.consumer_n = trace_n;
    for (int i = 0; i < trace_n; ++i) {
      // Phases not reached (L2's third; L1 with NVFP4 tokens stores float32 rows: its second and third) end with the tile.
      for (int j = 0; j < 4; ++j) r.info[i][j] = trace_info[i][j], r.e[i][j] = j < 3 && trace_e[i][j] ? trace_e[i][j] : trace_t[i][2];
      for (int j = 0; j < 3; ++j) r.t[i][j] = trace_t[i][j];
      r.c[i][0] = trace_c[i][0], r.c[i][1] = trace_c[i][1];
    }
    for (int g = 0; g < 2; ++g)
      for (int j = 0; j < 8; ++j) r.walk[g][j] = 0;  // the FP4 kernels keep no whole-walk sums
    r.exit = ptx::globaltimer_ns();
  }
#endif
#else
  __trap();  // built for a GPU without wgmma: the host never launches this
#endif
}

// Host: one instantiation's launch (defined here, instantiated by the per-layer .cu files).
template <int kBlockM, bool kIsL1, bool kNV, ActRecipe kRecipe, bool kFP8Mma, bool kSplitK = false,
          bool kWideTail = false, bool kOutFP4 = false>
void launch_config(const Fp4GroupedGemmArgs& a, const Params& p, int num_sms, cudaStream_t stream) {
  constexpr bool kActFP4 = kRecipe != ActRecipe::kFP8UE8M0Block32;
  constexpr int kCols = heuristics::fp4_tile_cols(kBlockM, kWideTail);
  constexpr int kStages = heuristics::fp4_num_stages_for(kBlockM, kActFP4, kCols);
  constexpr int kBytes = Smem<kBlockM, kCols, kActFP4>::template bytes<kStages>();
  static_assert(kBytes <= 227 * 1024, "FP4 grouped GEMM shared memory exceeds the 227 KB a block may use");
  constexpr auto kernel =
      sm90_fp4_grouped_gemm_kernel<kBlockM, kStages, kIsL1, kNV, kRecipe, kFP8Mma, kSplitK, kWideTail, kOutFP4>;
  allow_dynamic_smem<kernel>(kBytes);
  launch_pdl(kernel, dim3(num_sms), dim3(Roles<kBlockM>::kThreads), kBytes, stream, a.tmap_weights, a.tmap_acts,
             a.tmap_acts_tail, p);
#ifdef MEGAMOE_TILE_TRACE
  fp4_trace_print_kernel<<<1, 1, 0, stream>>>(kIsL1 ? 0 : 1, num_sms);  // after the GEMM (stream order)
#endif
}

// Every (block_m, activation recipe) of one layer and weight format (kFP8Mma: MXFP4 on FP8 wgmmas).
template <bool kIsL1, bool kNV, bool kFP8Mma = false>
void launch_layer(const Fp4GroupedGemmArgs& a, const Params& p, int block_m, int num_sms, cudaStream_t stream) {
  // Tail rows route blocks of up to block_m + tail_rows rows, which only the wide-tail build holds.
  if (a.tail_rows != 0 && (a.tail_rows != heuristics::kFp4TailRows || block_m != 16 || a.recipe == ActRecipe::kMXFP4 ||
                           (kFP8Mma && !p.folded_tokens) || p.split_round > 0))
    throw std::runtime_error("megamoe: FP4 routing tail_rows = " + std::to_string(a.tail_rows) +
                             " needs the wide-tail build (tail_rows " + std::to_string(heuristics::kFp4TailRows) +
                             ", block_m 16, NVFP4 or FP8 tokens, folded on the FP8-wgmma path, no split K); got block_m " +
                             std::to_string(block_m));
// Split K of the last round (SplitPlan) is compiled for block_m 16 only (few tokens) and launched where the host gave a
// workspace (heuristics::fp4_split_round): elsewhere the kernel without it, whose loops run K from 0 (the split-capable
// build ran 3-6 % slower at T = 16 / 128 with no tile split; H100, 2026-11-26).
// The wide-tail build (heuristics::fp4_tail_rows: block_m 16, NVFP4 or FP8 tokens, no split) where the routing gave
// tail rows.
#define MEGAMOE_FP4_LAUNCH_SPLIT(BM, RECIPE, FP8MMA)                                                              \
  if constexpr (BM == 16 && RECIPE != ActRecipe::kMXFP4)                                                          \
    if (p.split_round == 0 && a.tail_rows > 0)                                                                    \
      return launch_config<BM, kIsL1, kNV, RECIPE, FP8MMA, false, true>(a, p, num_sms, stream);                  \
  return BM == 16 && p.split_round > 0 ? launch_config<BM, kIsL1, kNV, RECIPE, FP8MMA, BM == 16>(a, p, num_sms, stream) \
                                       : launch_config<BM, kIsL1, kNV, RECIPE, FP8MMA>(a, p, num_sms, stream);
#define MEGAMOE_FP4_LAUNCH(BM)                                                                        \
  case BM:                                                                                            \
    switch (a.recipe) {                                                                               \
      case ActRecipe::kFP8UE8M0Block32:                                                               \
        MEGAMOE_FP4_LAUNCH_SPLIT(BM, ActRecipe::kFP8UE8M0Block32, kFP8Mma)                            \
      case ActRecipe::kMXFP4:                                                                         \
        if constexpr (!kNV) MEGAMOE_FP4_LAUNCH_SPLIT(BM, ActRecipe::kMXFP4, kFP8Mma)                  \
        break;                                                                                        \
      case ActRecipe::kNVFP4:                                                                         \
        if constexpr (kNV && !kFP8Mma) MEGAMOE_FP4_LAUNCH_SPLIT(BM, ActRecipe::kNVFP4, false)         \
        break;                                                                                        \
      default:                                                                                        \
        break;                                                                                        \
    }                                                                                                 \
    break;
  if (a.out_fp4)  // its own translation unit (sm90_fp4_grouped_gemm_l1_mxfp4_fold.cu)
    throw std::runtime_error("megamoe: MXFP4 output from upstream-folded tokens is launched by launch_l1_mxfp4_fold");
  switch (block_m) {
    MEGAMOE_FP4_LAUNCH(16)
    MEGAMOE_FP4_LAUNCH(32)
    MEGAMOE_FP4_LAUNCH(64)
    case 128:  // the 128 x 128 tile: MXFP4 weights on the FP8-wgmma path with folded FP8 tokens only (Roles)
      if constexpr (kFP8Mma && !kNV)
        if (a.recipe == ActRecipe::kFP8UE8M0Block32 && p.folded_tokens && !p.fold_output && p.split_round == 0 &&
            a.tail_rows == 0)
          return launch_config<128, kIsL1, false, ActRecipe::kFP8UE8M0Block32, true>(a, p, num_sms, stream);
      throw std::runtime_error("megamoe: FP4 block_m 128 needs MXFP4 weights on the FP8-wgmma path with folded FP8 "
                               "tokens, no fold in L1's epilogue, no split K and no tail rows (heuristics::"
                               "fp4_block128_recipe)");
  }
#undef MEGAMOE_FP4_LAUNCH
#undef MEGAMOE_FP4_LAUNCH_SPLIT
  throw std::runtime_error("megamoe: FP4 grouped GEMM has no instantiation for block_m = " + std::to_string(block_m) +
                           " with activation recipe " + std::to_string(int(a.recipe)));
}

}  // namespace megamoe::kernels::fp4
