"""Cascade (shared-prefix) paged attention on the Metal kernels: the prefix
pass (metal/attention_paged_cascade.h), the paged decode over each
sequence's own pages as the suffix pass and the paged merge
(metal/attention_paged.h merge_splits), launched from the C++ cascade plan
(csrc/metal/paged_launch_plan.cpp plan_cascade_paged_attention) in the MSL
emulator against the float64 oracle over the full tables (prefix pages then
own pages): groups interleaved with sequences outside any group, GQA, decode
rows and two-row chunks, windows that end inside the prefix and windows that
exclude it, sinks counted once, softcap, 4- and 8-bit pages, a prefix split
over several threadgroups. Table columns past a sequence's pages hold -1 and
the page buffers end at the last page (the emulator's guard pages fail any
read outside). Also: the plan's dispatches and records, and the modelled
device bytes (kernel_lab/cascade_bytes.py) against the emulator's counting
build, and the 16 x 4k row against today's paged decode. A sample runs by
default; MLX_ATTN_FULL_GRID=1 runs every point."""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest

from kernel_lab import msl_emulator
from kernel_lab.cascade_bytes import cascade_vs_paged, groups_of, modelled_bytes, sequences_of, shared_prefix_case
from kernel_lab.metal_runner import REPO
from kernel_lab.paged_metal_runner import (as_float, cascade_plan, device_bytes, full_table, oracle, own_lengths,
                                           paged_plan, run_cascade, run_paged, trimmed_sources)
from mlx_attn import _native, self_check
from sdpa_cases import TOLERANCE

pytestmark = [pytest.mark.skipif(_native.ext is None, reason="the native extension is not built"),
              pytest.mark.skipif(not msl_emulator.clang_available(), reason="clang-19 is not installed")]

FULL_GRID = os.environ.get("MLX_ATTN_FULL_GRID") == "1"
DTYPES = {"float32": (mx.float32, "float"), "float16": (mx.float16, "half")}
KEY_BLOCK = {64: 32, 128: 16}  # the default target's prefill keys per block


def instances(dtype: str, d: int, bits=(4, 8)) -> dict:
    tname = f"{dtype}, {DTYPES[dtype][1]}"
    return {"float_instances": [f"{tname}, {d}"], "quantized_instances": [f"{tname}, {d}, {b}" for b in bits],
            "cascade_instances": [f"{tname}, {d}, {KEY_BLOCK[d]}"] + [f"{tname}, {d}, {b}, {KEY_BLOCK[d]}"
                                                                       for b in bits]}


def build(d: int, dtypes, counters=False):
    directory = msl_emulator.cache_dir() / f"cascade_sources_d{d}_{'_'.join(dtypes)}"
    directory.mkdir(parents=True, exist_ok=True)
    merged: dict = {"float_instances": [], "quantized_instances": [], "cascade_instances": []}
    for dtype in dtypes:
        for key, values in instances(dtype, d).items():
            merged[key] += values
    return msl_emulator.compile_library(trimmed_sources(directory, **merged), include_dirs=[REPO], fast_math=True,
                                        counters=counters)


@pytest.fixture(scope="module")
def library():
    return build(64, ["float32", "float16"])


