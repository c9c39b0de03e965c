"""The user's GPU checks each Metal kernel variant before it is trusted.

No machine this project is developed on is a Mac: the Metal kernels are
verified in an emulator. So the first time a kernel variant (prefill or
decode, element type, head dim) is about to run in a process, it runs on a
few small canonical problems and is compared with the reference path. A
mismatch (or an error) disables that variant for the rest of the process with
one warning naming the variant and the error; calls then take the next path
(``mx.fast``, then the reference path). ``MLX_ATTN_SELF_CHECK=0`` turns the
check off.

The check is independent of how kernels are launched: it takes a
``run_kernel(q, k, v, *, scale, mask, sinks, window_size)`` callable. On a
Mac that is the fused primitive on the GPU stream; the tests pass the MSL
emulator, so this logic runs here too.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import warnings
from typing import Callable

import mlx.core as mx
import numpy as np

from mlx_attn.reference import reference_attention

__all__ = [
    "Variant",
    "QuantizedVariant",
    "check_quantized_variant",
    "CheckResult",
    "canonical_cases",
    "check_variant",
    "self_check_enabled",
    "trusted",
    "results",
    "reset",
]

# Max abs error against the reference path (outputs of magnitude ~1). The
# real Metal compiler uses fast math, so float32 gets more room than the
# emulator tests' 2e-5; half types allow one or two output roundings.
TOLERANCE = {"float32": 1e-4, "float16": 6e-3, "bfloat16": 4e-2}
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}

RunKernel = Callable[..., mx.array]


@dataclasses.dataclass(frozen=True)
class Variant:
    """One compiled kernel family: what a self-check vouches for."""

    phase: str  # "prefill" | "decode"
    dtype: str  # "float32" | "float16" | "bfloat16"
    head_dim: int

    def __post_init__(self):
        if self.phase not in ("prefill", "decode"):
            raise ValueError(f"phase must be 'prefill' or 'decode', got {self.phase!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    def __str__(self) -> str:
        return f"{self.phase}/{self.dtype}/D={self.head_dim}"


@dataclasses.dataclass(frozen=True)
class QuantizedVariant:
    """A kernel family over quantized K/V (metal/attention_quantized.metal)."""

    dtype: str  # q's: "float32" | "float16" | "bfloat16"
    head_dim: int
    bits: int
    group_size: int

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    def __str__(self) -> str:
        return f"quantized/{self.dtype}/D={self.head_dim}/{self.bits}-bit/group {self.group_size}"


@dataclasses.dataclass(frozen=True)
class CheckResult:
    variant: Variant | QuantizedVariant
    passed: bool
    cases: int
    max_error: float  # over the cases that ran (nan when none finished)
    seconds: float
    error: str | None = None  # why it failed


@dataclasses.dataclass(frozen=True)
class Case:
    """One small problem: shapes and the keyword arguments of the call."""

    name: str
    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    mask: str | None = None  # None | "causal" | "bool" | "additive"
    window_size: int | None = None
    sinks: bool = False


def canonical_cases(variant: Variant) -> list[Case]:
    """A few problems that together reach every branch of a variant's kernels:
    GQA, causal and window block skipping, both mask kinds, sinks, partial
    tiles and (decode) several key/value splits."""
    if variant.phase == "prefill":
        return [
            Case("causal+sinks", 1, 4, 2, 40, 72, mask="causal", sinks=True),
            Case("bool mask", 2, 2, 1, 37, 45, mask="bool"),
            Case("additive mask+window", 1, 3, 3, 33, 33, mask="additive", window_size=24),
        ]
    return [
        Case("one query", 1, 8, 2, 1, 300),
        Case("window+sinks", 2, 4, 1, 1, 257, mask="causal", window_size=100, sinks=True),
        Case("bool mask, 3 queries", 1, 4, 4, 3, 150, mask="bool"),
    ]


def make_inputs(variant: Variant, case: Case, seed: int = 0) -> tuple[tuple, dict]:
    """``(q, k, v), kwargs`` for a case, in the variant's dtype."""
    rng = np.random.default_rng(seed)
    dtype = DTYPES[variant.dtype]
    d = variant.head_dim

    def normal(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)

    q = normal(case.batch, case.q_heads, case.q_len, d)
    k = normal(case.batch, case.kv_heads, case.kv_len, d)
    v = normal(case.batch, case.kv_heads, case.kv_len, d)
    kwargs: dict = {"scale": d**-0.5, "window_size": case.window_size}
    shape = (case.batch, 1, case.q_len, case.kv_len)
    if case.mask == "causal":
        kwargs["mask"] = "causal"
    elif case.mask == "bool":
        visible = rng.random(shape) < 0.7
        visible[..., -1] = True  # every row sees a key: no fully masked row to argue about
        kwargs["mask"] = mx.array(visible)
    elif case.mask == "additive":
        kwargs["mask"] = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    if case.sinks:
        kwargs["sinks"] = mx.array(rng.standard_normal(case.q_heads).astype(np.float32)).astype(dtype)
    return (q, k, v), kwargs


