// The one argument validator of both ops, called by the Meta, CPU and CUDA kernels alike. Sizes are
// checked symbolically (TORCH_SYM_CHECK) so the same checks run under fake tensors and dynamic shapes.
#include "ops.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <c10/core/SymBool.h>
#include <c10/core/SymNodeImpl.h>

#include <exception>
#include <string>
#include <utility>

namespace nf4 {
namespace {

constexpr int64_t kMinBlocksize = 32;
constexpr int64_t kMaxBlocksize = 4096;
// The most elements a weight may have: N*K and every size derived from it (packed bytes, absmax blocks, an fp32
// output's bytes) then fit in int64 with room to spare; real weights are below 2^40.
constexpr int64_t kMaxWeightElementsLog2 = 60;

bool is_power_of_two(int64_t v) { return v > 0 && (v & (v - 1)) == 0; }

c10::SymInt ceil_div(const c10::SymInt& a, int64_t b) { return (a + (b - 1)) / b; }

// Every value in an error message is turned into a std::string first (text() below), so messages are
// assembled from strings alone. On the GPU machine (torch 2.11, extensions built by /opt/gcc's g++ against
// a different runtime libstdc++) streaming any number into the message's std::ostringstream segfaulted,
// whether the number came from this library or from c10's SymInt printer; strings were safe.
std::string text(int64_t value) { return std::to_string(value); }

// A symbolic size (torch.compile with dynamic shapes) is named with the value it has in the call being traced, where
// it has one ("s27 (= 321)"): the symbol alone does not say what was passed. Only failed checks build messages, so
// the guard that reading the value adds is on a trace that raises anyway.
std::string text(const c10::SymInt& value) {
  if (const auto concrete = value.maybe_as_int()) return std::to_string(*concrete);
  c10::SymNodeImpl* node = value.toSymNodeImplUnowned();
  std::string name = node->str();
  try {
    if (node->has_hint()) name += " (= " + std::to_string(node->guard_int(__FILE__, __LINE__)) + ")";
  } catch (const std::exception&) {  // the symbol alone, rather than no message
  }
  return name;
}

std::string text(c10::SymIntArrayRef values) {
  std::string out = "[";
  for (size_t i = 0; i < values.size(); ++i) out += (i == 0 ? "" : ", ") + text(values[i]);
  return out + "]";
}

std::string text(const at::Device& device) { return device.str(); }

void check_blocksize(const char* op, const char* name, int64_t value) {
  TORCH_CHECK(is_power_of_two(value) && value >= kMinBlocksize && value <= kMaxBlocksize, op, ": ", name,
              " must be a power of two in [", text(kMinBlocksize), ", ", text(kMaxBlocksize), "], got ",
              text(value));
}

void check_same_device(const char* op, const char* name, const at::Tensor& t, const at::Tensor& packed) {
  TORCH_CHECK(t.device() == packed.device(), op, ": ", name, " must be on the same device as packed (",
              text(packed.device()), "), got ", text(t.device()));
}

void check_contiguous(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous, got strides ", text(t.sym_strides()),
              " for sizes ", text(t.sym_sizes()));
}

void check_dtype(const char* op, const char* name, const at::Tensor& t, at::ScalarType expected,
                 const char* why = "") {
  TORCH_CHECK(t.scalar_type() == expected, op, ": ", name, " must be ", c10::toString(expected), why,
              ", got ", c10::toString(t.scalar_type()));
}

void check_numel(const char* op, const char* name, const at::Tensor& t, const c10::SymInt& expected,
                 const char* what) {
  TORCH_SYM_CHECK(t.sym_numel().sym_eq(expected), op, ": ", name, " must have ", what, " = ", text(expected),
                  " elements, got ", text(t.sym_numel()));
}

bool is_activation_dtype(at::ScalarType t) {
  return t == at::kHalf || t == at::kBFloat16 || t == at::kFloat;
}

}  // namespace

