"""Gemma 3 (text): local sliding-window layers and every Nth a global one,
built on mlx_attn's attention hook (mlx_attn.lm.models.base.Decoder).

What the architecture defines (Hugging Face ``Gemma3TextConfig`` /
``modeling_gemma3``; mlx-lm's ``gemma3_text`` agrees) and this file follows:
- layer ``i`` is global when ``(i + 1) % sliding_window_pattern == 0`` (6 by
  default), local otherwise; a local layer attends to the ``sliding_window``
  most recent tokens (itself included) with RoPE base ``rope_local_base_freq``
  (10000), a global layer to every earlier token with RoPE base
  ``rope_theta`` (1e6); RoPE rotates the two halves of a head (not
  interleaved pairs), in GGUF files too (llama.cpp's NEOX layout);
- queries and keys are RMS-normalized per head before RoPE; the attention
  scale is ``query_pre_attn_scalar ** -0.5``;
- every RMSNorm multiplies by ``1 + weight`` (GGUF files store ``1 + weight``:
  llama.cpp adds the one when converting, so it is taken off here);
- token embeddings are multiplied by ``sqrt(hidden_size)``; the output
  projection is the embedding matrix (tied);
- the MLP is gated with GELU (tanh approximation);
- the attention and MLP outputs are RMS-normalized before their residual adds
  (four norms per layer).

Local layers keep a rotating KV cache of the window (never more is needed),
global layers a full cache (or, with ``max_kv_size``, a rotating one as Llama
does)."""

from __future__ import annotations

import dataclasses
import math

import mlx.core as mx
import mlx.nn as nn

from mlx_attn.lm.models.base import (AttentionHook, Decoder, LayerAttention, decoder_weight_shapes,
                                     projection_shapes, rename_weights)
from mlx_attn.lm.models.registry import Architecture, register
from mlx_attn.lm.validate import FieldError, require_bool, require_float, require_int
from mlx_attn.rope import RoPE

__all__ = ["Gemma3Config", "Gemma3", "config_from_gguf", "config_from_hf", "sanitize_gguf", "sanitize_hf",
           "weight_shapes", "hf_config", "ARCHITECTURE"]

MAX_DIM = 2**31 - 1  # MLX shapes are 32-bit


