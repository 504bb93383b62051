"""What the fake transport's sidecar answers in the client unit tests: the exact top-k of a
matrix, computed in float64 (the independent reference the answers are checked against)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kalos.broker.layout import SlotView

Answer = Callable[[SlotView, int, int, int], "tuple[np.ndarray, np.ndarray]"]


def topk(matrix: np.ndarray, log: list[tuple[int, int]] | None = None) -> Answer:
    """``FakeConnection.serve``'s answer: the float64 top-k of each query row against
    ``matrix`` (dot product); ``log`` gets (nq, k) of every request served."""

    def answer(v: SlotView, op: int, k: int, nq: int) -> tuple[np.ndarray, np.ndarray]:
        if log is not None:
            log.append((nq, k))
        s = v.queries[:nq].astype(np.float64) @ matrix.T.astype(np.float64)
        ids = np.argsort(-s, axis=1, kind="stable")[:, :k]
        return ids.astype(np.int64), np.take_along_axis(s, ids, 1).astype(np.float32)

    return answer
