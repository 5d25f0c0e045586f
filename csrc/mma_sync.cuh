// Device-side wrappers of sm_80+ PTX shared by the tensor-core kernels (csrc/gemv.cu, csrc/gemv_many_rows.cu):
// the m16n8k16 mma with fp32 accumulators, cp.async copies to shared memory, and ldmatrix.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace nf4 {

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

// cp.async: copies kBytes (4, 8 or 16) from global to shared memory without registers, src_bytes of them
// read and the rest zero-filled; 16-byte copies bypass L1, so that x, which every warp rereads, stays there.
template <int kBytes>
__device__ __forceinline__ void copy_async(uint32_t shared_dst, const void* src, uint32_t src_bytes = kBytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (kBytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_dst), "l"(src), "r"(src_bytes)
                 : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(shared_dst), "l"(src), "n"(kBytes),
                 "r"(src_bytes)
                 : "memory");
  }
#else
  __trap();  // the host launches this path only on sm_80 or newer
#endif
}

// Closes this thread's group of copies (an empty group when it issued none).
__device__ __forceinline__ void copy_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most kPending of this thread's groups are still in flight.
template <int kPending>
__device__ __forceinline__ void copy_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
#endif
}

// Four 8x8 matrices of 16-bit values from shared memory (ldmatrix .x4, not transposed): lane l gives the
// address of row l % 8 of matrix l / 8, and each lane gets, of every matrix, the two values of row l / 4 at
// columns 2 (l % 4) and 2 (l % 4) + 1: an mma operand fragment.
__device__ __forceinline__ void load_matrix_x4(uint32_t shared_address, uint32_t (&r)[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address));
#else
  __trap();  // the host launches these paths only on sm_80 or newer
#endif
}

}  // namespace nf4
