"""The fused CPU kernel against the reference path on a grid of problems."""

import itertools
import os
import platform
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

import mlx_attn
from mlx_attn import _ext
from sdpa_cases import DTYPES, TOLERANCE, assert_close, fused, make_qkv, max_abs_diff, reference

HEAD_DIMS = [1, 3, 16, 64, 80, 96, 128, 256]
# (Tq, Tkv): single rows, odd sizes, sizes that are not multiples of the
# 64-key block or of the query block.
LENGTHS = [(1, 1), (1, 77), (7, 7), (13, 130), (65, 65), (130, 61)]


@pytest.fixture(params=_ext.supported_cpu_isas())
def isa(request):
    """Runs a test once per compiled kernel copy this CPU can execute."""
    before = _ext.cpu_isa()
    _ext.set_cpu_isa(request.param)
    yield request.param
    _ext.set_cpu_isa(before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_head_dims_and_dtypes(dtype, d, causal):
    for i, (tq, tkv) in enumerate(LENGTHS):
        q, k, v = make_qkv(1, 2, 2, tq, tkv, d, dtype=dtype, seed=i)
        mask = "causal" if causal else None
        out = fused(q, k, v, mask=mask)
        assert out.dtype == dtype and out.shape == (1, 2, tq, d)
        assert_close(out, reference(q, k, v, mask=mask), dtype)


@pytest.mark.parametrize("d,dv", [(64, 32), (16, 100), (3, 256), (256, 8)])
def test_value_dim_differs(d, dv):
    q, k, v = make_qkv(2, 4, 2, 9, 70, d, dv)
    assert_close(fused(q, k, v, mask="causal"), reference(q, k, v, mask="causal"), mx.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (6, 2), (8, 2), (16, 2), (8, 1), (5, 1)])
def test_gqa_and_mqa(dtype, hq, hkv):
    for tq, tkv in [(1, 100), (33, 33), (70, 140)]:
        q, k, v = make_qkv(2, hq, hkv, tq, tkv, 32, dtype=dtype)
        for mask in (None, "causal"):
            assert_close(fused(q, k, v, mask=mask), reference(q, k, v, mask=mask), dtype)


MASK_SHAPES = [(9, 70), (1, 70), (9, 1), (1, 1, 9, 70), (2, 1, 9, 70), (1, 4, 9, 70), (2, 4, 9, 70), (4, 1, 70), (70,)]


@pytest.mark.parametrize("shape", MASK_SHAPES, ids=str)
@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_array_masks_broadcast(shape, kind, dtype):
    q, k, v = make_qkv(2, 4, 2, 9, 70, 16, dtype=dtype)
    rng = np.random.default_rng(len(shape))
    if kind == "bool":
        mask = mx.array(rng.random(shape) > 0.4)
    else:
        mask = mx.array(rng.standard_normal(shape).astype(np.float32) * 3).astype(dtype)
    assert_close(fused(q, k, v, mask=mask), reference(q, k, v, mask=mask), dtype)


def test_float32_additive_mask_with_float32_inputs_and_mixed_dtypes():
    q, k, v = make_qkv(1, 2, 2, 5, 20, 8)
    mask = mx.zeros((5, 20)) - 2.0 * (mx.arange(20) % 3 == 0)
    assert_close(fused(q, k, v, mask=mask), reference(q, k, v, mask=mask), mx.float32)
    # q float16 with float32 k promotes to float32, like mx.fast
    out = mlx_attn.scaled_dot_product_attention(q.astype(mx.float16), k, v, scale=0.3)
    assert out.dtype == mx.float32


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mask", [None, "causal", "bool"])
def test_sinks(dtype, mask):
    q, k, v = make_qkv(2, 6, 2, 11, 75, 16, dtype=dtype)
    sinks = mx.array([0.0, 1.0, -2.0, 3.0, 10.0, -30.0]).astype(dtype)
    if mask == "bool":
        m = np.random.default_rng(0).random((11, 75)) > 0.5
        m[3] = False  # a fully masked row: the sink alone gives zeros
        mask = mx.array(m)
    out = fused(q, k, v, mask=mask, sinks=sinks)
    ref = reference(q, k, v, mask=mask, sinks=sinks)
    assert_close(out, ref, dtype)
    ours = np.array(out.astype(mx.float32))
    if mask is not None and not isinstance(mask, str):
        assert np.all(ours[:, :, 3] == 0)
    if dtype == mx.float32 and mask is None:
        theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=16**-0.5, sinks=sinks)
        assert max_abs_diff(out, theirs) < 2e-5


