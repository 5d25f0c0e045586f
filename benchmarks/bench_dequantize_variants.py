"""Dequantize benchmark over the variants the kernel benchmark leaves out: NF4 and FP4, bf16 / fp16 / fp32 output and
every blocksize, plain and nested absmax, against bitsandbytes' dequantize_4bit, the copy ceiling and a copy of
each layer's own bytes, in one process, on every paper layer shape of 20 MB or more (bytes moved at bf16 output,
blocksize 64). The kernel runs over the flat elements, so layers of the same element count (q and o, gate/up and
down) are timed once, as the first of them.

Method as benchmarks/bench_kernels.py (its graph timing, weight copies rotated past L2, the copy ceiling of a 1 GiB
device-to-device copy, warm-up): each variant changes one thing from the kernel benchmark's NF4 / bf16 / blocksize 64
plain: the quant type and the output dtype at blocksize 64, or the blocksize; nested absmax at every blocksize.

    python benchmarks/bench_dequantize_variants.py [--quick] [--out DIR]

Prints a table last (per variant: the least and the median % of the copy ceiling over the layers, the least speedup
over bitsandbytes, the least and the median % of a same-size copy) and writes DIR/dequantize_variants.json and
DIR/dequantize_variants.png.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import nf4_ops

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernels as bk  # noqa: E402
from report import dequantize_bytes, dequantize_variants_table  # noqa: E402

MIN_MOVED_BYTES = 20_000_000  # the "every paper shape of 20 MB or more" (bf16 output, blocksize 64)
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass(frozen=True)
class Variant:
    quant_type: str
    dtype: torch.dtype
    blocksize: int
    nested: bool

    @property
    def name(self) -> str:
        absmax = "nested" if self.nested else "plain"
        return f"{self.quant_type} {DTYPE_NAMES[self.dtype]} bs{self.blocksize} {absmax}"

    def moved_bytes(self, n: int, k: int) -> int:
        return dequantize_bytes(n, k, self.blocksize, self.nested, self.dtype.itemsize)


def variants() -> list[Variant]:
    """Plain absmax: the quant type and output dtype at blocksize 64, then every other blocksize at NF4 / bf16; nested
    absmax (whose scales the kernel computes itself) at NF4 / bf16 and every blocksize. The kernel benchmark's own
    NF4 / bf16 / blocksize 64 is among them, as the reference point."""
    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    blocksizes = (32, 64, 128, 256, 512, 1024, 2048, 4096)
    return ([Variant(q, d, 64, False) for q in ("nf4", "fp4") for d in dtypes]
            + [Variant("nf4", torch.bfloat16, bs, False) for bs in blocksizes if bs != 64]
            + [Variant("nf4", torch.bfloat16, bs, True) for bs in blocksizes])  # fmt: skip


def bench(layer: bk.Layer, variant: Variant) -> dict[str, float]:
    import bitsandbytes.functional as bnbf

    weight = torch.randn(layer.n, layer.k, device="cuda", dtype=variant.dtype)
    quantized = [bnbf.quantize_4bit(weight, blocksize=variant.blocksize, compress_statistics=variant.nested,
                                    quant_type=variant.quant_type)
                 for _ in range(bk.copies_for(variant.moved_bytes(layer.n, layer.k)))]  # fmt: skip
    with_outputs = bk.dequantize_inputs(quantized, layer, variant.dtype)  # outputs rotated with the inputs
    ours = bk.graph_median_us(lambda p, s, out: nf4_ops.dequantize(p, s, out=out), with_outputs)
    theirs = bk.graph_median_us(lambda p, s, out: bnbf.dequantize_4bit(p, s, out=out), with_outputs)
    del with_outputs
    # the same bits as bitsandbytes (the tests' promise), checked on the first copy
    packed, state = quantized[0]
    if not torch.equal(nf4_ops.dequantize(packed, state, variant.dtype), bnbf.dequantize_4bit(packed, state)):
        raise SystemExit(f"{layer.model} {layer.name} {variant.name}: nf4-ops and bitsandbytes differ")
    del weight, quantized
    torch.cuda.empty_cache()
    return {"nf4ops_us": ours, "bnb_us": theirs}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    copy = results["copy_GBps"]
    names = [v["name"] for v in results["variants"]]
    fig, ax = plt.subplots(figsize=(12, 5))
    for i, v in enumerate(results["variants"]):
        pct = [100 * p["moved_bytes"] / p["nf4ops_us"] / 1e3 / copy for p in v["layers"]]
        ax.scatter([i] * len(pct), pct, s=12, color="tab:blue")
    ax.axhline(90, color="tab:red", linestyle="--", linewidth=1, label="90% (issue target)")
    ax.set_xticks(range(len(names)), names, rotation=70, ha="right", fontsize=7)
    ax.set_ylabel("% of copy ceiling")
    ax.set_title(f"nf4::dequantize variants, paper layers of 20 MB or more ({results['env']['gpu']})")
    ax.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="Llama-3.3-70B's layers only")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--only", nargs="+", default=[], metavar="TEXT",
                        help="only the variants whose name contains every TEXT, e.g. --only bs64 bf16")
    args = parser.parse_args()
    chosen = [v for v in variants() if all(text in v.name for text in args.only)]
    if not chosen:
        parser.error(f"--only {' '.join(args.only)}: no variant's name contains that; names look like "
                     f"'{variants()[0].name}'")
    if not torch.cuda.is_available():
        print("bench_dequantize_variants: needs a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    layers, sizes = [], set()
    for layer in bk.PAPER_LAYERS:
        if (layer.model, layer.n * layer.k) in sizes or (args.quick and layer.model != "llama3.3-70b"):
            continue
        if dequantize_bytes(layer.n, layer.k, 64, False) >= MIN_MOVED_BYTES:
            layers.append(layer)
            sizes.add((layer.model, layer.n * layer.k))
    env = bk.environment()
    print(f"== {env}", flush=True)
    copy_GBps = bk.measure_ceilings()["copy_GBps"]
    print(f"== copy ceiling {copy_GBps:.0f} GB/s", flush=True)
    bk.warm_up(layers[0])
    # what a copy of each layer's bytes reaches (bench_kernels.same_size_copy_us), per output element size: the
    # variants' bytes differ from these by their absmax only (at most ~6%), so their rates are read against them
    same_size = [{"model": layer.model, "layer": layer.name, "out_bytes": out_bytes,
                  "moved_bytes": (nbytes := dequantize_bytes(layer.n, layer.k, 64, False, out_bytes)),
                  **bk.same_size_copy_us(nbytes)}
                 for layer in layers for out_bytes in sorted({v.dtype.itemsize for v in chosen})]  # fmt: skip
    results = {"env": env, "copy_GBps": copy_GBps, "min_graph_calls": bk.min_graph_calls,
               "same_size_copies": same_size, "variants": []}
    for variant in chosen:
        start = time.time()
        points = []
        for layer in layers:
            times = bench(layer, variant)
            points.append({"model": layer.model, "layer": layer.name, "n": layer.n, "k": layer.k,
                           "moved_bytes": variant.moved_bytes(layer.n, layer.k), **times})  # fmt: skip
        results["variants"].append({"name": variant.name, "quant_type": variant.quant_type,
                                    "dtype": DTYPE_NAMES[variant.dtype], "blocksize": variant.blocksize,
                                    "nested": variant.nested, "layers": points})  # fmt: skip
        print(f"[{len(results['variants'])}/{len(chosen)}] {variant.name}: {time.time() - start:.1f}s", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dequantize_variants.json").write_text(json.dumps(results, indent=1))
    plot(results, args.out / "dequantize_variants.png")
    print(f"\nwrote {args.out / 'dequantize_variants.json'} and dequantize_variants.png\n")
    print(f"GPU: {env['gpu']}, driver {env['driver']}, torch {env['torch']}, bitsandbytes {env['bitsandbytes']}; "
          f"copy ceiling {copy_GBps:.0f} GB/s; {len(layers)} layers; graphs of >= {bk.min_graph_calls} calls\n")
    print(dequantize_variants_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
