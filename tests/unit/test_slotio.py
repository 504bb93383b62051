"""The sidecar's slot byte work, compiled (``_cserve``) against its Python twin (``PySlotIO``): on
two segments in process memory (bytearrays laid out by ``broker.layout``) that start with the same
bytes, random batches taken, gathered, answered and published by each must leave the same bytes,
return the same values and post the same semaphores (real named ones), whatever the clients wrote
into the control blocks; indices out of range are refused by both and write nothing."""

from __future__ import annotations

import itertools
import os

import numpy as np
import posix_ipc
import pytest

from kalos.broker.layout import (
    CONTROL_BYTES,
    S_BUSY,
    S_DONE,
    S_POSTED,
    SLOT_FIELDS,
    Layout,
    SegmentView,
    SlotState,
    SlotWords,
    slot_dtype,
)
from kalos.broker.slotpath import REQUIRE_ENV, Choice, SlotPath
from kalos.sidecar_cuda.serving.slotio import SlotIO, layout_problems, load_compiled, open_slot_io

pytestmark = pytest.mark.timeout(60)

LAYOUT = Layout(n_slots=24, dim=8, max_k=6, max_queries=3, blob_bytes=1024)
_names = itertools.count()
T_DONE = dict((name, off) for name, _t, off in SLOT_FIELDS)["t_done_ns"]


@pytest.fixture(scope="module")
def cserve():
    try:
        return load_compiled()
    except ImportError as e:
        if os.environ.get(REQUIRE_ENV, "") not in ("", "0"):
            pytest.fail(f"{REQUIRE_ENV}=1 but the extension does not load: {e}")
        pytest.skip(f"the compiled slot path is not built: {e}")


class World:
    """One segment in process memory with its own named semaphores and one SlotIO over it."""

    def __init__(self, path: SlotPath, module: object, init: bytes, full_resp: frozenset[int] = frozenset()) -> None:
        self.buf = bytearray(init)
        self.seg = SegmentView(memoryview(self.buf), LAYOUT)
        self.words = SlotWords(memoryview(self.buf), LAYOUT)
        tag = f"/kalos-t{os.getpid()}-{next(_names)}"
        self.req = [posix_ipc.Semaphore(f"{tag}.{i}.req", posix_ipc.O_CREX) for i in range(LAYOUT.n_slots)]
        self.resp = [
            posix_ipc.Semaphore(
                f"{tag}.{i}.resp",
                posix_ipc.O_CREX,
                initial_value=posix_ipc.SEMAPHORE_VALUE_MAX if i in full_resp else 0,
            )
            for i in range(LAYOUT.n_slots)
        ]
        choice = Choice(path, module if path is SlotPath.COMPILED else None, "test")  # type: ignore[arg-type]
        self.io: SlotIO = open_slot_io(choice, self.seg, self.words, memoryview(self.buf), self.req, self.resp)
        # (what each world claims to run is what runs)
        assert type(self.io).__name__ == ("SlotIO" if path is SlotPath.COMPILED else "PySlotIO"), type(self.io)
        assert (type(self.io).__module__ == "kalos.sidecar_cuda.serving._cserve") == (path is SlotPath.COMPILED)

    def values(self) -> tuple[list[int], list[int]]:
        return [s.value for s in self.req], [s.value for s in self.resp]

    def close(self) -> None:
        self.io.close()
        self.words.release()
        for s in self.req + self.resp:
            s.unlink()
            s.close()


@pytest.fixture
def worlds(cserve):
    made: list[World] = []

    def make(init: bytes, full_resp: frozenset[int] = frozenset()) -> tuple[World, World]:
        pair = (World(SlotPath.COMPILED, cserve, init, full_resp), World(SlotPath.PYTHON, None, init, full_resp))
        made.extend(pair)
        return pair

    yield make
    for w in made:
        w.close()


