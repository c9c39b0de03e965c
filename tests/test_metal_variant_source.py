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

import msl_emulator
from metal_runner import EmulatedMetal
from mlx_attn import _ext
from mlx_attn.reference import reference_attention

REPO = Path(__file__).resolve().parent.parent
INSTANTIATION = re.compile(r"^MLX_ATTN_[A-Z0-9_]+\([^()]*\)[ \t]*\n?", re.M)
MASKS = {"": "MLX_ATTN_MASK_NONE", "_mask_bool": "MLX_ATTN_MASK_BOOL", "_mask_additive": "MLX_ATTN_MASK_ADDITIVE"}
TYPES = {"float32": "float", "float16": "half", "bfloat16": "bfloat"}


def expected_variant(kernel: str) -> str:
    match = re.fullmatch(r"attention_prefill_(float32|float16|bfloat16)_d(\d+)_bk(\d+)(_mask_bool|_mask_additive)?", kernel)
    suffix = match.group(4) or ""
    family = INSTANTIATION.sub("", _ext.metal_kernel_source("attention_prefill"))
    return (family + f'MLX_ATTN_PREFILL_MASK("{suffix}", {MASKS[suffix]}, {match.group(1)}, '
            f"{TYPES[match.group(1)]}, {match.group(2)}, {match.group(3)})\n")


@pytest.mark.parametrize("kernel", [
    "attention_prefill_float16_d64_bk32", "attention_prefill_bfloat16_d128_bk32_mask_bool",
    "attention_prefill_float32_d256_bk8_mask_additive"])
def test_prefill_variant_is_the_family_text_with_one_instantiation(kernel):
    text = _ext.metal_variant_source(kernel)
    assert text == expected_variant(kernel)
    assert len(INSTANTIATION.findall(text)) == 1
    assert len(text) < len(_ext.metal_kernel_source("attention_prefill"))


@pytest.mark.parametrize("kernel", [
    "attention_decode_partial_float16_d128",  # another family: its whole source
    "attention_prefill_float64_d64_bk32",  # not a kernel dtype
    "attention_prefill_float16_dxx_bk32",
    "attention_prefill_float16_d64",
    "attention_prefill",
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
    assert [d["kernel"] for d in run.last_plan["dispatches"]] == [kernel]
    expected = reference_attention(q.astype(mx.float32), k.astype(mx.float32), v.astype(mx.float32), scale=0.125)
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), np.array(expected), atol=2e-3, rtol=2e-3)
