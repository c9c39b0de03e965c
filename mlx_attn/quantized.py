"""Attention over quantized keys and values (the ``mx.quantize`` format).

A quantized tensor is the triple ``(packed, scales, biases)`` that
``mx.quantize(x, group_size, bits)`` returns for ``x`` of shape
``[B, H, T, D]``: ``packed`` is uint32 ``[B, H, T, D * bits / 32]`` (element
``i`` of a word sits at bit ``(i % (32 / bits)) * bits``), ``scales`` and
``biases`` are float ``[B, H, T, D / group_size]`` and
``x[..., i] ~= packed_i * scales[..., i // group_size] + biases[..., i // group_size]``.
The format's checks and conversions live in :mod:`mlx_attn.core.quantization`
(re-exported here: ``quantize``, ``dequantize``, ``check_quantization``...).

:func:`quantized_scaled_dot_product_attention` has the contract of
:func:`mlx_attn.scaled_dot_product_attention` (mask, sinks, window, GQA
without repeating K/V, lower-right causal) with ``k`` and ``v`` given as such
triples. On CPU streams it runs the fused CPU kernel, which dequantizes each
key/value block inside its tile (``csrc/cpu/kernel_impl.h``,
``load_quantized_row``); on GPU streams the Metal kernels of
``metal/attention_quantized.metal``, which dequantize packed K/V in registers,
and for long prompts at D = 64 / 128 ``metal/attention_quantized_prefill.metal``
(the prefill kernel's MMA tiles, K/V dequantized as they are staged; launch
plan: ``csrc/metal/quantized_launch_plan.cpp``, :func:`quantized_launch_plan`).
Its reference path dequantizes and runs the reference SDPA.
"""

from __future__ import annotations

import contextlib
import dataclasses

import mlx.core as mx

from mlx_attn import _native, ops, self_check
from mlx_attn.core.path_choice import Backend, PathChoice, QuantizedPath
from mlx_attn.core.quantization import (SUPPORTED_BITS, SUPPORTED_GROUP_SIZES, check_quantizable_dim,
                                        check_quantization, check_triple, dequantize, quantize, quantized_head_dim)

__all__ = [
    "SUPPORTED_BITS",
    "SUPPORTED_GROUP_SIZES",
    "check_quantization",
    "quantize",
    "dequantize",
    "quantized_head_dim",
    "quantized_scaled_dot_product_attention",
    "quantized_attention_path",
    "check_quantizable_dim",
]


@dataclasses.dataclass(frozen=True)
class QuantizedKV:
    """K and V of an :class:`mlx_attn.ops.AttentionCall` as ``mx.quantize``
    triples (checked), scales and biases in the output dtype as the fused
    kernels read them; the steps that differ from float K/V."""

    k: tuple[mx.array, mx.array, mx.array]
    v: tuple[mx.array, mx.array, mx.array]
    group_size: int
    bits: int

    def unsupported_reason(self, call) -> str | None:
        """The fused kernels' support rules for quantized K/V (C++: the CPU
        kernel's, the quantized Metal launch plan's) and, on the GPU, the
        variant's first-use self-check."""
        if call.device != mx.gpu:
            return _native.ext.unsupported_reason(call.problem, device=mx.cpu)
        if not _native.ext.has_metal():
            return "this build of mlx_attn has no Metal kernels (MLX without Metal)"
        plan = quantized_launch_plan(call.q, self.k, self.v, scale=call.scale, mask=call.mask_argument,
                                     sinks=call.sinks, window_size=call.window_size, bits=self.bits,
                                     group_size=self.group_size, softcap=call.softcap)
        if not plan.supported:
            return plan.reason
        variant = self_check.QuantizedVariant(str(call.q.dtype).removeprefix("mlx.core."), call.q.shape[-1],
                                              self.bits, self.group_size)
        if not self_check.trusted(variant, quantized_metal_kernel_runner(call.stream, self.group_size, self.bits)):
            return f"the Metal kernel variant {variant} failed its self-check on this GPU (see the warning)"
        return None

    def run_fused(self, q, **options) -> mx.array:
        return _native.ext.quantized_attention(q, list(self.k), list(self.v), bits=self.bits,
                                               group_size=self.group_size, **options)

    def dequantized(self, call) -> tuple[mx.array, mx.array]:
        """K and V as float arrays in the output dtype (the reference path)."""
        with mx.stream(call.stream) if call.stream is not None else contextlib.nullcontext():
            return tuple(dequantize(t, self.group_size, self.bits).astype(call.q.dtype) for t in (self.k, self.v))


def _stand_in(shape, dtype) -> mx.array:
    """A lazy array of this shape and dtype that is never evaluated: lets the
    float call's checks (mask, sinks, window, GQA) run on shapes."""
    return mx.broadcast_to(mx.zeros((), dtype=dtype), shape)


