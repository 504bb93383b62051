"""What a sidecar is told at start: :class:`ServeConfig`, and the command-line options that fill it.

The options are defined once, in :func:`add_serve_arguments`; ``python -m sidecar_cuda`` and
``kalos serve`` both add them to their parser and turn the parsed arguments into a config with
:func:`config_from_args`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from broker.errors import ConfigError
from broker.layout import Layout, Metric


@dataclass
class ServeConfig:
    name: str = "default"
    dim: int = 128
    slots: int = 64
    max_k: int = 128
    max_queries: int = 32
    blob_bytes: int = 256 * 1024
    payload_limit: int = 16 * 1024
    backend: str = "auto"
    storage_dtype: str = "float32"
    metric: str = "dot"
    device: int = 0
    data_dir: str | None = None  # None: ephemeral (in memory only)
    spin_us: float = 250.0
    gather_us: float = 1000.0
    pipeline: str = "auto"  # on | off | auto: pipeline batches of server.PIPELINE_MIN_WORK and more
    random_rows: int = 0
    seed: int = 0
    load_npy: str | None = None
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # None: no HTTP endpoint
    shm_mode: int = 0o600  # 0o660: shared with the sidecar user's group (a dedicated sidecar user)

    def layout(self) -> Layout:
        lay = Layout(n_slots=self.slots, dim=self.dim, max_k=self.max_k,
                     max_queries=self.max_queries, blob_bytes=self.blob_bytes)
        lay.check()
        return lay

    def metric_enum(self) -> Metric:
        try:
            return Metric[self.metric.upper()]
        except KeyError:
            raise ConfigError(f"metric must be dot, cosine or l2, got {self.metric!r}") from None


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """Add the options of a sidecar to ``p`` (defaults are those of :class:`ServeConfig`)."""
    p.add_argument("--name", default="default", help="broker name scoping the shared objects (default: default)")
    p.add_argument("--dim", type=int, default=128, help="vector dimension (default: 128)")
    p.add_argument("--slots", type=int, default=64, help="shared-memory slots = max in-flight requests (default: 64)")
    p.add_argument("--max-k", type=int, default=128, help="largest k a request may ask (default: 128)")
    p.add_argument("--max-queries", type=int, default=32,
                   help="rows per slot: queries of recall_many, vectors of one upsert chunk (default: 32)")
    p.add_argument("--blob-bytes", type=int, default=256 * 1024,
                   help="per-slot payload area in bytes (default: 262144)")
    p.add_argument("--backend", choices=["auto", "numpy", "cuda"], default="auto",
                   help="auto: CUDA if CuPy and a GPU are usable, else numpy (default: auto)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32",
                   help="storage dtype of the matrix on the GPU (numpy: float32 only)")
    p.add_argument("--metric", choices=["dot", "cosine", "l2"], default="dot", help="similarity (default: dot)")
    p.add_argument("--device", type=int, default=0, help="CUDA device ordinal")
    p.add_argument("--data-dir", help="durable store directory (SQLite, WAL); restarts keep acknowledged writes")
    p.add_argument("--ephemeral", action="store_true", help="keep memories in memory only")
    p.add_argument("--payload-limit", type=int, default=16 * 1024, help="max bytes of one payload (default: 16384)")
    p.add_argument("--spin-us", type=float, default=250.0,
                   help="after a batch, poll the slots this long before sleeping on the doorbell (default: 250)")
    p.add_argument("--gather-us", type=float, default=1000.0,
                   help="when fewer requests are posted than the last batch held, wait up to a quarter "
                        "of that batch's service time, at most this long, for the rest (default: 1000; 0: off)")
    p.add_argument("--pipeline", choices=["auto", "on", "off"], default="auto",
                   help="start the next recall batch on the device while one runs: on, off, or auto "
                        "(only for batches of at least 2^34 rows x queries x dim; default: auto)")
    p.add_argument("--random-rows", type=int, default=0, help="fill namespace 'default' with N random rows (ephemeral only)")
    p.add_argument("--seed", type=int, default=0, help="seed of --random-rows")
    p.add_argument("--load", help="fill namespace 'default' from an (n, dim) .npy file (ephemeral only)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address of /metrics, /healthz, /readyz")
    p.add_argument("--metrics-port", type=int, default=-1, help="port of the HTTP endpoint (-1: off)")
    p.add_argument("--shm-mode", choices=["0600", "0660"], default="0600",
                   help="mode of the shared objects: 0600 (clients run as this user) or 0660 (clients "
                        "in this user's group, for a dedicated sidecar user; they pass sidecar_uid=)")


def config_from_args(a: argparse.Namespace) -> ServeConfig:
    """The config of options parsed by a parser given :func:`add_serve_arguments`.

    Raises ConfigError unless one of ``--data-dir`` and ``--ephemeral`` is given: where the
    memories live is never a default."""
    if a.data_dir is None and not a.ephemeral:
        raise ConfigError("give --data-dir DIR (durable) or --ephemeral (memory only)")
    return ServeConfig(
        name=a.name, dim=a.dim, slots=a.slots, max_k=a.max_k, max_queries=a.max_queries,
        blob_bytes=a.blob_bytes, payload_limit=a.payload_limit, backend=a.backend,
        storage_dtype=a.dtype, metric=a.metric, device=a.device,
        data_dir=None if a.ephemeral else a.data_dir, spin_us=a.spin_us, gather_us=a.gather_us,
        pipeline=a.pipeline, random_rows=a.random_rows,
        seed=a.seed, load_npy=a.load, metrics_host=a.metrics_host,
        metrics_port=None if a.metrics_port < 0 else a.metrics_port, shm_mode=int(a.shm_mode, 8))
