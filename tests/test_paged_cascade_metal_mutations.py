"""Mutation test of the Metal cascade attention's emulator tests: faults seeded
into a copy of metal/attention_paged_cascade.metal (the prefix pass: each
tile row's sequence, query head, position and partial row, the tile's key
range, the prefix splits' key blocks, the log-sum-exp base of its partials)
and of metal/attention_paged.metal (the suffix pass's partial layout and the
merge: the prefix partials merged, the sinks joined once) must each be
caught: wrong results or log-sum-exp beyond tolerance, NaN, a read outside a
buffer, a deadlock or a compile error. A mutation whose target is missing
fails (tests/mutations.py). The default suite compiles a representative
few; MLX_ATTN_FULL_GRID=1 compiles them all."""

from __future__ import annotations

import os
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from kernel_lab import msl_emulator
from kernel_lab.metal_runner import REPO, EmulatedMetal
from kernel_lab.paged_metal_runner import as_float, full_table, oracle, paged_instantiation, run_cascade
from mlx_attn import _native
from mutations import assert_caught, kernel_text, mutated, write
from sdpa_cases import TOLERANCE
from test_paged_cascade_metal import GROUPS, LONERS, cascade_case, f64

pytestmark = [pytest.mark.skipif(not msl_emulator.clang_available(), reason="clang-19 is not installed"),
              pytest.mark.skipif(_native.ext is None, reason="the native extension is not built")]

CASCADE = REPO / "metal" / "attention_paged_cascade.metal"
PAGED = REPO / "metal" / "attention_paged.metal"
QUANTIZED = REPO / "metal" / "attention_paged_quantized.metal"
FULL_GRID = os.environ.get("MLX_ATTN_FULL_GRID") == "1"


def only_float32_d64(text: str) -> str:
    """Keep the one instantiation the cases use, so each mutant compiles quickly."""
    if "attention_paged_cascade_prefix<" in text:
        text = re.sub(r"^MLX_ATTN_PAGED_CASCADE_(2BYTE_)?TYPES\(.*\)$", "", text, flags=re.M)
        return text + "\nMLX_ATTN_PAGED_CASCADE_PREFIX(float32, float, 64, 32)\n"
    text = re.sub(r"^MLX_ATTN_PAGED_TYPES\(.*\)$", "", text, flags=re.M)
    return text + "\n" + paged_instantiation("float32, float", 64) + "\n"


def replaced(a: str, b: str) -> tuple:
    return ("replace", a, b)


# the prefix pass (metal/attention_paged_cascade.h)
PREFIX_MUTANTS = {
    "wrong log-sum-exp base: the prefix max in log2 units": replaced(
        "partial_stats[base * 2] = m_row;", "partial_stats[base * 2] = m_row * MLX_ATTN_LOG2E;"),
    "prefix rows at their own-key positions (the prefix not counted)": replaced(
        "rows.pos = p.kv_len + query_position(seq.attn, member.query);",
        "rows.pos = query_position(seq.attn, member.query);"),
    "prefix partial over the sequence's own first split": replaced(
        "(long(kv_head) * partials + seq.splits + split)", "(long(kv_head) * partials + split)"),
    "GQA rows of a member share one query head": replaced(
        "rows.h = kv_head * p.group + head_in_group;", "rows.h = kv_head * p.group;"),
    "every group reads the first prefix-table row": replaced(
        "prefix_table + g.table_start;", "prefix_table;"),
    "a split's first key block starts at its first visible key": replaced(
        "kb = split_begin + max(0, begin - split_begin) / BK * BK;", "kb = begin;"),
    "the tile's key range from its first simdgroup's rows": replaced(
        "for (int s = 0; s < NSG; ++s) {", "for (int s = 0; s < 1; ++s) {"),
    "member queries read from the batch's first rows": replaced(
        "(seq.q_start + member.query) * p.q_strides[2]", "member.query * p.q_strides[2]"),
}
# the suffix pass and the merge (metal/attention_paged.h, metal/attention_decode.h)
MERGE_MUTANTS = {
    "prefix dropped from the merge": replaced(
        "const int partials = seq.splits + seq.prefix_splits;", "const int partials = seq.splits;"),
    "sinks counted twice: the suffix partial joins the sink too": replaced(
        "outputs.partial_stats[base * 2 + 1] = rows.l[i];",
        "outputs.partial_stats[base * 2 + 1] = rows.l[i] + (p.has_sinks != 0 ? fast::exp2((saturate_logit(float("
        "outputs.sinks[(kv_head * p.group + (r0 + i) / p.q_len) * p.sinks_stride])) - rows.m[i]) * MLX_ATTN_LOG2E)"
        " : 0.0f);"),
    "sinks counted twice: a one-split member writes its rows itself": replaced(
        "outputs.direct = outputs.partial_splits == 1;", "outputs.direct = seq.splits == 1;"),
    "suffix partials laid out by the own splits only": replaced(
        "outputs.partial_splits = seq.splits + seq.prefix_splits;", "outputs.partial_splits = seq.splits;"),
}
# the quantized prefix staging (CascadeQuantizedPages): run on 8-bit pages
QUANTIZED_MUTANTS = {
    "quantized: every key of a block read from its first key's page": replaced(
        "on_page.select_head(p, at.page[j], kv_head);", "on_page.select_head(p, at.page[0], kv_head);"),
    "quantized: a key's slot taken as the key": replaced(
        "(kb + j) % page_size, value, col, row);", "kb + j, value, col, row);"),
    "quantized: value runs dequantized from the key's codes": replaced(
        "const device uint* packed = value ? kv.v : kv.k;", "const device uint* packed = kv.k;"),
}
DEFAULT = ["wrong log-sum-exp base: the prefix max in log2 units",
           "prefix rows at their own-key positions (the prefix not counted)",
           "prefix dropped from the merge", "sinks counted twice: the suffix partial joins the sink too"]
