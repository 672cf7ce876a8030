// FP4 GEMV path: one token on one rank, MXFP4 weights with FP8 or MXFP4 tokens (UE8M0 scales per 32: w4a8,
// DeepSeek-V4's checkpoint format, and w4a4), NVFP4 weights with FP8 or NVFP4 tokens (kNV: UE4M3 per 16 and the expert's
// global scale, as the walk's BF16 path splits them: weights x 2^-kSplit, tokens x 2^kSplit). heuristics::fp4_gemv
// chooses it; layouts and semantics: docs/plans/fp4-gemv.md (w4a4: the token's E2M1 nibbles convert to the same bf16
// fragments, and L1 writes E2M1 + UE8M0 as the walk's epilogue does, ceil_pow2(amax / 6) and e2m1_code; NVFP4 tokens:
// L1 writes float32 and each 32 outputs' amax, and every L2 CTA quantizes the rows of its items' slots as the walk's
// requantization does, quantize_tokens_nvfp4).
//
// Why: at T=1 the tile walk runs 256-row tiles (V4-Flash: 96 per GEMM on 132 SMs, 36 of them idle) and its wgmmas use
// one of their 8-16 token columns; the walk is bound by tile granularity and per-SM issue (docs/perf-notes.md, thirty-
// ninth session). Here an item is 64 weight rows of one slot's expert over the whole K (L1: 32 gate rows and their 32
// up rows, one UE8M0 block of outputs; L2: 64 output rows), four m16 tiles of 16 contiguous rows. One persistent CTA
// per SM takes items in turn (item = blockIdx.x + i x gridDim.x; NVFP4 tokens' L2: a run of consecutive items): a
// producer warp streams each tile's rows, scale bytes and row exponents into a ring of shared-memory stages with
// cp.async.bulk (contiguous bytes: one copy of the rows), 16 consumer warps split every tile's K by 128-K groups, and
// an epilogue warp finishes each item from their sums.
// NOTES (H100, 2026-11-27, forty-second session; docs/perf-notes.md): v1 had each lane load its 16-byte pieces straight
// from global memory, CTAs of one item (2.9 waves on 132 SMs, 4 groups a warp): latency-bound at ~1.2 TB/s (V4-Flash
// T=1: L1 41 µs, L2 32 µs; the call 1.15x the tile walk's time). This ring form: V4-Flash T=1 0.89-0.93x the walk's
// time, V4-Pro 0.98-1.01x; L1 ~30 µs for 52 MB (ncu: 1.8 TB/s, 0.5 issued warps a scheduler, the ALU pipe 40 %
// busy, 14 % of warp samples waiting on a full stage). The consumers' decode (~200 instructions a 128-K group and
// lane: 2 a weight) bounds it; 8 consumer warps, or two accumulator chains, or the group loop unrolled twice were
// no faster (the last 1.17x slower). Trimming the group loop 196 -> 179 instructions (zero-area token reads, shifted
// scale offsets) took the call 0.97x (V4-Flash) / 0.99x (V4-Pro) again: 0.86x / 0.96x the walk's time.
// Each lane decodes its 32-K block of two rows as the BF16 tile path does (decode_rows_bf16), but relative to each
// row's largest scale byte (transform_weights' row exponents, as the FP8-wgmma path: e2m1 x 2^(s - e), exact in bf16
// for every scale byte) into mma.sync m16n8k16 A fragments, and multiplies the token's B fragments (column 0; lanes
// 4-31 hold the zero columns; the token is converted to bf16 fragments in shared memory once a CTA): exact products,
// float32 sums on the tensor cores, then 2^(e - 127) per row: exact for every scale byte up to e - s = 125 binades
// below the row's largest (the FP8-wgmma walk: up to 14, rounded past that). Not the default walk's FP8 wgmmas on
// folded values: other roundings (within the tolerance of the reference, not bitwise), hence one rank only (EP's ranks
// must round alike whatever their token counts).
// MXFP4 layers whose K is whole 512-K chunks run on FP8 wgmmas instead (heuristics::fp4_gemv_fp8_mma; produce_chunks,
// consume_chunks): a ring of chunk stages (an item's 64 rows over 512 K), weights folded to E4M3 in registers, the token
// folded per 128-K group, the FP8-wgmma walk's roundings. NVFP4 layers likewise (heuristics::fp4_gemv_nv_fp8_mma;
// consume_chunks_nv): weights unscaled in E4M3, each accumulator column one 16-K block's sum (build_token_nv's B),
// scaled by its UE4M3 byte in float32.
// L1 epilogue as the tile walk's (swiglu_value on the bf16-rounded gate and up; UE8M0 scale per 32 outputs,
// ceil_pow2(amax / 448); E4M3 by the exact reciprocal), not folded: L2 reads E4M3 bytes [slot][I] (w4a4: E2M1
// [slot][I / 2]) and scale bytes [slot][I / 32] in the pool's regions (nothing else reads them in this call).
// L2 stores bf16 rows into the combine area; launch_combine sums the slots. Bad ids go to the error word and valid
// slots to recv_stats, as routing does.
#include "heuristics/sm90.hpp"
#include "kernels/sm90_fp4_grouped_gemm.cuh"

namespace megamoe::kernels {

namespace {

using fp4::decode_rows_bf16;
using fp4::act_factor_ue4m3_f32;
using fp4::act_factor_ue8m0_f32;
using fp4::e2m1x2_raw;
using fp4::fp8_pair_bf16;
using fp4::kBF16x2Pow2_126;
using fp4::weight_factors_nv;
using heuristics::kFp4GemvTileRows;

constexpr int kGemvWarps = 16;  // consumer warps (8: 3-4 % slower at V4-Flash T=1, the same at V4-Pro)
constexpr int kProducerWarp = kGemvWarps, kEpilogueWarp = kGemvWarps + 1;  // then one producer and one epilogue warp
constexpr int kGemvThreads = 32 * (kGemvWarps + 2);
constexpr int kGemvRows = 4 * kFp4GemvTileRows;  // weight rows per item: four m16 tiles
constexpr int kL1Outputs = 32;  // L1 outputs per item: one UE8M0 block (32 gate rows and their 32 up rows)
constexpr int kConsumerBarrier = 1;  // named barrier of the consumer warps (0 is __syncthreads)
static_assert(heuristics::kFp4GemvPartBytes == 2 * kGemvWarps * kGemvRows * 4, "partial sums: two items");
// The consumers that read each ring stage and write partial sums of an item: every warp (the BF16 / NVFP4 forms' tile
// ring: each warp takes a K range) or the 4 warpgroups (the wgmma form's chunk ring: each takes whole chunks).
template <bool kFP8Mma>
constexpr int kGemvParts = kFP8Mma ? 4 : kGemvWarps;
static_assert(heuristics::kFp4GemvTablesOffset >=
                  2 * heuristics::kFp4GemvMaxStages * 8 + 12 * heuristics::kFp4GemvMaxSlots + 16 + 64 + 4 * 8 &&
                  heuristics::kFp4GemvHeaderBytes >= heuristics::kFp4GemvTablesOffset + 8 * kNumFoldTables,
              "full and empty barriers, slot ids, the slots' token global scales, the quantized slots and their count, "
              "zeros, the partial sums' barriers, then the fold tables");

__device__ __forceinline__ void mma_m16n8k16_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Weight scale byte s of a row whose largest is e -> the bf16 pair factor 2^(s - e + 126), which turns e2m1x2_raw's
// e2m1 x 2^-126 into e2m1 x 2^(s - e) (exact: at most 6, and normal for s - e >= -125). The row's 2^(e - 127)
// multiplies its sums after the K (consume_tile's caller), so every scale byte is exact, as on the FP8-wgmma path;
// s > e, which transform_weights never writes, reads as s = e - 252.
__device__ __forceinline__ uint32_t relative_factor(uint32_t s, uint32_t e) {
  const uint32_t h = (253u - min(e - s, 252u)) << 7;
  return h | (h << 16);
}

// One layer's view for the kernels: weights of `n` rows of `k` per expert, `items` items per slot.
struct GemvPass {
  Fp4GemvLayer w;
  int n, k, items, slots;  // slots: top_k (items of slot j are j x items ..)
  int scale_block;         // K a weight scale byte: 32 (MXFP4: UE8M0, w.row_exp) or 16 (NVFP4: UE4M3, w.global_sf)
  int stages;              // ring stages (heuristics::fp4_gemv_stages)
  bool runs;               // each CTA takes a run of consecutive items, not every gridDim.x-th (heuristics::fp4_gemv_runs)
};

// The CTA's items: [first, end) by step. Items are slot-major (slot j's are j x items ..), so a run touches one or two
// slots where the turns touch ~items x slots / gridDim.x (V4-Pro L2: ~7 of 8); NVFP4 tokens quantize each touched
// slot's row in every CTA (quantize_tokens_nvfp4). Producer, consumers and epilogue warp walk the same items.
struct ItemWalk {
  int first, end, step;
};
__device__ __forceinline__ ItemWalk cta_items(const GemvPass& p) {
  const int total = p.items * p.slots, grid = static_cast<int>(gridDim.x), cta = static_cast<int>(blockIdx.x);
  if (p.runs) return {cta * total / grid, (cta + 1) * total / grid, 1};
  return {cta, total, grid};
}

// f(slot, id, index of the item in its slot) for each item of the CTA's walk whose slot holds a valid expert id: the
// producer, the consumers and the epilogue warp take the same items in the same order (their rings and parities pair).
template <typename F>
__device__ __forceinline__ void for_each_item(const GemvPass& p, const int* ids, int num_experts, F f) {
  const ItemWalk walk = cta_items(p);
  for (int item = walk.first; item < walk.end; item += walk.step) {
    const int slot = item / p.items, id = ids[slot];
    if (id >= 0 && id < num_experts) f(slot, id, item % p.items);
  }
}

// Shared memory: the ring's full / empty barriers, the consumer warps' partial sums (two buffers by item parity, handed
// to the epilogue warp through part_full / part_free), the token's bf16 B fragments (16 words per 32-K block: fp8_pair_bf16 in
// decode_rows_bf16's K order; the wgmma form: folded E4M3 bytes, 32 a block, then a float factor a 128-K group:
// fold_token), then the ring's stages (a tile: rows, scale bytes, row exponents).
struct GemvSmem {
  uint64_t* full;
  uint64_t* empty;
  int* ids;  // the token's slots' expert ids (read once: a global load an item stalled every warp ~10 % of L1's time)
  float* token_g;  // NVFP4 tokens: each slot's token global scale (L1: the token's; L2: its L1 output row's)
  int* quant;      // NVFP4 tokens, L2: the slots this CTA quantizes (quantize_tokens_nvfp4), then their count
  uint32_t* zeros;  // 64 zero bytes: the token fragments of lanes 4-31
  uint64_t* part_full;  // [2] part[b] holds an item's sums (each consumer lane that wrote arrives; the epilogue warp waits)
  uint64_t* part_free;  // [2] the epilogue warp has read part[b] (its 32 lanes arrive; the consumers wait, two items on)
  uint2* tables;        // the E2M1 -> E4M3 fold tables (make_fold_table; the wgmma form)
  float (*part)[kGemvWarps][kGemvRows];
  uint32_t* token;
  uint8_t* ring;
};

__device__ __forceinline__ GemvSmem carve(uint8_t* smem, int token_bytes) {
  GemvSmem s;
  s.full = reinterpret_cast<uint64_t*>(smem);
  s.empty = s.full + heuristics::kFp4GemvMaxStages;
  s.ids = reinterpret_cast<int*>(s.empty + heuristics::kFp4GemvMaxStages);
  s.token_g = reinterpret_cast<float*>(s.ids + heuristics::kFp4GemvMaxSlots);
  s.quant = reinterpret_cast<int*>(s.token_g + heuristics::kFp4GemvMaxSlots);
  s.zeros = reinterpret_cast<uint32_t*>(s.quant + heuristics::kFp4GemvMaxSlots + 4);
  s.part_full = reinterpret_cast<uint64_t*>(s.zeros + 16);
  s.part_free = s.part_full + 2;
  s.tables = reinterpret_cast<uint2*>(smem + heuristics::kFp4GemvTablesOffset);
  s.part = reinterpret_cast<float (*)[kGemvWarps][kGemvRows]>(smem + heuristics::kFp4GemvHeaderBytes);
  s.token = reinterpret_cast<uint32_t*>(smem + heuristics::kFp4GemvHeaderBytes + 2 * kGemvWarps * kGemvRows * 4);
  s.ring = reinterpret_cast<uint8_t*>(s.token) + token_bytes;
  return s;
}

// E2M1 nibbles p and p + 4 of word w (K 8t + p and 8t + p + 4 of the block, as fp8_pair_bf16 pairs E4M3 bytes) times
// f -> a bf16 pair: e2m1x2_raw's e2m1 x 2^-126, times 2^126 (exact), then f in float32 (a power of two: exact in the
// bf16 range, whatever the scale byte; 255 gives NaN).
template <int p>
__device__ __forceinline__ uint32_t e2m1_pair_bf16(uint32_t w, float f) {
  const uint32_t e = ptx::mul_bf16x2(e2m1x2_raw<p>(w), kBF16x2Pow2_126);
  const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&e));
  const __nv_bfloat162 b = __floats2bfloat162_rn(v.x * f, v.y * f);
  return *reinterpret_cast<const uint32_t*>(&b);
}

