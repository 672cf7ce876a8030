"""Ceiling probe: how fast can the FP8 grouped GEMM's main loop run on one SM, with and without its data stream?
(METHOD.md: measure the ceiling before optimising against it.)

The fused FP8 GEMM at T=8192 (block_m 64) spends ~0.65 µs per 128-K stage of a 256 x 64 tile (tile trace, H100,
2026-11-24): ~45 % of the dense FP8 rate. Halving its weight bytes through L2 (CTA pairs with TMA multicast) did not
help (2026-11-25), so the bound is on the SM. This probe runs the consumers' loop as the kernel does (two consumer
warpgroups, a 4-stage ring of full / empty mbarriers, per-stage wgmmas into a partial accumulator, promotion into the
tile accumulator in float32), on stage data that is either left in shared memory (no copy: the MMA + promotion
ceiling) or refilled per stage by one bulk copy from global memory (the kernel's shared-memory writes and L2 traffic),
for two tile shapes of the same MACs per stage:
  n64   the kernel's swap-AB tile: each warpgroup 2 slices of m64n64k32 (A: 64 weight rows each, B: 64 tokens);
        40 KB per stage.
  n128  tokens as the A side (DeepGEMM's orientation): each warpgroup 1 slice of m64n128k32 (A: its 64 tokens,
        B: 128 weight rows); 32 KB per stage.
Two more n64 variants: "pair" (clusters of two CTAs; each copies half of the stage's weight rows and multicasts it
into both, a stage refilled once both CTAs' consumers released it: the pair walk's protocol, 2026-11-25) and "+sf"
(the producer warp's lanes also cp.async the stage's 68 scale floats, 4 bytes each, as the kernel does).
One CTA per SM (384 threads, as the kernel); the MACs per stage are the same (2 x 2^20), so cycles per stage compare
directly; "of peak" is against 4,096 MACs per cycle and SM (dense FP8). Operand values are arbitrary finite E4M3
bytes (the rate does not depend on them beyond power).

    python3 benchmarks/probe_mma.py [--json out.json]
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

CUDA_SRC = r"""
#include <cuda.h>
#include <cuda_runtime.h>
#include <cstdint>
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include "megamoe/ptx/sm90.cuh"

namespace ptx = megamoe::ptx;
constexpr int kStages = 4, kBlockK = 128;

// kN: the wgmma N (tokens for n64, weight rows for n128); kSlices: m64 slices per consumer warpgroup.
// kPair (with kCopy): clusters of two CTAs; each copies half of the stage's A (n64: the weight rows) and multicasts
// it into both CTAs, plus its own B; a stage is refilled once both CTAs' consumers released it (the pair walk's
// protocol, 2026-11-25).
// kScales (with kCopy): as the kernel, the producer warp's lanes also copy the stage's 4 weight-chunk scales and 64 token
// scales (4-byte cp.async each, L2-resident) and arrive on the stage's full barrier when they land.
// kNoise (in smem only): the producer warp also issues kNoise independent integer instructions per stage (four
// chains), standing in for the kernel's producer, whose per-stage path is ~200 instructions on the SM sub-partition
// it shares with one warp of each consumer warpgroup (ncu, 2026-11-25).
// kOnePart (n128 with 2 slices: the 256 x 128 tile, 48 KB and 2^22 MACs per stage): one partial accumulator per
// warpgroup (64 registers beside the tile's 128), each slice's wgmmas promoted before the next slice's issue; the
// other warpgroup's wgmmas are meant to cover each promotion (two partials would need 256 registers).
// kSfc (n64, two partials, promoted): the consumers promote as the kernel does, with the stage's scales from shared
// memory (their two weight-chunk scales and 16 token-column scales as float2 loads after the full barrier) and one
// explicit fma per element (part x (weight scale x column scale) + acc), instead of a constant factor.
template <int kN, int kSlices, bool kPromote, bool kCopy, bool kPair = false, bool kScales = false, int kNoise = 0,
          bool kOnePart = false, bool kSfc = false>
