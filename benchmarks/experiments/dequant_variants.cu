// Experiment behind benchmarks/NOTES.md, dequantize row 5 (not product code; the kernel it chose lives in
// csrc/dequantize.cu). Standalone, no torch: variants of the dequantize kernel (bf16 out, NF4, blocksize 64,
// plain and nested absmax) at the paper layers' sizes, timed like bench_kernels.py (a CUDA graph cycling
// through enough input copies to exceed L2, median of 25 replays), beside three floors of the same sizes:
// a device memcpy of the same bytes, a write-only fill of the output, and a kernel that reads 4 bytes and
// writes 16 with no decode. Each variant's output is compared bit for bit with the first variant's.
//   nvcc -O3 -arch=sm_90 -std=c++17 -o /tmp/dequant_variants benchmarks/experiments/dequant_variants.cu
//   /tmp/dequant_variants [number of shapes]
// Variant names: w<packed words per lane> u<items per lane> shfl|lane (stores made contiguous per warp by
// shuffles, or each lane's units contiguous) cap<CTAs per SM the grid is capped at; 0 = one pass> st<store
// policy: 0 plain, 1 st.global.cs, 2 L1::no_allocate>.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#define CK(x)                                                                   \
  do {                                                                          \
    cudaError_t e = (x);                                                        \
    if (e != cudaSuccess) {                                                     \
      printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e), __FILE__, __LINE__); \
      exit(1);                                                                  \
    }                                                                           \
  } while (0)

__constant__ float kNf4[16] = {-1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
                               -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
                               0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f,
                               0.33791524171829224f, 0.44070982933044434f, 0.5626170039176941f,
                               0.7229568362236023f, 1.0f};

struct Scales {
  const float* absmax;
  const uint8_t* codes;
  const float* code2;
  const float* absmax2;
  const float* offset;
  __device__ __forceinline__ float at(int64_t b) const {
    if (absmax) return __ldg(absmax + b);
    return __fadd_rn(__fmul_rn(__ldg(code2 + __ldg(codes + b)), __ldg(absmax2 + (b >> 8))), __ldg(offset));
  }
};

__device__ __forceinline__ void store16(uint4* p, uint4 v, int policy) {
  if (policy == 1) {
    __stcs(p, v);
  } else if (policy == 2) {
    asm volatile("st.global.L1::no_allocate.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
                 "r"(v.w));
  } else {
    *p = v;
  }
}

__device__ __forceinline__ uint4 decode_word(uint32_t w, const float* table, float s) {
  alignas(16) __nv_bfloat16 v[8];
#pragma unroll
  for (int byte = 0; byte < 4; ++byte) {
    uint32_t b = (w >> (8 * byte)) & 0xFF;
    v[2 * byte] = __float2bfloat16_rn(__fmul_rn(table[b >> 4], s));
    v[2 * byte + 1] = __float2bfloat16_rn(__fmul_rn(table[b & 15], s));
  }
  return *reinterpret_cast<uint4*>(v);
}

