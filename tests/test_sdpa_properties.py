"""Property-based tests and the invariants of attention, on the fused path."""

import mlx.core as mx
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from sdpa_cases import DTYPES, TOLERANCE, assert_close, fused, make_qkv, reference


@st.composite
def problems(draw):
    kv_heads = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 3, 4]))
    tq = draw(st.integers(1, 80))
    tkv = draw(st.integers(1, 150))
    d = draw(st.sampled_from([1, 2, 5, 8, 16, 24, 33, 64, 96]))
    dv = draw(st.sampled_from([d, 7, 40]))
    batch = draw(st.integers(1, 2))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**16))
    q, k, v = make_qkv(batch, kv_heads * group, kv_heads, tq, tkv, d, dv, dtype=dtype, seed=seed)
    kind = draw(st.sampled_from(["none", "causal", "bool", "additive", "window"]))
    kw = {}
    rng = np.random.default_rng(seed)
    if kind == "causal":
        kw["mask"] = "causal"
    elif kind in ("bool", "additive"):
        dims = [batch, kv_heads * group, tq, tkv]
        shape = tuple(n if draw(st.booleans()) else 1 for n in dims)
        shape = shape[draw(st.integers(0, 3)) :]  # fewer leading dims broadcast too
        if kind == "bool":
            kw["mask"] = mx.array(rng.random(shape) > draw(st.floats(0.0, 0.9)))
        else:
            kw["mask"] = mx.array(rng.standard_normal(shape).astype(np.float32) * 4).astype(dtype)
    elif kind == "window":
        kw["window_size"] = draw(st.integers(1, 100))
    if draw(st.booleans()):
        kw["sinks"] = mx.array(rng.standard_normal(kv_heads * group).astype(np.float32)).astype(dtype)
    kw["scale"] = draw(st.sampled_from([d**-0.5, 1.0, 0.05]))
    return q, k, v, kw


@given(problems())
def test_fused_matches_reference(problem):
    q, k, v, kw = problem
    assert_close(fused(q, k, v, **kw), reference(q, k, v, **kw), q.dtype)


@given(problems())
def test_weights_sum_to_one(problem):
    """With every value equal to c, the output is c wherever a row sees a key:
    the fused weights sum to 1 (rows that see nothing are 0)."""
    q, k, v, kw = problem
    kw.pop("sinks", None)  # a sink takes weight away on purpose
    c = 0.75
    v_const = mx.full(v.shape, c, dtype=v.dtype)
    out = np.array(fused(q, k, v_const, **kw).astype(mx.float32))
    ones = np.array(reference(q, k, mx.ones(v.shape, dtype=v.dtype), **kw).astype(mx.float32))
    sees_any = ones[..., :1] > 0.5
    np.testing.assert_allclose(out, np.where(sees_any, c, 0.0) * np.ones_like(out), atol=TOLERANCE[q.dtype])


@given(st.integers(1, 100), st.integers(0, 99), st.sampled_from(DTYPES), st.booleans())
def test_causal_never_depends_on_later_positions(t, cut, dtype, windowed):
    cut = cut % t
    q, k, v = make_qkv(1, 4, 2, t, t, 16, dtype=dtype, seed=t)
    kw = {"window_size": 5} if windowed else {"mask": "causal"}
    before = np.array(fused(q, k, v, **kw).astype(mx.float32))
    # change every key, value and query after position `cut`
    noise = make_qkv(1, 4, 2, t, t, 16, dtype=dtype, seed=t + 1000)
    keep = (mx.arange(t) <= cut)[None, None, :, None]
    q2, k2, v2 = (mx.where(keep, a, b) for a, b in zip((q, k, v), noise))
    after = np.array(fused(q2, k2, v2, **kw).astype(mx.float32))
    np.testing.assert_array_equal(before[:, :, : cut + 1], after[:, :, : cut + 1])
    if cut + 1 < t:
        assert not np.array_equal(before[:, :, cut + 1 :], after[:, :, cut + 1 :])


def test_batch_elements_are_independent():
    q, k, v = make_qkv(3, 4, 2, 37, 91, 32)
    mask = mx.array(np.random.default_rng(0).random((3, 1, 37, 91)) > 0.3)
    together = np.array(fused(q, k, v, mask=mask))
    for b in range(3):
        alone = np.array(fused(q[b : b + 1], k[b : b + 1], v[b : b + 1], mask=mask[b : b + 1]))
        np.testing.assert_array_equal(together[b : b + 1], alone)


def test_deterministic():
    q, k, v = make_qkv(2, 8, 2, 200, 333, 64)
    first = np.array(fused(q, k, v, mask="causal"))
    for _ in range(3):
        np.testing.assert_array_equal(first, np.array(fused(q, k, v, mask="causal")))


def test_permuting_keys_with_values_changes_nothing():
    q, k, v = make_qkv(1, 2, 2, 20, 90, 16)
    perm = mx.array(np.random.default_rng(0).permutation(90))
    assert_close(fused(q, k[:, :, perm], v[:, :, perm]), fused(q, k, v), mx.float32)
