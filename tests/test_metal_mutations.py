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
from metal_runner import REPO, EmulatedMetal, View, reference_lse
from mlx_attn.reference import reference_attention
from sdpa_cases import TOLERANCE

pytestmark = pytest.mark.skipif(not msl_emulator.clang_available(), reason="clang-19 is not installed")

PREFILL = REPO / "metal" / "attention_prefill.metal"
DECODE = REPO / "metal" / "attention_decode.metal"


def only_float32_d64(text: str) -> str:
    """Keep one instantiation so each mutant compiles quickly."""
    text = re.sub(r"^MLX_ATTN_(PREFILL|DECODE)_(2BYTE_)?TYPES\(.*\)$", "", text, flags=re.M)
    kind = "PREFILL" if "attention_prefill<" in text else "DECODE"
    instance = "float32, float, 64, 32" if kind == "PREFILL" else "float32, float, 64"
    return text + f"\nMLX_ATTN_{kind}({instance})\n"


def nth_occurrence_removed(text: str, needle: str, n: int) -> str:
    starts = [m.start() for m in re.finditer(re.escape(needle), text)]
    start = starts[n]
    end = text.index(";", start) + 1
    return text[:start] + text[end:]


def barriers(source: Path, kind: str) -> dict:
    count = source.read_text().count(f"{kind}(")
    return {f"{source.stem}: {kind} #{i} removed": (source, "remove", f"{kind}(", i) for i in range(count)}


MUTANTS = {
    **barriers(PREFILL, "threadgroup_barrier"),
    **barriers(PREFILL, "simdgroup_barrier"),
    **barriers(DECODE, "threadgroup_barrier"),
    "prefill: causal comparison flipped": (PREFILL, "replace", "key <= pos &&", "key < pos &&"),
    "prefill: window comparison off by one": (PREFILL, "replace", "key > pos - p.window_size", "key >= pos - p.window_size"),
    "prefill: accumulator rescale dropped": (PREFILL, "replace", "o_tiles[d].thread_elements() *= alpha;", ""),
    "prefill: row max misses a lane pair": (PREFILL, "replace", "block_max = max(block_max, simd_shuffle_xor(block_max, 8));", ""),
    "prefill: row sum misses a lane pair": (PREFILL, "replace", "p_sum += simd_shuffle_xor(p_sum, 8);", ""),
    "prefill: normalize dropped": (PREFILL, "replace", "T(o_tiles[d].thread_elements()[t] * factor)", "T(o_tiles[d].thread_elements()[t])"),
    "prefill: K^T fragment reads the wrong key": (PREFILL, "replace", "k_tile[(j * 8 + c + t) * LD + d * 8 + r]", "k_tile[(j * 8 + c) * LD + d * 8 + r]"),
    "prefill: K/V tile load bound off by one": (PREFILL, "replace", "e < BK * D; e += THREADS", "e < BK * D - 1; e += THREADS"),
    "prefill: causal block range off by one": (PREFILL, "replace", "kv_end = min(kv_end, last_pos + 1);", "kv_end = min(kv_end, last_pos);"),
    "prefill: output row bound off by one": (PREFILL, "replace", "if (qi < p.q_len) {\n    const long row", "if (qi < p.q_len - 1) {\n    const long row"),
    "prefill: bool mask ignored": (PREFILL, "replace", "visible = mask[at] != 0;", "visible = true;"),
    "prefill: sink left out of the sum": (PREFILL, "replace", "l_final = l_row * correction + exp2((sink - m_final) * MLX_ATTN_LOG2E);", "l_final = l_row * correction;"),
    "decode: causal comparison flipped": (DECODE, "replace", "key <= pos &&", "key < pos &&"),
    "decode: accumulator rescale dropped": (DECODE, "replace", "o_part[i][e] * alpha + prob", "o_part[i][e] + prob"),
    "decode: split range off by one": (DECODE, "replace", "min(p.kv_len, kv_begin + chunk)", "min(p.kv_len, kv_begin + chunk - 1)"),
    "decode: merge rescale dropped": (DECODE, "replace", "const float weight = exp2((partial_stats[base * 2] - m) * MLX_ATTN_LOG2E);", "const float weight = 1.0f;"),
    "decode: keys not dealt out among simdgroups": (DECODE, "replace", "key < kv_end; key += NSG", "key < kv_end; key += 1"),
    "decode: key range end off by one": (DECODE, "replace", "key < kv_end; key += NSG", "key < kv_end - 1; key += NSG"),
    "decode: simdgroup combine rescale dropped": (DECODE, "replace", "const float weight = exp2((sg_max[g * R + i] - m) * MLX_ATTN_LOG2E);", "const float weight = 1.0f;"),
    "decode: simdgroup combine leaves one out": (DECODE, "replace", "for (int g = 0; g < NSG - 1; ++g) {\n      const float weight", "for (int g = 1; g < NSG - 1; ++g) {\n      const float weight"),
    "decode: simdgroup 0's output not rescaled in the combine": (DECODE, "replace", "o[e] = o_part[i][e] * own;", "o[e] = o_part[i][e];"),
    "decode: simdgroup 0's sum not rescaled in the combine": (DECODE, "replace", "float l = l_row[i] * own;", "float l = l_row[i];"),
    "decode: combine misses the last live row": (DECODE, "replace", "const int live_rows = min(R, rows - r0);", "const int live_rows = min(R, rows - r0) - 1;"),
    "decode: combine hands over rows at the wrong slot": (DECODE, "replace", "const int at = (int(sg) - 1) * R;", "const int at = int(sg) * R;"),
    "decode: a simdgroup's sum not handed over": (DECODE, "replace", "sg_sum[at + i] = l_row[i];", ""),
    "decode: combine reads a handed-over row from the wrong simdgroup": (DECODE, "replace", "o[e] += sg_out[(g * R + i) * D", "o[e] += sg_out[(0 * R + i) * D"),
    "decode: window start off by one": (DECODE, "replace", "offset - p.window_size + 1", "offset - p.window_size + 2"),
    "decode: row chunks ignored": (DECODE, "replace", "const int row_chunks = (rows + R - 1) / R;", "const int row_chunks = 1;"),
    "decode: sink left out of the sum": (DECODE, "replace", "l = l * correction + exp2((sink - m_final) * MLX_ATTN_LOG2E);", "l = l * correction;"),
    "decode: lse without the row max": (DECODE, "replace", "m + log(l)", "log(l)"),
    # (m + log(0) is -inf in IEEE arithmetic: the -inf must not become a finite value)
    "decode: lse of an empty row not -inf": (DECODE, "replace", "m + log(l) : as_type<float>(0xff800000u)", "m + log(l) : 0.0f"),
    "decode: lse before the sink joins": (DECODE, "replace", "    m = m_final;\n", "\n"),
    "prefill: lse without the row max": (PREFILL, "replace", "m_final + log(l_final)", "log(l_final)"),
    "prefill: lse of an empty row not -inf": (PREFILL, "replace", "m_final + log(l_final) : as_type<float>(0xff800000u)", "m_final + log(l_final) : 0.0f"),
    "prefill: lse without the sink's max": (PREFILL, "replace", "m_final + log(l_final)", "m_row + log(l_final)"),
    "prefill: additive mask ignored": (PREFILL, "replace", "s = saturate_logit(s + added);", ""),
    "prefill: GQA head mapping wrong": (PREFILL, "replace", "const int kv_head = h / p.group;", "const int kv_head = h % p.kv_heads;"),
    "prefill: key sequence stride assumed contiguous": (PREFILL, "replace", "key * p.k_strides[2]", "key * D"),
    "decode: value head stride assumed contiguous": (DECODE, "replace", "kv_head * p.v_strides[1]", "kv_head * p.kv_len * D"),
    "prefill: sinks stride assumed contiguous": (PREFILL, "replace", "sinks[h * p.sinks_stride]", "sinks[h]"),
    "decode: sinks stride assumed contiguous": (DECODE, "replace", "sinks[h * p.sinks_stride]", "sinks[h]"),
}


