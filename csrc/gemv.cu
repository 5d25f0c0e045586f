// nf4::gemv on CUDA, three paths chosen per call by the crossover constants in ops.h:
//  - the tensor-core kernel (below, "Tensor-core path"): fp16/bf16 x of up to kTensorCoreGemvMaxRows rows
//    on sm_80+, when the shape and alignment allow;
//  - the CUDA-core kernel (fp32 x, odd shapes, up to kFusedGemvMaxRows rows): one warp per row n of W
//    decodes that row once and dots it with every row of x, accumulating in fp32;
//  - more rows: W is dequantized once to x's dtype and cuBLAS does the matrix product.
// The fused kernels add the bias before the single rounding to x's dtype.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
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
// spends one byte permute (which builds the table address), one add and one shared-memory lookup in a
// 256-entry table that maps the byte straight to its two code values as a packed fp16/bf16 pair, plus a
// quarter of an mma; the absmax scale is applied once per 64 elements to the mma's fp32 result instead of
// once per element. The table is replicated once per lane, entry e of lane l at byte e * 256 + 4 * l, so
// that 32 random bytes never share a bank and the byte permute alone forms the offset (byte in bits 8..15,
// 4 * lane in bits 0..7).
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
//
// Work split. A work item is one 16-row tile and one slice of K; the 8 warps of a CTA split the slice
// again and add their sums in warp order. CTAs loop over work items (as many CTAs as fit at once). When K
// is sliced (`splits` > 1, for layers with few rows), each slice writes fp32 partial sums and a second
// kernel adds them in slice order. Every order is fixed, so the result is the same on every run.
constexpr int kTcWarps = 8;                 // warps per CTA
constexpr int kTcTileRows = 16;             // W rows per tile (the mma's M)
constexpr int kTcStep = 64;                 // K elements per step: 4 mma k-tiles, one absmax scale per row
#ifndef NF4_TC_UNROLL  // build-time knobs for tuning runs (benchmarks/NOTES.md); the defaults are the measured best
#define NF4_TC_UNROLL 4
#endif
#ifndef NF4_TC_MIN_CTAS_PER_SM
#define NF4_TC_MIN_CTAS_PER_SM 1
#endif
constexpr int kTcUnroll = NF4_TC_UNROLL;    // steps per loop turn; the next turn's weight loads are in flight
constexpr int kTcLutEntryBytes = 256;       // one table entry (32 lanes x 4 bytes, then unused) per 256 bytes
constexpr int kTcLutBytes = 256 * kTcLutEntryBytes;
constexpr int kTcMaxSplits = 8;             // most K slices per tile
constexpr int kTcMinStepsPerSlice = 16;     // a K slice keeps at least this many steps (2 per warp)
constexpr int64_t kTcMinRounds = 4;         // K is sliced until the resident CTAs go round this many times

constexpr int tc_shared_bytes(int n_tiles) { return kTcLutBytes + kTcWarps * n_tiles * 4 * 32 * 4; }

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
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]), "f"(c[2]),
          "f"(c[3]));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
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
  asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}

// The code pair of byte `kByte` (0..3) of `word`, from this lane's copy of the table.
template <int kByte>
__device__ __forceinline__ uint32_t code_pair(const uint8_t* lut, uint32_t word, uint32_t lane4) {
  // result byte 0 <- lane4's byte 0 (selector 4), byte 1 <- word's byte kByte, bytes 2, 3 <- zero (lane4's 1)
  const uint32_t offset = __byte_perm(word, lane4, 0x5504 | (kByte << 4));
  return *reinterpret_cast<const uint32_t*>(lut + offset);
}