MUTANTS = {**PREFIX_MUTANTS, **MERGE_MUTANTS}
NAMES = list(MUTANTS) if FULL_GRID else DEFAULT

# (groups, loners, case options, call options): windows into and past the
# prefix with sinks; a tile whose first simdgroup's row (8 query heads of a
# late position) sees no prefix key under the window and its second's does;
# a prefix of two splits, a window back into the first; not causal with a softcap
CASES = [
    (GROUPS, LONERS, {}, {"window_size": 12, "sinks": True}),
    ([(64, [(1, 30), (1, 2)])], [], {"gqa": 8, "kv_heads": 1, "shuffle": False}, {"window_size": 12}),
    ([(1040, [(1, 3), (1, 70)])], [(1, 20)], {"gqa": 1, "page_size": 5}, {"window_size": 600, "sinks": True}),
    (GROUPS, LONERS, {"page_size": 8}, {"causal": False, "softcap": 2.0}),
]


def caught(run) -> bool:
    for n, (groups, loners, case, options) in enumerate(CASES):
        q, k, v, own_table, prefix_table, q_lens, kv_lens, prefix_lens, prefix_groups = cascade_case(
            "float32", 64, groups=groups, loners=loners, seed=n, **case)
        sinks = (mx.array((np.random.default_rng(n).standard_normal(q.shape[1]) * 4).astype(np.float32))
                 if options.get("sinks") else None)
        causal, window, softcap = options.get("causal", True), options.get("window_size"), options.get("softcap")
        try:
            out, lse, _, _ = run_cascade(run.library, q, [k], [v], own_table, prefix_table, q_lens, kv_lens,
                                         prefix_lens, prefix_groups, scale=0.125, causal=causal, window_size=window,
                                         sinks=sinks, return_lse=True, softcap=softcap)
        except msl_emulator.EmulatorError:
            return True  # a read outside a buffer, a deadlock
        table = full_table(own_table, prefix_table, prefix_lens, prefix_groups, kv_lens, k.shape[2])
        want, want_lse = oracle(f64(q), f64(k), f64(v), table, q_lens, kv_lens, scale=0.125, causal=causal,
                                window_size=window, sinks=None if sinks is None else f64(sinks), softcap=softcap)
        got = as_float(out, mx.float32)
        if not np.isfinite(got).all() or np.abs(got - want).max() > TOLERANCE[mx.float32]:
            return True
        if not np.allclose(lse, want_lse, rtol=1e-5, atol=1e-4):
            return True
    return False


