"""Large and unequal head dims (key dim D, value dim Dv: 64, 192/128, 256,
512, 576/512 as in absorbed MLA) on the fused CPU kernel (forward and
backward) and in the Metal kernels run by the MSL emulator (the D-split
prefill kernel, metal/attention_prefill_split.h, and decode at D = 256 and
512), against a float64 NumPy oracle and mx.fast; and the reasons
``attention_path(..., explain=True)`` gives for every unfused route.

A representative sample runs by default; MLX_ATTN_FULL_GRID=1 runs every
(dims, dtype, mask) combination and the precise-math emulator build too."""

from __future__ import annotations

import itertools
import os

import mlx.core as mx
import numpy as np
import pytest

import mlx_attn
from kernel_lab import msl_emulator
from kernel_lab.metal_runner import REPO, EmulatedMetal
from mlx_attn import _native, ops
from mlx_attn.metal_support import launch_plan
from sdpa_cases import DTYPES, TOLERANCE, as_float64, make_qkv, numpy_attention

FULL_GRID = os.environ.get("MLX_ATTN_FULL_GRID") == "1"

# (key head dim, value head dim)
DIMS = [(64, 64), (192, 128), (256, 256), (512, 512), (576, 512)]
MASKS = ["none", "causal", "window", "bool", "additive", "sinks"]

# Gradient error relative to the largest oracle gradient (tests/test_backward.py's).
GRAD_TOLERANCE = {mx.float32: 1e-4, mx.float16: 1e-2, mx.bfloat16: 6e-2}


def sampled(grid: list, masks=MASKS) -> list:
    """Every combination under MLX_ATTN_FULL_GRID=1, else a representative
    sample: each (dims, dtype) pair once, the mask variants `masks` rotating
    so each appears."""
    if FULL_GRID:
        return grid
    sample = []
    for key in dict.fromkeys(case[:2] for case in grid):
        mask = masks[len(sample) % len(masks)]
        sample.append((*key, mask))
    return sample


def case_grid(dims, masks=MASKS):
    return sampled([(d, dtype, mask) for d in dims for dtype in DTYPES for mask in masks], masks)


def case_id(case) -> str:
    (d, dv), dtype, mask = case
    return f"{d}x{dv}-{str(dtype).split('.')[-1]}-{mask}"


def options(mask: str, q_heads: int, tq: int, tkv: int, dtype, seed: int = 0) -> dict:
    """The keywords of a mask variant: a causal mask, a sliding window, a
    random bool mask (a row that sees nothing included), an additive mask
    with -inf entries, or sinks (some above every logit)."""
    rng = np.random.default_rng(seed)
    if mask == "causal":
        return {"mask": "causal"}
    if mask == "window":
        return {"window_size": 9}
    if mask == "bool":
        visible = rng.random((tq, tkv)) > 0.4
        visible[0] = False
        return {"mask": mx.array(visible)}
    if mask == "additive":
        added = rng.standard_normal((tq, tkv)).astype(np.float32)
        added[1, ::3] = -np.inf
        return {"mask": mx.array(added).astype(dtype)}
    if mask == "sinks":
        return {"sinks": mx.array(rng.standard_normal(q_heads).astype(np.float32) * 3).astype(dtype)}
    return {}


def assert_matches_oracle(got, q, k, v, dtype, **kw):
    want = numpy_attention(q, k, v, **kw)
    got = as_float64(got)
    assert got.shape == want.shape
    assert np.isfinite(got).all()
    err = np.abs(got - want).max()
    assert err <= TOLERANCE[dtype], f"max error {err} > {TOLERANCE[dtype]} ({dtype})"


# ---------------------------------------------------------------- fused CPU
@pytest.mark.parametrize("case", case_grid(DIMS), ids=case_id)
def test_cpu_forward_matches_float64_oracle(case):
    (d, dv), dtype, mask = case
    hq, tq, tkv = 4, 11, 70  # GQA 2; two key blocks of the CPU kernel
    q, k, v = make_qkv(1, hq, 2, tq, tkv, d, dv, dtype=dtype, seed=d + dv)
    kw = {"scale": d ** -0.5, **options(mask, hq, tq, tkv, dtype)}
    assert mlx_attn.attention_path(q, k, v, **kw, stream=mx.cpu) == "fused-cpu"
    out = mlx_attn.scaled_dot_product_attention(q, k, v, **kw, backend="fused", stream=mx.cpu)
    assert out.shape == (1, hq, tq, dv) and out.dtype == dtype
    assert_matches_oracle(out, q, k, v, dtype, **kw)


