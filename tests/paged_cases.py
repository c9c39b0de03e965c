"""Paged, ragged attention cases and their float64 oracle, shared by the
paged tests of every path (reference, fused CPU, Metal under the emulator):
random pages scattered in a pool with a block table, and attention computed
in NumPy from the table (not by the code under test)."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

# decode rows, a chunked-prefill chunk in the middle of a sequence, a whole
# prompt, lengths that page_size 4 does not divide
MIXED = [(1, 9), (5, 13), (1, 1), (7, 7), (1, 4)]


def oracle(q, k_pages, v_pages, table, kv_lens, q_lens, scale, causal=True, window=None, sinks=None, softcap=None):
    """float64 paged attention: per sequence, its keys gathered page by page
    (key j is slot j % P of page table[b][j // P]), logits of every row
    (capped as softcap * tanh(logit / softcap) with a softcap), visibility
    from positions kv_len - q_len + i, softmax with sinks."""
    q, k_pages, v_pages = (np.asarray(a, np.float64) for a in (q, k_pages, v_pages))
    heads, kv_heads, page_size = q.shape[1], k_pages.shape[1], k_pages.shape[2]
    group = heads // kv_heads
    out = np.zeros((q.shape[0], heads, v_pages.shape[3]))
    lse = np.full((q.shape[0], heads), -np.inf)
    row = 0
    for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        if q_len == 0:
            continue
        j = np.arange(kv_len)
        pages = np.asarray(table[b])[j // page_size]
        keys = k_pages[pages, :, j % page_size]  # [kv_len, Hkv, D]
        values = v_pages[pages, :, j % page_size]
        keys = np.repeat(keys, group, axis=1)  # [kv_len, Hq, D]
        values = np.repeat(values, group, axis=1)
        rows = q[row : row + q_len]  # [q_len, Hq, D]
        logits = scale * np.einsum("ihd,jhd->hij", rows, keys)
        if softcap is not None:
            logits = softcap * np.tanh(logits / softcap)
        position = kv_len - q_len + np.arange(q_len)[:, None]
        visible = np.ones((q_len, kv_len), bool)
        if causal:
            visible &= j[None, :] <= position
        if window is not None:
            visible &= j[None, :] > position - window
        logits = np.where(visible[None], logits, -np.inf)
        if sinks is not None:
            logits = np.concatenate([logits, np.broadcast_to(np.asarray(sinks, np.float64)[:, None, None],
                                                             (heads, q_len, 1))], axis=2)
        top = logits.max(axis=2, keepdims=True)
        seen = np.isfinite(top)
        weights = np.where(seen, np.exp(logits - np.where(seen, top, 0)), 0)
        total = weights.sum(axis=2, keepdims=True)
        attended = np.einsum("hij,jhd->ihd", weights[:, :, :kv_len], values)
        out[row : row + q_len] = np.where(total.transpose(1, 0, 2) > 0,
                                          attended / np.where(total > 0, total, 1).transpose(1, 0, 2), 0)
        with np.errstate(divide="ignore"):
            lse[row : row + q_len] = (top + np.log(total))[:, :, 0].T
        row += q_len
    return out, lse


def make_case(rng, seqs, *, heads=4, kv_heads=2, dim=16, value_dim=None, page_size=4, dtype=mx.float32,
              spare_pages=2, share=True):
    """Random pages scattered in a pool and a block table (padded with -1)
    for ``seqs = [(q_len, kv_len), ...]``; with ``share`` every sequence's
    first page is the first sequence's (a shared prefix page)."""
    value_dim = value_dim or dim
    q_lens = [s[0] for s in seqs]
    kv_lens = [s[1] for s in seqs]
    needed = [math.ceil(kv / page_size) for kv in kv_lens]
    num_pages = sum(needed) + spare_pages
    order = rng.permutation(num_pages).tolist()
    table = np.full((len(seqs), max(needed + [1])), -1, np.int32)
    for b, n in enumerate(needed):
        for j in range(n):
            table[b, j] = order.pop()
    if share and len(seqs) > 1 and needed[0]:
        for b in range(1, len(seqs)):
            if needed[b]:
                table[b, 0] = table[0, 0]
    as_dtype = lambda a: mx.array(a.astype(np.float32)).astype(dtype)  # noqa: E731
    q = as_dtype(rng.standard_normal((sum(q_lens), heads, dim)))
    k = as_dtype(rng.standard_normal((num_pages, kv_heads, page_size, dim)))
    v = as_dtype(rng.standard_normal((num_pages, kv_heads, page_size, value_dim)))
    ints = lambda a: mx.array(np.asarray(a, np.int32))  # noqa: E731
    return q, k, v, ints(table), ints(kv_lens), ints(q_lens), table, kv_lens, q_lens


def as64(a):
    return np.asarray(a.astype(mx.float32), np.float64)
