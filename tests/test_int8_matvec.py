"""The integer-dot quantized matrix-vector product (``_ext.quantized_matvec_int8``,
csrc/cpu/int8_matvec_impl.h) against a float64 NumPy product of the same
dequantized weight, within the stated bound
(:func:`mlx_attn.lm.quantized_matmul.int8_error_bound`: only the activations
are rounded, to int8 or int16 per 32 columns), on every instruction-set copy
this CPU runs; and on the default model: its layers within the bound, its
logits within a stated bound of the float product's (int8) and its greedy
tokens the float product's (int16, the default)."""

import os

import mlx.core as mx
import numpy as np
import pytest

from mlx_attn import _ext
from mlx_attn.lm import quantized_matmul
from mlx_attn.lm.quantized_matmul import int8_error_bound

ISAS = list(_ext.supported_cpu_isas())
# MLX_ATTN_FULL_GRID=1: more row counts of the many-row product
FULL_GRID = os.environ.get("MLX_ATTN_FULL_GRID") == "1"
# float32 rounding of the sums, relative to |x| @ |W|.T
FLOAT_SUM_TOLERANCE = 2e-6


@pytest.fixture(params=ISAS)
def isa(request):
    before = _ext.cpu_isa()
    _ext.set_cpu_isa(request.param)
    yield request.param
    _ext.set_cpu_isa(before)


def _weight(n, k, bits, group_size, dtype, seed):
    w = mx.random.normal((n, k), key=mx.random.key(seed)) * 0.1
    codes, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
    return codes, scales.astype(dtype), biases.astype(dtype)


def _float_parts(codes, scales, biases, group_size, bits):
    """(the dequantized weight, |scale * code|) in float64."""
    s32, b32 = scales.astype(mx.float32), biases.astype(mx.float32)
    w = mx.dequantize(codes, s32, b32, group_size=group_size, bits=bits)
    scaled_codes = mx.dequantize(codes, s32, mx.zeros_like(b32), group_size=group_size, bits=bits)
    return np.array(w, dtype=np.float64), np.abs(np.array(scaled_codes, dtype=np.float64))


def _assert_within_bound(got, x, w, scaled_codes, activation_bits=8):
    x64 = np.array(x, dtype=np.float64)
    expected = x64 @ w.T
    allowed = int8_error_bound(x64, scaled_codes, activation_bits) + FLOAT_SUM_TOLERANCE * (np.abs(x64) @ np.abs(w).T) + 1e-7
    error = np.abs(np.array(got, dtype=np.float64) - expected)
    assert np.all(error <= allowed), f"worst excess {np.max(error - allowed)}, worst error {error.max()}"
    return error


@pytest.mark.parametrize("activation_bits", [8, 16])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size,k", [(32, 224), (64, 384), (128, 256)])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_within_the_stated_bound_of_the_float_product(isa, activation_bits, bits, group_size, k, dtype):
    # 11 rows: one 8-row pass and a 3-row one; 70 outputs: a partial thread task;
    # k = 224: 7 blocks (the AVX-512 copy's one-block tail)
    codes, scales, biases = _weight(70, k, bits, group_size, dtype, seed=bits + k)
    x = mx.random.normal((11, k), key=mx.random.key(k)) * mx.random.uniform(0.1, 3.0, (11, 1), key=mx.random.key(1))
    got = _ext.quantized_matvec_int8(x, codes, scales, biases, group_size, bits, activation_bits)
    assert got.shape == (11, 70) and got.dtype == mx.float32
    w, scaled_codes = _float_parts(codes, scales, biases, group_size, bits)
    error = _assert_within_bound(got, x, w, scaled_codes, activation_bits)
    # the bound is what a wrong block layout would break: it is ~1/254 of |x| @ |W|.T
    assert error.max() > 0


@pytest.mark.parametrize("activation_bits", [8, 16])
@pytest.mark.parametrize("rows", [3, 12])
def test_rows_of_many_scale_chunks_and_every_row_alike(isa, activation_bits, rows):
    # 300 groups of 32: more than one chunk of 256 converted scales per output;
    # 3 rows: AVX-512's int16 register-only path, 12: its panel of weight vectors
    k = 300 * 32
    codes, scales, biases = _weight(33, k, 4, 32, mx.float16, seed=5)
    x = mx.random.normal((rows, k), key=mx.random.key(6))
    got = _ext.quantized_matvec_int8(x, codes, scales, biases, 32, 4, activation_bits)
    _assert_within_bound(got, x, *_float_parts(codes, scales, biases, 32, 4), activation_bits)
    # a row's result does not depend on the rows beside it
    alone = _ext.quantized_matvec_int8(x[1:2], codes, scales, biases, 32, 4, activation_bits)
    np.testing.assert_array_equal(np.array(got[1:2]), np.array(alone))


