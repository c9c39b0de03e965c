"""The quantized prefill kernel (metal/attention_quantized_prefill.metal: the
dense prefill kernel's MMA tiles with a loader that dequantizes while
staging), launched from its C++ plan (csrc/metal/quantized_launch_plan.cpp) in the
MSL emulator, against the float64 oracle of the paged tests
(kernel_lab/paged_metal_runner.py, each batch entry one page) on the dequantized
K/V, and, for bool and additive masks, against dequantize-then-reference
(tests/test_quantized_metal.py check). A representative sample of the grid
bits x group size x D x GQA x mask x query length x dtype runs by default,
on a source trimmed to the sample's instantiations; MLX_ATTN_FULL_GRID=1
runs all of it on the whole source, in precise math too. The routing rule
(quantized_rows_take_prefill) is checked on the plan."""

from __future__ import annotations

import hashlib
import itertools
import os
import re
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from kernel_lab import msl_emulator
from kernel_lab.metal_runner import REPO, EmulatedMetal, View
from mlx_attn import _native
from kernel_lab.paged_metal_runner import oracle
from sdpa_cases import TOLERANCE
from test_quantized_metal import DTYPES, cache_view, check, dequantized, plan_for, quantize, roles
from test_quantized_metal import make_case as quantized_case

needs_ext = pytest.mark.skipif(_native.ext is None, reason="the native extension is not built")
needs_clang = pytest.mark.skipif(not msl_emulator.clang_available(), reason="clang-19 is not installed")

FULL_GRID = os.environ.get("MLX_ATTN_FULL_GRID") == "1"
SOURCE = REPO / "metal" / "attention_quantized_prefill.metal"
KV_HEADS = 2
MASK_KINDS = {"bool": ("_mask_bool", "MLX_ATTN_MASK_BOOL"), "additive": ("_mask_additive", "MLX_ATTN_MASK_ADDITIVE")}


def key_block(d: int) -> int:
    """The conservative target's keys per block (csrc/metal/launch_plan.cpp kSteelKeyBlocks)."""
    return 32 if d == 64 else 16


def instance(dtype: str, d: int, bits: int, mask: str = "none") -> str:
    """The MLX_ATTN_QUANTIZED_PREFILL_MASK arguments of one kernel."""
    suffix, kind = MASK_KINDS.get(mask, ("", "MLX_ATTN_MASK_NONE"))
    msl = {"float32": "float", "float16": "half", "bfloat16": "bfloat"}[dtype]
    return f'"{suffix}", {kind}, {dtype}, {msl}, {d}, {bits}, {key_block(d)}'


def trimmed_source(instances, text: str | None = None) -> Path:
    """The kernel family's source (or `text`, a mutant of it) with only these
    instantiations: quick builds. Written under a path named by its content
    (the emulator's build cache keys on the preprocessed text, file names
    included), so every test asking for the same build shares it."""
    text = re.sub(r"^MLX_ATTN_QUANTIZED_PREFILL_(2BYTE_)?TYPES\(.*\)$", "", text or SOURCE.read_text(), flags=re.M)
    text += "\n" + "\n".join(f"MLX_ATTN_QUANTIZED_PREFILL_MASK({i})" for i in sorted(set(instances))) + "\n"
    directory = Path(tempfile.gettempdir()) / "mlx_attn_trimmed" / hashlib.sha256(text.encode()).hexdigest()[:16]
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / SOURCE.name
    if not path.exists() or path.read_text() != text:
        partial = directory / f"{SOURCE.name}.{os.getpid()}.partial"
        partial.write_text(text)
        partial.replace(path)
    return path


def make_case(bits, group_size, d, gqa, mask, q_len, kv_len, dtype, batch=1, seed=0):
    """q, k_quant, v_quant and the keyword arguments of one grid point: the
    quantized decode tests' builder at this kv_len and batch; sinks come
    with the causal mask here."""
    q, k_quant, v_quant, kw = quantized_case(bits, group_size, d, gqa, mask, q_len, dtype, seed, kv_len=kv_len,
                                             batch=batch)
    if mask == "sinks":
        kw["mask"] = "causal"
    return q, k_quant, v_quant, kw


def plain(a):
    return a.array if isinstance(a, View) else a


