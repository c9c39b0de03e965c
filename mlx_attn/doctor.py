"""``mlx-attn doctor``: what this machine runs, checked against the reference.

Prints a Markdown report to paste into a bug report: versions, device, which
kernels the build carries, every kernel variant's check against the reference
path on a grid of shapes (masks, GQA, window, sinks, decode splits), the Metal
backward's variants against the reference path's gradients, and a short
timing table next to ``mx.fast`` and the reference path. The report is ``ok``
only if every check passed.
"""

from __future__ import annotations

import dataclasses
import platform
import sys
from typing import Callable

import mlx.core as mx
import numpy as np

import mlx_attn
from mlx_attn import _native, self_check
from mlx_attn._blas import blas_choice
from mlx_attn._timing import median_seconds
from mlx_attn.ops import metal_backward_runner, metal_kernel_runner
from mlx_attn.self_check import BackwardVariant, Case, CascadeVariant, CheckResult, PagedVariant, Variant

__all__ = ["DoctorReport", "run_doctor", "metal_grid", "cpu_grid", "backward_grid"]

METAL_HEAD_DIMS = (64, 80, 96, 128, 256)
# the Metal backward's (D, Dv) (csrc/metal/backward_launch_plan.cpp): the register-resident kernels, then the
# D-split family (metal/attention_backward_split.h)
BACKWARD_HEAD_DIMS = ((64, 64), (80, 80), (96, 96), (128, 128), (192, 128), (256, 256), (512, 512), (576, 512))
DTYPE_NAMES = ("float16", "bfloat16", "float32")
PAGED_HEAD_DIMS = (64, 96, 128, 256)  # the paged kernels' (csrc/metal/paged_launch_plan.cpp)
CASCADE_HEAD_DIMS = (64, 96, 128)  # the cascade prefix kernel's (metal/attention_paged_cascade.metal)


@dataclasses.dataclass
class DoctorReport:
    markdown: str
    ok: bool
    cpu_results: list[CheckResult]
    metal_results: list[CheckResult]
    backward_results: list[CheckResult] = dataclasses.field(default_factory=list)
    paged_results: list[CheckResult] = dataclasses.field(default_factory=list)
    cascade_results: list[CheckResult] = dataclasses.field(default_factory=list)


def _extra_cases(variant: Variant) -> list[Case]:
    """Beyond the canonical self-check: more GQA ratios, MQA, long decode."""
    if variant.phase == "prefill":
        return [
            Case("MQA causal", 1, 8, 1, 64, 64, mask="causal"),
            Case("cross (Tq < Tkv), bool", 1, 2, 2, 48, 200, mask="bool"),
            Case("window only", 1, 2, 1, 70, 70, window_size=16),
        ]
    return [
        Case("GQA 8, long", 1, 8, 1, 1, 2048),
        Case("GQA 3, additive", 1, 6, 2, 2, 513, mask="additive"),
        Case("sinks only", 1, 2, 2, 1, 65, sinks=True),
    ]


def metal_grid(variant: Variant) -> list[Case]:
    return self_check.canonical_cases(variant) + _extra_cases(variant)


def backward_grid(variant: BackwardVariant) -> list[Case]:
    """The backward self-check's cases and more: MQA, no mask with Tq < Tkv,
    a window alone over several query blocks."""
    return self_check.backward_cases(variant) + [
        Case("MQA causal", 1, 8, 1, 64, 64, mask="causal"),
        Case("cross (Tq < Tkv), no mask", 1, 2, 2, 20, 100),
        Case("window only", 1, 2, 1, 70, 70, window_size=16),
    ]


def cpu_grid(variant: Variant) -> list[Case]:
    # One CPU kernel serves both phases; the prefill and decode shapes cover it.
    return metal_grid(variant)


def _blas_row() -> str:
    choice = blas_choice()
    return f"system BLAS active: {choice.library} ({choice.reason})" if choice.library else \
        f"MLX's bundled BLAS: {choice.reason}"


