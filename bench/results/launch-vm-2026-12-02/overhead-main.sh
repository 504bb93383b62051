# How overhead-main-06104ca-*.json were made: the base commit's tree (no --launch option), with
# bench/bench_launch_overhead.py minus its `launch=pol,` line, the compiled extensions copied in
# (their sources are unchanged), run alternately with bench/bench_launch_overhead.py in this tree.
mkdir -p /tmp/base && git archive 06104ca | tar -x -C /tmp/base
cp clients/*.so /tmp/base/clients/ && cp sidecar_cuda/*.so /tmp/base/sidecar_cuda/
sed -e 's/                launch=pol,//' bench/bench_launch_overhead.py > /tmp/base/bench/lo_base.py
for i in 1 2 3; do
  PYTHONPATH=$PWD python3 bench/bench_launch_overhead.py --out bench/results/launch-vm-2026-12-02/overhead-$i.json
  (cd /tmp/base && PYTHONPATH=/tmp/base python3 bench/lo_base.py --policies main --out "$OLDPWD/bench/results/launch-vm-2026-12-02/overhead-main-06104ca-$i.json")
done
