"""The Metal launch plan seen from Python (tests and the emulator runner).

Which problems the Metal kernels handle is decided in one place, the C++
launch plan (csrc/metal/launch_plan.cpp); ``mlx_attn.ops`` asks it through
``_ext.attention_support``. This module returns the whole plan for arrays
(an ``_ext.LaunchPlan``: typed, read-only).
"""

from __future__ import annotations

import mlx.core as mx

from mlx_attn._native import MISSING_REASON, ext


def launch_plan(
    q, k, v, *, scale=1.0, mask=None, sinks=None, window_size=None, output_lse=False, softcap=None,
    gpu_family: str = "unknown", gpu_cores: int = 0, decode_shape: str = "auto",
):
    """The Metal launch plan for these arrays, as the Mac host would build it:
    strides are the arrays' own (evaluate views first: unevaluated arrays
    report row-contiguous strides); ``mask`` is ``"causal"`` or an array in
    its own (broadcastable) shape; ``sinks`` any ``[Hq]`` view; ``output_lse``
    adds the float32 ``[B, Hq, Tq]`` log-sum-exp output; ``softcap`` the
    logit cap (None: none). ``gpu_family``
    (``"apple7"``, ``"apple8"``, ``"apple9"``, ``"apple10"`` or ``"unknown"``, the
    conservative default) and ``gpu_cores`` (0: the family's base part) pick
    the row of the plan's per-GPU-family table (docs/metal_kernels.md);
    ``decode_shape`` (``"auto"``, ``"group"`` or ``"row"``) the dense
    decode's threadgroup shape (tests and benchmarks; in use the plan's rule)."""
    if ext is None:
        raise RuntimeError(MISSING_REASON)
    # a window implies causal (ops.AttentionCall's rule; the raw description insists on being told)
    problem = ext.describe_attention(
        q, k, v, scale=scale, causal=isinstance(mask, str) or window_size is not None, window_size=window_size or 0,
        mask=mask if isinstance(mask, mx.array) else None, sinks=sinks, output_lse=output_lse,
        softcap=softcap or 0.0,
    )
    return ext.metal_launch_plan(problem, gpu_family=gpu_family, gpu_cores=gpu_cores, decode_shape=decode_shape)