__global__ void __launch_bounds__(384, 1) mma_kernel(const uint8_t* src, int64_t wrap_bytes, int iters,
                                                     int64_t* cycles) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Mma = ptx::WgmmaFP8<kN>;
  constexpr int kRegs = Mma::kNumRegs;
  constexpr int kSliceBytes = 64 * kBlockK;               // one m64 slice of A
  constexpr int kABytes = 2 * kSlices * kSliceBytes;      // both warpgroups' slices
  constexpr int kStageBytes = kABytes + kN * kBlockK;     // + B
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (ptx::smem_addr(smem_raw) & 1023)) & 1023);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kStages * kStageBytes);
  uint64_t* empty = full + kStages;
  float* scales = reinterpret_cast<float*>(empty + kStages);  // [kStages][68]
  // Finite E4M3 bytes (exponent field below 15: no NaN), different per byte.
  for (int i = threadIdx.x; i < kStages * kStageBytes / 4; i += blockDim.x)
    reinterpret_cast<uint32_t*>(smem)[i] = (uint32_t(i) * 2654435761u) & 0x77777777u;
  for (int i = threadIdx.x; i < kStages * 68; i += blockDim.x) scales[i] = 1.0f;  // in smem: finite scales
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s)
      ptx::mbarrier_init(&full[s], kScales ? 33 : 1), ptx::mbarrier_init(&empty[s], kPair ? 16 : 8);
    ptx::fence_barrier_init();
  }
  ptx::fence_proxy_async_shared();
  const uint32_t rank = kPair ? ptx::cluster_ctarank() : 0;
  if constexpr (kPair) ptx::cluster_sync();
  else __syncthreads();
  const int warpgroup = threadIdx.x / 128, lane = threadIdx.x % 32;
  if (warpgroup == 0) {
    ptx::setmaxnreg_dec<40>();
    if (threadIdx.x < 32) {
      const uint8_t* base = src + int64_t(blockIdx.x) * wrap_bytes;
      // Scale lanes (kScales): each stage's 68 floats from this CTA's 16 KB window at the start of src (2 MB for 132
      // CTAs: L2-resident), a new offset per stage.
      const float* sf = reinterpret_cast<const float*>(src) + int64_t(blockIdx.x) * 4096;
      int64_t off = 0;
      for (int it = 0, s = 0; it < iters; ++it, s = (s + 1) % kStages) {
        if constexpr (kPair) ptx::mbarrier_wait_cluster(&empty[s], ((it / kStages) & 1) ^ 1);
        else ptx::mbarrier_wait(&empty[s], ((it / kStages) & 1) ^ 1);
        if (lane == 0) {
          if constexpr (kPair) {
            // The pair's A is read once (rank r: its half, from the cluster's rank-0 source), B per CTA.
            const uint8_t* a_src = src + int64_t(blockIdx.x & ~1) * wrap_bytes + off + rank * (kABytes / 2);
            ptx::mbarrier_arrive_expect_tx(&full[s], kStageBytes);
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
                         " [%0], [%1], %2, [%3], %4;"
                         ::"r"(ptx::smem_addr(smem + s * kStageBytes + rank * (kABytes / 2))), "l"(a_src),
                         "r"(kABytes / 2), "r"(ptx::smem_addr(&full[s])), "h"(uint16_t(3)) : "memory");
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                         ::"r"(ptx::smem_addr(smem + s * kStageBytes + kABytes)), "l"(base + off + kABytes),
                         "r"(kStageBytes - kABytes), "r"(ptx::smem_addr(&full[s])) : "memory");
          } else if constexpr (kCopy) {
            ptx::mbarrier_arrive_expect_tx(&full[s], kStageBytes);
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                         ::"r"(ptx::smem_addr(smem + s * kStageBytes)), "l"(base + off), "r"(kStageBytes),
                         "r"(ptx::smem_addr(&full[s])) : "memory");
          } else {
            ptx::mbarrier_arrive(&full[s]);
          }
        }
        if constexpr (kScales) {
          const float* stage_sf = sf + (it % 32) * 68;
          for (int c = lane; c < 68; c += 32) ptx::cp_async_4(scales + s * 68 + c, stage_sf + c);
          ptx::cp_async_mbarrier_arrive_noinc(&full[s]);
        }
        off += kStageBytes;
        if (off + kStageBytes > wrap_bytes) off = 0;
        if constexpr (kNoise > 0) {
          uint32_t a = lane + it, b = 3 * lane, c = 5 * lane, d = 7 * lane;
#pragma unroll
          for (int i = 0; i < kNoise / 4; ++i)
            a = a * 1664525u + 1013904223u, b = b * 22695477u + 1u, c = c * 69069u + 1u, d = d * 134775813u + 1u;
          asm volatile("" ::"r"(a ^ b ^ c ^ d));
        }
      }
      if constexpr (kScales) ptx::cp_async_wait_all();
    }
    if constexpr (kPair) ptx::cluster_sync();
    return;
  }
  ptx::setmaxnreg_inc<232>();
  const uint32_t peer_empty = kPair ? ptx::mapa_shared(ptx::smem_addr(empty), rank ^ 1) : 0;
  auto release = [&](int s) {
    __syncwarp();
    if (lane == 0) {
      ptx::mbarrier_arrive(&empty[s]);
      if constexpr (kPair) ptx::mbarrier_arrive_remote(peer_empty + s * 8);
    }
  };
  const int consumer = warpgroup - 1;
  const uint32_t lo = ptx::smem_desc_sw128_lo(smem);
  float acc[kSlices][kRegs], part[kOnePart ? 1 : kSlices][kRegs];
