// nf4::dequantize on CUDA. The output goes out in 16-byte stores: 8 elements (one 4-byte packed word) for
// fp16/bf16, 4 elements (a 2-byte word) for fp32. Each warp takes one item of kWordsPerLane * 32 words in
// one vector load per lane, then lane l writes the item's 16-byte units l, 32 + l, ..., taking each
// unit's word from the lane that loaded it by shuffle, so every warp store is 512 contiguous bytes. One
// item per warp and no grid-stride loop: on an H100 this was measured against the earlier shape (4-byte
// loads, 4 items per thread, a grid capped at 32 CTAs per SM): 93-96% of the copy ceiling instead of
// 88-90% on 300-600 MB layers (benchmarks/NOTES.md, dequantize row 5).
// Blocksizes are powers of two >= 32, so a unit never straddles an absmax block and takes one scale;
// the nested absmax is computed in the same launch. Elements past the last whole item, and every element
// when `packed` or `out` is not aligned for the vector path, take a scalar path.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <type_traits>

#include "cuda_types.cuh"
#include "launch_cache.h"
#include "ops.h"

namespace nf4 {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;
constexpr int kWordsPerLane = 4;  // 16-byte packed loads for fp16/bf16 output, 8-byte for fp32

template <typename T>
struct Unit {
  static constexpr int kElements = sizeof(uint4) / sizeof(T);  // one 16-byte store
  using PackedWord = std::conditional_t<kElements == 8, uint32_t, uint16_t>;
  static_assert(sizeof(PackedWord) * 2 == kElements, "two elements per packed byte");
  static constexpr int kItemWords = 32 * kWordsPerLane;  // one warp's item
  static constexpr int kItemBytes = kItemWords * int(sizeof(PackedWord));
  static constexpr int kLaneBytes = kWordsPerLane * int(sizeof(PackedWord));  // the vector load's alignment
};

// The lane's kWordsPerLane consecutive packed words, in one vector load.
template <typename Word>
__device__ __forceinline__ void load_lane_words(const uint8_t* lane_bytes, Word (&words)[kWordsPerLane]) {
  if constexpr (sizeof(Word) == 4) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(lane_bytes));
    words[0] = v.x, words[1] = v.y, words[2] = v.z, words[3] = v.w;
  } else {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(lane_bytes));
    words[0] = Word(v.x), words[1] = Word(v.x >> 16), words[2] = Word(v.y), words[3] = Word(v.y >> 16);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const uint8_t* __restrict__ packed, BlockScales scales, QuantType quant_type,
                      int blocksize_log2, int64_t numel, int64_t items, bool prefetch_scales, T* __restrict__ out) {
  using U = Unit<T>;
  using Word = typename U::PackedWord;
  let_next_kernel_start();
  const int lane = threadIdx.x % 32;
  const int64_t item = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
#if NF4_PREFETCH_BEFORE_WAIT
  // the item's packed bytes, one lane per 128-byte line, asked of L2 while the previous kernel finishes
  if (item < items && lane * U::kLaneBytes % 128 == 0) prefetch_l2(packed + item * U::kItemBytes + lane * U::kLaneBytes);
  // and, where the grid runs in several waves, the line of the item's first scale entry, by the first item whose
  // first entry lies in that line only (each line is asked for once per grid)
  if (prefetch_scales && item < items && lane == 1) {
    const int64_t item_elements = int64_t(U::kItemWords) * U::kElements;
    const auto entry = reinterpret_cast<uintptr_t>(block_scale_entry(scales, (item * item_elements) >> blocksize_log2));
    const auto previous = item == 0 ? entry - 128
                                    : reinterpret_cast<uintptr_t>(
                                          block_scale_entry(scales, ((item - 1) * item_elements) >> blocksize_log2));
    if (entry / 128 != previous / 128) prefetch_l2(reinterpret_cast<const void*>(entry));
  }
#endif
  __shared__ float table[16];
  if (threadIdx.x < 16) table[threadIdx.x] = code_table(quant_type).value[threadIdx.x];
  __syncthreads();
  wait_for_previous_kernels();

  if (item < items) {
    Word words[kWordsPerLane];
    load_lane_words(packed + item * U::kItemBytes + lane * U::kLaneBytes, words);
    const int64_t first_unit = item * U::kItemWords;
    float unit_scales[kWordsPerLane];
#pragma unroll
    for (int j = 0; j < kWordsPerLane; ++j) {  // independent of the words: requested before they arrive
      unit_scales[j] = scales.at(((first_unit + 32 * j + lane) * U::kElements) >> blocksize_log2);
    }
#pragma unroll
    for (int j = 0; j < kWordsPerLane; ++j) {
      // Unit 32j + l is word (32j + l) % kWordsPerLane == l % kWordsPerLane of lane (32j + l) / kWordsPerLane.
      const int source_lane = (32 * j + lane) / kWordsPerLane;
      Word word = 0;
#pragma unroll
      for (int w = 0; w < kWordsPerLane; ++w) {
        const Word shuffled = Word(__shfl_sync(0xFFFFFFFFu, uint32_t(words[w]), source_lane));
        word = w == lane % kWordsPerLane ? shuffled : word;
      }
      alignas(16) T values[U::kElements];
#pragma unroll
      for (int byte = 0; byte < U::kElements / 2; ++byte) {
        const uint32_t b = (uint32_t(word) >> (8 * byte)) & 0xFF;  // little-endian: byte 0 first
        values[2 * byte] = from_float<T>(__fmul_rn(table[b >> 4], unit_scales[j]));  // even = high nibble
        values[2 * byte + 1] = from_float<T>(__fmul_rn(table[b & 0x0F], unit_scales[j]));
      }
      reinterpret_cast<uint4*>(out)[first_unit + 32 * j + lane] = *reinterpret_cast<const uint4*>(values);
    }
  }
  const int64_t threads = int64_t(gridDim.x) * blockDim.x;
  for (int64_t e = items * U::kItemWords * U::kElements + int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
       e < numel; e += threads) {
    out[e] = from_float<T>(mul_rn(table[nibble_at(packed, e)], scales.at(e >> blocksize_log2)));
  }
}

