#!/usr/bin/env bash
# One call on the lent GPU machine: install the carried wheels, check the toolchain, run the GPU
# tests, run the benchmark. Logs and JSON go to $OUT (default ./gpu-out).
#
#   bash bench/gpu_session.sh check   # smoke + GPU tests + a short benchmark at 256x128 (~4 min)
#   bash bench/gpu_session.sh bench   # the full benchmark matrix (bench/bench_gpu.py, ~6 min)
#   bash bench/gpu_session.sh all     # both
#
# The device has no venv: python3 with PYTHONPATH=/tmp/site:. ; wheels for posix_ipc and the
# pytest stack travel in .whl/ (see the device README).
set -u -o pipefail
MODE=${1:-check}
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >"$OUT/pip.log" 2>&1 || { echo "wheel install failed"; tail -5 "$OUT/pip.log"; exit 1; }
fi
export PYTHONPATH=/tmp/site:.
{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -c "import sys, numpy, cupy, torch; print(sys.version); print('numpy', numpy.__version__, 'cupy', cupy.__version__, 'torch', torch.__version__)"
  nproc
} 2>&1 | tee "$OUT/env.log"

smoke() {
  timeout 300 python3 - <<'EOF' 2>&1 | tee "$OUT/smoke.log"
import time, numpy as np
from broker.layout import Metric
from sidecar_cuda.cupy_backend import CupyBackend, cuda_available
print("cuda_available:", cuda_available())
for dt in ("float32", "float16", "bfloat16"):
    t = time.perf_counter(); be = CupyBackend(storage_dtype=dt)
    print(dt, be.description, f"start {time.perf_counter() - t:.2f} s (compile {be.compile_s:.2f} s)")
    for qt, kern in be._k_small.items():
        print("  small q%d regs %d local %d" % (qt, kern.num_regs, kern.local_size_bytes))
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3000, 100), dtype=np.float32); q = rng.standard_normal((3, 100), dtype=np.float32)
    m = be.new_matrix(100, 3000, Metric.DOT); m.write_rows(np.arange(3000), x)
    ref = q.astype(np.float64) @ x.astype(np.float64).T
    for path in ("small", "gemm"):
        r, s = be.search(m, q, 3000, 10, path=path)
        best = np.argsort(-ref, axis=1)[:, :10]
        print(f"  {path}: rows {r[0][:5]} ref {best[0][:5]} max|score-ref| {np.abs(s - np.take_along_axis(ref, r, 1)).max():.4g}")
    be.close()
EOF
}

tests() {
  timeout 540 python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/test_gpu_backend.py tests/test_gpu_broker.py \
    --timeout 300 2>&1 | tee "$OUT/pytest-gpu.log" | tail -40
}

# GPU clocks and load once a second while we work (a latency benchmark of short kernels may run
# at idle clocks); stopped by its own pid at the end.
nvidia-smi dmon -s pucm -d 1 >"$OUT/dmon.log" 2>&1 &
DMON=$!
trap 'kill $DMON 2>/dev/null' EXIT

case "$MODE" in
  check)
    smoke
    tests
    timeout 240 python3 bench/bench_gpu.py --sizes 256x128:float32 --tasks 1,64 --seconds 1.5 --reps 300 \
      --out-dir "$OUT" 2>&1 | tee "$OUT/bench-small.log" | grep -v '^inproc' | tail -20
    grep '^inproc' "$OUT/bench-small.log" | cut -c1-220
    ;;
  bench)
    timeout 580 python3 bench/bench_gpu.py --out-dir "$OUT" 2>&1 | tee "$OUT/bench.log" | grep -v '^inproc'
    grep '^inproc' "$OUT/bench.log" | cut -c1-240
    ;;
  all)
    smoke
    tests
    timeout 580 python3 bench/bench_gpu.py --out-dir "$OUT" 2>&1 | tee "$OUT/bench.log" | grep -v '^inproc'
    ;;
esac
