"""The fused Metal paged attention kernels (metal/attention_paged.h,
metal/attention_paged_quantized.h), launched from their C++ plan
(csrc/metal/paged_launch_plan.cpp) in the MSL emulator against a float64 NumPy
oracle that reads the pages key by key: ragged batches with shared pages,
page sizes that divide no length, empty sequences, decode rows mixed with
chunked-prefill rows, GQA, causal / window / sinks, the log-sum-exp, and
quantized pages. Block-table columns past a sequence's pages hold -1 and
the page buffers end right after the last page: the emulator's guard pages
fail any read outside a buffer. A representative sample runs by default;
MLX_ATTN_FULL_GRID=1 runs the whole grid with every instantiation."""

from __future__ import annotations

import itertools
import os
import struct

import mlx.core as mx
import numpy as np
import pytest

from kernel_lab import msl_emulator
from mlx_attn import _native, self_check
from kernel_lab.paged_metal_runner import (QUANTIZED_SOURCES, as_float, dense_decode_bytes, oracle, paged_decode_bytes,
                                paged_plan, run_paged, trimmed_sources)
from kernel_lab.metal_runner import REPO, decode_instantiation
from sdpa_cases import TOLERANCE

needs_ext = pytest.mark.skipif(_native.ext is None, reason="the native extension is not built")
needs_clang = pytest.mark.skipif(not msl_emulator.clang_available(), reason="clang-19 is not installed")
pytestmark = [needs_ext, needs_clang]

FULL_GRID = os.environ.get("MLX_ATTN_FULL_GRID") == "1"
DTYPES = {"float32": (mx.float32, "float"), "float16": (mx.float16, "half"), "bfloat16": (mx.bfloat16, "bfloat")}
# the (dtype, D) of the default sample
FLOAT_SAMPLE = [("float32", 64), ("float16", 128), ("bfloat16", 64)]


# Fast math by default, as Metal compiles: the whole sources, the build
# test_metal_kernels.py's family-table test compiles too (one cached build);
# MLX_ATTN_FULL_GRID=1 adds precise math.
@pytest.fixture(scope="module", params=[True, False] if FULL_GRID else [True],
                ids=["fast-math", "precise"] if FULL_GRID else ["fast-math"])
def library(request):
    return msl_emulator.compile_library(QUANTIZED_SOURCES, include_dirs=[REPO], fast_math=request.param)


def ragged_case(dtype, d, *, gqa=4, kv_heads=2, page_size=16, kv_lens=(37, 0, 130, 5, 64), q_lens=(1, 0, 13, 5, 1),
                shared=True, seed=0):
    """q, k_pages, v_pages, block_table and the lengths of a ragged batch:
    pages in a shuffled pool, sequences 0 and 2 sharing their first pages
    (a common prefix) when `shared`, unused table entries -1."""
    rng = np.random.default_rng(seed)
    heads = kv_heads * gqa
    needed = [(n + page_size - 1) // page_size for n in kv_lens]
    max_pages = max(needed) + 1
    num_pages = sum(needed) + 2
    pool = rng.permutation(num_pages)
    table = np.full((len(kv_lens), max_pages), -1, np.int32)
    at = 0
    for b, n in enumerate(needed):
        table[b, :n] = pool[at:at + n]
        at += n
    if shared and len(needed) > 2 and needed[0] and needed[2]:
        prefix = min(needed[0], needed[2]) - 1 or 1
        table[2, :prefix] = table[0, :prefix]
    q = rng.standard_normal((sum(q_lens), heads, d)).astype(np.float32)
    k = rng.standard_normal((num_pages, kv_heads, page_size, d)).astype(np.float32)
    v = rng.standard_normal((num_pages, kv_heads, page_size, d)).astype(np.float32)
    cast = DTYPES[dtype][0]
    return (mx.array(q).astype(cast), mx.array(k).astype(cast), mx.array(v).astype(cast), mx.array(table),
            list(q_lens), list(kv_lens))


def f64(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32), np.float64)