@pytest.mark.parametrize("d,dv", DIMS[1:])
def test_cpu_forward_matches_mx_fast(d, dv):
    q, k, v = make_qkv(2, 4, 1, 9, 40, d, dv, dtype=mx.float32, seed=3)
    ours = mlx_attn.scaled_dot_product_attention(q, k, v, scale=d ** -0.5, mask="causal", backend="fused",
                                                 stream=mx.cpu)
    theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=d ** -0.5, mask="causal", stream=mx.cpu)
    assert np.abs(np.array(ours) - np.array(theirs)).max() <= TOLERANCE[mx.float32]


def numpy_attention_gradients(q, k, v, d_out, *, scale, mask=None, sinks=None, window_size=None):
    """d (sum(out * d_out)) / d (q, k, v) in float64, from the softmax's
    definition (no shared code with mlx_attn): dV = P^T dO, dP = dO V^T,
    dS = P (dP - rowsum(dO * O)), dQ = scale dS K, dK = scale dS^T Q, summed
    over each K/V head's query heads. Rows that see nothing have P = 0."""
    q64, k64, v64, do64 = (as_float64(x) for x in (q, k, v, d_out))
    group = q64.shape[1] // k64.shape[1]
    kr, vr = np.repeat(k64, group, axis=1), np.repeat(v64, group, axis=1)
    out, lse = numpy_attention(q, k, v, scale=scale, mask=mask, sinks=sinks, window_size=window_size,
                               return_lse=True)
    logits = scale * np.einsum("bhqd,bhkd->bhqk", q64, kr)
    tq, tkv = q64.shape[2], k64.shape[2]
    visible = np.ones(logits.shape, bool)
    if isinstance(mask, str) or window_size is not None:
        pos = np.arange(tq)[:, None] + tkv - tq
        keys = np.arange(tkv)[None, :]
        visible &= (keys <= pos) & ((keys > pos - window_size) if window_size else True)
    with np.errstate(invalid="ignore"):
        probs = np.where(visible & np.isfinite(lse)[..., None], np.exp(logits - lse[..., None]), 0.0)
    d_v = np.einsum("bhqk,bhqd->bhkd", probs, do64)
    d_p = np.einsum("bhqd,bhkd->bhqk", do64, vr)
    d_s = probs * (d_p - (do64 * out).sum(-1, keepdims=True))
    d_q = scale * np.einsum("bhqk,bhkd->bhqd", d_s, kr)
    d_k = scale * np.einsum("bhqk,bhqd->bhkd", d_s, q64)
    fold = lambda x: x.reshape(x.shape[0], -1, group, *x.shape[2:]).sum(2)  # noqa: E731
    return d_q, fold(d_k), fold(d_v)


BACKWARD_CASES = case_grid(DIMS, ("none", "causal", "window", "sinks"))


@pytest.mark.parametrize("case", BACKWARD_CASES, ids=case_id)
def test_cpu_backward_matches_float64_oracle(case):
    (d, dv), dtype, mask = case
    hq, tq, tkv = 4, 10, 70
    q, k, v = make_qkv(1, hq, 2, tq, tkv, d, dv, dtype=dtype, seed=d)
    d_out = mx.array(np.random.default_rng(5).standard_normal((1, hq, tq, dv)).astype(np.float32)).astype(dtype)
    kw = {"scale": d ** -0.5, **options(mask, hq, tq, tkv, dtype)}

    def attend(q, k, v):
        return mlx_attn.scaled_dot_product_attention(q, k, v, **kw, backend="fused", stream=mx.cpu)

    _, grads = mx.vjp(attend, [q, k, v], [d_out])
    mx.eval(grads)
    wants = numpy_attention_gradients(q, k, v, d_out, **kw)
    for name, got, want in zip(("dq", "dk", "dv"), grads, wants):
        assert got.shape == want.shape, name
        err = np.abs(as_float64(got) - want).max() / np.abs(want).max()
        assert err <= GRAD_TOLERANCE[dtype], f"{name}: relative error {err} ({dtype})"


