"""A workload for Nsight Compute: a few nf4::gemv calls on one layer shape, random weights.

    ncu --kernel-name regex:tc_gemv --launch-skip 3 --launch-count 1 --set full \
        python3 benchmarks/profile_gemv.py --rows 28672 --cols 8192 --m 1

Prints nothing of interest itself; the numbers come from the profiler (benchmarks/NOTES.md says which
profile each kernel change was decided from).
"""
import argparse

import torch

import nf4_ops  # noqa: F401  (registers torch.ops.nf4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=28672, help="N, rows of W")
    parser.add_argument("--cols", type=int, default=8192, help="K, columns of W")
    parser.add_argument("--m", type=int, default=1, help="rows of x")
    parser.add_argument("--blocksize", type=int, default=64)
    parser.add_argument("--nested", action="store_true", help="uint8 absmax codes with a nested absmax")
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args()

    n, k, bs = args.rows, args.cols, args.blocksize
    dev = torch.device("cuda")
    packed = torch.randint(0, 256, (n * k // 2, 1), dtype=torch.uint8, device=dev)
    blocks = n * k // bs
    nested = {}
    if args.nested:
        absmax = torch.randint(0, 256, (blocks,), dtype=torch.uint8, device=dev)
        nested = dict(
            nested_absmax=torch.rand((blocks + 255) // 256, device=dev) + 0.5,
            nested_code=torch.linspace(-1, 1, 256, device=dev),
            nested_offset=torch.tensor(0.1, device=dev),
        )
    else:
        absmax = torch.rand(blocks, device=dev) + 0.5
    x = torch.randn(args.m, k, dtype=torch.bfloat16, device=dev)
    for _ in range(args.calls):
        y = torch.ops.nf4.gemv(x, packed, absmax, bs, "nf4", [n, k], **nested)
    torch.cuda.synchronize()
    print("output", tuple(y.shape), "finite:", bool(torch.isfinite(y).all()))


if __name__ == "__main__":
    main()
