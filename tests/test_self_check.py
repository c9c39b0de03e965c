"""The first-use self-check of Metal kernel variants (forward, quantized,
backward) and `mlx-attn doctor`.

No Mac here: the Metal path of both is exercised through the MSL emulator,
including deliberately broken kernel variants that the check must disable.
"""

from __future__ import annotations

import functools
import os
import warnings
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from kernel_lab import msl_emulator
from kernel_lab.metal_runner import METAL_SOURCES, REAL_METAL, EmulatedMetal, emulated_backward
from mutations import kernel_text
from mlx_attn import _native, self_check
from mlx_attn.doctor import run_doctor
from mlx_attn.reference import reference_attention
from mlx_attn.self_check import BackwardVariant, Variant
from test_metal_backward import BACKWARD, SPLIT, split_only

needs_emulator = pytest.mark.skipif(
    REAL_METAL or not msl_emulator.clang_available(), reason="runs the Metal kernels in the MSL emulator"
)


@pytest.fixture(autouse=True)
def fresh_results(monkeypatch):
    monkeypatch.delenv("MLX_ATTN_SELF_CHECK", raising=False)
    self_check.reset()
    yield
    self_check.reset()


def reference_runner(q, k, v, **kwargs):
    return reference_attention(q, k, v, **kwargs)


def broken_runner(q, k, v, **kwargs):
    """Right shape, wrong numbers: the last key is dropped."""
    out = reference_runner(q, k[:, :, :-1], v[:, :, :-1], **{**kwargs, "mask": None})
    return out


def test_variant_validates_its_fields():
    with pytest.raises(ValueError, match="phase"):
        Variant("forward", "float16", 64)
    with pytest.raises(ValueError, match="dtype"):
        Variant("decode", "int8", 64)


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_canonical_cases_cover_the_kernel_branches(phase):
    cases = self_check.canonical_cases(Variant(phase, "float16", 64))
    assert {c.mask for c in cases} >= {"causal", "bool"}
    assert any(c.sinks for c in cases) and any(c.window_size for c in cases)
    assert any(c.softcap for c in cases)  # the kernels' SOFTCAP variant
    assert any(c.q_heads > c.kv_heads for c in cases)  # GQA
    if phase == "decode":
        assert all(c.q_len <= 8 for c in cases)
        assert max(c.kv_len for c in cases) > 256  # several key/value splits
    else:
        assert all(c.q_len > 32 for c in cases)  # more than one query block


@pytest.mark.parametrize("target", [{}, dict(gpu_family="apple8", gpu_cores=10), dict(gpu_family="apple8", gpu_cores=38),
                                    dict(gpu_family="apple9", gpu_cores=80), dict(gpu_family="apple10", gpu_cores=4)],
                         ids=["default", "m2", "m2-max", "80-cores", "4-cores"])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])
@pytest.mark.parametrize("family", ["float", "quantized"])
def test_decode_cases_reach_both_threadgroup_shapes(target, head_dim, family):
    """Whatever the GPU, the decode cases run both kernels of a variant (the
    float decode's and the quantized decode's, which share the shape rule:
    tests/test_quantized_metal.py): a problem the plan puts on the row shape
    and one on the group shape over more splits than the merge has
    simdgroups (each merges several), as the plan for that GPU shapes them."""
    from mlx_attn import _ext

    if family == "float":
        cases = self_check.canonical_cases(Variant("decode", "float16", head_dim), gpu_target=target)
    else:
        variant = self_check.QuantizedVariant("float16", head_dim, 4, 64)
        cases = [c for c in self_check.quantized_cases(variant, gpu_target=target) if c.q_len <= 8]
    taken = set()
    for case in cases:
        rows = case.q_heads // case.kv_heads * case.q_len
        shapes = _ext.metal_decode_shapes(case.batch, case.kv_heads, rows, case.kv_len, head_dim, **target)
        shape = "row" if shapes["row"]["chosen"] else "group"
        taken.add((shape, shapes[shape]["splits"] > self_check.MERGE_SIMDGROUPS))
    assert ("group", True) in taken and any(shape == "row" for shape, _ in taken), taken
    # the merge's simdgroups as the plan sizes its threadgroup
    from mlx_attn.metal_support import launch_plan

    (q, k, v), _ = self_check.make_inputs(Variant("decode", "float16", head_dim), cases[-1])
    merge = launch_plan(q, k, v, scale=1.0, **target).dispatches[-1]
    assert merge.kernel.startswith("attention_decode_merge_")
    assert merge.threadgroup == [32 * self_check.MERGE_SIMDGROUPS, 1, 1]