@pytest.mark.parametrize("window", [1, 2, 5, 64, 65, 200])
@pytest.mark.parametrize("tq,tkv", [(1, 150), (40, 40), (100, 230)])
def test_sliding_window(window, tq, tkv):
    q, k, v = make_qkv(1, 4, 2, tq, tkv, 32, seed=window)
    for mask in (None, "causal"):
        out = fused(q, k, v, mask=mask, window_size=window)
        assert_close(out, reference(q, k, v, mask=mask, window_size=window), mx.float32)
    # with an array mask on top
    bool_mask = mx.array(np.random.default_rng(1).random((tq, tkv)) > 0.2)
    out = fused(q, k, v, mask=bool_mask, window_size=window)
    assert_close(out, reference(q, k, v, mask=bool_mask, window_size=window), mx.float32)


def test_window_against_explicit_band_mask():
    q, k, v = make_qkv(1, 2, 1, 50, 90, 16)
    pos = np.arange(50)[:, None] + 40
    key = np.arange(90)[None, :]
    band = mx.array((key <= pos) & (key > pos - 7))
    assert max_abs_diff(fused(q, k, v, window_size=7), fused(q, k, v, mask=band)) < 1e-6


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fully_masked_rows_are_zero(dtype):
    q, k, v = make_qkv(1, 2, 2, 6, 70, 16, dtype=dtype)
    m = np.ones((6, 70), dtype=bool)
    m[2] = False
    additive = np.zeros((6, 70), dtype=np.float32)
    additive[4] = -np.inf
    additive[5, :69] = -np.inf  # only the last key visible
    for mask in (mx.array(m), mx.array(additive).astype(dtype)):
        out = np.array(fused(q, k, v, mask=mask).astype(mx.float32))
        assert np.isfinite(out).all()
    assert np.all(np.array(fused(q, k, v, mask=mx.array(m)).astype(mx.float32))[:, :, 2] == 0)
    out = np.array(fused(q, k, v, mask=mx.array(additive).astype(dtype)).astype(mx.float32))
    assert np.all(out[:, :, 4] == 0)
    np.testing.assert_allclose(out[:, :, 5], np.array(v.astype(mx.float32))[:, :, 69], atol=TOLERANCE[dtype])
    # causal with more queries than keys: the first queries see nothing
    q, k, v = make_qkv(1, 2, 2, 10, 4, 16, dtype=dtype)
    out = np.array(fused(q, k, v, mask="causal").astype(mx.float32))
    assert np.all(out[:, :, :6] == 0) and np.isfinite(out).all()
    assert_close(mx.array(out), reference(q, k, v, mask="causal"), dtype)
    # no keys at all
    q, k, v = make_qkv(1, 2, 2, 3, 0, 16, dtype=dtype)
    for backend in ("auto", "reference"):
        out = mlx_attn.scaled_dot_product_attention(q, k, v, scale=1.0, backend=backend)
        assert out.shape == (1, 2, 3, 16) and np.all(np.array(out.astype(mx.float32)) == 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_large_logits_stay_finite(dtype):
    q, k, v = make_qkv(1, 2, 2, 33, 99, 64, dtype=dtype)
    q = q * 60  # logits in the thousands: softmax is one-hot
    for mask in (None, "causal"):
        out = fused(q, k, v, mask=mask, scale=1.0)
        assert_close(out, reference(q, k, v, mask=mask, scale=1.0), dtype)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=str)
def test_tiny_products_with_a_scale_near_float32_max(dtype, isa):
    """Every product q_d k_d below float32's normal range (2^-126) and a scale
    of 1.5 * 2^127: the logits are of order one. The bf16 dot products of the
    native copies flush such products to zero unless the kernel moves part of
    the scale into q first. Oracle: float64 NumPy."""
    rng = np.random.default_rng(5)
    tiny = 2.0**-65
    q_np, k_np = (rng.integers(-128, 129, (1, 2, n, 64)) / 64 * tiny for n in (7, 70))
    v_np = rng.integers(-128, 129, (1, 2, 70, 64)) / 64
    scale = 1.5 * 2.0**127
    logits = np.einsum("bhqd,bhkd->bhqk", q_np, k_np) * scale
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    expected = (weights / weights.sum(-1, keepdims=True)) @ v_np
    assert np.abs(logits).max() > 0.5  # the logits matter
    q, k, v = (mx.array(x.astype(np.float32)).astype(dtype) for x in (q_np, k_np, v_np))
    out = np.array(fused(q, k, v, scale=scale).astype(mx.float32))
    assert np.abs(out - expected).max() < TOLERANCE[dtype], isa


