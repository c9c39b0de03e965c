"""Cascade (shared-prefix) paged attention on the CPU: against the paged op
over the full tables (prefix pages then each sequence's own pages) and
against the float64 oracle of tests/paged_cases.py on those tables."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_attn import _native, paged, paged_cascade
from mlx_attn.paged import (
    cascade_paged_attention,
    cascade_paged_attention_path,
    paged_attention,
    quantized_cascade_paged_attention,
    quantized_paged_attention,
)
from paged_cases import as64, oracle

pytestmark = pytest.mark.skipif(_native.ext is None, reason="the cascade runs the fused paged kernel")

TOLERANCE = {mx.float32: 3e-5, mx.float16: 4e-3, mx.bfloat16: 3e-2}
ints = lambda a: mx.array(np.asarray(a, np.int32))  # noqa: E731


def make_case(rng, groups, loose=(), *, heads=4, kv_heads=2, dim=16, page_size=4, dtype=mx.float32):
    """``groups``: ``[(prefix_pages, [(q_len, own_keys), ...]), ...]``;
    ``loose``: ``[(q_len, kv_len), ...]`` without a group. Pages scattered in
    a pool, the sequences in a shuffled batch order."""
    seqs = [(g, q_len, own) for g, (_, members) in enumerate(groups) for q_len, own in members]
    seqs += [(-1, q_len, kv) for q_len, kv in loose]
    seqs = [seqs[i] for i in rng.permutation(len(seqs))]
    prefix_lens = [n * page_size for n, _ in groups]
    own_needed = [math.ceil(own / page_size) for _, _, own in seqs]
    num_pages = sum(n for n, _ in groups) + sum(own_needed) + 3
    pool = rng.permutation(num_pages).tolist()
    prefix_pages = [[pool.pop() for _ in range(n)] for n, _ in groups]
    own_pages = [[pool.pop() for _ in range(n)] for n in own_needed]
    prefix_table = np.full((max(1, len(groups)), max([1] + [n for n, _ in groups])), -1, np.int32)
    for g, pages in enumerate(prefix_pages):
        prefix_table[g, : len(pages)] = pages
    block_table = np.full((len(seqs), max([1] + own_needed)), -1, np.int32)
    full_rows = []
    for b, pages in enumerate(own_pages):
        block_table[b, : len(pages)] = pages
        g = seqs[b][0]
        full_rows.append((prefix_pages[g] if g >= 0 else []) + pages)
    full_table = np.full((len(seqs), max(1, max((len(r) for r in full_rows), default=1))), -1, np.int32)
    for b, row in enumerate(full_rows):
        full_table[b, : len(row)] = row
    kv_lens = [(prefix_lens[g] if g >= 0 else 0) + own for g, _, own in seqs]
    q_lens = [q_len for _, q_len, _ in seqs]
    as_dtype = lambda a: mx.array(a.astype(np.float32)).astype(dtype)  # noqa: E731
    return dict(
        q=as_dtype(rng.standard_normal((sum(q_lens), heads, dim))),
        k=as_dtype(rng.standard_normal((num_pages, kv_heads, page_size, dim))),
        v=as_dtype(rng.standard_normal((num_pages, kv_heads, page_size, dim))),
        prefix_table=ints(prefix_table), prefix_lens=ints(prefix_lens or [0]),
        prefix_groups=ints([g for g, _, _ in seqs]), block_table=ints(block_table), kv_lens=ints(kv_lens),
        q_lens=ints(q_lens), full_table=full_table, kv_list=kv_lens, q_list=q_lens)


def cascade(case, **options):
    return cascade_paged_attention(case["q"], case["k"], case["v"], case["prefix_table"], case["prefix_lens"],
                                   case["prefix_groups"], case["block_table"], case["kv_lens"],
                                   q_lens=case["q_lens"], return_lse=True, **options)


def paged_full(case, **options):
    return paged_attention(case["q"], case["k"], case["v"], ints(case["full_table"]), case["kv_lens"],
                           q_lens=case["q_lens"], return_lse=True, **options)


def oracle_full(case, *, scale, causal=True, window_size=None, sinks=None, softcap=None):
    return oracle(as64(case["q"]), as64(case["k"]), as64(case["v"]), case["full_table"], case["kv_list"],
                  case["q_list"], scale, causal, window_size, None if sinks is None else as64(sinks), softcap)


def check(case, dtype=mx.float32, **options):
    """The cascade against the paged op over the full tables (float32: within
    1e-6) and against the float64 oracle."""
    options.setdefault("scale", 0.37)
    out, lse = cascade(case, backend="fused", **options)
    assert out.dtype == dtype and out.shape == case["q"].shape and lse.dtype == mx.float32
    want, want_lse = oracle_full(case, **options)
    tol = TOLERANCE[dtype]
    np.testing.assert_allclose(as64(out), want, atol=tol, rtol=tol)
    finite = np.isfinite(want_lse)
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
    np.testing.assert_allclose(np.asarray(lse)[finite], want_lse[finite], atol=1e-4, rtol=1e-4)
    if dtype == mx.float32:
        paged_out, paged_lse = paged_full(case, backend="fused", **options)
        np.testing.assert_allclose(np.asarray(out), np.asarray(paged_out), atol=1e-6, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(lse), np.asarray(paged_lse), atol=1e-6, rtol=1e-6)
    return out, lse


# two groups (3 and 5 sequences) plus loose sequences: decode rows, chunks,
# own suffixes of 0 to 30 keys, a waiting sequence, a row at the prefix's last key
GROUPS = [(2, [(1, 5), (6, 9), (1, 1), (0, 3)]), (3, [(1, 30), (4, 4), (1, 0), (2, 17), (1, 12)]),
          (1, [(1, 2)])]
LOOSE = [(1, 7), (3, 10)]


@pytest.mark.parametrize("options", [
    {},
    dict(window_size=14),  # a window that ends inside the prefix for some rows
    dict(window_size=3),  # windows that exclude the prefix entirely
    dict(window_size=60),  # windows that hold everything
    dict(sinks=mx.array([2.0, -1.0, 0.5, 3.0])),
    dict(softcap=1.2, scale=0.9),
    dict(causal=False),
    dict(window_size=11, sinks=mx.array([1.0, 0.0, -2.0, 2.5]), softcap=2.0),
], ids=["causal", "window-in-prefix", "window-past-prefix", "window-all", "sinks", "softcap", "not-causal",
        "window-sinks-softcap"])
def test_matches_paged_over_full_tables_and_oracle(options):
    check(make_case(np.random.default_rng(1), GROUPS, LOOSE), **options)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_16_bit(dtype):
    case = make_case(np.random.default_rng(2), GROUPS, LOOSE, dim=32, page_size=16, dtype=dtype)
    check(case, dtype, window_size=40, sinks=mx.array([0.5, 1.0, -1.0, 0.0]).astype(dtype))


def test_group_sizes_prefix_lengths_gqa_and_long_prefixes():
    rng = np.random.default_rng(3)
    for members in range(1, 6):
        for prefix_pages in (1, 2, 3):
            groups = [(prefix_pages, [(int(rng.integers(0, 3)) or 1, int(rng.integers(1, 9)))
                                      for _ in range(members)])]
            for kv_heads in (1, 4):
                check(make_case(rng, groups, heads=4, kv_heads=kv_heads), scale=0.5)
    # several 64-key blocks in the prefix, pages that do not divide 64, GQA 4
    long = [(11, [(1, 20), (33, 40), (1, 1), (1, 70)]), (5, [(1, 3)] * 5)]
    check(make_case(rng, long, [(1, 90)], heads=8, kv_heads=2, dim=64, page_size=7), window_size=100)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_pages(bits):
    rng = np.random.default_rng(4)
    case = make_case(rng, GROUPS, LOOSE, dim=64, page_size=16)
    kq, vq = (mx.quantize(case[n], group_size=32, bits=bits) for n in ("k", "v"))
    args = (case["q"], kq, vq, case["prefix_table"], case["prefix_lens"], case["prefix_groups"],
            case["block_table"], case["kv_lens"])
    options = dict(q_lens=case["q_lens"], scale=0.2, group_size=32, bits=bits, window_size=40,
                   sinks=mx.array([0.3, 1.0, 2.0, -1.0]), return_lse=True)
    assert cascade_paged_attention_path(*args, **{k: v for k, v in options.items() if k != "return_lse"}) \
        == "cascade-cpu"
    out, lse = quantized_cascade_paged_attention(*args, backend="fused", **options)
    want, want_lse = quantized_paged_attention(case["q"], kq, vq, ints(case["full_table"]), case["kv_lens"],
                                               backend="fused", **options)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), atol=1e-6, rtol=1e-6)
    deq = {n: mx.dequantize(*t, group_size=32, bits=bits) for n, t in (("k", kq), ("v", vq))}
    want64, _ = oracle_full(dict(case, **deq), scale=0.2, window_size=40, sinks=options["sinks"])
    np.testing.assert_allclose(as64(out), want64, atol=1e-4, rtol=1e-4)


def test_the_prefix_is_one_pass_per_group():
    """16 decode rows over one shared prefix: one pseudo-sequence of 16 rows
    over the prefix pages, one per sequence over its own pages, no direct row."""
    case = make_case(np.random.default_rng(5), [(4, [(1, 6)] * 16)], page_size=16)
    q_lens, kv_lens = case["q_list"], case["kv_list"]
    plan = _plan(case, causal=True, window_size=None)
    assert plan.prefix.q_lens == [16] and plan.prefix.kv_lens == [64]
    assert plan.suffix.q_lens == [1] * 16 and plan.suffix.kv_lens == [6] * 16
    assert not plan.direct.rows and len(q_lens) == len(kv_lens) == 16
    # a window past key 0 sends a row to the direct pass (its whole table); others stay
    plan = _plan(case, causal=True, window_size=69)  # row 69 sees keys 1..69
    assert not plan.prefix.rows and plan.direct.q_lens == [1] * 16
    check(case, window_size=69)
    assert not _plan(case, causal=True, window_size=70).direct.rows  # keys 0..69: the cascade


def _plan(case, **options):
    from mlx_attn.paged import CascadeTables, _prepare_cascade

    tables = CascadeTables(case["prefix_table"], case["prefix_lens"], case["prefix_groups"], case["block_table"],
                           case["kv_lens"], case["q_lens"])
    call = _prepare_cascade(case["q"], case["k"], case["v"], tables, 0.3, options["causal"], options["window_size"],
                            None, "auto", False, None, None)
    return call.plan


def test_a_merge_that_drops_a_side_or_counts_sinks_twice_fails(monkeypatch):
    """The checks above catch the two faults a cascade merge invites (in the
    MLX-op merge; the C++ merge's: the next test)."""
    monkeypatch.setattr(paged_cascade, "FUSED_MERGE", False)
    case = make_case(np.random.default_rng(6), GROUPS, LOOSE)
    sinks = mx.array([2.0, -1.0, 0.5, 3.0])
    check(case, sinks=sinks)
    merge = paged_cascade.merge_splits

    def drop(keep):
        return lambda outs, lses, sinks, dtype: merge(keep(outs), keep(lses), sinks, dtype)

    monkeypatch.setattr(paged_cascade, "merge_splits", drop(lambda parts: parts[:1]))  # suffix only
    with pytest.raises(AssertionError):
        check(case)
    monkeypatch.setattr(paged_cascade, "merge_splits", drop(lambda parts: parts[1:]))  # prefix only
    with pytest.raises(AssertionError):
        check(case)

    def sinks_twice(outs, lses, sinks, dtype):
        sink = mx.broadcast_to(sinks.astype(mx.float32)[None], lses[0].shape)
        return merge(outs + [mx.zeros_like(outs[0])], lses + [sink], sinks, dtype)

    monkeypatch.setattr(paged_cascade, "merge_splits", sinks_twice)
    with pytest.raises(AssertionError):
        check(case, sinks=sinks)
    monkeypatch.setattr(paged_cascade, "merge_splits", merge)
    check(case, sinks=sinks)


def test_the_fused_merge_equals_the_mlx_merge_and_its_faults_fail(monkeypatch):
    """The one-primitive cascade (csrc/ops/cascade_attention.cpp: passes and
    merge) gives the separate passes' MLX-op merge's result (key splits,
    direct rows, sinks, rows that see nothing); the separate passes' C++
    merge (csrc/ops/cascade_merge.cpp, the rows' merge both share) passes
    the checks, which catch it merging without the suffix, without the
    prefix, or with the sinks twice."""
    import types

    monkeypatch.setattr(paged, "_cpu_kernel_threads", lambda: 4)  # key splits
    case = make_case(np.random.default_rng(16), [(40, [(1, 9), (3, 20), (1, 0)]), (2, [(2, 5), (0, 3)])],
                     [(1, 30), (0, 0)], page_size=16)
    sinks = mx.array([1.0, -2.0, 0.5, 3.0])
    for dtype_case, options in ((case, dict(sinks=sinks, window_size=650)), (case, dict(softcap=2.0)),
                                (case, dict(causal=False))):
        fused = cascade(dtype_case, scale=0.4, **options)
        monkeypatch.setattr(paged_cascade, "FUSED_MERGE", False)
        plain = cascade(dtype_case, scale=0.4, **options)
        monkeypatch.setattr(paged_cascade, "FUSED_MERGE", True)
        np.testing.assert_allclose(np.asarray(fused[0]), np.asarray(plain[0]), atol=1e-6, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(fused[1]), np.asarray(plain[1]), atol=1e-6, rtol=1e-6)
        check(dtype_case, **options)
    half = make_case(np.random.default_rng(17), GROUPS, LOOSE, dim=32, page_size=16, dtype=mx.float16)
    check(half, mx.float16, sinks=mx.array([0.5, 1.0, -1.0, 0.0]).astype(mx.float16))

    real = paged_cascade._native.ext

    def seeded(fault):
        def merge(s_out, s_lse, p_out, p_lse, d_out, d_lse, s_index, p_index, d_index, sink, dtype):
            args = fault(list((s_out, s_lse, p_out, p_lse, d_out, d_lse, s_index, p_index, d_index, sink)))
            return real.cascade_merge(*args, dtype)

        return types.SimpleNamespace(ext=types.SimpleNamespace(cascade_merge=merge))

    def no_suffix(a):
        a[6] = mx.full(a[6].shape, -1, mx.int32)
        return a

    def no_prefix(a):
        a[7] = mx.full(a[7].shape, -1, mx.int32)
        return a

    def sinks_twice(a):  # the sink once more as a partial: a prefix "split" of value zero and lse = sink
        rows, heads = a[6].shape[0], a[9].shape[0]
        a[2] = mx.concatenate([a[2], mx.zeros((rows,) + a[2].shape[1:], a[2].dtype)])
        a[3] = mx.concatenate([a[3], mx.broadcast_to(a[9][None], (rows, heads))])
        extra = mx.arange(rows, dtype=mx.int32) + a[2].shape[0] - rows
        a[7] = mx.concatenate([a[7], extra[None]])
        return a

    for fault in (no_suffix, no_prefix, sinks_twice):
        monkeypatch.setattr(paged_cascade, "_native", seeded(fault))
        with pytest.raises(AssertionError):
            check(case, sinks=sinks)
    monkeypatch.setattr(paged_cascade, "_native", seeded(lambda a: a))
    check(case, sinks=sinks)


def test_reference_backend_and_paths():
    case = make_case(np.random.default_rng(7), GROUPS, LOOSE)
    args = [case[n] for n in ("q", "k", "v", "prefix_table", "prefix_lens", "prefix_groups", "block_table",
                              "kv_lens")]
    assert cascade_paged_attention_path(*args, q_lens=case["q_lens"]) == "cascade-cpu"
    assert cascade_paged_attention_path(*args, q_lens=case["q_lens"], backend="reference") == "reference"
    fused = cascade(case, scale=0.3, window_size=9, sinks=mx.array([1.0, 0.0, 0.0, -1.0]))
    ref = cascade(case, scale=0.3, window_size=9, sinks=mx.array([1.0, 0.0, 0.0, -1.0]), backend="reference")
    for a, b in zip(fused, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6, rtol=2e-6)
    single = cascade_paged_attention(*args, q_lens=case["q_lens"], scale=0.3)
    assert isinstance(single, mx.array) and single.shape == case["q"].shape
    with pytest.raises(ValueError, match="inference only"):
        mx.grad(lambda q: cascade_paged_attention(q, *args[1:], q_lens=case["q_lens"], scale=0.3).sum())(args[0])


def test_the_one_primitive_cascade_refuses_every_transform():
    # the CPU runner calls the primitive without an mx.custom_function around
    # it, so the primitive itself must refuse gradients, jvp and vmap
    case = make_case(np.random.default_rng(17), GROUPS, LOOSE)
    tables = paged.CascadeTables(*(case[n] for n in ("prefix_table", "prefix_lens", "prefix_groups", "block_table",
                                               "kv_lens")), case["q_lens"])
    run = lambda q: tables.attention(q, case["k"], case["v"], scale=0.4)  # noqa: E731
    mx.eval(run(case["q"]))
    assert paged_cascade.fused_cascade_runs(next(iter(tables._plans.values())))
    with pytest.raises(ValueError, match="inference only"):
        mx.grad(lambda q: run(q).sum())(case["q"])
    with pytest.raises(ValueError, match="inference only"):
        mx.jvp(run, [case["q"]], [mx.ones_like(case["q"])])
    with pytest.raises(ValueError, match="no vmap"):
        mx.eval(mx.vmap(run)(case["q"][None]))


def test_no_groups_at_all_is_the_paged_op():
    case = make_case(np.random.default_rng(8), [], [(1, 9), (4, 12), (0, 3)])
    check(case, window_size=5)


def test_bad_shared_levels_raise_naming_the_argument():
    case = make_case(np.random.default_rng(9), [(2, [(1, 5), (2, 3)])], [(1, 4)])
    names = ("q", "k", "v", "prefix_table", "prefix_lens", "prefix_groups", "block_table", "kv_lens")

    def call(**changes):
        args = [changes.get(n, case[n]) for n in names]
        return cascade_paged_attention(*args, q_lens=changes.get("q_lens", case["q_lens"]), scale=0.3)

    groups = np.asarray(case["prefix_groups"])
    member = int(np.argmax(groups == 0))
    cases = [
        (dict(prefix_groups=ints(np.where(groups == 0, 1, groups))), r"prefix_groups\[\d\] = 1 is not a group"),
        (dict(prefix_groups=ints(np.where(groups == 0, -2, groups))), r"prefix_groups\[\d\] = -2"),
        (dict(prefix_groups=ints(groups[:2])), "prefix_groups must have shape"),
        (dict(prefix_groups=mx.array(groups.astype(np.int64))), "prefix_groups must be int32"),
        (dict(prefix_lens=ints([-4])), "prefix_lens must be >= 0"),
        (dict(prefix_lens=ints([8, 8])), "prefix_lens must have shape"),
        (dict(prefix_lens=ints([6])), r"prefix_lens\[0\] = 6 must be a multiple of page_size"),
        (dict(prefix_lens=ints([12])), r"prefix_lens\[0\] = 12 needs 3 pages .* prefix_table has only 2"),
        (dict(prefix_table=ints([[0, 99]])), r"prefix_table\[0, 1\] = 99 is not a page index"),
        (dict(prefix_table=ints([0, 1])), "prefix_table must have rank 2"),
        (dict(kv_lens=ints(np.where(groups == 0, 7, np.asarray(case["kv_lens"])))),
         rf"prefix_lens\[0\] = 8 is longer than sequence {member}"),
        (dict(block_table=ints(np.full_like(np.asarray(case["block_table"]), -1))), r"block_table\[\d, 0\] = -1"),
        (dict(block_table=ints(np.asarray(case["block_table"])[:, :0])), "block_table has only 0 columns"),
        (dict(q_lens=ints(np.asarray(case["q_lens"]) + 1)), "q has .* rows but q_lens sums to"),
    ]
    for changes, message in cases:
        with pytest.raises(ValueError, match=message):
            call(**changes)
    with pytest.raises(ValueError, match="window_size needs causal=True"):
        cascade_paged_attention(*[case[n] for n in names], q_lens=case["q_lens"], scale=0.3, causal=False,
                                window_size=3)


@st.composite
def cascades(draw):
    page_size = draw(st.sampled_from([1, 3, 4, 16]))
    groups = [(draw(st.integers(1, 3)),
               [(draw(st.integers(0, 3)), draw(st.integers(0, 20))) for _ in range(draw(st.integers(1, 5)))])
              for _ in range(draw(st.integers(0, 3)))]
    groups = [(n, [(min(q, n * page_size + own), own) for q, own in members]) for n, members in groups]
    loose = [(draw(st.integers(0, 2)), draw(st.integers(2, 20))) for _ in range(draw(st.integers(0, 2)))]
    options = draw(st.sampled_from([{}, {"window_size": 5}, {"window_size": 17}, {"causal": False},
                                    {"sinks": mx.array([1.5, -0.5])}, {"softcap": 1.0}]))
    return draw(st.integers(0, 2**31 - 1)), page_size, groups, loose, draw(st.sampled_from([1, 2])), options


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cascades())
def test_random_cascades(p):
    seed, page_size, groups, loose, kv_heads, options = p
    case = make_case(np.random.default_rng(seed), groups, loose, heads=2, kv_heads=kv_heads, page_size=page_size)
    check(case, **options)