def test_bf16_tiny_products_with_a_huge_scale_at_large_head_dims():
    """bf16 at D = 576, q and k near 2^-64 (products below float32's normal
    range, which bf16 dot products flush) and a scale near 2^123: the
    CPU kernel moves a power of two of the scale into the bf16 Q panel
    (csrc/cpu/kernel_impl.h), bounded so that no q.k of D terms can overflow;
    the logits are the oracle's."""
    q, k, v = make_qkv(1, 2, 1, 3, 20, 576, 512, dtype=mx.float32, seed=4)
    q, k, v = (q * 2.0 ** -64).astype(mx.bfloat16), (k * 2.0 ** -64).astype(mx.bfloat16), v.astype(mx.bfloat16)
    scale = 2.0 ** 128 / 24
    out = mlx_attn.scaled_dot_product_attention(q, k, v, scale=scale, backend="fused", stream=mx.cpu)
    assert_matches_oracle(out, q, k, v, mx.bfloat16, scale=scale)


# ------------------------------------------------------------ attention_path
def explain(q, k, v, **kw):
    return mlx_attn.attention_path(q, k, v, **kw, explain=True)


def test_explain_on_a_fused_path_has_no_reason():
    q, k, v = make_qkv(1, 2, 1, 4, 8, 576, 512)
    choice = explain(q, k, v, scale=0.1, stream=mx.cpu)
    assert choice == ("fused-cpu", None) and choice.path == "fused-cpu" and choice.reason is None
    assert mlx_attn.attention_path(q, k, v, scale=0.1, stream=mx.cpu) == "fused-cpu"


def test_explain_names_the_cpu_head_dim_limit():
    q, k, v = make_qkv(1, 1, 1, 2, 3, 1025, 8)
    path, reason = explain(q, k, v, scale=0.1, stream=mx.cpu)
    assert path == "reference"
    assert "head dims 1..1024" in reason and "D=1025" in reason
    with pytest.raises(ValueError, match="head dims 1..1024"):
        mlx_attn.attention_path(q, k, v, scale=0.1, stream=mx.cpu, backend="fused")


def test_explain_names_backend_reference():
    q, k, v = make_qkv(1, 1, 1, 2, 3, 8)
    assert explain(q, k, v, backend="reference", stream=mx.cpu) == ("reference", "backend='reference'")


def test_explain_names_a_missing_extension(monkeypatch):
    """As in a source tree that was never built (mlx_attn/_native.py)."""
    monkeypatch.setattr(_native, "ext", None)
    monkeypatch.setattr(_native, "MISSING_REASON", "the native extension mlx_attn._ext is not built (test)")
    monkeypatch.setattr(_native, "warn_if_missing", lambda: None)
    q, k, v = make_qkv(1, 1, 1, 2, 3, 8)
    assert explain(q, k, v, stream=mx.cpu) == ("reference", "the native extension mlx_attn._ext is not built (test)")


@pytest.mark.skipif(_native.ext is not None and _native.ext.has_metal(), reason="asks a build without Metal")
def test_explain_names_a_build_without_metal():
    """On the GPU with a build that has no Metal kernels: MLX's own fused
    kernel where it computes the contract, else the reference path; both say
    why the fused kernel does not run."""
    q, k, v = make_qkv(1, 1, 1, 2, 3, 64)
    for kw, path in (({}, "mlx-fast"), ({"window_size": 2}, "reference")):
        choice = explain(q, k, v, **kw, stream=mx.gpu)
        assert choice.path == path and "no Metal kernels" in choice.reason


def test_explain_names_a_failed_self_check(monkeypatch):
    """A GPU variant whose self-check failed falls back, naming the variant."""
    class Planned:  # the extension's answers for a GPU that takes the problem
        def __getattr__(self, name):
            return getattr(real, name)

        def attention_support(self, q, k, v, *, device, **kwargs):
            support = real.attention_support(q, k, v, device=mx.cpu, **kwargs)
            phase = real.metal_launch_plan(support["problem"]).dispatches[0].id.phase
            return {**support, "reason": None, "phase": phase, "backward_supported": False}

    real = _native.ext
    monkeypatch.setattr(_native, "ext", Planned())
    monkeypatch.setattr(ops.self_check, "trusted", lambda variant, runner: False)
    q, k, v = make_qkv(1, 1, 1, 40, 50, 64)
    path, reason = explain(q, k, v, window_size=4, stream=mx.gpu)
    assert path == "reference" and "failed its self-check" in reason and "prefill" in reason


