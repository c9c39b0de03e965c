"""``softcap=``: every logit ``scale * q.k`` becomes ``softcap * tanh(logit /
softcap)`` before the mask (Gemma 2, Grok), on every path: the reference,
the fused CPU kernel (forward, backward, quantized K/V), the paged reference,
``MultiHeadAttention`` and the emulated Metal kernels (prefill, decode,
quantized, backward; tests/test_softcap_metal.py). Expected values come from
float64 NumPy (tests/sdpa_cases.py numpy_attention, and the analytic
gradients below, themselves checked against central differences)."""

import math
import struct

import mlx.core as mx
import numpy as np
import pytest

import mlx_attn
from mlx_attn import _ext
from mlx_attn.metal_support import launch_plan
from sdpa_cases import (
    DTYPES,
    TOLERANCE,
    as_float64,
    finite_difference_gradient,
    make_qkv,
    numpy_attention,
)
from test_launch_plan import PARAMS_FORMAT

FLOAT32_MAX = float(np.finfo(np.float32).max)
FLOAT32_TINY = float(np.finfo(np.float32).tiny)


# ------------------------------------------------------------------ oracle
def numpy_gradients(q, k, v, d_out, *, scale, softcap=None, mask=None, sinks=None, window_size=None, d_lse=None):
    """Gradients of sum(out * d_out) (+ sum(lse * d_lse)) in float64 from the
    definition: dP = dO V^T, delta = rowsum(dO * O) - dlse, dL = P (dP - delta)
    for the softmax's logits, through the additive mask unchanged (its
    gradient, summed over nothing: [B, Hq, Tq, Tkv]), times 1 - tanh^2 through
    the softcap, times scale into q and k. Returns dq, dk, dv, d_sinks (or
    None), d_mask (the full [B, Hq, Tq, Tkv] logit gradient)."""
    q64, k64, v64, do = (as_float64(x) for x in (q, k, v, d_out))
    b, hq, tq, _ = q64.shape
    hkv, tkv = k64.shape[1], k64.shape[2]
    group = hq // hkv
    k_rep, v_rep = np.repeat(k64, group, axis=1), np.repeat(v64, group, axis=1)
    raw = scale * np.einsum("bhqd,bhkd->bhqk", q64, k_rep)
    capped = softcap * np.tanh(raw / softcap) if softcap is not None else raw
    visible = np.ones(raw.shape, bool)
    logits = capped
    if isinstance(mask, str) or window_size is not None:
        pos = np.arange(tq)[:, None] + tkv - tq
        keys = np.arange(tkv)[None, :]
        visible &= (keys <= pos) & ((keys > pos - window_size) if window_size is not None else True)
    elif mask is not None and mask.dtype == mx.bool_:
        visible &= np.broadcast_to(np.array(mask), raw.shape)
    elif mask is not None:
        added = np.broadcast_to(as_float64(mask), raw.shape)
        visible &= added != -np.inf
        logits = capped + np.where(visible, added, 0.0)
    logits = np.where(visible, logits, -np.inf)
    _, lse = numpy_attention(q, k, v, scale=scale, softcap=softcap, mask=mask, sinks=sinks,
                             window_size=window_size, return_lse=True)
    seen = np.isfinite(lse)[..., None]
    safe_lse = np.where(seen, lse[..., None], 0.0)
    probs = np.where(seen & visible, np.exp(np.where(visible, logits, 0.0) - safe_lse), 0.0)
    out = np.einsum("bhqk,bhkd->bhqd", probs, v_rep)
    delta = (do * out).sum(-1)
    if d_lse is not None:
        delta = delta - np.where(seen[..., 0], as_float64(d_lse), 0.0)
    d_probs = np.einsum("bhqd,bhkd->bhqk", do, v_rep)
    d_logits = probs * (d_probs - delta[..., None])
    d_raw = d_logits * (1.0 - (capped / softcap) ** 2) if softcap is not None else d_logits
    dq = scale * np.einsum("bhqk,bhkd->bhqd", d_raw, k_rep)
    dk = (scale * np.einsum("bhqk,bhqd->bhkd", d_raw, q64)).reshape(b, hkv, group, tkv, -1).sum(2)
    dv = np.einsum("bhqk,bhqd->bhkd", probs, do).reshape(b, hkv, group, tkv, -1).sum(2)
    d_sinks = None
    if sinks is not None:
        sink_probs = np.where(seen[..., 0], np.exp(as_float64(sinks).reshape(1, hq, 1) - np.where(seen[..., 0], lse, 0.0)), 0.0)
        d_sinks = -(sink_probs * delta).sum(axis=(0, 2))
    return dq, dk, dv, d_sinks, d_logits