// kWords packed 4-byte words per lane per item (1, 2, 4). Item i of the warp covers 32*kWords words.
// Store j of an item: lane l writes 16-byte unit 32*j + l of the item (contiguous warp stores) when
// kShuffle, else lane l writes units kWords*l .. kWords*l + kWords-1 (each lane contiguous).
template <int kWords, int kUnroll, bool kShuffle>
__global__ void __launch_bounds__(256) dq_kernel(const uint32_t* __restrict__ packed, Scales scales, int64_t items,
                                                 __nv_bfloat16* __restrict__ out, int policy) {
  __shared__ float table[16];
  if (threadIdx.x < 16) table[threadIdx.x] = kNf4[threadIdx.x];
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t warps = (int64_t(gridDim.x) * blockDim.x) >> 5;
  // warp item = 32*kWords words; lane item granularity for tail: process whole warp items only (sizes here
  // are multiples)
  for (int64_t first = warp; first < items; first += warps * kUnroll) {
    uint32_t w[kUnroll][kWords];
    float sc[kUnroll][kWords];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t item = first + u * warps;
      if (item < items) {
        const uint32_t* base = packed + item * 32 * kWords;
        if constexpr (kWords == 1) {
          w[u][0] = __ldg(base + lane);
        } else if constexpr (kWords == 2) {
          uint2 v = __ldg(reinterpret_cast<const uint2*>(base) + lane);
          w[u][0] = v.x;
          w[u][1] = v.y;
        } else {
          uint4 v = __ldg(reinterpret_cast<const uint4*>(base) + lane);
          w[u][0] = v.x;
          w[u][1] = v.y;
          w[u][2] = v.z;
          w[u][3] = v.w;
        }
        // word index within tensor of lane's word j: item*32*kWords + lane*kWords + j ; 8 elements per word
#pragma unroll
        for (int j = 0; j < kWords; ++j) {
          const int64_t word = kShuffle ? item * 32 * kWords + 32 * j + lane : item * 32 * kWords + lane * kWords + j;
          sc[u][j] = scales.at(word >> 3);  // blocksize 64 = 8 words
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t item = first + u * warps;
      if (item < items) {
        uint4* obase = reinterpret_cast<uint4*>(out) + item * 32 * kWords;
#pragma unroll
        for (int j = 0; j < kWords; ++j) {
          uint32_t word;
          if constexpr (kShuffle && kWords > 1) {
            // unit 32*j + lane is word (32*j+lane) of the item: lane (32j+lane)/kWords, index (32j+lane)%kWords
            const int src = (32 * j + lane) / kWords;
            const int idx = lane % kWords;  // (32j + lane) % kWords == lane % kWords
            uint32_t picked = 0;
#pragma unroll
            for (int q = 0; q < kWords; ++q) {
              uint32_t v = __shfl_sync(0xffffffffu, w[u][q], src);
              picked = (q == idx) ? v : picked;
            }
            word = picked;
          } else {
            word = w[u][j];
          }
          const int unit = kShuffle ? 32 * j + lane : kWords * lane + j;
          store16(obase + unit, decode_word(word, table, sc[u][j]), policy);
        }
      }
    }
  }
}

// Floors: read 4 bytes, write 16 (the same traffic as dequantize, no decode).
__global__ void __launch_bounds__(256) expand_kernel(const uint32_t* __restrict__ in, int64_t words, uint4* out) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < words; i += stride * 4) {
    uint32_t v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) v[u] = i + u * stride < words ? __ldg(in + i + u * stride) : 0;
#pragma unroll
    for (int u = 0; u < 4; ++u)
      if (i + u * stride < words) out[i + u * stride] = make_uint4(v[u], v[u] ^ 1, v[u] ^ 2, v[u] ^ 3);
  }
}

__global__ void fill_kernel(uint4* out, int64_t units) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < units; i += stride)
    out[i] = make_uint4(1, 2, 3, 4);
}

