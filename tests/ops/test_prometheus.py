"""A real Prometheus server scrapes a real sidecar under load; the deploy/ files are checked by the
tools that consume them (promtool, Prometheus' query engine; the systemd unit: tests/ops/test_deploy.py).
The scrape jobs are made from the shipped files (deploy/prometheus.yml, the PodMonitors) so the
alerts and the dashboard are checked against the labels those produce.

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
from conftest import free_port

from kalos.clients import RecallPool
from kalos.sidecar_cuda.serving.objects import cleanup
from kalos.testing.sidecar import start_sidecar_process, stop_sidecar_process

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"

pytestmark = pytest.mark.timeout(180)


def _install_prometheus() -> str | None:
    """Path of the prometheus binary, installing the Debian package if needed; None + reason."""
    found = shutil.which("prometheus")
    if found:
        return found
    if os.geteuid() != 0:
        pytest.skip("prometheus is not installed and installing it needs root (apt-get install prometheus)")
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
        pytest.skip(f"apt-get install prometheus failed (exit {r.returncode}): {(r.stderr or r.stdout).strip()[-400:]}")
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
    """A Prometheus on a free port with ``scrape_configs`` (every 1 s) and the shipped alert rules."""

    def __init__(self, binary: str, workdir: Path, port: int, scrape_configs: list[dict]) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{self.port}"
        shutil.copy(DEPLOY / "kalos-alerts.yml", workdir / "kalos-alerts.yml")
        cfg = workdir / "prometheus.yml"
        cfg.write_text(
            json.dumps(
                {  # JSON is YAML
                    "global": {"scrape_interval": "1s", "scrape_timeout": "900ms", "evaluation_interval": "1s"},
                    "rule_files": ["kalos-alerts.yml"],
                    "scrape_configs": scrape_configs,
                },
                indent=1,
            )
        )
        self.log = open(workdir / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={cfg}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=workdir,
        )

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
            proc = start_sidecar_process(
                [
                    "--ephemeral",
                    "--dim",
                    "32",
                    "--random-rows",
                    "1000",
                    "--backend",
                    "numpy",
                    "--slots",
                    "16",
                    "--metrics-port",
                    str(port),
                ],
                name,
            )
            break
        except RuntimeError:
            if attempt == 2:
                raise
    yield SimpleNamespace(name=name, port=port)
    stop_sidecar_process(proc)
    cleanup(name, force=True)


BULK_ROWS = 20_000  # upserted before the recall load: 625 chunks of 32 rows


async def _load(name: str, seconds: float, tasks: int, seed: int, at_least: int = 0) -> list[int]:
    """A bulk upsert (namespace "bulk"), then recalls from ``tasks`` tasks for ``seconds``, and on
    until there are ``at_least`` of them (a loaded machine is slower, not a reason to test less);
    returns the recalls' latencies (ns) as the callers measured them."""
    rng = np.random.default_rng(seed)
    qs = rng.standard_normal((256, 32)).astype(np.float32)
    lat: list[int] = []
    async with RecallPool(name, size=tasks) as pool:
        bulk = rng.standard_normal((BULK_ROWS, 32)).astype(np.float32)
        assert await pool.upsert(np.arange(BULK_ROWS), bulk, namespace="bulk", timeout=300) == BULK_ROWS
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


def _dashboard() -> dict:
    return json.loads((DEPLOY / "grafana-kalos-dashboard.json").read_text())


def _dashboard_exprs(instance: str = ".*") -> list[str]:
    exprs = []
    for p in _dashboard()["panels"]:
        for t in p.get("targets", []):
            exprs.append(t["expr"].replace("$instance", instance).replace("$__rate_interval", "1m"))
    return exprs


def _panel_exprs(title_start: str) -> list[str]:
    (panel,) = [p for p in _dashboard()["panels"] if p["title"].startswith(title_start)]
    return [t["expr"].replace("$instance", ".*") for t in panel["targets"]]


