"""Times nf4::gemv alone on the paper's layers, for comparing kernel builds quickly (one build per run; the
full comparison against bitsandbytes and cuBLAS is benchmarks/bench_kernels.py). Same method as that
benchmark: CUDA graphs over rotated weight copies, median of replays, and this run's read ceiling. Weights
are random packed bytes with positive absmax (timing only).

    python benchmarks/experiments/time_gemv.py [--rows 1 16] [--quick] [--same] [--dtype float32]

--same runs every call of the graph on one weight: a W that fits in L2 then stays there, which shows the
kernel's own speed without DRAM (benchmarks/NOTES.md, "Where M=1 stands").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import nf4_ops  # noqa: F401  (registers torch.ops.nf4)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_kernels import BLOCKSIZE, PAPER_LAYERS, copies_for, graph_median_us, measure_ceilings  # noqa: E402
from report import gemv_bytes, read_ceiling  # noqa: E402


def random_weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    packed = torch.randint(0, 256, (n * k // 2, 1), dtype=torch.uint8, device="cuda")
    absmax = torch.rand(n * k // BLOCKSIZE, device="cuda") + 0.5
    return packed, absmax


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--quick", action="store_true", help="Llama-3.3-70B's layers only")
    parser.add_argument("--same", action="store_true", help="every call of the graph on one weight")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16", help="x's dtype")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    read = read_ceiling(measure_ceilings())
    print(f"{torch.cuda.get_device_name()}: read ceiling {read:.0f} GB/s; x {args.dtype}")
    print("| layer | " + " | ".join(f"M={m} us | M={m} %read" for m in args.rows) + " |")
    print("|---|" + "---|---|" * len(args.rows))
    seen = set()
    for layer in PAPER_LAYERS:
        if (args.quick and not layer.model.startswith("llama")) or (layer.n, layer.k) in seen:
            continue
        seen.add((layer.n, layer.k))
        cells = []
        for rows in args.rows:
            nbytes = gemv_bytes(layer.n, layer.k, BLOCKSIZE, rows, dtype.itemsize)
            count = copies_for(nbytes)
            weights = ([random_weight(layer.n, layer.k)] * count if args.same
                       else [random_weight(layer.n, layer.k) for _ in range(count)])  # fmt: skip
            x = torch.randn(rows, layer.k, dtype=dtype, device="cuda")
            shape = [layer.n, layer.k]
            us = graph_median_us(lambda p, a: torch.ops.nf4.gemv(x, p, a, BLOCKSIZE, "nf4", shape), weights)
            cells.append(f"{us:.1f} | {100 * nbytes / us / 1e3 / read:.0f}")
            del weights
            torch.cuda.empty_cache()
        print(f"| {layer.model} {layer.name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
