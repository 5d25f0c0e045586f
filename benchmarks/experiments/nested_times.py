# nf4::gemv and nf4::dequantize with plain and nested absmax on the paper layers (NF4, bf16, blocksize 64 unless a
# case names another), the harness's graph timing (16 calls per graph; dequantize writing a buffer per weight copy,
# NOTES dequantize row 6);
# appends one JSON line {"label", "layer", "times"} per layer to argv[1], the format ab_summary.py reads, so
# variant_ab.sh can A/B a change that touches both ops' start (TIMES_SCRIPT=benchmarks/experiments/nested_times.py).
# CASES: comma-separated "gemv M<rows> plain|nested" / "dq plain|nested", each optionally followed by "bs<blocksize>"
# (default bench_kernels.BLOCKSIZE); LAYERS: bench_kernels.layers_named.
import json
import os
import sys

sys.path.insert(0, "benchmarks")
import bitsandbytes.functional as bnbf
import torch

import bench_kernels as bk
import nf4_ops

bk.min_graph_calls = 16
label = sys.argv[2]
cases = os.environ.get("CASES", "gemv M1 nested,gemv M8 plain,gemv M16 plain,gemv M16 nested,dq plain,dq nested")
cases = [case.split() for case in cases.split(",")]
for case in cases:  # the blocksize last, as an int
    if not case[-1].startswith("bs"):
        case.append(f"bs{bk.BLOCKSIZE}")
    if len(case) < 3 or case[-2] not in ("plain", "nested") or not case[-1][2:].isdigit():
        sys.exit(f"nested_times.py: CASES: expected 'gemv M<rows> plain|nested [bs<N>]' or 'dq plain|nested [bs<N>]', "
                 f"found {' '.join(case)!r}")
with open(sys.argv[1], "a") as log:
    for layer in bk.layers_named(os.environ.get("LAYERS", "")):
        weight = torch.randn(layer.n, layer.k, device="cuda", dtype=torch.bfloat16)
        times = {}
        for nested, blocksize in sorted({(case[-2] == "nested", int(case[-1][2:])) for case in cases}):
            mine = [case for case in cases if (case[-2] == "nested", int(case[-1][2:])) == (nested, blocksize)]
            # enough copies that the gemv's bytes (the fewer) rotate past L2 too
            count = bk.copies_for(bk.gemv_bytes(layer.n, layer.k, blocksize, 1))
            quantized = [bnbf.quantize_4bit(weight, blocksize=blocksize, compress_statistics=nested,
                                            quant_type="nf4") for _ in range(count)]
            for case in mine:
                if case[0] == "dq":
                    inputs = [(p, s, torch.empty(layer.n, layer.k, device="cuda", dtype=torch.bfloat16))
                              for p, s in quantized]
                    run = lambda p, s, out: nf4_ops.dequantize(p, s, out=out)  # noqa: E731
                else:
                    x = torch.randn(int(case[1][1:]), layer.k, device="cuda", dtype=torch.bfloat16)
                    inputs = quantized
                    run = lambda p, s, x=x: nf4_ops.gemv(x, p, s)  # noqa: E731
                bk.graph_median_us(run, inputs)  # warm-up (the first timing of a process reads slow: NOTES row 5)
                times[" ".join(case if case[-1] != f"bs{bk.BLOCKSIZE}" else case[:-1])] = bk.graph_median_us(run, inputs)
            del quantized
        key = f"{layer.model} {layer.name}"
        log.write(json.dumps({"label": label, "layer": key, "times": times}) + "\n")
        print(f"{label:7s} {key:22s} " + " ".join(f"{c}: {t:6.2f}" for c, t in times.items()), flush=True)
        del weight
        torch.cuda.empty_cache()
