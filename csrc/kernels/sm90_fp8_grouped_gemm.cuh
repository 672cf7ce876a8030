// Grouped FP8 block-scaled GEMM for Hopper: one persistent launch walks (expert, token block, 256
// weight rows) tiles. Weights are the wgmma A operand (64-row slices, "swap AB"), so a decode step
// with a handful of tokens per expert still fills the 64-row MMA dimension with weights.
//
// Warp roles (384 threads): warpgroup 0 = producer (thread 0: TMA of the weight and token tiles; warp 1:
// cp.async of the stage's block scales into shared memory), warpgroups 1-2 = consumers, each owning 128
// weight rows = two 64-row slices. In L1 the slices are a gate chunk and its up chunk
// (transform_weights interleaves them), so SwiGLU happens in registers.
//
// Per 128-K block: 4 wgmma k32 steps into a fresh partial accumulator, then promotion
// acc += partial * weight_scale(64-row chunk, k block) * token_scale(token, k block) in float32.
// NOTES: promoting once per scale block (as DeepGEMM does) also bounds the error of Hopper's
// reduced-precision FP8 accumulation (~14 bits after alignment, DeepSeek-V3 report).
// NOTES: the scales of a stage arrive with it (producer warp 1, cp.async completing on the stage's full
// barrier), so promotion reads shared memory. Before, each consumer thread loaded its 2 + block_m / 4
// scales from global memory at the top of the stage (~130 L2 requests per stage and SM at block_m 64), and
// promotion waited for them: the T=1 profile had 44 % of the L1 kernel's stall samples on that wait.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "kernels/launch.hpp"
#include "kernels/sm90_common.cuh"
#include "megamoe/ptx/sm90.cuh"

