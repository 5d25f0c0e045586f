"""Seeded random calls of nf4::gemv and nf4::dequantize that mix what the path-by-path tests (test_gemv.py,
test_dequantize.py) set one at a time: W's shape and size (around the sizes at which csrc/ops.h's tables change the
kernel), rows of x, x's dtype, layout and leading dimensions, quant type, blocksize, nested absmax, bias and the
weight's dtype. Each call is checked as those tests check theirs: gemv within the tolerance rule and the same bits
on a second call, dequantize bit-exact with bitsandbytes and its out variant with it; the Meta kernels give the same
shapes and dtypes. On CUDA the sized draw must also reach every gemv kernel this GPU and build can run, so that the
draw cannot quietly stop exercising one."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

import nf4_ops
from conftest import ALL_DEVICES, HAS_CUDA, assert_gemv_close, bnb_cuda_works, bnb_dequantize_4bit, dtype_id
from test_gemv import random_x, warpgroup_kernel_on

# Packed sizes (MiB) at or next to which csrc/ops.h's row tables change (one-row, warpgroup, many-rows and tail
# limits), for the sized draw (whose 48 calls come to 1-97 MiB: TABLE_EDGE_CALLS take the entries from 100 MiB).
TABLE_SIZES_MIB = [1, 4, 5, 8, 16, 30, 32, 48, 55, 100]


@dataclass(frozen=True)
class Call:
    n: int
    k: int
    x_rows: int
    leading: tuple[int, ...]  # x's leading dimensions, their product x_rows
    x_dtype: torch.dtype
    x_layout: str  # "contiguous", "transposed" (a [K, rows] tensor's .t()) or "strided" (every other column)
    quant_type: str
    blocksize: int
    nested: bool
    weight_dtype: torch.dtype  # the dtype bitsandbytes quantized from (its dequantize_4bit returns it)
    bias: bool

    def __str__(self) -> str:
        return (f"W [{self.n}, {self.k}] {self.quant_type} bs{self.blocksize} {'nested' if self.nested else 'plain'} "
                f"from {dtype_id(self.weight_dtype)}; x {self.leading + (self.k,)} {dtype_id(self.x_dtype)} "
                f"{self.x_layout}{' + bias' if self.bias else ''}")  # fmt: skip


def draw_x_rows(rng: random.Random, most: int) -> int:
    """Mostly decode's 1-16 rows, then the many-rows kernel's and dequantize + cuBLAS's ranges."""
    bands = [(1, 4), (5, 16), (17, 40), (41, 130), (131, 300)]
    low, high = rng.choices(bands, weights=[30, 30, 20, 15, 5])[0]
    return min(rng.randint(low, high), most)