def _alerts() -> dict[str, str]:
    import yaml

    rules = yaml.safe_load((DEPLOY / "kalos-alerts.yml").read_text())
    return {r["alert"]: r["expr"] for g in rules["groups"] for r in g["rules"]}


def _yaml(path: Path) -> dict:
    import yaml

    doc: dict = yaml.safe_load(path.read_text())
    return doc


PODMONITORS = sorted((DEPLOY / "kubernetes").glob("*/podmonitor.yaml"))
_RELABEL_KEYS = {
    "sourceLabels": "source_labels",
    "targetLabel": "target_label",
    "separator": "separator",
    "regex": "regex",
    "replacement": "replacement",
    "action": "action",
    "modulus": "modulus",
}


def _host_job(targets: list[str]) -> dict:
    """deploy/prometheus.yml's Kalos job on ``targets``, under another job name: nothing may
    depend on the name."""
    (job,) = _yaml(DEPLOY / "prometheus.yml")["scrape_configs"]
    job = dict(job, job_name="kalos-on-this-host")
    job["static_configs"] = [{"targets": targets, "labels": job["static_configs"][0].get("labels", {})}]
    return job


def _podmonitor_job(path: Path, k8s_namespace: str, targets: list[str]) -> dict:
    """The scrape job the Prometheus Operator makes of a shipped PodMonitor, on static targets: the
    target labels it adds (job "<namespace>/<name>", namespace, pod, container, endpoint), then
    the PodMonitor's own honorLabels and relabelings."""
    pm = _yaml(path)
    assert pm["kind"] == "PodMonitor"
    (ep,) = pm["spec"]["podMetricsEndpoints"]
    relabel: list[dict] = [{"target_label": "job", "replacement": f"{k8s_namespace}/{pm['metadata']['name']}"}]
    for r in ep.get("relabelings", []):
        conv = {_RELABEL_KEYS[k]: v for k, v in r.items()}
        if "action" in conv:
            conv["action"] = conv["action"].lower()
        relabel.append(conv)
    return {
        "job_name": f"podMonitor/{k8s_namespace}/{pm['metadata']['name']}/{path.parent.name}",
        "honor_labels": bool(ep.get("honorLabels", False)),
        "metrics_path": ep.get("path", "/metrics"),
        "static_configs": [
            {
                "targets": targets,
                "labels": {
                    "namespace": k8s_namespace,
                    "pod": f"{path.parent.name}-0",
                    "container": "kalos-sidecar",
                    "endpoint": ep["port"],
                },
            }
        ],
        "relabel_configs": relabel,
    }


