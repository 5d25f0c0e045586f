// nf4::dequantize on the CPU: the core's loop, parallel over rows of W; on x86-64 CPUs with AVX-512 (F, BW, VL)
// each block's 16 values are one vector multiply and conversion, and whole runs of 64 elements inside a block take
// table permutes instead of scalar lookups.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <type_traits>

#include "ops.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define NF4_CPU_AVX512 1
#endif

namespace nf4 {

namespace {

template <typename scalar_t, typename Blocks = ScalarBlocks>
void dequantize_rows(const uint8_t* bytes, const BlockScales& scales, const CodeTable& table, int blocksize_log2,
                     int64_t begin, int64_t end, scalar_t* out) {
  // c10::Half / c10::BFloat16 construct from float with round-to-nearest-even, as bitsandbytes does.
  dequantize_elements(bytes, scales, table, blocksize_log2, begin, end, out,
                      [](float v) { return static_cast<scalar_t>(v); }, Blocks{});
}

#ifdef NF4_CPU_AVX512
#define NF4_AVX512_TARGET __attribute__((target("avx2,avx512f,avx512bw,avx512vl")))

// dequantize_elements' block policy with AVX-512 (F, BW and VL), the same bits as ScalarBlocks:
//  - a block's 16 values: code * scale as one fp32 vector multiply (rounded once, as the scalar multiply), then
//    converted as c10 does: fp16 by the hardware conversion with round to nearest even (c10's too, subnormals
//    included) and c10's NaN, 0x7E00 with the sign; bf16 by c10's rounding, bits + 0x7FFF + (bit 16), and 0x7FC0
//    for NaN;
//  - 64 elements from 32 packed bytes (byte i: element 2i in its high nibble, 2i + 1 in its low one): the nibbles
//    in element order as indices, then one permute of the 16 values per 32 (16-bit) or 16 (fp32) outputs.
struct Avx512Blocks {
  static constexpr bool kRuns64 = true;

  template <typename OutT, typename Convert>
  NF4_AVX512_TARGET void values(const CodeTable& table, float scale, Convert, OutT (&value)[16]) const {
    const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(table.value), _mm512_set1_ps(scale));
    if constexpr (std::is_same_v<OutT, float>) {
      _mm512_storeu_ps(value, v);
    } else {
      const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      __m256i bits;
      if constexpr (std::is_same_v<OutT, c10::Half>) {
        bits = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        // NaN: c10 keeps only the sign (0x7E00 | sign), the hardware keeps payload bits too
        const __m256i sign = _mm256_and_si256(bits, _mm256_set1_epi16(static_cast<int16_t>(0x8000)));
        bits = _mm256_mask_mov_epi16(bits, nan, _mm256_or_si256(sign, _mm256_set1_epi16(0x7E00)));
      } else {
        static_assert(std::is_same_v<OutT, c10::BFloat16>, "fp32, fp16 or bf16 outputs");
        const __m512i u = _mm512_castps_si512(v);
        const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)),
                                              _mm512_set1_epi32(0x7FFF));
        const __m512i rounded = _mm512_mask_mov_epi32(_mm512_srli_epi32(_mm512_add_epi32(u, bias), 16), nan,
                                                      _mm512_set1_epi32(0x7FC0));
        bits = _mm512_cvtepi32_epi16(rounded);
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(value), bits);
    }
  }

  template <typename OutT>
  NF4_AVX512_TARGET void run64(const uint8_t* bytes, const OutT (&value)[16], OutT* out) const {
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m256i high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
    const __m256i low = _mm256_and_si256(packed, low4);
    // unpack works per 128-bit lane: a = bytes 0-7 | 16-23, b = bytes 8-15 | 24-31, each as (high, low) pairs
    const __m256i a = _mm256_unpacklo_epi8(high, low), b = _mm256_unpackhi_epi8(high, low);
    const __m256i first = _mm256_permute2x128_si256(a, b, 0x20);   // elements 0-31
    const __m256i second = _mm256_permute2x128_si256(a, b, 0x31);  // elements 32-63
    if constexpr (sizeof(OutT) == 2) {
      static_assert(std::is_trivially_copyable_v<OutT>, "16-bit outputs are stored as their bits");
      // indices 0-15 read only the low 16 of the 32 words
      const __m512i values = _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(value)));
      _mm512_storeu_si512(out, _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(first), values));
      _mm512_storeu_si512(out + 32, _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(second), values));
    } else {
      static_assert(std::is_same_v<OutT, float>, "fp32 outputs");
      const __m512 values = _mm512_loadu_ps(value);
      const __m128i quarters[4] = {_mm256_castsi256_si128(first), _mm256_extracti128_si256(first, 1),
                                   _mm256_castsi256_si128(second), _mm256_extracti128_si256(second, 1)};
      for (int q = 0; q < 4; ++q) {
        _mm512_storeu_ps(out + 16 * q, _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(quarters[q]), values));
      }
    }
  }
};

