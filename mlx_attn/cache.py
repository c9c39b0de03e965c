"""Key/value caches for incremental decoding (interface compatible with mlx-lm).

Every cache stores keys and values in the ``[B, n_kv_heads, T, head_dim]``
layout and offers ``update_and_fetch(keys, values) -> (keys, values)``,
``offset`` (tokens seen so far), ``state`` (get/set), ``trim(n)``,
``is_trimmable()``, ``nbytes`` and ``make_mask(q_len)`` (the mask the attention
call needs after an update).

- :class:`ConcatKVCache`: the textbook version, concatenating on every step.
- :class:`KVCache`: preallocates in steps and returns slices of its buffers,
  views the fused kernel reads through their strides without a copy.
- :class:`RotatingKVCache`: a ring buffer of ``max_size`` slots that always
  keeps the first ``keep`` tokens (sliding-window attention).

:func:`save_cache` / :func:`load_cache` store caches in a safetensors file
(prompt caching); :func:`kv_cache_bytes` computes what a cache costs.
"""

from __future__ import annotations

import json
import os

import mlx.core as mx

__all__ = [
    "ConcatKVCache",
    "KVCache",
    "RotatingKVCache",
    "save_cache",
    "load_cache",
    "kv_cache_bytes",
    "kv_cache_bytes_per_token",
]


def _check_update(keys: mx.array, values: mx.array, stored: mx.array | None):
    if keys.ndim != 4 or values.ndim != 4:
        raise ValueError(
            f"keys and values must be [B, n_kv_heads, T, head_dim], got {keys.shape} and {values.shape}"
        )
    if keys.shape[:3] != values.shape[:3]:
        raise ValueError(f"keys {keys.shape} and values {values.shape} disagree on [B, heads, T]")
    if stored is not None and (keys.shape[:2] != stored.shape[:2] or keys.shape[3] != stored.shape[3]):
        raise ValueError(
            f"new keys {keys.shape} do not match the cached ones {stored.shape} (batch, heads or head_dim)"
        )


def _extend(stored: mx.array | None, like: mx.array, extra: int) -> mx.array:
    """`stored` followed by `extra` zero slots along the time axis."""
    b, h, _, d = like.shape
    zeros = mx.zeros((b, h, extra, d), dtype=like.dtype)
    return zeros if stored is None else mx.concatenate([stored, zeros], axis=2)


class _Cache:
    keys: mx.array | None
    values: mx.array | None
    offset: int

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

    def make_mask(self, q_len: int):
        """Mask for the attention of the ``q_len`` newest queries against the
        keys returned by the last update: plain lower-right causal."""
        return "causal" if q_len > 1 else None

    def is_trimmable(self) -> bool:
        return True

    @property
    def meta_state(self) -> dict:
        return {"offset": self.offset}


class ConcatKVCache(_Cache):
    """Appends by concatenation: simple, and every step copies the whole cache."""

    def __init__(self):
        self.keys = None
        self.values = None
        self.offset = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        _check_update(keys, values, self.keys)
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = mx.concatenate([self.keys, keys], axis=2)
            self.values = mx.concatenate([self.values, values], axis=2)
        self.offset += keys.shape[2]
        return self.keys, self.values

    @_Cache.state.setter
    def state(self, value):
        self.keys, self.values = value
        self.offset = self.keys.shape[2]

    def trim(self, n: int) -> int:
        n = min(self.offset, max(0, n))
        if n and self.keys is not None:
            self.offset -= n
            self.keys = self.keys[..., : self.offset, :]
            self.values = self.values[..., : self.offset, :]
        return n


