"""The portable launch plan the Mac host and the emulator tests share."""

import struct

import mlx.core as mx
import pytest

import mlx_attn
import mlx_attn.metal_support
from mlx_attn import _ext
from mlx_attn.metal_support import launch_plan


def roles(step) -> list[str]:
    return [b["role"] for b in step["bindings"]]


def plan_for(b=1, hq=8, hkv=2, tq=100, tkv=120, d=64, dv=None, dtype=mx.float16, **kw):
    q = mx.zeros((b, hq, tq, d), dtype=dtype)
    k = mx.zeros((b, hkv, tkv, d), dtype=dtype)
    v = mx.zeros((b, hkv, tkv, dv or d), dtype=dtype)
    return launch_plan(q, k, v, **kw)


def where_bound(plan) -> dict:
    """role -> (source, source_index, access) over every dispatch."""
    return {(i, b["role"]): (b["source"], b["source_index"], b["access"])
            for i, step in enumerate(plan["dispatches"]) for b in step["bindings"]}


@pytest.mark.parametrize("tq", [40, 2], ids=["prefill", "decode"])
@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_bindings_name_their_memory_and_placeholders(tq, with_mask, with_sinks):
    """Inputs come in the primitive's order (q, k, v, then mask and sinks when
    present); an absent mask or sinks is bound to q as a placeholder the
    kernel does not read; buffer indices are 0.. in order; only the output
    and scratch a dispatch produces are written."""
    mask = mx.ones((tq, 120), mx.bool_) if with_mask else None
    sinks = mx.zeros((8,), mx.float16) if with_sinks else None
    plan = plan_for(tq=tq, mask=mask, sinks=sinks)
    bound = where_bound(plan)
    for step in plan["dispatches"]:
        assert [b["index"] for b in step["bindings"]] == list(range(len(step["bindings"])))
        for b in step["bindings"]:
            writes = b["role"] == "out" or (b["source"] == "scratch" and plan["scratch"][b["source_index"]]["producer"] == plan["dispatches"].index(step))
            assert (b["access"] == "write") == writes
    mask_at = ("input", 3 if with_mask else 0, "read")
    sinks_at = ("input", (3 + with_mask) if with_sinks else 0, "read")
    for (i, role), where in bound.items():
        expected = {"q": ("input", 0, "read"), "k": ("input", 1, "read"), "v": ("input", 2, "read"),
                    "mask": mask_at, "sinks": sinks_at, "out": ("output", 0, "write"),
                    "params": ("params", 0, "read"), "splits": ("splits", 0, "read")}.get(role)
        if expected:
            assert where == expected, (role, where)
    params = struct.unpack("17q10ifi", plan["params"])
    assert params[26] == (1 if with_sinks else 0)
    assert params[25] == (_ext.MASK_BOOL if with_mask else _ext.MASK_NONE)


def test_sinks_stride_is_in_the_params():
    base = mx.arange(24).astype(mx.float16)
    for sinks, stride in ((base[::3], 3), (mx.broadcast_to(base[5:6], (8,)), 0), (base[1:9], 1)):
        mx.eval(sinks)
        plan = plan_for(sinks=sinks)
        assert struct.unpack("17q10ifi", plan["params"])[16] == stride
        assert plan["problem"].sinks_stride == stride


