// nf4::gemv on CUDA for more rows of fp16 / bf16 x than the tensor-core kernel takes in one launch
// (kTensorCoreGemvLaunchRows): the many-rows kernel, which decodes each weight once per 32 rows of x.
//
// Why a kernel of its own: the tensor-core kernel (csrc/gemv.cu) decodes W for at most 16 rows of x, so more rows
// took one launch per 16 rows, each decoding and reading all of W again, or W was dequantized to a 16-bit temporary
// for cuBLAS (written and read again: on Llama's gate/up 4x the packed bytes).
//
// Layout. A tile is 128 W rows by 32 x rows over all of K, in steps of 64 elements (one absmax block per row); a CTA's
// 4 warps take 32 W rows each (two mma m-tiles) by the 32 x rows (four mma n-tiles). Each x tile's steps over all W
// tiles, laid end to end, are cut into runs, one per CTA of that x tile's share of the resident CTAs (stream-K:
// run_begin), so every SM gets the same work whatever the layer's tile count. Each step the CTA copies the tile's
// packed bytes and x rows into a ring of kMrStages stages with cp.async (three steps in flight, across tile ends), and
// each warp decodes its own W rows from the stage straight into mma A fragments (one lookup per packed byte in the code
// pair table), reads the x rows with ldmatrix (16-byte XOR swizzle, no bank conflicts) and multiplies on mma.sync; each
// step's fp32 sums are scaled by the rows' absmax and added, as in the tensor-core kernel. A tile that one CTA finished
// is written with its bias; the parts of a tile shared by two or more runs go to an fp32 buffer, which a second kernel
// adds in run order, so every call gives the same bits (the runs depend on the x tiles too, so a row's bits may differ
// between calls of different row counts: no such equality is promised). Earlier
// versions, which decoded W into shared memory for ldmatrix or with byte-permute arithmetic, were 1.3-2.3x slower, and
// one with a grid of tiles (K split only where the tiles left half the CTAs idle) and two CTAs per SM was up to ~1.5x
// slower (benchmarks/NOTES.md, gemv rows 63-64).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <atomic>
#include <type_traits>

#include "code_pair_table.cuh"
#include "cuda_types.cuh"
#include "launch_cache.h"
#include "mma_sync.cuh"
#include "ops.h"