def cascade_case(dtype, d, *, groups, loners=(), gqa=4, kv_heads=2, page_size=16, seed=0, shuffle=True):
    """A batch of cascade groups and sequences outside any: groups = [(prefix
    keys, [(q_len, own keys), ...])], loners = [(q_len, kv_len)]; sequences
    shuffled (group members and loners interleaved) unless not `shuffle`.
    Returns q, k, v (in dtype), the own table, prefix table, q_lens, kv_lens,
    prefix_lens and prefix_groups."""
    rng = np.random.default_rng(seed)
    sequences = []  # (group, q_len, own keys)
    for g, (_, members) in enumerate(groups):
        sequences += [(g, q_len, own) for q_len, own in members]
    sequences += [(-1, q_len, kv_len) for q_len, kv_len in loners]
    order = rng.permutation(len(sequences)) if shuffle else range(len(sequences))
    sequences = [sequences[i] for i in order]
    prefix_pages = [-(-prefix // page_size) for prefix, _ in groups]
    own_pages = [-(-own // page_size) for _, _, own in sequences]
    num_pages = sum(prefix_pages) + sum(own_pages)
    pool = iter(rng.permutation(num_pages).tolist())
    prefix_table = np.full((len(groups), max(prefix_pages) + 1), -1, np.int32)
    for g, count in enumerate(prefix_pages):
        prefix_table[g, :count] = [next(pool) for _ in range(count)]
    own_table = np.full((len(sequences), max(own_pages) + 1), -1, np.int32)
    for b, count in enumerate(own_pages):
        own_table[b, :count] = [next(pool) for _ in range(count)]
    prefix_lens = [prefix for prefix, _ in groups]
    prefix_groups = [g for g, _, _ in sequences]
    q_lens = [q_len for _, q_len, _ in sequences]
    kv_lens = [own + (prefix_lens[g] if g >= 0 else 0) for g, _, own in sequences]
    cast = DTYPES[dtype][0]
    heads = kv_heads * gqa
    q = mx.array(rng.standard_normal((sum(q_lens), heads, d)).astype(np.float32)).astype(cast)
    k, v = (mx.array(rng.standard_normal((num_pages, kv_heads, page_size, d)).astype(np.float32)).astype(cast)
            for _ in range(2))
    return q, k, v, mx.array(own_table), mx.array(prefix_table), q_lens, kv_lens, prefix_lens, prefix_groups


def f64(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32), np.float64)


def quantize(x: mx.array, group_size: int, bits: int, dtype) -> tuple:
    packed, scales, biases = mx.quantize(x.astype(mx.float32), group_size=group_size, bits=bits)
    return packed, scales.astype(dtype), biases.astype(dtype)


def dequantized(triple, group_size, bits) -> np.ndarray:
    packed, scales, biases = triple
    return np.array(mx.dequantize(packed, scales.astype(mx.float32), biases.astype(mx.float32),
                                  group_size=group_size, bits=bits), np.float64)


# two groups (64 and 32 shared keys) with decode rows and a two-row chunk, beside two sequences of their own
GROUPS = [(64, [(1, 5), (1, 17), (2, 9)]), (32, [(1, 3), (1, 1)])]
LONERS = [(1, 40), (2, 7)]
MASKS = {
    "causal": {},
    "not causal": {"causal": False},
    # rows at 68..80: windows of 12 start inside the prefix (own 5, 9) or after it (own 17: excluded)
    "window": {"window_size": 12},
    "sinks": {"sinks": True},
    "softcap": {"softcap": 2.0, "sinks": True, "window_size": 40},
}
POINTS = ([(dtype, mask, bits) for dtype in DTYPES for mask in MASKS for bits in (0, 4, 8)] if FULL_GRID else
          [("float32", "causal", 0), ("float32", "window", 0), ("float16", "sinks", 0), ("float32", "softcap", 4),
           ("float16", "not causal", 8)])


def check(library, dtype, d, *, bits=0, group_size=32, causal=True, window_size=None, sinks=False, softcap=None,
          **case):
    q, k, v, own_table, prefix_table, q_lens, kv_lens, prefix_lens, prefix_groups = cascade_case(dtype, d, **case)
    scale = d**-0.5
    sink_array = None
    if sinks:  # some above every logit: a sink counted twice shows
        sink_array = mx.array((np.random.default_rng(7).standard_normal(q.shape[1]) * 4).astype(np.float32))
        sink_array = sink_array.astype(q.dtype)
    if bits:
        k_parts, v_parts = quantize(k, group_size, bits, q.dtype), quantize(v, group_size, bits, q.dtype)
        k64, v64 = dequantized(k_parts, group_size, bits), dequantized(v_parts, group_size, bits)
    else:
        k_parts, v_parts, k64, v64 = [k], [v], f64(k), f64(v)
    out, lse, plan, _ = run_cascade(library, q, k_parts, v_parts, own_table, prefix_table, q_lens, kv_lens,
                                    prefix_lens, prefix_groups, scale=scale, causal=causal, window_size=window_size,
                                    sinks=sink_array, return_lse=True, bits=bits, group_size=group_size if bits else 0,
                                    softcap=softcap)
    table = full_table(own_table, prefix_table, prefix_lens, prefix_groups, kv_lens, k.shape[2])
    want, want_lse = oracle(f64(q), k64, v64, table, q_lens, kv_lens, scale=scale, causal=causal,
                            window_size=window_size, sinks=None if sink_array is None else f64(sink_array),
                            softcap=softcap)
    got = as_float(out, q.dtype)
    assert np.isfinite(got).all(), "a row no kernel wrote, or a NaN"
    err = np.abs(got - want).max()
    assert err <= TOLERANCE[q.dtype], f"max error {err}"
    # quantized pages in 2-byte dtypes: the prefix tile stages the dequantized K rounded to q's dtype (as the
    # quantized prefill kernel does); the oracle and the decode loader keep it in float
    atol = TOLERANCE[q.dtype] if bits and q.dtype != mx.float32 else 1e-4
    assert np.allclose(lse, want_lse, rtol=1e-5, atol=atol), np.abs(lse - want_lse).max()
    return plan


@pytest.mark.parametrize("dtype,mask,bits", POINTS, ids=lambda x: str(x))
def test_cascade_matches_the_float64_oracle(library, dtype, mask, bits):
    plan = check(library, dtype, 64, bits=bits, groups=GROUPS, loners=LONERS, **MASKS[mask])
    kernels = [s.kernel for s in plan.dispatches]
    prefix = "attention_paged_cascade_quantized_prefix" if bits else "attention_paged_cascade_prefix"
    assert kernels[1].startswith(f"{prefix}_{dtype}_d64"), kernels
    assert kernels[2] == f"attention_paged_decode_merge_{dtype}_d64"


def test_a_prefix_split_over_threadgroups_with_a_window(library):
    """1040 shared keys in two prefix splits (the second starts mid-way, not
    at a key block of the window's first key), one group member's window
    reaching back into the first split, GQA 1 and pages of 5."""
    plan = check(library, "float32", 64, groups=[(1040, [(1, 3), (1, 70)])], loners=[(1, 20)], gqa=1, page_size=5,
                 window_size=600, sinks=True)
    (group,) = groups_of(plan)
    assert group["splits"] == 2 and group["keys_per_split"] % KEY_BLOCK[64] == 0


def test_plan_records_and_dispatches():
    """Suffix partial, prefix, merge; each member's partial rows hold its
    own splits then its group's prefix splits; loners have none; the prefix
    tile holds the group's rows x GQA group (one tile for 16 decode rows x 4)."""
    case = shared_prefix_case(sequences=16, prefix=1024, own=64, d=64)
    arrays = [case["q"], case["k"], case["v"], case["own_table"], case["prefix_table"]]
    plan = cascade_plan(arrays, case["q_lens"], own_lengths(case["kv_lens"], case["prefix_lens"],
                                                            case["prefix_groups"]),
                        case["prefix_lens"], case["prefix_groups"], scale=0.125)
    assert plan.supported, plan.reason
    assert [s.id.family for s in plan.dispatches] == ["paged_decode_partial", "paged_cascade_prefix",
                                                      "paged_decode_merge"]
    (group,) = groups_of(plan)
    assert group["rows"] == 16 and group["tiles"] == 1 and group["q_len"] == 64 and group["kv_len"] == 1024
    prefix = plan.dispatches[1]
    assert prefix.grid == [group["splits"], 2 * group["tiles"], 1]
    assert prefix.threadgroup == [32 * _native.ext.CASCADE_TILE_ROWS // 8, 1, 1]
    for s in sequences_of(plan):
        assert s["kv_len"] == 64 and s["prefix_splits"] == group["splits"] and s["prefix_group"] == 0
    assert [b.access for b in prefix.bindings if b.role.startswith("partial")] == ["write", "write"]
    assert {s.writers for s in plan.scratch} == {2}


def test_plan_refuses_what_the_kernels_do_not_serve():
    case = shared_prefix_case(sequences=2, prefix=64, own=16, d=64)
    own = own_lengths(case["kv_lens"], case["prefix_lens"], case["prefix_groups"])
    arrays = [case["q"], case["k"], case["v"], case["own_table"], case["prefix_table"]]
    # a 9-position chunk takes the paged prefill kernel: not the cascade's
    long_q = mx.zeros((10, 8, 64), mx.float16)
    plan = cascade_plan([long_q, *arrays[1:]], [9, 1], own, case["prefix_lens"], case["prefix_groups"], scale=0.1)
    assert not plan.supported and "decode rows" in plan.reason
    # D = 256: no prefix tile
    wide = shared_prefix_case(sequences=2, prefix=64, own=16, d=256)
    plan = cascade_plan([wide["q"], wide["k"], wide["v"], wide["own_table"], wide["prefix_table"]], [1, 1], own,
                        wide["prefix_lens"], wide["prefix_groups"], scale=0.1)
    assert not plan.supported and "head dims 64, 96 and 128" in plan.reason


def test_modelled_bytes_match_the_emulator_counts():
    """The bytes model (kernel_lab/cascade_bytes.py) against the counting
    build, on the cascade and on today's paged plan of one small batch."""
    counting = build(64, ["float16"], counters=True)
    case = shared_prefix_case(sequences=4, prefix=256, own=16, d=64)
    q, k, v = case["q"], case["k"], case["v"]
    shape = dict(d=64, element=2, kv_heads=2, group=4)
    *_, plan, results = run_cascade(counting, q, [k], [v], case["own_table"], case["prefix_table"], case["q_lens"],
                                    case["kv_lens"], case["prefix_lens"], case["prefix_groups"], scale=0.125)
    counted, modelled = device_bytes(results), modelled_bytes(plan, **shape)["total"]
    assert abs(modelled / counted - 1) < 0.1, (modelled, counted)
    *_, paged, paged_results = run_paged(counting, q, [k], [v], case["full_table"], case["q_lens"], case["kv_lens"],
                                         scale=0.125)
    counted, modelled = device_bytes(paged_results), modelled_bytes(paged, **shape)["total"]
    assert abs(modelled / counted - 1) < 0.1, (modelled, counted)


def test_sixteen_sequences_over_a_4k_prefix_read_at_most_0_15x_the_bytes():
    """The issue's target, modelled: 16 decode rows sharing 4096 keys with 64
    own keys each, D 64, float16 (2 KV heads x GQA 4)."""
    row = cascade_vs_paged(sequences=16, prefix=4096, own=64, d=64)
    assert row["cascade / paged"] <= 0.15, row


# ---------------------------------------------------------------- first-use self-check and doctor

def emulated_cascade_runner(library):
    """The cascade self-check's run_kernel over the emulated kernels."""

    def run(q, k_pages, v_pages, prefix_table, prefix_lens, prefix_groups, block_table, kv_lens, *, q_lens, scale,
            causal=True, window_size=None, sinks=None, bits=0, group_size=0):
        k_parts, v_parts = (list(x) if bits else [x] for x in (k_pages, v_pages))
        out, *_ = run_cascade(library, q, k_parts, v_parts, block_table, prefix_table, np.array(q_lens).tolist(),
                              np.array(kv_lens).tolist(), np.array(prefix_lens).tolist(),
                              np.array(prefix_groups).tolist(), scale=scale, causal=causal, window_size=window_size,
                              sinks=sinks, bits=bits, group_size=group_size)
        return mx.array(as_float(out, q.dtype).astype(np.float32)).astype(q.dtype)

    return run


@pytest.mark.parametrize("variant", [self_check.CascadeVariant("float32", 64),
                                     self_check.CascadeVariant("float16", 64, 4, 32)], ids=str)
def test_self_check_passes_the_emulated_kernels_and_fails_a_broken_one(library, variant):
    run = emulated_cascade_runner(library)
    result = self_check.check_cascade_variant(variant, run)
    assert result.passed and result.cases == len(self_check.cascade_cases(variant)), result.error

    failed = self_check.check_cascade_variant(variant, lambda *a, **kw: run(*a, **kw) * 1.05)
    assert not failed.passed and "max abs error" in failed.error


def test_doctor_lists_the_cascade_variants(library):
    from mlx_attn.doctor import run_doctor

    variant = self_check.CascadeVariant("float32", 64)
    report = run_doctor(metal_cascade=emulated_cascade_runner(library), cascade_variants=[variant],
                        paged_variants=[], timings=False, variants=[], backward_variants=[], metal_runner=None)
    assert "## Cascade Metal kernels against the paged reference path" in report.markdown
    cases = len(self_check.cascade_cases(variant))
    assert f"| cascade/float32/D=64 | {cases} |" in report.markdown
    assert [r.passed for r in report.cascade_results] == [True]


def test_the_python_dispatch_names_why_the_metal_cascade_cannot_run_here():
    """Without a Metal build the reason says so (a CPU stream keeps the CPU
    cascade); the plan's own reasons otherwise."""
    from mlx_attn import paged

    q, k, v, own_table, prefix_table, q_lens, kv_lens, prefix_lens, prefix_groups = cascade_case(
        "float32", 64, groups=GROUPS, loners=LONERS)
    tables = paged.CascadeTables(prefix_table, mx.array(prefix_lens, mx.int32), mx.array(prefix_groups, mx.int32),
                                 own_table, mx.array(kv_lens, mx.int32), mx.array(q_lens, mx.int32))
    _, _, full_pages, shared, groups, full = tables.checked(q, k.shape[0], k.shape[2])
    layout = tables.layout(q, tuple(k.shape), tuple(v.shape), full, full_pages)
    levels = tables.levels(shared, groups, layout)
    assert levels.own_kv_lens == own_lengths(kv_lens, prefix_lens, prefix_groups)
    reason = paged.metal_cascade_reason(q, [k], [v], levels, layout)
    assert reason == ("" if _native.ext.has_metal() else "this build of mlx_attn has no Metal kernels")
    assert paged.cascade_paged_attention_path(q, k, v, prefix_table, mx.array(prefix_lens, mx.int32),
                                              mx.array(prefix_groups, mx.int32), own_table,
                                              mx.array(kv_lens, mx.int32), q_lens=mx.array(q_lens, mx.int32),
                                              scale=0.125, stream=mx.cpu) == "cascade-cpu"