WeightSpec check_weight_args(const char* op, const at::Tensor& packed, const at::Tensor& absmax,
                             int64_t blocksize, c10::string_view quant_type, c10::SymIntArrayRef shape,
                             const OptTensor& nested_absmax, const OptTensor& nested_code,
                             const OptTensor& nested_offset, int64_t nested_blocksize) {
  WeightSpec spec{};
  if (quant_type == "nf4") {
    spec.quant_type = QuantType::NF4;
  } else if (quant_type == "fp4") {
    spec.quant_type = QuantType::FP4;
  } else {
    TORCH_CHECK(false, op, ": quant_type must be \"nf4\" or \"fp4\", got \"", std::string(quant_type), "\"");
  }
  check_blocksize(op, "blocksize", blocksize);
  spec.blocksize_log2 = log2_exact(blocksize);

  TORCH_CHECK(shape.size() == 2, op, ": shape must be [N, K] (2 values), got ",
              text(static_cast<int64_t>(shape.size())), " values ", text(shape));
  spec.rows = shape[0];
  spec.cols = shape[1];
  TORCH_SYM_CHECK(spec.rows.sym_gt(0), op, ": shape[0] (N) must be positive, got ", text(spec.rows));
  TORCH_SYM_CHECK(spec.cols.sym_gt(0), op, ": shape[1] (K) must be positive, got ", text(spec.cols));
  // N <= 2^60 / K (floor), i.e. N*K <= 2^60, tested without forming a product that could wrap
  TORCH_SYM_CHECK(spec.rows.sym_le(c10::SymInt(int64_t{1} << kMaxWeightElementsLog2) / spec.cols), op,
                  ": shape [N, K] must have N*K <= 2^", text(kMaxWeightElementsLog2), " elements, got ", text(shape));
  const c10::SymInt numel = spec.rows * spec.cols;

  // packed: bytes are bytes, whatever the storage dtype; bitsandbytes may pad up to one storage element.
  check_contiguous(op, "packed", packed);
  const int64_t storage_bytes = static_cast<int64_t>(packed.element_size());
  const c10::SymInt packed_bytes = packed.sym_numel() * storage_bytes;
  const c10::SymInt needed_bytes = ceil_div(numel, 2);
  TORCH_SYM_CHECK(packed_bytes.sym_ge(needed_bytes).sym_and(packed_bytes.sym_lt(needed_bytes + storage_bytes)),
                  op, ": packed must hold ceil(N*K/2) = ", text(needed_bytes), " bytes for shape ", text(shape),
                  " (plus at most one ", c10::toString(packed.scalar_type()), " element of padding), got ",
                  text(packed_bytes), " bytes (", text(packed.sym_numel()), " x ",
                  c10::toString(packed.scalar_type()), ")");

  const int given = int(nested_absmax.has_value()) + int(nested_code.has_value()) + int(nested_offset.has_value());
  TORCH_CHECK(given == 0 || given == 3, op,
              ": nested_absmax, nested_code and nested_offset must be given together (bitsandbytes' "
              "state2.absmax, state2.code and offset) or not at all, got ",
              nested_absmax.has_value() ? "nested_absmax " : "", nested_code.has_value() ? "nested_code " : "",
              nested_offset.has_value() ? "nested_offset " : "", "only");
  spec.nested = given == 3;

  const c10::SymInt blocks = ceil_div(numel, blocksize);
  check_same_device(op, "absmax", absmax, packed);
  check_contiguous(op, "absmax", absmax);
  check_numel(op, "absmax", absmax, blocks, "ceil(N*K/blocksize)");
  if (!spec.nested) {
    check_dtype(op, "absmax", absmax, at::kFloat, " (or uint8 codes when nested_* are given)");
    spec.nested_blocksize_log2 = 0;
    return spec;
  }
  check_dtype(op, "absmax", absmax, at::kByte, " (codes) when nested_* are given");
  check_blocksize(op, "nested_blocksize", nested_blocksize);
  spec.nested_blocksize_log2 = log2_exact(nested_blocksize);

  const at::Tensor& n_absmax = *nested_absmax;
  check_same_device(op, "nested_absmax", n_absmax, packed);
  check_contiguous(op, "nested_absmax", n_absmax);
  check_dtype(op, "nested_absmax", n_absmax, at::kFloat);
  check_numel(op, "nested_absmax", n_absmax, ceil_div(blocks, nested_blocksize),
              "ceil(absmax.numel()/nested_blocksize)");

  const at::Tensor& n_code = *nested_code;
  check_same_device(op, "nested_code", n_code, packed);
  check_contiguous(op, "nested_code", n_code);
  check_dtype(op, "nested_code", n_code, at::kFloat);
  check_numel(op, "nested_code", n_code, kNestedCodeEntries, "2^8 (one entry per uint8 code)");

  const at::Tensor& n_offset = *nested_offset;
  check_same_device(op, "nested_offset", n_offset, packed);
  check_dtype(op, "nested_offset", n_offset, at::kFloat);
  TORCH_SYM_CHECK(n_offset.sym_numel().sym_eq(1), op, ": nested_offset must be one value (bitsandbytes' offset), got ",
                  text(n_offset.sym_numel()), " elements");
  return spec;
}