namespace nf4 {
namespace {

constexpr int kMrWarpsN = 4;                          // warps along W's rows
constexpr int kMrWarpRows = 32;                       // W rows per warp: two mma m-tiles of 16
constexpr int kMrTileRows = kMrWarpsN * kMrWarpRows;  // W rows per tile
constexpr int kMrStep = 64;                           // K elements per step: 4 mma k-tiles, one absmax block
constexpr int kMrStepBytes = kMrStep / 2;             // packed bytes of a row's step
constexpr int kMrRowBytes = kMrStep * 2;              // an x row's step: 8 chunks of 16 bytes
constexpr int kMrStages = 4;                          // cp.async ring: the step multiplied, three more in flight
constexpr int kMrMinStepsPerCta = 8;                  // the shortest run of steps worth a CTA
constexpr int kMrXTileRows = kManyRowsXTileRows;      // x rows per tile: four mma n-tiles of 8 (ops.h)
constexpr int kMrThreads = kMrWarpsN * 32;
constexpr int kMrNTiles = kMrXTileRows / 8;
constexpr int kMrTileOutputs = kMrXTileRows * kMrTileRows;  // a tile's sums, as one part in the partial buffer
constexpr int kMrPackedBytes = kMrTileRows * kMrStepBytes;  // a stage: W's packed bytes, then x
constexpr int kMrXBytes = kMrXTileRows * kMrRowBytes;
constexpr int kMrStageBytes = kMrPackedBytes + kMrXBytes;
static_assert(kMrPackedBytes % (16 * kMrThreads) == 0 && kMrXBytes % (16 * kMrThreads) == 0, "whole 16-byte copies");

// CTAs per SM the kernel is built for (launch bounds: its registers). 3 (170 registers each, which the shared
// memory allows) was 8-20% slower than 2 on an H100 (benchmarks/NOTES.md gemv row 64). A tuning build may set it
// with -DNF4_MR_CTAS_PER_SM=n.
#ifndef NF4_MR_CTAS_PER_SM
#define NF4_MR_CTAS_PER_SM 2
#endif
constexpr int kMrCtasPerSm = NF4_MR_CTAS_PER_SM;

// Shared memory: the code pair table (csrc/code_pair_table.cuh), whose entries' unused last 128 bytes hold the
// ring of stages, then (nested) the 256-entry code map: 65 KB (a separate ring would make it 97 KB), which leaves
// the SM's L1 ~95 KB at two CTAs. Ring byte L (stage s at L = s * kMrStageBytes: the tile's packed bytes, then its x
// rows) lies in the second half of table entry L / 128; 16-byte pieces never straddle two halves, and a byte's
// bank is the same as in a plain layout (L % 128 / 4).
static_assert(kMrStages * kMrStageBytes <= 256 * (kCodePairEntryBytes - 128) && kMrStageBytes % 128 == 0,
              "the ring fills the table entries' second halves in whole 128-byte pieces");
constexpr int kMrSharedBytes = kCodePairTableBytes + 256 * 4;

__host__ __device__ constexpr uint32_t ring_offset(uint32_t linear) {
  return linear / 128 * kCodePairEntryBytes + 128 + linear % 128;
}

// Ring offset of stage `stage`'s byte `linear` (within the stage).
__device__ __forceinline__ uint32_t stage_offset(int stage, uint32_t linear) {
  return static_cast<uint32_t>(stage) * (kMrStageBytes / 128 * kCodePairEntryBytes) + ring_offset(linear);
}

// Offset in a stage (before ring_offset) of 16-byte chunk `chunk` (0..7) of the x tile's 128-byte row `row`:
// the chunks are XOR-swizzled so that ldmatrix's 8 rows of a matrix fall in 8 different bank groups.
__host__ __device__ constexpr uint32_t x_chunk(int row, int chunk) {
  return static_cast<uint32_t>(kMrPackedBytes + row * kMrRowBytes + ((chunk ^ (row & 7)) << 4));
}

// The work of each x tile (32 rows) is units, unit = W tile n * steps + K step, and the CTAs are m_tiles groups of
// `runs`: CTA c takes x tile m = c % m_tiles and, of its units, [run_begin(r), run_begin(r + 1)) for r = c / m_tiles,
// whatever W tiles they fall in (stream-K), so every CTA has the same number of steps however the tiles fill the
// GPU's slots, and the CTAs of the m tiles read the same W bytes at about the same time (all but the first find
// them in L2).
// (Both divide in 32 bits where the dividend fits, as it does but for the largest layers: a 64-bit division is
// ~10x the instructions, and it made the parts-adding kernel issue-bound: NOTES gemv row 64.)
__host__ __device__ __forceinline__ int64_t divide(uint64_t dividend, int64_t divisor) {
  return dividend <= UINT32_MAX ? static_cast<uint32_t>(dividend) / static_cast<uint32_t>(divisor)
                                : static_cast<int64_t>(dividend / static_cast<uint64_t>(divisor));
}
__host__ __device__ __forceinline__ int64_t run_begin(int64_t run, int64_t units, int64_t runs) {
  return divide(static_cast<uint64_t>(run) * units, runs);
}
// The run that holds `unit`.
__host__ __device__ __forceinline__ int64_t run_of(int64_t unit, int64_t units, int64_t runs) {
  return divide(static_cast<uint64_t>(unit + 1) * runs - 1, units);
}

// A place in a run: a step of W tile n_tile. advance() moves to the next unit.
struct UnitCursor {
  int step, n_tile;

