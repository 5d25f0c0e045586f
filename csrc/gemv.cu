// nf4::gemv on CUDA, six paths chosen per call (the crossover constants in ops.h, and each path's rule here):
//  - the one-row kernel (below, "One-row path"): one row of fp16/bf16 x (up to kOrMaxXRows rows, decoded together),
//    or of fp32 x as split bf16 operands (MmaOperand), on sm_80+, plain or nested absmax, on layers with enough steps
//    per warp (one_row_gemv_applies), and for fp32 x of up to kOneRowFp32RowLimits (ops.h) rows, one launch that takes
//    the rows one after another;
//  - the tensor-core kernel (below, "Tensor-core path"): fp16/bf16 x on sm_80+, when the shape and alignment
//    allow, of up to kTensorCoreGemvLaunchRows rows, in one launch;
//  - the warpgroup kernel (below, "Warpgroup path"): the tensor-core kernel's calls of kWgMinXRows to 16 rows that
//    warpgroup_gemv_takes_x_rows (ops.h) gives it by W's size, on H100 / H200 with sm_90a code but on small-N
//    layers (wg_gemv_applies);
//  - the many-rows kernel (csrc/gemv_many_rows.cu): fp16/bf16 x of 17 up to many_rows_gemv_max_rows rows where the
//    tensor-core kernel's layout fits, in one launch, but for a few last rows on large W (many_rows_gemv_tail_rows),
//    which then take one launch of the one-row, tensor-core or warpgroup kernel, as a call of those rows alone would;
//  - the CUDA-core kernel (fp32 x that the one-row kernel does not take, odd shapes, up to kFusedGemvMaxRows
//    rows): one warp per row n of W decodes that row once and dots it with every row of x, accumulating in fp32;
//  - more rows: W is dequantized once to x's dtype and cuBLAS does the matrix product.
// The fused kernels add the bias before the single rounding to x's dtype.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cooperative_groups.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <type_traits>

#include "code_pair_table.cuh"
#include "cuda_types.cuh"
#include "launch_cache.h"
#include "mma_sync.cuh"
#include "ops.h"

namespace nf4 {
namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kChunkElements = 32;

// Adds x[m, k0 .. k0+31] . w to acc, for a 16-byte-aligned x row.
template <typename T>
__device__ __forceinline__ float dot_chunk(const T* x_chunk, const float (&w)[kChunkElements]) {
  constexpr int kPerVector = sizeof(uint4) / sizeof(T);
  float acc = 0.0f;
#pragma unroll
  for (int v = 0; v < kChunkElements / kPerVector; ++v) {
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(x_chunk) + v);
    const T* xs = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < kPerVector; ++i) acc += to_float(xs[i]) * w[v * kPerVector + i];
  }
  return acc;
}

// kVectorized: K % 32 == 0 and packed / x 16-byte aligned, so each lane takes whole 32-element chunks
// (16 packed bytes, one absmax block). Otherwise each lane takes single elements.
template <typename T, bool kVectorized>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    fused_gemv_kernel(const T* __restrict__ x, const uint8_t* __restrict__ packed, BlockScales scales,
                      QuantType quant_type, int blocksize_log2, int64_t rows, int64_t cols, int x_rows,
                      const T* __restrict__ bias, T* __restrict__ out) {
  let_next_kernel_start();
  __shared__ float table[16];
  if (threadIdx.x < 16) table[threadIdx.x] = code_table(quant_type).value[threadIdx.x];
  __syncthreads();
  wait_for_previous_kernels();

  const int lane = threadIdx.x % 32;
  const int64_t n = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (n >= rows) return;
  const int64_t row_start = n * cols;  // flat element index of W[n, 0]

  float acc[kFusedGemvMaxRows] = {};
  if constexpr (kVectorized) {
    const int64_t chunks = cols / kChunkElements;
    const int64_t first_chunk = row_start / kChunkElements;
    for (int64_t c = lane; c < chunks; c += 32) {
      const int64_t chunk = first_chunk + c;
      float w[kChunkElements];
      decode_chunk(load_packed_chunk(packed, chunk), table, scales.at((chunk * kChunkElements) >> blocksize_log2), w);
#pragma unroll
      for (int m = 0; m < kFusedGemvMaxRows; ++m) {
        if (m < x_rows) acc[m] += dot_chunk(x + m * cols + c * kChunkElements, w);
      }
    }
  } else {
    for (int64_t k = lane; k < cols; k += 32) {
      const int64_t e = row_start + k;
      const float w = mul_rn(table[nibble_at(packed, e)], scales.at(e >> blocksize_log2));
#pragma unroll
      for (int m = 0; m < kFusedGemvMaxRows; ++m) {
        if (m < x_rows) acc[m] += to_float(x[m * cols + k]) * w;
      }
    }
  }

#pragma unroll
  for (int m = 0; m < kFusedGemvMaxRows; ++m) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], offset);
  }
  if (lane == 0) {
    const float b = bias != nullptr ? to_float(bias[n]) : 0.0f;
#pragma unroll
    for (int m = 0; m < kFusedGemvMaxRows; ++m) {
      if (m < x_rows) out[m * rows + n] = from_float<T>(acc[m] + b);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Tensor-core path (fp16 / bf16 x, sm_80+): y^T = W x^T as mma.sync m16n8k16 tiles, W rows on the mma's M
// side and the (at most 16) rows of x on its N side, fp32 accumulation.
//
// Why this shape: decode is one token per sequence, so the weight bytes are the whole cost, and what limits
// a kernel that streams them is the SM's load/store pipeline (L1 wavefronts) and the warps it has to hide
// memory latency, not arithmetic (benchmarks/NOTES.md, gemv rows 5-6, has the profile). Per packed byte
// this path spends one byte permute (which builds the table address) and one shared-memory lookup in a
// 256-entry table that maps the byte straight to its two code values as a packed fp16/bf16 pair, plus a
// quarter of an mma; the absmax scale is applied once per 64 elements to the mma's fp32 result instead of
// once per element, and a lane reads the scales of a whole loop turn (4 steps) in one vector read. The
// table is replicated once per lane, entry e of lane l at byte e * 256 + 4 * l, so that 32 random bytes
// never share a bank and the byte permute alone forms the offset (byte in bits 8..15, 4 * lane in 0..7).
//
// Numerics: each weight is code (rounded to x's dtype) * absmax (fp32) instead of dequantize's
// round(code * absmax); both are one rounding of a code-sized relative error, and the output is rounded
// once, so the result stays within the tolerance rule (README, "Correctness") that the tests check.
//
// Lane layout. mma lane (g = lane / 4, t = lane % 4) feeds W rows g and g + 8 of the tile and x row g of
// each n-tile. The k order inside a 64-element step is permuted (the same way for W and x, so the dot
// product is unchanged) so that each lane's operands are 16 consecutive elements: its own 8 packed bytes
// (one 8-byte shared-memory read per W row) and 16 consecutive x values (two 16-byte loads). mma k-tile j
// takes lane t's elements 16t + 4j .. 16t + 4j + 3, i.e. packed bytes 2j and 2j + 1 of its 8.
//
// Work split (stream-K). A tile is 16 W rows (32, two mmas' M, for 9-16 rows of x on large layers: see
// kTcWideTileMinCols) over all of K, cut into turns of 4 steps (K % 256 == 0, so a turn never straddles a
// row, nor an absmax block it does not start). The tiles' turns, laid end to end,
// are shared out evenly over every warp of a grid of resident CTAs, so each warp takes one contiguous run
// of turns, whatever the layer's shape: no warp waits for another, and small-N layers fill the GPU too.
// Each warp stages its turns through a ring of kTcStages turn-sized buffers in shared memory with cp.async:
// while it decodes one turn, the next ones (the next tile's first turns included) are in flight, whole
// 128-byte row pieces per copy instruction, without registers to hold them. A tile that
// one warp takes whole goes straight to the output; the parts of a tile that several warps share go to
// fp32 slots, which a second kernel adds in warp order. Small-N layers (no more tiles than resident CTAs,
// and few turns per tile: tc_cta_per_tile) take one CTA per tile instead: the same split with the grid
// cut to one CTA per tile keeps each tile's warps in one CTA, and they add their parts in shared memory,
// so the second kernel and its launch go (benchmarks/NOTES.md, gemv row 19). Where that would leave SMs idle
// and each warp 3 turns or more (Llama's k/v: 64 tiles of 32 turns) at 9-16 rows of x, each tile takes a cluster
// of CTAs on sm_90 (tc_tile_cluster), whose other CTAs push their parts into the first one's shared memory
// (rows 56, 134, 135). Every order is fixed, so the result is the same on every run.
// Warps per CTA, one CTA per SM (they share one table), by kind of launch (TcCta), measured on an H100 at 12-16
// warps and an H200 at 14-16 (NOTES gemv rows 91-93): 16 for the stream-K split of 16-row tiles (fewer were up to
// 22% slower at 4-8 rows, and even at 9-16) and for one CTA per tile at 1-8 rows (Llama's k/v, 32 turns per tile,
// 8-13% slower with 12); 14 for 32-row tiles (at 16 rows 4-10% faster than at 16 warps, at 9-12 rows up to 7%, and
// mostly faster than at 12, 13 or 15; ptxas gives them 128 registers either way, and the cause is not known: more L1
// alone, row 94, was slower); 12 for one CTA per tile at 9-16 rows (the k/v layers 8-19% faster: 168 registers, no
// spills in the loop).
#ifndef NF4_TC_WARPS  // build-time knobs for tuning runs (benchmarks/NOTES.md)
#define NF4_TC_WARPS 16
#endif
#ifndef NF4_TC_WIDE_WARPS
#define NF4_TC_WIDE_WARPS 14
#endif
#ifndef NF4_TC_CTA_PER_TILE_WIDE_X_WARPS
#define NF4_TC_CTA_PER_TILE_WIDE_X_WARPS 12
#endif
constexpr int kTcWarps = NF4_TC_WARPS;
constexpr int kTcWideWarps = NF4_TC_WIDE_WARPS;
constexpr int kTcCtaPerTileWideXWarps = NF4_TC_CTA_PER_TILE_WIDE_X_WARPS;  // one CTA per tile, two n-tiles
constexpr int kTcMmaRows = 16;                    // W rows per mma (its M); a tile is kMTiles of them
constexpr int kTcStep = 64;                       // K elements per step: 4 mma k-tiles, one absmax scale per row
constexpr int kTcTurnSteps = 4;                   // steps per loop turn
constexpr int kTcTurn = kTcStep * kTcTurnSteps;   // K elements per turn; the path needs K % kTcTurn == 0
#ifndef NF4_TC_MIN_TURNS_PER_WARP  // build-time knob for tuning runs (benchmarks/NOTES.md), as NF4_TC_STAGES
#define NF4_TC_MIN_TURNS_PER_WARP 2
#endif
constexpr int kTcMinTurnsPerWarp = NF4_TC_MIN_TURNS_PER_WARP;  // small layers: fewer warps, a few turns each
#ifndef NF4_TC_STAGES
#define NF4_TC_STAGES 2
#endif
// Turns each warp has staged in shared memory: one being decoded, the rest in flight.
constexpr int kTcStages = NF4_TC_STAGES;
static_assert(kTcStages >= 2 && (kTcStages & (kTcStages - 1)) == 0, "NF4_TC_STAGES: a power of two >= 2");
constexpr int kTcCode2Bytes = 256 * 4;            // the nested absmax map (state2.code), fp32
// At 9-16 rows of x (two n-tiles) a warp's tile is 32 W rows (two mmas' M) instead of 16, where the GPU's
// shared memory allows: each x fragment then feeds two mmas, which halves the x traffic per weight byte;
// with 16-row tiles a warp reads 4x as many bytes of x (from L2: 16 rows of x fit in no L1) as of weights
// per turn. At 1-8 rows 32-row tiles were slower (benchmarks/NOTES.md, gemv row 11).
#ifndef NF4_TC_WIDE_TILE_MIN_TURNS_PER_WARP
#define NF4_TC_WIDE_TILE_MIN_TURNS_PER_WARP 6
#endif
// Only on layers with K >= kTcWideTileMinCols that give every resident warp at least
// kTcWideTileMinTurnsPerWarp wide turns. Both measured on an H100 at 12 and 16 rows over the paper layers
// (benchmarks/NOTES.md, gemv row 11): with fewer turns per warp (k/v, q/o layers) each warp's fixed costs
// (its table share, its first turn's latency, the tile parts it shares) weigh more and 16-row tiles were
// 5-40% faster; at K = 5120-5376 (Gemma, Qwen gate/up) 16-row tiles were 3-4% faster; at K >= 8192 with
// 6.7-13.6 turns per warp (down projections, Llama gate/up) 32-row tiles were 2.5-13% faster.
constexpr int kTcWideTileMinTurnsPerWarp = NF4_TC_WIDE_TILE_MIN_TURNS_PER_WARP;
constexpr int64_t kTcWideTileMinCols = 8192;
constexpr int kTcRowTurnBytes = kTcTurn / 2;
constexpr int kTcRowScaleBytes = 16;
// One stage: the tile's rows x 128 packed bytes of one turn, then 16 bytes of scales per row (plain: the
// turn's absmax values, 4 / 2 / 1 fp32 by blocksize; nested: the 4-byte word holding the turn's uint8
// codes, then the fp32 nested absmax).
template <int kMTiles>
struct TileShape {
  static constexpr int kRows = kTcMmaRows * kMTiles;
  static constexpr int kStageWeightBytes = kRows * kTcRowTurnBytes;
  static constexpr int kStageBytes = kStageWeightBytes + kRows * kTcRowScaleBytes;
};

constexpr int kMbarrierBytes = 8;  // an mbarrier object in shared memory (PTX: .b64)
// CTAs per tile where one-CTA-per-tile launches take a cluster per tile (tc_tile_cluster).
#ifndef NF4_TC_TILE_CLUSTER
#define NF4_TC_TILE_CLUSTER 2
#endif
constexpr int kTcTileCluster = NF4_TC_TILE_CLUSTER;
// Only where one CTA's warps would take more than this many turns each: a cluster's launch and end cost ~2 us a call
// however they are done, which the halved turns buy back on Llama's k/v (32 turns a tile, 3 a warp without a
// cluster: 13-15% faster at 12-16 rows on an H200, NOTES gemv row 135) and not on Qwen's (20, 2 a warp: one CTA per
// tile 0.5 us faster at 16 rows on an H100, row 134b, and even on an H200, row 135).
#ifndef NF4_TC_TILE_CLUSTER_MIN_TURNS
#define NF4_TC_TILE_CLUSTER_MIN_TURNS 2
#endif
constexpr int kTcTileClusterMinTurns = NF4_TC_TILE_CLUSTER_MIN_TURNS;
// One CTA per tile in a cluster of CTAs (tc_tile_cluster, sm_90): the other CTAs push their warps' parts into the
// first CTA's shared memory with st.async, each store counted by the first CTA's mbarrier, and leave; the first CTA
// waits on that mbarrier alone. Where the first CTA read the others' parts through distributed shared memory between
// two cluster.sync()s, the calls at 9-16 rows spent ~1.9 us on that end (NOTES gemv row 133b), which no turn paid;
// the push took 0.4-0.5 us off them on an H100 and measured even on an H200 (rows 134b, 135; that end, the A/B's
// base, left the tree after row 135).
// The floats of one warp's part (x rows x tile rows) as its lanes push it: all of their accumulators.
template <int kNTiles>
constexpr int kTcPushedPartFloats = 32 * 4 * kNTiles;
// Where pushed float f (warp w's part of the other CTAs, in CTA then warp order, at w * kTcPushedPartFloats) sits
// in the table: 32 floats in each entry's free last 128 bytes. The mbarrier sits in the last entry's.
__host__ __device__ constexpr int pushed_float_offset(int f) {
  return f / 32 * kCodePairEntryBytes + kCodePairEntryBytes / 2 + f % 32 * int(sizeof(float));
}
constexpr int kTcPushBarrierOffset = 255 * kCodePairEntryBytes + kCodePairEntryBytes / 2;
static_assert(kTcPushBarrierOffset % kMbarrierBytes == 0, "the mbarrier's alignment");
static_assert((kTcTileCluster - 1) * kTcCtaPerTileWideXWarps * kTcPushedPartFloats<2> / 32 < 255,
              "the pushed parts fit the table's free halves below the mbarrier's");
// One CTA of a tensor-core launch: its warps and its shared memory (the table, the nested map, a ring per warp).
// One CTA per tile takes only 16-row tiles.
template <int kMTiles, int kNTiles, bool kCtaPerTile>
struct TcCta {
  static_assert(!kCtaPerTile || kMTiles == 1, "one CTA per tile: 16-row tiles");
  static constexpr int kWarps =
      kMTiles == 2 ? kTcWideWarps : (kCtaPerTile && kNTiles == 2 ? kTcCtaPerTileWideXWarps : kTcWarps);
  static constexpr int kSharedBytes =
      kCodePairTableBytes + kTcCode2Bytes + kWarps * kTcStages * TileShape<kMTiles>::kStageBytes;
  // With a cluster per tile (two n-tiles only), the parts the other CTAs push and the mbarrier that counts them go
  // into the code pair table's free halves (code_pair_table.cuh), not more shared memory: 12 KB more took the
  // carveout past 132 KB, less L1, and Gemma's k/v (no cluster) 8% slower at 16 rows (NOTES gemv row 134).
  static constexpr bool kPush = kCtaPerTile && kNTiles == 2;
};

// The code pair of byte `kByte` (0..3) of `word`, from this lane's copy of the table; `lut` is the table's
// shared-memory address (a shared-window address, so that the load can add it as a uniform register).
template <int kByte>
__device__ __forceinline__ uint32_t code_pair(uint32_t lut, uint32_t word, uint32_t lane4) {
  const uint32_t offset = code_pair_offset(word, kByte, lane4);
  uint32_t pair;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(pair) : "r"(lut + offset));
  return pair;
}

// The mma A fragment of k-tile j (0..3, a compile-time value once the caller's loop is unrolled) from a lane's
// 8 packed bytes of its A rows g (`lo`) and g + 8 (`hi`): k-tile j takes packed bytes 2j and 2j + 1, i.e.
// bytes (j % 2) * 2 and + 1 of word j / 2 (the lane's 16 consecutive elements, 4 per k-tile).
__device__ __forceinline__ void a_fragment(int j, uint2 lo, uint2 hi, uint32_t lut, uint32_t lane4, uint32_t (&a)[4]) {
  const uint32_t lo_word = j < 2 ? lo.x : lo.y, hi_word = j < 2 ? hi.x : hi.y;
  if (j % 2 == 0) {
    a[0] = code_pair<0>(lut, lo_word, lane4), a[1] = code_pair<0>(lut, hi_word, lane4);
    a[2] = code_pair<1>(lut, lo_word, lane4), a[3] = code_pair<1>(lut, hi_word, lane4);
  } else {
    a[0] = code_pair<2>(lut, lo_word, lane4), a[1] = code_pair<2>(lut, hi_word, lane4);
    a[2] = code_pair<3>(lut, lo_word, lane4), a[3] = code_pair<3>(lut, hi_word, lane4);
  }
}

// How the absmax blocks fall on a turn's 4 steps: `steps_per_block_log2` is log2(blocksize / 64) capped at
// 2, so 0: one block per step (blocksize 64), 1: one per two steps (128), 2: one for the whole turn.
struct TurnBlocks {
  int steps_per_block_log2;
  uint32_t spread;  // __byte_perm selector that puts block byte (u >> steps_per_block_log2) in byte u
};

__device__ __forceinline__ TurnBlocks turn_blocks(int blocksize_log2) {
  const int log2 = blocksize_log2 - 6 < 2 ? blocksize_log2 - 6 : 2;
  return TurnBlocks{log2, log2 == 0 ? 0x3210u : (log2 == 1 ? 0x1100u : 0x0000u)};
}

// Where W row r's packed bytes for step u, lane t (8 bytes: the row's turn bytes 32u + 8t ..) sit in a stage.
// The 32-byte pieces of a row are XOR-swizzled by r % 4, so that the 16 lanes of a half-warp (4 rows x 4
// lanes) read 4 different pieces and hit 32 different banks.
__device__ __forceinline__ int stage_weight_offset(int r, int u, int t) {
  return r * kTcRowTurnBytes + ((u ^ (r & 3)) << 5) + 8 * t;
}

// Where one lane's copies for the turns of one tile come from; set when the staging moves to a new tile and
// advanced by one turn per staged turn. The weights go as 16-byte copies, 8 lanes per W row and 4 whole
// 128-byte row pieces per copy instruction: lane l copies piece l % 8 of rows l / 8 + 4i. (Copies of 16
// rows' 32-byte pieces per instruction, one pointer per lane, measured 6% slower at one row of x and 30%
// slower at 16: benchmarks/NOTES.md, gemv row 17.)
struct StageSource {
  const uint8_t* weight;  // row tile * kRows + lane / 8's packed bytes at the next staged turn, piece lane % 8
  int64_t scale_element;  // flat index of row tile * kRows + lane's first element of that turn (scales)
  int rows_there;         // the tile's rows that exist (rows past the end of W are zero-filled)
};

template <int kRows>
__device__ __forceinline__ StageSource stage_source(const uint8_t* packed, int64_t tile, int s, int lane,
                                                    int64_t rows, int64_t cols) {
  const int64_t first_row = tile * kRows;
  return StageSource{packed + (first_row + lane / 8) * (cols / 2) + int64_t{s} * kTcRowTurnBytes + 16 * (lane % 8),
                     (first_row + lane) * cols + int64_t{s} * kTcTurn,
                     static_cast<int>(rows - first_row < kRows ? rows - first_row : kRows)};
}

// The warp requests the next turn of `src` into the stage at shared-window address `stage`: the weight
// bytes as 16-byte copies (StageSource), and lanes below kRows one row's scales each; then advances `src`
// by one turn.
template <int kRows, bool kNested>
__device__ __forceinline__ void stage_turn(uint32_t stage, StageSource& src, int64_t rows, int64_t cols,
                                           const BlockScales& scales, int blocksize_log2, TurnBlocks blocks,
                                           int lane) {
  static_assert(kRows <= 32, "one lane per row copies the scales");
  const int piece = lane % 8;  // 16-byte piece of the row's 128 turn bytes
  const int64_t four_rows_bytes = 2 * cols;
  // piece p holds turn bytes 16p .. 16p + 15, i.e. lanes 2(p % 2), +1 of step p / 2; rows lane / 8 + 4i
  // share r % 4, so their stage offsets differ by 4i rows
  const uint32_t first_dst = stage + stage_weight_offset(lane / 8, piece / 2, 2 * (piece % 2));
#pragma unroll
  for (int i = 0; i < kRows / 4; ++i) {
    const int r = lane / 8 + 4 * i;
    copy_async<16>(first_dst + 4 * i * kTcRowTurnBytes, src.weight + i * four_rows_bytes, r < src.rows_there ? 16 : 0);
  }
  src.weight += kTcRowTurnBytes;
  if (lane < kRows) {
    const int64_t first = src.scale_element >> blocksize_log2;  // the turn's first block
    const uint32_t dst = stage + kRows * kTcRowTurnBytes + lane * kTcRowScaleBytes;
    const bool there = lane < src.rows_there;
    if constexpr (!kNested) {
      const float* from = there ? scales.absmax + first : scales.absmax;
      if (blocks.steps_per_block_log2 == 0) {
        copy_async<16>(dst, from, there ? 16 : 0);
      } else if (blocks.steps_per_block_log2 == 1) {
        copy_async<8>(dst, from, there ? 8 : 0);
      } else {
        copy_async<4>(dst, from, there ? 4 : 0);
      }
    } else {
      // The aligned 4-byte word that holds the turn's 1, 2 or 4 codes; bytes past the codes' end read as zero.
      const int64_t word = there ? first & ~int64_t{3} : 0;
      const int64_t code_count = (rows * cols + (int64_t{1} << blocksize_log2) - 1) >> blocksize_log2;  // last partial
      const int64_t code_bytes = there ? (code_count - word < 4 ? code_count - word : 4) : 0;
      copy_async<4>(dst, scales.codes + word, static_cast<uint32_t>(code_bytes));
      copy_async<4>(dst + 4, scales.absmax2 + (there ? first >> scales.nested_blocksize_log2 : 0), there ? 4 : 0);
    }
  }
  src.scale_element += kTcTurn;
}

// Asks L2 for what the first stage_turn of 16- or 32-row tile `tile` at turn `s` copies: lane r < kRows row r's
// 128 bytes of the turn and, with kScales, the line of the turn's first scale (rows past W's end: nothing).
template <int kRows, bool kScales>
__device__ __forceinline__ void prefetch_first_turn(const uint8_t* packed, const BlockScales& scales, int64_t tile,
                                                    int s, int lane, int64_t rows, int64_t cols, int blocksize_log2) {
  const int64_t row = tile * kRows + lane;
  if (lane < kRows && row < rows) {
    prefetch_l2(packed + row * (cols / 2) + int64_t{s} * kTcRowTurnBytes);
    if (kScales) prefetch_block_scale(scales, (row * cols + int64_t{s} * kTcTurn) >> blocksize_log2);
  }
}

// What the nested scales are decoded with: state2.code in shared memory and the offset.
struct NestedDecode {
  const float* code2;
  float offset;
};

// The CTA fills the code pair table at `lut` and, for nested absmax, state2.code at `code2` (both in shared memory;
// the caller syncs before reading them), and returns what the nested scales are decoded with.
template <typename T, bool kNested>
__device__ __forceinline__ NestedDecode fill_decode_tables(uint8_t* lut, float* code2, QuantType quant_type,
                                                          const BlockScales& scales) {
  fill_code_pair_table<T>(lut, quant_type);
  NestedDecode nested{code2, 0.0f};
  if constexpr (kNested) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) code2[i] = scales.code2[i];
    nested.offset = *scales.offset;
  }
  return nested;
}

