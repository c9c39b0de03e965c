"""Key/value caches for incremental decoding (interface compatible with mlx-lm).

Every cache stores keys and values in the ``[B, n_kv_heads, T, head_dim]``
layout and offers ``update_and_fetch(keys, values) -> (keys, values)``,
``offset`` (tokens seen so far), ``state`` (get/set), ``trim(n)``,
``is_trimmable()``, ``nbytes``, ``make_mask(q_len)`` (the mask the attention
call needs after an update), ``keys_after_update(n)`` (how many keys the next
update of ``n`` tokens returns) and ``meta_state`` (get/set, the dict of
``META_FIELDS``).

Every argument is checked: a bad one raises ``ValueError`` naming it and
leaves the cache as it was. Updates must match what the cache holds (batch,
heads, head dim, value dim, dtype) and add at least one token; ``trim`` takes
an int >= 0 and returns how many tokens it dropped.

- :class:`ConcatKVCache`: the textbook version, concatenating on every step.
- :class:`KVCache`: preallocates in steps and returns slices of its buffers,
  views the fused kernel reads through their strides without a copy.
- :class:`RotatingKVCache`: a ring buffer of ``max_size`` slots that always
  keeps the first ``keep`` tokens (sliding-window attention).
- :class:`QuantizedKVCache`: like :class:`KVCache`, storing keys and values
  as ``mx.quantize`` triples (4 or 8 bits); ``update_and_fetch`` returns the
  triples, for :func:`mlx_attn.quantized_scaled_dot_product_attention`.
  ``KVCache.to_quantized`` / ``ConcatKVCache.to_quantized`` convert.

:func:`save_cache` / :func:`load_cache` store caches in a safetensors file
(prompt caching); :func:`kv_cache_bytes` computes what a cache costs.
"""

from __future__ import annotations

import json
import math
import os

import mlx.core as mx

from mlx_attn.core import quantization
from mlx_attn.core.checks import MAX_DIM, check_array, check_int, check_optional_int

__all__ = [
    "ConcatKVCache",
    "KVCache",
    "RotatingKVCache",
    "QuantizedKVCache",
    "save_cache",
    "load_cache",
    "kv_cache_bytes",
    "kv_cache_bytes_per_token",
    "MAX_STEP",
]

# The largest allocation step (tokens) a cache accepts: growing by more than
# this at once is a typo, not a plan (mlx-lm uses 256).
MAX_STEP = 2**16


def _check_pair(keys, values, what: str) -> None:
    """Keys and values of one update or state: 4-D, floating, one dtype,
    agreeing on [B, heads, T], with at least one head and one feature."""
    check_array(f"{what} keys", keys, floating=True)
    check_array(f"{what} values", values, floating=True)
    if keys.ndim != 4 or values.ndim != 4:
        raise ValueError(
            f"{what} keys and values must be [B, n_kv_heads, T, head_dim], got {keys.shape} and {values.shape}"
        )
    if keys.shape[:3] != values.shape[:3]:
        raise ValueError(f"{what} keys {keys.shape} and values {values.shape} disagree on [B, heads, T]")
    if keys.dtype != values.dtype:
        raise ValueError(f"{what} keys ({keys.dtype}) and values ({values.dtype}) need the same dtype")
    if keys.shape[1] == 0 or keys.shape[3] == 0 or values.shape[3] == 0:
        raise ValueError(f"{what} keys {keys.shape} / values {values.shape} need >= 1 head and head_dim >= 1")


def _check_update(keys, values, stored_keys: mx.array | None, stored_values: mx.array | None, offset: int):
    _check_pair(keys, values, "new")
    if keys.shape[2] == 0:
        raise ValueError(f"an update must add at least one token, got keys of shape {keys.shape}")
    check_int("the cache length after this update", offset + keys.shape[2])
    if stored_keys is None:
        return
    if keys.shape[:2] != stored_keys.shape[:2] or keys.shape[3] != stored_keys.shape[3]:
        raise ValueError(
            f"new keys {keys.shape} do not match the cached ones {stored_keys.shape} (batch, heads or head_dim)"
        )
    if values.shape[3] != stored_values.shape[3]:
        raise ValueError(f"new values {values.shape} do not match the cached ones {stored_values.shape} (value dim)")
    if keys.dtype != stored_keys.dtype:
        raise ValueError(f"new keys have dtype {keys.dtype}, the cached ones {stored_keys.dtype}")


def _check_state(value) -> tuple[mx.array | None, mx.array | None]:
    """A state to set: ``(keys, values)`` arrays, or ``(None, None)`` (empty)."""
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ValueError(f"state must be a (keys, values) pair, got {type(value).__name__}")
    keys, values = value
    if keys is None and values is None:
        return None, None
    _check_pair(keys, values, "state")
    return keys, values


def _check_meta(value, names: tuple[str, ...]) -> dict[str, int]:
    """A meta_state dict with exactly ``names``, all ints >= 0."""
    if not isinstance(value, dict) or set(value) != set(names):
        got = list(value) if isinstance(value, dict) else type(value).__name__
        raise ValueError(f"meta_state must be a dict with keys {list(names)}, got {got}")
    return {name: check_int(f"meta_state[{name!r}]", value[name], minimum=0) for name in names}