// Word t of a 32-K block of E2M1 tokens (K 8t .. 8t + 7, low nibble first) times f -> B-fragment words 4t .. 4t + 3 of
// the block.
__device__ __forceinline__ uint4 e2m1_word_fragments(uint32_t w, float f) {
  return make_uint4(e2m1_pair_bf16<0>(w, f), e2m1_pair_bf16<1>(w, f), e2m1_pair_bf16<2>(w, f), e2m1_pair_bf16<3>(w, f));
}

// A 32-K block of E2M1 tokens (words w) -> its 16 B-fragment words at d, K 0-15 times f_lo and K 16-31 times f_hi
// (MXFP4: one UE8M0 factor; NVFP4: the two UE4M3 factors x 2^kSplit).
__device__ __forceinline__ void e2m1_block_fragments(uint32_t* d, const uint32_t (&w)[4], float f_lo, float f_hi) {
  uint4* d4 = reinterpret_cast<uint4*>(d);
#pragma unroll
  for (int t = 0; t < 4; ++t) d4[t] = e2m1_word_fragments(w[t], t < 2 ? f_lo : f_hi);
}

// Token blocks [0, blocks) (E4M3 bytes `x` [32 blk ..], or with kFP4Act E2M1 `x` [16 blk ..]; UE8M0 `x_sf` [blk], or
// with NVFP4 tokens UE4M3 [2 blk, 2 blk + 1]) -> their B fragments in shared memory, by the consumer warps. Exact in
// bf16 for every scale the quantizers write (>= 1e-4 / 448: normal), up to 2^119; NVFP4: e2m1 x ue4m3 x 2^kSplit, at
// most 6 significant bits between 2^22 and 2^44. NVFP4 weights take tokens x 2^kSplit (the walk's BF16 path's split:
// weights x 2^-kSplit).
template <bool kFP4Act, bool kNV>
__device__ __forceinline__ void convert_token(uint32_t* dst, const uint8_t* x, const uint8_t* x_sf, int blocks) {
  for (int blk = threadIdx.x; blk < blocks; blk += 32 * kGemvWarps) {
    if constexpr (kFP4Act) {
      const uint4 raw = __ldcg(reinterpret_cast<const uint4*>(x + int64_t(blk) * 16));
      const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
      if constexpr (kNV) {
        const uint16_t sf2 = __ldcg(reinterpret_cast<const unsigned short*>(x_sf) + blk);
        e2m1_block_fragments(dst + blk * 16, w, act_factor_ue4m3_f32(sf2 & 0xFF), act_factor_ue4m3_f32(sf2 >> 8));
      } else {
        const float f = ue8m0_float(__ldcg(x_sf + blk));
        e2m1_block_fragments(dst + blk * 16, w, f, f);
      }
    } else {
      const float f = kNV ? act_factor_ue8m0_f32(__ldcg(x_sf + blk)) : ue8m0_float(__ldcg(x_sf + blk));
      const uint4 lo = __ldcg(reinterpret_cast<const uint4*>(x + int64_t(blk) * 32));
      const uint4 hi = __ldcg(reinterpret_cast<const uint4*>(x + int64_t(blk) * 32 + 16));
      const uint32_t w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
      uint32_t v[16];
#pragma unroll
      for (int t = 0; t < 4; ++t)
#pragma unroll
        for (int p = 0; p < 4; ++p) v[4 * t + p] = fp8_pair_bf16(w, t, p, f);
      uint4* d = reinterpret_cast<uint4*>(dst + blk * 16);
#pragma unroll
      for (int i = 0; i < 4; ++i) d[i] = make_uint4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
    }
  }
}

// The wgmma form's token: blocks [0, blocks) (E4M3 bytes `x` [32 blk ..], or with kFP4Act E2M1 `x` [16 blk ..]; UE8M0
// `x_sf` [blk]) folded per 128-K group as the FP8-wgmma walk folds them (fold_quarter_word, fold_e2m1_quarter: block j
// x 2^-(T - t_j), T the group's largest scale) into E4M3 bytes at dst, and 2^(T - 127) into factors[group], by the
// consumer warps: a lane a block, the four lanes q of a group side by side (blocks % 4 == 0). The bytes are in the
// wgmma K order, 32 a k32 step: step st of group g at 32 (4g + st), its byte 4q + i = K 32q + 8st + i of the group and
// byte 16 + 4q + i = K 32q + 8st + 4 + i, as the weights' decode (decode_weights_e4m3's fold) orders lane q's block.
template <bool kFP4Act>
__device__ __forceinline__ void fold_token(uint32_t* dst, float* factors, const uint2* tables, const uint8_t* x,
                                           const uint8_t* x_sf, int blocks) {
  const int lane = threadIdx.x % 32;
  for (int base = threadIdx.x - lane; base < blocks; base += 32 * kGemvWarps) {  // warp-uniform trips (shuffles)
    const int blk = base + lane;
    const bool active = blk < blocks;
    const uint32_t t = active ? __ldcg(x_sf + blk) : 0u;
    uint32_t tmax = max(t, __shfl_xor_sync(0xffffffffu, t, 1));
    tmax = max(tmax, __shfl_xor_sync(0xffffffffu, tmax, 2));
    if (!active) continue;
    const int d = static_cast<int>(tmax - t);
    uint32_t w[8];
    if constexpr (kFP4Act) {
      const uint4 raw = __ldcg(reinterpret_cast<const uint4*>(x + int64_t(blk) * 16));
      fold_e2m1_quarter(raw, tables, d, [&](int st, uint32_t lo, uint32_t hi) { w[2 * st] = lo, w[2 * st + 1] = hi; });
    } else {
      const uint4 lo = __ldcg(reinterpret_cast<const uint4*>(x + int64_t(blk) * 32));
      const uint4 hi = __ldcg(reinterpret_cast<const uint4*>(x + int64_t(blk) * 32 + 16));
      const uint32_t v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
      for (int i = 0; i < 8; ++i) w[i] = fold_quarter_word(v[i], d);
    }
    const int q = blk % 4;
    uint32_t* group = dst + (blk / 4) * 32;  // 128 bytes a group
#pragma unroll
    for (int st = 0; st < 4; ++st) group[8 * st + q] = w[2 * st], group[8 * st + 4 + q] = w[2 * st + 1];
    if (q == 0) factors[blk / 4] = ue8m0_float(tmax);
  }
}

// The slots this CTA quantizes into s.quant (then their count), by warp 0 of the consumers: the valid slots with an
// item in this CTA's walk (cta_items). Ids only, so before the dependency wait (off L2's path from L1's end).
__device__ __forceinline__ void quant_slots(const GemvSmem& s, const GemvPass& p, int num_experts) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp == 0) {
    const ItemWalk walk = cta_items(p);
    int n = 0;
    for (int base = 0; base < p.slots; base += 32) {
      const int slot = base + lane;
      bool take = false;
      if (slot < p.slots && s.ids[slot] >= 0 && s.ids[slot] < num_experts) {
        const int first = slot * p.items;
        // the walk's first item at or past the slot's first is first + ahead
        const int ahead =
            first <= walk.first ? walk.first - first : (walk.step - (first - walk.first) % walk.step) % walk.step;
        take = first + ahead < min(first + p.items, walk.end);
      }
      const uint32_t ballot = __ballot_sync(0xffffffffu, take);
      if (take) s.quant[n + __popc(ballot & ((1u << lane) - 1))] = slot;
      n += __popc(ballot);
    }
    if (lane == 0) s.quant[heuristics::kFp4GemvMaxSlots] = n;
  }
  ptx::named_barrier_sync(kConsumerBarrier, 32 * kGemvWarps);
}