def test_the_gradient_oracle_matches_central_differences():
    """The analytic float64 gradients above (softcap, additive mask, sinks,
    GQA, a lse cotangent) against central differences of numpy_attention."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s) for s in ((1, 2, 3, 3), (1, 1, 4, 3), (1, 1, 4, 2)))
    q, k = q * 2, k * 2  # logits of a few units: the tanh bends
    sinks = rng.standard_normal(2)
    added = rng.standard_normal((3, 4))
    d_out, d_lse = rng.standard_normal((1, 2, 3, 2)), rng.standard_normal((1, 2, 3))
    kw = dict(scale=0.7, softcap=1.3)
    mask = mx.array(added.astype(np.float32))
    added = as_float64(mask)

    def loss(q, k, v, sinks, added):
        out, lse = numpy_attention(q, k, v, sinks=sinks, mask=mx.array(added.astype(np.float32)), return_lse=True, **kw)
        return float((out * d_out).sum() + (lse * d_lse).sum())

    # the mask passes through float32 above: differentiate it by the logits' additive part instead
    def loss_added(q, k, v, sinks, shift):
        out, lse = _attention_with_added(q, k, v, sinks, added + shift, **kw)
        return float((out * d_out).sum() + (lse * d_lse).sum())

    dq, dk, dv, d_sinks, d_logits = numpy_gradients(q, k, v, d_out, sinks=sinks, mask=mask, d_lse=d_lse, **kw)
    arrays = [q, k, v, sinks, np.zeros_like(added)]
    for index, want in enumerate((dq, dk, dv, d_sinks)):
        got = finite_difference_gradient(loss_added, arrays, index)
        np.testing.assert_allclose(want, got, rtol=1e-6, atol=1e-7)
    got = finite_difference_gradient(loss_added, arrays, 4)
    np.testing.assert_allclose(d_logits[0].sum(0), got, rtol=1e-6, atol=1e-7)  # the mask broadcasts over heads
    assert abs(loss(q, k, v, sinks, added) - loss_added(q, k, v, sinks, 0.0)) < 1e-6


def _attention_with_added(q, k, v, sinks, added, *, scale, softcap):
    """numpy_attention with a float64 additive mask (no float32 rounding)."""
    raw = scale * np.einsum("bhqd,bhkd->bhqk", q, np.repeat(k, q.shape[1] // k.shape[1], axis=1))
    logits = softcap * np.tanh(raw / softcap) + added
    top = np.maximum(logits.max(-1, keepdims=True), sinks.reshape(1, -1, 1, 1))
    weights = np.exp(logits - top)
    total = weights.sum(-1, keepdims=True) + np.exp(sinks.reshape(1, -1, 1, 1) - top)
    out = np.einsum("bhqk,bhkd->bhqd", weights / total, np.repeat(v, q.shape[1] // v.shape[1], axis=1))
    return out, (np.log(total) + top)[..., 0]


# ------------------------------------------------------------------ contract
BAD_SOFTCAPS = [0, 0.0, -1.0, float("nan"), float("inf"), -float("inf"), 1e39, 1e-40, 10**400, True,
                np.float32(0), "50", mx.array(50.0), [50.0]]


@pytest.mark.parametrize("bad", BAD_SOFTCAPS, ids=repr)
def test_a_bad_softcap_is_a_value_error_naming_it(bad):
    q, k, v = make_qkv(1, 2, 1, 3, 5, 8)
    for call in (
        lambda: mlx_attn.scaled_dot_product_attention(q, k, v, scale=1.0, softcap=bad),
        lambda: mlx_attn.attention_path(q, k, v, scale=1.0, softcap=bad),
        lambda: mlx_attn.MultiHeadAttention(16, 2, softcap=bad),
    ):
        with pytest.raises(ValueError, match="softcap"):
            call()


def test_the_quantized_and_paged_calls_validate_softcap():
    q, k, v = make_qkv(1, 2, 1, 3, 64, 64)
    k_quant, v_quant = mx.quantize(k, bits=8), mx.quantize(v, bits=8)
    with pytest.raises(ValueError, match="softcap"):
        mlx_attn.quantized_scaled_dot_product_attention(q, k_quant, v_quant, scale=1.0, softcap=-2.0)
    pages = k.reshape(4, 1, 16, 64)
    table, lens = mx.array([[0, 1, 2, 3]], mx.int32), mx.array([64], mx.int32)
    rows = q[0, :, :1].swapaxes(0, 1)  # [1, Hq, D]
    for paged in (mlx_attn.paged.paged_attention, mlx_attn.paged.paged_attention_path):
        with pytest.raises(ValueError, match="softcap"):
            paged(rows, pages, pages, table, lens, scale=1.0, softcap=float("nan"))
    with pytest.raises(ValueError, match="softcap"):
        mlx_attn.paged.quantized_paged_attention(rows, mx.quantize(pages, bits=8), mx.quantize(pages, bits=8), table,
                                                 lens, scale=1.0, softcap=0.0)


def test_the_native_description_rejects_a_negative_or_nan_softcap():
    """C++ keeps its own invariant (the kernels read softcap > 0 as on)."""
    q, k, v = make_qkv(1, 2, 1, 3, 5, 8)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="softcap"):
            _ext.fused_attention(q, k, v, scale=1.0, softcap=bad)
    assert _ext.describe_attention(q, k, v, softcap=2.5).softcap == 2.5
    assert _ext.describe_attention(q, k, v).softcap == 0.0


def test_numbers_of_every_kind_are_accepted():
    q, k, v = make_qkv(1, 2, 1, 3, 5, 8)
    want = numpy_attention(q, k, v, scale=0.5, softcap=3.0)
    for cap in (3, 3.0, np.float32(3), np.float64(3), np.int64(3)):
        out = mlx_attn.scaled_dot_product_attention(q, k, v, scale=0.5, softcap=cap)
        assert np.abs(np.array(out) - want).max() <= TOLERANCE[mx.float32]


@pytest.mark.parametrize("cap", [None, 2.0])
def test_softcap_problems_run_fused_and_never_take_mlx_fast(cap):
    """attention_path reports the fused CPU kernel; on the GPU, mx.fast
    (which has no softcap) is never chosen for a softcap call."""
    q, k, v = make_qkv(1, 4, 2, 5, 9, 64)
    assert mlx_attn.attention_path(q, k, v, scale=0.1, mask="causal", softcap=cap, stream=mx.cpu) == "fused-cpu"
    if not _ext.has_metal():  # no Metal kernels: mx.fast where it computes the same, else the reference
        path = mlx_attn.attention_path(q, k, v, scale=0.1, softcap=cap, stream=mx.gpu)
        assert path == ("reference" if cap else "mlx-fast")


def test_the_cap_travels_in_the_params_bytes():
    q, k, v = make_qkv(1, 4, 2, 5, 9, 64)
    for cap, want in ((None, 0.0), (2.5, 2.5), (50, 50.0)):
        values = struct.unpack(PARAMS_FORMAT, launch_plan(q, k, v, softcap=cap).params)
        assert values[-1] == want


# ------------------------------------------------------------------ forward
CASES = {
    "causal, GQA": dict(shape=(2, 4, 2, 37, 53), mask="causal"),
    "window": dict(shape=(1, 2, 1, 40, 40), window_size=9),
    "bool mask, a row that sees nothing": dict(shape=(1, 4, 1, 19, 70), mask="bool"),
    "additive mask with -inf": dict(shape=(1, 2, 2, 21, 33), mask="additive"),
    "sinks + causal, decode": dict(shape=(2, 8, 2, 1, 300), mask="causal", sinks=True),
    "no mask, MQA, three queries": dict(shape=(1, 6, 1, 3, 130)),
}


def case_inputs(case: dict, dtype, seed: int = 0, d: int = 64):
    """q, k, v (q scaled up: logits of several units, where the tanh bends)
    and the keyword arguments of a case."""
    b, hq, hkv, tq, tkv = case["shape"]
    q, k, v = make_qkv(b, hq, hkv, tq, tkv, d, dtype=dtype, seed=seed)
    q = (q.astype(mx.float32) * 3).astype(dtype)
    rng = np.random.default_rng(seed)
    kw = {"scale": d**-0.5}
    if case.get("mask") == "bool":
        visible = rng.random((tq, tkv)) > 0.3
        visible[0] = False
        kw["mask"] = mx.array(visible)
    elif case.get("mask") == "additive":
        added = rng.standard_normal((1, 1, tq, tkv)).astype(np.float32) * 2
        added[..., ::5] = -np.inf
        kw["mask"] = mx.array(added).astype(dtype)
    elif case.get("mask"):
        kw["mask"] = case["mask"]
    if case.get("window_size"):
        kw["window_size"] = case["window_size"]
    if case.get("sinks"):
        kw["sinks"] = mx.array(rng.standard_normal(hq).astype(np.float32) * 2).astype(dtype)
    return (q, k, v), kw


def assert_matches(got, want, dtype, what=""):
    got = np.array(got.astype(mx.float32), np.float64)
    assert got.shape == want.shape
    finite = np.isfinite(want)
    assert np.array_equal(np.isfinite(got), finite), what
    err = np.abs(got[finite] - want[finite]).max() if finite.any() else 0.0
    assert err <= TOLERANCE[dtype], f"{what}: max abs error {err} > {TOLERANCE[dtype]} ({dtype})"


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("backend", ["reference", "fused"])
def test_forward_and_lse_match_float64(name, backend):
    """Reference and fused CPU paths, float32, with the row log-sum-exp (over
    the capped logits); the fused one in each of this CPU's kernel copies."""
    (q, k, v), kw = case_inputs(CASES[name], mx.float32)
    want, want_lse = numpy_attention(q, k, v, softcap=1.7, return_lse=True, **kw)
    isas = _ext.supported_cpu_isas() if backend == "fused" else ["one"]
    before = _ext.cpu_isa()
    try:
        for isa in isas:
            if backend == "fused":
                _ext.set_cpu_isa(isa)
            out, lse = mlx_attn.scaled_dot_product_attention(q, k, v, softcap=1.7, backend=backend, stream=mx.cpu,
                                                             return_lse=True, **kw)
            assert_matches(out, want, mx.float32, f"{name} out ({isa})")
            got_lse = np.array(lse, np.float64)
            assert np.array_equal(np.isneginf(got_lse), np.isneginf(want_lse))
            finite = np.isfinite(want_lse)
            assert np.abs(got_lse[finite] - want_lse[finite]).max() <= 1e-5 * max(1.0, np.abs(want_lse[finite]).max())
    finally:
        _ext.set_cpu_isa(before)
    if backend == "fused":
        assert mlx_attn.attention_path(q, k, v, softcap=1.7, stream=mx.cpu, return_lse=True, **kw) == "fused-cpu"


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["causal, GQA", "additive mask with -inf", "sinks + causal, decode"])
def test_half_precision_fused_cpu_matches_float64(dtype, name):
    (q, k, v), kw = case_inputs(CASES[name], dtype, seed=1)
    want = numpy_attention(q, k, v, softcap=2.0, **kw)
    out = mlx_attn.scaled_dot_product_attention(q, k, v, softcap=2.0, backend="fused", stream=mx.cpu, **kw)
    assert out.dtype == dtype
    assert_matches(out, want, dtype, name)


