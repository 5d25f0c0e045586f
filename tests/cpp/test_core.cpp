// Hand-checked tests of the torch-free core shared by the CPU and CUDA kernels.
#if defined(NF4_CATCH2_V3)
#include <catch2/catch_test_macros.hpp>
#else
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "nf4_core.h"

namespace {

uint32_t bits(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof(b));
  return b;
}

float from_bits(uint32_t b) {
  float v;
  std::memcpy(&v, &b, sizeof(v));
  return v;
}

}  // namespace

TEST_CASE("NF4 table has bitsandbytes' exact fp32 values", "[tables]") {
  // The bit patterns listed in shared/docs/bnb-format.md (and read from bitsandbytes 0.50.2).
  const uint32_t expected[16] = {0xbf800000, 0xbf3239b1, 0xbf066b30, 0xbeca32a0, 0xbe91a24d, 0xbe3d353f,
                                 0xbdba7871, 0x00000000, 0x3da2faff, 0x3e24cae3, 0x3e7c04dd, 0x3ead033a,
                                 0x3ee1a4b8, 0x3f1007ab, 0x3f3913b3, 0x3f800000};
  const nf4::CodeTable table = nf4::code_table(nf4::QuantType::NF4);
  for (int i = 0; i < 16; ++i) {
    INFO("nibble " << i);
    CHECK(bits(table.value[i]) == expected[i]);
  }
}

TEST_CASE("FP4 table is {0, 0.0625, 8, 12, 4, 6, 2, 3}/12 with a sign bit, nibble 8 = -0.0", "[tables]") {
  const uint32_t expected[16] = {0x00000000, 0x3baaaaab, 0x3f2aaaab, 0x3f800000, 0x3eaaaaab, 0x3f000000,
                                 0x3e2aaaab, 0x3e800000, 0x80000000, 0xbbaaaaab, 0xbf2aaaab, 0xbf800000,
                                 0xbeaaaaab, 0xbf000000, 0xbe2aaaab, 0xbe800000};
  const nf4::CodeTable table = nf4::code_table(nf4::QuantType::FP4);
  for (int i = 0; i < 16; ++i) {
    INFO("nibble " << i);
    CHECK(bits(table.value[i]) == expected[i]);
  }
}

TEST_CASE("the even element is the high nibble", "[nibbles]") {
  const uint8_t packed[2] = {0xAB, 0x3C};
  CHECK(nf4::nibble_at(packed, 0) == 0xA);
  CHECK(nf4::nibble_at(packed, 1) == 0xB);
  CHECK(nf4::nibble_at(packed, 2) == 0x3);
  CHECK(nf4::nibble_at(packed, 3) == 0xC);
}

TEST_CASE("log2 of the power-of-two blocksizes", "[blocks]") {
  CHECK(nf4::log2_exact(32) == 5);
  CHECK(nf4::log2_exact(64) == 6);
  CHECK(nf4::log2_exact(256) == 8);
  CHECK(nf4::log2_exact(4096) == 12);
}

TEST_CASE("plain absmax is read per block", "[absmax]") {
  const float absmax[3] = {1.5f, -2.0f, 0.25f};
  nf4::BlockScales scales;
  scales.absmax = absmax;
  CHECK_FALSE(scales.nested());
  CHECK(scales.at(0) == 1.5f);
  CHECK(scales.at(2) == 0.25f);
}

TEST_CASE("nested absmax rounds after the multiply and again after the add (no FMA)", "[absmax]") {
  // a*b = 1 + 2^-11 + 2^-24 exactly; rounded to fp32 that is 1 + 2^-11 (a tie, to even). Adding -1 then
  // gives 2^-11, where a fused multiply-add would keep the 2^-24 term.
  const float a = 1.0f + std::ldexp(1.0f, -12);
  std::vector<float> code2(256, 0.0f);
  code2[7] = a;
  code2[9] = 0.5f;
  const float absmax2[2] = {a, 4.0f};
  const float offset = -1.0f;
  std::vector<uint8_t> code_bytes(300, 7);
  code_bytes[256] = 9;  // block 256 is in the second nested block

  nf4::BlockScales scales;
  scales.codes = code_bytes.data();
  scales.code2 = code2.data();
  scales.absmax2 = absmax2;
  scales.offset = &offset;
  scales.nested_blocksize_log2 = 8;
  REQUIRE(scales.nested());
  CHECK(scales.at(0) == std::ldexp(1.0f, -11));
  CHECK(scales.at(0) != std::fma(a, a, offset));
  CHECK(scales.at(256) == 0.5f * 4.0f - 1.0f);
}

