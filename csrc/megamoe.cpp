// The megamoe op library: schemas, and the CPU registrations. CUDA registrations live in
// csrc/ops/cuda_ops.cpp (built only with nvcc).
#include <Python.h>

#include <torch/library.h>

#include "ops/ops.hpp"

// A dummy module so `import megamoe._C` loads the library and runs the static registrations below.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}

namespace megamoe {

at::Tensor get_buffer_layout(int64_t num_experts, int64_t num_ranks, int64_t max_tokens_per_rank,
                             int64_t top_k, int64_t hidden, int64_t intermediate, c10::string_view act_format);
std::tuple<at::Tensor, at::Tensor, at::Tensor> transform_weights(
    const at::Tensor& weights, const at::Tensor& weights_sf,
    const std::optional<at::Tensor>& weights_global_sf, c10::string_view weight_format, bool is_l1);
void pre_dispatch_cpu_op(const at::Tensor& x, const at::Tensor& topk_idx, const at::Tensor& topk_weights,
                         at::Tensor& buffer, int64_t num_experts, int64_t num_ranks, int64_t rank,
                         int64_t max_tokens_per_rank, int64_t top_k, int64_t intermediate,
                         c10::string_view weight_format, c10::string_view act_format);

namespace {

void fp8_mega_moe_cpu(at::Tensor& y, const at::Tensor& l1_weights, const at::Tensor& l1_weights_sf,
                      const at::Tensor& l2_weights, const at::Tensor& l2_weights_sf, at::Tensor& buffer,
                      int64_t num_experts, int64_t num_ranks, int64_t rank, int64_t max_tokens_per_rank,
                      int64_t top_k, std::optional<double> activation_clamp, bool fast_math,
                      std::optional<at::Tensor> recv_stats) {
  const auto args = check_mega_moe(y, l1_weights, l1_weights_sf, at::Tensor(), l2_weights, l2_weights_sf,
                                   at::Tensor(), buffer, num_experts, num_ranks, rank, max_tokens_per_rank,
                                   top_k, WeightFormat::kFP8, ActFormat::kFP8, activation_clamp, fast_math,
                                   recv_stats);
  mega_moe_cpu(y, l1_weights, l1_weights_sf, at::Tensor(), l2_weights, l2_weights_sf, at::Tensor(), buffer,
               args, recv_stats);
}

void fp8_fp4_mega_moe_cpu(at::Tensor& y, const at::Tensor& l1_weights, const at::Tensor& l1_weights_sf,
                          const at::Tensor& l1_weights_global_sf, const at::Tensor& l2_weights,
                          const at::Tensor& l2_weights_sf, const at::Tensor& l2_weights_global_sf,
                          at::Tensor& buffer, int64_t num_experts, int64_t num_ranks, int64_t rank,
                          int64_t max_tokens_per_rank, int64_t top_k, c10::string_view weight_format,
                          c10::string_view act_format, std::optional<double> activation_clamp,
                          bool fast_math, std::optional<at::Tensor> recv_stats) {
  const auto format = parse_weight_format(weight_format);
  TORCH_CHECK_VALUE(format != WeightFormat::kFP8,
                    "weight_format: fp8_fp4_mega_moe takes 'mxfp4' or 'nvfp4'; FP8 block weights go through "
                    "fp8_mega_moe");
  const auto args = check_mega_moe(y, l1_weights, l1_weights_sf, l1_weights_global_sf, l2_weights,
                                   l2_weights_sf, l2_weights_global_sf, buffer, num_experts, num_ranks, rank,
                                   max_tokens_per_rank, top_k, format, parse_act_format(act_format),
                                   activation_clamp, fast_math, recv_stats);
  mega_moe_cpu(y, l1_weights, l1_weights_sf, l1_weights_global_sf, l2_weights, l2_weights_sf,
               l2_weights_global_sf, buffer, args, recv_stats);
}

}  // namespace
}  // namespace megamoe

// NOTES: every mutated tensor carries its own alias letter; ops that mutate return () (a mutated
// tensor must never be returned). No argument is called `mode` (breaks functionalization).
TORCH_LIBRARY(megamoe, m) {
  m.def("get_buffer_layout(int num_experts, int num_ranks, int max_tokens_per_rank, int top_k, int hidden, "
        "int intermediate, str act_format) -> Tensor");
  m.def("transform_weights(Tensor weights, Tensor weights_sf, Tensor? weights_global_sf, str weight_format, "
        "bool is_l1) -> (Tensor, Tensor, Tensor)");
  m.def("pre_dispatch(Tensor x, Tensor topk_idx, Tensor topk_weights, Tensor(a!) buffer, int num_experts, "
        "int num_ranks, int rank, int max_tokens_per_rank, int top_k, int intermediate, str weight_format, "
        "str act_format) -> ()");
  m.def("fp8_mega_moe(Tensor(a!) y, Tensor l1_weights, Tensor l1_weights_sf, Tensor l2_weights, "
        "Tensor l2_weights_sf, Tensor(b!) buffer, int num_experts, int num_ranks, int rank, "
        "int max_tokens_per_rank, int top_k, float? activation_clamp, bool fast_math, "
        "Tensor(c!)? recv_stats) -> ()");
  m.def("fp8_fp4_mega_moe(Tensor(a!) y, Tensor l1_weights, Tensor l1_weights_sf, Tensor l1_weights_global_sf, "
        "Tensor l2_weights, Tensor l2_weights_sf, Tensor l2_weights_global_sf, Tensor(b!) buffer, "
        "int num_experts, int num_ranks, int rank, int max_tokens_per_rank, int top_k, str weight_format, "
        "str act_format, float? activation_clamp, bool fast_math, Tensor(c!)? recv_stats) -> ()");
}

TORCH_LIBRARY_IMPL(megamoe, CompositeExplicitAutograd, m) {
  m.impl("get_buffer_layout", &megamoe::get_buffer_layout);
  m.impl("transform_weights", &megamoe::transform_weights);
}

TORCH_LIBRARY_IMPL(megamoe, CPU, m) {
  m.impl("pre_dispatch", &megamoe::pre_dispatch_cpu_op);
  m.impl("fp8_mega_moe", &megamoe::fp8_mega_moe_cpu);
  m.impl("fp8_fp4_mega_moe", &megamoe::fp8_fp4_mega_moe_cpu);
}
