"""How long a plain read of a layer's gemv bytes takes on this GPU, timed as the benchmark times nf4::gemv
(CUDA graphs over rotated copies, median of replays), next to nf4::gemv at one row and the time the read
ceiling (measured over 1 GiB / a 470 MB weight) implies. Two reads of the same byte count: cuBLAS bf16 gemv of
a [bytes / 2K, K] weight at one row, and torch's fp32-accumulating sum of a bf16 buffer; the faster counts,
as in the read ceiling (report.read_ceiling). What it shows: the part of each call that does not scale with
its bytes (launch, ramp-up, tail), which no kernel of this size avoids (benchmarks/NOTES.md, gemv row 51).

    python benchmarks/experiments/same_size_read.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import nf4_ops  # noqa: F401  (registers torch.ops.nf4)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_kernels import BLOCKSIZE, PAPER_LAYERS, copies_for, graph_median_us, measure_ceilings  # noqa: E402
from report import gemv_bytes, read_ceiling  # noqa: E402
from time_gemv import random_weight  # noqa: E402  (this folder)


def main() -> None:
    read = read_ceiling(measure_ceilings())
    print(f"{torch.cuda.get_device_name()}: read ceiling {read:.0f} GB/s")
    print("| layer | MB | at the ceiling us | cuBLAS read us | sum read us | nf4::gemv us | gemv / faster read |")
    print("|---|---|---|---|---|---|---|")
    seen = set()
    for layer in PAPER_LAYERS:
        if (layer.n, layer.k) in seen:
            continue
        seen.add((layer.n, layer.k))
        nbytes = gemv_bytes(layer.n, layer.k, BLOCKSIZE, 1)
        count = copies_for(nbytes)
        rows_same_bytes = round(nbytes / (2 * layer.k))
        x = torch.randn(1, layer.k, dtype=torch.bfloat16, device="cuda")
        dense = [(torch.randn(rows_same_bytes, layer.k, dtype=torch.bfloat16, device="cuda"),) for _ in range(count)]
        cublas_us = graph_median_us(lambda w: torch.nn.functional.linear(x, w), dense)
        flat = [(w.view(-1),) for (w,) in dense]
        sum_us = graph_median_us(lambda f: f.sum(dtype=torch.float32), flat)
        del dense, flat
        packed = [random_weight(layer.n, layer.k) for _ in range(count)]
        shape = [layer.n, layer.k]
        gemv_us = graph_median_us(lambda p, a: torch.ops.nf4.gemv(x, p, a, BLOCKSIZE, "nf4", shape), packed)
        del packed
        torch.cuda.empty_cache()
        ceiling_us = nbytes / read / 1e3
        print(f"| {layer.model} {layer.name} | {nbytes / 1e6:.1f} | {ceiling_us:.1f} | {cublas_us:.1f} | {sum_us:.1f} "
              f"| {gemv_us:.1f} | {gemv_us / min(cublas_us, sum_us):.2f} |", flush=True)


if __name__ == "__main__":
    main()
