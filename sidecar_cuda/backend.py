"""The backend interface: where the memory matrix lives and how a batch is searched.

A backend owns device memory; everything about ids, namespaces, payloads and durability lives in
:mod:`sidecar_cuda.store` and is the same for every backend. Backends are chosen in one place,
:func:`sidecar_cuda.select.choose_backend`; this module imports none of them.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from broker.layout import Metric


class PendingSearch(Protocol):
    """A search under way on the backend's device (the sidecar's pipeline keeps up to two)."""

    def done(self) -> bool:
        """True once ``result()`` would not wait."""
        ...

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """(rows, scores) as ``Matrix.search`` returns them; raises what the search raised.
        Call it exactly once."""
        ...


class Completed:
    """A search that finished when it was started (the CPU backend, empty searches)."""

    __slots__ = ("_value",)

    def __init__(self, rows: np.ndarray, scores: np.ndarray) -> None:
        self._value = (rows, scores)

    def done(self) -> bool:
        return True

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        return self._value


class Matrix(Protocol):
    """Rows of one namespace, resident on the backend's device. Rows [0, n) are live."""

    capacity: int

    def write_rows(self, rows: np.ndarray, vectors: np.ndarray) -> None:
        """Store float32 ``vectors`` (m, d) at row indices ``rows`` (m,) (already metric-prepared)."""

    def move_rows(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy rows ``src`` onto rows ``dst`` (compaction after deletes; src and dst disjoint)."""

    def grow(self, capacity: int) -> None:
        """Grow to hold ``capacity`` rows, keeping the existing ones."""

    def read_rows(self, rows: np.ndarray) -> np.ndarray:
        """Stored rows as float32 (m, d), for export."""

    def search(self, queries: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Exact top-k over rows [0, n) for float32 ``queries`` (B, d).

        Returns (rows int64 (B, kk), scores float32 (B, kk)), kk = min(k, n), best first.
        Scores: dot product (dot, cosine on normalised rows), or minus the squared L2 distance.
        """

    def search_async(self, queries: np.ndarray, n: int, k: int) -> PendingSearch:
        """Start the same search and return at once. ``queries`` must stay untouched until the
        result is collected. At most two searches of a backend may be pending at a time, and no
        write, move or growth of the matrix may happen while one of its searches is."""


class Backend(Protocol):
    name: str  # "numpy" | "cuda"
    code: int  # header "backend" field: 1 numpy, 2 cuda
    description: str  # human-readable device line, printed at start
    max_k: int  # largest k this backend can serve

    def new_matrix(self, dim: int, capacity: int, metric: Metric) -> Matrix: ...

    def host_buffer(self, shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
        """Staging memory for gathering a batch (pinned on CUDA)."""
        ...

    def close(self) -> None: ...


def prepare_rows(vectors: np.ndarray, metric: Metric) -> np.ndarray:
    """Cosine stores unit rows (normalised at insert); dot and l2 store rows as given."""
    if metric == Metric.COSINE:
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        norms[norms == 0] = 1.0
        return np.ascontiguousarray(vectors / norms, dtype=np.float32)
    return vectors


def prepare_queries(queries: np.ndarray, metric: Metric) -> np.ndarray:
    return prepare_rows(queries, metric)
