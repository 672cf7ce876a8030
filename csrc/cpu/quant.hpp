// Bit-exact ATen versions of megamoe.formats (see docs/decisions.md), used by the CPU ops and by
// transform_weights. Inputs are float32 unless noted; blocks run along the last dimension.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

#include "megamoe/common.hpp"

namespace megamoe::cpu {

constexpr double kFP8Max = 448.0;
constexpr double kE2M1Max = 6.0;
constexpr double kAmaxEps = 1e-4;

// Positive float32 -> the next power of two (by bits); returns the float32 value.
at::Tensor ceil_pow2(const at::Tensor& s);
at::Tensor ue8m0_to_float(const at::Tensor& sf);  // uint8 -> float32, 0xFF -> NaN
at::Tensor float_to_ue8m0(const at::Tensor& s);   // exact power of two -> uint8 exponent field

at::Tensor e2m1_quantize(const at::Tensor& x);     // float32 -> uint8 codes
at::Tensor e2m1_dequantize(const at::Tensor& c);   // uint8 codes -> float32
at::Tensor pack_e2m1(const at::Tensor& codes);     // [..., K] -> [..., K/2]
at::Tensor unpack_e2m1(const at::Tensor& packed);  // [..., K/2] -> [..., K]

// Quantized activations of one recipe: element bytes (fp8 or packed e2m1), scale bytes per row
// (float32 / UE8M0 / UE4M3 reinterpreted as uint8) and, for NVFP4, the float32 per-row global scale.
struct QuantizedRows {
  at::Tensor data;       // uint8 [rows, K] (fp8) or [rows, K/2] (fp4)
  at::Tensor sf;         // uint8 [rows, sf bytes]
  at::Tensor global_sf;  // float32 [rows] (NVFP4) or undefined
};
// Scale bytes per row of K: K / divisor (float32 per 128 and UE8M0 per 32 are both K/32 bytes).
inline int64_t recipe_sf_divisor(ActRecipe r) { return r == ActRecipe::kNVFP4 ? 16 : 32; }

QuantizedRows quantize_rows(const at::Tensor& x, ActRecipe recipe);
at::Tensor dequantize_rows(const at::Tensor& data, const at::Tensor& sf, const at::Tensor& global_sf,
                           ActRecipe recipe, int64_t k);

// Kernel-layout weights of one expert -> float32 [N, K].
at::Tensor dequantize_weights(const at::Tensor& w, const at::Tensor& sf, const at::Tensor& global_sf,
                              WeightFormat format);

}  // namespace megamoe::cpu
