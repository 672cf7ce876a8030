// transform_weights: checkpoint layout -> kernel layout (docs/decisions.md, "Kernel weight layout").
// Pure function of its inputs; written in ATen so one implementation serves every device.
#include "ops/ops.hpp"

namespace megamoe {

namespace {

constexpr int64_t kInterleave = 64;  // gate/up chunk rows in the L1 kernel layout

// Rows [gate(I); up(I)] -> chunks of 64 rows alternating gate, up. Works on any trailing dims.
at::Tensor interleave_gate_up(const at::Tensor& t, int64_t rows_per_chunk) {
  auto sizes = t.sizes().vec();
  const int64_t e = sizes[0], n = sizes[1];
  std::vector<int64_t> split = {e, 2, n / 2 / rows_per_chunk, rows_per_chunk};
  split.insert(split.end(), sizes.begin() + 2, sizes.end());
  return t.reshape(split).transpose(1, 2).reshape(sizes).contiguous();
}

// [..., N, C] rows -> [..., N / 256, C / 16, 256, 16] scale tiles (forward) or back, same shape [..., N, C].
at::Tensor permute_scale_tiles(const at::Tensor& sf, bool forward) {
  auto sizes = sf.sizes().vec();
  const int64_t n = sizes[sizes.size() - 2], c = sizes.back(), d = static_cast<int64_t>(sizes.size());
  std::vector<int64_t> split(sizes.begin(), sizes.end() - 2);
  if (forward) {
    split.insert(split.end(), {n / kScaleTileRows, kScaleTileRows, c / kScaleTileBytes, kScaleTileBytes});
  } else {
    split.insert(split.end(), {n / kScaleTileRows, c / kScaleTileBytes, kScaleTileRows, kScaleTileBytes});
  }
  // Swap the two middle dimensions (rows within a tile, 16-byte column groups) either way.
  return sf.reshape(split).transpose(d - 1, d).reshape(sizes).contiguous();
}

}  // namespace

at::Tensor fp4_scales_by_row(const at::Tensor& sf, WeightFormat format, int64_t k) {
  return fp4_scale_tiles(format, sf.size(-2), k) ? permute_scale_tiles(sf, false) : sf;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> transform_weights(
    const at::Tensor& weights, const at::Tensor& weights_sf,
    const std::optional<at::Tensor>& weights_global_sf, c10::string_view weight_format, bool is_l1) {
  const auto format = parse_weight_format(weight_format);
  // ------------------------------------------------------------------ checks
  MEGAMOE_CHECK_DIM(weights, "weights", 3);
  MEGAMOE_CHECK_DIM(weights_sf, "weights_sf", 3);
  MEGAMOE_CHECK_SAME_DEVICE(weights_sf, "weights_sf", weights, "weights");
  const int64_t e = weights.size(0), n = weights.size(1);
  const bool fp4 = format != WeightFormat::kFP8;
  const int64_t k = fp4 ? weights.size(2) * 2 : weights.size(2);
  MEGAMOE_CHECK_MULTIPLE(n, is_l1 ? "weights.size(1) (2 * intermediate)" : "weights.size(1) (hidden)",
                         is_l1 ? 256 : 128);
  MEGAMOE_CHECK_MULTIPLE(k, fp4 ? "weights.size(2) * 2 (K, unpacked)" : "weights.size(2) (K)", 128);
  switch (format) {
    case WeightFormat::kFP8:
      MEGAMOE_CHECK_DTYPE(weights, "weights", at::kFloat8_e4m3fn);
      MEGAMOE_CHECK_DTYPE(weights_sf, "weights_sf", at::kFloat);
      MEGAMOE_CHECK_SIZE(weights_sf, "weights_sf", 0, e);
      MEGAMOE_CHECK_SIZE(weights_sf, "weights_sf", 1, n / 128);
      MEGAMOE_CHECK_SIZE(weights_sf, "weights_sf", 2, k / 128);
      break;
    case WeightFormat::kMXFP4:
      MEGAMOE_CHECK_DTYPE(weights, "weights", at::kByte);
      TORCH_CHECK_TYPE(weights_sf.scalar_type() == at::kByte || weights_sf.scalar_type() == at::kFloat8_e8m0fnu,
                       "weights_sf: expected dtype uint8 or float8_e8m0fnu (UE8M0), got ",
                       c10::toString(weights_sf.scalar_type()));
      MEGAMOE_CHECK_SIZE(weights_sf, "weights_sf", 0, e);
      MEGAMOE_CHECK_SIZE(weights_sf, "weights_sf", 1, n);
      MEGAMOE_CHECK_SIZE(weights_sf, "weights_sf", 2, k / 32);
      break;
    case WeightFormat::kNVFP4:
      MEGAMOE_CHECK_DTYPE(weights, "weights", at::kByte);
      MEGAMOE_CHECK_DTYPE(weights_sf, "weights_sf", at::kFloat8_e4m3fn);
      MEGAMOE_CHECK_SIZE(weights_sf, "weights_sf", 0, e);
      MEGAMOE_CHECK_SIZE(weights_sf, "weights_sf", 1, n);
      MEGAMOE_CHECK_SIZE(weights_sf, "weights_sf", 2, k / 16);
      break;
  }
  if (format == WeightFormat::kNVFP4) {
    TORCH_CHECK_VALUE(weights_global_sf.has_value(),
                      "weights_global_sf: NVFP4 needs the per-expert float32 global scale (weight_scale_2)");
    const auto& g = *weights_global_sf;
    MEGAMOE_CHECK_DTYPE(g, "weights_global_sf", at::kFloat);
    MEGAMOE_CHECK_SAME_DEVICE(g, "weights_global_sf", weights, "weights");
    TORCH_CHECK_VALUE(g.numel() == e || g.numel() == 1, "weights_global_sf: expected ", e,
                      " values (one per expert) or a scalar, got shape ", shape_str(g.sizes()));
  } else {
    TORCH_CHECK_VALUE(!weights_global_sf.has_value(), "weights_global_sf: only NVFP4 takes a global scale, "
                      "got one for weight_format '", to_string(format), "'");
  }

  // ------------------------------------------------------------------ transform
  at::Tensor w, sf;
  if (format == WeightFormat::kFP8) {
    // One scale per 64-row chunk (each 128-row block's scale repeated), so L1 chunks keep theirs.
    sf = weights_sf.repeat_interleave(2, 1);
    w = weights;
    if (is_l1) {
      w = interleave_gate_up(w, kInterleave);
      sf = interleave_gate_up(sf, 1);
    }
  } else {
    w = weights;
    sf = weights_sf.scalar_type() == at::kFloat8_e8m0fnu ? weights_sf.view(at::kByte) : weights_sf;
    if (is_l1) {
      w = interleave_gate_up(w, kInterleave);
      sf = interleave_gate_up(sf, kInterleave);
    }
  }
  // The third tensor: NVFP4 the per-expert global scale; MXFP4 each kernel-layout row's largest UE8M0 scale (uint8
  // [E, N]), the exponent the FP8-wgmma path folds the row's weights relative to (docs/decisions.md); FP8 ones.
  at::Tensor g;
  switch (format) {
    case WeightFormat::kNVFP4: g = weights_global_sf->reshape({-1}).expand({e}).to(at::kFloat); break;
    case WeightFormat::kMXFP4: g = k > 0 ? sf.amax(2) : at::zeros({e, n}, sf.options()); break;
    case WeightFormat::kFP8: g = at::ones({e}, weights.options().dtype(at::kFloat)); break;
  }
  // FP4 scales as scale tiles where the shape allows (formats.hpp; after the row exponents, which read rows).
  if (fp4_scale_tiles(format, n, k)) sf = permute_scale_tiles(sf, true);
  // Fresh contiguous outputs: the op is pure and never aliases its inputs.
  return {w.clone(at::MemoryFormat::Contiguous), sf.clone(at::MemoryFormat::Contiguous),
          g.clone(at::MemoryFormat::Contiguous)};
}

}  // namespace megamoe
