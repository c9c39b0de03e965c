"""Run the fused Metal attention the way the Mac host does: from the C++
launch plan. On Linux the .metal sources execute in the MSL emulator; on a
Mac with Metal, the real kernels run through mlx_attn on the GPU."""

from __future__ import annotations

import struct
from pathlib import Path

import mlx.core as mx
import numpy as np

import mlx_attn
from mlx_attn import _ext
from mlx_attn.metal_support import launch_plan

REPO = Path(__file__).resolve().parent.parent
METAL_SOURCES = sorted((REPO / "metal").glob("*.metal"))
REAL_METAL = mx.metal.is_available() and _ext.has_metal()


def to_numpy(a: mx.array) -> np.ndarray:
    """float32/float16 as themselves, bfloat16 as its uint16 bits."""
    if a.dtype == mx.bfloat16:
        return np.array(a.view(mx.uint16))
    return np.array(a)


def from_numpy(x: np.ndarray, dtype) -> mx.array:
    if dtype == mx.bfloat16:
        return mx.array(x).view(mx.bfloat16)
    return mx.array(x)


def element_strides(x: np.ndarray, shape=None) -> list[int]:
    view = x if shape is None else np.broadcast_to(x.reshape((1,) * (4 - x.ndim) + x.shape), shape)
    return [s // x.itemsize for s in view.strides]


def physical_layout(x: np.ndarray, layout: str | None):
    """(buffer, view): the memory an input lives in and its [B, H, T, D] view.
    "seq_major": stored [B, T, H, D] (the projection layout), so the head and
    sequence strides are swapped; "cache": the first T of a longer
    preallocated cache whose unused tail is NaN (a read past T would show)."""
    if layout is None:
        return x, x
    if layout == "seq_major":
        buffer = np.ascontiguousarray(x.transpose(0, 2, 1, 3))
        return buffer, buffer.transpose(0, 2, 1, 3)
    if layout == "cache":
        b, h, t, d = x.shape
        nan = np.array(0x7FC0, np.uint16) if x.dtype == np.uint16 else np.array(np.nan, x.dtype)
        buffer = np.full((b, h, t + 7, d), nan, x.dtype)
        buffer[:, :, :t] = x
        return buffer, buffer[:, :, :t]
    raise ValueError(f"unknown layout {layout!r}")


def mx_view(x: mx.array, layout: str | None) -> mx.array:
    """The same layout as an MLX view (what the real kernels receive)."""
    if layout is None:
        return x
    buffer = from_numpy(physical_layout(to_numpy(x), layout)[0], x.dtype)
    return buffer.transpose(0, 2, 1, 3) if layout == "seq_major" else buffer[:, :, : x.shape[2]]


class EmulatedMetal:
    def __init__(self, fast_math: bool, sources=None):
        import msl_emulator

        self.fast_math = fast_math
        self.library = msl_emulator.compile_library(sources or METAL_SOURCES, include_dirs=[REPO], fast_math=fast_math)

    def __call__(self, q, k, v, *, scale, mask=None, sinks=None, window_size=None, layout=None):
        buffers = {"mask": np.zeros(1, np.uint8)}
        strides = {}
        for name, x in (("q", q), ("k", k), ("v", v)):
            buffers[name], view = physical_layout(to_numpy(x), layout)
            strides[name] = element_strides(view)
        nq = buffers["q"]
        buffers["sinks"] = np.zeros(1, nq.dtype)
        if isinstance(mask, mx.array):
            m = mask if mask.dtype == mx.bool_ else mask.astype(q.dtype)
            nm = np.ascontiguousarray(to_numpy(m))
            full = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
            strides["mask"] = element_strides(nm, full)
            buffers["mask"] = nm.view(np.uint8) if nm.dtype == np.bool_ else nm
        if sinks is not None:
            buffers["sinks"] = np.ascontiguousarray(to_numpy(sinks.astype(q.dtype)))
        plan = launch_plan(q, k, v, mask, sinks, window_size, scale=scale, strides=strides)
        assert plan["supported"], plan["reason"]
        out = np.zeros((q.shape[0], q.shape[1], q.shape[2], v.shape[3]), dtype=nq.dtype)
        buffers["out"] = out
        buffers["params"] = plan["params"]
        buffers["splits"] = struct.pack("i", plan["splits"])
        for name, elements in plan["scratch"].items():
            buffers[name] = np.full(elements, np.nan, np.float32)  # unwritten partials would show
        self.last_plan = plan
        for step in plan["dispatches"]:
            bound = {i: buffers[name] for i, name in enumerate(step["buffers"])}
            self.library.dispatch(step["kernel"], step["grid"], step["threadgroup"], bound)
        return from_numpy(out, q.dtype)


class RealMetal:
    fast_math = True

    def __call__(self, q, k, v, layout=None, **kw):
        q, k, v = (mx_view(x, layout) for x in (q, k, v))
        out = mlx_attn.scaled_dot_product_attention(q, k, v, backend="fused", stream=mx.gpu, **kw)
        mx.eval(out)
        return out
