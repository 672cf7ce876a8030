// Per-rank buffer layout: one uint8 allocation holding the quantized inputs of pre_dispatch, routing
// metadata, the L1 -> L2 intermediate pool and the combine area. Host code sizes and allocates it,
// kernels receive it by value. The layout depends only on (num_experts, num_ranks, max_tokens_per_rank,
// top_k, hidden, intermediate, act_format): one buffer serves every weight format of an act format.
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define MEGAMOE_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define MEGAMOE_HOST_DEVICE inline
#endif

namespace megamoe::layout {

// Error word codes (int32 [4] at error_offset: code, offending value, token, slot).
enum ErrorCode : int32_t {
  kErrorNone = 0,
  kErrorExpertId = 1,     // value: the id
  kErrorTokenCount = 2,   // value: the count (a peer's, in expert parallelism)
  kErrorPeerPointers = 3, // value: the rank; the buffer's peer table does not hold this buffer
  kErrorTimeout = 4,      // value: the peer rank a cross-rank wait gave up on
  kErrorEarlyIds = 5,     // value: the id the FP4 GEMV's L1 read before its dependency wait (slot: which); the call
                          // streamed another expert's weights (an ordering PTX does not promise: docs/decisions.md)
};

constexpr int64_t kAlignment = 128;  // every region starts on a 128-byte boundary (TMA needs 16)
constexpr int64_t kNumErrorWords = 4;
// At most this many ranks: in the EP barriers (ep_signal / ep_wait) thread q of a block signals and waits for rank q,
// and the smallest block that takes part (the combine's) has 128 threads.
constexpr int64_t kMaxRanks = 128;
// The kernels number the pool's rows (rank, token, slot) in int32: num_ranks x max_tokens_per_rank x top_k, rounded up
// to 128 (pool_rows), must stay below 2^31.
constexpr int64_t kMaxPoolRows = (int64_t(1) << 31) - 128;

MEGAMOE_HOST_DEVICE int64_t align_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

struct BufferLayout {
  // --- configuration
  int64_t num_experts = 0, num_ranks = 1, max_tokens_per_rank = 0, top_k = 0, hidden = 0,
          intermediate = 0;
  bool act_fp4 = false;

  // --- derived sizes
  int64_t num_local_experts = 0;
  int64_t token_bytes = 0;        // packed activation bytes per token row of `hidden`
  int64_t token_sf_bytes = 0;     // scale bytes per token row (largest recipe of the act format)
  int64_t pool_rows = 0;          // (token, slot) rows a rank can receive in the worst case
  int64_t pool_row_bytes = 0;     // packed L2 activation bytes per pool row of `intermediate`
  int64_t pool_row_sf_bytes = 0;  // scale bytes per pool row

  // --- byte offsets of each region
  int64_t error_offset = 0;          // int32 [kNumErrorWords]
  int64_t num_tokens_offset = 0;     // int32 [1]: tokens this rank put in (written by pre_dispatch)
  int64_t expert_count_offset = 0;   // int32 [num_local_experts]: pool rows per local expert
  int64_t expert_offset_offset = 0;  // int32 [num_local_experts + 1]: first pool row of each expert
  int64_t tile_offset_offset = 0;    // int32 [num_local_experts + 1]: cumulative token blocks per expert
  int64_t sched_offset = 0;          // int32 [1 + num_local_experts]: the fused FP8 GEMM's next work tile, then
                                     // the L1 tiles finished per local expert (zeroed by routing each call)
  int64_t peer_ptrs_offset = 0;      // int64 [num_ranks]: every rank's buffer address (get_symm_buffer)
  int64_t signal_offset = 0;         // uint32 [2 phases][num_ranks] written by peers, then the call epoch
  int64_t x_offset = 0;              // uint8 [max_tokens_per_rank, token_bytes]
  int64_t x_sf_offset = 0;           // uint8 [max_tokens_per_rank, token_sf_bytes]
  int64_t x_global_sf_offset = 0;    // float32 [max_tokens_per_rank] (NVFP4 activations only)
  int64_t topk_idx_offset = 0;       // int32 [max_tokens_per_rank, top_k]; -1 = unused, outside [-1, E) = bad (skipped, reported)
  int64_t topk_weights_offset = 0;   // float32 [max_tokens_per_rank, top_k]
  // With peers (empty for one rank): what every rank's pre_dispatch pushes into every buffer, so that routing reads
  // it locally after barrier 0 instead of over NVLink (two round trips at decode).
  int64_t recv_count_offset = 0;     // int32 [num_ranks]: each rank's token count
  int64_t recv_idx_offset = 0;       // int32 [num_ranks, recv_idx_stride()]: each rank's slot ids (as topk_idx)
  int64_t pool_src_offset = 0;       // int32 [pool_rows]: (rank * max_tokens + token) * top_k + slot
  int64_t dispatch_x_offset = 0;     // uint8 [pool_rows, token_bytes]: L1 inputs grouped by expert
  int64_t dispatch_sf_offset = 0;    // scales of dispatch_x, K-block-major: [K / block, pool_rows]
  int64_t dispatch_global_sf_offset = 0;  // float32 [pool_rows]
  int64_t dispatch_weight_offset = 0; // float32 [pool_rows]: the row's top-k weight (read by SwiGLU)
  int64_t pool_offset = 0;           // uint8 [pool_rows, pool_row_bytes]: L2 inputs (SwiGLU output)
  int64_t pool_sf_offset = 0;        // scales of pool, K-block-major: [I / block, pool_rows]
  int64_t pool_global_sf_offset = 0; // float32 [pool_rows]
  int64_t combine_offset = 0;        // bf16 [max_tokens_per_rank, top_k, hidden]
  int64_t total_bytes = 0;

