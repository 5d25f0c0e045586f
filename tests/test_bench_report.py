"""The kernel benchmark's tables (benchmarks/report.py) read each layer against a copy and a read of its own bytes
as well as against the 1 GiB ceilings; the timings themselves come from a GPU run, not from tests."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from report import (dequantize_bytes, dequantize_table, gemv_bytes, gemv_table,  # noqa: E402
                    same_size_read_bytes)

N, K, BLOCKSIZE = 1024, 4096, 64


def results(times_us: dict) -> dict:
    return {"blocksize": BLOCKSIZE, "ceilings_GBps": {"copy_GBps": 1000.0, "read_sum_GBps": 900.0,
                                                       "read_cublas_gemv_GBps": 1000.0},
            "rows": [{"layer": {"model": "m", "name": "l", "n": N, "k": K}, "times_us": times_us}]}  # fmt: skip


def last_cells(table: str) -> list[str]:
    return [c.strip() for c in table.splitlines()[-1].strip("|").split("|")]


def test_dequantize_reads_against_the_faster_same_size_copy():
    plain_bytes, nested_bytes = dequantize_bytes(N, K, BLOCKSIZE, False), dequantize_bytes(N, K, BLOCKSIZE, True)
    # the faster copy of plain_bytes (the kernel) takes 8 us; nf4-ops plain 10 us (80%), nested at half its rate
    times = {"nf4ops_dequant_plain": 10.0, "nf4ops_dequant_nested": 2 * 8.0 * nested_bytes / plain_bytes,
             "bnb_dequant_plain": 20.0, "bnb_dequant_nested": 30.0,
             "copy_same_bytes_memcpy": 9.0, "copy_same_bytes_kernel": 8.0}  # fmt: skip
    table = dequantize_table(results(times))
    assert "% of a same-size copy (plain / nested)" in table.splitlines()[0]
    assert last_cells(table)[-1] == "80 / 50"
    del times["copy_same_bytes_memcpy"], times["copy_same_bytes_kernel"]  # results from before the column
    assert "same-size" not in dequantize_table(results(times))


def test_gemv_reads_against_the_faster_same_size_read():
    moved = gemv_bytes(N, K, BLOCKSIZE, 1)
    read_bytes = same_size_read_bytes(K, moved)
    gemv_rows = read_bytes["read_same_bytes_gemv"] // (2 * K)
    assert gemv_rows % 256 == 0 and moved <= 2 * K * gemv_rows < moved + 2 * K * 256  # rounded up to 256 rows
    assert moved <= read_bytes["read_same_bytes_sum"] <= moved + 1
    # cuBLAS reads at 1000 GB/s, the sum at 500; nf4-ops moves `moved` at 900 GB/s: 90% of the faster read
    times = {"nf4ops_gemv_M1": moved / 900e3, "bnb_gemv_M1": 1.0, "cublas_gemv_M1": 1.0,
             "read_same_bytes_gemv": read_bytes["read_same_bytes_gemv"] / 1000e3,
             "read_same_bytes_sum": read_bytes["read_same_bytes_sum"] / 500e3}  # fmt: skip
    table = gemv_table(results(times))
    assert table.splitlines()[0].rstrip(" |").endswith("M=1 % of a same-size read")
    assert last_cells(table)[-1] == "90"
    times["read_same_bytes_sum"] = read_bytes["read_same_bytes_sum"] / 1800e3  # now the sum is the faster read
    assert last_cells(gemv_table(results(times)))[-1] == "50"
