"""Bad input gets a clear error naming the argument, the expectation and what was found, from the CPU,
CUDA and Meta kernels alike (they share one validator), never a crash or a wrong answer."""

from __future__ import annotations

import copy
import re
import types

import pytest
import torch

import nf4_ops
from conftest import ALL_DEVICES, ALL_DEVICES_AND_META, HAS_CUDA, bnb_quantize

N, K, BLOCKSIZE = 8, 96, 64  # 768 elements: 384 packed bytes, 12 absmax blocks
X_ROWS = 2


def valid_args(device: str, nested: bool) -> dict:
    """Valid arguments of both ops (plus `x` and `dtype`), as meta tensors on the meta device."""
    args = dict(
        packed=torch.zeros(N * K // 2, 1, dtype=torch.uint8, device=device),
        absmax=torch.ones(N * K // BLOCKSIZE, dtype=torch.uint8 if nested else torch.float32, device=device),
        blocksize=BLOCKSIZE,
        quant_type="nf4",
        shape=[N, K],
    )
    if nested:
        args.update(
            nested_absmax=torch.ones(1, dtype=torch.float32, device=device),
            nested_code=torch.linspace(-1, 1, 256, device=device),
            nested_offset=torch.tensor(0.5, device=device),
        )
    return args


def strided(t: torch.Tensor) -> torch.Tensor:
    """A non-contiguous view with t's shape and values."""
    wide = torch.empty(*t.shape[:-1], t.shape[-1] * 2, dtype=t.dtype, device=t.device)[..., ::2]
    if t.device.type != "meta":
        wide.copy_(t)
    return wide


# (id, nested?, change to the valid arguments, expected message). Each message names the argument, the
# expectation and what was found.
WEIGHT_CASES = [
    ("quant_type", False, dict(quant_type="int4"), r'quant_type must be "nf4" or "fp4", got "int4"'),
    ("blocksize_not_pow2", False, dict(blocksize=48), r"blocksize must be a power of two in \[32, 4096\], got 48"),
    ("blocksize_too_small", False, dict(blocksize=16), r"blocksize must be a power of two in \[32, 4096\], got 16"),
    ("blocksize_too_big", False, dict(blocksize=8192), r"blocksize must be .*, got 8192"),
    ("shape_rank", False, dict(shape=[N * K]), r"shape must be \[N, K\] \(2 values\), got 1 values"),
    ("shape_zero", False, dict(shape=[0, K]), r"shape\[0\] \(N\) must be positive, got 0"),
    ("shape_negative_k", False, dict(shape=[N, -96]), r"shape\[1\] \(K\) must be positive, got -96"),
    # N*K past int64 wrapped to 2 before this check: 1 packed byte and 1 absmax then passed for 2^64 elements
    ("shape_wrapping_numel", False, dict(shape=[3, (2**64 + 2) // 3]),
     r"shape \[N, K\] must have N\*K <= 2\^60 elements, got \[3, 6148914691236517206\]"),
    ("shape_too_many", False, dict(shape=[2**31, 2**30]), r"shape \[N, K\] must have N\*K <= 2\^60 elements"),
    ("shape_just_over", False, dict(shape=[2**30 + 1, 2**30]), r"shape \[N, K\] must have N\*K <= 2\^60 elements"),
    ("shape_just_over_k", False, dict(shape=[1, 2**60 + 1]), r"shape \[N, K\] must have N\*K <= 2\^60 elements"),
    # at the limit the shape passes and packed's size is what fails
    ("shape_at_limit", False, dict(shape=[2**30, 2**30]),
     r"packed must hold ceil\(N\*K/2\) = 576460752303423488 bytes"),
    ("packed_too_small", False, lambda a: dict(packed=a["packed"][:100]),
     r"packed must hold ceil\(N\*K/2\) = 384 bytes for shape \[8, 96\].*got 100 bytes"),
    # one storage element of padding is bitsandbytes' (test_dequantize's storages); a whole element more is not
    ("packed_one_byte_too_long", False, lambda a: dict(packed=torch.zeros(N * K // 2 + 1, dtype=torch.uint8,
                                                                          device=a["packed"].device)),
     r"packed must hold ceil\(N\*K/2\) = 384 bytes .*\(plus at most one Byte element of padding\), got 385 bytes"),
    ("packed_one_float_too_long", False, lambda a: dict(packed=torch.zeros(N * K // 8 + 1, dtype=torch.float32,
                                                                           device=a["packed"].device)),
     r"packed must hold ceil\(N\*K/2\) = 384 bytes .*, got 388 bytes \(97 x Float\)"),
    ("packed_for_other_shape", False, dict(shape=[N, K // 2]),
     r"packed must hold ceil\(N\*K/2\) = 192 bytes .*got 384 bytes"),
    ("packed_non_contiguous", False, lambda a: dict(packed=strided(a["packed"].view(1, -1))),
     r"packed must be contiguous"),
    ("absmax_too_short", False, lambda a: dict(absmax=a["absmax"][:11]),
     r"absmax must have ceil\(N\*K/blocksize\) = 12 elements, got 11"),
    ("absmax_too_long", False, lambda a: dict(absmax=torch.ones(13, device=a["absmax"].device)),
     r"absmax must have ceil\(N\*K/blocksize\) = 12 elements, got 13"),
    ("absmax_dtype", False, lambda a: dict(absmax=a["absmax"].half()), r"absmax must be Float .*got Half"),
    ("absmax_non_contiguous", False, lambda a: dict(absmax=strided(a["absmax"])), r"absmax must be contiguous"),
    ("nested_half_given", False, lambda a: dict(nested_absmax=torch.ones(1, device=a["absmax"].device)),
     r"nested_absmax, nested_code and nested_offset must be given together.*got nested_absmax only"),
    ("nested_absmax_float_codes", True, lambda a: dict(absmax=a["absmax"].float()),
     r"absmax must be Byte \(codes\) when nested_\* are given, got Float"),
    ("nested_absmax_short", True, lambda a: dict(nested_absmax=a["nested_absmax"][:0]),
     r"nested_absmax must have ceil\(absmax.numel\(\)/nested_blocksize\) = 1 elements, got 0"),
    ("nested_absmax_dtype", True, lambda a: dict(nested_absmax=a["nested_absmax"].double()),
     r"nested_absmax must be Float, got Double"),
    ("nested_code_non_contiguous", True, lambda a: dict(nested_code=strided(a["nested_code"])),
     r"nested_code must be contiguous"),
    ("nested_code_short", True, lambda a: dict(nested_code=a["nested_code"][:255]),
     r"nested_code must have 2\^8 \(one entry per uint8 code\) = 256 elements, got 255"),
    ("nested_code_dtype", True, lambda a: dict(nested_code=a["nested_code"].double()),
     r"nested_code must be Float, got Double"),
    ("nested_offset_dtype", True, lambda a: dict(nested_offset=a["nested_offset"].half()),
     r"nested_offset must be Float, got Half"),
    ("nested_offset_numel", True, lambda a: dict(nested_offset=a["nested_offset"].repeat(2)),
     r"nested_offset must be one value \(bitsandbytes' offset\), got 2 elements"),
    ("nested_blocksize", True, dict(nested_blocksize=100),
     r"nested_blocksize must be a power of two in \[32, 4096\], got 100"),
]


def resolve(case_change, args):
    return case_change(args) if callable(case_change) else case_change


def run_both_ops(device: str, args: dict):
    """Yields (op name, callable) for dequantize and gemv with these weight arguments."""
    x = torch.zeros(X_ROWS, K, dtype=torch.bfloat16, device=device)
    yield "nf4::dequantize", lambda: torch.ops.nf4.dequantize(dtype=torch.bfloat16, **args)
    yield "nf4::gemv", lambda: torch.ops.nf4.gemv(x, **args)


@pytest.mark.parametrize("device", ALL_DEVICES_AND_META)
@pytest.mark.parametrize("case", WEIGHT_CASES, ids=[c[0] for c in WEIGHT_CASES])
def test_bad_weight_arguments(case, device):
    _, nested, change, message = case
    args = valid_args(device, nested)
    args.update(resolve(change, args))
    for op_name, call in run_both_ops(device, args):
        with pytest.raises(RuntimeError, match=re.escape(op_name) + ": " + message):
            call()


@pytest.mark.parametrize("device", ALL_DEVICES_AND_META)
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
def test_valid_arguments_pass(nested, device):
    """The base arguments of the error cases are valid: each error above comes from its one change."""
    for _, call in run_both_ops(device, valid_args(device, nested)):
        call()


GEMV_CASES = [
    ("x_last_dim", lambda a, x: dict(x=x[:, :95]), r"x's last dimension must equal K = shape\[1\] = 96, got x of shape \[2, 95\]"),
    ("x_dtype", lambda a, x: dict(x=x.double()), r"x must be Half, BFloat16 or Float, got Double"),
    ("x_int", lambda a, x: dict(x=x.int()), r"x must be Half, BFloat16 or Float, got Int"),
    ("x_0dim", lambda a, x: dict(x=x[0, 0]), r"x must have at least 1 dimension"),
    ("bias_length", lambda a, x: dict(bias=torch.zeros(N - 1, dtype=x.dtype, device=x.device)),
     r"bias must have N = shape\[0\] = 8 elements, got 7"),
    ("bias_dtype", lambda a, x: dict(bias=torch.zeros(N, dtype=torch.float32, device=x.device)),
     r"bias must be BFloat16 \(x's dtype\), got Float"),
    ("bias_2d", lambda a, x: dict(bias=torch.zeros(1, N, dtype=x.dtype, device=x.device)),
     r"bias must be 1-D \[N\], got shape \[1, 8\]"),
]


@pytest.mark.parametrize("device", ALL_DEVICES_AND_META)
@pytest.mark.parametrize("case", GEMV_CASES, ids=[c[0] for c in GEMV_CASES])
def test_bad_gemv_arguments(case, device):
    _, change, message = case
    args = valid_args(device, nested=False)
    args["x"] = torch.zeros(X_ROWS, K, dtype=torch.bfloat16, device=device)
    args.update(change(args, args["x"]))
    with pytest.raises(RuntimeError, match="nf4::gemv: " + message):
        torch.ops.nf4.gemv(**args)


def test_gemv_output_past_the_size_bound():
    """An output [x rows, N] of more than 2^60 elements (the weights' own bound) is named as such, not left to the
    allocator's overflow error, which names neither the op nor x. Only meta (or expanded) tensors get that far."""
    n, k = 2**40, 64
    args = dict(packed=torch.empty(n * k // 2, dtype=torch.uint8, device="meta"),
                absmax=torch.empty(n * k // 64, device="meta"), blocksize=64, quant_type="nf4", shape=[n, k])
    with pytest.raises(RuntimeError, match=r"nf4::gemv: the output \[x rows, N\] must have at most 2\^60 elements, "
                                           r"got x of shape \[2097152, 64\] and N = 1099511627776"):
        torch.ops.nf4.gemv(torch.empty(2**21, k, device="meta"), **args)
    assert torch.ops.nf4.gemv(torch.empty(2**20, k, device="meta"), **args).shape == (2**20, n)  # 2^60: at the bound


@pytest.mark.skipif(not HAS_CUDA or torch.cuda.mem_get_info()[0] < 24 * 2**30,
                    reason="needs a CUDA GPU with 24 GiB free (a 4 GiB weight, a 16 GiB output)")
def test_gemv_fused_kernel_grid_past_a_launch():
    """The fused CUDA-core kernel (K no multiple of 256) has one warp per row of W and no loop over rows: at N = 2^33
    its grid of 2^31 blocks passed a launch's limit, and at N = 2^34 + 4 it wrapped to one block and left all but 4
    rows unwritten. Now an error that names N (a helper's reading; K = 1 keeps the weight at 4 GiB)."""
    n = 2**33
    args = dict(packed=torch.zeros(n // 2, dtype=torch.uint8, device="cuda"),
                absmax=torch.ones(n // 4096, device="cuda"), blocksize=4096, quant_type="nf4", shape=[n, 1])
    with pytest.raises(RuntimeError, match=r"nf4::gemv: shape\[0\] \(N\) = 8589934592 needs 2147483648 CUDA blocks of "
                                           r"the fused kernel .*more than a launch allows \(2147483647\)"):
        torch.ops.nf4.gemv(torch.ones(1, 1, dtype=torch.bfloat16, device="cuda"), **args)
    del args
    torch.cuda.empty_cache()


def test_gemv_x_past_the_size_bound():
    """An x of more than 2^60 elements (expanded; its output within the bound) is named too: the kernels' contiguous
    or fp32 copy of it failed with the allocator's overflow error, which named neither the op nor x."""
    n, k = 8, 96
    args = dict(packed=torch.zeros(n * k // 2, dtype=torch.uint8), absmax=torch.ones(n * k // 64), blocksize=64,
                quant_type="nf4", shape=[n, k])
    x = torch.zeros(1, k, dtype=torch.float16).expand(2**56, k)  # output [2^56, 8]: 2^59 elements
    with pytest.raises(RuntimeError, match=r"nf4::gemv: x must have at most 2\^60 elements, got x of shape "
                                           r"\[72057594037927936, 96\]"):
        torch.ops.nf4.gemv(x, **args)
    # 2^60 elements exactly: at the bound, so allowed (meta tensors: the shape is all that is checked)
    meta_args = dict(packed=torch.empty(8 * 64 // 2, dtype=torch.uint8, device="meta"),
                     absmax=torch.empty(8, device="meta"), blocksize=64, quant_type="nf4", shape=[8, 64])
    assert torch.ops.nf4.gemv(torch.empty(2**54, 64, device="meta"), **meta_args).shape == (2**54, 8)


OUT_CASES = [
    ("dtype", lambda d: torch.empty(N, K, dtype=torch.float16, device=d), r"out must be BFloat16 \(the dtype argument\), got Half"),
    ("shape", lambda d: torch.empty(K, N, dtype=torch.bfloat16, device=d), r"out must have shape \[N, K\] = \[8, 96\], got \[96, 8\]"),
    ("rank", lambda d: torch.empty(N * K, dtype=torch.bfloat16, device=d), r"out must have shape \[N, K\] = \[8, 96\], got \[768\]"),
    ("non_contiguous", lambda d: torch.empty(K, N, dtype=torch.bfloat16, device=d).t(), r"out must be contiguous"),
]


@pytest.mark.parametrize("device", ALL_DEVICES_AND_META)
@pytest.mark.parametrize("case", OUT_CASES, ids=[c[0] for c in OUT_CASES])
def test_bad_dequantize_out(case, device):
    _, make_out, message = case
    with pytest.raises(RuntimeError, match="nf4::dequantize.out: " + message):
        torch.ops.nf4.dequantize.out(dtype=torch.bfloat16, out=make_out(device), **valid_args(device, nested=False))


def place_in(buffer: torch.Tensor, offset: int, source: torch.Tensor) -> torch.Tensor:
    """A view of `buffer`'s bytes from `offset` with source's dtype, shape and values."""
    raw = buffer.view(torch.uint8).view(-1)[offset : offset + source.numel() * source.element_size()]
    view = raw.view(source.dtype).view(source.shape)
    view.copy_(source)
    return view


@pytest.mark.parametrize("device", ALL_DEVICES_AND_META)
@pytest.mark.parametrize("input_name", ["packed", "absmax", "nested_absmax", "nested_code", "nested_offset"])
def test_dequantize_out_sharing_memory_with_an_input(input_name, device):
    """out over bytes the kernel reads would overwrite them before they are read: refused, not a wrong weight."""
    args = valid_args(device, nested=input_name.startswith("nested"))
    out = torch.zeros(N, K, dtype=torch.float32, device=device)
    args[input_name] = place_in(out, 0, args[input_name])
    with pytest.raises(RuntimeError, match=rf"nf4::dequantize.out: out must not share memory with {input_name}"):
        torch.ops.nf4.dequantize.out(dtype=torch.float32, out=out, **args)


@pytest.mark.parametrize("device", ALL_DEVICES)
def test_dequantize_out_beside_its_inputs_in_one_storage(device):
    """Disjoint views of one storage pass (the check compares bytes, not storages), with the right weight."""
    args = valid_args(device, nested=False)
    args["absmax"] = torch.rand(N * K // BLOCKSIZE, device=device)
    args["packed"] = torch.randint(0, 256, (N * K // 2, 1), dtype=torch.uint8, device=device)
    expected = torch.ops.nf4.dequantize(dtype=torch.float32, **args)
    storage = torch.zeros(N * K * 4 + 384 + 48, dtype=torch.uint8, device=device)
    out = storage[: N * K * 4].view(torch.float32).view(N, K)
    args["packed"] = place_in(storage, N * K * 4, args["packed"])
    args["absmax"] = place_in(storage, N * K * 4 + 384, args["absmax"])
    torch.ops.nf4.dequantize.out(dtype=torch.float32, out=out, **args)
    assert torch.equal(out, expected)


def test_dequantize_out_sharing_bytes_through_another_storage():
    """Two storages over one buffer (torch.frombuffer; DLPack alike): the overlap is in the bytes, not the storages,
    and the kernel would overwrite packed while reading it. Refused, like out in packed's own storage."""
    buffer = bytearray(N * K * 4)
    out = torch.frombuffer(buffer, dtype=torch.float32).view(N, K)
    args = valid_args("cpu", nested=False)
    args["packed"] = torch.frombuffer(buffer, dtype=torch.uint8, count=N * K // 2, offset=N * K).view(-1, 1)
    assert out.untyped_storage()._cdata != args["packed"].untyped_storage()._cdata  # two storages, one buffer
    with pytest.raises(RuntimeError, match=r"nf4::dequantize.out: out must not share memory with packed"):
        torch.ops.nf4.dequantize.out(dtype=torch.float32, out=out, **args)
    beside = torch.frombuffer(bytearray(N * K * 4), dtype=torch.float32).view(N, K)  # another buffer: fine
    torch.ops.nf4.dequantize.out(dtype=torch.float32, out=beside, **args)


@pytest.mark.parametrize("device", ALL_DEVICES)
def test_dequantize_out_in_autograd(device):
    """dequantize.out moves out's version counter (a backward that saved out then raises, not reads new values),
    and refuses inputs that need gradients, as ATen's out= ops do."""
    args = valid_args(device, nested=False)
    out = torch.zeros(N, K, device=device)
    before = out._version
    torch.ops.nf4.dequantize.out(dtype=torch.float32, out=out, **args)
    assert out._version > before
    weight = torch.zeros(N, K, device=device, requires_grad=True)
    saved = weight * 1.0  # a non-leaf that the square below saves for its backward
    y = (saved * saved).sum()
    torch.ops.nf4.dequantize.out(dtype=torch.float32, out=saved.detach(), **args)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()
    # inside torch.inference_mode() too, which skips the Autograd kernel but still moves an ordinary tensor's version
    weight = torch.zeros(N, K, device=device, requires_grad=True)
    saved = weight * 1.0
    y = (saved * saved).sum()
    with torch.inference_mode():
        torch.ops.nf4.dequantize.out(dtype=torch.float32, out=saved.detach(), **args)
        inference_out = torch.empty(N, K, device=device)  # an inference tensor, which has no version counter
        torch.ops.nf4.dequantize.out(dtype=torch.float32, out=inference_out, **args)
    assert torch.equal(inference_out, saved)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()
    absmax = args["absmax"].clone().requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"nf4::dequantize.out: absmax requires grad, but the op has no derivative"):
        torch.ops.nf4.dequantize.out(dtype=torch.float32, out=torch.empty(N, K, device=device), **{**args, "absmax": absmax})
    with torch.no_grad():
        torch.ops.nf4.dequantize.out(dtype=torch.float32, out=torch.empty(N, K, device=device), **{**args, "absmax": absmax})
    # packed too: bytes, but a weight of float storage (bitsandbytes' quant_storage=torch.float32) can require grad
    packed = torch.zeros(N * K // 8, dtype=torch.float32, device=device, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"nf4::dequantize.out: packed requires grad, but the op has no derivative"):
        torch.ops.nf4.dequantize.out(dtype=torch.float32, out=torch.empty(N, K, device=device), **{**args, "packed": packed})


@pytest.mark.parametrize("device", ALL_DEVICES)
def test_op_backward_is_an_error_not_a_missing_gradient(device):
    """The ops have no derivative: asking one for a gradient fails at backward (before the Autograd kernel x.grad
    came back None, with only a warning). nf4_ops.gemv has one (tests/test_patch.py's autograd tests)."""
    args = valid_args(device, nested=False)
    x = torch.randn(X_ROWS, K, device=device, requires_grad=True)
    y = torch.ops.nf4.gemv(x, **args)
    assert y.requires_grad
    with pytest.raises(RuntimeError, match=r"nf4::gemv.*not implemented"):
        y.sum().backward()
    absmax = args["absmax"].clone().requires_grad_(True)
    weight = torch.ops.nf4.dequantize(dtype=torch.float32, **{**args, "absmax": absmax})
    with pytest.raises(RuntimeError, match=r"nf4::dequantize.*not implemented"):
        weight.sum().backward()
    with torch.no_grad():  # without grad mode the op runs as before, and its output needs no gradient
        assert not torch.ops.nf4.gemv(x, **args).requires_grad


STORAGE_CASES = [(name, how) for name in ["packed", "absmax", "nested_absmax", "nested_code", "nested_offset", "x",
                                           "bias", "x_many_rows", "out"] for how in ["freed", "shrunk"]]


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("name, how", STORAGE_CASES, ids=[f"{n}-{h}" for n, h in STORAGE_CASES])
def test_storage_freed_or_shrunk_after_the_tensor_was_made(name, how, device):
    """A tensor whose storage was freed (FSDP's resharding: untyped_storage().resize_(0)) or shrunk keeps its sizes,
    so it passes the validator; the CPU and CUDA kernels then refuse it by name rather than read or write past the
    storage (a freed packed segfaulted: its bytes are read through an untyped pointer, which torch does not check)."""
    args = valid_args(device, nested=name.startswith("nested"))
    x = torch.zeros(17 if name == "x_many_rows" else X_ROWS, K, dtype=torch.bfloat16, device=device)
    bias = torch.zeros(N, dtype=torch.bfloat16, device=device)
    out = torch.empty(N, K, dtype=torch.bfloat16, device=device)
    tensors = {**args, "x": x, "x_many_rows": x, "bias": bias, "out": out}
    storage = tensors[name].untyped_storage()
    needed = storage.nbytes()
    storage.resize_(0 if how == "freed" else needed - 1)
    message = rf"{{op}}: {name.removesuffix('_many_rows')}'s storage must hold the {needed} bytes its sizes, strides " \
              rf"and offset reach, got {storage.nbytes()} \(was it freed or shrunk"
    def gemv(x_of_call):
        return "nf4::gemv", lambda: torch.ops.nf4.gemv(x_of_call, bias=bias, **args)

    dequantize_out = "nf4::dequantize.out", lambda: torch.ops.nf4.dequantize.out(dtype=torch.bfloat16, out=out, **args)
    if name in args:  # a weight tensor: both ops, gemv by its own name at 0 rows, on the fused path and on the many-rows one
        calls = [("nf4::dequantize", lambda: torch.ops.nf4.dequantize(dtype=torch.bfloat16, **args)), dequantize_out]
        calls += [gemv(torch.zeros(rows, K, dtype=torch.bfloat16, device=device)) for rows in (0, X_ROWS, 17)]
    elif name == "out":
        calls = [dequantize_out]
    else:
        calls = [gemv(x)]
    for op_name, call in calls:
        with pytest.raises(RuntimeError, match=message.format(op=re.escape(op_name))):
            call()


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU")
def test_dequantize_out_on_another_device():
    out = torch.empty(N, K, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"nf4::dequantize.out: out must be on the same device as packed"):
        torch.ops.nf4.dequantize.out(dtype=torch.bfloat16, out=out, **valid_args("cuda", nested=False))


@pytest.mark.parametrize("device", ALL_DEVICES_AND_META)
def test_bad_dequantize_dtype(device):
    args = valid_args(device, nested=False)
    for dtype, name in [(torch.float64, "Double"), (torch.int32, "Int"), (torch.uint8, "Byte")]:
        with pytest.raises(RuntimeError, match=f"nf4::dequantize: dtype must be Half, BFloat16 or Float, got {name}"):
            torch.ops.nf4.dequantize(dtype=dtype, **args)
        out = torch.empty(N, K, dtype=dtype, device=device)  # the out variant's errors name the out variant
        with pytest.raises(RuntimeError, match=f"nf4::dequantize.out: dtype must be Half, BFloat16 or Float, got {name}"):
            torch.ops.nf4.dequantize.out(dtype=dtype, out=out, **args)


MOVED_TO_CPU = [(name, False) for name in ("absmax", "packed", "x", "bias")] + [
    (name, True) for name in ("absmax", "nested_absmax", "nested_code", "nested_offset")
]


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU")
@pytest.mark.parametrize("moved, nested", MOVED_TO_CPU, ids=[f"{m}-{'nested' if n else 'plain'}" for m, n in MOVED_TO_CPU])
def test_mixed_devices(moved, nested):
    args = valid_args("cuda", nested)
    args["x"] = torch.zeros(X_ROWS, K, dtype=torch.bfloat16, device="cuda")
    args["bias"] = torch.zeros(N, dtype=torch.bfloat16, device="cuda")
    args[moved] = args[moved].cpu()
    expected = "x|bias|absmax|nested_absmax|nested_code|nested_offset" if moved == "packed" else moved
    with pytest.raises(RuntimeError, match=rf"nf4::gemv: ({expected}) must be on the same device as packed"):
        torch.ops.nf4.gemv(**args)
    if moved not in ("x", "bias"):
        del args["x"], args["bias"]
        with pytest.raises(RuntimeError, match=rf"nf4::dequantize: ({expected}) must be on the same device"):
            torch.ops.nf4.dequantize(dtype=torch.float16, **args)


@pytest.mark.parametrize("device", ALL_DEVICES)
def test_empty_x_gives_empty_output(device):
    args = valid_args(device, nested=False)
    for shape in [(0, K), (3, 0, K)]:
        out = torch.ops.nf4.gemv(torch.zeros(shape, dtype=torch.float16, device=device), **args)
        assert out.shape == (*shape[:-1], N) and out.dtype == torch.float16


@pytest.mark.parametrize("device", ALL_DEVICES_AND_META)
def test_negated_or_conjugated_views(device):
    """PyTorch resolves a negated or conjugated view's values before an op reads its bytes, so a packed weight would
    change (a negated byte b reads 256 - b) and an out= would be written into a resolved copy: the ops refuse both by
    name, and resolve the other tensors as PyTorch does (an x that is a negated view gives -(-x)'s result)."""
    args = valid_args(device, nested=False)
    packed = torch.randint(0, 256, (N * K // 2,), dtype=torch.uint8).view(torch.float32).to(device)
    args["packed"] = packed
    x = torch.randn(X_ROWS, K).to(device)
    negated, conjugated = torch._neg_view(packed), torch.view_as_complex(packed.view(-1, 2)).conj()
    for view, kind in [(negated, "negated"), (conjugated, "conjugated")]:
        with pytest.raises(RuntimeError, match=rf"nf4::dequantize: packed must be a plain tensor of bitsandbytes' "
                                               rf"bytes, got a {kind} view"):
            torch.ops.nf4.dequantize(dtype=torch.float32, **{**args, "packed": view})
        with pytest.raises(RuntimeError, match=rf"nf4::gemv: packed must be .*, got a {kind} view"):
            torch.ops.nf4.gemv(x, **{**args, "packed": view})
    out = torch.empty(N, K, device=device)
    with pytest.raises(RuntimeError, match=r"nf4::dequantize.out: out must be a plain tensor, got a negated view"):
        torch.ops.nf4.dequantize.out(dtype=torch.float32, out=torch._neg_view(out), **args)
    if device != "meta":
        assert torch.equal(torch.ops.nf4.gemv(torch._neg_view(-x), **args), torch.ops.nf4.gemv(x, **args))
    quantized = bnb_quantize((8, 96), "nf4", 64, nested=False, storage=torch.float32)  # the wrappers: the ops' errors
    with pytest.raises(RuntimeError, match="got a negated view"):
        nf4_ops.dequantize(torch._neg_view(quantized.packed), quantized.quant_state)
    with pytest.raises(RuntimeError, match="got a negated view"):
        nf4_ops.gemv(torch.zeros(2, 96), torch._neg_view(quantized.packed), quantized.quant_state)


def test_wrappers_name_a_quant_state_that_is_not_one():
    packed = torch.zeros(384, 1, dtype=torch.uint8)
    with pytest.raises(TypeError, match=r"quant_state must be a bitsandbytes QuantState, got NoneType without \.absmax"):
        nf4_ops.dequantize(packed, None)
    with pytest.raises(TypeError, match=r"quant_state must be a bitsandbytes QuantState, got dict without \.absmax"):
        nf4_ops.gemv(torch.zeros(2, 96), packed, {"absmax": None})


# A field of a real QuantState spoiled, and the error the wrappers give: the field's path and what it must be.
BAD_QUANT_STATE_FIELDS = [
    ("absmax", None, r"quant_state\.absmax must be a tensor, got NoneType"),
    ("blocksize", None, r"quant_state\.blocksize must be an int, got NoneType"),
    ("shape", None, r"quant_state\.shape must be a sequence of ints, got NoneType"),
    ("state2", None, r"quant_state\.state2 must be the QuantState of the nested absmax"),
    ("offset", 0.5, r"quant_state\.offset must be a tensor, got float"),
    ("state2.code", None, r"quant_state\.state2\.code must be a tensor, got NoneType"),
    # taken as they are, not rounded or converted: 32.9 was read as 32, a shape of floats truncated, None as "None"
    ("blocksize", 32.9, r"quant_state\.blocksize must be an int, got float"),
    ("shape", (8.0, 96.7), r"quant_state\.shape must be a sequence of ints, got tuple"),
    ("quant_type", None, r"quant_state\.quant_type must be a str, got NoneType"),
    ("state2.blocksize", "256", r"quant_state\.state2\.blocksize must be an int, got str"),
]


@pytest.mark.parametrize("path, value, message", BAD_QUANT_STATE_FIELDS, ids=[f[0] for f in BAD_QUANT_STATE_FIELDS])
def test_wrappers_name_a_bad_quant_state_field(path, value, message):
    quantized = bnb_quantize((8, 96), "nf4", 32, nested=True)
    state = copy.copy(quantized.quant_state)
    state.state2 = copy.copy(state.state2)
    owner, _, name = path.rpartition(".")
    setattr(getattr(state, owner) if owner else state, name, value)
    with pytest.raises(TypeError, match=message):
        nf4_ops.dequantize(quantized.packed, state)
    with pytest.raises(TypeError, match=message):
        nf4_ops.gemv(torch.zeros(2, 96), quantized.packed, state)


def test_wrappers_name_an_argument_that_is_not_a_tensor():
    quantized = bnb_quantize((8, 96), "nf4", 64, nested=False)
    packed, state, x = quantized.packed, quantized.quant_state, torch.zeros(2, 96)
    with pytest.raises(TypeError, match=r"packed must be a torch\.Tensor, got NoneType"):
        nf4_ops.dequantize(None, state)
    with pytest.raises(TypeError, match=r"out must be a torch\.Tensor or None, got int"):
        nf4_ops.dequantize(packed, state, out=3)
    with pytest.raises(TypeError, match=r"x must be a torch\.Tensor, got list"):
        nf4_ops.gemv([[0.0] * 96], packed, state)
    with pytest.raises(TypeError, match=r"bias must be a torch\.Tensor or None, got float"):
        nf4_ops.gemv(x, packed, state, bias=1.0)
    for dtype in (5, "float16"):  # an int was taken as a ScalarType's number (5: float16), a str got pybind's dump
        with pytest.raises(TypeError, match=r"nf4_ops\.dequantize: dtype must be a torch\.dtype or None, got "):
            nf4_ops.dequantize(packed, state, dtype=dtype)
    state = copy.copy(state)
    state.dtype = None
    with pytest.raises(TypeError, match=r"dtype was not given and quant_state\.dtype is not a torch\.dtype"):
        nf4_ops.dequantize(packed, state)
    del state.dtype  # a QuantState-like object without the field: the same advice, not an AttributeError
    with pytest.raises(TypeError, match=r"dtype was not given and quant_state\.dtype is not a torch\.dtype \(got NoneType\)"):
        nf4_ops.dequantize(packed, state)


def test_wrappers_name_a_missing_nested_field():
    """Every field the wrappers read is named when it is missing (.nested was not: a bare 'got SimpleNamespace')."""
    state = bnb_quantize((8, 96), "nf4", 64, nested=False).quant_state
    like = types.SimpleNamespace(**{k: getattr(state, k) for k in ("absmax", "blocksize", "quant_type", "shape")})
    with pytest.raises(TypeError, match=r"got SimpleNamespace without \.nested$"):
        nf4_ops.dequantize(torch.zeros(384, 1, dtype=torch.uint8), like, dtype=torch.float32)
    like.nested = 1  # read for its truth, as quant_state_args reads it: the missing state2 is what is named
    with pytest.raises(TypeError, match=r"got SimpleNamespace without \.state2$"):
        nf4_ops.gemv(torch.zeros(2, 96), torch.zeros(384, 1, dtype=torch.uint8), like)


def test_wrappers_name_bitsandbytes_cpu_only_layout():
    """bitsandbytes' eval-mode, no-grad CPU forward repacks a weight in place (on CPUs with AVX512-BF16) into a layout
    the ops do not read; the wrappers said 'absmax must be Float ..., got BFloat16' of an absmax the user never chose.
    The flag is set by hand here, so the test runs on every CPU (the repack itself needs AVX512-BF16)."""
    quantized = bnb_quantize((8, 96), "nf4", 64, nested=False)
    state = copy.copy(quantized.quant_state)
    state.packing_format_for_cpu = True
    message = r"quant_state is of a weight repacked in bitsandbytes' CPU-only layout \(quant_state\.packing_format_for_cpu\)"
    with pytest.raises(ValueError, match=message):
        nf4_ops.dequantize(quantized.packed, state)
    with pytest.raises(ValueError, match=message):
        nf4_ops.gemv(torch.zeros(2, 96), quantized.packed, state)
