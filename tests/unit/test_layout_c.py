"""The computing part of the generated C header (``broker/kalos_protocol.h``): its offset functions,
geometry check and latency bucket, compiled with ``cc`` and compared with :class:`Layout` and
``LATENCY_BOUNDS_NS`` on random geometries (the seed is printed)."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
from bisect import bisect_left

import numpy as np
import pytest

from kalos.broker import layout as L
from kalos.broker.errors import ConfigError

HEADER = pathlib.Path(__file__).parents[2] / "broker" / "kalos_protocol.h"

# Reads lines "n_slots dim max_k max_queries blob_bytes" (or "lat NS") and prints what the header's
# functions say of each.
PROGRAM = r"""
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include "kalos_protocol.h"

int main(void) {
    char word[16];
    while (scanf("%15s", word) == 1) {
        if (strcmp(word, "lat") == 0) {
            uint64_t ns;
            if (scanf("%" SCNu64, &ns) != 1) return 2;
            printf("%u\n", kalos_latency_bucket(ns));
            continue;
        }
        kalos_geometry g;
        if (sscanf(word, "%" SCNu64, &g.n_slots) != 1) return 2;
        if (scanf("%" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64, &g.dim, &g.max_k, &g.max_queries,
                  &g.blob_bytes) != 4) return 2;
        if (!kalos_geometry_ok(&g)) {
            printf("bad\n");
            continue;
        }
        uint64_t last = g.n_slots - 1;
        printf("%" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64
               " %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64 "\n",
               kalos_control_base(last), kalos_stats_offset(&g), kalos_data_offset(&g),
               kalos_stats_base(&g, last), kalos_query_offset(&g), kalos_ids_offset(&g),
               kalos_result_ids_offset(&g), kalos_result_scores_offset(&g), kalos_blob_offset(&g),
               kalos_slot_bytes(&g), kalos_data_base(&g, last), kalos_total_bytes(&g),
               (uint64_t)KALOS_OWNER_ABANDONED);
    }
    return 0;
}
"""


@pytest.fixture(scope="module")
def program(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler (cc)")
    d = tmp_path_factory.mktemp("layout_c")
    (d / "geometry.c").write_text(PROGRAM)
    exe = d / "geometry"
    r = subprocess.run(
        [
            cc,
            "-std=c11",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-O2",
            f"-I{HEADER.parent}",
            str(d / "geometry.c"),
            "-o",
            str(exe),
        ],
        capture_output=True,
    )
    assert r.returncode == 0, r.stderr.decode()
    return exe


def _run(exe: pathlib.Path, lines: list[str]) -> list[str]:
    r = subprocess.run([str(exe)], input="\n".join(lines).encode(), capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr.decode()
    return r.stdout.decode().split("\n")[: len(lines)]


def _expected(lay: L.Layout) -> str:
    last = lay.n_slots - 1
    values = (
        lay.control_base(last),
        lay.stats_offset,
        lay.data_offset,
        lay.stats_base(last),
        lay.query_offset,
        lay.ids_offset,
        lay.result_ids_offset,
        lay.result_scores_offset,
        lay.blob_offset,
        lay.slot_bytes,
        lay.data_base(last),
        lay.total_bytes,
        L.OWNER_ABANDONED % 2**64,
    )
    return " ".join(str(v) for v in values)


def _valid(lay: L.Layout) -> bool:
    try:
        lay.check()
        return True
    except ConfigError:
        return False


def test_offsets_match_layout_on_random_geometries(program: pathlib.Path, rng: np.random.Generator) -> None:
    limits = {f: (lo, hi) for f, lo, hi in L.GEOMETRY_LIMITS}
    geoms = [
        L.Layout(**{f: lo for f, (lo, _hi) in limits.items()}),
        L.Layout(**{f: hi for f, (_lo, hi) in limits.items()}),
    ]
    for _ in range(300):
        # Mostly within the limits (log-uniform, so small and large values both come up), and
        # now and then one field just outside them.
        kw = {f: int(np.exp(rng.uniform(np.log(lo), np.log(hi)))) for f, (lo, hi) in limits.items()}
        if rng.random() < 0.1:
            f = str(rng.choice(list(limits)))
            kw[f] = limits[f][0] - 1 if rng.random() < 0.5 else limits[f][1] + 1
        geoms.append(L.Layout(**kw))
    out = _run(program, [f"{g.n_slots} {g.dim} {g.max_k} {g.max_queries} {g.blob_bytes}" for g in geoms])
    invalid = 0
    for g, line in zip(geoms, out):
        if _valid(g):
            assert line == _expected(g), g
        else:
            invalid += 1
            assert line == "bad", g
    assert invalid, "no geometry outside the limits was tried"


def test_latency_bucket_matches_the_bounds(program: pathlib.Path, rng: np.random.Generator) -> None:
    bounds = list(L.LATENCY_BOUNDS_NS)
    lats = [0, 1, L.RING_NS_MAX, 2**64 - 1]
    for b in bounds:
        lats += [b - 1, b, b + 1]
    lats += [int(x) for x in np.exp(rng.uniform(0, np.log(1e10), 500))]
    out = _run(program, [f"lat {x}" for x in lats])
    assert [int(v) for v in out] == [bisect_left(bounds, x) for x in lats]
    assert max(int(v) for v in out) == L.HIST_BUCKETS - 1  # the +Inf bucket was reached
