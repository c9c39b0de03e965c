"""The Metal kernels over quantized K/V (metal/attention_quantized.metal),
launched from their C++ plan (csrc/metal/quantized_launch_plan.cpp) in the MSL
emulator, precise and fast math, against dequantize-then-reference
(mx.dequantize in float32, then mlx_attn.reference). A representative sample
of the grid bits x group size x D x GQA x mask x query length x dtype runs by
default; MLX_ATTN_FULL_GRID=1 runs all of it. The plan itself is checked
binding by binding, and the modelled device bytes show each packed byte,
scale and bias is read once per simdgroup."""

import itertools
import os
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from kernel_lab import msl_emulator
from kernel_lab.metal_runner import REPO, EmulatedMetal, View, reference_lse
from mlx_attn import _native, quantized_attention_path, quantized_scaled_dot_product_attention
from mlx_attn.quantized import quantized_launch_plan
from mlx_attn.reference import reference_attention
from sdpa_cases import TOLERANCE

needs_ext = pytest.mark.skipif(_native.ext is None, reason="the native extension is not built")
needs_clang = pytest.mark.skipif(not msl_emulator.clang_available(), reason="clang-19 is not installed")

# The quantized partial kernel and the float decode merge it reuses.
SOURCES = [REPO / "metal" / "attention_decode.metal", REPO / "metal" / "attention_quantized.metal"]
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
KV_HEADS = 2
KV_LEN = 150  # several splits of 64 keys


def quantize(x: mx.array, group_size: int, bits: int, dtype) -> tuple:
    packed, scales, biases = mx.quantize(x, group_size=group_size, bits=bits)
    return packed, scales.astype(dtype), biases.astype(dtype)


def dequantized(triple, group_size: int, bits: int) -> mx.array:
    """What the triple stands for, in float32 (the kernels' arithmetic)."""
    packed, scales, biases = triple
    return mx.dequantize(packed, scales.astype(mx.float32), biases.astype(mx.float32),
                         group_size=group_size, bits=bits)


def make_case(bits, group_size, d, gqa, mask, q_len, dtype, seed=0, *, kv_len=KV_LEN, batch=1):
    """q, k_quant, v_quant and the keyword arguments of one grid point (also
    the quantized prefill tests' builder)."""
    rng = np.random.default_rng(seed)
    hq = KV_HEADS * gqa
    dtype = DTYPES[dtype]
    q = mx.array(rng.standard_normal((batch, hq, q_len, d)).astype(np.float32)).astype(dtype)
    k, v = (mx.array(rng.standard_normal((batch, KV_HEADS, kv_len, d)).astype(np.float32)) for _ in range(2))
    kw = {"scale": d**-0.5}
    if mask == "causal":
        kw["mask"] = "causal"
    elif mask == "window":
        kw["window_size"] = 37
    elif mask == "bool":
        visible = rng.random((q_len, kv_len)) > 0.3
        visible[0] = False  # a row that sees nothing
        kw["mask"] = mx.array(visible)
    elif mask == "additive":
        kw["mask"] = mx.array(rng.standard_normal((1, hq, q_len, kv_len)).astype(np.float32)).astype(dtype)
    elif mask == "sinks":  # some above every logit: the sink sets the row max
        kw["sinks"] = mx.array((rng.standard_normal(hq) * 4).astype(np.float32)).astype(dtype)
    elif mask == "softcap":
        kw["softcap"] = 0.9
    return q, quantize(k, group_size, bits, dtype), quantize(v, group_size, bits, dtype), kw