def check_float(library, dtype, d, *, scale=None, causal=True, window_size=None, sinks=False, lse=False, softcap=None,
                gpu_target=None, vector_loads=True, decode_shape="auto", **case):
    q, k, v, table, q_lens, kv_lens = ragged_case(dtype, d, **case)
    scale = d**-0.5 if scale is None else scale
    sink_array = None
    if sinks:  # some above every logit: the sink sets the row max
        sink_array = mx.array((np.random.default_rng(7).standard_normal(q.shape[1]) * 4).astype(np.float32))
        sink_array = sink_array.astype(q.dtype)
    out, got_lse, plan, _ = run_paged(library, q, [k], [v], table, q_lens, kv_lens, scale=scale, causal=causal,
                                      window_size=window_size, sinks=sink_array, return_lse=lse, softcap=softcap,
                                      gpu_target=gpu_target, vector_loads=vector_loads, decode_shape=decode_shape)
    want, want_lse = oracle(f64(q), f64(k), f64(v), np.array(table), q_lens, kv_lens, scale=scale, causal=causal,
                            window_size=window_size, sinks=None if sink_array is None else f64(sink_array),
                            softcap=softcap)
    got = as_float(out, q.dtype)
    assert np.isfinite(got).all(), "a row no kernel wrote, or a NaN"
    err = np.abs(got - want).max(initial=0.0)
    assert err <= TOLERANCE[q.dtype], f"max error {err} ({dtype})"
    if lse:
        assert np.array_equal(np.isneginf(got_lse), np.isneginf(want_lse))
        finite = np.isfinite(want_lse)
        assert np.allclose(got_lse[finite], want_lse[finite], rtol=1e-5, atol=1e-4)
    return plan


MASKS = {"causal": {}, "none": {"causal": False}, "window": {"window_size": 9}, "sinks": {"sinks": True}}
AXES = {"dtype_d": FLOAT_SAMPLE if not FULL_GRID else [(t, d) for t in DTYPES for d in (64, 96, 128, 256)],
        "gqa": (1, 4), "mask": tuple(MASKS), "page_size": (1, 16, 5)}
SAMPLE = [
    dict(dtype_d=("float32", 64), gqa=4, mask="causal", page_size=16),
    dict(dtype_d=("float16", 128), gqa=1, mask="none", page_size=5),
    dict(dtype_d=("bfloat16", 64), gqa=4, mask="window", page_size=16),
    dict(dtype_d=("float32", 64), gqa=1, mask="sinks", page_size=1),
    dict(dtype_d=("float16", 128), gqa=4, mask="sinks", page_size=16),
]
POINTS = [dict(zip(AXES, values)) for values in itertools.product(*AXES.values())] if FULL_GRID else SAMPLE


def point_id(p):
    return f"{p['dtype_d'][0]}-d{p['dtype_d'][1]}-gqa{p['gqa']}-{p['mask']}-page{p['page_size']}"


@pytest.mark.parametrize("decode_shape", ["group", "row"])
@pytest.mark.parametrize("point", POINTS, ids=point_id)
def test_ragged_batch_matches_the_float64_oracle(library, point, decode_shape):
    """Decode rows (q_len 1), a chunked prefill (13 rows), a sequence whose
    every key is a query (q_len == kv_len), an empty sequence; pages shared;
    on each of the decode kernel's threadgroup shapes."""
    dtype, d = point["dtype_d"]
    plan = check_float(library, dtype, d, gqa=point["gqa"], page_size=point["page_size"], lse=dtype == "float32",
                       decode_shape=decode_shape, **MASKS[point["mask"]])
    rows, simdgroups = (8 if d <= 128 else 4, 4) if decode_shape == "group" else (1, 32 if d <= 128 else 16)
    assert plan.dispatches[0].kernel.endswith(f"_d{d}_r{rows}_sg{simdgroups}")
    assert plan.dispatches[0].threadgroup == [32 * simdgroups, 1, 1]


def test_sample_covers_every_axis_value():
    for axis in ("gqa", "mask", "page_size"):
        assert {p[axis] for p in SAMPLE} == set(AXES[axis]), axis
    assert {p["dtype_d"] for p in SAMPLE} == set(FLOAT_SAMPLE)


def test_long_sequences_split_over_many_page_windows(library):
    """More keys than one split covers (127 pages on the row shape, 31 on
    the group shape): several splits per sequence, each with its own window
    of block-table entries (the row shape's past 32 pages: several entries
    a lane), and a query block of 40 rows (several row chunks)."""
    assert _native.ext.PAGED_MAX_PAGES_PER_SPLIT == (127, 31)
    for decode_shape, most in (("row", 127), ("group", 31)):
        plan = check_float(library, "float16", 128, page_size=4, kv_lens=(1200, 3, 260), q_lens=(1, 3, 40), gqa=4,
                           lse=False, window_size=700, decode_shape=decode_shape)
        assert plan.keys_per_split <= most * 4
        assert plan.splits >= 1200 // (most * 4)
        if decode_shape == "row":
            assert plan.keys_per_split > 32 * 4  # windows past one entry a lane


