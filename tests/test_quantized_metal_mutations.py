"""Mutation test of the quantized Metal kernel's emulator tests: faults seeded
into copies of metal/attention_quantized.metal (wrong group index, wrong bit
unpacking, scale and bias swapped, each barrier, the split and simdgroup
merges, the one-split output write, ranges and strides), run on both of the
decode's threadgroup shapes, must each be caught: wrong results beyond tolerance, NaN, a deadlock or a compile error.
A mutation whose target text is missing fails the test, so none can
silently test nothing. Helpers are those of the float battery
(tests/test_metal_mutations.py)."""

import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from kernel_lab import msl_emulator
from kernel_lab.metal_runner import REPO, EmulatedMetal, View, decode_instantiation, quantized_instantiation
from mutations import kernel_text, assert_caught, mutated, write
from test_metal_mutations import case_options, differs_from_reference

pytestmark = pytest.mark.skipif(not msl_emulator.clang_available(), reason="clang-19 is not installed")

QUANTIZED = REPO / "metal" / "attention_quantized.metal"
DECODE = REPO / "metal" / "attention_decode.metal"
HEAD_DIMS = (64, 128, 256)  # shared words (64, 128 at 4 bits), whole words (128 at 8 bits, 256)


def only_float32(text: str) -> str:
    """Keep the float32 instantiations the cases use, so each mutant compiles quickly."""
    if "attention_quantized_decode_partial<" in text:
        text = re.sub(r"^MLX_ATTN_QUANTIZED_DECODE_BITS\(.*\)$", "", text, flags=re.M)
        kept = [quantized_instantiation("float32, float", d, bits) for d in HEAD_DIMS for bits in (4, 8)]
    else:
        text = re.sub(r"^MLX_ATTN_DECODE_TYPES\(.*\)$", "", text, flags=re.M)
        kept = [decode_instantiation("float32, float", d) for d in HEAD_DIMS]
    return text + "\n" + "\n".join(kept) + "\n"


def replaced(a: str, b: str) -> tuple:
    return ("replace", a, b)


MUTANTS = {
    **{f"threadgroup_barrier #{i} removed": ("remove", "threadgroup_barrier(", i)
       for i in range(kernel_text(QUANTIZED).count("threadgroup_barrier("))},
    # dequantization
    "group index from the lane, not the feature": replaced(
        "ushort(first / group_size)", "ushort(int(lane) / group_size)"),
    "group scales read by feature, not group": replaced(
        "scales[scale_at + int(lane) * scale_stride]", "scales[scale_at + first * scale_stride]"),
    "code mask one bit short": replaced("(1u << BITS) - 1u", "(1u << (BITS - 1)) - 1u"),
    "shared word: position in the word ignored": replaced("(word >> (shift + e * BITS))", "(word >> (e * BITS))"),
    "shared word taken from the wrong lane": replaced(
        "simd_shuffle(read, ushort(int(lane) / LANES_PER_WORD))", "simd_shuffle(read, ushort(lane))"),
    "whole words: shift of a code wrong": replaced("(word >> (c * BITS))", "(word >> (c * 4))"),
    "whole words: a lane's second word skipped": replaced(
        "(first / CODES_PER_WORD + w) * word_stride", "(first / CODES_PER_WORD) * word_stride"),
    "scale and bias swapped (shared words)": replaced(
        "scale * float((word >> (shift + e * BITS)) & CODE_MASK) + bias",
        "bias * float((word >> (shift + e * BITS)) & CODE_MASK) + scale"),
    "scale and bias swapped (whole words)": replaced(
        "scale * float((word >> (c * BITS)) & CODE_MASK) + bias",
        "bias * float((word >> (c * BITS)) & CODE_MASK) + scale"),
    "key scales read through the bias strides": replaced(
        "p.k_strides, qp->k_scale_strides, qp->k_bias_strides,", "p.k_strides, qp->k_bias_strides, qp->k_bias_strides,"),
    "value head stride assumed contiguous": replaced(
        "kv_head * p.v_strides[1]", "kv_head * p.kv_len * (D * BITS / 32)"),
    # ranges, rows and masks
    "split range off by one": replaced("split * chunk + chunk)", "split * chunk + chunk - 1)"),
    "causal chunk range off by one": replaced(
        "range.end = last_pos + 1 < p.kv_len ? last_pos + 1", "range.end = last_pos < p.kv_len ? last_pos"),
    "window start off by one": replaced("first_pos - p.window_size + 1", "first_pos - p.window_size + 2"),
    "chunk's first position not tracked": replaced("first_pos = min(first_pos, query_position(p, qi));", ""),
    "row chunks ignored": replaced("const int row_chunks = (row_count + R - 1) / R;", "const int row_chunks = 1;"),
    "causal comparison flipped": replaced("key <= pos &&", "key < pos &&"),
    "bool mask ignored": replaced("mask[mask_offset(p, b, h, qi, key)] != 0)", "true)"),
    "additive mask ignored": replaced("logit.value = additive_masked_logit(logit.value, added);", ""),
    "keys not dealt out among simdgroups": replaced(
        "key < kv_end; key += NSG", "key < kv_end; key += 1"),
    "GQA rows share one query head": replaced(
        "const int h = kv_head * p.group + (real ? r / p.q_len : 0);", "const int h = kv_head * p.group;"),
    # online softmax and the merges
    "accumulator rescale dropped": replaced("rows.o[i][e] * alpha + prob", "rows.o[i][e] + prob"),
    "simdgroup combine rescale dropped": replaced(
        "const float their_weight = fast::exp2((their_max - m) * MLX_ATTN_LOG2E);", "const float their_weight = 1.0f;"),
    "simdgroup combine leaves one out": replaced(
        "for (int g = 0; g < NSG - 1; ++g) {\n      const float weight",
        "for (int g = 1; g < NSG - 1; ++g) {\n      const float weight"),
    "partial in a layout the split merge does not read": replaced(
        "partial_out[base * D + KV::dim(lane, e)]", "partial_out[base * D + e * 32 + int(lane)]"),
    "partial max written as the sum": replaced("partial_stats[base * 2] = rows.m[i];", "partial_stats[base * 2] = rows.l[i];"),
    # one split: the partial kernel writes the output itself (the merge here is the unmutated decode
    # library's; the shared body's lse and row mutants are the float battery's)
    "one split: the sinks skipped": replaced("if (p.has_sinks != 0) {", "if (false) {"),
    "one split writes partials nobody merges": replaced("partial_stats, groups.x == 1, sinks", "partial_stats, false, sinks"),
    # the loader policy (QuantizedKV) and the interior-key shortcut (decode_keys)
    "loader: K/V head not selected": replaced(
        "at[i][0] = b * strides[i][0] + kv_head * strides[i][1];", "at[i][0] = b * strides[i][0];"),
    "loader: values read from the key triple": replaced(
        "dequantize_slice<T, D, BITS>(v, at[3][0]", "dequantize_slice<T, D, BITS>(k, at[3][0]"),
    "interior shortcut: a key past the diagonal taken as interior": replaced(
        "first_key + keys - 1 > first_pos;", "first_key + keys - 2 > first_pos;"),
    "interior shortcut: a key before the window taken as interior": replaced(
        "first_key <= last_pos - p.window_size;", "first_key < last_pos - p.window_size;"),
    "softcap variant never taken": replaced("if (p.softcap > 0.0f) {", "if (false) {"),
}