TEST_CASE("dequantize_elements: blocks straddle the range, odd start, one rounding", "[cpu-loop]") {
  // 6 bytes = 12 elements; blocksize 4 is smaller than the format allows, to put several blocks in a
  // hand-checkable range (the loop itself accepts any power of two).
  const uint8_t packed[6] = {0x0F, 0x78, 0x12, 0xF0, 0x77, 0x8E};
  const float absmax[3] = {2.0f, -0.5f, 3.0f};
  nf4::BlockScales scales;
  scales.absmax = absmax;
  const nf4::CodeTable nf4_table = nf4::code_table(nf4::QuantType::NF4);
  float out[11];
  nf4::dequantize_elements(packed, scales, nf4_table, /*blocksize_log2=*/2, 1, 12, out, [](float v) { return v; });
  const float t8 = nf4_table.value[8];
  const float expected[11] = {
      1.0f * 2.0f, 0.0f * 2.0f, t8 * 2.0f,                                     // elements 1..3, block 0
      nf4_table.value[1] * -0.5f, nf4_table.value[2] * -0.5f, 1.0f * -0.5f, -1.0f * -0.5f,  // block 1
      0.0f, 0.0f, t8 * 3.0f, nf4_table.value[14] * 3.0f};                     // block 2
  for (int i = 0; i < 11; ++i) {
    INFO("element " << i + 1);
    CHECK(bits(out[i]) == bits(expected[i]));
  }
  // the same range less its last element, which leaves a high nibble alone at the end of the last block
  float shorter[10];
  nf4::dequantize_elements(packed, scales, nf4_table, 2, 1, 11, shorter, [](float v) { return v; });
  for (int i = 0; i < 10; ++i) {
    INFO("element " << i + 1 << " of 1..10");
    CHECK(bits(shorter[i]) == bits(expected[i]));
  }
}

TEST_CASE("dequantize_elements converts through the given rounding", "[cpu-loop]") {
  const uint8_t packed[1] = {0xF0};
  const float absmax[1] = {from_bits(0x3f800001)};  // 1 + 2^-23
  nf4::BlockScales scales;
  scales.absmax = absmax;
  int calls = 0;
  float out[2];
  nf4::dequantize_elements(packed, scales, nf4::code_table(nf4::QuantType::NF4), 5, 0, 2, out, [&](float v) {
    ++calls;
    return v * 2.0f;
  });
  CHECK(calls == 16);  // once per value a nibble of the block can stand for, not once per element
  CHECK(out[0] == 2.0f * from_bits(0x3f800001));
  CHECK(bits(out[1]) == bits(-2.0f * from_bits(0x3f800001)));
}

namespace {

// dot_f32's order spelled out on its own: element k into partial sum k % 32, then the 32 sums added pairwise
// (sum i += sum i + w for w = 16, 8, ..., 1).
float dot_in_32_lanes(const std::vector<float>& a, const std::vector<float>& b) {
  float partial[32] = {};
  for (size_t k = 0; k < a.size(); ++k) partial[k % 32] += a[k] * b[k];
  for (int width = 16; width > 0; width /= 2) {
    for (int lane = 0; lane < width; ++lane) partial[lane] += partial[lane + width];
  }
  return partial[0];
}

// Values whose products round (24-bit mantissas, signs and exponents mixed), so a different order of adds shows.
std::vector<float> rounding_values(size_t n, uint32_t seed) {
  std::vector<float> v(n);
  uint32_t state = seed;
  for (auto& x : v) {
    state = state * 1664525u + 1013904223u;
    x = from_bits(0x3f800000u | (state >> 9)) * ((state & 1) ? -1.0f : 1.0f) * float(1 + (state >> 28));
  }
  return v;
}

#if defined(__x86_64__) && defined(__GNUC__)
// dot_f32 inlined into a function compiled for AVX-512, as Avx512Blocks::dot (csrc/cpu_vector.h) has it.
__attribute__((target("avx2,avx512f,avx512bw,avx512vl"))) float dot_avx512(const float* a, const float* b, int64_t n) {
  return nf4::dot_f32(a, b, n);
}
#endif

}  // namespace

TEST_CASE("dot_f32 adds in its stated order, the same bits when compiled for AVX-512", "[cpu-loop]") {
  for (size_t n : {1u, 7u, 31u, 32u, 33u, 200u, 1024u, 4099u}) {
    const std::vector<float> a = rounding_values(n, 7u + n), b = rounding_values(n, 99u + n);
    const float got = nf4::dot_f32(a.data(), b.data(), static_cast<int64_t>(n));
    CHECK(bits(got) == bits(dot_in_32_lanes(a, b)));
    double exact = 0.0;
    for (size_t k = 0; k < n; ++k) exact += double(a[k]) * double(b[k]);
    CHECK(std::fabs(got - exact) <= 1e-5 * (1.0 + std::fabs(exact)) * double(n));
#if defined(__x86_64__) && defined(__GNUC__)
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")) {
      CHECK(bits(dot_avx512(a.data(), b.data(), static_cast<int64_t>(n))) == bits(got));
    }
#endif
  }
}

TEST_CASE("dot_f32 on hand-checked vectors", "[cpu-loop]") {
  std::vector<float> a(19), b(19);
  float expected = 0.0f;
  for (int i = 0; i < 19; ++i) {
    a[i] = float(i + 1);
    b[i] = (i % 2 == 0) ? 1.0f : -0.5f;
    expected += a[i] * b[i];  // small integers and halves: exact in any order
  }
  CHECK(nf4::dot_f32(a.data(), b.data(), 19) == expected);
  CHECK(nf4::dot_f32(a.data(), b.data(), 0) == 0.0f);
  CHECK(nf4::dot_f32(a.data(), b.data(), 3) == 1.0f - 1.0f + 3.0f);
}
