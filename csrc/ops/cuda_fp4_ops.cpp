// CUDA registration of fp8_fp4_mega_moe (FP4 expert weights, MXFP4 / NVFP4, w4a8 and w4a4).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "ops/cuda_utils.hpp"
#include "ops/ops.hpp"

namespace megamoe {

namespace {

void fp8_fp4_mega_moe_cuda(at::Tensor& y, const at::Tensor& l1_weights, const at::Tensor& l1_weights_sf,
                           const at::Tensor& l1_weights_global_sf, const at::Tensor& l2_weights,
                           const at::Tensor& l2_weights_sf, const at::Tensor& l2_weights_global_sf,
                           at::Tensor& buffer, int64_t num_experts, int64_t num_ranks, int64_t rank,
                           int64_t max_tokens_per_rank, int64_t top_k, c10::string_view weight_format,
                           c10::string_view act_format, std::optional<double> activation_clamp, bool fast_math,
                           std::optional<at::Tensor> recv_stats) {
  const auto format = parse_weight_format(weight_format);
  TORCH_CHECK_VALUE(format != WeightFormat::kFP8, "weight_format: fp8_fp4_mega_moe takes 'mxfp4' or 'nvfp4'; "
                    "FP8 block weights go through fp8_mega_moe");
  check_mega_moe(y, l1_weights, l1_weights_sf, l1_weights_global_sf, l2_weights, l2_weights_sf,
                 l2_weights_global_sf, buffer, num_experts, num_ranks, rank, max_tokens_per_rank, top_k, format,
                 parse_act_format(act_format), activation_clamp, fast_math, recv_stats);
  TORCH_CHECK_NOT_IMPLEMENTED(false, "fp8_fp4_mega_moe: weight_format '", to_string(format), "' with act_format '",
                              std::string(act_format), "' has no CUDA kernel for ", arch_name(y),
                              " yet (the FP4 Hopper kernels are a separate issue); the CPU op implements it");
}


}  // namespace

}  // namespace megamoe

TORCH_LIBRARY_IMPL(megamoe, CUDA, m) { m.impl("fp8_fp4_mega_moe", &megamoe::fp8_fp4_mega_moe_cuda); }
