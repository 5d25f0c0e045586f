"""The built CUDA kernels keep the programmatic-launch rule (csrc/cuda_types.cuh): in the sm_90 code of every kernel,
no instruction that touches global memory comes before the wait for the previous kernel (griddepcontrol.wait,
ACQBULK in SASS), and every kernel waits and lets the next kernel launch (launch_dependents, PREEXIT). A static
check of the machine code, which runs wherever the extension was built with sm_90 code and cuobjdump is at hand (the
CPU-only CI machine too: it builds the CUDA kernels); the compiler, not the source, decides where loads land."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import nf4_ops._C as extension

# SASS opcodes (before the first '.') that read or write global memory, or may (generic LD / ST, atomics, TMA).
GLOBAL_MEMORY_OPCODES = {"LDG", "STG", "LDGSTS", "ATOMG", "ATOM", "RED", "REDG", "LD", "ST", "UBLKCP", "UTMALDG",
                         "UTMASTG", "UBLKRED", "UTMAPF"}
WAIT, LET_NEXT_START = "ACQBULK", "PREEXIT"


def cuobjdump() -> str | None:
    candidates = [shutil.which("cuobjdump"), os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "cuobjdump")]
    try:  # triton ships one
        import triton

        candidates.append(str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"))
    except ImportError:
        pass
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def sm90_kernels(sass: str) -> dict[str, list[str]]:
    """Each sm_90 (or sm_90a, setup.py's default) function's opcodes in the order of its code, by name (with
    " [sm_90]" added to the names of a build's plain sm_90 code where it also has sm_90a code, so neither hides the
    other)."""
    kernels: dict[str, list[str]] = {}
    arch, name = None, None
    both = "arch = sm_90a" in sass and re.search(r"arch = sm_90\b", sass) is not None
    for line in sass.splitlines():
        if m := re.match(r"\s*arch = (sm_\d+a?)", line):
            arch, name = m.group(1), None
        elif m := re.match(r"\s*Function : (\S+)", line):
            name = m.group(1) if arch in ("sm_90", "sm_90a") else None
            if name and both and arch == "sm_90":
                name += " [sm_90]"
            if name:
                kernels[name] = []
        elif name and (m := re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", line)):
            kernels[name].append(m.group(1))
    return kernels


def test_every_kernel_waits_before_touching_global_memory():
    tool = cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump")
    result = subprocess.run([tool, "-sass", extension.__file__], capture_output=True, text=True)
    kernels = sm90_kernels(result.stdout)
    if not kernels:
        pytest.skip("the extension has no sm_90 code (a CPU-only build, or other targets)")
    assert len(kernels) >= 9, sorted(kernels)  # at least one instance of each of the 9 kernels
    # the warpgroup kernel's instances are wgmma code in a build that takes them (setup.py: NF4_WGMMA_SM90A), else
    # traps that no call reaches
    warpgroup = [opcodes for name, opcodes in kernels.items() if "wg_gemv_kernel" in name]
    assert warpgroup, sorted(kernels)
    if extension.wgmma_sm90a:
        assert all("HGMMA" in opcodes for opcodes in warpgroup)
    for name, opcodes in kernels.items():
        assert WAIT in opcodes and LET_NEXT_START in opcodes, f"{name}: no griddepcontrol wait / launch_dependents"
        before = [op for op in opcodes[: opcodes.index(WAIT)] if op in GLOBAL_MEMORY_OPCODES]
        assert not before, f"{name}: {before} before the wait for the previous kernel"


def test_sass_report_names_kernel_instances():
    """benchmarks/sass_report.py (the GPU suite's SASS table) names each instance by its kernel and template
    arguments, which its line on the one-row kernel's memory descriptor is read by."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from sass_report import readable

    prefix = "_ZN3nf439_GLOBAL__N__33047b72_7_gemv_cu_b4fe88c4"
    assert readable(prefix + "19one_row_gemv_kernelI13__nv_bfloat16Lb0ELb0ELb1ELi4EEEvPKT_PKhPKfNS_9QuantTypeEilliS5_"
                    "PS3_NS_11BlockScalesEi") == ("one_row_gemv_kernel", "bf16,0,0,1,4")
    assert readable(prefix + "19one_row_gemv_kernelIfLb1ELb1ELb0EEEvPKT_PKhPKfNS_9QuantTypeEilliS4_PS2_NS_11BlockScal"
                    "esEi") == ("one_row_gemv_kernel", "fp32,1,1,0")
    assert readable(prefix + "14tc_gemv_kernelI6__halfLi1ELi2ELb0ELb1EEEvPKT_PKhNS_11BlockScalesENS_9QuantTypeEilliS"
                    "5_PS3_Pf") == ("tc_gemv_kernel", "fp16,1,2,0,1")
    assert readable("not_a_mangled_name") == ("not_a_mangled_name", "")


def test_report_header_names_the_chain_length():
    """benchmarks/report.py's header says how many calls each timed graph held when it was more than one per weight
    copy (bench_kernels.py's default, 16), and says nothing for runs with one call per copy (--min-calls 1, and runs
    from before the option)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from report import header_line

    env = {"gpu": "G", "driver": "d", "torch": "t", "cuda": "c", "bitsandbytes": "b"}
    ceilings = {"copy_GBps": 1.0, "read_sum_GBps": 1.0, "read_cublas_gemv_GBps": 1.0}
    results = {"env": env, "ceilings_GBps": ceilings, "quant_type": "nf4", "blocksize": 64, "rounds": 1,
               "rows": [{"times_us": {}}]}
    assert "timed graph" not in header_line(results)
    assert "timed graph" not in header_line({**results, "min_graph_calls": 1})
    assert "each timed graph holding at least 16 calls" in header_line({**results, "min_graph_calls": 16})
