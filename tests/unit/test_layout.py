"""The shared-memory layout: offsets, alignment, the generated C header."""

from __future__ import annotations

import itertools
import re
import subprocess

import numpy as np
import pytest

from kalos.broker import layout as L
from kalos.broker import names


def _spans(fields, itemsize):
    out = []
    for name, typ, off in fields:
        size = np.dtype(typ).itemsize
        assert off % min(size, 8) == 0, f"{name} misaligned"
        assert off + size <= itemsize, f"{name} past the block"
        out.append((off, off + size, name))
    out.sort()
    for (_a0, a1, an), (b0, _b1, bn) in itertools.pairwise(out):
        assert a1 <= b0, f"{an} overlaps {bn}"


def test_header_control_and_stats_fields_do_not_overlap():
    _spans(L.HEADER_FIELDS, L.HEADER_BYTES)
    _spans(L.SLOT_FIELDS, L.CONTROL_BYTES)
    _spans(L.HIT_META_FIELDS, L.HIT_META_BYTES)
    _spans(L.STATS_FIELDS, L.HIST_OFFSET)
    assert L.HIST_OFFSET + 8 * L.LATENCY_OPS * L.HIST_BUCKETS <= L.RING_OFFSET
    assert L.RING_OFFSET + 8 * L.RING_LEN <= L.STATS_BYTES


@pytest.mark.parametrize(
    "n,dim,k,q,blob", [(1, 1, 1, 1, 1024), (64, 128, 128, 32, 262144), (7, 1536, 1024, 3, 5000), (300, 3, 10, 64, 4096)]
)
def test_regions_are_disjoint_and_aligned(n, dim, k, q, blob):
    lay = L.Layout(n_slots=n, dim=dim, max_k=k, max_queries=q, blob_bytes=blob)
    lay.check()
    assert lay.control_offset == L.HEADER_BYTES
    assert lay.stats_offset >= lay.control_offset + n * L.CONTROL_BYTES
    assert lay.data_offset >= lay.stats_offset + n * L.STATS_BYTES
    assert lay.stats_offset % L.PAGE == 0 and lay.data_offset % L.PAGE == 0
    assert lay.slot_bytes % L.PAGE == 0
    areas = [
        (lay.query_offset, 4 * q * dim),
        (lay.ids_offset, 8 * q),
        (lay.result_ids_offset, 8 * q * k),
        (lay.result_scores_offset, 4 * q * k),
        (lay.blob_offset, blob),
    ]
    for (o, size), (o2, _s2) in itertools.pairwise(areas):
        assert o % 64 == 0 and o + size <= o2
    assert lay.blob_offset + blob <= lay.slot_bytes
    assert lay.total_bytes == lay.data_offset + n * lay.slot_bytes
    assert lay.data_base(n - 1) + lay.slot_bytes == lay.total_bytes


def test_attaching_parses_no_dtype_string(monkeypatch):
    """A segment's views are built without ``ast.literal_eval`` (numpy's parser of subarray
    formats): CPython 3.11's AST constructor can raise SystemError when threads parse at once
    (python/cpython#106905), and clients attach from many threads (a fleet test hit it)."""
    import ast

    def refuse(*a, **k):
        raise AssertionError("a dtype string was parsed while attaching")

    lay = L.Layout(n_slots=3, dim=5, max_k=4, max_queries=2, blob_bytes=1024)
    monkeypatch.setattr(ast, "literal_eval", refuse)
    seg = L.SegmentView(memoryview(bytearray(lay.total_bytes)), lay)
    assert seg.stats.shape == (3,) and seg.stats.dtype["lat_sum_ns"].shape == (L.LATENCY_OPS,)


def test_views_land_where_the_offsets_say():
    lay = L.Layout(n_slots=3, dim=5, max_k=4, max_queries=2, blob_bytes=1024)
    buf = bytearray(lay.total_bytes)
    seg = L.SegmentView(memoryview(buf), lay)
    seg.init_header(metric=1, backend=1, pid=1234, start_epoch_ns=5, payload_limit=16384)
    assert buf[:8] == L.MAGIC
    seg.slot[2].queries[1, 4] = 1.5
    off = lay.data_base(2) + lay.query_offset + 4 * (1 * 5 + 4)
    assert np.frombuffer(buf, np.float32, 1, off)[0] == 1.5
    seg.slots[1]["generation"] = 77
    off = L.slot_field_offset(lay, 1, "generation")
    assert np.frombuffer(buf, np.uint64, 1, off)[0] == 77
    w = L.SlotWords(memoryview(buf), lay)
    assert w.u64[w.generation[1]] == 77
    w.u32[w.state[2]] = L.S_POSTED
    assert list(seg.slots["state"]) == [0, 0, L.S_POSTED]
    seg.stats[0]["lat_count"] = 9
    assert w.u64[w.lat_count[0]] == 9
    seg.slot[0].hist[L.L_UPSERT, 3] = 4  # one row of buckets per LatencyOp
    off = lay.stats_base(0) + L.HIST_OFFSET + 8 * (L.L_UPSERT * L.HIST_BUCKETS + 3)
    assert np.frombuffer(buf, np.uint64, 1, off)[0] == 4
    seg.stats[1]["timeout_count"][L.L_GET] = 6  # per-op counters: arrays indexed by LatencyOp
    off = L.slot_field_offset(lay, 1, "timeout_count") + 8 * L.L_GET
    assert np.frombuffer(buf, np.uint64, 1, off)[0] == 6
    seg.slot[2].ring[5] = L.L_DELETE << L.RING_OP_SHIFT | L.RING_NS_MAX  # u64 entries: op | ns
    off = lay.stats_base(2) + L.RING_OFFSET + 8 * 5
    assert np.frombuffer(buf, np.uint64, 1, off)[0] >> np.uint64(56) == L.L_DELETE
    w.release()
    del seg


