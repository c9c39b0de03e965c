"""Mutation battery of the fused quantized matrix-vector product: seed one
fault into its source (csrc/cpu/matvec_impl.h), build the generic copy with
it into the standalone driver (tests/cpu_harness/matvec_driver.cpp: 4 and 8
bits, groups of 32/64/128, float/half/bfloat16 scales, 1 to 8 rows, rows
of more groups than one scale chunk, against a double product of codes it
unpacks itself), and require the driver to fail (tests/cpu_mutation_battery.py).

One mutant by default (a few seconds of compiling); every mutant with
MLX_ATTN_FULL_GRID=1."""

from __future__ import annotations

import pytest

from cpu_mutation_battery import CpuMutationBattery, selected

BATTERY = CpuMutationBattery(header="matvec_impl.h", unit="matvec", driver="matvec_driver.cpp", name="matvec")

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

SELECTED = selected(MUTANTS, DEFAULT_MUTANTS)


@pytest.mark.parametrize("name,target,replacement", SELECTED, ids=[m[0] for m in SELECTED])
def test_matvec_mutants_are_caught(tmp_path, name, target, replacement):
    BATTERY.assert_caught(tmp_path, name, target, replacement)


def test_every_mutation_target_exists():
    BATTERY.assert_targets_exist(MUTANTS)
