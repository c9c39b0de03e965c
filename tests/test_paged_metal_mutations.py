"""Mutation test of the paged Metal kernels' emulator tests: faults seeded into
copies of metal/attention_paged.metal (its header and the headers it includes
inlined: the page window, the slot of a key, each sequence's rows, block-table
row and partials, the split and row-chunk bounds, the packed output layout
of the merge and of one-split sequences)
and of metal/attention_paged_prefill.metal (the paged tile loader: key rows
located page by page, double-buffered; each query block's sequence, rows and
positions) must each be caught: wrong results beyond tolerance, NaN, a read outside a
buffer (the emulator's guard pages), a deadlock or a compile error. A
mutation whose target text is missing fails the test (tests/mutations.py).
The default suite compiles a representative few mutants;
MLX_ATTN_FULL_GRID=1 compiles them all."""

from __future__ import annotations

import os
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from kernel_lab import msl_emulator
from kernel_lab.metal_runner import REPO, EmulatedMetal
from mlx_attn import _native
from mutations import assert_caught, kernel_text, mutated, write
from kernel_lab.paged_metal_runner import as_float, oracle, paged_instantiation, run_paged
from sdpa_cases import TOLERANCE

pytestmark = [pytest.mark.skipif(not msl_emulator.clang_available(), reason="clang-19 is not installed"),
              pytest.mark.skipif(_native.ext is None, reason="the native extension is not built")]

PAGED = REPO / "metal" / "attention_paged.metal"
PREFILL = REPO / "metal" / "attention_paged_prefill.metal"


def only_float32_d64(text: str) -> str:
    """Keep the one instantiation the cases use, so each mutant compiles quickly."""
    if "attention_paged_prefill<" in text:
        text = re.sub(r"^MLX_ATTN_PAGED_PREFILL_(2BYTE_)?TYPES\(.*\)$", "", text, flags=re.M)
        return text + "\nMLX_ATTN_PAGED_PREFILL(float32, float, 64, 32)\n"
    text = re.sub(r"^MLX_ATTN_PAGED_TYPES\(.*\)$", "", text, flags=re.M)
    return text + "\n" + paged_instantiation("float32, float", 64) + "\n"


def replaced(a: str, b: str) -> tuple:
    return ("replace", a, b)


MUTANTS = {
    "slot ignored: a key read as its own slot": replaced(
        "at.load(key % pages.page_size, lane", "at.load(key, lane"),
    "page window one page late": replaced("first_page = first_key / size;", "first_page = first_key / size + 1;"),
    "page taken from the lane of the absolute page": replaced(
        "const int index = key / page_size - first_page;", "const int index = key / page_size;"),
    # a split of more than 32 pages: lane l's later entries hold pages l + 32, l + 64, ...
    "page window: a later round's entry never picked": replaced(
        "entry = index >= 32 * i ? page[i] : entry;", "entry = index > 32 * i ? page[i] : entry;"),
    "page window: later rounds read the first round's pages": replaced(
        "const int mine = first_page + 32 * i + int(lane);", "const int mine = first_page + int(lane);"),
    "every sequence reads the first block-table row": replaced(
        "kv.pages.select(block_table + seq.table_start,", "kv.pages.select(block_table,"),
    "every sequence reads the first sequence's query rows": replaced(
        "kv, q + seq.q_start * p.q_strides[2], p,", "kv, q, p,"),
    "every sequence writes the first sequence's partials": replaced(
        "partial_out + seq.partial_start * D,", "partial_out,"),
    "split bound off by one": replaced("if (split >= seq.splits || chunk >= chunks)",
                                       "if (split > seq.splits || chunk >= chunks)"),
    "row-chunk bound off by one": replaced("if (split >= seq.splits || chunk >= chunks)",
                                           "if (split >= seq.splits || chunk > chunks)"),
    "page window misses a partial last page": replaced(
        "const int pages = (key_end + size - 1) / size;", "const int pages = key_end / size;"),
    "merge: output rows head-major": replaced(
        "const long row = (seq.q_start + r % p.q_len) * p.q_heads + h;",
        "const long row = seq.q_start * p.q_heads + h * p.q_len + r % p.q_len;"),
    "merge: GQA rows share one query head": replaced(
        "const int h = kv_head * p.group + r / p.q_len;\n  const long row = (seq.q_start",
        "const int h = kv_head * p.group;\n  const long row = (seq.q_start"),
    "merge: partials of the first split only": replaced(
        "rows,\n                     partials, sinks, p, h,", "rows,\n                     1, sinks, p, h,"),
    # a sequence of one split writes its packed rows in the partial dispatch
    "one split: packed rows written head-major": replaced(
        "outputs.position_rows = p.q_heads;", "outputs.position_rows = 1;"),
    "one split: rows written from the batch's first": replaced("out + first_row * D,", "out,"),
    "merge: one-split sequences merged again": replaced("partials <= 1", "partials == 0"),
    # the row shape (one row per threadgroup): its row chunks are its rows
    "row chunks counted in the group shape's rows": replaced(
        "const int chunks = (rows + R - 1) / R;", "const int chunks = (rows + 7) / 8;"),
}
DEFAULT = ["slot ignored: a key read as its own slot", "page window one page late",
           "every sequence reads the first block-table row", "one split: packed rows written head-major",
           "row chunks counted in the group shape's rows", "page window: a later round's entry never picked"]
