"""``/metrics``, ``/healthz`` and ``/readyz`` of a sidecar over HTTP, from background threads of
the sidecar process (:class:`MetricsServer`). It listens on loopback unless told otherwise: the
endpoint has no authentication."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.exposition import choose_encoder

from ...broker.errors import ConfigError
from ...broker.layout import SidecarState
from .collector import SidecarCollector, SidecarView
from .exposition import TEXT_CONTENT_TYPE, TextEncoder, wants_openmetrics_only

log = logging.getLogger("kalos.metrics")


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    protocol_version = "HTTP/1.1"
    timeout = 30  # seconds an idle keep-alive connection is kept

    def do_GET(self) -> None:
        self._serve(body=True)

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def _serve(self, body: bool) -> None:
        path = self.path.split("?", 1)[0]
        owner = self.server.owner
        if path == "/metrics":
            try:
                accept = self.headers.get("Accept", "")
                if wants_openmetrics_only(accept):
                    encoder, ctype = choose_encoder(accept)
                    payload = encoder(owner.registry)
                else:
                    ctype, payload = TEXT_CONTENT_TYPE, owner.encoder.encode(owner.registry)
                status = 200
            except Exception:  # a broken collector must not kill the endpoint
                log.exception("collecting metrics failed")
                status, ctype, payload = 500, "text/plain; charset=utf-8", b"collecting metrics failed\n"
        elif path == "/healthz":
            status, ctype, payload = 200, "text/plain; charset=utf-8", b"ok\n"
        elif path == "/readyz":
            ok, why = owner.readiness()
            status, ctype, payload = (200 if ok else 503), "text/plain; charset=utf-8", why.encode() + b"\n"
        else:
            status, ctype, payload = 404, "text/plain; charset=utf-8", b"not found: try /metrics, /healthz, /readyz\n"
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if body:
            self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    owner: MetricsServer


class _HTTPServer6(_HTTPServer):
    address_family = socket.AF_INET6


class MetricsServer:
    """``/metrics``, ``/healthz`` and ``/readyz`` of one sidecar, served from background threads.

    ``registry``: where the collector is registered; a fresh ``CollectorRegistry`` (with a
    ``ProcessCollector`` for the sidecar's CPU and memory) when None. ``port=0`` picks a free port
    (see :attr:`port`). ``start()`` raises ConfigError if the address cannot be bound; ``stop()``
    is idempotent.
    """

    def __init__(
        self,
        sidecar: SidecarView,
        host: str = "127.0.0.1",
        port: int = 9464,
        registry: CollectorRegistry | None = None,
        *,
        harvest_interval_s: float = 0.1,
        window_s: float = 60.0,
        window_samples: int = 20_000,
        namespace_labels: int = 10,
        degraded: Callable[[], str | None] | None = None,
    ) -> None:
        self.sidecar = sidecar
        #: Why a ready sidecar may serve stale data (a fleet replica cut off from its store):
        #: /readyz then still answers 200 (recalls are served) with this reason.
        self.degraded = degraded
        self.host = host
        self._port = port
        self.harvest_interval_s = harvest_interval_s
        if registry is None:
            registry = CollectorRegistry()
            ProcessCollector(registry=registry)
        self.registry = registry
        self.collector = SidecarCollector(
            sidecar, window_s=window_s, window_samples=window_samples, namespace_labels=namespace_labels
        )
        self.registry.register(self.collector)
        self.encoder = TextEncoder()
        self._httpd: _HTTPServer | None = None
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()

    @property
    def port(self) -> int:
        """The bound port once started (the one asked for before)."""
        return self._port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def readiness(self) -> tuple[bool, str]:
        sc = self.sidecar
        seg = sc.seg
        if seg is None or not sc.ready:
            return False, "not ready: loading"
        state = SidecarState(int(seg.header["state"]))
        if state != SidecarState.READY:
            return False, f"not ready: {state.name.lower()}"
        why = self.degraded() if self.degraded is not None else None
        return True, "ready" if why is None else why

    def start(self) -> None:
        if self._httpd is not None:
            return
        cls = _HTTPServer6 if ":" in self.host else _HTTPServer
        try:
            httpd = cls((self.host, self._port), _Handler)
        except OSError as e:
            raise ConfigError(f"metrics endpoint: cannot listen on {self.host}:{self._port}: {e}") from None
        httpd.owner = self
        self._httpd = httpd
        self._port = int(httpd.server_address[1])
        self._stop.clear()
        self.collector.attach()
        self._threads = [
            threading.Thread(
                target=httpd.serve_forever, kwargs={"poll_interval": 0.2}, name="kalos-metrics-http", daemon=True
            ),
            threading.Thread(target=self._harvest_loop, name="kalos-metrics-harvest", daemon=True),
        ]
        for t in self._threads:
            t.start()
        log.info("metrics on %s/metrics (also /healthz, /readyz)", self.url)

    def _harvest_loop(self) -> None:
        while not self._stop.wait(self.harvest_interval_s):
            try:
                self.collector.harvest()
            except Exception:  # keep harvesting; the scrape reports what it can
                log.exception("metrics harvest failed")

    def stop(self) -> None:
        if self._httpd is None:
            return
        self._stop.set()
        self.collector.detach()
        httpd, self._httpd = self._httpd, None
        httpd.shutdown()
        httpd.server_close()
        for t in self._threads:
            t.join(timeout=5)
        self._threads = []

    def __enter__(self) -> MetricsServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