def check_float64(run, q, k_quant, v_quant, *, bits, group_size, scale, mask=None, window_size=None, sinks=None,
                  softcap=None):
    """The kernel's output and log-sum-exp against the float64 oracle on the
    dequantized K/V: each batch entry one page of kv_len keys."""
    got, got_lse = run.quantized(q, k_quant, v_quant, bits=bits, group_size=group_size, scale=scale, mask=mask,
                                 window_size=window_size, sinks=sinks, softcap=softcap, return_lse=True)
    assert run.last_plan.dispatches[0].kernel.startswith("attention_quantized_prefill_")
    k, v = (np.array(dequantized([plain(a) for a in t], group_size, bits)) for t in (k_quant, v_quant))
    q = plain(q)
    batch, hq, tq, d = q.shape
    kv_len = k.shape[2]
    q_rows = np.array(q.astype(mx.float32)).transpose(0, 2, 1, 3).reshape(batch * tq, hq, d)
    want, want_lse = oracle(q_rows, k, v, np.arange(batch).reshape(batch, 1), [tq] * batch, [kv_len] * batch,
                            scale=scale, causal=mask == "causal" or window_size is not None, window_size=window_size,
                            sinks=None if sinks is None else np.array(plain(sinks).astype(mx.float32)),
                            softcap=softcap)
    want = want.reshape(batch, tq, hq, d).transpose(0, 2, 1, 3)
    want_lse = want_lse.reshape(batch, tq, hq).transpose(0, 2, 1)
    got = np.array(got.astype(mx.float32))
    assert np.isfinite(got).all()
    err = np.abs(got - want).max()
    assert err <= TOLERANCE[q.dtype], f"max error {err} ({q.dtype})"
    got_lse = np.array(got_lse)
    assert np.array_equal(np.isneginf(got_lse), np.isneginf(want_lse))
    finite = np.isfinite(want_lse)
    # 2-byte dtypes: the staged K (as dequantize-then-attend's) is rounded to q's dtype
    atol = 1e-4 if q.dtype == mx.float32 else TOLERANCE[q.dtype]
    lse_err = np.abs(got_lse[finite] - want_lse[finite]).max(initial=0.0)
    assert np.allclose(got_lse[finite], want_lse[finite], rtol=1e-5, atol=atol), f"max lse error {lse_err}"


def run_point(run, point, seed=0):
    q, kq, vq, kw = make_case(**point, seed=seed)
    if point["mask"] in MASK_KINDS:  # the reference path takes the explicit masks
        check(run, q, kq, vq, bits=point["bits"], group_size=point["group_size"], lse=point["dtype"] == "float32",
              **kw)
        assert run.last_plan.dispatches[0].kernel.startswith("attention_quantized_prefill_")
    else:
        check_float64(run, q, kq, vq, bits=point["bits"], group_size=point["group_size"], **kw)


AXES = {
    "bits": (4, 8),
    "group_size": (32, 64, 128),
    "d": (64, 128),
    "gqa": (1, 4),
    "mask": ("none", "causal", "window", "sinks", "softcap", "bool", "additive"),
    # 9 positions: more than the decode kernel's 8; 33 and 70: a partial
    # query block; 70 > kv_len 37: causal rows that see no key
    "q_len": (9, 33, 70),
    "kv_len": (37, 150),  # neither a multiple of the key block (16 or 32)
    "dtype": tuple(DTYPES),
}


def routed(point) -> bool:
    return point["q_len"] > 8 or point["gqa"] * point["q_len"] > 32


def grid_points():
    points = [dict(zip(AXES, values)) for values in itertools.product(*AXES.values())]
    return [p for p in points if p["d"] % p["group_size"] == 0 and routed(p)]


# Every value of every axis at least once, with 6 instantiations (shared
# with the mutation battery and the quantized self-check's emulated run: one
# build, cached by content).
SAMPLE = [
    dict(bits=4, group_size=32, d=64, gqa=4, mask="causal", q_len=70, kv_len=37, dtype="float32"),
    dict(bits=8, group_size=64, d=128, gqa=1, mask="window", q_len=33, kv_len=150, dtype="float16"),
    dict(bits=4, group_size=128, d=128, gqa=4, mask="sinks", q_len=9, kv_len=150, dtype="bfloat16"),
    dict(bits=4, group_size=32, d=64, gqa=1, mask="bool", q_len=33, kv_len=150, dtype="float32"),
    dict(bits=4, group_size=64, d=64, gqa=4, mask="additive", q_len=9, kv_len=37, dtype="float16"),
    dict(bits=8, group_size=128, d=128, gqa=4, mask="softcap", q_len=70, kv_len=150, dtype="float32"),
    dict(bits=4, group_size=32, d=64, gqa=1, mask="none", q_len=33, kv_len=37, dtype="float32"),
]
POINTS = grid_points() if FULL_GRID else SAMPLE
SAMPLE_INSTANCES = [instance(p["dtype"], p["d"], p["bits"], p["mask"]) for p in SAMPLE]


