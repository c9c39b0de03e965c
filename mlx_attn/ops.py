"""``mlx_attn.scaled_dot_product_attention``: validation and dispatch.

The contract is exactly that of ``mx.fast.scaled_dot_product_attention``
(MLX 0.32), plus keyword-only extensions (``window_size``, ``backend``).
One documented difference: a query row that can see no key at all (fully
masked) returns zeros, where MLX returns an average of the values.
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import mlx.core as mx

from mlx_attn.reference import reference_attention

try:  # the native extension; the reference path works without it
    from mlx_attn import _ext
except ImportError as _error:  # pragma: no cover - only without a build
    _ext = None
    _EXT_ERROR = _error
else:
    _EXT_ERROR = None
    # The extension links against libmlx and shares MLX's nanobind types, so
    # it only works with the MLX release it was compiled against.
    if _ext.built_with_mlx != mx.__version__.split(".dev")[0]:
        raise ImportError(
            f"mlx_attn was built against MLX {_ext.built_with_mlx} but MLX {mx.__version__} "
            f"is installed; reinstall mlx_attn (pip install --force-reinstall --no-cache-dir mlx_attn) "
            f"or install mlx=={_ext.built_with_mlx}"
        )

__all__ = ["scaled_dot_product_attention", "attention_path", "Backend", "Path"]

Backend = Literal["auto", "fused", "reference"]
Path = Literal["fused-cpu", "fused-metal", "reference"]

FLOAT_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
MAX_FUSED_CPU_HEAD_DIM = 256


def _shape(a: mx.array) -> str:
    return "(" + ", ".join(str(d) for d in a.shape) + ")"


def _result_dtype(q: mx.array, k: mx.array, v: mx.array) -> mx.Dtype:
    for name, a in (("q", q), ("k", k), ("v", v)):
        if not mx.issubdtype(a.dtype, mx.floating):
            raise ValueError(
                f"{name} has dtype {a.dtype}; attention needs float16, bfloat16 or float32 inputs"
            )
    dtype = mx.result_type(q.dtype, k.dtype, v.dtype)
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"unsupported input dtype {dtype}; use float16, bfloat16 or float32")
    return dtype


def _validate(q, k, v, scale, mask, sinks, window_size, backend):
    """Checks everything and returns the output dtype. Raises ValueError."""
    for name, a in (("q", q), ("k", k), ("v", v)):
        if not isinstance(a, mx.array):
            raise ValueError(f"{name} must be an mlx.core.array, got {type(a).__name__}")
        if a.ndim != 4:
            raise ValueError(
                f"{name} must have rank 4 [batch, heads, length, head_dim], got shape {_shape(a)}"
            )
    dtype = _result_dtype(q, k, v)
    if k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
        raise ValueError(
            f"batch sizes differ: q {_shape(q)}, k {_shape(k)}, v {_shape(v)}"
        )
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v need the same number of heads: k {_shape(k)}, v {_shape(v)}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v need the same length: k {_shape(k)}, v {_shape(v)}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(
            f"q and k need the same head dim: q {_shape(q)}, k {_shape(k)}"
        )
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"the number of query heads ({q.shape[1]}) must be a multiple of the "
            f"number of key/value heads ({k.shape[1]})"
        )
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number, got {scale!r}")

    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"mask must be None, 'causal' or an array, got the string {mask!r}")
    elif mask is not None:
        if not isinstance(mask, mx.array):
            raise ValueError(f"mask must be None, 'causal' or an mlx array, got {type(mask).__name__}")
        if mask.ndim > 4:
            raise ValueError(f"mask must have at most 4 dims, got shape {_shape(mask)}")
        target = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        for got, want in zip(reversed(mask.shape), reversed(target)):
            if got not in (1, want):
                raise ValueError(
                    f"mask of shape {_shape(mask)} does not broadcast to "
                    f"[batch, q_heads, q_len, kv_len] = {list(target)}"
                )
        if mask.dtype != mx.bool_:
            if not mx.issubdtype(mask.dtype, mx.floating):
                raise ValueError(
                    f"mask must be boolean (True = attend) or an additive float mask, got {mask.dtype}"
                )
            if mx.result_type(mask.dtype, dtype) != dtype:
                raise ValueError(
                    f"additive mask dtype {mask.dtype} must promote to the output dtype {dtype}"
                )

    if sinks is not None:
        if not isinstance(sinks, mx.array):
            raise ValueError(f"sinks must be an mlx array, got {type(sinks).__name__}")
        if sinks.ndim != 1 or sinks.shape[0] != q.shape[1]:
            raise ValueError(
                f"sinks must have shape [q_heads] = [{q.shape[1]}], got {_shape(sinks)}"
            )
        if not mx.issubdtype(sinks.dtype, mx.floating):
            raise ValueError(f"sinks must be floating point, got {sinks.dtype}")
        if mx.result_type(sinks.dtype, dtype) != dtype:
            raise ValueError(f"sinks dtype {sinks.dtype} must promote to the output dtype {dtype}")

    if window_size is not None:
        if isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 1:
            raise ValueError(f"window_size must be a positive integer or None, got {window_size!r}")
    if backend not in ("auto", "fused", "reference"):
        raise ValueError(f"backend must be 'auto', 'fused' or 'reference', got {backend!r}")
    return dtype


def _device_type(stream) -> mx.DeviceType:
    if stream is None:
        return mx.default_device().type
    if isinstance(stream, mx.Stream):
        return stream.device.type
    if isinstance(stream, mx.Device):
        return stream.type
    if isinstance(stream, mx.DeviceType):  # mx.cpu / mx.gpu
        return stream
    raise ValueError(f"stream must be an mlx Stream, Device, mx.cpu/mx.gpu or None, got {type(stream).__name__}")


def _fused_unsupported_reason(q, k, v, mask, sinks, window_size, stream) -> str | None:
    """None when the fused kernel handles this problem, else why not."""
    if _ext is None:
        return f"the native extension mlx_attn._ext is not available ({_EXT_ERROR})"
    device = _device_type(stream)
    if device == mx.gpu:
        from mlx_attn import metal_support

        return metal_support.unsupported_reason(q, k, v, mask, sinks, window_size)
    d, dv = q.shape[3], v.shape[3]
    if not (1 <= d <= MAX_FUSED_CPU_HEAD_DIM and 1 <= dv <= MAX_FUSED_CPU_HEAD_DIM):
        return f"the fused CPU kernel supports head dims 1..{MAX_FUSED_CPU_HEAD_DIM}, got D={d}, Dv={dv}"
    return None


def attention_path(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float = 1.0,
    mask=None,
    sinks=None,
    window_size: int | None = None,
    backend: Backend = "auto",
    stream=None,
) -> Path:
    """Which implementation ``scaled_dot_product_attention`` uses for these
    arguments: ``"fused-cpu"``, ``"fused-metal"`` or ``"reference"``."""
    _validate(q, k, v, scale, mask, sinks, window_size, backend)
    return _choose_path(q, k, v, mask, sinks, window_size, backend, stream)


def _choose_path(q, k, v, mask, sinks, window_size, backend, stream) -> Path:
    if backend == "reference":
        return "reference"
    reason = _fused_unsupported_reason(q, k, v, mask, sinks, window_size, stream)
    if reason is None:
        return "fused-metal" if _device_type(stream) == mx.gpu else "fused-cpu"
    if backend == "fused":
        raise ValueError(f"backend='fused' is not possible here: {reason}")
    return "reference"


@functools.lru_cache(maxsize=256)
def _differentiable_fused(scale, causal, window_size, has_mask, has_sinks, stream):
    """The fused primitive wrapped so that gradients flow: the forward pass is
    fused, the backward pass differentiates the reference path."""
    mask_mode = "causal" if causal else None

    def split(extras):
        extras = list(extras)
        mask = extras.pop(0) if has_mask else mask_mode
        sinks = extras.pop(0) if has_sinks else None
        return mask, sinks

    @mx.custom_function
    def fused(q, k, v, *extras):
        mask, sinks = split(extras)
        return _ext.fused_attention(
            q,
            k,
            v,
            scale=scale,
            causal=causal,
            window_size=window_size or 0,
            mask=mask if has_mask else None,
            sinks=sinks,
            stream=stream,
        )[0]

    @fused.vjp
    def fused_vjp(primals, cotangent, output):
        def reference(q, k, v, *extras):
            mask, sinks = split(extras)
            return reference_attention(
                q, k, v, scale=scale, mask=mask, sinks=sinks, window_size=window_size, stream=stream
            )

        _, grads = mx.vjp(reference, list(primals), [cotangent])
        return tuple(
            g if p.dtype != mx.bool_ else mx.zeros_like(p) for g, p in zip(grads, primals)
        )

    return fused


def scaled_dot_product_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    mask: mx.array | str | None = None,
    sinks: mx.array | None = None,
    stream: mx.Stream | mx.Device | None = None,
    window_size: int | None = None,
    backend: Backend = "auto",
) -> mx.array:
    """Scaled dot-product attention, a drop-in for ``mx.fast.scaled_dot_product_attention``.

    Args:
        q: queries ``[B, Hq, Tq, D]``.
        k: keys ``[B, Hkv, Tkv, D]`` with ``Hq % Hkv == 0`` (GQA/MQA; never repeated).
        v: values ``[B, Hkv, Tkv, Dv]``.
        scale: multiplies ``q @ k^T`` (usually ``1/sqrt(D)``).
        mask: ``None``, ``"causal"`` (lower-right aligned), a boolean array
            (True = attend) or an additive array, broadcastable to
            ``[B, Hq, Tq, Tkv]``. An additive mask's dtype must promote to
            the output dtype.
        sinks: optional ``[Hq]`` logits that join each head's softmax and
            contribute no value.
        stream: stream or device to run on.
        window_size: sliding-window attention: each query sees at most this
            many most recent keys (itself included); implies causal.
        backend: ``"auto"`` (fused when supported, else reference),
            ``"fused"`` (error if unsupported) or ``"reference"``. See
            :func:`attention_path`.

    Returns:
        ``[B, Hq, Tq, Dv]`` in the promoted input dtype. Softmax and
        accumulation run in float32. Rows that see no key are zeros.

    Raises:
        ValueError: naming the offending argument, shape or dtype.
    """
    dtype = _validate(q, k, v, scale, mask, sinks, window_size, backend)
    q, k, v = (a.astype(dtype) if a.dtype != dtype else a for a in (q, k, v))
    path = _choose_path(q, k, v, mask, sinks, window_size, backend, stream)
    if path == "reference":
        return reference_attention(
            q, k, v, scale=scale, mask=mask, sinks=sinks, window_size=window_size, stream=stream
        )

    b, hq, tq, _ = q.shape
    tkv = k.shape[2]
    if min(b, hq, tq, tkv, v.shape[3]) == 0:
        return mx.zeros((b, hq, tq, v.shape[3]), dtype=dtype)
    extras = []
    has_mask = isinstance(mask, mx.array)
    if has_mask:
        if mask.dtype != mx.bool_ and mask.dtype != dtype:
            mask = mask.astype(dtype)
        # A broadcast view: the kernel reads it through zero strides.
        extras.append(mx.broadcast_to(mask, (b, hq, tq, tkv), stream=stream))
    if sinks is not None:
        extras.append(sinks.astype(dtype) if sinks.dtype != dtype else sinks)
    fused = _differentiable_fused(
        float(scale), mask == "causal" if isinstance(mask, str) else False,
        window_size, has_mask, sinks is not None, stream,
    )
    return fused(q, k, v, *extras)