def test_explain_names_the_quantized_rules():
    from mlx_attn.quantized import quantized_attention_path

    q, k, v = make_qkv(1, 2, 1, 3, 64, 64)
    k_quant, v_quant = mx.quantize(k, group_size=64, bits=4), mx.quantize(v, group_size=64, bits=4)
    choice = quantized_attention_path(q, k_quant, v_quant, scale=0.125, bits=4, group_size=64, stream=mx.cpu,
                                      explain=True)
    assert choice == ("fused-cpu", None)
    choice = quantized_attention_path(q, k_quant, v_quant, scale=0.125, bits=4, group_size=64,
                                      backend="reference", stream=mx.cpu, explain=True)
    assert choice == ("reference", "backend='reference'")


@pytest.mark.parametrize("d,dv,why", [
    (1024, 1024, "got 1024/1024"),      # past every instantiated head dim
    (80, 64, "got 80/64"),              # unequal dims that are no instantiated pair
    (256, 128, "192/128, 256/256, 512/512, 576/512"),
])
def test_metal_plan_reasons_name_the_head_dims(d, dv, why):
    q, k, v = make_qkv(1, 2, 1, 40, 50, d, dv)
    plan = launch_plan(q, k, v, scale=0.1)
    assert not plan.supported and why in plan.reason
    assert plan.reason.startswith("the Metal kernels support head dims")


def test_metal_plan_reason_names_the_quantized_head_dims():
    from mlx_attn.quantized import quantized_launch_plan

    q = mx.zeros((1, 2, 1, 192))
    k = mx.zeros((1, 1, 64, 192))
    v = mx.zeros((1, 1, 64, 128))
    plan = quantized_launch_plan(q, mx.quantize(k, group_size=64, bits=4), mx.quantize(v, group_size=64, bits=4),
                                 bits=4, group_size=64)
    assert not plan.supported and "64, 128, 256 or 512" in plan.reason


# ------------------------------------------------------- Metal launch plans
SPLIT_DIMS = DIMS[1:]
FAMILIES = ["apple7", "apple8", "apple9", "unknown"]


@pytest.mark.parametrize("d,dv", SPLIT_DIMS)
def test_split_plans_fit_threadgroup_memory_and_name_the_variant(d, dv):
    """Every family and dtype plans the D-split prefill kernel for these
    dims (decode too when Dk != Dv), within 32 KB of threadgroup memory, with
    the tile bytes the kernel declares (K: all D dims, V: one pass's chunk)."""
    for family, dtype, tq in itertools.product(FAMILIES, DTYPES, (40, 1)):
        q, k, v = make_qkv(1, 4, 2, tq, 50, d, dv, dtype=dtype)
        plan = launch_plan(q, k, v, scale=0.1, gpu_family=family)
        assert plan.supported, plan.reason
        (step, *rest) = plan.dispatches
        if tq == 1 and d == dv:
            assert step.kernel.startswith(f"attention_decode_partial_{str(dtype).split('.')[-1]}_d{d}")
            continue
        bk = 16 if family == "apple9" and dtype != mx.float32 else 8
        name = f"attention_prefill_split_{str(dtype).split('.')[-1]}_d{d}_dv{dv}_bk{bk}"
        assert step.kernel == name and not rest
        size = 4 if dtype == mx.float32 else 2
        assert step.threadgroup_memory_bytes == bk * (d * size + 16) + bk * (min(dv, 128) * size + 16)
        assert step.threadgroup_memory_bytes <= 32 * 1024
        assert step.grid == [2, 4, 1] if tq == 40 else [1, 4, 1]


