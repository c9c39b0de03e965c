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
K/V shapes and dtype come from a one-token probe forward; layers of
different shapes (Gemma 4's wider full-attention layers) get pages of their
own shape (``kv_layer_shapes``). A KV-shared layer (Gemma 3n, Gemma 4: no
cache of its own, the keys and values an earlier layer's cache returned)
is attended by that cache, on its pages.

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
models are served without prefix reuse (:attr:`MlxLmPagedModel.prefix_reuse`),
unless the engine saves states at page boundaries (``state_snapshots``):
prefill chunks then run in pieces that end at page boundaries, the state at
each boundary is saved under that page's prefix-cache key, and a request
whose prompt begins with cached pages resumes from the last saved state
among them.
A layer's ``CacheList`` (Falcon-H1: attention and a state-space block side
by side) counts as its entries, each kept by its kind. Other caches (a ring
with kept tokens) are refused with a :class:`ValueError` naming the layer.

**Gathering.** A model whose attention layers do not attend through the
seam with their cache's own keys and values
(:func:`mlx_lm_models.seam_problems`: attention computed by the model
itself, multi-head latent attention), or that cannot run sequences at
different positions in one call (dynamic-NTK RoPE), or that has chunked
attention layers (``ChunkedKVCache``: Llama 4 makes their mask over the
keys itself), would be served wrong by the flat step. It runs each request of a step alone with a
:class:`GatheringPagedCache` per attention layer instead: the rows go into
the pages and the request's whole K/V comes back gathered from them, as a
dense cache would hand it over (:attr:`MlxLmPagedModel.gathering` says
why); a hybrid model's decode rows then run alone too.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import logging
import types

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_attn.lm import mlx_lm_models
from mlx_attn.lm.models.base import AttentionHook, LayerAttention

log = logging.getLogger(__name__)

__all__ = ["MlxLmPagedModel", "PagedLayerCache", "GatheringPagedCache", "RecurrentStates", "UnsupportedForServing",
           "check_servable_mlx_lm_model"]


class UnsupportedForServing(ValueError):
    """An mlx-lm model whose layers the engine cannot page (yet)."""


class PagedLayerCache(mlx_lm_models.SelfAttendingCache):
    """One attention layer's view of the engine's pages for one model call.

    ``hook``: the step's store and arrays (the engine's
    :class:`~mlx_attn.serve.paged_forward.PagedAttention`, or the part of it one
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
        self._handed = self.hand_out(keys, values)  # a KV-shared layer attending to them reaches these pages
        return self._handed

    def keys_and_values(self):
        """What the last update returned (mlx-lm's ``keys_and_values``, read
        by Gemma 3n's KV-shared layers: the seam then lets this cache attend
        for them too)."""
        return self._handed

    def attend(self, queries, keys, values, *, scale, sinks, softcap):
        a = self.hook.arrays
        batch, heads, length, _ = queries.shape
        out = self.hook.store.attend(self.layer, self._rows(queries), a["block_table"], a["kv_lens"], a["q_lens"],
                                     scale=scale, window_size=self.window, sinks=sinks, softcap=softcap,
                                     cascade=getattr(self.hook, "cascade", None))  # a hybrid call's sub-hook: none
        return out.reshape(batch, length, heads, out.shape[-1]).swapaxes(1, 2)


class GatheringPagedCache:
    """One attention layer's cache for one request's call of ``L`` tokens
    (``[1, L]``, first position ``offset``, an int) where the layer does not
    let the cache attend (it computes attention itself, as mlx-lm's gemma2,
    or from keys computed from the cache's, as multi-head latent attention):
    ``update_and_fetch`` writes the rows into the layer's pages and returns
    the request's every key and value gathered from its pages in time order
    (dequantized from quantized pages), ``make_mask`` the causal mask over
    them within the layer's window, as a dense cache would. The pages keep
    what prefix sharing needs; the call costs a gather per layer."""

    start_position = 0  # ChunkedKVCache's: the first key returned (every key is)

    def __init__(self, store, layer: int, window: int | None, writes: tuple, block_row: np.ndarray, offset: int):
        self.store, self.layer, self.window = store, layer, window
        self.write_pages, self.write_slots = writes
        self.block_row, self.offset = block_row, offset
        self._fetched = None

    def __bool__(self) -> bool:
        return True

    def maybe_trim_front(self) -> None:
        """ChunkedKVCache's: keys before the chunk stay (the model's chunk mask hides them)."""

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        return mlx_lm_models.contiguous_mask(N, self.offset + N, window_size or self.window, return_array)

    def _gathered(self, stored, pages: mx.array, n_keys: int, dtype) -> mx.array:
        if isinstance(stored, tuple):
            rows = mx.dequantize(*(part[pages] for part in stored), group_size=self.store.group_size,
                                 bits=self.store.bits)
        else:
            rows = stored[pages]
        count, heads, size, dim = rows.shape
        return rows.swapaxes(0, 1).reshape(heads, count * size, dim)[None, :, :n_keys].astype(dtype)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.store.write(self.layer, self.write_pages, self.write_slots, PagedLayerCache._rows(keys),
                         PagedLayerCache._rows(values))
        n_keys = self.offset + keys.shape[2]
        pages = mx.array(self.block_row[: -(-n_keys // self.store.page_size)])
        self._fetched = (self._gathered(self.store.keys[self.layer], pages, n_keys, keys.dtype),
                         self._gathered(self.store.values[self.layer], pages, n_keys, values.dtype))
        return self._fetched

    def keys_and_values(self):
        return self._fetched


class RecurrentStates:
    """Each running request's recurrent state: the non-attention caches of
    mlx-lm's ``make_prompt_cache`` for the model (one list per request, in
    layer order). A request starting at position 0 starts from a fresh
    state (its first chunk, or again after a preemption).

    With ``max_snapshots`` > 0, states are also kept at page boundaries
    (:meth:`record` during a step, :meth:`save` under the page's prefix-cache
    key after it, at most ``max_snapshots``, least recently used dropped
    first): a request whose prompt begins with cached pages resumes from the
    state saved at the last of them (:meth:`restore`). A state depends only
    on the tokens before it, as the pages do, so a key names one state."""

    def __init__(self, model: nn.Module, slots: list[int], max_snapshots: int = 0):
        self._model, self._slots = model, slots
        self._by_request: dict = {}
        self.max_snapshots = max_snapshots
        self._snapshots: collections.OrderedDict[bytes, list] = collections.OrderedDict()
        self._recorded: list[tuple] = []

    def __len__(self) -> int:
        return len(self._by_request)

    def __contains__(self, request_id) -> bool:
        return request_id in self._by_request

    def get(self, request_id, start: int) -> list:
        if start == 0:
            caches = _flat_prompt_cache(self._model)
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
        states = list(self._by_request.values()) + [state for _, _, state in self._recorded]
        return [a for state in states for cache in state for a in cache.cache if a is not None]

    # ------------------------------------------------------------ snapshots
    @staticmethod
    def _copy(state: list) -> list:
        """Caches of their own holding the same (immutable) arrays: updates
        rebind a cache's entries, never change an array."""
        copies = []
        for cache in state:
            duplicate = copy.copy(cache)
            duplicate.cache = list(cache.cache)
            copies.append(duplicate)
        return copies

    @property
    def snapshots(self) -> int:
        return len(self._snapshots)

    def record(self, request_id, position: int) -> None:
        """Remember the request's state as it is now, after ``position`` tokens
        (a page boundary); :meth:`take_recorded` hands it to the engine."""
        if self.max_snapshots > 0:
            self._recorded.append((request_id, position, self._copy(self._by_request[request_id])))

    def take_recorded(self) -> list[tuple]:
        """``(request_id, position, state)`` recorded since the last call."""
        recorded, self._recorded = self._recorded, []
        return recorded

    def save(self, key: bytes, state: list) -> None:
        self._snapshots[key] = state
        self._snapshots.move_to_end(key)
        while len(self._snapshots) > self.max_snapshots:
            self._snapshots.popitem(last=False)

    def reusable_pages(self, keys: list[bytes]) -> int:
        """How many leading pages of a found prefix (their keys) a request may
        resume after: up to the last one with a saved state."""
        return next((i + 1 for i in range(len(keys) - 1, -1, -1) if keys[i] in self._snapshots), 0)

    def restore(self, request_id, key: bytes) -> None:
        """Give a request the state saved under ``key`` (a copy)."""
        self._snapshots.move_to_end(key)
        self._by_request[request_id] = self._copy(self._snapshots[key])

    def prune(self, is_indexed) -> None:
        """Drop the states of pages no longer in the prefix cache."""
        for key in [key for key in self._snapshots if not is_indexed(key)]:
            del self._snapshots[key]


