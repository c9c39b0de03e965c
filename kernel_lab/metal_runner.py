"""Run the fused Metal attention the way the Mac host does: from the C++
launch plan. On Linux the .metal sources execute in the MSL emulator; on a
Mac with Metal, the real kernels run through mlx_attn on the GPU."""

from __future__ import annotations

import struct

import mlx.core as mx
import numpy as np

import mlx_attn
from mlx_attn import _ext
from mlx_attn.metal_support import launch_plan
from mlx_attn.quantized import quantized_launch_plan

from kernel_lab.checkout import REPO

# the dense forward plans' kernels (the paged families run from
# kernel_lab/paged_metal_runner.py, the backward families from their own builds:
# tests/test_metal_backward*.py, the quantized prefill from a build trimmed to
# the instantiations a test uses: tests/test_quantized_prefill_metal.py)
METAL_SOURCES = sorted(p for p in (REPO / "metal").glob("*.metal")
                       if not p.name.startswith(("attention_paged", "attention_backward",
                                                 "attention_quantized_prefill")))
REAL_METAL = mx.metal.is_available() and _ext.has_metal()
DECODE_SOURCE = REPO / "metal" / "attention_decode.metal"


def decode_shape_numbers(d: int) -> tuple[int, int]:
    """(the group shape's rows, the row shape's simdgroups) at head dim d, as
    d's MLX_ATTN_DECODE_TYPES line in metal/attention_decode.metal names them."""
    import re

    match = re.search(rf"^MLX_ATTN_DECODE_TYPES\({d}, (\d+), (\d+)\)$", DECODE_SOURCE.read_text(), flags=re.M)
    if match is None:
        raise ValueError(f"metal/attention_decode.metal does not instantiate the decode at D = {d}")
    return int(match.group(1)), int(match.group(2))


def decode_instantiation(dtype_args: str, d: int) -> str:
    """The dense decode's instantiation line (both threadgroup shapes and the
    merge) for one dtype ("float32, float") at head dim d: for builds trimmed
    to the instantiations a test uses."""
    rows, simdgroups = decode_shape_numbers(d)
    return f"MLX_ATTN_DECODE({dtype_args}, {d}, {rows}, {simdgroups})"


def quantized_instantiation(dtype_args: str, d: int, bits: int) -> str:
    """The quantized decode's instantiation line (both threadgroup shapes)
    for one dtype and bit width at head dim d: for trimmed builds."""
    rows, simdgroups = decode_shape_numbers(d)
    return f"MLX_ATTN_QUANTIZED_DECODE({dtype_args}, {d}, {bits}, {rows}, {simdgroups})"


def to_numpy(a: mx.array) -> np.ndarray:
    """float32/float16 as themselves, bfloat16 as its uint16 bits."""
    if a.dtype == mx.bfloat16:
        return np.array(a.view(mx.uint16))
    return np.array(a)


def from_numpy(x: np.ndarray, dtype) -> mx.array:
    if dtype == mx.bfloat16:
        return mx.array(x).view(mx.bfloat16)
    return mx.array(x)


class View:
    """An input as the Mac host receives it: an MLX array that may be a view
    (transposed, sliced, broadcast) of the contiguous array `base`, starting
    `offset` elements into it. The emulator binds base's memory from offset
    and reads it through the strides the launch plan took from `array`."""

    def __init__(self, base: mx.array, view=lambda a: a, offset: int = 0):
        self.base = base
        self.array = view(base)
        self.offset = offset
        mx.eval(self.base, self.array)  # evaluated views carry their real strides

    def memory(self) -> np.ndarray:
        return to_numpy(self.base).reshape(-1)[self.offset:]


def physical_layout(x: np.ndarray, layout: str | None):
    """(buffer, view): the memory an input lives in and its [B, H, T, D] view.
    "seq_major": stored [B, T, H, D] (the projection layout), so the head and
    sequence strides are swapped; "cache": the first T of a longer
    preallocated cache whose unused tail is NaN (a read past T would show);
    "unaligned": rows of D + 4 elements starting 2 elements in (row strides a
    multiple of 4, the start not: scalar loads); "odd_rows": rows of D + 1
    (odd strides: scalar loads); "every_other": every other element of rows
    of 2·D (last-dim stride 2: scalar loads). Unused elements are NaN."""
    if layout is None:
        return x, x
    if layout == "seq_major":
        buffer = np.ascontiguousarray(x.transpose(0, 2, 1, 3))
        return buffer, buffer.transpose(0, 2, 1, 3)
    if layout == "cache":
        b, h, t, d = x.shape
        buffer = nan_filled((b, h, t + 7, d), x.dtype)
        buffer[:, :, :t] = x
        return buffer, buffer[:, :, :t]
    if layout == "every_other":
        buffer = nan_filled(x.shape[:3] + (2 * x.shape[3],), x.dtype)
        buffer[..., ::2] = x
        return buffer, buffer[..., ::2]
    if layout in ROW_PADDING:
        start, width = ROW_PADDING[layout]
        buffer = nan_filled(x.shape[:3] + (x.shape[3] + width,), x.dtype)
        buffer[..., start:start + x.shape[3]] = x
        return buffer, buffer[..., start:start + x.shape[3]]
    raise ValueError(f"unknown layout {layout!r}")


