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
K/V shapes and dtype come from a one-token probe forward.

**Hybrid models** (layers that keep a recurrent state in mlx-lm's
``ArraysCache`` / ``MambaCache``: linear attention, short convolutions,
state-space blocks) cannot run as one-token sequences: a state runs through
a request's tokens in order. Each request keeps its own state (one list of
mlx-lm's caches per request, :class:`RecurrentStates`); the step's decode
rows run as one batch ``[R, 1]`` with their states merged (mlx-lm's
``merge``) and split again after, and each prefill chunk runs alone
``[1, L]`` from its request's state. The attention layers of these calls
still read and write the engine's pages. A state summarises every earlier
token, so pages found in the prefix cache cannot stand in for it: these
models are served without prefix reuse (:attr:`MlxLmPagedModel.prefix_reuse`).
Other caches (``ChunkedKVCache``, ``CacheList``, a ring with kept tokens)
are refused with a :class:`ValueError` naming the layer.
"""

from __future__ import annotations

import dataclasses
import types

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_attn.lm import mlx_lm_models
from mlx_attn.lm.models.base import AttentionHook, LayerAttention

__all__ = ["MlxLmPagedModel", "PagedLayerCache", "RecurrentStates", "UnsupportedForServing",
           "check_servable_mlx_lm_model"]


class UnsupportedForServing(ValueError):
    """An mlx-lm model whose layers the engine cannot page (yet)."""


class PagedLayerCache(mlx_lm_models.SelfAttendingCache):
    """One attention layer's view of the engine's pages for one model call.

    ``hook``: the step's store and arrays (the engine's
    :class:`~mlx_attn.serve.engine.PagedAttention`, or the part of it one
    call of a hybrid model runs); ``layer``: the store's layer index;
    ``window``: the layer's sliding window (None: full attention). The call's
    input is ``[B, L]``: ``B`` sequences of ``L`` tokens each, in the order
    of the hook's tokens (``[T, 1]`` for the flat step; ``[1, L]`` or
    ``[R, 1]`` for a hybrid model's calls); ``offset``: each sequence's first
    position (default: the hook's positions, one per one-token sequence)."""

    def __init__(self, hook, layer: int, window: int | None, queries_per_sequence: int = 1, offset=None):
        self.hook, self.layer, self.window = hook, layer, window
        self.queries_per_sequence = queries_per_sequence
        self._offset = offset

    def __bool__(self) -> bool:  # mlx-lm tests `if cache and ...`
        return True

    @property
    def offset(self):
        """Each sequence's first position (RoPE's per-sequence offset)."""
        return self.hook.arrays["positions"] if self._offset is None else self._offset

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        if N != self.queries_per_sequence:
            raise ValueError(f"the paged call runs {self.queries_per_sequence} tokens per sequence, "
                             f"the model asked a mask for {N}")
        return None  # the pages' rule: causal per request, within the layer's window

    @staticmethod
    def _rows(x: mx.array) -> mx.array:
        """``[B, H, L, D]`` -> ``[B * L, H, D]`` (token order)."""
        return x.swapaxes(1, 2).reshape(-1, x.shape[1], x.shape[3])

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Store the call's rows in their pages; returns them (the model
        never reads them: :meth:`attend` reads the pages)."""
        a = self.hook.arrays
        self.hook.store.write(self.layer, a["write_pages"], a["write_slots"], self._rows(keys), self._rows(values))
        return keys, values

    def attend(self, queries, keys, values, *, scale, sinks, softcap):
        a = self.hook.arrays
        batch, heads, length, _ = queries.shape
        out = self.hook.store.attend(self.layer, self._rows(queries), a["block_table"], a["kv_lens"], a["q_lens"],
                                     scale=scale, window_size=self.window, sinks=sinks, softcap=softcap)
        return out.reshape(batch, length, heads, out.shape[-1]).swapaxes(1, 2)


class RecurrentStates:
    """Each running request's recurrent state: the non-attention caches of
    mlx-lm's ``make_prompt_cache`` for the model (one list per request, in
    layer order). A request starting at position 0 starts from a fresh
    state (its first chunk, or again after a preemption)."""

    def __init__(self, model: nn.Module, slots: list[int]):
        self._model, self._slots = model, slots
        self._by_request: dict = {}

    def __len__(self) -> int:
        return len(self._by_request)

    def __contains__(self, request_id) -> bool:
        return request_id in self._by_request

    def get(self, request_id, start: int) -> list:
        if start == 0:
            import mlx_lm.models.cache as mlx_lm_cache  # noqa: PLC0415 (optional dependency)

            caches = mlx_lm_cache.make_prompt_cache(self._model)
            self._by_request[request_id] = [caches[i] for i in self._slots]
        elif request_id not in self._by_request:
            raise RuntimeError(f"request {request_id!r} continues at position {start} without its recurrent state")
        return self._by_request[request_id]

    def put(self, request_id, state: list) -> None:
        self._by_request[request_id] = state

    def forget(self, request_id) -> None:
        self._by_request.pop(request_id, None)

    def arrays(self) -> list[mx.array]:
        """Every state's arrays (to evaluate them with a step's outputs)."""
        return [a for state in self._by_request.values() for cache in state for a in cache.cache if a is not None]


@dataclasses.dataclass(frozen=True)
class _KVShape:
    kv_heads: int
    head_dim: int
    value_dim: int
    dtype: mx.Dtype


_RECURRENT = "recurrent"  # a layer rule: the layer keeps a recurrent state, not K/V


def _layer_rules(model: nn.Module) -> list:
    """Each cache slot's rule from mlx-lm's cache structure: None (full
    attention), the sliding window (an int), or ``"recurrent"`` (an
    ``ArraysCache``, ``MambaCache``...: a state per request);
    :class:`UnsupportedForServing` for any other cache."""
    import mlx_lm.models.cache as mlx_lm_cache  # noqa: PLC0415 (optional dependency)

    rules = []
    for i, cache in enumerate(mlx_lm_cache.make_prompt_cache(model)):
        if type(cache) is mlx_lm_cache.KVCache:
            rules.append(None)
        elif type(cache) is mlx_lm_cache.RotatingKVCache and cache.keep == 0:
            rules.append(cache.max_size)
        elif isinstance(cache, mlx_lm_cache.ArraysCache):
            rules.append(_RECURRENT)
        else:
            raise UnsupportedForServing(
                f"layer cache {i} is mlx-lm's {type(cache).__name__}: the serving engine pages attention layers "
                "(KVCache, sliding-window RotatingKVCache) and keeps recurrent states (ArraysCache, "
                "MambaCache); chunked attention and nested cache lists are not served yet, use "
                "`mlx-attn generate` for them")
    if all(rule == _RECURRENT for rule in rules):
        raise UnsupportedForServing("the model has no attention layer: the serving engine needs one to page")
    return rules


def check_servable_mlx_lm_model(wrapped: mlx_lm_models.MlxLmModel) -> None:
    """:class:`UnsupportedForServing` when the engine cannot page the
    model's layers (see :func:`_layer_rules`)."""
    _layer_rules(wrapped.model)


