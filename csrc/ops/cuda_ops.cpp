// CUDA registrations: validation (shared with CPU), arch and feature checks, then the sm90 kernels.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "heuristics/sm90.hpp"
#include "ops/cuda_utils.hpp"
#include "kernels/launch.hpp"
#include "ops/ops.hpp"

namespace megamoe {

void pre_dispatch_cuda_op(const at::Tensor& x, const at::Tensor& topk_idx, const at::Tensor& topk_weights,
                          at::Tensor& buffer, int64_t num_experts, int64_t num_ranks, int64_t rank,
                          int64_t max_tokens_per_rank, int64_t top_k, int64_t intermediate,
                          c10::string_view weight_format, c10::string_view act_format) {
  const auto a = check_pre_dispatch(x, topk_idx, topk_weights, buffer, num_experts, num_ranks, rank,
                                    max_tokens_per_rank, top_k, intermediate, weight_format, act_format);
  check_arch(x, "pre_dispatch");
  const c10::cuda::CUDAGuard guard(x.device());
  kernels::launch_pre_dispatch(x.data_ptr(), topk_idx.data_ptr(), topk_idx.scalar_type() == at::kLong,
                               topk_weights.data_ptr<float>(), buffer_ptr(buffer), a.buf.layout,
                               static_cast<int>(a.buf.rank), static_cast<int>(x.size(0)), a.recipe,
                               c10::cuda::getCurrentCUDAStream());
}

namespace {

void fp8_mega_moe_cuda(at::Tensor& y, const at::Tensor& l1_weights, const at::Tensor& l1_weights_sf,
                       const at::Tensor& l2_weights, const at::Tensor& l2_weights_sf, at::Tensor& buffer,
                       int64_t num_experts, int64_t num_ranks, int64_t rank, int64_t max_tokens_per_rank,
                       int64_t top_k, std::optional<double> activation_clamp, bool fast_math,
                       std::optional<at::Tensor> recv_stats) {
  const auto args = check_mega_moe(y, l1_weights, l1_weights_sf, at::Tensor(), l2_weights, l2_weights_sf,
                                   at::Tensor(), buffer, num_experts, num_ranks, rank, max_tokens_per_rank, top_k,
                                   WeightFormat::kFP8, ActFormat::kFP8, activation_clamp, fast_math, recv_stats);
  check_arch(y, "fp8_mega_moe");
  const c10::cuda::CUDAGuard guard(y.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const auto& l = args.buf.layout;
  const int t = static_cast<int>(args.num_tokens);
  // NOTES: with peers, a rank without tokens still serves theirs and takes part in both barriers.
  if (t == 0 && l.num_ranks == 1) return;
  const int sms = num_sms(y);
  const auto cfg =
      heuristics::choose_grouped_gemm(t, l.top_k, l.num_local_experts, l.hidden, l.intermediate, l.num_ranks, sms);
  uint8_t* buf = buffer_ptr(buffer);
  const uint64_t e = l.num_local_experts, h = l.hidden, inter = l.intermediate, rows = l.pool_rows;
  const auto bm = static_cast<uint32_t>(cfg.block_m);

  // ---- routing and gather (dispatch: every rank's tokens routed to this rank's experts)
  kernels::launch_routing(buf, l, static_cast<int>(args.buf.rank), t, cfg.routing_block(),
                          recv_stats.has_value() ? recv_stats->data_ptr<int>() : nullptr, stream, cfg.tail_rows);
  kernels::launch_gather(buf, l, ActRecipe::kFP8F32Block128, sms, stream);

  // ---- L1: dispatch rows x w13 -> SwiGLU -> FP8 pool; L2: pool x w2 -> bf16 rows in the combine area
  kernels::GroupedGemmArgs g1;
  const uint32_t weight_box = cfg.pairs ? 128 : 256;  // pair walk: each CTA loads (and multicasts) half a tile
  g1.tmap_weights = kernels::make_tensor_map_2d(l1_weights.data_ptr(), h, e * 2 * inter, h, 128, weight_box);
  g1.tmap_acts = kernels::make_tensor_map_2d(buf + l.dispatch_x_offset, h, rows, l.token_bytes, 128, bm);
  g1.acts_sf = reinterpret_cast<const float*>(buf + l.dispatch_sf_offset);
  g1.weights_sf = l1_weights_sf.data_ptr<float>();
  g1.n = static_cast<int>(2 * inter);
  g1.k = static_cast<int>(h);
  kernels::GroupedGemmArgs g2;
  g2.tmap_weights = kernels::make_tensor_map_2d(l2_weights.data_ptr(), inter, e * h, inter, 128, weight_box);
  g2.tmap_acts = kernels::make_tensor_map_2d(buf + l.pool_offset, inter, rows, l.pool_row_bytes, 128, bm);
  g2.acts_sf = reinterpret_cast<const float*>(buf + l.pool_sf_offset);
  // A wide last block's rows past block_m (heuristics::fp8_tail_rows): the same rows, a tail_rows box.
  const auto tail_box = static_cast<uint32_t>(cfg.tail_rows);
  g1.tmap_acts_tail = tail_box > 0 ? kernels::make_tensor_map_2d(buf + l.dispatch_x_offset, h, rows, l.token_bytes,
                                                                 128, tail_box)
                                   : g1.tmap_acts;
  g2.tmap_acts_tail = tail_box > 0 ? kernels::make_tensor_map_2d(buf + l.pool_offset, inter, rows, l.pool_row_bytes,
                                                                 128, tail_box)
                                   : g2.tmap_acts;
  g2.weights_sf = l2_weights_sf.data_ptr<float>();
  g2.n = static_cast<int>(h);
  g2.k = static_cast<int>(inter);
  kernels::GroupedGemmLaunch how;
  how.block_m = cfg.block_m;
  how.fused = cfg.fused;
  how.pairs = cfg.pairs;
  how.rotate_rounds = cfg.rotate_rounds;
  how.activation_clamp = activation_clamp.has_value() ? static_cast<float>(*activation_clamp) : -1.0f;
  how.fast_math = fast_math;
  kernels::launch_fp8_grouped_gemms(g1, g2, buf, l, how, sms, stream);

  // ---- combine over slots
  kernels::launch_combine(y.data_ptr(), buf, l, static_cast<int>(args.buf.rank), t, sms, stream);
}

}  // namespace

}  // namespace megamoe

TORCH_LIBRARY_IMPL(megamoe, CUDA, m) {
  m.impl("pre_dispatch", &megamoe::pre_dispatch_cuda_op);
  m.impl("fp8_mega_moe", &megamoe::fp8_mega_moe_cuda);
}
