"""The scale contract: any scale finite in float32 (0, denormal, negative, up
to FLT_MAX) gives the float64 answer where that is representable, and finite
outputs always, on the fused CPU path and the reference path alike; scales
not finite in float32 raise ValueError naming `scale`. Logits saturate at
2^125 (mlx_attn/reference.py, metal/attention_params.h)."""

import mlx.core as mx
import numpy as np
import pytest

import mlx_attn
from sdpa_cases import exact_qkv, numpy_attention

FLT_MAX = float(np.finfo(np.float32).max)
SCALES = [0.0, 1e-45, 1e-40, 1e-30, -0.7, 0.7, 3.0, 1e4, -1e4, 1e30, 2.4e38, 3e38, FLT_MAX, -FLT_MAX]


def run(q, k, v, backend, **kw):
    out = mlx_attn.scaled_dot_product_attention(q, k, v, backend=backend, **kw)
    return np.array(out.astype(mx.float32))


@pytest.mark.parametrize("backend", ["fused", "reference"])
@pytest.mark.parametrize("mask", [None, "causal"])
@pytest.mark.parametrize("scale", SCALES, ids=repr)
def test_every_finite_scale_matches_float64(scale, mask, backend):
    """q.k is exact in float32 here (multiples of 1/64) and |q.k| < 1/8, so
    scale * q.k never reaches the saturation limit: float64 is the truth."""
    q, k, v = exact_qkv(1, 4, 2, 6, 9, 8)
    sinks = mx.array([0.0, -0.5, 0.25, 1.0])
    got = run(q, k, v, backend, scale=scale, mask=mask, sinks=sinks)
    want = numpy_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=str)
@pytest.mark.parametrize("scale", [FLT_MAX, -FLT_MAX, 1e38, 1e20], ids=repr)
def test_saturated_logits_stay_finite_and_paths_agree(scale, dtype):
    """Unit-normal inputs: scale * q.k overflows float32; logits saturate the
    same way on both paths, and no exponent overflows."""
    rng = np.random.default_rng(0)
    q, k, v = (mx.array(rng.standard_normal(s).astype(np.float32)).astype(dtype)
               for s in ((1, 4, 6, 8), (1, 2, 9, 8), (1, 2, 9, 8)))
    additive = mx.array(rng.standard_normal((6, 9)).astype(np.float32) * 3e37).astype(dtype)
    for kw in (dict(mask="causal"), dict(mask=additive), dict(sinks=mx.array([1e38, 0.0, -1e38, 3.0]).astype(dtype))):
        fused = run(q, k, v, "fused", scale=scale, **kw)
        reference = run(q, k, v, "reference", scale=scale, **kw)
        assert np.isfinite(fused).all() and np.isfinite(reference).all()
        np.testing.assert_allclose(fused, reference, atol={mx.float32: 2e-5, mx.float16: 4e-3, mx.bfloat16: 3e-2}[dtype])


@pytest.mark.parametrize("scale", [float("inf"), float("-inf"), float("nan"), 1e39, -3.5e38, np.float64(1e300)], ids=repr)
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_scales_not_finite_in_float32_are_rejected(scale, backend):
    q, k, v = exact_qkv(1, 2, 2, 3, 4, 8)
    with pytest.raises(ValueError, match="scale"):
        mlx_attn.scaled_dot_product_attention(q, k, v, scale=scale, backend=backend)
    with pytest.raises(ValueError, match="scale"):
        mlx_attn.attention_path(q, k, v, scale=scale)
