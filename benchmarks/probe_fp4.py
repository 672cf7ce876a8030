"""Ceiling probe of the FP4 kernel's consumer loop (BF16 path, block_m 64): how fast can the consumers decode MXFP4
weights into wgmma A fragments and multiply, with everything already in shared memory? (METHOD.md: measure the
ceiling before optimising against it.)

The FP4 grouped GEMM at V4-Flash T=2048 spends ~5,100 cycles per 256-K stage of a 256 x 64 tile (ncu, H100,
2026-11-25: 4M MACs per stage, 2,048 cycles at the dense BF16 rate), and no single ablation explains it
(docs/perf-notes.md, eighteenth session). This probe runs only the consumers' stage loop, with the kernel's own
decode (kernels::fp4::decode_weights) and register-A wgmmas (m64n64k16, B = a bf16 token tile), on data that never
changes: no producer, no converters, no barriers (the CTA is the consumer warpgroups alone, so ptxas may give them up
to 255 registers; with the converters of full+conv, 448 threads, ptxas allocates 128 (the measured build also spilled
4 bytes), as the kernel launches at 128 before setmaxnreg raises its consumers). Modes:
  full        decode + wgmmas, waiting for the unit's wgmmas before the next decode (the kernel's loop)
  mma-wait    the same wgmmas and waits, fragments never rewritten (no decode)
  decode      the decode only, each fragment folded into the accumulator by XORs (no wgmma)
  mma-stream  wgmmas only, one wait per stage (the register-A wgmma rate)
  full+conv   full, plus six converter warps (as the kernel at block_m 64) converting a full 64-row FP8 token tile
              (the kernel's convert_token_unit) into a ring of two bf16 tiles each stage, with the kernel's
              bf_full / bf_empty hand-off in the kernel's order (256 x 64 tile only)
  pipe        decode of the next unit into a second fragment set while the unit's wgmmas run, the stage's last
              unit waited for before the next stage (H100, 2026-11-25: 3,172 cycles vs full's 3,204; the same loop
              in the kernel gained nothing: decode and register-A wgmmas contend, the wait is not the limit)
  pipe-x      pipe with one unit in flight across stages (the next stage's first decode overlaps too)
  fp8-full    MXFP4, the kernel's FP8-wgmma path (the default for MXFP4 tokens): decode_weights_e4m3, 4 register-A
              m64n64k32 FP8 wgmmas into a partial, a full wait and the promotion per unit with the rows' and the
              tokens' factors (the kernel's until the thirtieth session; since then fp8-ffma's; FP8 ideal: 1,024 cycles)
  fp8-mma     the same without the decode;  fp8-decode: the decode only (256 x 64 tile only)
  fp8-wide-full / fp8-wide-mma  the FP8-path unit on a 128 x 256 tile (m64n128k32, two token halves per decode: a
              quarter of 256 x 64's decode per MAC), reported per 4M MACs; and (the rows of tile 128x128) on a
              128 x 128 tile (one n128 block per decode: half of 256 x 64's decode per MAC)
  fp8-ffma / fp8-fadd  fp8-full (256 x 64) or fp8-wide-full (128 x 128) with a cheaper promotion: the tokens' factors
              only (one FFMA per accumulator: weights folded relative to one exponent per row for the whole K), or
              none (one FADD: tokens too)
  fp8-ffma256 fp8-ffma on the 128 x 128 tile with the tokens folded per 256 K: the stage's second group of wgmmas adds
              onto the first's partial, one FFMA promotion per stage (not yet run on a GPU)
  e4m3-ss     MXFP4 only: the consumers decode to E4M3 into shared memory (two buffers per warpgroup) and issue
              shared-memory FP8 wgmmas (m64n64k32) with per-group promotion: decode and MMA can overlap within a
              warp (256 x 64 tile only; its FP8 ideal is half the BF16 one)
with two consumer warpgroups, on two tiles of the same MACs per stage: 256 weight rows x 64 tokens (two 64-row slices
per warpgroup, as the kernel at block_m 64) and 128 weight rows x 128 tokens (one slice each, m64n128k16 wgmmas: half
the decode per MAC; would the loop then reach the MMA rate?). NOTES: four consumer warpgroups (one slice each)
compile to serialised wgmmas here (ptxas C7512: the 96 registers of a 640-thread launch); the kernel's own
four-consumer L2 variant did not, and was measured directly (docs/perf-notes.md, eighteenth session).

    python3 benchmarks/probe_fp4.py [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os

# As setup.py does: an nvcc wrapper outside the toolkit on PATH makes torch guess /usr/local as CUDA_HOME.
if not os.environ.get("CUDA_HOME") and os.path.exists("/usr/local/cuda/include/cuda_runtime_api.h"):
    os.environ["CUDA_HOME"] = "/usr/local/cuda"

import torch  # noqa: E402  (after CUDA_HOME: cpp_extension reads it at import)
from torch.utils.cpp_extension import load_inline  # noqa: E402

import bench_utils as bu  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))

def _rs128(fp8: bool) -> str:
    """The m64n128 register-A wgmma wrapper the ptx header lacks: D[64 x 128] (+)= A[64 x K] (registers) * B[128 x K]^T,
    float32 accumulate (64 output registers). bf16 (K 16, always accumulating, WgmmaBF16RS128) or e4m3 (K 32;
    accumulate = false ignores D, as ptx::WgmmaFP8RS; WgmmaFP8RS128)."""
    d = ", ".join(f"%{i}" for i in range(64))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(64))
    name, shape, args, tail, scale = (
        ("WgmmaFP8RS128", "m64n128k32.f32.e4m3.e4m3", ", bool accumulate", "p, 1, 1;", "int(accumulate)") if fp8 else
        ("WgmmaBF16RS128", "m64n128k16.f32.bf16.bf16", "", "p, 1, 1, 0;", "1"))
    return (
        f"struct {name} {{\n  static constexpr int kNumRegs = 64;\n"
        f"  __device__ __forceinline__ static void run(float* d, const uint32_t* a, uint64_t desc_b{args}) {{\n"
        f'    asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %69, 0;\\nwgmma.mma_async.sync.aligned.{shape} '
        f'{{{d}}}, {{%64, %65, %66, %67}}, %68, {tail}\\n}}\\n"\n'
        f'      : {outs}\n      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"({scale}));\n  }}\n}};\n')


CUDA_SRC = r"""
#include <cuda.h>
#include <cuda_runtime.h>
#include <cstdint>
#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include "kernels/sm90_fp4_grouped_gemm.cuh"

