#!/bin/bash
# Issue 25 (client side): the compiled slot path against the pure-Python one, on the 2-vCPU VM
# (other work running), each comparison alternating within one run: bench_client_cpu.py (the pool
# over the in-memory transport), breakdown.py (a lone blocking caller, per stage), bench_broker.py
# (a real sidecar, 256x128 numpy, beside in-process numpy 1 query and batch-64).
# ROUNDS (default "1 2 3") and CPU_TAG (default "") name a repeat's files.
set -u
ROUNDS=${ROUNDS:-1 2 3}
CPU_TAG=${CPU_TAG:-}
PY=/work/main/.venv/bin/python
TREE=$(cd "$(dirname "$0")/../../.." && pwd)
OUTD=$TREE/bench/results/cslot-vm-2026-12-02
cd "$TREE"
export PYTHONPATH=$TREE
$PY setup.py -q build_ext --inplace > /dev/null 2>&1
$PY bench/bench_client_cpu.py --tasks 1,64 --runs 5 --seconds 2 --paths compiled,python \
  --out $OUTD/client-cpu$CPU_TAG.json > $OUTD/client-cpu$CPU_TAG.log 2>&1
echo "client-cpu rc=$?"
for r in $ROUNDS; do
  for side in compiled python; do
    if [ $side = python ]; then envs="KALOS_PURE_PYTHON=1"; else envs="KALOS_REQUIRE_COMPILED=1"; fi
    env $envs $PY bench/breakdown.py --backend numpy --sizes 256x128 -n 3000 \
      --out $OUTD/breakdown-$side-$r.json > $OUTD/breakdown-$side-$r.log 2>&1
    echo "breakdown $side $r rc=$?"
  done
done
for r in $ROUNDS; do
  for co in plain coalesce; do
    flag=""; [ $co = coalesce ] && flag="--coalesce"
    $PY bench/bench_broker.py --sizes 256x128 --tasks 1,64 --procs 1,4 --seconds 3 --loops uvloop \
      --paths compiled,python $flag --out $OUTD/broker-$co-$r.json > $OUTD/broker-$co-$r.log 2>&1
    echo "broker $co $r rc=$?"
  done
done
