// CPU vector code shared by the CPU kernels: dequantize_elements' block policy for x86-64 CPUs with AVX-512
// (F, BW, VL), chosen at run time (cpu_has_avx512), so the build needs no flag and other CPUs keep ScalarBlocks.
// NF4_OPS_AVX512=0 in the environment makes the CPU kernels take the path of a CPU without it (scripts/test.sh
// runs the CPU kernels' tests that way too, so that both paths are tested on any CPU that has it).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>

#include "environment.h"
#include "nf4_core.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define NF4_CPU_AVX512 1
#endif

namespace nf4 {

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

  // dot_f32 (always inlined) compiled for AVX-512: the same order of adds, so the same bits as ScalarBlocks::dot.
  NF4_AVX512_TARGET float dot(const float* a, const float* b, int64_t n) const { return dot_f32(a, b, n); }
};

inline bool cpu_has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && !environment_turns_off("NF4_OPS_AVX512");
  return has;
}
#endif  // NF4_CPU_AVX512

// Whether the CPU has native bf16 dot products (AVX512-BF16), which torch's bf16 CPU matmul uses (gemv_cpu.cpp); false
// where NF4_OPS_AVX512=0 turns AVX-512 off, as on a CPU without it.
inline bool cpu_has_avx512_bf16() {
#ifdef NF4_CPU_AVX512
  static const bool has = cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
  return has;
#else
  return false;
#endif
}

}  // namespace nf4
