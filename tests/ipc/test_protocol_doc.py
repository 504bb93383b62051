"""docs/protocol.md answers what a client writer asks (issue 33, item 13), and the answers are what
a real sidecar does: requests written field by field into a slot, as another language's client
would, each answer checked against the document's words.

Slot states and flags by number, ``ttl_ns``'s bound, which answers carry ``now_ns``, the recency
fields' bounds, flags an op does not take and bits 8-31, a TOUCH or DELETE naming an id twice,
JSON lines separated (not terminated), and the stats row of TOUCH, SET_TTL and unknown ops."""

from __future__ import annotations

import math
import re
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kalos import RecallClient
from kalos.broker.clock import MAX_TTL_NS
from kalos.broker.layout import (
    HIT_META_BYTES,
    L_OTHER,
    L_RECALL,
    L_RECALL_MANY,
    Flag,
    LatencyOp,
    Op,
    SlotState,
    Status,
    latency_op,
)
from kalos.broker.slotpath import Choice, SlotPath
from kalos.clients._slots import ClientSlot
from kalos.clients._transport import Connection

pytestmark = pytest.mark.timeout(120)
DOC = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text(encoding="utf-8")
DIM = 8
UNSET = 0xDEADBEEF  # what now_ns holds before a request whose answer must leave it alone


# --------------------------------------------------------------------------- the document's numbers
def test_slot_states_and_flags_are_numbered_as_the_layout_defines_them() -> None:
    table = DOC.split("### Slot states", 1)[1].split("```", 1)[0]
    rows = re.findall(r"^\| (\d+) \| ([A-Z]+) \|", table, re.M)
    assert [(int(v), n) for v, n in rows] == [(int(s), s.name) for s in SlotState]
    row = next(line for line in DOC.splitlines() if line.startswith("| 44 | flags |"))
    for f in Flag:
        assert f"{f.name} ({int(f)}" in row, f.name
    assert max(Flag) < 1 << 8 and "bits 8-31: reserved, write 0" in row
    flags = DOC.split("### Flags", 1)[1].split("\n## ", 1)[0]
    for f in Flag:
        assert f"| {f.name} ({int(f)}) |" in flags, f.name
    assert "| bits 8-31 |" in flags


def test_ttl_bound_in_the_document_is_the_sidecars() -> None:
    row = next(line for line in DOC.splitlines() if line.startswith("| 200 | ttl_ns |"))
    bound = re.search(r"0 to ([\d,]+) inclusive", row)
    assert bound and int(bound.group(1).replace(",", "")) == MAX_TTL_NS
    assert MAX_TTL_NS < 2**62  # the document's example of a refused value


def test_stats_rows_of_touch_set_ttl_and_unknown_ops() -> None:
    """The clients record TOUCH, SET_TTL (and every op outside the table) as "other", recalls as
    recall / recall_many whatever their flags: the document's table and its rule."""
    row = next(line for line in DOC.splitlines() if line.startswith("| 5 | other |"))
    for op in (Op.COUNT, Op.LIST_NAMESPACES, Op.DROP_NAMESPACE, Op.EXPORT, Op.TOUCH, Op.SET_TTL):
        assert latency_op(int(op), True) == latency_op(int(op), False) == L_OTHER
        assert op.name in row
    for unknown in (0, 11, 77, 2**31):
        assert latency_op(unknown, True) == L_OTHER
    assert latency_op(int(Op.RECALL), True) == L_RECALL and latency_op(int(Op.RECALL), False) == L_RECALL_MANY
    assert len(LatencyOp) == 6 and 'source="invalid"' in DOC


