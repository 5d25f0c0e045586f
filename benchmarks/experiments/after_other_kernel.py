"""nf4::gemv at one row and nf4::dequantize when the kernel before each call is not nf4-ops' own. The benchmark
times chains of calls of one op, in which each call may start while the one before finishes (programmatic
dependent launch on sm_90: benchmarks/NOTES.md, gemv rows 67-69); in a model most calls follow a norm or an
attention kernel instead. Here each call is also timed preceded by a small torch kernel (an in-place multiply of a
hidden-sized bf16 vector): compare the pairs' times across builds and NF4_OPS_PDL=0 / 1. (The pair minus the small
kernel's own chain is printed too, but it subtracts too much: a chain of tiny kernels is bound by their launches,
which in a pair overlap the op before.)

    python benchmarks/experiments/after_other_kernel.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

import nf4_ops  # noqa: F401  (registers torch.ops.nf4)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_kernels import BLOCKSIZE, copies_for, graph_median_us  # noqa: E402
from report import gemv_bytes  # noqa: E402
from time_gemv import random_weight  # noqa: E402  (this folder)

LAYERS = {  # name: (N, K)
    "llama3.3-70b gate/up": (28672, 8192),
    "llama3.3-70b q": (8192, 8192),
    "llama3.3-70b kv": (1024, 8192),
    "gemma-27b q": (4096, 5376),
}


def main() -> None:
    print(f"{torch.cuda.get_device_name()}, NF4_OPS_PDL={os.environ.get('NF4_OPS_PDL', '(unset: on)')}")
    print("| layer | op | chain of the op us | chain of (torch kernel, op) us | torch kernel alone us | pair - alone us |")
    print("|---|---|---|---|---|---|")
    for name, (n, k) in LAYERS.items():
        count = copies_for(gemv_bytes(n, k, BLOCKSIZE, 1) * 4)  # dequantize moves ~4.5x gemv's bytes
        weights = [random_weight(n, k) for _ in range(count)]
        x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        hidden = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        args = dict(blocksize=BLOCKSIZE, quant_type="nf4", shape=[n, k])

        def other() -> None:
            hidden.mul_(1.0001)

        ops = {
            "gemv M=1": lambda p, a: torch.ops.nf4.gemv(x, p, a, **args),
            "dequantize": lambda p, a: torch.ops.nf4.dequantize(p, a, dtype=torch.bfloat16, **args),
        }
        alone = graph_median_us(lambda p, a: other(), weights)
        for op_name, op in ops.items():
            chain = graph_median_us(op, weights)
            pair = graph_median_us(lambda p, a: (other(), op(p, a)), weights)
            print(f"| {name} | {op_name} | {chain:.1f} | {pair:.1f} | {alone:.1f} | {pair - alone:.1f} |", flush=True)
        del weights
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