def test_softcap_caps_the_logits_of_every_sequence(library):
    """softcap (1.25, with a scale that makes the cap bind on most logits)
    through the per-sequence params: the decode loop's softcap step."""
    check_float(library, "float32", 64, scale=0.6, softcap=1.25, sinks=True, lse=True)


def test_a_window_of_one_and_a_batch_without_rows(library):
    """A window of 1 (each row sees only its own key: one split, one key);
    a batch whose sequences have no query rows launches nothing."""
    check_float(library, "float32", 64, window_size=1, lse=True, kv_lens=(4, 9), q_lens=(4, 2), gqa=1)
    # no query rows at all: an empty launch
    q, k, v, table, q_lens, kv_lens = ragged_case("float32", 64, kv_lens=(5, 0), q_lens=(0, 0))
    out, _, plan, results = run_paged(library, q, [k], [v], table, q_lens, kv_lens, scale=0.1)
    assert out.shape == (0, 8, 64) and plan.dispatches == [] and results == []


# ---------------------------------------------------------------- chunked prefill on MMA tiles

# Sequences whose chunks the prefill kernel takes (33, 40 and 9 rows next to
# decode rows and an empty sequence): more query rows than one block of 32,
# a chunk that is the whole sequence (9 == kv_len), chunks after cached keys
# (positions offset by kv_len - q_len), key blocks of 16 or 32 keys cut by
# pages of 1, 5 or 16 keys, pages shared between sequences.
PREFILL_BATCH = dict(q_lens=(1, 40, 0, 9, 33, 3), kv_lens=(37, 100, 0, 9, 70, 200))
PREFILL_MASKS = {**MASKS, "softcap": {"softcap": 1.5, "scale": 0.5, "sinks": True}}
PREFILL_AXES = {"dtype_d": [(t, d) for t in DTYPES for d in (64, 96, 128)] if FULL_GRID else FLOAT_SAMPLE,
                "gqa": (1, 4), "mask": tuple(PREFILL_MASKS), "page_size": (1, 5, 16)}
PREFILL_SAMPLE = [
    dict(dtype_d=("float32", 64), gqa=4, mask="causal", page_size=5),
    dict(dtype_d=("float16", 128), gqa=1, mask="window", page_size=16),
    dict(dtype_d=("bfloat16", 64), gqa=4, mask="softcap", page_size=1),
    dict(dtype_d=("float32", 64), gqa=1, mask="none", page_size=16),
    dict(dtype_d=("float16", 128), gqa=4, mask="sinks", page_size=5),
]
PREFILL_POINTS = ([dict(zip(PREFILL_AXES, values)) for values in itertools.product(*PREFILL_AXES.values())]
                  if FULL_GRID else PREFILL_SAMPLE)


def routed_to_prefill(plan) -> bool:
    return any(d.kernel.startswith("attention_paged_prefill_") for d in plan.dispatches)


@pytest.mark.parametrize("point", PREFILL_POINTS, ids=point_id)
def test_prefill_chunks_match_the_float64_oracle(library, point):
    dtype, d = point["dtype_d"]
    options = dict(PREFILL_MASKS[point["mask"]])
    if point["mask"] == "window":
        options["window_size"] = 20  # shorter than the chunks: key blocks before the window skipped
    # the group shape's splits give the decode rows a merge: the prefill dispatch runs after both
    plan = check_float(library, dtype, d, gqa=point["gqa"], page_size=point["page_size"], lse=dtype == "float32",
                       decode_shape="group", **options, **PREFILL_BATCH)
    assert routed_to_prefill(plan) and len(plan.dispatches) == 3


def test_prefill_sample_covers_every_axis_value():
    for axis in ("gqa", "mask", "page_size"):
        assert {p[axis] for p in PREFILL_SAMPLE} == set(PREFILL_AXES[axis]), axis


@pytest.mark.parametrize("dtype,d", [("bfloat16", 128)] + ([("float32", 96), ("float16", 64)] if FULL_GRID else []))
def test_element_by_element_loads(library, dtype, d):
    """The path unaligned or strided inputs take (vector_loads cleared in
    every sequence's params): the prefill loader's and the decode loader's
    scalar reads, with the decode rows and chunks of the prefill batch."""
    plan = check_float(library, dtype, d, gqa=4, page_size=5, lse=True, window_size=30, vector_loads=False,
                       **PREFILL_BATCH)
    assert routed_to_prefill(plan)


