"""RoPE against mx.fast.rope and an independent NumPy implementation."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_attn import RoPE


def numpy_rope(x, dims, base, traditional, offset, scale=1.0):
    x = np.array(x, dtype=np.float64)
    t = x.shape[-2]
    out = x.copy()
    for p in range(t):
        for i in range(dims // 2):
            angle = scale * (p + offset) * base ** (-2.0 * i / dims)
            a, b = (2 * i, 2 * i + 1) if traditional else (i, i + dims // 2)
            x0, x1 = x[..., p, a], x[..., p, b]
            out[..., p, a] = x0 * np.cos(angle) - x1 * np.sin(angle)
            out[..., p, b] = x0 * np.sin(angle) + x1 * np.cos(angle)
    return out


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("dims,features", [(8, 8), (4, 8), (16, 16)])
@pytest.mark.parametrize("offset", [0, 5, 1000])
@pytest.mark.parametrize("base", [10000.0, 100000.0])
def test_matches_numpy_and_mx_fast(traditional, dims, features, offset, base):
    x = mx.random.normal((2, 3, 6, features))
    rope = RoPE(dims, base=base, traditional=traditional)
    got = rope(x, offset=offset)
    np.testing.assert_allclose(np.array(got), numpy_rope(x, dims, base, traditional, offset), atol=2e-4)
    fast = mx.fast.rope(x, dims, traditional=traditional, base=base, scale=1.0, offset=offset)
    np.testing.assert_allclose(np.array(got), np.array(fast), atol=2e-4)


def test_scale_and_dtype():
    x = mx.random.normal((1, 1, 5, 8)).astype(mx.float16)
    got = RoPE(8, scale=0.5)(x, offset=3)
    assert got.dtype == mx.float16
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), numpy_rope(x.astype(mx.float32), 8, 10000.0, False, 3, 0.5), atol=3e-3)


def test_rotation_preserves_norms_and_relative_positions():
    rope = RoPE(16)
    q = mx.random.normal((1, 1, 1, 16))
    k = mx.random.normal((1, 1, 1, 16))
    np.testing.assert_allclose(np.linalg.norm(np.array(rope(q, offset=7))), np.linalg.norm(np.array(q)), rtol=1e-5)
    # the score depends only on the distance between positions
    s1 = (rope(q, offset=10) * rope(k, offset=4)).sum().item()
    s2 = (rope(q, offset=106) * rope(k, offset=100)).sum().item()
    assert abs(s1 - s2) < 1e-4


def test_offset_matches_slicing_a_longer_sequence():
    rope = RoPE(8)
    x = mx.random.normal((1, 2, 10, 8))
    np.testing.assert_allclose(np.array(rope(x)[:, :, 6:]), np.array(rope(x[:, :, 6:], offset=6)), atol=1e-5)


@pytest.mark.parametrize("dims", [0, 3, -2])
def test_invalid(dims):
    with pytest.raises(ValueError, match="even"):
        RoPE(dims)
    with pytest.raises(ValueError, match="features"):
        RoPE(8)(mx.zeros((1, 4, 6)))


def test_a_position_array_met_again_rotates_as_a_fresh_one():
    """The per-step positions reused by every layer share one rotation; a
    new array of other positions (the next step) is rotated anew."""
    rope = RoPE(16, base=500.0)
    x = mx.random.normal((1, 2, 3, 16), key=mx.random.key(0))
    first = mx.array([4, 0, 9], dtype=mx.int32)
    a = rope(x, first)
    b = RoPE(16, base=500.0)(x, first)  # another layer's module, same step
    second = mx.array([5, 1, 10], dtype=mx.int32)
    c = rope(x, second)
    for got, positions in ((a, [4, 0, 9]), (b, [4, 0, 9]), (c, [5, 1, 10])):
        want = mx.concatenate([rope(x[:, :, i:i + 1], positions[i]) for i in range(3)], axis=2)
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-6, atol=1e-6)