// One 64-element step of one tile: 4 k-tiles into fresh fp32 sums, then acc += absmax * sums per W row.
template <typename T, int kNTiles>
__device__ __forceinline__ void tc_gemv_step(uint2 w_lo, uint2 w_hi, float scale_lo, float scale_hi,
                                             const T* const (&x_lane)[kNTiles], int64_t k0, bool live,
                                             const uint8_t* lut, uint32_t lane4, float (&acc)[kNTiles][4]) {
  uint4 xv[kNTiles][2];
#pragma unroll
  for (int nt = 0; nt < kNTiles; ++nt) {  // a step past the end reads no x (it may lie past x's end)
    const uint4* x16 = reinterpret_cast<const uint4*>(x_lane[nt] + k0);
    xv[nt][0] = live ? __ldg(x16) : make_uint4(0, 0, 0, 0);
    xv[nt][1] = live ? __ldg(x16 + 1) : make_uint4(0, 0, 0, 0);
  }
  float sums[kNTiles][4] = {};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t lo = j < 2 ? w_lo.x : w_lo.y;  // row g's packed bytes 2j and 2j + 1 are bytes
    const uint32_t hi = j < 2 ? w_hi.x : w_hi.y;  // (j % 2) * 2 and + 1 of these words; row g + 8's
    uint32_t a[4];
    if (j % 2 == 0) {
      a[0] = code_pair<0>(lut, lo, lane4), a[1] = code_pair<0>(lut, hi, lane4);
      a[2] = code_pair<1>(lut, lo, lane4), a[3] = code_pair<1>(lut, hi, lane4);
    } else {
      a[0] = code_pair<2>(lut, lo, lane4), a[1] = code_pair<2>(lut, hi, lane4);
      a[2] = code_pair<3>(lut, lo, lane4), a[3] = code_pair<3>(lut, hi, lane4);
    }
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

// The absmax of the block holding element k0 of a row whose first element is flat element `row_start`.
template <bool kNested>
__device__ __forceinline__ float row_scale(const BlockScales& scales, int64_t row_start, int64_t k0,
                                           int blocksize_log2) {
  return scales.at_known<kNested>((row_start + k0) >> blocksize_log2);
}

// Requirements (checked by tensor_core_gemv_applies): K % 64 == 0, blocksize >= 64, packed 8-byte and x
// 16-byte aligned, 1 <= x_rows <= 8 * kNTiles. `partial` is [splits, x_rows, rows] fp32 when splits > 1.
template <typename T, int kNTiles, bool kNested>
__global__ void __launch_bounds__(kTcWarps * 32, NF4_TC_MIN_CTAS_PER_SM)
    tc_gemv_kernel(const T* __restrict__ x, const uint8_t* __restrict__ packed, BlockScales scales,
                   QuantType quant_type, int blocksize_log2, int64_t rows, int64_t cols, int x_rows, int splits,
                   const T* __restrict__ bias, T* __restrict__ out, float* __restrict__ partial) {
  extern __shared__ __align__(16) uint8_t tc_shared[];
  uint8_t* lut = tc_shared;
  float(*warp_sums)[kNTiles * 4][32] = reinterpret_cast<float(*)[kNTiles * 4][32]>(tc_shared + kTcLutBytes);
  for (int byte = threadIdx.x; byte < 256; byte += blockDim.x) {
    const CodeTable table = code_table(quant_type);
    const uint32_t pair = uint32_t(bits_of(from_float<T>(table.value[byte >> 4]))) |
                          uint32_t(bits_of(from_float<T>(table.value[byte & 0x0F]))) << 16;
    uint4* entry = reinterpret_cast<uint4*>(lut + byte * kTcLutEntryBytes);
#pragma unroll
    for (int i = 0; i < 8; ++i) entry[i] = make_uint4(pair, pair, pair, pair);  // lanes 4i .. 4i + 3
  }
  __syncthreads();

  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int g = lane / 4;
  const int t = lane % 4;
  const uint32_t lane4 = 4 * lane;
  const int64_t steps = cols / kTcStep;
  const int64_t steps_per_slice = (steps + splits - 1) / splits;
  const int64_t steps_per_warp = (steps_per_slice + kTcWarps - 1) / kTcWarps;
  const int64_t row_bytes = cols / 2;
  const int64_t items = (rows + kTcTileRows - 1) / kTcTileRows * splits;
  // This lane's x rows (one per n-tile); rows past x_rows read the last row and their outputs are dropped.
  const T* x_lane[kNTiles];
#pragma unroll
  for (int nt = 0; nt < kNTiles; ++nt) {
    const int m = nt * 8 + g < x_rows ? nt * 8 + g : x_rows - 1;
    x_lane[nt] = x + m * cols + 16 * t;
  }

  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int64_t tile = item / splits;
    const int split = static_cast<int>(item % splits);
    const int64_t slice_end = (split + 1) * steps_per_slice < steps ? (split + 1) * steps_per_slice : steps;
    const int64_t begin = split * steps_per_slice + warp * steps_per_warp;
    const int64_t end = begin + steps_per_warp < slice_end ? begin + steps_per_warp : slice_end;
    // W rows past the end are clamped to the last row (valid memory) and their outputs dropped.
    const int64_t row_lo = tile * kTcTileRows + g < rows ? tile * kTcTileRows + g : rows - 1;
    const int64_t row_hi = tile * kTcTileRows + g + 8 < rows ? tile * kTcTileRows + g + 8 : rows - 1;
    const uint8_t* w_lo = packed + row_lo * row_bytes + 8 * t;
    const uint8_t* w_hi = packed + row_hi * row_bytes + 8 * t;
    const int64_t start_lo = row_lo * cols;
    const int64_t start_hi = row_hi * cols;

    // A turn is kTcUnroll steps, with no branches inside so that the compiler can issue every load early;
    // steps past `end` get zero weight bytes, zero scales and zero x, and add nothing. The weight bytes and
    // scales of the next turn are requested before this turn's are used.
    const auto fetch = [&](int64_t first, uint2 (&lo)[kTcUnroll], uint2 (&hi)[kTcUnroll],
                           float (&scale_lo)[kTcUnroll], float (&scale_hi)[kTcUnroll]) {
#pragma unroll
      for (int u = 0; u < kTcUnroll; ++u) {
        const bool live = first + u < end;
        const int64_t k0 = (first + u) * kTcStep;
        lo[u] = live ? load_weight_bytes(w_lo + k0 / 2) : make_uint2(0, 0);
        hi[u] = live ? load_weight_bytes(w_hi + k0 / 2) : make_uint2(0, 0);
        scale_lo[u] = live ? row_scale<kNested>(scales, start_lo, k0, blocksize_log2) : 0.0f;
        scale_hi[u] = live ? row_scale<kNested>(scales, start_hi, k0, blocksize_log2) : 0.0f;
      }
    };
    float acc[kNTiles][4] = {};
    uint2 lo[kTcUnroll], hi[kTcUnroll];
    float scale_lo[kTcUnroll], scale_hi[kTcUnroll];
    fetch(begin, lo, hi, scale_lo, scale_hi);
    for (int64_t s = begin; s < end; s += kTcUnroll) {
      uint2 next_lo[kTcUnroll], next_hi[kTcUnroll];
      float next_scale_lo[kTcUnroll], next_scale_hi[kTcUnroll];
      fetch(s + kTcUnroll, next_lo, next_hi, next_scale_lo, next_scale_hi);
#pragma unroll
      for (int u = 0; u < kTcUnroll; ++u) {
        tc_gemv_step<T, kNTiles>(lo[u], hi[u], scale_lo[u], scale_hi[u], x_lane, (s + u) * kTcStep,
                                 s + u < end, lut, lane4, acc);
      }
#pragma unroll
      for (int u = 0; u < kTcUnroll; ++u) {
        lo[u] = next_lo[u], hi[u] = next_hi[u], scale_lo[u] = next_scale_lo[u], scale_hi[u] = next_scale_hi[u];
      }
    }

#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) warp_sums[warp][nt * 4 + i][lane] = acc[nt][i];
    }
    __syncthreads();
    // Warp w adds up accumulator slot w (of 4 * kNTiles) over the 8 warps, in warp order.
    for (int slot = warp; slot < kNTiles * 4; slot += kTcWarps) {
      float sum = 0.0f;
#pragma unroll
      for (int w = 0; w < kTcWarps; ++w) sum += warp_sums[w][slot][lane];
      const int m = slot / 4 * 8 + 2 * t + slot % 2;                      // the mma's column: a row of x
      const int64_t n = tile * kTcTileRows + g + (slot % 4 >= 2 ? 8 : 0);  // the mma's row: a row of W
      if (m < x_rows && n < rows) {
        if (splits > 1) {
          partial[(split * int64_t{x_rows} + m) * rows + n] = sum;
        } else {
          out[m * rows + n] = from_float<T>(bias != nullptr ? sum + to_float(bias[n]) : sum);
        }
      }
    }
    __syncthreads();  // warp_sums is rewritten by the next item
  }
}

