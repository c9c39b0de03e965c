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
