"""The Prometheus collector of a sidecar: everything is read at scrape time, through the narrow
view :class:`SidecarView` (a ``sidecar_cuda.server.Sidecar`` is one), and registered in the
registry the caller passes. See the package docstring for the sources of every metric."""

from __future__ import annotations

import dataclasses
import enum
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import numpy as np
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from ...broker.errors import ConfigError
from ...broker.layout import (
    HIST_BUCKETS,
    LATENCY_BOUNDS_NS,
    LATENCY_OPS,
    LatencyOp,
    Layout,
    SegmentView,
    SidecarState,
    SlotState,
    Status,
)
from ...broker.slotpath import Choice
from ..backends.base import BackendStatistics
from ..embedding import EncodeStats, TextEncoder
from ..serving.stats import ROUTES, BatchRecord, SidecarStats
from .aggregate import (
    BATCH_SIZE_BOUNDS,
    OTHER_NAMESPACES,
    QUANTILES,
    STAGE_BOUNDS_NS,
    STAGES,
    MonotonicTotals,
    SlidingWindow,
    StageAggregator,
    cumulative_buckets,
    le_text,
    ring_take_all,
    slots_matrix,
    split_ring_entries,
    top_namespaces,
)

log = logging.getLogger("kalos.metrics")


class NamespaceCounts(Protocol):
    def counts(self) -> dict[str, int]:
        """Rows per namespace (a copy; may raise RuntimeError if a namespace is added meanwhile)."""
        ...


