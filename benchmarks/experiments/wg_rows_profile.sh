# Nsight Compute on the tree's warpgroup kernel (wg_gemv_kernel) at 8 rows of x (wgmma N = 8) and 12 / 16 rows
# (N = 16) on Gemma's q and Llama's q: where the 9-16-row instance's extra time goes (NOTES gemv row 108).
#   OUT=/tmp/out bash benchmarks/experiments/wg_rows_profile.sh   (needs bitsandbytes-free torch; .gpu/site optional)
set -uo pipefail
export PYTHONUNBUFFERED=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
root=$PWD; start=$SECONDS
TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 python3 setup.py build_ext --inplace > /tmp/build.log 2>&1 || tail -30 /tmp/build.log
echo "build $((SECONDS-start)) s"
S=smsp__average_warp_latency_issue_stalled
M="--metrics gpu__time_duration.sum,smsp__issue_active.avg.per_cycle_active,smsp__warps_eligible.avg.per_cycle_active,smsp__inst_executed.sum,smsp__warps_active.avg.per_cycle_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors_srcunit_tex_op_read.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum"
for s in long_scoreboard short_scoreboard barrier membar wait mio_throttle lg_throttle math_pipe_throttle not_selected selected dispatch_stall no_instruction branch_resolving sleeping; do M="$M,${S}_$s.ratio"; done
for shape in "4096 5376 gemma_q" "8192 8192 llama_q"; do
  set -- $shape
  for m in 8 12 16; do
    PYTHONPATH=$root/.gpu/site:$root timeout 120 ncu --kernel-name regex:wg_gemv --launch-skip 2 --launch-count 1 $M \
      python3 benchmarks/profile_gemv.py --rows $1 --cols $2 --m $m > $OUT/ncu_$3_$m.txt 2>&1
    echo "ncu $3 $m rc=$? $((SECONDS-start)) s"
  done
done
for f in $OUT/ncu_*.txt; do echo "== $f"; grep -E "wg_gemv_kernel<|gpu__time|issue_active|warps_eligible|warps_active|inst_executed|dram__|lts__|l1tex__|stalled_" $f | sed 's/  */ /g' | cut -c1-120; done > $OUT/summary.txt
cat $OUT/summary.txt
