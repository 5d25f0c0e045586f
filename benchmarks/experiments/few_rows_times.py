# nf4::gemv at several row counts of bf16 x on every paper layer (the harness's graph timing, 16 calls per graph),
# for benchmarks/experiments/few_rows.sh; appends one JSON line {"label", "layer", "times"} per layer to argv[1].
# LAYERS: bench_kernels.layers_named.
import sys, json, os
sys.path.insert(0, "benchmarks")
import torch, bitsandbytes.functional as bnbf
import bench_kernels as bk, nf4_ops
bk.min_graph_calls = 16
label = sys.argv[2]
row_counts = [int(r) for r in os.environ.get("ROWS", "1,3,8,9,16").split(",")]
with open(sys.argv[1], "a") as log:
    for layer in bk.layers_named(os.environ.get("LAYERS", "")):
        weight = torch.randn(layer.n, layer.k, device="cuda", dtype=torch.bfloat16)
        count = bk.copies_for(bk.gemv_bytes(layer.n, layer.k, bk.BLOCKSIZE, 1))
        quantized = [bnbf.quantize_4bit(weight, blocksize=bk.BLOCKSIZE, quant_type="nf4") for _ in range(count)]
        bk.graph_median_us(lambda p, s: nf4_ops.dequantize(p, s, torch.bfloat16), quantized)  # warm-up
        times = {}
        for rows in row_counts:
            x = torch.randn(rows, layer.k, device="cuda", dtype=torch.bfloat16)
            times[rows] = bk.graph_median_us(lambda p, s: nf4_ops.gemv(x, p, s), quantized)
        key = f"{layer.model} {layer.name}"
        log.write(json.dumps({"label": label, "layer": key, "times": times}) + "\n")
        print(f"{label:5s} {key:22s} " + " ".join(f"M{r} {t:6.2f}" for r, t in times.items()), flush=True)
        del weight, quantized
        torch.cuda.empty_cache()