// The absmax of each of the turn's 4 steps for W row r, from the stage's scale bytes of that row.
template <bool kNested>
__device__ __forceinline__ void turn_scales(const uint8_t* row_scales, int64_t row_start, int s, int blocksize_log2,
                                            TurnBlocks blocks, const NestedDecode& nested, float (&out)[kTcTurnSteps]) {
  if constexpr (!kNested) {
    if (blocks.steps_per_block_log2 == 0) {
      const float4 q = *reinterpret_cast<const float4*>(row_scales);
      out[0] = q.x, out[1] = q.y, out[2] = q.z, out[3] = q.w;
    } else if (blocks.steps_per_block_log2 == 1) {
      const float2 q = *reinterpret_cast<const float2*>(row_scales);
      out[0] = q.x, out[1] = q.x, out[2] = q.y, out[3] = q.y;
    } else {
      const float v = *reinterpret_cast<const float*>(row_scales);
      out[0] = v, out[1] = v, out[2] = v, out[3] = v;
    }
  } else {
    const int64_t first = (row_start + int64_t{s} * kTcTurn) >> blocksize_log2;
    const uint32_t word = *reinterpret_cast<const uint32_t*>(row_scales) >> (8 * (first & 3));
    const float absmax2 = *reinterpret_cast<const float*>(row_scales + 4);
    const uint32_t codes = __byte_perm(word, 0, blocks.spread);  // byte u: the code of step u
#pragma unroll
    for (int u = 0; u < kTcTurnSteps; ++u) {
      out[u] = BlockScales::nested_absmax_value(nested.code2[(codes >> (8 * u)) & 0xFF], absmax2, nested.offset);
    }
  }
}

// Which rows of x a lane feeds to the mmas: row g (n-tile 0) and, with two n-tiles, row 8 + g. With one
// n-tile (1-8 rows of x) a lane whose row g is past the last loads no x; with two (9-16 rows) every row g
// exists and row 8 + g is clamped to the last row (the outputs of clamped rows are dropped).
struct XRows {
  bool there;             // one n-tile: row g exists
  int64_t second_offset;  // two n-tiles: elements from row g to the (clamped) row 8 + g
};

// 16 bytes through the read-only path when `there`; otherwise no load, and the result is unspecified (the
// callers drop every output it feeds: an mma's column n of x feeds only column n of the result).
__device__ __forceinline__ uint4 load_16_if(bool there, const uint4* from) {
  uint4 v;
  asm("{\n .reg .pred p;\n setp.ne.b32 p, %4, 0;\n @p ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%5];\n}\n"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "r"(int{there}), "l"(from));
  return v;
}

// As load_16_if, but zeros when not `there` (for callers whose outputs are not dropped).
__device__ __forceinline__ uint4 load_16_or_zero(bool there, const uint4* from) {
  uint4 v = make_uint4(0, 0, 0, 0);
  asm("{\n .reg .pred p;\n setp.ne.b32 p, %4, 0;\n @p ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%5];\n}\n"
      : "+r"(v.x), "+r"(v.y), "+r"(v.z), "+r"(v.w)
      : "r"(int{there}), "l"(from));
  return v;
}

// One 64-element step of one tile: for each of its kMTiles mmas' 16 W rows, 4 k-tiles into fresh fp32 sums,
// then acc += absmax * sums per W row. Each x fragment is loaded once and feeds every m-tile; a lane whose
// x row does not exist loads nothing (its outputs are dropped).
template <typename T, int kMTiles, int kNTiles>
__device__ __forceinline__ void tc_gemv_step(const uint2 (&w_lo)[kMTiles], const uint2 (&w_hi)[kMTiles],
                                             const float (&scale_lo)[kMTiles], const float (&scale_hi)[kMTiles],
                                             const T* x_step, const XRows& x_rows, uint32_t lut, uint32_t lane4,
                                             float (&acc)[kMTiles][kNTiles][4]) {
  uint4 xv[kNTiles][2];
  const uint4* x16 = reinterpret_cast<const uint4*>(x_step);
  if constexpr (kNTiles == 1) {
    xv[0][0] = load_16_if(x_rows.there, x16);
    xv[0][1] = load_16_if(x_rows.there, x16 + 1);
  } else {
    static_assert(kNTiles == 2, "at most 16 rows of x");
    const uint4* x16_second = reinterpret_cast<const uint4*>(x_step + x_rows.second_offset);
    xv[0][0] = __ldg(x16), xv[0][1] = __ldg(x16 + 1);
    xv[1][0] = __ldg(x16_second), xv[1][1] = __ldg(x16_second + 1);
  }
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
    float sums[kNTiles][4] = {};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t a[4];
      a_fragment(j, w_lo[mt], w_hi[mt], lut, lane4, a);
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
        const uint4& x8 = xv[nt][j / 2];
        mma_16816<T>(sums[nt], a, j % 2 ? x8.z : x8.x, j % 2 ? x8.w : x8.y, sums[nt]);
      }
    }
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
      acc[mt][nt][0] = fmaf(scale_lo[mt], sums[nt][0], acc[mt][nt][0]);
      acc[mt][nt][1] = fmaf(scale_lo[mt], sums[nt][1], acc[mt][nt][1]);
      acc[mt][nt][2] = fmaf(scale_hi[mt], sums[nt][2], acc[mt][nt][2]);
      acc[mt][nt][3] = fmaf(scale_hi[mt], sums[nt][3], acc[mt][nt][3]);
    }
  }
}

// Decodes turn s of the lane's rows 16mt + g and 16mt + g + 8 of the tile (whose row 0 starts at flat
// element tile_start) from `stage`; x_turn points at the turn's first x element of the lane's x row g.
template <typename T, int kMTiles, int kNTiles, bool kNested>
__device__ __forceinline__ void tc_gemv_turn(const uint8_t* stage, int64_t tile_start, int64_t cols, int s, int g,
                                             int t, const T* x_turn, const XRows& x_rows,
                                             uint32_t lut, uint32_t lane4, int blocksize_log2, TurnBlocks blocks,
                                             const NestedDecode& nested, float (&acc)[kMTiles][kNTiles][4]) {
  float scale_lo[kMTiles][kTcTurnSteps], scale_hi[kMTiles][kTcTurnSteps];
  const uint8_t* stage_scales = stage + TileShape<kMTiles>::kStageWeightBytes;
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
    const int r = kTcMmaRows * mt + g;
    turn_scales<kNested>(stage_scales + r * kTcRowScaleBytes, tile_start + r * cols, s, blocksize_log2, blocks,
                         nested, scale_lo[mt]);
    turn_scales<kNested>(stage_scales + (r + 8) * kTcRowScaleBytes, tile_start + (r + 8) * cols, s, blocksize_log2,
                         blocks, nested, scale_hi[mt]);
  }
#pragma unroll
  for (int u = 0; u < kTcTurnSteps; ++u) {
    uint2 w_lo[kMTiles], w_hi[kMTiles];
    float step_lo[kMTiles], step_hi[kMTiles];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      const int r = kTcMmaRows * mt + g;
      w_lo[mt] = *reinterpret_cast<const uint2*>(stage + stage_weight_offset(r, u, t));
      w_hi[mt] = *reinterpret_cast<const uint2*>(stage + stage_weight_offset(r + 8, u, t));
      step_lo[mt] = scale_lo[mt][u], step_hi[mt] = scale_hi[mt][u];
    }
    tc_gemv_step<T, kMTiles, kNTiles>(w_lo, w_hi, step_lo, step_hi, x_turn + u * kTcStep, x_rows, lut, lane4, acc);
  }
}

// Which turns of the flattened (tile, turn) sequence warp `w` of `warps` takes: [first, end), shared out
// evenly (sizes differ by at most one).
struct WarpTurns {
  int64_t first, end;
};

__host__ __device__ inline WarpTurns warp_turns(int64_t w, int64_t warps, int64_t total) {
  return WarpTurns{w * total / warps, (w + 1) * total / warps};
}

// The warp whose turns include turn p (the inverse of warp_turns).
__host__ __device__ inline int64_t warp_of_turn(int64_t p, int64_t warps, int64_t total) {
  return ((p + 1) * warps - 1) / total;
}

// The slot rule for the parts of a tile that several warps share, for whoever adds them (add_tile_parts_kernel
// over the grid's warps, one_row_gemv_kernel over a CTA's): each warp has two slots, 0 for its run's first tile
// and 1 for its last. Of the warps that share the tile whose first turn is `tile_first`, only the first can
// have begun in an earlier tile (its slot 1); every later one began in this tile (its slot 0; zeros for a
// warp with no turns). Returns the first sharer's slot index, first sharer x 2 + (0 or 1); a later sharer w's
// is w x 2.
__host__ __device__ inline int64_t first_sharer_slot(int64_t tile_first, int64_t warps, int64_t total) {
  const int64_t first_sharer = warp_of_turn(tile_first, warps, total);
  return first_sharer * 2 + (warp_turns(first_sharer, warps, total).first < tile_first ? 1 : 0);
}

// Where accumulator i (0..3) of m-tile mt and n-tile nt of lane (g, t) belongs (the m16n8 mma result layout):
// x row m (the mma's column) and tile row r (the mma's row).
struct AccPosition {
  int m, r;
};

__device__ __forceinline__ AccPosition acc_position(int mt, int nt, int i, int g, int t) {
  return AccPosition{nt * 8 + 2 * t + i % 2, kTcMmaRows * mt + g + (i >= 2 ? 8 : 0)};
}

// A worker's sum for output (x row m, W row n: row r of its tile of kTileRows) when it leaves the tile: the output
// itself (+ bias, the one rounding) where it took the whole tile, else its part in its slot for the tile (worker x 2,
// + 1 where the tile is not its first: first_sharer_slot's numbering), slots being [x row][tile row] arrays laid one
// after another, as add_tile_parts_kernel reads them.
template <int kTileRows, typename T>
__device__ __forceinline__ void store_tile_sum(float value, bool whole, int64_t worker, bool first_tile, int m,
                                               int64_t n, int r, int x_rows, int64_t rows, const T* bias, T* out,
                                               float* partial) {
  if (whole) {
    out[m * rows + n] = from_float<T>(bias != nullptr ? value + to_float(bias[n]) : value);
  } else {
    const int64_t slot = worker * 2 + (first_tile ? 0 : 1);
    partial[(slot * x_rows + m) * kTileRows + r] = value;
  }
}

__device__ __forceinline__ void mbarrier_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void cluster_arrive_release() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait_acquire() {
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// The shared::cluster address of `local` (a shared-window address of this CTA) in the cluster's CTA `rank`.
__device__ __forceinline__ uint32_t cluster_address(uint32_t local, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  return remote;
}
__device__ __forceinline__ void push_float(uint32_t remote, float value, uint32_t remote_bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(remote),
               "r"(__float_as_uint(value)), "r"(remote_bar)
               : "memory");
}
__device__ __forceinline__ void mbarrier_expect_bytes(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
#endif
// Waits for the phase of parity `parity` of the mbarrier at `bar` to complete; with kCluster, acquiring what other
// CTAs of the cluster released to it (their st.async stores), else what this CTA's threads did.
template <bool kCluster = false>
__device__ __forceinline__ void mbarrier_wait_parity(uint32_t bar, uint32_t parity) {
  if constexpr (kCluster) {
    asm volatile(
        "{\n.reg .pred done;\nwait_again:\nmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra wait_again;\n}\n" ::"r"(bar), "r"(parity)
        : "memory");
  } else {
    asm volatile(
        "{\n.reg .pred done;\nwait_again:\nmbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra wait_again;\n}\n" ::"r"(bar), "r"(parity)
        : "memory");
  }
}

// The first CTA of a cluster sets up the mbarrier that counts the parts the others push (add_warp_parts), in two
// steps around the CTA's barrier after its table fill: `init` before it, then `arm` (expect all the pushed bytes)
// after it, so that no thread uses the mbarrier unordered with its init (racecheck flagged init and expect_tx by one
// thread with nothing between them: NOTES gemv row 134b); then every CTA arrives at the cluster barrier, which the
// others wait on before they push.
template <int kMTiles, int kNTiles, bool kArm>
__device__ __forceinline__ void tc_cluster_push_setup(const uint8_t* table) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Cta = TcCta<kMTiles, kNTiles, true>;
  const cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
  const unsigned ctas = cluster.num_blocks();
  if (ctas < 2) return;
  if (cluster.block_rank() == 0 && threadIdx.x == 0) {
    const uint32_t bar = static_cast<uint32_t>(__cvta_generic_to_shared(table + kTcPushBarrierOffset));
    if constexpr (!kArm) {
      mbarrier_init(bar, 1);
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    } else {
      mbarrier_expect_bytes(bar, (ctas - 1) * Cta::kWarps * kTcPushedPartFloats<kNTiles> * sizeof(float));
    }
  }
  if constexpr (kArm) cluster_arrive_release();
#endif
}

