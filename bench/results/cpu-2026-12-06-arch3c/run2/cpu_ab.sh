# Issue 35 CPU A/B on the 2-vCPU VM: old 8dd8922 (/tmp/r2) and new (HEAD copy, /tmp/base) alternating.
set -u
NEW=/tmp/base; OLD=/tmp/r2; PY=/work/main/.venv/bin/python; R=/tmp/cpuab2
for r in 1 2 3 4; do
  for side in old new; do
    dir=$NEW; [ $side = old ] && dir=$OLD
    (cd $dir && PYTHONPATH=$dir KALOS_REQUIRE_COMPILED=1 timeout 300 $PY $NEW/bench/bench_agent.py --backend numpy --dim 128 --layouts 1x1000,256x100 --tasks 1,32 --procs 2 --seconds 4 --label $side --out $R/$side-$r.json) > $R/$side-$r.log 2>&1
    echo "== $side-$r"; grep "target=" $R/$side-$r.log | grep -o "^.\{40\}\|[0-9.]*/s\|cpu_us.*" | tr "\n" " "; echo
  done
done
true