def _environment_rows(native) -> list[tuple[str, str]]:
    rows = [
        ("mlx_attn", mlx_attn.__version__),
        ("MLX", mx.__version__),
        ("Python", sys.version.split()[0]),
        ("OS", platform.platform()),
        ("machine", platform.machine()),
        ("default device", str(mx.default_device())),
        ("BLAS for MLX matmuls", _blas_row()),
    ]
    if native is None:
        rows.append(("native extension", "NOT LOADED: fused kernels unavailable (see warnings)"))
        return rows
    rows.append(("native extension", f"built with MLX {native.built_with_mlx}"))
    rows.append(("CPU kernel ISA", f"{native.cpu_isa()} (this CPU can run: {', '.join(native.supported_cpu_isas())})"))
    rows.append(("CPU backward copy", native.cpu_backward_copy()))
    metal = mx.metal.is_available()
    rows.append(("Metal available (MLX)", str(metal)))
    rows.append(("Metal kernels in this build", str(native.has_metal())))
    if metal:
        info = mx.metal.device_info()
        rows.append(("GPU", f"{info.get('device_name', '?')} ({info.get('architecture', '?')})"))
        target = self_check.device_gpu_target()  # the plan's target, as the self-check plans its cases
        cores = target.get("gpu_cores") or "the family's base part's"
        rows.append(("GPU family (launch plan)", f"{target.get('gpu_family', 'unknown')}, planned for {cores} cores"))
        rows.append(("Metal library", "compiled at run time from the embedded source, or the prebuilt "
                     "mlx_attn.metallib next to _ext when installed with MLX_ATTN_PREBUILT_METALLIB=ON"))
    return rows


def _check_rows(results: list[CheckResult], label: str = "", error: str = "max abs error") -> list[str]:
    lines = [f"| variant | cases | {error} | tolerance | result |", "|---|---|---|---|---|"]
    for r in results:
        verdict = "pass" if r.passed else f"**FAIL**: {r.error}"
        lines.append(
            f"| {label}{r.variant} | {r.cases} | {r.max_error:.2e} | {self_check.TOLERANCE[r.variant.dtype]:g} | {verdict} |"
        )
    return lines


def _timing_lines(stream, dtype, lengths, repeats: int) -> list[str]:
    lines = [
        "| phase | T | D | causal | fused ms | mx.fast ms | reference ms | fused speed-up vs mx.fast |",
        "|---|---|---|---|---|---|---|---|",
    ]
    heads, kv_heads = 8, 2
    for t in lengths:
        for d in (64, 128):
            for phase, tq in (("prefill", t), ("decode", 1)):
                causal = phase == "prefill"
                rng = np.random.default_rng(0)
                q, k, v = (
                    mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
                    for shape in ((1, heads, tq, d), (1, kv_heads, t, d), (1, kv_heads, t, d))
                )
                mask = "causal" if causal else None
                scale = d**-0.5

                def run(backend):
                    return lambda: mlx_attn.scaled_dot_product_attention(
                        q, k, v, scale=scale, mask=mask, stream=stream, backend=backend
                    )

                fused = 1e3 * median_seconds(run("fused"), repeats)
                fast = 1e3 * median_seconds(
                    lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, stream=stream),
                    repeats,
                )
                reference = 1e3 * median_seconds(run("reference"), repeats)
                lines.append(
                    f"| {phase} | {t} | {d} | {causal} | {fused:.2f} | {fast:.2f} | {reference:.2f} | {fast / fused:.2f}x |"
                )
    return lines


def _cpu_section(native) -> tuple[list[str], list[CheckResult]]:
    """The fused CPU kernel's variants against the reference path."""
    lines = ["", "## Fused CPU kernel against the reference path", ""]
    if native is None:
        return lines + ["Not checked: the native extension is not loaded."], []

    def cpu_runner(q, k, v, **kwargs):
        return mlx_attn.scaled_dot_product_attention(q, k, v, backend="fused", stream=mx.cpu, **kwargs)

    cpu_variants = [Variant(p, dt, d) for p in ("prefill", "decode") for dt in DTYPE_NAMES for d in (64, 128)]
    results = [self_check.check_variant(v, cpu_runner, cpu_grid(v)) for v in cpu_variants]
    return lines + _check_rows(results, label="cpu "), results


def _checked_section(title: str, unavailable: str, runner: Callable | None, variants: list, check,
                     **row_options) -> tuple[list[str], list[CheckResult]]:
    """A report section: ``check(variant, runner)`` of every variant, or
    ``unavailable`` without a runner."""
    lines = ["", f"## {title}", ""]
    if runner is None:
        return lines + [unavailable], []
    results = [check(v, runner) for v in variants]
    return lines + _check_rows(results, **row_options), results


