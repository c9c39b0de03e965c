"""Which problems the fused Metal kernels handle (see metal/ and csrc/launch_plan)."""

from __future__ import annotations

import mlx.core as mx


def unsupported_reason(q: mx.array, k: mx.array, v: mx.array, mask, sinks, window_size) -> str | None:
    """None when the Metal kernels handle this problem on the GPU, else why not."""
    from mlx_attn.ops import _ext

    if _ext is None or not _ext.has_metal():
        return "this build of mlx_attn has no Metal kernels"
    return "the Metal kernels are not available yet"
