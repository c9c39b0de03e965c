"""The paged reference path: each sequence's pages gathered into contiguous
K/V (dequantized for quantized pages), then
:func:`mlx_attn.reference.reference_attention` on its query rows. The
ground truth :mod:`mlx_attn.paged` falls back to and the paged self-check
(:mod:`mlx_attn.self_check`) compares the Metal kernels with; it takes a
checked call (:func:`mlx_attn.core.paged_layout.check_paged_layout`) with
every array in one dtype."""

from __future__ import annotations

import mlx.core as mx

from mlx_attn.core.paged_layout import PagedLayout
from mlx_attn.core.quantization import dequantize
from mlx_attn.reference import reference_attention

__all__ = ["gather_pages", "paged_reference_attention"]


def gather_pages(pages: mx.array, page_ids, length: int) -> mx.array:
    """The ``[Hkv, length, D]`` contiguous keys (or values) of one sequence:
    its pages ``page_ids`` (in key order) joined along the token axis."""
    if length == 0:
        return mx.zeros((pages.shape[1], 0, pages.shape[3]), dtype=pages.dtype)
    taken = pages[mx.array(page_ids, dtype=mx.int32)]  # [n, Hkv, P, D]
    joined = mx.flatten(taken.swapaxes(0, 1), 1, 2)  # [Hkv, n * P, D]
    return joined[:, :length]


def paged_reference_attention(q, k_parts, v_parts, layout: PagedLayout, *, scale, causal, window_size, sinks,
                              return_lse, softcap=None, bits=0, group_size=0) -> list[mx.array]:
    """``[out]`` or ``[out, lse]`` of a checked paged call. ``k_parts`` /
    ``v_parts``: ``(pages,)``, or the ``(packed, scales, biases)`` triples
    of quantized pages (``bits`` > 0)."""

    def fetch(b):
        pages, length = layout.pages[b], layout.kv_lens[b]
        if not bits:
            return gather_pages(k_parts[0], pages, length), gather_pages(v_parts[0], pages, length)
        return tuple(
            dequantize(tuple(gather_pages(part, pages, length) for part in parts), group_size, bits).astype(q.dtype)
            for parts in (k_parts, v_parts))

    return _attend(q, layout, fetch, scale, causal, window_size, sinks, return_lse, softcap)


def _attend(q, layout: PagedLayout, fetch, scale, causal, window_size, sinks, return_lse, softcap=None):
    """Per sequence, fetch its contiguous K/V and run the reference SDPA on
    its query rows. ``fetch(b) -> (k, v)``, ``[Hkv, T, D]``."""
    outs, lses = [], []
    start = 0
    for b, (q_len, kv_len) in enumerate(zip(layout.q_lens, layout.kv_lens)):
        if q_len == 0:
            continue
        k, v = fetch(b)
        rows = q[start : start + q_len].swapaxes(0, 1)[None]  # [1, Hq, q_len, D]
        start += q_len
        result = reference_attention(
            rows, k[None], v[None], scale=scale, mask="causal" if causal else None, sinks=sinks,
            window_size=window_size, return_lse=return_lse, softcap=softcap,
        )
        out, lse = result if return_lse else (result, None)
        outs.append(out[0].swapaxes(0, 1))  # [q_len, Hq, Dv]
        if return_lse:
            lses.append(lse[0].swapaxes(0, 1))  # [q_len, Hq]
    if not outs:
        out = mx.zeros((0, layout.heads, layout.value_dim), dtype=q.dtype)
        lse = mx.zeros((0, layout.heads), dtype=mx.float32)
    else:
        out = mx.concatenate(outs) if len(outs) > 1 else outs[0]
        lse = (mx.concatenate(lses) if len(lses) > 1 else lses[0]) if return_lse else None
    return [out, lse] if return_lse else [out]
