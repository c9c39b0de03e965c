"""The portable launch plan the Mac host and the emulator tests share."""

import re
import struct
from pathlib import Path

import mlx.core as mx
import pytest

import mlx_attn
import mlx_attn.metal_support
from mlx_attn import _ext
from mlx_attn.metal_support import launch_plan

from kernel_lab import decode_rule


# AttentionParams (metal/attention_params.h): 17 int64, 10 int32, the float
# scale, output_lse, vector_loads, the float softcap
PARAMS_FORMAT = "17q10ifiif"


def roles(step) -> list[str]:
    return [b.role for b in step.bindings]


def plan_for(b=1, hq=8, hkv=2, tq=100, tkv=120, d=64, dv=None, dtype=mx.float16, **kw):
    q = mx.zeros((b, hq, tq, d), dtype=dtype)
    k = mx.zeros((b, hkv, tkv, d), dtype=dtype)
    v = mx.zeros((b, hkv, tkv, dv or d), dtype=dtype)
    return launch_plan(q, k, v, **kw)


def where_bound(plan) -> dict:
    """role -> (source, source_index, access) over every dispatch."""
    return {(i, b.role): (b.source, b.source_index, b.access)
            for i, step in enumerate(plan.dispatches) for b in step.bindings}


@pytest.mark.parametrize("tq", [40, 2], ids=["prefill", "decode"])
@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("with_lse", [False, True])
def test_bindings_name_their_memory_and_placeholders(tq, with_mask, with_sinks, with_lse):
    """Inputs come in the primitive's order (q, k, v, then mask and sinks when
    present); an absent mask, sinks or lse is bound to q as a placeholder the
    kernel does not touch; buffer indices are 0.. in order; only the outputs
    and scratch a dispatch produces are written; the lse is the second output."""
    mask = mx.ones((tq, 120), mx.bool_) if with_mask else None
    sinks = mx.zeros((8,), mx.float16) if with_sinks else None
    plan = plan_for(tq=tq, mask=mask, sinks=sinks, output_lse=with_lse)
    assert plan.supported, plan.reason
    bound = where_bound(plan)
    for step in plan.dispatches:
        assert [b.index for b in step.bindings] == list(range(len(step.bindings)))
        for b in step.bindings:
            writes = b.role == "out" or (b.role == "lse" and with_lse) or (b.source == "scratch" and plan.scratch[b.source_index].producer == plan.dispatches.index(step))
            assert (b.access == "write") == writes
    mask_at = ("input", 3 if with_mask else 0, "read")
    sinks_at = ("input", (3 + with_mask) if with_sinks else 0, "read")
    lse_at = ("output", 1, "write") if with_lse else ("input", 0, "read")
    for (i, role), where in bound.items():
        expected = {"q": ("input", 0, "read"), "k": ("input", 1, "read"), "v": ("input", 2, "read"),
                    "mask": mask_at, "sinks": sinks_at, "out": ("output", 0, "write"), "lse": lse_at,
                    "params": ("params", 0, "read"), "splits": ("splits", 0, "read")}.get(role)
        if expected:
            assert where == expected, (role, where)
    # the dispatch that writes the output also writes the lse
    assert [roles(step).count("lse") for step in plan.dispatches] == ["out" in roles(step) for step in plan.dispatches]
    params = struct.unpack(PARAMS_FORMAT, plan.params)
    assert params[26] == (1 if with_sinks else 0)
    assert params[25] == (_ext.MASK_BOOL if with_mask else _ext.MASK_NONE)
    assert params[28] == (1 if with_lse else 0)


def test_sinks_stride_is_in_the_params():
    base = mx.arange(24).astype(mx.float16)
    for sinks, stride in ((base[::3], 3), (mx.broadcast_to(base[5:6], (8,)), 0), (base[1:9], 1)):
        mx.eval(sinks)
        plan = plan_for(sinks=sinks)
        assert struct.unpack(PARAMS_FORMAT, plan.params)[16] == stride
        assert plan.problem.sinks_stride == stride