  __device__ __forceinline__ void advance(int steps) {
    if (++step == steps) step = 0, ++n_tile;
  }
};

// What a lane loads ahead for one of its rows' scale of a step: the fp32 absmax, or (nested) the uint8 code and the
// nested absmax value it is relative to.
struct RawScale {
  float value;
  uint32_t code;
};

// A tile finished by one CTA is written to `out` (with the bias); one that a CTA finished only part of (its run's
// first or last tile) goes to the partial buffer, parts [2 c] (the run's first tile) and [2 c + 1] (its last), for
// add_run_parts_kernel. `units` counts one x tile's units (n tiles x steps).
template <typename T, bool kNested>
__global__ void __launch_bounds__(kMrThreads, kMrCtasPerSm)
    many_rows_gemv_kernel(const T* __restrict__ x, const uint8_t* __restrict__ packed, BlockScales scales,
                          QuantType quant_type, int blocksize_log2, int64_t rows, int64_t cols, int x_rows,
                          int m_tiles, int units, const T* __restrict__ bias, T* __restrict__ out,
                          float* __restrict__ partial) {
  constexpr int kThreads = kMrThreads, kNTiles = kMrNTiles;
  // fp32 x's split operands would fill the table entries' second halves, where the ring is.
  static_assert(!MmaOperand<T>::kSplit, "fp16 / bf16 x only");
  extern __shared__ __align__(128) uint8_t mr_shared[];
  const uint32_t ring = static_cast<uint32_t>(__cvta_generic_to_shared(mr_shared));
  float* code2 = reinterpret_cast<float*>(mr_shared + kCodePairTableBytes);

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int g = lane / 4, t = lane % 4;
  const int steps = static_cast<int>(cols / kMrStep);
  const int m_tile = blockIdx.x % m_tiles, run = blockIdx.x / m_tiles, runs = gridDim.x / m_tiles;
  const int begin = static_cast<int>(run_begin(run, units, runs));
  const int count = static_cast<int>(run_begin(run + 1, units, runs)) - begin;  // >= 1 (the host's rule)
  const int64_t row_bytes = cols / 2;
  // The run's places: of the next copies, of the next scale loads, and of the step being multiplied.
  UnitCursor copy_at = {begin % steps, begin / steps}, scale_at = copy_at, now_at = copy_at;

  let_next_kernel_start();
  fill_code_pair_table<T>(mr_shared, quant_type);  // no global memory: before the wait
  wait_for_previous_kernels();
  float nested_offset = 0.0f;
  if constexpr (kNested) {
    for (int i = tid; i < 256; i += kThreads) code2[i] = scales.code2[i];
    nested_offset = *scales.offset;
  }

  // The run's step j (called for j = 0, 1, 2, ... in turn) into stage j % kMrStages: thread tid copies W pieces
  // tid and tid + 128 (16 bytes at (tid % 2) * 16 of tile rows tid / 2 and tid / 2 + 64; rows past W's end copy
  // nothing: zeros) and x pieces tid and tid + 128 (chunk tid % 8 of x rows tid / 8 and tid / 8 + 16; zeros past
  // x's end). The sources move on by a step's bytes each call and are set afresh at each tile's first step. Every
  // call commits a group, an empty one past the run's end, so that the waits count the same.
  constexpr uint32_t kSecondPiece = ring_offset(16 * kMrThreads) - ring_offset(0);  // the same for W and x
  static_assert(ring_offset(x_chunk(kMrXTileRows / 2, 0)) - ring_offset(x_chunk(0, 0)) == kSecondPiece);
  const uint32_t w_dst = ring + ring_offset(tid * 16), x_dst = ring + ring_offset(x_chunk(tid / 8, tid % 8));
  const int64_t w_second = int64_t{kMrTileRows / 2} * row_bytes, x_second = int64_t{kMrXTileRows / 2} * cols;
  const uint8_t* w_src = nullptr;
  const T* x_src = nullptr;
  bool w_there[2], x_there[2];
  const auto aim_copies = [&] {
    const int64_t n = int64_t{copy_at.n_tile} * kMrTileRows + tid / 2;
    const int m = m_tile * kMrXTileRows + tid / 8;
    w_there[0] = n < rows, w_there[1] = n + kMrTileRows / 2 < rows;
    x_there[0] = m < x_rows, x_there[1] = m + kMrXTileRows / 2 < x_rows;
    // (step * kMrStep < cols fits an int: many_rows_gemv_fits)
    w_src = packed + (w_there[0] ? n * row_bytes + (tid % 2) * 16 + copy_at.step * kMrStepBytes : 0);
    x_src = x + (x_there[0] ? int64_t{m} * cols + (tid % 8) * 8 + copy_at.step * kMrStep : 0);
  };
  aim_copies();
  const auto issue = [&](int j) {
    if (j < count) {
      const uint32_t stage = stage_offset(j % kMrStages, 0) - ring_offset(0);
      copy_async<16>(w_dst + stage, w_src, w_there[0] ? 16 : 0);
      copy_async<16>(w_dst + stage + kSecondPiece, w_there[1] ? w_src + w_second : packed, w_there[1] ? 16 : 0);
      copy_async<16>(x_dst + stage, x_src, x_there[0] ? 16 : 0);
      copy_async<16>(x_dst + stage + kSecondPiece, x_there[1] ? x_src + x_second : x, x_there[1] ? 16 : 0);
      copy_at.advance(steps);
      if (copy_at.step == 0) {
        aim_copies();
      } else {
        w_src += w_there[0] ? kMrStepBytes : 0, x_src += x_there[0] ? kMrStep : 0;
      }
    }
    copy_async_commit();
  };

  // The lane's W rows: of m-tile mt, tile rows 16 mt + g (its A fragment's rows 0-7) and 16 mt + g + 8 (8-15).
  const auto lane_row = [&](int mt, int h) { return warp * kMrWarpRows + 16 * mt + g + 8 * h; };
  // The scales of the run's step j (called for j = 0, 1, 2, ... in turn; zeros past the run's end). Row n's
  // absmax block at a step is (n * cols + step * 64) >> blocksize_log2 = chunk >> (blocksize_log2 - 6), chunk =
  // n * steps + step its 64-element chunk (blocksize >= 64); `scale_chunk` is row lane_row(0, 0)'s, the others
  // 8, 16 and 24 rows on.
  const int chunk_shift = blocksize_log2 - 6;
  int64_t scale_chunk = 0;
  bool scale_there[2][2];
  const auto aim_scales = [&] {
    const int64_t n = int64_t{scale_at.n_tile} * kMrTileRows + lane_row(0, 0);
    scale_chunk = n * steps + scale_at.step;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) scale_there[mt][0] = n + 16 * mt < rows, scale_there[mt][1] = n + 16 * mt + 8 < rows;
  };
  aim_scales();
  const auto load_scales = [&](int j, RawScale (&raw)[2][2]) {
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        raw[mt][h] = RawScale{0.0f, 0};
        if (j < count && scale_there[mt][h]) {
          const int64_t block = (scale_chunk + int64_t{16 * mt + 8 * h} * steps) >> chunk_shift;
          if constexpr (kNested) {
            raw[mt][h].code = __ldg(scales.codes + block);
            raw[mt][h].value = __ldg(scales.absmax2 + (block >> scales.nested_blocksize_log2));
          } else {
            raw[mt][h].value = __ldg(scales.absmax + block);
          }
        }
      }
    }
    if (j < count) {
      scale_at.advance(steps);
      if (scale_at.step == 0) {
        aim_scales();
      } else {
        ++scale_chunk;
      }
    }
  };
  const auto scale_of = [&](const RawScale& raw) -> float {
    if constexpr (kNested) {
      return BlockScales::nested_absmax_value(code2[raw.code], raw.value, nested_offset);
    } else {
      return raw.value;
    }
  };

  // Operand words of k-tile kk for lane (g, t): A[row][2t, 2t + 1] and A[row][2t + 8, 2t + 9] of k-tile kk are
  // packed bytes 8 kk + t and 8 kk + t + 4 of the row's step: byte t of words 2 kk and 2 kk + 1.
  const uint32_t lane4 = 4 * lane;
  const auto lookup = [&](uint32_t word) -> uint32_t {
    return *reinterpret_cast<const uint32_t*>(mr_shared + code_pair_offset(word, t, lane4));
  };
  const int b_row = (lane / 16) * 8 + lane % 8;  // ldmatrix: + 16 p
  const int b_chunk = lane / 8 % 2;              // + 2 kk
  float acc[2][kNTiles][4] = {};
  const auto multiply = [&](int j, const RawScale (&raw)[2][2]) {
    const int stage = j % kMrStages;
    uint32_t a[4][2][4];  // [k-tile][m-tile][A register]
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint4* row =
            reinterpret_cast<const uint4*>(mr_shared + stage_offset(stage, lane_row(mt, h) * kMrStepBytes));
        const uint4 w0 = row[0], w1 = row[1];
        a[0][mt][h] = lookup(w0.x), a[0][mt][2 + h] = lookup(w0.y);
        a[1][mt][h] = lookup(w0.z), a[1][mt][2 + h] = lookup(w0.w);
        a[2][mt][h] = lookup(w1.x), a[2][mt][2 + h] = lookup(w1.y);
        a[3][mt][h] = lookup(w1.z), a[3][mt][2 + h] = lookup(w1.w);
      }
    }
    float sums[2][kNTiles][4] = {};
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
      for (int p = 0; p < kNTiles / 2; ++p) {
        uint32_t b[4];
        load_matrix_x4(ring + stage_offset(stage, x_chunk(b_row + 16 * p, b_chunk + 2 * kk)), b);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          mma_16816<T>(sums[mt][2 * p], a[kk][mt], b[0], b[1], sums[mt][2 * p]);
          mma_16816<T>(sums[mt][2 * p + 1], a[kk][mt], b[2], b[3], sums[mt][2 * p + 1]);
        }
      }
    }
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      const float upper = scale_of(raw[mt][0]), lower = scale_of(raw[mt][1]);  // rows g, g + 8
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
        acc[mt][nt][0] = fmaf(upper, sums[mt][nt][0], acc[mt][nt][0]);
        acc[mt][nt][1] = fmaf(upper, sums[mt][nt][1], acc[mt][nt][1]);
        acc[mt][nt][2] = fmaf(lower, sums[mt][nt][2], acc[mt][nt][2]);
        acc[mt][nt][3] = fmaf(lower, sums[mt][nt][3], acc[mt][nt][3]);
      }
    }
  };

  // The sums of the tile at `at` into `part` (a part of the partial buffer, as [x row][tile row]) or, with
  // part == nullptr, into `out` with the bias; then zeroed for the next tile. Lane (g, t) holds, per m-tile and
  // n-tile, W rows g and g + 8 by x rows 2t and 2t + 1.
  const auto store = [&](const UnitCursor& at, float* part) {
    const int64_t n0 = int64_t{at.n_tile} * kMrTileRows;
    const int m0 = m_tile * kMrXTileRows;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int tile_row = lane_row(mt, h);
        const int64_t n = n0 + tile_row;
        const float bias_n = bias != nullptr && part == nullptr && n < rows ? to_float(bias[n]) : 0.0f;
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int x_row = 8 * nt + 2 * t + c, m = m0 + x_row;
            float& v = acc[mt][nt][2 * h + c];
            if (n < rows && m < x_rows) {
              if (part != nullptr) {
                part[x_row * kMrTileRows + tile_row] = v;
              } else {
                out[int64_t{m} * rows + n] = from_float<T>(v + bias_n);
              }
            }
            v = 0.0f;
          }
        }
      }
    }
  };

  // Pipeline: before turn i, steps up to i + kMrStages - 2 are issued; turn i waits for step i's copies, and after
  // the barrier (every warp is past step i - 1, and step i's copies by every thread are visible; the first time,
  // the table too) issues step i + kMrStages - 1 into the stage step i - 1 used, then decodes and multiplies step
  // i. Scales are loaded two steps ahead. A tile's last step in the run ends with its store.
