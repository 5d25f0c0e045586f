"""Typed wrappers that take a bitsandbytes QuantState and call torch.ops.nf4.*."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:  # bitsandbytes is only needed to build a QuantState, not to call the ops
    from bitsandbytes.functional import QuantState


# bitsandbytes' forward repacks a CPU weight in place, into a layout of its own, when it runs in eval mode without
# grad on a CPU with AVX512-BF16; the ops read only the standard layout (bnb-format.md), and patch() names it too.
REPACKED_FOR_CPU = "weight repacked in bitsandbytes' CPU-only layout (quant_state.packing_format_for_cpu)"


def quant_state_args(quant_state: "QuantState") -> dict[str, Any]:
    """The op arguments a bitsandbytes QuantState stands for (everything but `packed`, `x` and `bias`)."""
    if getattr(quant_state, "packing_format_for_cpu", False):
        raise ValueError(f"quant_state is of a {REPACKED_FOR_CPU}, which the nf4 ops do not read: call them (or "
                         f"nf4_ops.patch the model) before bitsandbytes' own forward runs on the CPU in eval mode "
                         f"without grad, which repacks the weight")
    tensor = torch.Tensor
    try:  # a patched layer calls this per forward: a bad field is diagnosed after it fails, not looked for each time
        args: dict[str, Any] = {
            "absmax": quant_state.absmax,
            "blocksize": _int_field(quant_state.blocksize),
            "quant_type": quant_state.quant_type,
            "shape": [_int_field(s) for s in quant_state.shape],
        }
        valid = isinstance(args["absmax"], tensor) and isinstance(args["quant_type"], str)
        if quant_state.nested:
            args.update(
                nested_absmax=quant_state.state2.absmax,
                nested_code=quant_state.state2.code,
                nested_offset=quant_state.offset,
                nested_blocksize=_int_field(quant_state.state2.blocksize),
            )
            valid = (valid and isinstance(args["nested_absmax"], tensor) and isinstance(args["nested_code"], tensor)
                     and isinstance(args["nested_offset"], tensor))  # fmt: skip
        if not valid:
            raise TypeError("a tensor field is not a tensor")
    except (AttributeError, TypeError, ValueError) as error:
        raise _quant_state_error(quant_state) from error
    return args


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_field(value: Any) -> int:
    """An int field of a QuantState as it is: a float or a str is an error, not rounded or parsed (64.9 -> 64)."""
    if not _is_int(value):
        raise TypeError("an int field is not an int")
    return value


# What each QuantState field the ops read must be: (path, test, expectation), in the order quant_state_args reads them.
_QUANT_STATE_FIELDS = (
    ("absmax", lambda v: isinstance(v, torch.Tensor), "a tensor"),
    ("blocksize", _is_int, "an int"),
    ("quant_type", lambda v: isinstance(v, str), "a str"),
    ("shape", lambda v: isinstance(v, (tuple, list)) and all(_is_int(s) for s in v), "a sequence of ints"),
    ("nested", lambda v: True, "present"),  # read for its truth, as quant_state_args does: only a missing one is named
)
_NESTED_FIELDS = (
    ("state2", lambda v: v is not None, "the QuantState of the nested absmax (quant_state.nested is True)"),
    ("state2.absmax", lambda v: isinstance(v, torch.Tensor), "a tensor"),
    ("state2.code", lambda v: isinstance(v, torch.Tensor), "a tensor"),
    ("state2.blocksize", _is_int, "an int"),
    ("offset", lambda v: isinstance(v, torch.Tensor), "a tensor"),
)


def _quant_state_error(quant_state: Any) -> TypeError:
    """The first field of `quant_state` that quant_state_args cannot read, named with what it must be."""
    missing = object()

    def field(path):
        value = quant_state
        for part in path.split("."):
            value = getattr(value, part, missing)
            if value is missing or value is None:
                return value
        return value

    fields = _QUANT_STATE_FIELDS + (_NESTED_FIELDS if field("nested") not in (missing, None, False) else ())
    for path, valid, expected in fields:
        value = field(path)
        if value is missing:
            return TypeError(f"quant_state must be a bitsandbytes QuantState, got {type(quant_state).__name__} "
                             f"without .{path}")
        if not valid(value):
            return TypeError(f"quant_state.{path} must be {expected}, got {type(value).__name__}")
    return TypeError(f"quant_state must be a bitsandbytes QuantState, got {type(quant_state).__name__}")


def _check_tensor(name: str, value: Any, optional: bool = False) -> None:
    if not (isinstance(value, torch.Tensor) or (optional and value is None)):
        expected = "a torch.Tensor or None" if optional else "a torch.Tensor"
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__}")


def dequantize(
    packed: torch.Tensor,
    quant_state: "QuantState",
    dtype: Optional[torch.dtype] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The [N, K] weight in `dtype` (default: out's dtype, else the dtype it was quantized from),
    bit-exact with bitsandbytes.functional.dequantize_4bit. With `out` ([N, K], contiguous, on packed's
    device) it is written there and returned, with no allocation."""
    _check_tensor("packed", packed)
    _check_tensor("out", out, optional=True)
    args = quant_state_args(quant_state)
    packed = _frozen(packed)
    if dtype is None:
        dtype = getattr(quant_state, "dtype", None) if out is None else out.dtype
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype was not given and quant_state.dtype is not a torch.dtype (got "
                            f"{type(dtype).__name__}); pass dtype")
    elif not isinstance(dtype, torch.dtype):  # the op would read an int as a ScalarType's number
        raise TypeError(f"nf4_ops.dequantize: dtype must be a torch.dtype or None, got {type(dtype).__name__} "
                        f"{dtype!r}")
    if out is None:
        return torch.ops.nf4.dequantize(packed, dtype=dtype, **args)
    torch.ops.nf4.dequantize.out(packed, dtype=dtype, out=out, **args)
    return out


