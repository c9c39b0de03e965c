"""``_ext.decode_attention``, one decode step's attention block of a layer as
one CPU primitive (RoPE of q and k, the new rows written into the cache
buffers, attention over the filled slots only), against the MLX operations
it replaces (RoPE, slice updates, the reference attention over the whole
buffer with a visibility mask); and the compiled decode step that uses it."""

import itertools
import os

import mlx.core as mx
import numpy as np
import pytest
from model_fixtures import random_llama, tiny_llama

from mlx_attn import _native
from mlx_attn.cache import KVCache
from mlx_attn.lm.compiled_decode import CompiledDecodeStep
from mlx_attn.reference import reference_attention
from mlx_attn.rope import RoPE, rope_angles

pytestmark = pytest.mark.skipif(_native.ext is None, reason="needs the built extension")

TOLERANCE = {mx.float32: 2e-5, mx.float16: 3e-3, mx.bfloat16: 2e-2}


def unfused_block(q, k, v, key_cache, value_cache, position, rope, scale, window):
    """What the compiled step computed before: heads split, RoPE, the rows
    written with slice_update, attention over the whole buffer with a mask."""
    batch, dim, kv_heads, slots = q.shape[0], key_cache.shape[3], key_cache.shape[1], key_cache.shape[2]
    heads = lambda a, n: a.reshape(batch, 1, n, -1).transpose(0, 2, 1, 3)
    where = mx.array(position, dtype=mx.int32)
    queries = rope(heads(q, q.shape[2] // dim), offset=where)
    keys = mx.slice_update(key_cache, rope(heads(k, kv_heads), offset=where).astype(key_cache.dtype),
                           where.reshape(1), axes=(2,))
    values = mx.slice_update(value_cache, heads(v, kv_heads).astype(value_cache.dtype), where.reshape(1), axes=(2,))
    index = mx.arange(slots)
    visible = index <= position
    if window:
        visible = visible & (index > position - window)
    out = reference_attention(queries.astype(key_cache.dtype), keys, values, scale=scale,
                              mask=visible.reshape(1, 1, 1, -1))
    return out.transpose(0, 2, 1, 3).reshape(batch, 1, -1), keys, values


def fused_block(q, k, v, key_cache, value_cache, position, rope, scale, window):
    angles = rope_angles(mx.array([position], dtype=mx.int32), rope.dims, rope.base, rope.scale).reshape(-1)
    return _native.ext.decode_attention(q, k, v, key_cache, value_cache, mx.array(position, dtype=mx.int32),
                                        mx.cos(angles), mx.sin(angles), scale=scale, window_size=window,
                                        traditional=rope.traditional)


def make_problem(batch, q_heads, kv_heads, dim, slots, dtype, value_dim=None, seed=0):
    value_dim = value_dim or dim
    mx.random.seed(seed)
    normal = lambda *shape: mx.random.normal(shape)
    q = normal(batch, 1, q_heads * dim)
    k = normal(batch, 1, kv_heads * dim)
    v = normal(batch, 1, kv_heads * value_dim)
    key_cache = normal(batch, kv_heads, slots, dim).astype(dtype)
    value_cache = normal(batch, kv_heads, slots, value_dim).astype(dtype)
    mx.eval(q, k, v, key_cache, value_cache)
    return q, k, v, key_cache, value_cache


# (batch, q_heads, kv_heads, head_dim, slots, position, traditional, window, dtype, rotated_dims)
CASES = [
    (1, 9, 3, 64, 256, 0, True, 0, mx.float32, 64),      # SmolLM2's layer, first slot
    (1, 9, 3, 64, 256, 255, True, 0, mx.float32, 64),    # the last slot of a buffer step
    (1, 9, 3, 64, 512, 256, True, 0, mx.float32, 64),    # the first slot after one
    (1, 4, 4, 32, 8, 7, False, 0, mx.float32, 32),       # plain multi-head, buffer full
    (2, 8, 2, 128, 64, 40, False, 16, mx.float16, 128),  # GQA 4, a window, batch 2
    (1, 4, 1, 80, 24, 13, True, 0, mx.bfloat16, 40),     # one KV head, half the features rotated
    (1, 6, 3, 16, 300, 130, False, 0, mx.float32, 16),   # past two key blocks
]
if os.environ.get("MLX_ATTN_FULL_GRID") == "1":
    CASES += [(b, hq, hkv, d, s, p, t, w, dt, d)
              for b, (hq, hkv), d, (s, p), t, w, dt in itertools.product(
                  (1, 3), ((4, 4), (6, 2), (8, 1)), (32, 64, 96), ((64, 0), (64, 63), (256, 200)), (True, False),
                  (0, 5), (mx.float32, mx.float16))]


@pytest.mark.parametrize("batch, q_heads, kv_heads, dim, slots, position, traditional, window, dtype, rotated",
                         CASES)
def test_the_block_equals_the_operations_it_replaces(batch, q_heads, kv_heads, dim, slots, position, traditional,
                                                     window, dtype, rotated):
    problem = make_problem(batch, q_heads, kv_heads, dim, slots, dtype)
    rope = RoPE(rotated, base=10000.0, traditional=traditional)
    scale = dim**-0.5
    expected = unfused_block(*problem, position, rope, scale, window)
    got = fused_block(*problem, position, rope, scale, window)
    mx.eval(expected, got)
    out, keys, values = got
    assert out.shape == (batch, 1, q_heads * dim) and out.dtype == dtype
    # the rows written, and every other slot as it was
    assert np.array_equal(np.array(values.astype(mx.float32)), np.array(expected[2].astype(mx.float32)))
    assert np.allclose(np.array(keys.astype(mx.float32)), np.array(expected[1].astype(mx.float32)),
                       atol=TOLERANCE[dtype], rtol=0)
    assert np.allclose(np.array(out.astype(mx.float32)), np.array(expected[0].astype(mx.float32)),
                       atol=TOLERANCE[dtype], rtol=0)


def test_a_value_width_other_than_the_key_width():
    q, k, v, key_cache, value_cache = make_problem(1, 4, 2, 32, 16, mx.float32, value_dim=48)
    rope = RoPE(32)
    out, _, values = fused_block(q, k, v, key_cache, value_cache, 5, rope, 0.2, 0)
    expected = unfused_block(q, k, v, key_cache, value_cache, 5, rope, 0.2, 0)
    assert out.shape == (1, 1, 4 * 48)
    assert mx.allclose(out, expected[0], atol=2e-5).item() and mx.array_equal(values, expected[2]).item()


def test_a_cache_held_elsewhere_is_not_written_and_a_dropped_one_still_is():
    q, k, v, key_cache, value_cache = make_problem(1, 4, 2, 32, 16, mx.float32)
    before = np.array(key_cache), np.array(value_cache)
    rope = RoPE(32)
    out, keys, values = fused_block(q, k, v, key_cache, value_cache, 3, rope, 0.2, 0)
    mx.eval(out, keys, values)
    # the inputs are still referenced here: the outputs are copies, the inputs unchanged
    assert np.array_equal(np.array(key_cache), before[0]) and np.array_equal(np.array(value_cache), before[1])
    assert not np.array_equal(np.array(keys), before[0])
    # the step's buffers as the only reference (the compiled step's case): the same result
    expected = (np.array(out), np.array(keys), np.array(values))
    held = [mx.array(before[0]), mx.array(before[1])]
    mx.eval(held)
    outputs = fused_block(q, k, v, held.pop(0), held.pop(0), 3, rope, 0.2, 0)
    mx.eval(outputs)
    for got, want in zip(outputs, expected):
        assert np.array_equal(np.array(got), want)


@pytest.mark.parametrize("held", [True, False])
def test_a_buffer_nothing_else_holds_is_updated_in_place(held):
    """The compiled step's case (the cache holds the step's new buffers before
    anything is evaluated): no copy of the buffers, seen in MLX's peak memory;
    a buffer still held is copied (MLX arrays stay immutable)."""
    q, k, v, key_cache, value_cache = make_problem(1, 4, 2, 64, 1 << 13, mx.float32)
    kept = (key_cache, value_cache) if held else None
    angles = mx.zeros((32,))
    cos, sin, position = mx.cos(angles), mx.sin(angles), mx.array(3, dtype=mx.int32)
    mx.eval(cos, sin, position)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    out, key_cache, value_cache = _native.ext.decode_attention(q, k, v, key_cache, value_cache, position, cos, sin,
                                                               scale=0.1)
    mx.eval(out, key_cache, value_cache)
    copies = (mx.get_peak_memory() - base) / key_cache.nbytes
    assert (copies >= 2) if held else (copies < 0.5), copies
    assert kept is None or not mx.array_equal(kept[0], key_cache).item()


def test_a_position_outside_the_buffer_gives_nan_and_leaves_the_caches():
    q, k, v, key_cache, value_cache = make_problem(1, 4, 2, 32, 16, mx.float32)
    angles = rope_angles(mx.array([0], dtype=mx.int32), 32, 10000.0, 1.0).reshape(-1)
    for position in (16, -1):
        out, keys, values = _native.ext.decode_attention(q, k, v, key_cache, value_cache,
                                                         mx.array(position, dtype=mx.int32), mx.cos(angles),
                                                         mx.sin(angles), scale=0.2)
        assert mx.isnan(out).all().item()
        assert mx.array_equal(keys, key_cache).item() and mx.array_equal(values, value_cache).item()


def _arguments(**changes):
    q, k, v, key_cache, value_cache = make_problem(1, 4, 2, 32, 16, mx.float32)
    angles = mx.zeros((16,))
    arguments = dict(q=q, k=k, v=v, key_cache=key_cache, value_cache=value_cache,
                     position=mx.array(3, dtype=mx.int32), cos=mx.cos(angles), sin=mx.sin(angles), scale=0.2)
    arguments.update(changes)
    return arguments


@pytest.mark.parametrize("name, value", [
    ("key_cache", mx.zeros((1, 2, 16))),
    ("value_cache", mx.zeros((1, 2, 16, 32), dtype=mx.float16)),
    ("value_cache", mx.zeros((1, 2, 15, 32))),
    ("key_cache", mx.zeros((1, 2, 16, 32), dtype=mx.int32)),
    ("q", mx.zeros((1, 1, 4 * 32 + 1))),
    ("q", mx.zeros((1, 1, 3 * 32))),       # 3 heads over 2 KV heads
    ("q", mx.zeros((1, 2, 4 * 32))),       # two tokens
    ("k", mx.zeros((1, 1, 32))),
    ("v", mx.zeros((2, 1, 64))),
    ("v", mx.zeros((1, 1, 64), dtype=mx.int32)),
    ("position", mx.array(3.0)),
    ("position", mx.array([1, 2], dtype=mx.int32)),
    ("cos", mx.zeros((17,))),
    ("cos", mx.zeros((16,), dtype=mx.float16)),
    ("sin", mx.zeros((8,))),
    ("scale", float("inf")),
    ("window_size", -1),
])
def test_bad_inputs_raise_value_error_naming_the_argument(name, value):
    with pytest.raises(ValueError, match=name):
        _native.ext.decode_attention(**_arguments(**{name: value}))


# ---------------------------------------------------------------- the compiled step
def _decode(model, prompt, steps, fused):
    cache = [KVCache(step=8) for _ in model.layers]
    logits = model(mx.array([prompt]), cache=cache)[:, -1]
    step = CompiledDecodeStep(model, cache)
    step.fused = fused
    tokens, all_logits = [], []
    for _ in range(steps):
        token = mx.argmax(logits, axis=-1)
        tokens.append(token.item())
        logits = step(token.reshape(1, 1))
        all_logits.append(logits)
    return tokens, mx.concatenate(all_logits), cache


@pytest.mark.parametrize("make_model", [lambda: random_llama(seed=6, num_hidden_layers=3),
                                        lambda: tiny_llama(seed=2, num_key_value_heads=1)],
                         ids=["gqa2", "mqa"])
def test_the_compiled_step_with_the_fused_block_matches_the_one_without(make_model, monkeypatch):
    model = make_model()
    calls = []
    original = _native.ext.decode_attention
    monkeypatch.setattr(_native.ext, "decode_attention", lambda *a, **k: calls.append(1) or original(*a, **k))
    prompt = [5, 17, 40, 3, 25, 41]
    # 20 steps from 6 prompt tokens: across two buffer growths (8, 16, 24 slots)
    fused_tokens, fused_logits, fused_cache = _decode(model, prompt, 20, fused=True)
    assert calls, "the fused block was not used"
    calls.clear()
    tokens, logits, cache = _decode(model, prompt, 20, fused=False)
    assert not calls
    assert fused_tokens == tokens
    assert mx.allclose(fused_logits, logits, atol=1e-4).item()
    for ours, theirs in zip(fused_cache, cache):
        assert ours.offset == theirs.offset == len(prompt) + 20
        for a, b in zip(ours.state, theirs.state):
            assert mx.allclose(a, b, atol=1e-5).item()


def test_the_reference_backend_keeps_mlx_operations():
    model = tiny_llama(seed=1)
    model.set_backend("reference")
    cache = model.make_cache()
    model(mx.array([[1, 2, 3]]), cache=cache)
    assert CompiledDecodeStep(model, cache).fused is False
    model.set_backend("auto")
    assert CompiledDecodeStep(model, cache).fused is True


# ---------------------------------------------------------------- the serving engine's paged rows
def _rotated_oracle(rows, positions, rotated_dims, base, traditional, heads):
    """``rows [T, heads * D]`` as ``[T, heads, D]``, each token's first
    ``rotated_dims`` features rotated at its own position, in float64."""
    x = np.asarray(rows, np.float64).reshape(rows.shape[0], heads, -1).copy()
    pairs = rotated_dims // 2
    angles = np.asarray(positions, np.float64)[:, None] * base ** (-np.arange(0, rotated_dims, 2) / rotated_dims)
    cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]
    a_at, b_at = (slice(0, rotated_dims, 2), slice(1, rotated_dims, 2)) if traditional else \
        (slice(0, pairs), slice(pairs, rotated_dims))
    a, b = x[..., a_at].copy(), x[..., b_at].copy()
    x[..., a_at], x[..., b_at] = a * cos - b * sin, b * cos + a * sin
    return x


def _angles(positions, rotated_dims, base=10000.0):
    angles = rope_angles(mx.array(positions, dtype=mx.int32), rotated_dims, base, 1.0)
    return mx.cos(angles), mx.sin(angles)


@pytest.mark.parametrize("traditional, rotated_dims, dtype", [(True, 32, mx.float32), (False, 32, mx.float32),
                                                              (True, 16, mx.float16), (False, 32, mx.bfloat16)])
def test_paged_rows_write_puts_each_rotated_row_at_its_page_and_slot(traditional, rotated_dims, dtype):
    rng = np.random.default_rng(3)
    num_pages, kv_heads, page_size, dim, tokens = 6, 2, 4, 32, 5
    pages = rng.standard_normal((num_pages, kv_heads, page_size, dim)).astype(np.float32)
    rows = rng.standard_normal((1, tokens, kv_heads * dim)).astype(np.float32)
    positions = np.array([0, 7, 130, 3, 41])
    write_pages, write_slots = np.array([5, 0, 2, 2, 6]), np.array([3, 0, 1, 2, 0])  # the last: outside the pool
    cos, sin = _angles(positions, rotated_dims)
    stored = mx.array(pages).astype(dtype)
    out = _native.ext.paged_rows_write(stored, mx.array(rows), mx.array(write_pages, dtype=mx.int32),
                                       mx.array(write_slots, dtype=mx.int32), cos, sin, traditional=traditional)
    plain = _native.ext.paged_rows_write(stored, mx.array(rows), mx.array(write_pages, dtype=mx.int32),
                                         mx.array(write_slots, dtype=mx.int32))
    expected = np.array(stored.astype(mx.float32), np.float64)
    expected_plain = expected.copy()
    rotated = _rotated_oracle(rows[0], positions, rotated_dims, 10000.0, traditional, kv_heads)
    for t, (page, slot) in enumerate(zip(write_pages, write_slots)):
        if page < num_pages:
            expected[page, :, slot] = rotated[t]
            expected_plain[page, :, slot] = rows[0, t].reshape(kv_heads, dim)
    assert out.dtype == dtype and out.shape == pages.shape
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), expected, atol=TOLERANCE[dtype] * 4, rtol=0)
    np.testing.assert_allclose(np.array(plain.astype(mx.float32)), expected_plain, atol=TOLERANCE[dtype] * 4, rtol=0)
    # the input pool is still held here: it is left as it was
    np.testing.assert_array_equal(np.array(stored.astype(mx.float32)), np.array(mx.array(pages).astype(dtype)
                                                                                .astype(mx.float32)))


