"""Row-adaptive quantized layers (mlx_attn/lm/quantized_matmul.py): on the CPU
many rows multiply a dequantized float32 weight, a few rows go through the
fused matrix-vector product (``_ext.quantized_matvec``); both give x @ W.T
for the dequantized W (a float64 NumPy product of codes, scales and biases
is the oracle). Few rows take the float product here (``MATVEC_PRODUCT``);
tests/test_int8_matvec.py holds the int8 product, the default, to its
bound."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_attn.lm import quantized_matmul
from mlx_attn.lm.quantized_matmul import (RowAdaptiveQuantizedEmbedding, RowAdaptiveQuantizedLinear,
                                          use_row_adaptive_matmuls)


@pytest.fixture(autouse=True)
def float_matvec_product(monkeypatch):
    monkeypatch.setattr(quantized_matmul, "MATVEC_PRODUCT", "float")


def _dequantized(layer) -> np.ndarray:
    w = mx.dequantize(layer["weight"], layer["scales"], layer.get("biases"), group_size=layer.group_size,
                      bits=layer.bits)
    return np.array(w.astype(mx.float32), dtype=np.float64)


def _quantized_linear(out_features, in_features, bits, bias=False, seed=0):
    mx.random.seed(seed)
    layer = nn.Linear(in_features, out_features, bias=bias)
    model = nn.Sequential(layer)
    nn.quantize(model, group_size=32, bits=bits)
    return use_row_adaptive_matmuls(model).layers[0]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 7, 8, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_quantized_linear_matches_the_dequantized_product(bits, rows, bias):
    layer = _quantized_linear(96, 64, bits, bias=bias, seed=rows)
    assert isinstance(layer, RowAdaptiveQuantizedLinear)
    x = mx.random.normal((1, rows, 64), key=mx.random.key(rows))
    expected = np.array(x, dtype=np.float64) @ _dequantized(layer).T
    if bias:
        expected += np.array(layer["bias"], dtype=np.float64)
    got = np.array(layer(x))
    assert got.shape == (1, rows, 96)
    np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-5)


def test_many_rows_take_the_dequantized_product_and_few_rows_the_fused_matvec(monkeypatch):
    layer = _quantized_linear(64, 64, 4)
    calls = []
    for name in ("dequantized_matmul", "fused_matvec"):
        monkeypatch.setattr(quantized_matmul, name,
                            lambda x, lay, name=name: calls.append((name, x.shape)) or mx.zeros((*x.shape[:-1], 64)))
    layer(mx.ones((1, 1, 64)))
    layer(mx.ones((1, quantized_matmul.DEQUANTIZED_MATMUL_ROWS - 1, 64)))
    assert calls == [("fused_matvec", (1, 1, 64)), ("fused_matvec", (1, quantized_matmul.DEQUANTIZED_MATMUL_ROWS - 1, 64))]
    calls.clear()
    layer(mx.ones((2, quantized_matmul.DEQUANTIZED_MATMUL_ROWS // 2, 64)))
    assert calls == [("dequantized_matmul", (2, quantized_matmul.DEQUANTIZED_MATMUL_ROWS // 2, 64))]


def test_output_rows_are_dequantized_in_slices(monkeypatch):
    """A weight taller than one slice is multiplied slice by slice; the
    pieces land in order (slices of 40 rows, one ragged)."""
    monkeypatch.setattr(quantized_matmul, "DEQUANTIZED_SLICE_ROWS", 40)
    layer = _quantized_linear(100, 64, 4, seed=3)
    x = mx.random.normal((quantized_matmul.DEQUANTIZED_MATMUL_ROWS + 8, 64), key=mx.random.key(3))
    expected = np.array(x, dtype=np.float64) @ _dequantized(layer).T
    np.testing.assert_allclose(np.array(layer(x)), expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_the_output_keeps_the_input_dtype(dtype):
    layer = _quantized_linear(48, 64, 8)
    x = mx.random.normal((12, 64), key=mx.random.key(5)).astype(dtype)
    got = layer(x)
    assert got.dtype == dtype
    expected = np.array(x.astype(mx.float32), dtype=np.float64) @ _dequantized(layer).T
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("rows", [1, 40])
def test_a_tied_output_head_multiplies_through_the_embedding(rows):
    mx.random.seed(7)
    model = nn.Sequential(nn.Embedding(120, 64))
    nn.quantize(model, group_size=32, bits=4)
    embedding = use_row_adaptive_matmuls(model).layers[0]
    assert isinstance(embedding, RowAdaptiveQuantizedEmbedding)
    x = mx.random.normal((rows, 64), key=mx.random.key(rows))
    expected = np.array(x, dtype=np.float64) @ _dequantized(embedding).T
    np.testing.assert_allclose(np.array(embedding.as_linear(x)), expected, rtol=2e-5, atol=2e-5)
    # the lookup itself is the quantized embedding's own
    np.testing.assert_allclose(np.array(embedding(mx.array([3, 5]))), _dequantized(embedding)[[3, 5]], rtol=1e-6)


def test_loaded_quantized_models_use_the_row_adaptive_layers(tmp_path):
    """Every quantized layer of a loaded checkpoint multiplies row-adaptively,
    and a prompt of many rows gives the logits of MLX's quantized kernel."""
    from model_fixtures import random_llama, save_hf_directory

    from mlx_attn.lm.loading import load_hf_directory

    model = random_llama(quantized=True)
    save_hf_directory(model, tmp_path / "hf", quantized=True)
    loaded, _ = load_hf_directory(tmp_path / "hf")
    kinds = {type(m) for _, m in loaded.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))}
    assert kinds and kinds <= {RowAdaptiveQuantizedLinear, RowAdaptiveQuantizedEmbedding}
    tokens = mx.array([[1, 5, 9, 200, 42, 7, 7, 8, 100, 3, 2, 1]])
    np.testing.assert_allclose(np.array(loaded(tokens)), np.array(model(tokens)), rtol=1e-4, atol=1e-4)