@pytest.mark.parametrize("family", ["apple9"] + (["apple7"] if FULL_GRID else []))
def test_prefill_alone_with_the_apple9_key_blocks(library, family):
    """Only prefill chunks (no decode dispatch), 2-byte K/V: apple9's 32-key
    blocks at D = 128 (the default target's are 16 keys)."""
    plan = check_float(library, "float16", 128, gqa=2, page_size=16, q_lens=(64, 12), kv_lens=(90, 12),
                       window_size=50, lse=True, gpu_target={"gpu_family": family, "gpu_cores": 10})
    bk = 32 if family == "apple9" else 16
    assert [d.kernel for d in plan.dispatches] == [f"attention_paged_prefill_float16_d128_bk{bk}"]


# ---------------------------------------------------------------- quantized pages

def quantize(x: mx.array, group_size: int, bits: int, dtype) -> tuple:
    packed, scales, biases = mx.quantize(x, group_size=group_size, bits=bits)
    return packed, scales.astype(dtype), biases.astype(dtype)


def dequantized(triple, group_size, bits) -> np.ndarray:
    packed, scales, biases = triple
    return np.array(mx.dequantize(packed, scales.astype(mx.float32), biases.astype(mx.float32),
                                  group_size=group_size, bits=bits), np.float64)


QUANTIZED_POINTS = ([(t, d, b, g) for t in DTYPES for d in (64, 128, 256) for b in (4, 8) for g in (32, 64, 128)
                     if d % g == 0] if FULL_GRID else
                    [("float16", 128, 4, 32), ("float32", 64, 8, 64)])


@pytest.mark.parametrize("decode_shape", ["group", "row"])
@pytest.mark.parametrize("dtype,d,bits,group_size", QUANTIZED_POINTS)
def test_quantized_pages_match_dequantize_then_oracle(library, dtype, d, bits, group_size, decode_shape):
    q, k, v, table, q_lens, kv_lens = ragged_case(dtype, d, page_size=8, seed=3)
    kq, vq = (quantize(x.astype(mx.float32), group_size, bits, q.dtype) for x in (k, v))
    sinks = mx.array(np.linspace(-2, 3, q.shape[1]).astype(np.float32)).astype(q.dtype)
    out, lse, plan, _ = run_paged(library, q, kq, vq, table, q_lens, kv_lens, scale=d**-0.5, window_size=50,
                                  sinks=sinks, return_lse=True, bits=bits, group_size=group_size,
                                  decode_shape=decode_shape)
    assert ("_r1_sg" in plan.dispatches[0].kernel) == (decode_shape == "row")
    want, want_lse = oracle(f64(q), dequantized(kq, group_size, bits), dequantized(vq, group_size, bits),
                            np.array(table), q_lens, kv_lens, scale=d**-0.5, window_size=50, sinks=f64(sinks))
    got = as_float(out, q.dtype)
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() <= TOLERANCE[q.dtype]
    assert np.allclose(lse, want_lse, rtol=1e-5, atol=1e-4)


