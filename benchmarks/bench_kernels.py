"""Kernel benchmark: nf4-ops against bitsandbytes, cuBLAS bf16 and the measured memory ceilings, in one
process, on the linear-layer shapes of Gemma-27B, Qwen3-32B and Llama-3.3-70B.

Method (README.md, Performance): random weights quantized by bitsandbytes; each timed call runs
inside a CUDA graph that cycles through enough weight copies that the working set exceeds L2; CUDA events
around graph replays; the median of the replays, and of that over --rounds passes over every layer (so a
passing slowdown of the GPU, such as one that once put a layer 13% slow in one pass, moves no figure).
Ceilings: a 1 GiB device-to-device copy (bytes read + written, outside a graph) for dequantize, and the best
of a 1 GiB read (torch.sum) and a cuBLAS bf16 GEMV on 28672x8192 for gemv. Beside them, per layer and timed as
its calls are, a copy of the dequantize's bytes (memcpy and an elementwise kernel) and a read of the one-row
gemv's bytes (cuBLAS GEMV and torch.sum): what the GPU's own copies and reads reach at that size, where a call's
start and tail weigh more than at 1 GiB. Each layer's and sweep point's SM clock, temperature and power are
recorded with its times.

    python benchmarks/bench_kernels.py [--quick] [--rounds R] [--min-calls N] [--out DIR]

(--min-calls N: N calls per timed graph, cycling through the copies, or graphs of N copies each replayed in turn
where there are more copies; default 16. With 1 a graph holds one call per copy, which is 2 on the largest layers
and up to 64 on the smallest.)

Prints a table last and writes DIR/kernels.json and DIR/kernels.png.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

import nf4_ops

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import (crossover_table, dequantize_bytes, dequantize_table, gemv_bytes, gemv_table,  # noqa: E402
                    header_line, same_size_read_bytes)

BLOCKSIZE = 64
QUANT_TYPE = "nf4"
ROTATE_BYTES = 3 * 60 * 2**20  # three times the largest L2 here (H200: 60 MB)
MAX_COPIES = 256  # the paper layers need at most 64 (Qwen's k/v gemv, 2.96 MB a call); a multiple of 16
REPLAYS = 25
# The calls a timed graph holds (graph_chains). 1 keeps one graph with one call per input set, so a large layer's
# graph holds 2 calls and a small one's up to 64, and each replay's launch and first call's start weigh up to 32x
# more per call on the large layers (8x with the 16 copies of before session 58; NOTES gemv row 78); 16 gives every
# layer the same chain. Set by --min-calls.
DEFAULT_MIN_GRAPH_CALLS = 16
# Idle seconds before each layer's rows-of-x sweep: the sweep's compute-heavy points (dequantize + cuBLAS at 65-256
# rows) draw ~650 W on an H100 and lower its SM clock to ~1400 MHz, and the next layer's first points then read high
# (Llama's q one row 17.0 / 19.9 us in two suites against 16.2 / 15.5 in their tables, 16.2 after 10 s idle;
# NOTES gemv row 87).
SETTLE_S = 5
min_graph_calls = DEFAULT_MIN_GRAPH_CALLS


@dataclass(frozen=True)
class Layer:
    model: str
    name: str
    n: int  # out_features
    k: int  # in_features


def model_layers(model: str, hidden: int, intermediate: int, q: int, kv: int) -> list[Layer]:
    return [
        Layer(model, "q", q, hidden),
        Layer(model, "kv", kv, hidden),
        Layer(model, "o", hidden, q),
        Layer(model, "gate/up", intermediate, hidden),
        Layer(model, "down", hidden, intermediate),
    ]


PAPER_LAYERS = (
    model_layers("gemma-27b", 5376, 21504, 4096, 2048)
    + model_layers("qwen3-32b", 5120, 25600, 8192, 1024)
    + model_layers("llama3.3-70b", 8192, 28672, 8192, 1024)
)


def layers_named(keys: str) -> list[Layer]:
    """The paper layers whose "model name" keys (e.g. "llama3.3-70b gate/up") are in the comma-separated `keys`, in
    PAPER_LAYERS' order; all of them for an empty string (the experiments' LAYERS variable)."""
    wanted = [key for key in keys.split(",") if key]
    unknown = set(wanted) - {f"{layer.model} {layer.name}" for layer in PAPER_LAYERS}
    if unknown:
        raise ValueError(f"LAYERS: no paper layer named {sorted(unknown)}")
    return [layer for layer in PAPER_LAYERS if not wanted or f"{layer.model} {layer.name}" in wanted]


@dataclass
class Row:
    layer: Layer
    times_us: dict[str, float] = field(default_factory=dict)
    gpu_state: dict[str, float] = field(default_factory=dict)  # right after the layer's last timing (gpu_state)


def graph_chains(input_sets: int, min_calls: int) -> list[list[int]]:
    """Which input sets each timed graph calls fn on, in order (copies_for makes their count a divisor or a multiple
    of min_calls). Up to min_calls sets (or with min_calls 1): one graph that cycles through them until it holds
    min_calls calls. More sets than that (the small layers, whose copies must number up to 64 to exceed
    ROTATE_BYTES): graphs of min_calls sets each, replayed in turn, so that every layer's chain has the same length (a
    replay's launch weighs the same per call) while the sets rotated through still exceed L2; the last graph fills up
    from the first sets, which copies_for's whole graphs never need."""
    if min_calls <= 1 or input_sets <= min_calls:
        return [[i % input_sets for i in range(max(input_sets, min_calls))]]
    return [[(first + i) % input_sets for i in range(min_calls)] for first in range(0, input_sets, min_calls)]


