"""The call contract, tried as a hostile user would (issue 20's findings).

Each test compares against an independent oracle: the reference path (pure
MLX), float64 NumPy finite differences, or a full pass without a cache.
"""

import json

import mlx.core as mx
import numpy as np
import pytest

from mlx_attn import KVCache, MultiHeadAttention, RotatingKVCache, scaled_dot_product_attention
from mlx_attn import distributed
from mlx_attn.cache import QuantizedKVCache

B, HQ, HKV, TQ, TKV, D = 1, 4, 2, 6, 9, 8


def _inputs(seed=0, tq=TQ, tkv=TKV, d=D):
    rng = np.random.default_rng(seed)
    q = mx.array(rng.standard_normal((B, HQ, tq, d)).astype(np.float32))
    k = mx.array(rng.standard_normal((B, HKV, tkv, d)).astype(np.float32))
    v = mx.array(rng.standard_normal((B, HKV, tkv, d)).astype(np.float32))
    return q, k, v, rng


# ------------------------------------------------------------ gradients of every input
MASK_SHAPES = [(TQ, TKV), (1, HQ, TQ, TKV), (B, 1, 1, TKV)]
ARGS = ("q", "k", "v", "mask", "sinks")


def _loss(backend, scale=0.4, window=None):
    def loss(q, k, v, mask, sinks):
        out = scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks, window_size=window,
                                           backend=backend)
        weights = mx.arange(out.size, dtype=mx.float32).reshape(out.shape) / out.size
        return (out * weights).sum()
    return loss


@pytest.mark.parametrize("mask_shape", MASK_SHAPES)
@pytest.mark.parametrize("argnums", [(0, 1, 2, 3, 4), (3,), (4,), (0, 3), (1, 4)])
def test_gradients_of_every_input_match_the_reference(mask_shape, argnums):
    q, k, v, rng = _inputs()
    mask = mx.array(rng.standard_normal(mask_shape).astype(np.float32))
    sinks = mx.array(rng.standard_normal(HQ).astype(np.float32))
    want = mx.grad(_loss("reference"), argnums=argnums)(q, k, v, mask, sinks)
    got = mx.grad(_loss("auto"), argnums=argnums)(q, k, v, mask, sinks)
    for i, g, w in zip(argnums, got, want):
        assert g.shape == w.shape, ARGS[i]
        np.testing.assert_allclose(np.array(g), np.array(w), rtol=1e-4, atol=1e-5, err_msg=ARGS[i])
        assert float(mx.abs(w).max()) > 1e-3, f"the oracle's gradient of {ARGS[i]} is trivially zero"


@pytest.mark.parametrize("window", [None, 3])
def test_gradients_with_the_lse_and_a_window_match_the_reference(window):
    """return_lse=True (the lse in the loss too), a window, a broadcast mask."""
    q, k, v, rng = _inputs(seed=2)
    mask = mx.array(rng.standard_normal((1, 1, TQ, TKV)).astype(np.float32))
    sinks = mx.array(rng.standard_normal(HQ).astype(np.float32))

    def loss(backend):
        def f(q, k, v, mask, sinks):
            out, lse = scaled_dot_product_attention(q, k, v, scale=0.4, mask=mask, sinks=sinks, window_size=window,
                                                    backend=backend, return_lse=True)
            return out.sum() + (lse * mx.arange(TQ, dtype=mx.float32)).sum()
        return f

    want = mx.grad(loss("reference"), argnums=(0, 1, 2, 3, 4))(q, k, v, mask, sinks)
    got = mx.grad(loss("auto"), argnums=(0, 1, 2, 3, 4))(q, k, v, mask, sinks)
    for name, g, w in zip(ARGS, got, want):
        np.testing.assert_allclose(np.array(g), np.array(w), rtol=1e-4, atol=1e-5, err_msg=name)


