// nf4::gemv on CUDA for more rows of fp16 / bf16 x than the tensor-core kernel takes in one launch
// (kTensorCoreGemvLaunchRows): the many-rows kernel, which decodes each weight once per 32 or 64 rows of x.
//
// Why a kernel of its own: the tensor-core kernel (csrc/gemv.cu) decodes W for at most 16 rows of x, so more rows
// took one launch per 16 rows, each decoding and reading all of W again, and past the limits of
// kTensorCoreGemvRowLimits W was dequantized to a 16-bit temporary for cuBLAS (written and read again: on Llama's
// gate/up 4x the packed bytes).
//
// Layout. A CTA (m tile, n tile, K split) takes W rows [128 n, 128 n + 128), x rows [32 m, 32 m + 32) and the K
// steps (64 elements, one absmax block per row) of split z; its 4 warps take 32 W rows each (two mma m-tiles) by
// the 32 x rows (four mma n-tiles). Each step the CTA copies the tile's packed bytes and x rows into a ring of
// kMrStages stages with cp.async (three steps in flight), and each warp decodes its own W rows from the stage
// straight into mma A fragments (one lookup per packed byte in a table of code pairs), reads the x rows with
// ldmatrix (16-byte XOR swizzle, no bank conflicts) and multiplies on mma.sync; each step's fp32 sums are scaled by
// the rows' absmax and added, as in the tensor-core kernel. The m tiles are blockIdx.x, so the CTAs that read the
// same W rows run side by side and all but the first find them in L2. Layers with fewer tiles than resident CTAs
// split K (kMrMinStepsPerSplit steps at least), each split writing fp32 partial sums that a second kernel adds in
// split order, so every run gives the same bits (the split count depends on the x tiles too, so a row's bits may
// differ between calls of different row counts; unlike the launches of 16 rows, no such equality is promised). Earlier versions, which decoded W into shared memory for ldmatrix
// or with byte-permute arithmetic, were 1.3-2.3x slower (benchmarks/NOTES.md, gemv row 63).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <atomic>
#include <type_traits>

#include "cuda_types.cuh"
#include "launch_cache.h"
#include "mma_sync.cuh"
#include "ops.h"