#pragma unroll
  for (int j = 0; j < kMrStages - 1; ++j) issue(j);
  RawScale now[2][2], next[2][2];
  load_scales(0, now);
  load_scales(1, next);
  int first_step = now_at.step;  // of the tile being summed
  bool first_tile = true;        // of the run
  for (int i = 0; i < count; ++i) {
    copy_async_wait<kMrStages - 2>();
    __syncthreads();
    issue(i + kMrStages - 1);
    const RawScale raw[2][2] = {{now[0][0], now[0][1]}, {now[1][0], now[1][1]}};
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) now[mt][0] = next[mt][0], now[mt][1] = next[mt][1];
    load_scales(i + 2, next);
    multiply(i, raw);
    const bool tile_end = now_at.step == steps - 1;
    if (tile_end || i == count - 1) {
      const bool whole = first_step == 0 && tile_end;
      store(now_at, whole ? nullptr : partial + (2 * int64_t{blockIdx.x} + (first_tile ? 0 : 1)) * kMrTileOutputs);
      first_step = 0;
      first_tile = false;
    }
    now_at.advance(steps);
  }
}

// The tiles that no one CTA finished: each output is the sum of the tile's parts in run order, plus the bias, so
// every call gives the same bits. CTA (tile, x row) takes that x row of the tile, thread r its W row r (the CTAs of
// whole tiles and of rows past x's end return at once); four parts' loads are in flight at a time.
template <typename T>
__global__ void __launch_bounds__(kMrTileRows)
    add_run_parts_kernel(const float* __restrict__ partial, int units, int runs, int steps, int m_tiles, int64_t rows,
                         int x_rows, const T* __restrict__ bias, T* __restrict__ out) {
  let_next_kernel_start();
  wait_for_previous_kernels();
  const int n_tile = blockIdx.x / m_tiles, m_tile = blockIdx.x % m_tiles, first_unit = n_tile * steps;
  const int64_t n = int64_t{n_tile} * kMrTileRows + threadIdx.x;
  const int m = m_tile * kMrXTileRows + blockIdx.y;
  if (m >= x_rows || n >= rows) return;
  const int64_t first = run_of(first_unit, units, runs), last = run_of(first_unit + steps - 1, units, runs);
  if (first == last) return;
  // Run r's parts are CTA r * m_tiles + m_tile's; the first run's is its last tile, unless the run starts at this
  // tile (then it is its only one).
  const auto part_of = [&](int64_t run, int which) { return (2 * (run * m_tiles + m_tile) + which) * kMrTileOutputs; };
  const float* at = partial + blockIdx.y * kMrTileRows + threadIdx.x;
  float sum = at[part_of(first, run_begin(first, units, runs) < first_unit ? 1 : 0)];
  for (int64_t run = first + 1; run <= last; run += 4) {
    float part[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) part[u] = run + u <= last ? at[part_of(run + u, 0)] : -0.0f;
#pragma unroll
    for (int u = 0; u < 4; ++u) sum += part[u];  // in run order; -0.0 adds nothing, not even to a -0.0 sum
  }
  out[int64_t{m} * rows + n] = from_float<T>(sum + (bias != nullptr ? to_float(bias[n]) : 0.0f));
}

