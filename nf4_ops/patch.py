"""nf4_ops.patch(model): run every bitsandbytes Linear4bit of a loaded model on the nf4 operators.

The patched forward keeps bitsandbytes 0.50's `Linear4bit.forward` semantics (quant-state restore from the
module, compute-dtype rule, bias cast, output cast back to the input dtype) and replaces only the matmul:
`nf4::gemv`, which runs its fused kernel for few rows of x and dequantizes once + calls the dense matmul
(cuBLAS) for many; the crossover is the op's (`kManyRowsGemvRowLimits` / `kFusedGemvMaxRows` in csrc/ops.h). It has
nf4_ops.gemv's autograd rule for QLoRA (gradient for x and bias, never for the weight).

Layers it cannot run (an unknown weight layout, a device without nf4 kernels) or that do not run bitsandbytes' own
forward (a subclass's override, a forward set on the instance: patching would replace it) keep their original
forward; one warning names them and says why; a patched layer that changed since (moved, repacked) runs its original
forward, with one warning per layer. x the ops do not take (float64 with no compute dtype set) gets nf4::gemv's
error, not bitsandbytes' forward (whose float64 results on the CPU are wrong: tests/test_patch.py).
Nothing is changed in the checkpoint or the modules' parameters. A patched model pickles and deep-copies as one;
accelerate's hooks may be added or removed before or after patch(), and unpatch() keeps them.

transformers' `generate` compiles the decode step itself (static cache, `compile_config`, CUDA graphs) only
for models its quantizer calls compileable, and its bitsandbytes quantizer says no. Once every Linear4bit
runs on the nf4 ops (which compile with fullgraph and CUDA graphs), the model's quantizer says yes, so that path
runs: patch() marks it, the mark holds while every Linear4bit the model had at patch() is patched (one added later
needs another patch()), and unpatch() removes it.
"""

from __future__ import annotations

import functools
import types
import warnings
import weakref
from typing import Optional

import torch
from torch._subclasses.fake_tensor import is_fake

from .ops import REPACKED_FOR_CPU, linear, quant_state_args

# The module attribute that marks a patched layer and remembers how to undo the patch.
_SAVED = "_nf4_ops_saved_forward"
_KNOWN_QUANT_TYPES = ("nf4", "fp4")


def _kernel_device_types() -> frozenset:
    """Device types this build of nf4_ops has kernels for (read once per patch(), not per call)."""
    return frozenset(
        t for t in ("cpu", "cuda") if torch._C._dispatch_has_kernel_for_dispatch_key("nf4::gemv", t.upper())
    )


def _unsupported_reason(module, kernel_devices: frozenset) -> Optional[str]:
    """Why this Linear4bit cannot run on the nf4 ops now, or None if it can. Plain Python on the module's
    attributes, so torch.compile traces it without a graph break."""
    weight = module.weight
    state = getattr(weight, "quant_state", None) or getattr(module, "quant_state", None)
    if state is None:
        return "no quant_state (the weight was never quantized)"
    if getattr(state, "packing_format_for_cpu", False):
        return REPACKED_FOR_CPU
    if state.quant_type not in _KNOWN_QUANT_TYPES:
        return f"quant_type {state.quant_type!r} is not one of {_KNOWN_QUANT_TYPES}"
    if len(state.shape) != 2:
        return f"quant_state.shape {tuple(state.shape)} is not [out_features, in_features]"
    if weight.device.type not in kernel_devices:
        return f"no nf4 kernels for device {weight.device.type!r} (this build has {sorted(kernel_devices)})"
    return None


def _forward_attribute(module) -> str:
    """The attribute that holds the forward a call runs: accelerate's hooks (device_map=...) wrap `forward` and call
    `_old_forward`, so with a hook it is the inner one."""
    return "_old_forward" if hasattr(module, "_hf_hook") and hasattr(module, "_old_forward") else "forward"