namespace nf4 {
namespace {

constexpr int kMrWarpsN = 4;                          // warps along W's rows
constexpr int kMrWarpRows = 32;                       // W rows per warp: two mma m-tiles of 16
constexpr int kMrTileRows = kMrWarpsN * kMrWarpRows;  // W rows per CTA
constexpr int kMrStep = 64;                           // K elements per step: 4 mma k-tiles, one absmax block
constexpr int kMrStepBytes = kMrStep / 2;             // packed bytes of a row's step
constexpr int kMrRowBytes = kMrStep * 2;              // an x row's step: 8 chunks of 16 bytes
constexpr int kMrStages = 4;                          // cp.async ring: the step multiplied, three more in flight
constexpr int kMrMinStepsPerSplit = 8;
constexpr int64_t kMrMaxTiles = 65535;                // W tiles and K splits: grid dimensions y and z
constexpr int kMrXTileRows = 32;                      // x rows per CTA: four mma n-tiles of 8
constexpr int kMrThreads = kMrWarpsN * 32;
constexpr int kMrNTiles = kMrXTileRows / 8;
constexpr int kMrPackedBytes = kMrTileRows * kMrStepBytes;  // a stage: W's packed bytes, then x
constexpr int kMrXBytes = kMrXTileRows * kMrRowBytes;
constexpr int kMrStageBytes = kMrPackedBytes + kMrXBytes;
static_assert(kMrPackedBytes % (16 * kMrThreads) == 0 && kMrXBytes % (16 * kMrThreads) == 0, "whole 16-byte copies");

// Each packed byte is decoded by one shared-memory load from a table of its two code values as an mma operand
// word (the even element, the byte's high nibble, in the low half). Entry e holds 32 copies of its word, one per
// lane, 256 bytes apart, so that the lanes of a warp never meet in a bank, and a lane's offset in the table is one
// byte permute: the byte in bits 8-15, 4 x lane in 0-7 (as the tensor-core kernel's table, csrc/gemv.cu).
constexpr int kMrTableBytes = 256 * 256;

// The code pair table, the stages, then (nested) the 256-entry code map: 97 KB, two CTAs per SM on an H100.
constexpr int kMrSharedBytes = kMrTableBytes + kMrStages * kMrStageBytes + 256 * 4;

// Byte offset of 16-byte chunk `chunk` (0..7) of 128-byte row `row` in the swizzled x tile.
__device__ __forceinline__ uint32_t swizzled(int row, int chunk) {
  return static_cast<uint32_t>(row * kMrRowBytes + ((chunk ^ (row & 7)) << 4));
}

template <typename T>
__device__ __forceinline__ uint16_t bits16(float v) {
  const T h = from_float<T>(v);
  return *reinterpret_cast<const uint16_t*>(&h);
}

template <typename T>
__device__ __forceinline__ uint32_t code_pair(float first, float second) {
  return uint32_t(bits16<T>(first)) | uint32_t(bits16<T>(second)) << 16;
}

// What a lane loads ahead for one of its rows' scale of a step: the fp32 absmax, or (nested) the uint8 code and the
// nested absmax value it is relative to.
struct RawScale {
  float value;
  uint32_t code;
};

template <typename T, bool kNested>
__global__ void __launch_bounds__(kMrThreads, 2)
    many_rows_gemv_kernel(const T* __restrict__ x, const uint8_t* __restrict__ packed, BlockScales scales,
                          QuantType quant_type, int blocksize_log2, int64_t rows, int64_t cols, int x_rows,
                          int steps_per_split, const T* __restrict__ bias, T* __restrict__ out,
                          float* __restrict__ partial) {
  constexpr int kThreads = kMrThreads, kNTiles = kMrNTiles;
  extern __shared__ __align__(128) uint8_t mr_shared[];
  uint8_t* const stage_bytes = mr_shared + kMrTableBytes;
  const uint32_t stages = static_cast<uint32_t>(__cvta_generic_to_shared(stage_bytes));
  float* code2 = reinterpret_cast<float*>(stage_bytes + kMrStages * kMrStageBytes);

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int g = lane / 4, t = lane % 4;
  const int m0 = blockIdx.x * kMrXTileRows;
  const int64_t n0 = int64_t{blockIdx.y} * kMrTileRows;
  const int total_steps = static_cast<int>(cols / kMrStep);
  const int first_step = blockIdx.z * steps_per_split;
  const int count = min(steps_per_split, total_steps - first_step);  // >= 1 (the host's split rule)
  const int64_t row_bytes = cols / 2;

  {
    const CodeTable codes = code_table(quant_type);
    for (int chunk = tid; chunk < kMrTableBytes / 16; chunk += kThreads) {  // 16 chunks of 4 copies per entry
      const int byte = chunk / 16;
      const uint32_t pair = code_pair<T>(codes.value[byte >> 4], codes.value[byte & 0x0F]);
      reinterpret_cast<uint4*>(mr_shared)[chunk] = make_uint4(pair, pair, pair, pair);
    }
  }
  float nested_offset = 0.0f;
  if constexpr (kNested) {
    for (int i = tid; i < 256; i += kThreads) code2[i] = scales.code2[i];
    nested_offset = *scales.offset;
  }

  // Step j of this CTA (j < count) into stage j % kMrStages: 16-byte pieces of the tile's packed rows (rows past
  // W's end copy nothing: zeros) and of its x rows (zeros past x's). Every call commits a group, an empty one past
  // the end, so that the waits count the same.
  const auto issue = [&](int j) {
    if (j < count) {
      const int64_t k_byte = int64_t{first_step + j} * kMrStepBytes;
      const uint32_t stage = stages + (j % kMrStages) * kMrStageBytes;
#pragma unroll
      for (int i = 0; i < kMrPackedBytes / 16 / kThreads; ++i) {
        const int piece = tid + i * kThreads, tile_row = piece / 2;
        const bool there = n0 + tile_row < rows;
        const uint8_t* from = packed + (there ? (n0 + tile_row) * row_bytes + k_byte + (piece % 2) * 16 : 0);
        copy_async<16>(stage + piece * 16, from, there ? 16 : 0);
      }
#pragma unroll
      for (int i = 0; i < kMrXBytes / 16 / kThreads; ++i) {
        const int piece = tid + i * kThreads, x_row = piece / 8, chunk = piece % 8;
        const bool there = m0 + x_row < x_rows;
        const T* from = x + (there ? int64_t{m0 + x_row} * cols + k_byte * 2 + chunk * 8 : 0);
        copy_async<16>(stage + kMrPackedBytes + swizzled(x_row, chunk), from, there ? 16 : 0);
      }
    }
    copy_async_commit();
  };

  // The lane's W rows: of m-tile mt, tile rows 16 mt + g (its A fragment's rows 0-7) and 16 mt + g + 8 (8-15).
  const auto lane_row = [&](int mt, int h) { return warp * kMrWarpRows + 16 * mt + g + 8 * h; };
  const auto load_scale = [&](int j, int mt, int h) -> RawScale {
    RawScale raw = {0.0f, 0};
    const int64_t n = n0 + lane_row(mt, h);
    if (j < count && n < rows) {
      const int64_t block = (n * cols + int64_t{first_step + j} * kMrStep) >> blocksize_log2;
      if constexpr (kNested) {
        raw.code = __ldg(scales.codes + block);
        raw.value = __ldg(scales.absmax2 + (block >> scales.nested_blocksize_log2));
      } else {
        raw.value = __ldg(scales.absmax + block);
      }
    }
    return raw;
  };
  const auto scale_of = [&](const RawScale& raw) -> float {
    if constexpr (kNested) {
      return BlockScales::nested_absmax_value(code2[raw.code], raw.value, nested_offset);
    } else {
      return raw.value;
    }
  };

  // Operand words of k-tile kk for lane (g, t): A[row][2t, 2t + 1] and A[row][2t + 8, 2t + 9] of k-tile kk are
  // packed bytes 8 kk + t and 8 kk + t + 4 of the row's step: byte t of words 2 kk and 2 kk + 1. The permute puts
  // byte t of a word in bits 8-15 and 4 x lane (byte 0 of lane4, whose byte 1 is 0) in bits 0-7.
  const uint32_t lane4 = 4 * lane;
  const uint32_t table_offset = 0x5504u | uint32_t(t) << 4;
  const auto lookup = [&](uint32_t word) -> uint32_t {
    return *reinterpret_cast<const uint32_t*>(mr_shared + __byte_perm(word, lane4, table_offset));
  };
  const int b_row = (lane / 16) * 8 + lane % 8;  // ldmatrix: + 16 p
  const int b_chunk = lane / 8 % 2;                                       // + 2 kk
  float acc[2][kNTiles][4] = {};
  const auto multiply = [&](int j, const RawScale (&raw)[2][2]) {
    const uint8_t* stage = stage_bytes + (j % kMrStages) * kMrStageBytes;
    const uint32_t x_tile = stages + (j % kMrStages) * kMrStageBytes + kMrPackedBytes;
    uint32_t a[4][2][4];  // [k-tile][m-tile][A register]
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint4* row = reinterpret_cast<const uint4*>(stage + lane_row(mt, h) * kMrStepBytes);
        const uint4 w0 = row[0], w1 = row[1];
        a[0][mt][h] = lookup(w0.x), a[0][mt][2 + h] = lookup(w0.y);
        a[1][mt][h] = lookup(w0.z), a[1][mt][2 + h] = lookup(w0.w);
        a[2][mt][h] = lookup(w1.x), a[2][mt][2 + h] = lookup(w1.y);
        a[3][mt][h] = lookup(w1.z), a[3][mt][2 + h] = lookup(w1.w);
      }
    }
    float sums[2][kNTiles][4] = {};
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
      for (int p = 0; p < kNTiles / 2; ++p) {
        uint32_t b[4];
        load_matrix_x4(x_tile + swizzled(b_row + 16 * p, b_chunk + 2 * kk), b);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          mma_16816<T>(sums[mt][2 * p], a[kk][mt], b[0], b[1], sums[mt][2 * p]);
          mma_16816<T>(sums[mt][2 * p + 1], a[kk][mt], b[2], b[3], sums[mt][2 * p + 1]);
        }
      }
    }
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      const float upper = scale_of(raw[mt][0]), lower = scale_of(raw[mt][1]);  // rows g, g + 8
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
        acc[mt][nt][0] = fmaf(upper, sums[mt][nt][0], acc[mt][nt][0]);
        acc[mt][nt][1] = fmaf(upper, sums[mt][nt][1], acc[mt][nt][1]);
        acc[mt][nt][2] = fmaf(lower, sums[mt][nt][2], acc[mt][nt][2]);
        acc[mt][nt][3] = fmaf(lower, sums[mt][nt][3], acc[mt][nt][3]);
      }
    }
  };

  // Pipeline: before turn i, steps up to i + kMrStages - 2 are issued; turn i waits for step i's copies, and after
  // the barrier (every warp is past step i - 1, and step i's copies by every thread are visible) issues step
  // i + kMrStages - 1 into the stage step i - 1 used, then decodes and multiplies step i. Scales are loaded two
  // steps ahead.
