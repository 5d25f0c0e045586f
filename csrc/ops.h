// Host-side declarations shared by the registration, the CPU kernels and the CUDA kernels: the one
// argument validator every kernel (Meta, CPU, CUDA) calls, and the kernel entry points.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>
#include <c10/util/string_view.h>

#include <algorithm>
#include <optional>

#include "nf4_core.h"

namespace nf4 {

using OptTensor = std::optional<at::Tensor>;

// x @ w.T + bias by torch's matmul, as nf4::gemv's dense path (the weight dequantized, then cuBLAS or the CPU's
// matmul) computes it: outside any autocast region of the caller, so that nf4::gemv computes in x's dtype whatever
// its row count and whether eager or compiled (a custom op has no autocast kernel, and without this guard the
// caller's autocast reached this inner call alone, in eager mode only). Defined in gemv_cpu.cpp.
at::Tensor linear_outside_autocast(const at::Tensor& x, const at::Tensor& w, const OptTensor& bias);

// What the validator learned about a packed weight; sizes stay symbolic for the Meta kernels.
struct WeightSpec {
  QuantType quant_type;
  c10::SymInt rows;  // N
  c10::SymInt cols;  // K
  int blocksize_log2;
  int nested_blocksize_log2;
  bool nested;
};

// Checks every weight argument of both ops and throws a message that names the op, the argument, what
// was expected and what was found. `op` is "nf4::dequantize" or "nf4::gemv".
WeightSpec check_weight_args(const char* op, const at::Tensor& packed, const at::Tensor& absmax,
                             int64_t blocksize, c10::string_view quant_type, c10::SymIntArrayRef shape,
                             const OptTensor& nested_absmax, const OptTensor& nested_code,
                             const OptTensor& nested_offset, int64_t nested_blocksize);

WeightSpec check_dequantize_args(const at::Tensor& packed, const at::Tensor& absmax, int64_t blocksize,
                                 c10::string_view quant_type, c10::SymIntArrayRef shape, at::ScalarType dtype,
                                 const OptTensor& nested_absmax, const OptTensor& nested_code,
                                 const OptTensor& nested_offset, int64_t nested_blocksize);

// check_dequantize_args plus `out`: on packed's device, of dtype `dtype`, shaped [N, K], contiguous.
WeightSpec check_dequantize_out_args(const at::Tensor& packed, const at::Tensor& absmax, int64_t blocksize,
                                     c10::string_view quant_type, c10::SymIntArrayRef shape, at::ScalarType dtype,
                                     const OptTensor& nested_absmax, const OptTensor& nested_code,
                                     const OptTensor& nested_offset, int64_t nested_blocksize,
                                     const at::Tensor& out);

WeightSpec check_gemv_args(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& absmax,
                           int64_t blocksize, c10::string_view quant_type, c10::SymIntArrayRef shape,
                           const OptTensor& bias, const OptTensor& nested_absmax, const OptTensor& nested_code,
                           const OptTensor& nested_offset, int64_t nested_blocksize);

// For the CPU and CUDA kernels only (a Meta or fake tensor has no data): every byte that t's sizes, strides and
// offset reach lies in its storage. The kernels read and write through raw pointers, and a storage freed or shrunk
// after its tensor was made (FSDP frees a resharded parameter's with untyped_storage().resize_(0)) would otherwise be
// read or written out of bounds: torch's typed pointers catch only a freed storage, its untyped ones neither.
void check_storage_holds(const char* op, const char* name, const at::Tensor& t);

// Raw pointers to the (validated) weight data, for the kernels, after check_storage_holds on each tensor.
struct WeightData {
  const uint8_t* bytes;  // packed, whatever its storage dtype
  BlockScales scales;
};
WeightData weight_data(const char* op, const WeightSpec& spec, const at::Tensor& packed, const at::Tensor& absmax,
                       const OptTensor& nested_absmax, const OptTensor& nested_code, const OptTensor& nested_offset);

// The output shape of gemv: x's leading dims followed by N.
c10::SymDimVector gemv_output_shape(const at::Tensor& x, const c10::SymInt& rows);

// Dispatch over the three activation / output dtypes (the validator rejects every other dtype first).
#define NF4_DISPATCH_FLOAT_TYPES(TYPE, NAME, ...)                                                   \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)                          \
                                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)                       \
                                         AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