@dataclasses.dataclass(frozen=True)
class _KVShape:
    kv_heads: int
    head_dim: int
    value_dim: int
    dtype: mx.Dtype


_RECURRENT = "recurrent"  # a layer rule: the layer keeps a recurrent state, not K/V
_CHUNKED = "chunked"  # a layer rule: chunked attention (the model makes its mask over every key)


def _flatten(caches: list) -> list:
    """mlx-lm's caches with every ``CacheList`` replaced by its entries, in
    order (a layer with attention and a state-space block beside it, as
    Falcon-H1's, keeps both in one ``CacheList``): the cache slots."""
    import mlx_lm.models.cache as mlx_lm_cache  # noqa: PLC0415 (optional dependency)

    flat = []
    for cache in caches:
        flat += _flatten(cache.caches) if isinstance(cache, mlx_lm_cache.CacheList) else [cache]
    return flat


def _flat_prompt_cache(model: nn.Module) -> list:
    import mlx_lm.models.cache as mlx_lm_cache  # noqa: PLC0415 (optional dependency)

    return _flatten(mlx_lm_cache.make_prompt_cache(model))


def _cache_nesting(model: nn.Module) -> list:
    """mlx-lm's cache structure for ``model`` with each cache slot's number
    in place of the cache (a tuple for a ``CacheList``)."""
    import mlx_lm.models.cache as mlx_lm_cache  # noqa: PLC0415 (optional dependency)

    numbers = iter(range(1 << 30))

    def number(cache):
        if isinstance(cache, mlx_lm_cache.CacheList):
            return tuple(number(inner) for inner in cache.caches)
        return next(numbers)

    return [number(cache) for cache in mlx_lm_cache.make_prompt_cache(model)]


