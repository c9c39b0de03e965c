"""Mutation test of the Metal backward's emulator tests: faults seeded into
copies of metal/attention_backward.metal must each be caught by a battery of
gradient checks against the reference path (wrong gradients beyond
tolerance, NaN, a deadlock, an out-of-bounds access or a compile error). A
mutation whose target text is missing fails the test, so none can silently
test nothing."""

import os
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from kernel_lab import msl_emulator
from kernel_lab.metal_runner import EmulatedMetal, View
from mutations import kernel_text, assert_caught, mutated, write
from test_metal_backward import BACKWARD, SPLIT, check, make_mask, qkv, random, split_only

pytestmark = pytest.mark.skipif(not msl_emulator.clang_available(), reason="clang-19 runs the MSL emulator")


def only_float32_d64(text: str) -> str:
    """Keep one instantiation so each mutant compiles quickly."""
    text = re.sub(r"^MLX_ATTN_BACKWARD_((DELTA_|DQ_)?TYPES\(.*\)|SINKS\(.*\)|SINKS_BFLOAT16)$", "", text, flags=re.M)
    return text + "\nMLX_ATTN_BACKWARD(float32, float, 64, 32, 32)\nMLX_ATTN_BACKWARD_SINKS(float32, float)\n"


def barriers() -> dict:
    count = kernel_text(BACKWARD).count("threadgroup_barrier(")
    assert count == 4  # two per tiled kernel: after staging, before restaging
    return {f"threadgroup_barrier #{i} removed": ("remove", "threadgroup_barrier(", i) for i in range(count)}


