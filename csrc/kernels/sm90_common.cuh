// Device pieces shared by the sm90 kernels: error word, reductions, bit-exact quantization helpers
// (the same arithmetic as megamoe/formats.py and csrc/cpu/quant.cpp).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

#include "megamoe/layout/buffer.hpp"
#include "megamoe/ptx/sm90.cuh"

#define MEGAMOE_CUDA_CHECK(expr)                                                                   \
  do {                                                                                             \
    const cudaError_t err_ = (expr);                                                               \
    if (err_ != cudaSuccess)                                                                       \
      throw std::runtime_error(std::string("megamoe: CUDA error '") + cudaGetErrorString(err_) +   \
                               "' at " __FILE__ ":" + std::to_string(__LINE__) + ": " #expr);      \
  } while (0)

namespace megamoe::kernels {

// Launches with programmatic stream serialization: the kernel may start while its predecessor in the
// stream finishes, so every kernel launched this way calls ptx::grid_dependency_wait() before it reads
// anything a predecessor wrote. Captured into CUDA graphs as programmatic edges.
inline cudaLaunchAttribute cluster_dim_attr(int cluster) {
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = static_cast<unsigned>(cluster);
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  return attr;
}
// `cluster` > 1: thread-block clusters of that many blocks along x (grid.x a multiple of it).
template <typename... KernelArgs, typename... Args>
void launch_pdl_cluster(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem, int cluster,
                        cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  attr[1] = cluster_dim_attr(cluster);
  config.attrs = attr;
  config.numAttrs = cluster > 1 ? 2 : 1;
  MEGAMOE_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}
template <typename... KernelArgs, typename... Args>
void launch_pdl(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                Args&&... args) {
  launch_pdl_cluster(kernel, grid, block, smem, 1, stream, std::forward<Args>(args)...);
}

// Clusters of kCluster blocks of kKernel the current GPU holds at once (a persistent grid's size in clusters).
// NOTES: the count depends on the GPU only, so each device's first query (no sync) serves its later calls.
template <auto kKernel, int kCluster>
int max_active_clusters(dim3 block, size_t smem) {
  static std::atomic<int> per_device[64];
  int device = 0;
  MEGAMOE_CUDA_CHECK(cudaGetDevice(&device));
  int n = per_device[device & 63].load(std::memory_order_relaxed);
  if (n > 0) return n;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(kCluster);
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  cudaLaunchAttribute attr = cluster_dim_attr(kCluster);
  config.attrs = &attr;
  config.numAttrs = 1;
  MEGAMOE_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&n, reinterpret_cast<const void*>(kKernel), &config));
  if (n < 1) throw std::runtime_error("megamoe: no cluster of " + std::to_string(kCluster) + " blocks fits this GPU");
  per_device[device & 63].store(n, std::memory_order_relaxed);
  return n;
}

// Global-timer stamps of one block's phases (diagnostic build only, MEGAMOE_TILE_TRACE; benchmarks/tile_trace.py
// lays them out before the GEMM's tiles): printed at the block's exit as "MMTRACE K <kernel> <block> <ns>...", so
// the launch chain (pre_dispatch -> routing -> gather -> GEMM -> combine) can be read in one timeline. In other
// builds every call is empty and compiles away.
// MEGAMOE_PHASE_TRACE: these stamps only (no GEMM tile records), e.g. benchmarks/ep_trace.py, which reads block 0's;
// kernels of many blocks then print block 0 only (kPhaseTraceAllBlocks: every block under MEGAMOE_TILE_TRACE, whose
// chain table takes each kernel's last end).
#ifdef MEGAMOE_TILE_TRACE
constexpr bool kPhaseTraceAllBlocks = true;
#else
constexpr bool kPhaseTraceAllBlocks = false;
#endif
struct PhaseStamps {
#if defined(MEGAMOE_TILE_TRACE) || defined(MEGAMOE_PHASE_TRACE)
  static constexpr int kMax = 8;
  unsigned long long t[kMax] = {};
  int n = 0;
  __device__ __forceinline__ void stamp() {
    if (n < kMax) t[n++] = ptx::globaltimer_ns();
  }
  __device__ void print(const char* kernel) const {
    printf("MMTRACE K %s %d %d %llu %llu %llu %llu %llu %llu %llu %llu\n", kernel, blockIdx.x, n, t[0], t[1], t[2],
           t[3], t[4], t[5], t[6], t[7]);
  }
#else
  __device__ __forceinline__ void stamp() {}
  __device__ __forceinline__ void print(const char*) const {}
#endif
};

#ifdef MEGAMOE_TILE_TRACE
// Per-CTA tile records of the grouped GEMMs (diagnostic build only: setup.py with
// MEGAMOE_NVCC_DEFINES=MEGAMOE_TILE_TRACE; benchmarks/tile_trace.py reads the lines trace_print writes). A kernel
// keeps the global-timer stamps of its first kTraceTiles tiles in registers / local memory, stores them at exit into
// its own __device__ array, and a one-thread print kernel launched after it (stream order) prints them.
// NOTES: no printf in a GEMM kernel: a function call anywhere in a kernel makes ptxas serialise all its wgmmas
// (C7510; 2026-11-25: every wgmma waited for the previous one in the trace builds until then).
constexpr int kTraceTiles = 8, kTraceMaxCtas = 1024;
__device__ __forceinline__ unsigned trace_smid() {
  unsigned id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}
struct TraceRecord {
  // Producer: the tile claimed, when, when its first weight load was issued (the claim for the end marker), the
  // cycles it waited for free stages and from its first stage to its last issued.
  int producer_n, tile[kTraceTiles];
  unsigned long long claim[kTraceTiles], issue[kTraceTiles];
  long long pwait[kTraceTiles], pspan[kTraceTiles];
  // Consumers: SM, global timer at launch and after the dependency wait, per tile its gemm / expert / n_block /
  // rows, the stamps (start, main loop done, epilogue done), the epilogue phases, the main loop's cycles and the
  // cycles it waited for full stages.
  unsigned sm;
  int consumer_n, info[kTraceTiles][4];
  unsigned long long entry, launch, t[kTraceTiles][3], e[kTraceTiles][4];
  long long c[kTraceTiles][2];
  // The whole walk (every tile, not only the first kTraceTiles), per gemm: tiles, then ns summed over them from
  // the previous tile's end (or the entry) to this tile's first full stage, in the main loop, in each epilogue
  // phase (as e: L1 SwiGLU, amax, quantize, store, count; L2 stage, copies issued, -, -, rest; the wait for the last
  // L2 tile's copies counts in the next tile's first phase); and when the consumers saw the end marker.
  long long walk[2][8];
  unsigned long long exit;
};

