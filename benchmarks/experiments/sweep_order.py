"""Probe of the benchmark (NOTES gemv row 87): Llama q at 1, 2, 16 rows fresh, after Llama gate/up's crossover sweep,
after 10 s idle, each with the SM clock. From the repository root on a GPU: python benchmarks/experiments/sweep_order.py OUT.json"""
import sys, time, json
sys.path.insert(0, "benchmarks")
import torch
import bitsandbytes as bnb
import bench_kernels as bk

q = bk.Layer("llama3.3-70b", "q", 8192, 8192)
gate = bk.Layer("llama3.3-70b", "gate/up", 28672, 8192)
ROWS = [1, 2, 16]
out = {}
def probe(tag):
    pts = bk.bench_crossover(q, ROWS, bnb)
    out[tag] = pts
    for p in pts:
        t = p["times_us"]
        print(f"{tag:12} M={p['rows']:3} nf4 {t['nf4ops_gemv']:6.1f} bnb {t['bnb']:6.1f} cublas {t['cublas_bf16']:6.1f} "
              f"deq+cublas {t['nf4ops_dequantize_cublas']:6.1f} state {p['gpu_state']}", flush=True)
print("idle state", bk.gpu_state())
probe("fresh")
probe("fresh-again")
start = time.time()
sweep = bk.bench_crossover(gate, bk.CROSSOVER_ROWS, bnb)
print(f"gate/up sweep {time.time()-start:.1f}s, states", [p["gpu_state"].get("sm_mhz") for p in sweep], flush=True)
probe("after-gate")
time.sleep(10)
probe("after-idle")
json.dump(out, open(sys.argv[1], "w"), indent=1)