// out[i] = partial[0][i] + partial[1][i] + ... (+ bias), in slice order; i runs over x_rows * rows.
template <typename T>
__global__ void add_slices_kernel(const float* __restrict__ partial, int splits, int64_t count, int64_t rows,
                                  const T* __restrict__ bias, T* __restrict__ out) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count; i += int64_t{gridDim.x} * blockDim.x) {
    float sum = 0.0f;
    for (int s = 0; s < splits; ++s) sum += partial[s * count + i];
    out[i] = from_float<T>(bias != nullptr ? sum + to_float(bias[i % rows]) : sum);
  }
}

// Whether the tensor-core kernel can take this call (its layout needs whole 64-element steps inside one
// absmax block, 8-byte weight loads, 16-byte x loads and its 72 KiB of shared memory).
bool tensor_core_gemv_applies(const at::Tensor& x_2d, const void* packed_bytes, const WeightSpec& spec,
                              int64_t cols) {
  const auto dtype = x_2d.scalar_type();
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  return (dtype == at::kHalf || dtype == at::kBFloat16) && props->major >= 8 &&
         props->sharedMemPerBlockOptin >= size_t{tc_shared_bytes(2)} && cols % kTcStep == 0 &&
         (int64_t{1} << spec.blocksize_log2) >= kTcStep && reinterpret_cast<uintptr_t>(packed_bytes) % 8 == 0 &&
         is_aligned_16(x_2d.const_data_ptr());
}