def test_the_softcap_changes_the_result():
    """Against a cap the logits never reach the output is the uncapped one
    (tanh(x) ~ x), against a small one it differs: the cap is applied."""
    (q, k, v), kw = case_inputs(CASES["causal, GQA"], mx.float32)
    plain = np.array(mlx_attn.scaled_dot_product_attention(q, k, v, **kw))
    loose = np.array(mlx_attn.scaled_dot_product_attention(q, k, v, softcap=1e4, **kw))
    tight = np.array(mlx_attn.scaled_dot_product_attention(q, k, v, softcap=0.5, **kw))
    assert np.abs(loose - plain).max() < 1e-4
    assert np.abs(tight - plain).max() > 0.1


@pytest.mark.parametrize("backend", ["reference", "fused"])
def test_an_additive_mask_is_added_after_the_cap(backend):
    """Hugging Face's eager attention (Gemma 2): logits = cap * tanh(scale *
    q.k / cap), then + mask, then softmax. With cap 1 every capped logit is in
    [-1, 1]; a +4 on key 0 then gives it weight e^(c0 + 4) against at most e
    for the others, which the other order (cap of logit + mask) would bound."""
    q, k, v = make_qkv(1, 1, 1, 1, 6, 8, seed=3)
    added = np.zeros((1, 6), np.float32)
    added[0, 0] = 4.0
    mask = mx.array(added)
    out = np.array(mlx_attn.scaled_dot_product_attention(q, k, v, scale=1.0, mask=mask, softcap=1.0,
                                                         backend=backend, stream=mx.cpu), np.float64)
    np.testing.assert_allclose(out, numpy_attention(q, k, v, scale=1.0, mask=mask, softcap=1.0), atol=2e-6)
    raw = np.einsum("d,kd->k", as_float64(q)[0, 0, 0], as_float64(k)[0, 0])
    capped_after_mask = np.tanh(raw + added[0])  # the other order: the mask inside the cap
    other_order = np.exp(capped_after_mask) / np.exp(capped_after_mask).sum() @ as_float64(v)[0, 0]
    assert np.abs(out[0, 0, 0] - other_order).max() > 0.1  # the test tells the two orders apart