class KVCache(_Cache):
    """Preallocated in chunks of ``step`` tokens; returns ``[:, :, :offset]``
    slices of its buffers (no copy)."""

    def __init__(self, step: int = 256):
        if step < 1:
            raise ValueError(f"step must be >= 1, got {step}")
        self.step = step
        self.keys = None
        self.values = None
        self.offset = 0

    def _grow(self, keys: mx.array, values: mx.array):
        """Reallocate to the next multiple of `step` that fits the update."""
        needed = self.offset + keys.shape[2]
        capacity = (needed + self.step - 1) // self.step * self.step
        used = (None, None) if self.keys is None else (self.keys[..., : self.offset, :], self.values[..., : self.offset, :])
        self.keys = _extend(used[0], keys, capacity - self.offset)
        self.values = _extend(used[1], values, capacity - self.offset)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        _check_update(keys, values, self.keys)
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
        self.keys, self.values = value
        self.offset = self.keys.shape[2]

    def trim(self, n: int) -> int:
        n = min(self.offset, max(0, n))
        self.offset -= n
        return n

    @property
    def meta_state(self) -> dict:
        return {"offset": self.offset, "step": self.step}


class RotatingKVCache(_Cache):
    """A sliding window of ``max_size`` tokens that always keeps the first
    ``keep`` ones: a query at position ``p`` sees tokens ``0 .. keep-1`` and
    the ``max_size - keep`` most recent tokens up to ``p``.

    Single-token updates write into a ring buffer in place. A multi-token
    update (prefill in chunks) returns the stored window followed by the new
    tokens in temporal order, and :meth:`make_mask` gives the band mask that
    keeps each new query within its own window.
    """

    def __init__(self, max_size: int, keep: int = 0, step: int = 256):
        if max_size < 1:
            raise ValueError(f"max_size must be >= 1, got {max_size}")
        if not 0 <= keep < max_size:
            raise ValueError(f"keep must be in [0, max_size), got keep={keep}, max_size={max_size}")
        if step < 1:
            raise ValueError(f"step must be >= 1, got {step}")
        self.max_size = max_size
        self.keep = keep
        self.step = step
        self.keys = None
        self.values = None
        self.offset = 0
        self._idx = 0  # next slot to write; == buffer length when in temporal order

    # -- helpers ------------------------------------------------------------
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
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        _check_update(keys, values, self.keys)
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
        if self._idx == self.max_size:  # full: overwrite the oldest non-kept slot
            self._idx = self.keep
        self.keys[..., self._idx : self._idx + 1, :] = keys
        self.values[..., self._idx : self._idx + 1, :] = values
        self._idx += 1
        self.offset += 1
        if self.offset < self.keys.shape[2]:
            return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]
        return self.keys, self.values

    def make_mask(self, q_len: int):
        """After a multi-token update: a boolean ``[q_len, L]`` band mask for
        the returned keys; after a single token: None (every stored token is
        inside the window)."""
        if q_len == 1:
            return None
        length = self.keys.shape[2]
        j = mx.arange(length)
        key_pos = mx.where(j < self.keep, j, self.offset - length + j)
        query_pos = mx.arange(self.offset - q_len, self.offset)[:, None]
        recent = self.max_size - self.keep
        visible = (key_pos[None, :] <= query_pos) & (
            (key_pos[None, :] < self.keep) | (key_pos[None, :] > query_pos - recent)
        )
        return visible

    # -- state --------------------------------------------------------------
    @_Cache.state.setter
    def state(self, value):
        self.keys, self.values = value

    @property
    def meta_state(self) -> dict:
        return {
            "offset": self.offset,
            "max_size": self.max_size,
            "keep": self.keep,
            "step": self.step,
            "idx": self._idx,
        }

    def is_trimmable(self) -> bool:
        return self.offset < self.max_size

    def trim(self, n: int) -> int:
        """Only possible before the window has started to slide."""
        if not self.is_trimmable():
            return 0
        n = min(self.offset, max(0, n))
        self.offset -= n
        self._idx -= n
        return n


# ---------------------------------------------------------------- persistence
_CACHE_TYPES = {"ConcatKVCache": ConcatKVCache, "KVCache": KVCache, "RotatingKVCache": RotatingKVCache}
_META_KEY = "mlx_attn.caches"


