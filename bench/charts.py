#!/usr/bin/env python3
"""Charts of benchmark JSON (bench_gpu.py, bench_scaling.py, bench_seed.py): PNGs beside the JSON.

    python3 bench/charts.py FILE.json [FILE.json ...] [--out DIR]

For FILE.json it writes, where the file has the data for them:
  FILE-cdf.png          latency CDF of every case, a panel per size (from `lat_sample_us`, the
                        2000 quantiles the benchmarks keep; a file with percentiles only is drawn
                        as its p50/p95/p99 points)
  FILE-concurrency.png  recalls/s and p99 through the broker against concurrent tasks, a line per
                        size, with in-process batches of 256 as dashed references
  FILE-compare.png      one query: the broker (1 task) against ours in-process, torch (plain and
                        CUDA graph), naive CuPy, numpy and the seed design (bar = p50, whisker = p99,
                        dashed line = one full read of the matrix); and recalls/s at the highest
                        concurrency against in-process batches of 256
  FILE-scaling.png      latency and throughput against rows (bench_scaling.py), with one full read
                        of the matrix and the batch bound

Needs matplotlib (the Agg backend: no display).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable
from typing import Any

import numpy as np

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
except ImportError:  # reported in main()
    plt = None

Row = dict[str, Any]
SizeKey = tuple[int, int, str]

#: In-process single-query paths, in the order they are drawn, with their labels.
SINGLE = {
    "kalos_single": "ours in-process",
    "kalos_single_nograph": "ours in-process, no graph",
    "torch_single": "torch in-process",
    "torch_graph_single": "torch + CUDA graph",
    "cupy_naive_single": "CuPy naive",
    "numpy_single": "numpy in-process",
}
BATCH256 = {
    "torch_batch256": "torch batch 256",
    "kalos_batch256": "ours batch 256",
    "numpy_batch256": "numpy batch 256",
}
DTYPE_SHORT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
COLORS = plt.rcParams["axes.prop_cycle"].by_key()["color"] if plt else []


# ---------------------------------------------------------------------------- reading
def human(n: float) -> str:
    for div, suf in ((1_000_000, "M"), (1000, "k")):
        if n >= div:
            return f"{n / div:.3g}{suf}"
    return f"{n:g}"


def size_key(r: Row) -> SizeKey:
    return int(r["n"]), int(r["dim"]), str(r.get("dtype", "float32"))


def size_label(key: SizeKey) -> str:
    n, d, dt = key
    return f"{human(n)} x {d} {DTYPE_SHORT.get(dt, dt)}"


def load_rows(doc: dict[str, Any]) -> list[Row]:
    """The measurement rows of any of the benchmarks' JSON, with a `what` on each (bench_broker's
    rows, which have none, are broker rows)."""
    rows = doc.get("rows", doc if isinstance(doc, list) else [])
    out = []
    for r in rows:
        if not isinstance(r, dict) or "n" not in r or "dim" not in r:
            continue
        r = dict(r)
        r.setdefault("what", "broker" if "tasks" in r else "?")
        out.append(r)
    return out


def by_size(rows: Iterable[Row]) -> dict[SizeKey, list[Row]]:
    groups: dict[SizeKey, list[Row]] = {}
    for r in rows:
        groups.setdefault(size_key(r), []).append(r)
    return dict(sorted(groups.items()))


def brokers(rows: list[Row]) -> list[Row]:
    return sorted(
        (r for r in rows if r["what"] == "broker" and "p50_us" in r),
        key=lambda r: (r.get("k", 0), r.get("tasks", 1), r.get("procs", 1), r.get("loop", "")),
    )


def case_label(r: Row, several_k: bool) -> str:
    w = r["what"]
    if w == "broker":
        t = r.get("tasks", 1)
        s = f"broker, {t} task{'s' if t != 1 else ''}"
        if t != 1 and r.get("procs", 1) != 1:
            s += f" / {r['procs']} procs"
        if r.get("loop") and r["loop"] != "uvloop":
            s += f" ({r['loop']})"
    elif w == "seed":
        s = f"seed design ({r.get('variant', '?')})"
    else:
        s = SINGLE.get(w) or str(w)
    if several_k and "k" in r:
        s += f", k={r['k']}"
    return s


def title_of(doc: dict[str, Any], path: str) -> str:
    env = doc.get("env", {})
    where = env.get("gpu") or env.get("cpu") or env.get("node", "")
    date = str(doc.get("date", ""))[:10]
    return f"{os.path.basename(path)}: {where} {date}".strip()


# ---------------------------------------------------------------------------- formatting
def fmt_us(x: float, _pos: Any = None) -> str:
    """Microseconds, 3 significant digits: 62.4 us, 2.26 ms."""
    if x >= 1e6:
        return f"{x / 1e6:.3g} s"
    if x >= 1000:
        return f"{x / 1000:.3g} ms"
    return f"{x:.3g} us"


def fmt_rate(x: float, _pos: Any = None) -> str:
    return f"{human(x)}/s"


def fmt_rows(x: float, _pos: Any = None) -> str:
    return human(x)


def log_axis(axis: Any, fmt: Any) -> None:
    """Log axis labelled by ``fmt``: ticks at 1, 2 and 5 of each decade over a short span, at each
    power of 10 over a long one. Call after the data and the scale are set."""
    lo, hi = sorted(axis.get_view_interval())
    span = np.log10(hi / lo) if lo > 0 else 9
    subs = (1.0, 2.0, 5.0) if span < 2.5 else (1.0, 3.0) if span < 4.5 else (1.0,)
    axis.set_major_locator(LogLocator(base=10, subs=subs))
    axis.set_major_formatter(FuncFormatter(fmt))
    axis.set_minor_formatter(NullFormatter())


def grid(n_panels: int, cols: int, w: float = 6.4, h: float = 4.2) -> tuple[Any, list[Any]]:
    cols = max(1, min(cols, n_panels))
    nrows = (n_panels + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(w * cols, h * nrows), squeeze=False)
    flat = list(axes.ravel())
    for ax in flat[n_panels:]:
        ax.set_visible(False)
    return fig, flat[:n_panels]


def save(fig: Any, title: str, path: str) -> str:
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------- charts
PCT_Y = {"p50_us": 0.5, "p95_us": 0.95, "p99_us": 0.99}


def chart_cdf(rows: list[Row], title: str, path: str) -> str | None:
    groups = {}
    for key, g in by_size(rows).items():
        cases = brokers(g) + [r for r in g if (r["what"] in SINGLE or r["what"] == "seed") and "p50_us" in r]
        if cases:
            groups[key] = cases
    if not groups:
        return None
    fig, axes = grid(len(groups), 2)
    for ax, (key, cases) in zip(axes, groups.items()):
        several_k = len({r.get("k") for r in cases}) > 1
        for i, r in enumerate(cases):
            color = COLORS[i % len(COLORS)]
            style = "-" if r["what"] == "broker" else "--"
            label = case_label(r, several_k)
            s = r.get("lat_sample_us")
            if s:
                x = np.sort(np.asarray(s, float))
                y = (np.arange(len(x)) + 0.5) / len(x)
                ax.plot(x, y, style, color=color, lw=1.6, label=label)
            else:
                pts = [(r[p], q) for p, q in PCT_Y.items() if r.get(p) is not None]
                ax.plot(*zip(*pts), ":", marker="o", ms=4, color=color, lw=1.2, label=f"{label} (p50/95/99)")
        ax.set_xscale("log")
        ax.set_yscale("logit")
        sampled = any(r.get("lat_sample_us") for r in cases)
        ticks = [0.01, 0.1, 0.5, 0.9, 0.99, 0.999] if sampled else [0.5, 0.9, 0.99]
        ax.set_ylim(ticks[0] * 0.8, 0.999 if sampled else 0.995)
        ax.set_yticks(ticks)
        ax.set_yticklabels([f"p{100 * t:g}" for t in ticks])
        ax.yaxis.set_minor_formatter(NullFormatter())
        log_axis(ax.xaxis, fmt_us)
        ax.grid(True, which="major", alpha=0.35)
        ax.grid(True, which="minor", axis="x", alpha=0.12)
        ax.set_xlabel("recall latency (log)")
        ax.set_ylabel("fraction of recalls at or below")
        ax.set_title(size_label(key))
        ax.legend(fontsize=7, loc="lower right")
    return save(fig, f"Latency CDF - {title}", path)


def chart_concurrency(rows: list[Row], title: str, path: str) -> str | None:
    groups = {key: g for key, g in by_size(rows).items() if len({r.get("tasks") for r in brokers(g)}) > 1}
    if not groups:
        return None
    fig, (ax_t, ax_p) = plt.subplots(1, 2, figsize=(13, 4.8))
    for i, (key, g) in enumerate(groups.items()):
        color = COLORS[i % len(COLORS)]
        lines: dict[tuple[Any, ...], list[Row]] = {}
        for r in brokers(g):  # one line per (k, loop): the most processes measured at each task count
            lines.setdefault((r.get("k"), r.get("loop")), []).append(r)
        for j, (kk, rs) in enumerate(lines.items()):
            best: dict[int, Row] = {}
            for r in rs:
                t = int(r.get("tasks", 1))
                if t not in best or r.get("procs", 1) > best[t].get("procs", 1):
                    best[t] = r
            ts = sorted(best)
            several_k = len({x[0] for x in lines}) > 1
            label = size_label(key) + (f", k={kk[0]}" if several_k and kk[0] is not None else "")
            if kk[1] and kk[1] != "uvloop":
                label += f" ({kk[1]})"
            ls = ["-", "-.", ":"][j % 3]
            ax_t.plot(ts, [best[t]["recalls_per_s"] for t in ts], ls, marker="o", color=color, label=label)
            ax_p.plot(ts, [best[t]["p99_us"] for t in ts], ls, marker="o", color=color, label=label)
        for what, lab in BATCH256.items():
            ref = next((r for r in g if r["what"] == what and r.get("recalls_per_s")), None)
            if ref:
                ax_t.axhline(
                    ref["recalls_per_s"],
                    color=color,
                    ls="--" if what.startswith("torch") else ":",
                    lw=1,
                    alpha=0.7,
                    label=f"{size_label(key)}: {lab} in-process",
                )
    procs = {r.get("procs") for g in groups.values() for r in brokers(g) if r.get("tasks", 1) > 1}
    procs_note = (
        f" (over {procs.pop()} client processes above 1 task)"
        if len(procs) == 1
        else " (over several client processes: see the file)"
    )
    for ax in (ax_t, ax_p):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _p: f"{x:g}"))
        ax.set_xlabel("concurrent client tasks" + procs_note)
        ax.grid(True, which="both", alpha=0.3)
    log_axis(ax_t.yaxis, fmt_rate)
    ax_t.set_ylabel("recalls/s through the broker")
    ax_t.set_title("throughput")
    log_axis(ax_p.yaxis, fmt_us)
    ax_p.set_ylabel("p99 latency")
    ax_p.set_title("p99 latency")
    ax_t.legend(fontsize=7)
    ax_p.legend(fontsize=7)
    return save(fig, f"Broker against concurrency - {title}", path)


def chart_compare(rows: list[Row], title: str, path: str) -> str | None:
    groups = {}
    for key, g in by_size(rows).items():
        lat = [r for r in brokers(g) if r.get("tasks", 1) == 1]
        lat += [r for r in g if r["what"] == "seed" and "p50_us" in r]
        lat += [r for w in SINGLE for r in g if r["what"] == w and "p50_us" in r]
        many = [r for r in brokers(g) if r.get("tasks", 1) > 1]
        top = max(many, key=lambda r: (r["tasks"], r.get("procs", 1)), default=None)
        tput = (
            [
                (
                    f"broker, {top['tasks']} tasks" + (f" / {top['procs']} procs" if top.get("procs", 1) > 1 else ""),
                    top["recalls_per_s"],
                    top.get("p99_us"),
                )
            ]
            if top
            else []
        )
        tput += [
            (lab, r["recalls_per_s"], None)
            for w, lab in BATCH256.items()
            for r in g
            if r["what"] == w and r.get("recalls_per_s")
        ]
        bound = next((r["bound_batch256_per_s"] for r in g if r.get("bound_batch256_per_s")), None)
        if lat or tput:
            groups[key] = (lat, tput, bound, next((r.get("floor_us") for r in g if r.get("floor_us")), None))
    if not groups:
        return None
    with_tput = any(v[1] for v in groups.values())
    cols = 2 if with_tput else 1
    fig, axes = plt.subplots(
        len(groups),
        cols,
        figsize=(7.2 * cols, 0.45 * max(6, max(len(v[0]) for v in groups.values())) + 1.6 * len(groups) + 0.6),
        squeeze=False,
    )
    for row_axes, (key, (lat, tput, bound, floor)) in zip(axes, groups.items()):
        ax = row_axes[0]
        several_k = len({r.get("k") for r in lat}) > 1
        labels = [case_label(r, several_k) for r in lat]
        p50 = np.array([r["p50_us"] for r in lat], float)
        p99 = np.array([r.get("p99_us", r["p50_us"]) for r in lat], float)
        colors = [
            "tab:red" if r["what"] == "broker" else "tab:gray" if r["what"] == "seed" else "tab:blue" for r in lat
        ]
        y = np.arange(len(lat))
        ax.barh(y, p50, color=colors, alpha=0.8)
        ax.errorbar(p99, y, fmt="|", color="black", ms=10, mew=1.5)
        ax.hlines(y, p50, p99, color="black", lw=1)
        for yy, a, b in zip(y, p50, p99):
            ax.text(b * 1.08, yy, f"{fmt_us(a)} / {fmt_us(b)}", va="center", fontsize=7)
        ax.set_ylim(len(lat) - 0.5, -1.1)  # a free line at the top for the read's label
        lo = p50.min() if len(p50) else 1.0
        if floor and floor > lo / 50:
            ax.axvline(floor, color="black", ls="--", lw=1)
            ax.text(floor, -0.8, f" one full read: {fmt_us(floor)}", fontsize=7, va="center")
            lo = min(lo, floor)
        ax.set_yticks(y)
        ax.set_yticklabels(labels, fontsize=8)
        ax.set_xscale("log")
        if len(p50):
            ax.set_xlim(lo / 2, p99.max() * 6)
        log_axis(ax.xaxis, fmt_us)
        ax.grid(True, axis="x", which="both", alpha=0.25)
        ax.set_title(f"{size_label(key)}: one query, p50 (bar) to p99 (whisker)", fontsize=10)
        if cols == 2:
            ax2 = row_axes[1]
            if not tput:
                ax2.set_visible(False)
                continue
            y2 = np.arange(len(tput))
            vals = np.array([t[1] for t in tput], float)
            ax2.barh(y2, vals, color=["tab:red" if t[0].startswith("broker") else "tab:blue" for t in tput], alpha=0.8)
            for yy, (_lab, v, p) in zip(y2, tput):
                ax2.text(v * 1.05, yy, fmt_rate(v) + (f", p99 {fmt_us(p)}" if p else ""), va="center", fontsize=7)
            ax2.set_ylim(len(tput) - 0.5, -1.1)
            if bound:
                ax2.axvline(bound, color="black", ls="--", lw=1)
                ax2.text(bound, -0.8, f" bound, batch 256: {fmt_rate(bound)}", fontsize=7, va="center")
            ax2.set_yticks(y2)
            ax2.set_yticklabels([t[0] for t in tput], fontsize=8)
            ax2.set_xscale("log")
            ax2.set_xlim(vals.min() / 2, max(vals.max(), bound or 0) * 5)
            log_axis(ax2.xaxis, fmt_rate)
            ax2.grid(True, axis="x", which="both", alpha=0.25)
            ax2.set_title(f"{size_label(key)}: recalls/s (broker at its highest concurrency)", fontsize=10)
    return save(fig, f"Broker against in-process - {title}", path)


def chart_scaling(rows: list[Row], title: str, path: str) -> str | None:
    fam: dict[tuple[int, str], dict[int, list[Row]]] = {}
    for (n, d, dt), g in by_size(rows).items():
        fam.setdefault((d, dt), {})[n] = g
    fam = {kk: v for kk, v in fam.items() if len(v) > 1}
    if not fam:
        return None
    fig, axes = plt.subplots(len(fam), 2, figsize=(13, 4.8 * len(fam)), squeeze=False)
    for (ax_l, ax_t), ((d, dt), sizes) in zip(axes, fam.items()):
        ns = sorted(sizes)

        def series(pick: Any) -> tuple[list[int], list[Row]]:
            xs, rs = [], []
            for n in ns:
                r = pick(sizes[n])
                if r is not None:
                    xs.append(n)
                    rs.append(r)
            return xs, rs

        def one(what: str) -> Any:
            return lambda g: next((r for r in g if r["what"] == what and "p50_us" in r), None)

        def b1(g: Any) -> Any:
            return next((r for r in brokers(g) if r.get("tasks", 1) == 1), None)

        def bmax(g: Any) -> Any:
            return max((r for r in brokers(g) if r.get("tasks", 1) > 1), key=lambda r: r["tasks"], default=None)

        xs, rs = series(b1)
        if xs:
            ax_l.plot(xs, [r["p50_us"] for r in rs], "-o", color="tab:red", label="broker, 1 task: p50")
            ax_l.plot(xs, [r["p99_us"] for r in rs], ":o", color="tab:red", ms=3, label="broker, 1 task: p99")
        for i, (what, lab) in enumerate(SINGLE.items()):
            xs, rs = series(one(what))
            if xs:
                ax_l.plot(
                    xs, [r["p50_us"] for r in rs], "--s", ms=4, color=COLORS[(i + 2) % len(COLORS)], label=f"{lab}: p50"
                )
        xs, rs = series(lambda g: next((r for r in g if r.get("floor_us")), None))
        if xs:
            ax_l.plot(xs, [r["floor_us"] for r in rs], "-", color="black", lw=1.2, label="one full read of the rows")
        ax_l.set_ylabel("one query's latency")
        ax_l.set_title(f"one query (rows x {d} {DTYPE_SHORT.get(dt, dt)})")

        xs, rs = series(bmax)
        if xs:
            ax_t.plot(
                xs,
                [r["recalls_per_s"] for r in rs],
                "-o",
                color="tab:red",
                label=f"broker, {rs[-1]['tasks']} tasks / {rs[-1].get('procs', 1)} procs",
            )
            for x, r in zip(xs, rs):
                ax_t.annotate(
                    f"p99 {fmt_us(r['p99_us'])}",
                    (x, r["recalls_per_s"]),
                    fontsize=7,
                    textcoords="offset points",
                    xytext=(4, 6),
                )
        for i, (what, lab) in enumerate(BATCH256.items()):
            xs, rs = series(lambda g, w=what: next((r for r in g if r["what"] == w and r.get("recalls_per_s")), None))
            if xs:
                ax_t.plot(
                    xs,
                    [r["recalls_per_s"] for r in rs],
                    "--s",
                    ms=4,
                    color=COLORS[(i + 2) % len(COLORS)],
                    label=f"{lab}, in-process",
                )
        xs, rs = series(lambda g: next((r for r in g if r.get("bound_batch256_per_s")), None))
        if xs:
            ax_t.plot(
                xs,
                [r["bound_batch256_per_s"] for r in rs],
                "-",
                color="black",
                lw=1.2,
                label="bound, batch 256 (one read; tensor peak)",
            )
        xs, rs = series(lambda g: next((r for r in g if r.get("floor_us")), None))
        if xs:
            ax_t.plot(
                xs, [1e6 / r["floor_us"] for r in rs], ":", color="black", lw=1.2, label="one full read per recall"
            )
        ax_t.set_ylabel("recalls/s")
        ax_t.set_title(f"throughput (rows x {d} {DTYPE_SHORT.get(dt, dt)})")
        for ax, fmt in ((ax_l, fmt_us), (ax_t, fmt_rate)):
            ax.set_xscale("log")
            ax.set_yscale("log")
            log_axis(ax.xaxis, fmt_rows)
            log_axis(ax.yaxis, fmt)
            ax.set_xlabel("rows")
            ax.grid(True, which="both", alpha=0.25)
            ax.legend(fontsize=7)
    return save(fig, f"Exact search against rows - {title}", path)


CHARTS = {"cdf": chart_cdf, "concurrency": chart_concurrency, "compare": chart_compare, "scaling": chart_scaling}


def charts_for(path: str, out_dir: str | None = None) -> list[str]:
    """Write the charts of one benchmark JSON; returns the PNGs written."""
    with open(path) as f:
        doc = json.load(f)
    rows = load_rows(doc)
    stem = os.path.splitext(os.path.basename(path))[0]
    out_dir = out_dir or os.path.dirname(os.path.abspath(path))
    os.makedirs(out_dir, exist_ok=True)
    title = title_of(doc if isinstance(doc, dict) else {}, path)
    written = []
    for name, fn in CHARTS.items():
        png = fn(rows, title, os.path.join(out_dir, f"{stem}-{name}.png"))
        if png:
            written.append(png)
    return written


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", metavar="FILE.json")
    ap.add_argument("--out", default=None, help="folder for the PNGs (default: beside each JSON)")
    a = ap.parse_args()
    if plt is None:
        print("charts.py needs matplotlib (pip install 'matplotlib>=3.7')", file=sys.stderr)
        return 2
    status = 0
    for path in a.files:
        try:
            written = charts_for(path, a.out)
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"{path}: {type(e).__name__}: {e}", file=sys.stderr)
            status = 1
            continue
        for png in written:
            print(png)
        if not written:
            print(f"{path}: nothing to chart", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
