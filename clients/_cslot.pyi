"""Types of the compiled slot path (``clients/_cslot.c``); the docstrings are there."""

from collections.abc import Sequence
from typing import Any

import numpy as np

from .results import Hits

PROTOCOL_VERSION: int
PROTOCOL: dict[str, int]

class Sem:
    name: str
    def __init__(self, name: str) -> None: ...
    def post(self) -> None: ...
    def trywait(self) -> bool: ...
    def wait(self, timeout: float, /) -> bool: ...
    def close(self) -> None: ...

class Slot:
    def __init__(
        self,
        *,
        buffer: Any,
        index: int,
        control_base: int,
        stats_base: int,
        data_base: int,
        slot_bytes: int,
        query_offset: int,
        ids_offset: int,
        result_ids_offset: int,
        result_scores_offset: int,
        blob_offset: int,
        dim: int,
        max_k: int,
        max_queries: int,
        blob_bytes: int,
        sleeping_offset: int,
        bounds: tuple[int, ...],
        req: object,
        resp: object,
        bell: object,
    ) -> None: ...
    def post(self, generation: int, op: int, ns: bytes, k: int, nq: int, flags: int, blob_len: int, /) -> None: ...
    def post_rows(self, generation: int, rows: np.ndarray, k: int, ns: bytes, flags: int, /) -> None: ...
    def is_done(self) -> bool: ...
    def answered(self) -> bool: ...
    def set_free(self) -> None: ...
    def read_hits(
        self, generation: int, nq: int, k: int, single: bool, shares: Sequence[tuple[Any, ...]] | None = None, /
    ) -> Any: ...
    def record(self, latency_ns: int, ok: bool, timed_out: bool, op: int, /) -> None: ...
    def record_shares(
        self,
        now: int,
        shares: Sequence[tuple[Any, ...]],
        gone: Sequence[bool],
        ok: bool,
        op_single: int,
        op_many: int,
        /,
    ) -> None: ...

def as_row(x: Any, dim: int, /) -> np.ndarray | None: ...
def as_rows(x: Any, dim: int, max_rows: int, /) -> np.ndarray | None: ...
def configure(protocol_error: type[Exception], hits: type[Hits], /) -> None: ...
