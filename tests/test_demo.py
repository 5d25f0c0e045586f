"""The README's demo (examples/demo.py), run as a user runs it, on a small layer: it must report dequantize
bit-exact with bitsandbytes, gemv close to float64, and a timing table (on a GPU timed in CUDA graphs)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ALL_DEVICES

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo.py"


@pytest.mark.parametrize("device", ALL_DEVICES)
def test_demo_runs(device):
    env = dict(os.environ)
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # torch then sees no GPU, as on a CPU-only machine
    result = subprocess.run([sys.executable, str(DEMO), "--shape", "384", "1024", "--rows", "3"], env=env,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert ("device: CPU" in out) == (device == "cpu"), out
    assert "dequantize bit-exact with bitsandbytes: True" in out, out
    rel = float(re.search(r"relative error ([0-9.e+-]+)", out).group(1))
    assert rel < 1e-2, out  # bf16 output of a K = 1024 dot product: ~3e-3 against float64
    timed = re.findall(r"^\| (dequantize|matmul, 3 row\(s\)) \| ([0-9.]+) \| ([0-9.]+) \| ([0-9.]+)x \|$", out, re.M)
    assert [name for name, *_ in timed] == ["dequantize", "matmul, 3 row(s)"], out
    assert all(float(v) > 0 for _, *values in timed for v in values), out
    assert "unquantized bf16 weight" in out, out
    if device == "cuda":  # the heading says whether the copies went past L2: a layer this small stays within it
        assert re.search(r"copies of the packed weight, [0-9.]+ MiB, within the [0-9]+ MiB L2 cache", out), out
