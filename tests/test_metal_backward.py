"""The fused Metal backward kernels (metal/attention_backward.metal) against
the reference path's gradients (mx.vjp of mlx_attn.reference), run in the MSL
emulator (precise and fast math) from the C++ backward launch plan exactly as
the Mac host encodes it. A representative sample by default;
MLX_ATTN_FULL_GRID=1 runs every dtype x head dim x mask x GQA combination."""

import itertools
import os
import re

import mlx.core as mx
import numpy as np
import pytest

from kernel_lab import msl_emulator
from kernel_lab.metal_runner import REAL_METAL, REPO, EmulatedMetal, View, backward_launch_plan, emulated_backward
from mlx_attn.reference import reference_attention

FULL_GRID = os.environ.get("MLX_ATTN_FULL_GRID") == "1"
BACKWARD = REPO / "metal" / "attention_backward.metal"
# the D-split family (the dK/dV pass at D = 128, every pass past it):
# tests/test_metal_backward_split.py
SPLIT = REPO / "metal" / "attention_backward_split.metal"
# Max abs gradient error relative to the largest reference gradient (as
# tests/test_backward.py): float32 accumulation order; float16/bfloat16
# inputs, output and cotangent rounded once each.
GRAD_TOLERANCE = {mx.float32: 1e-4, mx.float16: 1e-2, mx.bfloat16: 6e-2}


def split_only(text: str, instantiations: str) -> str:
    """The D-split family's source `text` with only `instantiations` (lines
    of its macros): a smaller emulator build."""
    return re.sub(r"^MLX_ATTN_BACKWARD_SPLIT(_DKDV)?_TYPES\(.*\)$", "", text, flags=re.M) + "\n" + instantiations + "\n"


@pytest.fixture(scope="module", params=[False, True], ids=["precise", "fast-math"])
def metal(request, tmp_path_factory):
    if not msl_emulator.clang_available():
        pytest.skip("the MSL emulator needs clang-19")
    split = SPLIT  # fast math: the whole family (the build tests/test_metal_backward_split.py shares)
    if not request.param:  # precise: the D = 128 dK/dV pass these tests reach
        split = tmp_path_factory.mktemp("precise_split") / SPLIT.name
        split.write_text(split_only(SPLIT.read_text(), "MLX_ATTN_BACKWARD_SPLIT_DKDV_TYPES(128, 128)"))
    return EmulatedMetal(fast_math=request.param, sources=[BACKWARD, split])


def random(shape, seed, scale=1.0):
    return mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * scale)


def make_mask(kind, tq, tkv, seed, empty_rows=()):
    """"causal", None, or a [Tq, Tkv] bool / additive (float32) mask whose
    `empty_rows` see nothing."""
    if kind in (None, "causal"):
        return kind
    rng = np.random.default_rng(seed)
    if kind == "bool":
        visible = rng.random((tq, tkv)) > 0.4
        visible[list(empty_rows)] = False
        return mx.array(visible)
    additive = rng.standard_normal((tq, tkv)).astype(np.float32)
    additive[list(empty_rows)] = -np.inf
    return mx.array(additive)


def reference_gradients(q, k, v, d_out, d_lse=None, *, sinks=None, **kw):
    """(out, lse) of the reference path in float32 from the float32 values of
    the inputs, and the gradients (dq, dk, dv[, d_sinks]) of
    sum(out * d_out) + sum(lse * d_lse) by mx.vjp."""
    if isinstance(sinks, View):
        sinks = sinks.array
    primals = [x.astype(mx.float32) for x in (q, k, v)] + ([sinks.astype(mx.float32)] if sinks is not None else [])
    mask = kw.get("mask")
    if isinstance(mask, mx.array) and mask.dtype != mx.bool_:
        kw = {**kw, "mask": mask.astype(mx.float32)}

    def attend(*args):  # the lse joins only with a cotangent: log(0) of an empty row has no derivative
        results = reference_attention(*args[:3], sinks=args[3] if len(args) > 3 else None,
                                      return_lse=d_lse is not None, **kw)
        return list(results) if d_lse is not None else [results]

    out, lse = reference_attention(*primals[:3], sinks=primals[3] if sinks is not None else None, return_lse=True, **kw)
    cotangent = [d_out.astype(mx.float32)] + ([d_lse] if d_lse is not None else [])
    _, grads = mx.vjp(attend, primals, cotangent)
    return out, lse, grads


