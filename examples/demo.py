"""Demo: one linear layer quantized by bitsandbytes, run through nf4-ops and through bitsandbytes.

Shows that nf4::dequantize is bit-exact with bitsandbytes and that nf4::gemv matches F.linear on the
dequantized weight, then times both libraries, and cuBLAS on the unquantized bf16 weight, on whatever device is
here (a GPU shows the speedup; on a CPU the numbers are the CPU kernels', not the point of the project).

On a GPU each call is timed as benchmarks/bench_kernels.py times it: inside a CUDA graph that cycles through
enough copies of the weight to exceed the L2 cache, so that every call reads its weight from memory, as in a
model's forward pass, where each layer's weight is read once per token.

    python examples/demo.py [--shape N K] [--rows M]   (default on a GPU: Llama-3.3-70B's o projection, 8192x8192)
"""

import argparse
import math
import statistics
import time

import bitsandbytes as bnb
import bitsandbytes.functional as bnbf
import torch

import nf4_ops

REPEATS = {"cuda": 50, "cpu": 5}  # timed graph replays (GPU) or calls (CPU); the median is printed


def median_us(fn, inputs: list, device: str) -> float:
    """Median time in µs of one fn(*args) call, args taken from inputs in turn (one set per weight copy)."""
    if device == "cpu":
        fn(*inputs[0])  # warm-up
        times = []
        for i in range(REPEATS["cpu"]):
            start = time.perf_counter()
            fn(*inputs[i % len(inputs)])
            times.append((time.perf_counter() - start) * 1e6)
        return statistics.median(times)
    side = torch.cuda.Stream()  # warm-up (lazy init, workspaces) on a side stream, outside the graph
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for args in inputs:
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for args in inputs:
            fn(*args)
    graph.replay()
    times = []
    for _ in range(REPEATS["cuda"]):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(inputs))
    return statistics.median(times)


MAX_COPIES = 64  # a small layer's copies stay within L2 however many there are; the table's heading says so


def l2_bytes(device: str) -> int:
    return torch.cuda.get_device_properties(device).L2_cache_size if device == "cuda" else 0


def weight_copies(device: str, weight_bytes: int) -> int:
    """How many copies of the weight the timed calls cycle through: on a GPU enough for twice its L2 cache (at most
    MAX_COPIES)."""
    if device == "cpu":
        return 1
    return max(2, min(MAX_COPIES, math.ceil(2 * l2_bytes(device) / weight_bytes)))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", type=int, nargs=2, default=None, metavar=("N", "K"))
    parser.add_argument("--rows", type=int, default=1, help="rows of x (tokens) for the matmul")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n, k = args.shape or ((8192, 8192) if device == "cuda" else (4096, 4096))
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

    # quantizing the same weight again gives the same bytes in new buffers
    copies = weight_copies(device, packed.numel() * packed.element_size())
    quantized = [(packed, state)] + [
        bnbf.quantize_4bit(weight, blocksize=64, compress_statistics=True, quant_type="nf4") for _ in range(copies - 1)
    ]
    with_outputs = [(p, s, torch.empty(n, k, dtype=torch.bfloat16, device=device)) for p, s in quantized]
    dense = [(weight,)] + [(weight.clone(),) for _ in range(weight_copies(device, weight.numel() * 2) - 1)]
    # on a GPU each copy dequantizes into its own output buffer, so that the outputs rotate past L2 too
    # (bitsandbytes has no CPU kernel for an output buffer: there both allocate theirs)
    into = device == "cuda"
    ops = [
        ("dequantize", with_outputs, lambda p, s, out: nf4_ops.dequantize(p, s, out=out if into else None),
         lambda p, s, out: bnbf.dequantize_4bit(p, s, out=out if into else None)),
        (f"matmul, {args.rows} row(s)", quantized, lambda p, s: nf4_ops.gemv(x, p, s),
         lambda p, s: bnb.matmul_4bit(x, p.t(), quant_state=s)),
    ]  # fmt: skip
    copies_bytes = copies * packed.numel() * packed.element_size()
    where = "past" if copies_bytes > l2_bytes(device) else "within"
    how = (f"each call in a CUDA graph cycling through {copies} copies of the packed weight, "
           f"{copies_bytes / 2**20:.1f} MiB, {where} the {l2_bytes(device) / 2**20:.0f} MiB L2 cache"
           if device == "cuda" else "each call timed alone")
    print(f"\nmedian µs per call ({how}):\n")
    print("| op | nf4-ops µs | bitsandbytes µs | speedup |\n|---|---|---|---|")
    for name, inputs, ours_fn, theirs_fn in ops:
        t_ours, t_theirs = median_us(ours_fn, inputs, device), median_us(theirs_fn, inputs, device)
        print(f"| {name} | {t_ours:.1f} | {t_theirs:.1f} | {t_theirs / t_ours:.2f}x |")
    t_dense = median_us(lambda w: torch.nn.functional.linear(x, w), dense, device)
    print(f"\nThe same matmul on the unquantized bf16 weight (F.linear): {t_dense:.1f} µs; "
          f"nf4-ops' speedup over it: {t_dense / t_ours:.2f}x.")
    if device == "cpu":
        print("\n(CPU timings; the kernels this project tunes run on NVIDIA GPUs: see README, Performance.)")
    raise SystemExit(0 if exact else 1)


if __name__ == "__main__":
    main()
