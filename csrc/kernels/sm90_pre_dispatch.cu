// pre_dispatch: bf16 tokens -> the activation recipe (FP8 or E2M1 + scales) and the routing (ids as int32,
// out-of-range ones clamped, still out of range), in the buffer. One block per token; bit-exact with the CPU
// op (same divisions, same rounding). Clears the error word (bad ids are reported by the fused op's routing).
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "kernels/launch.hpp"
#include "kernels/sm90_common.cuh"

#include <algorithm>

namespace megamoe::kernels {

namespace {

constexpr int kMaxThreads = 1024;
constexpr int kVec = 8;  // bf16 elements per thread per step (one 16-byte load)

template <ActRecipe kRecipe, typename IdxT>
__global__ void __launch_bounds__(kMaxThreads) pre_dispatch_kernel(const __nv_bfloat16* __restrict__ x,
                                                                const IdxT* __restrict__ topk_idx,
                                                                const float* __restrict__ topk_weights,
                                                                uint8_t* __restrict__ buffer,
                                                                layout::BufferLayout l, int rank, int num_tokens) {
  PhaseStamps trace;  // entry, after the dependency wait, end (diagnostic builds only)
  trace.stamp();
  ptx::grid_dependency_wait();
  trace.stamp();
  const int token = blockIdx.x;
  // With peers (a table that holds this buffer: get_symm_buffer), this rank's count and slot ids are also stored into
  // every rank's buffer (recv_count / recv_idx at this rank's index, its own included), which each rank's routing
  // reads after barrier 0: the routing kernel signals barrier 0 after this grid has completed, and its release is
  // cumulative over these stores (the combine's peer stores and barrier 1 work the same way). The peers finished
  // reading the previous call's before this rank's combine passed barrier 1, so nothing here races their reads.
  const int num_ranks = static_cast<int>(l.num_ranks);
  const bool push = num_ranks > 1 && peer_buffer(buffer, l, rank) == buffer;
  if (push && token == 0)
    for (int q = threadIdx.x; q < num_ranks; q += blockDim.x) recv_count(peer_buffer(buffer, l, q), l)[rank] = num_tokens;
  if (token == 0 && threadIdx.x < layout::kNumErrorWords) {
    // The error word describes the bad input of this call only. NOTES: cleared here, not by a memset before
    // the launch: in a graph replay the first kernel started 6.6-9 µs after the memset node (V4-Flash T=1,
    // H200, profile_moe.py --timeline, 2026-11-23). No kernel of this grid records errors (the routing
    // kernel, which runs after this grid has completed, reports this rank's bad ids): nothing races the clear.
    reinterpret_cast<int*>(buffer + l.error_offset)[threadIdx.x] = 0;
    if (threadIdx.x == 0) *reinterpret_cast<int*>(buffer + l.num_tokens_offset) = num_tokens;
  }
  if (token >= num_tokens) return;  // an exited block counts as triggered (launch_dependents below)
  const int hidden = static_cast<int>(l.hidden), top_k = static_cast<int>(l.top_k);

  // ---- routing: ids are stored as int32, those outside [-1, num_experts) clamped so that they stay outside
  // (every reader skips them; the routing kernel reports them in the error word, first one wins)
  // A loop over the slots: the block has min(hidden / 8, 1024) threads rounded up to a warp, below top_k at hidden
  // 128-256 with top_k > 32 (before, slots past the block were never stored there).
  auto stored_id = [&](int64_t slot) {
    const int64_t id = static_cast<int64_t>(topk_idx[slot]);
    return static_cast<int>(id < INT32_MIN ? INT32_MIN : id > INT32_MAX ? INT32_MAX : id);
  };
  for (int j = threadIdx.x; j < top_k; j += blockDim.x) {
    const int64_t slot = int64_t(token) * top_k + j;
    reinterpret_cast<int*>(buffer + l.topk_idx_offset)[slot] = stored_id(slot);
    reinterpret_cast<float*>(buffer + l.topk_weights_offset)[slot] = topk_weights[slot];
  }
  if (threadIdx.x < top_k) __threadfence();  // by the writers only, as before the loop
  // The dependents launch only once every block's ids are stored and fenced: the FP4 GEMV's L1 reads them before its
  // dependency wait to stream its experts' weights while this grid still quantizes (sm90_fp4_gemv.cu); every other
  // reader waits for this grid's end. The first thread of a block to execute launch_dependents triggers for the whole
  // block, hence the barrier. NOTES: the trigger used to follow the wait directly; this order took the T=1 GEMV calls
  // 0.90-0.99x their time (H100 A/B, 2026-11-27, docs/decisions.md: programmatic launch chain).
  __syncthreads();
  ptx::launch_dependents();
  // With peers, the ids into every rank's buffer after the trigger: routing reads them only after barrier 0, which
  // follows this grid's end, and the fence above then waits for local stores only (not for NVLink's).
  if (push)
    for (int j = threadIdx.x; j < top_k; j += blockDim.x) {
      const int64_t slot = int64_t(token) * top_k + j;
      const int stored = stored_id(slot);
      for (int q = 0; q < num_ranks; ++q) recv_idx(peer_buffer(buffer, l, q), l, rank)[slot] = stored;
    }

  // ---- activations
  constexpr int kBlock = kRecipe == ActRecipe::kFP8F32Block128 ? 128 : kRecipe == ActRecipe::kNVFP4 ? 16 : 32;
  constexpr int kLanesPerBlock = kBlock / kVec;
  const __nv_bfloat16* row = x + int64_t(token) * hidden;
  uint8_t* data = buffer + l.x_offset + int64_t(token) * l.token_bytes;
  uint8_t* sf = buffer + l.x_sf_offset + int64_t(token) * l.token_sf_bytes;
  const int num_groups = hidden / kVec;

  float global_scale = 1.0f;
  if constexpr (kRecipe == ActRecipe::kNVFP4) {
    // NOTES: NVFP4 activations carry a per-token float32 scale g = amax_token / (6 * 448), so one
    // extra pass over the (cached) row finds the token's amax first.
    __shared__ float warp_amax[kMaxThreads / 32];
    float amax = 0.0f;
    for (int g = threadIdx.x; g < num_groups; g += blockDim.x) {
      float v[kVec];
      load_bf16x8(row + g * kVec, v);
      amax = abs_max(v, amax);
    }
    amax = warp_reduce_max<32>(amax);
    if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = amax;
    __syncthreads();
    amax = 0.0f;
    for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) amax = max_nan(amax, warp_amax[w]);
    global_scale = nvfp4_global_scale(amax);
    if (threadIdx.x == 0) reinterpret_cast<float*>(buffer + l.x_global_sf_offset)[token] = global_scale;
  }

