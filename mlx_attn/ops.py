"""``mlx_attn.scaled_dot_product_attention``: validation and dispatch.

The contract is exactly that of ``mx.fast.scaled_dot_product_attention``
(MLX 0.32), plus keyword-only extensions (``window_size``, ``backend``,
``return_lse``). One documented difference: a query row that can see no key
at all (fully masked) returns zeros, where MLX returns an average of the
values.

Paths, in order of preference: the fused kernel of the stream's device
(``"fused-cpu"``; ``"fused-metal"`` once its variant passed the first-use
self-check, :mod:`mlx_attn.self_check`); on the GPU, ``"mlx-fast"`` for the
problems ``mx.fast`` computes under this contract; else ``"reference"``.
Gradients of the fused primitive come from its fused backward (on the GPU,
once the Metal backward's variant passed its self-check: the gate registered
below), else from the reference path's autodiff.
"""

from __future__ import annotations

from typing import Literal

import mlx.core as mx
import numpy as np

from mlx_attn import _native, self_check
from mlx_attn.reference import reference_attention

__all__ = [
    "scaled_dot_product_attention", "attention_path", "metal_kernel_runner", "metal_backward_runner", "Backend", "Path",
]

Backend = Literal["auto", "fused", "reference"]
Path = Literal["fused-cpu", "fused-metal", "mlx-fast", "reference"]

FLOAT_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
FLOAT32_MAX = float(np.finfo(np.float32).max)
# Windows beyond any position are plain causal attention; the kernels take int32.
_WINDOW_LIMIT = 2**31 - 1

_ext = _native.ext  # kept for callers that probe mlx_attn.ops._ext


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


def _as_scale(scale) -> float:
    """What mx.fast accepts as a scale (Python/NumPy real scalars, 0-d NumPy
    arrays, size-1 MLX arrays), as a float finite in float32."""
    if isinstance(scale, mx.array):
        if scale.size != 1 or mx.issubdtype(scale.dtype, mx.complexfloating):
            raise ValueError(f"scale must be a real number or a size-1 array, got an array of shape {_shape(scale)} and dtype {scale.dtype}")
        value = scale.item()
    elif isinstance(scale, np.ndarray):
        if scale.ndim != 0 or not np.isrealobj(scale) or scale.dtype.kind not in "biuf":
            raise ValueError(f"scale must be a real number or a 0-d array, got a NumPy array of shape {scale.shape} and dtype {scale.dtype}")
        value = scale.item()
    elif isinstance(scale, (int, float, np.integer, np.floating, np.bool_)):
        value = scale
    else:
        raise ValueError(f"scale must be a real number, got {type(scale).__name__}")
    value = float(value)
    if not abs(value) <= FLOAT32_MAX:
        raise ValueError(f"scale must be finite in float32 (|scale| <= {FLOAT32_MAX:.8g}), got {value!r}")
    return value


def _validate(q, k, v, scale, mask, sinks, window_size, backend, stream, return_lse=False):
    """Checks everything; returns the output dtype and the scale as a float.
    Raises ValueError naming the argument."""
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
    scale = _as_scale(scale)

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
        if isinstance(window_size, (bool, np.bool_)) or not isinstance(window_size, (int, np.integer)) or window_size < 1:
            raise ValueError(f"window_size must be a positive integer or None, got {window_size!r}")
    if not isinstance(backend, str) or backend not in ("auto", "fused", "reference"):
        raise ValueError(f"backend must be 'auto', 'fused' or 'reference', got {backend!r}")
    if not isinstance(return_lse, (bool, np.bool_)):
        raise ValueError(f"return_lse must be True or False, got {return_lse!r}")
    _device_type(stream)  # raises for a stream of the wrong type
    return dtype, scale


