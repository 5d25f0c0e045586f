# The few-rows kernel A/B of NOTES gemv row 83: apply benchmarks/experiments/few_rows_kernel.diff to the tree first
# (bitsandbytes in .gpu/site, as ../shared/docs/gpu.md says). Builds the tree (var), the tree with the kernel off
# (base: -DNF4_FR_MAX_X_ROWS=2) and VARIANTS ("name=flags;name=flags") in parallel; var's tests (TESTS), then
# timing passes (PASSES) into $OUT/times.jsonl.
set -uo pipefail
export PYTHONUNBUFFERED=1 CUDA_HOME=/usr/local/cuda
root=$PWD; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
start=$SECONDS
b() { (cd $1 && NF4_OPS_NVCC_FLAGS="$2" TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=4 python3 setup.py build_ext --inplace > /tmp/build_$3.log 2>&1 || tail -30 /tmp/build_$3.log); }
IFS=';' read -ra specs <<< "base=-DNF4_FR_MAX_X_ROWS=2;${VARIANTS:-}"
for spec in "${specs[@]}"; do
  [ -z "$spec" ] && continue
  name=${spec%%=*}; flags=${spec#*=}
  rm -rf /tmp/$name && mkdir /tmp/$name && cp -r nf4_ops setup.py pyproject.toml benchmarks csrc /tmp/$name/
  b /tmp/$name "$flags" $name &
done
b $root "" var
wait; echo "builds $((SECONDS-start)) s"
PYTHONPATH=$root/.gpu/site:$root timeout 150 python3 -m pytest tests/test_gemv.py -q -p no:cacheprovider -x -k "${TESTS:-few_rows}" 2>&1 | grep -E "^FAILED|^E  |passed|failed|Error" | head -30 | tee $OUT/checks.txt
echo "tests $((SECONDS-start)) s"
for v in ${PASSES:-base var}; do
  d=$root; [ $v != var ] && d=/tmp/$v
  (cd $d && PYTHONPATH=$root/.gpu/site:$d timeout 120 python3 $root/benchmarks/experiments/few_rows_times.py $OUT/times.jsonl $v > /dev/null 2>&1)
  echo "$v $((SECONDS-start)) s"
done
if [ -n "${MORE_TESTS:-}" ]; then
  PYTHONPATH=$root/.gpu/site:$root timeout ${MORE_TESTS_S:-200} python3 -m pytest tests/test_gemv.py tests/test_kernel_binary.py -q -p no:cacheprovider -k "$MORE_TESTS" 2>&1 | grep -E "^FAILED|passed|failed" | tail -12 | tee -a $OUT/checks.txt
  echo "more tests $((SECONDS-start)) s"
fi
