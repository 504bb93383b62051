"""The one writer of answers (``sidecar_cuda.serving.answers``), alone, on a segment in process memory:
when a slot's response semaphore is posted, its answer, stamps and DONE state are all written.
The fake semaphores record what a client woken by the post would read at that moment."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from kalos.broker.layout import S_BUSY, S_DONE, Layout, SegmentView, SlotWords, Status
from kalos.sidecar_cuda.serving.answers import AnswerWriter
from kalos.sidecar_cuda.serving.slotio import PySlotIO

LAYOUT = Layout(n_slots=6, dim=8, max_k=4, max_queries=2, blob_bytes=256)

pytestmark = pytest.mark.timeout(30)


class RecordingSem:
    """A response semaphore that copies the slot as a client would read it when woken."""

    def __init__(self, seg: SegmentView, slot: int, log: list[tuple[int, dict[str, object]]]) -> None:
        self.seg, self.slot, self.log = seg, slot, log

    def release(self) -> None:
        ctl = self.seg.slots[self.slot]
        sv = self.seg.slot[self.slot]
        n = int(ctl["n_results"])
        self.log.append(
            (
                self.slot,
                {
                    "state": int(ctl["state"]),
                    "status": int(ctl["status"]),
                    "n_results": n,
                    "resp_generation": int(ctl["resp_generation"]),
                    "batch_size": int(ctl["batch_size"]),
                    "t_done_ns": int(ctl["t_done_ns"]),
                    "blob": sv.blob[: int(ctl["blob_len"])].tobytes(),
                    "ids": sv.result_ids[0, :n].copy(),
                    "scores": sv.result_scores[0, :n].copy(),
                },
            )
        )


@pytest.fixture
def world():
    buf = bytearray(LAYOUT.total_bytes)
    seg = SegmentView(memoryview(buf), LAYOUT)
    words = SlotWords(memoryview(buf), LAYOUT)
    posts: list[tuple[int, dict[str, object]]] = []
    errors: list[int] = []
    sems = [RecordingSem(seg, i, posts) for i in range(LAYOUT.n_slots)]
    writer = AnswerWriter(seg, words, PySlotIO(seg, words, [], sems), errors.append)
    seg.slots["state"] = S_BUSY  # every slot taken into a batch
    seg.slots["generation"] = np.arange(LAYOUT.n_slots) + 100
    yield seg, writer, posts, errors
    words.release()


def test_an_error_answer_is_complete_when_posted(world):
    seg, writer, posts, errors = world
    t0 = time.monotonic_ns()
    writer.answer(2, 102, Status.K_OUT_OF_RANGE, "k=0 outside 1..4")
    assert posts == [] and int(seg.slots["state"][2]) == S_BUSY  # written, not yet published
    writer.deliver(np.array([2], np.intp))
    [(slot, seen)] = posts
    assert slot == 2 and seen["state"] == S_DONE and seen["status"] == Status.K_OUT_OF_RANGE
    assert seen["resp_generation"] == 102 and seen["blob"] == b"k=0 outside 1..4"
    assert seen["batch_size"] == 1 and seen["t_done_ns"] >= t0
    assert errors == [Status.K_OUT_OF_RANGE]


def test_a_batch_is_published_only_once_every_answer_is_written(world):
    seg, writer, posts, errors = world
    slots = [0, 3, 5]
    writer.hits(0, np.array([[7, 8]]), np.array([[0.9, 0.5]], np.float32))
    writer.answer(0, 100, Status.OK, n_results=2)
    writer.answer_blob(3, 103, 1, b'{"a":1}')
    writer.answer(5, 105, Status.NOT_FINITE, "query contains NaN or infinity")
    assert posts == []
    writer.deliver(np.asarray(slots, np.intp))
    assert [s for s, _ in posts] == slots
    for slot, seen in posts:
        assert seen["state"] == S_DONE and seen["batch_size"] == 3
        assert seen["resp_generation"] == 100 + slot
    assert posts[0][1]["ids"].tolist() == [7, 8] and posts[0][1]["status"] == Status.OK
    assert posts[1][1]["blob"] == b'{"a":1}' and posts[1][1]["n_results"] == 1
    assert posts[2][1]["status"] == Status.NOT_FINITE
    assert errors == [Status.NOT_FINITE]
    assert int(seg.slots["state"][1]) == S_BUSY  # untouched


def test_a_uniform_batch_answer_is_complete_when_posted(world):
    seg, writer, posts, _errors = world
    sel = np.array([1, 4], np.intp)
    rec = seg.slots[sel]
    rec["k"] = [1, 4]  # as read when taken: n_results = min(k, hits)
    ids = np.array([[11, 12, 13], [21, 22, 23]])
    scores = np.array([[3, 2, 1], [6, 5, 4]], np.float32)
    writer.answer_recalls(sel, rec, ids, scores)
    writer.deliver(sel)
    (s1, a), (s4, b) = posts
    assert (s1, s4) == (1, 4)
    assert a["state"] == b["state"] == S_DONE and a["status"] == b["status"] == Status.OK
    assert a["n_results"] == 1 and a["ids"].tolist() == [11] and a["resp_generation"] == 101
    assert b["n_results"] == 3 and b["ids"].tolist() == [21, 22, 23]
    assert b["scores"].tolist() == [6, 5, 4] and b["resp_generation"] == 104


def test_the_single_route_answer_is_complete_when_posted(world):
    _seg, writer, posts, errors = world
    t_done = writer.answer_single(3, np.array([[5, 6, 7]]), np.array([[1.5, 1.0, 0.5]], np.float32))
    [(slot, seen)] = posts
    assert slot == 3 and seen["state"] == S_DONE and seen["status"] == Status.OK
    assert seen["n_results"] == 3 and seen["ids"].tolist() == [5, 6, 7]
    assert seen["resp_generation"] == 103 and seen["batch_size"] == 1 and seen["t_done_ns"] == t_done
    assert seen["blob"] == b"" and errors == []


def test_a_long_detail_is_cut_to_the_blob_area(world):
    _seg, writer, posts, _errors = world
    writer.answer(0, 100, Status.BACKEND_ERROR, "x" * 1000 + os.urandom(4).hex())
    writer.deliver(np.array([0], np.intp))
    assert posts[0][1]["blob"] == b"x" * LAYOUT.blob_bytes