def test_correct_kernel_passes_and_is_checked_once():
    calls = []

    def runner(q, k, v, **kwargs):
        calls.append(q.shape)
        return reference_runner(q, k, v, **kwargs)

    variant = Variant("prefill", "float32", 64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert self_check.trusted(variant, runner)
        assert self_check.trusted(variant, runner)
    assert len(calls) == len(self_check.canonical_cases(variant))
    result = self_check.results()[variant]
    assert result.passed and result.max_error < 1e-5


def test_wrong_kernel_is_disabled_with_one_warning():
    variant = Variant("decode", "float16", 128)
    with pytest.warns(RuntimeWarning, match=r"decode/float16/D=128.*max abs error"):
        assert not self_check.trusted(variant, broken_runner)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        assert not self_check.trusted(variant, broken_runner)


@pytest.mark.parametrize(
    "runner, message",
    [
        (lambda q, k, v, **kw: (_ for _ in ()).throw(RuntimeError("pipeline failed")), "RuntimeError: pipeline failed"),
        (lambda q, k, v, **kw: mx.full(q.shape, np.nan, q.dtype), "non-finite"),
        (lambda q, k, v, **kw: q[:, :, :1], "shape"),
    ],
    ids=["raises", "nan", "shape"],
)
def test_failure_modes_are_reported(runner, message):
    result = self_check.check_variant(Variant("prefill", "float16", 64), runner)
    assert not result.passed and message in result.error


def test_check_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("MLX_ATTN_SELF_CHECK", "0")
    assert self_check.trusted(Variant("prefill", "float16", 64), broken_runner)
    assert self_check.results() == {}


def test_doctor_reports_the_cpu_kernel_on_linux():
    report = run_doctor(lengths=(64,), repeats=1)
    assert report.ok, report.markdown
    text = report.markdown
    assert "## Fused CPU kernel against the reference path" in text
    assert "| cpu decode/bfloat16/D=128 |" in text
    assert f"| CPU backward copy | {_native.ext.cpu_backward_copy()} |" in text
    if not mx.metal.is_available():
        assert "Not checked: Metal is not available on this machine." in text
    assert "| prefill | 64 | 128 | True |" in text  # a timing row
    assert "all checks passed" in text


def test_doctor_fails_on_a_mismatch():
    report = run_doctor(
        metal_runner=broken_runner, variants=[Variant("decode", "float32", 64)], timings=False
    )
    assert not report.ok
    assert "**FAIL**" in report.markdown and "decode/float32/D=64" in report.markdown
    assert "MISMATCHES FOUND" in report.markdown


@needs_emulator
def test_doctor_runs_the_emulated_metal_kernels():
    runner = EmulatedMetal(fast_math=True)
    variants = [Variant("prefill", "float16", 64), Variant("decode", "bfloat16", 128)]
    report = run_doctor(metal_runner=runner, variants=variants, timings=False)
    assert report.ok, report.markdown
    assert [r.variant for r in report.metal_results] == variants
    assert all(r.passed and r.cases >= 6 for r in report.metal_results)
    assert len(report.cpu_results) == 12 and all(r.passed for r in report.cpu_results)


@needs_emulator
def test_self_check_disables_a_broken_emulated_variant(tmp_path):
    """A decode kernel that forgets to rescale the split partials when it
    merges them is wrong only on real data: the self-check must catch it."""
    decode = next(p for p in METAL_SOURCES if p.name == "attention_decode.metal")
    source = kernel_text(decode)  # the family's headers inlined
    merge_rescale = "fast::exp2((partial_stats[base * 2] - m)"
    assert source.count(merge_rescale) == 1
    broken = source.replace(merge_rescale, "(0.5f + 0.0f * (partial_stats[base * 2] - m)")
    mutated = tmp_path / decode.name
    mutated.write_text(broken)
    runner = EmulatedMetal(fast_math=True, sources=[p if p != decode else mutated for p in METAL_SOURCES])
    prefill, decode_variant = Variant("prefill", "float32", 64), Variant("decode", "float32", 64)
    assert self_check.trusted(prefill, runner)
    with pytest.warns(RuntimeWarning, match="decode/float32/D=64"):
        assert not self_check.trusted(decode_variant, runner)
    report = run_doctor(metal_runner=runner, variants=[prefill, decode_variant], timings=False)
    assert not report.ok


class MetalBuild:
    """_ext as a Metal build on a Mac would answer: the launch plan's support
    rule for the GPU, everything else the real extension."""

    def __init__(self, ext):
        self._ext = ext

    def __getattr__(self, name):
        return getattr(self._ext, name)

    def has_metal(self):
        return True

    def unsupported_reason(self, problem, *, device):
        if device == mx.gpu:
            plan = self._ext.metal_launch_plan(problem)
            return None if plan.supported else plan.reason
        return self._ext.unsupported_reason(problem, device=device)

    def attention_support(self, q, k, v, *, device, **kwargs):
        support = self._ext.attention_support(q, k, v, device=mx.cpu, **kwargs)
        if device == mx.gpu:
            problem = support["problem"]
            plan = self._ext.metal_launch_plan(problem)
            support["reason"] = self.unsupported_reason(problem, device=device)
            support["phase"] = plan.dispatches[0].id.phase if plan.supported else None
            support["backward_supported"] = self.metal_backward_launch_plan(problem).supported
        return support


@pytest.mark.parametrize("kernel_correct", [True, False], ids=["passes", "fails"])
def test_gpu_path_order_follows_the_self_check(monkeypatch, kernel_correct):
    """fused-metal once its variant passed; after a failed self-check the
    variant is disabled: mx.fast where it computes the same, else the
    reference path; backend='fused' names the failed self-check."""
    from mlx_attn import _native, ops

    monkeypatch.setattr(_native, "ext", MetalBuild(_native.ext))
    runner = reference_runner if kernel_correct else broken_runner
    monkeypatch.setattr(ops, "metal_kernel_runner", lambda stream=None: runner)
    # choosing the fused Metal forward also resolves the backward's trust
    monkeypatch.setattr(ops, "metal_backward_runner", lambda stream=None: autodiff_backward)
    q = mx.zeros((1, 4, 40, 64), mx.float16)
    kv = mx.zeros((1, 2, 40, 64), mx.float16)
    if kernel_correct:
        assert mlx_attn_path(q, kv, mask="causal") == "fused-metal"
        assert mlx_attn_path(q, kv, mask="causal", window_size=8) == "fused-metal"
        assert self_check.results()[Variant("prefill", "float16", 64)].passed
        assert self_check.results()[BackwardVariant("float16", 64)].passed
        return
    with pytest.warns(RuntimeWarning, match="prefill/float16/D=64"):
        assert mlx_attn_path(q, kv, mask="causal") == "mlx-fast"
    assert mlx_attn_path(q, kv, mask="causal", window_size=8) == "reference"
    with pytest.raises(ValueError, match="failed its self-check"):
        mlx_attn_path(q, kv, backend="fused")
    # other variants are checked on their own: decode passes with a correct kernel
    monkeypatch.setattr(ops, "metal_kernel_runner", lambda stream=None: reference_runner)
    assert mlx_attn_path(q[:, :, :1], kv) == "fused-metal"
    forward = {v for v in self_check.results() if isinstance(v, Variant)}
    assert forward == {Variant("prefill", "float16", 64), Variant("decode", "float16", 64)}


def mlx_attn_path(q, kv, **kwargs):
    import mlx_attn

    return mlx_attn.attention_path(q, kv, kv, scale=0.125, stream=mx.gpu, **kwargs)


def test_doctor_command_line(tmp_path):
    from mlx_attn.lm.cli import main

    report = tmp_path / "doctor.md"
    assert main(["doctor", "--quick", "--no-timings", "--output", str(report)]) == 0
    text = report.read_text()
    assert text.startswith("# mlx_attn doctor report") and "all checks passed" in text
    assert "## Timings" not in text


def test_doctor_quick_limits_forward_and_backward_variants(monkeypatch):
    from mlx_attn import doctor
    from mlx_attn.lm import cli

    asked = {}

    def spy(**kwargs):
        asked.update(kwargs)
        return doctor.run_doctor(lengths=(64,), timings=False)

    monkeypatch.setattr(cli, "run_doctor", spy)
    assert cli.main(["doctor", "--quick", "--no-timings"]) == 0
    assert {(v.phase, v.dtype, v.head_dim) for v in asked["variants"]} == {
        (phase, "float16", d) for phase in ("prefill", "decode") for d in (64, 128)}
    assert [(v.dtype, v.head_dim) for v in asked["backward_variants"]] == [("float16", 64), ("float16", 128)]


# --- kernels over quantized K/V: the same gate, checked against dequantize-then-reference


def quantized_cpu_runner(variant):
    """The fused CPU kernel over quantized K/V: a correct kernel."""
    import mlx_attn

    def run(q, k_quant, v_quant, **kwargs):
        return mlx_attn.quantized_scaled_dot_product_attention(
            q, k_quant, v_quant, group_size=variant.group_size, bits=variant.bits, stream=mx.cpu,
            backend="fused", **kwargs)

    return run


def scale_bias_swapped(runner):
    return lambda q, k_quant, v_quant, **kw: runner(q, (k_quant[0], k_quant[2], k_quant[1]), v_quant, **kw)


@pytest.mark.parametrize("bits, group_size", [(4, 32), (8, 64)])
def test_quantized_variant_passes_a_correct_kernel_and_fails_a_scale_bias_swap(bits, group_size):
    variant = self_check.QuantizedVariant("float16", 64, bits, group_size)
    assert str(variant) == f"quantized/float16/D=64/{bits}-bit/group {group_size}"
    good = self_check.check_quantized_variant(variant, quantized_cpu_runner(variant))
    assert good.passed and good.cases == len(self_check.quantized_cases(variant)), good.error
    bad = self_check.check_quantized_variant(variant, scale_bias_swapped(quantized_cpu_runner(variant)))
    assert not bad.passed and "max abs error" in bad.error
    with pytest.raises(ValueError, match="dtype"):
        self_check.QuantizedVariant("int8", 64, bits, group_size)


def test_quantized_cases_cover_decode_splits_window_sinks_and_prefill():
    cases = self_check.quantized_cases(self_check.QuantizedVariant("float32", 128, 8, 64))
    assert any(c.q_len == 1 and c.kv_len > 256 for c in cases)
    assert any(c.window_size and c.sinks for c in cases)
    assert any(c.q_len > 8 for c in cases)  # a prefill shape: several row chunks
    assert any(c.softcap for c in cases)


@needs_emulator
def test_quantized_self_check_runs_the_emulated_metal_kernel():
    from test_quantized_prefill_metal import SAMPLE_INSTANCES, instance, trimmed_source

    # the prefill case (19 positions, a bool mask) takes the quantized prefill
    # kernel: the emulator test's sample build (cached) has it
    assert instance("float32", 64, 4, "bool") in SAMPLE_INSTANCES
    prefill = trimmed_source(SAMPLE_INSTANCES)
    runner = EmulatedMetal(fast_math=True, sources=METAL_SOURCES + [prefill])
    variant = self_check.QuantizedVariant("float32", 64, 4, 32)

    def run(q, k_quant, v_quant, **kwargs):
        return runner.quantized(q, k_quant, v_quant, bits=variant.bits, group_size=variant.group_size, **kwargs)

    result = self_check.check_quantized_variant(variant, run)
    assert result.passed, result.error
    assert not self_check.check_quantized_variant(variant, scale_bias_swapped(run)).passed


@pytest.mark.parametrize("kernel_correct", [True, False], ids=["passes", "fails"])
def test_quantized_gpu_path_follows_the_self_check(monkeypatch, kernel_correct):
    """fused-metal once the quantized variant passed its check; a failed check
    disables it with one warning (auto: the reference path; fused: an error)."""
    import mlx_attn
    from mlx_attn import _native, quantized

    monkeypatch.setattr(_native, "ext", MetalBuild(_native.ext))
    variant = self_check.QuantizedVariant("float16", 64, 8, 64)
    runner = quantized_cpu_runner(variant)
    monkeypatch.setattr(quantized, "quantized_metal_kernel_runner",
                        lambda stream, group_size, bits: runner if kernel_correct else scale_bias_swapped(runner))
    q = mx.zeros((1, 4, 1, 64), mx.float16)
    k_quant = mx.quantize(mx.zeros((1, 2, 40, 64), mx.float16), 64, 8)

    def path(**kwargs):
        return mlx_attn.quantized_attention_path(q, k_quant, k_quant, scale=0.125, stream=mx.gpu, **kwargs)

    if kernel_correct:
        assert path() == "fused-metal"
        assert self_check.results()[variant].passed
        return
    with pytest.warns(RuntimeWarning, match="quantized/float16/D=64/8-bit/group 64"):
        assert path() == "reference"
    with pytest.raises(ValueError, match="failed its self-check"):
        path(backend="fused")


# --- the Metal backward: the same gate, gradients against the reference path's autodiff


class EmulatedBackward:
    """``run_backward`` of the Metal backward kernels in the MSL emulator,
    from the out and lse the fused forward returns (the reference path's)."""

    def __init__(self, sources=None):
        self.metal = EmulatedMetal(fast_math=True, sources=sources or [BACKWARD, SPLIT])

    def __call__(self, q, k, v, d_out, *, scale, mask=None, sinks=None, window_size=None, softcap=None):
        kwargs = dict(scale=scale, mask=mask, sinks=sinks, window_size=window_size, softcap=softcap)
        out, lse = reference_attention(q, k, v, return_lse=True, stream=mx.cpu, **kwargs)
        grads = emulated_backward(self.metal, q, k, v, out, lse, d_out, **kwargs)
        return [g for g in grads if g is not None]


def backward_of(attention):
    """``run_backward`` from mx.vjp of ``attention(q, k, v, *, sinks, ...)``."""
    def run(q, k, v, d_out, *, sinks=None, **kwargs):
        def attend(q, k, v, *maybe_sinks):
            return attention(q, k, v, sinks=maybe_sinks[0] if maybe_sinks else None, **kwargs)

        return mx.vjp(attend, [q, k, v] + ([sinks] if sinks is not None else []), [d_out])[1]

    return run


# A correct backward: the reference path's autodiff in the inputs' dtype.
autodiff_backward = backward_of(functools.partial(reference_attention, stream=mx.cpu))


def dk_dv_swapped(run):
    def swapped(*args, **kwargs):
        dq, dk, dv, *rest = run(*args, **kwargs)
        return [dq, dv, dk, *rest]
    return swapped


def dq_doubled(run):
    def doubled(*args, **kwargs):
        dq, *rest = run(*args, **kwargs)
        return [2 * dq, *rest]
    return doubled


def test_backward_variant_validates_and_names_itself():
    assert str(BackwardVariant("float16", 64)) == "backward/float16/D=64"
    assert BackwardVariant("float16", 64) == BackwardVariant("float16", 64, 64)
    assert str(BackwardVariant("bfloat16", 64, 128)) == "backward/bfloat16/D=64/Dv=128"
    with pytest.raises(ValueError, match="dtype"):
        BackwardVariant("int8", 64)


def test_backward_cases_cover_the_kernel_branches():
    cases = self_check.backward_cases(BackwardVariant("float32", 64))
    assert {c.mask for c in cases} >= {"causal", "bool", "additive"}
    assert any(c.softcap for c in cases)
    assert any(c.sinks for c in cases) and any(c.window_size for c in cases)
    assert any(c.q_heads > c.kv_heads for c in cases)  # GQA: dK/dV sum over the group
    assert all(c.q_len > 32 and c.q_len % 32 and c.kv_len % 32 for c in cases)  # several blocks, partial last


def test_correct_backward_passes_once_and_a_broken_one_warns_once():
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return autodiff_backward(*args, **kwargs)

    good = BackwardVariant("float32", 64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert self_check.trusted(good, counted) and self_check.trusted(good, counted)
    assert len(calls) == len(self_check.backward_cases(good))
    assert self_check.results()[good].max_error < 1e-5

    bad = BackwardVariant("bfloat16", 128)
    with pytest.warns(RuntimeWarning, match=r"backward/bfloat16/D=128.*dk max relative error.*autodiff"):
        assert not self_check.trusted(bad, dk_dv_swapped(autodiff_backward))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        assert not self_check.trusted(bad, dk_dv_swapped(autodiff_backward))


def test_the_fused_cpu_backward_passes_the_backward_check():
    """The check accepts a real fused backward (the CPU's, through mx.vjp of
    the public op), not only the reference autodiff it compares with."""
    import mlx_attn

    fused_cpu_backward = backward_of(
        functools.partial(mlx_attn.scaled_dot_product_attention, backend="fused", stream=mx.cpu))
    for dtype in ("float32", "bfloat16"):
        result = self_check.check_backward_variant(BackwardVariant(dtype, 64), fused_cpu_backward)
        assert result.passed and result.max_error <= self_check.TOLERANCE[dtype] / 5, result


@pytest.mark.parametrize(
    "runner, message",
    [
        (dq_doubled(autodiff_backward), "dq max relative error"),
        (lambda *a, **kw: autodiff_backward(*a, **kw)[:3], "returned 3 gradients, expected 4"),
        (lambda *a, **kw: [mx.full(g.shape, np.nan, g.dtype) for g in autodiff_backward(*a, **kw)], "non-finite dq"),
        (lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("no pipeline")), "RuntimeError: no pipeline"),
    ],
    ids=["scaled dq", "no d_sinks", "nan", "raises"],
)
def test_backward_failure_modes_are_reported(runner, message):
    result = self_check.check_backward_variant(BackwardVariant("float16", 64), runner)
    assert not result.passed and message in result.error
    assert result.error.startswith("case 'causal+sinks, GQA'")


def test_backward_check_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("MLX_ATTN_SELF_CHECK", "0")
    assert self_check.trusted(BackwardVariant("float16", 64), dk_dv_swapped(autodiff_backward))
    assert self_check.results() == {}


@needs_emulator
@pytest.mark.parametrize("dtype, head_dim, value_dim", [
    ("float32", 64, 64), ("float16", 128, 128), ("bfloat16", 80, 80),
    ("float32", 192, 128),  # the D-split family (metal/attention_backward_split.h)
])
def test_emulated_metal_backward_passes_its_self_check(dtype, head_dim, value_dim):
    variant = BackwardVariant(dtype, head_dim, value_dim)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert self_check.trusted(variant, EmulatedBackward())
    result = self_check.results()[variant]
    assert result.cases == 3 and result.max_error <= self_check.TOLERANCE[dtype] / 5  # room for the GPU's own rounding


@needs_emulator
@pytest.mark.parametrize("mutant", [
    ("gqa: dK/dV from the first query head only", "for (int g = 0; g < p.group; ++g)", "for (int g = 0; g < 1; ++g)"),
    ("window: dQ key range start off by one", "first_pos - p.window_size + 1;", "first_pos - p.window_size + 2;"),
], ids=lambda m: m[0])
def test_self_check_disables_a_broken_emulated_backward(tmp_path, mutant):
    """Faults of tests/test_metal_backward_mutations.py seeded into the
    backward's source: the canonical cases catch them, the gate says no."""
    _, old, new = mutant
    source = kernel_text(BACKWARD)  # the family's headers inlined
    assert source.count(old) == 1
    mutated = tmp_path / BACKWARD.name
    mutated.write_text(source.replace(old, new))
    variant = BackwardVariant("float32", 64)
    with pytest.warns(RuntimeWarning, match="backward/float32/D=64"):
        assert not self_check.trusted(variant, EmulatedBackward(sources=[mutated]))
    assert "max relative error" in self_check.results()[variant].error
    dx, dy = dk_dv_swapped(EmulatedBackward()), EmulatedBackward()
    assert not self_check.check_backward_variant(variant, dx).passed and self_check.check_backward_variant(variant, dy).passed


@needs_emulator
@pytest.mark.skipif(os.environ.get("MLX_ATTN_FULL_GRID") != "1",
                    reason="one more emulator compile: runs under MLX_ATTN_FULL_GRID=1")
def test_self_check_disables_a_broken_emulated_split_backward(tmp_path):
    """A fault of the D-split family (tests/test_metal_backward_mutations.py:
    its own chunk staged first, so the gradient products read another
    chunk's columns): the canonical cases catch it at 192/128."""
    old, new = "return (own + 1 + i) % chunks;", "return (own + i) % chunks;"
    source = kernel_text(SPLIT)
    assert source.count(old) == 1
    mutated = tmp_path / SPLIT.name
    mutated.write_text(split_only(source.replace(old, new), "MLX_ATTN_BACKWARD_SPLIT(float32, float, 192, 128)"))
    variant = BackwardVariant("float32", 192, 128)
    with pytest.warns(RuntimeWarning, match="backward/float32/D=192/Dv=128"):
        assert not self_check.trusted(variant, EmulatedBackward(sources=[BACKWARD, mutated]))
    assert "max relative error" in self_check.results()[variant].error


def metal_call(dtype=mx.float16, head_dim=64, **kwargs):
    """The call ops builds for a GPU problem, on a (simulated) Metal build."""
    from mlx_attn import ops

    q = mx.zeros((1, 4, 40, head_dim), dtype)
    kv = mx.zeros((1, 2, 40, head_dim), dtype)
    return ops.AttentionCall.build(q, kv, kv, scale=0.125, mask="causal", stream=mx.gpu, **kwargs)


@pytest.mark.parametrize("kernel_correct", [True, False], ids=["passes", "fails"])
def test_fused_metal_call_resolves_the_backward_variants_trust(monkeypatch, kernel_correct):
    """When ops picks the fused Metal forward it also resolves the Metal
    backward's trust (the problem's variant, checked once with the backward
    runner; a failure warns once) and hands it to the primitive as an option:
    the C++ vjp never calls back into Python for it."""
    from mlx_attn import _native, ops

    monkeypatch.setattr(_native, "ext", MetalBuild(_native.ext))
    monkeypatch.setattr(ops, "metal_kernel_runner", lambda stream=None: reference_runner)
    runner = autodiff_backward if kernel_correct else dq_doubled(autodiff_backward)
    monkeypatch.setattr(ops, "metal_backward_runner", lambda stream=None: runner)
    if kernel_correct:
        call = metal_call()
        assert (call.path, call.metal_backward_trusted) == ("fused-metal", True)
    else:
        with pytest.warns(RuntimeWarning, match="backward/float16/D=64"):
            call = metal_call()
        assert (call.path, call.metal_backward_trusted) == ("fused-metal", False)  # the forward still runs
        assert not metal_call().metal_backward_trusted  # checked once: no second warning
    with warnings.catch_warnings(record=True) as caught:  # other variants are checked on their own
        warnings.simplefilter("always")
        assert metal_call(mx.float32, 128).metal_backward_trusted == kernel_correct
    assert [str(w.message).count("backward/float32/D=128") for w in caught] == ([] if kernel_correct else [1])
    backward = {v for v in self_check.results() if isinstance(v, BackwardVariant)}
    assert backward == {BackwardVariant("float16", 64), BackwardVariant("float32", 128)}
    # the D-split family's variants (D = 256 here) are checked the same way
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert metal_call(mx.float16, 256).metal_backward_trusted == kernel_correct
    assert BackwardVariant("float16", 256) in self_check.results()
    # a problem the backward plan does not take is not checked (its gradients use the reference path)
    monkeypatch.setattr(_native.ext, "metal_backward_launch_plan",
                        lambda problem: SimpleNamespace(supported=False, reason="not taken"), raising=False)
    assert metal_call(mx.float32, 256).metal_backward_trusted
    assert BackwardVariant("float32", 256) not in self_check.results()


def test_the_backward_runner_and_the_cpu_need_no_trust(monkeypatch):
    """The CPU never reads the option: the fused CPU backward runs with
    metal_backward_trusted=False too, and gives the reference gradients."""
    from mlx_attn import _native

    q, k, v = (mx.array(np.random.default_rng(i).standard_normal((1, 2, 24, 64)).astype(np.float32))
               for i in range(3))

    def loss(q, k, v):
        (out,) = _native.ext.fused_attention(q, k, v, scale=0.125, causal=True, metal_backward_trusted=False,
                                             stream=mx.cpu)
        return out.sum()

    def reference_loss(q, k, v):
        return reference_attention(q, k, v, scale=0.125, mask="causal").sum()

    got = mx.grad(loss, argnums=(0, 1, 2))(q, k, v)
    compiled = mx.compile(mx.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    want = mx.grad(reference_loss, argnums=(0, 1, 2))(q, k, v)
    for g, c, w in zip(got, compiled, want):
        assert mx.allclose(g, w, atol=1e-4).item() and mx.allclose(c, w, atol=1e-4).item()


@needs_emulator
def test_doctor_lists_the_emulated_metal_backward():
    variants = [BackwardVariant("float32", 64), BackwardVariant("bfloat16", 96)]
    report = run_doctor(metal_backward=EmulatedBackward(), backward_variants=variants, timings=False)
    assert report.ok, report.markdown
    assert [r.variant for r in report.backward_results] == variants
    assert all(r.passed and r.cases == 6 for r in report.backward_results)
    assert "## Metal backward against the reference path's gradients" in report.markdown
    assert "| backward/bfloat16/D=96 | 6 |" in report.markdown
    broken = run_doctor(metal_backward=dk_dv_swapped(EmulatedBackward()), backward_variants=variants[:1],
                        timings=False)
    assert not broken.ok and "backward/float32/D=64" in broken.markdown.split("would be disabled")[1]


@pytest.mark.skipif(not REAL_METAL, reason="needs an Apple GPU: the Metal backward runs for real only on a Mac")
def test_gpu_gradients_fall_back_when_the_backward_is_not_trusted(monkeypatch):
    """On a Mac: with the backward's self-check failing, mx.grad on the GPU
    gives the reference path's gradients (its autodiff ran instead, without
    the lse kept for the backward: a row that sees no key gets zeros, not NaN)."""
    import mlx_attn
    from mlx_attn import ops

    rng = np.random.default_rng(0)
    q, k, v = (mx.array(rng.standard_normal((1, 4, 40, 64)).astype(np.float32)) for _ in range(3))
    visible = rng.random((40, 40)) < 0.7
    visible[3] = False
    mask = mx.array(visible)
    asked = []

    def refusing(*args, **kwargs):
        asked.append(args[0].shape[-1])
        return [2 * g for g in autodiff_backward(*args, **kwargs)]

    monkeypatch.setattr(ops, "metal_backward_runner", lambda stream=None: refusing)

    def loss(backend):
        return lambda q: mlx_attn.scaled_dot_product_attention(
            q, k, v, scale=0.125, mask=mask, backend=backend, stream=mx.gpu).sum()

    with pytest.warns(RuntimeWarning, match="backward/float32/D=64"):
        got = mx.grad(loss("fused"))(q)
    assert asked and set(asked) == {64}
    assert np.all(np.array(got)[:, :, 3] == 0)
    assert mx.allclose(got, mx.grad(loss("reference"))(q), atol=1e-4).item()


def _paged_runner(kernel_correct: bool):
    """The paged reference path on the CPU as the Metal paged kernels would
    answer (plus one everywhere when the 'kernel' is broken)."""
    from mlx_attn import paged

    def run(q, k_pages, v_pages, block_table, kv_lens, *, bits=0, group_size=0, **kwargs):
        if bits:
            out = paged.quantized_paged_attention(q, k_pages, v_pages, block_table, kv_lens, bits=bits,
                                                  group_size=group_size, backend="reference", stream=mx.cpu, **kwargs)
        else:
            out = paged.paged_attention(q, k_pages, v_pages, block_table, kv_lens, backend="reference",
                                        stream=mx.cpu, **kwargs)
        return out if kernel_correct else out + 1

    return run


@pytest.mark.parametrize("kernel_correct", [True, False], ids=["passes", "fails"])
def test_paged_gpu_path_follows_the_self_check(monkeypatch, kernel_correct):
    """On a Metal build a GPU paged call takes fused-metal once its variant
    passed the paged self-check; a failed check disables it (auto: the
    reference, fused: an error naming the check); head dims the paged
    kernels lack take the reference with their reason."""
    from mlx_attn import _native, paged

    monkeypatch.setattr(_native, "ext", MetalBuild(_native.ext))
    monkeypatch.setattr(paged, "metal_paged_runner", lambda stream=None: _paged_runner(kernel_correct))
    q = mx.zeros((3, 4, 64), mx.float16)
    pages = mx.zeros((8, 2, 16, 64), mx.float16)
    table = mx.array([[0, 1], [2, 3], [4, 5]], dtype=mx.int32)
    kv_lens = mx.array([20, 5, 17], dtype=mx.int32)

    def path(q=q, pages=pages, **kwargs):
        return paged.paged_attention_path(q, pages, pages, table, kv_lens, scale=0.125, stream=mx.gpu, **kwargs)

    with pytest.raises(ValueError, match="backend='fused' is not possible"):  # no paged kernel at D = 80
        path(q=mx.zeros((3, 4, 80), mx.float16), pages=mx.zeros((8, 2, 16, 80), mx.float16), backend="fused")
    if kernel_correct:
        assert path() == "fused-metal"
        assert self_check.results()[self_check.PagedVariant("float16", 64)].passed
        assert path(softcap=5.0, window_size=30, return_lse=True) == "fused-metal"
        return
    with pytest.warns(RuntimeWarning, match="float16"):
        assert path() == "reference"
    with pytest.raises(ValueError, match="failed its self-check"):
        path(backend="fused")