@pytest.mark.parametrize("backend", ["reference", "fused"])
def test_saturated_and_overflowing_logits_stay_finite_under_the_cap(backend):
    """A scale that overflows q.k to +-inf in float32 saturates the logit
    (2^125) and the cap then bounds it: every logit is +-cap, the output is
    finite and equals float64's. A tiny cap (float32's smallest normal), whose
    quotients overflow, makes every logit +-cap ~ 0: a plain average."""
    q, k, v = make_qkv(1, 2, 1, 4, 10, 16, seed=4)
    for scale, cap in ((FLOAT32_MAX, 2.0), (1e30, 5.0), (1.0, FLOAT32_TINY), (FLOAT32_MAX, FLOAT32_TINY)):
        out = mlx_attn.scaled_dot_product_attention(q, k, v, scale=scale, softcap=cap, mask="causal",
                                                    backend=backend, stream=mx.cpu)
        got = np.array(out, np.float64)
        assert np.isfinite(got).all(), (scale, cap)
        want = numpy_attention(q, k, v, scale=min(scale, 1e300), softcap=cap, mask="causal")
        assert np.abs(got - want).max() <= 1e-5, (scale, cap)


@pytest.mark.parametrize("backend", ["reference", "fused"])
def test_nan_in_an_additive_mask_row_stays_nan_there(backend):
    q, k, v = make_qkv(1, 2, 1, 3, 7, 8, seed=5)
    added = np.zeros((3, 7), np.float32)
    added[1, 2] = np.nan
    out = np.array(mlx_attn.scaled_dot_product_attention(q, k, v, scale=1.0, mask=mx.array(added), softcap=2.0,
                                                         backend=backend, stream=mx.cpu))
    assert np.isnan(out[:, :, 1]).all() and np.isfinite(out[:, :, [0, 2]]).all()


