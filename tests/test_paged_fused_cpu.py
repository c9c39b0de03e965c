"""mlx_attn.paged on the fused CPU kernel (path "fused-cpu"): paged, ragged
attention against the float64 NumPy oracle of tests/paged_cases.py, on ragged
batches with shared pages, decode rows mixed with chunked-prefill rows, GQA,
every dtype, page sizes that do and do not divide the kernel's key block, and
quantized pages. The edge contract (bad block tables, lengths past the table)
is checked at the host and, for direct callers of _ext, in the kernel."""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_attn import _native
from paged_cases import MIXED, as64, make_case, oracle
from mlx_attn.paged import (
    paged_attention,
    paged_attention_path,
    quantized_paged_attention,
    quantized_paged_attention_path,
)

pytestmark = pytest.mark.skipif(_native.ext is None, reason="the fused paged kernel needs mlx_attn._ext")

FULL_GRID = os.environ.get("MLX_ATTN_FULL_GRID") == "1"
TOLERANCE = {mx.float32: 3e-5, mx.float16: 4e-3, mx.bfloat16: 3e-2}


def check(case, *, dtype=mx.float32, scale=0.37, causal=True, window=None, sinks=None, lse=True, atol=None,
          softcap=None):
    q, k, v, table, kv_lens, q_lens, np_table, kv_list, q_list = case
    assert paged_attention_path(q, k, v, table, kv_lens, q_lens=q_lens, scale=scale, causal=causal,
                                window_size=window, sinks=sinks, return_lse=lse, softcap=softcap) == "fused-cpu"
    got = paged_attention(q, k, v, table, kv_lens, q_lens=q_lens, scale=scale, causal=causal, window_size=window,
                          sinks=sinks, return_lse=lse, backend="fused", softcap=softcap)
    out, got_lse = got if lse else (got, None)
    want, want_lse = oracle(as64(q), as64(k), as64(v), np_table, kv_list, q_list, scale, causal, window,
                            None if sinks is None else as64(sinks), softcap)
    assert out.shape == (q.shape[0], q.shape[1], v.shape[3]) and out.dtype == dtype
    tol = atol or TOLERANCE[dtype]
    np.testing.assert_allclose(as64(out), want, atol=tol, rtol=tol)
    if lse:
        assert got_lse.dtype == mx.float32 and got_lse.shape == q.shape[:2]
        np.testing.assert_allclose(np.asarray(got_lse), want_lse, atol=1e-4, rtol=1e-4)


# keys across several 64-key blocks, an empty query chunk
LONG = [(1, 200), (37, 150), (1, 64), (1, 65), (0, 40), (70, 70), (1, 1)]


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_mixed_decode_and_chunked_prefill_with_shared_pages(dtype):
    rng = np.random.default_rng(0)
    check(make_case(rng, MIXED, dtype=dtype), dtype=dtype)


# page sizes below the in-place run length (packed blocks), dividing the
# 64-key block, and not dividing it either way
PAGE_SIZES = [1, 3, 16, 48, 64, 100] if FULL_GRID else [3, 16, 100]


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_page_sizes_across_key_blocks(page_size):
    rng = np.random.default_rng(page_size)
    check(make_case(rng, LONG, heads=8, kv_heads=2, dim=32, page_size=page_size))


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_long_sequences_in_16_bit(dtype):
    rng = np.random.default_rng(11)
    check(make_case(rng, LONG, heads=8, kv_heads=2, dim=64, page_size=16, dtype=dtype), dtype=dtype, scale=0.125)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_gqa_mqa_mha(kv_heads):
    rng = np.random.default_rng(1)
    check(make_case(rng, MIXED, heads=4, kv_heads=kv_heads))


def test_window_sinks_not_causal_and_value_dim():
    rng = np.random.default_rng(2)
    case = make_case(rng, LONG, heads=4, kv_heads=1, dim=16, value_dim=8, page_size=16)
    sinks = mx.array(rng.standard_normal(4).astype(np.float32))
    check(case, window=3)
    check(case, window=70, sinks=sinks)
    check(case, sinks=sinks)
    check(case, causal=False)
    check(case, causal=False, sinks=sinks, lse=False)


