"""The one place a backend is chosen: ``--backend auto|numpy|cuda`` becomes a :class:`Backend`.

The backends are imported here, when chosen, and by nothing else of the sidecar:
:mod:`sidecar_cuda.backends.base` stays the interface that every backend imports, with no circle.
"""

from __future__ import annotations

from broker.errors import ConfigError
from sidecar_cuda.backends.base import Backend


def choose_backend(kind: str, *, storage_dtype: str = "float32", device: int = 0) -> Backend:
    """``auto`` picks CUDA when CuPy and a GPU are usable, numpy otherwise.

    Raises ConfigError for an unknown ``kind``, for ``cuda`` where CUDA is not usable, and for a
    ``storage_dtype`` other than float32 on numpy."""
    if kind not in ("auto", "numpy", "cuda"):
        raise ConfigError(f"backend must be auto, numpy or cuda, got {kind!r}")
    if kind in ("auto", "cuda"):
        try:
            from sidecar_cuda.backends.cuda import CupyBackend, cuda_available
        except ImportError as e:  # no CUDA backend module or no CuPy
            if kind == "cuda":
                raise ConfigError(f"--backend cuda needs CuPy: {e}") from None
        else:
            why = cuda_available()
            if why is None:
                return CupyBackend(storage_dtype=storage_dtype, device=device)
            if kind == "cuda":
                raise ConfigError(f"--backend cuda: {why}")
    if storage_dtype != "float32":
        raise ConfigError(f"the numpy backend stores float32 only, not {storage_dtype}")
    from sidecar_cuda.backends.numpy_backend import NumpyBackend

    return NumpyBackend()