// Allows tc_gemv_kernel<T, kNTiles, kNested> its dynamic shared memory on the current device and returns
// how many of its CTAs fit on one SM there; done once per device and kernel instance.
template <typename T, int kNTiles, bool kNested>
int prepare_tc_kernel() {
  static std::atomic<int> resident[64] = {};
  const int device = at::cuda::current_device();
  if (device < 64 && resident[device].load() > 0) return resident[device].load();
  const auto kernel = tc_gemv_kernel<T, kNTiles, kNested>;
  const int shared_bytes = tc_shared_bytes(kNTiles);
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes));
  int ctas = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, kernel, kTcWarps * 32, shared_bytes));
  TORCH_CHECK(ctas > 0, "nf4::gemv: the tensor-core kernel does not fit on this GPU's SMs");
  if (device < 64) resident[device].store(ctas);
  return ctas;
}

// How many K slices each 16-row tile is cut into: enough work items that the resident CTAs go round at
// least kTcMinRounds times (so the last, partly filled round costs little) while each slice keeps at least
// kTcMinStepsPerSlice steps. Layers with many rows get 1 (no second kernel).
int tc_splits(int64_t tiles, int64_t steps, int64_t resident_ctas) {
  int splits = 1;
  while (splits < kTcMaxSplits && tiles * splits < kTcMinRounds * resident_ctas &&
         steps / (2 * splits) >= kTcMinStepsPerSlice) {
    splits *= 2;
  }
  return splits;
}

template <typename T>
void launch_tc_gemv(const T* x, const uint8_t* packed, const BlockScales& scales, const WeightSpec& spec,
                    int64_t rows, int64_t cols, int64_t x_rows, const T* bias, T* out, const at::Tensor& like,
                    cudaStream_t stream) {
  const auto run = [&](auto n_tiles_constant, auto nested_constant) {
    constexpr int kNTiles = decltype(n_tiles_constant)::value;
    constexpr bool kNested = decltype(nested_constant)::value;
    const int shared_bytes = tc_shared_bytes(kNTiles);
    const int64_t resident = int64_t{prepare_tc_kernel<T, kNTiles, kNested>()} *
                             at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    const int64_t tiles = (rows + kTcTileRows - 1) / kTcTileRows;
    const int splits = tc_splits(tiles, cols / kTcStep, resident);
    const int grid = static_cast<int>(std::min(tiles * splits, resident));
    at::Tensor partial;
    if (splits > 1) partial = at::empty({splits, x_rows, rows}, like.options().dtype(at::kFloat));
    float* partial_data = splits > 1 ? partial.mutable_data_ptr<float>() : nullptr;
    tc_gemv_kernel<T, kNTiles, kNested><<<grid, kTcWarps * 32, shared_bytes, stream>>>(
        x, packed, scales, spec.quant_type, spec.blocksize_log2, rows, cols, int(x_rows), splits, bias, out,
        partial_data);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (splits > 1) {
      const int64_t count = x_rows * rows;
      const int threads = 256;
      const int blocks = static_cast<int>(std::min<int64_t>((count + threads - 1) / threads, resident * 8));
      add_slices_kernel<T><<<blocks, threads, 0, stream>>>(partial_data, splits, count, rows, bias, out);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  };
  using One = std::integral_constant<int, 1>;
  using Two = std::integral_constant<int, 2>;
  if (scales.nested()) {
    x_rows <= 8 ? run(One{}, std::true_type{}) : run(Two{}, std::true_type{});
  } else {
    x_rows <= 8 ? run(One{}, std::false_type{}) : run(Two{}, std::false_type{});
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
        launch_tc_gemv<T>(x_data, bytes, scales, spec, rows, cols, x_rows, bias_data, out_data, out, stream);
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
