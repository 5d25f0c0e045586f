# A/B of build-knob variants against the tree, the way NOTES gemv rows 91-95 ran them on the GPU machine: a
# quicker cousin of scripts/gpu_ab.sh (which applies patches and runs the whole benchmark), for -D knobs and
# several variants at once, timed by few_rows_times.py (or TIMES_SCRIPT) only.
# It needs bitsandbytes in .gpu/site, as ../shared/docs/gpu.md says. Builds the tree (label "tree", no flags) and
# VARIANTS ("name=flags;name=flags"; a variant whose .gpu/csrc_<name> exists builds those sources instead of the
# tree's csrc, e.g. an earlier commit's) in parallel; runs tests/test_gemv.py -k "$TESTS" on the tree and each variant
# but one named base (MORE_TEST_FILES adds files); then timing passes in the order PASSES (labels) with
# benchmarks/experiments/few_rows_times.py (ROWS), or TIMES_SCRIPT (a path from the root, e.g.
# benchmarks/experiments/nested_times.py with its CASES), into $OUT/times.jsonl; prints each layer's mean per label
# against the variant named base (or the tree); SANITIZE=1 adds memcheck and racecheck of the tree.
#   VARIANTS="base=-DNF4_TC_WIDE_WARPS=16;w12=-DNF4_TC_WIDE_WARPS=12" TESTS="tensor_core or wide" ROWS=1,9,16 \
#     PASSES="base tree w12 base tree w12" OUT=/tmp/out bash benchmarks/experiments/knob_ab.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
root=$PWD; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee $OUT/gpu.txt
start=$SECONDS
build() { (cd $1 && NF4_OPS_NVCC_FLAGS="$2" TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=6 python3 setup.py build_ext --inplace \
  > /tmp/build_$3.log 2>&1 || tail -30 /tmp/build_$3.log); }
names=()
IFS=";" read -ra specs <<< "${VARIANTS}"
for spec in "${specs[@]}"; do
  [ -z "$spec" ] && continue
  name=${spec%%=*}; flags=${spec#*=}; names+=("$name")
  rm -rf /tmp/$name && mkdir /tmp/$name && cp -r nf4_ops setup.py pyproject.toml benchmarks tests csrc /tmp/$name/
  [ -d .gpu/csrc_$name ] && rm -rf /tmp/$name/csrc && cp -r .gpu/csrc_$name /tmp/$name/csrc
  build /tmp/$name "$flags" $name &
done
build $root "" tree
wait; echo "builds $((SECONDS-start)) s"
for name in tree "${names[@]}"; do
  [ $name = base ] && continue; dir=/tmp/$name; [ $name = tree ] && dir=$root
  (cd $dir && PYTHONPATH=$root/.gpu/site:$dir timeout ${TEST_TIMEOUT:-150} python3 -m pytest tests/test_gemv.py \
    ${MORE_TEST_FILES:-} -q -p no:cacheprovider -k "${TESTS}" 2>&1 | grep -E "^FAILED|^E  |passed|failed|Error" |
    head -12 | sed "s/^/$name: /" | tee -a $OUT/checks.txt)
  echo "tests $name $((SECONDS-start)) s"
done
for label in ${PASSES}; do
  dir=$root; [ $label != tree ] && dir=/tmp/$label
  (cd $dir && PYTHONPATH=$root/.gpu/site:$dir timeout 150 \
    python3 $root/${TIMES_SCRIPT:-benchmarks/experiments/few_rows_times.py} $OUT/times.jsonl $label > /dev/null 2>&1)
  echo "$label $((SECONDS-start)) s"
done
python3 benchmarks/experiments/ab_summary.py "$OUT/times.jsonl" | tee $OUT/summary.txt
if [ "${SANITIZE:-0}" = 1 ]; then
  for tool in memcheck racecheck; do
    PYTHONPATH=$root/.gpu/site:$root timeout 200 compute-sanitizer --tool $tool --error-exitcode 1 \
      python3 scripts/sanitizer_workload.py > /tmp/$tool.log 2>&1
    echo "tree $tool rc=$?" | tee -a $OUT/checks.txt
    grep -E "mismatch|ERROR SUMMARY|RACECHECK SUMMARY" /tmp/$tool.log | head -n 4 | tee -a $OUT/checks.txt
  done
fi
echo "done $((SECONDS-start)) s"