// The end of tc_gemv_kernel with one CTA per tile, or one cluster of CTAs per tile (tile blockIdx.x / the
// cluster's size, shared out over the cluster's warps in CTA order): each warp puts its sums (zeros if it had
// no turns) into its own ring of stages, whose copies have all landed, as [x row][tile row] fp32; then the
// cluster's first CTA adds the parts of every warp of the cluster in warp order (the other CTAs' as they pushed
// them into its table's free halves), adds the bias, and writes the tile's outputs. The host launches clusters only
// on sm_90, for two n-tiles (kPush).
template <typename T, int kMTiles, int kNTiles>
__device__ __forceinline__ void add_warp_parts(const float (&acc)[kMTiles][kNTiles][4], const uint8_t* table,
                                               uint8_t* rings, int64_t rows,
                                               int x_rows, const T* __restrict__ bias, T* __restrict__ out) {
  using Tile = TileShape<kMTiles>;
  constexpr int kWarps = TcCta<kMTiles, kNTiles, true>::kWarps;
  constexpr int kRingBytes = kTcStages * Tile::kStageBytes;
  static_assert(8 * kNTiles * Tile::kRows * sizeof(float) <= kRingBytes, "a warp's part fits in its ring");
  const int lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  copy_async_wait<0>();
  __syncwarp();
  float* part = reinterpret_cast<float*>(rings + (threadIdx.x / 32) * kRingBytes);
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const auto [m, r] = acc_position(mt, nt, i, g, t);
        if (m < x_rows) part[m * Tile::kRows + r] = acc[mt][nt][i];
      }
    }
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (TcCta<kMTiles, kNTiles, true>::kPush) {  // the other CTAs push their parts to the first one
    const cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
    const int ctas = static_cast<int>(cluster.num_blocks());
    if (ctas > 1) {
      static_assert(!MmaOperand<T>::kSplit, "the pushed parts take the table's free halves, which split operands fill");
      const uint32_t table_shared = static_cast<uint32_t>(__cvta_generic_to_shared(table));
      const unsigned rank = cluster.block_rank();
      constexpr int kPartFloats = kTcPushedPartFloats<kNTiles>;
      if (rank != 0) {
        cluster_wait_acquire();  // the first CTA's mbarrier is set up (tc_cluster_push_setup)
        const uint32_t remote_table = cluster_address(table_shared, 0);
        const int part = ((rank - 1) * kWarps + threadIdx.x / 32) * kPartFloats;
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const auto [m, r] = acc_position(0, nt, i, g, t);
            push_float(remote_table + pushed_float_offset(part + m * Tile::kRows + r), acc[0][nt][i],
                       remote_table + kTcPushBarrierOffset);
          }
        }
        return;
      }
      cluster_wait_acquire();
      __syncthreads();  // this CTA's parts are in its rings
      mbarrier_wait_parity<true>(table_shared + kTcPushBarrierOffset, 0);  // and the other CTAs' have landed
      const int64_t first_row = int64_t{blockIdx.x / ctas} * Tile::kRows;
      for (int i = threadIdx.x; i < x_rows * Tile::kRows; i += blockDim.x) {
        const int r = i % Tile::kRows;
        if (first_row + r >= rows) continue;
        float sum = reinterpret_cast<const float*>(rings)[i];
#pragma unroll
        for (int w = 1; w < kWarps; ++w) sum += reinterpret_cast<const float*>(rings + w * kRingBytes)[i];
        for (int w = 0; w < (ctas - 1) * kWarps; ++w) {
          sum += *reinterpret_cast<const float*>(table + pushed_float_offset(w * kPartFloats + i));
        }
        const int64_t n = first_row + r;
        out[(i / Tile::kRows) * rows + n] = from_float<T>(bias != nullptr ? sum + to_float(bias[n]) : sum);
      }
      return;
    }
  }
#endif
  // One CTA per tile (the host launches clusters only on sm_90). A path of its own: with one loop over the
  // cluster's CTAs for both, Gemma's k/v (one CTA per tile) were 2-5% slower on an H200 (NOTES gemv row 56).
  __syncthreads();
  const int64_t first_row = int64_t{blockIdx.x} * Tile::kRows;
  for (int i = threadIdx.x; i < x_rows * Tile::kRows; i += blockDim.x) {
    const int m = i / Tile::kRows, r = i % Tile::kRows;
    if (first_row + r >= rows) continue;
    float sum = reinterpret_cast<const float*>(rings)[i];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) sum += reinterpret_cast<const float*>(rings + w * kRingBytes)[i];
    const int64_t n = first_row + r;
    out[m * rows + n] = from_float<T>(bias != nullptr ? sum + to_float(bias[n]) : sum);
  }
}

// Requirements (checked by tensor_core_gemv_applies): K % 256 == 0, blocksize >= 64, packed and x 16-byte
// aligned, plain absmax 16-byte / nested codes 4-byte aligned, nested blocksize >= 4,
// 1 <= x_rows <= 8 * kNTiles. `partial` holds two [x_rows][tile rows] fp32 slots per warp (tc_partial_floats);
// with kCtaPerTile (grid = the number of tiles x the cluster's size, cluster c takes tile c) it is unused and
// may be null.
// (kCtaPerTile is a template argument, not a runtime flag, because the flag cost the 1-n-tile loop two more
// register spills.)
template <typename T, int kMTiles, int kNTiles, bool kNested, bool kCtaPerTile>
__global__ void __launch_bounds__(TcCta<kMTiles, kNTiles, kCtaPerTile>::kWarps * 32, 1)
    tc_gemv_kernel(const T* __restrict__ x, const uint8_t* __restrict__ packed, BlockScales scales,
                   QuantType quant_type, int blocksize_log2, int64_t rows, int64_t cols, int x_rows,
                   const T* __restrict__ bias, T* __restrict__ out, float* __restrict__ partial) {
  let_next_kernel_start();
  extern __shared__ __align__(16) uint8_t tc_shared[];
  uint8_t* lut = tc_shared;
  float* code2 = reinterpret_cast<float*>(tc_shared + kCodePairTableBytes);
  using Tile = TileShape<kMTiles>;
  uint8_t* ring =
      tc_shared + kCodePairTableBytes + kTcCode2Bytes + (threadIdx.x / 32) * (kTcStages * Tile::kStageBytes);

  const int lane = threadIdx.x % 32;
  const int g = lane / 4;
  const int t = lane % 4;
  const TurnBlocks blocks = turn_blocks(blocksize_log2);
  const int turns = static_cast<int>(cols / kTcTurn);  // per tile
  const int64_t tiles = (rows + Tile::kRows - 1) / Tile::kRows;
  // One CTA per tile: the warp index as a uniform value (16 rows 5-6% faster on the k/v layers); the stream-K
  // instances keep threadIdx.x / 32, with which their loops spill less (2.5-6.6% faster; NOTES gemv row 70).
  constexpr int kWarps = TcCta<kMTiles, kNTiles, kCtaPerTile>::kWarps;
  const int64_t warp_id = int64_t{blockIdx.x} * kWarps + (kCtaPerTile ? warp_in_cta() : int(threadIdx.x / 32));
  const WarpTurns mine = warp_turns(warp_id, int64_t{gridDim.x} * kWarps, tiles * turns);
  const int64_t count = mine.end - mine.first;  // this warp's turns
  const int64_t first_tile = mine.first / turns;

  const uint32_t ring_shared = static_cast<uint32_t>(__cvta_generic_to_shared(ring));
  const int first_s = static_cast<int>(mine.first - first_tile * turns);
#if NF4_PREFETCH_BEFORE_WAIT
  // While the previous kernel finishes, L2 is asked for the warp's first turn: lane r the 128 bytes of tile row r.
  // (Their scales too made Llama's k/v 1-3% slower at 8-16 rows: NOTES gemv row 125.)
  if (count > 0) {
    prefetch_first_turn<Tile::kRows, false>(packed, scales, first_tile, first_s, lane, rows, cols, blocksize_log2);
  }
#endif
  // The first copies go out before the table fill, so they are in flight while it runs. (Filled before the wait,
  // as the one-row kernel's is, the table made 16 rows of x 5-27% slower on 16-row tiles, 2-4% faster on 32-row
  // ones: NOTES gemv row 69.)
  wait_for_previous_kernels();
  int64_t staged_tile = first_tile;  // where the next staged turn is (16-row tiles only, see below)
  int staged_s = first_s;
  StageSource source = stage_source<Tile::kRows>(packed, first_tile, first_s, lane, rows, cols);
  // Requests the warp's turn q (in order), which is turn q_s (possibly past the end: the next tiles) of tile
  // q_tile, into its stage, and moves `source` to the next tile after the tile's last turn. The 32-row tiles
  // take the tile change from (q_tile, q_s): kept in counters of their own there, the counters were spilled,
  // and reloading them from local memory every turn took 15% of the stall samples at 16 rows on an H200
  // (NOTES gemv rows 35-36); the 16-row tiles keep the counters, which cost them fewer instructions and spills.
  const auto stage_next = [&](int64_t q, int64_t q_tile, int q_s) {
    stage_turn<Tile::kRows, kNested>(ring_shared + (static_cast<int>(q) & (kTcStages - 1)) * Tile::kStageBytes,
                                     source, rows, cols, scales, blocksize_log2, blocks, lane);
    if constexpr (kMTiles == 2) {
      while (q_s >= turns) q_s -= turns, ++q_tile;
      if (q_s + 1 == turns) source = stage_source<Tile::kRows>(packed, q_tile + 1, 0, lane, rows, cols);
    } else {
      if (++staged_s == turns) staged_s = 0, source = stage_source<Tile::kRows>(packed, ++staged_tile, 0, lane, rows, cols);
    }
  };
  for (int q = 0; q < kTcStages - 1; ++q) {
    if (q < count) stage_next(q, first_tile, first_s + q);
    copy_async_commit();
  }

  if constexpr (TcCta<kMTiles, kNTiles, kCtaPerTile>::kPush) tc_cluster_push_setup<kMTiles, kNTiles, false>(tc_shared);
  const NestedDecode nested = fill_decode_tables<T, kNested>(lut, code2, quant_type, scales);
  __syncthreads();
  if constexpr (TcCta<kMTiles, kNTiles, kCtaPerTile>::kPush) tc_cluster_push_setup<kMTiles, kNTiles, true>(tc_shared);

  if (count <= 0 && !kCtaPerTile) {  // fewer turns than warps: an empty slot 0, which add_tile_parts_kernel adds
    for (int i = lane; i < x_rows * Tile::kRows; i += 32) partial[warp_id * 2 * x_rows * Tile::kRows + i] = 0.0f;
    return;
  }
  // In the one-CTA-per-tile instances the table's address is taken from lane 0, as in one_row_gemv_kernel: the
  // compiler then keeps it in a uniform register and each lookup loads [R+UR]; computed per lane it cost an add
  // per lookup there. The stream-K instances get [R+UR] either way, and the shuffle only moved their spills
  // (NOTES gemv row 32).
  const uint32_t lut_address = static_cast<uint32_t>(__cvta_generic_to_shared(lut));
  const uint32_t lut_shared = kCtaPerTile ? __shfl_sync(0xFFFFFFFFu, lut_address, 0) : lut_address;
  const uint32_t lane4 = 4 * lane;
  // Where the warp is: turn `s` of tile `tile`; the warp's part of the tile began at turn `part_begin`.
  int64_t tile = first_tile;
  int s = first_s;
  int part_begin = s;
  // This lane's x row g at turn s (the host takes one n-tile for x_rows <= 8, two above: XRows).
  const int x_row = g < x_rows ? g : 0;
  const T* x_turn = x + x_row * cols + 16 * t + int64_t{s} * kTcTurn;
  const XRows x_lane{g < x_rows, ((8 + g < x_rows ? 8 + g : x_rows - 1) - x_row) * cols};
  float acc[kMTiles][kNTiles][4] = {};

  // Adds the warp's sums for its part of `tile` to the output: directly when the part is the whole tile,
  // else into the warp's slot for the tile (0: its first tile, 1: its last), which add_tile_parts_kernel adds.
  const auto flush = [&](bool whole) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const auto [m, r] = acc_position(mt, nt, i, g, t);
          const int64_t n = tile * Tile::kRows + r;
          const float value = acc[mt][nt][i];
          acc[mt][nt][i] = 0.0f;
          if (m >= x_rows || n >= rows) continue;
          store_tile_sum<Tile::kRows>(value, whole, warp_id, tile == first_tile, m, n, r, x_rows, rows, bias, out,
                                      partial);
        }
      }
    }
  };

  // Each turn: request the turn kTcStages - 1 ahead into the stage the previous turn used, wait for this
  // turn's copies, decode it. The warp-wide syncs make every lane's copies visible to the others, and keep
  // a stage from being refilled while a lane still reads it.
  for (int64_t q = 0; q < count; ++q) {
    if (q + kTcStages - 1 < count) stage_next(q + kTcStages - 1, tile, s + kTcStages - 1);
    copy_async_commit();
    copy_async_wait<kTcStages - 1>();
    __syncwarp();
    const uint8_t* stage = ring + (static_cast<int>(q) & (kTcStages - 1)) * Tile::kStageBytes;
    // (the tile's rows past the end of W are zeros; their outputs are dropped)
    tc_gemv_turn<T, kMTiles, kNTiles, kNested>(stage, tile * Tile::kRows * cols, cols, s, g, t, x_turn, x_lane,
                                               lut_shared, lane4, blocksize_log2, blocks, nested, acc);
    if (!kCtaPerTile && (s + 1 == turns || q + 1 == count)) flush(part_begin == 0 && s + 1 == turns);
    x_turn += kTcTurn;
    if (++s == turns) ++tile, s = 0, part_begin = 0, x_turn -= cols;
    __syncwarp();
  }
  if constexpr (kCtaPerTile) {
    add_warp_parts<T, kMTiles, kNTiles>(acc, tc_shared, tc_shared + kCodePairTableBytes + kTcCode2Bytes, rows, x_rows,
                                        bias, out);
  }
}

// The floats tc_gemv_kernel's `partial` holds: two slots of [x_rows][tile_rows] per warp.
int64_t tc_partial_floats(int64_t warps, int64_t x_rows, int tile_rows) { return warps * 2 * x_rows * tile_rows; }

// Whether tc_gemv_kernel runs one CTA per tile: when every tile gets its own resident CTA, and a tile's turns
// are few enough (at most kTcMinTurnsPerWarp per warp of one stream-K CTA) that the stream-K grid would have no
// more CTAs than there are tiles, so one CTA per tile loses no parallelism. With warps = kWarps * tiles, the
// stream-K split (warp_turns) gives CTA c's warps exactly tile c's turns.
bool tc_cta_per_tile(int64_t tiles, int turns, int64_t resident_ctas) {
  return tiles <= resident_ctas && turns <= kTcWarps * kTcMinTurnsPerWarp;
}

// How many sharers' parts a thread of add_tile_parts_kernel loads before it adds them: a tile of s sharers costs
// about ceil(s / kAddPartsBatch) trips to L2 (Gemma's q at 16 rows on the warpgroup kernel has ~7 sharers a tile).
constexpr int kAddPartsBatch = 8;
// Threads per CTA of add_tile_parts_kernel: at most 1024 (a CTA per piece of a tile), or 128 where its grid is sized
// to be resident while the parts' writer runs (launch_add_tile_parts): CTAs of 128 threads and 32 registers (4 K) fit
// beside a 16-row warpgroup CTA (384 threads of ~140 registers), 1024-thread ones do not (NOTES gemv rows 122-123d).
constexpr int kAddPartsMaxThreads = 1024;
constexpr int kAddPartsResidentThreads = 128;
// Tiles a CTA of such a resident grid may take one after another (each is a few serial trips to L2: at 3-4 a CTA
// the gate/up layers lost 1-4% against a grid dispatched after the writer's drain, at ~1.3 the q/o layers gained).
#ifndef NF4_ADD_PARTS_MAX_TILES  // build-time knob for tuning runs
#define NF4_ADD_PARTS_MAX_TILES 2
#endif
constexpr int kAddPartsMaxTiles = NF4_ADD_PARTS_MAX_TILES;
// (its tiles' sharers are worked out by a thread each of a CTA of at least 32 threads)
static_assert(kAddPartsMaxTiles >= 1 && kAddPartsMaxTiles <= 32, "NF4_ADD_PARTS_MAX_TILES: 1 to 32");
// Consecutive outputs (tile rows of one x row) per thread of add_tile_parts_kernel, each sharer's parts of them one
// vector load and the outputs one vector store. 2 against 1 (the kernel before): -1 to -5% a call at 4 rows, -2 to -8%
// at 16 rows on an H100; 4 gained as much on the gate/up layers but lost 1-9% on the q/o layers at 4-8 rows, whose
// tiles then had too few warps (NOTES gemv rows 121-121b). A tile's rows (16, 32, 64, 192) are a multiple of it.
#ifndef NF4_ADD_PARTS_OUTPUTS  // build-time knob for tuning runs
#define NF4_ADD_PARTS_OUTPUTS 2
#endif
constexpr int kAddPartsOutputs = NF4_ADD_PARTS_OUTPUTS;
// A thread's kAddPartsOutputs values, one vector load or store: a sharer's fp32 parts, or the T outputs.
template <typename T>
struct alignas(sizeof(T) * kAddPartsOutputs) AddPartsVector {
  T v[kAddPartsOutputs];
};