def test_head_dim_128_decode_batch():
    rng = np.random.default_rng(3)
    seqs = [(1, int(n)) for n in rng.integers(1, 400, 12)]
    check(make_case(rng, seqs, heads=16, kv_heads=4, dim=128, page_size=32), scale=128**-0.5)


def test_fused_matches_reference_path():
    rng = np.random.default_rng(4)
    q, k, v, table, kv_lens, q_lens, *_ = make_case(rng, LONG, page_size=16)
    fused = paged_attention(q, k, v, table, kv_lens, q_lens=q_lens, scale=0.3, window_size=50)
    reference = paged_attention(q, k, v, table, kv_lens, q_lens=q_lens, scale=0.3, window_size=50,
                                backend="reference")
    np.testing.assert_allclose(np.asarray(fused), np.asarray(reference), atol=2e-5, rtol=2e-5)


def test_default_q_lens_is_decode_and_mixed_dtypes_promote():
    rng = np.random.default_rng(5)
    q, k, v, table, kv_lens, _, np_table, kv_list, _ = make_case(rng, [(1, 6), (1, 3), (1, 11)])
    out = paged_attention(q.astype(mx.float16), k, v.astype(mx.bfloat16), table, kv_lens, scale=0.5)
    assert out.dtype == mx.float32
    want, _ = oracle(as64(q.astype(mx.float16)), as64(k), as64(v.astype(mx.bfloat16)), np_table, kv_list,
                     [1, 1, 1], 0.5)
    np.testing.assert_allclose(as64(out), want, atol=3e-5)


def test_strided_views_are_read_in_place():
    rng = np.random.default_rng(6)
    q, k, v, table, kv_lens, q_lens, np_table, kv_list, q_list = make_case(rng, LONG, page_size=16)
    # q rows with a head-major layout, pages with the feature axis strided,
    # a block table column slice
    q_t = mx.array(np.ascontiguousarray(np.asarray(q).transpose(1, 0, 2))).transpose(1, 0, 2)
    k_wide = mx.concatenate([k, k], axis=3)[..., ::2]
    wide_table = mx.concatenate([table, table], axis=1)[:, : table.shape[1]]
    out = paged_attention(q_t, k_wide, v, wide_table, kv_lens, q_lens=q_lens, scale=0.4)
    want, _ = oracle(as64(q), as64(k_wide), as64(v), np_table, kv_list, q_list, 0.4)
    np.testing.assert_allclose(as64(out), want, atol=3e-5, rtol=3e-5)


def test_empty_sequences_and_empty_batch():
    rng = np.random.default_rng(7)
    check(make_case(rng, [(0, 5), (0, 0), (3, 6), (0, 0)], share=False))
    q, k, v, table, kv_lens, q_lens, *_ = make_case(rng, [(0, 0), (0, 3)], share=False)
    out, lse = paged_attention(q, k, v, table, kv_lens, q_lens=q_lens, scale=1.0, return_lse=True, backend="fused")
    assert out.shape == (0, 4, 16) and lse.shape == (0, 4)