MUTANTS = {
    **barriers(),
    # delta = rowsum(dO * O) - dlse, and its use in dS
    "delta: dS without the delta term": ("replace", "prob * (d_prob - delta)", "prob * d_prob"),
    "delta: lse cotangent left out": ("replace", "delta[row] = dot - d_lse[row];", "delta[row] = dot;"),
    "delta: row sum of one lane only": ("replace", "dot = simd_sum(dot);", ""),
    # P = exp(S - lse)
    "lse: P without subtracting the lse": ("replace", "exp2((logit.value - lse) * MLX_ATTN_LOG2E)", "exp2(logit.value * MLX_ATTN_LOG2E)"),
    "lse: natural exp taken as exp2": ("replace", "exp2((logit.value - lse) * MLX_ATTN_LOG2E)", "exp2(logit.value - lse)"),
    "lse: rows past the query length visible": ("replace", "key < p.kv_len && qi < p.q_len && key_visible", "key < p.kv_len && key_visible"),
    # the GQA reduction of dK/dV and the head mapping of dQ
    "gqa: dK/dV from the first query head of the group only": ("replace", "for (int g = 0; g < p.group; ++g)", "for (int g = 0; g < 1; ++g)"),
    "gqa: dK/dV query head mapping wrong": ("replace", "head.h = keys.kv_head * p.group + g;", "head.h = keys.kv_head + g;"),
    "gqa: dQ reads the wrong K/V head": ("replace", "rows.kv_head = rows.h / p.group;", "rows.kv_head = rows.h % p.kv_heads;"),
    # causal / window bounds
    "causal: comparison flipped": ("replace", "key <= pos &&", "key < pos &&"),
    "window: comparison off by one": ("replace", "key > pos - p.window_size", "key >= pos - p.window_size"),
    "causal: dK/dV first query row off by one": ("replace", "first_key - offset > 0 ? first_key - offset : 0", "first_key - offset + 1 > 0 ? first_key - offset + 1 : 0"),
    "window: dK/dV query range end off by one": ("replace", "const attn_int64 window_end = attn_int64(last_key) - offset + p.window_size;", "const attn_int64 window_end = attn_int64(last_key) - offset + p.window_size - 1;"),
    "causal: dQ key range end off by one": ("replace", "range.end = last_pos + 1 < p.kv_len ? last_pos + 1", "range.end = last_pos < p.kv_len ? last_pos"),
    "window: dQ key range start off by one": ("replace", "const int lo = first_pos - p.window_size + 1;", "const int lo = first_pos - p.window_size + 2;"),
    # the scale of dS in dK and dQ
    "scale: dK not scaled": ("replace", "T(dk_acc[d].thread_elements()[t] * p.scale)", "T(dk_acc[d].thread_elements()[t])"),
    "scale: dQ not scaled": ("replace", "T(dq_acc[d].thread_elements()[t] * p.scale)", "T(dq_acc[d].thread_elements()[t])"),
    "scale: logits not scaled": ("replace", "masked_logit<T, MASK, EDGE, SOFTCAP>(p, mask, score * p.scale,", "masked_logit<T, MASK, EDGE, SOFTCAP>(p, mask, score,"),
    # masks
    "mask: bool mask ignored": ("replace", "mask[mask_offset(p, b, h, qi, key)] != 0)", "true)"),
    "mask: additive mask not added": ("replace", "const float sum = logit.value + added;", "const float sum = logit.value;"),
    # sinks
    "sinks: gradient sign flipped": ("replace", "sum -= fast::exp2((sink - lse[", "sum += fast::exp2((sink - lse["),
    "sinks: stride assumed contiguous": ("replace", "float raw = float(sinks[h * p.sinks_stride]);",
                                         "float raw = float(sinks[h]);"),
    "sinks: one batch only": ("replace", "for (int b = 0; b < p.batch; ++b) {\n    const long head_rows", "for (int b = 0; b < 1; ++b) {\n    const long head_rows"),
    # staging, fragments and stores
    "dkdv: Q/dO staging bound off by one": ("replace", "e < BQ * D; e += THREADS", "e < BQ * D - 1; e += THREADS"),
    "dq: K/V staging bound off by one": ("replace", "e < BK * D; e += THREADS)", "e < BK * D - 1; e += THREADS)"),
    "dkdv: Q^T fragment reads the wrong query": ("replace", "q_tile[(j * 8 + c + t) * LD + d * 8 + r]", "q_tile[(j * 8 + c) * LD + d * 8 + r]"),
    "dkdv: dV uses dS instead of P": ("replace", "simdgroup_multiply_accumulate(dv_acc[d], s_t,", "simdgroup_multiply_accumulate(dv_acc[d], dp_t,"),
    "dkdv: last key row not stored": ("replace", "if (key < p.kv_len) {", "if (key < p.kv_len - 1) {"),
    "dq: K fragment reads the wrong key": ("replace", "tiles.k[(j * 8 + r) * LD + d * 8 + c + t]", "tiles.k[(j * 8 + c) * LD + d * 8 + c + t]"),
    "dq: key sequence stride assumed contiguous": ("replace", "k[k_head + key * p.k_strides[2]", "k[k_head + key * D"),
    "dkdv: query sequence stride assumed contiguous": ("replace", "q[head.q_head + qi * p.q_strides[2]", "q[head.q_head + qi * D"),
    # the interior-tile shortcut: only edge tiles test causal / window / bounds
    "interior shortcut: a key past the diagonal taken as interior": (
        "replace", "first_key + keys - 1 > first_pos;", "first_key + keys - 2 > first_pos;"),
    "interior shortcut: a key before the window taken as interior": (
        "replace", "first_key <= last_pos - p.window_size;", "first_key < last_pos - p.window_size;"),
    "interior shortcut: key blocks past the range end taken as interior": (
        "replace", "first_key + keys > key_end ||", ""),
    "dkdv: query tiles past the range end taken as interior": (
        "replace", "query_position(p, first_query + 7), first_query + 8 > q_end);",
        "query_position(p, first_query + 7), false);"),
    # the softcap's gradient: 1 - tanh^2 of the capped logit, in the variant
    # the tile picks
    "softcap: gradient without the tanh's slope": ("replace", "prob * (d_prob - delta) * logit.slope", "prob * (d_prob - delta)"),
    "softcap: slope of the uncapped logit": (
        "replace", "logit.slope = softcap_slope(logit.value, p.softcap);", "logit.slope = softcap_slope(raw, p.softcap);"),
    # under MLX_ATTN_FULL_GRID=1 (CI time): caught like the float battery's
    **({"softcap: variant never taken": ("replace", "if (p.softcap > 0.0f) {", "if (false) {")}
       if os.environ.get("MLX_ATTN_FULL_GRID") == "1" else {}),
}