def _extend(stored: mx.array | None, like: mx.array, extra: int) -> mx.array:
    """`stored` followed by `extra` zero slots along the time axis."""
    b, h, _, d = like.shape
    zeros = mx.zeros((b, h, extra, d), dtype=like.dtype)
    return zeros if stored is None else mx.concatenate([stored, zeros], axis=2)


class _Cache:
    """Shared interface. Arguments are checked: a bad one raises ValueError
    naming it, and leaves the cache unchanged."""

    keys: mx.array | None
    values: mx.array | None
    offset: int
    META_FIELDS: tuple[str, ...] = ("offset",)  # the keys of meta_state
    # what to_quantized builds (None: QuantizedKVCache); a subclass that adds
    # an interface names its quantized twin here
    QUANTIZED_CACHE: type | None = None

    @property
    def state(self):
        return self.keys, self.values

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache buffers (allocated, not only used)."""
        if self.keys is None:
            return 0
        return self.keys.nbytes + self.values.nbytes

    def _check_update(self, keys, values) -> None:
        _check_update(keys, values, self.keys, self.values, self.offset)

    def make_mask(self, q_len: int):
        """Mask for the attention of the ``q_len`` newest queries against the
        keys returned by the last update: plain lower-right causal."""
        q_len = check_int("q_len", q_len, minimum=0, maximum=self.offset)
        return "causal" if q_len > 1 else None

    def keys_after_update(self, n: int) -> int:
        """How many keys ``update_and_fetch`` returns for an update of ``n``
        tokens (lets a caller check a mask before changing the cache)."""
        return self.offset + check_int("n", n, minimum=1)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Forget the ``n`` newest tokens; returns how many were forgotten
        (preallocated buffers: only the offset moves back)."""
        n = self._trim_count(n)
        self.offset -= n
        return n

    def _trim_count(self, n) -> int:
        """``n`` checked (a non-negative int), capped at what the cache holds."""
        return min(self.offset, check_int("n", n, minimum=0, maximum=None))

    @property
    def meta_state(self) -> dict:
        return {field: getattr(self, field) for field in self.META_FIELDS}

    def _stored_length(self) -> int:
        """Tokens :attr:`state` returns (what a meta_state must agree with)."""
        keys = self.state[0]
        return 0 if keys is None else keys.shape[2]

    def _set_offset(self, offset: int) -> None:
        """Caches that hold every token: the offset is the stored length."""
        if offset != self._stored_length():
            raise ValueError(f"meta_state offset {offset} contradicts the {self._stored_length()} stored tokens")
        self.offset = offset

    # the tensors of :attr:`state`, flat, as a cache file names them
    STATE_TENSORS: tuple[str, ...] = ("keys", "values")

    def _state_tensors(self) -> tuple[mx.array, ...] | None:
        keys, values = self.state
        return None if keys is None else (keys, values)

    def _set_state_tensors(self, tensors: tuple[mx.array, ...]) -> None:
        self.state = tuple(tensors)

    def layout(self) -> dict | None:
        """What the stored keys and values look like (batch, n_kv_heads,
        head_dim, value_dim, dtype), or None when empty."""
        keys, values = self.state
        if keys is None:
            return None
        return {"batch": keys.shape[0], "n_kv_heads": keys.shape[1], "head_dim": keys.shape[3],
                "value_dim": values.shape[3], "dtype": keys.dtype}

    def to_quantized(self, group_size: int = 64, bits: int = 8) -> "QuantizedKVCache":
        """A :class:`QuantizedKVCache` holding this cache's tokens (this cache
        is left as it was)."""
        cache = (self.QUANTIZED_CACHE or QuantizedKVCache)(group_size, bits)
        keys, values = self.state
        if keys is not None and keys.shape[2] > 0:
            cache.update_and_fetch(keys, values)
        return cache


class ConcatKVCache(_Cache):
    """Appends by concatenation: simple, and every step copies the whole cache."""

    def __init__(self):
        self.keys = None
        self.values = None
        self.offset = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self._check_update(keys, values)
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = mx.concatenate([self.keys, keys], axis=2)
            self.values = mx.concatenate([self.values, values], axis=2)
        self.offset += keys.shape[2]
        return self.keys, self.values

    @_Cache.state.setter
    def state(self, value):
        self.keys, self.values = _check_state(value)
        self.offset = 0 if self.keys is None else self.keys.shape[2]

    @_Cache.meta_state.setter
    def meta_state(self, value):
        self._set_offset(_check_meta(value, self.META_FIELDS)["offset"])

    def trim(self, n: int) -> int:
        """Drop the ``n`` newest tokens; returns how many were dropped."""
        n = self._trim_count(n)
        if n and self.keys is not None:
            self.offset -= n
            self.keys = self.keys[..., : self.offset, :]
            self.values = self.values[..., : self.offset, :]
        return n


