"""Load pretrained decoders: GGUF files (MLX's own GGUF reader; Q4_0/Q4_1/Q8_0
weights stay MLX-quantized) and Hugging Face model directories
(``config.json``, ``*.safetensors``, ``tokenizer.json``)."""

from __future__ import annotations

import json
import mmap
import os
import re
import struct
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from mlx_attn.lm.models.llama import Llama, LlamaConfig
from mlx_attn.lm.tokenizer import Tokenizer, tokenizer_from_file, tokenizer_from_gguf_metadata

__all__ = ["load_gguf", "load_hf_directory", "load_decoder", "rename_weights", "check_gguf_structure"]

# GGUF tensor names -> this package's module paths
_GGUF_NAMES = [
    (r"^token_embd\.", "embed_tokens."),
    (r"^output_norm\.", "norm."),
    (r"^output\.", "lm_head."),
    (r"^blk\.(\d+)\.attn_q\.", r"layers.\1.self_attn.q_proj."),
    (r"^blk\.(\d+)\.attn_k\.", r"layers.\1.self_attn.k_proj."),
    (r"^blk\.(\d+)\.attn_v\.", r"layers.\1.self_attn.v_proj."),
    (r"^blk\.(\d+)\.attn_output\.", r"layers.\1.self_attn.o_proj."),
    (r"^blk\.(\d+)\.attn_norm\.", r"layers.\1.input_layernorm."),
    (r"^blk\.(\d+)\.ffn_norm\.", r"layers.\1.post_attention_layernorm."),
    (r"^blk\.(\d+)\.ffn_gate\.", r"layers.\1.mlp.gate_proj."),
    (r"^blk\.(\d+)\.ffn_up\.", r"layers.\1.mlp.up_proj."),
    (r"^blk\.(\d+)\.ffn_down\.", r"layers.\1.mlp.down_proj."),
]
GGUF_GROUP_SIZE = 32  # every GGUF block type MLX keeps quantized uses blocks of 32


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
                per_block, block_bytes = _GGML_BLOCKS.get(kind, (1, 0))
                end = data_start + offset + -(-elements // per_block) * block_bytes
                if end > len(data):
                    raise ValueError(
                        f"{path} is truncated or corrupted: tensor {name!r} ends at byte {end}, "
                        f"the file has {len(data)} bytes"
                    )


def _require_file(path: Path, what: str) -> None:
    if not path.exists():
        raise FileNotFoundError(f"{what} not found: {path}")
    if path.is_file() and path.stat().st_size == 0:
        raise ValueError(f"{what} is empty: {path}")


def _meta_int(meta: dict, key: str, default=None) -> int:
    if key not in meta:
        if default is None:
            raise ValueError(f"GGUF metadata lacks {key!r}")
        return default
    value = meta[key]
    return int(value.item() if hasattr(value, "item") else value)


def _meta_float(meta: dict, key: str, default: float) -> float:
    value = meta.get(key, default)
    return float(value.item() if hasattr(value, "item") else value)


def rename_weights(weights: dict, patterns: list[tuple[str, str]], skip=lambda name: False, source="checkpoint") -> dict:
    """Map checkpoint tensor names to module paths with the first matching
    (regex, replacement); names `skip` accepts are dropped, others are errors."""
    renamed = {}
    for name, value in weights.items():
        if skip(name):
            continue
        for pattern, replacement in patterns:
            new, count = re.subn(pattern, replacement, name)
            if count:
                renamed[new] = value
                break
        else:
            raise ValueError(f"unexpected tensor {name!r} in the {source}")
    return renamed


def _quantize_like(model: nn.Module, weights: dict, group_size: int) -> None:
    """Turn every layer whose weights come quantized (they have `scales`) into
    its quantized counterpart, with the bit width the packed weight implies."""

    def params(path: str, module: nn.Module):
        scales = weights.get(f"{path}.scales")
        if scales is None or not hasattr(module, "to_quantized"):
            return False
        in_features = scales.shape[-1] * group_size
        bits = weights[f"{path}.weight"].shape[-1] * 32 // in_features
        return {"group_size": group_size, "bits": bits}

    nn.quantize(model, group_size=group_size, class_predicate=params)


def _build(config: LlamaConfig, weights: dict, group_size: int | None, backend: str, source: str) -> Llama:
    model = Llama(config, backend=backend)
    if group_size is not None:
        _quantize_like(model, weights, group_size)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as error:
        raise ValueError(f"{source}: weights do not fit a {config.num_hidden_layers}-layer Llama: {error}") from error
    mx.eval(model.parameters())
    return model


def load_gguf(path: str | os.PathLike, backend: str = "auto") -> tuple[Llama, Tokenizer]:
    """A Llama-architecture GGUF file -> (model, tokenizer)."""
    path = Path(path)
    _require_file(path, "GGUF model file")
    check_gguf_structure(path)
    try:
        weights, meta = mx.load(str(path), return_metadata=True)
    except Exception as error:
        raise ValueError(f"could not read {path} (truncated or corrupted GGUF?): {error}") from error
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: architecture {arch!r} is not supported (only 'llama')")
    heads = _meta_int(meta, "llama.attention.head_count")
    hidden = _meta_int(meta, "llama.embedding_length")
    config = LlamaConfig(
        vocab_size=_meta_int(meta, "llama.vocab_size", len(meta.get("tokenizer.ggml.tokens", []))),
        hidden_size=hidden,
        intermediate_size=_meta_int(meta, "llama.feed_forward_length"),
        num_hidden_layers=_meta_int(meta, "llama.block_count"),
        num_attention_heads=heads,
        num_key_value_heads=_meta_int(meta, "llama.attention.head_count_kv", heads),
        head_dim=_meta_int(meta, "llama.attention.key_length", hidden // heads),
        rms_norm_eps=_meta_float(meta, "llama.attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=_meta_float(meta, "llama.rope.freq_base", 10000.0),
        # llama.cpp's converter permutes Q/K rows so RoPE rotates adjacent pairs
        rope_traditional=True,
        tie_word_embeddings="output.weight" not in weights,
        max_position_embeddings=_meta_int(meta, "llama.context_length", 8192),
    )
    weights = rename_weights(weights, _GGUF_NAMES, skip=lambda n: n.startswith("rope_freqs"), source="GGUF file")
    quantized = any(name.endswith(".scales") for name in weights)
    model = _build(config, weights, GGUF_GROUP_SIZE if quantized else None, backend, str(path))
    return model, tokenizer_from_gguf_metadata(meta)


def load_hf_directory(path: str | os.PathLike, backend: str = "auto") -> tuple[Llama, Tokenizer]:
    """A Hugging Face Llama model directory -> (model, tokenizer)."""
    path = Path(path)
    _require_file(path / "config.json", "config.json")
    try:
        config_json = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path / 'config.json'} is not valid JSON: {error}") from error
    if config_json.get("model_type") not in ("llama", "mistral", None):
        raise ValueError(f"{path}: model_type {config_json.get('model_type')!r} is not a Llama-family decoder")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    weights = {}
    for file in files:
        try:
            weights.update(mx.load(str(file)))
        except Exception as error:
            raise ValueError(f"could not read {file} (truncated or corrupted?): {error}") from error
    weights = {name.removeprefix("model."): value for name, value in weights.items()}
    weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
    fields = {f for f in LlamaConfig.__dataclass_fields__}
    config = LlamaConfig(**{k: v for k, v in config_json.items() if k in fields})
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    quantization = config_json.get("quantization")
    model = _build(config, weights, quantization["group_size"] if quantization else None, backend, str(path))
    _require_file(path / "tokenizer.json", "tokenizer.json")
    tokenizer_config = {}
    if (path / "tokenizer_config.json").exists():
        tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    return model, tokenizer_from_file(path / "tokenizer.json", tokenizer_config)


def load_decoder(path: str | os.PathLike, backend: str = "auto") -> tuple[Llama, Tokenizer]:
    """A ``.gguf`` file or a Hugging Face directory."""
    path = Path(path)
    if path.is_dir():
        return load_hf_directory(path, backend)
    if path.suffix != ".gguf" and path.exists():
        raise ValueError(f"{path}: expected a .gguf file or a model directory")
    return load_gguf(path, backend)