# --------------------------------------------------------------------------- a real sidecar
class Raw:
    """One leased slot written field by field (the pure-Python slot path's views)."""

    def __init__(self, name: str) -> None:
        self.conn = Connection(name, slot_path=Choice(SlotPath.PYTHON, None, "a raw client"))
        (slot,) = self.conn.lease(1)
        assert isinstance(slot, ClientSlot)
        self.s = slot
        self.rec = self.conn.seg.slots

    def ask(
        self,
        op: int,
        *,
        flags: int = 0,
        k: int = 0,
        ns: bytes = b"ns",
        ids: list[int] | None = None,
        q: np.ndarray | None = None,
        blob: bytes = b"",
        **fields: Any,
    ) -> dict[str, Any]:
        i, s = self.s.index, self.s
        self.rec[i]["now_ns"] = UNSET
        for f in ("ttl_ns", "half_life_s", "recency_weight", "after_xid", "after_seq", "after_until_ns"):
            self.rec[i][f] = fields.pop(f, 0)
        assert not fields, fields
        nq = len(ids) if ids is not None else (len(q) if q is not None else 0)
        if ids is not None:
            s.view.ids[:nq] = ids
        if q is not None:
            s.view.queries[: len(q)] = q
        if blob:
            s.view.blob[: len(blob)] = np.frombuffer(blob, np.uint8)
        s.post(int(op), ns, k, nq, flags, len(blob), time.monotonic_ns())
        assert s.wait(10.0), "no answer"
        status, n, blob_len = s.outcome()
        out = {
            "status": Status(status),
            "n": n,
            "blob": bytes(s.view.blob[:blob_len]),
            "now": int(self.rec[i]["now_ns"]),
            "ids": s.view.result_ids[0, :n].copy() if op == Op.RECALL else None,
        }
        s.set_free()
        return out

    def close(self) -> None:
        self.conn.give_back([self.s], [])
        self.conn.close()


@pytest.fixture
def raw(sidecar_factory) -> Iterator[tuple[Raw, str]]:
    h = sidecar_factory("protodoc", "--dim", str(DIM), "--backend", "numpy")
    with RecallClient(h.name) as c:
        c.upsert([1, 2, 3], np.eye(DIM, dtype=np.float32)[:3], [{"a": 1}, None, {"a": 3}], namespace="ns")
    r = Raw(h.name)
    yield r, h.name
    r.close()


E0 = np.eye(DIM, dtype=np.float32)[:1]


def test_bits_8_to_31_and_flags_an_op_does_not_take(raw) -> None:
    r, _name = raw
    plain = r.ask(Op.RECALL, k=3, q=E0)
    assert plain["status"] is Status.OK and plain["n"] == 3
    for extra in (1 << 8, 1 << 31, 0xFFFFFF00):
        got = r.ask(Op.RECALL, flags=extra, k=3, q=E0)
        assert got["status"] is Status.OK and list(got["ids"]) == list(plain["ids"])
    # TTL on a RECALL: ttl_ns unread (even a negative one), the answer carries now_ns.
    got = r.ask(Op.RECALL, flags=int(Flag.TTL), k=3, q=E0, ttl_ns=-5)
    assert got["status"] is Status.OK and abs(got["now"] - time.time_ns()) < 60e9
    # WITH_PAYLOAD on COUNT: ignored.
    assert r.ask(Op.COUNT, flags=int(Flag.WITH_PAYLOAD))["n"] == 3
    # WHERE on LIST_NAMESPACES / GET: the blob is parsed as a filter, then ignored.
    bad = r.ask(Op.LIST_NAMESPACES, flags=int(Flag.WHERE))
    assert bad["status"] is Status.BAD_REQUEST
    got = r.ask(Op.GET, flags=int(Flag.WHERE), ids=[1], blob=b'{"a":3}')
    assert got["status"] is Status.OK and got["n"] == 1 and got["blob"] == b'{"a":1}'
    # RECALL's RECENCY on a GET: HIT_META records as with TIMES (recency 0), the fields unread.
    got = r.ask(Op.GET, flags=int(Flag.RECENCY), ids=[1], half_life_s=-1.0, recency_weight=math.nan)
    assert got["status"] is Status.OK and len(got["blob"]) == HIT_META_BYTES + len(b'{"a":1}')
    assert struct.unpack_from("<d", got["blob"], 24)[0] == 0.0
    # AFTER on a write, without a fleet store: held for nothing, served.
    got = r.ask(Op.UPSERT, flags=int(Flag.AFTER), ids=[7], q=E0, after_xid=10**12, after_seq=1)
    assert got["status"] is Status.OK and got["n"] == 1


