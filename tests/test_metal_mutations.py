"""Mutation test of the emulator-based kernel tests: faults seeded into copies
of the Metal kernels must each be caught (wrong results beyond tolerance, NaN,
a deadlock, a misaligned vector load, or a compile error). A mutation whose
target text is missing fails the test, so it can never silently test nothing
(the loop: tests/mutations.py)."""

import os
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from kernel_lab import msl_emulator
from kernel_lab.metal_runner import REPO, EmulatedMetal, View, decode_instantiation, reference_lse
from mlx_attn.reference import reference_attention
from mutations import kernel_text, assert_caught, mutated, write
from sdpa_cases import TOLERANCE

pytestmark = pytest.mark.skipif(not msl_emulator.clang_available(), reason="clang-19 is not installed")

FULL_GRID = os.environ.get("MLX_ATTN_FULL_GRID") == "1"
PREFILL = REPO / "metal" / "attention_prefill.metal"
DECODE = REPO / "metal" / "attention_decode.metal"


def only_float32_d64(text: str) -> str:
    """Keep the float32 instantiations the cases use (D = 64; decode also
    D = 96, whose lanes read one element per chunk) so each mutant compiles quickly."""
    text = re.sub(r"^MLX_ATTN_(PREFILL|DECODE)_(2BYTE_)?TYPES\(.*\)$", "", text, flags=re.M)
    if "attention_prefill<" in text:
        return text + "\nMLX_ATTN_PREFILL(float32, float, 64, 32)\n"
    return text + "".join(f"\n{decode_instantiation('float32, float', d)}" for d in (64, 96)) + "\n"


def barriers(source: Path, kind: str) -> dict:
    count = kernel_text(source).count(f"{kind}(")
    return {f"{source.stem}: {kind} #{i} removed": (source, "remove", f"{kind}(", i) for i in range(count)}