def test_extreme_scale_stays_finite():
    rng = np.random.default_rng(8)
    q, k, v, table, kv_lens, q_lens, *_ = make_case(rng, [(2, 70), (1, 3)], page_size=16)
    for scale in (3e38, -3e38, 0.0):
        out = paged_attention(q, k, v, table, kv_lens, q_lens=q_lens, scale=scale, backend="fused")
        assert np.isfinite(as64(out)).all()


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_softcap_caps_the_logits_in_the_fused_kernel(dtype):
    """Logits large enough that the cap (1.5) changes every softmax; with a
    window and sinks, and ragged rows across several key blocks."""
    case = make_case(np.random.default_rng(17), LONG, dim=32, page_size=7, dtype=dtype)
    sinks = mx.array(np.linspace(-1, 1, 4).astype(np.float32)).astype(dtype)
    check(case, dtype=dtype, scale=0.9, window=90, sinks=sinks, softcap=1.5)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_pages_match_the_oracle_on_dequantized_pages(bits):
    rng = np.random.default_rng(9)
    for dtype, page_size in [(mx.float32, 16), (mx.float16, 5)]:
        q, k, v, table, kv_lens, q_lens, np_table, kv_list, q_list = make_case(
            rng, LONG, dim=64, page_size=page_size, dtype=dtype)
        kq, vq = mx.quantize(k, group_size=32, bits=bits), mx.quantize(v, group_size=32, bits=bits)
        k_deq, v_deq = (mx.dequantize(*t, group_size=32, bits=bits) for t in (kq, vq))
        assert quantized_paged_attention_path(q, kq, vq, table, kv_lens, q_lens=q_lens, group_size=32,
                                              bits=bits) == "fused-cpu"
        out, lse = quantized_paged_attention(q, kq, vq, table, kv_lens, q_lens=q_lens, scale=0.2, group_size=32,
                                             bits=bits, window_size=60, return_lse=True, backend="fused")
        want, want_lse = oracle(as64(q), as64(k_deq), as64(v_deq), np_table, kv_list, q_list, 0.2, window=60)
        tol = 1e-4 if dtype == mx.float32 else 4e-3
        np.testing.assert_allclose(as64(out), want, atol=tol, rtol=tol)
        np.testing.assert_allclose(np.asarray(lse), want_lse, atol=1e-3, rtol=1e-3)


def test_gradients_raise():
    rng = np.random.default_rng(10)
    q, k, v, table, kv_lens, q_lens, *_ = make_case(rng, MIXED)

    def loss(q, k):
        return paged_attention(q, k, v, table, kv_lens, q_lens=q_lens, scale=1.0).sum()

    with pytest.raises(ValueError, match="inference only"):
        mx.grad(loss)(q, k)


def test_backends_and_paths():
    rng = np.random.default_rng(12)
    q, k, v, table, kv_lens, q_lens, *_ = make_case(rng, MIXED)
    assert paged_attention_path(q, k, v, table, kv_lens, q_lens=q_lens) == "fused-cpu"
    assert paged_attention_path(q, k, v, table, kv_lens, q_lens=q_lens, backend="reference") == "reference"
    assert paged_attention_path(q, k, v, table, kv_lens, q_lens=q_lens, stream=mx.cpu) == "fused-cpu"
    # head dims past the kernel's limit (1024): auto falls back, fused says why
    wide = [mx.zeros((a.shape[0], a.shape[1], 1030)) for a in (q,)] + [
        mx.zeros((*k.shape[:3], 1030)), mx.zeros((*v.shape[:3], 1030))]
    assert paged_attention_path(wide[0], wide[1], wide[2], table, kv_lens, q_lens=q_lens) == "reference"
    with pytest.raises(ValueError, match="backend='fused' is not possible.*head dims"):
        paged_attention(wide[0], wide[1], wide[2], table, kv_lens, q_lens=q_lens, scale=1.0, backend="fused")


def test_bad_block_tables_raise_at_the_host():
    rng = np.random.default_rng(13)
    q, k, v, table, kv_lens, q_lens, np_table, *_ = make_case(rng, MIXED)
    for value, where in [(-1, (1, 0)), (k.shape[0], (1, 3)), (2**31 - 1, (0, 2))]:
        bad = np_table.copy()
        bad[where] = value
        with pytest.raises(ValueError, match=rf"block_table\[{where[0]}, {where[1]}\]"):
            paged_attention(q, k, v, mx.array(bad), kv_lens, q_lens=q_lens, scale=1.0)
    longer = np.array(kv_lens)
    longer[0] = table.shape[1] * k.shape[2] + 1
    with pytest.raises(ValueError, match="block_table has only"):
        paged_attention(q, k, v, table, mx.array(longer), q_lens=q_lens, scale=1.0)