@pytest.mark.parametrize("threads", [1, 2, 16])
def test_prefix_key_splits_merge_exactly(monkeypatch, threads):
    """A long prefix is cut into key splits (split-K) to give every kernel
    thread work; the splits' partials merge back to the paged result."""
    import mlx_attn.paged as paged

    monkeypatch.setattr(paged, "_cpu_kernel_threads", lambda: threads)
    case = make_case(np.random.default_rng(11), [(129, [(1, 9), (3, 20), (1, 1)]), (40, [(2, 5)])], [(1, 30)],
                     page_size=16)
    plan = _plan(case, causal=True, window_size=None)
    splits = plan.prefix_index.shape[0]
    assert (splits == 1) if threads == 1 else (splits > 1)
    assert all(kv <= 129 * 16 for kv in plan.prefix.kv_lens) and sum(plan.prefix.kv_lens[:splits]) >= 2064
    check(case, sinks=mx.array([1.0, 2.0, -1.0, 0.0]), softcap=3.0)
    check(case, window_size=2070)


def test_head_dims_the_kernel_cannot_run_fall_back_or_raise():
    """D = 1032 is past the CPU kernel's head dims (kMaxHeadDim 1024): "auto"
    runs the paged op over the full tables (its reference path), "fused"
    says why not."""
    case = make_case(np.random.default_rng(12), [(1, [(1, 3), (2, 2)])], [(1, 5)], dim=1032)
    args = [case[n] for n in ("q", "k", "v", "prefix_table", "prefix_lens", "prefix_groups", "block_table",
                              "kv_lens")]
    assert cascade_paged_attention_path(*args, q_lens=case["q_lens"]) == "reference"
    out, _ = cascade(case, scale=0.05)
    want, _ = oracle_full(case, scale=0.05)
    np.testing.assert_allclose(as64(out), want, atol=3e-5, rtol=3e-5)
    with pytest.raises(ValueError, match="backend='fused' is not possible"):
        cascade(case, scale=0.05, backend="fused")


