"""A Llama-family decoder (Llama, Mistral, SmolLM2): GQA attention through
the attention hook of :class:`mlx_attn.lm.models.base.Decoder`, RoPE, RMSNorm,
a SwiGLU MLP, tied or untied embeddings, optionally quantized linear layers.
Registered as the ``llama`` architecture (GGUF ``llama``; HF ``llama``,
``mistral``)."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn

from mlx_attn.lm.models.base import (AttentionHook, Decoder, LayerAttention, decoder_weight_shapes,
                                     projection_shapes, rename_weights)
from mlx_attn.lm.models.registry import GGUF_TENSOR_NAMES, Architecture, register
from mlx_attn.lm.quantized_matmul import fused_matvecs, fused_product
from mlx_attn.lm.validate import FieldError, require_bool, require_float, require_int
from mlx_attn.rope import RoPE

__all__ = ["LlamaConfig", "Llama", "ARCHITECTURE", "config_from_gguf", "config_from_hf", "sanitize_gguf",
           "sanitize_hf", "weight_shapes", "hf_config"]

MAX_DIM = 2**31 - 1  # MLX shapes are 32-bit


@dataclasses.dataclass
class LlamaConfig:
    """Validated on construction: types, ranges and the divisibility the
    attention needs (hidden_size % heads without head_dim, heads % kv_heads)."""

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
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                      "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            setattr(self, field, require_int(field, getattr(self, field), 1, MAX_DIM))
        self.rms_norm_eps = require_float("rms_norm_eps", self.rms_norm_eps, 0.0, 1.0, min_inclusive=False)
        self.rope_theta = require_float("rope_theta", self.rope_theta, 0.0, min_inclusive=False)
        for field in ("rope_traditional", "tie_word_embeddings", "attention_bias"):
            require_bool(field, getattr(self, field))
        heads, kv_heads = self.num_attention_heads, self.num_key_value_heads
        if heads % kv_heads:
            raise FieldError("num_key_value_heads", f"({kv_heads}) must divide num_attention_heads ({heads})")
        if self.head_dim is None:
            if self.hidden_size % heads:
                raise FieldError("hidden_size", f"({self.hidden_size}) is not a multiple of "
                                 f"num_attention_heads ({heads}) and no head_dim is given")
            self.head_dim = self.hidden_size // heads
        self.head_dim = require_int("head_dim", self.head_dim, 2, MAX_DIM)
        if self.head_dim % 2:
            raise FieldError("head_dim", f"must be even (RoPE rotates pairs), got {self.head_dim}")


# LlamaConfig field -> GGUF metadata key (llama.cpp's names)
GGUF_CONFIG_KEYS = {
    "vocab_size": "llama.vocab_size",
    "hidden_size": "llama.embedding_length",
    "intermediate_size": "llama.feed_forward_length",
    "num_hidden_layers": "llama.block_count",
    "num_attention_heads": "llama.attention.head_count",
    "num_key_value_heads": "llama.attention.head_count_kv",
    "head_dim": "llama.attention.key_length",
    "rms_norm_eps": "llama.attention.layer_norm_rms_epsilon",
    "rope_theta": "llama.rope.freq_base",
    "max_position_embeddings": "llama.context_length",
}
_GGUF_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def config_from_gguf(metadata: dict) -> LlamaConfig:
    """GGUF metadata (plain Python values) -> LlamaConfig; a FieldError names
    the GGUF key. The embeddings are tied when the file has no
    ``output.weight`` (its tensor names: ``metadata[GGUF_TENSOR_NAMES]``)."""
    tie_word_embeddings = "output.weight" not in metadata.get(GGUF_TENSOR_NAMES, ())
    missing = [GGUF_CONFIG_KEYS[f] for f in _GGUF_REQUIRED if GGUF_CONFIG_KEYS[f] not in metadata]
    if missing:
        raise FieldError(missing[0], "is missing")
    values = {field: metadata[key] for field, key in GGUF_CONFIG_KEYS.items() if key in metadata}
    if "vocab_size" not in values:
        values["vocab_size"] = len(metadata.get("tokenizer.ggml.tokens") or [])
    values.setdefault("num_key_value_heads", values["num_attention_heads"])
    scaling = metadata.get("llama.rope.scaling.type", "none")
    if scaling != "none":
        raise FieldError("llama.rope.scaling.type", f"{scaling!r} is not supported (only 'none')")
    try:
        config = LlamaConfig(**values, rope_traditional=True, tie_word_embeddings=tie_word_embeddings)
    except FieldError as error:
        raise FieldError(GGUF_CONFIG_KEYS.get(error.field, error.field), error.problem) from None
    # one head size for K and V, RoPE over the whole head: all this model does
    for key in ("llama.attention.value_length", "llama.rope.dimension_count"):
        if key in metadata and metadata[key] != config.head_dim:
            raise FieldError(key, f"({metadata[key]!r}) differs from the head dimension ({config.head_dim}); "
                             "unsupported")
    return config


HF_MODEL_TYPES = ("llama", "mistral")


def config_from_hf(config_json: dict) -> LlamaConfig:
    """A Hugging Face ``config.json`` -> LlamaConfig; a FieldError names the key."""
    model_type = config_json.get("model_type", "llama")
    if model_type not in HF_MODEL_TYPES:
        raise FieldError("model_type", f"{model_type!r} is not a Llama-family decoder ({', '.join(HF_MODEL_TYPES)})")
    if config_json.get("rope_scaling") is not None:
        raise FieldError("rope_scaling", "is not supported (RoPE scaling would be silently ignored)")
    if config_json.get("hidden_act", "silu") != "silu":
        raise FieldError("hidden_act", f"{config_json['hidden_act']!r} is not supported (only 'silu')")
    fields = LlamaConfig.__dataclass_fields__
    values = {k: v for k, v in config_json.items() if k in fields}  # rope_traditional: as mlx-lm's llama
    if "num_attention_heads" in values:
        values.setdefault("num_key_value_heads", values["num_attention_heads"])  # plain multi-head attention
    missing = [f for f, spec in fields.items() if spec.default is dataclasses.MISSING and f not in values]
    if missing:
        raise FieldError(missing[0], "is missing")
    return LlamaConfig(**values)


# GGUF tensor names -> module paths
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


def sanitize_gguf(weights: dict, config: LlamaConfig) -> dict:
    """GGUF tensor names -> this model's module paths (llama.cpp's
    precomputed ``rope_freqs`` are dropped: RoPE computes its own)."""
    return rename_weights(weights, _GGUF_NAMES, skip=lambda n: n.startswith("rope_freqs"))


def sanitize_hf(weights: dict, config: LlamaConfig) -> dict:
    """Hugging Face names (``model.layers.0...``) -> module paths; the cached
    rotary frequencies and, with tied embeddings, ``lm_head`` are dropped."""
    weights = {name.removeprefix("model."): value for name, value in weights.items()}
    weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    return weights


def weight_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of ``Llama(config)`` with its (unquantized) shape;
    call only once the layer count is known to match the checkpoint."""
    layer = projection_shapes(config)
    if config.attention_bias:
        layer.update({name.replace(".weight", ".bias"): shape[:1] for name, shape in layer.items()
                      if name.split(".")[1] in ("q_proj", "k_proj", "v_proj")})
    hidden = (config.hidden_size,)
    layer.update({"input_layernorm.weight": hidden, "post_attention_layernorm.weight": hidden})
    return decoder_weight_shapes(config, layer)


