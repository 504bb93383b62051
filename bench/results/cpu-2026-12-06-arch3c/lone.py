import os, sys, time, numpy as np
from kalos.testing.sidecar import start_sidecar_process, stop_sidecar_process
from kalos import RecallClient, RecallPool
import asyncio
N = 4000
name = f"lone{os.getpid()}"
proc = start_sidecar_process(["--ephemeral", "--dim", "128", "--backend", "numpy", "--max-k", "64"], name)
try:
    rng = np.random.default_rng(0)
    with RecallClient(name) as c:
        c.upsert(np.arange(1000), rng.standard_normal((1000, 128), dtype=np.float32), namespace="a")
        q = rng.standard_normal(128, dtype=np.float32)
        for _ in range(500): c.recall(q, 10, namespace="a")
        lat = []
        for _ in range(N):
            t = time.perf_counter_ns(); c.recall(q, 10, namespace="a"); lat.append(time.perf_counter_ns() - t)
    async def pool_run() -> list[int]:
        async with RecallPool(name, size=1) as p:
            for _ in range(500): await p.recall(q, 10, namespace="a")
            la: list[int] = []
            for _ in range(N):
                t = time.perf_counter_ns(); await p.recall(q, 10, namespace="a"); la.append(time.perf_counter_ns() - t)
            return la
    import uvloop
    lat2 = uvloop.run(pool_run())
    print(f"blocking p50 {np.median(lat)/1e3:.1f} us  pool p50 {np.median(lat2)/1e3:.1f} us")
finally:
    stop_sidecar_process(proc)
