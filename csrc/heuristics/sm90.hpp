// The one place where sm90 kernel configurations are chosen. Every rejected candidate has its reason.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <set>
#include <string>

namespace megamoe::heuristics {

struct GroupedGemmConfig {
  int block_m;         // tokens per tile (the wgmma N dimension): 16, 32, 64 or (FP8) 128
  int num_stages;      // TMA pipeline depth
  bool fused = false;  // FP8: L1 and L2 in one persistent launch
  bool pairs = false;  // FP8: that launch in CTA pairs sharing each weight tile (routing in 2 x block_m row blocks)
  int tail_rows = 0;   // FP8: rows an expert's last token block may hold beyond block_m (fp8_tail_rows)
  bool rotate_rounds = false;  // FP8, two launches: each round's tiles rotated among the CTAs (rotate_rounds)
  int routing_block() const { return pairs ? 2 * block_m : block_m; }
};

// FP8, block_m 64 (not the pair walk): an expert's last token block holds up to 64 + 16 rows, so rows 65-80, 129-144,
// ... take no block of their own; the kernel runs such a wide block on m64n80 wgmmas (its other blocks: m64n64).
// NOTES: at prefill an expert's rows scatter around the mean (uniform routing: sd ~11 at V4-Pro T=8192, 128 rows
// mean; ~14 at V4-Flash T=8192, 192 rows), and about half of the experts overflow their last full block by a few
// rows, each costing a tile of its own (the 256 weight rows streamed again); the wide block costs about 80 / 64 of a
// tile instead. H100 A/B (2026-11-26, 2 rounds, docs/bench/h100-2026-11-26c-ab-fp8-wide-tail.json; time over main's,
// per replay / in a graph): V4-Flash T=6144 (144 rows) -6.1 / -3.5 %, 8192 -1.9 / -4.3 %; V4-Pro T=4096 (64 rows)
// -3.4 / -5.2 %, 8192 -3.1 / -5.0 %; T=2048 and the block_m 128 sizes (V4-Flash 4096, V4-Pro 6144) within +-1.3 %;
// T = 1-512 (other block sizes) within +-1.6 % (-decode.json). The same build with the tail off read +0.4 / +4.3 % at
// V4-Flash 8192 (its fragment and token tile are sized for 80 columns) and within +-0.4 % elsewhere.
// The tail stays 0 for the other block sizes (decode: a block is taken up to ~85 % of its width; block_m 128: the
// one-partial loop has no registers for more columns). MEGAMOE_FP8_WIDE_TAIL=0 (read per call) turns it off, and
// with it the block_m 64 cut at 88 rows (back to 128 from 65: choose_grouped_gemm).
constexpr int fp8_tail_rows(int block_m, bool pairs) { return block_m == 64 && !pairs ? 16 : 0; }
// Token columns of the FP8 kernel's widest tile (its token tile in shared memory, its epilogue staging).
constexpr int fp8_tile_cols(int block_m, bool pairs) { return block_m + fp8_tail_rows(block_m, pairs); }

// Shared memory one stage takes: 256 x 128 weight bytes + tile_cols x 128 token bytes.
constexpr int stage_bytes(int tile_cols) { return 256 * 128 + tile_cols * 128; }

// The L2 epilogue's staged row per token: 256 bf16 outputs + 16 bytes (no bank conflicts, rows stay contiguous).
constexpr int kStagedL2RowBytes = 256 * 2 + 16;
// Deepest TMA pipeline that fits beside the largest epilogue (L2: a staged row per token column) in the 227 KB a
// block may use (minus alignment slack and barriers): 6, 5, 4 and 3 stages for block_m 16, 32, 64 (80 columns with
// the wide tail; 64 in the pair walk) and 128.
constexpr int num_stages_for(int block_m, bool pairs = false) {
  const int cols = fp8_tile_cols(block_m, pairs);
  return (227 * 1024 - 2048 - cols * kStagedL2RowBytes) / stage_bytes(cols);
}
static_assert(num_stages_for(16) == 6 && num_stages_for(32) == 5 && num_stages_for(64) == 4 &&
              num_stages_for(64, true) == 4 && num_stages_for(128) == 3, "stage counts");

// The token block for an expected `rows` per touched expert, at most max_block_m. NOTES: decode is weight-bound: a
// block_m larger than the rows an expert gets only wastes MMA work, never bytes; prefill wants the widest tile.
// block_m 128 (FP8 only: the 256 x 128 tile with one partial accumulator; an expert's last block of at most 64 rows
// runs m64n64 wgmmas in it) runs a 128-K stage of 2^22 MACs in ~1,840 cycles against 2 x ~1,050 for the 256 x 64
// tile (tile trace, H100, V4-Flash T=8192, 2026-11-25): only 0.87x the cycles per MAC. It pays where it saves a
// padded 64-row block. H100 A/Bs (2026-11-25, 2 rounds; time per replay / in a graph over block_m 64's): for every
// rows > 64 (docs/bench/h100-2026-11-25e-ab-block128-all-rows.json) V4-Flash T=4096 (96 rows) -5.0 / -3.5 %, but
// V4-Pro T=8192 (128 rows, half the experts over 128) +1.9 / +0.5 % and V4-Flash T=8192 (192 rows) +3.3 / +3.7 %;
// with this cut (-cut.json) V4-Flash T=3072 (72 rows) -2.4 / -8.9 %, T=4096 -3.7 / -2.8 %, V4-Pro T=6144 (96 rows)
// -11.7 / -10.8 %. So 64 < rows <= 112 (the cut between the measured 96 and 128 rows is not measured itself).
// Since the wide last block (fp8_tail_rows), block_m 64 takes 65-80 rows in one m64n80 tile: forced against block_m 128
// (H100, 2026-11-26, 2 rounds, docs/bench/h100-2026-11-26c-ab-fp8-block64-tail-vs-128.json; per replay / in a graph)
// it ran -3.5 / -9.7 % at 66 expected rows (V4-Flash T=2816), -4.2 / -6.7 % at 72, -0.9 / -4.8 % at 81, -3.7 / -3.9 %
// at 68 (V4-Pro T=4352), -3.6 / -3.5 % at 76, and +4.8 / +3.1 % at 102 (V4-Flash 4352). So block_m 128 for
// 88 < rows <= 112 (the cut between the measured 81 and 102 rows is not measured itself).
// 16 / 32 / 64: an expert's rows scatter around the mean (uniform routing: Poisson-like), and each row past a block
// costs a whole second tile (its weights streamed again, mostly from L2; for FP4 decoded again, which bounds those
// kernels), so a block is taken only up to ~85 % of its width (FP8 block_m 64 since the wide last block: up to 88
// rows, above). NOTES: H100 A/Bs (2026-11-26, 1 round each; time per
// replay and in a graph). FP4, every format pair (docs/bench/h100-2026-11-26-ab-fp4-block-m.json): at 16 rows (V4-Pro
// T=1024) block_m 32 ran 16-24 % faster than 16, at 32 rows (V4-Pro T=2048) 64 ran 10-14 % faster than 32; at 12 rows
// (V4-Flash T=512) 16 beat 32 by 4-25 %, at 24 (V4-Flash T=1024) 32 beat 64 by 15-36 %, at 4-8 rows 16 beat 32 by
// 5-34 %. FP8 (-ab-fp8-block-m.json): 16 rows 32 -6.5 %, 32 rows 64 -5 %, 12 rows 32 or 64 within 1 % of 16. The cuts
// (13 and 27 rows) are not measured themselves: they lie between those points, where a Poisson count passes its block
// ~20 % of the time (about what the next block width costs the FP4 kernels where nothing passes). Before: 16 / 32 / 64
// up to 16 / 32 / 64 rows.
// MEGAMOE_FP8_BLOCK_M=16/32/64/128 and MEGAMOE_FP4_BLOCK_M=16/32/64 (128 where fp4_block128_recipe) (read per call;
// tests) force the kernels'.
inline int token_block_for(int64_t rows, int max_block_m) {
  const int b = rows <= 13 ? 16 : rows <= 27 ? 32 : rows <= 88 ? 64 : rows <= 112 ? 128 : 64;
  return b < max_block_m ? b : max_block_m;
}

// `var` (read per call; tests and A/Bs), if set to a token block of 16 up to max_block_m, replaces block_m.
inline int forced_block_m(const char* var, int block_m, int max_block_m) {
  const char* env = std::getenv(var);
  if (env == nullptr || env[0] == '\0') return block_m;
  // Exactly "16", "32", "64" or "128" (as tests/test_gpu_fp8.py's gemm_block_m reads it; atoi would take "64 " too).
  const std::string value(env);
  const int forced = value == "16" ? 16 : value == "32" ? 32 : value == "64" ? 64 : value == "128" ? 128 : 0;
  if (forced != 0 && forced <= max_block_m) return forced;
  std::fprintf(stderr, "megamoe: %s=%s ignored (expected 16, 32%s)\n", var, env,
               max_block_m == 128 ? ", 64 or 128" : " or 64");
  return block_m;
}

// MEGAMOE_PRINT_CONFIGS: each configuration chosen, once per problem shape, weight family and configuration (a
// setting switched per call prints its own line). The FP8-only fields (one launch, pairs, tail rows, rotation) are
// left out for FP4, whose tail rows and rotation are chosen after this (cuda_fp4_ops.cpp).
inline void print_config_once(const char* family, int64_t num_tokens, int64_t top_k, int64_t num_experts,
                              int64_t hidden, int64_t intermediate, int64_t num_ranks, const GroupedGemmConfig& c) {
  if (std::getenv("MEGAMOE_PRINT_CONFIGS") == nullptr) return;
  char line[320];
  int n = std::snprintf(line, sizeof(line), "megamoe: sm90 %s grouped GEMM T=%lld K=%lld E=%lld H=%lld I=%lld ranks=%lld "
                        "-> block_m=%d stages=%d", family, (long long)num_tokens, (long long)top_k,
                        (long long)num_experts, (long long)hidden, (long long)intermediate, (long long)num_ranks,
                        c.block_m, c.num_stages);
  if (std::string(family) == "FP8" && n > 0 && n < int(sizeof(line)))
    std::snprintf(line + n, sizeof(line) - n, " fused=%d pairs=%d tail_rows=%d rotate_rounds=%d", int(c.fused),
                  int(c.pairs), c.tail_rows, int(c.rotate_rounds));
  static std::mutex mu;
  static std::set<std::string> printed;
  std::lock_guard<std::mutex> lock(mu);
  if (printed.insert(line).second) {
    std::printf("%s\n", line);
    std::fflush(stdout);  // one line at a time where ranks share a pipe
  }
}

// The FP4 kernels' static walk (CTA b takes units b, b + grid, ...) rotates each round's tiles by the round index
// (split_unit) where some expert likely holds more than one token block (mean + one standard deviation past the
// block's rows, tail rows included): token blocks are innermost and the grid (132) is a multiple of 2, 3 and 4, so
// without it every CTA takes the same token block of each expert (the even CTAs every full block, the odd ones every
// short last block at 2 blocks) and half the grid idles at the end. The same tiles run either way (the same bits).
// NOTES: H100 A/B (2026-11-26, 2 rounds, w4a8, rotation at every token count, over main's, per replay / in a graph;
// docs/bench/h100-2026-11-26m-ab-fp4-rotate-rounds.json): where experts have several blocks: MXFP4 V4-Flash 8192
// (192 rows, block_m 128) 0.933 / 0.951, V4-Pro 8192 (128) 0.938 / 0.937, V4-Flash 6144 (144, block_m 64) 0.987 /
// 0.996; NVFP4 V4-Flash 4096 (96, block_m 64) 0.924 / 0.936, V4-Pro 4096 (64) 0.934 / 0.969, 6144 0.923 / 0.933, 8192
// 0.966 / 0.967, V4-Flash 6144 0.989 / 0.991, 8192 1.008 / 0.990. Where every expert holds one block: MXFP4 V4-Flash
// 4096 (96 rows, block_m 128) 1.069 / 0.996, V4-Pro 4096 (64) 1.018 / 1.008, V4-Pro 6144 (96) 0.985 / 0.989, T = 1 /
// 512 1.00-1.01: not rotated there. With several ranks each rank decides from its own token count (the same bits
// either way). MEGAMOE_FP4_ROTATE_ROUNDS=0 / 1 (read per call; tests) forces it off / on. The FP8 kernel's static walk
// (two launches: by default only one rank at one round of L1 tiles, where it does not rotate; MEGAMOE_FP8_FUSED=0
// elsewhere) takes the same rule (MEGAMOE_FP8_ROTATE_ROUNDS; choose_grouped_gemm). NOTES: measured while peers ran two
// launches past 96 rows per local expert, 4 x H200 EP=4 FP8 A/B (2026-11-26, two runs, rotated over not,
// docs/bench/h200x4-2026-11-26o-ep4-fp8-rotate-ab*.json): V4-Pro 2048 / 8192 tokens per rank (128 / 512 rows, 2 / 8
// blocks) 0.972 / 0.970 and 0.970 / 0.963; V4-Flash 2048 / 8192 1.011 / 1.002 and 0.996 / 0.995. The same session
// then measured one launch faster still there (choose_grouped_gemm), so the rotation runs where two launches are
// forced.
inline bool rotate_rounds(const char* var, int64_t expected_rows, int block_m, int tail_rows) {
  const char* env = std::getenv(var);
  if (env != nullptr && (env[0] == '0' || env[0] == '1') && env[1] == '\0') return env[0] == '1';
  return double(expected_rows) + std::sqrt(double(expected_rows)) > double(block_m + tail_rows);
}
inline bool fp4_rotate_rounds(int64_t expected_rows, int block_m, int tail_rows) {
  return rotate_rounds("MEGAMOE_FP4_ROTATE_ROUNDS", expected_rows, block_m, tail_rows);
}

// Routing's count pass with peers reads every rank's slot ids in one flat pass (one load round trip instead of one
// per rank) where they fit one pass of the block (decode; sm90_routing.cu, NOTES there). The same counts either way.
// MEGAMOE_ROUTING_FLAT=0 (read per call; bench_ep --alt-env) reads rank by rank.
inline bool routing_flat_reads() {
  const char* env = std::getenv("MEGAMOE_ROUTING_FLAT");
  return !(env != nullptr && env[0] == '0' && env[1] == '\0');
}

// With peers, routing reads every rank's token count and slot ids where that rank's pre_dispatch pushed them, in its
// own buffer (layout recv_*), instead of from the rank's buffer over NVLink: two round trips fewer per call at
// decode (~1.6 and ~2 µs on 4 x H100, ep_trace.py, 2026-11-27). In a graph on 4 x H200, V4-Flash, over reading
// over NVLink: 1 token per rank 0.979 (FP8) / 0.987 (MXFP4), 16-128 0.989-0.999 (2026-11-27). pre_dispatch always
// pushes; MEGAMOE_EP_PUSH=0 (read per call; A/Bs, tests) reads over NVLink.
inline bool ep_read_pushed() {
  const char* env = std::getenv("MEGAMOE_EP_PUSH");
  return !(env != nullptr && env[0] == '0' && env[1] == '\0');
}

// Expected experts with at least one of num_tokens x top_k uniformly routed slots: E (1 - (1 - k / E)^T).
inline double expected_touched_experts(int64_t num_tokens, int64_t top_k, int64_t num_experts) {
  const double miss = 1.0 - std::min(1.0, double(top_k) / double(num_experts));
  return double(num_experts) * (1.0 - std::pow(miss, double(num_tokens)));
}

inline GroupedGemmConfig choose_grouped_gemm(int64_t num_tokens, int64_t top_k, int64_t num_experts, int64_t hidden,
                                             int64_t intermediate, int64_t num_ranks = 1, int num_sms = 132) {
  // Expected rows per touched expert (token_block_for).
  const int64_t slots = num_tokens * top_k;
  const int64_t rows = slots <= num_experts ? 1 : (slots + num_experts - 1) / num_experts;
  GroupedGemmConfig c;
  const char* tail_env = std::getenv("MEGAMOE_FP8_WIDE_TAIL");
  const bool tail_off = tail_env != nullptr && tail_env[0] == '0';
  int block = token_block_for(rows, 128);
  // Without the wide last block, block_m 128 from 65 rows, the cut measured before it (token_block_for).
  if (tail_off && block == 64 && rows > 64 && rows <= 112) block = 128;
  c.block_m = forced_block_m("MEGAMOE_FP8_BLOCK_M", block, 128);
  // NOTES: one launch for L1 and L2 (L2 tiles start as soon as their expert's L1 tiles are stored, on SMs
  // that finished L1, instead of after L1's tail and a second launch ramp). H100 A/B of this kernel vs two
  // launches (2026-11-23, docs/bench/h100-2026-11-23b-ab-fused-v2*.json): V4-Pro T=1 / 2048 / 4096 -4.3 / -16 /
  // -11 %, V4-Flash T=512 / 4096 -5.6 / -4.7 %, V4-Flash T=1 and 8192 within 1 % (second run). With peers
  // (2xH200 EP=2, V4-Flash, bench_ep --alt-env, two runs, docs/bench/h200-2026-11-23-ep2-fused-ab*.json):
  // 16-512 tokens per rank -5 %, 2048 -8 %, 1 within noise (+4.7 / -1.4 %), 8192 +2.2 / +5.0 % (two launches
  // then kept past 96 rows per local expert; not since 2026-11-27, below). MEGAMOE_FP8_FUSED=1 / =0 forces one
  // launch / two everywhere (read per call: tests and bench_ep compare both in one process).
  const char* fused_env = std::getenv("MEGAMOE_FP8_FUSED");
  // On one rank, two launches where L1's expected tiles fit one round of the grid (V4-Flash T=1: 96 tiles on 132
  // SMs): all of L1 ends at once, so there is no L1 tail for L2 to overlap, and the walk's per-tile counting costs
  // more than the second launch's ramp. H100 A/B (2026-11-26, docs/bench/h100-2026-11-26f-ab-fp8-fused-recheck.json,
  // 2 rounds, two launches over one, per replay / in a graph): V4-Flash T=1 0.968 / 0.964, V4-Pro T=1 (144 tiles)
  // 1.072 / 1.070, T = 16-8192 1.009-1.409 (8192: 1.24 / 1.41).
  const bool one_round_l1 = expected_touched_experts(num_tokens, top_k, num_experts) *
                                double((2 * intermediate + 255) / 256) <= double(num_sms);
  const bool forced = fused_env != nullptr && fused_env[0] == '1', off = fused_env != nullptr && fused_env[0] == '0';
  // With peers: one launch at every size. NOTES: 4 x H100 EP=4 FP8 (2026-11-27, bench_ep, three runs, one in reversed
  // order, the third on this rule; docs/bench/h100x4-2026-11-27-ep4-fp8-fused-*.json), two launches over one:
  // V4-Flash 2048 / 8192 tokens per rank (192 / 768 rows per local expert) 1.253 / 1.075, 1.265 / 1.091 and 1.260 /
  // 1.094, V4-Pro (128 / 512 rows) 1.348 / 1.098, 1.347 / 1.115 and 1.349 / 1.142;
  // 1024 (96 / 64 rows, one launch before too) 1.011 / 1.024. The cut at 96 rows came from EP=2 on 2026-11-23 (8192
  // tokens per rank +2 / +5 % for one launch), before the fused walk's two producer warps and later changes.
  c.fused = forced || (!off && (num_ranks > 1 || !one_round_l1));
  // NOTES: the pair walk (two CTAs of a cluster take two 64-row token blocks of one expert and TMA-multicast the
  // weight tile's halves into both) cuts the L2 -> SM bytes of a CTA-stage from 40 to 24 KB. Off by default: H100 A/B
  // (2026-11-25, docs/bench/h100-2026-11-25-ab-pairs-rejected.json) V4-Flash 4096 / 8192 +8 / +36 %, V4-Pro 8192
  // +27 %; in a second run +8 / +43 / +21 %, and the same walk without multicast +11 / +48 / +24 % (-no-multicast-
  // rejected.json). Tile traces: its L1 main loop per tile is unchanged
  // (Flash 21.5 vs 20.9 µs, Pro 37.8 vs 38.0) while phantom halves add CTA-tiles; probe_mma.py shows multicast
  // cutting a 132-SM stream's cost per stage by 43 %, so the kernel's per-stage limit lies elsewhere (perf-notes,
  // twelfth session). MEGAMOE_FP8_PAIRS=1 turns it on wherever the fused launch runs with block_m 64 (tests do).
  const char* pairs_env = std::getenv("MEGAMOE_FP8_PAIRS");
  const bool pairs_on = pairs_env != nullptr && pairs_env[0] == '1';
  if (c.fused && pairs_on && c.block_m == 128) c.block_m = 64;  // the pair walk's blocks are 64 rows
  c.pairs = c.fused && c.block_m == 64 && pairs_on;
  c.tail_rows = tail_off ? 0 : fp8_tail_rows(c.block_m, c.pairs);
  c.rotate_rounds = !c.fused && rotate_rounds("MEGAMOE_FP8_ROTATE_ROUNDS", rows, c.block_m, c.tail_rows);
  c.num_stages = num_stages_for(c.block_m, c.pairs);
  print_config_once("FP8", num_tokens, top_k, num_experts, hidden, intermediate, num_ranks, c);
  return c;
}

// MXFP4 weights on FP8 wgmmas (sm90_fp4_grouped_gemm.cuh, kFP8Mma) instead of the BF16 decode, for both token
// formats. NOTES: A/Bs on an H200 (2026-11-23, docs/bench/h200-2026-11-23-ab-mxfp4-fp8mma-*.json): with MXFP4 tokens
// (w4a4) -5 to -7 % at T=16-512, -3 to -4 % at T=1, within 2 % at 2048-8192 (two runs). With FP8 tokens (w4a8) it was
// +10 % at decode and +30-50 % at prefill while every tile folded its tokens (perf-notes, eighth session); since the
// tokens arrive folded (fp4_folded_tokens: the gather folds L1's, L1's epilogue L2's), H100, 2026-11-26, 2 rounds,
// per replay over the BF16 path (docs/bench/h100-2026-11-26i-ab-mxfp4-w4a8-fold-l2.json): V4-Flash 0.98 / 0.98 /
// 0.98 / 0.87 / 1.02 / 0.93 / 0.88 / 0.91 at T = 1 / 16 / 128 / 512 / 1365 / 2048 / 4096 / 8192, V4-Pro 1.00 / 0.98 /
// 0.98 / 0.93 / 0.92 / 1.00 / 0.88 / 0.84.
// NOTES: at 28-44 expected rows per expert (block_m 64 at most ~2/3 full: V4-Flash 1365, V4-Pro 2048 above; w4a4:
// docs/bench/h100-2026-11-26f-ab-mxfp4-w4a4-*.json) the BF16 path's narrow wgmmas beat this path's m64n64 by 0-10 %.
// The paths round differently, and a choice by token count breaks EP's bitwise equality with EP=1 (each rank sees
// its own token count; tests/ep_cases.py), so the default stays by recipe; MEGAMOE_MXFP4_FP8MMA=0 takes the BF16
// path where that equality does not matter.
// MEGAMOE_MXFP4_FP8MMA=1 / =0 (read per call) forces it on / off.
inline bool choose_mxfp4_fp8_mma() {
  const char* env = std::getenv("MEGAMOE_MXFP4_FP8MMA");
  if (env != nullptr && (env[0] == '0' || env[0] == '1')) return env[0] == '1';
  return true;
}

// FP4 GEMV path for one token on one rank (sm90_fp4_gemv.cu; docs/plans/fp4-gemv.md): MXFP4 weights with FP8 or MXFP4
// tokens (UE8M0 per 32: w4a8, w4a4), NVFP4 weights with FP8 or NVFP4 tokens (w4a8, w4a4: L2 quantizes L1's float32
// outputs itself, the per-row global scale needing the whole row), hidden and intermediate multiples of 128, two ring
// stages of either layer in shared memory (fp4_gemv_stages). Exact
// products and float32 sums on mma.sync (NVFP4; MXFP4 where fp4_gemv_fp8_mma leaves a layer on the BF16 form), or the
// FP8-wgmma walk's roundings on FP8 wgmmas (MXFP4, fp4_gemv_fp8_mma), summed in another order than the walk's: other
// bits, so not with peers (EP's ranks must round alike whatever their token counts; the EP tests' EP=1 runs turn it
// off).
// MEGAMOE_FP4_GEMV=0 (read per call; tests) turns it off; the tile walk's own switches (MEGAMOE_FP4_BLOCK_M,
// _SPLIT_ROUND, ...) act with it off.
// NOTES (H100, 2026-11-27, perf-notes forty-second session), time over the walk's at V4-Flash / V4-Pro T=1: MXFP4 w4a8
// 0.86x / 0.96x, w4a4 0.94x / 0.98x, NVFP4 w4a8 0.81x / 0.92x (v1, lanes loading straight from global memory, lost:
// 1.15x / 1.34x). NVFP4 w4a4 (forty-third session) 0.89x / 0.93x.
constexpr int kFp4GemvTileRows = 16;     // rows of a ring stage: one m16 tile
constexpr int kFp4GemvMaxStages = 8;
constexpr int kFp4GemvMaxSlots = 64;       // top_k
// barriers, slot ids, the slots' NVFP4 token global scales, the slots a CTA quantizes and their count, zeros, the
// partial sums' barriers (4), the E2M1 -> E4M3 fold tables at 1024 (the MXFP4 FP8-mma form); padded
// to a whole number of 128-byte lines so that the ring (after the header, the partial sums and the token, all whole
// lines) starts on a line. NOTES (H100, 2026-11-27, forty-third / forty-fourth sessions, T=1, every FP4 pair): the
// ring 80 bytes past a line read 1.03-1.07x against 64 past; on a line 0.97-0.99x against 64 past (stage counts equal).
constexpr int kFp4GemvHeaderBytes = 1280;
constexpr int kFp4GemvTablesOffset = 1024;
static_assert(kFp4GemvTablesOffset >= 2 * kFp4GemvMaxStages * 8 + 12 * kFp4GemvMaxSlots + 16 + 64 + 4 * 8 &&
                  kFp4GemvHeaderBytes >= kFp4GemvTablesOffset + 24 * 8 &&
                  kFp4GemvHeaderBytes % 128 == 0, "the GEMV's shared-memory header (see above)");
constexpr int kFp4GemvPartBytes = 2 * 16 * 64 * 4;  // the consumer warps' partial sums, two items
constexpr int kFp4GemvSmemLimit = 232448;  // H100 / H200 / H20: 227 KB of dynamic shared memory a CTA
// A ring stage: 16 rows of k (E2M1), their k / scale_block scale bytes and (MXFP4) their 16 row exponents, rounded up
// to 128 bytes.
constexpr int fp4_gemv_stage_bytes(int64_t k, int scale_block) {
  return static_cast<int>((kFp4GemvTileRows * (k / 2 + k / scale_block + 1) + 127) / 128 * 128);
}
// The token(s) as bf16 B fragments: 64 bytes a 32-K block.
constexpr int fp4_gemv_token_bytes(int64_t blocks) { return static_cast<int>(blocks * 64); }
constexpr int fp4_gemv_smem_bytes(int64_t k, int scale_block, int64_t token_blocks, int stages) {
  return kFp4GemvHeaderBytes + kFp4GemvPartBytes + fp4_gemv_token_bytes(token_blocks) +
         stages * fp4_gemv_stage_bytes(k, scale_block);
}
// As many stages as fit, up to kFp4GemvMaxStages (V4-Flash L1 / L2: 6 / 8; V4-Pro: 3 / 6: 100-180 KB a SM in flight,
// where ~25 KB keep the H100's HBM busy).
inline int fp4_gemv_stages(int64_t k, int scale_block, int64_t token_blocks) {
  const int64_t free = kFp4GemvSmemLimit - fp4_gemv_smem_bytes(k, scale_block, token_blocks, 0);
  return free <= 0 ? 0
                   : static_cast<int>(std::min<int64_t>(kFp4GemvMaxStages, free / fp4_gemv_stage_bytes(k, scale_block)));
}
// The wgmma form's ring (sm90_fp4_gemv.cu, produce_chunks): a stage holds an item's 64 rows over one K chunk of
// kFp4GemvChunkK (rows, their scale bytes: MXFP4 16 a row and the 64 row exponents; NVFP4 32 a row), so that a
// warpgroup starts on one stage.
constexpr int kFp4GemvChunkK = 512;
constexpr int fp4_gemv_chunk_stage_bytes(bool nv) {
  return nv ? 64 * (kFp4GemvChunkK / 2 + kFp4GemvChunkK / 16)
            : (64 * (kFp4GemvChunkK / 2 + kFp4GemvChunkK / 32 + 1) + 127) / 128 * 128;
}
constexpr int kFp4GemvChunkStageBytes = fp4_gemv_chunk_stage_bytes(false);
// The wgmma forms' tiles of an item that are contiguous weight rows go by runs, each one TMA box (the layer's
// tmap_chunks: [16 x run rows][256 bytes]) and one copy of its scales (and MXFP4 row exponents): MXFP4 L1's item is 32
// gate rows and their 32 up rows (two runs of 2 tiles), L2's 64 rows (one run of 4); NVFP4 a tile a run (its stage
// keeps the scales by tile). A run starts at a multiple of its rows (L1: 128 (i / 64) + i % 64 for output i, a
// multiple of 32; L2: 64 an item), so its rows never cross a 256-row scale tile: their scale bytes are contiguous.
// NOTES (H100, T=1, 3 rounds, 2026-11-27): runs against a box and two copies a 16-row tile (12 copies a stage): V4-Pro
// MXFP4 0.973x the time, V4-Flash MXFP4 0.996-1.008x; NVFP4 in runs too: V4-Flash 1.024x (w4a8) / 1.058x (w4a4),
// V4-Pro 1.00x (docs/bench/h100-2026-11-27s-ab-gemv-runs.txt); with NVFP4 a tile a run, MXFP4 alone: V4-Pro
// 0.968-0.980x, V4-Flash 0.997-1.011x per replay, NVFP4 0.996-1.007x (-ab-gemv-runs-mxfp4.txt).
constexpr int fp4_gemv_run_tiles(bool l1, bool nv) { return nv ? 1 : l1 ? 2 : 4; }
static_assert(fp4_gemv_chunk_stage_bytes(true) % 128 == 0, "stages start 128-byte aligned (TMA)");
// The token area of the wgmma form: MXFP4 the folded bytes and a factor a 128-K group (within fp4_gemv_token_bytes);
// NVFP4 B operands with one token lane's bytes a column (128 bytes a 32-K step: consume_chunks_nv) and a float factor
// a 16-K block, rounded up to 128 bytes (the ring follows it).
constexpr int fp4_gemv_chunk_token_bytes(int64_t token_blocks, bool nv) {
  return nv ? static_cast<int>((token_blocks * (128 + 8) + 127) / 128 * 128) : fp4_gemv_token_bytes(token_blocks);
}
// Stages: kFp4GemvMaxStages (8) or 0 (the layer keeps the BF16 form). Warpgroup t % 4 takes stage t, and its wait on
// stage t % S with parity (t / S) & 1 holds only if stage t - S was its own (S a multiple of 4: otherwise another
// warpgroup's unconsumed use of the stage can pass for this one); 8 is the depth measured (a review of b57f8e0 found
// S = 1-7 reachable at top_k x intermediate beyond the DeepSeek shapes, e.g. top_k 40 x 2048: 3).
constexpr int fp4_gemv_chunk_smem_bytes(int64_t token_blocks, int stages, bool nv = false) {
  return kFp4GemvHeaderBytes + kFp4GemvPartBytes + fp4_gemv_chunk_token_bytes(token_blocks, nv) +
         stages * fp4_gemv_chunk_stage_bytes(nv);
}
inline int fp4_gemv_chunk_stages(int64_t token_blocks, bool nv = false) {
  static_assert(kFp4GemvMaxStages % 4 == 0, "whole rounds of the four warpgroups");
  return fp4_gemv_chunk_smem_bytes(token_blocks, kFp4GemvMaxStages, nv) <= kFp4GemvSmemLimit ? kFp4GemvMaxStages : 0;
}
// scale_block: the weights' (32: MXFP4, 16: NVFP4); supported: MXFP4 or NVFP4 weights with FP8 tokens or tokens of
// their own FP4 format.
inline bool fp4_gemv(int64_t num_tokens, int64_t num_ranks, bool supported, int scale_block, int64_t hidden,
                     int64_t intermediate, int64_t top_k) {
  if (num_tokens != 1 || num_ranks != 1 || !supported || hidden % 128 != 0 || intermediate % 128 != 0 ||
      top_k > kFp4GemvMaxSlots)
    return false;
  if (fp4_gemv_stages(hidden, scale_block, hidden / 32) < 2 ||
      fp4_gemv_stages(intermediate, scale_block, top_k * (intermediate / 32)) < 2)
    return false;
  const char* env = std::getenv("MEGAMOE_FP4_GEMV");
  return env == nullptr || env[0] != '0';
}

// Which GEMV layers give each CTA a run of consecutive items (bit 0: L1, bit 1: L2) instead of every gridDim.x-th
// (the same items a CTA, give or take one; the same bits). A run touches one or two slots, the turns most of them: L2
// with NVFP4 tokens quantizes every touched slot's float32 row in each CTA (V4-Pro: ~7 rows a CTA in turns, 1-2 in
// runs). MEGAMOE_FP4_GEMV_RUNS (read per call: 0-3) overrides.
// NOTES (H100, 2026-11-27, perf-notes forty-seventh session, T=1, 3 rounds, time over turns in both layers): L2 in
// runs 0.939 (V4-Pro NVFP4 w4a4; 1.565 -> 1.471 x floor), 0.997 (V4-Flash); the other pairs 0.993-1.011, L1 in runs
// too 0.997-1.022: runs for L2 with NVFP4 tokens only.
// A per-layer switch of the GEMV (bit 0: L1, bit 1: L2) from environment variable `name` ('0'-'3', read per call),
// else `fallback`.
inline int fp4_gemv_layer_bits(const char* name, int fallback) {
  const char* env = std::getenv(name);
  return env != nullptr && env[0] >= '0' && env[0] <= '3' ? env[0] - '0' : fallback;
}
inline int fp4_gemv_runs(bool nvfp4_tokens) { return fp4_gemv_layer_bits("MEGAMOE_FP4_GEMV_RUNS", nvfp4_tokens ? 2 : 0); }

// Which GEMV layers take MXFP4 weights on FP8 wgmmas (bit 0: L1, bit 1: L2; sm90_fp4_gemv.cu, consume_chunks) instead
// of the BF16 decode on mma.sync: each weight folded to E4M3 relative to its row's largest scale (the fold tables, as
// the FP8-wgmma walk), the token folded per 128-K group (one factor 2^(T - 127) a group), four m64n8k32 wgmmas a
// group: ~135 instructions a 128-K group and lane against ~180 (mma.sync has no native E4M3 on sm_90: ptxas unpacks to
// F16). The walk's FP8-wgmma roundings (weights exact within 14 binades of their row's largest scale, tokens rounded
// more than 17 binades below their group's largest), not the BF16 form's exact products. A layer takes it where its K
// is whole chunks of kFp4GemvChunkK (its ring of chunk stages: produce_chunks / consume_chunks).
// NOTES (H100, 2026-11-27, perf-notes forty-eighth session, T=1, 3 rounds, MXFP4, time per replay). The first ring (a
// tile of 16 rows over the whole K a stage) made an item's four tiles wait for each other; over the BF16 form: L2 alone
// 0.95-0.97, L1 1.00-1.06. The chunk ring, over that first form's L2 alone: both layers 0.942-0.943 at V4-Flash (x
// floor 1.525 / 1.504 for w4a4 / w4a8), 0.959 at V4-Pro (1.301); L2 alone 0.980-0.988, L1 alone 0.96 (V4-Flash) /
// 1.00-1.02 (V4-Pro).
// MEGAMOE_FP4_GEMV_FP8MMA (read per call: 0-3) overrides.
inline int fp4_gemv_fp8_mma() { return fp4_gemv_layer_bits("MEGAMOE_FP4_GEMV_FP8MMA", 3); }

// Which GEMV layers take NVFP4 weights on FP8 wgmmas (bit 0: L1, bit 1: L2 with FP8 tokens; sm90_fp4_gemv.cu,
// consume_chunks_nv) instead of the BF16 decode on mma.sync. E2M1 is exact in E4M3 and UE4M3 is not a power of two, so
// the weights go in unscaled (one fixed table) and the scales stay out of the MMA: B holds the token once a column,
// each column one lane's 8 K of a k32 step (the rest zero), so that each accumulator column is one 16-K block's sum of
// a row, scaled in float32 by its UE4M3 weight scale and the token's. Exact products, sums of 16 in the FP8 wgmma's
// accumulator. Count: ~140 SASS instructions a 128-K group and lane against the BF16 form's ~192 (no per-weight scale
// multiply, the PRMT decode). V4-Pro's L2 (top_k x 3072 of token at 4.25 bytes a K) leaves no room for 8 stages: BF16.
// NOTES (H100, 2026-11-27, perf-notes fifty-first session, T=1, 2-3 rounds, time per replay over the BF16 form; in a
// graph): V4-Flash w4a8 0.899 (0.887), x floor 1.614 -> 1.440; w4a4 (L1 only) 0.907 (0.897), 1.838 -> 1.653; V4-Pro
// w4a8 / w4a4 (L1 only) 0.974 / 0.964. L1 alone / L2 alone at V4-Flash w4a8: 0.927 / 0.929.
// MEGAMOE_FP4_GEMV_NV_FP8MMA (read per call: 0-3) overrides.
inline int fp4_gemv_nv_fp8_mma() { return fp4_gemv_layer_bits("MEGAMOE_FP4_GEMV_NV_FP8MMA", 3); }

// FP8-wgmma path (MXFP4 weights) with FP8 tokens: the gather folds L1's tokens per 128-K group (one factor each) as it
// copies them, and L1's epilogue writes L2's input folded the same way, instead of every tile's converter warps folding
// its tokens again (launch_gather's fold, Params::fold_output). Same folded values, so the same bits.
// MEGAMOE_MXFP4_FOLD_TOKENS=0 (read per call) folds in the kernel (both GEMMs).
// NOTES: H100, 2026-11-26, MXFP4 w4a8 forced onto the FP8-wgmma path, 1 round, per replay, over the BF16 path (then
// the default; docs/bench/h100-2026-11-26h-ab-mxfp4-fp8mma-gather-fold.json): folding L1's tokens in the gather
// 0.90-0.94 at T=8192, 0.97-1.03 at 512-2048, 0.98-1.00 at 1-128; folding in the kernel 1.05-1.06 / 1.00-1.11 /
// 0.98-0.99. L2's in L1's epilogue as well (-ab-mxfp4-w4a8-fold-l2.json, 2 rounds): another 3-10 % from T=512 on.
inline bool fp4_folded_tokens() {
  const char* env = std::getenv("MEGAMOE_MXFP4_FOLD_TOKENS");
  return env == nullptr || env[0] != '0';
}

// FP8-wgmma path with MXFP4 tokens (w4a4): the gather folds the dispatched tokens into an E4M3 workspace, L1 quantizes
// its outputs to MXFP4 and folds them for L2 into the workspace in its epilogue (block_m 128, whose tiles hold half of
// L2's 128-K group: a pass after L1, launch_fold_mxfp4), all through the converters' fold (fold_e2m1_quarter: the same
// bits), and both GEMMs run the folded-token builds (w4a8's; no converters; block_m 128 opened to them:
// fp4_block128_for). Every block_m and split K of the last round, but not where an expert's last block takes tail rows
// (the wide-tail build has no MXFP4 output; w4a4 takes none today: fp4_tail_from_rows). Workspace per call: the rows
// one rank routes (T x top_k) x (hidden + intermediate) bytes plus factors (V4-Flash T=128: ~5 MB; 8192: ~300 MB);
// with several ranks pool_rows, every rank's tokens, so there only while that stays under kFp4FoldMxfp4MaxBytes (the
// caller). A choice by token or rank count keeps EP's bits (the same values either way). MEGAMOE_FP4_FOLD_MXFP4=0
// (read per call; tests) turns it off.
// NOTES: H100 A/Bs (2026-11-26, 2 rounds each, time per replay / in a graph). At block_m 128 with two fold passes,
// over the converters' block_m 64 (docs/bench/h100-2026-11-26k-ab-fp4-w4a4-upstream-fold.json): V4-Flash T=3072 0.765 /
// 0.761, 4096 0.759 / 0.747, 8192 0.885 / 0.900; V4-Pro 4096 0.861 / 0.851, 8192 0.876 / 0.876. The passes at every
// block_m (-26l-ab-fp4-w4a4-fold-passes-all-blocks.json): T = 16-1024 0.90-0.99, but V4-Flash T=1 1.023 / 1.028 (two
// launches). With the gather's and L1's epilogue folds, over the block_m 128-only build
// (-26l-ab-fp4-w4a4-gather-epilogue-fold.json): V4-Flash T=1 0.915 / 0.915, 16 0.877 / 0.875, 128 0.868 / 0.870, 512
// 0.995 / 0.944, 2048 0.924 / 0.981; V4-Pro 16 0.931 / 0.938, 128 0.923 / 0.926, 512-4096 0.96-0.98. MXFP4 w4a4 then
// runs within 1 % of w4a8 at T = 1-128 in the same run. With split K too (H200, over the build without it there;
// -26l-ab-fp4-w4a4-fold-split-k.json): V4-Pro T=1 0.917 / 0.926, 2 0.923 / 0.921, V4-Flash 2 0.946 / 0.948, 3 0.929
// / 0.925; no split (V4-Flash 1 / 4, V4-Pro 3 / 4) 0.994-1.002.
inline bool fp4_fold_mxfp4_allowed() {
  const char* env = std::getenv("MEGAMOE_FP4_FOLD_MXFP4");
  return env == nullptr || env[0] != '0';
}
inline bool fp4_fold_mxfp4_tokens(bool allowed, int tail_rows) { return allowed && tail_rows == 0; }
// With several ranks the fold's workspace holds pool_rows (every rank's tokens): taken up to this size.
constexpr int64_t kFp4FoldMxfp4MaxBytes = int64_t(256) << 20;

// FP4: each tile's wgmmas are as wide as its rows rounded up: BF16 path to 8, at least 16 (m64n16, n24 ... n64;
// block_m 16: n8 for up to 8 rows), FP8-wgmma path as below; not the whole block (sm90_fp4_grouped_gemm.cuh, live_cols).
// MEGAMOE_FP4_NARROW_MMA=0 (read per call; tests) runs every tile at the block's width. NOTES: H100 A/B of the
// block_m 32 / 64 part (2026-11-26, 2 rounds, every FP4 pair; docs/bench/h100-2026-11-26d-ab-fp4-narrow-mma.json;
// time per replay / in a graph): V4-Pro T=2048 (~32 rows) -6 to -11 % / -7 to -11 % on the BF16 path, V4-Flash 2048 (~48) -2 to -8 % / -1 to -3 %, 4096 -1 to -5 %, 8192 and
// T=1024 within +-2.6 %; bitwise equal. m64n8 at block_m 16 (NVFP4 tokens only; -ab-fp4-n8-nvfp4-tokens.json): T=128
// -3 to -8 %, V4-Pro 512 -2 to -6 %; with FP8 tokens it was 2-7 % slower (-ab-fp4-n8-all-recipes.json), so off there.
// The block_m cuts (token_block_for) re-measured with narrow wgmmas: unchanged (-ab-fp4-block-m-with-narrow-mma.json).
// Widths in steps of 8 instead of 16 (h100-2026-11-26e-ab-fp4-narrow-mma-8-steps.json, T = 1024-4096): NVFP4 weights
// -0.5 to -3 %, MXFP4 within +-1 %; geometric mean of the rows 0.994.
// The FP8-wgmma path (MXFP4 weights) runs a tile's stages at 16 / 32 (block_m 32) or 32 / 48 / 64 (block_m 64), one
// stage body per width. H100 A/B (2026-11-26, 2 rounds, MXFP4 w4a8 and w4a4, per replay over the block's width;
// docs/bench/h100-2026-11-26i-ab-fp4-fp8mma-narrow.json): V4-Flash 1365 -12 / -13 %, 2048 -1 / -3 %, V4-Pro 1024 -7 /
// -4 %, 2048 -9 / -12 %, 2560 -9 / -8 %; V4-Flash 1024 and V4-Pro 1365 +-0.5 %; T=4096-8192 w4a4 -2 to 0 %, w4a8 +1 to
// +3 % (in a graph +0.7 to +1.9 %; the two-width build read the same there). Re-checked (3 rounds each,
// -ab-fp4-fp8mma-narrow-recheck.json, -narrow-order.json): w4a8 at 4096-8192 +0.3 to +3.6 % per replay, +1.0 to +3.0 %
// in a graph, w4a4 -3 to +1 %; the full-width body first in code order read the same. Kept: the band's -5 to -13 %
// outweighs it; the cost is in the w4a8 (folded-token) build's full-width loop, not the branch.
inline bool fp4_narrow_mma() {
  const char* env = std::getenv("MEGAMOE_FP4_NARROW_MMA");
  return env == nullptr || env[0] != '0';
}

// Weight block scales by one bulk copy per stage (4 KB of a 256-row tile's scale tiles; formats.hpp), on the weight
// tile's barrier, where the layout has scale tiles; else the scale warp's 8- / 16-byte cp.async per row.
// NOTES: without any weight-scale copy (ablate.py fp4-no-weight-scales, wrong results) MXFP4 w4a8 ran 0.91-0.96 of the
// time at T = 1-128, both models (H100, 2026-11-27, docs/bench/h100-2026-11-27g-ab-fp4-carveout-scales.json). A TMA
// box over the row-major scales (256 rows x 16 bytes) over the cp.async, in a graph (-ab-fp4-scale-tma*.json): MXFP4
// T=2048 -3.5 to -5.5 %, V4-Flash T=1 -1 to -2.6 %, T = 16 / 128 within +-0.7 %; NVFP4 -3 to +3.4 %.
// Scale tiles: not yet measured (candidate, wip/fp4-scale-tiles). MEGAMOE_FP4_SCALE_TMA=0 / 1 (read per call) forces
// the cp.async / the bulk copy (tests compare the two bitwise).
inline bool fp4_scale_tma() {
  const char* env = std::getenv("MEGAMOE_FP4_SCALE_TMA");
  return env == nullptr || env[0] != '0';
}

// ------------------------------------------------------------------------------------------------
// FP4 grouped GEMM (sm90_fp4_grouped_gemm): weights decoded on chip to bf16, 256 K per stage.
// ------------------------------------------------------------------------------------------------
// One stage: packed weights fp4_tile_n rows (256; 128 at block_m 128) x 128 bytes, the token tile (E4M3: cols x 256
// bytes, E2M1: cols x 128; cols = fp4_tile_cols), weight scales fp4_tile_n rows x 16 bytes and token scales (at most 16
// blocks x cols), each piece rounded up to 1024 bytes (TMA 128B-swizzle alignment).
constexpr int fp4_round_1k(int b) { return (b + 1023) / 1024 * 1024; }
// FP4 wide last block: at block_m 16 with NVFP4 or FP8 tokens and 11-15 expected rows per expert (14-15 on the
// FP8-wgmma path: fp4_tail_from_rows), an expert's last
// token block holds up to 16 + 8 rows (routing tail_rows, as the FP8 kernel's wide block at 64), one m64n24 tile where
// a second tile would decode the same 256 weight rows again for 1-8 rows; a build of its own (the kernel's kWideTail:
// tiles of 24 token columns, early epilogue inputs in shared memory), so that the other sizes keep theirs.
// NOTES: block_m 16 serves up to 13 expected rows (15 with the tail: choose_fp4_grouped_gemm), and the rows scatter
// around the mean: at V4-Flash T=512 (12 rows) ~13 % of the experts overflow 16. H100 A/B of the tail for every recipe
// at block_m 16 (2026-11-26, 2 rounds, time over main's per replay;
// docs/bench/h100-2026-11-26e-ab-fp4-wide-tail-all-recipes.json): NVFP4 w4a4 V4-Flash T=512 0.917, V4-Pro 768 0.944,
// but V4-Pro 512 (8 rows) 1.048 and T = 16 / 128 1.02-1.05 (its tiles hold 4 stages, not 5); with FP8 tokens (two stage
// bodies: a width branch inside the stage made ptxas serialise the wgmmas, C7520) T = 1-128 1.07-1.22 and V4-Pro 512
// 1.03-1.12: no tail there. Its own build for NVFP4 tokens (-ab-fp4-wide-tail-nvfp4-tokens.json, 2 rounds, per replay /
// in a graph): V4-Flash T=512 (12 rows) 0.935 / 0.955, V4-Pro 768 (12) 0.961 / 0.946, V4-Pro 640 (10) 1.024 / 1.021,
// hence from 11 rows; every other row (the other builds) 0.98-1.025. FP8 tokens got the build later with every tile on
// m64n24 (one stage body, no width branch; the columns past a tile's rows are never stored): -1.5 to -2.5 % at the same
// rows, no other row past +0.8 % (-ab-fp4-wide-tail-fp8-tokens.json; MXFP4 tokens have no build).
// MEGAMOE_FP4_WIDE_TAIL=0 / =1 (read per call; tests) turns it off / on wherever the build exists (block_m 16, NVFP4 or
// FP8 tokens, no split).
constexpr int kFp4TailRows = 8;
constexpr int fp4_tile_cols(int block_m, bool wide_tail) { return block_m + (wide_tail ? kFp4TailRows : 0); }
// The expected rows per expert from which the tokens' recipe runs its wide-tail build; 0: it has none (MXFP4 tokens,
// or FP8 tokens on the FP8-wgmma path that are not folded). NVFP4 tokens, FP8 tokens on the BF16 path: 11 (above).
// Folded FP8 tokens on the FP8-wgmma path (every tile of the build on m64n24k32): 14. NOTES: H100 A/B (2026-11-26, 2
// rounds, MXFP4 w4a8, the build forced from 11 rows, time over no tail per replay / in a graph;
// docs/bench/h100-2026-11-26j-ab-fp4-fp8mma-wide-tail.json): V4-Flash T=640 (15 rows) 0.940 / 0.951, V4-Pro 896 (14)
// 0.961 / 0.960, but V4-Flash 512 (12) 1.030 / 1.054 and V4-Pro 768 (12) 1.025 / 1.013; 9-10 rows and 18-21 rows
// (block_m 32) within +-1.4 %. With m64n16 for the tiles of at most 16 rows (a second stage body) it lost more at 12
// rows (1.066 / 1.058, 1.036 / 1.021) and gained less at 14-15 (0.98): the loss at 12 rows is not the wider wgmma.
inline int fp4_tail_from_rows(bool nv_tokens, bool fp8_tokens, bool fp8_mma, bool folded) {
  if (nv_tokens) return 11;
  if (!fp8_tokens) return 0;
  return !fp8_mma ? 11 : folded ? 14 : 0;
}
inline int fp4_tail_rows(int block_m, int64_t expected_rows, int tail_from, bool split_k) {
  if (block_m != 16 || tail_from == 0 || split_k) return 0;
  const char* env = std::getenv("MEGAMOE_FP4_WIDE_TAIL");
  if (env != nullptr && (env[0] == '0' || env[0] == '1')) return env[0] == '1' ? kFp4TailRows : 0;
  return expected_rows >= tail_from ? kFp4TailRows : 0;
}
// Expected rows per touched expert (token_block_for's argument for the FP4 kernels).
inline int64_t fp4_expected_rows(int64_t num_tokens, int64_t top_k, int64_t num_experts) {
  const int64_t slots = num_tokens * top_k;
  return slots <= num_experts ? 1 : (slots + num_experts - 1) / num_experts;
}
// Token scales per stage: one row per 16- or 32-K block (16 rows for NVFP4 activations, 8 otherwise) of
// cols + 4 bytes (the 4-byte aligned window cp.async copies around the tile's first row).
constexpr int fp4_act_sf_bytes(int cols, bool act_fp4) { return fp4_round_1k((act_fp4 ? 16 : 8) * (cols + 4)); }
// Weight rows per FP4 tile: 256, or 128 at block_m 128 (the FP8-wgmma path's 128 x 128 tile: one 64-row slice per
// consumer warpgroup, half the decode per MAC of 256 x 64; choose_fp4_grouped_gemm).
constexpr int fp4_tile_n(int block_m) { return block_m == 128 ? 128 : 256; }
constexpr int fp4_stage_bytes(int block_m, int cols, bool act_fp4) {
  return fp4_tile_n(block_m) * 128 + fp4_round_1k(cols * (act_fp4 ? 128 : 256)) + fp4_tile_n(block_m) * 16 +
         fp4_act_sf_bytes(cols, act_fp4);
}
// Converted bf16 token tiles in flight (the converters run at most this many minus one stages ahead).
// NOTES: three for block_m 16 (H100 A/B, 2026-11-22: 0-7 % faster at T = 16-512 than two, although the third
// tile costs a weight stage, 5 -> 4); two otherwise, where a third would cost a stage of 3-4. Block_m 128 takes folded
// tokens only (nothing to convert): one tile, the epilogue's scratch.
constexpr int fp4_num_bf_tiles(int block_m) { return block_m == 16 ? 3 : block_m == 128 ? 1 : 2; }
// One bf16 token tile (cols x 256 K x 2 bytes); block_m 128: the epilogue's scratch, cols x 256 bytes (L2's staged
// bf16 outputs [cols][128], L1's SwiGLU exchange [2][32][128] floats).
constexpr int fp4_bf_tile_bytes(int block_m, int cols) { return block_m == 128 ? cols * 256 : cols * 512; }
// Fixed part: the bf16 token tiles (the epilogue reuses them), barriers, the FP8-wgmma path's fold tables, the
// wide-tail build's early epilogue inputs, alignment slack.
constexpr int fp4_fixed_bytes(int block_m, int cols) {
  return fp4_num_bf_tiles(block_m) * fp4_bf_tile_bytes(block_m, cols) + 1024 + 256 + 256 + (cols != block_m ? 512 : 0);
}
// Deepest pipeline in the 227 KB a block may use: block_m 16: 4 stages (E4M3 tokens) or 5 (E2M1 tokens; 4 with the
// wide last block's 24 columns); 32: 4; 64: 3; 128: 3.
constexpr int fp4_num_stages_for(int block_m, bool act_fp4, int cols) {
  return (227 * 1024 - fp4_fixed_bytes(block_m, cols)) / fp4_stage_bytes(block_m, cols, act_fp4);
}
static_assert(fp4_num_stages_for(16, false, 16) == 4 && fp4_num_stages_for(16, true, 16) == 5 &&
                  fp4_num_stages_for(16, true, 24) == 4 && fp4_num_stages_for(16, false, 24) == 4 &&
                  fp4_num_stages_for(32, true, 32) == 4 && fp4_num_stages_for(64, false, 64) == 3 &&
                  fp4_num_stages_for(128, false, 128) == 3,
              "FP4 stage counts");

// Split K of the last round for one FP4 grouped GEMM (sm90_fp4_grouped_gemm.cuh, SplitPlan): the tiles of one round
// (the grid: one CTA per SM), or 0 for the kernel without it. When the last of two or three rounds of tiles holds at
// most half a round, its tiles are cut into K units that run side by side. Taken where the GEMM's expected tile count
// (one token block per touched expert, E (1 - (1 - k / E)^T), times its `nblocks` 256-row weight blocks) says so:
// V4-Pro T=1 (144 L1 / 168 L2 tiles on 132 SMs), T=2 (~284 L1), V4-Flash T=2 (~190 / ~190), T=3 (~282 L1 / L2);
// block_m 16 only (the only build with it), one rank only (the estimate counts this rank's tokens only). Not past
// three rounds: the build with the split ran 3-6 % slower at T = 16 / 128 where it split nothing (H100, 2026-11-26).
// NOTES: H100 A/Bs (2026-11-26, 2 rounds each, every FP4 pair, per replay). Two rounds of tiles only
// (docs/bench/h100-2026-11-26-ab-fp4-split-last-round.json): V4-Pro T=1 0.77-0.80, V4-Flash T=2 0.94-0.97, T = 1
// (V4-Flash) / 16 / 128 (no split) 0.99-1.01 (in a graph V4-Flash T=128 1.00-1.03, the same kernel as before). Up to
// three rounds, against that (-ab-fp4-split-last-of-3-rounds.json): V4-Pro T=2 0.89-0.90, V4-Flash T=3 0.90-0.93, T = 1,
// 2 (Flash), 3 (Pro), 4, 16 0.99-1.01.
// MEGAMOE_FP4_SPLIT_ROUND (read per call; tests) forces the round size: "0" (off), or 2 up to num_sms (a smaller round,
// so that small shapes take the split path; block_m 16).
inline int fp4_split_round(int64_t num_tokens, int64_t top_k, int64_t num_experts, int64_t nblocks, int block_m,
                           int num_sms, int64_t num_ranks) {
  if (const char* env = std::getenv("MEGAMOE_FP4_SPLIT_ROUND"); env != nullptr && env[0] != '\0') {
    char* end = nullptr;
    const long forced = std::strtol(env, &end, 10);
    if (*end == '\0' && end != env && (forced == 0 || (forced >= 2 && forced <= num_sms)))
      return block_m == 16 ? static_cast<int>(forced) : 0;
    std::fprintf(stderr, "megamoe: MEGAMOE_FP4_SPLIT_ROUND=%s ignored (expected 0, or 2 up to %d)\n", env, num_sms);
  }
  if (num_ranks != 1 || block_m != 16 || num_experts <= 0) return 0;
  const double tiles = expected_touched_experts(num_tokens, top_k, num_experts) * double(nblocks);
  const double last = tiles - std::ceil(tiles / num_sms - 1.0) * num_sms;  // the last round's tiles
  return tiles > num_sms && tiles <= 3.0 * num_sms && last <= 0.5 * num_sms ? num_sms : 0;
}

// tail_from: fp4_tail_from_rows (from which rows the tokens' recipe runs the wide-tail build). NOTES: with it, 14-15
// expected rows stay at block_m 16: an expert's rows up to 24 take one m64n24 tile, where block_m 32 runs a 32-row
// block. H100 A/B
// (2026-11-26, 2 rounds, forced 16 over 32, per replay / in a graph; docs/bench/h100-2026-11-26f-ab-fp4-block16-*):
// V4-Flash T=640 (15 rows) MXFP4 w4a8 0.921 / 0.936, NVFP4 w4a4 0.924 / 1.002, NVFP4 w4a8 0.950 / 0.952; V4-Pro 960
// (15) 1.009 / 1.000, 0.969 / 0.978, 0.997 / 1.011; MXFP4 w4a4 (no wide-tail build) 1.05-1.11; at 23 rows 1.13-1.47.
// Not where block_m 16 would split K (few experts: fp4_split_round), which takes no tail rows.
// block128: the recipe has the block_m 128 build (MXFP4 weights on the FP8-wgmma path with folded FP8 tokens:
// fp4_block128_recipe), taken where fp4_block128_for says. Its 128 x 128 tiles decode half the weights per MAC of
// 256 x 64's but cost more tiles where an expert's last 128-row block is small: it wins where its tiles per 256 weight
// rows (2 per 128-row token block) are no more than block_m 64's (one per 64-row block, counted at the mean rows plus
// one standard deviation of an expert's rows, sqrt(rows): the blocks of the fuller experts).
// NOTES: H100 A/Bs (2026-11-26, 2 rounds, MXFP4 w4a8, time at block_m 128 over 64 per replay / in a graph;
// docs/bench/h100-2026-11-26j-ab-fp4-block128-*.json). Chosen: V4-Flash 72 rows (T=3072) 0.763 / 0.756, 84 0.741 /
// 0.711, 96 0.77 / 0.77, 120 0.919 / 0.920, 192 0.938 / 0.942; V4-Pro 80 0.699 / 0.692, 96 0.735 / 0.731, 112 0.805 /
// 0.805, 128 0.950 / 0.950. Not chosen: V4-Flash 144 1.066 / 1.057, 168 1.057 / 1.065; 60 rows 1.017 / 0.962; 24-56 rows
// 1.04-1.24.
// Re-checked after the row-exponent fold (H100, 2026-11-26, docs/bench/h100-2026-11-26k-ab-fp4-block128-*.json, 2 rounds
// unless noted): V4-Pro 64 rows (T=4096) 0.899 / 0.890 (and 0.895 / 0.911 in 1 round): from 64 rows since. Still not
// chosen: 60 rows V4-Flash 1.009 / 0.994, V4-Pro 1.005 / 0.968; 52-56 rows 1.02-1.15; V4-Flash 144 0.986 / 1.012 and
// 168 1.022 / 1.034 (1 round).
inline bool fp4_block128_recipe(bool fp8_mma, bool folded) { return fp8_mma && folded; }
inline bool fp4_block128_for(int64_t rows) {
  if (rows < 64) return false;
  const int64_t blocks64 = static_cast<int64_t>(std::ceil((rows + std::sqrt(double(rows))) / 64.0));
  return blocks64 >= 2 * ((rows + 127) / 128);
}
// e2m1_tiles: the kernels' token tiles are E2M1 (FP4 tokens not folded upstream), for the stage count.
inline GroupedGemmConfig choose_fp4_grouped_gemm(int64_t num_tokens, int64_t top_k, int64_t num_experts,
                                                 int64_t hidden, int64_t intermediate, bool e2m1_tiles, int tail_from,
                                                 bool block128, int num_sms, int64_t num_ranks) {
  GroupedGemmConfig c;
  const int64_t rows = fp4_expected_rows(num_tokens, top_k, num_experts);
  int block = token_block_for(rows, 64);
  if (block128 && fp4_block128_for(rows)) block = 128;
  if (block == 32 && rows <= 15 && fp4_tail_rows(16, rows, tail_from, false) > 0 &&
      fp4_split_round(num_tokens, top_k, num_experts, (2 * intermediate + 255) / 256, 16, num_sms, num_ranks) == 0 &&
      fp4_split_round(num_tokens, top_k, num_experts, (hidden + 255) / 256, 16, num_sms, num_ranks) == 0)
    block = 16;
  c.block_m = forced_block_m("MEGAMOE_FP4_BLOCK_M", block, block128 ? 128 : 64);
  c.num_stages = fp4_num_stages_for(c.block_m, e2m1_tiles, c.block_m);
  c.fused = false;  // the FP4 kernels run L1 and L2 as two launches
  c.pairs = false;
  print_config_once(e2m1_tiles ? "FP4 (E2M1 token tiles)" : "FP4 (E4M3 token tiles)", num_tokens, top_k, num_experts,
                    hidden, intermediate, num_ranks, c);
  return c;
}

}  // namespace megamoe::heuristics