// L2's NVFP4 tokens: the L1 outputs of the slots whose items this CTA takes (float32 [slot][inter] in `scratch`, each
// 32 outputs' amax after them, [slot][inter / 32]) quantized as nvfp4_requant_kernel quantizes them on the tile walk
// (the row's amax -> g = amax / (6 x 448); per 16: sf = e4m3(amax_blk / (6 g)), codes = e2m1(x / (sf g)): the same
// codes, by e2m1x8_word_fast) straight into B fragments (codes x sf x 2^kSplit, the same words as convert_token makes
// of those bytes), and each slot's g into token_g, by the consumer warps: a few of the slots' rows from the L2 cache
// instead of a requantization launch and the pool. After the dependency wait (the slots: quant_slots, before it); each
// thread's first 8-K word is loaded before the rows' amax pass, so that the two round trips to the L2 cache overlap
// (one on L2's path from L1's end instead of two), and a lane's amaxes of a row in one batch of loads.
// NOTES (H100, 2026-11-27, forty-third session): the first form quantized every slot, a thread a 32-K block with 32
// IEEE divisions (each a branch region, not interleaved), after a pass over every output for the amax: L2 ended 24 µs
// after L1 at V4-Flash T=1 against NVFP4 w4a8's 15.5.
__device__ __forceinline__ void quantize_tokens_nvfp4(const GemvSmem& s, const GemvPass& p, const float* scratch,
                                                      int inter) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, blocks = inter / 32, per_slot = inter / 8;
  const int n = s.quant[heuristics::kFp4GemvMaxSlots], total = n * per_slot;  // 8-K words: two a 16-K block
  float v[8];
  if (int(threadIdx.x) < total)
    load_floats_cg(scratch + int64_t(s.quant[threadIdx.x / per_slot]) * inter + (threadIdx.x % per_slot) * 8, v);
  const float* item_amax = scratch + int64_t(p.slots) * inter;
  for (int j = warp; j < n; j += kGemvWarps) {  // a warp a slot: the row's amax from its items' (max_nan: NaN wins)
    const float* row = item_amax + int64_t(s.quant[j]) * blocks;
    float amax = 0.0f;
    for (int b0 = 0; b0 < blocks; b0 += 4 * 32) {
      float x[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) x[u] = b0 + 32 * u + lane < blocks ? __ldcg(row + b0 + 32 * u + lane) : 0.0f;
#pragma unroll
      for (int u = 0; u < 4; ++u) amax = max_nan(amax, x[u]);
    }
    amax = warp_reduce_max<32>(amax);
    if (lane == 0) s.token_g[s.quant[j]] = nvfp4_global_scale(amax);
  }
  ptx::named_barrier_sync(kConsumerBarrier, 32 * kGemvWarps);
  // A thread an 8-K word, lanes 2i and 2i + 1 a 16-K block (its amax by one shuffle): at V4-Flash's 1-2 slots a CTA,
  // one word a thread. The loop is warp-uniform for the shuffle (total is even: the pairs are whole).
  for (int base = 32 * warp; base < total; base += 32 * kGemvWarps) {
    const int i = base + lane;
    const bool on = i < total;
    const int slot = s.quant[(on ? i : 0) / per_slot], w8 = i % per_slot;
    if (on && base != 32 * warp) load_floats_cg(scratch + int64_t(slot) * inter + w8 * 8, v);
    float amax = on ? abs_max(v) : 0.0f;
    amax = max_nan(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    if (on) {
      const float g = s.token_g[slot];
      const __nv_fp8_e4m3 sf = nvfp4_block_scale(amax, g);
      // 8-K word w8: half w8 % 2 of 16-K block w8 / 2, which is half (w8 / 2) % 2 of 32-K block w8 / 4 (convert_token's
      // 16 fragment words a 32-K block): its 4 words at 8 ((w8 / 2) % 2) + 4 (w8 % 2)
      uint4* d = reinterpret_cast<uint4*>(s.token + (slot * blocks + w8 / 4) * 16 + 8 * (w8 / 2 % 2));
      d[w8 % 2] = e2m1_word_fragments(e2m1x8_word_fast(v, float(sf) * g), act_factor_ue4m3_f32(sf.__x));
    }
  }
}

// Producer warp: every tile of the CTA's items whose slot holds a valid id, in the consumers' order. Every lane waits
// for the stage and lane 0 expects its bytes; then one bulk copy of the tile's 16 rows (contiguous) and one of its 16 row
// exponents by lane 0, and its scale bytes (rows: one copy by lane 16; scale tiles: one 256-byte piece per 16 blocks,
// by lanes 16-31 side by side). NOTES (H100, 2026-11-27, forty-sixth session, T=1, 3 rounds, every FP4 pair): this
// form over lane 0 issuing every piece (V4-Flash NVFP4 L1: 16 a tile) 0.980-1.000x per replay, 0.980-1.005x in a graph
// (docs/bench/h100-2026-11-27m-ab-gemv-warp-producer.txt); first measured as -ab-gemv-row-pad.txt's [2], 0.947-1.009x.
// The rows 64 bytes further apart in the stage (one copy a row by lanes 0-15, so that two rows' lanes in an LDS.128
// phase take different banks) lost there: [1], 1.018-1.072x at V4-Flash (branch wip/gemv-row-pad).
template <bool kNV, typename RowsOf>
__device__ __forceinline__ void produce(const GemvSmem& s, const GemvPass& p, const int* ids, int num_experts,
                                        RowsOf rows_of) {
  const int lane = threadIdx.x % 32, kb = p.k / (kNV ? 16 : 32), row_bytes = p.k / 2;
  const uint32_t stage_bytes = heuristics::fp4_gemv_stage_bytes(p.k, kNV ? 16 : 32);
  const uint32_t tile_bytes = kFp4GemvTileRows * (row_bytes + kb + (kNV ? 0 : 1));
  int stage = 0;
  uint32_t phase = 0;
  for_each_item(p, ids, num_experts, [&](int, int id, int index) {
    int r0[4];
    rows_of(index, r0);
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      // Every lane that copies into the stage waits for it to be empty itself: racecheck does not order another lane's
      // wait before a copy through __syncwarp (it reported the scale copies of lanes 16-31 once the ring wrapped).
      ptx::mbarrier_wait(&s.empty[stage], phase ^ 1);
      if (lane == 0) ptx::mbarrier_arrive_expect_tx(&s.full[stage], tile_bytes);
      __syncwarp();  // the bytes are expected before any copy completes
      uint8_t* dst = s.ring + stage * stage_bytes;
      const int64_t row = int64_t(id) * p.n + r0[m];
      if (lane == 0) ptx::bulk_load(dst, p.w.weights + row * row_bytes, kFp4GemvTileRows * row_bytes, &s.full[stage]);
      uint8_t* dst_sf = dst + kFp4GemvTileRows * row_bytes;
      if (p.w.scale_tiles) {
        // Scale tiles [n / 256][kb / 16][256][16] an expert: rows r0 .. r0 + 15 of 16 blocks are 256 contiguous bytes.
        const uint8_t* src = p.w.weights_sf + int64_t(id) * p.n * kb +
                             int64_t(r0[m] / kScaleTileRows) * (kb / kScaleTileBytes) * (kScaleTileRows * kScaleTileBytes) +
                             (r0[m] % kScaleTileRows) * kScaleTileBytes;
        for (int j = lane - 16; j >= 0 && j < kb / kScaleTileBytes; j += 16)
          ptx::bulk_load(dst_sf + j * kFp4GemvTileRows * kScaleTileBytes,
                         src + int64_t(j) * kScaleTileRows * kScaleTileBytes, kFp4GemvTileRows * kScaleTileBytes,
                         &s.full[stage]);
      } else if (lane == 16) {
        ptx::bulk_load(dst_sf, p.w.weights_sf + row * kb, kFp4GemvTileRows * kb, &s.full[stage]);
      }
      if (!kNV && lane == 0)
        ptx::bulk_load(dst_sf + kFp4GemvTileRows * kb, p.w.row_exp + row, kFp4GemvTileRows, &s.full[stage]);
      if (++stage == p.stages) stage = 0, phase ^= 1;
    }
  });
}

// One tile (16 rows) times the token over this warp's 128-K groups [g_begin, g_end), into acc (m16n8 accumulators:
// column 0 in lanes 4i, registers 0 (row i) and 2 (row i + 8)), relative to the rows' largest scales ea / eb (read
// here from the stage). Rows are k / 2 bytes apart: lanes of two rows share banks (two-way: ~500 cycles of a tile's
// ~2,900 of streaming at V4-Flash L1, not the bound).
template <bool kNV>
__device__ __forceinline__ void consume_tile(float (&acc)[4], uint32_t& ea, uint32_t& eb, const uint8_t* tile,
                                             const uint32_t* token, const uint32_t* zeros, bool scale_tiles, int k,
                                             int g_begin, int g_end, int lane) {
  const int q = lane % 4, rr = lane / 4, kb = k / (kNV ? 16 : 32), row_bytes = k / 2;
  const uint8_t* sf = tile + kFp4GemvTileRows * row_bytes;
  if constexpr (!kNV) {
    ea = sf[kFp4GemvTileRows * kb + rr];
    eb = sf[kFp4GemvTileRows * kb + rr + 8];
  }
  // Lane q's block 4g + q: its scale byte of row rr at sf_row + sf_offset(g) (scale tiles: byte (g / 4) x 256 + (g % 4)
  // x 4 past the row's block q; rows: 4g), and rr + 8's one row further. The token's B fragments: lanes 0-3 read
  // theirs, 64 bytes a block; the others read 64 zero bytes (no registers to zero a group).
  // NVFP4: the block's two UE4M3 bytes (16 K each), adjacent: 2q past the row's first, then (g / 2) x 256 + (g % 2) x 8
  // (scale tiles) or 8g.
  const int sf_row = (scale_tiles ? rr * kScaleTileBytes : rr * kb) + (kNV ? 2 * q : q);
  const int sf_row8 = scale_tiles ? 8 * kScaleTileBytes : 8 * kb;
  const uint32_t* token_lane = lane < 4 ? token + q * 16 : zeros;
  const int token_step = lane < 4 ? 64 : 0;
  for (int g = g_begin; g < g_end; ++g) {
    const int blk = 4 * g + q;
    const uint4 wa = *reinterpret_cast<const uint4*>(tile + rr * row_bytes + blk * 16);
    const uint4 wb = *reinterpret_cast<const uint4*>(tile + (rr + 8) * row_bytes + blk * 16);
    const uint32_t ug = static_cast<uint32_t>(g);
    const int ia = sf_row + static_cast<int>(kNV ? (scale_tiles ? ((ug >> 1) << 8) | ((ug & 1) << 3) : 8 * ug)
                                                 : (scale_tiles ? ((ug >> 2) << 8) | ((ug & 3) << 2) : 4 * ug));
    const int ib = ia + sf_row8;
    static_assert(kScaleTileBytes == 16 && kFp4GemvTileRows * kScaleTileBytes == 256, "sf_offset's constants");
    uint32_t b[8][2];
    const uint4* t = reinterpret_cast<const uint4*>(token_lane + g * token_step);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint4 v = t[i];
      b[2 * i][0] = v.x, b[2 * i][1] = v.y, b[2 * i + 1][0] = v.z, b[2 * i + 1][1] = v.w;
    }
    uint32_t fa, fb;
    if constexpr (kNV) {  // e2m1 x ue4m3 x 2^-kSplit, as the walk's BF16 path (tokens x 2^kSplit)
      const uint32_t sa = *reinterpret_cast<const uint16_t*>(sf + ia), sb = *reinterpret_cast<const uint16_t*>(sf + ib);
      weight_factors_nv(sa, sb, fa, fb);
    } else {
      fa = relative_factor(sf[ia], ea);
      fb = relative_factor(sf[ib], eb);
    }
    const uint32_t wa4[4] = {wa.x, wa.y, wa.z, wa.w}, wb4[4] = {wb.x, wb.y, wb.z, wb.w};
    uint32_t a[8][4];
    decode_rows_bf16(a, wa4, wb4, fa, fb);
#pragma unroll
    for (int s = 0; s < 8; ++s) mma_m16n8k16_bf16(acc, a[s], b[s][0], b[s][1]);
  }
}