def test_one_cascade_tables_serves_every_layer():
    """A serving step reads, checks and plans its tables once
    (:class:`CascadeTables`) and attends each layer through them: every
    layer's result is the one-off call's, each window rule planned once."""
    from mlx_attn.paged import CascadeTables

    rng = np.random.default_rng(21)
    case = make_case(rng, GROUPS, LOOSE)
    names = ("prefix_table", "prefix_lens", "prefix_groups", "block_table", "kv_lens")
    tables = CascadeTables(*(case[n] for n in names), case["q_lens"])
    for layer, window in enumerate([None, 5, None, 14]):
        pages = {n: mx.array(rng.standard_normal(case[n].shape).astype(np.float32)) for n in ("k", "v")}
        layer_case = dict(case, **pages)
        got = tables.attention(case["q"], pages["k"], pages["v"], scale=0.3 + layer, window_size=window,
                               return_lse=True)
        want = cascade(layer_case, scale=0.3 + layer, window_size=window)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        paged_out, _ = paged_full(layer_case, scale=0.3 + layer, window_size=window)
        np.testing.assert_allclose(np.asarray(got[0]), np.asarray(paged_out), atol=1e-6, rtol=1e-6)
    assert len(tables._plans) == 3 and len(tables._checked) == 1
    # quantized pages through the same tables
    k8, v8 = (mx.quantize(mx.array(rng.standard_normal((case["k"].shape[0], 2, 4, 32)).astype(np.float32)),
                          group_size=32, bits=8) for _ in range(2))
    q32 = mx.array(rng.standard_normal((case["q"].shape[0], 4, 32)).astype(np.float32))
    got = tables.quantized_attention(q32, k8, v8, scale=0.2, group_size=32, bits=8)
    want = quantized_paged_attention(q32, k8, v8, ints(case["full_table"]), case["kv_lens"], q_lens=case["q_lens"],
                                     scale=0.2, group_size=32, bits=8)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    # bad tables raise at the first call, naming the argument, and again at the next
    bad_table = np.asarray(case["prefix_table"]).copy()
    bad_table[0, 0] = 10_000
    bad = CascadeTables(ints(bad_table), *(case[n] for n in names[1:]), case["q_lens"])
    for _ in range(2):
        with pytest.raises(ValueError, match=r"prefix_table\[0, 0\] = 10000"):
            bad.attention(case["q"], case["k"], case["v"], scale=0.3)


