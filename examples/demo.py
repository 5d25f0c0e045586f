"""Demo: one linear layer quantized by bitsandbytes, run through nf4-ops and through bitsandbytes.

Shows that nf4::dequantize is bit-exact with bitsandbytes and that nf4::gemv matches F.linear on the
dequantized weight, then times both libraries on whatever device is here (a GPU shows the speedup; on a
CPU the numbers are the CPU kernels', not the point of the project).

    python examples/demo.py [--shape N K] [--rows M]   (default: Llama-3.3-70B's o projection, 8192x8192)
"""

import argparse
import statistics
import time

import bitsandbytes as bnb
import bitsandbytes.functional as bnbf
import torch

import nf4_ops


def median_ms(fn, device, repeats):
    fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", type=int, nargs=2, default=None, metavar=("N", "K"))
    parser.add_argument("--rows", type=int, default=1, help="rows of x (tokens) for the matmul")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n, k = args.shape or ((8192, 8192) if device == "cuda" else (4096, 4096))
    repeats = 50 if device == "cuda" else 5
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}; layer {n}x{k}, NF4, "
          f"blocksize 64, nested absmax, bf16; bitsandbytes {bnb.__version__}, torch {torch.__version__}")

    weight = torch.randn(n, k, dtype=torch.bfloat16).to(device)
    packed, state = bnbf.quantize_4bit(weight, blocksize=64, compress_statistics=True, quant_type="nf4")
    x = torch.randn(args.rows, k, dtype=torch.bfloat16, device=device)

    ours = nf4_ops.dequantize(packed, state)
    theirs = bnbf.dequantize_4bit(packed, state)
    exact = torch.equal(ours, theirs)
    y = nf4_ops.gemv(x, packed, state)
    y_ref = torch.nn.functional.linear(x.double(), theirs.double())
    rel = ((y.double() - y_ref).norm() / y_ref.norm()).item()
    print(f"dequantize bit-exact with bitsandbytes: {exact}")
    print(f"gemv vs float64 F.linear on the dequantized weight: relative error {rel:.2e}")

    rows = [
        ("dequantize", lambda: nf4_ops.dequantize(packed, state), lambda: bnbf.dequantize_4bit(packed, state)),
        (f"matmul, {args.rows} row(s)", lambda: nf4_ops.gemv(x, packed, state),
         lambda: bnb.matmul_4bit(x, packed.t(), quant_state=state)),
    ]  # fmt: skip
    print(f"\n| op | nf4-ops ms | bitsandbytes ms | speedup |\n|---|---|---|---|")
    for name, ours_fn, theirs_fn in rows:
        t_ours, t_theirs = median_ms(ours_fn, device, repeats), median_ms(theirs_fn, device, repeats)
        print(f"| {name} | {t_ours:.3f} | {t_theirs:.3f} | {t_theirs / t_ours:.2f}x |")
    if device == "cpu":
        print("\n(CPU timings; the kernels this project tunes run on NVIDIA GPUs: see README, Performance.)")
    raise SystemExit(0 if exact else 1)


if __name__ == "__main__":
    main()
