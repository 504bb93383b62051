"""Metrics without a sidecar process: the pure aggregation (fresh registries), the collector on a
fake sidecar view, the text exposition, the HTTP endpoint and ``kalos top``'s arithmetic."""

from __future__ import annotations

import asyncio
import io
import itertools
import math
import os
import socket
import time
import urllib.error
import urllib.request
from bisect import bisect_left
from types import SimpleNamespace

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from kalos.broker.errors import ConfigError
from kalos.broker.layout import (
    HIST_BUCKETS,
    L_DELETE,
    L_GET,
    L_RECALL,
    L_RECALL_MANY,
    L_UPSERT,
    LATENCY_BOUNDS_NS,
    LATENCY_OPS,
    RING_LEN,
    RING_NS_MAX,
    RING_OP_SHIFT,
    S_BUSY,
    S_POSTED,
    STATS_BYTES,
    LatencyOp,
    Layout,
    SegmentView,
    SidecarState,
    SlotView,
    Status,
)
from kalos.broker.slotpath import Choice, SlotPath
from kalos.clients import RecallPool
from kalos.clients._slots import ClientSlot
from kalos.clients.fake import FakeConnection
from kalos.sidecar_cuda.backends.base import BackendStatistics, PathStat, merge_statistics
from kalos.sidecar_cuda.metrics import (
    OTHER_NAMESPACES,
    QUANTILES,
    STAGE_BOUNDS_NS,
    MetricsServer,
    MonotonicTotals,
    SidecarCollector,
    SlidingWindow,
    StageAggregator,
    TextEncoder,
    bucket_counts,
    cumulative_buckets,
    encode_text,
    nearest_rank_quantiles,
    ring_take_all,
    slots_matrix,
    split_ring_entries,
    top_namespaces,
)
from kalos.sidecar_cuda.serving.stats import BatchRecord, SidecarStats
from kalos.top import compute_view, parse_metrics, render, run_top

pytestmark = pytest.mark.timeout(90)

_n = itertools.count()


def broker_name() -> str:
    return f"t-metrics-{os.getpid()}-{next(_n)}"


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"\n[seed] {request.node.name}: {seed}")
    return np.random.default_rng(seed)


# --------------------------------------------------------------------------- pure aggregation


def test_bucket_counts_match_prometheus_le_semantics(rng):
    bounds = LATENCY_BOUNDS_NS
    vals = np.concatenate(
        [
            np.asarray(bounds),  # exactly on a bound: that bucket (le is "<=")
            np.asarray(bounds) + 1,  # just above: the next one
            [0, 1, bounds[-1] * 10],  # below the first bound, beyond the last (+Inf)
            rng.integers(0, 2 * bounds[-1], 5000),
        ]
    )
    counts = bucket_counts(vals, bounds)
    assert counts.sum() == len(vals)
    cum = cumulative_buckets(counts, [b / 1e9 for b in bounds])
    assert len(cum) == len(bounds) + 1 and cum[-1] == ("+Inf", float(len(vals)))
    for (le, c), b in zip(cum, bounds):
        assert float(le) == pytest.approx(b / 1e9)
        assert c == np.count_nonzero(vals <= b), le
    # and the same bucket a client picks when it records (ClientSlot.record: bisect_left)
    for v in vals[:200].tolist():
        one = bucket_counts([v], bounds)
        assert one[bisect_left(bounds, v)] == 1


def test_latency_buckets_are_microsecond_ones_not_prometheus_defaults():
    cum = cumulative_buckets(np.zeros(len(LATENCY_BOUNDS_NS) + 1), [b / 1e9 for b in LATENCY_BOUNDS_NS])
    assert cum[0][0] == "5e-06" and float(cum[0][0]) < 0.005
    assert STAGE_BOUNDS_NS[0] == 1_000


def test_monotonic_totals_never_go_backwards_across_owner_changes(rng):
    slots, cols = 6, 3
    tot = MonotonicTotals(slots, cols)
    cur = np.zeros((slots, cols), np.int64)
    true_total = np.zeros(cols, np.int64)
    seen = np.zeros(cols, np.int64)
    for _ in range(300):
        for i in range(slots):
            if cur[i].min() >= 10 and rng.random() < 0.1:  # a new owner starts from zero
                cur[i] = 0
            inc = rng.integers(0, 5, cols)
            cur[i] += inc
            true_total += inc
        got = tot.update(cur)
        assert (got >= 0).all()
        assert (tot.totals >= seen).all()
        seen = tot.totals.copy()
    # Every reset row restarted from zero and grew by < 5 before the next update, below its old
    # values (>= 10), so each reset was seen and the totals are exact.
    assert (tot.totals == true_total).all()
    # The documented limit: a row that outgrows its old values between two updates after a reset
    # looks like a plain increase, and the value before the reset is lost (never a decrease).
    t = MonotonicTotals(1, 2)
    t.update(np.array([[5, 5]]))
    t.update(np.array([[7, 7]]))  # really: reset to 0, then +7
    assert t.totals.tolist() == [7, 7]


def test_monotonic_totals_reject_a_layout_change():
    with pytest.raises(ValueError):
        MonotonicTotals(2, 2).update(np.zeros((3, 2)))


def ring_take(ring: np.ndarray, last: int, count: int, count_after: int) -> tuple[np.ndarray, int, int]:
    """:func:`ring_take_all` for one slot whose count after the copy is already known."""
    vals, new_last, lost = ring_take_all(
        ring.reshape(1, -1),
        np.array([last], np.int64),
        np.array([count], np.int64),
        lambda: np.array([count_after], np.int64),
    )
    return vals, int(new_last[0]), lost


class RingWriter:
    """The writer side of one slot's ring, as ClientSlot.record does it."""

    def __init__(self, n: int) -> None:
        self.ring = np.zeros(n, np.uint32)
        self.count = 0
        self.values: list[int] = []

    def write(self, v: int, *, bump: bool = True) -> None:
        self.ring[self.count % len(self.ring)] = v
        if bump:
            self.values.append(v)
            self.count += 1


