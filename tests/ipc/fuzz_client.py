"""A hostile client for the fuzz test: leases slots of a running sidecar and writes random and
adversarial bytes into their control blocks, data areas and stats blocks, posts semaphores and the
doorbell, and sends well-formed requests in between, checking each answer's generation echo; in
bursts, every slot at once (recalls checked against float64, alone or among hostile requests).

Run as a process: ``python tests/fuzz_client.py NAME SEED SECONDS METRICS_URL``. Prints one JSON
line with what it did and saw, then exits without giving its slots back (as a crashed client
would), so the sidecar's reaper has to reclaim them.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from collections import Counter

import numpy as np

import kalos.clients._requests as _requests
from kalos.broker.layout import (
    CONTROL_BYTES,
    S_DONE,
    S_FREE,
    S_POSTED,
    STATS_BYTES,
    Flag,
    Status,
)
from kalos.clients._slots import ClientSlot
from kalos.clients._transport import Connection, Semaphore

N_SLOTS = 6
DEEP = b"[" * 20000 + b"]" * 20000  # beyond any JSON decoder's recursion limit


class Fuzzer:
    def __init__(self, name: str, seed: int, metrics_url: str) -> None:
        self.rng = np.random.default_rng(seed)
        # The sidecar's "default" namespace (--random-rows 500 --seed SEED, dim 16), which nothing
        # here writes: the reference for the recalls of a burst.
        self.matrix = np.random.default_rng(seed).standard_normal((500, 16), dtype=np.float32).astype(np.float64)
        self.conn = Connection(name)
        self.L = self.conn.layout
        self.slots: list[ClientSlot] = self.conn.lease(N_SLOTS)
        self.metrics_url = metrics_url
        self.c: Counter[str] = Counter()
        self.statuses: Counter[str] = Counter()
        self.next_scrape = 0.0

    # -- helpers ---------------------------------------------------------------------------
    def pick(self, options: list[object]) -> object:
        return options[int(self.rng.integers(len(options)))]

    def ours(self, s: ClientSlot) -> bool:
        return int(self.conn.seg.slots[s.index]["owner_pid"]) == os.getpid()

    def drain(self, sem: Semaphore) -> None:
        while sem.try_acquire():
            pass

    def reset(self, s: ClientSlot) -> None:
        """Make a slot usable again after a fuzz step (leftover posts drained, state FREE)."""
        self.drain(s.req)
        self.drain(s.resp)
        self.conn.seg.slots[s.index]["state"] = S_FREE

    def wait_answer(self, s: ClientSlot, generation: int, timeout: float = 15.0) -> str:
        """'answered' (DONE with the generation echoed), 'reclaimed' (the reaper took the slot),
        'echo' (answered for another generation) or 'unanswered'."""
        rec = self.conn.seg.slots
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if int(rec[s.index]["state"]) == S_DONE:
                s.resp.acquire(1.0)
                if int(rec[s.index]["resp_generation"]) != generation:
                    return "echo"
                st = int(np.int32(rec[s.index]["status"]))
                try:
                    self.statuses[Status(st).name] += 1
                except ValueError:
                    self.statuses[f"status {st}"] += 1
                return "answered"
            if not self.ours(s):
                return "reclaimed"
            time.sleep(0.0005)
        return "unanswered"

    def post_raw(self, s: ClientSlot, *, bell: bool = True) -> None:
        rec = self.conn.seg.slots
        rec[s.index]["state"] = S_POSTED
        s.req.release()
        if bell:
            self.conn.bell.release()

    def scrape(self) -> None:
        now = time.monotonic()
        if now < self.next_scrape:
            return
        self.next_scrape = now + 0.25
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=5) as r:
                r.read()
                self.c["scrape_ok" if r.status == 200 else "scrape_bad"] += 1
        except Exception:
            self.c["scrape_bad"] += 1

    # -- fuzz steps ----------------------------------------------------------------------------
    def wellformed(self, s: ClientSlot) -> None:
        rng, L = self.rng, self.L
        ns = str(self.pick(["fuzz", "fz-1", "fz.2"]))
        kind = int(rng.integers(6))
        nq = int(rng.integers(1, L.max_queries + 1))
        vecs = rng.standard_normal((nq, L.dim)).astype(np.float32)
        ids = rng.integers(0, 50, nq)
        if kind == 0:
            p = _requests.recall(
                L, vecs, int(rng.integers(1, L.max_k + 1)), ns.encode(), bool(rng.integers(2)), shape=_requests.ROWS
            )
        elif kind == 1:
            p = _requests.upsert(L, ids, vecs, [{"n": int(i)} for i in ids], ns, 16384)[0]
        elif kind == 2:
            p = _requests.delete(L, ids, ns)[0]
        elif kind == 3:
            p = _requests.export_page(L, ns, int(rng.integers(-1, 40)))
        elif kind == 4:
            p = _requests.list_namespaces()
        else:
            p = _requests.drop(ns)
        blob_len = _requests.write(s.view, p)
        gen = s.post(p.op, p.ns, p.k, p.nq, p.flags, blob_len, time.monotonic_ns())
        self.c["wellformed"] += 1
        self.c["wellformed_" + self.wait_answer(s, gen)] += 1
        self.reset(s)

    def garbage_control(self, s: ClientSlot) -> None:
        """Random bytes over the whole control block, lease fields kept (mostly)."""
        rng, conn = self.rng, self.conn
        base = self.L.control_base(s.index)
        rec = conn.seg.slots
        owner = (int(rec[s.index]["owner_pid"]), int(rec[s.index]["owner_start"]))
        conn.mm[base : base + CONTROL_BYTES] = rng.bytes(CONTROL_BYTES)
        if rng.random() < 0.9:
            rec[s.index]["owner_pid"], rec[s.index]["owner_start"] = owner
        self.posted_garbage(s)

    def garbage_fields(self, s: ClientSlot) -> None:
        """A plausible request with adversarial fields and data."""
        self.hostile_fields(s)
        self.posted_garbage(s)

    def hostile_fields(self, s: ClientSlot) -> None:
        """Write a plausible request with adversarial fields and data (not posted)."""
        rng, L, conn = self.rng, self.L, self.conn
        rec = conn.seg.slots
        i = s.index
        v = s.view
        rec[i]["op"] = int(self.pick([1, 2, 3, 4, 5, 6, 7, 8, 0, 9, 99, 2**32 - 1]))
        rec[i]["k"] = int(self.pick([1, 5, L.max_k, 0, L.max_k + 1, 2**31, 2**32 - 1]))
        rec[i]["nq"] = int(self.pick([1, L.max_queries, 0, L.max_queries + 1, 2**32 - 1]))
        rec[i]["flags"] = int(self.pick([0, int(Flag.WITH_PAYLOAD), int(Flag.WHERE), int(rng.integers(2**32))]))
        rec[i]["generation"] = int(rng.integers(2**63)) * 2 + int(rng.integers(2))
        rec[i]["t_post_ns"] = int(self.pick([0, time.monotonic_ns(), 2**63 + 5, 2**64 - 1]))
        ns = self.pick([b"fuzz", b"default\xff", b"\x00" * 8, rng.bytes(64), b"a" * 64])
        rec[i]["namespace"] = ns
        rec[i]["ns_len"] = int(self.pick([len(ns), 0, 65, 2**32 - 1]))
        q = rng.standard_normal(v.queries.shape).astype(np.float32)
        if rng.random() < 0.3:
            q.flat[rng.integers(q.size)] = self.pick([np.nan, np.inf, -np.inf, 3.4e38])
        v.queries[...] = q
        v.ids[...] = self.pick(
            [rng.integers(0, 100, v.ids.shape), rng.integers(-(2**63), 2**63 - 1, v.ids.shape, dtype=np.int64)]
        )
        blob = self.pick(
            [
                b"",
                b"not json",
                DEEP,
                b"null\n" * 3,
                b'{"a":1}',
                rng.bytes(200),
                b"\xff\xfe",
                b'{"a":{"$in":[1,"x",null]},"$or":[{"b":{"$gt":2}}]}',
            ]
        )
        blob = bytes(blob)[: L.blob_bytes]
        v.blob[: len(blob)] = np.frombuffer(blob, np.uint8)
        rec[i]["blob_len"] = int(self.pick([len(blob), 0, L.blob_bytes, L.blob_bytes + 1, 2**32 - 1]))

    def burst(self, _s: ClientSlot) -> None:
        """Every slot posted at once, so that the requests meet in one batch: recalls of the
        legitimate namespace only (the batch route: rows gathered, one search, answered in one
        call), or mixed with hostile requests. Each recall's answer is checked against float64."""
        rng, L, conn = self.rng, self.L, self.conn
        hostile = rng.random() < 0.5
        posted: list[tuple[ClientSlot, int, tuple[np.ndarray, int] | None]] = []
        for s in self.slots:
            if hostile and rng.random() < 0.5:
                self.hostile_fields(s)
                self.post_raw(s, bell=False)
                posted.append((s, int(conn.seg.slots[s.index]["generation"]), None))
                continue
            nq, k = int(rng.integers(1, L.max_queries + 1)), int(rng.integers(1, L.max_k + 1))
            q = rng.standard_normal((nq, L.dim)).astype(np.float32)
            p = _requests.recall(L, q, k, b"default", False, shape=_requests.ROWS)
            gen = s.post(p.op, p.ns, p.k, p.nq, p.flags, _requests.write(s.view, p), time.monotonic_ns())
            posted.append((s, gen, (q, k)))
        conn.bell.release()
        for s, gen, asked in posted:
            outcome = self.wait_answer(s, gen)
            self.c[f"burst_{'recall' if asked else 'garbage'}_{outcome}"] += 1
            if asked is not None and outcome == "answered":
                self.c["burst_checked" if self.correct(s, *asked) else "burst_wrong"] += 1
            if self.ours(s):
                self.reset(s)
        self.c["burst"] += 1

    def correct(self, s: ClientSlot, q: np.ndarray, k: int) -> bool:
        """An answer of status OK with k hits per query row, each a true top-k row by float64
        scores (ties by score)."""
        rec = self.conn.seg.slots[s.index]
        if int(np.int32(rec["status"])) != Status.OK or int(rec["n_results"]) != k:
            return False
        for j, row in enumerate(q.astype(np.float64)):
            ref = self.matrix @ row
            kth = np.sort(ref)[-k]
            ids = np.asarray(s.view.result_ids[j, :k])
            if len(set(ids.tolist())) != k or not (0 <= ids).all() or not (ref[ids % 500] >= kth - 1e-4).all():
                return False
        return True

    def posted_garbage(self, s: ClientSlot) -> None:
        rng = self.rng
        rec = self.conn.seg.slots
        gen = int(rec[s.index]["generation"])
        if rng.random() < 0.85:  # a posted request: it must be answered (or the slot reclaimed)
            self.post_raw(s, bell=bool(rng.integers(2)))
            self.c["garbage_posted"] += 1
            self.c["garbage_" + self.wait_answer(s, gen)] += 1
        else:  # some other state, maybe with a stray req post: the sidecar must ignore it
            rec[s.index]["state"] = int(self.pick([0, 1, 3, 4, 5, 2**32 - 1]))
            if rng.random() < 0.5:
                s.req.release()
            time.sleep(0.002)
            self.c["garbage_unposted"] += 1
        if self.ours(s):
            self.reset(s)

    def garbage_stats(self, s: ClientSlot) -> None:
        rng, conn = self.rng, self.conn
        base = self.L.stats_base(s.index)
        if rng.random() < 0.5:
            conn.mm[base : base + STATS_BYTES] = rng.bytes(STATS_BYTES)
        else:
            for field in ("lat_count", "lat_sum_ns", "err_count", "timeout_count"):
                conn.seg.stats[s.index][field] = int(self.pick([0, 2**63, 2**64 - 1, 2**62 + 3]))
        self.c["stats"] += 1

    def stray_posts(self, s: ClientSlot) -> None:
        for _ in range(int(self.rng.integers(1, 5))):
            s.req.release()
            self.conn.bell.release()
        time.sleep(0.002)
        self.reset(s)
        self.c["stray_posts"] += 1

    def bad_owner(self, s: ClientSlot) -> None:
        rec = self.conn.seg.slots
        rec[s.index]["owner_pid"] = int(self.pick([2**31, 2**31 + 7, 2**63 - 1, -7, 1 << 22 | 1]))
        rec[s.index]["owner_start"] = int(self.rng.integers(2**63))
        rec[s.index]["state"] = int(self.pick([0, 2, 4]))
        self.slots.remove(s)
        self.c["bad_owner"] += 1

    def enough(self) -> bool:
        c = self.c
        return (
            c["iterations"] > 50
            and c["wellformed"] > 5
            and c["garbage_posted"] > 5
            and c["burst"] > 5
            and c["scrape_ok"] >= 1
        )

    def run(self, seconds: float) -> dict[str, object]:
        steps = [
            self.wellformed,
            self.garbage_control,
            self.garbage_fields,
            self.garbage_stats,
            self.stray_posts,
            self.bad_owner,
            self.burst,
        ]
        weights = np.array([4, 3, 4, 1, 1, 0.3, 1.5])
        weights /= weights.sum()
        t0 = time.monotonic()
        # ``seconds`` at least, and on (up to ten times as long) until each kind of attack has
        # happened a few times: a loaded machine makes fewer per second.
        while time.monotonic() - t0 < seconds or (not self.enough() and time.monotonic() - t0 < 10 * seconds):
            self.scrape()
            self.slots = [s for s in self.slots if self.ours(s)]
            if len(self.slots) < N_SLOTS:
                self.slots += self.conn.lease(N_SLOTS - len(self.slots))
            if not self.slots:
                time.sleep(0.01)
                continue
            s = self.slots[int(self.rng.integers(len(self.slots)))]
            steps[int(self.rng.choice(len(steps), p=weights))](s)
            self.c["iterations"] += 1
        self.next_scrape = 0.0
        self.scrape()
        return {
            "seconds": round(time.monotonic() - t0, 2),
            **self.c,
            "statuses": dict(self.statuses),
            "slots_fuzzed": sorted({s.index for s in self.slots}),
        }


def main() -> None:
    name, seed, seconds, url = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    f = Fuzzer(name, seed, url)
    out = f.run(seconds)
    print(json.dumps(out), flush=True)
    os._exit(0)  # no give-back: the reaper must reclaim everything this process held


if __name__ == "__main__":
    main()
