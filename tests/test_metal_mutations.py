"""Mutation test of the emulator-based kernel tests: faults seeded into copies
of the Metal kernels must each be caught (wrong results beyond tolerance, NaN,
a deadlock, or a compile error). A mutation whose target text is missing
fails the test, so it can never silently test nothing."""

import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import msl_emulator
from metal_runner import REPO, EmulatedMetal
from mlx_attn.reference import reference_attention

pytestmark = pytest.mark.skipif(not msl_emulator.clang_available(), reason="clang-19 is not installed")

PREFILL = REPO / "metal" / "attention_prefill.metal"


def only_float32_d64(text: str) -> str:
    """Keep one instantiation so each mutant compiles quickly."""
    text = re.sub(r"^MLX_ATTN_PREFILL_TYPES\(.*\)$", "", text, flags=re.M)
    return text + "\nMLX_ATTN_PREFILL(float32, float, 64, 32)\n"


def nth_occurrence_removed(text: str, needle: str, n: int) -> str:
    starts = [m.start() for m in re.finditer(re.escape(needle), text)]
    start = starts[n]
    end = text.index(";", start) + 1
    return text[:start] + text[end:]


BARRIERS = PREFILL.read_text().count("threadgroup_barrier(")
SIMD_BARRIERS = PREFILL.read_text().count("simdgroup_barrier(")

MUTANTS = {
    **{f"threadgroup_barrier #{i} removed": ("remove", "threadgroup_barrier(", i) for i in range(BARRIERS)},
    **{f"simdgroup_barrier #{i} removed": ("remove", "simdgroup_barrier(", i) for i in range(SIMD_BARRIERS)},
    "causal comparison flipped": ("replace", "key <= pos &&", "key < pos &&"),
    "window comparison off by one": ("replace", "key > pos - p.window_size", "key >= pos - p.window_size"),
    "accumulator rescale dropped": ("replace", "simdgroup_multiply(o_tiles[d], rescale, o_tiles[d]);", ""),
    "K/V tile load bound off by one": ("replace", "e < BK * D; e += THREADS", "e < BK * D - 1; e += THREADS"),
    "causal block range off by one": ("replace", "kv_end = min(kv_end, last_pos + 1);", "kv_end = min(kv_end, last_pos);"),
    "output row bound off by one": ("replace", "if (row < p.q_len) {", "if (row < p.q_len - 1) {"),
    "bool mask ignored": ("replace", "visible = mask[at] != 0;", "visible = true;"),
    "sink left out of the sum": ("replace", "l_final = l_row * correction + exp2(sink - m_final);", "l_final = l_row * correction;"),
}


def mutate(kind, a, b) -> str:
    text = PREFILL.read_text()
    if kind == "remove":
        assert text.count(a) > b
        return only_float32_d64(nth_occurrence_removed(text, a, b))
    assert text.count(a) == 1, f"mutation target {a!r} must occur exactly once"
    return only_float32_d64(text.replace(a, b))


CASES = [
    dict(shape=(1, 4, 2, 40, 100), mask="causal"),
    dict(shape=(1, 2, 1, 37, 90), window_size=7),
    dict(shape=(2, 2, 2, 33, 70), mask="bool", sinks=True),
]


def caught(run) -> bool:
    for case in CASES:
        b, hq, hkv, tq, tkv = case["shape"]
        rng = np.random.default_rng(tq)
        q, k, v = (mx.array(rng.standard_normal(s).astype(np.float32))
                   for s in ((b, hq, tq, 64), (b, hkv, tkv, 64), (b, hkv, tkv, 64)))
        kw = {"scale": 0.125}
        if case.get("mask") == "bool":
            kw["mask"] = mx.array(rng.random((tq, tkv)) > 0.4)
        elif case.get("mask"):
            kw["mask"] = case["mask"]
        if case.get("window_size"):
            kw["window_size"] = case["window_size"]
        if case.get("sinks"):
            kw["sinks"] = mx.array(rng.standard_normal(hq).astype(np.float32))
        try:
            got = np.array(run(q, k, v, **kw))
        except msl_emulator.EmulatorError:
            return True  # deadlock or launch failure
        want = np.array(reference_attention(q, k, v, **kw))
        if not np.isfinite(got).all() or np.abs(got - want).max() > 2e-5:
            return True
    return False


def test_unmutated_kernel_passes_the_battery():
    assert not caught(EmulatedMetal(fast_math=True, sources=[_write(only_float32_d64(PREFILL.read_text()), "original")]))


_TMP = Path(__import__("tempfile").mkdtemp(prefix="mlx_attn_mutants_"))


def _write(text: str, name: str) -> Path:
    path = _TMP / f"{re.sub(r'[^a-z0-9]+', '_', name.lower())}.metal"
    path.write_text(text)
    return path


@pytest.mark.parametrize("name", list(MUTANTS))
def test_mutant_is_caught(name):
    source = _write(mutate(*MUTANTS[name]), name)
    try:
        run = EmulatedMetal(fast_math=True, sources=[source])
    except msl_emulator.MetalCompileError:
        return  # caught by the compiler
    assert caught(run), f"mutant survived: {name}"