class KVCache(_Cache):
    """Preallocated in chunks of ``step`` tokens (1 .. ``MAX_STEP``); returns
    ``[:, :, :offset]`` slices of its buffers (no copy)."""

    META_FIELDS = ("offset", "step")

    def __init__(self, step: int = 256):
        self.step = check_int("step", step, minimum=1, maximum=MAX_STEP)
        self.keys = None
        self.values = None
        self.offset = 0

    def _grow(self, keys: mx.array, values: mx.array):
        """Reallocate to the next multiple of `step` that fits the update."""
        needed = self.offset + keys.shape[2]
        capacity = min((needed + self.step - 1) // self.step * self.step, MAX_DIM)
        used = (None, None) if self.keys is None else (self.keys[..., : self.offset, :], self.values[..., : self.offset, :])
        self.keys = _extend(used[0], keys, capacity - self.offset)
        self.values = _extend(used[1], values, capacity - self.offset)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self._check_update(keys, values)
        start = self.offset
        if self.keys is None or start + keys.shape[2] > self.keys.shape[2]:
            self._grow(keys, values)
        self.offset = start + keys.shape[2]
        self.keys[..., start : self.offset, :] = keys
        self.values[..., start : self.offset, :] = values
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    @property
    def state(self):
        if self.keys is None:
            return None, None
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    @state.setter
    def state(self, value):
        self.keys, self.values = _check_state(value)
        self.offset = 0 if self.keys is None else self.keys.shape[2]

    @_Cache.meta_state.setter
    def meta_state(self, value):
        meta = _check_meta(value, self.META_FIELDS)
        step = check_int("meta_state['step']", meta["step"], minimum=1, maximum=MAX_STEP)
        self._set_offset(meta["offset"])
        self.step = step


class RotatingKVCache(_Cache):
    """A sliding window of ``max_size`` tokens that always keeps the first
    ``keep`` ones: a query at position ``p`` sees tokens ``0 .. keep-1`` and
    the ``max_size - keep`` most recent tokens up to ``p``.

    Single-token updates write into a ring buffer in place. A multi-token
    update (prefill in chunks) returns the stored window followed by the new
    tokens in temporal order, and :meth:`make_mask` gives the band mask that
    keeps each new query within its own window.
    """

    META_FIELDS = ("offset", "max_size", "keep", "step", "idx")

    def __init__(self, max_size: int, keep: int = 0, step: int = 256):
        self.max_size = check_int("max_size", max_size, minimum=1)
        if check_int("keep", keep, minimum=0) >= max_size:
            raise ValueError(f"keep must be in [0, max_size), got keep={keep}, max_size={max_size}")
        self.keep = keep
        self.step = check_int("step", step, minimum=1, maximum=MAX_STEP)
        self.keys = None
        self.values = None
        self.offset = 0
        self._idx = 0  # next slot to write; == buffer length when in temporal order
        self._last_update = 0  # tokens of the last update (what make_mask describes)

    # -- helpers ------------------------------------------------------------
    def _temporal_length(self) -> int:
        """How many entries `_temporal` returns."""
        size = self.keys.shape[2]
        return self._idx if self._idx != size and self.offset <= self._idx else size

    def _temporal(self, buf: mx.array) -> mx.array:
        """The valid entries of a buffer, oldest first."""
        size = buf.shape[2]
        if self._idx == size:
            return buf
        if self.offset <= self._idx:  # not wrapped yet: [0, idx) are valid
            return buf[..., : self._idx, :]
        k, i = self.keep, self._idx  # wrapped: [keep][idx..end][keep..idx)
        return mx.concatenate([buf[..., :k, :], buf[..., i:, :], buf[..., k:i, :]], axis=2)

    def _window(self, buf: mx.array, size: int) -> mx.array:
        """The first `keep` and the most recent `size - keep` entries."""
        if buf.shape[2] <= size:
            return buf
        recent = size - self.keep
        parts = [buf[..., : self.keep, :]] if self.keep else []
        if recent > 0:
            parts.append(buf[..., -recent:, :])
        return mx.concatenate(parts, axis=2) if len(parts) > 1 else parts[0]

    # -- updates ------------------------------------------------------------
    def keys_after_update(self, n: int) -> int:
        n = check_int("n", n, minimum=1)
        if n == 1:
            return min(self.offset + 1, self.max_size)
        if self.keys is None:
            return n
        return min(self._temporal_length(), self.max_size - 1) + n

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self._check_update(keys, values)
        self._last_update = keys.shape[2]
        if keys.shape[2] == 1:
            return self._update_in_place(keys, values)
        return self._update_concat(keys, values)

    def _update_concat(self, keys, values):
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            # the new queries need at most max_size - 1 older tokens
            old_k = self._window(self._temporal(self.keys), self.max_size - 1)
            old_v = self._window(self._temporal(self.values), self.max_size - 1)
            self.keys = mx.concatenate([old_k, keys], axis=2)
            self.values = mx.concatenate([old_v, values], axis=2)
        self.offset += keys.shape[2]
        self._idx = self.keys.shape[2]
        return self.keys, self.values

    def _update_in_place(self, keys, values):
        if self.keys is not None and self.keys.shape[2] > self.max_size:
            # after a chunk: bring the window back to max_size - 1 in order
            self.keys = self._window(self._temporal(self.keys), self.max_size - 1)
            self.values = self._window(self._temporal(self.values), self.max_size - 1)
            self._idx = self.keys.shape[2]
        if self.keys is None or (self._idx == self.keys.shape[2] and self.keys.shape[2] < self.max_size):
            grow = min(self.step, self.max_size - (0 if self.keys is None else self.keys.shape[2]))
            self.keys = _extend(self.keys, keys, grow)
            self.values = _extend(self.values, values, grow)
        self._idx = self._next_slot()
        self.keys[..., self._idx : self._idx + 1, :] = keys
        self.values[..., self._idx : self._idx + 1, :] = values
        self._idx += 1
        self.offset += 1
        if self.offset < self.keys.shape[2]:
            return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]
        return self.keys, self.values

    def _next_slot(self) -> int:
        """Where a single token goes once the buffer is in place: the ring's
        next slot; when full, the oldest non-kept one."""
        return self.keep if self._idx == self.max_size else self._idx

    def in_place_slot(self) -> int | None:
        """The slot the next single-token update writes when that write is
        all it does; None when it first reorders the buffer (after a chunk)
        or grows it, or the cache is empty."""
        if self.keys is None:
            return None
        size = self.keys.shape[2]
        if size > self.max_size or (self._idx == size and size < self.max_size):
            return None
        return self._next_slot()

    def written_in_place(self, keys: mx.array, values: mx.array, slot: int) -> None:
        """Take buffers that hold one more token at ``slot`` (from
        :meth:`in_place_slot`), written elsewhere (a compiled step): the
        state the single-token update leaves."""
        self.keys, self.values = keys, values
        self._idx, self.offset, self._last_update = slot + 1, self.offset + 1, 1

    def key_positions(self) -> mx.array:
        """The sequence position of each key the last update returned: in
        time order after a multi-token update (the kept tokens, then the most
        recent ones), in ring order after a single token once the ring has
        wrapped (slot ``s >= keep`` holds the token written ``idx - 1 - s``
        ring steps before the newest)."""
        if self.keys is None:
            return mx.zeros((0,), mx.int32)
        if self._last_update > 1:  # [keep][recent ... newest], contiguous after the kept ones
            length = self.keys.shape[2]
            j = mx.arange(length)
            return mx.where(j < self.keep, j, self.offset - length + j)
        length = min(self.offset, self.keys.shape[2])
        slot = mx.arange(length)
        ring = self.max_size - self.keep
        age = (self._idx - 1 - slot) % ring  # ring steps since the slot was written
        return mx.where(slot < self.keep, slot, self.offset - 1 - age)

    def key_positions_after_update(self, n: int) -> mx.array:
        """What :meth:`key_positions` will return after an update of ``n``
        tokens, without changing the cache: the update runs on a stand-in
        holding one zero feature per stored slot (lazy arrays, nothing is
        evaluated), so callers that build a mask before the update (mlx-lm's
        models) get the layout the update will leave."""
        n = check_int("n", n, minimum=1)
        stand_in = RotatingKVCache(self.max_size, self.keep, self.step)
        stand_in.offset, stand_in._idx, stand_in._last_update = self.offset, self._idx, self._last_update
        if self.keys is not None:
            stand_in.keys = mx.zeros((1, 1, self.keys.shape[2], 1))
            stand_in.values = mx.zeros((1, 1, self.keys.shape[2], 1))
        new = mx.zeros((1, 1, n, 1))
        stand_in.update_and_fetch(new, new)
        return stand_in.key_positions()

    def make_mask(self, q_len: int, window_size: int | None = None):
        """A boolean ``[q_len, L]`` mask for the keys the last update returned
        (``q_len`` at most the update's length): a query at position ``p``
        sees keys at positions up to ``p`` that the cache keeps for it (the
        first ``keep`` and the ``max_size - keep`` most recent) and, with
        ``window_size``, only the ``window_size`` most recent of them. The
        visibility goes by each key's position, not its place in the buffer
        (a wrapped ring is not in time order). None when a single query sees
        every stored key (one token, no window)."""
        q_len = check_int("q_len", q_len, minimum=0)
        window_size = check_optional_int("window_size", window_size, minimum=1)
        if q_len == 0 or (q_len == 1 and window_size is None):
            return None
        if q_len > self._last_update:
            raise ValueError(
                f"q_len={q_len}: make_mask describes the last update, which added {self._last_update} tokens"
            )
        key_pos = self.key_positions()[None, :]
        query_pos = mx.arange(self.offset - q_len, self.offset)[:, None]
        recent = self.max_size - self.keep
        visible = (key_pos <= query_pos) & ((key_pos < self.keep) | (key_pos > query_pos - recent))
        if window_size is not None:
            visible = visible & (key_pos > query_pos - window_size)
        return visible

    # -- state --------------------------------------------------------------
    @property
    def state(self):
        if self.keys is not None and self.offset < self.keys.shape[2]:
            return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]
        return self.keys, self.values

    @state.setter
    def state(self, value):
        """The buffers as :attr:`state` returns them; read as every token
        in temporal order until :attr:`meta_state` says the window has slid."""
        self.keys, self.values = _check_state(value)
        self.offset = self._idx = 0 if self.keys is None else self.keys.shape[2]
        self._last_update = 0

    @property
    def meta_state(self) -> dict:
        return {
            "offset": self.offset,
            "max_size": self.max_size,
            "keep": self.keep,
            "step": self.step,
            "idx": self._idx,
        }

    @meta_state.setter
    def meta_state(self, value):
        meta = _check_meta(value, self.META_FIELDS)
        shape = RotatingKVCache(meta["max_size"], meta["keep"], meta["step"])  # checks those three
        offset, idx, stored = meta["offset"], meta["idx"], self._stored_length()
        # the layouts update_and_fetch can leave behind
        if stored == offset:  # every token stored, oldest first
            consistent = idx == stored
        else:  # the window has slid: a full ring, or a chunk in temporal order
            consistent = stored < offset and stored >= shape.max_size and (
                shape.keep <= idx <= stored if stored == shape.max_size else idx == stored
            )
        if not consistent:
            raise ValueError(
                f"meta_state offset={offset}, idx={idx} contradict the {stored} stored tokens "
                f"of a window of max_size={shape.max_size}, keep={shape.keep}"
            )
        self.max_size, self.keep, self.step = shape.max_size, shape.keep, shape.step
        self.offset, self._idx = offset, idx

    def is_trimmable(self) -> bool:
        return self.offset < self.max_size

    def to_quantized(self, group_size: int = 64, bits: int = 8):
        """Refused: a quantized cache keeps every token, not a window."""
        raise ValueError("a RotatingKVCache cannot be converted to a QuantizedKVCache (it keeps a sliding window)")

    def trim(self, n: int) -> int:
        """Only possible before the window has started to slide; returns how
        many tokens were dropped (0 once it has)."""
        n = self._trim_count(n)
        if not self.is_trimmable():
            return 0
        self.offset -= n
        self._idx -= n
        self._last_update = 0
        return n


