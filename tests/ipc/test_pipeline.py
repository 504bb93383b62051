"""The sidecar's pipeline (``--pipeline on``) at its two delicate moments, forced deterministically:
callers posting just as the sidecar announces that it sleeps, and a stop with two batches in flight
and one more posted. A real sidecar (in this process, on the numpy backend, whose searches of
INLINE_WORK and more run on its worker thread) serves real slots and semaphores; answers are
checked against float64."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from conftest import unique_name

from kalos.broker.layout import S_DONE, Op, Status
from kalos.clients._transport import Connection
from kalos.sidecar_cuda.backends.numpy_backend import INLINE_WORK
from kalos.sidecar_cuda.server import ServeConfig, Sidecar

pytestmark = pytest.mark.timeout(60)


def post(slot, q: np.ndarray, k: int) -> None:
    slot.view.queries[0] = q
    slot.post(int(Op.RECALL), b"default", k, 1, 0, 0, time.monotonic_ns())


def check_answer(sc: Sidecar, slot, q: np.ndarray, k: int, matrix: np.ndarray) -> None:
    f = sc.seg.slots[slot.index]
    assert int(f["state"]) == S_DONE and int(f["status"]) == Status.OK
    ids = np.asarray(slot.view.result_ids[0, :k])
    ref = matrix.astype(np.float64) @ q.astype(np.float64)
    kth = np.sort(ref)[-k]
    assert (ref[ids] >= kth - 1e-4).all() and len(set(ids.tolist())) == k


def test_callers_posting_as_the_sidecar_sleeps_are_not_stalled(seed):
    """Two recalls are posted just as the sidecar announces it sleeps: their batch is started
    and left in flight; the sidecar must not then block on the doorbell (which nobody would ring
    for 250 ms) while it is in flight."""
    rng = np.random.default_rng(seed)
    cfg = ServeConfig(
        name=unique_name("psleep"),
        dim=8,
        slots=8,
        backend="numpy",
        random_rows=1000,
        seed=seed,
        spin_us=0.0,
        pipeline="on",
    )
    matrix = np.random.default_rng(seed).standard_normal((1000, 8), dtype=np.float32)
    hook: list = []

    class Racing(Sidecar):
        def _drain(self, bell):
            Sidecar._drain(bell)
            if hook:
                # The clients read "not sleeping" just before the sidecar announced it, so they
                # post without ringing the doorbell; their posts land right after the announcement.
                u32 = self._words.u32
                u32[self._sleep_word] = 0
                hook.pop()()
                u32[self._sleep_word] = 1

    class WatchedBell:
        """The doorbell, noting every blocking wait that starts while a posted request is still
        unanswered: nobody would ring for those (the stall), whatever the machine's speed."""

        def __init__(self, bell) -> None:
            self._bell = bell
            self.stalls = 0

        def acquire(self, timeout=None):
            if timeout != 0 and posted_at and not all(s.is_done() for s in slots):
                self.stalls += 1
            return self._bell.acquire(timeout)

        def __getattr__(self, name):
            return getattr(self._bell, name)

    # Bound before the serving thread starts: WatchedBell reads them from its first wait.
    posted_at: list[float] = []
    slots: list = []
    sc = Racing(cfg)
    sc.start()
    bell = sc._objs.bell = WatchedBell(sc._objs.bell)
    th = threading.Thread(target=sc.serve_forever, daemon=True)
    th.start()
    conn = Connection(cfg.name)
    try:
        slots[:] = conn.lease(2)
        qs = [rng.standard_normal(8).astype(np.float32) for _ in slots]

        def post_both() -> None:
            posted_at.append(time.perf_counter())
            for s, q in zip(slots, qs):
                post(s, q, 5)

        hook.append(post_both)
        t0 = time.perf_counter()
        while not all(s.is_done() for s in slots):
            assert time.perf_counter() - t0 < 30, "never answered"
            time.sleep(0.0001)
        waited = time.perf_counter() - posted_at[0]
        for s, q in zip(slots, qs):
            check_answer(sc, s, q, 5, matrix)
        print(f"\n[pipeline] answered {waited * 1e3:.1f} ms after the posts")
        assert bell.stalls == 0, "the sidecar blocked on the doorbell with requests unanswered"
    finally:
        sc.request_stop()
        th.join(10)
        conn.close()


def test_stop_answers_every_request_posted_before_it(seed):
    """Two batches in flight (the pipeline's depth) and a fifth request posted: the stop must
    answer all five, not leave the fifth POSTED for its caller to see as BrokerUnavailable."""
    rng = np.random.default_rng(seed)
    # Big enough that a batch of two queries runs on the worker thread (smaller ones are searched
    # at once) and is still running when the next one is taken.
    d = 64
    n = INLINE_WORK // (2 * d) + 1
    cfg = ServeConfig(
        name=unique_name("pstop"), dim=d, slots=8, backend="numpy", random_rows=n, seed=seed, pipeline="on"
    )
    matrix = np.random.default_rng(seed).standard_normal((n, d), dtype=np.float32)
    sc = Sidecar(cfg)
    sc.start()
    conn = Connection(cfg.name)
    try:
        slots = conn.lease(5)
        qs = [rng.standard_normal(d).astype(np.float32) for _ in slots]
        post(slots[0], qs[0], 4)
        post(slots[1], qs[1], 4)
        sc.serve_pending()
        post(slots[2], qs[2], 4)
        post(slots[3], qs[3], 4)
        sc.serve_pending()
        post(slots[4], qs[4], 4)
        assert sc.serve_remaining() == 5
        for s, q in zip(slots, qs):
            check_answer(sc, s, q, 4, matrix)
    finally:
        conn.close()
        sc.close()
