"""Argument checks shared by the library's modules, masks, RoPE and caches.

Policy: every bad argument raises ``ValueError`` naming it (wrong types
included, so callers catch one exception type). Sizes are checked against
:data:`MAX_DIM` / :data:`MAX_ELEMENTS` before anything is allocated.
"""

from __future__ import annotations

import math
import numbers

import mlx.core as mx
import numpy as np

# The element types of attention's inputs (and of quantized scales).
FLOAT_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
# MLX shapes are int32: no axis can be longer than this.
MAX_DIM = 2**31 - 1
# The largest array (in elements) a builder here agrees to create: a 2 GiB
# boolean mask. Bigger problems use mask="causal" / window_size instead.
MAX_ELEMENTS = 2**31 - 1


def check_int(name: str, value, *, minimum: int | None = None, maximum: int | None = MAX_DIM) -> int:
    """``value`` as an int; bools, floats, strings and arrays are rejected."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    value = int(value)
    if minimum is not None and value < minimum:
        wanted = "positive" if minimum == 1 else f">= {minimum}"
        raise ValueError(f"{name} must be {wanted}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def check_optional_int(name: str, value, **bounds) -> int | None:
    return None if value is None else check_int(name, value, **bounds)


def check_real(name: str, value, *, positive: bool = False) -> float:
    """``value`` as a finite float (NaN and infinities rejected)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def check_bool(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
    return bool(value)


def check_array(name: str, value, *, ndim: int | None = None, floating: bool = False) -> mx.array:
    if not isinstance(value, mx.array):
        raise ValueError(f"{name} must be an mlx.core.array, got {type(value).__name__}")
    if ndim is not None and value.ndim != ndim:
        raise ValueError(f"{name} must have rank {ndim}, got shape {tuple(value.shape)}")
    if floating and value.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be floating point (float16, bfloat16 or float32), got {value.dtype}")
    return value


def check_elements(name: str, shape) -> None:
    """Refuse to build an array of ``shape`` larger than MAX_ELEMENTS."""
    count = math.prod(shape)
    if count > MAX_ELEMENTS:
        raise ValueError(
            f"{name} would have shape {tuple(shape)} = {count} elements, more than the limit {MAX_ELEMENTS}"
        )


def check_mask_dtype(name: str, dtype) -> mx.Dtype:
    """A mask dtype: bool (boolean mask) or floating (additive mask)."""
    if not isinstance(dtype, mx.Dtype):
        raise ValueError(f"{name} must be an mlx dtype (mx.bool_ or a float dtype), got {dtype!r}")
    if dtype != mx.bool_ and not mx.issubdtype(dtype, mx.floating):
        raise ValueError(f"{name} must be mx.bool_ or a floating dtype, got {dtype}")
    return dtype
