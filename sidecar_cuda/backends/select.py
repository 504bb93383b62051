"""The one place a backend is chosen: ``--backend auto|numpy|cuda`` becomes a :class:`Backend`.

The backends are imported here, when chosen, and by nothing else of the sidecar:
:mod:`kalos.sidecar_cuda.backends.base` stays the interface that every backend imports, with no circle.
"""

from __future__ import annotations

from ...broker.errors import ConfigError
from .base import Backend
from .options import BackendKind, FusedKernel, Int8Pass, StorageDtype, parse_option
from .sharded import ShardedBackend, parse_devices


def choose_backend(
    kind: BackendKind | str,
    *,
    storage_dtype: StorageDtype | str = StorageDtype.FLOAT32,
    devices: str = "all",
    shards: int = 0,
    host_work: int | None = None,
    fused_kernel: FusedKernel = FusedKernel.AUTO,
    int8_pass: Int8Pass = Int8Pass.AUTO,
) -> Backend:
    """``auto`` picks CUDA when CuPy and a GPU are usable, numpy otherwise.

    ``devices``: the GPUs of the CUDA backend (``all`` or ``0,1``...); ``shards``: how many shards
    each namespace is spread over (0: one per device, and 1 on numpy); more shards than devices
    place several on a device (round-robin). One shard is the plain backend, more a
    :class:`~kalos.sidecar_cuda.backends.sharded.ShardedBackend`. ``host_work``: the CUDA backend's
    ``--host-search-work`` (None: its default); ``fused_kernel``: its ``--fused-kernel``; ``int8_pass``: its ``--int8-pass``.

    Raises ConfigError for an unknown ``kind``, for ``cuda`` where CUDA is not usable, for
    devices that do not exist, and for a ``storage_dtype`` other than float32 on numpy."""
    kind = parse_option(BackendKind, kind, "--backend")
    dtype = parse_option(StorageDtype, storage_dtype, "--dtype")
    if shards < 0:
        raise ConfigError(f"--shards must be >= 0, got {shards}")
    if kind is not BackendKind.NUMPY:
        try:
            from .cuda import CupyBackend, cuda_available, device_count
        except ImportError as e:  # no CUDA backend module or no CuPy
            if kind is BackendKind.CUDA:
                raise ConfigError(f"--backend cuda needs CuPy: {e}") from None
        else:
            why = cuda_available()
            if why is None:
                from .cuda.planner import HOST_WORK

                hw = HOST_WORK if host_work is None else host_work
                devs = parse_devices(devices, device_count())
                n = shards or len(devs)
                if n == 1:
                    return CupyBackend(
                        storage_dtype=dtype.value,
                        device=devs[0],
                        host_work=hw,
                        fused_kernel=fused_kernel,
                        int8_pass=int8_pass,
                    )
                placed = [devs[i % len(devs)] for i in range(n)]
                parts: list[Backend] = [
                    CupyBackend(
                        storage_dtype=dtype.value,
                        device=d,
                        host_work=hw,
                        fused_kernel=fused_kernel,
                        int8_pass=int8_pass,
                    )
                    for d in placed
                ]
                return ShardedBackend(parts, [f"cuda:{d}" for d in placed])
            if kind is BackendKind.CUDA:
                raise ConfigError(f"--backend cuda: {why}")
    if dtype is not StorageDtype.FLOAT32:
        raise ConfigError(f"the numpy backend stores float32 only, not {dtype.value}")
    from .numpy_backend import NumpyBackend

    if shards <= 1:
        return NumpyBackend()
    return ShardedBackend([NumpyBackend() for _ in range(shards)], [f"cpu{i}" for i in range(shards)])
