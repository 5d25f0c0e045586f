// The only TORCH_LIBRARY(nf4, ...): every schema, the Meta kernels, and the Python module stub that lets
// `import nf4_ops._C` load this library. CPU and CUDA kernels register themselves in their own files.
#include <Python.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include "ops.h"

namespace nf4 {
namespace {

// Meta kernels: the same validation as the real kernels, then an output of the right symbolic shape.
at::Tensor dequantize_meta(NF4_DEQUANTIZE_PARAMS) {
  const WeightSpec spec = check_dequantize_args(packed, absmax, blocksize, quant_type, shape, dtype, nested_absmax,
                                                nested_code, nested_offset, nested_blocksize);
  return at::empty_symint({spec.rows, spec.cols}, packed.options().dtype(dtype));
}

void dequantize_out_meta(NF4_DEQUANTIZE_PARAMS, at::Tensor& out) {
  check_dequantize_out_args(packed, absmax, blocksize, quant_type, shape, dtype, nested_absmax, nested_code,
                            nested_offset, nested_blocksize, out);
}

at::Tensor gemv_meta(NF4_GEMV_PARAMS) {
  const WeightSpec spec = check_gemv_args(x, packed, absmax, blocksize, quant_type, shape, bias, nested_absmax,
                                          nested_code, nested_offset, nested_blocksize);
  return at::empty_symint(gemv_output_shape(x, spec.rows), x.options());
}

}  // namespace
}  // namespace nf4

TORCH_LIBRARY(nf4, m) {
  m.def(
      "dequantize(Tensor packed, Tensor absmax, int blocksize, str quant_type, SymInt[] shape, ScalarType dtype, "
      "Tensor? nested_absmax=None, Tensor? nested_code=None, Tensor? nested_offset=None, "
      "int nested_blocksize=256) -> Tensor");
  // Writes into a caller's [N, K] buffer of dtype `dtype`, so a dequantize + matmul path allocates nothing.
  m.def(
      "dequantize.out(Tensor packed, Tensor absmax, int blocksize, str quant_type, SymInt[] shape, "
      "ScalarType dtype, Tensor? nested_absmax=None, Tensor? nested_code=None, Tensor? nested_offset=None, "
      "int nested_blocksize=256, *, Tensor(a!) out) -> ()");
  m.def(
      "gemv(Tensor x, Tensor packed, Tensor absmax, int blocksize, str quant_type, SymInt[] shape, "
      "Tensor? bias=None, Tensor? nested_absmax=None, Tensor? nested_code=None, Tensor? nested_offset=None, "
      "int nested_blocksize=256) -> Tensor");
}

// The ops have no derivative of their own (nf4_ops.gemv's Python wrapper has one for x and bias). PyTorch's
// not-implemented fallbacks (for both keys, as its REGISTER_AUTOGRAD_NOT_IMPLEMENTED_FALLBACK does) make that an
// error at backward, where without them the output came back with no grad_fn and x's gradient silently None; they
// also move dequantize.out's version counter as for any out= op.
constexpr const char* kOpNames[] = {"dequantize", "dequantize.out", "gemv"};

TORCH_LIBRARY_IMPL(nf4, Autograd, m) {
  for (const char* name : kOpNames) m.impl(name, torch::autograd::autogradNotImplementedFallback());
}

TORCH_LIBRARY_IMPL(nf4, ADInplaceOrView, m) {
  for (const char* name : kOpNames) m.impl(name, torch::autograd::autogradNotImplementedInplaceOrViewFallback());
}

TORCH_LIBRARY_IMPL(nf4, Meta, m) {
  m.impl("dequantize", &nf4::dequantize_meta);
  m.impl("dequantize.out", &nf4::dequantize_out_meta);
  m.impl("gemv", &nf4::gemv_meta);
}

#ifndef NF4_WGMMA_SM90A
#define NF4_WGMMA_SM90A 0
#endif

// `import nf4_ops._C` needs a module init function; the ops register when the library loads. Its attribute
// wgmma_sm90a says whether the build has the warpgroup gemv kernel (setup.py), for the tests that check which kernel
// a call takes.
extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "nf4 torch operators (torch.ops.nf4)", -1,
                                   nullptr};
  PyObject* module = PyModule_Create(&module_def);
  if (module != nullptr && PyModule_AddIntConstant(module, "wgmma_sm90a", NF4_WGMMA_SM90A) != 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