namespace {
// dequantize's and dequantize.out's shared checks, their errors named after the op the caller called.
WeightSpec check_dtype_and_weight_args(const char* op, const at::Tensor& packed, const at::Tensor& absmax,
                                       int64_t blocksize, c10::string_view quant_type, c10::SymIntArrayRef shape,
                                       at::ScalarType dtype, const OptTensor& nested_absmax,
                                       const OptTensor& nested_code, const OptTensor& nested_offset,
                                       int64_t nested_blocksize) {
  TORCH_CHECK(is_activation_dtype(dtype), op, ": dtype must be Half, BFloat16 or Float, got ",
              c10::toString(dtype));
  return check_weight_args(op, packed, absmax, blocksize, quant_type, shape, nested_absmax, nested_code,
                           nested_offset, nested_blocksize);
}
}  // namespace

WeightSpec check_dequantize_args(const at::Tensor& packed, const at::Tensor& absmax, int64_t blocksize,
                                 c10::string_view quant_type, c10::SymIntArrayRef shape, at::ScalarType dtype,
                                 const OptTensor& nested_absmax, const OptTensor& nested_code,
                                 const OptTensor& nested_offset, int64_t nested_blocksize) {
  return check_dtype_and_weight_args("nf4::dequantize", packed, absmax, blocksize, quant_type, shape, dtype,
                                     nested_absmax, nested_code, nested_offset, nested_blocksize);
}

WeightSpec check_dequantize_out_args(const at::Tensor& packed, const at::Tensor& absmax, int64_t blocksize,
                                     c10::string_view quant_type, c10::SymIntArrayRef shape, at::ScalarType dtype,
                                     const OptTensor& nested_absmax, const OptTensor& nested_code,
                                     const OptTensor& nested_offset, int64_t nested_blocksize,
                                     const at::Tensor& out) {
  constexpr const char* op = "nf4::dequantize.out";
  WeightSpec spec = check_dtype_and_weight_args(op, packed, absmax, blocksize, quant_type, shape, dtype,
                                                nested_absmax, nested_code, nested_offset, nested_blocksize);
  check_same_device(op, "out", out, packed);
  check_dtype(op, "out", out, dtype, " (the dtype argument)");
  TORCH_SYM_CHECK(out.sym_sizes().size() == 2 ? out.sym_size(0).sym_eq(spec.rows).sym_and(out.sym_size(1).sym_eq(spec.cols))
                                             : c10::SymBool(false),
                  op, ": out must have shape [N, K] = ", text(shape), ", got ", text(out.sym_sizes()));
  check_contiguous(op, "out", out);
  // out must not share memory with what the kernel reads: it would overwrite bytes it has yet to read. Every
  // tensor here was checked contiguous (nested_offset has one element), so the status is never TooHard, and each
  // one's bytes are [data, data + nbytes): memory shared through separate storages (torch.frombuffer, DLPack), which
  // get_overlap_status does not see, is found by comparing those ranges. Tensors of symbolic sizes (fake tensors
  // while torch.compile traces dynamic shapes) are skipped: torch 2.11's get_overlap_status throws on them, and the
  // compiled graph's call of the real kernel checks the real tensors.
  const auto symbolic = [](const at::Tensor& t) { return t.unsafeGetTensorImpl()->has_symbolic_sizes_strides(); };
  const auto bytes_overlap = [](const at::Tensor& a, const at::Tensor& b) {
    if (a.is_meta() || b.is_meta() || !a.has_storage() || !b.has_storage() || a.nbytes() == 0 || b.nbytes() == 0) {
      return false;
    }
    const auto* a_first = static_cast<const char*>(a.const_data_ptr());
    const auto* b_first = static_cast<const char*>(b.const_data_ptr());
    return a_first < b_first + b.nbytes() && b_first < a_first + a.nbytes();
  };
  const std::pair<const char*, const at::Tensor*> inputs[] = {
      {"packed", &packed},
      {"absmax", &absmax},
      {"nested_absmax", nested_absmax ? &*nested_absmax : nullptr},
      {"nested_code", nested_code ? &*nested_code : nullptr},
      {"nested_offset", nested_offset ? &*nested_offset : nullptr}};
  for (const auto& [name, input] : inputs) {
    if (input == nullptr || symbolic(out) || symbolic(*input)) continue;
    const at::MemOverlapStatus overlap = at::get_overlap_status(out, *input);
    TORCH_CHECK(overlap != at::MemOverlapStatus::Full && overlap != at::MemOverlapStatus::Partial &&
                    !bytes_overlap(out, *input),
                op, ": out must not share memory with ", name, ", which the kernel reads; got out overlapping ", name);
  }
  return spec;
}

