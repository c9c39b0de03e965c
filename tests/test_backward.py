"""The fused CPU backward (csrc/cpu/backward_*): gradients of
mlx_attn.scaled_dot_product_attention on the fused path against the
reference path's autodiff (float32, on float32 copies of the inputs) over
the forward's grid, against float64 finite differences of an independent
NumPy attention, with no Tq x Tkv buffer (MLX's peak memory), and that the
reference rule is not what runs."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import mlx_attn
from mlx_attn import _native
from mlx_attn.attention import MultiHeadAttention
from sdpa_cases import finite_difference_gradient, make_qkv, numpy_attention

# Max abs gradient error relative to the largest reference gradient: float32
# accumulation order; float16/bfloat16 inputs, output and cotangent rounded
# once each (ulp(1) 2^-10 resp. 2^-7), float32 accumulation.
GRAD_TOLERANCE = {mx.float32: 1e-4, mx.float16: 1e-2, mx.bfloat16: 6e-2}


# The CPU backward's two schemes (csrc/cpu/backward_kernels.h): which one runs
# by default depends on batch x kv heads and the thread count, so the tests
# force each in turn.
BACKWARD_SCHEMES = ["single", "two"]


@pytest.fixture(params=BACKWARD_SCHEMES)
def backward_scheme(request, monkeypatch):
    monkeypatch.setenv("MLX_ATTN_CPU_BACKWARD", request.param)
    return request.param


def test_unknown_backward_scheme_is_refused(monkeypatch):
    monkeypatch.setenv("MLX_ATTN_CPU_BACKWARD", "three")
    q, k, v = make_qkv(1, 2, 1, 4, 4, 8, seed=1)
    with pytest.raises(ValueError, match="MLX_ATTN_CPU_BACKWARD"):
        _grads(q, k, v, None, "fused", _loss_weights((1, 2, 4, 8)), scale=0.5)


def _loss_weights(shape, seed=11):
    rng = np.random.default_rng(seed)
    return mx.array(rng.standard_normal(shape).astype(np.float32))


def _grads(q, k, v, sinks, backend, weights, **kw):
    """d sum(out * weights) / d (q, k, v[, sinks])."""
    argnums = (0, 1, 2, 3) if sinks is not None else (0, 1, 2)

    def loss(q, k, v, sinks=None):
        out = mlx_attn.scaled_dot_product_attention(q, k, v, sinks=sinks, backend=backend, **kw)
        return (out.astype(mx.float32) * weights).sum()

    args = (q, k, v, sinks) if sinks is not None else (q, k, v)
    grads = mx.grad(loss, argnums=argnums)(*args)
    mx.eval(grads)
    return grads


def _as32(x):
    return None if x is None else x.astype(mx.float32)


def assert_grads_match_reference(q, k, v, *, sinks=None, dtype=mx.float32, **kw):
    kw.setdefault("scale", q.shape[-1] ** -0.5)
    assert mlx_attn.attention_path(q, k, v, sinks=sinks, **kw) == "fused-cpu"
    out_shape = (q.shape[0], q.shape[1], q.shape[2], v.shape[3])
    weights = _loss_weights(out_shape)
    got = _grads(q, k, v, sinks, "fused", weights, **kw)
    mask = kw.get("mask")
    ref_kw = dict(kw)
    if isinstance(mask, mx.array) and mask.dtype != mx.bool_:
        ref_kw["mask"] = mask.astype(mx.float32)
    want = _grads(_as32(q), _as32(k), _as32(v), _as32(sinks), "reference", weights, **ref_kw)
    for name, g, w in zip(("q", "k", "v", "sinks"), got, want):
        assert g.dtype == dtype and g.shape == w.shape, name
        g64 = np.array(g.astype(mx.float32)).astype(np.float64)
        w64 = np.array(w).astype(np.float64)
        assert np.isfinite(g64).all(), f"d/d{name} not finite"
        scale = max(1.0, float(np.abs(w64).max()))
        err = float(np.abs(g64 - w64).max()) / scale
        assert err <= GRAD_TOLERANCE[dtype], f"d/d{name}: relative error {err} > {GRAD_TOLERANCE[dtype]}"


# (b, hq, hkv, tq, tkv, d, dv): several key blocks (64) and query blocks
# (128 rows / group), Tq < Tkv and Tq > Tkv, GQA 1/2/4, MQA, D != Dv.
SHAPES = [
    (1, 2, 2, 5, 7, 8, 8),
    (2, 4, 2, 70, 150, 16, 16),
    (1, 8, 2, 33, 65, 12, 20),
    (1, 6, 1, 40, 40, 32, 8),
    (1, 4, 4, 90, 30, 24, 24),
]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("mask", [None, "causal", "window", "bool", "additive", "additive-broadcast"])
def test_fused_gradients_match_reference_autodiff(shape, mask, backward_scheme):
    b, hq, hkv, tq, tkv, d, dv = shape
    q, k, v = make_qkv(b, hq, hkv, tq, tkv, d, dv, seed=sum(shape))
    rng = np.random.default_rng(3)
    kw = {}
    if mask == "causal":
        kw["mask"] = "causal"
    elif mask == "window":
        kw["window_size"] = 9
    elif mask == "bool":
        kw["mask"] = mx.array(rng.random((b, hq, tq, tkv)) > 0.3)
    elif mask == "additive":
        kw["mask"] = mx.array(rng.standard_normal((b, hq, tq, tkv)).astype(np.float32))
    elif mask == "additive-broadcast":
        kw["mask"] = mx.array(rng.standard_normal((tq, tkv)).astype(np.float32))
    assert_grads_match_reference(q, k, v, **kw)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_fused_gradients_dtypes_with_sinks(dtype, causal, backward_scheme):
    q, k, v = make_qkv(1, 4, 2, 37, 80, 16, 24, dtype=dtype, seed=4)
    sinks = mx.array([0.5, -1.0, 2.0, 0.0]).astype(dtype)
    assert_grads_match_reference(q, k, v, sinks=sinks, dtype=dtype, mask="causal" if causal else None)


def test_fused_gradients_strided_inputs(backward_scheme):
    """q, k, v as transposed views ([B, T, H, D] memory), sinks a strided view."""
    rng = np.random.default_rng(8)
    q = mx.array(rng.standard_normal((2, 50, 4, 16)).astype(np.float32)).swapaxes(1, 2)
    k = mx.array(rng.standard_normal((2, 70, 2, 16)).astype(np.float32)).swapaxes(1, 2)
    v = mx.array(rng.standard_normal((2, 16, 2, 70)).astype(np.float32)).transpose(0, 2, 3, 1)
    sinks = mx.array(rng.standard_normal(8).astype(np.float32))[::2]
    assert_grads_match_reference(q, k, v, sinks=sinks, mask="causal")


@pytest.mark.parametrize("isa", _native.ext.supported_cpu_isas() if _native.ext else [])
def test_fused_gradients_every_instruction_set(isa, backward_scheme):
    before = _native.ext.cpu_isa()
    _native.ext.set_cpu_isa(isa)
    try:
        q, k, v = make_qkv(1, 4, 2, 45, 100, 20, 12, seed=9)
        assert_grads_match_reference(q, k, v, mask="causal", sinks=mx.array([0.1, 0.2, -0.3, 1.0]))
    finally:
        _native.ext.set_cpu_isa(before)


# bf16 problems on whole 32-feature tiles (D, Dv multiples of 32): the
# avx512amx backward copy's AMX products where the CPU grants AMX tiles
# (csrc/cpu/backward_impl.h AmxTiles), the float32 tiles elsewhere; the same
# bf16 tolerance as every bf16 gradient. Padded query tiles (70 x group
# rows), partial key blocks, GQA / MQA, D != Dv.
WHOLE_TILE_SHAPES = [
    (1, 4, 2, 70, 150, 64, 64),
    (1, 2, 2, 33, 65, 32, 96),
    (2, 2, 1, 40, 40, 128, 128),
]


@pytest.mark.parametrize("shape", WHOLE_TILE_SHAPES, ids=str)
@pytest.mark.parametrize("case", ["none", "causal", "window+sinks", "bool", "softcap"])
def test_bf16_gradients_on_whole_tiles(shape, case, backward_scheme):
    b, hq, hkv, tq, tkv, d, dv = shape
    q, k, v = make_qkv(b, hq, hkv, tq, tkv, d, dv, dtype=mx.bfloat16, seed=sum(shape))
    kw = {}
    if case == "causal":
        kw["mask"] = "causal"
    elif case == "window+sinks":
        kw.update(window_size=21, sinks=mx.array(np.linspace(-1.0, 1.0, hq).astype(np.float32)).astype(mx.bfloat16))
    elif case == "bool":
        kw["mask"] = mx.array(np.random.default_rng(5).random((b, hq, tq, tkv)) > 0.3)
    elif case == "softcap":
        kw.update(softcap=2.0, mask="causal")
    assert_grads_match_reference(q, k, v, dtype=mx.bfloat16, **kw)


@pytest.mark.parametrize("mask", [None, "causal"])
def test_bf16_whole_tile_gradients_of_a_sum(mask, backward_scheme):
    """The cotangent of out.sum() is a broadcast (strides 0), which the AMX
    tiles gather into their dO rows."""
    q, k, v = make_qkv(1, 4, 2, 70, 90, 64, 32, dtype=mx.bfloat16, seed=12)

    def grads(backend, *arrays):
        def loss(q, k, v):
            out = mlx_attn.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask, backend=backend)
            return out.astype(mx.float32).sum()
        result = mx.grad(loss, argnums=(0, 1, 2))(*arrays)
        mx.eval(result)
        return result

    got = grads("fused", q, k, v)
    want = grads("reference", _as32(q), _as32(k), _as32(v))
    for name, g, w in zip("qkv", got, want):
        g64, w64 = np.array(g.astype(mx.float32)).astype(np.float64), np.array(w).astype(np.float64)
        err = float(np.abs(g64 - w64).max()) / max(1.0, float(np.abs(w64).max()))
        assert err <= GRAD_TOLERANCE[mx.bfloat16], f"d/d{name}: relative error {err}"


# The backward copy that serves each forward copy (csrc/cpu/copies.h): the
# AMX forward has its own, the other avx512 copies share one.
BACKWARD_COPY_OF = {"avx512amx": "avx512amx_backward", "avx512bf16": "avx512_backward", "avx512": "avx512_backward",
                    "avx2": "avx2_backward", "neonbf16": "neon_backward", "neonfhm": "neon_backward",
                    "neon": "neon_backward", "generic": "generic_backward"}


@pytest.mark.parametrize("isa", _native.ext.supported_cpu_isas() if _native.ext else [])
def test_bf16_whole_tile_gradients_every_instruction_set(isa, backward_scheme):
    """Each copy with its own backward; K with strided features (a transposed
    view), which the AMX tiles leave to the float32 tiles, beside contiguous."""
    before = _native.ext.cpu_isa()
    _native.ext.set_cpu_isa(isa)
    try:
        assert _native.ext.cpu_backward_copy() == BACKWARD_COPY_OF[isa]
        q, k, v = make_qkv(1, 4, 2, 45, 100, 64, 32, dtype=mx.bfloat16, seed=10)
        sinks = mx.array([0.1, 0.2, -0.3, 1.0]).astype(mx.bfloat16)
        assert_grads_match_reference(q, k, v, dtype=mx.bfloat16, mask="causal", sinks=sinks)
        k_features_strided = mx.swapaxes(mx.swapaxes(k, 2, 3) + 0, 2, 3)
        assert_grads_match_reference(q, k_features_strided, v, dtype=mx.bfloat16, mask="causal", sinks=sinks)
    finally:
        _native.ext.set_cpu_isa(before)


@pytest.mark.parametrize("sinks", [False, True])
def test_fully_masked_rows_give_zero_gradients(sinks, backward_scheme):
    q, k, v = make_qkv(1, 2, 1, 6, 9, 8, seed=2)
    visible = np.ones((1, 2, 6, 9), bool)
    visible[0, 0, 2, :] = False  # row 2 of head 0 sees nothing
    visible[0, :, 4, :] = False  # row 4 of every head sees nothing
    mask = mx.array(visible)
    sink_values = mx.array([0.3, -0.7]) if sinks else None
    weights = _loss_weights((1, 2, 6, 8))
    grads = _grads(q, k, v, sink_values, "fused", weights, scale=0.5, mask=mask)
    dq = np.array(grads[0])
    for g in grads:
        assert np.isfinite(np.array(g)).all()
    assert (dq[0, 0, 2] == 0).all() and (dq[0, :, 4] == 0).all()
    assert np.abs(dq[0, 1, 2]).max() > 0  # a row that sees keys still gets a gradient
    want = _grads(q, k, v, sink_values, "reference", weights, scale=0.5, mask=mask)
    for g, w in zip(grads, want):
        np.testing.assert_allclose(np.array(g), np.array(w), atol=1e-5)


@pytest.mark.parametrize(
    "case",
    [
        dict(shape=(1, 4, 1, 3, 5, 3, 2), window_size=2),  # MQA, D != Dv, window
        dict(shape=(1, 4, 2, 4, 3, 2, 3), mask="causal"),  # Tq > Tkv: a row sees nothing
        dict(shape=(2, 2, 2, 2, 4, 3, 3), mask="bool-empty-row"),
    ],
    ids=["mqa-window", "causal-tq-gt-tkv", "bool-empty-row"],
)
def test_fused_gradients_match_finite_differences(case, backward_scheme):
    b, hq, hkv, tq, tkv, d, dv = case["shape"]
    q, k, v = make_qkv(b, hq, hkv, tq, tkv, d, dv, seed=6)
    sinks = mx.array(np.linspace(-0.5, 0.5, hq).astype(np.float32))
    mask = case.get("mask")
    if mask == "bool-empty-row":
        visible = np.random.default_rng(1).random((b, hq, tq, tkv)) > 0.4
        visible[0, 0, 1, :] = False
        mask = mx.array(visible)
    kw = dict(scale=0.8, mask=mask, window_size=case.get("window_size"))
    weights = np.random.default_rng(12).standard_normal((b, hq, tq, dv))

    def loss_numpy(q, k, v, sinks):
        return float((numpy_attention(q, k, v, sinks=sinks, **kw) * weights).sum())

    grads = _grads(q, k, v, sinks, "fused", mx.array(weights.astype(np.float32)), **kw)
    arrays = [np.array(a).astype(np.float64) for a in (q, k, v, sinks)]
    for index, name in enumerate(("q", "k", "v", "sinks")):
        want = finite_difference_gradient(loss_numpy, arrays, index)
        np.testing.assert_allclose(np.array(grads[index]), want, atol=3e-5, rtol=1e-4, err_msg=name)


def test_lse_output_is_differentiable_on_the_cpu():
    """The fused backward takes the lse's cotangent too: d sum(lse * w) / dq
    against finite differences of a float64 log-sum-exp."""
    q, k, v = make_qkv(1, 2, 1, 3, 4, 2, seed=3)
    w = np.random.default_rng(4).standard_normal((1, 2, 3))

    def loss(q):
        out, lse = _native.ext.fused_attention(q, k, v, scale=0.9, causal=True, output_lse=True)
        return (lse * mx.array(w.astype(np.float32))).sum() + out.sum()

    def loss_numpy(q64, k64, v64):
        logits = 0.9 * q64 @ np.repeat(k64, 2, axis=1).swapaxes(-1, -2)
        logits = np.where(np.tril(np.ones((3, 4), bool), k=1), logits, -np.inf)
        lse = np.log(np.exp(logits).sum(-1))
        return float((lse * w).sum() + numpy_attention(q64, k64, v64, scale=0.9, mask="causal").sum())

    got = np.array(mx.grad(loss)(q))
    arrays = [np.array(a).astype(np.float64) for a in (q, k, v)]
    np.testing.assert_allclose(got, finite_difference_gradient(loss_numpy, arrays, 0), atol=3e-5, rtol=1e-4)


def _graph_primitives(tmp_path, *arrays) -> str:
    """The text of the graph behind ``arrays`` (mx.export_to_dot): its node
    labels name each primitive."""
    path = tmp_path / "graph.dot"
    mx.export_to_dot(str(path), *arrays)
    return path.read_text()


def test_gradients_come_from_the_fused_backward_and_jvp_from_the_cpp_graph(tmp_path):
    """CPU gradients of the fused path come from the fused backward's
    primitive; forward-mode derivatives come from the reference graph built
    in C++ (no call back into Python: the extension has no rule to register)
    and equal the Python reference path's own jvp."""
    assert not hasattr(_native.ext, "set_differentiation_rule")
    q, k, v = make_qkv(1, 2, 1, 10, 12, 8, seed=1)

    def loss(q):
        return mlx_attn.scaled_dot_product_attention(q, k, v, scale=0.3, mask="causal", backend="fused").sum()

    assert "FusedAttentionBackward" in _graph_primitives(tmp_path, mx.grad(loss)(q))

    def forward(backend):
        return lambda q: mlx_attn.scaled_dot_product_attention(q, k, v, scale=0.3, mask="causal", backend=backend)

    tangent = mx.random.normal(q.shape, key=mx.random.key(3))
    (fused_tangent,) = mx.jvp(forward("fused"), [q], [tangent])[1]
    assert "FusedAttentionBackward" not in _graph_primitives(tmp_path, fused_tangent)
    (reference_tangent,) = mx.jvp(forward("reference"), [q], [tangent])[1]
    np.testing.assert_allclose(np.array(fused_tangent), np.array(reference_tangent), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["window+sinks+softcap+lse", "additive+gqa", "bool+sinks", "causal+empty-rows"])
