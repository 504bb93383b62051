#!/bin/bash
# Medians (min-max) over every round in this folder, compiled vs python: summary.txt, summary.json.
cd "$(dirname "$0")"
/work/main/.venv/bin/python - <<'PY'
import glob, json, statistics as st

def mm(xs):
    xs = [x for x in xs if x == x]
    return {"median": round(st.median(xs), 2), "min": round(min(xs), 2), "max": round(max(xs), 2), "n": len(xs)}

def fmt(d):
    return f"{d['median']:,} ({d['min']:,}-{d['max']:,})"

out, lines = {}, []
cpu = {}
for f in sorted(glob.glob("client-cpu*.json")):
    for key, runs in json.load(open(f))["runs"].items():
        k = key.split(" ", 1)[1]
        cpu.setdefault(k, []).extend(runs)
out["client_cpu"] = {
    k: {"us_per_recall": mm([r["us_per_recall"] for r in rs]), "client_us_per_recall": mm([r["client_us_per_recall"] for r in rs])}
    for k, rs in sorted(cpu.items())
}
lines.append("bench_client_cpu.py (pool over the in-memory transport), us of CPU per recall: total | without the fake sidecar")
for k, v in out["client_cpu"].items():
    lines.append(f"  {k:42s} {fmt(v['us_per_recall']):>24s} | {fmt(v['client_us_per_recall'])}")

bd = {}
for f in sorted(glob.glob("breakdown-*.json")):
    r = json.load(open(f))["results"][0]
    for stage, v in r["p50_us"].items():
        bd.setdefault((r["slot_path"], stage), []).append(v)
out["breakdown_p50_us"] = {f"{p} {s}": mm(v) for (p, s), v in sorted(bd.items())}
lines.append("")
lines.append("breakdown.py --backend numpy --sizes 256x128 (a lone blocking caller), p50 us per stage")
for k, v in out["breakdown_p50_us"].items():
    lines.append(f"  {k:42s} {fmt(v)}")

br = {}
for f in sorted(glob.glob("broker-*.json")):
    co = "coalesce" if "coalesce" in f else "plain"
    for r in json.load(open(f))["rows"]:
        key = (co, r["tasks"], r["procs"], r["slot_path"])
        br.setdefault(key, []).append(r)
out["broker"] = {}
lines.append("")
lines.append("bench_broker.py 256x128 numpy, uvloop; in-process numpy measured in each run")
for (co, t, p, path), rs in sorted(br.items()):
    v = {
        "p50_us": mm([r["p50_us"] for r in rs]),
        "p99_us": mm([r["p99_us"] for r in rs]),
        "recalls_per_s": mm([r["recalls_per_s"] for r in rs]),
        "client_cpu_us_per_recall": mm([r["client_cpu_us_per_recall"] for r in rs]),
        "overhead_p50_us": mm([r["overhead_p50_us"] for r in rs]),
        "inproc_numpy_1q_p50_us": mm([r["inproc_numpy_1q_p50_us"] for r in rs]),
        "inproc_numpy_b64_recalls_per_s": mm([r["inproc_numpy_b64_recalls_per_s"] for r in rs]),
        "wrong": sum(r["wrong"] for r in rs),
        "checked": sum(r["checked"] for r in rs),
    }
    out["broker"][f"{co} tasks={t} procs={p} {path}"] = v
    lines.append(
        f"  {co:8s} tasks={t:<2} procs={p} {path:8s} p50 {fmt(v['p50_us'])} us, p99 {fmt(v['p99_us'])}, "
        f"{fmt(v['recalls_per_s'])}/s, client CPU {fmt(v['client_cpu_us_per_recall'])} us/recall, "
        f"overhead over numpy 1q {fmt(v['overhead_p50_us'])} us; numpy 1q {fmt(v['inproc_numpy_1q_p50_us'])} us, "
        f"b64 {fmt(v['inproc_numpy_b64_recalls_per_s'])}/s; wrong {v['wrong']}/{v['checked']}"
    )
# Paired: compiled against python of the same run (measured one after the other), then the median
# of those ratios over the runs: the load of the shared VM drifts between runs more than within one.
pairs = {}
for f in sorted(glob.glob("broker-*.json")):
    co = "coalesce" if "coalesce" in f else "plain"
    rows = {(r["tasks"], r["procs"], r["slot_path"]): r for r in json.load(open(f))["rows"]}
    for (t, p, path), r in rows.items():
        q = rows.get((t, p, "python"))
        if path != "compiled" or q is None:
            continue
        d = pairs.setdefault(f"{co} tasks={t} procs={p}", {"p50": [], "tput": [], "cpu": [], "p50_minus_us": [], "cpu_minus_us": []})
        d["p50"].append(r["p50_us"] / q["p50_us"])
        d["tput"].append(r["recalls_per_s"] / q["recalls_per_s"])
        d["cpu"].append(r["client_cpu_us_per_recall"] / q["client_cpu_us_per_recall"])
        d["p50_minus_us"].append(r["p50_us"] - q["p50_us"])
        d["cpu_minus_us"].append(r["client_cpu_us_per_recall"] - q["client_cpu_us_per_recall"])
out["broker_paired_compiled_over_python"] = {k: {m: mm(v) for m, v in d.items()} for k, d in pairs.items()}
lines.append("")
lines.append("bench_broker.py paired, compiled / python within each run: median (min-max) over the runs")
for k, d in out["broker_paired_compiled_over_python"].items():
    lines.append(
        f"  {k:26s} p50 x{fmt(d['p50'])} ({fmt(d['p50_minus_us'])} us), throughput x{fmt(d['tput'])}, "
        f"client CPU x{fmt(d['cpu'])} ({fmt(d['cpu_minus_us'])} us)"
    )
json.dump(out, open("summary.json", "w"), indent=1)
open("summary.txt", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
