"""Drop-in parity with mx.fast.scaled_dot_product_attention under MLX's
function transforms (vmap, jvp, vjp/grad, compile with and without
shapeless=True) and for every scale type mx.fast accepts, on the CPU."""

import mlx.core as mx
import numpy as np
import pytest

import mlx_attn
from sdpa_cases import TOLERANCE, make_qkv, max_abs_diff

sdpa = mlx_attn.scaled_dot_product_attention
fast = mx.fast.scaled_dot_product_attention

MASKS = [None, "causal", "bool", "additive"]


def mask_for(kind, tq, tkv, seed=0):
    rng = np.random.default_rng(seed)
    if kind == "bool":
        visible = rng.random((tq, tkv)) > 0.3
        visible[:, -1] = True  # every row sees a key: mx.fast averages fully masked rows
        return mx.array(visible)
    if kind == "additive":
        return mx.array(rng.standard_normal((tq, tkv)).astype(np.float32))
    return kind


def assert_matches_fast(ours, theirs, tolerance=TOLERANCE[mx.float32]):
    err = max_abs_diff(ours, theirs)
    assert err <= tolerance, f"max abs error {err} > {tolerance}"


def test_default_path_is_fused():
    q, k, v = make_qkv(1, 4, 2, 5, 7, 8)
    assert mlx_attn.attention_path(q, k, v, scale=0.5) == "fused-cpu"


@pytest.mark.parametrize("mask", MASKS, ids=str)
@pytest.mark.parametrize(
    "in_axes",
    [(0, 0, 0), (2, 0, 1), (0, None, None), (None, 0, 0), (4, None, 3)],
    ids=lambda a: "-".join(map(str, a)),
)
def test_vmap(mask, in_axes):
    q, k, v = make_qkv(2, 4, 2, 5, 7, 8)
    mapped = 3

    def stack(x, axis, seed):
        if axis is None:
            return x
        rng = np.random.default_rng(seed)
        copies = [x * float(rng.uniform(0.5, 1.5)) for _ in range(mapped)]
        return mx.stack(copies, axis=axis)

    args = [stack(x, a, i) for i, (x, a) in enumerate(zip((q, k, v), in_axes))]
    m = mask_for(mask, 5, 7)
    ours = mx.vmap(lambda q, k, v: sdpa(q, k, v, scale=0.4, mask=m), in_axes=in_axes)(*args)
    theirs = mx.vmap(lambda q, k, v: fast(q, k, v, scale=0.4, mask=m), in_axes=in_axes)(*args)
    assert_matches_fast(ours, theirs)


@pytest.mark.parametrize("mask_axis", [0, 1, None])
def test_vmap_over_masks_and_sinks(mask_axis):
    q, k, v = make_qkv(1, 4, 2, 5, 7, 8)
    rng = np.random.default_rng(1)
    masks = mx.array(rng.standard_normal((3, 1, 4, 5, 7)).astype(np.float32))
    if mask_axis is None:
        masks = masks[0]
    elif mask_axis == 1:
        masks = masks.swapaxes(0, 1)
    sinks = mx.array(rng.standard_normal((3, 4)).astype(np.float32))
    ours = mx.vmap(lambda m, s: sdpa(q, k, v, scale=0.4, mask=m, sinks=s), in_axes=(mask_axis, 0))(masks, sinks)
    theirs = mx.vmap(lambda m, s: fast(q, k, v, scale=0.4, mask=m, sinks=s), in_axes=(mask_axis, 0))(masks, sinks)
    assert_matches_fast(ours, theirs)


@pytest.mark.parametrize("mask", MASKS, ids=str)
def test_jvp(mask):
    q, k, v = make_qkv(1, 4, 2, 5, 7, 8)
    tq, tk, tv = make_qkv(1, 4, 2, 5, 7, 8, seed=1)
    m = mask_for(mask, 5, 7)
    outs = [
        mx.jvp(lambda q, k, v: fn(q, k, v, scale=0.4, mask=m), [q, k, v], [tq, tk, tv])
        for fn in (sdpa, fast)
    ]
    assert_matches_fast(outs[0][0][0], outs[1][0][0])
    assert_matches_fast(outs[0][1][0], outs[1][1][0], 1e-4)