def test_non_contiguous_inputs():
    rng = np.random.default_rng(0)
    base = mx.array(rng.standard_normal((2, 40, 4, 32)).astype(np.float32))
    q = base.transpose(0, 2, 1, 3)  # [B, H, T, D] view of [B, T, H, D]
    big = mx.array(rng.standard_normal((2, 2, 90, 48)).astype(np.float32))
    k = big[:, :, 5:85, :32]  # sliced
    v = big[:, :, 5:85, 16:]
    kt = mx.array(rng.standard_normal((2, 2, 32, 80)).astype(np.float32)).swapaxes(-1, -2)
    for kk in (k, kt):
        out = fused(q, kk, v, mask="causal")
        assert_close(out, reference(q, kk, v, mask="causal"), mx.float32)
    # K/V broadcast over the batch (zero strides) and a transposed mask
    kb = mx.broadcast_to(k[:1], k.shape)
    mask_t = mx.array(rng.random((80, 40)) > 0.3).T
    out = fused(q, kb, v, mask=mask_t)
    assert_close(out, reference(q, kb, v, mask=mask_t), mx.float32)
    # every other query (stride 2 in T) and a reversed-in-memory head order
    qs = mx.array(rng.standard_normal((2, 4, 80, 32)).astype(np.float32))[:, ::-1, ::2]
    assert_close(fused(qs, k, v), reference(qs, k, v), mx.float32)


def test_every_kernel_copy_agrees(isa):
    for dtype, (tq, tkv), d in itertools.product(DTYPES, [(1, 70), (67, 131)], [3, 64, 80]):
        q, k, v = make_qkv(1, 4, 2, tq, tkv, d, dtype=dtype)
        sinks = mx.array([0.5, -1.0, 0.0, 2.0]).astype(dtype)
        mask = mx.array(np.random.default_rng(d).random((tq, tkv)) > 0.3)
        for kw in ({"mask": "causal"}, {"mask": mask, "sinks": sinks}, {"window_size": 9}):
            assert_close(fused(q, k, v, **kw), reference(q, k, v, **kw), dtype)


# Logit ramps over 700 keys (one value per key, added through feature 0):
# rises below and above 8 / log2 e ~ 5.5 (the slack of lazy rescaling, which
# the kernel had and dropped: kRescaleSlack) per 64- or 128-key block, a late
# jump, a fall (the first block holds the max): every rescale pattern;
# |logits| <= 20 keeps float32's own rounding of them (the reference path's
# error too) well inside the tolerance.
LOGIT_RAMPS = {
    "slow rise": np.linspace(-10.0, 10.0, 700),
    "fast rise": np.linspace(-20.0, 20.0, 700),
    "late jump": np.where(np.arange(700) < 300, 0.0, 20.0),
    "fall": np.linspace(30.0, 0.0, 700),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("ramp", list(LOGIT_RAMPS))
def test_rescaling_keeps_output_and_lse_exact(isa, dtype, ramp):
    """Rows whose max moves at every block, at some, or never (and, with a
    rescale slack, a reference max that trails the true one so P exceeds 1):
    output and log-sum-exp must still match float64, causal or not, with
    128 and 64 features (the AMX bf16 path and the pair / float paths)."""
    from sdpa_cases import numpy_attention

    for d in (64, 128):
        rng = np.random.default_rng(d)
        q = rng.standard_normal((1, 2, 40, d)).astype(np.float32) * 0.1
        k = rng.standard_normal((1, 2, 700, d)).astype(np.float32) * 0.1
        v = rng.standard_normal((1, 2, 700, d)).astype(np.float32)
        q[..., 0] = 1.0
        k[..., 0] = LOGIT_RAMPS[ramp]
        q, k, v = (mx.array(x).astype(dtype) for x in (q, k, v))
        for mask in (None, "causal"):
            out, lse = mlx_attn.scaled_dot_product_attention(
                q, k, v, scale=1.0, mask=mask, backend="fused", return_lse=True
            )
            want_out, want_lse = numpy_attention(q, k, v, scale=1.0, mask=mask, return_lse=True)
            assert np.abs(np.array(lse) - want_lse).max() < 1e-4
            assert np.abs(np.array(out.astype(mx.float32)) - want_out).max() <= TOLERANCE[dtype]


def test_matches_mlx_fast_on_cpu():
    q, k, v = make_qkv(2, 8, 2, 100, 300, 64)
    for mask in (None, "causal"):
        ours = fused(q, k, v, mask=mask)
        theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask, stream=mx.cpu)
        assert max_abs_diff(ours, theirs) < 2e-5