# ------------------------------------------------------- emulated Metal
pytestmark_metal = pytest.mark.skipif(not msl_emulator.clang_available(), reason="needs clang-19 for the MSL emulator")
METAL_SOURCES = [REPO / "metal" / "attention_prefill_split.metal", REPO / "metal" / "attention_decode.metal"]


@pytest.fixture(scope="module", params=[True, False] if FULL_GRID else [True],
                ids=["fast-math", "precise"] if FULL_GRID else ["fast-math"])
def metal(request):
    return EmulatedMetal(fast_math=request.param, sources=METAL_SOURCES)


METAL_CASES = case_grid(SPLIT_DIMS)


@pytestmark_metal
@pytest.mark.parametrize("case", METAL_CASES, ids=case_id)
def test_emulated_prefill_matches_float64_oracle(metal, case):
    (d, dv), dtype, mask = case
    hq, tq, tkv = 2, 33, 13  # two query blocks (one row in the second), two key blocks (the last partial)
    q, k, v = make_qkv(1, hq, 1, tq, tkv, d, dv, dtype=dtype, seed=d + 1)
    kw = {"scale": d ** -0.5, **options(mask, hq, tq, tkv, dtype, seed=2)}
    out, lse = metal(q, k, v, **kw, return_lse=True)
    assert "attention_prefill_split" in metal.last_plan.dispatches[0].kernel
    assert_matches_oracle(out, q, k, v, dtype, **kw)
    _, want_lse = numpy_attention(q, k, v, **kw, return_lse=True)
    lse = np.array(lse)
    assert np.array_equal(np.isneginf(lse), np.isneginf(want_lse))
    finite = np.isfinite(want_lse)
    assert np.allclose(lse[finite], want_lse[finite], rtol=1e-4, atol=1e-3)


DECODE_CASES = case_grid(SPLIT_DIMS, ("none", "causal", "sinks", "bool"))


@pytestmark_metal
@pytest.mark.parametrize("case", DECODE_CASES, ids=case_id)
def test_emulated_decode_matches_float64_oracle(metal, case):
    """Few queries: the decode kernel at D = Dv (256: 4 rows per
    threadgroup, 512: 2, so the GQA group's 4 rows take two row chunks), the
    D-split prefill kernel where Dk != Dv."""
    (d, dv), dtype, mask = case
    hq, tq, tkv = (8, 1, 150) if d == dv else (4, 1, 20)  # decode: several splits; D-split prefill: small
    q, k, v = make_qkv(1, hq, 2, tq, tkv, d, dv, dtype=dtype, seed=d + 2)
    kw = {"scale": d ** -0.5, **options(mask, hq, tq, tkv, dtype, seed=3)}
    if mask == "bool":
        kw["mask"] = mx.array(np.random.default_rng(1).random((tq, tkv)) > 0.3)
    out = metal(q, k, v, **kw)
    kernel = metal.last_plan.dispatches[0].kernel
    assert kernel.startswith("attention_decode_partial" if d == dv else "attention_prefill_split"), kernel
    assert_matches_oracle(out, q, k, v, dtype, **kw)


@pytestmark_metal
def test_emulated_apple9_key_blocks_at_large_head_dims(metal):
    q, k, v = make_qkv(1, 2, 1, 33, 20, 576, 512, dtype=mx.float16, seed=9)
    out = metal(q, k, v, scale=576 ** -0.5, mask="causal", gpu_target={"gpu_family": "apple9"})
    assert metal.last_plan.dispatches[0].kernel.endswith("_bk16")
    assert_matches_oracle(out, q, k, v, mx.float16, scale=576 ** -0.5, mask="causal")


@pytestmark_metal
def test_every_planned_split_and_decode_kernel_is_compiled(metal):
    names = set()
    for family, dtype, (d, dv), tq in itertools.product(FAMILIES, DTYPES, SPLIT_DIMS, (40, 1)):
        q, k, v = make_qkv(1, 4, 2, tq, 50, d, dv, dtype=dtype)
        for mask in (None, mx.ones((tq, 50), dtype=mx.bool_), mx.zeros((tq, 50), dtype=dtype)):
            plan = launch_plan(q, k, v, mask=mask, gpu_family=family)
            names.update(step.kernel for step in plan.dispatches)
    assert names <= set(metal.library.kernel_names), sorted(names - set(metal.library.kernel_names))
