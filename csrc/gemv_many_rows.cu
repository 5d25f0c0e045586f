// nf4::gemv on CUDA for more rows of fp16 / bf16 x than the tensor-core kernel takes in one launch
// (kTensorCoreGemvLaunchRows): the many-rows kernel, a matrix product that decodes each weight once per CTA.
//
// Why a kernel of its own: the tensor-core kernel (csrc/gemv.cu) decodes W in registers for at most 16 rows of x,
// so more rows took one launch per 16 rows, each decoding and reading all of W again, and past the limits of
// kTensorCoreGemvRowLimits W was dequantized to a 16-bit temporary for cuBLAS (written and read again: on Llama's
// gate/up 4x the packed bytes). Here a CTA decodes its 256 W rows of each 64-element step once, into shared memory,
// in dequantize's own rounding (fp32 code x absmax, rounded once to x's dtype: so the result is x @ W.T for the
// very W that nf4::dequantize gives, as on the dequantize + cuBLAS path), and its 8 warps multiply that tile with
// up to kXTileRows rows of x (staged in shared memory too) on mma.sync, fp32 accumulators.
//
// Layout. CTA (m tile, n tile, K split): W rows [256 n, 256 n + 256), x rows [kXTileRows m, ...), the K steps of
// split z. Warp w owns W rows 32w .. 32w + 31 of the tile (two mma m-tiles) and every x row of the tile (n-tiles
// of 8). Each step: thread t copies W row t's 32 packed bytes and its share of the x tile into a ring of kMrStages
// stages with cp.async (three steps in flight), decodes row t of the next step into one of two decoded tiles, and
// the warps multiply the other one. Decoded and x tiles are 128-byte rows stored with a 16-byte XOR swizzle, so
// that ldmatrix reads them without bank conflicts. The m tiles are blockIdx.x, so the CTAs that read the same W
// rows run side by side and all but the first find them in L2. Layers with fewer tiles than SMs split K
// (kMrMinStepsPerSplit steps at least), each split writing fp32 partial sums that a second kernel adds in split
// order, so every run gives the same bits.
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

// 8 warps: 4 along W's rows (32 each: two mma m-tiles of 16) by 2 along x's (half the x tile each).
constexpr int kMrWarpsN = 4;
constexpr int kMrWarpsM = 2;
constexpr int kMrThreads = kMrWarpsN * kMrWarpsM * 32;
constexpr int kMrWarpRows = 32;
constexpr int kMrTileRows = kMrWarpsN * kMrWarpRows;  // W rows per CTA: two threads per row copy and decode it
constexpr int kMrThreadsPerRow = kMrThreads / kMrTileRows;
constexpr int kMrStep = 64;                           // K elements per step: 4 mma k-tiles, one absmax block
constexpr int kMrStepBytes = kMrStep / 2;             // packed bytes of a row's step
constexpr int kMrRowBytes = kMrStep * 2;              // a row's step of 16-bit values: 8 chunks of 16 bytes
constexpr int kMrStages = 4;                          // cp.async ring: the next step decoded, two more in flight
constexpr int kMrMinStepsPerSplit = 8;
// The decode looks each packed byte up in a table of its two code values as an operand pair; lane l reads copy
// l % kMrPairCopies, the copies interleaved word by word, so that lanes of different copies never meet in a bank.
constexpr int kMrPairCopies = 4;

template <int kXTileRows>
struct MrShape {
  static_assert(kXTileRows % (16 * kMrWarpsM) == 0, "each warp's x rows come in ldmatrix pairs of n-tiles");
  static constexpr int kNTiles = kXTileRows / kMrWarpsM / 8;  // per warp
  static constexpr int kPackedBytes = kMrTileRows * kMrStepBytes;  // a stage: W's packed bytes, then x
  static constexpr int kXBytes = kXTileRows * kMrRowBytes;
  static constexpr int kStageBytes = kPackedBytes + kXBytes;
  static constexpr int kDecodedBytes = kMrTileRows * kMrRowBytes;
  static constexpr int kScalesBytes = 2 * kMrTileRows * 4;  // the rows' scales of the two decoded steps
  // the code pair table (kMrPairCopies interleaved copies), then (nested) the 256-entry code map
  static constexpr int kTableBytes = (256 * kMrPairCopies + 256) * 4;
  static constexpr int kSharedBytes = kMrStages * kStageBytes + 2 * kDecodedBytes + kScalesBytes + kTableBytes;
};

// Byte offset of 16-byte chunk `chunk` (0..7) of 128-byte row `row` in a swizzled tile.
__device__ __forceinline__ uint32_t swizzled(int row, int chunk) {
  return static_cast<uint32_t>(row * kMrRowBytes + ((chunk ^ (row & 7)) << 4));
}