// Consumer warps: every item of the CTA whose slot holds a valid id, in the producer's order: its four tiles, each
// row's sums times 2^(e - 127) (its largest scale byte e; 255: NaN, as on the FP8-wgmma path) into part[parity][warp]
// for the epilogue warp (epilogue_items). The token of slot j is B fragments at token + j x token_words.
// NOTES: the first consumer warp ran each item's epilogue after a barrier of all 16, so every item waited for it (and
// for the slowest warp) before the next; the consumers now only hand the sums over (part_full / part_free), up to two
// items ahead of the epilogue warp.
template <bool kNV, bool kFP4Act, typename RowsOf>
__device__ __forceinline__ void consume(const GemvSmem& s, const GemvPass& p, const int* ids, int num_experts,
                                        int token_words, RowsOf rows_of) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int groups = p.k / 128, g_begin = warp * groups / kGemvWarps, g_end = (warp + 1) * groups / kGemvWarps;
  const uint32_t stage_bytes = heuristics::fp4_gemv_stage_bytes(p.k, kNV ? 16 : 32);
  int stage = 0, parity = 0, n = 0;  // n: the valid items so far
  uint32_t phase = 0;
  for_each_item(p, ids, num_experts, [&](int slot, int id, int) {
    const uint32_t* token = s.token + slot * token_words;
    // NVFP4: the expert's global scale times the token's (NVFP4 tokens), as the walk's column factors.
    const float global = kNV ? __ldg(p.w.global_sf + id) * (kFP4Act ? s.token_g[slot] : 1.0f) : 1.0f;
    float acc[4][4] = {};
    uint32_t ea[4], eb[4];
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      ptx::mbarrier_wait(&s.full[stage], phase);
      consume_tile<kNV>(acc[m], ea[m], eb[m], s.ring + stage * stage_bytes, token, s.zeros, p.w.scale_tiles, p.k, g_begin,
                   g_end, lane);
      // Every lane arrives on empty: racecheck does not order the other lanes' loads of the stage before one lane's
      // arrive after __syncwarp (it reported the producer's next bulk copy into the stage once the ring wrapped).
      ptx::mbarrier_arrive(&s.empty[stage]);
      if (++stage == p.stages) stage = 0, phase ^= 1;
    }
    // The epilogue warp has read item n - 2's sums from part[parity] (phase (n - 2) / 2; before: the previous phase).
    ptx::mbarrier_wait(&s.part_free[parity], ((n >> 1) & 1) ^ 1);
    if (lane % 4 == 0) {
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        s.part[parity][warp][16 * m + lane / 4] = acc[m][0] * (kNV ? global : ue8m0_float(ea[m]));
        s.part[parity][warp][16 * m + lane / 4 + 8] = acc[m][2] * (kNV ? global : ue8m0_float(eb[m]));
      }
      // Each writing lane arrives itself: racecheck does not order other lanes' stores before one lane's arrive.
      ptx::mbarrier_arrive(&s.part_full[parity]);
    }
    parity ^= 1, ++n;
  });
}

// The wgmma forms' ring (heuristics::fp4_gemv_fp8_mma / fp4_gemv_nv_fp8_mma): stage t holds chunk t % C of the t / C-th
// valid item (C = k / kFp4GemvChunkK chunks an item): its 64 rows over the chunk's 512 K ([64][256] bytes), then MXFP4
// their 16 scale bytes each ([64][16]) and their row exponents ([64]), NVFP4 their 32 ([tile][piece][16 rows][16]);
// warpgroup t % 4 consumes it (consume_chunks / consume_chunks_nv).
constexpr int kChunkRowBytes = heuristics::kFp4GemvChunkK / 2, kChunkBlocks = heuristics::kFp4GemvChunkK / 32;
constexpr int kChunkScaleOffset = kGemvRows * kChunkRowBytes, kChunkExpOffset = kChunkScaleOffset + kGemvRows * kChunkBlocks;
static_assert(kChunkExpOffset + kGemvRows <= heuristics::kFp4GemvChunkStageBytes && kChunkBlocks == kScaleTileBytes,
              "a chunk's scale bytes are one 16-block piece of a scale tile");

// Producer warp of the wgmma form: every lane waits for the stage (racecheck), lane 0 expects its bytes. The item's
// tiles go by runs of kRun that are contiguous weight rows (heuristics::fp4_gemv_run_tiles; NVFP4: a tile a run):
// lanes 8 .. 8 + 4 / kRun - 1 load each run's rows over the chunk (one box of the tensor map p.w.tmap_chunks: [16 kRun
// rows][256 bytes]), lanes 0 .. each run's scale piece (MXFP4 scale tiles: 16 kRun rows of 16 contiguous bytes; NVFP4
// two pieces a tile; row-major: pieces of 16 bytes a row over all 32 lanes) and lanes 4 .. each run's row exponents.
// NOTES (H100, 2026-11-27, forty-eighth session): the rows as 64 bulk copies of 256 bytes a stage (~70 copies a stage,
// ~840 a CTA at V4-Flash L2 against ~40 for the tile ring) took the call 1.45-2.7x main's time.
template <bool kNV, int kRun, typename RowsOf>
__device__ __forceinline__ void produce_chunks(const GemvSmem& s, const GemvPass& p, const int* ids, int num_experts,
                                               RowsOf rows_of) {
  static_assert(kRun == 1 || kRun == 2 || kRun == 4, "runs of whole tiles");
  static_assert(!kNV || kRun == 1, "NVFP4 stages keep their scales [tile][piece] (consume_chunks_nv)");
  constexpr int kRuns = 4 / kRun, kRunRows = kRun * kFp4GemvTileRows;
  const int lane = threadIdx.x % 32, kb = p.k / (kNV ? 16 : 32), chunks = p.k / heuristics::kFp4GemvChunkK;
  constexpr uint32_t kBytes = kNV ? kGemvRows * (kChunkRowBytes + 2 * kChunkBlocks)
                                  : kGemvRows * (kChunkRowBytes + kChunkBlocks + 1);
  constexpr int kStageBytes = heuristics::fp4_gemv_chunk_stage_bytes(kNV);
  static_assert(kBytes <= kStageBytes, "a chunk stage's bytes");
  int stage = 0;
  uint32_t phase = 0;
  for_each_item(p, ids, num_experts, [&](int, int id, int index) {
    int r0[4];
    rows_of(index, r0);
    for (int c = 0; c < chunks; ++c) {
      ptx::mbarrier_wait(&s.empty[stage], phase ^ 1);
      if (lane == 0) ptx::mbarrier_arrive_expect_tx(&s.full[stage], kBytes);
      __syncwarp();  // the bytes are expected before any copy completes
      uint8_t* dst = s.ring + stage * kStageBytes;
      if (lane >= 8 && lane < 8 + kRuns) {
        const int m = (lane - 8) * kRun, r = m == 0 ? r0[0] : m == 1 ? r0[1] : m == 2 ? r0[2] : r0[3];
        ptx::tma_load_2d(dst + m * kFp4GemvTileRows * kChunkRowBytes, &p.w.tmap_chunks, &s.full[stage],
                         c * kChunkRowBytes, id * p.n + r);
      }
      if constexpr (kNV) {
        // NVFP4: a row's 32 UE4M3 bytes of the chunk as two 16-byte pieces, in the scale tiles' shape whatever the
        // layout: [tile m][piece j][16 rows][16 bytes] (consume_chunks_nv).
        if (!p.w.scale_tiles) {
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int j = 0; j < 2; ++j) {
              const int r = lane + 32 * h, m = r / kFp4GemvTileRows;  // row r of the item: tile 2h or 2h + 1
              const int64_t row = int64_t(id) * p.n + (lane < 16 ? r0[2 * h] : r0[2 * h + 1]) + r % 16;
              ptx::bulk_load(dst + kChunkScaleOffset + m * 512 + j * 256 + (r % 16) * 16,
                             p.w.weights_sf + row * kb + c * 2 * kChunkBlocks + 16 * j, 16, &s.full[stage]);
            }
        } else if (lane < 8) {  // [n / 256][kb / 16][256][16]: piece 2c + j holds the chunk's blocks 16j .. 16j + 15
          const int m = lane / 2, j = lane % 2, r = m == 0 ? r0[0] : m == 1 ? r0[1] : m == 2 ? r0[2] : r0[3];
          ptx::bulk_load(dst + kChunkScaleOffset + m * 512 + j * 256,
                         p.w.weights_sf + int64_t(id) * p.n * kb +
                             int64_t(r / kScaleTileRows) * (kb / kScaleTileBytes) * (kScaleTileRows * kScaleTileBytes) +
                             int64_t(2 * c + j) * kScaleTileRows * kScaleTileBytes + (r % kScaleTileRows) * kScaleTileBytes,
                         kFp4GemvTileRows * kScaleTileBytes, &s.full[stage]);
        }
      } else {
        if (!p.w.scale_tiles) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int r = lane + 32 * h;  // row r of the item: tile r / 16 (2h or 2h + 1), its row r % 16
            const int64_t row = int64_t(id) * p.n + (lane < 16 ? r0[2 * h] : r0[2 * h + 1]) + r % 16;
            ptx::bulk_load(dst + kChunkScaleOffset + r * kChunkBlocks, p.w.weights_sf + row * kb + c * kChunkBlocks,
                           kChunkBlocks, &s.full[stage]);
          }
        }
        if (p.w.scale_tiles && lane < kRuns) {  // [n / 256][kb / 16][256][16]: a run's rows of blocks 16c .. 16c + 15
          const int m = lane * kRun, r = m == 0 ? r0[0] : m == 1 ? r0[1] : m == 2 ? r0[2] : r0[3];
          ptx::bulk_load(dst + kChunkScaleOffset + m * kFp4GemvTileRows * kChunkBlocks,
                         p.w.weights_sf + int64_t(id) * p.n * kb +
                             int64_t(r / kScaleTileRows) * (kb / kScaleTileBytes) * (kScaleTileRows * kScaleTileBytes) +
                             int64_t(c) * kScaleTileRows * kScaleTileBytes + (r % kScaleTileRows) * kScaleTileBytes,
                         kRunRows * kChunkBlocks, &s.full[stage]);
        }
        if (lane >= 4 && lane < 4 + kRuns) {
          const int m = (lane - 4) * kRun, r = m == 0 ? r0[0] : m == 1 ? r0[1] : m == 2 ? r0[2] : r0[3];
          ptx::bulk_load(dst + kChunkExpOffset + m * kFp4GemvTileRows, p.w.row_exp + int64_t(id) * p.n + r,
                         kRunRows, &s.full[stage]);
        }
      }
      if (++stage == p.stages) stage = 0, phase ^= 1;
    }
  });
}