#pragma unroll
  for (int sl = 0; sl < kSlices; ++sl)
#pragma unroll
    for (int i = 0; i < kRegs; ++i) acc[sl][i] = 0.0f;
  const float scale = 1.0f + 1e-3f * lane;  // stands for weight scale x token scale
  int64_t start = 0;
  for (int it = 0, s = 0; it < iters; ++it, s = (s + 1) % kStages) {
    ptx::mbarrier_wait(&full[s], (it / kStages) & 1);
    if (it == 1) start = clock64();  // after the first stage: the fill and launch are not timed
    const uint32_t a_lo = lo + (s * kStageBytes + consumer * kSlices * kSliceBytes) / 16;
    const uint32_t b_lo = lo + (s * kStageBytes + kABytes) / 16;
    if constexpr (kOnePart) {
      static_assert(kPromote && kSlices == 2, "one partial: the promoted two-slice tile");
#pragma unroll
      for (int sl = 0; sl < kSlices; ++sl) {
#pragma unroll
        for (int i = 0; i < kRegs; ++i) ptx::fence_operand(part[0][i]);
        ptx::wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < kBlockK / 32; ++ks)
          Mma::run(part[0], ptx::smem_desc_sw128(a_lo + (sl * kSliceBytes + ks * 32) / 16),
                   ptx::smem_desc_sw128(b_lo + ks * 2), ks > 0);
        ptx::wgmma_commit();
        ptx::wgmma_wait<0>();
#pragma unroll
        for (int i = 0; i < kRegs; ++i) ptx::fence_operand(part[0][i]);
        if (sl == kSlices - 1) release(s);
#pragma unroll
        for (int i = 0; i < kRegs; ++i) acc[sl][i] += part[0][i] * scale;
      }
      continue;
    }
    float ws[kSlices], col_sf[kN / 4];
    if constexpr (kSfc) {
      static_assert(kN == 64 && kSlices == 2 && kPromote, "kSfc: the kernel's n64 two-partial promotion");
      const float* sc = scales + s * 68;
      ws[0] = sc[consumer * 2], ws[1] = sc[consumer * 2 + 1];
#pragma unroll
      for (int j = 0; j < kN / 8; ++j) {
        const float2 v = *reinterpret_cast<const float2*>(sc + 4 + 8 * j + 2 * (lane % 4));
        col_sf[2 * j] = v.x, col_sf[2 * j + 1] = v.y;
      }
    }
    auto promote = [&](int sl) {
#pragma unroll
      for (int i = 0; i < kRegs; ++i)
        acc[sl][i] = kSfc ? __fmaf_rn(part[sl][i], ws[sl] * col_sf[(i / 4) * 2 + (i % 2)], acc[sl][i])
                          : acc[sl][i] + part[sl][i] * scale;
    };
    ptx::wgmma_fence();