// Two 16-bit values of type T in one word, `first` in the low half (the lower address).
template <typename T>
__device__ __forceinline__ uint32_t pack_pair(float first, float second) {
  const T a = from_float<T>(first), b = from_float<T>(second);
  return uint32_t(*reinterpret_cast<const uint16_t*>(&a)) | uint32_t(*reinterpret_cast<const uint16_t*>(&b)) << 16;
}

// What a thread loads ahead for its row's scale of a step: the fp32 absmax, or (nested) the uint8 code and the
// nested absmax value it is relative to.
struct RawScale {
  float value;
  uint32_t code;
};

template <typename T, int kXTileRows, bool kNested>
__global__ void __launch_bounds__(kMrThreads, 2)
    many_rows_gemv_kernel(const T* __restrict__ x, const uint8_t* __restrict__ packed, BlockScales scales,
                          QuantType quant_type, int blocksize_log2, int64_t rows, int64_t cols, int x_rows,
                          int steps_per_split, const T* __restrict__ bias, T* __restrict__ out,
                          float* __restrict__ partial) {
  using Shape = MrShape<kXTileRows>;
  constexpr int kNTiles = Shape::kNTiles;
  extern __shared__ __align__(128) uint8_t mr_shared[];
  const uint32_t shared_base = static_cast<uint32_t>(__cvta_generic_to_shared(mr_shared));
  const uint32_t stages = shared_base;
  const uint32_t decoded = shared_base + kMrStages * Shape::kStageBytes;
  float* row_scales = reinterpret_cast<float*>(mr_shared + kMrStages * Shape::kStageBytes + 2 * Shape::kDecodedBytes);
  uint32_t* pairs = reinterpret_cast<uint32_t*>(row_scales + 2 * kMrTileRows);
  float* code2 = reinterpret_cast<float*>(pairs + 256 * kMrPairCopies);

  const int tid = threadIdx.x, lane = tid % 32, warp_n = tid / 32 % kMrWarpsN, warp_m = tid / 32 / kMrWarpsN;
  const int m0 = blockIdx.x * kXTileRows;
  const int64_t n0 = int64_t{blockIdx.y} * kMrTileRows;
  const int total_steps = static_cast<int>(cols / kMrStep);
  const int first_step = blockIdx.z * steps_per_split;
  const int count = min(steps_per_split, total_steps - first_step);  // >= 1 (the host's split rule)

  {
    const CodeTable codes = code_table(quant_type);
    for (int i = tid; i < 256 * kMrPairCopies; i += kMrThreads) {  // entry i / copies: the even element is the high nibble
      const int byte = i / kMrPairCopies;
      pairs[i] = pack_pair<T>(codes.value[byte >> 4], codes.value[byte & 0x0F]);
    }
  }
  float nested_offset = 0.0f;
  if constexpr (kNested) {
    for (int i = tid; i < 256; i += kMrThreads) code2[i] = scales.code2[i];
    nested_offset = *scales.offset;
  }

  // This thread's W row in the copies, the decode and the scales, and its part of the row's step (16 packed bytes);
  // rows past W's end copy nothing (zeros) and take scale 0, and their outputs are dropped.
  const int tile_row = tid / kMrThreadsPerRow, row_part = tid % kMrThreadsPerRow;
  static_assert(kMrThreadsPerRow * 16 == kMrStepBytes, "a 16-byte copy and decode per thread");
  const int64_t my_row = n0 + tile_row;
  const bool row_there = my_row < rows;
  const uint8_t* row_bytes = packed + (row_there ? my_row : 0) * (cols / 2);
  const int64_t row_first_block = (row_there ? my_row : 0) * (cols >> blocksize_log2);

  // Step j of this CTA (j < count) into stage j % kMrStages: the thread's part of its W row's packed bytes and its
  // chunks of the x tile. Every call commits a group, an empty one past the end, so that the waits count the same.
  const auto issue = [&](int j) {
    if (j < count) {
      const int step = first_step + j;
      const uint32_t stage = stages + (j % kMrStages) * Shape::kStageBytes;
      copy_async<16>(stage + tid * 16, row_bytes + int64_t{step} * kMrStepBytes + row_part * 16, row_there ? 16 : 0);
      static_assert(kXTileRows * 8 % kMrThreads == 0, "whole x chunks per thread");
#pragma unroll
      for (int i = 0; i < kXTileRows * 8 / kMrThreads; ++i) {
        const int c = tid + i * kMrThreads, x_row = c / 8, chunk = c % 8;
        const bool x_there = m0 + x_row < x_rows;
        const T* x_from = x + (x_there ? int64_t{m0 + x_row} * cols + int64_t{step} * kMrStep + chunk * 8 : 0);
        copy_async<16>(stage + Shape::kPackedBytes + swizzled(x_row, chunk), x_from, x_there ? 16 : 0);
      }
    }
    copy_async_commit();
  };
  const auto load_scale = [&](int j) -> RawScale {
    RawScale raw = {0.0f, 0};
    if (j < count && row_there) {
      const int64_t block = row_first_block + ((int64_t{first_step + j} * kMrStep) >> blocksize_log2);
      if constexpr (kNested) {
        raw.code = __ldg(scales.codes + block);
        raw.value = __ldg(scales.absmax2 + (block >> scales.nested_blocksize_log2));
      } else {
        raw.value = __ldg(scales.absmax + block);
      }
    }
    return raw;
  };
  // Row tid of step j (staged) into decoded tile j % 2 as code values (each packed byte one table lookup), and its
  // scale into the step's scale slots: the products of a step are scaled in fp32 after the mma, as in the
  // tensor-core kernel (csrc/gemv.cu).
  const uint32_t* pairs_lane = pairs + tid % kMrPairCopies;
  const auto decode = [&](int j, RawScale raw) {
    float scale = raw.value;
    if constexpr (kNested) {
      scale = row_there ? BlockScales::nested_absmax_value(code2[raw.code], raw.value, nested_offset) : 0.0f;
    }
    const uint4 part = *reinterpret_cast<const uint4*>(mr_shared + (j % kMrStages) * Shape::kStageBytes + tid * 16);
    uint8_t* row_out = mr_shared + kMrStages * Shape::kStageBytes + (j % 2) * Shape::kDecodedBytes;
#pragma unroll
    for (int c = 0; c < 4; ++c) {  // chunk 4 row_part + c of the row: 8 elements, 4 packed bytes, one word
      const uint32_t word = c == 0 ? part.x : c == 1 ? part.y : c == 2 ? part.z : part.w;
      uint32_t out_words[4];
#pragma unroll
      for (int byte = 0; byte < 4; ++byte) {
        out_words[byte] = pairs_lane[((word >> (8 * byte)) & 0xFF) * kMrPairCopies];
      }
      *reinterpret_cast<uint4*>(row_out + swizzled(tile_row, 4 * row_part + c)) =
          make_uint4(out_words[0], out_words[1], out_words[2], out_words[3]);
    }
    if (row_part == 0) row_scales[(j % 2) * kMrTileRows + tile_row] = scale;
  };

  float acc[2][kNTiles][4] = {};
  // The lane's ldmatrix rows: A (W) from matrix q = lane / 8 of an m-tile, rows 0-7 / 8-15 by q % 2 and k chunks
  // by q / 2; B (x) pairs of n-tiles, the n-tile by q / 2 and the k chunk by q % 2.
  const int q = lane / 8;
  const int a_row = warp_n * kMrWarpRows + (q % 2) * 8 + lane % 8;        // + 16 mt
  const int a_chunk = q / 2;                                              // + 2 kk
  const int b_row = warp_m * (kXTileRows / kMrWarpsM) + (q / 2) * 8 + lane % 8;  // + 16 p
  const int b_chunk = q % 2;                                       // + 2 kk
  const int g = lane / 4, t = lane % 4;
  const auto multiply = [&](int j) {
    float sums[2][kNTiles][4] = {};
    const uint32_t w_tile = decoded + (j % 2) * Shape::kDecodedBytes;
    const uint32_t x_tile = stages + (j % kMrStages) * Shape::kStageBytes + Shape::kPackedBytes;
#pragma unroll
    for (int kk = 0; kk < kMrStep / 16; ++kk) {
      uint32_t a[2][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) load_matrix_x4(w_tile + swizzled(a_row + 16 * mt, a_chunk + 2 * kk), a[mt]);
#pragma unroll
      for (int p = 0; p < kNTiles / 2; ++p) {
        uint32_t b[4];
        load_matrix_x4(x_tile + swizzled(b_row + 16 * p, b_chunk + 2 * kk), b);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          mma_16816<T>(sums[mt][2 * p], a[mt], b[0], b[1], sums[mt][2 * p]);
          mma_16816<T>(sums[mt][2 * p + 1], a[mt], b[2], b[3], sums[mt][2 * p + 1]);
        }
      }
    }
    // lane (g, t)'s rows of each m-tile: g (accumulators 0, 1) and g + 8 (2, 3)
    const float* step_scales = row_scales + (j % 2) * kMrTileRows + warp_n * kMrWarpRows + g;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      const float upper = step_scales[16 * mt], lower = step_scales[16 * mt + 8];
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
        acc[mt][nt][0] = fmaf(upper, sums[mt][nt][0], acc[mt][nt][0]);
        acc[mt][nt][1] = fmaf(upper, sums[mt][nt][1], acc[mt][nt][1]);
        acc[mt][nt][2] = fmaf(lower, sums[mt][nt][2], acc[mt][nt][2]);
        acc[mt][nt][3] = fmaf(lower, sums[mt][nt][3], acc[mt][nt][3]);
      }
    }
  };

  // Pipeline: before turn i, steps up to i + kMrStages - 2 are issued and step i is decoded; turn i waits for
  // step i + 1's copies, issues step i + kMrStages - 1 into the stage step i - 1 used, decodes step i + 1 into
  // the decoded tile step i - 1 used, and multiplies step i. The barrier at each turn's start separates those
  // reuses from step i - 1's reads by the other warps, and publishes step i + 1's x and step i's decoded tile.