// One thread's kAddPartsOutputs outputs of a shared tile, at `dst` (W rows n.. of an x row): the parts at `partial_at`
// (the thread's place in a slot; slots slot_vectors vectors apart) of sharers w_first (slot first_slot) to w_last
// (slot 0 of each later one, 2 apart) added in worker order, + bias.
template <typename T>
__device__ __forceinline__ void add_sharers_parts(const float* __restrict__ partial_at, int64_t slot_vectors,
                                                  int64_t first_slot, int64_t w_first, int64_t w_last, int64_t n,
                                                  int64_t rows, const T* __restrict__ bias, T* dst) {
  using PartVector = AddPartsVector<float>;
  const PartVector* part = reinterpret_cast<const PartVector*>(partial_at);
  const PartVector* later = part + (w_first + 1) * 2 * slot_vectors;  // the later sharers' slot 0, 2 apart
  const int later_count = static_cast<int>(w_last - w_first);
  float bias_n[kAddPartsOutputs];  // loaded with the first batch
#pragma unroll
  for (int k = 0; k < kAddPartsOutputs; ++k) bias_n[k] = bias != nullptr && n + k < rows ? to_float(bias[n + k]) : 0.0f;
  PartVector sum = part[first_slot * slot_vectors];
  for (int j0 = 0; j0 < later_count; j0 += kAddPartsBatch) {
    PartVector parts[kAddPartsBatch];
#pragma unroll
    for (int b = 0; b < kAddPartsBatch; ++b) {
      if (j0 + b < later_count) {
        parts[b] = later[(j0 + b) * 2 * slot_vectors];
      } else {
#pragma unroll
        for (int k = 0; k < kAddPartsOutputs; ++k) parts[b].v[k] = -0.0f;
      }
    }
#pragma unroll
    for (int b = 0; b < kAddPartsBatch; ++b) {  // in worker order; -0.0 adds nothing, even to -0.0
#pragma unroll
      for (int k = 0; k < kAddPartsOutputs; ++k) sum.v[k] += parts[b].v[k];
    }
  }
  AddPartsVector<T> values;
#pragma unroll
  for (int k = 0; k < kAddPartsOutputs; ++k) {
    values.v[k] = from_float<T>(bias != nullptr ? sum.v[k] + bias_n[k] : sum.v[k]);
  }
  if (n + kAddPartsOutputs <= rows && reinterpret_cast<uintptr_t>(dst) % sizeof(values) == 0) {
    *reinterpret_cast<AddPartsVector<T>*>(dst) = values;  // one store (rows even, as on every paper layer)
  } else {
#pragma unroll
    for (int k = 0; k < kAddPartsOutputs; ++k) {
      if (n + k < rows) dst[k] = values.v[k];
    }
  }
}

// For every tile that more than one worker (a warp of tc_gemv_kernel, a team of wg_gemv_kernel) shared: out = the
// workers' slots (first_sharer_slot) added in worker order (+ bias), a thread per kAddPartsOutputs outputs ([x row]
// [tile row], so consecutive threads write consecutive W rows). A tile is gridDim.y CTAs' work (pieces of blockDim.x
// threads, piece blockIdx.y); CTA (b, piece) takes tile b, then every gridDim.x tiles on, at most kTiles (1: a CTA
// per tile; kAddPartsMaxTiles: a grid sized to be resident beside the parts' writer, launch_add_tile_parts). Tiles
// one worker took whole were written by the kernel that wrote the parts, and their CTAs do nothing. The sharers are
// worked out before the wait, a thread a tile (a thread per output over the whole grid, rows 64-104, spent ~5 64-bit
// divisions an output on them, NOTES gemv row 105; until row 121 every warp of the CTA did them for itself); every
// thread also divides rows by tile_rows once (the tile count; NOTES gemv rows 123d-123e: a suspect for the gate/up
// layers' +0.5-1% at 12-16 rows, not confirmed, since the build that passed it in spilled elsewhere). Each of a tile's
// sums is the same, in the same order, whatever the grid. add_run_parts_kernel (gemv_many_rows.cu) adds its parts the
// same way; one helper for both compiled to a slower kernel here (0.3-1 us a call on an H200: NOTES gemv row 114).
template <typename T, int kTiles>
__global__ void __launch_bounds__(kAddPartsMaxThreads)
    add_tile_parts_kernel(const float* __restrict__ partial, int64_t workers, int turns, int tile_rows, int64_t rows,
                          int x_rows, const T* __restrict__ bias, T* __restrict__ out) {
  let_next_kernel_start();
  const int64_t tiles = (rows + tile_rows - 1) / tile_rows;
  __shared__ int64_t tile_sharers[kTiles][2];  // a tile's first sharer's slot, its last sharer
  if (threadIdx.x < kTiles && blockIdx.x + int64_t{threadIdx.x} * gridDim.x < tiles) {
    const int64_t tile = blockIdx.x + int64_t{threadIdx.x} * gridDim.x;
    tile_sharers[threadIdx.x][0] = first_sharer_slot(tile * turns, workers, tiles * turns);
    tile_sharers[threadIdx.x][1] = warp_of_turn((tile + 1) * turns - 1, workers, tiles * turns);
  }
  // the thread's first output's index in a tile's [x row][tile row]: kAddPartsOutputs consecutive tile rows of one
  // x row (tile_rows is a multiple of it)
  int i = (blockIdx.y * blockDim.x + threadIdx.x) * kAddPartsOutputs;
  const int m = i / tile_rows, r = i % tile_rows;
  int64_t n = int64_t{blockIdx.x} * tile_rows + r;  // the thread's first output's W row in the CTA's first tile
  int64_t out_offset = int64_t{m} * rows + n;
  // the index work ordered before the wait (the front end moved it after; ptxas still sinks part of it: NOTES gemv
  // rows 123b-123d, cuda_types.cuh computed_here)
  computed_here(i), computed_here(n), computed_here(out_offset);
  const int64_t slot_vectors = int64_t{x_rows} * tile_rows / kAddPartsOutputs;
  __syncthreads();
  int64_t first_slot = tile_sharers[0][0], last_sharer = tile_sharers[0][1];  // the CTA's first tile's
  wait_for_previous_kernels();
  if (m >= x_rows) return;
#pragma unroll
  for (int j = 0; j < kTiles; ++j) {
    if (j > 0) {  // the CTA's next tile, gridDim.x tiles on
      if (blockIdx.x + int64_t{j} * gridDim.x >= tiles) return;
      n += int64_t{gridDim.x} * tile_rows, out_offset += int64_t{gridDim.x} * tile_rows;
      first_slot = tile_sharers[j][0], last_sharer = tile_sharers[j][1];
    }
    const int64_t w_first = first_slot / 2;
    if (w_first != last_sharer && n < rows) {
      add_sharers_parts(partial + i, slot_vectors, first_slot, w_first, last_sharer, n, rows, bias, out + out_offset);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Warpgroup path (sm_90a: H100 / H200; fp16 / bf16 x, kWgMinXRows to 16 rows, the tensor-core kernel's layout):
// the tensor-core kernel's decode with wgmma. A warpgroup (4 warps) takes a tile of 64 W rows; each warp stages and
// decodes its 16 rows exactly as tc_gemv_kernel does (its ring of turn stages, the code pair table, the permuted k
// order) into wgmma's A operand, from registers, and x (wgmma's B) sits in a stage of shared memory that the
// warpgroup's team fills once per turn (a ring of stages, each handed over by an mbarrier: a thread waits only before
// a turn's first wgmma, after its first lookups; NOTES gemv row 111), so that one wgmma m64nNk16 per k-tile and warp
// replaces tc_gemv_kernel's one mma.sync per n-tile. A team is the warpgroup alone at 1-8 rows of x, and the CTA's
// three warpgroups at 9-16 (WgShape::kXGroups), where x has as many bytes as the weights: they take three adjacent
// tiles at the same turns, load each x stage once, and store it two turns ahead, so that they may drift a turn
// apart (row 115c: 16 rows 1-14% faster on an H100; stored one turn ahead, the 12 warps' barrier cost more than the
// shared x saved, rows 115-115b). Against the tensor-core kernel's 16-row tiles a warp then loads no
// x into registers (there it loaded 4x as many bytes of x as of weights at 16 rows, from L2: 16 rows of a large K fit
// in no L1), x's traffic per weight byte falls 4x, and at 9-16 rows half the mma instructions go (at 1-8 rows wgmma's N
// is 8, one per k-tile, as many as mma.sync's). Each step's 4 wgmmas start from zero and the scales go onto their fp32
// sums once their group is done; the step's wgmmas overlap the next step's decode (waiting for all but the newest
// group). 3 warpgroups per CTA (up to 168 registers) were 8-17% faster than 4 (128) in row 98's probe. Which rows
// it takes, by W's size and the GPU, and what it measured against the tensor-core kernel there: ops.h,
// kWarpgroupXRows (NOTES gemv rows 99, 101, 104, 106).
// Its second kernel (add_tile_parts_kernel) cost it 2-4.5 us a call (row 99), 1-2.5 us less since row 105's CTA
// per tile, and still 3-7.6 us at 16 rows in row 120, 1-4 us less since row 121b's two outputs a thread; adding the
// parts in the kernel, in clusters (row 100), by the last sharer (rows 102-102c) or by the first (row 141), was
// slower.
// The layers whose 16-row tiles take one CTA per tile (the k/v layers: too few tiles to fill the GPU with 64-row
// ones; 27-57% slower in row 98's probe) keep the tensor-core kernel.
// Stream-K as in tc_gemv_kernel, over teams: each takes a contiguous run of the (team tile, turn) sequence, writes
// the team tiles it takes whole and puts its parts of shared ones into two fp32 slots, which add_tile_parts_kernel
// adds in team order, so the result is the same on every run.
#ifndef NF4_WG_GROUPS
#define NF4_WG_GROUPS 3
#endif
#ifndef NF4_WG_MIN_X_ROWS
#define NF4_WG_MIN_X_ROWS 4
#endif
// How many of a CTA's warpgroups share one x stage (a team), and how many turns ahead the team stores x, for wgmma's
// N = 8 (1-8 rows of x) and N = 16 (9-16): NOTES gemv rows 115-115c.
#ifndef NF4_WG_X_GROUPS_N8
#define NF4_WG_X_GROUPS_N8 1
#endif
#ifndef NF4_WG_X_AHEAD_N8
#define NF4_WG_X_AHEAD_N8 1
#endif
#ifndef NF4_WG_X_GROUPS_N16
#define NF4_WG_X_GROUPS_N16 3
#endif
#ifndef NF4_WG_X_AHEAD_N16
#define NF4_WG_X_AHEAD_N16 2
#endif
constexpr int kWgGroups = NF4_WG_GROUPS;         // warpgroups per CTA, one CTA per SM (they share one table)
constexpr int kWgWarps = 4 * kWgGroups;
constexpr int kWgTileRows = 4 * kTcMmaRows;      // wgmma's M
constexpr int kWgMinXRows = NF4_WG_MIN_X_ROWS;
constexpr int kWgXCoreBytes = 128;               // a core matrix of wgmma's B: 8 rows of x x 8 k values
// wgmma's B for k-tile j of step u: kN rows of x x 16 k, as core matrices (K-major, no swizzle): the two along K
// (logical k 0-7, 8-15) kWgXCoreBytes apart (the descriptor's leading byte offset), the ones along N (x rows 0-7,
// 8-15) 2 x kWgXCoreBytes apart (its stride byte offset).
// A team (kXGroups warpgroups that share one x stage a turn) takes a team tile: its groups' kXGroups adjacent 64-row
// tiles, at the same turns. It stores x kXAhead turns ahead into a ring of 2 kXAhead stages, so its groups may drift
// up to kXAhead - 1 turns apart.
template <int kN>
struct WgShape {
  static constexpr int kKTileBytes = kN * 16 * 2;
  static constexpr int kXStageBytes = 4 * kTcTurnSteps * kKTileBytes;  // a turn's 16 k-tiles
  static constexpr int kXGroups = kN == 16 ? NF4_WG_X_GROUPS_N16 : NF4_WG_X_GROUPS_N8;
  static constexpr int kXAhead = kN == 16 ? NF4_WG_X_AHEAD_N16 : NF4_WG_X_AHEAD_N8;
  static constexpr int kXSlots = 2 * kXAhead;
  static constexpr int kTeams = kWgGroups / kXGroups;  // per CTA
  static constexpr int kTeamWarps = 4 * kXGroups;
  static constexpr int kTeamRows = kXGroups * kWgTileRows;
  static_assert(kXGroups >= 1 && kWgGroups % kXGroups == 0, "NF4_WG_X_GROUPS_*: a divisor of NF4_WG_GROUPS");
  static_assert(kXAhead >= 1 && (kXAhead & (kXAhead - 1)) == 0, "NF4_WG_X_AHEAD_*: a power of two");
  // A stage's 512-byte pieces (combos: a warp's 32 lanes x 16 bytes), shared out over the team's warps: a warp takes a
  // run of kXLoads consecutive ones where they share out evenly, else every kTeamWarps-th from its first.
  static constexpr int kXCombos = kXStageBytes / 512;
  static constexpr int kXLoads = (kXCombos + kTeamWarps - 1) / kTeamWarps;
  static constexpr bool kXRun = kXCombos % kTeamWarps == 0;
  static_assert(!kXRun || 8 % kXLoads == 0, "a warp's run of combos stays in one x row");
  static constexpr int kXRingsOffset = kCodePairTableBytes + kTcCode2Bytes + kWgWarps * kTcStages *
                                       TileShape<1>::kStageBytes;
  static constexpr int kXFullOffset = kXRingsOffset + kTeams * kXSlots * kXStageBytes;  // then a barrier per stage
  static constexpr int kSharedBytes = kXFullOffset + kTeams * kXSlots * kMbarrierBytes;
};

// The x stages' "full" barriers (mbarriers in shared memory, one per stage): each of the team's threads arrives once
// it has stored and fenced its part of the stage, and waits on the phase before the stage's first wgmma.
__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// Where x row n's logical k values 8h + 2t, + 1 of k-tile j of step u go in an x stage. In the permuted k order
// (tc_gemv_turn) those are the step's elements 16t + 4j + 2h, + 1.
template <int kN>
__device__ __forceinline__ uint32_t wg_x_offset(int u, int j, int n, int h, int t) {
  return (u * 4 + j) * WgShape<kN>::kKTileBytes + (n >> 3) * 2 * kWgXCoreBytes + h * kWgXCoreBytes + (n & 7) * 16 +
         t * 4;
}

// The shared-memory matrix descriptor of a k-tile's B at shared-window address `address` (no swizzle).
__device__ __forceinline__ uint64_t wg_x_descriptor(uint32_t address) {
  return uint64_t((address & 0x3FFFF) >> 4) | uint64_t(kWgXCoreBytes >> 4) << 16 |
         uint64_t((2 * kWgXCoreBytes) >> 4) << 32;
}

// d (kN / 2 fp32 per lane) = A (this warp's 16 rows, from registers) x B (descriptor), plus d when `accumulate`.
// (sm_90a only: called from wg_gemv_kernel's sm_90a body alone.)
template <typename T, int kN>
__device__ __forceinline__ void wgmma_k16(float (&d)[kN / 2], const uint32_t (&a)[4], uint64_t b, bool accumulate) {
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  if constexpr (kN == 16 && kBf16) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\nwgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(int{accumulate}));
  } else if constexpr (kN == 16) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\nwgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(int{accumulate}));
  } else if constexpr (kBf16) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\nwgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(int{accumulate}));
  } else {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\nwgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(int{accumulate}));
  }
}

