"""Ceiling probe: how fast can N SMs stream from HBM into shared memory with bulk copies, as a function of
the bytes each SM keeps in flight and of the access pattern? (METHOD.md: measure the ceiling before
optimising against it.)

The grouped GEMMs stream ~23 GB/s per busy SM at T=1 (96 of 132 SMs busy, DRAM at 66 %) and the same per
SM at T=16 with all SMs busy (DRAM-bound there). This probe separates the two explanations: a per-SM cap
(in-flight bytes / latency) would show as a flat GB/s-per-SM column independent of the SM count; a shared
DRAM limit as a flat total.

One CTA per SM, one warp: a ring of `stages` shared-memory buffers of `stage_bytes`, each refilled as soon
as it lands (no consumer work). Patterns:
  contiguous  one 1D bulk copy (cp.async.bulk) per stage;
  rows        the weight-tile walk of the grouped GEMMs: a stage is stage_bytes / 128 rows of 128 bytes,
              row stride 4096 (an L1 weight matrix of V4-Flash), K innermost; 128-byte bulk copies.
  tensor      the same walk as the GEMMs issue it: one TMA tensor box per stage (128 bytes x stage_bytes / 128
              rows of a [rows, 4096] uint8 map, 128B swizzle, L2 promotion 256 B: the GEMMs' weight maps).
  gemv        the FP4 GEMV's wgmma ring (sm90_fp4_gemv.cu, produce_chunks): a stage is an item's 64 rows over one
              512-K chunk (256 bytes of a [rows, 2048] map: V4-Flash L1's K 4096 in E2M1), as boxes of box_rows
              rows x box_inner bytes (256: no swizzle, as the kernel; 128: 128B-swizzled, two boxes across the chunk),
              items' chunks innermost, plus small copies a stage from a side buffer (the kernel's scale pieces and
              row exponents, case by case as each format's stage issues them); 3 items a CTA on every SM, 8 stages.
The "tile" cases stream 1 MB per CTA on 96 CTAs, one V4-Flash T=1 L1 weight tile per SM as the fused GEMM
runs it: their time, ramp and tail included, is what the L1 phase would take with no consumer in the way. The
"dynamic" cases stream the same 96 tiles in units (1 MB to 64 KB) that CTAs take from an atomic counter.

    python3 benchmarks/probe_stream.py [--json out.json]
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

CUDA_SRC = r"""
#include <cuda.h>
#include <cuda_runtime.h>
#include <cstdint>

__device__ __forceinline__ uint32_t saddr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