def battery(metal) -> None:
    """Gradient checks (float32, D = 64) that together reach every rule the
    mutants break; raises AssertionError on a wrong gradient."""
    q, k, v = qkv(1, 4, 2, 40, 100, 64, mx.float32, seed=1)
    check(metal, q, k, v, mask="causal", d_lse=random((1, 4, 40), 2))
    check(metal, *qkv(1, 2, 1, 37, 90, 64, mx.float32, seed=3), window_size=7)
    q, k, v = qkv(2, 2, 2, 33, 70, 64, mx.float32, seed=4)
    check(metal, q, k, v, mask=make_mask("bool", 33, 70, seed=4, empty_rows=(0,)), sinks=mx.array([0.5, 2.0]))
    q, k, v = qkv(1, 4, 2, 20, 45, 64, mx.float32, seed=5)
    check(metal, q, k, v, mask=make_mask("additive", 20, 45, seed=5), layout="seq_major")
    sinks = View(random((8,), 6), lambda a: a[::2])
    check(metal, *qkv(2, 4, 1, 35, 60, 64, mx.float32, seed=6), mask="causal", sinks=sinks, layout="cache")
    check(metal, *qkv(1, 2, 2, 40, 8, 64, mx.float32, seed=7), mask="causal")  # the first rows see nothing
    # edge tiles: one ending a key past a row group's first position (offset
    # 6), one starting at the last row's window edge (key 0 hidden from 39 only)
    check(metal, *qkv(1, 2, 1, 40, 46, 64, mx.float32, seed=8), mask="causal")
    check(metal, *qkv(1, 2, 1, 48, 48, 64, mx.float32, seed=9), window_size=39)
    # a bool mask whose last key block passes Tkv in rows that fill their simdgroup
    check(metal, *qkv(1, 2, 1, 40, 70, 64, mx.float32, seed=10), mask=make_mask("bool", 40, 70, seed=10))
    # softcap: logits of a few units (the tanh bends), an additive mask after the cap
    q, k, v = qkv(1, 4, 2, 37, 53, 64, mx.float32, seed=11)
    check(metal, q * 3, k, v, mask=make_mask("additive", 37, 53, seed=11), softcap=1.3)


def caught(metal) -> bool:
    try:
        battery(metal)
    except (AssertionError, msl_emulator.EmulatorError):
        return True
    return False


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("backward_mutants")


def test_unmutated_kernels_pass_the_battery(workdir):
    battery(EmulatedMetal(fast_math=True, sources=[write(workdir, only_float32_d64(kernel_text(BACKWARD)), "original")]))


@pytest.mark.parametrize("name", list(MUTANTS))
def test_mutant_is_caught(workdir, name):
    mutant = write(workdir, only_float32_d64(mutated(kernel_text(BACKWARD), *MUTANTS[name])), name)
    assert_caught(name, [mutant], caught)


# ------------------------------------------------ the D-split family
# (metal/attention_backward_split.h). Each mutant is one emulator compile, so
# two run by default and every one under MLX_ATTN_FULL_GRID=1.

def only_delta_float32_d128(text: str) -> str:
    """The register-resident family's delta (value dim 128) and sinks kernels,
    float32: the dispatches the split plan borrows."""
    text = re.sub(r"^MLX_ATTN_BACKWARD_((DELTA_|DQ_)?TYPES\(.*\)|SINKS\(.*\)|SINKS_BFLOAT16)$", "", text, flags=re.M)
    return text + "\nMLX_ATTN_BACKWARD_DELTA(float32, float, 128)\nMLX_ATTN_BACKWARD_SINKS(float32, float)\n"


def only_float32_192(text: str) -> str:
    """192/128 float32: three dK and dQ chunks, two dV chunks (a chunk with no
    dV columns), every mask kind."""
    return split_only(text, "MLX_ATTN_BACKWARD_SPLIT(float32, float, 192, 128)")


