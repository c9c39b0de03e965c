"""The host-side layout of a paged attention call: the values of its
integer arguments (``block_table``, ``kv_lens``, ``q_lens``) checked against
the shapes of q and the pages, and what each sequence reads. Shared by
:mod:`mlx_attn.paged`, the paged reference path and the paged self-check."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlx_attn.core.attention_arguments import shape_text
from mlx_attn.core.checks import FLOAT_DTYPES
from mlx_attn.core.quantization import quantized_head_dim

__all__ = ["PagedLayout", "check_paged_layout", "check_float_array", "check_int32_values", "page_shape"]


@dataclass(frozen=True)
class PagedLayout:
    """The host-side facts of a checked call: per-sequence lengths and the
    block-table rows actually read (plain Python ints)."""

    q_lens: list[int]
    kv_lens: list[int]
    pages: Sequence[list[int]]  # the pages each sequence reads, in key order
    heads: int
    kv_heads: int
    page_size: int
    value_dim: int


def _check_rank(name: str, a, ndim: int, meaning: str) -> mx.array:
    if not isinstance(a, mx.array):
        raise ValueError(f"{name} must be an mlx.core.array, got {type(a).__name__}")
    if a.ndim != ndim:
        raise ValueError(f"{name} must have rank {ndim} {meaning}, got shape {shape_text(a)}")
    return a


def check_int32_values(name: str, a, ndim: int, meaning: str) -> np.ndarray:
    """The host values of ``a``, an int32 array of rank ``ndim`` (else a
    ValueError naming ``name``)."""
    _check_rank(name, a, ndim, meaning)
    if a.dtype != mx.int32:
        raise ValueError(f"{name} must be int32, got {a.dtype}")
    return np.asarray(a) if a.size else np.zeros(a.shape, np.int32)


def check_paged_layout(q, k_shape, v_shape, num_pages, block_table, kv_lens, q_lens, *,
                       checked_pages: Sequence[list[int]] | None = None) -> PagedLayout:
    """Shapes of q and the pages (given as 4-d shapes) and the values of the
    integer arguments, checked on the host. ``checked_pages``: the pages each
    sequence reads, already checked by the caller (the cascade, which checks
    its two tables and builds ``block_table`` from them), so not checked again."""
    total_q, heads, head_dim = q.shape
    _, kv_heads, page_size, k_dim = k_shape
    if k_shape[:3] != v_shape[:3]:
        raise ValueError(
            f"k_pages {k_shape} and v_pages {v_shape} must agree on [num_pages, kv_heads, page_size]"
        )
    if k_dim != head_dim:
        raise ValueError(f"q and k_pages need the same head dim: q {shape_text(q)}, k_pages {k_shape}")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(
            f"the number of query heads ({heads}) must be a multiple of the number of key/value heads "
            f"({kv_heads}) of k_pages"
        )
    if page_size == 0:
        raise ValueError(f"k_pages must have page_size >= 1, got shape {k_shape}")

    table = check_int32_values("block_table", block_table, 2, "[batch, max_pages]")
    batch, max_pages = table.shape
    kv = check_int32_values("kv_lens", kv_lens, 1, "[batch]")
    if kv.shape[0] != batch:
        raise ValueError(f"kv_lens must have shape [batch] = [{batch}] (block_table's rows), got {kv.shape}")
    if q_lens is None:
        ql = np.ones(batch, np.int32)
        what = "q_lens (None: one query row per sequence)"
    else:
        ql = check_int32_values("q_lens", q_lens, 1, "[batch]")
        what = "q_lens"
        if ql.shape[0] != batch:
            raise ValueError(f"q_lens must have shape [batch] = [{batch}] (block_table's rows), got {ql.shape}")
    if (kv < 0).any():
        raise ValueError(f"kv_lens must be >= 0, got {kv.tolist()}")
    if (ql < 0).any():
        raise ValueError(f"q_lens must be >= 0, got {ql.tolist()}")
    if (ql > kv).any():
        b = int(np.argmax(ql > kv))
        raise ValueError(
            f"{what} must not exceed kv_lens (a query row's own key is in the pages): "
            f"sequence {b} has q_lens {int(ql[b])} > kv_lens {int(kv[b])}"
        )
    if int(ql.sum()) != total_q:
        raise ValueError(f"q has {total_q} rows but {what} sums to {int(ql.sum())}")
    needed = (kv.astype(np.int64) + page_size - 1) // page_size
    if (needed > max_pages).any():
        b = int(np.argmax(needed > max_pages))
        raise ValueError(
            f"kv_lens[{b}] = {int(kv[b])} needs {int(needed[b])} pages of {page_size} keys but block_table "
            f"has only {max_pages} columns"
        )
    if checked_pages is not None:
        return PagedLayout(ql.tolist(), kv.tolist(), checked_pages, heads, kv_heads, page_size, v_shape[3])
    pages = []
    for b in range(batch):
        row = table[b, : needed[b]]
        bad = (row < 0) | (row >= num_pages)
        if bad.any():
            j = int(np.argmax(bad))
            raise ValueError(
                f"block_table[{b}, {j}] = {int(row[j])} is not a page index in [0, {num_pages}) "
                f"(sequence {b} reads {int(needed[b])} pages for kv_lens {int(kv[b])})"
            )
        pages.append(row.tolist())
    return PagedLayout(ql.tolist(), kv.tolist(), pages, heads, kv_heads, page_size, v_shape[3])


def check_float_array(name: str, a, ndim: int, meaning: str) -> mx.array:
    _check_rank(name, a, ndim, meaning)
    if a.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float16, bfloat16 or float32, got {a.dtype}")
    return a


def page_shape(pages: mx.array, bits: int = 0) -> tuple[int, int, int, int]:
    """``[num_pages, Hkv, page_size, D]`` of float pages (``bits`` 0) or of
    the packed words of quantized ones."""
    if not bits:
        return tuple(pages.shape)
    return (*pages.shape[:3], quantized_head_dim(pages, bits))
