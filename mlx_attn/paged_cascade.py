"""Cascade (shared-prefix) paged attention: the host-side plan and the merge.

A group of sequences whose keys begin with the same pages (a shared system
prompt, ``n`` > 1 choices) attends in three passes of the ordinary fused
paged kernel, then merges:

- **prefix pass**: all the group's query rows, stacked, as the rows of one
  pseudo-sequence over the shared pages, not causal (every such row sits at or
  after the prefix's last key and its window covers key 0, so it sees the
  whole prefix). The kernel's tile is (kv head, block of rows x GQA group),
  so each prefix page is read once per tile of up to 128 rows instead of once
  per sequence;
- **suffix pass**: each sequence's rows over its own pages, causal and
  windowed as asked (bottom-right alignment over the own keys is the full
  causal rule restricted to them);
- **direct rows**: rows the prefix pass cannot take (causal rows inside the
  prefix, rows whose sliding window starts after key 0) are computed whole,
  over the sequence's full table (prefix pages then own pages), with sinks.
  The fused kernel skips the key blocks a window hides, so these cost what
  today's paged op costs for them.

Prefix and suffix partials merge by their log-sum-exp
(:func:`merge_splits`: :func:`mlx_attn.distributed.merge_partials`,
the split-K merge, over any number of partials); sinks
are left out of both passes and counted once, in the merge (a sink is a
partial with value zero and log-sum-exp ``sink``). Softcap applies to every
logit, so to both passes.

This module only plans (plain Python / NumPy on the host values already read
for validation) and merges; :mod:`mlx_attn.paged` runs the passes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from mlx_attn import _native
from mlx_attn.reference import LOGIT_LIMIT

__all__ = ["CascadePlan", "PassPlan", "plan_cascade", "prefix_splits", "merge_cascade", "merge_splits",
           "run_fused_cascade", "fused_cascade_runs", "FUSED_MERGE"]

# The passes and the merge as one C++ primitive (csrc/ops/cascade_attention.cpp),
# or the merge alone as one (csrc/ops/cascade_merge.cpp), where the extension is
# built; the MLX-op merge below is the same computation (and what a test seeds
# faults into). False: the passes and the MLX-op merge.
FUSED_MERGE = True
MAX_FUSED_SPLITS = 62  # key splits the C++ merge takes per row


@dataclass
class PassPlan:
    """One call of the fused paged kernel: pseudo-sequences over some table
    rows. ``rows`` are indices into the caller's ``q`` (in pass order)."""

    table: list[list[int]] = field(default_factory=list)
    kv_lens: list[int] = field(default_factory=list)
    q_lens: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    _arrays: tuple | None = field(default=None, repr=False, compare=False)
    _in_order: bool | None = field(default=None, repr=False, compare=False)

    def add(self, pages: list[int], kv_len: int, rows: list[int], *, bottom_aligned: bool) -> None:
        """A pseudo-sequence of ``rows`` over the first ``kv_len`` keys of
        ``pages``. Not bottom-aligned (no causal rule), the rows are cut into
        pieces of at most ``kv_len`` (the kernel wants ``q_len <= kv_len``)."""
        if not rows:
            return
        if bottom_aligned:
            assert len(rows) <= kv_len, (len(rows), kv_len)
            pieces = [rows]
        else:
            assert kv_len > 0
            pieces = [rows[i : i + kv_len] for i in range(0, len(rows), kv_len)]
        for piece in pieces:
            self.table.append(pages)
            self.kv_lens.append(kv_len)
            self.q_lens.append(len(piece))
            self.rows.extend(piece)

    def arrays(self):
        """``(block_table, kv_lens, q_lens, rows)`` as int32 MLX arrays (made
        once: a plan serves every layer of a step)."""
        if self._arrays is None:
            self._arrays = self._make_arrays()
        return self._arrays

    def takes_all_in_order(self, total_q: int) -> bool:
        """Whether the pass's rows are the call's rows 0 .. total_q - 1 in
        order (then the pass reads ``q`` itself, no gather)."""
        if self._in_order is None:
            self._in_order = self.rows == list(range(len(self.rows)))
        return self._in_order and len(self.rows) == total_q

    def kernel_arrays(self):
        """:meth:`arrays`, or empty int32 arrays of the same ranks for a pass
        without rows (the one-primitive cascade takes all three passes)."""
        if self.rows:
            return self.arrays()
        return (mx.zeros((0, 1), mx.int32), *(mx.zeros((0,), mx.int32) for _ in range(3)))

    def _make_arrays(self):
        width = max(1, max((len(p) for p in self.table), default=1))
        table = [pages + [0] * (width - len(pages)) for pages in self.table]  # unread entries: any valid page
        return tuple(mx.array(a, dtype=mx.int32) for a in (table, self.kv_lens, self.q_lens, self.rows))


