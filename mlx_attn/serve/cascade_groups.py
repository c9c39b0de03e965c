"""Which sequences of a step read their shared prefix once (cascade
attention, :func:`mlx_attn.paged.cascade_paged_attention`).

The prefix cache already says which sequences share keys: a shared page is
one page id in several block tables (:class:`~mlx_attn.serve.pages.PagePool`
hands out an indexed page by reference, and ``n`` > 1 choices of a request
hold their prompt's pages that way). So the groups come from the step's
block tables, by page id, without hashing a token: sequences whose tables
begin with the same pages form a group over those pages.

One sequence belongs to at most one group (the cascade has one shared
level). Where sequences agree on a few pages and some of them on many more
(a system prompt shared by all, a question shared by the ``n`` choices of
one request), :func:`shared_prefix_groups` picks the partition that saves
the most page reads: a group of ``s`` sequences over ``p`` shared keys
saves ``(s - 1) * p`` key reads per query row, and only groups whose saving
reaches the :class:`CascadeRule`'s threshold are kept (below it the cascade's
fixed costs outweigh the saved reads; docs/paged.md, "When the engine uses
it").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mlx_attn.core.checks import check_int

__all__ = ["CascadeRule", "SharedPrefixLevels", "shared_prefix_groups", "DEFAULT_CASCADE_RULE"]


@dataclass(frozen=True)
class CascadeRule:
    """When a group pays: ``(sequences - 1) * prefix_keys >= min_saved_keys``
    (the key reads per query row the shared pass saves), with at least two
    sequences and one full page shared; only sequences bringing at most
    ``max_query_rows`` rows to the step join a group (a prefill chunk's rows
    already share each page read in the paged kernel's tile)."""

    min_saved_keys: int
    max_query_rows: int = 1

    def __post_init__(self):
        for name in ("min_saved_keys", "max_query_rows"):
            check_int(name, getattr(self, name), minimum=1)

    def pays(self, sequences: int, prefix_keys: int) -> bool:
        return sequences >= 2 and prefix_keys > 0 and (sequences - 1) * prefix_keys >= self.min_saved_keys


# Measured on this project's CPU (docs/paged.md, "When the engine uses it"): a
# layer's cascade call (tables checked once per step, the C++ merge) breaks even
# with the paged op at about 100 to 200 saved key reads per row (2 sequences over
# 64 keys: 0.95x to 1.02x; 16 over 16: 0.94x to 1.02x; 2 over 256: 1.07x to 1.15x)
# for decode rows; 16 chunks of 30 rows over 4k keys: 0.8x, so decode rows only.
DEFAULT_CASCADE_RULE = CascadeRule(min_saved_keys=256, max_query_rows=1)


@dataclass(frozen=True)
class SharedPrefixLevels:
    """The two-level tables of :func:`mlx_attn.paged.cascade_paged_attention`
    (NumPy int32): ``prefix_table [G, max_prefix_pages]``, ``prefix_lens
    [G]``, ``prefix_groups [B]`` (-1: none), ``block_table [B, max_pages]``
    (each sequence's pages after its group's prefix, -1 padded)."""

    prefix_table: np.ndarray
    prefix_lens: np.ndarray
    prefix_groups: np.ndarray
    block_table: np.ndarray

    @property
    def num_groups(self) -> int:
        return int(self.prefix_lens.shape[0])


def _common_pages(table: np.ndarray, members: list[int], start: int, limit: np.ndarray) -> int:
    """How many leading pages all ``members`` share (they share ``start``)."""
    end = int(limit[members].min())
    if end <= start:
        return start
    block = table[members, start:end]
    same = (block == block[0]).all(axis=0)
    return start + (int(np.argmin(same)) if not same.all() else end - start)


def _best_partition(table, members, start, limit, page_size, rule) -> tuple[int, list[tuple[list[int], int]]]:
    """``(saved key reads, [(members, shared pages), ...])``, the best
    disjoint groups among ``members``, which share their first ``start``
    pages: all of them over their common pages, or the best of each subset
    that continues with one page (a trie over page ids)."""
    depth = _common_pages(table, members, start, limit)
    together = (len(members) - 1) * depth * page_size
    best = (together, [(members, depth)]) if rule.pays(len(members), depth * page_size) else (0, [])
    by_page: dict[int, list[int]] = {}
    for m in members:
        if limit[m] > depth:
            by_page.setdefault(int(table[m, depth]), []).append(m)
    saved, groups = 0, []
    for subset in by_page.values():
        if len(subset) >= 2:
            s, g = _best_partition(table, subset, depth + 1, limit, page_size, rule)
            saved, groups = saved + s, groups + g
    return (saved, groups) if saved > best[0] else best


def shared_prefix_groups(tables: Sequence[Sequence[int]], kv_lens: Sequence[int], page_size: int,
                         rule: CascadeRule, q_lens: Sequence[int] | None = None) -> SharedPrefixLevels | None:
    """The step's groups from its block tables (``tables[b]``: sequence
    ``b``'s pages, ``kv_lens[b]`` its keys, ``q_lens[b]`` its rows, None:
    one each), or None when no group pays. Only whole pages every member has
    computed are shared (a prefix ends at or before each member's last key)."""
    batch = len(tables)
    if batch < 2:
        return None
    width = max(len(t) for t in tables)
    table = np.full((batch, max(1, width)), -1, np.int64)
    for b, pages in enumerate(tables):
        table[b, : len(pages)] = pages
    limit = np.minimum([len(t) for t in tables], np.asarray(kv_lens, np.int64) // page_size)
    if q_lens is not None:  # sequences with more rows join no group
        limit = np.where(np.asarray(q_lens) > rule.max_query_rows, 0, limit)
    by_first: dict[int, list[int]] = {}
    for b in range(batch):
        if limit[b] > 0:
            by_first.setdefault(int(table[b, 0]), []).append(b)
    groups: list[tuple[list[int], int]] = []
    for members in by_first.values():
        if len(members) >= 2:
            groups += _best_partition(table, members, 1, limit, page_size, rule)[1]
    if not groups:
        return None
    prefix_groups = np.full(batch, -1, np.int32)
    prefix_table = np.full((len(groups), max(d for _, d in groups)), -1, np.int32)
    prefix_lens = np.zeros(len(groups), np.int32)
    lead = np.zeros(batch, np.int64)
    for g, (members, depth) in enumerate(groups):
        prefix_groups[members] = g
        prefix_table[g, :depth] = table[members[0], :depth]
        prefix_lens[g] = depth * page_size
        lead[members] = depth
    own_width = max(1, max(len(t) - int(lead[b]) for b, t in enumerate(tables)))
    block_table = np.full((batch, own_width), -1, np.int32)
    for b, pages in enumerate(tables):
        own = pages[int(lead[b]):]
        block_table[b, : len(own)] = own
    return SharedPrefixLevels(prefix_table, prefix_lens, prefix_groups, block_table)
