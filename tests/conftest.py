"""Shared test helpers: the devices to run on, bitsandbytes-quantized weights, and the tolerance rule."""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import pytest
import torch

import nf4_ops  # a missing build fails here, loudly: never a skip
from nf4_ops.reference import gemv_error_bound

HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
ALL_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU"))]
ALL_DEVICES_AND_META = ALL_DEVICES + ["meta"]

QUANT_TYPES = ["nf4", "fp4"]
BLOCKSIZES = [32, 64, 128, 256, 512, 1024, 2048, 4096]
STORAGES = [torch.uint8, torch.float16, torch.bfloat16, torch.float32]
FLOAT_DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Quantized:
    """A weight quantized by bitsandbytes: its packed data and QuantState, and the op arguments."""

    weight: torch.Tensor
    packed: torch.Tensor
    quant_state: object

    @property
    def args(self) -> dict:
        return nf4_ops.quant_state_args(self.quant_state)


@functools.lru_cache(maxsize=None)
def bnb_quantize(
    shape: tuple[int, int],
    quant_type: str,
    blocksize: int,
    nested: bool,
    storage: torch.dtype = torch.uint8,
    device: str = "cpu",
    seed: int = 0,
) -> Quantized:
    """Random normal weights (never zeros) quantized by bitsandbytes' own quantize_4bit on `device`."""
    import bitsandbytes.functional as bnbf

    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(shape, generator=generator).to(device)
    packed, state = bnbf.quantize_4bit(
        weight, blocksize=blocksize, compress_statistics=nested, quant_type=quant_type, quant_storage=storage
    )
    return Quantized(weight, packed, state)


def bnb_cpu_kernels_from_gpu_build() -> bool:
    """Whether bitsandbytes loaded its CUDA-build library (it does wherever torch sees a CUDA GPU), whose CPU kernels
    convert to fp16 in software, rounding exact ties away from zero (0.50.2's cpu_ops.h float_to_fp16 without
    __AVX2__), where its CPU-only library, its CUDA kernels and torch round them to even (test_dequantize.py,
    test_bnb_fp16_ties)."""
    from bitsandbytes import cextension

    return isinstance(cextension.lib, cextension.CudaBNBNativeLibrary)


def bnb_dequantize_4bit(packed: torch.Tensor, state) -> torch.Tensor:
    """bitsandbytes' dequantize_4bit, the oracle for bit-exactness. Two exceptions, both on the CPU, where its
    pure-PyTorch implementation (the same fp32 math, converted by torch) is the oracle instead:
    - where blocks straddle rows (K % blocksize != 0): bitsandbytes 0.50.2's native CPU kernel is wrong there on
      CPUs with AVX-512 (seen on an AMD EPYC: every such case differs from its own scalar branch, its CUDA kernels
      and its pure-PyTorch implementation; its AVX-512 branch indexes the blocks per row), and it runs that
      implementation itself for odd K and for blocksizes of 2048 and more on those CPUs; on every CPU;
    - fp16 output where bitsandbytes loaded its CUDA-build library (bnb_cpu_kernels_from_gpu_build): its CPU
      kernels there round fp16 ties whose kept bit is even away from zero (about 1 element in 17,000-24,000 of
      random weights quantized from fp32 or fp16).
    Every other CPU comparison, and every GPU one, uses bitsandbytes' own kernels."""
    import bitsandbytes.functional as bnbf

    straddles = state.shape[-1] % state.blocksize != 0
    fp16_ties = state.dtype == torch.float16 and bnb_cpu_kernels_from_gpu_build()
    if packed.device.type != "cpu" or not (straddles or fp16_ties):
        return bnbf.dequantize_4bit(packed, state)
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
    from bitsandbytes.backends.utils import _get_4bit_code

    absmax = state.absmax
    if state.nested:  # as bnbf.dequantize_4bit: the codes through state2, then the offset, in fp32
        absmax = bnbf.dequantize_blockwise(state.absmax, state.state2) + state.offset
    code = _get_4bit_code(state.quant_type, packed.device)
    # bitsandbytes wraps it in torch.compile (falling back to it where compiling fails): the function itself, eager,
    # so that the oracle does not depend on inductor's code and no test waits for a compile per shape
    compute = getattr(_dequantize_4bit_compute, "__wrapped__", _dequantize_4bit_compute)
    return compute(packed.view(torch.uint8).reshape(-1), absmax.float(), code, state.blocksize, state.shape,
                   state.dtype)  # fmt: skip


def state_on(quantized: Quantized, device: str):
    """A copy of the QuantState on `device` (QuantState.to moves in place; the cached one must not move)."""
    state = copy.deepcopy(quantized.quant_state)
    state.to(torch.device(device))
    return state


def bnb_cuda_works() -> bool:
    """Whether bitsandbytes can quantize on this GPU (its CUDA library loaded)."""
    if not HAS_CUDA:
        return False
    try:
        bnb_quantize((8, 64), "nf4", 64, False, torch.uint8, "cuda")
        return True
    except Exception:  # noqa: BLE001 - any failure means bitsandbytes has no CUDA backend here
        return False


def assert_gemv_close(out: torch.Tensor, x: torch.Tensor, packed: torch.Tensor, args: dict, bias=None) -> None:
    """The tolerance rule (nf4_ops.reference.gemv_error_bound), and out's dtype, shape and finiteness."""
    assert out.dtype == x.dtype
    assert out.shape == (*x.shape[:-1], args["shape"][0])
    assert torch.isfinite(out).all()
    err, allowed = gemv_error_bound(out, x, packed, bias=bias, **args)
    assert err <= allowed, f"max error {err:.3g} > {allowed:.3g} allowed (twice plain PyTorch's + 1e-5 of max |out|)"
