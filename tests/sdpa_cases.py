"""Shared helpers for the scaled_dot_product_attention tests."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

import mlx_attn

# Max abs error allowed between the fused kernel and the reference path, per
# dtype, for outputs of magnitude ~1 (unit-normal inputs). float32: accumulation
# order only; float16/bfloat16: one or two rounding steps of the output
# (ulp(1) is 2^-10 resp. 2^-7).
TOLERANCE = {mx.float32: 2e-5, mx.float16: 4e-3, mx.bfloat16: 3e-2}
DTYPES = [mx.float32, mx.float16, mx.bfloat16]


def make_qkv(b, hq, hkv, tq, tkv, d, dv=None, dtype=mx.float32, seed=0):
    rng = np.random.default_rng(seed)
    dv = d if dv is None else dv
    q = mx.array(rng.standard_normal((b, hq, tq, d)).astype(np.float32)).astype(dtype)
    k = mx.array(rng.standard_normal((b, hkv, tkv, d)).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((b, hkv, tkv, dv)).astype(np.float32)).astype(dtype)
    return q, k, v


def fused(q, k, v, **kw):
    kw.setdefault("scale", q.shape[-1] ** -0.5)
    assert mlx_attn.attention_path(q, k, v, **{x: y for x, y in kw.items() if x != "stream"}) == "fused-cpu"
    out = mlx_attn.scaled_dot_product_attention(q, k, v, backend="fused", **kw)
    mx.eval(out)
    return out


def reference(q, k, v, **kw):
    kw.setdefault("scale", q.shape[-1] ** -0.5)
    out = mlx_attn.scaled_dot_product_attention(q, k, v, backend="reference", **kw)
    mx.eval(out)
    return out


def max_abs_diff(a, b) -> float:
    a = np.array(a.astype(mx.float32))
    b = np.array(b.astype(mx.float32))
    assert a.shape == b.shape
    assert np.isfinite(a).all() and np.isfinite(b).all()
    return float(np.abs(a - b).max()) if a.size else 0.0


def assert_close(out, ref, dtype):
    err = max_abs_diff(out, ref)
    assert err <= TOLERANCE[dtype], f"max abs error {err} > {TOLERANCE[dtype]} for {dtype}"


def exact_qkv(b, hq, hkv, tq, tkv, d, dtype=mx.float32, seed=0):
    """q, k, v of multiples of 1/64 in [-1/16, 1/16]: every product and sum of
    q.k is exact in float32 (and float16), and |q.k| <= d / 256."""
    rng = np.random.default_rng(seed)
    return tuple(
        mx.array(rng.integers(-4, 5, shape).astype(np.float32) / 64).astype(dtype)
        for shape in ((b, hq, tq, d), (b, hkv, tkv, d), (b, hkv, tkv, d))
    )


def as_float64(x) -> np.ndarray:
    if isinstance(x, mx.array):
        return np.array(x.astype(mx.float32)).astype(np.float64)
    return np.asarray(x, np.float64)


def numpy_attention(q, k, v, *, scale, mask=None, sinks=None, window_size=None, return_lse=False, softcap=None):
    """Attention in float64 NumPy, straight from the definition (no shared
    code with mlx_attn): softmax over keys of scale * q.k (capped to
    softcap * tanh(. / softcap) with a softcap, then + additive mask), sinks
    as extra logits with no value, rows that see no key give zeros.
    With ``return_lse`` also the log of each row's softmax denominator
    (``-inf`` where it is empty). q, k, v, sinks: MLX or NumPy arrays."""
    q64, k64, v64 = (as_float64(x) for x in (q, k, v))
    b, hq, tq, _ = q64.shape
    hkv, tkv = k64.shape[1], k64.shape[2]
    group = hq // hkv
    k64 = np.repeat(k64, group, axis=1)
    v64 = np.repeat(v64, group, axis=1)
    logits = scale * np.einsum("bhqd,bhkd->bhqk", q64, k64)
    if softcap is not None:
        logits = softcap * np.tanh(logits / softcap)
    visible = np.ones((b, hq, tq, tkv), bool)
    if isinstance(mask, str) or window_size is not None:
        pos = np.arange(tq)[:, None] + tkv - tq
        keys = np.arange(tkv)[None, :]
        causal = keys <= pos
        if window_size is not None:
            causal &= keys > pos - window_size
        visible &= causal
    elif mask is not None:
        m = np.broadcast_to(np.array(mask.astype(mx.float32) if mask.dtype != mx.bool_ else mask), visible.shape)
        if mask.dtype == mx.bool_:
            visible &= m
        else:
            visible &= m != -np.inf
            logits = logits + np.where(m == -np.inf, 0.0, m)
    logits = np.where(visible, logits, -np.inf)
    row_max = logits.max(axis=-1, keepdims=True, initial=-np.inf)
    if sinks is not None:
        s = as_float64(sinks).reshape(1, hq, 1, 1)
        row_max = np.maximum(row_max, s)
    shift = np.where(np.isfinite(row_max), row_max, 0.0)
    weights = np.exp(logits - shift)
    total = weights.sum(axis=-1, keepdims=True)
    if sinks is not None:
        total = total + np.exp(s - shift)
    seen = visible.any(axis=-1, keepdims=True)
    out = np.einsum("bhqk,bhkd->bhqd", weights / np.where(total > 0, total, 1.0), v64)
    out = np.where(seen, out, 0.0)
    if not return_lse:
        return out
    with np.errstate(divide="ignore"):
        lse = np.where(total > 0, np.log(total) + shift, -np.inf)[..., 0]
    return out, lse


FINITE_DIFFERENCE_STEP = 1e-6


def finite_difference_gradient(f, arrays, index, step=FINITE_DIFFERENCE_STEP):
    """d f(*arrays) / d arrays[index] by central differences, element by
    element (float64 arrays; f returns a Python float)."""
    x = arrays[index]
    grad = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        plus, minus = [a.copy() for a in arrays], [a.copy() for a in arrays]
        plus[index][i] += step
        minus[index][i] -= step
        grad[i] = (f(*plus) - f(*minus)) / (2 * step)
    return grad
