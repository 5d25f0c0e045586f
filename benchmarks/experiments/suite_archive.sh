#!/usr/bin/env bash
# scripts/gpu_suite.sh for a device runner that brings back only a few files from $OUT (the lent GPU machine brings
# back at most 8): runs the suite into a scratch folder, tees its console to $OUT/console.txt and packs its logs, JSON
# and PNG into $OUT/suite.tgz. Arguments and SANITIZERS pass through; bitsandbytes as for the suite (.gpu/site).
#   SANITIZERS="memcheck racecheck memcheck_tc" OUT=/tmp/out bash benchmarks/experiments/suite_archive.sh
# (An H100 took 600 s for all of it from a fresh machine in session 38, the runner's limit: there, run the
# sanitizers but memcheck in a second call on the same warm machine, e.g. SANITIZERS=memcheck first.)
set -uo pipefail
dest=$OUT
export OUT=/tmp/suite-out
rm -rf "$OUT" && mkdir -p "$OUT"
bash scripts/gpu_suite.sh "$@" 2>&1 | tee "$dest/console.txt"
rc=${PIPESTATUS[0]}
tar czf "$dest/suite.tgz" -C /tmp suite-out
exit $rc
