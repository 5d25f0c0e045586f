// Torch-free core of the bitsandbytes 4-bit format: the code tables, the nibble order, the block and
// nested-absmax math, and the scalar dequantize / dot loops the CPU kernels run. Everything here compiles
// for the host and, under nvcc, for the device, so the CPU kernels, the CUDA kernels and the Catch2 tests
// all read the format from this one file (see ../shared/docs/bnb-format.md for where each fact comes from).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define NF4_HD __host__ __device__ __forceinline__
#else
#define NF4_HD inline
#endif

namespace nf4 {

enum class QuantType : int { NF4 = 0, FP4 = 1 };

// The 16 dequantized code values, indexed by nibble. Exact fp32 values of bitsandbytes' tables:
// NF4 as bitsandbytes lists it; FP4 is {0, 0.0625, 8, 12, 4, 6, 2, 3} / 12 with the sign in bit 3.
// Nibble 8 of FP4 is -0.0, as bitsandbytes' CUDA and C++ CPU kernels give (its pure-PyTorch fallback
// gives +0.0, which compares equal).
struct CodeTable {
  float value[16];
};

NF4_HD constexpr CodeTable code_table(QuantType quant_type) {
  return quant_type == QuantType::NF4
             ? CodeTable{{-1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
                          -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
                          0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f,
                          0.33791524171829224f, 0.44070982933044434f, 0.5626170039176941f,
                          0.7229568362236023f, 1.0f}}
             : CodeTable{{0.0f, 0.0625f / 12.0f, 8.0f / 12.0f, 12.0f / 12.0f, 4.0f / 12.0f, 6.0f / 12.0f,
                          2.0f / 12.0f, 3.0f / 12.0f, -0.0f, -0.0625f / 12.0f, -8.0f / 12.0f,
                          -12.0f / 12.0f, -4.0f / 12.0f, -6.0f / 12.0f, -2.0f / 12.0f, -3.0f / 12.0f}};
}

// Nibble of flat element e: byte e/2 holds elements 2j (HIGH nibble) and 2j+1 (low nibble).
NF4_HD uint8_t nibble_of_byte(uint8_t byte, int64_t element) {
  return (element & 1) ? (byte & 0x0F) : (byte >> 4);
}

NF4_HD uint8_t nibble_at(const uint8_t* packed, int64_t element) {
  return nibble_of_byte(packed[element >> 1], element);
}

// fp32 multiply and add, each rounded once. bitsandbytes rounds after the multiply and again after the
// add; a fused multiply-add would give a different last bit, so device code uses the _rn intrinsics
// (which nvcc never contracts) and host code is built with -ffp-contract=off.
NF4_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

NF4_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// Entries of nested absmax's 8-bit map (state2.code, fp32): one per uint8 code.
constexpr int kNestedCodeEntries = 256;

// Where the per-block scale (absmax) of the outer blocks comes from.
//  plain:  absmax[b] (fp32).
//  nested: fp32(fp32(code2[codes[b]] * absmax2[b / nested_blocksize]) + *offset), bitsandbytes'
//          dequantize_blockwise of the uint8 codes followed by `+= offset`.
struct BlockScales {
  const float* absmax = nullptr;    // plain fp32 absmax, or nullptr when nested
  const uint8_t* codes = nullptr;   // nested: uint8 absmax codes
  const float* code2 = nullptr;     // nested: the 256-entry dynamic map (state2.code)
  const float* absmax2 = nullptr;   // nested: state2.absmax, one per nested block
  const float* offset = nullptr;    // nested: pointer to the fp32 offset (read where the data lives)
  int nested_blocksize_log2 = 8;

  NF4_HD bool nested() const { return absmax == nullptr; }

  NF4_HD float at(int64_t block) const {
    if (!nested()) return absmax[block];
    return nested_absmax_value(code2[codes[block]], absmax2[block >> nested_blocksize_log2], *offset);
  }