def caught_quantized(run) -> bool:
    """Two groups beside sequences of their own on 8-bit pages, windows into and past the prefix, and a
    third group whose prefix (one page) is shorter than a key block."""
    q, k, v, own_table, prefix_table, q_lens, kv_lens, prefix_lens, prefix_groups = cascade_case(
        "float32", 64, groups=GROUPS + [(8, [(1, 4), (1, 2)])], loners=LONERS, page_size=8)
    k_parts, v_parts = (mx.quantize(x, group_size=32, bits=8) for x in (k, v))
    try:
        out, lse, _, _ = run_cascade(run.library, q, list(k_parts), list(v_parts), own_table, prefix_table, q_lens,
                                     kv_lens, prefix_lens, prefix_groups, scale=0.125, window_size=12,
                                     return_lse=True, bits=8, group_size=32)
    except msl_emulator.EmulatorError:
        return True
    k64, v64 = (np.array(mx.dequantize(*parts, group_size=32, bits=8), np.float64) for parts in (k_parts, v_parts))
    table = full_table(own_table, prefix_table, prefix_lens, prefix_groups, kv_lens, k.shape[2])
    want, want_lse = oracle(f64(q), k64, v64, table, q_lens, kv_lens, scale=0.125, window_size=12)
    got = as_float(out, mx.float32)
    return (not np.isfinite(got).all() or np.abs(got - want).max() > TOLERANCE[mx.float32]
            or not np.allclose(lse, want_lse, rtol=1e-5, atol=1e-4))


def quantized_sources(workdir, cascade_text: str, name: str) -> list:
    """The paged decode (float and 8-bit, float32 D 64) and this cascade text with its 8-bit prefix kernel."""
    paged = write(workdir, only_float32_d64(kernel_text(PAGED)), "original attention_paged")
    text = re.sub(r"^MLX_ATTN_PAGED_QUANTIZED_BITS\(.*\)$", "", kernel_text(QUANTIZED), flags=re.M)
    quantized = write(workdir, text + "\nMLX_ATTN_PAGED_QUANTIZED(float32, float, 64, 8, 8, 32)\n",
                      "original attention_paged_quantized")
    cascade_text = re.sub(r"^MLX_ATTN_PAGED_CASCADE_(2BYTE_)?TYPES\(.*\)$", "", cascade_text, flags=re.M)
    cascade = write(workdir, cascade_text + "\nMLX_ATTN_PAGED_CASCADE_QUANTIZED_PREFIX(float32, float, 64, 8, 32)\n",
                    name)
    return [paged, quantized, cascade]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cascade_mutants")


def originals(workdir) -> list:
    return [write(workdir, only_float32_d64(kernel_text(PAGED)), "original attention_paged"),
            write(workdir, only_float32_d64(kernel_text(CASCADE)), "original attention_paged_cascade")]


def test_unmutated_kernels_pass_the_battery(workdir):
    assert not caught(EmulatedMetal(fast_math=True, sources=originals(workdir)))


QUANTIZED_BATTERY = pytest.mark.skipif(
    not FULL_GRID, reason="the quantized battery compiles three more sources: runs under MLX_ATTN_FULL_GRID=1")


@QUANTIZED_BATTERY
def test_unmutated_quantized_kernels_pass_the_battery(workdir):
    sources = quantized_sources(workdir, kernel_text(CASCADE), "original quantized attention_paged_cascade")
    assert not caught_quantized(EmulatedMetal(fast_math=True, sources=sources))


@QUANTIZED_BATTERY
@pytest.mark.parametrize("name", list(QUANTIZED_MUTANTS))
def test_quantized_mutant_is_caught(workdir, name):
    text = mutated(kernel_text(CASCADE), *QUANTIZED_MUTANTS[name])
    assert_caught(name, quantized_sources(workdir, text, f"cascade {name}"), caught_quantized)


def test_every_mutation_target_exists():
    for source, mutants in ((CASCADE, PREFIX_MUTANTS), (CASCADE, QUANTIZED_MUTANTS), (PAGED, MERGE_MUTANTS)):
        text = kernel_text(source)
        for mutation in mutants.values():
            mutated(text, *mutation)  # asserts the target occurs exactly once


@pytest.mark.parametrize("name", NAMES)
def test_mutant_is_caught(workdir, name):
    paged, cascade = originals(workdir)
    if name in PREFIX_MUTANTS:
        cascade = write(workdir, only_float32_d64(mutated(kernel_text(CASCADE), *MUTANTS[name])), f"cascade {name}")
    else:
        paged = write(workdir, only_float32_d64(mutated(kernel_text(PAGED), *MUTANTS[name])), f"cascade {name}")
    assert_caught(name, [paged, cascade], caught)
