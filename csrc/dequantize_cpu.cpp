// nf4::dequantize on the CPU: the core's loop, parallel over rows of W; on x86-64 CPUs with AVX-512 (F, BW, VL)
// each block's 16 values are one vector multiply and conversion, and whole runs of 64 elements inside a block take
// table permutes instead of scalar lookups.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_vector.h"
#include "ops.h"

namespace nf4 {

namespace {

template <typename scalar_t, typename Blocks = ScalarBlocks>
void dequantize_rows(const uint8_t* bytes, const BlockScales& scales, const CodeTable& table, int blocksize_log2,
                     int64_t begin, int64_t end, scalar_t* out) {
  // c10::Half / c10::BFloat16 construct from float with round-to-nearest-even, as bitsandbytes does.
  dequantize_elements(bytes, scales, table, blocksize_log2, begin, end, out,
                      [](float v) { return static_cast<scalar_t>(v); }, Blocks{});
}

#ifdef NF4_CPU_AVX512
// The same loop compiled for AVX-512, so that the policy's functions inline into it.
template <typename scalar_t>
NF4_AVX512_TARGET void dequantize_rows_avx512(const uint8_t* bytes, const BlockScales& scales, const CodeTable& table,
                                              int blocksize_log2, int64_t begin, int64_t end, scalar_t* out) {
  dequantize_rows<scalar_t, Avx512Blocks>(bytes, scales, table, blocksize_log2, begin, end, out);
}
#endif

void dequantize_into(const WeightSpec& spec, const WeightData& weight, at::Tensor& out) {
  const int64_t rows = spec.rows.expect_int();
  const int64_t cols = spec.cols.expect_int();
  const CodeTable table = code_table(spec.quant_type);
  const int64_t grain_rows = std::max<int64_t>(1, at::internal::GRAIN_SIZE / cols);

  NF4_DISPATCH_FLOAT_TYPES(out.scalar_type(), "nf4::dequantize", [&] {
    scalar_t* out_data = out.mutable_data_ptr<scalar_t>();
    auto rows_kernel = dequantize_rows<scalar_t>;
#ifdef NF4_CPU_AVX512
    if (cpu_has_avx512()) rows_kernel = dequantize_rows_avx512<scalar_t>;
#endif
    at::parallel_for(0, rows, grain_rows, [&](int64_t row_begin, int64_t row_end) {
      rows_kernel(weight.bytes, weight.scales, table, spec.blocksize_log2, row_begin * cols, row_end * cols,
                  out_data + row_begin * cols);
    });
  });
}

}  // namespace

at::Tensor dequantize_cpu(NF4_DEQUANTIZE_PARAMS) {
  const WeightSpec spec = check_dequantize_args(packed, absmax, blocksize, quant_type, shape, dtype, nested_absmax,
                                                nested_code, nested_offset, nested_blocksize);
  const WeightData weight = weight_data("nf4::dequantize", spec, packed, absmax, nested_absmax, nested_code,
                                        nested_offset);
  at::Tensor out = at::empty({spec.rows.expect_int(), spec.cols.expect_int()}, packed.options().dtype(dtype));
  dequantize_into(spec, weight, out);
  return out;
}

void dequantize_out_cpu(NF4_DEQUANTIZE_PARAMS, at::Tensor& out) {
  const WeightSpec spec = check_dequantize_out_args(packed, absmax, blocksize, quant_type, shape, dtype,
                                                    nested_absmax, nested_code, nested_offset, nested_blocksize, out);
  const WeightData weight = weight_data("nf4::dequantize.out", spec, packed, absmax, nested_absmax, nested_code,
                                        nested_offset);
  check_storage_holds("nf4::dequantize.out", "out", out);
  dequantize_into(spec, weight, out);
}

TORCH_LIBRARY_IMPL(nf4, CPU, m) {
  m.impl("dequantize", &dequantize_cpu);
  m.impl("dequantize.out", &dequantize_out_cpu);
}

}  // namespace nf4
