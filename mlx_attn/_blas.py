"""A fast BLAS for MLX's float32 matrix products on Linux.

MLX's Linux wheels (``mlx-cpu``) link the reference (netlib) BLAS, whose
``sgemm`` runs at ~1 GFLOP/s: on this project's 2-core machines a float32
matmul is 20-40x slower than with an optimised BLAS, which makes training
(``examples/train_shakespeare.py``) and any float32 model crawl. A system
OpenBLAS (Debian/Ubuntu ``libopenblas0``) exports the same CBLAS/BLAS
symbols; loaded into the process's global symbol scope *before* MLX's
library, it is what MLX's calls bind to.

This rebinds the whole process's BLAS, so it happens only on request:
:func:`use_system_blas` (``mlx_attn.use_system_blas()``), called before
anything imports ``mlx.core``; the ``mlx-attn`` command, the examples and
the training script call it. Nothing changes on macOS (MLX uses Accelerate
there) or once ``mlx.core`` is imported (the binding is already made; MLX
keeps its bundled BLAS).

``MLX_ATTN_BLAS``: ``auto`` (default: the system OpenBLAS when found),
``off``, or the path of a BLAS shared library exporting ``cblas_sgemm``.
This module must not import MLX.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from dataclasses import dataclass

ENV = "MLX_ATTN_BLAS"
_KNOWN_OPENBLAS = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)


@dataclass(frozen=True)
class BlasChoice:
    library: str | None  # the preloaded library, None: MLX's own BLAS
    reason: str  # why, in words


_NOT_REQUESTED = BlasChoice(None, "not requested: MLX's bundled BLAS (mlx_attn.use_system_blas(), called before "
                                  "mlx.core is imported, binds a system OpenBLAS)")
_choice = _NOT_REQUESTED


def _find_openblas() -> str | None:
    for path in _KNOWN_OPENBLAS:
        if os.path.exists(path):
            return path
    name = ctypes.util.find_library("openblas")
    return name


def use_system_blas() -> BlasChoice:
    """Load a fast BLAS into the global symbol scope if that can still take
    effect (see the module docstring); idempotent. Returns the choice."""
    global _choice
    if _choice is not _NOT_REQUESTED:
        return _choice
    setting = os.environ.get(ENV, "auto").strip()
    if not sys.platform.startswith("linux"):
        _choice = BlasChoice(None, "not Linux: MLX's own BLAS (Accelerate on macOS)")
    elif setting.lower() == "off":
        _choice = BlasChoice(None, f"{ENV}=off: MLX's bundled BLAS")
    elif "mlx.core" in sys.modules:
        _choice = BlasChoice(None, "mlx.core was imported before use_system_blas(): MLX keeps its bundled BLAS "
                                   "(call it first to use a system OpenBLAS)")
    else:
        explicit = setting.lower() != "auto"
        library = setting if explicit else _find_openblas()
        if library is None:
            _choice = BlasChoice(None, "no system OpenBLAS found (apt-get install libopenblas0): "
                                       "MLX's bundled reference BLAS, slow float32 matmuls")
        else:
            try:
                handle = ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL)
                handle.cblas_sgemm  # noqa: B018 - raises AttributeError if absent
            except (OSError, AttributeError) as error:
                if explicit:
                    raise ValueError(f"{ENV}={setting!r} is not a loadable BLAS exporting cblas_sgemm: "
                                     f"{error}") from None
                _choice = BlasChoice(None, f"{library} could not be loaded ({error}): MLX's bundled BLAS")
            else:
                _choice = BlasChoice(library, "preloaded before MLX, so MLX's BLAS calls use it")
    return _choice


def blas_choice() -> BlasChoice:
    """What :func:`use_system_blas` decided for this process (or that it
    was not called)."""
    return _choice