# layout -> (first element of a row, extra elements per row)
ROW_PADDING = {"unaligned": (2, 4), "odd_rows": (0, 1)}
LAYOUTS = ("seq_major", "cache", *ROW_PADDING, "every_other")


def layout_view(x: mx.array, layout: str | None) -> View:
    """`x` stored in `layout` (see physical_layout), as the view MLX hands over."""
    if layout is None:
        return View(x)
    buffer = from_numpy(physical_layout(to_numpy(x), layout)[0], x.dtype)
    if layout == "seq_major":
        return View(buffer, lambda a: a.transpose(0, 2, 1, 3))
    if layout == "every_other":
        return View(buffer, lambda a: a[..., ::2])
    if layout in ROW_PADDING:
        start = ROW_PADDING[layout][0]
        return View(buffer, lambda a: a[..., start:start + x.shape[3]], offset=start)
    return View(buffer, lambda a: a[:, :, : x.shape[2]])


def as_view(x) -> View:
    return x if isinstance(x, View) else View(x)


def with_mask_and_sinks(views: list[View], mask, sinks) -> tuple[list[View], dict]:
    """`views` (q, k, v or the quantized triples) followed by the primitive's
    other inputs: an array mask (bool, or additive in q's dtype) and sinks
    (an array or a View). Returns them and the plan's mask= / sinks=
    arguments (the bound arrays; a mask string such as "causal" as is)."""
    views = list(views)
    plan_kw = {"mask": mask, "sinks": None}
    if isinstance(mask, mx.array):
        views.append(View(mask if mask.dtype == mx.bool_ else mask.astype(views[0].array.dtype)))
        plan_kw["mask"] = views[-1].array
    if sinks is not None:
        views.append(as_view(sinks))
        plan_kw["sinks"] = views[-1].array
    return views, plan_kw


def reference_lse(q, k, v, *, scale, mask=None, sinks=None, window_size=None, softcap=None):
    """The row log-sum-exp float32 [B, Hq, Tq] the kernels should return,
    computed independently in float64 NumPy from the same logits as the
    reference path (scale·q·k, capped by softcap·tanh(·/softcap), plus an
    additive mask, masked keys -inf; the sink joins the sum); -inf for a row
    that sees nothing."""
    q64, k64 = (np.array(x.astype(mx.float32), np.float64) for x in (q, k))
    group = q.shape[1] // k.shape[1]
    logits = scale * np.einsum("bhqd,bhkd->bhqk", q64, np.repeat(k64, group, axis=1))
    if softcap is not None:
        logits = softcap * np.tanh(logits / softcap)
    tq, tkv = q.shape[2], k.shape[2]
    visible = np.ones((tq, tkv), bool)
    if isinstance(mask, str) or window_size:
        pos = np.arange(tq)[:, None] + tkv - tq
        keys = np.arange(tkv)[None, :]
        visible = (keys <= pos) & ((keys > pos - window_size) if window_size else True)
    if isinstance(mask, mx.array) and mask.dtype == mx.bool_:  # beside a window too
        visible = visible & np.array(mask)
    elif isinstance(mask, mx.array):  # additive: -inf masks
        logits = logits + np.array(mask.astype(mx.float32), np.float64)
    logits = np.where(visible, logits, -np.inf)
    if sinks is not None:
        sink = np.broadcast_to(np.array(sinks.astype(mx.float32), np.float64)[None, :, None, None], logits.shape[:3] + (1,))
        logits = np.concatenate([logits, sink], axis=-1)
    top = logits.max(axis=-1, keepdims=True)
    safe = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        return (np.log(np.exp(logits - safe).sum(axis=-1)) + safe[..., 0])