# ------------------------------------------------------------------ gradients
GRADIENT_CASES = {
    "causal, GQA, sinks": dict(shape=(1, 4, 2, 37, 53), mask="causal", sinks=True),
    "window": dict(shape=(2, 2, 1, 30, 30), window_size=7),
    "bool mask": dict(shape=(1, 2, 2, 19, 70), mask="bool"),
}


def primals_and_fn(q, k, v, kw, softcap, backend, with_lse=False):
    sinks = kw.get("sinks")
    rest = {x: y for x, y in kw.items() if x != "sinks"}
    primals = [q, k, v] + ([sinks] if sinks is not None else [])

    def attend(q, k, v, *maybe_sinks):
        result = mlx_attn.scaled_dot_product_attention(
            q, k, v, sinks=maybe_sinks[0] if maybe_sinks else None, softcap=softcap, backend=backend,
            stream=mx.cpu, return_lse=with_lse, **rest)
        return list(result) if with_lse else [result]

    return primals, attend


def assert_gradients(got, want, tolerance, what):
    for name, g, w in zip(("dq", "dk", "dv", "d_sinks"), got, want):
        g = np.array(g.astype(mx.float32), np.float64)
        err = np.abs(g - w).max() / max(1.0, np.abs(w).max())
        assert err <= tolerance, f"{what} {name}: relative error {err}"


