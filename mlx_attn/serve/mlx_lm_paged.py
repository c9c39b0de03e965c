"""mlx-lm's model classes on the engine's paged path, through the same two
seams as generation (:mod:`mlx_attn.lm.mlx_lm_models`): no model code is
copied.

A step's ragged batch (``T`` tokens of several requests, one position each)
goes through an mlx-lm model as ``T`` sequences of one token
(``inputs [T, 1]``): every matmul, norm and MLP is row-wise, so the rows do
not mix, and RoPE takes one offset per sequence, the token's position
(``cache.offset``, int32 ``[T]``). Each attention layer gets a
:class:`PagedLayerCache`: ``update_and_fetch`` writes the step's K/V rows
into that layer's pages (float or quantized) and returns them; the installed
attention, handed that cache, calls :meth:`PagedLayerCache.attend`, which is
:func:`mlx_attn.paged.paged_attention` over every request's block table
(``q_lens``/``kv_lens`` of the step, the layer's sliding window, the
model's sinks and softcap). Masks the model asks the cache for are ``None``:
the pages' rule is causal per request, within the layer's window.

Each layer's rule comes from mlx-lm's own cache structure
(``make_prompt_cache``): a ``KVCache`` is full attention, a
``RotatingKVCache`` without kept tokens a sliding window of its size. The
K/V shapes and dtype come from a one-token probe forward. Models with other
caches (hybrid models' recurrent state, ``ChunkedKVCache``, ``CacheList``)
are refused in this slice with a :class:`ValueError` saying so.
"""

from __future__ import annotations

import dataclasses
import types

import mlx.core as mx
import mlx.nn as nn

from mlx_attn.lm import mlx_lm_models
from mlx_attn.lm.models.base import AttentionHook, LayerAttention

__all__ = ["MlxLmPagedModel", "PagedLayerCache", "UnsupportedForServing", "check_servable_mlx_lm_model"]


class UnsupportedForServing(ValueError):
    """An mlx-lm model whose layers the engine cannot page (yet)."""


class PagedLayerCache(mlx_lm_models.SelfAttendingCache):
    """One attention layer's view of the engine's pages for one step.

    ``hook``: the engine's :class:`~mlx_attn.serve.engine.PagedAttention` of
    the step (its store and the step's arrays); ``layer``: the store's layer
    index; ``window``: the layer's sliding window (None: full attention)."""

    def __init__(self, hook, layer: int, window: int | None):
        self.hook, self.layer, self.window = hook, layer, window

    def __bool__(self) -> bool:  # mlx-lm tests `if cache and ...`
        return True

    @property
    def offset(self) -> mx.array:
        """Each one-token sequence's position (RoPE's per-sequence offset)."""
        return self.hook.arrays["positions"]

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        if N != 1:
            raise ValueError(f"the paged step runs one token per sequence, the model asked a mask for {N}")
        return None

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Store the step's rows (``[T, Hkv, 1, D]``) in their pages; returns
        them (the model never reads them: :meth:`attend` reads the pages)."""
        a = self.hook.arrays
        self.hook.store.write(self.layer, a["write_pages"], a["write_slots"], keys[:, :, 0], values[:, :, 0])
        return keys, values

    def attend(self, queries, keys, values, *, scale, sinks, softcap):
        a = self.hook.arrays
        out = self.hook.store.attend(self.layer, queries[:, :, 0], a["block_table"], a["kv_lens"], a["q_lens"],
                                     scale=scale, window_size=self.window, sinks=sinks, softcap=softcap,
                                     cascade=self.hook.cascade)
        return out[:, :, None]


@dataclasses.dataclass(frozen=True)
class _KVShape:
    kv_heads: int
    head_dim: int
    value_dim: int
    dtype: mx.Dtype


def _layer_windows(model: nn.Module) -> list[int | None]:
    """Each cache slot's rule from mlx-lm's cache structure: None (full
    attention) or the sliding window; :class:`UnsupportedForServing` for
    any other cache."""
    import mlx_lm.models.cache as mlx_lm_cache  # noqa: PLC0415 (optional dependency)

    windows = []
    for i, cache in enumerate(mlx_lm_cache.make_prompt_cache(model)):
        if type(cache) is mlx_lm_cache.KVCache:
            windows.append(None)
        elif type(cache) is mlx_lm_cache.RotatingKVCache and cache.keep == 0:
            windows.append(cache.max_size)
        else:
            raise UnsupportedForServing(
                f"layer cache {i} is mlx-lm's {type(cache).__name__}: the serving engine pages attention layers "
                "only (KVCache, sliding-window RotatingKVCache); hybrid models (recurrent or state-space "
                "layers) and chunked attention are not served yet, use `mlx-attn generate` for them")
    return windows


def check_servable_mlx_lm_model(wrapped: mlx_lm_models.MlxLmModel) -> None:
    """:class:`UnsupportedForServing` when the engine cannot page the
    model's layers (see :func:`_layer_windows`)."""
    _layer_windows(wrapped.model)


