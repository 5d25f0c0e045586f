# nf4::gemv on the CPU at a few rows of bf16 x against bitsandbytes' matmul_4bit and dequantize + torch's matmul
# (what the op does past kFusedGemvMaxRows), medians of REPEATS calls, one line per layer and row count.
#   python benchmarks/experiments/cpu_gemv_rows.py [N K ...]   (default: 4096 4096 and 3584 1024)
import statistics, sys, time
import torch, bitsandbytes as bnb, bitsandbytes.functional as bnbf
import nf4_ops

REPEATS = 15
shapes = [tuple(map(int, sys.argv[i:i + 2])) for i in range(1, len(sys.argv), 2)] or [(4096, 4096), (3584, 1024)]


def median_ms(fn):
    fn()
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


torch.manual_seed(0)
for n, k in shapes:
    weight = torch.randn(n, k, dtype=torch.bfloat16)
    packed, state = bnbf.quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=True)
    for rows in (1, 2, 4, 8):
        x = torch.randn(rows, k, dtype=torch.bfloat16)
        fused = median_ms(lambda: nf4_ops.gemv(x, packed, state))
        library = median_ms(lambda: bnb.matmul_4bit(x, packed.t(), quant_state=state))
        dense = median_ms(lambda: torch.nn.functional.linear(x.float(), nf4_ops.dequantize(packed, state, torch.float32)))
        print(f"{n}x{k} M{rows}: nf4::gemv {fused:6.2f} ms  bitsandbytes {library:6.2f}  dequantize fp32 + linear "
              f"{dense:6.2f}", flush=True)
