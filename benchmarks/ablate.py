"""Ablation builds of the grouped GEMMs (diagnostic; wrong results by design, timing only).

Patches a copy of the source tree so the kernels leave out parts of each stage, to see which of them bounds the main
loop. FP8 kernel (docs/perf-notes.md, twelfth session: ~1,150 cycles per stage at T=8192 against 641 for the MMA):
  no-scales      no weight-scale or token-scale cp.async (the lanes still arrive: the stage completes without them)
  no-token-scales  no token-scale cp.async (the weight scales stay): what a single copy of a stage's token scales
                 could save at most
  ones-scales    no-scales, with every stage's scale slots set to 1.0 once at the start: the copies gone but the
                 products as large as real ones (no-scales' slots hold whatever shared memory held, zeros included,
                 which changes the data the MMAs and epilogues see, and with it the power drawn)
  no-token-tma   no token tile (its bytes leave the stage's expect_tx)
  no-weight-tma  no weight tile (the consumers multiply whatever the slot holds)
  no-ws-mul      the consumers' promotion without the weight scale (32 FMUL per stage fewer)
  no-scaling     the consumers' promotion adds the partials unscaled (no scale loads, no products)
  no-epilogue    the consumers skip the epilogue (fused L1 tiles still counted): main loops back to back
The consumers run unchanged on whatever the slots hold, so outputs are garbage; bench_moe --no-peer times them.
Unpaired walk only: with MEGAMOE_FP8_PAIRS=1 no-weight-tma would leave the multicast halves uncounted (a hang).
Two more FP8 patches keep the results exact; they change how the stage's scale copies synchronise, for racecheck A/Bs
(device_check.sh race):
  sync-scales    the producer warps' lanes wait for their cp.asyncs (cp.async.wait_all) and arrive plainly, in place
                 of the asynchronous cp.async.mbarrier.arrive.noinc
  fill-scales    every stage writes all kBlockM token-scale slots (those past the tile's rows zero-filled by a
                 cp.async of source size 0), so the consumers never read a slot written in an earlier stage

FP4 kernel (docs/perf-notes.md: its decode tiles run at 1.2-1.3x the weight-byte floor, issue-heavy consumers):
  fp4-no-convert     the converter warps skip the token tile's conversion / fold (barriers as before): the consumers
                     multiply whatever the bf16 / E4M3 tile holds
  fp4-half-convert   the converters convert only the tiles of even weight blocks (odd ones multiply whatever the bf16 /
                     E4M3 tile holds): the ceiling of sharing one conversion between two CTAs of a cluster
  fp4-no-decode      the consumers' E2M1 bit placement becomes one XOR per register (BF16 path: mask, IMAD, mask per
                     bf16 pair; FP8-wgmma path: the PRMT table lookups and sign spreading); the scale multiply stays
  fp4-no-weight-tma  no weight tile (its bytes leave the stage's expect_tx; scales still copied)
  fp4-no-weight-scales  no per-stage weight-scale copies (the scale warp's, where one copy per row and stage is taken: k
                     a multiple of 256, the V4 shapes, the lanes still arrive; and the TMA thread's scale boxes): what
                     do the weight scales cost the decode stream (2026-11-27: 4-9 % of the time at T = 1-128)?
  fp4-no-promote     FP8-wgmma path: each 128-K group's partial is added to the accumulator unscaled (no factor
                     loads, no products)
  fp4-hilo           FP8-wgmma path: what NVFP4 weights on FP8 wgmmas with exact products would cost (timing only):
                     each weight as two E4M3 bytes (s = s_hi + s_lo), two tables a 16-K block, twice the wgmmas
  fp4-no-scale-mul   BF16 path (and the GEMV's BF16 forms, which share decode_rows_bf16): no block-scale HMUL2 on
                     the decoded weights (the factors still computed): what scaling per 16-K block partial after the
                     MMA could save at most
  fp4-pow2-scale     NVFP4 weights: the block scale's mantissa dropped from the bf16 factor (same instructions, A of
                     at most two significant bits as with MXFP4)
  fp4-no-mma         no wgmma: each decoded A fragment is folded into the accumulator by XORs and one add (keeps the
                     decode live), so the tensor pipe is idle (is the register-A wgmma the prefill limit?)

FP4 GEMV (T=1, sm90_fp4_gemv.cu):
  gemv-no-consume    the consumer warps take no 128-K group of any tile (no ring reads, decode or mma.sync; they still
                     wait for each stage and release it): the ring's streaming rate alone (is L1 / L2 bound by the
                     consumers' issue or by the bytes?)
  gemv-no-stream     the producer copies nothing (it arrives on each stage's full barrier plainly): the consumers run
                     on whatever the ring holds, never waiting for bytes (their own time alone)
  gemv-chunks-no-consume  the wgmma form (MXFP4): the consumers take no 128-K group of any chunk (they still wait for
                     each stage and release it): the chunk ring's streaming rate alone
  gemv-chunks-nv-no-consume  the same for NVFP4's wgmma form (consume_chunks_nv)
  gemv-chunks-no-stream   the wgmma form: the producer copies nothing (it arrives on each stage's full barrier
                     plainly): the consumers' decode and wgmmas alone
  gemv-nvfp4-no-scratch  NVFP4 tokens: L1's epilogue stores no float32 outputs and amaxes (L2 quantizes whatever the
                     scratch holds): is L1's in-graph excess over w4a8 (~5 µs at V4-Flash T=1) its stores?
  gemv-nvfp4-no-quant    NVFP4 tokens: L2 quantizes nothing (its token fragments are whatever shared memory holds):
                     L2's quantization cost in a graph replay

    python3 benchmarks/ablate.py TREE no-scales[,no-token-tma,...]
    e.g. on the device: AB_VARIANTS=".ab/main .ab/abl-scales" bash benchmarks/ab.sh (no AB_TESTS for these trees)
"""
from __future__ import annotations

