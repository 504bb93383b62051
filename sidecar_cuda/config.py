"""What a sidecar is told at start: :class:`ServeConfig`, and the command-line options that fill it.

The options are defined once, in :func:`add_serve_arguments`; ``python -m kalos.sidecar_cuda`` and
``kalos serve`` both add them to their parser and turn the parsed arguments into a config with
:func:`config_from_args`.
"""

from __future__ import annotations

import argparse
import enum
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..broker.errors import ConfigError
from ..broker.layout import GEOMETRY_LIMITS, Layout, Metric
from .backends.options import BackendKind, FusedKernel, Int8Pass, StorageDtype, parse_option
from .serving.launch import Launch


class Pipelining(str, enum.Enum):
    """``--pipeline``: start the next recall batch on the device while one runs. The values are
    the option's spellings (a config prints and compares as it was given)."""

    AUTO = "auto"  # for batches of batching.PIPELINE_MIN_WORK and more
    ON = "on"
    OFF = "off"


#: The option that sets each field of the segment's layout (``broker.layout.GEOMETRY_LIMITS``).
LAYOUT_OPTIONS = {
    "n_slots": "--slots",
    "dim": "--dim",
    "max_k": "--max-k",
    "max_queries": "--max-queries",
    "blob_bytes": "--blob-bytes",
}


@dataclass
class ServeConfig:
    name: str = "default"
    dim: int = 128
    slots: int = 64
    max_k: int = 128
    max_queries: int = 32
    blob_bytes: int = 256 * 1024
    payload_limit: int = 16 * 1024
    backend: BackendKind = BackendKind.AUTO
    storage_dtype: StorageDtype = StorageDtype.FLOAT32
    metric: str = "dot"
    devices: str = "all"  # GPUs of the cuda backend: all, or a comma list (--device N: "N")
    shards: int = 0  # shards per namespace: 0 = one per device (1 on numpy)
    data_dir: str | None = None  # None: ephemeral (in memory only)
    spin_us: float = 250.0
    gather_us: float = 1000.0
    launch: Launch = Launch.FILL
    pipeline: Pipelining = Pipelining.AUTO
    host_search_work: int | None = None  # cuda: searches this small run on the CPU (None: default)
    fused_kernel: FusedKernel = FusedKernel.AUTO  # cuda backend
    int8_pass: Int8Pass = Int8Pass.AUTO  # cuda backend
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
    embed: str | None = None  # --embed DIR: the embedding model served (Op.EMBED); None: none

    def __post_init__(self) -> None:
        # The one check of these options: the command line and direct construction (tests, the
        # harness) give their spellings, and nothing downstream sees a string.
        self.pipeline = parse_option(Pipelining, self.pipeline, "--pipeline")
        self.launch = parse_option(Launch, self.launch, "--launch")
        self.backend = parse_option(BackendKind, self.backend, "--backend")
        self.storage_dtype = parse_option(StorageDtype, self.storage_dtype, "--dtype")
        self.fused_kernel = parse_option(FusedKernel, self.fused_kernel, "--fused-kernel")
        self.int8_pass = parse_option(Int8Pass, self.int8_pass, "--int8-pass")
        self.metric_enum()  # (checked here, once: ConfigError names the choices)

    def layout(self) -> Layout:
        """The segment's geometry; ConfigError names the option out of bounds (``--slots``, not
        the layout's ``n_slots``)."""
        lay = Layout(
            n_slots=self.slots, dim=self.dim, max_k=self.max_k, max_queries=self.max_queries, blob_bytes=self.blob_bytes
        )
        for fname, lo, hi in GEOMETRY_LIMITS:
            v = getattr(lay, fname)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ConfigError(f"{LAYOUT_OPTIONS[fname]} must be an integer in [{lo}, {hi}], got {v!r}")
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
#: Namespace attributes where parsing records where values came from: the options given on the
#: command line (a set, made by the first one), and the defaults taken from the environment
#: (dest -> ``VAR='value'``, a parser default).
_GIVEN = "_kalos_given"
_FROM_ENV = "_kalos_from_env"


class Source(enum.Enum):
    """Where an option's value came from."""

    COMMAND_LINE = "command line"
    ENVIRONMENT = "environment"
    DEFAULT = "default"


@dataclass(frozen=True)
class Origin:
    source: Source
    detail: str  # "the command line", "KALOS_EPHEMERAL='1'", "the default"

    def __str__(self) -> str:
        return self.detail