__global__ void __launch_bounds__(32, 1) stream_kernel(const uint8_t* src, int64_t bytes_per_cta, int stage_bytes,
                                                       int stages, int rows_pattern, int row_stride,
                                                       int64_t wrap_bytes, const __grid_constant__ CUtensorMap tmap,
                                                       int box_rows, int box_inner, int extras, const uint8_t* side) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (saddr(smem_raw) & 1023)) & 1023);  // 128B-swizzled boxes: 1 KB aligned
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + int64_t(stages) * stage_bytes);
  const int lane = threadIdx.x;
  // With wrap_bytes > 0 each CTA re-reads its first wrap_bytes (L2-resident when they all fit).
  const uint8_t* base = src + blockIdx.x * (wrap_bytes > 0 ? wrap_bytes : bytes_per_cta);
  if (lane == 0) {
    for (int s = 0; s < stages; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(saddr(&full[s])));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncwarp();
  const int64_t num_loads = bytes_per_cta / stage_bytes;
  const int rows = stage_bytes / 128, chunks = row_stride / 128;
  auto issue = [&](int64_t i) {
    const int s = static_cast<int>(i % stages);
    uint8_t* dst = smem + int64_t(s) * stage_bytes;
    // gemv: the stage's extra copies land after its rows. extras packs n_big | n_small << 4 | big / 16 << 8 |
    // small / 16 << 16: n_big copies of big bytes, then n_small of small bytes (the kernel's scale pieces and row
    // exponents), within 4 KB a stage.
    const int n_big = extras & 15, n_small = (extras >> 4) & 15, big = ((extras >> 8) & 255) * 16,
              small = ((extras >> 16) & 255) * 16;
    const int extra_bytes = rows_pattern == 3 ? n_big * big + n_small * small : 0;
    if (lane == 0)
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(saddr(&full[s])),
                   "r"(stage_bytes + extra_bytes) : "memory");
    __syncwarp();
    if (rows_pattern == 3) {
      // Stage i: chunk i % chunks (256 bytes) of item i / chunks (64 rows) of this CTA's items, lanes 8.. a box each.
      const int gchunks = row_stride / 256, items = static_cast<int>(bytes_per_cta / (64 * int64_t(row_stride)));
      const int row0 = static_cast<int>((blockIdx.x * items + i / gchunks) * 64), c = static_cast<int>(i % gchunks);
      const int halves = 256 / box_inner, boxes = (64 / box_rows) * halves;
      if (lane >= 8 && lane < 8 + boxes) {
        const int b = lane - 8, rb = b / halves, h = b % halves;
        // 128-byte boxes: [half][64 rows][128] (each 1 KB aligned for the swizzle); 256-byte: [64 rows][256]
        uint8_t* to = box_inner == 256 ? dst + rb * box_rows * 256 : dst + h * 64 * 128 + rb * box_rows * 128;
        asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
                     ::"r"(saddr(to)), "l"(reinterpret_cast<uint64_t>(&tmap)), "r"(saddr(&full[s])),
                     "r"(c * 256 + h * box_inner), "r"(row0 + rb * box_rows) : "memory");
      }
      if (lane < n_big + n_small) {
        const int bytes = lane < n_big ? big : small;
        const int at = lane < n_big ? lane * big : n_big * big + (lane - n_big) * small;
        const int64_t off = (int64_t(blockIdx.x) * num_loads + i) * 4096 + at;
        uint8_t* to = smem + int64_t(stages) * stage_bytes + 1024 + int64_t(s) * 4096 + at;
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     ::"r"(saddr(to)), "l"(side + off), "r"(bytes), "r"(saddr(&full[s])) : "memory");
      }
    } else if (rows_pattern == 2) {
      // Stage i: column chunk i % chunks of this CTA's row block i / chunks, as one tensor box.
      const int row0 = static_cast<int>((blockIdx.x * (bytes_per_cta / (int64_t(rows) * row_stride)) + i / chunks) * rows);
      if (lane == 0)
        asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
                     ::"r"(saddr(dst)), "l"(reinterpret_cast<uint64_t>(&tmap)), "r"(saddr(&full[s])),
                     "r"(static_cast<int>(i % chunks) * 128), "r"(row0) : "memory");
    } else if (!rows_pattern) {
      const uint8_t* from = base + (wrap_bytes > 0 ? i * stage_bytes % wrap_bytes : i * stage_bytes);
      if (lane == 0)
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     ::"r"(saddr(dst)), "l"(from), "r"(stage_bytes), "r"(saddr(&full[s])) : "memory");
    } else {
      // Stage i: column chunk i % chunks of row block i / chunks (K innermost, as the GEMM walks a tile).
      const uint8_t* blk = base + (i / chunks) * int64_t(rows) * row_stride + (i % chunks) * 128;
      for (int r = lane; r < rows; r += 32)
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], 128, [%2];"
                     ::"r"(saddr(dst + r * 128)), "l"(blk + int64_t(r) * row_stride), "r"(saddr(&full[s])) : "memory");
    }
  };
  for (int64_t i = 0; i < num_loads && i < stages; ++i) issue(i);
  for (int64_t i = 0; i < num_loads; ++i) {
    const int s = static_cast<int>(i % stages);
    const uint32_t parity = static_cast<uint32_t>((i / stages) & 1);
    asm volatile(
        "{\n.reg .pred p;\nWAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra WAIT_%=;\n}\n" ::"r"(saddr(&full[s])), "r"(parity) : "memory");
    __syncwarp();
    if (i + stages < num_loads) issue(i + stages);
  }