def test_ring_take_reads_new_entries_and_counts_losses():
    w = RingWriter(8)
    for v in range(100, 105):
        w.write(v)
    vals, last, lost = ring_take(w.ring, 0, w.count, w.count)
    assert vals.tolist() == [100, 101, 102, 103, 104] and last == 5 and lost == 0
    vals, last, lost = ring_take(w.ring, last, w.count, w.count)
    assert len(vals) == 0 and last == 5 and lost == 0
    for v in range(200, 220):  # 20 more than the ring holds: the 12 oldest are gone, and the
        w.write(v)  # oldest left (217) is the one a busy writer overwrites next
    vals, last, lost = ring_take(w.ring, last, w.count, w.count)
    assert vals.tolist() == list(range(213, 220)) and last == 25 and lost == 13


def test_ring_take_discards_entries_overwritten_during_the_copy():
    w = RingWriter(8)
    for v in range(10):
        w.write(v)
    count = w.count  # 10: entries 2..9 are in the ring
    # While we copy, the writer completes records 10..12 and is writing record 13.
    for v in (1010, 1011, 1012):
        w.write(v)
    w.write(1013, bump=False)
    vals, last, lost = ring_take(w.ring, 0, count, w.count)
    # Entries j <= count_after - 8 = 5 are not trusted; 6..9 are intact.
    assert vals.tolist() == [6, 7, 8, 9] and last == 10 and lost == 6


def test_ring_take_after_a_reset_reads_from_zero():
    w = RingWriter(8)
    for v in range(5):
        w.write(v)
    _vals, last, _lost = ring_take(w.ring, 0, w.count, w.count)
    w2 = RingWriter(8)  # new owner, counters from zero
    w2.write(77)
    w2.write(78)
    vals, last, lost = ring_take(w2.ring, last, w2.count, w2.count)
    assert vals.tolist() == [77, 78] and last == 2 and lost == 0


def test_ring_take_never_returns_a_value_twice_or_a_wrong_one(rng):
    w = RingWriter(16)
    last = 0
    got: list[int] = []
    lost_total = 0
    for _step in range(2000):
        for _ in range(int(rng.integers(0, 24))):
            w.write(len(w.values) + 1)  # value == 1-based record number
        vals, last, lost = ring_take(w.ring, last, w.count, w.count)
        got.extend(vals.tolist())
        lost_total += lost
    assert got == sorted(set(got)), "duplicates or out of order"
    assert len(got) + lost_total == len(w.values)
    assert set(got) <= set(w.values)


def test_ring_take_all_equals_ring_take_slot_by_slot(rng):
    n_slots, n = 5, 16
    writers = [RingWriter(n) for _ in range(n_slots)]
    last = np.zeros(n_slots, np.int64)
    for step in range(500):
        for w in writers:
            if rng.random() < 0.05:  # a new owner from zero
                w.ring[:] = 0
                w.count = 0
            for _ in range(int(rng.integers(0, 2 * n))):
                w.write(int(rng.integers(1, 1 << 30)))
        count = np.array([w.count for w in writers], np.int64)
        after = count + rng.integers(0, 3, n_slots) * (rng.random(n_slots) < 0.2)  # writers racing
        rings = np.stack([w.ring for w in writers])
        vals, new_last, lost = ring_take_all(rings, last, count, lambda: after)
        want, want_lost = [], 0
        for i, w in enumerate(writers):
            v, l_i, lo_i = ring_take(w.ring, int(last[i]), int(count[i]), int(after[i]))
            want.extend(v.tolist())
            want_lost += lo_i
            assert new_last[i] == l_i
        assert vals.tolist() == want and lost == want_lost, step
        last = new_last


def test_ring_take_all_rereads_the_counts_after_copying():
    w = RingWriter(8)
    for v in range(10):
        w.write(v)

    def reread() -> np.ndarray:
        w.ring[:] = 999  # what a writer did after our copy must not be in it
        return np.array([w.count], np.int64)

    vals, last, lost = ring_take_all(
        w.ring.reshape(1, -1), np.zeros(1, np.int64), np.array([w.count], np.int64), reread
    )
    assert vals.tolist() == [3, 4, 5, 6, 7, 8, 9] and last.tolist() == [10] and lost == 3


def test_slots_matrix_views_every_slot_without_copying():
    sc = fake_sidecar(n_slots=5)
    rings = slots_matrix([v.ring for v in sc.seg.slot])
    sc.seg.slot[3].ring[7] = 1234
    assert rings.shape == (5, RING_LEN) and rings[3, 7] == 1234
    assert slots_matrix([sc.seg.slot[0].hist.reshape(-1)]).shape == (1, LATENCY_OPS * HIST_BUCKETS)
    with pytest.raises(ValueError):
        slots_matrix([sc.seg.slot[0].ring, sc.seg.slot[1].ring, sc.seg.slot[4].ring])


def test_nearest_rank_quantiles_follow_the_definition(rng):
    for n in (1, 2, 3, 10, 99, 1000):
        x = rng.integers(0, 10_000, n)
        for q, v in zip(QUANTILES, nearest_rank_quantiles(x, QUANTILES)):
            assert v in x
            assert np.count_nonzero(x <= v) >= q * n
            assert np.count_nonzero(x < v) < q * n
    assert all(math.isnan(v) for v in nearest_rank_quantiles(np.empty(0), QUANTILES))


def test_sliding_window_keeps_the_newest_samples_within_its_time():
    w = SlidingWindow(window_s=10.0, max_samples=100)
    w.add(0.0, np.arange(60))
    w.add(1.0, np.arange(60, 120))
    assert len(w) == 100
    assert w.values(1.0).tolist() == list(range(20, 120))
    w.add(5.0, np.arange(1000, 1010))
    assert w.values(5.0).tolist() == list(range(30, 120)) + list(range(1000, 1010))
    assert w.values(10.5).tolist() == list(range(60, 120)) + list(range(1000, 1010))  # t=0 expired
    assert w.values(14.0).tolist() == list(range(1000, 1010))
    assert len(w.values(100.0)) == 0 and len(w) == 0
    w.add(200.0, np.arange(500))  # one chunk larger than the window: its newest samples
    assert w.values(200.0).tolist() == list(range(400, 500))
    with pytest.raises(ConfigError):
        SlidingWindow(window_s=0)


