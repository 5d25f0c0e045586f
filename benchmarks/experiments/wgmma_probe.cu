// (experiment, NOTES gemv row 98; not part of the package) Is a warpgroup kernel faster at 4-16 rows of x?
// The tree's tensor-core kernel (csrc/gemv.cu) gives each warp a 16-row W tile, loads x's mma fragments from
// L1/L2 into registers (8 KB of x per 2 KB of weights at 16 rows) and issues two mma.sync per k-tile. Here a
// warpgroup (4 warps) takes a 64-row tile: each warp decodes its 16 rows exactly as the tree does (its stage ring,
// the byte -> code pair table, the permuted k order), and one wgmma m64n16k16 per k-tile, with A (the decoded
// weights) from registers and B (x) from a shared-memory stage that the warpgroup fills once per turn: a quarter
// of the x traffic per weight byte, no x in registers, half the mma instructions.
// Plain fp32 absmax at blocksize 64, bf16 x, K % 256 == 0, N % 64 == 0, 1-16 rows of x. Partial tiles are added
// with fp32 atomics into a zeroed fp32 output (a probe: neither deterministic nor rounded to bf16).
// Built by benchmarks/experiments/wgmma_probe.py with torch.utils.cpp_extension for sm_90a.
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include "code_pair_table.cuh"
#include "mma_sync.cuh"

namespace {
using nf4::QuantType;
using bf16 = __nv_bfloat16;

#ifndef WG_GROUPS
#define WG_GROUPS 4  // warpgroups per CTA
#endif
#ifndef WG_PIPE
#define WG_PIPE 0  // 1: a step's wgmmas overlap the next step's decode (wait for all but the newest group)
#endif
constexpr int kWarpgroups = WG_GROUPS;
constexpr int kThreads = kWarpgroups * 128;
constexpr int kTileRows = 64;           // W rows per warpgroup tile (wgmma's M)
constexpr int kTurn = 256;              // K elements per turn: 4 steps of 64 (one absmax block each)
constexpr int kWStageBytes = 16 * 128 + 16 * 16;  // a warp's 16 rows x 128 packed bytes, then 4 scales per row
constexpr int kXStageBytes = 16 * kTurn * 2;       // 16 rows of x x 256 bf16, in wgmma's core-matrix layout
constexpr int kSharedBytes = nf4::kCodePairTableBytes + kWarpgroups * 4 * 2 * kWStageBytes + kWarpgroups * 2 * kXStageBytes;

#ifndef WG_LBO
#define WG_LBO 128  // bytes between the two core matrices of a k-tile along K
#endif
#ifndef WG_SBO
#define WG_SBO 256  // bytes between the two core matrices along N (x rows 0-7, 8-15)
#endif

__device__ __forceinline__ uint64_t x_descriptor(uint32_t address) {
  return uint64_t((address & 0x3FFFF) >> 4) | uint64_t(WG_LBO >> 4) << 16 | uint64_t(WG_SBO >> 4) << 32;
}

// x element e (0..63) of a step sits, in the permuted k order of csrc/gemv.cu, at k-tile j = (e % 16) / 4, lane
// t = e / 16, half h = (e % 4) / 2 (logical k 8h + 2t + e % 2). Its byte in the stage of that step's k-tile j:
// 512 j + 256 (n / 8) + 128 h + 16 (n % 8) + 4 t + 2 (e % 2).
__device__ __forceinline__ uint32_t x_word_offset(int u, int j, int n, int h, int t) {
  return (u * 4 + j) * 512 + (n >> 3) * WG_SBO + h * WG_LBO + (n & 7) * 16 + t * 4;
}

__device__ __forceinline__ uint32_t code_pair(uint32_t lut, uint32_t word, uint32_t byte, uint32_t lane4) {
  uint32_t pair;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(pair) : "r"(lut + nf4::code_pair_offset(word, byte, lane4)));
  return pair;
}

__device__ __forceinline__ void wgmma_16(float (&d)[8], const uint32_t (&a)[4], uint64_t desc, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate));
}

__device__ __forceinline__ void named_barrier(int id) { asm volatile("bar.sync %0, 128;" ::"r"(id) : "memory"); }