@pytest.mark.parametrize("d", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("tq", [9, 31, 32, 33, 1000])
def test_prefill_grid_covers_every_query_row_and_memory_fits(d, tq):
    plan = plan_for(tq=tq, d=d)
    assert plan["supported"], plan["reason"]
    (step,) = plan["dispatches"]
    rows_per_group = 32
    assert step["grid"] == [-(-tq // rows_per_group), 8, 1]
    assert step["grid"][0] * rows_per_group >= tq > (step["grid"][0] - 1) * rows_per_group
    assert step["threadgroup"] == [128, 1, 1]
    assert step["threadgroup_memory_bytes"] <= 32 * 1024
    assert step["kernel"] == f"attention_prefill_float16_d{d}"
    assert roles(step) == ["q", "k", "v", "out", "params", "mask", "sinks"]


@pytest.mark.parametrize("d", [64, 96, 128, 256])
@pytest.mark.parametrize("tq,tkv", [(1, 1), (1, 150), (8, 4000), (4, 100000)])
def test_decode_plan_for_few_queries(d, tq, tkv):
    plan = plan_for(b=2, hq=8, hkv=2, tq=tq, tkv=tkv, d=d)
    assert plan["supported"], plan["reason"]
    partial, merge = plan["dispatches"]
    rows = 4 * tq  # query heads per KV head x query positions
    splits = plan["splits"]
    assert splits == min(32, max(1, -(-tkv // 64)))
    assert partial["kernel"] == f"attention_decode_partial_float16_d{d}"
    assert partial["grid"] == [splits, 2, 2] and partial["threadgroup"] == [128, 1, 1]
    assert partial["threadgroup_memory_bytes"] <= 32 * 1024
    assert merge["kernel"] == f"attention_decode_merge_float16_d{d}"
    assert merge["grid"] == [rows, 2, 2] and merge["threadgroup"] == [32, 1, 1]
    # the partials the first dispatch writes are what the second one reads
    assert plan["scratch"] == [
        {"role": "partial_out", "elements": 2 * 2 * splits * rows * d, "producer": 0, "consumer": 1},
        {"role": "partial_stats", "elements": 2 * 2 * splits * rows * 2, "producer": 0, "consumer": 1},
    ]
    for step, access in ((partial, "write"), (merge, "read")):
        scratch = [b for b in step["bindings"] if b["source"] == "scratch"]
        assert [(b["role"], b["source_index"], b["access"]) for b in scratch] == [
            ("partial_out", 0, access), ("partial_stats", 1, access)]
    assert "out" in roles(merge) and "out" not in roles(partial)


@pytest.mark.parametrize("kwargs", [dict(d=80, tq=1), dict(hq=40, hkv=1, tq=1), dict(hq=8, hkv=2, tq=9)])
def test_shapes_outside_decode_take_the_prefill_kernel(kwargs):
    plan = plan_for(**kwargs)
    assert plan["supported"]
    assert [step["kernel"].split("_float")[0] for step in plan["dispatches"]] == ["attention_prefill"]


def test_params_bytes_encode_the_problem():
    """The params carry the problem as the host sees it: the strides of the
    arrays handed over (views included) and the mask's broadcast strides."""
    q = mx.zeros((2, 7, 8, 64), mx.float16).transpose(0, 2, 1, 3)  # stored [B, T, H, D]
    k = mx.zeros((2, 2, 12, 64), mx.float16)[:, :, :9]  # the first 9 rows of a longer cache
    v = mx.zeros((2, 2, 9, 64), mx.float16)
    mask = mx.zeros((7, 9), mx.bool_)
    mx.eval(q, k, v, mask)
    plan = launch_plan(q, k, v, mask=mask, window_size=4, scale=0.5)
    raw = plan["params"]
    assert len(raw) == _ext.ATTENTION_PARAMS_BYTES
    values = struct.unpack("17q10ifi", raw)
    assert values[:4] == (7 * 8 * 64, 64, 8 * 64, 1)
    assert values[4:8] == (2 * 12 * 64, 12 * 64, 64, 1)
    assert values[8:12] == (2 * 9 * 64, 9 * 64, 64, 1)
    assert values[12:16] == (0, 0, 9, 1)
    assert values[16] == 0  # sinks stride (no sinks)
    batch, q_heads, kv_heads, group, q_len, kv_len, causal, window, mask_kind, sinks = values[17:27]
    assert (batch, q_heads, kv_heads, group, q_len, kv_len) == (2, 8, 2, 4, 7, 9)
    assert (causal, window, mask_kind, sinks) == (1, 4, _ext.MASK_BOOL, 0)
    assert values[27] == 0.5


@pytest.mark.parametrize("kwargs,reason", [
    (dict(d=72), "head dims 64, 80, 96, 128 and 256"),
    (dict(d=64, dv=32), "equal"),
    (dict(d=8), "head dims"),
])
def test_unsupported_problems_say_why(kwargs, reason):
    plan = plan_for(**kwargs)
    assert not plan["supported"] and reason in plan["reason"]


def test_metal_support_reason_on_this_build():
    q = mx.zeros((1, 2, 4, 64))
    reason = _ext.unsupported_reason(_ext.describe_attention(q, q, q), device=mx.gpu)
    if _ext.has_metal():
        assert reason is None
    else:
        assert "no Metal kernels" in reason


@pytest.mark.parametrize("d", [72, 64])
def test_gpu_dispatch_falls_back_to_the_reference_path_with_the_reason(d):
    """ops asks the launch plan (through _ext) on a GPU stream: an
    unsupported head dim, or a build without Metal, takes the reference path,
    and backend='fused' names the reason."""
    q = mx.zeros((1, 2, 4, d))
    path = mlx_attn.attention_path(q, q, q, stream=mx.gpu)
    supported = _ext.has_metal() and d in (64, 80, 96, 128, 256)
    assert path == ("fused-metal" if supported else "reference")
    if not supported:
        reason = "head dims 64, 80, 96, 128 and 256" if _ext.has_metal() else "no Metal kernels"
        with pytest.raises(ValueError, match=reason):
            mlx_attn.attention_path(q, q, q, stream=mx.gpu, backend="fused")
