// Host side of the grouped FP8 GEMM: tensor maps, the instantiation table, the launch.
#include <cuda.h>
#include <cuda_runtime.h>


#include "heuristics/sm90.hpp"
#include "kernels/sm90_fp8_grouped_gemm.cuh"

namespace megamoe::kernels {

namespace {

template <int kBlockM, Gemms kGemms, bool kPairs = false>
void launch_config(const GroupedGemmArgs& l1, const GroupedGemmArgs& l2, const GemmParams& p, int num_sms,
                   cudaStream_t stream) {
  constexpr int kStages = heuristics::num_stages_for(kBlockM, kPairs);
  using Smem = GemmSmem<heuristics::fp8_tile_cols(kBlockM, kPairs), kStages, kGemms>;
  static_assert(Smem::kBytes <= 227 * 1024, "grouped GEMM shared memory exceeds the 227 KB a block may use");
  constexpr auto kernel = sm90_fp8_grouped_gemm_kernel<kBlockM, kStages, kGemms, kPairs>;
  allow_dynamic_smem<kernel>(Smem::kBytes);
  int ctas = num_sms;
  if constexpr (kPairs) {
    // Persistent: as many CTA pairs as the GPU holds at once (the walk waits across CTAs: all must be resident).
    ctas = 2 * max_active_clusters<kernel, 2>(dim3(kNumThreads), Smem::kBytes);
    launch_pdl_cluster(kernel, dim3(ctas), dim3(kNumThreads), Smem::kBytes, 2, stream, l1.tmap_weights,
                       l1.tmap_acts, l2.tmap_weights, l2.tmap_acts, l1.tmap_acts_tail, l2.tmap_acts_tail, p);
  } else {
    launch_pdl(kernel, dim3(ctas), dim3(kNumThreads), Smem::kBytes, stream, l1.tmap_weights, l1.tmap_acts,
               l2.tmap_weights, l2.tmap_acts, l1.tmap_acts_tail, l2.tmap_acts_tail, p);
  }
#ifdef MEGAMOE_TILE_TRACE
  fp8_trace_print_kernel<<<1, 1, 0, stream>>>(ctas);  // the trace records, after the GEMM (stream order)
#endif
}

template <int kBlockM>
void launch_block_m(const GroupedGemmArgs& l1, const GroupedGemmArgs& l2, const GemmParams& p, bool fused,
                    bool pairs, int num_sms, cudaStream_t stream) {
  if (pairs) {
    if constexpr (kBlockM == 64) return launch_config<kBlockM, Gemms::kFused, true>(l1, l2, p, num_sms, stream);
    throw std::runtime_error("megamoe: the FP8 pair walk needs block_m = 64, not " + std::to_string(kBlockM));
  } else if (fused) {
    launch_config<kBlockM, Gemms::kFused>(l1, l2, p, num_sms, stream);
  } else {
    launch_config<kBlockM, Gemms::kL1>(l1, l2, p, num_sms, stream);
    launch_config<kBlockM, Gemms::kL2>(l1, l2, p, num_sms, stream);
  }
}

}  // namespace

void launch_fp8_grouped_gemms(const GroupedGemmArgs& l1, const GroupedGemmArgs& l2, uint8_t* buffer,
                              const layout::BufferLayout& layout, const GroupedGemmLaunch& how, int num_sms,
                              cudaStream_t stream) {
  GemmParams p;
  p.op[0] = {l1.weights_sf, l1.acts_sf, l1.n, l1.k};
  p.op[1] = {l2.weights_sf, l2.acts_sf, l2.n, l2.k};
  p.buffer = buffer;
  p.l = layout;
  p.activation_clamp = how.activation_clamp;
  p.fast_math = how.fast_math;
  p.rotate_rounds = how.rotate_rounds;  // read by the static walk only (kL1 / kL2)
  switch (how.block_m) {
    case 16: return launch_block_m<16>(l1, l2, p, how.fused, how.pairs, num_sms, stream);
    case 32: return launch_block_m<32>(l1, l2, p, how.fused, how.pairs, num_sms, stream);
    case 64: return launch_block_m<64>(l1, l2, p, how.fused, how.pairs, num_sms, stream);
    case 128: return launch_block_m<128>(l1, l2, p, how.fused, how.pairs, num_sms, stream);
  }
  throw std::runtime_error("megamoe: grouped GEMM has no instantiation for block_m = " + std::to_string(how.block_m));
}

// ------------------------------------------------------------------------------------------------
// Tensor maps (driver entry point fetched through the runtime: no link against libcuda)
// ------------------------------------------------------------------------------------------------
namespace {

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeTiledFn encode_tiled() {
  static EncodeTiledFn fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status;
    MEGAMOE_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault,
                                                        &status));
    if (status != cudaDriverEntryPointSuccess || ptr == nullptr)
      throw std::runtime_error("megamoe: cuTensorMapEncodeTiled is not available from the CUDA driver");
    return reinterpret_cast<EncodeTiledFn>(ptr);
  }();
  return fn;
}

}  // namespace

CUtensorMap make_tensor_map_2d(const void* base, uint64_t inner, uint64_t outer, uint64_t row_stride_bytes,
                               uint32_t box_inner, uint32_t box_outer, bool swizzle) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {inner, outer};
  const cuuint64_t strides[1] = {row_stride_bytes};
  const cuuint32_t box[2] = {box_inner, box_outer};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = encode_tiled()(
      &map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(base), dims, strides, box, elem_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw std::runtime_error("megamoe: cuTensorMapEncodeTiled failed with CUresult " + std::to_string(int(r)));
  return map;
}

}  // namespace megamoe::kernels
