"""Mask helpers against explicit NumPy constructions."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mlx_attn
from mlx_attn.masks import (
    additive_to_bool,
    bool_to_additive,
    causal_mask,
    combine_masks,
    padding_mask,
    query_key_padding_mask,
    sliding_window_mask,
)


def np_causal(tq, tkv, offset, window=None):
    m = np.zeros((tq, tkv), dtype=bool)
    for i in range(tq):
        for j in range(tkv):
            m[i, j] = j <= offset + i and (window is None or j > offset + i - window)
    return m


@pytest.mark.parametrize("tq,tkv,offset", [(5, 5, None), (3, 8, None), (3, 8, 2), (1, 10, 9), (4, 6, 0)])
@pytest.mark.parametrize("window", [None, 1, 3])
def test_causal_and_window_masks(tq, tkv, offset, window):
    expected = np_causal(tq, tkv, tkv - tq if offset is None else offset, window)
    got = causal_mask(tq, tkv, offset=offset, window_size=window)
    assert got.dtype == mx.bool_
    np.testing.assert_array_equal(np.array(got), expected)
    additive = np.array(causal_mask(tq, tkv, offset=offset, window_size=window, dtype=mx.float16))
    np.testing.assert_array_equal(additive == 0, expected)
    assert np.all(np.isneginf(additive[~expected]))
    if window is not None:
        np.testing.assert_array_equal(np.array(sliding_window_mask(tq, window, tkv, offset=offset)), expected)


def test_causal_mask_offset_defaults_kv_len():
    np.testing.assert_array_equal(np.array(causal_mask(2, offset=3)), np_causal(2, 5, 3))


def test_causal_mask_agrees_with_the_causal_string():
    q = mx.random.normal((1, 2, 4, 8))
    k = mx.random.normal((1, 2, 9, 8))
    for mask in (causal_mask(4, 9), causal_mask(4, 9, dtype=mx.float32)):
        a = mlx_attn.scaled_dot_product_attention(q, k, k, scale=0.3, mask=mask)
        b = mlx_attn.scaled_dot_product_attention(q, k, k, scale=0.3, mask="causal")
        np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-6)


def test_padding_masks():
    m = np.array(padding_mask([3, 1, 0], 4))
    assert m.shape == (3, 1, 1, 4)
    np.testing.assert_array_equal(m[:, 0, 0], [[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    both = np.array(query_key_padding_mask([2, 3]))
    assert both.shape == (2, 1, 3, 3)
    np.testing.assert_array_equal(both[0, 0], [[1, 1, 0], [1, 1, 0], [0, 0, 0]])
    assert padding_mask([2, 2]).shape == (2, 1, 1, 2)  # max_len defaults to the longest
    with pytest.raises(ValueError, match="exceeds"):
        padding_mask([5], 4)
    with pytest.raises(ValueError, match=">= 0"):
        padding_mask([-1, 2], 4)


def test_padded_query_rows_get_zeros_not_nan():
    q = mx.random.normal((2, 2, 4, 8))
    mask = query_key_padding_mask([4, 2])
    for backend in ("fused", "reference"):
        out = np.array(mlx_attn.scaled_dot_product_attention(q, q, q, scale=0.3, mask=mask, backend=backend))
        assert np.isfinite(out).all()
        assert np.all(out[1, :, 2:] == 0)


def test_conversions_round_trip():
    m = mx.array(np.random.default_rng(0).random((3, 5)) > 0.5)
    add = bool_to_additive(m, mx.bfloat16)
    assert add.dtype == mx.bfloat16
    np.testing.assert_array_equal(np.array(additive_to_bool(add)), np.array(m))
    with pytest.raises(ValueError, match="boolean"):
        bool_to_additive(add)
    with pytest.raises(ValueError, match="floating"):
        additive_to_bool(m)


def test_combine_masks():
    a = mx.array([[True, True, False]])
    b = mx.array([[True], [False]])
    np.testing.assert_array_equal(np.array(combine_masks(a, None, b)), [[1, 1, 0], [0, 0, 0]])
    soft = mx.array([[0.0, -1.0, 0.0]])
    mixed = np.array(combine_masks(a, soft))
    np.testing.assert_array_equal(mixed, [[0.0, -1.0, -np.inf]])
    assert combine_masks(None, None) is None
    with pytest.raises(ValueError, match="arrays"):
        combine_masks("causal", a)


@settings(max_examples=60, deadline=None)
@given(
    tq=st.integers(0, 9),
    extra=st.integers(0, 9),
    offset_shift=st.one_of(st.none(), st.integers(-3, 3)),
    window=st.one_of(st.none(), st.integers(1, 12)),
)
def test_causal_mask_property(tq, extra, offset_shift, window):
    """Any lengths, offsets (lower-right or explicit) and windows agree with
    the loop definition, in both forms."""
    tkv = tq + extra
    offset = None if offset_shift is None else max(0, tkv - tq + offset_shift)
    expected = np_causal(tq, tkv, tkv - tq if offset is None else offset, window)
    got = causal_mask(tq, tkv, offset=offset, window_size=window)
    assert got.shape == (tq, tkv)
    np.testing.assert_array_equal(np.array(got), expected)
    additive = causal_mask(tq, tkv, offset=offset, window_size=window, dtype=mx.float32)
    np.testing.assert_array_equal(np.array(additive_to_bool(additive)), expected)


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(0, 7), min_size=1, max_size=4), pad=st.integers(0, 3))
def test_padding_mask_property(lengths, pad):
    max_len = max(lengths) + pad
    mask = np.array(padding_mask(lengths, max_len))
    assert mask.shape == (len(lengths), 1, 1, max_len)
    np.testing.assert_array_equal(mask.sum(-1).ravel(), lengths)
    for b, n in enumerate(lengths):
        assert mask[b, 0, 0, :n].all() and not mask[b, 0, 0, n:].any()
    both = np.array(query_key_padding_mask(lengths, max_len))
    np.testing.assert_array_equal(both[:, 0], mask[:, 0, 0, :, None] & mask[:, 0, 0, None, :])
