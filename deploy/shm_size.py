"""How big /dev/shm must be for a sidecar: the segment of its geometry, and a limit to set.

    python deploy/shm_size.py --slots 128 --dim 768        # or with KALOS_SLOTS=... set

The segment is ``broker.layout.Layout(slots, dim, max_k, max_queries, blob_bytes).total_bytes``
(header, per-slot control and stats blocks, per-slot data areas, page-aligned). Recommended limit:
twice that (after a crash, workers keep the old segment mapped until they re-attach, while the new
sidecar creates its own) plus 16 MiB for the semaphores, the lease file and other users of
/dev/shm, rounded up to a MiB. Geometry options default to $KALOS_* and then to `kalos serve`'s
defaults, so this reads the same settings as the sidecar.
"""

from __future__ import annotations

import argparse
import json
import sys

from kalos.broker.layout import Layout
from kalos.sidecar_cuda.config import add_serve_arguments

MIB = 1 << 20
HEADROOM = 16 * MIB


def segment_bytes(slots: int, dim: int, max_k: int, max_queries: int, blob_bytes: int) -> int:
    lay = Layout(n_slots=slots, dim=dim, max_k=max_k, max_queries=max_queries, blob_bytes=blob_bytes)
    lay.check()
    return lay.total_bytes


def recommended_limit(segment: int) -> int:
    """Bytes: 2 x segment + headroom, rounded up to a MiB."""
    return -(-(2 * segment + HEADROOM) // MIB) * MIB


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_serve_arguments(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    a = p.parse_args(argv)
    seg = segment_bytes(a.slots, a.dim, a.max_k, a.max_queries, a.blob_bytes)
    limit = recommended_limit(seg)
    if a.json:
        print(json.dumps({"segment_bytes": seg, "recommended_bytes": limit, "recommended": f"{limit // MIB}Mi"}))
    else:
        print(
            f"segment: {seg} bytes ({seg / MIB:.1f} MiB) for {a.slots} slots, dim {a.dim}, "
            f"max_k {a.max_k}, max_queries {a.max_queries}, blob {a.blob_bytes} B"
        )
        print(f"/dev/shm sizeLimit: at least {limit // MIB}Mi (2 x segment + 16 MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
