"""Prometheus metrics, liveness and readiness of a sidecar over HTTP.

Modules: ``aggregate`` (the pure arithmetic: histograms, windows, rings, totals, stage times),
``collector`` (:class:`SidecarCollector`, reading a :class:`SidecarView` at scrape time),
``exposition`` (the text format), ``http`` (:class:`MetricsServer`).

``MetricsServer(sidecar, host, port)`` serves, from a background thread of the sidecar process:

* ``/metrics``  Prometheus exposition (text format, or OpenMetrics when the scraper asks for it);
* ``/healthz``  200 while the process is up;
* ``/readyz``   200 once the memory is loaded and the backend is serving, 503 before and while
  stopping.

It listens on loopback unless told otherwise: the endpoint has no authentication.

Everything is computed at scrape time by one collector of our own (:class:`SidecarCollector`),
registered in the registry the caller passes (a fresh ``CollectorRegistry`` otherwise; nothing is
ever put in prometheus_client's global registry). Its sources:

End-to-end latency as callers see it (``kalos_client_latency_seconds{op}``)
    Each slot's client stats block in shared memory (``broker.layout``: per kind of call
    (``LatencyOp``, the ``op`` label: recall, recall_many, upsert, delete, get, other) a histogram
    ``hist[op]`` over the protocol's ``LATENCY_BOUNDS_NS``, ``lat_sum_ns[op]``, ``err_count[op]``,
    ``timeout_count[op]``; and one ring of the last ``RING_LEN`` latencies, each entry tagged with
    its op), written by the slot's lease owner after every completed request. A request is timed
    from the call, including the wait for a slot; a chunk of a call sent in several chunks (upsert,
    delete, get of more than max_queries rows) from its own sending, so a bulk write never shows as
    one long recall. The collector keeps the last value it saw of every per-slot counter and adds the
    *difference* to its own totals (:class:`MonotonicTotals`). A slot whose counters went down (a
    new owner that started from zero) contributes its new values as the difference. So the exported
    counters never go backwards, however slots change owners, and a slot given up keeps its history.
    Every op's series are exported from the start (at zero until its first request).

Window quantiles (summaries ``kalos_client_latency_window_seconds{op,quantile="0.5|0.95|0.99"}``)
    A sliding window per op over recent samples (:class:`SlidingWindow`): the last ``window_s``
    seconds (default 60), at most ``window_samples`` samples (default 20000, newest kept); the
    summary's ``_count`` and ``_sum`` are the histogram's (since start). Client samples
    come from the rings: a harvest thread reads, every ``harvest_interval_s`` (0.1 s) and at every
    scrape, the entries written since its last read of each slot, using ``lat_count`` as the
    ring's write index (:func:`ring_take_all`), and files each under the op in its top byte (an
    entry of no known op is counted as ``invalid`` and dropped). A slot that completed more than
    ``RING_LEN`` requests between two reads loses the older ones (one read trusts at most
    ``RING_LEN - 1`` entries: the oldest may be under overwrite; losses are counted in
    ``kalos_metrics_dropped_samples_total``); the window is then a subsample. Entries the writer may
    have overwritten during the copy are discarded, never misread. Samples are stamped with the time
    they were read, not the time they were recorded (the ring has no timestamps), which shifts the
    window by at most one harvest interval. The quantile is the nearest-rank one: the smallest sample
    with at least q of the window at or below it (numpy ``method="inverted_cdf"``). Ring entries
    keep 56 bits of nanoseconds (two years): no latency is clipped.

The sidecar's own stages (``kalos_queue_wait_seconds``, ``kalos_batch_compute_seconds``, ``kalos_service_seconds``,
and their window quantiles ``kalos_stage_latency_window_seconds{stage,quantile}``)
    From a ``SidecarStats`` observer, called by the serving thread with each ``BatchRecord``: it only
    stamps the record and queues it (a few hundred nanoseconds); the harvest thread turns records
    into histograms and windows. Queue wait is posted -> taken into a batch, per request. Compute is
    the backend work of a whole batch, per batch. Service is posted -> results written
    (``t_done_ns`` of the record), per request.

Everything else is read at scrape time: slots (leased, by state), requests, batches and errors by
kind (one series per ``Status`` name: a bounded set), rows per namespace (the ``namespace_labels``
largest namespaces by rows as labels, every other namespace summed under ``namespace="_other"``;
a real namespace named ``_other`` always falls in that bucket), backend info and uptime.
"""

from .aggregate import (
    BATCH_SIZE_BOUNDS,
    COUNTER_CAP,
    OTHER_NAMESPACES,
    QUANTILES,
    STAGE_BOUNDS_NS,
    STAGE_CAP_NS,
    MonotonicTotals,
    SlidingWindow,
    StageAggregator,
    bucket_counts,
    cumulative_buckets,
    nearest_rank_quantiles,
    ring_take_all,
    slots_matrix,
    split_ring_entries,
    top_namespaces,
)
from .collector import OP_LABELS, SidecarCollector, SidecarView
from .exposition import TEXT_CONTENT_TYPE, TextEncoder, encode_text
from .http import MetricsServer

__all__ = [
    "MetricsServer",
    "SidecarCollector",
    "SidecarView",
    "TextEncoder",
    "encode_text",
    "TEXT_CONTENT_TYPE",
    "MonotonicTotals",
    "SlidingWindow",
    "StageAggregator",
    "bucket_counts",
    "cumulative_buckets",
    "nearest_rank_quantiles",
    "ring_take_all",
    "slots_matrix",
    "split_ring_entries",
    "top_namespaces",
    "OP_LABELS",
    "QUANTILES",
    "STAGE_BOUNDS_NS",
    "BATCH_SIZE_BOUNDS",
    "OTHER_NAMESPACES",
    "COUNTER_CAP",
    "STAGE_CAP_NS",
]
