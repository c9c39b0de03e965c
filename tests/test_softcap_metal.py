"""``softcap=`` in the Metal kernels (prefill, decode, quantized K/V and the
backward), run in the MSL emulator from the same C++ launch plans as on a
Mac, against float64 NumPy (tests/sdpa_cases.py numpy_attention; the
analytic gradients of tests/test_softcap.py). The libraries are the ones
the other Metal tests compile (nothing new to build). A representative
sample in fast math (what Metal compiles with) by default;
MLX_ATTN_FULL_GRID=1 runs every dtype x mask x phase, in precise and fast
math."""

import itertools
import os

import mlx.core as mx
import numpy as np
import pytest

from kernel_lab import msl_emulator
from kernel_lab.metal_runner import REAL_METAL, REPO, EmulatedMetal, emulated_backward, reference_lse
from sdpa_cases import TOLERANCE, make_qkv, numpy_attention
from test_softcap import numpy_gradients

pytestmark = pytest.mark.skipif(
    REAL_METAL or not msl_emulator.clang_available(),
    reason="runs the emulated kernels (clang-19); on a Mac the public op's tests cover the real ones")

FULL_GRID = os.environ.get("MLX_ATTN_FULL_GRID") == "1"
MODES = [False, True] if FULL_GRID else [True]
CAP = 1.3  # logits of a few units (q scaled by 3): the tanh bends


@pytest.fixture(scope="module", params=MODES, ids=lambda fast: "fast-math" if fast else "precise")
def metal(request):
    return EmulatedMetal(fast_math=request.param)


DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
MASKS = ["causal", "window", "bool", "additive", "sinks"]
PHASES = {"prefill": 37, "decode": 3}
SAMPLE = [
    ("float32", "causal", "prefill"),
    ("float16", "additive", "prefill"),
    ("bfloat16", "sinks", "decode"),
    ("float32", "bool", "decode"),
    ("float16", "window", "decode"),
]
GRID = list(itertools.product(DTYPES, MASKS, PHASES)) if FULL_GRID else SAMPLE


def options(mask: str, tq: int, tkv: int, hq: int, dtype, rng) -> dict:
    kw = {}
    if mask == "window":
        kw["window_size"] = 9
    elif mask == "bool":
        visible = rng.random((tq, tkv)) > 0.3
        visible[0] = False  # a row that sees nothing
        kw["mask"] = mx.array(visible)
    elif mask == "additive":
        added = rng.standard_normal((tq, tkv)).astype(np.float32) * 2
        added[:, ::7] = -np.inf
        kw["mask"] = mx.array(added).astype(dtype)
    elif mask == "sinks":
        kw["mask"] = "causal"
        kw["sinks"] = mx.array(rng.standard_normal(hq).astype(np.float32) * 2).astype(dtype)
    else:
        kw["mask"] = mask
    return kw


@pytest.mark.parametrize("dtype,mask,phase", GRID, ids=lambda x: str(x))
def test_forward_kernels_match_float64(metal, dtype, mask, phase):
    """Prefill and decode kernels (GQA), output and row log-sum-exp over the
    capped logits."""
    dtype = DTYPES[dtype]
    tq, tkv, hq, d = PHASES[phase], 90, 4, 64
    q, k, v = make_qkv(1, hq, 2, tq, tkv, d, dtype=dtype, seed=tq)
    q = (q.astype(mx.float32) * 3).astype(dtype)
    kw = {"scale": d**-0.5, **options(mask, tq, tkv, hq, dtype, np.random.default_rng(tq))}
    out, lse = metal(q, k, v, softcap=CAP, return_lse=True, **kw)
    assert phase in metal.last_plan.dispatches[0].kernel
    want = numpy_attention(q, k, v, softcap=CAP, **kw)
    got = np.array(out.astype(mx.float32), np.float64)
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() <= TOLERANCE[dtype]
    want_lse = reference_lse(q, k, v, softcap=CAP, **kw)
    got_lse = np.array(lse, np.float64)
    assert np.array_equal(np.isneginf(got_lse), np.isneginf(want_lse))
    finite = np.isfinite(want_lse)
    assert np.abs(got_lse[finite] - want_lse[finite]).max() <= 1e-4 * max(1.0, np.abs(want_lse[finite]).max())