#pragma unroll
    for (int sl = 0; sl < kSlices; ++sl) {
      float* d = kPromote ? part[sl] : acc[sl];
#pragma unroll
      for (int i = 0; i < kRegs; ++i) ptx::fence_operand(d[i]);
#pragma unroll
      for (int ks = 0; ks < kBlockK / 32; ++ks)
        Mma::run(d, ptx::smem_desc_sw128(a_lo + (sl * kSliceBytes + ks * 32) / 16),
                 ptx::smem_desc_sw128(b_lo + ks * 2), !kPromote || ks > 0);
      ptx::wgmma_commit();
    }
    if constexpr (kPromote) {
      if constexpr (kSlices == 2) {
        ptx::wgmma_wait<1>();
#pragma unroll
        for (int i = 0; i < kRegs; ++i) ptx::fence_operand(part[0][i]);
        promote(0);
      }
      ptx::wgmma_wait<0>();
#pragma unroll
      for (int sl = kSlices - 1; sl < kSlices; ++sl)
#pragma unroll
        for (int i = 0; i < kRegs; ++i) ptx::fence_operand(part[sl][i]);
      release(s);
      promote(kSlices - 1);
    } else {
      ptx::wgmma_wait<0>();
#pragma unroll
      for (int sl = 0; sl < kSlices; ++sl)
#pragma unroll
        for (int i = 0; i < kRegs; ++i) ptx::fence_operand(acc[sl][i]);
      release(s);
    }
  }
  const int64_t stop = clock64();
  if constexpr (kPair) ptx::cluster_sync();
  float sum = 0.0f;
#pragma unroll
  for (int sl = 0; sl < kSlices; ++sl)
#pragma unroll
    for (int i = 0; i < kRegs; ++i) sum += acc[sl][i];
  if (threadIdx.x == 128) cycles[blockIdx.x] = stop - start + (sum == 12345.0f);  // keeps the sums alive
#endif
}

template <int kN, int kSlices, bool kPromote, bool kCopy, bool kPair = false, bool kScales = false, int kNoise = 0,
          bool kOnePart = false, bool kSfc = false>
void launch(const torch::Tensor& src, int64_t wrap_bytes, int64_t ctas, int64_t iters, torch::Tensor& cycles) {
  constexpr int kStageBytes = 2 * kSlices * 64 * kBlockK + kN * kBlockK;
  constexpr int kSmem = 1024 + kStages * kStageBytes + 2 * kStages * 8 + kStages * 68 * 4;
  auto kernel = mma_kernel<kN, kSlices, kPromote, kCopy, kPair, kScales, kNoise, kOnePart, kSfc>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(kPair ? ctas / 2 * 2 : ctas));
  config.blockDim = dim3(384);
  config.dynamicSmemBytes = kSmem;
  config.stream = c10::cuda::getCurrentCUDAStream();
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = kPair ? 2 : 1;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  config.attrs = attr;
  config.numAttrs = 1;
  cudaError_t err = cudaLaunchKernelEx(&config, kernel, static_cast<const uint8_t*>(src.data_ptr<uint8_t>()), wrap_bytes,
                                       static_cast<int>(iters), cycles.data_ptr<int64_t>());
  TORCH_CHECK(err == cudaSuccess, "mma_kernel launch: ", cudaGetErrorString(err));
  err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "mma_kernel: ", cudaGetErrorString(err));
}

