"""First-use compile cost, by proxy: how long clang-19 takes to compile a
Metal family's whole source (what the Mac host hands Metal's run-time
compiler on the first fused call today: every instantiation of the file)
against one variant of it (the same headers, one kernel instantiated).

No Metal compiler runs here (Linux): the proxy is the MSL emulator's build
(kernel_lab/msl_emulator: translate, then clang-19 -O1 to a shared library),
uncached. Metal's compiler is a different compiler; the ratio of the two
times, not their values, is what carries over (a compile's cost grows with
the instantiated kernel bodies in both).

    python benchmarks/bench_metal_compile.py            # prefill, decode, quantized; float16
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# One kernel per kind of each family (csrc/metal/metal_sources.cpp
# kVariantFamilies), by its host name.
VARIANTS = {
    "attention_prefill": {"prefill": "attention_prefill_float16_d64_bk32"},
    "attention_decode": {"decode partial": "attention_decode_partial_float16_d128_r8_sg4",
                         "decode merge": "attention_decode_merge_float16_d128"},
    "attention_quantized": {"quantized decode partial": "attention_quantized_decode_partial_float16_d128_b4_r8_sg4"},
}


def one_variant_source(family: str, kind: str) -> str:
    """The source the Mac host compiles on a kernel's first use
    (_ext.metal_variant_source: the family's text, one instantiation)."""
    from mlx_attn import _ext

    kernel = VARIANTS[family][kind]
    text = _ext.metal_variant_source(kernel)
    if not text:
        raise ValueError(f"{kernel} has no per-variant source")
    return text


def timed_build(source: Path) -> tuple[float, int]:
    """Seconds for an uncached emulator build of `source`, and its kernel count."""
    from kernel_lab.msl_emulator import build

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