def check(metal, q, k, v, *, sinks=None, d_lse=None, layout=None, seed=7, **kw):
    kw.setdefault("scale", q.shape[-1] ** -0.5)
    dtype = q.dtype
    d_out = random(q.shape[:3] + (v.shape[3],), seed).astype(dtype)
    out, lse, want = reference_gradients(q, k, v, d_out, d_lse, sinks=sinks, **kw)
    got = emulated_backward(metal, q, k, v, out.astype(dtype), lse, d_out, d_lse, sinks=sinks, layout=layout, **kw)
    names = ("q", "k", "v", "sinks")
    for name, g, w in zip(names, got, want):
        assert g.dtype == dtype and g.shape == w.shape, name
        g64 = np.array(g.astype(mx.float32)).astype(np.float64)
        w64 = np.array(w).astype(np.float64)
        assert np.isfinite(g64).all(), f"d/d{name} not finite"
        err = float(np.abs(g64 - w64).max()) / max(1.0, float(np.abs(w64).max()))
        assert err <= GRAD_TOLERANCE[dtype], f"d/d{name}: relative error {err} > {GRAD_TOLERANCE[dtype]}"
    if sinks is None:
        assert got[3] is None
    return got


def qkv(b, hq, hkv, tq, tkv, d, dtype, seed=0):
    return tuple(random(s, seed + i).astype(dtype) for i, s in
                 enumerate(((b, hq, tq, d), (b, hkv, tkv, d), (b, hkv, tkv, d))))


# (dtype, head dim, mask, (hq, hkv)): the default sample covers every value
# of each axis at least once; the full grid every combination.
DTYPES = [mx.float32, mx.float16, mx.bfloat16]
HEAD_DIMS = [64, 80, 96, 128]
MASKS = [None, "causal", "bool", "additive", "window", "sinks"]
GROUPS = [(2, 2), (4, 2), (4, 1)]
SAMPLE = [
    (mx.float32, 64, "causal", (4, 2)),
    (mx.float32, 64, None, (2, 2)),
    (mx.float16, 80, "bool", (4, 1)),
    (mx.bfloat16, 128, "additive", (4, 2)),
    (mx.float16, 96, "window", (2, 2)),
    (mx.float32, 128, "sinks", (4, 1)),
]
GRID = list(itertools.product(DTYPES, HEAD_DIMS, MASKS, GROUPS)) if FULL_GRID else SAMPLE


@pytest.mark.parametrize("dtype,d,mask,heads", GRID, ids=lambda x: str(x).replace("mlx.core.", ""))
def test_gradients_match_the_reference(metal, dtype, d, mask, heads):
    hq, hkv = heads
    tq, tkv = 37, 53  # several key and query blocks, partial last ones, Tq < Tkv
    q, k, v = qkv(2, hq, hkv, tq, tkv, d, dtype, seed=d)
    kw = {}
    if mask == "window":
        kw["window_size"] = 9
    elif mask == "sinks":
        kw["sinks"] = (random((hq,), 3) * 2).astype(dtype)
        kw["mask"] = "causal"
    else:
        m = make_mask(mask, tq, tkv, seed=d)
        kw["mask"] = m if not isinstance(m, mx.array) or m.dtype == mx.bool_ else m.astype(dtype)
    check(metal, q, k, v, **kw)


