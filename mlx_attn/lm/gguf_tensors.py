"""GGUF tensors of any ggml type, dequantized with the ``gguf`` package
(llama.cpp's own Python code, ``gguf.quants.dequantize``).

``mx.load`` reads only F32/F16/BF16/Q4_0/Q4_1/Q8_0 GGUF tensors; the K-quants
(Q4_K, Q6_K, ...) and Q5_0 that most published GGUF files mix in fail there.
This module parses the file itself (``gguf.GGUFReader`` takes 15 s on a
262k-token vocabulary), dequantizes every tensor to float32 and turns the
quantized matrices into MLX's affine format (packed uint32 weights, a scale
and a bias per group of 32): exactly, for the types whose blocks are affine
groups (:data:`EXACT_BITS`), else re-quantized (:class:`QuantizationPolicy`;
the choice is measured in docs/gemma3.md).

Untrusted sizes are checked before anything is allocated: the file's
structure first (every tensor inside the file, by
:func:`mlx_attn.lm.gguf_structure.check_gguf_structure`), then each tensor's element
count against its ggml block layout."""

from __future__ import annotations

import dataclasses
import math
import os
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_attn.lm.gguf_structure import check_gguf_structure

__all__ = ["GGUFFile", "read_gguf", "dequantize", "QuantizationPolicy", "DEFAULT_POLICY", "to_mlx_weights",
           "needs_gguf_package", "EXACT_BITS", "QUANTIZED_TYPES"]

MAX_ELEMENTS = 2**31 - 1  # MLX arrays index with 32-bit sizes

# the ggml types that store matrices quantized (the others are float or integer)
QUANTIZED_TYPES = {
    "Q2_K", "Q3_K", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0", "Q4_0",
    "Q4_1", "Q4_K", "IQ4_NL", "IQ4_XS", "MXFP4", "NVFP4", "Q1_0", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "Q8_1",
    "Q8_K",
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
    """How the file's quantized matrices become MLX ones (groups of
    ``group_size``): ``bits="exact"`` carries the types whose blocks are
    affine groups of 32 over to MLX unchanged (:data:`EXACT_BITS`) and
    re-quantizes the others at ``fallback_bits``; an int re-quantizes every
    quantized matrix at that width; None keeps everything float32. Tensors
    the file stores as floats stay float."""

    bits: int | str | None = "exact"
    group_size: int = 32
    fallback_bits: int = 8

    def __post_init__(self):
        if self.bits is not None and self.bits != "exact" and self.bits not in MLX_BITS:
            raise ValueError(f"bits must be one of {MLX_BITS}, 'exact' or None, got {self.bits!r}")
        if self.group_size not in MLX_GROUP_SIZES:
            raise ValueError(f"group_size must be one of {MLX_GROUP_SIZES}, got {self.group_size!r}")
        if self.fallback_bits not in MLX_BITS:
            raise ValueError(f"fallback_bits must be one of {MLX_BITS}, got {self.fallback_bits!r}")
        if self.bits == "exact" and self.group_size != 32:
            raise ValueError("bits='exact' needs group_size 32 (the ggml block size)")


# chosen by measured logit error against the dequantized float32 model
# (docs/gemma3.md): the affine types carried over exactly, the rest at 8 bits
DEFAULT_POLICY = QuantizationPolicy()

# ggml types whose blocks (or 32-element sub-blocks) are MLX affine groups:
# value = scale * code + bias with integer codes of this many bits
EXACT_BITS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8, "Q4_K": 4, "Q5_K": 5}


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[:, at:at + 2].copy().view(np.float16).astype(np.float32)[:, 0]


def _group_affine(type_name: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per 32-element group: (scale, bias) such that every value of the
    group is scale * code + bias for an integer code (ggml's block layouts)."""
    if type_name in ("Q4_0", "Q5_0", "Q8_0"):  # d * (q - offset)
        d = _f16(blocks, 0)
        offset = {"Q4_0": 8, "Q5_0": 16, "Q8_0": 128}[type_name]
        return d, -offset * d
    if type_name in ("Q4_1", "Q5_1"):  # d * q + m
        return _f16(blocks, 0), _f16(blocks, 2)
    from gguf.quants import Q4_K  # Q4_K and Q5_K pack their 6-bit sub-block scales alike

    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16].copy())
    return (d[:, None] * sc.astype(np.float32)).reshape(-1), (-dmin[:, None] * m.astype(np.float32)).reshape(-1)


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes [rows, n] -> MLX's packing: one little-endian bit stream per row
    in uint32 words."""
    if bits == 8:
        return np.ascontiguousarray(codes).view(np.uint32)
    if bits == 4:
        return np.ascontiguousarray(codes[:, 0::2] | (codes[:, 1::2] << 4)).view(np.uint32)
    bit_planes = (codes[..., None] >> np.arange(bits, dtype=np.uint8)) & 1
    stream = np.packbits(bit_planes.reshape(codes.shape[0], -1).astype(np.uint8), axis=1, bitorder="little")
    return stream.view(np.uint32)


def exact_affine(file: GGUFFile, name: str, values: np.ndarray):
    """The MLX triple (packed, scales, biases) holding exactly ``values`` (the
    tensor's dequantized values), or None when its type has no exact MLX form
    or the result does not reproduce them."""
    type_name = file.type_name(name)
    bits = EXACT_BITS.get(type_name)
    if bits is None or values.ndim != 2 or values.shape[1] % 32:
        return None
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    _, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    blocks = np.asarray(file.tensors[name].data).reshape(-1, type_size)
    scale, bias = _group_affine(type_name, blocks)
    rows, groups = values.shape[0], values.shape[1] // 32
    scale, bias = scale.reshape(rows, groups), bias.reshape(rows, groups)
    grouped = values.reshape(rows, groups, 32)
    safe = np.where(scale == 0, 1.0, scale)[..., None]
    codes = np.clip(np.rint((grouped - bias[..., None]) / safe), 0, 2**bits - 1).astype(np.uint8)
    rebuilt = scale[..., None] * codes + bias[..., None]
    if not np.allclose(rebuilt, grouped, rtol=1e-5, atol=1e-6 * max(1.0, float(np.abs(values).max()))):
        return None
    packed = mx.array(_pack(codes.reshape(rows, -1), bits))
    return packed, mx.array(scale), mx.array(bias), bits


def to_mlx_weights(file: GGUFFile, policy: QuantizationPolicy | None = None) -> dict[str, mx.array]:
    """Every tensor as MLX arrays under the names ``mx.load`` gives a GGUF:
    a quantized 2-D ``x.weight`` whose rows are whole groups becomes the
    affine triple ``x.weight`` (packed uint32), ``x.scales``, ``x.biases``;
    every other tensor float32. ``policy``: :data:`DEFAULT_POLICY` if None."""
    policy = DEFAULT_POLICY if policy is None else policy
    weights = {}
    for name in file.tensors:
        values = dequantize(file, name)
        quantized = file.type_name(name) in QUANTIZED_TYPES
        if (policy.bits is None or not quantized or values.ndim != 2 or values.shape[1] % policy.group_size
                or not name.endswith(".weight")):
            weights[name] = mx.array(values)
            continue
        exact = exact_affine(file, name, values) if policy.bits == "exact" else None
        if exact is not None:
            packed, scales, biases, _ = exact
        else:
            bits = policy.fallback_bits if policy.bits == "exact" else policy.bits
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