def test_c_header_matches_and_compiles(tmp_path):
    text = L.c_header()
    defs = dict(re.findall(r"#define (\w+) (\S+)", text))
    for name, _t, off in L.SLOT_FIELDS:
        assert int(defs[f"KALOS_SLOT_{name.upper()}"]) == off
    for name, _t, off in L.HEADER_FIELDS:
        assert int(defs[f"KALOS_HDR_{name.upper()}"]) == off
    for name, _t, off in L.STATS_FIELDS:
        assert int(defs[f"KALOS_STATS_{name.upper()}"]) == off
    for name, _t, off in L.HIT_META_FIELDS:
        assert int(defs[f"KALOS_HIT_META_{name.upper()}"]) == off
    assert int(defs["KALOS_HIT_META_BYTES"]) == L.HIT_META_BYTES == L.hit_meta_dtype().itemsize
    for f in L.Flag:
        assert int(defs[f"KALOS_FLAG_{f.name}"]) == f
    for op in L.LatencyOp:
        assert int(defs[f"KALOS_LATENCYOP_{op.name}"]) == op
    for name in (
        "HIST_OFFSET",
        "HIST_BUCKETS",
        "RING_OFFSET",
        "RING_LEN",
        "RING_OP_SHIFT",
        "LATENCY_OPS",
        "STATS_BYTES",
    ):
        assert int(defs[f"KALOS_{name}"].rstrip("UL"), 0) == getattr(L, name), name
    assert int(defs["KALOS_RING_NS_MAX"].rstrip("UL"), 0) == L.RING_NS_MAX
    assert int(defs["KALOS_PROTOCOL_VERSION"]) == L.PROTOCOL_VERSION
    # The committed copy for other languages is the generated one.
    import pathlib

    committed = pathlib.Path(__file__).parents[2] / "broker" / "kalos_protocol.h"
    assert committed.read_text() == text, "broker/kalos_protocol.h is stale: make protocol-header"
    c = tmp_path / "t.c"
    c.write_text(f'#include "{committed}"\nint main(void){{return KALOS_SLOT_STATE;}}\n')
    try:
        r = subprocess.run(["cc", str(c), "-o", str(tmp_path / "t")], capture_output=True)
    except FileNotFoundError:
        pytest.skip("no C compiler")
    assert r.returncode == 0, r.stderr.decode()


def test_latency_op_keeps_recalls_apart_from_bulk_and_admin_calls():
    assert L.latency_op(L.Op.RECALL, True) == L.LatencyOp.RECALL
    assert L.latency_op(L.Op.RECALL, False) == L.LatencyOp.RECALL_MANY
    assert L.latency_op(L.Op.UPSERT, False) == L.LatencyOp.UPSERT
    assert L.latency_op(L.Op.DELETE, False) == L.LatencyOp.DELETE
    assert L.latency_op(L.Op.GET, False) == L.LatencyOp.GET
    for op in (L.Op.COUNT, L.Op.EXPORT, L.Op.LIST_NAMESPACES, L.Op.DROP_NAMESPACE, 0, 99, -1):
        assert L.latency_op(op, False) == L.LatencyOp.OTHER
    assert {L.latency_op(op, single) for op in L.Op for single in (True, False)} == set(L.LatencyOp)


def test_layout_rejects_bad_geometry():
    from kalos.broker.errors import ConfigError

    for kw in (dict(n_slots=0), dict(dim=0), dict(max_k=0), dict(max_queries=0), dict(blob_bytes=10)):
        args = dict(n_slots=1, dim=1, max_k=1, max_queries=1, blob_bytes=1024) | kw
        with pytest.raises(ConfigError):
            L.Layout(**args).check()
    with pytest.raises(ConfigError):
        names.validate_broker_name("../etc")


def test_decode_namespace_rejects_garbage():
    assert names.decode_namespace(b"user-7", 6) == "user-7"
    assert names.decode_namespace(b"user-7", 0) is None
    assert names.decode_namespace(b"\xff\xfe", 2) is None
    assert names.decode_namespace(b"a b", 3) is None
    assert names.decode_namespace(b"x" * 64, 65) is None