def test_top_namespaces_bound_the_label_set(rng):
    counts = {f"ns{i}": int(rng.integers(0, 1000)) for i in range(50)}
    top = top_namespaces(counts, 5)
    assert len(top) == 6 and top[-1][0] == OTHER_NAMESPACES
    assert sum(r for _n, r in top) == sum(counts.values())
    biggest = sorted(counts.values(), reverse=True)[:5]
    assert [r for _n, r in top[:5]] == biggest
    assert top_namespaces({"a": 1, "b": 2}, 5) == [("b", 2), ("a", 1)]
    assert top_namespaces({"a": 1, "b": 1, "c": 1}, 2) == [("a", 1), ("b", 1), (OTHER_NAMESPACES, 1)]
    # a namespace really called "_other" is folded into the bucket: labels stay unique
    top = top_namespaces({"_other": 500, "x": 3}, 5)
    assert top == [("x", 3), (OTHER_NAMESPACES, 500)]
    assert top_namespaces({}, 3) == []
    assert top_namespaces({"a": 4}, 0) == [(OTHER_NAMESPACES, 4)]


def test_stage_aggregator_derives_service_time():
    agg = StageAggregator(60.0, 1000)
    recs = [
        # posted at 990_000 and 980_000, picked at 1_000_000, results written at 1_040_000
        (
            BatchRecord(
                size=2, compute_ns=30_000, t_post_ns=[990_000, 980_000], t_pick_ns=1_000_000, t_done_ns=1_040_000
            ),
            1_090_000,
        ),
        # no done time: until the observer ran
        (BatchRecord(size=1, compute_ns=5_000, t_post_ns=[1_999_000], t_pick_ns=2_000_000), 2_008_000),
        # the sidecar's one-request fast path: one posting time as a plain int
        (
            BatchRecord(size=1, compute_ns=4_000, t_post_ns=(2_995_000,), t_pick_ns=3_000_000, t_done_ns=3_015_000),
            3_020_000,
        ),
    ]
    agg.add(recs, now=1.0)
    assert sorted(agg.windows["queue_wait"].values(1.0).tolist()) == [1_000, 5_000, 10_000, 20_000]
    assert sorted(agg.windows["service"].values(1.0).tolist()) == [9_000, 20_000, 50_000, 60_000]
    assert sorted(agg.windows["compute"].values(1.0).tolist()) == [4_000, 5_000, 30_000]
    assert agg.hist["service"].sum() == 4 and agg.sums_ns["service"] == 139_000
    assert agg.batch_size.sum() == 3 and agg.batch_size_sum == 4


# --------------------------------------------------------------------------- the collector


class FakeStore:
    def __init__(self, counts: dict[str, int]) -> None:
        self.c = counts

    def counts(self) -> dict[str, int]:
        return dict(sorted(self.c.items()))


#: What the fake backend reports: two paths, a redo count, memory by part.
BACKEND_STATS = BackendStatistics(
    (PathStat("int8", "1", 7, 0.0021), PathStat("gemmh", "65-512", 3, 0.0036)),
    (("gemmh", 2), ("int8", 1)),
    (("int8", 4096), ("rows", 1 << 20)),
)


class FakeBackend:
    """The backend's identity and statistics as the collector reads them (None: it fails)."""

    name, description, placement = "numpy", "numpy (CPU)", "cpu"

    def __init__(self, stats: BackendStatistics | None = BACKEND_STATS) -> None:
        self.stats = stats

    def statistics(self) -> BackendStatistics:
        if self.stats is None:
            raise RuntimeError("the device is gone")
        return self.stats


def fake_sidecar(n_slots: int = 4, counts: dict[str, int] | None = None) -> SimpleNamespace:
    """What the collector reads of a Sidecar, on a real segment layout in process memory."""
    layout = Layout(n_slots=n_slots, dim=8, max_k=4, max_queries=2, blob_bytes=1024)
    buf = bytearray(layout.total_bytes)
    seg = SegmentView(memoryview(buf), layout)
    seg.init_header(
        metric=1, backend=1, pid=os.getpid(), start_epoch_ns=time.time_ns() - 5 * 10**9, payload_limit=16384
    )
    seg.header["state"] = SidecarState.READY
    return SimpleNamespace(
        layout=layout,
        seg=seg,
        stats=SidecarStats(n_slots),
        ready=True,
        _buf=buf,
        store=FakeStore(counts if counts is not None else {"default": 1000}),
        backend=FakeBackend(),
        encoder=None,
        cfg=SimpleNamespace(name="unit", storage_dtype="float32", metric="dot", dim=8),
        slot_path=Choice(SlotPath.COMPILED, None, "the extension is built"),
    )


def client_record(
    sc: SimpleNamespace, i: int, latency_ns: int, ok: bool = True, timed_out: bool = False, op: int = L_RECALL
) -> None:
    """What a slot's lease owner writes after a finished request: the real ClientSlot.record."""
    writers = sc.__dict__.setdefault("writers", {})
    if i not in writers:
        buf = sc._buf
        conn = SimpleNamespace(
            layout=sc.layout,
            name="unit",
            seg=sc.seg,
            bell=None,
            mm=buf,
            w32=memoryview(buf).cast("I"),
            w64=memoryview(buf).cast("Q"),
        )
        writers[i] = ClientSlot(conn, i, None, None)  # type: ignore[arg-type]
    writers[i].record(latency_ns, ok, timed_out, op=op)


def sample(reg: CollectorRegistry, name: str, **labels: str) -> float | None:
    return reg.get_sample_value(name, labels)


