"""nf4::gemv equals F.linear(x, dequantize(W), bias) within the tolerance rule, for any number of rows."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

import nf4_ops
from nf4_ops.reference import absmax_reference, has_fast_memory
from conftest import (
    ALL_DEVICES, BLOCKSIZES, FLOAT_DTYPES, QUANT_TYPES, STORAGES, assert_gemv_close, bnb_cuda_works, bnb_quantize,
    dtype_id, state_on,
)  # fmt: skip

# Rows of x on each side of the fused / dense boundaries (csrc/ops.h: kFusedGemvMaxRows = 8 for the CPU and
# CUDA-core kernels, 16 for the tensor-core kernel on a W this small, whose n-tiles hold 8 rows).
ROW_COUNTS = [0, 1, 3, 8, 9, 16, 17, 33]
SHAPES = {
    "k_multiple_of_256": (48, 512),  # the tensor-core kernel for fp16 / bf16 x on CUDA; vectorised otherwise
    "k_multiple_of_64": (48, 320),  # the vectorised CUDA-core kernel
    "odd_k": (33, 77),  # the element-wise path; N*K odd
}


def weight_on(device, shape, quant_type="nf4", blocksize=64, nested=False, storage=torch.uint8):
    quantized = bnb_quantize(shape, quant_type, blocksize, nested, storage)
    return quantized.packed.to(device), nf4_ops.quant_state_args(state_on(quantized, device))


def random_x(shape, dtype, device, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(device=device, dtype=dtype)


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("rows", ROW_COUNTS, ids=lambda m: f"M{m}")
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
@pytest.mark.parametrize("quant_type", QUANT_TYPES)
@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_gemv_matrix(shape_name, quant_type, nested, dtype, rows, with_bias, device):
    shape = SHAPES[shape_name]
    packed, args = weight_on(device, shape, quant_type, 64, nested)
    x = random_x((rows, shape[1]), dtype, device)
    bias = random_x((shape[0],), dtype, device, seed=2) if with_bias else None
    out = torch.ops.nf4.gemv(x, packed, bias=bias, **args)
    assert out.device == x.device
    assert_gemv_close(out, x, packed, args, bias)


def dot_in_32_lanes(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K].T in fp32 in the CPU kernel's order (csrc/nf4_core.h, dot_f32): element k into partial sum
    k % 32, each product and add rounded to fp32 (no fused multiply-add), then the 32 sums added pairwise."""
    partial = torch.zeros(x.shape[0], w.shape[0], 32)
    whole = x.shape[1] // 32 * 32
    for k in range(0, whole, 32):
        partial += x[:, None, k : k + 32] * w[None, :, k : k + 32]
    for k in range(whole, x.shape[1]):
        partial[:, :, k % 32] += x[:, None, k] * w[None, :, k]
    for width in (16, 8, 4, 2, 1):
        partial[:, :, :width] += partial[:, :, width : 2 * width]
    return partial[:, :, 0]