MUTANTS = {
    **barriers(PREFILL, "threadgroup_barrier"),
    **barriers(PREFILL, "simdgroup_barrier"),
    **barriers(DECODE, "threadgroup_barrier"),
    "prefill: causal comparison flipped": (PREFILL, "replace", "key <= pos &&", "key < pos &&"),
    "prefill: window comparison off by one": (PREFILL, "replace", "key > pos - p.window_size", "key >= pos - p.window_size"),
    "prefill: accumulator rescale dropped": (PREFILL, "replace", "o_tiles[d].thread_elements() *= alpha;", ""),
    "prefill: the lazy max never moves after the first block": (
        PREFILL, "replace", "const bool moves = (block_max - m_row) * MLX_ATTN_LOG2E > MLX_ATTN_LAZY_MAX_LOG2;",
        "const bool moves = m_row == MLX_ATTN_MASKED_LOGIT;"),
    "prefill: rescale skipped unless every row moved its max": (
        PREFILL, "replace", "if (simd_any(alpha != 1.0f)) {", "if (simd_all(alpha != 1.0f)) {"),
    "prefill: row max misses a lane pair": (PREFILL, "replace", "block_max = max(block_max, simd_shuffle_xor(block_max, 8));", ""),
    "prefill: row sum misses a lane pair": (PREFILL, "replace", "p_sum += simd_shuffle_xor(p_sum, 8);", ""),
    "prefill: normalize dropped": (PREFILL, "replace", "T(o_tiles[d].thread_elements()[t] * factor)", "T(o_tiles[d].thread_elements()[t])"),
    "prefill: K^T fragment reads the wrong key": (PREFILL, "replace", "tiles.k[(j * 8 + c + t) * LD + d * 8 + r]", "tiles.k[(j * 8 + c) * LD + d * 8 + r]"),
    "prefill: K/V tile load bound off by one": (PREFILL, "replace", "e < BK * D; e += THREADS)", "e < BK * D - 1; e += THREADS)"),
    "prefill: vector K/V tile load bound short by a vector": (PREFILL, "replace", "e < BK * D; e += THREADS * W", "e < BK * D - W; e += THREADS * W"),
    "prefill: vector K/V tile loads keys past the range": (PREFILL, "replace", "if (key < kv_end) {", "if (true) {"),
    "prefill: vector K/V tile store drops an element": (PREFILL, "replace", "for (int i = 0; i < W; ++i) {", "for (int i = 0; i < W - 1; ++i) {"),
    "prefill: causal block range off by one": (PREFILL, "replace", "range.end = last_pos + 1 < p.kv_len ? last_pos + 1", "range.end = last_pos < p.kv_len ? last_pos"),
    "prefill: output row bound off by one": (PREFILL, "replace", "if (rows.qi < p.q_len) {\n    device T* out_row", "if (rows.qi < p.q_len - 1) {\n    device T* out_row"),
    "prefill: bool mask ignored": (PREFILL, "replace", "mask[mask_offset(p, b, h, qi, key)] != 0)", "true)"),
    "prefill: sink left out of the sum": (PREFILL, "replace", "l_row = l_row * correction + fast::exp2((sink - m_final) * MLX_ATTN_LOG2E);", "l_row = l_row * correction;"),
    "decode: causal comparison flipped": (DECODE, "replace", "key <= pos &&", "key < pos &&"),
    "decode: accumulator rescale dropped": (DECODE, "replace", "rows.o[i][e] * alpha + prob", "rows.o[i][e] + prob"),
    "decode: split range off by one": (DECODE, "replace", "split * chunk + chunk)", "split * chunk + chunk - 1)"),
    "decode: merge rescale dropped": (DECODE, "replace", "return fast::exp2((partial_stats[base * 2] - m) * MLX_ATTN_LOG2E);", "return 1.0f;"),
    "decode: keys not dealt out among simdgroups": (DECODE, "replace", "key < kv_end; key += NSG", "key < kv_end; key += 1"),
    "decode: key range end off by one": (DECODE, "replace", "key < kv_end; key += NSG", "key < kv_end - 1; key += NSG"),
    "decode: simdgroup combine rescale dropped": (DECODE, "replace", "const float their_weight = fast::exp2((their_max - m) * MLX_ATTN_LOG2E);", "const float their_weight = 1.0f;"),
    "decode: combine max taken from one lane": (DECODE, "replace", "max(rows.m[i], simd_max(their_max))", "max(rows.m[i], their_max)"),
    "decode: combine weight broadcast from the wrong lane": (DECODE, "replace", "simd_shuffle(their_weight, ushort(g))", "simd_shuffle(their_weight, ushort(0))"),
    "decode: a handed-over max and sum read by no lane": (DECODE, "replace", "lane < uint(NSG - 1);", "lane < uint(NSG - 2);"),
    "decode: handed-over sums not added across lanes": (DECODE, "replace", "simd_sum(their_sum * their_weight)", "their_sum * their_weight"),
    "decode: lane layout overlaps chunks": (DECODE, "replace", "e / VEC * 32 * VEC", "e / VEC * 16 * VEC"),
    "decode: key/value chunk loop stops a chunk early": (DECODE, "replace", "for (int e = 0; e < SLICE; e += VEC) {\n      const int d", "for (int e = 0; e < SLICE - VEC; e += VEC) {\n      const int d"),
    "decode: query chunk loop stops a chunk early": (DECODE, "replace", "for (int e = 0; e < SLICE; e += VEC) {\n      if (real)", "for (int e = 0; e < SLICE - VEC; e += VEC) {\n      if (real)"),
    "decode: vector chunk read as one element": (DECODE, "replace", "RowLoad<T, VEC>::read(k,", "RowLoad<T, 1>::read(k,"),
    "decode: simdgroup combine leaves one out": (DECODE, "replace", "for (int g = 0; g < NSG - 1; ++g) {\n      const float weight", "for (int g = 1; g < NSG - 1; ++g) {\n      const float weight"),
    "decode: simdgroup 0's output not rescaled in the combine": (DECODE, "replace", "rows.o[i][e] = rows.o[i][e] * own;", "rows.o[i][e] = rows.o[i][e];"),
    "decode: simdgroup 0's sum not rescaled in the combine": (DECODE, "replace", "rows.l[i] * own + simd_sum", "rows.l[i] + simd_sum"),
    "decode: combine misses the last live row": (DECODE, "replace", "const int live_rows = min(R, row_count - r0);", "const int live_rows = min(R, row_count - r0) - 1;"),
    "decode: combine hands over rows at the wrong slot": (DECODE, "replace", "const int at = (int(sg) - 1) * R;", "const int at = int(sg) * R;"),
    "decode: a simdgroup's sum not handed over": (DECODE, "replace", "states.row_sum[at + i] = rows.l[i];", ""),
    "decode: combine reads a handed-over row from the wrong simdgroup": (DECODE, "replace", "rows.o[i][e] += states.out[(g * R + i) * D", "rows.o[i][e] += states.out[(0 * R + i) * D"),
    "decode: window start off by one": (DECODE, "replace", "const int lo = first_pos - p.window_size + 1;", "const int lo = first_pos - p.window_size + 2;"),
    "decode: row chunks ignored": (DECODE, "replace", "const int row_chunks = (row_count + R - 1) / R;", "const int row_chunks = 1;"),
    "decode: sink left out of the sum": (DECODE, "replace", "l_row = l_row * correction + fast::exp2((sink - m_final) * MLX_ATTN_LOG2E);", "l_row = l_row * correction;"),
    "decode: lse without the row max": (DECODE, "replace", "m_final + log(l_final)", "log(l_final)"),
    # (m + log(0) is -inf in IEEE arithmetic: the -inf must not become a finite value)
    "decode: lse of an empty row not -inf": (DECODE, "replace", "m_final + log(l_final) : as_type<float>(0xff800000u)", "m_final + log(l_final) : 0.0f"),
    "decode: lse before the sink joins": (DECODE, "replace", "    m_row = m_final;\n", "\n"),
    "prefill: lse without the row max": (PREFILL, "replace", "m_final + log(l_final)", "log(l_final)"),
    "prefill: lse of an empty row not -inf": (PREFILL, "replace", "m_final + log(l_final) : as_type<float>(0xff800000u)", "m_final + log(l_final) : 0.0f"),
    "prefill: lse without the sink's max": (PREFILL, "replace", "    m_row = m_final;\n", "\n"),
    "prefill: additive mask ignored": (PREFILL, "replace", "logit.value = additive_masked_logit(logit.value, added);", ""),
    "prefill: GQA head mapping wrong": (PREFILL, "replace", "rows.kv_head = rows.h / p.group;", "rows.kv_head = rows.h % p.kv_heads;"),
    "prefill: key sequence stride assumed contiguous (vector loads)": (PREFILL, "replace", "k_head + key * p.k_strides[2] + col)", "k_head + key * D + col)"),
    "prefill: key sequence stride assumed contiguous (scalar loads)": (PREFILL, "replace", "k_head + key * p.k_strides[2] + col * p", "k_head + key * D + col * p"),
    "prefill: value dim stride ignored (scalar loads)": (PREFILL, "replace", "col * p.v_strides[3]", "col"),
    "decode: key dim stride ignored (scalar loads)": (DECODE, "replace", "k_row + d * k_dim_stride", "k_row + d"),
    "decode: value head stride assumed contiguous": (DECODE, "replace", "kv_head * p.v_strides[1]", "kv_head * p.kv_len * D"),
    "prefill: sinks stride assumed contiguous": (PREFILL, "replace", "sinks[h * p.sinks_stride]", "sinks[h]"),
    "decode: sinks stride assumed contiguous": (DECODE, "replace", "sinks[h * p.sinks_stride]", "sinks[h]"),
    # the loader policy (ContiguousKV) and the interior-block shortcut: only
    # edge blocks test causal / window / bounds per element
    "decode loader: K/V head not selected": (DECODE, "replace", "k_at = b * p.k_strides[0] + kv_head * p.k_strides[1];", "k_at = b * p.k_strides[0];"),
    "decode loader: values read from the key buffer": (DECODE, "replace", "RowLoad<T, VEC>::read(v, v_row", "RowLoad<T, VEC>::read(k, v_row"),
    **{f"{source.stem}: interior shortcut: a key past the diagonal taken as interior": (
        source, "replace", "first_key + keys - 1 > first_pos;", "first_key + keys - 2 > first_pos;") for source in (PREFILL, DECODE)},
    **{f"{source.stem}: interior shortcut: a key before the window taken as interior": (
        source, "replace", "first_key <= last_pos - p.window_size;", "first_key < last_pos - p.window_size;") for source in (PREFILL, DECODE)},
    "prefill: interior shortcut: the block past the key range end taken as interior": (PREFILL, "replace", "first_key + keys > key_end ||", ""),
    "prefill: interior shortcut: rows past the query length taken as interior": (PREFILL, "replace", "return rows_past_end ||", "return"),
    # the softcap: its rule (metal/attention_rules.h), its place before the
    # mask (metal/attention_steps.h) and the per-block variant choice
    "prefill: softcap divides by nothing": (PREFILL, "replace", "return cap * attn_tanh(s / cap);", "return cap * attn_tanh(s);"),
    "prefill: softcap applied after the additive mask": (
        PREFILL, "replace", "logit.value = additive_masked_logit(logit.value, added);",
        "logit.value = SOFTCAP ? softcap_logit(additive_masked_logit(saturate_logit(raw), added), p.softcap)"
        " : additive_masked_logit(logit.value, added);"),
    # one split: the partial kernel writes the normalized output itself
    "decode: one split writes partials nobody merges": (DECODE, "replace", "partial_stats, groups.x == 1, sinks", "partial_stats, false, sinks"),
    "decode: one split writes every position's output to the first": (DECODE, "replace", " + (r0 + i) % p.q_len * outputs.position_rows;", ";"),
    # the merge on several simdgroups: every simdgroup takes the same splits
    "decode: merge simdgroups all take the first simdgroup's splits": (DECODE, "replace", "const int own = int(sg);", "const int own = 0;"),
    # prefetch: the next key's K/V loaded during the current key's math
    "decode: prefetch reloads the current key": (DECODE, "replace", "kv.load(next, lane, k_next, v_next);", "kv.load(key, lane, k_next, v_next);"),
    # the rest of the one-split, prefetch and lane-merge mutants: the full grid (CI budget)
    **({"decode: every split writes the output directly": (DECODE, "replace", "partial_stats, groups.x == 1, sinks", "partial_stats, true, sinks"),
        "decode: one split takes the group's first query head": (DECODE, "replace", "const int h = kv_head * p.group + (r0 + i) / p.q_len;", "const int h = kv_head * p.group;"),
        "decode: one split writes no lse": (DECODE, "replace", "p.output_lse != 0 ? outputs.lse + row : nullptr", "nullptr"),
        "decode: one split writes position-major rows": (DECODE, "replace", "out, lse, p.q_len, 1, int(groups.x)};", "out, lse, 1, p.q_heads, int(groups.x)};"),
        "decode: first key not prefetched": (DECODE, "replace", "if (PREFETCH && key < kv_end) {", "if (false) {"),
        "decode: prefetch skips the last key": (DECODE, "replace", "if (next < kv_end) {", "if (next < kv_end - 1) {"),
        "decode: merge max taken from one lane": (DECODE, "replace", "const float m = simd_max(lane_max);", "const float m = lane_max;"),
        "decode: merge sums not added across lanes": (DECODE, "replace", "row.l[0] = simd_sum(lane_sum);", "row.l[0] = lane_sum;"),
        "decode: merge loads the current split again, not the next": (DECODE, "replace", "partial_out[(base + NSG * stride) * D", "partial_out[base * D"),
        # the merge on several simdgroups: each its own splits, combined as the partial kernel's
        "decode: merge simdgroups walk their splits one by one": (DECODE, "replace", "s < splits; s += NSG) {", "s < splits; s += 1) {"),
        "decode: merge's first split not loaded ahead": (DECODE, "replace", "next[e] = own < splits ? partial_out", "next[e] = false ? partial_out"),
        "decode: merge simdgroups' states not combined": (DECODE, "replace", "combine_simdgroup_states<NSG>(states, row, 1, sg, lane)", "combine_simdgroup_states<NSG>(states, row, 0, sg, lane)"),
        "decode: merge sums' second lane round overlaps the first": (DECODE, "replace", "s += 32 * NSG) {\n    const long base", "s += 32) {\n    const long base"),
        "decode: merge threadgroup smaller than the plan's": (DECODE, "replace", "#define MLX_ATTN_DECODE_MERGE_SIMDGROUPS 8", "#define MLX_ATTN_DECODE_MERGE_SIMDGROUPS 4"),
        } if FULL_GRID else {}),
    "decode: softcap variant never taken": (DECODE, "replace", "if (p.softcap > 0.0f) {", "if (false) {"),
    "prefill: softcap edge blocks taken as interior": (
        PREFILL, "replace", "prefill_logits<T, BK, MASK, true, true>", "prefill_logits<T, BK, MASK, false, true>"),
    # the same kinds of faults in the other family: under MLX_ATTN_FULL_GRID=1 (CI time)
    **({"prefill: softcap variant never taken": (PREFILL, "replace", "if (p.softcap > 0.0f) {", "if (false) {"),
        "decode: softcap edge keys taken as interior": (
            DECODE, "replace", "decode_key<T, R, SLICE, MASK, true, true>",
            "decode_key<T, R, SLICE, MASK, false, true>")} if FULL_GRID else {}),
}