def gemv(
    x: torch.Tensor,
    packed: torch.Tensor,
    quant_state: "QuantState",
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """x @ W.T + bias as [..., N] in x.dtype, accumulated in fp32. Differentiable in x and bias (the op itself
    has no autograd; this wrapper's rule gives grad_x = grad_y @ W and grad_bias, never a weight gradient)."""
    _check_tensor("x", x)
    _check_tensor("packed", packed)
    _check_tensor("bias", bias, optional=True)
    if bias is not None and bias.dtype != x.dtype:  # linear() would take it; the op's contract does not
        raise TypeError(f"nf4_ops.gemv: bias must be {x.dtype} (x's dtype), got {bias.dtype}")
    return linear(x, packed, quant_state_args(quant_state), bias)


def _frozen(packed: torch.Tensor) -> torch.Tensor:
    """packed is bytes, never differentiated; a float-storage weight (quant_storage=bf16) may still require grad, and
    the ops' not-implemented autograd kernels would then fail the backward (and torch.compile) of an output that
    bitsandbytes treats as a frozen weight or its product (dequantize.out refuses such an input outright). A detached
    tensor keeps its base's version counter, which _Nf4Linear's backward checks."""
    return packed.detach()


def _functorch_transform_active() -> bool:
    """Under torch.func's transforms (vmap, grad) a batched or wrapped x reports requires_grad=False whether or not
    the tensor under it needs a gradient, so the rule is taken there always: vmap of a call whose x required grad
    then backward, or grad of a vmap, reached the op's not-implemented autograd kernel. (Not asked when compiling:
    torch.compile traces the transforms itself.)"""
    return not torch.compiler.is_compiling() and torch._C._are_functorch_transforms_active()


def linear(x: torch.Tensor, packed: torch.Tensor, args: dict[str, Any], bias: Optional[torch.Tensor]) -> torch.Tensor:
    """gemv on op arguments already taken from a QuantState, with the autograd rule where x or bias need gradients
    (patch()'s forward calls it per layer and call). A bias of another dtype than x (a patched layer's, in its compute
    dtype, under autocast) goes to the op in x's dtype, and its gradient is summed in its own dtype, as bitsandbytes'
    MatMul4Bit does."""
    packed = _frozen(packed)
    if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)
                                    or _functorch_transform_active()):
        return _Nf4Linear.apply(x, bias, packed, args)
    return torch.ops.nf4.gemv(x, packed, bias=_in_dtype_of(x, bias), **args)


