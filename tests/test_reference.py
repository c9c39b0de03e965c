"""The reference path against an independent float64 NumPy implementation and
against mx.fast.scaled_dot_product_attention (the contract it mirrors)."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_attn.reference import causal_visibility, reference_attention
from sdpa_cases import make_qkv


def numpy_attention(q, k, v, scale, visible=None, additive=None, sinks=None):
    """Textbook attention in float64, with GQA by explicit head mapping."""
    q, k, v = (np.array(a.astype(mx.float32), dtype=np.float64) for a in (q, k, v))
    b, hq, tq, _ = q.shape
    hkv = k.shape[1]
    out = np.zeros((b, hq, tq, v.shape[-1]))
    for bi in range(b):
        for h in range(hq):
            kvh = h // (hq // hkv)
            s = q[bi, h] @ k[bi, kvh].T * scale
            if additive is not None:
                s = s + np.broadcast_to(additive, (b, hq) + s.shape)[bi, h]
            if visible is not None:
                s = np.where(np.broadcast_to(visible, (b, hq) + s.shape)[bi, h], s, -np.inf)
            extra = [] if sinks is None else [sinks[h]]
            for i in range(tq):
                row = np.concatenate([s[i], extra])
                if np.all(row == -np.inf):
                    continue  # nothing visible: zeros
                w = np.exp(row - row.max())
                w = w / w.sum()
                out[bi, h, i] = w[: s.shape[1]] @ v[bi, kvh]
    return out


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("mask_kind", [None, "causal", "bool", "additive", "window"])
def test_reference_matches_numpy(hq, hkv, mask_kind):
    q, k, v = make_qkv(2, hq, hkv, 5, 9, 8, 6, seed=hq * 10 + hkv)
    rng = np.random.default_rng(1)
    kw, visible, additive = {}, None, None
    if mask_kind == "causal":
        kw["mask"] = "causal"
        visible = np.array(causal_visibility(5, 9))
        # independent check of lower-right alignment: last query sees all keys
        assert visible[-1].all() and visible[0].sum() == 5
    elif mask_kind == "bool":
        visible = rng.random((2, 1, 5, 9)) > 0.3
        visible[0, 0, 2] = False  # a fully masked row
        kw["mask"] = mx.array(visible)
    elif mask_kind == "additive":
        additive = rng.standard_normal((5, 9)).astype(np.float32)
        additive[1, :4] = -np.inf
        kw["mask"] = mx.array(additive)
    elif mask_kind == "window":
        kw["window_size"] = 3
        pos = np.arange(5)[:, None] + 4
        key = np.arange(9)[None, :]
        visible = (key <= pos) & (key > pos - 3)
    out = reference_attention(q, k, v, scale=0.4, **kw)
    expected = numpy_attention(q, k, v, 0.4, visible=visible, additive=additive)
    np.testing.assert_allclose(np.array(out), expected, atol=1e-5)


def test_reference_sinks_match_numpy():
    q, k, v = make_qkv(1, 4, 2, 3, 7, 8)
    sinks = np.array([0.5, -1.0, 2.0, 0.0], dtype=np.float32)
    out = reference_attention(q, k, v, scale=0.3, sinks=mx.array(sinks), mask="causal")
    visible = np.array(causal_visibility(3, 7))
    expected = numpy_attention(q, k, v, 0.3, visible=visible, sinks=sinks)
    np.testing.assert_allclose(np.array(out), expected, atol=1e-5)


@pytest.mark.parametrize("mask_kind", [None, "causal", "bool", "additive"])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
def test_reference_matches_mlx_fast(mask_kind, hq, hkv):
    """Same semantics as mx.fast.scaled_dot_product_attention wherever every
    row sees at least one key (MLX averages fully masked rows; we return 0)."""
    q, k, v = make_qkv(2, hq, hkv, 6, 11, 16)
    rng = np.random.default_rng(2)
    mask = mask_kind
    if mask_kind == "bool":
        m = rng.random((1, hq, 6, 11)) > 0.5
        m[..., 0] = True
        mask = mx.array(m)
    elif mask_kind == "additive":
        mask = mx.array(rng.standard_normal((6, 11)).astype(np.float32))
    ours = reference_attention(q, k, v, scale=0.25, mask=mask)
    theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    np.testing.assert_allclose(np.array(ours), np.array(theirs), atol=2e-5)


def test_reference_weights_sum_to_one_and_match_output():
    q, k, v = make_qkv(1, 4, 2, 5, 8, 8)
    out, w = reference_attention(q, k, v, scale=0.5, mask="causal", return_weights=True)
    assert w.shape == (1, 4, 5, 8)
    np.testing.assert_allclose(np.array(w.sum(-1)), 1.0, atol=1e-6)
    assert np.all(np.array(w)[0, :, 0, 5:] == 0)  # causal: first query sees keys 0..3
    group = np.repeat(np.array(v), 2, axis=1)
    np.testing.assert_allclose(np.array(out), np.array(w) @ group, atol=1e-5)


def test_reference_dropout_zeroes_and_rescales():
    q, k, v = make_qkv(1, 2, 2, 64, 64, 8)
    _, w = reference_attention(q, k, v, scale=0.5, return_weights=True)
    _, wd = reference_attention(
        q, k, v, scale=0.5, return_weights=True, dropout_p=0.25, dropout_key=mx.random.key(3)
    )
    w, wd = np.array(w), np.array(wd)
    dropped = wd == 0
    assert 0.15 < dropped.mean() < 0.35
    np.testing.assert_allclose(wd[~dropped], w[~dropped] / 0.75, rtol=1e-5)
    with pytest.raises(ValueError, match="dropout_p"):
        reference_attention(q, k, v, scale=0.5, dropout_p=1.0)