def hf_config(config: LlamaConfig) -> dict:
    """The ``config.json`` mlx-lm's ``llama`` model loads (``rope_traditional``
    says in which pair order the Q/K rows are)."""
    return dict(dataclasses.asdict(config), model_type="llama", architectures=["LlamaForCausalLM"],
                hidden_act="silu")


def _projected(x, layer, gate=None, residual=None):
    """``residual + layer(silu(gate) * x)`` (each part where given): in one
    integer product where :func:`fused_product` applies, else MLX's ops."""
    out = fused_product(x, layer, gate=gate, residual=residual)
    if out is None:
        out = layer(x if gate is None else nn.silu(gate) * x)
        out = out if residual is None else residual + out
    return out


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x, norm=None, residual=None):
        """``norm``: an RMSNorm to apply to ``x`` first; ``residual``: added to
        the output (both inside the fused products where they can)."""
        gate_up = fused_matvecs(x, [self.gate_proj, self.up_proj], norm)
        if gate_up is None:
            x = x if norm is None else norm(x)
            gate_up = fused_matvecs(x, [self.gate_proj, self.up_proj]) or (self.gate_proj(x), self.up_proj(x))
        gate, up = gate_up
        return _projected(up, self.down_proj, gate=gate, residual=residual)


class Attention(nn.Module):
    """Q/K/V projections (GQA: K/V at ``num_key_value_heads``), RoPE, the
    hook's attention, the output projection."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                        config.head_dim)
        q_width, kv_width = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_width, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_width, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_width, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_width, config.hidden_size, bias=False)
        self.rope = RoPE(config.head_dim, base=config.rope_theta, traditional=config.rope_traditional)

    def __call__(self, x, positions, layer: LayerAttention, attention: AttentionHook, norm=None, residual=None):
        """``norm``: an RMSNorm to apply to ``x`` first; ``residual``: added to
        the output (both inside the fused products where they can)."""
        b, t, _ = x.shape
        heads = lambda a, n: a.reshape(b, t, n, self.head_dim).transpose(0, 2, 1, 3)
        projections = [self.q_proj, self.k_proj, self.v_proj]
        qkv = fused_matvecs(x, projections, norm)
        if qkv is None:
            x = x if norm is None else norm(x)
            qkv = fused_matvecs(x, projections) or [projection(x) for projection in projections]
        q, k, v = qkv
        out = attention.attend_projected(layer, self.rope, q, k, v)
        if out is None:
            q = self.rope(heads(q, self.n_heads), offset=positions)
            k = self.rope(heads(k, self.n_kv_heads), offset=positions)
            v = heads(v, self.n_kv_heads)
            out = attention(layer, q, k, v).transpose(0, 2, 1, 3).reshape(b, t, -1)
        return _projected(out, self.o_proj, residual=residual)


class DecoderBlock(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def __call__(self, x, positions, layer: LayerAttention, attention: AttentionHook):
        # the norms run inside the fused Q/K/V and gate/up products, the residual adds inside o_proj's and
        # down_proj's, where those apply
        x = self.self_attn(x, positions, layer, attention, norm=self.input_layernorm, residual=x)
        return self.mlp(x, norm=self.post_attention_layernorm, residual=x)


class Llama(Decoder):
    """``model(tokens [B, T], cache=None) -> logits [B, T, vocab]``; see
    :class:`mlx_attn.lm.models.base.Decoder` for the attention hook."""

    def __init__(self, config: LlamaConfig, backend: str = "auto"):
        super().__init__(backend)
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = [DecoderBlock(config) for _ in range(config.num_hidden_layers)]
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def attention_layers(self) -> list[LayerAttention]:
        scale = self.config.head_dim**-0.5
        return [LayerAttention(i, scale, head_dim=self.config.head_dim) for i in range(len(self.layers))]

    def forward(self, tokens: mx.array, attention: AttentionHook) -> mx.array:
        positions = attention.positions(tokens.shape[1])
        x = self.embed_tokens(tokens)
        for layer, block in zip(self.attention_layers(), self.layers):
            x = block(x, positions, layer, attention)
        return self.output_logits(self.norm(x), attention)


ARCHITECTURE = register(Architecture(
    name="llama",
    gguf_architectures=("llama",),
    hf_model_types=HF_MODEL_TYPES,
    model_class=Llama,
    config_from_gguf=config_from_gguf,
    config_from_hf=config_from_hf,
    sanitize_gguf=sanitize_gguf,
    sanitize_hf=sanitize_hf,
    weight_shapes=weight_shapes,
    hf_config=hf_config,
))