def test_collector_aggregates_client_stats_of_every_slot(rng):
    sc = fake_sidecar(n_slots=4)
    reg = CollectorRegistry()
    col = SidecarCollector(sc)
    reg.register(col)
    lat = rng.lognormal(np.log(150_000), 0.6, 1200).astype(np.int64)
    for j, v in enumerate(lat.tolist()):
        client_record(sc, j % 3, v)
        if j % 500 == 499:
            col.harvest()  # the harvest thread's job: read rings before they wrap
    R = {"op": "recall"}
    assert sample(reg, "kalos_client_latency_seconds_count", **R) == len(lat)
    assert sample(reg, "kalos_client_latency_seconds_sum", **R) == pytest.approx(lat.sum() / 1e9)
    buckets = {
        float(s.labels["le"]): s.value
        for m in reg.collect()
        if m.name == "kalos_client_latency_seconds"
        for s in m.samples
        if s.name.endswith("_bucket") and s.labels["op"] == "recall"
    }
    assert len(buckets) == len(LATENCY_BOUNDS_NS) + 1
    for b in LATENCY_BOUNDS_NS:
        assert buckets[b / 1e9] == np.count_nonzero(lat <= b), b
    assert sample(reg, "kalos_client_requests_total", outcome="ok", **R) == len(lat)
    for q, want in zip(QUANTILES, nearest_rank_quantiles(lat, QUANTILES)):
        got = sample(reg, "kalos_client_latency_window_seconds", quantile=str(q), **R)
        assert got == pytest.approx(want / 1e9)
    assert sample(reg, "kalos_client_latency_window_seconds_count", **R) == len(lat)
    assert sample(reg, "kalos_client_latency_window_samples", **R) == len(lat)
    assert sample(reg, "kalos_metrics_dropped_samples_total", source="ring") == 0
    # Only recalls were made: every other op is there, at zero (rate() needs the zero).
    for op in LatencyOp:
        if op != LatencyOp.RECALL:
            assert sample(reg, "kalos_client_latency_seconds_count", op=op.name.lower()) == 0
            assert sample(reg, "kalos_client_requests_total", op=op.name.lower(), outcome="error") == 0

    # Slot 0 gets a new owner whose counters start from zero: nothing goes backwards.
    before = sample(reg, "kalos_client_latency_seconds_count", **R)
    st = sc.seg.stats
    st["lat_count"][0] = 0
    st["lat_sum_ns"][0] = 0
    sc.seg.slot[0].hist[:] = 0
    for v in (20_000, 30_000):
        client_record(sc, 0, v)
    assert sample(reg, "kalos_client_latency_seconds_count", **R) == before + 2
    client_record(sc, 1, 0, ok=False)
    client_record(sc, 1, 0, ok=False)
    client_record(sc, 1, 0, ok=False, op=L_UPSERT)
    client_record(sc, 2, 0, ok=False, timed_out=True)
    assert sample(reg, "kalos_client_requests_total", outcome="error", **R) == 2
    assert sample(reg, "kalos_client_requests_total", outcome="timeout", **R) == 1
    assert sample(reg, "kalos_client_requests_total", outcome="error", op="upsert") == 1
    assert sample(reg, "kalos_client_latency_seconds_count", op="upsert") == 0


def test_collector_counts_ring_entries_lost_between_harvests():
    sc = fake_sidecar(n_slots=2)
    reg = CollectorRegistry()
    reg.register(SidecarCollector(sc))
    for v in range(RING_LEN + 100):
        client_record(sc, 1, 10_000 + v)
    # histogram: exact
    assert sample(reg, "kalos_client_latency_seconds_count", op="recall") == RING_LEN + 100
    # a full ring: all but its oldest entry, which a busy writer could be overwriting
    assert sample(reg, "kalos_client_latency_window_samples", op="recall") == RING_LEN - 1
    assert sample(reg, "kalos_metrics_dropped_samples_total", source="ring") == 101


def test_collector_reports_stages_slots_errors_memory_and_identity():
    counts = {f"ns{i:02d}": 100 * i for i in range(1, 31)}
    sc = fake_sidecar(n_slots=8, counts=counts)
    reg = CollectorRegistry()
    col = SidecarCollector(sc, namespace_labels=5)
    reg.register(col)
    col.attach()
    t = time.monotonic_ns()
    sc.stats.record_batch(
        BatchRecord(size=3, compute_ns=40_000, t_post_ns=[t - 5_000, t - 6_000, t - 7_000], t_pick_ns=t)
    )
    sc.stats.record_batch(BatchRecord(size=1, compute_ns=20_000, t_post_ns=[t - 4_000], t_pick_ns=t), "single")
    col.detach()
    sc.stats.record_batch(BatchRecord(size=1, compute_ns=1, t_post_ns=[t - 1], t_pick_ns=t))  # not observed any more
    sc.stats.record_error(Status.DIM_MISMATCH)
    sc.stats.record_error(Status.DIM_MISMATCH)
    sc.stats.record_error(Status.BACKEND_ERROR)
    slots = sc.seg.slots
    slots["owner_pid"][:3] = os.getpid()
    slots["state"][0] = S_POSTED
    slots["state"][1] = S_BUSY

    assert sample(reg, "kalos_batch_size_count") == 2 and sample(reg, "kalos_batch_size_sum") == 4
    assert sample(reg, "kalos_batch_size_bucket", le="2.0") == 1
    assert sample(reg, "kalos_queue_wait_seconds_count") == 4
    assert sample(reg, "kalos_queue_wait_seconds_sum") == pytest.approx(22e-6)
    assert sample(reg, "kalos_batch_compute_seconds_count") == 2
    assert sample(reg, "kalos_service_seconds_count") == 4
    assert sample(reg, "kalos_stage_latency_window_seconds", stage="queue_wait", quantile="0.5") == 5e-6
    assert sample(reg, "kalos_stage_latency_window_seconds_count", stage="queue_wait") == 4
    assert sample(reg, "kalos_stage_latency_window_samples", stage="service") == 4
    assert sample(reg, "kalos_batches_total") == 3 and sample(reg, "kalos_requests_total") == 5
    assert [sample(reg, "kalos_batches_by_route_total", route=r) for r in ("single", "uniform", "general")] == [1, 0, 2]
    assert sample(reg, "kalos_errors_total", kind="DIM_MISMATCH") == 2
    assert sample(reg, "kalos_errors_total", kind="BACKEND_ERROR") == 1
    assert sample(reg, "kalos_errors_total", kind="OK") is None
    kinds = [
        s.labels["kind"]
        for m in reg.collect()
        if m.name == "kalos_errors"
        for s in m.samples
        if s.name == "kalos_errors_total"
    ]
    assert sorted(kinds) == sorted(s.name for s in Status if s != Status.OK)
    assert sample(reg, "kalos_slots") == 8 and sample(reg, "kalos_slots_leased") == 3
    assert sample(reg, "kalos_slots_in_flight") == 2
    assert sample(reg, "kalos_slots_by_state", state="free") == 6
    rows = {s.labels["namespace"]: s.value for m in reg.collect() if m.name == "kalos_memory_rows" for s in m.samples}
    assert len(rows) == 6 and rows[OTHER_NAMESPACES] == sum(100 * i for i in range(1, 26))
    assert rows["ns30"] == 3000 and sum(rows.values()) == sum(counts.values())
    assert sample(reg, "kalos_namespaces") == 30
    assert (
        sample(
            reg,
            "kalos_backend_info",
            broker="unit",
            backend="numpy",
            description="numpy (CPU)",
            dtype="float32",
            metric="dot",
            dim="8",
            device="cpu",
        )
        == 1
    )
    assert sample(reg, "kalos_slot_path_info", path="compiled", reason="the extension is built") == 1
    assert sample(reg, "kalos_ready") == 1
    assert 4.0 < sample(reg, "kalos_uptime_seconds") < 60.0
    sc.seg.header["state"] = SidecarState.STOPPING
    assert sample(reg, "kalos_ready") == 0