def origin(a: argparse.Namespace, dest: str) -> Origin:
    """Where option ``dest`` of arguments parsed by a parser given these options came from."""
    if dest in getattr(a, _GIVEN, ()):
        return Origin(Source.COMMAND_LINE, "the command line")
    env: dict[str, str] = getattr(a, _FROM_ENV, None) or {}
    if dest in env:
        return Origin(Source.ENVIRONMENT, env[dest])
    return Origin(Source.DEFAULT, "the default")


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


def _converter(kind: Callable[[str], Any], what: str, choices: Sequence[str] | None = None) -> Callable[[str], Any]:
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


def _mark_given(namespace: argparse.Namespace, dest: str) -> None:
    given: set[str] | None = getattr(namespace, _GIVEN, None)
    if given is None:
        given = set()
        setattr(namespace, _GIVEN, given)
    given.add(dest)


class _Store(argparse.Action):
    """argparse's ``store``, remembering that the option was on the command line."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, self._value(values))
        _mark_given(namespace, self.dest)

    def _value(self, values: Any) -> Any:
        return values


class _EnvFlag(_Store):
    """A ``store_true`` flag whose default may come from the environment (1/true/yes/on, 0/...)."""

    def __init__(self, option_strings: list[str], dest: str, **kw: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, **kw)

    def _value(self, values: Any) -> bool:
        return True


def shown_default(default: object) -> str:
    """How help text writes a default: ``none`` for None, ``off`` for False."""
    if default is None:
        return "none"
    if isinstance(default, bool):
        return "on" if default else "off"
    return str(default)


def add_env_option(
    p: argparse.ArgumentParser,
    flag: str,
    *,
    help: str,
    kind: type[str | int | float] = str,
    choices: Sequence[str] | None = None,
    default: Any = None,
    shown: str | None = None,
    dest: str | None = None,
    switch: bool = False,
    environ: Mapping[str, str] | None = None,
    secret: bool = False,
) -> None:
    """Add ``flag`` to ``p``, defaulting to ``$KALOS_FLAG`` when that variable is set and not empty
    (``environ``, default ``os.environ``); the command line wins. The help text gets the default
    (``shown`` if given) and the variable. A variable that does not convert fails
    ``p.parse_args`` naming the variable, and only when the option is not on the command line.
    ``secret``: the value may hold a password, so where it came from is recorded without it."""
    env = os.environ if environ is None else environ
    var = env_var(flag)
    raw = env.get(var, "")
    kw: dict[str, Any] = {
        "default": _EnvValue(raw, var) if raw else default,
        "help": f"{help} (default: {shown if shown is not None else shown_default(default)}) [env {var}]",
    }
    if dest is not None:
        kw["dest"] = dest
    if choices is not None:
        kw["choices"] = choices
    what = {int: "an integer", float: "a number"}.get(kind, "a string")
    if switch:  # an on/off option without a value
        action = p.add_argument(flag, action=_EnvFlag, type=_converter(_flag, "1/true/yes/on or 0/false/no/off"), **kw)
    else:
        action = p.add_argument(flag, action=_Store, type=_converter(kind, what, choices), **kw)
    if raw:
        from_env = dict(p.get_default(_FROM_ENV) or {})
        from_env[action.dest] = f"{var} (value not shown)" if secret else f"{var}={raw!r}"
        p.set_defaults(**{_FROM_ENV: from_env})


def add_name_argument(p: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """``--name`` (``$KALOS_NAME``): the broker a command serves or talks to. Every ``kalos``
    command that takes a broker name adds it with this function."""
    add_env_option(
        p,
        "--name",
        default="default",
        environ=environ,
        help="broker name scoping the shared objects (/dev/shm/kalos.NAME)",
    )


def configure_logging(verbose: bool) -> None:
    """The log of a sidecar or a ``kalos`` command: lines on stderr, DEBUG with ``-v``, else INFO."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )


def add_serve_arguments(p: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """Add the options of a sidecar to ``p`` (defaults are those of :class:`ServeConfig`).

    Every option ``--opt-name`` defaults to ``$KALOS_OPT_NAME`` when that variable is set and not
    empty (``environ``, default ``os.environ``); the command line wins over the environment. A
    variable that does not convert fails ``p.parse_args`` naming the variable, and only when the
    option is not given on the command line."""

    def opt(flag: str, **kw: Any) -> None:
        add_env_option(p, flag, environ=environ, **kw)

    def choice(flag: str, default: enum.Enum, **kw: Any) -> None:
        """An option spelled as the values of ``default``'s enum (ServeConfig makes it a member)."""
        opt(flag, choices=[str(m.value) for m in type(default)], default=default.value, **kw)

    add_name_argument(p, environ)
    opt("--dim", kind=int, default=128, help="vector dimension")
    opt("--slots", kind=int, default=64, help="shared-memory slots = max in-flight requests")
    opt("--max-k", kind=int, default=128, help="largest k a request may ask")
    opt(
        "--max-queries", kind=int, default=32, help="rows per slot: queries of recall_many, vectors of one upsert chunk"
    )
    opt("--blob-bytes", kind=int, default=256 * 1024, help="per-slot payload area in bytes")
    choice("--backend", BackendKind.AUTO, help="auto: CUDA if CuPy and a GPU are usable, else numpy")
    choice("--dtype", StorageDtype.FLOAT32, help="storage dtype of the matrix on the GPU (numpy: float32 only)")
    opt("--metric", choices=["dot", "cosine", "l2"], default="dot", help="similarity")
    opt(
        "--devices",
        default="all",
        help="GPUs the cuda backend spreads every namespace over: all (every visible one), or a comma list such as 0,1",
    )
    opt("--device", kind=int, default=None, help="one CUDA device ordinal (the same as --devices N)")
    opt(
        "--shards",
        kind=int,
        default=0,
        help="shards per namespace: 0 = one per device (1 on numpy); more than the devices places several on each",
    )
    opt(
        "--data-dir",
        shown="none; one of --data-dir, --store and --ephemeral is required",
        help="durable store directory (SQLite, WAL; created 0700 if missing, must belong to "
        "this user); restarts keep acknowledged writes; one sidecar at a time (a second one "
        "on the directory is refused). --store instead: a fleet's shared PostgreSQL store",
    )
    opt(
        "--ephemeral",
        default=False,
        switch=True,
        help="keep memories in memory only; conflicts with --data-dir (env: 1/true/yes/on)",
    )
    opt(
        "--store",
        shown="none",
        secret=True,
        help="a fleet's shared store, postgresql://USER@HOST:PORT/DB?sslmode=...: every "
        'sidecar on it keeps a replica that follows it (docs/deploy.md, "Several '
        'nodes"); give the password through PGPASSWORD or PGPASSFILE, or set the '
        "whole URI in the environment (KALOS_STORE), so it is not in `ps`",
    )
    opt(
        "--store-retention",
        kind=float,
        default=600.0,
        help="--store: seconds a silent follower keeps the change log from being pruned; one "
        "away longer reloads everything when it comes back",
    )
    opt("--payload-limit", kind=int, default=16 * 1024, help="max bytes of one payload")
    opt(
        "--embed",
        shown="none",
        help="an embedding model directory (sentence-transformers or transformers format, a "
        "BERT-family encoder; docs/text.md) loaded once in the sidecar: clients send text "
        "(embed, upsert_text, recall_text); its dimension must equal --dim",
    )
    opt(
        "--spin-us",
        kind=float,
        default=250.0,
        help="after a batch, poll the slots this long before sleeping on the doorbell",
    )
    opt(
        "--gather-us",
        kind=float,
        default=1000.0,
        help="the longest the device is kept waiting for callers about to post, so that a "
        "batch fills (0: never; --launch fill waits less where the device time a fuller batch "
        "saves is smaller, eager a quarter of the last batch's service time)",
    )
    choice(
        "--launch",
        Launch.FILL,
        help="when the next batch leaves: fill (one batch of every caller where that costs the "
        "device less per request than two halves taking turns, measured; a lone caller at "
        "once), eager (once as many are posted as the last batch held: the earlier policy, "
        "kept to compare), or merge / split (fill held in one of its two ways, to measure them)",
    )
    choice(
        "--pipeline",
        Pipelining.AUTO,
        help="start the next recall batch on the device while one runs: on, off, or auto "
        "(only for batches of at least 2^34 rows x queries x dim)",
    )
    opt(
        "--host-search-work",
        kind=int,
        default=None,
        shown="131072, measured on an H200 host",
        help="cuda backend: a search of at most this many rows x queries x padded dim is scored "
        "on the sidecar's CPU from a host copy of the rows, as a GPU launch would cost more "
        "(0: always on the GPU)",
    )
    opt(
        "--fused-kernel",
        default="auto",
        help="cuda backend: auto searches with the fused wgmma kernel (Hopper GPUs, float16 "
        "storage) where it was measured to beat the GEMM paths, off never",
    )
    opt(
        "--int8-pass",
        default="auto",
        help="cuda backend: auto scores small batches over large matrices in int8 first (an int8 "
        "copy of the rows beside them: half the memory of float16 rows; answers stay exact), "
        "off never",
    )
    opt("--random-rows", kind=int, default=0, help="fill namespace 'default' with N random rows (ephemeral only)")
    opt(
        "--random-payloads",
        default=False,
        switch=True,
        help='give each --random-rows row the payload {"bucket": id %% 1000} (benchmarks of filtered recall)',
    )
    opt("--seed", kind=int, default=0, help="seed of --random-rows")
    opt("--load", help="fill namespace 'default' from an (n, dim) .npy file (ephemeral only)")
    opt("--metrics-host", default="127.0.0.1", help="address of /metrics, /healthz, /readyz")
    opt("--metrics-port", kind=int, default=-1, help="port of the HTTP endpoint (-1: off)")
    opt(
        "--shm-mode",
        choices=["0600", "0660"],
        default="0600",
        help="mode of the shared objects: 0600 (clients run as this user) or 0660 (clients "
        "in this user's group, for a dedicated sidecar user; they pass sidecar_uid=)",
    )
    if p.epilog is None:
        p.epilog = (
            f"Every option --opt-name may be set by the environment variable "
            f"{ENV_PREFIX}OPT_NAME (e.g. {ENV_PREFIX}DIM=768, {ENV_PREFIX}DATA_DIR=/var/lib/kalos, "
            f"{ENV_PREFIX}EPHEMERAL=1); the command line wins; an empty variable is unset."
        )


def config_from_args(a: argparse.Namespace) -> ServeConfig:
    """The config of options parsed by a parser given :func:`add_serve_arguments`.

    Raises ConfigError unless exactly one of ``--data-dir``, ``--store`` and ``--ephemeral`` is
    given, from the command line or the environment: where the memories live is never a default,
    and a stray ``KALOS_EPHEMERAL`` must not make a durable sidecar forget everything at its next
    restart. A ``--store`` value is never echoed: it may hold a password."""
    given = [
        (name, f"{flag} (from {origin(a, name)})")
        for name, flag in (("ephemeral", "--ephemeral"), ("data_dir", f"--data-dir {a.data_dir}"), ("store", "--store"))
        if (getattr(a, name) if name == "ephemeral" else getattr(a, name) is not None)
    ]
    if not given:
        raise ConfigError(
            "give --data-dir DIR (durable), --store postgresql://... (a fleet's "
            "shared store) or --ephemeral (memory only)"
        )
    if len(given) > 1:
        raise ConfigError(" conflicts with ".join(g for _, g in given) + ": give one of them")
    if a.store is not None and not str(a.store).startswith(("postgresql://", "postgres://")):
        raise ConfigError("--store takes a postgresql:// URI (value not shown: it may hold a password)")
    if a.host_search_work is not None and a.host_search_work < 0:
        raise ConfigError(f"--host-search-work must be >= 0, got {a.host_search_work}")
    return ServeConfig(
        name=a.name,
        dim=a.dim,
        slots=a.slots,
        max_k=a.max_k,
        max_queries=a.max_queries,
        blob_bytes=a.blob_bytes,
        payload_limit=a.payload_limit,
        backend=a.backend,
        storage_dtype=a.dtype,
        metric=a.metric,
        devices=a.devices if a.device is None else str(a.device),
        shards=a.shards,
        data_dir=a.data_dir,
        spin_us=a.spin_us,
        gather_us=a.gather_us,
        launch=a.launch,
        pipeline=a.pipeline,
        host_search_work=a.host_search_work,
        fused_kernel=a.fused_kernel,
        int8_pass=a.int8_pass,
        random_rows=a.random_rows,
        random_payloads=a.random_payloads,
        seed=a.seed,
        load_npy=a.load,
        metrics_host=a.metrics_host,
        metrics_port=None if a.metrics_port < 0 else a.metrics_port,
        shm_mode=int(a.shm_mode, 8),
        store=None if a.store is None else str(a.store),
        store_retention_s=a.store_retention,
        embed=a.embed,
    )
