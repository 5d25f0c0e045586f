#!/usr/bin/env bash
# A same-machine A/B of kernel changes, the way benchmarks/NOTES.md measures them: the tree (base) against the tree
# with the given patches applied (var), both built in parallel for the visible GPU; the benchmark (one pass each,
# with the rows-of-x sweep) in the order var, base, var, base; then with var the SASS report's last line, the gemv
# and kernel-binary tests, memcheck and racecheck. Writes run<i>_<var|base>.json, checks.txt and gpu.txt to $OUT
# (default ./gpu-ab; no more files, as the device tool brings back few); benchmarks/compare_runs.py $OUT compares
# them. AB_CHECKS=0 skips var's SASS line, tests and sanitizers (a timing-only variant, e.g. one that routes
# calls away from what the tests assert).
#   bash scripts/gpu_ab.sh benchmarks/experiments/one_row_flush_shed.diff [more.diff ...]
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[ $# -ge 1 ] || { echo "usage: bash scripts/gpu_ab.sh PATCH.diff [PATCH.diff ...]"; exit 2; }
root=$PWD OUT="${OUT:-$PWD/gpu-ab}" PY="${PYTHON:-python3}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi
site=""; [ -d .gpu/site ] && site="$root/.gpu/site:"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt" ||
  { echo "no NVIDIA GPU here (nvidia-smi failed)"; exit 1; }
start=$SECONDS
ARCH=$("$PY" -c "import torch; print('.'.join(map(str, torch.cuda.get_device_capability())))")
[ "$ARCH" = 9.0 ] && ARCH=9.0a  # H100 / H200: sm_90a code, which has the warpgroup kernel (setup.py)
var=$(mktemp -d)
cp -r nf4_ops setup.py pyproject.toml benchmarks tests scripts csrc "$var/"
for patch_file in "$@"; do
  (cd "$var" && patch -s -p1 < "$root/$patch_file") || { echo "$patch_file does not apply to the tree"; exit 1; }
done
jobs=$(( $(nproc) / 2 ))
(cd "$var" && TORCH_CUDA_ARCH_LIST=$ARCH MAX_JOBS=$jobs "$PY" setup.py build_ext --inplace > "$var/build.log" 2>&1) &
TORCH_CUDA_ARCH_LIST=$ARCH MAX_JOBS=$jobs "$PY" setup.py build_ext --inplace > "$var/build_base.log" 2>&1 ||
  { tail -30 "$var/build_base.log"; exit 1; }
wait
ls "$var"/nf4_ops/_C*.so > /dev/null 2>&1 || { tail -30 "$var/build.log"; exit 1; }
echo "builds $((SECONDS - start)) s"
i=0
for variant in var base var base; do
  i=$((i + 1)); dir=$root; [ $variant = var ] && dir=$var
  (cd "$dir" && PYTHONPATH="$site$dir" "$PY" benchmarks/bench_kernels.py --rounds 1 --out "$var/run$i" > "$var/run$i.log" 2>&1)
  echo "bench $variant rc=$? $((SECONDS - start)) s"
  cp "$var/run$i/kernels.json" "$OUT/run${i}_$variant.json"
done
[ "${AB_CHECKS:-1}" = 0 ] && { echo "AB_CHECKS=0: no checks of var"; echo "done $((SECONDS - start)) s"; exit 0; }
cd "$var"
export PYTHONPATH="$site$var"
"$PY" benchmarks/sass_report.py | tail -n 1 | tee "$OUT/checks.txt"
"$PY" -m pytest tests/test_kernel_binary.py tests/test_gemv.py -q -p no:cacheprovider 2>&1 | tail -n 1 |
  sed 's/^/var gemv tests: /' | tee -a "$OUT/checks.txt"
echo "tests $((SECONDS - start)) s"
for tool in memcheck racecheck; do
  compute-sanitizer --tool $tool --error-exitcode 1 "$PY" scripts/sanitizer_workload.py > "$var/$tool.log" 2>&1
  echo "var $tool rc=$?" | tee -a "$OUT/checks.txt"
  grep -E "mismatch|ERROR SUMMARY|RACECHECK SUMMARY" "$var/$tool.log" | head -n 4 | tee -a "$OUT/checks.txt"
done
echo "done $((SECONDS - start)) s"
