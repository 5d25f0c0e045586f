"""A small run of every kernel path, for compute-sanitizer (memcheck, racecheck) on the GPU machine.

Random packed bytes and scales are valid weights (every byte is two codes); each result is checked
against the reference so a sanitizer run is also a correctness run. Exits non-zero on a mismatch.
"""

import torch

import nf4_ops  # noqa: F401  (registers torch.ops.nf4)
from nf4_ops.reference import dequantize_reference, gemv_error_bound, has_fast_memory


def random_weight(n, k, blocksize, nested, device="cuda", misalign=False):
    g = torch.Generator().manual_seed(n * 31 + k)
    numel = n * k
    blocks = -(-numel // blocksize)
    packed = torch.randint(0, 256, ((numel + 1) // 2,), generator=g, dtype=torch.uint8)
    if misalign:  # a view one byte into its storage: the scalar paths
        packed = torch.cat([torch.zeros(1, dtype=torch.uint8), packed])[1:]
    args = dict(blocksize=blocksize, quant_type="nf4" if k % 2 else "fp4", shape=[n, k])
    if nested:
        args.update(
            absmax=torch.randint(0, 256, (blocks,), generator=g, dtype=torch.uint8).to(device),
            nested_absmax=torch.rand(-(-blocks // 256), generator=g).to(device) + 0.5,
            nested_code=torch.linspace(-1, 1, 256).to(device),
            nested_offset=torch.tensor(0.75).to(device),
        )
    else:
        args["absmax"] = (torch.rand(blocks, generator=g) + 0.1).to(device)
    return packed.to(device), args


def check_gemv(packed, args, rows, label, dtype=torch.bfloat16):
    """1 if nf4::gemv on `rows` rows of x (of `dtype`) misses the CPU reference (the tolerance rule), else 0."""
    n, k = args["shape"]
    # Seeded, so that every sanitizer run checks the same numbers (the tests' inputs are seeded too).
    g = torch.Generator().manual_seed(n * 131 + k * 7 + rows)
    x = torch.randn(rows, k, generator=g).to(dtype).cuda()
    bias = torch.randn(n, generator=g).to(dtype).cuda()
    out = torch.ops.nf4.gemv(x, packed, bias=bias, **args)
    # References on the CPU: cuBLAS's own split-K kernels trip racecheck, and only ours are on trial.
    args_cpu = {key: v.cpu() if isinstance(v, torch.Tensor) else v for key, v in args.items()}
    err, allowed = gemv_error_bound(out.cpu(), x.cpu(), packed.cpu(), bias=bias.cpu(), **args_cpu)
    if err <= allowed:
        return 0
    print(f"gemv mismatch: {label} M={rows} {dtype}: max error {err:.3g} > {allowed:.3g} allowed")
    return 1


def main():
    failures = 0
    # (n, k, blocksize, nested, misaligned packed): the tensor-core gemv (bf16, K % 256 == 0, aligned) with
    # one CTA per tile whose warps add their parts in shared memory (64 x 512, 40 x 4352, 40 x 7424; at 12 and 16
    # rows the last takes a cluster of 2 CTAs per tile on sm_90, the second CTA pushing its parts into the first's
    # shared memory with st.async: csrc/gemv.cu, tc_tile_cluster and add_warp_parts), tiles shared by several CTAs'
    # warps plus the kernel that adds their parts (40 x 17152: 67 turns per tile; on an H100 or H200 at
    # 5-16 rows the warpgroup kernel, which also takes 25640 x 512: about half the tiles taken whole, the rest
    # shared), few turns per warp (40 x 1024), absmax blocks that span rows (bs 512 over K = 1280), a partial last
    # nested block whose codes end inside a 4-byte copy (bs 4096 over 40 x 1280), W rows past the last tile's end, an
    # odd N whose shared tiles' sums the adding kernel writes two at a time (9613 x 1280: outputs of odd x rows at odd
    # places, scalar stores; the last row a pair's first), an adding grid resident beside the warpgroup grid whose
    # CTAs take two tiles each (9616 x 5376 at 12-16 rows on an H100 or H200: csrc/gemv.cu launch_add_tile_parts);
    # the CUDA-core and scalar paths (K % 256 != 0, odd K, bs 32, misaligned).
    cases = [(64, 512, 64, False, False), (40, 4352, 64, True, False), (40, 7424, 64, True, False),
             (40, 7424, 256, False, False),
             (40, 17152, 64, True, False), (64 * 400 + 40, 512, 128, False, False),
             (40, 1024, 128, True, False), (24, 1280, 512, False, False), (40, 1280, 4096, True, False),
             (64, 320, 64, False, False), (64 * 150 + 13, 1280, 64, True, False),
             (64 * 150 + 16, 5376, 256, False, False), (33, 77, 32, True, False), (48, 1088, 4096, True, True),
             (7, 40, 128, False, True)]  # fmt: skip
    for n, k, blocksize, nested, misalign in cases:
        packed, args = random_weight(n, k, blocksize, nested, misalign=misalign)
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            out = torch.ops.nf4.dequantize(packed, dtype=dtype, **args)
            if not torch.equal(out, dequantize_reference(packed, dtype=dtype, **args)):
                failures += 1
                print(f"dequantize mismatch: {n}x{k} bs{blocksize} nested={nested} {dtype}")
        for rows in (1, 5, 8, 12, 16):
            failures += check_gemv(packed, args, rows, f"{n}x{k} bs{blocksize} nested={nested}")
    # The 32-row-tile kernel (9-16 rows of x on large layers, csrc/gemv.cu kTcWideTile*): a weight just large
    # enough for this GPU's SM count (as tests/test_gemv.py wide_tile_shape, whose test checks the kernel
    # runs), with a last tile of 8 rows (its second m-tile wholly past W's end).
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    wide_n, wide_k = 32 * (-(-6 * 16 * sms // 67) + 1) - 24, 256 * 67
    for nested in (False, True):
        packed, args = random_weight(wide_n, wide_k, 64, nested)
        failures += check_gemv(packed, args, 16, f"{wide_n}x{wide_k} wide tiles nested={nested}")
    # The warpgroup kernel's whole team tiles (csrc/gemv.cu wg_whole_tile_grid, csrc/ops.h
    # kWarpgroupWholeTileMinPercent*): team tiles 97% of this GPU's SMs (whole under both memory classes' fractions,
    # as tests/test_gemv.py team_tiles_shape), the last tile 40 rows short, so a CTA per tile and no adding kernel
    # on an H100 or H200 at 4-16 rows.
    whole_n, whole_k = 192 * -(-97 * sms // 100) - 40, 256 * 5
    for nested in (False, True):
        packed, args = random_weight(whole_n, whole_k, 64, nested)
        for rows in (5, 8, 16):
            failures += check_gemv(packed, args, rows, f"{whole_n}x{whole_k} whole team tiles nested={nested}")
    # The one-row kernel (one row of x, plain absmax, K % 256 == 0 and K % blocksize == 0, a range of N / SMs rows
    # per CTA and at least 1 step of 4 rows x 512 elements per warp: csrc/gemv.cu kOr*; as tests/test_gemv.py
    # one_row_shape, whose test checks which kernel runs): 17 steps per tile, 8 tiles per CTA (8-9 steps per
    # warp, so the warps refill their rings of loads), each CTA's last tile of 2 or 3 rows (its others load as
    # zeros), tiles shared by two or three warps of a CTA; the same with each row's last step a half step
    # (K % 512 == 256), whose upper lanes must read nothing past W's and x's rows; and 2 tiles per CTA (2-3 steps
    # per warp: runs shorter than the ring); and 1 tile per CTA (1-2 steps per warp, most warps one, as on Qwen's
    # k/v: the kernel's minimum since NOTES gemv row 140). Each with bf16 x (1 row, and 2 and 3 rows decoded together where csrc/ops.h's
    # kOneRowXRowLimits allow: 3 on the 16.5 MiB W, 2 on the 3.3 MiB one, whose 3 rows take the tensor-core kernel)
    # and with fp32 x (split into bf16 parts), and 3 rows of fp32 x (one
    # launch that takes the rows one after another: csrc/ops.h kOneRowFp32RowLimits); and each with nested absmax
    # (its codes turned into scales from shared-memory tables: csrc/gemv.cu kOrNestedMaxBlocks).
    for tiles_per_cta, one_row_k in ((8, 512 * 17), (8, 512 * 17 - 256), (2, 512 * 17), (1, 512 * 17)):
        one_row_n = (4 * tiles_per_cta - 2) * sms + 7
        for nested in (False, True):
            packed, args = random_weight(one_row_n, one_row_k, 64, nested)
            label = f"{one_row_n}x{one_row_k} one-row kernel nested={nested}"
            for dtype, rows in ((torch.bfloat16, 1), (torch.bfloat16, 2), (torch.bfloat16, 3), (torch.float32, 1),
                                (torch.float32, 3)):
                failures += check_gemv(packed, args, rows, label, dtype)
    # More rows of x than one tensor-core launch takes, on the many-rows kernel up to csrc/ops.h's limits (32 rows
    # under 5 MiB packed, 64 from 5 MiB, 96 from 16 MiB; on memory of 4 TB/s or more 32, and 64 from 16 MiB; past them
    # dequantize + cuBLAS; tests/test_gemv.py MANY_ROWS_SHAPES): one CTA per tile with a last tile of 88 W rows;
    # tiles shared by several CTAs' runs (fp32 parts added by a second kernel); more tiles than CTAs, runs starting
    # and ending inside tiles, two tiles of x (on fast memory one); three tiles of x (on fast memory two); each with
    # a part-empty last tile of x; and on W of 16 MiB or more, a last row of x in a launch of its own after the whole
    # tiles (kManyRowsTailRowLimits).
    fast = has_fast_memory()
    many_rows_cases = ((128 * 6 - 40, 512, False, (24,)), (300, 256 * 20, True, (31,)),
                       (128 * 450 - 24, 512, False, (31 if fast else 40,)),
                       (128 * 33 - 40, 8192, False, (48 if fast else 80, 33)))  # fmt: skip
    for n, k, nested, row_counts in many_rows_cases:
        packed, args = random_weight(n, k, 64, nested)
        for rows in row_counts:
            failures += check_gemv(packed, args, rows, f"{n}x{k} many rows nested={nested}")
    torch.cuda.synchronize()
    print(f"sanitizer workload: {failures} mismatches")
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    main()
