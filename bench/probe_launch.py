"""Where does a lone 256x128 f32 search's GPU time go? Variants timed with CUDA events.

Run on a GPU machine from the repository root (writes $OUT/<name>.json, or ./ without OUT).
Results: bench/results/h200-2026-12-01e/ and bench/results/README.md."""
import json, sys, time
import numpy as np
import cupy as cp
from kalos.broker.layout import Metric
from kalos.sidecar_cuda.backends.cuda import paths as P
from kalos.sidecar_cuda.backends.cuda.backend import CupyBackend

def timeit(fn, stream, reps=400):
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    gpu, wall = [], []
    for i in range(reps + 20):
        t0 = time.perf_counter_ns()
        e0.record(stream); fn(); e1.record(stream); e1.synchronize()
        t1 = time.perf_counter_ns()
        if i >= 20:
            gpu.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3); wall.append((t1 - t0) / 1e3)
    return {"gpu_us": round(float(np.median(gpu)), 2), "wall_us": round(float(np.median(wall)), 2)}

res = {}
rng = np.random.default_rng(1)
for rows, dim, dt in ((256, 128, "float32"), (4096, 128, "float32"), (100000, 768, "float16")):
    for graphs in (True, False):
        for zc in (4, 0):
            P.ZERO_COPY_BLOCKS = zc
            be = CupyBackend(storage_dtype=dt, use_graphs=graphs)
            m = be.new_matrix(dim, rows, Metric.DOT)
            m.write_rows(np.arange(rows), rng.standard_normal((rows, dim), dtype=np.float32))
            q = rng.standard_normal((1, dim), dtype=np.float32)
            r = timeit(lambda: m.search(q, rows, 10), be._stream)
            res[f"{rows}x{dim}:{dt} search graphs={graphs} zero_copy={bool(zc)}"] = r
            be.close()
P.ZERO_COPY_BLOCKS = 4
s = cp.cuda.Stream(non_blocking=True)
mod = cp.RawModule(code=r'''
extern "C" __global__ void empty() {}
extern "C" __global__ void rt(const int* h, int* o) { if (threadIdx.x == 0) o[0] = h[0] + 1; }
extern "C" __global__ void rt2(const int* h, int* o) { if (threadIdx.x == 0) { int a = h[0]; o[0] = h[a & 1] + 1; } }
''')
empty, rtk, rt2 = mod.get_function("empty"), mod.get_function("rt"), mod.get_function("rt2")
hm = cp.cuda.alloc_pinned_memory(4096); hp = hm.ptr
dm = cp.cuda.alloc(4096)
res["empty kernel"] = timeit(lambda: empty((1,), (32,), (), stream=s), s)
res["kernel: 1 mapped read + mapped write"] = timeit(lambda: rtk((1,), (32,), (np.uint64(hp), np.uint64(hp + 64)), stream=s), s)
res["kernel: 2 dependent mapped reads"] = timeit(lambda: rt2((1,), (32,), (np.uint64(hp), np.uint64(hp + 64)), stream=s), s)
res["kernel: device read/write"] = timeit(lambda: rtk((1,), (32,), (np.uint64(dm.ptr), np.uint64(dm.ptr + 64)), stream=s), s)
res["H2D 576 B + empty"] = timeit(lambda: (cp.cuda.runtime.memcpyAsync(dm.ptr, hp, 576, 1, s.ptr), empty((1,), (32,), (), stream=s)), s)
# graph of the empty kernel
s.begin_capture(); empty((1,), (32,), (), stream=s); g = s.end_capture()
res["graph(empty)"] = timeit(lambda: g.launch(s), s)
res["nothing (2 events)"] = timeit(lambda: None, s)
for k, v in res.items():
    print(f"{k:60s} gpu {v['gpu_us']:8.2f} us  wall {v['wall_us']:8.2f} us")
import os
json.dump(res, open(os.environ.get("OUT", ".") + "/probe-small.json", "w"), indent=1)