NAMES = list(MUTANTS) if os.environ.get("MLX_ATTN_FULL_GRID") == "1" else DEFAULT

# the paged prefill kernel (metal/attention_paged_prefill.h)
PREFILL_MUTANTS = {
    "prefill: a key's slot taken as the key": replaced("const int slot = key % page_size;", "const int slot = key;"),
    "prefill: keys located for the block being staged, not the next": replaced(
        "kb + BK, kv_end, lane, key_rows[1 - buffer]", "kb, kv_end, lane, key_rows[1 - buffer]"),
    "prefill: row-offset buffers never swapped": replaced("buffer = 1 - buffer;", ""),
    "prefill: chunk positions not offset by the cached keys": replaced(
        "return query + p.kv_len - p.q_len;", "return query;"),
    "prefill: every query block taken as the first sequence's": replaced(
        "while (sequences[b].query_block_start + sequences[b].query_blocks <= block) {", "while (false) {"),
    "prefill: query block not counted from its sequence's first": replaced(
        "uint(block - seq.query_block_start)", "uint(block)"),
    "prefill: queries read from the first sequence's rows": replaced(
        "(seq.q_start + qi) * p.q_strides[2]", "qi * p.q_strides[2]"),
    "prefill: outputs written at the first sequence's rows": replaced(
        "const long row = (seq.q_start + qi) * p.q_heads + h;", "const long row = qi * p.q_heads + h;"),
    "prefill: every sequence reads the first block-table row": replaced(
        "block_table + seq.table_start;", "block_table;"),
    "prefill: page window from the sequence's first page": replaced(
        "window.select(table_row, kb, end,", "window.select(table_row, 0, end,"),
    "prefill: a block's last key not located": replaced(
        "const int end = min(kb + BK, kv_end);", "const int end = min(kb + BK, kv_end) - 1;"),
    "prefill: keys past the range staged": replaced(
        "const bool inside = kb + j < kv_end;", "const bool inside = true;"),
    "prefill: K/V head not selected": replaced(
        "rows.k[lane] = page * p.k_strides[0] + kv_head * p.k_strides[1]", "rows.k[lane] = page * p.k_strides[0]"),
    "prefill: every key staged from the block's first row": replaced(
        "(k + at.k[j] + col)", "(k + at.k[0] + col)"),
    "prefill: element by element staging reads every value from the block's first row": replaced(
        "v[at.v[j] + col * p.v_strides[3]]", "v[at.v[0] + col * p.v_strides[3]]"),
}
PREFILL_DEFAULT = ["prefill: a key's slot taken as the key", "prefill: keys located for the block being staged, not the next"]
PREFILL_NAMES = list(PREFILL_MUTANTS) if os.environ.get("MLX_ATTN_FULL_GRID") == "1" else PREFILL_DEFAULT