// The producer warp of either ring: the wgmma form's chunk stages or the BF16 / NVFP4 forms' tile stages.
template <bool kNV, bool kFP8Mma, int kRun, typename RowsOf>
__device__ __forceinline__ void produce_form(const GemvSmem& s, const GemvPass& p, const int* ids, int num_experts,
                                             RowsOf rows_of) {
  if constexpr (kFP8Mma)
    produce_chunks<kNV, kRun>(s, p, ids, num_experts, rows_of);
  else
    produce<kNV>(s, p, ids, num_experts, rows_of);
}

// The group's four m64n8k32 FP8 wgmmas (register A a8[st], B at desc(st)) into kAcc accumulators (1: all four steps
// into d[0]; 2: steps 0-1 into d[0], 2-3 into d[1]), committed and waited for: ptxas keeps register-A wgmmas
// unserialised only with every operand fenced around them.
template <int kAcc, typename Desc>
__device__ __forceinline__ void group_wgmmas(float (&d)[kAcc][4], uint32_t (&a8)[4][4], Desc desc) {
  static_assert(kAcc == 1 || kAcc == 2, "one or two accumulators");
  constexpr int kSteps = 4 / kAcc;  // steps an accumulator
#pragma unroll
  for (int st = 0; st < 4; ++st)
#pragma unroll
    for (int r = 0; r < 4; ++r) ptx::fence_operand(a8[st][r]);
#pragma unroll
  for (int h = 0; h < kAcc; ++h)
#pragma unroll
    for (int r = 0; r < 4; ++r) ptx::fence_operand(d[h][r]);
  ptx::wgmma_fence();
#pragma unroll
  for (int st = 0; st < 4; ++st) ptx::WgmmaFP8RS<8>::run(d[st / kSteps], a8[st], desc(st), st % kSteps != 0);
  ptx::wgmma_commit();
  ptx::wgmma_wait<0>();
#pragma unroll
  for (int h = 0; h < kAcc; ++h)
#pragma unroll
    for (int r = 0; r < 4; ++r) ptx::fence_operand(d[h][r]);
}

// The wgmma form's consumers: warpgroup w / 4 takes the stages t = w / 4 (mod 4) (chunk t % C of an item), warp w its
// rows 16 (w % 4) .. + 15 of the item's 64 (its rows of an m64 wgmma). Each lane decodes its 32-K block of rows rr and
// rr + 8 (lane q: block q of each 128-K group) to E4M3 relative to each row's largest scale (e2m1 x 2^(s - e +
// kFoldHeadroom), the fold tables, as the FP8-wgmma walk's decode_weights_e4m3) straight into the A fragments of the
// group's four k32 steps; B is the folded token in shared memory (fold_token: a K-major operand without swizzle whose
// row 0 is the token's 32 bytes of the step and whose core matrices lie 16 bytes apart, so rows 1-7, the columns 1-7
// of the product, read the bytes that follow: ignored). The group's sum times its token factor adds to the row's
// float32 sum; after the item, 2^(e - 127 - kFoldHeadroom) per row into part[parity][w / 4] for the epilogue warp (4
// partial sums a row; a warpgroup with no chunk of the item writes zeros).
// Why: the BF16 form decodes ~2.2 instructions a weight (mma.sync has no native E4M3 on sm_90: ptxas unpacks to F16);
// the PRMT fold to E4M3 is 1.25, and wgmma takes E4M3 from registers. NOTES (H100, 2026-11-27, forty-eighth session):
// the first form took a tile of 16 rows over the whole K a stage, so an item's four tiles had to sit in the ring
// together before a warpgroup could start (a cold L1 waited for four tiles; two stages streamed the next item while
// one was consumed): L2 alone 0.95-0.97x the BF16 form's time, L1 1.00-1.06x. On chunk stages (TMA boxes), both
// layers: 0.94x (V4-Flash) / 0.96x (V4-Pro) that first form's L2 alone (heuristics::fp4_gemv_fp8_mma).
__device__ __forceinline__ void consume_chunks(const GemvSmem& s, const GemvPass& p, const int* ids, int num_experts,
                                               int token_bytes, const float* token_f) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wg = warp / 4, m = warp % 4;
  const int q = lane % 4, rr = lane / 4, chunks = p.k / heuristics::kFp4GemvChunkK;
  const int ra = kFp4GemvTileRows * m + rr, rb = ra + 8;  // this lane's rows of the item
  const uint8_t* token8 = reinterpret_cast<const uint8_t*>(s.token);
  int t0 = 0, parity = 0, n = 0;  // t0: the item's first stage in ring order
  for_each_item(p, ids, num_experts, [&](int slot, int, int) {
    // B of group g, step st: the token's 32 bytes at 32 (4g + st) (lo + 8g + 2st); core matrices 16 bytes apart
    const uint32_t desc_lo = ptx::smem_desc_noswizzle_lo(token8 + slot * token_bytes, 16);
    const float* factors = token_f + slot * (token_bytes / 128);
    float acc0 = 0.0f, acc2 = 0.0f;  // column 0 of rows ra and rb (lanes q = 0)
    uint32_t ea = 0, eb = 0;
    for (int c = (wg - t0 % 4 + 4) % 4; c < chunks; c += 4) {
      const int t = t0 + c, stage = t % p.stages;
      const uint8_t* st8 = s.ring + stage * heuristics::kFp4GemvChunkStageBytes;  // chunk c of the item
      ptx::mbarrier_wait(&s.full[stage], (t / p.stages) & 1);
      ea = st8[kChunkExpOffset + ra], eb = st8[kChunkExpOffset + rb];
#pragma unroll 1
      for (int lg = 0; lg < kChunkBlocks / 4; ++lg) {  // the chunk's 128-K groups
        const int g = c * (kChunkBlocks / 4) + lg, blk = 4 * lg + q;
        const uint4 wra = *reinterpret_cast<const uint4*>(st8 + ra * kChunkRowBytes + blk * 16);
        const uint4 wrb = *reinterpret_cast<const uint4*>(st8 + rb * kChunkRowBytes + blk * 16);
        // A scale above its row's largest (never written by transform_weights) reads the all-zero last table.
        const uint2 ta = s.tables[min(ea - st8[kChunkScaleOffset + ra * kChunkBlocks + blk], uint32_t(kNumFoldTables - 1))];
        const uint2 tb = s.tables[min(eb - st8[kChunkScaleOffset + rb * kChunkBlocks + blk], uint32_t(kNumFoldTables - 1))];
        uint32_t a8[4][4];
        group_a_fragments(wra, wrb, ta, tb, a8);
        float sum[1][4] = {};
        group_wgmmas(sum, a8, [&](int st) { return ptx::smem_desc_noswizzle(desc_lo + 8 * g + 2 * st, 128); });
        const float f = factors[g];
        acc0 = fmaf(sum[0][0], f, acc0);
        acc2 = fmaf(sum[0][2], f, acc2);
      }
      ptx::mbarrier_arrive(&s.empty[stage]);  // every lane of the warpgroup (racecheck)
    }
    t0 += chunks;
    ptx::mbarrier_wait(&s.part_free[parity], ((n >> 1) & 1) ^ 1);
    if (q == 0) {
      static_assert(kFoldHeadroom == 6, "the rows' 2^-6");
      s.part[parity][wg][ra] = acc0 * (ue8m0_float(ea) * 0x1p-6f);  // a warpgroup without a chunk: 0 x 2^-133
      s.part[parity][wg][rb] = acc2 * (ue8m0_float(eb) * 0x1p-6f);
      ptx::mbarrier_arrive(&s.part_full[parity]);
    }
    parity ^= 1, ++n;
  });
}

