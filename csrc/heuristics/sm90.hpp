// The one place where sm90 kernel configurations are chosen. Every rejected candidate has its reason.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <set>
#include <tuple>

namespace megamoe::heuristics {

struct GroupedGemmConfig {
  int block_m;     // tokens per tile (the wgmma N dimension): 16, 32 or 64
  int num_stages;  // TMA pipeline depth
  int k_splits;    // K segments per tile (split K for decode), 1 = none
};

// Shared memory one stage takes: 256 x 128 weight bytes + block_m x 128 token bytes.
constexpr int stage_bytes(int block_m) { return 256 * 128 + block_m * 128; }

// Deepest TMA pipeline that fits beside the largest epilogue (L2: block_m x 256 bf16) in the 227 KB a
// block may use (minus alignment slack and barriers): 6, 5 and 4 stages for block_m 16, 32 and 64.
constexpr int num_stages_for(int block_m) {
  return (227 * 1024 - 2048 - block_m * 256 * 2) / stage_bytes(block_m);
}

inline GroupedGemmConfig choose_grouped_gemm(int64_t num_tokens, int64_t top_k, int64_t num_experts, int64_t hidden,
                                             int64_t intermediate) {
  // Expected rows per touched expert. NOTES: decode is weight-bound: a block_m larger than the rows an
  // expert gets only wastes MMA work, never bytes; prefill wants the widest tile (fewest weight
  // re-reads, best MMA efficiency), capped at 64 by the registers of two partial accumulators.
  const int64_t slots = num_tokens * top_k;
  const int64_t rows = slots <= num_experts ? 1 : (slots + num_experts - 1) / num_experts;
  GroupedGemmConfig c;
  c.block_m = rows <= 16 ? 16 : rows <= 32 ? 32 : 64;
  c.num_stages = num_stages_for(c.block_m);
  // Split K in 4 when at most a quarter of the experts can be touched (T*K <= E/4, e.g. T <= 10 on
  // V4-Flash): then only ~16 weight tiles per touched expert exist, fewer than the SMs, and whole-K tiles
  // leave SMs idle while the busy ones stream 1 MB each. The rule depends on rows per expert only, so EP
  // ranks and a single GPU with the same load choose the same split (same bits). MEGAMOE_K_SPLITS overrides.
  // The kernel itself falls back to 1 when more than layout::kMaxSplitTiles tiles exist.
  c.k_splits = c.block_m == 16 && slots * 4 <= num_experts ? 4 : 1;
  if (const char* env = std::getenv("MEGAMOE_K_SPLITS")) {
    const int v = std::atoi(env);
    if (v >= 1 && v <= 8) c.k_splits = c.block_m == 16 ? v : 1;
  }
  if (std::getenv("MEGAMOE_PRINT_CONFIGS") != nullptr) {
    static std::mutex mu;
    static std::set<std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>> printed;
    std::lock_guard<std::mutex> lock(mu);
    if (printed.insert({num_tokens, top_k, num_experts, hidden, intermediate}).second)
      std::printf("megamoe: sm90 grouped GEMM T=%lld K=%lld E=%lld H=%lld I=%lld -> block_m=%d stages=%d "
                  "k_splits=%d\n", (long long)num_tokens, (long long)top_k, (long long)num_experts, (long long)hidden,
                  (long long)intermediate, c.block_m, c.num_stages, c.k_splits);
  }
  return c;
}

}  // namespace megamoe::heuristics
