"""The sidecar: sleeps on the doorbell, gathers every posted slot into one batch, serves it with one
backend call per namespace, writes results and posts each slot's response semaphore.

Uniform recall batches (the common case under load) are pipelined: a batch is started on the
device and the loop goes on; while it runs, the callers answered by the batch before it re-post and
are started as the next batch, queued right behind it. At most two batches are in flight; anything
else (writes, payloads, several namespaces, bad slots) first finishes what is in flight, so a
write never moves rows under a search and answers leave in order."""

from __future__ import annotations

import fcntl
import gc
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import posix_ipc

from broker.errors import ConfigError
from broker.layout import (
    HEARTBEAT_S, OWNER_ABANDONED, S_BUSY, S_DONE, S_FREE, S_POSTED, Flag,
    Op,
    NAMESPACE_BYTES, SegmentView, SidecarState, SlotWords, Status,
    header_field_offset, slot_field_offset,
)
from broker.names import decode_namespace, validate_broker_name
from broker.procs import pid_alive
from broker.validation import payload_problem
import sidecar_cuda.objects as objects
from sidecar_cuda.backends.base import Backend, PendingSearch
from sidecar_cuda.config import ServeConfig  # defined there; still importable from here
from sidecar_cuda.persist import Persistence, StoreError, Write
from sidecar_cuda.planning import (
    Rejection, Request, SlotFields, pack_offsets, parse_request, plan_batch, posted_slots,
)
from sidecar_cuda.backends.select import choose_backend
from sidecar_cuda.stats import BatchRecord, SidecarStats
from sidecar_cuda.store import MemoryStore, Namespace

log = logging.getLogger("kalos.sidecar")
REAP_S = 0.25
_RECALL, _OK = int(Op.RECALL), int(Status.OK)  # plain ints for numpy comparisons
PIPELINE_DEPTH = 2  # uniform recall batches in flight at most (a backend holds two searches)
# --pipeline auto pipelines a batch of at least this many multiply-adds (rows x queries x dim).
# Measured on the H200 (bench/results/README.md): pipelining raised 256 tasks at 1M x 768 from
# ~100-110k to 116-141k recalls/s, but lowered 256 x 128 (339k -> 238k/s) and 100k x 768
# (237k -> 208k/s), where the host, not the device, bounds a batch.
PIPELINE_MIN_WORK = 1 << 34
_POLL_SLEEP_AFTER_NS = 2_000_000  # a batch in flight this long: poll every 50 us, not flat out
# ... and this long: wait for it in result(), where the backend's timeout applies (a hung device
# then becomes BACKEND_ERROR answers instead of a loop polling forever).
_BLOCK_AFTER_NS = 500_000_000


@dataclass(slots=True)
class InFlight:
    """A uniform recall batch started on the backend, not yet answered."""

    sel: np.ndarray  # its slots
    rec: np.ndarray  # their control blocks as read when the batch was taken
    taken: list[int]
    t_pick: int  # CLOCK_MONOTONIC when taken
    t0: int  # perf_counter_ns when started
    staging: int  # which staging buffer holds its queries
    pending: PendingSearch
    work: int  # rows x queries x dim


def pipelined(work: int, min_work: int) -> bool:
    """Leave a started batch in flight (and take the next one meanwhile)? ``min_work`` < 0: never."""
    return 0 <= min_work <= work