@dataclass
class CascadePlan:
    """The three passes and, per query row of the call, where its partials
    are (``-1``: none). A row is either direct (``direct_index >= 0``) or
    merged from its suffix partial and its prefix partials, one per key
    split of its group's prefix (``prefix_index[split, row]``)."""

    prefix: PassPlan
    suffix: PassPlan
    direct: PassPlan
    prefix_index: np.ndarray
    suffix_index: np.ndarray
    direct_index: np.ndarray
    # the merge's gather indices and direct-row mask as MLX arrays, made once per plan
    merge_arrays: dict = field(default_factory=dict, repr=False, compare=False)


# Split-K of the prefix pass: a split holds at least this many keys, and a
# group's prefix is split until its work items (kv heads x row tiles x
# splits) give every kernel thread two.
MIN_SPLIT_KEYS = 512
ROWS_PER_TILE = 128  # the CPU kernel's kMaxRows (csrc/cpu/kernels.h): query rows x GQA group


def prefix_splits(prefix_keys: int, rows: int, *, kv_heads: int, gqa: int, threads: int, page_size: int):
    """``[(first page, pages, keys), ...]``: the key splits of one group's
    prefix pass."""
    pages = -(-prefix_keys // page_size)
    tiles = kv_heads * -(-rows * gqa // ROWS_PER_TILE)
    wanted = max(1, min(-(-2 * threads // tiles), prefix_keys // MIN_SPLIT_KEYS))
    per_split = -(-pages // wanted)
    return [(first, min(per_split, pages - first),
             min(prefix_keys, (first + per_split) * page_size) - first * page_size)
            for first in range(0, pages, per_split)]


def plan_cascade(q_lens, kv_lens, own_pages, prefix_pages, prefix_lens, groups, page_size, *, causal,
                 window_size, kv_heads=1, gqa=1, threads=1) -> CascadePlan:
    """The passes of a checked cascade call (host ints). ``own_pages[b]``:
    the pages of sequence ``b``'s own keys (after its group's prefix);
    ``prefix_pages[g]`` / ``prefix_lens[g]``: group ``g``'s shared pages and
    keys; ``groups[b]``: ``b``'s group or ``-1``. ``kv_heads``, ``gqa`` and
    ``threads`` size the prefix pass's key splits."""
    total_q = int(sum(q_lens))
    # plain lists while planning (a few host microseconds per sequence), arrays at the end
    suffix_index, direct_index = [-1] * total_q, [-1] * total_q
    prefix, suffix, direct = PassPlan(), PassPlan(), PassPlan()
    group_rows: dict[int, list[int]] = {}

    def place(index, plan, rows):
        index[rows.start : rows.stop] = range(len(plan.rows), len(plan.rows) + len(rows))

    start = 0
    for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        g = groups[b]
        shared = prefix_lens[g] if g >= 0 else 0
        first = kv_len - q_len  # position of row 0
        rows = range(start, start + q_len)
        start += q_len
        if shared == 0 or not causal:
            lo, hi = 0, q_len  # every row takes the cascade
        else:
            # causal rows at or after the prefix's last key whose window covers key 0
            lo = min(q_len, max(0, shared - 1 - first))
            hi = q_len if window_size is None else max(lo, min(q_len, window_size - first))
        for a, c in ((0, lo), (hi, q_len)):  # direct rows: over the full table, bottom-aligned at their last row
            if c > a:
                place(direct_index, direct, rows[a:c])
                end_keys = first + c if causal else kv_len
                full_pages = (prefix_pages[g] if g >= 0 else []) + own_pages[b]
                direct.add(full_pages[: -(-end_keys // page_size)], end_keys, list(rows[a:c]),
                           bottom_aligned=causal)
        if hi <= lo:
            continue
        if shared:
            group_rows.setdefault(g, []).extend(rows[lo:hi])
        # suffix: the rows' own keys; a causal row at the prefix's last key has none
        s_lo = max(lo, shared - first) if causal else lo
        own_keys = (first + hi - shared) if causal else (kv_len - shared)
        if hi > s_lo and own_keys > 0:
            place(suffix_index, suffix, rows[s_lo:hi])
            suffix.add(own_pages[b], own_keys, list(rows[s_lo:hi]), bottom_aligned=causal)

    # one pseudo-sequence (or a few) per group and key split: the shared read
    split_index = []
    for g, rows in group_rows.items():
        splits = prefix_splits(prefix_lens[g], len(rows), kv_heads=kv_heads, gqa=gqa, threads=threads,
                               page_size=page_size)
        while len(split_index) < len(splits):
            split_index.append([-1] * total_q)
        for (first, count, keys), index in zip(splits, split_index):
            for i, row in enumerate(rows, start=len(prefix.rows)):
                index[row] = i
            prefix.add(prefix_pages[g][first : first + count], keys, rows, bottom_aligned=False)
    prefix_index = np.asarray(split_index, np.int64).reshape(len(split_index), total_q)
    suffix_index, direct_index = np.asarray(suffix_index, np.int64), np.asarray(direct_index, np.int64)
    return CascadePlan(prefix, suffix, direct, prefix_index, suffix_index, direct_index)


def _pick(out, lse, index: np.ndarray, made: dict | None = None, name=None):
    """Rows ``index`` of a pass's ``(out, lse)``; ``-1`` gives an empty
    partial (zeros, ``-inf``). ``made``: the plan's cache of index arrays,
    where this index is kept under ``name``."""
    if index.size and index[0] >= 0 and (np.diff(index) == 1).all():
        first = int(index[0])  # consecutive rows (a decode batch, a key split): a slice, no gather
        return out[first : first + index.size], lse[first : first + index.size]
    heads, value_dim = out.shape[1], out.shape[2]
    out = mx.concatenate([out, mx.zeros((1, heads, value_dim), out.dtype)])
    lse = mx.concatenate([lse, mx.full((1, heads), -mx.inf, mx.float32)])
    key = (name, out.shape[0])
    where = None if made is None or name is None else made.get(key)
    if where is None:
        where = mx.array(np.where(index < 0, out.shape[0] - 1, index).astype(np.int32))
        if made is not None and name is not None:
            made[key] = where
    return mx.take(out, where, axis=0), mx.take(lse, where, axis=0)


# Plain ops, not mx.compile: on the CPU a compiled graph is C++ compiled on first use
# of each shape (seconds), and a serving step's row count changes every step.
def _merge_all(outs: list, lses: list, sink: mx.array, like: mx.array):
    """The merge of :func:`merge_splits`; the output in ``like``'s dtype."""
    lses = [lse.astype(mx.float32) for lse in lses]
    top = sink
    for lse in lses:
        top = mx.maximum(top, lse)
    top = mx.where(top == -mx.inf, 0.0, top)  # no key and no sink: any finite shift
    weights = [mx.exp(lse - top) for lse in lses]
    total = mx.exp(sink - top)
    out = 0.0
    for weight, part in zip(weights, outs):
        total = total + weight
        out = out + part.astype(mx.float32) * weight[..., None]
    safe = mx.where(total == 0, 1.0, total)
    lse = mx.where(total == 0, -mx.inf, top + mx.log(safe))
    return (out / safe[..., None]).astype(like.dtype), lse


def merge_splits(outs: list, lses: list, sinks: mx.array | None, dtype):
    """:func:`mlx_attn.distributed.merge_partials` over any number of
    partials ``out [T, Hq, Dv]``, ``lse [T, Hq]`` of disjoint key sets, with
    the sink logits ``[Hq]`` counted once (a sink is one more partial, of
    value zero). A side with ``lse = -inf`` adds nothing; a row with no key
    and no sink gives zeros and ``-inf``. Returns ``(out in dtype, lse float32)``."""
    sink = _saturated_sinks(sinks, lses[0].shape[1])  # saturated, as the kernels do
    return _merge_all(list(outs), list(lses), sink, mx.zeros((), dtype))


def _saturated_sinks(sinks: mx.array | None, heads: int) -> mx.array:
    if sinks is None:
        return mx.full((1, heads), -mx.inf, mx.float32)
    return mx.clip(sinks.astype(mx.float32), -LOGIT_LIMIT, LOGIT_LIMIT)[None, :]


def _merge_inputs(plan: CascadePlan, sinks, heads: int):
    """The C++ merge's index arrays (made once per plan) and sinks."""
    made = plan.merge_arrays
    if "fused" not in made:
        made["fused"] = tuple(mx.array(a.astype(np.int32)) for a in (plan.suffix_index, plan.prefix_index,
                                                                    plan.direct_index))
    if sinks is not None:
        return made["fused"], _saturated_sinks(sinks, heads)[0]
    if "no sinks" not in made:
        made["no sinks"] = mx.full((heads,), -mx.inf, mx.float32)
    return made["fused"], made["no sinks"]


def fused_cascade_runs(plan: CascadePlan) -> bool:
    """Whether :func:`run_fused_cascade` takes ``plan`` (the extension has the
    one-primitive cascade, and the plan's key splits fit its merge). That
    primitive refuses gradients itself (ValueError, "inference only")."""
    ext = _native.ext
    return (FUSED_MERGE and ext is not None and hasattr(ext, "cascade_paged_attention")
            and plan.prefix_index.shape[0] <= MAX_FUSED_SPLITS)


def run_fused_cascade(plan: CascadePlan, q, k_parts, v_parts, sinks, *, heads: int, options: dict, stream):
    """``[out, lse]`` of the whole cascade as one C++ primitive
    (csrc/ops/cascade_attention.cpp: the three passes over their gathered
    rows, then the merge, in one evaluation), or None where the extension has
    none (then the passes run as separate paged calls and
    :func:`merge_cascade` merges). ``options``: the paged kernel's (scale,
    causal, window, softcap, bits, group size)."""
    if not fused_cascade_runs(plan):
        return None
    made = plan.merge_arrays
    if "passes" not in made:
        made["passes"] = [a for p in (plan.prefix, plan.suffix, plan.direct) for a in p.kernel_arrays()]
    indices, sink = _merge_inputs(plan, sinks, heads)
    return _native.ext.cascade_paged_attention(q, list(k_parts), list(v_parts), made["passes"], *indices, sink, sinks=sinks,
                                       stream=stream, output_lse=True, **options)


def _fused_merge(plan: CascadePlan, prefix, suffix, direct, *, dtype, sinks, heads):
    """:func:`merge_cascade` in one C++ primitive: every index array made
    once per plan, no gather, no per-row MLX op."""
    indices, sink = _merge_inputs(plan, sinks, heads)
    out, lse = _native.ext.cascade_merge(*suffix, *prefix, *direct, *indices, sink, dtype)
    return out, lse


def merge_cascade(plan: CascadePlan, prefix, suffix, direct, *, heads, value_dim, dtype, sinks):
    """The call's ``(out, lse)`` from the passes' ``(out, lse)`` (None for a
    pass without rows): suffix and prefix splits merged, sinks once, direct
    rows taken as they are."""
    empty = (mx.zeros((0, heads, value_dim), dtype), mx.zeros((0, heads), mx.float32))
    prefix, suffix, direct = (p if p is not None else empty for p in (prefix, suffix, direct))
    if FUSED_MERGE and _native.ext is not None and plan.prefix_index.shape[0] <= MAX_FUSED_SPLITS:
        return _fused_merge(plan, prefix, suffix, direct, dtype=dtype, sinks=sinks, heads=heads)
    made = plan.merge_arrays
    parts = [_pick(*suffix, plan.suffix_index, made, "suffix")]
    parts += [_pick(*prefix, split, made, ("prefix", i)) for i, split in enumerate(plan.prefix_index)]
    out, lse = merge_splits([o for o, _ in parts], [l for _, l in parts], sinks, dtype)
    if (plan.direct_index >= 0).any():
        out_d, lse_d = _pick(*direct, plan.direct_index, made, "direct")
        if "is_direct" not in made:
            made["is_direct"] = mx.array(plan.direct_index >= 0)
        is_direct = made["is_direct"]
        out = mx.where(is_direct[:, None, None], out_d, out)
        lse = mx.where(is_direct[:, None], lse_d, lse)
    return out, lse
