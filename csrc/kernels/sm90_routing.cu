// Routing (per-expert row lists), gather (token rows grouped by expert) and combine (sum over slots).
// These move routing metadata and token rows; the GEMMs live in sm90_fp8_grouped_gemm.cu.
#include <cuda_bf16.h>

#include <algorithm>

#include "heuristics/sm90.hpp"
#include "kernels/launch.hpp"
#include "kernels/sm90_common.cuh"

namespace megamoe::kernels {

namespace {

constexpr int kRoutingThreads = 1024;

// Returns the local expert of a slot, or -1 when the slot is unused, remote or invalid (invalid ids
// also set the error word: the buffer is never trusted as an address).
__device__ __forceinline__ int local_expert(int id, const layout::BufferLayout& l, int rank, uint8_t* buffer,
                                            int slot_index, bool report) {
  if (id < 0 || id >= l.num_experts) {
    if (report && id != -1)
      record_error(buffer, l, layout::kErrorExpertId, id, slot_index / static_cast<int>(l.top_k),
                   slot_index % static_cast<int>(l.top_k));
    return -1;
  }
  const int local = id - rank * static_cast<int>(l.num_local_experts);
  return local >= 0 && local < l.num_local_experts ? local : -1;
}

// Calls f(i, id) for the first n slot ids of a (possibly remote) rank's topk_idx, or of its row of recv_idx: 16-byte
// loads (each is 128-byte aligned in every rank's buffer), four in flight per thread, the n % 4 tail one id a thread.
// NOTES: over NVLink the loop is bound by load latency, not bandwidth, and the one routing block reads every
// rank's slots twice: 16 ids in flight per thread instead of 4 (scalar loads) for EP prefill (EP=8 audit:
// 393,216 slots per pass at 8 ranks x 8192 tokens).
template <typename F>
__device__ __forceinline__ void for_each_slot(const int* ids, int n, F&& f) {
  constexpr int kUnroll = 4;
  const int n4 = n / 4;
  const int4* ids4 = reinterpret_cast<const int4*>(ids);
  for (int base = 0; base < n4; base += kUnroll * blockDim.x) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * blockDim.x + threadIdx.x;
      v[u] = i < n4 ? __ldcg(ids4 + i) : make_int4(-1, -1, -1, -1);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * blockDim.x + threadIdx.x;
      if (i < n4) f(4 * i, v[u].x), f(4 * i + 1, v[u].y), f(4 * i + 2, v[u].z), f(4 * i + 3, v[u].w);
    }
  }
  for (int i = 4 * n4 + threadIdx.x; i < n; i += blockDim.x) f(i, __ldcg(ids + i));
}

// The count pass keeps each slot's local expert (int16) in shared memory for the scatter pass, for ranks whose
// slots fit here (all of them up to 2,730 tokens per rank at top-6 on one rank): one read of the ids, local or
// over NVLink, instead of two.
constexpr int kRoutingCachedSlots = 16384;
constexpr int kRoutingMaxSmem = 227 * 1024 - 1024;  // what a block may have, less the kernel's static shared memory

// Shared memory of the routing block: count and cursor per local expert, tokens and cached-slot base per rank
// (ints), then the slot cache: as many slots as the call can have, at most kRoutingCachedSlots, none when local
// experts do not fit in int16, and fewer where the experts' counters leave less than 160 KB.
struct RoutingSmem {
  int64_t int_bytes, cached_slots;
  explicit RoutingSmem(const layout::BufferLayout& l) {
    int_bytes = (2 * l.num_local_experts + 2 * l.num_ranks) * int64_t(sizeof(int));
    const int64_t room = std::max<int64_t>(0, (160 * 1024 - int_bytes) / int64_t(sizeof(int16_t)));
    cached_slots = l.num_local_experts <= INT16_MAX
                       ? std::min({l.num_ranks * l.max_tokens_per_rank * l.top_k, int64_t(kRoutingCachedSlots), room})
                       : 0;
  }
  size_t bytes() const { return size_t(int_bytes + cached_slots * int64_t(sizeof(int16_t))); }
};