// The op entry points, one per device (the schemas are in registration.cpp).
#define NF4_DEQUANTIZE_PARAMS                                                                                 \
  const at::Tensor &packed, const at::Tensor &absmax, int64_t blocksize, c10::string_view quant_type,       \
      c10::SymIntArrayRef shape, at::ScalarType dtype, const OptTensor &nested_absmax,                       \
      const OptTensor &nested_code, const OptTensor &nested_offset, int64_t nested_blocksize
#define NF4_GEMV_PARAMS                                                                                       \
  const at::Tensor &x, const at::Tensor &packed, const at::Tensor &absmax, int64_t blocksize,               \
      c10::string_view quant_type, c10::SymIntArrayRef shape, const OptTensor &bias,                         \
      const OptTensor &nested_absmax, const OptTensor &nested_code, const OptTensor &nested_offset,          \
      int64_t nested_blocksize

at::Tensor dequantize_cpu(NF4_DEQUANTIZE_PARAMS);
void dequantize_out_cpu(NF4_DEQUANTIZE_PARAMS, at::Tensor& out);
at::Tensor gemv_cpu(NF4_GEMV_PARAMS);
at::Tensor dequantize_cuda(NF4_DEQUANTIZE_PARAMS);
void dequantize_out_cuda(NF4_DEQUANTIZE_PARAMS, at::Tensor& out);
at::Tensor gemv_cuda(NF4_GEMV_PARAMS);
// The many-rows kernel (csrc/gemv_many_rows.cu): whether it fits this GPU (its shared memory) and a call on a W of
// `rows` x `cols` with `x_rows` rows of x (its work counted in 32-bit), and one call of it on fp16 / bf16 x_2d (whose
// layout tensor_core_gemv_applies accepted) into `out` [x rows, N].
bool many_rows_gemv_fits(int64_t rows, int64_t cols, int64_t x_rows);
void launch_many_rows_gemv(const at::Tensor& x_2d, const uint8_t* packed, const BlockScales& scales,
                           const WeightSpec& spec, const at::Tensor& bias, at::Tensor& out);

// The crossover between gemv's fused kernels and dequantize + dense matmul (cuBLAS on CUDA, at::linear
// on the CPU): above these many rows of x, gemv dequantizes W once into x's dtype (on the CPU only bf16 x on CPUs
// with AVX512-BF16; fp32 otherwise: gemv_cpu.cpp) and calls the matmul,
// because W is then reused by enough rows that a matrix-matrix product wins. This is the one place they
// are set; benchmarks/NOTES.md (gemv rows 18, 20, 64 and 65) and the rows-of-x sweep of benchmarks/bench_kernels.py
// measure them (README, "Performance").
//  - the CPU kernel and the CUDA-core CUDA kernel (fp32 x that the one-row kernel does not take, or shapes the
//    tensor-core kernel cannot take):
constexpr int64_t kFusedGemvMaxRows = 8;
//  - the CUDA tensor-core kernel (fp16 / bf16 x on sm_80+, K % 256 == 0, blocksize >= 64): up to these many rows of
//    x in one launch (two mma n-tiles of 8); more rows take the many-rows kernel below, then dequantize + cuBLAS.
//    (Calls of 17-64 rows took launches of 16 rows, each reading all of W again, up to limits by W's size, until
//    the many-rows kernel came: NOTES gemv rows 18, 20 and 65. Its limits reach past theirs on every W in both
//    memory classes and it was faster at every row count its sweeps measured, so the launches and their tables are
//    gone. At 33 rows, which those sweeps skipped, an H200's older suite had the launches 8% ahead on Llama's
//    gate/up, until the last rows of such calls took a launch of their own, below: now 1.23x faster than them.)
constexpr int64_t kTensorCoreGemvLaunchRows = 16;
struct GemvRowLimit {
  int64_t min_packed_mib;  // from this size of the packed W (N * K / 2 bytes, in MiB) ...
  int64_t max_rows;        // ... up to this many rows of x take the path its table is for
};
struct GemvRowRange {
  int64_t min_packed_mib;  // from this size of the packed W (N * K / 2 bytes, in MiB) ...
  int64_t min_rows;        // ... from this many rows of x ...
  int64_t max_rows;        // ... up to this many take the path its table is for (none where max_rows < min_rows)
};
// The memory classes of the tables below: the peak DRAM bandwidth from the device's memory clock and bus width.
// The first table of each pair was measured on an H100 SXM (HBM3, 3.35 TB/s peak), the FastMemory one, for a
// peak of kFastMemoryMinPeakGBps or more, on an H200 (HBM3e, 4.8 TB/s peak); other GPUs take the class their
// bandwidth falls in.
constexpr int64_t kFastMemoryMinPeakGBps = 4000;