def test_the_kernel_never_reads_outside_its_buffers():
    """Direct callers of _ext skip the host checks: sequences whose entries or
    lengths fall outside the buffers get NaN rows, the others their values."""
    rng = np.random.default_rng(14)
    q, k, v, table, kv_lens, q_lens, np_table, kv_list, q_list = make_case(rng, MIXED, share=False)
    want, _ = oracle(as64(q), as64(k), as64(v), np_table, kv_list, q_list, 0.5)
    bad = np_table.copy()
    bad[1, 2] = 1 << 30  # sequence 1 (rows 1..5) reads a page far outside
    too_long = np.array(kv_lens, np.int32)
    too_long[3] = 10**6  # sequence 3 (rows 7..13) runs past its table row
    out = _native.ext.paged_attention(q, [k], [v], mx.array(bad), mx.array(too_long), q_lens, scale=0.5)[0]
    got = as64(out)
    poisoned = np.zeros(q.shape[0], bool)
    poisoned[1:6] = poisoned[7:14] = True
    assert np.isnan(got[poisoned]).all()
    np.testing.assert_allclose(got[~poisoned], want[~poisoned], atol=3e-5)
    # q_lens summing past the rows q has: sequence 3 (rows 7..13) does not
    # fit in 12 rows, the sequences before it are computed
    out = as64(_native.ext.paged_attention(q[:12], [k], [v], table, kv_lens, q_lens, scale=0.5)[0])
    np.testing.assert_allclose(out[:7], want[:7], atol=3e-5)
    assert np.isnan(out[7:]).all()


def test_extra_memory_is_tiles_not_the_kv():
    """The fused path allocates tiles and a work list, O(rows x D); gathering
    would copy every live key and value."""
    rng = np.random.default_rng(15)
    seqs = [(1, 1500)] * 8
    q, k, v, table, kv_lens, q_lens, *_ = make_case(rng, seqs, heads=8, kv_heads=2, dim=64, page_size=16,
                                                     share=False)
    mx.eval(q, k, v, table, kv_lens, q_lens)
    kv_bytes = k.nbytes + v.nbytes
    out = paged_attention(q, k, v, table, kv_lens, q_lens=q_lens, scale=0.1)  # warm-up (host reads, pool)
    mx.eval(out)
    del out
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    out = paged_attention(q, k, v, table, kv_lens, q_lens=q_lens, scale=0.1)
    mx.eval(out)
    extra = mx.get_peak_memory() - before
    assert extra < kv_bytes / 10, (extra, kv_bytes)


@st.composite
def ragged(draw):
    batch = draw(st.integers(1, 4))
    seqs = []
    for _ in range(batch):
        kv = draw(st.integers(0, 150))
        seqs.append((draw(st.integers(0, min(kv, 20))), kv))
    return dict(
        seqs=seqs, page_size=draw(st.sampled_from([1, 5, 16, 64])), kv_heads=draw(st.sampled_from([1, 2])),
        group=draw(st.sampled_from([1, 3])), window=draw(st.one_of(st.none(), st.integers(1, 80))),
        causal=draw(st.booleans()), sinks=draw(st.booleans()), share=draw(st.booleans()),
        dtype=draw(st.sampled_from([mx.float32, mx.float16])), seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=40 if FULL_GRID else 15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ragged())
def test_random_ragged_batches(p):
    rng = np.random.default_rng(p["seed"])
    heads = p["kv_heads"] * p["group"]
    case = make_case(rng, p["seqs"], heads=heads, kv_heads=p["kv_heads"], dim=8, page_size=p["page_size"],
                     share=p["share"], dtype=p["dtype"])
    sinks = mx.array(rng.standard_normal(heads).astype(np.float32)).astype(p["dtype"]) if p["sinks"] else None
    causal = p["causal"] or p["window"] is not None
    check(case, causal=causal, window=p["window"], sinks=sinks, dtype=p["dtype"])
