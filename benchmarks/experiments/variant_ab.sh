# A same-machine A/B of one source variant (or several: NAMES="a b") against the tree, leaner than knob_ab.sh (which also tests the tree and
# sanitizes only the tree): the variant's sources are .gpu/csrc_$NAME (csrc with a patch applied, e.g.
#   rm -rf .gpu/csrc_lastadd && cp -r csrc .gpu/csrc_lastadd && patch -d .gpu/csrc_lastadd -p2 < benchmarks/experiments/wg_last_sharer_adding.diff
# ; that diff is against db0cf54's csrc). Both built for sm_90a in parallel; the variant's warpgroup / determinism / back-to-back / bias / graph / compile
# tests (TESTS); timing passes tree, variant(s), tree, variant(s) (few_rows_times.py at ROWS); SANITIZE=1: memcheck and
# racecheck of the variant. Used for NOTES gemv rows 102-102c (NAME=lastadd) onwards; needs bitsandbytes in .gpu/site.
# A change to how scales are loaded or prefetched needs cases beyond blocksize 64 (nested_times.py CASES with bs4096,
# or VARIANTS=1, which also runs the dequantize variants benchmark in each build, two alternated passes, into
# variants_summary.txt): NOTES dequantize row 11 gained at bs64 and lost up to half its speed at bs2048-4096 nested.
#   NAME=lastadd SANITIZE=1 OUT=/tmp/out bash benchmarks/experiments/variant_ab.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
NAMES=${NAMES:-${NAME:-lastadd}}  # one variant or several, space-separated, each built and timed against the tree
TESTS=${TESTS:-warpgroup or determin or back_to_back or bias or graph or compile}
TEST_FILES=${TEST_FILES:-tests/test_gemv.py tests/test_torch_integration.py}
# the timing script: few_rows_times.py (gemv at ROWS), dequant_times.py (dequantize variants) or nested_times.py (gemv and
# dequantize, plain and nested, at CASES), each per LAYERS
TIMES_SCRIPT=${TIMES_SCRIPT:-benchmarks/experiments/few_rows_times.py}
root=$PWD; start=$SECONDS
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
jobs=$(( $(nproc) / ($(echo $NAMES | wc -w) + 1) ))
for name in $NAMES; do
  rm -rf /tmp/$name && mkdir /tmp/$name && cp -r nf4_ops setup.py pyproject.toml benchmarks tests scripts /tmp/$name/ &&
    cp -r .gpu/csrc_$name /tmp/$name/csrc
  (cd /tmp/$name && TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=$jobs python3 setup.py build_ext --inplace > /tmp/b_$name.log 2>&1 ||
    tail -30 /tmp/b_$name.log) &
done
TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=$jobs python3 setup.py build_ext --inplace > /tmp/b.log 2>&1 || tail -30 /tmp/b.log
wait; echo "built $((SECONDS-start)) s"
for name in $NAMES; do
  (cd /tmp/$name && PYTHONPATH=$root/.gpu/site:/tmp/$name timeout 200 python3 -m pytest $TEST_FILES \
    -q -p no:cacheprovider -k "$TESTS" 2>&1 |
    grep -E "^FAILED|^E  |passed|failed|Error" | head -20 | sed "s/^/$name: /" | tee -a $OUT/checks.txt)
  echo "tests $name $((SECONDS-start)) s"
done
for pass in 1 2; do
  for label in tree $NAMES; do
    dir=$root; [ $label != tree ] && dir=/tmp/$label
    (cd $dir && PYTHONPATH=$root/.gpu/site:$dir ROWS=${ROWS:-4,8,16} LAYERS=${LAYERS:-} timeout 150 \
      python3 $root/$TIMES_SCRIPT $OUT/times.jsonl $label 2>&1 | grep -v Warn | tail -16)
    echo "$label $((SECONDS-start)) s"
  done
done
python3 benchmarks/experiments/ab_summary.py "$OUT/times.jsonl" | tee $OUT/summary.txt
if [ "${VARIANTS:-0}" = 1 ]; then  # every dequantize variant, two alternated passes, into variants_summary.txt
  for pass in 1 2; do
    for label in tree $NAMES; do
      dir=$root; [ $label != tree ] && dir=/tmp/$label
      (cd $dir && PYTHONPATH=$root/.gpu/site:$dir timeout 150 python3 benchmarks/bench_dequantize_variants.py \
        --out /tmp/variants_$label > /tmp/variants_$label.log 2>&1 || tail -5 /tmp/variants_$label.log) &&
        python3 benchmarks/experiments/variants_jsonl.py /tmp/variants_$label/dequantize_variants.json \
          $OUT/variants.jsonl $label
      echo "variants $label $((SECONDS-start)) s"
    done
  done
  python3 benchmarks/experiments/ab_summary.py "$OUT/variants.jsonl" > $OUT/variants_summary.txt
  grep -E "\(\+[3-9]|\(\+[1-9][0-9]" $OUT/variants_summary.txt | head -20  # the variant's losses of 3% or more
fi
echo "done $((SECONDS-start)) s"
if [ "${SANITIZE:-0}" = 1 ]; then
  for name in $NAMES; do
    for tool in memcheck racecheck; do
      (cd /tmp/$name && PYTHONPATH=$root/.gpu/site:/tmp/$name timeout 150 compute-sanitizer --tool $tool \
        --error-exitcode 1 python3 scripts/sanitizer_workload.py > /tmp/$tool.log 2>&1
       echo "$name $tool rc=$?" | tee -a $OUT/checks.txt)
      grep -E "mismatch|ERROR SUMMARY|RACECHECK SUMMARY" /tmp/$tool.log | head -n 4 | tee -a $OUT/checks.txt
    done
  done
fi
echo "all $((SECONDS-start)) s"