# (q_lens, kv_lens, page_size, heads, kv_heads, options): ragged decode and
# chunked prefill, several splits and page windows, window and sinks
CASES = [
    ((1, 0, 13, 5, 1), (37, 0, 290, 5, 64), 4, 8, 2, {}),
    ((3, 1), (150, 400), 5, 4, 1, {"window_size": 60, "sinks": True}),
    # one sequence of one split (written by the partial kernel) beside one of seven (merged)
    ((1, 1), (20, 400), 4, 8, 2, {"sinks": True}),
    # prefill chunks (40 and 33 rows: two query blocks; 9 == kv_len) after
    # cached keys, pages of 3 cutting every key block, a window
    ((40, 1, 9, 33), (100, 50, 9, 64), 3, 4, 2, {"window_size": 30, "sinks": True}),
] + ([  # the full grid: the same element by element (the path unaligned pages take)
    ((40, 1, 9, 33), (100, 50, 9, 64), 3, 4, 2, {"window_size": 30, "vector_loads": False}),
] if os.environ.get("MLX_ATTN_FULL_GRID") == "1" else [])


def caught(run) -> bool:
    """Every case on both of the decode kernel's threadgroup shapes."""
    return any(caught_on(run, shape) for shape in ("group", "row"))


def caught_on(run, decode_shape: str) -> bool:
    for n, (q_lens, kv_lens, page_size, heads, kv_heads, options) in enumerate(CASES):
        rng = np.random.default_rng(n)
        needed = [(t + page_size - 1) // page_size for t in kv_lens]
        table = np.full((len(needed), max(needed) + 2), -1, np.int32)
        pool = rng.permutation(sum(needed))
        at = 0
        for b, count in enumerate(needed):
            table[b, :count] = pool[at:at + count]
            at += count
        q = mx.array(rng.standard_normal((sum(q_lens), heads, 64)).astype(np.float32))
        k, v = (mx.array(rng.standard_normal((len(pool), kv_heads, page_size, 64)).astype(np.float32))
                for _ in range(2))
        sinks = mx.array(rng.standard_normal(heads).astype(np.float32)) if options.get("sinks") else None
        window = options.get("window_size")
        try:
            out, lse, _, _ = run_paged(run.library, q, [k], [v], mx.array(table), q_lens, kv_lens, scale=0.125,
                                       window_size=window, sinks=sinks, return_lse=True,
                                       vector_loads=options.get("vector_loads", True), decode_shape=decode_shape)
        except msl_emulator.EmulatorError:
            return True  # a read outside a buffer, a deadlock
        want, want_lse = oracle(np.array(q), np.array(k), np.array(v), table, q_lens, kv_lens, scale=0.125,
                                window_size=window, sinks=None if sinks is None else np.array(sinks))
        got = as_float(out, mx.float32)
        if not np.isfinite(got).all() or np.abs(got - want).max() > TOLERANCE[mx.float32]:
            return True
        if not np.allclose(lse, want_lse, rtol=1e-5, atol=1e-4):
            return True
    return False


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("paged_mutants")


def originals(workdir) -> tuple:
    return (write(workdir, only_float32_d64(kernel_text(PAGED)), "original attention_paged"),
            write(workdir, only_float32_d64(kernel_text(PREFILL)), "original attention_paged_prefill"))


def test_unmutated_kernel_passes_the_battery(workdir):
    assert not caught(EmulatedMetal(fast_math=True, sources=list(originals(workdir))))


def test_every_mutation_target_exists():
    for source, mutants in ((PAGED, MUTANTS), (PREFILL, PREFILL_MUTANTS)):
        text = kernel_text(source)
        for name, mutation in mutants.items():
            mutated(text, *mutation)  # asserts the target occurs exactly once


@pytest.mark.parametrize("name", NAMES)
def test_mutant_is_caught(workdir, name):
    mutant = write(workdir, only_float32_d64(mutated(kernel_text(PAGED), *MUTANTS[name])), f"paged {name}")
    assert_caught(name, [mutant, originals(workdir)[1]], caught)


@pytest.mark.parametrize("name", PREFILL_NAMES)
def test_prefill_mutant_is_caught(workdir, name):
    mutant = write(workdir, only_float32_d64(mutated(kernel_text(PREFILL), *PREFILL_MUTANTS[name])), f"paged {name}")
    assert_caught(name, [originals(workdir)[0], mutant], caught)