static float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Time of one call: a graph of `calls` launches (call i uses input copy i % copies), replayed 25 times.
static float time_us(const std::function<void(int, cudaStream_t)>& launch, int calls) {
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (int i = 0; i < calls; ++i) launch(i, s);
  CK(cudaStreamSynchronize(s));
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < calls; ++i) launch(i, s);
  CK(cudaStreamEndCapture(s, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  CK(cudaGraphLaunch(ge, s));
  CK(cudaStreamSynchronize(s));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<float> ts;
  for (int r = 0; r < 25; ++r) {
    CK(cudaEventRecord(a, s));
    CK(cudaGraphLaunch(ge, s));
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    ts.push_back(ms * 1e3f / calls);
  }
  CK(cudaGraphExecDestroy(ge));
  CK(cudaGraphDestroy(g));
  CK(cudaStreamDestroy(s));
  return median(ts);
}

struct Variant {
  std::string name;
  std::function<void(const uint32_t*, Scales, int64_t, __nv_bfloat16*, int, int, cudaStream_t)> run;
  int words;
};

template <int W, int U, bool S>
static Variant make(int cap_per_sm, int policy, int sms) {
  Variant v;
  char buf[128];
  snprintf(buf, sizeof buf, "w%d u%d %s cap%d st%d", W, U, S ? "shfl" : "lane", cap_per_sm, policy);
  v.name = buf;
  v.words = W;
  v.run = [=](const uint32_t* p, Scales sc, int64_t total_words, __nv_bfloat16* o, int, int, cudaStream_t s) {
    const int64_t items = total_words / (32 * W);
    const int64_t warps_needed = (items + U - 1) / U;
    int64_t blocks = (warps_needed + 7) / 8;
    if (cap_per_sm > 0) blocks = std::min<int64_t>(blocks, int64_t(sms) * cap_per_sm);
    dq_kernel<W, U, S><<<int(std::max<int64_t>(blocks, 1)), 256, 0, s>>>(p, sc, items, o, policy);
  };
  return v;
}

int main(int argc, char** argv) {
  int sms;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  printf("GPU %s, %d SMs, L2 %d MB\n", prop.name, sms, prop.l2CacheSize >> 20);
  struct Shape {
    const char* name;
    int64_t n, k;
  };
  std::vector<Shape> shapes = {{"qwen kv", 1024, 5120},       {"llama kv", 1024, 8192}, {"gemma kv", 2048, 5376},
                               {"gemma q", 4096, 5376},       {"qwen q", 8192, 5120},   {"llama q", 8192, 8192},
                               {"gemma gate", 21504, 5376},   {"llama gate", 28672, 8192}};
  if (argc > 1) shapes.resize(std::min<size_t>(shapes.size(), size_t(atoi(argv[1]))));

  std::vector<Variant> variants = {
      make<1, 4, false>(32, 0, sms),  // = the shipped kernel's shape (warp-major here)
      make<1, 4, false>(8, 0, sms),   make<1, 4, false>(16, 0, sms), make<1, 4, false>(0, 0, sms),
      make<1, 2, false>(0, 0, sms),   make<1, 8, false>(32, 0, sms), make<1, 4, false>(32, 1, sms),
      make<1, 4, false>(32, 2, sms),  make<2, 2, true>(32, 0, sms),  make<2, 2, false>(32, 0, sms),
      make<2, 4, true>(32, 0, sms),   make<2, 1, true>(0, 0, sms),   make<4, 1, true>(0, 0, sms),
      make<4, 2, true>(32, 0, sms),   make<4, 1, false>(0, 0, sms),  make<2, 2, true>(0, 1, sms),
  };

  for (const Shape& sh : shapes) {
    const int64_t numel = sh.n * sh.k;
    const int64_t words = numel / 8;
    const int64_t blocks = numel / 64;
    const double bytes_plain = numel * 2.0 + numel / 2.0 + blocks * 4.0;
    const double bytes_nested = numel * 2.0 + numel / 2.0 + blocks * 1.0;
    const double per_call = bytes_plain;
    const int copies = std::max(2, std::min(16, int((3.0 * 60 * (1 << 20) + per_call - 1) / per_call)));
    std::vector<uint32_t*> packed(copies);
    std::vector<float*> absmax(copies);
    std::vector<uint8_t*> codes(copies);
    float *code2, *absmax2, *offset;
    for (int c = 0; c < copies; ++c) {
      CK(cudaMalloc(&packed[c], words * 4));
      CK(cudaMalloc(&absmax[c], blocks * 4));
      CK(cudaMalloc(&codes[c], blocks));
      std::vector<uint32_t> hw(words);
      uint32_t x = 12345 + c;
      for (auto& v : hw) v = (x = x * 1664525u + 1013904223u);
      CK(cudaMemcpy(packed[c], hw.data(), words * 4, cudaMemcpyHostToDevice));
      std::vector<float> ha(blocks);
      for (auto& v : ha) v = 0.5f + ((x = x * 1664525u + 1013904223u) >> 8) / float(1 << 24);
      CK(cudaMemcpy(absmax[c], ha.data(), blocks * 4, cudaMemcpyHostToDevice));
      std::vector<uint8_t> hc(blocks);
      for (auto& v : hc) v = (x = x * 1664525u + 1013904223u) >> 24;
      CK(cudaMemcpy(codes[c], hc.data(), blocks, cudaMemcpyHostToDevice));
    }
    CK(cudaMalloc(&code2, 256 * 4));
    CK(cudaMalloc(&absmax2, (blocks / 256 + 1) * 4));
    CK(cudaMalloc(&offset, 4));
    {
      std::vector<float> h(256);
      for (int i = 0; i < 256; ++i) h[i] = (i - 128) / 128.0f;
      CK(cudaMemcpy(code2, h.data(), 256 * 4, cudaMemcpyHostToDevice));
      std::vector<float> h2(blocks / 256 + 1, 0.75f);
      CK(cudaMemcpy(absmax2, h2.data(), h2.size() * 4, cudaMemcpyHostToDevice));
      float o = 0.1f;
      CK(cudaMemcpy(offset, &o, 4, cudaMemcpyHostToDevice));
    }
    __nv_bfloat16 *out, *ref;
    CK(cudaMalloc(&out, numel * 2));
    CK(cudaMalloc(&ref, numel * 2));
    uint8_t* big;  // copy floor: half in, half out, same total bytes as dequantize plain
    const int64_t half = int64_t(bytes_plain / 2) / 16 * 16;
    CK(cudaMalloc(&big, half * 2));
    const int calls = copies * 2;

    printf("\n%s %lldx%lld: %.1f MB per call, %d copies\n", sh.name, (long long)sh.n, (long long)sh.k,
           bytes_plain / 1e6, copies);
    auto report = [&](const char* what, float us, double bytes) {
      printf("  %-28s %8.2f us %7.0f GB/s\n", what, us, bytes / us / 1e3);
    };
    report("memcpy same bytes", time_us([&](int, cudaStream_t s) { cudaMemcpyAsync(big + half, big, half, cudaMemcpyDeviceToDevice, s); }, calls), bytes_plain);
    report("fill out (write only)", time_us([&](int, cudaStream_t s) { fill_kernel<<<sms * 8, 256, 0, s>>>((uint4*)out, numel / 8); }, calls), numel * 2.0);
    report("memset out", time_us([&](int, cudaStream_t s) { cudaMemsetAsync(out, 0, numel * 2, s); }, calls), numel * 2.0);
    report("expand 4->16 (no decode)", time_us([&](int i, cudaStream_t s) { expand_kernel<<<std::min<int64_t>(sms * 32, (words / 4 + 255) / 256), 256, 0, s>>>(packed[i % copies], words, (uint4*)out); }, calls), bytes_plain);

    for (int nested = 0; nested < 2; ++nested) {
      for (size_t vi = 0; vi < variants.size(); ++vi) {
        const Variant& v = variants[vi];
        auto scales_for = [&](int c) {
          return nested ? Scales{nullptr, codes[c], code2, absmax2, offset} : Scales{absmax[c], nullptr, nullptr, nullptr, nullptr};
        };
        // correctness vs variant 0
        __nv_bfloat16* dst = vi == 0 ? ref : out;
        CK(cudaMemset(dst, 0xff, numel * 2));
        v.run(packed[0], scales_for(0), words, dst, 0, 0, 0);
        CK(cudaDeviceSynchronize());
        bool same = true;
        if (vi > 0) {
          std::vector<uint16_t> a(numel), b(numel);
          CK(cudaMemcpy(a.data(), ref, numel * 2, cudaMemcpyDeviceToHost));
          CK(cudaMemcpy(b.data(), out, numel * 2, cudaMemcpyDeviceToHost));
          same = memcmp(a.data(), b.data(), numel * 2) == 0;
        }
        float us = time_us([&](int i, cudaStream_t s) { v.run(packed[i % copies], scales_for(i % copies), words, out, 0, 0, s); }, calls);
        char label[160];
        snprintf(label, sizeof label, "%s %s%s", nested ? "nested" : "plain ", v.name.c_str(), same ? "" : " MISMATCH");
        report(label, us, nested ? bytes_nested : bytes_plain);
      }
    }
    for (int c = 0; c < copies; ++c) {
      cudaFree(packed[c]);
      cudaFree(absmax[c]);
      cudaFree(codes[c]);
    }
    cudaFree(code2);
    cudaFree(absmax2);
    cudaFree(offset);
    cudaFree(out);
    cudaFree(ref);
    cudaFree(big);
  }
  return 0;
}