#endif
}

// Dynamic units: the same tensor-box walk over num_tiles 256-row tiles of the map, cut into units of
// unit_chunks 128-byte K chunks (32 KB stages), units handed out by an atomic counter (one thread streams, the
// ring spans units): a CTA that the memory system serves slowly takes fewer units, so the CTAs end together.
// The counter only grows: this launch's units are the values in [base, base + num_units).
__global__ void __launch_bounds__(32, 1) dynamic_kernel(int* counter, int base, int num_tiles, int chunks,
                                                        int unit_chunks, int stages,
                                                        const __grid_constant__ CUtensorMap tmap) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (saddr(smem_raw) & 1023)) & 1023);
  constexpr int kStageBytes = 32768;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + int64_t(stages) * kStageBytes);
  if (threadIdx.x != 0) return;
  for (int s = 0; s < stages; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(saddr(&full[s])));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  const int units_per_tile = chunks / unit_chunks, num_units = num_tiles * units_per_tile;
  int unit = atomicAdd(counter, 1) - base, chunk = 0;
  int64_t issued = 0, done = 0;
  for (;;) {
    while (issued - done < stages && unit < num_units) {
      const int s = static_cast<int>(issued % stages);
      const int tile = unit / units_per_tile, c = (unit % units_per_tile) * unit_chunks + chunk;
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(saddr(&full[s])), "r"(kStageBytes)
                   : "memory");
      asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
                   ::"r"(saddr(smem + int64_t(s) * kStageBytes)), "l"(reinterpret_cast<uint64_t>(&tmap)),
                   "r"(saddr(&full[s])), "r"(c * 128), "r"(tile * 256) : "memory");
      ++issued;
      if (++chunk == unit_chunks) chunk = 0, unit = atomicAdd(counter, 1) - base;
    }
    if (done == issued) break;
    const int s = static_cast<int>(done % stages);
    const uint32_t parity = static_cast<uint32_t>((done / stages) & 1);
    asm volatile(
        "{\n.reg .pred p;\nWAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra WAIT_%=;\n}\n" ::"r"(saddr(&full[s])), "r"(parity) : "memory");
    ++done;
  }
#endif
}

