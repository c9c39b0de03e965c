"""``mlx_attn.scaled_dot_product_attention``: one validated call object
(:class:`AttentionCall`) and its dispatch.

The contract is exactly that of ``mx.fast.scaled_dot_product_attention``
(MLX 0.32), plus keyword-only extensions (``window_size``, ``backend``,
``return_lse``, ``softcap``). One documented difference: a query row that can
see no key at all (fully masked) returns zeros, where MLX returns an average
of the values.

Paths, in order of preference: the fused kernel of the stream's device
(``"fused-cpu"``; ``"fused-metal"`` once its variant passed the first-use
self-check, :mod:`mlx_attn.self_check`); on the GPU, ``"mlx-fast"`` for the
problems ``mx.fast`` computes under this contract; else ``"reference"``.
Gradients of the fused primitive come from its fused backward (on the GPU,
once the Metal backward's variant passed its self-check, resolved when the
call picks the fused Metal forward and passed to the primitive as an
option), else, and for an additive mask among the differentiated inputs,
from the reference path's autodiff (the rule registered below).
"""

from __future__ import annotations

import dataclasses
import functools

import mlx.core as mx

from mlx_attn import _native, self_check
from mlx_attn.core.attention_arguments import (as_flag, as_scale, as_softcap, check_sinks,
                                               check_window_size, device_type, shape_text)
from mlx_attn.core.checks import FLOAT_DTYPES
from mlx_attn.core.path_choice import Backend, Path, PathChoice, check_backend
from mlx_attn.reference import reference_attention

__all__ = [
    "scaled_dot_product_attention", "attention_path", "AttentionCall", "metal_kernel_runner",
    "metal_backward_runner", "Backend", "Path", "PathChoice",
]

_ext = _native.ext  # kept for callers that probe mlx_attn.ops._ext


def _result_dtype(q: mx.array, k: mx.array, v: mx.array) -> mx.Dtype:
    for name, a in (("q", q), ("k", k), ("v", v)):
        if not mx.issubdtype(a.dtype, mx.floating):
            raise ValueError(
                f"{name} has dtype {a.dtype}; attention needs float16, bfloat16 or float32 inputs"
            )
    dtype = mx.result_type(q.dtype, k.dtype, v.dtype)
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"unsupported input dtype {dtype}; use float16, bfloat16 or float32")
    return dtype


def _check_qkv(q, k, v) -> mx.Dtype:
    """q, k and v: rank-4 arrays that agree on batch, key/value heads and
    length, head dim and the GQA ratio; returns the output dtype."""
    for name, a in (("q", q), ("k", k), ("v", v)):
        if not isinstance(a, mx.array):
            raise ValueError(f"{name} must be an mlx.core.array, got {type(a).__name__}")
        if a.ndim != 4:
            raise ValueError(
                f"{name} must have rank 4 [batch, heads, length, head_dim], got shape {shape_text(a)}"
            )
    dtype = _result_dtype(q, k, v)
    if k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
        raise ValueError(
            f"batch sizes differ: q {shape_text(q)}, k {shape_text(k)}, v {shape_text(v)}"
        )
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v need the same number of heads: k {shape_text(k)}, v {shape_text(v)}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v need the same length: k {shape_text(k)}, v {shape_text(v)}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(
            f"q and k need the same head dim: q {shape_text(q)}, k {shape_text(k)}"
        )
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"the number of query heads ({q.shape[1]}) must be a multiple of the "
            f"number of key/value heads ({k.shape[1]})"
        )
    return dtype


def _check_mask(mask, q: mx.array, k: mx.array, dtype: mx.Dtype) -> None:
    """None, "causal", or an array broadcastable to [batch, q_heads, q_len,
    kv_len]: boolean, or additive in a dtype that promotes to ``dtype``."""
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"mask must be None, 'causal' or an array, got the string {mask!r}")
        return
    if mask is None:
        return
    if not isinstance(mask, mx.array):
        raise ValueError(f"mask must be None, 'causal' or an mlx array, got {type(mask).__name__}")
    if mask.ndim > 4:
        raise ValueError(f"mask must have at most 4 dims, got shape {shape_text(mask)}")
    target = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    for got, want in zip(reversed(mask.shape), reversed(target)):
        if got not in (1, want):
            raise ValueError(
                f"mask of shape {shape_text(mask)} does not broadcast to "
                f"[batch, q_heads, q_len, kv_len] = {list(target)}"
            )
    if mask.dtype != mx.bool_:
        if not mx.issubdtype(mask.dtype, mx.floating):
            raise ValueError(
                f"mask must be boolean (True = attend) or an additive float mask, got {mask.dtype}"
            )
        if mx.result_type(mask.dtype, dtype) != dtype:
            raise ValueError(
                f"additive mask dtype {mask.dtype} must promote to the output dtype {dtype}"
            )