namespace ptx = megamoe::ptx;
namespace fp4 = megamoe::kernels::fp4;
namespace kernels = megamoe::kernels;  // the fold tables (sm90_common.cuh)
constexpr int kStages = 2;
constexpr int kTileA = 256 * 128, kTileSW = 256 * 16, kStage = kTileA + kTileSW;
// Converter mode: a second bf16 tile (the ring of two), the raw FP8 token tile, its scales, four mbarriers.
constexpr int kTokenRaw(int n) { return n * 256; }
constexpr int kTokenSF(int n) { return 8 * (n + 4); }
constexpr int kSmem(int n, bool conv) {
  return kStages * kStage + (conv ? 2 : 1) * n * 256 * 2 + (conv ? kTokenRaw(n) + 1024 : 0) + 1024;
}
RS128_SRC
template <int kN> struct Rs { using T = ptx::WgmmaBF16RS<kN>; };
template <> struct Rs<128> { using T = WgmmaBF16RS128; };

// The dynamic shared memory, from its first 1024-byte boundary (the 128B-swizzled tiles' alignment).
__device__ __forceinline__ uint8_t* aligned_smem() {
  extern __shared__ uint8_t smem_raw[];
  return smem_raw + ((1024 - (ptx::smem_addr(smem_raw) & 1023)) & 1023);
}
// Arbitrary E2M1 codes and the UE8M0 scale byte 120 (2^-7) in every weight stage.
__device__ __forceinline__ void fill_weight_stages(uint8_t* smem) {
  for (int s = 0; s < kStages; ++s) {
    for (int i = threadIdx.x; i < kTileA / 4; i += blockDim.x)
      reinterpret_cast<uint32_t*>(smem + s * kStage)[i] = (uint32_t(i + s) * 2654435761u);
    for (int i = threadIdx.x; i < kTileSW; i += blockDim.x) smem[s * kStage + kTileA + i] = 120;
  }
}
template <int kSlices, int kRegs>
__device__ __forceinline__ void zero_accumulators(float (&acc)[kSlices][kRegs]) {
#pragma unroll
  for (int ls = 0; ls < kSlices; ++ls)
#pragma unroll
    for (int i = 0; i < kRegs; ++i) acc[ls][i] = 0.0f;
}

// The slowest consumer warp (named barrier `barrier` over `threads`) ends the measurement: thread 0 stores the CTA's
// cycles. The accumulators are stored only when iters < 0 (never): ptxas drops wgmmas whose results are never read.
template <int kSlices, int kRegs>
__device__ __forceinline__ void finish_measurement(int barrier, int threads, int64_t start, int iters, int64_t* cycles,
                                                   const float (&acc)[kSlices][kRegs]) {
  ptx::named_barrier_sync(barrier, threads);
  const int64_t end = clock64();
  if (threadIdx.x == 0) cycles[blockIdx.x] = end - start;
  if (iters < 0) {
#pragma unroll
    for (int ls = 0; ls < kSlices; ++ls)
#pragma unroll
      for (int i = 0; i < kRegs; ++i) cycles[(ls * kRegs + i) * blockDim.x + threadIdx.x] = int64_t(acc[ls][i]);
  }
}

// The FP8-path modes' inputs: the weight stages with scales 118-121 (shifts 0-3 through the fold tables), finite E4M3
// token bytes [2 groups][64][128], token factors 1 and the fold tables.
constexpr int kFp8Tokens = 2 * 64 * 128;  // E4M3 tokens [2 groups][64][128], 128B-swizzled
template <int kTokens = 64>  // token rows of the E4M3 tile [2 groups][kTokens][128] and of the factors [2][kTokens]
__device__ __forceinline__ void fill_fp8_path_inputs(uint8_t* smem, uint8_t* tokens, float* tfac, uint2* tables) {
  fill_weight_stages(smem);
  for (int s = 0; s < kStages; ++s)
    for (int i = threadIdx.x; i < kTileSW; i += blockDim.x) smem[s * kStage + kTileA + i] = 118 + (i * 7) % 4;
  for (int i = threadIdx.x; i < 2 * kTokens * 128 / 4; i += blockDim.x)
    reinterpret_cast<uint32_t*>(tokens)[i] = (uint32_t(i) * 2654435761u) & 0x77777777u;
  for (int i = threadIdx.x; i < 2 * kTokens; i += blockDim.x) tfac[i] = 1.0f;
  if (threadIdx.x < kernels::kNumFoldTables)
    tables[threadIdx.x] = kernels::make_fold_table(threadIdx.x - kernels::kFoldHeadroom);
}

