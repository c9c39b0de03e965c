"""First-use compile cost, by proxy: how long clang-19 takes to compile a
Metal family's whole source (what the Mac host hands Metal's run-time
compiler on the first fused call today: every instantiation of the file)
against one variant of it (the same headers, one kernel instantiated).

No Metal compiler runs here (Linux): the proxy is the MSL emulator's build
(tests/msl_emulator: translate, then clang-19 -O1 to a shared library),
uncached. Metal's compiler is a different compiler; the ratio of the two
times, not their values, is what carries over (a compile's cost grows with
the instantiated kernel bodies in both).

    python benchmarks/bench_metal_compile.py            # prefill, decode, quantized; float16
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

# A top-level line that expands an instantiation macro, e.g.
# `MLX_ATTN_PREFILL_TYPES(64, 32)`: what a one-variant source drops.
INSTANTIATION_LINE = re.compile(r"^MLX_ATTN_[A-Z0-9_]+\([^()]*\)[ \t]*$", re.M)

# Variants per family (csrc/metal/metal_sources.cpp kVariantFamilies): the
# per-kernel instantiation macro and its arguments, one per kernel kind.
VARIANTS = {
    "attention_prefill": {"prefill": 'MLX_ATTN_PREFILL_MASK("", MLX_ATTN_MASK_NONE, float16, half, 64, 32)'},
    "attention_decode": {"decode partial": 'MLX_ATTN_DECODE_PARTIAL("", MLX_ATTN_MASK_NONE, float16, half, 128)',
                         "decode merge": "MLX_ATTN_DECODE_MERGE(float16, half, 128)"},
    "attention_quantized": {
        "quantized decode partial": 'MLX_ATTN_QUANTIZED_DECODE_MASK("", MLX_ATTN_MASK_NONE, float16, half, 128, 4)'},
}


def one_variant_source(family: str, kind: str) -> str:
    text = (ROOT / "metal" / f"{family}.metal").read_text()
    kept = INSTANTIATION_LINE.sub("", text)
    if kept == text:
        raise ValueError(f"metal/{family}.metal has no instantiation lines to drop")
    return kept + "\n" + VARIANTS[family][kind] + "\n"


def timed_build(source: Path) -> tuple[float, int]:
    """Seconds for an uncached emulator build of `source`, and its kernel count."""
    from msl_emulator import build

    start = time.perf_counter()
    _, translation = build.build(source, include_dirs=(ROOT,), fast_math=True)
    return time.perf_counter() - start, len(translation.kernels)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--variants-only", action="store_true",
                   help="time the one-variant builds alone (the whole files take minutes each)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as cache:
        os.environ["MSL_EMULATOR_CACHE"] = cache  # uncached: every build compiles
        print("| family | whole file: kernels, s | variant | one variant: kernels, s | one / whole |")
        print("|---|---|---|---|---|")
        rows = []
        for family in args.families:
            whole_seconds, whole_kernels = (float("nan"), 0) if args.variants_only else timed_build(
                ROOT / "metal" / f"{family}.metal")
            for kind in VARIANTS[family]:
                variant = Path(cache) / f"{family}_{kind.replace(' ', '_')}.metal"
                variant.write_text(one_variant_source(family, kind))
                one_seconds, one_kernels = timed_build(variant)
                rows.append((family, whole_kernels, whole_seconds, kind, one_kernels, one_seconds))
                print(f"| {family} | {whole_kernels}, {whole_seconds:.1f} | {kind} | {one_kernels}, {one_seconds:.1f} | "
                      f"{one_seconds / whole_seconds:.2f}x |", flush=True)
    return rows


if __name__ == "__main__":
    main()
