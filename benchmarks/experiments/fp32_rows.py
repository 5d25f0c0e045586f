"""fp32 x (HF's default compute dtype) at 1-16 rows: nf4::gemv against bitsandbytes' matmul_4bit on the same
fp32 x, the two paths nf4::gemv chooses between for fp32 x (a one-row call per row of x, and dequantize to fp32 +
cuBLAS), and nf4::gemv on bf16 x, on a few paper layers. Same method as benchmarks/bench_kernels.py (CUDA graphs
over rotated weight copies quantized by bitsandbytes, medians of replays).

    python benchmarks/experiments/fp32_rows.py [--rows 1 2 4 8 9 16] [--small] [--nested]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import nf4_ops

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_kernels import BLOCKSIZE, PAPER_LAYERS, QUANT_TYPE, copies_for, graph_median_us  # noqa: E402
from report import gemv_bytes  # noqa: E402

LAYERS = [("llama3.3-70b", "gate/up"), ("llama3.3-70b", "q"), ("qwen3-32b", "q"), ("llama3.3-70b", "kv"),
          ("qwen3-32b", "kv"), ("gemma-27b", "q"), ("gemma-27b", "kv")]


def main() -> None:
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbf

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 8, 9, 16])
    parser.add_argument("--small", action="store_true", help="the layers under 16 MiB of packed W only")
    parser.add_argument("--nested", action="store_true", help="nested absmax (bnb_4bit_use_double_quant)")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, bitsandbytes {bnb.__version__}, {'nested' if args.nested else 'plain'} absmax")
    print("| layer | M | nf4 fp32 us | bnb fp32 us | nf4 vs bnb | a one-row call per row us | dequantize + cuBLAS us "
          "| nf4 bf16 us |")
    print("|---|---|---|---|---|---|---|---|")
    for layer in (lay for lay in PAPER_LAYERS if (lay.model, lay.name) in LAYERS):
        if args.small and layer.n * layer.k // 2 >= 16 * 2**20:
            continue
        weight = torch.randn(layer.n, layer.k, device="cuda", dtype=torch.bfloat16)
        count = copies_for(gemv_bytes(layer.n, layer.k, BLOCKSIZE, 1))
        quantized = [bnbf.quantize_4bit(weight, blocksize=BLOCKSIZE, quant_type=QUANT_TYPE,
                                        compress_statistics=args.nested) for _ in range(count)]  # fmt: skip
        for rows in args.rows:
            x = torch.randn(rows, layer.k, device="cuda", dtype=torch.bfloat16)
            x32 = x.float()
            ours = graph_median_us(lambda p, s: nf4_ops.gemv(x32, p, s), quantized)
            theirs = graph_median_us(lambda p, s: bnb.matmul_4bit(x32, p.t(), quant_state=s), quantized)
            per_row = graph_median_us(lambda p, s: [nf4_ops.gemv(x32[m : m + 1], p, s) for m in range(rows)], quantized)
            dense = graph_median_us(
                lambda p, s: torch.nn.functional.linear(x32, nf4_ops.dequantize(p, s, torch.float32)), quantized
            )
            bf16 = graph_median_us(lambda p, s: nf4_ops.gemv(x, p, s), quantized)
            cells = [f"{layer.model} {layer.name}", str(rows), f"{ours:.1f}", f"{theirs:.1f}", f"{theirs / ours:.2f}x",
                     f"{per_row:.1f}", f"{dense:.1f}", f"{bf16:.1f}"]
            print("| " + " | ".join(cells) + " |", flush=True)
        del weight, quantized
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