def _nested(nesting: list, flat: list) -> list:
    """The caches of the cache slots ``flat`` in ``nesting`` (each
    ``CacheList`` rebuilt around its slots), as the model indexes them."""
    import mlx_lm.models.cache as mlx_lm_cache  # noqa: PLC0415 (optional dependency)

    def build(entry):
        return mlx_lm_cache.CacheList(*(build(e) for e in entry)) if isinstance(entry, tuple) else flat[entry]

    return [build(entry) for entry in nesting]


def _layer_rules(model: nn.Module) -> list:
    """Each cache slot's rule from mlx-lm's cache structure (nested cache
    lists flattened): None (full attention), the sliding window (an int),
    ``"chunked"`` (a ``ChunkedKVCache``: Llama 4's chunked attention) or
    ``"recurrent"`` (an ``ArraysCache``, ``MambaCache``...: a state per
    request); :class:`UnsupportedForServing` for any other cache."""
    import mlx_lm.models.cache as mlx_lm_cache  # noqa: PLC0415 (optional dependency)

    rules = []
    for i, cache in enumerate(_flat_prompt_cache(model)):
        if type(cache) is mlx_lm_cache.KVCache:
            rules.append(None)
        elif type(cache) is mlx_lm_cache.RotatingKVCache and cache.keep == 0:
            rules.append(cache.max_size)
        elif type(cache) is mlx_lm_cache.ChunkedKVCache:
            rules.append(_CHUNKED)
        elif isinstance(cache, mlx_lm_cache.ArraysCache):
            rules.append(_RECURRENT)
        else:
            raise UnsupportedForServing(
                f"layer cache {i} is mlx-lm's {type(cache).__name__}: the serving engine pages attention layers "
                "(KVCache, sliding-window RotatingKVCache, ChunkedKVCache) and keeps recurrent states "
                "(ArraysCache, MambaCache); use `mlx-attn generate` for it")
    if all(rule == _RECURRENT for rule in rules):
        raise UnsupportedForServing("the model has no attention layer: the serving engine needs one to page; "
                                    "`mlx-attn generate` runs it")
    return rules


