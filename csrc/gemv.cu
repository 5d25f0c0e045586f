// nf4::gemv on CUDA. Up to kFusedGemvMaxRows rows of x: one warp per row n of W decodes that row once
// and dots it with every row of x, accumulating in fp32; the bias is added before the single rounding to
// x's dtype. More rows: W is dequantized once to x's dtype and cuBLAS does the matrix product.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <type_traits>

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

// ---------------------------------------------------------------------------------------------------------
// Tensor-core path (fp16 / bf16 x, sm_80+): y^T = W x^T as mma.sync m16n8k16 tiles, W rows on the mma's M
// side and the (at most 16) rows of x on its N side, fp32 accumulation.
//
// Why this shape: decode is one token per sequence, so the weight bytes are the whole cost and every
// instruction spent per weight byte competes with keeping enough loads in flight. Per packed byte this path
// spends one shared-memory lookup (a 256-entry table mapping the byte straight to its two code values as a
// packed fp16/bf16 pair, so no nibble masking and no per-element conversion) and a quarter of an mma; the
// absmax scale is applied once per 64 elements to the mma's fp32 result instead of once per element.
// The table is replicated once per lane (table[byte][lane]) so that 32 random bytes never share a bank.
//
// Numerics: each weight is code (rounded to x's dtype) * absmax (fp32) instead of dequantize's
// round(code * absmax); both are one rounding of a code-sized relative error, and the output is rounded
// once, so the result stays within the tolerance rule (README, "Correctness") that the tests check.
//
// Lane layout. mma lane (g = lane / 4, t = lane % 4) feeds W rows g and g + 8 of the tile and x row g of
// each n-tile. The k order inside a 64-element step is permuted (the same way for W and x, so the dot
// product is unchanged) so that each lane's operands are 16 consecutive elements: its own 8 packed bytes
// (one 8-byte load per W row) and 16 consecutive x values (two 16-byte loads). mma k-tile j takes lane t's
// elements 16t + 4j .. 16t + 4j + 3, i.e. packed bytes 2j and 2j + 1 of its 8.
constexpr int kTcWarps = 8;         // warps per CTA; all work on one 16-row tile, each on 1/8 of K
constexpr int kTcTileRows = 16;     // W rows per tile (the mma's M)
constexpr int kTcStep = 64;         // K elements per step: 4 mma k-tiles, one absmax scale per row
constexpr int kTcUnroll = 4;        // steps whose weight loads a warp keeps in flight together

template <typename T>
__device__ __forceinline__ uint16_t bits_of(T v);
template <>
__device__ __forceinline__ uint16_t bits_of<__half>(__half v) { return __half_as_ushort(v); }
template <>
__device__ __forceinline__ uint16_t bits_of<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat16_as_ushort(v); }

// D = A * B + C for one m16n8k16 tile, fp32 accumulators.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                                          const float (&c)[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]), "f"(c[2]),
          "f"(c[3]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]), "f"(c[2]),
          "f"(c[3]));
  }
#else
  __trap();  // the host launches this path only on sm_80 or newer
#endif
}

// 8 packed weight bytes, read once: streamed past L1 so that x, which every warp rereads, stays there.
__device__ __forceinline__ uint2 load_weight_bytes(const uint8_t* p) {
  uint2 v;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}

// One 64-element step of one tile: 4 k-tiles into fresh fp32 sums, then acc += absmax * sums per W row.
template <typename T, int kNTiles>
__device__ __forceinline__ void tc_gemv_step(uint2 w_lo, uint2 w_hi, float scale_lo, float scale_hi,
                                             const T* const (&x_lane)[kNTiles], int64_t k0,
                                             const uint32_t (*lut)[32], int lane, float (&acc)[kNTiles][4]) {
  uint4 xv[kNTiles][2];
#pragma unroll
  for (int nt = 0; nt < kNTiles; ++nt) {
    xv[nt][0] = __ldg(reinterpret_cast<const uint4*>(x_lane[nt] + k0));
    xv[nt][1] = __ldg(reinterpret_cast<const uint4*>(x_lane[nt] + k0) + 1);
  }
  float sums[kNTiles][4] = {};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t lo = j < 2 ? w_lo.x : w_lo.y;  // row g's bytes 2j, 2j + 1 are bits shift .. shift + 15
    const uint32_t hi = j < 2 ? w_hi.x : w_hi.y;  // row g + 8's
    const int shift = (j % 2) * 16;
    const uint32_t a[4] = {lut[(lo >> shift) & 0xFF][lane], lut[(hi >> shift) & 0xFF][lane],
                           lut[(lo >> (shift + 8)) & 0xFF][lane], lut[(hi >> (shift + 8)) & 0xFF][lane]};
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
      const uint4& x8 = xv[nt][j / 2];
      mma_16816<T>(sums[nt], a, j % 2 ? x8.z : x8.x, j % 2 ? x8.w : x8.y, sums[nt]);
    }
  }
