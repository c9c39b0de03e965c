"""Which problems the fused Metal kernels handle: the rules live in one place,
the C++ launch plan (csrc/launch_plan.cpp), asked here through _ext."""

from __future__ import annotations

import mlx.core as mx

DTYPE_NAMES = {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16"}


def mask_kind(mask) -> int:
    from mlx_attn.ops import _ext

    if not isinstance(mask, mx.array):
        return _ext.MASK_NONE
    return _ext.MASK_BOOL if mask.dtype == mx.bool_ else _ext.MASK_ADDITIVE


def launch_plan(q, k, v, mask=None, sinks=None, window_size=None, scale=1.0, strides=None) -> dict:
    """The launch plan for these arrays (strides: element strides of q, k, v
    and the broadcast mask; row-contiguous when not given)."""
    from mlx_attn.ops import _ext

    def contiguous(shape):
        out, step = [], 1
        for n in reversed(shape):
            out.append(step)
            step *= n
        return list(reversed(out))

    strides = strides or {}
    return _ext.attention_launch_plan(
        q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3],
        DTYPE_NAMES.get(q.dtype, str(q.dtype)),
        strides.get("q", contiguous(q.shape)), strides.get("k", contiguous(k.shape)),
        strides.get("v", contiguous(v.shape)), strides.get("mask", [0, 0, 0, 0]),
        mask_kind=mask_kind(mask), causal=isinstance(mask, str), window_size=window_size or 0,
        has_sinks=sinks is not None, scale=float(scale),
    )


def unsupported_reason(q: mx.array, k: mx.array, v: mx.array, mask, sinks, window_size) -> str | None:
    """None when the Metal kernels handle this problem on the GPU, else why not."""
    from mlx_attn.ops import _ext

    if _ext is None or not _ext.has_metal():
        return "this build of mlx_attn has no Metal kernels (MLX without Metal)"
    plan = launch_plan(q, k, v, mask, sinks, window_size)
    return None if plan["supported"] else plan["reason"]