def _build_call(q, k_quant, v_quant, scale, mask, sinks, window_size, group_size, bits, backend,
                stream, softcap=None) -> ops.AttentionCall:
    """The validated call: the triples checked here, everything else by the
    float contract (:class:`mlx_attn.ops.AttentionCall`) on stand-ins for K
    and V of the shapes the triples hold."""
    group_size, bits = check_quantization(group_size, bits)
    k_quant = check_triple("k_quant", k_quant, group_size, bits)
    v_quant = check_triple("v_quant", v_quant, group_size, bits)
    if k_quant[1].dtype != v_quant[1].dtype:
        raise ValueError(f"k_quant and v_quant scales need one dtype, got {k_quant[1].dtype} and {v_quant[1].dtype}")
    if k_quant[0].shape[:3] != v_quant[0].shape[:3]:
        raise ValueError(
            f"k_quant {k_quant[0].shape} and v_quant {v_quant[0].shape} disagree on [batch, heads, length]"
        )
    float_dtype = k_quant[1].dtype
    k = _stand_in((*k_quant[0].shape[:3], quantized_head_dim(k_quant[0], bits)), float_dtype)
    v = _stand_in((*v_quant[0].shape[:3], quantized_head_dim(v_quant[0], bits)), float_dtype)
    dtype = mx.result_type(q.dtype, float_dtype) if isinstance(q, mx.array) else float_dtype

    def in_dtype(triple):  # scales and biases as the fused kernels read them
        return (triple[0], *(a.astype(dtype) if a.dtype != dtype else a for a in triple[1:]))

    kv = QuantizedKV(in_dtype(k_quant), in_dtype(v_quant), group_size, bits)
    return ops.AttentionCall.build(q, k, v, scale=scale, mask=mask, sinks=sinks, window_size=window_size,
                                   backend=backend, stream=stream, quantized=kv, softcap=softcap)


def quantized_metal_kernel_runner(stream, group_size: int, bits: int):
    """``run(q, k_quant, v_quant, *, scale, mask=None, sinks=None,
    window_size=None, softcap=None)``: the quantized Metal kernels themselves
    on ``stream``, evaluated, bypassing the self-check (what the self-check
    runs)."""

    def run(q, k_quant, v_quant, *, scale, mask=None, sinks=None, window_size=None, softcap=None):
        call = _build_call(q, k_quant, v_quant, scale, mask, sinks, window_size, group_size, bits, "reference",
                           stream, softcap)
        out = call.run_fused()[0]
        mx.eval(out)
        return out

    return run


def quantized_attention_path(
    q, k_quant, v_quant, *, scale: float = 1.0, mask=None, group_size: int = 64, bits: int = 8,
    sinks=None, window_size=None, stream=None, backend: Backend = "auto", softcap=None, explain: bool = False,
) -> QuantizedPath | PathChoice:
    """Which implementation :func:`quantized_scaled_dot_product_attention`
    uses for these arguments: ``"fused-cpu"``, ``"fused-metal"`` or
    ``"reference"``; with ``explain=True`` ``(path, reason)`` as
    :func:`mlx_attn.attention_path` gives it."""
    call = _build_call(q, k_quant, v_quant, scale, mask, sinks, window_size, group_size, bits, backend, stream,
                       softcap)
    return PathChoice(call.path, call.reason) if explain else call.path


def quantized_launch_plan(q, k_quant, v_quant, *, scale=1.0, mask=None, sinks=None, window_size=None, bits=8,
                          group_size=64, output_lse=False, softcap=None, gpu_family: str = "unknown",
                          gpu_cores: int = 0, decode_shape: str = "auto") -> dict:
    """The Metal launch plan over quantized K/V for these arrays, as the Mac
    host builds it (csrc/metal/quantized_launch_plan.cpp): strides are the arrays'
    own (evaluate views first); scales and biases in q's dtype; ``mask`` is
    ``"causal"`` or an array; ``output_lse`` adds the float32 ``[B, Hq, Tq]``
    log-sum-exp output; ``gpu_family``, ``gpu_cores`` and ``decode_shape``
    as for :func:`mlx_attn.metal_support.launch_plan`. The dict of that
    function plus ``quantized_params`` (bytes)."""
    if _native.ext is None:
        raise RuntimeError(_native.MISSING_REASON)
    return _native.ext.quantized_metal_launch_plan(
        q, list(k_quant), list(v_quant), scale=scale, causal=isinstance(mask, str) or window_size is not None,
        window_size=window_size or 0,
        mask=mask if isinstance(mask, mx.array) else None, sinks=sinks, bits=bits, group_size=group_size,
        output_lse=output_lse, softcap=softcap or 0.0, gpu_family=gpu_family, gpu_cores=gpu_cores,
        decode_shape=decode_shape,
    )


def quantized_scaled_dot_product_attention(
    q: mx.array,
    k_quant,
    v_quant,
    *,
    scale: float,
    mask: mx.array | str | None = None,
    group_size: int = 64,
    bits: int = 8,
    sinks: mx.array | None = None,
    window_size: int | None = None,
    stream: mx.Stream | mx.Device | None = None,
    backend: Backend = "auto",
    softcap: float | None = None,
) -> mx.array:
    """Scaled dot-product attention with quantized keys and values.

    Args:
        q: queries ``[B, Hq, Tq, D]``.
        k_quant: keys as ``mx.quantize`` returns them for ``[B, Hkv, Tkv, D]``:
            ``(packed uint32, scales, biases)``; ``Hq % Hkv == 0``.
        v_quant: values likewise for ``[B, Hkv, Tkv, Dv]``; scales in the
            same dtype as the keys'.
        scale, mask, sinks, window_size, stream, backend, softcap: as in
            :func:`mlx_attn.scaled_dot_product_attention`.
        group_size, bits: the quantization of both triples (32/64/128; 4/8).

    The fused CPU kernel dequantizes each key/value block inside its tile,
    the Metal kernels dequantize K/V in registers (no dequantized copy of K/V
    exists); they compute the forward pass only (no gradients through them). The reference path dequantizes, then runs the
    reference SDPA.

    Returns:
        ``[B, Hq, Tq, Dv]`` in the dtype ``q`` and the scales promote to.
        Softmax and accumulation run in float32. Rows that see no key are zeros.

    Raises:
        ValueError: naming the offending argument, part of a triple, shape or dtype.
    """
    return _build_call(q, k_quant, v_quant, scale, mask, sinks, window_size, group_size, bits, backend,
                       stream, softcap).run()