def test_ttl_ns_bounds_and_set_ttl_without_the_flag(raw) -> None:
    r, name = raw
    assert r.ask(Op.SET_TTL, ns=b"t1", ttl_ns=MAX_TTL_NS)["status"] is Status.OK
    for bad in (MAX_TTL_NS + 1, 2**62, -1):
        got = r.ask(Op.SET_TTL, ns=b"t1", ttl_ns=bad)
        assert got["status"] is Status.BAD_REQUEST and got["now"] == UNSET, got
        got = r.ask(Op.UPSERT, flags=int(Flag.TTL), ids=[9], q=E0, ttl_ns=bad)
        assert got["status"] is Status.BAD_REQUEST
    # Without flag TTL an UPSERT does not read ttl_ns (2^62 is no error) ...
    assert r.ask(Op.UPSERT, ids=[9], q=E0, ttl_ns=2**62, ns=b"t2")["status"] is Status.OK
    # ... and SET_TTL needs no flag: its default applies to the next upsert without TTL.
    assert r.ask(Op.SET_TTL, ns=b"t3", ttl_ns=5 * 10**9)["status"] is Status.OK
    with RecallClient(name) as c:
        c.upsert([1], E0, namespace="t3")
        rec = c.get([1], namespace="t3")
        assert rec.expires_at[0] - rec.updated_at[0] == pytest.approx(5.0, abs=1e-6)
        assert np.isinf(c.get([9], namespace="t2").expires_at).all()


def test_now_ns_on_ok_and_error_answers(raw) -> None:
    r, _name = raw
    ok = r.ask(Op.DELETE, ids=[99])
    assert ok["status"] is Status.OK and abs(ok["now"] - time.time_ns()) < 60e9
    for got in (
        r.ask(77, flags=int(Flag.TTL)),
        r.ask(Op.RECALL, flags=int(Flag.TIMES), k=0, q=E0),
        r.ask(Op.RECALL, flags=int(Flag.RECENCY), k=1, q=E0, half_life_s=0.0, recency_weight=1.0),
    ):
        assert got["status"] is not Status.OK and got["now"] == UNSET, got


def test_recency_bounds(raw) -> None:
    r, _name = raw
    for hl, w in ((0.0, 1.0), (-1.0, 1.0), (math.inf, 1.0), (math.nan, 1.0), (1.0, math.inf), (1.0, math.nan)):
        got = r.ask(Op.RECALL, flags=int(Flag.RECENCY), k=1, q=E0, half_life_s=hl, recency_weight=w)
        assert got["status"] is Status.BAD_REQUEST, (hl, w)
    for hl, w in ((1e-300, -1.0), (1e300, 0.0), (3600.0, -5.0)):
        got = r.ask(Op.RECALL, flags=int(Flag.RECENCY), k=1, q=E0, half_life_s=hl, recency_weight=w)
        assert got["status"] is Status.OK, (hl, w)


def test_touch_and_delete_count_a_repeated_id_once(raw) -> None:
    r, _name = raw
    assert r.ask(Op.TOUCH, ids=[1, 1, 1])["n"] == 1
    assert r.ask(Op.TOUCH, flags=int(Flag.TTL), ids=[1, 2, 1, 99], ttl_ns=10**12)["n"] == 2
    assert r.ask(Op.DELETE, ids=[3, 3])["n"] == 1


def test_json_lines_are_separated_not_terminated(raw) -> None:
    r, _name = raw
    two = np.eye(DIM, dtype=np.float32)[4:6]
    assert r.ask(Op.UPSERT, ids=[5, 6], q=two, blob=b'{"x":1}\n{"y":2}')["status"] is Status.OK
    for blob in (b'{"x":1}\n{"y":2}\n', b'{"x":1}\n'):  # a terminating newline; an empty line
        assert r.ask(Op.UPSERT, ids=[5, 6], q=two, blob=blob)["status"] is Status.BAD_REQUEST
    got = r.ask(Op.RECALL, flags=int(Flag.WITH_PAYLOAD), k=3, q=E0)
    assert got["n"] == 3 and got["blob"].count(b"\n") == 2 and not got["blob"].endswith(b"\n")
    got = r.ask(Op.GET, ids=[5, 2, 6])
    assert got["blob"] == b'{"x":1}\nnull\n{"y":2}'
