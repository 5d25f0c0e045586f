"""Whether nf4::gemv's dequantize + cuBLAS path (past the fused kernel's rows-of-x limits) is slower than the
benchmark's dequantize into a preallocated buffer + cuBLAS (the H200 suites' k/v layer at 256 rows, NOTES gemv
after rows 39-40): the two, and the same path with a fresh dequantize output per call, in the benchmark's
graphs over rotated weight copies, twice each.

    python benchmarks/experiments/kv256_gap.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import bitsandbytes.functional as bnbf
import torch

import nf4_ops

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_kernels import BLOCKSIZE, QUANT_TYPE, copies_for, graph_median_us  # noqa: E402
from report import gemv_bytes  # noqa: E402

LAYERS = [(1024, 8192), (2048, 5376), (8192, 8192)]  # Llama-3.3-70B k/v, Gemma-27B k/v, Llama-3.3-70B q
ROW_COUNTS = [128, 256]


def main() -> None:
    print(torch.cuda.get_device_name())
    for n, k in LAYERS:
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for rows in ROW_COUNTS:
            copies = copies_for(gemv_bytes(n, k, BLOCKSIZE, rows))
            quantized = [bnbf.quantize_4bit(weight, blocksize=BLOCKSIZE, quant_type=QUANT_TYPE) for _ in range(copies)]
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            buffer = torch.empty_like(weight)

            def preallocated(packed, state):
                nf4_ops.dequantize(packed, state, torch.bfloat16, out=buffer)
                return torch.nn.functional.linear(x, buffer)

            def fresh(packed, state):
                return torch.nn.functional.linear(x, nf4_ops.dequantize(packed, state, torch.bfloat16))

            paths = [("gemv", lambda packed, state: nf4_ops.gemv(x, packed, state)),
                     ("preallocated", preallocated), ("fresh", fresh)]  # fmt: skip
            for repetition in range(2):
                times = {name: graph_median_us(fn, quantized) for name, fn in paths}
                print(f"{n}x{k} rows {rows} ({copies} copies), run {repetition}: "
                      + ", ".join(f"{name} {us:.1f} us" for name, us in times.items()), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