// One CTA's record as "MMTRACE P/E/S/C" lines; `b` names the CTA (the FP4 kernels offset L2's by kTraceMaxCtas).
__device__ __forceinline__ void trace_print(const TraceRecord& r, int b) {
  for (int i = 0; i < r.producer_n; ++i)
    printf("MMTRACE P %d %u %d %llu %llu %lld %lld\n", b, r.sm, r.tile[i], r.claim[i], r.issue[i], r.pwait[i],
           r.pspan[i]);
  printf("MMTRACE E %d %u %llu %llu\n", b, r.sm, r.entry, r.launch);
  printf("MMTRACE S %d", b);
  for (int g = 0; g < 2; ++g)
    for (int j = 0; j < 8; ++j) printf(" %lld", r.walk[g][j]);
  printf(" %llu\n", r.exit);
  for (int i = 0; i < r.consumer_n; ++i)
    printf("MMTRACE C %d %u %d %d %d %d %llu %llu %llu %llu %llu %llu %llu %lld %lld\n", b, r.sm, r.info[i][0],
           r.info[i][1], r.info[i][2], r.info[i][3], r.t[i][0], r.t[i][1], r.t[i][2], r.e[i][0], r.e[i][1], r.e[i][2],
           r.e[i][3], r.c[i][0], r.c[i][1]);
}
#endif

// Raises a kernel's dynamic shared-memory limit on the current device, once per (kernel, device): the
// attribute is per device, so one process driving several GPUs needs it on each (a process-wide once flag
// let the second device's launch fail).
template <auto kKernel>
void allow_dynamic_smem(int bytes) {
  static std::atomic<uint64_t> done_devices{0};
  int device = 0;
  MEGAMOE_CUDA_CHECK(cudaGetDevice(&device));
  const uint64_t bit = uint64_t(1) << (device & 63);
  if (done_devices.load(std::memory_order_relaxed) & bit) return;
  MEGAMOE_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  done_devices.fetch_or(bit, std::memory_order_relaxed);
}

constexpr float kFP8Max = 448.0f;
constexpr float kE2M1Max = 6.0f;
constexpr float kAmaxEps = 1e-4f;

// First error wins: the CAS on the code word elects the writer of the other fields.
__device__ __forceinline__ void record_error(uint8_t* buffer, const layout::BufferLayout& l, int code,
                                             int64_t value, int token, int slot) {
  int* err = reinterpret_cast<int*>(buffer + l.error_offset);
  if (atomicCAS(err, 0, code) == 0) {
    err[1] = static_cast<int>(value < INT32_MIN ? INT32_MIN : value > INT32_MAX ? INT32_MAX : value);
    err[2] = token;
    err[3] = slot;
  }
}

// ------------------------------------------------------------------------------------------------
// Expert parallelism: peer buffers and cross-rank barriers over symmetric memory (DESIGN.md §7)
// ------------------------------------------------------------------------------------------------
// Rank r's buffer. With one rank that is this buffer (a plain tensor has no peer table).
__device__ __forceinline__ uint8_t* peer_buffer(uint8_t* buffer, const layout::BufferLayout& l, int r) {
  if (l.num_ranks == 1) return buffer;
  return reinterpret_cast<uint8_t* const*>(buffer + l.peer_ptrs_offset)[r];
}

// With peers: rank r's token count and slot ids as its pre_dispatch pushed them into `buffer` (layout recv_*).
__device__ __forceinline__ int* recv_count(uint8_t* buffer, const layout::BufferLayout& l) {
  return reinterpret_cast<int*>(buffer + l.recv_count_offset);
}
__device__ __forceinline__ int* recv_idx(uint8_t* buffer, const layout::BufferLayout& l, int r) {
  return reinterpret_cast<int*>(buffer + l.recv_idx_offset) + int64_t(r) * l.recv_idx_stride();
}

__device__ __forceinline__ uint32_t* signal_words(uint8_t* buffer, const layout::BufferLayout& l) {
  return reinterpret_cast<uint32_t*>(buffer + l.signal_offset);
}
// The call counter (this rank's, incremented once per call by the routing kernel).
__device__ __forceinline__ uint32_t* epoch_word(uint8_t* buffer, const layout::BufferLayout& l) {
  return signal_words(buffer, l) + 2 * l.num_ranks;
}

constexpr uint64_t kPeerWaitTimeoutNs = 20ull * 1000 * 1000 * 1000;

// Barrier `phase` (0: inputs of this call are in every buffer; 1: every expert output of this call is in
// its owner's combine area) of call `epoch`. Thread q < num_ranks stores the epoch into rank q's slot
// [phase][rank] (release, system scope: this rank's earlier writes, local or remote, become visible
// first), then thread q waits (acquire) until rank q has stored it into this rank's slot [phase][q].
// NOTES: the values only grow, so no flag is ever reset and a replayed CUDA graph stays in step. A wait
// that outlives kPeerWaitTimeoutNs (a peer that never calls) gives up and sets the error word: the
// result is then wrong but the process does not hang. Callers __syncthreads() afterwards.
__device__ __forceinline__ void ep_signal(uint8_t* buffer, const layout::BufferLayout& l, int rank, int phase,
                                          uint32_t epoch) {
  const int q = threadIdx.x;
  if (q < l.num_ranks) {
    __threadfence_system();
    ptx::st_release_sys(signal_words(peer_buffer(buffer, l, q), l) + phase * l.num_ranks + rank, epoch);
  }
}
__device__ __forceinline__ void ep_wait(uint8_t* buffer, const layout::BufferLayout& l, int phase, uint32_t epoch) {
  const int q = threadIdx.x;
  if (q < l.num_ranks) {
    const uint32_t* flag = signal_words(buffer, l) + phase * l.num_ranks + q;
    const uint64_t start = ptx::globaltimer_ns();
    while (static_cast<int32_t>(ptx::ld_acquire_sys(flag) - epoch) < 0) {
      if (ptx::globaltimer_ns() - start > kPeerWaitTimeoutNs) {
        record_error(buffer, l, layout::kErrorTimeout, q, -1, phase);
        break;
      }
      __nanosleep(64);
    }
  }
}

// UE8M0 byte -> 2^(b - 127) (0: 2^-127, a float subnormal; 255: NaN).
__device__ __forceinline__ float ue8m0_float(uint32_t b) {
  return __uint_as_float(b == 255 ? 0x7FC00000u : b == 0 ? 0x00400000u : b << 23);
}

// Four E4M3 values x f (a power of two, so the product rounds once, to nearest even) -> E4M3.
__device__ __forceinline__ uint32_t fold_e4m3x4(uint32_t v, float f) {
  const auto pair = [](uint32_t x) {
    return __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(x), __NV_E4M3)));
  };
  const float2 a = pair(v & 0xFFFF), b = pair(v >> 16);
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a.x * f, a.y * f), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(b.x * f, b.y * f), __NV_SATFINITE, __NV_E4M3);
  return lo | (hi << 16);
}