  // The nested math alone, for kernels that fetch the three inputs themselves.
  NF4_HD static float nested_absmax_value(float code2_value, float absmax2_value, float offset_value) {
    return add_rn(mul_rn(code2_value, absmax2_value), offset_value);
  }
};

// One dequantized value before rounding to the output type: code * absmax in fp32 (one rounding).
NF4_HD float dequantize_value(const CodeTable& table, uint8_t nibble, float scale) {
  return mul_rn(table.value[nibble], scale);
}

NF4_HD int log2_exact(int64_t power_of_two) {
  int log2 = 0;
  while ((int64_t{1} << log2) < power_of_two) ++log2;
  return log2;
}

// sum_k a[k] * b[k] in fp32 over 32 interleaved partial sums (element k into sum k % 32), added pairwise at the
// end: a shorter rounding chain than one running sum, and independent chains of adds that the compiler vectorises
// (2 of 16 lanes with AVX-512, 8 of 4 with SSE2), so that the loads more than one chain's add latency set the pace
// (benchmarks/NOTES.md, CPU row 4: in a probe of 8-64 sums, 32 were as fast as 64 with AVX-512, 2.6x 8's, and as
// fast as 8 with SSE2, where 64 spill). The order is the same however it is compiled, so the same bits. Always
// inlined, so that a caller compiled for AVX-512 (Avx512Blocks::dot, cpu_vector.h) vectorises it with AVX-512: as a
// function of its own it is compiled for the build's baseline ISA (SSE2 on x86-64) only.
#if defined(__GNUC__) && !defined(__CUDACC__)
__attribute__((always_inline))
#endif
inline float dot_f32(const float* a, const float* b, int64_t n) {
  constexpr int kLanes = 32;
  float partial[kLanes] = {};
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes) {
    for (int lane = 0; lane < kLanes; ++lane) partial[lane] += a[k + lane] * b[k + lane];
  }
  for (; k < n; ++k) partial[k % kLanes] += a[k] * b[k];
  for (int width = kLanes / 2; width > 0; width /= 2) {
    for (int lane = 0; lane < width; ++lane) partial[lane] += partial[lane + width];
  }
  return partial[0];
}

// How dequantize_elements builds a block's 16 values and whether it hands whole runs of 64 elements to a vector
// kernel. This default: the scalar loop for both (a vector policy must produce the same bits: cpu_vector.h).
struct ScalarBlocks {
  static constexpr bool kRuns64 = false;
  template <typename OutT, typename Convert>
  void values(const CodeTable& table, float scale, Convert convert, OutT (&value)[16]) const {
    for (int nibble = 0; nibble < 16; ++nibble) {
      value[nibble] = convert(dequantize_value(table, static_cast<uint8_t>(nibble), scale));
    }
  }
  template <typename OutT>
  void run64(const uint8_t*, const OutT (&)[16], OutT*) const {}
  float dot(const float* a, const float* b, int64_t n) const { return dot_f32(a, b, n); }
};

// Dequantizes flat elements [begin, end) into out[0 .. end-begin), converting each fp32 value with
// `convert` (round to nearest even for fp16/bf16). Per block, the scale is fetched once and the 16 values a
// nibble can stand for are computed and converted once (code * scale rounded once, then converted: what each
// element would get on its own), so each element is one lookup, two per packed byte. `blocks` may build the 16
// values and take whole runs of 64 elements (32 packed bytes) inside a block with vector code instead.
template <typename OutT, typename Convert, typename Blocks = ScalarBlocks>
inline void dequantize_elements(const uint8_t* packed, const BlockScales& scales, const CodeTable& table,
                                int blocksize_log2, int64_t begin, int64_t end, OutT* out, Convert convert,
                                Blocks blocks = {}) {
  int64_t e = begin;
  OutT* o = out;
  while (e < end) {
    const int64_t block = e >> blocksize_log2;
    const int64_t block_end_raw = (block + 1) << blocksize_log2;
    const int64_t block_end = block_end_raw < end ? block_end_raw : end;
    OutT value[16];
    blocks.values(table, scales.at(block), convert, value);
    if ((e & 1) != 0) *o++ = value[nibble_at(packed, e++)];  // a low nibble starts the range
    if constexpr (Blocks::kRuns64) {
      for (; e + 64 <= block_end; e += 64, o += 64) blocks.run64(packed + (e >> 1), value, o);
    }
    for (; e + 1 < block_end; e += 2) {
      const uint8_t byte = packed[e >> 1];
      o[0] = value[nibble_of_byte(byte, 0)];
      o[1] = value[nibble_of_byte(byte, 1)];
      o += 2;
    }
    if (e < block_end) *o++ = value[nibble_at(packed, e++)];  // a high nibble ends it
  }
}

}  // namespace nf4