def quantized(x: mx.array, group_size: int, bits: int) -> tuple:
    return tuple(mx.quantize(x, group_size=group_size, bits=bits))


def cache_view(x: mx.array) -> View:
    """x as the first T positions of a longer cache holding garbage past T."""
    b, h, t, f = x.shape
    tail = mx.full((b, h, 5, f), 0xFFFFFFFF if x.dtype == mx.uint32 else float("nan"), dtype=x.dtype)
    return View(mx.concatenate([x, tail], axis=2), lambda a: a[:, :, :t])


# (B, Hq, Hkv, Tq, Tkv, D, bits, group_size) and the options
CASES = [
    dict(shape=(1, 8, 2, 2, 150, 64, 4, 32), mask="causal", sinks=True),  # decode: split K/V, shared words
    dict(shape=(1, 4, 2, 3, 140, 128, 8, 32), mask="bool"),  # whole words, 4 groups
    dict(shape=(1, 4, 1, 1, 90, 128, 4, 64), window_size=7),
    dict(shape=(1, 2, 1, 2, 100, 256, 8, 64), mask="additive"),  # two words per lane
    dict(shape=(1, 2, 1, 2, 100, 256, 4, 128)),
    # 8 positions x GQA 4, the most rows the decode kernel takes (longer:
    # the quantized prefill kernel, tests/test_quantized_prefill_mutations.py)
    dict(shape=(1, 8, 2, 8, 45, 64, 8, 64), mask="causal", layout="cache"),  # 2 row chunks, strided triples
    dict(shape=(1, 8, 2, 8, 60, 128, 4, 32), window_size=9),  # 4 row chunks and the window
    dict(shape=(2, 8, 2, 3, 70, 64, 8, 32), sinks=True, layout="biases"),  # scales and biases strides differ
    dict(shape=(1, 4, 2, 3, 70, 64, 8, 32), mask="additive", softcap=0.8),  # the softcap variant
]


def caught(run) -> bool:
    """Every case on both of the decode's threadgroup shapes (the group
    shape first: most mutants are caught there)."""
    return any(caught_on(run, shape) for shape in ("group", "row"))


def caught_on(run, decode_shape: str) -> bool:
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
        elif case.get("layout") == "biases":  # biases stored [B, T, H, G]
            views_k[2], views_v[2] = (View(mx.contiguous(t[2].transpose(0, 2, 1, 3)), lambda a: a.transpose(0, 2, 1, 3))
                                      for t in (k_quant, v_quant))
        try:
            got, lse = run.quantized(q, views_k, views_v, bits=bits, group_size=group_size, return_lse=True,
                                     gpu_target={"decode_shape": decode_shape}, **kw)
        except msl_emulator.EmulatorError:
            return True  # deadlock or launch failure
        k_ref, v_ref = (mx.dequantize(*t, group_size=group_size, bits=bits) for t in (k_quant, v_quant))
        if differs_from_reference(got, lse, q, k_ref, v_ref, **kw):
            return True
    return False


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("quantized_mutants")


@pytest.fixture(scope="module")
def decode_merge(workdir) -> Path:
    return write(workdir, only_float32(kernel_text(DECODE)), "original attention_decode")


def test_unmutated_kernel_passes_the_battery(workdir, decode_merge):
    original = write(workdir, only_float32(kernel_text(QUANTIZED)), "original attention_quantized")
    assert not caught(EmulatedMetal(fast_math=True, sources=[decode_merge, original]))


@pytest.mark.parametrize("name", list(MUTANTS))
def test_mutant_is_caught(workdir, decode_merge, name):
    mutant = write(workdir, only_float32(mutated(kernel_text(QUANTIZED), *MUTANTS[name])), f"quantized {name}")
    assert_caught(name, [decode_merge, mutant], caught)
