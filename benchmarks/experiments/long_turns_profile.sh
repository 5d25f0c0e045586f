# Nsight Compute: the tree (base) against long turns (experiments/tc_long_turns.diff) on Llama's q at 4 and 16 rows.
set -uo pipefail
export PYTHONUNBUFFERED=1 CUDA_HOME=/usr/local/cuda
root=$PWD; start=$SECONDS
rm -rf /tmp/lt && mkdir /tmp/lt && cp -r nf4_ops setup.py pyproject.toml benchmarks csrc tests /tmp/lt/
(cd /tmp/lt && git apply --directory=. $root/benchmarks/experiments/tc_long_turns.diff 2>&1 || patch -p1 < $root/benchmarks/experiments/tc_long_turns.diff)
grep -c "kTcLongTurnGroups" /tmp/lt/csrc/gemv.cu
b() { (cd $1 && TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=8 python3 setup.py build_ext --inplace > /tmp/build_$2.log 2>&1 || tail -30 /tmp/build_$2.log); }
b $root base & b /tmp/lt lt & wait
echo "builds $((SECONDS-start)) s"
M="--metrics gpu__time_duration.sum,smsp__issue_active.avg.per_cycle_active,smsp__warps_eligible.avg.per_cycle_active,smsp__inst_executed.sum,l1tex__t_requests_pipe_lsu_mem_local_op_ld.sum,smsp__average_warp_latency_issue_stalled_long_scoreboard.ratio,smsp__average_warp_latency_issue_stalled_short_scoreboard.ratio,smsp__average_warp_latency_issue_stalled_barrier.ratio,smsp__average_warp_latency_issue_stalled_membar.ratio,smsp__average_warp_latency_issue_stalled_wait.ratio,smsp__average_warp_latency_issue_stalled_mio_throttle.ratio,smsp__average_warp_latency_issue_stalled_lg_throttle.ratio,smsp__average_warp_latency_issue_stalled_math_pipe_throttle.ratio,smsp__average_warp_latency_issue_stalled_not_selected.ratio,smsp__average_warp_latency_issue_stalled_selected.ratio,smsp__average_warp_latency_issue_stalled_dispatch_stall.ratio,smsp__average_warp_latency_issue_stalled_no_instruction.ratio,smsp__average_warp_latency_issue_stalled_drain.ratio,smsp__average_warp_latency_issue_stalled_sleeping.ratio,smsp__average_warp_latency_issue_stalled_branch_resolving.ratio,smsp__average_warp_latency_issue_stalled_imc_miss.ratio,smsp__average_warp_latency_issue_stalled_tex_throttle.ratio,dram__throughput.avg.pct_of_peak_sustained_elapsed"
for v in base lt; do d=$root; [ $v = lt ] && d=/tmp/lt
  for m in 4 16; do
    (cd $d && PYTHONPATH=$root/.gpu/site:$d timeout 100 ncu --kernel-name regex:tc_gemv --launch-skip 2 --launch-count 1 $M python3 benchmarks/profile_gemv.py --rows 8192 --cols 8192 --m $m > $OUT/ncu_${v}_$m.txt 2>&1)
    echo "ncu $v $m rc=$? $((SECONDS-start)) s"
  done
done
for f in $OUT/ncu_*.txt; do echo "== $f"; grep -E "tc_gemv_kernel<|gpu__time|issue_active|warps_eligible|inst_executed|mem_local|stalled_(long|short|barrier|wait|mio|lg|math|not_sel|selected|dispatch|no_inst|branch)|dram__" $f | sed 's/  */ /g' | cut -c1-150; done