def _reference_quantiles(vals: np.ndarray) -> list[float]:
    """Nearest-rank quantiles by numpy (float64), independent of the exporter's own function."""
    return [float(np.quantile(vals.astype(np.float64), q, method="inverted_cdf")) for q in QUANTILES]


def test_collector_files_latencies_by_kind_of_call_without_clipping(rng):
    """Issue 22, item 5: a bulk upsert's chunks (seconds each, many over 2**32 ns) recorded on the
    same slots as recalls: each op has its own histogram, counters and window, recalls stay at
    recall figures, and nothing is clipped at 4.29 s."""
    sc = fake_sidecar(n_slots=4)
    reg = CollectorRegistry()
    col = SidecarCollector(sc)
    reg.register(col)
    made = {
        "recall": (L_RECALL, rng.lognormal(np.log(120_000), 0.5, 700).astype(np.int64)),
        "recall_many": (L_RECALL_MANY, rng.lognormal(np.log(400_000), 0.5, 60).astype(np.int64)),
        "upsert": (L_UPSERT, rng.uniform(2e9, 9e9, 40).astype(np.int64)),
        "get": (L_GET, rng.lognormal(np.log(90_000), 0.3, 25).astype(np.int64)),
    }
    seq = [(op, int(v)) for op, vals in made.values() for v in vals]
    for j, idx in enumerate(rng.permutation(len(seq)).tolist()):
        op, v = seq[idx]
        client_record(sc, j % 4, v, op=op)
        if j % 300 == 299:
            col.harvest()  # before a slot's ring wraps
    assert max(v for _op, v in seq) > 2**32  # values the old u32 ring clipped
    for name, (_op, vals) in made.items():
        lab = {"op": name}
        assert sample(reg, "kalos_client_latency_seconds_count", **lab) == len(vals)
        assert sample(reg, "kalos_client_latency_seconds_sum", **lab) == pytest.approx(vals.sum() / 1e9)
        assert sample(reg, "kalos_client_requests_total", outcome="ok", **lab) == len(vals)
        for b in LATENCY_BOUNDS_NS:
            got = sample(reg, "kalos_client_latency_seconds_bucket", le=str(b / 1e9), **lab)
            assert got == np.count_nonzero(vals <= b), (name, b)
        for q, want in zip(QUANTILES, _reference_quantiles(vals)):
            got = sample(reg, "kalos_client_latency_window_seconds", quantile=str(q), **lab)
            assert got == pytest.approx(want / 1e9, rel=1e-12), (name, q)
    assert sample(reg, "kalos_client_latency_window_seconds", op="recall", quantile="0.99") < 0.01
    assert sample(reg, "kalos_client_latency_seconds_count", op="delete") == 0  # none made
    assert sample(reg, "kalos_metrics_dropped_samples_total", source="invalid") == 0


def test_collector_drops_ring_entries_of_no_known_op():
    sc = fake_sidecar(n_slots=2)
    reg = CollectorRegistry()
    reg.register(SidecarCollector(sc))
    client_record(sc, 0, 10_000)
    ring, st = sc.seg.slot[0].ring, sc.seg.stats
    for op in (LATENCY_OPS, 200, 255):  # a client's garbage: no such op
        n = int(st["lat_count"][0])
        ring[n % RING_LEN] = op << RING_OP_SHIFT | 5_000
        st["lat_count"][0] = n + 1
    client_record(sc, 0, 20_000, op=L_DELETE)
    assert sample(reg, "kalos_metrics_dropped_samples_total", source="invalid") == 3
    assert sample(reg, "kalos_client_latency_window_samples", op="recall") == 1
    assert sample(reg, "kalos_client_latency_window_seconds", op="delete", quantile="0.5") == 20e-6


def test_split_ring_entries_gives_op_and_nanoseconds(rng):
    ops = rng.integers(0, 256, 1000)
    ns = rng.integers(0, RING_NS_MAX, 1000, endpoint=True)
    ns[:2] = (0, RING_NS_MAX)
    entries = (ops.astype(np.uint64) << np.uint64(RING_OP_SHIFT)) | ns.astype(np.uint64)
    got_ops, got_ns = split_ring_entries(entries)
    assert got_ops.tolist() == ops.tolist() and got_ns.tolist() == ns.tolist()