import os
import sys

KERNEL = "csrc/kernels/sm90_fp8_grouped_gemm.cuh"
KERNEL_FP4 = "csrc/kernels/sm90_fp4_grouped_gemm.cuh"
KERNEL_GEMV = "csrc/kernels/sm90_fp4_gemv.cu"


def kernel_of(name: str) -> str:
    """The source file an ablation patches (fp4-*: the FP4 tile walk, gemv-*: the FP4 GEMV)."""
    return KERNEL_FP4 if name.startswith("fp4-") else KERNEL_GEMV if name.startswith("gemv-") else KERNEL


# (ablation, original text, replacement); each original must occur exactly once.
SCALE_COPIES = [  # the FP8 kernel's per-stage token-scale, then weight-scale cp.asyncs left out
    ("                if (c < t.rows) ptx::cp_async_4(dst + c, src + c);",
     "                if (false && c < t.rows) ptx::cp_async_4(dst + c, src + c);"),
    ("            if (chunk_valid)\n              ptx::cp_async_4(",
     "            if (false && chunk_valid)\n              ptx::cp_async_4("),
]
PATCHES = {
    "no-scales": SCALE_COPIES,
    "no-token-scales": SCALE_COPIES[:1],
    "ones-scales": SCALE_COPIES + [
        ("  // Pair walk: the other CTA's barriers are initialised before any multicast or remote arrival reaches them.\n",
         "  for (int i = threadIdx.x; i < kNumStages * (Smem::kScales / 4); i += blockDim.x) stage_scales[i] = 1.0f;\n"
         "  // Pair walk: the other CTA's barriers are initialised before any multicast or remote arrival reaches them.\n"),
    ],
    "no-token-tma": [
        ("                ptx::mbarrier_arrive_expect_tx(&full[stage], (wide ? kTileCols : kBlockM) * kBlockK);\n"
         "                ptx::tma_load_2d(",
         "                ptx::mbarrier_arrive_expect_tx(&full[stage], 0);\n"
         "                if (false) ptx::tma_load_2d("),
        ("                if (wide)\n                  ptx::tma_load_2d(",
         "                if (false)\n                  ptx::tma_load_2d("),
    ],
    "no-weight-tma": [
        ("              else\n                ptx::tma_load_2d(tile_a + stage * Smem::kTileA, tmap_w,",
         "              else if (false)\n                ptx::tma_load_2d(tile_a + stage * Smem::kTileA, tmap_w,"),
        ("ptx::mbarrier_arrive_expect_tx(&full[stage], Smem::kTileA);",
         "ptx::mbarrier_arrive_expect_tx(&full[stage], 0 * Smem::kTileA);"),
    ],
    # The consumers' promotion (timing only): without the weight-scale products (32 FMUL per stage fewer), or
    # without any scaling (partials added as they are: the scale loads and products go).
    "no-ws-mul": [
        ("acc0[i] = __fmaf_rn(part0[i], ws0 * col_sf[(i / 4) * 2 + (i % 2)], acc0[i]);",
         "acc0[i] = __fmaf_rn(part0[i], col_sf[(i / 4) * 2 + (i % 2)], acc0[i]);"),
        ("acc1[i] = __fmaf_rn(part1[i], ws1 * col_sf[(i / 4) * 2 + (i % 2)], acc1[i]);",
         "acc1[i] = __fmaf_rn(part1[i], col_sf[(i / 4) * 2 + (i % 2)], acc1[i]);"),
        ("      const float s0 = ws * v.x, s1 = ws * v.y;", "      const float s0 = v.x, s1 = v.y;"),  # block_m 128
    ],
    "no-scaling": [
        ("acc0[i] = __fmaf_rn(part0[i], ws0 * col_sf[(i / 4) * 2 + (i % 2)], acc0[i]);", "acc0[i] += part0[i];"),
        ("acc1[i] = __fmaf_rn(part1[i], ws1 * col_sf[(i / 4) * 2 + (i % 2)], acc1[i]);", "acc1[i] += part1[i];"),
        # block_m 128 (one_partial_stage): no token-scale loads, no products
        ("      const float2 v = *reinterpret_cast<const float2*>(token_sf + 8 * j + 2 * (lane % 4));\n"
         "      const float s0 = ws * v.x, s1 = ws * v.y;",
         "      const float s0 = 1.0f, s1 = 1.0f;"),
    ],
    # The consumers go from one tile's main loop straight to the next (timing only): no epilogue, but each fused L1
    # tile is still counted for its expert (its L2 tiles wait for the count) and the accumulators stay live.
    "no-epilogue": [
        ("    if constexpr (kTailRows > 0) {\n      if (t.rows > kBlockM) epilogue_regs(",
         "    if (true) {\n"
         "#pragma unroll\n"
         "      for (int i = 0; i < kRegs; ++i) asm volatile(\"\" ::\"f\"(acc0[i]), \"f\"(acc1[i]));\n"
         "      if (kFused && is_l1) {\n"
         "        ptx::named_barrier_sync(1, kNumConsumerThreads);\n"
         "        if (ctid == 0) ptx::red_release_gpu_add(sched + 1 + t.expert, 1);\n"
         "      }\n"
         "    } else if constexpr (kTailRows > 0) {\n      if (t.rows > kBlockM) epilogue_regs("),
    ],
    "sync-scales": [
        ("            ptx::cp_async_mbarrier_arrive_noinc(&full[stage]);\n            if (++stage",
         "            ptx::cp_async_wait_all(), ptx::mbarrier_arrive(&full[stage]);\n            if (++stage"),
        ("              ptx::cp_async_mbarrier_arrive_noinc(&full[stage]);\n            } else {",
         "              ptx::cp_async_wait_all(), ptx::mbarrier_arrive(&full[stage]);\n            } else {"),
    ],
    "fill-scales": [
        ("                if (c < t.rows) ptx::cp_async_4(dst + c, src + c);",
         "                if (c < t.rows) ptx::cp_async_4(dst + c, src + c);\n"
         "                else asm volatile(\"cp.async.ca.shared.global [%0], [%1], 4, 0;\" ::\"r\"(ptx::smem_addr(dst + c)),"
         " \"l\"(src) : \"memory\");"),
    ],
    "fp4-no-convert": [
        ("          for (int u = ctid; u < units; u += R::kConverterWarps * 32) {",
         "          for (int u = ctid; false && u < units; u += R::kConverterWarps * 32) {"),
    ],
    "fp4-half-convert": [
        ("            units = (tile_infos[stage].rows * 8 + 31) / 32 * 32;",
         "            units = tile_infos[stage].n_block % 2 ? 0 : (tile_infos[stage].rows * 8 + 31) / 32 * 32;"),
    ],
    "fp4-no-decode": [
        ("  return (x * ((1u << (6 - 4 * pp)) + (1u << (12 - 4 * pp)))) & 0x81C081C0u;",
         "  return v ^ uint32_t(p);"),
        # The weights' E2M1 -> E4M3 of the FP8-wgmma walk (decode_weights_e4m3's call of group_a_fragments, shared
        # with the GEMV in sm90_common.cuh: replaced here, so the GEMV keeps its decode).
        ("  group_a_fragments(wra, wrb, ta, tb, a8);",
         "  const uint32_t wa[4] = {wra.x, wra.y, wra.z, wra.w}, wb[4] = {wrb.x, wrb.y, wrb.z, wrb.w};\n"
         "  for (int st = 0; st < 4; ++st) {\n"
         "    a8[st][0] = wa[st] ^ ta.x, a8[st][2] = (wa[st] << 4) ^ ta.y;\n"
         "    a8[st][1] = wb[st] ^ tb.x, a8[st][3] = (wb[st] << 4) ^ tb.y;\n"
         "  }"),
    ],
    "fp4-no-weight-tma": [
        ("        uint32_t bytes = S::kTileA + (p.scale_tma ? S::kTileSW : 0);",
         "        uint32_t bytes = 0 * S::kTileA + (p.scale_tma ? S::kTileSW : 0);"),
        ("            ptx::tma_load_2d(tile_a(i), &tmap_weights,", "            if (false) ptx::tma_load_2d(tile_a(i), &tmap_weights,"),
        ("            ptx::tma_load_2d(tile_a(stage), &tmap_weights,",
         "            if (false) ptx::tma_load_2d(tile_a(stage), &tmap_weights,"),
    ],
    "fp4-no-weight-scales": [
        ("          for (int r = lane; r < kTileN; r += 32) {\n            if (weight_row + r >= total_rows) break;",
         "          for (int r = lane; false && r < kTileN; r += 32) {\n            if (weight_row + r >= total_rows) break;"),
        # and the TMA copies (MXFP4's default): their bytes leave the stages' expect_tx
        ("        uint32_t bytes = S::kTileA + (p.scale_tma ? S::kTileSW : 0);", "        uint32_t bytes = S::kTileA;"),
        ("          if (p.scale_tma)\n            for (int i = 0; i < early; ++i)",
         "          if (false)\n            for (int i = 0; i < early; ++i)"),
        ("            if (p.scale_tma)\n              ptx::bulk_load(tile_sw(stage)",
         "            if (false)\n              ptx::bulk_load(tile_sw(stage)"),
        ("          for (int r = lane; r < kTileN; r += 32) {\n            if constexpr (kWWords == 4) ptx::cp_async_16(dst",
         "          for (int r = lane; false && r < kTileN; r += 32) {\n            if constexpr (kWWords == 4) ptx::cp_async_16(dst"),
    ],
    # FP8-wgmma path: each group's partial is added unscaled (no factor loads, no products): what the promotion costs.
    "fp4-no-promote": [
        ("          for (int i = 0; i < kRegsW; ++i) acc[ls][i] = fmaf(part[i], fc[(i / 4) * 2 + (i % 2)], acc[ls][i]);",
         "          for (int i = 0; i < kRegsW; ++i) acc[ls][i] += part[i];"),
    ],
    # FP8-wgmma path: the cost of NVFP4 weights on FP8 wgmmas with exact products (timing only, outputs wrong). An
    # E2M1 x UE4M3 product has up to 6 significant bits; split as s = s_hi + s_lo (1.a x 2^e and 0.0bc x 2^e) both
    # products are exact in E4M3, so each weight becomes two E4M3 bytes: two table lookups sharing the selectors and
    # signs, two scale bytes a lane and row (16-K blocks) each choosing a hi and a lo table, and twice the wgmmas
    # (hi and lo against the same token tile). Run on MXFP4 weights, whose bytes are 6 % fewer than NVFP4's.
    "fp4-hilo": [
        ("// One token unit of the FP8-wgmma path: token n, 128-K group g, quarter q (32 K) -> folded E4M3 bytes in the\n",
         "__device__ __forceinline__ void e2m1x8_hilo(uint32_t w, uint2 th, uint2 tl, uint32_t& lh, uint32_t& hh,\n"
         "                                            uint32_t& ll, uint32_t& hl) {\n"
         "  const uint32_t x4 = w << 4;\n"
         "  const uint32_t s0 = ptx::prmt(w, x4, 0x9D8Cu) & 0x80808080u, s1 = ptx::prmt(w, x4, 0xBFAEu) & 0x80808080u;\n"
         "  const uint32_t i0 = w & 0x7777u, i1 = (w >> 16) & 0x7777u;\n"
         "  lh = ptx::prmt(th.x, th.y, i0) | s0, hh = ptx::prmt(th.x, th.y, i1) | s1;\n"
         "  ll = ptx::prmt(tl.x, tl.y, i0) | s0, hl = ptx::prmt(tl.x, tl.y, i1) | s1;\n"
         "}\n"
         "__device__ __forceinline__ void decode_weights_hilo(uint32_t (&a8)[4][4], uint32_t (&a8l)[4][4], const uint8_t* tile_a,\n"
         "                                                    const uint8_t* tile_sw, const uint2* fold_tables, int row, int g,\n"
         "                                                    int q, uint32_t ra, uint32_t rb) {\n"
         "  const int unit = ((4 * g + q) ^ (row % 8)) << 4;\n"
         "  const uint4 wra = *reinterpret_cast<const uint4*>(tile_a + row * 128 + unit);\n"
         "  const uint4 wrb = *reinterpret_cast<const uint4*>(tile_a + (row + 8) * 128 + unit);\n"
         "  const uint32_t wa[4] = {wra.x, wra.y, wra.z, wra.w}, wb[4] = {wrb.x, wrb.y, wrb.z, wrb.w};\n"
         "  const uint32_t ea = tile_sw[row * kScaleWordsBytes + 4 * g + q], eb = tile_sw[(row + 8) * kScaleWordsBytes + 4 * g + q];\n"
         "  uint2 th[2][2], tl[2][2];  // [row a / b][16-K half]\n"
         "  auto tabs = [&](uint32_t s, uint32_t r, uint2& h, uint2& l) {\n"
         "    const uint32_t d = min(r - (s >> 1), uint32_t(kNumFoldTables - 3));\n"
         "    h = fold_tables[d], l = fold_tables[d + 1 + (s & 1)];\n"
         "  };\n"
         "  tabs(ea, ra, th[0][0], tl[0][0]), tabs(ea ^ 1, ra, th[0][1], tl[0][1]);\n"
         "  tabs(eb, rb, th[1][0], tl[1][0]), tabs(eb ^ 1, rb, th[1][1], tl[1][1]);\n"
         "#pragma unroll\n"
         "  for (int st = 0; st < 4; ++st) {\n"
         "    e2m1x8_hilo(wa[st], th[0][st / 2], tl[0][st / 2], a8[st][0], a8[st][2], a8l[st][0], a8l[st][2]);\n"
         "    e2m1x8_hilo(wb[st], th[1][st / 2], tl[1][st / 2], a8[st][1], a8[st][3], a8l[st][1], a8l[st][3]);\n"
         "  }\n"
         "}\n\n"
         "// One token unit of the FP8-wgmma path: token n, 128-K group g, quarter q (32 K) -> folded E4M3 bytes in the\n"),
        ("          uint32_t a8[4][4];  // k32 step s: word s of the 16 bytes (K 32q + 8s .. + 7)\n"
         "          decode_weights_e4m3(a8,",
         "          uint32_t a8[4][4], a8l[4][4];\n"
         "          decode_weights_hilo(a8, a8l,"),
        ("            for (int r = 0; r < 4; ++r) ptx::fence_operand(a8[s][r]);",
         "            for (int r = 0; r < 4; ++r) ptx::fence_operand(a8[s][r]), ptx::fence_operand(a8l[s][r]);"),
        ("            MmaW::run(part, a8[s], ptx::smem_desc_sw128(tok_desc_lo + (g * kCols * 128 + s * 32) / 16), s > 0);",
         "            MmaW::run(part, a8[s], ptx::smem_desc_sw128(tok_desc_lo + (g * kCols * 128 + s * 32) / 16), s > 0),\n"
         "            MmaW::run(part, a8l[s], ptx::smem_desc_sw128(tok_desc_lo + (g * kCols * 128 + s * 32) / 16), true);"),
    ],
    # BF16 path: the weights' block-scale multiply (one HMUL2 a bf16 pair) left out, the factors still computed (timing
    # only): the most that applying NVFP4's UE4M3 scales after the MMA (per 16-K block partials) could save.
    "fp4-no-scale-mul": [
        ("    a[2 * t][0] = mul(e2m1x2_raw<0>(wa[t]), fa);\n"
         "    a[2 * t][1] = mul(e2m1x2_raw<0>(wb[t]), fb);\n"
         "    a[2 * t][2] = mul(e2m1x2_raw<1>(wa[t]), fa);\n"
         "    a[2 * t][3] = mul(e2m1x2_raw<1>(wb[t]), fb);\n"
         "    a[2 * t + 1][0] = mul(e2m1x2_raw<2>(wa[t]), fa);\n"
         "    a[2 * t + 1][1] = mul(e2m1x2_raw<2>(wb[t]), fb);\n"
         "    a[2 * t + 1][2] = mul(e2m1x2_raw<3>(wa[t]), fa);\n"
         '    a[2 * t + 1][3] = mul(e2m1x2_raw<3>(wb[t]), fb);',
         "    asm volatile(\"\" ::\"r\"(fa), \"r\"(fb));\n"
         "    (void)mul;\n"
         "    a[2 * t][0] = e2m1x2_raw<0>(wa[t]);\n"
         "    a[2 * t][1] = e2m1x2_raw<0>(wb[t]);\n"
         "    a[2 * t][2] = e2m1x2_raw<1>(wa[t]);\n"
         "    a[2 * t][3] = e2m1x2_raw<1>(wb[t]);\n"
         "    a[2 * t + 1][0] = e2m1x2_raw<2>(wa[t]);\n"
         "    a[2 * t + 1][1] = e2m1x2_raw<2>(wb[t]);\n"
         "    a[2 * t + 1][2] = e2m1x2_raw<3>(wa[t]);\n"
         '    a[2 * t + 1][3] = e2m1x2_raw<3>(wb[t]);'),
    ],
    # NVFP4 weights: the UE4M3 block scale's mantissa dropped from the bf16 factor (outputs wrong): the same
    # instructions, but A = e2m1 x 2^k (at most two significant bits) as with MXFP4's power-of-two scales. Against
    # fp4-no-scale-mul: is the multiply's cost its issue slots or the wider operands the MMAs then see (power)?
    "fp4-pow2-scale": [
        ("    fb = weight_factor_nv_bits(sb & 0xFFu) | weight_factor_nv_bits((sb >> 8) & 0xFFu) << 16;\n  }",
         "    fb = weight_factor_nv_bits(sb & 0xFFu) | weight_factor_nv_bits((sb >> 8) & 0xFFu) << 16;\n  }\n"
         "  fa &= 0xFF80FF80u, fb &= 0xFF80FF80u;"),
    ],
    "fp4-no-mma": [
        ("            MmaW::run(part, a8[s], ptx::smem_desc_sw128(tok_desc_lo + (g * kCols * 128 + s * 32) / 16), s > 0);",
         "            part[s] = __uint_as_float(a8[s][0] ^ a8[s][1] ^ a8[s][2] ^ a8[s][3]) + (s > 0 ? part[s] : 0.0f);\n"
         "          for (int i = 4; i < kRegsW; ++i) part[i] = part[i % 4];"),
        ("          for (int s = 0; s < 8; ++s) ptx::WgmmaBF16RS<decltype(width)::value>::run(acc[ls], a[s], desc_b[s]);",
         "          for (int s = 0; s < 8; ++s) acc[ls][s] += __uint_as_float(a[s][0] ^ a[s][1] ^ a[s][2] ^ a[s][3] ^ uint32_t(desc_b[s]));"),
    ],
    "gemv-no-consume": [
        ("  for (int g = g_begin; g < g_end; ++g) {\n    const int blk = 4 * g + q;",
         "  for (int g = g_begin; g < g_begin; ++g) {\n    const int blk = 4 * g + q;"),
    ],
    "gemv-chunks-no-consume": [
        ("      for (int lg = 0; lg < kChunkBlocks / 4; ++lg) {  // the chunk's 128-K groups",
         "      for (int lg = 0; lg < 0; ++lg) {  // the chunk's 128-K groups"),
    ],
    "gemv-chunks-nv-no-consume": [
        ("      for (int lg = 0; lg < kChunkBlocks / 4; ++lg) {  // NVFP4: the chunk's 128-K groups",
         "      for (int lg = 0; lg < 0; ++lg) {  // NVFP4: the chunk's 128-K groups"),
    ],
    "gemv-chunks-no-stream": [
        ("      if (lane == 0) ptx::mbarrier_arrive_expect_tx(&s.full[stage], kBytes);\n"
         "      __syncwarp();  // the bytes are expected before any copy completes\n",
         "      if (lane == 0) ptx::mbarrier_arrive(&s.full[stage]);\n      __syncwarp();\n      if (false) {\n"),
        ("                         kRunRows, &s.full[stage]);\n        }\n      }\n      if (++stage == p.stages)",
         "                         kRunRows, &s.full[stage]);\n        }\n      }\n      }\n      if (++stage == p.stages)"),
    ],
    "gemv-nvfp4-no-scratch": [
        ("      scratch[int64_t(slot) * inter + ob * kL1Outputs + lane] = a;\n"
         "      if (lane == 0) scratch[int64_t(p.slots) * inter + int64_t(slot) * blocks + ob] = amax;",
         "      if (a == 12345.0f) scratch[int64_t(slot) * inter + ob * kL1Outputs + lane] = a;\n"
         "      if (amax == 12345.0f) scratch[int64_t(p.slots) * inter + int64_t(slot) * blocks + ob] = amax;"),
    ],
    "gemv-nvfp4-no-quant": [
        ("    quantize_tokens_nvfp4(s, p, scratch, inter);",
         "    if (inter < 0) quantize_tokens_nvfp4(s, p, scratch, inter);"),
    ],
    "gemv-no-stream": [
        ("      if (lane == 0) ptx::mbarrier_arrive_expect_tx(&s.full[stage], tile_bytes);\n"
         "      __syncwarp();  // the bytes are expected before any copy completes",
         "      if (lane == 0) ptx::mbarrier_arrive(&s.full[stage]);\n      __syncwarp();\n      if (false) {"),
        ("p.w.row_exp + row, kFp4GemvTileRows, &s.full[stage]);\n",
         "p.w.row_exp + row, kFp4GemvTileRows, &s.full[stage]);\n      }\n"),
    ],
}


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    tree, names = sys.argv[1], sys.argv[2].split(",")
    texts = {}
    for name in names:
        if name not in PATCHES:
            sys.exit(f"ablate: unknown ablation {name!r}; known: {', '.join(PATCHES)}")
        kernel = kernel_of(name)
        if kernel not in texts:
            texts[kernel] = open(os.path.join(tree, kernel)).read()
        for old, new in PATCHES[name]:
            if texts[kernel].count(old) != 1:
                sys.exit(f"ablate: {name}: expected the text once in {kernel}, found {texts[kernel].count(old)}:\n{old}")
            texts[kernel] = texts[kernel].replace(old, new)
    for kernel, text in texts.items():
        with open(os.path.join(tree, kernel), "w") as f:
            f.write(text)
    print(f"ablate: {tree}: {', '.join(names)}")


if __name__ == "__main__":
    main()
