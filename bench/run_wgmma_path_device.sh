#!/bin/bash
# One device call (issue 14 item 1): compile check, wgmma GPU tests, the probe, the other GPU tests.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && export CUPY_CACHE_DIR=/tmp/kc && nvidia-smi > $OUT/nvidia-smi.txt 2>&1; S=$(date +%s)
timeout 150 python3 -c "
import logging,time;logging.basicConfig(level=10)
from kalos.sidecar_cuda.backends.cuda import wgmma as w
for bq in (16,32,64):
  t=time.time(); c=w.compile_cubin(w.kernel_source(bq), w.compile_options(bq, w.stages_for(bq,232448))); print('bq',bq,'cubin',len(c),'bytes',round(time.time()-t,2),'s',flush=True)
" > $OUT/compile.log 2>&1; echo "compile rc=$? t=$(( $(date +%s)-S ))"; tail -c 3000 $OUT/compile.log; grep -q "cubin" $OUT/compile.log || exit 3
timeout 170 python3 -m pytest -q -m gpu tests/gpu/test_gpu_wgmma.py -p no:cacheprovider -x > $OUT/test_gpu_wgmma.log 2>&1; echo "wgmma tests rc=$? t=$(( $(date +%s)-S ))"; tail -c 2500 $OUT/test_gpu_wgmma.log
timeout 150 python3 bench/probe_wgmma_path.py --out $OUT/probe_wgmma_path.json > $OUT/probe_wgmma_path.log 2>&1; echo "probe rc=$? t=$(( $(date +%s)-S ))"; grep -v DEBUG $OUT/probe_wgmma_path.log | tail -c 2500
R=$(( 430 - ($(date +%s)-S) )); [ $R -gt 30 ] && timeout $R python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider --ignore=tests/gpu/test_gpu_wgmma.py > $OUT/test_gpu_all.log 2>&1; echo "all gpu tests rc=$? t=$(( $(date +%s)-S ))"; tail -c 1500 $OUT/test_gpu_all.log