def hostile_segment(rng: np.random.Generator) -> tuple[bytes, list[int]]:
    """A segment whose control blocks and data areas are random bytes, in every slot state (and
    garbage ones), and the slots whose request semaphore to post (most POSTED ones)."""
    buf = bytearray(rng.bytes(LAYOUT.total_bytes))
    seg = SegmentView(memoryview(buf), LAYOUT)
    states = [int(s) for s in SlotState] + [S_POSTED] * 4 + [5, 2**32 - 1]
    seg.slots["state"] = rng.choice(states, LAYOUT.n_slots)
    seg.slots["k"][: LAYOUT.n_slots // 2] = rng.choice([0, 1, 3, LAYOUT.max_k, 2**31, 2**32 - 1], LAYOUT.n_slots // 2)
    posted = np.flatnonzero(seg.slots["state"] == S_POSTED).tolist()
    to_post = [i for i in posted if rng.random() < 0.8]  # the others are "between POSTED and the post"
    out = bytes(buf)
    del seg
    return out, to_post


def same(a: World, b: World, what: str) -> None:
    assert a.buf == b.buf, f"the segments differ after {what}"
    assert a.values() == b.values(), f"the semaphores differ after {what}"


def both(a: World, b: World, call: str, *args: object) -> tuple[object, object]:
    """Call one method on each world with copies of the array arguments."""
    ra = getattr(a.io, call)(*(x.copy() if isinstance(x, np.ndarray) else x for x in args))
    rb = getattr(b.io, call)(*(x.copy() if isinstance(x, np.ndarray) else x for x in args))
    return ra, rb


def results(rng: np.random.Generator, m: int, kk: int) -> tuple[np.ndarray, np.ndarray]:
    ids = rng.integers(-(2**63), 2**63 - 1, (m, kk), dtype=np.int64)
    scores = rng.standard_normal((m, kk)).astype(np.float32)
    return ids, scores


def published(a: World, b: World, sel: list[int], ta: int, tb: int) -> None:
    """Each delivered slot carries its world's t_done; then the worlds must be equal with it put
    aside (two clocks read at two moments)."""
    for w, t in ((a, ta), (b, tb)):
        assert all(int(w.seg.slots["t_done_ns"][i]) == t for i in sel)
        for i in sel:
            off = LAYOUT.control_base(i) + T_DONE
            w.buf[off : off + 8] = bytes(8)


@pytest.mark.parametrize("round_", range(6))
def test_both_paths_write_the_same_bytes_for_random_batches(worlds, seed, round_):
    rng = np.random.default_rng(seed + round_)
    init, to_post = hostile_segment(rng)
    a, b = worlds(init)
    for w in (a, b):
        for i in to_post:
            w.req[i].release()
    # scan, then take: the same slots, the same semaphores consumed
    out_a, out_b = np.full(LAYOUT.n_slots, -1, np.intp), np.full(LAYOUT.n_slots, -1, np.intp)
    na, nb = a.io.scan(out_a), b.io.scan(out_b)
    assert na == nb and out_a[:na].tolist() == out_b[:nb].tolist()
    posted = out_a[:na].tolist()
    assert posted == np.flatnonzero(a.seg.slots["state"] == S_POSTED).tolist()
    ma, mb = a.io.take(out_a, na), b.io.take(out_b, nb)
    assert ma == mb and out_a[:ma].tolist() == out_b[:mb].tolist() == [i for i in posted if i in to_post]
    same(a, b, "take")
    assert a.values()[0] == [0] * LAYOUT.n_slots  # every post consumed
    # snapshot: BUSY, t_pick, and the control blocks as they were written
    sel = out_a[:ma].copy()
    before = SegmentView(memoryview(bytearray(a.buf)), LAYOUT).slots[sel]
    rec_a, rec_b = np.empty(len(sel), slot_dtype()), np.empty(len(sel), slot_dtype())
    t_pick = int(rng.integers(2**64, dtype=np.uint64))
    a.io.snapshot(sel, t_pick, rec_a)
    b.io.snapshot(sel, t_pick, rec_b)
    same(a, b, "snapshot")
    for field in slot_dtype().names or ():  # (the padding between fields is no one's)
        assert rec_a[field].tobytes() == rec_b[field].tobytes(), field
    assert (rec_a["state"] == S_BUSY).all() and (rec_a["t_pick_ns"] == t_pick).all()
    assert (rec_a["generation"] == before["generation"]).all() and (rec_a["k"] == before["k"]).all()
    # gather: row 0 of each, then random rows
    q_a, q_b = np.empty((len(sel), LAYOUT.dim), np.float32), np.empty((len(sel), LAYOUT.dim), np.float32)
    a.io.gather(sel, None, q_a)
    b.io.gather(sel, None, q_b)
    assert q_a.tobytes() == q_b.tobytes() == a.seg.all_queries[sel, 0].tobytes()
    slots = rng.integers(0, LAYOUT.n_slots, 40).astype(np.intp)
    rows = rng.integers(0, LAYOUT.max_queries, 40).astype(np.intp)
    g_a, g_b = np.empty((40, LAYOUT.dim), np.float32), np.empty((40, LAYOUT.dim), np.float32)
    a.io.gather(slots, rows, g_a)
    b.io.gather(slots, rows, g_b)
    assert g_a.tobytes() == g_b.tobytes() == a.seg.all_queries[slots, rows].tobytes()
    same(a, b, "gather")
    # answers of the batch: one row each, or several rows per slot (a recall_many batch)
    kk = int(rng.integers(0, LAYOUT.max_k + 1))
    if rng.random() < 0.5 or len(sel) == 0:
        ids, scores = results(rng, len(sel), kk)
        both(a, b, "answer_recalls", sel, rec_a, ids, scores, None, None)
        written = [(int(s), 0, j) for j, s in enumerate(sel)]
    else:
        nq = rng.integers(1, LAYOUT.max_queries + 1, len(sel))
        rs = np.repeat(sel, nq)
        rr = np.concatenate([np.arange(n) for n in nq]).astype(np.intp)
        ids, scores = results(rng, len(rs), kk)
        both(a, b, "answer_recalls", sel, rec_a, ids, scores, rs, rr)
        written = [(int(s), int(r), j) for j, (s, r) in enumerate(zip(rs, rr))]
    same(a, b, "answer_recalls")
    for s, r, j in written:
        assert a.seg.all_result_ids[s, r, :kk].tolist() == ids[j].tolist()
        assert a.seg.all_result_scores[s, r, :kk].tobytes() == scores[j].tobytes()
    assert (a.seg.slots["n_results"][sel] == np.minimum(rec_a["k"], kk)).all()
    assert (a.seg.slots["resp_generation"][sel] == rec_a["generation"]).all()
    assert (a.seg.slots["status"][sel] == 0).all() and (a.seg.slots["blob_len"][sel] == 0).all()
    # publish: stamps, DONE, one post each
    ta, tb = both(a, b, "deliver", sel)
    assert a.values()[1] == [int(i in sel.tolist()) for i in range(LAYOUT.n_slots)]
    assert (a.seg.slots["state"][sel] == S_DONE).all() and (a.seg.slots["batch_size"][sel] == len(sel)).all()
    published(a, b, sel.tolist(), ta, tb)  # type: ignore[arg-type]
    same(a, b, "deliver")
    # the SINGLE route's answer, on a slot in whatever state
    i = int(rng.integers(LAYOUT.n_slots))
    kk = int(rng.integers(0, LAYOUT.max_k + 1))
    ids, scores = results(rng, 1, kk)
    generation = int(a.seg.slots["generation"][i])
    ta, tb = both(a, b, "answer_single", i, ids, scores)
    assert int(a.seg.slots["resp_generation"][i]) == generation and int(a.seg.slots["n_results"][i]) == kk
    assert int(a.seg.slots["batch_size"][i]) == 1 and int(a.seg.slots["state"][i]) == S_DONE
    published(a, b, [i], ta, tb)  # type: ignore[arg-type]
    same(a, b, "answer_single")


def test_indices_out_of_range_are_refused_and_write_nothing(worlds, rng):
    init, _ = hostile_segment(rng)
    a, b = worlds(init)
    n, mq = LAYOUT.n_slots, LAYOUT.max_queries
    ok = np.array([0, 1], np.intp)
    ids, scores = results(rng, 2, 3)
    for bad in ([0, n], [-1, 2], [2**62, 0], [0, -(2**63)]):
        sel = np.array(bad, np.intp)
        rec = np.zeros(2, slot_dtype())
        calls = [
            ("take", sel, 2),
            ("snapshot", sel, 5, rec),
            ("gather", sel, None, np.empty((2, LAYOUT.dim), np.float32)),
            ("gather", ok, np.array([0, mq if bad[1] >= 0 else -1], np.intp), np.empty((2, LAYOUT.dim), np.float32)),
            ("answer_recalls", sel, rec, ids, scores, None, None),
            ("answer_recalls", ok, rec, ids, scores, sel, ok),
            ("answer_recalls", ok, rec, ids, scores, ok, np.array([mq, 0], np.intp)),
            ("deliver", sel),
            ("answer_single", bad[1] if bad[1] < 0 or bad[1] >= n else n, ids[:1], scores[:1]),
        ]
        for call, *args in calls:
            for w in (a, b):
                with pytest.raises(ValueError, match="index"):
                    getattr(w.io, call)(*args)
            same(a, b, f"a refused {call}")
    assert a.buf == init and a.values() == ([0] * n, [0] * n)


def test_inconsistent_arguments_are_refused_by_both(worlds, rng):
    init, _ = hostile_segment(rng)
    a, b = worlds(init)
    sel = np.array([3, 4], np.intp)
    rec = np.zeros(2, slot_dtype())
    ids, scores = results(rng, 2, LAYOUT.max_k + 1)  # kk beyond max_k
    calls = [
        ("take", sel, 3),  # n > len(idx)
        ("take", sel, -1),
        ("snapshot", sel, 1, np.zeros(3, slot_dtype())),  # a record per slot
        ("gather", sel, None, np.empty((3, LAYOUT.dim), np.float32)),
        ("gather", sel, np.zeros(1, np.intp), np.empty((2, LAYOUT.dim), np.float32)),
        ("answer_recalls", sel, rec, ids, scores, None, None),
        ("answer_recalls", sel, rec, ids[:, :2].copy(), scores[:, :3].copy(), None, None),
        ("answer_recalls", sel, rec, ids[:1, :2].copy(), scores[:1, :2].copy(), None, None),  # one query, two slots
        ("answer_recalls", sel, np.zeros(1, slot_dtype()), ids[:, :2].copy(), scores[:, :2].copy(), None, None),
        ("answer_single", 3, ids[:, :2].copy(), scores[:, :2].copy()),  # (1, kk) only
        ("answer_single", 3, ids[:1], scores[:1]),
        ("scan", np.empty(LAYOUT.n_slots - 1, np.intp)),
    ]
    for call, *args in calls:
        for w in (a, b):
            with pytest.raises(ValueError):
                getattr(w.io, call)(*args)
        same(a, b, f"a refused {call}")
    assert a.buf == init


def test_a_failed_post_does_not_keep_the_others_of_the_batch_unposted(worlds, rng):
    """A client can post its own response semaphore up to the limit: the sidecar's post of that
    slot then fails (EOVERFLOW). Every other slot of the batch is still published and posted;
    the failure is raised after."""
    init, _ = hostile_segment(rng)
    full = 5
    a, b = worlds(init, frozenset({full}))
    sel = np.array([2, full, 9], np.intp)
    for w in (a, b):
        with pytest.raises(OSError) as e:
            w.io.deliver(sel.copy())
        assert e.value.errno == 75  # EOVERFLOW
        _req, resp = w.values()
        assert resp[2] == 1 and resp[9] == 1 and resp[full] == posix_ipc.SEMAPHORE_VALUE_MAX
        assert (w.seg.slots["state"][sel] == S_DONE).all()
    for w in (a, b):
        with pytest.raises(OSError):
            w.io.answer_single(full, np.zeros((1, 1), np.int64), np.zeros((1, 1), np.float32))


def test_a_closed_slot_io_refuses_every_call(worlds, rng):
    init, _ = hostile_segment(rng)
    for w in worlds(init):
        w.io.close()
        w.io.close()  # twice is fine
        with pytest.raises(ValueError, match="closed"):
            w.io.scan(np.empty(LAYOUT.n_slots, np.intp))
        with pytest.raises(ValueError, match="closed"):
            w.io.deliver(np.array([1], np.intp))
        assert w.values()[1] == [0] * LAYOUT.n_slots


def test_the_compiled_layout_is_the_layouts(cserve):
    """The control-block offsets and widths, states and status the extension was compiled with
    (from broker/kalos_protocol.h) are broker.layout's; a build from another layout is refused
    at load (the check can fail: a changed value is reported)."""
    compiled = cserve.SlotIO.layout()
    assert layout_problems(compiled) == []
    assert {"state", "generation", "k", "t_done_ns", "KALOS_CONTROL_BYTES"} <= set(compiled)
    assert compiled["KALOS_CONTROL_BYTES"] == CONTROL_BYTES
    moved = {**compiled, "k": (compiled["k"][0] + 4, 4), "KALOS_SLOTSTATE_DONE": 9}
    assert len(layout_problems(moved)) == 2
    assert layout_problems({**compiled, "generation": (8, 4)}) == ["generation: compiled (8, 4), layout (8, 8)"]


def test_the_compiled_object_checks_its_geometry(cserve):
    """A geometry that does not fit the buffer it is given is refused before any byte is
    touched (the sidecar passes broker.layout's; nothing else should)."""
    buf = bytearray(LAYOUT.total_bytes)
    L = LAYOUT
    good = dict(
        n_slots=L.n_slots,
        dim=L.dim,
        max_k=L.max_k,
        max_queries=L.max_queries,
        control_offset=L.control_offset,
        data_offset=L.data_offset,
        slot_bytes=L.slot_bytes,
        query_offset=L.query_offset,
        result_ids_offset=L.result_ids_offset,
        result_scores_offset=L.result_scores_offset,
        req_names=[],
        resp_names=[],
    )
    for change in (
        {"n_slots": L.n_slots + 1},
        {"data_offset": L.data_offset + 8},
        {"slot_bytes": L.slot_bytes * 2},
        {"max_k": L.max_k * 64},
        {"dim": 0},
        {"result_ids_offset": L.slot_bytes},
        {"control_offset": 2**63},
    ):
        with pytest.raises(ValueError, match="geometry"):
            cserve.SlotIO(buf, **{**good, **change})
    with pytest.raises(ValueError, match="names"):  # the semaphores: one per slot each
        cserve.SlotIO(buf, **good)
    with pytest.raises(OSError):
        cserve.SlotIO(
            buf,
            **{**good, "req_names": [f"/kalos-none-{os.getpid()}.{i}" for i in range(L.n_slots)], "resp_names": []},
        )
    with pytest.raises(BufferError):
        cserve.SlotIO(bytes(L.total_bytes), **good)  # read-only


def test_both_paths_map_a_mixed_searchs_rows_to_ids_alike_and_refuse_alike(worlds, rng):
    """``map_ids``: each query's rows through its own namespace's ids (-1 where no hit), the same
    on both paths against a plain reference; a row past its table, or arguments that do not fit,
    refused by both (ValueError) with nothing written past the refusal's query."""
    init, _ = hostile_segment(rng)
    a, b = worlds(init)
    for _ in range(20):
        q, k = int(rng.integers(1, 40)), int(rng.integers(1, 12))
        tables = [rng.integers(-(2**62), 2**62, int(rng.integers(1, 50))) for _ in range(q)]
        rows = np.stack([rng.integers(-1, len(t), k) for t in tables]).astype(np.int64)
        want = np.array([[t[r] if r >= 0 else -1 for r in row] for t, row in zip(tables, rows)], np.int64)
        for w in (a, b):
            out = np.zeros((q, k), np.int64)
            w.io.map_ids(tables, rows, out)
            np.testing.assert_array_equal(out, want)
    tables = [np.arange(5, dtype=np.int64), np.arange(3, dtype=np.int64)]
    bad = [
        (tables, np.array([[0, 1], [2, 3]], np.int64), np.zeros((2, 2), np.int64)),  # row 3 of a 3-row table
        (tables[:1], np.zeros((2, 2), np.int64), np.zeros((2, 2), np.int64)),  # a table short
        (tables, np.zeros((2, 2), np.int64), np.zeros((2, 3), np.int64)),  # out not shaped as rows
    ]
    for args in bad:
        for w in (a, b):
            with pytest.raises(ValueError):
                w.io.map_ids(*args)
    same(a, b, "map_ids")
    assert a.buf == init