// shape 0: n64 (2 slices), 1: n128 (1 slice), 2: n128 with 2 slices and one partial (promotion only); copy: 0 none, 1 bulk copy per stage from src (wrap_bytes per CTA);
// pair: CTA pairs multicasting A; scales: the kernel's per-stage scale cp.asyncs (both n64 with promotion and copies).
void mma(const torch::Tensor& src, int64_t shape, bool promote, bool copy, bool pair, bool scales, int64_t noise,
         bool sfc, int64_t wrap_bytes, int64_t ctas, int64_t iters, torch::Tensor cycles) {
  if (sfc) {
    TORCH_CHECK(shape == 0 && promote && !pair && noise == 0, "mma: kernel-style promotion only for n64, promoted");
    if (scales) return launch<64, 2, true, true, false, true, 0, false, true>(src, wrap_bytes, ctas, iters, cycles);
    if (copy) return launch<64, 2, true, true, false, false, 0, false, true>(src, wrap_bytes, ctas, iters, cycles);
    return launch<64, 2, true, false, false, false, 0, false, true>(src, wrap_bytes, ctas, iters, cycles);
  }
  if (noise > 0) {
    TORCH_CHECK(shape == 0 && promote && !copy && !pair && !scales, "mma: noise only for n64 with promotion, in smem");
    if (noise == 100) return launch<64, 2, true, false, false, false, 100>(src, wrap_bytes, ctas, iters, cycles);
    if (noise == 200) return launch<64, 2, true, false, false, false, 200>(src, wrap_bytes, ctas, iters, cycles);
    if (noise == 400) return launch<64, 2, true, false, false, false, 400>(src, wrap_bytes, ctas, iters, cycles);
    TORCH_CHECK(false, "mma: noise 100, 200 or 400");
  }
  if (pair || scales) {
    TORCH_CHECK(shape == 0 && promote && copy, "mma: pairs and scales only for n64 with promotion and copies");
    if (pair && scales) return launch<64, 2, true, true, true, true>(src, wrap_bytes, ctas, iters, cycles);
    if (pair) return launch<64, 2, true, true, true>(src, wrap_bytes, ctas, iters, cycles);
    return launch<64, 2, true, true, false, true>(src, wrap_bytes, ctas, iters, cycles);
  }
  if (shape == 2) {
    TORCH_CHECK(promote, "mma: shape 2 is the promoted 256 x 128 tile");
    if (copy) return launch<128, 2, true, true, false, false, 0, true>(src, wrap_bytes, ctas, iters, cycles);
    return launch<128, 2, true, false, false, false, 0, true>(src, wrap_bytes, ctas, iters, cycles);
  }
#define MEGAMOE_PROBE_CASE(N, SL, P, C) \
  if (shape == (N == 128) && promote == P && copy == C) return launch<N, SL, P, C>(src, wrap_bytes, ctas, iters, cycles);
  MEGAMOE_PROBE_CASE(64, 2, true, true) MEGAMOE_PROBE_CASE(64, 2, true, false)
  MEGAMOE_PROBE_CASE(64, 2, false, true) MEGAMOE_PROBE_CASE(64, 2, false, false)
  MEGAMOE_PROBE_CASE(128, 1, true, true) MEGAMOE_PROBE_CASE(128, 1, true, false)
  MEGAMOE_PROBE_CASE(128, 1, false, true) MEGAMOE_PROBE_CASE(128, 1, false, false)
#undef MEGAMOE_PROBE_CASE
  TORCH_CHECK(false, "mma: no case");
}
"""

CPP_SRC = ("void mma(const torch::Tensor& src, int64_t shape, bool promote, bool copy, bool pair, bool scales, int64_t noise, "
           "bool sfc, int64_t wrap_bytes, int64_t ctas, int64_t iters, torch::Tensor cycles);")

MACS_PER_STAGE = 2 * 2 * 64 * 64 * 128  # n64 and n128; the 256 x 128 tile (shape 2) has twice as many
PEAK_MACS_PER_CYCLE = 4096  # dense FP8 per SM (H100: 1979 TFLOP/s at 1.83 GHz over 132 SMs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--iters", type=int, default=4000, help="stages per CTA and launch")
    ap.add_argument("--tile-only", action="store_true",
                    help="only the 256 x 128 tile (one partial) beside n64, promoted, each data source")
    ap.add_argument("--noise-only", action="store_true",
                    help="only the producer-noise rows (n64, promotion, in smem: 0, 100, 200, 400 instructions)")
    ap.add_argument("--scales-only", action="store_true",
                    help="only the promotion rows: constant factor vs the kernel's (scales from shared memory), in "
                         "smem and copied from HBM with the producer's scale copies")
    args = ap.parse_args()
    include = os.path.join(HERE, "..", "csrc", "include")
    mod = load_inline("megamoe_probe_mma", CPP_SRC, cuda_sources=CUDA_SRC, functions=["mma"],
                      extra_include_paths=[include],
                      extra_cuda_cflags=["-O3", "-std=c++20", "--expt-relaxed-constexpr",
                                         "-gencode=arch=compute_90a,code=sm_90a"], verbose=False)
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    big = 8 << 20  # per CTA: 1 GB in all, streamed from HBM; small: 128 KB per CTA (17 MB), L2-resident
    src = torch.empty(sms * big, dtype=torch.uint8, device="cuda")
    src.random_(0, 256)
    cycles = torch.zeros(sms, dtype=torch.int64, device="cuda")
    rows = []
    print(f"{props.name}: {sms} SMs; cycles per 128-K stage of 2^21 MACs (ideal {MACS_PER_STAGE // PEAK_MACS_PER_CYCLE}; "
          f"the 256x128 tile: 2^22, ideal {2 * MACS_PER_STAGE // PEAK_MACS_PER_CYCLE})")
    print(f"{'shape':12} {'promote':7} {'data':13} {'SMs':>4} {'cycles/stage':>12} {'of peak':>7} {'µs/stage':>8} "
          f"{'TFLOP/s':>8}")
    cases = [(shape, name, promote, data, wrap, False, False, 0) for shape, name in ((0, "n64"), (1, "n128"))
             for promote in (True, False)
             for data, wrap in (("in smem", 0), ("copy from L2", 128 << 10), ("copy from HBM", big))]
    cases += [(0, "n64" + " pair" * pair + " +sf" * scales, True, data, wrap, pair, scales, 0)
              for pair, scales in ((True, False), (False, True), (True, True))
              for data, wrap in (("copy from L2", 128 << 10), ("copy from HBM", big))]
    noise_cases = [(0, f"n64 noise{noise}", True, "in smem", 0, False, False, noise) for noise in (0, 100, 200, 400)]
    tile_cases = [(shape, name, True, data, wrap, False, False, 0) for shape, name in ((0, "n64"), (2, "256x128 1p"))
                  for data, wrap in (("in smem", 0), ("copy from L2", 128 << 10), ("copy from HBM", big))]
    scale_cases = [(0, "n64", True, "in smem", 0, False, False, 0), (0, "n64 sfc", True, "in smem", 0, False, False, 0),
                   (0, "n64 +sf", True, "copy from HBM", big, False, True, 0),
                   (0, "n64 +sf sfc", True, "copy from HBM", big, False, True, 0)]
    cases = (noise_cases if args.noise_only else tile_cases if args.tile_only else scale_cases if args.scales_only
             else cases + tile_cases[3:] + noise_cases[1:] + [scale_cases[1], scale_cases[3]])
    for shape, name, promote, data, wrap, pair, scales, noise in cases:
        sfc = name.endswith("sfc")
        for n in ((2, sms) if pair else (1, sms)):  # a pair needs two SMs
            def call():
                mod.mma(src, shape, promote, wrap > 0, pair, scales, noise, sfc, max(wrap, 1), n, args.iters, cycles)

            us = bu.time_events(call, iters=10, flush=False)
            cyc = cycles[:n].double().median().item() / (args.iters - 1)
            macs = MACS_PER_STAGE * (2 if shape == 2 else 1)
            tflops = 2 * macs * args.iters * n / us / 1e6
            row = dict(shape=name, promote=promote, data=data, pair=pair, scales=scales, noise=noise, sms=n,
                       macs_per_stage=macs, cycles_per_stage=round(cyc, 1),
                       of_peak=round(macs / PEAK_MACS_PER_CYCLE / cyc, 3),
                       us_per_stage=round(us / args.iters, 4), tflops=round(tflops, 1))
            rows.append(row)
            print(f"{name:12} {str(promote):7} {data:13} {n:4d} {cyc:12.1f} {row['of_peak']:7.3f} "
                  f"{row['us_per_stage']:8.4f} {tflops:8.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=props.name, iters=args.iters, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
