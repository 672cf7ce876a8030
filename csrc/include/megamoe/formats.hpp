// Format and recipe enums shared by host code and kernels (no ATen: .cu files include this).
#pragma once

namespace megamoe {

// ---------------------------------------------------------------------------------------------
// Formats
// ---------------------------------------------------------------------------------------------
enum class WeightFormat : int { kFP8 = 0, kMXFP4 = 1, kNVFP4 = 2 };
enum class ActFormat : int { kFP8 = 0, kFP4 = 1 };

// FP4 weight block scales in the kernel layout (transform_weights): per expert N rows of K / blk bytes (blk 32 for
// MXFP4, 16 for NVFP4) as "scale tiles" where N % 256 == 0 and K / blk % 16 == 0 (every V4 shape): [N / 256][K / blk /
// 16][256 rows][16 bytes], so that a 256-row weight tile's scales over 16 bytes of K (two MXFP4 stages of 256 K, one
// NVFP4 stage) are 4 KB in one piece, one bulk copy (a 128-row tile's: 2 KB); otherwise the rows as they are. Why: the
// per-row scale reads (16 bytes of each 128-224-byte row) cost the FP4 decode stream 4-9 % of its time (H100,
// 2026-11-27: ablate.py fp4-no-weight-scales), and a TMA box of 256 such rows did not take it back at decode.
constexpr int kScaleTileRows = 256;
constexpr int kScaleTileBytes = 16;
constexpr int fp4_scale_block(WeightFormat f) { return f == WeightFormat::kNVFP4 ? 16 : 32; }
constexpr bool fp4_scale_tiles(WeightFormat f, long long n, long long k) {
  return f != WeightFormat::kFP8 && n % kScaleTileRows == 0 && (k / fp4_scale_block(f)) % kScaleTileBytes == 0;
}

// How activations are quantized (into L1 and into L2); follows from (weight format, act format).
// See docs/decisions.md.
enum class ActRecipe : int {
  kFP8F32Block128 = 0,  // E4M3, float32 scale per 128 (FP8 block weights)
  kFP8UE8M0Block32 = 1, // E4M3, UE8M0 scale per 32 (w4a8)
  kMXFP4 = 2,           // E2M1, UE8M0 scale per 32 (w4a4, MXFP4 weights)
  kNVFP4 = 3,           // E2M1, UE4M3 scale per 16 + float32 per token (w4a4, NVFP4 weights)
};

}  // namespace megamoe
