"""Gradients checked independently: central finite differences of a float64
NumPy attention (tests/sdpa_cases.py, no code shared with mlx_attn) against
mx.grad through mlx_attn.scaled_dot_product_attention, fused and reference,
for q, k, v and sinks on a tiny problem."""

import mlx.core as mx
import numpy as np
import pytest

import mlx_attn
from sdpa_cases import finite_difference_gradient, make_qkv, numpy_attention


@pytest.mark.parametrize("backend", ["fused", "reference"])
@pytest.mark.parametrize("mask", [None, "causal", "additive", "bool"], ids=str)
def test_gradients_match_finite_differences(backend, mask):
    q, k, v = make_qkv(1, 4, 2, 3, 4, 3, seed=5)
    sinks = mx.array([0.2, -0.4, 1.0, 0.0])
    rng = np.random.default_rng(7)
    weights = rng.standard_normal((1, 4, 3, 3))
    if mask == "additive":
        mask = mx.array(rng.standard_normal((3, 4)).astype(np.float32))
    elif mask == "bool":
        visible = rng.random((1, 4, 3, 4)) > 0.4
        visible[..., 0] = True
        mask = mx.array(visible)
    scale = 0.7

    def loss_mlx(q, k, v, sinks):
        out = mlx_attn.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks, backend=backend)
        return (out * mx.array(weights.astype(np.float32))).sum()

    def loss_numpy(q, k, v, sinks):
        return float((numpy_attention(q, k, v, scale=scale, mask=mask, sinks=sinks) * weights).sum())

    grads = mx.grad(loss_mlx, argnums=(0, 1, 2, 3))(q, k, v, sinks)
    arrays = [np.array(a).astype(np.float64) for a in (q, k, v, sinks)]
    for index, name in enumerate(("q", "k", "v", "sinks")):
        want = finite_difference_gradient(loss_numpy, arrays, index)
        got = np.array(grads[index])
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4, err_msg=f"d loss / d {name}")
