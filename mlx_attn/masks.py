"""Attention masks.

Two forms, both accepted by :func:`mlx_attn.scaled_dot_product_attention`:

- **boolean**: True where a query may attend to a key;
- **additive**: added to the scores, 0 where allowed and ``-inf`` where not.

Shapes broadcast to ``[B, H, Tq, Tkv]``. A query row that may see no key gets
zeros from the attention (never NaN), which is what padded query rows need.

Additive masks hold finite values or ``-inf``; NaN and ``+inf`` would turn
scores into NaN and are rejected. Every builder raises ``ValueError`` naming
the bad argument, and refuses results larger than ``MAX_ELEMENTS`` before
allocating them.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlx_attn.core.checks import (
    MAX_DIM,
    check_array,
    check_elements,
    check_int,
    check_mask_dtype,
    check_optional_int,
)
from mlx_attn.reference import causal_visibility

__all__ = [
    "causal_mask",
    "sliding_window_mask",
    "padding_mask",
    "query_key_padding_mask",
    "combine_masks",
    "bool_to_additive",
    "additive_to_bool",
    "check_additive_values",
]


def check_additive_values(name: str, mask: mx.array) -> None:
    """An additive mask may hold finite values and ``-inf``, never NaN or
    ``+inf`` (both make the scores NaN). Evaluates the mask."""
    if mask.dtype == mx.bool_:
        return
    if mx.any(mx.isnan(mask) | mx.isposinf(mask)).item():
        raise ValueError(f"{name} is an additive mask with NaN or +inf values; use finite values or -inf")


def _as_dtype(visible: mx.array, dtype) -> mx.array:
    if dtype == mx.bool_:
        return visible
    return bool_to_additive(visible, dtype)


def causal_mask(
    q_len: int,
    kv_len: int | None = None,
    *,
    offset: int | None = None,
    window_size: int | None = None,
    dtype: mx.Dtype = mx.bool_,
) -> mx.array:
    """``[q_len, kv_len]`` causal mask.

    Query ``i`` sits at absolute position ``offset + i`` and sees keys
    ``0 .. offset + i`` (with ``window_size``: only the last ``window_size``
    of them). ``offset`` defaults to ``kv_len - q_len`` (lower-right aligned,
    the cached-decoding case: the new queries are the last positions);
    ``kv_len`` defaults to ``offset + q_len``. ``dtype`` bool gives a boolean
    mask, a float dtype an additive one.
    """
    q_len = check_int("q_len", q_len, minimum=0)
    kv_len = check_optional_int("kv_len", kv_len, minimum=0)
    offset = check_optional_int("offset", offset, minimum=0, maximum=MAX_DIM - q_len)
    window_size = check_optional_int("window_size", window_size, minimum=1)
    check_mask_dtype("dtype", dtype)
    if kv_len is None:
        kv_len = check_int("kv_len (q_len + offset)", q_len + (offset or 0))
    check_elements("the causal mask", (q_len, kv_len))
    if offset is None or offset == kv_len - q_len:
        visible = causal_visibility(q_len, kv_len, window_size)
    else:
        positions = mx.arange(q_len)[:, None] + offset
        keys = mx.arange(kv_len)[None, :]
        visible = keys <= positions
        if window_size is not None:
            visible = visible & (keys > positions - window_size)
    return _as_dtype(visible, dtype)


def sliding_window_mask(
    q_len: int,
    window_size: int,
    kv_len: int | None = None,
    *,
    offset: int | None = None,
    dtype: mx.Dtype = mx.bool_,
) -> mx.array:
    """Causal mask where each query sees at most ``window_size`` most recent
    keys, itself included (see :func:`causal_mask`)."""
    check_int("window_size", window_size, minimum=1)
    return causal_mask(q_len, kv_len, offset=offset, window_size=window_size, dtype=dtype)


def _lengths_array(lengths, max_len: int | None, rows_per_length: bool) -> tuple[mx.array, int]:
    """Checked ``lengths`` (int32) and ``max_len``; refuses masks too large
    to build (``rows_per_length``: the mask is ``max_len`` x ``max_len``)."""
    max_len = check_optional_int("max_len", max_len, minimum=0)
    try:
        values = np.asarray(lengths)
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"lengths must be a 1-D sequence of integers: {error}") from error
    if values.ndim != 1:
        raise ValueError(f"lengths must be a 1-D sequence of lengths, got shape {values.shape}")
    if values.size and values.dtype.kind not in "iu":
        raise ValueError(f"lengths must be integers, got dtype {values.dtype}")
    if values.size and values.min() < 0:
        raise ValueError(f"lengths must be >= 0, got {values.min()}")
    longest = int(values.max()) if values.size else 0
    if max_len is None:
        max_len = check_int("max_len (the longest length)", longest)
    elif longest > max_len:
        raise ValueError(f"a length ({longest}) exceeds max_len ({max_len})")
    rows = max_len if rows_per_length else 1
    check_elements("the padding mask", (values.size, rows, max_len))
    return mx.array(values.astype(np.int32)), max_len


def padding_mask(lengths, max_len: int | None = None, *, dtype: mx.Dtype = mx.bool_) -> mx.array:
    """Key-padding mask ``[B, 1, 1, max_len]`` from per-sequence lengths:
    True (or 0) for the first ``lengths[b]`` keys of batch element ``b``."""
    check_mask_dtype("dtype", dtype)
    lengths, max_len = _lengths_array(lengths, max_len, rows_per_length=False)
    valid = mx.arange(max_len)[None, :] < lengths[:, None]
    return _as_dtype(valid[:, None, None, :], dtype)


def query_key_padding_mask(lengths, max_len: int | None = None, *, dtype: mx.Dtype = mx.bool_) -> mx.array:
    """``[B, 1, max_len, max_len]``: real queries see real keys; padded query
    rows see nothing, so attention returns zeros for them."""
    check_mask_dtype("dtype", dtype)
    lengths, max_len = _lengths_array(lengths, max_len, rows_per_length=True)
    valid = mx.arange(max_len)[None, :] < lengths[:, None]
    both = valid[:, None, :, None] & valid[:, None, None, :]
    return _as_dtype(both, dtype)


def bool_to_additive(mask: mx.array, dtype: mx.Dtype = mx.float32) -> mx.array:
    """True -> 0, False -> -inf."""
    check_array("mask", mask)
    if mask.dtype != mx.bool_:
        raise ValueError(f"mask: expected a boolean mask, got {mask.dtype}")
    if check_mask_dtype("dtype", dtype) == mx.bool_:
        raise ValueError(f"dtype: an additive mask needs a floating dtype, got {dtype}")
    return mx.where(mask, mx.array(0.0, dtype), mx.array(-mx.inf, dtype))


def additive_to_bool(mask: mx.array) -> mx.array:
    """A key is visible where the additive mask is not ``-inf``.

    Finite penalties have no boolean form: they are dropped (treated as
    visible), so only masks of 0 / ``-inf`` convert losslessly. NaN or
    ``+inf`` entries are rejected."""
    check_array("mask", mask)
    if not mx.issubdtype(mask.dtype, mx.floating):
        raise ValueError(f"mask: expected an additive (floating) mask, got {mask.dtype}")
    check_additive_values("mask", mask)
    return mask > -mx.inf


def combine_masks(*masks: mx.array | None) -> mx.array | None:
    """Combine masks so a key is visible only where every mask allows it.

    Booleans are ANDed; if any mask is additive the result is additive (the
    sum, with booleans converted). ``None`` entries are ignored; all ``None``
    gives ``None``. Shapes broadcast.
    """
    for i, m in enumerate(masks):
        if m is not None and not isinstance(m, mx.array):
            raise ValueError(f"combine_masks takes arrays or None, got {type(m).__name__} for mask {i}")
        if m is not None:
            check_mask_dtype(f"mask {i} dtype", m.dtype)
    present = [m for m in masks if m is not None]
    if not present:
        return None
    try:
        shape = mx.broadcast_shapes(*[m.shape for m in present])
    except ValueError as error:
        raise ValueError(f"combine_masks: the mask shapes do not broadcast: {error}") from error
    check_elements("the combined mask", shape)
    for i, m in enumerate(masks):  # values last: this evaluates the masks
        if m is not None:
            check_additive_values(f"mask {i}", m)
    masks = present
    if all(m.dtype == mx.bool_ for m in masks):
        out = masks[0]
        for m in masks[1:]:
            out = out & m
        return out
    dtype = mx.result_type(*[m.dtype for m in masks if m.dtype != mx.bool_])
    out = None
    for m in masks:
        term = bool_to_additive(m, dtype) if m.dtype == mx.bool_ else m.astype(dtype)
        out = term if out is None else out + term
    return out
