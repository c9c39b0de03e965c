"""mlx-lm's model classes on mlx_attn's kernels, through mlx-lm's two seams.

mlx-lm's models run as they are (no model file is copied); every attention
layer of theirs goes through two seams, and mlx_attn supplies both:

1. **The attention call.** A model module does ``from .base import
   scaled_dot_product_attention`` and calls it with ``(queries, keys, values,
   cache=..., scale=..., mask=..., sinks=...)``. :func:`install_attention`
   rebinds that name, in ``mlx_lm.models.base`` and in every loaded
   ``mlx_lm.models.*`` module that bound it, to :func:`attention`: the fused
   CPU / Metal path of :func:`mlx_attn.scaled_dot_product_attention` (sinks and
   softcap passed through), and over quantized K/V (the triples a quantized
   cache returns) :func:`mlx_attn.quantized_scaled_dot_product_attention`,
   fused and with sinks (mlx-lm's own quantized attention refuses sinks).
2. **The caches.** Models build their masks by asking the cache
   (``cache.make_mask(N, return_array=..., window_size=...)``) before the
   update. :func:`make_cache` takes mlx-lm's own ``make_prompt_cache``
   structure and swaps each attention cache for one of mlx_attn's
   (:class:`KVCache`, :class:`RotatingKVCache`, :class:`QuantizedKVCache` of
   this module, subclasses of :mod:`mlx_attn.cache`'s), keeping the others
   (``ArraysCache``, ``MambaCache``... of hybrid layers) as mlx-lm makes them.
   A sliding-window mask these caches make is the array mlx-lm would make
   (lazy: never computed unless read), remembered with the window it encodes;
   :func:`attention` recognises it and calls the kernel with ``window_size``
   instead of a mask array. A model that reads the mask itself gets a correct
   array.

A serving engine supplies a third kind of cache, a :class:`SelfAttendingCache`
(its pages, :mod:`mlx_attn.serve.mlx_lm_paged`): the update writes the step's
K/V rows into the engine's pages, and :func:`attention`, handed that cache,
lets it attend (paged attention over every sequence of the ragged batch).

:func:`load` reads any directory ``mlx_lm.load`` accepts (float or
quantized), or a Hugging Face repo id found in the local Hugging Face cache
(never the network). Needs the ``mlx-lm`` extra: ``pip install
'mlx_attn[mlx-lm]'``. Importing this module does not import mlx-lm.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import sys
import types
import weakref
from pathlib import Path

import mlx.core as mx

from mlx_attn import cache as mlx_attn_cache
from mlx_attn.lm.quantized_matmul import use_row_adaptive_matmuls, widen_for_integer_product
from mlx_attn.ops import AttentionCall
from mlx_attn.quantized import quantized_scaled_dot_product_attention

__all__ = ["SelfAttendingCache", "attention", "contiguous_mask", "install_attention", "attention_installed", "restore_attention", "attention_calls", "attention_paths", "make_cache", "load",
           "resolve_model_path", "seam_problems", "SeamCall", "MlxLmModel", "MlxLmTokenizer", "KVCache", "RotatingKVCache",
           "QuantizedKVCache", "INSTALL_HINT"]

INSTALL_HINT = "mlx-lm models need the mlx-lm extra: pip install 'mlx_attn[mlx-lm]'"
SEAM_NAME = "scaled_dot_product_attention"
MLX_LM_MODELS = "mlx_lm.models"

# How often each kind of call went through the seam ("float", "quantized",
# "windowed" for the float or quantized calls that took window_size, and
# "self-attending" for a serving engine's paged caches), and
# which path each float call took (mlx_attn.attention_path's names): lets a
# caller check that mlx_attn ran a model's attention, and which way.
attention_calls: collections.Counter = collections.Counter()
attention_paths: collections.Counter = collections.Counter()


def _import_mlx_lm():
    try:
        import mlx_lm.models.base  # noqa: PLC0415 (optional dependency)
        import mlx_lm.models.cache  # noqa: PLC0415
        import mlx_lm.utils  # noqa: PLC0415
    except ImportError as error:
        raise ImportError(f"{INSTALL_HINT} ({error})") from error
    return mlx_lm


# ---------------------------------------------------------------- masks
class _ArrayNotes:
    """A note kept beside each of some arrays while the array lives (by
    identity, weakly): which window a mask this module's caches made
    encodes, or which self-attending cache handed out some keys."""

    def __init__(self):
        self._by_id: dict[int, tuple[weakref.ref, object]] = {}

    def remember(self, array: mx.array, note) -> mx.array:
        key = id(array)
        self._by_id[key] = (weakref.ref(array, lambda _, key=key: self._by_id.pop(key, None)), note)
        return array

    def lookup(self, array) -> tuple[bool, object]:
        """``(known, note)`` for an argument."""
        entry = self._by_id.get(id(array))
        if entry is None or entry[0]() is not array:
            return False, None
        return True, entry[1]


# mask arrays made by this module's caches, each with the lower-right causal window it encodes (None:
# plain causal), so attention() can pass the window instead of the array
_windowed_masks = _ArrayNotes()
# keys handed out by self-attending caches: (their values, a weak reference to the cache)
_handed_out = _ArrayNotes()


def _causal_mask(n_queries: int, n_keys: int, window: int | None) -> mx.array:
    """Boolean ``[n_queries, n_keys]``: lower-right causal, within ``window``
    most recent keys (itself included) when given; lazy."""
    query = mx.arange(n_keys - n_queries, n_keys)[:, None]
    key = mx.arange(n_keys)[None]
    visible = key <= query
    return visible & (key > query - window) if window is not None else visible


def contiguous_mask(n_queries: int, n_keys: int, window: int | None, return_array: bool):
    """The mask of ``n_queries`` new queries over ``n_keys`` keys held in time
    order and ending at the newest query: ``None`` / ``"causal"`` where no
    window bites and no array is asked for, else a lazy array remembered with
    its window."""
    if not return_array and (window is None or n_keys <= window):
        return "causal" if n_queries > 1 else None
    return _windowed_masks.remember(_causal_mask(n_queries, n_keys, window), window)


# ---------------------------------------------------------------- caches
class _MlxLmMasks:
    """mlx-lm's ``make_mask(N, return_array=, window_size=)``, asked before
    the update of ``N`` tokens, for caches that hold every token in order."""

    attention_backend = "auto"  # the backend= of :func:`attention` for this cache's layer

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        return contiguous_mask(N, self.offset + N, window_size, return_array)


class _KeysAndValues:
    """mlx-lm's ``keys_and_values()``: the keys and values the last
    ``update_and_fetch`` returned, the same arrays (a KV-shared layer of
    Gemma 3n reads its source layer's cache this way after that layer's
    update, and attends with a mask of the source layer's kind)."""

    _returned = None

    def update_and_fetch(self, keys, values):
        self._returned = super().update_and_fetch(keys, values)
        return self._returned

    def keys_and_values(self):
        if self._returned is None:
            raise ValueError("keys_and_values() of a cache no update has reached yet")
        return self._returned


class QuantizedKVCache(_MlxLmMasks, _KeysAndValues, mlx_attn_cache.QuantizedKVCache):
    """:class:`mlx_attn.cache.QuantizedKVCache` with mlx-lm's mask interface."""


class KVCache(_MlxLmMasks, _KeysAndValues, mlx_attn_cache.KVCache):
    """:class:`mlx_attn.cache.KVCache` with mlx-lm's mask interface;
    ``to_quantized`` gives this module's :class:`QuantizedKVCache`."""

    QUANTIZED_CACHE = QuantizedKVCache


class RotatingKVCache(_KeysAndValues, mlx_attn_cache.RotatingKVCache):
    """:class:`mlx_attn.cache.RotatingKVCache` with mlx-lm's mask interface.

    The window is ``window_size`` or, as in mlx-lm, ``max_size``. While the
    keys an update returns are in time order (always for ``keep=0`` chunks,
    and before the ring wraps) the mask is causal with that window (an array
    remembered with it, so the kernel takes ``window_size``); otherwise
    (a wrapped ring, or kept first tokens after the window slid) it is a
    boolean array by each key's position."""

    attention_backend = "auto"

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        if N == 1 and not return_array and (window_size is None or window_size >= self.max_size):
            return None  # one query sees the whole window the cache keeps
        window = window_size or self.max_size
        n_keys = self.keys_after_update(N)
        in_time_order = n_keys == self.offset + N or (N > 1 and self.keep == 0)
        if in_time_order:
            return contiguous_mask(N, n_keys, window, return_array)
        positions = self.key_positions_after_update(N)[None]
        query = mx.arange(self.offset, self.offset + N)[:, None]
        return (positions <= query) & (positions > query - window)


def _our_cache(cache, mlx_lm_cache):
    """One of mlx-lm's caches as this module's, recursing into a CacheList;
    non-attention caches stay as they are."""
    if isinstance(cache, (mlx_lm_cache.KVCache, mlx_lm_cache.ConcatenateKVCache)):
        return KVCache()
    if isinstance(cache, mlx_lm_cache.RotatingKVCache):
        return RotatingKVCache(max_size=cache.max_size, keep=cache.keep)
    if isinstance(cache, mlx_lm_cache.QuantizedKVCache):
        return QuantizedKVCache(group_size=cache.group_size, bits=cache.bits)
    if isinstance(cache, mlx_lm_cache.CacheList):
        return mlx_lm_cache.CacheList(*(_our_cache(c, mlx_lm_cache) for c in cache.caches))
    return cache


def make_cache(model, max_kv_size: int | None = None, *, backend: str = "auto") -> list:
    """The per-layer caches of an mlx-lm model: ``mlx_lm``'s
    ``make_prompt_cache(model, max_kv_size)`` with every attention cache
    swapped for this module's (same window and keep), the others kept.
    ``backend``: the attention path (``"auto"``, ``"fused"``, ``"reference"``)
    :func:`attention` takes for these caches' layers."""
    mlx_lm = _import_mlx_lm()
    caches = [_our_cache(c, mlx_lm.models.cache) for c in mlx_lm.models.cache.make_prompt_cache(model, max_kv_size)]
    for cache in _flat(caches):
        if isinstance(cache, (_MlxLmMasks, RotatingKVCache)):
            cache.attention_backend = backend
    return caches


def _flat(caches):
    for cache in caches:
        inner = getattr(cache, "caches", None)
        if inner is not None and not isinstance(cache, (_MlxLmMasks, RotatingKVCache)):
            yield from _flat(inner)
        else:
            yield cache


class SelfAttendingCache:
    """A cache that runs its layer's attention itself: :func:`attention`
    handed one (mlx-lm passes each layer's cache to the call) returns
    ``cache.attend(queries, keys, values, scale=, sinks=, softcap=)`` with the
    ``keys``/``values`` its ``update_and_fetch`` returned, and ignores the
    mask (the cache knows each query's keys and the layer's window).

    A KV-shared layer (Gemma 4's later layers) has no cache: it calls the
    attention with ``cache=None`` and the keys and values an earlier layer's
    cache returned. ``update_and_fetch`` hands them out through
    :meth:`hand_out`, so :func:`attention` knows them and lets that cache
    attend for the shared layer too, with its window (mlx-lm's models share
    a layer's K/V only with layers of its own kind).
    Subclasses: the serving engine's paged caches."""

    def hand_out(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """``(keys, values)``, remembered (weakly) as this cache's."""
        _handed_out.remember(keys, (values, weakref.ref(self)))
        return keys, values

    def attend(self, queries: mx.array, keys, values, *, scale: float, sinks: mx.array | None,
               softcap: float | None) -> mx.array:
        raise NotImplementedError


def _owner_of(keys, values) -> SelfAttendingCache | None:
    """The self-attending cache that handed out exactly ``keys`` and ``values``."""
    known, entry = _handed_out.lookup(keys)
    if not known or entry[0] is not values:
        return None
    return entry[1]()


# ---------------------------------------------------------------- attention
def attention(queries: mx.array, keys, values, cache=None, scale: float = 1.0, mask=None,
              sinks: mx.array | None = None, *, softcap: float | None = None) -> mx.array:
    """mlx-lm's ``scaled_dot_product_attention`` (same arguments; ``softcap``
    in addition) on mlx_attn's kernels. Keys and values given as quantized
    triples (what a quantized cache returns) run the fused quantized
    attention with the cache's ``group_size`` and ``bits``, sinks included. A
    mask made by this module's caches for a sliding window becomes
    ``window_size``. A :class:`SelfAttendingCache` attends itself."""
    if _seam_recorders:
        _seam_recorders[-1].append(SeamCall(cache, keys, values, mask))
    if cache is None and isinstance(keys, mx.array):  # a KV-shared layer: keys another layer's cache returned
        cache = _owner_of(keys, values) or cache
    if isinstance(cache, SelfAttendingCache):
        attention_calls["self-attending"] += 1
        return cache.attend(queries, keys, values, scale=scale, sinks=sinks, softcap=softcap)
    known, window = _windowed_masks.lookup(mask)
    if known:
        mask = None if window is not None else "causal"
    backend = getattr(cache, "attention_backend", "auto")
    options = dict(scale=scale, mask=mask, sinks=sinks, window_size=window, backend=backend, softcap=softcap)
    if window is not None:
        attention_calls["windowed"] += 1
    if isinstance(keys, (tuple, list)):
        attention_calls["quantized"] += 1
        group_size, bits = (cache.group_size, cache.bits) if hasattr(cache, "bits") else _quantization_of(queries, keys)
        return quantized_scaled_dot_product_attention(queries, tuple(keys), tuple(values),
                                                      group_size=group_size, bits=bits, **options)
    attention_calls["float"] += 1
    call = AttentionCall.build(queries, keys, values, **options)
    attention_paths[call.path] += 1
    return call.run()


# ---------------------------------------------------------------- what went through the seam
@dataclasses.dataclass(frozen=True)
class SeamCall:
    """One call of :func:`attention`, as a model made it."""

    cache: object
    keys: object
    values: object
    mask: object


_seam_recorders: list[list[SeamCall]] = []


def _record_cache_returns(cache, returned: dict) -> None:
    """Make ``cache`` remember (in ``returned``, by its id) what its
    ``update_and_fetch`` handed the model last."""
    update = cache.update_and_fetch

    def update_and_fetch(keys, values):
        returned[id(cache)] = update(keys, values)
        return returned[id(cache)]

    cache.update_and_fetch = update_and_fetch


def seam_problems(model, tokens: int = 2) -> dict[int, str]:
    """Run ``tokens`` tokens, then one more, through ``model`` with this
    module's caches and check, for each attention cache (its slot in the
    cache list, nested lists flattened), that its layer attends through the
    seam exactly as a cache that attends itself needs: calls of
    :func:`attention` handed that cache (several: KV-shared layers handed
    their source's cache), each with the keys and values its
    ``update_and_fetch`` returned (not transformed) and a mask that is none,
    ``"causal"`` or one this module's caches made. Returns ``{slot: what
    differs}`` for the layers that do not (slot None: a layer attending
    without a cache to keys no cache returned; empty: every attention layer
    conforms). A layer that computes attention itself (mlx-lm's gemma2) or
    attends to keys computed from the cache's, with scores of its own in the
    mask (multi-head latent attention, deepseek_v3), is named here: dense
    generation runs them as they are, the serving engine gathers their K/V
    from its pages. A layer without a cache (KV sharing) passes when it
    attends to exactly the keys and values another cache returned
    (:class:`SelfAttendingCache` attends for it)."""
    install_attention()
    caches = make_cache(model)
    flat = list(_flat(caches))
    attention_slots = {id(cache): slot for slot, cache in enumerate(flat)
                       if isinstance(cache, (_MlxLmMasks, RotatingKVCache))}
    returned: dict[int, tuple] = {}
    for cache in flat:
        if id(cache) in attention_slots:
            _record_cache_returns(cache, returned)
    problems: dict[int, str] = {}
    for inputs in (mx.zeros((1, tokens), mx.int32), mx.zeros((1, 1), mx.int32)):
        returned.clear()
        calls: list[SeamCall] = []
        _seam_recorders.append(calls)
        try:
            mx.eval(model(inputs, cache=caches))
        finally:
            _seam_recorders.pop()
        by_cache = collections.defaultdict(list)
        for call in calls:
            by_cache[id(call.cache)].append(call)
            if id(call.cache) not in attention_slots:  # a layer without a cache of its own
                source = next((attention_slots[i] for i, (k, v) in returned.items()
                               if k is call.keys and v is call.values), None)
                if source is None:  # KV sharing reads a cache's keys and values as they are; this does not
                    problems.setdefault(None, "a layer attends without a cache of its own, to keys and values "
                                              "no cache returned")
        for cache_id, slot in attention_slots.items():
            if slot in problems:
                continue
            made = by_cache.get(cache_id, [])
            keys, values = returned.get(cache_id, (None, None))
            if not made:
                problems[slot] = "its layer computes attention itself, not through mlx-lm's scaled_dot_product_attention"
            # several calls with one cache: KV-shared layers handed the source layer's cache (Gemma 3n)
            elif any(call.keys is not keys or call.values is not values for call in made):
                problems[slot] = ("its layer attends to keys/values other than those the cache returned "
                                  "(computed from them, as multi-head latent attention does)")
            elif not all(_seam_mask(call.mask) for call in made):
                problems[slot] = "its layer passes a mask array of its own (scores or positions the cache cannot know)"
    return problems


def _seam_mask(mask) -> bool:
    """Whether a mask handed to :func:`attention` is one a cache that
    attends itself may ignore: none, ``"causal"``, or made by our caches."""
    return mask is None or isinstance(mask, str) or _windowed_masks.lookup(mask)[0]


def _quantization_of(queries: mx.array, keys) -> tuple[int, int]:
    """``(group_size, bits)`` of a quantized key triple read from its shapes
    (packed 32-bit words, one scale per group) and the queries' head dim:
    for a KV-shared layer, which gets an earlier layer's triples without
    its cache."""
    packed, scales = keys[0], keys[1]
    head_dim = queries.shape[-1]
    return head_dim // scales.shape[-1], packed.shape[-1] * 32 // head_dim


_mlx_lm_attention = None  # mlx-lm's own function, kept by install_attention for restore_attention


def _model_modules():
    return [module for name, module in list(sys.modules.items())
            if isinstance(module, types.ModuleType) and (name == MLX_LM_MODELS or name.startswith(MLX_LM_MODELS + "."))]


def install_attention() -> list[str]:
    """Make mlx-lm's models call :func:`attention`: rebinds
    ``scaled_dot_product_attention`` in ``mlx_lm.models.base`` and in every
    loaded ``mlx_lm.models.*`` module that bound mlx-lm's function (a module
    imported later keeps mlx-lm's until the next call: :func:`load` calls it
    after the model's module is imported). Process-wide and idempotent;
    returns the names of the modules it changed. :func:`restore_attention`
    undoes it."""
    global _mlx_lm_attention
    mlx_lm = _import_mlx_lm()
    current = getattr(mlx_lm.models.base, SEAM_NAME)
    if _mlx_lm_attention is None and current is not attention:
        _mlx_lm_attention = current
    changed = []
    for module in _model_modules():
        if _mlx_lm_attention is not None and getattr(module, SEAM_NAME, None) is _mlx_lm_attention:
            setattr(module, SEAM_NAME, attention)
            changed.append(module.__name__)
    return changed


def attention_installed() -> bool:
    """Whether ``mlx_lm.models.base`` calls :func:`attention` (what
    :func:`install_attention` does and :func:`restore_attention` undoes)."""
    base = sys.modules.get(MLX_LM_MODELS + ".base")
    return base is not None and getattr(base, SEAM_NAME, None) is attention


def restore_attention() -> list[str]:
    """Give every module :func:`install_attention` changed (or that bound
    :func:`attention` since) mlx-lm's own function back; returns their names."""
    if _mlx_lm_attention is None:
        return []
    changed = []
    for module in _model_modules():
        if getattr(module, SEAM_NAME, None) is attention:
            setattr(module, SEAM_NAME, _mlx_lm_attention)
            changed.append(module.__name__)
    return changed


# ---------------------------------------------------------------- loading
def _hub_cache_dir() -> str:
    try:
        from huggingface_hub import constants  # noqa: PLC0415 (mlx-lm's dependency)
    except ImportError:
        return os.environ.get("HF_HUB_CACHE", "~/.cache/huggingface/hub")
    return constants.HF_HUB_CACHE


def resolve_model_path(path_or_repo: str | os.PathLike) -> Path:
    """A local directory as it is; otherwise ``owner/name`` looked up in the
    local Hugging Face cache only (``FileNotFoundError`` naming the cache
    directory when it is not there). Never downloads."""
    path = Path(path_or_repo).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"{path}: an mlx-lm model is a directory (config.json, *.safetensors, tokenizer)")
        return path
    name = str(path_or_repo)
    parts = name.split("/")
    if len(parts) != 2 or not all(parts):
        raise FileNotFoundError(f"model {name!r} not found: no such directory, and not a Hugging Face repo id "
                                "(owner/name)")
    try:
        from huggingface_hub import snapshot_download  # noqa: PLC0415

        found = snapshot_download(name, local_files_only=True)
    except Exception as error:  # noqa: BLE001 (every miss of the local cache reads the same to the user)
        raise FileNotFoundError(f"model {name!r} looks like a Hugging Face Hub name and is neither a local "
                                f"directory nor in the local Hugging Face cache (looked in {_hub_cache_dir()}); "
                                f"mlx_attn never downloads: fetch it first, e.g. `hf download {name}`") from None
    return Path(found)


class MlxLmModel:
    """An mlx-lm model as :mod:`mlx_attn.lm.generate` drives it:
    ``model(tokens, cache=cache)``, ``make_cache(max_kv_size)`` (this
    module's caches), ``config`` (``vocab_size``, ``max_position_embeddings``
    where the checkpoint's config gives them) and ``backend``."""

    def __init__(self, model, config: dict, source: str, backend: str = "auto"):
        self.model = model
        self.source = source
        self.backend = backend
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
        self.config = types.SimpleNamespace(
            model_type=config.get("model_type"),
            vocab_size=config.get("vocab_size", text.get("vocab_size")),
            max_position_embeddings=config.get("max_position_embeddings", text.get("max_position_embeddings")),
        )

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        return self.model(inputs, cache=cache)

    def parameters(self):
        return self.model.parameters()

    def make_cache(self, max_kv_size: int | None = None) -> list:
        return make_cache(self.model, max_kv_size, backend=self.backend)


class MlxLmTokenizer:
    """mlx-lm's ``TokenizerWrapper`` with the interface of
    :class:`mlx_attn.lm.tokenizer.Tokenizer` the generation loop and the CLI
    use (the chat template renders text; ``encode`` takes
    ``add_special_tokens``)."""

    def __init__(self, wrapper):
        self.wrapper = wrapper

    @property
    def eos_token_ids(self) -> set[int]:
        return self.wrapper.eos_token_ids

    @property
    def chat_template(self):
        return self.wrapper.chat_template if self.wrapper.has_chat_template else None

    @property
    def vocab_size(self) -> int:
        return len(self.wrapper)

    def add_eos_token(self, token: str) -> None:
        found = self.wrapper.convert_tokens_to_ids(token)
        if found is None or found == getattr(self.wrapper, "unk_token_id", None):
            raise ValueError(f"end token {token!r} is not in the vocabulary")
        self.wrapper.eos_token_ids = self.wrapper.eos_token_ids | {found}

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.wrapper.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids, *, skip_special_tokens: bool = False) -> str:
        return self.wrapper.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; use plain prompts")
        try:
            return self.wrapper.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                    tokenize=False, tools=tools)
        except Exception as error:  # noqa: BLE001 (the template is the model file's code)
            raise ValueError(f"the model's chat template failed: {type(error).__name__}: {error}") from None


def load(path_or_repo: str | os.PathLike, backend: str = "auto") -> tuple[MlxLmModel, MlxLmTokenizer]:
    """``(model, tokenizer)`` for any directory ``mlx_lm.load`` accepts
    (float or quantized weights), or a Hugging Face repo id in the local
    cache (see :func:`resolve_model_path`), with :func:`install_attention`
    done. ``backend``: the attention path for the caches the model makes."""
    mlx_lm = _import_mlx_lm()
    path = resolve_model_path(path_or_repo)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: no config.json (not an mlx-lm / Hugging Face model directory)")
    model, wrapper, config = mlx_lm.utils.load(str(path), return_config=True)
    if mx.default_device() == mx.cpu:  # quantized layers through the integer product, as our own models
        use_row_adaptive_matmuls(model)
        widen_for_integer_product(model)
    install_attention()
    return MlxLmModel(model, config, str(path), backend), MlxLmTokenizer(wrapper)


def model_type_of(path: str | os.PathLike) -> str | None:
    """``model_type`` of a directory's config.json (None when unreadable)."""
    try:
        value = json.loads((Path(path) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None
