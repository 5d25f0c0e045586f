"""The end-to-end decode benchmark (benchmarks/bench_decode.py) runs its three variants through on the CPU (steps of a
small model, with eager ops and compiled) and writes a time for each; it is a benchmark, so this checks that it runs and reports, not its
numbers. The GPU is hidden from it: its GPU path (CUDA-graph replays of Llama-3.3-70B-shaped layers) runs as the GPU
suite's DECODE=1 step, which fails when a variant fails, and would add its model's set-up to a pytest run that is
already most of the suite's time on the GPU machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_decode_benchmark_times_every_variant(tmp_path, compiled):
    args = ["--layers", "1", "--batch", "1", "2", "--prompt", "8", "--replays", "2", "--repeats", "2"]
    args += ["--compile"] * compiled
    child = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_decode.py"), *args, "--out", str(tmp_path)],
                           cwd=ROOT, capture_output=True, text=True, timeout=600,
                           env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    results = json.loads((tmp_path / "decode.json").read_text())
    assert "errors" not in results, results["errors"]
    assert results["compiled"] is compiled
    if compiled:  # each variant's step compiled as one graph, which ran without compiling again
        assert set(results["compiled_graphs"].values()) == {1}, results["compiled_graphs"]
    for batch in ("1", "2"):
        assert set(results["steps"][batch]) == {"bf16", "bitsandbytes", "nf4-ops"}
        assert all(ms > 0 for ms in results["steps"][batch].values()), results["steps"][batch]
    weights = results["linear_weight_bytes"]
    assert weights["nf4-ops"] == weights["bitsandbytes"] < weights["bf16"] / 3  # 4-bit codes and their scales
    assert (tmp_path / "decode.png").stat().st_size > 0
    assert "| nf4-ops | 2 |" in child.stdout
