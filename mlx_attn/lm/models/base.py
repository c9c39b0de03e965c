"""What every model shares: the decoder interface with its attention hook
(:class:`Decoder`, :class:`AttentionHook`, :class:`LayerAttention` and the
default hook :class:`CachedAttention`), renaming checkpoint tensors to module
paths, and checking a checkpoint against the shapes a config implies before
the model is built (so no untrusted number sizes an allocation)."""

from __future__ import annotations

import dataclasses
import re

import mlx.core as mx
import mlx.nn as nn

from mlx_attn.cache import KVCache, RotatingKVCache
from mlx_attn.lm.validate import FieldError, require_int
from mlx_attn.ops import scaled_dot_product_attention
from mlx_attn.quantized import quantized_scaled_dot_product_attention
from mlx_attn.reference import reference_attention

__all__ = ["Decoder", "AttentionHook", "LayerAttention", "CachedAttention", "AttentionWeights",
           "ROTATING_CACHE_KEEP", "check_cache_list", "check_max_kv_size", "rename_weights", "layer_indices",
           "check_layer_count", "check_weights"]

BACKENDS = ("auto", "fused", "reference")
# first tokens a rotating cache of a full-attention layer never drops (the
# attention sinks; mlx-lm keeps as many)
ROTATING_CACHE_KEEP = 4


# ---------------------------------------------------------------- the attention hook
@dataclasses.dataclass(frozen=True)
class LayerAttention:
    """The attention rule of one layer, as the model declares it (the hook
    applies it). ``index``: the layer's place, the key of its KV store;
    ``scale``: of the logits; ``window_size``: None for causal attention to
    every earlier token, else each query sees only the ``window_size`` most
    recent tokens (itself included)."""

    index: int
    scale: float
    window_size: int | None = None
    head_dim: int | None = None  # the query/key width (lets a caller check a KV quantization before running)


class AttentionHook:
    """How one forward pass of a :class:`Decoder` attends. Implementations:
    :class:`CachedAttention` (the default), the ring attention of
    ``mlx_attn.lm.distributed_generate``, :class:`AttentionWeights`.

    ``positions(length)``: the positions of the pass's ``length`` new tokens,
    used for RoPE: an int (the first position; the tokens are consecutive) or
    an int32 array ``[length]`` (one position per token, e.g. a packed batch of
    several sequences or a rank's shards of one).

    ``hook(layer, queries, keys, values)``: ``queries [B, Hq, T, D]``,
    ``keys``/``values [B, Hkv, T, D]`` of the new tokens (RoPE applied); the
    hook stores the keys and values in its KV store for ``layer.index``,
    attends each query to the keys it may see under ``layer``'s rule
    (causal, window) and returns ``[B, Hq, T, Dv]``."""

    #: None, or int32 ``[R]``: the forward returns the logits of these token
    #: rows only (``[B, R, vocab]``; a serving engine samples from a few rows
    #: of a long packed batch and skips the rest of the output projection)
    logit_rows = None

    def positions(self, length: int):
        raise NotImplementedError

    def __call__(self, layer: LayerAttention, queries: mx.array, keys: mx.array, values: mx.array) -> mx.array:
        raise NotImplementedError

    def attend_projected(self, layer: LayerAttention, rope, queries: mx.array, keys: mx.array,
                         values: mx.array) -> mx.array | None:
        """A whole attention block in one go, where the hook has one: the
        projections' rows ``queries [B, T, Hq * D]``, ``keys``/``values
        [B, T, Hkv * D]`` before RoPE, and the model's ``rope``; returns the
        attention output ``[B, T, Hq * Dv]`` (the output projection's input),
        with the keys and values stored as ``__call__`` would. None (the
        default): the model applies RoPE, splits the heads and calls the hook."""
        return None


def check_cache_list(cache, layers: int) -> list:
    """``cache`` as a list of one KV cache per layer; anything else is a
    ValueError naming ``cache``."""
    if not isinstance(cache, list):  # a list: generation may swap its caches for quantized ones in place
        raise ValueError(f"cache must be a list of {layers} per-layer KV caches (e.g. model.make_cache()), "
                         f"got {type(cache).__name__}")
    if len(cache) != layers:
        raise ValueError(f"cache has {len(cache)} layers, the model {layers}")
    for i, layer_cache in enumerate(cache):
        if not (hasattr(layer_cache, "update_and_fetch") and hasattr(layer_cache, "offset")):
            raise ValueError(f"cache[{i}] must be a KV cache (update_and_fetch, offset), "
                             f"got {type(layer_cache).__name__}")
    return cache


