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