@pytest.mark.parametrize("hq,hkv", GROUPS)
def test_gqa_sums_dk_dv_over_the_group(metal, hq, hkv):
    """K/V heads shared by 1, 2 and 4 query heads: dK/dV sum over them."""
    check(metal, *qkv(1, hq, hkv, 40, 45, 64, mx.float32, seed=hq), mask="causal")


def test_fully_masked_rows_give_zero_gradients(metal):
    tq, tkv = 35, 60
    q, k, v = qkv(1, 4, 2, tq, tkv, 64, mx.float32)
    empty = (0, 9, 34)
    for kind in ("bool", "additive"):
        dq, *_ = check(metal, q, k, v, mask=make_mask(kind, tq, tkv, seed=1, empty_rows=empty))
        assert np.all(np.array(dq)[:, :, list(empty)] == 0)
    # a row that sees only its sink: no dQ, but the sink still has a gradient
    sinks = mx.array([0.5, -1.0, 3.0, 0.0])
    dq, _, _, d_sinks = check(metal, q, k, v, mask=make_mask("bool", tq, tkv, seed=2, empty_rows=empty), sinks=sinks)
    assert np.all(np.array(dq)[:, :, list(empty)] == 0) and np.all(np.array(d_sinks) != 0)
    # more queries than keys under a causal mask: the first 32 rows see nothing
    q, k, v = qkv(1, 2, 2, 40, 8, 64, mx.float32)
    dq, *_ = check(metal, q, k, v, mask="causal")
    assert np.all(np.array(dq)[:, :, :32] == 0)


def test_window_bounds(metal):
    q, k, v = qkv(1, 2, 1, 40, 70, 64, mx.float32, seed=5)
    for window in (1, 7, 33):
        check(metal, q, k, v, window_size=window)


def test_lse_cotangent_joins_delta(metal):
    """A cotangent of the lse output (return_lse) enters delta = rowsum(dO * O) - dlse."""
    q, k, v = qkv(1, 4, 2, 33, 40, 64, mx.float32, seed=3)
    d_lse = random((1, 4, 33), 9)
    check(metal, q, k, v, mask="causal", d_lse=d_lse, sinks=mx.array([0.5, -1.0, 2.0, 0.0]))


@pytest.mark.parametrize("layout", ["seq_major", "cache"])
def test_strided_inputs(metal, layout):
    """q/k/v read through their strides: [B, T, H, D] storage or the first Tkv
    rows of a longer cache; sinks through a strided view."""
    q, k, v = qkv(2, 4, 2, 30, 45, 64, mx.float16, seed=11)
    base = mx.array(np.linspace(-2.0, 3.0, 9).astype(np.float32)).astype(mx.float16)
    sinks = View(base, lambda a: a[:8:2])
    check(metal, q, k, v, mask="causal", layout=layout, sinks=sinks)


def test_large_and_degenerate_scales(metal):
    """A zero or negative scale, and logits in the thousands (P = exp(S - lse)
    differences far beyond exp's range: no overflow, no NaN). Logits that
    saturate at 2^125 are not compared: a float32 lse that large has lost
    log(row sum), for the CPU backward too (docs/metal_kernels.md)."""
    q, k, v = qkv(1, 2, 1, 20, 40, 64, mx.float32, seed=2)
    for scale in (0.0, -0.3, 40.0):
        check(metal, q, k, v, scale=scale, mask="causal", sinks=mx.array([30.0, -2.0]))


# ---------------------------------------------------------------- the plan

def plan_for(d=64, dtype=mx.float32, hq=4, hkv=2, tq=37, tkv=53, **kw):
    q, k, v = qkv(1, hq, hkv, tq, tkv, d, dtype)
    return backward_launch_plan(q, k, v, scale=0.125, **kw)