//  - fp32 x on CUDA where the one-row kernel takes it (csrc/gemv.cu, one_row_gemv_applies with split operands):
//    one launch of the one-row kernel that takes the rows of x one after another (W from L2 after the first row
//    where it fits there), up to these many rows by the size of W, then dequantize + cuBLAS (the CUDA-core kernel,
//    which the other fp32 cases keep, costs about a weight read per row of x and was 2x slower than dequantize +
//    cuBLAS at 8 rows on Llama's gate/up and q). Each limit is the most rows through which the launch was faster
//    than dequantize + cuBLAS in fp32 (and than bitsandbytes, which does the same there) on plain and on nested
//    absmax, measured on an H100 at 1-12, 14, 16, 20, 24 and 32 rows (plain) and 4-10, 12 and 16 (nested) (NOTES gemv
//    rows 59 and 62; cuBLAS's fp32 time jumps between row counts, so a limit is where the launch stays ahead, not
//    where the two cross first):
constexpr GemvRowLimit kOneRowFp32RowLimits[] = {
    {0, 7},   // Qwen's k/v (2.5 MiB): nested 35.7 us against 41.7 at 7 rows, 5% behind at 8 (plain 4% ahead there)
    {4, 16},  // Llama's k/v (4 MiB): ahead through 16 rows (plain 71.5 us against 84.6, nested 79.0 against 84.5)
    {5, 8},   // Gemma's k/v (5.25 MiB) and q (10.5 MiB): ahead through 8 (k/v 56.6 us against 76.4 nested); at 9
              // Gemma's q nested 3% behind (plain 4% ahead), its k/v even (plain) or 9% behind (nested)
    {16, 9},  // Qwen's q (20 MiB), Llama's q (32 MiB) and gate/up (112 MiB): ahead through 9 (4-19%), at 10 about
              // even or behind, at 11 all of them behind
};

//  - fp16 / bf16 x on CUDA where the one-row kernel takes it (csrc/gemv.cu, one_row_gemv_applies): up to these many
//    rows (at most kOrMaxXRows, 3) take one launch of it that decodes each step once for all of them; more rows take
//    the tensor-core kernel. Measured against the tensor-core kernel with 16 calls per graph, every paper layer, two
//    passes each, at 2 rows (NOTES gemv rows 79 and 82) and at 3 (row 84). H100: 2 rows 6-30% faster on all but
//    Gemma's k/v (even: 6.68 us against 6.62; Llama's gate/up 51.9 us against 60.8); 3 rows 18-20% faster on Gemma's
//    q/o (10.5 MiB packed: 10.8 us against 13.5), 8-11% on Qwen's q/o (20 MiB), 2-5% from Llama's q/o (32 MiB) to
//    Qwen's gate/up and down (62.5 MiB), but 5-14% slower on the k/v layers (4-5.25 MiB: Gemma's 7.6 us against 6.6)
//    and 3-8% on Llama's gate/up and down (112 MiB: 66.8 us against 61.7 on down).
constexpr GemvRowLimit kOneRowXRowLimits[] = {
    {0, 2},
    {8, 3},
    {100, 2},
};
//    H200: 2 rows 4-36% faster below 48 MiB of packed W (Gemma's q/o, Qwen's q/o, Llama's q/o and k/v) but for
//    Gemma's k/v (6.6 us against 6.2); from 55 MiB 5-12% slower on the gate/up layers and Llama's down (50.2 us
//    against 45.5 on Llama's gate/up) and 6% faster on Gemma's and Qwen's down, so from 48 MiB one row (the H200 runs
//    the one-row kernel's decode nearer its issue limit: one row reads 75% of the read ceiling there, 93% on the
//    H100). 3 rows 18-19% faster on Gemma's q/o and 5-8% on Qwen's q/o, but 11% slower on Llama's q/o (32 MiB: 22.2
//    us against 20.0) and 6-18% on the k/v layers.
constexpr GemvRowLimit kOneRowXRowLimitsFastMemory[] = {
    {0, 2},
    {8, 3},
    {32, 2},
    {48, 1},
};