def _validate(q, k, v, scale, mask, sinks, window_size, backend, stream, return_lse, softcap):
    """Checks the public contract (ValueError naming the argument; the C++
    describe_attention keeps only the invariants the kernels must not trust,
    without restating these messages). Returns the output dtype, the scale as
    a float, the window as an int (or None), return_lse as a bool and the
    softcap as a float or None."""
    dtype = _check_qkv(q, k, v)
    scale = as_scale(scale)
    _check_mask(mask, q, k, dtype)
    check_sinks(sinks, q.shape[1], dtype)
    window_size = check_window_size(window_size)
    check_backend(backend)
    return_lse = as_flag("return_lse", return_lse)
    softcap = as_softcap(softcap)
    device_type(stream)  # raises for a stream of the wrong type
    return dtype, scale, window_size, return_lse, softcap


_SAME = object()  # run_fused's "the call's own sinks"


@dataclasses.dataclass(frozen=True, eq=False)  # arrays do not compare as values
class AttentionCall:
    """One validated attention call, built once by :meth:`build` and used by
    ``scaled_dot_product_attention``, :func:`attention_path`,
    :mod:`mlx_attn.quantized`, :mod:`mlx_attn.distributed` and
    ``MultiHeadAttention``.

    Fields are normalized: q, k, v (k, v stand-ins of the right shapes when
    ``quantized``), the mask (an array mask in the output dtype when
    additive) and sinks in the output dtype; ``causal`` is True for
    ``mask="causal"`` and for any window (the one place where "a window
    implies causal" is decided); ``path`` is the implementation chosen and
    ``reason`` why the fused kernel does not run it (None when it does);
    ``softcap`` the cap of the logits (None: none);
    ``metal_backward_trusted`` whether a gradient on the GPU may run the
    Metal backward (its variant's first-use self-check, resolved when the
    fused Metal forward is chosen: the C++ vjp never asks Python)."""

    q: mx.array
    k: mx.array
    v: mx.array
    scale: float
    mask: mx.array | None
    causal: bool
    window_size: int | None
    sinks: mx.array | None
    return_lse: bool
    backend: Backend
    stream: object
    device: mx.DeviceType
    quantized: "mlx_attn.quantized.QuantizedKV | None" = None  # noqa: F821 (no import: quantized imports ops)
    softcap: float | None = None
    path: Path = "reference"
    reason: str | None = None
    metal_backward_trusted: bool = True

    @classmethod
    def build(cls, q, k, v, *, scale, mask=None, sinks=None, window_size=None, backend: Backend = "auto",
              stream=None, return_lse=False, quantized=None, softcap=None) -> "AttentionCall":
        """Validates every argument (ValueError naming it), promotes dtypes
        and chooses the path. ``backend="fused"`` raises where the fused
        kernel cannot run the call."""
        dtype, scale, window_size, return_lse, softcap = _validate(q, k, v, scale, mask, sinks, window_size, backend,
                                                                   stream, return_lse, softcap)
        q, k, v = (a.astype(dtype) if a.dtype != dtype else a for a in (q, k, v))
        array_mask = mask if isinstance(mask, mx.array) else None
        if array_mask is not None and array_mask.dtype not in (mx.bool_, dtype):
            array_mask = array_mask.astype(dtype)  # lossless: its dtype promotes to dtype
        if sinks is not None and sinks.dtype != dtype:
            sinks = sinks.astype(dtype)
        call = cls(q, k, v, scale, array_mask, isinstance(mask, str) or window_size is not None, window_size,
                   sinks, return_lse, backend, stream, device_type(stream), quantized, softcap)
        return call._with_path()

    # -- the path ------------------------------------------------------------
    @property
    def mask_argument(self) -> mx.array | str | None:
        """The mask as mx.fast and the reference path take it (with
        ``window_size`` beside it)."""
        if self.mask is not None:
            return self.mask
        return "causal" if self.causal else None

    @functools.cached_property
    def support(self) -> dict:
        """The one C++ answer the path choice needs (``_ext.attention_support``):
        the problem description of the float call (of the stand-ins, for
        quantized K/V), why the fused kernels of the call's device do not run
        it (None: they do) and, on the GPU, the kernel's phase and whether the
        Metal backward's plan takes it."""
        return _native.ext.attention_support(
            self.q, self.k, self.v, mask=self.mask, sinks=self.sinks, device=self.device, scale=self.scale,
            causal=self.causal, window_size=self.window_size or 0, output_lse=self.return_lse,
            softcap=self.softcap or 0.0,
        )

    @property
    def problem(self):
        """The C++ problem description (``_ext.describe_attention``) of the call."""
        return self.support["problem"]

    def _fused_unsupported_reason(self) -> str | None:
        """None when the fused kernel handles this call, else why not (the
        support rules live in C++: the CPU kernel's and the Metal launch
        plans'; on the GPU also the first-use self-check of the variant)."""
        if _native.ext is None:
            _native.warn_if_missing()
            return _native.MISSING_REASON
        if self.quantized is not None:  # its own plan and self-check (mlx_attn.quantized.QuantizedKV)
            return self.quantized.unsupported_reason(self)
        problem, reason = self.problem, self.support["reason"]
        if reason is None and self.device == mx.gpu:
            variant = self_check.Variant(self.support["phase"], problem.dtype, problem.head_dim, problem.value_dim)
            if not self_check.trusted(variant, metal_kernel_runner(self.stream)):
                reason = f"the Metal kernel variant {variant} failed its self-check on this GPU (see the warning)"
        return reason

    def _mlx_fast_computes(self) -> bool:
        """Calls ``mx.fast`` computes under this package's contract: float
        K/V, no window, log-sum-exp or softcap (it has none of them) and no
        row that can see no key (it does not return zeros for those; an array
        mask may hide every key of a row)."""
        if self.quantized is not None or self.window_size is not None or self.return_lse or self.softcap:
            return False
        return self.mask is None and (not self.causal or self.q.shape[2] <= self.k.shape[2])

    def _metal_backward_trust(self) -> bool:
        """On the fused Metal path: whether the Metal backward's variant
        passed its self-check (asked only where its plan takes the problem;
        the vjp uses the reference path's autodiff elsewhere anyway)."""
        problem = self.problem
        if problem.batch * problem.q_heads * problem.q_len * problem.kv_len == 0:
            return True  # nothing to differentiate through the kernels
        takes = self.support["backward_supported"]
        return not takes or self_check.trusted(metal_backward_variant(problem), metal_backward_runner(self.stream))

    def _with_path(self) -> "AttentionCall":
        if self.backend == "reference":
            return dataclasses.replace(self, path="reference", reason="backend='reference'")
        reason = self._fused_unsupported_reason()
        on_gpu = self.device == mx.gpu
        if reason is None:
            trusted = on_gpu and self.quantized is None and self._metal_backward_trust()
            return dataclasses.replace(self, path="fused-metal" if on_gpu else "fused-cpu",
                                       metal_backward_trusted=trusted or not on_gpu)
        if self.backend == "fused":
            raise ValueError(f"backend='fused' is not possible here: {reason}")
        path = "mlx-fast" if on_gpu and self._mlx_fast_computes() else "reference"
        # every unfused route names its reason (attention_path(..., explain=True))
        assert reason, "an unfused path without a reason"
        return dataclasses.replace(self, path=path, reason=reason)

    # -- running it ----------------------------------------------------------
    def run(self):
        """The call's result: ``out``, or ``(out, lse)`` with ``return_lse``."""
        if self.path == "reference":
            return self.run_reference()
        if self.path == "mlx-fast":
            return mx.fast.scaled_dot_product_attention(
                self.q, self.k, self.v, scale=self.scale, mask=self.mask_argument, sinks=self.sinks,
                stream=self.stream)
        outputs = self.run_fused()
        return (outputs[0], outputs[1]) if self.return_lse else outputs[0]

    def run_reference(self):
        q, k, v = self.q, self.k, self.v
        if self.quantized is not None:
            k, v = self.quantized.dequantized(self)
        return reference_attention(
            q, k, v, scale=self.scale, mask=self.mask_argument, sinks=self.sinks, window_size=self.window_size,
            stream=self.stream, return_lse=self.return_lse, softcap=self.softcap,
        )

    def run_fused(self, *, sinks=_SAME, metal_backward_trusted=None) -> list[mx.array]:
        """The fused primitive on the call's device, bypassing the path
        choice: ``[out]`` or ``[out, lse]`` (``[out]`` over quantized K/V).
        ``sinks`` replaces the call's (a traced copy, for a vjp)."""
        sinks = self.sinks if sinks is _SAME else sinks
        common = dict(scale=self.scale, causal=self.causal, window_size=self.window_size or 0, mask=self.mask,
                      sinks=sinks, softcap=self.softcap or 0.0, stream=self.stream)
        if self.quantized is not None:
            return [self.quantized.run_fused(self.q, **common)]
        trusted = self.metal_backward_trusted if metal_backward_trusted is None else metal_backward_trusted
        return _native.ext.fused_attention(self.q, self.k, self.v, output_lse=self.return_lse,
                                           metal_backward_trusted=trusted, **common)