// Requirements (checked by wg_gemv_applies): tc_gemv_kernel's, sm_90a, kWgMinXRows <= x_rows <= kN. `partial`
// holds two [x_rows][WgShape<kN>::kTeamRows] fp32 slots per team (tc_partial_floats).
template <typename T, int kN, bool kNested>
__global__ void __launch_bounds__(kWgWarps * 32, 1)
    wg_gemv_kernel(const T* __restrict__ x, const uint8_t* __restrict__ packed, BlockScales scales,
                   QuantType quant_type, int blocksize_log2, int64_t rows, int64_t cols, int x_rows,
                   const T* __restrict__ bias, T* __restrict__ out, float* __restrict__ partial) {
  let_next_kernel_start();
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // elsewhere a trap, which no call reaches (wg_kernel_runs_here)
  using Shape = WgShape<kN>;
  using Tile16 = TileShape<1>;
  constexpr int kAcc = kN / 2;  // wgmma's fp32 sums per lane: W rows g, g + 8 x (kN / 8) x (x rows 2t, 2t + 1)
  extern __shared__ __align__(128) uint8_t wg_shared[];
  uint8_t* lut = wg_shared;
  float* code2 = reinterpret_cast<float*>(wg_shared + kCodePairTableBytes);
  // a uniform warp index: the warp's ring and its team's x ring and barriers in shared memory, the table's base and
  // wgmma's descriptors built from them live in uniform registers (NOTES gemv row 103)
  const int warp = warp_in_cta();
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int group = warp / 4, warp_in_group = warp % 4;  // the warp's rows of its group's tile: 16 x warp_in_group
  const int team = group / Shape::kXGroups, group_in_team = group % Shape::kXGroups;
  const int warp_in_team = warp % Shape::kTeamWarps;
  uint8_t* ring = wg_shared + kCodePairTableBytes + kTcCode2Bytes + warp * (kTcStages * Tile16::kStageBytes);
  uint8_t* x_ring = wg_shared + Shape::kXRingsOffset + team * Shape::kXSlots * Shape::kXStageBytes;
  // the team's x stages' barriers: stage slot's at x_full + kMbarrierBytes * slot
  const uint32_t x_full = static_cast<uint32_t>(__cvta_generic_to_shared(wg_shared + Shape::kXFullOffset)) +
                          team * Shape::kXSlots * kMbarrierBytes;
  const uint32_t lut_shared = static_cast<uint32_t>(__cvta_generic_to_shared(lut));
  const uint32_t ring_shared = static_cast<uint32_t>(__cvta_generic_to_shared(ring));
  const uint32_t x_ring_shared = static_cast<uint32_t>(__cvta_generic_to_shared(x_ring));
  const uint32_t lane4 = 4 * lane;
  const TurnBlocks blocks = turn_blocks(blocksize_log2);
  const int turns = static_cast<int>(cols / kTcTurn);  // per tile
  const int64_t tiles = (rows + Shape::kTeamRows - 1) / Shape::kTeamRows;  // team tiles
  const int64_t team_id = int64_t{blockIdx.x} * Shape::kTeams + team;
  const WarpTurns mine = warp_turns(team_id, int64_t{gridDim.x} * Shape::kTeams, tiles * turns);
  const int64_t count = mine.end - mine.first;  // the team's turns (each of its groups')
  const int64_t first_tile = mine.first / turns;
  const int first_s = static_cast<int>(mine.first - first_tile * turns);
#if NF4_PREFETCH_BEFORE_WAIT
  // While the previous kernel (in a chain, the last call's adding kernel) finishes, L2 is asked for the warp's first
  // turn, its 16-row tile's (warp_tile16's below) weights and scales (each block's own entry, never its state2.absmax
  // line: prefetch_block_scale), and by the first warp for nested absmax's map and offset: on an H100 4-6% off 4-16
  // rows on Gemma's and Qwen's q/o layers, 3% off Llama's at 12-16; on an H200 within the noise (NOTES gemv rows 126,
  // 128; the map and offset's part alone measured even on an H100, row 129).
  if (count > 0) {
    prefetch_first_turn<Tile16::kRows, true>(packed, scales,
                                             4 * (Shape::kXGroups * first_tile + group_in_team) + warp_in_group,
                                             first_s, lane, rows, cols, blocksize_log2);
  }
  if (kNested && threadIdx.x < 32) prefetch_nested_tables(scales, lane);
#endif
  wait_for_previous_kernels();

  // The warp's 16 rows of team tile `tile` are 16-row tile 4 (kXGroups x tile + group_in_team) + warp_in_group (past
  // W's last row where a last team tile has fewer 64-row tiles: zero-filled, and dropped by the flush).
  const auto warp_tile16 = [&](int64_t tile) { return 4 * (Shape::kXGroups * tile + group_in_team) + warp_in_group; };
  int64_t staged_tile = first_tile;
  int staged_s = first_s;
  StageSource source = stage_source<Tile16::kRows>(packed, warp_tile16(first_tile), first_s, lane, rows, cols);
  const auto stage_next = [&](int64_t q) {
    stage_turn<Tile16::kRows, kNested>(ring_shared + (static_cast<int>(q) & (kTcStages - 1)) * Tile16::kStageBytes,
                                       source, rows, cols, scales, blocksize_log2, blocks, lane);
    if (++staged_s == turns) {
      staged_s = 0;
      source = stage_source<Tile16::kRows>(packed, warp_tile16(++staged_tile), 0, lane, rows, cols);
    }
  };
  for (int q = 0; q < kTcStages - 1; ++q) {
    if (q < count) stage_next(q);
    copy_async_commit();
  }
  const NestedDecode nested = fill_decode_tables<T, kNested>(lut, code2, quant_type, scales);

  // x: for combo c of a stage (Shape::kXCombos; the team's warp w takes c = c_first + kXStride i, i < kXLoads) lane
  // (rn, tt) = (lane / 4, lane % 4) loads 16 bytes of x row 8 (c >> 3) + rn, step (c >> 1) & 3, elements 16 tt +
  // 8 (c & 1) .. + 7, and stores its 4 words where wg_x_offset puts them: each store instruction fills the 32 (rn, tt)
  // word slots of a core matrix row pair, so no two lanes share a bank. Where the combos share out evenly (kXRun), a
  // warp's run of kXLoads (which divides 8) all read one x row, at steps step(c_first) + i / 2 (no carry past step 3):
  // one address and one stage offset serve them all, the rest constant offsets from those (NOTES gemv row 112).
  // Lanes of rows past x's last read row 0 instead: an x row feeds only its own column of wgmma's sums, and the flush
  // and add_tile_parts_kernel drop those columns.
  constexpr int kXLoads = Shape::kXLoads, kXStride = Shape::kXRun ? 1 : Shape::kTeamWarps;
  const int c_first = Shape::kXRun ? kXLoads * warp_in_team : warp_in_team;
  const auto has_combo = [&](int i) { return Shape::kXRun || c_first + kXStride * i < Shape::kXCombos; };  // uniform
  const int rn = lane / 4, tt = lane % 4;
  const T* x_lane[kXLoads];   // load i's address at turn 0
  uint32_t x_stage_offset[kXLoads];  // and its first word's offset in a stage
#pragma unroll
  for (int i = 0; i < kXLoads; ++i) {
    if (Shape::kXRun && i > 0) {
      x_lane[i] = x_lane[0] + (i / 2) * kTcStep + 8 * (i % 2);
      x_stage_offset[i] = x_stage_offset[0] + (4 * (i / 2) + 2 * (i % 2)) * Shape::kKTileBytes;
    } else {
      const int c = c_first + kXStride * i, x_row = 8 * (c >> 3) + rn, step = (c >> 1) & 3, half = c & 1;
      x_lane[i] = x + int64_t{x_row < x_rows ? x_row : 0} * cols + step * kTcStep + 16 * tt + 8 * half;
      x_stage_offset[i] = wg_x_offset<kN>(step, 2 * half, x_row, 0, tt);
    }
  }
  uint4 x_words[kXLoads];
  const auto load_x = [&](int s, uint4(&words)[kXLoads]) {
#pragma unroll
    for (int i = 0; i < kXLoads; ++i) {
      if (has_combo(i)) words[i] = __ldg(reinterpret_cast<const uint4*>(x_lane[i] + int64_t{s} * kTcTurn));
    }
  };
  const auto store_x = [&](int slot, const uint4(&words)[kXLoads]) {
    uint8_t* stage = x_ring + slot * Shape::kXStageBytes;
#pragma unroll
    for (int i = 0; i < kXLoads; ++i) {
      if (!has_combo(i)) continue;
      const uint32_t lane_words[4] = {words[i].x, words[i].y, words[i].z, words[i].w};
#pragma unroll
      for (int w = 0; w < 4; ++w) {  // elements 8 (c & 1) + 2w, + 1 of lane tt's 16: k-tile + w / 2, half w % 2
        const int offset = (w / 2) * Shape::kKTileBytes + (w % 2) * kWgXCoreBytes;
        *reinterpret_cast<uint32_t*>(stage + x_stage_offset[i] + offset) = lane_words[w];
      }
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the stores, made visible to wgmma's reads
  };
  const auto next_turn = [&](int s) { return s + 1 == turns ? 0 : s + 1; };
  if (threadIdx.x % (32 * Shape::kTeamWarps) == 0) {
#pragma unroll
    for (int slot = 0; slot < Shape::kXSlots; ++slot) {
      mbarrier_init(x_full + kMbarrierBytes * slot, 32 * Shape::kTeamWarps);
    }
  }
  // the first kXAhead turns' x, requested before the barrier
  uint4 x_first[Shape::kXAhead][kXLoads];
  int x_s = first_s;  // then the turn of the x stage stored next
#pragma unroll
  for (int a = 0; a < Shape::kXAhead; ++a) {
    if (a < count) load_x(x_s, x_first[a]);
    x_s = next_turn(x_s);
  }
  __syncthreads();  // the table and the barriers
  // No turns for this team (fewer team turns than teams: not under wg_gemv_applies' rule, whose layers all have more
  // turns than warpgroups; kept so that the kernel stays right for any launch): an empty slot 0, which
  // add_tile_parts_kernel adds.
  if (count <= 0) {
    for (int i = threadIdx.x % (32 * Shape::kTeamWarps); i < x_rows * Shape::kTeamRows; i += 32 * Shape::kTeamWarps) {
      partial[team_id * 2 * x_rows * Shape::kTeamRows + i] = 0.0f;
    }
    return;
  }
#pragma unroll
  for (int a = 0; a < Shape::kXAhead; ++a) {
    if (a < count) store_x(a, x_first[a]), mbarrier_arrive(x_full + kMbarrierBytes * a);
  }

  // k-tile (u, j)'s descriptor is the ring's plus the k-tile's offset in 16-byte units: the address field (bits 0-13)
  // holds shared-window addresses >> 4 up to 256 KB, so an offset inside the ring carries into no other field.
  static_assert(Shape::kSharedBytes + 1024 <= (1 << 18), "shared addresses (after 1 KB reserved) under 256 KB");
  const uint64_t x_ring_descriptor = wg_x_descriptor(x_ring_shared);
  int64_t tile = first_tile;
  int s = first_s;
  int part_begin = s;
  float acc[kAcc] = {};
  // Adds the warp's sums for its part of team tile `tile` to the output: directly when the part is the whole tile,
  // else into the team's slot for the tile (0: its first tile, 1: its last).
  const auto flush = [&](bool whole) {
#pragma unroll
    for (int i = 0; i < kAcc; ++i) {
      const int m = 8 * (i / 4) + 2 * t + i % 2;  // wgmma's accumulator i: W row g + 8 ((i / 2) % 2), x row m
      const int r = kWgTileRows * group_in_team + kTcMmaRows * warp_in_group + g + 8 * ((i / 2) % 2);
      const int64_t n = tile * Shape::kTeamRows + r;
      const float value = acc[i];
      acc[i] = 0.0f;
      if (m >= x_rows || n >= rows) continue;
      store_tile_sum<Shape::kTeamRows>(value, whole, team_id, tile == first_tile, m, n, r, x_rows, rows, bias, out,
                                       partial);
    }
  };

  for (int64_t q = 0; q < count; ++q) {
    const int slot = static_cast<int>(q) & (Shape::kXSlots - 1);
    const uint32_t x_phase = static_cast<uint32_t>(static_cast<uint64_t>(q) / Shape::kXSlots) & 1;
    const bool more = q + 1 < count, x_more = q + Shape::kXAhead < count;
    if (q + kTcStages - 1 < count) stage_next(q + kTcStages - 1);
    copy_async_commit();
    if (x_more) load_x(x_s, x_words);
    copy_async_wait<kTcStages - 1>();
    __syncwarp();
    const uint8_t* stage = ring + (static_cast<int>(q) & (kTcStages - 1)) * Tile16::kStageBytes;
    const int64_t rows_start = warp_tile16(tile) * Tile16::kRows * cols;
    float scale_lo[kTcTurnSteps], scale_hi[kTcTurnSteps];
    turn_scales<kNested>(stage + Tile16::kStageWeightBytes + g * kTcRowScaleBytes, rows_start + g * cols, s,
                         blocksize_log2, blocks, nested, scale_lo);
    turn_scales<kNested>(stage + Tile16::kStageWeightBytes + (g + 8) * kTcRowScaleBytes, rows_start + (g + 8) * cols,
                         s, blocksize_log2, blocks, nested, scale_hi);
    const uint64_t x_descriptor = x_ring_descriptor + slot * (Shape::kXStageBytes >> 4);
    float sums[2][kAcc];
    const auto add_step = [&](int u) {  // acc += the step's scales x its sums, once its wgmmas are done
#pragma unroll
      for (int i = 0; i < kAcc; ++i) acc[i] = fmaf((i / 2) % 2 ? scale_hi[u] : scale_lo[u], sums[u & 1][i], acc[i]);
    };
    // each step's weight words are read one step ahead, before the previous step's wgmmas are waited on
    uint2 lo = *reinterpret_cast<const uint2*>(stage + stage_weight_offset(g, 0, t));
    uint2 hi = *reinterpret_cast<const uint2*>(stage + stage_weight_offset(g + 8, 0, t));
#pragma unroll
    for (int u = 0; u < kTcTurnSteps; ++u) {
      uint32_t a[4][4];
#pragma unroll
      for (int j = 0; j < 4; ++j) a_fragment(j, lo, hi, lut_shared, lane4, a[j]);
      if (u + 1 < kTcTurnSteps) {
        lo = *reinterpret_cast<const uint2*>(stage + stage_weight_offset(g, u + 1, t));
        hi = *reinterpret_cast<const uint2*>(stage + stage_weight_offset(g + 8, u + 1, t));
      }
      // the turn's x stage: stored by the whole team (turn q's is the (q / kXSlots)th phase of its barrier)
      if (u == 0) mbarrier_wait_parity(x_full + kMbarrierBytes * slot, x_phase);
      asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        wgmma_k16<T, kN>(sums[u & 1], a[j], x_descriptor + ((u * 4 + j) * Shape::kKTileBytes >> 4), j > 0);
      }
      asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
      if (u > 0) {
        asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
        add_step(u - 1);
      }
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    add_step(kTcTurnSteps - 1);
    if (s + 1 == turns || !more) flush(part_begin == 0 && s + 1 == turns);
    if (s + 1 == turns) ++tile, part_begin = 0;
    s = next_turn(s);
    __syncwarp();  // the W stage is read before it is refilled
    // The x stage refilled here (turn q + kXAhead's) was last read by turn q - kXAhead's wgmmas, which every thread of
    // the team waited for (wait_group 0) before it arrived on this turn's barrier, which this thread waited on.
    if (x_more) {
      const int x_slot = static_cast<int>(q + Shape::kXAhead) & (Shape::kXSlots - 1);
      store_x(x_slot, x_words), mbarrier_arrive(x_full + kMbarrierBytes * x_slot);
      x_s = next_turn(x_s);
    }
  }
#else
  wait_for_previous_kernels();
  __trap();
#endif
}

// ---------------------------------------------------------------------------------------------------------
// One-row path (one row of x, plain or nested absmax, K % 256 == 0, W rows starting on absmax block boundaries
// (K % blocksize == 0), sm_80+, at least kOrMinStepsPerWarp steps per warp): no shared-memory staging.
// Each lane loads its own weight bytes and scales straight into registers, kOrDepth steps ahead of the step
// it decodes, so a warp keeps kOrDepth x kOrRows x 256 bytes in flight
// without cp.async's write and read of every byte through shared memory and without a warp-wide wait per
// turn (benchmarks/NOTES.md, gemv row 27).
// A step is kOrRows W rows x 256 packed bytes (512 elements); lane (g, t) holds bytes 32g + 8t .. + 7 of each
// row's step. The mma's 16 A rows are 2 W rows x 8 K segments of 64 elements (A row g: W row 2mt, segment g;
// A row g + 8: W row 2mt + 1, segment g) and its 8 columns are x's 8 segments (lane (g, t) feeds column g
// with the x values of its own weight bytes), so column g of A rows g and g + 8 holds segment g's dot
// product: the product is the mma result's diagonal, and the tile's 8 segments are added by shuffles when
// the warp leaves the tile (NOTES gemv row 26). A segment is one 64-element absmax piece (rows start on a block
// and blocksize >= 64), so each A row's scale goes onto the mma's fp32 sums once per step. Where K % 512 == 256
// (kHalfStep: Gemma's K = 5376) each row's last step is a half step: segments 4-7 lie past the row, and their
// lanes load no weights, scales or x but zeros, so their products are zero (NOTES gemv row 52). The k order inside a
// segment is the tensor-core path's (lane t's 16 consecutive elements, k-tile j its bytes 2j and 2j + 1).
// Each CTA owns a contiguous range of W rows (the rows split evenly over the CTAs, one per SM), tiled from its
// first row, its last tile partial; its (tile, step) sequence is split over its warps as the tensor-core path
// splits its turns, and the tiles that two of its warps share are added in shared memory at the CTA's end, so
// no parts leave the CTA and no second kernel runs (NOTES gemv row 37).
#ifndef NF4_OR_ROWS  // build-time knobs for tuning runs (benchmarks/NOTES.md)
#define NF4_OR_ROWS 4
#endif
#ifndef NF4_OR_DEPTH
#define NF4_OR_DEPTH 3
#endif
// W rows per tile (kOrRows / 2 m-tiles, sharing each x load) and steps loaded ahead per warp: 4 and 3 were
// the fastest on an H100 and an H200 of 8 x 2 (row 27's choice, made before row 31 trimmed the loads), 8 x 3
// at 12 warps, 6 x 2, 6 x 3, 4 x 2, 4 x 4 and 2 x 6 at 16 warps per SM (NOTES gemv rows 44-45): 1-5% on the
// largest layers, more where a CTA's last tile is mostly empty rows (Gemma's down: 40-41 rows per CTA). The ring
// has one slot more than the steps in flight: a step is decoded from its slot, which is then refilled, so no
// slot is copied out first (NOTES gemv row 31).
constexpr int kOrRows = NF4_OR_ROWS;
constexpr int kOrDepth = NF4_OR_DEPTH;
constexpr int kOrRing = kOrDepth + 1;
constexpr int kOrStepBytes = 256;           // packed bytes per W row per step: 32 lanes x 8
constexpr int kOrStep = 2 * kOrStepBytes;   // K elements per step; the path needs K % (kOrStep / 2) == 0
constexpr int kOrHalfStepSegments = 4;      // the 64-element segments (lanes g) of a half step
#ifndef NF4_OR_WARPS
#define NF4_OR_WARPS 16
#endif
constexpr int kOrWarps = NF4_OR_WARPS;      // warps per CTA, one CTA per SM (they share one table)
// Layers with fewer steps per warp keep the tensor-core kernel. With 4-row tiles Llama's and Qwen's q/o layers
// (16 and 10 steps per warp) took this kernel and were 11-19% faster than on the tensor-core kernel on both
// GPUs (NOTES gemv rows 44-45; with 8-row tiles they had been 3-9% slower, rows 27 and 34), Gemma's q/o (5.5)
// 17-21% (row 53), Llama's k/v (2) 4-9% and Gemma's k/v (2.75) the same to 0.1 us (row 53), and Qwen's k/v (1.25)
// 11% at one row of bf16 x and 16% on nested absmax on an H100, 3% at 2 rows, even at 3 (row 140), where the
// tensor-core kernel's one CTA per 16-row tile left half the SMs idle. So every layer that gives each warp a step
// (the kernel needs one) takes it, for every x dtype (fp32 x has no tensor-core kernel; on the smallest layers it
// took the CUDA-core kernel, slower than bitsandbytes on Qwen's k/v: row 57).
constexpr int kOrMinStepsPerWarp = 1;
static_assert(kOrRows % 2 == 0 && kOrRows <= 32, "NF4_OR_ROWS: even, at most 32 (one lane writes each row)");
// Rows of fp16 / bf16 x that one launch of the one-row kernel takes together: each step's weights are decoded once
// (the byte permutes and table reads that bound the kernel) and feed one set of mmas per row of x, whose x loads,
// mmas and scale FMAs are all that a row adds. One instance per row count up to kOrMaxXRows; which W take how many
// rows, by size and memory class: ops.h one_row_gemv_max_x_rows. On an H100, 2 rows took 8-30% less time than on the
// tensor-core kernel, 3 rows 2-20% less from 8 to 62.5 MiB of packed W; 4 rows (8 mmas per row and step, 7 of 8 of
// their products off the diagonal) 6-14% more on the Llama layers (NOTES gemv rows 79 and 84).
#ifndef NF4_OR_MAX_X_ROWS
#define NF4_OR_MAX_X_ROWS 3
#endif
constexpr int kOrMaxXRows = NF4_OR_MAX_X_ROWS;
// The ring of steps in flight for several rows of x: each row's x words and sums take registers that one row's
// instance gives the ring (128 per thread at 16 warps per SM).
#ifndef NF4_OR_X_ROWS_DEPTH
#define NF4_OR_X_ROWS_DEPTH 2
#endif
constexpr int kOrXRowsRing = NF4_OR_X_ROWS_DEPTH + 1;
static_assert(kOrMaxXRows >= 1 && kOrMaxXRows <= 4, "NF4_OR_MAX_X_ROWS: 1 to 4");
static_assert(kOrRows * kOrMaxXRows <= 32, "one lane writes each (x row, W row) sum of a tile");

// Loads that skip L1: the weights and scales are read once, and L1 is left to x, which every warp rereads.
__device__ __forceinline__ uint2 load_once_8(const uint8_t* from) {
  uint2 v;
  asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "l"(from));
  return v;
}
__device__ __forceinline__ float load_once_f32(const float* from) {
  float v;
  asm("ld.global.nc.L1::no_allocate.f32 %0, [%1];\n" : "=f"(v) : "l"(from));
  return v;
}
__device__ __forceinline__ uint32_t load_once_u8(const uint8_t* from) {
  uint32_t v;
  asm("ld.global.nc.L1::no_allocate.u8 %0, [%1];\n" : "=r"(v) : "l"(from));
  return v;
}
// A block's scale as the one-row kernel loads it: the fp32 absmax, or (nested) its uint8 code.
__device__ __forceinline__ float load_once_scale(const float* from) { return load_once_f32(from); }
__device__ __forceinline__ uint32_t load_once_scale(const uint8_t* from) { return load_once_u8(from); }

