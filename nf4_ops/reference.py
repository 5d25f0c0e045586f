"""The pure-PyTorch oracle of the nf4 ops: every test and benchmark compares against these functions.

Written for clarity, not speed, straight from the format (../shared/docs/bnb-format.md).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

# The Python copy of the code tables (the C++ copy is csrc/nf4_core.h; tests check they are equal).
NF4_TABLE = torch.tensor(
    [
        -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
        -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
        0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
        0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
    ],
    dtype=torch.float32,
)  # fmt: skip
# {0, 0.0625, 8, 12, 4, 6, 2, 3} / 12 with the sign in bit 3; nibble 8 is -0.0 as in bitsandbytes' kernels.
_FP4_MAGNITUDES = torch.tensor([0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0], dtype=torch.float32) / 12.0
FP4_TABLE = torch.cat([_FP4_MAGNITUDES, -_FP4_MAGNITUDES])
TABLES = {"nf4": NF4_TABLE, "fp4": FP4_TABLE}


def unpack_nibbles(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The 4-bit codes of flat elements 0..numel-1: byte j holds element 2j in its HIGH nibble."""
    data = packed.contiguous().view(torch.uint8).flatten()[: (numel + 1) // 2]
    nibbles = torch.stack([data >> 4, data & 0x0F], dim=1).flatten()
    return nibbles[:numel].long()


def absmax_reference(
    absmax: torch.Tensor,
    nested_absmax: Optional[torch.Tensor] = None,
    nested_code: Optional[torch.Tensor] = None,
    nested_offset: Optional[torch.Tensor] = None,
    nested_blocksize: int = 256,
) -> torch.Tensor:
    """The fp32 per-block scales; nested: fp32(fp32(code2[q] * absmax2[i // nb]) + offset), two roundings."""
    if nested_absmax is None:
        return absmax.float()
    codes = absmax.flatten().long()
    block_of = torch.arange(codes.numel(), device=codes.device) // nested_blocksize
    scaled = nested_code.flatten()[codes] * nested_absmax.flatten()[block_of]  # rounded once here...
    return scaled + nested_offset.flatten()[0]  # ...and once here (separate ops never fuse into an FMA)


def dequantize_reference(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    blocksize: int,
    quant_type: str,
    shape: Sequence[int],
    dtype: torch.dtype,
    nested_absmax: Optional[torch.Tensor] = None,
    nested_code: Optional[torch.Tensor] = None,
    nested_offset: Optional[torch.Tensor] = None,
    nested_blocksize: int = 256,
) -> torch.Tensor:
    """out[e] = round_to(dtype)(fp32(code[nibble(e)] * absmax[e // blocksize])), shaped [N, K]."""
    rows, cols = (int(s) for s in shape)
    numel = rows * cols
    codes = TABLES[quant_type].to(packed.device)[unpack_nibbles(packed, numel)]
    scales = absmax_reference(absmax, nested_absmax, nested_code, nested_offset, nested_blocksize)
    block_of = torch.arange(numel, device=packed.device) // blocksize
    return (codes * scales[block_of]).to(dtype).reshape(rows, cols)


def gemv_reference(
    x: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    blocksize: int,
    quant_type: str,
    shape: Sequence[int],
    bias: Optional[torch.Tensor] = None,
    nested_absmax: Optional[torch.Tensor] = None,
    nested_code: Optional[torch.Tensor] = None,
    nested_offset: Optional[torch.Tensor] = None,
    nested_blocksize: int = 256,
    compute_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """F.linear(x, W, bias) with W dequantized, computed in `compute_dtype` (default x.dtype): float64
    gives the accurate answer, x.dtype what plain PyTorch gets at that precision. Returned in compute_dtype."""
    compute_dtype = x.dtype if compute_dtype is None else compute_dtype
    weight = dequantize_reference(
        packed, absmax, blocksize, quant_type, shape, torch.float32,
        nested_absmax, nested_code, nested_offset, nested_blocksize,
    ).to(compute_dtype)  # fmt: skip
    bias = None if bias is None else bias.to(compute_dtype)
    return torch.nn.functional.linear(x.to(compute_dtype), weight, bias)


def gemv_error_bound(
    out: torch.Tensor, x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor] = None, **args
) -> tuple[float, float]:
    """The tolerance rule (README, "Correctness") for a gemv result `out`: returns (its max error against the
    float64 answer, the most the rule allows), the allowance being twice the max error of plain PyTorch at x's
    dtype (F.linear on the dequantized weight) plus a small absolute term, 1e-5 of the output's magnitude (fp32
    summation-order noise). Computed on the inputs' device."""
    exact = gemv_reference(x, packed, bias=bias, compute_dtype=torch.float64, **args)
    plain = gemv_reference(x, packed, bias=bias, **args)
    if exact.numel() == 0:
        return 0.0, 0.0
    err = (out.double() - exact).abs().max().item()
    err_plain = (plain.double() - exact).abs().max().item()
    return err, 2 * err_plain + 1e-5 * max(1.0, exact.abs().max().item())


# The memory class by which csrc/ops.h picks its CUDA row limits (kFastMemoryMinPeakGBps: the tables measured on an
# H200 from this peak bandwidth on), so that tests and the sanitizer workload can choose the row counts they check.
FAST_MEMORY_MIN_PEAK_GBPS = 4000


def has_fast_memory(device: Optional[int] = None) -> bool:
    """Whether the CUDA device's peak memory bandwidth, computed as csrc/gemv.cu peak_memory_GBps does (memory
    clock and bus width), is FAST_MEMORY_MIN_PEAK_GBPS or more."""
    props = torch.cuda.get_device_properties(device)
    return 2 * props.memory_clock_rate * (props.memory_bus_width // 8) // 10**6 >= FAST_MEMORY_MIN_PEAK_GBPS
