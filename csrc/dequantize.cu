// nf4::dequantize on CUDA. Each lane turns one packed word into one 16-byte store of output: 8 elements
// (a 4-byte word) for fp16/bf16, 4 elements (a 2-byte word) for fp32, so a warp's loads and stores are
// both contiguous. Blocksizes are powers of two >= 32, so an item never straddles an absmax block and
// takes one scale; the nested absmax is computed in the same launch. Each lane keeps kUnroll
// independent items in flight. Elements past the last whole item, and every element when `packed` or
// `out` is not aligned for the vector path, take a scalar path.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <type_traits>

#include "cuda_types.cuh"
#include "ops.h"

namespace nf4 {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;

template <typename T>
struct Item {
  static constexpr int kElements = sizeof(uint4) / sizeof(T);  // one 16-byte store
  using PackedWord = std::conditional_t<kElements == 8, uint32_t, uint16_t>;
  static_assert(sizeof(PackedWord) * 2 == kElements, "two elements per packed byte");
};

template <typename T>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const uint8_t* __restrict__ packed, BlockScales scales, QuantType quant_type,
                      int blocksize_log2, int64_t numel, int64_t vector_items, T* __restrict__ out) {
  using Word = typename Item<T>::PackedWord;
  constexpr int kElements = Item<T>::kElements;
  __shared__ float table[16];
  if (threadIdx.x < 16) table[threadIdx.x] = code_table(quant_type).value[threadIdx.x];
  __syncthreads();

  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t first = tid; first < vector_items; first += stride * kUnroll) {
    Word words[kUnroll];
    float item_scales[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {  // all loads first: kUnroll independent requests in flight
      const int64_t item = first + u * stride;
      if (item < vector_items) {
        words[u] = __ldg(reinterpret_cast<const Word*>(packed) + item);
        item_scales[u] = scales.at((item * kElements) >> blocksize_log2);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t item = first + u * stride;
      if (item < vector_items) {
        alignas(16) T values[kElements];
#pragma unroll
        for (int byte = 0; byte < kElements / 2; ++byte) {
          const uint32_t b = (uint32_t(words[u]) >> (8 * byte)) & 0xFF;  // little-endian: byte 0 first
          values[2 * byte] = from_float<T>(__fmul_rn(table[b >> 4], item_scales[u]));  // even = high nibble
          values[2 * byte + 1] = from_float<T>(__fmul_rn(table[b & 0x0F], item_scales[u]));
        }
        reinterpret_cast<uint4*>(out)[item] = *reinterpret_cast<const uint4*>(values);
      }
    }
  }
  for (int64_t e = vector_items * kElements + tid; e < numel; e += stride) {
    out[e] = from_float<T>(mul_rn(table[nibble_at(packed, e)], scales.at(e >> blocksize_log2)));
  }
}

void launch_dequantize(const WeightSpec& spec, const at::Tensor& packed, const BlockScales& scales,
                       at::Tensor& out) {
  const int64_t numel = spec.rows.expect_int() * spec.cols.expect_int();
  const auto* bytes = static_cast<const uint8_t*>(packed.const_data_ptr());
  NF4_DISPATCH_FLOAT_TYPES(out.scalar_type(), "nf4::dequantize", [&] {
    using T = typename CudaScalar<scalar_t>::type;
    T* out_data = reinterpret_cast<T*>(out.mutable_data_ptr<scalar_t>());
    constexpr int kElements = Item<T>::kElements;
    const bool vectorize = reinterpret_cast<uintptr_t>(bytes) % sizeof(typename Item<T>::PackedWord) == 0 &&
                           is_aligned_16(out_data);
    const int64_t vector_items = vectorize ? numel / kElements : 0;
    const int64_t scalar_elements = numel - vector_items * kElements;
    const int64_t work = std::max<int64_t>((vector_items + kUnroll - 1) / kUnroll, scalar_elements);
    // One pass of kUnroll items per thread, not a persistent grid: on an H100 a grid of only the resident
    // CTAs was measured slower (85-88% of the copy ceiling instead of 90% on 300-600 MB layers).
    const int64_t max_blocks = int64_t(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) * 32;
    const int blocks = static_cast<int>(std::clamp<int64_t>((work + kThreads - 1) / kThreads, 1, max_blocks));
    dequantize_kernel<T><<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        bytes, scales, spec.quant_type, spec.blocksize_log2, numel, vector_items, out_data);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace

at::Tensor dequantize_cuda(NF4_DEQUANTIZE_PARAMS) {
  const WeightSpec spec = check_dequantize_args(packed, absmax, blocksize, quant_type, shape, dtype, nested_absmax,
                                                nested_code, nested_offset, nested_blocksize);
  const c10::cuda::CUDAGuard device_guard(packed.device());
  at::Tensor out = at::empty({spec.rows.expect_int(), spec.cols.expect_int()}, packed.options().dtype(dtype));
  launch_dequantize(spec, packed, block_scales(spec, absmax, nested_absmax, nested_code, nested_offset), out);
  return out;
}

void dequantize_out_cuda(NF4_DEQUANTIZE_PARAMS, at::Tensor& out) {
  const WeightSpec spec = check_dequantize_out_args(packed, absmax, blocksize, quant_type, shape, dtype,
                                                    nested_absmax, nested_code, nested_offset, nested_blocksize, out);
  const c10::cuda::CUDAGuard device_guard(packed.device());
  launch_dequantize(spec, packed, block_scales(spec, absmax, nested_absmax, nested_code, nested_offset), out);
}

TORCH_LIBRARY_IMPL(nf4, CUDA, m) {
  m.impl("dequantize", &dequantize_cuda);
  m.impl("dequantize.out", &dequantize_out_cuda);
}

}  // namespace nf4