def graph_median_us(fn, inputs: list) -> float:
    """Median time of one fn(*inputs[i]) call over REPLAYS replays of each CUDA graph of graph_chains."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for args in inputs:  # warm-up (lazy init, workspace allocation) outside the graph
            fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    chains = graph_chains(len(inputs), min_graph_calls)
    graphs = []
    for chain in chains:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in chain:
                fn(*inputs[i])
        graph.replay()
        graphs.append(graph)
    torch.cuda.synchronize()
    times = []
    for _ in range(REPLAYS):
        for graph, chain in zip(graphs, chains):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / len(chain))
    del graphs
    return statistics.median(times)


def median_of_rounds(rounds: list[dict[str, float]]) -> dict[str, float]:
    """Each key's median over the rounds' figures."""
    return {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}


def event_median_us(fn, repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def measure_ceilings() -> dict[str, float]:
    """Bandwidths in GB/s, measured now on this GPU."""
    nbytes = 2**30
    src = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_us = event_median_us(lambda: dst.copy_(src))
    sum_us = event_median_us(lambda: src.sum(dtype=torch.float32))
    weight = torch.randn(28672, 8192, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 8192, device="cuda", dtype=torch.bfloat16)
    gemv_us = graph_median_us(lambda: torch.nn.functional.linear(x, weight), [()])
    del src, dst
    return {
        "copy_GBps": 2 * nbytes / copy_us / 1e3,
        "read_sum_GBps": nbytes / sum_us / 1e3,
        "read_cublas_gemv_GBps": weight.numel() * 2 / gemv_us / 1e3,
    }


def warm_up(layer: Layer) -> None:
    """One untimed dequantize timing before the table's: the first timing of a process read ~12% slow
    (Gemma q, H100: 26.1 us, then 23.1 on the same inputs; benchmarks/NOTES.md, dequantize row 5), and so did
    the first after the ceilings' 1 GiB buffers (25.4 us in each of three rounds, Gemma o 22.3)."""
    import bitsandbytes.functional as bnbf

    weight = torch.randn(layer.n, layer.k, device="cuda", dtype=torch.bfloat16)
    quantized = [bnbf.quantize_4bit(weight, blocksize=BLOCKSIZE, quant_type=QUANT_TYPE)
                 for _ in range(copies_for(dequantize_bytes(layer.n, layer.k, BLOCKSIZE, False)))]
    with_outputs = dequantize_inputs(quantized, layer, torch.bfloat16)
    graph_median_us(lambda p, s, out: nf4_ops.dequantize(p, s, out=out), with_outputs)
    del with_outputs
    del weight, quantized
    torch.cuda.empty_cache()


