"""The first-use self-check of Metal kernel variants and `mlx-attn doctor`.

No Mac here: the Metal path of both is exercised through the MSL emulator,
including a deliberately broken kernel variant that the check must disable.
"""

from __future__ import annotations

import warnings

import mlx.core as mx
import numpy as np
import pytest

import msl_emulator
from metal_runner import METAL_SOURCES, REAL_METAL, EmulatedMetal
from mlx_attn import self_check
from mlx_attn.doctor import run_doctor
from mlx_attn.reference import reference_attention
from mlx_attn.self_check import Case, Variant

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
    assert any(c.q_heads > c.kv_heads for c in cases)  # GQA
    if phase == "decode":
        assert all(c.q_len <= 8 for c in cases)
        assert max(c.kv_len for c in cases) > 256  # several key/value splits
    else:
        assert all(c.q_len > 32 for c in cases)  # more than one query block


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
    source = decode.read_text()
    broken = source.replace("exp2(", "(0.5f + 0.0f * ", 1)
    assert broken != source
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
            return None if plan["supported"] else plan["reason"]
        return self._ext.unsupported_reason(problem, device=device)


@pytest.mark.parametrize("kernel_correct", [True, False], ids=["passes", "fails"])
def test_gpu_path_order_follows_the_self_check(monkeypatch, kernel_correct):
    """fused-metal once its variant passed; after a failed self-check the
    variant is disabled: mx.fast where it computes the same, else the
    reference path; backend='fused' names the failed self-check."""
    from mlx_attn import _native, ops

    monkeypatch.setattr(_native, "ext", MetalBuild(_native.ext))
    runner = reference_runner if kernel_correct else broken_runner
    monkeypatch.setattr(ops, "metal_kernel_runner", lambda stream=None: runner)
    q = mx.zeros((1, 4, 40, 64), mx.float16)
    kv = mx.zeros((1, 2, 40, 64), mx.float16)
    if kernel_correct:
        assert mlx_attn_path(q, kv, mask="causal") == "fused-metal"
        assert mlx_attn_path(q, kv, mask="causal", window_size=8) == "fused-metal"
        assert self_check.results()[Variant("prefill", "float16", 64)].passed
        return
    with pytest.warns(RuntimeWarning, match="prefill/float16/D=64"):
        assert mlx_attn_path(q, kv, mask="causal") == "mlx-fast"
    assert mlx_attn_path(q, kv, mask="causal", window_size=8) == "reference"
    with pytest.raises(ValueError, match="failed its self-check"):
        mlx_attn_path(q, kv, backend="fused")
    # other variants are checked on their own: decode passes with a correct kernel
    monkeypatch.setattr(ops, "metal_kernel_runner", lambda stream=None: reference_runner)
    assert mlx_attn_path(q[:, :, :1], kv) == "fused-metal"
    assert set(self_check.results()) == {Variant("prefill", "float16", 64), Variant("decode", "float16", 64)}


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


@needs_emulator
def test_quantized_self_check_runs_the_emulated_metal_kernel():
    runner = EmulatedMetal(fast_math=True)
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
