"""Build of the optional compiled slot path (everything else is in pyproject.toml).

Two C extensions do the byte work of the slot protocol (``docs/protocol.md``) under the Python API:
``kalos.clients._cslot`` (a client's encode + write + post and its answer's decode) and
``kalos.sidecar_cuda.serving._cserve`` (the sidecar's scan, gather and answer writing). Both include the
header generated from ``broker/layout.py`` (``broker/kalos_protocol.h``) and numpy's C API (numpy
is a build requirement: the extensions make the result arrays themselves). They are optional: where
no C compiler is found, numpy's headers are missing, or a build fails, the install goes on with a
warning and Kalos runs the pure-Python slot path (``kalos.broker.slotpath``), which behaves
identically.
"""

from __future__ import annotations

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

_FLAGS = ["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror=implicit-function-declaration", "-fvisibility=hidden"]


class OptionalBuildExt(build_ext):
    """Build each extension if possible; a failure is a warning, never a failed install."""

    def run(self) -> None:
        if os.environ.get("KALOS_NO_EXTENSIONS") == "1":
            print("kalos: KALOS_NO_EXTENSIONS=1: not building the compiled slot path", file=sys.stderr)
            return
        try:
            super().run()
        except Exception as e:  # no compiler at all, a broken toolchain
            self._skip("the extensions", e)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as e:
            self._skip(ext.name, e)

    @staticmethod
    def _skip(what: str, e: BaseException) -> None:
        print(
            f"kalos: WARNING: could not build {what} ({type(e).__name__}: {e}); "
            "Kalos will run the pure-Python slot path",
            file=sys.stderr,
        )


def _numpy_include() -> list[str]:
    """numpy's C headers, if numpy is importable (else the build fails and is skipped, warned)."""
    try:
        import numpy
    except ImportError:
        print("kalos: numpy is not importable at build time: no compiled slot path", file=sys.stderr)
        return []
    return [numpy.get_include()]


def _ext(name: str, source: str) -> Extension:
    return Extension(
        name,
        sources=[source],
        include_dirs=["broker", *_numpy_include()],
        depends=["broker/kalos_protocol.h"],
        extra_compile_args=_FLAGS,
        libraries=["pthread"],  # sem_open and friends (glibc < 2.34 keeps them in libpthread)
    )


setup(
    ext_modules=[
        _ext("kalos.clients._cslot", "clients/_cslot.c"),
        _ext("kalos.sidecar_cuda.serving._cserve", "sidecar_cuda/serving/_cserve.c"),
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)
