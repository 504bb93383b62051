"""The Prometheus text exposition format (0.0.4), written by hand: ``prometheus_client``'s
``generate_latest`` validates every sample name, which holds the sidecar's GIL several times
longer per scrape (the serving thread waits for it meanwhile)."""

from __future__ import annotations

import math

from prometheus_client.registry import Collector

_TEXT_TYPES = {"counter": "counter", "gauge": "gauge", "histogram": "histogram", "summary": "summary",
               "info": "gauge", "stateset": "gauge", "gaugehistogram": "histogram", "unknown": "untyped"}
TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _float_text(v: float) -> str:
    if v != v:
        return "NaN"
    if v in (math.inf, -math.inf):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


def _label_text(v: str) -> str:
    if "\\" in v or "\n" in v or '"' in v:
        v = v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
    return v


def encode_text(registry: Collector) -> bytes:
    """The Prometheus text format (0.0.4) of ``registry``, as ``prometheus_client``'s
    ``generate_latest`` writes it, without its per-sample name validation: a scrape holds the
    sidecar's GIL several times shorter (the serving thread waits for it meanwhile). Names come
    from our own collectors; label values are escaped."""
    out: list[str] = []
    for metric in registry.collect():
        mname, mtype = metric.name, metric.type
        if mtype == "counter":
            mname += "_total"
        elif mtype == "info":
            mname += "_info"
        doc = metric.documentation.replace("\\", "\\\\").replace("\n", "\\n")
        out.append(f"# HELP {mname} {doc}\n# TYPE {mname} {_TEXT_TYPES.get(mtype, 'untyped')}\n")
        extra: dict[str, list[str]] = {}
        for s in metric.samples:
            if s.labels:
                labels = ",".join(f'{k}="{_label_text(v)}"' for k, v in sorted(s.labels.items()))
                line = f"{s.name}{{{labels}}} {_float_text(s.value)}"
            else:
                line = f"{s.name} {_float_text(s.value)}"
            if s.timestamp is not None:
                line += f" {int(float(s.timestamp) * 1000):d}"
            suffix = s.name[len(metric.name):]
            if suffix in ("_created", "_gsum", "_gcount"):  # OpenMetrics-only: gauges of their own
                extra.setdefault(suffix, []).append(line + "\n")
            else:
                out.append(line + "\n")
        for suffix, lines in sorted(extra.items()):
            out.append(f"# HELP {metric.name}{suffix} {doc}\n# TYPE {metric.name}{suffix} gauge\n")
            out.extend(lines)
    return "".join(out).encode()


def wants_openmetrics_only(accept: str) -> bool:
    """Serve the text format to anyone who accepts it (Prometheus does, next to OpenMetrics)."""
    a = accept.lower()
    return bool(a) and "text/plain" not in a and "*/*" not in a