def check(run, q, k_quant, v_quant, *, bits, group_size, lse=False, gpu_target=None, **kw):
    got = run.quantized(q, k_quant, v_quant, bits=bits, group_size=group_size, return_lse=lse, gpu_target=gpu_target,
                        **kw)
    got, got_lse = got if lse else (got, None)
    plain = {name: (a.array if isinstance(a, View) else a) for name, a in kw.items()}
    k = dequantized([a.array if isinstance(a, View) else a for a in k_quant], group_size, bits)
    v = dequantized([a.array if isinstance(a, View) else a for a in v_quant], group_size, bits)
    q32 = (q.array if isinstance(q, View) else q).astype(mx.float32)
    if isinstance(plain.get("mask"), mx.array) and plain["mask"].dtype != mx.bool_:
        plain["mask"] = plain["mask"].astype(mx.float32)
    if plain.get("sinks") is not None:
        plain["sinks"] = plain["sinks"].astype(mx.float32)
    want = np.array(reference_attention(q32, k, v, **plain))
    got = np.array(got.astype(mx.float32))
    assert np.isfinite(got).all()
    err = np.abs(got - want).max()
    dtype = (q.array if isinstance(q, View) else q).dtype
    assert err <= TOLERANCE[dtype], f"max error {err} ({dtype})"
    if lse:
        want_lse = reference_lse(q32, k, v, **plain)
        got_lse = np.array(got_lse)
        assert np.array_equal(np.isneginf(got_lse), np.isneginf(want_lse))
        finite = np.isfinite(want_lse)
        assert np.allclose(got_lse[finite], want_lse[finite], rtol=1e-5, atol=1e-4)


@pytest.fixture(scope="module", params=[False, True], ids=["precise", "fast-math"])
def run(request):
    return EmulatedMetal(fast_math=request.param, sources=SOURCES)


AXES = {
    "bits": (4, 8),
    "group_size": (32, 64, 128),
    "d": (64, 128, 512),
    "gqa": (1, 4),
    "mask": ("none", "causal", "bool", "additive", "window", "sinks"),
    # decode (Tq 1..4), 8 positions (up to 32 rows: several row chunks) and a
    # prefill shape, which the decode kernel takes at D = 512 only
    "q_len": (1, 2, 3, 4, 8, 40),
    "dtype": tuple(DTYPES),
}


def takes_prefill(p: dict) -> bool:
    """Rows the quantized prefill kernel takes (csrc/metal/quantized_launch_plan.h
    quantized_rows_take_prefill; tests/test_quantized_prefill_metal.py)."""
    return p["d"] <= 128 and (p["q_len"] > 8 or p["gqa"] * p["q_len"] > 32)


def grid_points():
    points = [dict(zip(AXES, values)) for values in itertools.product(*AXES.values())]
    return [p for p in points if p["d"] % p["group_size"] == 0 and not takes_prefill(p)]


# Every value of every axis at least once, decode and prefill shapes with each
# mask kind, both bit widths with each group size.
SAMPLE = [
    dict(bits=4, group_size=32, d=64, gqa=1, mask="none", q_len=1, dtype="float32"),
    dict(bits=8, group_size=64, d=64, gqa=4, mask="causal", q_len=2, dtype="float16"),
    dict(bits=4, group_size=128, d=128, gqa=4, mask="bool", q_len=3, dtype="bfloat16"),
    dict(bits=8, group_size=32, d=128, gqa=1, mask="additive", q_len=4, dtype="float32"),
    dict(bits=4, group_size=64, d=128, gqa=4, mask="window", q_len=1, dtype="float16"),
    dict(bits=8, group_size=128, d=128, gqa=4, mask="sinks", q_len=2, dtype="float32"),
    dict(bits=4, group_size=32, d=128, gqa=4, mask="causal", q_len=8, dtype="float32"),
    dict(bits=8, group_size=64, d=64, gqa=1, mask="window", q_len=8, dtype="bfloat16"),
    dict(bits=4, group_size=64, d=64, gqa=4, mask="sinks", q_len=8, dtype="float16"),
    dict(bits=8, group_size=32, d=64, gqa=4, mask="bool", q_len=8, dtype="float32"),
    dict(bits=4, group_size=64, d=512, gqa=4, mask="causal", q_len=2, dtype="float16"),  # 2 rows per threadgroup
    dict(bits=8, group_size=128, d=512, gqa=1, mask="window", q_len=40, dtype="float32"),  # prefill at D = 512
]
POINTS = grid_points() if os.environ.get("MLX_ATTN_FULL_GRID") == "1" else SAMPLE


