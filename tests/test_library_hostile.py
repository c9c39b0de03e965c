"""Hostile input for the library's modules, RoPE, masks and caches.

Every public entry point must answer bad arguments with a ValueError that
names the argument (or the file and field), fail fast on huge sizes instead
of allocating them, and leave a cache untouched when it refuses an update.
"""

import json
import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_attn import ConcatKVCache, KVCache, MultiHeadAttention, RoPE, RotatingKVCache
from mlx_attn.cache import kv_cache_bytes, kv_cache_bytes_per_token, load_cache, save_cache
from mlx_attn.masks import (
    additive_to_bool,
    bool_to_additive,
    causal_mask,
    combine_masks,
    padding_mask,
    query_key_padding_mask,
    sliding_window_mask,
)
from mlx_attn.rope import rope_angles

NAN, INF = float("nan"), float("inf")
HUGE = 2**40


def kv(b=1, h=2, t=3, d=8, dv=None, dtype=mx.float32):
    """A (keys, values) pair of the given sizes."""
    return mx.ones((b, h, t, d), dtype=dtype), mx.ones((b, h, t, d if dv is None else dv), dtype=dtype)


# ------------------------------------------------------------ MultiHeadAttention construction
BAD_MODULE_CONFIGS = [
    (dict(d_model="32", n_heads=4), "d_model"),
    (dict(d_model=32.0, n_heads=4), "d_model"),
    (dict(d_model=True, n_heads=1), "d_model"),
    (dict(d_model=-32, n_heads=4), "d_model"),
    (dict(d_model=0, n_heads=4), "d_model"),
    (dict(d_model=HUGE, n_heads=1), "d_model"),
    (dict(d_model=32, n_heads=None), "n_heads"),
    (dict(d_model=32, n_heads=3.5), "n_heads"),
    (dict(d_model=32, n_heads=-4), "n_heads"),
    (dict(d_model=32, n_heads=4, n_kv_heads=0), "n_kv_heads"),
    (dict(d_model=32, n_heads=4, n_kv_heads=True), "n_kv_heads"),
    (dict(d_model=32, n_heads=4, n_kv_heads=8), "multiple"),
    (dict(d_model=32, n_heads=4, head_dim=0), "head_dim"),
    (dict(d_model=32, n_heads=4, head_dim=-8), "head_dim"),
    (dict(d_model=32, n_heads=4, head_dim=8.0), "head_dim"),
    (dict(d_model=32, n_heads=4, bias="yes"), "bias"),
    (dict(d_model=32, n_heads=4, out_bias=1), "out_bias"),
    (dict(d_model=32, n_heads=4, fused_qkv=None), "fused_qkv"),
    (dict(d_model=32, n_heads=4, dropout=NAN), "dropout"),
    (dict(d_model=32, n_heads=4, dropout=INF), "dropout"),
    (dict(d_model=32, n_heads=4, dropout=-0.1), "dropout"),
    (dict(d_model=32, n_heads=4, dropout="0.1"), "dropout"),
    (dict(d_model=32, n_heads=4, rope="rope"), "rope"),
    (dict(d_model=32, n_heads=4, backend=None), "backend"),
    (dict(d_model=32, n_heads=4, window_size=0), "window_size"),
    (dict(d_model=32, n_heads=4, window_size=1.5), "window_size"),
    (dict(d_model=32, n_heads=4, window_size=True), "window_size"),
    # sizes whose weights could not exist: refused before nn.Linear sees them
    (dict(d_model=2**20, n_heads=16), "weight"),
    (dict(d_model=64, n_heads=2**20, head_dim=2**12), "n_heads \\* head_dim"),
    (dict(d_model=64, n_heads=2**12, head_dim=2**12, fused_qkv=True), "weight"),
]