def _foreign_forward_reason(module) -> Optional[str]:
    """Why this Linear4bit does not run bitsandbytes' own Linear4bit.forward, whose semantics the patched forward keeps,
    or None if it does: patching would replace what it runs now. Asked at patch() only (the patched forward is then in
    the module's __dict__ itself)."""
    import bitsandbytes as bnb

    base = bnb.nn.Linear4bit.forward
    if getattr(base, "__module__", None) != "bitsandbytes.nn.modules" or base.__qualname__ != "Linear4bit.forward":
        return f"bitsandbytes' Linear4bit.forward was replaced (by {base.__module__}.{base.__qualname__})"
    if type(module).forward is not base:
        return f"its class {type(module).__qualname__} overrides Linear4bit.forward"
    # an instance attribute is what runs (accelerate leaves the class's own forward, bound, when its hook is removed)
    attribute = _forward_attribute(module)
    own = module.__dict__.get(attribute)
    if own is not None and not (getattr(own, "__func__", None) is base and getattr(own, "__self__", None) is module):
        return f"its {attribute} was replaced on the instance (by {own!r:.80})"
    return None


def _patched_forward(self, x: torch.Tensor) -> torch.Tensor:
    """bitsandbytes 0.50's Linear4bit.forward with its matmul on nf4::gemv."""
    import bitsandbytes as bnb

    saved = getattr(self, _SAVED, None)
    if saved is None:  # unpatched, yet still called from somewhere unpatch() could not see: bitsandbytes' forward
        return type(self).forward(self, x)
    weight = self.weight
    if getattr(weight, "quant_state", None) is None:
        # what bitsandbytes' recovery below (the module's quant_state put back on a packed [n, 1] weight) cannot
        # mend, and reports with an AssertionError that says nothing
        if getattr(self, "quant_state", None) is None:
            raise ValueError("nf4_ops: a patched Linear4bit has no quant_state, on its weight or itself: the weight "
                             "was never quantized; quantize it through bitsandbytes (e.g. .to(device)) first")
        if weight.dim() != 2 or weight.shape[1] != 1:
            raise ValueError(f"nf4_ops: a patched Linear4bit's weight of shape {tuple(weight.shape)} has no "
                             f"quant_state and is not bitsandbytes' packed [n, 1] that the layer's quant_state could "
                             f"go back on: it was never quantized; quantize it through bitsandbytes (e.g. .to(device)) "
                             f"first")
    if (getattr(weight, "quant_state", None) is None and not isinstance(weight, bnb.nn.Params4bit)
            and (torch.compiler.is_compiling() or is_fake(weight))):
        # A plain fake tensor in the weight's place (torch.export's default, non-strict mode) or one being traced:
        # bitsandbytes' recovery would wrap it in a new Params4bit, which a fake tensor cannot become (the export
        # failed); the layer's own quant_state gives the same arguments, and the module is left as it is. A real
        # plain tensor (load_state_dict(assign=True), FSDP) takes the recovery below, as in bitsandbytes' forward:
        # left plain, the layer's state_dict and save_pretrained lose its quant state.
        quant_state = self.quant_state
    else:
        bnb.nn.modules.fix_4bit_weight_quant_state_from_module(self)
        quant_state = self.weight.quant_state
    reason = _unsupported_reason(self, saved.kernel_devices)
    if reason is not None:  # the layer changed since patch() (moved to another device, repacked)
        _warn_once(self, reason)
        return saved.call_original(self, x)

    if not self.compute_type_is_set:
        if torch.compiler.is_compiling():
            # bitsandbytes' rule without its fp16 warning, a logger call that torch.compile cannot trace (fullgraph)
            if x.dtype in (torch.float32, torch.bfloat16):
                self.compute_dtype = x.dtype
        else:
            self.set_compute_type(x)
        self.compute_type_is_set = True
    input_dtype = x.dtype
    if self.compute_dtype is not None:
        x = x.to(self.compute_dtype)

    bias = self.bias
    if bias is not None:
        # bitsandbytes casts the stored bias to the compute dtype too; torch.compile cannot trace that store (it
        # changes a parameter's dtype), so a compiled call casts the bias for the call alone: the same values
        if bias.dtype != x.dtype and not torch.compiler.is_compiling():
            bias.data = bias.data.to(x.dtype)
        bias = bias.to(x.dtype)
    if torch.is_autocast_enabled(x.device.type) and x.dtype in (torch.float32, torch.float16, torch.bfloat16):
        # Under autocast x goes to autocast's dtype, as autocast casts F.linear's floating inputs (float64 aside), at
        # every row count, eager or compiled (the nf4 ops themselves compute in x's dtype whatever autocast says).
        # That is bitsandbytes' eager CPU forward, whose matmul ends in F.linear on the dequantized weight; its
        # compiled calls and its CUDA kernel for few rows stay in x's dtype, so bitsandbytes differs by path there.
        # The bias stays in the compute dtype: linear() gives the op its value in x's dtype and sums its gradient in
        # its own, as bitsandbytes' MatMul4Bit does.
        x = x.to(torch.get_autocast_dtype(x.device.type))
    return linear(x, self.weight, quant_state_args(quant_state), bias).to(input_dtype)