def point_id(p: dict) -> str:
    return f"b{p['bits']}-g{p['group_size']}-d{p['d']}-gqa{p['gqa']}-{p['mask']}-tq{p['q_len']}-{p['dtype']}"


@needs_ext
@needs_clang
@pytest.mark.parametrize("decode_shape", ["group", "row"])
@pytest.mark.parametrize("point", POINTS, ids=point_id)
def test_kernels_match_dequantize_then_reference(run, point, decode_shape):
    """Each point on both of the decode's threadgroup shapes (the rows the
    quantized prefill kernel takes: that kernel, whatever the shape)."""
    q, kq, vq, kw = make_case(**point)
    check(run, q, kq, vq, bits=point["bits"], group_size=point["group_size"], lse=point["dtype"] == "float32",
          gpu_target={"decode_shape": decode_shape}, **kw)
    kernel = run.last_plan.dispatches[0].kernel
    if kernel.startswith("attention_quantized_decode_partial_"):
        assert ("_r1_sg" in kernel) == (decode_shape == "row"), kernel


@needs_ext
@needs_clang
def test_sample_covers_every_axis_value():
    for axis, values in AXES.items():
        assert {p[axis] for p in SAMPLE} == set(values), axis
    assert all(p in grid_points() for p in SAMPLE)


def cache_view(x: mx.array, fill) -> View:
    """x as the first T positions of a longer preallocated cache whose unused
    tail holds `fill` (a read past T would show)."""
    b, h, t, f = x.shape
    buffer = mx.concatenate([x, mx.full((b, h, 9, f), fill, dtype=x.dtype)], axis=2)
    return View(buffer, lambda a: a[:, :, :t])


@needs_ext
@needs_clang
@pytest.mark.parametrize("bits", [4, 8])
def test_strided_triples_from_a_cache(run, bits):
    """Packed words, scales and biases each read through their own strides:
    slices of a longer cache (NaN scales and garbage words past the end), and
    biases stored [B, T, H, G] (head and position strides swapped)."""
    q, (kp, ks, kb), (vp, vs, vb), kw = make_case(bits, 32, 64, 4, "causal", 3, "float16", seed=5)
    k_quant = (cache_view(kp, 0xFFFFFFFF), cache_view(ks, float("nan")),
               View(mx.contiguous(kb.transpose(0, 2, 1, 3)), lambda a: a.transpose(0, 2, 1, 3)))
    v_quant = (cache_view(vp, 0x12345678), View(vs), cache_view(vb, float("nan")))
    check(run, q, k_quant, v_quant, bits=bits, group_size=32, **kw)


@needs_ext
@needs_clang
def test_rows_that_see_nothing_and_an_empty_key_range(run):
    q, kq, vq, kw = make_case(8, 64, 64, 4, "bool", 2, "float32", seed=2)
    check(run, q, kq, vq, bits=8, group_size=64, lse=True, **kw)
    # more queries than keys, causal: the first rows see no key at all
    rng = np.random.default_rng(1)
    q = mx.array(rng.standard_normal((1, 4, 6, 64)).astype(np.float32))
    k, v = (mx.array(rng.standard_normal((1, 2, 4, 64)).astype(np.float32)) for _ in range(2))
    check(run, q, quantize(k, 64, 4, mx.float32), quantize(v, 64, 4, mx.float32), bits=4, group_size=64,
          lse=True, scale=0.125, mask="causal")


@needs_ext
@needs_clang
@pytest.mark.parametrize("q_len, kv_len, splits", [(4, 64, 1), (1, KV_LEN, 10)], ids=["one-split", "ten-splits"])
def test_sinks_and_lse_with_one_split_and_with_several(run, q_len, kv_len, splits):
    """One split: the partial kernel adds the sinks, normalizes and writes
    out and lse itself, in one dispatch; several: the float decode's merge
    does, in a second one. Sinks above every logit (the sink sets the max)."""
    q, kq, vq, kw = make_case(8, 64, 128, 4, "sinks", q_len, "float32", seed=3, kv_len=kv_len)
    check(run, q, kq, vq, bits=8, group_size=64, lse=True, gpu_target={"decode_shape": "group"}, **kw)
    # the group shape over dequantized keys: a quarter of max(64, 16 x rows) keys per split:
    # 16 rows, 64 keys per split: one for 64 keys; 4 rows, 16 keys: 10 for 150
    assert run.last_plan.splits == splits
    assert len(run.last_plan.dispatches) == (1 if splits == 1 else 2)


