#!/usr/bin/env bash
# The whole suite on a machine with an NVIDIA GPU, in one command: build the extension for this GPU, run
# the tests (CUDA ones included), compute-sanitizer memcheck and racecheck, the kernel benchmark and the dequantize
# variants benchmark.
# Prints a short table last; full logs, JSON and PNG go to $OUT (default ./gpu-out).
#   bash scripts/gpu_suite.sh [--quick] [BENCH_ARG ...]
# (--quick: benchmark Llama-3.3-70B's layers only; other arguments go to benchmarks/bench_kernels.py, e.g.
# --rounds 1)
# DECODE=1 adds benchmarks/bench_decode.py (an end-to-end decode step, eager ops and compiled) after the benchmarks.
# SANITIZERS: the compute-sanitizer steps to run (default all three: "memcheck racecheck memcheck_tc"); a second
# GPU of the same kernels may take fewer to fit a time limit, and the summary then lists only the steps that ran.
# SKIP_STEPS: step names not to run (e.g. "pytest" in a second call on the same warm machine, when one call's time
# limit cannot hold every step); the summary lists them as skipped. Steps: build sass pytest pytest_random
# pytest_cpu_scalar pytest_tc memcheck racecheck memcheck_tc bench variants pytest_decode_smoke (and decode
# decode_compiled with DECODE=1).
# Uses the machine's python3 and torch. bitsandbytes, if not installed, may be carried in .gpu/site
# (see README, "GPU suite").
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
SANITIZERS="${SANITIZERS:-memcheck racecheck memcheck_tc}"
BENCH_ARGS=("$@")  # --quick and any other bench_kernels.py arguments
[ -d .gpu/site ] && export PYTHONPATH="$PWD/.gpu/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi

summary=()
step() {  # step NAME COMMAND...: runs it, logs to $OUT/NAME.log, records status, time and last line
  local name=$1; shift
  if [[ " ${SKIP_STEPS:-} " == *" $name "* ]]; then
    summary+=("$(printf '| %-10s | %-15s | %5ss | %s |' "$name" "SKIPPED" 0 "SKIP_STEPS")")
    return 0
  fi
  local start=$SECONDS
  echo "== $name: $*"
  "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  local result="PASS"; [ $rc -eq 0 ] || result="FAIL (exit $rc)"
  summary+=("$(printf '| %-10s | %-15s | %5ss | %s |' "$name" "$result" $((SECONDS - start)) \
    "$(grep -v '^\s*$' "$OUT/$name.log" | tail -n 1 | cut -c1-110)")")
  return $rc
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
"$PY" -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'python', sys.version.split()[0])" | tee -a "$OUT/gpu.txt"
"$PY" -c "import bitsandbytes as b; print('bitsandbytes', b.__version__)" 2>&1 | tail -n 1 | tee -a "$OUT/gpu.txt"
ARCH=$("$PY" -c "import torch; print('.'.join(map(str, torch.cuda.get_device_capability())))")
[ "$ARCH" = 9.0 ] && ARCH=9.0a  # H100 / H200: sm_90a code, which has the warpgroup kernel (setup.py)

if step build env TORCH_CUDA_ARCH_LIST="$ARCH" MAX_JOBS="$(nproc)" "$PY" setup.py build_ext --inplace; then
  cuobjdump --dump-resource-usage nf4_ops/_C*.so >"$OUT/resources.log" 2>&1  # registers, stack, spills
  step sass "$PY" benchmarks/sass_report.py  # the gemv kernels' SASS by opcode; last line: NOTES gemv rows 71-74
  # the seeded random calls in a step of their own (~20 s on an H100 or an H200), so that the build and the main
  # pytest step fit one 10-minute call and the random calls go with the second one's steps (README, "GPU suite")
  # the decode benchmark's smoke test hides the GPU (it times a small model on the CPU, as CI runs it) and takes ~115 s
  # here: a step of its own, after the benchmarks, so that the build and this step fit one call (README, "GPU suite")
  step pytest "$PY" -m pytest tests -q -p no:cacheprovider --ignore=tests/test_random_calls.py \
    --ignore=tests/test_bench_decode.py --durations=40
  step pytest_random "$PY" -m pytest tests/test_random_calls.py -q -p no:cacheprovider
  # the tests' CPU cases again on the path of a CPU without AVX-512, as scripts/test.sh runs them
  step pytest_cpu_scalar env NF4_OPS_AVX512=0 "$PY" -m pytest tests -q -p no:cacheprovider -k cpu
  # the tensor-core kernel's instances that the warpgroup kernel replaces on sm_90 (tests/test_gemv.py)
  step pytest_tc env NF4_OPS_WGMMA=0 "$PY" -m pytest tests/test_gemv.py -q -p no:cacheprovider \
    -k "tensor_core or wide or determin or back_to_back or one_row_kernel or many_rows"
  sanitizing() { [[ " $SANITIZERS " == *" $1 "* ]]; }
  sanitizing memcheck && step memcheck compute-sanitizer --tool memcheck --error-exitcode 1 "$PY" \
    scripts/sanitizer_workload.py
  sanitizing racecheck && step racecheck compute-sanitizer --tool racecheck --error-exitcode 1 "$PY" \
    scripts/sanitizer_workload.py
  sanitizing memcheck_tc && step memcheck_tc env NF4_OPS_WGMMA=0 compute-sanitizer --tool memcheck --error-exitcode 1 \
    "$PY" scripts/sanitizer_workload.py
  step bench "$PY" benchmarks/bench_kernels.py --out "$OUT" "${BENCH_ARGS[@]}"
  step variants "$PY" benchmarks/bench_dequantize_variants.py --out "$OUT"  # NF4/FP4, every dtype and blocksize
  step pytest_decode_smoke "$PY" -m pytest tests/test_bench_decode.py -q -p no:cacheprovider
  # the end-to-end decode step (bf16, bitsandbytes, nf4-ops), when asked: DECODE=1 (the suite is near a 10-minute
  # call's limit on an H100 without it)
  # eager ops, then compiled as transformers' compiled decode runs them
  if [ "${DECODE:-0}" = 1 ]; then
    step decode "$PY" benchmarks/bench_decode.py --out "$OUT"
    step decode_compiled "$PY" benchmarks/bench_decode.py --compile --out "$OUT/compiled"
  fi
fi

echo
cat "$OUT/gpu.txt"
[ -f "$OUT/bench.log" ] && sed -n '/^| model/,$p' "$OUT/bench.log"
[ -f "$OUT/variants.log" ] && sed -n '/^| variant/,$p' "$OUT/variants.log"
for log in decode decode_compiled; do [ -f "$OUT/$log.log" ] && sed -n '/^decode step of/,$p' "$OUT/$log.log"; done
echo
echo "| step       | result          |  time | last line |"
echo "|---|---|---|---|"
printf '%s\n' "${summary[@]}"
! printf '%s\n' "${summary[@]}" | grep -q FAIL