// One block: (EP) barrier 0, then count rows per local expert over every rank's slots, scan into row
// and token-block offsets, then scatter. Pool rows are global slot indices
// (source rank * max_tokens + token) * top_k + slot.
// NOTES: rows of one expert land in arbitrary order (atomics); every output element is still computed
// by exactly one tile with a fixed summation order, so results are deterministic.
__global__ void __launch_bounds__(kRoutingThreads) routing_kernel(uint8_t* buffer, layout::BufferLayout l, int rank,
                                                                  int num_tokens, int block_m, int tail_rows,
                                                                  int* recv_stats, int cached_slots, bool flat_reads,
                                                                  bool read_pushed) {
  // entry, after the dependency wait, barrier 0 (with peers), the ranks' token counts, counted, scanned, end
  // (diagnostic builds only; the stamps are taken with one rank too)
  PhaseStamps trace;
  trace.stamp();
  int* expert_count = reinterpret_cast<int*>(buffer + l.expert_count_offset);
  int* expert_offset = reinterpret_cast<int*>(buffer + l.expert_offset_offset);
  int* tile_offset = reinterpret_cast<int*>(buffer + l.tile_offset_offset);
  int* sched = reinterpret_cast<int*>(buffer + l.sched_offset);  // the fused FP8 GEMM's counters: fresh per call
  int* pool_src = reinterpret_cast<int*>(buffer + l.pool_src_offset);
  // Hints for the lines this block touches first, issued while the previous kernel still runs (programmatic
  // launch): nothing is read here, so no stale value can be used.
  if (threadIdx.x < 6) {
    const int t = threadIdx.x;
    // (with peers, the pushed counts: routing's first reads after barrier 0)
    ptx::prefetch_l2(t == 0   ? static_cast<const void*>(buffer + (l.num_ranks > 1 ? l.recv_count_offset
                                                                                : l.topk_idx_offset))
                     : t == 1 ? expert_count
                     : t == 2 ? expert_offset
                     : t == 3 ? tile_offset
                     : t == 4 ? sched
                              : pool_src);
  }
  ptx::grid_dependency_wait();
  ptx::launch_dependents();
  trace.stamp();
  extern __shared__ int smem[];
  const int num_experts = static_cast<int>(l.num_local_experts);
  const int num_ranks = static_cast<int>(l.num_ranks);
  const int top_k = static_cast<int>(l.top_k);
  const int rank_slots = static_cast<int>(l.max_tokens_per_rank) * top_k;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int* count = smem;
  int* cursor = smem + num_experts;
  int* rank_tokens = cursor + num_experts;  // [num_ranks]
  int* rank_cache = rank_tokens + num_ranks;  // [num_ranks]: first cache entry of the rank's slots, -1: not cached
  int16_t* cache = reinterpret_cast<int16_t*>(rank_cache + num_ranks);  // [cached_slots]: local expert or -1
  __shared__ bool peers_checked;
  __shared__ int warp_rows[32], warp_tiles[32], carry[2];

  // One rank: no peer table to trust. With peers, thread 0's check reaches every thread through the barrier; each
  // thread keeps it in a register (a shared flag read outside a barrier's order is a race even where the read is
  // dead: racecheck reported the compiler's speculative load of it at one rank, 2026-11-27).
  bool peers_ok = true;
  if (num_ranks > 1) {
    // A buffer whose peer table does not point at itself did not come from get_symm_buffer: no
    // address in that table is trusted. The call then routes nothing and says so in the error word.
    if (threadIdx.x == 0) {
      peers_checked = peer_buffer(buffer, l, rank) == buffer;
      if (!peers_checked) record_error(buffer, l, layout::kErrorPeerPointers, rank, -1, -1);
      else *epoch_word(buffer, l) += 1;
    }
    __syncthreads();
    peers_ok = peers_checked;
    if (peers_ok) {
      const uint32_t epoch = *epoch_word(buffer, l);
      ep_signal(buffer, l, rank, 0, epoch);
      ep_wait(buffer, l, 0, epoch);
    }
    __syncthreads();
  }
  trace.stamp();
  // With peers, every rank's count and slot ids as its pre_dispatch pushed them into this buffer (local loads), or,
  // with read_pushed off (heuristics::ep_read_pushed), from its own buffer over NVLink (a round trip each).
  const bool pushed = read_pushed && num_ranks > 1 && peers_ok;
  auto rank_ids = [&](int r) {
    return pushed ? static_cast<const int*>(recv_idx(buffer, l, r))
                  : reinterpret_cast<const int*>(peer_buffer(buffer, l, r) + l.topk_idx_offset);
  };
  for (int r = threadIdx.x; r < num_ranks; r += blockDim.x) {
    int n = r == rank    ? num_tokens
            : !peers_ok  ? 0
            : pushed     ? __ldcg(recv_count(buffer, l) + r)
                         : __ldcg(reinterpret_cast<const int*>(peer_buffer(buffer, l, r) + l.num_tokens_offset));
    if (n < 0 || n > l.max_tokens_per_rank) {  // a peer's count is never trusted as an address bound
      record_error(buffer, l, layout::kErrorTokenCount, n, -1, r);
      n = n < 0 ? 0 : static_cast<int>(l.max_tokens_per_rank);
    }
    rank_tokens[r] = peers_ok ? n : 0;
  }
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) count[e] = 0;
  if (threadIdx.x < 2) carry[threadIdx.x] = 0;
  __syncthreads();
  trace.stamp();
  if (threadIdx.x == 0) {  // ranks in order, each cached whole or not at all
    int used = 0;
    for (int r = 0; r < num_ranks; ++r) {
      const int n = rank_tokens[r] * top_k;
      rank_cache[r] = used + n <= cached_slots ? used : -1;
      if (rank_cache[r] >= 0) used += n;
    }
  }
  __syncthreads();
  // Count pass: slot i of rank r (id read locally or over NVLink) counted for its local expert, which the cache keeps
  // for the scatter pass. Each rank reports its own tokens' bad ids.
  auto count_slot = [&](int r, int cached_at, int i, int id) {
    const int e = local_expert(id, l, rank, buffer, i, r == rank);
    if (e >= 0) atomicAdd(&count[e], 1);
    if (cached_at >= 0) cache[cached_at + i] = static_cast<int16_t>(e);
  };
  // NOTES: at decode a rank's ids take one load latency (over NVLink ~1-2 us), and read rank after rank they cost
  // one round trip per rank (EP=8: eight in a row; EP=8 audit, 2026-11-26). With peers, where every rank's slots
  // laid end to end fit one pass of the block (kFlatIds scalar ids in flight per thread: 4,096 slots, e.g. 170
  // tokens per rank at EP=4, top-6), the block reads them so: all ranks' ids in flight at once. Else (one rank,
  // larger batches) rank by rank, 16-byte loads. 4 x H200 EP=4 FP8 A/B (2026-11-26, bench_ep --alt-env
  // MEGAMOE_ROUTING_FLAT=0, two runs; docs/bench/h200x4-2026-11-26o-ep4-routing-flat-ab*.json), rank by rank over
  // flat: V4-Flash 1 token per rank 1.067 / 1.081 (a third run, final rule: 1.068), 128 1.032 / 1.028; within the
  // benchmark's spread (rows straddling 1.0): V4-Flash 16 1.036 / 0.949, V4-Pro 1 1.055 / 0.962, V4-Pro 16-128
  // 0.993-1.004. At 512 (three flat passes, then the rule was "fewer passes than ranks") 0.997 / 0.970 and 0.998 /
  // 0.987: one pass only.
  constexpr int kFlatIds = 4;
  int total = 0;
  for (int r = 0; r < num_ranks; ++r) total += rank_tokens[r] * top_k;
  const int per_pass = kFlatIds * static_cast<int>(blockDim.x);
  if (flat_reads && num_ranks > 1 && total <= per_pass) {
    int id[kFlatIds], slot_rank[kFlatIds], slot[kFlatIds];
#pragma unroll
    for (int u = 0; u < kFlatIds; ++u) {
      const int g = u * static_cast<int>(blockDim.x) + static_cast<int>(threadIdx.x);
      int r = 0, first = 0;  // g's rank and its first slot (ranks are few: a walk over shared memory)
      while (r < num_ranks - 1 && g >= first + rank_tokens[r] * top_k) first += rank_tokens[r] * top_k, ++r;
      slot_rank[u] = r, slot[u] = g - first;
      id[u] = g < total ? __ldcg(rank_ids(r) + slot[u])
                        : -1;
    }
#pragma unroll
    for (int u = 0; u < kFlatIds; ++u)
      if (u * static_cast<int>(blockDim.x) + static_cast<int>(threadIdx.x) < total)
        count_slot(slot_rank[u], rank_cache[slot_rank[u]], slot[u], id[u]);
  } else {
    for (int r = 0; r < num_ranks; ++r) {
      const int* ids = rank_ids(r);
      const int cached_at = rank_cache[r];
      for_each_slot(ids, rank_tokens[r] * top_k, [&](int i, int id) { count_slot(r, cached_at, i, id); });
    }
  }
  __syncthreads();
  trace.stamp();

  // Exclusive scans of rows and token blocks over the experts, a thread per expert (chunks of blockDim): warp
  // scans, then warp 0 over the warp totals; each expert's words are stored by its own thread (coalesced).
  for (int base = 0; base < num_experts; base += blockDim.x) {
    const int e = base + threadIdx.x;
    // Token blocks of block_m rows; the last may hold tail_rows more (heuristics::fp8_tail_rows; decode_tile_warp).
    const int c = e < num_experts ? count[e] : 0, t = c == 0 ? 0 : (max(c - tail_rows, 1) + block_m - 1) / block_m;
    int rows = c, tiles = t;  // inclusive within the warp
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int r = __shfl_up_sync(0xffffffffu, rows, d), u = __shfl_up_sync(0xffffffffu, tiles, d);
      if (lane >= d) rows += r, tiles += u;
    }
    if (lane == 31) warp_rows[warp] = rows, warp_tiles[warp] = tiles;
    __syncthreads();
    if (warp == 0) {
      const int nw = static_cast<int>(blockDim.x / 32);
      int wr = lane < nw ? warp_rows[lane] : 0, wt = lane < nw ? warp_tiles[lane] : 0;
      const int own_r = wr, own_t = wt;
#pragma unroll
      for (int d = 1; d < 32; d *= 2) {
        const int r = __shfl_up_sync(0xffffffffu, wr, d), u = __shfl_up_sync(0xffffffffu, wt, d);
        if (lane >= d) wr += r, wt += u;
      }
      if (lane < nw) warp_rows[lane] = carry[0] + wr - own_r, warp_tiles[lane] = carry[1] + wt - own_t;
    }
    __syncthreads();
    const int rows_before = warp_rows[warp] + rows - c, tiles_before = warp_tiles[warp] + tiles - t;
    if (e < num_experts) {
      expert_count[e] = c;
      expert_offset[e] = rows_before;
      tile_offset[e] = tiles_before;
      sched[1 + e] = 0;
      cursor[e] = rows_before;
      if (recv_stats != nullptr) recv_stats[e] += c;
      if (e == num_experts - 1)
        expert_offset[num_experts] = rows_before + c, tile_offset[num_experts] = tiles_before + t, sched[0] = 0;
    }
    __syncthreads();  // every thread has read warp_rows / carry
    if (threadIdx.x == blockDim.x - 1) carry[0] = rows_before + c, carry[1] = tiles_before + t;
  }
  __syncthreads();
  trace.stamp();

  for (int r = 0; r < num_ranks; ++r) {
    const int n = rank_tokens[r] * top_k, cached_at = rank_cache[r];
    if (cached_at >= 0) {
      for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const int e = cache[cached_at + i];
        if (e >= 0) pool_src[atomicAdd(&cursor[e], 1)] = r * rank_slots + i;
      }
    } else {
      const int* ids = rank_ids(r);
      for_each_slot(ids, n, [&](int i, int id) {
        const int e = local_expert(id, l, rank, buffer, i, false);
        if (e >= 0) pool_src[atomicAdd(&cursor[e], 1)] = r * rank_slots + i;
      });
    }
  }
  trace.stamp();
  if (threadIdx.x == 0) trace.print("routing");
}