@needs_ext
@needs_clang
def test_one_split_runs_from_its_variant_source_alone(tmp_path):
    """With one split the plan's only kernel is the quantized partial: its
    per-variant source (csrc/metal/metal_sources.cpp, the Mac's first-use
    compile) stands alone, with no include dirs and no merge, and computes
    out, sinks and lse."""
    q, kq, vq, kw = make_case(4, 64, 64, 4, "sinks", 4, "float32", seed=4, kv_len=64)  # 16 rows: one split
    for shape, fields in (("group", "_r8_sg4"), ("row", "_r1_sg32")):
        kernel = f"attention_quantized_decode_partial_float32_d64_b4{fields}"
        path = tmp_path / f"{kernel}.metal"
        path.write_bytes(_native.ext.metal_variant_source(kernel).encode())
        assert msl_emulator.compile_library([path], include_dirs=[]).kernel_names == [kernel]
        run = EmulatedMetal(fast_math=True, sources=[path])
        check(run, q, kq, vq, bits=4, group_size=64, lse=True, gpu_target={"decode_shape": shape}, **kw)
        assert [d.kernel for d in run.last_plan.dispatches] == [kernel]


# ---------------------------------------------------------------- the plan

def plan_for(bits=8, group_size=64, d=64, hq=8, hkv=2, q_len=1, kv_len=300, dtype=mx.float16, mask=None,
             sinks=False, output_lse=False, decode_shape="group", batch=1, **target):
    """A quantized plan; the decode on the group shape unless named (the
    bindings and grids below are the group shape's)."""
    rng = np.random.default_rng(0)
    q = mx.zeros((batch, hq, q_len, d), dtype=dtype)
    k = mx.array(rng.standard_normal((batch, hkv, kv_len, d)).astype(np.float32))
    kq, vq = quantize(k, group_size, bits, dtype), quantize(k, group_size, bits, dtype)
    return quantized_launch_plan(q, kq, vq, scale=0.1, mask=mask, sinks=mx.zeros((hq,), dtype) if sinks else None,
                                 bits=bits, group_size=group_size, output_lse=output_lse, decode_shape=decode_shape,
                                 **target)


@needs_ext
def test_plan_picks_the_decode_shape_by_the_float_rule():
    """The quantized decode takes the float decode's rule over dequantized
    keys (kernel_lab/decode_rule.py, written apart from the C++: a quarter of the
    keys per split, at most one wave of row-shape splits, one row per KV head
    on the row shape): both shapes over the grid, the kernel's host name,
    threadgroup and split count the rule's."""
    from kernel_lab import decode_rule

    chosen = set()
    for batch, hkv, gqa, kv_len, d, cores in itertools.product((1, 3), (1, 8), (1, 4), (100, 1024, 8192),
                                                              (64, 256), (0, 38)):
        plan = plan_for(d=d, hq=hkv * gqa, hkv=hkv, kv_len=kv_len, batch=batch, decode_shape="auto",
                        gpu_family="apple8", gpu_cores=cores)
        rule = decode_rule.decode_plan(batch, hkv, gqa, kv_len, d, cores or 8, dequantized=True)
        partial = plan.dispatches[0]
        assert partial.kernel == f"attention_quantized_decode_partial_float16_d{d}_b8{rule['fields']}"
        assert partial.threadgroup == [32 * rule["simdgroups"], 1, 1] and plan.splits == rule["splits"]
        chosen.add(rule["shape"])
    assert chosen == {"row", "group"}
    # one row per KV head over 4096 keys: the float rule would take the group shape, the quantized the row shape
    assert decode_rule.decode_plan(1, 1, 1, 4096, 128, 8)["shape"] == "group"
    plan = plan_for(d=128, hq=1, hkv=1, kv_len=4096, decode_shape="auto", bits=4)
    assert plan.dispatches[0].kernel.endswith("_r1_sg32")


