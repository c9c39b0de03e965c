"""Mutation test of the quantized prefill kernel's emulator tests: faults
seeded into copies of metal/attention_quantized_prefill.metal (its headers
inlined; the targets are the dequantizing block loader and the kernel body
around it) must each be caught: wrong results beyond tolerance, NaN, a read
outside a buffer (the emulator's guard pages), a deadlock or a compile
error. A mutation whose target text is missing fails the test
(tests/mutations.py). The default suite compiles two mutants;
MLX_ATTN_FULL_GRID=1 compiles them all."""

from __future__ import annotations

import os
import mlx.core as mx
import numpy as np
import pytest

from kernel_lab import msl_emulator
from kernel_lab.metal_runner import EmulatedMetal, View
from mlx_attn import _native
from mutations import assert_caught, kernel_text, mutated
from test_quantized_metal_mutations import cache_view, quantized
from test_metal_mutations import case_options, differs_from_reference
from test_quantized_prefill_metal import SOURCE, instance, trimmed_source

pytestmark = [pytest.mark.skipif(not msl_emulator.clang_available(), reason="clang-19 is not installed"),
              pytest.mark.skipif(_native.ext is None, reason="the native extension is not built")]


def replaced(a: str, b: str) -> tuple:
    return ("replace", a, b)


STAGE_CALL = "stage_quantized_key_block<T, D, BK, BITS, PrefillGroup::THREADS>(kv, kb, kv_end, tid, tiles);"
DEQUANTIZE = "row[w * CODES_PER_WORD + c] = T(scale * float((word >> (c * BITS)) & CODE_MASK) + bias);"
MUTANTS = {
    "group of a run taken as the first": replaced("const int group = col / kv.group_size;", "const int group = 0;"),
    "code shift of a 4-bit word": replaced(DEQUANTIZE, DEQUANTIZE.replace("(c * BITS)", "(c * 4)")),
    "code mask one bit short": replaced(
        "constexpr uint CODE_MASK = (1u << BITS) - 1u;\n  const QuantizedRowAt at",
        "constexpr uint CODE_MASK = (1u << (BITS - 1)) - 1u;\n  const QuantizedRowAt at"),
    "scale and bias swapped": replaced(DEQUANTIZE, DEQUANTIZE.replace("T(scale * float", "T(bias * float")
                                       .replace("+ bias)", "+ scale)")),
    "a run's second word skipped": replaced("(col / CODES_PER_WORD + w) * at.word_stride",
                                            "(col / CODES_PER_WORD) * at.word_stride"),
    "values read through the key strides": replaced(
        "value ? quantized_row_at<3>(kv, key) : quantized_row_at<0>(kv, key)", "quantized_row_at<0>(kv, key)"),
    "values' codes read from the keys": replaced("const device uint* packed = value ? kv.v : kv.k;",
                                                 "const device uint* packed = kv.k;"),
    "value runs never staged": replaced("u < 2 * TILE_RUNS; u += THREADS", "u < TILE_RUNS; u += THREADS"),
    "run staged into the wrong key row": replaced("const int j = run / ROW_RUNS;", "const int j = run % BK;"),
    "keys past the range read, not zeroed": replaced("if (key >= kv_end) {", "if (false) {"),
    "key position stride ignored": replaced(
        "return {kv.at[FIRST][0] + key * kv.at[FIRST][1],", "return {kv.at[FIRST][0] + key,"),
    "scale read through the bias strides": replaced(
        "scales[at.scales + group * at.scale_stride]", "scales[at.biases + group * at.bias_stride]"),
    "K/V head not selected": replaced(
        "at[i][0] = b * strides[i][0] + kv_head * strides[i][1];", "at[i][0] = b * strides[i][0];"),
    "barrier after staging removed": replaced(
        STAGE_CALL + "\n    threadgroup_barrier(mem_flags::mem_threadgroup);", STAGE_CALL),
    "barrier before the next staging removed": replaced(
        "threadgroup_barrier(mem_flags::mem_threadgroup);  // the next block's staging overwrites the tiles", ""),
}
DEFAULT = ["code shift of a 4-bit word", "values read through the key strides"]
NAMES = list(MUTANTS) if os.environ.get("MLX_ATTN_FULL_GRID") == "1" else DEFAULT

# (B, Hq, Hkv, Tq, Tkv, D, bits, group_size) and the options, float32
CASES = [
    # two groups per row (shared scales: one per run), a partial key block,
    # NaN scales and garbage words past the cache's end, sinks
    dict(shape=(1, 8, 2, 40, 70, 64, 4, 32), mask="causal", sinks=True, layout="cache"),
    # two words per run, two batch entries, value biases stored [B, T, H, G], a window
    dict(shape=(2, 4, 2, 33, 50, 128, 8, 64), window_size=20, layout="biases"),
]
# the cases' kernels only: a mutant builds in about half the time of the
# emulator test's sample build
INSTANCES = [instance("float32", 64, 4), instance("float32", 128, 8)]


def caught(run) -> bool:
    for n, case in enumerate(CASES):
        b, hq, hkv, tq, tkv, d, bits, group_size = case["shape"]
        rng = np.random.default_rng(n)
        q = mx.array(rng.standard_normal((b, hq, tq, d)).astype(np.float32))
        k, v = (mx.array(rng.standard_normal((b, hkv, tkv, d)).astype(np.float32)) for _ in range(2))
        k_quant, v_quant = quantized(k, group_size, bits), quantized(v, group_size, bits)
        kw = {"scale": d**-0.5, **case_options(case, rng, hq, tq, tkv)}
        views_k, views_v = [View(a) for a in k_quant], [View(a) for a in v_quant]
        if case.get("layout") == "cache":
            views_k, views_v = [cache_view(a) for a in k_quant], [cache_view(a) for a in v_quant]
        elif case.get("layout") == "biases":  # the values' only: K and V strides differ
            views_v[2] = View(mx.contiguous(v_quant[2].transpose(0, 2, 1, 3)), lambda a: a.transpose(0, 2, 1, 3))
        try:
            got, lse = run.quantized(q, views_k, views_v, bits=bits, group_size=group_size, return_lse=True, **kw)
        except msl_emulator.EmulatorError:
            return True  # a read outside a buffer, a deadlock
        assert run.last_plan.dispatches[0].kernel.startswith("attention_quantized_prefill_")
        k_ref, v_ref = (mx.dequantize(*t, group_size=group_size, bits=bits) for t in (k_quant, v_quant))
        if differs_from_reference(got, lse, q, k_ref, v_ref, **kw):
            return True
    return False


def test_unmutated_kernel_passes_the_battery():
    assert not caught(EmulatedMetal(fast_math=True, sources=[trimmed_source(INSTANCES)]))


def test_every_mutation_target_exists():
    text = kernel_text(SOURCE)
    for mutation in MUTANTS.values():
        mutated(text, *mutation)  # asserts the target occurs exactly once


@pytest.mark.parametrize("name", NAMES)
def test_mutant_is_caught(name):
    mutant = trimmed_source(INSTANCES, mutated(kernel_text(SOURCE), *MUTANTS[name]))
    assert_caught(name, [mutant], caught)