def metal_variant(problem) -> self_check.Variant:
    """The kernel variant the Metal launch plan uses for a problem: what a
    self-check vouches for (prefill or decode, dtype, head dims)."""
    phase = _native.ext.metal_launch_plan(problem).dispatches[0].id.phase
    return self_check.Variant(phase, problem.dtype, problem.head_dim, problem.value_dim)


def _unchecked_call(q, k, v, scale, mask, sinks, window_size, stream, softcap=None) -> AttentionCall:
    """A validated call on ``stream`` pinned to the fused Metal kernels,
    without the path choice (so without any self-check): what runners use."""
    call = AttentionCall.build(q, k, v, scale=scale, mask=mask, sinks=sinks, window_size=window_size,
                               backend="reference", stream=stream, softcap=softcap)
    return dataclasses.replace(call, path="fused-metal", reason=None)


def metal_kernel_runner(stream=None):
    """``run(q, k, v, *, scale, mask=None, sinks=None, window_size=None,
    softcap=None)``: the fused Metal kernels themselves on ``stream``
    (default: the GPU), evaluated, bypassing the self-check. What the
    self-check and ``mlx-attn doctor`` test."""
    stream = mx.gpu if stream is None else stream

    def run(q, k, v, *, scale, mask=None, sinks=None, window_size=None, softcap=None):
        out = _unchecked_call(q, k, v, scale, mask, sinks, window_size, stream, softcap).run_fused()[0]
        mx.eval(out)
        return out

    return run


