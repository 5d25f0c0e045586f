"""Compares the benchmark runs of a same-machine A/B (scripts/gpu_ab.sh): DIR/run<i>_<name>.json, one pass each of
bench_kernels.py, alternating between two builds.

    python benchmarks/compare_runs.py DIR [--var var] [--base base]

Prints, per figure of the layer table, the sum over the layers of the mean over each build's passes, and the change
var / base - 1; then one row per layer for nf4::gemv at one row (plain, nested, fp32 x) and at 16 rows; then,
where the runs have the rows-of-x sweep, the nf4::gemv time per row count. Read a change net of the drift: the
figures whose code the patch does not touch (bitsandbytes, cuBLAS, and the kernels it leaves alone) move by what the
machine drifted between the passes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

PER_LAYER_FIGURES = ("nf4ops_gemv_M1", "nf4ops_gemv_M1_nested", "nf4ops_gemv_M1_fp32x", "nf4ops_gemv_M16")


def load(directory: Path, name: str) -> list[dict]:
    runs = [json.loads(p.read_text()) for p in sorted(directory.glob(f"run*_{name}.json"))]
    if not runs:
        sys.exit(f"no {directory}/run*_{name}.json")
    return runs


def mean_time(runs: list[dict], layer: int, figure: str) -> float:
    return statistics.mean(run["rows"][layer]["times_us"][figure] for run in runs)


def change(var: float, base: float) -> str:
    return f"{100 * (var / base - 1):+.2f}%"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--var", default="var", help="the patched build's name in the file names")
    parser.add_argument("--base", default="base", help="the base build's name in the file names")
    args = parser.parse_args()
    var, base = load(args.directory, args.var), load(args.directory, args.base)
    layers = range(len(base[0]["rows"]))
    print(f"{args.directory}: {len(var)} pass(es) of {args.var}, {len(base)} of {args.base}; {base[0]['env']['gpu']}")
    print()
    print(f"| figure | {args.base} µs (sum over layers) | {args.var} µs | change |")
    print("| --- | --- | --- | --- |")
    for figure in base[0]["rows"][0]["times_us"]:
        base_sum = sum(mean_time(base, i, figure) for i in layers)
        var_sum = sum(mean_time(var, i, figure) for i in layers)
        print(f"| {figure} | {base_sum:.1f} | {var_sum:.1f} | {change(var_sum, base_sum)} |")
    for figure in PER_LAYER_FIGURES:
        print()
        print(f"| layer | {figure}: {args.base} µs per pass | {args.var} µs per pass | change |")
        print("| --- | --- | --- | --- |")
        for i in layers:
            layer = base[0]["rows"][i]["layer"]
            passes = [" / ".join(f"{run['rows'][i]['times_us'][figure]:.2f}" for run in runs) for runs in (base, var)]
            print(f"| {layer['model']} {layer['name']} | {passes[0]} | {passes[1]} | "
                  f"{change(mean_time(var, i, figure), mean_time(base, i, figure))} |")
    for c, curve in enumerate(base[0].get("crossover") or []):
        layer = curve["layer"]
        print()
        print(f"{layer['model']} {layer['name']}, nf4::gemv by rows of x:")
        print()
        print(f"| rows | {args.base} µs | {args.var} µs | change |")
        print("| --- | --- | --- | --- |")
        for p, point in enumerate(curve["points"]):
            times = [[run["crossover"][c]["points"][p]["times_us"]["nf4ops_gemv"] for run in runs] for runs in (base, var)]
            print(f"| {point['rows']} | {' / '.join(f'{t:.1f}' for t in times[0])} | "
                  f"{' / '.join(f'{t:.1f}' for t in times[1])} | "
                  f"{change(statistics.mean(times[1]), statistics.mean(times[0]))} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
