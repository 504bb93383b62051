#!/usr/bin/env bash
# Issue 14's round-3 measurements on the lent H200 in one call (about 5 minutes; every step has a
# time limit), as run for bench/results/h200-2026-12-01d/:
#   0. breakdown.py     a lone caller's microseconds by stage, 256x128 f32 and 1M x 768 f16
#   1. bench_seed.py    the seed design (built with nvcc) beside the broker at 256x128 and 100k x 768 f32
#   2. bench_gpu.py     256x128 f32 and 1M x 768 f16 at 1/16/256 tasks (latency samples for the CDFs),
#                       and 1M at 256 tasks with coalescing clients
#   3. bench_scaling.py 10k, 100k, 1M, 10M x 768 f16 at 1 and 256 tasks, with the time left (its JSON
#                       is rewritten after every size, so a cut-off run keeps the sizes it finished)
#   4. charts.py        PNGs of all of them, in charts-h200.tgz (the device returns at most 8 files)
# Before the call (the seed's files are not in the repository):
#   mkdir -p .dev/seed && cp ../shared/baselines/seed_* .dev/seed/
# Then, on the device, from the repository root with $OUT set and the wheels in .whl/:
#   bash bench/gpu_round3.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
set -u -o pipefail
export PYTHONUNBUFFERED=1
BUDGET=${BUDGET:-410}
LOG=$OUT/bench-h200.log
W=$(mktemp -d)
left() { echo $(( BUDGET - SECONDS - $1 )); }  # seconds left, keeping $1 for what follows
step() { echo "### $(date -u +%T) +${SECONDS}s: $*" | tee -a "$LOG"; }
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader
  nvcc --version | tail -1
  python3 -c "import sys, numpy, cupy, torch, matplotlib; print(sys.version.split()[0], 'numpy', numpy.__version__, 'cupy', cupy.__version__, 'torch', torch.__version__, 'matplotlib', matplotlib.__version__)"
  echo "cpus $(nproc); /dev/shm: $(df -h /dev/shm | tail -1); /tmp: $(df -h /tmp | tail -1)"
  git log -1 --format='code %h %s' 2>/dev/null | cut -c1-120; git status --short 2>/dev/null | head -20
} 2>&1 | tee "$LOG"

step "breakdown (limit 100 s)"
timeout -k 10 100 python3 bench/breakdown.py --backend cuda --sizes 256x128:float32,1Mx768:float16 -n 2000 --out "$OUT/breakdown-h200.json" 2>&1 | grep --line-buffered -v ' INFO ' | tee -a "$LOG"
step "bench_seed (limit 100 s)"
timeout -k 15 100 python3 bench/bench_seed.py --out "$OUT/seed-h200.json" 2>&1 | grep --line-buffered -v ' INFO ' | tee -a "$LOG"
echo "rc=$?" | tee -a "$LOG"

T=$(left 120); [ "$T" -gt 100 ] && T=100; [ "$T" -lt 30 ] && T=30
step "bench_gpu 256x128 + 1M, 1..256 tasks (limit $T s)"
timeout -k 15 "$T" python3 bench/bench_gpu.py --sizes 256x128:float32,1Mx768:float16 --tasks 1,16,256 --seconds 2 \
  --skip-inproc --out-dir "$OUT" --out-name gpu-concurrency-h200.json 2>&1 | grep --line-buffered -v ' INFO ' | tee -a "$LOG"
echo "rc=$?" | tee -a "$LOG"

step "bench_gpu 1M 256 tasks, coalescing clients (limit 60 s)"
timeout -k 10 60 python3 bench/bench_gpu.py --sizes 1Mx768:float16 --tasks 256 --seconds 2 --skip-inproc --coalesce \
  --out-dir "$OUT" --out-name gpu-coalesce-h200.json 2>&1 | grep --line-buffered -v ' INFO ' | tee -a "$LOG"

T=$(left 25); [ "$T" -lt 30 ] && T=30
step "bench_scaling 10k..10M x 768 f16 (limit $T s)"
timeout -k 15 "$T" python3 bench/bench_scaling.py --seconds 1.5 --reps 200 --out "$OUT/scaling-h200.json" 2>&1 | grep --line-buffered -v ' INFO ' | tee -a "$LOG"
echo "rc=$?" | tee -a "$LOG"

step "charts"
mkdir -p "$W/charts"
for f in "$OUT"/breakdown-h200.json "$OUT"/seed-h200.json "$OUT"/gpu-concurrency-h200.json "$OUT"/scaling-h200.json; do
  [ -f "$f" ] && timeout 60 python3 bench/charts.py "$f" --out "$W/charts" 2>&1 | tee -a "$LOG"
done
tar -C "$W" -czf "$OUT/charts-h200.tgz" charts && cp "$W"/charts/scaling-h200-scaling.png "$OUT"/ 2>/dev/null
nvidia-smi --query-gpu=clocks.sm,clocks.mem,memory.used --format=csv,noheader | tee -a "$LOG"
step "done"
ls -la "$OUT" | tee -a "$LOG"
