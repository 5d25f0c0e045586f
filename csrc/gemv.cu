// nf4::gemv on CUDA. Up to kFusedGemvMaxRows rows of x: one warp per row n of W decodes that row once
// and dots it with every row of x, accumulating in fp32; the bias is added before the single rounding to
// x's dtype. More rows: W is dequantized once to x's dtype and cuBLAS does the matrix product.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "cuda_types.cuh"
#include "ops.h"

namespace nf4 {
namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kChunkElements = 32;

// Adds x[m, k0 .. k0+31] . w to acc, for a 16-byte-aligned x row.
template <typename T>
__device__ __forceinline__ float dot_chunk(const T* x_chunk, const float (&w)[kChunkElements]) {
  constexpr int kPerVector = sizeof(uint4) / sizeof(T);
  float acc = 0.0f;
#pragma unroll
  for (int v = 0; v < kChunkElements / kPerVector; ++v) {
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(x_chunk) + v);
    const T* xs = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < kPerVector; ++i) acc += to_float(xs[i]) * w[v * kPerVector + i];
  }
  return acc;
}

// kVectorized: K % 32 == 0 and packed / x 16-byte aligned, so each lane takes whole 32-element chunks
// (16 packed bytes, one absmax block). Otherwise each lane takes single elements.
template <typename T, bool kVectorized>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    fused_gemv_kernel(const T* __restrict__ x, const uint8_t* __restrict__ packed, BlockScales scales,
                      QuantType quant_type, int blocksize_log2, int64_t rows, int64_t cols, int x_rows,
                      const T* __restrict__ bias, T* __restrict__ out) {
  __shared__ float table[16];
  if (threadIdx.x < 16) table[threadIdx.x] = code_table(quant_type).value[threadIdx.x];
  __syncthreads();

  const int lane = threadIdx.x % 32;
  const int64_t n = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (n >= rows) return;
  const int64_t row_start = n * cols;  // flat element index of W[n, 0]

  float acc[kFusedGemvMaxRows] = {};
  if constexpr (kVectorized) {
    const int64_t chunks = cols / kChunkElements;
    const int64_t first_chunk = row_start / kChunkElements;
    for (int64_t c = lane; c < chunks; c += 32) {
      const int64_t chunk = first_chunk + c;
      float w[kChunkElements];
      decode_chunk(load_packed_chunk(packed, chunk), table, scales.at((chunk * kChunkElements) >> blocksize_log2), w);
#pragma unroll
      for (int m = 0; m < kFusedGemvMaxRows; ++m) {
        if (m < x_rows) acc[m] += dot_chunk(x + m * cols + c * kChunkElements, w);
      }
    }
  } else {
    for (int64_t k = lane; k < cols; k += 32) {
      const int64_t e = row_start + k;
      const float w = mul_rn(table[nibble_at(packed, e)], scales.at(e >> blocksize_log2));
#pragma unroll
      for (int m = 0; m < kFusedGemvMaxRows; ++m) {
        if (m < x_rows) acc[m] += to_float(x[m * cols + k]) * w;
      }
    }
  }

#pragma unroll
  for (int m = 0; m < kFusedGemvMaxRows; ++m) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], offset);
  }
  if (lane == 0) {
    const float b = bias != nullptr ? to_float(bias[n]) : 0.0f;
#pragma unroll
    for (int m = 0; m < kFusedGemvMaxRows; ++m) {
      if (m < x_rows) out[m * rows + n] = from_float<T>(acc[m] + b);
    }
  }
}

}  // namespace

at::Tensor gemv_cuda(NF4_GEMV_PARAMS) {
  const WeightSpec spec = check_gemv_args(x, packed, absmax, blocksize, quant_type, shape, bias, nested_absmax,
                                          nested_code, nested_offset, nested_blocksize);
  const c10::cuda::CUDAGuard device_guard(packed.device());
  const int64_t rows = spec.rows.expect_int();
  const int64_t cols = spec.cols.expect_int();
  const at::Tensor x_2d = x.reshape({-1, cols}).contiguous();
  const int64_t x_rows = x_2d.size(0);
  const c10::SymDimVector out_shape = gemv_output_shape(x, spec.rows);

  if (x_rows > kFusedGemvMaxRows) {
    const at::Tensor w = dequantize_cuda(packed, absmax, blocksize, quant_type, shape, x.scalar_type(),
                                         nested_absmax, nested_code, nested_offset, nested_blocksize);
    return at::linear(x_2d, w, bias).reshape_symint(out_shape);
  }

  at::Tensor out = at::empty({x_rows, rows}, x.options());
  if (x_rows == 0) return out.reshape_symint(out_shape);
  const at::Tensor bias_c = bias.has_value() ? bias->contiguous() : at::Tensor();
  const auto* bytes = static_cast<const uint8_t*>(packed.const_data_ptr());
  const BlockScales scales = block_scales(spec, absmax, nested_absmax, nested_code, nested_offset);
  const int blocks = static_cast<int>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();

  NF4_DISPATCH_FLOAT_TYPES(x.scalar_type(), "nf4::gemv", [&] {
    using T = typename CudaScalar<scalar_t>::type;
    const T* x_data = reinterpret_cast<const T*>(x_2d.const_data_ptr<scalar_t>());
    const T* bias_data = bias_c.defined() ? reinterpret_cast<const T*>(bias_c.const_data_ptr<scalar_t>()) : nullptr;
    T* out_data = reinterpret_cast<T*>(out.mutable_data_ptr<scalar_t>());
    const bool vectorize = cols % kChunkElements == 0 && is_aligned_16(bytes) && is_aligned_16(x_data);
    if (vectorize) {
      fused_gemv_kernel<T, true><<<blocks, kWarpsPerBlock * 32, 0, stream>>>(
          x_data, bytes, scales, spec.quant_type, spec.blocksize_log2, rows, cols, int(x_rows), bias_data, out_data);
    } else {
      fused_gemv_kernel<T, false><<<blocks, kWarpsPerBlock * 32, 0, stream>>>(
          x_data, bytes, scales, spec.quant_type, spec.blocksize_log2, rows, cols, int(x_rows), bias_data, out_data);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out.reshape_symint(out_shape);
}

TORCH_LIBRARY_IMPL(nf4, CUDA, m) { m.impl("gemv", &gemv_cuda); }

}  // namespace nf4