@pytest.mark.timeout(900)  # includes installing prometheus on a fresh machine
def test_real_prometheus_scrapes_the_sidecar(prometheus_bin, sidecar_with_metrics, tmp_path):
    """One Prometheus, jobs made from the shipped files: the live sidecar through the PodMonitor of
    deploy/kubernetes/base (as the operator would scrape it, in Kubernetes namespace
    "kalos-system"), dead Kalos targets through deploy/prometheus.yml and each PodMonitor, and two
    targets that are not Kalos (Prometheus itself; a dead one)."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"[seed] {seed}")
    sc = sidecar_with_metrics
    port = free_port()
    live = f"127.0.0.1:{sc.port}"
    dead = {name: f"127.0.0.1:{free_port()}" for name in ["host", "other"] + [p.parent.name for p in PODMONITORS]}
    jobs = [_host_job([dead["host"]])]
    for path in PODMONITORS:
        targets = [dead[path.parent.name]] + ([live] if path.parent.name == "base" else [])
        jobs.append(_podmonitor_job(path, "kalos-system", targets))
    jobs += [
        {"job_name": "prometheus", "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]},
        {"job_name": "something-else", "static_configs": [{"targets": [dead["other"]]}]},
    ]
    prom = Prometheus(prometheus_bin, tmp_path, port, jobs)
    try:
        prom.wait_ready()
        assert wait_for(lambda: prom.scalar(f'up{{instance="{live}"}}') == 1.0, 20), "target never up"
        assert wait_for(lambda: len(prom.query("up")) == len(dead) + 2, 20), prom.query("up")
        lat = asyncio.run(_load(sc.name, seconds=5.0, tasks=4, seed=seed, at_least=600))
        total = len(lat)
        chunks = -(-BULK_ROWS // 32)
        assert total > 500
        # Wait for a scrape taken after the load: Prometheus' counter then equals what we sent.
        recalls = 'kalos_client_latency_seconds_count{op="recall"}'
        got = wait_for(lambda: prom.scalar(recalls) == total, 20)
        assert got, (prom.scalar(recalls), total)
        assert prom.scalar('kalos_client_latency_seconds_count{op="upsert"}') == chunks

        client = np.asarray(lat, np.float64) / 1e9
        c99 = float(np.percentile(client, 99))
        c50 = float(np.percentile(client, 50))
        sel = 'kalos_client_latency_seconds_bucket{op="recall"}'
        h99 = prom.scalar(f"histogram_quantile(0.99, sum(rate({sel}[30s])) by (le))")
        g99 = prom.scalar('kalos_client_latency_window_seconds{op="recall",quantile="0.99"}')
        h50 = prom.scalar(f"histogram_quantile(0.5, sum(rate({sel}[30s])) by (le))")
        # The shipped alert's own query: recalls only, whatever the bulk upsert before them took.
        alert_q = _alerts()["KalosRecallLatencyHigh"].split(" > 0.005")[0]
        a99 = prom.scalar(alert_q)
        u99 = prom.scalar(
            'histogram_quantile(0.99, sum(rate(kalos_client_latency_seconds_bucket{op="upsert"}[5m])) by (le))'
        )
        print(
            f"client p50 {c50 * 1e6:.0f} us p99 {c99 * 1e6:.0f} us; prometheus histogram p50 "
            f"{h50 * 1e6:.0f} us p99 {h99 * 1e6:.0f} us; summary p99 {g99 * 1e6:.0f} us; alert "
            f"query {a99 * 1e6:.0f} us; upsert chunks p99 {u99 * 1e6:.0f} us"
        )
        # Same requests measured from both sides; bucket interpolation and clocks differ a little.
        assert c99 / 3 <= h99 <= c99 * 3, (h99, c99)
        assert c99 / 3 <= g99 <= c99 * 3, (g99, c99)
        assert c50 / 3 <= h50 <= c50 * 3, (h50, c50)
        assert c99 / 3 <= a99 <= c99 * 3, (a99, c99)
        assert h50 <= h99
        assert prom.scalar('sum(kalos_client_requests_total{op="recall",outcome="ok"})') == total
        assert prom.scalar('sum(kalos_client_requests_total{outcome="ok"})') == total + chunks
        assert prom.scalar("kalos_requests_total") == total + chunks
        rate = prom.scalar('sum(rate(kalos_client_requests_total{outcome="ok"}[30s]))')
        assert rate is not None and rate > 0

        # Every dashboard query evaluates, and those about recalls have data.
        empty = []
        for expr in _dashboard_exprs():
            if not prom.query(expr) and "> 0" not in expr:  # error panels are empty without errors
                empty.append(expr)
        assert not empty, f"dashboard queries without data: {empty}"
        # Panels that select Kalos targets by their metrics, not by a job: the CPU of the sidecar
        # only (Prometheus itself exports process_cpu_seconds_total too); rows by the broker's
        # namespaces (the PodMonitor's honorLabels), not the pod's Kubernetes namespace.
        (cpu,) = _panel_exprs("Sidecar CPU")
        assert [r["metric"]["instance"] for r in prom.query(cpu)] == [live]
        (rows,) = _panel_exprs("Rows per namespace")
        assert {r["metric"].get("namespace") for r in prom.query(rows)} == {"default", "bulk"}
        # KalosDown finds the dead Kalos targets of every shipped config, and nothing else.
        down = prom.query(_alerts()["KalosDown"])
        assert sorted(r["metric"]["instance"] for r in down) == sorted(v for k, v in dead.items() if k != "other"), down

        # The shipped alert rules load and evaluate; on a healthy sidecar none fires but KalosDown
        # (pending or firing for the dead targets).
        def rules_evaluated() -> list[dict] | None:
            groups = http_json(prom.url + "/api/v1/rules")["data"]["groups"]
            rules = [r for g in groups for r in g["rules"]]
            return (
                rules
                if rules and all(r.get("lastEvaluation", "").startswith("20") and r["health"] == "ok" for r in rules)
                else None
            )

        rules = wait_for(rules_evaluated, 15)
        assert rules, http_json(prom.url + "/api/v1/rules")
        states = {r["name"]: r.get("state") for r in rules}
        assert states.pop("KalosDown") in ("pending", "firing")
        firing = [name for name, state in states.items() if state == "firing"]
        assert not firing, firing
    finally:
        prom.stop()


# --------------------------------------------------------------------------- deploy files


def _promtool(prometheus_bin: str) -> str:
    """promtool ships beside prometheus in Debian's package (installed by the fixture as root)."""
    promtool = shutil.which("promtool") or str(Path(prometheus_bin).with_name("promtool"))
    if not os.path.exists(promtool):
        pytest.skip("promtool not installed")
    return promtool