def copies_for(nbytes_per_call: int) -> int:
    """How many copies of a call's inputs to rotate through: enough to move ROTATE_BYTES, at least 2, and a divisor
    or a multiple of min_graph_calls, so that graph_chains' graphs hold every copy equally often and no copy is read
    twice in a row. Until session 58 they were neither: 3, 5, 7 or 13-15 copies cycled through a graph of 16 calls
    ended each replay on copy 0 and began the next on it again, one call in 16 reading from L2 what the call before
    had just read (Llama's q/o: 5 copies of 38 MB); and at most 16 copies left the smallest layers' gemv sets short
    (Qwen's k/v 47 MB, under an H100's 50 MB of L2). The cap now only bounds a tiny shape's memory."""
    copies = max(2, math.ceil(ROTATE_BYTES / max(nbytes_per_call, 1)))
    if min_graph_calls > 1:
        copies = (next(d for d in range(copies, min_graph_calls + 1) if min_graph_calls % d == 0)
                  if copies <= min_graph_calls else -(-copies // min_graph_calls) * min_graph_calls)  # fmt: skip
    return min(MAX_COPIES, copies)


def dequantize_inputs(quantized: list, layer: Layer, dtype: torch.dtype) -> list:
    """(packed, quant_state, out) per weight copy: each copy dequantizes into its own output buffer, so that the
    outputs rotate past L2 with the inputs (copies_for counts them). With a new output per call, which the graph's
    pool handed out at the same address every time, the k/v layers' 10-22 MB outputs stayed partly in L2 between
    calls and read up to 112% of the copy ceiling (NOTES dequantize row 6)."""
    return [(p, s, torch.empty(layer.n, layer.k, device="cuda", dtype=dtype)) for p, s in quantized]


def same_size_copy_us(nbytes: int) -> dict[str, float]:
    """What copying nbytes (nbytes / 2 read, nbytes / 2 written) takes in the same chain of calls as a dequantize
    that moves nbytes, with as many buffer pairs as it has weight copies: as a memcpy (copy_) and as an elementwise
    kernel (mul by 1, exact). At small sizes a call's start and tail weigh more than in the 1 GiB copy of the ceiling,
    for every kernel; this says how much, so that a layer can also be read against a copy of its own size (NOTES
    dequantize row 8). The report takes the faster of the two."""
    half = -(-nbytes // 4) * 2  # bytes each side, a whole number of bf16 values
    pairs = [(torch.empty(half // 2, device="cuda", dtype=torch.bfloat16).normal_(),
              torch.empty(half // 2, device="cuda", dtype=torch.bfloat16)) for _ in range(copies_for(nbytes))]
    times = {"copy_same_bytes_memcpy": graph_median_us(lambda src, dst: dst.copy_(src), pairs),
             "copy_same_bytes_kernel": graph_median_us(lambda src, dst: torch.mul(src, 1, out=dst), pairs)}
    del pairs
    return times  # fmt: skip


def same_size_read_us(layer: Layer, nbytes: int) -> dict[str, float]:
    """What reading about nbytes takes in the same chain of calls as the one-row gemv that reads them, with as many
    copies: cuBLAS's bf16 GEMV on a [rows, K] weight (K the layer's) and a torch.sum of a bf16 vector, the two
    reads of the read ceiling (same_size_read_bytes gives each one's bytes; the report takes the faster rate)."""
    read_bytes = same_size_read_bytes(layer.k, nbytes)
    x = torch.randn(1, layer.k, device="cuda", dtype=torch.bfloat16)
    weights = [(torch.randn(read_bytes["read_same_bytes_gemv"] // (2 * layer.k), layer.k, device="cuda",
                            dtype=torch.bfloat16),) for _ in range(copies_for(nbytes))]
    vectors = [(torch.randn(read_bytes["read_same_bytes_sum"] // 2, device="cuda", dtype=torch.bfloat16),)
               for _ in range(copies_for(nbytes))]
    times = {"read_same_bytes_gemv": graph_median_us(lambda w: torch.nn.functional.linear(x, w), weights),
             "read_same_bytes_sum": graph_median_us(lambda v: v.sum(dtype=torch.float32), vectors)}
    del weights, vectors
    return times  # fmt: skip


def bench_layer(layer: Layer, row_counts: list[int], bnb) -> Row:
    import bitsandbytes.functional as bnbf

    row = Row(layer)
    weight = torch.randn(layer.n, layer.k, device="cuda", dtype=torch.bfloat16)
    for nested in (False, True):
        tag = "nested" if nested else "plain"
        count = copies_for(dequantize_bytes(layer.n, layer.k, BLOCKSIZE, nested))
        quantized = [
            bnbf.quantize_4bit(weight, blocksize=BLOCKSIZE, compress_statistics=nested, quant_type=QUANT_TYPE)
            for _ in range(count)
        ]
        with_outputs = dequantize_inputs(quantized, layer, torch.bfloat16)
        row.times_us[f"nf4ops_dequant_{tag}"] = graph_median_us(
            lambda p, s, out: nf4_ops.dequantize(p, s, out=out), with_outputs
        )
        row.times_us[f"bnb_dequant_{tag}"] = graph_median_us(
            lambda p, s, out: bnbf.dequantize_4bit(p, s, out=out), with_outputs
        )
        del with_outputs
        if not nested:  # what a copy of the same bytes takes, in the same chain (same_size_copy_us)
            row.times_us.update(same_size_copy_us(dequantize_bytes(layer.n, layer.k, BLOCKSIZE, False)))
        if nested:  # one row of bf16 x on nested absmax (bnb_4bit_use_double_quant), against bitsandbytes' too
            count = copies_for(gemv_bytes(layer.n, layer.k, BLOCKSIZE, 1))
            quantized = quantized[:count] + [
                bnbf.quantize_4bit(weight, blocksize=BLOCKSIZE, compress_statistics=True, quant_type=QUANT_TYPE)
                for _ in range(count - len(quantized))
            ]
            x = torch.randn(1, layer.k, device="cuda", dtype=torch.bfloat16)
            row.times_us["nf4ops_gemv_M1_nested"] = graph_median_us(lambda p, s: nf4_ops.gemv(x, p, s), quantized)
            row.times_us["bnb_gemv_M1_nested"] = graph_median_us(
                lambda p, s: bnb.matmul_4bit(x, p.t(), quant_state=s), quantized
            )
            continue
        for rows in row_counts:
            count = copies_for(gemv_bytes(layer.n, layer.k, BLOCKSIZE, rows))
            quantized = quantized[:count] + [
                bnbf.quantize_4bit(weight, blocksize=BLOCKSIZE, quant_type=QUANT_TYPE)
                for _ in range(count - len(quantized))
            ]
            x = torch.randn(rows, layer.k, device="cuda", dtype=torch.bfloat16)
            row.times_us[f"nf4ops_gemv_M{rows}"] = graph_median_us(
                lambda p, s: nf4_ops.gemv(x, p, s), quantized
            )
            row.times_us[f"bnb_gemv_M{rows}"] = graph_median_us(
                lambda p, s: bnb.matmul_4bit(x, p.t(), quant_state=s), quantized
            )
            dense = [(weight.clone(),) for _ in range(copies_for(layer.n * layer.k * 2))]
            row.times_us[f"cublas_gemv_M{rows}"] = graph_median_us(
                lambda w: torch.nn.functional.linear(x, w), dense
            )
            del dense
            if rows == 1:
                # what a read of the same bytes takes (same_size_read_us)
                row.times_us.update(same_size_read_us(layer, gemv_bytes(layer.n, layer.k, BLOCKSIZE, 1)))
                # HF's default compute dtype is fp32: one row of fp32 x, against bitsandbytes' too
                x32 = x.float()
                row.times_us["nf4ops_gemv_M1_fp32x"] = graph_median_us(
                    lambda p, s: nf4_ops.gemv(x32, p, s), quantized
                )
                row.times_us["bnb_gemv_M1_fp32x"] = graph_median_us(
                    lambda p, s: bnb.matmul_4bit(x32, p.t(), quant_state=s), quantized
                )
    row.gpu_state = gpu_state()
    del weight
    torch.cuda.empty_cache()
    return row


# One layer from each size band of kManyRowsGemvRowLimits (csrc/ops.h: under 5 MiB, 5-16 and from 16 MiB packed;
# Llama's gate/up too, the largest), and the rows on either side of the limits of both memory classes (16 for one
# tensor-core launch, 32, 64 and 96 for the many-rows kernel; 33, 40 and 65 where the last rows of x take a launch of
# their own, kManyRowsTailRowLimits).
CROSSOVER_LAYERS = [Layer("llama3.3-70b", "gate/up", 28672, 8192), Layer("llama3.3-70b", "q", 8192, 8192),
                    Layer("gemma-27b", "q", 4096, 5376), Layer("llama3.3-70b", "kv", 1024, 8192)]  # fmt: skip
CROSSOVER_ROWS = [1, 2, 4, 8, 12, 16, 17, 24, 32, 33, 40, 48, 64, 65, 96, 97, 128, 256]


def bench_crossover(layer: Layer, row_counts: list[int], bnb) -> list[dict]:
    """nf4::gemv (which picks its fused kernel or dequantize + cuBLAS by the rows of x), the two paths it
    chooses between (dequantize into a preallocated buffer + cuBLAS), bitsandbytes and cuBLAS bf16, for
    each row count: the curve that checks kManyRowsGemvRowLimits."""
    import bitsandbytes.functional as bnbf

    weight = torch.randn(layer.n, layer.k, device="cuda", dtype=torch.bfloat16)
    most = copies_for(gemv_bytes(layer.n, layer.k, BLOCKSIZE, min(row_counts)))
    all_quantized = [bnbf.quantize_4bit(weight, blocksize=BLOCKSIZE, quant_type=QUANT_TYPE) for _ in range(most)]
    dense = [(weight.clone(),) for _ in range(copies_for(layer.n * layer.k * 2))]
    buffer = torch.empty_like(weight)
    out = []
    for rows in row_counts:
        quantized = all_quantized[: copies_for(gemv_bytes(layer.n, layer.k, BLOCKSIZE, rows))]
        x = torch.randn(rows, layer.k, device="cuda", dtype=torch.bfloat16)

        def dequantize_then_cublas(p, s):
            nf4_ops.dequantize(p, s, torch.bfloat16, out=buffer)
            return torch.nn.functional.linear(x, buffer)

        out.append({"rows": rows, "times_us": {
            "nf4ops_gemv": graph_median_us(lambda p, s: nf4_ops.gemv(x, p, s), quantized),
            "nf4ops_dequantize_cublas": graph_median_us(dequantize_then_cublas, quantized),
            "bnb": graph_median_us(lambda p, s: bnb.matmul_4bit(x, p.t(), quant_state=s), quantized),
            "cublas_bf16": graph_median_us(lambda w: torch.nn.functional.linear(x, w), dense),
        }, "gpu_state": gpu_state()})  # fmt: skip
    del all_quantized, dense, buffer, weight
    torch.cuda.empty_cache()
    return out


def plot_crossover(curves: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = min(2, len(curves))
    grid_rows = -(-len(curves) // columns)
    fig, axes = plt.subplots(grid_rows, columns, figsize=(7 * columns, 4.5 * grid_rows), squeeze=False)
    for ax, curve in zip(axes.flat, curves):
        ms = [p["rows"] for p in curve["points"]]
        for key, label in [("nf4ops_gemv", "nf4::gemv"), ("nf4ops_dequantize_cublas", "nf4 dequantize + cuBLAS"),
                           ("bnb", "bitsandbytes matmul_4bit"), ("cublas_bf16", "cuBLAS bf16")]:  # fmt: skip
            ax.plot(ms, [p["times_us"][key] for p in curve["points"]], marker="o", ms=3, label=label)
        lay = curve["layer"]
        ax.set_title(f"{lay['model']} {lay['name']} {lay['n']}x{lay['k']}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("rows of x (M)")
        ax.set_ylabel("µs")
        ax.legend(fontsize=8)
    fig.suptitle(f"{torch.cuda.get_device_name()}: time against rows of x (NF4, blocksize {BLOCKSIZE}, bf16)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot(rows: list[Row], ceilings: dict[str, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r.layer.model}\n{r.layer.name}" for r in rows]
    copy_ceiling = ceilings["copy_GBps"]
    fig, axes = plt.subplots(2, 1, figsize=(14, 8), sharex=True)
    width = 0.2
    xs = range(len(rows))
    for i, (key, nested, label) in enumerate([
        ("nf4ops_dequant_plain", False, "nf4-ops plain"), ("bnb_dequant_plain", False, "bnb plain"),
        ("nf4ops_dequant_nested", True, "nf4-ops nested"), ("bnb_dequant_nested", True, "bnb nested"),
    ]):  # fmt: skip
        pct = [100 * dequantize_bytes(r.layer.n, r.layer.k, BLOCKSIZE, nested) / r.times_us[key] / 1e3 / copy_ceiling
               for r in rows]
        axes[0].bar([x + (i - 1.5) * width for x in xs], pct, width, label=label)
    axes[0].set_ylabel("dequantize, % of copy ceiling")
    axes[0].axhline(100, color="k", lw=0.5)
    axes[0].legend(ncol=4)
    for i, (prefix, label) in enumerate([("nf4ops", "nf4-ops"), ("bnb", "bnb"), ("cublas", "cuBLAS bf16")]):
        axes[1].bar([x + (i - 1) * width for x in xs], [r.times_us[f"{prefix}_gemv_M1"] for r in rows], width,
                    label=label)
    axes[1].set_ylabel("M=1 GEMV time, us")
    axes[1].set_yscale("log")
    axes[1].legend(ncol=3)
    axes[1].set_xticks(list(xs), labels, fontsize=7)
    fig.suptitle(f"{torch.cuda.get_device_name()}: nf4-ops vs bitsandbytes (NF4, blocksize {BLOCKSIZE}, bf16)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="Llama-3.3-70B's layers only")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16], help="rows of x for gemv")
    parser.add_argument("--no-crossover", action="store_true", help="skip the rows-of-x sweep")
    parser.add_argument("--rounds", type=int, default=3,
                        help="passes over the layers (and ceilings); the tables take each figure's median over them")
    parser.add_argument("--min-calls", type=int, default=DEFAULT_MIN_GRAPH_CALLS,
                        help=f"calls per timed graph, cycling through the weight copies, or graphs of that many copies "
                        f"replayed in turn where there are more (default {DEFAULT_MIN_GRAPH_CALLS}; 1: one graph, one "
                        f"call per copy, 2-64 by layer size)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds: expected at least 1, got {args.rounds}")
    if args.min_calls < 1:
        parser.error(f"--min-calls: expected at least 1, got {args.min_calls}")
    global min_graph_calls
    min_graph_calls = args.min_calls
    if not torch.cuda.is_available():
        print("bench_kernels: needs a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    import bitsandbytes as bnb

    layers = [l for l in PAPER_LAYERS if l.model == "llama3.3-70b"] if args.quick else PAPER_LAYERS
    env = environment()
    print(f"== {env}", flush=True)
    ceiling_rounds, row_rounds = [], []
    for round_index in range(args.rounds):
        ceiling_rounds.append(measure_ceilings())
        print(f"== round {round_index + 1}/{args.rounds}, ceilings (GB/s): {ceiling_rounds[-1]}", flush=True)
        warm_up(layers[0])  # after the ceilings: the first timing after them read slow in every round (Gemma q)
        row_rounds.append([])
        for i, layer in enumerate(layers):
            start = time.time()
            row_rounds[-1].append(bench_layer(layer, args.rows, bnb))
            print(f"[{i + 1}/{len(layers)}] {layer.model} {layer.name} {layer.n}x{layer.k}: "
                  f"{time.time() - start:.1f}s, then {row_rounds[-1][-1].gpu_state}", flush=True)
    ceilings = median_of_rounds(ceiling_rounds)
    rows = [Row(passes[0].layer, median_of_rounds([r.times_us for r in passes])) for passes in zip(*row_rounds)]
    curves = []
    for layer in [] if args.no_crossover else CROSSOVER_LAYERS:
        time.sleep(SETTLE_S)
        start = time.time()
        curves.append({"layer": asdict(layer), "points": bench_crossover(layer, CROSSOVER_ROWS, bnb)})
        clocks = [p["gpu_state"]["sm_mhz"] for p in curves[-1]["points"] if "sm_mhz" in p["gpu_state"]]
        print(f"[crossover] {layer.model} {layer.name}: {time.time() - start:.1f}s, SM clock "
              f"{min(clocks, default=0):.0f}-{max(clocks, default=0):.0f} MHz", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"env": env, "rounds": args.rounds, "min_graph_calls": min_graph_calls, "ceilings_GBps": ceilings,
               "ceilings_GBps_rounds": ceiling_rounds, "blocksize": BLOCKSIZE, "quant_type": QUANT_TYPE,
               "rows": [{"layer": asdict(r.layer), "times_us": r.times_us,
                         "times_us_rounds": [p.times_us for p in passes],
                         "gpu_state_rounds": [p.gpu_state for p in passes]}
                        for r, passes in zip(rows, zip(*row_rounds))],
               "crossover": curves}  # fmt: skip
    (args.out / "kernels.json").write_text(json.dumps(results, indent=1))
    plot(rows, ceilings, args.out / "kernels.png")
    if curves:
        plot_crossover(curves, args.out / "crossover.png")
    print(f"\nwrote {args.out / 'kernels.json'} and the plots in {args.out}\n")
    print(header_line(results), "", dequantize_table(results), "", gemv_table(results), "",
          crossover_table(results), sep="\n")
    return 0


def environment() -> dict[str, str]:
    """What a run's results were measured with: the GPU, its driver, torch, CUDA, bitsandbytes, the command."""
    import bitsandbytes as bnb

    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "bitsandbytes": bnb.__version__, "driver": _driver_version(), "command": " ".join(sys.argv)}  # fmt: skip


def gpu_state() -> dict[str, float]:
    """The GPU's SM clock (MHz), temperature (C) and power draw (W) now, right after a timing, as nvidia-smi reads
    them (empty where it cannot): recorded beside each layer's and each sweep point's times, so that a figure taken
    at a lowered clock shows as such (the q layers' sweep once read 8-28% above their table rows)."""
    values = _nvidia_smi("clocks.sm", "temperature.gpu", "power.draw")
    try:
        return dict(zip(("sm_mhz", "temp_c", "power_w"), map(float, values))) if values else {}
    except ValueError:  # "[N/A]" where the GPU does not report one
        return {}


def _driver_version() -> str:
    values = _nvidia_smi("driver_version")
    return values[0] if values else "unknown"


def _nvidia_smi(*fields: str) -> list[str] | None:
    """nvidia-smi's values of `fields` for this process's GPU (found by its PCI address: nvidia-smi's own indices
    ignore CUDA_VISIBLE_DEVICES), or None where nvidia-smi cannot answer."""
    import subprocess

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    pci = f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
    try:
        line = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits",
                               f"--id={pci}"], capture_output=True, text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    values = [v.strip() for v in line.split(",")]
    return values if len(values) == len(fields) else None


if __name__ == "__main__":
    sys.exit(main())
