"""mlx_attn: fast, exact attention for MLX.

``scaled_dot_product_attention`` is a drop-in for
``mx.fast.scaled_dot_product_attention`` with three implementations: the
pure-MLX reference path, a fused tiled CPU kernel and fused Metal kernels.

Importing ``mlx_attn`` changes nothing in the process: the names below load
their modules on first use, and MLX is imported then. On Linux,
:func:`use_system_blas` (called before anything imports ``mlx.core``) binds
MLX's float32 matmuls to a system OpenBLAS; the ``mlx-attn`` command, the
examples and the training script call it, a library user may.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from mlx_attn._blas import blas_choice, use_system_blas  # imports no MLX

__version__ = "0.1.0"

# exported name -> the module that defines it (imported on first use)
_EXPORTS = {
    "scaled_dot_product_attention": "mlx_attn.ops",
    "attention_path": "mlx_attn.ops",
    "reference_attention": "mlx_attn.reference",
    "MultiHeadAttention": "mlx_attn.attention",
    "RoPE": "mlx_attn.rope",
    "ConcatKVCache": "mlx_attn.cache",
    "KVCache": "mlx_attn.cache",
    "RotatingKVCache": "mlx_attn.cache",
    "QuantizedKVCache": "mlx_attn.cache",
    "quantized_scaled_dot_product_attention": "mlx_attn.quantized",
    "quantized_attention_path": "mlx_attn.quantized",
    "paged_attention": "mlx_attn.paged",
    "quantized_paged_attention": "mlx_attn.paged",
    "cascade_paged_attention": "mlx_attn.paged",
    "quantized_cascade_paged_attention": "mlx_attn.paged",
}

__all__ = [*_EXPORTS, "use_system_blas", "blas_choice"]

if TYPE_CHECKING:  # for type checkers and IDEs; at run time __getattr__ loads these
    from mlx_attn import distributed
    from mlx_attn.attention import MultiHeadAttention
    from mlx_attn.cache import ConcatKVCache, KVCache, QuantizedKVCache, RotatingKVCache
    from mlx_attn.ops import attention_path, scaled_dot_product_attention
    from mlx_attn.paged import (cascade_paged_attention, paged_attention, quantized_cascade_paged_attention,
                                quantized_paged_attention)
    from mlx_attn.quantized import quantized_attention_path, quantized_scaled_dot_product_attention
    from mlx_attn.reference import reference_attention
    from mlx_attn.rope import RoPE


def __getattr__(name: str):
    if name.startswith("__"):  # probes such as __wrapped__ are no submodules
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    else:  # a submodule, e.g. mlx_attn.distributed
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as error:
            if error.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__():
    return sorted({*globals(), *__all__})