template <typename T, bool kNested>
void launch(const T* x, const uint8_t* packed, const BlockScales& scales, const WeightSpec& spec, int64_t rows,
            int64_t cols, int64_t x_rows, const T* bias, T* out, const at::Tensor& like, cudaStream_t stream) {
  const auto kernel = many_rows_gemv_kernel<T, kNested>;
  static std::atomic<int64_t> resident_cache[64] = {};  // one cache per instance
  const int64_t per_sm = prepare_kernel(resident_cache, kernel, kMrThreads, kMrSharedBytes);
  const int64_t resident = per_sm * at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t m_tiles = (x_rows + kMrXTileRows - 1) / kMrXTileRows;
  const int64_t n_tiles = (rows + kMrTileRows - 1) / kMrTileRows;
  const int64_t steps = cols / kMrStep;
  const int64_t units = n_tiles * steps;  // of each x tile
  // Every resident CTA, unless that leaves runs of fewer than kMrMinStepsPerCta steps.
  const int64_t runs = std::max<int64_t>(1, std::min(resident / m_tiles, units / kMrMinStepsPerCta));
  const int64_t ctas = runs * m_tiles;
  // Parts to add: unless every run is whole tiles.
  const bool parts = units % runs != 0 || units / runs % steps != 0;
  TORCH_INTERNAL_ASSERT(units <= INT32_MAX && ctas <= INT32_MAX && x_rows <= INT32_MAX);  // many_rows_gemv_fits
  at::Tensor partial;
  float* partial_data = nullptr;
  if (parts) {
    partial = at::empty({2 * ctas, kMrTileOutputs}, like.options().dtype(at::kFloat));
    partial_data = partial.mutable_data_ptr<float>();
  }
  launch_kernel(kernel, dim3(static_cast<unsigned>(ctas)), kMrThreads, kMrSharedBytes, stream, 1, x, packed, scales,
                spec.quant_type, spec.blocksize_log2, rows, cols, static_cast<int>(x_rows), static_cast<int>(m_tiles),
                static_cast<int>(units), bias, out, partial_data);
  if (parts) {
    const dim3 add_grid(static_cast<unsigned>(m_tiles * n_tiles), kMrXTileRows);
    launch_kernel(add_run_parts_kernel<T>, add_grid, kMrTileRows, 0, stream, 1, partial_data, static_cast<int>(units),
                  static_cast<int>(runs), static_cast<int>(steps), static_cast<int>(m_tiles), rows,
                  static_cast<int>(x_rows), bias, out);
  }
}

}  // namespace