def draw_call(rng: random.Random, n: int, k: int, most_x_rows: int) -> Call:
    x_rows = draw_x_rows(rng, most_x_rows)
    leading = (x_rows,)
    if x_rows % 2 == 0 and rng.random() < 0.25:
        leading = (2, x_rows // 2)
    layout = rng.choices(["contiguous", "transposed", "strided"], weights=[70, 15, 15])[0]
    # keyword arguments in the order of the draws (reordering them would change every seed's calls)
    return Call(n=n, k=k, x_rows=x_rows, leading=leading if layout == "contiguous" else (x_rows,),
                x_dtype=rng.choice([torch.float16, torch.bfloat16, torch.bfloat16, torch.float32]), x_layout=layout,
                quant_type=rng.choice(["nf4", "fp4"]),
                blocksize=rng.choice([32, 64, 64, 64, 128, 256, 512, 1024, 2048, 4096]), nested=rng.random() < 0.5,
                weight_dtype=rng.choice([torch.float32, torch.float16, torch.bfloat16]),
                bias=rng.random() < 0.3)  # fmt: skip


def draw_small_k(rng: random.Random) -> int:
    """K: whole tensor-core turns (256), whole 64-element steps, or anything (odd included)."""
    kind = rng.choice(["k256", "k64", "any"])
    return {"k256": 256 * rng.randint(1, 24), "k64": 64 * rng.randint(1, 60), "any": rng.randint(1, 1500)}[kind]


def small_calls(count: int, seed: int) -> list[Call]:
    """Weights of at most ~0.5 MiB packed: every kernel's shapes and tails, fast enough for the CPU."""
    rng = random.Random(seed)
    calls = []
    for _ in range(count):
        k = draw_small_k(rng)
        n = rng.randint(1, max(1, min(700, 2**20 // k)))
        calls.append(draw_call(rng, n, k, most_x_rows=48))
    return calls


def sized_calls(count: int, seed: int) -> list[Call]:
    """Weights at or next to the tables' sizes, K as the paper's layers have it or any multiple of 256, N not always
    a multiple of 16."""
    rng = random.Random(seed)
    calls = []
    for _ in range(count):
        k = rng.choice([2048, 4096, 5120, 5376, 8192, 256 * rng.randint(8, 40)])
        mib = rng.choice(TABLE_SIZES_MIB) * rng.choice([0.97, 1.0, 1.0, 1.03])
        n = max(1, round(mib * 2**21 / k) + rng.choice([0, 0, rng.randint(-15, 15)]))
        calls.append(draw_call(rng, n, k, most_x_rows=300))
    return calls


def quantize(call: Call, device: str, seed: int):
    """packed and QuantState from bitsandbytes' own quantize_4bit of random normal weights (not cached: the sized
    weights are up to ~1 GB before quantization)."""
    import bitsandbytes.functional as bnbf

    generator = torch.Generator(device=device).manual_seed(seed)
    weight = torch.randn((call.n, call.k), generator=generator, device=device).to(call.weight_dtype)
    return bnbf.quantize_4bit(weight, blocksize=call.blocksize, compress_statistics=call.nested,
                              quant_type=call.quant_type)  # fmt: skip


def x_for(call: Call, device: str, seed: int) -> torch.Tensor:
    if call.x_layout == "transposed":
        return random_x((call.k, call.x_rows), call.x_dtype, device, seed).t()
    if call.x_layout == "strided":
        return random_x((call.x_rows, 2 * call.k), call.x_dtype, device, seed)[:, ::2]
    return random_x(call.leading + (call.k,), call.x_dtype, device, seed)


def check_call(call: Call, device: str, seed: int) -> tuple[torch.Tensor, torch.Tensor, dict, torch.Tensor | None]:
    """Runs the call's dequantize and gemv and checks them; returns gemv's inputs (x, packed, args, bias)."""
    packed, state = quantize(call, device, seed)
    args = nf4_ops.quant_state_args(state)
    weight = torch.ops.nf4.dequantize(packed, dtype=call.weight_dtype, **args)
    assert torch.equal(weight, bnb_dequantize_4bit(packed, state)), f"dequantize differs from bitsandbytes: {call}"
    into = torch.full_like(weight, float("nan"))
    torch.ops.nf4.dequantize.out(packed, dtype=call.weight_dtype, out=into, **args)
    assert torch.equal(into, weight), f"dequantize.out differs from dequantize: {call}"
    del weight, into
    x = x_for(call, device, seed)
    bias = random_x((call.n,), call.x_dtype, device, seed + 1) if call.bias else None
    out = torch.ops.nf4.gemv(x, packed, bias=bias, **args)
    try:
        assert_gemv_close(out, x, packed, args, bias)
        assert torch.equal(torch.ops.nf4.gemv(x, packed, bias=bias, **args), out), "not the same bits on a second call"
        # the Meta kernels: the same output shape, dtype and (dense) strides from the same arguments
        on_meta = {name: v.to("meta") if torch.is_tensor(v) else v for name, v in args.items()}
        meta_bias = bias.to("meta") if bias is not None else None
        meta_out = torch.ops.nf4.gemv(x.to("meta"), packed.to("meta"), bias=meta_bias, **on_meta)
        assert (meta_out.shape, meta_out.dtype, meta_out.stride()) == (out.shape, out.dtype, out.stride()), "Meta gemv"
        meta_weight = torch.ops.nf4.dequantize(packed.to("meta"), dtype=call.weight_dtype, **on_meta)
        assert (meta_weight.shape, meta_weight.dtype) == ((call.n, call.k), call.weight_dtype), "Meta dequantize"
    except AssertionError as error:
        raise AssertionError(f"{call}: {error}") from error
    return x, packed, args, bias


SMALL_CALLS = small_calls(60, seed=20261127)


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("index", range(0, len(SMALL_CALLS), 10), ids=lambda i: f"calls{i}-{i + 9}")
def test_random_small_calls(index, device):
    if device == "cuda" and not bnb_cuda_works():
        pytest.skip("bitsandbytes has no CUDA backend here")
    for offset, call in enumerate(SMALL_CALLS[index : index + 10]):
        check_call(call, device, seed=index + offset)


# The tables' entries from 100 MiB (the one-row kernel's rows, the H200's warpgroup rows, the many-rows kernel's tail
# launches), at rows that take them: Llama-3.3-70B's gate/up (112 MiB) and a W of 100 MiB.
TABLE_EDGE_CALLS = [
    Call(n=28672, k=8192, x_rows=1, leading=(1,), x_dtype=torch.bfloat16, x_layout="contiguous", quant_type="nf4",
         blocksize=64, nested=True, weight_dtype=torch.bfloat16, bias=False),
    Call(n=28672, k=8192, x_rows=41, leading=(41,), x_dtype=torch.float16, x_layout="contiguous", quant_type="fp4",
         blocksize=128, nested=False, weight_dtype=torch.float16, bias=True),  # 32 rows + a tail launch of 9
    Call(n=25600, k=8192, x_rows=8, leading=(8,), x_dtype=torch.bfloat16, x_layout="contiguous", quant_type="nf4",
         blocksize=64, nested=False, weight_dtype=torch.float32, bias=False),
    Call(n=25600, k=8192, x_rows=12, leading=(12,), x_dtype=torch.bfloat16, x_layout="strided", quant_type="nf4",
         blocksize=256, nested=True, weight_dtype=torch.float32, bias=True),
]  # fmt: skip

# The gemv kernels a call may launch (csrc/gemv.cu, gemv_many_rows.cu; fused_gemv_kernel is the CUDA-core one); a
# call that launches none of them but a dequantize kernel went through dequantize + cuBLAS.
GEMV_KERNELS = ["one_row_gemv_kernel", "tc_gemv_kernel", "wg_gemv_kernel", "many_rows_gemv_kernel", "fused_gemv_kernel"]
DEQUANTIZE_AND_CUBLAS = "dequantize + cuBLAS"


def kernels_launched(call: Call, seed: int) -> set[str]:
    """Checks the call, then returns what its gemv launches (profiled alone, after the checks)."""
    x, packed, args, bias = check_call(call, "cuda", seed)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        torch.ops.nf4.gemv(x, packed, bias=bias, **args)
        torch.cuda.synchronize()
    names = [event.name for event in profile.events()]
    found = {kernel for kernel in GEMV_KERNELS if any(kernel in name for name in names)}
    if not found and any("dequantize_kernel" in name for name in names):
        found.add(DEQUANTIZE_AND_CUBLAS)
    assert found, f"{call}: gemv launched neither a gemv kernel nor a dequantize: {names}"
    return found


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU")
def test_random_sized_calls():
    if not bnb_cuda_works():
        pytest.skip("bitsandbytes has no CUDA backend here")
    seen: set[str] = set()
    for seed, call in enumerate(sized_calls(48, seed=20261128) + TABLE_EDGE_CALLS):
        kernels = kernels_launched(call, seed)
        print(f"{call}: {' '.join(sorted(kernels))}")  # with -s, the kernels each call took
        seen |= kernels
        torch.cuda.empty_cache()
    # every path but the CUDA-core kernel, which this draw need not reach (test_gemv.py's shapes do)
    expected = {"one_row_gemv_kernel", "tc_gemv_kernel", "many_rows_gemv_kernel", DEQUANTIZE_AND_CUBLAS}
    if warpgroup_kernel_on():
        expected.add("wg_gemv_kernel")
    assert expected <= seen, f"the draw reached only {sorted(seen)}"