// kMode: 0 full, 1 mma-wait, 2 decode, 3 mma-stream, 4 full with converters (see the file comment). kN: tokens (the
// wgmma N); kSlices: 64-row weight slices per consumer warpgroup (the tile has 64 x kConsumers x kSlices weight rows).
constexpr int kConverterThreads = 192;  // six warps, as the kernel's converters at block_m 32 / 64
template <int kConsumers, int kN, int kSlices, int kMode>
__global__ void __launch_bounds__(128 * kConsumers + (kMode == 4) * kConverterThreads, 1)
    probe_kernel(int iters, int64_t* cycles) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr bool kConv = kMode == 4;
  constexpr int kBlockM = kN, kTileBF = kN * 256 * 2;
  using Mma = typename Rs<kN>::T;
  constexpr int kRegs = Mma::kNumRegs;
  uint8_t* smem = aligned_smem();
  uint8_t* bf = smem + kStages * kStage;
  fill_weight_stages(smem);
  for (int i = threadIdx.x; i < (kConv ? 2 : 1) * kTileBF / 4; i += blockDim.x)
    reinterpret_cast<uint32_t*>(bf)[i] = 0x3F803F80u;
  uint8_t* raw = bf + 2 * kTileBF;                      // FP8 token tile [2 groups][kN rows][128 bytes]
  uint8_t* sfa = raw + kTokenRaw(kN);                   // token scales [8 blocks][kN + 4]
  uint64_t* bf_full = reinterpret_cast<uint64_t*>(sfa + kTokenSF(kN) + 64 - kTokenSF(kN) % 64);
  uint64_t* bf_empty = bf_full + 2;
  if constexpr (kConv) {
    for (int i = threadIdx.x; i < kTokenRaw(kN) / 4; i += blockDim.x)  // finite E4M3 bytes (no exponent 15)
      reinterpret_cast<uint32_t*>(raw)[i] = (uint32_t(i) * 2654435761u) & 0x77777777u;
    for (int i = threadIdx.x; i < kTokenSF(kN); i += blockDim.x) sfa[i] = 120;
  }
  if (kConv && threadIdx.x == 0) {
    for (int b = 0; b < 2; ++b)
      ptx::mbarrier_init(&bf_full[b], kConverterThreads), ptx::mbarrier_init(&bf_empty[b], 4 * kConsumers);
    ptx::fence_barrier_init();
  }
  ptx::fence_proxy_async_shared();
  __syncthreads();
  if (kConv && threadIdx.x >= 128 * kConsumers) {
    // The converter warps, as the kernel's: bf16 tile b is free once every consumer warp has
    // finished the wgmmas that read it; it is full once all 128 converter threads have written their units.
    const int ctid = threadIdx.x - 128 * kConsumers;
    for (int it = 0; it < iters; ++it) {
      const int b = it % 2;
      ptx::mbarrier_wait(&bf_empty[b], ((it / 2) & 1) ^ 1);
      for (int u = ctid; u < kN * 8; u += kConverterThreads)
        fp4::convert_token_unit<kN, megamoe::ActRecipe::kFP8UE8M0Block32>(raw, sfa, bf + b * kTileBF, u / 8,
                                                                          (u / 4) % 2, u % 4);
      ptx::fence_proxy_async_shared();
      ptx::mbarrier_arrive(&bf_full[b]);
    }
    return;
  }
  const int lane = threadIdx.x % 32;
  const int consumer = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, q = lane % 4;
  const int quad_row = warp * 16 + lane / 4;
  const uint32_t bf_lo = ptx::smem_desc_sw128_lo(bf);
  float acc[kSlices][kRegs];
  zero_accumulators(acc);
  uint32_t a[8][4];
#pragma unroll
  for (int s = 0; s < 8; ++s)
#pragma unroll
    for (int r = 0; r < 4; ++r) a[s][r] = 0x3F803F80u;
  float part256[kRegs];  // kPromo 3: the stage's partial over both 128-K groups
  int64_t start = 0;
  for (int it = 0; it < iters; ++it) {
    if (it == 1) start = clock64();
    const uint8_t* tile_a = smem + (it % kStages) * kStage;
    // The first group's wait, before the accumulator fences (with 64 accumulator registers ptxas otherwise
    // serialises the wgmmas, C7514); the loop below waits again at no cost. With the converters the kernel's order
    // instead: the stage's bf16 tile first, then (first group) the wait and the previous tile's release.
    if constexpr (kMode != 3 && !kConv) ptx::wgmma_wait<0>();
    const int b = kConv ? it % 2 : 0;
    if constexpr (kConv) ptx::mbarrier_wait(&bf_full[b], (it / 2) & 1);
#pragma unroll
    for (int ls = 0; ls < kSlices; ++ls)
#pragma unroll
      for (int i = 0; i < kRegs; ++i) ptx::fence_operand(acc[ls][i]);
#pragma unroll
    for (int j = 0; j < 2 * kSlices; ++j) {
      const int g = j / kSlices, ls = j % kSlices;
      if constexpr (kMode != 3) ptx::wgmma_wait<0>();
      if (kConv && j == 0 && it > 0) {
        // Every wgmma of the previous stage has finished (waited above): its bf16 tile goes back to the converters.
        __syncwarp();
        if (lane == 0) ptx::mbarrier_arrive(&bf_empty[b ^ 1]);
      }
      if constexpr (kMode == 0 || kMode == 2 || kMode == 4)
        fp4::decode_weights<false>(a, tile_a, tile_a + kTileA, (kSlices * consumer + ls) * 64 + quad_row, g, q);
      uint64_t desc_b[8];
#pragma unroll
      for (int s = 0; s < 8; ++s) {
        const int step = 8 * g + s;
        desc_b[s] = ptx::smem_desc_sw128(bf_lo + (b * kTileBF + (step / 4) * kBlockM * 128 + (step % 4) * 32) / 16);
      }
      fp4::fence_fragment(a);
      if constexpr (kMode == 2) {
#pragma unroll
        for (int s = 0; s < 8; ++s)
          acc[ls][s] += __uint_as_float(a[s][0] ^ a[s][1] ^ a[s][2] ^ a[s][3] ^ uint32_t(desc_b[s]));
      } else {
        ptx::wgmma_fence();
#pragma unroll
        for (int s = 0; s < 8; ++s) Mma::run(acc[ls], a[s], desc_b[s]);
        ptx::wgmma_commit();
        // Every fragment stays live (read, not written) past the commit: otherwise ptxas gives all eight the same
        // four registers at N = 128 and waits for each wgmma before decoding the next fragment into them.
#pragma unroll
        for (int s = 0; s < 8; ++s)
#pragma unroll
          for (int r = 0; r < 4; ++r) asm volatile("" ::"r"(a[s][r]));
      }
    }
    if constexpr (kMode == 3) ptx::wgmma_wait<0>();
  }
  ptx::wgmma_wait<0>();
  finish_measurement(1, 128 * kConsumers, start, iters, cycles, acc);
