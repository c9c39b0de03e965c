"""The D-split Metal backward (metal/attention_backward_split.h): head dims
192/128, 256, 512 and 576/512, and the dK/dV pass at D = 128, run in the MSL
emulator from the C++ backward launch plan exactly as the Mac host encodes
it, against the analytic float64 gradients of tests/test_softcap.py
(numpy_gradients: from the softmax's definition, itself checked against
central differences there). A representative sample by default (fast math);
MLX_ATTN_FULL_GRID=1 runs every head dims x dtype x mask combination, and
the precise-math build too."""

import itertools
import os
import re

import mlx.core as mx
import numpy as np
import pytest

from kernel_lab import msl_emulator
from kernel_lab.metal_runner import EmulatedMetal, backward_launch_plan, emulated_backward
from sdpa_cases import as_float64, numpy_attention
from test_metal_backward import BACKWARD, SPLIT, make_mask, qkv, random
from test_softcap import numpy_gradients

FULL_GRID = os.environ.get("MLX_ATTN_FULL_GRID") == "1"
# Max abs gradient error relative to the largest oracle gradient (at least
# 1), as tests/test_metal_backward.py's.
GRAD_TOLERANCE = {mx.float32: 1e-4, mx.float16: 1e-2, mx.bfloat16: 6e-2}
SPLIT_DIMS = [(128, 128), (192, 128), (256, 256), (512, 512), (576, 512)]


@pytest.fixture(scope="module", params=[True, False] if FULL_GRID else [True],
                ids=lambda fast: "fast-math" if fast else "precise")
def metal(request):
    if not msl_emulator.clang_available():
        pytest.skip("the MSL emulator needs clang-19")
    return EmulatedMetal(fast_math=request.param, sources=[BACKWARD, SPLIT])


def qkv_dims(b, hq, hkv, tq, tkv, d, dv, dtype, seed=0):
    q, k, _ = qkv(b, hq, hkv, tq, tkv, d, dtype, seed)
    return q, k, random((b, hkv, tkv, dv), seed + 7).astype(dtype)


def check_against_oracle(metal, q, k, v, *, seed=3, d_lse=None, layout=None, **kw):
    """The emulated gradients against numpy_gradients in float64; the forward's
    out and lse handed to the backward are the float64 oracle's (out rounded
    to the input dtype, lse to float32, as the fused forward returns them)."""
    kw.setdefault("scale", q.shape[-1] ** -0.5)
    dtype = q.dtype
    d_out = random(q.shape[:3] + (v.shape[3],), seed).astype(dtype)
    oracle_kw = {name: value for name, value in kw.items() if value is not None}
    out, lse = numpy_attention(q, k, v, return_lse=True, **oracle_kw)
    got = emulated_backward(metal, q, k, v, mx.array(out.astype(np.float32)).astype(dtype),
                            mx.array(lse.astype(np.float32)), d_out, d_lse, layout=layout, **kw)
    want = numpy_gradients(q, k, v, d_out, d_lse=d_lse, **oracle_kw)[:4]
    for name, g, w in zip(("dq", "dk", "dv", "d_sinks"), got, want):
        if w is None:
            assert g is None, name
            continue
        assert g.dtype == dtype and g.shape == w.shape, name
        g64 = as_float64(g)
        assert np.isfinite(g64).all(), f"{name} not finite"
        err = float(np.abs(g64 - w).max()) / max(1.0, float(np.abs(w).max()))
        assert err <= GRAD_TOLERANCE[dtype], f"{name}: relative error {err} > {GRAD_TOLERANCE[dtype]} ({dtype})"
    return got


def mask_options(mask, hq, tq, tkv, dtype, seed):
    """The keywords of a mask variant (as tests/test_head_dims.py's, plus the
    softcap): causal, a window, a bool mask with a row that sees nothing, an
    additive mask with -inf entries, sinks under a causal mask, a softcap."""
    if mask == "causal":
        return {"mask": "causal"}
    if mask == "window":
        return {"window_size": 9}
    if mask == "bool":
        return {"mask": make_mask("bool", tq, tkv, seed, empty_rows=(0,))}
    if mask == "additive":
        return {"mask": make_mask("additive", tq, tkv, seed, empty_rows=(1,)).astype(dtype)}
    if mask == "sinks":
        return {"mask": "causal", "sinks": (random((hq,), seed) * 2).astype(dtype)}
    if mask == "softcap":
        return {"mask": "causal", "softcap": 1.5}
    return {}


DTYPES = [mx.float32, mx.float16, mx.bfloat16]
MASKS = [None, "causal", "window", "bool", "additive", "sinks", "softcap"]
GROUPS = [(2, 2), (4, 1)]
# (head dims, dtype, mask, (hq, hkv)): issue #22's cases (D = 256 causal fp16,
# 192/128 with a window, 512 with a softcap, GQA) and the D = 128 dK/dV pass
SAMPLE = [
    ((256, 256), mx.float16, "causal", (4, 2)),
    ((192, 128), mx.float32, "window", (4, 1)),
    ((512, 512), mx.float32, "softcap", (2, 1)),
    ((576, 512), mx.float16, "sinks", (2, 1)),
    ((128, 128), mx.float32, "bool", (4, 2)),
]
GRID = list(itertools.product(SPLIT_DIMS, DTYPES, MASKS, GROUPS)) if FULL_GRID else SAMPLE


