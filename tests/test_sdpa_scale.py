"""The scale contract: any scale finite in float32 (0, denormal, negative, up
to FLT_MAX) gives the float64 answer where that is representable, and finite
outputs always, on the fused CPU path and the reference path alike; scales
not finite in float32 raise ValueError naming `scale`. Logits saturate at
2^125 (mlx_attn/reference.py, metal/attention_params.h)."""

import mlx.core as mx
import numpy as np
import pytest

import mlx_attn
from sdpa_cases import exact_qkv, numpy_attention

FLT_MAX = float(np.finfo(np.float32).max)
SCALES = [0.0, 1e-45, 1e-40, 1e-30, -0.7, 0.7, 3.0, 1e4, -1e4, 1e30, 2.4e38, 3e38, FLT_MAX, -FLT_MAX]


def run(q, k, v, backend, **kw):
    out = mlx_attn.scaled_dot_product_attention(q, k, v, backend=backend, **kw)
    return np.array(out.astype(mx.float32))


@pytest.mark.parametrize("backend", ["fused", "reference"])
@pytest.mark.parametrize("mask", [None, "causal"])
@pytest.mark.parametrize("scale", SCALES, ids=repr)
def test_every_finite_scale_matches_float64(scale, mask, backend):
    """q.k is exact in float32 here (multiples of 1/64) and |q.k| < 1/8, so
    scale * q.k never reaches the saturation limit: float64 is the truth."""
    q, k, v = exact_qkv(1, 4, 2, 6, 9, 8)
    sinks = mx.array([0.0, -0.5, 0.25, 1.0])
    got = run(q, k, v, backend, scale=scale, mask=mask, sinks=sinks)
    want = numpy_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=str)
@pytest.mark.parametrize("scale", [FLT_MAX, -FLT_MAX, 1e38, 1e20], ids=repr)
def test_saturated_logits_stay_finite_and_paths_agree(scale, dtype):
    """Unit-normal inputs: scale * q.k overflows float32; logits saturate the
    same way on both paths, and no exponent overflows."""
    rng = np.random.default_rng(0)
    q, k, v = (mx.array(rng.standard_normal(s).astype(np.float32)).astype(dtype)
               for s in ((1, 4, 6, 8), (1, 2, 9, 8), (1, 2, 9, 8)))
    additive = mx.array(rng.standard_normal((6, 9)).astype(np.float32) * 3e37).astype(dtype)
    for kw in (dict(mask="causal"), dict(mask=additive), dict(sinks=mx.array([1e38, 0.0, -1e38, 3.0]).astype(dtype))):
        fused = run(q, k, v, "fused", scale=scale, **kw)
        reference = run(q, k, v, "reference", scale=scale, **kw)
        assert np.isfinite(fused).all() and np.isfinite(reference).all()
        np.testing.assert_allclose(fused, reference, atol={mx.float32: 2e-5, mx.float16: 4e-3, mx.bfloat16: 3e-2}[dtype])


@pytest.mark.parametrize("scale", [float("inf"), float("-inf"), float("nan"), 1e39, -3.5e38, np.float64(1e300)], ids=repr)
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_scales_not_finite_in_float32_are_rejected(scale, backend):
    q, k, v = exact_qkv(1, 2, 2, 3, 4, 8)
    with pytest.raises(ValueError, match="scale"):
        mlx_attn.scaled_dot_product_attention(q, k, v, scale=scale, backend=backend)
    with pytest.raises(ValueError, match="scale"):
        mlx_attn.attention_path(q, k, v, scale=scale)


# ------------------------------------------------- huge scales, small logits
# A scale near float32's maximum with q.k near 1 / scale gives logits of
# order one; every fused CPU kernel copy must then still match float64. The
# products q_d * k_d sit below float32's normal range (2^-126), and with
# `tiny_side` "k" and `shift` 6 the keys themselves are subnormal: kernels
# whose dot products flush either (AVX512_BF16 vdpbf16ps, arm64 BFDOT) must
# not drop them. Values are multiples of powers of two, so q.k is exact in
# every dtype that can hold it (float16 cannot: its tiny side is 0 and the
# logits are too).
from mlx_attn import _native  # noqa: E402
from sdpa_cases import TOLERANCE  # noqa: E402

HUGE_SCALES = [2.3e38, -3e38, FLT_MAX]
SMALL_LOGIT_CASES = [("k", 0), ("k", 6), ("q", 0)]


@pytest.fixture(params=_native.ext.supported_cpu_isas() if _native.ext else [])
def cpu_isa(request):
    """Runs a test once per compiled kernel copy this CPU can execute."""
    before = _native.ext.cpu_isa()
    _native.ext.set_cpu_isa(request.param)
    yield request.param
    _native.ext.set_cpu_isa(before)