// NVFP4 on the wgmma form (heuristics::fp4_gemv_nv_fp8_mma). The token as B operands of m64n8k32 wgmmas whose column c
// holds only token lane c's 8 K of the step (lane c of a quad: K 32c + 8st .. + 7 of the 128-K group, the bytes the
// weights' lane c decodes for step st), the rest zero: so accumulator column c is row r's sum over that lane's K
// alone, and one 16-K block's whatever the step (steps 0-1: blocks 2c, steps 2-3: 2c + 1 of the group, two
// accumulators). Step st of 128-K group g at 128 (4g + st): core matrix 0 (K 0-15) rows 0-3 then core matrix 1 (K
// 16-31) rows 0-3, 64 bytes apart (lbo); rows 4-7 (columns 4-7, ignored) read the 64 bytes that follow. Row c of each
// holds its lane's 4 bytes in word c. Then a float32 factor a 16-K block: [blocks][2] after the B area. FP8 tokens:
// E4M3 bytes as they are, factor 2^(s - 127) of their UE8M0 byte; E2M1 tokens (NVFP4 w4a4, L1): E4M3 of the code
// (exact), factor the UE4M3 scale (the token's global scale multiplies the sums). No fold: exact products, the 16-term
// sums in the FP8 wgmma's accumulator, the rest in float32.
template <bool kFP4Act>
__device__ __forceinline__ void build_token_nv(uint8_t* dst, float* factors, uint2 table, const uint8_t* x,
                                               const uint8_t* x_sf, int blocks) {
  for (int blk = threadIdx.x; blk < blocks; blk += 32 * kGemvWarps) {
    uint32_t lo[4], hi[4];
    if constexpr (kFP4Act) {
      const uint4 raw = __ldcg(reinterpret_cast<const uint4*>(x + int64_t(blk) * 16));
      const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
      for (int st = 0; st < 4; ++st) e2m1x8_to_e4m3(w[st], table, lo[st], hi[st]);
      const uint16_t sf2 = __ldcg(reinterpret_cast<const unsigned short*>(x_sf) + blk);
      factors[2 * blk] = __half2float(__half(__nv_cvt_fp8_to_halfraw(sf2 & 0xFF, __NV_E4M3)));
      factors[2 * blk + 1] = __half2float(__half(__nv_cvt_fp8_to_halfraw(sf2 >> 8, __NV_E4M3)));
    } else {
      const uint4 a = __ldcg(reinterpret_cast<const uint4*>(x + int64_t(blk) * 32));
      const uint4 b = __ldcg(reinterpret_cast<const uint4*>(x + int64_t(blk) * 32 + 16));
      lo[0] = a.x, hi[0] = a.y, lo[1] = a.z, hi[1] = a.w, lo[2] = b.x, hi[2] = b.y, lo[3] = b.z, hi[3] = b.w;
      factors[2 * blk] = factors[2 * blk + 1] = ue8m0_float(__ldcg(x_sf + blk));
    }
    const int q = blk % 4;
#pragma unroll
    for (int st = 0; st < 4; ++st) {
      uint8_t* step = dst + (4 * (blk / 4) + st) * 128;
      *reinterpret_cast<uint4*>(step + 16 * q) =
          make_uint4(q == 0 ? lo[st] : 0u, q == 1 ? lo[st] : 0u, q == 2 ? lo[st] : 0u, q == 3 ? lo[st] : 0u);
      *reinterpret_cast<uint4*>(step + 64 + 16 * q) =
          make_uint4(q == 0 ? hi[st] : 0u, q == 1 ? hi[st] : 0u, q == 2 ? hi[st] : 0u, q == 3 ? hi[st] : 0u);
    }
  }
}

// UE4M3 bytes of w (byte i: block i) -> floats, exact (E4M3 -> F16 holds every value; 0x7F: NaN).
__device__ __forceinline__ float4 ue4m3x4_floats(uint32_t w) {
  const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xFFFFu), __NV_E4M3);
  const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w >> 16), __NV_E4M3);
  const float2 a = __half22float2(__half2(lo)), b = __half22float2(__half2(hi));
  return make_float4(a.x, a.y, b.x, b.y);
}

// The NVFP4 wgmma form's consumers: the chunk ring's stages as consume_chunks takes them (warpgroup, rows ra / rb,
// lane q's 32-K block of each group), the weights decoded to E4M3 unscaled (fold table kFoldHeadroom: x 1), four
// m64n8k32 wgmmas a group into two accumulators (steps 0-1, 2-3) against build_token_nv's B. Lane q < 2 holds columns
// 2q and 2q + 1 of each: the group's 16-K blocks 4q .. 4q + 3 of its rows, each times its UE4M3 weight scale (stage:
// [tile][piece][16 rows][16 bytes], produce_chunks<true, 1>) and the token's factor into the row's float32 sum; lanes
// 2-3 compute columns 4-7 (nothing) alike. After the item: lanes 0 and 1 summed, times the expert's global scale (and
// the token's, NVFP4 tokens), into part[parity][w / 4].
template <bool kFP4Act>
__device__ __forceinline__ void consume_chunks_nv(const GemvSmem& s, const GemvPass& p, const int* ids, int num_experts,
                                                  int slot_blocks, const uint8_t* token_b, const float* token_f) {
  constexpr int kStageBytes = heuristics::fp4_gemv_chunk_stage_bytes(true);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wg = warp / 4, m = warp % 4;
  const int q = lane % 4, qh = q & 1, rr = lane / 4, chunks = p.k / heuristics::kFp4GemvChunkK;
  const int ra = kFp4GemvTileRows * m + rr, rb = ra + 8;  // this lane's rows of the item
  const uint2 table = s.tables[kFoldHeadroom];
  int t0 = 0, parity = 0, n = 0;  // t0: the item's first stage in ring order
  for_each_item(p, ids, num_experts, [&](int slot, int id, int) {
    const uint32_t desc_lo = ptx::smem_desc_noswizzle_lo(token_b + int64_t(slot) * slot_blocks * 128, 64);
    const float* fac = token_f + slot * slot_blocks * 2;
    float acc_a = 0.0f, acc_b = 0.0f;
    for (int c = (wg - t0 % 4 + 4) % 4; c < chunks; c += 4) {
      const int t = t0 + c, stage = t % p.stages;
      const uint8_t* st8 = s.ring + stage * kStageBytes;  // chunk c of the item
      const uint8_t* sfa = st8 + kChunkScaleOffset + m * 512 + rr * kScaleTileBytes;  // row ra's; rb's 128 further
      ptx::mbarrier_wait(&s.full[stage], (t / p.stages) & 1);
#pragma unroll 1
      for (int lg = 0; lg < kChunkBlocks / 4; ++lg) {  // NVFP4: the chunk's 128-K groups
        const int g = c * (kChunkBlocks / 4) + lg, blk = 4 * lg + q;
        const uint4 wra = *reinterpret_cast<const uint4*>(st8 + ra * kChunkRowBytes + blk * 16);
        const uint4 wrb = *reinterpret_cast<const uint4*>(st8 + rb * kChunkRowBytes + blk * 16);
        // blocks 4qh .. 4qh + 3 of the group: chunk blocks 8 lg + 4 qh .., piece lg / 2, byte (8 lg + 4 qh) % 16; read
        // before the wgmmas (their fences keep later loads behind the wait)
        const int so = (lg >> 1) * 256 + ((8 * lg + 4 * qh) & 15);
        const uint32_t sw_a = *reinterpret_cast<const uint32_t*>(sfa + so);
        const uint32_t sw_b = *reinterpret_cast<const uint32_t*>(sfa + 8 * kScaleTileBytes + so);
        const float4 ft = *reinterpret_cast<const float4*>(fac + 8 * g + 4 * qh);
        uint32_t a8[4][4];
        group_a_fragments(wra, wrb, table, table, a8);
        const float4 fa = ue4m3x4_floats(sw_a), fb = ue4m3x4_floats(sw_b);
        const float fta[4] = {fa.x * ft.x, fa.y * ft.y, fa.z * ft.z, fa.w * ft.w};
        const float ftb[4] = {fb.x * ft.x, fb.y * ft.y, fb.z * ft.z, fb.w * ft.w};
        float d[2][4] = {};
        group_wgmmas(d, a8, [&](int st) { return ptx::smem_desc_noswizzle(desc_lo + 8 * (4 * g + st), 128); });
        // column 2q: block 4q (d[0]) / 4q + 1 (d[1]); column 2q + 1: 4q + 2 / 4q + 3
        acc_a = fmaf(d[0][0], fta[0], acc_a);
        acc_a = fmaf(d[1][0], fta[1], acc_a);
        acc_a = fmaf(d[0][1], fta[2], acc_a);
        acc_a = fmaf(d[1][1], fta[3], acc_a);
        acc_b = fmaf(d[0][2], ftb[0], acc_b);
        acc_b = fmaf(d[1][2], ftb[1], acc_b);
        acc_b = fmaf(d[0][3], ftb[2], acc_b);
        acc_b = fmaf(d[1][3], ftb[3], acc_b);
      }
      ptx::mbarrier_arrive(&s.empty[stage]);  // every lane of the warpgroup (racecheck)
    }
    t0 += chunks;
    acc_a += __shfl_xor_sync(0xffffffffu, acc_a, 1);  // lane 0: blocks 0-3 of each group, lane 1: 4-7
    acc_b += __shfl_xor_sync(0xffffffffu, acc_b, 1);
    const float global = __ldg(p.w.global_sf + id) * (kFP4Act ? s.token_g[slot] : 1.0f);
    ptx::mbarrier_wait(&s.part_free[parity], ((n >> 1) & 1) ^ 1);
    if (q == 0) {
      s.part[parity][wg][ra] = acc_a * global;  // a warpgroup without a chunk: 0
      s.part[parity][wg][rb] = acc_b * global;
      ptx::mbarrier_arrive(&s.part_full[parity]);
    }
    parity ^= 1, ++n;
  });
}

// Epilogue warp: the consumers' items in their order; each item's sums once written (part_full), then
// epilogue(part of the item, slot, item index in the slot, lane) by the whole warp, then part_free.
template <typename Epilogue>
__device__ __forceinline__ void epilogue_items(const GemvSmem& s, const GemvPass& p, const int* ids, int num_experts,
                                               Epilogue epilogue) {
  const int lane = threadIdx.x % 32;
  int parity = 0, n = 0;
  for_each_item(p, ids, num_experts, [&](int slot, int, int index) {
    ptx::mbarrier_wait(&s.part_full[parity], (n >> 1) & 1);
    epilogue(s.part[parity], slot, index, lane);
    ptx::mbarrier_arrive(&s.part_free[parity]);  // every lane read part[parity]: every lane arrives (racecheck)
    parity ^= 1, ++n;
  });
}

// Row i's sum over the consumers' kParts partial sums (the BF16 form: a warp each; the wgmma form: a warpgroup each).
template <int kParts>
__device__ __forceinline__ float warps_sum(const float (&part)[kGemvWarps][kGemvRows], int i) {
  float s = part[0][i];
#pragma unroll
  for (int w = 1; w < kParts; ++w) s += part[w][i];
  return s;
}