#endif
}

// pipe / pipe-x: the kernel's decode and register-A wgmmas, software-pipelined within a warp: two fragment sets, unit
// u + 1 (a (group, slice) of the stage) decoded into one while unit u's wgmmas read the other. ptxas serialises a
// warp's wgmmas (C7513) when a register a wgmma in flight reads is written before the wait that retires it; it sees a
// fragment's last use at the wgmma and may give its register to the next decode, so each set is kept live (read, not
// written) right after the wait that retires its unit (no C75xx remark). pipe waits for the stage's last unit before the next stage (the next stage's first decode is
// exposed); pipe-x keeps one unit in flight across the loop's back edge.
template <int kN, int kSlices, bool kCross>
__global__ void __launch_bounds__(256, 1) pipe_kernel(int iters, int64_t* cycles) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Mma = typename Rs<kN>::T;
  constexpr int kRegs = Mma::kNumRegs, kUnits = 2 * kSlices, kBlockM = kN;
  uint8_t* smem = aligned_smem();
  uint8_t* bf = smem + kStages * kStage;
  fill_weight_stages(smem);
  for (int i = threadIdx.x; i < kN * 256 * 2 / 4; i += blockDim.x) reinterpret_cast<uint32_t*>(bf)[i] = 0x3F803F80u;
  ptx::fence_proxy_async_shared();
  __syncthreads();
  const int lane = threadIdx.x % 32;
  const int consumer = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, q = lane % 4;
  const int quad_row = warp * 16 + lane / 4;
  const uint32_t bf_lo = ptx::smem_desc_sw128_lo(bf);
  float acc[kSlices][kRegs];
  zero_accumulators(acc);
  uint32_t af[2][8][4];
  auto decode = [&](int set, int it, int u) {
    const uint8_t* tile_a = smem + (it % kStages) * kStage;
    fp4::decode_weights<false>(af[set], tile_a, tile_a + kTileA, (kSlices * consumer + u % kSlices) * 64 + quad_row,
                               u / kSlices, q);
  };
  auto keep = [&](int set) {
#pragma unroll
    for (int s = 0; s < 8; ++s)
#pragma unroll
      for (int r = 0; r < 4; ++r) asm volatile("" ::"r"(af[set][s][r]));
  };
  auto issue = [&](int set, int u) {
    const int g = u / kSlices, ls = u % kSlices;
    fp4::fence_fragment(af[set]);
    ptx::wgmma_fence();
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      const int step = 8 * g + s;
      Mma::run(acc[ls], af[set][s], ptx::smem_desc_sw128(bf_lo + ((step / 4) * kBlockM * 128 + (step % 4) * 32) / 16));
    }
    ptx::wgmma_commit();
  };
#pragma unroll
  for (int ls = 0; ls < kSlices; ++ls)
#pragma unroll
    for (int i = 0; i < kRegs; ++i) ptx::fence_operand(acc[ls][i]);
  int64_t start = 0;
  if constexpr (kCross) decode(0, 0, 0);
  for (int it = 0; it < iters; ++it) {
    if (it == 1) start = clock64();
    if constexpr (!kCross) decode(0, it, 0);
#pragma unroll
    for (int u = 0; u < kUnits; ++u) {
      issue(u % 2, u);
      const bool last = u + 1 == kUnits;
      if (last && !kCross) {
        ptx::wgmma_wait<0>();
        keep(0), keep(1);
      } else {
        // Retires unit u - 1 (the previous stage's last unit at u = 0 with pipe-x): its set takes the next unit.
        if (u > 0 || kCross) {
          ptx::wgmma_wait<1>();
          keep((u + 1) % 2);
        }
        if (!last) decode((u + 1) % 2, it, u + 1);
        else if (it + 1 < iters) decode(0, it + 1, 0);
      }
    }
  }
  ptx::wgmma_wait<0>();
  keep(0), keep(1);
#pragma unroll
  for (int ls = 0; ls < kSlices; ++ls)
#pragma unroll
    for (int i = 0; i < kRegs; ++i) ptx::fence_operand(acc[ls][i]);
  finish_measurement(1, 256, start, iters, cycles, acc);
#endif
}