@pytest.mark.parametrize("rows", [1, 3, 8], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_gemv_cpu_fused_bits(shape_name, rows):
    # The CPU's fused rows (fp32 x, up to kFusedGemvMaxRows) give the bits of dot_f32's stated order, on whichever
    # path this CPU takes (AVX-512 or the baseline: the same order, so the same bits).
    shape = SHAPES[shape_name]
    packed, args = weight_on("cpu", shape, "nf4", 64, nested=True)
    x = random_x((rows, shape[1]), torch.float32, "cpu")
    w = torch.ops.nf4.dequantize(packed, dtype=torch.float32, **args)
    assert torch.equal(torch.ops.nf4.gemv(x, packed, **args), dot_in_32_lanes(x, w))


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("storage", STORAGES, ids=lambda s: "storage_" + dtype_id(s))
@pytest.mark.parametrize("blocksize", BLOCKSIZES, ids=lambda b: f"bs{b}")
def test_gemv_blocksizes_and_storages(blocksize, storage, device):
    # K = 1280: whole tensor-core turns on CUDA, and blocks of 512 or more span rows
    packed, args = weight_on(device, (40, 1280), "nf4", blocksize, True, storage)
    for rows in (1, 5, 12, 20):  # 20: the many-rows kernel on CUDA, with blocks of 2048 and 4096 spanning rows
        x = random_x((rows, 1280), torch.bfloat16, device)
        assert_gemv_close(torch.ops.nf4.gemv(x, packed, **args), x, packed, args)


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("rows", [1, 9, 64], ids=lambda m: f"M{m}")
def test_gemv_computes_in_x_dtype_under_autocast(rows, device):
    """nf4::gemv has no autocast kernel, so it computes in x's dtype whatever the caller's autocast says, on every
    path: its dense path's inner matmul (more rows than the fused kernels take) took the caller's autocast, in eager
    mode only, so eager and compiled calls differed."""
    packed, args = weight_on(device, (64, 256))
    x = random_x((rows, 256), torch.float32, device)
    bias = random_x((64,), torch.float32, device, seed=3)
    expected = torch.ops.nf4.gemv(x, packed, bias=bias, **args)
    for dtype in (torch.bfloat16, torch.float16):
        with torch.autocast(device, dtype=dtype):
            out = torch.ops.nf4.gemv(x, packed, bias=bias, **args)
        assert out.dtype == torch.float32 and torch.equal(out, expected), dtype


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("leading", [(), (2, 3), (2, 7), (4, 0), (1, 1, 5)], ids=str)
def test_gemv_leading_dims(leading, device):
    packed, args = weight_on(device, (48, 512), "fp4", 128, True)
    x = random_x((*leading, 512), torch.float16, device)
    bias = random_x((48,), torch.float16, device, seed=3)
    out = torch.ops.nf4.gemv(x, packed, bias=bias, **args)
    assert out.shape == (*leading, 48)
    assert_gemv_close(out, x, packed, args, bias)


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("rows", [3, 20], ids=lambda m: f"M{m}")
def test_gemv_non_contiguous_x(rows, device):
    packed, args = weight_on(device, (48, 512), "nf4", 64, False)
    x = random_x((512, rows), torch.bfloat16, device).t()  # a transposed view
    assert not x.is_contiguous()
    assert_gemv_close(torch.ops.nf4.gemv(x, packed, **args), x, packed, args)
    x_sliced = random_x((rows, 1024), torch.bfloat16, device)[:, ::2]  # every other column
    assert_gemv_close(torch.ops.nf4.gemv(x_sliced, packed, **args), x_sliced, packed, args)


def shifted(t: torch.Tensor, elements: int) -> torch.Tensor:
    """A contiguous view of t's values that starts `elements` of its own dtype into a storage of its own, so its data
    pointer loses the 16-byte alignment the vector paths need (the kernels must take their element-wise paths)."""
    storage = torch.empty(t.numel() + elements, dtype=t.dtype, device=t.device)
    view = storage[elements:].view(t.shape)
    view.copy_(t)
    return view


MISALIGNED = ["packed_1_byte", "x_1_element", "absmax_1_element", "codes_1_to_3_bytes", "bias_1_element"]


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("rows", [1, 5, 16, 40], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("what", MISALIGNED)
def test_gemv_misaligned_inputs(what, rows, device):
    """Contiguous views that start off the 16-byte alignment of the tensor-core, one-row, warpgroup and vectorised
    CUDA-core paths (a helper's reading found these untested on CUDA): each call takes a path that needs no alignment
    and is still right, at the rows of every path (one row, the fused kernels' limits, dequantize + matmul)."""
    shape = (48, 512)
    packed, args = weight_on(device, shape, "nf4", 64, nested=what.startswith("codes"))
    x = random_x((rows, shape[1]), torch.bfloat16, device)
    bias = random_x((shape[0],), torch.bfloat16, device, seed=2)
    cases = {
        "packed_1_byte": lambda: dict(packed=shifted(packed.view(torch.uint8).flatten(), 1)),
        "x_1_element": lambda: dict(x=shifted(x, 1)),
        "absmax_1_element": lambda: dict(absmax=shifted(args["absmax"], 1)),
        "codes_1_to_3_bytes": lambda: dict(absmax=shifted(args["absmax"], {1: 1, 5: 2, 16: 3, 40: 1}[rows])),
        "bias_1_element": lambda: dict(bias=shifted(bias, 1)),
    }
    call = dict(x=x, packed=packed, bias=bias, **args) | cases[what]()
    assert any(t.data_ptr() % 16 for t in (call["x"], call["packed"], call["absmax"], call["bias"]))
    out = torch.ops.nf4.gemv(**call)
    assert_gemv_close(out, call["x"], call["packed"], {k: v for k, v in call.items() if k not in ("x", "packed", "bias")},
                      call["bias"])


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("out_dtype", FLOAT_DTYPES, ids=dtype_id)
def test_dequantize_out_misaligned(out_dtype, device):
    """dequantize.out into a view that starts one element off 16 bytes, and (fp32 out) a packed weight 8 but not 16
    bytes aligned: the element-wise path, the same bits as an aligned call."""
    packed, args = weight_on(device, (40, 320), "nf4", 64, nested=True)
    expected = torch.ops.nf4.dequantize(packed, dtype=out_dtype, **args)
    out = shifted(torch.empty_like(expected), 1)
    assert out.data_ptr() % 16
    torch.ops.nf4.dequantize.out(packed, dtype=out_dtype, out=out, **args)
    assert torch.equal(out, expected)
    packed_8 = shifted(packed.view(torch.uint8).flatten(), 8)
    assert packed_8.data_ptr() % 16 == 8
    assert torch.equal(torch.ops.nf4.dequantize(packed_8, dtype=out_dtype, **args), expected)


# Shapes that reach every path of the tensor-core kernel (csrc/gemv.cu), each with the second kernel that
# adds shared tiles' parts launched or not. Stream-K: more 16-row tiles than warps, so warps' runs of turns
# (and their staged copies) cross tiles, with a last tile of 8 rows (rows past W's end are zero-filled) and
# an odd 17 turns per tile, so runs end on either stage of the ring; few rows with a long K (67 turns per
# tile, more than one CTA per tile takes), so several warps share each tile and the second kernel adds their
# fp32 parts. One CTA per tile (tc_cta_per_tile: no more tiles than SMs, at most 32 turns per tile), whose
# warps add their parts in shared memory: 61 tiles of 21 turns, the last of 8 rows (some warps taking 2 turns,
# some 1), and 61 tiles of 29 turns, which on sm_90 at 9-16 rows of x take a cluster of 2 CTAs per tile (more than
# 2 turns for each of a CTA's 12 warps: tc_tile_cluster), whose second CTA pushes its parts into the first's shared
# memory (elsewhere one CTA); and
# 12 turns in all (3 tiles x 4), so that most warps get none. Each with its own blocksize: one,
# two and four absmax blocks per turn are three ways of copying and reading the scales. (many_tiles' blocks of
# 512 span rows at K = 4352, which also keeps its one row of x off the one-row kernel on any GPU: that kernel
# needs rows that start on a block.)
TENSOR_CORE_SHAPES = {  # name: (shape, blocksize, whether the second kernel runs)
    "many_tiles": ((16 * 900 + 8, 256 * 17), 512, True),
    "k_slices": ((40, 256 * 67), 64, True),
    "cta_per_tile": ((16 * 60 + 8, 256 * 21), 64, False),
    "cta_per_tile_cluster": ((16 * 60 + 8, 256 * 29), 64, False),
    "few_turns": ((40, 1024), 128, False),
    # an odd N: the adding kernel's outputs of an x row past the first start at odd places (no vector store), and the
    # last tile's last row is a pair's first (csrc/gemv.cu, kAddPartsOutputs)
    "odd_rows": ((16 * 700 + 5, 256 * 9), 512, True),
}


# The CTAs per tile of a small-N layer's launch at 9-16 rows of x on sm_90 (csrc/gemv.cu, kTcTileCluster), where
# the clusters of every tile fit on the GPU at once (the test's 61 tiles do on an H100 or H200), and the warps of
# such a CTA (kTcCtaPerTileWideXWarps): a tile of more than kTcTileClusterMinTurns turns per warp takes a cluster.
TILE_CLUSTER = 2
TILE_CLUSTER_MIN_TURNS = 2  # kTcTileClusterMinTurns
CTA_PER_TILE_WIDE_X_WARPS = 12
# The tensor-core kernel's 32-row tiles (csrc/gemv.cu): warps per CTA (kTcWideWarps) and the shared memory a CTA
# takes (TcCta<2, 2, false>::kSharedBytes: the 64 KB table, the 1 KB nested map, 2 stages of 4.5 KB per warp).
WIDE_TILE_WARPS = 14
WIDE_TILE_SHARED_BYTES = 64 * 1024 + 1024 + WIDE_TILE_WARPS * 2 * (32 * 128 + 32 * 16)


def size_entry(table, shape: tuple[int, int]) -> tuple:
    """The entry of a table by size of csrc/ops.h ((from this many MiB of packed W, then its rows), as
    gemv_size_entry reads it) for a W of `shape`: the rest of the last entry whose size the packed W reaches."""
    packed_mib = shape[0] * shape[1] // 2 // 2**20
    return [entry[1:] for entry in table if packed_mib >= entry[0]][-1]


def row_limit(limits, shape: tuple[int, int]) -> int:
    """The rows of x that a limits table of csrc/ops.h ((from this many MiB of packed W, up to this many rows), as
    gemv_row_limit reads it) gives a W of `shape`."""
    (max_rows,) = size_entry(limits, shape)
    return max_rows


# The warpgroup kernel (csrc/gemv.cu, wg_gemv_applies): fp16 / bf16 x of WARPGROUP_MIN_X_ROWS (kWgMinXRows) to 16 rows,
# those of them that the range by W's size and the GPU's memory class gives (csrc/ops.h, kWarpgroupXRows*: (packed MiB
# from, rows from, rows up to)), on the layers whose 16-row tiles would not take one CTA per tile, in a build with
# sm_90a code on an sm_90 GPU.
WARPGROUP_MIN_X_ROWS = 4
WARPGROUP_X_ROWS = [(0, 4, 16)]
WARPGROUP_X_ROWS_FAST_MEMORY = [(0, 4, 16), (48, 7, 16), (100, 9, 16)]


def warpgroup_kernel_on() -> bool:
    """Whether this process's calls take the warpgroup kernel where it applies: an sm_90 GPU, a build with sm_90a
    code (nf4_ops._C.wgmma_sm90a, setup.py) and NF4_OPS_WGMMA not 0 (scripts/gpu_suite.sh runs the tensor-core
    kernel's tests again with it 0, so that the instances the warpgroup kernel replaces there are tested too)."""
    return (
        torch.cuda.is_available()
        and torch.cuda.get_device_capability() == (9, 0)
        and bool(nf4_ops._C.wgmma_sm90a)
        and os.environ.get("NF4_OPS_WGMMA") != "0"
    )


def warpgroup_takes(shape, rows) -> bool:
    """Whether a call of `rows` rows of fp16 / bf16 x on a W of `shape` that the tensor-core kernel's layout fits
    (K % 256 == 0) takes the warpgroup kernel in this process: not where the tensor-core kernel's 16-row tiles would
    take one CTA per tile (no more tiles than SMs, at most 32 turns per tile: csrc/gemv.cu, tc_cta_per_tile)."""
    if not warpgroup_kernel_on():
        return False
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if -(-shape[0] // 16) <= sms and shape[1] // 256 <= 32:
        return False
    min_rows, max_rows = size_entry(WARPGROUP_X_ROWS_FAST_MEMORY if has_fast_memory() else WARPGROUP_X_ROWS, shape)
    return WARPGROUP_MIN_X_ROWS <= rows <= 16 and min_rows <= rows <= max_rows


def kernel_events(profile, tmp_path, kernel: str) -> list[dict]:
    """The profiler trace's events of the launches of `kernel` (name, and args: grid, block, registers, ...)."""
    trace = tmp_path / "trace.json"
    profile.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    return [e for e in events if e.get("cat") == "kernel" and kernel in e.get("name", "")]


def launched_grids(profile, tmp_path, kernel: str) -> list[int]:
    """The grid sizes (x) of the profiled launches of `kernel`, from the profiler's trace."""
    return [e["args"]["grid"][0] for e in kernel_events(profile, tmp_path, kernel)]


def profiled_gemv_with_bias(shape, blocksize, nested, rows):
    """One nf4::gemv call on CUDA (NF4 weight, bf16 x of `rows` rows, bf16 bias) under the profiler:
    (out, x, packed, args, bias, profile)."""
    packed, args = weight_on("cuda", shape, "nf4", blocksize, nested)
    x = random_x((rows, shape[1]), torch.bfloat16, "cuda")
    bias = random_x((shape[0],), torch.bfloat16, "cuda", seed=5)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        out = torch.ops.nf4.gemv(x, packed, bias=bias, **args)
        torch.cuda.synchronize()
    return out, x, packed, args, bias, profile


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
@pytest.mark.parametrize("rows", [1, 7, 16], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
@pytest.mark.parametrize("shape_name", list(TENSOR_CORE_SHAPES))
def test_gemv_tensor_core_tiling(shape_name, nested, rows, tmp_path):
    shape, blocksize, adds_parts = TENSOR_CORE_SHAPES[shape_name]
    if adds_parts and warpgroup_takes(shape, rows):
        pytest.skip("the warpgroup kernel takes this call here (test_gemv_warpgroup_kernel); NF4_OPS_WGMMA=0 tests it")
    if rows == 1 and one_row_kernel_takes(shape, blocksize, nested):  # the one-CTA-per-tile shapes since row 140
        pytest.skip("the one-row kernel takes this call (test_gemv_one_row_kernel); few_turns keeps one row here")
    out, x, packed, args, bias, profile = profiled_gemv_with_bias(shape, blocksize, nested, rows)
    names = [event.name for event in profile.events()]
    assert sum("tc_gemv_kernel" in name for name in names) == 1, names
    assert any("add_tile_parts_kernel" in name for name in names) == adds_parts, names
    if not adds_parts:  # one CTA per tile, or a cluster of TILE_CLUSTER CTAs per tile (csrc/gemv.cu, tc_tile_cluster)
        tiles, turns = -(-shape[0] // 16), shape[1] // 256
        on_sm90 = torch.cuda.get_device_capability()[0] >= 9
        fits = TILE_CLUSTER * tiles <= torch.cuda.get_device_properties(0).multi_processor_count  # all at once
        takes_cluster = on_sm90 and fits and turns > TILE_CLUSTER_MIN_TURNS * CTA_PER_TILE_WIDE_X_WARPS and rows > 8
        cluster = TILE_CLUSTER if takes_cluster else 1
        assert launched_grids(profile, tmp_path, "tc_gemv_kernel") == [tiles * cluster]
    assert_gemv_close(out, x, packed, args, bias)


def wide_tile_shape(whole_tiles: bool) -> tuple[int, int]:
    """A weight that takes the 32-row-tile kernel at 9-16 rows of x (csrc/gemv.cu, kTcWideTile*: K >= 8192 and
    at least 6 wide turns per resident warp, WIDE_TILE_WARPS per SM), with a last tile of 8 rows (its second
    m-tile wholly past W's end). Without `whole_tiles`: 67 turns per tile (odd, so warps' runs end on either
    stage), each tile shared by several warps. With it: 32 turns per tile and 21 tiles more than a warp's worth
    per SM, so the warps' runs (32-33 turns) cross tiles and some take a tile whole, which goes straight to the
    output (a ~250 MB weight: about the fewest rows that do that)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if whole_tiles:
        return 32 * (WIDE_TILE_WARPS * sms + 21) - 24, 256 * 32
    turns = 67
    tiles = -(-6 * WIDE_TILE_WARPS * sms // turns) + 1
    return 32 * tiles - 24, 256 * turns


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
@pytest.mark.parametrize(
    "whole_tiles, nested, rows",
    [(False, False, 9), (False, False, 16), (False, True, 9), (False, True, 16), (True, False, 16)],
    ids=["shared-plain-M9", "shared-plain-M16", "shared-nested-M9", "shared-nested-M16", "whole-plain-M16"],
)
def test_gemv_wide_tiles(whole_tiles, nested, rows):
    if torch.cuda.get_device_properties(0).shared_memory_per_block_optin < WIDE_TILE_SHARED_BYTES:
        pytest.skip(f"the 32-row-tile kernel needs {WIDE_TILE_SHARED_BYTES} bytes of shared memory per block")
    shape = wide_tile_shape(whole_tiles)
    if warpgroup_takes(shape, rows):
        pytest.skip("the warpgroup kernel takes this call here (test_gemv_warpgroup_kernel); NF4_OPS_WGMMA=0 tests it")
    packed, args = weight_on("cuda", shape, "nf4", 256 if nested else 64, nested)
    x = random_x((rows, shape[1]), torch.bfloat16, "cuda")
    bias = random_x((shape[0],), torch.bfloat16, "cuda", seed=5)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        out = torch.ops.nf4.gemv(x, packed, bias=bias, **args)
        torch.cuda.synchronize()
    kernels = {event.name for event in profile.events()}
    # <T, kMTiles, kNTiles, kNested, kCtaPerTile>: this test is about the wide tile, so it fails if the call did
    # not take it.
    assert any(re.search(r"tc_gemv_kernel<[^,]+, 2, 2, (true|false), false>", name) for name in kernels), kernels
    assert_gemv_close(out, x, packed, args, bias)


# Weights for the warpgroup kernel (64-row tiles, 3 warpgroups per CTA, stream-K over teams: a warpgroup at up to 8
# rows of x, the CTA's three on three adjacent tiles at 9-16, csrc/gemv.cu WgShape; every one has more 16-row tiles
# than an H100 or H200 has SMs, or more turns per tile than one CTA's 16 warps take, so none takes one CTA per tile):
# one tile of 40 rows (a warp's 16 rows wholly past W's end, another's half; at 9-16 rows two of the team's tiles
# wholly past it) shared by every team, 67 turns;
# 401 tiles of 2 turns (about half the teams take a team tile whole and write it straight out; the last tile 40 rows);
# 151 tiles of 21 turns (runs cross tiles; absmax blocks of 256, one per turn; the last tile 16 rows);
# blocks of 512 that span rows (K = 4352: 17 turns);
# 301 tiles of one turn (K = 256: no tile is shared, so no adding kernel runs);
# an odd N (the adding kernel's outputs of x rows past the first at odd places; the last row a pair's first).
WARPGROUP_SHAPES = {  # name: (shape, blocksize)
    "shared_tile": ((40, 256 * 67), 64),
    "whole_tiles": ((64 * 400 + 40, 256 * 2), 128),
    "crossing_runs": ((64 * 150 + 16, 256 * 21), 256),
    "blocks_span_rows": ((64 * 40 + 8, 256 * 17), 512),
    "one_turn": ((64 * 300 + 8, 256), 64),
    "odd_rows": ((64 * 150 + 13, 256 * 5), 64),
}


@pytest.mark.skipif(not warpgroup_kernel_on(), reason="needs an sm_90 GPU, sm_90a code and NF4_OPS_WGMMA not 0")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("rows", [4, 7, 8, 9, 16], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
@pytest.mark.parametrize("shape_name", list(WARPGROUP_SHAPES))
def test_gemv_warpgroup_kernel(shape_name, nested, rows, dtype):
    shape, blocksize = WARPGROUP_SHAPES[shape_name]
    if not warpgroup_takes(shape, rows):  # the shapes are built to take it where these rows do (csrc/ops.h)
        pytest.skip("this GPU's memory class keeps the tensor-core kernel at these rows (csrc/ops.h)")
    packed, args = weight_on("cuda", shape, "nf4" if rows % 2 else "fp4", blocksize, nested)
    x = random_x((rows, shape[1]), dtype, "cuda")
    bias = random_x((shape[0],), dtype, "cuda", seed=5) if rows % 4 else None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        out = torch.ops.nf4.gemv(x, packed, bias=bias, **args)
        torch.cuda.synchronize()
    names = [event.name for event in profile.events()]
    # <T, kN, kNested>: wgmma's N is 8 for up to 8 rows of x, else 16
    wide_n = 16 if rows > 8 else 8
    assert sum(bool(re.search(rf"wg_gemv_kernel<[^,]+, {wide_n}, ", name)) for name in names) == 1, names
    assert not any("tc_gemv_kernel" in name for name in names), names
    assert any("add_tile_parts_kernel" in name for name in names) == (shape[1] > 256), names
    assert_gemv_close(out, x, packed, args, bias)


# csrc/gemv.cu wg_whole_tile_grid: where the warpgroup kernel's team tiles (192 W rows at 9-16 rows of x; three teams
# of a 64-row tile a CTA at 4-8) come to a fraction of the resident CTAs (one a SM) from csrc/ops.h's
# kWarpgroupWholeTileMinPercent* up to all of them, each team takes one tile whole: a CTA per team tile (per three at
# 4-8 rows), no adding kernel (NOTES gemv rows 143-143d); below it stream-K over every SM and the adding kernel.
WARPGROUP_WHOLE_TILE_MIN_PERCENT, WARPGROUP_WHOLE_TILE_MIN_PERCENT_FAST_MEMORY = 82, 93


def team_tiles_shape(percent: int) -> tuple[int, int]:
    """A weight whose team tiles come to `percent`% of this GPU's SMs (rounded up), the last one 40 rows short (one
    warp's 16 rows wholly past W's end, another's half), 5 turns a tile."""
    tiles = -(-percent * torch.cuda.get_device_properties(0).multi_processor_count // 100)
    return 192 * tiles - 40, 256 * 5


@pytest.mark.skipif(not warpgroup_kernel_on(), reason="needs an sm_90 GPU, sm_90a code and NF4_OPS_WGMMA not 0")
@pytest.mark.parametrize("rows", [4, 8, 9, 16], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
@pytest.mark.parametrize("percent", [97, 80], ids=lambda p: f"tiles{p}pct")
def test_gemv_warpgroup_whole_team_tiles(percent, nested, rows, tmp_path):
    shape = team_tiles_shape(percent)
    if not warpgroup_takes(shape, rows):
        pytest.skip("this GPU's memory class keeps the tensor-core kernel at these rows (csrc/ops.h)")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    team_tiles = -(-shape[0] // 192)
    min_percent = (WARPGROUP_WHOLE_TILE_MIN_PERCENT_FAST_MEMORY if has_fast_memory()
                   else WARPGROUP_WHOLE_TILE_MIN_PERCENT)  # fmt: skip
    whole = min_percent * sms <= 100 * team_tiles <= 100 * sms
    assert whole == (percent == 97)  # the shapes sit on either side of both memory classes' fractions
    out, x, packed, args, bias, profile = profiled_gemv_with_bias(shape, 64, nested, rows)
    names = [event.name for event in profile.events()]
    assert any("add_tile_parts_kernel" in name for name in names) != whole, names
    if whole:
        assert launched_grids(profile, tmp_path, "wg_gemv_kernel") == [team_tiles]  # 3 teams of a 64-row tile at 4-8
    assert_gemv_close(out, x, packed, args, bias)
    assert torch.equal(out, torch.ops.nf4.gemv(x, packed, bias=bias, **args))  # the same bits on every run


# csrc/gemv.cu launch_add_tile_parts: the adding kernel's CTAs of a tile's piece of up to ADDING_MAX_THREADS threads,
# or of ADDING_RESIDENT_THREADS taking up to ADDING_MAX_TILES tiles each, and a thread per ADDING_OUTPUTS outputs.
ADDING_MAX_THREADS, ADDING_RESIDENT_THREADS, ADDING_MAX_TILES, ADDING_OUTPUTS = 1024, 128, 2, 2
# Per SM on sm_80-sm_90 (not in torch's device properties): CTAs at most, and shared memory reserved for each CTA.
MAX_CTAS_PER_SM, RESERVED_SHARED_BYTES_PER_CTA = 32, 1024


def adding_grid_beside(writer: dict, adding: dict, tiles: int, tile_rows: int, rows: int) -> tuple[int, int, int]:
    """The adding kernel's (grid x, grid y, block) that csrc/gemv.cu launch_add_tile_parts picks beside a writer's
    grid (as the profiler's trace gives both kernels: grid, block, registers, shared memory): the first of its three
    grids that fits on the SMs beside the writer's CTAs (launch_cache.h ctas_fitting_beside), else the first."""
    device = torch.cuda.get_device_properties(0)
    sms = device.multi_processor_count

    def warp_registers(per_thread: int) -> int:
        return -(-per_thread * 32 // 256) * 256

    def fitting(writer_ctas: int, threads: int) -> int:
        writer_warps = writer["block"][0] // 32
        guest_warps = threads // 32
        limits = [
            (device.regs_per_multiprocessor - writer_ctas * writer_warps * warp_registers(writer["registers per thread"]))
            // (guest_warps * warp_registers(adding["registers per thread"])),
            (device.max_threads_per_multi_processor - writer_ctas * writer["block"][0]) // threads,
            (device.shared_memory_per_multiprocessor
             - writer_ctas * (writer["shared memory"] + RESERVED_SHARED_BYTES_PER_CTA))
            // (adding["shared memory"] + RESERVED_SHARED_BYTES_PER_CTA),
            MAX_CTAS_PER_SM - writer_ctas,
        ]  # fmt: skip
        return max(min(limits), 0)

    vectors = rows * tile_rows // ADDING_OUTPUTS
    writer_grid = writer["grid"][0]
    choices = []
    for most_threads, tiles_per_cta in ((ADDING_MAX_THREADS, 1), (ADDING_RESIDENT_THREADS, 1),
                                        (ADDING_RESIDENT_THREADS, ADDING_MAX_TILES)):  # fmt: skip
        threads = min(most_threads, -(-vectors // 32) * 32)
        choices.append((-(-tiles // tiles_per_cta), -(-vectors // threads), threads))
    for across, pieces, threads in choices:
        resident = (writer_grid % sms) * fitting(writer_grid // sms + 1, threads) + (
            sms - writer_grid % sms) * fitting(writer_grid // sms, threads)  # fmt: skip
        if across * pieces <= resident:
            return across, pieces, threads
    return choices[0]


@pytest.mark.skipif(not warpgroup_kernel_on(), reason="needs an sm_90 GPU, sm_90a code and NF4_OPS_WGMMA not 0")
@pytest.mark.parametrize("rows", [9, 16], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
def test_gemv_adding_grid_beside_the_writer(rows, nested, tmp_path):
    """With programmatic launch the adding kernel's grid is sized to be resident beside the warpgroup kernel's
    (csrc/gemv.cu launch_add_tile_parts; the grid it takes is worked out here by the same rule from the registers and
    shared memory the profiler reports). On the H100 and H200 of 3e85a5f's suites: 9 rows plain 128-thread CTAs a tile
    each, 9 nested and 16 plain 128-thread CTAs taking two tiles, 16 nested the grid of a CTA per tile's piece of 1024
    threads (the nested instance's 3 more registers leave room for 2 adding CTAs an SM, not 3). Whatever the grid, it
    adds the same parts in the same order as the grid that a launch without programmatic launch takes (NF4_OPS_PDL=0,
    in a child process: the switch is read once per process), so the output has the same bits, and is right. (The rule
    takes every grid's registers and shared memory from the instance that ran; both instances have the same today.)"""
    shape, blocksize = WARPGROUP_SHAPES["crossing_runs"]  # 51 team tiles of 21 turns at 9-16 rows
    out, x, packed, args, bias, profile = profiled_gemv_with_bias(shape, blocksize, nested, rows)
    assert_gemv_close(out, x, packed, args, bias)
    kernels = kernel_events(profile, tmp_path, "")
    writer = [e["args"] for e in kernels if "wg_gemv_kernel" in e["name"]]
    adding = [e for e in kernels if "add_tile_parts_kernel" in e["name"]]
    assert len(writer) == 1 and len(adding) == 1, [e["name"] for e in kernels]
    tile_rows = 192  # team tiles of 3 x 64 W rows at 9-16 rows
    across, pieces, threads = adding_grid_beside(writer[0], adding[0]["args"], -(-shape[0] // tile_rows), tile_rows,
                                                 rows)  # fmt: skip
    got = adding[0]["args"]
    assert (got["grid"][0], got["grid"][1], got["block"][0]) == (across, pieces, threads), adding[0]
    # <T, kTiles>: the instance whose CTAs take several tiles where the grid has fewer CTAs along x than tiles
    tiles_per_cta = int(re.search(r"add_tile_parts_kernel<[^,]+, (\d+)>", adding[0]["name"]).group(1))
    assert tiles_per_cta == (ADDING_MAX_TILES if across * tile_rows < shape[0] else 1), adding[0]["name"]
    child = f"""
import os, sys, torch
sys.path.insert(0, "tests")
from test_gemv import weight_on, random_x
packed, args = weight_on("cuda", {shape!r}, "nf4", {blocksize}, {nested})
x = random_x(({rows}, {shape[1]}), torch.bfloat16, "cuda")
bias = random_x(({shape[0]},), torch.bfloat16, "cuda", seed=5)
torch.save(torch.ops.nf4.gemv(x, packed, bias=bias, **args).cpu(), {str(tmp_path / "no_pdl.pt")!r})
"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-c", child], cwd=root, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "NF4_OPS_PDL": "0"})  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert torch.equal(out.cpu(), torch.load(tmp_path / "no_pdl.pt"))


# The one-row kernel's tiling (csrc/gemv.cu: kOrRows, kOrMinStepsPerWarp, kOrWarps), which the shapes below are
# built around; the test fails, not passes vacuously, if the kernel's rule changes, since it asserts which
# kernel ran.
ONE_ROW_TILE_ROWS, ONE_ROW_MIN_STEPS_PER_WARP, ONE_ROW_WARPS = 4, 1, 16  # every x dtype (NOTES gemv row 140)
ONE_ROW_NESTED_MAX_BLOCKS = 4096  # kOrNestedMaxBlocks: the nested absmax values a CTA holds in shared memory
ONE_ROW_MAX_X_ROWS = 3  # kOrMaxXRows: the most rows of fp16 / bf16 x that the kernel decodes together
# csrc/ops.h kOneRowXRowLimits (memory below 4 TB/s) and kOneRowXRowLimitsFastMemory: (from this many MiB of packed W,
# up to this many rows of fp16 / bf16 x) take one launch of the one-row kernel where it takes one row.
ONE_ROW_X_ROW_LIMITS = [(0, 2), (8, 3), (100, 2)]
ONE_ROW_X_ROW_LIMITS_FAST_MEMORY = [(0, 2), (8, 3), (32, 2), (48, 1)]


def one_row_max_x_rows(shape: tuple[int, int]) -> int:
    """The most rows of fp16 / bf16 x that one launch of the one-row kernel takes on this W on this GPU (csrc/ops.h
    one_row_gemv_max_x_rows), on a W where it takes one row."""
    limits = ONE_ROW_X_ROW_LIMITS_FAST_MEMORY if has_fast_memory() else ONE_ROW_X_ROW_LIMITS
    rows = row_limit(limits, shape)
    assert rows <= ONE_ROW_MAX_X_ROWS
    return rows


def one_row_kernel_takes(
    shape: tuple[int, int], blocksize: int, nested: bool, nested_blocksize: int = 256
) -> bool:
    """Whether one row of x (fp16, bf16 or fp32) on this W takes the one-row kernel (csrc/gemv.cu
    one_row_gemv_applies, on this GPU's SM count), for tests that must know which kernel a call takes. Nested
    absmax: where a CTA's nested absmax values fit its shared memory (one_row_nested_blocks <= kOrNestedMaxBlocks)."""
    n, k = shape
    sms = torch.cuda.get_device_properties(0).multi_processor_count  # one CTA per SM
    fewest_rows = n // sms  # per CTA
    steps = -(-fewest_rows // ONE_ROW_TILE_ROWS) * -(-k // 512)  # a last half step (K % 512 == 256) counts as one
    nested_blocks = -(-n // sms) * (k // blocksize) // nested_blocksize + 2
    return ((not nested or nested_blocks <= ONE_ROW_NESTED_MAX_BLOCKS) and k % 256 == 0 and k % blocksize == 0
            and steps >= ONE_ROW_MIN_STEPS_PER_WARP * ONE_ROW_WARPS)  # fmt: skip


def one_row_shape(steps: int, half_step: bool = False, steps_per_warp: int = 8) -> tuple[int, int]:
    """A weight that takes the one-row kernel at one row of x (K % 256 == 0, one CTA of 16 warps per SM, each
    CTA a range of N / SMs rows tiled in 4-row tiles, and at least 1 step of 4 rows x 512 elements per warp of
    the CTA with the fewest rows; the kernel also needs K % blocksize == 0), with `steps` steps
    per tile, the last of them a half step (256 elements) if `half_step`, and about `steps_per_warp` (>= the
    kernel's minimum) steps per warp: 8, runs long enough to refill the warp's ring of loads (4 steps), unless told
    otherwise.
    The CTAs get 4 t - 2 or 4 t - 1 rows (t tiles each), so every CTA's last tile has 2 or 3 rows (its other
    rows load as zeros)."""
    assert steps_per_warp >= ONE_ROW_MIN_STEPS_PER_WARP
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tiles_per_cta = -(-steps_per_warp * ONE_ROW_WARPS // steps)
    return (ONE_ROW_TILE_ROWS * tiles_per_cta - 2) * sms + 7, 512 * steps - (256 if half_step else 0)


# (steps per tile, last step a half step, blocksize, quant_type, dtype, bias): odd and even step counts, so
# warps' runs end anywhere in a tile and on any slot of the load ring; every blocksize (one absmax value per
# segment, per 2 or 4 segments, per step, per 2, 4 or 8 steps), and blocks of 4096 that span two rows at
# K = 5120, which the one-row kernel leaves to the tensor-core kernel (its scale addresses need rows that start
# on a block); one step per tile (K = 512, ~67k rows of W), where no tile is shared; and rows that end in a half
# step (K % 512 == 256, as Gemma's K = 5376), one half step alone per row (K = 256) among them, and one where
# blocks of 512 then span rows (the tensor-core kernel). The last field: steps per warp, 8 (refills of the load
# ring) but for two cases at 2 (runs shorter than the ring, as on Llama's k/v) and four at the kernel's minimum of
# 1 (as on Qwen's k/v: most warps one step, a few two), two of them fp32.
ONE_ROW_CASES = [
    (1, False, 512, "nf4", torch.bfloat16, True, 8),
    (17, False, 64, "nf4", torch.bfloat16, True, 8),
    (17, False, 128, "fp4", torch.float16, False, 8),
    (10, False, 4096, "nf4", torch.bfloat16, True, 8),
    (24, False, 4096, "fp4", torch.float16, False, 8),
    (10, False, 512, "nf4", torch.float16, False, 8),
    (33, False, 256, "nf4", torch.bfloat16, True, 8),
    (9, False, 1024, "fp4", torch.bfloat16, False, 8),
    (16, False, 2048, "nf4", torch.float16, True, 8),
    (11, True, 64, "nf4", torch.bfloat16, True, 8),
    (11, True, 128, "fp4", torch.float16, False, 8),
    (1, True, 256, "nf4", torch.float16, True, 8),
    (4, True, 256, "nf4", torch.bfloat16, False, 8),
    (18, True, 512, "fp4", torch.bfloat16, True, 8),
    (16, False, 64, "nf4", torch.bfloat16, True, 2),
    (11, True, 64, "fp4", torch.float16, False, 2),
    (10, False, 64, "nf4", torch.bfloat16, True, 1),  # the minimum, 1 step per warp (NOTES gemv row 140)
    (11, True, 256, "fp4", torch.float16, False, 1),
    # fp32 x (split into bf16 parts: csrc/gemv.cu, MmaOperand), where a bf16 x would miss the tolerance rule by far;
    # blocks of 4096 at K = 5120 take the CUDA-core kernel instead
    (17, False, 64, "nf4", torch.float32, True, 8),
    (33, False, 256, "fp4", torch.float32, False, 8),
    (10, False, 4096, "nf4", torch.float32, True, 8),
    (11, True, 128, "fp4", torch.float32, False, 8),
    (1, True, 256, "nf4", torch.float32, True, 8),
    (16, False, 64, "nf4", torch.float32, True, 2),
    (10, False, 64, "nf4", torch.float32, True, 1),  # the minimum, 1 step per warp
    (11, True, 256, "fp4", torch.float32, False, 1),
]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
@pytest.mark.parametrize(
    "case",
    ONE_ROW_CASES,
    ids=lambda c: f"steps{c[0]}{'-half' if c[1] else ''}-bs{c[2]}-{c[3]}-{dtype_id(c[4])}-{c[6]}perwarp",
)
def test_gemv_one_row_kernel(case):
    steps, half_step, blocksize, quant_type, dtype, with_bias, steps_per_warp = case
    shape = one_row_shape(steps, half_step, steps_per_warp)
    quantized = bnb_quantize(shape, quant_type, blocksize, False, device="cuda" if bnb_cuda_works() else "cpu")
    packed, args = quantized.packed.cuda(), nf4_ops.quant_state_args(state_on(quantized, "cuda"))
    # x's row is followed in memory by NaNs, so a kernel that read past its end (a half step's upper lanes) would
    # return NaNs
    x = torch.full((1, shape[1] + 64), float("nan"), dtype=dtype, device="cuda")[:, : shape[1]]
    x.copy_(random_x((1, shape[1]), dtype, "cuda"))
    bias = random_x((shape[0],), dtype, "cuda", seed=7) if with_bias else None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        out = torch.ops.nf4.gemv(x, packed, bias=bias, **args)
        torch.cuda.synchronize()
    names = [event.name for event in profile.events()]
    # this test is about the one-row kernel, so it fails if the call did not take it where it applies (rows that
    # start on an absmax block), and if it took it anywhere else (there the tensor-core kernel must, or for fp32 x
    # the CUDA-core one)
    takes_one_row = shape[1] % blocksize == 0
    assert one_row_kernel_takes(shape, blocksize, False) == takes_one_row  # the helper agrees with the shapes
    other_kernel = "fused_gemv_kernel" if dtype == torch.float32 else "tc_gemv_kernel"  # fp32: the CUDA-core kernel
    kernel = "one_row_gemv_kernel" if takes_one_row else other_kernel
    assert sum(kernel in name for name in names) == 1 and sum("gemv_kernel" in name for name in names) == 1, names
    if takes_one_row:  # the CTA adds its shared tiles' parts itself: no second kernel
        assert not any("add_tile_parts_kernel" in name for name in names), names
    assert_gemv_close(out, x, packed, args, bias)
    for _ in range(2):
        assert torch.equal(torch.ops.nf4.gemv(x, packed, bias=bias, **args), out)  # the same bits every run
    if takes_one_row and dtype != torch.float32:
        check_one_row_x_rows(shape, packed, args, dtype, bias)


def check_one_row_x_rows(shape, packed, args, dtype, bias):
    """Several rows of fp16 / bf16 x on a W the one-row kernel takes: up to one_row_max_x_rows rows (by W's size) take
    one launch of it, which decodes each step once for all of them, each row the same bits as that row alone; a row
    more takes the tensor-core kernel (or the warpgroup kernel, where it applies)."""
    max_rows = one_row_max_x_rows(shape)
    for rows in range(2, max_rows + 2):
        # x is followed in memory by NaNs, so a read past its last row would turn outputs into NaNs
        buffer = torch.full((rows * shape[1] + 64,), float("nan"), dtype=dtype, device="cuda")
        x = buffer[: rows * shape[1]].view(rows, shape[1])
        x.copy_(random_x((rows, shape[1]), dtype, "cuda", seed=rows))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            out = torch.ops.nf4.gemv(x, packed, bias=bias, **args)
            torch.cuda.synchronize()
        names = [event.name for event in profile.events()]
        more = "wg_gemv_kernel" if warpgroup_takes(shape, rows) else "tc_gemv_kernel"
        kernel = "one_row_gemv_kernel" if rows <= max_rows else more
        assert sum(kernel in name for name in names) == 1 and sum("gemv_kernel" in n for n in names) == 1, names
        assert_gemv_close(out, x, packed, args, bias)
        assert torch.equal(torch.ops.nf4.gemv(x, packed, bias=bias, **args), out)  # the same bits every run
        if rows <= max_rows:
            for row in range(rows):
                alone = torch.ops.nf4.gemv(x[row : row + 1], packed, bias=bias, **args)
                assert torch.equal(out[row], alone[0]), f"row {row} of {rows}"


# csrc/ops.h kOneRowXRowLimits and kOneRowXRowLimitsFastMemory, at each of their sizes: 2 and 3 rows of fp16 / bf16 x
# on weights just below and at each limit's size (K = 8192) take the one-row kernel up to one_row_max_x_rows rows,
# else the tensor-core kernel.
X_ROW_LIMIT_SIZES_MIB = sorted({mib + d for mib, _ in ONE_ROW_X_ROW_LIMITS + ONE_ROW_X_ROW_LIMITS_FAST_MEMORY
                                for d in (-1, 0) if mib > 0})  # fmt: skip


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
@pytest.mark.parametrize("packed_mib", X_ROW_LIMIT_SIZES_MIB, ids=lambda mib: f"{mib}MiB")
def test_gemv_x_rows_limit_by_size(packed_mib):
    shape = (packed_mib * 256, 8192)
    assert shape[0] * shape[1] // 2 // 2**20 == packed_mib and one_row_kernel_takes(shape, 64, False)
    quantized = bnb_quantize(shape, "nf4", 64, False, device="cuda" if bnb_cuda_works() else "cpu")
    packed, args = quantized.packed.cuda(), nf4_ops.quant_state_args(state_on(quantized, "cuda"))
    for rows in (2, 3):
        x = random_x((rows, shape[1]), torch.bfloat16, "cuda")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            out = torch.ops.nf4.gemv(x, packed, **args)
            torch.cuda.synchronize()
        names = [event.name for event in profile.events()]
        kernel = "one_row_gemv_kernel" if rows <= one_row_max_x_rows(shape) else "tc_gemv_kernel"
        assert sum(kernel in name for name in names) == 1 and sum("gemv_kernel" in n for n in names) == 1, names
        assert_gemv_close(out, x, packed, args)


# csrc/ops.h kWarpgroupXRows and kWarpgroupXRowsFastMemory, at each of their sizes: fp16 / bf16 x of 4-16 rows on
# weights just below and at each range's size (K = 8192: more 16-row tiles than SMs) take the warpgroup kernel where
# this GPU's range has those rows, else the tensor-core kernel; 6 and 7 rows straddle the H200's start from 48 MiB, 8
# and 9 its start from 100 MiB.
WARPGROUP_SIZES_MIB = sorted({entry[0] + d for entry in WARPGROUP_X_ROWS + WARPGROUP_X_ROWS_FAST_MEMORY
                              for d in (-1, 0) if entry[0] > 0})  # fmt: skip


@pytest.mark.skipif(not warpgroup_kernel_on(), reason="needs an sm_90 GPU, sm_90a code and NF4_OPS_WGMMA not 0")
@pytest.mark.parametrize("packed_mib", WARPGROUP_SIZES_MIB, ids=lambda mib: f"{mib}MiB")
def test_gemv_warpgroup_rows_by_size(packed_mib):
    shape = (packed_mib * 256, 8192)
    assert shape[0] * shape[1] // 2 // 2**20 == packed_mib
    quantized = bnb_quantize(shape, "nf4", 64, False, device="cuda" if bnb_cuda_works() else "cpu")
    packed, args = quantized.packed.cuda(), nf4_ops.quant_state_args(state_on(quantized, "cuda"))
    for rows in (4, 6, 7, 8, 9, 16):
        x = random_x((rows, shape[1]), torch.bfloat16, "cuda")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            out = torch.ops.nf4.gemv(x, packed, **args)
            torch.cuda.synchronize()
        names = [event.name for event in profile.events()]
        kernel = "wg_gemv_kernel" if warpgroup_takes(shape, rows) else "tc_gemv_kernel"
        assert sum(kernel in name for name in names) == 1 and sum("gemv_kernel" in n for n in names) == 1, names
        assert_gemv_close(out, x, packed, args)


# csrc/ops.h kOneRowFp32RowLimits: fp32 x on a W that the one-row kernel takes runs one launch of it that takes the
# rows of x one after another, up to these many rows by the packed W's size in MiB, then dequantize + cuBLAS.
ONE_ROW_FP32_ROW_LIMITS = [(0, 7), (4, 16), (5, 8), (16, 9)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
@pytest.mark.parametrize(
    "steps, half_step, steps_per_warp", [(17, False, 8), (10, False, 1), (11, True, 2)], ids=["16.5MiB", "2MiB", "half"]
)
def test_gemv_fp32_rows(steps, half_step, steps_per_warp, nested):
    """fp32 x of several rows on the one-row kernel: one launch for all of them, each row the same bits as that
    row alone, up to the limit for this size of W; one row more takes dequantize + cuBLAS. Rows that end in a half
    step (K % 512 == 256) too, where a row's upper lanes must not read into the next row of x; plain and nested
    absmax."""
    shape = one_row_shape(steps, half_step, steps_per_warp)
    assert one_row_kernel_takes(shape, 64, nested)
    limit = row_limit(ONE_ROW_FP32_ROW_LIMITS, shape)
    packed, args = weight_on("cuda", shape, "nf4", 64, nested)
    x = random_x((limit + 1, shape[1]), torch.float32, "cuda")
    bias = random_x((shape[0],), torch.float32, "cuda", seed=8)
    for rows in (2, limit, limit + 1):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            out = torch.ops.nf4.gemv(x[:rows], packed, bias=bias, **args)
            torch.cuda.synchronize()
        names = [event.name for event in profile.events()]
        one_row_launches = sum("one_row_gemv_kernel" in name for name in names)
        if rows <= limit:
            assert one_row_launches == 1 and not any("dequantize" in name for name in names), names
            for row in range(rows):
                alone = torch.ops.nf4.gemv(x[row : row + 1], packed, bias=bias, **args)
                assert torch.equal(out[row : row + 1], alone), f"row {row} of {rows}"
        else:
            assert one_row_launches == 0 and any("dequantize" in name for name in names), names
        assert_gemv_close(out, x[:rows], packed, args, bias)


# (steps per tile, last step a half step, blocksize, quant_type, steps per warp, x's dtype): nested absmax on a W that
# the one-row kernel takes, at blocksizes of one segment, of two and of a whole step, rows ending in a half step,
# and the kernel's minimum of 1 step per warp.
ONE_ROW_NESTED_CASES = [
    (17, False, 64, "nf4", 8, torch.bfloat16),
    (11, True, 128, "fp4", 2, torch.float16),
    (10, False, 512, "nf4", 2, torch.bfloat16),
    (10, False, 512, "nf4", 1, torch.bfloat16),
    (17, False, 64, "nf4", 8, torch.float32),
    (11, True, 128, "fp4", 2, torch.float32),
    (10, False, 512, "nf4", 1, torch.float32),
]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
@pytest.mark.parametrize("nested_blocksize", [256, 32], ids=["nbs256", "nbs32"])
@pytest.mark.parametrize(
    "case",
    ONE_ROW_NESTED_CASES,
    ids=lambda c: f"steps{c[0]}{'-half' if c[1] else ''}-bs{c[2]}-{c[3]}-{c[4]}perwarp-{dtype_id(c[5])}",
)
def test_gemv_nested_one_row(case, nested_blocksize):
    """Nested absmax on the one-row kernel (its codes loaded with the weights, turned into scales from shared-memory
    tables: csrc/gemv.cu kOrNestedMaxBlocks), at one row and at 3 for fp32 x (rows one after another) or the most
    rows of fp16 / bf16 x decoded together on this W (one_row_max_x_rows): within the tolerance rule, each row
    the same bits as that row alone and on every run, and the same bits as the one-row kernel on the plain absmax
    that the nested values stand for (nf4_ops.reference.absmax_reference: bitsandbytes' nested math, two roundings,
    as dequantize's)."""
    steps, half_step, blocksize, quant_type, steps_per_warp, dtype = case
    shape = one_row_shape(steps, half_step, steps_per_warp)
    assert one_row_kernel_takes(shape, blocksize, True, nested_blocksize)
    packed, args = weight_on("cuda", shape, quant_type, blocksize, True)
    # bitsandbytes quantizes the absmax in blocks of 256; other nested blocksizes are valid op input too (the nested
    # absmax values are taken as they are), so the test re-blocks the same codes with one value per 32 blocks, which
    # does not divide a row's blocks (the CTAs' ranges and the rows then start anywhere in a nested block)
    if nested_blocksize != 256:
        blocks = args["absmax"].numel()
        generator = torch.Generator().manual_seed(11)
        args["nested_absmax"] = (torch.rand(-(-blocks // nested_blocksize), generator=generator) + 0.5).cuda()
        args["nested_blocksize"] = nested_blocksize
    x = random_x((3, shape[1]), dtype, "cuda")
    bias = random_x((shape[0],), dtype, "cuda", seed=9)
    plain_absmax = absmax_reference(args["absmax"], args["nested_absmax"], args["nested_code"], args["nested_offset"],
                                    args["nested_blocksize"])
    plain_args = {name: args[name] for name in ("blocksize", "quant_type", "shape")} | {"absmax": plain_absmax}
    for rows in (1, 3) if dtype == torch.float32 else (1, one_row_max_x_rows(shape)):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            out = torch.ops.nf4.gemv(x[:rows], packed, bias=bias, **args)
            torch.cuda.synchronize()
        names = [event.name for event in profile.events()]
        assert sum("one_row_gemv_kernel" in name for name in names) == 1, names
        assert sum("gemv_kernel" in name for name in names) == 1 and not any("dequantize" in n for n in names), names
        assert_gemv_close(out, x[:rows], packed, args, bias)
        assert torch.equal(torch.ops.nf4.gemv(x[:rows], packed, bias=bias, **plain_args), out)
        assert torch.equal(torch.ops.nf4.gemv(x[:rows], packed, bias=bias, **args), out)  # the same bits every run
        for row in range(rows):
            alone = torch.ops.nf4.gemv(x[row : row + 1], packed, bias=bias, **args)
            assert torch.equal(out[row : row + 1], alone), f"row {row} of {rows}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=dtype_id)
def test_gemv_nested_one_row_half_step_stays_in_row(dtype):
    """Rows that end in a half step (K % 512 == 256): the upper lanes of a row's last step lie in the next row's
    blocks, and on nested absmax the one-row kernel must not let the next row's scale reach this row's sum. With
    K = 5376, blocksize 128 (42 blocks a row) and nested blocks of 32, nested block 21 holds blocks 672-703, all of
    row 16 and the first of them where row 15's last step overruns; an Inf there must leave every other row's output
    as it was, bit for bit (row 16 itself turns non-finite, as its scales are)."""
    shape = one_row_shape(11, True, 2)
    assert shape[1] == 5376 and one_row_kernel_takes(shape, 128, True, 32)
    packed, args = weight_on("cuda", shape, "nf4", 128, True)
    blocks = args["absmax"].numel()
    generator = torch.Generator().manual_seed(12)
    args["nested_absmax"] = (torch.rand(-(-blocks // 32), generator=generator) + 0.5).cuda()
    args["nested_blocksize"] = 32
    x = random_x((1, shape[1]), dtype, "cuda")
    finite = torch.ops.nf4.gemv(x, packed, **args)
    args["nested_absmax"][21] = float("inf")
    with_inf = torch.ops.nf4.gemv(x, packed, **args)
    others = torch.arange(shape[0], device="cuda") != 16
    assert torch.isfinite(finite).all() and not torch.isfinite(with_inf[0, 16])
    assert torch.equal(with_inf[:, others], finite[:, others])


# The many-rows kernel (csrc/gemv_many_rows.cu) takes 17 up to a limit of rows of fp16 / bf16 x that depends on W's
# packed size and the GPU's memory (csrc/ops.h kManyRowsGemvRowLimits: 32 under 5 MiB, 64 from 5 MiB, 96 from 16 MiB;
# on memory of 4 TB/s or more, kManyRowsGemvRowLimitsFastMemory: 32 under 16 MiB, 64 from 16 MiB) in tiles of 128 W
# rows by 32 rows of x over all of K (steps of 64), each x tile's steps cut into runs, one per CTA (stream-K).
# "whole_tiles": K = 512 (8 steps, kMrMinStepsPerCta) gives one CTA per tile, each writing its outputs, with a last
# tile of 88 rows (its other 40 copy nothing). "shared_tiles": 3 tiles of 128 rows (the last of 44) by 84 steps over
# 31 CTAs, so every tile is shared by several runs (some holding fewer of its steps than the ring's stages) and a
# second kernel adds their fp32 parts in order. "runs_across_tiles" (14 MiB): 450 tiles of 8 steps, more than an
# H100's resident CTAs (264 at 17-32 rows, 132 per x tile at 33-64), so that runs there start and end inside tiles
# and some hold whole ones (on other GPUs the runs differ, so whether parts are added is asserted only for the first
# two shapes). "three_x_tiles" (30.3 MiB): 61 tiles of 128 steps, the last of 88 rows, at 65-96 rows three groups of
# CTAs, one per tile of x; on it a last tile of x of up to 8 rows (csrc/ops.h kManyRowsTailRowLimits) takes a launch of
# its own (the tensor-core or one-row kernel), and those rows must equal a call of them alone, bit for bit, as the
# whole tiles' rows must equal a call of those. 17 and 41 rows leave a tile of x part empty (33, 40, 65 and 72 only
# on the other shapes: on this one their last rows go apart), 80 the third (16 last rows, too many to go apart), 32
# fills one, 64 two and 96 three; past the limit, dequantize + cuBLAS. name: (shape, blocksize, the limit, the limit
# on fast memory, the most last rows that take a launch of their own).
MANY_ROWS_SHAPES = {
    "whole_tiles": ((128 * 6 - 40, 512), 64, 32, 32, 0),
    "shared_tiles": ((300, 256 * 21), 128, 32, 32, 0),
    "runs_across_tiles": ((128 * 450 - 24, 512), 64, 64, 32, 0),
    "three_x_tiles": ((128 * 61 - 40, 8192), 64, 96, 64, 8),
}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
@pytest.mark.parametrize("shape_name", list(MANY_ROWS_SHAPES))
def test_gemv_many_rows(shape_name, nested, dtype):
    shape, blocksize, max_rows, fast_memory_max_rows, max_tail_rows = MANY_ROWS_SHAPES[shape_name]
    max_rows = fast_memory_max_rows if has_fast_memory() else max_rows
    packed, args = weight_on("cuda", shape, "fp4" if nested else "nf4", blocksize, nested)
    x = random_x((100, shape[1]), dtype, "cuda")
    bias = random_x((shape[0],), dtype, "cuda", seed=7)
    for rows in (17, 32, 33, 40, 41, 64, 65, 72, 80, 96, 97, 100):
        row_bias = bias if rows % 2 else None
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            out = torch.ops.nf4.gemv(x[:rows], packed, bias=row_bias, **args)
            torch.cuda.synchronize()
        names = [event.name for event in profile.events()]
        takes = rows <= max_rows
        assert sum("many_rows_gemv_kernel" in name for name in names) == takes, (rows, names)
        tail = rows % 32 if takes and rows > 32 and rows % 32 <= max_tail_rows else 0
        launches = sum(any(k in name for k in ("tc_gemv_kernel", "wg_gemv_kernel", "one_row_gemv_kernel"))
                       for name in names)  # fmt: skip
        if not takes:  # past the limit: dequantize + cuBLAS
            assert launches == 0 and any("dequantize" in name for name in names), names
        else:
            assert launches == (tail > 0), (rows, names)
            parts = any("add_run_parts_kernel" in name for name in names)
            if shape_name in ("whole_tiles", "shared_tiles"):
                assert parts == (shape_name == "shared_tiles"), names
        if tail:
            for first, last in ((0, rows - tail), (rows - tail, rows)):
                alone = torch.ops.nf4.gemv(x[first:last], packed, bias=row_bias, **args)
                assert torch.equal(out[first:last], alone), f"rows {first}-{last} of {rows}"
        assert_gemv_close(out, x[:rows], packed, args, row_bias)
        assert torch.equal(torch.ops.nf4.gemv(x[:rows], packed, bias=row_bias, **args), out)  # the same bits every run


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
@pytest.mark.parametrize("rows", [1, 8, 24], ids=lambda m: f"M{m}")  # one-row, tensor-core, many-rows kernels
def test_back_to_back_calls_see_what_the_call_before_did(rows):
    """On sm_90 a kernel may start while the one before it finishes (programmatic dependent launch, csrc/cuda_types.cuh)
    and must touch no global memory until that one is done: calls queued back to back, each reading what the call
    before wrote or overwriting what it read, give the bits of the same calls made one at a time, and those are
    right. (The 4096 x 4096 weights are 8 MiB: 8 rows take the warpgroup kernel on an H100 and an H200 (the
    tensor-core kernel elsewhere) and the adding kernel, 24 the many-rows kernel and its adding kernel.)"""
    k = 4096
    first_w, first_args = weight_on("cuda", (k, k), "nf4", 64, False)
    second_w, second_args = weight_on("cuda", (k, k), "fp4", 64, True)
    x_w, x_args = weight_on("cuda", (rows, k), "nf4", 64, False)  # dequantized over x once the first gemv read it
    bias = random_x((k,), torch.bfloat16, "cuda", seed=3)
    absmax = torch.rand(rows * 4 * k // 64, generator=torch.Generator().manual_seed(2)).add(0.5).cuda()

    def calls(x, between):
        """The calls, with between() after each; returns their results and x as the calls left it."""
        results = [torch.ops.nf4.gemv(x, first_w, **first_args)]  # reads x
        between()
        torch.ops.nf4.dequantize.out(x_w, dtype=torch.bfloat16, out=x, **x_args)  # overwrites x
        between()
        results.append(torch.ops.nf4.gemv(results[0], second_w, bias=bias, **second_args))  # the first call's output
        between()
        # the bytes that gemv wrote, as a packed weight
        results.append(torch.ops.nf4.dequantize(results[1].view(torch.uint8), absmax, 64, "nf4", [rows * 4, k],
                                                torch.bfloat16))
        between()
        return results + [x]

    x = random_x((rows, k), torch.bfloat16, "cuda")
    one_at_a_time = calls(x.clone(), between=torch.cuda.synchronize)
    # right, not only repeatable (a missing wait inside one call, before an adding kernel, would be in both runs)
    assert_gemv_close(one_at_a_time[0], x, first_w, first_args)
    assert_gemv_close(one_at_a_time[1], one_at_a_time[0], second_w, second_args, bias)
    x_args_cpu = {name: v.cpu() if torch.is_tensor(v) else v for name, v in x_args.items()}
    expected_x = torch.ops.nf4.dequantize(x_w.cpu(), dtype=torch.bfloat16, **x_args_cpu)
    assert torch.equal(one_at_a_time[3].cpu(), expected_x)
    expected_bytes = torch.ops.nf4.dequantize(one_at_a_time[1].view(torch.uint8).cpu(), absmax.cpu(), 64, "nf4",
                                              [rows * 4, k], torch.bfloat16)
    assert torch.equal(one_at_a_time[2].cpu(), expected_bytes)
    for _ in range(5):
        x_again = x.clone()
        torch.cuda.synchronize()
        # the GPU busy for ~10 ms, so that the calls below are all queued behind it and follow each other at once
        # (issued from Python one by one, kernels this small would otherwise find an idle GPU each time)
        torch.cuda._sleep(20_000_000)
        back_to_back = calls(x_again, between=lambda: None)
        torch.cuda.synchronize()
        names = ("first gemv", "second gemv", "dequantize of its bytes", "x overwritten")
        for name, got, expected in zip(names, back_to_back, one_at_a_time):
            assert torch.equal(got, expected), name


@pytest.mark.parametrize("device", ALL_DEVICES)
def test_gemv_is_deterministic(device):
    # on CUDA: one CTA per tile, and tiles shared by several CTAs' warps, or warpgroups (csrc/gemv.cu)
    for shape in [(256, 1024), (40, 4352), (40, 256 * 67)]:
        packed, args = weight_on(device, shape, "nf4", 64, True)
        for rows in (4, 16):
            x = random_x((rows, shape[1]), torch.bfloat16, device)
            first = torch.ops.nf4.gemv(x, packed, **args)
            for _ in range(3):
                assert torch.equal(torch.ops.nf4.gemv(x, packed, **args), first)


@pytest.mark.parametrize("device", ALL_DEVICES)
def test_python_wrapper(device):
    quantized = bnb_quantize((48, 320), "nf4", 64, True)
    state = state_on(quantized, device)
    packed = quantized.packed.to(device)
    x = random_x((2, 320), torch.bfloat16, device)
    bias = random_x((48,), torch.bfloat16, device, seed=4)
    out = nf4_ops.gemv(x, packed, state, bias=bias)
    assert torch.equal(out, torch.ops.nf4.gemv(x, packed, bias=bias, **nf4_ops.quant_state_args(state)))
    assert_gemv_close(out, x, packed, nf4_ops.quant_state_args(state), bias)
