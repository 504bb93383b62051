"""What a sidecar is told at start: :class:`ServeConfig`, and the command-line options that fill it.

The options are defined once, in :func:`add_serve_arguments`; ``python -m kalos.sidecar_cuda`` and
``kalos serve`` both add them to their parser and turn the parsed arguments into a config with
:func:`config_from_args`.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..broker.errors import ConfigError
from ..broker.layout import Layout, Metric


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
    devices: str = "all"  # GPUs of the cuda backend: all, or a comma list (--device N: "N")
    shards: int = 0  # shards per namespace: 0 = one per device (1 on numpy)
    data_dir: str | None = None  # None: ephemeral (in memory only)
    spin_us: float = 250.0
    gather_us: float = 1000.0
    pipeline: str = "auto"  # on | off | auto: pipeline batches of server.PIPELINE_MIN_WORK and more
    host_search_work: int | None = None  # cuda: searches this small run on the CPU (None: default)
    fused_kernel: str = "auto"  # cuda: the wgmma path (Hopper, float16) where measured to win: auto | off
    random_rows: int = 0
    random_payloads: bool = False  # --random-rows rows get {"bucket": id % 1000}
    seed: int = 0
    load_npy: str | None = None
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # None: no HTTP endpoint
    shm_mode: int = 0o600  # 0o660: shared with the sidecar user's group (a dedicated sidecar user)
    # --store postgresql://...: a fleet's shared store (None: --data-dir or --ephemeral). Not in
    # the repr: it may hold a password.
    store: str | None = field(default=None, repr=False)
    store_retention_s: float = 600.0  # a follower silent this long is dropped; the log it pinned goes

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


#: Prefix of the environment variables that set serve options: ``--max-k`` <- ``KALOS_MAX_K``.
ENV_PREFIX = "KALOS_"
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def env_var(option: str) -> str:
    """The environment variable of a long option: ``--data-dir`` -> ``KALOS_DATA_DIR``."""
    return ENV_PREFIX + option.lstrip("-").upper().replace("-", "_")


class _EnvValue(str):
    """A default taken from the environment; remembers its variable so a bad value is named.

    argparse converts a ``str`` default with the option's ``type`` only when the option is not on
    the command line, so a bad variable fails ``parse_args`` (usage, exit 2) and only then: other
    commands, ``--help`` and an option given on the command line are not affected by it."""

    var: str

    def __new__(cls, value: str, var: str) -> _EnvValue:
        self = super().__new__(cls, value)
        self.var = var
        return self


def _converter(kind: Callable[[str], Any], what: str,
               choices: Sequence[str] | None = None) -> Callable[[str], Any]:
    def convert(raw: str) -> Any:
        source = f"{raw.var}={str(raw)!r}" if isinstance(raw, _EnvValue) else repr(raw)
        try:
            value = kind(raw.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{source} is not {what}") from None
        if choices is not None and value not in choices:
            raise argparse.ArgumentTypeError(f"{source}: choose from {', '.join(choices)}")
        return value

    convert.__name__ = what  # argparse names the type in some messages
    return convert


def _flag(raw: str) -> bool:
    low = raw.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(raw)


class _EnvFlag(argparse.Action):
    """A ``store_true`` flag whose default may come from the environment (1/true/yes/on, 0/...)."""

    def __init__(self, option_strings: list[str], dest: str, **kw: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, **kw)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, True)


def add_serve_arguments(p: argparse.ArgumentParser,
                        environ: Mapping[str, str] | None = None) -> None:
    """Add the options of a sidecar to ``p`` (defaults are those of :class:`ServeConfig`).

    Every option ``--opt-name`` defaults to ``$KALOS_OPT_NAME`` when that variable is set and not
    empty (``environ``, default ``os.environ``); the command line wins over the environment. A
    variable that does not convert fails ``p.parse_args`` naming the variable, and only when the
    option is not given on the command line."""
    env = os.environ if environ is None else environ

    def opt(flag: str, *, kind: type[str | int | float] = str,
            choices: Sequence[str] | None = None, default: Any = None, help: str,
            dest: str | None = None, switch: bool = False) -> None:
        var = env_var(flag)
        raw = env.get(var, "")
        kw: dict[str, Any] = {"default": _EnvValue(raw, var) if raw else default,
                              "help": f"{help} [env {var}]"}
        if dest is not None:
            kw["dest"] = dest
        what = {int: "an integer", float: "a number"}.get(kind, "a string")
        if choices is not None:
            kw["choices"] = choices
        if switch:  # an on/off option without a value
            p.add_argument(flag, action=_EnvFlag, type=_converter(_flag, "1/true/yes/on or 0/false/no/off"),
                           **kw)
            return
        p.add_argument(flag, type=_converter(kind, what, choices), **kw)

    opt("--name", default="default", help="broker name scoping the shared objects (default: default)")
    opt("--dim", kind=int, default=128, help="vector dimension (default: 128)")
    opt("--slots", kind=int, default=64, help="shared-memory slots = max in-flight requests (default: 64)")
    opt("--max-k", kind=int, default=128, help="largest k a request may ask (default: 128)")
    opt("--max-queries", kind=int, default=32,
        help="rows per slot: queries of recall_many, vectors of one upsert chunk (default: 32)")
    opt("--blob-bytes", kind=int, default=256 * 1024, help="per-slot payload area in bytes (default: 262144)")
    opt("--backend", choices=["auto", "numpy", "cuda"], default="auto",
        help="auto: CUDA if CuPy and a GPU are usable, else numpy (default: auto)")
    opt("--dtype", choices=["float32", "float16", "bfloat16"], default="float32",
        help="storage dtype of the matrix on the GPU (numpy: float32 only)")
    opt("--metric", choices=["dot", "cosine", "l2"], default="dot", help="similarity (default: dot)")
    opt("--devices", default="all",
        help="GPUs the cuda backend spreads every namespace over: all, or a comma list such as "
             "0,1 (default: all visible)")
    opt("--device", kind=int, default=None, help="one CUDA device ordinal (the same as --devices N)")
    opt("--shards", kind=int, default=0,
        help="shards per namespace: 0 = one per device (1 on numpy); more than the devices "
             "places several on each (default: 0)")
    opt("--data-dir", help="durable store directory (SQLite, WAL); restarts keep acknowledged writes")
    opt("--ephemeral", default=False, switch=True, help="keep memories in memory only (env: 1/true/yes/on)")
    opt("--store", help="a fleet's shared store, postgresql://USER@HOST:PORT/DB?sslmode=...: every "
                        "sidecar on it keeps a replica that follows it (docs/deploy.md, \"Several "
                        "nodes\"); give the password through PGPASSWORD or PGPASSFILE, or set the "
                        "whole URI in the environment, so it is not in `ps`")
    opt("--store-retention", kind=float, default=600.0,
        help="--store: seconds a silent follower keeps the change log from being pruned; one "
             "away longer reloads everything when it comes back (default: 600)")
    opt("--payload-limit", kind=int, default=16 * 1024, help="max bytes of one payload (default: 16384)")
    opt("--spin-us", kind=float, default=250.0,
        help="after a batch, poll the slots this long before sleeping on the doorbell (default: 250)")
    opt("--gather-us", kind=float, default=1000.0,
        help="when fewer requests are posted than the last batch held, wait up to a quarter "
             "of that batch's service time, at most this long, for the rest (default: 1000; 0: off)")
    opt("--pipeline", choices=["auto", "on", "off"], default="auto",
        help="start the next recall batch on the device while one runs: on, off, or auto "
             "(only for batches of at least 2^34 rows x queries x dim; default: auto)")
    opt("--host-search-work", kind=int, default=None,
        help="cuda backend: a search of at most this many rows x queries x padded dim is scored "
             "on the sidecar's CPU from a host copy of the rows, as a GPU launch would cost more "
             "(default: 131072, measured on an H200 host; 0: always on the GPU)")
    opt("--fused-kernel", default="auto",
        help="cuda backend: auto searches with the fused wgmma kernel (Hopper GPUs, float16 "
             "storage) where it was measured to beat the GEMM paths, off never (default: auto)")
    opt("--random-rows", kind=int, default=0, help="fill namespace 'default' with N random rows (ephemeral only)")
    opt("--random-payloads", default=False, switch=True,
        help='give each --random-rows row the payload {"bucket": id %% 1000} (benchmarks of '
             'filtered recall)')
    opt("--seed", kind=int, default=0, help="seed of --random-rows")
    opt("--load", help="fill namespace 'default' from an (n, dim) .npy file (ephemeral only)")
    opt("--metrics-host", default="127.0.0.1", help="address of /metrics, /healthz, /readyz")
    opt("--metrics-port", kind=int, default=-1, help="port of the HTTP endpoint (-1: off)")
    opt("--shm-mode", choices=["0600", "0660"], default="0600",
        help="mode of the shared objects: 0600 (clients run as this user) or 0660 (clients "
             "in this user's group, for a dedicated sidecar user; they pass sidecar_uid=)")
    if p.epilog is None:
        p.epilog = (f"Every option --opt-name may be set by the environment variable "
                    f"{ENV_PREFIX}OPT_NAME (e.g. {ENV_PREFIX}DIM=768, {ENV_PREFIX}DATA_DIR=/var/lib/kalos, "
                    f"{ENV_PREFIX}EPHEMERAL=1); the command line wins; an empty variable is unset.")


def config_from_args(a: argparse.Namespace) -> ServeConfig:
    """The config of options parsed by a parser given :func:`add_serve_arguments`.

    Raises ConfigError unless one of ``--data-dir`` and ``--ephemeral`` is given: where the
    memories live is never a default."""
    if a.store is not None:  # (its value is never echoed: it may hold a password)
        if a.data_dir is not None or a.ephemeral:
            raise ConfigError("--store keeps the memories in PostgreSQL: give it without "
                              "--data-dir and --ephemeral")
        if not str(a.store).startswith(("postgresql://", "postgres://")):
            raise ConfigError("--store takes a postgresql:// URI (value not shown: it may hold "
                              "a password)")
    elif a.data_dir is None and not a.ephemeral:
        raise ConfigError("give --data-dir DIR (durable), --store postgresql://... (a fleet's "
                          "shared store) or --ephemeral (memory only)")
    if a.host_search_work is not None and a.host_search_work < 0:
        raise ConfigError(f"--host-search-work must be >= 0, got {a.host_search_work}")
    if a.fused_kernel not in ("auto", "off"):
        raise ConfigError(f"--fused-kernel must be auto or off, got {a.fused_kernel!r}")
    return ServeConfig(
        name=a.name, dim=a.dim, slots=a.slots, max_k=a.max_k, max_queries=a.max_queries,
        blob_bytes=a.blob_bytes, payload_limit=a.payload_limit, backend=a.backend,
        storage_dtype=a.dtype, metric=a.metric,
        devices=a.devices if a.device is None else str(a.device), shards=a.shards,
        data_dir=None if a.ephemeral else a.data_dir, spin_us=a.spin_us, gather_us=a.gather_us,
        pipeline=a.pipeline, host_search_work=a.host_search_work,
        fused_kernel=a.fused_kernel, random_rows=a.random_rows, random_payloads=a.random_payloads,
        seed=a.seed, load_npy=a.load, metrics_host=a.metrics_host,
        metrics_port=None if a.metrics_port < 0 else a.metrics_port, shm_mode=int(a.shm_mode, 8),
        store=None if a.store is None else str(a.store), store_retention_s=a.store_retention)