WeightSpec check_gemv_args(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& absmax,
                           int64_t blocksize, c10::string_view quant_type, c10::SymIntArrayRef shape,
                           const OptTensor& bias, const OptTensor& nested_absmax, const OptTensor& nested_code,
                           const OptTensor& nested_offset, int64_t nested_blocksize) {
  constexpr const char* op = "nf4::gemv";
  WeightSpec spec = check_weight_args(op, packed, absmax, blocksize, quant_type, shape, nested_absmax,
                                      nested_code, nested_offset, nested_blocksize);
  TORCH_CHECK(is_activation_dtype(x.scalar_type()), op, ": x must be Half, BFloat16 or Float, got ",
              c10::toString(x.scalar_type()));
  TORCH_CHECK(x.dim() >= 1, op, ": x must have at least 1 dimension [..., K], got a 0-dim tensor");
  check_same_device(op, "x", x, packed);
  TORCH_SYM_CHECK(x.sym_size(-1).sym_eq(spec.cols), op, ": x's last dimension must equal K = shape[1] = ",
                  text(spec.cols), ", got x of shape ", text(x.sym_sizes()));
  // x and the output [..., N] within the weight's own bound (no product that could wrap): past it only meta or
  // expanded x get here, and the allocation of the output or of x's contiguous or fp32 copy failed with its own
  // overflow error, which named neither the op nor x. Checked on concrete sizes only: on symbolic ones (torch.compile,
  // torch.export) it would be a guard bounding x's rows, which an export with a named dynamic dimension refuses;
  // the CPU and CUDA kernels check the concrete sizes when they run.
  const std::optional<int64_t> x_elements = x.sym_numel().maybe_as_int(), n = spec.rows.maybe_as_int(),
                               k = spec.cols.maybe_as_int();
  if (x_elements && n && k) {  // (N, K > 0: checked above)
    constexpr int64_t kMaxElements = int64_t{1} << kMaxWeightElementsLog2;
    TORCH_CHECK(*x_elements <= kMaxElements, op, ": x must have at most 2^", text(kMaxWeightElementsLog2),
                " elements, got x of shape ", text(x.sym_sizes()));
    TORCH_CHECK(*x_elements / *k <= kMaxElements / *n, op, ": the output [x rows, N] must have at most 2^",
                text(kMaxWeightElementsLog2), " elements, got x of shape ", text(x.sym_sizes()), " and N = ",
                text(*n));
  }
  if (bias.has_value()) {
    const at::Tensor& b = *bias;
    check_same_device(op, "bias", b, packed);
    check_dtype(op, "bias", b, x.scalar_type(), " (x's dtype)");
    TORCH_CHECK(b.dim() == 1, op, ": bias must be 1-D [N], got shape ", text(b.sym_sizes()));
    check_numel(op, "bias", b, spec.rows, "N = shape[0]");
  }
  return spec;
}

void check_storage_holds(const char* op, const char* name, const at::Tensor& t) {
  if (t.numel() == 0) return;
  int64_t last_element = t.storage_offset();  // strides are never negative in torch
  for (int64_t d = 0; d < t.dim(); ++d) last_element += (t.size(d) - 1) * t.stride(d);
  const int64_t needed = (last_element + 1) * static_cast<int64_t>(t.itemsize());
  const int64_t held = t.has_storage() && t.storage().data() != nullptr ? static_cast<int64_t>(t.storage().nbytes()) : 0;
  TORCH_CHECK(held >= needed, op, ": ", name, "'s storage must hold the ", text(needed),
              " bytes its sizes, strides and offset reach, got ", text(held),
              " (was it freed or shrunk after the tensor was made, as FSDP does to a resharded parameter?)");
}

WeightData weight_data(const char* op, const WeightSpec& spec, const at::Tensor& packed, const at::Tensor& absmax,
                       const OptTensor& nested_absmax, const OptTensor& nested_code, const OptTensor& nested_offset) {
  check_storage_holds(op, "packed", packed);
  check_storage_holds(op, "absmax", absmax);
  WeightData data{static_cast<const uint8_t*>(packed.const_data_ptr()), BlockScales{}};
  if (!spec.nested) {
    data.scales.absmax = absmax.const_data_ptr<float>();
    return data;
  }
  check_storage_holds(op, "nested_absmax", *nested_absmax);
  check_storage_holds(op, "nested_code", *nested_code);
  check_storage_holds(op, "nested_offset", *nested_offset);
  data.scales.codes = absmax.const_data_ptr<uint8_t>();
  data.scales.absmax2 = nested_absmax->const_data_ptr<float>();
  data.scales.code2 = nested_code->const_data_ptr<float>();
  data.scales.offset = nested_offset->const_data_ptr<float>();
  data.scales.nested_blocksize_log2 = spec.nested_blocksize_log2;
  return data;
}

c10::SymDimVector gemv_output_shape(const at::Tensor& x, const c10::SymInt& rows) {
  c10::SymDimVector out_shape(x.sym_sizes().begin(), x.sym_sizes().end());
  out_shape.back() = rows;
  return out_shape;
}

}  // namespace nf4
