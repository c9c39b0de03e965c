"""The arguments every attention call (dense, quantized, paged) parses alike:
the scale, the softcap, bool flags, the sliding window, sinks and the
stream's device. Each bad value raises ``ValueError`` naming the argument,
with one message whichever call received it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

__all__ = [
    "FLOAT32_MAX", "FLOAT32_TINY", "WINDOW_LIMIT", "shape_text", "as_scale", "as_softcap", "as_flag",
    "check_window_size", "check_sinks", "device_type",
]

FLOAT32_MAX = float(np.finfo(np.float32).max)
FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal float32
# Windows beyond any position are plain causal attention; the kernels take int32.
WINDOW_LIMIT = 2**31 - 1


def shape_text(a) -> str:
    """An array's shape as the error messages write it: ``(2, 8, 16, 64)``."""
    return "(" + ", ".join(str(d) for d in a.shape) + ")"


def as_scale(scale) -> float:
    """What mx.fast accepts as a scale (Python/NumPy real scalars, 0-d NumPy
    arrays, size-1 MLX arrays), as a float finite in float32."""
    if isinstance(scale, mx.array):
        if scale.size != 1 or mx.issubdtype(scale.dtype, mx.complexfloating):
            raise ValueError(f"scale must be a real number or a size-1 array, got an array of shape "
                             f"{shape_text(scale)} and dtype {scale.dtype}")
        value = scale.item()
    elif isinstance(scale, np.ndarray):
        if scale.ndim != 0 or not np.isrealobj(scale) or scale.dtype.kind not in "biuf":
            raise ValueError(f"scale must be a real number or a 0-d array, got a NumPy array of shape "
                             f"{scale.shape} and dtype {scale.dtype}")
        value = scale.item()
    elif isinstance(scale, (int, float, np.integer, np.floating, np.bool_)):
        value = scale
    else:
        raise ValueError(f"scale must be a real number, got {type(scale).__name__}")
    try:
        value = float(value)
    except OverflowError:  # a Python int beyond any float
        value = float("inf") if value > 0 else float("-inf")
    if not abs(value) <= FLOAT32_MAX:
        raise ValueError(f"scale must be finite in float32 (|scale| <= {FLOAT32_MAX:.8g}), got {value!r}")
    return value


def as_softcap(softcap) -> float | None:
    """``softcap``: None, or a positive number, normal and finite in float32
    (Python or NumPy reals, not bools), as a float."""
    if softcap is None:
        return None
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, (int, float, np.integer, np.floating)):
        raise ValueError(f"softcap must be a positive number or None, got {softcap!r}")
    try:
        value = float(softcap)
    except OverflowError:  # a Python int beyond any float
        value = float("inf")
    # normal in float32: a denormal cap would flush to 0 where kernels flush denormals
    if not FLOAT32_TINY <= value <= FLOAT32_MAX:
        raise ValueError(
            f"softcap must be a positive number, normal and finite in float32 "
            f"({FLOAT32_TINY:.8g} <= softcap <= {FLOAT32_MAX:.8g}), or None; got {softcap!r}"
        )
    return value


def as_flag(name: str, value) -> bool:
    """A bool flag: Python or NumPy bools, as a Python bool."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def check_window_size(window_size) -> int | None:
    """``window_size``: None or a positive integer (not a bool), as an int
    capped at :data:`WINDOW_LIMIT`."""
    if window_size is None:
        return None
    if isinstance(window_size, (bool, np.bool_)) or not isinstance(window_size, (int, np.integer)) or window_size < 1:
        raise ValueError(f"window_size must be a positive integer or None, got {window_size!r}")
    return min(int(window_size), WINDOW_LIMIT)


def check_sinks(sinks, q_heads: int, dtype: mx.Dtype) -> None:
    """``sinks``: None or a floating ``[q_heads]`` array whose dtype promotes
    to the output dtype."""
    if sinks is None:
        return
    if not isinstance(sinks, mx.array):
        raise ValueError(f"sinks must be an mlx array, got {type(sinks).__name__}")
    if sinks.ndim != 1 or sinks.shape[0] != q_heads:
        raise ValueError(f"sinks must have shape [q_heads] = [{q_heads}], got {shape_text(sinks)}")
    if not mx.issubdtype(sinks.dtype, mx.floating):
        raise ValueError(f"sinks must be floating point, got {sinks.dtype}")
    if mx.result_type(sinks.dtype, dtype) != dtype:
        raise ValueError(f"sinks dtype {sinks.dtype} must promote to the output dtype {dtype}")


def device_type(stream) -> mx.DeviceType:
    """The device type a ``stream`` argument runs on (None: the default
    device's); any other type raises."""
    if stream is None:
        return mx.default_device().type
    if isinstance(stream, mx.Stream):
        return stream.device.type
    if isinstance(stream, mx.Device):
        return stream.type
    if isinstance(stream, mx.DeviceType):  # mx.cpu / mx.gpu
        return stream
    raise ValueError(f"stream must be an mlx Stream, Device, mx.cpu/mx.gpu or None, got {type(stream).__name__}")
