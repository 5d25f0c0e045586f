"""The ops behave as torch operators: opcheck, torch.compile (fullgraph, dynamic), CUDA graphs, streams."""

from __future__ import annotations

import pytest
import torch

import nf4_ops
from conftest import ALL_DEVICES, HAS_CUDA, assert_gemv_close, bnb_quantize, state_on


def weight(device, shape=(48, 512), quant_type="nf4", blocksize=64, nested=True):
    quantized = bnb_quantize(shape, quant_type, blocksize, nested)
    return quantized.packed.to(device), nf4_ops.quant_state_args(state_on(quantized, device))


def opcheck_samples(device):
    """(op, args, kwargs) samples covering plain/nested, both quant types, fused and dense gemv paths."""
    samples = []
    for quant_type, nested in [("nf4", False), ("fp4", True)]:
        packed, args = weight(device, quant_type=quant_type, nested=nested)
        samples.append((torch.ops.nf4.dequantize.default, (packed,), dict(dtype=torch.bfloat16, **args)))
        out = torch.empty(args["shape"], dtype=torch.float16, device=device)
        samples.append((torch.ops.nf4.dequantize.out, (packed,), dict(dtype=torch.float16, out=out, **args)))
        for rows in (1, 12):
            x = torch.randn(rows, 512, device=device, dtype=torch.float16)
            bias = torch.randn(48, device=device, dtype=torch.float16)
            samples.append((torch.ops.nf4.gemv.default, (x, packed), dict(bias=bias, **args)))
    x3 = torch.randn(2, 3, 512, device=device)
    samples.append((torch.ops.nf4.gemv.default, (x3, packed), args))
    return samples


@pytest.mark.parametrize("device", ALL_DEVICES)
def test_opcheck(device):
    for op, args, kwargs in opcheck_samples(device):
        torch.library.opcheck(op, args, kwargs)  # all default test_utils, test_aot_dispatch_dynamic included


@pytest.mark.parametrize("device", ALL_DEVICES)
def test_opcheck_autograd_registration(device):
    """Inputs that need gradients meet a registered Autograd kernel (one that raises at backward), not PyTorch's
    global fallback, which only warned and gave None gradients."""
    packed, args = weight(device, quant_type="nf4", nested=False)
    x = torch.randn(3, 512, device=device, requires_grad=True)
    torch.library.opcheck(torch.ops.nf4.gemv.default, (x, packed), args, test_utils="test_autograd_registration")
    absmax = args["absmax"].clone().requires_grad_(True)
    torch.library.opcheck(torch.ops.nf4.dequantize.default, (packed,),
                          dict(args, absmax=absmax, dtype=torch.float32), test_utils="test_autograd_registration")


def dequantize_then_gemv(x, packed, absmax, nested_absmax, nested_code, nested_offset):
    """A function that calls both ops, as user code would."""
    common = dict(
        blocksize=64, quant_type="nf4", shape=[48, 512],
        nested_absmax=nested_absmax, nested_code=nested_code, nested_offset=nested_offset,
    )  # fmt: skip
    weight = torch.ops.nf4.dequantize(packed, absmax, dtype=x.dtype, **common)
    return torch.ops.nf4.gemv(x, packed, absmax, **common) + x @ weight.t()


@pytest.mark.parametrize("device", ALL_DEVICES)
def test_compile_fullgraph_dynamic(device):
    torch._dynamo.reset()
    packed, args = weight(device)
    tensors = (packed, args["absmax"], args["nested_absmax"], args["nested_code"], args["nested_offset"])
    compiled = torch.compile(dequantize_then_gemv, fullgraph=True, dynamic=True)
    for rows in (1, 3, 17):  # dynamic=True: one graph for every row count
        x = torch.randn(rows, 512, device=device)
        torch.testing.assert_close(compiled(x, *tensors), dequantize_then_gemv(x, *tensors))
        x3 = torch.randn(2, rows, 512, device=device)
        torch.testing.assert_close(compiled(x3, *tensors), dequantize_then_gemv(x3, *tensors))