def test_client_record_starts_over_on_a_slot_left_at_the_counter_ceiling():
    """A slot's stats block outlives its owner: a new owner must not crash on counters an earlier
    (broken or hostile) owner left at 2**64 - 1, and the exported totals never go backwards."""
    sc = fake_sidecar(n_slots=2)
    reg = CollectorRegistry()
    reg.register(SidecarCollector(sc))
    client_record(sc, 1, 50_000)
    assert sample(reg, "kalos_client_latency_seconds_count", op="recall") == 1
    st = sc.seg.stats
    for field in ("lat_count", "lat_sum_ns", "err_count", "timeout_count"):
        st[field][1] = 2**64 - 1
    sc.seg.slot[1].hist[:] = 2**64 - 1
    for ok, timed_out in ((True, False), (False, False), (False, True)):
        client_record(sc, 1, 60_000, ok=ok, timed_out=timed_out)  # must not raise
    start = sc.layout.stats_base(1)
    assert bytes(sc._buf[start : start + STATS_BYTES]).count(0) >= STATS_BYTES - 64  # started over
    client_record(sc, 1, 70_000)
    client_record(sc, 1, 0, ok=False, op=L_UPSERT)
    assert int(st["lat_count"][1]) == 1 and int(st["err_count"][1][L_UPSERT]) == 1
    assert sample(reg, "kalos_client_latency_seconds_count", op="recall") >= 1
    assert sample(reg, "kalos_client_requests_total", op="upsert", outcome="error") == 1


def test_exported_families_keep_quantile_and_le_labels_to_their_types():
    """Issue 22, item 6, the rule ``promtool check metrics`` applies (tests/ops runs promtool on
    a real sidecar): ``quantile`` only on summaries, ``le`` only on histograms."""
    sc = fake_sidecar(n_slots=3)
    for op in LatencyOp:
        client_record(sc, 0, 1000 + op, op=op)
    reg = CollectorRegistry()
    reg.register(SidecarCollector(sc))
    families = {m.name: m for m in reg.collect()}
    assert families["kalos_client_latency_window_seconds"].type == "summary"
    assert families["kalos_stage_latency_window_seconds"].type == "summary"
    for m in families.values():
        for smp in m.samples:
            assert "quantile" not in smp.labels or m.type == "summary", (m.name, m.type)
            assert "le" not in smp.labels or m.type == "histogram", (m.name, m.type)


@pytest.mark.asyncio
async def test_pool_times_each_chunk_of_a_bulk_call_from_its_own_sending(rng):
    """Issue 22, item 5, in the pool: an upsert of several chunks over one slot is observed once per
    chunk under op=upsert, each from its own sending. The chunks follow each other on the slot,
    so their latencies add up to no more than the call (timed from the call, they would add up to
    about n/2 calls); recall and recall_many go under their own ops."""
    lay = Layout(n_slots=1, dim=8, max_k=4, max_queries=2, blob_bytes=1024)
    conn = FakeConnection(lay)
    pool = await RecallPool("fake", size=1, connect=lambda name, uid: conn, spin_us=50).open()

    def answer(v: SlotView, op: int, k: int, nq: int):
        width = k if op == 1 else nq  # a recall: k hits per row; a write: rows written
        return np.zeros((max(nq, 1), width), np.int64), np.zeros((max(nq, 1), width), np.float32)

    async def serve(n: int) -> None:
        served = 0
        while served < n:
            served += conn.serve(answer)
            await asyncio.sleep(0.001)

    rows, chunks = 9, 5
    server = asyncio.ensure_future(serve(chunks))
    t0 = time.monotonic_ns()
    await pool.upsert(np.arange(rows), rng.standard_normal((rows, 8)).astype(np.float32), timeout=10)
    call_ns = time.monotonic_ns() - t0
    await server
    st, hist = conn.seg.stats[0], conn.seg.slot[0].hist
    assert int(hist[L_UPSERT].sum()) == chunks and int(hist.sum()) == chunks
    chunk_sum = int(st["lat_sum_ns"][L_UPSERT])
    print(f"upsert call {call_ns / 1e6:.2f} ms, its {chunks} chunks add up to {chunk_sum / 1e6:.2f} ms")
    assert 0 < chunk_sum <= call_ns
    server = asyncio.ensure_future(serve(2))
    await pool.recall(np.ones(8, np.float32), k=2, timeout=10)
    await pool.recall_many(np.ones((2, 8), np.float32), k=2, timeout=10)
    await server
    assert [int(hist[op].sum()) for op in (L_RECALL, L_RECALL_MANY, L_UPSERT)] == [1, 1, chunks]
    await pool.close()


def test_collector_describes_its_metrics_so_duplicates_are_refused():
    sc = fake_sidecar()
    reg = CollectorRegistry()
    reg.register(SidecarCollector(sc))
    with pytest.raises(ValueError):
        reg.register(SidecarCollector(sc))


def test_collector_before_the_segment_exists():
    sc = fake_sidecar()
    sc.seg = None
    sc.ready = False
    reg = CollectorRegistry()
    reg.register(SidecarCollector(sc))
    assert sample(reg, "kalos_ready") == 0
    assert sample(reg, "kalos_client_latency_seconds_count", op="recall") == 0
    assert sample(reg, "kalos_slots_leased") is None


def _parsed(text: bytes) -> list[tuple[str, str, tuple[tuple[str, str], ...], float | str]]:
    out = []
    for fam in text_string_to_metric_families(text.decode()):
        for smp in fam.samples:
            v = "NaN" if math.isnan(smp.value) else smp.value
            out.append((fam.type, smp.name, tuple(sorted(smp.labels.items())), v))
    return sorted(out)