// Nested absmax on the one-row kernel: the codes are loaded with the weights (1 byte per row and step where plain
// absmax takes 4), and each is turned into its fp32 scale when the step is decoded, from two shared-memory tables
// filled at the CTA's start: the 256-entry code map (state2.code) and the CTA's range of nested absmax values
// (state2.absmax), at most kOrNestedMaxBlocks of them (one_row_gemv_applies). The value is bitsandbytes' nested
// math, as dequantize's (BlockScales::nested_absmax_value). NOTES gemv row 61.
// Lane (g, t) loads and converts the code of tile row t alone and the 4 lanes of segment g share their scales by
// shuffles: each scale is worked out once per warp, where every lane had converted all kOrRows rows' codes (4 times
// the nested math, the loop's +15% of instructions over plain absmax; NOTES gemv row 132).
constexpr int kOrCode2Floats = kNestedCodeEntries;
constexpr int kOrNestedMaxBlocks = 4096;
constexpr int kOrNestedSharedBytes = (kOrCode2Floats + kOrNestedMaxBlocks) * 4;

// The nested absmax values CTA ranges need at most: those of the blocks of ceil(N / ctas) rows, starting anywhere in
// a nested block. The kernel clamps the index for the rows past the CTA's end, whose outputs are dropped.
__host__ __device__ inline int64_t one_row_nested_blocks(int64_t rows, int64_t ctas, int64_t row_scales,
                                                         int nested_blocksize_log2) {
  return ((rows + ctas - 1) / ctas * row_scales >> nested_blocksize_log2) + 2;
}

// The W rows of CTA `cta` of `ctas`: [first, end).
struct CtaRows {
  int64_t first, end;
};
__host__ __device__ inline CtaRows cta_rows(int64_t cta, int64_t ctas, int64_t rows) {
  return CtaRows{cta * rows / ctas, (cta + 1) * rows / ctas};
}

// Lane (g, t)'s 16 consecutive x values of a step (the mma's B fragments of its 4 k-tiles: k-tile j takes
// words 2j and 2j + 1) as 8 words of two operand values each, and with split operands (fp32 x) their lo parts
// too. With kMaybeOutside, zeros where `inside` is false (a half step's upper lanes, past the row's end).
template <typename T, bool kMaybeOutside>
__device__ __forceinline__ void one_row_x(const T* from, bool inside, uint32_t (&x_hi)[8], uint32_t (&x_lo)[8]) {
  constexpr int kLoads = 16 * sizeof(T) / sizeof(uint4);
  const uint4* from16 = reinterpret_cast<const uint4*>(from);
  uint4 v[kLoads];
#pragma unroll
  for (int i = 0; i < kLoads; ++i) v[i] = kMaybeOutside ? load_16_or_zero(inside, from16 + i) : __ldg(from16 + i);
  if constexpr (!MmaOperand<T>::kSplit) {
#pragma unroll
    for (int i = 0; i < kLoads; ++i) x_hi[4 * i] = v[i].x, x_hi[4 * i + 1] = v[i].y, x_hi[4 * i + 2] = v[i].z,
                                     x_hi[4 * i + 3] = v[i].w;
  } else {
    using M = typename MmaOperand<T>::type;
    const float* values = reinterpret_cast<const float*>(v);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float first = values[2 * i], second = values[2 * i + 1];
      x_hi[i] = uint32_t(operand_part<M>(first, 0)) | uint32_t(operand_part<M>(second, 0)) << 16;
      x_lo[i] = uint32_t(operand_part<M>(first, 1)) | uint32_t(operand_part<M>(second, 1)) << 16;
    }
  }
}

// kNested: `absmax` is unused and `nested` holds the scales (BlockScales, nested), `nested_blocks` values of
// state2.absmax per CTA (one_row_nested_blocks).
// kXRows: rows of x decoded together (x_rows of them; launch_one_row_gemv takes the instance of x_rows rows, and
// with fewer the kernel would repeat the last row up to kXRows); 1 for one row and for kRowLoop, whose rows of x go
// one after another.
template <typename T, bool kHalfStep, bool kRowLoop, bool kNested, int kXRows>
__global__ void __launch_bounds__(kOrWarps * 32, 1)
    one_row_gemv_kernel(const T* __restrict__ x, const uint8_t* __restrict__ packed, const float* __restrict__ absmax,
                        QuantType quant_type, int blocksize_log2, int64_t rows, int64_t cols, int x_rows,
                        const T* __restrict__ bias, T* __restrict__ out, BlockScales nested, int nested_blocks) {
  static_assert(kXRows >= 1 && kXRows <= kOrMaxXRows && (kXRows == 1 || (!kRowLoop && !MmaOperand<T>::kSplit)),
                "several rows of x decoded together: fp16 / bf16 x, no row loop");
  constexpr int kRing = kXRows == 1 ? kOrRing : kOrXRowsRing;
  constexpr int kSums = kXRows * kOrRows;  // a tile's outputs: (x row, W row), x row major
  let_next_kernel_start();
  using M = typename MmaOperand<T>::type;
  using ScaleSource = std::conditional_t<kNested, uint8_t, float>;  // what the loads read per block
  using ScaleWord = std::conditional_t<kNested, uint32_t, float>;   // what the ring holds per row and step
  // Nested: the ring holds the code of the lane's own tile row (t) only.
  static_assert(!kNested || kOrRows == 4, "nested: one tile row per lane t, 4 rows");
  constexpr int kScaleSlots = kNested ? 1 : kOrRows;
  extern __shared__ __align__(16) uint8_t or_lut[];
  // the parts of the CTA's shared tiles: [warp][0: its first tile, 1: its last][tile row]
  __shared__ float tile_parts[kOrWarps][2][kSums];
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int lane_byte = 32 * g + 8 * t;
  const int steps = static_cast<int>(cols / kOrStep) + (kHalfStep ? 1 : 0);  // per tile, a last half step counted
  // Whether the lane's segment of step s lies in the row: all but the upper lanes of a last half step.
  const auto segment_in_row = [&](int s) { return !kHalfStep || s + 1 < steps || g < kOrHalfStepSegments; };
  const int64_t row_bytes = cols / 2;
  const int64_t row_scales = cols >> blocksize_log2;  // whole blocks per W row (the host's rule)
  // From here on rows, tiles and pointers are the CTA's: 32-bit row and tile indices (one SM's share of W)
  // keep the loop's cursor in registers.
  const CtaRows cta = cta_rows(blockIdx.x, gridDim.x, rows);
  const int cta_row_count = static_cast<int>(cta.end - cta.first);
  packed += cta.first * row_bytes;
  const ScaleSource* scale_source;
  if constexpr (kNested) {
    scale_source = nested.codes + cta.first * row_scales;
  } else {
    scale_source = absmax + cta.first * row_scales;
  }
  out += cta.first;
  if (bias != nullptr) bias += cta.first;
  const int64_t total = int64_t{(cta_row_count + kOrRows - 1) / kOrRows} * steps;  // the CTA's (tile, step)s
  const int warp = warp_in_cta();
  const WarpTurns mine = warp_turns(warp, kOrWarps, total);
  const int count = static_cast<int>(mine.end - mine.first);  // this warp's steps, >= 1 (the host's rule)
  const int first_tile = static_cast<int>(mine.first / steps);  // the tile and step the warp's run begins at
  const int first_s = static_cast<int>(mine.first - int64_t{first_tile} * steps);
  // The CTA's shared tiles: a warp whose run began inside a tile shares it with the warps before; the warp that
  // holds the tile's last step adds every sharer's part at the CTA's end, by first_sharer_slot's rule. This
  // warp's part in that: -1 for none, else the first sharer's slot, kept in one register across the loop.
  int merge_from = -1;
  if (first_s != 0) {
    const int64_t tile_first = int64_t{first_tile} * steps;
    if (warp_of_turn(tile_first + steps - 1, kOrWarps, total) == warp) {
      merge_from = static_cast<int>(first_sharer_slot(tile_first, kOrWarps, total));
    }
  }

  // kRowLoop (fp32 x of several rows): the rows of x one after another, the table filled once, and the later rows
  // find W in L2 where it fits there, so a row costs its decode rather than a launch and a read from DRAM. Other
  // calls take an instance with a constant trip count of 1, whose code is the loop's body alone: the loop's live
  // values cost the fp32 loop spills, and one row 2-11% of its time (NOTES gemv row 59).
  const int row_count = kRowLoop ? x_rows : 1;
  const int x_rows_together = kXRows == 1 ? 1 : x_rows;  // rows of x decoded together, <= kXRows
  // Nested: the shared code map and nested absmax values (filled with the table), the offset, and where the CTA's
  // first block sits in its nested block.
  const float* nested_code2 = reinterpret_cast<const float*>(or_lut + kCodePairTableBytes);
  const float* nested_absmax2 = nested_code2 + kOrCode2Floats;
#if NF4_PREFETCH_BEFORE_WAIT
  // While the previous kernel finishes, L2 is asked for what the warp's first loads read: the first kOrRing steps
  // (1 KB) of its first tile's first 4 rows, lane l line l % 8 of row l / 8, and lanes below kOrRows their row's scales.
  if (count > 0) {
    const int row = first_tile * kOrRows + lane / 8;
    const int64_t line = int64_t{first_s} * kOrStepBytes + 128 * (lane % 8);
    if (lane / 8 < kOrRows && row < cta_row_count && line < row_bytes) prefetch_l2(packed + row * row_bytes + line);
    const int scale_row = first_tile * kOrRows + lane;
    if (lane < kOrRows && scale_row < cta_row_count) {
      prefetch_l2(scale_source + scale_row * row_scales + ((int64_t{first_s} * kOrStep) >> blocksize_log2));
    }
  }
#endif
  // The table needs no global memory: filled while the previous kernel finishes (in flight with the prefetches
  // otherwise); the barrier after the first loads below publishes it.
  fill_code_pair_table<T>(or_lut, quant_type);
  wait_for_previous_kernels();
  float nested_offset = 0.0f;
  int nested_phase = 0;
  const int row_scales_int = static_cast<int>(row_scales);
  if constexpr (!kNested) {
    // Without it ptxas holds the global memory descriptor (every load's desc[UR] operand) in two vector
    // registers and converts it (R2UR) before every load, ~10 instructions per step; the nested instances, whose
    // first global load (the offset's) is unconditional, keep it in uniform registers. This load of x's first word
    // (always there; a volatile load, so that it stays although nothing reads it) gives the plain instances the
    // same (NOTES gemv rows 71-72). It is ptxas' choice, not a rule: benchmarks/sass_report.py says when the
    // conversions come back (an unconditional first load alone does not keep them away in the many-rows kernel,
    // row 74).
    uint32_t unused;
    asm volatile("ld.volatile.global.b32 %0, [%1];" : "=r"(unused) : "l"(x));
  }
  if constexpr (kNested) {
    nested_offset = *nested.offset;
    nested_phase = static_cast<int>(cta.first * row_scales & ((int64_t{1} << nested.nested_blocksize_log2) - 1));
  }
  for (int x_row = 0; x_row < row_count; ++x_row, x += cols, out += rows) {
    // The load cursor: the step that the next loads are for, its weight bytes for the lane (tile row 0) and the
    // tile's first scale (row 0's first block). Row r's bytes and scales are row r x row_bytes and row r x
    // row_scales further on, added row by row: per-row 64-bit index math was most of this loop's instructions
    // (NOTES gemv row 31).
    int load_tile = first_tile;
    int load_s = first_s;
    const uint8_t* load_weight = nullptr;
    const ScaleSource* load_tile_scales = nullptr;
    int load_rows = 0;  // the tile's rows in the CTA's range (the last tile's others load as zeros)
    const auto seek = [&] {
      const int first_row = load_tile * kOrRows;
      load_weight = packed + first_row * row_bytes + int64_t{load_s} * kOrStepBytes + lane_byte;
      load_tile_scales = scale_source + first_row * row_scales;
      load_rows = min(cta_row_count - first_row, kOrRows);
    };
    const auto load_step = [&](uint2(&weights)[kOrRows], ScaleWord(&scales)[kScaleSlots]) {
      const uint8_t* weight = load_weight;
      // the block of the lane's segment: the same column of blocks in every row, since rows start on a block
      const ScaleSource* scale = load_tile_scales + ((int64_t{load_s} * kOrStep + 64 * g) >> blocksize_log2);
      const bool lane_there = segment_in_row(load_s);
      if constexpr (kNested) {  // row t's code alone (0 past the CTA's rows and the row's end, as below)
        scales[0] = t < load_rows && lane_there ? load_once_scale(scale + t * row_scales) : 0;
      }
      if (load_rows == kOrRows && lane_there) {  // every step but a short last tile's and a half step's upper lanes
#pragma unroll
        for (int r = 0; r < kOrRows; ++r) {
          weights[r] = load_once_8(weight);
          if constexpr (!kNested) scales[r] = load_once_scale(scale);
          weight += row_bytes, scale += row_scales;
        }
      } else {
#pragma unroll
        for (int r = 0; r < kOrRows; ++r) {
          if (r < load_rows && lane_there) {
            weights[r] = load_once_8(weight);
            if constexpr (!kNested) scales[r] = load_once_scale(scale);
          } else {  // past the CTA's rows (outputs dropped) or the row's end (x is zero there too): zeros
            weights[r] = make_uint2(0, 0);
            if constexpr (!kNested) scales[r] = 0;
          }
          weight += row_bytes, scale += row_scales;
        }
      }
      load_weight += kOrStepBytes;
      if (++load_s == steps) load_s = 0, ++load_tile, seek();
    };
    seek();
    // The ring of steps in flight, slot d holding steps d, d + kRing, ... (indexed by unrolled loops only,
    // so it stays in registers).
    uint2 ring_weights[kRing][kOrRows];
    ScaleWord ring_scales[kRing][kScaleSlots];
#pragma unroll
    for (int d = 0; d < kRing; ++d) {
      if (d < count) load_step(ring_weights[d], ring_scales[d]);
    }
    if (x_row == 0) {  // the code pair table was filled before the wait
      if constexpr (kNested) {  // the code map, and the nested absmax values of the CTA's range (0 past W's)
        float* code2 = reinterpret_cast<float*>(or_lut + kCodePairTableBytes);
        for (int i = threadIdx.x; i < kOrCode2Floats; i += blockDim.x) code2[i] = nested.code2[i];
        const int64_t first = cta.first * row_scales >> nested.nested_blocksize_log2;
        const int64_t there = ((rows * row_scales - 1) >> nested.nested_blocksize_log2) + 1 - first;
        for (int i = threadIdx.x; i < nested_blocks; i += blockDim.x) {
          code2[kOrCode2Floats + i] = i < there ? nested.absmax2[first + i] : 0.0f;
        }
      }
      __syncthreads();
    }

    // The table's address, taken from lane 0 so that the compiler sees one value per warp: it then keeps it in a
    // uniform register and adds it inside each lookup's load ([R+UR]); computed per lane it cost an add per
    // lookup (64 per step) and pushed the loop into spills (NOTES gemv row 31).
    const uint32_t lut = __shfl_sync(0xFFFFFFFFu, static_cast<uint32_t>(__cvta_generic_to_shared(or_lut)), 0);
    const uint32_t lane4 = 4 * lane;
    int tile = first_tile;
    int s = first_s;
    bool from_tile_start = s == 0;  // the warp's part of `tile` began at its step 0
    const T* x_lane = x + 64 * g + 16 * t;
    // x row xr of those decoded together starts this far after the first (the last row repeated past x_rows)
    const auto x_row_offset = [&](int xr) { return int64_t{min(xr, x_rows_together - 1)} * cols; };
    // Segment g's sums of the step sit on the diagonal, in lane (g, g / 2): result column g % 2 for row 2mt
    // and 2 + g % 2 for row 2mt + 1; each lane keeps the two of its columns that would be there, and only the
    // diagonal lanes' sums are used.
    const bool diagonal = t == g / 2;
    const bool odd_column = g % 2 != 0;
    float acc[kXRows][kOrRows] = {};  // x row xr, row r of the tile, this lane's segment
    // Lane l < kSums holds the tile's output (x row l / kOrRows, W row l % kOrRows) after a flush.
    const int lane_x_row = lane / kOrRows, lane_tile_row = lane % kOrRows;
    const bool lane_writes = lane < kSums && lane_x_row < x_rows_together;

    // The warp leaves `tile`: add the 8 segments of each row by a butterfly over the warp (the same order on
    // every run; lanes off the diagonal give zeros); lane l writes its output, to `out` when the warp took the
    // whole tile, else to its slot for the tile (0: its first tile, 1: its last), added at the CTA's end.
    const auto flush = [&](bool whole) {
      float row_sum[kSums];
#pragma unroll
      for (int i = 0; i < kSums; ++i) {
        row_sum[i] = diagonal ? acc[i / kOrRows][i % kOrRows] : 0.0f, acc[i / kOrRows][i % kOrRows] = 0.0f;
      }
      float mine_sum = 0.0f;
#pragma unroll
      for (int i = 0; i < kSums; ++i) {
#pragma unroll
        for (int offset = 16; offset > 0; offset /= 2) row_sum[i] += __shfl_xor_sync(0xFFFFFFFFu, row_sum[i], offset);
        if (lane == i) mine_sum = row_sum[i];
      }
      const int n = tile * kOrRows + lane_tile_row;
      if (lane_writes && n < cta_row_count) {
        if (whole) {
          out[lane_x_row * rows + n] = from_float<T>(bias != nullptr ? mine_sum + to_float(bias[n]) : mine_sum);
        } else {
          tile_parts[warp][tile == first_tile ? 0 : 1][lane] = mine_sum;
        }
      }
    };

    for (int q0 = 0; q0 < count; q0 += kRing) {
#pragma unroll
      for (int d = 0; d < kRing; ++d) {
        const int q = q0 + d;
        if (q >= count) break;
        const uint2(&weights)[kOrRows] = ring_weights[d];
        const ScaleWord(&scales)[kScaleSlots] = ring_scales[d];
#ifdef NF4_OR_NO_DECODE  // timing build: the stream alone (every loaded value still feeds the result)
        uint32_t bits = 0;
#pragma unroll
        for (int r = 0; r < kOrRows; ++r) bits ^= weights[r].x ^ weights[r].y;
#pragma unroll
        for (int r = 0; r < kScaleSlots; ++r) bits ^= __float_as_uint(float(scales[r]));
        acc[0][0] += __uint_as_float(bits & 0x3FFFFFFFu);
#else
        // The row's scale for this lane's segment (nested: from the code loaded with the weights).
        int nested_first = 0;  // nested: the step's block index in tile row 0, from the CTA range's first value
        if constexpr (kNested) {
          nested_first = nested_phase + tile * kOrRows * row_scales_int + ((s * kOrStep + 64 * g) >> blocksize_log2);
        }
        // Nested: tile row t's scale for the lane's segment, from its code, for lanes (g, 0..3) to share.
        [[maybe_unused]] float own_scale = 0.0f;
        if constexpr (kNested) {
          const int index = min((nested_first + t * row_scales_int) >> nested.nested_blocksize_log2,
                                nested_blocks - 1);  // fmt: skip
          const float value = BlockScales::nested_absmax_value(nested_code2[scales[0]], nested_absmax2[index],
                                                               nested_offset);
          // a half step's upper lanes lie past the row, in the next row's blocks: zero, as plain absmax loads
          // there, so that no value of the next row's (an Inf) reaches this row's sum
          own_scale = segment_in_row(s) ? value : 0.0f;
        }
        const auto row_scale = [&](int r) -> float {
          if constexpr (kNested) {
            return __shfl_sync(0xFFFFFFFFu, own_scale, 4 * g + r);
          } else {
            return scales[r];
          }
        };
        uint32_t x_hi[kXRows][8], x_lo[8];  // x_lo: fp32 x only (MmaOperand), one row
        // a half step: zeros past the row's end, whose weights load as zeros too
#pragma unroll
        for (int xr = 0; xr < kXRows; ++xr) {
          const T* from = x_lane + int64_t{s} * kOrStep + x_row_offset(xr);
          one_row_x<T, kHalfStep>(from, segment_in_row(s), x_hi[xr], x_lo);
        }
#pragma unroll
        for (int mt = 0; mt < kOrRows / 2; ++mt) {
          const uint2 lo = weights[2 * mt], hi = weights[2 * mt + 1];
          float sums[kXRows][4] = {};
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            uint32_t a[4];
            a_fragment(j, lo, hi, lut, lane4, a);  // decoded once for every row of x
            if constexpr (MmaOperand<T>::kSplit) {  // the small products first
              uint32_t a_lo[4];
              a_fragment(j, lo, hi, lut + kCodePairEntryBytes / 2, lane4, a_lo);
              mma_16816<M>(sums[0], a_lo, x_hi[0][2 * j], x_hi[0][2 * j + 1], sums[0]);
              mma_16816<M>(sums[0], a, x_lo[2 * j], x_lo[2 * j + 1], sums[0]);
            }
#pragma unroll
            for (int xr = 0; xr < kXRows; ++xr) {
              mma_16816<M>(sums[xr], a, x_hi[xr][2 * j], x_hi[xr][2 * j + 1], sums[xr]);
            }
          }
          const float scale_lo = row_scale(2 * mt), scale_hi = row_scale(2 * mt + 1);
#pragma unroll
          for (int xr = 0; xr < kXRows; ++xr) {
            acc[xr][2 * mt] = fmaf(scale_lo, odd_column ? sums[xr][1] : sums[xr][0], acc[xr][2 * mt]);
            acc[xr][2 * mt + 1] = fmaf(scale_hi, odd_column ? sums[xr][3] : sums[xr][2], acc[xr][2 * mt + 1]);
          }
        }
#endif
        if (q + kRing < count) load_step(ring_weights[d], ring_scales[d]);  // the slot is decoded: refill it
        if (s + 1 == steps || q + 1 == count) flush(from_tile_start && s + 1 == steps);
        if (++s == steps) s = 0, ++tile, from_tile_start = true;
      }
    }

    // The shared tile this warp adds, in warp order (the same bits on every run).
    __syncthreads();
    const int n = first_tile * kOrRows + lane_tile_row;
    if (merge_from >= 0 && lane_writes && n < cta_row_count) {
      float sum = tile_parts[merge_from / 2][merge_from % 2][lane];
      for (int w = merge_from / 2 + 1; w <= warp; ++w) sum += tile_parts[w][0][lane];
      out[lane_x_row * rows + n] = from_float<T>(bias != nullptr ? sum + to_float(bias[n]) : sum);
    }
    if (x_row + 1 < row_count) __syncthreads();  // tile_parts is read above before the next row writes it
  }
}