def small_logit_values(rng, q_shape, k_shape, scale, tiny_side, shift, dtype):
    """q = a / 64 * 2^shift and k = b / 64 * 2^-shift (a, b integers in
    [-4, 4]), the `tiny_side` times a power of two t with |scale| * t near
    2^7, so scale * q.k is of order one (D <= 128)."""
    tiny = 2.0 ** round(np.log2(2**7 / abs(scale)))
    q = rng.integers(-4, 5, q_shape) / 64 * 2.0**shift * (tiny if tiny_side == "q" else 1.0)
    k = rng.integers(-4, 5, k_shape) / 64 * 2.0**-shift * (tiny if tiny_side == "k" else 1.0)
    return (mx.array(x.astype(np.float32)).astype(dtype) for x in (q, k))


SMALL_LOGIT_OPTIONS = [dict(), dict(mask="causal"), dict(softcap=2.0), dict(sinks=True)]


@pytest.mark.skipif(_native.ext is None, reason="the fused CPU kernel needs mlx_attn._ext")
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=str)
@pytest.mark.parametrize("scale", HUGE_SCALES, ids=repr)
@pytest.mark.parametrize("tiny_side,shift", SMALL_LOGIT_CASES)
def test_huge_scale_small_logits_match_float64(cpu_isa, tiny_side, shift, scale, dtype):
    rng = np.random.default_rng(3)
    # prefill across two key blocks, decode, a small head dim
    for tq, tkv, d in [(7, 70, 64), (1, 70, 128), (5, 9, 8)]:
        q, k = small_logit_values(rng, (1, 4, tq, d), (1, 2, tkv, d), scale, tiny_side, shift, dtype)
        v = mx.array(rng.standard_normal((1, 2, tkv, d)).astype(np.float32)).astype(dtype)
        logits = scale * np.einsum("hqd,hkd->hqk", np.array(q.astype(mx.float32), np.float64)[0],
                                   np.repeat(np.array(k.astype(mx.float32), np.float64)[0], 2, 0))
        if dtype != mx.float16:  # the case is what it claims: logits of order one, not all equal
            assert 0.5 < np.abs(logits).max() < 64
        for options in SMALL_LOGIT_OPTIONS:
            kw = dict(options)
            if kw.pop("sinks", False):
                kw["sinks"] = mx.array([0.0, 1.0, -1.0, 2.0]).astype(dtype)
            got = run(q, k, v, "fused", scale=scale, **kw)
            want = numpy_attention(q, k, v, scale=scale, **kw)
            np.testing.assert_allclose(got, want, atol=TOLERANCE[dtype], rtol=0, err_msg=f"{tq, tkv, d, options}")


@pytest.mark.skipif(_native.ext is None, reason="the fused CPU kernel needs mlx_attn._ext")
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=str)
@pytest.mark.parametrize("tiny_side,shift", SMALL_LOGIT_CASES)
def test_huge_scale_small_logits_paged_match_float64(cpu_isa, tiny_side, shift, dtype):
    from mlx_attn.paged import paged_attention
    from paged_cases import as64, make_case, oracle

    rng = np.random.default_rng(4)
    scale = 2.3e38
    q, k, v, table, kv_lens, q_lens, np_table, kv_list, q_list = make_case(
        rng, [(1, 70), (6, 40), (1, 3)], dim=64, page_size=16, dtype=dtype)
    q, k = small_logit_values(rng, q.shape, k.shape, scale, tiny_side, shift, dtype)
    for causal, softcap, sinks in [(True, None, None), (False, 2.0, mx.array([0.0, 1.0, -1.0, 2.0]).astype(dtype))]:
        got = paged_attention(q, k, v, table, kv_lens, q_lens=q_lens, scale=scale, causal=causal, sinks=sinks,
                              softcap=softcap, backend="fused")
        want, _ = oracle(as64(q), as64(k), as64(v), np_table, kv_list, q_list, scale, causal, None,
                         None if sinks is None else as64(sinks), softcap)
        np.testing.assert_allclose(as64(got), want, atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.skipif(_native.ext is None, reason="the fused CPU kernel needs mlx_attn._ext")
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=str)
@pytest.mark.parametrize("bits", [4, 8])
def test_huge_scale_small_logits_quantized_kv_match_float64(cpu_isa, bits, dtype):
    """The oracle reads the keys and values the quantization gives back."""
    rng = np.random.default_rng(5)
    scale = 3e38
    for tq in (1, 7):
        q, k = small_logit_values(rng, (1, 4, tq, 64), (1, 2, 70, 64), scale, "k", 0, dtype)
        v = mx.array(rng.standard_normal((1, 2, 70, 64)).astype(np.float32)).astype(dtype)
        kq, vq = mx.quantize(k, group_size=32, bits=bits), mx.quantize(v, group_size=32, bits=bits)
        k_deq, v_deq = (mx.dequantize(*t, group_size=32, bits=bits) for t in (kq, vq))
        got = mlx_attn.quantized_scaled_dot_product_attention(q, kq, vq, scale=scale, mask="causal", group_size=32,
                                                              bits=bits, backend="fused")
        want = numpy_attention(q, k_deq, v_deq, scale=scale, mask="causal")
        np.testing.assert_allclose(np.array(got.astype(mx.float32)), want, atol=TOLERANCE[dtype], rtol=0)