# Caught only where a misaligned device load fails: in the counting build.
ALIGNMENT_MUTANTS = {
    f"{source.stem}: vector loads whatever the alignment": (
        source, "replace", "const bool vector_loads = p.vector_loads != 0;", "const bool vector_loads = true;")
    for source in (PREFILL, DECODE)
}


CASES = [
    dict(shape=(1, 4, 2, 40, 100), mask="causal"),
    # logits growing along the keys by hundreds: the prefill's lazy max must move (a kept max would
    # overflow exp2) and O be rescaled
    dict(shape=(1, 2, 1, 40, 200), mask="causal", key_growth=150.0),
    dict(shape=(1, 2, 1, 37, 90), window_size=7),
    dict(shape=(2, 2, 2, 33, 70), mask="bool", sinks=True),
    dict(shape=(1, 8, 2, 2, 150), mask="causal", sinks=True),  # decode: split KV
    dict(shape=(1, 2, 2, 1, 200), mask="causal", sinks=True),  # decode: one row, 4 splits of 64 keys
    dict(shape=(2, 4, 4, 1, 70), mask="bool"),
    dict(shape=(1, 4, 2, 20, 45), mask="additive", layout="seq_major"),  # [B, T, H, D] storage
    dict(shape=(1, 4, 2, 3, 45), layout="cache"),  # decode from a cache
    dict(shape=(1, 4, 2, 30, 50), mask="causal", sinks="strided"),  # sinks[::2] of a longer array
    dict(shape=(1, 4, 2, 2, 50), sinks="strided"),
    dict(shape=(1, 4, 2, 2, 90), window_size=5),  # decode: keys before the window skipped
    dict(shape=(1, 8, 1, 3, 400), mask="causal"),  # decode: 24 rows, two row chunks of the group shape at D = 64
    dict(shape=(1, 2, 2, 35, 60), sinks=True),  # prefill: sinks without a mask
    dict(shape=(1, 2, 1, 20, 40), mask="bool"),  # prefill: a row that sees nothing, no sinks
    # scalar loads: a start 2 elements into an aligned row, odd rows, a strided last dim
    dict(shape=(1, 4, 2, 35, 45), mask="causal", layout="unaligned"),
    dict(shape=(1, 4, 2, 2, 75), layout="unaligned"),
    dict(shape=(1, 2, 2, 33, 40), layout="odd_rows"),
    dict(shape=(1, 4, 2, 3, 50), mask="causal", layout="odd_rows"),
    dict(shape=(1, 2, 1, 20, 30), layout="every_other"),
    dict(shape=(1, 4, 1, 1, 40), layout="every_other"),
    dict(shape=(1, 2, 2, 35, 45), mask="causal", layout="cache"),  # prefill: the last key block's tail is NaN
    dict(shape=(1, 4, 2, 2, 90), mask="causal", d=96),  # decode: one element per chunk, 3 per lane
    dict(shape=(1, 4, 2, 2, 70), layout="unaligned", d=96),
    # prefill edge blocks: a block ending one key past a row group's first
    # position (offset 6: rows 24.. at 30..), one starting at the last row's
    # window edge (rows 32..39, window 39: key 0 hidden from position 39 only)
    dict(shape=(1, 2, 1, 40, 46), mask="causal"),
    dict(shape=(1, 2, 1, 48, 48), window_size=39),
    # softcap (logits of about one unit: the tanh bends), an additive mask
    # added after the cap, a window for edge blocks; prefill and decode
    dict(shape=(1, 4, 2, 35, 60), mask="additive", window_size=20, softcap=0.8),
    dict(shape=(1, 4, 2, 2, 90), mask="additive", window_size=40, softcap=0.8),
    # the merge: 21 splits of the group shape on its 8 simdgroups (not a multiple),
    # the row shape's 2 splits, sinks, lse; under MLX_ATTN_FULL_GRID=1 also 265
    # splits (a second round of each simdgroup's lanes, > 8 x 32)
    dict(shape=(1, 2, 1, 1, 1300), sinks=True),
    *([dict(shape=(1, 1, 1, 1, 16900), mask="causal", sinks=True,
            targets=[{"gpu_family": "apple7", "gpu_cores": 48, "decode_shape": "group"}])] if FULL_GRID else []),
]


