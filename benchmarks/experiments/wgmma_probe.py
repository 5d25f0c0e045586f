# (experiment, NOTES gemv row 98) Builds wgmma_probe.cu for sm_90a, checks it against nf4::gemv (the tree) on every
# paper layer at ROWS rows of bf16 x, then times both the benchmark's way (graph of 16 calls over weight copies
# rotated past L2). Run from the repository root on the GPU machine, with the package built and bitsandbytes on the
# path: python benchmarks/experiments/wgmma_probe.py OUT.jsonl
import json, os, sys
sys.path.insert(0, "benchmarks")
import torch, bitsandbytes.functional as bnbf
from torch.utils import cpp_extension
import bench_kernels as bk, nf4_ops

flags = os.environ.get("WG_FLAGS", "").split()
probe = cpp_extension.load(name="wgmma_probe" + str(abs(hash(tuple(flags))) % 10000),
                           sources=["benchmarks/experiments/wgmma_probe.cu"], extra_include_paths=["csrc"],
                           extra_cuda_cflags=["-O3", "-std=c++20", "-gencode=arch=compute_90a,code=sm_90a"] + flags,
                           verbose=False)
bk.min_graph_calls = 16
rows_list = [int(r) for r in os.environ.get("ROWS", "4,8,16").split(",")]
layers = [l for l in bk.PAPER_LAYERS if l.n % 64 == 0 and l.k % 256 == 0]
only = os.environ.get("LAYERS")
if only:
    layers = [l for l in layers if f"{l.model} {l.name}" in only.split(",")]
log = open(sys.argv[1], "a")
for layer in layers:
    weight = torch.randn(layer.n, layer.k, device="cuda", dtype=torch.bfloat16)
    count = bk.copies_for(bk.gemv_bytes(layer.n, layer.k, 64, 1))
    quantized = [bnbf.quantize_4bit(weight, blocksize=64, quant_type="nf4") for _ in range(count)]
    times = {}
    for m in rows_list:
        x = torch.randn(m, layer.k, device="cuda", dtype=torch.bfloat16)
        p, s = quantized[0]
        ref = nf4_ops.gemv(x, p, s).float()
        out = torch.zeros(m, layer.n, device="cuda", dtype=torch.float32)
        probe.wg_gemv_add(x, p, s.absmax, layer.n, layer.k, out)
        torch.cuda.synchronize()
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        outs = [torch.empty(m, layer.n, device="cuda", dtype=torch.float32) for _ in quantized]
        tree = bk.graph_median_us(lambda p, s: nf4_ops.gemv(x, p, s), quantized)
        wg = bk.graph_median_us(lambda p, s, o: probe.wg_gemv_add(x, p, s.absmax, layer.n, layer.k, o),
                                [(p, s, o) for (p, s), o in zip(quantized, outs)])
        times[m] = {"tree": tree, "wg": wg, "max_err_rel": err}
        print(f"{layer.model:13s} {layer.name:8s} M{m:<3d} tree {tree:7.2f} us  wgmma {wg:7.2f} us ({wg / tree - 1:+.0%})"
              f"  max |wg - tree| / max |tree| {err:.1e}", flush=True)
    log.write(json.dumps({"layer": f"{layer.model} {layer.name}", "flags": flags, "times": times}) + "\n")
    del weight, quantized
    torch.cuda.empty_cache()
