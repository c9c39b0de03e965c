"""Hostile input for scaled_dot_product_attention and attention_path: every
argument of a wrong type or value raises ValueError naming it, or the call
returns numbers; nothing crashes or hangs.

Documented behaviour for non-finite data (same on the fused CPU path and the
reference path): logits saturate at +-2^125, so +inf in an additive mask or in
sinks acts as the largest logit; an additive mask value of -inf masks the key;
NaN in a mask row or in a head's sink gives NaN in that row / head only."""

import mlx.core as mx
import numpy as np
import pytest

import mlx_attn
from sdpa_cases import make_qkv

sdpa = mlx_attn.scaled_dot_product_attention
BACKENDS = ["auto", "reference"]


def qkv():
    return make_qkv(1, 4, 2, 5, 7, 8)


def call(fn, **overrides):
    q, k, v = qkv()
    args = dict(q=q, k=k, v=v, scale=0.5)
    args.update(overrides)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    out = fn(q, k, v, **args)
    if isinstance(out, mx.array):
        mx.eval(out)
    return out


WRONG = [
    ("q", dict(q=[[1.0]])),
    ("q", dict(q=None)),
    ("q", dict(q=np.zeros((1, 4, 5, 8), np.float32))),
    ("k", dict(k=3)),
    ("v", dict(v="v")),
    ("q", dict(q=mx.zeros((1, 4, 5, 8), mx.int32))),
    ("q", dict(q=mx.zeros((1, 4, 5, 8), mx.complex64))),
    ("k", dict(k=mx.zeros((1, 2, 7, 8), mx.uint8))),
    ("v", dict(v=mx.zeros((1, 2, 7, 8), mx.bool_))),
    ("scale", dict(scale=None)),
    ("scale", dict(scale="1")),
    ("scale", dict(scale=[0.5])),
    ("scale", dict(scale=mx.array([1.0, 2.0]))),
    ("scale", dict(scale=2j)),
    ("mask", dict(mask=[[True]])),
    ("mask", dict(mask=1)),
    ("mask", dict(mask="upper")),
    ("mask", dict(mask=np.ones((5, 7), bool))),
    ("mask", dict(mask=mx.ones((5, 7), mx.int32))),
    ("mask", dict(mask=mx.ones((5, 7), mx.complex64))),
    ("mask", dict(mask=mx.ones((1, 1, 1, 5, 7), mx.bool_))),
    ("mask", dict(mask=mx.ones((5, 6), mx.bool_))),
    ("mask", dict(mask=mx.ones((2, 4, 5, 7), mx.bool_))),
    ("mask", dict(mask=mx.ones((5, 7), mx.float16), q=mx.zeros((1, 4, 5, 8), mx.bfloat16),
                  k=mx.zeros((1, 2, 7, 8), mx.bfloat16), v=mx.zeros((1, 2, 7, 8), mx.bfloat16))),
    ("sinks", dict(sinks=[0.0] * 4)),
    ("sinks", dict(sinks=np.zeros(4, np.float32))),
    ("sinks", dict(sinks=mx.zeros((4,), mx.int32))),
    ("sinks", dict(sinks=mx.zeros((3,)))),
    ("sinks", dict(sinks=mx.zeros(()))),
    ("window_size", dict(window_size=0)),
    ("window_size", dict(window_size=-3)),
    ("window_size", dict(window_size=True)),
    ("window_size", dict(window_size=2.0)),
    ("window_size", dict(window_size="4")),
    ("stream", dict(stream="cpu")),
    ("stream", dict(stream=0)),
    ("backend", dict(backend=None)),
    ("backend", dict(backend="metal")),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,overrides", WRONG, ids=[f"{i}-{w[0]}" for i, w in enumerate(WRONG)])
def test_wrong_arguments_raise_value_error_naming_them(name, overrides, backend):
    overrides = {"backend": backend, **overrides}
    for fn in (sdpa, mlx_attn.attention_path):
        with pytest.raises(ValueError, match=name):
            call(fn, **overrides)


@pytest.mark.parametrize("backend", ["fused", "reference"])
@pytest.mark.parametrize("shape", [(0, 4, 2, 5, 7), (1, 4, 2, 0, 7), (1, 4, 2, 5, 0), (2, 0, 1, 5, 7), (1, 4, 2, 0, 0)], ids=str)
def test_empty_problems_return_zeros_of_the_right_shape(shape, backend):
    q, k, v = make_qkv(*shape, 8)
    for mask in (None, "causal"):
        out = sdpa(q, k, v, scale=0.5, mask=mask, backend=backend)
        assert out.shape == (shape[0], shape[1], shape[3], 8)
        assert np.all(np.array(out) == 0)  # no key to see: zeros, by contract


def test_huge_window_is_causal():
    q, k, v = qkv()
    for backend in ("fused", "reference"):
        wide = sdpa(q, k, v, scale=0.5, window_size=10**30, backend=backend)
        causal = sdpa(q, k, v, scale=0.5, mask="causal", backend=backend)
        np.testing.assert_allclose(np.array(wide), np.array(causal), atol=0)


def both(**kw):
    q, k, v = qkv()
    return [np.array(sdpa(q, k, v, scale=0.5, backend=b, **kw)) for b in ("fused", "reference")]


def test_infinite_sinks_and_additive_masks_give_numbers():
    fused, reference = both(sinks=mx.array([np.inf, -np.inf, 0.0, 1.0]))
    assert np.isfinite(fused).all()
    np.testing.assert_allclose(fused, reference, atol=2e-5)
    assert np.all(fused[:, 0] == 0)  # a +inf sink takes every weight and carries no value
    additive = np.zeros((5, 7), np.float32)
    additive[1, 3] = np.inf  # the largest logit: row 1 is v at key 3
    additive[2] = -np.inf  # row 2 sees nothing: zeros
    fused, reference = both(mask=mx.array(additive))
    assert np.isfinite(fused).all()
    np.testing.assert_allclose(fused, reference, atol=2e-5)
    q, k, v = qkv()
    np.testing.assert_allclose(fused[0, :, 1], np.repeat(np.array(v[0, :, 3]), 2, axis=0), atol=1e-6)
    assert np.all(fused[:, :, 2] == 0)


def test_nan_in_a_mask_row_or_a_sink_stays_in_that_row_or_head():
    additive = np.zeros((5, 7), np.float32)
    additive[3, 0] = np.nan
    for out in both(mask=mx.array(additive)):
        assert np.isnan(out[:, :, 3]).all()
        assert np.isfinite(np.delete(out, 3, axis=2)).all()
    for out in both(sinks=mx.array([0.0, np.nan, 0.0, 0.0])):
        assert np.isnan(out[:, 1]).all()
        assert np.isfinite(np.delete(out, 1, axis=1)).all()
