"""The dequantize variants benchmark's variant list and summary (benchmarks/bench_dequantize_variants.py and its table
in benchmarks/report.py); the timings
themselves come from a GPU run, not from tests."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_dequantize_variants as bdv  # noqa: E402
from report import dequantize_variants_table  # noqa: E402
from conftest import BLOCKSIZES, FLOAT_DTYPES, QUANT_TYPES  # noqa: E402


def test_variants_cover_every_quant_type_dtype_and_blocksize():
    found = bdv.variants()
    assert len({v.name for v in found}) == len(found)
    assert {v.quant_type for v in found} == set(QUANT_TYPES)
    assert {v.dtype for v in found} == set(FLOAT_DTYPES)
    for nested in (False, True):
        assert {v.blocksize for v in found if v.nested == nested} == set(BLOCKSIZES)


def test_moved_bytes_count_the_output_dtype_and_the_absmax_kind():
    plain32 = bdv.Variant("nf4", torch.float32, 64, False)
    nested16 = bdv.Variant("nf4", torch.bfloat16, 64, True)
    # 4096 elements: 2048 packed bytes, 64 blocks (256 fp32 absmax bytes, or 64 codes + one fp32 nested value)
    assert plain32.moved_bytes(64, 64) == 2048 + 256 + 4096 * 4
    assert nested16.moved_bytes(64, 64) == 2048 + 64 + 4 + 4096 * 2


def test_summary_names_the_least_layer_and_the_medians():
    def point(layer, us, bnb_us):  # 1e6 bytes in `us` microseconds: 1000 / us GB/s
        return {"model": "m", "layer": layer, "moved_bytes": 1_000_000, "nf4ops_us": us, "bnb_us": bnb_us}

    results = {"copy_GBps": 1000.0, "variants": [
        {"name": "nf4 bf16 bs64 plain", "layers": [point("a", 1.0, 1.5), point("b", 1.25, 1.5), point("c", 2.0, 2.0)]},
    ]}  # fmt: skip
    row = dequantize_variants_table(results).splitlines()[2]
    # % of the ceiling: 100, 80, 50 -> least 50 (layer c), median 80; speedups 1.5, 1.2, 1.0 -> least 1.00, median 1.20
    assert row == "| nf4 bf16 bs64 plain | 3 | 50 / 80 | m c | 1.00x / 1.20x |"


def test_summary_reads_each_layer_against_its_same_size_copy():
    def point(layer, us):  # 1e6 bytes in `us` microseconds: 1000 / us GB/s
        return {"model": "m", "layer": layer, "moved_bytes": 1_000_000, "nf4ops_us": us, "bnb_us": us}

    def copy(layer, out_bytes, memcpy_us, kernel_us):  # the faster of the two copies counts
        return {"model": "m", "layer": layer, "out_bytes": out_bytes, "moved_bytes": 1_000_000,
                "copy_same_bytes_memcpy": memcpy_us, "copy_same_bytes_kernel": kernel_us}  # fmt: skip

    # layer a's copy at 800 GB/s (1.25 us), b's at 500 (2.0 us); fp32 output's copies of a and b at 1000 GB/s
    copies = [copy("a", 2, 1.25, 1.5), copy("b", 2, 2.5, 2.0), copy("a", 4, 1.0, 1.0), copy("b", 4, 1.0, 1.0)]
    results = {"copy_GBps": 1000.0, "same_size_copies": copies, "variants": [
        {"name": "nf4 bf16 bs64 plain", "dtype": "bf16", "layers": [point("a", 1.25), point("b", 2.5)]},
        {"name": "nf4 fp32 bs64 plain", "dtype": "fp32", "layers": [point("a", 1.25), point("b", 2.5)]},
    ]}  # fmt: skip
    table = dequantize_variants_table(results).splitlines()
    assert table[0].endswith("| % of a same-size copy (least / median) |")
    # bf16: a at 800 of 800 GB/s (100%), b at 400 of 500 (80%); fp32: 80% and 40% of 1000
    assert table[2].endswith("| 80 / 90 |") and table[3].endswith("| 40 / 60 |")
