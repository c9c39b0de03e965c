"""Benchmark of the fused Metal kernels on an Apple GPU: prefill and decode
times, TFLOP/s (prefill) and GB/s of K/V read (decode) next to
mx.fast.scaled_dot_product_attention and the reference path, for D in
{64, 128}, T up to 16384, causal and not, float16 and bfloat16. Prints a
table, saves JSON and a PNG.

    python benchmarks/bench_metal.py                  # on a Mac with Metal
    python benchmarks/bench_metal.py --emulate        # anywhere with clang-19:
                                                      # one tiny shape through the MSL emulator
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

import mlx_attn

ROOT = Path(__file__).resolve().parent.parent
DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16}


def timed(fn, repeats=5) -> float:
    mx.eval(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def gpu_rows(args):
    rows = []
    for d in args.head_dims:
        for dtype_name in args.dtypes:
            dtype = DTYPES[dtype_name]
            for causal in (False, True):
                for t in args.lengths:
                    for phase, tq in (("prefill", t), ("decode", 1)):
                        q = mx.random.normal((1, args.heads, tq, d)).astype(dtype)
                        k = mx.random.normal((1, args.kv_heads, t, d)).astype(dtype)
                        v = mx.random.normal((1, args.kv_heads, t, d)).astype(dtype)
                        mask = "causal" if causal else None
                        row = {"phase": phase, "D": d, "dtype": dtype_name, "causal": causal, "T": t}
                        impls = {
                            "fused": lambda: mlx_attn.scaled_dot_product_attention(q, k, v, scale=d**-0.5, mask=mask, stream=mx.gpu, backend="fused"),
                            "mx.fast": lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=d**-0.5, mask=mask, stream=mx.gpu),
                        }
                        if t <= args.max_reference_len:
                            impls["reference"] = lambda: mlx_attn.scaled_dot_product_attention(q, k, v, scale=d**-0.5, mask=mask, stream=mx.gpu, backend="reference")
                        flops = 4.0 * args.heads * tq * t * d * (0.5 if causal and phase == "prefill" else 1.0)
                        kv_bytes = 2.0 * args.kv_heads * t * d * q.itemsize
                        for name, fn in impls.items():
                            seconds = timed(fn)
                            row[name] = {"ms": seconds * 1e3, "tflops": flops / seconds / 1e12, "gbps": kv_bytes / seconds / 1e9}
                        rows.append(row)
                        f = row["fused"]
                        print(f"| {phase} | {d} | {dtype_name} | {'yes' if causal else 'no'} | {t} | {f['ms']:.2f} | "
                              f"{f['tflops']:.2f} | {f['gbps']:.0f} | {row['mx.fast']['ms']:.2f} | "
                              f"{row['mx.fast']['ms'] / f['ms']:.2f}x |", flush=True)
    return rows


def emulated_rows():
    """One tiny shape through the MSL emulator (keeps this script from rotting)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from metal_runner import EmulatedMetal
    from mlx_attn.reference import reference_attention

    run = EmulatedMetal(fast_math=True)
    rows = []
    for phase, tq in (("prefill", 40), ("decode", 1)):
        q = mx.random.normal((1, 4, tq, 64))
        k = mx.random.normal((1, 2, 80, 64))
        v = mx.random.normal((1, 2, 80, 64))
        start = time.perf_counter()
        out = run(q, k, v, scale=0.125, mask="causal")
        seconds = time.perf_counter() - start
        err = float(mx.abs(out - reference_attention(q, k, v, scale=0.125, mask="causal")).max())
        rows.append({"phase": phase, "T": 80, "emulated_seconds": seconds, "max_abs_error": err,
                     "kernels": [s["kernel"] for s in run.last_plan["dispatches"]]})
        print(f"| {phase} (emulated) | 64 | float32 | yes | 80 | {seconds * 1e3:.0f} ms on the CPU | max error {err:.1e} |")
    return rows


def plot(rows, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, phase, key, label in ((axes[0], "prefill", "tflops", "TFLOP/s"), (axes[1], "decode", "gbps", "GB/s of K/V")):
        for impl, style in (("fused", "o-"), ("mx.fast", "s--"), ("reference", "^:")):
            for d in sorted({r["D"] for r in rows}):
                pts = [(r["T"], r[impl][key]) for r in rows
                       if r["phase"] == phase and r["D"] == d and impl in r and r["dtype"] == "float16" and not r["causal"]]
                if pts:
                    ax.plot(*zip(*pts), style, label=f"{impl} D={d}")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{phase} (float16, not causal)")
        ax.set_xlabel("T")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--max-reference-len", type=int, default=8192)
    p.add_argument("--emulate", action="store_true", help="run one tiny shape in the MSL emulator instead")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    print("| phase | D | dtype | causal | T | fused ms | TFLOP/s | GB/s | mx.fast ms | speed-up |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    if args.emulate:
        rows = emulated_rows()
    else:
        if not (mx.metal.is_available() and mlx_attn.ops._ext is not None and mlx_attn.ops._ext.has_metal()):
            raise SystemExit("needs an Apple GPU and mlx_attn built with Metal (or use --emulate)")
        rows = gpu_rows(args)
        plot(rows, args.out / "bench_metal.png")
    (args.out / "bench_metal.json").write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
