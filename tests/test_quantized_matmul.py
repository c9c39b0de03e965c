"""Row-adaptive quantized layers (mlx_attn/lm/quantized_matmul.py): on the CPU
many rows multiply a dequantized float32 weight, one row keeps MLX's quantized
kernel; both give x @ W.T for the dequantized W (a float64 NumPy product is
the oracle)."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_attn.lm import quantized_matmul
from mlx_attn.lm.quantized_matmul import (RowAdaptiveQuantizedEmbedding, RowAdaptiveQuantizedLinear,
                                          use_row_adaptive_matmuls)


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


def test_many_rows_take_the_dequantized_product_and_one_row_the_quantized_kernel(monkeypatch):
    layer = _quantized_linear(64, 64, 4)
    calls = []
    monkeypatch.setattr(quantized_matmul, "dequantized_matmul",
                        lambda x, lay: calls.append(x.shape) or mx.zeros((*x.shape[:-1], 64)))
    layer(mx.ones((1, 1, 64)))
    layer(mx.ones((1, quantized_matmul.DEQUANTIZED_MATMUL_ROWS - 1, 64)))
    assert calls == []
    layer(mx.ones((2, quantized_matmul.DEQUANTIZED_MATMUL_ROWS // 2, 64)))
    assert calls == [(2, quantized_matmul.DEQUANTIZED_MATMUL_ROWS // 2, 64)]


def test_output_rows_are_dequantized_in_slices(monkeypatch):
    """A weight taller than one slice is multiplied slice by slice; the
    pieces land in order (slices of 40 rows, one ragged)."""
    monkeypatch.setattr(quantized_matmul, "DEQUANTIZED_SLICE_ROWS", 40)
    layer = _quantized_linear(100, 64, 4, seed=3)
    x = mx.random.normal((16, 64), key=mx.random.key(3))
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


@pytest.mark.parametrize("rows", [1, 20])
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
    x = mx.random.normal((16, 256), key=mx.random.key(11))
    scales, biases = (np.array(layer[n].astype(mx.float32), dtype=np.float64) for n in ("scales", "biases"))
    codes = np.array(mx.dequantize(layer["weight"], mx.ones_like(layer["scales"]).astype(mx.float32),
                                   mx.zeros_like(layer["biases"]).astype(mx.float32), group_size=32, bits=8),
                     dtype=np.float64)
    weight = codes * np.repeat(scales, 32, axis=1) + np.repeat(biases, 32, axis=1)
    expected = np.array(x, dtype=np.float64) @ weight.T
    np.testing.assert_allclose(np.array(layer(x)), expected, rtol=1e-5, atol=1e-5)