#pragma unroll
  for (int j = 0; j < kMrStages - 1; ++j) issue(j);
  RawScale ahead[2] = {load_scale(1), load_scale(2)};  // steps i + 1 and i + 2
  copy_async_wait<kMrStages - 2>();
  __syncthreads();  // the tables
  decode(0, load_scale(0));
  for (int i = 0; i < count; ++i) {
    copy_async_wait<kMrStages - 3>();
    __syncthreads();
    issue(i + kMrStages - 1);
    if (i + 1 < count) decode(i + 1, ahead[0]);
    ahead[0] = ahead[1];
    ahead[1] = load_scale(i + 3);
    multiply(i);
  }

  // Lane (g, t) holds, per m-tile and n-tile, W rows g and g + 8 by x rows 2t and 2t + 1.
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t n = n0 + warp_n * kMrWarpRows + 16 * mt + g + 8 * half;
      if (n >= rows) continue;
      const float bias_n = bias != nullptr && partial == nullptr ? to_float(bias[n]) : 0.0f;
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int m = m0 + warp_m * (kXTileRows / kMrWarpsM) + 8 * nt + 2 * t + c;
          if (m >= x_rows) continue;
          const float v = acc[mt][nt][2 * half + c];
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

// x rows per CTA: 32 for up to 32 rows of x, else 64 (more rows take more m tiles).
constexpr int kMrSmallXTileRows = 32;
constexpr int kMrLargeXTileRows = 64;

