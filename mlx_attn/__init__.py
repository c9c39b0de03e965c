"""mlx_attn: fast, exact attention for MLX.

``scaled_dot_product_attention`` is a drop-in for
``mx.fast.scaled_dot_product_attention`` with three implementations: the
pure-MLX reference path, a fused tiled CPU kernel and fused Metal kernels.
"""

# Before anything imports MLX: on Linux, bind MLX's float32 matmuls to a
# system OpenBLAS instead of the reference BLAS its wheel bundles (_blas.py).
from mlx_attn._blas import preload_fast_blas

preload_fast_blas()

from mlx_attn.attention import MultiHeadAttention
from mlx_attn import distributed  # ring attention: mlx_attn.distributed.ring_attention
from mlx_attn.cache import ConcatKVCache, KVCache, QuantizedKVCache, RotatingKVCache
from mlx_attn.ops import attention_path, scaled_dot_product_attention
from mlx_attn.quantized import quantized_attention_path, quantized_scaled_dot_product_attention
from mlx_attn.reference import reference_attention
from mlx_attn.rope import RoPE

__version__ = "0.1.0"

__all__ = [
    "scaled_dot_product_attention",
    "attention_path",
    "reference_attention",
    "MultiHeadAttention",
    "RoPE",
    "ConcatKVCache",
    "KVCache",
    "RotatingKVCache",
    "QuantizedKVCache",
    "quantized_scaled_dot_product_attention",
    "quantized_attention_path",
]