#pragma unroll
  for (int j = 0; j < kMrStages - 1; ++j) issue(j);
  RawScale ahead[2][2][2];  // [steps i, i + 1][m-tile][row g, g + 8]
#pragma unroll
  for (int d = 0; d < 2; ++d) {
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) ahead[d][mt][0] = load_scale(d, mt, 0), ahead[d][mt][1] = load_scale(d, mt, 1);
  }
  for (int i = 0; i < count; ++i) {
    copy_async_wait<kMrStages - 2>();
    __syncthreads();
    issue(i + kMrStages - 1);
    const RawScale now[2][2] = {{ahead[0][0][0], ahead[0][0][1]}, {ahead[0][1][0], ahead[0][1][1]}};
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      ahead[0][mt][0] = ahead[1][mt][0], ahead[0][mt][1] = ahead[1][mt][1];
      ahead[1][mt][0] = load_scale(i + 2, mt, 0), ahead[1][mt][1] = load_scale(i + 2, mt, 1);
    }
    multiply(i, now);
  }

  // Lane (g, t) holds, per m-tile and n-tile, W rows g and g + 8 by x rows 2t and 2t + 1.
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t n = n0 + lane_row(mt, h);
      if (n >= rows) continue;
      const float bias_n = bias != nullptr && partial == nullptr ? to_float(bias[n]) : 0.0f;
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int m = m0 + 8 * nt + 2 * t + c;
          if (m >= x_rows) continue;
          const float v = acc[mt][nt][2 * h + c];
          if (partial != nullptr) {
            partial[(int64_t{blockIdx.z} * x_rows + m) * rows + n] = v;
          } else {
            out[int64_t{m} * rows + n] = from_float<T>(v + bias_n);
          }
        }
      }
    }
  }
}