namespace megamoe::kernels {

constexpr int kBlockN = 256;           // weight rows per tile
constexpr int kBlockK = 128;           // K per stage (one scale block, one 128-byte swizzle row)
constexpr int kNumThreads = 384;
constexpr int kNumConsumerThreads = 256;

struct GemmParams {
  const float* weights_sf;  // [E, n / 64, k / 128]
  const float* acts_sf;     // [k / 128, pool_rows] (K-block-major: a K block's token scales are contiguous)
  uint8_t* buffer;
  layout::BufferLayout l;
  int n, k;
  float activation_clamp;  // < 0: none
  bool fast_math;
};

template <int kBlockM, int kNumStages, bool kIsL1>
struct GemmSmem {
  static constexpr int kTileA = kBlockN * kBlockK;       // bytes
  static constexpr int kTileB = kBlockM * kBlockK;       // bytes
  static constexpr int kEpilogue = kIsL1 ? kBlockM * 128 + 8 * kBlockM * 4 : kBlockM * kBlockN * 2;
  // Scales of one stage (float32): the tile's four 64-row weight chunks, then its kBlockM token columns.
  static constexpr int kScales = (kBlockN / 64 + kBlockM) * 4;
  static_assert(kScales % 16 == 0 && kEpilogue % 16 == 0, "scale slots must stay 16-byte aligned");
  static constexpr int kBytes = 1024 /* alignment slack */ + kNumStages * (kTileA + kTileB) + kEpilogue +
                                2 * kNumStages * 8 + kNumStages * int(sizeof(TileInfo)) + kNumStages * kScales;
};

template <int kBlockM, int kNumStages, bool kIsL1>
__global__ void __launch_bounds__(kNumThreads, 1)
    sm90_fp8_grouped_gemm_kernel(const __grid_constant__ CUtensorMap tmap_weights,
                                 const __grid_constant__ CUtensorMap tmap_acts, GemmParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Smem = GemmSmem<kBlockM, kNumStages, kIsL1>;
  using Mma = ptx::WgmmaFP8<kBlockM>;
  constexpr int kRegs = Mma::kNumRegs;
  static_assert(kBlockM % 8 == 0 && kBlockM <= 64, "token block must be a multiple of 8, at most 64");

  extern __shared__ uint8_t smem_raw[];
  // 128B-swizzled TMA tiles need 1024-byte alignment.
  // Offset arithmetic on the __shared__ array (not an integer round trip) keeps the address space known to
  // the compiler: shared-memory loads and stores (LDS/STS), not generic ones (LD/ST, long-scoreboard waits).
  uint8_t* smem = smem_raw + ((1024 - (ptx::smem_addr(smem_raw) & 1023)) & 1023);
  uint8_t* tile_a = smem;
  uint8_t* tile_b = tile_a + kNumStages * Smem::kTileA;
  uint8_t* epilogue = tile_b + kNumStages * Smem::kTileB;
  // [kNumStages][Smem::kScales / 4]; each stage's slot is 16-byte aligned (kScales and kEpilogue are multiples
  // of 16), so token-scale pairs load as float2.
  float* stage_scales = reinterpret_cast<float*>(epilogue + Smem::kEpilogue);
  uint64_t* full = reinterpret_cast<uint64_t*>(stage_scales + kNumStages * (Smem::kScales / 4));
  uint64_t* empty = full + kNumStages;
  TileInfo* tile_infos = reinterpret_cast<TileInfo*>(empty + kNumStages);  // [kNumStages], see TileInfo

  const int warpgroup = threadIdx.x / 128;
  const int lane = threadIdx.x % 32;
  const auto& l = p.l;
  const int num_experts = static_cast<int>(l.num_local_experts);
  const int* tile_offset = reinterpret_cast<const int*>(p.buffer + l.tile_offset_offset);
  const int* expert_offset = reinterpret_cast<const int*>(p.buffer + l.expert_offset_offset);
  const int num_nblocks = (p.n + kBlockN - 1) / kBlockN;
  const int num_kblocks = p.k / kBlockK;
  // NOTES: routing metadata (tile_offset, expert_offset) is final before this grid launches: the
  // predecessor allows the launch only after its own dependency wait, which follows the routing kernel.
  // Reads bypass L1 (__ldcg) so no line cached by an earlier kernel on this SM can be stale.
  const int num_tiles = __ldcg(tile_offset + num_experts) * num_nblocks;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kNumStages; ++s) {
      ptx::mbarrier_init(&full[s], 1 + 32);  // TMA thread + the 32 scale-copy lanes
      ptx::mbarrier_init(&empty[s], kNumConsumerThreads / 32);
    }
    ptx::fence_barrier_init();
  }
  __syncthreads();

  if (warpgroup == 0) {
    // ======================================================================== producer
    ptx::setmaxnreg_dec<40>();
    if (threadIdx.x == 0) {
      ptx::prefetch_tensormap(&tmap_weights);
      ptx::prefetch_tensormap(&tmap_acts);
      // NOTES: weights depend on no earlier kernel, so the first kNumStages weight tiles load before the
      // dependency wait (overlapping the predecessor's tail); their token tiles load after it.
      int pending_row[kNumStages], pending_kb[kNumStages];
      int issued = 0;
      bool waited = false;
      auto finish_wait = [&] {
        ptx::grid_dependency_wait();
        ptx::launch_dependents();
        for (int s = 0; s < issued && s < kNumStages; ++s)
          ptx::tma_load_2d(tile_b + s * Smem::kTileB, &tmap_acts, &full[s], pending_kb[s] * kBlockK, pending_row[s]);
        waited = true;
      };
      int stage = 0;
      uint32_t phase = 0;
      for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
        const TileInfo t = decode_tile(tile, tile_offset, expert_offset, num_experts, num_nblocks, kBlockM);
        const int weight_row = t.expert * p.n + t.n_block * kBlockN;
        for (int kb = 0; kb < num_kblocks; ++kb) {
          if (!waited && issued == kNumStages) finish_wait();
          ptx::mbarrier_wait(&empty[stage], phase ^ 1);
          if (kb == 0) tile_infos[stage] = t;
          ptx::mbarrier_arrive_expect_tx(&full[stage], Smem::kTileA + Smem::kTileB);
          ptx::tma_load_2d(tile_a + stage * Smem::kTileA, &tmap_weights, &full[stage], kb * kBlockK, weight_row);
          if (waited) {
            ptx::tma_load_2d(tile_b + stage * Smem::kTileB, &tmap_acts, &full[stage], kb * kBlockK, t.row0);
          } else {
            pending_row[issued] = t.row0;
            pending_kb[issued] = kb;
          }
          ++issued;
          if (++stage == kNumStages) stage = 0, phase ^= 1;
        }
      }
      if (!waited) finish_wait();
    } else if (threadIdx.x / 32 == 1) {
      // Block scales of each stage: weight chunk c of the tile (lanes 0-3; chunks past n are never read) and
      // the token columns [row0, row0 + kBlockM) of the K-block-major token scales (columns past the pool
      // end are never stored; their slots keep old values).
      // The token scales come from the grid before this one: wait for it as the TMA thread does.
      ptx::grid_dependency_wait();
      int stage = 0;
      uint32_t phase = 0;
      for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
        const TileInfo t = decode_tile(tile, tile_offset, expert_offset, num_experts, num_nblocks, kBlockM);
        const int first_chunk = (t.expert * p.n + t.n_block * kBlockN) / 64;
        const bool chunk_valid = lane < kBlockN / 64 && t.n_block * kBlockN + lane * 64 < p.n;
        for (int kb = 0; kb < num_kblocks; ++kb) {
          ptx::mbarrier_wait(&empty[stage], phase ^ 1);
          float* dst = stage_scales + stage * (Smem::kScales / 4);
          if (chunk_valid) ptx::cp_async_4(dst + lane, p.weights_sf + int64_t(first_chunk + lane) * num_kblocks + kb);
          const float* src = p.acts_sf + int64_t(kb) * l.pool_rows + t.row0;
#pragma unroll
          for (int c = lane; c < kBlockM; c += 32)
            if (t.row0 + c < l.pool_rows) ptx::cp_async_4(dst + kBlockN / 64 + c, src + c);
          ptx::cp_async_mbarrier_arrive_noinc(&full[stage]);
          if (++stage == kNumStages) stage = 0, phase ^= 1;
        }
      }
      ptx::cp_async_wait_all();
    }
    return;
  }

  // ========================================================================== consumers
  ptx::setmaxnreg_inc<232>();
  ptx::grid_dependency_wait();  // token tiles, scales and routing rows come from earlier kernels
  ptx::launch_dependents();
  const int consumer = warpgroup - 1;                 // owns weight rows [128 c, 128 c + 128) of the tile
  const int warp = (threadIdx.x / 32) % 4;            // warp within the warpgroup
  const int ctid = threadIdx.x - 128;                 // 0..255 over both consumers
  const int quad_row = warp * 16 + lane / 4;          // this thread's first row in a 64-row slice
  int stage = 0;
  uint32_t phase = 0;
  const uint32_t tile_a_desc_lo = ptx::smem_desc_sw128_lo(tile_a), tile_b_desc_lo = ptx::smem_desc_sw128_lo(tile_b);

  for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    ptx::mbarrier_wait(&full[stage], phase);  // the tile's first stage carries its TileInfo
    const TileInfo t = tile_infos[stage];
    // NOTES: n (= hidden in L2) is a multiple of 128, not always of 256: the last tile's upper half
    // then lies past this expert's rows; its scales are never read and its rows never stored.
    const int first_row = t.n_block * kBlockN + consumer * 128;
    const bool valid0 = first_row < p.n, valid1 = first_row + 64 < p.n;

    float acc0[kRegs], acc1[kRegs];