def test_the_backward_is_not_gated_by_a_python_hook():
    """The Metal backward's trust is an option of the call, not a hook C++ asks."""
    from mlx_attn import _native

    assert not hasattr(_native.ext, "set_backward_gate")
    q, k, v, _ = _inputs()
    from mlx_attn.ops import AttentionCall

    call = AttentionCall.build(q, k, v, scale=0.5, window_size=2)
    assert call.causal and call.window_size == 2 and call.path == "fused-cpu" and call.metal_backward_trusted
    with pytest.raises(ValueError, match="window_size"):
        AttentionCall.build(q, k, v, scale=0.5, window_size=0)


def test_mask_gradient_matches_float64_finite_differences():
    """The reference path itself, for the mask and the sinks, against NumPy float64."""
    q, k, v, rng = _inputs(seed=1, tq=3, tkv=5)
    mask = rng.standard_normal((3, 5))
    sinks = rng.standard_normal(HQ)

    def np_loss(mask, sinks):
        qf, kf, vf = (np.array(a, dtype=np.float64) for a in (q, k, v))
        kf, vf = np.repeat(kf, HQ // HKV, axis=1), np.repeat(vf, HQ // HKV, axis=1)
        s = 0.4 * qf @ kf.swapaxes(-1, -2) + mask
        sk = np.broadcast_to(sinks[None, :, None, None], (*s.shape[:-1], 1))
        full = np.concatenate([s, sk], axis=-1)
        p = np.exp(full - full.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out = p[..., :-1] @ vf
        return (out * (np.arange(out.size).reshape(out.shape) / out.size)).sum()

    eps = 1e-6
    fd_mask = np.zeros_like(mask)
    for idx in np.ndindex(mask.shape):
        up, down = mask.copy(), mask.copy()
        up[idx] += eps
        down[idx] -= eps
        fd_mask[idx] = (np_loss(up, sinks) - np_loss(down, sinks)) / (2 * eps)
    fd_sinks = np.zeros_like(sinks)
    for h in range(HQ):
        up, down = sinks.copy(), sinks.copy()
        up[h] += eps
        down[h] -= eps
        fd_sinks[h] = (np_loss(mask, up) - np_loss(mask, down)) / (2 * eps)
    for backend in ("reference", "auto"):
        g_mask, g_sinks = mx.grad(_loss(backend), argnums=(3, 4))(
            q, k, v, mx.array(mask.astype(np.float32)), mx.array(sinks.astype(np.float32)))
        np.testing.assert_allclose(np.array(g_mask), fd_mask, rtol=1e-3, atol=1e-5, err_msg=backend)
        np.testing.assert_allclose(np.array(g_sinks), fd_sinks, rtol=1e-3, atol=1e-5, err_msg=backend)


# ------------------------------------------------------------ caches under a window
def _band_mask(length, window, max_size, keep):
    """What a query at position p sees through RotatingKVCache(max_size, keep)
    (the first `keep` tokens and the `max_size - keep` most recent) and the
    window (the `window` most recent), causal."""
    p = np.arange(length)[:, None]
    j = np.arange(length)[None, :]
    visible = j <= p
    if max_size is not None:
        visible &= (j < keep) | (j > p - (max_size - keep))
    if window is not None:
        visible &= j > p - window
    return visible


def _decode_through(module, x, cache, chunk):
    outs, t = [], 0
    while t < x.shape[1]:
        step = chunk if t == 0 else 1
        piece = x[:, t:t + step]
        outs.append(module(piece, mask="causal", cache=cache))
        t += step
    return mx.concatenate(outs, axis=1)


CACHE_GRID = [  # window, cache, prefill chunk
    (4, ("rotating", 6, 0), 1),  # the finding: max_size > window, token by token
    (4, ("rotating", 4, 0), 1),
    (4, ("rotating", 6, 0), 3),
    (3, ("rotating", 8, 2), 1),
    (5, ("rotating", 5, 1), 2),
    (2, ("rotating", 7, 0), 4),
    (None, ("rotating", 5, 2), 1),
    (4, ("kv",), 1),
    (4, ("kv",), 5),
    (3, ("quantized",), 2),
]


@pytest.mark.parametrize("window, cache_spec, chunk", CACHE_GRID)
def test_caches_give_the_full_pass_answer_under_a_window(window, cache_spec, chunk):
    mx.random.seed(3)
    kind = cache_spec[0]
    head_dim = 32 if kind == "quantized" else None  # whole quantization groups
    module = MultiHeadAttention(64, 4, 2, head_dim=head_dim, window_size=window)
    x = mx.random.normal((1, 14, 64))
    if kind == "rotating":
        cache = RotatingKVCache(cache_spec[1], keep=cache_spec[2])
        band = mx.array(_band_mask(x.shape[1], window, cache_spec[1], cache_spec[2]))
        full = MultiHeadAttention.__call__(module, x, mask=band)
    else:
        cache = KVCache() if kind == "kv" else QuantizedKVCache(group_size=32, bits=8)
        full = module(x, mask="causal")
    got = _decode_through(module, x, cache, chunk)
    tol = 0.05 if kind == "quantized" else 1e-4
    np.testing.assert_allclose(np.array(got), np.array(full), atol=tol, rtol=tol)


# ------------------------------------------------------------ shapeless compile
@pytest.mark.parametrize("backend, d", [("reference", 8), ("auto", 320), ("auto", 8)])
@pytest.mark.parametrize("mask, window", [("causal", None), (None, 3), ("causal", 2)])
def test_shapeless_compile_follows_every_shape(backend, d, mask, window):
    def attend(q, k, v):
        return scaled_dot_product_attention(q, k, v, scale=0.3, mask=mask, window_size=window, backend=backend)

    compiled = mx.compile(attend, shapeless=True)
    for tq, tkv in [(4, 6), (3, 6), (4, 9), (1, 5), (6, 6)]:
        q, k, v, _ = _inputs(seed=tq * 10 + tkv, tq=tq, tkv=tkv, d=d)
        want = scaled_dot_product_attention(q, k, v, scale=0.3, mask=mask, window_size=window, backend="reference")
        got = compiled(q, k, v)
        assert got.shape == want.shape, (tq, tkv)
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-5, err_msg=f"{tq}, {tkv}")


# ------------------------------------------------------------ rows that see no key, with the lse
def _empty_row_mask(tq=TQ, tkv=TKV):
    mask = np.ones((tq, tkv), dtype=bool)
    mask[2] = False
    return mx.array(mask)


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_lse_rows_that_see_no_key_have_finite_derivatives(backend):
    q, k, v, _ = _inputs()
    mask = _empty_row_mask()

    def out_only(q, k, v):
        out, _ = scaled_dot_product_attention(q, k, v, scale=0.5, mask=mask, backend=backend, return_lse=True)
        return out.sum()

    def with_lse(q, k, v):
        out, lse = scaled_dot_product_attention(q, k, v, scale=0.5, mask=mask, backend=backend, return_lse=True)
        return out.sum() + mx.where(mx.isinf(lse), 0.0, lse).sum()

    for loss in (out_only, with_lse):
        for g in mx.grad(loss, argnums=(0, 1, 2))(q, k, v):
            assert np.isfinite(np.array(g)).all(), loss.__name__

    def lse_of(q):
        return scaled_dot_product_attention(q, k, v, scale=0.5, mask=mask, backend=backend, return_lse=True)[1]

    _, (tangent,) = mx.jvp(lse_of, [q], [mx.ones_like(q)])
    tangent = np.array(tangent)
    assert np.isfinite(tangent).all()
    assert (tangent[:, :, 2] == 0).all()  # the lse of a row that sees nothing is the constant -inf


# ------------------------------------------------------------ argument parsing
def test_a_huge_python_scale_is_a_value_error_naming_scale():
    q, k, v, _ = _inputs()
    for scale in (10**400, -(10**400)):
        with pytest.raises(ValueError, match="scale"):
            scaled_dot_product_attention(q, k, v, scale=scale)


@pytest.mark.parametrize("flag", [np.bool_(True), np.bool_(False)])
def test_numpy_bools_are_accepted_as_flags(flag):
    q, k, v, _ = _inputs()
    for backend in ("auto", "reference"):
        result = scaled_dot_product_attention(q, k, v, scale=0.5, return_lse=flag, backend=backend)
        assert isinstance(result, tuple) == bool(flag)
    module = MultiHeadAttention(16, 2)
    y = module(mx.ones((1, 3, 16)), return_weights=flag)
    assert isinstance(y, tuple) == bool(flag)


@pytest.mark.parametrize("flag", [1, "yes", None, mx.array(True)])
def test_other_flags_are_refused_naming_the_flag(flag):
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match="return_lse"):
        scaled_dot_product_attention(q, k, v, scale=0.5, return_lse=flag)