bool many_rows_gemv_fits(int64_t rows, int64_t cols, int64_t x_rows) {
  const int64_t n_tiles = (rows + kMrTileRows - 1) / kMrTileRows, m_tiles = (x_rows + kMrXTileRows - 1) / kMrXTileRows;
  return at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin >= size_t{kMrSharedBytes} &&
         n_tiles <= INT32_MAX / std::max<int64_t>(1, cols / kMrStep) && m_tiles <= INT32_MAX / 1024 &&
         cols <= INT32_MAX;
}

void launch_many_rows_gemv(const at::Tensor& x_2d, const uint8_t* packed, const BlockScales& scales,
                           const WeightSpec& spec, const at::Tensor& bias, at::Tensor& out) {
  const int64_t rows = spec.rows.expect_int(), cols = spec.cols.expect_int(), x_rows = x_2d.size(0);
  TORCH_INTERNAL_ASSERT(cols % kMrStep == 0 && (int64_t{1} << spec.blocksize_log2) >= kMrStep && x_rows > 0);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const auto run = [&](auto* type_tag) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    const T* x = static_cast<const T*>(x_2d.const_data_ptr());
    const T* bias_data = bias.defined() ? static_cast<const T*>(bias.const_data_ptr()) : nullptr;
    T* out_data = static_cast<T*>(out.mutable_data_ptr());
    const auto with_tile = [&](auto nested) {
      launch<T, decltype(nested)::value>(x, packed, scales, spec, rows, cols, x_rows, bias_data, out_data, out, stream);
    };
    scales.nested() ? with_tile(std::true_type{}) : with_tile(std::false_type{});
  };
  if (x_2d.scalar_type() == at::kHalf) {
    run(static_cast<__half*>(nullptr));
  } else {
    TORCH_INTERNAL_ASSERT(x_2d.scalar_type() == at::kBFloat16);
    run(static_cast<__nv_bfloat16*>(nullptr));
  }
}

}  // namespace nf4