SPLIT_MUTANTS = {
    # the chunk loop: every chunk once, the own one last (its columns stay staged)
    "split: own chunk staged first, not last": ("replace", "return (own + 1 + i) % chunks;", "return (own + i) % chunks;"),
    "split dkdv: the last chunk of S^T left out": (
        "replace", "if (i < KC) {\n          accumulate_chunk_scores<T, C, BQ, LD>(s_t,",
        "if (i < KC - 1) {\n          accumulate_chunk_scores<T, C, BQ, LD>(s_t,"),
    "split dq: dO rows read at the key head dim": (
        "replace", "accumulate_chunk_scores<T, C, BK, LD>(dp, d_out, row * DV,",
        "accumulate_chunk_scores<T, C, BK, LD>(dp, d_out, row * D,"),
    "split dkdv: dV written by the chunks past DV": ("replace", "if (own < VC) dv[row * DV + col]", "dv[row * DV + col]"),
    "split dkdv: dK not scaled": (
        "replace", "dk[row * D + col] = T(dk_acc[d].thread_elements()[t] * p.scale);",
        "dk[row * D + col] = T(dk_acc[d].thread_elements()[t]);"),
    "split dq: rows of the chunk index's block": (
        "replace", "query_rows<BQ>(p, uint3(group_id.x / KC,", "query_rows<BQ>(p, uint3(group_id.x % KC,"),
    "split: streamed rows assumed contiguous": (
        "replace", "src[base + row * row_stride + (d0 + col) * col_stride]", "src[base + row * C + (d0 + col) * col_stride]"),
    "split: barrier before the next chunk removed": (
        "remove", "threadgroup_barrier(mem_flags::mem_threadgroup);  // the next chunk", 0),
    "split dkdv: lse and delta staged for rows past the range": (
        "replace", "for (int i = int(tid); i < BQ; i += THREADS) {\n    const bool inside = qs + i < q_end;",
        "for (int i = int(tid); i < BQ; i += THREADS) {\n    const bool inside = true;"),
}
DEFAULT_SPLIT_MUTANTS = ["split: own chunk staged first, not last", "split dq: dO rows read at the key head dim"]


def split_battery(metal) -> None:
    """Gradient checks (float32, 192/128) reaching every chunk of both passes:
    GQA with a lse cotangent, [B, T, H, D] strides with a window, a bool mask
    with sinks (a row that sees nothing), a softcap."""
    def dims(b, hq, hkv, tq, tkv, seed):
        q, k, _ = qkv(b, hq, hkv, tq, tkv, 192, mx.float32, seed)
        return q, k, random((b, hkv, tkv, 128), seed + 7)

    check(metal, *dims(1, 4, 2, 36, 40, 1), mask="causal", d_lse=random((1, 4, 36), 2))
    check(metal, *dims(2, 2, 1, 34, 40, 3), window_size=7, layout="seq_major")
    check(metal, *dims(1, 2, 2, 33, 40, 4), mask=make_mask("bool", 33, 40, seed=4, empty_rows=(0,)),
          sinks=mx.array([0.5, 2.0]))
    q, k, v = dims(1, 2, 1, 20, 36, 5)
    check(metal, q * 3, k, v, mask=make_mask("additive", 20, 36, seed=5), softcap=1.3)


def split_caught(metal) -> bool:
    try:
        split_battery(metal)
    except (AssertionError, msl_emulator.EmulatorError):
        return True
    return False


@pytest.fixture(scope="module")
def split_workdir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("backward_split_mutants")
    (directory / "delta").mkdir()
    write(directory / "delta", only_delta_float32_d128(kernel_text(BACKWARD)), "attention_backward")
    return directory


def test_unmutated_split_kernels_pass_the_battery(split_workdir):
    split = write(split_workdir, only_float32_192(kernel_text(SPLIT)), "original")
    split_battery(EmulatedMetal(fast_math=True, sources=[split_workdir / "delta" / "attention_backward.metal", split]))


@pytest.mark.parametrize("name", list(SPLIT_MUTANTS) if os.environ.get("MLX_ATTN_FULL_GRID") == "1"
                         else DEFAULT_SPLIT_MUTANTS)
def test_split_mutant_is_caught(split_workdir, name):
    mutant = write(split_workdir, only_float32_192(mutated(kernel_text(SPLIT), *SPLIT_MUTANTS[name])), name)
    assert_caught(name, [split_workdir / "delta" / "attention_backward.metal", mutant], split_caught)