constexpr int kSfPerLane = 4;  // scale elements a lane loads with its row (FP8: 1; MXFP4 tokens: <= 4)

// One warp per pool row: the token's packed row (16 bytes a lane), its scales (K-block-major:
// `sf_elems` elements of `sf_elem_bytes` each), its top-k weight and, for NVFP4 activations, its global
// scale, read from the buffer of the rank that owns the token (NVLink loads for a peer).
// kFold (tokens for the FP8-wgmma FP4 path): each 128-K group is folded to one scale as it is copied, E4M3 values
// in the kernel's tile order, then float factors [k / 128, pool_rows], so that the L1 GEMM multiplies the rows as they
// land, with no conversion of its own. FP8 tokens (kFoldFP8: fold_fp8_group) in place of the rows and their UE8M0
// bytes; MXFP4 tokens (kFoldMXFP4: fold_e2m1_quarter, the converters' fold) into E4M3 rows of `hidden` bytes at
// fold_dst and factors at fold_factors (the packed rows and their scales are not copied).
// The folding builds hold a group's words in and out per lane: 2 blocks per SM (128 registers), not 4.
// The folding builds move a row through a per-warp shared-memory stage (warp_fold_fp8_groups / warp_fold_mxfp4_groups,
// sm90_common.cuh: coalesced loads and stores). NOTES: at EP=4 decode a peer's row took 6-10 µs in the folding gather
// with or without the stage, against ~3 µs as a plain copy (ep_trace.py, 4 x H100, 2026-11-27): not the load pattern
// (the fold's arithmetic or its build's occupancy; not separated).
constexpr int kGatherThreads = 256;
enum GatherFold : int { kGatherCopy = 0, kFoldFP8 = 1, kFoldMXFP4 = 2 };
template <int kFold>
__global__ void __launch_bounds__(kGatherThreads, kFold != kGatherCopy ? 2 : 4)
    gather_kernel(uint8_t* buffer, layout::BufferLayout l, int sf_elems, int sf_elem_bytes, bool has_global_sf,
                  int* zero_words, int num_zero_words, uint8_t* fold_dst, float* fold_factors) {
  constexpr bool fold = kFold != kGatherCopy;
  __shared__ uint2 tables[kFold == kFoldMXFP4 ? kNumFoldTables : 1];
  __shared__ uint4 stage_all[fold ? kGatherThreads / 32 : 1][fold ? 8 * kFoldStageGroups : 1];
  uint4* stage = stage_all[fold ? threadIdx.x / 32 : 0];
  if constexpr (kFold == kFoldMXFP4) {
    if (threadIdx.x < kNumFoldTables) tables[threadIdx.x] = make_fold_table(threadIdx.x - kFoldHeadroom);
    __syncthreads();
  }
  // entry, after the dependency wait, the row count read, the block's first row stored (if it has one), end
  // (diagnostic builds only)
  PhaseStamps trace;
  trace.stamp();
  {  // hints for this block's first lines (see routing_kernel), while the routing kernel runs
    const int64_t first = int64_t(blockIdx.x) * blockDim.x / 32;  // never past the pool: a hint stays in the buffer
    if (threadIdx.x == 0 && first < l.pool_rows) ptx::prefetch_l2(buffer + l.pool_src_offset + first * sizeof(int));
    if (threadIdx.x == 1 && first < l.pool_rows) ptx::prefetch_l2(buffer + l.dispatch_x_offset + first * l.token_bytes);
    if (threadIdx.x == 2) ptx::prefetch_l2(buffer + l.x_offset);
  }
  ptx::grid_dependency_wait();
  ptx::launch_dependents();
  trace.stamp();
  // The FP4 GEMMs' split-K counters (launch_gather's caller): zero before the GEMMs, which wait for this grid.
  if (blockIdx.x == 0)
    for (int i = threadIdx.x; i < num_zero_words; i += blockDim.x) zero_words[i] = 0;
  const int num_rows = __ldcg(reinterpret_cast<const int*>(buffer + l.expert_offset_offset) + l.num_local_experts);
  trace.stamp();
  const int lane = threadIdx.x % 32;
  const int warps = gridDim.x * blockDim.x / 32;
  const int* pool_src = reinterpret_cast<const int*>(buffer + l.pool_src_offset);
  const int rank_slots = static_cast<int>(l.max_tokens_per_rank * l.top_k);
  const int top_k = static_cast<int>(l.top_k);
  const int chunks = static_cast<int>(l.token_bytes / 16);
  // A warp per item: a row, or in the folding gathers, where the rows' passes of up to kFoldStageGroups 128-K groups
  // fit the grid's warps at once (decode), a row's pass: its passes run side by side instead of one after the other.
  // Either way each group is folded by the same code, so the bits do not depend on the split.
  // NOTES: V4-Pro (56 groups: 2 passes) MXFP4 w4a8 T=1 on one warp per row: the folding gather's one row took 13.7 us
  // in a graph replay against 2.8 for FP8's copy (ep_trace.py, H100, 2026-11-27), ncu of the gather alone 9.8 against
  // 7.7 us: each dependent round trip waits behind L1's early weight loads (without them the gather ended 6 us
  // sooner; docs/perf-notes.md, thirty-eighth session).
  const int groups = kFold == kFoldFP8 ? chunks / 8 : chunks / 4;  // 128-K groups per row (the folds)
  const int row_passes = fold ? (groups + kFoldStageGroups - 1) / kFoldStageGroups : 1;
  const int passes = num_rows * row_passes <= warps ? row_passes : 1;  // items per row
  const int num_items = num_rows * passes;
  const int first = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  int src = first < num_items ? __ldcg(pool_src + first / passes) : 0;
  for (int item = first; item < num_items; item += warps) {
    const int row = item / passes, pass = item - row * passes;
    // The item's groups [group_begin, group_end): one pass of the row, or all of them.
    const int group_begin = pass * kFoldStageGroups;
    const int group_end = passes == 1 ? groups : min(groups, group_begin + kFoldStageGroups);
    // The next item's source is loaded under this item's copy: one round trip per item, not two.
    const int next_src = item + warps < num_items ? __ldcg(pool_src + (item + warps) / passes) : 0;
    const int src_rank = src / rank_slots, slot = src - src_rank * rank_slots, token = slot / top_k;
    const uint8_t* peer = peer_buffer(buffer, l, src_rank);
    const uint4* from = reinterpret_cast<const uint4*>(peer + l.x_offset + int64_t(token) * l.token_bytes);
    uint4* to = reinterpret_cast<uint4*>(buffer + l.dispatch_x_offset + int64_t(row) * l.token_bytes);
    const uint8_t* sf = peer + l.x_sf_offset + int64_t(token) * l.token_sf_bytes;
    uint8_t* dsf = buffer + l.dispatch_sf_offset;
    // Every load of a lane first (row chunks, the first kSfPerLane scale elements, the top-k weight), then the
    // stores: a row, local or remote, costs one round trip.
    uint32_t sfv[kSfPerLane];
    if constexpr (!fold) {
#pragma unroll
      for (int u = 0; u < kSfPerLane; ++u) {
        const int j = lane + 32 * u;
        if (j < sf_elems) sfv[u] = sf_elem_bytes == 4 ? __ldcg(reinterpret_cast<const uint32_t*>(sf) + j) : sf[j];
      }
    }
    float weight = 0.f, global_sf = 0.f;
    if (lane == 0 && pass == 0) {  // one item of a row stores them
      weight = __ldcg(reinterpret_cast<const float*>(peer + l.topk_weights_offset) + slot);
      if (has_global_sf) global_sf = __ldcg(reinterpret_cast<const float*>(peer + l.x_global_sf_offset) + token);
    }
    // The folds: passes of up to 32 groups, lane g folding group base + g (its scale bytes: one word of the token's
    // row of them).
    auto scale_word = [&](int g) { return __ldcg(reinterpret_cast<const uint32_t*>(sf) + g); };
    if constexpr (kFold == kFoldFP8) {
      warp_fold_row<false>(
          from, to, group_begin, group_end, scale_word,
          [&](int g, float f) { reinterpret_cast<float*>(dsf)[int64_t(g) * l.pool_rows + row] = f; }, nullptr, stage,
          lane);
    } else if constexpr (kFold == kFoldMXFP4) {
      // Into the E4M3 rows of `hidden` bytes at fold_dst (the packed rows and their scales are not copied).
      uint4* folded = reinterpret_cast<uint4*>(fold_dst + int64_t(row) * l.hidden);
      warp_fold_row<true>(
          from, folded, group_begin, group_end, scale_word,
          [&](int g, float f) { fold_factors[int64_t(g) * l.pool_rows + row] = f; }, tables, stage, lane);
    } else {
      constexpr int kMaxChunksPerLane = 8;  // hidden <= 8 * 32 * 16 bytes = 4096 FP8 per pass
      for (int c0 = 0; c0 < chunks; c0 += 32 * kMaxChunksPerLane) {
        uint4 v[kMaxChunksPerLane];
#pragma unroll
        for (int u = 0; u < kMaxChunksPerLane; ++u) {
          const int i = c0 + u * 32 + lane;
          if (i < chunks) v[u] = __ldcg(from + i);
        }
#pragma unroll
        for (int u = 0; u < kMaxChunksPerLane; ++u) {
          const int i = c0 + u * 32 + lane;
          if (i < chunks) to[i] = v[u];
        }
      }
#pragma unroll
      for (int u = 0; u < kSfPerLane; ++u) {
        const int j = lane + 32 * u;
        if (j >= sf_elems) continue;
        if (sf_elem_bytes == 4)
          reinterpret_cast<uint32_t*>(dsf)[int64_t(j) * l.pool_rows + row] = sfv[u];
        else
          dsf[int64_t(j) * l.pool_rows + row] = static_cast<uint8_t>(sfv[u]);
      }
      for (int j = lane + 32 * kSfPerLane; j < sf_elems; j += 32) {  // NVFP4 tokens past 2048 channels
        if (sf_elem_bytes == 4)
          reinterpret_cast<float*>(dsf)[int64_t(j) * l.pool_rows + row] =
              __ldcg(reinterpret_cast<const float*>(sf) + j);
        else
          dsf[int64_t(j) * l.pool_rows + row] = sf[j];
      }
    }
    if (lane == 0 && pass == 0) {
      reinterpret_cast<float*>(buffer + l.dispatch_weight_offset)[row] = weight;
      if (has_global_sf) reinterpret_cast<float*>(buffer + l.dispatch_global_sf_offset)[row] = global_sf;
    }
    src = next_src;
    if (item == first) trace.stamp();
  }
  trace.stamp();
  if (threadIdx.x == 0 && (kPhaseTraceAllBlocks || blockIdx.x == 0)) trace.print("gather");
}