class EmulatedMetal:
    def __init__(self, fast_math: bool, sources=None, counters: bool = False):
        """counters: the counting build (slower): its dispatches return cost
        Counters, and a misaligned device access fails."""
        from kernel_lab import msl_emulator

        self.fast_math = fast_math
        self.library = msl_emulator.compile_library(sources or METAL_SOURCES, include_dirs=[REPO], fast_math=fast_math,
                                                    counters=counters)

    def __call__(self, q, k, v, *, scale, mask=None, sinks=None, window_size=None, layout=None, return_lse=False,
                 gpu_target: dict | None = None, softcap=None):
        """q, k, v: arrays (stored in `layout`) or Views; sinks: an array or
        a View; gpu_target: the plan's GPU ({"gpu_family": ..., "gpu_cores":
        ...}, default the conservative target) and, for a dense decode, its
        threadgroup shape ("decode_shape": "auto", "group" or "row"; the
        launch_plan keywords); the result as an MLX array
        (and the float32 [B, Hq, Tq] log-sum-exp with return_lse)."""
        inputs, plan_kw = with_mask_and_sinks(
            [x if isinstance(x, View) else layout_view(x, layout) for x in (q, k, v)], mask, sinks)
        dtype = inputs[0].array.dtype
        plan = launch_plan(*(view.array for view in inputs[:3]), scale=scale, **plan_kw, window_size=window_size,
                           output_lse=return_lse, softcap=softcap, **(gpu_target or {}))
        assert plan.supported, plan.reason
        # the offsets the host reads from MLX (bytes / itemsize) are the ones bound here
        problem = plan.problem
        assert (problem.q_offset, problem.k_offset, problem.v_offset) == tuple(view.offset for view in inputs[:3])
        self.last_plan = plan
        out, lse = self.launch(plan, inputs)
        return (from_numpy(out, dtype), mx.array(lse)) if return_lse else from_numpy(out, dtype)

    def quantized(self, q, k_quant, v_quant, *, scale, bits, group_size, mask=None, sinks=None, window_size=None,
                  return_lse=False, softcap=None, gpu_target: dict | None = None):
        """The kernels over quantized K/V, launched from their plan
        (csrc/metal/quantized_launch_plan.cpp): q and each part of the
        (packed, scales, biases) triples an array or a View, scales and
        biases in q's dtype; otherwise as __call__ (gpu_target included:
        the decode's shape too)."""
        inputs, plan_kw = with_mask_and_sinks([as_view(x) for x in (q, *k_quant, *v_quant)], mask, sinks)
        dtype = inputs[0].array.dtype
        arrays = [view.array for view in inputs]
        plan = quantized_launch_plan(
            arrays[0], arrays[1:4], arrays[4:7], scale=scale, **plan_kw, window_size=window_size, bits=bits,
            group_size=group_size, output_lse=return_lse, softcap=softcap, **(gpu_target or {}),
        )
        assert plan.supported, plan.reason
        self.last_plan = plan
        out, lse = self.launch(plan, inputs)
        return (from_numpy(out, dtype), mx.array(lse)) if return_lse else from_numpy(out, dtype)

    def launch(self, plan: dict, inputs: list[View]) -> np.ndarray:
        """Runs every dispatch of `plan` with the bindings it names, as
        csrc/metal/attention_metal.cpp encodes them: each input's memory from
        its view's offset (read through the plan's strides), the output,
        scratch buffers and bytes. Returns the outputs (out, lse); lse is
        NaN where no kernel wrote it."""
        problem = plan.problem
        memory = [view.memory() for view in inputs]
        memory = [m.view(np.uint8) if m.dtype == np.bool_ else m for m in memory]
        out = np.zeros((problem.batch, problem.q_heads, problem.q_len, problem.value_dim), memory[0].dtype)
        lse = np.full((problem.batch, problem.q_heads, problem.q_len), np.nan, np.float32)
        outputs = [out, lse] if problem.output_lse else [out]
        self.last_counters = run_plan(self.library, plan, memory, outputs)
        return out, lse


class RealMetal:
    fast_math = True

    def __call__(self, q, k, v, layout=None, sinks=None, return_lse=False, **kw):
        q, k, v = (x.array if isinstance(x, View) else layout_view(x, layout).array for x in (q, k, v))
        if sinks is not None:
            kw["sinks"] = as_view(sinks).array
        if return_lse:  # the public keyword (ops.py), asked for only when wanted
            kw["return_lse"] = True
        out = mlx_attn.scaled_dot_product_attention(q, k, v, backend="fused", stream=mx.gpu, **kw)
        mx.eval(out)
        return out


