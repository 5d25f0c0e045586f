"""Typed wrappers that take a bitsandbytes QuantState and call torch.ops.nf4.*."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:  # bitsandbytes is only needed to build a QuantState, not to call the ops
    from bitsandbytes.functional import QuantState


def quant_state_args(quant_state: "QuantState") -> dict[str, Any]:
    """The op arguments a bitsandbytes QuantState stands for (everything but `packed`, `x` and `bias`)."""
    args: dict[str, Any] = {
        "absmax": quant_state.absmax,
        "blocksize": int(quant_state.blocksize),
        "quant_type": str(quant_state.quant_type),
        "shape": [int(s) for s in quant_state.shape],
    }
    if quant_state.nested:
        args.update(
            nested_absmax=quant_state.state2.absmax,
            nested_code=quant_state.state2.code,
            nested_offset=quant_state.offset,
            nested_blocksize=int(quant_state.state2.blocksize),
        )
    return args


def dequantize(
    packed: torch.Tensor,
    quant_state: "QuantState",
    dtype: Optional[torch.dtype] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The [N, K] weight in `dtype` (default: out's dtype, else the dtype it was quantized from),
    bit-exact with bitsandbytes.functional.dequantize_4bit. With `out` ([N, K], contiguous, on packed's
    device) it is written there and returned, with no allocation."""
    if dtype is None:
        dtype = quant_state.dtype if out is None else out.dtype
    if out is None:
        return torch.ops.nf4.dequantize(packed, dtype=dtype, **quant_state_args(quant_state))
    torch.ops.nf4.dequantize.out(packed, dtype=dtype, out=out, **quant_state_args(quant_state))
    return out


def gemv(
    x: torch.Tensor,
    packed: torch.Tensor,
    quant_state: "QuantState",
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """x @ W.T + bias as [..., N] in x.dtype, accumulated in fp32."""
    return torch.ops.nf4.gemv(x, packed, bias=bias, **quant_state_args(quant_state))