// The ring's barriers, and the slots' ids into shared memory (pre_dispatch wrote them: read after its grid ended).
// readers: the consumer warps that read each stage (every lane arrives on empty): all (BF16 form) or 4 (wgmma form).
__device__ __forceinline__ void init_ring(const GemvSmem& s, int stages, const int* ids, int slots, int readers) {
  if (threadIdx.x == 0) {
    for (int i = 0; i < stages; ++i) {
      ptx::mbarrier_init(&s.full[i], 1);
      ptx::mbarrier_init(&s.empty[i], 32 * readers);
    }
    for (int b = 0; b < 2; ++b) {  // part_full: the 8 lanes of each consumer warp that write sums; part_free: 32 lanes
      ptx::mbarrier_init(&s.part_full[b], kGemvWarps * 8);
      ptx::mbarrier_init(&s.part_free[b], 32);
    }
    ptx::fence_barrier_init();
  }
  for (int slot = threadIdx.x; slot < slots; slot += kGemvThreads) s.ids[slot] = __ldcg(ids + slot);
  if (threadIdx.x < 16) s.zeros[threadIdx.x] = 0;
  if (threadIdx.x >= 32 && threadIdx.x < 32 + kNumFoldTables)  // the wgmma form's fold tables
    s.tables[threadIdx.x - 32] = make_fold_table(threadIdx.x - 32 - kFoldHeadroom);
  __syncthreads();
}

// L1: item ob of a slot = the 32 gate rows of outputs [32 ob, 32 ob + 32) and their up rows, 64
// further (transform_weights' interleave: chunk 2j = gate rows [64j, 64j + 64), chunk 2j + 1 = the matching up rows).
template <bool kFast, bool kFP4Act, bool kNV, bool kFP8Mma>
__global__ void __launch_bounds__(kGemvThreads, 1) fp4_gemv_l1_kernel(const __grid_constant__ GemvPass p, uint8_t* buffer,
                                                                      layout::BufferLayout l, float clamp,
                                                                      int* recv_stats, float* scratch) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int hidden = static_cast<int>(l.hidden), inter = static_cast<int>(l.intermediate);
  const GemvSmem s = carve(smem, kNV && kFP8Mma ? heuristics::fp4_gemv_chunk_token_bytes(hidden / 32, true)
                                                : heuristics::fp4_gemv_token_bytes(hidden / 32));
  // The ids before the dependency wait: pre_dispatch triggers this grid only after its blocks stored and fenced them
  // (sm90_pre_dispatch.cu), so the producer streams the experts' weights while pre_dispatch still quantizes the token.
  // NOTES: before, every warp waited for pre_dispatch's end first (V4-Flash T=1 timeline: L1 started 0.6 µs into the
  // call, pre_dispatch ended at 2.4 µs, and no weight byte was requested before then).
  init_ring(s, p.stages, reinterpret_cast<const int*>(buffer + l.topk_idx_offset), p.slots,  // token 0's slots
            kGemvParts<kFP8Mma>);
  const int* ids = s.ids;
  const int num_experts = static_cast<int>(l.num_experts);
  // Tiles 0-1 and 2-3 are contiguous rows from multiples of 32: the wgmma ring loads them as runs of 2
  // (heuristics::fp4_gemv_run_tiles; change both together).
  auto rows_of = [](int ob, int (&r0)[4]) {
    const int i0 = ob * kL1Outputs, gate0 = 128 * (i0 / 64) + i0 % 64;
    r0[0] = gate0, r0[1] = gate0 + 16, r0[2] = gate0 + 64, r0[3] = gate0 + 80;
  };
  const float* weights = reinterpret_cast<const float*>(buffer + l.topk_weights_offset);
  auto epilogue = [&](const float (&part)[kGemvWarps][kGemvRows], int slot, int ob, int lane) {
    const int blocks = inter / kL1Outputs;
    const float g = __bfloat162float(__float2bfloat16_rn(warps_sum<kGemvParts<kFP8Mma>>(part, lane)));
    const float u = __bfloat162float(__float2bfloat16_rn(warps_sum<kGemvParts<kFP8Mma>>(part, kL1Outputs + lane)));
    const float a = swiglu_value<kFast>(g, u, __ldcg(weights + slot), clamp);
    const float amax = warp_reduce_max<32>(fabsf(a));
    if constexpr (kNV && kFP4Act) {  // NVFP4's global scale spans the whole row: L2 quantizes (quantize_tokens_nvfp4)
      scratch[int64_t(slot) * inter + ob * kL1Outputs + lane] = a;
      if (lane == 0) scratch[int64_t(p.slots) * inter + int64_t(slot) * blocks + ob] = amax;
      return;
    }
    const float scale = ue8m0_block_scale(amax, kFP4Act ? kE2M1Max : kFP8Max);
    if constexpr (kFP4Act) {  // E2M1, low nibble first: lane 2i's byte takes lane 2i + 1's code
      const uint32_t code = e2m1_code(a * pow2_reciprocal(scale));
      const uint32_t odd = __shfl_down_sync(0xffffffffu, code, 1);
      if (lane % 2 == 0)
        buffer[l.pool_offset + int64_t(slot) * (inter / 2) + ob * (kL1Outputs / 2) + lane / 2] =
            static_cast<uint8_t>(code | (odd << 4));
    } else {
      buffer[l.pool_offset + int64_t(slot) * inter + ob * kL1Outputs + lane] = to_fp8(a * pow2_reciprocal(scale));
    }
    if (lane == 0) buffer[l.pool_sf_offset + int64_t(slot) * blocks + ob] = ue8m0_bits(scale);
  };
  const int warp = threadIdx.x / 32;
  if (warp == kProducerWarp) {  // weights only: no wait (this grid's end follows the consumers', which wait)
    produce_form<kNV, kFP8Mma, heuristics::fp4_gemv_run_tiles(true, kNV)>(s, p, ids, num_experts, rows_of);
    return;
  }
  ptx::grid_dependency_wait();  // pre_dispatch's token, top-k weights and error word
  ptx::launch_dependents();     // after the wait: L2 reads the ids before its own (fp4_gemv_l2_kernel)
  if (warp == kEpilogueWarp) {
    // Every CTA read the ids before the wait (init_ring): re-read after it, a store that was not visible then is
    // reported. By the epilogue warp, which idles until its first item's partials: in the consumers' branch the L2
    // round trip cost NVFP4 w4a4 2.7 us per call, at the producer's end ~1 % (V4-Flash T=1, H100 A/B, 2026-11-27).
    for (int slot = threadIdx.x % 32; slot < p.slots; slot += 32)
      if (__ldcg(reinterpret_cast<const int*>(buffer + l.topk_idx_offset) + slot) != ids[slot])
        record_error(buffer, l, layout::kErrorEarlyIds, ids[slot], 0, slot);
    epilogue_items(s, p, ids, num_experts, epilogue);
    return;
  }
  for (int slot = threadIdx.x; blockIdx.x == 0 && slot < p.slots; slot += 32 * kGemvWarps) {  // as routing: bad ids
    const int id = ids[slot];                                                                     // reported, valid
    if ((id < 0 || id >= num_experts) && id != -1) record_error(buffer, l, layout::kErrorExpertId, id, 0, slot);
    if (id >= 0 && id < num_experts && recv_stats != nullptr) atomicAdd(recv_stats + id, 1);  // slots counted
  }
  float* token_f = reinterpret_cast<float*>(s.token + (kNV ? 32 : 8) * (hidden / 32));  // the wgmma forms' factors
  if constexpr (kFP8Mma && kNV) {
    build_token_nv<kFP4Act>(reinterpret_cast<uint8_t*>(s.token), token_f, s.tables[kFoldHeadroom],
                            buffer + l.x_offset, buffer + l.x_sf_offset, hidden / 32);
    ptx::fence_proxy_async_shared();  // the wgmmas read the token through the async proxy
  } else if constexpr (kFP8Mma) {
    fold_token<kFP4Act>(s.token, token_f, s.tables, buffer + l.x_offset, buffer + l.x_sf_offset, hidden / 32);
    ptx::fence_proxy_async_shared();  // the wgmmas read the token through the async proxy
  } else {
    convert_token<kFP4Act, kNV>(s.token, buffer + l.x_offset, buffer + l.x_sf_offset, hidden / 32);
  }
  if constexpr (kNV && kFP4Act) {  // every slot's token is token 0
    const float gt = __ldcg(reinterpret_cast<const float*>(buffer + l.x_global_sf_offset));
    for (int slot = threadIdx.x; slot < p.slots; slot += 32 * kGemvWarps) s.token_g[slot] = gt;
  }
  ptx::named_barrier_sync(kConsumerBarrier, 32 * kGemvWarps);
  if constexpr (kFP8Mma && kNV)
    consume_chunks_nv<kFP4Act>(s, p, ids, num_experts, 0, reinterpret_cast<const uint8_t*>(s.token), token_f);
  else if constexpr (kFP8Mma)
    consume_chunks(s, p, ids, num_experts, 0, token_f);
  else
    consume<kNV, kFP4Act>(s, p, ids, num_experts, 0, rows_of);
}

