"""The ``mx.quantize`` triple format that quantized attention, quantized
paged attention and ``QuantizedKVCache`` share.

A quantized tensor is the triple ``(packed, scales, biases)`` that
``mx.quantize(x, group_size, bits)`` returns for ``x`` of shape
``[..., D]``: ``packed`` is uint32 ``[..., D * bits / 32]`` (element ``i`` of
a word sits at bit ``(i % (32 / bits)) * bits``), ``scales`` and ``biases``
are float ``[..., D / group_size]`` and
``x[..., i] ~= packed_i * scales[..., i // group_size] + biases[..., i // group_size]``.
"""

from __future__ import annotations

import mlx.core as mx

from mlx_attn.core.checks import FLOAT_DTYPES, check_int

__all__ = [
    "SUPPORTED_BITS", "SUPPORTED_GROUP_SIZES", "check_quantization", "check_quantizable_dim", "quantize",
    "dequantize", "quantized_head_dim", "check_triple",
]

SUPPORTED_BITS = (4, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)
WORD_BITS = 32


def check_quantization(group_size, bits) -> tuple[int, int]:
    """``(group_size, bits)`` checked against the supported values."""
    group_size = check_int("group_size", group_size)
    bits = check_int("bits", bits)
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {SUPPORTED_GROUP_SIZES}, got {group_size}")
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    return group_size, bits


def check_quantizable_dim(name: str, dim: int, group_size: int) -> None:
    """A feature dimension ``mx.quantize`` can split into whole groups."""
    if dim == 0 or dim % group_size != 0:
        raise ValueError(f"{name} {dim} must be a positive multiple of group_size={group_size}")


def quantize(x: mx.array, group_size: int = 64, bits: int = 8) -> tuple[mx.array, mx.array, mx.array]:
    """``x [..., D]`` as a ``(packed, scales, biases)`` triple (``mx.quantize``)."""
    group_size, bits = check_quantization(group_size, bits)
    check_quantizable_dim("the last dimension", x.shape[-1], group_size)
    return tuple(mx.quantize(x, group_size=group_size, bits=bits))


def dequantize(triple, group_size: int = 64, bits: int = 8) -> mx.array:
    """The float array a ``(packed, scales, biases)`` triple stands for."""
    packed, scales, biases = triple
    if packed.size == 0:  # mx.dequantize cannot reshape an empty array
        return mx.zeros((*packed.shape[:-1], quantized_head_dim(packed, bits)), dtype=scales.dtype)
    return mx.dequantize(packed, scales, biases, group_size=group_size, bits=bits)


def quantized_head_dim(packed: mx.array, bits: int) -> int:
    """The feature dimension a packed uint32 array holds."""
    return packed.shape[-1] * (WORD_BITS // bits)


def check_triple(name: str, triple, group_size: int, bits: int) -> tuple[mx.array, mx.array, mx.array]:
    """One ``(packed, scales, biases)`` triple: types, ranks, dtypes and the
    shapes ``mx.quantize`` gives for this group size and bit width."""
    if not isinstance(triple, (tuple, list)) or len(triple) != 3:
        raise ValueError(f"{name} must be a (packed, scales, biases) triple as mx.quantize returns, "
                         f"got {type(triple).__name__}"
                         + (f" of length {len(triple)}" if isinstance(triple, (tuple, list)) else ""))
    for part, a in zip(("packed", "scales", "biases"), triple):
        if not isinstance(a, mx.array):
            raise ValueError(f"{name} {part} must be an mlx.core.array, got {type(a).__name__}")
        if a.ndim != 4:
            raise ValueError(f"{name} {part} must have rank 4 [batch, heads, length, features], got {a.shape}")
    packed, scales, biases = triple
    if packed.dtype != mx.uint32:
        raise ValueError(f"{name} packed must be uint32 (mx.quantize's packing), got {packed.dtype}")
    if scales.dtype not in FLOAT_DTYPES or biases.dtype != scales.dtype:
        raise ValueError(
            f"{name} scales and biases must share one float dtype (float16, bfloat16, float32), "
            f"got {scales.dtype} and {biases.dtype}"
        )
    if scales.shape != biases.shape or scales.shape[:3] != packed.shape[:3]:
        raise ValueError(
            f"{name} packed {packed.shape}, scales {scales.shape} and biases {biases.shape} disagree on "
            f"[batch, heads, length] or scales/biases shapes"
        )
    dim = quantized_head_dim(packed, bits)
    if dim == 0 or dim % group_size != 0 or scales.shape[3] != dim // group_size:
        raise ValueError(
            f"{name} does not match group_size={group_size}, bits={bits}: packed {packed.shape} holds "
            f"{dim} features, which needs scales/biases with {dim // group_size if dim % group_size == 0 else '?'} "
            f"groups, got {scales.shape}"
        )
    return packed, scales, biases