def test_cpp_reference_graph_derivatives_match_the_python_reference(case):
    """Derivatives the fused primitive takes from its C++ reference graph
    (forward mode always; reverse mode for a differentiated additive mask)
    equal mx.jvp / mx.vjp of the Python reference path, for every input."""
    q, k, v = make_qkv(2, 4, 2, 5, 9, 8, seed=7)
    kw = dict(scale=0.45)
    extras = []
    if "window" in case:
        kw.update(mask="causal", window_size=3, softcap=2.5, return_lse=True)
    if "additive" in case:
        extras.append(("mask", mx.random.normal((1, 4, 5, 9), key=mx.random.key(2))))
    if "bool" in case:
        extras.append(("mask", mx.random.bernoulli(0.6, (5, 9), key=mx.random.key(4))))
    if "causal+empty" in case:  # more queries than keys: the first rows see no key
        q = mx.random.normal((2, 4, 12, 8), key=mx.random.key(5))
        kw["mask"] = "causal"
    if "sinks" in case:
        extras.append(("sinks", mx.random.normal((4,), key=mx.random.key(6))))
    names = [name for name, _ in extras]
    primals = [q, k, v] + [a for _, a in extras]

    def attend(backend):
        def f(*arrays):
            named = dict(zip(names, arrays[3:]))
            out = mlx_attn.scaled_dot_product_attention(*arrays[:3], backend=backend, **kw, **named)
            return list(out) if isinstance(out, tuple) else [out]
        return f

    float_args = [i for i, a in enumerate(primals) if a.dtype != mx.bool_]
    tangents = [mx.random.normal(a.shape, key=mx.random.key(10 + i)) if a.dtype != mx.bool_ else mx.zeros_like(a)
                for i, a in enumerate(primals)]
    fused_t = mx.jvp(attend("fused"), primals, tangents)[1]
    reference_t = mx.jvp(attend("reference"), primals, tangents)[1]
    assert len(fused_t) == len(reference_t)
    for got, want in zip(fused_t, reference_t):
        np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-5, rtol=1e-4)
    outputs = attend("reference")(*primals)
    cotangents = [mx.random.normal(o.shape, key=mx.random.key(20 + i)) for i, o in enumerate(outputs)]
    fused_g = mx.vjp(attend("fused"), primals, cotangents)[1]
    reference_g = mx.vjp(attend("reference"), primals, cotangents)[1]
    for i in float_args:
        np.testing.assert_allclose(np.array(fused_g[i]), np.array(reference_g[i]), atol=2e-5, rtol=1e-4)
        assert np.isfinite(np.array(fused_g[i])).all()


