// FP4 grouped GEMM instantiations: L2, MXFP4 weights on FP8 wgmmas (block_m 16/32/64 x both activation formats).
#include "kernels/sm90_fp4_grouped_gemm.cuh"
#include "kernels/sm90_fp4_grouped_gemm_layers.hpp"

namespace megamoe::kernels::fp4 {

void launch_l2_mxfp4_fp8mma(const Fp4GroupedGemmArgs& a, const Params& p, int block_m, int num_sms,
                            cudaStream_t stream) {
  launch_layer</*kIsL1=*/false, /*kNV=*/false, /*kFP8Mma=*/true>(a, p, block_m, num_sms, stream);
}

}  // namespace megamoe::kernels::fp4
