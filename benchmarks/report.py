"""Tables from a kernel benchmark's JSON (benchmarks/bench_kernels.py), and the README section made of them.

    python benchmarks/report.py RESULTS.json                  # print the tables
    python benchmarks/report.py RESULTS.json --readme README.md  # rewrite README's performance section

The README section lies between the markers `<!-- performance:begin -->` and `<!-- performance:end -->`.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

BEGIN, END = "<!-- performance:begin -->", "<!-- performance:end -->"


def dequantize_bytes(n: int, k: int, blocksize: int, nested: bool, out_bytes: int = 2) -> int:
    """The fewest bytes dequantize must move: packed weight + absmax read, output written."""
    numel = n * k
    blocks = math.ceil(numel / blocksize)
    absmax = blocks + 4 * math.ceil(blocks / 256) if nested else 4 * blocks
    return math.ceil(numel / 2) + absmax + numel * out_bytes


def gemv_bytes(n: int, k: int, blocksize: int, rows: int, act_bytes: int = 2) -> int:
    """The fewest bytes gemv must move: packed weight + fp32 absmax + x read, y written."""
    numel = n * k
    return math.ceil(numel / 2) + 4 * math.ceil(numel / blocksize) + act_bytes * rows * (k + n)


def same_size_read_bytes(k: int, nbytes: int) -> dict[str, int]:
    """The bytes each same-size read of bench_kernels.same_size_read_us reads for a gemv that reads nbytes:
    cuBLAS's GEMV on a bf16 [rows, k] weight (rows rounded up to a multiple of 256: cuBLAS read 132 MB of
    [8058, 8192] at 61% of the rate of [8192, 8192] on an H100, NOTES gemv row 86) and a torch.sum of bf16 values."""
    rows = -(-nbytes // (2 * k * 256)) * 256
    return {"read_same_bytes_gemv": 2 * k * rows, "read_same_bytes_sum": -(-nbytes // 2) * 2}


def same_size_rate(times_us: dict, moved_bytes: dict) -> float:
    """The best rate in GB/s of the same-size runs whose bytes moved_bytes gives by key (those that were timed)."""
    return max(moved_bytes[key] / times_us[key] / 1e3 for key in moved_bytes if key in times_us)


def same_size_copy_rate(times_us: dict, nbytes: int) -> float:
    """The best rate in GB/s of the same-size copies of nbytes (bench_kernels.same_size_copy_us: every copy_same_bytes_*
    key) in times_us."""
    return same_size_rate(times_us, {key: nbytes for key in times_us if key.startswith("copy_same_bytes_")})


def read_ceiling(ceilings: dict) -> float:
    return max(ceilings["read_sum_GBps"], ceilings["read_cublas_gemv_GBps"])


def _row(cells) -> str:
    return "| " + " | ".join(cells) + " |"


def dequantize_table(results: dict) -> str:
    copy = results["ceilings_GBps"]["copy_GBps"]
    bs = results["blocksize"]
    header = ["model", "layer", "N x K", "MB moved", "nf4-ops µs (plain / nested)", "GB/s (plain)",
              "% of copy ceiling (plain / nested)", "bnb µs (plain / nested)", "speedup vs bnb (plain / nested)"]
    with_same_size = "copy_same_bytes_memcpy" in results["rows"][0]["times_us"]  # older results lack it
    header += ["% of a same-size copy (plain / nested)"] * with_same_size
    lines = [_row(header), _row(["---"] * len(header))]
    for r in results["rows"]:
        lay, t = r["layer"], r["times_us"]
        plain, nested = t["nf4ops_dequant_plain"], t["nf4ops_dequant_nested"]
        bytes_plain = dequantize_bytes(lay["n"], lay["k"], bs, False)
        bytes_nested = dequantize_bytes(lay["n"], lay["k"], bs, True)
        if with_same_size:  # the copies moved bytes_plain
            copy_rate = same_size_copy_rate(t, bytes_plain)
        lines.append(_row([
            lay["model"], lay["name"], f"{lay['n']} x {lay['k']}", f"{bytes_plain / 1e6:.0f}",
            f"{plain:.1f} / {nested:.1f}", f"{bytes_plain / plain / 1e3:.0f}",
            f"{100 * bytes_plain / plain / 1e3 / copy:.0f} / {100 * bytes_nested / nested / 1e3 / copy:.0f}",
            f"{t['bnb_dequant_plain']:.1f} / {t['bnb_dequant_nested']:.1f}",
            f"{t['bnb_dequant_plain'] / plain:.2f} / {t['bnb_dequant_nested'] / nested:.2f}",
        ] + ([
            f"{100 * bytes_plain / plain / 1e3 / copy_rate:.0f} / {100 * bytes_nested / nested / 1e3 / copy_rate:.0f}"
        ] if with_same_size else [])))  # fmt: skip
    return "\n".join(lines)


def gemv_table(results: dict) -> str:
    read = read_ceiling(results["ceilings_GBps"])
    bs = results["blocksize"]
    first = results["rows"][0]["times_us"]
    row_counts = sorted({int(key.rsplit("M", 1)[1]) for key in first
                         if key.startswith("nf4ops_gemv_M") and key.rsplit("M", 1)[1].isdigit()})  # fmt: skip
    with_growth = 1 in row_counts and len(row_counts) > 1  # the most rows' time over the one-row time
    with_fp32 = "nf4ops_gemv_M1_fp32x" in first
    header = ["model", "layer", "N x K"]
    for m in row_counts:
        header += [f"M={m} µs", f"M={m} GB/s", f"M={m} % of read ceiling", f"M={m} vs bnb", f"M={m} vs cuBLAS bf16"]
    with_bnb_fp32 = "bnb_gemv_M1_fp32x" in first  # older results timed only nf4-ops on fp32 x
    header += [f"M={row_counts[-1]} time / M=1 time"] * with_growth + ["M=1 µs, fp32 x"] * with_fp32
    header += ["M=1 fp32 x vs bnb"] * with_bnb_fp32
    with_nested = "nf4ops_gemv_M1_nested" in first  # older results timed plain absmax only
    header += ["M=1 µs, nested absmax", "M=1 nested vs bnb"] * with_nested
    with_same_size = "read_same_bytes_gemv" in first  # older results lack it
    header += ["M=1 % of a same-size read"] * with_same_size
    lines = [_row(header), _row(["---"] * len(header))]
    for r in results["rows"]:
        lay, t = r["layer"], r["times_us"]
        cells = [lay["model"], lay["name"], f"{lay['n']} x {lay['k']}"]
        for m in row_counts:
            ours = t[f"nf4ops_gemv_M{m}"]
            gbps = gemv_bytes(lay["n"], lay["k"], bs, m) / ours / 1e3
            cells += [f"{ours:.1f}", f"{gbps:.0f}", f"{100 * gbps / read:.0f}",
                      f"{t[f'bnb_gemv_M{m}'] / ours:.2f}x", f"{t[f'cublas_gemv_M{m}'] / ours:.2f}x"]  # fmt: skip
        if with_growth:
            cells.append(f"{t[f'nf4ops_gemv_M{row_counts[-1]}'] / t['nf4ops_gemv_M1']:.2f}")
        if with_fp32:
            cells.append(f"{t['nf4ops_gemv_M1_fp32x']:.1f}")
        if with_bnb_fp32:
            cells.append(f"{t['bnb_gemv_M1_fp32x'] / t['nf4ops_gemv_M1_fp32x']:.2f}x")
        if with_nested:
            nested = t["nf4ops_gemv_M1_nested"]
            cells += [f"{nested:.1f}", f"{t['bnb_gemv_M1_nested'] / nested:.2f}x"]
        if with_same_size:
            moved = gemv_bytes(lay["n"], lay["k"], bs, 1)
            read_rate = same_size_rate(t, same_size_read_bytes(lay["k"], moved))
            cells.append(f"{100 * moved / t['nf4ops_gemv_M1'] / 1e3 / read_rate:.0f}")
        lines.append(_row(cells))
    return "\n".join(lines)


def crossover_table(results: dict) -> str:
    """Time against rows of x, for the layers of the crossover sweep: nf4::gemv, the dequantize + cuBLAS
    path it switches to, bitsandbytes and cuBLAS bf16."""
    lines = []
    for curve in results.get("crossover", []):
        lay = curve["layer"]
        lines += [f"{lay['model']} {lay['name']} {lay['n']} x {lay['k']}:", ""]
        header = ["M", "nf4::gemv µs", "nf4 dequantize + cuBLAS µs", "bnb µs", "cuBLAS bf16 µs",
                  "nf4::gemv vs best of (bnb, dequantize + cuBLAS)"]  # fmt: skip
        lines += [_row(header), _row(["---"] * len(header))]
        for p in curve["points"]:
            t = p["times_us"]
            best_other = min(t["bnb"], t["nf4ops_dequantize_cublas"])
            lines.append(_row([str(p["rows"]), f"{t['nf4ops_gemv']:.1f}", f"{t['nf4ops_dequantize_cublas']:.1f}",
                               f"{t['bnb']:.1f}", f"{t['cublas_bf16']:.1f}", f"{best_other / t['nf4ops_gemv']:.2f}x"]))
        lines.append("")
    return "\n".join(lines).rstrip()


def header_line(results: dict) -> str:
    env, ceilings = results["env"], results["ceilings_GBps"]
    return (
        f"{env['gpu']}, driver {env['driver']}, torch {env['torch']} (CUDA {env['cuda']}), bitsandbytes "
        f"{env['bitsandbytes']}; {results['quant_type'].upper()}, blocksize {results['blocksize']}, bf16. "
        f"Ceilings measured in the same run: copy {ceilings['copy_GBps']:.0f} GB/s (read + write), "
        f"read {read_ceiling(ceilings):.0f} GB/s. Times are medians in µs{rounds_note(results)}{chain_note(results)}; "
        f"speedups above 1 mean nf4-ops is faster."
    )


def chain_note(results: dict) -> str:
    """How many calls each timed graph held, where --min-calls raised it above one per weight copy."""
    calls = results.get("min_graph_calls", 1)
    return f", each timed graph holding at least {calls} calls" if calls > 1 else ""


def rounds_note(results: dict) -> str:
    """How the table's figures came from several passes, and how far the passes were apart (runs before
    --rounds existed have one pass)."""
    rows = results["rows"]
    if results.get("rounds", 1) < 2 or "times_us_rounds" not in rows[0]:
        return ""
    def spreads(prefixes: tuple[str, ...]) -> list[float]:
        return [max(p[key] for p in r["times_us_rounds"]) / min(p[key] for p in r["times_us_rounds"]) - 1
                for r in rows for key in r["times_us"] if key.startswith(prefixes)]  # fmt: skip

    ours, baselines = spreads(("nf4ops",)), spreads(("bnb", "cublas"))
    # the baselines' too: a median of three passes hides a pass at another level only where two agree (an H200's
    # cuBLAS read Llama's gate/up at 118, 118 and 107 µs in one run, and 107 in that run's read ceiling)
    return (f" (each the median of {results['rounds']} passes over the layers, ceilings too; an nf4-ops figure's "
            f"passes were at most {100 * max(ours):.0f}% apart, in half of them {100 * statistics.median(ours):.1f}%; "
            f"a bitsandbytes or cuBLAS figure's at most {100 * max(baselines):.0f}%, "
            f"in half of them {100 * statistics.median(baselines):.1f}%)")


def dequantize_variants_table(results: dict) -> str:
    """benchmarks/bench_dequantize_variants.py's results: per variant the least and the median % of the copy ceiling
    over the layers, where the least is, the least and the median speedup over bitsandbytes, and (runs that timed
    them) the least and the median % of the rate a copy of the layer's own bytes reached."""
    copy = results["copy_GBps"]
    same_size = {(c["model"], c["layer"], c["out_bytes"]): same_size_copy_rate(c, c["moved_bytes"])
                 for c in results.get("same_size_copies", [])}
    header = ["variant", "layers", "% of copy ceiling (least / median)", "least at", "vs bnb (least / median)"]
    header += ["% of a same-size copy (least / median)"] * bool(same_size)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for v in results["variants"]:
        points = v["layers"]
        rates = [p["moved_bytes"] / p["nf4ops_us"] / 1e3 for p in points]
        pct = [100 * rate / copy for rate in rates]
        speedup = [p["bnb_us"] / p["nf4ops_us"] for p in points]
        worst = points[min(range(len(points)), key=pct.__getitem__)]
        cells = [v["name"], str(len(points)), f"{min(pct):.0f} / {statistics.median(pct):.0f}",
                 f"{worst['model']} {worst['layer']}", f"{min(speedup):.2f}x / {statistics.median(speedup):.2f}x"]
        if same_size:
            out_bytes = {"bf16": 2, "fp16": 2, "fp32": 4}[v["dtype"]]
            of_same = [100 * rate / same_size[(p["model"], p["layer"], out_bytes)] for p, rate in zip(points, rates)]
            cells.append(f"{min(of_same):.0f} / {statistics.median(of_same):.0f}")
        lines.append(_row(cells))
    return "\n".join(lines)