def point_id(p: dict) -> str:
    return (f"b{p['bits']}-g{p['group_size']}-d{p['d']}-gqa{p['gqa']}-{p['mask']}-tq{p['q_len']}-tkv{p['kv_len']}"
            f"-{p['dtype']}")


@pytest.fixture(scope="module", params=[True, False] if FULL_GRID else [True],
                ids=["fast-math", "precise"] if FULL_GRID else ["fast-math"])
def run(request):
    sources = [SOURCE] if FULL_GRID else [trimmed_source(SAMPLE_INSTANCES)]
    return EmulatedMetal(fast_math=request.param, sources=sources)


@needs_ext
@needs_clang
@pytest.mark.parametrize("point", POINTS, ids=point_id)
def test_kernel_matches_the_float64_oracle(run, point):
    run_point(run, point)


@needs_ext
@needs_clang
def test_sample_covers_every_axis_value():
    for axis, values in AXES.items():
        assert {p[axis] for p in SAMPLE} == set(values), axis
    assert all(p in grid_points() for p in SAMPLE)


@needs_ext
@needs_clang
def test_batches_and_strided_triples_from_a_cache(run):
    """Two batch entries; packed words, scales and biases each read through
    their own strides: slices of a longer cache (NaN scales and garbage
    words past the end), biases stored [B, T, H, G]."""
    q, (kp, ks, kb), (vp, vs, vb), kw = make_case(4, 32, 64, 4, "causal", 70, 37, "float32", batch=2, seed=3)
    k_quant = (cache_view(kp, 0xFFFFFFFF), cache_view(ks, float("nan")),
               View(mx.contiguous(kb.transpose(0, 2, 1, 3)), lambda a: a.transpose(0, 2, 1, 3)))
    v_quant = (cache_view(vp, 0x12345678), View(vs), cache_view(vb, float("nan")))
    check_float64(run, q, k_quant, v_quant, bits=4, group_size=32, **kw)


# ---------------------------------------------------------------- the plan

@needs_ext
def test_prefill_rows_take_the_quantized_prefill_kernel():
    """The routing rule (csrc/metal/quantized_launch_plan.h quantized_rows_take_prefill):
    more than 8 positions or 32 rows (GQA group x positions) at D = 64 / 128
    take one dispatch of the prefill kernel on the dense prefill's grid;
    decode rows, short chunks and D = 256 stay on the decode structure."""
    plan = plan_for(bits=4, group_size=32, d=128, hq=8, hkv=2, q_len=40, kv_len=300,
                    mask=mx.ones((40, 300), dtype=mx.bool_), sinks=True, output_lse=True)
    assert plan.supported, plan.reason
    (prefill,) = plan.dispatches
    assert prefill.kernel == "attention_quantized_prefill_float16_d128_b4_bk16_mask_bool"
    assert prefill.grid == [2, 8, 1] and prefill.threadgroup == [128, 1, 1]
    assert prefill.threadgroup_memory_bytes == 2 * 16 * (128 * 2 + 16)
    assert plan.scratch == []
    assert roles(prefill) == [
        (0, "q", "input", 0, "read"), (1, "k", "input", 1, "read"), (2, "k_scales", "input", 2, "read"),
        (3, "k_biases", "input", 3, "read"), (4, "v", "input", 4, "read"), (5, "v_scales", "input", 5, "read"),
        (6, "v_biases", "input", 6, "read"), (7, "out", "output", 0, "write"), (8, "params", "params", 0, "read"),
        (9, "quantized_params", "quantized_params", 0, "read"), (10, "mask", "input", 7, "read"),
        (11, "sinks", "input", 8, "read"), (12, "lse", "output", 1, "write"),
    ]
    # 9 positions x GQA 1: more than 8 positions; 5 x GQA 8 = 40 rows: more than 32
    assert plan_for(d=64, hq=2, hkv=2, q_len=9).dispatches[0].kernel.startswith("attention_quantized_prefill_")
    assert plan_for(d=64, hq=16, hkv=2, q_len=5).dispatches[0].kernel == (
        "attention_quantized_prefill_float16_d64_b8_bk32")
    # decode rows, a short chunk, and D = 256 (the dense D-split's head dim) keep the decode structure
    for kw in (dict(q_len=1), dict(q_len=8, hq=2, hkv=2), dict(d=256, q_len=40)):
        kernels = [d.kernel for d in plan_for(**kw).dispatches]
        assert kernels[0].startswith("attention_quantized_decode_partial_"), kw