def test_tables_rerun_a_checked_call_only_for_its_signature():
    """A :class:`CascadeTables` keeps a checked CPU cascade call per argument
    signature and reruns it on the next layer's arrays: each rerun equals a
    fresh call, another dtype, sinks, return_lse or option is checked and
    planned anew, and arguments the checks refuse still raise after a good
    call of the same shapes."""
    from mlx_attn.paged import CascadeTables

    rng = np.random.default_rng(23)
    case = make_case(rng, GROUPS, LOOSE)
    names = ("prefix_table", "prefix_lens", "prefix_groups", "block_table", "kv_lens")
    tables = CascadeTables(*(case[n] for n in names), case["q_lens"])
    sinks = mx.array([1.0, -0.5, 0.0, 2.0])
    calls = [dict(), dict(return_lse=True), dict(sinks=sinks), dict(window_size=6), dict(causal=False),
             dict(dtype=mx.float16), dict(dtype=mx.float16, sinks=sinks, return_lse=True),
             dict(dtype=mx.float16, pages=mx.float32), dict(dtype=mx.float32, pages=mx.float16)]
    for layer in range(3):
        for options in calls:
            options = dict(options)
            q_dtype = options.pop("dtype", mx.float32)
            pages_dtype = options.pop("pages", q_dtype)
            dtype = mx.result_type(q_dtype, pages_dtype)  # the call's output dtype
            if "sinks" in options:
                options["sinks"] = options["sinks"].astype(dtype)
            layer_case = dict(case, **{n: mx.array(rng.standard_normal(case[n].shape).astype(np.float32)).astype(
                q_dtype if n == "q" else pages_dtype) for n in ("q", "k", "v")})
            got = tables.attention(layer_case["q"], layer_case["k"], layer_case["v"], scale=0.4, **options)
            fresh = CascadeTables(*(case[n] for n in names), case["q_lens"])
            want = fresh.attention(layer_case["q"], layer_case["k"], layer_case["v"], scale=0.4, **options)
            assert type(got) is type(want)
            for a, b in zip(*((g,) if isinstance(g, mx.array) else g for g in (got, want))):
                assert a.dtype == b.dtype == (dtype if a.ndim == 3 else mx.float32)
                np.testing.assert_array_equal(np.asarray(a.astype(mx.float32)), np.asarray(b.astype(mx.float32)))
            if dtype == mx.float32 and "causal" not in options:  # and each rerun is right, not only repeatable
                want_out, _ = oracle_full(layer_case, scale=0.4, window_size=options.get("window_size"),
                                          sinks=options.get("sinks"))
                out = got[0] if isinstance(got, tuple) else got
                np.testing.assert_allclose(as64(out), want_out, atol=3e-5, rtol=3e-5)
    assert len(tables._prepared) == len(calls)
    for bad, match in [(dict(causal=1), "causal must be True or False"), (dict(scale=float("nan")), "scale"),
                       (dict(sinks=mx.array([1.0, 2.0])), "sinks"), (dict(return_lse=0), "return_lse")]:
        with pytest.raises(ValueError, match=match):
            tables.attention(case["q"], case["k"], case["v"], **{"scale": 0.4, **bad})
    # still inference only on a rerun
    with pytest.raises(ValueError, match="inference only"):
        mx.grad(lambda q: tables.attention(q, case["k"], case["v"], scale=0.4).sum())(case["q"])