cudaError_t launch_dynamic(int* counter, int base, int num_ctas, int num_tiles, int chunks, int unit_chunks,
                           int stages, const CUtensorMap& tmap, cudaStream_t stream) {
  const int used = stages * 32768 + stages * 8 + 1024;
  const int smem = used > 116 * 1024 ? used : 116 * 1024;
  const cudaError_t err = cudaFuncSetAttribute(dynamic_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  dynamic_kernel<<<num_ctas, 32, smem, stream>>>(counter, base, num_tiles, chunks, unit_chunks, stages, tmap);
  return cudaGetLastError();
}

cudaError_t launch_stream(const uint8_t* src, int num_ctas, int64_t bytes_per_cta, int stage_bytes, int stages,
                          int rows_pattern, int row_stride, int64_t wrap_bytes, const CUtensorMap& tmap,
                          int box_rows, int box_inner, int extras, const uint8_t* side, cudaStream_t stream) {
  // At least 116 KB so that two CTAs never share an SM (one streaming warp per SM, as in the GEMMs). Layout: the
  // stages, their barriers (within 1 KB), then (gemv) 4 KB of extra copies a stage.
  const int used = stages * stage_bytes + 1024 + (rows_pattern == 3 ? stages * 4096 : 0) + 1024;
  const int smem = used > 116 * 1024 ? used : 116 * 1024;
  const cudaError_t err = cudaFuncSetAttribute(stream_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  stream_kernel<<<num_ctas, 32, smem, stream>>>(src, bytes_per_cta, stage_bytes, stages, rows_pattern, row_stride,
                                                 wrap_bytes, tmap, box_rows, box_inner, extras, side);
  return cudaGetLastError();
}
"""

CPP_SRC = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>
#include <cuda_runtime.h>

cudaError_t launch_stream(const uint8_t* src, int num_ctas, int64_t bytes_per_cta, int stage_bytes, int stages,
                          int rows_pattern, int row_stride, int64_t wrap_bytes, const CUtensorMap& tmap,
                          int box_rows, int box_inner, int extras, const uint8_t* side, cudaStream_t stream);

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

cudaError_t launch_dynamic(int* counter, int base, int num_ctas, int num_tiles, int chunks, int unit_chunks,
                           int stages, const CUtensorMap& tmap, cudaStream_t stream);

// src as a [rows, row_stride] uint8 tensor map with boxes of box_inner bytes x box_rows rows: 128 bytes 128B-swizzled
// (the GEMMs' maps), 256 bytes unswizzled (the FP4 GEMV's tmap_chunks).
static CUtensorMap make_map(torch::Tensor src, int64_t row_stride, int64_t box_inner, int64_t box_rows) {
  CUtensorMap tmap{};
  {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult status;
    TORCH_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &status) ==
                    cudaSuccess && fn != nullptr, "cuTensorMapEncodeTiled: not available");
    const cuuint64_t dims[2] = {static_cast<cuuint64_t>(row_stride), static_cast<cuuint64_t>(src.numel() / row_stride)};
    const cuuint64_t strides[1] = {static_cast<cuuint64_t>(row_stride)};
    const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_inner), static_cast<cuuint32_t>(box_rows)};
    const cuuint32_t elem_strides[2] = {1, 1};
    const CUresult r = reinterpret_cast<EncodeTiledFn>(fn)(
        &tmap, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, src.data_ptr(), dims, strides, box, elem_strides,
        CU_TENSOR_MAP_INTERLEAVE_NONE, box_inner == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE,
        CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    TORCH_CHECK(r == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed: ", int(r));
  }
  return tmap;
}

void dynamic(torch::Tensor src, torch::Tensor counter, int64_t base, int64_t num_ctas, int64_t num_tiles,
             int64_t unit_chunks, int64_t stages) {
  TORCH_CHECK(src.is_cuda() && src.numel() >= num_tiles * 256 * 4096, "src: too small");
  TORCH_CHECK(32 % unit_chunks == 0, "unit_chunks: must divide 32");
  const CUtensorMap tmap = make_map(src, 4096, 128, 256);
  const cudaError_t err = launch_dynamic(counter.data_ptr<int>(), static_cast<int>(base), static_cast<int>(num_ctas),
                                         static_cast<int>(num_tiles), 32, static_cast<int>(unit_chunks),
                                         static_cast<int>(stages), tmap, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "dynamic_kernel: ", cudaGetErrorString(err));
}

// pattern: 0 contiguous, 1 rows, 2 tensor, 3 gemv (see the module docstring; box_rows, box_inner, extras and side
// only for gemv: side holds 4 KB a stage of every CTA).
void stream(torch::Tensor src, int64_t num_ctas, int64_t bytes_per_cta, int64_t stage_bytes, int64_t stages,
            int64_t rows_pattern, int64_t row_stride, int64_t wrap_bytes, int64_t box_rows, int64_t box_inner,
            int64_t extras, torch::Tensor side) {
  const CUtensorMap tmap = rows_pattern == 2   ? make_map(src, row_stride, 128, stage_bytes / 128)
                           : rows_pattern == 3 ? make_map(src, row_stride, box_inner, box_rows)
                                               : CUtensorMap{};
  TORCH_CHECK(src.is_cuda() && src.numel() >= num_ctas * bytes_per_cta, "src: too small");
  TORCH_CHECK(rows_pattern != 3 || (stage_bytes == 64 * 256 && (box_inner == 128 || box_inner == 256) &&
                                    64 % box_rows == 0 && (extras & 15) + ((extras >> 4) & 15) <= 8 &&
                                    (extras & 15) * ((extras >> 8) & 255) * 16 +
                                            ((extras >> 4) & 15) * ((extras >> 16) & 255) * 16 <= 4096 &&
                                    bytes_per_cta % (64 * row_stride) == 0 &&
                                    side.numel() >= num_ctas * (bytes_per_cta / stage_bytes) * 4096),
              "gemv pattern: 16 KB stages of 64 rows, box_inner 128 or 256, box_rows dividing 64, at most 8 extra "
              "copies of 4 KB in all a stage, whole items a CTA, side 4 KB a stage");
  const int64_t row_block = stage_bytes / 128 * row_stride;  // rows pattern: bytes of one block of rows
  TORCH_CHECK(bytes_per_cta % stage_bytes == 0 &&
                  (rows_pattern == 0 || rows_pattern == 3 || bytes_per_cta % row_block == 0),
              "bytes_per_cta: must hold whole stages (rows pattern: whole row blocks)");
  const cudaError_t err = launch_stream(src.data_ptr<uint8_t>(), static_cast<int>(num_ctas), bytes_per_cta,
                                        static_cast<int>(stage_bytes), static_cast<int>(stages),
                                        static_cast<int>(rows_pattern), static_cast<int>(row_stride), wrap_bytes, tmap,
                                        static_cast<int>(box_rows), static_cast<int>(box_inner), static_cast<int>(extras),
                                        side.data_ptr<uint8_t>(), c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "stream_kernel: ", cudaGetErrorString(err));
}
"""


PATTERNS = ("contiguous", "rows", "tensor", "gemv")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--bytes-per-cta", type=int, default=4 << 20)
    ap.add_argument("--patterns", default="contiguous,rows,tensor,L2,tile,dynamic,gemv",
                    help="comma list of HBM patterns (contiguous, rows, tensor), L2, tile (1 MB per CTA), dynamic "
                         "(96 tiles of 1 MB in units from an atomic counter) and gemv (the FP4 GEMV's chunk ring)")
    args = ap.parse_args()
    mod = load_inline("megamoe_probe_stream", CPP_SRC, cuda_sources=CUDA_SRC, functions=["stream", "dynamic"],
                      extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a"], verbose=False)
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    per_cta = args.bytes_per_cta
    src = torch.empty(sms * per_cta, dtype=torch.uint8, device="cuda")
    src.random_(0, 256)
    side = torch.zeros(sms * (per_cta // 16384) * 4096, dtype=torch.uint8, device="cuda")  # gemv: 4 KB a stage
    copy_tbs = bu.measure_copy_bandwidth() / 1e12
    print(f"{props.name}: {sms} SMs, device copy {copy_tbs:.2f} TB/s (read + write)")
    rows = []
    print(f"{'source':6} {'pattern':10} {'SMs':>4} {'MB/SM':>5} {'stages':>6} {'stage KB':>8} {'in flight KB':>12} "
          f"{'µs':>7} {'TB/s':>6} {'/ copy':>6} {'GB/s per SM':>11}")
    # HBM: every CTA streams its own 4 MB (L2 flushed before each run). L2: every CTA re-reads its own 128 KB
    # (17 MB in all at 132 SMs, L2-resident after the warm-up), the regime of the T=8192 GEMMs, whose weight
    # tiles are shared by the CTAs of an expert's token blocks and mostly served by L2.
    patterns = args.patterns.split(",")
    cases = [("HBM", p, sb, st, per_cta, (16, 48, 96, 132)) for p in ("contiguous", "rows", "tensor") if p in patterns
             for sb, st in ((32768, 2), (32768, 3), (32768, 4), (32768, 6), (16384, 12), (65536, 3))
             if p != "tensor" or sb <= 32768]  # a TMA box has at most 256 rows
    if "L2" in patterns:
        cases += [("L2", "contiguous", sb, st, per_cta, (16, 48, 96, 132))
                  for sb, st in ((32768, 2), (32768, 4), (32768, 6), (16384, 12))]
    if "tile" in patterns:
        cases += [("HBM", p, 32768, st, 1 << 20, (96, 132)) for p in ("contiguous", "tensor") for st in (3, 6)]
    for source, pattern, stage_bytes, stages, per_cta, sm_counts in cases:
        box = (0, 0, 0)
        for n in sm_counts:
            n = min(n, sms)
            wrap = 128 << 10 if source == "L2" else 0
            # L2 cases keep L2 warm and time 8 launches back to back (one ~60 us launch would also time the
            # host's launch overhead). NOTES: flush_l2 leaves dirty lines whose write-back competes with HBM
            # cases a little, as in bench_moe.
            reps = 8 if source == "L2" else 1

            def call():
                for _ in range(reps):
                    mod.stream(src, n, per_cta, stage_bytes, stages, PATTERNS.index(pattern), 4096, wrap, *box, side)

            us = bu.time_events(call, iters=15, flush=source == "HBM") / reps
            tbs = n * (per_cta // stage_bytes * stage_bytes) / us / 1e6
            row = dict(source=source, pattern=pattern, sms=n, stages=stages, stage_bytes=stage_bytes, bytes_per_cta=per_cta,
                       us=round(us, 1), tb_per_s=round(tbs, 3), over_copy=round(tbs / copy_tbs, 3),
                       gb_per_s_per_sm=round(tbs * 1000 / n, 1))
            rows.append(row)
            print(f"{source:6} {pattern:10} {n:4d} {per_cta / 2**20:5g} {stages:6d} {stage_bytes // 1024:8d} "
                  f"{stages * stage_bytes // 1024:12d} {us:7.1f} {tbs:6.2f} {tbs / copy_tbs:6.2f} "
                  f"{row['gb_per_s_per_sm']:11.1f}", flush=True)
    if "gemv" in patterns:
        # The FP4 GEMV's wgmma ring at V4-Flash L1 (K 4096: 2048-byte rows, 8 chunks an item of 64 rows): 3 items a CTA
        # on every SM (~50 MB, L1's weights), 8 stages of 16 KB. Which of box shape, swizzle and the small copies keeps
        # the kernel's L1 at ~0.73 of the copy ceiling (2026-11-27 timeline) when a contiguous stream of the same
        # stages does better?
        item_bytes, gemv_cta = 64 * 2048, 3 * 64 * 2048
        print(f"{'gemv':6} {'case':24} {'box rows':>8} {'inner':>5} {'extras':>16} {'stages':>6} {'SMs':>4} {'µs':>7} "
              f"{'TB/s':>6} {'/ copy':>6} {'GB/s per SM':>11}")
        # (name, box rows, box inner bytes, (n_big, big bytes, n_small, small bytes), stages); box rows 0: contiguous
        # 16 KB copies. The kernel's stages (produce_chunks, scale_tiles layouts): MXFP4 L1 two runs of 32 rows (a
        # 512-byte scale piece and 32 row exponents each), L2 one run of 64; NVFP4 a tile a run (two 256-byte scale
        # pieces a tile).
        gemv_cases = [
            ("contiguous", 0, 0, (0, 0, 0, 0), 8),
            ("box16", 16, 256, (0, 0, 0, 0), 8),
            ("box32", 32, 256, (0, 0, 0, 0), 8),
            ("box64", 64, 256, (0, 0, 0, 0), 8),
            ("box64 swz128", 64, 128, (0, 0, 0, 0), 8),
            ("mxfp4 L1 (main)", 32, 256, (2, 512, 2, 32), 8),
            ("mxfp4 L1 no exps", 32, 256, (2, 512, 0, 0), 8),
            ("mxfp4 L1 exps a tile", 16, 256, (4, 256, 4, 16), 8),
            ("mxfp4 L2 (main)", 64, 256, (1, 1024, 1, 64), 8),
            ("mxfp4 L2 no exps", 64, 256, (1, 1024, 0, 0), 8),
            ("nvfp4 (main)", 16, 256, (8, 256, 0, 0), 8),
            ("nvfp4 box64 (nvbox)", 64, 256, (8, 256, 0, 0), 8),
            ("nvfp4 box64 2 pieces", 64, 256, (2, 1024, 0, 0), 8),
            ("nvfp4 box16 4 pieces", 16, 256, (4, 512, 0, 0), 8),
            ("nvfp4 box64 1 piece", 64, 256, (1, 2048, 0, 0), 8),
        ]
        for name, box_rows, box_inner, (n_big, big, n_small, small), stages in gemv_cases:
            extras = n_big | n_small << 4 | (big // 16) << 8 | (small // 16) << 16

            def call():
                if box_rows == 0:
                    mod.stream(src, sms, gemv_cta, 16384, stages, 0, 2048, 0, 0, 0, 0, side)
                else:
                    mod.stream(src, sms, gemv_cta, 16384, stages, 3, 2048, 0, box_rows, box_inner, extras, side)

            us = bu.time_events(call, iters=15, flush=True)
            nbytes = sms * gemv_cta + (sms * gemv_cta // 16384) * (n_big * big + n_small * small)
            tbs = nbytes / us / 1e6
            rows.append(dict(source="HBM", pattern="gemv" if box_rows else "contiguous", case=name, sms=sms,
                             stages=stages, stage_bytes=16384, bytes_per_cta=gemv_cta, box_rows=box_rows,
                             box_inner=box_inner, extras=[n_big, big, n_small, small],
                             items_per_cta=gemv_cta // item_bytes, us=round(us, 1), tb_per_s=round(tbs, 3),
                             over_copy=round(tbs / copy_tbs, 3), gb_per_s_per_sm=round(tbs * 1000 / sms, 1)))
            print(f"{'HBM':6} {name:24} {box_rows or '-':>8} {box_inner or '-':>5} "
                  f"{f'{n_big}x{big}+{n_small}x{small}':>16} {stages:6d} {sms:4d} {us:7.1f} {tbs:6.2f} "
                  f"{tbs / copy_tbs:6.2f} {tbs * 1000 / sms:11.1f}", flush=True)
    if "dynamic" in patterns:
        # 96 tiles of 1 MB (V4-Flash T=1's L1 weights) in units handed out by an atomic counter, against the
        # static walk above (one tile per CTA): does dynamic hand-out end the CTAs together (no tail)?
        counter = torch.zeros(1, dtype=torch.int32, device="cuda")
        base = [0]
        tiles = 96
        print(f"{'dynamic':17} {'SMs':>4} {'unit KB':>7} {'stages':>6} {'µs':>7} {'TB/s':>6} {'/ copy':>6}")
        for n in (96, 132):
            for unit_chunks in (32, 8, 4, 2):
                for stages in (3, 6):
                    def call():
                        mod.dynamic(src, counter, base[0], n, tiles, unit_chunks, stages)
                        base[0] += tiles * (32 // unit_chunks) + n  # each CTA's last claim overshoots once

                    us = bu.time_events(call, iters=15, flush=True)
                    tbs = tiles * (1 << 20) / us / 1e6
                    rows.append(dict(source="HBM", pattern="dynamic", sms=n, stages=stages, stage_bytes=32768,
                                     unit_bytes=unit_chunks * 32768, total_bytes=tiles << 20, us=round(us, 1),
                                     tb_per_s=round(tbs, 3), over_copy=round(tbs / copy_tbs, 3)))
                    print(f"{'HBM tensor units':17} {n:4d} {unit_chunks * 32:7d} {stages:6d} {us:7.1f} {tbs:6.2f} "
                          f"{tbs / copy_tbs:6.2f}", flush=True)
        torch.cuda.synchronize()
        assert counter.item() == base[0], "dynamic units: the claim count does not match (a unit was lost)"
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=props.name, copy_tb_per_s=round(copy_tbs, 3), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
