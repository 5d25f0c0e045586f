# NOTES gemv rows 102-102c: the warpgroup kernel's last-sharer adding (no add_tile_parts_kernel) against the tree. The
# variant's sources were .gpu/csrc_lastadd: csrc with benchmarks/experiments/wg_last_sharer_adding.diff applied (row 102c's
# kernel; the diff's test part goes into tests/). Both built for sm_90a in parallel, the variant's warpgroup / determinism /
# integration tests, then timing passes tree, lastadd, tree, lastadd (few_rows_times.py, ROWS); SANITIZE=1: sanitizers.
set -uo pipefail
export PYTHONUNBUFFERED=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
root=$PWD; start=$SECONDS
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
rm -rf /tmp/lastadd && mkdir /tmp/lastadd && cp -r nf4_ops setup.py pyproject.toml benchmarks tests scripts /tmp/lastadd/ && cp -r .gpu/csrc_lastadd /tmp/lastadd/csrc
(cd /tmp/lastadd && TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=8 python3 setup.py build_ext --inplace > /tmp/b2.log 2>&1 || tail -30 /tmp/b2.log) &
TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=8 python3 setup.py build_ext --inplace > /tmp/b.log 2>&1 || tail -30 /tmp/b.log
wait; echo "built $((SECONDS-start)) s"
(cd /tmp/lastadd && PYTHONPATH=$root/.gpu/site:/tmp/lastadd timeout 200 python3 -m pytest tests/test_gemv.py \
  tests/test_torch_integration.py -q -p no:cacheprovider -k "warpgroup or determin or back_to_back or bias or graph or compile" 2>&1 |
  grep -E "^FAILED|^E  |passed|failed|Error" | head -20 | tee $OUT/checks.txt)
echo "tests $((SECONDS-start)) s"
for label in tree lastadd tree lastadd; do
  dir=$root; [ $label != tree ] && dir=/tmp/$label
  (cd $dir && PYTHONPATH=$root/.gpu/site:$dir ROWS=${ROWS:-4,8,16} timeout 150 \
    python3 $root/benchmarks/experiments/few_rows_times.py $OUT/times.jsonl $label 2>&1 | grep -v Warn | tail -16)
  echo "$label $((SECONDS-start)) s"
done
python3 - "$OUT/times.jsonl" <<'PY' | tee $OUT/summary.txt
import collections, json, sys
times = collections.defaultdict(lambda: collections.defaultdict(list))
for line in open(sys.argv[1]):
    r = json.loads(line)
    for rows, t in r["times"].items():
        times[(r["layer"], rows)][r["label"]].append(t)
for (layer, rows), by_label in times.items():
    b = sum(by_label["tree"]) / len(by_label["tree"])
    print(f"{layer:22s} M{rows:3s} tree {b:6.1f} " + " ".join(
        f"{n} {sum(v) / len(v):6.1f} ({sum(v) / len(v) / b - 1:+.0%})" for n, v in by_label.items() if n != "tree"))
PY
echo "done $((SECONDS-start)) s"
if [ "${SANITIZE:-0}" = 1 ]; then
  for tool in memcheck racecheck; do
    (cd /tmp/lastadd && PYTHONPATH=$root/.gpu/site:/tmp/lastadd timeout 150 compute-sanitizer --tool $tool --error-exitcode 1 \
      python3 scripts/sanitizer_workload.py > /tmp/$tool.log 2>&1; echo "lastadd $tool rc=$?" | tee -a $OUT/checks.txt)
    grep -E "mismatch|ERROR SUMMARY|RACECHECK SUMMARY" /tmp/$tool.log | head -n 4 | tee -a $OUT/checks.txt
  done
fi
echo "all $((SECONDS-start)) s"