@dataclasses.dataclass
class Gemma3Config:
    """Validated on construction (types, ranges, heads % kv_heads)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0  # global layers
    rope_local_base_freq: float = 10_000.0  # local (sliding-window) layers
    query_pre_attn_scalar: float = 256.0
    sliding_window: int = 512
    sliding_window_pattern: int = 6
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = True

    def __post_init__(self):
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                      "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                      "sliding_window", "sliding_window_pattern"):
            setattr(self, field, require_int(field, getattr(self, field), 1, MAX_DIM))
        self.head_dim = require_int("head_dim", self.head_dim, 2, MAX_DIM)
        if self.head_dim % 2:
            raise FieldError("head_dim", f"must be even (RoPE rotates pairs), got {self.head_dim}")
        self.rms_norm_eps = require_float("rms_norm_eps", self.rms_norm_eps, 0.0, 1.0, min_inclusive=False)
        for field in ("rope_theta", "rope_local_base_freq", "query_pre_attn_scalar"):
            setattr(self, field, require_float(field, getattr(self, field), 0.0, min_inclusive=False))
        require_bool("tie_word_embeddings", self.tie_word_embeddings)
        if self.num_attention_heads % self.num_key_value_heads:
            raise FieldError("num_key_value_heads", f"({self.num_key_value_heads}) must divide "
                             f"num_attention_heads ({self.num_attention_heads})")

    def is_global(self, layer: int) -> bool:
        return (layer + 1) % self.sliding_window_pattern == 0


# Gemma3Config field -> GGUF metadata key (llama.cpp's names)
GGUF_CONFIG_KEYS = {
    "hidden_size": "gemma3.embedding_length",
    "intermediate_size": "gemma3.feed_forward_length",
    "num_hidden_layers": "gemma3.block_count",
    "num_attention_heads": "gemma3.attention.head_count",
    "num_key_value_heads": "gemma3.attention.head_count_kv",
    "head_dim": "gemma3.attention.key_length",
    "rms_norm_eps": "gemma3.attention.layer_norm_rms_epsilon",
    "rope_theta": "gemma3.rope.freq_base",
    "sliding_window": "gemma3.attention.sliding_window",
    "max_position_embeddings": "gemma3.context_length",
}
_GGUF_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def config_from_gguf(metadata: dict) -> Gemma3Config:
    """GGUF metadata (plain Python values) -> Gemma3Config; a FieldError
    names the GGUF key. GGUF files do not record the layer pattern, the local
    RoPE base nor ``query_pre_attn_scalar``: Gemma 3's values are used (the
    scalar is the head dimension in every published Gemma 3 text model)."""
    missing = [GGUF_CONFIG_KEYS[f] for f in _GGUF_REQUIRED if GGUF_CONFIG_KEYS[f] not in metadata]
    if missing:
        raise FieldError(missing[0], "is missing")
    values = {field: metadata[key] for field, key in GGUF_CONFIG_KEYS.items() if key in metadata}
    values["vocab_size"] = len(metadata.get("tokenizer.ggml.tokens") or [])
    if not values["vocab_size"]:
        raise FieldError("tokenizer.ggml.tokens", "is missing (the vocabulary sizes the embedding)")
    values.setdefault("num_key_value_heads", values["num_attention_heads"])
    if "head_dim" in values:
        values["query_pre_attn_scalar"] = values["head_dim"]
    scaling = metadata.get("gemma3.rope.scaling.type", "none")
    if scaling != "none":
        raise FieldError("gemma3.rope.scaling.type", f"{scaling!r} is not supported (only 'none')")
    try:
        config = Gemma3Config(**values)
    except FieldError as error:
        raise FieldError(GGUF_CONFIG_KEYS.get(error.field, error.field), error.problem) from None
    value_length = metadata.get("gemma3.attention.value_length", config.head_dim)
    if value_length != config.head_dim:
        raise FieldError("gemma3.attention.value_length", f"({value_length!r}) differs from the key length "
                         f"({config.head_dim}); unsupported")
    return config


HF_MODEL_TYPES = ("gemma3_text",)


def config_from_hf(config_json: dict) -> Gemma3Config:
    """A Hugging Face / mlx-lm ``config.json`` of a Gemma 3 text model."""
    model_type = config_json.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise FieldError("model_type", f"{model_type!r} is not a Gemma 3 text model ({', '.join(HF_MODEL_TYPES)})")
    for key in ("final_logit_softcapping", "attn_logit_softcapping", "rope_scaling"):
        if config_json.get(key) is not None:
            raise FieldError(key, "is not supported (it would be silently ignored)")
    if config_json.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise FieldError("hidden_activation", f"{config_json['hidden_activation']!r} is not supported")
    values = dict(config_json)
    rope = values.get("rope_parameters")  # transformers >= 5 spells the two bases per layer type
    if isinstance(rope, dict):
        for layer_type, field in (("full_attention", "rope_theta"), ("sliding_attention", "rope_local_base_freq")):
            if isinstance(rope.get(layer_type), dict) and "rope_theta" in rope[layer_type]:
                values.setdefault(field, rope[layer_type]["rope_theta"])
    layer_types = values.get("layer_types")
    fields = Gemma3Config.__dataclass_fields__
    values = {k: v for k, v in values.items() if k in fields}
    missing = [f for f, spec in fields.items() if spec.default is dataclasses.MISSING and f not in values]
    if missing:
        raise FieldError(missing[0], "is missing")
    config = Gemma3Config(**values)
    if layer_types is not None:
        expected = ["full_attention" if config.is_global(i) else "sliding_attention"
                    for i in range(config.num_hidden_layers)]
        if layer_types != expected:
            raise FieldError("layer_types", "must be every sliding_window_pattern-th layer global, as Gemma 3 is")
    return config


def hf_config(config: Gemma3Config) -> dict:
    """A ``config.json`` that mlx-lm's ``gemma3_text`` (and transformers) load."""
    values = dataclasses.asdict(config)
    scalar = values["query_pre_attn_scalar"]
    if scalar == int(scalar):  # transformers' config class insists on an int
        values["query_pre_attn_scalar"] = int(scalar)
    return {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
            "hidden_activation": "gelu_pytorch_tanh", **values}