class CachedAttention(AttentionHook):
    """The default hook: dense attention of a batch of sequences that share
    their positions, through :func:`mlx_attn.scaled_dot_product_attention`
    (or its quantized form for a ``QuantizedKVCache``), with one
    ``mlx_attn.cache`` cache per layer, or, without ``cache``, among the
    pass's own tokens. A ``RotatingKVCache`` brings its own window (its band
    mask); on a windowed layer it may not keep more than the layer sees."""

    def __init__(self, cache: list | None, layers: int, backend: str = "auto"):
        self.cache = None if cache is None else check_cache_list(cache, layers)
        self.backend = backend

    def positions(self, length: int) -> int:
        return self.cache[0].offset if self.cache else 0

    def __call__(self, layer, queries, keys, values):
        cache = self.cache[layer.index] if self.cache is not None else None
        window = layer.window_size
        mask = "causal" if queries.shape[2] > 1 else None
        if cache is not None:
            if isinstance(cache, RotatingKVCache):
                if window is not None and (cache.keep or cache.max_size > window):
                    raise ValueError(f"layer {layer.index} sees a window of {window} tokens, its RotatingKVCache "
                                     f"keeps {cache.max_size} (keep={cache.keep}): it would see keys outside "
                                     "its window")
                window = None  # the cache's band mask is the window (its buffer is not in time order)
            keys, values = cache.update_and_fetch(keys, values)
            mask = cache.make_mask(queries.shape[2])
        if isinstance(keys, tuple):  # a QuantizedKVCache returns mx.quantize triples
            return quantized_scaled_dot_product_attention(
                queries, keys, values, scale=layer.scale, mask=mask, window_size=window,
                group_size=cache.group_size, bits=cache.bits, backend=self.backend)
        return scaled_dot_product_attention(queries, keys, values, scale=layer.scale, mask=mask,
                                            window_size=window, backend=self.backend)


class AttentionWeights(AttentionHook):
    """Records the attention weights ``[B, Hq, T, T]`` of one layer (through
    the reference path) over a pass without cache; ``mask`` applies at that
    layer (None: every token sees every other), causal elsewhere."""

    def __init__(self, layer: int, mask="causal"):
        self.layer, self.mask, self.weights = layer, mask, None

    def positions(self, length: int) -> int:
        return 0

    def __call__(self, layer, queries, keys, values):
        mask = self.mask if layer.index == self.layer else "causal"
        window = layer.window_size if isinstance(mask, str) else None
        out, weights = reference_attention(queries, keys, values, scale=layer.scale,
                                           mask=mask if queries.shape[2] > 1 else None, window_size=window,
                                           return_weights=True)
        if layer.index == self.layer:
            self.weights = weights
        return out