def _probe_kv_shapes(model: nn.Module) -> list[_KVShape | None]:
    """Run one token through the model with mlx_attn's dense caches and read
    each attention layer's K/V shape and dtype (None for a recurrent layer)."""
    caches = mlx_lm_models.make_cache(model)
    mx.eval(model(mx.array([[0]]), cache=caches))
    shapes = []
    for cache in caches:
        keys, values = getattr(cache, "keys", None), getattr(cache, "values", None)
        shapes.append(None if keys is None else _KVShape(keys.shape[1], keys.shape[-1], values.shape[-1], keys.dtype))
    return shapes


class MlxLmPagedModel:
    """An mlx-lm model as the engine drives a :class:`Decoder`:
    ``attention_layers()`` (the attention layers only: the store's layers),
    ``config`` (``vocab_size``, ``max_position_embeddings``,
    ``num_key_value_heads``), ``value_dim``, ``kv_dtype``, ``weights`` (the
    ``nn.Module`` whose weights the engine prepares), ``prefix_reuse``
    (False for hybrid models), ``forget_request(rid)`` (drop a finished,
    cancelled or preempted request's recurrent state) and
    ``model(tokens [1, T], attention=hook)`` -> logits ``[1, R, vocab]`` of
    the hook's ``logit_rows`` (all ``T`` without; a hybrid model's rows are
    each row's last token, and it needs the hook's ``request_ids``)."""

    def __init__(self, wrapped: mlx_lm_models.MlxLmModel):
        self.model = wrapped.model
        self._rules = _layer_rules(self.model)
        self._recurrent_slots = [i for i, rule in enumerate(self._rules) if rule == _RECURRENT]
        self.states = RecurrentStates(self.model, self._recurrent_slots) if self._recurrent_slots else None
        self._source = wrapped.source
        self._config = wrapped.config
        self.refresh_kv_layout()

    @property
    def prefix_reuse(self) -> bool:
        """Whether pages found in the prefix cache may stand in for computing
        a prompt's first tokens: not when a layer keeps a recurrent state."""
        return self.states is None

    @property
    def recurrent_layers(self) -> list[int]:
        """The layers (cache slots) that keep a recurrent state."""
        return list(self._recurrent_slots)

    def refresh_kv_layout(self) -> None:
        """Probe the K/V layout (again after the weights' dtype changed)."""
        mlx_lm_models.install_attention()
        shapes = _probe_kv_shapes(self.model)
        if len(shapes) != len(self._rules):
            raise UnsupportedForServing(f"{len(shapes)} probed caches, {len(self._rules)} in mlx-lm's structure")
        attention = [(slot, shape) for slot, shape in enumerate(shapes) if shape is not None]
        if [slot for slot, _ in attention] != [i for i, rule in enumerate(self._rules) if rule != _RECURRENT]:
            raise UnsupportedForServing("the probe's attention layers differ from mlx-lm's cache structure")
        first_slot, first = attention[0]
        for slot, shape in attention:
            if dataclasses.replace(shape, dtype=first.dtype) != first:
                raise UnsupportedForServing(
                    f"layer {slot} keeps K/V of {shape.kv_heads} heads x {shape.head_dim}/{shape.value_dim} "
                    f"features, layer {first_slot} of {first.kv_heads} x {first.head_dim}/{first.value_dim}: "
                    "the engine's pages have one shape for every layer")
        self._attention_slots = [slot for slot, _ in attention]  # store layer i is cache slot [i]
        self._layers = [LayerAttention(i, 1.0, self._rules[slot], first.head_dim)
                        for i, slot in enumerate(self._attention_slots)]
        self.value_dim, self.kv_dtype = first.value_dim, first.dtype
        self._paged_config = types.SimpleNamespace(**vars(self._config), num_key_value_heads=first.kv_heads)

    @property
    def weights(self) -> nn.Module:
        return self.model

    @property
    def config(self):
        return self._paged_config

    def attention_layers(self) -> list[LayerAttention]:
        """Each attention layer's window and head width (the scale is the
        model's own: it passes it to the attention call)."""
        return list(self._layers)

    def forget_request(self, request_id) -> None:
        if self.states is not None:
            self.states.forget(request_id)

    def state_arrays(self) -> list[mx.array]:
        """The recurrent states' arrays (none for attention-only models)."""
        return [] if self.states is None else self.states.arrays()

    def __call__(self, tokens: mx.array, *, attention: AttentionHook) -> mx.array:
        if not mlx_lm_models.attention_installed():  # mlx-lm's own attention would ignore the pages
            mlx_lm_models.install_attention()
        if self.states is not None:
            return self._hybrid_call(attention)
        caches = [PagedLayerCache(attention, layer.index, layer.window_size) for layer in self._layers]
        logits = self.model(tokens.reshape(-1, 1), cache=caches)[:, 0]
        if attention.logit_rows is not None:
            logits = logits[attention.logit_rows]
        return logits[None]

    # ------------------------------------------------------------ hybrid models
    def _hybrid_call(self, hook) -> mx.array:
        """The step's rows in calls that run each request's tokens in order
        through its recurrent state: the decode rows in one batched call,
        each other row alone. The logits of the last token of each row whose
        last token the hook's ``logit_rows`` name."""
        host = hook.host_arrays
        q_lens = host["q_lens"]
        ends = np.cumsum(q_lens)
        starts = ends - q_lens
        first_positions = host["positions"][starts]
        decode = [b for b in range(len(q_lens)) if q_lens[b] == 1 and first_positions[b] > 0]
        groups = ([decode] if decode else []) + [[b] for b in range(len(q_lens)) if b not in set(decode)]
        last_logits = {}
        for rows in groups:
            logits = self._run_rows(hook, rows, starts, ends, first_positions)
            for i, b in enumerate(rows):
                last_logits[b] = logits[i]
        row_of_end = {int(end) - 1: b for b, end in enumerate(ends)}
        wanted = (range(len(q_lens)) if hook.host_logit_rows is None
                  else [row_of_end[int(end)] for end in hook.host_logit_rows])
        if not wanted:
            return mx.zeros((1, 0, self.config.vocab_size))
        return mx.stack([last_logits[b] for b in wanted])[None]

    def _run_rows(self, hook, rows: list[int], starts, ends, first_positions) -> mx.array:
        """Run ``rows`` (several of one token each, or one row) as
        ``[len(rows), L]``; the logits of each row's last token."""
        host, ids = hook.host_arrays, hook.request_ids
        tokens = np.concatenate([np.arange(starts[b], ends[b]) for b in rows])
        sub = {name: mx.array(host[name][tokens]) for name in ("tokens", "positions", "write_pages", "write_slots")}
        sub.update(q_lens=mx.array(host["q_lens"][rows]), kv_lens=mx.array(host["kv_lens"][rows]),
                   block_table=mx.array(host["block_table"][rows]))
        view = types.SimpleNamespace(store=hook.store, arrays=sub)
        length = int(host["q_lens"][rows[0]])
        states = [self.states.get(ids[b], int(first_positions[b])) for b in rows]
        if len(rows) == 1:
            merged, offset = states[0], int(first_positions[rows[0]])
        else:  # one batch: mlx-lm's own merge of the rows' states
            merged = [type(column[0]).merge(list(column)) for column in zip(*states)]
            offset = sub["positions"]
        caches = [None] * len(self._rules)
        for layer, slot in zip(self._layers, self._attention_slots):
            caches[slot] = PagedLayerCache(view, layer.index, layer.window_size, length, offset)
        for slot, cache in zip(self._recurrent_slots, merged):
            caches[slot] = cache
        logits = self.model(sub["tokens"].reshape(len(rows), length), cache=caches)[:, -1]
        if len(rows) > 1:
            for i, b in enumerate(rows):
                self.states.put(ids[b], [cache.extract(i) for cache in merged])
        return logits
