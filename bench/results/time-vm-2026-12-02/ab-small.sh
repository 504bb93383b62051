#!/bin/bash
# The same A/B as ab.sh at 256x128, one task, 8 rounds of 2 s (finer alternation: the VM is shared).
set -u
PY=/work/main/.venv/bin/python
OUTD=$(cd "$(dirname "$0")" && pwd)
NEW=$(cd "$OUTD/../../.." && pwd)
OLD=${OLD:-/tmp/ttl-base}
for r in 1 2 3 4 5 6 7 8; do
  for side in old new; do
    if [ $side = old ]; then tree=$OLD; else tree=$NEW; fi
    (cd $tree && KALOS_PURE_PYTHON=1 PYTHONPATH=$tree $PY bench/bench_broker.py --sizes 256x128 --tasks 1 \
       --procs 1 --seconds 2 --loops uvloop --out $OUTD/small-$side-$r.json > $OUTD/small-$side-$r.log 2>&1)
    echo "$side $r rc=$?"
  done
done