// Blocks (token stride, 1024-channel chunk); 8 channels a thread; slots summed in slot order in float32.
// Every valid slot's row is in this rank's combine area: written by the rank that owns its expert.
// NOTES (EP): block (0, 0) signals barrier 1 (this rank's expert outputs of this call are all written:
// the L2 grid has completed) and every block waits for all ranks'. The grid is at most what the SMs hold at
// once (occupancy query at launch), so every block is resident once the L2 grid has left and the wait
// cannot starve block (0, 0).
constexpr int kCombineThreads = 128;
static_assert(kCombineThreads >= layout::kMaxRanks && kRoutingThreads >= layout::kMaxRanks,
              "ep_signal / ep_wait: a thread of the block per rank");
constexpr int kCombineSlots = 8;  // slots of a token whose rows are loaded together (any top_k: in chunks)
__global__ void __launch_bounds__(kCombineThreads) combine_kernel(__nv_bfloat16* y, uint8_t* buffer,
                                                                  layout::BufferLayout l, int rank, int num_tokens) {
  PhaseStamps trace;  // entry, after the dependency wait, barrier 1 (with peers), end (diagnostic builds only)
  trace.stamp();
  const int top_k = static_cast<int>(l.top_k), hidden = static_cast<int>(l.hidden);
  const int c = (blockIdx.y * kCombineThreads + threadIdx.x) * 8;
  const int* topk_idx = reinterpret_cast<const int*>(buffer + l.topk_idx_offset);
  // The block's first token's first kCombineSlots ids, loaded before the dependency wait: pre_dispatch wrote them,
  // and every kernel of the chain (routing, gather, the GEMMs, the NVFP4 requantization) triggers its dependents
  // only after its own wait, so this grid runs only once pre_dispatch has completed; the next call's pre_dispatch
  // writes only after this grid has completed. NOTES: at decode that takes one of the combine's two round trips off
  // the chain after the GEMM.
  int first_ids[kCombineSlots];
#pragma unroll
  for (int u = 0; u < kCombineSlots; ++u)
    first_ids[u] = c < hidden && int(blockIdx.x) < num_tokens && u < top_k
                       ? __ldcg(topk_idx + int64_t(blockIdx.x) * top_k + u) : -1;
  ptx::grid_dependency_wait();
  ptx::launch_dependents();
  trace.stamp();
  bool zero = false;  // the peer table is not this call's symmetric buffer: routing produced no row
  if (l.num_ranks > 1) {
    // The routing kernel's test, not the error word: an earlier error of this call (or of an earlier call, when
    // the fused op runs twice after one pre_dispatch) may hold the word, and a zeroed table must never be used.
    zero = peer_buffer(buffer, l, rank) != buffer;
    if (!zero) {
      const uint32_t epoch = __ldcg(epoch_word(buffer, l));
      if (blockIdx.x == 0 && blockIdx.y == 0) ep_signal(buffer, l, rank, 1, epoch);
      ep_wait(buffer, l, 1, epoch);
      __syncthreads();
    }
  }
  trace.stamp();
  if (c >= hidden) return;
  for (int token = blockIdx.x; token < num_tokens; token += gridDim.x) {
    const int* ids = topk_idx + int64_t(token) * top_k;
    const __nv_bfloat16* rows =
        reinterpret_cast<const __nv_bfloat16*>(buffer + l.combine_offset) + int64_t(token) * top_k * hidden;
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    // A chunk's ids first, then all its valid rows' loads, then the sums: two memory round trips per chunk of
    // kCombineSlots slots, where a loop over slots with a branch on each id waited for each id and row in turn.
    for (int k0 = 0; k0 < top_k; k0 += kCombineSlots) {
      const bool preloaded = token == int(blockIdx.x) && k0 == 0;
      bool valid[kCombineSlots];
#pragma unroll
      for (int u = 0; u < kCombineSlots; ++u) {
        const int id = preloaded ? first_ids[u] : k0 + u < top_k ? __ldcg(ids + k0 + u) : -1;
        valid[u] = !zero && id >= 0 && id < l.num_experts;  // unused or invalid: never an address
      }
      uint4 raw[kCombineSlots];
#pragma unroll
      for (int u = 0; u < kCombineSlots; ++u)
        if (valid[u]) raw[u] = __ldcg(reinterpret_cast<const uint4*>(rows + int64_t(k0 + u) * hidden + c));
#pragma unroll
      for (int u = 0; u < kCombineSlots; ++u) {  // slot order, as the reference sums
        if (!valid[u]) continue;
        const __nv_bfloat16* b = reinterpret_cast<const __nv_bfloat16*>(&raw[u]);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] += __bfloat162float(b[i]);
      }
    }
    uint4 out;
    __nv_bfloat16* o = reinterpret_cast<__nv_bfloat16*>(&out);
#pragma unroll
    for (int i = 0; i < 8; ++i) o[i] = __float2bfloat16_rn(acc[i]);
    *reinterpret_cast<uint4*>(y + int64_t(token) * hidden + c) = out;
  }
  trace.stamp();
  if (threadIdx.x == 0 && blockIdx.y == 0) trace.print("combine");
}

}  // namespace