def roles(dispatch) -> list[tuple]:
    return [(b.index, b.role, b.source, b.source_index, b.access) for b in dispatch.bindings]


@needs_ext
def test_plan_binds_packed_data_scales_and_biases_of_k_and_v():
    plan = plan_for(mask=mx.ones((1, 300), dtype=mx.bool_), sinks=True, output_lse=True)
    assert plan.supported, plan.reason
    partial, merge = plan.dispatches
    assert partial.kernel == "attention_quantized_decode_partial_float16_d64_b8_r8_sg4_mask_bool"
    assert merge.kernel == "attention_decode_merge_float16_d64"
    assert roles(partial) == [
        (0, "q", "input", 0, "read"), (1, "k", "input", 1, "read"), (2, "k_scales", "input", 2, "read"),
        (3, "k_biases", "input", 3, "read"), (4, "v", "input", 4, "read"), (5, "v_scales", "input", 5, "read"),
        (6, "v_biases", "input", 6, "read"), (7, "params", "params", 0, "read"),
        (8, "quantized_params", "quantized_params", 0, "read"), (9, "mask", "input", 7, "read"),
        (10, "partial_out", "scratch", 0, "write"), (11, "partial_stats", "scratch", 1, "write"),
        # written only with one split (no merge then)
        (12, "sinks", "input", 8, "read"), (13, "out", "output", 0, "write"), (14, "lse", "output", 1, "write"),
    ]
    assert roles(merge) == [
        (0, "partial_out", "scratch", 0, "read"), (1, "partial_stats", "scratch", 1, "read"),
        (2, "sinks", "input", 8, "read"), (3, "out", "output", 0, "write"), (4, "params", "params", 0, "read"),
        (5, "splits", "splits", 0, "read"), (6, "lse", "output", 1, "write"),
    ]
    rows = 4 * 1  # GQA group x query positions
    assert partial.grid == [plan.splits, 2, 1] and merge.grid == [rows, 2, 1]
    assert plan.splits > 1
    assert [s.elements for s in plan.scratch] == [2 * plan.splits * rows * 64, 2 * plan.splits * rows * 2]


@needs_ext
def test_plan_binds_placeholders_for_absent_mask_sinks_and_lse():
    partial, merge = plan_for().dispatches
    assert (9, "mask", "input", 0, "read") in roles(partial)
    assert (12, "sinks", "input", 0, "read") in roles(partial) and (14, "lse", "input", 0, "read") in roles(partial)
    assert (2, "sinks", "input", 0, "read") in roles(merge)
    assert (6, "lse", "input", 0, "read") in roles(merge)
    # sinks without a mask follow the two triples directly
    partial, merge = plan_for(sinks=True).dispatches
    assert (2, "sinks", "input", 7, "read") in roles(merge) and (12, "sinks", "input", 7, "read") in roles(partial)


@needs_ext
def test_one_split_plans_one_dispatch_and_no_scratch():
    """As the float decode (csrc/metal/launch_plan.cpp): with one split the partial
    kernel writes out, sinks and lse itself; no partials, no merge."""
    # 16 rows on the group shape: a split keeps 64 dequantized keys
    plan = plan_for(mask=mx.ones((4, 64), dtype=mx.bool_), sinks=True, output_lse=True, q_len=4, kv_len=64)
    assert plan.supported, plan.reason
    assert plan.splits == 1 and plan.scratch == []
    (partial,) = plan.dispatches
    assert partial.grid == [1, 4, 1]  # 16 rows: two chunks of the group shape's 8 per KV head (D = 64)
    assert roles(partial)[9:] == [
        (9, "mask", "input", 7, "read"),
        # placeholders: the kernel writes no partials with one split
        (10, "partial_out", "input", 0, "read"), (11, "partial_stats", "input", 0, "read"),
        (12, "sinks", "input", 8, "read"), (13, "out", "output", 0, "write"), (14, "lse", "output", 1, "write"),
    ]
    # one more key per row would need a second split only past 256 keys (16 rows x 16)
    assert len(plan_for(q_len=4, kv_len=257).dispatches) == 2