def _prepare(q, k, v, scale, mask, sinks, window_size, backend, stream, return_lse=False):
    """Validates the call; returns q, k, v in the output dtype, the scale as a
    float and the window size as an int (or None)."""
    dtype, scale = _validate(q, k, v, scale, mask, sinks, window_size, backend, stream, return_lse)
    q, k, v = (a.astype(dtype) if a.dtype != dtype else a for a in (q, k, v))
    if window_size is not None:
        window_size = min(int(window_size), _WINDOW_LIMIT)
    return q, k, v, scale, window_size


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


def _kernel_inputs(mask, sinks, dtype):
    """The mask and sinks as the fused kernels take them: an additive mask and
    sinks in the output dtype; the mask in its own (broadcastable) shape."""
    if isinstance(mask, mx.array) and mask.dtype != mx.bool_ and mask.dtype != dtype:
        mask = mask.astype(dtype)
    if sinks is not None and sinks.dtype != dtype:
        sinks = sinks.astype(dtype)
    return (mask if isinstance(mask, mx.array) else None), sinks


def _describe(q, k, v, scale, mask, sinks, window_size, return_lse=False):
    """The C++ problem description of a validated call."""
    array_mask, sinks = _kernel_inputs(mask, sinks, q.dtype)
    return _native.ext.describe_attention(
        q, k, v, scale=scale, causal=isinstance(mask, str), window_size=window_size or 0,
        mask=array_mask, sinks=sinks, output_lse=return_lse,
    )


def _fused_unsupported_reason(q, k, v, scale, mask, sinks, window_size, stream, return_lse=False) -> str | None:
    """None when the fused kernel handles this problem, else why not (the
    support rules live in C++: the CPU kernel's and the Metal launch plan's;
    on the GPU also the first-use self-check of the kernel variant)."""
    if _native.ext is None:
        _native.warn_if_missing()
        return _native.MISSING_REASON
    problem = _describe(q, k, v, scale, mask, sinks, window_size, return_lse)
    device = _device_type(stream)
    reason = _native.ext.unsupported_reason(problem, device=device)
    if reason is None and device == mx.gpu:
        variant = metal_variant(problem)
        if not self_check.trusted(variant, metal_kernel_runner(stream)):
            reason = f"the Metal kernel variant {variant} failed its self-check on this GPU (see the warning)"
    return reason


def metal_variant(problem) -> self_check.Variant:
    """The kernel variant the Metal launch plan uses for a problem: what a
    self-check vouches for (prefill or decode, dtype, head dim)."""
    first_kernel = _native.ext.metal_launch_plan(problem)["dispatches"][0]["kernel"]
    phase = "decode" if "decode" in first_kernel else "prefill"
    return self_check.Variant(phase, problem.dtype, problem.head_dim)


def _run_fused(q, k, v, scale, mask, sinks, window_size, stream, return_lse=False) -> list[mx.array]:
    """The fused primitive on validated inputs: ``[out]`` or ``[out, lse]``."""
    array_mask, sinks = _kernel_inputs(mask, sinks, q.dtype)
    return _native.ext.fused_attention(
        q, k, v, scale=scale, causal=isinstance(mask, str), window_size=window_size or 0,
        mask=array_mask, sinks=sinks, output_lse=return_lse, stream=stream,
    )


def metal_kernel_runner(stream=None):
    """``run(q, k, v, *, scale, mask=None, sinks=None, window_size=None)``:
    the fused Metal kernels themselves on ``stream`` (default: the GPU),
    evaluated, bypassing the self-check. What the self-check and
    ``mlx-attn doctor`` test."""
    stream = mx.gpu if stream is None else stream

    def run(q, k, v, *, scale, mask=None, sinks=None, window_size=None):
        q, k, v, scale, window_size = _prepare(q, k, v, scale, mask, sinks, window_size, "fused", stream)
        out = _run_fused(q, k, v, scale, mask, sinks, window_size, stream)[0]
        mx.eval(out)
        return out

    return run