#pragma unroll
  for (int nt = 0; nt < kNTiles; ++nt) {
    acc[nt][0] = fmaf(scale_lo, sums[nt][0], acc[nt][0]);
    acc[nt][1] = fmaf(scale_lo, sums[nt][1], acc[nt][1]);
    acc[nt][2] = fmaf(scale_hi, sums[nt][2], acc[nt][2]);
    acc[nt][3] = fmaf(scale_hi, sums[nt][3], acc[nt][3]);
  }
}

// Requirements (checked by tensor_core_gemv_applies): K % 64 == 0, blocksize >= 64, packed 8-byte and x
// 16-byte aligned, 1 <= x_rows <= 8 * kNTiles. CTAs loop over 16-row tiles; the 8 warps of a CTA split K
// and their partial sums are added in warp order (deterministic).
template <typename T, int kNTiles>
__global__ void __launch_bounds__(kTcWarps * 32)
    tc_gemv_kernel(const T* __restrict__ x, const uint8_t* __restrict__ packed, BlockScales scales,
                   QuantType quant_type, int blocksize_log2, int64_t rows, int64_t cols, int x_rows,
                   const T* __restrict__ bias, T* __restrict__ out) {
  __shared__ uint32_t lut[256][32];  // packed byte -> (code of high nibble, code of low nibble), per lane
  __shared__ float partial[kTcWarps][kNTiles * 4][32];
  for (int byte = threadIdx.x; byte < 256; byte += blockDim.x) {
    const CodeTable table = code_table(quant_type);
    const uint32_t pair = uint32_t(bits_of(from_float<T>(table.value[byte >> 4]))) |
                          uint32_t(bits_of(from_float<T>(table.value[byte & 0x0F]))) << 16;
#pragma unroll
    for (int copy = 0; copy < 32; ++copy) lut[byte][copy] = pair;
  }
  __syncthreads();

  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int g = lane / 4;
  const int t = lane % 4;
  const int64_t steps = cols / kTcStep;
  const int64_t steps_per_warp = (steps + kTcWarps - 1) / kTcWarps;
  const int64_t step_begin = warp * steps_per_warp;
  const int64_t step_end = step_begin + steps_per_warp < steps ? step_begin + steps_per_warp : steps;
  const int64_t row_bytes = cols / 2;
  const int64_t tiles = (rows + kTcTileRows - 1) / kTcTileRows;
  // This lane's x rows (one per n-tile); rows past x_rows read the last row and their outputs are dropped.
  const T* x_lane[kNTiles];
#pragma unroll
  for (int nt = 0; nt < kNTiles; ++nt) {
    const int m = nt * 8 + g < x_rows ? nt * 8 + g : x_rows - 1;
    x_lane[nt] = x + m * cols + 16 * t;
  }

  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    // W rows past the end are clamped to the last row (valid memory) and their outputs dropped.
    const int64_t row_lo = tile * kTcTileRows + g < rows ? tile * kTcTileRows + g : rows - 1;
    const int64_t row_hi = tile * kTcTileRows + g + 8 < rows ? tile * kTcTileRows + g + 8 : rows - 1;
    const uint8_t* w_lo = packed + row_lo * row_bytes + 8 * t;
    const uint8_t* w_hi = packed + row_hi * row_bytes + 8 * t;
    float acc[kNTiles][4] = {};
    int64_t s = step_begin;
    for (; s + kTcUnroll <= step_end; s += kTcUnroll) {
      uint2 lo[kTcUnroll], hi[kTcUnroll];
#pragma unroll
      for (int u = 0; u < kTcUnroll; ++u) {
        lo[u] = load_weight_bytes(w_lo + (s + u) * (kTcStep / 2));
        hi[u] = load_weight_bytes(w_hi + (s + u) * (kTcStep / 2));
      }
#pragma unroll
      for (int u = 0; u < kTcUnroll; ++u) {
        const int64_t k0 = (s + u) * kTcStep;
        tc_gemv_step<T, kNTiles>(lo[u], hi[u], scales.at((row_lo * cols + k0) >> blocksize_log2),
                                 scales.at((row_hi * cols + k0) >> blocksize_log2), x_lane, k0, lut, lane, acc);
      }
    }
    for (; s < step_end; ++s) {
      const int64_t k0 = s * kTcStep;
      tc_gemv_step<T, kNTiles>(load_weight_bytes(w_lo + s * (kTcStep / 2)),
                               load_weight_bytes(w_hi + s * (kTcStep / 2)),
                               scales.at((row_lo * cols + k0) >> blocksize_log2),
                               scales.at((row_hi * cols + k0) >> blocksize_log2), x_lane, k0, lut, lane, acc);
    }

#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) partial[warp][nt * 4 + i][lane] = acc[nt][i];
    }
    __syncthreads();
    // Warp w adds up accumulator slot w (of 4 * kNTiles) over the 8 warps, in warp order.
    for (int slot = warp; slot < kNTiles * 4; slot += kTcWarps) {
      float sum = 0.0f;
#pragma unroll
      for (int w = 0; w < kTcWarps; ++w) sum += partial[w][slot][lane];
      const int nt = slot / 4;
      const int i = slot % 4;
      const int m = nt * 8 + 2 * t + i % 2;                         // the mma's column: a row of x
      const int64_t n = tile * kTcTileRows + g + (i >= 2 ? 8 : 0);  // the mma's row: a row of W
      if (m < x_rows && n < rows) {
        out[m * rows + n] = from_float<T>(bias != nullptr ? sum + to_float(bias[n]) : sum);
      }
    }
    __syncthreads();  // `partial` is rewritten by the next tile
  }
}


