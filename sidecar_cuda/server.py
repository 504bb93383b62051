"""The sidecar process's life: it opens the durable store (if any), creates the shared objects,
loads the memory, announces READY, runs the serving loop until told to stop, answers what was
posted before the stop, and unlinks everything.

The loop (:meth:`Sidecar.serve_forever`) polls the slot states while requests keep coming and
sleeps on the doorbell once idle; each pass is :meth:`Pipeline.serve_pending
<sidecar_cuda.serving.pipeline.Pipeline.serve_pending>` (take the posted slots, classify them, serve the
route), guarded so that nothing a slot holds can end the loop, and the reaper
(:mod:`kalos.sidecar_cuda.serving.leases`) runs on time, busy or not.

One recall, end to end: client -> (shm) -> this loop -> pipeline -> batching.classify -> store ->
backend -> answers -> (shm) -> client."""

from __future__ import annotations

import gc
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import posix_ipc

from ..broker import leases
from ..broker.errors import ConfigError
from ..broker.layout import HEARTBEAT_S, SegmentView, SidecarState, SlotWords, header_field_offset
from ..broker.names import validate_broker_name
from ..broker.positions import BEYOND, Position
from ..broker.slotpath import Choice, choose
from ..broker.waiting import SpinThenBlock
from .backends.base import Backend
from .backends.select import choose_backend
from .config import Pipelining, ServeConfig  # (ServeConfig is still importable from here)
from .embedding import ModelError, TextEncoder
from .serving.answers import AnswerWriter
from .serving.batching import PIPELINE_MIN_WORK, Limits
from .serving.embeds import EmbedRoute
from .serving.expiry import SWEEP_S, Sweeper
from .serving.general import GeneralRoute
from .serving.launch import Regime, launch_policy
from .serving.leases import REAP_S, ReapOutcome, reap_dead_owners
from .serving.notify import sd_notify
from .serving.objects import Objects
from .serving.objects import create as create_objects
from .serving.objects import unlink as unlink_objects
from .serving.pipeline import PIPELINE_DEPTH, Pipeline
from .serving.slotio import SlotIO, load_compiled, open_slot_io
from .serving.stats import SidecarStats
from .serving.waits import HeldReads
from .storage.datadir import DataDirLock, lock_data_dir
from .storage.durable import Durable, StoreError, StoreKind, store_kind
from .storage.sqlite import Persistence, prepare_data_dir
from .storage.store import MemoryStore

if TYPE_CHECKING:
    from .storage.fleet import FleetStore

log = logging.getLogger("kalos.sidecar")
_POLL_SLEEP_AFTER_NS = 2_000_000  # a batch in flight this long: poll every 50 us, not flat out
_REAP_WAIT_WARN_PASSES = 40  # reaper passes held off by the claim lock (10 s) between two warnings


def load_encoder(directory: str | None, dim: int, backend: Backend) -> TextEncoder | None:
    """``--embed DIR``: the model, resident where the backend computes (CuPy float16 on a CUDA
    backend, numpy float32 otherwise); ConfigError if it cannot be served or its dimension is not
    ``--dim``."""
    if directory is None:
        return None
    if backend.code == 2:  # (the header's backend field: 2 cuda)
        import cupy  # (the CUDA backend runs: CuPy is there)

        xp, dtype = cupy, cupy.float16
    else:
        xp, dtype = np, np.float32
    try:
        encoder = TextEncoder(Path(directory), xp, dtype)
    except ModelError as e:
        raise ConfigError(f"--embed: {e}") from None
    if encoder.dim != dim:
        raise ConfigError(
            f"--embed: the model's vectors have {encoder.dim} dimensions, --dim is {dim}: start the sidecar "
            f"with --dim {encoder.dim} (a sidecar serves one dimension)"
        )
    log.info("embedding model: %s", encoder.describe())
    return encoder