def test_half_precision_scales_dequantize_in_float32():
    """A float16 model's scales and biases: the many-row product uses
    scale * code + bias in float32, as the one-row quantized kernel does (in
    float16 every weight would be rounded once more, ~1e-3 relative)."""
    mx.random.seed(11)
    model = nn.Sequential(nn.Linear(256, 64, bias=False))
    model.set_dtype(mx.float16)
    nn.quantize(model, group_size=32, bits=8)
    layer = use_row_adaptive_matmuls(model).layers[0]
    assert layer["scales"].dtype == mx.float16
    x = mx.random.normal((quantized_matmul.DEQUANTIZED_MATMUL_ROWS, 256), key=mx.random.key(11))
    scales, biases = (np.array(layer[n].astype(mx.float32), dtype=np.float64) for n in ("scales", "biases"))
    codes = np.array(mx.dequantize(layer["weight"], mx.ones_like(layer["scales"]).astype(mx.float32),
                                   mx.zeros_like(layer["biases"]).astype(mx.float32), group_size=32, bits=8),
                     dtype=np.float64)
    weight = codes * np.repeat(scales, 32, axis=1) + np.repeat(biases, 32, axis=1)
    expected = np.array(x, dtype=np.float64) @ weight.T
    np.testing.assert_allclose(np.array(layer(x)), expected, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- the fused matrix-vector product
def _codes_oracle(codes: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int) -> np.ndarray:
    """W in float64 from the packed words unpacked in NumPy (little-endian
    fields of ``bits`` bits), independent of mx.dequantize."""
    words = np.array(codes).astype(np.uint64)
    per_word = 32 // bits
    fields = (words[:, :, None] >> (bits * np.arange(per_word, dtype=np.uint64))) & ((1 << bits) - 1)
    q = fields.reshape(words.shape[0], -1).astype(np.float64)
    s = np.repeat(np.array(scales.astype(mx.float32), dtype=np.float64), group_size, axis=1)
    b = np.repeat(np.array(biases.astype(mx.float32), dtype=np.float64), group_size, axis=1)
    return q * s + b


@pytest.mark.parametrize("isa", ["generic", "widest"])
@pytest.mark.parametrize("bits,group_size,scale_dtype", [(4, 32, mx.float16), (8, 32, mx.bfloat16),
                                                         (4, 64, mx.float32), (8, 128, mx.float16),
                                                         (4, 128, mx.bfloat16)])
def test_fused_matvec_matches_the_float64_product_of_the_codes(isa, bits, group_size, scale_dtype):
    """Each compiled copy (the generic one and the widest this CPU runs),
    rows 1 to 11 (past one pass of 8), an output count no task multiple."""
    from mlx_attn import _ext

    previous = _ext.cpu_isa()
    _ext.set_cpu_isa("generic" if isa == "generic" else _ext.supported_cpu_isas()[0])
    try:
        n, k = 97, 2 * group_size + 128 if group_size < 128 else 256
        w = mx.random.normal((n, k), key=mx.random.key(bits * group_size)).astype(scale_dtype)
        codes, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
        weight = _codes_oracle(codes, scales, biases, group_size, bits)
        for rows in (1, 3, 8, 11):
            x = mx.random.normal((rows, k), key=mx.random.key(rows))
            got = _ext.quantized_matvec(x, codes, scales, biases, group_size, bits)
            assert got.dtype == mx.float32 and got.shape == (rows, n)
            np.testing.assert_allclose(np.array(got), np.array(x, dtype=np.float64) @ weight.T, rtol=1e-5, atol=1e-4)
    finally:
        _ext.set_cpu_isa(previous)


def test_fused_matvec_gradient_reaches_x():
    from mlx_attn import _ext

    w = mx.random.normal((40, 64), key=mx.random.key(2))
    codes, scales, biases = mx.quantize(w, group_size=32, bits=4)
    weight = _codes_oracle(codes, scales, biases, 32, 4)
    x = mx.random.normal((2, 64), key=mx.random.key(3))
    cotangent = np.array(mx.random.normal((2, 40), key=mx.random.key(4)), dtype=np.float64)
    grad = mx.grad(lambda v: (_ext.quantized_matvec(v, codes, scales, biases, 32, 4) * mx.array(cotangent)).sum())(x)
    np.testing.assert_allclose(np.array(grad), cotangent @ weight, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("change,message", [
    (dict(bits=3), "bits must be 4 or 8"),
    (dict(group_size=16), "group_size must be 32, 64 or 128"),
    (dict(x=mx.ones((2, 64), dtype=mx.float16)), "x must be float32"),
    (dict(x=mx.ones((2, 96))), "do not hold 96 columns"),
    (dict(x=mx.ones((64,))), "x must be \\[rows, k\\]"),
    (dict(scales=mx.ones((8, 3))), "scales must be \\[8, 2\\]"),
    (dict(biases=mx.ones((8, 2), dtype=mx.float16)), "biases must have the scales' dtype"),
    (dict(codes=mx.ones((8, 8), dtype=mx.int32)), "codes must be uint32"),
])
def test_fused_matvec_names_what_is_wrong(change, message):
    from mlx_attn import _ext

    codes, scales, biases = mx.quantize(mx.ones((8, 64)), group_size=32, bits=4)
    args = dict(x=mx.ones((2, 64)), codes=codes, scales=scales, biases=biases, group_size=32, bits=4) | change
    with pytest.raises(ValueError, match=message):
        _ext.quantized_matvec(args["x"], args["codes"], args["scales"], args["biases"], args["group_size"],
                              args["bits"])


# ---------------------------------------------------------------- the one-pass dequantization
def _bitstream_oracle(codes: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int) -> np.ndarray:
    """W in float64 from each row's bytes as one little-endian bit stream
    (code i at bit i * bits; any bit width), unpacked by NumPy."""
    row_bytes = np.array(codes).view(np.uint8).reshape(codes.shape[0], -1)
    stream = np.unpackbits(row_bytes, axis=1, bitorder="little")
    k = stream.shape[1] // bits
    fields = stream[:, :k * bits].reshape(codes.shape[0], k, bits).astype(np.int64)
    q = (fields << np.arange(bits)).sum(axis=2).astype(np.float64)
    s = np.repeat(np.array(scales.astype(mx.float32), dtype=np.float64), group_size, axis=1)
    b = np.repeat(np.array(biases.astype(mx.float32), dtype=np.float64), group_size, axis=1)
    return q * s + b


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group_size,scale_dtype", [(32, mx.float32), (64, mx.float16), (128, mx.bfloat16)])
def test_dequantize_affine_matches_the_bit_stream_and_mlx(bits, group_size, scale_dtype):
    """Against a NumPy unpacking of the bit stream (float64) and against
    mx.dequantize with float32 scales: equal up to the one rounding of the
    fused multiply-add (exactly equal with half-precision scales, whose
    products with a code are exact in float32)."""
    from mlx_attn import _ext

    n, k = 37, 3 * 128
    w = mx.random.normal((n, k), key=mx.random.key(bits + group_size)).astype(scale_dtype)
    codes, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
    got = _ext.dequantize_affine(codes, scales, biases, group_size, bits)
    assert got.dtype == mx.float32 and got.shape == (n, k)
    np.testing.assert_allclose(np.array(got), _bitstream_oracle(codes, scales, biases, group_size, bits),
                               rtol=1e-6, atol=1e-6)
    mlx = mx.dequantize(codes, scales.astype(mx.float32), biases.astype(mx.float32), group_size=group_size, bits=bits)
    if scale_dtype == mx.float32:
        np.testing.assert_allclose(np.array(got), np.array(mlx), rtol=0, atol=1e-6)  # one rounding of s * q
    else:
        assert np.array_equal(np.array(got), np.array(mlx))


@pytest.mark.parametrize("change,message", [
    (dict(bits=7), "bits must be 2, 3, 4, 5, 6 or 8"),
    (dict(group_size=16), "group_size must be 32, 64 or 128"),
    (dict(codes=mx.ones((8, 8), dtype=mx.int32)), "codes must be uint32"),
    (dict(codes=mx.ones((8, 5), dtype=mx.uint32)), "do not hold whole groups"),
    (dict(scales=mx.ones((8, 3))), "scales must be \\[8, 2\\]"),
    (dict(biases=mx.ones((8, 2), dtype=mx.float16)), "biases must have the scales' dtype"),
    (dict(scales=mx.ones((8, 2), dtype=mx.int32), biases=mx.ones((8, 2), dtype=mx.int32)), "scales must be float32"),
])
def test_dequantize_affine_names_what_is_wrong(change, message):
    from mlx_attn import _ext

    codes, scales, biases = mx.quantize(mx.ones((8, 64)), group_size=32, bits=4)
    args = dict(codes=codes, scales=scales, biases=biases, group_size=32, bits=4) | change
    with pytest.raises(ValueError, match=message):
        _ext.dequantize_affine(args["codes"], args["scales"], args["biases"], args["group_size"], args["bits"])


def test_dequantize_affine_gradients_reach_scales_and_biases():
    """d w / d scale = code, d w / d bias = 1 (summed over each group); the
    integer codes get zeros."""
    from mlx_attn import _ext

    w = mx.random.normal((6, 64), key=mx.random.key(8))
    codes, scales, biases = mx.quantize(w, group_size=32, bits=5)
    cotangent = np.array(mx.random.normal((6, 64), key=mx.random.key(9)), dtype=np.float64)
    q = _bitstream_oracle(codes, mx.ones_like(scales), mx.zeros_like(biases), 32, 5)
    loss = lambda s, b: (_ext.dequantize_affine(codes, s, b, 32, 5) * mx.array(cotangent.astype(np.float32))).sum()
    d_scales, d_biases = mx.grad(loss, argnums=(0, 1))(scales, biases)
    np.testing.assert_allclose(np.array(d_scales), (cotangent * q).reshape(6, 2, 32).sum(-1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(d_biases), cotangent.reshape(6, 2, 32).sum(-1), rtol=1e-5, atol=1e-5)


def test_many_rows_through_a_dequantized_layer_have_a_gradient():
    """The dequantized product's gradient to its input (the weight waits
    for the input through mx.depends, so the gradient passes the
    dequantization: zeros to the codes)."""
    model = nn.Sequential(nn.Linear(64, 40, bias=False))
    nn.quantize(model, group_size=32, bits=5)
    layer = use_row_adaptive_matmuls(model).layers[0]
    x = mx.random.normal((quantized_matmul.DEQUANTIZED_MATMUL_ROWS + 1, 64), key=mx.random.key(6))
    cotangent = np.array(mx.random.normal((x.shape[0], 40), key=mx.random.key(7)), dtype=np.float64)
    grad = mx.grad(lambda v: (layer(v) * mx.array(cotangent.astype(np.float32))).sum())(x)
    weight = _bitstream_oracle(layer["weight"], layer["scales"], layer["biases"], 32, 5)
    np.testing.assert_allclose(np.array(grad), cotangent @ weight, rtol=1e-4, atol=1e-4)


def test_dequantized_layers_use_the_one_pass_dequantization(monkeypatch):
    """Many rows on the CPU: the layer's float32 weight comes from
    _ext.dequantize_affine (5 bits here: MLX's own dequantize of 5 bits
    builds intermediates five times the weight), and the product matches
    the float64 one of the bit stream."""
    from mlx_attn import _ext

    calls = []
    real = _ext.dequantize_affine
    monkeypatch.setattr(_ext, "dequantize_affine", lambda *a, **kw: calls.append(a[3:5]) or real(*a, **kw))
    model = nn.Sequential(nn.Linear(128, 48, bias=False))
    nn.quantize(model, group_size=32, bits=5)
    layer = use_row_adaptive_matmuls(model).layers[0]
    x = mx.random.normal((quantized_matmul.DEQUANTIZED_MATMUL_ROWS + 3, 128), key=mx.random.key(5))
    got = layer(x)
    assert calls == [(32, 5)]
    weight = _bitstream_oracle(layer["weight"], layer["scales"], layer["biases"], 32, 5)
    np.testing.assert_allclose(np.array(got), np.array(x, dtype=np.float64) @ weight.T, rtol=1e-5, atol=1e-5)


def test_held_float32_weights_serve_many_rows_and_the_codes_few():
    """hold_float32_weights: many rows multiply the held weight (no
    dequantization per call), few rows still read the packed codes; both
    the float64 product."""
    from mlx_attn.lm.quantized_matmul import float32_weight, hold_float32_weights

    mx.random.seed(13)
    model = nn.Sequential(nn.Linear(64, 48, bias=False))
    model.set_dtype(mx.float16)
    nn.quantize(model, group_size=32, bits=4)
    hold_float32_weights(model)
    layer = model.layers[0]
    weight = _codes_oracle(layer["weight"], layer["scales"], layer["biases"], 32, 4)
    np.testing.assert_array_equal(np.array(float32_weight(layer), dtype=np.float64), weight.astype(np.float32))
    assert "_float32_weight" not in dict(layer.parameters())  # held beside the parameters, not saved with them
    for rows in (2, quantized_matmul.DEQUANTIZED_MATMUL_ROWS):
        x = mx.random.normal((rows, 64), key=mx.random.key(rows))
        np.testing.assert_allclose(np.array(layer(x)), np.array(x, dtype=np.float64) @ weight.T, rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------- widths the integer product does not read
@pytest.mark.parametrize("bits", [2, 3, 5, 6])
@pytest.mark.parametrize("group_size", [32, 64])
def test_widened_layers_keep_their_weights_and_take_the_integer_product(bits, group_size, monkeypatch):
    """widen_for_integer_product: a 2/3/5/6-bit layer (and embedding) is held
    at 4 or 8 bits with the same codes, so the same weights bit for bit
    (the bit-stream oracle of both packings); its few rows then go through
    the integer product, within that product's bound of the original
    weights' float64 product; stored_form gives the original packing back."""
    from mlx_attn import _ext
    from mlx_attn.lm.quantized_matmul import WIDENED_BITS, int8_error_bound, stored_form, widen_for_integer_product

    monkeypatch.setattr(quantized_matmul, "MATVEC_PRODUCT", "int16")
    mx.random.seed(bits * 10 + group_size)
    model = nn.Sequential(nn.Linear(128, 40, bias=False), nn.Embedding(24, 128))
    nn.quantize(model, group_size=group_size, bits=bits)
    use_row_adaptive_matmuls(model)
    linear, embedding = model.layers
    originals = [(m["weight"], _bitstream_oracle(m["weight"], m["scales"], m["biases"], group_size, bits))
                 for m in (linear, embedding)]
    assert not quantized_matmul.product_reads(linear)
    assert widen_for_integer_product(model) == 2
    for module, (packed, weight) in zip((linear, embedding), originals):
        assert module.bits == WIDENED_BITS[bits] and quantized_matmul.product_reads(module)
        np.testing.assert_array_equal(
            _bitstream_oracle(module["weight"], module["scales"], module["biases"], group_size, module.bits), weight)
        stored_bits, stored = stored_form(module)
        assert stored_bits == bits and stored.dtype == mx.uint32
        np.testing.assert_array_equal(np.array(stored), np.array(packed))
    calls = []
    real = _ext.quantized_matvec_int8
    monkeypatch.setattr(_ext, "quantized_matvec_int8", lambda *a, **kw: calls.append(a[5]) or real(*a, **kw))
    x = mx.random.normal((3, 128), key=mx.random.key(bits))
    for module, (_, weight) in zip((linear, embedding), originals):
        got = np.array(module(x) if module is linear else module.as_linear(x), dtype=np.float64)
        bound = int8_error_bound(np.array(x), np.abs(weight), activation_bits=16)
        assert np.all(np.abs(got - np.array(x, dtype=np.float64) @ weight.T) <= bound + 1e-5 * (1 + np.abs(got)))
    assert calls == [WIDENED_BITS[bits]] * 2
    tokens = mx.array([0, 5, 23])
    np.testing.assert_allclose(np.array(embedding(tokens)), originals[1][1][[0, 5, 23]], rtol=1e-6, atol=1e-6)


def test_widening_leaves_read_widths_and_other_modes_alone():
    """4- and 8-bit layers are read as they are, and a layer without biases
    (a non-affine mode) is not the integer product's: nothing is widened."""
    from mlx_attn.lm.quantized_matmul import stored_form, widen_for_integer_product

    model = nn.Sequential(nn.Linear(64, 16), nn.Linear(64, 16))
    nn.quantize(model, group_size=32, bits=4)
    model.layers[1] = nn.QuantizedLinear.from_linear(nn.Linear(64, 16), group_size=32, bits=8)
    before = [np.array(m["weight"]) for m in model.layers]
    assert widen_for_integer_product(model) == 0
    assert [m.bits for m in model.layers] == [4, 8]
    for m, w in zip(model.layers, before):
        np.testing.assert_array_equal(np.array(stored_form(m)[1]), w)
    unbiased = nn.Sequential(nn.QuantizedLinear.from_linear(nn.Linear(64, 16), group_size=32, bits=5))
    unbiased.layers[0].biases = None
    assert widen_for_integer_product(unbiased) == 0 and unbiased.layers[0].bits == 5