def check_variant(variant: Variant, run_kernel: RunKernel, cases: list[Case] | None = None) -> CheckResult:
    """Runs ``cases`` (default: the canonical ones) through ``run_kernel`` and
    compares each with the reference path on the CPU."""
    cases = canonical_cases(variant) if cases is None else cases

    def outputs(index, case):
        (q, k, v), kwargs = make_inputs(variant, case, seed=index)
        return (lambda: run_kernel(q, k, v, **kwargs),
                lambda: reference_attention(q, k, v, stream=mx.cpu, **kwargs))

    return _compare(variant, cases, outputs)


def quantized_cases(variant: QuantizedVariant) -> list[Case]:
    """Decode (GQA, several splits, window + sinks) and a prefill shape."""
    return [
        Case("one query", 1, 8, 2, 1, 300),
        Case("window+sinks", 2, 4, 1, 1, 257, mask="causal", window_size=100, sinks=True),
        Case("prefill, bool mask", 1, 4, 2, 19, 40, mask="bool"),
    ]


def check_quantized_variant(variant: QuantizedVariant, run_kernel: RunKernel,
                            cases: list[Case] | None = None) -> CheckResult:
    """As :func:`check_variant` for a kernel over quantized K/V:
    ``run_kernel(q, k_quant, v_quant, **kwargs)`` against the reference path
    on the dequantized keys and values."""
    cases = quantized_cases(variant) if cases is None else cases
    dtype = DTYPES[variant.dtype]

    def outputs(index, case):
        (q, k, v), kwargs = make_inputs(variant, case, seed=index)
        k_quant, v_quant = (mx.quantize(x, variant.group_size, variant.bits, stream=mx.cpu) for x in (k, v))
        k_plain, v_plain = (mx.dequantize(*t, variant.group_size, variant.bits, stream=mx.cpu).astype(dtype)
                            for t in (k_quant, v_quant))
        return (lambda: run_kernel(q, k_quant, v_quant, **kwargs),
                lambda: reference_attention(q, k_plain, v_plain, stream=mx.cpu, **kwargs))

    return _compare(variant, cases, outputs)


def _compare(variant, cases: list[Case], outputs) -> CheckResult:
    """``outputs(index, case) -> (run, want)``: runs each case's kernel and
    compares it with the reference (shape, finiteness, max abs error)."""
    start = time.perf_counter()
    worst = float("nan")
    for index, case in enumerate(cases):
        run, reference = outputs(index, case)
        try:
            got = np.array(mx.array(run()).astype(mx.float32))
        except Exception as error:  # a failing kernel is a result, not a crash
            return CheckResult(variant, False, index, worst, time.perf_counter() - start,
                               f"case {case.name!r} raised {type(error).__name__}: {error}")
        want = np.array(reference().astype(mx.float32))
        if got.shape != want.shape:
            return CheckResult(variant, False, index, worst, time.perf_counter() - start,
                               f"case {case.name!r} returned shape {got.shape}, expected {want.shape}")
        if not np.isfinite(got).all():
            return CheckResult(variant, False, index, worst, time.perf_counter() - start,
                               f"case {case.name!r} returned non-finite values")
        error = float(np.abs(got - want).max())
        worst = error if np.isnan(worst) else max(worst, error)
        if error > TOLERANCE[variant.dtype]:
            return CheckResult(variant, False, index + 1, worst, time.perf_counter() - start,
                               f"case {case.name!r}: max abs error {error:.3g} > {TOLERANCE[variant.dtype]:g}")
    return CheckResult(variant, True, len(cases), worst, time.perf_counter() - start)


def self_check_enabled() -> bool:
    return os.environ.get("MLX_ATTN_SELF_CHECK", "1").strip() not in ("0", "false", "no", "off")


_results: dict[Variant | QuantizedVariant, CheckResult] = {}
_lock = threading.Lock()


def trusted(variant: Variant | QuantizedVariant, run_kernel: RunKernel) -> bool:
    """Whether ``variant`` may run: checked once per process (unless
    ``MLX_ATTN_SELF_CHECK=0``); a failure warns once and disables it."""
    if not self_check_enabled():
        return True
    with _lock:
        result = _results.get(variant)
        if result is None:
            check = check_quantized_variant if isinstance(variant, QuantizedVariant) else check_variant
            result = check(variant, run_kernel)
            _results[variant] = result
            if not result.passed:
                warnings.warn(
                    f"mlx_attn: the Metal kernel variant {variant} failed its self-check against the "
                    f"reference path ({result.error}); it is disabled for this process and calls fall "
                    f"back to mx.fast or the reference path. Please report this with `mlx-attn doctor`.",
                    RuntimeWarning,
                    stacklevel=3,
                )
    return result.passed


def results() -> dict[Variant | QuantizedVariant, CheckResult]:
    """The self-checks run so far in this process."""
    with _lock:
        return dict(_results)


def reset() -> None:
    """Forget every result (tests; a new process starts empty anyway)."""
    with _lock:
        _results.clear()