@pytest.mark.parametrize("kwargs,message", BAD_MODULE_CONFIGS)
def test_module_construction_rejects(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MultiHeadAttention(**kwargs)


# ------------------------------------------------------------ MultiHeadAttention call
def module_call_cases():
    x = mx.ones((2, 5, 32))
    return [
        (lambda m: m([[1.0] * 32]), "x must be an mlx"),
        (lambda m: m(mx.ones((2, 5, 32), dtype=mx.int32)), "x must be floating"),
        (lambda m: m(mx.ones((2, 5, 32), dtype=mx.float64)), "x must be floating"),
        (lambda m: m(mx.ones((5, 32))), r"\[batch, length"),
        (lambda m: m(mx.ones((1, 2, 5, 32))), r"\[batch, length"),
        (lambda m: m(mx.ones((2, 5, 16))), "32"),
        (lambda m: m(x, mx.ones((2, 4, 32), dtype=mx.int32)), "kv must be floating"),
        (lambda m: m(x, mx.ones((2, 32))), "kv must be"),
        (lambda m: m(x, mx.ones((3, 4, 32))), "batch sizes differ"),
        (lambda m: m(x, cache="cache"), "cache must be"),
        (lambda m: m(x, cache={}), "cache must be"),
        (lambda m: m(x, return_weights="yes"), "return_weights"),
        # masks on the weights path are checked like on the fused path
        (lambda m: m(x, mask=mx.ones((4, 4), dtype=mx.bool_), return_weights=True), "broadcast"),
        (lambda m: m(x, mask=mx.ones((5, 5), dtype=mx.int32), return_weights=True), "mask"),
        (lambda m: m(x, mask="causal_", return_weights=True), "mask"),
        (lambda m: m(x, mask=[[True]], return_weights=True), "mask"),
        (lambda m: m(x, mask=mx.ones((1, 1, 1, 5, 5), dtype=mx.bool_), return_weights=True), "4 dims"),
        (lambda m: m(x, mask=mx.ones((5, 5), dtype=mx.int32)), "mask"),
    ]


@pytest.mark.parametrize("case", range(len(module_call_cases())))
def test_module_call_rejects(case):
    call, message = module_call_cases()[case]
    with pytest.raises(ValueError, match=message):
        call(MultiHeadAttention(32, 4, 2, rope=RoPE(8)))


def test_module_dropout_path_checks_the_mask():
    mha = MultiHeadAttention(32, 4, dropout=0.5)
    mha.train()
    with pytest.raises(ValueError, match="broadcast"):
        mha(mx.ones((1, 5, 32)), mask=mx.ones((3, 3), dtype=mx.bool_))


@pytest.mark.parametrize("make_cache", [ConcatKVCache, KVCache, lambda: RotatingKVCache(4, keep=1)])
@pytest.mark.parametrize("chunk", [1, 3])
def test_bad_mask_leaves_the_cache_untouched(make_cache, chunk):
    """A mask that fits the keys before the update but not after it is
    refused before the cache changes."""
    mha = MultiHeadAttention(16, 2, rope=RoPE(4))
    cache = make_cache()
    mha(mx.ones((1, 3, 16)), mask="causal", cache=cache)
    before = [np.array(a) for a in cache.state] + [cache.offset]
    stale = mx.ones((chunk, cache.state[0].shape[2]), dtype=mx.bool_)  # ignores the new keys
    for return_weights in (False, True):
        with pytest.raises(ValueError, match="broadcast"):
            mha(mx.ones((1, chunk, 16)), mask=stale, cache=cache, return_weights=return_weights)
    after = [np.array(a) for a in cache.state] + [cache.offset]
    assert after[-1] == before[-1]
    for a, b in zip(before[:-1], after[:-1]):
        np.testing.assert_array_equal(a, b)


def test_module_with_a_cache_of_another_shape_leaves_it_untouched():
    cache = KVCache()
    MultiHeadAttention(16, 2)(mx.ones((1, 3, 16)), cache=cache)
    with pytest.raises(ValueError, match="do not match"):
        MultiHeadAttention(16, 4)(mx.ones((1, 1, 16)), cache=cache)
    assert cache.offset == 3


def test_module_empty_batch_and_sequence():
    mha = MultiHeadAttention(16, 4, 2, rope=RoPE(4))
    assert mha(mx.ones((0, 3, 16)), mask="causal").shape == (0, 3, 16)
    y = mha(mx.ones((2, 0, 16)))
    assert y.shape == (2, 0, 16)
    y, w = mha(mx.ones((2, 3, 16)), mx.ones((2, 0, 16)), return_weights=True)
    assert y.shape == (2, 3, 16) and w.shape == (2, 4, 3, 0)
    with pytest.raises(ValueError, match="at least one token"):
        mha(mx.ones((1, 0, 16)), cache=KVCache())


# ------------------------------------------------------------ RoPE
BAD_ROPE_CONFIGS = [
    (dict(dims="8"), "dims"),
    (dict(dims=8.0), "dims"),
    (dict(dims=True), "dims"),
    (dict(dims=None), "dims"),
    (dict(dims=7), "even"),
    (dict(dims=8, base=NAN), "base"),
    (dict(dims=8, base=INF), "base"),
    (dict(dims=8, base=-10.0), "base"),
    (dict(dims=8, base=0), "base"),
    (dict(dims=8, base="1e4"), "base"),
    (dict(dims=8, base=True), "base"),
    (dict(dims=8, base=1e-40), "overflow float32"),  # 1/base is not a float32
    (dict(dims=8, base=1e39), "base"),
    (dict(dims=8, scale=1e30), "overflow float32"),
    (dict(dims=8, base=1e-20, scale=-1e10), "overflow float32"),
    (dict(dims=8, scale=NAN), "scale"),
    (dict(dims=8, scale=-INF), "scale"),
    (dict(dims=8, scale="1"), "scale"),
    (dict(dims=8, traditional="no"), "traditional"),
    (dict(dims=8, traditional=1), "traditional"),
]


@pytest.mark.parametrize("kwargs,message", BAD_ROPE_CONFIGS)
def test_rope_construction_rejects(kwargs, message):
    dims = kwargs.pop("dims")
    with pytest.raises(ValueError, match=message):
        RoPE(dims, **kwargs)


BAD_ROPE_CALLS = [
    (lambda r: r([[1.0] * 8]), "x must be an mlx"),
    (lambda r: r(mx.ones((2, 8), dtype=mx.int32)), "floating"),
    (lambda r: r(mx.ones((2, 8), dtype=mx.bool_)), "floating"),
    (lambda r: r(mx.ones((2, 8), dtype=mx.float64)), "floating"),
    (lambda r: r(mx.ones((8,))), r"\[\.\.\., T, features\]"),
    (lambda r: r(mx.ones((2, 4))), "features"),
    (lambda r: r(mx.ones((2, 8)), offset=-1), "offset"),
    (lambda r: r(mx.ones((2, 8)), offset=1.5), "offset"),
    (lambda r: r(mx.ones((2, 8)), offset=True), "offset"),
    (lambda r: r(mx.ones((2, 8)), offset="3"), "offset"),
    (lambda r: r(mx.ones((2, 8)), offset=None), "offset"),
    (lambda r: r(mx.ones((2, 8)), offset=HUGE), "offset"),
    (lambda r: r(mx.ones((2, 8)), offset=2**31 - 2), "offset"),  # the last position overflows int32
    (lambda r: r(mx.ones((2, 8)), offset=mx.array(1.5)), "offset"),
    (lambda r: r(mx.ones((2, 8)), offset=mx.array(NAN)), "offset"),
    (lambda r: r(mx.ones((2, 8)), offset=mx.array([1, 2, 3])), "offset"),  # one position per step: 2, not 3
    (lambda r: rope_angles(mx.zeros((2, 2)), 8, 1e4, 1.0), "positions"),
    (lambda r: rope_angles(mx.arange(3), 5, 1e4, 1.0), "even"),
    (lambda r: rope_angles(mx.arange(3), 8, NAN, 1.0), "base"),
]


@pytest.mark.parametrize("case", range(len(BAD_ROPE_CALLS)))
def test_rope_call_rejects(case):
    call, message = BAD_ROPE_CALLS[case]
    with pytest.raises(ValueError, match=message):
        call(RoPE(8))


def test_rope_accepts_integer_array_offsets_and_empty_sequences():
    rope = RoPE(8)
    x = mx.random.normal((1, 2, 3, 8))
    for offset in (mx.array(5), mx.array(5, dtype=mx.uint32), np.int64(5)):
        np.testing.assert_array_equal(np.array(rope(x, offset=offset)), np.array(rope(x, offset=5)))
    empty = rope(mx.ones((1, 2, 0, 8), dtype=mx.float16))
    assert empty.shape == (1, 2, 0, 8) and empty.dtype == mx.float16
    large = rope(x, offset=2**31 - 4)  # the largest offset that still fits
    assert np.isfinite(np.array(large)).all()
    # the most extreme accepted base and scale still give finite rotations
    for extreme in (RoPE(8, base=1e-20, scale=1e8), RoPE(8, base=1e38, scale=-1.0), RoPE(8, scale=0.0)):
        assert np.isfinite(np.array(extreme(x, offset=2**31 - 4))).all()


# ------------------------------------------------------------ masks
BAD_MASK_CALLS = [
    (lambda: causal_mask(-1), "q_len"),
    (lambda: causal_mask("4"), "q_len"),
    (lambda: causal_mask(4.0), "q_len"),
    (lambda: causal_mask(True), "q_len"),
    (lambda: causal_mask(None), "q_len"),
    (lambda: causal_mask(4, -1), "kv_len"),
    (lambda: causal_mask(4, 2.5), "kv_len"),
    (lambda: causal_mask(4, 6, offset=-1), "offset"),
    (lambda: causal_mask(4, 6, offset="1"), "offset"),
    (lambda: causal_mask(4, offset=HUGE), "offset"),
    (lambda: causal_mask(4, window_size=0), "window_size"),
    (lambda: causal_mask(4, window_size=1.5), "window_size"),
    (lambda: causal_mask(4, dtype="bool"), "dtype"),
    (lambda: causal_mask(4, dtype=mx.int32), "dtype"),
    (lambda: causal_mask(4, dtype=np.bool_), "dtype"),
    (lambda: causal_mask(HUGE), "q_len"),
    (lambda: causal_mask(2**20, 2**20), "elements"),
    (lambda: causal_mask(2**16, offset=2**30), "elements"),
    (lambda: sliding_window_mask(4, 0), "window_size"),
    (lambda: sliding_window_mask(4, None), "window_size"),
    (lambda: sliding_window_mask(4, 2.0), "window_size"),
    (lambda: padding_mask([[1, 2]]), "1-D"),
    (lambda: padding_mask(["a"]), "integers"),
    (lambda: padding_mask([1.5]), "integers"),
    (lambda: padding_mask(mx.array([1.0, 2.0])), "integers"),
    (lambda: padding_mask([True, False]), "integers"),
    (lambda: padding_mask(None), "1-D"),
    (lambda: padding_mask("abc"), "1-D"),
    (lambda: padding_mask([[1], [1, 2]]), "lengths"),
    (lambda: padding_mask([-1]), ">= 0"),
    (lambda: padding_mask([5], 4), "exceeds"),
    (lambda: padding_mask([1], -1), "max_len"),
    (lambda: padding_mask([1], 2.5), "max_len"),
    (lambda: padding_mask([1], True), "max_len"),
    (lambda: padding_mask([1], dtype=mx.int32), "dtype"),
    (lambda: padding_mask([HUGE]), "max_len"),
    (lambda: padding_mask([2**20] * 2**12), "elements"),
    (lambda: query_key_padding_mask([2**16]), "elements"),
    (lambda: query_key_padding_mask([1], dtype="float32"), "dtype"),
    (lambda: bool_to_additive([[True]]), "mask"),
    (lambda: bool_to_additive(mx.zeros((2,))), "boolean"),
    (lambda: bool_to_additive(mx.ones((2,), dtype=mx.bool_), mx.int32), "dtype"),
    (lambda: bool_to_additive(mx.ones((2,), dtype=mx.bool_), mx.bool_), "floating"),
    (lambda: bool_to_additive(mx.ones((2,), dtype=mx.bool_), "float32"), "dtype"),
    (lambda: additive_to_bool([0.0]), "mask"),
    (lambda: additive_to_bool(mx.ones((2,), dtype=mx.bool_)), "floating"),
    (lambda: additive_to_bool(mx.array([0.0, NAN])), "NaN"),
    (lambda: additive_to_bool(mx.array([0.0, INF])), r"\+inf"),
    (lambda: combine_masks("causal"), "arrays"),
    (lambda: combine_masks([[True]]), "arrays"),
    (lambda: combine_masks(mx.ones((2, 2), dtype=mx.int32)), "dtype"),
    (lambda: combine_masks(mx.ones((2, 2), dtype=mx.bool_), mx.full((2, 2), NAN)), "NaN"),
    (lambda: combine_masks(mx.full((2, 2), INF)), r"\+inf"),
    (lambda: combine_masks(mx.ones((2, 3), dtype=mx.bool_), mx.ones((4, 3), dtype=mx.bool_)), "broadcast"),
    (lambda: combine_masks(mx.ones((2**16, 1), dtype=mx.bool_), mx.ones((1, 2**16), dtype=mx.bool_)), "elements"),
]


@pytest.mark.parametrize("case", range(len(BAD_MASK_CALLS)))
def test_mask_builders_reject(case):
    call, message = BAD_MASK_CALLS[case]
    with pytest.raises(ValueError, match=message):
        call()


def test_mask_edge_cases_that_are_valid():
    assert causal_mask(0).shape == (0, 0)
    assert causal_mask(0, 5).shape == (0, 5)
    assert padding_mask([]).shape == (0, 1, 1, 0)
    assert padding_mask(np.array([2, 0], dtype=np.uint8)).shape == (2, 1, 1, 2)
    np.testing.assert_array_equal(np.array(padding_mask(mx.array([1, 0]), 2))[:, 0, 0], [[1, 0], [0, 0]])
    np.testing.assert_array_equal(
        np.array(combine_masks(mx.array([0.0, -INF, -2.0]), mx.array([True, True, False]))), [0.0, -INF, -INF]
    )
    np.testing.assert_array_equal(np.array(additive_to_bool(mx.array([-INF, -1e30, 0.0]))), [False, True, True])


# ------------------------------------------------------------ cache construction
BAD_CACHE_CONSTRUCTION = [
    (lambda: KVCache(step=0), "step"),
    (lambda: KVCache(step=-1), "step"),
    (lambda: KVCache(step=1.5), "step"),
    (lambda: KVCache(step=True), "step"),
    (lambda: KVCache(step="256"), "step"),
    (lambda: KVCache(step=HUGE), "step"),
    (lambda: RotatingKVCache(0), "max_size"),
    (lambda: RotatingKVCache(-4), "max_size"),
    (lambda: RotatingKVCache(2.5), "max_size"),
    (lambda: RotatingKVCache(True), "max_size"),
    (lambda: RotatingKVCache(HUGE), "max_size"),
    (lambda: RotatingKVCache(4, keep=-1), "keep"),
    (lambda: RotatingKVCache(4, keep=4), "keep"),
    (lambda: RotatingKVCache(4, keep=1.5), "keep"),
    (lambda: RotatingKVCache(4, step=0), "step"),
    (lambda: RotatingKVCache(4, step=HUGE), "step"),
]


@pytest.mark.parametrize("case", range(len(BAD_CACHE_CONSTRUCTION)))
def test_cache_construction_rejects(case):
    call, message = BAD_CACHE_CONSTRUCTION[case]
    with pytest.raises(ValueError, match=message):
        call()


# ------------------------------------------------------------ cache updates
CACHES = {
    "concat": ConcatKVCache,
    "kv": lambda: KVCache(step=4),
    "rotating": lambda: RotatingKVCache(5, keep=1, step=2),
}

BAD_UPDATES = [  # against a cache holding kv(b=1, h=2, t=3, d=8, dv=6)
    (lambda: ([[1.0]], kv()[1]), "keys must be an mlx"),
    (lambda: (kv()[0], None), "values must be an mlx"),
    (lambda: (mx.ones((2, 3, 8)), [[1.0]]), "values must be an mlx"),
    (lambda: (mx.ones((2, 3, 8)), mx.ones((2, 3, 8))), r"\[B, n_kv_heads, T, head_dim\]"),
    (lambda: kv(d=8, dv=6, dtype=mx.int32), "floating"),
    (lambda: kv(d=8, dv=6, dtype=mx.float64), "floating"),
    (lambda: (kv()[0], kv(dv=6, dtype=mx.float16)[1]), "same dtype"),
    (lambda: (kv(t=1)[0], kv(t=2, dv=6)[1]), "disagree"),
    (lambda: kv(t=1, dv=8), "value dim"),  # the head dim of the values changed
    (lambda: kv(t=1, dv=1), "value dim"),  # ... even to one that would broadcast
    (lambda: kv(t=1, d=4, dv=6), "do not match"),
    (lambda: kv(t=1, h=4, dv=6), "do not match"),
    (lambda: kv(t=1, b=2, dv=6), "do not match"),
    (lambda: kv(t=1, dv=6, dtype=mx.float16), "dtype"),
    (lambda: kv(t=0, dv=6), "at least one token"),
    (lambda: kv(t=1, h=0, dv=6), "head"),
    (lambda: kv(t=1, d=0, dv=6), "head_dim"),
]


def state_snapshot(cache):
    keys, values = cache.state
    return cache.offset, np.array(keys), np.array(values), cache.meta_state


def assert_unchanged(cache, snapshot):
    offset, keys, values, meta = state_snapshot(cache)
    assert offset == snapshot[0] and meta == snapshot[3]
    np.testing.assert_array_equal(keys, snapshot[1])
    np.testing.assert_array_equal(values, snapshot[2])


@pytest.mark.parametrize("kind", list(CACHES))
@pytest.mark.parametrize("case", range(len(BAD_UPDATES)))
def test_cache_update_rejects_and_keeps_its_state(kind, case):
    cache = CACHES[kind]()
    cache.update_and_fetch(*kv(d=8, dv=6))
    snapshot = state_snapshot(cache)
    make, message = BAD_UPDATES[case]
    with pytest.raises(ValueError, match=message):
        cache.update_and_fetch(*make())
    assert_unchanged(cache, snapshot)


@pytest.mark.parametrize("kind", list(CACHES))
def test_cache_accepts_a_value_dim_other_than_the_key_dim(kind):
    cache = CACHES[kind]()
    for t in (3, 1, 2):
        keys, values = cache.update_and_fetch(*kv(t=t, d=8, dv=6))
    assert keys.shape[3] == 8 and values.shape[3] == 6 and cache.offset == 6


@pytest.mark.parametrize("kind", list(CACHES))
@pytest.mark.parametrize("steps", [[1] * 9, [3, 1, 4, 1, 2], [7, 2], [1, 1, 5, 1, 1, 1, 6]])
def test_keys_after_update_predicts_update_and_fetch(kind, steps):
    """What a module checks a mask against before updating is exactly what
    the update returns."""
    cache = CACHES[kind]()
    for t in steps:
        predicted = cache.keys_after_update(t)
        keys, _ = cache.update_and_fetch(*kv(t=t))
        assert keys.shape[2] == predicted


# ------------------------------------------------------------ trim
@pytest.mark.parametrize("kind", list(CACHES))
@pytest.mark.parametrize("n", [1.5, True, False, -1, "1", None, mx.array(1), 1.0])
def test_trim_takes_a_non_negative_int(kind, n):
    cache = CACHES[kind]()
    cache.update_and_fetch(*kv(t=3))
    snapshot = state_snapshot(cache)
    with pytest.raises(ValueError, match="n must be"):
        cache.trim(n)
    assert_unchanged(cache, snapshot)


@pytest.mark.parametrize("kind", list(CACHES))
def test_trim_returns_how_many_tokens_it_dropped(kind):
    cache = CACHES[kind]()
    assert cache.trim(3) == 0  # empty
    cache.update_and_fetch(*kv(t=4))
    assert cache.trim(0) == 0 and cache.offset == 4
    assert cache.trim(np.int64(1)) == 1 and cache.offset == 3
    assert cache.trim(10) == 3 and cache.offset == 0
    assert cache.state[0] is None or cache.state[0].shape[2] == 0
    keys, _ = cache.update_and_fetch(*kv(t=2))
    assert keys.shape[2] == 2 and cache.offset == 2


# ------------------------------------------------------------ state / meta_state setters
BAD_STATES = [
    (lambda: kv()[0], "pair"),
    (lambda: (*kv(), kv()[0]), "pair"),
    (lambda: (kv()[0], None), "values must be an mlx"),
    (lambda: (mx.ones((2, 3, 8)), mx.ones((2, 3, 8))), r"\[B, n_kv_heads, T, head_dim\]"),
    (lambda: (kv(t=3)[0], kv(t=4)[1]), "disagree"),
    (lambda: kv(dtype=mx.int32), "floating"),
    (lambda: (kv()[0], kv(dtype=mx.bfloat16)[1]), "same dtype"),
]


@pytest.mark.parametrize("kind", list(CACHES))
@pytest.mark.parametrize("case", range(len(BAD_STATES)))
def test_state_setter_rejects(kind, case):
    cache = CACHES[kind]()
    cache.update_and_fetch(*kv(t=2))
    snapshot = state_snapshot(cache)
    make, message = BAD_STATES[case]
    with pytest.raises(ValueError, match=message):
        cache.state = make()
    assert_unchanged(cache, snapshot)


def bad_meta_states(kind):
    """meta_state values a cache holding 3 tokens must refuse."""
    good = CACHES[kind]()
    good.update_and_fetch(*kv(t=3))
    meta = good.meta_state
    cases = [
        ("not a dict", "dict"),
        ({**meta, "extra": 1}, "keys"),
        ({**meta, 1: 2}, "keys"),
        ({k: v for k, v in meta.items() if k != "offset"}, "keys"),
        ({**meta, "offset": "3"}, "offset"),
        ({**meta, "offset": 3.0}, "offset"),
        ({**meta, "offset": -1}, "offset"),
        ({**meta, "offset": 2}, "contradict"),
        ({**meta, "offset": 4}, "contradict"),
    ]
    if "step" in meta:
        cases.append(({**meta, "step": 0}, "step"))
    if kind == "rotating":
        cases += [
            ({**meta, "idx": 4}, "contradict"),
            ({**meta, "idx": 1}, "contradict"),
            ({**meta, "keep": 5}, "keep"),
            ({**meta, "max_size": 0}, "max_size"),
            ({**meta, "offset": 9, "idx": 3}, "contradict"),  # slid, yet fewer than max_size stored
        ]
    return cases


@pytest.mark.parametrize("kind", list(CACHES))
def test_meta_state_setter_rejects(kind):
    for value, message in bad_meta_states(kind):
        cache = CACHES[kind]()
        cache.update_and_fetch(*kv(t=3))
        snapshot = state_snapshot(cache)
        with pytest.raises(ValueError, match=message):
            cache.meta_state = value
        assert_unchanged(cache, snapshot)


@pytest.mark.parametrize("kind", list(CACHES))
def test_state_and_meta_state_copy_a_cache(kind):
    source, copy = CACHES[kind](), CACHES[kind]()
    for t in (4, 1, 1, 3, 1):
        source.update_and_fetch(*kv(t=t, d=4))
    copy.state = source.state
    copy.meta_state = source.meta_state
    extra = mx.random.normal((1, 2, 1, 4))
    np.testing.assert_array_equal(
        np.array(source.update_and_fetch(extra, extra)[0]), np.array(copy.update_and_fetch(extra, extra)[0])
    )


# ------------------------------------------------------------ make_mask
@pytest.mark.parametrize("kind", list(CACHES))
@pytest.mark.parametrize("q_len", [-1, 1.5, True, "2", 99])
def test_make_mask_rejects(kind, q_len):
    cache = CACHES[kind]()
    cache.update_and_fetch(*kv(t=3))
    with pytest.raises(ValueError, match="q_len"):
        cache.make_mask(q_len)


def test_rotating_make_mask_describes_only_the_last_update():
    cache = RotatingKVCache(4)
    cache.update_and_fetch(*kv(t=3))
    cache.update_and_fetch(*kv(t=1))
    assert cache.make_mask(1) is None
    with pytest.raises(ValueError, match="last update"):
        cache.make_mask(2)
    cache.update_and_fetch(*kv(t=2))
    assert cache.make_mask(2).shape == (2, cache.keys.shape[2])


# ------------------------------------------------------------ save / load
def filled(kind, tokens=3):
    cache = CACHES[kind]()
    for t in (tokens, 1, 1):
        cache.update_and_fetch(*kv(t=t))
    return cache


@pytest.mark.parametrize("kind", list(CACHES))
@pytest.mark.parametrize("name", ["prompt", "prompt.safetensors", "prompt.bin"])
def test_save_and_load_agree_on_the_file_name(tmp_path, kind, name):
    """The path given to save_cache is the path load_cache takes; the suffix
    follows mx.save_safetensors (appended unless already there)."""
    caches = [filled(kind), CACHES[kind]()]
    save_cache(tmp_path / name, caches)
    written = name if name.endswith(".safetensors") else name + ".safetensors"
    assert sorted(p.name for p in tmp_path.iterdir()) == [written]
    for spelling in (tmp_path / name, str(tmp_path / name), str(tmp_path / written)):
        loaded, _ = load_cache(spelling, n_layers=2)
        assert [c.offset for c in loaded] == [5, 0]
        np.testing.assert_array_equal(np.array(loaded[0].state[0]), np.array(caches[0].state[0]))
        assert loaded[1].state == (None, None)


BAD_SAVES = [
    (lambda p: save_cache(3, [KVCache()]), "path"),
    (lambda p: save_cache("", [KVCache()]), "path"),
    (lambda p: save_cache(p / "c", KVCache()), "list"),
    (lambda p: save_cache(p / "c", [KVCache(), "cache"]), r"caches\[1\]"),
    (lambda p: save_cache(p / "c", [KVCache()], metadata={"model": 3}), "metadata"),
    (lambda p: save_cache(p / "c", [KVCache()], metadata=["model"]), "metadata"),
    (lambda p: save_cache(p / "c", [KVCache()], metadata={"mlx_attn.caches": "[]"}), "reserved"),
    (lambda p: save_cache(p / "missing" / "dir" / "c", [KVCache()]), "missing"),
]


@pytest.mark.parametrize("case", range(len(BAD_SAVES)))
def test_save_cache_rejects(tmp_path, case):
    call, message = BAD_SAVES[case]
    with pytest.raises(ValueError, match=message):
        call(tmp_path)


def write_cache_file(path, arrays, described, metadata=None):
    """A cache file written without save_cache (to forge damaged ones)."""
    meta = dict(metadata or {})
    if described is not None:
        meta["mlx_attn.caches"] = described if isinstance(described, str) else json.dumps(described)
    mx.save_safetensors(str(path), arrays, metadata=meta)
    return path


def kv_layer(kind="KVCache", offset=3, **meta):
    defaults = {"KVCache": {"step": 4}, "ConcatKVCache": {},
                "RotatingKVCache": {"max_size": 5, "keep": 1, "step": 2, "idx": offset}}[kind]
    return {"type": kind, "meta": {"offset": offset, **defaults, **meta}, "empty": False}


def forged_files():
    """(arrays, layer descriptions, message) of files load_cache must refuse."""
    k, v = kv(t=3)
    ok = {"0.keys": k, "0.values": v}
    return [
        (ok, [kv_layer(offset=-1)], "offset"),
        (ok, [kv_layer(offset="3")], "offset"),
        (ok, [kv_layer(offset=3.0)], "offset"),
        (ok, [kv_layer(offset=None)], "offset"),
        (ok, [kv_layer(offset=4)], "contradicts the 3 stored"),
        (ok, [kv_layer(offset=2)], "contradicts the 3 stored"),
        (ok, [kv_layer("ConcatKVCache", offset=7)], "contradicts"),
        (ok, [kv_layer("RotatingKVCache", idx=1)], "contradict"),
        (ok, [kv_layer("RotatingKVCache", offset=9, idx=3)], "contradict"),
        (ok, [kv_layer("RotatingKVCache", keep=9)], "keep"),
        (ok, [kv_layer(step=0)], "step"),
        (ok, [kv_layer(step=HUGE)], "step"),
        (ok, [{**kv_layer(), "type": "PagedKVCache"}], "type"),
        (ok, [{**kv_layer(), "type": ["KVCache"]}], "type"),
        (ok, [{"type": "KVCache", "meta": {"offset": 3, "step": 4}}], "fields"),
        (ok, [{**kv_layer(), "meta": "offset=3"}], "meta"),
        (ok, [{**kv_layer(), "meta": {"offset": 3}}], "keys"),
        (ok, [{**kv_layer(), "empty": True}], "empty"),
        (ok, [{**kv_layer(), "empty": "no"}], "empty"),
        ({}, [kv_layer()], "empty"),
        ({"0.keys": k}, [kv_layer()], "keys stored without values"),
        ({"0.values": v}, [{**kv_layer(), "empty": True}], "values stored without keys"),
        ({**ok, "weights": k}, [kv_layer()], "not cache layers"),
        ({**ok, "1.keys": k, "1.values": v}, [kv_layer()], "not cache layers"),
        ({"0.keys": k, "0.values": kv(t=3, h=1)[1]}, [kv_layer()], "disagree"),
        ({"0.keys": k, "0.values": kv(t=4)[1]}, [kv_layer()], "disagree"),
        ({"0.keys": k.astype(mx.int32), "0.values": v.astype(mx.int32)}, [kv_layer()], "floating"),
        ({"0.keys": k, "0.values": v.astype(mx.float16)}, [kv_layer()], "same dtype"),
        ({"0.keys": k[0], "0.values": v[0]}, [kv_layer()], r"\[B, n_kv_heads"),
        ({**ok, "1.keys": kv(b=2)[0], "1.values": kv(b=2)[1]}, [kv_layer(), kv_layer()], "earlier layer batch"),
        (ok, "not json", "JSON"),
        (ok, json.dumps({"0": kv_layer()}), "list"),
        (ok, ["KVCache"], "fields"),
    ]


@pytest.mark.parametrize("case", range(len(forged_files())))
def test_load_cache_rejects_forged_files(tmp_path, case):
    arrays, described, message = forged_files()[case]
    path = write_cache_file(tmp_path / "forged.safetensors", arrays, described)
    with pytest.raises(ValueError, match=message) as error:
        load_cache(path)
    assert "forged.safetensors" in str(error.value)


def test_load_cache_checks_the_expected_shapes_and_dtypes(tmp_path):
    cache = KVCache()
    cache.update_and_fetch(*kv(t=3, d=8, dv=6, dtype=mx.float16))
    save_cache(tmp_path / "c", [cache])
    loaded, _ = load_cache(tmp_path / "c", {"value_dim": 6, "dtype": mx.float16, "head_dim": 8})
    assert loaded[0].state[1].shape == (1, 2, 3, 6)
    for expected, message in [
        ({"value_dim": 8}, "value_dim=6"),
        ({"dtype": mx.float32}, "dtype=mlx.core.float16"),
        ({"dtype": "float16"}, "dtype"),
        ({"n_kv_heads": 0}, "n_kv_heads"),
        ({"n_kv_heads": "2"}, "n_kv_heads"),
        ({"batch": True}, "batch"),
        ({"n_layers": -1}, "n_layers"),
        ({"head_dim": 8.0}, "head_dim"),
        ([("head_dim", 8)], "expected must be a dict"),
    ]:
        with pytest.raises(ValueError, match=message):
            load_cache(tmp_path / "c", expected)
    with pytest.raises(ValueError, match="n_kv_heads"):
        load_cache(tmp_path / "c", n_kv_heads=-2)


def damaged_files(good: bytes):
    """(bytes, message) of files that are not sound safetensors files."""
    header_len = int.from_bytes(good[:8], "little")
    header = json.loads(good[8 : 8 + header_len])

    def with_header(new_header):
        raw = json.dumps(new_header).encode()
        return len(raw).to_bytes(8, "little") + raw + good[8 + header_len :]

    first = next(name for name in header if name != "__metadata__")
    return [
        (b"", "shorter"),
        (good[:5], "shorter"),
        (good[:40], "header length"),
        (good[:-7], "exceed"),  # truncated inside the tensor data
        (b"\xff" * 64, "header length"),
        ((2**62).to_bytes(8, "little") + good[8:], "header length"),
        (good[:8] + b"\x00" * header_len + good[8 + header_len :], "JSON"),
        (with_header([1, 2]), "JSON object"),
        (with_header({**header, first: {**header[first], "dtype": "X99"}}), "dtype"),
        (with_header({**header, first: {**header[first], "shape": [1, -2, 3, 8]}}), "shape"),
        (with_header({**header, first: {**header[first], "shape": [1, 2, 3, 9]}}), "bytes do not hold"),
        (with_header({**header, first: {**header[first], "data_offsets": [0, 2**60]}}), "exceed"),
        (with_header({**header, first: {**header[first], "data_offsets": "0-96"}}), "data_offsets"),
        (with_header({**header, "__metadata__": {"mlx_attn.caches": 3}}), "__metadata__"),
        (with_header({k: v for k, v in header.items() if k != "__metadata__"}), "metadata"),
    ]


@pytest.mark.parametrize("case", range(15))
def test_load_cache_rejects_damaged_files(tmp_path, case):
    save_cache(tmp_path / "good", [filled("kv")])
    data, message = damaged_files((tmp_path / "good.safetensors").read_bytes())[case]
    (tmp_path / "bad.safetensors").write_bytes(data)
    with pytest.raises(ValueError, match=message) as error:
        load_cache(tmp_path / "bad")
    assert "bad.safetensors" in str(error.value) and "not a readable" in str(error.value)


def test_load_cache_rejects_foreign_and_missing_files(tmp_path):
    mx.save_safetensors(str(tmp_path / "weights.safetensors"), {"w": mx.ones((2, 2))})
    with pytest.raises(ValueError, match="weights.safetensors.*metadata"):
        load_cache(tmp_path / "weights")
    (tmp_path / "dir.safetensors").mkdir()
    with pytest.raises(ValueError, match="not a file"):
        load_cache(tmp_path / "dir")
    with pytest.raises(FileNotFoundError, match="nothing.safetensors"):
        load_cache(tmp_path / "nothing")
    with pytest.raises(ValueError, match="path"):
        load_cache(None)


# ------------------------------------------------------------ memory accounting
@pytest.mark.parametrize("call", [
    lambda: kv_cache_bytes_per_token(True, 1, 1),
    lambda: kv_cache_bytes_per_token(1.5, 1, 1),
    lambda: kv_cache_bytes_per_token(1, "2", 1),
    lambda: kv_cache_bytes_per_token(1, 1, 0),
    lambda: kv_cache_bytes_per_token(1, 1, 1, dtype="float16"),
    lambda: kv_cache_bytes_per_token(1, 1, 1, batch=-1),
    lambda: kv_cache_bytes(1, 1, 1, -1),
    lambda: kv_cache_bytes(1, 1, 1, 2.5),
    lambda: kv_cache_bytes(1, 1, 1, NAN),
    lambda: kv_cache_bytes(1, 1, 1, None),
])
def test_memory_accounting_rejects(call):
    with pytest.raises(ValueError, match="n_layers|n_kv_heads|head_dim|dtype|batch|context"):
        call()


def test_memory_accounting_of_huge_contexts_is_arithmetic():
    # a 2**40-token context is a number to report, not an allocation
    assert kv_cache_bytes(32, 8, 128, HUGE, mx.bfloat16) == 2 * 32 * 8 * 128 * 2 * HUGE
    assert math.log2(kv_cache_bytes_per_token(1, 1, 1, mx.float32)) == 3


# ------------------------------------------------------------ every reachable state loads back
@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from(list(CACHES)),
    actions=st.lists(st.one_of(st.integers(1, 7), st.integers(-3, -1)), min_size=1, max_size=10),
)
def test_any_reachable_state_survives_save_and_load(tmp_path_factory, kind, actions):
    """Updates (positive sizes) and trims (negative) in any order: the saved
    state passes load_cache's consistency checks and decodes on identically."""
    cache = CACHES[kind]()
    mx.random.seed(len(actions))
    for action in actions:
        if action > 0:
            cache.update_and_fetch(*[mx.random.normal((1, 2, action, 4))] * 2)
        else:
            cache.trim(-action)
    path = tmp_path_factory.mktemp("state") / "cache"
    save_cache(path, [cache])
    (loaded,), _ = load_cache(path)
    assert loaded.offset == cache.offset and loaded.meta_state == cache.meta_state
    for size in (1, 3, 1):
        new = mx.random.normal((1, 2, size, 4))
        expected_keys, _ = cache.update_and_fetch(new, new)
        got_keys, _ = loaded.update_and_fetch(new, new)
        np.testing.assert_array_equal(np.array(got_keys), np.array(expected_keys))