// One 32-K quarter's word of an FP8 token row folded by d = T - t_q (its scale's distance below the group's largest):
// the word x 2^-d (exact for d = 0; d >= 127 flushes to zero). The gather's fold (fold_fp8_group) and the kernel's
// converters (fold_token_unit, sm90_fp4_grouped_gemm.cuh) both fold through this, so their bits agree.
__device__ __forceinline__ uint32_t fold_quarter_word(uint32_t w, int d) {
  const float f = __uint_as_float(d >= 127 ? 0u : uint32_t(127 - d) << 23);
  return d == 0 ? w : fold_e4m3x4(w, f);
}

// One 128-K group of an FP8 (E4M3, UE8M0 per 32) token row folded for the FP8-wgmma FP4 path: quarter q's values x
// 2^-(T - t_q), T the largest of the four scales, so that one factor 2^(T - 127) per group scales them all (rounded
// where a value falls below E4M3's range relative to T). `in`: the group's 128 bytes in K order; `out`: the same
// bytes in the kernel's E4M3 tile order (16-byte chunk c, word q = quarter q's word c: the wgmma K order, file
// comment of sm90_fp4_grouped_gemm.cuh). Returns T.
__device__ __forceinline__ uint32_t fold_fp8_group(const uint4 (&in)[8], uint32_t scales4, uint4 (&out)[8]) {
  uint32_t t[4], tmax = 0;
#pragma unroll
  for (int q = 0; q < 4; ++q) t[q] = (scales4 >> (8 * q)) & 0xFF, tmax = max(tmax, t[q]);
  uint32_t o[8][4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int d = static_cast<int>(tmax - t[q]);
    const uint32_t w[8] = {in[2 * q].x, in[2 * q].y, in[2 * q].z, in[2 * q].w,
                           in[2 * q + 1].x, in[2 * q + 1].y, in[2 * q + 1].z, in[2 * q + 1].w};
#pragma unroll
    for (int c = 0; c < 8; ++c) o[c][q] = fold_quarter_word(w[c], d);
  }
#pragma unroll
  for (int c = 0; c < 8; ++c) out[c] = make_uint4(o[c][0], o[c][1], o[c][2], o[c][3]);
  return tmax;
}

// ------------------------------------------------------------------------------------------------
// E2M1 -> E4M3 folds (the FP8-wgmma FP4 path: its weight decode and token converters, the gather's and L1's folds)
// ------------------------------------------------------------------------------------------------
// The fold tables: table i holds the E2M1 magnitudes x 2^(kFoldHeadroom - i). E2M1 x 2^d is exact in E4M3 for -8 <= d
// <= 6 (0.5 x 2^-8 is its smallest subnormal, 6 x 2^6 = 384 <= 448), so weights folded relative to their row's largest
// scale times 2^-6 (table row_exp - e_j) are exact while the row's scales span at most 14 binades. Tokens fold
// relative to their group's largest scale (tables from kFoldHeadroom on: 2^-d). Every magnitude rounds to 0 from
// 2^-13 on (the last tables).
constexpr int kFoldHeadroom = 6;
constexpr int kNumFoldTables = kFoldHeadroom + 18;
constexpr int kNumTokenFoldTables = kNumFoldTables - kFoldHeadroom;  // token shifts 0..17

// E4M3 bytes of the 8 E2M1 magnitudes x 2^-d (d >= -kFoldHeadroom), as the two PRMT sources (magnitudes 0-3, 4-7).
__device__ __forceinline__ uint2 make_fold_table(int d) {
  constexpr float kMagnitudes[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float f = __uint_as_float(uint32_t(127 - d) << 23);  // 2^-d, exact
  uint32_t w[2] = {0, 0};
#pragma unroll
  for (int m = 0; m < 8; ++m)
    w[m / 4] |= uint32_t(__nv_cvt_float_to_fp8(kMagnitudes[m] * f, __NV_SATFINITE, __NV_E4M3)) << (8 * (m % 4));
  return make_uint2(w[0], w[1]);
}

// 8 E2M1 codes in checkpoint packing (nibble i = K element i, sign in its bit 3) -> E4M3 bytes of elements
// 0-3 (lo) and 4-7 (hi), magnitudes through the table t; the signs by PRMT's sign-replicate mode (selector
// nibble 8 | byte: 0xFF where that byte's bit 7 is set) over {w, w << 4}, whose bytes carry the odd elements'
// signs in bit 7 and the even elements' in bit 7 after the shift.
__device__ __forceinline__ void e2m1x8_to_e4m3(uint32_t w, uint2 t, uint32_t& lo, uint32_t& hi) {
  const uint32_t x4 = w << 4;
  lo = ptx::prmt(t.x, t.y, w & 0x7777u) | (ptx::prmt(w, x4, 0x9D8Cu) & 0x80808080u);
  hi = ptx::prmt(t.x, t.y, (w >> 16) & 0x7777u) | (ptx::prmt(w, x4, 0xBFAEu) & 0x80808080u);
}

// A register-A FP8 wgmma's fragments of one 128-K group from a lane's 32-K block of two rows, r (wra) and r + 8 (wrb),
// 16 bytes of E2M1 each (word st = the K of k32 step st), E2M1 -> E4M3 by tables ta / tb: a8[st] = {row r K 0-3, row
// r + 8 K 0-3, row r K 4-7, row r + 8 K 4-7} of the lane's 8 K of step st. Shared by the FP8-wgmma tile walk
// (decode_weights_e4m3) and the FP4 GEMV's wgmma forms.
__device__ __forceinline__ void group_a_fragments(uint4 wra, uint4 wrb, uint2 ta, uint2 tb, uint32_t (&a8)[4][4]) {
  const uint32_t wa[4] = {wra.x, wra.y, wra.z, wra.w}, wb[4] = {wrb.x, wrb.y, wrb.z, wrb.w};
#pragma unroll
  for (int st = 0; st < 4; ++st) {
    e2m1x8_to_e4m3(wa[st], ta, a8[st][0], a8[st][2]);
    e2m1x8_to_e4m3(wb[st], tb, a8[st][1], a8[st][3]);
  }
}

// One 32-K quarter of MXFP4 tokens (16 bytes of E2M1 in checkpoint packing: word s = K 8s .. 8s + 7) folded d binades
// below its group's largest scale (the fold tables from kFoldHeadroom on); emit(s, lo, hi) takes the E4M3 bytes of K
// 8s .. + 3 and 8s + 4 .. + 7. Shared by the converters (fold_token_unit) and the upstream fold (launch_fold_mxfp4):
// the same bits.
template <typename Emit>
__device__ __forceinline__ void fold_e2m1_quarter(uint4 raw, const uint2* tables, int d, Emit&& emit) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
  const uint2 tab = tables[kFoldHeadroom + min(d, kNumTokenFoldTables - 1)];
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    uint32_t lo, hi;
    e2m1x8_to_e4m3(w[s], tab, lo, hi);
    emit(s, lo, hi);
  }
}

