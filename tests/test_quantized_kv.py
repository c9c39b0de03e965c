"""Quantized KV cache and attention over quantized keys and values.

Ground truths: an independent NumPy unpacking of the ``mx.quantize`` format
and a NumPy softmax attention; dequantize-then-``scaled_dot_product_attention``;
the float caches.
"""

import math

import mlx.core as mx
import numpy as np
import pytest

import mlx_attn
from mlx_attn import ConcatKVCache, KVCache, QuantizedKVCache, RotatingKVCache
from mlx_attn.cache import kv_cache_bytes, kv_cache_bytes_per_token, load_cache, save_cache
from mlx_attn.quantized import quantize

qsdpa = mlx_attn.quantized_scaled_dot_product_attention


# ------------------------------------------------------------ NumPy ground truth
def numpy_dequantize(triple, group_size: int, bits: int) -> np.ndarray:
    """Unpack ``mx.quantize``'s layout by hand: element i of a uint32 word
    sits at bit (i % per_word) * bits; one scale and bias per group."""
    packed, scales, biases = (np.array(a.astype(mx.float32) if a.dtype != mx.uint32 else a) for a in triple)
    per_word = 32 // bits
    shifts = (np.arange(per_word, dtype=np.uint64) * bits)
    words = packed.astype(np.uint64)[..., None]
    codes = ((words >> shifts) & ((1 << bits) - 1)).reshape(*packed.shape[:-1], packed.shape[-1] * per_word)
    scale = np.repeat(scales, group_size, axis=-1)
    bias = np.repeat(biases, group_size, axis=-1)
    return codes.astype(np.float64) * scale + bias


def numpy_attention(q, k, v, scale, visible=None, sinks=None):
    """Softmax attention in float64 with GQA by head index; ``visible`` is a
    boolean [Tq, Tkv] or [B, Hq, Tq, Tkv]."""
    b, hq, tq, _ = q.shape
    hkv = k.shape[1]
    k = np.repeat(k, hq // hkv, axis=1)
    v = np.repeat(v, hq // hkv, axis=1)
    scores = np.einsum("bhqd,bhkd->bhqk", q, k) * scale
    if visible is not None:
        scores = np.where(visible, scores, -np.inf)
    row_max = scores.max(-1, keepdims=True)
    if sinks is not None:
        row_max = np.maximum(row_max, sinks.reshape(1, hq, 1, 1))
    weights = np.exp(scores - row_max)
    total = weights.sum(-1, keepdims=True)
    if sinks is not None:
        total = total + np.exp(sinks.reshape(1, hq, 1, 1) - row_max)
    return np.einsum("bhqk,bhkd->bhqd", weights / total, v)


def lower_right_causal(tq, tkv, window=None):
    i = np.arange(tq)[:, None] + tkv - tq
    j = np.arange(tkv)[None, :]
    visible = j <= i
    if window is not None:
        visible &= j > i - window
    return visible


def make_kv(seed, b=1, hkv=2, t=33, d=64, dv=None, dtype=mx.float16):
    mx.random.seed(seed)
    k = mx.random.normal((b, hkv, t, d)).astype(dtype)
    v = mx.random.normal((b, hkv, t, dv or d)).astype(dtype)
    return k, v


# ------------------------------------------------------------ format
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_numpy_unpacking_matches_mx_dequantize(bits, group_size):
    k, _ = make_kv(0, t=5, d=128)
    triple = quantize(k, group_size, bits)
    assert triple[0].dtype == mx.uint32 and triple[0].shape[-1] == 128 * bits // 32
    np.testing.assert_allclose(
        numpy_dequantize(triple, group_size, bits),
        np.array(mlx_attn.quantized.dequantize(triple, group_size, bits).astype(mx.float32)),
        rtol=1e-3, atol=1e-3,
    )
    # every element within one step of its group's (max - min) / (2^bits - 1) grid
    x = np.array(k.astype(mx.float32)).reshape(1, 2, 5, -1, group_size)
    step = (x.max(-1) - x.min(-1)) / (2**bits - 1)
    err = np.abs(numpy_dequantize(triple, group_size, bits).reshape(x.shape) - x)
    assert np.all(err <= step[..., None] + 0.01)


# ------------------------------------------------------------ attention vs truths
CASES = {
    "decode-gqa": dict(hq=6, hkv=2, tq=1, mask=None),
    "prefill-causal": dict(hq=4, hkv=4, tq=33, mask="causal"),
    "chunk-causal-mqa": dict(hq=4, hkv=1, tq=7, mask="causal"),
    "window-sinks": dict(hq=4, hkv=2, tq=9, mask="causal", window=5, sinks=True),
    "bool-mask": dict(hq=4, hkv=2, tq=3, mask="bool"),
}


def case_inputs(name, bits, group_size, d=64, dtype=mx.float16):
    c = CASES[name]
    k, v = make_kv(hash(name) % 1000, hkv=c["hkv"], d=d, dtype=dtype)
    q = mx.random.normal((1, c["hq"], c["tq"], d)).astype(dtype)
    mask = c["mask"]
    if mask == "bool":
        mask = mx.random.bernoulli(0.7, (1, c["hq"], c["tq"], k.shape[2]))
    sinks = mx.random.normal((c["hq"],)).astype(dtype) if c.get("sinks") else None
    return q, quantize(k, group_size, bits), quantize(v, group_size, bits), mask, sinks, c.get("window")


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64])
@pytest.mark.parametrize("case", list(CASES))
def test_reference_path_matches_numpy(case, bits, group_size):
    q, kq, vq, mask, sinks, window = case_inputs(case, bits, group_size)
    scale = 1 / math.sqrt(q.shape[-1])
    out = qsdpa(q, kq, vq, scale=scale, mask=mask, group_size=group_size, bits=bits, sinks=sinks,
                window_size=window, backend="reference")
    assert out.dtype == mx.float16 and out.shape == (*q.shape[:3], 64)
    tq, tkv = q.shape[2], kq[0].shape[2]
    if isinstance(mask, mx.array):
        visible = np.array(mask)
    elif mask == "causal":
        visible = lower_right_causal(tq, tkv, window)
    else:
        visible = None
    expected = numpy_attention(
        np.array(q.astype(mx.float32)), numpy_dequantize(kq, group_size, bits), numpy_dequantize(vq, group_size, bits),
        scale, visible, None if sinks is None else np.array(sinks.astype(mx.float32)),
    )
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), expected, atol=5e-3, rtol=5e-3)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("case", list(CASES))
def test_reference_path_matches_dequantize_then_sdpa(case, bits, group_size):
    q, kq, vq, mask, sinks, window = case_inputs(case, bits, group_size, d=128, dtype=mx.float32)
    k = mlx_attn.quantized.dequantize(kq, group_size, bits)
    v = mlx_attn.quantized.dequantize(vq, group_size, bits)
    kwargs = dict(scale=0.1, mask=mask, sinks=sinks, window_size=window)
    out = qsdpa(q, kq, vq, group_size=group_size, bits=bits, backend="reference", **kwargs)
    np.testing.assert_allclose(
        np.array(out), np.array(mlx_attn.scaled_dot_product_attention(q, k, v, **kwargs)), atol=2e-5, rtol=2e-5
    )


