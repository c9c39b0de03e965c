"""Benchmark of the fused Metal kernels on an Apple GPU: prefill and decode
times, TFLOP/s (prefill) and GB/s of K/V read (decode) next to
mx.fast.scaled_dot_product_attention and the reference path, for D in
{64, 128}, T up to 16384, causal and not, float16 and bfloat16. Prints a
table, saves JSON and a PNG.

    python benchmarks/bench_metal.py                  # on a Mac with Metal
    python benchmarks/bench_metal.py --emulate        # anywhere with clang-19: modelled costs
    python benchmarks/bench_metal.py --model-only     # the cost model's table alone (seconds)

--emulate runs our kernels and MLX's own (steel_attention, sdpa_vector) on the
same problems in counting builds of the MSL emulator (kernel_lab/msl_emulator/)
and prints device/threadgroup bytes, simdgroup MMAs, simd ops, barriers and
exp calls per useful FLOP (prefill) or per K/V byte (decode), ours next to
MLX's; the table goes to docs/emulator_costs.md and JSON to
benchmarks/results/. These are modelled costs, not timings. After them, the
cost model (kernel_lab/metal_cost_model.py): registers per thread,
occupancy, predicted time for our kernels (before / after each fix of issue
#23) and MLX's on a 38-core M2 Max, its validation against MLX's own tile
tuning and a public throughput figure, and a check of its counts against
the emulator's counters.

This script is the command line: the runs, checks and tables are
kernel_lab's (emulated_costs, cost_checks, cost_report).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx

import mlx_attn
from mlx_attn._timing import median_seconds

from kernel_lab.cost_report import model_markdown, write_model_section
from kernel_lab.emulated_costs import costs_markdown, emulated_rows, markdown_header, markdown_row

ROOT = Path(__file__).resolve().parent.parent
DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16}


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
                            seconds = median_seconds(fn)
                            row[name] = {"ms": seconds * 1e3, "tflops": flops / seconds / 1e12, "gbps": kv_bytes / seconds / 1e9}
                        rows.append(row)
                        f = row["fused"]
                        print(f"| {phase} | {d} | {dtype_name} | {'yes' if causal else 'no'} | {t} | {f['ms']:.2f} | "
                              f"{f['tflops']:.2f} | {f['gbps']:.0f} | {row['mx.fast']['ms']:.2f} | "
                              f"{row['mx.fast']['ms'] / f['ms']:.2f}x |", flush=True)
    return rows


def model_problems(args) -> list:
    """The cost model's problems: (phase, D, causal, T, GQA group)."""
    problems = [("prefill", d, causal, t, 1) for d in args.head_dims for causal in (False, True) for t in args.lengths]
    problems += [("decode", d, False, t, g) for d in args.decode_head_dims for g in args.decode_groups
                 for t in sorted({128, 1024, *args.decode_lengths})]  # 1024: issue #23's under-filled case; 128: one split
    return problems


def emulated_problems(args) -> list:
    """The problems --emulate runs in the emulator: (phase, D, causal, T, GQA group)."""
    problems = [("prefill", d, causal, t, 1) for d in args.head_dims for causal in (False, True) for t in args.lengths]
    problems += [("decode", d, False, t, g) for d in args.decode_head_dims for g in args.decode_groups
                 for t in args.decode_lengths]
    return problems


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
    p.add_argument("--emulate", action="store_true",
                   help="modelled costs of our kernels and MLX's in the MSL emulator (no GPU needed)")
    p.add_argument("--decode-lengths", type=int, nargs="+", default=[4096, 8192],
                   help="--emulate: decode K/V lengths")
    p.add_argument("--decode-head-dims", type=int, nargs="+", default=[128], help="--emulate: decode head dims")
    p.add_argument("--decode-groups", type=int, nargs="+", default=[4, 8],
                   help="--emulate: decode GQA groups (query heads over one KV head)")
    p.add_argument("--emulate-heads", type=int, default=1, help="--emulate: prefill heads (and KV heads)")
    p.add_argument("--decode-kv-heads", type=int, default=1,
                   help="--emulate: decode KV heads (the plan's split count depends on them)")
    p.add_argument("--model-only", action="store_true",
                   help="only the cost model's table and validation (seconds; no emulator run): "
                        "rewrites its section of --costs-doc")
    p.add_argument("--costs-doc", type=Path, default=ROOT / "docs" / "emulator_costs.md",
                   help="--emulate: where the Markdown table goes")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.model_only:
        if "--lengths" not in (argv if argv is not None else sys.argv[1:]):
            args.lengths = [1024, 2048]
        section = model_markdown(model_problems(args))
        print(section)
        write_model_section(args.costs_doc, section)
        return section
    if args.emulate:
        if "--lengths" not in (argv if argv is not None else sys.argv[1:]):
            # The prefill lengths; the emulator manages some 1e8
            # FLOP/s on 2 cores, so this takes tens of minutes (--lengths
            # 512 1024 about 5; the costs per FLOP move by a few percent).
            args.lengths = [1024, 2048]
        print(markdown_header())
        rows = emulated_rows(emulated_problems(args), args.emulate_heads, args.decode_kv_heads,
                             on_row=lambda row: print(markdown_row(row), flush=True))
        command = " ".join(["python benchmarks/bench_metal.py", *(argv if argv is not None else sys.argv[1:])])
        args.costs_doc.write_text(costs_markdown(rows, command))
        section = model_markdown(model_problems(args))  # the cost model's columns beside the counters
        print(section)
        write_model_section(args.costs_doc, section)
        (args.out / "bench_metal_emulated.json").write_text(json.dumps(rows, indent=1))
        return rows
    print("| phase | D | dtype | causal | T | fused ms | TFLOP/s | GB/s | mx.fast ms | speed-up |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    if not (mx.metal.is_available() and mlx_attn.ops._ext is not None and mlx_attn.ops._ext.has_metal()):
        raise SystemExit("needs an Apple GPU and mlx_attn built with Metal (or use --emulate)")
    rows = gpu_rows(args)
    plot(rows, args.out / "bench_metal.png")
    (args.out / "bench_metal.json").write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
