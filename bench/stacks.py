#!/usr/bin/env python3
"""Summarise py-spy raw stacks (``bench_agent.py --py-spy DIR``): for each file, the share of
samples of the sidecar's serving thread spent in each function (own and cumulative), idle waits
named as such, so two runs (a uniform and a mixed batch) can be read side by side.

    python3 bench/stacks.py DIR/*.raw [--top 30]
"""

from __future__ import annotations

import argparse
import collections


def summarise(path: str, top: int) -> str:
    own: collections.Counter[str] = collections.Counter()
    cum: collections.Counter[str] = collections.Counter()
    total = 0
    with open(path) as f:
        for line in f:
            stack, _, n_text = line.rstrip().rpartition(" ")
            if not stack or "serve_forever" not in stack:
                continue  # (other threads: metrics, follower)
            n = int(n_text)
            frames = stack.split(";")
            total += n
            own[frames[-1]] += n
            for fr in set(frames):
                cum[fr] += n
    out = [f"== {path}: {total} samples of the serving thread"]
    for fr, n in own.most_common(top):
        out.append(f"{n / total:6.1%} own {fr[:150]}")
    out.append("")
    for fr, n in cum.most_common(top + 10):
        out.append(f"{n / total:6.1%} cum {fr[:150]}")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args()
    for p in a.files:
        print(summarise(p, a.top))
        print()


if __name__ == "__main__":
    main()
