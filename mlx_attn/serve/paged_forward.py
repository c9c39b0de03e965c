"""A model's forward over the paged K/V store: the weights as the
engine's products run them, the attention hook of one step, and mlx-lm
models behind the paged path. Shared by the engine and its draft model
(:mod:`mlx_attn.serve.draft_model`), which runs the same forward over a
store of its own."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_map_with_path

from mlx_attn.lm import quantized_matmul
from mlx_attn.lm.models.base import AttentionHook, Decoder, LayerAttention
from mlx_attn.lm.quantized_matmul import hold_float32_weights, use_row_adaptive_matmuls
from mlx_attn.paged import CascadeTables
from mlx_attn.serve.cascade_groups import SharedPrefixLevels
from mlx_attn.serve.kv_store import PagedKVStore

__all__ = ["WEIGHT_CHOICES", "prepare_weights", "PagedAttention", "paged_model"]

WEIGHT_CHOICES = ("auto", "packed", "float32", "as-loaded")


def prepare_weights(model: Decoder, weights: str = "auto") -> str:
    """Hold ``model``'s weights (in place) the way the engine's matmuls run
    fastest on this device; returns the choice made.

    ``"float32"``: every float weight cast to float32 and every quantized
    layer holding its float32 weight beside its packed one
    (:func:`mlx_attn.lm.quantized_matmul.hold_float32_weights`): batched
    rows multiply the float32 weight through the BLAS (what MLX's CPU device
    does well), a step of fewer rows (one request decoding) reads the packed
    weight through the fused CPU matrix-vector product, both with the same
    float32 weight values. ``"as-loaded"``: untouched (quantized matmuls:
    what MLX's GPU does well). ``"packed"``: as ``"float32"`` without the
    held float32 weights: every step reads the packed weight through the
    integer matrix-vector product (faster than the BLAS on a held weight up
    to ~64 rows, about level past it, and no dequantized weight per call).
    ``"auto"``: on MLX's CPU device ``"packed"`` (``"float32"`` when
    ``MATVEC_PRODUCT`` is ``"float"``), else ``"as-loaded"``."""
    if weights not in WEIGHT_CHOICES:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_CHOICES)}, got {weights!r}")
    if weights == "auto":
        if mx.default_device() != mx.cpu:
            weights = "as-loaded"
        else:
            weights = "float32" if quantized_matmul.MATVEC_PRODUCT == "float" else "packed"
    if weights in ("float32", "packed"):
        # packed: the scales and biases of the linear layers the products read
        # stay as loaded (a decode step streams 2 bytes a group of each, not 4;
        # the same values). An embedding's stay float32: its lookups then
        # dequantize in float32 (with float16 ones a compiled step spent 75 ms
        # of a 90 ms token converting float16 to float32, source not found).
        as_loaded = _product_scales(model) if weights == "packed" else set()
        model.update(tree_map_with_path(
            lambda path, a: a.astype(mx.float32) if mx.issubdtype(a.dtype, mx.floating) and path not in as_loaded
            else a, model.parameters()))
        mx.eval(model.parameters())
        if weights == "float32":
            hold_float32_weights(model)
        else:  # packed: the integer product at every row count, no dequantized transients
            use_row_adaptive_matmuls(model, dequantize_many_rows=quantized_matmul.MATVEC_PRODUCT == "float")
    return weights


def _product_scales(model: Decoder) -> set[str]:
    """The parameter paths of the scales and biases of every quantized linear
    layer the fused CPU products read."""
    return {f"{name}.{part}" if name else part for name, module in model.named_modules()
            if isinstance(module, nn.QuantizedLinear) and quantized_matmul.product_reads(module)
            for part in ("scales", "biases")}


class PagedAttention(AttentionHook):
    """The attention hook of one step: K/V into pages, paged attention out."""

    def __init__(self, store: PagedKVStore, arrays: dict[str, np.ndarray], logit_rows: np.ndarray | None = None,
                 request_ids: Sequence[Hashable] = (), cascade: SharedPrefixLevels | None = None):
        self.store = store
        # the host arrays and each row's request: models that keep a state per
        # request (hybrid mlx-lm models) split the step by request
        self.host_arrays, self.host_logit_rows, self.request_ids = arrays, logit_rows, tuple(request_ids)
        self.arrays = {name: mx.array(value) for name, value in arrays.items()}
        self.logit_rows = None if logit_rows is None else mx.array(logit_rows, dtype=mx.int32)
        # the step's shared-prefix groups, checked and planned once for every layer (None: plain paged)
        self.cascade = None if cascade is None else CascadeTables(
            *(mx.array(a) for a in (cascade.prefix_table, cascade.prefix_lens, cascade.prefix_groups,
                                    cascade.block_table)), self.arrays["kv_lens"], self.arrays["q_lens"])

    def positions(self, length: int) -> mx.array:
        return self.arrays["positions"]

    def __call__(self, layer: LayerAttention, queries, keys, values):
        a = self.arrays
        rows = lambda x: x[0].swapaxes(0, 1)  # noqa: E731  [1, H, T, D] -> [T, H, D]
        self.store.write(layer.index, a["write_pages"], a["write_slots"], rows(keys), rows(values))
        out = self.store.attend(layer.index, rows(queries), a["block_table"], a["kv_lens"], a["q_lens"],
                                scale=layer.scale, window_size=layer.window_size, cascade=self.cascade)
        return out.swapaxes(0, 1)[None]


def paged_model(model):
    """``model`` as the engine runs it: an mlx_attn :class:`Decoder` as it
    is, an mlx-lm model (:class:`mlx_attn.lm.mlx_lm_models.MlxLmModel`)
    through :class:`mlx_attn.serve.mlx_lm_paged.MlxLmPagedModel`."""
    if isinstance(model, Decoder):
        return model
    from mlx_attn.lm.mlx_lm_models import MlxLmModel  # noqa: PLC0415 (imports no mlx-lm itself)

    if isinstance(model, MlxLmModel):
        from mlx_attn.serve.mlx_lm_paged import MlxLmPagedModel  # noqa: PLC0415 (needs the mlx-lm extra)

        return MlxLmPagedModel(model)
    raise ValueError(f"model must be an mlx_attn.lm Decoder or an mlx-lm model (mlx_attn.lm.mlx_lm_models.load), "
                     f"got {type(model).__name__}")
