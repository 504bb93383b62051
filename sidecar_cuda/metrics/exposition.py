"""The Prometheus text exposition format (0.0.4), written by hand: ``prometheus_client``'s
``generate_latest`` validates every sample name, which holds the sidecar's GIL several times
longer per scrape (the serving thread waits for it meanwhile)."""

from __future__ import annotations

import math

from prometheus_client.registry import Collector

_TEXT_TYPES = {
    "counter": "counter",
    "gauge": "gauge",
    "histogram": "histogram",
    "summary": "summary",
    "info": "gauge",
    "stateset": "gauge",
    "gaugehistogram": "histogram",
    "unknown": "untyped",
}
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


class TextEncoder:
    """The Prometheus text format (0.0.4) of a registry, as ``prometheus_client``'s
    ``generate_latest`` writes it, without its per-sample name validation: a scrape holds the
    sidecar's GIL several times shorter (the serving thread waits for it meanwhile). Names come
    from our own collectors; label values are escaped. Keep one per endpoint: it remembers the
    text of every label set it wrote (they repeat from scrape to scrape; at most ``cache_limit``)."""

    def __init__(self, cache_limit: int = 1 << 14) -> None:
        self._labels: dict[tuple[tuple[str, str], ...], str] = {}
        self._limit = cache_limit

    def _label_set(self, labels: dict[str, str]) -> str:
        key = tuple(labels.items())
        text = self._labels.get(key)
        if text is None:
            text = ",".join(f'{k}="{_label_text(v)}"' for k, v in sorted(labels.items()))
            if len(self._labels) >= self._limit:  # label values we did not expect: start over
                self._labels.clear()
            self._labels[key] = text
        return text

    def encode(self, registry: Collector) -> bytes:
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
                v = s.value
                # A finite float (nearly every sample) as repr writes it, without a call.
                vt = repr(v) if type(v) is float and v - v == 0.0 else _float_text(v)
                if s.labels:
                    line = f"{s.name}{{{self._label_set(s.labels)}}} {vt}"
                else:
                    line = f"{s.name} {vt}"
                if s.timestamp is not None:
                    line += f" {int(float(s.timestamp) * 1000):d}"
                suffix = s.name[len(metric.name) :]
                if suffix in ("_created", "_gsum", "_gcount"):  # OpenMetrics-only: gauges of their own
                    extra.setdefault(suffix, []).append(line + "\n")
                else:
                    out.append(line + "\n")
            for suffix, lines in sorted(extra.items()):
                out.append(f"# HELP {metric.name}{suffix} {doc}\n# TYPE {metric.name}{suffix} gauge\n")
                out.extend(lines)
        return "".join(out).encode()


def encode_text(registry: Collector) -> bytes:
    """The Prometheus text format (0.0.4) of ``registry`` (:class:`TextEncoder`, without memory)."""
    return TextEncoder().encode(registry)


def wants_openmetrics_only(accept: str) -> bool:
    """Serve the text format to anyone who accepts it (Prometheus does, next to OpenMetrics)."""
    a = accept.lower()
    return bool(a) and "text/plain" not in a and "*/*" not in a
