# Why the many-rows kernel reads slower at 17-24 rows than at 32 on the small layers (the suites' rows-of-x sweeps:
# Llama's k/v 13.4 / 12.8 / 10.6 us at 17 / 24 / 32 rows on an H100, alike on an H200): per layer and row count,
# the graph-timed call (the harness's method, 16 calls a graph) and, from the profiler's trace of one call, each
# kernel's duration. LAYERS (bench_kernels.layers_named), ROWS.
#   LAYERS="llama3.3-70b kv" ROWS=16,17,24,32 python3 benchmarks/experiments/many_rows_small.py
import json, os, sys, tempfile
sys.path.insert(0, "benchmarks")
import torch, bitsandbytes.functional as bnbf
import bench_kernels as bk, nf4_ops

bk.min_graph_calls = 16
trace = os.path.join(tempfile.mkdtemp(), "trace.json")
for layer in bk.layers_named(os.environ.get("LAYERS", "")):
    weight = torch.randn(layer.n, layer.k, device="cuda", dtype=torch.bfloat16)
    count = bk.copies_for(bk.gemv_bytes(layer.n, layer.k, bk.BLOCKSIZE, 1))
    quantized = [bnbf.quantize_4bit(weight, blocksize=bk.BLOCKSIZE, quant_type="nf4") for _ in range(count)]
    for rows in [int(r) for r in os.environ.get("ROWS", "16,17,20,24,28,32").split(",")]:
        x = torch.randn(rows, layer.k, device="cuda", dtype=torch.bfloat16)
        run = lambda p, s, x=x: nf4_ops.gemv(x, p, s)  # noqa: E731
        bk.graph_median_us(run, quantized)
        graph_us = bk.graph_median_us(run, quantized)
        durations = []
        for _ in range(3):
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
                run(*quantized[0])
                torch.cuda.synchronize()
            profile.export_chrome_trace(trace)
            durations.append([(e["name"].replace("(anonymous namespace)::", "").split("(")[0].split("<")[0],
                               e["dur"], e["args"]["grid"]) for e in json.load(open(trace))["traceEvents"]
                              if e.get("cat") == "kernel"])
        kernels = "; ".join(f"{name} {grid} " + "/".join(f"{d[i][1]:.1f}" for d in durations)
                            for i, (name, _, grid) in enumerate(durations[0]))
        print(f"{layer.model} {layer.name} M{rows}: graph {graph_us:.1f} us | {kernels}", flush=True)
