#!/bin/bash
# Issue 23's end-to-end A/B: d7a3428 (before this session's work) and main, alternating, 3 rounds,
# bench/bench_broker.py at 256x128, 1 and 64 tasks in one process, uvloop; then 64 tasks / 4 procs.
set -u
PY=/work/main/.venv/bin/python
OUTD=/work/main/bench/results/ab-session-vm-2026-12-02
mkdir -p $OUTD
for r in 1 2 3; do
  for side in old new; do
    if [ $side = old ]; then tree=/tmp/k/base; else tree=/work/main; fi
    (cd $tree && PYTHONPATH=$tree $PY bench/bench_broker.py --sizes 256x128 --tasks 1,64 --procs 1 --seconds 3 \
       --loops uvloop --out $OUTD/broker-$side-$r.json > $OUTD/broker-$side-$r.log 2>&1)
    echo "$side $r rc=$?"
  done
done
