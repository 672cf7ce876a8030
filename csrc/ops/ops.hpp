// Host entry points of the megamoe ops: validation shared by every backend, and the backend
// implementations they dispatch to (CPU here in ATen, CUDA in csrc/kernels).
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "megamoe/common.hpp"
#include "megamoe/layout/buffer.hpp"

namespace megamoe {

// ---------------------------------------------------------------------------------------------
// Validated arguments
// ---------------------------------------------------------------------------------------------
struct BufferArgs {
  layout::BufferLayout layout;
  int64_t rank = 0;
};

// Checks the buffer against the layout the configuration implies, and the configuration itself.
BufferArgs check_buffer(const at::Tensor& buffer, int64_t num_experts, int64_t num_ranks, int64_t rank,
                        int64_t max_tokens_per_rank, int64_t top_k, int64_t hidden,
                        int64_t intermediate, ActFormat act_format);

struct MoEArgs {
  BufferArgs buf;
  WeightFormat weight_format;
  ActRecipe recipe;
  int64_t num_tokens;
  std::optional<double> activation_clamp;
  bool fast_math;
};

// Validates every argument of fp8_mega_moe / fp8_fp4_mega_moe (weights in kernel layout, see
// docs/decisions.md). Global scales are undefined tensors for the FP8 op.
MoEArgs check_mega_moe(const at::Tensor& y, const at::Tensor& l1_weights, const at::Tensor& l1_weights_sf,
                       const at::Tensor& l1_weights_global_sf, const at::Tensor& l2_weights,
                       const at::Tensor& l2_weights_sf, const at::Tensor& l2_weights_global_sf,
                       const at::Tensor& buffer, int64_t num_experts, int64_t num_ranks, int64_t rank,
                       int64_t max_tokens_per_rank, int64_t top_k, WeightFormat weight_format,
                       ActFormat act_format, std::optional<double> activation_clamp, bool fast_math,
                       const std::optional<at::Tensor>& recv_stats);

struct PreDispatchArgs {
  BufferArgs buf;
  ActRecipe recipe;
};

PreDispatchArgs check_pre_dispatch(const at::Tensor& x, const at::Tensor& topk_idx,
                                   const at::Tensor& topk_weights, const at::Tensor& buffer,
                                   int64_t num_experts, int64_t num_ranks, int64_t rank,
                                   int64_t max_tokens_per_rank, int64_t top_k, int64_t intermediate,
                                   c10::string_view weight_format, c10::string_view act_format);

// FP4 kernel-layout weight scales [..., N, K / blk] (formats.hpp, fp4_scale_tiles) in the rows' order: the scale
// tiles undone where the layout has them, else `sf` itself.
at::Tensor fp4_scales_by_row(const at::Tensor& sf, WeightFormat format, int64_t k);

// Typed views into the buffer (host side; kernels use the raw offsets).
at::Tensor buffer_view(const at::Tensor& buffer, int64_t offset, at::IntArrayRef sizes, at::ScalarType dtype);

// ---------------------------------------------------------------------------------------------
// Backend implementations (arguments already validated)
// ---------------------------------------------------------------------------------------------
void pre_dispatch_cpu(const at::Tensor& x, const at::Tensor& topk_idx, const at::Tensor& topk_weights,
                      at::Tensor& buffer, const BufferArgs& buf, ActRecipe recipe);
void mega_moe_cpu(at::Tensor& y, const at::Tensor& l1_weights, const at::Tensor& l1_weights_sf,
                  const at::Tensor& l1_weights_global_sf, const at::Tensor& l2_weights,
                  const at::Tensor& l2_weights_sf, const at::Tensor& l2_weights_global_sf,
                  at::Tensor& buffer, const MoEArgs& args, const std::optional<at::Tensor>& recv_stats);

#ifdef MEGAMOE_WITH_CUDA
void pre_dispatch_cuda(const at::Tensor& x, const at::Tensor& topk_idx, const at::Tensor& topk_weights,
                       at::Tensor& buffer, const BufferArgs& buf, ActRecipe recipe);
void mega_moe_cuda(at::Tensor& y, const at::Tensor& l1_weights, const at::Tensor& l1_weights_sf,
                   const at::Tensor& l1_weights_global_sf, const at::Tensor& l2_weights,
                   const at::Tensor& l2_weights_sf, const at::Tensor& l2_weights_global_sf,
                   at::Tensor& buffer, const MoEArgs& args, const std::optional<at::Tensor>& recv_stats);
#endif

}  // namespace megamoe