// Whether the tensor-core kernel's layout fits this call, whatever x's dtype: it needs whole 256-element turns
// (so a turn never straddles a row, and its absmax blocks are one copy), 16-byte weight copies and x loads,
// 16-byte absmax copies (4-byte copies of nested codes, a nested block of at least one turn's 4 blocks), and its
// shared memory (the table and the warps' stages). The tensor-core kernel takes fp16 / bf16 x
// (tensor_core_gemv_applies); the one-row kernel, which needs the same, fp32 x too (one_row_gemv_applies).
bool tensor_core_layout_fits(const at::Tensor& x_2d, const void* packed_bytes, const BlockScales& scales,
                             const WeightSpec& spec, int64_t cols) {
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  const bool scales_aligned = scales.nested()
                                  ? reinterpret_cast<uintptr_t>(scales.codes) % 4 == 0 &&
                                        scales.nested_blocksize_log2 >= 2
                                  : is_aligned_16(scales.absmax);
  return props->major >= 8 &&
         props->sharedMemPerBlockOptin >=
             size_t{std::max({TcCta<1, 1, false>::kSharedBytes, TcCta<1, 2, false>::kSharedBytes,
                              TcCta<1, 1, true>::kSharedBytes, TcCta<1, 2, true>::kSharedBytes})} &&
         cols % kTcTurn == 0 &&
         (int64_t{1} << spec.blocksize_log2) >= kTcStep && is_aligned_16(packed_bytes) &&
         is_aligned_16(x_2d.const_data_ptr()) && scales_aligned;
}

bool tensor_core_gemv_applies(const at::Tensor& x_2d, const void* packed_bytes, const BlockScales& scales,
                              const WeightSpec& spec, int64_t cols) {
  const auto dtype = x_2d.scalar_type();
  return (dtype == at::kHalf || dtype == at::kBFloat16) &&
         tensor_core_layout_fits(x_2d, packed_bytes, scales, spec, cols);
}

template <typename T, int kMTiles, int kNTiles, bool kNested, bool kCtaPerTile>
int prepare_tc_kernel() {
  static std::atomic<int64_t> resident[64] = {};
  using Cta = TcCta<kMTiles, kNTiles, kCtaPerTile>;
  return prepare_kernel(resident, tc_gemv_kernel<T, kMTiles, kNTiles, kNested, kCtaPerTile>, Cta::kWarps * 32,
                        Cta::kSharedBytes);
}

// The CTAs per tile of a one-CTA-per-tile launch (add_warp_parts): kTcTileCluster on sm_90 for 9-16 rows of x
// (two n-tiles) where a tile has more than kTcTileClusterMinTurns turns for each of one CTA's warps (a second CTA
// then halves the busiest warps' turns) and a cluster for every tile fits on the GPU at once (Llama's k/v, 64 tiles,
// would otherwise leave half of 132 SMs idle); else 1. Llama's k/v at 16 rows: 8.1 -> 7.7 us on an H100 (row 134b),
// 8.3 -> 7.3 on an H200 (row 135).
// `kernel` is a prepared one-CTA-per-tile instance and `fits` its own cache.
template <typename Kernel>
int tc_tile_cluster(std::atomic<int64_t> (&fits)[64], Kernel kernel, int64_t tiles, int turns, int n_tiles,
                    int warps, int shared_bytes, cudaStream_t stream) {
  // (code JIT-compiled from sm_80 PTX has no cluster path in add_warp_parts: its doubled grid would be wrong)
  if (kTcTileCluster < 2 || at::cuda::getCurrentDeviceProperties()->major < 9 || n_tiles < 2 ||
      turns <= kTcTileClusterMinTurns * warps || !compiled_for_sm90(kernel)) {
    return 1;
  }
  const int64_t clusters = once_per_device(fits, [&](int) -> int64_t {
    const LaunchConfig launch(dim3(kTcTileCluster), warps * 32, shared_bytes, stream, kTcTileCluster, false);
    int count = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&count, kernel, &launch.config));
    return int64_t{count} + 1;  // + 1: the cache holds positive values, and none may fit
  }) - 1;
  return tiles <= clusters ? kTcTileCluster : 1;
}

// The current device's peak DRAM bandwidth in GB/s (double data rate: 2 transfers per memory clock), which
// picks the crossover table in ops.h; read once per device.
int64_t peak_memory_GBps() {
  static std::atomic<int64_t> peak[64] = {};
  return once_per_device(peak, [](int device) -> int64_t {
    int clock_khz = 0, bus_bits = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device));
    return 2 * int64_t{clock_khz} * (bus_bits / 8) / 1000000;
  });
}

// Launches add_tile_parts_kernel for the parts that `writer_grid` CTAs of footprint `writer` wrote, a thread per
// kAddPartsOutputs outputs of a tile, a tile's pieces along the grid's y. With a programmatic launch its CTAs may
// start while the writer runs, work out their sharers and wait there; its grid is then the first of these that is
// resident beside the writer's CTAs (taken as spread one round at a time over the SMs), so that none of its CTAs is
// dispatched only after the writer's drain (NOTES gemv rows 122-123d: 4-13% off 12-16 rows on the q/o layers): a
// CTA per tile's piece of up to kAddPartsMaxThreads threads; of kAddPartsResidentThreads; of kAddPartsResidentThreads
// taking up to kAddPartsMaxTiles tiles each. Where none is, the first (its CTAs are then dispatched as the writer's
// leave).
template <typename T>
void launch_add_tile_parts(const float* partial, int64_t workers, int turns, int tile_rows, int64_t rows,
                           int64_t x_rows, const T* bias, T* out, const CtaFootprint& writer, int64_t writer_grid,
                           cudaStream_t stream) {
  TORCH_INTERNAL_ASSERT(tile_rows % kAddPartsOutputs == 0);
  const int64_t tiles = (rows + tile_rows - 1) / tile_rows;
  const int64_t vectors = x_rows * tile_rows / kAddPartsOutputs;  // per tile, a thread each
  struct Grid {
    int64_t threads, pieces, tiles_across;  // a CTA's threads, a tile's CTAs (y), CTAs along x
  };
  const auto grid_of = [&](int64_t most_threads, int64_t tiles_per_cta) {
    const int64_t threads = std::min<int64_t>(most_threads, (vectors + 31) / 32 * 32);
    return Grid{threads, (vectors + threads - 1) / threads, (tiles + tiles_per_cta - 1) / tiles_per_cta};
  };
  const Grid choices[] = {grid_of(kAddPartsMaxThreads, 1), grid_of(kAddPartsResidentThreads, 1),
                          grid_of(kAddPartsResidentThreads, kAddPartsMaxTiles)};
  Grid grid = choices[0];
  if (programmatic_launch_enabled(add_tile_parts_kernel<T, 1>)) {
    const cudaDeviceProp& device = *at::cuda::getCurrentDeviceProperties();
    const int64_t sms = device.multiProcessorCount;
    const int64_t round = writer_grid / sms, busier = writer_grid % sms;  // busier SMs have one writer CTA more
    static std::atomic<int64_t> one_tile[64] = {}, several_tiles[64] = {};  // the instances' attributes
    for (const Grid& choice : choices) {
      const CtaFootprint adder =
          choice.tiles_across < tiles
              ? cta_footprint(several_tiles, add_tile_parts_kernel<T, kAddPartsMaxTiles>, choice.threads, 0)
              : cta_footprint(one_tile, add_tile_parts_kernel<T, 1>, choice.threads, 0);
      const int64_t resident = busier * ctas_fitting_beside(device, writer, round + 1, adder) +
                               (sms - busier) * ctas_fitting_beside(device, writer, round, adder);
      if (choice.tiles_across * choice.pieces <= resident) {
        grid = choice;
        break;
      }
    }
  }
  // every tile taken: CTA (b, piece) takes tiles b, b + tiles_across, ..., at most `most_tiles` (its kTiles)
  const auto launch = [&](auto kernel, int64_t most_tiles) {
    TORCH_INTERNAL_ASSERT(grid.tiles_across * most_tiles >= tiles &&
                          grid.tiles_across <= std::numeric_limits<int32_t>::max() && grid.pieces <= 65535);
    launch_kernel(kernel, dim3(static_cast<unsigned>(grid.tiles_across), static_cast<unsigned>(grid.pieces)),
                  static_cast<int>(grid.threads), 0, stream, 1, partial, workers, turns, tile_rows, rows, int(x_rows),
                  bias, out);
  };
  grid.tiles_across < tiles ? launch(add_tile_parts_kernel<T, kAddPartsMaxTiles>, kAddPartsMaxTiles)
                            : launch(add_tile_parts_kernel<T, 1>, 1);
}

// Whether the one-row kernel takes a call whose layout fits the tensor-core kernel (tensor_core_layout_fits; x
// fp16, bf16 or, with `split_operands`, fp32: MmaOperand): one row of x (fp16 / bf16 x: up to kOrMaxXRows rows by
// W's size and the GPU's memory, ops.h one_row_gemv_max_x_rows, decoded together; fp32 x asks for one row, and
// takes more one after another: launch_one_row_gemv), plain absmax or nested absmax whose values
// for a CTA's rows fit its shared memory (kOrNestedMaxBlocks), whole 512-element steps or
// a last half step per row, W rows that start on absmax block boundaries (its scale addresses step by whole rows
// of blocks), and enough steps (a half step counted as one) that every warp of the CTA with the fewest rows (one
// CTA per SM) has kOrMinStepsPerWarp (one step: layers with fewer, where some warp would have none, keep the
// tensor-core kernel's one CTA per tile).
// Where it applies it was 4-8% faster than the tensor-core kernel on an H100 (NOTES gemv row 27) and, since its
// leaner loads (row 31), 0-5% faster on an H200 (row 33; before row 31 it was slower there, row 29); with 4-row
// tiles, 11-21% on the q/o layers it then took too (rows 45 and 53).
bool one_row_gemv_applies(int64_t x_rows, const BlockScales& scales, int blocksize_log2, int64_t rows, int64_t cols,
                          bool split_operands) {
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;  // one CTA per SM
  const int64_t fewest_rows = rows / sms;  // per CTA
  const int64_t steps = (cols + kOrStep - 1) / kOrStep;  // per tile
  const bool nested_fit = !scales.nested() || one_row_nested_blocks(rows, sms, cols >> blocksize_log2,
                                                                    scales.nested_blocksize_log2) <= kOrNestedMaxBlocks;
  const int64_t max_x_rows =
      split_operands ? 1 : std::min<int64_t>(kOrMaxXRows, one_row_gemv_max_x_rows(rows, cols, peak_memory_GBps()));
  // the kernel indexes a row's columns in int (s * kOrStep): a K past that would wrap its nested scale index
  return x_rows >= 1 && x_rows <= max_x_rows && nested_fit && cols % (kOrStep / 2) == 0 &&
         cols <= std::numeric_limits<int>::max() - kOrStep && cols % (int64_t{1} << blocksize_log2) == 0 &&
         (fewest_rows + kOrRows - 1) / kOrRows * steps >= int64_t{kOrMinStepsPerWarp} * kOrWarps;
}

// The most rows of fp32 x that take the one-row kernel (ops.h); a tuning build (benchmarks/NOTES.md, gemv row 59)
// may set one limit for every W with -DNF4_ONE_ROW_FP32_MAX_ROWS=n, to time the kernel past the table's limits.
int64_t one_row_fp32_max_rows(int64_t rows, int64_t cols) {
#ifdef NF4_ONE_ROW_FP32_MAX_ROWS
  return NF4_ONE_ROW_FP32_MAX_ROWS;
#else
  return gemv_row_limit(kOneRowFp32RowLimits, rows, cols);
#endif
}

// f(std::integral_constant<int, x_rows>{}) for 1 <= x_rows <= kMost: one instance per row count.
template <int kMost, typename F>
void with_x_rows(int64_t x_rows, F&& f) {
  if constexpr (kMost > 1) {
    if (x_rows < kMost) return with_x_rows<kMost - 1>(x_rows, f);
  }
  f(std::integral_constant<int, kMost>{});
}

// x_rows: up to kOrMaxXRows, decoded together; with split operands (fp32 x) 1, or up to kOneRowFp32RowLimits (ops.h)
// taken one after another.
template <typename T>
void launch_one_row_gemv(const T* x, const uint8_t* packed, const BlockScales& scales, const WeightSpec& spec,
                         int64_t rows, int64_t cols, int64_t x_rows, const T* bias, T* out, cudaStream_t stream) {
  TORCH_INTERNAL_ASSERT(x_rows >= 1 && (MmaOperand<T>::kSplit ? x_rows <= INT32_MAX : x_rows <= kOrMaxXRows));
  const int grid = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;  // one_row_gemv_applies' CTAs
  const int64_t nested_count =
      scales.nested() ? one_row_nested_blocks(rows, grid, cols >> spec.blocksize_log2, scales.nested_blocksize_log2)
                      : 0;
  TORCH_INTERNAL_ASSERT(nested_count <= kOrNestedMaxBlocks);  // one_row_gemv_applies' rule
  const int nested_blocks = static_cast<int>(nested_count);
  const auto launch = [&](auto half_step_constant, auto row_loop_constant, auto nested_constant, auto x_rows_constant) {
    constexpr bool kHalfStep = decltype(half_step_constant)::value;
    constexpr bool kRowLoop = decltype(row_loop_constant)::value;
    constexpr bool kNested = decltype(nested_constant)::value;
    constexpr int kXRows = decltype(x_rows_constant)::value;
    const auto kernel = one_row_gemv_kernel<T, kHalfStep, kRowLoop, kNested, kXRows>;
    constexpr int kMostSharedBytes = kCodePairTableBytes + (kNested ? kOrNestedSharedBytes : 0);
    static std::atomic<int64_t> resident[64] = {};  // one cache per instance
    prepare_kernel(resident, kernel, kOrWarps * 32, kMostSharedBytes);
    const int shared_bytes = kCodePairTableBytes + (kNested ? (kOrCode2Floats + nested_blocks) * 4 : 0);
    launch_kernel(kernel, dim3(grid), kOrWarps * 32, shared_bytes, stream, 1, x, packed, scales.absmax,
                  spec.quant_type, spec.blocksize_log2, rows, cols, static_cast<int>(x_rows), bias, out, scales,
                  nested_blocks);
  };
  const auto with_half_step = [&](auto row_loop, auto nested, auto x_rows_constant) {
    cols % kOrStep == 0 ? launch(std::false_type{}, row_loop, nested, x_rows_constant)
                        : launch(std::true_type{}, row_loop, nested, x_rows_constant);
  };
  const auto with_nested = [&](auto row_loop, auto x_rows_constant) {
    scales.nested() ? with_half_step(row_loop, std::true_type{}, x_rows_constant)
                    : with_half_step(row_loop, std::false_type{}, x_rows_constant);
  };
  using OneXRow = std::integral_constant<int, 1>;
  if constexpr (MmaOperand<T>::kSplit) {
    x_rows > 1 ? with_nested(std::true_type{}, OneXRow{}) : with_nested(std::false_type{}, OneXRow{});
  } else {
    with_x_rows<kOrMaxXRows>(x_rows, [&](auto x_rows_constant) { with_nested(std::false_type{}, x_rows_constant); });
  }
}

