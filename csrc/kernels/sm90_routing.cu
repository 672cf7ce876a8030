// Routing (per-expert row lists), gather (token rows grouped by expert) and combine (sum over slots).
// These move routing metadata and token rows; the GEMMs live in sm90_fp8_grouped_gemm.cu.
#include <cuda_bf16.h>

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

// One block: count rows per local expert, scan into row and token-block offsets, then scatter.
// NOTES: rows of one expert land in arbitrary order (atomics); every output element is still computed
// by exactly one tile with a fixed summation order, so results are deterministic.
__global__ void __launch_bounds__(kRoutingThreads) routing_kernel(uint8_t* buffer, layout::BufferLayout l, int rank,
                                                                  int num_tokens, int block_m, int* recv_stats) {
  ptx::grid_dependency_wait();
  ptx::launch_dependents();
  extern __shared__ int smem[];
  const int num_experts = static_cast<int>(l.num_local_experts);
  int* count = smem;
  int* cursor = smem + num_experts;
  const int* ids = reinterpret_cast<const int*>(buffer + l.topk_idx_offset);
  const int num_slots = num_tokens * static_cast<int>(l.top_k);

  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) count[e] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < num_slots; i += blockDim.x) {
    const int e = local_expert(ids[i], l, rank, buffer, i, true);
    if (e >= 0) atomicAdd(&count[e], 1);
  }
  __syncthreads();

  // Exclusive scans of rows and token blocks by warp 0 (each lane owns a contiguous expert range).
  int* expert_count = reinterpret_cast<int*>(buffer + l.expert_count_offset);
  int* expert_offset = reinterpret_cast<int*>(buffer + l.expert_offset_offset);
  int* tile_offset = reinterpret_cast<int*>(buffer + l.tile_offset_offset);
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    const int per_lane = (num_experts + 31) / 32;
    const int begin = min(lane * per_lane, num_experts), end = min(begin + per_lane, num_experts);
    int rows = 0, tiles = 0;
    for (int e = begin; e < end; ++e) rows += count[e], tiles += (count[e] + block_m - 1) / block_m;
    int rows_before = rows, tiles_before = tiles;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int r = __shfl_up_sync(0xffffffffu, rows_before, d), t = __shfl_up_sync(0xffffffffu, tiles_before, d);
      if (lane >= d) rows_before += r, tiles_before += t;
    }
    rows_before -= rows, tiles_before -= tiles;
    for (int e = begin; e < end; ++e) {
      expert_count[e] = count[e];
      expert_offset[e] = rows_before;
      tile_offset[e] = tiles_before;
      cursor[e] = rows_before;
      if (recv_stats != nullptr) recv_stats[e] += count[e];
      rows_before += count[e];
      tiles_before += (count[e] + block_m - 1) / block_m;
    }
    if (lane == 31) expert_offset[num_experts] = rows_before, tile_offset[num_experts] = tiles_before;
  }
  __syncthreads();

  int* pool_src = reinterpret_cast<int*>(buffer + l.pool_src_offset);
  for (int i = threadIdx.x; i < num_slots; i += blockDim.x) {
    const int e = local_expert(ids[i], l, rank, buffer, i, false);
    if (e >= 0) pool_src[atomicAdd(&cursor[e], 1)] = i;
  }
}

// One warp per pool row: the token's packed row (16 bytes a lane), its scales (K-block-major:
// `sf_elems` elements of `sf_elem_bytes` each) and, for NVFP4 activations, its global scale.
__global__ void gather_kernel(uint8_t* buffer, layout::BufferLayout l, int sf_elems, int sf_elem_bytes,
                              bool has_global_sf) {
  ptx::grid_dependency_wait();
  ptx::launch_dependents();
  const int num_rows = reinterpret_cast<const int*>(buffer + l.expert_offset_offset)[l.num_local_experts];
  const int lane = threadIdx.x % 32;
  const int warps = gridDim.x * blockDim.x / 32;
  const int* pool_src = reinterpret_cast<const int*>(buffer + l.pool_src_offset);
  const int top_k = static_cast<int>(l.top_k);
  for (int row = (blockIdx.x * blockDim.x + threadIdx.x) / 32; row < num_rows; row += warps) {
    const int token = pool_src[row] / top_k;
    const uint4* src = reinterpret_cast<const uint4*>(buffer + l.x_offset + int64_t(token) * l.token_bytes);
    uint4* dst = reinterpret_cast<uint4*>(buffer + l.dispatch_x_offset + int64_t(row) * l.token_bytes);
    for (int i = lane; i < l.token_bytes / 16; i += 32) dst[i] = src[i];
    const uint8_t* sf = buffer + l.x_sf_offset + int64_t(token) * l.token_sf_bytes;
    uint8_t* dsf = buffer + l.dispatch_sf_offset;
    for (int j = lane; j < sf_elems; j += 32) {
      if (sf_elem_bytes == 4)
        reinterpret_cast<float*>(dsf)[int64_t(j) * l.pool_rows + row] = reinterpret_cast<const float*>(sf)[j];
      else
        dsf[int64_t(j) * l.pool_rows + row] = sf[j];
    }
    if (has_global_sf && lane == 0)
      reinterpret_cast<float*>(buffer + l.dispatch_global_sf_offset)[row] =
          reinterpret_cast<const float*>(buffer + l.x_global_sf_offset)[token];
  }
}

