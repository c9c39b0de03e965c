"""Mutation battery of the CPU kernel's paged K/V layout: seed one fault
into the kernel source (csrc/cpu/kernel_impl.h: PagedLayout, the per-page
segments, the packed rows), build the generic kernel copy with it into the
standalone paged driver (tests/cpu_harness/paged_driver.cpp: ragged batches
over scattered, shared pages against a scalar double-precision paged
attention), and require the driver to fail. The unchanged source must pass
first, so a mutant cannot be "caught" by a broken driver.

One mutant by default (about 20 s of compiling, two builds in parallel);
every mutant with MLX_ATTN_FULL_GRID=1. Needs clang (clang-19); without it
the test skips with the reason, except on CI (CI set), where it fails."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNEL = ROOT / "csrc" / "cpu" / "kernel_impl.h"
DRIVER = ROOT / "tests" / "cpu_harness" / "paged_driver.cpp"
FLAGS = ["-std=c++20", "-O1", "-ffp-contract=fast", "-fno-math-errno"]

# (name, target text, replacement): each target occurs exactly once.
MUTANTS = [
    ("a page's run one key too long", "call.paged.page_size - slot}", "call.paged.page_size - slot + 1}"),
    ("slot off by one", "const int slot = key % call.paged.page_size;",
     "const int slot = (key + 1) % call.paged.page_size;"),
    ("segment not cut at the page end", "const int len = at.run < n - j ? at.run : n - j;", "const int len = n - j;"),
    ("the sequence's own kv_len ignored", "t.seq.kv_len = it.kv_len;", "t.seq.kv_len = p.kv_len;"),
    ("packed q rows from the batch start", "const int64_t qi = tile.q_begin + q_start + r % qb;",
     "const int64_t qi = q_start + r % qb;"),
    ("output row without its head", "return (t.q_begin + qi) * call.problem.q_heads + h;",
     "return (t.q_begin + qi) * call.problem.q_heads;"),
    ("in-place scores of every segment at the block start", "scores_t + seg.first * rp, rp, seg.n, D, rp);",
     "scores_t, rp, seg.n, D, rp);"),
    ("in-place P.V of every segment from the block start",
     "matmul_accumulate_transposed_a(scores_t + seg.first * rp, rp,", "matmul_accumulate_transposed_a(scores_t, rp,"),
    ("packed rows all from the segment's first slot", "const int64_t koff = k_at(seg.outer, seg.slot + i);",
     "const int64_t koff = k_at(seg.outer, seg.slot);"),
]
DEFAULT_MUTANTS = [MUTANTS[2]]


def _clang():
    for name in ("clang++-19", "clang++"):
        if shutil.which(name):
            return name
    if os.environ.get("CI"):
        pytest.fail("the paged mutation battery needs clang++ on CI")
    pytest.skip("clang++ (clang-19) not found: the paged mutation battery cannot build its driver")


def _start_build(clang, kernel_text: str, out: Path) -> subprocess.Popen:
    """Builds the driver against the generic copy of `kernel_text` (the
    kernel header, possibly mutated) in the background."""
    include = out / "include"
    (include / "csrc" / "cpu").mkdir(parents=True)
    (include / "csrc" / "cpu" / "kernel_impl.h").write_text(kernel_text)
    unit = out / "kernel_generic.cpp"
    unit.write_text('#define MLX_ATTN_ISA generic\n#include "csrc/cpu/isa_generic.h"\n'
                    '#include "csrc/cpu/kernel_impl.h"\n')
    binary = out / "driver"
    script = (f"{clang} {' '.join(FLAGS)} -I{include} -I{ROOT} -c {unit} -o {out / 'kernel.o'} && "
              f"{clang} {' '.join(FLAGS)} -I{ROOT} {DRIVER} {out / 'kernel.o'} -lm -o {binary}")
    return subprocess.Popen(["sh", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _driver_passes(out: Path) -> bool:
    run = subprocess.run([str(out / "driver")], capture_output=True, text=True, timeout=120)
    return run.returncode == 0


SELECTED = MUTANTS if os.environ.get("MLX_ATTN_FULL_GRID") == "1" else DEFAULT_MUTANTS


@pytest.mark.parametrize("name,target,replacement", SELECTED, ids=[m[0] for m in SELECTED])
def test_paged_layout_mutants_are_caught(tmp_path, name, target, replacement):
    clang = _clang()
    source = KERNEL.read_text()
    assert source.count(target) == 1, f"mutation target {target!r} must occur exactly once in {KERNEL.name}"
    builds = {
        "original": _start_build(clang, source, tmp_path / "original"),
        "mutant": _start_build(clang, source.replace(target, replacement), tmp_path / "mutant"),
    }
    logs = {key: proc.communicate()[0] for key, proc in builds.items()}
    assert builds["original"].returncode == 0, f"building the paged driver failed:\n{logs['original']}"
    assert _driver_passes(tmp_path / "original"), "the unchanged kernel fails the paged driver"
    if builds["mutant"].returncode != 0:
        return  # caught by the compiler
    assert not _driver_passes(tmp_path / "mutant"), f"mutant survived: {name}"