def test_huge_lazy_masks_are_refused_by_shape_before_their_values_are_read():
    """A mask whose shape is wrong is never evaluated (its values check would
    allocate 2**40 elements)."""
    huge = mx.zeros((2**20, 2**20))
    with pytest.raises(ValueError, match="broadcast"):
        MultiHeadAttention(16, 2)(mx.ones((1, 3, 16)), mask=huge)
    with pytest.raises(ValueError, match="elements"):
        combine_masks(huge, mx.ones((2**20, 1), dtype=mx.bool_))


def test_foreign_caches_are_checked_after_their_update():
    """A cache that cannot say how many keys it will return still has the
    mask checked, after the update."""

    class MinimalCache:
        def __init__(self):
            self.offset, self.keys, self.values = 0, None, None

        def update_and_fetch(self, keys, values):
            self.offset += keys.shape[2]
            self.keys = keys if self.keys is None else mx.concatenate([self.keys, keys], axis=2)
            self.values = values if self.values is None else mx.concatenate([self.values, values], axis=2)
            return self.keys, self.values

        def make_mask(self, q_len):
            return "causal"

    mha, cache = MultiHeadAttention(16, 2, rope=RoPE(4)), MinimalCache()
    x = mx.random.normal((1, 4, 16))
    np.testing.assert_allclose(
        np.array(mha(x, mask="causal", cache=cache)), np.array(mha(x, mask="causal")), atol=1e-5
    )
    with pytest.raises(ValueError, match="broadcast"):
        mha(x[:, :1], mask=mx.ones((1, 4), dtype=mx.bool_), cache=cache)


def test_numpy_scalars_are_numbers_not_errors():
    mha = MultiHeadAttention(np.int64(16), np.int32(4), np.int64(2), bias=np.bool_(True), dropout=np.float32(0.1))
    assert (mha.d_model, mha.n_heads, mha.n_kv_heads) == (16, 4, 2)
    rope = RoPE(np.int64(4), base=np.float64(500.0), traditional=np.bool_(True))
    assert rope.traditional is True and rope.base == 500.0
    with pytest.raises(ValueError, match="d_model"):
        MultiHeadAttention(np.bool_(True), 1)
    assert causal_mask(np.int64(3)).shape == (3, 3)