// One 128-K group of an MXFP4 token row (its 4 quarters of 16 bytes, UE8M0 scale bytes in scales4, quarter q in byte q)
// folded as fold_fp8_group folds FP8 ones: `out` holds the group's E4M3 bytes in the kernel's tile order (chunk 2s /
// 2s + 1, word q: quarter q's K 8s .. + 3 / 8s + 4 .. + 7). Returns T, the largest scale. The gather's fold and
// launch_fold_mxfp4 both fold through this (and the converters through fold_e2m1_quarter): the same bits.
__device__ __forceinline__ uint32_t fold_mxfp4_group(const uint4 (&in)[4], uint32_t scales4, const uint2* tables,
                                                     uint4 (&out)[8]) {
  uint32_t t[4], tmax = 0;
#pragma unroll
  for (int q = 0; q < 4; ++q) t[q] = (scales4 >> (8 * q)) & 0xFF, tmax = max(tmax, t[q]);
  uint32_t lo[4][4], hi[4][4];  // [quarter][step]
#pragma unroll
  for (int q = 0; q < 4; ++q)
    fold_e2m1_quarter(in[q], tables, int(tmax - t[q]), [&](int s, uint32_t a, uint32_t b) { lo[q][s] = a, hi[q][s] = b; });
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    out[2 * s] = make_uint4(lo[0][s], lo[1][s], lo[2][s], lo[3][s]);
    out[2 * s + 1] = make_uint4(hi[0][s], hi[1][s], hi[2][s], hi[3][s]);
  }
  return tmax;
}

// Warp-level folds of one row's 128-K groups through a shared-memory stage of kFoldStageGroups groups (4 KB per warp):
// the warp loads the groups' chunks with coalesced 16-byte loads (a warp instruction covers 512 contiguous bytes), lane
// g folds group base + g, the warp stores the folded chunks coalesced. The gather and the pool fold passes use them.
// NOTES: with a lane loading and storing its own group (lane stride 128 bytes: 32 lines per warp instruction) the
// gather's folds ran 1-5 % slower at T >= 2048 (H100 A/B, 2026-11-27, docs/bench/h100-2026-11-27c-ab-gather-staged-
// folds.json: staged over direct T=8192 0.952-0.988 per replay, 0.961-0.989 in a graph; decode within +-1.5 %).
constexpr int kFoldStageGroups = 32;  // one per lane
// Slot of chunk c (16 bytes) of group g in a warp's stage: g's chunks (8; 4 for E2M1 inputs) rotated by the group's
// 128-byte line of the stage (g, or g / 2 at 4 chunks), so that the eight lanes of a quarter warp reading chunk c of
// their own groups, and those writing consecutive chunks, hit distinct bank quads.
__device__ __forceinline__ int fold_stage_slot(int g, int c, int chunks_per_group) {
  return g * chunks_per_group + ((c ^ (g * chunks_per_group / 8)) & (chunks_per_group - 1));
}
// The warp's coalesced loads of n groups' chunks (kChunks per group) from `from` + kChunks base into the stage.
template <int kChunks>
__device__ __forceinline__ void warp_load_stage(const uint4* from, int base, int n, uint4* stage, int lane) {
  uint4 v[kChunks];
#pragma unroll
  for (int u = 0; u < kChunks; ++u)
    if (32 * u + lane < kChunks * n) v[u] = __ldcg(from + kChunks * base + 32 * u + lane);
#pragma unroll
  for (int u = 0; u < kChunks; ++u) {
    const int i = 32 * u + lane;
    if (i < kChunks * n) stage[fold_stage_slot(i / kChunks, i % kChunks, kChunks)] = v[u];
  }
  __syncwarp();
}
// The warp's stores of the stage's chunk i (of 8 per group) to `to` + 8 base + i, n groups.
__device__ __forceinline__ void warp_store_folded(uint4* to, int base, int n, const uint4* stage, int lane) {
#pragma unroll
  for (int u = 0; u < 8; ++u) {
    const int i = 32 * u + lane;
    if (i < 8 * n) to[8 * base + i] = stage[fold_stage_slot(i / 8, i % 8, 8)];
  }
  __syncwarp();  // the stage is read before the next pass writes it
}
// Groups [base, base + n) (n <= kFoldStageGroups) of an FP8 row, 8 chunks each: from `from` (E4M3 in K order) to `to`
// (fold_fp8_group's tile order). `to` may be `from`: each lane stores exactly the chunks it loaded, after the warp's
// loads of this pass, and passes cover disjoint groups. Lane g < n passes its group's scales4 and gets T.
__device__ __forceinline__ uint32_t warp_fold_fp8_groups(const uint4* from, uint4* to, int base, int n,
                                                         uint32_t scales4, uint4* stage, int lane) {
  warp_load_stage<8>(from, base, n, stage, lane);
  uint32_t tmax = 0;
  if (lane < n) {
    uint4 in[8], out[8];
#pragma unroll
    for (int c = 0; c < 8; ++c) in[c] = stage[fold_stage_slot(lane, c, 8)];
    tmax = fold_fp8_group(in, scales4, out);
#pragma unroll
    for (int c = 0; c < 8; ++c) stage[fold_stage_slot(lane, c, 8)] = out[c];
  }
  __syncwarp();
  warp_store_folded(to, base, n, stage, lane);
  return tmax;
}
// The same for an MXFP4 row: 4 E2M1 chunks per group in (`from`), fold_mxfp4_group's 8 E4M3 chunks out (`to`, a
// separate row).
__device__ __forceinline__ uint32_t warp_fold_mxfp4_groups(const uint4* from, uint4* to, int base, int n,
                                                           uint32_t scales4, const uint2* tables, uint4* stage,
                                                           int lane) {
  warp_load_stage<4>(from, base, n, stage, lane);
  uint4 in[4], out[8];
  if (lane < n) {
#pragma unroll
    for (int q = 0; q < 4; ++q) in[q] = stage[fold_stage_slot(lane, q, 4)];
  }
  __syncwarp();  // every input is read before the outputs (twice as many slots) overwrite the stage
  uint32_t tmax = 0;
  if (lane < n) {
    tmax = fold_mxfp4_group(in, scales4, tables, out);
#pragma unroll
    for (int c = 0; c < 8; ++c) stage[fold_stage_slot(lane, c, 8)] = out[c];
  }
  __syncwarp();
  warp_store_folded(to, base, n, stage, lane);
  return tmax;
}

// Groups [begin, end) of one row, in passes of up to kFoldStageGroups: lane g of a pass folds group base + g
// (warp_fold_mxfp4_groups with kMXFP4, else warp_fold_fp8_groups), scale_word(g) giving its 4 scale bytes, and hands
// its factor 2^(T - 127) to store_factor(g, f). The gather and the pool fold passes run their rows through it.
template <bool kMXFP4, typename ScaleWord, typename StoreFactor>
__device__ __forceinline__ void warp_fold_row(const uint4* from, uint4* to, int begin, int end, ScaleWord&& scale_word,
                                              StoreFactor&& store_factor, const uint2* tables, uint4* stage, int lane) {
  for (int base = begin; base < end; base += kFoldStageGroups) {
    const int n = min(kFoldStageGroups, end - base);
    const uint32_t scales4 = lane < n ? scale_word(base + lane) : 0u;
    uint32_t tmax;
    if constexpr (kMXFP4) tmax = warp_fold_mxfp4_groups(from, to, base, n, scales4, tables, stage, lane);
    else tmax = warp_fold_fp8_groups(from, to, base, n, scales4, stage, lane);
    if (lane < n) store_factor(base + lane, ue8m0_float(tmax));
  }
}