def _seam_problem(model: nn.Module) -> tuple[str | None, bool]:
    """``(what keeps paged caches from attending for the model's layers, or
    None; whether a gathering cache can serve it instead)``, from
    :func:`mlx_lm_models.seam_problems`: a layer that computes attention
    itself, or from keys computed from the cache's, reads what a cache
    returns, which a :class:`GatheringPagedCache` gives it; a layer that
    attends without a cache to keys no cache returned cannot be served."""
    problems = mlx_lm_models.seam_problems(model)
    if not problems:
        return None, True
    slots_by_reason = collections.defaultdict(list)
    for slot, why in problems.items():
        slots_by_reason[why].append(slot)
    named = "; ".join(why if None in slots else
                      f"layer cache{'s' if len(slots) > 1 else ''} {', '.join(map(str, sorted(slots)))}: {why}"
                      for why, slots in slots_by_reason.items())
    return named, None not in problems


def _fast_path_problem(model: nn.Module, model_type, rules: list) -> str | None:
    """Why the engine's flat paged step cannot run the model (None: it can):
    then it is served with :class:`GatheringPagedCache` (one request a call),
    or refused (:class:`UnsupportedForServing`) where that cannot serve it
    either (a layer attending to keys no cache returned).
    ``rules``: :func:`_layer_rules`'s."""
    chunked = [slot for slot, rule in enumerate(rules) if rule == _CHUNKED]
    why, gatherable = (f"layer cache{'s' if len(chunked) > 1 else ''} {', '.join(map(str, chunked))}: chunked "
                       "attention (mlx-lm's ChunkedKVCache; the model makes its mask over the keys)", True
                       ) if chunked else _seam_problem(model)
    if why is None:
        why = _positions_problem(model)
    if why is not None and not gatherable:
        raise UnsupportedForServing(
            f"mlx-lm's {model_type or 'model'} cannot be served on pages: {why}. The engine's pages need every "
            "attention layer to attend through mlx-lm's scaled_dot_product_attention with its cache's own keys "
            "and values, or to read them from its cache; `mlx-attn generate` runs this model")
    return why


class _PositionsProbeCache(mlx_lm_models.SelfAttendingCache):
    """An attention layer's cache for :func:`_check_positions_per_sequence`:
    two one-token sequences at different positions (``offset`` an array, as
    the engine's steps give), attention answered with zeros."""

    def __init__(self, offset: mx.array):
        self.offset = offset

    def __bool__(self) -> bool:
        return True

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        return None

    def update_and_fetch(self, keys, values):
        self._handed = self.hand_out(keys, values)
        return self._handed

    def keys_and_values(self):
        return self._handed

    def attend(self, queries, keys, values, *, scale, sinks, softcap):
        return mx.zeros((*queries.shape[:-1], values.shape[-1]), queries.dtype)


def _positions_problem(model: nn.Module) -> str | None:
    """Why the model cannot run sequences at different positions in one
    call (RoPE given one offset per sequence, an array), as the engine's
    flat steps do (None: it can). mlx-lm's dynamic-NTK RoPE, say, needs one
    integer position."""
    flat = []
    for rule, state in zip(_layer_rules(model), _flat_prompt_cache(model)):
        if rule == _RECURRENT:  # two fresh states side by side, as the engine's decode rows run
            flat.append(type(state).merge([state, copy.deepcopy(state)]))
        else:
            flat.append(_PositionsProbeCache(mx.array([0, 3], mx.int32)))
    try:
        mx.eval(model(mx.zeros((2, 1), mx.int32), cache=_nested(_cache_nesting(model), flat)))
    except Exception as error:  # noqa: BLE001 (whatever the model's code raises, the flat step cannot run it)
        return (f"it cannot run sequences at different positions in one call (one position per sequence, an "
                f"array, and no mask array): {type(error).__name__}: {' '.join(str(error).split())}")
    return None


