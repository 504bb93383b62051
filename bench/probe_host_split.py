"""Host-side split of a lone CUDA search (in-process): enqueue, wait, collect; graph replay alone.

Run on a GPU machine from the repository root (writes $OUT/<name>.json, or ./ without OUT).
Results: bench/results/h200-2026-12-01e/ and bench/results/README.md."""
import json, os, time
import numpy as np
import cupy as cp
from kalos.broker.layout import Metric
from kalos.sidecar_cuda.backends.cuda.backend import CupyBackend

def med(x): return round(float(np.median(x)) / 1e3, 2)
res = {}
rng = np.random.default_rng(2)
for rows, dim, dt in ((256, 128, "float32"), (1000000, 768, "float16")):
    be = CupyBackend(storage_dtype=dt)
    m = be.new_matrix(dim, rows, Metric.DOT)
    for r0 in range(0, rows, 1 << 17):
        r1 = min(rows, r0 + (1 << 17))
        m.write_rows(np.arange(r0, r1), rng.standard_normal((r1 - r0, dim), dtype=np.float32))
    qs = rng.standard_normal((600, 1, dim), dtype=np.float32)
    st, wt, ct, tot = [], [], [], []
    for i in range(600):
        t0 = time.perf_counter_ns()
        p = be._start(m, qs[i], rows, 10, None)
        t1 = time.perf_counter_ns()
        be._wait(p.bufs.done)
        t2 = time.perf_counter_ns()
        be._collect(p)
        t3 = time.perf_counter_ns()
        if i >= 100:
            st.append(t1 - t0); wt.append(t2 - t1); ct.append(t3 - t2); tot.append(t3 - t0)
    key = f"{rows}x{dim}:{dt}"
    res[key + " start (stage+launch+record)"] = med(st)
    res[key + " wait (spin on event)"] = med(wt)
    res[key + " collect"] = med(ct)
    res[key + " total"] = med(tot)
    g = next(iter(be._graphs.values()))
    s = be._stream
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    gl, gw = [], []
    for i in range(500):
        t0 = time.perf_counter_ns()
        e0.record(s); g.launch(s); e1.record(s)
        while not e1.done: pass
        t1 = time.perf_counter_ns()
        if i >= 100:
            gl.append(cp.cuda.get_elapsed_time(e0, e1) * 1e6); gw.append(t1 - t0)
    res[key + " graph replay GPU (events)"] = med(gl)
    res[key + " graph replay wall (record+launch+record+spin)"] = med(gw)
    # pieces of host work
    import timeit as T
    n = 20000
    res[key + " host: with be._dev"] = round(T.timeit(lambda: be._dev.__enter__() or be._dev.__exit__(None, None, None), number=n) / n * 1e6, 2)
    res[key + " host: g.launch (async)"] = round(T.timeit(lambda: g.launch(s), number=2000) / 2000 * 1e6, 2); s.synchronize()
    ev = be._sets[0].done
    res[key + " host: event.record"] = round(T.timeit(lambda: ev.record(s), number=2000) / 2000 * 1e6, 2); s.synchronize()
    res[key + " host: event.done (query)"] = round(T.timeit(lambda: ev.done, number=n) / n * 1e6, 2)
    be.close()
for k, v in res.items():
    print(f"{k:70s} {v:8.2f} us")
json.dump(res, open(os.environ.get("OUT", ".") + "/probe-host.json", "w"), indent=1)
