// The byte -> code pair table that the tensor-core kernels (csrc/gemv.cu, csrc/gemv_many_rows.cu) decode packed
// weights with: one shared-memory lookup turns a packed byte into its two code values as a packed fp16 / bf16
// operand word for mma.sync. The table is replicated once per lane, entry e of lane l at byte e * 256 + 4 * l, so
// that the 32 lanes' random bytes never share a bank and one byte permute forms a lane's offset (the byte in bits
// 8..15, 4 * lane in 0..7). An entry's first 128 bytes hold the lanes' copies; its last 128 hold the lo parts of
// split operands (fp32 x, MmaOperand) and are otherwise free for the kernel's own use.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda_types.cuh"
#include "nf4_core.h"

namespace nf4 {

constexpr int kCodePairEntryBytes = 256;  // per table entry: 32 lanes x 4 bytes, then (split operands) their lo parts
constexpr int kCodePairTableBytes = 256 * kCodePairEntryBytes;

template <typename T>
__device__ __forceinline__ uint16_t bits_of(T v);
template <>
__device__ __forceinline__ uint16_t bits_of<__half>(__half v) { return __half_as_ushort(v); }
template <>
__device__ __forceinline__ uint16_t bits_of<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat16_as_ushort(v); }

// Code value `index` (0..15). (nvcc turns the selects back into one indexed read of the table, which it
// keeps in local memory: once per thread here, not once per table entry as before; NOTES gemv row 10.)
__device__ __forceinline__ float code_value(QuantType quant_type, int index) {
  const CodeTable table = code_table(quant_type);
  float value = 0.0f;
#pragma unroll
  for (int i = 0; i < 16; ++i) value = index == i ? table.value[i] : value;
  return value;
}

// The mmas' operand type for x of type T, and whether x and the codes are split into two parts of it. fp16 /
// bf16 x feed the mmas as they are. fp32 x (HF's default compute dtype) would lose 16 of its 24 bits as bf16
// (and fp16 could overflow), so x and the codes are each split into bf16 parts, v = hi + lo (lo = the rounding
// error of hi, so hi + lo holds ~16 bits of v, and bf16 keeps fp32's exponent range), and each k-tile takes three
// mmas: lo(code) x hi(x), hi(code) x lo(x), then hi x hi. The dropped lo x lo is under 2^-16 of each product,
// and every bf16 product is exact in the fp32 sums, so the result stays within the fp32 tolerance rule (README,
// "Correctness") at 3x the mmas and 2x the table lookups of a bf16 step.
template <typename T>
struct MmaOperand {
  using type = T;
  static constexpr bool kSplit = false;
};
template <>
struct MmaOperand<float> {
  using type = __nv_bfloat16;
  static constexpr bool kSplit = true;
};

// Part `part` (0: hi, 1: lo) of v as the mmas' operand type M: hi = M(v), lo = M(v - hi).
template <typename M>
__device__ __forceinline__ uint16_t operand_part(float v, int part) {
  const M high = from_float<M>(v);
  return bits_of(part == 0 ? high : from_float<M>(v - to_float(high)));
}

// A lane's offset in the table of the code pair of byte `byte` (0..3) of `word`, with lane4 = 4 x lane: result
// byte 0 <- lane4's byte 0 (selector 4), byte 1 <- word's byte `byte`, bytes 2, 3 <- zero (lane4's byte 1), i.e.
// byte * 256 + 4 * lane.
__device__ __forceinline__ uint32_t code_pair_offset(uint32_t word, uint32_t byte, uint32_t lane4) {
  return __byte_perm(word, lane4, 0x5504u | byte << 4);
}

// Fills the byte -> code pair table (kCodePairTableBytes at `lut`, one copy per lane: see above) with the CTA's
// threads; the caller syncs before reading it. Entry e holds (code of e's high nibble, code of its low nibble) as two
// operand values in one 32-bit word, lane l's copy at byte e * 256 + 4 * l (the entry's first 128 bytes); with split
// operands the entry's last 128 bytes hold the pairs' lo parts the same way, so that a lookup's lo part is at its
// address + 128. Thread i writes 16-byte chunk i % 8 (i % 16 when split) of entry i / 8 (i / 16), so a warp's stores
// cover whole 128-byte rows, 4 wavefronts and no more. Lane l reads code value l % 16 once and the others take it by
// shuffle: reading the (local-memory) table for every entry was slow on small layers, where the fill is a good part of
// the time.
template <typename T>
__device__ __forceinline__ void fill_code_pair_table(uint8_t* lut, QuantType quant_type) {
  using M = typename MmaOperand<T>::type;
  constexpr int kChunks = MmaOperand<T>::kSplit ? 16 : 8;  // 16-byte chunks per entry: 8 per part
  const float lane_code = code_value(quant_type, threadIdx.x % 32 % 16);
  for (int chunk = threadIdx.x; chunk < 256 * kChunks; chunk += blockDim.x) {  // whole warps: 256 * 8 % 32 == 0
    const int byte = chunk / kChunks, part = chunk % kChunks / 8;
    const float high = __shfl_sync(0xFFFFFFFFu, lane_code, byte >> 4);
    const float low = __shfl_sync(0xFFFFFFFFu, lane_code, byte & 0x0F);
    const uint32_t pair = uint32_t(operand_part<M>(high, part)) | uint32_t(operand_part<M>(low, part)) << 16;
    reinterpret_cast<uint4*>(lut + byte * kCodePairEntryBytes)[chunk % kChunks] = make_uint4(pair, pair, pair, pair);
  }
}

}  // namespace nf4
