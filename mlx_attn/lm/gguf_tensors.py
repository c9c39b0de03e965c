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
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np

__all__ = ["GGUFFile", "read_gguf", "dequantize", "QuantizationPolicy", "DEFAULT_POLICY", "to_mlx_weights",
           "needs_gguf_package", "SOURCE_BITS"]

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


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # ggml order: innermost first
    type_name: str
    data: np.ndarray  # the raw bytes (uint8), a view of the mapped file


@dataclasses.dataclass
class GGUFFile:
    """Metadata as plain Python values, and the tensors (not yet decoded)."""

    path: Path
    metadata: dict
    tensors: dict  # name -> TensorInfo

    def type_name(self, name: str) -> str:
        return self.tensors[name].type_name

    def shape(self, name: str) -> tuple[int, ...]:
        """Row-major shape (ggml lists dimensions innermost first)."""
        return tuple(reversed(self.tensors[name].dims))


# GGUF value types -> struct format of one scalar (8: string, 9: array)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


class _Cursor:
    """Sequential little-endian reads; every read is bounds-checked (the
    structure check ran first, this is the second line)."""

    def __init__(self, data: memoryview, path: Path):
        self.data, self.path, self.pos = data, path, 0

    def take(self, fmt: str):
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.data):
            raise ValueError(f"{self.path} is truncated or corrupted (at byte {self.pos})")
        values = struct.unpack_from("<" + fmt, self.data, self.pos)
        self.pos += size
        return values[0] if len(values) == 1 else values

    def string(self) -> str:
        length = self.take("Q")
        if self.pos + length > len(self.data):
            raise ValueError(f"{self.path} is truncated or corrupted: a string runs past the end")
        self.pos += length
        try:
            return bytes(self.data[self.pos - length:self.pos]).decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{self.path}: a metadata string is not UTF-8") from None

    def value(self, kind: int):
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == 8:
            return self.string()
        if kind == 9:
            item_kind, count = self.take("IQ")
            if count > len(self.data) - self.pos:
                raise ValueError(f"{self.path} is truncated or corrupted: an array claims {count} items")
            if item_kind in _SCALARS:
                fmt = _SCALARS[item_kind]
                size = struct.calcsize(fmt) * count
                if self.pos + size > len(self.data):
                    raise ValueError(f"{self.path} is truncated or corrupted: an array runs past the end")
                values = np.frombuffer(self.data, dtype=np.dtype("<" + fmt), count=count, offset=self.pos)
                self.pos += size
                return values.tolist()
            return [self.value(item_kind) for _ in range(count)]
        raise ValueError(f"{self.path}: unknown metadata value type {kind}")


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Open a GGUF file of any tensor types; a damaged file is a ValueError
    naming it. The file stays mapped while its tensors are alive."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    from mlx_attn.lm.loading import check_gguf_structure

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF model file not found: {path}")
    check_gguf_structure(path)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    cursor = _Cursor(memoryview(data), path)
    _magic, _version, tensor_count, kv_count = cursor.take("4sIQQ")
    metadata = {}
    for _ in range(kv_count):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.take("I"))
    alignment = metadata.get("general.alignment", 32)
    raw = []
    for _ in range(tensor_count):
        name = cursor.string()
        dims = tuple(cursor.take("Q") for _ in range(cursor.take("I")))
        kind, offset = cursor.take("IQ")
        raw.append((name, dims, kind, offset))
    start = -(-cursor.pos // alignment) * alignment
    tensors = {}
    for name, dims, kind, offset in raw:
        if name in tensors:
            raise ValueError(f"{path}: tensor {name!r} appears twice")
        try:
            qtype = GGMLQuantizationType(kind)
        except ValueError:
            raise ValueError(f"{path}: tensor {name!r} has unknown ggml type {kind}") from None
        if not 1 <= len(dims) <= 4 or any(d < 1 for d in dims):
            raise ValueError(f"{path}: tensor {name!r} has shape {list(dims)}")
        elements = math.prod(dims)
        if elements > MAX_ELEMENTS:
            raise ValueError(f"{path}: tensor {name!r} has {elements} elements, more than MLX indexes")
        block, type_size = GGML_QUANT_SIZES[qtype]
        if dims[0] % block:
            raise ValueError(f"{path}: tensor {name!r} rows of {dims[0]} are not whole {qtype.name} blocks of {block}")
        size = elements // block * type_size
        if start + offset + size > len(data):
            raise ValueError(f"{path} is truncated or corrupted: tensor {name!r} runs past the end")
        tensors[name] = TensorInfo(name, dims, qtype.name, data[start + offset:start + offset + size])
    return GGUFFile(path, metadata, tensors)


def dequantize(file: GGUFFile, name: str) -> np.ndarray:
    """One tensor as float32, in row-major shape."""
    from gguf import quants

    from gguf.constants import GGMLQuantizationType

    tensor = file.tensors[name]
    rows = math.prod(tensor.dims[1:])
    try:
        values = quants.dequantize(np.asarray(tensor.data).reshape(rows, -1), GGMLQuantizationType[tensor.type_name])
    except NotImplementedError:
        raise ValueError(f"{file.path}: tensor {name!r} has type {tensor.type_name}, which the gguf "
                         "package cannot dequantize") from None
    values = np.asarray(values, dtype=np.float32).reshape(file.shape(name))
    if not np.isfinite(values).all():
        raise ValueError(f"{file.path}: tensor {name!r} holds NaN or infinite values")
    return values


@dataclasses.dataclass(frozen=True)
class QuantizationPolicy:
    """How the file's quantized matrices are re-quantized for MLX: ``bits``
    an MLX width, or ``"source"`` for :data:`SOURCE_BITS` of each tensor's
    ggml type, or None for none at all (every tensor float32). Tensors the
    file stores as floats stay float."""

    bits: int | str | None = 8
    group_size: int = 32

    def __post_init__(self):
        if self.bits is not None and self.bits != "source" and self.bits not in MLX_BITS:
            raise ValueError(f"bits must be one of {MLX_BITS}, 'source' or None, got {self.bits!r}")
        if self.group_size not in MLX_GROUP_SIZES:
            raise ValueError(f"group_size must be one of {MLX_GROUP_SIZES}, got {self.group_size!r}")

    def bits_for(self, type_name: str) -> int | None:
        if self.bits is None or type_name not in SOURCE_BITS:
            return None
        return SOURCE_BITS[type_name] if self.bits == "source" else self.bits


# chosen by measured logit error against the dequantized float32 model
# (docs/gemma3.md): 8 bits in groups of 32 for every quantized matrix
DEFAULT_POLICY = QuantizationPolicy(bits=8, group_size=32)


def to_mlx_weights(file: GGUFFile, policy: QuantizationPolicy | None = None) -> dict[str, mx.array]:
    """Every tensor as MLX arrays under the names ``mx.load`` gives a GGUF:
    a quantized 2-D ``x.weight`` whose rows are whole groups becomes the
    affine triple ``x.weight`` (packed uint32), ``x.scales``, ``x.biases``;
    every other tensor float32. ``policy``: :data:`DEFAULT_POLICY` if None."""
    policy = DEFAULT_POLICY if policy is None else policy
    weights = {}
    for name in file.tensors:
        values = dequantize(file, name)
        bits = policy.bits_for(file.type_name(name))
        if bits is None or values.ndim != 2 or values.shape[1] % policy.group_size or not name.endswith(".weight"):
            weights[name] = mx.array(values)
            continue
        packed, scales, biases = mx.quantize(mx.array(values), group_size=policy.group_size, bits=bits)
        module = name.removesuffix(".weight")
        weights[f"{module}.weight"], weights[f"{module}.scales"], weights[f"{module}.biases"] = packed, scales, biases
        mx.eval(packed, scales, biases)  # one float copy alive at a time
    return weights


# what mx.load reads of a GGUF (F32, F16, BF16 and, kept quantized, Q4_0, Q4_1, Q8_0)
MLX_READABLE = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0"}


def needs_gguf_package(file: GGUFFile) -> bool:
    """Whether a tensor's type is one ``mx.load`` cannot read."""
    return any(t.type_name not in MLX_READABLE for t in file.tensors.values())
