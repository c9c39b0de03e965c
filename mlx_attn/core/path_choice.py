"""The path choice's vocabulary: the ``backend`` argument every attention
call takes, the paths a call can take, and :class:`PathChoice`, the path
with the reason a fused kernel does not run the call."""

from __future__ import annotations

from typing import Literal, NamedTuple

__all__ = ["Backend", "BACKENDS", "check_backend", "Path", "QuantizedPath", "PagedPath", "PathChoice"]

Backend = Literal["auto", "fused", "reference"]
BACKENDS = ("auto", "fused", "reference")
# dense attention; over quantized K/V or paged K/V there is no mx.fast path
Path = Literal["fused-cpu", "fused-metal", "mlx-fast", "reference"]
QuantizedPath = Literal["fused-cpu", "fused-metal", "reference"]
PagedPath = Literal["fused-cpu", "fused-metal", "reference"]


class PathChoice(NamedTuple):
    """``attention_path(..., explain=True)``: the path and, whenever it is not
    a fused kernel, the human reason why not (None on a fused path)."""

    path: Path
    reason: str | None


def check_backend(backend) -> str:
    """``backend``: ``"auto"``, ``"fused"`` or ``"reference"``."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto', 'fused' or 'reference', got {backend!r}")
    return backend