class Sidecar:
    """One sidecar process's serving state. ``backend``: injected (tests, benchmarks), else
    chosen from ``cfg``; ``slot_path``: the slot path's choice (:mod:`kalos.broker.slotpath`),
    else made from this process's environment (``KALOS_PURE_PYTHON``, ``KALOS_REQUIRE_COMPILED``;
    a ConfigError when the compiled path is required and not built)."""

    def __init__(self, cfg: ServeConfig, backend: Backend | None = None, slot_path: Choice | None = None) -> None:
        validate_broker_name(cfg.name)
        self.slot_path = slot_path or choose(os.environ, load_compiled)
        self.cfg = cfg
        self.layout = cfg.layout()
        self.metric = cfg.metric_enum()
        if (cfg.data_dir is not None or cfg.store is not None) and (cfg.random_rows or cfg.load_npy):
            raise ConfigError(
                "--random-rows/--load only fill an --ephemeral sidecar; use `kalos import` for a durable one"
            )
        self.backend = backend or choose_backend(
            cfg.backend,
            storage_dtype=cfg.storage_dtype,
            devices=cfg.devices,
            shards=cfg.shards,
            host_work=cfg.host_search_work,
            fused_kernel=cfg.fused_kernel,
            int8_pass=cfg.int8_pass,
        )
        if cfg.max_k > self.backend.max_k:
            raise ConfigError(
                f"--max-k {cfg.max_k} exceeds the {self.backend.name} backend's limit of {self.backend.max_k}"
            )
        self.store = MemoryStore(self.backend, cfg.dim, self.metric)
        self.encoder = load_encoder(cfg.embed, cfg.dim, self.backend)  # --embed: the text model, or None
        self.persist: Durable | None = None
        self.fleet: FleetStore | None = None  # --store postgresql://: this sidecar is a replica
        self._dir_lock: DataDirLock | None = None  # --data-dir: held from start() to close()
        self.stats = SidecarStats(self.layout.n_slots)
        self._stop = threading.Event()
        self._objs: Objects | None = None
        self.seg: SegmentView | None = None
        # Staging for gathered queries (pinned on CUDA): one per batch in flight.
        self._stagings = [
            self.backend.host_buffer((self.layout.n_slots * self.layout.max_queries, self.layout.dim), np.float32)
            for _ in range(PIPELINE_DEPTH)
        ]
        self.pipeline: Pipeline | None = None  # built by start()
        self._io: SlotIO | None = None  # the slot path's byte work, made by start()
        self.sweeper: Sweeper | None = None  # built by start(): deletes expired records
        self._launch_logged_at = -math.inf  # (_log_launch)
        self._launch_switches = 0
        self._pass: Callable[[], int] = self._not_started  # one pass: pipeline.serve_pending
        self._heartbeat: threading.Thread | None = None
        self._last_error_log = 0.0
        self._reaps_waiting = 0  # reaper passes in a row that found the claim lock held
        self.ready = False

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Open the store, create the objects, load memory, then announce READY."""
        cfg = self.cfg
        # The data dir and the store first: one that cannot be used is a ConfigError before any
        # shared object exists, so no client attaches to a sidecar that is about to fail and
        # nothing has to be unlinked.
        # One data dir, one sidecar: the lock is taken before the store is opened and held until
        # close() (or the process's end: kill -9 releases it too), so a second sidecar on the
        # directory is refused instead of serving and overwriting a store of its own (datadir).
        kind = store_kind(cfg.data_dir, cfg.store)
        try:
            if kind is StoreKind.SQLITE:
                assert cfg.data_dir is not None
                prepare_data_dir(cfg.data_dir)
                self._dir_lock = lock_data_dir(cfg.data_dir, "sidecar", cfg.name)
                self.persist = Persistence(cfg.data_dir, cfg.dim, self.metric.name.lower())
            elif kind is StoreKind.POSTGRES:
                self.persist = self.fleet = self._open_fleet()
            self._objs = create_objects(cfg.name, self.layout, mode=cfg.shm_mode)
        except BaseException:
            if self.persist is not None:
                self.persist.close()
                self.persist = self.fleet = None
            self._release_data_dir()
            raise
        self.seg = SegmentView(memoryview(self._objs.mm), self.layout)
        self._words = SlotWords(memoryview(self._objs.mm), self.layout)
        self._sleep_word = header_field_offset("sidecar_sleeping") // 4
        self.seg.init_header(
            metric=self.metric,
            backend=self.backend.code,
            pid=os.getpid(),
            start_epoch_ns=time.time_ns(),
            payload_limit=cfg.payload_limit,
            embed_dim=0 if self.encoder is None else self.encoder.dim,
        )
        self._beat()
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="kalos-heartbeat", daemon=True)
        self._heartbeat.start()
        try:
            if self.persist is not None:
                rows, secs = self.persist.load_into(self.store)
                log.info(
                    "loaded %d rows in %d namespaces from %s in %.2f s",
                    rows,
                    len(self.store.namespaces),
                    self.fleet.target.shown if self.fleet is not None else cfg.data_dir,
                    secs,
                )
            self._fill_initial()
            self.pipeline = self._build_pipeline()
            self.sweeper = Sweeper(
                self.store, self.persist, self.pipeline.finish_inflight, self.stats, self.store.clock
            )
            self._pass = self.pipeline.serve_pending if self.fleet is None else self._fleet_pass
            if self.fleet is not None:
                self.fleet.start_following(self._wake)
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
        sd_notify(f"READY=1\nSTATUS=serving broker {cfg.name!r}")
        log.info(
            "kalos sidecar %r ready: backend %s, dim %d, %d slots, max_k %d, metric %s, slot path %s (%s), %s",
            cfg.name,
            self.backend.description,
            cfg.dim,
            cfg.slots,
            cfg.max_k,
            self.metric.name.lower(),
            self.slot_path.path.value,
            self.slot_path.reason,
            f"replica of {self.fleet.target.shown}"
            if self.fleet is not None
            else "ephemeral"
            if cfg.data_dir is None
            else f"data in {cfg.data_dir}",
        )

    def _release_data_dir(self) -> None:
        """Drop the data dir's lock (after the store is closed: nothing of ours writes to it)."""
        lock, self._dir_lock = self._dir_lock, None
        if lock is not None:
            lock.release()

    def _open_fleet(self) -> FleetStore:
        """The PostgreSQL store (psycopg is an optional dependency: imported only here)."""
        assert self.cfg.store is not None
        try:
            from .storage.fleet import FleetOptions
            from .storage.fleet import FleetStore as Fleet
            from .storage.pgstore import parse_target
        except ImportError as e:
            raise ConfigError(
                f"--store postgresql:// needs psycopg 3: pip install 'kalos-recall[postgres]' ({e})"
            ) from None
        retention = self.cfg.store_retention_s
        if not retention > 0:
            raise ConfigError(f"--store-retention must be > 0 seconds, got {retention}")
        options = FleetOptions(
            retention_s=retention, prune_s=min(10.0, retention / 4), heartbeat_s=min(1.0, retention / 8)
        )
        return Fleet(
            parse_target(self.cfg.store),
            name=self.cfg.name,
            dim=self.cfg.dim,
            metric=self.metric,
            backend=self.backend,
            options=options,
        )

    def _fleet_pass(self) -> int:
        """One pass of a fleet replica: followed changes are applied between batches, with
        nothing in flight on the backend, by this thread (the only writer of the store)."""
        assert self.fleet is not None and self.pipeline is not None
        served = 0
        if self.fleet.has_work():
            served += self.pipeline.finish_inflight()
            self.fleet.apply_pending(self.store)
        return served + self.pipeline.serve_pending()

    def _wake(self) -> None:
        """Wake the serving loop (from the follower thread): something waits to be applied."""
        objs = self._objs
        if objs is not None:
            try:
                objs.bell.release()
            except posix_ipc.Error:
                pass

    def applied_position(self) -> Position:
        """How far this sidecar has applied its fleet's change log (no fleet: past everything)."""
        return BEYOND if self.fleet is None else self.fleet.applied

    def degraded(self) -> str | None:
        """Why the sidecar serves but may be stale (None: it is not)."""
        return None if self.fleet is None else self.fleet.degraded()

    def _build_pipeline(self) -> Pipeline:
        assert self._objs is not None and self.seg is not None
        cfg, seg, objs = self.cfg, self.seg, self._objs
        self._io = open_slot_io(self.slot_path, seg, self._words, memoryview(objs.mm), objs.req, objs.resp)
        writer = AnswerWriter(seg, self._words, self._io, self.stats.record_error)
        general = GeneralRoute(
            seg,
            writer,
            self.store,
            self.persist,
            self._stagings[0],
            backend_max_k=self.backend.max_k,
            payload_limit=cfg.payload_limit,
            on_unexpected=self._log_unexpected,
        )
        min_work = {Pipelining.ON: 0, Pipelining.OFF: -1, Pipelining.AUTO: PIPELINE_MIN_WORK}[cfg.pipeline]
        limits = Limits(
            k_limit=min(self.layout.max_k, self.backend.max_k),
            dim=cfg.dim,
            min_work=min_work,
            max_queries=self.layout.max_queries,
        )
        return Pipeline(
            seg,
            self._words,
            self._objs.mm,
            self._io,
            writer,
            general,
            self.store,
            self.stats,
            self._stagings,
            limits,
            launch=launch_policy(cfg.launch, int(cfg.gather_us * 1000), self._log_launch),
            batches_word=header_field_offset("batches") // 8,
            on_unexpected=self._log_unexpected,
            hold=HeldReads(self._words, writer, self.applied_position),
            embeds=EmbedRoute(seg, writer, self.encoder, cfg.dim),
        )

    def _log_launch(self, regime: Regime, why: str) -> None:
        """A switch of ``--launch fill``'s way of batching: at DEBUG each, at INFO at most once a
        minute (on a noisy host the policy may switch several times a second)."""
        self._launch_switches += 1
        now = time.monotonic()
        if now - self._launch_logged_at < 60.0:
            log.debug("launch: batches now %s (%s)", regime.value, why)
            return
        log.info(
            "launch: batches now %s (%s); %d switches since the last such line",
            regime.value,
            why,
            self._launch_switches,
        )
        self._launch_logged_at, self._launch_switches = now, 0

    def _fill_initial(self) -> None:
        cfg = self.cfg
        if not (cfg.random_rows or cfg.load_npy):
            return  # nothing to fill: no namespace exists until a client writes one
        ns = self.store.get_or_create("default", capacity=max(cfg.random_rows, 1))
        if cfg.random_rows:
            rng = np.random.default_rng(cfg.seed)
            step = 65536
            for lo in range(0, cfg.random_rows, step):
                hi = min(cfg.random_rows, lo + step)
                pls: list[bytes | None] | None = None
                if cfg.random_payloads:
                    pls = [b'{"bucket":%d}' % (i % 1000) for i in range(lo, hi)]
                ns.upsert(
                    np.arange(lo, hi, dtype=np.int64), rng.standard_normal((hi - lo, cfg.dim), dtype=np.float32), pls
                )
        if cfg.load_npy:
            try:
                mat = np.load(cfg.load_npy, mmap_mode="r")
            except (OSError, ValueError) as e:
                raise ConfigError(f"cannot load {cfg.load_npy}: {e}") from None
            if mat.ndim != 2 or mat.shape[1] != cfg.dim:
                raise ConfigError(f"{cfg.load_npy} has shape {mat.shape}, need (n, {cfg.dim})")
            base = ns.n
            for lo in range(0, mat.shape[0], 65536):
                chunk = np.asarray(mat[lo : lo + 65536], np.float32)
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
        sd_notify("STOPPING=1")
        if self.seg is not None and int(self.seg.header["state"]) != SidecarState.FAILED:
            self.seg.header["state"] = SidecarState.STOPPED
        objs, self._objs = self._objs, None
        if self._io is not None:
            self._io.close()  # (its semaphores are closed here; posix_ipc's handles below)
        unlink_objects(self.cfg.name, objs)
        if self.persist is not None:
            self.persist.close()
        self._release_data_dir()
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
        then skip the doorbell); after ``spin_us`` without work (``broker.waiting``, the clients'
        spin-then-block policy with a fixed window) it announces that it sleeps and blocks on the
        doorbell, so an idle sidecar costs no CPU."""
        assert self._objs is not None and self.seg is not None and self.pipeline is not None
        bell = self._objs.bell
        inflight = self.pipeline.inflight
        u32 = self._words.u32
        sleeping = self._sleep_word
        spinning = SpinThenBlock(self.cfg.spin_us).spinning  # a fixed window: --spin-us
        clock = time.monotonic_ns
        reap_ns = int(REAP_S * 1e9)
        next_reap = clock() + reap_ns
        sweep_ns = int(SWEEP_S * 1e9)
        next_sweep = clock() + sweep_ns
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
                if now >= next_sweep:  # (expired records are hidden from reads meanwhile)
                    self.sweep_guarded()
                    next_sweep = now + sweep_ns
                if served or inflight:
                    last_work = now
                    if not served and inflight and last_work - inflight[0].t_pick > _POLL_SLEEP_AFTER_NS:
                        time.sleep(0.00005)  # a long batch on the device: poll gently
                    continue
                if spinning(now - last_work):
                    os.sched_yield()  # polite polling: a client on this core gets to run
                    continue
                u32[sleeping] = 1
                self._drain(bell)  # the try-wait is also the fence before the re-scan
                if not self.serve_guarded() and not inflight:
                    try:
                        bell.acquire(self._sleep_s())
                    except (posix_ipc.BusyError, posix_ipc.SignalError):
                        pass
                u32[sleeping] = 0
                last_work = clock()
            # Finish what was posted before the stop, then tell clients.
            self.seg.header["state"] = SidecarState.STOPPING
            self.serve_remaining()
        finally:
            self.close()

    def _sleep_s(self) -> float:
        """How long the idle loop may sleep on the doorbell: until the reaper is due, or the
        earliest limit of a read held for a fleet position."""
        assert self.pipeline is not None
        due = self.pipeline.hold.next_deadline_s()
        most = min(REAP_S, SWEEP_S) if self.store.next_expiry() <= time.time_ns() + int(SWEEP_S * 1e9) else REAP_S
        return most if due is None else min(most, due)

    def serve_pending(self) -> int:
        """One pass of the loop, unguarded (:meth:`Pipeline.serve_pending`)."""
        return self._pass()

    @staticmethod
    def _not_started() -> int:
        raise RuntimeError("the sidecar is not started")

    def serve_remaining(self) -> int:
        """At stop: answer the batches in flight and every request posted before now."""
        assert self.pipeline is not None
        served = self.pipeline.finish_inflight()  # (first: serve_pending then takes every posted slot)
        served += self.pipeline.serve_pending()
        return served + self.pipeline.finish_inflight()

    @staticmethod
    def _drain(bell: posix_ipc.Semaphore) -> None:
        while True:
            try:
                bell.acquire(0)
            except posix_ipc.BusyError:
                return

    # ------------------------------------------------------------------ guards
    def serve_guarded(self) -> int:
        """:meth:`serve_pending`, but nothing a slot holds can end the loop: an unexpected error
        while serving is logged and every request it stranded gets SERVER_ERROR."""
        try:
            return self._pass()
        except Exception as e:
            self._log_unexpected("serving a batch failed", e)
            return self._answer_stranded(e)

    def _answer_stranded(self, e: BaseException) -> int:
        assert self.pipeline is not None
        return self.pipeline.answer_stranded(e)

    def sweep_guarded(self) -> int:
        """One pass of the sweeper (``expiry.Sweeper``): the records it deleted. A store that fails
        is logged (the expired records stay hidden from reads, the next pass tries again), and so
        is anything else: nothing ends the loop."""
        if self.sweeper is None:
            return 0
        try:
            return self.sweeper.sweep()
        except StoreError as e:
            n = self.sweeper.failures
            if n & (n - 1) == 0:  # (1st, 2nd, 4th, 8th ... failure in a row: the retries back off)
                log.error("sweeping expired records failed %d time(s) (they stay hidden; retrying): %s", n, e)
        except Exception as e:
            self._log_unexpected("sweeping expired records failed", e)
        return 0

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
            log.error(
                "%s (%d unexpected errors so far): %s: %s",
                what,
                self.stats.internal_errors,
                type(e).__name__,
                e,
                exc_info=e,
            )

    def reap_dead_owners(self) -> int:
        """Free the slots of clients that died (or gave them up) while holding them, and slots
        left in a state other than FREE without an owner (:mod:`kalos.sidecar_cuda.serving.leases`). Slots of a
        batch in flight are left alone until it is answered. Never waits for the claim lock: while
        a client holds it, the slots wait for a later pass (every REAP_S)."""
        assert self._objs is not None and self.seg is not None and self.pipeline is not None
        fd = self._objs.leases_fd
        self.pipeline.hold.drop(lambda i: leases.is_locked(fd, i))
        reap = reap_dead_owners(
            self.seg.slots,
            self._objs.shm.fd,
            self._objs.req,
            self._objs.resp,
            self.pipeline.inflight_slots(),
            held=lambda i: leases.is_locked(fd, i),
        )
        if reap.outcome is ReapOutcome.LOCK_HELD:
            self._reaps_waiting += 1
            if self._reaps_waiting % _REAP_WAIT_WARN_PASSES == 0:
                log.warning(
                    "slots of dead or departed clients have waited %.0f s or more to be "
                    "reclaimed: a client holds the segment's claim lock (flock), perhaps "
                    "stopped or frozen; serving goes on",
                    self._reaps_waiting * REAP_S,
                )
        else:
            self._reaps_waiting = 0
        if reap.freed:
            log.info("reclaimed %d slots of dead or departed clients", reap.freed)
            self.stats.slots_reclaimed += reap.freed
        return reap.freed


def run(cfg: ServeConfig) -> int:
    """Start, serve until SIGTERM/SIGINT, clean up. Returns a process exit code."""
    sidecar = Sidecar(cfg)
    sidecar.install_signal_handlers()
    # The serving thread shares the GIL with the heartbeat and metrics threads: hand it back
    # after at most 0.5 ms instead of 5 ms, so a scrape cannot stall a batch for long.
    sys.setswitchinterval(0.0005)
    exporter = None
    if cfg.metrics_port is not None:
        from .metrics import MetricsServer

        # Before loading: /healthz answers and /readyz says 503 until the memory is loaded.
        exporter = MetricsServer(sidecar, cfg.metrics_host, cfg.metrics_port, degraded=sidecar.degraded)
        exporter.start()
    try:
        sidecar.start()
        if exporter is not None and sidecar.fleet is not None:
            from .storage.fleet import FleetCollector

            exporter.registry.register(FleetCollector(sidecar.fleet))
        sidecar.serve_forever()
    finally:
        if exporter is not None:
            exporter.stop()
        sidecar.close()  # idempotent; unlinks the objects if start() or serving never began
    return 0