def _patched_forward_of(module) -> functools.partial:
    """The forward patch() installs: a partial, not a bound method, so that a pickled patched model loads again
    (a bound method pickles as a lookup of its function's name on the module, which has no such attribute)."""
    return functools.partial(_patched_forward, module)


def _is_patched_forward(value) -> bool:
    """Whether `value` is a forward patch() installed (on this layer, or on the layer a shallow copy was made of)."""
    return isinstance(value, functools.partial) and value.func is _patched_forward and len(value.args) == 1


class _SavedForward:
    """How a layer's forward looked before patch(): which attribute was replaced and its old value."""

    name = "<unnamed>"  # what a layer pickled by an nf4_ops from before names were kept reads

    def __init__(self, module, name: str, kernel_devices: frozenset):
        self.name = name  # the layer's name in the model patch() was given, for the warning of a layer that changed
        self.kernel_devices = kernel_devices
        self.attribute = _forward_attribute(module)
        self.had_instance_attribute = self.attribute in module.__dict__
        self.previous = module.__dict__.get(self.attribute)
        self.warned = False

    def call_original(self, module, x: torch.Tensor) -> torch.Tensor:
        if self.had_instance_attribute:
            return self.previous(x)
        return type(module).forward(module, x)

    def restore(self, module) -> None:
        """Puts the old forward back wherever the patched one is now: accelerate moves it between `forward` and
        `_old_forward` when a hook is added or removed after patch(), and a hook added after patch() stays. A shallow
        copy (copy.copy) holds the forward patched on its original, which goes too."""
        for attribute in ("forward", "_old_forward"):
            if not _is_patched_forward(module.__dict__.get(attribute)):
                continue
            if self.had_instance_attribute:
                setattr(module, attribute, self.previous)
            elif attribute == "forward":
                delattr(module, attribute)  # the class's own forward again
            else:  # what accelerate would have saved from an unpatched layer
                setattr(module, attribute, types.MethodType(type(module).forward, module))


def _warn_once(module, reason: str) -> None:
    saved = getattr(module, _SAVED)
    if not saved.warned:
        saved.warned = True
        warnings.warn(f"nf4_ops: the patched Linear4bit {saved.name!r} runs its original forward (once patched, it "
                      f"changed): {reason}", stacklevel=3)


def _linear4bit_layers(model):
    import bitsandbytes as bnb

    return [(name, m) for name, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]


# The attribute of a marked quantizer's class that holds the class it had before patch(), and the attribute of a
# marked quantizer that holds weak references to the Linear4bit layers its model had at patch().
_UNMARKED_CLASS = "_nf4_ops_unmarked_class"
_MODEL_LAYERS = "_nf4_ops_model_layers"


def _every_layer_patched(quantizer) -> bool:
    """The marked quantizer's `is_compileable`: whether every Linear4bit its model had at patch() and still has is
    patched (a layer since replaced and freed no longer counts; one added since was never patched: patch again)."""
    for layer_ref in quantizer.__dict__.get(_MODEL_LAYERS, ()):
        layer = layer_ref()
        if layer is not None and not is_patched(layer):
            return False
    return True


def _reduce_marked_quantizer(quantizer, protocol):
    """Pickles (and deep-copies) a marked quantizer as its class's maker and its state, the layers held strongly
    there (weak references do not pickle): the subclass is made at patch(), so another process has no such global
    until this rebuilds it."""
    state = dict(quantizer.__dict__)
    layers = (layer_ref() for layer_ref in state.get(_MODEL_LAYERS, ()))
    state[_MODEL_LAYERS] = [layer for layer in layers if layer is not None]
    return _new_marked_quantizer, (getattr(type(quantizer), _UNMARKED_CLASS),), state


def _new_marked_quantizer(quantizer_class: type):
    subclass = _compileable_class(quantizer_class)
    return subclass.__new__(subclass)