@pytest.mark.parametrize("device", ALL_DEVICES)
def test_export_with_a_named_dynamic_dimension(device):
    """torch.export with a named dynamic dimension on x's rows, as F.linear exports: the ops' size bounds put no
    guard on it (gemv's rows-of-x bound had made one, which the export refused as a constraint violation); the
    kernels still check the concrete sizes when they run."""
    packed, args = weight(device, nested=False)

    class Module(torch.nn.Module):
        def forward(self, x, packed, absmax):
            return torch.ops.nf4.gemv(x, packed, absmax, 64, "nf4", [48, 512])

    exported = torch.export.export(Module(), (torch.randn(3, 512, device=device), packed, args["absmax"]),
                                   dynamic_shapes=({0: torch.export.Dim("rows")}, None, None))
    x = torch.randn(5, 512, device=device)
    torch.testing.assert_close(exported.module()(x, packed, args["absmax"]),
                               torch.ops.nf4.gemv(x, packed, args["absmax"], 64, "nf4", [48, 512]))


def test_compile_dynamic_errors_name_the_sizes_passed():
    """Under dynamic shapes an error names each symbolic size with the value this call has, not the symbol alone."""
    torch._dynamo.reset()
    n, k = 48, 320
    packed, absmax = torch.zeros(n * k // 2, dtype=torch.uint8), torch.ones(n * k // 64)

    def call(x, packed, absmax, bias):
        return torch.ops.nf4.gemv(x, packed, absmax, 64, "nf4", [n, k], bias)

    compiled = torch.compile(call, fullgraph=True, dynamic=True)
    with pytest.raises(Exception, match=r"x's last dimension must equal K = shape\[1\] = .*, got x of shape "
                                        r"\[s\d+ \(= 2\), s\d+ \(= 321\)\]"):
        compiled(torch.randn(2, 321), packed, absmax, None)
    with pytest.raises(Exception, match=r"bias must have N = shape\[0\] = .*48.* elements, got s\d+ \(= 47\)"):
        compiled(torch.randn(2, k), packed, absmax, torch.randn(47))


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU")
@pytest.mark.parametrize("rows", [1, 4, 16], ids=lambda m: f"M{m}")
def test_cuda_graph_capture_and_replay(rows):
    packed, args = weight("cuda")
    static_x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(48, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the graph, as torch recommends
        torch.ops.nf4.gemv(static_x, packed, bias=bias, **args)
        torch.ops.nf4.dequantize(packed, dtype=torch.bfloat16, **args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = torch.ops.nf4.gemv(static_x, packed, bias=bias, **args)
        static_weight = torch.ops.nf4.dequantize(packed, dtype=torch.bfloat16, **args)
    for seed in range(3):
        static_x.copy_(torch.randn(rows, 512, generator=torch.Generator().manual_seed(seed)).to(static_x))
        static_weight.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert_gemv_close(static_out, static_x, packed, args, bias)
        assert torch.equal(static_weight, torch.ops.nf4.dequantize(packed, dtype=torch.bfloat16, **args))


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU")
def test_runs_on_the_current_non_default_stream():
    packed, args = weight("cuda", shape=(4096, 4096))
    x = torch.randn(3, 4096, device="cuda", dtype=torch.float16)
    expected_w = torch.ops.nf4.dequantize(packed, dtype=torch.float16, **args)
    expected_y = torch.ops.nf4.gemv(x, packed, **args)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        # A long kernel queued first on this stream: an op that ignored the current stream would read
        # `x` before this overwrite lands, or race with it.
        x_new = x.clone()
        torch.cuda._sleep(10_000_000)
        x_new.mul_(2)
        w = torch.ops.nf4.dequantize(packed, dtype=torch.float16, **args)
        y = torch.ops.nf4.gemv(x_new, packed, **args)
    stream.synchronize()
    assert torch.equal(w, expected_w)
    torch.testing.assert_close(y, 2 * expected_y, rtol=2e-3, atol=2e-3)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_runs_on_the_tensors_device_not_the_current_one():
    packed, args = weight("cuda:1")
    x = torch.randn(2, 512, device="cuda:1", dtype=torch.bfloat16)
    with torch.cuda.device(0):
        out = torch.ops.nf4.gemv(x, packed, **args)
        w = torch.ops.nf4.dequantize(packed, dtype=torch.bfloat16, **args)
    assert out.device == torch.device("cuda:1") and w.device == torch.device("cuda:1")
    assert_gemv_close(out, x, packed, args)


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU")
def test_ops_do_not_synchronise_the_host():
    packed, args = weight("cuda")
    x = torch.randn(2, 512, device="cuda", dtype=torch.bfloat16)
    torch.cuda.set_sync_debug_mode("error")
    try:
        torch.ops.nf4.gemv(x, packed, **args)
        torch.ops.nf4.gemv(torch.randn(20, 512, device="cuda", dtype=torch.bfloat16), packed, **args)
        torch.ops.nf4.dequantize(packed, dtype=torch.bfloat16, **args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
