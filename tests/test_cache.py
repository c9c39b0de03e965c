"""KV caches: incremental decoding equals one full causal pass; persistence;
memory accounting."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mlx_attn
from mlx_attn import ConcatKVCache, KVCache, MultiHeadAttention, RoPE, RotatingKVCache
from mlx_attn.cache import kv_cache_bytes, kv_cache_bytes_per_token, load_cache, save_cache

CACHES = {
    "concat": ConcatKVCache,
    "kv": lambda: KVCache(step=8),
    "rotating": lambda: RotatingKVCache(64, step=8),  # larger than the sequence: within its window
}
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}


def decode(mha, x, cache, chunks):
    """Feed x through the module in the given chunk sizes."""
    outs, start = [], 0
    for size in chunks:
        outs.append(mha(x[:, start : start + size], mask="causal", cache=cache))
        start += size
    assert start == x.shape[1]
    return mx.concatenate(outs, axis=1)


@pytest.mark.parametrize("cache_kind", list(CACHES))
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("backend", ["fused", "reference"])
@pytest.mark.parametrize("chunks", [[1] * 19, [5, 1, 1, 7, 1, 4], [19]], ids=["tokens", "mixed", "one"])
def test_incremental_decoding_equals_full_pass(cache_kind, heads, backend, chunks):
    n_heads, n_kv = HEADS[heads]
    mx.random.seed(1)
    mha = MultiHeadAttention(32, n_heads, n_kv, rope=RoPE(8, base=500.0), backend=backend)
    x = mx.random.normal((2, 19, 32))
    full = mha(x, mask="causal")
    cache = CACHES[cache_kind]()
    incremental = decode(mha, x, cache, chunks)
    assert cache.offset == 19
    np.testing.assert_allclose(np.array(incremental), np.array(full), atol=2e-5)


def windowed_reference_mask(length, max_size, keep):
    """Independent construction: position p sees keys 0..keep-1 and the
    max_size - keep most recent keys up to p."""
    pos = np.arange(length)[:, None]
    key = np.arange(length)[None, :]
    return (key <= pos) & ((key < keep) | (key > pos - (max_size - keep)))


@pytest.mark.parametrize("max_size,keep", [(6, 0), (6, 2), (9, 4), (4, 1)])
@pytest.mark.parametrize("chunks", [[1] * 23, [3, 1, 1, 8, 1, 1, 8], [10, 13], [2, 7, 1, 1, 12]])
@pytest.mark.parametrize("backend", ["fused", "reference"])
def test_rotating_cache_beyond_its_window(max_size, keep, chunks, backend):
    mx.random.seed(2)
    mha = MultiHeadAttention(24, 4, 2, rope=RoPE(6), backend=backend)
    x = mx.random.normal((1, 23, 24))
    expected = mha(x, mask=mx.array(windowed_reference_mask(23, max_size, keep)))
    cache = RotatingKVCache(max_size, keep=keep, step=3)
    got = decode(mha, x, cache, chunks)
    np.testing.assert_allclose(np.array(got), np.array(expected), atol=2e-5)
    # the ring never holds more than the window once decoding one token at a time
    if chunks[-1] == 1:
        assert cache.keys.shape[2] <= max_size


@st.composite
def chunkings(draw, length=17):
    """A random split of `length` tokens into consecutive chunks."""
    sizes, left = [], length
    while left:
        size = draw(st.integers(1, min(left, 6)))
        sizes.append(size)
        left -= size
    return sizes


@settings(max_examples=25, deadline=None)
@given(
    chunks=chunkings(),
    max_size=st.integers(2, 9),
    keep_fraction=st.floats(0.0, 0.99),
    backend=st.sampled_from(["fused", "reference"]),
)
def test_rotating_cache_any_chunking(chunks, max_size, keep_fraction, backend):
    keep = int(keep_fraction * max_size)
    mx.random.seed(4)
    mha = MultiHeadAttention(16, 4, 2, rope=RoPE(4), backend=backend)
    x = mx.random.normal((1, 17, 16))
    expected = mha(x, mask=mx.array(windowed_reference_mask(17, max_size, keep)))
    got = decode(mha, x, RotatingKVCache(max_size, keep=keep, step=2), chunks)
    np.testing.assert_allclose(np.array(got), np.array(expected), atol=2e-5)


@settings(max_examples=15, deadline=None)
@given(chunks=chunkings(), step=st.integers(1, 8))
def test_stepped_cache_any_chunking(chunks, step):
    mx.random.seed(5)
    mha = MultiHeadAttention(16, 4, 1, rope=RoPE(4, traditional=True))
    x = mx.random.normal((2, 17, 16))
    cache = KVCache(step=step)
    got = decode(mha, x, cache, chunks)
    np.testing.assert_allclose(np.array(got), np.array(mha(x, mask="causal")), atol=2e-5)
    assert cache.keys.shape[2] % step == 0 and cache.keys.shape[2] >= 17


def test_kv_cache_slices_take_the_fused_path():
    """The prefix views a KVCache returns are handed to the fused kernel as
    they are (no fallback to the reference path)."""
    cache = KVCache(step=16)
    for length in (5, 1, 1):
        k = mx.random.normal((1, 2, length, 8))
        keys, values = cache.update_and_fetch(k, k)
    assert cache.keys.shape[2] == 16 and keys.shape[2] == 7
    q = mx.random.normal((1, 4, 1, 8))
    assert mlx_attn.attention_path(q, keys, values, scale=0.35, mask="causal") == "fused-cpu"
    dense = mx.array(np.array(keys))
    np.testing.assert_allclose(
        np.array(mlx_attn.scaled_dot_product_attention(q, keys, values, scale=0.35, mask="causal")),
        np.array(mlx_attn.scaled_dot_product_attention(q, dense, dense, scale=0.35, mask="causal", backend="reference")),
        atol=1e-5,
    )


def test_kv_cache_returns_views_and_grows_in_steps():
    cache = KVCache(step=4)
    k = mx.ones((1, 2, 3, 8))
    keys, _ = cache.update_and_fetch(k, k)
    assert keys.shape == (1, 2, 3, 8) and cache.keys.shape[2] == 4
    keys, _ = cache.update_and_fetch(k, k)
    assert keys.shape == (1, 2, 6, 8) and cache.keys.shape[2] == 8
    assert cache.nbytes == 2 * 8 * 2 * 8 * 4
    assert cache.trim(2) == 2 and cache.offset == 4
    assert cache.state[0].shape == (1, 2, 4, 8)
    keys, _ = cache.update_and_fetch(2 * k[:, :, :1], 2 * k[:, :, :1])
    assert keys.shape[2] == 5 and float(keys[0, 0, 4, 0]) == 2.0  # overwrote the trimmed slot


def test_rotating_cache_trim_only_before_it_wraps():
    cache = RotatingKVCache(4)
    one = mx.ones((1, 1, 1, 2))
    for _ in range(3):
        cache.update_and_fetch(one, one)
    assert cache.is_trimmable() and cache.trim(1) == 1 and cache.offset == 2
    for _ in range(4):
        cache.update_and_fetch(one, one)
    assert not cache.is_trimmable() and cache.trim(1) == 0


@pytest.mark.parametrize("kind", ["concat", "kv", "rotating"])
def test_save_and_load_round_trip_continues_decoding(tmp_path, kind):
    mx.random.seed(3)
    mha = MultiHeadAttention(16, 4, 2, rope=RoPE(4))
    x = mx.random.normal((1, 12, 16))
    make = {"concat": ConcatKVCache, "kv": lambda: KVCache(4), "rotating": lambda: RotatingKVCache(6, keep=1, step=2)}[kind]
    caches = [make(), make()]
    for t in range(8):  # two "layers" share the module for the test
        for c in caches:
            mha(x[:, t : t + 1], mask="causal", cache=c)
    path = tmp_path / "prompt.safetensors"
    save_cache(path, caches, metadata={"model": "tiny"})
    loaded, meta = load_cache(path, n_layers=2, n_kv_heads=2, head_dim=4)
    assert meta["model"] == "tiny"
    assert [type(c) for c in loaded] == [type(c) for c in caches]
    assert all(c.offset == 8 for c in loaded)
    for t in range(8, 12):
        a = mha(x[:, t : t + 1], mask="causal", cache=caches[0])
        b = mha(x[:, t : t + 1], mask="causal", cache=loaded[0])
        np.testing.assert_array_equal(np.array(a), np.array(b))


def test_load_cache_rejects_mismatches_and_bad_files(tmp_path):
    cache = KVCache()
    k = mx.zeros((1, 2, 3, 8))
    cache.update_and_fetch(k, k)
    path = tmp_path / "c.safetensors"
    save_cache(path, [cache])
    with pytest.raises(ValueError, match="n_kv_heads=2"):
        load_cache(path, n_kv_heads=4)
    with pytest.raises(ValueError, match="head_dim=8"):
        load_cache(path, head_dim=64)
    with pytest.raises(ValueError, match="1 layers"):
        load_cache(path, n_layers=30)
    with pytest.raises(ValueError, match="batch=1"):
        load_cache(path, {"batch": 4})
    with pytest.raises(ValueError, match="n_kv_heads=2"):
        load_cache(path, {"n_layers": 1, "n_kv_heads": 3})
    with pytest.raises(ValueError, match="unknown key 'layers'"):
        load_cache(path, {"layers": 1})
    with pytest.raises(ValueError, match="contradicts"):
        load_cache(path, {"head_dim": 8}, head_dim=16)
    loaded, _ = load_cache(path, {"n_layers": 1, "n_kv_heads": 2, "head_dim": 8, "batch": 1})
    assert loaded[0].offset == 3 and loaded[0].state[0].shape == (1, 2, 3, 8)
    with pytest.raises(FileNotFoundError):
        load_cache(tmp_path / "missing.safetensors")
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(path.read_bytes()[:40])
    with pytest.raises(ValueError, match="not a readable"):
        load_cache(broken)


def test_update_shape_errors():
    cache = KVCache()
    cache.update_and_fetch(mx.zeros((1, 2, 3, 8)), mx.zeros((1, 2, 3, 8)))
    with pytest.raises(ValueError, match="do not match"):
        cache.update_and_fetch(mx.zeros((1, 4, 1, 8)), mx.zeros((1, 4, 1, 8)))
    with pytest.raises(ValueError, match="disagree"):
        cache.update_and_fetch(mx.zeros((1, 2, 1, 8)), mx.zeros((1, 2, 2, 8)))
    with pytest.raises(ValueError, match="keep"):
        RotatingKVCache(4, keep=4)


def test_memory_calculator_formula():
    # SmolLM2-135M: 30 layers, 3 KV heads of 64, fp16 -> 2*30*3*64*2 bytes per token
    assert kv_cache_bytes_per_token(30, 3, 64, mx.float16) == 23040
    assert kv_cache_bytes(30, 3, 64, 2048, mx.float16) == 23040 * 2048
    mha = kv_cache_bytes(32, 32, 128, 4096, mx.float16)
    gqa = kv_cache_bytes(32, 8, 128, 4096, mx.float16)
    mqa = kv_cache_bytes(32, 1, 128, 4096, mx.float16)
    assert mha == 2 * 2**30 and mha // gqa == 4 and mha // mqa == 32
    assert kv_cache_bytes(1, 1, 1, 1, mx.float32, batch=3) == 24
    with pytest.raises(ValueError):
        kv_cache_bytes(0, 1, 1, 1)
    # the formula agrees with what a real cache allocates
    cache = KVCache(step=16)
    k = mx.zeros((1, 3, 16, 64), dtype=mx.float16)
    cache.update_and_fetch(k, k)
    assert cache.nbytes == kv_cache_bytes(1, 3, 64, 16, mx.float16)
