# Issue 35 CPU A/B on the 2-vCPU VM: old 8dd8922 (/tmp/r2) and new (HEAD copy, /tmp/base) alternating.
set -u
NEW=/tmp/base; OLD=/tmp/r2; PY=/work/main/.venv/bin/python; R=/tmp/cpuab
for r in 1 2 3 4; do
  for side in old new; do
    dir=$NEW; [ $side = old ] && dir=$OLD
    (cd $dir && PYTHONPATH=$dir KALOS_REQUIRE_COMPILED=1 timeout 300 $PY $NEW/bench/bench_agent.py --backend numpy --dim 128 --layouts 1x1000,256x100 --tasks 1,32 --procs 2 --seconds 4 --label $side --out $R/$side-$r.json) > $R/$side-$r.log 2>&1
    echo "== $side-$r"; grep "target=" $R/$side-$r.log | cut -c1-200
  done
done
PYTHONPATH=$NEW KALOS_REQUIRE_COMPILED=1 timeout 600 $PY $NEW/bench/bench_client_cpu.py --tasks 1,16 --runs 5 --trees $NEW,$OLD --out $R/client-cpu.json 2>&1 | tail -6
