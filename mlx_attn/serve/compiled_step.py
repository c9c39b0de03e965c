"""The engine's decode-only step, traced once per shape and replayed.

A step whose every row is one request's next token (no prompt chunk, no
drafts, no shared-prefix groups, no recurrent state) is the same graph every
time: only its integer arrays change (tokens, positions, where each K/V row
goes, the block table, the lengths). :class:`CompiledDecodeSteps` runs the
model's own forward for such a step under ``mx.compile``, with those arrays
and every layer's K/V pages as inputs and the updated pages as outputs, so
the ~20 small operations per layer are not rebuilt in Python each token and
the elementwise ones are fused. The engine samples from the step's logits
before anything is evaluated, so the step and its sampling are one
evaluation.

One trace per (rows, block-table width): the table's width is padded to a
power of two (the kernel reads only the pages each length needs), so a
request growing token by token replays one trace for a long time.

The attention is the fused CPU paged primitive called directly
(``_ext.paged_attention``): :func:`mlx_attn.paged.paged_attention` reads the
integer arguments on the host to check them, which a traced function cannot;
:meth:`CompiledDecodeSteps.step_arrays` checks them once per step instead.
Only on MLX's CPU device with the native extension; elsewhere (and for a
problem the fused kernel does not take, found when first traced) the engine's
eager step runs."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlx_attn import _native
from mlx_attn.lm.models.base import AttentionHook, Decoder
from mlx_attn.rope import RoPE, rope_angles
from mlx_attn.serve.kv_store import PagedKVStore

__all__ = ["CompiledDecodeSteps", "MIN_TABLE_WIDTH"]

# the narrowest block table a trace takes (pages of each sequence): a short
# request's whole life fits one trace
MIN_TABLE_WIDTH = 16


class _Unsupported(Exception):
    """The fused paged kernel does not take this model's attention."""


class _PagedDecodeAttention(AttentionHook):
    """One traced decode step's attention: each row's K/V written into the
    pages passed in (kept as the step's outputs), then the fused paged kernel."""

    def __init__(self, store: PagedKVStore, keys: list, values: list, positions, write_pages, write_slots,
                 block_table, kv_lens, q_lens):
        self.store, self.keys, self.values = store, list(keys), list(values)
        self._positions, self.write_pages, self.write_slots = positions, write_pages, write_slots
        self.block_table, self.kv_lens, self.q_lens = block_table, kv_lens, q_lens
        self._rotations = {}

    def positions(self, length: int) -> mx.array:
        return self._positions

    def _rotation(self, rope: RoPE) -> tuple[mx.array, mx.array]:
        """Each row's cos and sin ``[T, dims / 2]`` (the angles ``rope``
        computes), once per step and parameter set."""
        key = (rope.dims, rope.base, rope.scale)
        if key not in self._rotations:
            angles = rope_angles(self._positions, rope.dims, rope.base, rope.scale)
            self._rotations[key] = (mx.cos(angles), mx.sin(angles))
        return self._rotations[key]

    def attend_projected(self, layer, rope, queries, keys, values):
        """The attention block in four nodes (float pages, a plain RoPE):
        the rotated keys and the values written into their pages, the
        rotated queries, the fused paged kernel; not the ~25 reshapes,
        transposes, RoPE operations and scatters of ``__call__``."""
        i = layer.index
        if self.store.bits is not None or type(rope) is not RoPE or queries.shape[0] != 1 or \
                queries.dtype != self.keys[i].dtype:  # __call__ refuses what the eager step would convert
            return None
        ext = _native.ext
        cos, sin = self._rotation(rope)
        self.keys[i] = ext.paged_rows_write(self.keys[i], keys, self.write_pages, self.write_slots, cos, sin,
                                            traditional=rope.traditional)
        self.values[i] = ext.paged_rows_write(self.values[i], values, self.write_pages, self.write_slots)
        q = ext.rotated_rows(queries, cos, sin, heads=queries.shape[-1] // layer.head_dim,
                             traditional=rope.traditional)
        out = self._attend(layer, q, [self.keys[i]], [self.values[i]])
        return out.reshape(1, out.shape[0], -1)

    def _attend(self, layer, q, k_parts: list, v_parts: list) -> mx.array:
        """The fused paged kernel over one layer's pages: ``q [T, Hq, D]`` -> ``[T, Hq, Dv]``."""
        store = self.store
        options = dict(scale=layer.scale, causal=True, window_size=layer.window_size or 0, sinks=None,
                       output_lse=False, bits=store.bits or 0, group_size=store.group_size if store.bits else 0,
                       softcap=0.0)
        ext = _native.ext
        reason = ext.paged_unsupported_reason(q, k_parts, v_parts, self.block_table, self.kv_lens, self.q_lens,
                                              device=mx.cpu, **options)
        if reason:
            raise _Unsupported(reason)
        return ext.paged_attention(q, k_parts, v_parts, self.block_table, self.kv_lens, self.q_lens, stream=None,
                                   **options)[0]

    def __call__(self, layer, queries, keys, values):
        rows = lambda x: x[0].swapaxes(0, 1)  # noqa: E731  [1, H, T, D] -> [T, H, D]
        i, store = layer.index, self.store
        self.keys[i] = store._put(self.keys[i], self.write_pages, self.write_slots, rows(keys))
        self.values[i] = store._put(self.values[i], self.write_pages, self.write_slots, rows(values))
        parts = lambda x: list(x) if isinstance(x, tuple) else [x]  # noqa: E731
        k_parts, v_parts = parts(self.keys[i]), parts(self.values[i])
        q = rows(queries)
        if q.dtype != k_parts[-1].dtype:  # the eager call would convert the pool; that step stays eager
            raise _Unsupported(f"queries are {q.dtype}, pages {k_parts[-1].dtype}")
        return self._attend(layer, q, k_parts, v_parts).swapaxes(0, 1)[None]


