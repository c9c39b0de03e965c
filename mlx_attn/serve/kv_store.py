"""The K/V pages of every layer of a model: ``[num_pages, Hkv, page_size, D]``
per layer (float), or ``mx.quantize`` triples of that shape (8- or 4-bit pages,
the ``QuantizedKVCache`` format). Page numbers come from
:class:`mlx_attn.serve.pages.PagePool`; this class only stores."""

from __future__ import annotations

import mlx.core as mx

from mlx_attn import quantized
from mlx_attn.paged import CascadeTables, paged_attention, quantized_paged_attention

__all__ = ["PagedKVStore"]


class PagedKVStore:
    """``layer_shapes``: ``(n_kv_heads, head_dim, value_dim)`` of each layer
    where the layers differ (then ``n_kv_heads``, ``head_dim`` and
    ``value_dim`` are unused); by default every layer has the one shape."""

    def __init__(self, num_pages: int, page_size: int, n_layers: int, n_kv_heads: int, head_dim: int,
                 value_dim: int | None = None, dtype=mx.float16, bits: int | None = None, group_size: int = 64,
                 layer_shapes: list[tuple[int, int, int]] | None = None):
        value_dim = head_dim if value_dim is None else value_dim
        if layer_shapes is None:
            layer_shapes = [(n_kv_heads, head_dim, value_dim)] * n_layers
        elif len(layer_shapes) != n_layers:
            raise ValueError(f"layer_shapes has {len(layer_shapes)} entries for {n_layers} layers")
        self.num_pages, self.page_size, self.dtype = num_pages, page_size, dtype
        self.bits, self.group_size = bits, group_size
        if bits is not None:
            self.group_size, self.bits = quantized.check_quantization(group_size, bits)
            for name, dim in sorted({("head_dim", d) for _, d, _ in layer_shapes} |
                                    {("value_dim", d) for _, _, d in layer_shapes}):
                quantized.check_quantizable_dim(name, dim, group_size)

        def empty(heads, dim):
            pages = mx.zeros((num_pages, heads, page_size, dim), dtype=dtype)
            return pages if bits is None else tuple(mx.quantize(pages, group_size=group_size, bits=bits))

        self.keys = [empty(heads, dim) for heads, dim, _ in layer_shapes]
        self.values = [empty(heads, dim) for heads, _, dim in layer_shapes]

    @property
    def nbytes(self) -> int:
        parts = lambda x: x if isinstance(x, tuple) else (x,)  # noqa: E731
        return sum(a.nbytes for layer in self.keys + self.values for a in parts(layer))

    def _put(self, stored, pages: mx.array, slots: mx.array, new: mx.array):
        """``stored`` with token rows ``new [T, Hkv, D]`` at (page, slot)."""
        if self.bits is None:
            stored[pages, :, slots] = new.astype(self.dtype)
            return stored
        parts = mx.quantize(new.astype(self.dtype), group_size=self.group_size, bits=self.bits)
        out = []
        for part, value in zip(stored, parts):
            part[pages, :, slots] = value
            out.append(part)
        return tuple(out)

    def write(self, layer: int, pages: mx.array, slots: mx.array, keys: mx.array, values: mx.array) -> None:
        """Store the K/V of ``T`` tokens (``[T, Hkv, D]``) of one layer at
        pages ``pages`` and slots ``slots`` (int32 ``[T]``)."""
        self.keys[layer] = self._put(self.keys[layer], pages, slots, keys)
        self.values[layer] = self._put(self.values[layer], pages, slots, values)

    def copy(self, copies) -> None:
        """Copy-on-write: page ``source`` into page ``destination`` for each
        pair, in every layer."""
        if not copies:
            return
        src = mx.array([s for s, _ in copies], dtype=mx.int32)
        dst = mx.array([d for _, d in copies], dtype=mx.int32)
        parts = lambda stored: stored if isinstance(stored, tuple) else (stored,)  # noqa: E731
        # the source pages are read (evaluated) first: a write whose pool is
        # also read by a pending gather cannot update it in place and would
        # copy every layer's whole pool
        sources = [[part[src] for part in parts(stored)] for stored in self.keys + self.values]
        mx.eval(sources)

        def moved(stored, rows):
            out = []
            for part, part_rows in zip(parts(stored), rows):
                part[dst] = part_rows
                out.append(part)
            return tuple(out) if isinstance(stored, tuple) else out[0]

        layers = len(self.keys)
        self.keys = [moved(x, rows) for x, rows in zip(self.keys, sources[:layers])]
        self.values = [moved(x, rows) for x, rows in zip(self.values, sources[layers:])]

    def attend(self, layer: int, q: mx.array, block_table: mx.array, kv_lens: mx.array, q_lens: mx.array, *,
               scale: float, cascade: CascadeTables | None = None, **options) -> mx.array:
        """:func:`mlx_attn.paged.paged_attention` over this layer's pages;
        with ``cascade`` (the step's shared-prefix groups, checked once for
        every layer) cascade attention instead, ``block_table``, ``kv_lens``
        and ``q_lens`` then unused (``cascade`` holds them: the same keys,
        the shared pages read once per group)."""
        if cascade is not None:
            if self.bits is None:
                return cascade.attention(q, self.keys[layer], self.values[layer], scale=scale, **options)
            return cascade.quantized_attention(q, self.keys[layer], self.values[layer], scale=scale,
                                               group_size=self.group_size, bits=self.bits, **options)
        if self.bits is None:
            return paged_attention(q, self.keys[layer], self.values[layer], block_table, kv_lens, q_lens=q_lens,
                                   scale=scale, **options)
        return quantized_paged_attention(q, self.keys[layer], self.values[layer], block_table, kv_lens,
                                         q_lens=q_lens, scale=scale, group_size=self.group_size, bits=self.bits,
                                         **options)