// NOTES: NaN-propagating max / min (PTX max.NaN / min.NaN) for every amax and clamp on a quantization
// path. fmaxf / fminf return the other operand for a NaN (IEEE maxNum): a NaN activation then vanished into
// a finite scale or a clamp bound and the output came out finite, while the reference (torch amax / clamp)
// turns the block's scale into NaN. Found by the extreme-scale GPU test (2026-11-22).
__device__ __forceinline__ float max_nan(float a, float b) {
  float d;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}
__device__ __forceinline__ float min_nan(float a, float b) {
  float d;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}
// max(amax, |v[i]|) over the N values, NaN winning (max_nan).
template <int N>
__device__ __forceinline__ float abs_max(const float (&v)[N], float amax = 0.0f) {
#pragma unroll
  for (int i = 0; i < N; ++i) amax = max_nan(amax, fabsf(v[i]));
  return amax;
}

// One SwiGLU output from the bf16-rounded gate and up values: clamp (when clamp >= 0; NaN propagates), silu(g) x u x
// the top-k weight w, in float32, left to right (megamoe.reference's order): the FP4 GEMV's form, the same operations
// per element as the fragment form below. NOTES: the fragment form calling a scalar form compiled to other SASS (the
// FP8 kernels' 440 instructions fewer, an NVFP4 L1 kernel spilling 4 bytes; nvcc 13.0, 2026-11-26:
// benchmarks/patches/fp4-block128-epilogue-warps-rejected.patch), so the measured kernels keep their own loop.
template <bool kFast>
__device__ __forceinline__ float swiglu_value(float g, float u, float w, float clamp) {
  if (clamp >= 0.0f) {
    g = min_nan(g, clamp);
    u = min_nan(max_nan(u, -clamp), clamp);
  }
  const float silu = kFast ? __fdividef(g, 1.0f + __expf(-g)) : g / (1.0f + expf(-g));
  return silu * u * w;
}

// SwiGLU of a thread's L1 accumulator fragment, in place (DESIGN.md §3): gate[i] <- silu(g) * u * col_w[j(i)] with
// g, u = bf16(gate[i] * f), bf16(up[i] * f), f = col_f[j(i)] when kScaled (FP4: the tokens' dequantization factor),
// clamped when clamp >= 0; j(i) = (i / 4) * 2 + i % 2 is the m64nN fragment's column (token) of register i. It
// processes the first kLive registers only (default: all; the FP8 kernel's narrow tile in a fragment sized for a wide
// last block).
// NOTES: fast_math is branched on once per fragment, not per element: with the branch inside the loop ptxas kept
// each element's chain (two bf16 conversions, ex2, rcp) apart, so their latencies added up: ~2.3 µs of a ~5 µs L1
// epilogue at block_m 64 (tile trace, H100, 2026-11-25). Pairs round to bf16 in one packed conversion.
template <bool kFast, bool kScaled, int kLive, int kRegs, int kCols>
__device__ __forceinline__ void swiglu_fragment_impl(float (&gate)[kRegs], const float (&up)[kRegs],
                                                     const float (&col_w)[kCols], const float (&col_f)[kCols],
                                                     float clamp) {
  static_assert(kRegs % 4 == 0 && kCols == kRegs / 2, "an m64nN accumulator fragment and its columns");
  static_assert(kLive % 4 == 0 && kLive <= kRegs, "whole column groups of the fragment");
#pragma unroll
  for (int i = 0; i < kLive; i += 2) {
    const int j = (i / 4) * 2;  // registers i, i + 1: columns j, j + 1
    const float f0 = kScaled ? col_f[j] : 1.0f, f1 = kScaled ? col_f[j + 1] : 1.0f;
    const __nv_bfloat162 g2 = kScaled ? __floats2bfloat162_rn(gate[i] * f0, gate[i + 1] * f1)
                                      : __floats2bfloat162_rn(gate[i], gate[i + 1]);
    const __nv_bfloat162 u2 = kScaled ? __floats2bfloat162_rn(up[i] * f0, up[i + 1] * f1)
                                      : __floats2bfloat162_rn(up[i], up[i + 1]);
    float g[2] = {__low2float(g2), __high2float(g2)}, u[2] = {__low2float(u2), __high2float(u2)};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (clamp >= 0.0f) {
        g[h] = min_nan(g[h], clamp);
        u[h] = min_nan(max_nan(u[h], -clamp), clamp);
      }
      const float silu = kFast ? __fdividef(g[h], 1.0f + __expf(-g[h])) : g[h] / (1.0f + expf(-g[h]));
      gate[i + h] = silu * u[h] * col_w[j + h];
    }
  }
}
template <bool kScaled, int kLive = -1, int kRegs, int kCols>
__device__ __forceinline__ void swiglu_fragment(float (&gate)[kRegs], const float (&up)[kRegs],
                                                const float (&col_w)[kCols], const float (&col_f)[kCols],
                                                bool fast_math, float clamp) {
  constexpr int kN = kLive < 0 ? kRegs : kLive;
  if (fast_math) swiglu_fragment_impl<true, kScaled, kN>(gate, up, col_w, col_f, clamp);
  else swiglu_fragment_impl<false, kScaled, kN>(gate, up, col_w, col_f, clamp);
}

// Max over groups of kLanes consecutive lanes (kLanes a power of two <= 32); NaN wins.
template <int kLanes>
__device__ __forceinline__ float warp_reduce_max(float v) {
#pragma unroll
  for (int m = kLanes / 2; m >= 1; m /= 2) v = max_nan(v, __shfl_xor_sync(0xffffffffu, v, m));
  return v;
}

__device__ __forceinline__ void load_bf16x8(const __nv_bfloat16* p, float* v) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat16* b = reinterpret_cast<const __nv_bfloat16*>(&raw);
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = __bfloat162float(b[i]);
}