def _set_marked_quantizer_state(quantizer, state: dict) -> None:
    quantizer.__dict__.update(state)
    quantizer.__dict__[_MODEL_LAYERS] = [weakref.ref(layer) for layer in state.get(_MODEL_LAYERS, ())]


@functools.lru_cache(maxsize=None)
def _compileable_class(quantizer_class: type) -> type:
    """`quantizer_class` whose `is_compileable` is True while every Linear4bit of the model is patched (one subclass
    per class, so unpatch can go back)."""
    name = f"_Nf4OpsCompileable{quantizer_class.__name__}"
    return type(name, (quantizer_class,), {"is_compileable": property(_every_layer_patched),
                                           "__reduce_ex__": _reduce_marked_quantizer,
                                           "__setstate__": _set_marked_quantizer_state,
                                           _UNMARKED_CLASS: quantizer_class, "__module__": __name__})  # fmt: skip


def _mark_quantizer_compileable(model: torch.nn.Module, layers: list) -> None:
    """Lets transformers' generate compile the patched model (see the module docstring): only this model's
    quantizer object changes class, never the class bitsandbytes-quantized models share. The mark holds while
    every one of `layers` is patched, so unpatching some of them (unpatch on a submodule) takes it away too. It
    holds the layers weakly: a layer replaced after patch() is not kept alive by it."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None:
        return
    if not hasattr(type(quantizer), _UNMARKED_CLASS):
        if getattr(quantizer, "is_compileable", True):  # compileable without the mark
            return
        quantizer.__class__ = _compileable_class(type(quantizer))
    quantizer.__dict__[_MODEL_LAYERS] = [weakref.ref(layer) for layer in layers]


def _check_module(name: str, value) -> None:
    """patch()'s, unpatch()'s and is_patched()'s argument check."""
    if not isinstance(value, torch.nn.Module):
        raise TypeError(f"{name} must be a torch.nn.Module, got {type(value).__name__}")


def patch(model: torch.nn.Module) -> torch.nn.Module:
    """Makes every bitsandbytes Linear4bit in `model` run on nf4::gemv / nf4::dequantize; returns `model`.

    Patching twice is harmless; `unpatch(model)` restores the original forwards exactly. Layers that
    cannot run on the nf4 ops are left alone and named in one warning. While every one is patched, a
    transformers model's quantizer says it is compileable, so `generate` with a static cache compiles the
    decode step as it does for unquantized models (`generation_config.disable_compile` turns that off).
    """
    _check_module("model", model)
    left_alone = []
    kernel_devices = _kernel_device_types()
    layers = _linear4bit_layers(model)
    if not layers:
        warnings.warn("nf4_ops.patch found no bitsandbytes Linear4bit layer in the model: nothing to patch",
                      stacklevel=2)
    for name, module in layers:
        name = name or "<model>"  # the model itself is a Linear4bit
        if hasattr(module, _SAVED):
            continue
        reason = _unsupported_reason(module, kernel_devices) or _foreign_forward_reason(module)
        if reason is not None:
            left_alone.append(f"{name}: {reason}")
            continue
        saved = _SavedForward(module, name, kernel_devices)
        setattr(module, _SAVED, saved)
        setattr(module, saved.attribute, _patched_forward_of(module))
    _mark_quantizer_compileable(model, [module for _, module in layers])
    if left_alone:
        warnings.warn(
            f"nf4_ops.patch left {len(left_alone)} Linear4bit layer(s) on their original forward:\n  "
            + "\n  ".join(left_alone),
            stacklevel=2,
        )
    return model


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Restores the forward every patched Linear4bit in `model` had before patch(); returns `model`."""
    _check_module("model", model)
    for _, module in _linear4bit_layers(model):
        saved = module.__dict__.pop(_SAVED, None)
        if saved is not None:
            saved.restore(module)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and hasattr(type(quantizer), _UNMARKED_CLASS):
        quantizer.__class__ = getattr(type(quantizer), _UNMARKED_CLASS)
        quantizer.__dict__.pop(_MODEL_LAYERS, None)
    return model


def is_patched(module: torch.nn.Module) -> bool:
    """Whether patch() put the nf4 ops' forward on this Linear4bit (a layer changed since, moved to a device without
    nf4 kernels or repacked, runs its original forward with a warning, and still counts as patched)."""
    _check_module("module", module)
    return hasattr(module, _SAVED)
