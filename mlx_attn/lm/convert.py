"""Write a loaded decoder as a model directory in mlx-lm's layout, so the
same weights run in both tools: ``config.json`` (Hugging Face field names,
mlx-lm's ``quantization`` entry), ``model.safetensors`` (``model.``-prefixed
tensor names; quantized layers keep MLX's ``weight``/``scales``/``biases``),
``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``
and ``generation_config.json`` (every end token).

The model's architecture (:mod:`mlx_attn.lm.models.registry`) gives the
``config.json`` (its ``hf_config``) and mlx-lm's tensor names
(``mlx_lm_name``)."""

from __future__ import annotations

import collections
import json
import os
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_attn.lm.loading import QUANTIZATION_MODE, load_model
from mlx_attn.lm.models.registry import Architecture, architectures
from mlx_attn.lm.quantized_matmul import stored_bits, stored_form

__all__ = ["convert", "save_mlx_directory"]

WEIGHTS_FILE = "model.safetensors"


def _architecture(model) -> Architecture:
    for arch in architectures():
        if type(model) is arch.model_class:
            return arch
    raise ValueError(f"{type(model).__name__} is no registered architecture's model class")


def _quantization(model: nn.Module, arch: Architecture) -> dict | None:
    """mlx-lm's ``quantization`` entry: the most common bits/group size, and
    per-layer entries (mlx-lm's module paths) for layers that differ."""
    layers = {arch.mlx_lm_name(path): (stored_bits(m), m.group_size)
              for path, m in model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))}
    if not layers:
        return None
    bits, group_size = collections.Counter(layers.values()).most_common(1)[0][0]
    entry = {"group_size": group_size, "bits": bits, "mode": QUANTIZATION_MODE}
    for path, (layer_bits, layer_group) in sorted(layers.items()):
        if (layer_bits, layer_group) != (bits, group_size):
            entry[path] = {"group_size": layer_group, "bits": layer_bits, "mode": QUANTIZATION_MODE}
    return entry


def _check_target(path: Path) -> None:
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ValueError(f"--mlx-path {path} already exists and is not an empty directory")


def save_mlx_directory(model, tokenizer, path: str | os.PathLike) -> Path:
    """Write ``model`` (a decoder of a registered architecture) and its
    tokenizer to a new directory ``path``; refuses to write into a non-empty one."""
    arch = _architecture(model)
    path = Path(path)
    _check_target(path)
    path.mkdir(parents=True, exist_ok=True)
    config = arch.hf_config(model.config)
    quantization = _quantization(model, arch)
    if quantization is not None:
        config["quantization"] = config["quantization_config"] = quantization
    weights = {arch.mlx_lm_name(name): value for name, value in tree_flatten(model.parameters())}
    for name, module in model.named_modules():  # layers widened for the CPU product: the width they were loaded at
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)) and stored_bits(module) != module.bits:
            weights[arch.mlx_lm_name(f"{name}.weight")] = stored_form(module)[1]
    mx.save_safetensors(str(path / WEIGHTS_FILE), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=2))

    tokenizer.backend.save(str(path / "tokenizer.json"))
    special = {}
    if tokenizer.bos_token_id is not None:
        special["bos_token"] = tokenizer.backend.id_to_token(tokenizer.bos_token_id)
    eos_ids = sorted(tokenizer.eos_token_ids)
    if eos_ids:
        special["eos_token"] = tokenizer.backend.id_to_token(eos_ids[0])
    tokenizer_config = dict(special, tokenizer_class="PreTrainedTokenizerFast", add_bos_token=tokenizer.add_bos)
    if "max_position_embeddings" in config:
        tokenizer_config["model_max_length"] = config["max_position_embeddings"]
    if tokenizer.chat_template:
        tokenizer_config["chat_template"] = tokenizer.chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (path / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
    generation = {"eos_token_id": eos_ids}
    if tokenizer.bos_token_id is not None:
        generation["bos_token_id"] = tokenizer.bos_token_id
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return path


def convert(model: str | os.PathLike | None, mlx_path: str | os.PathLike) -> Path:
    """A ``.gguf`` file, model directory or registered name -> an mlx-lm
    directory at ``mlx_path``."""
    if mlx_path is None or not str(mlx_path):
        raise ValueError("--mlx-path must name the directory to create")
    target = Path(mlx_path)
    _check_target(target)  # before the slow load
    loaded, tokenizer = load_model(model)
    return save_mlx_directory(loaded, tokenizer, target)
