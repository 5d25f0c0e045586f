# nf4::gemv on paper layers against fp32 math on the dequantized weight (NF4, bf16 x, blocksize 64, plain absmax):
# prints the largest error relative to the largest output per layer and row count, for timing builds whose launch
# rules only the paper shapes reach (NOTES gemv row 143). LAYERS: bench_kernels.layers_named; ROWS: comma-separated.
import os
import sys

sys.path.insert(0, "benchmarks")
import bitsandbytes.functional as bnbf
import torch

import bench_kernels as bk
import nf4_ops

torch.manual_seed(0)
for layer in bk.layers_named(os.environ.get("LAYERS", "")):
    weight = torch.randn(layer.n, layer.k, device="cuda", dtype=torch.bfloat16)
    packed, state = bnbf.quantize_4bit(weight, blocksize=64, quant_type="nf4")
    dense = bnbf.dequantize_4bit(packed, state).float()
    for rows in (int(r) for r in os.environ.get("ROWS", "8,16").split(",")):
        x = torch.randn(rows, layer.k, device="cuda", dtype=torch.bfloat16)
        got = nf4_ops.gemv(x, packed, state).float()
        want = x.float() @ dense.T
        error = ((got - want).abs().max() / want.abs().max()).item()
        print(f"{layer.model} {layer.name} M{rows}: max error / max output {error:.2e}"
              f" {'ok' if error < 1e-2 else 'WRONG'}", flush=True)