def metal_backward_variant(problem) -> self_check.BackwardVariant:
    """The Metal backward variant of a problem: what its self-check vouches for."""
    return self_check.BackwardVariant(problem.dtype, problem.head_dim, problem.value_dim)


def metal_backward_runner(stream=None):
    """``run(q, k, v, d_out, *, scale, mask=None, sinks=None, window_size=None,
    softcap=None) -> [dq, dk, dv(, d_sinks)]``: the fused forward and the
    Metal backward on ``stream`` (default: the GPU), evaluated, bypassing the
    self-check. What the backward self-check and ``mlx-attn doctor`` test."""
    stream = mx.gpu if stream is None else stream

    def run(q, k, v, d_out, *, scale, mask=None, sinks=None, window_size=None, softcap=None):
        call = _unchecked_call(q, k, v, scale, mask, sinks, window_size, stream, softcap)

        def attend(q, k, v, *maybe_sinks):
            traced = dataclasses.replace(call, q=q, k=k, v=v)
            return traced.run_fused(sinks=maybe_sinks[0] if maybe_sinks else None, metal_backward_trusted=True)[0]

        primals = [call.q, call.k, call.v] + ([call.sinks] if call.sinks is not None else [])
        _, grads = mx.vjp(attend, primals, [d_out])  # the Metal backward, told it is trusted
        mx.eval(grads)
        return grads

    return run


