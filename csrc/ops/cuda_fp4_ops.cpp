// CUDA registration of fp8_fp4_mega_moe (FP4 expert weights, MXFP4 / NVFP4, w4a8 and w4a4).
#include <ATen/ATen.h>

#include <algorithm>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "heuristics/sm90.hpp"
#include "kernels/launch.hpp"
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
  const auto args = check_mega_moe(y, l1_weights, l1_weights_sf, l1_weights_global_sf, l2_weights, l2_weights_sf,
                                   l2_weights_global_sf, buffer, num_experts, num_ranks, rank, max_tokens_per_rank,
                                   top_k, format, parse_act_format(act_format), activation_clamp, fast_math,
                                   recv_stats);
  check_arch(y, "fp8_fp4_mega_moe");
  const c10::cuda::CUDAGuard guard(y.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const auto& l = args.buf.layout;
  const int t = static_cast<int>(args.num_tokens);
  // NOTES: with peers, a rank without tokens still serves theirs and takes part in both barriers.
  if (t == 0 && l.num_ranks == 1) return;
  const int sms = num_sms(y);
  const float clamp = activation_clamp.has_value() ? static_cast<float>(*activation_clamp) : -1.0f;
  int* recv_stats_ptr = recv_stats.has_value() ? recv_stats->data_ptr<int>() : nullptr;
  // One token on one rank: GEMVs over its experts instead of routing, gather and the tile walk (heuristics::fp4_gemv).
  // It copies pieces of 16-64 rows of the weights, scales and row exponents with cp.async.bulk and TMA (16-byte
  // aligned): tensors off that alignment (sliced; transform_weights never returns one) take the tile walk, whose tensor
  // maps refuse misaligned weights with an error.
  const auto aligned16 = [](const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; };
  const bool weights_aligned = aligned16(l1_weights) && aligned16(l2_weights) && aligned16(l1_weights_sf) &&
                               aligned16(l2_weights_sf) && aligned16(l1_weights_global_sf) &&
                               aligned16(l2_weights_global_sf);
  const bool nv_weights = format == WeightFormat::kNVFP4;
  const bool gemv_supported = args.recipe == ActRecipe::kFP8UE8M0Block32 ||
                              (format == WeightFormat::kMXFP4 && args.recipe == ActRecipe::kMXFP4) ||
                              (nv_weights && args.recipe == ActRecipe::kNVFP4);
  if (weights_aligned && heuristics::fp4_gemv(t, l.num_ranks, gemv_supported, fp4_scale_block(format), l.hidden,
                                              l.intermediate, l.top_k)) {
    // The third tensor: MXFP4 row exponents (uint8 [E, n]) or the NVFP4 global scales (float32 [E]).
    auto layer = [&](const at::Tensor& w, const at::Tensor& sf, const at::Tensor& third, int64_t n, int64_t k,
                     int run_tiles) {
      kernels::Fp4GemvLayer g{static_cast<const uint8_t*>(w.data_ptr()), static_cast<const uint8_t*>(sf.data_ptr()),
                              nv_weights ? nullptr : third.data_ptr<uint8_t>(),
                              nv_weights ? third.data_ptr<float>() : nullptr, fp4_scale_tiles(format, n, k), {}};
      if (k % heuristics::kFp4GemvChunkK == 0)  // the wgmma forms' chunks (host only: capture-safe)
        g.tmap_chunks = kernels::make_tensor_map_2d(w.data_ptr(), k / 2, w.numel() / (k / 2), k / 2,
                                                    heuristics::kFp4GemvChunkK / 2,
                                                    run_tiles * heuristics::kFp4GemvTileRows, false);
      return g;
    };
    uint8_t* b = buffer_ptr(buffer);
    // NVFP4 tokens: L1's float32 outputs and each 32's amax, which L2 quantizes (their global scale spans the row).
    at::Tensor scratch;
    if (args.recipe == ActRecipe::kNVFP4)
      scratch = at::empty({l.top_k * (l.intermediate + l.intermediate / 32)}, y.options().dtype(at::kFloat));
    kernels::launch_fp4_gemv(layer(l1_weights, l1_weights_sf, l1_weights_global_sf, 2 * l.intermediate, l.hidden,
                                   heuristics::fp4_gemv_run_tiles(true, nv_weights)),
                             layer(l2_weights, l2_weights_sf, l2_weights_global_sf, l.hidden, l.intermediate,
                                   heuristics::fp4_gemv_run_tiles(false, nv_weights)),
                             b, l,
                             clamp, fast_math, recv_stats_ptr,
                             scratch.defined() ? scratch.data_ptr<float>() : nullptr, sms, stream);
    kernels::launch_combine(y.data_ptr(), b, l, static_cast<int>(args.buf.rank), t, sms, stream);
    return;
  }
  const bool act_fp4 = l.act_fp4;
  const auto recipe = args.recipe;
  const bool nv_acts = recipe == ActRecipe::kNVFP4;
  // The path (BF16 decode or FP8 wgmmas for MXFP4 weights) and whether the tokens' recipe has the wide-tail build
  // (heuristics::fp4_tail_rows, from the expected rows per local expert).
  const int64_t expected_rows = heuristics::fp4_expected_rows(t, l.top_k, l.num_local_experts);
  const bool fp8_mma = format == WeightFormat::kMXFP4 && heuristics::choose_mxfp4_fp8_mma();
  // The FP8-wgmma path's FP8 tokens arrive folded (heuristics::fp4_folded_tokens): L1's by the gather, L2's by L1's
  // epilogue.
  const bool folded = fp8_mma && recipe == ActRecipe::kFP8UE8M0Block32 && heuristics::fp4_folded_tokens();
  // MXFP4 tokens on the FP8-wgmma path are folded upstream (heuristics::fp4_fold_mxfp4_tokens, decided below from the
  // tail rows), which also opens block_m 128 to them. Its E4M3 workspace holds the rows one rank routes (at
  // most T x top_k, as the NVFP4 scratch; rounded up to 128, TMA reads past them as zeros); with several ranks the rows
  // it receives are not known here, so pool_rows (every rank's tokens), and only up to kFp4FoldMxfp4MaxBytes.
  const uint64_t rows = l.pool_rows;
  const int64_t mx_rows = l.num_ranks == 1 ? (std::max<int64_t>(int64_t(t) * l.top_k, 1) + 127) / 128 * 128
                                           : static_cast<int64_t>(rows);
  const int64_t mx_bytes = mx_rows * int64_t(l.hidden + l.intermediate) +
                           int64_t(l.hidden + l.intermediate) / 128 * int64_t(rows) * int64_t(sizeof(float));
  const bool mx_fold_allowed = fp8_mma && recipe == ActRecipe::kMXFP4 && heuristics::fp4_fold_mxfp4_allowed() &&
                               (l.num_ranks == 1 || mx_bytes <= heuristics::kFp4FoldMxfp4MaxBytes);
  const int tail_from = heuristics::fp4_tail_from_rows(nv_acts, recipe == ActRecipe::kFP8UE8M0Block32, fp8_mma, folded);
  // E2M1 token tiles only where MXFP4 tokens are not folded (mx_fold below is mx_fold_allowed: they take no tail rows).
  const auto cfg = heuristics::choose_fp4_grouped_gemm(t, l.top_k, l.num_local_experts, l.hidden, l.intermediate,
                                                       act_fp4 && !mx_fold_allowed, tail_from,
                                                       heuristics::fp4_block128_recipe(fp8_mma, folded || mx_fold_allowed),
                                                       sms, l.num_ranks);
  uint8_t* buf = buffer_ptr(buffer);
  const uint64_t e = l.num_local_experts, h = l.hidden, inter = l.intermediate;
  const auto bm = static_cast<uint32_t>(cfg.block_m);

  // The L2 input of NVFP4 activations has a per-row global scale over the whole I row: L1 stores float32
  // SwiGLU outputs here and a requantization kernel fills the pool (docs/decisions.md, FP4 kernels).
  at::Tensor scratch;
  if (nv_acts) {
    const int64_t max_rows = l.num_ranks == 1 ? std::max<int64_t>(int64_t(t) * l.top_k, 1) : l.pool_rows;
    scratch = at::empty({max_rows, l.intermediate}, y.options().dtype(at::kFloat));
  }

  // Split K of the last round, per GEMM (heuristics::fp4_split_round; the kernel plans it from its tile count). One
  // float32 workspace: L1's then L2's tile counters (round / 2 each, int32; gather zeroes them), then the larger round's
  // units of partial sums (256 x block_m each; L2's reuse L1's: L2's consumers start after L1 has finished).
  constexpr int64_t kTileRows = 256;  // heuristics::fp4_tile_n of the split build (block_m 16)
  const int round1 = heuristics::fp4_split_round(t, l.top_k, static_cast<int64_t>(e),
                                                 (2 * static_cast<int64_t>(inter) + kTileRows - 1) / kTileRows,
                                                 cfg.block_m, sms, l.num_ranks);
  const int round2 = heuristics::fp4_split_round(t, l.top_k, static_cast<int64_t>(e),
                                                 (static_cast<int64_t>(h) + kTileRows - 1) / kTileRows, cfg.block_m,
                                                 sms, l.num_ranks);
  // A block_m 128 L1 tile writes 64 outputs, half of L2's 128-K group: a pass (launch_pool_fold) folds L2's input
  // after it instead, its factors [intermediate / 128, pool_rows] in a per-call tensor (allocated before any launch).
  const bool fold_pass = folded && cfg.block_m == 128;
  at::Tensor fold_factors;
  if (fold_pass)
    fold_factors = at::empty({static_cast<int64_t>(inter / 128), static_cast<int64_t>(rows)}, y.options().dtype(at::kFloat));
  at::Tensor split_ws;
  float* partials = nullptr;
  int* counters = nullptr;
  const int counter_words = round1 + round2 > 0 ? (round1 / 2 + round2 / 2 + 3) / 4 * 4 : 0;
  if (round1 + round2 > 0) {
    split_ws = at::empty({counter_words + int64_t(std::max(round1, round2)) * kTileRows * cfg.block_m},
                         y.options().dtype(at::kFloat));
    counters = reinterpret_cast<int*>(split_ws.data_ptr<float>());
    partials = split_ws.data_ptr<float>() + counter_words;
  }
  // ---- routing and gather (dispatch: every rank's tokens routed to this rank's experts). An expert's last token block
  // may hold tail rows past block_m where both GEMMs run a build with them (heuristics::fp4_tail_rows).
  const int tail_rows = heuristics::fp4_tail_rows(cfg.block_m, expected_rows, tail_from, round1 + round2 > 0);
  const bool mx_fold = heuristics::fp4_fold_mxfp4_tokens(mx_fold_allowed, tail_rows);
  // Its workspace (mx_bytes, allocated before any launch): E4M3 rows [mx_rows, hidden] (L1) and [mx_rows,
  // intermediate] (L2), then the float factors [hidden / 128, pool_rows] and [intermediate / 128, pool_rows] (the
  // kernels' factor stride).
  at::Tensor mx_ws;
  uint8_t *mx_x = nullptr, *mx_pool = nullptr;
  float *mx_x_factors = nullptr, *mx_pool_factors = nullptr;
  if (mx_fold) {
    mx_ws = at::empty({mx_bytes}, y.options().dtype(at::kByte));
    if (poison_workspaces()) mx_ws.fill_(0xFF);
    mx_x = mx_ws.data_ptr<uint8_t>();
    mx_pool = mx_x + mx_rows * int64_t(h);
    mx_x_factors = reinterpret_cast<float*>(mx_pool + mx_rows * int64_t(inter));
    mx_pool_factors = mx_x_factors + int64_t(h / 128) * int64_t(rows);
  }
  kernels::launch_routing(buf, l, static_cast<int>(args.buf.rank), t, cfg.block_m, recv_stats_ptr, stream, tail_rows);
  // With the MXFP4 fold the gather writes the folded rows into the workspace (the dispatch rows are not copied).
  kernels::launch_gather(buf, l, recipe, sms, stream, counters, counter_words, folded || mx_fold, mx_x, mx_x_factors);

  // The third kernel-layout weight tensor: NVFP4's per-expert global scales, MXFP4's per-row exponents (check_mega_moe).
  auto global_ptr = [&](const at::Tensor& g) -> const float* {
    return format == WeightFormat::kNVFP4 && g.defined() ? g.data_ptr<float>() : nullptr;
  };
  auto row_exp_ptr = [&](const at::Tensor& g) -> const uint8_t* {
    return format == WeightFormat::kMXFP4 ? g.data_ptr<uint8_t>() : nullptr;
  };
  // The weight scales' layout (scale tiles where the shape allows: formats.hpp) and how a stage's are copied.
  auto set_scale_copies = [&](kernels::Fp4GroupedGemmArgs& g, int64_t n, int64_t k) {
    g.scale_tiles = fp4_scale_tiles(format, n, k);
    g.scale_tma = g.scale_tiles && heuristics::fp4_scale_tma();
  };

  // ---- L1: dispatch rows x w13 -> SwiGLU -> pool (FP8 / MXFP4 in the epilogue, NVFP4 through scratch)
  kernels::Fp4GroupedGemmArgs g1;
  const uint32_t tile_n = static_cast<uint32_t>(heuristics::fp4_tile_n(cfg.block_m));  // weight rows per tile
  g1.tmap_weights = kernels::make_tensor_map_2d(l1_weights.data_ptr(), h / 2, e * 2 * inter, h / 2, 128, tile_n);
  g1.tmap_acts = kernels::make_tensor_map_2d(buf + l.dispatch_x_offset, l.token_bytes, rows, l.token_bytes, 128, bm);
  g1.tmap_acts_tail = tail_rows > 0 ? kernels::make_tensor_map_2d(buf + l.dispatch_x_offset, l.token_bytes, rows,
                                                                   l.token_bytes, 128, heuristics::kFp4TailRows)
                                     : g1.tmap_acts;  // not read without tail rows
  g1.acts_sf = buf + l.dispatch_sf_offset;
  g1.weights_sf = static_cast<const uint8_t*>(l1_weights_sf.data_ptr());
  set_scale_copies(g1, 2 * inter, h);
  g1.weights_global_sf = global_ptr(l1_weights_global_sf);
  g1.weights_row_exp = row_exp_ptr(l1_weights_global_sf);
  g1.acts_global_sf = nv_acts ? reinterpret_cast<const float*>(buf + l.dispatch_global_sf_offset) : nullptr;
  g1.scratch = nv_acts ? scratch.data_ptr<float>() : nullptr;
  g1.n = static_cast<int>(2 * inter);
  g1.k = static_cast<int>(h);
  g1.is_l1 = true;
  g1.weight_format = format;
  g1.recipe = recipe;
  g1.activation_clamp = clamp;
  g1.fast_math = fast_math;
  g1.fp8_mma = fp8_mma;
  g1.tail_rows = tail_rows;
  g1.rotate_rounds = heuristics::fp4_rotate_rounds(expected_rows, cfg.block_m, tail_rows);  // L2 too (g2 = g1)
  g1.split_round = round1;
  g1.partials = partials;
  g1.split_counters = counters;
  g1.folded_tokens = folded;
  g1.fold_output = folded && !fold_pass;
  // The folded E4M3 rows and factors, read as folded FP8 tokens; MXFP4 out, which the epilogue of 256-row tiles folds
  // for L2 into the workspace (a 128-row tile's 64 outputs are half of L2's 128-K group: the E2M1 pool, folded by a
  // pass before L2).
  const bool mx_fold_pass = mx_fold && cfg.block_m == 128;
  if (mx_fold) {
    g1.tmap_acts = kernels::make_tensor_map_2d(mx_x, h, mx_rows, h, 128, bm);
    g1.acts_sf = reinterpret_cast<const uint8_t*>(mx_x_factors);
    g1.recipe = ActRecipe::kFP8UE8M0Block32;
    g1.folded_tokens = true;
    g1.out_fp4 = true;
    g1.fold_output = !mx_fold_pass;
    g1.fold_out = mx_pool;
    g1.fold_out_factors = mx_pool_factors;
  }
  kernels::launch_fp4_grouped_gemm(g1, buf, l, cfg.block_m, sms, stream);
  if (nv_acts) kernels::launch_nvfp4_requant(g1.scratch, buf, l, static_cast<int>(scratch.size(0)), sms, stream);

  // ---- L2: pool x w2 -> bf16 rows in the combine area
  kernels::Fp4GroupedGemmArgs g2 = g1;
  g2.tmap_weights = kernels::make_tensor_map_2d(l2_weights.data_ptr(), inter / 2, e * h, inter / 2, 128, tile_n);
  g2.tmap_acts = kernels::make_tensor_map_2d(buf + l.pool_offset, l.pool_row_bytes, rows, l.pool_row_bytes, 128, bm);
  g2.tmap_acts_tail = tail_rows > 0 ? kernels::make_tensor_map_2d(buf + l.pool_offset, l.pool_row_bytes, rows,
                                                                   l.pool_row_bytes, 128, heuristics::kFp4TailRows)
                                     : g2.tmap_acts;
  g2.acts_sf = buf + l.pool_sf_offset;
  if (fold_pass) {
    kernels::launch_pool_fold(buf, l, fold_factors.data_ptr<float>(), sms, stream);
    g2.acts_sf = reinterpret_cast<const uint8_t*>(fold_factors.data_ptr<float>());
  }
  g2.weights_sf = static_cast<const uint8_t*>(l2_weights_sf.data_ptr());
  set_scale_copies(g2, h, inter);
  g2.weights_global_sf = global_ptr(l2_weights_global_sf);
  g2.weights_row_exp = row_exp_ptr(l2_weights_global_sf);
  g2.acts_global_sf = nv_acts ? reinterpret_cast<const float*>(buf + l.pool_global_sf_offset) : nullptr;
  g2.scratch = nullptr;
  g2.n = static_cast<int>(h);
  g2.k = static_cast<int>(inter);
  g2.is_l1 = false;
  g2.folded_tokens = folded;
  g2.fold_output = false;
  g2.out_fp4 = false;
  if (mx_fold) {
    if (mx_fold_pass)
      kernels::launch_fold_mxfp4(buf + l.pool_offset, buf + l.pool_sf_offset, static_cast<int64_t>(inter), mx_pool,
                                 mx_pool_factors, buf, l, sms, stream);
    g2.tmap_acts = kernels::make_tensor_map_2d(mx_pool, inter, mx_rows, inter, 128, bm);
    g2.acts_sf = reinterpret_cast<const uint8_t*>(mx_pool_factors);
    g2.recipe = ActRecipe::kFP8UE8M0Block32;
    g2.folded_tokens = true;
  }
  g2.split_round = round2;
  g2.split_counters = counters + round1 / 2;
  kernels::launch_fp4_grouped_gemm(g2, buf, l, cfg.block_m, sms, stream);

  // ---- combine over slots
  kernels::launch_combine(y.data_ptr(), buf, l, static_cast<int>(args.buf.rank), t, sms, stream);
}

}  // namespace

}  // namespace megamoe

TORCH_LIBRARY_IMPL(megamoe, CUDA, m) { m.impl("fp8_fp4_mega_moe", &megamoe::fp8_fp4_mega_moe_cuda); }
