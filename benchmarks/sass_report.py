"""What the compiler made of the built kernels: per sm_90 kernel instance of the extension, its instruction count
and the opcodes benchmarks/NOTES.md has read them by. A static view of the machine code, no GPU needed: it reads the
built extension (`nf4_ops/_C*.so`, with sm_90 code, as CI and scripts/gpu_suite.sh build it) with cuobjdump.

    python benchmarks/sass_report.py          # the one-row, tensor-core and many-rows kernels
    python benchmarks/sass_report.py --all    # every kernel

Columns: R2UR, conversions into uniform registers; LDL / STL, local-memory (spill) loads and stores; SHFL, LDS,
LDG, HMMA, the shuffles, shared and global loads and mmas. One thing it watches: in the one-row kernel's
plain-absmax instances ptxas may hold the global memory descriptor (every load's desc[UR] operand) in vector
registers and convert it before every load, ~190 R2UR where there are otherwise 0-4, which cost 1-2% at one row
(NOTES gemv rows 71-74). The load after the wait that keeps it uniform steers the compiler's choice but no rule
fixes it (in the many-rows kernel an unconditional first load alone does not), so the report says when the
conversions are back. A report, not a test: it exits 0.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_kernel_binary import cuobjdump, sm90_kernels  # the one SASS parser (the programmatic-launch test's)

COLUMNS = ("R2UR", "LDL", "STL", "SHFL", "LDS", "LDG", "HMMA")
DEFAULT_KERNELS = ("one_row_gemv_kernel", "tc_gemv_kernel", "many_rows_gemv_kernel")
# More conversions than this in a one-row instance: the memory descriptor converted per load (see above).
DESCRIPTOR_R2UR_LIMIT = 16
# Template arguments as the mangled names spell them.
MANGLED_ARGUMENTS = [(r"^f", "fp32,"), (r"13__nv_bfloat16", "bf16,"), (r"6__half", "fp16,"), (r"Lb([01])E", r"\1,"),
                     (r"Li(\d+)E", r"\1,")]


def readable(mangled: str) -> tuple[str, str]:
    """(kernel name, its template arguments) from a mangled sm_90 function name."""
    # the kernel's own name is length-prefixed (Itanium mangling): the digits right before it give its length
    for m in re.finditer(r"(?=(\d{1,2})([A-Za-z_]\w*?_kernel)(I.*?EEv|E))", mangled):
        if int(m.group(1)) == len(m.group(2)):
            break
    else:
        return mangled, ""
    arguments = m.group(3)[1:-3] if m.group(3).startswith("I") else ""
    for pattern, replacement in MANGLED_ARGUMENTS:
        arguments = re.sub(pattern, replacement, arguments)
    return m.group(2), arguments.rstrip(",")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--all", action="store_true", help="every kernel, not only the gemv kernels")
    args = parser.parse_args()
    import nf4_ops._C as extension

    tool = cuobjdump()
    if tool is None:
        print("no cuobjdump on this machine: nothing to report")
        return 0
    sass = subprocess.run([tool, "-sass", extension.__file__], capture_output=True, text=True).stdout
    kernels = sm90_kernels(sass)
    if not kernels:
        print(f"{extension.__file__} has no sm_90 code: nothing to report")
        return 0
    rows = []
    for mangled, opcodes in kernels.items():
        name, arguments = readable(mangled)
        if args.all or name in DEFAULT_KERNELS:
            counts = Counter(opcodes)
            rows.append((name, arguments, len(opcodes), [counts[c] for c in COLUMNS]))
    rows.sort()
    print(f"sm_90 SASS of {extension.__file__}")
    print()
    print("| kernel | template arguments | instructions | " + " | ".join(COLUMNS) + " |")
    print("| --- | --- | --- |" + " --- |" * len(COLUMNS))
    for name, arguments, total, counts in rows:
        print(f"| {name} | {arguments} | {total} | " + " | ".join(str(c) for c in counts) + " |")
    one_row = [(arguments, counts[0]) for name, arguments, _, counts in rows if name == "one_row_gemv_kernel"]
    converting = [arguments for arguments, r2ur in one_row if r2ur > DESCRIPTOR_R2UR_LIMIT]
    print()
    print(f"one-row instances converting the memory descriptor per load (R2UR > {DESCRIPTOR_R2UR_LIMIT}): "
          f"{len(converting)} of {len(one_row)}" + (f" ({'; '.join(converting)})" if converting else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
