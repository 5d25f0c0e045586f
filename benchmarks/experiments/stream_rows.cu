// Standalone: how fast can kWarps warps per SM (16 in the gemv) stream a packed weight the way the tensor-core
// gemv reads it (each warp a 16-row tile, row pieces of kPieceBytes per row per request, kStages requests in
// flight per warp, cp.async into shared memory), with no decode? With and without the turn's scales (16 bytes per row, from a
// second array), grouped 4 turns per copy or not, with cp.async's L2 prefetch hint or not. Against a plain
// coalesced read of the same bytes. Work is split over the warps as the gemv's stream-K split does.
//   nvcc -O3 -arch=sm_90 -o /tmp/stream_rows benchmarks/experiments/stream_rows.cu && /tmp/stream_rows
// Prints one line per variant; GB/s counts the weight bytes, plus the scales' when they are read
// (benchmarks/NOTES.md, "Where M=1 stands", records what it printed on the H100).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

constexpr int kRows = 16;
constexpr int kGroupBytes = 2 * 1024;  // per warp: two buffers of 16 rows x 64 bytes of grouped scales (kScales 4)

// Bytes of one stage: kRows x kPieceBytes of weights, then room for their scales (blocksize 64, fp32: an
// eighth of the weight bytes; at least 256 bytes, what the 16-byte-per-row copies need).
template <int kPieceBytes>
__host__ __device__ constexpr int stage_stride() {
  return kRows * kPieceBytes + (kRows * kPieceBytes / 8 > 256 ? kRows * kPieceBytes / 8 : 256);
}

// kPrefetch: 0, or 128 / 256: the L2 fetches that many bytes around each request (cp.async's L2::NB hint).
template <int kPrefetch = 0>
__device__ __forceinline__ void copy16(uint32_t dst, const void* src) {
  if constexpr (kPrefetch == 256) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
  } else if constexpr (kPrefetch == 128) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
  } else {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
  }
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wait_pending() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// W: rows x row_bytes. Work units: (tile, piece) with pieces of kPieceBytes per row, laid end to end and split
// evenly over all warps (as the gemv's stream-K split). Each unit: kRows rows x kPieceBytes into one stage.
// kScales: 0 none; 1: each unit's 16 bytes of scales per row with the unit; 4: 64 bytes per row (4 units' scales)
// with every 4th unit, into a separate pair of buffers.
// kInterleave: the CTA takes one contiguous run of units and its warps take turns over it (warp w: units
// w, w + kWarps, ...), so at any time the CTA's warps read neighbouring pieces of the same rows.
template <int kPieceBytes, int kStages, int kScales, int kPrefetch, int kWarps, bool kInterleave>
__global__ void __launch_bounds__(kWarps * 32, 1)
    stream_kernel(const uint8_t* w, const uint8_t* scales, int64_t rows, int64_t row_bytes, uint32_t* sink) {
  extern __shared__ __align__(16) uint8_t smem[];
  constexpr int kStageBytes = kRows * kPieceBytes;
  constexpr int kStageStride = stage_stride<kPieceBytes>();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  uint8_t* ring = smem + warp * kStages * kStageStride;
  uint8_t* groups = smem + kWarps * kStages * kStageStride + warp * kGroupBytes;
  const uint32_t groups_s = static_cast<uint32_t>(__cvta_generic_to_shared(groups));
  const uint32_t ring_s = static_cast<uint32_t>(__cvta_generic_to_shared(ring));
  const int64_t pieces = row_bytes / kPieceBytes;
  const int64_t total = rows / kRows * pieces;
  const int64_t warps = int64_t{gridDim.x} * kWarps, id = int64_t{blockIdx.x} * kWarps + warp;
  const int64_t cta_first = blockIdx.x * total / gridDim.x, cta_end = (blockIdx.x + 1) * total / gridDim.x;
  const int64_t first = kInterleave ? cta_first + warp : id * total / warps;
  const int64_t end = kInterleave ? cta_end : (id + 1) * total / warps;
  constexpr int kStride = kInterleave ? kWarps : 1;  // units between a warp's consecutive units
  const auto issue = [&](int64_t unit, int stage) {
    const int64_t tile = unit / pieces, piece = unit % pieces;
    const uint8_t* src = w + tile * kRows * row_bytes + piece * kPieceBytes;
    constexpr int kCopies = kStageBytes / 16 / 32;  // per lane
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      const int c = i * 32 + lane;  // 16-byte chunk of the stage
      const int r = c / (kPieceBytes / 16), o = c % (kPieceBytes / 16);
      copy16<kPrefetch>(ring_s + stage * kStageStride + c * 16, src + r * row_bytes + o * 16);
    }
    if (kScales == 4 && (unit - first) % 4 == 0) {  // rows lane / 4 + 8i, 16 bytes each of 4 units
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = lane / 4 + 8 * i;
        copy16(groups_s + (((unit - first) / 4) % 2) * (kGroupBytes / 2) + r * 64 + (lane % 4) * 16,
               scales + (tile * kRows + r) * (row_bytes / 8) + piece * (kPieceBytes / 8) + (lane % 4) * 16);
      }
    }
    if (kScales == 1) {  // the unit's fp32 absmax of its rows (blocksize 64: row_bytes / 8 per row), 16 B a copy
      constexpr int kPerRow = kPieceBytes / 8 / 16;
      for (int c = lane; c < kRows * kPerRow; c += 32) {
        const int r = c / kPerRow, o = c % kPerRow;
        copy16<kPrefetch>(ring_s + stage * kStageStride + kStageBytes + c * 16,
                          scales + (tile * kRows + r) * (row_bytes / 8) + piece * (kPieceBytes / 8) + o * 16);
      }
    }
  };
  static_assert(!(kInterleave && kScales == 4), "grouped scales assume a contiguous run");
  for (int q = 0; q < kStages - 1; ++q) {
    if (first + q * kStride < end) issue(first + q * kStride, q);
    commit();
  }
  uint32_t acc = 0;
  for (int64_t q = 0; first + q * kStride < end; ++q) {
    const int64_t ahead = first + (q + kStages - 1) * kStride;
    if (ahead < end) issue(ahead, (q + kStages - 1) % kStages);
    commit();
    wait_pending<kStages - 1>();
    __syncwarp();
    const uint32_t* stage = reinterpret_cast<const uint32_t*>(ring + (q % kStages) * kStageStride);
#pragma unroll
    for (int i = 0; i < kStageBytes / 4 / 32; i += 8) acc ^= stage[i * 32 + lane];
    __syncwarp();
  }
  if (acc == 0x12345678u) sink[0] = acc;
}

