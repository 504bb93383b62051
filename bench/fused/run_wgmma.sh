#!/bin/bash
# One device call for the wgmma variant: versions, SASS check, tests (raw-score check first), probe.
# Run from the repository root with carry [bench/fused/.cubin, bench/fused/base]; logs under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
cd bench/fused
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv;
  python3 -c "import cupy,numpy;print('cupy',cupy.__version__,'numpy',numpy.__version__,'rt',cupy.cuda.runtime.runtimeGetVersion())";
  nvcc --version | tail -1;
  f=$(ls .cubin/fw_w128smaxpf_kc32_*.cubin | head -1); echo "SASS $f: HGMMA $(cuobjdump -sass $f | grep -c HGMMA), HMMA $(cuobjdump -sass $f | grep -c ' HMMA')";
  cuobjdump -sass $f | grep -m3 HGMMA; } 2>&1 | tee $OUT/env.txt
timeout 120 python3 -m pytest -x -q test_fused.py -k "wgmma_raw" 2>&1 | tee $OUT/test_raw.txt || { echo RAW FAILED; exit 1; }
timeout 200 python3 -m pytest -q test_fused.py -k "wgmma" 2>&1 | tee $OUT/test_wgmma.txt
cd ../..
timeout 120 python3 bench/fused/diag_wgmma.py --out $OUT/diag_wgmma.json 2>&1 | tee $OUT/diag_log.txt
timeout ${PROBE_T:-300} python3 bench/fused/probe_fused.py --no-sweep ${PROBE_ARGS} --out $OUT/fused_wgmma_probe_h200_k10.json 2>&1 | tee $OUT/probe_log.txt
