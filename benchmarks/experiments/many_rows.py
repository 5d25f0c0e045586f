"""Rows of bf16 x past one tensor-core launch (17-256): nf4::gemv against the paths it chooses between there
(launches of 16 rows, each a call of nf4::gemv on 16 rows of x; dequantize into a preallocated buffer + cuBLAS),
bitsandbytes' matmul_4bit and cuBLAS bf16 on the unquantized weight, on the paper's layer shapes (each N x K once).
Same method as benchmarks/bench_kernels.py (CUDA graphs over rotated weight copies quantized by bitsandbytes,
medians of replays). Built with -DNF4_MANY_ROWS_MAX_ROWS=256 -DNF4_MANY_ROWS_TAIL_ROWS=0 (NF4_OPS_NVCC_FLAGS),
nf4::gemv takes the many-rows kernel alone at every row count here: that is how csrc/ops.h's kManyRowsGemvRowLimits
is measured, and the last column (the last rows % 32 as a call of their own) its kManyRowsTailRowLimits. Each
nf4::gemv result is also checked against the tolerance rule (nf4_ops.reference.gemv_error_bound; the script exits
non-zero on a miss), so a sweep of a tuning build checks row counts past the limits, which the tests do not reach.

    python benchmarks/experiments/many_rows.py [--rows 17 32 64 128 256] [--nested] [--layers N K ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import nf4_ops
from nf4_ops.reference import gemv_error_bound

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_kernels import BLOCKSIZE, PAPER_LAYERS, QUANT_TYPE, copies_for, graph_median_us  # noqa: E402
from report import gemv_bytes  # noqa: E402

LAUNCH_ROWS = 16  # csrc/ops.h, kTensorCoreGemvLaunchRows
X_TILE_ROWS = 32  # csrc/ops.h, kManyRowsXTileRows


def main() -> None:
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbf

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 17, 24, 32, 48, 64, 96, 128, 192, 256])
    parser.add_argument("--nested", action="store_true", help="nested absmax (bnb_4bit_use_double_quant)")
    parser.add_argument("--layers", type=int, nargs="+", help="N K pairs (default: every paper shape once)")
    args = parser.parse_args()
    if args.layers:
        shapes = list(zip(args.layers[::2], args.layers[1::2]))
    else:
        shapes = list(dict.fromkeys((layer.n, layer.k) for layer in PAPER_LAYERS))
    names = {(lay.n, lay.k): f"{lay.model} {lay.name}" for lay in reversed(PAPER_LAYERS)}
    print(f"{torch.cuda.get_device_name()}, bitsandbytes {bnb.__version__}, "
          f"{'nested' if args.nested else 'plain'} absmax, bf16 x")  # fmt: skip
    print("| layer | N x K | M | nf4::gemv us | launches of 16 us | dequantize + cuBLAS us | bnb us | cuBLAS bf16 us "
          "| gemv vs best of (launches, dequantize + cuBLAS) | gemv vs bnb | gemv max error / allowed "
          "| gemv with the last rows % 32 apart us |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    misses = []
    for n, k in shapes:
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        count = copies_for(gemv_bytes(n, k, BLOCKSIZE, 1))
        quantized = [bnbf.quantize_4bit(weight, blocksize=BLOCKSIZE, quant_type=QUANT_TYPE,
                                        compress_statistics=args.nested) for _ in range(count)]  # fmt: skip
        dense = [(weight.clone(),) for _ in range(copies_for(n * k * 2))]
        buffer = torch.empty_like(weight)
        for rows in args.rows:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)

            def dequantize_then_cublas(p, s):
                nf4_ops.dequantize(p, s, torch.bfloat16, out=buffer)
                return torch.nn.functional.linear(x, buffer)

            def launches(p, s):
                return [nf4_ops.gemv(x[m : m + LAUNCH_ROWS], p, s) for m in range(0, rows, LAUNCH_ROWS)]

            # A last part-filled tile of x of up to one launch's rows as a call of its own (one launch of the
            # tensor-core or one-row kernel) after the whole tiles: what that split would cost.
            tail = rows % X_TILE_ROWS if rows > X_TILE_ROWS and rows % X_TILE_ROWS <= LAUNCH_ROWS else 0

            def tail_apart(p, s):
                return [nf4_ops.gemv(x[: rows - tail], p, s), nf4_ops.gemv(x[rows - tail :], p, s)]

            ours = graph_median_us(lambda p, s: nf4_ops.gemv(x, p, s), quantized)
            apart = graph_median_us(tail_apart, quantized) if tail else 0.0
            old = graph_median_us(launches, quantized)
            dense_path = graph_median_us(dequantize_then_cublas, quantized)
            theirs = graph_median_us(lambda p, s: bnb.matmul_4bit(x, p.t(), quant_state=s), quantized)
            cublas = graph_median_us(lambda w: torch.nn.functional.linear(x, w), dense)
            packed, state = quantized[0]
            out = nf4_ops.gemv(x, packed, state)
            err, allowed = gemv_error_bound(out, x, packed, **nf4_ops.quant_state_args(state))
            if not err <= allowed:
                misses.append(f"{n} x {k}, {rows} rows: max error {err:.3g} > {allowed:.3g} allowed")
            cells = [names.get((n, k), "-"), f"{n} x {k}", str(rows), f"{ours:.1f}", f"{old:.1f}", f"{dense_path:.1f}",
                     f"{theirs:.1f}", f"{cublas:.1f}", f"{min(old, dense_path) / ours:.2f}x", f"{theirs / ours:.2f}x",
                     f"{err / allowed:.2f}", f"{apart:.1f}" if tail else "-"]
            print("| " + " | ".join(cells) + " |", flush=True)
        del weight, quantized, dense, buffer
        torch.cuda.empty_cache()
    for miss in misses:
        print(f"gemv result outside the tolerance rule: {miss}")
    raise SystemExit(1 if misses else 0)


if __name__ == "__main__":
    main()
