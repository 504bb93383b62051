"""The backend's own statistics on a real sidecar's /metrics: searches by path and batch size,
queries redone, bytes held. Real sidecar processes and clients; the counts are checked against what
the test sent (numpy here; the CUDA backend's paths with KALOS_TEST_BACKEND=cuda, and in
tests/gpu)."""

from __future__ import annotations

import urllib.request

import numpy as np
import pytest
from conftest import TEST_BACKEND, assert_topk, free_port

from kalos.clients import RecallClient

pytestmark = pytest.mark.timeout(120)
DIM = 16
ROWS = 3000


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the kalos_backend_* families: (name, sorted labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("kalos_backend_") and s.name != "kalos_backend_info":
                out[s.name, tuple(sorted(s.labels.items()))] = s.value
    return out


def searches(samples: dict, batch: str) -> float:
    """Searches of one batch-size bucket, summed over the paths."""
    return sum(
        v
        for (name, labels), v in samples.items()
        if name == "kalos_backend_searches_total" and ("batch", batch) in labels
    )


def shards(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        line = next(ln for ln in r.read().decode().splitlines() if ln.startswith("kalos_backend_info{"))
    return line.split('device="', 1)[1].split('"', 1)[0].count(",") + 1


def start(sidecar_factory, port: int, seed: int, *args: str):
    return sidecar_factory(
        "bstats",
        "--dim",
        str(DIM),
        "--backend",
        "numpy",
        "--random-rows",
        str(ROWS),
        "--seed",
        str(seed),
        "--max-queries",
        "8",
        "--metrics-port",
        str(port),
        *args,
    )


@pytest.mark.parametrize("shard_count", [None, 2])
def test_searches_by_batch_size_and_the_rows_bytes_reach_metrics(sidecar_factory, seed, rng, shard_count):
    if shard_count is not None and TEST_BACKEND != "numpy":
        pytest.skip("several shards of one kind: the numpy backend here")
    port = free_port()
    h = start(sidecar_factory, port, seed, *(["--shards", str(shard_count)] if shard_count else []))
    per_search = shards(port)  # a batch is searched once on every shard, and counted there
    assert per_search == (shard_count or per_search)
    matrix = np.random.default_rng(seed).standard_normal((ROWS, DIM), dtype=np.float32)
    before = scrape(port)
    assert searches(before, "1") == searches(before, "2-8") == 0, before
    rows_bytes = before["kalos_backend_memory_bytes", (("part", "rows"),)]
    assert rows_bytes >= ROWS * DIM * 4  # float32 rows at least (padding, norms and times on top)
    with RecallClient(h.name) as c:
        for _ in range(5):  # one caller, one query a request: five batches of one
            q = rng.standard_normal(DIM).astype(np.float32)
            hits = c.recall(q, 5, timeout=30)
            assert_topk(q, matrix, hits.ids, hits.scores, 5)
        c.recall_many(rng.standard_normal((4, DIM)).astype(np.float32), 5, timeout=30)  # a batch of 4
        after = scrape(port)
        assert searches(after, "1") == 5 * per_search, after
        assert searches(after, "2-8") == 1 * per_search, after
        seconds = [v for (name, _l), v in after.items() if name == "kalos_backend_search_seconds_total"]
        assert seconds and all(v > 0 for v in seconds)
        if TEST_BACKEND == "numpy":
            paths = {dict(labels)["path"] for (name, labels) in after if name == "kalos_backend_searches_total"}
            assert paths == {"inline"}, paths  # small searches run on the serving thread
        # A namespace of its own adds a matrix: the bytes grow by its rows at least.
        c.upsert(np.arange(500), rng.standard_normal((500, DIM)).astype(np.float32), namespace="more", timeout=30)
        grown = scrape(port)["kalos_backend_memory_bytes", (("part", "rows"),)]
        assert grown >= rows_bytes + 500 * DIM * 4