// fp8-full / fp8-mma / fp8-decode (256 x 64 tile, MXFP4): the kernel's FP8-wgmma path (the default for MXFP4 tokens),
// its consumer loop alone: per (group, slice) unit kernels::fp4::decode_weights_e4m3 (E4M3 relative to the rows'
// largest scale of the group: quad shuffles, fold-table PRMTs), 4 register-A m64n64k32 wgmmas into a partial against
// an E4M3 token tile, a full wait, and the promotion with the rows' and 16 tokens' factors (the kernel's order).
// fp8-mma: the same without the decode (fragments never rewritten); fp8-decode: the decode only. The FP8 ideal of a
// stage is 1,024 cycles, half the BF16 one.
// fp8-wide-full / fp8-wide-mma (128 x 256 tile: 128 weight rows x 256 tokens, MXFP4): the FP8-wgmma path on the tile
// whose accumulators still fit (two consumer warpgroups of one 64-row slice, 2 x 64 accumulator registers each for the
// two 128-token halves, one 64-register partial): per 128-K group one decode_weights_e4m3 of the slice, then per half
// 4 register-A m64n128k32 wgmmas into the partial, a full wait and the promotion (the kernel's unit, at a quarter
// of the decode per MAC of 256 x 64). A stage is 8.4M MACs: Python reports cycles per 4M MACs. fp8-wide-mma: no decode.
// The question (docs/perf-notes.md, "FP4 prefill: what a tile can reach"): does this loop get near the FP8 rate
// (1,024 cycles per 4M MACs)? Build the kernel tile only at <= ~1,400.
// One kernel for both tiles: per stage, per 128-K group g and weight slice, one decode, then per token block of kN
// (one at 256 x 64, two halves at 128 x 256) four k32 wgmmas into the partial, the wait and the promotion.
template <int kTokens> constexpr int kFp8Smem = kStages * kStage + 2 * kTokens * 128 + 2 * kTokens * 4 + 256 + 1024;
template <int kN> struct Fp8Rs { using T = ptx::WgmmaFP8RS<kN>; };
template <> struct Fp8Rs<128> { using T = WgmmaFP8RS128; };
// kPromo: the promotion per unit: 0 the kernel's until the thirtieth session (rows' x tokens' factors: FMUL + FFMA), 1
// the tokens' factors only (the kernel's since: weights folded relative to one exponent per row for the whole K), 2
// none (FADD: tokens too), 3 the tokens' factors once per 256-K stage (tokens folded per 256 K: the second group's
// wgmmas accumulate onto the first's partial; 128 x 128 only).
template <int kMode, int kTokens, int kPromo = 0>  // kMode: 0 full, 1 mma, 2 decode (64 tokens only); kTokens: 64, 128, 256
__global__ void __launch_bounds__(256, 1) fp8path_kernel(int iters, int64_t* cycles) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  static_assert(kTokens == 64 || ((kTokens == 128 || kTokens == 256) && kMode != 2), "probe: 256 x 64, 128 x 128 or 128 x 256");
  static_assert(kPromo != 3 || (kTokens == 128 && kMode == 0), "probe: the promotion per 256 K on 128 x 128 only");
  constexpr int kN = kTokens == 64 ? 64 : 128;      // wgmma N
  constexpr int kSlices = kTokens == 64 ? 2 : 1;     // 64-row weight slices per consumer warpgroup
  constexpr int kBlocks = kTokens / kN;              // token blocks of kN per decode
  using Mma = typename Fp8Rs<kN>::T;
  constexpr int kRegs = Mma::kNumRegs;
  uint8_t* smem = aligned_smem();
  uint8_t* tokens = smem + kStages * kStage;
  float* tfac = reinterpret_cast<float*>(tokens + 2 * kTokens * 128);  // token factors [2 groups][kTokens]
  uint2* tables = reinterpret_cast<uint2*>(tfac + 2 * kTokens);
  fill_fp8_path_inputs<kTokens>(smem, tokens, tfac, tables);
  ptx::fence_proxy_async_shared();
  __syncthreads();
  const int lane = threadIdx.x % 32;
  const int consumer = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, q = lane % 4;
  const int quad_row = warp * 16 + lane / 4;
  const uint32_t tok_lo = ptx::smem_desc_sw128_lo(tokens);
  float acc[kSlices * kBlocks][kRegs];
  zero_accumulators(acc);
  uint32_t a8[4][4];
#pragma unroll
  for (int s = 0; s < 4; ++s)
