// pre_dispatch: bf16 hidden states + top-k routing -> quantized activations, scales and routing in the
// buffer. Checks here, CPU implementation here, CUDA implementation in csrc/ops/cuda_ops.cpp.
#include "ops/ops.hpp"

#include "cpu/quant.hpp"

namespace megamoe {

PreDispatchArgs check_pre_dispatch(const at::Tensor& x, const at::Tensor& topk_idx,
                                   const at::Tensor& topk_weights, const at::Tensor& buffer,
                                   int64_t num_experts, int64_t num_ranks, int64_t rank,
                                   int64_t max_tokens_per_rank, int64_t top_k, int64_t intermediate,
                                   c10::string_view weight_format, c10::string_view act_format) {
  PreDispatchArgs a;
  const auto act = parse_act_format(act_format);
  a.recipe = act_recipe(parse_weight_format(weight_format), act);
  MEGAMOE_CHECK_DTYPE(x, "x", at::kBFloat16);
  MEGAMOE_CHECK_DIM(x, "x", 2);
  MEGAMOE_CHECK_CONTIGUOUS(x, "x");
  MEGAMOE_CHECK_MULTIPLE(x.size(1), "x.size(1) (hidden)", 128);
  a.buf = check_buffer(buffer, num_experts, num_ranks, rank, max_tokens_per_rank, top_k, x.size(1),
                       intermediate, act);
  const int64_t t = x.size(0);
  TORCH_CHECK_VALUE(t <= max_tokens_per_rank, "x: expected at most max_tokens_per_rank = ",
                    max_tokens_per_rank, " tokens (the buffer's capacity), got ", t);
  TORCH_CHECK_TYPE(topk_idx.scalar_type() == at::kInt || topk_idx.scalar_type() == at::kLong,
                   "topk_idx: expected dtype int32 or int64, got ", c10::toString(topk_idx.scalar_type()));
  MEGAMOE_CHECK_DIM(topk_idx, "topk_idx", 2);
  MEGAMOE_CHECK_SIZE(topk_idx, "topk_idx", 0, t);
  MEGAMOE_CHECK_SIZE(topk_idx, "topk_idx", 1, top_k);
  MEGAMOE_CHECK_CONTIGUOUS(topk_idx, "topk_idx");
  MEGAMOE_CHECK_DTYPE(topk_weights, "topk_weights", at::kFloat);
  MEGAMOE_CHECK_DIM(topk_weights, "topk_weights", 2);
  MEGAMOE_CHECK_SIZE(topk_weights, "topk_weights", 0, t);
  MEGAMOE_CHECK_SIZE(topk_weights, "topk_weights", 1, top_k);
  MEGAMOE_CHECK_CONTIGUOUS(topk_weights, "topk_weights");
  MEGAMOE_CHECK_SAME_DEVICE(topk_idx, "topk_idx", x, "x");
  MEGAMOE_CHECK_SAME_DEVICE(topk_weights, "topk_weights", x, "x");
  MEGAMOE_CHECK_SAME_DEVICE(buffer, "buffer", x, "x");
  return a;
}

void pre_dispatch_cpu(const at::Tensor& x, const at::Tensor& topk_idx, const at::Tensor& topk_weights,
                      at::Tensor& buffer, const BufferArgs& buf, ActRecipe recipe) {
  const auto& l = buf.layout;
  const int64_t t = x.size(0), k = l.top_k;
  auto error = buffer_view(buffer, l.error_offset, {layout::kNumErrorWords}, at::kInt);
  error.zero_();
  buffer_view(buffer, l.num_tokens_offset, {1}, at::kInt).fill_(t);

  // ---- activations
  auto q = cpu::quantize_rows(x, recipe);
  buffer_view(buffer, l.x_offset, {l.max_tokens_per_rank, l.token_bytes}, at::kByte)
      .narrow(0, 0, t).narrow(1, 0, q.data.size(1)).copy_(q.data);
  buffer_view(buffer, l.x_sf_offset, {l.max_tokens_per_rank, l.token_sf_bytes}, at::kByte)
      .narrow(0, 0, t).narrow(1, 0, q.sf.size(1)).copy_(q.sf);
  if (q.global_sf.defined())
    buffer_view(buffer, l.x_global_sf_offset, {l.max_tokens_per_rank}, at::kFloat).narrow(0, 0, t).copy_(q.global_sf);

  // ---- routing: ids stored as int32, those outside [-1, num_experts) clamped so that they stay outside
  // (as the CUDA kernel does); the fused op skips them and reports the first in the error word
  auto ids = topk_idx.to(at::kLong).clamp(INT32_MIN, INT32_MAX);
  buffer_view(buffer, l.topk_idx_offset, {l.max_tokens_per_rank, k}, at::kInt).narrow(0, 0, t).copy_(ids);
  buffer_view(buffer, l.topk_weights_offset, {l.max_tokens_per_rank, k}, at::kFloat)
      .narrow(0, 0, t).copy_(topk_weights);
}

void pre_dispatch_cpu_op(const at::Tensor& x, const at::Tensor& topk_idx, const at::Tensor& topk_weights,
                         at::Tensor& buffer, int64_t num_experts, int64_t num_ranks, int64_t rank,
                         int64_t max_tokens_per_rank, int64_t top_k, int64_t intermediate,
                         c10::string_view weight_format, c10::string_view act_format) {
  const auto a = check_pre_dispatch(x, topk_idx, topk_weights, buffer, num_experts, num_ranks, rank,
                                    max_tokens_per_rank, top_k, intermediate, weight_format, act_format);
  pre_dispatch_cpu(x, topk_idx, topk_weights, buffer, a.buf, a.recipe);
}

}  // namespace megamoe