//  - fp16 / bf16 x on CUDA where the warpgroup kernel applies (csrc/gemv.cu, wg_gemv_applies: sm_90a builds on
//    H100 / H200, from kWgMinXRows (4) to 16 rows, layers whose 16-row tiles would not take one CTA per tile): these
//    rows by the size of W, the tensor-core kernel elsewhere. Measured against the tensor-core kernel, 16 calls per
//    graph, two passes. H100 (NOTES gemv row 99, every paper layer at 2-16 rows): 4-8 rows 4-23% faster on the q/o
//    layers (Gemma's q 8 rows 11.6 us against 15.1), 1-4% on Gemma's and Qwen's gate/up and down; 12-16 rows -8% to
//    +1%; on Llama's gate/up and down (112 MiB) 1-4% slower at 4-16 rows. After its shorter loop (row 103) and the
//    cheaper adding kernel (row 105), Llama's gate/up and down at 4-16 rows (row 106): 0-3% faster at 4-8 rows, 4-6%
//    at 12-16 (Llama's down 16 rows 66.7 us against 70.8), so every size takes it.
constexpr GemvRowRange kWarpgroupXRows[] = {
    {0, 4, 16},
};
//    H200 (NOTES gemv row 101): 4-8 rows 6-24% faster below 32 MiB (Gemma's q 8 rows 11.2 us against 14.7, Qwen's q/o
//    7-9%), Llama's q/o (32 MiB) -2 to +3%; 4 rows 4-19% slower on the gate/up and down layers, 12-16 rows within
//    -3% to +9%. After row 103 (row 104): Gemma's and Qwen's q 3-5% faster at 16 rows, Llama's q (32 MiB) 7-8% at 4
//    and 16. After row 105 (row 106, at 4, 8, 12 and 16 rows): Gemma's and Qwen's gate/up and down (55-62.5 MiB)
//    2-12% faster at 8-16 rows (Gemma's down 8 rows 28.7 us against 32.6) but the gate/up layers 7-9% slower at 4
//    (the down layers 2-4% faster there); Llama's gate/up and down (112 MiB) -6% to +10% (gate/up +10% at 4 rows,
//    +3% at 12-16). At 5-7 rows (row 109): the gate/up layers +3 / +5% at 5, +1 / +3% at 6, -4 / -1% at 7, the down
//    layers 6-12% faster (a model runs gate and up, two calls, for each down). So up to 48 MiB 4-16 rows, from 48 MiB
//    7-16, from 100 MiB none. Since the CTA's warpgroups share x at 9-16 rows (rows 115-115c), Llama's gate/up and
//    down at 9 / 12 / 16 rows (row 116): 6-11% / 9-17% faster (down 16 rows 54.4 us against 65.2), so from 100 MiB
//    9-16 (1-8 rows, whose kernel did not change, stay on the tensor-core kernel).
constexpr GemvRowRange kWarpgroupXRowsFastMemory[] = {
    {0, 4, 16},
    {48, 7, 16},
    {100, 9, 16},
};

