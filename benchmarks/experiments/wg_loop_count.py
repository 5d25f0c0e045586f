"""The warpgroup kernel's hot loop, counted in sm_90a SASS (NOTES gemv row 103): for each wg_gemv_kernel instance of
a compiled object or extension, the innermost loop that holds its wgmmas (HGMMA), its instruction count, and the count
without the flush branch (the code after the turn's last wgmma wait that writes a finished tile, which runs once per
tile, not per turn), by opcode. No GPU needed.

    nvcc -std=c++20 -O3 -gencode arch=compute_90a,code=sm_90a -DNF4_WGMMA_SM90A=1 <torch and python includes> \
        -Icsrc -c csrc/gemv.cu -o /tmp/gemv.o
    python benchmarks/experiments/wg_loop_count.py /tmp/gemv.o [more objects to compare]
"""

from __future__ import annotations

import collections
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from test_kernel_binary import cuobjdump  # noqa: E402  (the one place that finds cuobjdump)

INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);")
TARGET = re.compile(r"0x([0-9a-f]+)")


def functions(sass: str):
    """(name, [(address, instruction without its predicate)]) per function of the SASS text."""
    for chunk in re.split(r"\n\s*Function : ", sass)[1:]:
        name = chunk.split("\n", 1)[0].strip()
        code = [(int(m.group(1), 16), re.sub(r"^@!?U?P\w+\s+", "", m.group(2).strip())) for m in INSTRUCTION.finditer(chunk)]
        yield name, code


def hot_loop(code):
    """(loop instructions, instructions without the flush branch) of the innermost backward branch's loop that holds
    an HGMMA and an LDGSTS."""
    loops = []
    for address, text in code:
        if text.startswith("BRA") and (target := TARGET.search(text)) and int(target.group(1), 16) < address:
            loops.append((int(target.group(1), 16), address))
    # the turn loop stages weights (LDGSTS) and runs wgmmas; an mbarrier wait's retry branch, placed after the
    # function's main code, jumps back into the loop and spans HGMMAs too, but no LDGSTS
    loops = [(a, b) for a, b in loops
             if all(any(a <= x <= b and t.startswith(op) for x, t in code) for op in ("HGMMA", "LDGSTS"))]
    start, end = min(loops, key=lambda loop: loop[1] - loop[0])
    body = [(x, t) for x, t in code if start <= x <= end]
    last_wait = max(i for i, (_, t) in enumerate(body) if t.startswith("WARPGROUP.DEPBAR.LE gsb0, 0x0"))
    branch_at, branch = next((x, t) for x, t in body[last_wait:] if t.startswith("BRA"))
    skip_to = int(TARGET.search(branch).group(1), 16)
    return body, [(x, t) for x, t in body if not branch_at < x < skip_to]


def main() -> None:
    tool = cuobjdump()
    if tool is None:
        sys.exit("no cuobjdump found")
    for path in sys.argv[1:]:
        sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout
        for name, code in functions(sass):
            if "wg_gemv_kernel" not in name:
                continue
            body, hot = hot_loop(code)
            opcodes = collections.Counter(t.split()[0].split(".")[0] for _, t in hot)
            instance = re.sub(r"EEEvPKT.*", "", name.split("wg_gemv_kernelI", 1)[1])
            print(f"{Path(path).name} {instance}: loop {len(body)}, a turn without the flush {len(hot)}: "
                  + " ".join(f"{op} {n}" for op, n in opcodes.most_common(12)))


if __name__ == "__main__":
    main()
