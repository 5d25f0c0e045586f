# Which kernels (instance, grid, block) one nf4::gemv call launches, per paper layer and row count of bf16 x, from
# the profiler's trace: to check which path a rule picks on this GPU. LAYERS (bench_kernels.layers_named), ROWS.
#   LAYERS="llama3.3-70b kv" ROWS=9,16 python3 benchmarks/experiments/launched_kernels.py
import json, os, sys, tempfile
sys.path.insert(0, "benchmarks")
import torch, bitsandbytes.functional as bnbf
import bench_kernels as bk, nf4_ops
trace = os.path.join(tempfile.mkdtemp(), "trace.json")
for layer in bk.layers_named(os.environ.get("LAYERS", "")):
    weight = torch.randn(layer.n, layer.k, device="cuda", dtype=torch.bfloat16)
    packed, state = bnbf.quantize_4bit(weight, blocksize=bk.BLOCKSIZE, quant_type="nf4")
    for rows in [int(r) for r in os.environ.get("ROWS", "1,8,9,16").split(",")]:
        x = torch.randn(rows, layer.k, device="cuda", dtype=torch.bfloat16)
        nf4_ops.gemv(x, packed, state)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            nf4_ops.gemv(x, packed, state)
            torch.cuda.synchronize()
        profile.export_chrome_trace(trace)
        for e in json.load(open(trace))["traceEvents"]:
            if e.get("cat") == "kernel":
                name = e["name"].replace("(anonymous namespace)::", "").split("(")[0]
                print(f"{layer.model} {layer.name} M{rows}: {name} grid {e['args']['grid']} block {e['args']['block']}")
