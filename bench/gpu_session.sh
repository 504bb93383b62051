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
#   AB_OLD=.gpu_old bash bench/gpu_session.sh ab  # old vs new checkout alternating (~6 min)
#   bash bench/gpu_session.sh ttl     # memory over time (issue 26): the recency GPU tests, the TTL and
#                                     # recency ipc suite on a CUDA sidecar, bench_time at 1M x 768 fp16
#   bash bench/gpu_session.sh check table
#   bash bench/gpu_session.sh mixed   # issue 34: the mixed-namespace kernel, recency, fused and wgmma tests,
#                                     # then the mixed, memory-time and broker suites on a CUDA sidecar
#   AB_OLD=.gpu_old bash bench/gpu_session.sh agent  # the agent workload (bench/bench_agent.py), old and
#                                     # new alternating; AGENT_LAYOUTS, AGENT_TASKS, AGENT_SIDES, AGENT_TARGET
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
# The compiled slot path (setup.py), built in place for this machine's Python; without it (no
# compiler or no Python headers there) everything runs the Python slot path, and env.log says so.
python3 setup.py -q build_ext --inplace >"$OUT/build-ext.log" 2>&1 || echo "build_ext failed (see build-ext.log)"
{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader
  python3 -c "import sys, numpy, cupy; print(sys.version.split()[0], 'numpy', numpy.__version__, 'cupy', cupy.__version__)"
  python3 -c "import importlib, os; from kalos.broker.slotpath import choose
for m in ('kalos.clients._cslot', 'kalos.sidecar_cuda.serving._cserve'):
    c = choose(os.environ, lambda: importlib.import_module(m)); print('slot path', m, c.path.value, '-', c.reason)"
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
  KALOS_TEST_BACKEND=cuda timeout 180 python3 -m pytest -q -p no:cacheprovider tests/ipc/test_broker.py \
    tests/ipc/test_backend_metrics.py 2>&1 \
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

# Old and new checkout alternating in one lease (issue 25's table): AB_OLD names a folder holding the
# old checkout's files (carried: e.g. `git archive 85fb378 | tar -x -C .gpu_old`), AB_ROUNDS the
# rounds. 256x128 f32 and 1M x 768 f16 at 1 and 256 tasks through the broker; the in-process
# baselines once, from the new checkout.
ab() {
  local old=${AB_OLD:-.gpu_old} rounds=${AB_ROUNDS:-2} r side dir
  [ -d "$old" ] || { echo "ab: no old checkout in $old"; return 1; }
  for r in $(seq 1 "$rounds"); do
    for side in old new; do
      dir=$PWD; [ "$side" = old ] && dir=$PWD/$old
      (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout 200 python3 bench/bench_gpu.py \
        --sizes 256x128:float32,1Mx768:float16 --tasks ${AB_TASKS:-1,256} --seconds 2 --skip-inproc \
        --out-dir "$OUT" --out-name "ab-$side-$r.json" > "$OUT/ab-$side-$r.log" 2>&1)
      echo "== $side round $r"; grep -E 'tasks=' "$OUT/ab-$side-$r.log" | cut -c1-200
    done
  done
  timeout 200 python3 bench/bench_gpu.py --sizes 256x128:float32,1Mx768:float16 --skip-broker --reps 300 \
    --out-dir "$OUT" --out-name ab-inproc.json > "$OUT/ab-inproc.log" 2>&1
  grep '^inproc' "$OUT/ab-inproc.log" | cut -c1-220
}

# Issue 27's last figures, in two calls of under 10 minutes each. $OUT brings back 8 files at most,
# so each mode runs in a staging folder and packs its JSON into one file and its logs into another.
#   AB_OLD=.gpu_old bash bench/gpu_session.sh ab256    # the int8 GPU tests and the backend's
#     /metrics statistics on a CUDA sidecar; then 1M x 768 fp16 at
#     256 tasks: old, new and new with --int8-pass off alternating, twice (is the 7% loss the
#     int8 pass's, or the lease's?)
#   AB_OLD=.gpu_old bash bench/gpu_session.sh close27  # in-process batch 64/256 beside torch; the
#     paths forced one by one at 512k-2M rows, batches 1-16 (where the int8 pass starts to pay);
#     10M x 768 fp16 at 256 tasks, old then new
pack() {  # pack NAME: the staging folder's JSON into $OUT/NAME.json, its logs onto $OUT/NAME.log;
  # called after every step, so what a call that runs out of time finished still comes back
  python3 - "$STAGE" "$OUT/$1.json" <<'PY'
import glob, json, os, sys
stage, out = sys.argv[1], sys.argv[2]
runs = json.load(open(out)) if os.path.exists(out) else {}
for f in sorted(glob.glob(os.path.join(stage, "*.json"))):
    runs[os.path.basename(f)[:-5]] = json.load(open(f))
json.dump(runs, open(out, "w"), indent=1)
PY
  for f in "$STAGE"/*.log; do [ -e "$f" ] && { echo "==== $(basename "$f")"; cat "$f"; }; done >> "$OUT/$1.log"
  rm -f "$STAGE"/*
}

ab256() {
  local old=${AB_OLD:-.gpu_old} r side dir extra
  [ -d "$old" ] || { echo "ab256: no old checkout in $old"; return 1; }
  STAGE=$(mktemp -d)
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/gpu/test_gpu_int8.py 2>&1 | tail -40 \
    > "$STAGE/gpu-int8-tests.log"
  tail -3 "$STAGE/gpu-int8-tests.log"
  KALOS_TEST_BACKEND=cuda timeout 120 python3 -m pytest -q -p no:cacheprovider -rfE tests/ipc/test_backend_metrics.py \
    2>&1 | tail -15 > "$STAGE/cuda-backend-metrics.log"
  tail -1 "$STAGE/cuda-backend-metrics.log"; pack ab256
  for r in 1 2; do
    for side in old new off; do
      dir=$PWD extra=""
      [ "$side" = old ] && dir=$PWD/$old
      [ "$side" = off ] && extra="--int8-pass off"
      (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout 150 python3 bench/bench_gpu.py --sizes 1Mx768:float16 \
        --tasks 256 --seconds 3 --skip-inproc --sidecar-args "$extra" --out-dir "$STAGE" \
        --out-name "ab256-$side-$r.json" > "$STAGE/ab256-$side-$r.log" 2>&1)
      echo "== $side round $r"; grep -E 'tasks=' "$STAGE/ab256-$side-$r.log" | cut -c1-220; pack ab256
    done
  done
  rm -rf "$STAGE"
}

close27() {
  local old=${AB_OLD:-.gpu_old} side dir
  [ -d "$old" ] || { echo "close27: no old checkout in $old"; return 1; }
  STAGE=$(mktemp -d)
  timeout 110 python3 bench/bench_gpu.py --sizes 1Mx768:float16 --skip-broker --reps 300 --out-dir "$STAGE" \
    --out-name inproc.json > "$STAGE/inproc.log" 2>&1
  grep '^inproc' "$STAGE/inproc.log" | cut -c1-220; pack close27
  timeout 120 python3 bench/probe.py paths --rows 524288,786432,1000000,2000000 --batches 1,4,8,16 \
    --paths auto,int8,small,wgmma,gemmh,gemm --check --out "$STAGE/paths-int8-rows.json" 2>&1 | grep -v '^{' \
    > "$STAGE/paths-int8-rows.log"
  tail -20 "$STAGE/paths-int8-rows.log"; pack close27
  for side in old new; do  # last: 15 GB of rows each, drawn on the device and loaded from /dev/shm
    dir=$PWD; [ "$side" = old ] && dir=$PWD/$old
    (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout 170 python3 bench/bench_scaling.py --sizes 10M --tasks 256 \
      --seconds 3 --skip-inproc --out "$STAGE/scale10m-$side.json" > "$STAGE/scale10m-$side.log" 2>&1)
    echo "== 10M, $side"; grep -v INFO "$STAGE/scale10m-$side.log" | tail -3 | cut -c1-220
    pack close27
  done
  rm -rf "$STAGE"
}

# What close27's first try lost, and a fair old/new A/B (both checkouts on the compiled slot path:
# ab and ab256 built the extension in the new checkout only, so their "old" runs took the Python slot
# path; the sidecar's ready line says which):
#   AB_OLD=.gpu_old bash bench/gpu_session.sh finish27  # the paths forced one by one at 256k-2M rows,
#     batches 1/4/16 (the raw JSON lines kept: close27 filtered them and ran out of time before its
#     table); then 1M x 768 fp16 at 256 tasks, old and new alternating, twice
build_old() {  # the compiled slot path in the old checkout too (same compiler, same flags)
  (cd "$1" && python3 setup.py -q build_ext --inplace) > "$STAGE/build-ext-old.log" 2>&1 \
    || echo "build_ext in $1 failed (see build-ext-old.log)"
}

alternate() {  # alternate PACK PREFIX TASKS SECONDS TIMEOUT OLD: 1M x 768 fp16 through the broker,
  # old and new checkout alternating, two rounds, each on a fresh sidecar, packed after every run
  local r side dir
  for r in 1 2; do
    for side in old new; do
      dir=$PWD; [ "$side" = old ] && dir=$PWD/$6
      (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout "$5" python3 bench/bench_gpu.py --sizes 1Mx768:float16 \
        --tasks "$3" --seconds "$4" --skip-inproc --out-dir "$STAGE" --out-name "$2-$side-$r.json" \
        > "$STAGE/$2-$side-$r.log" 2>&1)
      echo "== $side round $r: $(grep -o 'slot path [a-z]*' "$STAGE/$2-$side-$r.log" | head -1)"
      grep -E 'tasks=|paths:' "$STAGE/$2-$side-$r.log" | cut -c1-220; pack "$1"
    done
  done
}

finish27() {
  local old=${AB_OLD:-.gpu_old}
  [ -d "$old" ] || { echo "finish27: no old checkout in $old"; return 1; }
  STAGE=$(mktemp -d)
  build_old "$old"
  timeout 230 python3 bench/probe.py paths --rows 262144,524288,786432,2000000 --batches 1,4,16 \
    --paths auto,int8,small,wgmma,gemmh --reps 10 --check --out "$STAGE/paths-int8-rows.json" \
    > "$STAGE/paths-int8-rows.log" 2>&1
  grep -v '^{' "$STAGE/paths-int8-rows.log" | tail -16; pack finish27
  alternate finish27 ab256c 256 3 120 "$old"
  rm -rf "$STAGE"
}

# Issue 27's figures at 1, 8, 64 and 256 tasks, old and new alternating with both checkouts on the
# compiled slot path (packed into $OUT/abtasks.json and .log):
#   AB_OLD=.gpu_old bash bench/gpu_session.sh abtasks
abtasks() {
  local old=${AB_OLD:-.gpu_old}
  [ -d "$old" ] || { echo "abtasks: no old checkout in $old"; return 1; }
  STAGE=$(mktemp -d)
  build_old "$old"
  alternate abtasks abtasks 1,8,64,256 1.5 110 "$old"
  rm -rf "$STAGE"
}

mixed() {  # issue 34 and 33.5: the kernels this change touched, on the device, then the CUDA broker suites
  STAGE=$(mktemp -d)
  timeout "${MIXED_TESTS_S:-200}" python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/gpu/test_gpu_mixed.py \
    tests/gpu/test_gpu_recency.py ${MIXED_MORE:-tests/gpu/test_gpu_backend.py} 2>&1 | tail -90 \
    > "$STAGE/gpu-tests.log"
  tail -4 "$STAGE/gpu-tests.log"; pack mixed
  KALOS_TEST_BACKEND=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE tests/ipc/test_mixed_namespaces.py \
    tests/ipc/test_memory_time.py 2>&1 | tail -15 > "$STAGE/cuda-broker.log"
  tail -3 "$STAGE/cuda-broker.log"; pack mixed
  rm -rf "$STAGE"
}

agent() {  # the agent workload (bench/bench_agent.py): old and new checkout alternating, both compiled
  local old=${AB_OLD:-.gpu_old} new=$PWD r side dir layouts=${AGENT_LAYOUTS:-1024x1000,1x1000}
  [ -d "$old" ] || { echo "agent: no old checkout in $old"; return 1; }
  STAGE=$(mktemp -d)
  case "${AGENT_SIDES:-old new}" in *old*) build_old "$old" ;; esac
  for r in $(seq 1 "${AGENT_ROUNDS:-2}"); do
    for side in ${AGENT_SIDES:-old new}; do
      dir=$new; [ "$side" = old ] && dir=$new/$old
      (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout "${AGENT_TIMEOUT:-200}" python3 "$new/bench/bench_agent.py" \
        --backend cuda --dtype float16 --dim 768 --layouts "$layouts" --tasks "${AGENT_TASKS:-1,8,64,256}" \
        --procs 8 --seconds "${AGENT_SECONDS:-2}" --target "${AGENT_TARGET:-all}" --label "$side" \
        --sidecar-args "${AGENT_SIDECAR_ARGS:-}" \
        --out "$STAGE/${AGENT_PACK:-agent}-$side-$r.json" > "$STAGE/${AGENT_PACK:-agent}-$side-$r.log" 2>&1)
      echo "== $side round $r"; grep -E 'target=|loaded|Error|error' "$STAGE/${AGENT_PACK:-agent}-$side-$r.log" | cut -c1-400
      pack "${AGENT_PACK:-agent}"
    done
  done
  rm -rf "$STAGE"
}

# Issue 36: the embedding model on the GPU: its tests (tests/gpu/test_gpu_embed.py, the text suite on
# a CUDA sidecar), then bench/bench_text.py (TEXT_MODEL: a model directory carried in, default
# .model/minilm) at 1M rows: in-process copies per worker against the sidecar's one model.
text() {
  STAGE=$(mktemp -d)
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/gpu/test_gpu_embed.py 2>&1 | tail -30 \
    > "$STAGE/gpu-embed-tests.log"
  tail -3 "$STAGE/gpu-embed-tests.log"
  KALOS_TEST_BACKEND=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE tests/ipc/test_text.py 2>&1 \
    | tail -20 > "$STAGE/cuda-text.log"
  tail -2 "$STAGE/cuda-text.log"; pack text
  (timeout "${TEXT_TIMEOUT:-400}" python3 bench/bench_text.py --model "${TEXT_MODEL:-.model/minilm}" \
    --backend cuda --dtype float16 --rows "${TEXT_ROWS:-1000000}" --procs "${TEXT_PROCS:-1,8}" \
    --tasks "${TEXT_TASKS:-1,32}" --seconds "${TEXT_SECONDS:-3}" --probe "${TEXT_PROBE:-1,8,32,128,256}" \
    --out "$STAGE/text-bench.json") > "$STAGE/text-bench.log" 2>&1
  grep -v INFO "$STAGE/text-bench.log" | tail -16; pack text
  rm -rf "$STAGE"
}

for mode in "${@:-check}"; do
  case "$mode" in
    check) check ;;
    table) table ;;
    wgmma) wgmma ;;
    bench) bench ;;
    ab) ab ;;
    ttl) ttl ;;
    ab256) ab256 ;;
    close27) close27 ;;
    finish27) finish27 ;;
    abtasks) abtasks ;;
    mixed) mixed ;;
    agent) agent ;;
    text) text ;;
    *) echo "unknown mode $mode (check, table, wgmma, bench, ab, ttl, ab256, close27, finish27, abtasks, mixed, agent, text)"; exit 2 ;;
  esac
done
