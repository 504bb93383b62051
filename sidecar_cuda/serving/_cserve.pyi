"""Types of the compiled extension (``_cserve.c``); what each call does is documented in
:mod:`kalos.sidecar_cuda.serving.slotio`, beside its Python twin."""

from collections.abc import Sequence

import numpy as np

PROTOCOL_VERSION: int

class SlotIO:
    def __init__(
        self,
        segment: memoryview | bytearray,
        *,
        n_slots: int,
        dim: int,
        max_k: int,
        max_queries: int,
        control_offset: int,
        data_offset: int,
        slot_bytes: int,
        query_offset: int,
        result_ids_offset: int,
        result_scores_offset: int,
        req_names: Sequence[str],
        resp_names: Sequence[str],
    ) -> None: ...
    def scan(self, out: np.ndarray, /) -> int: ...
    def take(self, idx: np.ndarray, n: int, /) -> int: ...
    def snapshot(self, sel: np.ndarray, t_pick: int, rec: np.ndarray, /) -> None: ...
    def gather(self, slots: np.ndarray, rows: np.ndarray | None, out: np.ndarray, /) -> None: ...
    def answer_recalls(
        self,
        sel: np.ndarray,
        rec: np.ndarray,
        ids: np.ndarray,
        scores: np.ndarray,
        slots: np.ndarray | None,
        rows: np.ndarray | None,
        /,
    ) -> None: ...
    def deliver(self, sel: np.ndarray, /) -> int: ...
    def answer_single(self, slot: int, ids: np.ndarray, scores: np.ndarray, /) -> int: ...
    def map_ids(self, tables: list[np.ndarray], rows: np.ndarray, out: np.ndarray, /) -> None: ...
    def close(self) -> None: ...
    @staticmethod
    def layout() -> dict[str, int | tuple[int, int]]: ...