// Block (token, 1024-channel chunk); 8 channels a thread; slots summed in slot order in float32.
constexpr int kCombineThreads = 128;
__global__ void __launch_bounds__(kCombineThreads) combine_kernel(__nv_bfloat16* y, const uint8_t* buffer,
                                                                  layout::BufferLayout l, int rank) {
  ptx::grid_dependency_wait();
  ptx::launch_dependents();
  const int token = blockIdx.x;
  const int top_k = static_cast<int>(l.top_k), hidden = static_cast<int>(l.hidden);
  const int* ids = reinterpret_cast<const int*>(buffer + l.topk_idx_offset) + token * top_k;
  const __nv_bfloat16* rows =
      reinterpret_cast<const __nv_bfloat16*>(buffer + l.combine_offset) + int64_t(token) * top_k * hidden;
  const int first = rank * static_cast<int>(l.num_local_experts);
  const int c = (blockIdx.y * kCombineThreads + threadIdx.x) * 8;
  if (c < hidden) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll 4
    for (int k = 0; k < top_k; ++k) {
      const int id = ids[k];
      if (id < first || id >= first + l.num_local_experts) continue;  // unused, invalid or remote
      float v[8];
      load_bf16x8(rows + int64_t(k) * hidden + c, v);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] += v[i];
    }
    uint4 out;
    __nv_bfloat16* o = reinterpret_cast<__nv_bfloat16*>(&out);
#pragma unroll
    for (int i = 0; i < 8; ++i) o[i] = __float2bfloat16_rn(acc[i]);
    *reinterpret_cast<uint4*>(y + int64_t(token) * hidden + c) = out;
  }
}

}  // namespace

void launch_routing(uint8_t* buffer, const layout::BufferLayout& layout, int rank, int num_tokens, int block_m,
                    int* recv_stats, cudaStream_t stream) {
  const size_t smem = size_t(layout.num_local_experts) * 2 * sizeof(int);
  launch_pdl(routing_kernel, dim3(1), dim3(kRoutingThreads), smem, stream, buffer, layout, rank, num_tokens, block_m,
             recv_stats);
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
}

void launch_gather(uint8_t* buffer, const layout::BufferLayout& layout, ActRecipe recipe, int num_sms,
                   cudaStream_t stream) {
  // Scale elements per token row of `hidden`, by recipe (docs/decisions.md, "Activation recipes").
  const int h = static_cast<int>(layout.hidden);
  const int sf_elem_bytes = recipe == ActRecipe::kFP8F32Block128 ? 4 : 1;
  const int sf_elems = recipe == ActRecipe::kFP8F32Block128 ? h / 128 : recipe == ActRecipe::kNVFP4 ? h / 16 : h / 32;
  launch_pdl(gather_kernel, dim3(num_sms * 4), dim3(256), 0, stream, buffer, layout, sf_elems, sf_elem_bytes,
             recipe == ActRecipe::kNVFP4);
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
}

void launch_combine(void* y, const uint8_t* buffer, const layout::BufferLayout& layout, int rank, int num_tokens,
                    cudaStream_t stream) {
  if (num_tokens == 0) return;
  const dim3 grid(num_tokens, static_cast<unsigned>((layout.hidden / 8 + kCombineThreads - 1) / kCombineThreads));
  launch_pdl(combine_kernel, grid, dim3(kCombineThreads), 0, stream, static_cast<__nv_bfloat16*>(y), buffer, layout,
             rank);
  MEGAMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace megamoe::kernels
