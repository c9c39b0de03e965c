"""Mutation battery of the fused quantized matrix-vector product: seed one
fault into its source (csrc/cpu/matvec_impl.h), build the generic copy with
it into the standalone driver (tests/cpu_harness/matvec_driver.cpp: 4 and 8
bits, groups of 32/64/128, float/half/bfloat16 scales, 1 to 8 rows, rows
of more groups than one scale chunk, against a double product of codes it
unpacks itself), and require the driver to fail. The unchanged source must
pass first, so a mutant cannot be "caught" by a broken driver.

One mutant by default (a few seconds of compiling); every mutant with
MLX_ATTN_FULL_GRID=1. Needs clang (clang-19); without it the test skips with
the reason, except on CI (CI set), where it fails."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNEL = ROOT / "csrc" / "cpu" / "matvec_impl.h"
DRIVER = ROOT / "tests" / "cpu_harness" / "matvec_driver.cpp"
FLAGS = ["-std=c++20", "-O1", "-ffp-contract=fast", "-fno-math-errno"]

# (name, target text, replacement): each target occurs exactly once.
MUTANTS = [
    ("odd 4-bit codes from the low nibble", "__builtin_convertvector(b >> uint8_t(4), vfloat)",
     "__builtin_convertvector(b & uint8_t(15), vfloat)"),
    ("8-bit weights without their bias", "codes_of(codes + col) * scale + bias;", "codes_of(codes + col) * scale;"),
    ("odd columns read from the even half", "load(xr + half + pair)", "load(xr + pair)"),
    ("every group with the chunk's first scale", "splat(scales[j])", "splat(scales[0])"),
    ("scale chunks all from the row's first group", "convert_contiguous<S>(scales, c.scales, n * groups + g0, chunk);",
     "convert_contiguous<S>(scales, c.scales, n * groups, chunk);"),
    ("every row reads the first row's x", "load(c.x + r * c.k + col)", "load(c.x + col)"),
    ("every row written to the first output row", "c.out[r * c.n + n]", "c.out[n]"),
]
DEFAULT_MUTANTS = [MUTANTS[0]]


def _clang():
    for name in ("clang++-19", "clang++"):
        if shutil.which(name):
            return name
    if os.environ.get("CI"):
        pytest.fail("the matvec mutation battery needs clang++ on CI")
    pytest.skip("clang++ (clang-19) not found: the matvec mutation battery cannot build its driver")


def _start_build(clang, kernel_text: str, out: Path) -> subprocess.Popen:
    include = out / "include"
    (include / "csrc" / "cpu").mkdir(parents=True)
    (include / "csrc" / "cpu" / "matvec_impl.h").write_text(kernel_text)
    unit = out / "matvec_generic.cpp"
    unit.write_text('#define MLX_ATTN_ISA generic\n#include "csrc/cpu/isa_generic.h"\n'
                    '#include "csrc/cpu/matvec_impl.h"\n')
    binary = out / "driver"
    script = (f"{clang} {' '.join(FLAGS)} -I{include} -I{ROOT} -c {unit} -o {out / 'matvec.o'} && "
              f"{clang} {' '.join(FLAGS)} -I{ROOT} {DRIVER} {out / 'matvec.o'} -lm -o {binary}")
    return subprocess.Popen(["sh", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _driver_passes(out: Path) -> bool:
    return subprocess.run([str(out / "driver")], capture_output=True, text=True, timeout=120).returncode == 0


SELECTED = MUTANTS if os.environ.get("MLX_ATTN_FULL_GRID") == "1" else DEFAULT_MUTANTS


@pytest.mark.parametrize("name,target,replacement", SELECTED, ids=[m[0] for m in SELECTED])
def test_matvec_mutants_are_caught(tmp_path, name, target, replacement):
    clang = _clang()
    source = KERNEL.read_text()
    assert source.count(target) == 1, f"mutation target {target!r} must occur exactly once in {KERNEL.name}"
    builds = {
        "original": _start_build(clang, source, tmp_path / "original"),
        "mutant": _start_build(clang, source.replace(target, replacement), tmp_path / "mutant"),
    }
    logs = {key: proc.communicate()[0] for key, proc in builds.items()}
    assert builds["original"].returncode == 0, f"building the matvec driver failed:\n{logs['original']}"
    assert _driver_passes(tmp_path / "original"), "the unchanged kernel fails the matvec driver"
    if builds["mutant"].returncode != 0:
        return  # caught by the compiler
    assert not _driver_passes(tmp_path / "mutant"), f"mutant survived: {name}"