def readme_section(results: dict, json_path: str, variants: dict | None = None, variants_path: str = "") -> str:
    variant_lines = [] if variants is None else [
        f"**Dequantize variants** (`python benchmarks/bench_dequantize_variants.py`, `{variants_path}`; copy ceiling "
        f"{variants['copy_GBps']:.0f} GB/s in that run; each variant over the paper layers of 20 MB or more, one per "
        "element count; the last column against a copy of each layer's own bytes, timed as the dequantize is):",
        "",
        dequantize_variants_table(variants),
        "",
    ]  # fmt: skip
    return "\n".join([
        BEGIN,
        f"Generated by `python benchmarks/report.py {json_path} --readme README.md` from the run of "
        f"`{results['env']['command']}` (`bash scripts/gpu_suite.sh` runs it after the build, the tests and the "
        "sanitizers).",
        "",
        header_line(results),
        "",
        "**Dequantize** (bytes moved: packed weight + absmax read, bf16 weight written; the last column against the "
        "faster of a memcpy and an elementwise copy of the same bytes, in the same chain of calls):",
        "",
        dequantize_table(results),
        "",
        *variant_lines,
        "**GEMV** `x[M, K] @ W.T` (bytes moved: packed weight + absmax + x read, y written; the last column against "
        "the faster of cuBLAS's bf16 GEMV and torch.sum reading the one-row call's bytes, in the same chain of calls):",
        "",
        gemv_table(results),
        "",
        "**Rows of x**: where `nf4::gemv` switches from its fused kernels (the many-rows kernel for 17 rows and more) "
        "to dequantize + cuBLAS (`kManyRowsGemvRowLimits`, csrc/ops.h):",
        "",
        crossover_table(results),
        END,
    ])  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path)
    parser.add_argument("--readme", type=Path, help="rewrite this README's performance section")
    parser.add_argument("--variants", type=Path, help="and add this dequantize_variants.json's table to it")
    args = parser.parse_args()
    results = json.loads(args.results.read_text())
    variants = json.loads(args.variants.read_text()) if args.variants else None
    if args.readme is None:
        print(header_line(results), dequantize_table(results), "", gemv_table(results), "", crossover_table(results),
              sep="\n")
        return 0
    text = args.readme.read_text()
    if BEGIN not in text or END not in text:
        print(f"report: {args.readme} has no {BEGIN} ... {END} section", file=sys.stderr)
        return 2
    before, rest = text.split(BEGIN, 1)
    after = rest.split(END, 1)[1]
    args.readme.write_text(before + readme_section(results, str(args.results), variants, str(args.variants)) + after)
    return 0


if __name__ == "__main__":
    sys.exit(main())