def _peak_gradient_memory(backend, q, k, v):
    def loss(q, k, v):
        return mlx_attn.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal", backend=backend).sum()

    mx.eval(q, k, v)
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    grads = mx.grad(loss, argnums=(0, 1, 2))(q, k, v)
    mx.eval(grads)
    peak = mx.get_peak_memory() - base
    del grads
    return peak


def test_fused_backward_allocates_no_score_matrix():
    """Tq x Tkv float32 for one head is 16 MiB here; the fused forward and
    backward together stay far below it (inputs, outputs and gradients are
    ~3 MiB), the reference path's autodiff does not."""
    t, heads, d = 2048, 2, 32
    q, k, v = make_qkv(1, heads, heads, t, t, d, seed=0)
    score_matrix = t * t * 4
    fused_peak = _peak_gradient_memory("fused", q, k, v)
    reference_peak = _peak_gradient_memory("reference", q, k, v)
    assert reference_peak > score_matrix  # the measurement sees such a buffer
    assert fused_peak < score_matrix / 2, f"fused peak {fused_peak / 2**20:.1f} MiB"


def test_module_gradients_fused_match_reference():
    """nn.value_and_grad through MultiHeadAttention (GQA, causal): the fused
    backend's loss and parameter gradients equal the reference backend's."""
    mx.random.seed(0)
    fused_attn = MultiHeadAttention(32, 4, 2, backend="fused")
    reference_attn = MultiHeadAttention(32, 4, 2, backend="reference")
    reference_attn.update(fused_attn.parameters())
    x = mx.random.normal((2, 20, 32))

    def loss(model, x):
        return (model(x, mask="causal") ** 2).mean()

    (fused_loss, fused_grads) = nn.value_and_grad(fused_attn, loss)(fused_attn, x)
    (ref_loss, ref_grads) = nn.value_and_grad(reference_attn, loss)(reference_attn, x)
    assert abs(fused_loss.item() - ref_loss.item()) < 1e-5
    flat_fused = dict(_flatten(fused_grads))
    for name, g in _flatten(ref_grads):
        np.testing.assert_allclose(np.array(flat_fused[name]), np.array(g), atol=2e-5, err_msg=name)


def _flatten(tree, prefix=""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _flatten(value, f"{prefix}{key}.")
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            yield from _flatten(value, f"{prefix}{i}.")
    else:
        yield prefix, tree


def test_backward_benchmark_quick_run(tmp_path):
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_backward.py"
    spec = importlib.util.spec_from_file_location("bench_backward", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.main(["--quick", "--heads", "2", "--repeats", "1", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "bench_backward.json").read_text())
    assert saved["rows"] == rows and len(rows) == 4
    assert all(r["fused_s"] > 0 and "reference_s" in r for r in rows)
    assert (tmp_path / "bench_backward.png").stat().st_size > 10_000
