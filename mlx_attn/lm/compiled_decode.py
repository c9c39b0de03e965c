"""A compiled decode step: one token's forward through a :class:`Decoder`,
traced once with ``mx.compile`` and replayed for every later token, so a
step no longer rebuilds ~20 small operations per layer in Python.

What makes the step compile-safe: the KV caches' preallocated buffers
(``KVCache`` grows in chunks of ``step`` tokens) and the token position are
inputs of the compiled function, as arrays, and the updated buffers are its
outputs. The new key/value is written with ``mx.slice_update`` at the
position array, and attention runs over the whole buffer with a mask that
hides the slots past the position, so every step of a buffer size has the
same shapes and replays the same trace (a new trace only when a buffer
grows, every ``step`` tokens). Sampling stays outside.

Only plain ``KVCache`` layers compile; quantized, rotating and concatenating
caches, models that are not this package's :class:`Decoder` (mlx-lm's) and
the distributed generator keep the eager step (:func:`compilable`)."""

from __future__ import annotations

import mlx.core as mx

from mlx_attn.cache import KVCache
from mlx_attn.lm.models.base import AttentionHook, Decoder
from mlx_attn.ops import scaled_dot_product_attention

__all__ = ["CompiledDecodeStep", "compilable"]


def compilable(model, cache: list) -> bool:
    """Whether :class:`CompiledDecodeStep` can run ``model``'s decode steps
    over ``cache``: one of this package's decoders, every layer a plain
    ``KVCache`` (its buffers are fixed-size between growths)."""
    return isinstance(model, Decoder) and bool(cache) and all(type(c) is KVCache for c in cache)


class _BufferAttention(AttentionHook):
    """Attention of one new token over whole cache buffers: the token's
    key/value written at ``position`` (an int32 scalar array), the slots after
    it masked out (and, for a windowed layer, those before its window)."""

    def __init__(self, keys: list, values: list, position: mx.array, backend: str):
        self.keys, self.values, self.position, self.backend = list(keys), list(values), position, backend
        self._positions = None
        self._masks = {}

    def positions(self, length: int) -> mx.array:
        # one position per token ([1]), the same array for every layer: RoPE
        # then computes the step's cos/sin once, not twice per layer
        if self._positions is None:
            self._positions = self.position.reshape(1)
        return self._positions

    def __call__(self, layer, queries, keys, values):
        i, start = layer.index, self.position.reshape(1)
        self.keys[i] = mx.slice_update(self.keys[i], keys, start, axes=(2,))
        self.values[i] = mx.slice_update(self.values[i], values, start, axes=(2,))
        return scaled_dot_product_attention(queries, self.keys[i], self.values[i], scale=layer.scale,
                                            mask=self._visible(self.keys[i].shape[2], layer.window_size),
                                            backend=self.backend)

    def _visible(self, slots: int, window_size: int | None) -> mx.array:
        """The slots a layer's query sees, [1, 1, 1, slots]: built once per
        buffer size and window for the whole step (two operations each, 30
        times per SmolLM2 step otherwise)."""
        key = (slots, window_size)
        if key not in self._masks:
            index = mx.arange(slots)
            visible = index <= self.position
            if window_size is not None:
                visible = visible & (index > self.position - window_size)
            self._masks[key] = visible.reshape(1, 1, 1, -1)
        return self._masks[key]


class CompiledDecodeStep:
    """``step(tokens [B, 1]) -> logits [B, vocab]`` of the next position,
    updating ``cache`` (plain ``KVCache`` layers, see :func:`compilable`) as
    ``model(tokens, cache=cache)[:, -1]`` does. The model's weights are
    captured by the trace: build a new step after changing them."""

    def __init__(self, model: Decoder, cache: list):
        if not compilable(model, cache):
            raise ValueError("the compiled decode step needs one of this package's decoders and a plain KVCache "
                             "per layer")
        self.model, self.cache = model, cache
        self._forward = mx.compile(self._traced_forward)

    def _traced_forward(self, tokens, position, keys, values):
        hook = _BufferAttention(keys, values, position, self.model.backend)
        logits = self.model(tokens, attention=hook)[:, -1]
        return logits, hook.keys, hook.values

    def __call__(self, tokens: mx.array) -> mx.array:
        cache = self.cache
        offset = cache[0].offset
        if tokens.shape[1] != 1 or any(c.keys is None or c.offset != offset or offset + 1 > c.keys.shape[2]
                                       for c in cache):
            # an empty or full buffer grows in the cache's own update; several
            # tokens at once are a prefill: both eager
            return self.model(tokens, cache=cache)[:, -1]
        logits, keys, values = self._forward(tokens, mx.array(offset, dtype=mx.int32),
                                             [c.keys for c in cache], [c.values for c in cache])
        for c, k, v in zip(cache, keys, values):
            c.keys, c.values, c.offset = k, v, offset + 1
        return logits
