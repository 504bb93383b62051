#!/bin/bash
# Issue 25 on the 2-vCPU VM: the old checkout (85fb378, before the compiled slot path; unpacked in
# .gpu_old by `git archive 85fb378 | tar -x -C .gpu_old`) against main with both sides on the pure
# Python slot path (KALOS_PURE_PYTHON=1 for the sidecar and the clients) and with both compiled
# (KALOS_REQUIRE_COMPILED=1), alternating, ROUNDS rounds; numpy 256x128, 1 task and 64 tasks over
# 4 processes, beside in-process numpy (1 query, batch of 64) measured in each run.
set -u
ROUNDS=${ROUNDS:-3}
PY=/work/main/.venv/bin/python
TREE=$(cd "$(dirname "$0")/../../.." && pwd)
OUTD=$TREE/bench/results/slotpath-vm-2026-12-02
cd "$TREE"
ARGS="--sizes 256x128 --tasks 1,64 --procs 1,4 --seconds 3 --loops uvloop"
for r in $(seq 1 "$ROUNDS"); do
  for side in old pure compiled; do
    case $side in
      old) (cd .gpu_old && env -u KALOS_PURE_PYTHON -u KALOS_REQUIRE_COMPILED PYTHONPATH=$TREE/.gpu_old \
             $PY bench/bench_broker.py $ARGS --out $OUTD/broker-$side-$r.json > $OUTD/broker-$side-$r.log 2>&1) ;;
      pure) env KALOS_PURE_PYTHON=1 PYTHONPATH=$TREE $PY bench/bench_broker.py $ARGS --paths python \
             --out $OUTD/broker-$side-$r.json > $OUTD/broker-$side-$r.log 2>&1 ;;
      compiled) env KALOS_REQUIRE_COMPILED=1 PYTHONPATH=$TREE $PY bench/bench_broker.py $ARGS --paths compiled \
             --out $OUTD/broker-$side-$r.json > $OUTD/broker-$side-$r.log 2>&1 ;;
    esac
    echo "$side $r rc=$?"
  done
done