def _paged_sections(no_metal: str, metal_paged, paged_variants, metal_cascade, cascade_variants) -> tuple:
    """The paged and the cascade kernels' sections: (lines, results) of each."""
    if paged_variants is None:
        paged_variants = [PagedVariant(dt, d) for dt in DTYPE_NAMES for d in PAGED_HEAD_DIMS]
        paged_variants += [PagedVariant(dt, d, bits, 64) for dt in DTYPE_NAMES for d in (64, 128) for bits in (4, 8)]
    paged = _checked_section("Paged Metal kernels against the paged reference path", no_metal, metal_paged,
                             paged_variants, self_check.check_paged_variant)
    if cascade_variants is None:
        cascade_variants = [CascadeVariant(dt, d) for dt in DTYPE_NAMES for d in CASCADE_HEAD_DIMS]
        cascade_variants += [CascadeVariant(dt, d, bits, 64) for dt in DTYPE_NAMES for d in (64, 128)
                             for bits in (4, 8)]
    cascade = _checked_section("Cascade Metal kernels against the paged reference path", no_metal, metal_cascade,
                               cascade_variants, self_check.check_cascade_variant)
    return (*paged, *cascade)


def run_doctor(
    *,
    metal_runner: Callable | None = None,
    variants: list[Variant] | None = None,
    metal_backward: Callable | None = None,
    backward_variants: list[BackwardVariant] | None = None,
    metal_paged: Callable | None = None,
    paged_variants: list[PagedVariant] | None = None,
    metal_cascade: Callable | None = None,
    cascade_variants: list[CascadeVariant] | None = None,
    timings: bool = True,
    lengths: tuple[int, ...] = (256, 1024),
    repeats: int = 3,
    native=None,
) -> DoctorReport:
    """Builds the report. ``metal_runner`` runs the Metal kernels and
    ``metal_backward`` the Metal backward (defaults: the real GPU when this
    build and machine have Metal; the tests pass the MSL emulator);
    ``variants`` and ``backward_variants`` limit the variants checked."""
    native = _native.ext if native is None else native
    if native is not None and mx.metal.is_available() and native.has_metal():
        metal_runner = metal_kernel_runner(mx.gpu) if metal_runner is None else metal_runner
        metal_backward = metal_backward_runner(mx.gpu) if metal_backward is None else metal_backward
        if metal_paged is None:
            from mlx_attn.paged import metal_paged_runner

            metal_paged = metal_paged_runner(mx.gpu)
        if metal_cascade is None:
            from mlx_attn.paged import metal_cascade_runner

            metal_cascade = metal_cascade_runner(mx.gpu)
    lines = ["# mlx_attn doctor report", "", "## Environment", "", "| | |", "|---|---|"]
    lines += [f"| {key} | {value} |" for key, value in _environment_rows(native)]
    cpu_lines, cpu_results = _cpu_section(native)
    no_metal = (
        "Not checked: "
        + ("Metal is not available on this machine" if not mx.metal.is_available()
           else "this build of mlx_attn has no Metal kernels")
        + "."
    )
    if variants is None:
        variants = [Variant(p, dt, d) for p in ("prefill", "decode") for dt in DTYPE_NAMES for d in METAL_HEAD_DIMS]
    metal_lines, metal_results = _checked_section(
        "Metal kernels against the reference path", no_metal, metal_runner, variants,
        lambda v, run: self_check.check_variant(v, run, metal_grid(v)))
    if backward_variants is None:
        backward_variants = [BackwardVariant(dt, d, dv) for dt in DTYPE_NAMES for d, dv in BACKWARD_HEAD_DIMS]
    backward_lines, backward_results = _checked_section(
        "Metal backward against the reference path's gradients", no_metal, metal_backward, backward_variants,
        lambda v, run: self_check.check_backward_variant(v, run, backward_grid(v)),
        error="max error / largest gradient")
    paged_lines, paged_results, cascade_lines, cascade_results = _paged_sections(
        no_metal, metal_paged, paged_variants, metal_cascade, cascade_variants)
    lines += cpu_lines + metal_lines + backward_lines + paged_lines + cascade_lines
    gpu_results = metal_results + backward_results + paged_results + cascade_results
    ok = native is not None and all(r.passed for r in cpu_results + gpu_results)
    failed = [str(r.variant) for r in gpu_results if not r.passed]
    if failed:
        lines += ["", f"Variants that would be disabled by the first-use self-check: {', '.join(failed)}."]

    if timings and native is not None:
        on_gpu = metal_runner is not None and mx.metal.is_available()
        device = "GPU" if on_gpu else "CPU"
        dtype = mx.float16 if on_gpu else mx.float32
        lines += ["", f"## Timings on the {device} (median of {repeats}, {str(dtype).split('.')[-1]}, 8 query / 2 KV heads)", ""]
        lines += _timing_lines(mx.gpu if on_gpu else mx.cpu, dtype, lengths, repeats)

    lines += ["", f"**Result: {'all checks passed' if ok else 'MISMATCHES FOUND (see above)'}**", ""]
    return DoctorReport("\n".join(lines), bool(ok), cpu_results, metal_results, backward_results, paged_results,
                        cascade_results)