MANY_ROWS = [2, 9, 33, 130] + ([64, 128] if FULL_GRID else [])


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size,k", [(32, 224), (64, 320), (128, 384)])
@pytest.mark.parametrize("rows", MANY_ROWS)
def test_many_rows_within_the_bound_and_each_as_alone(isa, bits, group_size, k, rows):
    # 37 outputs: two 16-output tiles and a 5-output tail (and a partial thread
    # task); k: 7, 10 and 12 blocks, so 4-bit chunks of 4 blocks and 8-bit ones
    # of 2 end short; 130 rows: more than one 128-row pass
    n = 37
    codes, scales, biases = _weight(n, k, bits, group_size, mx.bfloat16, seed=rows * 8 + bits)
    x = mx.random.normal((rows, k), key=mx.random.key(rows)) * mx.random.uniform(0.1, 3.0, (rows, 1),
                                                                                 key=mx.random.key(2))
    got = _ext.quantized_matvec_int8(x, codes, scales, biases, group_size, bits, 16)
    assert got.shape == (rows, n)
    error = _assert_within_bound(got, x, *_float_parts(codes, scales, biases, group_size, bits), 16)
    assert error.max() > 0
    for row in sorted({0, rows // 2, rows - 1}):
        alone = _ext.quantized_matvec_int8(x[row:row + 1], codes, scales, biases, group_size, bits, 16)
        np.testing.assert_array_equal(np.array(got[row:row + 1]), np.array(alone), err_msg=f"row {row}")


@pytest.mark.parametrize("activation_bits", [8, 16])
@pytest.mark.parametrize("bits", [4, 8])
def test_several_weights_in_one_call_equal_one_call_each(isa, activation_bits, bits):
    # a layer's Q/K/V: weights of different widths (70: a partial thread task), scale dtypes, one x
    weights = [_weight(n, 128, bits, 32, dtype, seed=n) for n, dtype in
               ((70, mx.float16), (32, mx.bfloat16), (96, mx.float32))]
    x = mx.random.normal((5, 128), key=mx.random.key(3))
    together = _ext.quantized_matvec_int8_many(x, [w[0] for w in weights], [w[1] for w in weights],
                                               [w[2] for w in weights], 32, bits, activation_bits)
    assert [t.shape for t in together] == [(5, 70), (5, 32), (5, 96)]
    for got, (codes, scales, biases) in zip(together, weights):
        alone = _ext.quantized_matvec_int8(x, codes, scales, biases, 32, bits, activation_bits)
        np.testing.assert_array_equal(np.array(got), np.array(alone))
    # a transposed (strided) x reads as its values
    strided = _ext.quantized_matvec_int8_many(mx.array(np.array(x).T.copy()).T, [weights[0][0]], [weights[0][1]],
                                              [weights[0][2]], 32, bits, activation_bits)
    np.testing.assert_array_equal(np.array(strided[0]), np.array(together[0]))
    # so does a strided x not yet evaluated (a lazy transpose, and a slice of every other column pair)
    lazy = (mx.array(np.array(x).T.copy()) * 1.0).T
    lazy_out = _ext.quantized_matvec_int8_many(lazy, [weights[0][0]], [weights[0][1]], [weights[0][2]], 32, bits,
                                               activation_bits)
    np.testing.assert_array_equal(np.array(lazy_out[0]), np.array(together[0]))
    wide = mx.concatenate([x[:, :, None], mx.zeros((5, 128, 1))], axis=2).reshape(5, 256)
    sliced = _ext.quantized_matvec_int8_many(wide[:, ::2], [weights[0][0]], [weights[0][1]], [weights[0][2]], 32, bits,
                                             activation_bits)
    np.testing.assert_array_equal(np.array(sliced[0]), np.array(together[0]))


def test_leading_axes_of_x_pass_through():
    codes, scales, biases = _weight(40, 64, 4, 32, mx.float16, seed=8)
    x = mx.random.normal((2, 3, 64), key=mx.random.key(8))
    got = _ext.quantized_matvec_int8(x, codes, scales, biases, 32, 4, 16)
    assert got.shape == (2, 3, 40)
    flat = _ext.quantized_matvec_int8(x.reshape(6, 64), codes, scales, biases, 32, 4, 16)
    np.testing.assert_array_equal(np.array(got).reshape(6, 40), np.array(flat))
    # no columns: zeros of the right shape
    empty = _ext.quantized_matvec_int8(mx.zeros((2, 3, 0)), codes[:, :0], scales[:, :0], biases[:, :0], 32, 4, 16)
    assert empty.shape == (2, 3, 40)
    np.testing.assert_array_equal(np.array(empty), np.zeros((2, 3, 40), np.float32))


def test_gradient_of_several_weights_sums_over_them():
    weights = [_weight(n, 64, 4, 32, mx.float32, seed=n) for n in (48, 16)]
    x = mx.random.normal((2, 64), key=mx.random.key(4))
    cotangents = [mx.random.normal((2, n), key=mx.random.key(n)) for n in (48, 16)]

    def loss(v):
        outs = _ext.quantized_matvec_int8_many(v, *[[w[i] for w in weights] for i in range(3)], 32, 4, 16)
        return sum((out * c).sum() for out, c in zip(outs, cotangents))

    expected = sum(np.array(c, dtype=np.float64) @ _float_parts(*w, 32, 4)[0] for c, w in zip(cotangents, weights))
    np.testing.assert_allclose(np.array(mx.grad(loss)(x)), expected, rtol=1e-4, atol=1e-5)


def test_llama_decode_multiplies_qkv_and_gate_up_in_one_call_each(monkeypatch):
    import mlx.nn as nn

    from mlx_attn.lm.models import llama
    from mlx_attn.lm.quantized_matmul import use_row_adaptive_matmuls

    mx.random.seed(0)
    model = llama.Llama(llama.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2))
    nn.quantize(model, group_size=32, bits=4)
    use_row_adaptive_matmuls(model)
    calls = []
    many = _ext.quantized_matvec_int8_many
    monkeypatch.setattr(_ext, "quantized_matvec_int8_many", lambda x, codes, *a, **kw: calls.append(
        (len(codes), *(kw.get(name) is not None for name in ("norm_weight", "gate", "residual")))) or
        many(x, codes, *a, **kw))
    tokens = mx.array([[3]])
    normalized_inside = model(tokens)
    # per layer: Q/K/V taking the RMSNorm inside, o_proj adding the residual, gate/up taking the norm, down_proj
    # taking silu(gate) * up and adding the residual
    layer_calls = [(3, True, False, False), (1, False, False, True), (2, True, False, False), (1, False, True, True)]
    assert calls == layer_calls * 2
    monkeypatch.setattr(quantized_matmul, "fusable_norm", lambda norm: False)  # the norms as MLX ops
    fused = model(tokens)
    assert [call[:2] for call in calls[8:]] == [(3, False), (1, False), (2, False), (1, False)] * 2
    monkeypatch.setattr(llama, "fused_matvecs", lambda x, layers, norm=None: None)
    np.testing.assert_array_equal(np.array(fused), np.array(model(tokens)))
    # the norm inside the call rounds its sum in another order than MLX's: float32 rounding apart
    np.testing.assert_allclose(np.array(normalized_inside), np.array(fused), rtol=1e-4, atol=1e-4)
    # the SwiGLU and the residual adds as MLX ops: the adds are float32's either way, but the SwiGLU's exp
    # differs from MLX's by an ulp here and there, which moves an activation's int16 code (1/32767 of its
    # block's largest) at times (measured: 1.3e-4 of logits up to 3)
    monkeypatch.setattr(llama, "fused_product", lambda *a, **kw: None)
    np.testing.assert_allclose(np.array(model(tokens)), np.array(fused), rtol=0, atol=1e-3)


@pytest.mark.parametrize("rows", [1, 3])
def test_rms_norm_inside_the_product_is_the_product_of_the_norm(rows):
    """norm_weight: the product of RMSNorm(x) (MLX's own), within float32
    rounding of the norm (the integer products are the same code path);
    its gradient to x goes through the norm."""
    mx.random.seed(1)
    k = 96
    x = mx.random.normal((rows, k)) * 3.0
    weight = mx.random.normal((40, k))
    codes, scales, biases = mx.quantize(weight, group_size=32, bits=4)
    norm_weight = mx.random.uniform(0.5, 1.5, (k,))
    got = _ext.quantized_matvec_int8_many(x, [codes], [scales], [biases], 32, 4, 16, norm_weight=norm_weight,
                                          norm_eps=1e-5)[0]
    normed = mx.fast.rms_norm(x, norm_weight, 1e-5)
    expected = _ext.quantized_matvec_int8(normed, codes, scales, biases, 32, 4, 16)
    scale = float(mx.abs(expected).max())
    np.testing.assert_allclose(np.array(got), np.array(expected), rtol=0, atol=1e-5 * scale)
    assert not np.allclose(np.array(got), np.array(_ext.quantized_matvec_int8(x, codes, scales, biases, 32, 4, 16)),
                           atol=1e-2 * scale)  # the norm did change the product
    cotangent = mx.random.normal((rows, 40))
    grad = mx.grad(lambda a: (_ext.quantized_matvec_int8_many(a, [codes], [scales], [biases], 32, 4, 16,
                                                              norm_weight=norm_weight)[0] * cotangent).sum())(x)
    float_weight = mx.dequantize(codes, scales, biases, group_size=32, bits=4)
    expected_grad = mx.grad(lambda a: ((mx.fast.rms_norm(a, norm_weight, 1e-5) @ float_weight.T) * cotangent).sum())(x)
    np.testing.assert_allclose(np.array(grad), np.array(expected_grad), rtol=1e-4, atol=1e-5)
    # the norm's weight stays trainable (a quantized model's RMSNorms are float parameters)
    norm_grad = mx.grad(lambda g: (_ext.quantized_matvec_int8_many(x, [codes], [scales], [biases], 32, 4, 16,
                                                                   norm_weight=g)[0] * cotangent).sum())(norm_weight)
    expected_norm_grad = mx.grad(lambda g: ((mx.fast.rms_norm(x, g, 1e-5) @ float_weight.T) * cotangent).sum())(
        norm_weight)
    np.testing.assert_allclose(np.array(norm_grad), np.array(expected_norm_grad), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("change,message", [
    (dict(norm_weight=mx.ones((95,))), r"norm_weight must be float32 \[96\]"),
    (dict(norm_weight=mx.ones((96,), dtype=mx.float16)), r"norm_weight must be float32 \[96\]"),
    (dict(norm_weight=mx.ones((96,)), norm_eps=float("nan")), "norm_eps must be finite"),
])
def test_bad_norm_arguments_are_named(change, message):
    codes, scales, biases = mx.quantize(mx.ones((8, 96)), group_size=32, bits=4)
    with pytest.raises(ValueError, match=message):
        _ext.quantized_matvec_int8_many(mx.ones((1, 96)), [codes], [scales], [biases], 32, 4, 16, **change)


@pytest.mark.parametrize("rows", [1, 5])
def test_swiglu_inside_the_product_is_the_product_of_silu_gate_times_up(isa, rows):
    """gate: the product of silu(gate) * x, within the bound of the
    activations' rounding against a float64 product of float64 SwiGLU
    activations (independent of MLX's sigmoid and of ours), saturated gates
    included; a gate of -inf gives NaN as silu(-inf) * x does in MLX."""
    k, n = 128, 40
    codes, scales, biases = _weight(n, k, 4, 32, mx.float32, seed=11)
    rng = np.random.default_rng(rows)
    up = rng.normal(size=(rows, k)).astype(np.float32)
    gate = (rng.normal(size=(rows, k)) * 4).astype(np.float32)
    gate[0, :8] = [-100.0, -88.0, -30.0, 30.0, 88.0, 100.0, 0.0, -0.0]
    got = np.array(_ext.quantized_matvec_int8_many(mx.array(up), [codes], [scales], [biases], 32, 4, 16,
                                                   gate=mx.array(gate))[0])
    g64 = gate.astype(np.float64)
    activations = g64 / (1.0 + np.exp(-g64)) * up
    w, scaled_codes = _float_parts(codes, scales, biases, 32, 4)
    _assert_within_bound(got, activations, w, scaled_codes, 16)
    plain = np.array(_ext.quantized_matvec_int8(mx.array(up), codes, scales, biases, 32, 4, 16))
    assert not np.allclose(got, plain, atol=1e-2 * np.abs(plain).max())  # the gate did change the product
    gate[0, 9] = -np.inf
    got = np.array(_ext.quantized_matvec_int8_many(mx.array(up), [codes], [scales], [biases], 32, 4, 16,
                                                   gate=mx.array(gate))[0])
    assert np.all(np.isnan(got[0])) and np.all(np.isfinite(got[1:]))


@pytest.mark.parametrize("leading", [(3,), (2, 3)])
def test_residual_is_added_to_the_output_in_float32(isa, leading):
    """residual: the output is residual + the product, float32's add bit for bit."""
    codes, scales, biases = _weight(48, 64, 8, 64, mx.float16, seed=12)
    x = mx.random.normal((*leading, 64), key=mx.random.key(12))
    residual = mx.random.normal((*leading, 48), key=mx.random.key(13)) * 10
    got = _ext.quantized_matvec_int8_many(x, [codes], [scales], [biases], 64, 8, 16, residual=residual)[0]
    product = np.array(_ext.quantized_matvec_int8(x, codes, scales, biases, 64, 8, 16))
    np.testing.assert_array_equal(np.array(got), np.array(residual) + product)
    # a strided residual (a view) is read by its strides
    wide = mx.random.normal((*leading, 96), key=mx.random.key(14))
    got = _ext.quantized_matvec_int8_many(x, [codes], [scales], [biases], 64, 8, 16, residual=wide[..., ::2])[0]
    np.testing.assert_array_equal(np.array(got), np.array(wide)[..., ::2] + product)


def test_gradients_flow_through_the_swiglu_and_the_residual():
    """To x (the up projection), the gate and the residual: those of the
    float formula residual + (silu(gate) * x) @ W.T (MLX's own autodiff)."""
    k, n = 64, 24
    codes, scales, biases = _weight(n, k, 4, 32, mx.float32, seed=15)
    up, gate = mx.random.normal((3, k), key=mx.random.key(15)), mx.random.normal((3, k), key=mx.random.key(16))
    residual = mx.random.normal((3, n), key=mx.random.key(17))
    cotangent = mx.random.normal((3, n), key=mx.random.key(18))
    float_weight = mx.dequantize(codes, scales, biases, group_size=32, bits=4)

    def fused(u, g, r):
        return (_ext.quantized_matvec_int8_many(u, [codes], [scales], [biases], 32, 4, 16, gate=g,
                                                residual=r)[0] * cotangent).sum()

    def reference(u, g, r):
        return ((r + (g * mx.sigmoid(g) * u) @ float_weight.T) * cotangent).sum()

    got = mx.grad(fused, argnums=(0, 1, 2))(up, gate, residual)
    expected = mx.grad(reference, argnums=(0, 1, 2))(up, gate, residual)
    for name, g, e in zip(["up", "gate", "residual"], got, expected):
        np.testing.assert_allclose(np.array(g), np.array(e), rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("change,message", [
    (dict(gate=mx.ones((2, 95))), r"gate must be float32 of x's shape \(2, 96\)"),
    (dict(gate=mx.ones((2, 96), dtype=mx.float16)), r"gate must be float32"),
    (dict(gate=mx.ones((2, 96)), norm_weight=mx.ones((96,))), "gate and norm_weight cannot be combined"),
    (dict(residual=mx.ones((2, 7))), r"residual must be float32 of the output's shape \(2, 8\)"),
    (dict(residual=mx.ones((2, 8), dtype=mx.bfloat16)), "residual must be float32"),
    (dict(residual=mx.ones((2, 8)), weights=2), "residual needs exactly one weight, got 2"),
])
def test_bad_gate_and_residual_arguments_are_named(change, message):
    codes, scales, biases = mx.quantize(mx.ones((8, 96)), group_size=32, bits=4)
    count = change.pop("weights", 1)
    with pytest.raises(ValueError, match=message):
        _ext.quantized_matvec_int8_many(mx.ones((2, 96)), [codes] * count, [scales] * count, [biases] * count, 32, 4,
                                        16, **change)


def test_several_weights_reject_lists_of_different_lengths():
    codes, scales, biases = _weight(32, 64, 4, 32, mx.float16, seed=1)
    x = mx.zeros((1, 64))
    with pytest.raises(ValueError, match="one entry per weight"):
        _ext.quantized_matvec_int8_many(x, [codes, codes], [scales], [biases], 32, 4, 16)
    with pytest.raises(ValueError, match="one entry per weight"):
        _ext.quantized_matvec_int8_many(x, [], [], [], 32, 4, 16)
    with pytest.raises(ValueError, match="do not hold"):
        _ext.quantized_matvec_int8_many(x, [codes, codes[:, :4]], [scales, scales], [biases, biases], 32, 4, 16)


@pytest.mark.parametrize("activation_bits", [8, 16])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [9, 40])
def test_every_copy_computes_the_generic_sums(bits, activation_bits, rows):
    codes, scales, biases = _weight(64, 256, bits, 64, mx.bfloat16, seed=9)
    x = mx.random.normal((rows, 256), key=mx.random.key(10))
    before = _ext.cpu_isa()
    results = {}
    try:
        for name in ISAS:
            _ext.set_cpu_isa(name)
            results[name] = np.array(_ext.quantized_matvec_int8(x, codes, scales, biases, 64, bits, activation_bits))
    finally:
        _ext.set_cpu_isa(before)
    # same integer sums, float lanes summed in another order
    scale = np.abs(results["generic"]).max()
    for name, got in results.items():
        np.testing.assert_allclose(got, results["generic"], rtol=0, atol=1e-5 * scale, err_msg=name)


@pytest.mark.parametrize("activation_bits", [8, 16])
@pytest.mark.parametrize("rows", [4, 21])
def test_non_finite_activations_give_non_finite_rows_only(isa, activation_bits, rows):
    codes, scales, biases = _weight(40, 128, 4, 32, mx.float16, seed=2)
    x = np.random.default_rng(0).normal(size=(rows, 128)).astype(np.float32)
    x[1, 70] = np.nan
    x[2, 3] = np.inf
    x[3] = 0.0
    got = np.array(_ext.quantized_matvec_int8(mx.array(x), codes, scales, biases, 32, 4, activation_bits))
    assert np.all(np.isfinite(np.delete(got, [1, 2, 3], axis=0)))
    assert np.all(np.isnan(got[1]))
    assert not np.any(np.isfinite(got[2]))
    np.testing.assert_array_equal(got[3], 0.0)


def test_gradient_is_the_float_products():
    codes, scales, biases = _weight(48, 64, 4, 32, mx.float32, seed=4)
    x = mx.random.normal((2, 64), key=mx.random.key(4))
    cotangent = mx.random.normal((2, 48), key=mx.random.key(5))
    grad = mx.grad(lambda v: (_ext.quantized_matvec_int8(v, codes, scales, biases, 32, 4) * cotangent).sum())(x)
    w, _ = _float_parts(codes, scales, biases, 32, 4)
    np.testing.assert_allclose(np.array(grad), np.array(cotangent, dtype=np.float64) @ w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("change,message", [
    (dict(bits=3), "bits must be 4 or 8"),
    (dict(activation_bits=4), "activation_bits must be 8 or 16"),
    (dict(group_size=16), "group_size must be 32, 64 or 128"),
    (dict(x=mx.zeros((2, 64), dtype=mx.float16)), "x must be float32"),
    (dict(x=mx.zeros((64,))), "x must be [rows, k]"),
    (dict(x=mx.zeros((2, 96))), "do not hold 96 columns"),
    (dict(scales=mx.zeros((8, 3))), "scales must be [8, 2]"),
])
def test_bad_arguments_are_named(change, message):
    codes, scales, biases = _weight(8, 64, 4, 32, mx.float16, seed=0)
    args = dict(x=mx.zeros((2, 64)), codes=codes, scales=scales, biases=biases, group_size=32, bits=4,
                activation_bits=8)
    args.update(change)
    with pytest.raises(ValueError, match="quantized_matvec_int8.*" + message.replace("[", r"\[").replace("]", r"\]")):
        _ext.quantized_matvec_int8(args["x"], args["codes"], args["scales"], args["biases"], args["group_size"],
                                   args["bits"], args["activation_bits"])


def test_quantized_layers_use_the_int16_product_by_default(monkeypatch):
    from mlx_attn.lm.quantized_matmul import fused_matvec

    assert quantized_matmul.MATVEC_PRODUCT == "int16"
    codes, scales, biases = _weight(16, 64, 4, 32, mx.float16, seed=3)

    class Layer(dict):
        group_size, bits = 32, 4

    layer = Layer(weight=codes, scales=scales, biases=biases)
    x = mx.random.normal((1, 2, 64), key=mx.random.key(3))
    np.testing.assert_array_equal(np.array(fused_matvec(x, layer)[0]),
                                  np.array(_ext.quantized_matvec_int8(x[0], codes, scales, biases, 32, 4, 16)))
    monkeypatch.setattr(quantized_matmul, "MATVEC_PRODUCT", "int8")
    np.testing.assert_array_equal(np.array(fused_matvec(x, layer)[0]),
                                  np.array(_ext.quantized_matvec_int8(x[0], codes, scales, biases, 32, 4, 8)))
    monkeypatch.setattr(quantized_matmul, "MATVEC_PRODUCT", "float")
    np.testing.assert_array_equal(np.array(fused_matvec(x, layer)[0]),
                                  np.array(_ext.quantized_matvec(x[0], codes, scales, biases, 32, 4)))
    monkeypatch.setattr(quantized_matmul, "MATVEC_PRODUCT", "int4")
    with pytest.raises(ValueError, match="MATVEC_PRODUCT must be one of int16, int8, float"):
        fused_matvec(x, layer)


# ------------------------------------------------------------------ default model
def _model_layers():
    from model_fixtures import smollm2
    import mlx.nn as nn

    model, tokenizer = smollm2()
    layers = [(name, m) for name, m in model.named_modules()
              if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]
    return model, tokenizer, layers


def test_default_model_layers_within_the_bound():
    """Every quantized layer of SmolLM2 (MLX_ATTN_FULL_GRID=1) or one of each
    kind, on activations of the model's own scale (a row of the embedding,
    normed as the layers see it) and on random ones."""
    _, _, layers = _model_layers()
    if os.environ.get("MLX_ATTN_FULL_GRID") != "1":
        kinds = {}
        for name, layer in layers:
            kinds.setdefault(name.rsplit(".", 1)[-1], (name, layer))
        layers = list(kinds.values())
    for name, layer in layers:
        codes, scales, biases = layer["weight"], layer["scales"], layer["biases"]
        k = codes.shape[1] * 32 // layer.bits
        x = mx.random.normal((3, k), key=mx.random.key(k)) * mx.array([[0.05], [1.0], [20.0]])
        n = min(codes.shape[0], 4096)  # the output head: a slice of its 49,152 rows
        codes, scales, biases = codes[:n], scales[:n], biases[:n]
        parts = _float_parts(codes, scales, biases, layer.group_size, layer.bits)
        for activation_bits in (8, 16):
            got = _ext.quantized_matvec_int8(x, codes, scales, biases, layer.group_size, layer.bits, activation_bits)
            try:
                _assert_within_bound(got, x, *parts, activation_bits)
            except AssertionError as error:
                raise AssertionError(f"{name}, int{activation_bits}: {error}") from None


# Measured on SmolLM2 (3 prompts x 45 decode steps, teacher-forced on the float
# product's greedy tokens). int8: max |logit difference| 3.35, mean 0.46-0.54,
# the argmax changed at 9 of 135 steps, every one where the float product's top
# two logits were within 0.57: the model's activations are spiky (a block's
# largest |x| is 10-30x its mean), so int8 per 32 columns moves the output
# head's logits by ~7% of their norm (llama.cpp's q8 activations round the same
# way). int16: max |logit difference| 0.027, mean 0.003, no argmax changed and
# the same 40 greedy tokens after each prompt.
INT8_LOGIT_BOUND = 4.0
INT8_NEAR_TIE = 1.0
INT16_LOGIT_BOUND = 0.05


def _decode_logits(model, ids):
    """Logits after each token, fed one at a time (one row: the decode path)."""
    cache = model.make_cache()
    rows = [model(mx.array([[t]]), cache=cache)[0, -1].astype(mx.float32) for t in ids]
    mx.eval(rows)
    return np.array(mx.stack(rows))


def test_default_model_logits_within_the_stated_bounds_of_the_float_products(monkeypatch):
    """Teacher-forced on the float product's 16 greedy tokens. int16 (the
    default): every logit within INT16_LOGIT_BOUND of the float product's,
    the same greedy token at every step, and the same tokens generated freely.
    int8: within INT8_LOGIT_BOUND, the greedy token the same wherever the
    float product's top two logits are more than INT8_NEAR_TIE apart."""
    from mlx_attn.lm.generate import GenerationConfig, generate_tokens

    model, tokenizer, _ = _model_layers()
    prompt = tokenizer.encode("The capital of France is")
    config = GenerationConfig(max_tokens=16, stop_at_eos=False)
    logits, generated = {}, {}
    for product in ("float", "int16", "int8"):
        monkeypatch.setattr(quantized_matmul, "MATVEC_PRODUCT", product)
        generated[product] = list(generate_tokens(model, prompt, config))
        logits[product] = _decode_logits(model, prompt + generated["float"])
    float_logits = logits["float"]
    top_two = np.sort(float_logits, axis=1)[:, -2:]
    margin = top_two[:, 1] - top_two[:, 0]

    int16 = np.abs(logits["int16"] - float_logits)
    assert 0 < int16.max() <= INT16_LOGIT_BOUND
    np.testing.assert_array_equal(logits["int16"].argmax(axis=1), float_logits.argmax(axis=1))
    assert generated["int16"] == generated["float"]

    int8 = np.abs(logits["int8"] - float_logits)
    assert 0 < int8.max() <= INT8_LOGIT_BOUND
    flipped = float_logits.argmax(axis=1) != logits["int8"].argmax(axis=1)
    assert np.all(margin[flipped] <= INT8_NEAR_TIE), f"margins where the greedy token changed: {margin[flipped]}"


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 7, 9])
def test_quantized_layers_multiply_few_rows_within_the_bound(bits, rows):
    """Through the layer, the default product (int16 activations)."""
    import mlx.nn as nn

    from mlx_attn.lm.quantized_matmul import RowAdaptiveQuantizedLinear, use_row_adaptive_matmuls

    mx.random.seed(rows)
    model = nn.Sequential(nn.Linear(96, 80, bias=True))
    nn.quantize(model, group_size=32, bits=bits)
    layer = use_row_adaptive_matmuls(model).layers[0]
    assert isinstance(layer, RowAdaptiveQuantizedLinear)
    x = mx.random.normal((1, rows, 96), key=mx.random.key(rows))
    w, scaled_codes = _float_parts(layer["weight"], layer["scales"], layer["biases"], 32, bits)
    got = np.array(layer(x)[0], dtype=np.float64) - np.array(layer["bias"], dtype=np.float64)
    _assert_within_bound(got, x[0], w, scaled_codes, 16)


def test_the_row_limit_follows_the_integer_copy(monkeypatch):
    """Only the AVX512-VNNI int16 copy (a weight block once for 128 rows)
    takes whole prompt chunks; the 8-rows-a-pass copies stop at 128."""
    from mlx_attn import _native

    limit = quantized_matmul.matvec_rows_limit
    assert limit("float") == quantized_matmul.DEQUANTIZED_MATMUL_ROWS
    assert limit("int8") == quantized_matmul.PASSED_MATVEC_ROWS
    tiled = _native.ext.int8_matvec_copy() == "avx512vnni"
    assert limit("int16") == (quantized_matmul.INTEGER_MATVEC_ROWS if tiled else quantized_matmul.PASSED_MATVEC_ROWS)
    monkeypatch.setattr(_native.ext, "int8_matvec_copy", lambda: "avx2")
    assert limit("int16") == quantized_matmul.PASSED_MATVEC_ROWS


@pytest.mark.parametrize("product", ["int16", "int8", "float"])
def test_integer_products_take_rows_up_to_their_own_limit(monkeypatch, product):
    import mlx.nn as nn

    from mlx_attn.lm.quantized_matmul import use_row_adaptive_matmuls

    limit = quantized_matmul.matvec_rows_limit(product)
    monkeypatch.setattr(quantized_matmul, "MATVEC_PRODUCT", product)
    model = nn.Sequential(nn.Linear(64, 32, bias=False))
    nn.quantize(model, group_size=32, bits=4)
    layer = use_row_adaptive_matmuls(model).layers[0]
    calls = []
    for name in ("dequantized_matmul", "fused_matvec"):
        monkeypatch.setattr(quantized_matmul, name,
                            lambda x, lay, name=name: calls.append((name, x.shape[-2])) or mx.zeros((*x.shape[:-1], 32)))
    for rows in (1, limit - 1, limit):
        layer(mx.ones((rows, 64)))
    assert calls == [("fused_matvec", 1), ("fused_matvec", limit - 1), ("dequantized_matmul", limit)]


def test_packed_layers_take_the_integer_product_at_any_row_count(monkeypatch):
    """``use_row_adaptive_matmuls(dequantize_many_rows=False)`` (the engine's
    packed weights): a step of more than ``INTEGER_MATVEC_ROWS`` rows reads
    the packed codes through the integer product, never a per-call
    dequantized weight; the default still dequantizes from there."""
    import mlx.nn as nn

    from mlx_attn.lm import quantized_matmul

    if quantized_matmul.MATVEC_PRODUCT == "float":
        pytest.skip("MLX_ATTN_MATVEC=float: the packed engine holds float32 weights instead")
    x = mx.random.normal((quantized_matmul.matvec_rows_limit() + 44, 64), key=mx.random.key(11))
    dequantized = []
    real = quantized_matmul._dequantized
    monkeypatch.setattr(quantized_matmul, "_dequantized", lambda *a, **k: dequantized.append(1) or real(*a, **k))
    for many_rows in (False, True):
        layer = nn.QuantizedLinear(64, 32, bias=False, group_size=32, bits=4)
        quantized_matmul.use_row_adaptive_matmuls(nn.Sequential(layer), dequantize_many_rows=many_rows)
        out = np.array(layer(x))
        assert bool(dequantized) == many_rows
        integer = np.array(_ext.quantized_matvec_int8(x, layer["weight"], layer["scales"], layer["biases"], 32, 4, 16
                                                      if quantized_matmul.MATVEC_PRODUCT == "int16" else 8))
        if not many_rows:
            np.testing.assert_array_equal(out, integer)