# ------------------------------------------------------------ distributed, on one rank
def _one_rank():
    return mx.distributed.init()


@pytest.mark.parametrize("k_shape", [None, (B, HKV, 0, D)])
def test_decode_attention_validates_on_a_rank_without_keys(k_shape):
    q, _, _, _ = _inputs(tq=1)
    k = v = None if k_shape is None else mx.zeros(k_shape)
    with pytest.raises(ValueError, match="scale"):
        distributed.decode_attention(q, k, v, scale=float("nan"), group=_one_rank())
    if k_shape is not None:
        bad = mx.zeros((B, 3, 0, D))
        with pytest.raises(ValueError, match="heads"):
            distributed.decode_attention(q, bad, bad, scale=1.0, group=_one_rank())


@pytest.mark.parametrize("timeout", [-1, 0, "soon", float("nan"), True])
def test_timeout_is_checked_on_a_group_of_one(timeout):
    q, k, v, _ = _inputs(tq=1)
    with pytest.raises(ValueError, match="timeout"):
        distributed.decode_attention(q, k, v, scale=1.0, group=_one_rank(), timeout=timeout)
    with pytest.raises(ValueError, match="timeout"):
        distributed.ring_attention(q, k[:, :, :1], v[:, :, :1], scale=1.0, group=_one_rank(), timeout=timeout)


