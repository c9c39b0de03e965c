"""Mutation battery of the CPU kernel's paged K/V layout: seed one fault
into the kernel source (csrc/cpu/kernel_impl.h: PagedLayout, the per-page
segments, the packed rows), build the generic kernel copy with it into the
standalone paged driver (tests/cpu_harness/paged_driver.cpp: ragged batches
over scattered, shared pages against a scalar double-precision paged
attention), and require the driver to fail (tests/cpu_mutation_battery.py).

One mutant by default (about 20 s of compiling, two builds in parallel);
every mutant with MLX_ATTN_FULL_GRID=1."""

from __future__ import annotations

import pytest

from cpu_mutation_battery import CpuMutationBattery, selected

BATTERY = CpuMutationBattery(header="kernel_impl.h", unit="kernel", driver="paged_driver.cpp", name="paged")

# (name, target text, replacement): each target occurs exactly once.
MUTANTS = [
    ("a page's run one key too long", "call.paged.page_size - slot}", "call.paged.page_size - slot + 1}"),
    ("slot off by one", "const int slot = key % call.paged.page_size;",
     "const int slot = (key + 1) % call.paged.page_size;"),
    ("segment not cut at the page end", "const int len = at.run < n - j ? at.run : n - j;", "const int len = n - j;"),
    ("the sequence's own kv_len ignored", "t.seq.kv_len = it.kv_len;", "t.seq.kv_len = p.kv_len;"),
    ("packed q rows from the batch start", "const int64_t qi = w.tile.q_begin + w.query(r);",
     "const int64_t qi = w.query(r);"),
    ("output row without its head", "return (t.q_begin + qi) * call.problem.q_heads + h;",
     "return (t.q_begin + qi) * call.problem.q_heads;"),
    ("in-place scores of every segment at the block start", "scores_t + seg.first * w.ls, seg.n);",
     "scores_t, seg.n);"),
    ("in-place P.V of every segment from the block start",
     "matmul_accumulate_transposed_a(w.buf.scores_t + seg.first * w.ls, w.ls,",
     "matmul_accumulate_transposed_a(w.buf.scores_t, w.ls,"),
    ("packed rows all from the segment's first slot", "const int64_t koff = w.k_at(seg.outer, seg.slot + i);",
     "const int64_t koff = w.k_at(seg.outer, seg.slot);"),
]
DEFAULT_MUTANTS = [MUTANTS[2]]

SELECTED = selected(MUTANTS, DEFAULT_MUTANTS)


@pytest.mark.parametrize("name,target,replacement", SELECTED, ids=[m[0] for m in SELECTED])
def test_paged_layout_mutants_are_caught(tmp_path, name, target, replacement):
    BATTERY.assert_caught(tmp_path, name, target, replacement)


def test_every_mutation_target_exists():
    BATTERY.assert_targets_exist(MUTANTS)