@needs_ext
def test_plan_params_carry_the_scales_and_biases_strides():
    rng = np.random.default_rng(0)
    q = mx.zeros((1, 4, 1, 128), dtype=mx.float16)
    kq = quantize(mx.array(rng.standard_normal((1, 2, 40, 128)).astype(np.float32)), 32, 4, mx.float16)
    cache = [cache_view(a, 0) for a in kq]  # strides of a longer cache
    transposed = View(mx.contiguous(kq[2].transpose(0, 2, 1, 3)), lambda a: a.transpose(0, 2, 1, 3))
    k_quant = [cache[0].array, cache[1].array, transposed.array]
    v_quant = [kq[0], kq[1], cache[2].array]
    plan = quantized_launch_plan(q, k_quant, v_quant, bits=4, group_size=32)
    assert plan.supported, plan.reason
    assert len(plan.quantized_params) == _native.ext.QUANTIZED_ATTENTION_PARAMS_BYTES
    values = struct.unpack("16q2i", plan.quantized_params)
    groups = 128 // 32
    assert list(values[0:4]) == [2 * 49 * groups, 49 * groups, groups, 1]  # k scales: cache slice
    assert list(values[4:8]) == [2 * 40 * groups, groups, 2 * groups, 1]  # k biases: [B, T, H, G] storage
    assert list(values[8:12]) == [2 * 40 * groups, 40 * groups, groups, 1]  # v scales: contiguous
    assert list(values[12:16]) == [2 * 49 * groups, 49 * groups, groups, 1]  # v biases: cache slice
    assert values[16] == 32
    assert plan.problem.k_strides == [2 * 49 * 16, 49 * 16, 16, 1]  # packed words