def attention_path(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float = 1.0,
    mask=None,
    sinks=None,
    window_size: int | None = None,
    backend: Backend = "auto",
    stream=None,
    return_lse: bool = False,
    softcap: float | None = None,
    explain: bool = False,
) -> Path | PathChoice:
    """Which implementation ``scaled_dot_product_attention`` uses for these
    arguments: ``"fused-cpu"``, ``"fused-metal"``, ``"mlx-fast"`` (GPU only)
    or ``"reference"``. With ``explain=True`` a :class:`PathChoice`
    ``(path, reason)``: ``reason`` is None on a fused path, else why the fused
    kernel does not run the call (head dims, the GPU's kernels, a failed
    self-check, a missing extension, ``backend='reference'``...)."""
    call = AttentionCall.build(q, k, v, scale=scale, mask=mask, sinks=sinks, window_size=window_size,
                               backend=backend, stream=stream, return_lse=return_lse, softcap=softcap)
    return PathChoice(call.path, call.reason) if explain else call.path


def scaled_dot_product_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    mask: mx.array | str | None = None,
    sinks: mx.array | None = None,
    stream: mx.Stream | mx.Device | None = None,
    window_size: int | None = None,
    backend: Backend = "auto",
    return_lse: bool = False,
    softcap: float | None = None,
) -> mx.array | tuple[mx.array, mx.array]:
    """Scaled dot-product attention, a drop-in for ``mx.fast.scaled_dot_product_attention``.

    Args:
        q: queries ``[B, Hq, Tq, D]``.
        k: keys ``[B, Hkv, Tkv, D]`` with ``Hq % Hkv == 0`` (GQA/MQA; never repeated).
        v: values ``[B, Hkv, Tkv, Dv]``.
        scale: multiplies ``q @ k^T`` (usually ``1/sqrt(D)``): what mx.fast
            accepts (Python or NumPy real scalars, 0-d NumPy arrays, size-1
            MLX arrays), finite in float32. Logits saturate at +-2^125 (see
            :mod:`mlx_attn.reference`), so every such scale gives finite
            outputs for finite inputs.
        mask: ``None``, ``"causal"`` (lower-right aligned), a boolean array
            (True = attend) or an additive array, broadcastable to
            ``[B, Hq, Tq, Tkv]``. An additive mask's dtype must promote to
            the output dtype.
        sinks: optional ``[Hq]`` logits (any view, e.g. strided or
            broadcast) that join each head's softmax and contribute no value.
        stream: stream or device to run on.
        window_size: sliding-window attention: each query sees at most this
            many most recent keys (itself included); implies causal.
        backend: ``"auto"`` (the fused kernel when it supports the problem;
            on the GPU then ``mx.fast`` where it computes the same, else the
            reference path), ``"fused"`` (error if the fused kernel cannot
            run it) or ``"reference"``. See :func:`attention_path`.
        return_lse: also return the row log-sum-exp: float32 ``[B, Hq, Tq]``,
            the natural log of each row's softmax denominator (sinks
            included; ``-inf`` for a row that sees no key). Partial results
            over disjoint key sets merge exactly through it.
        softcap: a positive cap for the logits (Gemma 2's
            ``attn_logit_softcapping``, Grok): each ``scale * q.k`` becomes
            ``softcap * tanh(logit / softcap)`` before the mask is applied
            (an additive mask is added to the capped logit, as in Hugging
            Face's eager attention), then sinks join the softmax. The
            log-sum-exp is over the capped logits; gradients go through the
            tanh. ``None``: no cap (mx.fast has no such argument, so a
            softcap call never takes the ``"mlx-fast"`` path).

    Returns:
        ``[B, Hq, Tq, Dv]`` in the promoted input dtype (and the
        log-sum-exp with ``return_lse``). Softmax and accumulation run in
        float32. Rows that see no key are zeros.

    Raises:
        ValueError: naming the offending argument, shape or dtype.
    """
    return AttentionCall.build(q, k, v, scale=scale, mask=mask, sinks=sinks, window_size=window_size,
                               backend=backend, stream=stream, return_lse=return_lse, softcap=softcap).run()
