// The only TORCH_LIBRARY(nf4, ...): every schema, the Meta kernels, and the Python module stub that lets
// `import nf4_ops._C` load this library. CPU and CUDA kernels register themselves in their own files.
#include <Python.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <string>

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

// nf4::dequantize.out through the dispatcher, for the kernels below that run it under their own key.
const c10::TypedOperatorHandle<void(NF4_DEQUANTIZE_PARAMS, at::Tensor&)>& dequantize_out_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("nf4::dequantize", "out")
                             .typed<void(NF4_DEQUANTIZE_PARAMS, at::Tensor&)>();
  return op;
}

// The ops have no derivative of their own (nf4_ops.gemv's Python wrapper has one for x and bias). Without an
// Autograd kernel PyTorch's global fallback only warned at backward and gave a None gradient. dequantize and gemv
// take PyTorch's not-implemented fallback (below): backward, or torch.compile tracing a call whose inputs need
// gradients, raises "derivative for nf4::... is not implemented". That fallback does nothing for dequantize.out,
// whose schema returns no tensor: this kernel refuses inputs that need gradients, as ATen's out= ops do. out's
// version counter moves in the ADInplaceOrView kernel below this one, which torch.inference_mode() still runs for
// ordinary tensors (it skips this one): a backward that saved `out` before it was overwritten raises instead of
// reading it, inside inference mode or not.
void dequantize_out_autograd(NF4_DEQUANTIZE_PARAMS, at::Tensor& out) {
  if (at::GradMode::is_enabled()) {
    const std::pair<const char*, const at::Tensor*> differentiable[] = {
        {"packed", &packed},  // bytes, but a float quant_storage (a Params4bit of bf16) can require grad
        {"absmax", &absmax},
        {"nested_absmax", nested_absmax ? &*nested_absmax : nullptr},
        {"nested_code", nested_code ? &*nested_code : nullptr},
        {"nested_offset", nested_offset ? &*nested_offset : nullptr},
        {"out", &out}};
    for (const auto& [name, t] : differentiable) {
      TORCH_CHECK(t == nullptr || !t->requires_grad(), "nf4::dequantize.out: ", name,
                  " requires grad, but the op has no derivative and out= ops take no part in autograd; call it "
                  "under torch.no_grad() or on tensors that need no gradient");
    }
  }
  at::AutoDispatchBelowAutograd below_autograd;  // on to ADInplaceOrView, which moves out's version
  dequantize_out_op().call(packed, absmax, blocksize, quant_type, shape, dtype, nested_absmax, nested_code,
                           nested_offset, nested_blocksize, out);
}

void dequantize_out_inplace_or_view(NF4_DEQUANTIZE_PARAMS, at::Tensor& out) {
  {
    at::AutoDispatchBelowADInplaceOrView below_inplace_or_view;
    dequantize_out_op().call(packed, absmax, blocksize, quant_type, shape, dtype, nested_absmax, nested_code,
                             nested_offset, nested_blocksize, out);
  }
  torch::autograd::impl::bump_version(out);
}

// A view with a math bit (torch._neg_view, a conjugate) reaches an op through PyTorch's Negative and Conjugate
// fallbacks, which resolve it into a new tensor before the kernel runs. That is right for values, but `packed` is
// bytes: its resolved copy holds other bytes (a negated uint8 b is 256 - b), so the weight would come out wrong with
// no error; and out= would be written into a resolved copy, not the caller's tensor. So these kernels refuse both
// and, like the fallbacks, resolve every other tensor (x, bias, the scales), then dispatch below their key.
void resolve_math_bits(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack,
                       c10::DispatchKey self) {
  const auto& arguments = op.schema().arguments();
  const size_t first = stack->size() - arguments.size();
  const std::string name = op.schema().operator_name().name + (op.schema().overload_name().empty()
                                                                    ? std::string()
                                                                    : "." + op.schema().overload_name());
  for (size_t i = 0; i < arguments.size(); ++i) {
    c10::IValue& value = (*stack)[first + i];
    if (!value.isTensor()) continue;
    const at::Tensor& t = value.toTensor();
    if (!t.is_neg() && !t.is_conj()) continue;
    const std::string& argument = arguments[i].name();
    const char* kind = t.is_neg() ? "negated" : "conjugated";
    TORCH_CHECK(argument != "packed", name, ": packed must be a plain tensor of bitsandbytes' bytes, got a ", kind,
                " view, whose values PyTorch would resolve before the op reads its bytes; pass the tensor it views");
    const auto* alias = arguments[i].alias_info();
    TORCH_CHECK(alias == nullptr || !alias->isWrite(), name, ": ", argument, " must be a plain tensor, got a ", kind,
                " view, which the op would write a resolved copy of; pass a tensor without the view's flag");
    value = t.resolve_conj().resolve_neg();
  }
  op.redispatchBoxed(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, self), stack);
}

void resolve_negative(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  resolve_math_bits(op, keys, stack, c10::DispatchKey::Negative);
}

void resolve_conjugate(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  resolve_math_bits(op, keys, stack, c10::DispatchKey::Conjugate);
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

TORCH_LIBRARY_IMPL(nf4, Autograd, m) {
  m.impl("dequantize", torch::autograd::autogradNotImplementedFallback());
  m.impl("gemv", torch::autograd::autogradNotImplementedFallback());
  m.impl("dequantize.out", &nf4::dequantize_out_autograd);
}

TORCH_LIBRARY_IMPL(nf4, ADInplaceOrView, m) {
  m.impl("dequantize.out", &nf4::dequantize_out_inplace_or_view);
}

TORCH_LIBRARY_IMPL(nf4, Negative, m) {
  for (const char* op : {"dequantize", "dequantize.out", "gemv"}) {
    m.impl(op, torch::CppFunction::makeFromBoxedFunction<&nf4::resolve_negative>());
  }
}

TORCH_LIBRARY_IMPL(nf4, Conjugate, m) {
  for (const char* op : {"dequantize", "dequantize.out", "gemv"}) {
    m.impl(op, torch::CppFunction::makeFromBoxedFunction<&nf4::resolve_conjugate>());
  }
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