@pytest.mark.parametrize("args", [(8, 0), (8, -1), (0, 2), (8, 2.0), (True, 1)])
def test_attention_work_refuses_bad_sizes(args):
    with pytest.raises(ValueError, match="ranks|seq_len"):
        distributed.attention_work(*args)


@pytest.mark.parametrize("content", ["not json", "{\"a\": 1}", "[[1, 2]]", "[]", "[\"host:1\"]"])
def test_a_malformed_hostfile_names_the_file_and_the_variable(tmp_path, monkeypatch, content):
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(content)
    monkeypatch.setenv("MLX_HOSTFILE", str(hostfile))
    monkeypatch.setenv("MLX_RANK", "0")
    with pytest.raises(ValueError, match="MLX_HOSTFILE") as info:
        distributed.init(backend="ring", timeout=5)
    assert str(hostfile) in str(info.value)


def test_a_rank_beyond_the_hostfile_is_refused(tmp_path, monkeypatch):
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([["127.0.0.1:5000"], ["127.0.0.1:5001"]]))
    monkeypatch.setenv("MLX_HOSTFILE", str(hostfile))
    monkeypatch.setenv("MLX_RANK", "2")
    with pytest.raises(ValueError, match="MLX_RANK=2"):
        distributed.init(backend="ring", timeout=5)


def test_a_missing_hostfile_names_the_file_and_the_variable(tmp_path, monkeypatch):
    missing = tmp_path / "nowhere.json"
    monkeypatch.setenv("MLX_HOSTFILE", str(missing))
    monkeypatch.setenv("MLX_RANK", "0")
    with pytest.raises(ValueError, match="MLX_HOSTFILE") as info:
        distributed.init(backend="ring", timeout=5)
    assert str(missing) in str(info.value)
