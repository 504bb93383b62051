"""The thread count of the BLAS library numpy uses (OpenBLAS), for the numpy backend.

A product of a few hundred rows is faster on one thread whenever the other cores are busy: a
second BLAS thread must be woken and scheduled, and on a small host the cores are taken by the
clients the sidecar is answering (measured on 2 vCPUs: 64 callers served 2.8x faster with the
sidecar's small products on one thread; bench/results/README.md). Large products keep every
thread. numpy does not expose the setting, so this module finds the OpenBLAS library loaded in
the process (Linux: ``/proc/self/maps``) and calls its ``*set_num_threads*`` entry through ctypes,
as threadpoolctl does. Where none is found (another BLAS, another OS) nothing is changed.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable

log = logging.getLogger("kalos.sidecar")

#: Entry points of OpenBLAS builds: plain, 64-bit-integer, and numpy's bundled scipy-openblas.
_PREFIXES = ("openblas_", "scipy_openblas_")
_SUFFIXES = ("", "64_")


def loaded_openblas(maps_path: str = "/proc/self/maps") -> list[str]:
    """Paths of the OpenBLAS libraries mapped into this process (empty where unknown)."""
    try:
        with open(maps_path) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    paths = []
    for line in lines:
        path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
        name = path.rsplit("/", 1)[-1].lower()
        if "openblas" in name and ".so" in name and path not in paths:
            paths.append(path)
    return paths


class BlasThreads:
    """Set the library's thread count (process-wide); calls it only when the count changes.
    ``busy`` counts the searches running on worker threads, which may be inside BLAS: the count
    is lowered only while none is (raising it back is always allowed)."""

    def __init__(self, setter: Callable[[int], None], getter: Callable[[], int], library: str) -> None:
        self._set = setter
        self.library = library
        self.default = max(1, int(getter()))  # what the library (or OPENBLAS_NUM_THREADS) chose
        self.current = self.default
        self._lock = threading.Lock()
        self.busy = 0

    def set(self, n: int) -> None:
        with self._lock:
            if n != self.current:
                self._set(n)
                self.current = n

    def enter(self) -> None:
        """A worker-thread search is about to run."""
        with self._lock:
            self.busy += 1

    def leave(self) -> None:
        with self._lock:
            self.busy -= 1


_FOUND: list[BlasThreads | None] = []  # the one control of this process, once looked for


def find_blas_threads() -> BlasThreads | None:
    """The thread control of the OpenBLAS numpy loaded, or None (logged once). The same object
    for every caller: the setting is process-wide, and so is the ``busy`` count."""
    if not _FOUND:
        _FOUND.append(_find())
    return _FOUND[0]


def _find() -> BlasThreads | None:
    import numpy  # noqa: F401  (loads the library, if it is not loaded yet)

    for path in loaded_openblas():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix in _PREFIXES:
            for suffix in _SUFFIXES:
                setter = getattr(lib, f"{prefix}set_num_threads{suffix}", None)
                getter = getattr(lib, f"{prefix}get_num_threads{suffix}", None)
                if setter is not None and getter is not None:
                    setter.restype = None
                    setter.argtypes = [ctypes.c_int]
                    getter.restype = ctypes.c_int
                    getter.argtypes = []
                    return BlasThreads(setter, getter, path)
    log.info("BLAS thread count not controllable (no OpenBLAS found): small products may use every BLAS thread")
    return None


__all__ = ["BlasThreads", "find_blas_threads", "loaded_openblas"]