// The same loop compiled for AVX-512, so that the policy's functions inline into it.
template <typename scalar_t>
NF4_AVX512_TARGET void dequantize_rows_avx512(const uint8_t* bytes, const BlockScales& scales, const CodeTable& table,
                                              int blocksize_log2, int64_t begin, int64_t end, scalar_t* out) {
  dequantize_rows<scalar_t, Avx512Blocks>(bytes, scales, table, blocksize_log2, begin, end, out);
}

bool cpu_has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl");
  return has;
}
#endif

void dequantize_into(const WeightSpec& spec, const at::Tensor& packed, const BlockScales& scales, at::Tensor& out) {
  const int64_t rows = spec.rows.expect_int();
  const int64_t cols = spec.cols.expect_int();
  const auto* bytes = static_cast<const uint8_t*>(packed.const_data_ptr());
  const CodeTable table = code_table(spec.quant_type);
  const int64_t grain_rows = std::max<int64_t>(1, at::internal::GRAIN_SIZE / cols);

  NF4_DISPATCH_FLOAT_TYPES(out.scalar_type(), "nf4::dequantize", [&] {
    scalar_t* out_data = out.mutable_data_ptr<scalar_t>();
    auto rows_kernel = dequantize_rows<scalar_t>;
#ifdef NF4_CPU_AVX512
    if (cpu_has_avx512()) rows_kernel = dequantize_rows_avx512<scalar_t>;
#endif
    at::parallel_for(0, rows, grain_rows, [&](int64_t row_begin, int64_t row_end) {
      rows_kernel(bytes, scales, table, spec.blocksize_log2, row_begin * cols, row_end * cols,
                  out_data + row_begin * cols);
    });
  });
}

}  // namespace

at::Tensor dequantize_cpu(NF4_DEQUANTIZE_PARAMS) {
  const WeightSpec spec = check_dequantize_args(packed, absmax, blocksize, quant_type, shape, dtype, nested_absmax,
                                                nested_code, nested_offset, nested_blocksize);
  at::Tensor out = at::empty({spec.rows.expect_int(), spec.cols.expect_int()}, packed.options().dtype(dtype));
  dequantize_into(spec, packed, block_scales(spec, absmax, nested_absmax, nested_code, nested_offset), out);
  return out;
}

void dequantize_out_cpu(NF4_DEQUANTIZE_PARAMS, at::Tensor& out) {
  const WeightSpec spec = check_dequantize_out_args(packed, absmax, blocksize, quant_type, shape, dtype,
                                                    nested_absmax, nested_code, nested_offset, nested_blocksize, out);
  dequantize_into(spec, packed, block_scales(spec, absmax, nested_absmax, nested_code, nested_offset), out);
}

TORCH_LIBRARY_IMPL(nf4, CPU, m) {
  m.impl("dequantize", &dequantize_cpu);
  m.impl("dequantize.out", &dequantize_out_cpu);
}

}  // namespace nf4