// The CTAs of a stream-K launch of `total` turns whose CTAs split their turns over `workers` (warps, or teams):
// as many as are resident at once, but no more than give each worker kTcMinTurnsPerWarp turns.
int64_t stream_k_grid(int64_t total, int workers, int64_t resident_ctas) {
  return std::min(resident_ctas, (total + workers * kTcMinTurnsPerWarp - 1) / (workers * kTcMinTurnsPerWarp));
}

// The warpgroup kernel's instances, prepared once per device; returns its CTAs per SM.
template <typename T, int kN, bool kNested>
int prepare_wg_kernel() {
  static std::atomic<int64_t> resident[64] = {};
  return prepare_kernel(resident, wg_gemv_kernel<T, kN, kNested>, kWgWarps * 32, WgShape<kN>::kSharedBytes);
}

// Whether the warpgroup kernel takes a call that the tensor-core kernel's layout fits (tensor_core_gemv_applies):
// where the build has sm_90a code (setup.py defines NF4_WGMMA_SM90A when its only sm_90 target is sm_90a: a build
// that also has plain sm_90 code might run that on an H100), on an sm_90 GPU, for those of kWgMinXRows to 16 rows
// of x that ops.h's warpgroup_gemv_takes_x_rows gives W's size and the GPU's memory class, on layers whose 16-row
// tiles would not take one CTA per tile (tc_cta_per_tile: the k/v layers, where 64-row tiles leave SMs idle and the
// probe of NOTES gemv row 98 was 27-57% slower).
// The environment's NF4_OPS_WGMMA=0 (exactly "0"; read once per process) turns the kernel off, so that the
// tensor-core kernel's instances that it replaces on these GPUs can still be tested and compared there.
// Besides the build's flag, the code this GPU runs must be the sm_90a code: flags added to the build by hand (an
// extra -gencode for sm_90) could give it code where the kernel is only a trap. That code uses a few registers where
// the kernel uses over 100 (checked once per device on one instance: every instance comes from the same targets).
#if NF4_WGMMA_SM90A
bool wg_kernel_runs_here() {
  static std::atomic<int64_t> compiled[64] = {};
  return once_per_device(compiled, [](int) -> int64_t {
           cudaFuncAttributes attributes;
           C10_CUDA_CHECK(cudaFuncGetAttributes(
               &attributes, reinterpret_cast<const void*>(wg_gemv_kernel<__nv_bfloat16, 16, false>)));
           return attributes.numRegs >= 64 ? 2 : 1;  // positive values only
         }) == 2;
}
#endif

template <typename T>
bool wg_gemv_applies(int64_t x_rows, int64_t rows, int64_t cols) {
#if NF4_WGMMA_SM90A
  static const bool allowed = !environment_turns_off("NF4_OPS_WGMMA");
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  if (!allowed || props->major != 9 || props->minor != 0 || !wg_kernel_runs_here() || x_rows < kWgMinXRows ||
      !warpgroup_gemv_takes_x_rows(x_rows, rows, cols, peak_memory_GBps()) ||
      props->sharedMemPerBlockOptin < size_t{std::max(WgShape<8>::kSharedBytes, WgShape<16>::kSharedBytes)}) {
    return false;
  }
  const int64_t tc_resident = int64_t{prepare_tc_kernel<T, 1, 1, false, false>()} * props->multiProcessorCount;
  return !tc_cta_per_tile((rows + TileShape<1>::kRows - 1) / TileShape<1>::kRows, static_cast<int>(cols / kTcTurn),
                          tc_resident);
#else
  return false;
#endif
}

// The warpgroup kernel's grid where each team takes one team tile whole, or 0 where it takes stream-K's: where the
// tiles fill whole CTAs and come to ops.h's warpgroup_whole_tile_min_percent of the resident CTAs or more, up to all
// of them, a CTA per kTeams tiles leaves the other SMs idle, but no tile is shared, so no parts are stored and no
// adding kernel runs: the second kernel's ~3 us goes, and on an H100 the CTAs' pace rose with fewer SMs pulling
// from DRAM (on an H200 it did not, hence its higher fraction; NOTES gemv rows 143-143d).
int64_t wg_whole_tile_grid(int64_t tiles, int teams_per_cta, int64_t resident_ctas) {
  const int64_t ctas = tiles / teams_per_cta;
  const bool whole = tiles % teams_per_cta == 0 && ctas <= resident_ctas &&
                     ctas * 100 >= resident_ctas * warpgroup_whole_tile_min_percent(peak_memory_GBps());
  return whole ? ctas : 0;
}

// One launch of wg_gemv_kernel (wgmma's N: 8 for up to 8 rows of x, else 16), then add_tile_parts_kernel for the
// team tiles that several teams shared. The grid has at most one CTA per kTeams * kTcMinTurnsPerWarp team turns (on
// layers with fewer turns than resident teams x kTcMinTurnsPerWarp, teams get about that many), or is
// wg_whole_tile_grid's, with no second kernel.
template <typename T>
void launch_wg_gemv(const T* x, const uint8_t* packed, const BlockScales& scales, const WeightSpec& spec,
                    int64_t rows, int64_t cols, int64_t x_rows, const T* bias, T* out, const at::Tensor& like,
                    cudaStream_t stream) {
  const auto run = [&](auto n_constant, auto nested_constant) {
    constexpr int kN = decltype(n_constant)::value;
    constexpr bool kNested = decltype(nested_constant)::value;
    const int64_t resident =
        int64_t{prepare_wg_kernel<T, kN, kNested>()} * at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    using Shape = WgShape<kN>;
    const int turns = static_cast<int>(cols / kTcTurn);
    const int64_t tiles = (rows + Shape::kTeamRows - 1) / Shape::kTeamRows;
    const int64_t total = tiles * turns;
    const int64_t whole_tile_grid = wg_whole_tile_grid(tiles, Shape::kTeams, resident);
    const bool whole_tiles = whole_tile_grid > 0;
    const int64_t grid = whole_tiles ? whole_tile_grid : stream_k_grid(total, Shape::kTeams, resident);
    const int64_t teams = grid * Shape::kTeams;
    // whole tiles: every team writes its tile straight to `out` (no parts, no second kernel)
    at::Tensor partial = at::empty({whole_tiles ? 0 : tc_partial_floats(teams, x_rows, Shape::kTeamRows)},
                                   like.options().dtype(at::kFloat));
    float* partial_data = partial.mutable_data_ptr<float>();
    launch_kernel(wg_gemv_kernel<T, kN, kNested>, dim3(static_cast<unsigned>(grid)), kWgWarps * 32,
                  WgShape<kN>::kSharedBytes, stream, 1, x, packed, scales, spec.quant_type, spec.blocksize_log2, rows,
                  cols, int(x_rows), bias, out, partial_data);
    if (turns > 1 && !whole_tiles) {  // with one turn per tile no tile is shared
      static std::atomic<int64_t> attributes[64] = {};
      const CtaFootprint writer =
          cta_footprint(attributes, wg_gemv_kernel<T, kN, kNested>, kWgWarps * 32, WgShape<kN>::kSharedBytes);
      launch_add_tile_parts<T>(partial_data, teams, turns, Shape::kTeamRows, rows, x_rows, bias, out, writer, grid,
                               stream);
    }
  };
  const auto with_nested = [&](auto n_constant) {
    scales.nested() ? run(n_constant, std::true_type{}) : run(n_constant, std::false_type{});
  };
  TORCH_INTERNAL_ASSERT(x_rows >= kWgMinXRows && x_rows <= 16);
  x_rows <= 8 ? with_nested(std::integral_constant<int, 8>{}) : with_nested(std::integral_constant<int, 16>{});
}

template <typename T>
void launch_tc_gemv(const T* x, const uint8_t* packed, const BlockScales& scales, const WeightSpec& spec,
                    int64_t rows, int64_t cols, int64_t x_rows, const T* bias, T* out, const at::Tensor& like,
                    cudaStream_t stream) {
  const auto run = [&](auto m_tiles_constant, auto n_tiles_constant, auto nested_constant) {
    constexpr int kMTiles = decltype(m_tiles_constant)::value;
    constexpr int kNTiles = decltype(n_tiles_constant)::value;
    constexpr bool kNested = decltype(nested_constant)::value;
    using Tile = TileShape<kMTiles>;
    const int64_t resident = int64_t{prepare_tc_kernel<T, kMTiles, kNTiles, kNested, false>()} *
                             at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    const int turns = static_cast<int>(cols / kTcTurn);
    const int64_t tiles = (rows + Tile::kRows - 1) / Tile::kRows;
    const int64_t total = tiles * turns;
    // (only 16-row tiles: 32-row ones are chosen for layers with many more turns per resident warp)
    const bool cta_per_tile = kMTiles == 1 && tc_cta_per_tile(tiles, turns, resident);
    constexpr int kStreamKWarps = TcCta<kMTiles, kNTiles, false>::kWarps;
    const int64_t grid = cta_per_tile ? tiles : stream_k_grid(total, kStreamKWarps, resident);
    const int64_t warps = grid * kStreamKWarps;
    at::Tensor partial;
    float* partial_data = nullptr;
    if (!cta_per_tile) {
      partial = at::empty({tc_partial_floats(warps, x_rows, Tile::kRows)}, like.options().dtype(at::kFloat));
      partial_data = partial.mutable_data_ptr<float>();
    }
    const auto launch = [&](auto cta_per_tile_constant) {
      constexpr bool kCtaPerTile = decltype(cta_per_tile_constant)::value;
      const auto kernel = tc_gemv_kernel<T, kMTiles, kNTiles, kNested, kCtaPerTile>;
      using Cta = TcCta<kMTiles, kNTiles, kCtaPerTile>;
      int cluster = 1;
      if constexpr (kCtaPerTile) {
        prepare_tc_kernel<T, kMTiles, kNTiles, kNested, true>();
        static std::atomic<int64_t> fits[64] = {};
        cluster = tc_tile_cluster(fits, kernel, tiles, turns, kNTiles, Cta::kWarps, Cta::kSharedBytes, stream);
      }
      launch_kernel(kernel, dim3(static_cast<unsigned>(grid * cluster)), Cta::kWarps * 32, Cta::kSharedBytes, stream,
                    cluster, x, packed, scales, spec.quant_type, spec.blocksize_log2, rows, cols, int(x_rows), bias,
                    out, partial_data);
    };
    if constexpr (kMTiles == 1) {
      cta_per_tile ? launch(std::true_type{}) : launch(std::false_type{});
    } else {
      launch(std::false_type{});
    }
    if (!cta_per_tile && turns > 1) {  // with one turn per tile no tile is shared
      using Cta = TcCta<kMTiles, kNTiles, false>;
      static std::atomic<int64_t> attributes[64] = {};
      const CtaFootprint writer = cta_footprint(attributes, tc_gemv_kernel<T, kMTiles, kNTiles, kNested, false>,
                                                Cta::kWarps * 32, Cta::kSharedBytes);
      launch_add_tile_parts<T>(partial_data, warps, turns, Tile::kRows, rows, x_rows, bias, out, writer, grid,
                               stream);
    }
  };
  using One = std::integral_constant<int, 1>;
  using Two = std::integral_constant<int, 2>;
  const auto with_nested = [&](auto m_tiles, auto n_tiles) {
    scales.nested() ? run(m_tiles, n_tiles, std::true_type{}) : run(m_tiles, n_tiles, std::false_type{});
  };
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  const int64_t wide_turns = (rows + TileShape<2>::kRows - 1) / TileShape<2>::kRows * (cols / kTcTurn);
  const bool wide = props->sharedMemPerBlockOptin >= size_t{TcCta<2, 2, false>::kSharedBytes} &&
                    cols >= kTcWideTileMinCols &&
                    wide_turns >= int64_t{kTcWideTileMinTurnsPerWarp} * TcCta<2, 2, false>::kWarps *
                                      props->multiProcessorCount;
  TORCH_INTERNAL_ASSERT(x_rows >= 1 && x_rows <= kTensorCoreGemvLaunchRows);
  if (x_rows <= 8) {
    with_nested(One{}, One{});
  } else {
    wide ? with_nested(Two{}, Two{}) : with_nested(One{}, Two{});
  }
}

}  // namespace

at::Tensor gemv_cuda(NF4_GEMV_PARAMS) {
  const WeightSpec spec = check_gemv_args(x, packed, absmax, blocksize, quant_type, shape, bias, nested_absmax,
                                          nested_code, nested_offset, nested_blocksize);
  check_storage_holds("nf4::gemv", "x", x);
  if (bias.has_value()) check_storage_holds("nf4::gemv", "bias", *bias);
  const c10::cuda::CUDAGuard device_guard(packed.device());
  const int64_t rows = spec.rows.expect_int();
  const int64_t cols = spec.cols.expect_int();
  const at::Tensor x_2d = x.reshape({-1, cols}).contiguous();
  const int64_t x_rows = x_2d.size(0);
  const c10::SymDimVector out_shape = gemv_output_shape(x, spec.rows);
  const WeightData weight = weight_data("nf4::gemv", spec, packed, absmax, nested_absmax, nested_code, nested_offset);
  const uint8_t* bytes = weight.bytes;
  const BlockScales& scales = weight.scales;
  const bool tensor_cores = tensor_core_gemv_applies(x_2d, bytes, scales, spec, cols);
  // fp32 x: the one-row kernel (split operands) where it applies, else the CUDA-core kernel
  const bool one_row_fp32 = x.scalar_type() == at::kFloat && tensor_core_layout_fits(x_2d, bytes, scales, spec, cols) &&
                            one_row_gemv_applies(1, scales, spec.blocksize_log2, rows, cols, true);
  // fp16 / bf16 x of more than one launch's rows: the many-rows kernel up to its limit (ops.h)
  const bool many_rows = tensor_cores && x_rows > kTensorCoreGemvLaunchRows &&
                         x_rows <= many_rows_gemv_max_rows(rows, cols, peak_memory_GBps()) &&
                         many_rows_gemv_fits(rows, cols, x_rows);
  const int64_t fused_max_rows = many_rows      ? x_rows
                                 : tensor_cores ? kTensorCoreGemvLaunchRows
                                 : one_row_fp32 ? one_row_fp32_max_rows(rows, cols)
                                                : kFusedGemvMaxRows;
  if (x_rows > fused_max_rows) {
    const at::Tensor w = dequantize_cuda(packed, absmax, blocksize, quant_type, shape, x.scalar_type(),
                                         nested_absmax, nested_code, nested_offset, nested_blocksize);
    return linear_outside_autocast(x_2d, w, bias).reshape_symint(out_shape);
  }

  at::Tensor out = at::empty({x_rows, rows}, x.options());
  if (x_rows == 0 || rows == 0) return out.reshape_symint(out_shape);
  const at::Tensor bias_c = bias.has_value() ? bias->contiguous() : at::Tensor();
  // The many-rows kernel takes every row of x, or its whole tiles and leaves the last rows (ops.h,
  // many_rows_gemv_tail_rows) to the launch below that a call of those rows alone takes.
  int64_t first_row = 0;
  if (many_rows) {
    first_row = x_rows - many_rows_gemv_tail_rows(rows, cols, x_rows);
    at::Tensor tiles_out = out.narrow(0, 0, first_row);
    launch_many_rows_gemv(x_2d.narrow(0, 0, first_row), bytes, scales, spec, bias_c, tiles_out);
    if (first_row == x_rows) return out.reshape_symint(out_shape);
  }
  const int64_t launch_rows = x_rows - first_row;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();

  NF4_DISPATCH_FLOAT_TYPES(x.scalar_type(), "nf4::gemv", [&] {
    using T = typename CudaScalar<scalar_t>::type;
    const T* x_data = reinterpret_cast<const T*>(x_2d.const_data_ptr<scalar_t>()) + first_row * cols;
    const T* bias_data = bias_c.defined() ? reinterpret_cast<const T*>(bias_c.const_data_ptr<scalar_t>()) : nullptr;
    T* out_data = reinterpret_cast<T*>(out.mutable_data_ptr<scalar_t>()) + first_row * rows;
    if constexpr (!std::is_same_v<T, float>) {
      // Up to kOrMaxXRows rows take the one-row kernel where it applies, up to 16 rows the warpgroup kernel where it
      // applies, else the tensor-core kernel.
      if (tensor_cores) {
        if (one_row_gemv_applies(launch_rows, scales, spec.blocksize_log2, rows, cols, false)) {
          launch_one_row_gemv<T>(x_data, bytes, scales, spec, rows, cols, launch_rows, bias_data, out_data, stream);
        } else if (wg_gemv_applies<T>(launch_rows, rows, cols)) {
          launch_wg_gemv<T>(x_data, bytes, scales, spec, rows, cols, launch_rows, bias_data, out_data, out, stream);
        } else {
          launch_tc_gemv<T>(x_data, bytes, scales, spec, rows, cols, launch_rows, bias_data, out_data, out, stream);
        }
        return;
      }
    } else if (one_row_fp32) {  // one launch for every row of x (ops.h, kOneRowFp32RowLimits)
      launch_one_row_gemv<T>(x_data, bytes, scales, spec, rows, cols, launch_rows, bias_data, out_data, stream);
      return;
    }
    // one warp per row of W and no loop over rows: a grid past a launch's limit would wrap and leave rows unwritten
    const int64_t blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
    TORCH_CHECK(blocks <= std::numeric_limits<int>::max(), "nf4::gemv: shape[0] (N) = " + std::to_string(rows) +
                " needs " + std::to_string(blocks) + " CUDA blocks of the fused kernel (taken where no tensor-core kernel applies: here K = " +
                std::to_string(cols) + ", or an input's alignment, blocksize or the GPU), more than a launch allows (" +
                std::to_string(std::numeric_limits<int>::max()) + ")");
    const bool vectorize = cols % kChunkElements == 0 && is_aligned_16(bytes) && is_aligned_16(x_data);
    launch_kernel(vectorize ? fused_gemv_kernel<T, true> : fused_gemv_kernel<T, false>, dim3(static_cast<unsigned>(blocks)),
                  kWarpsPerBlock * 32, 0, stream, 1, x_data, bytes, scales, spec.quant_type, spec.blocksize_log2, rows,
                  cols, int(launch_rows), bias_data, out_data);
  });
  return out.reshape_symint(out_shape);
}

TORCH_LIBRARY_IMPL(nf4, CUDA, m) { m.impl("gemv", &gemv_cuda); }

}  // namespace nf4
