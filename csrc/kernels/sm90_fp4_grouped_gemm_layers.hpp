// The FP4 grouped GEMM's instantiation files, one per (layer, weight format) so that each translation
// unit compiles in well under two minutes on the 2-core CI: every (block_m, activation recipe) inside.
#pragma once

#include <cuda_runtime.h>

#include "kernels/launch.hpp"

namespace megamoe::kernels::fp4 {

struct Params;
void launch_l1_mxfp4(const Fp4GroupedGemmArgs& a, const Params& p, int block_m, int num_sms, cudaStream_t stream);
void launch_l1_nvfp4(const Fp4GroupedGemmArgs& a, const Params& p, int block_m, int num_sms, cudaStream_t stream);
void launch_l2_mxfp4(const Fp4GroupedGemmArgs& a, const Params& p, int block_m, int num_sms, cudaStream_t stream);
void launch_l2_nvfp4(const Fp4GroupedGemmArgs& a, const Params& p, int block_m, int num_sms, cudaStream_t stream);
void launch_l1_mxfp4_fp8mma(const Fp4GroupedGemmArgs& a, const Params& p, int block_m, int num_sms,
                            cudaStream_t stream);
// L1 from MXFP4 tokens folded upstream, MXFP4 out (Fp4GroupedGemmArgs::out_fp4).
void launch_l1_mxfp4_fold(const Fp4GroupedGemmArgs& a, const Params& p, int block_m, int num_sms, cudaStream_t stream);
void launch_l2_mxfp4_fp8mma(const Fp4GroupedGemmArgs& a, const Params& p, int block_m, int num_sms,
                            cudaStream_t stream);

}  // namespace megamoe::kernels::fp4
