"""Paged, ragged attention: a batch of sequences of different lengths whose
keys and values live in fixed-size pages addressed through a block table.

:func:`paged_attention` takes the query rows of every sequence packed in
batch order (no padding) and K/V pages shared by all sequences::

    q            [total_q, Hq, D]          q_lens[b] rows for sequence b, in batch order
    k_pages      [num_pages, Hkv, page_size, D]
    v_pages      [num_pages, Hkv, page_size, Dv]
    block_table  int32 [B, max_pages]       key j of sequence b is slot j % page_size
                                            of page block_table[b, j // page_size]
    kv_lens      int32 [B]                  keys of sequence b
    q_lens       int32 [B] or None          query rows of sequence b (None: one each, decode)

Query row ``i`` of sequence ``b`` sits at position ``kv_lens[b] - q_lens[b] + i``
(bottom-right aligned), so decode rows (``q_lens[b] == 1``) and chunked-prefill
rows mix in one call. The output is ``[total_q, Hq, Dv]``. Masks follow the
dense op's rules (:func:`mlx_attn.scaled_dot_product_attention`): causal,
sliding window (implies causal), sinks, saturated logits, rows that see no key
give zeros; float16 / bfloat16 / float32 with float32 softmax; GQA/MQA without
repeating K/V.

Only the first ``ceil(kv_lens[b] / page_size)`` entries of row ``b`` of the
block table are read (the rest may hold anything, e.g. ``-1``); those must be
page indices in ``[0, num_pages)``. Pages may be shared between sequences and
``page_size`` need not divide any length. The host checks the integer
arguments' values (one small device-to-host read of ``block_table``,
``kv_lens`` and ``q_lens``), so the call cannot be traced by ``mx.compile``.

:func:`quantized_paged_attention` is the sibling for pages stored in the
``QuantizedKVCache`` format (``mx.quantize`` triples per page, 4 or 8 bits).

:func:`cascade_paged_attention` (and :func:`quantized_cascade_paged_attention`)
takes a shared level in front of each sequence's own pages: groups of
sequences whose keys begin with the same pages read them once per group
(three passes of the fused paged kernel merged by log-sum-exp on the CPU,
:mod:`mlx_attn.paged_cascade`; docs/paged.md, "Cascade").

Implementations (:func:`paged_attention_path` says which one a call takes):

- ``"fused-cpu"``: the fused CPU kernel (``csrc/cpu/``): the dense kernel's
  tile loop with a paged K/V loader (page-table-aware key blocks, work split
  over (sequence, kv head, query block) with dynamic scheduling, the GQA
  group sharing each page read, pages dequantized in the tile for
  :func:`quantized_paged_attention`). Extra memory: per-thread tiles and a
  work list, O(rows x D), never O(total K/V) (when q and the pages share one
  dtype: otherwise the promotion casts them first).
- ``"fused-metal"``: the Metal paged kernels, once their variant passed its
  first-use self-check: decode rows and short chunks on the decode kernel's
  split-K loop over a paged K/V loader (``metal/attention_paged.h``), long
  chunks on the prefill kernel's MMA tiles with K/V staged page by page
  (``metal/attention_paged_prefill.h``); the launch plan routes each sequence
  (``paged_rows_take_prefill`` in ``csrc/metal/paged_launch_plan.h``).
- ``"reference"`` (:mod:`mlx_attn.paged_reference`): gather each sequence's
  pages into contiguous K/V and run
  :func:`mlx_attn.reference.reference_attention` per sequence.

``backend="auto"`` takes the fused kernel of the stream's device where one
exists and handles the call, else the reference;
``"fused"`` raises ``ValueError`` where it cannot; ``"reference"`` forces the
reference. Inference only: asking for a gradient raises ``ValueError``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlx_attn import _native, self_check
from mlx_attn.core.attention_arguments import (as_flag, as_scale, as_softcap, check_sinks, check_window_size,
                                               device_type)
from mlx_attn.core.paged_layout import (PagedLayout, check_float_array, check_int32_values, check_paged_layout,
                                        page_shape)
from mlx_attn.core.path_choice import PagedPath, check_backend
from mlx_attn.core.quantization import check_quantization, check_triple
from mlx_attn.paged_cascade import CascadePlan, fused_cascade_runs, merge_cascade, plan_cascade, run_fused_cascade
from mlx_attn.paged_reference import gather_pages, paged_reference_attention

__all__ = [
    "paged_attention",
    "quantized_paged_attention",
    "paged_attention_path",
    "quantized_paged_attention_path",
    "cascade_paged_attention",
    "quantized_cascade_paged_attention",
    "cascade_paged_attention_path",
    "CascadeTables",
    "gather_pages",
    "check_paged_layout",
    "PagedPath",
]

_INFERENCE_ONLY = (
    "paged_attention is inference only: it has no gradient (use mlx_attn.scaled_dot_product_attention "
    "on contiguous K/V to train)"
)


def _check_options(q, dtype, scale, causal, window_size, sinks, backend, return_lse, stream, softcap=None):
    """The options' checks, in the order the call reports them: ``(scale,
    causal, window_size, softcap)`` as the kernels take them."""
    scale = as_scale(scale)
    softcap = as_softcap(softcap)
    causal = as_flag("causal", causal)
    window_size = check_window_size(window_size)
    if window_size is not None and not causal:
        raise ValueError("window_size needs causal=True (a sliding window is causal)")
    check_sinks(sinks, q.shape[1], dtype)
    check_backend(backend)
    as_flag("return_lse", return_lse)
    device_type(stream)  # raises for a stream of the wrong type
    return scale, causal, window_size, softcap


def _inference_only_function(compute):
    """``compute`` as a function whose gradient raises a clear error (the
    reference would differentiate, the fused kernels do not: one contract for
    both)."""

    @mx.custom_function
    def run(*arrays):
        return compute(*arrays)

    @run.vjp
    def _vjp(primals, cotangents, outputs):
        raise ValueError(_INFERENCE_ONLY)

    @run.jvp
    def _jvp(primals, tangents):
        raise ValueError(_INFERENCE_ONLY)

    return run


def _inference_only(compute, arrays: list[mx.array]):
    """``compute(*arrays)``, inference only (:func:`_inference_only_function`)."""
    return _inference_only_function(compute)(*arrays)


def _stream_scope(stream):
    return mx.stream(stream) if stream is not None else contextlib.nullcontext()


@dataclass(frozen=True, eq=False)  # arrays do not compare as values
class _PagedCall:
    """One validated paged call: arrays in the output dtype (q, the float
    pages or the quantized triples' scales and biases, sinks), the integer
    arguments (``q_lens`` filled in for decode), the host-side layout, the
    options, and the path chosen for it."""

    q: mx.array
    k: tuple[mx.array, ...]  # (pages,) or (packed, scales, biases)
    v: tuple[mx.array, ...]
    block_table: mx.array
    kv_lens: mx.array
    q_lens: mx.array
    sinks: mx.array | None
    layout: PagedLayout
    scale: float
    causal: bool
    window_size: int | None
    return_lse: bool
    stream: object
    backend: str
    bits: int = 0  # 0: float pages
    group_size: int = 0
    softcap: float | None = None

    @classmethod
    def build(cls, q, k, v, dtype, layout, block_table, kv_lens, q_lens, sinks, options, backend, return_lse,
              stream, bits=0, group_size=0, resolve_path=True) -> "_PagedCall":
        scale, causal, window_size, softcap = options
        cast = lambda a: a.astype(dtype) if a.dtype != dtype else a  # noqa: E731
        q = cast(q)
        # float pages, or the scales and biases of quantized ones (words stay)
        k, v = (tuple(cast(a) if i or not bits else a for i, a in enumerate(parts)) for parts in (k, v))
        if q_lens is None:
            q_lens = mx.ones((len(layout.kv_lens),), dtype=mx.int32)
        sinks = cast(sinks) if sinks is not None else None
        call = cls(q, k, v, block_table, kv_lens, q_lens, sinks, layout, scale, causal, window_size,
                   bool(return_lse), stream, backend, bits, group_size, softcap)
        if resolve_path:  # the cascade resolves its own path first (this call is its fallback)
            call.path  # noqa: B018  (backend="fused" raises here, at the call)
        return call

    @property
    def device(self) -> mx.DeviceType:
        return device_type(self.stream)

    def fused_unsupported_reason(self) -> str | None:
        """None when the fused kernel of the call's device runs it, else why not."""
        if _native.ext is None:
            return _native.MISSING_REASON
        if self.device not in _FUSED_PATHS:
            return f"no fused paged attention kernel for {self.device} in this build"
        if self.device == mx.gpu:
            return self._metal_unsupported_reason()
        return _native.ext.paged_unsupported_reason(
            self.q, list(self.k), list(self.v), self.block_table, self.kv_lens, self.q_lens, scale=self.scale,
            causal=self.causal, window_size=self.window_size or 0, sinks=self.sinks, output_lse=self.return_lse,
            bits=self.bits, group_size=self.group_size, softcap=self.softcap or 0.0, device=self.device)

    def _metal_unsupported_reason(self) -> str | None:
        reason = metal_paged_reason(self.q, self.k, self.v, self.block_table, self.layout,
                                    window_size=self.window_size, sinks=self.sinks, return_lse=self.return_lse,
                                    bits=self.bits, group_size=self.group_size, softcap=self.softcap)
        if reason:
            return reason
        if not metal_paged_trusted(self.q.dtype, self.q.shape[-1], bits=self.bits, group_size=self.group_size,
                                   stream=self.stream):
            return "the Metal paged kernel variant failed its self-check on this GPU (see the warning)"
        return None

    @functools.cached_property
    def path(self) -> PagedPath:
        if self.backend == "reference":
            return "reference"
        reason = self.fused_unsupported_reason()
        if reason is None:
            return _FUSED_PATHS[self.device]
        if self.backend == "fused":
            raise ValueError(f"backend='fused' is not possible: {reason}")
        return "reference"

    def run(self):
        arrays = [self.q, *self.k, *self.v] + ([self.sinks] if self.sinks is not None else [])
        runner = _RUNNERS[self.path]
        with _stream_scope(self.stream):
            outputs = _inference_only(lambda *a: runner(self, *a), arrays)
        return tuple(outputs) if self.return_lse else outputs[0]

    def split(self, arrays):
        """``(q, k parts, v parts, sinks)`` of the flat array list ``run`` passes."""
        parts = len(self.k)
        sinks = arrays[1 + 2 * parts] if self.sinks is not None else None
        return arrays[0], arrays[1 : 1 + parts], arrays[1 + parts : 1 + 2 * parts], sinks


# -- the paths: one runner each (runner(call, *arrays) -> [out] or [out, lse]) --

def _run_reference(call: _PagedCall, *arrays):
    q, k_parts, v_parts, sinks = call.split(arrays)
    return paged_reference_attention(q, k_parts, v_parts, call.layout, scale=call.scale, causal=call.causal,
                                     window_size=call.window_size, sinks=sinks, return_lse=call.return_lse,
                                     softcap=call.softcap, bits=call.bits, group_size=call.group_size)


def _run_fused_cpu(call: _PagedCall, *arrays):
    q, k_parts, v_parts, sinks = call.split(arrays)
    return _native.ext.paged_attention(
        q, list(k_parts), list(v_parts), call.block_table, call.kv_lens, call.q_lens, scale=call.scale,
        causal=call.causal, window_size=call.window_size or 0, sinks=sinks, output_lse=call.return_lse,
        bits=call.bits, group_size=call.group_size, softcap=call.softcap or 0.0, stream=call.stream)


def _run_fused_metal(call: _PagedCall, *arrays):
    q, k_parts, v_parts, sinks = call.split(arrays)
    return fused_metal_paged_attention(
        q, k_parts, v_parts, call.block_table, call.layout, scale=call.scale, causal=call.causal,
        window_size=call.window_size, sinks=sinks, return_lse=call.return_lse, bits=call.bits,
        group_size=call.group_size, softcap=call.softcap, stream=call.stream)


# The fused path of each device and the runner of every path.
_FUSED_PATHS: dict[mx.DeviceType, str] = {mx.cpu: "fused-cpu", mx.gpu: "fused-metal"}
_RUNNERS = {"fused-cpu": _run_fused_cpu, "fused-metal": _run_fused_metal, "reference": _run_reference}


def _prepare(q, k_pages, v_pages, block_table, kv_lens, q_lens, scale, causal, window_size, sinks, backend,
             return_lse, stream, softcap=None) -> _PagedCall:
    check_float_array("q", q, 3, "[total_q, q_heads, head_dim]")
    check_float_array("k_pages", k_pages, 4, "[num_pages, kv_heads, page_size, head_dim]")
    check_float_array("v_pages", v_pages, 4, "[num_pages, kv_heads, page_size, value_dim]")
    dtype = mx.result_type(q.dtype, k_pages.dtype, v_pages.dtype)
    layout = check_paged_layout(q, tuple(k_pages.shape), tuple(v_pages.shape), k_pages.shape[0], block_table,
                           kv_lens, q_lens)
    options = _check_options(q, dtype, scale, causal, window_size, sinks, backend, return_lse, stream, softcap)
    return _PagedCall.build(q, (k_pages,), (v_pages,), dtype, layout, block_table, kv_lens, q_lens, sinks, options,
                            backend, return_lse, stream)


def _prepare_quantized(q, k_pages, v_pages, block_table, kv_lens, q_lens, scale, group_size, bits, causal,
                       window_size, sinks, backend, return_lse, stream, softcap=None) -> _PagedCall:
    group_size, bits = check_quantization(group_size, bits)
    k_pages = _check_quantized_pages("k_pages", k_pages, group_size, bits)
    v_pages = _check_quantized_pages("v_pages", v_pages, group_size, bits)
    check_float_array("q", q, 3, "[total_q, q_heads, head_dim]")
    if k_pages[1].dtype != v_pages[1].dtype:
        raise ValueError(f"k_pages and v_pages scales need one dtype, got {k_pages[1].dtype} and {v_pages[1].dtype}")
    dtype = mx.result_type(q.dtype, k_pages[1].dtype)
    k_shape, v_shape = page_shape(k_pages[0], bits), page_shape(v_pages[0], bits)
    layout = check_paged_layout(q, k_shape, v_shape, k_shape[0], block_table, kv_lens, q_lens)
    options = _check_options(q, dtype, scale, causal, window_size, sinks, backend, return_lse, stream, softcap)
    return _PagedCall.build(q, tuple(k_pages), tuple(v_pages), dtype, layout, block_table, kv_lens, q_lens, sinks,
                            options, backend, return_lse, stream, bits, group_size)


def paged_attention_path(q, k_pages, v_pages, block_table, kv_lens, *, q_lens=None, scale=1.0, causal=True,
                         window_size=None, sinks=None, backend="auto", return_lse=False,
                         stream=None, softcap=None) -> PagedPath:
    """Which implementation :func:`paged_attention` uses for these arguments
    (validated as the call does): ``"fused-cpu"``, ``"fused-metal"`` or ``"reference"``.
    ``backend="fused"`` raises ``ValueError`` where no fused kernel runs the
    call."""
    return _prepare(q, k_pages, v_pages, block_table, kv_lens, q_lens, scale, causal, window_size, sinks, backend,
                    return_lse, stream, softcap).path


def quantized_paged_attention_path(q, k_pages, v_pages, block_table, kv_lens, *, q_lens=None, scale=1.0,
                                   group_size=64, bits=8, causal=True, window_size=None, sinks=None,
                                   backend="auto", return_lse=False, stream=None, softcap=None) -> PagedPath:
    """:func:`paged_attention_path` for :func:`quantized_paged_attention`."""
    return _prepare_quantized(q, k_pages, v_pages, block_table, kv_lens, q_lens, scale, group_size, bits, causal,
                              window_size, sinks, backend, return_lse, stream, softcap).path


def paged_attention(
    q: mx.array,
    k_pages: mx.array,
    v_pages: mx.array,
    block_table: mx.array,
    kv_lens: mx.array,
    *,
    q_lens: mx.array | None = None,
    scale: float,
    causal: bool = True,
    window_size: int | None = None,
    sinks: mx.array | None = None,
    backend: str = "auto",
    return_lse: bool = False,
    stream: mx.Stream | mx.Device | None = None,
    softcap: float | None = None,
) -> mx.array | tuple[mx.array, mx.array]:
    """Attention of packed, ragged query rows over paged K/V (see the module doc).

    Args:
        q: ``[total_q, Hq, D]``, the rows of every sequence in batch order.
        k_pages: ``[num_pages, Hkv, page_size, D]``, ``Hq % Hkv == 0``.
        v_pages: ``[num_pages, Hkv, page_size, Dv]``.
        block_table: int32 ``[B, max_pages]``; row ``b`` lists sequence
            ``b``'s pages in key order (only the first
            ``ceil(kv_lens[b] / page_size)`` entries are read).
        kv_lens: int32 ``[B]``, keys of each sequence (0 allowed).
        q_lens: int32 ``[B]``, query rows of each sequence (0 allowed,
            ``<= kv_lens``, summing to ``total_q``); ``None``: one row each.
        scale: multiplies ``q @ k^T`` (as in the dense op).
        causal: row ``i`` of sequence ``b`` (at position
            ``kv_lens[b] - q_lens[b] + i``) sees keys at or before its
            position; ``False``: every key of its sequence.
        window_size: each row sees at most this many most recent keys
            (itself included); needs ``causal=True``.
        sinks: optional ``[Hq]`` logits joining each head's softmax.
        backend: ``"auto"`` (the fused kernel of the stream's device where it
            runs the call, else the reference), ``"fused"`` (raises where it
            cannot) or ``"reference"``.
        return_lse: also return the row log-sum-exp, float32 ``[total_q, Hq]``
            (``-inf`` for a row that sees no key).
        stream: stream or device to run on.
        softcap: a positive cap of the logits, ``softcap * tanh(logit /
            softcap)`` before the mask (as in the dense op); None: none.

    Returns:
        ``[total_q, Hq, Dv]`` in the promoted dtype of ``q``, ``k_pages`` and
        ``v_pages`` (and the log-sum-exp with ``return_lse``).

    Raises:
        ValueError: naming the offending argument (shapes, dtypes, lengths,
        block-table entries); also when a gradient is asked for.
    """
    return _prepare(q, k_pages, v_pages, block_table, kv_lens, q_lens, scale, causal, window_size, sinks, backend,
                    return_lse, stream, softcap).run()


def _check_quantized_pages(name: str, pages, group_size: int, bits: int):
    """A ``(packed, scales, biases)`` triple of pages: ``mx.quantize`` of
    ``[num_pages, Hkv, page_size, D]`` (the ``QuantizedKVCache`` format)."""
    return check_triple(name, pages, group_size, bits)


def quantized_paged_attention(
    q: mx.array,
    k_pages,
    v_pages,
    block_table: mx.array,
    kv_lens: mx.array,
    *,
    q_lens: mx.array | None = None,
    scale: float,
    group_size: int = 64,
    bits: int = 8,
    causal: bool = True,
    window_size: int | None = None,
    sinks: mx.array | None = None,
    backend: str = "auto",
    return_lse: bool = False,
    stream: mx.Stream | mx.Device | None = None,
    softcap: float | None = None,
) -> mx.array | tuple[mx.array, mx.array]:
    """:func:`paged_attention` over quantized pages.

    ``k_pages`` and ``v_pages`` are ``(packed, scales, biases)`` triples as
    ``mx.quantize(pages, group_size, bits)`` returns them for float pages
    ``[num_pages, Hkv, page_size, D]`` (the ``QuantizedKVCache`` format,
    one scale and bias per ``group_size`` features of each token): packed
    uint32 ``[num_pages, Hkv, page_size, D * bits / 32]``, scales and biases
    ``[num_pages, Hkv, page_size, D / group_size]`` in one float dtype.
    ``bits`` 4 or 8, ``group_size`` 32/64/128. The fused kernel dequantizes
    each key block inside its tile (no dequantized copy of the pages); the
    reference dequantizes each sequence's gathered pages. Both attend in the
    dtype ``q`` and the scales promote to. Everything else as
    :func:`paged_attention`.
    """
    return _prepare_quantized(q, k_pages, v_pages, block_table, kv_lens, q_lens, scale, group_size, bits, causal,
                              window_size, sinks, backend, return_lse, stream, softcap).run()


# ---------------------------------------------------------------- cascade (shared prefix)
# A shared level in front of each sequence's own pages (docs/paged.md, "Cascade").
# The passes and the merge: mlx_attn/paged_cascade.py.

CascadePath = str  # "cascade-cpu", "cascade-metal", or the full-table call's path ("fused-metal", "reference")


@dataclass(frozen=True, eq=False)  # arrays do not compare as values
class _CascadeLevels:
    """The two levels as the Metal cascade kernels take them: the own pages'
    and the prefix pages' tables (int32 MLX arrays) and the host lengths
    (own_kv_lens: each sequence's keys after its group's prefix)."""

    own_table: mx.array
    prefix_table: mx.array
    own_kv_lens: list
    prefix_lens: list
    prefix_groups: list


@functools.cache
def _cpu_kernel_threads() -> int:
    """The fused CPU kernel's pool size (csrc/cpu/thread_pool.cpp's rule)."""
    try:
        forced = int(os.environ.get("MLX_ATTN_NUM_THREADS", "0"))
    except ValueError:
        forced = 0
    return forced if forced > 0 else (os.cpu_count() or 1)


class _FullPages(Sequence):
    """The pages each sequence reads, prefix then own, joined when asked
    for (the reference path asks; the cascade does not)."""

    def __init__(self, prefix_pages, own_pages, groups):
        self.prefix_pages, self.own_pages, self.groups = prefix_pages, own_pages, groups

    def __len__(self):
        return len(self.own_pages)

    def __getitem__(self, b):
        g = self.groups[b]
        return (self.prefix_pages[g] if g >= 0 else []) + self.own_pages[b]


def _cascade_tables(q, num_pages, page_size, prefix_table, prefix_lens, prefix_groups, block_table, kv_lens):
    """The shared level checked against the own level: ``(own pages per
    sequence, prefix pages per group, full pages per sequence, prefix lens,
    groups, full table)`` (host ints; the full table is what
    paged_attention would take)."""
    own_table = check_int32_values("block_table", block_table, 2, "[batch, max_pages]")
    batch = own_table.shape[0]
    kv = check_int32_values("kv_lens", kv_lens, 1, "[batch]")
    if kv.shape[0] != batch:
        raise ValueError(f"kv_lens must have shape [batch] = [{batch}] (block_table's rows), got {kv.shape}")
    if (kv < 0).any():
        raise ValueError(f"kv_lens must be >= 0, got {kv.tolist()}")
    shared_table = check_int32_values("prefix_table", prefix_table, 2, "[groups, max_prefix_pages]")
    num_groups = shared_table.shape[0]
    shared = check_int32_values("prefix_lens", prefix_lens, 1, "[groups]")
    if shared.shape[0] != num_groups:
        raise ValueError(
            f"prefix_lens must have shape [groups] = [{num_groups}] (prefix_table's rows), got {shared.shape}")
    if (shared < 0).any():
        raise ValueError(f"prefix_lens must be >= 0, got {shared.tolist()}")
    groups = check_int32_values("prefix_groups", prefix_groups, 1, "[batch]")
    if groups.shape[0] != batch:
        raise ValueError(
            f"prefix_groups must have shape [batch] = [{batch}] (block_table's rows), got {groups.shape}")
    if ((groups < -1) | (groups >= num_groups)).any():
        b = int(np.argmax((groups < -1) | (groups >= num_groups)))
        raise ValueError(f"prefix_groups[{b}] = {int(groups[b])} is not a group in [0, {num_groups}) or -1 (none)")

    def first_bad_entry(table, name, counts, what):
        """Raises for the first read entry (the first ``counts[r]`` of row
        ``r``) outside ``[0, num_pages)`` or beyond the table's columns."""
        columns = table.shape[1]
        if counts.size and counts.max() > columns:
            r = int(np.argmax(counts > columns))
            raise ValueError(f"{what(r)} needs {int(counts[r])} pages of {page_size} keys but {name} has only "
                             f"{columns} columns")
        read = np.arange(columns)[None, :] < counts[:, None]
        bad = read & ((table < 0) | (table >= num_pages))
        if bad.any():
            r, j = (int(i) for i in np.argwhere(bad)[0])
            raise ValueError(f"{name}[{r}, {j}] = {int(table[r, j])} is not a page index in [0, {num_pages}) "
                             f"({what(r)})")

    prefix_counts = -(-shared.astype(np.int64) // page_size)
    first_bad_entry(shared_table, "prefix_table", prefix_counts, lambda g: f"prefix_lens[{g}] = {int(shared[g])}")
    before = np.where(groups >= 0, shared[np.maximum(groups, 0)] if num_groups else 0, 0).astype(np.int64)
    if (before > kv).any():
        b = int(np.argmax(before > kv))
        raise ValueError(f"prefix_lens[{int(groups[b])}] = {int(before[b])} is longer than sequence {b} of its "
                         f"group (kv_lens[{b}] = {int(kv[b])})")
    own = kv - before
    unaligned = (own > 0) & (before % page_size != 0)
    if unaligned.any():
        b = int(np.argmax(unaligned))
        raise ValueError(f"prefix_lens[{int(groups[b])}] = {int(before[b])} must be a multiple of page_size "
                         f"({page_size}): sequence {b} has own keys after it, which start on a fresh page")
    own_counts = -(-own // page_size)
    first_bad_entry(own_table, "block_table", own_counts,
                    lambda b: f"sequence {b}'s {int(own[b])} own keys after its prefix")

    prefix_pages = [shared_table[g, : prefix_counts[g]].tolist() for g in range(num_groups)]
    own_pages = [own_table[b, : own_counts[b]].tolist() for b in range(batch)]
    full_pages = _FullPages(prefix_pages, own_pages, groups.tolist())
    # the full tables: prefix pages, then own pages (what paged_attention would take), built
    # in NumPy: a Python list of every entry costs ~0.1 ms per 4k entries
    lead = np.where(groups >= 0, prefix_counts[np.maximum(groups, 0)] if num_groups else 0, 0)
    width = max(1, int((lead + own_counts).max(initial=0)))
    column = np.arange(width)[None, :]
    full = np.full((batch, width), -1, np.int32)
    if num_groups and shared_table.shape[1]:
        from_prefix = shared_table[np.maximum(groups, 0)][:, np.minimum(column[0], shared_table.shape[1] - 1)]
        full = np.where(column < lead[:, None], from_prefix, full)
    if own_table.shape[1]:
        own_column = column - lead[:, None]
        from_own = np.take_along_axis(own_table, np.clip(own_column, 0, own_table.shape[1] - 1), axis=1)
        full = np.where((own_column >= 0) & (own_column < own_counts[:, None]), from_own, full)
    return own_pages, prefix_pages, full_pages, shared.tolist(), groups.tolist(), mx.array(full.astype(np.int32))


@dataclass(frozen=True, eq=False)
class _CascadeCall:
    """A checked cascade call: the equivalent paged call over the full tables
    (what the reference and the no-cascade fallback run) and the passes."""

    full: _PagedCall
    plan: CascadePlan
    backend: str
    support: dict = dataclasses.field(default_factory=dict)  # the tables' cache of support answers
    levels: _CascadeLevels | None = None

    @functools.cached_property
    def path(self) -> CascadePath:
        if self.backend == "reference":
            return "reference"
        reason = self.cascade_unsupported_reason()
        if reason is None:
            return "cascade-metal" if self.full.device == mx.gpu else "cascade-cpu"
        if self.backend == "fused":
            raise ValueError(f"backend='fused' is not possible: {reason}")
        return self.full.path  # today's paged op over the full tables

    def cascade_unsupported_reason(self) -> str | None:
        if self.full.device == mx.gpu:
            return self._metal_unsupported_reason()
        if self.full.device != mx.cpu:
            return f"no cascade paged attention for {self.full.device} (the full tables go to the paged op)"
        # the passes are fused CPU paged calls that return their log-sum-exp; the answer
        # depends on dtypes, shapes and options only, so every layer alike asks once
        full = self.full
        key = (full.q.dtype, *(tuple(a.shape) for a in (full.q, *full.k, *full.v)), full.bits, full.group_size,
               full.sinks is not None, full.causal, full.window_size, full.softcap)
        if key not in self.support:
            self.support[key] = dataclasses.replace(full, return_lse=True).fused_unsupported_reason()
        return self.support[key]

    def _metal_unsupported_reason(self) -> str | None:
        """What the Metal cascade plan refuses (decode rows only, head dims
        64 / 96 / 128), or a variant that failed its self-check."""
        full = self.full
        key = ("metal", full.q.dtype, *(tuple(a.shape) for a in (full.q, *full.k, *full.v)), full.bits,
               full.group_size, full.sinks is not None, full.causal, full.window_size, full.softcap, full.return_lse)
        if key not in self.support:
            reason = metal_cascade_reason(full.q, full.k, full.v, self.levels, full.layout,
                                          window_size=full.window_size, sinks=full.sinks,
                                          return_lse=full.return_lse, bits=full.bits, group_size=full.group_size,
                                          softcap=full.softcap) or None
            self.support[key] = reason
        if self.support[key] is not None:
            return self.support[key]
        if not metal_cascade_trusted(full.q.dtype, full.q.shape[-1], bits=full.bits, group_size=full.group_size,
                                     stream=full.stream):
            return "the Metal cascade kernel variant failed its self-check on this GPU (see the warning)"
        return None

    def run_on(self, q, k_pages, v_pages, sinks):
        """The fused CPU cascade of this checked call over other arrays of
        the same shapes and dtypes (cast as the checked call cast its own)."""
        full = self.full
        dtype = full.q.dtype  # the call's output dtype, as checked
        cast = lambda a: a.astype(dtype) if a.dtype != dtype else a  # noqa: E731
        k_parts = k_pages if full.bits else (k_pages,)
        v_parts = v_pages if full.bits else (v_pages,)
        arrays = [cast(q), *(cast(a) if i or not full.bits else a for parts in (k_parts, v_parts)
                             for i, a in enumerate(parts))]
        if sinks is not None:
            arrays.append(cast(sinks))
        with _stream_scope(full.stream):
            if fused_cascade_runs(self.plan):  # the primitive refuses gradients itself
                outputs = _run_cascade_cpu(full, self.plan, *arrays)
            else:
                outputs = self._inference_only_cpu(*arrays)
        return tuple(outputs) if full.return_lse else outputs[0]

    @functools.cached_property
    def _inference_only_cpu(self):
        """The CPU cascade as an inference-only function, made once per call
        signature (making an ``mx.custom_function`` costs as much as the checks)."""
        return _inference_only_function(lambda *arrays: _run_cascade_cpu(self.full, self.plan, *arrays))

    def run(self):
        if self.path not in ("cascade-cpu", "cascade-metal"):
            return self.full.run()
        call = self.full
        arrays = [call.q, *call.k, *call.v] + ([call.sinks] if call.sinks is not None else [])
        if self.path == "cascade-metal":
            def run(*a):
                q, k_parts, v_parts, sinks = call.split(a)
                return fused_metal_cascade_attention(
                    q, k_parts, v_parts, self.levels, call.layout, scale=call.scale, causal=call.causal,
                    window_size=call.window_size, sinks=sinks, return_lse=call.return_lse, bits=call.bits,
                    group_size=call.group_size, softcap=call.softcap, stream=call.stream)
        else:
            def run(*a):
                return _run_cascade_cpu(call, self.plan, *a)
        with _stream_scope(call.stream):
            if self.path == "cascade-cpu" and fused_cascade_runs(self.plan):  # refuses gradients itself
                outputs = run(*arrays)
            else:
                outputs = _inference_only(run, arrays)
        return tuple(outputs) if call.return_lse else outputs[0]


def _run_cascade_cpu(call: _PagedCall, plan: CascadePlan, *arrays):
    q, k_parts, v_parts, sinks = call.split(arrays)
    fused = run_fused_cascade(plan, q, k_parts, v_parts, sinks, heads=call.layout.heads, stream=call.stream,
                              options=dict(scale=call.scale, causal=call.causal, window_size=call.window_size or 0,
                                           bits=call.bits, group_size=call.group_size, softcap=call.softcap or 0.0))
    if fused is not None:
        return list(fused) if call.return_lse else [fused[0]]

    def run_pass(pass_plan, *, causal, window_size, sinks):
        if not pass_plan.rows:
            return None
        table, kv_lens, q_lens, rows = pass_plan.arrays()
        pass_q = q if pass_plan.takes_all_in_order(q.shape[0]) else mx.take(q, rows, axis=0)
        out, lse = _native.ext.paged_attention(
            pass_q, list(k_parts), list(v_parts), table, kv_lens, q_lens, scale=call.scale,
            causal=causal, window_size=window_size or 0, sinks=sinks, output_lse=True, bits=call.bits,
            group_size=call.group_size, softcap=call.softcap or 0.0, stream=call.stream)
        return out, lse

    # sinks join the softmax once: in the merge for merged rows, in the direct rows' own pass
    prefix = run_pass(plan.prefix, causal=False, window_size=None, sinks=None)
    suffix = run_pass(plan.suffix, causal=call.causal, window_size=call.window_size, sinks=None)
    direct = run_pass(plan.direct, causal=call.causal, window_size=call.window_size, sinks=sinks)
    out, lse = merge_cascade(plan, prefix, suffix, direct, heads=call.layout.heads, value_dim=call.layout.value_dim,
                             dtype=q.dtype, sinks=sinks)
    return [out, lse] if call.return_lse else [out]


class CascadeTables:
    """The integer arguments of cascade calls over the same tables
    (``prefix_table``, ``prefix_lens``, ``prefix_groups``, ``block_table``,
    ``kv_lens``, ``q_lens`` as :func:`cascade_paged_attention` takes them),
    read and checked once and planned once per layer rule, for many calls:
    each layer of a serving step attends through one object, so the host
    reads, checks and plans once per step, not once per layer.

    ``tables.attention(q, k_pages, v_pages, scale=..., ...)`` is
    :func:`cascade_paged_attention` with these tables;
    ``tables.quantized_attention`` is :func:`quantized_cascade_paged_attention`.
    The arrays are read when first used: change none of them in place after."""

    def __init__(self, prefix_table, prefix_lens, prefix_groups, block_table, kv_lens, q_lens=None):
        self.arrays = (prefix_table, prefix_lens, prefix_groups, block_table, kv_lens)
        self.q_lens = q_lens
        self._checked: dict = {}  # (num_pages, page_size) -> _cascade_tables(...)
        self._layouts: dict = {}  # shapes of q and the pages -> PagedLayout
        self._plans: dict = {}  # (shapes, causal, window, threads) -> CascadePlan
        self._support: dict = {}  # dtypes, shapes, options -> why the fused CPU passes cannot run (None: they can)
        self._prepared: dict = {}  # argument signature -> a checked cascade-cpu call, rerun on new arrays

    def checked(self, q, num_pages: int, page_size: int):
        key = (num_pages, page_size)
        if key not in self._checked:
            self._checked[key] = _cascade_tables(q, num_pages, page_size, *self.arrays)
        return self._checked[key]

    def layout(self, q, k_shape, v_shape, full_table, full_pages) -> PagedLayout:
        key = (tuple(q.shape), k_shape, v_shape)
        if key not in self._layouts:
            self._layouts[key] = check_paged_layout(q, k_shape, v_shape, k_shape[0], full_table, self.arrays[4],
                                                    self.q_lens, checked_pages=full_pages)
        return self._layouts[key]

    def plan(self, layout: PagedLayout, own_pages, prefix_pages, shared, groups, *, causal, window_size):
        threads = _cpu_kernel_threads()
        key = (layout.heads, layout.kv_heads, layout.page_size, causal, window_size, threads)
        if key not in self._plans:
            self._plans[key] = plan_cascade(layout.q_lens, layout.kv_lens, own_pages, prefix_pages, shared, groups,
                                            layout.page_size, causal=causal, window_size=window_size,
                                            kv_heads=layout.kv_heads, gqa=layout.heads // layout.kv_heads,
                                            threads=threads)
        return self._plans[key]

    def levels(self, shared, groups, layout: PagedLayout) -> _CascadeLevels:
        """The tables and lengths the Metal cascade kernels take (made once)."""
        if not hasattr(self, "_levels"):
            own_kv = [n - (shared[g] if g >= 0 else 0) for n, g in zip(layout.kv_lens, groups)]
            own_table, prefix_table = (mx.array(np.asarray(a, np.int32)) for a in (self.arrays[3], self.arrays[0]))
            self._levels = _CascadeLevels(own_table, prefix_table, own_kv, list(shared), list(groups))
        return self._levels

    def attention(self, q, k_pages, v_pages, *, scale: float, causal=True, window_size=None, sinks=None,
                  backend="auto", return_lse=False, stream=None, softcap=None):
        """:func:`cascade_paged_attention` over these tables."""
        return self._run(q, k_pages, v_pages, scale, causal, window_size, sinks, backend, return_lse, stream, softcap)

    def quantized_attention(self, q, k_pages, v_pages, *, scale: float, group_size: int = 64, bits: int = 8,
                            causal=True, window_size=None, sinks=None, backend="auto", return_lse=False,
                            stream=None, softcap=None):
        """:func:`quantized_cascade_paged_attention` over these tables."""
        return self._run(q, k_pages, v_pages, scale, causal, window_size, sinks, backend, return_lse, stream, softcap,
                         bits, group_size)

    def _run(self, q, k_pages, v_pages, *args):
        """The call, checked and prepared once per argument signature (shapes,
        dtypes, options): every layer of a serving step repeats the first
        layer's signature, so the checks (tens of microseconds of Python, a
        tenth of a CPU cascade layer) run once per step. Only the fused CPU
        cascade is kept; other paths, and arguments without a signature, are
        checked on every call."""
        key = _cascade_signature(q, k_pages, v_pages, args)
        prepared = self._prepared.get(key) if key is not None else None
        if prepared is not None:
            return prepared.run_on(q, k_pages, v_pages, args[3])
        call = _prepare_cascade(q, k_pages, v_pages, self, *args)
        if key is not None and call.path == "cascade-cpu":
            self._prepared[key] = call
        return call.run()


def _signature_of(value):
    """An option or array as a cache key: arrays by shape and dtype, plain
    values with their type (``1`` must not stand for ``True``), or None."""
    if isinstance(value, mx.array):
        return ("array", tuple(value.shape), value.dtype)
    if value is None or isinstance(value, (bool, int, float, str)):
        return (type(value), value)
    if isinstance(value, (tuple, list)):
        parts = tuple(_signature_of(v) for v in value)
        return None if None in parts else (type(value), parts)
    if isinstance(value, (mx.Stream, mx.Device)):
        return (type(value), str(value))
    return None


def _cascade_signature(q, k_pages, v_pages, args):
    """What the checks and the plan of a :class:`CascadeTables` call depend
    on besides the tables, or None when an argument has no signature.
    ``args``: (scale, causal, window_size, sinks, backend, return_lse, stream,
    softcap[, bits, group_size])."""
    if not isinstance(q, mx.array):
        return None
    where = args[6] if args[6] is not None else mx.default_device()  # no stream: the default device's
    key = tuple(_signature_of(a) for a in (q, k_pages, v_pages, *args, where)) + (_cpu_kernel_threads(),)
    return None if None in key else key


def _prepare_cascade(q, k_parts, v_parts, tables: CascadeTables, scale, causal, window_size, sinks, backend,
                     return_lse, stream, softcap, bits=0, group_size=0) -> _CascadeCall:
    check_float_array("q", q, 3, "[total_q, q_heads, head_dim]")
    if bits:
        group_size, bits = check_quantization(group_size, bits)
        k_parts = _check_quantized_pages("k_pages", k_parts, group_size, bits)
        v_parts = _check_quantized_pages("v_pages", v_parts, group_size, bits)
        if k_parts[1].dtype != v_parts[1].dtype:
            raise ValueError(
                f"k_pages and v_pages scales need one dtype, got {k_parts[1].dtype} and {v_parts[1].dtype}")
        dtype = mx.result_type(q.dtype, k_parts[1].dtype)
    else:
        check_float_array("k_pages", k_parts, 4, "[num_pages, kv_heads, page_size, head_dim]")
        check_float_array("v_pages", v_parts, 4, "[num_pages, kv_heads, page_size, value_dim]")
        dtype = mx.result_type(q.dtype, k_parts.dtype, v_parts.dtype)
        k_parts, v_parts = (k_parts,), (v_parts,)
    k_shape, v_shape = page_shape(k_parts[0], bits), page_shape(v_parts[0], bits)
    if k_shape[2] == 0:
        raise ValueError(f"k_pages must have page_size >= 1, got shape {k_shape}")
    own_pages, prefix_pages, full_pages, shared, groups, full_table = tables.checked(q, k_shape[0], k_shape[2])
    layout = tables.layout(q, k_shape, v_shape, full_table, full_pages)
    options = _check_options(q, dtype, scale, causal, window_size, sinks, backend, return_lse, stream, softcap)
    full = _PagedCall.build(q, k_parts, v_parts, dtype, layout, full_table, tables.arrays[4], tables.q_lens, sinks,
                            options, "auto" if backend == "fused" else backend, return_lse, stream, bits, group_size,
                            resolve_path=False)
    plan = tables.plan(layout, own_pages, prefix_pages, shared, groups, causal=full.causal,
                       window_size=full.window_size)
    levels = tables.levels(shared, groups, layout) if full.device == mx.gpu else None
    call = _CascadeCall(full, plan, backend, tables._support, levels)
    call.path  # noqa: B018  (backend="fused" raises here, at the call)
    return call


def cascade_paged_attention_path(q, k_pages, v_pages, prefix_table, prefix_lens, prefix_groups, block_table,
                                 kv_lens, *, q_lens=None, scale=1.0, causal=True, window_size=None, sinks=None,
                                 backend="auto", return_lse=False, stream=None, softcap=None, bits=0,
                                 group_size=64) -> CascadePath:
    """Which implementation :func:`cascade_paged_attention` uses:
    ``"cascade-cpu"`` (the three passes on the fused CPU kernel),
    ``"cascade-metal"`` (the Metal cascade kernels, GPU streams), else the
    path of the equivalent paged call over the full tables (``"fused-metal"``
    or ``"reference"``). ``bits`` > 0: quantized ``(packed, scales,
    biases)`` pages as :func:`quantized_cascade_paged_attention` takes them."""
    tables = CascadeTables(prefix_table, prefix_lens, prefix_groups, block_table, kv_lens, q_lens)
    return _prepare_cascade(q, k_pages, v_pages, tables, scale, causal, window_size, sinks, backend, return_lse,
                            stream, softcap, bits, group_size if bits else 0).path


def cascade_paged_attention(
    q: mx.array,
    k_pages: mx.array,
    v_pages: mx.array,
    prefix_table: mx.array,
    prefix_lens: mx.array,
    prefix_groups: mx.array,
    block_table: mx.array,
    kv_lens: mx.array,
    *,
    q_lens: mx.array | None = None,
    scale: float,
    causal: bool = True,
    window_size: int | None = None,
    sinks: mx.array | None = None,
    backend: str = "auto",
    return_lse: bool = False,
    stream: mx.Stream | mx.Device | None = None,
    softcap: float | None = None,
) -> mx.array | tuple[mx.array, mx.array]:
    """:func:`paged_attention` with a shared level: groups of sequences whose
    keys begin with the same pages, read once per group (docs/paged.md,
    "Cascade").

    Sequence ``b`` of group ``g = prefix_groups[b]`` has the keys of
    ``paged_attention`` over the full table ``prefix_table[g,
    :ceil(prefix_lens[g] / page_size)]`` followed by ``block_table[b]``:

    Args:
        prefix_table: int32 ``[G, max_prefix_pages]``, each group's shared pages.
        prefix_lens: int32 ``[G]``, each group's shared keys; a multiple of
            ``page_size`` where a member has keys after it.
        prefix_groups: int32 ``[B]``, the group of each sequence, ``-1`` for none.
        block_table: int32 ``[B, max_pages]``, each sequence's own pages
            (the keys after its prefix).
        kv_lens: int32 ``[B]``, ALL keys of each sequence, prefix included
            (as in :func:`paged_attention`), ``>= prefix_lens[g]``.

    Everything else, the result and the errors as :func:`paged_attention`
    over the full tables (equal to it within float rounding).
    """
    return CascadeTables(prefix_table, prefix_lens, prefix_groups, block_table, kv_lens, q_lens).attention(
        q, k_pages, v_pages, scale=scale, causal=causal, window_size=window_size, sinks=sinks, backend=backend,
        return_lse=return_lse, stream=stream, softcap=softcap)


def quantized_cascade_paged_attention(q, k_pages, v_pages, prefix_table, prefix_lens, prefix_groups, block_table,
                                      kv_lens, *, q_lens=None, scale: float, group_size: int = 64, bits: int = 8,
                                      causal=True, window_size=None, sinks=None, backend="auto", return_lse=False,
                                      stream=None, softcap=None):
    """:func:`cascade_paged_attention` over quantized pages (``(packed,
    scales, biases)`` triples, as :func:`quantized_paged_attention`)."""
    return CascadeTables(prefix_table, prefix_lens, prefix_groups, block_table, kv_lens, q_lens).quantized_attention(
        q, k_pages, v_pages, scale=scale, group_size=group_size, bits=bits, causal=causal, window_size=window_size,
        sinks=sinks, backend=backend, return_lse=return_lse, stream=stream, softcap=softcap)


# ---------------------------------------------------------------- fused Metal kernels
# The Mac host side of the paged kernels (metal/attention_paged.h, plan
# csrc/metal/paged_launch_plan.cpp, primitive csrc/ops/metal_paged_attention.h): what a
# GPU-stream dispatch calls once the arguments are checked (_prepare /
# check_paged_layout) and cast to the call's dtype.


def _metal_inputs(q, k_parts, v_parts, block_table, sinks) -> list:
    return [q, *k_parts, *v_parts, block_table] + ([sinks] if sinks is not None else [])


def metal_paged_reason(q, k_parts, v_parts, block_table, layout: PagedLayout, *, window_size=None, sinks=None,
                       return_lse=False, bits=0, group_size=0, softcap=None) -> str:
    """Why the fused Metal paged kernels cannot run this checked call ("" when
    they can): no Metal build, or what the launch plan refuses (head dims,
    Dv != D, quantization). ``k_parts`` / ``v_parts``: ``[pages]`` or the
    ``(packed, scales, biases)`` triples."""
    ext = _native.ext
    if ext is None or not ext.has_metal():
        return "this build of mlx_attn has no Metal kernels"
    plan = ext.paged_metal_launch_plan(
        _metal_inputs(q, k_parts, v_parts, block_table, sinks), layout.q_lens, layout.kv_lens,
        window_size=window_size or 0, has_sinks=sinks is not None, output_lse=return_lse, bits=bits,
        group_size=group_size, softcap=softcap or 0.0)
    return "" if plan.supported else plan.reason


def fused_metal_paged_attention(q, k_parts, v_parts, block_table, layout: PagedLayout, *, scale, causal, window_size,
                                sinks, return_lse, bits=0, group_size=0, softcap=None, stream=None) -> list:
    """The fused Metal paged kernels on a GPU stream: ``[out]`` or
    ``[out, lse]``. Arguments checked and in one dtype (scales and biases
    too); ``block_table`` int32; lengths from ``layout``."""
    return _native.ext.metal_paged_attention(
        _metal_inputs(q, k_parts, v_parts, block_table, sinks), layout.q_lens, layout.kv_lens, scale=scale,
        causal=causal, window_size=window_size or 0, has_sinks=sinks is not None, output_lse=return_lse, bits=bits,
        group_size=group_size, softcap=softcap or 0.0, stream=stream if stream is not None else mx.gpu)


def _metal_cascade_inputs(q, k_parts, v_parts, levels: _CascadeLevels, sinks) -> list:
    return _metal_inputs(q, k_parts, v_parts, levels.own_table, sinks) + [levels.prefix_table]


def metal_cascade_reason(q, k_parts, v_parts, levels: _CascadeLevels, layout: PagedLayout, *, window_size=None,
                         sinks=None, return_lse=False, bits=0, group_size=0, softcap=None) -> str:
    """Why the Metal cascade kernels cannot run this checked call ("" when
    they can): no Metal build, or what the cascade plan refuses."""
    ext = _native.ext
    if ext is None or not ext.has_metal():
        return "this build of mlx_attn has no Metal kernels"
    plan = ext.cascade_metal_launch_plan(
        _metal_cascade_inputs(q, k_parts, v_parts, levels, sinks), layout.q_lens, levels.own_kv_lens,
        levels.prefix_lens, levels.prefix_groups, window_size=window_size or 0, has_sinks=sinks is not None,
        output_lse=return_lse, bits=bits, group_size=group_size, softcap=softcap or 0.0)
    return "" if plan.supported else plan.reason


def fused_metal_cascade_attention(q, k_parts, v_parts, levels: _CascadeLevels, layout: PagedLayout, *, scale, causal,
                                  window_size, sinks, return_lse, bits=0, group_size=0, softcap=None,
                                  stream=None) -> list:
    """Cascade attention on the Metal kernels (metal/attention_paged_cascade.h):
    ``[out]`` or ``[out, lse]``; arguments checked and in one dtype."""
    return _native.ext.metal_cascade_paged_attention(
        _metal_cascade_inputs(q, k_parts, v_parts, levels, sinks), layout.q_lens, levels.own_kv_lens,
        levels.prefix_lens, levels.prefix_groups, scale=scale, causal=causal, window_size=window_size or 0,
        has_sinks=sinks is not None, output_lse=return_lse, bits=bits, group_size=group_size,
        softcap=softcap or 0.0, stream=stream if stream is not None else mx.gpu)


def metal_cascade_runner(stream):
    """``run(q, k_pages, v_pages, prefix_table, prefix_lens, prefix_groups,
    block_table, kv_lens, *, q_lens, scale, causal, window_size, sinks,
    bits=0, group_size=0)`` on the Metal cascade kernels: the runner of
    :func:`mlx_attn.self_check.check_cascade_variant` and ``mlx-attn doctor``."""

    def run(q, k_pages, v_pages, prefix_table, prefix_lens, prefix_groups, block_table, kv_lens, *, q_lens=None,
            scale, causal=True, window_size=None, sinks=None, bits=0, group_size=0):
        tables = CascadeTables(prefix_table, prefix_lens, prefix_groups, block_table, kv_lens, q_lens)
        k_parts = tuple(k_pages) if bits else (k_pages,)
        v_parts = tuple(v_pages) if bits else (v_pages,)
        k_shape, v_shape = page_shape(k_parts[0], bits), page_shape(v_parts[0], bits)
        _, _, full_pages, shared, groups, full_table = tables.checked(q, k_shape[0], k_shape[2])
        layout = tables.layout(q, k_shape, v_shape, full_table, full_pages)
        return fused_metal_cascade_attention(q, k_parts, v_parts, tables.levels(shared, groups, layout), layout,
                                             scale=scale, causal=causal, window_size=window_size, sinks=sinks,
                                             return_lse=False, bits=bits, group_size=group_size, stream=stream)[0]

    return run


def metal_cascade_trusted(dtype, head_dim: int, *, bits: int = 0, group_size: int = 0, stream=None) -> bool:
    """Whether the cascade kernel variant for this dtype and head dim passed
    its first-use self-check (run now if it has not; a failure warns once
    and disables it: cascade calls then take the paged op over the full tables)."""
    variant = self_check.CascadeVariant(str(dtype).split(".")[-1], head_dim, bits, group_size)
    return self_check.trusted(variant, metal_cascade_runner(stream if stream is not None else mx.gpu))


def metal_paged_runner(stream):
    """``run(q, k_pages, v_pages, block_table, kv_lens, *, q_lens, scale,
    causal, window_size, sinks, bits=0, group_size=0)`` on the fused Metal
    paged kernels: the runner of :func:`mlx_attn.self_check.check_paged_variant`
    and ``mlx-attn doctor``."""

    def run(q, k_pages, v_pages, block_table, kv_lens, *, q_lens=None, scale, causal=True, window_size=None,
            sinks=None, bits=0, group_size=0):
        k_parts = tuple(k_pages) if bits else (k_pages,)
        v_parts = tuple(v_pages) if bits else (v_pages,)
        k_shape, v_shape = page_shape(k_parts[0], bits), page_shape(v_parts[0], bits)
        layout = check_paged_layout(q, k_shape, v_shape, k_shape[0], block_table, kv_lens, q_lens)
        return fused_metal_paged_attention(q, k_parts, v_parts, block_table, layout, scale=scale, causal=causal,
                                           window_size=window_size, sinks=sinks, return_lse=False, bits=bits,
                                           group_size=group_size, stream=stream)[0]

    return run


def metal_paged_trusted(dtype, head_dim: int, *, bits: int = 0, group_size: int = 0, stream=None) -> bool:
    """Whether the paged kernel variant for this dtype and head dim passed its
    first-use self-check (run now if it has not; a failure warns once and
    disables the variant: calls then take the reference path)."""
    variant = self_check.PagedVariant(str(dtype).split(".")[-1], head_dim, bits, group_size)
    return self_check.trusted(variant, metal_paged_runner(stream if stream is not None else mx.gpu))
