// Format and recipe enums shared by host code and kernels (no ATen: .cu files include this).
#pragma once

namespace megamoe {

// ---------------------------------------------------------------------------------------------
// Formats
// ---------------------------------------------------------------------------------------------
enum class WeightFormat : int { kFP8 = 0, kMXFP4 = 1, kNVFP4 = 2 };
enum class ActFormat : int { kFP8 = 0, kFP4 = 1 };

// How activations are quantized (into L1 and into L2); follows from (weight format, act format).
// See docs/decisions.md.
enum class ActRecipe : int {
  kFP8F32Block128 = 0,  // E4M3, float32 scale per 128 (FP8 block weights)
  kFP8UE8M0Block32 = 1, // E4M3, UE8M0 scale per 32 (w4a8)
  kMXFP4 = 2,           // E2M1, UE8M0 scale per 32 (w4a4, MXFP4 weights)
  kNVFP4 = 3,           // E2M1, UE4M3 scale per 16 + float32 per token (w4a4, NVFP4 weights)
};

}  // namespace megamoe