# GGUF tensor names -> module paths (llama.cpp's names)
GGUF_NAMES = [
    (r"^token_embd\.", "embed_tokens."),
    (r"^output_norm\.", "norm."),
    (r"^blk\.(\d+)\.attn_q\.", r"layers.\1.self_attn.q_proj."),
    (r"^blk\.(\d+)\.attn_k\.", r"layers.\1.self_attn.k_proj."),
    (r"^blk\.(\d+)\.attn_v\.", r"layers.\1.self_attn.v_proj."),
    (r"^blk\.(\d+)\.attn_output\.", r"layers.\1.self_attn.o_proj."),
    (r"^blk\.(\d+)\.attn_q_norm\.", r"layers.\1.self_attn.q_norm."),
    (r"^blk\.(\d+)\.attn_k_norm\.", r"layers.\1.self_attn.k_norm."),
    (r"^blk\.(\d+)\.attn_norm\.", r"layers.\1.input_layernorm."),
    (r"^blk\.(\d+)\.post_attention_norm\.", r"layers.\1.post_attention_layernorm."),
    (r"^blk\.(\d+)\.ffn_norm\.", r"layers.\1.pre_feedforward_layernorm."),
    (r"^blk\.(\d+)\.post_ffw_norm\.", r"layers.\1.post_feedforward_layernorm."),
    (r"^blk\.(\d+)\.ffn_gate\.", r"layers.\1.mlp.gate_proj."),
    (r"^blk\.(\d+)\.ffn_up\.", r"layers.\1.mlp.up_proj."),
    (r"^blk\.(\d+)\.ffn_down\.", r"layers.\1.mlp.down_proj."),
]


def is_norm(path: str) -> bool:
    return path.endswith("norm.weight")


def sanitize_gguf(weights: dict, config: Gemma3Config) -> dict:
    """GGUF names -> module paths; norm weights from ``1 + w`` (as llama.cpp
    stores them) back to ``w``."""
    renamed = rename_weights(weights, GGUF_NAMES)
    return {name: (value - 1.0 if is_norm(name) else value) for name, value in renamed.items()}


def sanitize_hf(weights: dict, config: Gemma3Config) -> dict:
    """Hugging Face names (``model.layers.0...``; a multimodal checkpoint's
    ``language_model.model.``) -> module paths; a tied ``lm_head`` is dropped."""
    out = {}
    for name, value in weights.items():
        for prefix in ("language_model.model.", "model.language_model.", "model."):
            if name.startswith(prefix):
                name = name[len(prefix):]
                break
        out[name] = value
    if config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def weight_shapes(config: Gemma3Config) -> dict[str, tuple[int, ...]]:
    """Every parameter of ``Gemma3(config)`` with its (unquantized) shape."""
    layer = projection_shapes(config)
    head, hidden = (config.head_dim,), (config.hidden_size,)
    layer.update({"self_attn.q_norm.weight": head, "self_attn.k_norm.weight": head})
    layer.update({f"{norm}.weight": hidden for norm in ("input_layernorm", "post_attention_layernorm",
                                                        "pre_feedforward_layernorm", "post_feedforward_layernorm")})
    return decoder_weight_shapes(config, layer)


