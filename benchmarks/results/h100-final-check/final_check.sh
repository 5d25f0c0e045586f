# final tree on an H100: build (sm_90a), the gemv tests that touch the warpgroup / tensor-core kernels, the same with
# the warpgroup kernel off, kernel-binary tests, memcheck + racecheck of the sanitizer workload
set -uo pipefail
export PYTHONPATH=$PWD/.gpu/site:$PWD PYTHONUNBUFFERED=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 python3 setup.py build_ext --inplace > /tmp/b.log 2>&1 || { tail -30 /tmp/b.log; exit 1; }
echo built $SECONDS
K="warpgroup or tensor_core or wide or determin or back_to_back or one_row_kernel or many_rows or x_rows"
python3 -m pytest tests/test_gemv.py tests/test_kernel_binary.py -q -p no:cacheprovider -k "$K or kernel" 2>&1 | tail -3
echo tests $SECONDS
NF4_OPS_WGMMA=0 python3 -m pytest tests/test_gemv.py -q -p no:cacheprovider -k "$K" 2>&1 | tail -2
echo tests_tc $SECONDS
for tool in memcheck racecheck; do
  timeout 200 compute-sanitizer --tool $tool --error-exitcode 1 python3 scripts/sanitizer_workload.py > /tmp/$tool.log 2>&1
  echo "$tool rc=$?"; grep -E "mismatch|ERROR SUMMARY|RACECHECK SUMMARY" /tmp/$tool.log | head -4
done
echo done $SECONDS