def test_saturated_logits_stay_finite_under_the_cap(metal):
    """A scale that overflows q.k: every logit saturates, then is +-cap."""
    for tq in (35, 2):
        q, k, v = make_qkv(1, 4, 2, tq, 50, 64, seed=1)
        out = metal(q, k, v, scale=float(np.finfo(np.float32).max), softcap=2.0, mask="causal")
        want = numpy_attention(q, k, v, scale=1e300, softcap=2.0, mask="causal")
        assert np.abs(np.array(out, np.float64) - want).max() <= TOLERANCE[mx.float32]


# 8 positions x GQA 2: the most query rows the quantized decode kernel takes
# (longer ones: the quantized prefill kernel, tests/test_quantized_prefill_metal.py)
@pytest.mark.parametrize("tq", [1, 8], ids=["decode", "rows"])
def test_quantized_kernel_matches_float64(metal, tq):
    bits, group_size = (4, 32) if tq == 1 else (8, 64)
    q, k, v = make_qkv(1, 4, 2, tq, 150, 64, seed=tq)
    q = q * 3
    k_quant, v_quant = (tuple(mx.quantize(x, group_size=group_size, bits=bits)) for x in (k, v))
    k_plain, v_plain = (mx.dequantize(*t, group_size=group_size, bits=bits) for t in (k_quant, v_quant))
    sinks = mx.array([0.5, -1.0, 2.0, 0.0])
    kw = dict(scale=0.125, mask="causal", sinks=sinks)
    out = metal.quantized(q, k_quant, v_quant, bits=bits, group_size=group_size, softcap=CAP, **kw)
    want = numpy_attention(q, k_plain, v_plain, softcap=CAP, **kw)
    assert np.abs(np.array(out, np.float64) - want).max() <= TOLERANCE[mx.float32]


BACKWARD_GRID = (list(itertools.product(DTYPES, ["causal", "additive", "sinks", "window"])) if FULL_GRID
                 else [("float32", "sinks"), ("float32", "additive"), ("bfloat16", "window")])
GRAD_TOLERANCE = {mx.float32: 1e-4, mx.float16: 1e-2, mx.bfloat16: 6e-2}


@pytest.fixture(scope="module", params=MODES, ids=lambda fast: "fast-math" if fast else "precise")
def backward_metal(request):
    return EmulatedMetal(fast_math=request.param, sources=[REPO / "metal" / "attention_backward.metal"])


@pytest.mark.parametrize("dtype,mask", BACKWARD_GRID, ids=lambda x: str(x))
def test_backward_kernels_match_float64(backward_metal, dtype, mask):
    """dq, dk, dv (and d_sinks) of the Metal backward against the analytic
    float64 gradients, through the tanh (1 - tanh^2), with an lse cotangent."""
    dtype = DTYPES[dtype]
    tq, tkv, hq, d = 37, 53, 4, 64
    q, k, v = make_qkv(2, hq, 2, tq, tkv, d, dtype=dtype, seed=5)
    q = (q.astype(mx.float32) * 3).astype(dtype)
    rng = np.random.default_rng(6)
    kw = {"scale": d**-0.5, **options(mask, tq, tkv, hq, dtype, rng)}
    d_out = mx.array(rng.standard_normal((2, hq, tq, d)).astype(np.float32)).astype(dtype)
    d_lse = mx.array(rng.standard_normal((2, hq, tq)).astype(np.float32))
    out, lse = numpy_attention(q, k, v, softcap=CAP, return_lse=True, **kw)
    got = emulated_backward(backward_metal, q, k, v, mx.array(out.astype(np.float32)).astype(dtype),
                            mx.array(lse.astype(np.float32)), d_out, d_lse, softcap=CAP, **kw)
    want = numpy_gradients(q, k, v, d_out, softcap=CAP, d_lse=d_lse, **kw)
    for name, g, w in zip(("dq", "dk", "dv", "d_sinks"), got, want):
        if w is None:
            assert g is None
            continue
        g = np.array(g.astype(mx.float32), np.float64)
        assert np.isfinite(g).all(), name
        err = np.abs(g - w).max() / max(1.0, np.abs(w).max())
        assert err <= GRAD_TOLERANCE[dtype], f"{name}: relative error {err}"