class Decoder(nn.Module):
    """A decoder-only language model: ``model(tokens [B, T], cache=None) ->
    logits [B, T, vocab]``.

    **The attention hook.** The model owns its weights, projections, norms,
    RoPE and the per-layer attention rule (:meth:`attention_layers`: scale
    and sliding window of each layer). How attention runs is the caller's:
    ``model(tokens, attention=hook)`` runs the model's own forward and, for
    each layer, RoPE at ``hook.positions(T)`` then ``hook(layer, q, k, v)``
    (see :class:`AttentionHook`). The hook owns the KV store per layer, the
    token positions, how the layer's causal/window rule becomes a mask over
    its keys, and the attention call itself. So one forward serves

    - cached generation: ``model(tokens, cache=cache)`` is
      ``model(tokens, attention=CachedAttention(cache, ...))``, with
      :meth:`make_cache` giving each layer the cache its rule needs;
    - distributed generation: a hook that runs ring attention over the
      ranks' shards of the prompt and merges partial decodes;
    - a serving engine: a hook holding paged KV blocks per sequence, fed a
      packed ragged batch (``B = 1``, several sequences' tokens one after
      the other, one position per token).

    A subclass implements ``__init__(config, backend="auto")`` (calling
    ``super().__init__(backend)``), :meth:`attention_layers` and
    :meth:`forward`; its ``config`` has ``vocab_size`` and, if the model
    has a context limit, ``max_position_embeddings``."""

    def __init__(self, backend: str = "auto"):
        super().__init__()
        self.set_backend(backend)

    @property
    def backend(self) -> str:
        """The attention path of the default hook: auto, fused or reference."""
        return self._backend

    def set_backend(self, backend: str) -> None:
        """Choose the attention path of the default hook: auto, fused or reference."""
        if backend not in BACKENDS:
            raise ValueError(f"backend must be 'auto', 'fused' or 'reference', got {backend!r}")
        self._backend = backend

    def attention_layers(self) -> list[LayerAttention]:
        """Each layer's attention rule, in order."""
        raise NotImplementedError

    def forward(self, tokens: mx.array, attention: AttentionHook) -> mx.array:
        """Logits ``[B, T, vocab]``; attention through ``attention``."""
        raise NotImplementedError

    def output_logits(self, hidden: mx.array, attention: AttentionHook) -> mx.array:
        """The vocabulary logits of the final (normalized) hidden states, of
        the hook's ``logit_rows`` only when it names some: through the
        embedding matrix (``embed_tokens``) when ``config.tie_word_embeddings``,
        through ``lm_head`` otherwise."""
        if attention.logit_rows is not None:
            hidden = hidden[:, attention.logit_rows]
        if self.config.tie_word_embeddings:
            return self.embed_tokens.as_linear(hidden)
        return self.lm_head(hidden)

    def __call__(self, tokens: mx.array, cache: list | None = None, *,
                 attention: AttentionHook | None = None) -> mx.array:
        if not isinstance(tokens, mx.array) or tokens.ndim != 2:
            raise ValueError(f"tokens must be an array [batch, length], got shape {getattr(tokens, 'shape', None)}")
        if attention is None:
            attention = CachedAttention(cache, len(self.attention_layers()), self.backend)
        elif cache is not None:
            raise ValueError("pass cache or attention, not both (the hook owns the KV store)")
        elif not isinstance(attention, AttentionHook):
            raise ValueError(f"attention must be an AttentionHook, got {type(attention).__name__}")
        return self.forward(tokens, attention)

    def make_cache(self, max_kv_size: int | None = None) -> list:
        """One cache per layer for the default hook: a ``KVCache`` for a
        full-attention layer, a ``RotatingKVCache`` of the window for a
        windowed one. With ``max_kv_size``, no layer keeps more than that
        many tokens: a full-attention layer keeps its first
        ``ROTATING_CACHE_KEEP`` tokens (attention sinks) and the most
        recent ones, so ``max_kv_size`` must exceed ``ROTATING_CACHE_KEEP``."""
        if max_kv_size is not None:
            max_kv_size = check_max_kv_size(max_kv_size)
        caches = []
        for layer in self.attention_layers():
            window = layer.window_size
            if window is not None:  # the window's tokens, no sinks (the layer never sees them)
                caches.append(RotatingKVCache(window if max_kv_size is None else min(window, max_kv_size), keep=0))
            elif max_kv_size is not None:
                caches.append(RotatingKVCache(max_kv_size, keep=ROTATING_CACHE_KEEP))
            else:
                caches.append(KVCache())
        return caches

    def attention_weights(self, tokens: mx.array, layer: int, mask="causal") -> mx.array:
        """Attention weights ``[B, heads, T, T]`` of one layer on a sequence
        (through the reference path), e.g. for visualisation; ``mask``
        applies at that layer."""
        layer = require_int("layer", layer, 0, len(self.attention_layers()) - 1)
        hook = AttentionWeights(layer, mask)
        self(tokens, attention=hook)
        return hook.weights