@pytest.mark.parametrize("d", [64, 80, 96, 128, 256, 512])
@pytest.mark.parametrize("tq", [9, 31, 32, 33, 1000])
def test_prefill_grid_covers_every_query_row_and_memory_fits(d, tq):
    plan = plan_for(tq=tq, d=d)
    assert plan.supported, plan.reason
    (step,) = plan.dispatches
    rows_per_group = 32
    assert step.grid == [-(-tq // rows_per_group), 8, 1]
    assert step.grid[0] * rows_per_group >= tq > (step.grid[0] - 1) * rows_per_group
    assert step.threadgroup == [128, 1, 1]
    assert step.threadgroup_memory_bytes <= 32 * 1024
    # the conservative default target takes MLX steel_attention's BK for fp16
    # (past D = 128 the D-split kernel, metal/attention_prefill_split.h)
    expected = {d: f"attention_prefill_float16_d{d}_bk{bk}" for d, bk in ((64, 32), (80, 16), (96, 16), (128, 16))}
    expected |= {d: f"attention_prefill_split_float16_d{d}_dv{d}_bk8" for d in (256, 512)}
    assert step.kernel == expected[d]
    assert roles(step) == ["q", "k", "v", "out", "params", "mask", "sinks", "lse"]


@pytest.mark.parametrize("d", [64, 96, 128, 256, 512])
@pytest.mark.parametrize("tq,tkv", [(1, 1), (1, 150), (8, 4000), (4, 100000)])
def test_decode_plan_for_few_queries(d, tq, tkv):
    plan = plan_for(b=2, hq=8, hkv=2, tq=tq, tkv=tkv, d=d)
    assert plan.supported, plan.reason
    partial, *merges = plan.dispatches
    rows = 4 * tq  # query heads per KV head x query positions
    # the shape and splits of the rule (kernel_lab/decode_rule.py) on the default target (8 cores)
    rule = decode_rule.decode_plan(2, 2, rows, tkv, d)
    row_chunks = -(-rows // rule["rows"])
    splits = plan.splits
    assert splits == rule["splits"]
    assert partial.kernel == f"attention_decode_partial_float16_d{d}{rule['fields']}"
    assert partial.grid == [splits, 2 * row_chunks, 2]
    assert partial.threadgroup == [32 * rule["simdgroups"], 1, 1]
    # simdgroups 1.. hand each row's output, max and sum to simdgroup 0
    assert partial.threadgroup_memory_bytes == (rule["simdgroups"] - 1) * rule["rows"] * (d + 2) * 4 <= 32 * 1024
    assert roles(partial) == ["q", "k", "v", "params", "mask", "partial_out", "partial_stats", "sinks", "out", "lse"]
    if splits == 1:
        # one split: the partial kernel writes the output itself, no partials, no merge
        assert merges == [] and plan.scratch == []
        assert all(b.source != "scratch" for b in partial.bindings)
        assert where_bound(plan)[(0, "out")] == ("output", 0, "write")
        return
    (merge,) = merges
    assert merge.kernel == f"attention_decode_merge_float16_d{d}"
    # a threadgroup per row of MLX_ATTN_DECODE_MERGE_SIMDGROUPS (8) simdgroups, 7 of which hand over their states
    assert merge.grid == [rows, 2, 2] and merge.threadgroup == [256, 1, 1]
    assert merge.threadgroup_memory_bytes == 7 * (d + 2) * 4 <= 32 * 1024
    # the partials the first dispatch writes are what the second one reads
    assert [(s.role, s.elements, s.producer, s.consumer) for s in plan.scratch] == [
        ("partial_out", 2 * 2 * splits * rows * d, 0, 1),
        ("partial_stats", 2 * 2 * splits * rows * 2, 0, 1),
    ]
    for step, access in ((partial, "write"), (merge, "read")):
        scratch = [b for b in step.bindings if b.source == "scratch"]
        assert [(b.role, b.source_index, b.access) for b in scratch] == [
            ("partial_out", 0, access), ("partial_stats", 1, access)]
    # several splits: the output is bound to both (the kernel writes it only at one split)
    assert "out" in roles(merge)


@pytest.mark.parametrize("tkv,hkv,target,expected", [
    (8192, 1, {}, 64),  # the 64 threadgroups of 8 cores x 8 bind before 64 keys per split (16 per row)
    (2048, 1, {}, 32),  # 64 keys per split bind before the 64 threadgroups
    (8192, 8, {}, 8),  # 8 KV heads x 8 splits fill the default 8 cores x 8
    (4096, 1, {}, 64),
    (300, 1, {}, 5),
    (100, 16, {}, 2),
    (1024, 8, dict(gpu_family="apple8", gpu_cores=38), 16),  # issue 23's M2 Max case: 128 threadgroups, not 32
    (100000, 64, {}, 1),
    (8192, 8, dict(gpu_family="apple9", gpu_cores=24), 24),  # 24 cores x 8 / 8 KV heads
    (8192, 8, dict(gpu_family="apple8", gpu_cores=10), 10),
    (100000, 1, dict(gpu_family="apple7", gpu_cores=48), 384),
])
def test_decode_splits_fill_the_gpu_without_tiny_splits(tkv, hkv, target, expected):
    """The group shape's splits (8 rows, 4 simdgroups at D = 128), GQA 4, one
    query: 4 rows, one row chunk per KV head."""
    shapes = _ext.metal_decode_shapes(1, hkv, 4, tkv, 128, **target)
    assert (shapes["group"]["rows"], shapes["group"]["simdgroups"]) == (8, 4)
    assert shapes["group"]["splits"] == expected
    plan = plan_for(b=1, hq=4 * hkv, hkv=hkv, tq=1, tkv=tkv, d=128, **target)
    chosen = "row" if shapes["row"]["chosen"] else "group"
    assert plan.splits == shapes[chosen]["splits"]


@pytest.mark.parametrize("b,hkv,group,tkv,target,shape,splits", [
    # issue #23's case (B=1, Hkv=8, GQA 4, T=1024 on a 38-core M2 Max): the
    # group shape needs 16 splits and a merge for its 128 threadgroups; the row
    # shape keeps 32 threadgroups of 1024 threads, 32 keys per simdgroup, one
    # dispatch
    (1, 8, 4, 1024, dict(gpu_family="apple8", gpu_cores=38), "row", 1),
    (1, 8, 4, 128, dict(gpu_family="apple8", gpu_cores=38), "row", 1),
    # long contexts: the group shape reads each key once for its 4 rows
    (1, 8, 4, 4096, dict(gpu_family="apple8", gpu_cores=38), "group", 38),
    (1, 8, 8, 8192, dict(gpu_family="apple8", gpu_cores=38), "group", 38),
    # one KV head, 8 query heads, 100k keys: the row shape splits too (its
    # floor: 32 keys per simdgroup) but loses to the group shape's 64 splits
    (1, 1, 8, 100000, {}, "group", 64),
    # a batch that fills the GPU by itself (the default 8 cores): one split
    # either way; the row shape's 2048 threadgroups run in 256 waves of 8,
    # 32 keys per simdgroup each, the group shape's 512 in 8 waves of 64,
    # 256 keys of 4 rows per simdgroup each
    (64, 8, 4, 1024, {}, "group", 1),
])
def test_decode_shape_choice(b, hkv, group, tkv, target, shape, splits):
    shapes = _ext.metal_decode_shapes(b, hkv, group, tkv, 128, **target)
    assert shapes[shape]["chosen"] and not shapes["row" if shape == "group" else "group"]["chosen"]
    assert shapes[shape]["splits"] == splits
    assert decode_rule.decode_plan(b, hkv, group, tkv, 128, target.get("gpu_cores") or 8)["shape"] == shape
    plan = plan_for(b=b, hq=group * hkv, hkv=hkv, tq=1, tkv=tkv, d=128, **target)
    fields = "_r1_sg32" if shape == "row" else "_r8_sg4"
    assert plan.dispatches[0].kernel == f"attention_decode_partial_float16_d128{fields}"
    assert len(plan.dispatches) == (1 if splits == 1 else 2)


def test_decode_shapes_follow_the_rule_on_a_grid():
    """Both shapes, their splits and the choice against the rule written
    apart (kernel_lab/decode_rule.py), over batches, KV heads, rows, lengths,
    head dims and core counts."""
    import itertools

    chosen = set()
    for b, hkv, rows, tkv, d, cores in itertools.product((1, 3), (1, 2, 8, 32), (1, 3, 4, 8, 32),
                                                          (1, 60, 600, 1024, 4096, 100000), (64, 96, 128, 256, 512),
                                                          (0, 10, 38)):
        shapes = _ext.metal_decode_shapes(b, hkv, rows, tkv, d, gpu_family="apple8", gpu_cores=cores)
        rule = decode_rule.decode_plan(b, hkv, rows, tkv, d, cores or 8)
        name = "row" if shapes["row"]["chosen"] else "group"
        assert (name, shapes[name]["splits"]) == (rule["shape"], rule["splits"]), (b, hkv, rows, tkv, d, cores)
        assert (shapes[name]["rows"], shapes[name]["simdgroups"]) == (rule["rows"], rule["simdgroups"])
        chosen.add(name)
    assert chosen == {"row", "group"}


def test_decode_shapes_reject_a_bad_target():
    with pytest.raises(ValueError, match="gpu_family"):
        _ext.metal_decode_shapes(1, 1, 1, 10, 128, gpu_family="m9")
    assert _ext.metal_decode_shapes(1, 1, 1, 10, 80)["group"]["rows"] == 0  # no decode kernel at D = 80


@pytest.mark.parametrize("kwargs", [dict(d=80, tq=1), dict(hq=40, hkv=1, tq=1), dict(hq=8, hkv=2, tq=9)])
def test_shapes_outside_decode_take_the_prefill_kernel(kwargs):
    plan = plan_for(**kwargs)
    assert plan.supported
    assert [step.kernel.split("_float")[0] for step in plan.dispatches] == ["attention_prefill"]


def test_params_bytes_encode_the_problem():
    """The params carry the problem as the host sees it: the strides of the
    arrays handed over (views included) and the mask's broadcast strides."""
    q = mx.zeros((2, 7, 8, 64), mx.float16).transpose(0, 2, 1, 3)  # stored [B, T, H, D]
    k = mx.zeros((2, 2, 12, 64), mx.float16)[:, :, :9]  # the first 9 rows of a longer cache
    v = mx.zeros((2, 2, 9, 64), mx.float16)
    mask = mx.zeros((7, 9), mx.bool_)
    mx.eval(q, k, v, mask)
    plan = launch_plan(q, k, v, mask=mask, window_size=4, scale=0.5)
    raw = plan.params
    assert len(raw) == _ext.ATTENTION_PARAMS_BYTES
    values = struct.unpack(PARAMS_FORMAT, raw)
    assert values[:4] == (7 * 8 * 64, 64, 8 * 64, 1)
    assert values[4:8] == (2 * 12 * 64, 12 * 64, 64, 1)
    assert values[8:12] == (2 * 9 * 64, 9 * 64, 64, 1)
    assert values[12:16] == (0, 0, 9, 1)
    assert values[16] == 0  # sinks stride (no sinks)
    batch, q_heads, kv_heads, group, q_len, kv_len, causal, window, mask_kind, sinks = values[17:27]
    assert (batch, q_heads, kv_heads, group, q_len, kv_len) == (2, 8, 2, 4, 7, 9)
    assert (causal, window, mask_kind, sinks) == (1, 4, _ext.MASK_BOOL, 0)
    assert values[27] == 0.5
    assert values[29] == 1 and plan.vector_loads  # every row start a multiple of 4 elements
    assert values[30] == 0.0  # no softcap


def evaluated(x: mx.array) -> mx.array:
    mx.eval(x)  # a view's strides and offset are known once it is evaluated
    return x


@pytest.mark.parametrize("tq", [40, 2], ids=["prefill", "decode"])
def test_vector_loads_need_every_row_start_aligned(tq):
    """The plan lets the kernels read q/k/v as 4-element vectors only when the
    last dim is contiguous and every batch/head/position stride and the
    buffer offset are multiples of 4 elements (csrc/metal/launch_plan.cpp)."""
    q = evaluated(mx.zeros((1, 4, tq, 64), mx.float16))
    wide = evaluated(mx.zeros((1, 2, 50, 68), mx.float16))
    odd = evaluated(mx.zeros((1, 2, 50, 65), mx.float16))
    seq_major = evaluated(mx.zeros((1, 50, 2, 64), mx.float16))
    cases = {
        "rows of 68 elements": (q, wide[..., :64], True),
        "offset of 4 elements": (q, evaluated(wide[..., 4:]), True),
        "[B, T, H, D] storage": (q, evaluated(seq_major.transpose(0, 2, 1, 3)), True),
        "offset of 2 elements": (q, evaluated(wide[..., 2:66]), False),
        "odd row stride": (q, evaluated(odd[..., :64]), False),
        "strided last dim": (q, evaluated(mx.zeros((1, 2, 50, 128), mx.float16)[..., ::2]), False),
        "q misaligned, k/v aligned": (evaluated(mx.zeros((1, 4, tq, 66), mx.float16)[..., 1:65]), wide[..., :64], False),
    }
    for name, (q_in, kv, vector) in cases.items():
        kv = evaluated(kv)
        plan = launch_plan(q_in, kv, kv, scale=0.125)
        assert plan.supported, plan.reason
        assert plan.vector_loads == vector, name
        assert struct.unpack(PARAMS_FORMAT, plan.params)[29] == int(vector), name
    offset_view = evaluated(wide[..., 2:66])
    assert launch_plan(q, offset_view, offset_view, scale=0.125).problem.k_offset == 2  # elements, not bytes


@pytest.mark.parametrize("kwargs,reason", [
    (dict(d=72), "head dims (key/value) 64, 80, 96, 128 (key = value head dim), 192/128, 256/256, 512/512, "
                 "576/512, got 72/72"),
    (dict(d=64, dv=32), "got 64/32"),
    (dict(d=8), "head dims"),
    (dict(d=576), "got 576/576"),
])
def test_unsupported_problems_say_why(kwargs, reason):
    plan = plan_for(**kwargs)
    assert not plan.supported and reason in plan.reason


def test_metal_support_reason_on_this_build():
    q = mx.zeros((1, 2, 4, 64))
    reason = _ext.unsupported_reason(_ext.describe_attention(q, q, q), device=mx.gpu)
    if _ext.has_metal():
        assert reason is None
    else:
        assert "no Metal kernels" in reason


@pytest.mark.parametrize("d", [72, 64])
def test_gpu_dispatch_falls_back_with_the_reason(d):
    """ops asks the launch plan (through _ext) on a GPU stream: an
    unsupported head dim, or a build without Metal, takes mx.fast where it
    computes the same (no window, no log-sum-exp, no row that may see no key),
    else the reference path; backend='fused' names the reason."""
    q = mx.zeros((1, 2, 4, d))
    supported = _ext.has_metal() and d in (64, 80, 96, 128, 256, 512)
    fallback = {
        "plain": (dict(), "mlx-fast"),
        "causal": (dict(mask="causal"), "mlx-fast"),
        "window": (dict(mask="causal", window_size=2), "reference"),
        "bool mask": (dict(mask=mx.ones((4, 4), dtype=mx.bool_)), "reference"),
        "lse": (dict(return_lse=True), "reference"),
    }
    for name, (kwargs, expected) in fallback.items():
        path = mlx_attn.attention_path(q, q, q, stream=mx.gpu, **kwargs)
        if supported and name != "lse":
            assert path == "fused-metal", name
        elif not supported:
            assert path == expected, name
    causal_cross = mlx_attn.attention_path(q, q[:, :, :2], q[:, :, :2], mask="causal", stream=mx.gpu)
    assert causal_cross == ("fused-metal" if supported else "reference")  # Tq > Tkv: rows that see nothing
    if not supported:
        reason = "the Metal kernels support head dims" if _ext.has_metal() else "no Metal kernels"
        with pytest.raises(ValueError, match=reason):
            mlx_attn.attention_path(q, q, q, stream=mx.gpu, backend="fused")


# The per-GPU-family table as docs/metal_kernels.md states it: BK per head
# dim (64, 80, 96, 128, 256) for 2-byte dtypes and for float32.
STEEL_BK = (32, 16, 16, 16, 8)
DOCUMENTED_KEY_BLOCKS = {
    "unknown": (STEEL_BK, STEEL_BK),
    "apple7": (STEEL_BK, STEEL_BK),
    "apple8": (STEEL_BK, STEEL_BK),
    "apple9": ((32, 32, 32, 32, 16), STEEL_BK),
    "apple10": ((32, 32, 32, 32, 16), STEEL_BK),
}


@pytest.mark.parametrize("architecture,family,cores", [
    ("applegpu_g13g", "apple7", 8),  # M1
    ("applegpu_g13s", "apple7", 14),  # M1 Pro
    ("applegpu_g14c", "apple8", 24),  # M2 Max
    ("applegpu_g14d", "apple8", 48),  # M2 Ultra
    ("applegpu_g15g", "apple9", 8),  # M3
    ("applegpu_g16s", "apple9", 14),  # M4 Pro
    ("applegpu_g16g", "apple9", 8),  # M4
    ("applegpu_g17g", "apple10", 8),  # M5
    ("applegpu_g17p", "apple10", 4),  # A19
    ("applegpu_g18s", "unknown", 14),  # not known yet: the conservative family, the tier's cores
    ("applegpu_g14", "apple8", 0),  # no tier: the family's base part
    ("applegpu_g14x", "apple8", 0),
    ("applegpu_g12g", "unknown", 8),  # older than the table
    ("applegpu_g", "unknown", 0),
    ("", "unknown", 0),
    ("Apple M2", "unknown", 0),
])
def test_gpu_target_from_mlx_architecture(architecture, family, cores):
    """The one function the Mac host calls with MLX's
    Device::get_architecture(): generation -> family, tier -> cores."""
    assert _ext.gpu_target_from_architecture(architecture) == {"gpu_family": family, "gpu_cores": cores}


def test_family_table_is_the_documented_one():
    table = {row["gpu_family"]: row for row in _ext.gpu_family_table()}
    assert set(table) == set(DOCUMENTED_KEY_BLOCKS)
    doc = (Path(__file__).resolve().parent.parent / "docs" / "metal_kernels.md").read_text()
    for family, (bk16, bk32) in DOCUMENTED_KEY_BLOCKS.items():
        row = table[family]
        assert tuple(row["prefill_key_block"][d][0] for d in (64, 80, 96, 128, 256)) == bk16
        assert tuple(row["prefill_key_block"][d][1] for d in (64, 80, 96, 128, 256)) == bk32
        line = next(line for line in doc.splitlines() if line.startswith(f"| {family} |"))
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[2:7] == [str(row["base_cores"]), str(row["prefill_simdgroups"]),
                              "/".join(map(str, bk16)), "/".join(map(str, bk32)),
                              str(row["decode_threadgroups_per_core"])], family


@pytest.mark.parametrize("family", list(DOCUMENTED_KEY_BLOCKS))
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32], ids=str)
@pytest.mark.parametrize("d", [64, 80, 96, 128, 256])
def test_each_family_plans_its_tiles(family, dtype, d):
    """The family's row decides BK (in the kernel name and the threadgroup
    memory), the simdgroups (threadgroup size and rows per threadgroup)."""
    plan = plan_for(tq=70, tkv=90, d=d, dtype=dtype, gpu_family=family)
    assert plan.supported, plan.reason
    assert (plan.gpu_family, plan.gpu_cores) == (family, 8)
    bk16, bk32 = DOCUMENTED_KEY_BLOCKS[family]
    bk = (bk32 if dtype == mx.float32 else bk16)[(64, 80, 96, 128, 256).index(d)]
    (step,) = plan.dispatches
    name = {mx.float16: "float16", mx.bfloat16: "bfloat16", mx.float32: "float32"}[dtype]
    size = 4 if dtype == mx.float32 else 2
    if d <= 128:
        assert step.kernel == f"attention_prefill_{name}_d{d}_bk{bk}"
        assert step.threadgroup_memory_bytes == 2 * bk * (d * size + 16) <= 32 * 1024
    else:  # the D-split kernel: K whole, V one 128-dim pass at a time
        assert step.kernel == f"attention_prefill_split_{name}_d{d}_dv{d}_bk{bk}"
        assert step.threadgroup_memory_bytes == bk * (d * size + 16) + bk * (128 * size + 16) <= 32 * 1024
    assert step.threadgroup == [128, 1, 1] and step.grid == [3, 8, 1]  # 4 simdgroups x 8 rows


@pytest.mark.parametrize("kwargs,message", [
    (dict(gpu_family="apple6"), "gpu_family"),
    (dict(gpu_family="M2"), "gpu_family"),
    (dict(gpu_cores=-1), "gpu_cores"),
])
def test_bad_gpu_target_is_a_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_for(**kwargs)


def documented_buffer_roles() -> list[str]:
    """The roles docs/architecture.md lists, in order: the bullet list after
    "The buffer roles"."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "architecture.md").read_text()
    after = text.split("The buffer roles (`BufferRole`", 1)[1]
    bullets = after.split("\n\n")[1]  # the paragraph after the heading sentence
    assert bullets.lstrip().startswith("- "), "the role list must follow the sentence that introduces it"
    return re.findall(r"`([a-z_]+)`", bullets)


def test_architecture_doc_lists_every_buffer_role():
    assert documented_buffer_roles() == list(_ext.buffer_role_names())


def test_every_role_binds_through_the_one_table():
    """Every role a plan binds (forward, decode, quantized and backward
    plans) comes from the same enumeration, and the placeholders bind input
    0 for reading."""
    q = mx.zeros((1, 4, 40, 64))
    k = v = mx.zeros((1, 2, 50, 64))
    plan = launch_plan(q, k, v)
    placeholders = [b for d in plan.dispatches for b in d.bindings if b.role in ("mask", "sinks", "lse")]
    assert placeholders and all((b.source, b.source_index, b.access) == ("input", 0, "read") for b in placeholders)
    roles = {b.role for d in plan.dispatches for b in d.bindings}
    assert roles <= set(_ext.buffer_role_names())


# ------------------------------------------------------------ kernel identity
def dispatches_of_every_family():
    """Dispatches of plans that reach every planned kernel family."""
    plans = [plan_for(tq=100), plan_for(tq=1, tkv=4000), plan_for(tq=100, d=256, dv=256),
             plan_for(tq=100, mask=mx.zeros((100, 120), mx.bool_)), plan_for(tq=2, tkv=300, sinks=mx.zeros((8,), mx.float16))]
    q, k = mx.zeros((1, 8, 50, 64), mx.float32), mx.zeros((1, 2, 60, 64), mx.float32)
    plans.append(_ext.metal_backward_launch_plan(_ext.describe_attention(q, k, k, scale=0.1, sinks=mx.zeros((8,)))))
    plans.append(_ext.metal_backward_launch_plan(_ext.describe_attention(
        mx.zeros((1, 2, 40, 256)), mx.zeros((1, 2, 40, 256)), mx.zeros((1, 2, 40, 256)), scale=0.1)))
    return [step for plan in plans for step in plan.dispatches]


def test_a_dispatch_carries_its_kernel_identity_and_the_name_reads_back():
    steps = dispatches_of_every_family()
    assert {step.id.family for step in steps} >= {
        "prefill", "prefill_split", "decode_partial", "decode_merge", "backward_delta", "backward_dkdv",
        "backward_dq", "backward_sinks", "backward_split_dkdv", "backward_split_dq"}
    for step in steps:
        assert _ext.parse_kernel_id(step.kernel) == step.id, step.kernel
        # the name is the identity spelled out, field by field (written here apart from the C++)
        kernel_id = step.id
        fields = "".join(f"_{tag}{value}" for tag, value in kernel_id.fields.items())
        mask = {0: "", 1: "_mask_bool", 2: "_mask_additive"}[kernel_id.mask]
        assert step.kernel == f"attention_{kernel_id.family}_{kernel_id.dtype}{fields}{mask}"
        assert kernel_id.phase == ("backward" if "backward" in kernel_id.family else
                                   "decode" if "decode" in kernel_id.family else "prefill")


@pytest.mark.parametrize("name", ["attention_prefill", "attention_prefill_float16", "attention_prefill_half_d64",
                                  "attention_nothing_float16_d64", "attention_prefill_float16_d", "prefill_float16_d64",
                                  "attention_prefill_float16_d64_", "attention_prefill_float16_64",
                                  "attention_decode_merge_float16_d64_x"])
def test_names_that_spell_no_kernel_read_as_none(name):
    assert _ext.parse_kernel_id(name) is None


def test_the_self_check_variant_comes_from_the_identity_not_the_name():
    from mlx_attn import ops
    decode = _ext.describe_attention(mx.zeros((1, 8, 1, 64), mx.float16), mx.zeros((1, 2, 500, 64), mx.float16),
                                     mx.zeros((1, 2, 500, 64), mx.float16), scale=0.1)
    prefill = _ext.describe_attention(mx.zeros((1, 8, 100, 64), mx.float16), mx.zeros((1, 2, 100, 64), mx.float16),
                                      mx.zeros((1, 2, 100, 64), mx.float16), scale=0.1)
    assert ops.metal_variant(decode).phase == "decode" and ops.metal_variant(prefill).phase == "prefill"
