"""A Llama-family decoder built from mlx_attn's pieces: GQA attention
(:class:`mlx_attn.MultiHeadAttention`), RoPE and KV caches, with RMSNorm, a
SwiGLU MLP, tied or untied embeddings, and optionally quantized linear layers."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn

from mlx_attn.attention import MultiHeadAttention
from mlx_attn.cache import KVCache
from mlx_attn.rope import RoPE

__all__ = ["LlamaConfig", "Llama"]


@dataclasses.dataclass
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_traditional: bool = False  # GGUF files (llama.cpp layout) use interleaved pairs
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x):
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderBlock(nn.Module):
    def __init__(self, config: LlamaConfig, backend: str):
        super().__init__()
        self.self_attn = MultiHeadAttention(
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            head_dim=config.head_dim,
            bias=config.attention_bias,
            out_bias=False,
            rope=RoPE(config.head_dim, base=config.rope_theta, traditional=config.rope_traditional),
            backend=backend,
        )
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def __call__(self, x, mask, cache):
        x = x + self.self_attn(self.input_layernorm(x), mask=mask, cache=cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """``model(tokens [B, T], cache=None) -> logits [B, T, vocab]``."""

    def __init__(self, config: LlamaConfig, backend: str = "auto"):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = [DecoderBlock(config, backend) for _ in range(config.num_hidden_layers)]
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def backend(self) -> str:
        return self.layers[0].self_attn.backend

    def set_backend(self, backend: str) -> None:
        """Choose the attention path of every layer: auto, fused or reference."""
        if backend not in ("auto", "fused", "reference"):
            raise ValueError(f"backend must be 'auto', 'fused' or 'reference', got {backend!r}")
        for layer in self.layers:
            layer.self_attn.backend = backend

    def make_cache(self) -> list:
        return [KVCache() for _ in self.layers]

    def __call__(self, tokens: mx.array, cache: list | None = None) -> mx.array:
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [batch, length], got shape {tokens.shape}")
        if cache is not None and len(cache) != len(self.layers):
            raise ValueError(f"cache has {len(cache)} layers, the model {len(self.layers)}")
        x = self.embed_tokens(tokens)
        mask = "causal" if tokens.shape[1] > 1 else None
        for i, layer in enumerate(self.layers):
            x = layer(x, mask, cache[i] if cache is not None else None)
        x = self.norm(x)
        if self.config.tie_word_embeddings:
            return self.embed_tokens.as_linear(x)
        return self.lm_head(x)

    def attention_weights(self, tokens: mx.array, layer: int, mask="causal") -> mx.array:
        """Attention weights ``[B, heads, T, T]`` of one layer on a sequence
        (through the reference path), e.g. for visualisation."""
        if not 0 <= layer < len(self.layers):
            raise ValueError(f"layer must be in [0, {len(self.layers)}), got {layer}")
        x = self.embed_tokens(tokens)
        causal = "causal" if tokens.shape[1] > 1 else None
        for block in self.layers[:layer]:
            x = block(x, causal, None)
        block = self.layers[layer]
        _, weights = block.self_attn(block.input_layernorm(x), mask=mask, return_weights=True)
        return weights