def case_targets(case: dict) -> list:
    """The plan keywords a case runs under: a decode case on both threadgroup
    shapes (each with its own split count on the default target), a prefill
    case once; a case's `targets` replaces them."""
    if "targets" in case:
        return case["targets"]
    tq = case["shape"][3]
    return [{"decode_shape": "row"}, {"decode_shape": "group"}] if tq <= 8 else [None]


def caught(run) -> bool:
    for case in CASES:
        b, hq, hkv, tq, tkv = case["shape"]
        d = case.get("d", 64)
        rng = np.random.default_rng(tq)
        q, k, v = (mx.array(rng.standard_normal(s).astype(np.float32))
                   for s in ((b, hq, tq, d), (b, hkv, tkv, d), (b, hkv, tkv, d)))
        if case.get("key_growth"):
            k = k * mx.array(np.linspace(0.05, case["key_growth"], tkv, dtype=np.float32))[:, None]
        kw = {"scale": 0.125, **case_options(case, rng, hq, tq, tkv)}
        for target in case_targets(case):
            try:
                got, lse = run(q, k, v, **kw, layout=case.get("layout"), return_lse=True, gpu_target=target)
            except msl_emulator.EmulatorError:
                return True  # deadlock or launch failure
            reference_kw = {**kw, "sinks": kw["sinks"].array} if isinstance(kw.get("sinks"), View) else kw
            if differs_from_reference(got, lse, q, k, v, **reference_kw):
                return True
    return False


