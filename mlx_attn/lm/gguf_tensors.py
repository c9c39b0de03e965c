"""GGUF tensors of any ggml type, read with the ``gguf`` package (llama.cpp's
own Python reader) and dequantized with ``gguf.quants.dequantize``.

``mx.load`` reads only F32/F16/BF16/Q4_0/Q4_1/Q8_0 GGUF tensors; the K-quants
(Q4_K, Q6_K, ...) and Q5_0 that most published GGUF files mix in fail there.
This module dequantizes every tensor to float32 and, for the matrices a
model multiplies by, re-quantizes it into MLX's affine format (packed uint32
weights, a scale and a bias per group) with a bit width chosen per tensor.

Untrusted sizes are checked before anything is allocated: the file's
structure first (every tensor inside the file, by
:func:`mlx_attn.lm.loading.check_gguf_structure`), then each tensor's element
count against its ggml block layout."""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import mlx.core as mx
import numpy as np

__all__ = ["GGUFFile", "read_gguf", "dequantize", "QuantizationPolicy", "to_mlx_weights", "SOURCE_BITS"]

MAX_ELEMENTS = 2**31 - 1  # MLX arrays index with 32-bit sizes

# ggml type name -> the MLX bit width that keeps its precision (no fewer bits
# than the source spends on a weight; MLX has no 5-bit K-quant super-blocks,
# so each is mapped to the next width MLX supports)
SOURCE_BITS = {
    "Q2_K": 3, "Q3_K": 3, "IQ2_XXS": 3, "IQ2_XS": 3, "IQ2_S": 3, "IQ3_XXS": 3, "IQ3_S": 3, "IQ1_S": 2,
    "IQ1_M": 2, "TQ1_0": 2, "TQ2_0": 2, "Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "IQ4_NL": 4, "IQ4_XS": 4, "MXFP4": 4,
    "Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q6_K": 6, "Q8_0": 8, "Q8_1": 8, "Q8_K": 8,
}
MLX_BITS = (2, 3, 4, 5, 6, 8)
MLX_GROUP_SIZES = (32, 64, 128)


@dataclasses.dataclass
class GGUFFile:
    """Metadata as plain Python values, and the tensors (not yet read)."""

    path: Path
    metadata: dict
    tensors: dict  # name -> gguf.ReaderTensor

    def type_name(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def shape(self, name: str) -> tuple[int, ...]:
        """Row-major shape (ggml lists dimensions innermost first)."""
        return tuple(int(d) for d in reversed(self.tensors[name].shape.tolist()))


def _plain(value):
    if isinstance(value, (np.generic,)):
        return value.item()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Open a GGUF file of any tensor types; a damaged file is a ValueError
    naming it."""
    import gguf

    from mlx_attn.lm.loading import check_gguf_structure

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF model file not found: {path}")
    check_gguf_structure(path)
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as error:  # the reader raises ValueError/IndexError/... on damage
        raise ValueError(f"could not read {path} (truncated or corrupted GGUF?): {error}") from None
    metadata = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            metadata[key] = _plain(field.contents())
        except Exception as error:  # noqa: BLE001 - a field the reader cannot decode
            raise ValueError(f"{path}: metadata {key!r} cannot be read: {error}") from None
    tensors = {}
    for tensor in reader.tensors:
        if tensor.name in tensors:
            raise ValueError(f"{path}: tensor {tensor.name!r} appears twice")
        _check_tensor(path, tensor)
        tensors[tensor.name] = tensor
    return GGUFFile(path, metadata, tensors)


def _check_tensor(path: Path, tensor) -> None:
    from gguf.constants import GGML_QUANT_SIZES

    dims = [int(d) for d in tensor.shape.tolist()]
    if not 1 <= len(dims) <= 4 or any(d < 1 for d in dims):
        raise ValueError(f"{path}: tensor {tensor.name!r} has shape {dims}")
    elements = math.prod(dims)
    if elements > MAX_ELEMENTS:
        raise ValueError(f"{path}: tensor {tensor.name!r} has {elements} elements, more than MLX indexes")
    block, type_size = GGML_QUANT_SIZES[tensor.tensor_type]
    if dims[0] % block:
        raise ValueError(f"{path}: tensor {tensor.name!r} rows of {dims[0]} are not whole "
                         f"{tensor.tensor_type.name} blocks of {block}")
    if tensor.n_bytes != elements // block * type_size or tensor.data.nbytes != tensor.n_bytes:
        raise ValueError(f"{path}: tensor {tensor.name!r} holds {tensor.data.nbytes} bytes, "
                         f"{tensor.tensor_type.name} {dims} needs {elements // block * type_size}")


def dequantize(file: GGUFFile, name: str) -> np.ndarray:
    """One tensor as float32, in row-major shape."""
    from gguf import quants

    tensor = file.tensors[name]
    try:
        values = quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise ValueError(f"{file.path}: tensor {name!r} has type {tensor.tensor_type.name}, which the gguf "
                         "package cannot dequantize") from None
    values = np.asarray(values, dtype=np.float32).reshape(file.shape(name))
    if not np.isfinite(values).all():
        raise ValueError(f"{file.path}: tensor {name!r} holds NaN or infinite values")
    return values


@dataclasses.dataclass(frozen=True)
class QuantizationPolicy:
    """How matrices are re-quantized for MLX: ``bits`` an MLX width, or
    ``"source"`` for :data:`SOURCE_BITS` of each tensor's ggml type (float
    tensors stay float), or None for no quantization at all (float32)."""

    bits: int | str | None = "source"
    group_size: int = 32

    def __post_init__(self):
        if self.bits is not None and self.bits != "source" and self.bits not in MLX_BITS:
            raise ValueError(f"bits must be one of {MLX_BITS}, 'source' or None, got {self.bits!r}")
        if self.group_size not in MLX_GROUP_SIZES:
            raise ValueError(f"group_size must be one of {MLX_GROUP_SIZES}, got {self.group_size!r}")

    def bits_for(self, type_name: str) -> int | None:
        if self.bits is None:
            return None
        if self.bits == "source":
            return SOURCE_BITS.get(type_name)
        return self.bits


def to_mlx_weights(file: GGUFFile, names: dict[str, str], quantizable: set[str],
                   policy: QuantizationPolicy = QuantizationPolicy()) -> dict[str, mx.array]:
    """``names``: GGUF tensor name -> module parameter path (``...weight``).
    Tensors whose path is in ``quantizable`` (2-D, the input width a multiple
    of the group size) become ``.weight/.scales/.biases`` triples with the
    policy's bits; all others float32."""
    weights = {}
    for gguf_name, path in names.items():
        values = dequantize(file, gguf_name)
        bits = policy.bits_for(file.type_name(gguf_name)) if path in quantizable else None
        if bits is not None and (values.ndim != 2 or values.shape[1] % policy.group_size):
            bits = None
        array = mx.array(values)
        if bits is None:
            weights[path] = array
            continue
        packed, scales, biases = mx.quantize(array, group_size=policy.group_size, bits=bits)
        module = path.removesuffix(".weight")
        weights[f"{module}.weight"], weights[f"{module}.scales"], weights[f"{module}.biases"] = packed, scales, biases
        mx.eval(packed, scales, biases)  # free the float copy before the next tensor
    return weights