@pytest.mark.parametrize("name", list(GRADIENT_CASES))
@pytest.mark.parametrize("backend", ["reference", "fused"])
def test_gradients_match_float64(name, backend):
    """Fused CPU backward (through mx.vjp of the public op; in each of this
    CPU's kernel copies) and the reference path's autodiff against the
    analytic float64 gradients."""
    (q, k, v), kw = case_inputs(GRADIENT_CASES[name], mx.float32, seed=2)
    d_out = mx.array(np.random.default_rng(9).standard_normal((*q.shape[:3], v.shape[3])).astype(np.float32))
    primals, attend = primals_and_fn(q, k, v, kw, 1.5, backend)
    want = numpy_gradients(q, k, v, d_out, softcap=1.5, **kw)
    before = _ext.cpu_isa()
    try:
        for isa in _ext.supported_cpu_isas() if backend == "fused" else [before]:
            _ext.set_cpu_isa(isa)
            _, grads = mx.vjp(attend, primals, [d_out])
            assert_gradients(grads, [w for w in want[:4] if w is not None], 1e-4, f"{name} ({backend}, {isa})")
    finally:
        _ext.set_cpu_isa(before)


def test_gradients_with_an_lse_cotangent_and_bfloat16():
    (q, k, v), kw = case_inputs(GRADIENT_CASES["causal, GQA, sinks"], mx.float32, seed=4)
    rng = np.random.default_rng(10)
    d_out = mx.array(rng.standard_normal((*q.shape[:3], v.shape[3])).astype(np.float32))
    d_lse = mx.array(rng.standard_normal(q.shape[:3]).astype(np.float32))
    primals, attend = primals_and_fn(q, k, v, kw, 2.5, "fused", with_lse=True)
    _, grads = mx.vjp(attend, primals, [d_out, d_lse])
    want = numpy_gradients(q, k, v, d_out, softcap=2.5, d_lse=d_lse, **kw)
    assert_gradients(grads, want[:4], 1e-4, "with d_lse")
    low = [x.astype(mx.bfloat16) for x in (q, k, v, kw["sinks"])]
    primals, attend = primals_and_fn(*low[:3], {**kw, "sinks": low[3]}, 2.5, "fused")
    _, grads = mx.vjp(attend, primals, [d_out.astype(mx.bfloat16)])
    want = numpy_gradients(*low[:3], d_out.astype(mx.bfloat16), softcap=2.5, **{**kw, "sinks": low[3]})
    assert_gradients(grads, want[:4], 6e-2, "bfloat16")


