"""MultiHeadAttention: MHA / GQA / MQA, self and cross attention, invariants."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_attn import MultiHeadAttention, RoPE
from mlx_attn.masks import padding_mask, query_key_padding_mask


def n_params(module):
    return sum(v.size for _, v in tree_flatten(module.parameters()))


def numpy_mha(mha, x, kv=None, causal=False):
    """Independent float64 computation from the module's weights (separate
    projections, no RoPE), with K/V heads repeated explicitly per group."""
    w = {k: np.array(v, dtype=np.float64) for k, v in tree_flatten(mha.parameters())}
    xs = np.array(x, dtype=np.float64)
    src = xs if kv is None else np.array(kv, dtype=np.float64)

    def lin(name, a):
        out = a @ w[f"{name}.weight"].T
        return out + w[f"{name}.bias"] if f"{name}.bias" in w else out

    b, t, _ = xs.shape
    s = src.shape[1]
    hd, h, hkv = mha.head_dim, mha.n_heads, mha.n_kv_heads
    q = lin("q_proj", xs).reshape(b, t, h, hd).transpose(0, 2, 1, 3)
    k = lin("k_proj", src).reshape(b, s, hkv, hd).transpose(0, 2, 1, 3)
    v = lin("v_proj", src).reshape(b, s, hkv, hd).transpose(0, 2, 1, 3)
    k, v = np.repeat(k, h // hkv, axis=1), np.repeat(v, h // hkv, axis=1)
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd)
    if causal:
        scores = np.where(np.tril(np.ones((t, s), dtype=bool), s - t), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    out = (weights @ v).transpose(0, 2, 1, 3).reshape(b, t, h * hd)
    return lin("o_proj", out)


@pytest.mark.parametrize("n_heads,n_kv", [(4, 4), (6, 2), (6, 3), (4, 1)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", ["fused", "reference"])
def test_matches_independent_numpy(n_heads, n_kv, bias, causal, backend):
    mx.random.seed(0)
    mha = MultiHeadAttention(48, n_heads, n_kv, bias=bias, backend=backend)
    x = mx.random.normal((2, 11, 48))
    y = mha(x, mask="causal" if causal else None)
    np.testing.assert_allclose(np.array(y), numpy_mha(mha, x, causal=causal), atol=1e-4)


def test_cross_attention_rectangular():
    mx.random.seed(1)
    mha = MultiHeadAttention(32, 8, 2)
    x, memory = mx.random.normal((3, 5, 32)), mx.random.normal((3, 17, 32))
    y, w = mha(x, memory, return_weights=True)
    assert y.shape == (3, 5, 32) and w.shape == (3, 8, 5, 17)
    np.testing.assert_allclose(np.array(y), numpy_mha(mha, x, memory), atol=1e-4)
    np.testing.assert_allclose(np.array(mha(x, memory)), np.array(y), atol=1e-5)  # fused == reference


def test_fused_qkv_equals_separate_projections():
    mx.random.seed(2)
    separate = MultiHeadAttention(32, 4, 2, bias=True)
    fused = MultiHeadAttention(32, 4, 2, bias=True, fused_qkv=True)
    fused.qkv_proj.weight = mx.concatenate([separate.q_proj.weight, separate.k_proj.weight, separate.v_proj.weight])
    fused.qkv_proj.bias = mx.concatenate([separate.q_proj.bias, separate.k_proj.bias, separate.v_proj.bias])
    fused.o_proj = separate.o_proj
    x = mx.random.normal((2, 9, 32))
    np.testing.assert_allclose(np.array(fused(x, mask="causal")), np.array(separate(x, mask="causal")), atol=1e-5)
    with pytest.raises(ValueError, match="self-attention"):
        fused(x, x)


@pytest.mark.parametrize("d_model,n_heads,n_kv,bias,expected", [
    (64, 8, 8, False, 4 * 64 * 64),                          # MHA: 4 d^2
    (64, 8, 8, True, 4 * 64 * 64 + 4 * 64),                  # + biases
    (64, 8, 2, False, 2 * 64 * 64 + 2 * 64 * (2 * 8)),       # GQA: K/V project to 2 heads of 8
    (64, 8, 1, False, 2 * 64 * 64 + 2 * 64 * 8),             # MQA
])
def test_parameter_counts(d_model, n_heads, n_kv, bias, expected):
    assert n_params(MultiHeadAttention(d_model, n_heads, n_kv, bias=bias)) == expected


def test_weights_sum_to_one_and_causal_zeros():
    mx.random.seed(3)
    mha = MultiHeadAttention(16, 4, 2, rope=RoPE(4))
    _, w = mha(mx.random.normal((2, 7, 16)), mask="causal", return_weights=True)
    w = np.array(w)
    np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-6)
    assert np.all(w[..., np.triu_indices(7, 1)[0], np.triu_indices(7, 1)[1]] == 0)


@pytest.mark.parametrize("backend", ["fused", "reference"])
def test_causal_output_never_depends_on_later_tokens(backend):
    mx.random.seed(4)
    mha = MultiHeadAttention(32, 4, 1, rope=RoPE(8), backend=backend)
    x = mx.random.normal((1, 12, 32))
    changed = mx.concatenate([x[:, :6], mx.random.normal((1, 6, 32))], axis=1)
    a, b = np.array(mha(x, mask="causal")), np.array(mha(changed, mask="causal"))
    np.testing.assert_array_equal(a[:, :6], b[:, :6])
    assert not np.allclose(a[:, 6:], b[:, 6:])


def test_batch_independence_and_determinism():
    mx.random.seed(5)
    mha = MultiHeadAttention(32, 4, 2, rope=RoPE(8))
    x = mx.random.normal((3, 10, 32))
    together = np.array(mha(x, mask="causal"))
    for i in range(3):
        np.testing.assert_allclose(together[i : i + 1], np.array(mha(x[i : i + 1], mask="causal")), atol=1e-6)
    np.testing.assert_array_equal(together, np.array(mha(x, mask="causal")))


def test_padding_keys_and_queries():
    """Batch of different lengths: real positions match the unpadded
    sequence, padded query rows are exactly zero before o_proj (no NaN)."""
    mx.random.seed(6)
    mha = MultiHeadAttention(16, 2, bias=False)
    x = mx.random.normal((2, 6, 16))
    lengths = [6, 3]
    y = np.array(mha(x, mask=padding_mask(lengths)))
    short = np.array(mha(x[1:, :3]))
    np.testing.assert_allclose(y[1, :3], short[0], atol=1e-5)
    y2 = np.array(mha(x, mask=query_key_padding_mask(lengths)))
    assert np.isfinite(y2).all()
    bias_only = np.zeros(16) if mha.o_proj.get("bias") is None else np.array(mha.o_proj.bias)
    np.testing.assert_allclose(y2[1, 3:], np.broadcast_to(bias_only, (3, 16)), atol=1e-6)


def test_large_head_dim_is_stable():
    mx.random.seed(7)
    mha = MultiHeadAttention(2048, 2, head_dim=1024)
    x = mx.random.normal((1, 5, 2048)) * 10
    y = mha(x, mask="causal")
    assert np.isfinite(np.array(y)).all()
    np.testing.assert_allclose(np.array(y), numpy_mha(mha, x, causal=True), rtol=1e-3, atol=1e-3)


def test_gradients_reach_every_parameter():
    mx.random.seed(8)
    mha = MultiHeadAttention(16, 4, 2, bias=True, rope=RoPE(4), dropout=0.1)
    mha.train()
    x = mx.random.normal((2, 5, 16))

    def loss(params):
        mha.update(params)
        return (mha(x, mask="causal") ** 2).sum()

    grads = dict(tree_flatten(mx.grad(loss)(mha.trainable_parameters())))
    assert set(grads) == {k for k, _ in tree_flatten(mha.trainable_parameters())}
    for name, g in grads.items():
        g = np.array(g)
        assert np.isfinite(g).all(), name
        assert np.abs(g).max() > 0, name


def test_dropout_only_in_training():
    mx.random.seed(9)
    mha = MultiHeadAttention(16, 4, dropout=0.5)
    x = mx.random.normal((1, 8, 16))
    mha.eval()
    np.testing.assert_array_equal(np.array(mha(x)), np.array(mha(x)))
    mha.train()
    assert not np.allclose(np.array(mha(x)), np.array(mha(x)))


@pytest.mark.parametrize("kwargs,message", [
    (dict(d_model=30, n_heads=4), "divisible"),
    (dict(d_model=32, n_heads=4, n_kv_heads=3), "multiple"),
    (dict(d_model=32, n_heads=0), "positive"),
    (dict(d_model=32, n_heads=4, dropout=1.0), "dropout"),
    (dict(d_model=32, n_heads=4, backend="tpu"), "backend"),
    (dict(d_model=32, n_heads=4, rope=RoPE(16)), "head_dim"),
])
def test_invalid_configurations(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MultiHeadAttention(**kwargs)


def test_mismatched_inputs():
    mha = MultiHeadAttention(32, 4)
    with pytest.raises(ValueError, match="32"):
        mha(mx.zeros((1, 5, 31)))
    with pytest.raises(ValueError, match=r"\[batch, length"):
        mha(mx.zeros((5, 32)))
    with pytest.raises(ValueError, match="batch sizes differ"):
        mha(mx.zeros((2, 5, 32)), mx.zeros((3, 4, 32)))
    with pytest.raises(ValueError, match="broadcast"):
        mha(mx.zeros((1, 5, 32)), mask=mx.ones((4, 4), dtype=mx.bool_))


def test_is_an_mlx_module():
    mha = MultiHeadAttention(16, 2)
    assert isinstance(mha, nn.Module)
    assert {"q_proj", "k_proj", "v_proj", "o_proj"} <= set(mha.children())


def test_module_compiles_with_an_additive_mask():
    """Validation never reads mask values, so a model with an additive mask
    compiles (an evaluation inside mx.compile would raise)."""
    mx.random.seed(3)
    mha = MultiHeadAttention(32, 4, n_kv_heads=2)
    x = mx.random.normal((2, 6, 32))
    mask = mx.where(mx.tril(mx.ones((6, 6), dtype=mx.bool_)), 0.0, -mx.inf)
    compiled = mx.compile(lambda x, m: mha(x, mask=m))
    got = compiled(x, mask)
    want = numpy_mha(mha, x, causal=True)
    assert np.abs(np.array(got, dtype=np.float64) - want).max() < 1e-4