class QuantizedKVCache(_Cache):
    """Like :class:`KVCache` (preallocated in ``step``-token chunks, slices
    returned without a copy), with keys and values stored quantized by
    ``mx.quantize`` (``bits`` 4 or 8, ``group_size`` 32/64/128 features per
    scale and bias). ``update_and_fetch`` takes float keys and values and
    returns ``(packed, scales, biases)`` triples; :attr:`state` is a pair of
    triples; ``meta_state`` adds ``group_size`` and ``bits``. Head and value
    dims must be multiples of ``group_size``; scales keep the update dtype.
    """

    META_FIELDS = ("offset", "step", "group_size", "bits")
    STATE_TENSORS = tuple(f"{which}.{part}" for which in ("keys", "values") for part in ("packed", "scales", "biases"))

    def __init__(self, group_size: int = 64, bits: int = 8, step: int = 256):
        self.group_size, self.bits = quantization.check_quantization(group_size, bits)
        self.step = check_int("step", step, minimum=1, maximum=MAX_STEP)
        self.keys = None  # (packed, scales, biases) buffers of capacity >= offset
        self.values = None
        self.offset = 0

    def _check_update(self, keys, values) -> None:
        _check_pair(keys, values, "new")
        for name, dim in (("head_dim", keys.shape[3]), ("value_dim", values.shape[3])):
            quantization.check_quantizable_dim(f"new keys/values {name}", dim, self.group_size)
        if keys.shape[2] == 0:
            raise ValueError(f"an update must add at least one token, got keys of shape {keys.shape}")
        check_int("the cache length after this update", self.offset + keys.shape[2])
        held = self.layout()
        if held is None:
            return
        new = {"batch": keys.shape[0], "n_kv_heads": keys.shape[1], "head_dim": keys.shape[3],
               "value_dim": values.shape[3], "dtype": keys.dtype}
        for name, value in new.items():
            if value != held[name]:
                raise ValueError(f"new keys {keys.shape} / values {values.shape} ({keys.dtype}) do not match "
                                 f"the cached ones: {name} {value} != {held[name]}")

    def _quantize(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        return quantization.quantize(x, self.group_size, self.bits)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self._check_update(keys, values)
        new_k, new_v = self._quantize(keys), self._quantize(values)
        start = self.offset
        if self.keys is None or start + keys.shape[2] > self.keys[0].shape[2]:
            needed = start + keys.shape[2]
            extra = min((needed + self.step - 1) // self.step * self.step, MAX_DIM) - start
            used_k, used_v = self.state
            self.keys = tuple(_extend(old, part, extra) for old, part in zip(used_k or (None,) * 3, new_k))
            self.values = tuple(_extend(old, part, extra) for old, part in zip(used_v or (None,) * 3, new_v))
        self.offset = start + keys.shape[2]
        for buffer, new in zip(self.keys + self.values, new_k + new_v):
            buffer[..., start : self.offset, :] = new
        return self.state

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return sum(a.nbytes for a in self.keys + self.values)

    @property
    def state(self):
        if self.keys is None:
            return None, None
        return (tuple(a[..., : self.offset, :] for a in self.keys),
                tuple(a[..., : self.offset, :] for a in self.values))

    @state.setter
    def state(self, value):
        """``((k_packed, k_scales, k_biases), (v_packed, v_scales, v_biases))``
        for this cache's ``group_size`` and ``bits``, or ``(None, None)``."""
        if not isinstance(value, (tuple, list)) or len(value) != 2:
            raise ValueError(f"state must be a (keys, values) pair of quantized triples, got {type(value).__name__}")
        keys, values = value
        if keys is None and values is None:
            self.keys = self.values = None
            self.offset = 0
            return
        keys = quantization.check_triple("state keys", keys, self.group_size, self.bits)
        values = quantization.check_triple("state values", values, self.group_size, self.bits)
        if keys[0].shape[:3] != values[0].shape[:3] or keys[1].dtype != values[1].dtype:
            raise ValueError(f"state keys {keys[0].shape} ({keys[1].dtype}) and values {values[0].shape} "
                             f"({values[1].dtype}) disagree on [B, heads, T] or the scales dtype")
        if keys[0].shape[1] == 0:
            raise ValueError(f"state keys {keys[0].shape} need >= 1 head")
        self.keys, self.values = keys, values
        self.offset = keys[0].shape[2]

    def _state_tensors(self):
        keys, values = self.state
        return None if keys is None else keys + values

    def _set_state_tensors(self, tensors) -> None:
        self.state = (tuple(tensors[:3]), tuple(tensors[3:]))

    def _stored_length(self) -> int:
        keys = self.state[0]
        return 0 if keys is None else keys[0].shape[2]

    def layout(self) -> dict | None:
        if self.keys is None:
            return None
        (k_packed, k_scales, _), (v_packed, _, _) = self.keys, self.values
        return {"batch": k_packed.shape[0], "n_kv_heads": k_packed.shape[1],
                "head_dim": quantization.quantized_head_dim(k_packed, self.bits),
                "value_dim": quantization.quantized_head_dim(v_packed, self.bits), "dtype": k_scales.dtype}

    @_Cache.meta_state.setter
    def meta_state(self, value):
        meta = _check_meta(value, self.META_FIELDS)
        step = check_int("meta_state['step']", meta["step"], minimum=1, maximum=MAX_STEP)
        group_size, bits = quantization.check_quantization(meta["group_size"], meta["bits"])
        if self.keys is not None and (group_size, bits) != (self.group_size, self.bits):
            raise ValueError(
                f"meta_state group_size={group_size}, bits={bits} contradict the stored tensors, "
                f"quantized with group_size={self.group_size}, bits={self.bits}"
            )
        self._set_offset(meta["offset"])
        self.step, self.group_size, self.bits = step, group_size, bits


# ---------------------------------------------------------------- persistence
_CACHE_TYPES = {
    "ConcatKVCache": ConcatKVCache, "KVCache": KVCache, "RotatingKVCache": RotatingKVCache,
    "QuantizedKVCache": QuantizedKVCache,
}
# every tensor name a layer may store, over all cache types
_ALL_STATE_TENSORS = tuple(dict.fromkeys(name for cls in _CACHE_TYPES.values() for name in cls.STATE_TENSORS))
_META_KEY = "mlx_attn.caches"
_SUFFIX = ".safetensors"
# bytes per element of the safetensors dtypes
_SAFETENSORS_ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8, "C64": 8,
}
_MAX_HEADER_BYTES = 100 * 2**20


def _cache_file(path) -> str:
    """The file a cache lives in: ``path`` with ``.safetensors`` appended
    unless it already ends so (the rule of ``mx.save_safetensors``)."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    path = os.fspath(path)
    if not isinstance(path, str) or not path:
        raise ValueError(f"path must be a non-empty str path, got {path!r}")
    return path if path.endswith(_SUFFIX) else path + _SUFFIX


def save_cache(path: str | os.PathLike, caches: list, metadata: dict[str, str] | None = None) -> None:
    """Save a list of caches (one per layer) to a safetensors file.

    ``path`` gets ``.safetensors`` appended unless it ends so, exactly as
    :func:`mlx.core.save_safetensors` does; :func:`load_cache` accepts the
    same ``path``. ``metadata``: extra ``str -> str`` entries."""
    file = _cache_file(path)
    if not isinstance(caches, (list, tuple)):
        raise ValueError(f"caches must be a list of caches (one per layer), got {type(caches).__name__}")
    if metadata is not None and not isinstance(metadata, dict):
        raise ValueError(f"metadata must be a dict of str -> str, got {type(metadata).__name__}")
    meta = dict(metadata or {})
    for key, value in meta.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise ValueError(f"metadata must map str to str, got {key!r}: {value!r}")
    if _META_KEY in meta:
        raise ValueError(f"metadata key {_META_KEY!r} is reserved for the cache description")
    arrays, described = {}, []
    for i, cache in enumerate(caches):
        name = type(cache).__name__
        if _CACHE_TYPES.get(name) is not type(cache):
            raise ValueError(f"cannot save caches[{i}] of type {name}; supported: {', '.join(_CACHE_TYPES)}")
        tensors = cache._state_tensors()
        if tensors is not None:
            arrays.update({f"{i}.{part}": a for part, a in zip(cache.STATE_TENSORS, tensors)})
        described.append({"type": name, "meta": cache.meta_state, "empty": tensors is None})
    meta[_META_KEY] = json.dumps(described)
    try:
        mx.save_safetensors(file, arrays, metadata=meta)
    except (RuntimeError, OSError) as error:
        raise ValueError(f"cannot write the cache file {file}: {error}") from error


def _read_safetensors_header(file: str) -> tuple[dict, dict]:
    """The tensor table and metadata of a safetensors file, every extent
    checked against the file size (so MLX's reader only sees sound files).
    Messages leave out the file name: the caller adds it."""
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{size} bytes, shorter than the header size field")
        header_len = int.from_bytes(prefix, "little")
        if header_len > min(size - 8, _MAX_HEADER_BYTES):
            raise ValueError(f"header length {header_len} does not fit the {size}-byte file")
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as error:
        raise ValueError(f"the safetensors header is not valid JSON: {error}") from error
    if not isinstance(header, dict):
        raise ValueError("the safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError("__metadata__ must map str to str")
    data_size = size - 8 - header_len
    for name, entry in header.items():
        where = f"tensor {name!r}"
        if not isinstance(entry, dict) or entry.get("dtype") not in _SAFETENSORS_ITEMSIZE:
            raise ValueError(f"{where} has no known dtype")
        shape, extent = entry.get("shape"), entry.get("data_offsets")
        if not isinstance(shape, list) or not all(type(d) is int and 0 <= d <= MAX_DIM for d in shape):
            raise ValueError(f"{where} has an invalid shape {shape!r}")
        if not (isinstance(extent, list) and len(extent) == 2 and all(type(o) is int for o in extent)):
            raise ValueError(f"{where} has invalid data_offsets {extent!r}")
        begin, end = extent
        if not 0 <= begin <= end <= data_size:
            raise ValueError(f"{where}: data_offsets {extent} exceed the {data_size} data bytes (truncated file?)")
        if end - begin != math.prod(shape) * _SAFETENSORS_ITEMSIZE[entry["dtype"]]:
            raise ValueError(f"{where}: {end - begin} bytes do not hold shape {shape} of {entry['dtype']}")
    return header, metadata


def _check_expected(expected, given: dict) -> dict:
    """Merge the ``expected`` dict with the keyword arguments, each checked."""
    if expected is not None and not isinstance(expected, dict):
        raise ValueError(f"expected must be a dict, got {type(expected).__name__}")
    wanted = dict(given)
    for key, value in (expected or {}).items():
        if key not in _EXPECTABLE:
            raise ValueError(f"unknown key {key!r} in expected; use {', '.join(_EXPECTABLE)}")
        if wanted[key] is not None and wanted[key] != value:
            raise ValueError(f"expected[{key!r}]={value} contradicts {key}={wanted[key]}")
        wanted[key] = value
    for key, value in wanted.items():
        if value is None:
            continue
        if key == "dtype":
            if not isinstance(value, mx.Dtype):
                raise ValueError(f"expected dtype must be an mlx dtype, got {value!r}")
        else:
            check_int(key, value, minimum=0 if key == "n_layers" else 1)
    return wanted


def _load_layer(file: str, i: int, entry, arrays: dict):
    """One cache from its description and tensors; ValueError naming the field."""
    if not isinstance(entry, dict) or set(entry) != {"type", "meta", "empty"}:
        raise ValueError("the description must have exactly the fields type, meta, empty")
    cls = _CACHE_TYPES.get(entry["type"]) if isinstance(entry["type"], str) else None
    if cls is None:
        raise ValueError(f"type {entry['type']!r} is not one of {', '.join(_CACHE_TYPES)}")
    info = _check_meta(entry["meta"], cls.META_FIELDS)
    if cls is RotatingKVCache:
        cache = cls(info["max_size"], info["keep"], info["step"])
    elif cls is KVCache:
        cache = cls(info["step"])
    elif cls is QuantizedKVCache:
        cache = cls(info["group_size"], info["bits"], info["step"])
    else:
        cache = cls()
    stored = [part for part in _ALL_STATE_TENSORS if f"{i}.{part}" in arrays]
    foreign = [part for part in stored if part not in cls.STATE_TENSORS]
    if foreign:
        raise ValueError(f"a {entry['type']} does not store {', '.join(foreign)}")
    if stored and len(stored) != len(cls.STATE_TENSORS):
        missing = [part for part in cls.STATE_TENSORS if part not in stored]
        raise ValueError(f"{', '.join(stored)} stored without {', '.join(missing)}")
    empty = entry["empty"]
    if not isinstance(empty, bool) or empty == bool(stored):
        raise ValueError(f"empty={empty!r} contradicts the tensors stored for it")
    if not empty:
        cache._set_state_tensors(tuple(arrays[f"{i}.{part}"] for part in cls.STATE_TENSORS))
    cache.meta_state = info
    return cache


def _check_layer_shapes(cache, expected: dict, batch_seen: int | None) -> int | None:
    got = cache.layout()
    if got is None:
        return batch_seen
    for name, value in got.items():
        if expected[name] is not None and expected[name] != value:
            raise ValueError(f"has {name}={value} ({got}), expected {expected[name]}")
    if batch_seen is not None and got["batch"] != batch_seen:
        raise ValueError(f"has batch={got['batch']}, an earlier layer batch={batch_seen}")
    return got["batch"]


_EXPECTABLE = ("n_layers", "n_kv_heads", "head_dim", "batch", "value_dim", "dtype")


def load_cache(
    path: str | os.PathLike,
    expected: dict | None = None,
    *,
    n_layers: int | None = None,
    n_kv_heads: int | None = None,
    head_dim: int | None = None,
    batch: int | None = None,
) -> tuple[list, dict[str, str]]:
    """Load caches saved by :func:`save_cache`; returns ``(caches, metadata)``.

    ``path`` is what was given to :func:`save_cache` (``.safetensors`` is
    appended unless it ends so). Pass the model's ``n_layers`` /
    ``n_kv_heads`` / ``head_dim`` (and the ``batch`` size), as keywords or in
    an ``expected`` dict (which also takes ``value_dim`` and ``dtype``), to
    have a cache made for another model rejected with a ``ValueError``.
    Damaged, truncated or foreign files raise ``ValueError`` naming the file
    and the field; a missing one ``FileNotFoundError``.
    """
    given = dict(n_layers=n_layers, n_kv_heads=n_kv_heads, head_dim=head_dim, batch=batch,
                 value_dim=None, dtype=None)
    wanted = _check_expected(expected, given)
    file = _cache_file(path)
    if not os.path.exists(file):
        raise FileNotFoundError(f"no cache file at {file}")
    if not os.path.isfile(file):
        raise ValueError(f"{file} is not a file")
    unreadable = f"{file} is not a readable mlx_attn cache file"
    try:
        header, meta = _read_safetensors_header(file)
    except ValueError as error:
        raise ValueError(f"{unreadable}: {error}") from error
    if _META_KEY not in meta:
        raise ValueError(f"{unreadable}: no {_META_KEY!r} metadata")
    try:
        described = json.loads(meta.pop(_META_KEY))
    except (ValueError, RecursionError) as error:
        raise ValueError(f"{file}: metadata {_META_KEY!r} is not valid JSON: {error}") from error
    if not isinstance(described, list):
        raise ValueError(f"{file}: metadata {_META_KEY!r} must be a list of layer descriptions")
    if wanted["n_layers"] is not None and len(described) != wanted["n_layers"]:
        raise ValueError(f"{file} holds caches for {len(described)} layers, expected {wanted['n_layers']}")
    names = {f"{i}.{part}" for i in range(len(described)) for part in _ALL_STATE_TENSORS}
    foreign = sorted(set(header) - names)
    if foreign:
        raise ValueError(f"{file} holds tensors that are not cache layers: {foreign[:5]}")
    try:
        arrays = mx.load(file, format="safetensors")
    except Exception as error:  # MLX's reader: anything it refuses is a bad file
        raise ValueError(f"{unreadable}: {error}") from error
    caches, batch_seen = [], None
    for i, entry in enumerate(described):
        try:
            cache = _load_layer(file, i, entry, arrays)
            batch_seen = _check_layer_shapes(cache, wanted, batch_seen)
        except ValueError as error:
            raise ValueError(f"layer {i} of {file}: {error}") from error
        caches.append(cache)
    return caches, meta


# ---------------------------------------------------------------- memory
def kv_cache_bytes_per_token(
    n_layers: int, n_kv_heads: int, head_dim: int, dtype=mx.float16, batch: int = 1,
    *, bits: int | None = None, group_size: int = 64,
) -> int:
    """Bytes one token adds to the cache: keys and values of every layer.

    With ``bits`` (4 or 8) the cache is a :class:`QuantizedKVCache`: per
    feature ``bits / 8`` bytes, plus a scale and a bias in ``dtype`` per
    ``group_size`` features."""
    for name, value in (("n_layers", n_layers), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim), ("batch", batch)):
        check_int(name, value, minimum=1, maximum=None)
    if not isinstance(dtype, mx.Dtype):
        raise ValueError(f"dtype must be an mlx dtype, got {dtype!r}")
    if bits is None:
        per_head_vector = head_dim * dtype.size
    else:
        group_size, bits = quantization.check_quantization(group_size, bits)
        quantization.check_quantizable_dim("head_dim", head_dim, group_size)
        per_head_vector = head_dim * bits // 8 + 2 * (head_dim // group_size) * dtype.size
    return 2 * n_layers * n_kv_heads * per_head_vector * batch


def kv_cache_bytes(
    n_layers: int, n_kv_heads: int, head_dim: int, context: int, dtype=mx.float16, batch: int = 1,
    *, bits: int | None = None, group_size: int = 64,
) -> int:
    """Bytes of a cache holding ``context`` tokens (quantized with ``bits``)."""
    check_int("context", context, minimum=0, maximum=None)
    per_token = kv_cache_bytes_per_token(n_layers, n_kv_heads, head_dim, dtype, batch, bits=bits, group_size=group_size)
    return per_token * context
