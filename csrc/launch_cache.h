// Host-side launch helpers shared by the CUDA gemv kernels (csrc/gemv.cu, csrc/gemv_many_rows.cu): values computed
// once per device (such as a kernel's resident CTAs per SM).
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <atomic>
#include <cstdint>

namespace nf4 {

// compute(device) for the current device, computed once per device (up to 64 devices; more are recomputed
// every call) and kept in `cache`; compute must return a positive value.
template <typename Compute>
inline int64_t once_per_device(std::atomic<int64_t> (&cache)[64], Compute compute) {
  const int device = at::cuda::current_device();
  if (device < 64 && cache[device].load() > 0) return cache[device].load();
  const int64_t value = compute(device);
  if (device < 64) cache[device].store(value);
  return value;
}

// Allows `kernel` its dynamic shared memory on the current device and returns how many of its CTAs fit on
// one SM there; done once per device and kernel (`resident` is the kernel's own cache).
template <typename Kernel>
inline int prepare_kernel(std::atomic<int64_t> (&resident)[64], Kernel kernel, int threads, int shared_bytes) {
  return static_cast<int>(once_per_device(resident, [&](int) -> int64_t {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes));
    int ctas = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, kernel, threads, shared_bytes));
    TORCH_CHECK(ctas > 0, "nf4::gemv: a kernel does not fit on this GPU's SMs");
    return ctas;
  }));
}

}  // namespace nf4