@needs_ext
def test_apple9_stages_twice_the_keys_of_two_byte_dtypes():
    rng = np.random.default_rng(0)
    q = mx.zeros((1, 4, 64, 128), dtype=mx.float16)
    kq = quantize(mx.array(rng.standard_normal((1, 2, 100, 128)).astype(np.float32)), 64, 8, mx.float16)
    plan = _native.ext.quantized_metal_launch_plan(q, list(kq), list(kq), bits=8, group_size=64, gpu_family="apple9")
    assert plan.supported, plan.reason
    assert [d.kernel for d in plan.dispatches] == ["attention_quantized_prefill_float16_d128_b8_bk32"]
    with pytest.raises(ValueError, match="gpu_family"):
        _native.ext.quantized_metal_launch_plan(q, list(kq), list(kq), bits=8, group_size=64, gpu_family="apple99")
    with pytest.raises(ValueError, match="gpu_cores"):
        _native.ext.quantized_metal_launch_plan(q, list(kq), list(kq), bits=8, group_size=64, gpu_cores=-1)


@needs_ext
def test_prefill_kernels_compile_one_at_a_time(tmp_path):
    """The Mac compiles a quantized prefill kernel alone at first use
    (csrc/metal/metal_sources.cpp variant_source): the family's text without
    its instantiation lines, plus the one per-mask instantiation. The full
    grid also compiles that text alone in the emulator."""
    kernel = "attention_quantized_prefill_bfloat16_d128_b4_bk32_mask_additive"
    text = _native.ext.metal_variant_source(kernel)
    family = _native.ext.metal_kernel_source(kernel)
    instantiation = re.compile(r"^MLX_ATTN_[A-Z0-9_]+\([^()]*\)[ \t]*\n?", re.M)
    assert text == instantiation.sub("", family) + (
        'MLX_ATTN_QUANTIZED_PREFILL_MASK("_mask_additive", MLX_ATTN_MASK_ADDITIVE, bfloat16, bfloat, 128, 4, 32)\n')
    assert "attention_quantized_prefill<" in family  # its own family, not the quantized decode's
    assert _native.ext.metal_variant_source("attention_quantized_prefill_float16_d128_b4") == ""
    if FULL_GRID:
        path = tmp_path / f"{kernel}.metal"
        path.write_text(text)
        assert msl_emulator.compile_library([path], include_dirs=[]).kernel_names == [kernel]


# ---------------------------------------------------------------- the cost model

def cost_model():
    from kernel_lab import metal_cost_model

    return metal_cost_model


@pytest.mark.parametrize("bits,group_size", [(4, 64), (8, 32)])
def test_model_reads_the_packed_bytes(bits, group_size):
    """A problem whose threadgroups all run in one wave reads each K/V head
    from DRAM once: its packed codes (bits / 8 bytes an element) and a 2-byte
    scale and bias per group, where the float prefill reads 2 bytes an
    element; the dequantizing ALU comes on top of the same MMAs."""
    cm = cost_model()
    gpu = cm.M2_MAX
    heads, kv_heads, t, d = 8, 2, 256, 128  # 8 query blocks x 8 heads = 64 threadgroups
    problem = (1, heads, kv_heads, t, t, False, gpu)
    ours = cm.quantized_prefill_kernel("q", d, 16, bits, group_size, *problem)
    dense = cm.prefill_kernel("f", cm.our_prefill_tile(d, 16, "fast"), *problem)
    q_and_out = 2 * heads * t * d * 2
    assert dense.dram_bytes - q_and_out == kv_heads * 2 * t * d * 2
    assert ours.dram_bytes - q_and_out == pytest.approx(kv_heads * 2 * t * d * (bits / 8 + 4 / group_size))
    assert ours.block.counts["fma"] > dense.block.counts["fma"]
    assert ours.block.counts["mma"] == dense.block.counts["mma"]


def test_model_puts_the_kernel_within_the_target():
    """Issue #23's target, by the model: quantized prefill at most 1.2x
    dequantize-then-steel (D 64/128, T 2048, 4 and 8 bits, causal and not),
    and faster than the decode structure it replaces on those rows."""
    cm = cost_model()
    gpu = cm.M2_MAX
    for d, bk in ((64, 32), (128, 16)):
        for bits in (4, 8):
            for causal in (False, True):
                problem = (1, 32, 8, 2048, 2048, causal, gpu)
                ours = cm.predict_all([cm.quantized_prefill_kernel("q", d, bk, bits, 64, *problem)], gpu)
                base = cm.predict_all(cm.dequantize_then_steel_kernels(d, bits, 64, *problem), gpu)
                before = cm.predict_all(cm.quantized_decode_structure_kernels(
                    1, 32, 8, 2048, 2048, d, bits, 64, causal, gpu), gpu)
                assert ours["seconds"] <= 1.2 * base["seconds"], (d, bits, causal)
                assert before["seconds"] > 2 * ours["seconds"], (d, bits, causal)
                assert not ours["spills"]