class Sidecar:
    def __init__(self, cfg: ServeConfig, backend: Backend | None = None) -> None:
        validate_broker_name(cfg.name)
        self.cfg = cfg
        self.layout = cfg.layout()
        self.metric = cfg.metric_enum()
        if cfg.pipeline not in ("auto", "on", "off"):
            raise ConfigError(f"--pipeline must be auto, on or off, got {cfg.pipeline!r}")
        if cfg.data_dir is not None and (cfg.random_rows or cfg.load_npy):
            raise ConfigError("--random-rows/--load only fill an --ephemeral sidecar; "
                              "use `kalos import` for a durable one")
        self.backend = backend or choose_backend(cfg.backend, storage_dtype=cfg.storage_dtype,
                                                 device=cfg.device)
        if cfg.max_k > self.backend.max_k:
            raise ConfigError(f"--max-k {cfg.max_k} exceeds the {self.backend.name} backend's "
                              f"limit of {self.backend.max_k}")
        self.store = MemoryStore(self.backend, cfg.dim, self.metric)
        self.persist: Persistence | None = None
        self.stats = SidecarStats(self.layout.n_slots)
        self._stop = threading.Event()
        self._objs: objects.Objects | None = None
        self.seg: SegmentView | None = None
        # Staging for gathered queries (pinned on CUDA): one per batch in flight.
        self._stagings = [self.backend.host_buffer((self.layout.n_slots * self.layout.max_queries,
                                                    self.layout.dim), np.float32)
                          for _ in range(PIPELINE_DEPTH)]
        self._staging = self._stagings[0]  # the synchronous paths' (nothing in flight then)
        self._inflight: deque[InFlight] = deque()
        self._heartbeat: threading.Thread | None = None
        self._last_error_log = 0.0
        self.ready = False

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Create the objects, load memory, then announce READY."""
        cfg = self.cfg
        self._objs = objects.create(cfg.name, self.layout)
        self.seg = SegmentView(memoryview(self._objs.mm), self.layout)
        self._words = SlotWords(memoryview(self._objs.mm), self.layout)
        self._states = self.seg.slots["state"]
        self._batches_word = header_field_offset("batches") // 8
        self._sleep_word = header_field_offset("sidecar_sleeping") // 4
        self._k_limit = min(self.layout.max_k, self.backend.max_k)
        self._gather_ns = int(self.cfg.gather_us * 1000)
        self._min_work = {"on": 0, "off": -1, "auto": PIPELINE_MIN_WORK}[self.cfg.pipeline]
        self._last_batch = 0
        self._last_service_ns = 0
        self._ns_names: dict[tuple[bytes, int], str] = {}
        self._ns_off = [slot_field_offset(self.layout, i, "namespace") for i in range(self.layout.n_slots)]
        self.seg.init_header(metric=self.metric, backend=self.backend.code, pid=os.getpid(),
                             start_epoch_ns=time.time_ns())
        self._beat()
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="kalos-heartbeat",
                                           daemon=True)
        self._heartbeat.start()
        try:
            self.store.get_or_create("default")
            if cfg.data_dir is not None:
                self.persist = Persistence(cfg.data_dir, cfg.dim, self.metric.name.lower())
                rows, secs = self.persist.load_into(self.store)
                log.info("loaded %d rows in %d namespaces from %s in %.2f s", rows,
                         len(self.store.namespaces), cfg.data_dir, secs)
            self._fill_initial()
        except BaseException:
            self.seg.header["state"] = SidecarState.FAILED
            self.close()
            raise
        # Everything allocated so far lives as long as the process: keep it out of the collector's
        # young generations so collections on the serving path stay short.
        gc.collect()
        gc.freeze()
        self.seg.header["state"] = SidecarState.READY
        self.ready = True
        log.info("kalos sidecar %r ready: backend %s, dim %d, %d slots, max_k %d, metric %s, %s",
                 cfg.name, self.backend.description, cfg.dim, cfg.slots, cfg.max_k,
                 self.metric.name.lower(), "ephemeral" if cfg.data_dir is None
                 else f"data in {cfg.data_dir}")

    def _fill_initial(self) -> None:
        cfg = self.cfg
        ns = self.store.get_or_create("default", capacity=max(cfg.random_rows, 1))
        if cfg.random_rows:
            rng = np.random.default_rng(cfg.seed)
            step = 65536
            for lo in range(0, cfg.random_rows, step):
                hi = min(cfg.random_rows, lo + step)
                ns.upsert(np.arange(lo, hi, dtype=np.int64),
                          rng.standard_normal((hi - lo, cfg.dim), dtype=np.float32), None)
        if cfg.load_npy:
            try:
                mat = np.load(cfg.load_npy, mmap_mode="r")
            except (OSError, ValueError) as e:
                raise ConfigError(f"cannot load {cfg.load_npy}: {e}") from None
            if mat.ndim != 2 or mat.shape[1] != cfg.dim:
                raise ConfigError(f"{cfg.load_npy} has shape {mat.shape}, need (n, {cfg.dim})")
            base = ns.n
            for lo in range(0, mat.shape[0], 65536):
                chunk = np.asarray(mat[lo:lo + 65536], np.float32)
                ns.upsert(np.arange(base + lo, base + lo + len(chunk), dtype=np.int64), chunk, None)

    def install_signal_handlers(self) -> None:
        def stop(signum: int, _frame: Any) -> None:
            log.info("signal %d: finishing in-flight work", signum)
            self.request_stop()

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)

    def request_stop(self) -> None:
        self._stop.set()
        if self._objs is not None:
            try:
                self._objs.bell.release()  # wake the loop
            except posix_ipc.Error:
                pass

    def close(self) -> None:
        """Mark the header STOPPED (clients then fail fast) and unlink every object."""
        if self._objs is None:
            return
        self._stop.set()
        if self.seg is not None and int(self.seg.header["state"]) != SidecarState.FAILED:
            self.seg.header["state"] = SidecarState.STOPPED
        objs, self._objs = self._objs, None
        objects.unlink(self.cfg.name, objs)
        if self.persist is not None:
            self.persist.close()
        self.backend.close()
        log.info("sidecar %r stopped; objects unlinked", self.cfg.name)

    def _beat(self) -> None:
        assert self.seg is not None
        self.seg.header["heartbeat_ns"] = time.monotonic_ns()

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._beat()
            except (ValueError, TypeError):  # segment unmapped during shutdown
                return

    # ------------------------------------------------------------------ main loop
    def serve_forever(self) -> None:
        """Serve until stopped. While requests keep coming the loop polls the slot states (clients
        then skip the doorbell); after ``spin_us`` without work it announces that it sleeps and
        blocks on the doorbell, so an idle sidecar costs no CPU."""
        assert self._objs is not None and self.seg is not None
        bell = self._objs.bell
        u32 = self._words.u32
        sleeping = self._sleep_word
        spin_ns = int(self.cfg.spin_us * 1000)
        clock = time.monotonic_ns
        reap_ns = int(REAP_S * 1e9)
        next_reap = clock() + reap_ns
        last_work = clock()
        try:
            while not self._stop.is_set():
                served = self.serve_guarded()
                now = clock()
                # On time, busy or not: under saturation the slots of dead clients are exactly
                # what the living ones wait for.
                if now >= next_reap:
                    self.reap_guarded()
                    next_reap = now + reap_ns
                if served or self._inflight:
                    last_work = now
                    if not served and self._inflight and \
                            last_work - self._inflight[0].t_pick > _POLL_SLEEP_AFTER_NS:
                        time.sleep(0.00005)  # a long batch on the device: poll gently
                    continue
                if now - last_work < spin_ns:
                    os.sched_yield()  # polite polling: a client on this core gets to run
                    continue
                u32[sleeping] = 1
                self._drain(bell)  # the try-wait is also the fence before the re-scan
                if not self.serve_guarded() and not self._inflight:
                    try:
                        bell.acquire(REAP_S)
                    except (posix_ipc.BusyError, posix_ipc.SignalError):
                        pass
                u32[sleeping] = 0
                last_work = clock()
            # Finish what was posted before the stop, then tell clients.
            self.seg.header["state"] = SidecarState.STOPPING
            self.serve_remaining()
        finally:
            self.close()

    def serve_remaining(self) -> int:
        """At stop: answer the batches in flight and every request posted before now."""
        served = self._finish_inflight()  # (first: serve_pending then takes every posted slot)
        served += self.serve_pending()
        return served + self._finish_inflight()

    @staticmethod
    def _drain(bell: posix_ipc.Semaphore) -> None:
        while True:
            try:
                bell.acquire(0)
            except posix_ipc.BusyError:
                return

    def serve_guarded(self) -> int:
        """:meth:`serve_pending`, but nothing a slot holds can end the loop: an unexpected error
        while serving is logged and every request it stranded gets SERVER_ERROR."""
        try:
            return self.serve_pending()
        except Exception as e:
            self._log_unexpected("serving a batch failed", e)
            return self._answer_stranded(e)

    def reap_guarded(self) -> int:
        try:
            return self.reap_dead_owners()
        except Exception as e:
            self._log_unexpected("reaping leases failed", e)
            return 0

    def _log_unexpected(self, what: str, e: BaseException) -> None:
        """Log an unexpected error with its traceback, at most once a second (a bad slot may make
        every pass fail)."""
        self.stats.internal_errors += 1
        now = time.monotonic()
        if now - self._last_error_log >= 1.0:
            self._last_error_log = now
            log.error("%s (%d unexpected errors so far): %s: %s", what, self.stats.internal_errors,
                      type(e).__name__, e, exc_info=e)

    def _inflight_slots(self) -> set[int]:
        return {i for b in self._inflight for i in b.taken}

    def _answer_stranded(self, e: BaseException) -> int:
        """Answer SERVER_ERROR to every slot taken into a batch (BUSY) that no batch in flight
        will answer. Between two passes of the loop those are exactly the requests an error
        left behind."""
        assert self._objs is not None and self.seg is not None
        slots = self.seg.slots
        busy = set(np.flatnonzero(slots["state"] == S_BUSY).tolist()) - self._inflight_slots()
        detail = f"the sidecar failed serving this request ({type(e).__name__}); it was logged"
        for i in sorted(busy):
            r = Rejection(i, Status.SERVER_ERROR, detail, int(slots[i]["generation"]))
            self._set_result(r, r.status, r.detail)
            slots[i]["state"] = S_DONE  # last field written, then the post (the fence)
            self._objs.resp[i].release()
        return len(busy)

    def serve_pending(self) -> int:
        """Answer a finished batch in flight, if any, and take every posted slot as a new batch:
        a uniform recall batch is started and left in flight, anything else is served now.
        Returns the number of requests answered."""
        assert self._objs is not None and self.seg is not None
        inflight = self._inflight
        served = 0
        if inflight and (inflight[0].pending.done()
                         or time.monotonic_ns() - inflight[0].t_pick > _BLOCK_AFTER_NS):
            served += self._finish_uniform(inflight.popleft())
        if len(inflight) >= PIPELINE_DEPTH:
            return served
        idx = posted_slots(self._states)
        if len(idx) == 0:
            return served
        if inflight:
            # One batch on the device: start the next right behind it once as many callers as
            # last time have posted, or as soon as the device is about to be idle.
            if len(idx) < self._last_batch and not inflight[0].pending.done():
                return served
        elif len(idx) < self._last_batch and self._gather_ns:
            idx = self._gather()
        t_pick = time.monotonic_ns()
        taken: list[int] = []
        req = self._objs.req
        for i in idx.tolist():
            try:
                req[i].acquire(0)  # the acquire is the fence before reading the request
            except posix_ipc.BusyError:
                continue  # client between writing POSTED and posting req; next scan brings it
            taken.append(i)
        if not taken:
            return served
        if not inflight and len(taken) == 1 and self._serve_single_recall(taken[0], t_pick):
            self._last_batch = 1
            return served + 1
        slots = self.seg.slots
        sel = np.asarray(taken, np.intp)
        slots["state"][sel] = S_BUSY
        slots["t_pick_ns"][sel] = t_pick
        rec = slots[sel]  # a copy of the control blocks: what the clients wrote, read once
        t0 = time.perf_counter_ns()
        batch = self._start_uniform(sel, rec, taken, t_pick, t0)
        if batch is not None:
            inflight.append(batch)
            if not pipelined(batch.work, self._min_work):  # answer it now
                served += self._finish_inflight()
            return served
        served += self._finish_inflight()
        self._serve_general(taken, rec)
        return served + self._complete(sel, taken, rec, t_pick, t0)

    def _finish_inflight(self) -> int:
        """Answer every batch in flight (waiting for the device)."""
        served = 0
        while self._inflight:
            served += self._finish_uniform(self._inflight.popleft())
        return served

    def _complete(self, sel: np.ndarray, taken: list[int], rec: np.ndarray, t_pick: int,
                  t0: int) -> int:
        """Results are written: stamp the slots, mark them DONE, post each, record the batch."""
        assert self._objs is not None and self.seg is not None
        slots = self.seg.slots
        t1 = time.perf_counter_ns()
        n = len(taken)
        self._last_batch, self._last_service_ns = n, t1 - t0
        slots["batch_size"][sel] = n
        t_done = time.monotonic_ns()
        slots["t_done_ns"][sel] = t_done
        slots["state"][sel] = S_DONE  # last field written, then each post (the fence)
        resp = self._objs.resp
        for i in taken:
            resp[i].release()
        self.stats.record_batch(BatchRecord(n, t1 - t0, t_pick_ns=t_pick, t_post_ns=rec["t_post_ns"],
                                            t_done_ns=t_done))
        self._words.u64[self._batches_word] = self.stats.batches
        return n

    def _namespace(self, key: tuple[bytes, int]) -> Namespace | None:
        """The namespace named by a slot's (raw bytes, length), decoded once per distinct key;
        None if the bytes are not a valid name or the namespace does not exist."""
        name = self._ns_names.get(key)
        if name is None:
            name = decode_namespace(*key)
            if name is None:
                return None
            if len(self._ns_names) < 4096:
                self._ns_names[key] = name
        return self.store.get(name)

    def _gather(self) -> np.ndarray:
        """Fewer requests are posted than the last batch held: their callers are most likely
        re-posting right now. Wait a little for them (a quarter of the last batch's service time,
        at most ``gather_us``) so a steady set of callers keeps getting served in full batches
        instead of a batch of one followed by the rest. Costs nothing with one caller."""
        end = time.monotonic_ns() + min(self._gather_ns, self._last_service_ns // 4)
        want = self._last_batch
        while True:
            idx = posted_slots(self._states)
            if len(idx) >= want or time.monotonic_ns() >= end:
                return idx

    def _serve_single_recall(self, i: int, t_pick: int) -> bool:
        """A batch of one plain recall (one vector, no payloads): the latency case. Every field is
        read and written through word views and the query is searched in place, so the batch costs
        a handful of numpy calls. Returns False, having written nothing, for anything else."""
        W = self._words
        u32, u64 = W.u32, W.u64
        k = u32[W.k[i]]
        if not (u32[W.op[i]] == _RECALL and u32[W.nq[i]] == 1 and u32[W.flags[i]] == 0
                and 1 <= k <= self._k_limit):
            return False
        ns_len = u32[W.ns_len[i]]
        off = self._ns_off[i]
        raw = self._objs.mm[off:off + min(ns_len, NAMESPACE_BYTES)]  # type: ignore[union-attr]
        ns = self._namespace((raw, ns_len))
        if ns is None:
            return False
        sv = self.seg.slot[i]  # type: ignore[union-attr]
        q = sv.queries[:1]
        if not math.isfinite(q.sum()) and not np.isfinite(q).all():
            return False
        u32[W.state[i]] = S_BUSY
        u64[W.t_pick_ns[i]] = t_pick
        t0 = time.perf_counter_ns()
        try:
            ids, scores = ns.search(q, k)
        except Exception:  # the general path reports it
            u32[W.state[i]] = S_POSTED
            return False
        t1 = time.perf_counter_ns()
        kk = ids.shape[1]
        sv.result_ids[0, :kk] = ids[0]
        sv.result_scores[0, :kk] = scores[0]
        u32[W.status[i]] = _OK
        u32[W.n_results[i]] = kk
        u32[W.blob_len[i]] = 0
        u64[W.resp_generation[i]] = u64[W.generation[i]]
        u32[W.batch_size[i]] = 1
        t_done = time.monotonic_ns()
        u64[W.t_done_ns[i]] = t_done
        u32[W.state[i]] = S_DONE  # last field written, then the post (the fence)
        self._objs.resp[i].release()  # type: ignore[union-attr]
        self.stats.record_batch(BatchRecord(1, t1 - t0, t_pick_ns=t_pick,
                                            t_post_ns=(u64[W.t_post_ns[i]],), t_done_ns=t_done))
        u64[self._batches_word] = self.stats.batches
        return True

    def _start_uniform(self, sel: np.ndarray, rec: np.ndarray, taken: list[int], t_pick: int,
                       t0: int) -> InFlight | None:
        """The common batch, started with a fixed number of numpy calls whatever its size: every
        request a one-vector recall without payloads in the same namespace. Returns None (having
        written nothing to the slots) for any other batch."""
        k = rec["k"]
        if len(rec) == 1:  # plain ints: cheaper than array calls for one request
            r = rec[0]
            if not (r["op"] == _RECALL and r["nq"] == 1 and r["flags"] == 0
                    and 1 <= r["k"] <= self._k_limit):
                return None
            key = (bytes(r["namespace"]), int(r["ns_len"]))
        else:
            # k is unsigned: k - 1 wraps to a huge value for k = 0.
            if not ((rec["op"] == _RECALL) & (rec["nq"] == 1) & (rec["flags"] == 0)
                    & (k - 1 < self._k_limit) & (rec["ns_len"] == rec["ns_len"][0])).all():
                return None
            nsraw = rec["namespace"]
            if not (nsraw == nsraw[0]).all():
                return None
            key = (bytes(nsraw[0]), int(rec["ns_len"][0]))
        ns = self._namespace(key)
        if ns is None:
            return None
        assert self.seg is not None
        # Gather the batch with one copy into a staging buffer no batch in flight uses (pinned:
        # the CUDA backend copies it to the device from there). A fancy index then a contiguous
        # copy: 2.7x faster than np.take(out=) here.
        st = 1 - self._inflight[0].staging if self._inflight else 0
        q = self._stagings[st][: len(sel)]
        q[...] = self.seg.all_queries[sel, 0]
        if not np.isfinite(q).all():
            return None
        try:
            pending = ns.search_start(q, int(k.max()))
        except Exception:  # the general path reports it per request
            return None
        return InFlight(sel, rec, taken, t_pick, t0, st, pending, ns.n * len(sel) * self.cfg.dim)

    def _finish_uniform(self, b: InFlight) -> int:
        """Write a started batch's answers (waiting for the device if need be) and post them."""
        try:
            return self._finish_uniform_unguarded(b)
        except Exception as e:  # its slots are no longer in flight: answer them now
            self._log_unexpected("answering a batch failed", e)
            return self._answer_stranded(e)

    def _finish_uniform_unguarded(self, b: InFlight) -> int:
        assert self.seg is not None
        try:
            ids, scores = b.pending.result()
        except Exception:  # the general path searches again and reports per request
            served = self._finish_inflight()  # (it stages queries where a later batch may have)
            self._serve_general(b.taken, b.rec)
            return served + self._complete(b.sel, b.taken, b.rec, b.t_pick, b.t0)
        rec, sel = b.rec, b.sel
        kk = ids.shape[1]
        seg, slots = self.seg, self.seg.slots
        seg.all_result_ids[sel, 0, :kk] = ids
        seg.all_result_scores[sel, 0, :kk] = scores
        slots["status"][sel] = _OK
        slots["n_results"][sel] = np.minimum(rec["k"], kk)
        slots["blob_len"][sel] = 0
        slots["resp_generation"][sel] = rec["generation"]
        return self._complete(sel, b.taken, rec, b.t_pick, b.t0)

    def _serve_general(self, taken: list[int], rec: np.ndarray) -> None:
        reqs: list[Request] = []
        for i, r in zip(taken, rec):
            f = SlotFields(op=int(r["op"]), k=int(r["k"]), nq=int(r["nq"]), flags=int(r["flags"]),
                           blob_len=int(r["blob_len"]), ns_len=int(r["ns_len"]),
                           namespace=bytes(r["namespace"]), generation=int(r["generation"]),
                           t_post_ns=int(r["t_post_ns"]))
            p = parse_request(i, f, self.layout, self.backend.max_k)
            if isinstance(p, Rejection):
                self._set_result(p, p.status, p.detail)
            else:
                reqs.append(p)
        plan = plan_batch(reqs)
        if plan.writes:
            self._guarded(plan.writes, lambda: self._serve_writes(plan.writes))
        for ns, group in plan.recalls.items():
            self._guarded(group, lambda: self._serve_recalls(ns, group))
        for r in plan.others:
            self._guarded([r], lambda: self._serve_other(r))

    def _guarded(self, group: list[Request], serve: Callable[[], None]) -> None:
        """Serve a group of requests; an unexpected error answers the whole group SERVER_ERROR
        (logged) and the rest of the batch is served as usual."""
        try:
            serve()
        except Exception as e:
            self._log_unexpected(f"serving {len(group)} request(s) failed", e)
            for r in group:
                self._set_result(r, Status.SERVER_ERROR,
                                 f"the sidecar failed serving this request ({type(e).__name__}); "
                                 "it was logged")

    def _set_result(self, r: Request | Rejection, status: Status, detail: str = "",
                    n_results: int = 0, *, keep_blob: bool = False) -> None:
        """Outcome of a request; the slot is posted once the whole batch is done."""
        assert self.seg is not None
        W = self._words
        i = r.slot
        if not keep_blob:
            data = detail.encode()[: self.layout.blob_bytes]
            if data:
                self.seg.slot[i].blob[: len(data)] = np.frombuffer(data, np.uint8)
            W.u32[W.blob_len[i]] = len(data)
        W.u32[W.status[i]] = int(status)
        W.u32[W.n_results[i]] = n_results
        W.u64[W.resp_generation[i]] = r.generation
        if status != Status.OK:
            self.stats.record_error(status)

    # ------------------------------------------------------------------ ops
    def _serve_recalls(self, ns_name: str, group: list[Request]) -> None:
        assert self.seg is not None
        ns = self.store.get(ns_name)
        if ns is None:
            for r in group:
                self._set_result(r, Status.UNKNOWN_NAMESPACE, f"no namespace {ns_name!r}")
            return
        if len(group) == 1:  # read the queries in place: no gather copy
            offs = [0]
            q = self.seg.slot[group[0].slot].queries[: group[0].nq]
        else:
            offs = pack_offsets([r.nq for r in group]).tolist()
            q = self._staging[: offs[-1]]
            for r, o in zip(group, offs):
                q[o:o + r.nq] = self.seg.slot[r.slot].queries[: r.nq]
        if not np.isfinite(q).all():
            # A broken client wrote garbage; reject its request alone and serve the others.
            good = []
            for r, o in zip(group, offs):
                if np.isfinite(q[o:o + r.nq]).all():
                    good.append(r)
                else:
                    self._set_result(r, Status.NOT_FINITE, "query contains NaN or infinity")
            if good:
                self._serve_recalls(ns_name, good)
            return
        kmax = group[0].k if len(group) == 1 else max(r.k for r in group)
        try:
            ids, scores = ns.search(q, kmax)
        except Exception as e:  # backend failure: every caller gets a clean error status
            log.exception("backend search failed")
            for r in group:
                self._set_result(r, Status.BACKEND_ERROR, f"{type(e).__name__}: {e}")
            return
        kk = ids.shape[1]
        for r, o in zip(group, offs):
            sv = self.seg.slot[r.slot]
            kr = min(r.k, kk)
            sv.result_ids[: r.nq, :kr] = ids[o:o + r.nq, :kr]
            sv.result_scores[: r.nq, :kr] = scores[o:o + r.nq, :kr]
            if r.flags & Flag.WITH_PAYLOAD:
                blob = b"\n".join(ns.payloads.get(i, b"null")
                                  for i in ids[o:o + r.nq, :kr].ravel().tolist())
                if len(blob) > self.layout.blob_bytes:
                    self._set_result(r, Status.PAYLOAD_TOO_LARGE,
                                     f"payloads of the hits take {len(blob)} bytes, the slot holds "
                                     f"{self.layout.blob_bytes}; lower k or raise --blob-bytes")
                    continue
                sv.blob[: len(blob)] = np.frombuffer(blob, np.uint8)
                self._words.u32[self._words.blob_len[r.slot]] = len(blob)
                self._set_result(r, Status.OK, n_results=kr, keep_blob=True)
                continue
            self._set_result(r, Status.OK, n_results=kr)

    def _decode_write(self, r: Request) -> Write | tuple[Status, str]:
        """Read and check an upsert/delete/drop from its slot (a broken client may have written it)."""
        assert self.seg is not None
        sv = self.seg.slot[r.slot]
        if r.op == Op.DROP_NAMESPACE:
            return Write("drop", r.namespace)
        ids = sv.ids[: r.nq].copy()
        if (ids < 0).any():
            return (Status.BAD_ID, "ids must be >= 0")
        if r.op == Op.DELETE:
            return Write("delete", r.namespace, ids=ids)
        vecs = sv.queries[: r.nq].copy()
        if not np.isfinite(vecs).all():
            return (Status.NOT_FINITE, "vectors contain NaN or infinity")
        payloads: list[bytes | None] | None = None
        blob_len = self._words.u32[self._words.blob_len[r.slot]]
        if blob_len:
            lines = sv.blob[:blob_len].tobytes().split(b"\n")
            if len(lines) != r.nq:
                return (Status.BAD_REQUEST, f"{len(lines)} payload lines for {r.nq} vectors")
            payloads = []
            for line in lines:
                if len(line) > self.cfg.payload_limit:
                    return (Status.PAYLOAD_TOO_LARGE,
                            f"a payload of {len(line)} bytes exceeds the limit of {self.cfg.payload_limit}")
                problem = payload_problem(line)
                if problem is not None:
                    return (Status.BAD_REQUEST, problem)
                payloads.append(None if line == b"null" else line)
        return Write("upsert", r.namespace, ids=ids, vectors=vecs, payloads=payloads)

    def _serve_writes(self, writes: list[Request]) -> None:
        accepted: list[tuple[Request, Write]] = []
        for r in writes:
            w = self._decode_write(r)
            if isinstance(w, tuple):
                self._set_result(r, *w)
            else:
                accepted.append((r, w))
        if not accepted:
            return
        # Capacity first, so nothing can fail in memory once the writes are durable.
        need: dict[str, int] = {}
        for _r, w in accepted:
            if w.op == "upsert":
                assert w.ids is not None
                need[w.namespace] = need.get(w.namespace, 0) + len(w.ids)
        try:
            for name, extra in need.items():
                ns = self.store.get_or_create(name)
                ns.ensure_capacity(ns.n + extra)
        except Exception as e:
            log.exception("growing capacity failed")
            for r, _w in accepted:
                self._set_result(r, Status.CAPACITY, f"{type(e).__name__}: {e}")
            return
        if self.persist is not None:
            try:
                self.persist.commit([w for _r, w in accepted])
            except StoreError as e:
                log.error("store commit failed: %s", e)
                for r, _w in accepted:
                    self._set_result(r, Status.STORE_ERROR, str(e))
                return
        for r, w in accepted:
            try:
                if w.op == "upsert":
                    assert w.ids is not None and w.vectors is not None
                    n = self.store.get_or_create(w.namespace).upsert(w.ids, w.vectors, w.payloads)
                elif w.op == "delete":
                    assert w.ids is not None
                    target = self.store.get(w.namespace)
                    n = 0 if target is None else target.delete(w.ids)
                else:
                    n = self.store.drop(w.namespace)
                    if w.namespace == "default":
                        self.store.get_or_create("default")
            except Exception as e:
                log.exception("applying a write failed")
                self._set_result(r, Status.BACKEND_ERROR, f"{type(e).__name__}: {e}")
                continue
            self._set_result(r, Status.OK, n_results=n)

    def _serve_other(self, r: Request) -> None:
        assert self.seg is not None
        if r.op == Op.LIST_NAMESPACES:
            blob = json.dumps(self.store.counts(), separators=(",", ":")).encode()
            if len(blob) > self.layout.blob_bytes:
                self._set_result(r, Status.PAYLOAD_TOO_LARGE, "namespace list exceeds the slot")
                return
            sv = self.seg.slot[r.slot]
            sv.blob[: len(blob)] = np.frombuffer(blob, np.uint8)
            self._words.u32[self._words.blob_len[r.slot]] = len(blob)
            self._set_result(r, Status.OK, n_results=len(self.store.namespaces), keep_blob=True)
        elif r.op == Op.EXPORT:
            ns = self.store.get(r.namespace)
            if ns is None:
                self._set_result(r, Status.UNKNOWN_NAMESPACE, f"no namespace {r.namespace!r}")
                return
            sv = self.seg.slot[r.slot]
            ids, vecs, pls = ns.export_page(int(sv.ids[0]), r.nq)
            blob = b"\n".join(pls)
            while len(blob) > self.layout.blob_bytes and len(ids) > 1:  # fewer rows per page
                ids, vecs, pls = ids[: len(ids) // 2], vecs[: len(ids) // 2], pls[: len(ids) // 2]
                blob = b"\n".join(pls)
            if len(blob) > self.layout.blob_bytes:
                self._set_result(r, Status.PAYLOAD_TOO_LARGE, "a payload exceeds the slot's blob area")
                return
            sv.ids[: len(ids)] = ids
            sv.queries[: len(ids)] = vecs
            sv.blob[: len(blob)] = np.frombuffer(blob, np.uint8)
            self._words.u32[self._words.blob_len[r.slot]] = len(blob)
            self._set_result(r, Status.OK, n_results=len(ids), keep_blob=True)
        else:
            self._set_result(r, Status.UNKNOWN_OP, f"op {int(r.op)} not served")

    # ------------------------------------------------------------------ leases
    def reap_dead_owners(self) -> int:
        """Free the slots of clients that died (or gave them up) while holding them, and slots
        left in a state other than FREE without an owner (only a broken client leaves those).
        Every lease field was written by a client: pids are checked by value, never trusted.
        Slots of a batch in flight are left alone until it is answered."""
        assert self._objs is not None and self.seg is not None
        slots = self.seg.slots
        owners = slots["owner_pid"]
        suspects = np.flatnonzero((owners != 0) | (slots["state"] != S_FREE))
        if len(suspects) == 0:
            return 0
        freed = 0
        alive: dict[tuple[int, int], bool] = {}
        busy = self._inflight_slots()
        fcntl.flock(self._objs.shm.fd, fcntl.LOCK_EX)
        try:
            for i in suspects.tolist():
                if i in busy:
                    continue
                pid = int(slots[i]["owner_pid"])
                start = int(slots[i]["owner_start"])
                if pid == 0 and int(slots[i]["state"]) == S_FREE:
                    continue  # given back meanwhile
                if pid not in (0, OWNER_ABANDONED):
                    key = (pid, start)
                    if key not in alive:
                        alive[key] = pid_alive(pid, start)
                    if alive[key]:
                        continue
                for sem in (self._objs.req[i], self._objs.resp[i]):
                    while True:
                        try:
                            sem.acquire(0)
                        except posix_ipc.BusyError:
                            break
                slots[i]["state"] = S_FREE
                slots[i]["owner_start"] = 0
                slots[i]["owner_pid"] = 0
                freed += 1
        finally:
            fcntl.flock(self._objs.shm.fd, fcntl.LOCK_UN)
        if freed:
            log.info("reclaimed %d slots of dead or departed clients", freed)
            self.stats.slots_reclaimed += freed
        return freed


def run(cfg: ServeConfig) -> int:
    """Start, serve until SIGTERM/SIGINT, clean up. Returns a process exit code."""
    sidecar = Sidecar(cfg)
    sidecar.install_signal_handlers()
    # The serving thread shares the GIL with the heartbeat and metrics threads: hand it back
    # after at most 0.5 ms instead of 5 ms, so a scrape cannot stall a batch for long.
    sys.setswitchinterval(0.0005)
    exporter = None
    if cfg.metrics_port is not None:
        from sidecar_cuda.metrics import MetricsServer

        # Before loading: /healthz answers and /readyz says 503 until the memory is loaded.
        exporter = MetricsServer(sidecar, cfg.metrics_host, cfg.metrics_port)
        exporter.start()
    try:
        sidecar.start()
        sidecar.serve_forever()
    finally:
        if exporter is not None:
            exporter.stop()
        sidecar.close()  # idempotent; unlinks the objects if start() or serving never began
    return 0
