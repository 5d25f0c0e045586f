# nf4::gemv at 8 and 16 rows on synthetic layers whose warpgroup team tiles come to a range of fractions of the
# resident CTAs (N = 192 x tiles, NF4, bf16, blocksize 64, plain absmax), the harness's graph timing (16 calls a
# graph); appends {"label", "layer", "times"} lines to argv[1] for ab_summary.py (NOTES gemv row 143b).
# TILES: comma-separated team tile counts; KS: comma-separated K; ROWS: comma-separated rows of x.
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
rows_list = [int(r) for r in os.environ.get("ROWS", "8,16").split(",")]
with open(sys.argv[1], "a") as log:
    for k in (int(v) for v in os.environ.get("KS", "5376").split(",")):
        for tiles in (int(v) for v in os.environ.get("TILES", "100,112,124").split(",")):
            n = 192 * tiles
            weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            count = bk.copies_for(bk.gemv_bytes(n, k, 64, 1))
            inputs = [bnbf.quantize_4bit(weight, blocksize=64, quant_type="nf4") for _ in range(count)]
            times = {}
            for rows in rows_list:
                x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
                run = lambda p, s, x=x: nf4_ops.gemv(x, p, s)  # noqa: E731
                bk.graph_median_us(run, inputs)  # warm-up
                times[f"M{rows}"] = bk.graph_median_us(run, inputs)
            key = f"{n}x{k} ({tiles} tiles)"
            log.write(json.dumps({"label": label, "layer": key, "times": times}) + "\n")
            print(f"{label:7s} {key:24s} " + " ".join(f"{c}: {t:6.2f}" for c, t in times.items()), flush=True)
            del inputs, weight
            torch.cuda.empty_cache()