// out[m, n] = sum over splits (in split order) of partial[split, m, n], plus bias[n].
template <typename T>
__global__ void add_split_parts_kernel(const float* __restrict__ partial, int splits, int64_t outputs, int64_t rows,
                                       const T* __restrict__ bias, T* __restrict__ out) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < outputs; i += int64_t{gridDim.x} * blockDim.x) {
    float sum = partial[i];
    for (int z = 1; z < splits; ++z) sum += partial[int64_t{z} * outputs + i];
    if (bias != nullptr) sum += to_float(bias[i % rows]);
    out[i] = from_float<T>(sum);
  }
}

template <typename T, bool kNested>
void launch(const T* x, const uint8_t* packed, const BlockScales& scales, const WeightSpec& spec, int64_t rows,
            int64_t cols, int64_t x_rows, const T* bias, T* out, const at::Tensor& like, cudaStream_t stream) {
  const auto kernel = many_rows_gemv_kernel<T, kNested>;
  static std::atomic<int64_t> resident_cache[64] = {};  // one cache per instance
  const int64_t per_sm = prepare_kernel(resident_cache, kernel, kMrThreads, kMrSharedBytes);
  const int64_t resident = per_sm * at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t m_tiles = (x_rows + kMrXTileRows - 1) / kMrXTileRows;
  const int64_t n_tiles = (rows + kMrTileRows - 1) / kMrTileRows;
  const int64_t total_steps = cols / kMrStep;
  // Splits of K where the tiles leave at least half the resident CTAs idle, each of kMrMinStepsPerSplit steps or
  // more; the split count is then recomputed so that none is empty.
  int64_t splits = 1;
  if (m_tiles * n_tiles * 2 <= resident) {
    splits = std::max<int64_t>(1, std::min(resident / (m_tiles * n_tiles), total_steps / kMrMinStepsPerSplit));
  }
  const int64_t steps_per_split = (total_steps + splits - 1) / splits;
  splits = (total_steps + steps_per_split - 1) / steps_per_split;
  TORCH_INTERNAL_ASSERT(m_tiles <= INT32_MAX && n_tiles <= kMrMaxTiles && splits <= kMrMaxTiles && x_rows <= INT32_MAX);
  at::Tensor partial;
  float* partial_data = nullptr;
  if (splits > 1) {
    partial = at::empty({splits, x_rows, rows}, like.options().dtype(at::kFloat));
    partial_data = partial.mutable_data_ptr<float>();
  }
  const dim3 grid(static_cast<unsigned>(m_tiles), static_cast<unsigned>(n_tiles), static_cast<unsigned>(splits));
  kernel<<<grid, kMrThreads, kMrSharedBytes, stream>>>(x, packed, scales, spec.quant_type, spec.blocksize_log2,
                                                            rows, cols, static_cast<int>(x_rows),
                                                            static_cast<int>(steps_per_split), bias, out,
                                                            partial_data);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (splits > 1) {
    const int64_t outputs = x_rows * rows;
    const int threads = 256;
    const int blocks = static_cast<int>(std::min<int64_t>((outputs + threads - 1) / threads, resident * 8));
    add_split_parts_kernel<T><<<blocks, threads, 0, stream>>>(partial_data, static_cast<int>(splits), outputs, rows,
                                                              bias, out);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace

bool many_rows_gemv_fits(int64_t rows) {
  return at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin >= size_t{kMrSharedBytes} &&
         (rows + kMrTileRows - 1) / kMrTileRows <= kMrMaxTiles;
}

void launch_many_rows_gemv(const at::Tensor& x_2d, const uint8_t* packed, const BlockScales& scales,
                           const WeightSpec& spec, const at::Tensor& bias, at::Tensor& out) {
  const int64_t rows = spec.rows.expect_int(), cols = spec.cols.expect_int(), x_rows = x_2d.size(0);
  TORCH_INTERNAL_ASSERT(cols % kMrStep == 0 && (int64_t{1} << spec.blocksize_log2) >= kMrStep && x_rows > 0);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const auto run = [&](auto* type_tag) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    const T* x = static_cast<const T*>(x_2d.const_data_ptr());
    const T* bias_data = bias.defined() ? static_cast<const T*>(bias.const_data_ptr()) : nullptr;
    T* out_data = static_cast<T*>(out.mutable_data_ptr());
    const auto with_tile = [&](auto nested) {
      launch<T, decltype(nested)::value>(x, packed, scales, spec, rows, cols, x_rows, bias_data, out_data, out, stream);
    };
    scales.nested() ? with_tile(std::true_type{}) : with_tile(std::false_type{});
  };
  if (x_2d.scalar_type() == at::kHalf) {
    run(static_cast<__half*>(nullptr));
  } else {
    TORCH_INTERNAL_ASSERT(x_2d.scalar_type() == at::kBFloat16);
    run(static_cast<__nv_bfloat16*>(nullptr));
  }
}

}  // namespace nf4