#pragma unroll
    for (int r = 0; r < 4; ++r) a8[s][r] = 0x38383838u;  // E4M3 1.0
  float part256[kRegs];  // kPromo 3: the stage's partial over both 128-K groups
  int64_t start = 0;
  for (int it = 0; it < iters; ++it) {
    if (it == 1) start = clock64();
    const uint8_t* tile_a = smem + (it % kStages) * kStage;
#pragma unroll
    for (int j = 0; j < 2 * kSlices; ++j) {
      const int g = j / kSlices, ls = j % kSlices;
      float fa = tfac[quad_row], fb = tfac[kTokens + quad_row];  // runtime values: the promotion's multiplies stay
      // The rows' exponents (at least every scale byte of fill_fp8_path_inputs), runtime values as the kernel's.
      const uint32_t ra = 121u + (fa != 1.0f), rb = 121u + (fb != 1.0f);
      if constexpr (kMode != 1)
        fp4::decode_weights_e4m3(a8, tile_a, tile_a + kTileA, tables, (kSlices * consumer + ls) * 64 + quad_row, g, q,
                                 ra, rb);
      if constexpr (kMode == 2) {
#pragma unroll
        for (int s = 0; s < 4; ++s)
#pragma unroll
          for (int r = 0; r < 4; ++r) ptx::fence_operand(a8[s][r]);  // as the BF16 decode mode: no hoisted loads
#pragma unroll
        for (int s = 0; s < 4; ++s)
          acc[ls][s] += __uint_as_float(a8[s][0] ^ a8[s][1] ^ a8[s][2] ^ a8[s][3]) * (s % 2 ? fb : fa);
        continue;
      } else {
#pragma unroll
        for (int h = 0; h < kBlocks; ++h) {
          // The block's token factors: loaded before the wgmmas as the kernel does at 64 tokens; read after the wait at
          // 128 (32 more live registers would not fit beside 2 x 64 accumulators and the partial).
          const float* fcol = tfac + g * kTokens + h * kN;
          float fc[kN == 64 ? 16 : 1];
          if constexpr (kN == 64) {
#pragma unroll
            for (int jj = 0; jj < 16; ++jj) fc[jj] = fcol[8 * (jj / 2) + 2 * q + (jj % 2)];
          }
          float part_unit[kRegs];
          float(&part)[kRegs] = *[&] {
            if constexpr (kPromo == 3) return &part256;
            else return &part_unit;
          }();
          const bool carry = kPromo == 3 && g == 1;  // the stage's second group adds onto the first's partial
#pragma unroll
          for (int s = 0; s < 4; ++s)
#pragma unroll
            for (int r = 0; r < 4; ++r) ptx::fence_operand(a8[s][r]);
#pragma unroll
          for (int i = 0; i < kRegs; ++i) ptx::fence_operand(part[i]);
          ptx::wgmma_fence();
#pragma unroll
          for (int s = 0; s < 4; ++s)
            Mma::run(part, a8[s], ptx::smem_desc_sw128(tok_lo + ((g * kTokens + h * kN) * 128 + s * 32) / 16),
                     s > 0 || carry);
          ptx::wgmma_commit();
          ptx::wgmma_wait<0>();
#pragma unroll
          for (int i = 0; i < kRegs; ++i) ptx::fence_operand(part[i]);
          if (kPromo == 3 && g == 0) continue;  // promoted once, after the stage's second group
#pragma unroll
          for (int i = 0; i < kRegs; ++i) {
            const float f = kN == 64 ? fc[(i / 4) * 2 + (i % 2)] : fcol[8 * (i / 4) + 2 * q + (i % 2)];
            float& a = acc[ls * kBlocks + h][i];
            if constexpr (kPromo == 0) a = fmaf(part[i], ((i / 2) % 2 ? fb : fa) * f, a);
            else if constexpr (kPromo == 1 || kPromo == 3) a = fmaf(part[i], f, a);
            else a += part[i];
          }
        }
      }
    }
  }
  finish_measurement(1, 256, start, iters, cycles, acc);
#endif
}

// e4m3-ss (256 x 64 tile): the MXFP4 weights decoded to E4M3 in shared memory by the consumers themselves (the
// FP8-wgmma path's PRMT decode, relative to each row's largest scale of the 128-K group: quad shuffles, a fold-table
// load), then shared-memory FP8 wgmmas (m64n64k32) against an E4M3 token tile into a partial, promoted per group with
// the rows' factors and 16 token factors from shared memory. Two A buffers per warpgroup: a warp decodes group j + 1
// while the wgmmas of group j run, since no wgmma input register is rewritten (within a stage: the stage's last group
// is waited for before the next stage's first decode).
constexpr int kSsUnit = 64 * 128;                           // one (group, slice) A tile: 64 rows x 128 K E4M3
constexpr int kSsTokens = kFp8Tokens;                       // E4M3 tokens [2 groups][64][128]
constexpr int kSsSmem = kStages * kStage + kSsTokens + 2 * 2 * kSsUnit + 2 * 64 * 4 + 1024 + 1024;
__global__ void __launch_bounds__(256, 1) ss_kernel(int iters, int64_t* cycles) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Mma = ptx::WgmmaFP8<64>;
  constexpr int kRegs = Mma::kNumRegs;
  uint8_t* smem = aligned_smem();
  uint8_t* tokens = smem + kStages * kStage;
  uint8_t* abuf = tokens + kSsTokens;                       // [2 consumers][2 buffers][kSsUnit]
  float* tfac = reinterpret_cast<float*>(abuf + 2 * 2 * kSsUnit);  // token factors [2 groups][64]
  uint2* tables = reinterpret_cast<uint2*>(tfac + 2 * 64);
  fill_fp8_path_inputs(smem, tokens, tfac, tables);
  ptx::fence_proxy_async_shared();
  __syncthreads();
  const int lane = threadIdx.x % 32, consumer = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, q = lane % 4;
  const int quad_row = warp * 16 + lane / 4;
  const uint32_t tok_lo = ptx::smem_desc_sw128_lo(tokens);
  uint8_t* my_buf = abuf + consumer * 2 * kSsUnit;
  const uint32_t buf_lo = ptx::smem_desc_sw128_lo(my_buf);
  float acc[2][kRegs], part[2][kRegs];
  zero_accumulators(acc);
  float prev_fa = 0.0f, prev_fb = 0.0f;
  // Promotes unit (g, ls)'s partial (buffer u's) into the slice's accumulator, as the kernel's FP8-wgmma path.
  auto promote = [&](int u, int g, int ls) {
    float fc[16];
#pragma unroll
    for (int jj = 0; jj < 16; ++jj) fc[jj] = tfac[g * 64 + 8 * (jj / 2) + 2 * q + (jj % 2)];
#pragma unroll
    for (int i = 0; i < kRegs; ++i) ptx::fence_operand(part[u][i]);
#pragma unroll
    for (int i = 0; i < kRegs; ++i)
      acc[ls][i] = fmaf(part[u][i], ((i / 2) % 2 ? prev_fb : prev_fa) * fc[(i / 4) * 2 + (i % 2)], acc[ls][i]);
  };
  float part256[kRegs];  // kPromo 3: the stage's partial over both 128-K groups
  int64_t start = 0;
  for (int it = 0; it < iters; ++it) {
    if (it == 1) start = clock64();
    const uint8_t* tile_a = smem + (it % kStages) * kStage;
    const uint8_t* tile_sw = tile_a + kTileA;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int g = j / 2, ls = j % 2, u = j % 2;  // four units per stage: buffer u alternates across stages too
      uint32_t a8[4][4];  // the kernel's FP8-path decode; k32 step s: rows r (0, 2) and r + 8 (1, 3), lo / hi words
      const float fa = tfac[quad_row], fb = tfac[64 + quad_row];  // runtime row factors (the probe's; all 1)
      fp4::decode_weights_e4m3(a8, tile_a, tile_sw, tables, (2 * consumer + ls) * 64 + quad_row, g, q,
                               121u + (fa != 1.0f), 121u + (fb != 1.0f));
      uint32_t oa[8], ob[8];  // each row's 32 K in order: step s's lo and hi words
#pragma unroll
      for (int s = 0; s < 4; ++s)
        oa[2 * s] = a8[s][0], oa[2 * s + 1] = a8[s][2], ob[2 * s] = a8[s][1], ob[2 * s + 1] = a8[s][3];
      // Buffer u was last read by the wgmmas two units back, which the wait below (one unit back) has retired.
      uint8_t* buf = my_buf + u * kSsUnit;
      const int r0 = quad_row, r1 = quad_row + 8;  // rows within the 64-row slice; 16-byte chunks 2q, 2q + 1
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        *reinterpret_cast<uint4*>(buf + r0 * 128 + (((2 * q + h) ^ (r0 % 8)) << 4)) =
            make_uint4(oa[4 * h], oa[4 * h + 1], oa[4 * h + 2], oa[4 * h + 3]);
        *reinterpret_cast<uint4*>(buf + r1 * 128 + (((2 * q + h) ^ (r1 % 8)) << 4)) =
            make_uint4(ob[4 * h], ob[4 * h + 1], ob[4 * h + 2], ob[4 * h + 3]);
      }
      ptx::fence_proxy_async_shared();  // generic-proxy stores -> the wgmmas (async proxy)
      ptx::named_barrier_sync(1 + consumer, 128);  // the warpgroup's whole A tile is written
