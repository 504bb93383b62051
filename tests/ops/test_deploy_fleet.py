"""deploy/kubernetes/daemonset-fleet: the per-node DaemonSet following one PostgreSQL store,
rendered by kubectl and validated against the Kubernetes API models (as tests/ops/test_deploy.py
does for the other variants)."""

from __future__ import annotations

import argparse

import pytest
from test_deploy import _pod, _render, validate_object

from kalos.sidecar_cuda.config import add_serve_arguments, config_from_args

pytestmark = pytest.mark.timeout(120)


def test_fleet_daemonset_reads_the_store_from_a_secret() -> None:
    objs = _render("daemonset-fleet")
    for obj in objs:
        assert validate_object(obj) == [], (obj["kind"], validate_object(obj))
    by_kind = {o["kind"]: o for o in objs}
    secret, service, ds = by_kind["Secret"], by_kind["Service"], by_kind["DaemonSet"]
    assert "KALOS_STORE" in secret["stringData"]
    assert service["metadata"]["name"] == "kalos-store" and service["spec"]["ports"][0]["port"] == 5432
    sidecar = next(c for c in _pod(ds)["containers"] if c["name"] == "kalos-sidecar")
    env = {e["name"]: e for e in sidecar["env"]}
    assert "KALOS_DATA_DIR" not in env  # the store replaces the node's data dir
    ref = env["KALOS_STORE"]["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == (secret["metadata"]["name"], "KALOS_STORE")
    assert "KALOS_STORE" not in " ".join(sidecar.get("args", []))  # never on the command line
    # The environment the pod gets, the Secret's value included, is one `kalos serve` accepts.
    values = {k: e["value"] for k, e in env.items() if "value" in e}
    values["KALOS_STORE"] = secret["stringData"]["KALOS_STORE"]
    p = argparse.ArgumentParser(exit_on_error=False)
    add_serve_arguments(p, environ={k: v for k, v in values.items() if k.startswith("KALOS_")})
    cfg = config_from_args(p.parse_args([]))
    assert cfg.store is not None and cfg.data_dir is None and cfg.store_retention_s == 600
