"""Hybrid (lexical + dense) recall, the parts both sides share: :class:`Hybrid` (what a caller asks),
the tokenizer and BM25's parameters, and a hybrid request's blob. Pure.

The lexical score is Okapi BM25 as ``rank_bm25.BM25Okapi`` computes it (k1 1.5, b 0.75, epsilon
0.25: a term's idf is ``ln((N - df + 0.5) / (df + 0.5))``, and a negative idf becomes epsilon
times the mean idf of the namespace's terms), over the namespace's records that carry a text
(``upsert_text``: the payload's ``"text"``), tokenized by :func:`tokenize` (lower case, runs of
Unicode word characters). A hybrid recall ranks every record its filter (and expiry) admits by

    score = similarity + weight * max(bm25, 0) / max_bm25

``max_bm25`` the largest BM25 score of the query among those records (the lexical part is 0 when
no record shares a term with it): exactly, over every matching row. (A BM25 below 0 is possible
under the epsilon rule only when the mean idf is negative, most terms in most texts: it counts as
0, so no record scores below its similarity.)
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .errors import InvalidRequest
from .texts import TextError, decode_texts, encode_texts

K1 = 1.5
B = 0.75
EPSILON = 0.25
_WORD = re.compile(r"\w+")


def tokenize(text: str) -> list[str]:
    """A text's terms: lower case, maximal runs of Unicode word characters (``\\w``)."""
    return _WORD.findall(text.lower())


@dataclass(frozen=True)
class Hybrid:
    """``recall_text(..., hybrid=Hybrid(weight))``: rank by the dense similarity plus ``weight``
    times the query's normalized BM25 score (module docstring); ``weight`` finite, >= 0 (0: the
    dense ranking)."""

    weight: float = 0.5

    def __post_init__(self) -> None:
        problem = weight_problem(self.weight)
        if problem is not None:
            raise InvalidRequest(problem)


def weight_problem(weight: object) -> str | None:
    """Why ``weight`` is no hybrid weight (None: it is one)."""
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
        return f"hybrid weight must be a finite number >= 0, got {weight!r}"
    return None


def encode_hybrid_blob(text: str, where: bytes) -> bytes:
    """A hybrid recall's blob: its query text (NUL-terminated, as Op.EMBED's texts), then its
    filter's bytes (Flag.WHERE), if any."""
    try:
        return encode_texts([text]) + where
    except TextError as e:
        raise InvalidRequest(f"hybrid query {e}") from None


def decode_hybrid_blob(blob: bytes) -> tuple[str, bytes]:
    """(query text, filter bytes) of a hybrid recall's blob, checked as untrusted (TextError)."""
    end = blob.find(b"\x00")
    if end < 0:
        raise TextError("a hybrid recall's blob must start with its NUL-terminated query text")
    return decode_texts(blob[: end + 1], 1)[0], blob[end + 1 :]


__all__ = ["B", "EPSILON", "K1", "Hybrid", "decode_hybrid_blob", "encode_hybrid_blob", "tokenize", "weight_problem"]