#pragma unroll
    for (int i = 0; i < kRegs; ++i) acc0[i] = 0.0f, acc1[i] = 0.0f;

    for (int kb = 0; kb < num_kblocks; ++kb) {
      ptx::mbarrier_wait(&full[stage], phase);
      // Scales of this stage from shared memory (read before the stage is released): this consumer's two
      // weight chunks (0 past n: those rows are never stored) and this thread's token columns.
      const float* sc = stage_scales + stage * (Smem::kScales / 4);
      const float ws0 = valid0 ? sc[consumer * 2] : 0.0f, ws1 = valid1 ? sc[consumer * 2 + 1] : 0.0f;
      float col_sf[kBlockM / 4];
#pragma unroll
      for (int j = 0; j < kBlockM / 8; ++j) {
        const float2 v = *reinterpret_cast<const float2*>(sc + kBlockN / 64 + 8 * j + 2 * (lane % 4));
        col_sf[2 * j] = v.x, col_sf[2 * j + 1] = v.y;
      }
      const uint32_t a_lo = tile_a_desc_lo + (stage * Smem::kTileA + consumer * 128 * kBlockK) / 16;
      const uint32_t b_lo = tile_b_desc_lo + stage * (Smem::kTileB / 16);
      float part0[kRegs], part1[kRegs];
#pragma unroll
      for (int i = 0; i < kRegs; ++i) ptx::fence_operand(part0[i]), ptx::fence_operand(part1[i]);
      // NOTES: the two slices are separate commit groups, so slice 0's promotion runs while slice 1's
      // wgmmas are still in the tensor pipe (ncu, V4-Flash T=8192 L1: 14 % of all stall samples were
      // consumers waiting on one wait_group for both). Each accumulator keeps its k order: same bits.
      ptx::wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kBlockK / 32; ++ks)
        Mma::run(part0, ptx::smem_desc_sw128(a_lo + ks * 2), ptx::smem_desc_sw128(b_lo + ks * 2), ks > 0);
      ptx::wgmma_commit();
