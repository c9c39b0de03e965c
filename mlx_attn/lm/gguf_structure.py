"""The structure check of a GGUF file: header, metadata and tensor table
walked with bounds-checked reads before MLX's reader or
:mod:`mlx_attn.lm.gguf_tensors` trusts any count in them. Both loaders
(:mod:`mlx_attn.lm.loading`, :mod:`mlx_attn.lm.gguf_tensors`) run it first."""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

__all__ = ["check_gguf_structure"]


# GGUF value types -> struct format of one scalar (8: string, 9: array)
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
# ggml tensor types -> (elements per block, bytes per block), for the size check
_GGML_BLOCKS = {
    0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 9: (32, 36),
    10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 15: (256, 292), 30: (1, 2),
}


class _GGUFReader:
    """Bounds-checked reads from a mapped GGUF file."""

    def __init__(self, data, path: Path):
        self.data, self.path, self.pos = data, path, 0

    def fail(self, what: str):
        raise ValueError(f"{self.path} is truncated or corrupted: {what} (at byte {self.pos} of {len(self.data)})")

    def unpack(self, fmt: str, what: str):
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.data):
            self.fail(f"{what} runs past the end of the file")
        values = struct.unpack_from("<" + fmt, self.data, self.pos)
        self.pos += size
        return values[0] if len(values) == 1 else values

    def string(self, what: str) -> bytes:
        length = self.unpack("Q", f"length of {what}")
        if self.pos + length > len(self.data):
            self.fail(f"{what} ({length} bytes) runs past the end of the file")
        self.pos += length
        return bytes(self.data[self.pos - length : self.pos])

    def skip_value(self, kind: int, what: str) -> None:
        if kind in _GGUF_SCALARS:
            self.unpack(_GGUF_SCALARS[kind], what)
        elif kind == 8:
            self.string(what)
        elif kind == 9:
            item_kind, count = self.unpack("IQ", f"array header of {what}")
            if item_kind in _GGUF_SCALARS:
                size = struct.calcsize("<" + _GGUF_SCALARS[item_kind]) * count
                if self.pos + size > len(self.data):
                    self.fail(f"array {what} ({count} items) runs past the end of the file")
                self.pos += size
            elif item_kind == 8:
                if count > len(self.data) - self.pos:
                    self.fail(f"array {what} claims {count} strings")
                for _ in range(count):
                    self.string(what)
            else:
                self.fail(f"array {what} has unsupported item type {item_kind}")
        else:
            self.fail(f"{what} has unknown value type {kind}")


def check_gguf_structure(path: str | os.PathLike) -> None:
    """Walk a GGUF file's header, metadata and tensor table and check that
    everything, tensor data included, lies inside the file. MLX's GGUF reader
    trusts these counts and can crash the process on a corrupted file, so this
    runs first and turns such damage into a ValueError naming the file."""
    path = Path(path)
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size < 24:
            raise ValueError(f"{path} is truncated or corrupted: shorter than a GGUF header")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            reader = _GGUFReader(data, path)
            magic, version, tensor_count, kv_count = reader.unpack("4sIQQ", "header")
            if magic != b"GGUF":
                raise ValueError(f"{path} is not a GGUF file (bad magic bytes)")
            if version not in (2, 3):
                reader.fail(f"unsupported GGUF version {version}")
            if tensor_count > len(data) or kv_count > len(data):
                reader.fail(f"header claims {tensor_count} tensors and {kv_count} metadata entries")
            alignment = 32
            for index in range(kv_count):
                key = reader.string(f"metadata key {index}")
                kind = reader.unpack("I", f"type of metadata {key!r}")
                if key == b"general.alignment" and kind == 4:
                    alignment = reader.unpack("I", "general.alignment")
                    if alignment == 0 or alignment & (alignment - 1):
                        reader.fail(f"general.alignment {alignment} is not a power of two")
                else:
                    reader.skip_value(kind, f"metadata {key!r}")
            tensors = []
            for index in range(tensor_count):
                name = reader.string(f"name of tensor {index}").decode("utf-8", "replace")
                n_dims = reader.unpack("I", f"rank of tensor {name!r}")
                if n_dims > 4:
                    reader.fail(f"tensor {name!r} claims {n_dims} dimensions")
                dims = [reader.unpack("Q", f"shape of tensor {name!r}") for _ in range(n_dims)]
                kind, offset = reader.unpack("IQ", f"type and offset of tensor {name!r}")
                tensors.append((name, dims, kind, offset))
            data_start = -(-reader.pos // alignment) * alignment
            for name, dims, kind, offset in tensors:
                elements = 1
                for dim in dims:
                    elements *= dim
                if kind not in _GGML_BLOCKS:
                    raise ValueError(f"{path}: tensor {name!r} has unsupported ggml type {kind}")
                per_block, block_bytes = _GGML_BLOCKS[kind]
                end = data_start + offset + -(-elements // per_block) * block_bytes
                if end > len(data):
                    raise ValueError(
                        f"{path} is truncated or corrupted: tensor {name!r} ends at byte {end}, "
                        f"the file has {len(data)} bytes"
                    )