def metal_backward_variant(problem) -> self_check.BackwardVariant:
    """The Metal backward variant of a problem: what its self-check vouches for."""
    return self_check.BackwardVariant(problem.dtype, problem.head_dim, problem.value_dim)


def metal_backward_runner(stream=None):
    """``run(q, k, v, d_out, *, scale, mask=None, sinks=None, window_size=None)
    -> [dq, dk, dv(, d_sinks)]``: the fused forward and the Metal backward on
    ``stream`` (default: the GPU), evaluated, bypassing the self-check. What
    the backward self-check and ``mlx-attn doctor`` test."""
    stream = mx.gpu if stream is None else stream

    def run(q, k, v, d_out, *, scale, mask=None, sinks=None, window_size=None):
        q, k, v, scale, window_size = _prepare(q, k, v, scale, mask, sinks, window_size, "fused", stream)

        def attend(q, k, v, *maybe_sinks):
            return _run_fused(q, k, v, scale, mask, maybe_sinks[0] if maybe_sinks else None, window_size, stream)[0]

        primals = [q, k, v] + ([sinks] if sinks is not None else [])
        with self_check.unchecked():  # the vjp asks the gate: these calls run the kernels under test
            _, grads = mx.vjp(attend, primals, [d_out])
            mx.eval(grads)
        return grads

    return run


def _metal_backward_trusted(problem) -> bool:
    """The backward gate (``_ext.set_backward_gate``): FusedAttention's vjp
    asks it on the GPU only, while the graph of a gradient is built (inside
    ``mx.grad`` or ``mx.compile`` too). It sees the problem, never the
    caller's arrays: the check runs on arrays of its own."""
    return self_check.trusted(metal_backward_variant(problem), metal_backward_runner())


def _mlx_fast_computes(q, k, mask, window_size, return_lse) -> bool:
    """Problems ``mx.fast`` computes under this package's contract: no window
    or log-sum-exp (it has neither) and no row that can see no key (it does
    not return zeros for those; an array mask may hide every key of a row)."""
    if window_size is not None or return_lse:
        return False
    return mask is None or (isinstance(mask, str) and q.shape[2] <= k.shape[2])


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
    return_lse: bool = False,
) -> Path:
    """Which implementation ``scaled_dot_product_attention`` uses for these
    arguments: ``"fused-cpu"``, ``"fused-metal"``, ``"mlx-fast"`` (GPU only)
    or ``"reference"``."""
    q, k, v, scale, window_size = _prepare(q, k, v, scale, mask, sinks, window_size, backend, stream, return_lse)
    return _choose_path(q, k, v, scale, mask, sinks, window_size, backend, stream, return_lse)


def _choose_path(q, k, v, scale, mask, sinks, window_size, backend, stream, return_lse=False) -> Path:
    if backend == "reference":
        return "reference"
    reason = _fused_unsupported_reason(q, k, v, scale, mask, sinks, window_size, stream, return_lse)
    on_gpu = _device_type(stream) == mx.gpu
    if reason is None:
        return "fused-metal" if on_gpu else "fused-cpu"
    if backend == "fused":
        raise ValueError(f"backend='fused' is not possible here: {reason}")
    if on_gpu and _mlx_fast_computes(q, k, mask, window_size, return_lse):
        return "mlx-fast"
    return "reference"


