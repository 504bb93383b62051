#!/bin/bash
# Issue 26's "no TTLs -> no slower than today": the branch point fe5d354 (protocol 5) and the ttl
# branch, alternating, 3 rounds, bench/bench_broker.py (plain recalls in a namespace without TTLs)
# at 256x128 and 100k x 384, 1 and 64 tasks in one process, uvloop, the Python slot path on both.
set -u
PY=/work/main/.venv/bin/python
OUTD=$(cd "$(dirname "$0")" && pwd)
NEW=$(cd "$OUTD/../../.." && pwd)
OLD=${OLD:-/tmp/ttl-base}   # git archive fe5d354 | tar -x -C /tmp/ttl-base
for r in 1 2 3; do
  for side in old new; do
    if [ $side = old ]; then tree=$OLD; else tree=$NEW; fi
    (cd $tree && KALOS_PURE_PYTHON=1 PYTHONPATH=$tree $PY bench/bench_broker.py --sizes 256x128,100kx384 --tasks 1,64 \
       --procs 1 --seconds 3 --loops uvloop --out $OUTD/broker-$side-$r.json > $OUTD/broker-$side-$r.log 2>&1)
    echo "$side $r rc=$?"
  done
done
