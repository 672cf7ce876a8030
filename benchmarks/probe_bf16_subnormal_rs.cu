// Does a register-A BF16 wgmma (m64n16k16) multiply subnormal A operands exactly? The companion of
// probe_bf16_subnormal.py (A in shared memory, through cuBLAS): every element of A one bf16 value (subnormal, or the
// smallest normal as the control), every element of B 2^100, so each output is exactly 16 a 2^100.
//   nvcc -gencode arch=compute_90a,code=sm_90a -o /tmp/rs benchmarks/probe_bf16_subnormal_rs.cu && /tmp/rs
#include <cstdio>
#include <cstdint>
#include <cuda_bf16.h>
__global__ void k(uint16_t a_bits, float* out) {
  __shared__ __align__(1024) uint16_t b[16 * 16 * 8];  // every element 2^100: any layout the descriptor reads
  for (int i = threadIdx.x; i < 16 * 16 * 8; i += blockDim.x) b[i] = 0x7180;  // bf16 2^100 (exp 227)
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  const uint32_t a = uint32_t(a_bits) | (uint32_t(a_bits) << 16);
  float d[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(b));
  const uint64_t desc = uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t(128 >> 4) << 16) | (uint64_t(256 >> 4) << 32);
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "r"(a), "r"(a), "r"(a), "r"(a), "l"(desc), "r"(0));
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  for (int i = 0; i < 8; ++i) out[threadIdx.x * 8 + i] = d[i];
}
int main() {
  float* out;
  cudaMallocManaged(&out, 128 * 8 * sizeof(float));
  const uint16_t cases[] = {0x0040, 0x0001, 0x0060, 0x0080};  // 2^-127, 2^-133, 1.5 x 2^-127; 2^-126
  const double want[] = {16.0 * 0x1p-127 * 0x1p100, 16.0 * 0x1p-133 * 0x1p100, 16.0 * 0x1.8p-127 * 0x1p100,
                         16.0 * 0x1p-126 * 0x1p100};
  for (int c = 0; c < 4; ++c) {
    k<<<1, 128>>>(cases[c], out);
    cudaError_t e = cudaDeviceSynchronize();
    int exact = 0;
    for (int i = 0; i < 128 * 8; ++i) exact += double(out[i]) == want[c];
    printf("register-A m64n16k16 bf16: a bits %#06x, b 2^100: d[0] %.6e want %.6e, %d of 1024 exact (%s)\n", cases[c],
           out[0], want[c], exact, cudaGetErrorString(e));
  }
  return 0;
}
