"""A real Prometheus server scrapes a real sidecar under load; the deploy/ files are checked by the
tools that consume them (promtool, Prometheus' query engine; the systemd unit: tests/ops/test_deploy.py).

The Debian ``prometheus`` package is installed here when missing (``apt-get install``, as root;
about 20 s on a fresh machine), otherwise the Prometheus tests are skipped with the reason.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from kalos.clients import RecallPool
from kalos.testing.sidecar import start_sidecar_process, stop_sidecar_process
from kalos.sidecar_cuda.objects import cleanup
from conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"

pytestmark = pytest.mark.timeout(180)


def _install_prometheus() -> str | None:
    """Path of the prometheus binary, installing the Debian package if needed; None + reason."""
    found = shutil.which("prometheus")
    if found:
        return found
    if os.geteuid() != 0:
        pytest.skip("prometheus is not installed and installing it needs root "
                    "(apt-get install prometheus)")
    if shutil.which("apt-get") is None:
        pytest.skip("prometheus is not installed and there is no apt-get to install it")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "prometheus"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:  # a fresh machine may have no package lists yet
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=300)
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    found = shutil.which("prometheus")
    if r.returncode != 0 or not found:
        pytest.skip(f"apt-get install prometheus failed (exit {r.returncode}): "
                    f"{(r.stderr or r.stdout).strip()[-400:]}")
    return found


@pytest.fixture(scope="module")
def prometheus_bin() -> str:
    return _install_prometheus()


def http_json(url: str, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read().decode())


def wait_for(pred, timeout: float, step: float = 0.2):
    end = time.monotonic() + timeout
    while True:
        try:
            v = pred()
            if v:
                return v
        except (OSError, ValueError, KeyError, IndexError):
            pass
        if time.monotonic() > end:
            return None
        time.sleep(step)


class Prometheus:
    def __init__(self, binary: str, workdir: Path, target_port: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        shutil.copy(DEPLOY / "kalos-alerts.yml", workdir / "kalos-alerts.yml")
        cfg = workdir / "prometheus.yml"
        cfg.write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 900ms\n  evaluation_interval: 1s\n"
            "rule_files: [kalos-alerts.yml]\n"
            "scrape_configs:\n  - job_name: kalos\n    static_configs:\n"
            f"      - targets: ['127.0.0.1:{target_port}']\n")
        self.log = open(workdir / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={cfg}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=workdir)

    def wait_ready(self, timeout: float = 60.0) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited with {self.proc.returncode}")
            with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                return r.status == 200
        assert wait_for(ready, timeout), "prometheus not ready"

    def query(self, expr: str) -> list[dict]:
        q = urllib.parse.urlencode({"query": expr, "time": f"{time.time():.3f}"})
        d = http_json(f"{self.url}/api/v1/query?{q}")
        assert d["status"] == "success", d
        return d["data"]["result"]

    def scalar(self, expr: str) -> float | None:
        res = self.query(expr)
        return float(res[0]["value"][1]) if res else None

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture
def sidecar_with_metrics():
    name = f"t-metrics-{os.getpid()}-prom"
    for attempt in range(3):
        port = free_port()
        try:
            proc = start_sidecar_process(["--ephemeral", "--dim", "32", "--random-rows", "1000",
                                          "--backend", "numpy", "--slots", "16",
                                          "--metrics-port", str(port)], name)
            break
        except RuntimeError:
            if attempt == 2:
                raise
    yield SimpleNamespace(name=name, port=port)
    stop_sidecar_process(proc)
    cleanup(name, force=True)


async def _load(name: str, seconds: float, tasks: int, seed: int, at_least: int = 0) -> list[int]:
    """Recall latencies (ns) of ``tasks`` tasks recalling for ``seconds``, and on until there are
    ``at_least`` of them (a loaded machine is slower, not a reason to test less)."""
    rng = np.random.default_rng(seed)
    qs = rng.standard_normal((256, 32)).astype(np.float32)
    lat: list[int] = []
    async with RecallPool(name, size=tasks) as pool:
        end = time.monotonic() + seconds

        async def worker(t: int) -> None:
            j = t
            while time.monotonic() < end or len(lat) < at_least:
                t0 = time.perf_counter_ns()
                await pool.recall(qs[j % len(qs)], k=5)
                lat.append(time.perf_counter_ns() - t0)
                j += tasks
                if j % 64 == 0:
                    await asyncio.sleep(0.0005)  # leave the 2-core machine some air for Prometheus

        await asyncio.gather(*(worker(t) for t in range(tasks)))
    return lat


def _dashboard_exprs() -> list[str]:
    dash = json.loads((DEPLOY / "grafana-kalos-dashboard.json").read_text())
    exprs = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            exprs.append(t["expr"].replace("$instance", ".*").replace("$__rate_interval", "1m"))
    return exprs


@pytest.mark.timeout(900)  # includes installing prometheus on a fresh machine
def test_real_prometheus_scrapes_the_sidecar(prometheus_bin, sidecar_with_metrics, tmp_path):
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"[seed] {seed}")
    sc = sidecar_with_metrics
    prom = Prometheus(prometheus_bin, tmp_path, sc.port)
    try:
        prom.wait_ready()
        assert wait_for(lambda: prom.scalar('up{job="kalos"}') == 1.0, 20), "target never up"
        lat = asyncio.run(_load(sc.name, seconds=5.0, tasks=4, seed=seed, at_least=600))
        total = len(lat)
        assert total > 500
        # Wait for a scrape taken after the load: Prometheus' counter then equals what we sent.
        got = wait_for(lambda: prom.scalar("kalos_recall_latency_seconds_count") == total, 20)
        assert got, (prom.scalar("kalos_recall_latency_seconds_count"), total)

        client = np.asarray(lat, np.float64) / 1e9
        c99 = float(np.percentile(client, 99))
        c50 = float(np.percentile(client, 50))
        h99 = prom.scalar(
            "histogram_quantile(0.99, sum(rate(kalos_recall_latency_seconds_bucket[30s])) by (le))")
        g99 = prom.scalar('kalos_recall_latency_quantile_seconds{quantile="0.99"}')
        h50 = prom.scalar(
            "histogram_quantile(0.5, sum(rate(kalos_recall_latency_seconds_bucket[30s])) by (le))")
        print(f"client p50 {c50 * 1e6:.0f} us p99 {c99 * 1e6:.0f} us; prometheus histogram p50 "
              f"{h50 * 1e6:.0f} us p99 {h99 * 1e6:.0f} us; gauge p99 {g99 * 1e6:.0f} us")
        # Same requests measured from both sides; bucket interpolation and clocks differ a little.
        assert c99 / 3 <= h99 <= c99 * 3, (h99, c99)
        assert c99 / 3 <= g99 <= c99 * 3, (g99, c99)
        assert c50 / 3 <= h50 <= c50 * 3, (h50, c50)
        assert h50 <= h99
        assert prom.scalar('sum(kalos_client_requests_total{outcome="ok"})') == total
        assert prom.scalar("kalos_requests_total") == total
        rate = prom.scalar('sum(rate(kalos_client_requests_total{outcome="ok"}[30s]))')
        assert rate is not None and rate > 0

        # Every dashboard query evaluates, and those about recalls have data.
        empty = []
        for expr in _dashboard_exprs():
            if not prom.query(expr) and "> 0" not in expr:  # error panels are empty without errors
                empty.append(expr)
        assert not empty, f"dashboard queries without data: {empty}"
        # The shipped alert rules load and evaluate; none fires on a healthy sidecar.
        def rules_evaluated() -> list[dict] | None:
            groups = http_json(prom.url + "/api/v1/rules")["data"]["groups"]
            rules = [r for g in groups for r in g["rules"]]
            return rules if rules and all(r.get("lastEvaluation", "").startswith("20")
                                          and r["health"] == "ok" for r in rules) else None
        rules = wait_for(rules_evaluated, 15)
        assert rules, http_json(prom.url + "/api/v1/rules")
        firing = [r["name"] for r in rules if r.get("state") == "firing"]
        assert not firing, firing
    finally:
        prom.stop()


# --------------------------------------------------------------------------- deploy files

def test_deploy_prometheus_config_and_rules_are_valid(prometheus_bin):
    promtool = shutil.which("promtool") or str(Path(prometheus_bin).with_name("promtool"))
    if not os.path.exists(promtool):
        pytest.skip("promtool not installed")
    r = subprocess.run([promtool, "check", "config", str(DEPLOY / "prometheus.yml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run([promtool, "check", "rules", str(DEPLOY / "kalos-alerts.yml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dashboard_uses_microsecond_histograms_and_known_metrics():
    from prometheus_client import CollectorRegistry

    import importlib.util

    from kalos.sidecar_cuda.metrics import SidecarCollector

    # The unit tests' fake sidecar, loaded by path (tests/unit is on sys.path only when pytest
    # collected a file from it first).
    spec = importlib.util.spec_from_file_location("unit_test_metrics",
                                                  Path(__file__).parents[1] / "unit" / "test_metrics.py")
    assert spec is not None and spec.loader is not None
    unit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(unit)
    fake_sidecar = unit.fake_sidecar

    reg = CollectorRegistry()
    reg.register(SidecarCollector(fake_sidecar()))
    exported = set()
    for m in reg.collect():
        exported.update(s.name for s in m.samples)
        exported.add(m.name)
    exported.add("process_cpu_seconds_total")  # the ProcessCollector of the default registry
    exported.add("up")
    exprs = _dashboard_exprs()
    used = set()
    for e in exprs:
        used.update(n for n in re.findall(r"\b([a-z_]+_(?:total|bucket|sum|count|seconds|info|rows|slots|"
                                          r"leased|flight|ready|size))\b", e))
    assert used and used <= exported, used - exported
    for q in ("0.5", "0.95", "0.99"):
        assert any(f"histogram_quantile({q}, sum by (le) (rate(kalos_recall_latency_seconds_bucket" in e
                   and "[1m]" in e for e in exprs), q
    for stage in ("kalos_queue_wait_seconds", "kalos_batch_compute_seconds", "kalos_service_seconds"):
        assert sum(f"rate({stage}_bucket" in e for e in exprs) == 3, stage