// Positive float -> next power of two, by bits (exponent + 1 when the mantissa is non-zero).
// Exponent 255 (inf, NaN) keeps its magnitude, as megamoe.formats.ceil_pow2 does (NaN stays NaN; was -0).
__device__ __forceinline__ float ceil_pow2(float s) {
  uint32_t bits = __float_as_uint(s);
  uint32_t e = (bits >> 23) & 0xFF;
  if (e == 0xFF) return __uint_as_float(bits & 0x7FFFFFFFu);
  e += (bits & 0x7FFFFF) != 0;
  return __uint_as_float(e << 23);
}
__device__ __forceinline__ uint8_t ue8m0_bits(float pow2) { return (__float_as_uint(pow2) >> 23) & 0xFF; }
// 1 / pow2 for a power of two (ceil_pow2's output), so that x * pow2_reciprocal(s) == x / s bit for bit: for a normal
// s = 2^k with |k| <= 126 the reciprocal 2^-k is exact, and both sides round the same real x * 2^-k once (subnormal
// results included); inf -> 0, NaN -> NaN (as x / inf, x / NaN). The rest (s subnormal or 2^127) returns 1 / s, exact
// unless it overflows (s < 2^-127); ceil_pow2's outputs in the epilogues (>= 1e-4 / 448) are never that small.
// NOTES: the true division's fast path and its slow-path call are ~20 instructions a value, in code that runs once per
// tile (the FP4 L1 epilogue's quantize phase took 1.4-2.1 us per block_m 16 tile: H100 tile trace, 2026-11-26).
__device__ __forceinline__ float pow2_reciprocal(float s) {
  const uint32_t e = (__float_as_uint(s) >> 23) & 0xFF;
  if (e == 0xFF) return (__float_as_uint(s) & 0x7FFFFF) != 0 ? s : 0.0f;
  if (e == 0 || e == 254) return 1.0f / s;
  return __uint_as_float((254u - e) << 23);
}

// Saturating E4M3: equal to clamp(v, ±448) then round for every non-NaN v; NaN stays NaN (0x7F).
__device__ __forceinline__ uint8_t to_fp8(float v) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

// 8 values / scale -> 8 E4M3 bytes (true division: bit-exact with the CPU op).
__device__ __forceinline__ void store_fp8x8(uint8_t* dst, const float* v, float scale) {
  uint32_t lo = 0, hi = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) lo |= uint32_t(to_fp8(v[i] / scale)) << (8 * i);
#pragma unroll
  for (int i = 0; i < 4; ++i) hi |= uint32_t(to_fp8(v[4 + i] / scale)) << (8 * i);
  *reinterpret_cast<uint2*>(dst) = make_uint2(lo, hi);
}

// The UE8M0 recipes' block scale (MXFP4 tokens: code_max 6; FP8 with UE8M0 per 32: 448; the CPU op's,
// csrc/cpu/quant.cpp): the power of two at or above max(amax, eps) / code_max.
__device__ __forceinline__ float ue8m0_block_scale(float amax, float code_max) {
  return ceil_pow2(max_nan(amax, kAmaxEps) / code_max);
}

// NVFP4's recipe (docs/decisions.md; the CPU op's, csrc/cpu/quant.cpp): the row's global scale g = max(amax, eps) /
// (6 x 448), and a 16-value block's scale sf = e4m3(min(amax_blk / (6 g), 448)); codes of v / (sf g) (e2m1x8_word).
__device__ __forceinline__ float nvfp4_global_scale(float row_amax) {
  return max_nan(row_amax, kAmaxEps) / (kE2M1Max * kFP8Max);
}
__device__ __forceinline__ __nv_fp8_e4m3 nvfp4_block_scale(float block_amax, float g) {
  return __nv_fp8_e4m3(min_nan(block_amax / (g * kE2M1Max), kFP8Max));
}
// The same from the block's 16 values (their amax, NaN winning).
__device__ __forceinline__ __nv_fp8_e4m3 nvfp4_block_scale(const float (&v)[16], float g) {
  return nvfp4_block_scale(abs_max(v), g);
}

// N floats (N % 4 == 0, 16-byte aligned) through the L2 cache (written by another grid of the chain).
template <int N>
__device__ __forceinline__ void load_floats_cg(const float* src, float (&v)[N]) {
  static_assert(N % 4 == 0, "whole float4s");
#pragma unroll
  for (int i = 0; i < N / 4; ++i) {
    const float4 x = __ldcg(reinterpret_cast<const float4*>(src) + i);
    v[4 * i] = x.x, v[4 * i + 1] = x.y, v[4 * i + 2] = x.z, v[4 * i + 3] = x.w;
  }
}

// Nearest E2M1 code, ties to even, saturating; sign bit = (x < 0); NaN -> 0.
__device__ __forceinline__ uint32_t e2m1_code(float x) {
  const float m = fabsf(x);
  const uint32_t code = (m > 0.25f) + (m >= 0.75f) + (m > 1.25f) + (m >= 1.75f) + (m > 2.5f) + (m >= 3.5f) +
                        (m > 5.0f);
  return code | (x < 0.0f ? 8u : 0u);
}

// 8 values / scale -> 8 E2M1 codes in a word (low nibble first; true division); a zero scale gives zero codes.
__device__ __forceinline__ uint32_t e2m1x8_word(const float* v, float scale) {
  uint32_t packed = 0;
  if (scale > 0.0f) {
#pragma unroll
    for (int i = 0; i < 8; ++i) packed |= e2m1_code(v[i] / scale) << (4 * i);
  }
  return packed;
}
__device__ __forceinline__ void store_e2m1x8(uint8_t* dst, const float* v, float scale) {
  *reinterpret_cast<uint32_t*>(dst) = e2m1x8_word(v, scale);
}
// e2m1x8_word's codes with fewer divisions. The code depends on the quotient only through its comparisons with the
// seven code boundaries, so it is taken from m = |v x rcp(scale)| (MUFU.RCP, at most 1 ulp off: m lies within 2^-22 of
// the quotient and of its rounding) wherever m (1 - 2^-19) and m (1 + 2^-19) give the same code (then no boundary
// lies near, and the quotient, nonzero and finite there, has v's sign); zeros give code 0 (their quotient is +-0);
// anything else (a boundary within 2^-19, m below 2^-100 or above 2^100, NaN, inf, a flushed reciprocal) takes the
// divisions. docs/models/e2m1_fast_quotient.py checks the argument in float32 (tests/test_models.py: 0 differing codes
// over random, boundary and special values; 249-1,275 without the 2^-19 margin).
// Why: each IEEE division is a branch region of ~12 instructions that the compiler does not interleave; 32 in a row
// made the GEMV's L2 quantization ~8 µs at V4-Flash T=1. Only there: in pre_dispatch (32 registers: the fast form
// spills) and the walk's requantization it read 1.00-1.04x slower (H100 A/B, 2026-11-27, perf-notes 43rd/44th).
__device__ __forceinline__ uint32_t e2m1x8_word_fast(const float* v, float scale) {
  if (!(scale > 0.0f)) return 0;
  const float r = ptx::rcp_approx(scale);
  uint32_t packed = 0;
  bool fast = true;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float m = fabsf(v[i] * r);
    const uint32_t lo = e2m1_code(m * (1.0f - 0x1p-19f)), hi = e2m1_code(m * (1.0f + 0x1p-19f));
    fast &= v[i] == 0.0f || (lo == hi && m >= 0x1p-100f && m <= 0x1p100f);
    packed |= (v[i] == 0.0f ? 0u : lo | (v[i] < 0.0f ? 8u : 0u)) << (4 * i);
  }
  if (fast) return packed;
  return e2m1x8_word(v, scale);
}

