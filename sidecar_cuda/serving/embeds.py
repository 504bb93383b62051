"""The EMBED route: the text requests of a pass, every client's, embedded together.

The pipeline takes them out of the batch before it classifies the rest (so a text request never
sends a batch of recalls to the general route) and hands them here: each request's blob is read
as untrusted input (``broker.texts``: UTF-8, NUL-terminated, limits), the texts of every valid
request go through the encoder in one call (``embedding.TextEncoder.encode``: one forward pass for
a batch of the sizes agents send), and each request gets its vectors in its slot's queries area,
``n_results = nq``. A rejected request gets its own status and takes nothing from the others.
"""

from __future__ import annotations

import logging

import numpy as np

from ...broker.layout import SegmentView, Status
from ...broker.texts import TextError, decode_texts
from ..embedding import TextEncoder
from .answers import AnswerWriter

log = logging.getLogger("kalos.sidecar")

NO_MODEL = "this sidecar serves no embedding model (start it with --embed DIR)"


class EmbedRoute:
    """``encoder``: the sidecar's model, or None (every request then gets UNKNOWN_OP, saying so)."""

    def __init__(self, seg: SegmentView, writer: AnswerWriter, encoder: TextEncoder | None, dim: int) -> None:
        self.seg = seg
        self.layout = seg.layout
        self.writer = writer
        self.encoder = encoder
        self.dim = dim

    def serve(self, taken: list[int], rec: np.ndarray) -> None:
        """Answer (not yet publish) the EMBED requests of slots ``taken`` (control blocks ``rec``)."""
        lay = self.layout
        valid: list[tuple[int, int, int]] = []  # (slot, generation, nq)
        texts: list[str] = []
        for i, r in zip(taken, rec):
            gen, nq, blob_len = int(r["generation"]), int(r["nq"]), int(r["blob_len"])
            if self.encoder is None:
                self.writer.answer(i, gen, Status.UNKNOWN_OP, NO_MODEL)
                continue
            if not 1 <= nq <= lay.max_queries:
                self.writer.answer(i, gen, Status.TOO_MANY_QUERIES, f"nq={nq} outside 1..{lay.max_queries}")
                continue
            if not 0 < blob_len <= lay.blob_bytes:
                self.writer.answer(i, gen, Status.BAD_REQUEST, f"blob_len={blob_len} outside 1..{lay.blob_bytes}")
                continue
            try:
                mine = decode_texts(self.seg.slot[i].blob[:blob_len].tobytes(), nq)
            except TextError as e:
                self.writer.answer(i, gen, Status.BAD_REQUEST, f"texts: {e}")
                continue
            valid.append((i, gen, nq))
            texts += mine
        if not valid:
            return
        assert self.encoder is not None
        try:
            vectors = self.encoder.encode(texts)
        except Exception as e:  # (a bug or the device: every request of the pass is told)
            log.error("embedding %d texts failed", len(texts), exc_info=e)
            for i, gen, _nq in valid:
                self.writer.answer(
                    i, gen, Status.BACKEND_ERROR, f"embedding failed ({type(e).__name__}); it was logged"
                )
            return
        start = 0
        for i, gen, nq in valid:
            self.writer.rows(i, np.arange(nq, dtype=np.int64), vectors[start : start + nq])
            self.writer.answer(i, gen, Status.OK, n_results=nq)
            start += nq


__all__ = ["NO_MODEL", "EmbedRoute"]