#pragma unroll
      for (int ks = 0; ks < kBlockK / 32; ++ks)
        Mma::run(part1, ptx::smem_desc_sw128(a_lo + (64 * kBlockK + ks * 32) / 16), ptx::smem_desc_sw128(b_lo + ks * 2),
                 ks > 0);
      ptx::wgmma_commit();

      // Promotion. Fragment layout of m64nN: register 4j + {0,1} -> (row r, cols 8j + 2(lane%4) + {0,1}),
      // 4j + {2,3} -> (row r + 8, same cols).
      ptx::wgmma_wait<1>();
#pragma unroll
      for (int i = 0; i < kRegs; ++i) ptx::fence_operand(part0[i]);
#pragma unroll
      for (int i = 0; i < kRegs; ++i) acc0[i] += part0[i] * (ws0 * col_sf[(i / 4) * 2 + (i % 2)]);
      ptx::wgmma_wait<0>();
#pragma unroll
      for (int i = 0; i < kRegs; ++i) ptx::fence_operand(part1[i]);
      __syncwarp();
      if (lane == 0) ptx::mbarrier_arrive(&empty[stage]);
      if (++stage == kNumStages) stage = 0, phase ^= 1;
#pragma unroll
      for (int i = 0; i < kRegs; ++i) acc1[i] += part1[i] * (ws1 * col_sf[(i / 4) * 2 + (i % 2)]);
    }

    // ======================================================================== epilogue
    if constexpr (kIsL1) {
      // SwiGLU in registers: acc0 = gate rows, acc1 = the matching up rows.
      float* amax_smem = reinterpret_cast<float*>(epilogue + kBlockM * 128);  // [8 warps][kBlockM]
      const float* row_weight = reinterpret_cast<const float*>(p.buffer + l.dispatch_weight_offset);
      float col_w[kBlockM / 4];
#pragma unroll
      for (int j = 0; j < kBlockM / 4; ++j) {
        const int col = 8 * (j / 2) + 2 * (lane % 4) + (j % 2);
        col_w[j] = col < t.rows ? row_weight[t.row0 + col] : 0.0f;
      }
#pragma unroll
      for (int i = 0; i < kRegs; ++i) {
        float g = __bfloat162float(__float2bfloat16_rn(acc0[i]));
        float u = __bfloat162float(__float2bfloat16_rn(acc1[i]));
        if (p.activation_clamp >= 0.0f) {
          g = min_nan(g, p.activation_clamp);
          u = min_nan(max_nan(u, -p.activation_clamp), p.activation_clamp);
        }
        const float silu = p.fast_math ? __fdividef(g, 1.0f + __expf(-g)) : g / (1.0f + expf(-g));
        acc0[i] = silu * u * col_w[(i / 4) * 2 + (i % 2)];
      }
      // Per-token amax over this tile's 128 outputs (= one L2 scale block): registers, then lanes
      // sharing a column (xor 4, 8, 16), then the 8 consumer warps through shared memory.
      store_token_amax<kBlockM>(acc0, amax_smem + (consumer * 4 + warp) * kBlockM, lane);
      ptx::named_barrier_sync(1, kNumConsumerThreads);
      uint8_t* out_tile = epilogue;  // [kBlockM tokens][128 outputs] E4M3
      float* pool_sf = reinterpret_cast<float*>(p.buffer + l.pool_sf_offset);
#pragma unroll
      for (int j = 0; j < kBlockM / 4; ++j) {
        const int col = 8 * (j / 2) + 2 * (lane % 4) + (j % 2);
        float amax = 0.0f;
#pragma unroll
        for (int w = 0; w < 8; ++w) amax = max_nan(amax, amax_smem[w * kBlockM + col]);
        const float scale = max_nan(amax, kAmaxEps) / kFP8Max;
        const int i0 = (j / 2) * 4 + (j % 2);
        const int out = consumer * 64 + quad_row;
        const float inv = 1.0f / scale;
        const float v0 = p.fast_math ? acc0[i0] * inv : acc0[i0] / scale;
        const float v1 = p.fast_math ? acc0[i0 + 2] * inv : acc0[i0 + 2] / scale;
        out_tile[col * 128 + out] = to_fp8(v0);
        out_tile[col * 128 + out + 8] = to_fp8(v1);
        if (consumer == 0 && warp == 0 && lane < 4 && col < t.rows)
          pool_sf[int64_t(t.n_block) * l.pool_rows + t.row0 + col] = scale;
      }
      ptx::named_barrier_sync(1, kNumConsumerThreads);
      // Coalesced copy-out: 8 x 16 bytes per token row.
      const int inter = p.n / 2;
      for (int c = ctid; c < kBlockM * 8; c += kNumConsumerThreads) {
        const int col = c / 8, part = c % 8;
        if (col < t.rows)
          *reinterpret_cast<uint4*>(p.buffer + l.pool_offset + int64_t(t.row0 + col) * inter + t.n_block * 128 +
                                    part * 16) = reinterpret_cast<const uint4*>(out_tile)[c];
      }
      ptx::named_barrier_sync(1, kNumConsumerThreads);
    } else {
      // L2: bf16 rows into the combine area of the token's rank at (token, slot) (NVLink stores for a peer).
      __nv_bfloat16* out_tile = reinterpret_cast<__nv_bfloat16*>(epilogue);  // [kBlockM][256]
#pragma unroll
      for (int i = 0; i < kRegs; ++i) {
        const int col = 8 * (i / 4) + 2 * (lane % 4) + (i % 2);
        const int row = consumer * 128 + quad_row + ((i / 2) % 2) * 8;
        out_tile[col * kBlockN + row] = __float2bfloat16_rn(acc0[i]);
        out_tile[col * kBlockN + row + 64] = __float2bfloat16_rn(acc1[i]);
      }
      ptx::named_barrier_sync(1, kNumConsumerThreads);
      store_combine_tile<kBlockM, kBlockN, kNumConsumerThreads>(out_tile, p.buffer, l, t.row0, t.rows, t.n_block, p.n,
                                                               ctid);
      ptx::named_barrier_sync(1, kNumConsumerThreads);
    }
  }
#else
  __trap();  // built for a GPU without wgmma: the host never launches this
#endif
}

}  // namespace megamoe::kernels