  // Ints per rank in recv_idx: its slots rounded up to 128 bytes, so that every rank's ids start 16-byte aligned (the
  // routing kernel reads them with 16-byte loads, as it reads topk_idx).
  MEGAMOE_HOST_DEVICE int64_t recv_idx_stride() const { return align_up(max_tokens_per_rank * top_k, 32); }

  static BufferLayout make(int64_t num_experts, int64_t num_ranks, int64_t max_tokens_per_rank,
                           int64_t top_k, int64_t hidden, int64_t intermediate, bool act_fp4) {
    BufferLayout l;
    l.num_experts = num_experts;
    l.num_ranks = num_ranks;
    l.max_tokens_per_rank = max_tokens_per_rank;
    l.top_k = top_k;
    l.hidden = hidden;
    l.intermediate = intermediate;
    l.act_fp4 = act_fp4;
    l.num_local_experts = num_experts / num_ranks;

    // FP8: E4M3 bytes; scales: float32 per 128 == UE8M0 per 32 == K/32 bytes.
    // FP4: packed E2M1; scales: UE4M3 per 16 (K/16 bytes) covers UE8M0 per 32.
    l.token_bytes = act_fp4 ? hidden / 2 : hidden;
    l.token_sf_bytes = act_fp4 ? hidden / 16 : hidden / 32;
    // NOTES: one row per (token, slot) of every rank: the worst case (all slots of all ranks on this
    // rank's experts) fits, and so do repeated ids within a token: a row index can never leave the pool.
    // Rounded up so K-block-major scale rows stay 16-byte aligned.
    l.pool_rows = align_up(num_ranks * max_tokens_per_rank * top_k, 128);
    l.pool_row_bytes = act_fp4 ? intermediate / 2 : intermediate;
    l.pool_row_sf_bytes = act_fp4 ? intermediate / 16 : intermediate / 32;

    int64_t off = 0;
    auto take = [&](int64_t bytes) {
      const int64_t at = off;
      off = align_up(off + bytes, kAlignment);
      return at;
    };
    l.error_offset = take(kNumErrorWords * 4);
    l.num_tokens_offset = take(4);
    l.expert_count_offset = take(l.num_local_experts * 4);
    l.expert_offset_offset = take((l.num_local_experts + 1) * 4);
    l.tile_offset_offset = take((l.num_local_experts + 1) * 4);
    l.sched_offset = take((l.num_local_experts + 1) * 4);
    l.peer_ptrs_offset = take(num_ranks * 8);
    l.signal_offset = take((2 * num_ranks + 1) * 4);
    l.x_offset = take(max_tokens_per_rank * l.token_bytes);
    l.x_sf_offset = take(max_tokens_per_rank * l.token_sf_bytes);
    l.x_global_sf_offset = take(max_tokens_per_rank * 4);
    l.topk_idx_offset = take(max_tokens_per_rank * top_k * 4);
    l.topk_weights_offset = take(max_tokens_per_rank * top_k * 4);
    l.recv_count_offset = take(num_ranks > 1 ? num_ranks * 4 : 0);
    l.recv_idx_offset = take(num_ranks > 1 ? num_ranks * l.recv_idx_stride() * 4 : 0);
    l.pool_src_offset = take(l.pool_rows * 4);
    l.dispatch_x_offset = take(l.pool_rows * l.token_bytes);
    l.dispatch_sf_offset = take(l.pool_rows * l.token_sf_bytes);
    l.dispatch_global_sf_offset = take(l.pool_rows * 4);
    l.dispatch_weight_offset = take(l.pool_rows * 4);
    l.pool_offset = take(l.pool_rows * l.pool_row_bytes);
    l.pool_sf_offset = take(l.pool_rows * l.pool_row_sf_bytes);
    l.pool_global_sf_offset = take(l.pool_rows * 4);
    l.combine_offset = take(max_tokens_per_rank * top_k * hidden * 2);
    l.total_bytes = off;
    return l;
  }
};

// Order of the fields returned by the `get_buffer_layout` op (megamoe/buffer.py reads them by name).
#define MEGAMOE_BUFFER_LAYOUT_FIELDS(X)                                                        \
  X(total_bytes) X(error_offset) X(num_tokens_offset) X(expert_count_offset)                  \
  X(expert_offset_offset) X(tile_offset_offset) X(sched_offset) X(peer_ptrs_offset) X(signal_offset) X(x_offset) \
  X(x_sf_offset) X(x_global_sf_offset) X(topk_idx_offset) X(topk_weights_offset)              \
  X(recv_count_offset) X(recv_idx_offset)                                                     \
  X(pool_src_offset) X(dispatch_x_offset) X(dispatch_sf_offset) X(dispatch_global_sf_offset)  \
  X(dispatch_weight_offset) X(pool_offset) X(pool_sf_offset) X(pool_global_sf_offset)                \
  X(combine_offset) X(token_bytes) X(token_sf_bytes) X(pool_rows) X(pool_row_bytes)          \
  X(pool_row_sf_bytes) X(num_local_experts)

}  // namespace megamoe::layout