def test_encode_text_equals_prometheus_client_generate_latest(rng):
    sc = fake_sidecar(n_slots=3, counts={'we"ird\\ns\nname': 5, "b": 7})
    reg = CollectorRegistry()
    col = SidecarCollector(sc)
    reg.register(col)
    for v in rng.integers(1_000, 10_000_000, 300).tolist():
        client_record(sc, int(v) % 3, int(v), op=int(v) % LATENCY_OPS)
    Counter("plain_events", "A standard counter (has _created).", ["kind"], registry=reg).labels("a").inc(3)
    Gauge("plain_gauge", "Line one\nline two \\ backslash.", registry=reg).set(float("inf"))
    Histogram("plain_seconds", "Standard histogram.", registry=reg).observe(0.25)
    Info("plain_build", "Info.", registry=reg).info({"version": "1.2"})
    fast, ref = encode_text(reg), generate_latest(reg)
    # An endpoint keeps one encoder: it remembers label sets (here more than its limit: it starts
    # over) and writes the same text scrape after scrape.
    enc = TextEncoder(cache_limit=50)
    encoded = [_parsed(enc.encode(reg)) for _ in range(3)]
    pf, pr = _parsed(fast), _parsed(ref)
    drop = {"kalos_uptime_seconds"}  # moves between the two calls
    assert [x for x in pf if x[1] not in drop] == [x for x in pr if x[1] not in drop]
    for pe in encoded:
        assert [x for x in pe if x[1] not in drop] == [x for x in pr if x[1] not in drop]
    assert len(pf) > 200
    # the same HELP/TYPE lines, in the same order
    assert [ln for ln in fast.decode().splitlines() if ln.startswith("#")] == [
        ln for ln in ref.decode().splitlines() if ln.startswith("#")
    ]


def test_collector_exports_the_backends_searches_redone_queries_and_memory():
    sc = fake_sidecar()
    reg = CollectorRegistry()
    reg.register(SidecarCollector(sc))
    for ps in BACKEND_STATS.searches:
        assert sample(reg, "kalos_backend_searches_total", path=ps.path, batch=ps.batch) == ps.searches
        assert sample(reg, "kalos_backend_search_seconds_total", path=ps.path, batch=ps.batch) == ps.seconds
    assert sample(reg, "kalos_backend_redone_queries_total", path="gemmh") == 2
    assert sample(reg, "kalos_backend_redone_queries_total", path="int8") == 1
    assert sample(reg, "kalos_backend_memory_bytes", part="rows") == 1 << 20
    assert sample(reg, "kalos_backend_memory_bytes", part="int8") == 4096
    sc.backend.stats = merge_statistics([BACKEND_STATS, BACKEND_STATS])  # counters follow the backend
    assert sample(reg, "kalos_backend_searches_total", path="int8", batch="1") == 14
    assert sample(reg, "kalos_backend_memory_bytes", part="rows") == 2 << 20


def test_a_backend_without_statistics_leaves_them_out_and_the_scrape_answers(caplog):
    sc = fake_sidecar()
    sc.backend.stats = None
    reg = CollectorRegistry()
    reg.register(SidecarCollector(sc))
    with caplog.at_level("WARNING", logger="kalos.metrics"):
        for _ in range(3):
            text = encode_text(reg).decode()
            assert "kalos_slots 4" in text and "kalos_backend_searches_total{" not in text
    warned = [r for r in caplog.records if "backend statistics unavailable" in r.getMessage()]
    assert len(warned) == 1 and "the device is gone" in warned[0].getMessage()


def test_merge_statistics_sums_by_labels():
    a = BackendStatistics((PathStat("gemm", "1", 2, 0.5),), (("int8", 1),), (("rows", 10),))
    b = BackendStatistics(
        (PathStat("gemm", "1", 3, 0.25), PathStat("small", "2-8", 1, 0.125)), (("int8", 4),), (("rows", 5), ("int8", 2))
    )
    m = merge_statistics([a, b])
    assert m.searches == (PathStat("gemm", "1", 5, 0.75), PathStat("small", "2-8", 1, 0.125))
    assert m.redone == (("int8", 5),) and m.memory == (("int8", 2), ("rows", 15))
    assert merge_statistics([]) == BackendStatistics()


# --------------------------------------------------------------------------- HTTP endpoint


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_metrics_server_endpoints_and_readiness():
    sc = fake_sidecar()
    sc.ready = False
    reg = CollectorRegistry()
    with MetricsServer(sc, "127.0.0.1", 0, registry=reg) as srv:
        assert srv.port > 0 and srv.url == f"http://127.0.0.1:{srv.port}"
        assert http_get(srv.url + "/healthz") == (200, "ok\n")
        assert http_get(srv.url + "/readyz")[0] == 503
        sc.ready = True
        assert http_get(srv.url + "/readyz") == (200, "ready\n")
        sc.seg.header["state"] = SidecarState.STOPPING
        code, body = http_get(srv.url + "/readyz")
        assert code == 503 and "stopping" in body
        code, body = http_get(srv.url + "/metrics")
        assert code == 200
        names = {f.name for f in text_string_to_metric_families(body)}
        assert {"kalos_client_latency_seconds", "kalos_ready", "kalos_batch_size"} <= names
        assert "process_cpu_seconds" not in names  # the caller's registry: nothing added to it
        assert http_get(srv.url + "/nope")[0] == 404
        om = urllib.request.Request(
            srv.url + "/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"}
        )
        with urllib.request.urlopen(om, timeout=5) as r:
            assert r.headers["Content-Type"].startswith("application/openmetrics-text")
            assert r.read().decode().endswith("# EOF\n")
        prom = urllib.request.Request(
            srv.url + "/metrics",
            headers={"Accept": ("application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")},
        )
        with urllib.request.urlopen(prom, timeout=5) as r:
            assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        with pytest.raises(ConfigError):
            MetricsServer(sc, "127.0.0.1", srv.port, registry=CollectorRegistry()).start()
        assert srv.collector.observe_batch in sc.stats.observers
    assert srv.collector.observe_batch not in sc.stats.observers
    srv.stop()  # twice is fine
    with pytest.raises(OSError):
        urllib.request.urlopen(srv.url + "/healthz", timeout=2)


def test_metrics_server_default_registry_is_private_and_has_process_metrics():
    a, b = MetricsServer(fake_sidecar(), port=0), MetricsServer(fake_sidecar(), port=0)
    assert a.registry is not b.registry
    assert a.registry.get_sample_value("process_cpu_seconds_total") is not None


# --------------------------------------------------------------------------- kalos top, pure


