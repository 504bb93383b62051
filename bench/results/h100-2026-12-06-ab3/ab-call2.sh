set -u
export PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
NEW=$PWD; OLD=$PWD/.dev/old
cp /tmp/res/gpu-suite.log /tmp/res/ab.log $OUT/ 2>/dev/null
python3 bench/stacks.py /tmp/res/spy/*.raw --top 45 > $OUT/stacks.txt 2>&1
ls /tmp/res /tmp/res/spy > $OUT/ls.txt 2>&1
(PYTHONPATH=/tmp/site:$NEW timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gpu_embed.py -x 2>&1 | tail -40) > $OUT/embed.log
A="--backend cuda --dtype float16 --dim 768 --procs 8 --seconds 3 --warmup 1"
run() { local side=$1 label=$2 layouts=$3 tasks=$4; shift 4; local dir=$NEW; [ $side = old ] && dir=$OLD
  [ $SECONDS -gt 250 ] && { echo "skip $label"; return; }
  (cd $dir && PYTHONPATH=/tmp/site:$dir timeout 90 python3 $NEW/bench/bench_agent.py $A --layouts $layouts --tasks $tasks --label $label --out /tmp/res/$label.json "$@") >> $OUT/ab2.log 2>&1
  echo "== $label ($SECONDS s)"; grep "target=" $OUT/ab2.log | tail -n 2 | cut -c1-420; }
run old old-m 1024x1000 256
run new new-m 1024x1000 256
run old old-m2 1024x1000 256
run new new-m2 1024x1000 256
run new new-100k 100000x10 256
tar czf $OUT/res.tgz -C /tmp res
