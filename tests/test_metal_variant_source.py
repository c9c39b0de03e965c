"""Per-variant first-use compile (csrc/metal/metal_sources.cpp variant_source):
a prefill kernel's source is its family's embedded text with the top-level
instantiation lines dropped and its one instantiation appended, and that
text alone defines exactly that kernel and computes attention in the MSL
emulator. The dropping rule is written here a second time, independently."""

import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from kernel_lab import msl_emulator
from kernel_lab.metal_runner import EmulatedMetal, reference_lse
from mlx_attn import _ext
from mlx_attn.reference import reference_attention

REPO = Path(__file__).resolve().parent.parent
INSTANTIATION = re.compile(r"^MLX_ATTN_[A-Z0-9_]+\([^()]*\)[ \t]*\n?", re.M)
MASKS = {"": "MLX_ATTN_MASK_NONE", "_mask_bool": "MLX_ATTN_MASK_BOOL", "_mask_additive": "MLX_ATTN_MASK_ADDITIVE"}
TYPES = {"float32": "float", "float16": "half", "bfloat16": "bfloat"}


# family -> (name pattern after the prefix, per-kernel macro, whether it takes the mask arguments)
FAMILIES = {
    "attention_prefill_split_": (r"(\w+?)_d(\d+)_dv(\d+)_bk(\d+)", "MLX_ATTN_PREFILL_SPLIT_MASK", True),
    "attention_prefill_": (r"(\w+?)_d(\d+)_bk(\d+)", "MLX_ATTN_PREFILL_MASK", True),
    "attention_decode_partial_": (r"(\w+?)_d(\d+)_r(\d+)_sg(\d+)", "MLX_ATTN_DECODE_PARTIAL", True),
    "attention_decode_merge_": (r"(\w+?)_d(\d+)", "MLX_ATTN_DECODE_MERGE", False),
    "attention_quantized_decode_partial_": (r"(\w+?)_d(\d+)_b(\d+)_r(\d+)_sg(\d+)", "MLX_ATTN_QUANTIZED_DECODE_MASK",
                                            True),
}


def expected_variant(kernel: str) -> str:
    prefix = next(p for p in FAMILIES if kernel.startswith(p))  # longer prefixes first
    pattern, macro, masked = FAMILIES[prefix]
    mask = r"(_mask_bool|_mask_additive)?" if masked else "()"
    dtype, *fields, suffix = re.fullmatch(pattern + mask, kernel[len(prefix):]).groups()
    suffix = suffix or ""
    source = re.match(r"attention_(prefill_split|prefill|decode|quantized)", kernel).group(0)
    text = INSTANTIATION.sub("", _ext.metal_kernel_source(source))
    arguments = [dtype, TYPES[dtype], *fields]
    if masked:
        arguments = [f'"{suffix}"', MASKS[suffix], *arguments]
    return text + f"{macro}({', '.join(arguments)})\n"


@pytest.mark.parametrize("kernel", [
    "attention_prefill_float16_d64_bk32", "attention_prefill_bfloat16_d128_bk32_mask_bool",
    "attention_prefill_float32_d128_bk16_mask_additive", "attention_prefill_split_float32_d256_dv256_bk8",
    "attention_prefill_split_float16_d576_dv512_bk16_mask_bool",
    "attention_decode_partial_float16_d128_r8_sg4", "attention_decode_partial_bfloat16_d512_r1_sg16_mask_additive",
    "attention_decode_merge_float32_d96",
    "attention_quantized_decode_partial_float16_d64_b4_r8_sg4",
    "attention_quantized_decode_partial_bfloat16_d128_b8_r1_sg32_mask_bool"])
def test_variant_is_the_family_text_with_one_instantiation(kernel):
    text = _ext.metal_variant_source(kernel)
    assert text == expected_variant(kernel)
    assert len(INSTANTIATION.findall(text)) == 1
    source = re.match(r"attention_(prefill_split|prefill|decode|quantized)", kernel).group(0)
    assert len(text) < len(_ext.metal_kernel_source(source))