def test_extra_memory_is_not_quadratic():
    """At T=4096 a materialized score matrix would be 64 MiB per head."""
    q, k, v = make_qkv(1, 1, 1, 4096, 4096, 64)
    mx.eval(q, k, v)
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    out = fused(q, k, v, mask="causal")
    extra = mx.get_peak_memory() - base
    assert extra < out.nbytes + 8 * 2**20, f"extra peak {extra / 2**20:.1f} MiB"
    mx.reset_peak_memory()
    ref = reference(q, k, v, mask="causal")
    assert mx.get_peak_memory() - base > 4096 * 4096 * 4  # the unfused path does
    assert_close(out, ref, mx.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_single_visible_key_returns_value_bit_exactly(dtype, isa):
    """One visible key gets weight exactly 1, so the output must equal that
    value row bit for bit: checks the fp16/bf16 load and store conversions
    (including subnormals and extremes; a sum cannot keep the sign of -0)."""
    special = {
        mx.float32: [0.0, 1e-40, -3.4e38, 1.5, 7e-8],
        mx.float16: [0.0, 6e-8, -6.1e-5, 65504.0, -2.0e-7, 0.333],
        mx.bfloat16: [0.0, 1e-39, -3.0e38, 1.0e-3, 0.333],
    }[dtype]
    rng = np.random.default_rng(0)
    tkv, dv = 70, 40
    values = rng.standard_normal((1, 1, tkv, dv)).astype(np.float32) * 100
    values.flat[: len(special)] = special
    v = mx.array(values).astype(dtype)
    q, k, _ = make_qkv(1, 2, 1, 9, tkv, 16, dtype=dtype)
    visible = np.zeros((9, tkv), dtype=bool)
    chosen = rng.choice(tkv, 9)
    chosen[0] = 0  # the row holding the special values
    visible[np.arange(9), chosen] = True
    out = fused(q, k, v, mask=mx.array(visible))
    got = np.array(out.astype(mx.float32)).view(np.uint32)
    want = np.array(v.astype(mx.float32))[0, 0, chosen].view(np.uint32)
    np.testing.assert_array_equal(got[0, 0], want)
    np.testing.assert_array_equal(got[0, 1], want)


@pytest.mark.parametrize("make_sinks", [
    lambda base: base[::3][:4],
    lambda base: base[1:5],
    lambda base: mx.broadcast_to(base[2:3], (4,)),
], ids=["stride-3", "offset", "broadcast"])
def test_sinks_views_are_read_through_their_stride(make_sinks):
    q, k, v = make_qkv(1, 4, 2, 9, 13, 16)
    sinks = make_sinks(mx.array(np.linspace(-2.0, 3.0, 13).astype(np.float32)))
    mx.eval(sinks)
    assert_close(fused(q, k, v, sinks=sinks, mask="causal"), reference(q, k, v, sinks=sinks, mask="causal"), mx.float32)


# ------------------------------------------------------------ ISA dispatch
# Each x86 copy and the /proc/cpuinfo flags it needs, widest first (the
# order dispatch.cpp prefers); the expectation comes from the kernel's
# documented rule, not from the code under test.
X86_COPY_FLAGS = [
    # AMX also needs Linux to grant the process the tile state (arch_prctl),
    # which it does where the flags show (no test host refuses it).
    ("avx512amx", {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16", "amx_tile", "amx_bf16", "avx2",
                   "fma", "f16c"}),
    ("avx512bf16", {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16", "avx2", "fma", "f16c"}),
    ("avx512", {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx2", "fma", "f16c"}),
    ("avx2", {"avx2", "fma", "f16c"}),
    ("generic", set()),
]


# Each arm64 copy and the Linux hwcaps names (/proc/cpuinfo "Features") it
# needs, widest first.
ARM64_COPY_FEATURES = [
    ("neonbf16", {"asimdfhm", "bf16"}),
    ("neonfhm", {"asimdfhm"}),
    ("neon", set()),
    ("generic", set()),
]


def _cpuinfo_flags():
    """The CPU's feature names: x86's "flags" line, arm64's "Features"."""
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split())
    return None


def _x86_linux_flags():
    flags = _cpuinfo_flags()
    if platform.machine().lower() not in ("x86_64", "amd64") or flags is None:
        pytest.skip("reads the CPU features from /proc/cpuinfo on x86-64 Linux")
    return flags


def _isa_in_fresh_process(env_isa=None):
    env = {k: v for k, v in os.environ.items() if k != "MLX_ATTN_CPU_ISA"}
    if env_isa is not None:
        env["MLX_ATTN_CPU_ISA"] = env_isa
    # MLX first, as mlx_attn._native does (`import mlx_attn` no longer imports it;
    # _ext finds libmlx through the loaded mlx.core when MLX sits in another
    # site-packages, e.g. a --system-site-packages venv)
    script = "import mlx.core; from mlx_attn import _ext; print(_ext.cpu_isa())"
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, check=True).stdout.strip()


def test_dispatch_offers_exactly_the_copies_the_cpu_features_allow():
    flags = _x86_linux_flags()
    expected = [name for name, needs in X86_COPY_FLAGS if needs <= flags]
    assert list(_ext.supported_cpu_isas()) == expected
    assert _isa_in_fresh_process() == expected[0]  # the widest by default


def test_arm64_dispatch_offers_exactly_the_copies_the_hwcaps_allow():
    flags = _cpuinfo_flags()
    if platform.machine().lower() not in ("aarch64", "arm64") or flags is None:
        pytest.skip("reads the CPU features from /proc/cpuinfo on arm64 Linux; elsewhere "
                    "test_cpu_kernel_arm64.py checks the same rule under qemu-aarch64")
    expected = [name for name, needs in ARM64_COPY_FEATURES if needs <= flags]
    assert list(_ext.supported_cpu_isas()) == expected
    assert _isa_in_fresh_process() == expected[0]
    for name, needs in ARM64_COPY_FEATURES:
        if not needs <= flags:
            with pytest.raises(ValueError, match=name):
                _ext.set_cpu_isa(name)


def test_isa_override_picks_the_named_copy_and_refuses_missing_ones():
    flags = _x86_linux_flags()
    assert _isa_in_fresh_process("generic") == "generic"
    for name, needs in X86_COPY_FLAGS:
        if not needs <= flags:  # e.g. avx512bf16 on a CPU without AVX512_BF16
            with pytest.raises(ValueError, match=name):
                _ext.set_cpu_isa(name)
    for arm64_copy, _ in ARM64_COPY_FEATURES[:3]:  # not built on x86-64
        with pytest.raises(ValueError, match=arm64_copy):
            _ext.set_cpu_isa(arm64_copy)
    # An unavailable name in the environment falls back to the widest copy.
    if not X86_COPY_FLAGS[0][1] <= flags:
        assert _isa_in_fresh_process(X86_COPY_FLAGS[0][0]) != X86_COPY_FLAGS[0][0]


@pytest.fixture(params=["avx512bf16", "avx512amx"])
def native_bf16_copy(request):
    """The x86 copies with a native bf16 score product: vdpbf16ps, AMX tiles."""
    if request.param not in _ext.supported_cpu_isas():
        pytest.skip(f"the {request.param} copy needs a CPU with its bf16 instructions (cpuinfo flags avx512_bf16, "
                    "amx_bf16)")
    before = _ext.cpu_isa()
    _ext.set_cpu_isa(request.param)
    yield
    _ext.set_cpu_isa(before)


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_native_bf16_score_product_matches_the_reference(native_bf16_copy, d, causal):
    """vdpbf16ps sums feature pairs: odd D pads the last pair, and a K whose
    features are not contiguous (a transposed view) is packed, not read in place."""
    mask = "causal" if causal else None
    for i, (tq, tkv) in enumerate(LENGTHS):
        q, k, v = make_qkv(1, 4, 2, tq, tkv, d, dtype=mx.bfloat16, seed=i)
        assert_close(fused(q, k, v, mask=mask), reference(q, k, v, mask=mask), mx.bfloat16)
    k_features_strided = mx.swapaxes(mx.swapaxes(k, 2, 3) + 0, 2, 3)
    assert_close(fused(q, k_features_strided, v, mask=mask), reference(q, k, v, mask=mask), mx.bfloat16)