def _exposition(ok: float, served: float, batches: float, bsum: float, errs: float) -> str:
    return f"""
kalos_client_requests_total{{op="recall",outcome="ok"}} {ok}
kalos_client_requests_total{{op="recall",outcome="error"}} 1
kalos_requests_total {served}
kalos_batches_total {batches}
kalos_batch_size_bucket{{le="1.0"}} {batches / 2}
kalos_batch_size_bucket{{le="2.0"}} {batches / 2}
kalos_batch_size_bucket{{le="4.0"}} {batches}
kalos_batch_size_bucket{{le="+Inf"}} {batches}
kalos_batch_size_count {batches}
kalos_batch_size_sum {bsum}
kalos_errors_total{{kind="DIM_MISMATCH"}} {errs}
kalos_client_latency_window_seconds{{op="recall",quantile="0.99"}} 0.00042
kalos_client_latency_window_seconds{{op="upsert",quantile="0.99"}} 0.0125
kalos_client_latency_window_samples{{op="recall"}} 900
kalos_client_latency_window_samples{{op="upsert"}} 40
kalos_client_latency_window_samples{{op="get"}} 0
kalos_stage_latency_window_seconds{{stage="compute",quantile="0.5"}} 0.00003
kalos_slots 64
kalos_slots_leased 8
kalos_slots_in_flight 3
kalos_ready 1
kalos_memory_rows{{namespace="default"}} 1000
"""


def test_top_view_rates_from_counter_deltas():
    prev = parse_metrics(_exposition(1000, 1000, 500, 800, 2), t=10.0)
    cur = parse_metrics(_exposition(3000, 3100, 900, 1800, 7), t=12.0)
    v = compute_view(cur, prev)
    assert v.completed_per_s == pytest.approx(1000.0) and v.served_per_s == pytest.approx(1050.0)
    assert v.batches_per_s == pytest.approx(200.0)
    assert v.batch_mean == pytest.approx(1000 / 400)
    assert v.batch_p50_le == 1.0 and v.batch_max_le == 4.0
    assert v.errors["DIM_MISMATCH"] == (7.0, pytest.approx(2.5))
    assert v.e2e_q["recall"]["0.99"] == pytest.approx(0.00042)
    assert v.e2e_q["upsert"]["0.99"] == pytest.approx(0.0125)
    assert v.stage_q["compute"]["0.5"] == pytest.approx(3e-5)
    assert v.window_samples == {"recall": 900, "upsert": 40, "get": 0}
    assert (v.slots, v.leased, v.in_flight, v.ready) == (64, 8, 3, True)
    first = compute_view(cur)
    assert first.completed_per_s is None and first.batch_mean == pytest.approx(1800 / 900)
    restarted = compute_view(parse_metrics(_exposition(10, 10, 5, 8, 0), t=14.0), cur)
    assert restarted.completed_per_s is None  # counters went down: no rate, not a negative one
    out = io.StringIO()
    Console(file=out, width=120).print(render(v, "http://x/metrics"))
    text = out.getvalue()
    assert "READY" in text and "420 µs" in text and "DIM_MISMATCH" in text and "1,000" in text
    assert "end to end: recall" in text and "end to end: upsert" in text and "12.50 ms" in text
    assert "end to end: get" not in text  # no get in the window


def _backend_exposition(int8: float, int8_s: float, gemmh: float, gemmh_s: float, redone: float) -> str:
    return f"""
kalos_backend_searches_total{{path="int8",batch="1"}} {int8 / 2}
kalos_backend_searches_total{{path="int8",batch="2-8"}} {int8 / 2}
kalos_backend_search_seconds_total{{path="int8",batch="1"}} {int8_s / 2}
kalos_backend_search_seconds_total{{path="int8",batch="2-8"}} {int8_s / 2}
kalos_backend_searches_total{{path="gemmh",batch="65-512"}} {gemmh}
kalos_backend_search_seconds_total{{path="gemmh",batch="65-512"}} {gemmh_s}
kalos_backend_searches_total{{path="gemm",batch="9-64"}} 0
kalos_backend_redone_queries_total{{path="int8"}} {redone}
kalos_backend_redone_queries_total{{path="gemmh"}} 0
kalos_backend_memory_bytes{{part="rows"}} {1.5 * 2**30}
kalos_backend_memory_bytes{{part="int8"}} {740 * 2**20}
kalos_backend_memory_bytes{{part="gathered"}} 0
"""


def test_top_shows_the_search_paths_and_the_backends_memory():
    prev = parse_metrics(_backend_exposition(1000, 0.35, 100, 0.12, 4), t=10.0)
    cur = parse_metrics(_backend_exposition(3000, 1.05, 300, 0.36, 10), t=12.0)
    v = compute_view(cur, prev)
    assert set(v.paths) == {"int8", "gemmh"}  # gemm never ran
    int8, gemmh = v.paths["int8"], v.paths["gemmh"]
    assert int8.searches == 2000 and int8.per_s == pytest.approx(1000) and int8.mean_s == pytest.approx(0.7 / 2000)
    assert int8.redone_per_s == pytest.approx(3.0)
    assert gemmh.per_s == pytest.approx(100) and gemmh.mean_s == pytest.approx(0.24 / 200)
    assert gemmh.redone_per_s == pytest.approx(0.0)
    assert v.memory_bytes == {"rows": 1.5 * 2**30, "int8": 740 * 2**20, "gathered": 0}
    first = compute_view(cur)  # totals since start, no rates
    assert first.paths["int8"].searches == 3000 and first.paths["int8"].per_s is None
    assert first.paths["int8"].mean_s == pytest.approx(1.05 / 3000)
    restarted = compute_view(parse_metrics(_backend_exposition(10, 0.01, 0, 0, 0), t=14.0), cur)
    assert restarted.paths["int8"].searches == 10 and restarted.paths["int8"].per_s is None
    out = io.StringIO()
    Console(file=out, width=120).print(render(v, "http://x/metrics"))
    text = out.getvalue()
    assert "search paths" in text and "int8" in text and "gemmh" in text and "350 µs" in text and "91 %" in text
    assert "rows 1.5 GiB" in text and "int8 740.0 MiB" in text and "gathered" not in text


def test_top_reports_an_unreachable_endpoint():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    out = io.StringIO()
    assert run_top(f"http://127.0.0.1:{port}/metrics", 0.1, once=True, console=Console(file=out, width=100)) == 1
    assert "cannot read" in out.getvalue()


# --------------------------------------------------------------------------- real sidecars
