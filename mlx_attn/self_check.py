"""The user's GPU checks each Metal kernel variant before it is trusted.

No machine this project is developed on is a Mac: the Metal kernels are
verified in an emulator. So the first time a kernel variant (prefill or
decode, element type, head dim) is about to run in a process, it runs on a
few small canonical problems and is compared with the reference path. A
mismatch (or an error) disables that variant for the rest of the process with
one warning naming the variant and the error; calls then take the next path
(``mx.fast``, then the reference path). The Metal backward is gated the same
way (:class:`BackwardVariant`): its gradients are compared with the reference
path's autodiff, and a failed variant's gradients come from that autodiff.
``MLX_ATTN_SELF_CHECK=0`` turns the check off.

The check is independent of how kernels are launched: it takes a
``run_kernel(q, k, v, *, scale, mask, sinks, window_size[, softcap])`` callable (the
backward's: ``run_backward(q, k, v, d_out, ...) -> [dq, dk, dv(, d_sinks)]``).
On a Mac that is the fused primitive on the GPU stream; the tests pass the
MSL emulator, so this logic runs here too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
import warnings
from typing import Callable

import mlx.core as mx
import numpy as np

from mlx_attn import _native
from mlx_attn.core.paged_layout import check_paged_layout, page_shape
from mlx_attn.paged_reference import paged_reference_attention
from mlx_attn.reference import reference_attention

__all__ = [
    "Variant",
    "QuantizedVariant",
    "BackwardVariant",
    "PagedVariant",
    "check_paged_variant",
    "CascadeVariant",
    "check_cascade_variant",
    "cascade_cases",
    "paged_reference_on_cpu",
    "paged_cases",
    "check_quantized_variant",
    "check_backward_variant",
    "backward_cases",
    "reference_gradients",
    "unchecked",
    "CheckResult",
    "canonical_cases",
    "group_shape_case",
    "check_variant",
    "self_check_enabled",
    "trusted",
    "results",
    "reset",
]

# Max abs error against the reference path (outputs of magnitude ~1). The
# real Metal compiler uses fast math, so float32 gets more room than the
# emulator tests' 2e-5; half types allow one or two output roundings.
# The backward's gradients get the same bounds on their max abs error
# relative to the largest reference gradient (at least 1); the emulated
# Metal backward stays within a fifth of them on its cases (fast math).
TOLERANCE = {"float32": 1e-4, "float16": 6e-3, "bfloat16": 4e-2}
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}

RunKernel = Callable[..., mx.array]


def _check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")


@dataclasses.dataclass(frozen=True)
class Variant:
    """One compiled kernel family: what a self-check vouches for."""

    phase: str  # "prefill" | "decode"
    dtype: str  # "float32" | "float16" | "bfloat16"
    head_dim: int
    value_dim: int | None = None  # None: the head dim (the D-split kernel also runs Dk != Dv)

    def __post_init__(self):
        if self.phase not in ("prefill", "decode"):
            raise ValueError(f"phase must be 'prefill' or 'decode', got {self.phase!r}")
        _check_dtype(self.dtype)
        if self.value_dim is None:
            object.__setattr__(self, "value_dim", self.head_dim)

    def __str__(self) -> str:
        value = f"/Dv={self.value_dim}" if self.value_dim != self.head_dim else ""
        return f"{self.phase}/{self.dtype}/D={self.head_dim}{value}"


@dataclasses.dataclass(frozen=True)
class QuantizedVariant:
    """A kernel family over quantized K/V (metal/attention_quantized.metal)."""

    dtype: str  # q's: "float32" | "float16" | "bfloat16"
    head_dim: int
    bits: int
    group_size: int

    def __post_init__(self):
        _check_dtype(self.dtype)

    def __str__(self) -> str:
        return f"quantized/{self.dtype}/D={self.head_dim}/{self.bits}-bit/group {self.group_size}"


@dataclasses.dataclass(frozen=True)
class BackwardVariant:
    """The Metal backward kernels (metal/attention_backward.metal) of one
    element type and head dims: what a backward self-check vouches for."""

    dtype: str  # "float32" | "float16" | "bfloat16"
    head_dim: int
    value_dim: int | None = None  # None: the head dim

    def __post_init__(self):
        _check_dtype(self.dtype)
        if self.value_dim is None:
            object.__setattr__(self, "value_dim", self.head_dim)

    def __str__(self) -> str:
        value = f"/Dv={self.value_dim}" if self.value_dim != self.head_dim else ""
        return f"backward/{self.dtype}/D={self.head_dim}{value}"


@dataclasses.dataclass(frozen=True)
class PagedVariant:
    """The paged kernels (metal/attention_paged.metal, and
    metal/attention_paged_quantized.metal when bits > 0) of one element type
    and head dim."""

    dtype: str  # q's: "float32" | "float16" | "bfloat16"
    head_dim: int
    bits: int = 0  # 0: float pages; 4 or 8: quantized pages
    group_size: int = 0

    def __post_init__(self):
        _check_dtype(self.dtype)

    def __str__(self) -> str:
        pages = f"/{self.bits}-bit/group {self.group_size}" if self.bits else ""
        return f"paged/{self.dtype}/D={self.head_dim}{pages}"


@dataclasses.dataclass(frozen=True)
class CascadeVariant:
    """Cascade attention's Metal kernels (metal/attention_paged_cascade.metal's
    prefix pass, with the paged decode as its suffix pass and the paged merge)
    of one element type and head dim, float or quantized pages."""

    dtype: str
    head_dim: int
    bits: int = 0
    group_size: int = 0

    def __post_init__(self):
        _check_dtype(self.dtype)

    def __str__(self) -> str:
        pages = f"/{self.bits}-bit/group {self.group_size}" if self.bits else ""
        return f"cascade/{self.dtype}/D={self.head_dim}{pages}"


AnyVariant = Variant | QuantizedVariant | BackwardVariant | PagedVariant | CascadeVariant


@dataclasses.dataclass(frozen=True)
class CheckResult:
    variant: AnyVariant
    passed: bool
    cases: int
    max_error: float  # over the cases that ran (nan when none finished); relative for the backward
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
    softcap: float | None = None  # the softcap variant of every logit step
    # keys scaled from 0.05x to this along the sequence: logits grow with the
    # key index, so key/value splits reach very different maxima and a merge
    # that weighs them wrongly shows (None: plain normal keys)
    key_growth: float | None = None


def canonical_cases(variant: Variant, gpu_target: dict | None = None) -> list[Case]:
    """A few problems that together reach every branch of a variant's kernels:
    GQA, causal and window block skipping, both mask kinds, sinks, the
    softcap, partial tiles and (decode) both threadgroup shapes, the group
    shape over several key/value splits and the merge. Decode's shape
    depends on the GPU (`gpu_target`: the launch plan's gpu_family /
    gpu_cores; default this process's GPU)."""
    if variant.phase == "prefill":
        return [
            Case("causal+sinks", 1, 4, 2, 40, 72, mask="causal", sinks=True),
            Case("bool mask+softcap", 2, 2, 1, 37, 45, mask="bool", softcap=1.5),
            Case("additive mask+window", 1, 3, 3, 33, 33, mask="additive", window_size=24),
        ]
    # short contexts: the row shape (one row per threadgroup)
    cases = [
        Case("one query", 1, 8, 2, 1, 300),
        Case("window+sinks", 2, 4, 1, 1, 257, mask="causal", window_size=100, sinks=True),
        Case("bool mask+softcap, 3 queries", 1, 4, 4, 3, 150, mask="bool", softcap=1.5),
    ]
    group = group_shape_case(variant.head_dim, gpu_target)
    return cases + ([group] if group is not None else [])


# Contexts the group-shape case may take, shortest first.
GROUP_SHAPE_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
# Simdgroups of a decode merge threadgroup (MLX_ATTN_DECODE_MERGE_SIMDGROUPS):
# simdgroup g merges splits g, g + 8, ...
MERGE_SIMDGROUPS = 8


def device_gpu_target() -> dict:
    """The launch plan's target (gpu_family, gpu_cores) for this process's
    GPU, as the Mac host plans for it; {} (the conservative default, which
    the emulator tests plan for) without Metal."""
    if _native.ext is None or not mx.metal.is_available():
        return {}
    architecture = str(mx.metal.device_info().get("architecture", ""))
    return dict(_native.ext.gpu_target_from_architecture(architecture))


def group_shape_case(head_dim: int, gpu_target: dict | None = None) -> Case | None:
    """One query of 4 heads over one KV head, causal, keys growing along the
    sequence: the shortest context of GROUP_SHAPE_LENGTHS that the plan runs
    on the group shape over more splits than the merge has simdgroups
    (MERGE_SIMDGROUPS: each then merges several, so their rescale counts) on
    the target (csrc/metal/launch_plan.cpp decode_shape). None without the
    extension or where no length does."""
    if _native.ext is None:
        return None
    target = device_gpu_target() if gpu_target is None else gpu_target
    for kv_len in GROUP_SHAPE_LENGTHS:
        shapes = _native.ext.metal_decode_shapes(1, 1, 4, kv_len, head_dim, **target)
        if shapes["group"]["chosen"] and shapes["group"]["splits"] > MERGE_SIMDGROUPS:
            return Case("GQA 4, long context (group shape, several splits)", 1, 4, 1, 1, kv_len, mask="causal",
                        key_growth=4.0)
    return None


def backward_cases(variant: BackwardVariant) -> list[Case]:
    """Problems that reach the backward's branches: the GQA sum of dK/dV,
    causal and window block skipping in both kernels, both mask kinds, the
    sinks' gradient, several and partial query and key blocks."""
    return [
        Case("causal+sinks, GQA", 1, 4, 2, 40, 72, mask="causal", sinks=True),
        Case("bool mask+softcap", 2, 2, 1, 37, 45, mask="bool", softcap=1.5),
        Case("additive mask+window", 1, 3, 3, 33, 50, mask="additive", window_size=9),
    ]


def _normal(rng: np.random.Generator, shape: tuple, dtype: mx.Dtype) -> mx.array:
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def make_inputs(variant: AnyVariant, case: Case, seed: int = 0) -> tuple[tuple, dict]:
    """``(q, k, v), kwargs`` for a case, in the variant's dtype."""
    rng = np.random.default_rng(seed)
    dtype = DTYPES[variant.dtype]
    d = variant.head_dim
    value_dim = getattr(variant, "value_dim", d)

    def normal(*shape):
        return _normal(rng, shape, dtype)

    q = normal(case.batch, case.q_heads, case.q_len, d)
    k = normal(case.batch, case.kv_heads, case.kv_len, d)
    if case.key_growth:
        growth = np.linspace(0.05, case.key_growth, case.kv_len, dtype=np.float32)[:, None]
        k = (k.astype(mx.float32) * mx.array(growth)).astype(dtype)
    v = normal(case.batch, case.kv_heads, case.kv_len, value_dim)
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
    if case.softcap is not None:
        kwargs["softcap"] = case.softcap
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


def quantized_cases(variant: QuantizedVariant, gpu_target: dict | None = None) -> list[Case]:
    """Decode (GQA, window + sinks) and a prefill shape; the decode on both
    threadgroup shapes (the float decode's rule: short contexts on the row
    shape, group_shape_case's long one on the group shape over several
    splits) for the GPU (`gpu_target`, as canonical_cases)."""
    cases = [
        Case("one query", 1, 8, 2, 1, 300),
        Case("window+sinks", 2, 4, 1, 1, 257, mask="causal", window_size=100, sinks=True),
        Case("prefill, bool mask+softcap", 1, 4, 2, 19, 40, mask="bool", softcap=1.5),
    ]
    group = group_shape_case(variant.head_dim, gpu_target)
    return cases + ([group] if group is not None else [])


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


def reference_gradients(q, k, v, d_out, *, scale, mask=None, sinks=None, window_size=None,
                        softcap=None) -> list[mx.array]:
    """``[dq, dk, dv(, d_sinks)]`` of ``sum(out * d_out)``: ``mx.vjp`` of the
    reference path on the CPU, in float32 from the inputs' values."""
    with mx.stream(mx.cpu):
        primals = [x.astype(mx.float32) for x in (q, k, v)]
        if sinks is not None:
            primals.append(sinks.astype(mx.float32))
        if isinstance(mask, mx.array) and mask.dtype != mx.bool_:
            mask = mask.astype(mx.float32)

        def attend(q, k, v, *maybe_sinks):
            return reference_attention(q, k, v, scale=scale, mask=mask, sinks=maybe_sinks[0] if maybe_sinks else None,
                                       window_size=window_size, softcap=softcap)

        _, grads = mx.vjp(attend, primals, [d_out.astype(mx.float32)])
        mx.eval(grads)
    return grads


def check_backward_variant(variant: BackwardVariant, run_backward: RunKernel,
                           cases: list[Case] | None = None) -> CheckResult:
    """Runs ``cases`` (default: :func:`backward_cases`) through
    ``run_backward(q, k, v, d_out, **kwargs) -> [dq, dk, dv(, d_sinks)]`` and
    compares every gradient with :func:`reference_gradients`."""
    cases = backward_cases(variant) if cases is None else cases

    def outputs(index, case):
        (q, k, v), kwargs = make_inputs(variant, case, seed=index)
        d_out = _normal(np.random.default_rng([index, 1]), (*q.shape[:3], v.shape[3]), q.dtype)
        return (lambda: run_backward(q, k, v, d_out, **kwargs),
                lambda: reference_gradients(q, k, v, d_out, **kwargs))

    return _compare(variant, cases, outputs)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PagedOptions:
    """The paged op's options a case sets (by keyword)."""

    q_heads: int = 8
    kv_heads: int = 2
    causal: bool = True
    window_size: int | None = None
    sinks: bool = False


@dataclasses.dataclass(frozen=True)
class PagedCase(PagedOptions):
    """A small ragged batch: per-sequence lengths over pages of page_size."""

    name: str
    q_lens: tuple
    kv_lens: tuple
    page_size: int


def paged_cases(variant: PagedVariant) -> list[PagedCase]:
    """Decode rows and a chunked prefill in one batch with an empty sequence
    and shared pages, several splits and page windows; window and sinks;
    decode rows of one query head each (the row shape: one row per
    threadgroup) beside the GQA groups' rows (the group shape)."""
    return [
        PagedCase("ragged decode + prefill chunk", (1, 0, 9, 1), (37, 0, 300, 5), 16),
        PagedCase("window+sinks, pages of 5", (1, 4), (1200, 4), 5, window_size=100, sinks=True),
        PagedCase("not causal, MQA", (2, 1), (20, 70), 8, q_heads=4, kv_heads=1, causal=False),
        PagedCase("decode rows, MHA, pages of 3", (1, 1, 1), (90, 7, 600), 3, q_heads=4, kv_heads=4, sinks=True),
    ]


def make_paged_inputs(variant: PagedVariant, case: PagedCase, seed: int = 0) -> tuple[tuple, dict]:
    """``(q, k_pages, v_pages, block_table, kv_lens), kwargs`` for a case:
    pages in a shuffled pool, the first sequence's first page shared with
    every other sequence that has keys (a common prefix), unused entries -1."""
    rng = np.random.default_rng(seed)
    dtype = DTYPES[variant.dtype]
    needed = [(n + case.page_size - 1) // case.page_size for n in case.kv_lens]
    pool = rng.permutation(sum(needed) + 1)
    table = np.full((len(needed), max(needed) + 1), -1, np.int32)
    at = 0
    for b, n in enumerate(needed):
        table[b, :n] = pool[at:at + n]
        at += n
    for b in range(1, len(needed)):
        if needed[b] and needed[0]:
            table[b, 0] = table[0, 0]
    shape = (len(pool), case.kv_heads, case.page_size, variant.head_dim)
    q = _normal(rng, (sum(case.q_lens), case.q_heads, variant.head_dim), dtype)
    k_pages, v_pages = _normal(rng, shape, dtype), _normal(rng, shape, dtype)
    kwargs: dict = {"scale": variant.head_dim**-0.5, "causal": case.causal, "window_size": case.window_size,
                    "q_lens": mx.array(np.array(case.q_lens, np.int32))}
    if case.sinks:
        kwargs["sinks"] = _normal(rng, (case.q_heads,), dtype)
    return (q, k_pages, v_pages, mx.array(table), mx.array(np.array(case.kv_lens, np.int32))), kwargs


def _quantized_pages(variant: PagedVariant | CascadeVariant, q, k_pages, v_pages) -> tuple:
    """``(quantization keywords, k triple, v triple)``: the pages quantized
    as the variant's, scales and biases in q's dtype."""
    quantization = {"group_size": variant.group_size, "bits": variant.bits}
    k_quant, v_quant = (tuple(a.astype(q.dtype) if i else a
                              for i, a in enumerate(mx.quantize(x, stream=mx.cpu, **quantization)))
                        for x in (k_pages, v_pages))
    return quantization, k_quant, v_quant


def check_paged_variant(variant: PagedVariant, run_kernel: RunKernel,
                        cases: list[PagedCase] | None = None) -> CheckResult:
    """Runs ``cases`` (default: :func:`paged_cases`) through
    ``run_kernel(q, k_pages, v_pages, block_table, kv_lens, **kwargs)``
    (quantized variants: the pages as ``mx.quantize`` triples, and
    ``bits`` / ``group_size`` keywords) and compares
    each with the paged reference path on the CPU (gather + reference)."""
    cases = paged_cases(variant) if cases is None else cases

    def outputs(index, case):
        (q, k_pages, v_pages, table, kv_lens), kwargs = make_paged_inputs(variant, case, seed=index)
        if not variant.bits:
            return (lambda: run_kernel(q, k_pages, v_pages, table, kv_lens, **kwargs),
                    lambda: paged_reference_on_cpu(variant, q, (k_pages,), (v_pages,), table, kv_lens, **kwargs))
        quantization, k_quant, v_quant = _quantized_pages(variant, q, k_pages, v_pages)
        return (lambda: run_kernel(q, k_quant, v_quant, table, kv_lens, **quantization, **kwargs),
                lambda: paged_reference_on_cpu(variant, q, k_quant, v_quant, table, kv_lens, **kwargs))

    return _compare(variant, cases, outputs)


def paged_reference_on_cpu(variant: PagedVariant | CascadeVariant, q, k_parts, v_parts, block_table, kv_lens, *, q_lens, scale,
                           causal, window_size, sinks=None) -> mx.array:
    """The paged reference path's output for a case's inputs (one dtype
    already), on the CPU: what :func:`check_paged_variant` compares with."""
    k_shape, v_shape = page_shape(k_parts[0], variant.bits), page_shape(v_parts[0], variant.bits)
    layout = check_paged_layout(q, k_shape, v_shape, k_shape[0], block_table, kv_lens, q_lens)
    with mx.stream(mx.cpu):
        return paged_reference_attention(q, k_parts, v_parts, layout, scale=scale, causal=causal,
                                         window_size=window_size, sinks=sinks, return_lse=False,
                                         bits=variant.bits, group_size=variant.group_size)[0]


@dataclasses.dataclass(frozen=True)
class CascadeCase(PagedOptions):
    """Cascade groups ((prefix keys, ((q_len, own keys), ...)), ...) beside
    sequences of their own ((q_len, kv_len), ...), over pages of page_size."""

    name: str
    groups: tuple
    loners: tuple
    page_size: int


def cascade_cases(variant: CascadeVariant) -> list[CascadeCase]:
    """Two groups with decode rows and a two-row chunk beside sequences of
    their own; windows that end inside the prefix and that exclude it, with
    sinks (counted once); a prefix of two splits; MQA without causality."""
    return [
        CascadeCase("two groups beside sequences of their own", ((64, ((1, 5), (1, 17), (2, 9))), (32, ((1, 3),))),
                    ((1, 40),), 16),
        CascadeCase("windows into and past the prefix, sinks", ((48, ((1, 4), (1, 30))),), ((1, 9),), 8,
                    window_size=20, sinks=True),
        CascadeCase("a prefix of two splits", ((1040, ((1, 3), (1, 2))),), (), 16, sinks=True),
        CascadeCase("not causal, MQA", ((40, ((1, 7), (1, 2))),), (), 5, q_heads=4, kv_heads=1, causal=False),
    ]


def make_cascade_inputs(variant: CascadeVariant, case: CascadeCase, seed: int = 0) -> tuple[tuple, dict, np.ndarray]:
    """``(q, k_pages, v_pages, prefix_table, prefix_lens, prefix_groups,
    block_table, kv_lens), kwargs, full_table`` of a case: pages in a
    shuffled pool, unused entries -1; ``full_table`` is the equivalent paged
    call's (each group's prefix pages, then the sequence's own)."""
    rng = np.random.default_rng(seed)
    dtype = DTYPES[variant.dtype]
    sequences = [(g, q_len, own) for g, (_, members) in enumerate(case.groups) for q_len, own in members]
    sequences += [(-1, q_len, kv_len) for q_len, kv_len in case.loners]
    prefix_lens = [prefix for prefix, _ in case.groups]
    prefix_pages = [-(-prefix // case.page_size) for prefix in prefix_lens]
    own_pages = [-(-own // case.page_size) for _, _, own in sequences]
    pool = iter(rng.permutation(sum(prefix_pages) + sum(own_pages)).tolist())
    prefix_table = np.full((len(prefix_lens), max(prefix_pages) + 1), -1, np.int32)
    for g, count in enumerate(prefix_pages):
        prefix_table[g, :count] = [next(pool) for _ in range(count)]
    own_table = np.full((len(sequences), max(own_pages) + 1), -1, np.int32)
    full = np.full((len(sequences), max(prefix_pages) + max(own_pages) + 1), -1, np.int32)
    for b, (g, _, _) in enumerate(sequences):
        own_table[b, :own_pages[b]] = [next(pool) for _ in range(own_pages[b])]
        shared = list(prefix_table[g, :prefix_pages[g]]) if g >= 0 else []
        full[b, :len(shared) + own_pages[b]] = shared + list(own_table[b, :own_pages[b]])
    q_lens = [q_len for _, q_len, _ in sequences]
    kv_lens = [own + (prefix_lens[g] if g >= 0 else 0) for g, _, own in sequences]
    shape = (sum(prefix_pages) + sum(own_pages), case.kv_heads, case.page_size, variant.head_dim)
    q = _normal(rng, (sum(q_lens), case.q_heads, variant.head_dim), dtype)
    k_pages, v_pages = _normal(rng, shape, dtype), _normal(rng, shape, dtype)
    kwargs: dict = {"scale": variant.head_dim**-0.5, "causal": case.causal, "window_size": case.window_size,
                    "q_lens": mx.array(np.array(q_lens, np.int32))}
    if case.sinks:
        kwargs["sinks"] = _normal(rng, (case.q_heads,), dtype)
    arrays = (q, k_pages, v_pages, mx.array(prefix_table), mx.array(np.array(prefix_lens, np.int32)),
              mx.array(np.array([g for g, _, _ in sequences], np.int32)), mx.array(own_table),
              mx.array(np.array(kv_lens, np.int32)))
    return arrays, kwargs, full


def check_cascade_variant(variant: CascadeVariant, run_kernel: RunKernel,
                          cases: list[CascadeCase] | None = None) -> CheckResult:
    """Runs ``cases`` (default: :func:`cascade_cases`) through
    ``run_kernel(q, k_pages, v_pages, prefix_table, prefix_lens,
    prefix_groups, block_table, kv_lens, **kwargs)`` (quantized variants:
    the pages as ``mx.quantize`` triples and ``bits`` / ``group_size``
    keywords) and compares each with the paged reference path over the
    full tables on the CPU."""
    cases = cascade_cases(variant) if cases is None else cases

    def outputs(index, case):
        (q, k_pages, v_pages, *tables, kv_lens), kwargs, full = make_cascade_inputs(variant, case, seed=index)
        full = mx.array(full)
        if not variant.bits:
            return (lambda: run_kernel(q, k_pages, v_pages, *tables, kv_lens, **kwargs),
                    lambda: paged_reference_on_cpu(variant, q, (k_pages,), (v_pages,), full, kv_lens, **kwargs))
        quantization, k_quant, v_quant = _quantized_pages(variant, q, k_pages, v_pages)
        return (lambda: run_kernel(q, k_quant, v_quant, *tables, kv_lens, **quantization, **kwargs),
                lambda: paged_reference_on_cpu(variant, q, k_quant, v_quant, full, kv_lens, **kwargs))

    return _compare(variant, cases, outputs)


GRADIENT_NAMES = ("dq", "dk", "dv", "d_sinks")


def _compare(variant: AnyVariant, cases: list[Case], outputs) -> CheckResult:
    """``outputs(index, case) -> (run, want)``: runs each case's kernel and
    compares it with the reference (shape, finiteness, max abs error; for
    the backward, each gradient's, relative to its largest reference value)."""
    backward = isinstance(variant, BackwardVariant)
    limit = TOLERANCE[variant.dtype]
    start = time.perf_counter()
    worst = float("nan")

    def failed(ran: int, case: Case, why: str) -> CheckResult:
        return CheckResult(variant, False, ran, worst, time.perf_counter() - start, f"case {case.name!r}{why}")

    for index, case in enumerate(cases):
        run, reference = outputs(index, case)
        try:
            got = [np.array(mx.array(g).astype(mx.float32)) for g in (run() if backward else [run()])]
        except Exception as error:  # a failing kernel is a result, not a crash
            return failed(index, case, f" raised {type(error).__name__}: {error}")
        want = [np.array(w.astype(mx.float32)) for w in (reference() if backward else [reference()])]
        if len(got) != len(want):
            return failed(index, case, f" returned {len(got)} gradients, expected {len(want)}")
        for name, g, w in zip(GRADIENT_NAMES if backward else [""], got, want):
            label = f"{name} " if name else ""
            if g.shape != w.shape:
                return failed(index, case, f" returned {label}shape {g.shape}, expected {w.shape}")
            if not np.isfinite(g).all():
                return failed(index, case, f" returned non-finite {name or 'values'}")
            error = float(np.abs(g - w).max(initial=0.0))
            if backward:
                error /= max(1.0, float(np.abs(w).max(initial=0.0)))
            worst = error if np.isnan(worst) else max(worst, error)
            if error > limit:
                measure = f"{label}max relative error" if backward else "max abs error"
                return failed(index + 1, case, f": {measure} {error:.3g} > {limit:g}")
    return CheckResult(variant, True, len(cases), worst, time.perf_counter() - start)


def self_check_enabled() -> bool:
    return os.environ.get("MLX_ATTN_SELF_CHECK", "1").strip() not in ("0", "false", "no", "off")


_results: dict[AnyVariant, CheckResult] = {}
_lock = threading.RLock()  # re-entrant: a check's kernel calls may ask about a variant again
_thread = threading.local()

_CHECKS = {Variant: check_variant, QuantizedVariant: check_quantized_variant, BackwardVariant: check_backward_variant,
           PagedVariant: check_paged_variant, CascadeVariant: check_cascade_variant}
_FALLBACKS = {
    Variant: "calls fall back to mx.fast or the reference path",
    QuantizedVariant: "calls fall back to the reference path",
    BackwardVariant: "gradients come from the reference path's autodiff",
    PagedVariant: "calls fall back to the paged reference path",
    CascadeVariant: "cascade calls fall back to the paged op over the full tables",
}


@contextlib.contextmanager
def unchecked():
    """Within it (this thread only), :func:`trusted` trusts every variant:
    for code that runs the kernels themselves (a check, ``mlx-attn doctor``),
    whose calls must neither recurse into a check nor be rerouted by one."""
    _thread.depth = getattr(_thread, "depth", 0) + 1
    try:
        yield
    finally:
        _thread.depth -= 1


def trusted(variant: AnyVariant, run_kernel: RunKernel) -> bool:
    """Whether ``variant`` may run: checked once per process (unless
    ``MLX_ATTN_SELF_CHECK=0``); a failure warns once and disables it.
    ``run_kernel`` is the variant kind's runner (see the check functions)."""
    if not self_check_enabled() or getattr(_thread, "depth", 0):
        return True
    with _lock:
        result = _results.get(variant)
        if result is None:
            with unchecked():
                result = _CHECKS[type(variant)](variant, run_kernel)
            _results[variant] = result
            if not result.passed:
                warnings.warn(
                    f"mlx_attn: the Metal kernel variant {variant} failed its self-check against the "
                    f"reference path ({result.error}); it is disabled for this process and "
                    f"{_FALLBACKS[type(variant)]}. Please report this with `mlx-attn doctor`.",
                    RuntimeWarning,
                    stacklevel=3,
                )
    return result.passed


def results() -> dict[AnyVariant, CheckResult]:
    """The self-checks run so far in this process."""
    with _lock:
        return dict(_results)


def reset() -> None:
    """Forget every result (tests; a new process starts empty anyway)."""
    with _lock:
        _results.clear()