void launch_routing(uint8_t* buffer, const layout::BufferLayout& layout, int rank, int num_tokens, int block_m,
                    int* recv_stats, cudaStream_t stream, int tail_rows) {
  const RoutingSmem smem(layout);
  // The limit is set once per device (allow_dynamic_smem), so to what any layout may ask, not to this call's size.
  allow_dynamic_smem<routing_kernel>(kRoutingMaxSmem);
  launch_pdl(routing_kernel, dim3(1), dim3(kRoutingThreads), smem.bytes(), stream, buffer, layout, rank, num_tokens,
             block_m, tail_rows, recv_stats, static_cast<int>(smem.cached_slots), heuristics::routing_flat_reads(),
             heuristics::ep_read_pushed());
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
}

void launch_gather(uint8_t* buffer, const layout::BufferLayout& layout, ActRecipe recipe, int num_sms,
                   cudaStream_t stream, int* zero_words, int num_zero_words, bool fold, uint8_t* fold_dst,
                   float* fold_factors) {
  if (fold && ((recipe != ActRecipe::kFP8UE8M0Block32 && recipe != ActRecipe::kMXFP4) || layout.hidden % 128 != 0))
    throw std::runtime_error("megamoe: the gather folds FP8 or MXFP4 tokens with UE8M0 scales per 32 only");
  if (fold && recipe == ActRecipe::kMXFP4 && (fold_dst == nullptr || fold_factors == nullptr))
    throw std::runtime_error("megamoe: the gather's MXFP4 fold needs its destination rows and factors");
  // Scale elements per token row of `hidden`, by recipe (docs/decisions.md, "Activation recipes").
  const int h = static_cast<int>(layout.hidden);
  const int sf_elem_bytes = recipe == ActRecipe::kFP8F32Block128 ? 4 : 1;
  const int sf_elems = recipe == ActRecipe::kFP8F32Block128 ? h / 128 : recipe == ActRecipe::kNVFP4 ? h / 16 : h / 32;
  if (fold && recipe == ActRecipe::kMXFP4)
    launch_pdl(gather_kernel<kFoldMXFP4>, dim3(num_sms * 2), dim3(kGatherThreads), 0, stream, buffer, layout,
               sf_elems, sf_elem_bytes, false, zero_words, num_zero_words, fold_dst, fold_factors);
  else if (fold)
    launch_pdl(gather_kernel<kFoldFP8>, dim3(num_sms * 2), dim3(kGatherThreads), 0, stream, buffer, layout, sf_elems,
               sf_elem_bytes, false, zero_words, num_zero_words, fold_dst, fold_factors);
  else
    launch_pdl(gather_kernel<kGatherCopy>, dim3(num_sms * 4), dim3(kGatherThreads), 0, stream, buffer, layout,
               sf_elems, sf_elem_bytes, recipe == ActRecipe::kNVFP4, zero_words, num_zero_words, fold_dst,
               fold_factors);
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
}

