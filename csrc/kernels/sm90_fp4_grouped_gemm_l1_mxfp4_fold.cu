// FP4 grouped GEMM instantiations: L1, MXFP4 weights on FP8 wgmmas reading MXFP4 tokens folded upstream
// (the gather's fold: read as folded FP8 tokens) and writing MXFP4 (the w4a4 semantics): block_m 16/32/64 fold it for
// L2 in the epilogue, block_m 128 writes the E2M1 pool (launch_fold_mxfp4 folds it).
#include "kernels/sm90_fp4_grouped_gemm.cuh"
#include "kernels/sm90_fp4_grouped_gemm_layers.hpp"

namespace megamoe::kernels::fp4 {

void launch_l1_mxfp4_fold(const Fp4GroupedGemmArgs& a, const Params& p, int block_m, int num_sms,
                          cudaStream_t stream) {
  // heuristics::fp4_fold_mxfp4_tokens: no tail rows; split K of the last round at block_m 16 only (as the other
  // builds). A 256-row tile's 128 outputs are one 128-K group of L2: the epilogue folds them (fold_output, into
  // Params::fold_out); block_m 128's 64 outputs are half of one, so it writes the MXFP4 pool and launch_fold_mxfp4
  // folds that.
  if (a.out_fp4 && a.recipe == ActRecipe::kFP8UE8M0Block32 && p.folded_tokens && p.fold_output == (block_m != 128) &&
      (p.split_round == 0 || block_m == 16) && a.tail_rows == 0) {
    constexpr auto kFolded = ActRecipe::kFP8UE8M0Block32;
    switch (block_m) {
      case 16:
        if (p.split_round > 0)
          return launch_config<16, true, false, kFolded, true, true, false, true>(a, p, num_sms, stream);
        return launch_config<16, true, false, kFolded, true, false, false, true>(a, p, num_sms, stream);
      case 32: return launch_config<32, true, false, kFolded, true, false, false, true>(a, p, num_sms, stream);
      case 64: return launch_config<64, true, false, kFolded, true, false, false, true>(a, p, num_sms, stream);
      case 128: return launch_config<128, true, false, kFolded, true, false, false, true>(a, p, num_sms, stream);
      default: break;
    }
  }
  throw std::runtime_error("megamoe: MXFP4 output from upstream-folded tokens needs L1 on the FP8-wgmma path, block_m "
                           "16, 32, 64 (folding its output) or 128 (not), folded tokens, split K at block_m 16 only, no "
                           "tail rows; got block_m " + std::to_string(block_m) + ", out_fp4 " +
                           std::to_string(a.out_fp4) + ", recipe " + std::to_string(int(a.recipe)) + ", folded_tokens " +
                           std::to_string(p.folded_tokens) + ", fold_output " + std::to_string(p.fold_output) +
                           ", split_round " + std::to_string(p.split_round) + ", tail_rows " +
                           std::to_string(a.tail_rows));
}

}  // namespace megamoe::kernels::fp4