def test_additive_mask_gradient_and_jvp_go_through_the_reference_rule_with_the_cap():
    """An additive mask among the differentiated inputs, and every jvp, take
    the reference graph's autodiff (csrc/ops/reference_graph.cpp): it must get the
    softcap too."""
    (q, k, v), kw = case_inputs(CASES["additive mask with -inf"], mx.float32, seed=6)
    mask = kw.pop("mask")
    d_out = mx.array(np.random.default_rng(11).standard_normal((*q.shape[:3], v.shape[3])).astype(np.float32))

    def attend(q, k, v, mask):
        return mlx_attn.scaled_dot_product_attention(q, k, v, mask=mask, softcap=1.5, backend="fused",
                                                     stream=mx.cpu, **kw)

    _, grads = mx.vjp(attend, [q, k, v, mask], [d_out])
    dq, dk, dv, _, d_logits = numpy_gradients(q, k, v, d_out, softcap=1.5, mask=mask, **kw)
    assert_gradients(grads[:3], [dq, dk, dv], 1e-4, "with the mask differentiated")
    d_mask = np.where(np.isfinite(as_float64(mask)), d_logits.sum(axis=(0, 1), keepdims=True), 0.0)
    got = np.array(grads[3], np.float64)
    assert np.abs(np.where(np.isfinite(as_float64(mask)), got, 0.0) - d_mask).max() <= 1e-4

    # jvp: the directional derivative against float64 central differences
    rng = np.random.default_rng(12)
    tangents = [mx.array(rng.standard_normal(x.shape).astype(np.float32)) for x in (q, k, v)]
    _, (jvp,) = mx.jvp(lambda q, k, v: attend(q, k, v, mask), [q, k, v], tangents)
    step = 1e-5
    moved = [[as_float64(x) + sign * step * as_float64(t) for x, t in zip((q, k, v), tangents)] for sign in (1, -1)]
    want = (numpy_attention(*moved[0], softcap=1.5, mask=mask, **kw)
            - numpy_attention(*moved[1], softcap=1.5, mask=mask, **kw)) / (2 * step)
    assert np.abs(np.array(jvp, np.float64) - want).max() <= 1e-3 * max(1.0, np.abs(want).max())


def test_vmap_keeps_the_cap():
    (q, k, v), kw = case_inputs(CASES["causal, GQA"], mx.float32, seed=7)
    qs, ks, vs = (mx.stack([x, x * 0.5]) for x in (q, k, v))
    out = mx.vmap(lambda q, k, v: mlx_attn.scaled_dot_product_attention(q, k, v, softcap=1.5, backend="fused",
                                                                        stream=mx.cpu, **kw))(qs, ks, vs)
    for i in range(2):
        assert_matches(out[i], numpy_attention(qs[i], ks[i], vs[i], softcap=1.5, **kw), mx.float32, f"item {i}")


# ------------------------------------------------------------------ quantized, paged, modules
@pytest.mark.parametrize("bits, group_size", [(4, 32), (8, 64)])
@pytest.mark.parametrize("tq", [1, 19], ids=["decode", "prefill"])
def test_quantized_kv_on_the_fused_cpu_kernel(bits, group_size, tq):
    q, k, v = make_qkv(1, 4, 2, tq, 90, 64, seed=bits + tq)
    q = q * 3
    k_quant, v_quant = (mx.quantize(x, group_size=group_size, bits=bits) for x in (k, v))
    k_plain, v_plain = (mx.dequantize(*t, group_size=group_size, bits=bits) for t in (k_quant, v_quant))
    sinks = mx.array([0.5, -1.0, 2.0, 0.0])
    kw = dict(scale=0.125, mask="causal", sinks=sinks, group_size=group_size, bits=bits, softcap=1.2)
    assert mlx_attn.quantized_attention_path(q, k_quant, v_quant, stream=mx.cpu, **kw) == "fused-cpu"
    want = numpy_attention(q, k_plain, v_plain, scale=0.125, mask="causal", sinks=sinks, softcap=1.2)
    for backend in ("fused", "reference"):
        out = mlx_attn.quantized_scaled_dot_product_attention(q, k_quant, v_quant, backend=backend, stream=mx.cpu, **kw)
        assert_matches(out, want, mx.float32, backend)


