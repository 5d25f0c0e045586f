# nf4::dequantize on the paper layers in four variants (bf16 / fp32 out, plain / nested absmax; NF4, blocksize
# BLOCKSIZE, default 64), the harness's graph timing (16 calls per graph, each call writing its own output: NOTES
# dequantize row 6), with bitsandbytes' time and the copy ceiling beside; appends one JSON line {"label", "layer",
# "times"} per layer to argv[1], the format ab_summary.py reads, so variant_ab.sh can A/B dequantize kernels
# (TIMES_SCRIPT=benchmarks/experiments/dequant_times.py). LAYERS: bench_kernels.layers_named.
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
blocksize = int(os.environ.get("BLOCKSIZE", "64"))
variants = [("bf16", False), ("bf16", True), ("fp32", False), ("fp32", True)]
dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
with open(sys.argv[1], "a") as log:
    for layer in bk.layers_named(os.environ.get("LAYERS", "")):
        weight = torch.randn(layer.n, layer.k, device="cuda", dtype=torch.bfloat16)
        times = {}
        for out_name, nested in variants:
            dtype = dtypes[out_name]
            count = bk.copies_for(bk.dequantize_bytes(layer.n, layer.k, blocksize, nested) * dtype.itemsize // 2)
            quantized = [bnbf.quantize_4bit(weight, blocksize=blocksize, compress_statistics=nested, quant_type="nf4")
                         for _ in range(count)]
            inputs = [(p, s, torch.empty(layer.n, layer.k, device="cuda", dtype=dtype)) for p, s in quantized]
            run = lambda p, s, out: nf4_ops.dequantize(p, s, out=out)  # noqa: E731
            bk.graph_median_us(run, inputs)  # warm-up (the first timing of a process reads slow: NOTES row 5)
            times[f"{out_name} {'nested' if nested else 'plain'}"] = bk.graph_median_us(run, inputs)
            del quantized, inputs
        key = f"{layer.model} {layer.name}"
        log.write(json.dumps({"label": label, "layer": key, "times": times}) + "\n")
        print(f"{label:7s} {key:22s} " + " ".join(f"{v} {t:6.2f}" for v, t in times.items()), flush=True)
        del weight
        torch.cuda.empty_cache()
