"""``kalos export`` / ``kalos import``: a namespace as files (ids.npy, vectors.npy, payloads.jsonl)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

import numpy as np

from kalos.broker.errors import ConfigError

BLOCK_ROWS = 4096  # rows per pool.upsert call (each is split over the pool's slots)


def export_namespace(name: str, namespace: str, out_dir: str, *, timeout: float | None = 60.0) -> int:
    """Write every record of ``namespace`` to ``out_dir``; returns the number of records.

    Pages are read with an id cursor, so the export stays consistent record by record while
    writers go on (a record changed during the export appears in its old or new form)."""
    from kalos.clients.blocking import RecallClient

    ids, vecs, payloads = [], [], []
    with RecallClient(name, timeout=timeout) as c:
        after = -1
        while True:
            i, v, p = c.export_page(namespace, after)
            if not len(i):
                break
            ids.append(i)
            vecs.append(v)
            payloads.extend(p)
            after = int(i[-1])
        dim = c.layout.dim
    os.makedirs(out_dir, exist_ok=True)
    all_ids = np.concatenate(ids) if ids else np.empty(0, np.int64)
    all_vecs = np.concatenate(vecs) if vecs else np.empty((0, dim), np.float32)
    np.save(os.path.join(out_dir, "ids.npy"), all_ids)
    np.save(os.path.join(out_dir, "vectors.npy"), all_vecs)
    with open(os.path.join(out_dir, "payloads.jsonl"), "w", encoding="utf-8") as f:
        for p in payloads:
            f.write(json.dumps(p, ensure_ascii=False) + "\n")
    return len(all_ids)


def read_export(src: str) -> tuple[np.ndarray, np.ndarray, list[Any] | None]:
    try:
        vectors = np.load(os.path.join(src, "vectors.npy"), mmap_mode="r")
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {src}/vectors.npy: {e}") from None
    ids_path = os.path.join(src, "ids.npy")
    ids = np.load(ids_path) if os.path.exists(ids_path) else np.arange(len(vectors), dtype=np.int64)
    if vectors.ndim != 2 or len(ids) != len(vectors):
        raise ConfigError(f"{src}: {len(ids)} ids for vectors of shape {vectors.shape}")
    payloads = None
    pl_path = os.path.join(src, "payloads.jsonl")
    if os.path.exists(pl_path):
        with open(pl_path, encoding="utf-8") as f:
            payloads = [json.loads(line) for line in f if line.strip()]
        if len(payloads) != len(ids):
            raise ConfigError(f"{pl_path}: {len(payloads)} payloads for {len(ids)} vectors")
    return ids, vectors, payloads


def import_namespace(name: str, namespace: str, src: str, *, timeout: float | None = 60.0,
                     pool_size: int = 16) -> tuple[int, float]:
    """Bulk-upsert an export into ``namespace``; returns (records, seconds). Blocks of rows go
    through every slot of a pool at once; each block is acknowledged (durable) before the next."""
    ids, vectors, payloads = read_export(src)

    async def run() -> int:
        from kalos.clients.pool import RecallPool

        n = 0
        async with RecallPool(name, size=pool_size, timeout=timeout) as pool:
            for lo in range(0, len(ids), BLOCK_ROWS):
                hi = min(len(ids), lo + BLOCK_ROWS)
                n += await pool.upsert(ids[lo:hi], np.asarray(vectors[lo:hi], np.float32),
                                       None if payloads is None else payloads[lo:hi],
                                       namespace=namespace)
        return n

    t0 = time.perf_counter()
    n = asyncio.run(run())
    return n, time.perf_counter() - t0
