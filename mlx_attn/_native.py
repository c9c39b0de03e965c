"""The one home of the native extension ``mlx_attn._ext``.

Loads it, checks that it was built against the installed MLX (it links
libmlx and shares MLX's nanobind types, so a mismatch is an ImportError), and
says loudly when it is missing: imported from a source checkout that was never
built, every call would quietly take the reference path, which materializes
the ``Tq x Tkv`` scores. The first call that would have been fused warns once.
"""

from __future__ import annotations

import warnings

import mlx.core as mx

__all__ = ["ext", "MISSING_REASON", "warn_if_missing"]

try:
    from mlx_attn import _ext as ext
except ImportError as _error:
    ext = None
    MISSING_REASON: str | None = (
        f"the native extension mlx_attn._ext is not built ({_error}); build it with "
        f"`pip install .`, or `pip install -e .` in a source checkout"
    )
else:
    MISSING_REASON = None
    if ext.built_with_mlx != mx.__version__.split(".dev")[0]:
        raise ImportError(
            f"mlx_attn was built against MLX {ext.built_with_mlx} but MLX {mx.__version__} "
            f"is installed; reinstall mlx_attn (pip install --force-reinstall --no-cache-dir mlx_attn) "
            f"or install mlx=={ext.built_with_mlx}"
        )

_warned = False


def warn_if_missing() -> None:
    """Warns once per process when the extension is missing."""
    global _warned
    if ext is None and not _warned:
        _warned = True
        warnings.warn(
            f"mlx_attn: {MISSING_REASON}. Falling back to the reference path, which "
            f"materializes the full attention matrix.",
            UserWarning,
            stacklevel=4,
        )