def test_paged_reference_applies_the_cap():
    """Two sequences of different lengths over shared pages (one decode row,
    one chunk of 3 rows), float and quantized pages."""
    rng = np.random.default_rng(13)
    page_size, hkv, hq, d = 8, 2, 4, 64
    k_pages, v_pages = (mx.array(rng.standard_normal((6, hkv, page_size, d)).astype(np.float32)) for _ in range(2))
    table = mx.array([[0, 2, 4], [1, 3, 5]], mx.int32)
    kv_lens, q_lens = mx.array([20, 13], mx.int32), mx.array([1, 3], mx.int32)
    q = mx.array(rng.standard_normal((4, hq, d)).astype(np.float32) * 3)
    kw = dict(scale=0.125, softcap=1.4, window_size=6)
    outs = {
        "float": mlx_attn.paged.paged_attention(q, k_pages, v_pages, table, kv_lens, q_lens=q_lens, **kw),
        "quantized": mlx_attn.paged.quantized_paged_attention(
            q, mx.quantize(k_pages, group_size=64, bits=8), mx.quantize(v_pages, group_size=64, bits=8), table,
            kv_lens, q_lens=q_lens, group_size=64, bits=8, **kw),
    }
    start = 0
    for b, (rows, keys) in enumerate(((1, 20), (3, 13))):
        pages = np.array(table[b]).tolist()
        k_seq, v_seq = (mlx_attn.paged.gather_pages(p, pages, keys)[None] for p in (k_pages, v_pages))
        want = numpy_attention(q[start:start + rows].swapaxes(0, 1)[None], k_seq, v_seq, scale=0.125, softcap=1.4,
                               mask="causal", window_size=6)[0].swapaxes(0, 1)
        assert np.abs(np.array(outs["float"][start:start + rows]) - want).max() <= TOLERANCE[mx.float32]
        assert np.abs(np.array(outs["quantized"][start:start + rows]) - want).max() <= 0.05  # 8-bit pages
        start += rows


def test_multi_head_attention_forwards_the_cap():
    mx.random.seed(0)
    layer = mlx_attn.MultiHeadAttention(64, 4, 2, softcap=0.8)
    x = mx.random.normal((2, 9, 64)) * 4
    got = layer(x, mask="causal")
    q = layer.q_proj(x).reshape(2, 9, 4, 16).transpose(0, 2, 1, 3)
    k = layer.k_proj(x).reshape(2, 9, 2, 16).transpose(0, 2, 1, 3)
    v = layer.v_proj(x).reshape(2, 9, 2, 16).transpose(0, 2, 1, 3)
    out = numpy_attention(q, k, v, scale=0.25, mask="causal", softcap=0.8)
    want = np.array(layer.o_proj(mx.array(out.transpose(0, 2, 1, 3).reshape(2, 9, 64).astype(np.float32))))
    assert np.abs(np.array(got) - want).max() <= 1e-4
    _, weights = layer(x, mask="causal", return_weights=True)  # the reference path, with its weights
    plain = mlx_attn.MultiHeadAttention(64, 4, 2)
    plain.update(layer.parameters())
    assert np.abs(np.array(plain(x, mask="causal")) - np.array(got)).max() > 1e-3
    assert math.isclose(float(weights.sum(-1).mean()), 1.0, rel_tol=1e-5)