def test_the_battery_reaches_both_decode_shapes_and_their_splits():
    """The decode cases, under their targets, run the row shape in one split
    and in several, the group shape in one and in several (row chunks
    among them), and 21 splits into the merge's 8 simdgroups."""
    from mlx_attn import _ext

    reached = set()
    for case in CASES:
        b, hq, hkv, tq, tkv = case["shape"]
        if tq > 8:
            continue
        for target in case_targets(case):
            target = dict(target)
            name = target.pop("decode_shape")
            shapes = _ext.metal_decode_shapes(b, hkv, hq // hkv * tq, tkv, case.get("d", 64), **target)
            chunks = -(-(hq // hkv * tq) // shapes[name]["rows"])
            reached.add((name, min(shapes[name]["splits"], 2), min(chunks, 2)))
            reached.add(("splits", shapes[name]["splits"]))
    assert {("row", 1, 2), ("row", 2, 2), ("group", 1, 1), ("group", 2, 1), ("group", 2, 2), ("splits", 21)} <= reached


def case_options(case: dict, rng: np.random.Generator, q_heads: int, q_len: int, kv_len: int) -> dict:
    """The mask, window_size and sinks keywords a battery case asks for
    (drawn from rng: the mask, then the sinks). Shared with the quantized
    battery."""
    kw = {}
    if case.get("mask") == "bool":
        visible = rng.random((q_len, kv_len)) > 0.4
        visible[0] = False  # a row that sees nothing
        kw["mask"] = mx.array(visible)
    elif case.get("mask") == "additive":
        kw["mask"] = mx.array(rng.standard_normal((q_len, kv_len)).astype(np.float32))
    elif case.get("mask"):
        kw["mask"] = case["mask"]
    if case.get("window_size"):
        kw["window_size"] = case["window_size"]
    if case.get("softcap"):
        kw["softcap"] = case["softcap"]
    if case.get("sinks") == "strided":
        kw["sinks"] = View(mx.array(rng.standard_normal(2 * q_heads).astype(np.float32)), lambda a: a[::2])
    elif case.get("sinks"):  # some above every logit: the sink sets the row max
        kw["sinks"] = mx.array(rng.standard_normal(q_heads).astype(np.float32) * 4)
    return kw


def differs_from_reference(got, lse, q, k, v, **kw) -> bool:
    """Whether a float32 output (NaN, or beyond tolerance) or its row
    log-sum-exp differs from the reference path's on q, k, v."""
    want = np.array(reference_attention(q, k, v, **kw))
    if not np.isfinite(got).all() or np.abs(np.array(got) - want).max() > TOLERANCE[mx.float32]:
        return True
    lse, want_lse = np.array(lse), reference_lse(q, k, v, **kw)
    if not np.array_equal(np.isneginf(lse), np.isneginf(want_lse)):
        return True
    finite = np.isfinite(want_lse)
    return not np.allclose(lse[finite], want_lse[finite], rtol=1e-5, atol=1e-4)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mutants")


def originals(directory: Path) -> list[Path]:
    return [write(directory, only_float32_d64(kernel_text(src)), f"original {src.stem}") for src in (PREFILL, DECODE)]


def test_unmutated_kernels_pass_the_battery(workdir):
    assert not caught(EmulatedMetal(fast_math=True, sources=originals(workdir)))
    assert not caught(EmulatedMetal(fast_math=True, sources=originals(workdir), counters=True))


def mutant_sources(workdir: Path, name: str, source: Path, *change) -> list[Path]:
    mutant = write(workdir, only_float32_d64(mutated(kernel_text(source), *change)), name)
    return [mutant if original.name.startswith(f"original_{source.stem}") else original
            for original in originals(workdir)]


@pytest.mark.parametrize("name", list(MUTANTS))
def test_mutant_is_caught(workdir, name):
    assert_caught(name, mutant_sources(workdir, name, *MUTANTS[name]), caught)


@pytest.mark.parametrize("name", list(ALIGNMENT_MUTANTS))
def test_alignment_mutant_is_caught(workdir, name):
    assert_caught(name, mutant_sources(workdir, name, *ALIGNMENT_MUTANTS[name]), caught, counters=True)