class BackendIdentity(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def description(self) -> str: ...

    @property
    def placement(self) -> str: ...

    def statistics(self) -> BackendStatistics: ...


class ConfigIdentity(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def storage_dtype(self) -> str: ...

    @property
    def metric(self) -> str: ...

    @property
    def dim(self) -> int: ...


class SidecarView(Protocol):
    """What the collector and the HTTP endpoint read of a sidecar, from their own threads: its
    segment (None until it exists), counters, namespace sizes, identity and readiness."""

    @property
    def layout(self) -> Layout: ...

    @property
    def seg(self) -> SegmentView | None: ...

    @property
    def stats(self) -> SidecarStats: ...

    @property
    def ready(self) -> bool: ...

    @property
    def store(self) -> NamespaceCounts: ...

    @property
    def backend(self) -> BackendIdentity: ...

    @property
    def encoder(self) -> TextEncoder | None: ...  # --embed's model

    @property
    def cfg(self) -> ConfigIdentity: ...

    @property
    def slot_path(self) -> Choice: ...


#: Per-op client counters summed into the totals, after the histograms (``lat_count`` is only the
#: ring's write index: the histograms count the latencies).
_STATS_NAMES = ("lat_sum_ns", "err_count", "timeout_count")
#: The ``op`` label values, by LatencyOp.
OP_LABELS = tuple(op.name.lower() for op in LatencyOp)
_QUANTILE_LABELS = tuple(le_text(q) for q in QUANTILES)
_LAT_LE = [le_text(b / 1e9) for b in LATENCY_BOUNDS_NS]
_STAGE_LE = [le_text(b / 1e9) for b in STAGE_BOUNDS_NS]
_BATCH_LE = [le_text(b) for b in BATCH_SIZE_BOUNDS]
#: The labels of every client histogram's buckets, made once: a scrape then builds no label dicts
#: for them (they are read, never changed, by the encoders).
_OP_BUCKET_LABELS = [[{"op": op, "le": le} for le in _LAT_LE + ["+Inf"]] for op in OP_LABELS]
_OP_LABEL_SETS = [{"op": op} for op in OP_LABELS]


def _add_histogram(
    family: HistogramMetricFamily,
    bucket_labels: list[dict[str, str]],
    labels: dict[str, str],
    counts: np.ndarray,
    sum_value: float,
) -> None:
    """``family.add_metric`` for per-bucket ``counts`` whose bucket labels are made already
    (the same samples, in the same order)."""
    cum = np.cumsum(counts).tolist()
    name = family.name
    family.samples.extend(Sample(name + "_bucket", lab, float(c)) for lab, c in zip(bucket_labels, cum))
    family.samples.append(Sample(name + "_count", labels, float(cum[-1])))
    family.samples.append(Sample(name + "_sum", labels, sum_value))


_STAGE_METRICS = {
    "queue_wait": (
        "kalos_queue_wait_seconds",
        "Sidecar queue wait per request: posted by the client -> taken into a batch.",
    ),
    "compute": (
        "kalos_batch_compute_seconds",
        "Backend work per batch (all namespaces of the batch), "
        "started to answered; a pipelined batch includes its wait behind the previous one.",
    ),
    "service": ("kalos_service_seconds", "Sidecar service time per request: posted by the client -> results written."),
}


class SidecarCollector(Collector):
    """Reads a sidecar (its SegmentView, SidecarStats, store and backend) at scrape time.

    Call :meth:`observe_batch` for each BatchRecord (see :meth:`attach`), :meth:`harvest` often
    (the MetricsServer's harvest thread does), and let the registry call :meth:`collect`.
    """

    def __init__(
        self,
        sidecar: SidecarView,
        *,
        window_s: float = 60.0,
        window_samples: int = 20_000,
        namespace_labels: int = 10,
        pending_limit: int = 1 << 16,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if namespace_labels < 0:
            raise ConfigError("namespace_labels must be >= 0")
        self._sc = sidecar
        self._clock = clock
        self._lock = threading.Lock()
        n = sidecar.layout.n_slots
        self._n_slots = n
        # Columns: every op's histogram (LATENCY_OPS x HIST_BUCKETS), then each of _STATS_NAMES
        # for every op.
        self._client = MonotonicTotals(n, LATENCY_OPS * (HIST_BUCKETS + len(_STATS_NAMES)))
        self._ring_last = np.zeros(n, np.int64)
        self._seg_views: tuple[SegmentView, np.ndarray, np.ndarray] | None = None  # (seg, rings, hists)
        self._client_windows = [SlidingWindow(window_s, window_samples) for _ in LatencyOp]
        self._stages = StageAggregator(window_s, window_samples)
        self._pending: deque[tuple[BatchRecord, int]] = deque(maxlen=pending_limit)
        self._pending_limit = pending_limit
        self._dropped_batches = 0  # written by the serving thread only
        self._dropped_ring = 0
        self._invalid_ring = 0  # ring entries whose op is no LatencyOp (a client's garbage)
        self._namespace_labels = namespace_labels
        self._backend_failed = False  # logged once

    # -- feeding ----------------------------------------------------------------------------
    def observe_batch(self, rec: BatchRecord) -> None:
        """The SidecarStats observer: runs in the serving thread, so it only stamps and queues."""
        p = self._pending
        if len(p) >= self._pending_limit:
            self._dropped_batches += 1  # the harvest thread fell behind; the deque drops the oldest
        p.append((rec, time.monotonic_ns()))

    def attach(self) -> None:
        self._sc.stats.observers.append(self.observe_batch)

    def detach(self) -> None:
        try:
            self._sc.stats.observers.remove(self.observe_batch)
        except ValueError:
            pass

    def harvest(self) -> None:
        """Move new ring entries and queued batch records into the windows and histograms."""
        with self._lock:
            self._harvest_locked(self._clock())

    def _harvest_locked(self, now: float) -> None:
        p = self._pending
        stamped = [p.popleft() for _ in range(len(p))]
        self._stages.add(stamped, now)
        views = self._views()
        if views is None:
            return
        seg, rings, _hists = views
        counts_view = seg.stats["lat_count"]
        counts = counts_view.astype(np.int64)
        if (counts == self._ring_last).all():
            return
        vals, self._ring_last, lost = ring_take_all(
            rings, self._ring_last, counts, lambda: counts_view.astype(np.int64)
        )
        self._dropped_ring += lost
        if len(vals) == 0:
            return
        ops, ns = split_ring_entries(vals)
        if (ops == ops[0]).all():  # the usual harvest: one kind of call
            if 0 <= ops[0] < LATENCY_OPS:
                self._client_windows[int(ops[0])].add(now, ns)
            else:
                self._invalid_ring += len(ops)
            return
        for op, window in enumerate(self._client_windows):
            window.add(now, ns[ops == op])
        self._invalid_ring += int(((ops < 0) | (ops >= LATENCY_OPS)).sum())

    def _views(self) -> tuple[SegmentView, np.ndarray, np.ndarray] | None:
        seg = self._sc.seg
        if seg is None:
            return None
        if self._seg_views is None or self._seg_views[0] is not seg:
            self._seg_views = (
                seg,
                slots_matrix([v.ring for v in seg.slot]),
                slots_matrix([v.hist.reshape(-1) for v in seg.slot]),
            )
        return self._seg_views

    # -- scraping ---------------------------------------------------------------------------
    def describe(self) -> Iterable[Metric]:
        return list(self._families(None))

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            now = self._clock()
            try:
                self._harvest_locked(now)
            except Exception:  # a scrape still answers with what is there
                log.exception("metrics harvest failed")
            snap = self._snapshot(now)
        return list(self._families(snap))

    def _snapshot(self, now: float) -> dict[str, Any]:
        sc = self._sc
        views = self._views()
        s: dict[str, Any] = {"ready": self._is_ready(), "counts": {}}
        if views is not None:
            seg, _rings, hists = views
            st = seg.stats
            cur = np.column_stack([hists.astype(np.int64)] + [st[name].astype(np.int64) for name in _STATS_NAMES])
            self._client.update(cur)
            slots = seg.slots
            states = slots["state"].astype(np.int64)
            owners = slots["owner_pid"]
            s["slot_states"] = np.bincount(np.clip(states, 0, len(SlotState)), minlength=len(SlotState) + 1)
            s["leased"] = int((owners != 0).sum())
            s["start_epoch_ns"] = int(seg.header["start_epoch_ns"])
        tot = self._client.totals
        nh = LATENCY_OPS * HIST_BUCKETS
        s["client_hist"] = tot[:nh].reshape(LATENCY_OPS, HIST_BUCKETS).copy()
        for j, name in enumerate(_STATS_NAMES):
            s[name] = tot[nh + j * LATENCY_OPS : nh + (j + 1) * LATENCY_OPS].tolist()
        s["client_q"] = [w.quantiles(QUANTILES, now) for w in self._client_windows]
        s["client_window"] = [len(w) for w in self._client_windows]
        s["stage_q"] = {st: self._stages.windows[st].quantiles(QUANTILES, now) for st in STAGES}
        s["stage_window"] = {st: len(self._stages.windows[st]) for st in STAGES}
        stats = sc.stats
        with stats.lock:
            s["errors"] = dict(stats.errors)
        s["batches"], s["requests"] = stats.batches, stats.requests
        s["routes"] = {r: stats.routes[r] for r in ROUTES}
        s["reclaimed"] = stats.slots_reclaimed
        s["expired"] = stats.records_expired
        try:
            s["counts"] = dict(sc.store.counts())
        except RuntimeError:  # the serving thread added a namespace mid-copy: next scrape
            s["counts"] = None
        s["backend"] = self._backend_statistics()
        enc = sc.encoder
        s["embed"] = None if enc is None else dataclasses.replace(enc.stats)
        return s

    def _backend_statistics(self) -> BackendStatistics | None:
        """The backend's statistics; None (and one log line) if it cannot give them: a scrape
        still answers with everything else."""
        try:
            return self._sc.backend.statistics()
        except Exception as e:
            if not self._backend_failed:
                self._backend_failed = True
                log.warning("backend statistics unavailable (%s: %s); left out of /metrics", type(e).__name__, e)
            return None

    def _is_ready(self) -> bool:
        seg = self._sc.seg
        return bool(self._sc.ready and seg is not None and int(seg.header["state"]) == SidecarState.READY)

    def _families(self, snap: dict[str, Any] | None) -> Iterator[Metric]:
        """Every metric family; without a snapshot, empty ones (for ``describe``)."""
        g = snap is not None
        s: dict[str, Any] = snap if snap is not None else {}
        # End to end, as callers see it, by kind of call.
        h = HistogramMetricFamily(
            "kalos_client_latency_seconds",
            "End-to-end latency of completed requests as callers see them, by kind of call (op): "
            "from the call (a chunk of a bulk call: from its sending) to the result in hand, "
            "including the wait for a slot; from every slot's client stats in shared memory.",
            labels=["op"],
        )
        q = SummaryMetricFamily(
            "kalos_client_latency_window_seconds",
            "Quantiles (nearest rank) of kalos_client_latency_seconds over the sliding window of "
            "recent requests read from the slots' latency rings; count and sum since start.",
            labels=["op"],
        )
        c = CounterMetricFamily(
            "kalos_client_requests",
            "Requests completed as callers saw them, by "
            "kind of call (op) and outcome (timeout: the caller gave up or was "
            "cancelled).",
            labels=["op", "outcome"],
        )
        wc = GaugeMetricFamily(
            "kalos_client_latency_window_samples", "Samples in each op's quantile window.", labels=["op"]
        )
        if g:
            # Every op from the start, at zero until its first request: rate() misses the first
            # increase of a series that appears with a value.
            for i, op in enumerate(OP_LABELS):
                hist = s["client_hist"][i]
                n_ok, lat_sum = int(hist.sum()), s["lat_sum_ns"][i] / 1e9
                _add_histogram(h, _OP_BUCKET_LABELS[i], _OP_LABEL_SETS[i], hist, lat_sum)
                for ql, v in zip(_QUANTILE_LABELS, s["client_q"][i]):
                    q.samples.append(Sample(q.name, {"op": op, "quantile": ql}, v / 1e9))
                q.add_metric([op], n_ok, lat_sum)
                c.add_metric([op, "ok"], float(n_ok))
                c.add_metric([op, "error"], float(s["err_count"][i]))
                c.add_metric([op, "timeout"], float(s["timeout_count"][i]))
                wc.add_metric([op], s["client_window"][i])
        yield from (h, q, c, wc)
        # The sidecar's stages.
        sq = SummaryMetricFamily(
            "kalos_stage_latency_window_seconds",
            "Sidecar stage latency quantiles (nearest rank) over the sliding window; count and sum since start.",
            labels=["stage"],
        )
        ws = GaugeMetricFamily(
            "kalos_stage_latency_window_samples", "Samples in each stage's quantile window.", labels=["stage"]
        )
        for stage in STAGES:
            name, doc = _STAGE_METRICS[stage]
            sh = HistogramMetricFamily(name, doc)
            if g:
                agg = self._stages
                stage_sum = agg.sums_ns[stage] / 1e9
                sh.add_metric([], cumulative_buckets(agg.hist[stage], _STAGE_LE), stage_sum)
                for ql, v in zip(_QUANTILE_LABELS, s["stage_q"][stage]):
                    sq.samples.append(Sample(sq.name, {"stage": stage, "quantile": ql}, v / 1e9))
                sq.add_metric([stage], int(agg.hist[stage].sum()), stage_sum)
                ws.add_metric([stage], s["stage_window"][stage])
            yield sh
        yield sq
        yield ws
        bs = HistogramMetricFamily("kalos_batch_size", "Requests per batch served by the sidecar.")
        if g:
            bs.add_metric(
                [], cumulative_buckets(self._stages.batch_size, _BATCH_LE), float(self._stages.batch_size_sum)
            )
        yield bs
        # Counters of the serving loop.
        for name, key, doc in (
            ("kalos_requests", "requests", "Requests served by the sidecar (every op)."),
            ("kalos_batches", "batches", "Batches served by the sidecar."),
            ("kalos_slots_reclaimed", "reclaimed", "Slots freed after their owner died or left."),
            ("kalos_records_expired", "expired", "Records the sweeper deleted once their TTL ran out."),
        ):
            cm = CounterMetricFamily(name, doc)
            if g:
                cm.add_metric([], float(s[key]))
            yield cm
        rt = CounterMetricFamily(
            "kalos_batches_by_route",
            "Batches served by the sidecar, by route: "
            "single (one plain recall), uniform (recalls of one namespace in one "
            "search, maybe pipelined), general (request by request).",
            labels=["route"],
        )
        if g:
            for r in ROUTES:
                rt.add_metric([r], float(s["routes"][r]))
        yield rt
        e = CounterMetricFamily(
            "kalos_errors",
            "Requests the sidecar answered with an error, by kind (the protocol's Status names).",
            labels=["kind"],
        )
        if g:
            errs = dict(s["errors"])
            for st in Status:
                if st != Status.OK:
                    e.add_metric([st.name], float(errs.pop(int(st), 0)))
            unknown = sum(v for k, v in errs.items() if k != Status.OK)
            if unknown:
                e.add_metric(["UNKNOWN"], float(unknown))
        yield e
        d = CounterMetricFamily(
            "kalos_metrics_dropped_samples",
            "Samples the exporter lost: ring entries overwritten before they were "
            "read (quantile windows only), ring entries of no known op (invalid), "
            "batch records queued past the limit.",
            labels=["source"],
        )
        if g:
            d.add_metric(["ring"], float(self._dropped_ring))
            d.add_metric(["invalid"], float(self._invalid_ring))
            d.add_metric(["batches"], float(self._dropped_batches))
        yield d
        # Slots.
        total = GaugeMetricFamily("kalos_slots", "Slots of the segment.")
        leased = GaugeMetricFamily("kalos_slots_leased", "Slots leased by client processes.")
        inflight = GaugeMetricFamily("kalos_slots_in_flight", "Slots holding a request (any state but FREE).")
        by_state = GaugeMetricFamily("kalos_slots_by_state", "Slots by state.", labels=["state"])
        if g:
            total.add_metric([], self._n_slots)
            if "slot_states" in s:
                st_counts = s["slot_states"]
                leased.add_metric([], s["leased"])
                inflight.add_metric([], int(st_counts[1:].sum()))
                for ss in SlotState:
                    by_state.add_metric([ss.name.lower()], int(st_counts[int(ss)]))
                by_state.add_metric(["invalid"], int(st_counts[len(SlotState)]))
        yield from (total, leased, inflight, by_state)
        # Memory.
        rows = GaugeMetricFamily(
            "kalos_memory_rows",
            f"Rows per namespace: the {self._namespace_labels} largest by rows, the "
            f'rest summed under namespace="{OTHER_NAMESPACES}".',
            labels=["namespace"],
        )
        nss = GaugeMetricFamily("kalos_namespaces", "Namespaces in memory.")
        if g and s["counts"] is not None:
            for label, n in top_namespaces(s["counts"], self._namespace_labels):
                rows.add_metric([label], n)
            nss.add_metric([], len(s["counts"]))
        yield rows
        yield nss
        # Identity and state.
        info = InfoMetricFamily("kalos_backend", "Backend and configuration of the sidecar.")
        if g:
            cfg = self._sc.cfg
            backend = self._sc.backend
            info.add_metric(
                [],
                {
                    "broker": str(cfg.name),
                    "backend": str(backend.name),
                    "description": str(backend.description),
                    "dtype": _spelling(cfg.storage_dtype),
                    "metric": _spelling(cfg.metric),
                    "dim": str(cfg.dim),
                    "device": str(backend.placement),
                },
            )
        yield info
        path = InfoMetricFamily(
            "kalos_slot_path",
            "The slot path the sidecar serves with: compiled (the C extension's byte work) or python, and why.",
        )
        if g:
            choice = self._sc.slot_path
            path.add_metric([], {"path": choice.path.value, "reason": choice.reason})
        yield path
        ready = GaugeMetricFamily("kalos_ready", "1 when memory is loaded and the sidecar serves.")
        start = GaugeMetricFamily("kalos_start_time_seconds", "Sidecar start, seconds since the epoch.")
        up = GaugeMetricFamily("kalos_uptime_seconds", "Seconds since the sidecar started.")
        if g:
            ready.add_metric([], 1.0 if s["ready"] else 0.0)
            if s.get("start_epoch_ns"):
                start.add_metric([], s["start_epoch_ns"] / 1e9)
                up.add_metric([], max(0.0, time.time() - s["start_epoch_ns"] / 1e9))
        yield from (ready, start, up)
        yield from _backend_families(s.get("backend"))
        yield from _embed_families(s.get("embed"))


def _embed_families(st: EncodeStats | None) -> Iterator[Metric]:
    """The embedding model's work (``--embed``): nothing without one."""
    if st is None:
        return
    for name, doc, value in (
        (
            "kalos_embed_batches",
            "Batches of text requests embedded (every EMBED request of a pass, together).",
            st.calls,
        ),
        (
            "kalos_embed_passes",
            "Forward passes of the embedding model (one per batch unless over its token budget).",
            st.passes,
        ),
        ("kalos_embed_texts", "Texts embedded.", st.texts),
        ("kalos_embed_tokens", "Tokens embedded (padding excluded).", st.tokens),
        ("kalos_embed_seconds", "Time spent embedding (tokenizing and forward passes), seconds.", st.seconds),
    ):
        c = CounterMetricFamily(name, doc)
        c.add_metric([], float(value))
        yield c


def _backend_families(st: BackendStatistics | None) -> Iterator[Metric]:
    """The backend's own counts: searches and their time by path and batch size, queries redone
    in float32, bytes held by part (empty families without statistics)."""
    searches = CounterMetricFamily(
        "kalos_backend_searches",
        "Searches the backend served, by search path and batch-size bucket (CUDA: host, small, "
        "wgmma, int8, gemmh, gemm, exact; numpy: inline, worker; with shards, one per shard).",
        labels=["path", "batch"],
    )
    seconds = CounterMetricFamily(
        "kalos_backend_search_seconds",
        "Wall time of those searches, from start to answer, by search path and batch-size bucket.",
        labels=["path", "batch"],
    )
    redone = CounterMetricFamily(
        "kalos_backend_redone_queries",
        "Queries a proving path (gemmh, wgmma, int8) could not prove exact and redid in float32.",
        labels=["path"],
    )
    memory = GaugeMetricFamily(
        "kalos_backend_memory_bytes",
        "Bytes the backend holds for the memory, by part: rows (with norms and times), int8 (the "
        "int8 first pass's copies), gathered (rows of filtered searches), host_copy (CUDA's host path).",
        labels=["part"],
    )
    if st is not None:
        for ps in st.searches:
            searches.add_metric([ps.path, ps.batch], ps.searches)
            seconds.add_metric([ps.path, ps.batch], ps.seconds)
        for path, n in st.redone:
            redone.add_metric([path], n)
        for part, b in st.memory:
            memory.add_metric([part], b)
    yield from (searches, seconds, redone, memory)


def _spelling(option: str) -> str:
    """An option as it was spelled: an enum's value (``str()`` of a ``str`` enum is its name)."""
    return str(option.value) if isinstance(option, enum.Enum) else str(option)