def test_deploy_prometheus_config_and_rules_are_valid(prometheus_bin):
    promtool = _promtool(prometheus_bin)
    r = subprocess.run(
        [promtool, "check", "config", str(DEPLOY / "prometheus.yml")], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run(
        [promtool, "check", "rules", str(DEPLOY / "kalos-alerts.yml")], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_promtool_check_metrics_passes_on_a_real_sidecar(prometheus_bin, sidecar_with_metrics):
    """Issue 22, item 6: the exposition of a sidecar that served every kind of call (and an error)
    passes ``promtool check metrics`` (no ``quantile`` label outside a summary, and the rest of its
    lint)."""
    from kalos.broker.errors import PayloadTooLarge
    from kalos.clients import RecallClient

    promtool = _promtool(prometheus_bin)
    sc = sidecar_with_metrics
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    vecs = rng.standard_normal((100, 32)).astype(np.float32)
    with RecallClient(sc.name) as c:
        c.upsert(np.arange(100), vecs, namespace="lint")
        c.recall(vecs[0], k=3, namespace="lint")
        c.recall_many(vecs[:3], k=3, namespace="lint")
        c.get(np.arange(40), namespace="lint")
        c.count("lint")
        c.namespaces()
        c.export_page("lint")
        c.delete(np.arange(50), namespace="lint")
        c.drop_namespace("lint")
        assert len(c.recall(vecs[0], k=3, namespace="missing")) == 0  # never written: no hits, no error
        c.upsert(np.arange(20), vecs[:20], [{"t": "x" * 15000}] * 20, namespace="big")
        with pytest.raises(PayloadTooLarge):  # an error the sidecar answers: the hits overflow the slot
            c.recall(vecs[0], k=20, namespace="big", with_payload=True)
    with urllib.request.urlopen(f"http://127.0.0.1:{sc.port}/metrics", timeout=10) as r:
        body = r.read()
    ops = set(re.findall(rb'kalos_client_latency_seconds_count\{op="(\w+)"\}', body))
    assert ops == {b"recall", b"recall_many", b"upsert", b"delete", b"get", b"other"}, ops
    r = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True, timeout=60)
    out = (r.stdout + r.stderr).decode()
    assert r.returncode == 0 and not out.strip(), out


def test_dashboard_declares_no_unused_input_and_every_panel_uses_the_datasource_variable():
    dash = _dashboard()
    used = json.dumps(dash["panels"]) + json.dumps(dash["templating"])
    for inp in dash.get("__inputs", []):  # an input is only there to be used
        assert "${" + inp["name"] + "}" in used, inp["name"]
    for p in dash["panels"]:
        for item in [p] + p.get("targets", []):
            if p["type"] != "row":
                assert item["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]


def test_dashboard_and_alerts_hard_code_no_job_and_recall_ones_select_op_recall():
    """Issue 22, item 7: the job name is the deployment's (the PodMonitors' is "<namespace>/kalos");
    Kalos targets are found by their metrics or by the label the shipped configs set (the real
    Prometheus test above checks what those select). Recall latency panels and alerts read
    op="recall" only (item 5)."""
    exprs = _dashboard_exprs() + list(_alerts().values())
    for e in exprs:
        assert not re.search(r"\bjob\s*(=|!=|=~|!~)", e), e
    # The label KalosDown selects by is set by every shipped scrape config.
    m = re.fullmatch(r'up\{(\w+)="([^"]+)"\} == 0', _alerts()["KalosDown"].strip())
    assert m, _alerts()["KalosDown"]
    label, value = m.groups()
    (host,) = _yaml(DEPLOY / "prometheus.yml")["scrape_configs"]
    assert all(sc["labels"][label] == value for sc in host["static_configs"])
    for path in PODMONITORS:
        (ep,) = _yaml(path)["spec"]["podMetricsEndpoints"]
        assert {"targetLabel": label, "replacement": value} in ep["relabelings"], path
    latency = _panel_exprs("recall() latency") + _panel_exprs("recall() P99") + [_alerts()["KalosRecallLatencyHigh"]]
    assert len(latency) == 5
    for e in latency:
        for sel in re.findall(r"kalos_client_latency_\w+\{[^}]*\}|kalos_client_latency_\w+\[", e):
            assert 'op="recall"' in sel, (sel, e)


def test_dashboard_uses_microsecond_histograms_and_known_metrics():
    import importlib.util

    from prometheus_client import CollectorRegistry

    from kalos.broker.layout import LatencyOp
    from kalos.sidecar_cuda.metrics import SidecarCollector

    # The unit tests' fake sidecar, loaded by path (tests/unit is on sys.path only when pytest
    # collected a file from it first).
    spec = importlib.util.spec_from_file_location(
        "unit_test_metrics", Path(__file__).parents[1] / "unit" / "test_metrics.py"
    )
    assert spec is not None and spec.loader is not None
    unit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(unit)
    sc = unit.fake_sidecar()
    for op in LatencyOp:  # every op's series
        unit.client_record(sc, 0, 10_000, op=op)

    reg = CollectorRegistry()
    reg.register(SidecarCollector(sc))
    exported = set()
    for m in reg.collect():
        exported.update(s.name for s in m.samples)
        exported.add(m.name)
    exported.add("process_cpu_seconds_total")  # the ProcessCollector of the default registry
    exported.add("up")
    exprs = _dashboard_exprs()
    used = set()
    for e in exprs:
        used.update(
            n
            for n in re.findall(
                r"\b([a-z_]+_(?:total|bucket|sum|count|seconds|info|rows|slots|"
                r"leased|flight|ready|size|bytes))\b",
                e,
            )
        )
    assert used and used <= exported, used - exported
    for q in ("0.5", "0.95", "0.99"):
        assert any(
            f'histogram_quantile({q}, sum by (le) (rate(kalos_client_latency_seconds_bucket{{op="recall",' in e
            and "[1m]" in e
            for e in exprs
        ), q
    for stage in ("kalos_queue_wait_seconds", "kalos_batch_compute_seconds", "kalos_service_seconds"):
        assert sum(f"rate({stage}_bucket" in e for e in exprs) == 3, stage
