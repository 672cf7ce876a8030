// Bit-exact ATen implementation of the formats (mirrors megamoe/formats.py).
#include "cpu/quant.hpp"

namespace megamoe::cpu {

namespace {

// Splits the last dim into blocks: [..., K] -> [..., K/block, block].
at::Tensor blocked(const at::Tensor& x, int64_t block) {
  auto sizes = x.sizes().vec();
  const int64_t k = sizes.back();
  sizes.back() = k / block;
  sizes.push_back(block);
  return x.reshape(sizes);
}

at::Tensor block_amax(const at::Tensor& x, int64_t block) {
  return blocked(x, block).abs().amax(-1).clamp_min(kAmaxEps);
}

// [..., K/block] scales broadcast back over [..., K/block, block] and flattened to [..., K].
at::Tensor apply_blocks(const at::Tensor& x, const at::Tensor& scale, int64_t block, bool divide) {
  auto xb = blocked(x, block);
  auto s = scale.unsqueeze(-1);
  return (divide ? xb / s : xb * s).reshape(x.sizes());
}

at::Tensor to_fp8(const at::Tensor& x) { return x.clamp(-kFP8Max, kFP8Max).to(at::kFloat8_e4m3fn); }

at::Tensor as_bytes(const at::Tensor& t) {
  // Reinterprets a contiguous tensor's bytes as uint8 [..., last * itemsize].
  auto c = t.contiguous();
  auto sizes = c.sizes().vec();
  sizes.back() *= c.element_size();
  return c.view(at::kByte).view(sizes);
}

}  // namespace

at::Tensor ceil_pow2(const at::Tensor& s) {
  auto bits = s.to(at::kFloat).contiguous().view(at::kInt);
  auto exponent = bits.bitwise_right_shift(23).bitwise_and(0xFF);
  auto mantissa = bits.bitwise_and(0x7FFFFF);
  auto rounded = (exponent + mantissa.ne(0).to(at::kInt)).bitwise_left_shift(23);
  // Exponent 255 (inf, NaN) keeps its magnitude, as megamoe.formats.ceil_pow2 does: a NaN amax gave -0.0
  // here, and an MXFP4 block holding a NaN came out finite.
  return at::where(exponent.eq(0xFF), bits.bitwise_and(0x7FFFFFFF), rounded).view(at::kFloat);
}

at::Tensor float_to_ue8m0(const at::Tensor& s) {
  return s.to(at::kFloat).contiguous().view(at::kInt).bitwise_right_shift(23).bitwise_and(0xFF).to(at::kByte);
}

at::Tensor ue8m0_to_float(const at::Tensor& sf) {
  // 2^(b-127) exactly: b=0 is the float32 subnormal 2^-127, so build it in float64 then round.
  auto e = sf.to(at::kInt) - 127;
  auto v = at::pow(at::scalar_tensor(2.0, at::kDouble), e.to(at::kDouble)).to(at::kFloat);
  return at::where(sf.eq(0xFF), at::full({}, std::numeric_limits<float>::quiet_NaN()), v);
}

at::Tensor e2m1_quantize(const at::Tensor& x) {
  auto xf = x.to(at::kFloat);
  auto m = xf.abs();
  // NOTES: nearest value of {0,.5,1,1.5,2,3,4,6}, ties to the even code, saturating; NaN -> 0
  // because every comparison is false.
  auto code = m.gt(0.25).to(at::kByte) + m.ge(0.75).to(at::kByte) + m.gt(1.25).to(at::kByte) +
              m.ge(1.75).to(at::kByte) + m.gt(2.5).to(at::kByte) + m.ge(3.5).to(at::kByte) +
              m.gt(5.0).to(at::kByte);
  return code + xf.lt(0).to(at::kByte) * 8;
}

at::Tensor e2m1_dequantize(const at::Tensor& c) {
  static const float kValues[16] = {0, .5f, 1, 1.5f, 2, 3, 4, 6, -0.f, -.5f, -1, -1.5f, -2, -3, -4, -6};
  auto table = at::from_blob(const_cast<float*>(kValues), {16}, at::kFloat).to(c.device());
  return table.index({c.to(at::kLong)});
}

at::Tensor pack_e2m1(const at::Tensor& codes) {
  auto b = blocked(codes.to(at::kByte), 2);
  using at::indexing::Ellipsis;
  return b.index({Ellipsis, 0}).bitwise_or(b.index({Ellipsis, 1}).bitwise_left_shift(4)).contiguous();
}

at::Tensor unpack_e2m1(const at::Tensor& packed) {
  auto lo = packed.bitwise_and(0x0F);
  auto hi = packed.bitwise_right_shift(4);
  auto sizes = packed.sizes().vec();
  sizes.back() *= 2;
  return at::stack({lo, hi}, -1).reshape(sizes);
}

QuantizedRows quantize_rows(const at::Tensor& x_in, ActRecipe recipe) {
  auto x = x_in.to(at::kFloat);
  QuantizedRows out;
  switch (recipe) {
    case ActRecipe::kFP8F32Block128: {
      auto scale = block_amax(x, 128) / kFP8Max;
      out.data = as_bytes(to_fp8(apply_blocks(x, scale, 128, true)));
      out.sf = as_bytes(scale);
      break;
    }
    case ActRecipe::kFP8UE8M0Block32: {
      auto scale = ceil_pow2(block_amax(x, 32) / kFP8Max);
      out.data = as_bytes(to_fp8(apply_blocks(x, scale, 32, true)));
      out.sf = float_to_ue8m0(scale);
      break;
    }
    case ActRecipe::kMXFP4: {
      auto scale = ceil_pow2(block_amax(x, 32) / kE2M1Max);
      out.data = pack_e2m1(e2m1_quantize(apply_blocks(x, scale, 32, true)));
      out.sf = float_to_ue8m0(scale);
      break;
    }
    case ActRecipe::kNVFP4: {
      // Dynamic per-row global scale g, UE4M3 block scales sf = e4m3(amax_block / (6 g)).
      auto g = x.abs().amax(-1, /*keepdim=*/true).clamp_min(kAmaxEps) / (kE2M1Max * kFP8Max);
      auto amax = blocked(x, 16).abs().amax(-1);
      auto sf = (amax / (g * kE2M1Max)).clamp_max(kFP8Max).to(at::kFloat8_e4m3fn);
      auto denom = sf.to(at::kFloat) * g;
      auto scaled = apply_blocks(x, denom, 16, true);
      auto codes = at::where(blocked(scaled, 16).isfinite().logical_and(denom.unsqueeze(-1).gt(0)),
                             blocked(scaled, 16), at::zeros({}, scaled.options()))
                       .reshape(x.sizes());
      out.data = pack_e2m1(e2m1_quantize(codes));
      out.sf = as_bytes(sf);
      out.global_sf = g.squeeze(-1).contiguous();
      break;
    }
  }
  return out;
}

at::Tensor dequantize_rows(const at::Tensor& data, const at::Tensor& sf, const at::Tensor& global_sf,
                           ActRecipe recipe, int64_t k) {
  switch (recipe) {
    case ActRecipe::kFP8F32Block128: {
      auto q = data.view(at::kFloat8_e4m3fn).to(at::kFloat);
      auto scale = sf.contiguous().view(at::kFloat);
      return apply_blocks(q, scale, 128, false);
    }
    case ActRecipe::kFP8UE8M0Block32: {
      auto q = data.view(at::kFloat8_e4m3fn).to(at::kFloat);
      return apply_blocks(q, ue8m0_to_float(sf), 32, false);
    }
    case ActRecipe::kMXFP4:
      return apply_blocks(e2m1_dequantize(unpack_e2m1(data)), ue8m0_to_float(sf), 32, false);
    case ActRecipe::kNVFP4: {
      auto v = apply_blocks(e2m1_dequantize(unpack_e2m1(data)), sf.view(at::kFloat8_e4m3fn).to(at::kFloat),
                            16, false);
      return v * global_sf.unsqueeze(-1);
    }
  }
  TORCH_CHECK(false, "unreachable recipe");
}

at::Tensor dequantize_weights(const at::Tensor& w, const at::Tensor& sf, const at::Tensor& global_sf,
                              WeightFormat format) {
  switch (format) {
    case WeightFormat::kFP8: {
      // Scales per (64-row chunk, 128-column block).
      auto s = sf.repeat_interleave(64, 0).repeat_interleave(128, 1);
      return w.to(at::kFloat) * s;
    }
    case WeightFormat::kMXFP4:
      return apply_blocks(e2m1_dequantize(unpack_e2m1(w)), ue8m0_to_float(sf), 32, false);
    case WeightFormat::kNVFP4: {
      auto v = apply_blocks(e2m1_dequantize(unpack_e2m1(w)), sf.to(at::kFloat), 16, false);
      return v * global_sf.to(at::kFloat);
    }
  }
  TORCH_CHECK(false, "unreachable format");
}

}  // namespace megamoe::cpu