#pragma unroll
      for (int i = 0; i < kRegs; ++i) ptx::fence_operand(part[u][i]);
      ptx::wgmma_fence();
#pragma unroll
      for (int s = 0; s < 4; ++s)
        Mma::run(part[u], ptx::smem_desc_sw128(buf_lo + (u * kSsUnit + s * 32) / 16),
                 ptx::smem_desc_sw128(tok_lo + (g * 64 * 128 + s * 32) / 16), s > 0);
      ptx::wgmma_commit();
      // The previous unit's wgmmas (the other buffer and partial) have finished; the stage's last unit is waited for
      // and promoted before the next stage (no wgmma in flight across the loop's back edge: ptxas serialised every
      // wgmma otherwise, C7514).
      ptx::wgmma_wait<1>();
      if (j > 0) promote(u ^ 1, (j - 1) / 2, (j - 1) % 2);
      prev_fa = fa, prev_fb = fb;
      if (j == 3) {
        ptx::wgmma_wait<0>();
        promote(u, 1, 1);
      }
    }
  }
  ptx::wgmma_wait<0>();
  finish_measurement(3, 256, start, iters, cycles, acc);
#endif
}

template <int kConsumers, int kN, int kSlices, int kMode>
void launch(int64_t ctas, int64_t iters, torch::Tensor cycles) {
  auto kernel = probe_kernel<kConsumers, kN, kSlices, kMode>;
  // At least 114 KB, so that one CTA fits an SM whatever the registers (decode-only mode uses few).
  constexpr int kBytes = kSmem(kN, kMode == 4) > 114 * 1024 ? kSmem(kN, kMode == 4) : 114 * 1024;
  static_assert(kBytes <= 227 * 1024, "probe: shared memory");
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes);
  const int threads = 128 * kConsumers + (kMode == 4) * kConverterThreads;
  kernel<<<ctas, threads, kBytes, c10::cuda::getCurrentCUDAStream()>>>(static_cast<int>(iters), cycles.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// tile 0: 256 weight rows x 64 tokens (the kernel's block_m 64); 1: 128 rows x 128 tokens (the same MACs per stage,
// half the decode per MAC).
// One CTA per SM (at least 114 KB of shared memory) for an fp8path_kernel of kTokens tokens.
template <int kTokens>
void launch_fp8path(void (*kernel)(int, int64_t*), int64_t ctas, int64_t iters, torch::Tensor& cycles) {
  constexpr int kBytes = kFp8Smem<kTokens> > 114 * 1024 ? kFp8Smem<kTokens> : 114 * 1024;
  static_assert(kBytes <= 227 * 1024, "probe: shared memory");
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes);
  kernel<<<ctas, 256, kBytes, c10::cuda::getCurrentCUDAStream()>>>(static_cast<int>(iters), cycles.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void probe(int64_t tile, int64_t mode, int64_t ctas, int64_t iters, torch::Tensor cycles) {
  if (tile == 0 && mode == 5) {
    static_assert(kSsSmem <= 227 * 1024, "probe: shared memory");
    cudaFuncSetAttribute(ss_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSsSmem);
    ss_kernel<<<ctas, 256, kSsSmem, c10::cuda::getCurrentCUDAStream()>>>(static_cast<int>(iters),
                                                                         cycles.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  if (tile == 0 && mode >= 8 && mode <= 10)
    return launch_fp8path<64>(mode == 8 ? fp8path_kernel<0, 64> : mode == 9 ? fp8path_kernel<1, 64> : fp8path_kernel<2, 64>,
                              ctas, iters, cycles);
  if (tile == 0 && (mode == 13 || mode == 14))
    return launch_fp8path<64>(mode == 13 ? fp8path_kernel<0, 64, 1> : fp8path_kernel<0, 64, 2>, ctas, iters, cycles);
  if (tile == 3 && mode >= 11 && mode <= 15)
    return launch_fp8path<128>(mode == 11 ? fp8path_kernel<0, 128> : mode == 12 ? fp8path_kernel<1, 128>
                               : mode == 13 ? fp8path_kernel<0, 128, 1> : mode == 14 ? fp8path_kernel<0, 128, 2>
                                                                        : fp8path_kernel<0, 128, 3>,
                               ctas, iters, cycles);
  if (tile == 2 && (mode == 11 || mode == 12))
    return launch_fp8path<256>(mode == 11 ? fp8path_kernel<0, 256> : fp8path_kernel<1, 256>, ctas, iters, cycles);
  if (mode == 6 || mode == 7) {
    auto kernel = tile == 0 ? (mode == 6 ? pipe_kernel<64, 2, false> : pipe_kernel<64, 2, true>)
                            : (mode == 6 ? pipe_kernel<128, 1, false> : pipe_kernel<128, 1, true>);
    constexpr int kBytes = kSmem(128, false);  // both tiles; over 114 KB: one CTA per SM
    static_assert(kBytes >= 114 * 1024 && kBytes <= 227 * 1024, "probe: shared memory");
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes);
    kernel<<<ctas, 256, kBytes, c10::cuda::getCurrentCUDAStream()>>>(static_cast<int>(iters), cycles.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
#define MEGAMOE_PROBE_CASE(T, N, SL, M) if (tile == T && mode == M) return launch<2, N, SL, M>(ctas, iters, cycles);
  MEGAMOE_PROBE_CASE(0, 64, 2, 0) MEGAMOE_PROBE_CASE(0, 64, 2, 1) MEGAMOE_PROBE_CASE(0, 64, 2, 2)
  MEGAMOE_PROBE_CASE(0, 64, 2, 3) MEGAMOE_PROBE_CASE(0, 64, 2, 4) MEGAMOE_PROBE_CASE(1, 128, 1, 0) MEGAMOE_PROBE_CASE(1, 128, 1, 1)
  MEGAMOE_PROBE_CASE(1, 128, 1, 3)
#undef MEGAMOE_PROBE_CASE
  TORCH_CHECK(false, "probe: no case for tile ", tile, ", mode ", mode);
}
"""

CUDA_SRC = CUDA_SRC.replace("RS128_SRC", _rs128(fp8=False) + _rs128(fp8=True))
CPP_SRC = "void probe(int64_t tile, int64_t mode, int64_t ctas, int64_t iters, torch::Tensor cycles);"

MODES = ("full", "mma-wait", "decode", "mma-stream", "full+conv", "e4m3-ss", "pipe", "pipe-x", "fp8-full",
         "fp8-mma", "fp8-decode", "fp8-wide-full", "fp8-wide-mma", "fp8-ffma", "fp8-fadd", "fp8-ffma256")
MACS_PER_STAGE = 256 * 256 * 64  # 256 weight rows x 256 K x 64 tokens, or 128 x 256 x 128
TILES = ((0, "256x64", (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10)), (1, "128x128", (0, 1, 3, 6, 7)), (2, "128x256", (11, 12)),
         (3, "128x128", (11, 12, 13, 14, 15)), (0, "256x64", (13, 14)))
STAGE_MACS = {2: 2}  # tiles whose 256-K stage holds more than MACS_PER_STAGE: cycles are reported per MACS_PER_STAGE
BF16_MACS_PER_CYCLE = 2048  # dense BF16 per SM (H100: 989 TFLOP/s at 1.83 GHz over 132 SMs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--iters", type=int, default=2000, help="stages per CTA and launch")
    args = ap.parse_args()
    if args.iters < 2:
        ap.error("--iters: at least 2 (the first stage is not timed)")
    root = os.path.join(HERE, "..", "csrc")
    mod = load_inline("megamoe_probe_fp4", CPP_SRC, cuda_sources=CUDA_SRC, functions=["probe"],
                      extra_include_paths=[root, os.path.join(root, "include")],
                      extra_cuda_cflags=["-O3", "-std=c++20", "--expt-relaxed-constexpr",
                                         "-gencode=arch=compute_90a,code=sm_90a"], verbose=False)
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    cycles = torch.zeros(sms, dtype=torch.int64, device="cuda")
    ideal = MACS_PER_STAGE // BF16_MACS_PER_CYCLE
    print(f"{props.name}: {sms} SMs; cycles per {MACS_PER_STAGE} MACs (a 256-K stage of 256 x 64 or 128 x 128; half of 128 x 256; "
          f"{ideal} at the dense BF16 rate, {ideal // 2} at the FP8 rate: the ideal of the fp8-* rows), data in shared "
          f"memory; medians over SMs of the slowest consumer warp")
    print(f"{'tile':8} {'mode':13} {'cycles':>12} {'x ideal':>7}")
    rows = []
    for tile, tile_name, modes in TILES:
        for mode in modes:
            def call():
                mod.probe(tile, mode, sms, args.iters, cycles)

            bu.time_events(call, iters=5, flush=False)
            cyc = cycles.double().median().item() / (args.iters - 1) / STAGE_MACS.get(tile, 1)
            mode_ideal = ideal // 2 if MODES[mode].startswith("fp8-") else ideal  # FP8 wgmmas: twice the BF16 rate
            rows.append(dict(tile=tile_name, consumers=2, mode=MODES[mode], cycles_per_stage=round(cyc, 1),
                             ideal_cycles=mode_ideal, over_ideal=round(cyc / mode_ideal, 3)))
            print(f"{tile_name:8} {MODES[mode]:13} {cyc:12.1f} {cyc / mode_ideal:7.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=props.name, iters=args.iters, ideal_cycles=ideal, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
