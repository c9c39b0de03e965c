"""Mutation battery of the D-split prefill kernel
(metal/attention_prefill_split.h): faults seeded into its D chunks, value
passes and staging must each be caught by the battery below (wrong results
against the reference path, NaN, a misaligned vector load, or a compile
error). The loop: tests/mutations.py.

Each mutant is one emulator compile (tens of seconds), so two run by default
(the skipped last key-dim chunk and the skipped last value pass) and every
mutant under MLX_ATTN_FULL_GRID=1."""

import os
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from kernel_lab import msl_emulator
from kernel_lab.metal_runner import REPO, EmulatedMetal
from mlx_attn.reference import reference_attention
from mutations import assert_caught, kernel_text, mutated, write
from sdpa_cases import TOLERANCE

pytestmark = pytest.mark.skipif(not msl_emulator.clang_available(), reason="clang-19 is not installed")

SPLIT = REPO / "metal" / "attention_prefill_split.metal"
FULL_GRID = os.environ.get("MLX_ATTN_FULL_GRID") == "1"


def only_float32(text: str) -> str:
    """The float32, BK = 8 instantiations the cases use (so each mutant
    compiles quickly): 192/128 (three key chunks, one value pass; no mask and
    bool) and 256/256 (four key chunks, two value passes; no mask)."""
    text = re.sub(r"^MLX_ATTN_PREFILL_SPLIT_(2BYTE_)?TYPES\(.*\)$", "", text, flags=re.M)
    return text + ('\nMLX_ATTN_PREFILL_SPLIT_MASK("", MLX_ATTN_MASK_NONE, float32, float, 192, 128, 8)'
                   '\nMLX_ATTN_PREFILL_SPLIT_MASK("_mask_bool", MLX_ATTN_MASK_BOOL, float32, float, 192, 128, 8)'
                   '\nMLX_ATTN_PREFILL_SPLIT_MASK("", MLX_ATTN_MASK_NONE, float32, float, 256, 256, 8)\n')


MUTANTS = {
    "the last key-dim chunk skipped": ("replace", "for (int d0 = 0; d0 < D; d0 += QC)",
                                       "for (int d0 = 0; d0 < D - QC; d0 += QC)"),
    "the last value pass skipped": ("replace", "for (int v0 = 0; v0 < DV; v0 += VC)",
                                    "for (int v0 = 0; v0 < DV - VC; v0 += VC)"),
    "K read at the chunk's first dims": ("replace", "* Tiles::LDK + d0 + d * 8 + r]", "* Tiles::LDK + d * 8 + r]"),
    "Q read at the chunk's first dims": ("replace", "q_row + (d0 + d * 8 + c) * p.q_strides[3]",
                                         "q_row + (d * 8 + c) * p.q_strides[3]"),
    "V staged from the first value chunk": ("replace", "(v0 + col) * p.v_strides[3]", "col * p.v_strides[3]"),
    "output written at the first value chunk": ("replace", "DV, v0, v0 == 0,", "DV, 0, v0 == 0,"),
    # (the register-resident kernel, inlined too, rescales D / 8 tiles)
    "the pass's O not rescaled by the new max": ("remove", "prefill_rescale<VC / 8>(o_tiles, alpha)", 0),
    "V tile read shifted in later passes": ("replace", "* Tiles::LDV + d * 8 + c + t]", "* Tiles::LDV - v0 / 32 + d * 8 + c + t]"),
}
DEFAULT_MUTANTS = ["the last key-dim chunk skipped", "the last value pass skipped"]
# Caught only where a misaligned device load fails: in the counting build.
ALIGNMENT_MUTANTS = {
    "vector staging whatever the alignment": ("replace", "kb, kv_end, v0, vector_loads, tid, tiles)",
                                              "kb, kv_end, v0, true, tid, tiles)"),
}

# (shape b, hq, hkv, tq, tkv; dims d, dv; keywords): prefill only (tq > 8)
CASES = [
    dict(shape=(1, 4, 2, 37, 21), dims=(192, 128), mask="causal"),
    dict(shape=(1, 2, 1, 40, 30), dims=(256, 256), window_size=9),
    dict(shape=(1, 2, 2, 33, 19), dims=(256, 256), sinks=True),
    dict(shape=(1, 2, 1, 20, 13), dims=(192, 128), mask="bool"),
    dict(shape=(1, 2, 1, 20, 13), dims=(256, 256), layout="unaligned"),  # scalar loads
    dict(shape=(1, 2, 1, 35, 45), dims=(256, 256), mask="causal", layout="cache"),  # the last block's tail is NaN
    # keys past the first block score ~30x higher: the row max moves far past the
    # lazy max's 8 (log2 units), so every pass must rescale its O slice
    dict(shape=(1, 2, 1, 20, 29), dims=(256, 256), rising_keys=True),
]


def caught(run) -> bool:
    for i, case in enumerate(CASES):
        b, hq, hkv, tq, tkv = case["shape"]
        d, dv = case["dims"]
        rng = np.random.default_rng(i)
        q, k, v = (mx.array(rng.standard_normal(s).astype(np.float32))
                   for s in ((b, hq, tq, d), (b, hkv, tkv, d), (b, hkv, tkv, dv)))
        if case.get("rising_keys"):  # (the battery's BK: 8 keys a block)
            k = k * mx.array(np.where(np.arange(tkv) >= 8, 30.0, 1.0).astype(np.float32))[:, None]
        kw = {"scale": d ** -0.5}
        if case.get("mask") == "bool":
            visible = rng.random((tq, tkv)) > 0.4
            visible[0] = False
            kw["mask"] = mx.array(visible)
        elif case.get("mask"):
            kw["mask"] = case["mask"]
        if case.get("window_size"):
            kw["window_size"] = case["window_size"]
        if case.get("sinks"):
            kw["sinks"] = mx.array(rng.standard_normal(hq).astype(np.float32) * 3)
        try:
            got = run(q, k, v, **kw, layout=case.get("layout"))
        except msl_emulator.EmulatorError:
            return True  # deadlock or launch failure
        want = np.array(reference_attention(q, k, v, **kw))
        if not np.isfinite(np.array(got)).all() or np.abs(np.array(got) - want).max() > TOLERANCE[mx.float32]:
            return True
    return False


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("split_mutants")


def test_unmutated_kernel_passes_the_battery(workdir):
    original = write(workdir, only_float32(kernel_text(SPLIT)), "original split")
    assert not caught(EmulatedMetal(fast_math=True, sources=[original]))


@pytest.mark.parametrize("name", list(MUTANTS) if FULL_GRID else DEFAULT_MUTANTS)
def test_mutant_is_caught(workdir, name):
    mutant = write(workdir, only_float32(mutated(kernel_text(SPLIT), *MUTANTS[name])), name)
    assert_caught(name, [mutant], caught)


@pytest.mark.skipif(not FULL_GRID, reason="a counting-build compile: MLX_ATTN_FULL_GRID=1")
@pytest.mark.parametrize("name", list(ALIGNMENT_MUTANTS))
def test_alignment_mutant_is_caught(workdir, name):
    mutant = write(workdir, only_float32(mutated(kernel_text(SPLIT), *ALIGNMENT_MUTANTS[name])), name)
    assert_caught(name, [mutant], caught, counters=True)