// L2: item rb of a slot = weight rows [64 rb, 64 rb + 64) -> bf16 of the slot's combine row.
template <bool kFP4Act, bool kNV, bool kFP8Mma>
__global__ void __launch_bounds__(kGemvThreads, 1) fp4_gemv_l2_kernel(const __grid_constant__ GemvPass p, uint8_t* buffer,
                                                                      layout::BufferLayout l, const float* scratch) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int hidden = static_cast<int>(l.hidden), inter = static_cast<int>(l.intermediate);
  const int top_k = p.slots;
  static_assert(!(kNV && kFP4Act && kFP8Mma), "NVFP4 tokens' L2 quantizes into the BF16 form's fragments");
  const GemvSmem s = carve(smem, kNV && kFP8Mma ? heuristics::fp4_gemv_chunk_token_bytes(top_k * (inter / 32), true)
                                                : heuristics::fp4_gemv_token_bytes(top_k * (inter / 32)));
  // the wgmma forms' factors
  float* token_f = reinterpret_cast<float*>(s.token + (kNV ? 32 : 8) * top_k * (inter / 32));
  // The ids before the dependency wait: pre_dispatch wrote them, and L1 triggered this grid only after its own wait for
  // pre_dispatch (every kernel of the chain triggers after its wait; see combine_kernel).
  init_ring(s, p.stages, reinterpret_cast<const int*>(buffer + l.topk_idx_offset), top_k, kGemvParts<kFP8Mma>);
  const int* ids = s.ids;
  const int num_experts = static_cast<int>(l.num_experts);
  // The four tiles are 64 contiguous rows from a multiple of 64: one run (heuristics::fp4_gemv_run_tiles).
  auto rows_of = [](int rb, int (&r0)[4]) {
    for (int m = 0; m < 4; ++m) r0[m] = rb * kGemvRows + kFp4GemvTileRows * m;
  };
  const int warp = threadIdx.x / 32;
  if (warp == kProducerWarp) {
    // The producer streams weights before L1 ends (they do not depend on it). It does not wait at all: this grid's end
    // (combine's wait) follows the consumers', which wait.
    produce_form<kNV, kFP8Mma, heuristics::fp4_gemv_run_tiles(false, kNV)>(s, p, ids, num_experts, rows_of);
    return;
  }
  if constexpr (kNV && kFP4Act)
    if (warp != kEpilogueWarp) quant_slots(s, p, num_experts);  // the consumer warps
  ptx::grid_dependency_wait();  // L1's outputs
  ptx::launch_dependents();
  if (warp == kEpilogueWarp) {  // bf16 of each item's 64 rows into the slot's combine row
    __nv_bfloat16* out = reinterpret_cast<__nv_bfloat16*>(buffer + l.combine_offset);  // token 0's slots
    epilogue_items(s, p, ids, num_experts, [&](const float (&part)[kGemvWarps][kGemvRows], int slot, int rb, int lane) {
#pragma unroll
      for (int r = lane; r < kGemvRows; r += 32)
        out[int64_t(slot) * hidden + rb * kGemvRows + r] =
            __float2bfloat16_rn(warps_sum<kGemvParts<kFP8Mma>>(part, r));
    });
    return;
  }
  if constexpr (kNV && kFP4Act) {
    quantize_tokens_nvfp4(s, p, scratch, inter);
  } else {
    // Every slot's row at once: the pool's rows [slot][I] (scales [slot][I / 32]) are one run of top_k x I / 32 blocks,
    // as the token area's. A slot with a bad id converts bytes L1 never wrote there; no item of it is consumed.
    // NOTES (H100, 2026-11-27, forty-fifth session): slot by slot, the first I / 32 threads took top_k round trips to
    // the L2 cache in turn while the other warps waited at the barrier below (ncu, V4-Flash T=1: ~40 % of L2's warp
    // samples on it); in one pass the call takes 0.95-0.98x the time for w4a8 and MXFP4 w4a4 at T=1.
    if constexpr (kFP8Mma && kNV) {
      build_token_nv<kFP4Act>(reinterpret_cast<uint8_t*>(s.token), token_f, s.tables[kFoldHeadroom],
                              buffer + l.pool_offset, buffer + l.pool_sf_offset, top_k * (inter / 32));
      ptx::fence_proxy_async_shared();
    } else if constexpr (kFP8Mma) {
      fold_token<kFP4Act>(s.token, token_f, s.tables, buffer + l.pool_offset, buffer + l.pool_sf_offset,
                          top_k * (inter / 32));
      ptx::fence_proxy_async_shared();
    } else {
      convert_token<kFP4Act, kNV>(s.token, buffer + l.pool_offset, buffer + l.pool_sf_offset, top_k * (inter / 32));
    }
  }
  ptx::named_barrier_sync(kConsumerBarrier, 32 * kGemvWarps);
  if constexpr (kFP8Mma && kNV)
    consume_chunks_nv<kFP4Act>(s, p, ids, num_experts, inter / 32, reinterpret_cast<const uint8_t*>(s.token),
                               token_f);
  else if constexpr (kFP8Mma)
    consume_chunks(s, p, ids, num_experts, inter, token_f);
  else
    consume<kNV, kFP4Act>(s, p, ids, num_experts, (inter / 32) * 16, rows_of);
}

// L1 and L2, each a persistent grid with its ring's dynamic shared memory (launch_fp4_gemv launches L1 then L2).
template <bool kFast, bool kFP4Act, bool kNV, bool kFP8Mma>
void launch_l1(const GemvPass& p, dim3 grid, int smem, uint8_t* buffer, const layout::BufferLayout& layout,
               float activation_clamp, int* recv_stats, float* scratch, cudaStream_t stream) {
  allow_dynamic_smem<fp4_gemv_l1_kernel<kFast, kFP4Act, kNV, kFP8Mma>>(heuristics::kFp4GemvSmemLimit);
  launch_pdl(fp4_gemv_l1_kernel<kFast, kFP4Act, kNV, kFP8Mma>, grid, dim3(kGemvThreads), smem, stream, p, buffer,
             layout, activation_clamp, recv_stats, scratch);
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
}
template <bool kFP4Act, bool kNV, bool kFP8Mma>
void launch_l2(const GemvPass& p, dim3 grid, int smem, uint8_t* buffer, const layout::BufferLayout& layout,
               const float* scratch, cudaStream_t stream) {
  allow_dynamic_smem<fp4_gemv_l2_kernel<kFP4Act, kNV, kFP8Mma>>(heuristics::kFp4GemvSmemLimit);
  launch_pdl(fp4_gemv_l2_kernel<kFP4Act, kNV, kFP8Mma>, grid, dim3(kGemvThreads), smem, stream, p, buffer, layout,
             scratch);
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void launch_fp4_gemv(const Fp4GemvLayer& l1, const Fp4GemvLayer& l2, uint8_t* buffer, const layout::BufferLayout& layout,
                     float activation_clamp, bool fast_math, int* recv_stats, float* scratch, int num_sms,
                     cudaStream_t stream) {
  const int top_k = static_cast<int>(layout.top_k);
  const int hidden = static_cast<int>(layout.hidden), inter = static_cast<int>(layout.intermediate);
  const bool nv = l1.global_sf != nullptr;
  const int sb = nv ? 16 : 32;  // weight scale block
  const int l1_stages = heuristics::fp4_gemv_stages(hidden, sb, hidden / 32);
  const int l2_stages = heuristics::fp4_gemv_stages(inter, sb, top_k * (inter / 32));
  if (layout.num_ranks != 1 || hidden % 128 != 0 || inter % 128 != 0 || top_k > heuristics::kFp4GemvMaxSlots ||
      l1_stages < 2 || l2_stages < 2 || (nv && layout.act_fp4 && scratch == nullptr))
    throw std::runtime_error("megamoe: the FP4 GEMV path takes one rank, hidden and intermediate multiples of 128, top_k "
                             "<= 64, two ring stages of each layer and, with NVFP4 tokens, a float32 scratch of "
                             "top_k x (intermediate + intermediate / 32) (heuristics::fp4_gemv)");
  // Forms: 0 MXFP4 on BF16 mma.sync, 1 NVFP4 on BF16 mma.sync, 2 MXFP4 on FP8 wgmmas (heuristics::fp4_gemv_fp8_mma),
  // 3 NVFP4 on FP8 wgmmas (heuristics::fp4_gemv_nv_fp8_mma; L2 with FP8 tokens only): a layer whose K is whole chunks
  // and whose shared memory holds 8 chunk stages beside its token (produce_chunks / consume_chunks[_nv]).
  const int wgmma = nv ? heuristics::fp4_gemv_nv_fp8_mma() : heuristics::fp4_gemv_fp8_mma();
  const bool w1 = (wgmma & 1) && hidden % heuristics::kFp4GemvChunkK == 0 &&
                  heuristics::fp4_gemv_chunk_stages(hidden / 32, nv) > 0;
  const bool w2 = (wgmma & 2) && !(nv && layout.act_fp4) && inter % heuristics::kFp4GemvChunkK == 0 &&
                  heuristics::fp4_gemv_chunk_stages(top_k * (inter / 32), nv) > 0;
  const int form1 = (w1 ? 2 : 0) + (nv ? 1 : 0), form2 = (w2 ? 2 : 0) + (nv ? 1 : 0);
  const int stages1 = w1 ? heuristics::fp4_gemv_chunk_stages(hidden / 32, nv) : l1_stages;
  const int stages2 = w2 ? heuristics::fp4_gemv_chunk_stages(top_k * (inter / 32), nv) : l2_stages;
  const int runs = heuristics::fp4_gemv_runs(nv && layout.act_fp4);
  const GemvPass p1{l1, 2 * inter, hidden, inter / kL1Outputs, top_k, sb, stages1, (runs & 1) != 0};
  const GemvPass p2{l2, hidden, inter, hidden / kGemvRows, top_k, sb, stages2, (runs & 2) != 0};
  // Persistent CTAs, one an SM (the ring takes most of its shared memory), over items x top_k items.
  const dim3 g1(std::min(num_sms, p1.items * top_k)), g2(std::min(num_sms, p2.items * top_k));
  const int smem1 = w1 ? heuristics::fp4_gemv_chunk_smem_bytes(hidden / 32, stages1, nv)
                       : heuristics::fp4_gemv_smem_bytes(hidden, sb, hidden / 32, l1_stages);
  const int smem2 = w2 ? heuristics::fp4_gemv_chunk_smem_bytes(top_k * (inter / 32), stages2, nv)
                       : heuristics::fp4_gemv_smem_bytes(inter, sb, top_k * (inter / 32), l2_stages);
  // [form]: <kNV, kFP8Mma> = (0, 0), (1, 0), (0, 1), (1, 1)
  using L1 = decltype(&launch_l1<false, false, false, false>);
  static constexpr L1 kL1[2][2][4] = {  // [fast_math][act_fp4][form]
      {{launch_l1<false, false, false, false>, launch_l1<false, false, true, false>,
        launch_l1<false, false, false, true>, launch_l1<false, false, true, true>},
       {launch_l1<false, true, false, false>, launch_l1<false, true, true, false>, launch_l1<false, true, false, true>,
        launch_l1<false, true, true, true>}},
      {{launch_l1<true, false, false, false>, launch_l1<true, false, true, false>, launch_l1<true, false, false, true>,
        launch_l1<true, false, true, true>},
       {launch_l1<true, true, false, false>, launch_l1<true, true, true, false>, launch_l1<true, true, false, true>,
        launch_l1<true, true, true, true>}}};
  using L2 = decltype(&launch_l2<false, false, false>);
  static constexpr L2 kL2[2][4] = {  // [act_fp4][form]; NVFP4 tokens never take form 3 (w2 above): the BF16 form
      {launch_l2<false, false, false>, launch_l2<false, true, false>, launch_l2<false, false, true>,
       launch_l2<false, true, true>},
      {launch_l2<true, false, false>, launch_l2<true, true, false>, launch_l2<true, false, true>,
       launch_l2<true, true, false>}};
  kL1[fast_math][layout.act_fp4][form1](p1, g1, smem1, buffer, layout, activation_clamp, recv_stats, scratch, stream);
  kL2[layout.act_fp4][form2](p2, g2, smem2, buffer, layout, static_cast<const float*>(scratch), stream);
}

}  // namespace megamoe::kernels
