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

On the CPU (with the extension built) a layer whose model hands its
projected rows to the hook (:meth:`AttentionHook.attend_projected`, the
Llama decoder) runs its attention block as three nodes of
``_ext.decode_attention``: the key (rotated) and value rows written into
the buffers, then RoPE of the query and attention over the filled slots
only (no mask, no reads past the position), the output in the output
projection's layout. That stands for ~20 graph operations per layer
(reshapes, transposes, RoPE's elementwise ops, two slice updates, the
attention call) and for reading the whole buffer. The buffers are donated: the cache holds
the step's new buffers before anything is evaluated, so the primitive
writes the new rows in place; a buffer still held elsewhere is copied, as
MLX's ``slice_update`` does. On a GPU, under ``backend="reference"`` and for
models that attend through ``hook(layer, q, k, v)``, the step is MLX's
operations as above.

Plain ``KVCache`` layers compile, and ``RotatingKVCache`` layers (windows,
``max_kv_size``) for one-token steps: the token goes to the ring's next slot
(a scalar input, as the position), and it sees every filled slot, which
the ring keeps within the window; steps that grow or reorder a ring run
eager. Quantized and concatenating caches, models that are not this
package's :class:`Decoder` (mlx-lm's) and the distributed generator keep
the eager step (:func:`compilable`)."""

from __future__ import annotations

import mlx.core as mx

from mlx_attn import _native
from mlx_attn.cache import KVCache, RotatingKVCache
from mlx_attn.lm.models.base import AttentionHook, Decoder
from mlx_attn.ops import scaled_dot_product_attention
from mlx_attn.rope import RoPE, rope_angles

__all__ = ["CompiledDecodeStep", "compilable"]


def compilable(model, cache: list) -> bool:
    """Whether :class:`CompiledDecodeStep` can run ``model``'s decode steps
    over ``cache``: one of this package's decoders, every layer a plain
    ``KVCache`` (its buffers are fixed-size between growths) or a
    ``RotatingKVCache`` in which a token sees every key the ring holds (no
    longer than a windowed layer's window, and keeping no sinks there), as
    ``make_cache`` gives windowed layers and ``max_kv_size``."""
    if not isinstance(model, Decoder) or not cache or len(cache) != len(model.attention_layers()):
        return False
    for c, layer in zip(cache, model.attention_layers()):
        # a windowed layer's ring sees no sinks (kept tokens fall out of the window) and no more than the window
        ring_fits = type(c) is RotatingKVCache and (
            layer.window_size is None or (c.keep == 0 and c.max_size <= layer.window_size))
        if type(c) is not KVCache and not ring_fits:
            return False
    return True


def fused_attention_block(backend: str) -> bool:
    """Whether the compiled step runs each layer's attention block through
    ``_ext.decode_attention``: on the CPU with the extension built,
    unless the model's backend asks for the reference path."""
    return backend != "reference" and _native.ext is not None and mx.default_device() == mx.cpu


class _BufferAttention(AttentionHook):
    """Attention of one new token over whole cache buffers: the token's
    key/value written at ``position`` (an int32 scalar array), the slots after
    it masked out (and, for a windowed layer, those before its window); with
    ``fused``, a whole attention block per layer (:meth:`attend_projected`)."""

    def __init__(self, keys: list, values: list, position: mx.array, backend: str, fused: bool = False,
                 rings: list | None = None):
        self.keys, self.values, self.position, self.backend = list(keys), list(values), position, backend
        self.fused = fused
        # per layer: None (a plain buffer, filled up to the position) or a rotating cache's (slot, filled)
        # int32 scalars: the new token goes to slot, and the first `filled` slots hold what the layer sees
        self.rings = rings or [None] * len(self.keys)
        self._positions = None
        self._masks = {}
        self._rotations = {}

    def attend_projected(self, layer, rope, queries, keys, values):
        if not self.fused or type(rope) is not RoPE or queries.shape[1] != 1 or self.rings[layer.index] is not None:
            return None
        i = layer.index
        cos, sin = self._rotation(rope)
        out, self.keys[i], self.values[i] = _native.ext.decode_attention(
            queries, keys, values, self.keys[i], self.values[i], self.position, cos, sin, scale=layer.scale,
            window_size=layer.window_size or 0, traditional=rope.traditional)
        return out

    def _rotation(self, rope: RoPE) -> tuple[mx.array, mx.array]:
        """The step's cos and sin ``[dims / 2]`` of ``rope``'s angles, once per
        step and parameter set (the same angles ``rope`` computes)."""
        key = (rope.dims, rope.base, rope.scale)
        if key not in self._rotations:
            angles = rope_angles(self.positions(1), rope.dims, rope.base, rope.scale).reshape(-1)
            self._rotations[key] = (mx.cos(angles), mx.sin(angles))
        return self._rotations[key]

    def positions(self, length: int) -> mx.array:
        # one position per token ([length]), the same array for every layer:
        # RoPE then computes the step's cos/sin once, not twice per layer
        if self._positions is None:
            self._positions = (self.position.reshape(1) if length == 1
                               else self.position + mx.arange(length, dtype=mx.int32))
        return self._positions

    def __call__(self, layer, queries, keys, values):
        i, start = layer.index, self.position.reshape(1)
        if self.rings[i] is not None:
            # a ring holds only keys the token sees (the cache keeps its window): the filled slots, any order
            slot, filled = self.rings[i]
            self.keys[i] = mx.slice_update(self.keys[i], keys, slot.reshape(1), axes=(2,))
            self.values[i] = mx.slice_update(self.values[i], values, slot.reshape(1), axes=(2,))
            visible = (mx.arange(self.keys[i].shape[2]) < filled).reshape(1, 1, 1, -1)
            return scaled_dot_product_attention(queries, self.keys[i], self.values[i], scale=layer.scale,
                                                mask=visible, backend=self.backend)
        self.keys[i] = mx.slice_update(self.keys[i], keys, start, axes=(2,))
        self.values[i] = mx.slice_update(self.values[i], values, start, axes=(2,))
        visible = self._visible(self.keys[i].shape[2], layer.window_size, queries.shape[2])
        return scaled_dot_product_attention(queries, self.keys[i], self.values[i], scale=layer.scale,
                                            mask=visible, backend=self.backend)

    def _visible(self, slots: int, window_size: int | None, length: int = 1) -> mx.array:
        """The slots each of the step's ``length`` queries sees, [1, 1,
        length, slots] (causal among the new tokens): built once per buffer
        size and window for the whole step (two operations each, 30 times per
        SmolLM2 step otherwise)."""
        key = (slots, window_size)
        if key not in self._masks:
            index = mx.arange(slots)
            last = self.positions(length).reshape(-1, 1)  # each query's own position
            visible = index <= last
            if window_size is not None:
                visible = visible & (index > last - window_size)
            self._masks[key] = visible.reshape(1, 1, length, -1)
        return self._masks[key]


class CompiledDecodeStep:
    """``step(tokens [B, 1]) -> logits [B, vocab]`` of the next position,
    updating ``cache`` (``KVCache`` and ``RotatingKVCache`` layers, see :func:`compilable`) as
    ``model(tokens, cache=cache)[:, -1]`` does. The model's weights are
    captured by the trace: build a new step after changing them."""

    def __init__(self, model: Decoder, cache: list):
        if not compilable(model, cache):
            raise ValueError("the compiled decode step needs one of this package's decoders and a plain KVCache "
                             "or RotatingKVCache per layer")
        self.model, self.cache = model, cache
        self.rings = [i for i, c in enumerate(cache) if type(c) is RotatingKVCache]  # layers with a ring buffer
        self.fused = fused_attention_block(model.backend)
        self._forward = mx.compile(self._traced_forward)

    def _traced_forward(self, tokens, position, keys, values, ring_scalars):
        # ring_scalars: (slot, filled) of each rotating layer in turn (self.rings: which layers)
        rings = [None] * len(keys)
        for n, i in enumerate(self.rings):
            rings[i] = (ring_scalars[2 * n], ring_scalars[2 * n + 1])
        hook = _BufferAttention(keys, values, position, self.model.backend, self.fused, rings)
        logits = self.model(tokens, attention=hook)
        return (logits[:, -1] if tokens.shape[1] == 1 else logits), hook.keys, hook.values

    def __call__(self, tokens: mx.array) -> mx.array:
        """``tokens [B, 1]`` -> the next position's logits ``[B, vocab]``
        (several tokens: a prefill, eager)."""
        if tokens.shape[1] != 1:
            return self.model(tokens, cache=self.cache)[:, -1]
        return self._step(tokens)

    def rows(self, tokens: mx.array) -> mx.array:
        """``tokens [B, T]`` (a few: a token and the drafts that follow it)
        -> the logits of every position ``[B, T, vocab]``, the cache
        advanced by ``T``: one trace per ``T`` and buffer size, as the
        one-token step."""
        if tokens.shape[1] == 1:
            return self._step(tokens)[:, None]
        return self._step(tokens)

    def _step(self, tokens: mx.array) -> mx.array:
        cache = self.cache
        offset, length = cache[0].offset, tokens.shape[1]
        slots = [c.in_place_slot() if type(c) is RotatingKVCache and length == 1 else None for c in cache]
        if any(c.keys is None or c.offset != offset or
               (offset + length > c.keys.shape[2] if type(c) is KVCache else slot is None)
               for c, slot in zip(cache, slots)):
            # an empty or full buffer grows (or a ring reorders) in the cache's own update; a rotating
            # cache takes several tokens there too: eager
            logits = self.model(tokens, cache=cache)
            return logits[:, -1] if length == 1 else logits
        ring_scalars = [mx.array(n, dtype=mx.int32) for i in self.rings
                        for n in (slots[i], min(offset + 1, cache[i].keys.shape[2]))]
        logits, keys, values = self._forward(tokens, mx.array(offset, dtype=mx.int32),
                                             [c.keys for c in cache], [c.values for c in cache], ring_scalars)
        # the new buffers replace the old ones before anything is evaluated: the old ones are then held by
        # the step's graph alone, so it updates them in place (donated)
        for c, k, v, slot in zip(cache, keys, values, slots):
            if slot is None:
                c.keys, c.values, c.offset = k, v, offset + length
            else:
                c.written_in_place(k, v, slot)
        return logits