@pytest.mark.parametrize("mask", MASKS, ids=str)
def test_vjp_and_grad(mask):
    q, k, v = make_qkv(1, 4, 2, 5, 7, 8)
    sinks = mx.array([0.3, -0.2, 1.0, 0.0])
    m = mask_for(mask, 5, 7)
    cotangent = make_qkv(1, 4, 2, 5, 7, 8, seed=2)[0]
    grads = [
        mx.vjp(lambda q, k, v, s: fn(q, k, v, scale=0.4, mask=m, sinks=s), [q, k, v, sinks], [cotangent])[1]
        for fn in (sdpa, fast)
    ]
    for ours, theirs in zip(*grads):
        assert_matches_fast(ours, theirs, 1e-4)
    loss = [mx.grad(lambda q: fn(q, k, v, scale=0.4, mask=m).sum())(q) for fn in (sdpa, fast)]
    assert_matches_fast(*loss, 1e-4)


@pytest.mark.parametrize("shapeless", [False, True])
@pytest.mark.parametrize("mask", MASKS, ids=str)
def test_compile_with_changing_lengths(shapeless, mask):
    """Changing Tq/Tkv between calls of a compiled function gives the answer
    for the new shapes (no stale shape baked in by the trace)."""

    def attend(fn):
        def f(q, k, v, *m):
            return fn(q, k, v, scale=0.4, mask=m[0] if m else (mask if mask == "causal" else None))

        return f

    compiled = mx.compile(attend(sdpa), shapeless=shapeless)
    for i, (tq, tkv) in enumerate([(5, 7), (3, 9), (6, 6), (1, 12)]):
        q, k, v = make_qkv(1, 4, 2, tq, tkv, 8, seed=i)
        extra = [mask_for(mask, tq, tkv, seed=i)] if mask in ("bool", "additive") else []
        assert_matches_fast(compiled(q, k, v, *extra), attend(fast)(q, k, v, *extra))


SCALES = [
    2,
    0.25,
    True,
    np.float32(0.3),
    np.float64(0.3),
    np.float16(0.3),
    np.int64(2),
    np.array(0.3),
    np.array(0.3, dtype=np.float16),
    mx.array(0.3),
    mx.array([0.3]),
    mx.array(0.3, dtype=mx.float16),
    mx.array(1),
]


@pytest.mark.parametrize("scale", SCALES, ids=lambda s: f"{type(s).__name__}-{s!r}"[:40])
def test_scale_types_mx_fast_accepts(scale):
    q, k, v = make_qkv(1, 2, 2, 4, 6, 8)
    assert_matches_fast(sdpa(q, k, v, scale=scale), fast(q, k, v, scale=scale))


@pytest.mark.parametrize("scale", [np.array([0.3]), "0.3", None, mx.array([0.3, 0.4]), 1 + 2j, [0.3]],
                         ids=lambda s: f"{type(s).__name__}")
def test_scale_types_mx_fast_rejects(scale):
    q, k, v = make_qkv(1, 2, 2, 4, 6, 8)
    with pytest.raises(TypeError):
        fast(q, k, v, scale=scale)
    with pytest.raises(ValueError, match="scale"):
        sdpa(q, k, v, scale=scale)


@pytest.mark.parametrize("mask", [None, "bool", "additive"], ids=str)
def test_grad_under_shapeless_compile_with_changing_lengths(mask):
    """The fused op's gradient is the reference path's, written with
    shape-free ops, so a shapeless compiled gradient follows new lengths
    (mx.fast itself manages this without a mask only; causal masks need
    concrete lengths on both)."""

    def loss(fn):
        def f(q, k, v, *m):
            return (fn(q, k, v, scale=0.4, mask=m[0] if m else None) ** 2).sum()

        return mx.grad(f, argnums=(0, 1, 2))

    compiled = mx.compile(loss(sdpa), shapeless=True)
    for i, (tq, tkv) in enumerate([(5, 7), (3, 9), (2, 2)]):
        q, k, v = make_qkv(1, 4, 2, tq, tkv, 8, seed=i)
        extra = [mask_for(mask, tq, tkv, seed=i)] if mask else []
        for ours, theirs in zip(compiled(q, k, v, *extra), loss(fast)(q, k, v, *extra)):
            assert_matches_fast(ours, theirs, 1e-4)
