// nf4::gemv on the CPU. Few rows: each W row is dequantized once to fp32 (on AVX-512 CPUs by the vector block
// policy, cpu_vector.h) and dotted with every x row, accumulating in fp32. Many rows: W is dequantized once (to
// bf16 for bf16 x on CPUs with AVX512-BF16, else fp32) and torch's CPU matmul does the rest.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <vector>

#include "cpu_vector.h"
#include "ops.h"

namespace nf4 {
namespace {

// Rows [row_begin, row_end) of out[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]), all in fp32; x is [M, K].
template <typename scalar_t, typename Blocks = ScalarBlocks>
void fused_gemv_rows(const uint8_t* bytes, const BlockScales& scales, const CodeTable& table, int blocksize_log2,
                     int64_t rows, int64_t cols, const float* x, int64_t x_rows, const float* bias_f32,
                     int64_t row_begin, int64_t row_end, scalar_t* out) {
  std::vector<float> w_row(cols);
  for (int64_t n = row_begin; n < row_end; ++n) {
    dequantize_elements(bytes, scales, table, blocksize_log2, n * cols, (n + 1) * cols, w_row.data(),
                        [](float v) { return v; }, Blocks{});
    for (int64_t m = 0; m < x_rows; ++m) {
      float acc = Blocks{}.dot(x + m * cols, w_row.data(), cols);
      if (bias_f32 != nullptr) acc += bias_f32[n];
      out[m * rows + n] = static_cast<scalar_t>(acc);
    }
  }
}

#ifdef NF4_CPU_AVX512
// The same rows compiled for AVX-512: the row decode and the dot product take the vector block policy
// (cpu_vector.h); the dot product keeps its order (32 interleaved partial sums, no contraction: -ffp-contract=off),
// so the result is the same bits as on the scalar path.
template <typename scalar_t>
NF4_AVX512_TARGET void fused_gemv_rows_avx512(const uint8_t* bytes, const BlockScales& scales, const CodeTable& table,
                                              int blocksize_log2, int64_t rows, int64_t cols, const float* x,
                                              int64_t x_rows, const float* bias_f32, int64_t row_begin,
                                              int64_t row_end, scalar_t* out) {
  fused_gemv_rows<scalar_t, Avx512Blocks>(bytes, scales, table, blocksize_log2, rows, cols, x, x_rows, bias_f32,
                                          row_begin, row_end, out);
}
#endif

// out[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]), all in fp32; x_f32 is [M, K] contiguous.
template <typename scalar_t>
void fused_gemv_cpu(const WeightSpec& spec, const uint8_t* bytes, const BlockScales& scales,
                    const at::Tensor& x_f32, const float* bias_f32, scalar_t* out) {
  const int64_t rows = spec.rows.expect_int();
  const int64_t cols = spec.cols.expect_int();
  const CodeTable table = code_table(spec.quant_type);
  const int64_t grain_rows = std::max<int64_t>(1, at::internal::GRAIN_SIZE / cols);
  auto rows_kernel = fused_gemv_rows<scalar_t>;
#ifdef NF4_CPU_AVX512
  if (cpu_has_avx512()) rows_kernel = fused_gemv_rows_avx512<scalar_t>;
#endif
  at::parallel_for(0, rows, grain_rows, [&](int64_t row_begin, int64_t row_end) {
    rows_kernel(bytes, scales, table, spec.blocksize_log2, rows, cols, x_f32.const_data_ptr<float>(), x_f32.size(0),
                bias_f32, row_begin, row_end, out);
  });
}

}  // namespace

at::Tensor linear_outside_autocast(const at::Tensor& x, const at::Tensor& w, const OptTensor& bias) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  return at::linear(x, w, bias);
}

at::Tensor gemv_cpu(NF4_GEMV_PARAMS) {
  const WeightSpec spec = check_gemv_args(x, packed, absmax, blocksize, quant_type, shape, bias, nested_absmax,
                                          nested_code, nested_offset, nested_blocksize);
  check_storage_holds("nf4::gemv", "x", x);
  if (bias.has_value()) check_storage_holds("nf4::gemv", "bias", *bias);
  // before either path, so a bad weight is named for this op whatever x's row count (as in gemv.cu)
  const WeightData weight = weight_data("nf4::gemv", spec, packed, absmax, nested_absmax, nested_code, nested_offset);
  const int64_t rows = spec.rows.expect_int();
  const int64_t cols = spec.cols.expect_int();
  const at::Tensor x_2d = x.reshape({-1, cols});
  const int64_t x_rows = x_2d.size(0);
  const c10::SymDimVector out_shape = gemv_output_shape(x, spec.rows);

  if (x_rows > kFusedGemvMaxRows) {
    // W dequantized once, then torch's matmul: in bf16 for bf16 x on CPUs with AVX512-BF16 (as the CUDA path and
    // bitsandbytes do; in fp32, twice the bytes of W and an fp32 matmul, 16-128 rows took 2-4x as long), else in
    // fp32: torch's fp16 CPU matmul without native fp16 was up to 2.4x slower than fp32's on such a CPU, and its
    // bf16 one without AVX512-BF16 was not measured (NOTES CPU row 5).
    const at::ScalarType dense = x.scalar_type() == at::kBFloat16 && cpu_has_avx512_bf16()
                                     ? at::kBFloat16
                                     : at::kFloat;
    const at::Tensor w = dequantize_cpu(packed, absmax, blocksize, quant_type, shape, dense, nested_absmax,
                                        nested_code, nested_offset, nested_blocksize);
    const OptTensor dense_bias = bias.has_value() ? OptTensor(bias->to(dense)) : std::nullopt;
    return linear_outside_autocast(x_2d.to(dense), w, dense_bias).to(x.scalar_type()).reshape_symint(out_shape);
  }

  at::Tensor out = at::empty({x_rows, rows}, x.options());
  if (x_rows == 0) return out.reshape_symint(out_shape);
  const at::Tensor x_f32 = x_2d.to(at::kFloat).contiguous();
  const at::Tensor bias_f32 = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  NF4_DISPATCH_FLOAT_TYPES(x.scalar_type(), "nf4::gemv", [&] {
    fused_gemv_cpu<scalar_t>(spec, weight.bytes, weight.scales, x_f32, bias_f32.defined() ? bias_f32.const_data_ptr<float>() : nullptr,
                             out.mutable_data_ptr<scalar_t>());
  });
  return out.reshape_symint(out_shape);
}

TORCH_LIBRARY_IMPL(nf4, CPU, m) { m.impl("gemv", &gemv_cpu); }

}  // namespace nf4
