#!/usr/bin/env bash
# One call on the lent GPU machine: install the carried wheels, record the toolchain, run the GPU
# tests and the behavioural suites on a CUDA sidecar, and/or the benchmark. Logs and JSON go to
# $OUT (default ./gpu-out).
#
#   bash bench/gpu_session.sh check   # warm-up figures, GPU tests, CUDA broker suite (~4 min)
#   bash bench/gpu_session.sh table   # issue 14's table: 256x128 f32 and 1M x 768 f16 at 1 and
#                                     # 256 tasks, with and without coalescing clients (~4 min)
#   bash bench/gpu_session.sh wgmma   # the wgmma path vs the GEMM paths in the backend, 1M and 2M x
#                                     # 768 fp16, batches 2-32 (bench/probe.py paths, ~1 min)
#   bash bench/gpu_session.sh bench   # the full benchmark matrix (bench/bench_gpu.py, ~6 min)
#   bash bench/gpu_session.sh ttl     # memory over time (issue 26): the recency GPU tests, the TTL and
#                                     # recency ipc suite on a CUDA sidecar, bench_time at 1M x 768 fp16
#   bash bench/gpu_session.sh check table
#
# The device has no venv: python3 with PYTHONPATH=/tmp/site:. ; wheels for posix_ipc and the
# pytest stack travel in .whl/ (see the device README; carry ".whl").
set -u -o pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >"$OUT/pip.log" 2>&1 || { echo "wheel install failed"; tail -5 "$OUT/pip.log"; exit 1; }
fi
export PYTHONPATH=/tmp/site:$PWD
{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader
  python3 -c "import sys, numpy, cupy; print(sys.version.split()[0], 'numpy', numpy.__version__, 'cupy', cupy.__version__)"
  echo "cpus $(nproc)"; git log -1 --format='code %h %s' 2>/dev/null | cut -c1-120; git status --short 2>/dev/null | head
} 2>&1 | tee "$OUT/env.log"

check() {
  timeout 120 python3 -c "
from kalos.sidecar_cuda.backends.cuda import CupyBackend
for dt in ('float32', 'float16'):
    be = CupyBackend(storage_dtype=dt)
    print(dt, be.description, 'compile_s %.2f warm_s %.2f' % (be.compile_s, be.warm_s))
    be.close()
" 2>&1 | grep -v INFO | tee "$OUT/warm.log"
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu 2>&1 | tail -15 | tee "$OUT/gpu-suite.log"
  KALOS_TEST_BACKEND=cuda timeout 180 python3 -m pytest -q -p no:cacheprovider tests/ipc/test_broker.py 2>&1 \
    | tail -15 | tee "$OUT/cuda-broker.log"
}

table() {
  timeout 200 python3 bench/bench_gpu.py --sizes 256x128:float32,1Mx768:float16 --tasks 1,256 --seconds 2 \
    --reps 300 --out-dir "$OUT" --out-name gpu-table-h200.json 2>&1 | tee "$OUT/table.log" | grep -v '^inproc' | tail -20
  grep '^inproc' "$OUT/table.log" | cut -c1-220
  timeout 120 python3 bench/bench_gpu.py --sizes 1Mx768:float16 --tasks 256 --seconds 2 --skip-inproc --coalesce \
    --out-dir "$OUT" --out-name gpu-table-coalesce-h200.json 2>&1 | tee "$OUT/table-coalesce.log" | tail -6
}

wgmma() {
  timeout 300 python3 bench/probe.py paths --rows 1000000,2097152 --batches 2,4,8,12,16,24,32 \
    --paths auto,wgmma,gemm,gemmh --check --out "$OUT/probe-paths-wgmma.json" 2>&1 | grep -v '^{' \
    | tee "$OUT/probe-paths-wgmma.log" | tail -18
}

ttl() {
  timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gpu_recency.py 2>&1 | tail -15 \
    | tee "$OUT/gpu-recency.log"
  KALOS_TEST_BACKEND=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider tests/ipc/test_memory_time.py 2>&1 \
    | tail -15 | tee "$OUT/cuda-memory-time.log"
  timeout 420 python3 bench/bench_time.py --rows 1000000 --dim 768 --backend cuda --dtype float16 --reps 300 \
    --inproc --out "$OUT/time-cuda-1Mx768.json" 2>&1 | grep -v INFO | tee "$OUT/time-cuda-1Mx768.log"
}

bench() {
  timeout 580 python3 bench/bench_gpu.py --out-dir "$OUT" 2>&1 | tee "$OUT/bench.log" | grep -v '^inproc'
  grep '^inproc' "$OUT/bench.log" | cut -c1-240
}

for mode in "${@:-check}"; do
  case "$mode" in
    check) check ;;
    table) table ;;
    wgmma) wgmma ;;
    bench) bench ;;
    ttl) ttl ;;
    *) echo "unknown mode $mode (check, table, wgmma, bench, ttl)"; exit 2 ;;
  esac
done
