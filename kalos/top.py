"""``kalos top``: a live terminal view of a sidecar, read from its ``/metrics`` endpoint.

Every ``interval`` seconds it scrapes the endpoint, and shows slots in use, throughput and batch
sizes computed from the counters' increase since the previous scrape, the latency quantiles the
sidecar exports (end to end as callers see it, by kind of call, and per stage), errors by kind and
memory rows.
The arithmetic is in :func:`compute_view` (pure, tested without a terminal); :func:`render` turns
its result into a ``rich`` renderable; :func:`run_top` does the I/O. ``q`` quits.

Which endpoint: ``--url`` if given; else the sidecar serving ``--name`` is found from the pid in
its segment's header and its listening TCP sockets in ``/proc`` (same PID namespace, same user or
root), and :data:`DEFAULT_URL` is tried last. A candidate counts only if its
``kalos_backend_info`` names that broker, so a pid from another PID namespace or another sidecar
on the default port is never shown as this one.
"""

from __future__ import annotations

import ipaddress
import math
import os
import select
import sys
import termios
import time
import tty
import urllib.error
import urllib.request
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, TextIO

from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from kalos.broker.errors import ConfigError
from kalos.sidecar_cuda.serving.objects import live_sidecar

#: Where ``kalos top`` looks last (and the port the docs' examples give ``--metrics-port``).
DEFAULT_URL = "http://127.0.0.1:9464/metrics"
QUIT_KEYS = frozenset("qQ")
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp

Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Scrape:
    """One parsed scrape: ``values[sample name][sorted label pairs] = value``, taken at ``t``
    (CLOCK_MONOTONIC seconds)."""

    t: float
    values: dict[str, dict[Labels, float]]

    def get(self, name: str, **labels: str) -> float | None:
        return self.values.get(name, {}).get(tuple(sorted(labels.items())))

    def series(self, name: str) -> dict[Labels, float]:
        return self.values.get(name, {})