@pytest.mark.parametrize("kernel", [
    "attention_paged_decode_partial_float16_d128",  # a family without the rule: its whole source
    "attention_backward_dq_float16_d64_bk32",
    "attention_decode_merge_float16_d64_mask_bool",  # the merge has no mask kinds
    "attention_decode_partial_float16_d128_bk16",
    "attention_decode_partial_float16_d128",  # the dense decode names its shape
    "attention_decode_partial_float16_d128_r8",
    "attention_quantized_decode_partial_float16_d64",  # the quantized family names its bits
    "attention_quantized_decode_partial_float16_d64_bx",
    "attention_quantized_decode_partial_float16_d64_b4",  # and its shape
    "attention_quantized_decode_partial_float16_d64_b4_r8",
    "attention_prefill_float64_d64_bk32",  # not a kernel dtype
    "attention_prefill_float16_dxx_bk32",
    "attention_prefill_float16_d64",
    "attention_prefill",
    "attention_prefill_split_float16_d256_bk8",  # the split family names its value dim
    "attention_prefill_split_float16_d256_dvx_bk8",
])
def test_other_names_compile_the_whole_family(kernel):
    assert _ext.metal_variant_source(kernel) == ""


def test_headers_have_no_top_level_instantiation_lines():
    """The rule drops such lines anywhere in the inlined text: only the
    .metal instantiation files may have them."""
    for header in sorted((REPO / "metal").glob("*.h")):
        found = INSTANTIATION.findall(header.read_text())
        assert not found, f"{header.name}: {found[0]!r} would be dropped from every variant source"


@pytest.mark.skipif(not msl_emulator.clang_available(), reason="needs clang-19 for the MSL emulator")
def test_variant_source_alone_defines_and_runs_its_kernel(tmp_path):
    kernel = "attention_prefill_float16_d64_bk32"  # the default target's plan for this problem
    path = tmp_path / f"{kernel}.metal"
    path.write_bytes(_ext.metal_variant_source(kernel).encode())
    # no include dirs: the text stands alone, as in a run-time compile
    assert msl_emulator.compile_library([path], include_dirs=[]).kernel_names == [kernel]
    run = EmulatedMetal(fast_math=True, sources=[path])
    rng = np.random.default_rng(0)
    q, k, v = (mx.array(rng.standard_normal(shape).astype(np.float16))
               for shape in ((1, 2, 40, 64), (1, 2, 70, 64), (1, 2, 70, 64)))
    out = run(q, k, v, scale=0.125)
    assert [d.kernel for d in run.last_plan.dispatches] == [kernel]
    expected = reference_attention(q.astype(mx.float32), k.astype(mx.float32), v.astype(mx.float32), scale=0.125)
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), np.array(expected), atol=2e-3, rtol=2e-3)


@pytest.mark.skipif(not msl_emulator.clang_available(), reason="needs clang-19 for the MSL emulator")
def test_decode_variant_source_alone_runs_a_one_split_decode(tmp_path):
    """One split: the plan's single dispatch (the partial kernel writing the
    output itself) compiled from its variant source alone, with sinks and
    the row log-sum-exp."""
    kernel = "attention_decode_partial_float32_d64_r1_sg32_mask_bool"  # the row shape
    path = tmp_path / f"{kernel}.metal"
    path.write_bytes(_ext.metal_variant_source(kernel).encode())
    assert msl_emulator.compile_library([path], include_dirs=[]).kernel_names == [kernel]
    run = EmulatedMetal(fast_math=True, sources=[path])
    rng = np.random.default_rng(1)
    q, k, v = (mx.array(rng.standard_normal(shape).astype(np.float32))
               for shape in ((1, 4, 2, 64), (1, 2, 40, 64), (1, 2, 40, 64)))
    mask = mx.array(rng.random((2, 40)) > 0.3)
    sinks = mx.array(rng.standard_normal(4).astype(np.float32))
    out, lse = run(q, k, v, scale=0.125, mask=mask, sinks=sinks, return_lse=True)
    assert [d.kernel for d in run.last_plan.dispatches] == [kernel] and run.last_plan.splits == 1
    expected = reference_attention(q, k, v, scale=0.125, mask=mask, sinks=sinks)
    np.testing.assert_allclose(np.array(out), np.array(expected), atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.array(lse), reference_lse(q, k, v, scale=0.125, mask=mask, sinks=sinks),
                               atol=1e-4, rtol=1e-5)