// Whether the tensor-core kernel can take this call (its layout needs whole 64-element steps inside one
// absmax block, 8-byte weight loads and 16-byte x loads).
bool tensor_core_gemv_applies(const at::Tensor& x_2d, const void* packed_bytes, const WeightSpec& spec,
                              int64_t cols) {
  const auto dtype = x_2d.scalar_type();
  return (dtype == at::kHalf || dtype == at::kBFloat16) && at::cuda::getCurrentDeviceProperties()->major >= 8 &&
         cols % kTcStep == 0 && (int64_t{1} << spec.blocksize_log2) >= kTcStep &&
         reinterpret_cast<uintptr_t>(packed_bytes) % 8 == 0 && is_aligned_16(x_2d.const_data_ptr());
}

// Resident CTAs of one tensor-core kernel instance per SM, asked once per device.
template <typename Kernel>
int resident_ctas_per_sm(Kernel kernel) {
  static int cached[64] = {};
  const int device = at::cuda::current_device();
  int& slot = device < 64 ? cached[device] : cached[0];
  if (device >= 64 || slot == 0) {
    int ctas = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, kernel, kTcWarps * 32, 0));
    if (device >= 64) return ctas > 0 ? ctas : 1;
    slot = ctas > 0 ? ctas : 1;
  }
  return slot;
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
  const auto* bytes = static_cast<const uint8_t*>(packed.const_data_ptr());
  const bool tensor_cores = tensor_core_gemv_applies(x_2d, bytes, spec, cols);

  if (x_rows > (tensor_cores ? kTensorCoreGemvMaxRows : kFusedGemvMaxRows)) {
    const at::Tensor w = dequantize_cuda(packed, absmax, blocksize, quant_type, shape, x.scalar_type(),
                                         nested_absmax, nested_code, nested_offset, nested_blocksize);
    return at::linear(x_2d, w, bias).reshape_symint(out_shape);
  }

  at::Tensor out = at::empty({x_rows, rows}, x.options());
  if (x_rows == 0 || rows == 0) return out.reshape_symint(out_shape);
  const at::Tensor bias_c = bias.has_value() ? bias->contiguous() : at::Tensor();
  const BlockScales scales = block_scales(spec, absmax, nested_absmax, nested_code, nested_offset);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();

  NF4_DISPATCH_FLOAT_TYPES(x.scalar_type(), "nf4::gemv", [&] {
    using T = typename CudaScalar<scalar_t>::type;
    const T* x_data = reinterpret_cast<const T*>(x_2d.const_data_ptr<scalar_t>());
    const T* bias_data = bias_c.defined() ? reinterpret_cast<const T*>(bias_c.const_data_ptr<scalar_t>()) : nullptr;
    T* out_data = reinterpret_cast<T*>(out.mutable_data_ptr<scalar_t>());
    if constexpr (!std::is_same_v<T, float>) {
      if (tensor_cores) {
        const auto launch = [&](auto kernel) {
          const int64_t tiles = (rows + kTcTileRows - 1) / kTcTileRows;
          const int64_t resident = int64_t{resident_ctas_per_sm(kernel)} *
                                   at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
          const int grid = static_cast<int>(tiles < resident ? tiles : resident);
          kernel<<<grid, kTcWarps * 32, 0, stream>>>(x_data, bytes, scales, spec.quant_type, spec.blocksize_log2,
                                                     rows, cols, int(x_rows), bias_data, out_data);
        };
        if (x_rows <= 8) {
          launch(tc_gemv_kernel<T, 1>);
        } else {
          launch(tc_gemv_kernel<T, 2>);
        }
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        return;
      }
    }
    const int blocks = static_cast<int>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
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