def case_id(case) -> str:
    (d, dv), dtype, mask, (hq, hkv) = case
    return f"{d}x{dv}-{str(dtype).split('.')[-1]}-{mask}-gqa{hq // hkv}"


@pytest.mark.parametrize("case", GRID, ids=case_id)
def test_gradients_match_the_float64_oracle(metal, case):
    (d, dv), dtype, mask, (hq, hkv) = case
    # two streamed blocks each way, partial last ones, Tq < Tkv; at D >= 512
    # one partial block each way (the emulator's time grows with D)
    tq, tkv = (35, 40) if d <= 256 else (20, 28)
    q, k, v = qkv_dims(1, hq, hkv, tq, tkv, d, dv, dtype, seed=d + dv)
    if mask == "softcap":
        q = q * 3  # logits of a few units: the tanh bends
    check_against_oracle(metal, q, k, v, **mask_options(mask, hq, tq, tkv, dtype, seed=d))
    kernels = [step.kernel for step in metal.last_plan.dispatches]
    assert kernels[1].startswith("attention_backward_split_dkdv_")
    assert kernels[2].startswith("attention_backward_split_dq_" if d > 128 else "attention_backward_dq_")


def test_lse_cotangent_and_strided_inputs(metal):
    """A cotangent of the lse output joins delta; q/k/v read through [B, T, H, D]
    strides; two batches (192/128: the dQ pass has more chunks than dV)."""
    q, k, v = qkv_dims(2, 4, 2, 33, 40, 192, 128, mx.float32, seed=5)
    check_against_oracle(metal, q, k, v, mask="causal", d_lse=random((2, 4, 33), 6), layout="seq_major")


# ---------------------------------------------------------------- the plan

def plan_for(d, dv, dtype=mx.float32, hq=4, hkv=2, tq=37, tkv=53, **kw):
    q, k, v = qkv_dims(1, hq, hkv, tq, tkv, d, dv, dtype)
    return backward_launch_plan(q, k, v, scale=0.125, **kw)


@pytest.mark.parametrize("d,dv", SPLIT_DIMS)
def test_plan_routes_the_split_family(d, dv):
    plan = plan_for(d, dv, mask="causal")
    assert plan.supported, plan.reason
    delta, dkdv, dq = plan.dispatches
    assert delta.kernel == f"attention_backward_delta_float32_d{dv}"  # rows of out and dO
    assert dkdv.kernel == f"attention_backward_split_dkdv_float32_d{d}_dv{dv}_bk32"
    # one threadgroup per (block of 32 keys, chunk of 64 dK / dV columns)
    assert dkdv.grid == [2 * max(d, dv) // 64, 2, 1]
    if d == 128:  # the dQ pass stays register-resident at D = 128
        assert dq.kernel == "attention_backward_dq_float32_d128" and dq.grid == [2, 4, 1]
    else:
        assert dq.kernel == f"attention_backward_split_dq_float32_d{d}_dv{dv}_bk32"
        assert dq.grid == [2 * d // 64, 4, 1]


@pytest.mark.parametrize("d,dv", SPLIT_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_plan_threadgroup_memory_fits(d, dv, dtype):
    for step in plan_for(d, dv, dtype=dtype, sinks=mx.zeros((4,), dtype)).dispatches:
        assert step.threadgroup_memory_bytes <= 32 * 1024


def test_plan_keeps_the_reason_for_unsupported_dims():
    for d, dv in ((64, 128), (128, 64), (320, 320)):
        plan = plan_for(d, dv)
        assert not plan.supported and f"got {d}/{dv}" in plan.reason


def test_each_split_kernel_compiles_alone(tmp_path):
    """Per-variant first use (csrc/metal/metal_sources.cpp kVariantFamilies):
    a split kernel's source is its family's text with the instantiation lines
    dropped and its own one appended; those two sources alone (beside the
    register-resident family's delta) define the plan's kernels and give the
    oracle's gradients."""
    from mlx_attn import _ext

    q, k, v = qkv_dims(1, 4, 2, 35, 40, 192, 128, mx.float32, seed=9)
    plan = backward_launch_plan(q, k, v, scale=192 ** -0.5, mask="causal")
    family = _ext.metal_kernel_source("attention_backward_split")
    sources = [BACKWARD]
    for step in plan.dispatches[1:]:
        text = _ext.metal_variant_source(step.kernel)
        assert text and len(text) < len(family)
        instantiations = re.findall(r"^MLX_ATTN_[A-Z0-9_]+\(.*\)$", text, flags=re.M)
        assert len(instantiations) == 1 and "float32, float, 192, 128, 32)" in instantiations[0]
        sources.append(tmp_path / f"{step.kernel}.metal")
        sources[-1].write_text(text)
    metal = EmulatedMetal(fast_math=True, sources=sources)
    split_kernels = {name for name in metal.library.kernel_names if name.startswith("attention_backward_split_")}
    assert split_kernels == {step.kernel for step in plan.dispatches[1:]}
    check_against_oracle(metal, q, k, v, mask="causal")