void launch_combine(void* y, uint8_t* buffer, const layout::BufferLayout& layout, int rank, int num_tokens,
                    int num_sms, cudaStream_t stream) {
  // One rank with no tokens has nothing to do; with peers it still takes part in barrier 1.
  if (num_tokens == 0 && layout.num_ranks == 1) return;
  // As many blocks as fit on the device at once (with peers every block must be resident for barrier 1): at
  // one block per SM the prefill combine ran at ~55 % of the copy rate, its loads waiting on latency.
  static const int resident_per_sm = [] {
    int n = 0;
    MEGAMOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, combine_kernel, kCombineThreads, 0));
    return n < 1 ? 1 : n;
  }();
  const int blocks_y = static_cast<int>((layout.hidden / 8 + kCombineThreads - 1) / kCombineThreads);
  const int max_x = std::max(1, num_sms * resident_per_sm / blocks_y);
  const unsigned blocks_x = static_cast<unsigned>(std::clamp(num_tokens, 1, max_x));
  const dim3 grid(blocks_x, static_cast<unsigned>(blocks_y));
  launch_pdl(combine_kernel, grid, dim3(kCombineThreads), 0, stream, static_cast<__nv_bfloat16*>(y), buffer, layout,
             rank, num_tokens);
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace megamoe::kernels