class RMSNorm(nn.Module):
    """Gemma's RMSNorm: ``x / rms(x) * (1 + weight)``, the weight starting at 0."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.zeros((dims,))
        self.eps = eps

    def __call__(self, x):
        return mx.fast.rms_norm(x, 1.0 + self.weight, self.eps)


class Attention(nn.Module):
    """Q/K/V projections (GQA), per-head q/k RMSNorm, RoPE of the layer's
    base, the hook's attention (the layer's scale and window), output."""

    def __init__(self, config: Gemma3Config, layer: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                        config.head_dim)
        q_width, kv_width = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_width, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, kv_width, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, kv_width, bias=False)
        self.o_proj = nn.Linear(q_width, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        base = config.rope_theta if config.is_global(layer) else config.rope_local_base_freq
        self.rope = RoPE(config.head_dim, base=base)  # rotate-half, in GGUF files too

    def __call__(self, x, positions, layer: LayerAttention, attention: AttentionHook):
        b, t, _ = x.shape
        heads = lambda a, n: a.reshape(b, t, n, self.head_dim).transpose(0, 2, 1, 3)
        q = self.rope(self.q_norm(heads(self.q_proj(x), self.n_heads)), offset=positions)
        k = self.rope(self.k_norm(heads(self.k_proj(x), self.n_kv_heads)), offset=positions)
        v = heads(self.v_proj(x), self.n_kv_heads)
        out = attention(layer, q, k, v)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, t, -1))


class GatedGELU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x):
        return self.down_proj(nn.gelu_approx(self.gate_proj(x)) * self.up_proj(x))


class DecoderBlock(nn.Module):
    def __init__(self, config: Gemma3Config, layer: int):
        super().__init__()
        self.self_attn = Attention(config, layer)
        self.mlp = GatedGELU(config.hidden_size, config.intermediate_size)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps)

    def __call__(self, x, positions, layer: LayerAttention, attention: AttentionHook):
        h = self.self_attn(self.input_layernorm(x), positions, layer, attention)
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3(Decoder):
    """``model(tokens [B, T], cache=None) -> logits [B, T, vocab]``; see
    :class:`mlx_attn.lm.models.base.Decoder` for the attention hook. Its
    ``make_cache`` gives local layers a rotating cache of the window and
    global layers a full one (with ``max_kv_size``: rotating, with sinks)."""

    def __init__(self, config: Gemma3Config, backend: str = "auto"):
        super().__init__(backend)
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = [DecoderBlock(config, i) for i in range(config.num_hidden_layers)]
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        scale = config.query_pre_attn_scalar**-0.5
        self._attention_layers = [
            LayerAttention(i, scale, window_size=None if config.is_global(i) else config.sliding_window,
                           head_dim=config.head_dim)
            for i in range(config.num_hidden_layers)
        ]

    def attention_layers(self) -> list[LayerAttention]:
        return list(self._attention_layers)

    def forward(self, tokens: mx.array, attention: AttentionHook) -> mx.array:
        positions = attention.positions(tokens.shape[1])
        x = self.embed_tokens(tokens)
        # sqrt(hidden) in the activations' dtype, as Hugging Face scales
        x = x * mx.array(math.sqrt(self.config.hidden_size), dtype=x.dtype)
        for layer, block in zip(self._attention_layers, self.layers):
            x = block(x, positions, layer, attention)
        return self.output_logits(self.norm(x))


ARCHITECTURE = register(Architecture(
    name="gemma3",
    gguf_architectures=("gemma3",),
    hf_model_types=HF_MODEL_TYPES,
    model_class=Gemma3,
    config_from_gguf=config_from_gguf,
    config_from_hf=config_from_hf,
    sanitize_gguf=sanitize_gguf,
    sanitize_hf=sanitize_hf,
    weight_shapes=weight_shapes,
    hf_config=hf_config,
))