def _in_dtype_of(x: torch.Tensor, bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return bias if bias is None or bias.dtype == x.dtype else bias.to(x.dtype)


class _Nf4Linear(torch.autograd.Function):
    """y = x @ W.T + bias with W 4-bit; backward gives grad_x = grad_y @ W and grad_bias, no weight grad. In the
    forward / setup_context form, with a generated vmap rule, so that torch.func's transforms (grad, vjp, jacrev,
    vmap) take it: the old forward(ctx, ...) form raised under them."""

    generate_vmap_rule = True  # forward and backward run as written on vmap's batched tensors (nf4::gemv's own rule below)

    @staticmethod
    def forward(x, bias, packed, args):
        return torch.ops.nf4.gemv(x, packed, bias=_in_dtype_of(x, bias), **args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, bias, packed, args = inputs
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.tensor_names = tuple(name for name, value in args.items() if isinstance(value, torch.Tensor))
        ctx.other_args = {name: value for name, value in args.items() if name not in ctx.tensor_names}
        weight = (packed,) + tuple(args[name] for name in ctx.tensor_names)
        if torch.compiler.is_compiling():
            # Traced, the weight's tensors must be saved tensors: compiled autograd (torch._dynamo.config.
            # compiled_autograd) fails with an IndexError on tensors kept on ctx. AOT autograd's compiled function saves
            # every tensor its backward graph reads, the weight among them, whichever way it was kept here, so this
            # costs nothing more under saved-tensor hooks. torch.compile does not trace version counters.
            ctx.save_for_backward(*weight)
            ctx.weight, ctx.versions = None, None
        else:
            # Eager, the weight's tensors stay on ctx, not in save_for_backward: saved tensors pass through saved-tensor
            # hooks (save_on_cpu, activation offloading), which would copy the 4-bit weight off the GPU every training
            # step (bitsandbytes' MatMul4Bit keeps its weight on ctx too). Their versions are checked at backward
            # instead, so a weight changed in place since (copy_, a reload) raises, as it does for F.linear, rather
            # than backward dequantizing bytes the forward never used.
            ctx.weight, ctx.versions = weight, _versions(weight)

    @staticmethod
    def backward(ctx, grad_y):
        # outside any autocast region: the gradients in the dtypes of x and bias, eager or compiled (a compiled backward
        # is traced while the forward runs, so a forward under autocast put its matmul in autocast's dtype)
        with torch.autocast(grad_y.device.type, enabled=False):
            return _Nf4Linear._gradients(ctx, grad_y)

    @staticmethod
    def _gradients(ctx, grad_y):
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            weight = ctx.saved_tensors if ctx.weight is None else ctx.weight
            if ctx.versions is not None and not torch.compiler.is_compiling() and _versions(weight) != ctx.versions:
                raise RuntimeError("nf4_ops.gemv: the weight (packed, absmax or nested absmax) was modified by an "
                                   "inplace operation between the forward and this backward, which needs it as it was")
            packed, args = weight[0], dict(ctx.other_args, **dict(zip(ctx.tensor_names, weight[1:])))
            grad_x = grad_y @ torch.ops.nf4.dequantize(packed, dtype=grad_y.dtype, **args)
        if ctx.needs_input_grad[1]:
            grad_bias = grad_y.reshape(-1, grad_y.shape[-1]).sum(0, dtype=ctx.bias_dtype)
        return grad_x, grad_bias, None, None


def _versions(weight: tuple[torch.Tensor, ...]) -> tuple[int, ...]:
    """The version counters of the weight's tensors (packed and the QuantState's). An inference tensor (a weight
    quantized under torch.inference_mode()) has none, and outside inference mode cannot be changed in place at all: it
    counts as -1."""
    return tuple(-1 if t.is_inference() else t._version for t in weight)


def _gemv_vmap(info, in_dims, *args):
    """nf4::gemv's batching rule for torch.func.vmap (args in the schema's order, x first; the SymInt[] shape's
    in_dims is a list). A batch dimension of x alone joins x's leading dimensions, which the op takes as rows: one
    call. A batched weight or bias (an ensemble of layers) is one call per member, stacked. Without a rule functorch
    called the op once per batch element in every case."""
    if all(dim is None for dim in in_dims[1:] if not isinstance(dim, (list, tuple))):
        return torch.ops.nf4.gemv(args[0].movedim(in_dims[0], 0), *args[1:]), 0
    members = [[arg if dim is None or isinstance(dim, (list, tuple)) else arg.select(dim, member)
                for arg, dim in zip(args, in_dims)] for member in range(info.batch_size)]  # fmt: skip
    return torch.stack([torch.ops.nf4.gemv(*member) for member in members]), 0


torch.library.register_vmap("nf4::gemv", _gemv_vmap)
