"""A namespace's lexical index for hybrid recall (``broker.lexical``): Okapi BM25 over the texts its
records carry (the payload's ``"text"``, as ``upsert_text`` writes it), exactly as
``rank_bm25.BM25Okapi`` scores, in float64.

Built from the namespace's rows on the first hybrid recall after a write (the namespace's version
names it) and kept until the next: O(the texts' tokens) then, a few array operations per query
term after. Rows without a text are no documents (they count in no statistic and score 0).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence

import numpy as np

from ...broker.lexical import EPSILON, K1, B, tokenize


def text_of(payload: bytes | None) -> str | None:
    """The text a record's payload JSON line carries (its ``"text"`` field), or None."""
    if not payload or b'"text"' not in payload:
        return None
    try:
        p = json.loads(payload)
    except ValueError:
        return None
    t = p.get("text") if isinstance(p, dict) else None
    return t if isinstance(t, str) else None


class LexicalIndex:
    """BM25 statistics of the texts of rows [0, n): postings (term -> rows, term frequencies),
    document lengths, and each term's idf."""

    def __init__(self, texts: Sequence[str | None]) -> None:
        self.n = len(texts)
        self.doc_len = np.zeros(self.n, np.float64)
        postings: dict[str, dict[int, int]] = {}
        docs = 0
        for row, text in enumerate(texts):
            if text is None:
                continue
            docs += 1
            terms = tokenize(text)
            self.doc_len[row] = len(terms)
            for t in terms:
                per = postings.setdefault(t, {})
                per[row] = per.get(row, 0) + 1
        self.docs = docs
        self.avgdl = float(self.doc_len.sum() / docs) if docs else 0.0
        self.postings: dict[str, tuple[np.ndarray, np.ndarray]] = {
            t: (np.fromiter(per.keys(), np.int64, len(per)), np.fromiter(per.values(), np.float64, len(per)))
            for t, per in postings.items()
        }
        self.idf = _idf({t: len(rows) for t, (rows, _tf) in self.postings.items()}, docs)

    def scores(self, query: str) -> tuple[np.ndarray, np.ndarray]:
        """BM25 of ``query`` for the rows that share a term with it: (rows ascending int64,
        scores float64); every other row scores 0. A query term counts as often as it occurs in
        the query, each row's terms summed in the query's order (as rank_bm25 sums). Costs the
        query terms' postings, not the namespace's size."""
        rows_parts: list[np.ndarray] = []
        vals: list[np.ndarray] = []
        if self.docs and self.avgdl > 0:
            for term in tokenize(query):
                hit = self.postings.get(term)
                if hit is None:
                    continue
                rows, tf = hit
                norm = K1 * (1 - B + B * self.doc_len[rows] / self.avgdl)
                rows_parts.append(rows)
                vals.append(self.idf[term] * (tf * (K1 + 1) / (tf + norm)))
        if not rows_parts:
            return np.empty(0, np.int64), np.empty(0, np.float64)
        uniq, at = np.unique(np.concatenate(rows_parts), return_inverse=True)
        return uniq, np.bincount(at, weights=np.concatenate(vals), minlength=len(uniq))


def _idf(df: Mapping[str, int], docs: int) -> dict[str, float]:
    """rank_bm25's BM25Okapi idf: ln((N - df + 0.5) / (df + 0.5)); a negative one (a term in more
    than half the documents) becomes EPSILON times the mean idf."""
    idf = {t: math.log(docs - d + 0.5) - math.log(d + 0.5) for t, d in df.items()}
    if not idf:
        return idf
    floor = EPSILON * (sum(idf.values()) / len(idf))
    return {t: (floor if v < 0 else v) for t, v in idf.items()}


__all__ = ["LexicalIndex", "text_of"]
