# One call: the GPU suite on this code; old (59c1c62, before issue 34) and new alternating through
# the broker; the new side sampled with py-spy and under each launch regime. Stops starting steps
# near the call's limit; packs what it has.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > $OUT/pip.log 2>&1
export PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
NEW=$PWD; OLD=$PWD/.dev/old
(PYTHONPATH=/tmp/site:$NEW python3 setup.py -q build_ext --inplace; cd $OLD && PYTHONPATH=/tmp/site:$OLD python3 setup.py -q build_ext --inplace) > $OUT/build.log 2>&1
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import sys,numpy,cupy; print(sys.version.split()[0], numpy.__version__, cupy.__version__)"; py-spy --version; git -C $NEW log --oneline -1 2>/dev/null; } > $OUT/env.log 2>&1
mkdir -p /tmp/res
(PYTHONPATH=/tmp/site:$NEW timeout 170 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu 2>&1 | tail -25) > /tmp/res/gpu-suite.log
tail -3 /tmp/res/gpu-suite.log
A="--backend cuda --dtype float16 --dim 768 --procs 8 --seconds 3 --warmup 1"
run() {  # side label layouts tasks extra...
  local side=$1 label=$2 layouts=$3 tasks=$4; shift 4
  local dir=$NEW; [ $side = old ] && dir=$OLD
  [ $SECONDS -gt 470 ] && { echo "skip $label ($SECONDS s)"; return; }
  (cd $dir && PYTHONPATH=/tmp/site:$dir timeout 150 python3 $NEW/bench/bench_agent.py $A --layouts $layouts --tasks $tasks --label $label --out /tmp/res/$label.json "$@") >> /tmp/res/ab.log 2>&1
  echo "== $label ($SECONDS s)"; grep "target=" /tmp/res/ab.log | tail -n 4 | cut -c1-300
}
run old old-1 1x1000000,1024x1000 1,256
run new new-1 1x1000000,1024x1000 1,256
run new spy 1024x1000 256 --py-spy /tmp/res/spy
run old old-2 1x1000000,1024x1000 1,256
run new new-2 1x1000000,1024x1000 1,256
for L in merge split; do run new launch-$L 1024x1000 256 --sidecar-args "--launch $L"; done
python3 $NEW/bench/stacks.py /tmp/res/spy/*.raw --top 40 > $OUT/stacks.txt 2>&1
cp /tmp/res/ab.log $OUT/ab.log
tar czf $OUT/res.tgz -C /tmp res