def test_one_split_sequences_write_their_rows_in_one_dispatch(library):
    """Every sequence of one split, float and quantized pages: the partial
    kernel adds the sinks, normalizes and writes out and lse (packed rows)
    itself, no merge; beside a sequence of several splits, the merge passes
    over it."""
    lengths = dict(kv_lens=(40, 0, 17, 9), q_lens=(1, 0, 3, 2), page_size=8, seed=5)
    plan = check_float(library, "float32", 64, sinks=True, lse=True, **lengths)
    assert [d.kernel for d in plan.dispatches] == ["attention_paged_decode_partial_float32_d64_r8_sg4"]
    # one sequence of one split beside one of several: the merge passes over the first
    # (the group shape: the row shape reads 400 keys in one split)
    plan = check_float(library, "float32", 64, sinks=True, lse=True, kv_lens=(20, 400), q_lens=(1, 1), page_size=4,
                       decode_shape="group")
    assert [s["splits"] for s in sequences(plan)] == [1, 7] and len(plan.dispatches) == 2
    q, k, v, table, q_lens, kv_lens = ragged_case("float16", 128, **lengths)
    kq, vq = (quantize(x.astype(mx.float32), 64, 4, q.dtype) for x in (k, v))
    sinks = mx.array(np.linspace(-2, 3, q.shape[1]).astype(np.float32)).astype(q.dtype)
    out, lse, plan, _ = run_paged(library, q, kq, vq, table, q_lens, kv_lens, scale=0.125, sinks=sinks,
                                  return_lse=True, bits=4, group_size=64, decode_shape="group")
    assert [d.kernel for d in plan.dispatches] == [
        "attention_paged_quantized_decode_partial_float16_d128_b4_r8_sg4"]
    want, want_lse = oracle(f64(q), dequantized(kq, 64, 4), dequantized(vq, 64, 4), np.array(table), q_lens, kv_lens,
                            scale=0.125, sinks=f64(sinks))
    assert np.abs(as_float(out, q.dtype) - want).max() <= TOLERANCE[q.dtype]
    assert np.allclose(lse, want_lse, rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------- the plan

def plan_for(kv_lens, q_lens, *, page_size=16, d=128, heads=8, kv_heads=2, dtype=mx.float16, **kw):
    pages = sum((n + page_size - 1) // page_size for n in kv_lens) + 1
    q = mx.zeros((sum(q_lens), heads, d), dtype)
    k = mx.zeros((pages, kv_heads, page_size, d), dtype)
    table = mx.zeros((len(kv_lens), max(1, max((n + page_size - 1) // page_size for n in kv_lens))), mx.int32)
    return paged_plan([q, k, k, table], q_lens, kv_lens, scale=0.1, **kw)


def sequences(plan) -> list[dict]:
    """The PagedSequence array: the fields after AttentionParams."""
    size = _native.ext.PAGED_SEQUENCE_BYTES
    params = _native.ext.ATTENTION_PARAMS_BYTES
    data = plan.sequences
    fields = ("q_start", "table_start", "partial_start", "splits", "page_size", "query_block_start", "query_blocks")
    rows = []
    for at in range(0, len(data), size):
        rows.append(dict(zip(fields, struct.unpack_from("<qqqiiii", data, at + params))))
    return rows


def test_plan_routes_long_chunks_to_the_prefill_kernel():
    """The routing rule (csrc/metal/paged_launch_plan.h paged_rows_take_prefill):
    more than 8 positions, or more than 32 rows (GQA group x positions), go to
    the prefill kernel's query blocks of 32 rows, packed in batch order; the
    rest to the decode kernel, whose grid is sized for its own sequences."""
    kv_lens, q_lens = [300, 20, 8, 100, 0, 64], [1, 9, 8, 40, 0, 33]
    plan = plan_for(kv_lens, q_lens, page_size=16, heads=8, kv_heads=2)  # GQA 4: q_len 8 is 32 rows
    seqs = sequences(plan)
    assert [s["query_blocks"] for s in seqs] == [0, 1, 0, 2, 0, 2]
    assert [s["query_block_start"] for s in seqs] == [0, 0, 1, 1, 3, 3]
    assert [s["splits"] > 0 for s in seqs] == [True, False, True, False, False, False]
    partial, prefill = plan.dispatches  # the decode sequences have one split each: no merge
    assert partial.kernel == "attention_paged_decode_partial_float16_d128_r8_sg4"  # the group shape: 32 rows
    assert prefill.kernel == "attention_paged_prefill_float16_d128_bk16"
    assert prefill.grid == [5, 8, 1] and prefill.threadgroup == [128, 1, 1]
    assert partial.grid == [1, 2 * 4, 6]  # the decode rows' largest sequence: 8 x 4, 8 rows per threadgroup
    assert [b.role for b in prefill.bindings] == [
        "q", "k", "v", "block_table", "sequences", "sinks", "out", "lse"]
    # GQA 8: 5 positions are 40 rows; apple9 stages 32 keys per block at 2 bytes
    assert [s["query_blocks"] for s in sequences(plan_for([10], [5], heads=16, kv_heads=2))] == [1]
    apple9 = plan_for([100], [40], gpu_target={"gpu_family": "apple9", "gpu_cores": 10})
    assert [d.kernel for d in apple9.dispatches] == ["attention_paged_prefill_float16_d128_bk32"]
    # D = 256 (no register-resident prefill) and quantized pages: the decode kernel serves every row
    # (160 rows: one split, written by the partial kernel, no merge)
    assert [d.kernel for d in plan_for([100], [40], d=256).dispatches] == [
        "attention_paged_decode_partial_float16_d256_r4_sg4"]
    assert [d.kernel for d in plan_for([5000], [40], d=256).dispatches] == [
        "attention_paged_decode_partial_float16_d256_r4_sg4", "attention_paged_decode_merge_float16_d256"]
    q = mx.zeros((40, 8, 128), mx.float16)
    packed = mx.zeros((8, 2, 16, 128 * 4 // 32), mx.uint32)
    scales = mx.zeros((8, 2, 16, 128 // 64), mx.float16)
    quantized = paged_plan([q, packed, scales, scales, packed, scales, scales, mx.zeros((1, 8), mx.int32)], [40],
                           [100], scale=0.1, bits=4, group_size=64)
    assert [d.kernel for d in quantized.dispatches] == [
        "attention_paged_quantized_decode_partial_float16_d128_b4_r8_sg4"]  # 40 rows: the group shape
    assert quantized.scratch == []


def test_plan_picks_the_decode_shape_by_the_dense_rule_under_the_page_cap():
    """Float pages: the dense decode's rule (kernel_lab/decode_rule.py, written
    apart from the C++) over the decode kernel's sequences as a batch of the
    longest, each shape's splits capped by its page window (127 pages on
    the row shape, 31 on the group shape); both shapes appear over the grid,
    the row shape's grid has one row per threadgroup. Quantized pages take
    the same rule."""
    import itertools

    from kernel_lab import decode_rule

    chosen = set()
    for sequences, kv_heads, gqa, longest, page_size, d, cores in itertools.product(
            (1, 4), (1, 8), (1, 4), (40, 1024, 5000), (1, 16), (64, 256), (0, 38)):
        kv_lens = [longest] + [max(1, longest // 3)] * (sequences - 1)
        target = {"gpu_family": "apple8", "gpu_cores": cores}
        plan = plan_for(kv_lens, [1] * sequences, page_size=page_size, d=d, heads=kv_heads * gqa,
                        kv_heads=kv_heads, gpu_target=target)
        rule = decode_rule.decode_plan(sequences, kv_heads, gqa, longest, d, cores or 8,
                                       max_pages_per_split=_native.ext.PAGED_MAX_PAGES_PER_SPLIT, page_size=page_size)
        partial = plan.dispatches[0]
        assert partial.kernel == f"attention_paged_decode_partial_float16_d{d}{rule['fields']}", (
            sequences, kv_heads, gqa, longest, page_size, d, cores)
        assert partial.threadgroup == [32 * rule["simdgroups"], 1, 1]
        assert partial.grid[1] == kv_heads * -(-gqa // rule["rows"])
        chosen.add(rule["shape"])
    assert chosen == {"row", "group"}
    q = mx.zeros((1, 8, 128), mx.float16)
    packed = mx.zeros((8, 8, 16, 128 * 4 // 32), mx.uint32)
    scales = mx.zeros((8, 8, 16, 128 // 64), mx.float16)
    quantized = paged_plan([q, packed, scales, scales, packed, scales, scales, mx.zeros((1, 8), mx.int32)], [1],
                           [100], scale=0.1, bits=4, group_size=64)
    assert decode_rule.decode_plan(1, 8, 1, 100, 128, 8)["shape"] == "row"
    assert quantized.dispatches[0].kernel == "attention_paged_quantized_decode_partial_float16_d128_b4_r1_sg32"
    # quantized pages, one row per KV head over 4096 keys: the row shape (dequantized keys), where float pages
    # take the group shape
    pages = 4096 // 16
    q = mx.zeros((1, 1, 128), mx.float16)
    packed = mx.zeros((pages, 1, 16, 128 * 4 // 32), mx.uint32)
    scales = mx.zeros((pages, 1, 16, 128 // 64), mx.float16)
    table = mx.zeros((1, pages), mx.int32)
    long_quantized = paged_plan([q, packed, scales, scales, packed, scales, scales, table], [1], [4096], scale=0.1,
                                bits=4, group_size=64)
    long_float = plan_for([4096], [1], heads=1, kv_heads=1)
    assert long_quantized.dispatches[0].kernel.endswith("_r1_sg32")
    assert long_float.dispatches[0].kernel.endswith("_r8_sg4")
    # and the splits of dequantized keys: the 8 cores' occupancy, where a quarter of the row shape's floor
    # (256 keys) would allow 16 splits; the float floor (1024 keys) would give 4
    rule = decode_rule.decode_plan(1, 1, 1, 4096, 128, 8, max_pages_per_split=_native.ext.PAGED_MAX_PAGES_PER_SPLIT,
                                   page_size=16, dequantized=True)
    assert rule["splits"] == 8 and long_quantized.keys_per_split == 4096 // 8


def test_plan_sizes_each_sequence_and_caps_a_split_by_its_page_window():
    kv_lens, q_lens = [5000, 0, 17, 300], [1, 0, 7, 4]  # every row the decode kernel's (7 x GQA 4 = 28 rows)
    plan = plan_for(kv_lens, q_lens, page_size=16)
    per = plan.keys_per_split
    assert per % 16 == 0 and 16 <= per <= max(_native.ext.PAGED_MAX_PAGES_PER_SPLIT) * 16
    seqs = sequences(plan)
    assert [s["q_start"] for s in seqs] == [0, 1, 1, 8]
    assert [s["splits"] for s in seqs] == [(n + per - 1) // per if q else 0 for n, q in zip(kv_lens, q_lens)]
    assert [s["query_blocks"] for s in seqs] == [0, 0, 0, 0]
    partial, scratch = plan.dispatches
    rows = [4 * q for q in q_lens]
    # partials laid out sequence after sequence: [Hkv, splits, rows] each
    starts = np.cumsum([0] + [2 * s["splits"] * r for s, r in zip(seqs, rows)])
    assert [s["partial_start"] for s in seqs] == list(starts[:-1])
    assert plan.scratch[0].elements == starts[-1] * 128
    assert partial.grid == [max(s["splits"] for s in seqs), 2 * 4, 4]  # 28 rows, 8 per threadgroup at D = 128
    assert scratch.grid == [28, 2, 4]
    # the merge: a row per threadgroup of MLX_ATTN_DECODE_MERGE_SIMDGROUPS (8) simdgroups, 7 hand over their states
    assert scratch.threadgroup == [256, 1, 1] and scratch.threadgroup_memory_bytes == 7 * (128 + 2) * 4
    assert [b.role for b in partial.bindings] == [
        "q", "k", "v", "block_table", "sequences", "partial_out", "partial_stats", "sinks", "out", "lse"]
    assert {b.source for b in partial.bindings if b.role == "sequences"} == {"sequences"}


def test_plan_of_one_split_sequences_has_no_merge_and_no_scratch():
    """Every sequence of one split: the partial kernel writes the packed
    output rows itself (metal/attention_paged.h), one dispatch; one longer
    sequence brings the merge back (it passes over the one-split ones)."""
    plan = plan_for([40, 0, 17], [1, 0, 3], return_lse=True)
    assert [s["splits"] for s in sequences(plan)] == [1, 0, 1]
    assert plan.scratch == []
    (partial,) = plan.dispatches
    where = {b.role: (b.source, b.access) for b in partial.bindings}
    assert where["out"] == ("output", "write") and where["lse"] == ("output", "write")
    assert where["sinks"] == ("input", "read") and where["partial_out"] == ("input", "read")  # placeholders
    assert len(plan_for([4000, 17], [1, 3]).dispatches) == 2


def test_plan_refuses_what_the_kernels_cannot_run():
    assert "head dims" in plan_for([10], [1], d=80).reason
    # D = 512: the dense decode has it, the paged kernels are not instantiated for it
    assert "head dims 64, 96, 128 and 256, got 512" in plan_for([10], [1], d=512).reason
    q = mx.zeros((1, 4, 64), mx.float16)
    k = mx.zeros((2, 2, 16, 64), mx.float16)
    v = mx.zeros((2, 2, 16, 32), mx.float16)
    plan = paged_plan([q, k, v, mx.zeros((1, 1), mx.int32)], [1], [10], scale=0.1)
    assert not plan.supported and "value head dims" in plan.reason
    with pytest.raises(ValueError, match="q_lens"):
        paged_plan([q, k, k, mx.zeros((1, 1), mx.int32)], [2], [1], scale=0.1)
    with pytest.raises(ValueError, match="block table"):
        paged_plan([q, k, k, mx.zeros((1, 1), mx.int32)], [1], [17], scale=0.1)


# ---------------------------------------------------------------- modelled traffic

@pytest.fixture(scope="module")
def counting(tmp_path_factory):
    """Counting builds (every device access checked against its buffer) of
    the paged kernels and the dense decode at float16, D = 128."""
    directory = tmp_path_factory.mktemp("paged-counting")
    sources = trimmed_sources(directory, ["float16, half, 128"])
    decode = directory / "attention_decode.metal"
    text = (REPO / "metal" / "attention_decode.metal").read_text()
    decode.write_text(text[: text.index("MLX_ATTN_DECODE_TYPES(64,")] + decode_instantiation("float16, half", 128) + "\n")
    return msl_emulator.compile_library(sources + [decode], include_dirs=[REPO], fast_math=True, counters=True)


def test_page_indirection_costs_at_most_5_percent_of_device_bytes(counting):
    """Device bytes per live K/V byte of the paged decode (partial and merge)
    against the dense decode kernel run on each sequence's contiguous K/V
    (the same live keys): <= 1.05x (the issue's target)."""
    case = ragged_case("float16", 128, page_size=16, kv_lens=(300, 77, 700, 150), q_lens=(1, 1, 1, 1), seed=4)
    paged = paged_decode_bytes(counting, *case)
    dense = dense_decode_bytes(counting, *case)
    print(f"device bytes per live K/V byte: paged {paged:.4f}, dense on the same keys {dense:.4f}")
    assert paged <= 1.05 * dense, (paged, dense)


# ---------------------------------------------------------------- first-use self-check and doctor

def emulated_runner(library):
    """The self-check's run_kernel over the emulated paged kernels."""

    def run(q, k_pages, v_pages, block_table, kv_lens, *, q_lens, scale, causal=True, window_size=None, sinks=None,
            bits=0, group_size=0):
        k_parts, v_parts = (list(x) if bits else [x] for x in (k_pages, v_pages))
        out, *_ = run_paged(library, q, k_parts, v_parts, block_table, np.array(q_lens).tolist(),
                            np.array(kv_lens).tolist(), scale=scale, causal=causal, window_size=window_size,
                            sinks=sinks, bits=bits, group_size=group_size)
        return mx.array(as_float(out, q.dtype).astype(np.float32)).astype(q.dtype)

    return run


@pytest.mark.parametrize("variant", [self_check.PagedVariant("float16", 128),
                                     self_check.PagedVariant("bfloat16", 64, 8, 32)], ids=str)
def test_self_check_passes_the_emulated_kernels_and_fails_a_broken_one(library, variant):
    run = emulated_runner(library)
    result = self_check.check_paged_variant(variant, run)
    assert result.passed and result.cases == len(self_check.paged_cases(variant)), result.error

    failed = self_check.check_paged_variant(variant, lambda *a, **kw: run(*a, **kw) * 1.05)
    assert not failed.passed and "max abs error" in failed.error


def test_doctor_lists_the_paged_variants(library):
    from mlx_attn.doctor import run_doctor

    report = run_doctor(metal_paged=emulated_runner(library), paged_variants=[self_check.PagedVariant("float32", 64)],
                        timings=False, variants=[], backward_variants=[], metal_runner=None)
    assert "## Paged Metal kernels against the paged reference path" in report.markdown
    cases = len(self_check.paged_cases(self_check.PagedVariant("float32", 64)))
    assert cases == 4 and f"| paged/float32/D=64 | {cases} |" in report.markdown
    assert [r.passed for r in report.paged_results] == [True]


def test_the_python_dispatch_names_why_the_kernels_cannot_run_here():
    """mlx_attn.paged.metal_paged_reason: without a Metal build it says so
    (before asking the plan); the plan's own reasons otherwise."""
    from mlx_attn import paged

    q, k, v, table, q_lens, kv_lens = ragged_case("float32", 64)
    layout = paged.check_paged_layout(q, tuple(k.shape), tuple(v.shape), k.shape[0], table, mx.array(kv_lens, mx.int32),
                                 mx.array(q_lens, mx.int32))
    reason = paged.metal_paged_reason(q, [k], [v], table, layout)
    if _native.ext.has_metal():
        assert reason == ""
    else:
        assert reason == "this build of mlx_attn has no Metal kernels"
    plan = paged_plan([q, k, v, table], q_lens, kv_lens, scale=0.1)
    assert plan.supported and layout.q_lens == q_lens and layout.kv_lens == kv_lens
    with pytest.raises(ValueError, match="pages of rank 4"):
        paged_plan([q, k, v.astype(mx.float16), table], q_lens, kv_lens, scale=0.1)


def test_prefill_kernels_compile_one_at_a_time(tmp_path):
    """The Mac compiles a paged prefill kernel alone at first use
    (csrc/metal/metal_sources.cpp variant_source): the family's text without
    its instantiation lines, plus the one MLX_ATTN_PAGED_PREFILL line (no mask
    kinds: a mask suffix names no kernel of this family). The full grid also
    compiles that text alone in the emulator."""
    import re

    kernel = "attention_paged_prefill_bfloat16_d96_bk32"
    text = _native.ext.metal_variant_source(kernel)
    family = _native.ext.metal_kernel_source(kernel)
    instantiation = re.compile(r"^MLX_ATTN_[A-Z0-9_]+\([^()]*\)[ \t]*\n?", re.M)
    assert text == instantiation.sub("", family) + "MLX_ATTN_PAGED_PREFILL(bfloat16, bfloat, 96, 32)\n"
    assert _native.ext.metal_variant_source(kernel + "_mask_bool") == ""
    assert _native.ext.metal_variant_source("attention_paged_prefill_float16_d96") == ""
    if FULL_GRID:
        path = tmp_path / f"{kernel}.metal"
        path.write_text(text)
        assert msl_emulator.compile_library([path], include_dirs=[]).kernel_names == [kernel]