def _reference_derivative(mode, primals, vectors, argnums, options, stream):
    """The fused primitive's vjp / jvp (registered with _ext): those of the
    reference path on the same inputs and stream, for every output (the
    log-sum-exp too when the call returns it). Bool masks are constants."""
    # causal is a window of every earlier key: one route for both
    window_size = options.window_size or (_WINDOW_LIMIT if options.causal else None)

    def attend(arrays):
        q, k, v, *extras = arrays
        mask = extras.pop(0) if options.has_mask else None
        sinks = extras.pop(0) if options.has_sinks else None
        outputs = reference_attention(
            q, k, v, scale=options.scale, mask=mask, sinks=sinks, window_size=window_size, stream=stream,
            return_lse=options.output_lse,
        )
        return list(outputs) if options.output_lse else [outputs]

    argnums = list(argnums)
    active = [i for i in argnums if primals[i].dtype != mx.bool_]

    def of_active(*chosen):
        arrays = list(primals)
        for i, a in zip(active, chosen):
            arrays[i] = a
        return attend(arrays)

    chosen = [primals[i] for i in active]
    if mode == "vjp":
        _, grads = mx.vjp(of_active, chosen, list(vectors))
        by_index = dict(zip(active, grads))
        return [by_index.get(i, mx.zeros_like(primals[i])) for i in argnums]
    tangents = [t for i, t in zip(argnums, vectors) if primals[i].dtype != mx.bool_]
    if not chosen:
        return [mx.zeros_like(out) for out in attend(list(primals))]
    _, out_tangents = mx.jvp(of_active, chosen, tangents)
    return out_tangents


if _native.ext is not None:
    _native.ext.set_differentiation_rule(_reference_derivative)
    _native.ext.set_backward_gate(_metal_backward_trusted)


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
    return_lse: bool = False,
) -> mx.array | tuple[mx.array, mx.array]:
    """Scaled dot-product attention, a drop-in for ``mx.fast.scaled_dot_product_attention``.

    Args:
        q: queries ``[B, Hq, Tq, D]``.
        k: keys ``[B, Hkv, Tkv, D]`` with ``Hq % Hkv == 0`` (GQA/MQA; never repeated).
        v: values ``[B, Hkv, Tkv, Dv]``.
        scale: multiplies ``q @ k^T`` (usually ``1/sqrt(D)``): what mx.fast
            accepts (Python or NumPy real scalars, 0-d NumPy arrays, size-1
            MLX arrays), finite in float32. Logits saturate at +-2^125 (see
            :mod:`mlx_attn.reference`), so every such scale gives finite
            outputs for finite inputs.
        mask: ``None``, ``"causal"`` (lower-right aligned), a boolean array
            (True = attend) or an additive array, broadcastable to
            ``[B, Hq, Tq, Tkv]``. An additive mask's dtype must promote to
            the output dtype.
        sinks: optional ``[Hq]`` logits (any view, e.g. strided or
            broadcast) that join each head's softmax and contribute no value.
        stream: stream or device to run on.
        window_size: sliding-window attention: each query sees at most this
            many most recent keys (itself included); implies causal.
        backend: ``"auto"`` (the fused kernel when it supports the problem;
            on the GPU then ``mx.fast`` where it computes the same, else the
            reference path), ``"fused"`` (error if the fused kernel cannot
            run it) or ``"reference"``. See :func:`attention_path`.
        return_lse: also return the row log-sum-exp: float32 ``[B, Hq, Tq]``,
            the natural log of each row's softmax denominator (sinks
            included; ``-inf`` for a row that sees no key). Partial results
            over disjoint key sets merge exactly through it.

    Returns:
        ``[B, Hq, Tq, Dv]`` in the promoted input dtype (and the
        log-sum-exp with ``return_lse``). Softmax and accumulation run in
        float32. Rows that see no key are zeros.

    Raises:
        ValueError: naming the offending argument, shape or dtype.
    """
    q, k, v, scale, window_size = _prepare(q, k, v, scale, mask, sinks, window_size, backend, stream, return_lse)
    path = _choose_path(q, k, v, scale, mask, sinks, window_size, backend, stream, return_lse)
    if path == "reference":
        return reference_attention(
            q, k, v, scale=scale, mask=mask, sinks=sinks, window_size=window_size, stream=stream,
            return_lse=return_lse,
        )
    if path == "mlx-fast":
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks, stream=stream)
    outputs = _run_fused(q, k, v, scale, mask, sinks, window_size, stream, return_lse)
    return (outputs[0], outputs[1]) if return_lse else outputs[0]
