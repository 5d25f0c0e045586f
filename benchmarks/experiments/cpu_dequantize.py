"""nf4::dequantize on the CPU against bitsandbytes' CPU dequantize_4bit, into a fresh output and into a
preallocated one (out=), on the demo's layer (4096x4096, NF4, blocksize 64, nested absmax, bf16); medians of 9
calls, and torch.empty + fill_ of the same size for the cost of a fresh output's first touch.

    python benchmarks/experiments/cpu_dequantize.py
"""

from __future__ import annotations

import time

import torch

import nf4_ops


def median_ms(call, count: int = 9) -> float:
    times = []
    for _ in range(count):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return sorted(times)[count // 2] * 1e3


def main() -> None:
    import bitsandbytes.functional as bnbf

    torch.manual_seed(0)
    weight = torch.randn(4096, 4096, dtype=torch.bfloat16)
    packed, state = bnbf.quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=True)
    args = nf4_ops.quant_state_args(state)
    out = torch.empty_like(weight)
    print(f"CPU threads: {torch.get_num_threads()}")
    rows = [
        ("nf4-ops, fresh output", lambda: torch.ops.nf4.dequantize(packed, dtype=torch.bfloat16, **args)),
        ("nf4-ops, out=", lambda: torch.ops.nf4.dequantize.out(packed, dtype=torch.bfloat16, out=out, **args)),
        ("bitsandbytes", lambda: bnbf.dequantize_4bit(packed, state)),
        ("torch.empty + fill_", lambda: torch.empty_like(weight).fill_(1)),
    ]
    print("| call | ms |\n|---|---|")
    for name, call in rows:
        print(f"| {name} | {median_ms(call):.2f} |")


if __name__ == "__main__":
    main()