def test_plan_dispatches_and_bindings():
    plan = plan_for(mask=mx.array(np.ones((37, 53), bool)), sinks=mx.zeros((4,)))
    assert plan.supported, plan.reason
    kinds = ["attention_backward_delta_float32_d64", "attention_backward_dkdv_float32_d64_mask_bool",
             "attention_backward_dq_float32_d64_mask_bool", "attention_backward_sinks_float32"]
    assert [step.kernel for step in plan.dispatches] == kinds
    assert [(s.role, s.elements, s.producer, s.consumer) for s in plan.scratch] == [("delta", 4 * 37, 0, 3)]
    delta, dkdv, dq, sinks = plan.dispatches
    assert dkdv.grid == [2, 2, 1] and dq.grid == [2, 4, 1] and sinks.grid == [4, 1, 1]
    # inputs: q k v mask sinks | out lse d_out d_lse; outputs: dq dk dv d_sinks
    where = {b.role: (b.source, b.source_index, b.access) for step in plan.dispatches
             for b in step.bindings if b.source != "scratch" or b.access == "write"}
    assert where == {
        "q": ("input", 0, "read"), "k": ("input", 1, "read"), "v": ("input", 2, "read"),
        "mask": ("input", 3, "read"), "sinks": ("input", 4, "read"), "out": ("input", 5, "read"),
        "lse": ("input", 6, "read"), "d_out": ("input", 7, "read"), "d_lse": ("input", 8, "read"),
        "dq": ("output", 0, "write"), "dk": ("output", 1, "write"), "dv": ("output", 2, "write"),
        "d_sinks": ("output", 3, "write"), "delta": ("scratch", 0, "write"), "params": ("params", 0, "read"),
    }
    for step in plan.dispatches:
        assert [b.index for b in step.bindings] == list(range(len(step.bindings)))
    plain = plan_for()
    assert len(plain.dispatches) == 3 and plain.scratch[0].consumer == 2
    mask_binding = [b for b in plain.dispatches[1].bindings if b.role == "mask"][0]
    assert (mask_binding.source, mask_binding.source_index) == ("input", 0)  # placeholder: q


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_plan_threadgroup_memory_fits(d, dtype):
    """Every kernel's tiles fit 32 KiB; the emulator checks the kernels' own
    declarations against the same limit, the plan says what the host reserves."""
    for step in plan_for(d=d, dtype=dtype).dispatches:
        assert step.threadgroup_memory_bytes <= 32 * 1024


def test_plan_refuses_with_a_reason():
    assert plan_for(d=256).supported  # the D-split family's (tests/test_metal_backward_split.py)
    assert not plan_for(d=32).supported and "32" in plan_for(d=32).reason
    assert "empty" in plan_for(tq=0).reason
    q, k = qkv(1, 2, 2, 8, 8, 64, mx.float32)[:2]
    v = random((1, 2, 8, 128), 0)
    reason = backward_launch_plan(q, k, v, scale=1.0).reason
    assert "head dims (key/value)" in reason and "got 64/128" in reason  # names the unequal pair


@pytest.mark.skipif(not REAL_METAL, reason="needs an Apple GPU: the Metal backward runs for real only on a Mac")
@pytest.mark.parametrize("mask", [None, "causal"])
def test_gpu_grad_through_the_public_api(mask):
    """On a Mac, mx.grad through scaled_dot_product_attention on the GPU uses
    the fused forward and the Metal backward; its gradients match the
    reference path's autodiff."""
    import mlx_attn

    q, k, v = qkv(1, 4, 2, 70, 90, 64, mx.float32, seed=1)
    weights = random((1, 4, 70, 64), 2)

    def loss(backend):
        def f(q, k, v):
            out = mlx_attn.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask, backend=backend, stream=mx.gpu)
            return (out * weights).sum()
        return f

    got = mx.grad(loss("fused"), argnums=(0, 1, 2))(q, k, v)
    want = mx.grad(loss("reference"), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want):
        assert np.abs(np.array(g) - np.array(w)).max() <= 1e-4 * max(1.0, float(np.abs(np.array(w)).max()))