def parse_metrics(text: str, t: float) -> Scrape:
    values: dict[str, dict[Labels, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            values.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = float(s.value)
    return Scrape(t, values)


def fetch(url: str, timeout: float = 5.0) -> Scrape:
    """GET the exposition text (raises OSError / urllib.error.URLError)."""
    req = urllib.request.Request(url, headers={"Accept": "text/plain; version=0.0.4"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        body = r.read().decode()
    return parse_metrics(body, time.monotonic())


@dataclass
class TopView:
    info: dict[str, str] = field(default_factory=dict)
    ready: bool | None = None
    uptime_s: float | None = None
    slots: float | None = None
    leased: float | None = None
    in_flight: float | None = None
    interval_s: float | None = None
    #: per second over the last interval; None on the first frame or after a counter reset
    completed_per_s: float | None = None  # requests completed as callers saw them (ok, every op)
    served_per_s: float | None = None  # requests served by the sidecar
    batches_per_s: float | None = None
    batch_mean: float | None = None  # over the last interval (else since start)
    batch_p50_le: float | None = None  # upper bound of the bucket holding the median batch size
    batch_max_le: float | None = None  # upper bound of the largest non-empty bucket
    e2e_q: dict[str, dict[str, float]] = field(default_factory=dict)  # op -> quantile -> seconds
    stage_q: dict[str, dict[str, float]] = field(default_factory=dict)  # stage -> quantile -> s
    window_samples: dict[str, float] = field(default_factory=dict)  # op -> samples in its window
    errors: dict[str, tuple[float, float | None]] = field(default_factory=dict)  # kind -> (total, /s)
    client_errors: float | None = None
    client_timeouts: float | None = None
    rows: dict[str, float] = field(default_factory=dict)
    #: the backend's search paths: path -> (searches/s, mean wall time s, queries redone/s) over
    #: the last interval (since start on the first frame: searches as a total, no rates)
    paths: dict[str, PathLine] = field(default_factory=dict)
    memory_bytes: dict[str, float] = field(default_factory=dict)  # part -> bytes


@dataclass
class PathLine:
    """One search path of the backend in a frame (None: not known in this frame)."""

    searches: float  # over the interval (since start on the first frame)
    per_s: float | None  # searches per second (None on the first frame)
    mean_s: float | None  # mean wall time of those searches
    redone_per_s: float | None  # queries redone in float32 per second (proving paths)


def _by_label(s: Scrape, name: str, key: str) -> dict[str, float]:
    """The series of ``name`` summed by the value of label ``key``."""
    out: dict[str, float] = {}
    for labels, val in s.series(name).items():
        k = dict(labels).get(key)
        if k is not None:
            out[k] = out.get(k, 0.0) + val
    return out


def _paths(cur: Scrape, prev: Scrape | None) -> dict[str, PathLine]:
    """Searches, their mean time and redone queries by path, from the increase since ``prev``
    (from the totals when there is none, or the sidecar restarted)."""
    n1 = _by_label(cur, "kalos_backend_searches_total", "path")
    t1 = _by_label(cur, "kalos_backend_search_seconds_total", "path")
    r1 = _by_label(cur, "kalos_backend_redone_queries_total", "path")
    dt = None if prev is None else cur.t - prev.t
    n0 = t0 = r0 = {}
    if prev is not None:
        n0 = _by_label(prev, "kalos_backend_searches_total", "path")
        t0 = _by_label(prev, "kalos_backend_search_seconds_total", "path")
        r0 = _by_label(prev, "kalos_backend_redone_queries_total", "path")
        if any(n1.get(p, 0.0) < n for p, n in n0.items()) or not dt or dt <= 0:  # restarted: totals
            n0 = t0 = r0 = {}
            dt = None
    out: dict[str, PathLine] = {}
    for path, n in n1.items():
        dn = n - n0.get(path, 0.0)
        dtime = t1.get(path, 0.0) - t0.get(path, 0.0)
        dr = r1.get(path, 0.0) - r0.get(path, 0.0)
        if n <= 0:
            continue  # a path that never ran
        out[path] = PathLine(
            searches=dn,
            per_s=None if dt is None else dn / dt,
            mean_s=dtime / dn if dn > 0 else None,
            redone_per_s=None if dt is None or path not in r1 else dr / dt,
        )
    return out


def _rate(cur: Scrape, prev: Scrape | None, name: str, **labels: str) -> float | None:
    if prev is None:
        return None
    a, b = prev.get(name, **labels), cur.get(name, **labels)
    dt = cur.t - prev.t
    if a is None or b is None or dt <= 0 or b < a:  # b < a: the sidecar restarted
        return None
    return (b - a) / dt


def _sum_rate(cur: Scrape, prev: Scrape | None, name: str, **labels: str) -> float | None:
    """Per second, the increase of the sum of every series of ``name`` with ``labels`` (a series
    new since ``prev`` counts from 0: an op's series appear with its first request)."""
    if prev is None or cur.t <= prev.t:
        return None
    total = 0.0
    for lb, b in cur.series(name).items():
        if labels.items() <= dict(lb).items():
            a = prev.series(name).get(lb, 0.0)
            if b < a:  # the sidecar restarted
                return None
            total += b - a
    return total / (cur.t - prev.t) if cur.series(name) else None


def _sum(s: Scrape, name: str, **labels: str) -> float | None:
    vals = [v for lb, v in s.series(name).items() if labels.items() <= dict(lb).items()]
    return sum(vals) if vals else None


def _buckets(s: Scrape, name: str) -> list[tuple[float, float]]:
    """[(le, cumulative count)] sorted by le."""
    out = []
    for labels, v in s.series(name + "_bucket").items():
        le = dict(labels).get("le")
        if le is not None:
            out.append((float(le), v))
    return sorted(out)


def compute_view(cur: Scrape, prev: Scrape | None = None) -> TopView:
    """What one frame shows: gauges from ``cur``, rates from the increase since ``prev``."""
    v = TopView()
    for labels, _val in cur.series("kalos_backend_info").items():
        v.info = dict(labels)
    r = cur.get("kalos_ready")
    v.ready = None if r is None else r >= 1
    v.uptime_s = cur.get("kalos_uptime_seconds")
    v.slots = cur.get("kalos_slots")
    v.leased = cur.get("kalos_slots_leased")
    v.in_flight = cur.get("kalos_slots_in_flight")
    v.interval_s = None if prev is None else cur.t - prev.t
    v.completed_per_s = _sum_rate(cur, prev, "kalos_client_requests_total", outcome="ok")
    v.served_per_s = _rate(cur, prev, "kalos_requests_total")
    v.batches_per_s = _rate(cur, prev, "kalos_batches_total")

    # Batch sizes: from the histogram's increase over the interval (since start on the first
    # frame or after a restart of the sidecar).
    cb = _buckets(cur, "kalos_batch_size")
    csum, ccount = cur.get("kalos_batch_size_sum"), cur.get("kalos_batch_size_count")
    psum = prev.get("kalos_batch_size_sum") if prev is not None else None
    pcount = prev.get("kalos_batch_size_count") if prev is not None else None
    if csum is not None and ccount is not None:
        if psum is not None and pcount is not None and ccount >= pcount:
            pb = dict(_buckets(prev, "kalos_batch_size")) if prev is not None else {}
            cb = [(le, c - pb.get(le, 0.0)) for le, c in cb]
            csum, ccount = csum - psum, ccount - pcount
        if ccount > 0:
            v.batch_mean = csum / ccount
    if cb and cb[-1][1] > 0:
        total = cb[-1][1]
        v.batch_p50_le = next(le for le, c in cb if c >= total / 2)
        v.batch_max_le = next(le for le, c in cb if c >= total)

    for labels, val in cur.series("kalos_client_latency_window_seconds").items():
        d = dict(labels)
        v.e2e_q.setdefault(d["op"], {})[d["quantile"]] = val
    for labels, val in cur.series("kalos_stage_latency_window_seconds").items():
        d = dict(labels)
        v.stage_q.setdefault(d["stage"], {})[d["quantile"]] = val
    for labels, val in cur.series("kalos_client_latency_window_samples").items():
        v.window_samples[dict(labels)["op"]] = val
    for labels, val in cur.series("kalos_errors_total").items():
        kind = dict(labels)["kind"]
        v.errors[kind] = (val, _rate(cur, prev, "kalos_errors_total", kind=kind))
    v.client_errors = _sum(cur, "kalos_client_requests_total", outcome="error")
    v.client_timeouts = _sum(cur, "kalos_client_requests_total", outcome="timeout")
    for labels, val in cur.series("kalos_memory_rows").items():
        v.rows[dict(labels)["namespace"]] = val
    v.paths = _paths(cur, prev)
    v.memory_bytes = _by_label(cur, "kalos_backend_memory_bytes", "part")
    return v


def _bytes(b: float | None) -> str:
    if b is None:
        return "-"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= size:
            return f"{b / size:.1f} {unit}"
    return f"{b:.0f} B"


def _num(x: float | None, fmt: str = "{:,.0f}") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return fmt.format(x)


def _dur(s: float | None) -> str:
    if s is None or math.isnan(s):
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.0f} µs"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"


def _uptime(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(s)
    d, h, m = s // 86400, s % 86400 // 3600, s % 3600 // 60
    return f"{d}d{h:02d}h" if d else f"{h}h{m:02d}m" if h else f"{m}m{s % 60:02d}s"


def render(v: TopView, url: str = "") -> RenderableType:
    info = v.info
    head = Text()
    head.append(f"kalos top  {url}\n", style="bold")
    head.append("READY" if v.ready else "NOT READY", style="green" if v.ready else "red")
    head.append(
        f"  up {_uptime(v.uptime_s)}  broker {info.get('broker', '?')}  "
        f"{info.get('description', '?')}  dim {info.get('dim', '?')} {info.get('dtype', '')} "
        f"{info.get('metric', '')}"
    )

    load = Table.grid(padding=(0, 2))
    for _ in range(4):
        load.add_column(justify="right")
    load.add_row("slots", f"{_num(v.in_flight)} in flight", f"{_num(v.leased)} leased", f"{_num(v.slots)} total")
    load.add_row(
        "throughput",
        f"{_num(v.completed_per_s)} done/s",
        f"{_num(v.served_per_s)} served/s",
        f"{_num(v.batches_per_s)} batches/s",
    )
    load.add_row(
        "batch size",
        f"mean {_num(v.batch_mean, '{:.2f}')}",
        f"p50 ≤ {_num(v.batch_p50_le)}",
        f"max ≤ {_num(v.batch_max_le)}",
    )

    lat = Table(
        title="latency of recent requests (end to end: by kind of call)", title_justify="left", box=None, pad_edge=False
    )
    lat.add_column("")
    for col in ("P50", "P95", "P99", "window"):
        lat.add_column(col, justify="right")
    keys = ("0.5", "0.95", "0.99")
    for op, q in sorted(v.e2e_q.items(), key=lambda kv: (kv[0] != "recall", kv[0])):
        n = v.window_samples.get(op)
        if op == "recall" or n:  # the kinds of call seen lately
            lat.add_row(f"end to end: {op}", *(_dur(q.get(k)) for k in keys), _num(n))
    for stage, label in (
        ("queue_wait", "sidecar queue wait"),
        ("compute", "batch compute"),
        ("service", "sidecar service"),
    ):
        sq = v.stage_q.get(stage, {})
        lat.add_row(label, *(_dur(sq.get(k)) for k in keys), "")

    err = Table(title="errors", title_justify="left", box=None, pad_edge=False)
    err.add_column("kind")
    err.add_column("total", justify="right")
    err.add_column("/s", justify="right")
    shown = [(k, tot, rate) for k, (tot, rate) in sorted(v.errors.items()) if tot > 0]
    for k, tot, rate in shown:
        err.add_row(k, _num(tot), _num(rate, "{:,.1f}"))
    err.add_row("client-side errors", _num(v.client_errors), "")
    err.add_row("client timeouts/cancels", _num(v.client_timeouts), "")

    paths = Table(title="search paths (backend)", title_justify="left", box=None, pad_edge=False)
    for col in ("path", "searches/s", "mean time", "share", "redone/s"):
        paths.add_column(col, justify="left" if col == "path" else "right")
    total = sum(pl.searches for pl in v.paths.values())
    for path, pl in sorted(v.paths.items(), key=lambda kv: -kv[1].searches):
        share = f"{100 * pl.searches / total:.0f} %" if total > 0 else "-"
        paths.add_row(path, _num(pl.per_s), _dur(pl.mean_s), share, _num(pl.redone_per_s, "{:,.1f}"))

    mem = Table(title="memory rows", title_justify="left", box=None, pad_edge=False)
    mem.add_column("namespace")
    mem.add_column("rows", justify="right")
    for ns, n in sorted(v.rows.items(), key=lambda kv: -kv[1]):
        mem.add_row(ns, _num(n))
    held = Text(
        "backend memory  "
        + "  ".join(f"{part} {_bytes(b)}" for part, b in sorted(v.memory_bytes.items(), key=lambda kv: -kv[1]) if b > 0)
    )
    return Group(head, Text(""), load, Text(""), lat, Text(""), paths, Text(""), err, Text(""), mem, held)


def listening_sockets(table: str, inodes: Collection[int]) -> list[tuple[str, int]]:
    """(host, port) of the listening sockets among ``inodes`` in a ``/proc/net/tcp`` or
    ``tcp6`` table. Pure."""
    out = []
    for line in table.splitlines()[1:]:
        f = line.split()
        if len(f) < 10 or f[3] != _LISTEN or not f[9].isdigit() or int(f[9]) not in inodes:
            continue
        addr_hex, port_hex = f[1].split(":")
        raw = bytes.fromhex(addr_hex)
        if sys.byteorder == "little":  # the kernel prints each 32-bit word in host order
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
        out.append((str(ipaddress.ip_address(raw)), int(port_hex, 16)))
    return out


def metrics_url(host: str, port: int) -> str:
    """The /metrics URL of a socket listening on (host, port); a wildcard address is reached on
    loopback. Pure."""
    ip = ipaddress.ip_address(host)
    if ip.is_unspecified:
        ip = ipaddress.ip_address("127.0.0.1" if ip.version == 4 else "::1")
    return f"http://{ip}:{port}/metrics" if ip.version == 4 else f"http://[{ip}]:{port}/metrics"


def sidecar_endpoints(pid: int) -> list[str] | None:
    """/metrics URLs of the TCP sockets process ``pid`` listens on; None if its file descriptors
    cannot be read here (another user, another PID namespace, gone)."""
    try:
        inodes = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue  # closed meanwhile
            if link.startswith("socket:["):
                inodes.add(int(link[8:-1]))
        urls = []
        for table in ("tcp", "tcp6"):
            try:
                with open(f"/proc/{pid}/net/{table}", encoding="ascii") as f:
                    text = f.read()
            except FileNotFoundError:  # no IPv6
                continue
            urls += [metrics_url(h, p) for h, p in listening_sockets(text, inodes)]
        return urls
    except OSError:
        return None


def find_metrics_url(name: str, scrape: Callable[[str], Scrape] | None = None) -> str:
    """The /metrics URL of the sidecar serving broker ``name`` (see the module docstring).
    Raises ConfigError saying what was tried and why it did not fit."""
    get = scrape or (lambda url: fetch(url, timeout=2.0))
    pid = live_sidecar(name)
    found = None if pid is None else sidecar_endpoints(pid)
    tried = []
    for url in [*(found or []), DEFAULT_URL]:
        try:
            s = get(url)
        except (OSError, ValueError) as e:  # URLError is an OSError
            tried.append(f"{url}: {getattr(e, 'reason', e)}")
            continue
        brokers = sorted({dict(labels).get("broker", "?") for labels in s.series("kalos_backend_info")})
        if name in brokers:
            return url
        tried.append(f"{url} serves broker {', '.join(brokers) or '?'}")
    if pid is None:
        why = "no sidecar serves it"
    elif found is None:
        why = f"its sidecar's (pid {pid}) sockets cannot be read from here"
    elif not found:
        why = f"its sidecar (pid {pid}) listens on no TCP port: start it with --metrics-port PORT"
    else:
        why = f"no endpoint of its sidecar (pid {pid}) answered as broker {name!r}"
    raise ConfigError(
        f"cannot find the metrics endpoint of broker {name!r}: {why}; tried "
        f"{'; '.join(tried)}. Give --url http://HOST:PORT/metrics (the sidecar's "
        "--metrics-host and --metrics-port)"
    )


class Keys:
    """Key presses from a terminal as they are typed (cbreak mode: no Enter needed, Ctrl-C still
    interrupts), the terminal's settings restored on exit. Elsewhere :meth:`wait` just sleeps."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = sys.stdin if stream is None else stream
        self._fd: int | None = None
        self._saved: list[Any] | None = None

    def __enter__(self) -> Keys:
        try:
            if self._stream.isatty():
                fd = self._stream.fileno()
                self._saved = termios.tcgetattr(fd)
                self._fd = fd
                tty.setcbreak(fd)
        except (OSError, ValueError, termios.error):  # closed or not a real terminal
            self._fd = None
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        if self._fd is not None and self._saved is not None:
            termios.tcsetattr(self._fd, termios.TCSADRAIN, self._saved)
            self._fd = None

    def wait(self, seconds: float) -> str:
        """A key typed within ``seconds`` (returned at once), or "" when none was."""
        if self._fd is None:
            time.sleep(seconds)
            return ""
        ready, _, _ = select.select([self._fd], [], [], seconds)
        if not ready:
            return ""
        return os.read(self._fd, 1).decode(errors="replace")


def run_top(
    url: str, interval: float, once: bool = False, console: Console | None = None, keys: Keys | None = None
) -> int:
    """Show the live view until ``q`` or Ctrl-C (``once``: scrape twice, ``interval`` seconds
    apart, print one frame with rates and exit). ``keys``: where keys are read (default: stdin).
    Where the console is not a terminal (a pipe, a file, a log) a live view would print nothing:
    one plain frame is printed every ``interval`` seconds instead (:func:`print_frames`).
    Returns 0, or 1 if the endpoint cannot be read."""
    console = console or Console()
    interval = max(0.05, float(interval))

    def get() -> Scrape | None:
        try:
            return fetch(url, timeout=max(2.0, interval))
        except (OSError, ValueError) as e:  # URLError is an OSError
            reason = getattr(e, "reason", e)
            console.print(f"kalos top: cannot read {url}: {reason}", style="red")
            return None

    prev = get()
    if prev is None:
        return 1
    if once:
        time.sleep(interval)
        cur = get()
        if cur is None:
            return 1
        console.print(render(compute_view(cur, prev), url))
        return 0
    if not console.is_terminal:
        return print_frames(console, url, prev, interval, get)
    keys = Keys() if keys is None else keys
    try:
        with (
            keys as k,
            Live(render(compute_view(prev), url), console=console, auto_refresh=False, screen=False) as live,
        ):
            while True:
                end = time.monotonic() + interval
                while (left := end - time.monotonic()) > 0:
                    if k.wait(left) in QUIT_KEYS:
                        return 0
                try:
                    cur = fetch(url, timeout=max(2.0, interval))
                except (OSError, ValueError) as e:
                    live.update(
                        Text(f"kalos top: cannot read {url}: {getattr(e, 'reason', e)} (retrying)", style="red"),
                        refresh=True,
                    )
                    continue
                live.update(render(compute_view(cur, prev), url), refresh=True)
                prev = cur
    except KeyboardInterrupt:
        return 0


def print_frames(
    console: Console, url: str, prev: Scrape, interval: float, get: Callable[[], Scrape | None], frames: int = 0
) -> int:
    """``kalos top`` where output is not a terminal (as ``top -b``): a frame with the rates of
    the last ``interval`` seconds, every ``interval`` seconds, each one printed whole and flushed
    (so ``kalos top | grep``, ``tee`` or a log see it at once), until Ctrl-C, the reader closing
    the pipe, or ``frames`` frames (0: no limit). An endpoint that cannot be read prints a line
    (``get`` does) and is tried again. Returns 0."""
    shown = 0
    try:
        while not frames or shown < frames:
            time.sleep(interval)
            cur = get()
            if cur is None:
                continue
            console.print(render(compute_view(cur, prev), url))
            console.print()
            console.file.flush()
            prev = cur
            shown += 1
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:  # (kalos top | head): the reader has what it wanted
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, console.file.fileno())  # no second error when the interpreter flushes
            os.close(devnull)
        except (OSError, ValueError):  # not a file with a descriptor
            pass
    return 0


__all__ = [
    "run_top",
    "print_frames",
    "compute_view",
    "render",
    "parse_metrics",
    "fetch",
    "Scrape",
    "TopView",
    "find_metrics_url",
    "listening_sockets",
    "metrics_url",
    "Keys",
    "DEFAULT_URL",
]