class CompiledDecodeSteps:
    """Decode-only steps of ``model`` over ``store``'s pages, compiled.

    ``step(arrays)`` takes :meth:`step_arrays`' arrays and returns the
    logits ``[rows, vocab]``, lazy; the store's pages are replaced by the
    step's updated ones (each layer's new pages feed its attention, so
    evaluating the logits writes them). The model's weights are captured by the traces: build a new
    instance after changing them."""

    def __init__(self, model: Decoder, store: PagedKVStore):
        self.model, self.store = model, store
        self.disabled_reason: str | None = None
        self.traced_shapes: set[tuple[int, int]] = set()  # (rows, table width): one trace each
        self.steps = 0  # steps run compiled (for tests and measurements)
        self._forward = mx.compile(self._traced_step)

    @staticmethod
    def available(model) -> str | None:
        """None when a decode step of ``model`` can be compiled here, else why not."""
        if not isinstance(model, Decoder):
            return "only this package's decoders (an mlx-lm model's forward is not traced)"
        if _native.ext is None:
            return _native.MISSING_REASON
        if mx.default_device() != mx.cpu:
            return "the compiled step calls the fused CPU paged kernel (MLX's CPU device only)"
        return None

    def _traced_step(self, tokens, positions, write_pages, write_slots, block_table, kv_lens, q_lens, keys, values):
        hook = _PagedDecodeAttention(self.store, keys, values, positions, write_pages, write_slots, block_table,
                                     kv_lens, q_lens)
        logits = self.model(tokens[None], attention=hook)[0]
        return logits, hook.keys, hook.values

    def step_arrays(self, arrays: dict[str, np.ndarray]) -> dict[str, mx.array]:
        """The step's inputs from :meth:`StepPlan.arrays` of a decode-only
        plan: the block table padded to a power-of-two width (at least
        :data:`MIN_TABLE_WIDTH`), its read entries checked to be pages."""
        table, kv_lens = arrays["block_table"], arrays["kv_lens"]
        page_size, num_pages = self.store.page_size, self.store.num_pages
        needed = (kv_lens.astype(np.int64) + page_size - 1) // page_size
        read = np.arange(table.shape[1]) < needed[:, None]
        if ((table < 0) | (table >= num_pages))[read].any() or (needed > table.shape[1]).any():
            raise ValueError("the step's block table names pages outside the pool")  # a scheduler bug
        width = max(MIN_TABLE_WIDTH, 1 << max(int(table.shape[1]) - 1, 0).bit_length())
        padded = np.zeros((table.shape[0], width), np.int32)  # page 0: any page index is safe to hold
        padded[:, : table.shape[1]] = np.where(read, table, 0)
        out = {name: mx.array(arrays[name]) for name in ("tokens", "positions", "write_pages", "write_slots",
                                                        "kv_lens", "q_lens")}
        out["block_table"] = mx.array(padded)
        return out

    def step(self, arrays: dict[str, mx.array]):
        """The step's logits ``[rows, vocab]``, or None when this
        model's attention cannot take the compiled step (then
        :attr:`disabled_reason` says why and later calls return None at once)."""
        if self.disabled_reason is not None:
            return None
        store = self.store
        try:
            logits, keys, values = self._forward(
                arrays["tokens"], arrays["positions"], arrays["write_pages"], arrays["write_slots"],
                arrays["block_table"], arrays["kv_lens"], arrays["q_lens"], store.keys, store.values)
        except _Unsupported as why:
            self.disabled_reason = str(why)
            return None
        # the step's pages replace the old ones before anything evaluates, so
        # the page writes update the pool in place (no other reference is left)
        store.keys, store.values = list(keys), list(values)
        self.traced_shapes.add((int(arrays["tokens"].shape[0]), int(arrays["block_table"].shape[1])))
        self.steps += 1
        return logits
