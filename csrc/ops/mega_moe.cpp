// fp8_mega_moe / fp8_fp4_mega_moe: argument checks shared by every backend, and the CPU implementation
// (ATen, emulates exactly what the kernels compute; speed does not matter on CPU).
#include "ops/ops.hpp"

#include <cmath>

#include "cpu/quant.hpp"

namespace megamoe {

namespace {

// Expected dtype and shape of one kernel-layout weight tensor set (docs/decisions.md).
void check_weights(const at::Tensor& w, const at::Tensor& sf, const at::Tensor& global_sf, const char* name,
                   const char* sf_name, const char* global_name, WeightFormat format, int64_t e, int64_t n,
                   int64_t k, const at::Tensor& y) {
  const bool fp4 = format != WeightFormat::kFP8;
  MEGAMOE_CHECK_DTYPE(w, name, fp4 ? at::kByte : at::kFloat8_e4m3fn);
  MEGAMOE_CHECK_DIM(w, name, 3);
  MEGAMOE_CHECK_SIZE(w, name, 0, e);
  MEGAMOE_CHECK_SIZE(w, name, 1, n);
  MEGAMOE_CHECK_SIZE(w, name, 2, fp4 ? k / 2 : k);
  MEGAMOE_CHECK_CONTIGUOUS(w, name);
  MEGAMOE_CHECK_SAME_DEVICE(w, name, y, "y");
  MEGAMOE_CHECK_DIM(sf, sf_name, 3);
  MEGAMOE_CHECK_SIZE(sf, sf_name, 0, e);
  switch (format) {
    case WeightFormat::kFP8:
      MEGAMOE_CHECK_DTYPE(sf, sf_name, at::kFloat);
      MEGAMOE_CHECK_SIZE(sf, sf_name, 1, n / 64);
      MEGAMOE_CHECK_SIZE(sf, sf_name, 2, k / 128);
      break;
    case WeightFormat::kMXFP4:
      MEGAMOE_CHECK_DTYPE(sf, sf_name, at::kByte);
      MEGAMOE_CHECK_SIZE(sf, sf_name, 1, n);
      MEGAMOE_CHECK_SIZE(sf, sf_name, 2, k / 32);
      break;
    case WeightFormat::kNVFP4:
      MEGAMOE_CHECK_DTYPE(sf, sf_name, at::kFloat8_e4m3fn);
      MEGAMOE_CHECK_SIZE(sf, sf_name, 1, n);
      MEGAMOE_CHECK_SIZE(sf, sf_name, 2, k / 16);
      break;
  }
  MEGAMOE_CHECK_CONTIGUOUS(sf, sf_name);
  MEGAMOE_CHECK_SAME_DEVICE(sf, sf_name, y, "y");
  // Scale tiles go to shared memory in 16-byte pieces (bulk copies, 8- / 16-byte cp.async).
  TORCH_CHECK_VALUE(!sf.is_cuda() || !fp4_scale_tiles(format, n, k) || reinterpret_cast<uintptr_t>(sf.data_ptr()) % 16 == 0,
                    sf_name, ": expected a data pointer aligned to 16 bytes (FP4 scale tiles, as transform_weights "
                    "allocates them), got an offset of ", reinterpret_cast<uintptr_t>(sf.data_ptr()) % 16, " bytes");
  // The third tensor: none for FP8 (the FP8 op has no argument), NVFP4's per-expert global scales, MXFP4's per-row
  // exponents (each row's largest UE8M0 scale: the FP8-wgmma path folds the row's weights relative to it).
  TORCH_CHECK_VALUE(format == WeightFormat::kFP8 || global_sf.defined(), global_name,
                    ": expected the third tensor transform_weights returns, got an undefined tensor");
  if (global_sf.defined()) {
    if (format == WeightFormat::kMXFP4) {
      TORCH_CHECK_TYPE(global_sf.scalar_type() == at::kByte, global_name,
                       ": expected dtype Byte (mxfp4: each row's largest UE8M0 scale, from transform_weights), got ",
                       c10::toString(global_sf.scalar_type()));
      MEGAMOE_CHECK_DIM(global_sf, global_name, 2);
      MEGAMOE_CHECK_SIZE(global_sf, global_name, 0, e);
      MEGAMOE_CHECK_SIZE(global_sf, global_name, 1, n);
      // The kernel copies each 4 rows' exponents as one 4-byte word (cp.async of 4 bytes needs 4-byte alignment).
      TORCH_CHECK_VALUE(!global_sf.is_cuda() || reinterpret_cast<uintptr_t>(global_sf.data_ptr()) % 4 == 0, global_name,
                        ": expected a data pointer aligned to 4 bytes (mxfp4 row exponents, as transform_weights "
                        "allocates them), got an offset of ", reinterpret_cast<uintptr_t>(global_sf.data_ptr()) % 4,
                        " bytes");
    } else {
      MEGAMOE_CHECK_DTYPE(global_sf, global_name, at::kFloat);
      MEGAMOE_CHECK_DIM(global_sf, global_name, 1);
      MEGAMOE_CHECK_SIZE(global_sf, global_name, 0, e);
    }
    MEGAMOE_CHECK_CONTIGUOUS(global_sf, global_name);
    MEGAMOE_CHECK_SAME_DEVICE(global_sf, global_name, y, "y");
  }
}

}  // namespace

MoEArgs check_mega_moe(const at::Tensor& y, const at::Tensor& l1_weights, const at::Tensor& l1_weights_sf,
                       const at::Tensor& l1_weights_global_sf, const at::Tensor& l2_weights,
                       const at::Tensor& l2_weights_sf, const at::Tensor& l2_weights_global_sf,
                       const at::Tensor& buffer, int64_t num_experts, int64_t num_ranks, int64_t rank,
                       int64_t max_tokens_per_rank, int64_t top_k, WeightFormat weight_format,
                       ActFormat act_format, std::optional<double> activation_clamp, bool fast_math,
                       const std::optional<at::Tensor>& recv_stats) {
  MoEArgs a;
  a.weight_format = weight_format;
  a.recipe = act_recipe(weight_format, act_format);
  a.activation_clamp = activation_clamp;
  a.fast_math = fast_math;
  MEGAMOE_CHECK_DTYPE(y, "y", at::kBFloat16);
  MEGAMOE_CHECK_DIM(y, "y", 2);
  MEGAMOE_CHECK_CONTIGUOUS(y, "y");
  MEGAMOE_CHECK_MULTIPLE(y.size(1), "y.size(1) (hidden)", 128);
  a.num_tokens = y.size(0);
  const int64_t hidden = y.size(1);
  const bool fp4 = weight_format != WeightFormat::kFP8;
  MEGAMOE_CHECK_DIM(l2_weights, "l2_weights", 3);
  const int64_t intermediate = fp4 ? l2_weights.size(2) * 2 : l2_weights.size(2);
  MEGAMOE_CHECK_MULTIPLE(intermediate, "intermediate (l2_weights.size(2), unpacked)", 128);
  MEGAMOE_CHECK_SAME_DEVICE(buffer, "buffer", y, "y");
  a.buf = check_buffer(buffer, num_experts, num_ranks, rank, max_tokens_per_rank, top_k, hidden,
                       intermediate, act_format);
  const int64_t e = a.buf.layout.num_local_experts;
  check_weights(l1_weights, l1_weights_sf, l1_weights_global_sf, "l1_weights", "l1_weights_sf",
                "l1_weights_global_sf", weight_format, e, 2 * intermediate, hidden, y);
  check_weights(l2_weights, l2_weights_sf, l2_weights_global_sf, "l2_weights", "l2_weights_sf",
                "l2_weights_global_sf", weight_format, e, hidden, intermediate, y);
  TORCH_CHECK_VALUE(a.num_tokens <= max_tokens_per_rank, "y: expected at most max_tokens_per_rank = ",
                    max_tokens_per_rank, " tokens (the buffer's capacity), got ", a.num_tokens);
  if (activation_clamp.has_value())
    TORCH_CHECK_VALUE(std::isfinite(*activation_clamp) && *activation_clamp > 0,
                      "activation_clamp: expected a finite positive value or None, got ", *activation_clamp);
  if (recv_stats.has_value()) {
    MEGAMOE_CHECK_DTYPE(*recv_stats, "recv_stats", at::kInt);
    MEGAMOE_CHECK_DIM(*recv_stats, "recv_stats", 1);
    MEGAMOE_CHECK_SIZE(*recv_stats, "recv_stats", 0, e);
    MEGAMOE_CHECK_CONTIGUOUS(*recv_stats, "recv_stats");
    MEGAMOE_CHECK_SAME_DEVICE(*recv_stats, "recv_stats", y, "y");
  }
  return a;
}

// ---------------------------------------------------------------------------------------------
// CPU implementation
// ---------------------------------------------------------------------------------------------
void mega_moe_cpu(at::Tensor& y, const at::Tensor& l1_weights, const at::Tensor& l1_weights_sf,
                  const at::Tensor& l1_weights_global_sf, const at::Tensor& l2_weights,
                  const at::Tensor& l2_weights_sf, const at::Tensor& l2_weights_global_sf,
                  at::Tensor& buffer, const MoEArgs& args, const std::optional<at::Tensor>& recv_stats) {
  TORCH_CHECK_NOT_IMPLEMENTED(args.buf.layout.num_ranks == 1,
                              "num_ranks: expert parallelism needs CUDA symmetric memory; the CPU ops "
                              "run with num_ranks = 1, got ", args.buf.layout.num_ranks);
  const auto& l = args.buf.layout;
  const int64_t t = args.num_tokens, k = l.top_k, h = l.hidden, inter = l.intermediate;
  const int64_t sf_bytes = h / cpu::recipe_sf_divisor(args.recipe);

  // ---- inputs from the buffer (as pre_dispatch left them)
  auto data = buffer_view(buffer, l.x_offset, {l.max_tokens_per_rank, l.token_bytes}, at::kByte).narrow(0, 0, t);
  auto sf = buffer_view(buffer, l.x_sf_offset, {l.max_tokens_per_rank, l.token_sf_bytes}, at::kByte)
                .narrow(0, 0, t).narrow(1, 0, sf_bytes);
  auto gsf = buffer_view(buffer, l.x_global_sf_offset, {l.max_tokens_per_rank}, at::kFloat).narrow(0, 0, t);
  auto x = cpu::dequantize_rows(data, sf, gsf, args.recipe, h);
  auto ids = buffer_view(buffer, l.topk_idx_offset, {l.max_tokens_per_rank, k}, at::kInt).narrow(0, 0, t).to(at::kLong);
  auto weights = buffer_view(buffer, l.topk_weights_offset, {l.max_tokens_per_rank, k}, at::kFloat).narrow(0, 0, t);
  // Ids outside [-1, num_experts) (pre_dispatch stores them clamped to int32) are skipped below and the first
  // is reported in the error word, unless an error of this call is there already (first one wins).
  auto bad_pos = ids.lt(-1).logical_or(ids.ge(l.num_experts)).reshape({-1}).nonzero();
  auto error = buffer_view(buffer, l.error_offset, {layout::kNumErrorWords}, at::kInt);
  if (bad_pos.numel() > 0 && error[0].item<int32_t>() == 0) {
    const int64_t flat = bad_pos[0][0].item<int64_t>();
    auto e = error.accessor<int32_t, 1>();
    e[0] = layout::kErrorExpertId;
    e[1] = static_cast<int32_t>(ids.reshape({-1})[flat].item<int64_t>());
    e[2] = static_cast<int32_t>(flat / k);
    e[3] = static_cast<int32_t>(flat % k);
  }

  // ---- experts: L1 -> SwiGLU (+clamp, x topk weight) -> requant -> L2, one (token, slot) row each
  auto combine = at::zeros({t, k, h}, y.options().dtype(at::kFloat));
  const int64_t first = args.buf.rank * l.num_local_experts;
  for (int64_t e = 0; e < l.num_local_experts; ++e) {
    auto pos = ids.eq(first + e).nonzero();  // [n, 2]: (token, slot)
    const int64_t n = pos.size(0);
    if (recv_stats.has_value()) (*recv_stats)[e].add_(n);
    if (n == 0) continue;
    auto tok = pos.select(1, 0), slot = pos.select(1, 1);
    // Global scales: NVFP4 only (MXFP4's third tensor holds row exponents, which scale nothing).
    const bool nv = args.weight_format == WeightFormat::kNVFP4;
    auto w1 = cpu::dequantize_weights(l1_weights[e], fp4_scales_by_row(l1_weights_sf[e], args.weight_format, h),
                                      nv ? l1_weights_global_sf[e] : at::Tensor(), args.weight_format);
    auto w2 = cpu::dequantize_weights(l2_weights[e], fp4_scales_by_row(l2_weights_sf[e], args.weight_format, inter),
                                      nv ? l2_weights_global_sf[e] : at::Tensor(), args.weight_format);
    auto hid = at::matmul(x.index_select(0, tok), w1.t()).to(at::kBFloat16).to(at::kFloat);
    // Interleaved rows: chunk 2j = gate rows [64j, 64j+64), chunk 2j+1 = the matching up rows.
    auto chunks = hid.view({n, inter / 64, 2, 64});
    auto gate = chunks.select(2, 0).reshape({n, inter});
    auto up = chunks.select(2, 1).reshape({n, inter});
    if (args.activation_clamp.has_value()) {
      const double c = *args.activation_clamp;
      gate = gate.clamp_max(c);
      up = up.clamp(-c, c);
    }
    // exp in float64, rounded once: float32 exp implementations differ by an ulp between CPUs, and the
    // reference (megamoe.reference) does the same, so the CPU op stays bitwise equal to it.
    auto silu = gate / (1 + at::exp(-gate.to(at::kDouble)).to(at::kFloat));
    auto act = silu * up * weights.index({tok, slot}).unsqueeze(1);
    auto q = cpu::quantize_rows(act, args.recipe);
    auto act_q = cpu::dequantize_rows(q.data, q.sf, q.global_sf, args.recipe, inter);
    auto out = at::matmul(act_q, w2.t()).to(at::kBFloat16).to(at::kFloat);
    combine.index_put_({tok, slot}, out);
  }
  // ---- combine: float32 sum over slots in slot order, one bf16 rounding
  auto acc = at::zeros({t, h}, combine.options());
  for (int64_t s = 0; s < k; ++s) acc.add_(combine.select(1, s));
  y.copy_(acc.to(at::kBFloat16));
}

}  // namespace megamoe