def save_cache(path: str | os.PathLike, caches: list, metadata: dict[str, str] | None = None) -> None:
    """Save a list of caches (one per layer) to a safetensors file."""
    arrays, described = {}, []
    for i, cache in enumerate(caches):
        name = type(cache).__name__
        if name not in _CACHE_TYPES:
            raise ValueError(f"cannot save a cache of type {name}")
        keys, values = cache.state
        if keys is not None:
            arrays[f"{i}.keys"] = keys
            arrays[f"{i}.values"] = values
        described.append({"type": name, "meta": cache.meta_state, "empty": keys is None})
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    meta[_META_KEY] = json.dumps(described)
    mx.save_safetensors(str(path), arrays, metadata=meta)


_EXPECTABLE = ("n_layers", "n_kv_heads", "head_dim", "batch")


def load_cache(
    path: str | os.PathLike,
    expected: dict[str, int] | None = None,
    *,
    n_layers: int | None = None,
    n_kv_heads: int | None = None,
    head_dim: int | None = None,
    batch: int | None = None,
) -> tuple[list, dict[str, str]]:
    """Load caches saved by :func:`save_cache`; returns ``(caches, metadata)``.

    Pass the model's ``n_layers`` / ``n_kv_heads`` / ``head_dim`` (and the
    ``batch`` size), as keywords or as an ``expected`` dict with those keys, to
    have a cache made for another model rejected with a ``ValueError``.
    """
    wanted = dict(n_layers=n_layers, n_kv_heads=n_kv_heads, head_dim=head_dim, batch=batch)
    for key, value in (expected or {}).items():
        if key not in _EXPECTABLE:
            raise ValueError(f"unknown key {key!r} in expected; use {', '.join(_EXPECTABLE)}")
        if wanted[key] is not None and wanted[key] != value:
            raise ValueError(f"expected[{key!r}]={value} contradicts {key}={wanted[key]}")
        wanted[key] = value
    n_layers, n_kv_heads, head_dim, batch = (wanted[k] for k in _EXPECTABLE)
    path = str(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no cache file at {path}")
    try:
        arrays, meta = mx.load(path, return_metadata=True)
        described = json.loads(meta.pop(_META_KEY))
    except Exception as error:  # corrupted or not ours
        raise ValueError(f"{path} is not a readable mlx_attn cache file: {error}") from error
    if n_layers is not None and len(described) != n_layers:
        raise ValueError(f"{path} holds caches for {len(described)} layers, expected {n_layers}")
    caches = []
    for i, entry in enumerate(described):
        cls = _CACHE_TYPES[entry["type"]]
        info = entry["meta"]
        if cls is RotatingKVCache:
            cache = cls(info["max_size"], info["keep"], info["step"])
            cache._idx = info["idx"]
        elif cls is KVCache:
            cache = cls(info["step"])
        else:
            cache = cls()
        if not entry["empty"]:
            keys, values = arrays[f"{i}.keys"], arrays[f"{i}.values"]
            checks = (("batch", batch, keys.shape[0]), ("n_kv_heads", n_kv_heads, keys.shape[1]),
                      ("head_dim", head_dim, keys.shape[3]))
            for name, want, got in checks:
                if want is not None and want != got:
                    raise ValueError(
                        f"layer {i} of {path} has {name}={got} (keys {keys.shape}), expected {want}"
                    )
            if keys.shape[:3] != values.shape[:3]:
                raise ValueError(f"layer {i} of {path}: keys {keys.shape} and values {values.shape} disagree")
            cache.state = (keys, values)
        cache.offset = info["offset"]
        caches.append(cache)
    return caches, meta


# ---------------------------------------------------------------- memory
def kv_cache_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, dtype=mx.float16, batch: int = 1) -> int:
    """Bytes one token adds to the cache: keys and values of every layer."""
    for name, value in (("n_layers", n_layers), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim), ("batch", batch)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    return 2 * n_layers * n_kv_heads * head_dim * dtype.size * batch


def kv_cache_bytes(
    n_layers: int, n_kv_heads: int, head_dim: int, context: int, dtype=mx.float16, batch: int = 1
) -> int:
    """Bytes of a cache holding ``context`` tokens."""
    if context < 0:
        raise ValueError(f"context must be >= 0, got {context}")
    return kv_cache_bytes_per_token(n_layers, n_kv_heads, head_dim, dtype, batch) * context