def backward_launch_plan(q, k, v, *, scale=1.0, mask=None, sinks=None, window_size=None, softcap=None):
    """The Metal backward's launch plan (csrc/metal/backward_launch_plan.cpp) for
    the forward problem of these arrays, as the Mac host would build it."""
    problem = _ext.describe_attention(  # a window implies causal (as ops.AttentionCall says)
        q, k, v, scale=scale, causal=isinstance(mask, str) or window_size is not None,
        window_size=window_size or 0, mask=mask if isinstance(mask, mx.array) else None, sinks=sinks,
        softcap=softcap or 0.0,
    )
    return _ext.metal_backward_launch_plan(problem)


def nan_filled(shape, dtype: np.dtype) -> np.ndarray:
    """A buffer no kernel wrote reads as NaN (bfloat16: its uint16 bits)."""
    if dtype == np.uint16:
        return np.full(shape, 0x7FC0, np.uint16)
    return np.full(shape, np.nan, dtype)


def run_plan(library, plan: dict, inputs: list[np.ndarray], outputs: list[np.ndarray]) -> list:
    """Runs every dispatch of `plan` in `library` with the bindings it names,
    as csrc/metal/attention_metal.cpp's encode_launch_plan encodes them:
    inputs[i] and outputs[i] by source_index, NaN-filled scratch (a read of
    something nobody wrote shows), params (and quantized params) bytes. A scratch buffer is written
    by its producer and read only by later dispatches up to its consumer.
    Returns what each dispatch returned (Counters in a counting build)."""
    scratch = [np.full(buffer.elements, np.nan, np.float32) for buffer in plan.scratch]
    results = []
    for position, step in enumerate(plan.dispatches):
        bound = {}
        for binding in step.bindings:
            source, index = binding.source, binding.source_index
            if source == "input":
                bound[binding.index] = inputs[index]
            elif source == "output":
                bound[binding.index] = outputs[index]
            elif source == "scratch":
                buffer = plan.scratch[index]
                writers = range(buffer.producer, buffer.producer + buffer.writers)
                if binding.access == "write":
                    assert position in writers
                else:
                    assert writers.stop <= position <= buffer.consumer
                bound[binding.index] = scratch[index]
            elif source == "params":
                bound[binding.index] = plan.params
            elif source == "quantized_params":
                bound[binding.index] = plan.quantized_params
            elif source in ("sequences", "cascade_groups", "cascade_rows"):  # a paged / cascade plan's arrays
                bound[binding.index] = np.frombuffer(getattr(plan, source), np.uint8).copy()
            else:
                bound[binding.index] = struct.pack("i", plan.splits)
        results.append(library.dispatch(step.kernel, step.grid, step.threadgroup, bound))
    return results


def emulated_backward(metal: EmulatedMetal, q, k, v, out, lse, d_out, d_lse=None, *, scale, mask=None,
                      sinks=None, window_size=None, layout=None, softcap=None):
    """Gradients (dq, dk, dv, d_sinks or None) of the Metal backward kernels
    in the emulator, launched from the backward plan with the buffers of the
    backward primitive: q, k, v (stored in `layout`), mask, sinks, then the
    forward's out and float32 lse and the cotangents d_out and d_lse (float32
    [B, Hq, Tq]; zeros when None), row-contiguous as the vjp hands them over."""
    views, plan_kw = with_mask_and_sinks(
        [x if isinstance(x, View) else layout_view(x, layout) for x in (q, k, v)], mask, sinks)
    dtype = views[0].array.dtype
    arrays = [view.array for view in views]
    plan = backward_launch_plan(*arrays[:3], scale=scale, **plan_kw, window_size=window_size, softcap=softcap)
    assert plan.supported, plan.reason
    metal.last_plan = plan
    problem = plan.problem
    rows = (problem.batch, problem.q_heads, problem.q_len)
    if d_lse is None:
        d_lse = mx.zeros(rows, mx.float32)
    memory = [view.memory() for view in views]
    memory = [m.view(np.uint8) if m.dtype == np.bool_ else m for m in memory]
    memory += [np.ascontiguousarray(to_numpy(out.astype(dtype))), np.ascontiguousarray(np.array(lse, np.float32)),
               np.ascontiguousarray(to_numpy(d_out.astype(dtype))), np.ascontiguousarray(np.array(d_lse, np.float32))]
    element = memory[0].dtype
    outputs = [nan_filled(arrays[i].shape, element) for i in range(3)]
    if sinks is not None:
        outputs.append(nan_filled((problem.q_heads,), element))
    run_plan(metal.library, plan, memory, outputs)
    grads = [from_numpy(g, dtype) for g in outputs]
    return (*grads[:3], grads[3] if sinks is not None else None)
