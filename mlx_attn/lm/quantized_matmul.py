"""How a quantized layer multiplies: per device and per number of rows.

MLX's quantized matmul on the CPU costs about the same per row whatever the
number of rows (a 512-row prompt chunk costs ~512 single rows), while a
float32 matrix product through an optimised BLAS gains from every extra row.
So on the CPU, from ``DEQUANTIZED_MATMUL_ROWS`` rows on, a quantized layer
dequantizes its weight (a transient the size of one layer, in slices of at
most ``DEQUANTIZED_SLICE_ROWS`` output rows) and multiplies in float32:
measured here with the system OpenBLAS (``mlx_attn.use_system_blas()``),
20x faster at 512 rows, 4x at 16, slower below ~8. One row (decode) keeps
MLX's quantized kernel, which reads 4 or 8 bits per weight instead of 32.
On a GPU MLX's quantized kernels are the fast path at every row count, so
nothing changes there. The stored weights stay quantized either way.

``benchmarks/bench_generate.py`` and ``benchmarks/bench_gemma3.py`` measure
the effect on prompt speed.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

__all__ = ["DEQUANTIZED_MATMUL_ROWS", "DEQUANTIZED_SLICE_ROWS", "RowAdaptiveQuantizedLinear",
           "RowAdaptiveQuantizedEmbedding", "use_row_adaptive_matmuls"]

# rows from which the CPU multiplies a dequantized float32 weight
DEQUANTIZED_MATMUL_ROWS = 8
# output rows of a weight dequantized at once: bounds the transient (an output head of 262,144 x 640
# would otherwise be 671 MB of float32 at once)
DEQUANTIZED_SLICE_ROWS = 16384


def _rows(x: mx.array) -> int:
    return x.size // x.shape[-1] if x.ndim else 0


def _dequantized_rows(x: mx.array) -> bool:
    return _rows(x) >= DEQUANTIZED_MATMUL_ROWS and mx.default_device() == mx.cpu


def dequantized_matmul(x: mx.array, layer) -> mx.array:
    """``x @ W.T`` for the quantized weight of ``layer`` (a quantized linear or
    embedding), through float32 slices of at most ``DEQUANTIZED_SLICE_ROWS``
    output rows, in ``x``'s dtype."""
    weight, scales, biases = layer["weight"], layer["scales"], layer.get("biases")
    x32 = x.astype(mx.float32)
    outputs = []
    for begin in range(0, weight.shape[0], DEQUANTIZED_SLICE_ROWS):
        end = begin + DEQUANTIZED_SLICE_ROWS
        # scale * code + bias in float32, as MLX's quantized kernel computes it: dequantizing in the
        # scales' own (half) dtype would round every weight once more
        w = mx.dequantize(weight[begin:end], scales[begin:end].astype(mx.float32),
                          None if biases is None else biases[begin:end].astype(mx.float32),
                          group_size=layer.group_size, bits=layer.bits, mode=layer.mode)
        outputs.append(x32 @ w.T)
    out = outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=-1)
    return out.astype(x.dtype)


class RowAdaptiveQuantizedLinear(nn.QuantizedLinear):
    """``nn.QuantizedLinear`` that multiplies many rows on the CPU through a
    dequantized float32 weight (see the module)."""

    def __call__(self, x):
        if not _dequantized_rows(x):
            return super().__call__(x)
        y = dequantized_matmul(x, self)
        return y + self["bias"] if "bias" in self else y


class RowAdaptiveQuantizedEmbedding(nn.QuantizedEmbedding):
    """``nn.QuantizedEmbedding`` whose ``as_linear`` (a tied output head)
    multiplies many rows on the CPU through dequantized float32 slices."""

    def as_linear(self, x):
        return dequantized_matmul(x, self) if _dequantized_rows(x) else super().as_linear(x)


_ROW_ADAPTIVE = {nn.QuantizedLinear: RowAdaptiveQuantizedLinear, nn.QuantizedEmbedding: RowAdaptiveQuantizedEmbedding}


def use_row_adaptive_matmuls(model: nn.Module) -> nn.Module:
    """Give every quantized linear and embedding layer of ``model`` the
    row-adaptive multiply (in place; same weights, same state)."""
    for _, module in model.named_modules():
        adaptive = _ROW_ADAPTIVE.get(type(module))
        if adaptive is not None:
            module.__class__ = adaptive
    return model