// ------------------------------------------------------------------------------------------------
// Grouped-GEMM work tiles (both weight formats): tile -> (expert, token block, weight block)
// ------------------------------------------------------------------------------------------------
struct TileInfo {
  int expert, m_block, n_block, row0, rows;
};
// Tile -> (expert, token block, weight block) for a whole warp (every lane calls it with the same tile; every lane
// gets the result). The tile list is expert-major, token blocks innermost (CTAs running side by side share a weight
// tile, which L2 then serves); an expert's last token block takes the rest of its rows (up to block_m + the routing's
// tail rows, heuristics::fp8_tail_rows). The search narrows the expert range 32-fold per round of 32 parallel loads
// (2 rounds for up to 1,024 experts), then lanes 0-3 load the expert's offsets together: 3 L2 round trips where a
// binary search is ~log2(E) + 2 dependent ones, all before the tile's first weight load. NOTES: FP8 tile trace (H100,
// 2026-11-23): every CTA's first stage was full ~12 µs after its first claim; with this search ~10 µs (the rest is
// the first loads themselves). Model: docs/models/warp_tile_decode.py (tests/test_models.py).
// NOTES: only the producer runs the search: in the FP4 kernel its TMA warp and its scale-copy warp, in the FP8 kernel
// its weight warp. The producer stores the TileInfo in shared memory next to the tile's first stage
// (tile_infos[stage]) before arming that stage's full barrier, whose release/acquire publishes it. The consumer roles
// read it after their wait on that stage; the producer rewrites the slot only once every consumer has released the
// stage. ncu had the consumers of the FP4 kernel spend ~5 % of their time in their own search at each tile start.
__device__ __forceinline__ TileInfo decode_tile_warp(int tile, const int* tile_offset, const int* expert_offset,
                                                     int num_experts, int num_nblocks, int block_m) {
  const int lane = threadIdx.x % 32;
  // The expert is the last e with tile_offset[e] * num_nblocks <= tile (true for a prefix of e: the offsets
  // never decrease, and tile_offset[0] = 0), and it lies in [lo, lo + n).
  int lo = 0, n = num_experts;
  while (n > 1) {
    const int stride = (n + 31) / 32;
    const bool in = lane * stride < n && __ldcg(tile_offset + lo + lane * stride) * num_nblocks <= tile;
    const int below = __popc(__ballot_sync(0xffffffffu, in)) - 1;  // >= 0: lane 0 probes lo
    lo += below * stride;
    n = min(stride, n - below * stride);
  }
  TileInfo t;
  t.expert = lo;
  const int v = lane < 4 ? __ldcg((lane < 2 ? tile_offset : expert_offset) + lo + (lane & 1)) : 0;
  const int first_block = __shfl_sync(0xffffffffu, v, 0), m_blocks = __shfl_sync(0xffffffffu, v, 1) - first_block;
  const int first_row = __shfl_sync(0xffffffffu, v, 2), end_row = __shfl_sync(0xffffffffu, v, 3);
  const int local = tile - first_block * num_nblocks;
  t.n_block = local / m_blocks;  // token blocks innermost
  t.m_block = local % m_blocks;
  t.row0 = first_row + t.m_block * block_m;
  t.rows = t.m_block == m_blocks - 1 ? end_row - t.row0 : min(block_m, end_row - t.row0);
  return t;
}

// The static walks' rotation (FP4 split_unit, FP8 kL1 / kL2 launches; their Params::rotate_rounds): CTA b runs units b,
// b + grid, ... (round r = unit / grid), and round r's units map to its tiles rotated by r, unit r grid + b -> tile
// r grid + (b + r) mod (the round's tiles, `count` in all). Each round keeps its tiles (the blocks a wave shares in
// L2); a CTA no longer takes the same token block of every expert where the grid (132) is a multiple of the experts'
// token-block count (decode_tile_warp: token blocks innermost). Needs unit < count: callers map the units past the
// walk's end to themselves (a remainder by zero otherwise where a rank has no tile).
__device__ __forceinline__ int rotated_tile(int unit, int count) {
  const int grid = static_cast<int>(gridDim.x), r = unit / grid, pos = unit - r * grid;
  const int round_tiles = min(grid, count - r * grid);  // > pos: unit < count
  return r * grid + (pos + r) % round_tiles;
}

// The epilogues' staging tiles in shared memory ([token][outputs], a row of 128 or 512 bytes per token: the FP8 and
// FP4 L1 E4M3 / E2M1 codes, the FP4 L2 bf16 outputs): 16-byte chunk c of token `col`'s row sits at chunk c ^ (col % 8)
// of that row; writers and readers both go through this. (The FP8 L2 stage pads its rows instead: its bulk copies
// need each row contiguous.)
// NOTES: an accumulator fragment store gives a warp's lanes 4 token columns (lane % 4) x 8 consecutive outputs
// (lane / 4); unswizzled, the 4 columns' rows (a multiple of 128 bytes apart) hit the same banks, a 4-way conflict
// on every store. Swizzled, the 4 columns fall into 4 different chunks. The copy-out reads whole rows of chunks, so it
// stays conflict-free.
__host__ __device__ constexpr int staged_chunk(int col, int chunk) { return chunk ^ (col % 8); }
// Element offset of output `row` of token `col` in a staging tile of kRowElems elements per token (16-byte chunks
// of 16 / sizeof(T) elements).
template <typename T, int kRowElems>
__host__ __device__ constexpr int staged_offset(int col, int row) {
  constexpr int kChunk = 16 / sizeof(T);
  static_assert(kRowElems % (8 * kChunk) == 0, "the swizzle permutes 8 chunks");
  return col * kRowElems + staged_chunk(col, row / kChunk) * kChunk + row % kChunk;
}
// The same for bf16 element i of an m64nN accumulator fragment (column 8 (i / 4) + 2 (lane % 4) + i % 2, row
// first_row + lane / 4 + 8 ((i / 2) % 2), first_row a multiple of 16): base = staged_offset(2 (lane % 4), first_row +
// lane / 4), then a constant per i. NOTES: first_row / 8 and 2 (lane % 4) are even and i's parts only set bit 0 of the
// chunk, so the XOR splits; ptxas, computing the offsets per element, spilled 208 bytes in the fused FP8 kernel.
template <int kRowElems>
__host__ __device__ constexpr int staged_fragment_delta(int i) {
  return (8 * (i / 4) + i % 2) * kRowElems + (((i / 2) % 2) ^ (i % 2)) * 8;
}
// Checked at compile time for every lane, warp, 64-row slice and fragment element of the FP4 L2 stage (256 bf16
// outputs per token, up to 64 tokens), against staged_offset; and that the 32 lanes' stores of one
// fragment element touch no bank at two different words (no bank conflict).
template <int kRowElems, int kCols>
constexpr bool staged_fragment_delta_is_exact() {
  for (int slice = 0; slice < kRowElems / 64; ++slice)
    for (int warp = 0; warp < 4; ++warp)
      for (int i = 0; i < kCols / 2; ++i) {
        int bank_word[32] = {};  // word + 1 per bank (0: none yet)
        for (int lane = 0; lane < 32; ++lane) {
          const int first_row = slice * 64 + warp * 16, q = lane % 4;
          const int col = 8 * (i / 4) + 2 * q + i % 2, row = first_row + lane / 4 + 8 * ((i / 2) % 2);
          const int offset = staged_offset<__nv_bfloat16, kRowElems>(col, row);
          if (staged_offset<__nv_bfloat16, kRowElems>(2 * q, first_row + lane / 4) + staged_fragment_delta<kRowElems>(i) !=
              offset)
            return false;
          const int word = offset / 2, bank = word % 32;  // bf16 elements, 4-byte banks
          if (bank_word[bank] != 0 && bank_word[bank] != word + 1) return false;  // two words in one bank: a conflict
          bank_word[bank] = word + 1;
        }
      }
  return true;
}
static_assert(staged_fragment_delta_is_exact<256, 64>(), "staged_fragment_delta or the swizzle is wrong");
static_assert(staged_fragment_delta_is_exact<128, 128>(), "the same for the block_m 128 tile (128 outputs, 128 tokens)");