def check_servable_mlx_lm_model(wrapped: mlx_lm_models.MlxLmModel) -> None:
    """:class:`UnsupportedForServing` when the engine cannot page the
    model's layers (see :func:`_layer_rules` and :func:`_fast_path_problem`)."""
    _fast_path_problem(wrapped.model, wrapped.config.model_type, _layer_rules(wrapped.model))


def _probe_kv_shapes(model: nn.Module) -> list[_KVShape | None]:
    """Run one token through the model with mlx_attn's dense caches and read
    each attention layer's K/V shape and dtype (None for a recurrent layer)."""
    caches = mlx_lm_models.make_cache(model)
    mx.eval(model(mx.array([[0]]), cache=caches))
    shapes = []
    for cache in _flatten(caches):
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
        self._nesting = _cache_nesting(self.model)
        # why each request runs alone over K/V gathered from its pages (None: the flat paged step)
        self.gathering = _fast_path_problem(self.model, wrapped.config.model_type, self._rules)
        if self.gathering:
            log.warning("each request runs alone in a step, over K/V gathered from its pages (slower than the "
                        "batched paged step, which cannot run mlx-lm's %s: %s)", wrapped.config.model_type,
                        self.gathering)
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
        first = attention[0][1]
        self._attention_slots = [slot for slot, _ in attention]  # store layer i is cache slot [i]
        windows = [rule if isinstance(rule, int) else None for rule in self._rules]  # chunked: every key gathered
        self._layers = [LayerAttention(i, 1.0, windows[slot], shape.head_dim)
                        for i, (slot, shape) in enumerate(attention)]
        layer_shapes = [(shape.kv_heads, shape.head_dim, shape.value_dim) for _, shape in attention]
        # pages of each layer's own shape where the layers differ (Gemma 4's full-attention layers are wider)
        self.kv_layer_shapes = layer_shapes if len(set(layer_shapes)) > 1 else None
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

    def __call__(self, tokens: mx.array, *, attention: AttentionHook) -> mx.array:
        if not mlx_lm_models.attention_installed():  # mlx-lm's own attention would ignore the pages
            mlx_lm_models.install_attention()
        if self.states is not None:
            return self._hybrid_call(attention)
        if self.gathering:
            return self._gathering_call(attention)
        caches = _nested(self._nesting, [PagedLayerCache(attention, layer.index, layer.window_size)
                                         for layer in self._layers])
        logits = self.model(tokens.reshape(-1, 1), cache=caches)[:, 0]
        if attention.logit_rows is not None:
            logits = logits[attention.logit_rows]
        return logits[None]

    def _gathering_call(self, hook) -> mx.array:
        """Each row of the step alone (``[1, L]``, its first position an
        int) with :class:`GatheringPagedCache` for its attention layers; the
        logits of the hook's ``logit_rows`` (every token without)."""
        host = hook.host_arrays
        ends = np.cumsum(host["q_lens"])
        by_token = {}
        for b, (lo, hi) in enumerate(zip(ends - host["q_lens"], ends)):
            tokens = np.arange(lo, hi)
            writes = (mx.array(host["write_pages"][tokens]), mx.array(host["write_slots"][tokens]))
            first = int(host["positions"][lo])
            caches = [GatheringPagedCache(hook.store, layer.index, layer.window_size, writes, host["block_table"][b],
                                          first) for layer in self._layers]
            logits = self.model(mx.array(host["tokens"][tokens])[None], cache=_nested(self._nesting, caches))[0]
            by_token.update(zip(tokens.tolist(), logits))
        wanted = range(len(host["tokens"])) if hook.host_logit_rows is None else hook.host_logit_rows.tolist()
        if not wanted:
            return mx.zeros((1, 0, self.config.vocab_size))
        return mx.stack([by_token[t] for t in wanted])[None]

    # ------------------------------------------------------------ hybrid models
    def enable_state_snapshots(self, max_snapshots: int) -> None:
        """Keep recurrent states at page boundaries for prefix reuse (at most
        ``max_snapshots``; see :class:`RecurrentStates`). Prefill chunks then
        run in pieces that end at page boundaries."""
        if self.states is None:
            raise ValueError("state snapshots are for models with recurrent layers; this one has none")
        self.states.max_snapshots = max_snapshots

    def _hybrid_call(self, hook) -> mx.array:
        """The step's rows in calls that run each request's tokens in order
        through its recurrent state: the decode rows in one batched call,
        each other row alone (in pieces ending at page boundaries when states
        are saved there). The logits of the last token of each row whose last
        token the hook's ``logit_rows`` name."""
        host = hook.host_arrays
        q_lens, positions = host["q_lens"], host["positions"]
        ends = np.cumsum(q_lens)
        starts = ends - q_lens
        size = hook.store.page_size
        snapshots = self.states.max_snapshots > 0
        decode = [b for b in range(len(q_lens)) if q_lens[b] == 1 and positions[starts[b]] > 0
                  and not self.gathering]  # gathering: each row alone
        calls = [[(b, starts[b], ends[b]) for b in decode]] if decode else []
        for b in range(len(q_lens)):
            if b in set(decode):
                continue
            cuts = [int(starts[b])]
            if snapshots:  # token indices where a page boundary falls inside the row
                first = int(positions[starts[b]])
                cuts += [int(starts[b]) + p - first for p in range((first // size + 1) * size,
                                                                   first + int(q_lens[b]), size)]
            cuts.append(int(ends[b]))
            calls += [[(b, lo, hi)] for lo, hi in zip(cuts, cuts[1:])]
        last_logits = {}
        for pieces in calls:
            logits = self._run_pieces(hook, pieces)
            for i, (b, _, hi) in enumerate(pieces):
                last_logits[b] = logits[i]
                end_position = int(positions[hi - 1]) + 1
                if snapshots and end_position % size == 0:
                    self.states.record(hook.request_ids[b], end_position)
        row_of_end = {int(end) - 1: b for b, end in enumerate(ends)}
        wanted = (range(len(q_lens)) if hook.host_logit_rows is None
                  else [row_of_end[int(end)] for end in hook.host_logit_rows])
        if not wanted:
            return mx.zeros((1, 0, self.config.vocab_size))
        return mx.stack([last_logits[b] for b in wanted])[None]

    def _run_pieces(self, hook, pieces: list[tuple[int, int, int]]) -> mx.array:
        """Run ``pieces`` (``(row, first token, end token)`` of the step's
        tokens: several of one token each, or one) as ``[len(pieces), L]``;
        the logits of each piece's last token."""
        host, ids = hook.host_arrays, hook.request_ids
        tokens = np.concatenate([np.arange(lo, hi) for _, lo, hi in pieces])
        rows = [b for b, _, _ in pieces]
        sub = {name: mx.array(host[name][tokens]) for name in ("tokens", "positions", "write_pages", "write_slots")}
        length = pieces[0][2] - pieces[0][1]
        first_positions = [int(host["positions"][lo]) for _, lo, _ in pieces]
        sub.update(q_lens=mx.array(np.full(len(pieces), length, np.int32)),
                   kv_lens=mx.array(np.array([p + length for p in first_positions], np.int32)),
                   block_table=mx.array(host["block_table"][rows]))
        view = types.SimpleNamespace(store=hook.store, arrays=sub)
        states = [self.states.get(ids[b], p) for b, p in zip(rows, first_positions)]
        if len(pieces) == 1:
            merged, offset = states[0], first_positions[0]
        else:  # one batch: mlx-lm's own merge of the rows' states
            merged = [type(column[0]).merge(list(column)) for column in zip(*states)]
            offset = sub["positions"]
        caches = [None] * len(self._rules)
        for layer, slot in zip(self._layers, self._attention_slots):
            caches[slot] = (GatheringPagedCache(hook.store, layer.index, layer.window_size,
                                                (sub["write_pages"], sub["write_slots"]), host["block_table"][rows[0]],
                                                offset) if self.gathering else
                            PagedLayerCache(view, layer.index, layer.window_size, length, offset))
        for slot, cache in zip(self._recurrent_slots, merged):
            caches[slot] = cache
        logits = self.model(sub["tokens"].reshape(len(pieces), length), cache=_nested(self._nesting, caches))[:, -1]
        if len(pieces) > 1:
            for i, b in enumerate(rows):
                self.states.put(ids[b], [cache.extract(i) for cache in merged])
        return logits
