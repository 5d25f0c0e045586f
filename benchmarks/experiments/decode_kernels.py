"""Where a decode step's GPU time goes: bench_decode's model (Llama-3.3-70B layer shapes) at one batch size, each
variant's step (compiled with fullgraph unless --eager) run under torch.profiler after warm-up, its kernels summed by
name. Prints per variant: kernels per step, GPU µs per step by group (KERNEL_GROUPS: nf4-ops', bitsandbytes' and
cuBLAS's kernels, the last including the bf16 lm head's and the rotary embedding's small fp32 matmul; the rest, most
of it Inductor's fused kernels, attention and copies), and the top kernels. Inductor names its fused kernels after the
ops they hold (`triton_..._gemv_mul_silu`), so those count as "other" whatever their names contain. Profiled calls
are not graph replays, so the gaps between kernels are the host's; the kernel durations are the GPU's.

    python benchmarks/experiments/decode_kernels.py [--batch 1] [--layers 2] [--eager] [--steps 5]
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import nf4_ops  # noqa: E402
from bench_decode import VARIANTS, build_models, prefilled_step_inputs  # noqa: E402

# (group, words in a kernel's name): the first group with a word in the name takes it; "other" takes the rest
KERNEL_GROUPS = (("nf4-ops", ("nf4::",)), ("bitsandbytes", ("gemm_4bit", "kDequantize", "kgemm_4bit")),
                 ("cuBLAS", ("nvjet", "cublas", "cutlass", "xmma", "gemm")))  # fmt: skip


def kernel_group(name: str) -> str:
    if name.startswith("triton_"):  # Inductor's, named after the ops it fused
        return "other"
    return next((group for group, words in KERNEL_GROUPS if any(word in name for word in words)), "other")


def profile_steps(model, config, args) -> torch.profiler.profile:
    """args.steps decode steps after a prefill and 3 warm-up steps, as bench_decode runs them (a static cache, the
    prefill eager), under torch.profiler."""
    torch._dynamo.reset()
    forward = model if args.eager else torch.compile(model, fullgraph=True)
    with torch.no_grad():
        kwargs = prefilled_step_inputs(model, config, args.batch, args.prompt, args.context, "cuda")
        for _ in range(3):
            forward(**kwargs)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            for _ in range(args.steps):
                forward(**kwargs)
            torch.cuda.synchronize()
    return profile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5, help="profiled steps (times are per step)")
    parser.add_argument("--eager", action="store_true", help="eager ops (default: compiled with fullgraph)")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    if args.prompt + 3 + args.steps > args.context:  # the static cache takes one position per call (bench_decode)
        parser.error(f"--context {args.context} holds fewer than the prompt and the {3 + args.steps} steps")
    config, dense, quantized = build_models("cuda", args.layers, "sdpa")
    for variant in VARIANTS:
        model = dense if variant == "bf16" else quantized
        if variant == "nf4-ops":
            nf4_ops.patch(model)
        try:
            profile = profile_steps(model, config, args)
        finally:
            if variant == "nf4-ops":
                nf4_ops.unpatch(model)
        totals, counts = collections.Counter(), collections.Counter()
        for event in profile.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                totals[event.name] += event.device_time / args.steps
                counts[event.name] += 1 / args.steps
        groups = collections.Counter()
        for name, total in totals.items():
            groups[kernel_group(name)] += total
        print(f"\n== {variant}, batch {args.batch}, {'eager' if args.eager else 'compiled'}: "
              f"{round(sum(counts.values()))} GPU events a step (kernels, copies), {sum(totals.values()):.1f} µs: "
              + ", ".join(f"{group} {total:.1f}" for group, total in groups.most_common()))  # fmt: skip
        for name, total in totals.most_common(args.top):
            print(f"  {total:8.1f} µs  x{counts[name]:5.1f}  {name[:110]}")


if __name__ == "__main__":
    main()