__global__ void __launch_bounds__(kThreads, 1)
wg_gemv_kernel(const bf16* __restrict__ x, int x_rows, const uint8_t* __restrict__ packed,
               const float* __restrict__ absmax, int64_t rows, int64_t cols, float* __restrict__ out) {
  extern __shared__ __align__(1024) uint8_t smem[];
  uint8_t* lut = smem;
  nf4::fill_code_pair_table<bf16>(lut, QuantType::NF4);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int wg = warp / 4, wr = warp % 4;
  const uint32_t lut_s = static_cast<uint32_t>(__cvta_generic_to_shared(lut)), lane4 = 4 * lane;
  const uint32_t w_ring = lut_s + nf4::kCodePairTableBytes + warp * 2 * kWStageBytes;
  const uint8_t* w_ring_p = smem + nf4::kCodePairTableBytes + warp * 2 * kWStageBytes;
  const uint32_t x_ring = lut_s + nf4::kCodePairTableBytes + kWarpgroups * 4 * 2 * kWStageBytes + wg * 2 * kXStageBytes;
  uint8_t* x_ring_p = smem + nf4::kCodePairTableBytes + kWarpgroups * 4 * 2 * kWStageBytes + wg * 2 * kXStageBytes;
  __syncthreads();

  const int64_t turns = cols / kTurn, tiles = rows / kTileRows, total = tiles * turns;
  const int64_t groups = int64_t{gridDim.x} * kWarpgroups, group = int64_t{blockIdx.x} * kWarpgroups + wg;
  const int64_t first = group * total / groups, count = (group + 1) * total / groups - first;
  if (count <= 0) return;  // the whole warpgroup alike
  int64_t tile = first / turns;
  int s = static_cast<int>(first % turns);

  // W: lane copies 16-byte piece lane % 8 of rows lane / 8 + 4i, swizzled as stage_weight_offset in gemv.cu.
  const auto stage_w = [&](int slot, int64_t tl, int ss) {
    const uint32_t dst = w_ring + slot * kWStageBytes;
    const int64_t row0 = tl * kTileRows + wr * 16;
    const int piece = lane % 8;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = lane / 8 + 4 * i;
      nf4::copy_async<16>(dst + r * 128 + (((piece / 2) ^ (r & 3)) << 5) + 16 * (piece % 2),
                          packed + (row0 + r) * (cols / 2) + ss * 128 + 16 * piece);
    }
    if (lane < 16) nf4::copy_async<16>(dst + 2048 + lane * 16, absmax + ((row0 + lane) * cols + ss * kTurn) / 64);
  };
  // x: thread (lane = 4 rn + tt, combo = 4 wr + i) loads the 16 bytes of x row 8 nb + rn, step u, elements
  // 16 tt + 8 hh .. + 7 (combo = 8 nb + 2 u' ...), and stores their 4 words where the stage wants them: every
  // store instruction covers the 32 (rn, tt) word slots of one core-matrix pair, so no bank conflicts.
  uint4 xr[4];
  const int rn = lane / 4, tt = lane % 4;
  const auto load_x = [&](int ss) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int combo = wr * 4 + i, nb = combo >> 3, u = (combo >> 1) & 3, hh = combo & 1;
      const int n = 8 * nb + rn;
      xr[i] = make_uint4(0, 0, 0, 0);
      if (n < x_rows) xr[i] = __ldg(reinterpret_cast<const uint4*>(x + n * cols + ss * kTurn + u * 64 + 16 * tt + 8 * hh));
    }
  };
  const auto store_x = [&](int slot) {
    uint8_t* stage = x_ring_p + slot * kXStageBytes;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int combo = wr * 4 + i, nb = combo >> 3, u = (combo >> 1) & 3, hh = combo & 1;
      const int n = 8 * nb + rn;
      const uint32_t w4[4] = {xr[i].x, xr[i].y, xr[i].z, xr[i].w};
#pragma unroll
      for (int wi = 0; wi < 4; ++wi) {  // word wi: elements 8 hh + 2 wi, +1 of lane tt's 16: j = 2 hh + wi / 2, h = wi % 2
        *reinterpret_cast<uint32_t*>(stage + x_word_offset(u, 2 * hh + wi / 2, n, wi % 2, tt)) = w4[wi];
      }
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  };

  stage_w(0, tile, s);
  nf4::copy_async_commit();
  load_x(s);
  store_x(0);
  named_barrier(1 + wg);

  float acc[8] = {};
  for (int64_t q = 0; q < count; ++q) {
    const int slot = static_cast<int>(q & 1);
    const bool more = q + 1 < count;
    const int64_t next_tile = s + 1 == turns ? tile + 1 : tile;
    const int next_s = s + 1 == turns ? 0 : s + 1;
    if (more) stage_w(slot ^ 1, next_tile, next_s);
    nf4::copy_async_commit();
    if (more) load_x(next_s);
    nf4::copy_async_wait<1>();
    __syncwarp();
    const uint8_t* stage = w_ring_p + slot * kWStageBytes;
    const float4 sc_lo = *reinterpret_cast<const float4*>(stage + 2048 + g * 16);
    const float4 sc_hi = *reinterpret_cast<const float4*>(stage + 2048 + (g + 8) * 16);
    const float scale_lo[4] = {sc_lo.x, sc_lo.y, sc_lo.z, sc_lo.w}, scale_hi[4] = {sc_hi.x, sc_hi.y, sc_hi.z, sc_hi.w};
    const uint32_t x_stage = x_ring + slot * kXStageBytes;
    float d[2][8];
    const auto add_step = [&](int u) {  // acc += the step's scale x its sums, once its wgmmas are done
      const float* du = d[u & 1];
      acc[0] = fmaf(scale_lo[u], du[0], acc[0]), acc[1] = fmaf(scale_lo[u], du[1], acc[1]);
      acc[2] = fmaf(scale_hi[u], du[2], acc[2]), acc[3] = fmaf(scale_hi[u], du[3], acc[3]);
      acc[4] = fmaf(scale_lo[u], du[4], acc[4]), acc[5] = fmaf(scale_lo[u], du[5], acc[5]);
      acc[6] = fmaf(scale_hi[u], du[6], acc[6]), acc[7] = fmaf(scale_hi[u], du[7], acc[7]);
    };
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const uint2 lo = *reinterpret_cast<const uint2*>(stage + g * 128 + ((u ^ (g & 3)) << 5) + 8 * t);
      const uint2 hi = *reinterpret_cast<const uint2*>(stage + (g + 8) * 128 + ((u ^ (g & 3)) << 5) + 8 * t);
      uint32_t a[4][4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t lw = j < 2 ? lo.x : lo.y, hw = j < 2 ? hi.x : hi.y, b0 = (j % 2) * 2;
        a[j][0] = code_pair(lut_s, lw, b0, lane4), a[j][1] = code_pair(lut_s, hw, b0, lane4);
        a[j][2] = code_pair(lut_s, lw, b0 + 1, lane4), a[j][3] = code_pair(lut_s, hw, b0 + 1, lane4);
      }
      asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
      for (int j = 0; j < 4; ++j) wgmma_16(d[u & 1], a[j], x_descriptor(x_stage + (u * 4 + j) * 512), j);
      asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
      if (WG_PIPE) {
        if (u > 0) {
          asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
          add_step(u - 1);
        }
      } else {
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
        add_step(u);
      }
    }
    if (WG_PIPE) {
      asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
      add_step(3);
    }
    if (s + 1 == turns || !more) {
      // d[4 c + 2 h + e]: W row 16 wr + g + 8 h, x row 8 c + 2 t + e
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int m = 8 * (i / 4) + 2 * t + (i % 2);
        const int64_t n = tile * kTileRows + 16 * wr + g + 8 * ((i / 2) % 2);
        if (m < x_rows) atomicAdd(out + m * rows + n, acc[i]);
        acc[i] = 0.0f;
      }
    }
    __syncwarp();
    if (more) store_x(slot ^ 1);
    named_barrier(1 + wg);
    tile = next_tile, s = next_s;
  }
}
}  // namespace

// Adds x @ W.T into `out` (fp32 [x rows, rows]): the caller zeroes it for a result; timing calls skip that.
void wg_gemv_add(torch::Tensor x, torch::Tensor packed, torch::Tensor absmax, int64_t rows, int64_t cols,
                 torch::Tensor out) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(1) == cols && x.size(0) <= 16);
  TORCH_CHECK(cols % kTurn == 0 && rows % kTileRows == 0 && absmax.scalar_type() == at::kFloat);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.size(0) == x.size(0) && out.size(1) == rows);
  static bool configured = false;
  if (!configured) {
    TORCH_CHECK(cudaFuncSetAttribute(wg_gemv_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSharedBytes) ==
                cudaSuccess);
    configured = true;
  }
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, x.device().index());
  wg_gemv_kernel<<<sms, kThreads, kSharedBytes, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const bf16*>(x.data_ptr()), static_cast<int>(x.size(0)), packed.data_ptr<uint8_t>(),
      absmax.data_ptr<float>(), rows, cols, out.data_ptr<float>());
  TORCH_CHECK(cudaGetLastError() == cudaSuccess);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("wg_gemv_add", &wg_gemv_add); }