  // Every thread runs every step (inactive ones with zeros) so the block-amax shuffles stay converged.
  for (int base = 0; base < num_groups; base += blockDim.x) {
    const int g = base + threadIdx.x;
    const bool active = g < num_groups;
    float v[kVec];
    if (active) {
      load_bf16x8(row + g * kVec, v);
    } else {
      for (int i = 0; i < kVec; ++i) v[i] = 0.0f;
    }
    float amax = abs_max(v);
    amax = warp_reduce_max<kLanesPerBlock>(amax);
    if (!active) continue;
    const int blk = g / kLanesPerBlock;
    const bool leader = g % kLanesPerBlock == 0;
    if constexpr (kRecipe == ActRecipe::kFP8F32Block128 || kRecipe == ActRecipe::kFP8UE8M0Block32) {
      float scale = max_nan(amax, kAmaxEps) / kFP8Max;
      if constexpr (kRecipe == ActRecipe::kFP8UE8M0Block32) scale = ceil_pow2(scale);
      store_fp8x8(data + g * kVec, v, scale);
      if (leader) {
        if constexpr (kRecipe == ActRecipe::kFP8F32Block128) reinterpret_cast<float*>(sf)[blk] = scale;
        else sf[blk] = ue8m0_bits(scale);
      }
    } else if constexpr (kRecipe == ActRecipe::kMXFP4) {
      const float scale = ue8m0_block_scale(amax, kE2M1Max);
      store_e2m1x8(data + g * (kVec / 2), v, scale);
      if (leader) sf[blk] = ue8m0_bits(scale);
    } else {
      const __nv_fp8_e4m3 block_sf = nvfp4_block_scale(amax, global_scale);
      const float denom = float(block_sf) * global_scale;
      store_e2m1x8(data + g * (kVec / 2), v, denom);
      if (leader) sf[blk] = block_sf.__x;
    }
  }
  trace.stamp();
  if (threadIdx.x == 0) trace.print("pre_dispatch");
}

template <ActRecipe kRecipe>
void launch_recipe(const void* x, const void* topk_idx, bool is_int64, const float* topk_weights, uint8_t* buffer,
                   const layout::BufferLayout& l, int rank, int num_tokens, cudaStream_t stream) {
  // NOTES: one block per token and one 16-byte group per thread: a decode step is a few tokens, so
  // the whole row is loaded in one round trip instead of a loop of dependent ones.
  const dim3 grid(num_tokens > 0 ? num_tokens : 1);
  const int groups = static_cast<int>(l.hidden / kVec);
  const dim3 block((std::min(groups, kMaxThreads) + 31) / 32 * 32);
  auto* xb = static_cast<const __nv_bfloat16*>(x);
  if (is_int64)
    launch_pdl(pre_dispatch_kernel<kRecipe, int64_t>, grid, block, 0, stream, xb,
               static_cast<const int64_t*>(topk_idx), topk_weights, buffer, l, rank, num_tokens);
  else
    launch_pdl(pre_dispatch_kernel<kRecipe, int32_t>, grid, block, 0, stream, xb,
               static_cast<const int32_t*>(topk_idx), topk_weights, buffer, l, rank, num_tokens);
}

}  // namespace

void launch_pre_dispatch(const void* x, const void* topk_idx, bool topk_idx_is_int64, const float* topk_weights,
                         uint8_t* buffer, const layout::BufferLayout& layout, int rank, int num_tokens,
                         ActRecipe recipe, cudaStream_t stream) {
  switch (recipe) {
    case ActRecipe::kFP8F32Block128:
      launch_recipe<ActRecipe::kFP8F32Block128>(x, topk_idx, topk_idx_is_int64, topk_weights, buffer, layout,
                                                rank, num_tokens, stream);
      break;
    case ActRecipe::kFP8UE8M0Block32:
      launch_recipe<ActRecipe::kFP8UE8M0Block32>(x, topk_idx, topk_idx_is_int64, topk_weights, buffer, layout,
                                                 rank, num_tokens, stream);
      break;
    case ActRecipe::kMXFP4:
      launch_recipe<ActRecipe::kMXFP4>(x, topk_idx, topk_idx_is_int64, topk_weights, buffer, layout, rank,
                                       num_tokens, stream);
      break;
    case ActRecipe::kNVFP4:
      launch_recipe<ActRecipe::kNVFP4>(x, topk_idx, topk_idx_is_int64, topk_weights, buffer, layout, rank,
                                       num_tokens, stream);
      break;
  }
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace megamoe::kernels
