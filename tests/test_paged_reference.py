"""mlx_attn.paged, the reference path (backend="reference"): paged, ragged attention against the float64 NumPy
oracle of tests/paged_cases.py (through the block table, not by the code under test)."""

from __future__ import annotations


import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings, HealthCheck
from hypothesis import strategies as st

from mlx_attn.paged import paged_attention, paged_attention_path, quantized_paged_attention
from paged_cases import MIXED, as64, make_case, oracle

TOLERANCE = {mx.float32: 2e-5, mx.float16: 4e-3, mx.bfloat16: 3e-2}


def check(case, *, dtype=mx.float32, scale=0.37, causal=True, window=None, sinks=None, lse=True,
          backend="reference"):
    q, k, v, table, kv_lens, q_lens, np_table, kv_list, q_list = case
    got = paged_attention(q, k, v, table, kv_lens, q_lens=q_lens, scale=scale, causal=causal, window_size=window,
                          sinks=sinks, return_lse=lse, backend=backend)
    out, got_lse = got if lse else (got, None)
    want, want_lse = oracle(as64(q), as64(k), as64(v), np_table, kv_list, q_list, scale, causal, window,
                            None if sinks is None else as64(sinks))
    assert out.shape == (q.shape[0], q.shape[1], v.shape[3]) and out.dtype == dtype
    np.testing.assert_allclose(as64(out), want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    if lse:
        assert got_lse.dtype == mx.float32 and got_lse.shape == q.shape[:2]
        np.testing.assert_allclose(np.asarray(got_lse), want_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_mixed_decode_and_chunked_prefill_with_shared_pages(dtype):
    rng = np.random.default_rng(0)
    check(make_case(rng, MIXED, dtype=dtype), dtype=dtype)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_gqa_mqa_mha(kv_heads):
    rng = np.random.default_rng(1)
    check(make_case(rng, MIXED, heads=4, kv_heads=kv_heads))


def test_window_sinks_not_causal_and_value_dim():
    rng = np.random.default_rng(2)
    case = make_case(rng, MIXED, value_dim=8)
    sinks = mx.array(rng.standard_normal(4).astype(np.float32))
    check(case, window=3)
    check(case, sinks=sinks)
    check(case, window=1, sinks=sinks)
    check(case, causal=False)
    check(case, causal=False, sinks=sinks)


def test_default_q_lens_is_decode():
    rng = np.random.default_rng(3)
    q, k, v, table, kv_lens, _, np_table, kv_list, _ = make_case(rng, [(1, 6), (1, 3), (1, 11)])
    out = paged_attention(q, k, v, table, kv_lens, scale=0.5, backend="reference")
    want, _ = oracle(as64(q), as64(k), as64(v), np_table, kv_list, [1, 1, 1], 0.5)
    np.testing.assert_allclose(as64(out), want, atol=2e-5)


def test_empty_sequences_and_empty_batch():
    rng = np.random.default_rng(4)
    # q_lens 0 (a sequence waiting this step), kv_lens 0 (nothing yet), a full row
    check(make_case(rng, [(0, 5), (0, 0), (3, 6), (0, 0)], share=False))
    q, k, v, table, kv_lens, q_lens, *_ = make_case(rng, [(0, 0), (0, 3)], share=False)
    out, lse = paged_attention(q, k, v, table, kv_lens, q_lens=q_lens, scale=1.0, return_lse=True,
                               backend="reference")
    assert out.shape == (0, 4, 16) and lse.shape == (0, 4)


def test_extreme_scale_stays_finite():
    # every row sees at least its own key (q_lens <= kv_lens), so no row is
    # empty here; logits saturate as in the dense op
    rng = np.random.default_rng(5)
    q, k, v, table, kv_lens, q_lens, *_ = make_case(rng, [(2, 5), (1, 3)])
    for scale in (3e38, -3e38, 0.0):
        out = paged_attention(q, k, v, table, kv_lens, q_lens=q_lens, scale=scale, backend="reference")
        assert np.isfinite(as64(out)).all()


def test_quantized_pages_match_the_oracle_on_dequantized_pages():
    rng = np.random.default_rng(6)
    for bits in (4, 8):
        q, k, v, table, kv_lens, q_lens, np_table, kv_list, q_list = make_case(rng, MIXED, dim=64)
        kq, vq = mx.quantize(k, group_size=32, bits=bits), mx.quantize(v, group_size=32, bits=bits)
        k_deq, v_deq = mx.dequantize(*kq, group_size=32, bits=bits), mx.dequantize(*vq, group_size=32, bits=bits)
        out = quantized_paged_attention(q, kq, vq, table, kv_lens, q_lens=q_lens, scale=0.2, group_size=32,
                                        bits=bits, window_size=6, backend="reference")
        want, _ = oracle(as64(q), as64(k_deq), as64(v_deq), np_table, kv_list, q_list, 0.2, window=6)
        np.testing.assert_allclose(as64(out), want, atol=1e-4, rtol=1e-4)
        # and quantization error stays small against the float pages
        exact, _ = oracle(as64(q), as64(k), as64(v), np_table, kv_list, q_list, 0.2, window=6)
        assert np.abs(as64(out) - exact).max() < (0.5 if bits == 4 else 0.05)


def test_gradients_raise():
    rng = np.random.default_rng(7)
    q, k, v, table, kv_lens, q_lens, *_ = make_case(rng, MIXED)

    def loss(q, k):
        return paged_attention(q, k, v, table, kv_lens, q_lens=q_lens, scale=1.0, backend="reference").sum()

    with pytest.raises(ValueError, match="inference only"):
        mx.grad(loss)(q, k)
    with pytest.raises(ValueError, match="inference only"):
        mx.jvp(lambda q: paged_attention(q, k, v, table, kv_lens, q_lens=q_lens, scale=1.0, backend="reference"),
               [q], [q])


def test_path_reference_backend():
    rng = np.random.default_rng(8)
    q, k, v, table, kv_lens, q_lens, *_ = make_case(rng, MIXED)
    assert paged_attention_path(q, k, v, table, kv_lens, q_lens=q_lens, backend="reference") == "reference"


def _bad_calls(q, k, v, table, kv_lens, q_lens):
    i32 = lambda a: mx.array(np.asarray(a, np.int32))  # noqa: E731
    bad_table = np.array(table)
    ok = dict(q_lens=q_lens, scale=1.0)
    yield "block_table", (q, k, v, table.astype(mx.int64), kv_lens), ok
    yield "kv_lens", (q, k, v, table, kv_lens.astype(mx.float32)), ok
    yield "q_lens", (q, k, v, table, kv_lens), dict(ok, q_lens=q_lens[:-1])
    yield "q and k_pages", (q[:, :, :-1], k, v, table, kv_lens), ok  # head dims differ
    yield "q must", (q[0], k, v, table, kv_lens), ok
    yield "k_pages", (q, k.astype(mx.int32), v, table, kv_lens), ok
    yield "v_pages", (q, k, v[:, :, :-1], table, kv_lens), ok
    yield "query heads", (q, mx.repeat(k[:, :1], 3, axis=1), mx.repeat(v[:, :1], 3, axis=1), table, kv_lens), ok
    neg = bad_table.copy(); neg[1, 0] = -1  # noqa: E702
    yield "block_table\\[1, 0\\]", (q, k, v, i32(neg), kv_lens), ok
    big = bad_table.copy(); big[1, 3] = k.shape[0]  # noqa: E702
    yield "block_table\\[1, 3\\]", (q, k, v, i32(big), kv_lens), ok
    longer = np.array(kv_lens); longer[0] = table.shape[1] * k.shape[2] + 1  # noqa: E702
    yield "block_table has only", (q, k, v, table, i32(longer)), ok
    yield "q_lens must not exceed kv_lens", (q, k, v, table, kv_lens), dict(ok, q_lens=i32([1, 5, 2, 6, 1]))
    yield "sums to", (q, k, v, table, kv_lens), dict(ok, q_lens=i32([1, 5, 1, 6, 1]))
    yield "kv_lens must be >= 0", (q, k, v, table, i32([-1, 13, 1, 7, 4])), dict(ok, q_lens=i32([0, 5, 1, 7, 1]))
    yield "sinks", (q, k, v, table, kv_lens), dict(ok, sinks=mx.zeros((3,)))
    yield "window_size", (q, k, v, table, kv_lens), dict(ok, window_size=0)
    yield "window_size needs causal", (q, k, v, table, kv_lens), dict(ok, window_size=2, causal=False)
    yield "causal", (q, k, v, table, kv_lens), dict(ok, causal="yes")
    yield "scale", (q, k, v, table, kv_lens), dict(ok, scale=float("nan"))
    yield "backend", (q, k, v, table, kv_lens), dict(ok, backend="gpu")
    yield "return_lse", (q, k, v, table, kv_lens), dict(ok, return_lse=1)
    yield "stream", (q, k, v, table, kv_lens), dict(ok, stream="cpu")


def test_bad_arguments_raise_value_errors_naming_them():
    rng = np.random.default_rng(9)
    q, k, v, table, kv_lens, q_lens, *_ = make_case(rng, MIXED)
    for name, args, kwargs in _bad_calls(q, k, v, table, kv_lens, q_lens):
        with pytest.raises(ValueError, match=name):
            paged_attention(*args, **kwargs)
            pytest.fail(f"no error for the case {name!r}")


def test_entries_past_the_used_pages_are_never_read():
    rng = np.random.default_rng(10)
    q, k, v, table, kv_lens, q_lens, np_table, kv_list, q_list = make_case(rng, [(1, 4), (2, 9)])
    padded = np.concatenate([np_table, np.full((2, 3), 12345, np.int32)], axis=1)
    out = paged_attention(q, k, v, mx.array(padded), kv_lens, q_lens=q_lens, scale=0.5, backend="reference")
    want, _ = oracle(as64(q), as64(k), as64(v), np_table, kv_list, q_list, 0.5)
    np.testing.assert_allclose(as64(out), want, atol=2e-5)


def test_quantized_bad_triples():
    rng = np.random.default_rng(11)
    q, k, v, table, kv_lens, q_lens, *_ = make_case(rng, MIXED, dim=64)
    kq, vq = mx.quantize(k, group_size=64, bits=8), mx.quantize(v, group_size=64, bits=8)
    with pytest.raises(ValueError, match="k_pages"):
        quantized_paged_attention(q, kq[:2], vq, table, kv_lens, q_lens=q_lens, scale=1.0)
    with pytest.raises(ValueError, match="bits"):
        quantized_paged_attention(q, kq, vq, table, kv_lens, q_lens=q_lens, scale=1.0, bits=3)
    with pytest.raises(ValueError, match="v_pages"):
        v4 = mx.quantize(v, group_size=64, bits=4)
        quantized_paged_attention(q, kq, v4, table, kv_lens, q_lens=q_lens, scale=1.0, bits=8)


@st.composite
def ragged(draw):
    batch = draw(st.integers(1, 4))
    seqs = []
    for _ in range(batch):
        kv = draw(st.integers(0, 12))
        seqs.append((draw(st.integers(0, kv)), kv))
    return dict(
        seqs=seqs, page_size=draw(st.sampled_from([1, 3, 4, 8])), kv_heads=draw(st.sampled_from([1, 2])),
        group=draw(st.sampled_from([1, 3])), window=draw(st.one_of(st.none(), st.integers(1, 6))),
        causal=draw(st.booleans()), sinks=draw(st.booleans()), share=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ragged())
def test_random_ragged_batches(p):
    rng = np.random.default_rng(p["seed"])
    heads = p["kv_heads"] * p["group"]
    case = make_case(rng, p["seqs"], heads=heads, kv_heads=p["kv_heads"], dim=8, page_size=p["page_size"],
                     share=p["share"])
    sinks = mx.array(rng.standard_normal(heads).astype(np.float32)) if p["sinks"] else None
    causal = p["causal"] or p["window"] is not None
    check(case, causal=causal, window=p["window"], sinks=sinks)
