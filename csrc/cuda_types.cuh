// Device-side helpers shared by the CUDA kernels: the torch -> CUDA scalar type map and the conversions
// to and from fp32 (round to nearest even, as bitsandbytes and torch do).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "nf4_core.h"

namespace nf4 {

template <typename TorchT>
struct CudaScalar;
template <>
struct CudaScalar<float> {
  using type = float;
};
template <>
struct CudaScalar<c10::Half> {
  using type = __half;
};
template <>
struct CudaScalar<c10::BFloat16> {
  using type = __nv_bfloat16;
};

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

// Programmatic dependent launch (sm_90+). The kernels are launched with launch_kernel (launch_cache.h), which lets
// a kernel start while the kernel before it in the stream is still finishing: its CTAs take SMs as the previous
// kernel's CTAs leave them, and do their set-up (the shared-memory tables) in that time. Nothing before
// wait_for_previous_kernels() may touch global memory: the previous kernel may be writing x, W or the buffer
// this kernel writes (the caching allocator hands freed memory on in stream order). Every CTA calls it, before
// any return, so that this kernel's completion implies the previous one's, for the kernel after. Every kernel
// calls let_next_kernel_start() first thing: the next kernel's CTAs may then launch once all of this kernel's
// have, and they wait in turn. Without the launch attribute, or before sm_90, both do nothing.
__device__ __forceinline__ void wait_for_previous_kernels() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void let_next_kernel_start() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Orders `value`'s computation before what follows in the PTX (both this and wait_for_previous_kernels() are
// volatile asm, which keep their order), where the front end had moved index arithmetic past the wait, onto the path
// after it. ptxas may still sink part of it: in add_tile_parts_kernel 59-68 instructions remain between the wait
// and the first load, against 77 without it and the old kernel's 54 (NOTES gemv rows 123b-123d). 32- or 64-bit
// integers.
template <typename Int>
__device__ __forceinline__ void computed_here(Int& value) {
  static_assert(std::is_integral_v<Int> && (sizeof(Int) == 4 || sizeof(Int) == 8),
                "computed_here: a 32- or 64-bit integer");
  if constexpr (sizeof(Int) == 4) {
    asm volatile("" : "+r"(value));
  } else {
    asm volatile("" : "+l"(value));
  }
}

// Asks L2 for the 128-byte line holding `address`, loading nothing into registers or L1. Allowed before
// wait_for_previous_kernels(): every SM's writes land in L2, so a line fetched early still takes the previous
// kernel's writes, and the kernel reads it only after the wait. A tuning build may leave these prefetches out
// with -DNF4_PREFETCH_BEFORE_WAIT=0.
#ifndef NF4_PREFETCH_BEFORE_WAIT
#define NF4_PREFETCH_BEFORE_WAIT 1
#endif
__device__ __forceinline__ void prefetch_l2(const void* address) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(address));
}

// Where block `block`'s own scale entry lies: its fp32 absmax, or with nested absmax its code byte.
__device__ __forceinline__ const void* block_scale_entry(const BlockScales& scales, int64_t block) {
  return scales.nested() ? static_cast<const void*>(scales.codes + block) : static_cast<const void*>(scales.absmax + block);
}

// Asks L2 for the line of block `block`'s own scale entry (block_scale_entry). Never for its state2.absmax value: one
// line of those covers 32 x 256 blocks (at blocksize 4096, 33.5 M elements), so every warp of a grid would ask L2 for
// the same line, and prefetches pass L1 by: thousands at once stalled that L2 slice and dequantize with it (NOTES
// dequantize row 11), where the loads themselves meet in each SM's L1.
__device__ __forceinline__ void prefetch_block_scale(const BlockScales& scales, int64_t block) {
  prefetch_l2(block_scale_entry(scales, block));
}

// Asks L2 for what every nested scale reads besides its own block's bytes: state2.code (256 floats, at most 9
// lines) and the offset, lanes 0-8 of the calling warp a line of the map each and lane 9 the offset's. Nothing for
// plain absmax.
__device__ __forceinline__ void prefetch_nested_tables(const BlockScales& scales, int lane) {
  if (!scales.nested()) return;
  if (lane < 9) {
    prefetch_l2(scales.code2 + (32 * lane < 256 ? 32 * lane : 255));
  } else if (lane == 9) {
    prefetch_l2(scales.offset);
  }
}

// The thread's warp in its CTA, as one value per warp that the compiler can see is one: taken from lane 0 by a
// shuffle, it lives in a uniform register, and so do the loop bounds and counters derived from it, which frees
// vector registers and lets the compiler treat the warp's loops as convergent (no divergent-path copies of their
// shuffles). threadIdx.x / 32 is the same number, but the compiler does not know that it is one per warp.
__device__ __forceinline__ int warp_in_cta() { return __shfl_sync(0xFFFFFFFFu, static_cast<int>(threadIdx.x / 32), 0); }

// Whether a pointer allows 16-byte vector access.
inline bool is_aligned_16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Loads the 16 packed bytes of 32 consecutive elements (element 32*chunk .. 32*chunk+31).
__device__ __forceinline__ uint4 load_packed_chunk(const uint8_t* packed, int64_t chunk) {
  return __ldg(reinterpret_cast<const uint4*>(packed) + chunk);
}

// The 32 code values of one packed chunk, scaled: w[i] = code[nibble(i)] * scale in fp32.
__device__ __forceinline__ void decode_chunk(uint4 raw, const float* table, float scale, float (&w)[32]) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int word = 0; word < 4; ++word) {
#pragma unroll
    for (int byte = 0; byte < 4; ++byte) {
      const uint32_t b = (words[word] >> (8 * byte)) & 0xFF;
      const int element = 8 * word + 2 * byte;  // the even element is the high nibble
      w[element] = __fmul_rn(table[b >> 4], scale);
      w[element + 1] = __fmul_rn(table[b & 0x0F], scale);
    }
  }
}

}  // namespace nf4