def mutate(source, kind, a, b) -> str:
    text = source.read_text()
    if kind == "remove":
        assert text.count(a) > b
        return only_float32_d64(nth_occurrence_removed(text, a, b))
    assert text.count(a) == 1, f"mutation target {a!r} must occur exactly once"
    return only_float32_d64(text.replace(a, b))


CASES = [
    dict(shape=(1, 4, 2, 40, 100), mask="causal"),
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
    dict(shape=(1, 8, 1, 3, 60), mask="causal"),  # decode: 24 rows, two row chunks at D = 64
    dict(shape=(1, 2, 2, 35, 60), sinks=True),  # prefill: sinks without a mask
    dict(shape=(1, 2, 1, 20, 40), mask="bool"),  # prefill: a row that sees nothing, no sinks
]


def caught(run) -> bool:
    for case in CASES:
        b, hq, hkv, tq, tkv = case["shape"]
        rng = np.random.default_rng(tq)
        q, k, v = (mx.array(rng.standard_normal(s).astype(np.float32))
                   for s in ((b, hq, tq, 64), (b, hkv, tkv, 64), (b, hkv, tkv, 64)))
        kw = {"scale": 0.125}
        if case.get("mask") == "bool":
            visible = rng.random((tq, tkv)) > 0.4
            visible[0] = False  # a row that sees nothing
            kw["mask"] = mx.array(visible)
        elif case.get("mask") == "additive":
            kw["mask"] = mx.array(rng.standard_normal((tq, tkv)).astype(np.float32))
        elif case.get("mask"):
            kw["mask"] = case["mask"]
        if case.get("window_size"):
            kw["window_size"] = case["window_size"]
        if case.get("sinks") == "strided":
            kw["sinks"] = View(mx.array(rng.standard_normal(2 * hq).astype(np.float32)), lambda a: a[::2])
        elif case.get("sinks"):  # some above every logit: the sink sets the row max
            kw["sinks"] = mx.array(rng.standard_normal(hq).astype(np.float32) * 4)
        try:
            got, lse = run(q, k, v, **kw, layout=case.get("layout"), return_lse=True)
        except msl_emulator.EmulatorError:
            return True  # deadlock or launch failure
        if isinstance(kw.get("sinks"), View):
            kw["sinks"] = kw["sinks"].array
        if differs_from_reference(got, lse, q, k, v, **kw):
            return True
    return False


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


def write(directory: Path, text: str, name: str) -> Path:
    path = directory / f"{re.sub(r'[^a-z0-9]+', '_', name.lower())}.metal"
    path.write_text(text)
    return path


def originals(directory: Path) -> list[Path]:
    return [write(directory, only_float32_d64(src.read_text()), f"original {src.stem}") for src in (PREFILL, DECODE)]


def test_unmutated_kernels_pass_the_battery(workdir):
    assert not caught(EmulatedMetal(fast_math=True, sources=originals(workdir)))


@pytest.mark.parametrize("name", list(MUTANTS))
def test_mutant_is_caught(workdir, name):
    source, *change = MUTANTS[name]
    mutated = write(workdir, mutate(source, *change), name)
    sources = [mutated if original.name.startswith(f"original_{source.stem}") else original
               for original in originals(workdir)]
    try:
        run = EmulatedMetal(fast_math=True, sources=sources)
    except msl_emulator.MetalCompileError:
        return  # caught by the compiler
    assert caught(run), f"mutant survived: {name}"