@pytest.mark.parametrize("traditional", [True, False])
def test_rotated_rows_rotate_each_token_at_its_position(traditional):
    rng = np.random.default_rng(4)
    rows = rng.standard_normal((1, 3, 4 * 16)).astype(np.float32)
    positions = np.array([2, 0, 300])
    cos, sin = _angles(positions, 12, base=500.0)
    out = _native.ext.rotated_rows(mx.array(rows), cos, sin, heads=4, traditional=traditional)
    assert out.shape == (3, 4, 16) and out.dtype == mx.float32
    np.testing.assert_allclose(np.array(out), _rotated_oracle(rows[0], positions, 12, 500.0, traditional, 4),
                               atol=1e-4, rtol=0)


def test_paged_rows_write_updates_a_pool_nothing_else_holds_in_place():
    pages = mx.zeros((1 << 12, 2, 16, 64))
    rows, where = mx.ones((1, 64 * 2)), mx.array([7], dtype=mx.int32)
    mx.eval(pages, rows, where)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    pages = _native.ext.paged_rows_write(pages, rows, where, where)
    mx.eval(pages)
    assert (mx.get_peak_memory() - base) / pages.nbytes < 0.5
    assert pages[7, :, 7].sum().item() == 128 and pages.sum().item() == 128


@pytest.mark.parametrize("name, value", [
    ("pages", mx.zeros((4, 2, 16))),
    ("pages", mx.zeros((4, 2, 4, 16), dtype=mx.int32)),
    ("rows", mx.zeros((2, 2, 32))),
    ("rows", mx.zeros((2, 33))),
    ("write_pages", mx.zeros((3,), dtype=mx.int32)),
    ("write_slots", mx.zeros((2,))),
    ("cos", mx.zeros((2, 9))),
    ("sin", mx.zeros((2, 4))),
])
def test_paged_rows_write_names_a_bad_argument(name, value):
    arguments = dict(pages=mx.zeros((4, 2, 4, 16)), rows=mx.zeros((2, 32)), write_pages=mx.zeros((2,), mx.int32),
                     write_slots=mx.zeros((2,), mx.int32), cos=mx.zeros((2, 8)), sin=mx.zeros((2, 8)))
    arguments[name] = value
    with pytest.raises(ValueError, match=name):
        _native.ext.paged_rows_write(**arguments)
