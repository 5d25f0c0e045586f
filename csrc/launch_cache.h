// Host-side launch helpers shared by the CUDA kernels: values computed once per device (such as a kernel's resident
// CTAs per SM), and the one launch function they all go through.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <utility>

#include "environment.h"

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

// What one CTA of a kernel takes of an SM, for counting the CTAs of another kernel that fit beside it.
struct CtaFootprint {
  int warps = 0;
  int registers = 0;     // per thread
  int shared_bytes = 0;  // static and dynamic
};

// `kernel`'s footprint at `threads` threads and `dynamic_shared_bytes`; its attributes are read once per device
// (`cache` is the kernel's own).
template <typename Kernel>
CtaFootprint cta_footprint(std::atomic<int64_t> (&cache)[64], Kernel kernel, int threads, int dynamic_shared_bytes) {
  const int64_t attributes = once_per_device(cache, [&](int) -> int64_t {
    cudaFuncAttributes read;
    C10_CUDA_CHECK(cudaFuncGetAttributes(&read, reinterpret_cast<const void*>(kernel)));
    return (int64_t{read.numRegs} << 32) | static_cast<int64_t>(read.sharedSizeBytes);  // numRegs >= 1: positive
  });
  return {(threads + 31) / 32, static_cast<int>(attributes >> 32),
          static_cast<int>(attributes & 0xffffffff) + dynamic_shared_bytes};
}

// How many CTAs of footprint `guest` fit on one SM of `device` that runs `host_ctas` CTAs of footprint `host`:
// registers go to warps in units of 256, and every CTA's shared memory has a reserved slice besides its own. (The
// SM's split of shared memory and L1 is the host's, which may leave less than this counts: an estimate that only
// decides how a grid is sized, never what it computes.)
inline int64_t ctas_fitting_beside(const cudaDeviceProp& device, const CtaFootprint& host, int64_t host_ctas,
                                   const CtaFootprint& guest) {
  const auto warp_registers = [](int per_thread) { return int64_t{(per_thread * 32 + 255) / 256 * 256}; };
  const int64_t reserved = static_cast<int64_t>(device.reservedSharedMemPerBlock);
  const int64_t registers = device.regsPerMultiprocessor - host_ctas * host.warps * warp_registers(host.registers);
  const int64_t threads = device.maxThreadsPerMultiProcessor - host_ctas * host.warps * 32;
  const int64_t shared =
      static_cast<int64_t>(device.sharedMemPerMultiprocessor) - host_ctas * (host.shared_bytes + reserved);
  const int64_t slots = device.maxBlocksPerMultiProcessor - host_ctas;
  const int64_t fitting = std::min({registers / (guest.warps * warp_registers(guest.registers)),
                                    threads / (guest.warps * 32), shared / (guest.shared_bytes + reserved), slots});
  return std::max<int64_t>(fitting, 0);
}

// Whether `kernel`'s code on this device was compiled for sm_90+ (PTX version 9.0+): code JIT-compiled on an H100
// from sm_80 PTX has none of what the kernels compile for sm_90 only (#if __CUDA_ARCH__ >= 900: the waits of
// cuda_types.cuh, the tile clusters' end in csrc/gemv.cu). Asked once per device and kernel signature: every kernel
// of the build has the same targets.
template <typename Kernel>
bool compiled_for_sm90(Kernel kernel) {
  static std::atomic<int64_t> compiled_for_it[64] = {};
  return once_per_device(compiled_for_it, [&](int) -> int64_t {
           cudaFuncAttributes attributes;
           C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, reinterpret_cast<const void*>(kernel)));
           return attributes.ptxVersion >= 90 ? 2 : 1;  // positive values only
         }) == 2;
}

// Whether `kernel` is launched with programmatic dependent launch (cuda_types.cuh, wait_for_previous_kernels): where
// its code was compiled for sm_90+, so that its waits are in it, unless the environment sets NF4_OPS_PDL=0 (read once
// per process; for comparisons and for ruling it out).
template <typename Kernel>
bool programmatic_launch_enabled(Kernel kernel) {
  static const bool allowed = !environment_turns_off("NF4_OPS_PDL");
  return allowed && compiled_for_sm90(kernel);
}

// A launch's configuration: `cluster` CTAs per cluster when above 1 (sm_90), and programmatic dependent launch
// where `programmatic`. `config` points into the object, which therefore is built where it is used, never copied.
struct LaunchConfig {
  cudaLaunchAttribute attributes[2];
  cudaLaunchConfig_t config = {};
  LaunchConfig(dim3 grid, int threads, int shared_bytes, cudaStream_t stream, int cluster, bool programmatic) {
    config.gridDim = grid;
    config.blockDim = dim3(threads, 1, 1);
    config.dynamicSmemBytes = shared_bytes;
    config.stream = stream;
    config.attrs = attributes;
    config.numAttrs = 0;
    if (cluster > 1) {
      cudaLaunchAttribute& attribute = attributes[config.numAttrs++];
      attribute.id = cudaLaunchAttributeClusterDimension;
      attribute.val.clusterDim.x = cluster, attribute.val.clusterDim.y = 1, attribute.val.clusterDim.z = 1;
    }
    if (programmatic) {
      cudaLaunchAttribute& attribute = attributes[config.numAttrs++];
      attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attribute.val.programmaticStreamSerializationAllowed = 1;
    }
  }
  LaunchConfig(const LaunchConfig&) = delete;
  LaunchConfig& operator=(const LaunchConfig&) = delete;
};

// Launches `kernel` on `stream`, in clusters of `cluster` CTAs when above 1, with programmatic dependent launch where
// programmatic_launch_enabled(). Every kernel launched here calls let_next_kernel_start() and
// wait_for_previous_kernels() (cuda_types.cuh).
template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, int threads, int shared_bytes, cudaStream_t stream,
                   int cluster, Args&&... args) {
  const LaunchConfig launch(grid, threads, shared_bytes, stream, cluster, programmatic_launch_enabled(kernel));
  C10_CUDA_CHECK(cudaLaunchKernelEx(&launch.config, kernel, std::forward<Args>(args)...));
}

}  // namespace nf4