@needs_ext
def test_plan_serves_prefill_rows_in_chunks():
    """At D = 256 (no register-resident prefill there) the decode structure
    takes prefill rows too, in chunks."""
    plan = plan_for(d=256, hq=8, hkv=2, q_len=40, kv_len=64)
    rows = 4 * 40
    rows_per_threadgroup = 4  # MLX_ATTN_DECODE_ROW_FLOATS / (256 / 32)
    (partial,) = plan.dispatches  # 80 threadgroups fill the GPU: one split, no merge
    assert partial.grid == [1, 2 * (rows // rows_per_threadgroup), 1]


@needs_ext
def test_plan_refuses_with_a_reason():
    # D = 96: a lane's 3 features would straddle two groups of 32
    plan = plan_for(d=96, group_size=32)
    assert not plan.supported and "group_size" in plan.reason and not plan.dispatches
    with pytest.raises(ValueError, match="multiple"):
        plan_for(hq=3, hkv=2)


@needs_ext
def test_empty_output_plans_nothing():
    plan = plan_for(q_len=0)
    assert plan.supported and plan.dispatches == []


@needs_ext
@pytest.mark.skipif(_native.ext is not None and _native.ext.has_metal(), reason="this build has the Metal kernels")
def test_gpu_streams_take_the_reference_path_without_metal():
    q, kq, vq, kw = make_case(8, 64, 64, 4, "causal", 1, "float16")
    assert quantized_attention_path(q, kq, vq, bits=8, group_size=64, stream=mx.gpu, **kw) == "reference"
    with pytest.raises(ValueError, match="no Metal kernels"):
        quantized_scaled_dot_product_attention(q, kq, vq, bits=8, group_size=64, stream=mx.gpu, backend="fused", **kw)


# ---------------------------------------------------------------- modelled traffic

def float16_d128_sources(directory: Path) -> list:
    """SOURCES trimmed to their float16 D = 128 instantiations (the float
    decode and merge, the quantized decode at 4 and 8 bits)."""
    import re

    from kernel_lab.metal_runner import decode_instantiation, quantized_instantiation

    kept = {SOURCES[0]: [decode_instantiation("float16, half", 128)],
            SOURCES[1]: [quantized_instantiation("float16, half", 128, bits) for bits in (4, 8)]}
    paths = []
    for source, lines in kept.items():
        text = re.sub(r"^MLX_ATTN_[A-Z0-9_]+\([^()]*\)[ \t]*$", "", source.read_text(), flags=re.M)
        path = directory / source.name
        path.write_text(text + "\n" + "\n".join(lines) + "\n")
        paths.append(path)
    return paths


def decode_kv_bytes_per_element(run, q, *kv, quantized=None) -> float:
    """Device bytes the decode partial kernel reads per K/V element, q's
    reads (each simdgroup reads its rows' q) taken out: the quantized decode
    and the float decode's group shape, each key read once for the rows of
    its KV head."""
    counters = []

    class Counting:
        def dispatch(self, *args, **kwargs):
            counters.append(run.counting.dispatch(*args, **kwargs))

    library, run.library = run.library, Counting()
    try:
        # the group shape: each key read once for the rows of its KV head
        if quantized:
            run.quantized(q, *kv, scale=0.1, **quantized, gpu_target={"decode_shape": "group"})
        else:
            run(q, *kv, scale=0.1, gpu_target={"decode_shape": "group"})
    finally:
        run.library = library
    _, hq, tq, d = q.shape
    kv_heads, kv_len = kv[0][0].shape[1:3] if quantized else kv[0].shape[1:3]
    q_bytes = run.last_plan.splits * 4 * hq * tq * d * q.itemsize  # MLX_ATTN_DECODE_SIMDGROUPS = 4
    return (counters[0].device_bytes_read - q_bytes) / (2 * kv_heads * kv_len * d)


@needs_ext
@needs_clang
def test_decode_reads_each_quantized_byte_once(tmp_path):
    """fp16 K/V: 2 bytes per element; quantized: bits / 8 plus a float16 scale
    and bias per group: 8-bit ~0.53x and 4-bit ~0.28x of fp16's K/V bytes
    (docs/metal_kernels.md). (Builds of the float16 D = 128 kernels alone:
    a counting build of the whole files takes minutes.)"""
    sources = float16_d128_sources(tmp_path)
    run = EmulatedMetal(fast_math=True, sources=sources)
    run.counting = msl_emulator.compile_library(sources, include_dirs=[REPO], fast_math=True, counters=True)
    rng = np.random.default_rng(0)
    q = mx.array(rng.standard_normal((1, 4, 1, 128)).astype(np.float16))
    k, v = (mx.array(rng.standard_normal((1, 1, 256, 128)).astype(np.float16)) for _ in range(2))
    assert decode_kv_bytes_per_element(run, q, k, v) == 2.0
    for bits, group_size in ((8, 64), (4, 64), (4, 32)):
        kv = [quantize(x, group_size, bits, mx.float16) for x in (k, v)]
        got = decode_kv_bytes_per_element(run, q, *kv, quantized={"bits": bits, "group_size": group_size})
        assert got == bits / 8 + 2 * 2 / group_size, (bits, group_size)


if __name__ == "__main__":  # the docs' table: python tests/test_quantized_metal.py
    import tempfile

    trimmed = float16_d128_sources(Path(tempfile.mkdtemp()))
    emulated = EmulatedMetal(fast_math=True, sources=trimmed)
    emulated.counting = msl_emulator.compile_library(trimmed, include_dirs=[REPO], fast_math=True, counters=True)
    q = mx.random.normal((1, 4, 1, 128)).astype(mx.float16)
    k, v = (mx.random.normal((1, 1, 1024, 128)).astype(mx.float16) for _ in range(2))
    fp16 = decode_kv_bytes_per_element(emulated, q, k, v)
    print(f"decode, D=128, GQA 4, Tkv=1024: modelled device bytes per K/V element\n  float16: {fp16:.4f}")
    for bits in (8, 4):
        for group_size in (32, 64, 128):
            kv = [quantize(x, group_size, bits, mx.float16) for x in (k, v)]
            got = decode_kv_bytes_per_element(emulated, q, *kv, quantized={"bits": bits, "group_size": group_size})
            print(f"  {bits}-bit, group {group_size}: {got:.4f} ({got / fp16:.3f}x float16)")