//  - where the warpgroup kernel takes a call, the fraction of the resident CTAs (one a SM) from which its team tiles
//    go one to a team, whole (csrc/gemv.cu, wg_whole_tile_grid: the SMs past the tiles idle, no tile shared, no adding
//    kernel), up to all of them; stream-K over every SM below it. Synthetic layers of 70-131 team tiles (53-99% of 132
//    SMs) at K = 5376 and 8192, 8 and 16 rows of bf16 x, two passes (NOTES gemv rows 143-143d). H100: 3-11% faster
//    from 112 tiles (85%: Gemma-27B's gate/up, 34.1 -> 32.1 us at 16 rows), 1-4% at 106 (80%), -1 to +2% at 100
//    (76%), 6-33% slower at 53-65%. H200: 2-11% faster from 126 tiles (95%: 33.3 -> 30.4 us at K = 5376, 16 rows),
//    -7 to +2% at 120 (91%), -1 to +7% at 112 (Gemma's gate/up +2% at 8 rows), 3-9% slower at 106 (80%), 9-57% at
//    53-76%: with faster DRAM the idle SMs cost more. Each fraction lies midway between the last measured one where a
//    case gained under 2% and the first where every case gained 2% or more.
constexpr int64_t kWarpgroupWholeTileMinPercent = 82;
constexpr int64_t kWarpgroupWholeTileMinPercentFastMemory = 93;
// A tuning build may set one fraction for every GPU with -DNF4_WG_WHOLE_TILE_MIN_PERCENT=p (above 100: never).
inline int64_t warpgroup_whole_tile_min_percent(int64_t peak_memory_GBps) {
#ifdef NF4_WG_WHOLE_TILE_MIN_PERCENT
  return NF4_WG_WHOLE_TILE_MIN_PERCENT;
#else
  return peak_memory_GBps >= kFastMemoryMinPeakGBps ? kWarpgroupWholeTileMinPercentFastMemory
                                                    : kWarpgroupWholeTileMinPercent;
#endif
}

// The entry of a table by size (GemvRowLimit, GemvRowRange) for a W of rows x cols: the last entry whose
// min_packed_mib the packed W reaches, or nullptr where none does.
template <typename Entry, size_t kCount>
const Entry* gemv_size_entry(const Entry (&table)[kCount], int64_t rows, int64_t cols) {
  const int64_t packed_mib = rows * cols / 2 / (int64_t{1} << 20);
  const Entry* found = nullptr;
  for (const Entry& entry : table) {
    if (packed_mib >= entry.min_packed_mib) found = &entry;
  }
  return found;
}

// The max_rows of the last limit whose min_packed_mib the packed W reaches (0 where none does).
template <size_t kCount>
int64_t gemv_row_limit(const GemvRowLimit (&limits)[kCount], int64_t rows, int64_t cols) {
  const GemvRowLimit* limit = gemv_size_entry(limits, rows, cols);
  return limit != nullptr ? limit->max_rows : 0;
}