// How many CTAs of dequantize_kernel<T> are resident at once on the current device.
template <typename T>
int64_t resident_ctas() {
  static std::atomic<int64_t> cache[64] = {};
  return once_per_device(cache, [](int device) -> int64_t {
    int per_sm = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, dequantize_kernel<T>, kThreads, 0));
    return int64_t{std::max(per_sm, 1)} * at::cuda::getDeviceProperties(device)->multiProcessorCount;
  });
}

void launch_dequantize(const WeightSpec& spec, const WeightData& weight, at::Tensor& out) {
  const int64_t numel = spec.rows.expect_int() * spec.cols.expect_int();
  const uint8_t* bytes = weight.bytes;
  NF4_DISPATCH_FLOAT_TYPES(out.scalar_type(), "nf4::dequantize", [&] {
    using T = typename CudaScalar<scalar_t>::type;
    using U = Unit<T>;
    T* out_data = reinterpret_cast<T*>(out.mutable_data_ptr<scalar_t>());
    const bool vectorize = reinterpret_cast<uintptr_t>(bytes) % U::kLaneBytes == 0 && is_aligned_16(out_data);
    const int64_t items = vectorize ? numel / (int64_t(U::kItemWords) * U::kElements) : 0;
    const int64_t scalar_elements = numel - items * U::kItemWords * U::kElements;
    const int64_t blocks = std::max<int64_t>({(items + kWarpsPerBlock - 1) / kWarpsPerBlock,
                                              (scalar_elements + kThreads - 1) / kThreads, 1});
    // the message is built from strings alone: streaming a number (a SymInt above all) into it segfaulted on the GPU
    // machine's toolchain (checks.cpp, text())
    TORCH_CHECK(blocks <= std::numeric_limits<int>::max(), "nf4::dequantize: shape " +
                std::to_string(spec.rows.expect_int()) + " x " + std::to_string(spec.cols.expect_int()) + " needs " +
                std::to_string(blocks) + " CUDA blocks, more than a launch allows");
    launch_kernel(dequantize_kernel<T>, dim3(static_cast<unsigned>(blocks)), kThreads, 0,
                  at::cuda::getCurrentCUDAStream(), 1, bytes, weight.scales, spec.quant_type, spec.blocksize_log2, numel,
                  items, blocks > resident_ctas<T>(), out_data);
  });
}

}  // namespace

at::Tensor dequantize_cuda(NF4_DEQUANTIZE_PARAMS) {
  const WeightSpec spec = check_dequantize_args(packed, absmax, blocksize, quant_type, shape, dtype, nested_absmax,
                                                nested_code, nested_offset, nested_blocksize);
  const c10::cuda::CUDAGuard device_guard(packed.device());
  const WeightData weight = weight_data("nf4::dequantize", spec, packed, absmax, nested_absmax, nested_code,
                                        nested_offset);
  at::Tensor out = at::empty({spec.rows.expect_int(), spec.cols.expect_int()}, packed.options().dtype(dtype));
  launch_dequantize(spec, weight, out);
  return out;
}

void dequantize_out_cuda(NF4_DEQUANTIZE_PARAMS, at::Tensor& out) {
  const WeightSpec spec = check_dequantize_out_args(packed, absmax, blocksize, quant_type, shape, dtype,
                                                    nested_absmax, nested_code, nested_offset, nested_blocksize, out);
  const c10::cuda::CUDAGuard device_guard(packed.device());
  const WeightData weight = weight_data("nf4::dequantize.out", spec, packed, absmax, nested_absmax, nested_code,
                                        nested_offset);
  check_storage_holds("nf4::dequantize.out", "out", out);
  launch_dequantize(spec, weight, out);
}

TORCH_LIBRARY_IMPL(nf4, CUDA, m) {
  m.impl("dequantize", &dequantize_cuda);
  m.impl("dequantize.out", &dequantize_out_cuda);
}

}  // namespace nf4
