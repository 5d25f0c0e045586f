// nf4::dequantize on CUDA. Each thread decodes one 16-byte chunk of packed bytes (32 elements, which
// always share one absmax block since blocksizes are powers of two >= 32) and writes them with 16-byte
// stores; the nested absmax is computed in the same launch. Elements past the last whole chunk, and
// every element when `packed` is not 16-byte aligned, take a scalar path.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "cuda_types.cuh"
#include "ops.h"

namespace nf4 {
namespace {

constexpr int kThreads = 256;
constexpr int kChunkElements = 32;

template <typename T>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const uint8_t* __restrict__ packed, BlockScales scales, QuantType quant_type,
                      int blocksize_log2, int64_t numel, int64_t vector_chunks, T* __restrict__ out) {
  __shared__ float table[16];
  if (threadIdx.x < 16) table[threadIdx.x] = code_table(quant_type).value[threadIdx.x];
  __syncthreads();

  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t chunk = tid; chunk < vector_chunks; chunk += stride) {
    const uint4 raw = load_packed_chunk(packed, chunk);
    const float scale = scales.at((chunk * kChunkElements) >> blocksize_log2);
    float w[kChunkElements];
    decode_chunk(raw, table, scale, w);
    alignas(16) T values[kChunkElements];
#pragma unroll
    for (int i = 0; i < kChunkElements; ++i) values[i] = from_float<T>(w[i]);
    constexpr int kStores = kChunkElements * sizeof(T) / sizeof(uint4);
    uint4* dst = reinterpret_cast<uint4*>(out + chunk * kChunkElements);
#pragma unroll
    for (int i = 0; i < kStores; ++i) dst[i] = reinterpret_cast<const uint4*>(values)[i];
  }
  for (int64_t e = vector_chunks * kChunkElements + tid; e < numel; e += stride) {
    out[e] = from_float<T>(mul_rn(table[nibble_at(packed, e)], scales.at(e >> blocksize_log2)));
  }
}

}  // namespace

at::Tensor dequantize_cuda(NF4_DEQUANTIZE_PARAMS) {
  const WeightSpec spec = check_dequantize_args(packed, absmax, blocksize, quant_type, shape, dtype, nested_absmax,
                                                nested_code, nested_offset, nested_blocksize);
  const c10::cuda::CUDAGuard device_guard(packed.device());
  const int64_t rows = spec.rows.expect_int();
  const int64_t cols = spec.cols.expect_int();
  const int64_t numel = rows * cols;
  at::Tensor out = at::empty({rows, cols}, packed.options().dtype(dtype));
  const auto* bytes = static_cast<const uint8_t*>(packed.const_data_ptr());
  const BlockScales scales = block_scales(spec, absmax, nested_absmax, nested_code, nested_offset);

  NF4_DISPATCH_FLOAT_TYPES(dtype, "nf4::dequantize", [&] {
    using T = typename CudaScalar<scalar_t>::type;
    T* out_data = reinterpret_cast<T*>(out.mutable_data_ptr<scalar_t>());
    const bool vectorize = is_aligned_16(bytes) && is_aligned_16(out_data);
    const int64_t vector_chunks = vectorize ? numel / kChunkElements : 0;
    const int64_t scalar_elements = numel - vector_chunks * kChunkElements;
    const int64_t work = std::max<int64_t>(vector_chunks, scalar_elements);
    const int64_t max_blocks = int64_t(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) * 64;
    const int blocks = static_cast<int>(std::clamp<int64_t>((work + kThreads - 1) / kThreads, 1, max_blocks));
    dequantize_kernel<T><<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        bytes, scales, spec.quant_type, spec.blocksize_log2, numel, vector_chunks, out_data);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

TORCH_LIBRARY_IMPL(nf4, CUDA, m) { m.impl("dequantize", &dequantize_cuda); }

}  // namespace nf4