// L2 epilogue copy-out of the FP4 kernel (the FP8 kernel: bulk_store_combine_row below): the staged bf16 tile
// [block_m][256] of output features goes to
// the combine area of each row's token owner at (token, slot) (staged_offset's layout): local stores, or NVLink stores for a peer. Two
// steps: load_combine_srcs takes the pool_src entries of the rows this thread stores (tile_src: the tile's entries,
// rows [row0, row0 + rows)), store_combine_tile stores.
// NOTES: each thread first loads the pool_src entries of all its rows, then stores: loads interleaved with
// the stores could not be hoisted past them (the stores may alias), so each of the kIters iterations waited
// for its own L2 round trip. ncu (H100, V4-Flash T=8192, 2026-11-23): 12 % of the L2 kernel's stall
// samples sat on that wait. The FP4 kernel loads them at the tile's start at decode.
template <int kBlockM, int kBlockN, int kThreads>
constexpr int combine_tile_iters() {
  return (kBlockM * (kBlockN / 8) + kThreads - 1) / kThreads;  // 16-byte chunks of the tile per thread
}
template <int kBlockM, int kBlockN, int kThreads>
__device__ __forceinline__ void load_combine_srcs(int (&src)[combine_tile_iters<kBlockM, kBlockN, kThreads>()],
                                                  const int* tile_src, int rows, int tid) {
  constexpr int kChunks = kBlockM * (kBlockN / 8);
#pragma unroll
  for (int it = 0; it < combine_tile_iters<kBlockM, kBlockN, kThreads>(); ++it) {
    const int col = (tid + it * kThreads) / (kBlockN / 8);
    src[it] = tid + it * kThreads < kChunks && col < rows ? __ldcg(tile_src + col) : -1;
  }
}
template <int kBlockM, int kBlockN, int kThreads>
__device__ __forceinline__ void store_combine_tile(const int (&src)[combine_tile_iters<kBlockM, kBlockN, kThreads>()],
                                                   const __nv_bfloat16* out_tile, uint8_t* buffer,
                                                   const layout::BufferLayout& l, int n_block, int n, int tid) {
  constexpr int kIters = combine_tile_iters<kBlockM, kBlockN, kThreads>();
  const int rank_slots = static_cast<int>(l.max_tokens_per_rank * l.top_k);
  uint4* dst[kIters];  // with several ranks the owner's buffer is one more load (the peer table)
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int part = (tid + it * kThreads) % (kBlockN / 8);
    dst[it] = nullptr;
    if (src[it] >= 0 && n_block * kBlockN + part * 8 < n) {
      const int src_rank = src[it] / rank_slots;
      auto* combine = reinterpret_cast<__nv_bfloat16*>(peer_buffer(buffer, l, src_rank) + l.combine_offset);
      dst[it] = reinterpret_cast<uint4*>(combine + int64_t(src[it] - src_rank * rank_slots) * l.hidden +
                                         n_block * kBlockN + part * 8);
    }
  }
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int c = tid + it * kThreads, col = c / (kBlockN / 8);
    if (dst[it] != nullptr)
      *dst[it] = reinterpret_cast<const uint4*>(out_tile)[col * (kBlockN / 8) + staged_chunk(col, c % (kBlockN / 8))];
  }
}

// L2 epilogue copy-out by bulk copies (FP8 kernel): the row of token column `col` of a staged bf16 tile (row_smem:
// kBlockN outputs, 16-byte aligned) to the combine area of its token owner at (token, slot) = src (pool_src entry;
// < 0: none), as store_combine_tile places it; one bulk async-group per row, committed by the calling thread, which
// must wait for it (ptx::bulk_wait_group_read) before the row is overwritten.
template <int kBlockN>
__device__ __forceinline__ void bulk_store_combine_row(int src, const void* row_smem, uint8_t* buffer,
                                                       const layout::BufferLayout& l, int n_block, int n) {
  if (src < 0) return;
  const int rank_slots = static_cast<int>(l.max_tokens_per_rank * l.top_k), src_rank = src / rank_slots;
  auto* combine = reinterpret_cast<__nv_bfloat16*>(peer_buffer(buffer, l, src_rank) + l.combine_offset);
  const int cols = min(kBlockN, n - n_block * kBlockN);  // n: a multiple of 128
  ptx::bulk_store(combine + int64_t(src - src_rank * rank_slots) * l.hidden + n_block * kBlockN, row_smem, cols * 2);
  ptx::bulk_commit_group();
}

// L1 epilogue (both weight formats): per-token amax over this warp's 16 rows of an m64nN accumulator
// fragment (registers, then the lanes sharing a column: xor 4, 8, 16); lanes 0-3 store it, one float per
// token column, at out[col].
template <int kBlockM>
__device__ __forceinline__ void store_token_amax(const float* acc, float* out, int lane) {
#pragma unroll
  for (int j = 0; j < kBlockM / 4; ++j) {
    const int i0 = (j / 2) * 4 + (j % 2);
    float m = max_nan(fabsf(acc[i0]), fabsf(acc[i0 + 2]));
    m = max_nan(m, __shfl_xor_sync(0xffffffffu, m, 4));
    m = max_nan(m, __shfl_xor_sync(0xffffffffu, m, 8));
    m = max_nan(m, __shfl_xor_sync(0xffffffffu, m, 16));
    if (lane < 4) out[8 * (j / 2) + 2 * lane + (j % 2)] = m;
  }
}

}  // namespace megamoe::kernels
