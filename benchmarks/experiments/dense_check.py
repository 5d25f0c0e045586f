# Run from the repository root on a CUDA machine: python benchmarks/experiments/dense_check.py (benchmarks/results/h100-3a2bfdd/dense_check.txt)
# Does dequantize + cuBLAS (bf16) pass the sanitizer workload's tolerance check on 300x5120 nested at 65 rows
# (past the many-rows limit), with torch's default bf16 reduced-precision reductions and without them?
import sys, torch
sys.path.insert(0, "scripts")
import sanitizer_workload as w
packed, args = w.random_weight(300, 256 * 20, 64, True)
for rows in (63, 65):
    for allow in (True, False):
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = allow
        print("rows", rows, "bf16 reduced-precision reduction", allow, "mismatches:", w.check_gemv(packed, args, rows, f"dense check {rows}"))
