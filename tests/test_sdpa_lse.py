"""``return_lse=True``: the row log-sum-exp next to the output, on every path,
against float64 NumPy; partial results over disjoint key sets merge exactly
through it; gradients flow through both outputs."""

import mlx.core as mx
import numpy as np
import pytest

import mlx_attn
from sdpa_cases import DTYPES, TOLERANCE, make_qkv, numpy_attention

CASES = {
    "plain": dict(),
    "causal": dict(mask="causal"),
    "window": dict(mask="causal", window_size=5),
    "bool mask": "bool",
    "additive mask": "additive",
    "sinks": "sinks",
    "causal cross (rows that see nothing)": dict(mask="causal", tq=12, tkv=7),
}


def build(case, dtype, seed=0):
    spec = CASES[case]
    tq, tkv = 9, 13
    kwargs = {}
    if isinstance(spec, dict):
        kwargs = {k: v for k, v in spec.items() if k not in ("tq", "tkv")}
        tq, tkv = spec.get("tq", tq), spec.get("tkv", tkv)
    q, k, v = make_qkv(2, 6, 2, tq, tkv, 32, dtype=dtype, seed=seed)
    rng = np.random.default_rng(seed + 1)
    if spec == "bool":
        visible = rng.random((2, 1, tq, tkv)) < 0.6
        visible[0, 0, 3] = False  # a row that sees nothing: lse -inf, output 0
        kwargs["mask"] = mx.array(visible)
    elif spec == "additive":
        kwargs["mask"] = mx.array(rng.standard_normal((tq, tkv)).astype(np.float32)).astype(dtype)
    elif spec == "sinks":
        kwargs["sinks"] = mx.array(rng.standard_normal(6).astype(np.float32)).astype(dtype)
    return (q, k, v), kwargs


@pytest.mark.parametrize("backend", ["fused", "reference"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_lse_matches_float64_numpy(case, dtype, backend):
    (q, k, v), kwargs = build(case, dtype)
    scale = 32**-0.5
    out, lse = mlx_attn.scaled_dot_product_attention(
        q, k, v, scale=scale, backend=backend, return_lse=True, **kwargs
    )
    assert lse.dtype == mx.float32 and lse.shape == (2, 6, q.shape[2])
    want_out, want_lse = numpy_attention(q, k, v, scale=scale, return_lse=True, **kwargs)
    got_lse = np.array(lse)
    assert np.array_equal(np.isneginf(got_lse), np.isneginf(want_lse))
    finite = np.isfinite(want_lse)
    assert np.isfinite(got_lse[finite]).all()
    # the logits are computed from inputs in `dtype`: compare in float32 terms
    assert np.abs(got_lse[finite] - want_lse[finite]).max() < 1e-4
    assert np.abs(np.array(out.astype(mx.float32)) - want_out).max() <= TOLERANCE[dtype]
    plain = mlx_attn.scaled_dot_product_attention(q, k, v, scale=scale, backend=backend, **kwargs)
    assert np.array_equal(np.array(plain.astype(mx.float32)), np.array(out.astype(mx.float32)))


def test_partials_over_disjoint_keys_merge_exactly_through_the_lse():
    q, k, v = make_qkv(1, 4, 2, 16, 40, 64, seed=3)
    scale = 64**-0.5
    parts = [
        mlx_attn.scaled_dot_product_attention(q, k[:, :, s], v[:, :, s], scale=scale, return_lse=True)
        for s in (slice(0, 17), slice(17, 40))
    ]
    lse = mx.logaddexp(parts[0][1], parts[1][1])
    merged = sum(mx.exp(part_lse - lse)[..., None] * out for out, part_lse in parts)
    whole, whole_lse = mlx_attn.scaled_dot_product_attention(q, k, v, scale=scale, return_lse=True)
    assert np.abs(np.array(merged - whole)).max() < 1e-5
    assert np.abs(np.array(lse - whole_lse)).max() < 1e-5


def test_gradients_flow_through_both_outputs():
    q, k, v = make_qkv(1, 4, 2, 6, 10, 16, seed=4)
    weights = mx.array(np.random.default_rng(5).standard_normal((1, 4, 6)).astype(np.float32))

    def loss(backend):
        def f(q, k, v):
            out, lse = mlx_attn.scaled_dot_product_attention(
                q, k, v, scale=0.25, mask="causal", backend=backend, return_lse=True
            )
            return (out * out).sum() + (weights * lse).sum()

        return mx.grad(f, argnums=(0, 1, 2))(q, k, v)

    fused, reference = loss("fused"), loss("reference")
    for got, want in zip(fused, reference):
        assert np.abs(np.array(got - want)).max() < 1e-5

    # and against central finite differences of the loss in float64 terms
    def value(qq):
        out, lse = mlx_attn.scaled_dot_product_attention(qq, k, v, scale=0.25, mask="causal", return_lse=True)
        return float(((out * out).sum() + (weights * lse).sum()).item())

    base = np.array(q)
    eps = 1e-2
    for index in [(0, 0, 0, 0), (0, 3, 5, 7), (0, 1, 2, 15)]:
        bumped = [base.copy(), base.copy()]
        bumped[0][index] += eps
        bumped[1][index] -= eps
        numeric = (value(mx.array(bumped[0])) - value(mx.array(bumped[1]))) / (2 * eps)
        assert abs(numeric - float(fused[0][index].item())) < 2e-2 * max(1.0, abs(numeric))


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_return_lse_must_be_a_bool(bad):
    q, k, v = make_qkv(1, 2, 2, 3, 3, 8)
    with pytest.raises(ValueError, match="return_lse"):
        mlx_attn.scaled_dot_product_attention(q, k, v, scale=1.0, return_lse=bad)