//  - the many-rows kernel (csrc/gemv_many_rows.cu: fp16 / bf16 x where the tensor-core kernel's layout fits): a call
//    of more than kTensorCoreGemvLaunchRows rows of x, up to these many, takes one launch of it (and, for a few last
//    rows on large W, one launch of the one-row, tensor-core or warpgroup kernel: kManyRowsTailRowLimits below), which
//    decodes W once per 32 rows of x (each 32 rows cost about the whole time again: it is bound by its decode, while
//    dequantize + cuBLAS, which writes and reads W in 16 bits, is bound by the memory). Measured with its stream-K
//    version over the paper's layer shapes at 17-128 rows (benchmarks/NOTES.md gemv rows 64-65, the sweeps in
//    benchmarks/results/h100-many-rows/v13_sweep_checked.txt and h200-many-rows/), against the better of
//    dequantize + cuBLAS and launches of 16 rows (and bitsandbytes, slower than both there):
//    H100: faster on every layer through 32 rows (1.09-1.69x); at 48-64 rows slower on Llama's k/v (4 MiB packed:
//    16.1-16.5 us against 15.3-15.6) and on Qwen's at 64 (2.5 MiB: 14.3 against 13.7), faster on the rest (Gemma's
//    k/v, 5.25 MiB, 1.07-1.09x); at 80-96 rows (three tiles of x) faster on every layer of 16 MiB or more
//    (1.17-1.42x), slower on Gemma's o and k/v; at 128 slower on the q/o/k/v layers and Llama's gate/up.
constexpr GemvRowLimit kManyRowsGemvRowLimits[] = {
    {0, 32},
    {5, 64},
    {16, 96},
};
//    H200: faster on every layer through 32 rows (1.02-1.58x); at 48-64 rows faster on every layer of 16 MiB or
//    more (1.06-1.49x), even or slower below (Gemma's o 0.97-0.99x, the k/v layers 0.85-0.97x; Gemma's q 1.07-1.13x);
//    at 80 rows and more slower on all but Gemma's and Qwen's down (1.02-1.03x).
constexpr GemvRowLimit kManyRowsGemvRowLimitsFastMemory[] = {
    {0, 32},
    {16, 64},
};
//    The kernel decodes W once per tile of this many rows of x, so a last tile of a few rows costs about what a whole
//    one does (on Llama's gate/up ~95 us on an H100 or an H200), where a launch of the one-row kernel for one row
//    takes 46-56 us and of the tensor-core kernel for 2-16 rows 48-86. So, in a call the many-rows kernel takes, the
//    last x_rows % 32 rows take a launch of their own after the whole tiles (the launch a call of those rows alone
//    takes) where they are at most these many, by the size of W. Each is the most such rows at which that split was
//    faster on the paper's layers at 33-48 and 65-80 rows (benchmarks/NOTES.md gemv row 66; the sweeps
//    benchmarks/results/h100-many-rows/v13_sweep_tail_apart.txt and h200-many-rows/): one row from 16 MiB (H100
//    1.06-1.26x, H200 1.11-1.33x); 2-8 rows from 30 MiB (H100 0.99-1.09x: Gemma's gate/up at 8 rows 1% slower; H200
//    1.08-1.17x); up to 16 rows on Llama's gate/up and down, 112 MiB (H100 1.05-1.26x, H200 1.13-1.33x). Below 16 MiB
//    the launch costs more than the tile. One table for both memory classes: the H200 gained more at every point.
constexpr int64_t kManyRowsXTileRows = 32;
constexpr GemvRowLimit kManyRowsTailRowLimits[] = {
    {16, 1},
    {30, 8},
    {100, 16},
};
// A tuning build may set one limit for every W and GPU with -DNF4_MANY_ROWS_MAX_ROWS=n, and one tail limit with
// -DNF4_MANY_ROWS_TAIL_ROWS=n (0: the kernel alone takes every row).
inline int64_t many_rows_gemv_max_rows(int64_t rows, int64_t cols, int64_t peak_memory_GBps) {
#ifdef NF4_MANY_ROWS_MAX_ROWS
  return NF4_MANY_ROWS_MAX_ROWS;
#else
  return peak_memory_GBps >= kFastMemoryMinPeakGBps ? gemv_row_limit(kManyRowsGemvRowLimitsFastMemory, rows, cols)
                                                    : gemv_row_limit(kManyRowsGemvRowLimits, rows, cols);
#endif
}

// The most rows of fp16 / bf16 x that the one-row kernel takes (decoded together) on this W and GPU.
inline int64_t one_row_gemv_max_x_rows(int64_t rows, int64_t cols, int64_t peak_memory_GBps) {
  return peak_memory_GBps >= kFastMemoryMinPeakGBps ? gemv_row_limit(kOneRowXRowLimitsFastMemory, rows, cols)
                                                    : gemv_row_limit(kOneRowXRowLimits, rows, cols);
}

// Whether the warpgroup kernel's table takes x_rows rows of fp16 / bf16 x on this W and GPU (wg_gemv_applies also
// asks for the kernel's own minimum, kWgMinXRows, and the GPU).
inline bool warpgroup_gemv_takes_x_rows(int64_t x_rows, int64_t rows, int64_t cols, int64_t peak_memory_GBps) {
  const GemvRowRange* range = peak_memory_GBps >= kFastMemoryMinPeakGBps
                                  ? gemv_size_entry(kWarpgroupXRowsFastMemory, rows, cols)
                                  : gemv_size_entry(kWarpgroupXRows, rows, cols);
  return range != nullptr && x_rows >= range->min_rows && x_rows <= range->max_rows;
}

// How many of the last rows of x take a launch of their own in a call of x_rows rows that the many-rows kernel takes.
inline int64_t many_rows_gemv_tail_rows(int64_t rows, int64_t cols, int64_t x_rows) {
#ifdef NF4_MANY_ROWS_TAIL_ROWS
  const int64_t max_tail = NF4_MANY_ROWS_TAIL_ROWS;
#else
  const int64_t max_tail = gemv_row_limit(kManyRowsTailRowLimits, rows, cols);
#endif
  const int64_t tail = x_rows % kManyRowsXTileRows;
  return x_rows > kManyRowsXTileRows && tail <= std::min(max_tail, kTensorCoreGemvLaunchRows) ? tail : 0;
}

}  // namespace nf4