def decoder_weight_shapes(config, layer_weights: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Every parameter of a decoder with its (unquantized) shape: the
    embedding, the final norm, ``lm_head`` unless the embeddings are tied,
    and ``layer_weights`` (names relative to ``layers.{i}.``) in each layer."""
    hidden = config.hidden_size
    shapes = {"embed_tokens.weight": (config.vocab_size, hidden), "norm.weight": (hidden,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for i in range(config.num_hidden_layers):
        shapes.update({f"layers.{i}.{name}": shape for name, shape in layer_weights.items()})
    return shapes


def projection_shapes(config) -> dict[str, tuple[int, ...]]:
    """The weights of the attention projections and the gated MLP of one
    layer (names relative to the layer)."""
    hidden, head_dim, inner = config.hidden_size, config.head_dim, config.intermediate_size
    q_width, kv_width = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    return {"self_attn.q_proj.weight": (q_width, hidden), "self_attn.k_proj.weight": (kv_width, hidden),
            "self_attn.v_proj.weight": (kv_width, hidden), "self_attn.o_proj.weight": (hidden, q_width),
            "mlp.gate_proj.weight": (inner, hidden), "mlp.up_proj.weight": (inner, hidden),
            "mlp.down_proj.weight": (hidden, inner)}


def check_max_kv_size(max_kv_size, name: str = "max_kv_size") -> int:
    """A rotating cache's size: it keeps the first ``ROTATING_CACHE_KEEP``
    tokens (attention sinks), so it must hold at least one more."""
    value = require_int(name, max_kv_size)
    if value <= ROTATING_CACHE_KEEP:
        raise FieldError(name, f"must be at least {ROTATING_CACHE_KEEP + 1}, got {value}: the rotating KV cache "
                         f"always keeps the first {ROTATING_CACHE_KEEP} tokens (attention sinks) and needs room "
                         "for at least one recent token")
    return value

QUANTIZED_BITS = (2, 3, 4, 5, 6, 8)  # what MLX's quantized matmul supports


def rename_weights(weights: dict, patterns: list[tuple[str, str]], skip=lambda name: False, source: str = "") -> dict:
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
            raise ValueError(f"{source}: unexpected tensor {name!r}" if source else f"unexpected tensor {name!r}")
    return renamed


def layer_indices(weights: dict, prefix: str = "layers") -> set[int]:
    """Indices ``i`` of the ``{prefix}.i.*`` tensors present."""
    pattern = re.compile(rf"^{re.escape(prefix)}\.(\d+)\.")
    return {int(match.group(1)) for name in weights if (match := pattern.match(name))}


def check_layer_count(weights: dict, n_layers: int, field: str, source: str, prefix: str = "layers") -> None:
    """The config's layer count must be what the checkpoint holds (tensors
    ``{prefix}.i.*``): checked before anything is built per layer."""
    present = layer_indices(weights, prefix)
    # n distinct non-negative indices whose largest is n - 1 are exactly 0..n-1
    # (and nothing here is sized by the untrusted n_layers)
    if len(present) != n_layers or max(present, default=-1) != n_layers - 1:
        holds = f"tensors for {len(present)} layers" + (f" (highest index {max(present)})" if present else "")
        raise ValueError(f"{source}: weights do not fit: {field} says a {n_layers}-layer model, "
                         f"the checkpoint holds {holds}")


def _quantized_problem(name: str, weights: dict, shape: tuple[int, int], group_size: int) -> str | None:
    """Why a packed ``name.weight`` / ``.scales`` / ``.biases`` triple cannot be
    the quantized form of a float ``shape`` matrix, or None if it can."""
    out_features, in_features = shape
    if f"{name}.weight" not in weights:
        return f"{name}.scales without {name}.weight"
    weight, scales = weights[f"{name}.weight"], weights[f"{name}.scales"]
    biases = weights.get(f"{name}.biases")
    if in_features % group_size:
        return f"{in_features} input features are not a multiple of the group size {group_size}"
    groups = in_features // group_size
    if weight.dtype != mx.uint32 or weight.ndim != 2 or weight.shape[0] != out_features:
        return f"packed weight is {weight.dtype} {tuple(weight.shape)}, expected uint32 ({out_features}, ...)"
    bits, remainder = divmod(weight.shape[1] * 32, in_features)
    if remainder or bits not in QUANTIZED_BITS:
        return f"packed width {weight.shape[1]} gives no supported bit width for {in_features} features"
    for part, tensor in (("scales", scales), ("biases", biases)):
        if tensor is None:
            return f"{name}.{part} is missing"
        if tuple(tensor.shape) != (out_features, groups) or not mx.issubdtype(tensor.dtype, mx.floating):
            return f"{part} are {tensor.dtype} {tuple(tensor.shape)}, expected float ({out_features}, {groups})"
    return None


def check_weights(weights: dict, expected: dict[str, tuple[int, ...]], group_size: int | None, source: str) -> None:
    """Every expected tensor is present with its shape (or as a consistent
    quantized triple when ``group_size`` is given and ``.scales`` exist), and
    nothing else is."""
    quantized = {name.removesuffix(".scales") for name in weights if name.endswith(".scales")}
    if quantized and group_size is None:
        raise ValueError(f"{source}: quantized tensors (e.g. {min(quantized)}.scales) but no quantization settings")
    allowed = set(expected)
    for name, shape in expected.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module in quantized:
            allowed |= {f"{module}.scales", f"{module}.biases"}
            problem = ("only matrices can be quantized" if len(shape) != 2
                       else _quantized_problem(module, weights, shape, group_size))
            if problem:
                raise ValueError(f"{source}: tensor {name!r}: {problem}")
            continue
        if name not in weights:
            raise ValueError(f"{source}: tensor {name!r} {shape} is missing")
        tensor = weights[name]
        if tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, the config implies {shape}")
        if not mx.issubdtype(tensor.dtype, mx.floating):
            raise ValueError(f"{source}: tensor {name!r} is {tensor.dtype}, expected a floating-point type")
    unexpected = sorted(set(weights) - allowed)
    if unexpected:
        raise ValueError(f"{source}: unexpected tensor {unexpected[0]!r}" +
                         (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))
