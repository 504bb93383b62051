"""The CUDA backend's buffers: growable device and pinned-host byte buffers, and the set of them
one search writes (two sets: the sidecar's pipeline enqueues a second search behind the first)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .planner import next_pow2


class Buffer:
    """A growable device or pinned-host buffer of raw bytes."""

    def __init__(self, cp: Any, pinned: bool, stream: Any = None) -> None:
        self._cp = cp
        self.pinned = pinned
        self._stream = stream
        self.nbytes = 0
        self.mem: Any = None
        self.ptr = 0
        self._views: dict[tuple[Any, int], np.ndarray] = {}

    def ensure(self, nbytes: int) -> bool:
        """Make room for ``nbytes``; True if the buffer moved (graphs that use it are stale).
        Only called while no pending search uses this buffer (its set is being enqueued), so
        the old one is free to go (CuPy's pool reuses it in stream order)."""
        if nbytes <= self.nbytes:
            return False
        size = next_pow2(max(nbytes, 4096))
        if self.pinned:
            self.mem = self._cp.cuda.alloc_pinned_memory(size)
            np.frombuffer(self.mem, np.uint8, size)[:] = 0
        else:
            with self._stream:
                self.mem = self._cp.cuda.alloc(size)
                self.mem.memset_async(0, size, self._stream)
        self.ptr = int(self.mem.ptr)
        self.nbytes = size
        self._views.clear()
        return True

    def view(self, dtype: Any, count: int, offset: int = 0) -> np.ndarray:
        """The first ``count`` items of type ``dtype`` from byte ``offset`` (pinned buffers)."""
        key = (dtype, offset)
        v = self._views.get(key)
        if v is None:
            itemsize = np.dtype(dtype).itemsize
            v = self._views[key] = np.frombuffer(self.mem, dtype, (self.nbytes - offset) // itemsize, offset)
        return v[:count]


class BufferSet:
    """Everything one search writes: two sets let a second search be enqueued behind the first
    (the sidecar's pipeline) without touching the buffers the first is still using."""

    def __init__(self, cp: Any, stream: Any, index: int) -> None:
        self.index = index
        self.epoch = 0  # bumped when a buffer moves: graphs that captured the old one are stale
        self.h_req = Buffer(cp, pinned=True)  # request header + float32 queries
        self.d_req = Buffer(cp, pinned=False, stream=stream)
        self.h_out = Buffer(cp, pinned=True)  # rows, scores (and half-path flags) of the answer
        self.d_cand = Buffer(cp, pinned=False, stream=stream)
        self.d_counters = Buffer(cp, pinned=False, stream=stream)
        self.d_q = Buffer(cp, pinned=False, stream=stream)  # GEMM paths: queries as stored, |q|^2
        self.d_scores = Buffer(cp, pinned=False, stream=stream)
        self.d_top = Buffer(cp, pinned=False, stream=stream)  # half path: 32 candidates a query
        self.done = cp.cuda.Event(block=False, disable_timing=True)
        self.busy = False  # a search using these buffers has not been collected yet
        self.seq = 0  # which search (Device.seq) last used them

    def make_room(self, buf: Buffer, nbytes: int) -> None:
        """``buf`` (one of this set's) holds at least ``nbytes``; graphs that captured it before
        it moved are stale (the epoch is part of their key: never replayed, aged out)."""
        if buf.ensure(nbytes):
            self.epoch += 1