def _probe_kv_shapes(model: nn.Module) -> list[_KVShape]:
    """Run one token through the model with mlx_attn's dense caches and read
    each layer's K/V shape and dtype."""
    caches = mlx_lm_models.make_cache(model)
    mx.eval(model(mx.array([[0]]), cache=caches))
    shapes = []
    for cache in caches:
        keys, values = cache.keys, cache.values
        shapes.append(_KVShape(keys.shape[1], keys.shape[-1], values.shape[-1], keys.dtype))
    return shapes


class MlxLmPagedModel:
    """An mlx-lm model as the engine drives a :class:`Decoder`:
    ``attention_layers()``, ``config`` (``vocab_size``,
    ``max_position_embeddings``, ``num_key_value_heads``), ``value_dim``,
    ``kv_dtype``, ``weights`` (the ``nn.Module`` whose weights the engine
    prepares) and ``model(tokens [1, T], attention=hook)`` -> logits
    ``[1, R, vocab]`` of the hook's ``logit_rows`` (all ``T`` without)."""

    def __init__(self, wrapped: mlx_lm_models.MlxLmModel):
        self.model = wrapped.model
        self._windows = _layer_windows(self.model)
        self._source = wrapped.source
        self._config = wrapped.config
        self.refresh_kv_layout()

    def refresh_kv_layout(self) -> None:
        """Probe the K/V layout (again after the weights' dtype changed)."""
        mlx_lm_models.install_attention()
        shapes = _probe_kv_shapes(self.model)
        if len(shapes) != len(self._windows):
            raise UnsupportedForServing(f"{len(shapes)} probed caches, {len(self._windows)} in mlx-lm's structure")
        first = shapes[0]
        for i, shape in enumerate(shapes):
            if dataclasses.replace(shape, dtype=first.dtype) != dataclasses.replace(first, dtype=first.dtype):
                raise UnsupportedForServing(
                    f"layer {i} keeps K/V of {shape.kv_heads} heads x {shape.head_dim}/{shape.value_dim} features, "
                    f"layer 0 of {first.kv_heads} x {first.head_dim}/{first.value_dim}: the engine's pages have one "
                    "shape for every layer")
        self._layers = [LayerAttention(i, 1.0, window, first.head_dim) for i, window in enumerate(self._windows)]
        self.value_dim, self.kv_dtype = first.value_dim, first.dtype
        self._paged_config = types.SimpleNamespace(**vars(self._config), num_key_value_heads=first.kv_heads)

    @property
    def weights(self) -> nn.Module:
        return self.model

    @property
    def config(self):
        return self._paged_config

    def attention_layers(self) -> list[LayerAttention]:
        """Each layer's window and head width (the scale is the model's own:
        it passes it to the attention call)."""
        return list(self._layers)

    def __call__(self, tokens: mx.array, *, attention: AttentionHook) -> mx.array:
        if not mlx_lm_models.attention_installed():  # mlx-lm's own attention would ignore the pages
            mlx_lm_models.install_attention()
        caches = [PagedLayerCache(attention, layer.index, layer.window_size) for layer in self._layers]
        logits = self.model(tokens.reshape(-1, 1), cache=caches)[:, 0]
        if attention.logit_rows is not None:
            logits = logits[attention.logit_rows]
        return logits[None]
