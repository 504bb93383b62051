#!/usr/bin/env bash
# The Kubernetes pod's layout on one host, without containers: one sidecar, N uvicorn workers of
# examples/http_recall.py sharing its /dev/shm and uid, and Prometheus scraping the sidecar
# (deploy/prometheus.yml) when `prometheus` is installed and PROMETHEUS=1 (default).
#
#   deploy/local-workers.sh [N_WORKERS]        # then: curl 'localhost:8000/recall?seed=7&k=5'
#
# Settings: KALOS_* (every `kalos serve` option; defaults below: an ephemeral broker "local" of
# 3000 random rows, dim 16, metrics on 9464), PORT (8000), PROMETHEUS (1). Ctrl-C stops all.
set -euo pipefail

workers=${1:-4}
root=$(cd "$(dirname "$0")/.." && pwd)
export KALOS_NAME=${KALOS_NAME:-local}
export KALOS_DIM=${KALOS_DIM:-16}
export KALOS_METRICS_PORT=${KALOS_METRICS_PORT:-9464}
if [[ -z ${KALOS_DATA_DIR:-} ]]; then
    export KALOS_EPHEMERAL=${KALOS_EPHEMERAL:-1}
    export KALOS_RANDOM_ROWS=${KALOS_RANDOM_ROWS:-3000}
fi
port=${PORT:-8000}
python=${PYTHON:-python3}

pids=()
stop() {
    trap - EXIT INT TERM
    # Workers first, then the sidecar (the order a pod stops a native sidecar).
    for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
        kill -TERM "${pids[i]}" 2>/dev/null || true
        wait "${pids[i]}" 2>/dev/null || true
    done
}
trap stop EXIT INT TERM

"$python" -m kalos.sidecar_cuda &
pids+=($!)

# Start the workers once the memory is loaded, like the pod's startupProbe.
"$python" - "$KALOS_METRICS_PORT" <<'PY'
import sys, time, urllib.request
url = f"http://127.0.0.1:{sys.argv[1]}/readyz"
deadline = time.monotonic() + 600
while True:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            if r.status == 200:
                break
    except OSError:
        pass
    if time.monotonic() > deadline:
        sys.exit("sidecar not ready after 600 s")
    time.sleep(0.1)
PY

"$python" -m uvicorn --app-dir "$root/examples" http_recall:app --workers "$workers" \
    --host 127.0.0.1 --port "$port" &
pids+=($!)

if [[ ${PROMETHEUS:-1} == 1 ]] && command -v prometheus >/dev/null; then
    tsdb=$(mktemp -d)
    prometheus --config.file="$root/deploy/prometheus.yml" --storage.tsdb.path="$tsdb" \
        --web.listen-address=127.0.0.1:9090 >"$tsdb/prometheus.log" 2>&1 &
    pids+=($!)
    echo "prometheus on http://127.0.0.1:9090 (log $tsdb/prometheus.log)" >&2
fi
echo "broker $KALOS_NAME: $workers workers on http://127.0.0.1:$port/recall, metrics on :$KALOS_METRICS_PORT" >&2
# Until one of them exits (or Ctrl-C); the trap stops the rest.
wait -n