def test_quantized_attention_is_close_to_float_attention():
    """The quantization error reaching the output is small: 8 bits well
    under 4 bits, both bounded."""
    q, k, v = (mx.random.normal((1, 4, 16, 64), key=mx.random.key(i)) for i in range(3))
    exact = np.array(mlx_attn.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal"))
    errors = {}
    for bits in (4, 8):
        out = qsdpa(q, quantize(k, 64, bits), quantize(v, 64, bits), scale=0.125, mask="causal", bits=bits)
        errors[bits] = np.abs(np.array(out) - exact).max()
    assert errors[8] < 0.02 and errors[4] < 0.3 and errors[8] < errors[4] / 4


def test_value_dim_differs_from_head_dim_and_output_dtype_promotes():
    k, _ = make_kv(3, d=64, dtype=mx.float16)
    _, v = make_kv(4, d=64, dv=128, dtype=mx.float16)
    q = mx.random.normal((1, 2, 2, 64))  # float32 queries promote the float16 scales
    out = qsdpa(q, quantize(k), quantize(v), scale=0.125)
    assert out.shape == (1, 2, 2, 128) and out.dtype == mx.float32


def test_empty_key_sequence_gives_zeros():
    k, v = make_kv(5, t=0)
    out = qsdpa(mx.ones((1, 2, 3, 64)), quantize(k), quantize(v), scale=1.0)
    assert out.shape == (1, 2, 3, 64) and not np.any(np.array(out))


def test_path_is_observable():
    k, v = make_kv(6)
    q = mx.ones((1, 2, 1, 64))
    assert mlx_attn.quantized_attention_path(q, quantize(k), quantize(v), backend="reference") == "reference"


# ------------------------------------------------------------ hostile inputs
def _good():
    k, v = make_kv(7, t=8)
    return mx.ones((1, 4, 2, 64), dtype=mx.float16), quantize(k), quantize(v)


def _replace(triple, index, value):
    parts = list(triple)
    parts[index] = value
    return tuple(parts)


HOSTILE = {
    "bits 3": (lambda q, k, v: dict(bits=3), "bits must be one of"),
    "bits str": (lambda q, k, v: dict(bits="8"), "bits must be an integer"),
    "bits bool": (lambda q, k, v: dict(bits=True), "bits must be an integer"),
    "group 16": (lambda q, k, v: dict(group_size=16), "group_size must be one of"),
    "group 256": (lambda q, k, v: dict(group_size=256), "group_size must be one of"),
    "group wrong for triple": (lambda q, k, v: dict(group_size=32), "does not match group_size=32"),
    "bits wrong for triple": (lambda q, k, v: dict(bits=4), "does not match group_size=64, bits=4"),
    "k not a triple": (lambda q, k, v: dict(k_quant=k[:2]), "k_quant must be a \\(packed, scales, biases\\) triple"),
    "k an array": (lambda q, k, v: dict(k_quant=k[0]), "k_quant must be a \\(packed, scales, biases\\) triple"),
    "packed float": (lambda q, k, v: dict(k_quant=_replace(k, 0, k[0].astype(mx.float32))), "packed must be uint32"),
    "scales int": (lambda q, k, v: dict(v_quant=_replace(v, 1, v[1].astype(mx.int32))), "share one float dtype"),
    "biases other dtype": (lambda q, k, v: dict(v_quant=_replace(v, 2, v[2].astype(mx.float32))), "share one float dtype"),
    "scales wrong groups": (lambda q, k, v: dict(k_quant=_replace(k, 1, mx.concatenate([k[1], k[1]], -1))), "disagree"),
    "scales wrong length": (lambda q, k, v: dict(k_quant=_replace(k, 1, k[1][:, :, :3])), "disagree"),
    "packed rank 3": (lambda q, k, v: dict(k_quant=_replace(k, 0, k[0][0])), "must have rank 4"),
    "part not array": (lambda q, k, v: dict(k_quant=_replace(k, 2, np.array(k[2]))), "biases must be an mlx.core.array"),
    "k v lengths differ": (lambda q, k, v: dict(v_quant=tuple(a[:, :, :5] for a in v)), "disagree on \\[batch, heads, length\\]"),
    "k v scale dtypes differ": (lambda q, k, v: dict(v_quant=(v[0], v[1].astype(mx.float32), v[2].astype(mx.float32))), "scales need one dtype"),
    "q not array": (lambda q, k, v: dict(q=np.ones((1, 4, 2, 64))), "q must be an mlx.core.array"),
    "q int": (lambda q, k, v: dict(q=mx.ones((1, 4, 2, 64), dtype=mx.int32)), "q has dtype"),
    "gqa not divisible": (lambda q, k, v: dict(q=mx.ones((1, 3, 2, 64), dtype=mx.float16)), "multiple of"),
    "mask shape": (lambda q, k, v: dict(mask=mx.ones((2, 5), dtype=mx.bool_)), "does not broadcast"),
    "mask string": (lambda q, k, v: dict(mask="upper"), "mask must be None, 'causal'"),
    "sinks shape": (lambda q, k, v: dict(sinks=mx.zeros((3,))), "sinks must have shape"),
    "window zero": (lambda q, k, v: dict(window_size=0), "window_size must be a positive integer"),
    "scale nan": (lambda q, k, v: dict(scale=float("nan")), "scale must be finite"),
    "backend": (lambda q, k, v: dict(backend="fast"), "backend must be"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_inputs_raise_clear_errors(name):
    q, k, v = _good()
    change, message = HOSTILE[name]
    args = dict(q=q, k_quant=k, v_quant=v, scale=0.125)
    args.update(change(q, k, v))
    with pytest.raises(ValueError, match=message):
        qsdpa(args.pop("q"), args.pop("k_quant"), args.pop("v_quant"), **args)


def test_fused_backend_refused_with_reason_when_the_kernel_does_not_apply():
    """Head dims over the fused CPU kernel's limit take the reference path;
    backend='fused' says why it cannot."""
    k, v = make_kv(7, t=4, d=1152)  # past 1..1024
    q = mx.ones((1, 2, 1, 1152), dtype=mx.float16)
    kq, vq = quantize(k, 128), quantize(v, 128)
    assert mlx_attn.quantized_attention_path(q, kq, vq, group_size=128) == "reference"
    with pytest.raises(ValueError, match="backend='fused' is not possible here: .*head dims"):
        qsdpa(q, kq, vq, scale=1.0, group_size=128, backend="fused")


# ------------------------------------------------------------ the cache
def feed(cache, k, v, chunks):
    start = 0
    for size in chunks:
        out = cache.update_and_fetch(k[:, :, start : start + size], v[:, :, start : start + size])
        start += size
    return out


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_incremental_updates_equal_one_full_update(bits, group_size):
    k, v = make_kv(8, b=2, t=21, d=128)
    whole = QuantizedKVCache(group_size, bits, step=8)
    pieces = QuantizedKVCache(group_size, bits, step=8)
    full = feed(whole, k, v, [21])
    incremental = feed(pieces, k, v, [1, 5, 1, 1, 9, 4])
    for a, b, direct in zip(full[0] + full[1], incremental[0] + incremental[1], quantize(k, group_size, bits) + quantize(v, group_size, bits)):
        assert a.shape == b.shape == direct.shape
        assert mx.array_equal(a, b) and mx.array_equal(a, direct)
    assert pieces.offset == 21 and pieces.keys[0].shape[2] == 24  # three steps of 8


def test_decoding_with_the_cache_matches_dequantized_full_pass():
    """Token-by-token attention over the cache's triples equals one causal
    pass over the dequantized whole (quantization is per token)."""
    k, v = make_kv(9, hkv=2, t=12, d=64, dtype=mx.float32)
    q = mx.random.normal((1, 4, 12, 64))
    cache = QuantizedKVCache(64, 8, step=4)
    outs = []
    for t in range(12):
        kq, vq = cache.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
        outs.append(qsdpa(q[:, :, t : t + 1], kq, vq, scale=0.125, mask=cache.make_mask(1)))
    deq = [mlx_attn.quantized.dequantize(quantize(x), 64, 8) for x in (k, v)]
    full = mlx_attn.scaled_dot_product_attention(q, *deq, scale=0.125, mask="causal")
    np.testing.assert_allclose(np.array(mx.concatenate(outs, axis=2)), np.array(full), atol=1e-5)


def test_trim_then_update_overwrites():
    k, v = make_kv(10, t=10)
    cache = QuantizedKVCache(step=4)
    feed(cache, k, v, [6])
    assert cache.trim(2) == 2 and cache.offset == 4
    kq, _ = cache.update_and_fetch(k[:, :, 6:], v[:, :, 6:])
    expected = quantize(mx.concatenate([k[:, :, :4], k[:, :, 6:]], axis=2))
    assert all(mx.array_equal(a, b) for a, b in zip(kq, expected))
    assert cache.trim(100) == 8 and cache.offset == 0 and cache.is_trimmable()


@pytest.mark.parametrize("source", [lambda: KVCache(step=8), ConcatKVCache])
def test_to_quantized_from_float_caches(source):
    k, v = make_kv(11, t=9)
    cache = source()
    feed(cache, k, v, [4, 5])
    q_cache = cache.to_quantized(group_size=32, bits=4)
    assert isinstance(q_cache, QuantizedKVCache) and q_cache.offset == 9
    assert (q_cache.group_size, q_cache.bits) == (32, 4)
    assert all(mx.array_equal(a, b) for a, b in zip(q_cache.state[0], quantize(k, 32, 4)))
    assert cache.offset == 9 and mx.array_equal(cache.state[0], k)  # the source is untouched
    assert source().to_quantized().offset == 0


def test_rotating_cache_refuses_conversion():
    with pytest.raises(ValueError, match="RotatingKVCache cannot be converted"):
        RotatingKVCache(8).to_quantized()


@pytest.mark.parametrize("bits", [4, 8])
def test_save_load_round_trip(tmp_path, bits):
    k, v = make_kv(12, b=1, hkv=3, t=13, d=64)
    layers = [QuantizedKVCache(32, bits, step=8), QuantizedKVCache(64, bits), KVCache()]
    feed(layers[0], k, v, [5, 8])
    feed(layers[1], k, v, [13])
    layers[1].trim(3)
    feed(layers[2], k, v, [13])
    save_cache(tmp_path / "c", layers, {"note": "x"})
    loaded, meta = load_cache(tmp_path / "c", n_layers=3, n_kv_heads=3, head_dim=64, batch=1)
    assert meta == {"note": "x"}
    for before, after in zip(layers, loaded):
        assert type(before) is type(after) and before.meta_state == after.meta_state
        flat_before, flat_after = before._state_tensors(), after._state_tensors()
        assert len(flat_before) == len(flat_after)
        assert all(mx.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(flat_before, flat_after))
    # decoding continues identically
    extra_k, extra_v = make_kv(13, hkv=3, t=1, d=64)
    for a, b in zip(layers[:2], loaded[:2]):
        x, y = a.update_and_fetch(extra_k, extra_v), b.update_and_fetch(extra_k, extra_v)
        assert all(mx.array_equal(p, r) for p, r in zip(x[0] + x[1], y[0] + y[1]))
    with pytest.raises(ValueError, match="head_dim=64"):
        load_cache(tmp_path / "c", head_dim=128)


def test_load_refuses_mixed_up_quantized_tensors(tmp_path):
    k, v = make_kv(14, t=3)
    cache = QuantizedKVCache()
    cache.update_and_fetch(k, v)
    save_cache(tmp_path / "q", [cache])
    arrays = dict(mx.load(str(tmp_path / "q.safetensors")))
    meta = mx.load(str(tmp_path / "q.safetensors"), return_metadata=True)[1]
    # a float cache's description over quantized tensors
    described = meta["mlx_attn.caches"].replace('"QuantizedKVCache"', '"KVCache"').replace(
        ', "group_size": 64, "bits": 8', "")
    mx.save_safetensors(str(tmp_path / "bad1.safetensors"), arrays, metadata={"mlx_attn.caches": described})
    with pytest.raises(ValueError, match="a KVCache does not store keys.packed"):
        load_cache(tmp_path / "bad1")
    # one part missing
    del arrays["0.values.biases"]
    mx.save_safetensors(str(tmp_path / "bad2.safetensors"), arrays, metadata=meta)
    with pytest.raises(ValueError, match="stored without values.biases"):
        load_cache(tmp_path / "bad2")
    # meta_state bits contradict the stored tensors' shapes
    arrays = dict(mx.load(str(tmp_path / "q.safetensors")))
    bad = meta["mlx_attn.caches"].replace('"bits": 8', '"bits": 4')
    mx.save_safetensors(str(tmp_path / "bad3.safetensors"), arrays, metadata={"mlx_attn.caches": bad})
    with pytest.raises(ValueError, match="layer 0 of .*bad3"):
        load_cache(tmp_path / "bad3")


def test_cache_rejects_bad_updates_and_states():
    k, v = make_kv(15, t=4, d=64)
    cache = QuantizedKVCache(64, 8)
    with pytest.raises(ValueError, match="multiple of group_size=64"):
        cache.update_and_fetch(k[..., :48], v[..., :48])
    with pytest.raises(ValueError, match="value_dim 32 must be a positive multiple"):
        cache.update_and_fetch(k, v[..., :32])
    with pytest.raises(ValueError, match="floating point"):
        cache.update_and_fetch(k.astype(mx.int32), v.astype(mx.int32))
    assert cache.offset == 0 and cache.keys is None  # unchanged by refused updates
    cache.update_and_fetch(k, v)
    for bad, message in [
        ((k.astype(mx.float32), v.astype(mx.float32)), "dtype"),
        ((k[:, :1], v[:, :1]), "n_kv_heads"),
        ((mx.concatenate([k, k], -1), mx.concatenate([v, v], -1)), "head_dim"),
        ((k[:, :, :0], v[:, :, :0]), "at least one token"),
    ]:
        with pytest.raises(ValueError, match=message):
            cache.update_and_fetch(*bad)
    assert cache.offset == 4
    with pytest.raises(ValueError, match="state must be a"):
        cache.state = (k, v, k)
    with pytest.raises(ValueError, match="state keys must be a \\(packed, scales, biases\\) triple"):
        cache.state = (k, v)
    with pytest.raises(ValueError, match="packed must be uint32"):
        cache.state = ((k, k, k), (v, v, v))
    with pytest.raises(ValueError, match="does not match group_size=64, bits=8"):
        cache.state = (quantize(k, 32, 8), quantize(v, 32, 8))
    with pytest.raises(ValueError, match="contradict the stored tensors"):
        cache.meta_state = {"offset": 4, "step": 256, "group_size": 32, "bits": 8}
    with pytest.raises(ValueError, match="contradicts the 4 stored tokens"):
        cache.meta_state = {"offset": 5, "step": 256, "group_size": 64, "bits": 8}
    for bad in [dict(group_size=48), dict(bits=2), dict(step=0), dict(bits=8.0)]:
        with pytest.raises(ValueError):
            QuantizedKVCache(**bad)
    assert cache.offset == 4 and cache.meta_state["bits"] == 8


# ------------------------------------------------------------ memory
def test_memory_accounting_matches_hand_counts():
    # D=128, fp16 scales, group 64: 8 bits = 128 + 2 groups x 2 x 2 bytes = 136 bytes/vector; 4 bits = 64 + 8 = 72
    assert kv_cache_bytes_per_token(1, 1, 128, mx.float16, bits=8) == 2 * 136
    assert kv_cache_bytes_per_token(1, 1, 128, mx.float16, bits=4) == 2 * 72
    assert kv_cache_bytes_per_token(1, 1, 128, mx.float16) == 2 * 256
    for d in (64, 128):
        float_bytes = kv_cache_bytes(32, 8, d, 4096, mx.float16)
        assert kv_cache_bytes(32, 8, d, 4096, mx.float16, bits=8) <= 0.55 * float_bytes
        assert kv_cache_bytes(32, 8, d, 4096, mx.float16, bits=4) <= 0.30 * float_bytes
    k, v = make_kv(16, b=2, hkv=3, t=16, d=128)
    cache = QuantizedKVCache(64, 4, step=16)
    cache.update_and_fetch(k, v)
    assert cache.nbytes == kv_cache_bytes(1, 3, 128, 16, mx.float16, batch=2, bits=4)
    with pytest.raises(ValueError, match="head_dim 96 must be a positive multiple of group_size=64"):
        kv_cache_bytes(1, 1, 96, 1, bits=8)
    with pytest.raises(ValueError, match="bits must be one of"):
        kv_cache_bytes(1, 1, 64, 1, bits=16)


# ------------------------------------------------------------ modules and the model
@pytest.mark.parametrize("bits, tolerance", [(8, 0.02), (4, 0.2)])
def test_multi_head_attention_decodes_over_a_quantized_cache(bits, tolerance):
    """Chunked prefill then token-by-token decoding over a quantized cache
    stays within the quantization error of one float causal pass."""
    mx.random.seed(2)
    mha = mlx_attn.MultiHeadAttention(128, 4, 2, rope=mlx_attn.RoPE(32))
    x = mx.random.normal((1, 20, 128))
    full = mha(x, mask="causal")
    cache = QuantizedKVCache(32, bits, step=4)
    outs = [mha(x[:, :7], mask="causal", cache=cache)]
    outs += [mha(x[:, t : t + 1], mask="causal", cache=cache) for t in range(7, 20)]
    error = np.abs(np.array(mx.concatenate(outs, axis=1) - full)).max()
    assert 0 < error < tolerance
    _, weights = mha(x[:, :1], mask="causal", cache=cache, return_weights=True)
    assert weights.shape == (1, 4, 1, 21)
    np.testing.assert_allclose(np.array(weights.sum(-1)), 1.0, rtol=1e-5)



def _smollm2_prompts():
    import json
    from pathlib import Path

    data = json.loads((Path(__file__).parent / "fixtures" / "smollm2.json").read_text())
    return [p for p in data["prompts"] if "greedy_ids" in p]


def _greedy(model, prompt, caches, steps):
    """Greedy token ids, the logits of the first step and each step's gap
    between the two largest logits."""
    logits = model(mx.array(prompt)[None], cache=caches)[:, -1]
    first, tokens, gaps = logits, [], []
    for _ in range(steps):
        top2 = np.sort(np.array(logits[0].astype(mx.float32)))[-2:]
        gaps.append(float(top2[1] - top2[0]))
        tokens.append(int(mx.argmax(logits, axis=-1).item()))
        logits = model(mx.array([[tokens[-1]]]), cache=caches)[:, -1]
    return tokens, first, gaps


# 4-bit keys and values shift SmolLM2-135M's logits by several units (measured
# max |diff| of the first-step logits 4.5 and 7.6 on the two fixture prompts,
# with logits up to ~28): its greedy continuation keeps the first token only.
FOUR_BIT_LOGIT_TOLERANCE = 10.0
# A step whose two best float logits are closer than this is a near tie that
# quantization error may flip (measured: 8 bits, group 64 flips one with gap
# 0.07 at step 25 of the second prompt; group 32 flips none).
NEAR_TIE = 0.1


def test_smollm2_greedy_tokens_with_quantized_caches():
    from model_fixtures import smollm2

    model, _ = smollm2()
    layers = len(model.layers)
    for entry in _smollm2_prompts():
        steps = len(entry["greedy_ids"])
        expected, float_logits, gaps = _greedy(model, entry["ids"], [KVCache() for _ in range(layers)], steps)
        assert expected == entry["greedy_ids"]  # the float cache reproduces transformers
        tokens, _, _ = _greedy(model, entry["ids"], [QuantizedKVCache(32, 8) for _ in range(layers)], steps)
        assert tokens == expected
        tokens, _, _ = _greedy(model, entry["ids"], [QuantizedKVCache(64, 8) for _ in range(layers)], steps)
        first_difference = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), None)
        assert first_difference is None or gaps[first_difference] < NEAR_TIE
        four_bit, logits, _ = _greedy(model, entry["ids"], [QuantizedKVCache(64, 4) for _ in range(layers)], 1)
        assert four_bit == expected[:1]
        assert np.abs(np.array(logits - float_logits)).max() < FOUR_BIT_LOGIT_TOLERANCE


def test_kv_cache_memory_example_reports_quantized_caches(tmp_path, capsys):
    from test_examples import load

    load("kv_cache_memory").main(["--out", str(tmp_path / "kv.png")])
    printed = capsys.readouterr().out
    # Llama-3-8B, 8 KV heads x 128 dims x 32 layers: 8 bits = (128 + 2 x 2 x 2) x 2 x 8 x 32 bytes = 68 KiB per token
    assert "| Llama-3-8B | 8-bit, group 64 | 68.0 KiB | 0.531x | 136.0 MiB |" in printed
    assert "| Llama-3-8B | 4-bit, group 64 | 36.0 KiB | 0.281x |" in printed
    assert (tmp_path / "kv.png").stat().st_size > 10_000


def _bench():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_quantized_kv.py"
    spec = importlib.util.spec_from_file_location("bench_quantized_kv", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("bits", [4, 8])
def test_benchmark_unfused_formula_computes_attention(bits):
    """The re-implemented mlx-lm formula is a correct baseline."""
    q = mx.random.normal((1, 12, 1, 64), key=mx.random.key(1))
    kq, vq = (quantize(mx.random.normal((1, 4, 100, 64), key=mx.random.key(i)), 64, bits) for i in (2, 3))
    got = _bench().unfused_quantized_attention(q, kq, vq, scale=0.125, group_size=64, bits=bits)
    expected = qsdpa(q, kq, vq, scale=0.125, bits=bits, backend="reference")
    np.testing.assert_allclose(np.array(got), np.array(expected), atol=1e-5)


def test_benchmark_quick_run(tmp_path):
    import json

    result = _bench().main(["--quick", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "bench_quantized_kv.json").read_text())
    assert len(saved["rows"]) == len(result["rows"]) == 2
    for row in saved["rows"]:
        for method in ("quantized 8-bit", "quantized 4-bit", "float16 fused", "mlx-lm unfused 8-bit"):
            assert row[method]["ms"] > 0
        assert row["quantized 8-bit"]["kv_bytes"] <= 0.55 * row["float16 fused"]["kv_bytes"]
        assert row["quantized 4-bit"]["kv_bytes"] <= 0.30 * row["float16 fused"]["kv_bytes"]
    assert (tmp_path / "bench_quantized_kv.png").stat().st_size > 10_000


# ------------------------------------------------------------ generation and the CLI
def test_generation_config_checks_the_kv_options():
    from mlx_attn.lm.generate import GenerationConfig

    for bad, message in [(dict(kv_bits=3), "bits must be one of"), (dict(kv_bits=8, kv_group_size=48), "group_size"),
                         (dict(quantized_kv_start=-1), "quantized_kv_start")]:
        with pytest.raises(ValueError, match=message):
            GenerationConfig(**bad)


@pytest.mark.parametrize("start, quantized", [(6, True), (0, True), (100, False)])
def test_generation_switches_to_a_quantized_cache_at_the_start_offset(start, quantized):
    from mlx_attn.lm.generate import GenerationConfig, generate_tokens
    from model_fixtures import tiny_llama

    model = tiny_llama(hidden_size=128, head_dim=32)  # one group of 32 features per head
    config = GenerationConfig(max_tokens=4, stop_at_eos=False, prefill_chunk=4, kv_bits=8, kv_group_size=32,
                              quantized_kv_start=start)
    cache = model.make_cache()
    tokens = list(generate_tokens(model, list(range(1, 10)), config, cache=cache))
    assert len(tokens) == 4
    assert all(isinstance(c, QuantizedKVCache) == quantized for c in cache)
    assert all(c.offset == 9 + 3 for c in cache)
    if quantized:
        assert all((c.bits, c.group_size) == (8, 32) for c in cache)


def test_cli_generates_the_same_text_with_an_8_bit_cache(capsys):
    from mlx_attn.lm.cli import main

    prompt = _smollm2_prompts()[0]["prompt"]
    outputs = []
    for extra in ([], ["--kv-bits", "8", "--kv-group-size", "64"], ["--kv-bits", "8", "--quantized-kv-start", "3"]):
        assert main(["generate", "--max-tokens", "12", "--quiet", "--ignore-chat-template", *extra, prompt]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0].startswith(prompt) and len(outputs[0]) > len(prompt)
    assert outputs[1] == outputs[0] and outputs[2] == outputs[0]
    assert main(["generate", "--kv-bits", "3", prompt]) == 2
    assert "--kv-bits" in capsys.readouterr().err


# ------------------------------------------------------------ the fused CPU kernel
from mlx_attn import _native  # noqa: E402

needs_ext = pytest.mark.skipif(_native.ext is None, reason="the native extension is not built")

FUSED_CASES = {
    # name: (q heads, kv heads, q len, kv len, mask, window, sinks)
    "decode-gqa3": (6, 2, 1, 150, None, None, False),
    "decode-gqa8-sinks": (8, 1, 1, 200, None, None, True),
    "prefill-causal": (4, 4, 37, 37, "causal", None, False),
    "chunk-causal-gqa": (6, 3, 9, 130, "causal", None, False),
    "window": (4, 2, 20, 90, "causal", 17, True),
    "bool-mask": (4, 2, 5, 70, "bool", None, False),
    "additive-mask": (4, 2, 3, 65, "additive", None, False),
}


def fused_inputs(case, bits, group_size, d, dtype=mx.float16, batch=1):
    hq, hkv, tq, tkv, mask_kind, window, with_sinks = FUSED_CASES[case]
    key = mx.random.key(sum(map(ord, case)) + bits + group_size + d)
    kq_, kk, kv_, km, ks = mx.random.split(key, 5)
    q = mx.random.normal((batch, hq, tq, d), key=kq_).astype(dtype)
    k = mx.random.normal((batch, hkv, tkv, d), key=kk).astype(dtype)
    v = mx.random.normal((batch, hkv, tkv, d), key=kv_).astype(dtype)
    mask = mask_kind
    if mask_kind == "bool":
        mask = mx.random.bernoulli(0.6, (batch, hq, tq, tkv), key=km)
    elif mask_kind == "additive":
        mask = (mx.random.normal((tq, tkv), key=km) * 2).astype(dtype)
    sinks = mx.random.normal((hq,), key=ks).astype(dtype) if with_sinks else None
    return q, quantize(k, group_size, bits), quantize(v, group_size, bits), mask, sinks, window


def assert_fused_matches_reference(q, kq, vq, *, group_size, bits, tolerance=2e-3, **kwargs):
    assert mlx_attn.quantized_attention_path(q, kq, vq, group_size=group_size, bits=bits, **kwargs) == "fused-cpu"
    fused = qsdpa(q, kq, vq, group_size=group_size, bits=bits, **kwargs)
    reference = qsdpa(q, kq, vq, group_size=group_size, bits=bits, backend="reference", **kwargs)
    assert fused.dtype == reference.dtype and fused.shape == reference.shape
    np.testing.assert_allclose(np.array(fused.astype(mx.float32)), np.array(reference.astype(mx.float32)),
                               atol=tolerance, rtol=tolerance)


@needs_ext
@pytest.mark.parametrize("group_size, d", [(32, 64), (64, 64), (32, 128), (64, 128), (128, 128)])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("case", list(FUSED_CASES))
def test_fused_matches_reference(case, bits, group_size, d):
    q, kq, vq, mask, sinks, window = fused_inputs(case, bits, group_size, d)
    assert_fused_matches_reference(q, kq, vq, group_size=group_size, bits=bits, scale=d**-0.5, mask=mask,
                                   sinks=sinks, window_size=window)


@needs_ext
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_fused_other_dtypes_and_batches(dtype):
    q, kq, vq, mask, sinks, window = fused_inputs("chunk-causal-gqa", 8, 64, 64, dtype=dtype, batch=3)
    assert_fused_matches_reference(q, kq, vq, group_size=64, bits=8, scale=0.125, mask=mask,
                                   tolerance=2e-3 if dtype == mx.float32 else 2e-2)


@needs_ext
@pytest.mark.parametrize("bits", [4, 8])
def test_fused_reads_strided_views(bits):
    """Cache slices, words read with a stride, transposed scales, broadcast
    biases: the kernel reads every part through its own strides."""
    q, kq, vq, _, _, _ = fused_inputs("decode-gqa3", bits, 32, 64)
    packed, scales, biases = kq
    buffer = mx.concatenate([packed, packed], axis=2)  # a cache buffer; the triple is a slice of it
    words_doubled = mx.repeat(packed, 2, axis=-1)  # every word twice: [..., ::2] reads with stride 2
    strided_k = (words_doubled[..., ::2], mx.swapaxes(mx.swapaxes(scales, 2, 3) + 0, 2, 3), biases)
    sliced_v = tuple(mx.concatenate([a, a], axis=2)[:, :, : a.shape[2]] for a in vq)
    assert buffer.shape[2] == 2 * packed.shape[2]
    assert_fused_matches_reference(q, strided_k, sliced_v, group_size=32, bits=bits, scale=0.125)
    # one scale and bias per head broadcast along time: still a valid triple
    shared = (packed, mx.broadcast_to(scales[:, :, :1], scales.shape), mx.broadcast_to(biases[:, :, :1], biases.shape))
    assert_fused_matches_reference(q, shared, vq, group_size=32, bits=bits, scale=0.125)


@needs_ext
def test_every_kernel_copy_agrees_on_quantized_kv():
    q, kq, vq, mask, sinks, window = fused_inputs("window", 4, 64, 128)
    before = _native.ext.cpu_isa()
    outputs = {}
    try:
        for isa in _native.ext.supported_cpu_isas():
            _native.ext.set_cpu_isa(isa)
            outputs[isa] = np.array(qsdpa(q, kq, vq, scale=0.1, mask=mask, sinks=sinks, window_size=window, bits=4))
    finally:
        _native.ext.set_cpu_isa(before)
    reference = np.array(qsdpa(q, kq, vq, scale=0.1, mask=mask, sinks=sinks, window_size=window, bits=4,
                               backend="reference"))
    for isa, out in outputs.items():
        np.testing.assert_allclose(out, reference, atol=2e-3, err_msg=isa)


@needs_ext
def test_fused_edge_cases():
    k, v = make_kv(20, t=0)
    out = qsdpa(mx.ones((1, 2, 3, 64), dtype=mx.float16), quantize(k), quantize(v), scale=1.0, backend="fused")
    assert out.shape == (1, 2, 3, 64) and not np.any(np.array(out))
    # a row that sees no key (boolean mask all False) is zeros; the others are not
    q, kq, vq, _, _, _ = fused_inputs("bool-mask", 8, 64, 64)
    mask = mx.ones((1, 4, 5, 70), dtype=mx.bool_)
    mask[:, :, 2] = False
    out = np.array(qsdpa(q, kq, vq, scale=0.1, mask=mask, backend="fused"))
    assert not np.any(out[:, :, 2]) and np.all(np.any(out[:, :, [0, 1, 3, 4]] != 0, axis=-1))
    # float32 queries with float16 scales: the output promotes, the kernel reads float32 scales
    q32 = q.astype(mx.float32)
    assert_fused_matches_reference(q32, kq, vq, group_size=64, bits=8, scale=0.1)
    assert qsdpa(q32, kq, vq, scale=0.1).dtype == mx.float32


@needs_ext
@pytest.mark.skipif(_native.ext is not None and _native.ext.has_metal(), reason="this build has the Metal kernels")
def test_fused_backend_on_the_gpu_stream_is_refused_with_reason():
    q, kq, vq, _, _, _ = fused_inputs("decode-gqa3", 8, 64, 64)
    with pytest.raises(ValueError, match="has no Metal kernels"):
        qsdpa(q, kq, vq, scale=0.1, backend="fused", stream=mx.gpu)


@needs_ext
def test_native_op_validates_its_inputs():
    q, kq, vq, _, _, _ = fused_inputs("decode-gqa3", 8, 64, 64)
    ext = _native.ext
    for args, message in [
        (dict(k_quant=list(kq[:2])), "triples"),
        (dict(bits=3), "bits must be 4 or 8"),
        (dict(group_size=16), "group_size must be 32, 64 or 128"),
        (dict(group_size=32), "do not match bits=8, group_size=32"),
        (dict(k_quant=[kq[0].astype(mx.int32), kq[1], kq[2]]), "packed must be uint32"),
        (dict(k_quant=[kq[0], kq[1].astype(mx.float32), kq[2]]), "q's dtype"),
        (dict(v_quant=[a[:, :, :5] for a in vq]), "same heads and length"),
    ]:
        call = dict(k_quant=list(kq), v_quant=list(vq), bits=8, group_size=64)
        call.update(args)
        with pytest.raises(ValueError, match=message):
            ext.quantized_attention(q, call.pop("k_quant"), call.pop("v_quant"), scale=0.1, **call)


@needs_ext
def test_cache_decoding_takes_the_fused_path():
    k, v = make_kv(21, hkv=2, t=40, d=64)
    cache = QuantizedKVCache(64, 4)
    kq, vq = cache.update_and_fetch(k, v)
    q = mx.random.normal((1, 6, 1, 64)).astype(mx.float16)
    assert mlx_attn.quantized_attention_path(q, kq, vq, bits=4) == "fused-cpu"
    assert_fused_matches_reference(q, kq, vq, group_size=64, bits=4, scale=0.125)