template <typename T, int kXTileRows, bool kNested>
void launch(const T* x, const uint8_t* packed, const BlockScales& scales, const WeightSpec& spec, int64_t rows,
            int64_t cols, int64_t x_rows, const T* bias, T* out, const at::Tensor& like, cudaStream_t stream) {
  using Shape = MrShape<kXTileRows>;
  const auto kernel = many_rows_gemv_kernel<T, kXTileRows, kNested>;
  static std::atomic<int64_t> resident_cache[64] = {};  // one cache per instance
  const int64_t per_sm = prepare_kernel(resident_cache, kernel, kMrThreads, Shape::kSharedBytes);
  const int64_t resident = per_sm * at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t m_tiles = (x_rows + kXTileRows - 1) / kXTileRows;
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
  TORCH_CHECK(m_tiles <= INT32_MAX && n_tiles <= 65535 && splits <= 65535,
              "nf4::gemv: shape ", rows, " x ", cols, " with ", x_rows, " rows of x needs more CUDA blocks than a "
              "launch allows");
  at::Tensor partial;
  float* partial_data = nullptr;
  if (splits > 1) {
    partial = at::empty({splits, x_rows, rows}, like.options().dtype(at::kFloat));
    partial_data = partial.mutable_data_ptr<float>();
  }
  const dim3 grid(static_cast<unsigned>(m_tiles), static_cast<unsigned>(n_tiles), static_cast<unsigned>(splits));
  kernel<<<grid, kMrThreads, Shape::kSharedBytes, stream>>>(x, packed, scales, spec.quant_type, spec.blocksize_log2,
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

bool many_rows_gemv_fits() {
  return at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin >=
         size_t{MrShape<kMrLargeXTileRows>::kSharedBytes};
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
      constexpr bool kNested = decltype(nested)::value;
      if (x_rows <= kMrSmallXTileRows) {
        launch<T, kMrSmallXTileRows, kNested>(x, packed, scales, spec, rows, cols, x_rows, bias_data, out_data, out,
                                              stream);
      } else {
        launch<T, kMrLargeXTileRows, kNested>(x, packed, scales, spec, rows, cols, x_rows, bias_data, out_data, out,
                                              stream);
      }
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