__global__ void read_kernel(const uint4* w, int64_t n16, uint32_t* sink) {
  uint32_t acc = 0;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n16; i += int64_t{gridDim.x} * blockDim.x) {
    const uint4 v = __ldcs(w + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) sink[0] = acc;
}

template <typename Launch>
float time_us(Launch launch, int copies) {
  cudaEvent_t a, b;
  cudaEventCreate(&a), cudaEventCreate(&b);
  for (int i = 0; i < copies; ++i) launch(i);
  std::vector<float> ts;
  for (int rep = 0; rep < 15; ++rep) {
    cudaEventRecord(a);
    for (int i = 0; i < copies; ++i) launch(i);
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms;
    cudaEventElapsedTime(&ms, a, b);
    ts.push_back(ms * 1e3f / copies);
  }
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}

// One line of the table: stream_kernel<...> over the weight copies ws (scales ss).
template <int kPieceBytes, int kStages, int kScales, int kPrefetch = 0, int kWarps = 16, bool kInterleave = false>
void run(const std::vector<uint8_t*>& ws, const std::vector<uint8_t*>& ss, int64_t rows, int64_t row_bytes,
         uint32_t* sink, int sms) {
  const int smem = kWarps * (kStages * stage_stride<kPieceBytes>() + kGroupBytes);
  auto k = stream_kernel<kPieceBytes, kStages, kScales, kPrefetch, kWarps, kInterleave>;
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  const float us =
      time_us([&](int i) { k<<<sms, kWarps * 32, smem>>>(ws[i], ss[i], rows, row_bytes, sink); }, ws.size());
  const int64_t bytes = rows * row_bytes + (kScales ? rows * row_bytes / 8 : 0);
  printf("| %lld x %lld | %d warps%s, rows %4d B x %d stages, L2 prefetch %d%s | %6.1f us | %5.0f GB/s | %s |\n",
         (long long)rows, (long long)row_bytes * 2, kWarps, kInterleave ? " taking turns" : "", kPieceBytes, kStages,
         kPrefetch,
         kScales == 4 ? " + scales, 4 units per copy" : (kScales ? " + scales" : ""), us, bytes / us / 1e3,
         cudaGetErrorString(cudaGetLastError()));
}

int main() {
  int sms;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  uint32_t* sink;
  cudaMalloc(&sink, 4);
  const int64_t shapes[][2] = {{28672, 8192}, {8192, 28672}, {8192, 8192}};
  for (const auto& shape : shapes) {
    const int64_t rows = shape[0], row_bytes = shape[1] / 2;
    const int64_t bytes = rows * row_bytes;
    const int copies = static_cast<int>(std::max<int64_t>(2, 400000000 / bytes));
    std::vector<uint8_t*> ws(copies), ss(copies);
    for (auto& w : ws) cudaMalloc(&w, bytes), cudaMemset(w, 1, bytes);
    for (auto& sc : ss) cudaMalloc(&sc, bytes / 8), cudaMemset(sc, 1, bytes / 8);
    const auto read = [&](int i) { read_kernel<<<sms * 8, 256>>>(reinterpret_cast<uint4*>(ws[i]), bytes / 16, sink); };
    const float us = time_us(read, copies);
    printf("| %lld x %lld | coalesced read | %6.1f us | %5.0f GB/s | |\n", (long long)rows, (long long)shape[1], us,
           bytes / us / 1e3);
    run<128, 2, 0>(ws, ss, rows, row_bytes, sink, sms);
    run<128, 2, 1>(ws, ss, rows, row_bytes, sink, sms);
    run<128, 2, 0, 0, 16, true>(ws, ss, rows, row_bytes, sink, sms);  // the CTA's warps take turns
    run<128, 2, 1, 0, 16, true>(ws, ss, rows, row_bytes, sink, sms);
    run<128, 3, 1, 0, 16, true>(ws, ss, rows, row_bytes, sink, sms);
    run<128, 2, 1, 256>(ws, ss, rows, row_bytes, sink, sms);
    run<128, 2, 4>(ws, ss, rows, row_bytes, sink, sms);
    run<256, 2, 1>(ws, ss, rows, row_bytes, sink, sms);
    run<256, 2, 1, 0, 16, true>(ws, ss, rows, row_bytes, sink, sms);
    run<1024, 2, 1, 0, 4>(ws, ss, rows, row_bytes, sink, sms);  // 1 KB per row per request (8 turns)
    run<1024, 2, 1, 0, 5>(ws, ss, rows, row_bytes, sink, sms);
    run<512, 2, 1, 0, 8>(ws, ss, rows, row_bytes, sink, sms);
    for (auto& w : ws) cudaFree(w);
    for (auto& sc : ss) cudaFree(sc);
  }
  return 0;
}
