"""CPU benchmark of scaled dot-product attention: mlx_attn's fused kernel vs
mx.fast.scaled_dot_product_attention on the CPU stream, the pure-MLX reference
path and (when installed) PyTorch's CPU scaled_dot_product_attention with the
same number of threads.

Prints a table (time, GFLOP/s, extra peak memory, speed-up of the fused kernel
over each baseline measured in the same run), saves it as JSON and a PNG plot.

    python benchmarks/bench_sdpa_cpu.py                   # full grid
    python benchmarks/bench_sdpa_cpu.py --quick           # a small smoke run

The slow unfused baselines are only run up to --max-baseline-len (they need
O(T^2) memory and minutes per call beyond it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

import mlx_attn
from mlx_attn import _ext

try:
    import torch
except ImportError:  # optional, for comparison only
    torch = None

DTYPES = {"float32": mx.float32, "float16": mx.float16}


def attention_flops(batch, heads, q_len, kv_len, d, dv, causal):
    """Multiply-adds of Q.K^T and P.V, counted as 2 FLOPs each; causal counts
    only the visible half (what an ideal kernel computes)."""
    pairs = q_len * kv_len
    if causal:
        pairs = sum(min(kv_len, i + 1 + kv_len - q_len) for i in range(q_len))
    return 2.0 * batch * heads * pairs * (d + dv)


def threads_used() -> int:
    env = os.environ.get("MLX_ATTN_NUM_THREADS")
    return int(env) if env else os.cpu_count() or 1


def time_call(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def mlx_runner(impl, q, k, v, causal):
    mask = "causal" if causal else None
    scale = q.shape[-1] ** -0.5
    if impl == "fused":
        return lambda: mx.eval(
            mlx_attn.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, backend="fused")
        )
    if impl == "reference":
        return lambda: mx.eval(
            mlx_attn.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, backend="reference")
        )
    if impl == "mx.fast":
        return lambda: mx.eval(
            mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, stream=mx.cpu)
        )
    raise ValueError(impl)


def extra_peak_memory(fn) -> int:
    """Peak bytes MLX allocated during fn beyond what was live before."""
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    fn()
    mx.synchronize()
    return mx.get_peak_memory() - base


def run_torch(batch, heads, t, d, dtype_name, causal, repeats):
    tdtype = {"float32": torch.float32, "float16": torch.float16}[dtype_name]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, heads, t, d, generator=gen, dtype=tdtype) for _ in range(3))
    fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
    with torch.inference_mode():
        return time_call(fn, repeats)


def benchmark(args):
    mx.set_default_device(mx.cpu)
    if torch is not None:
        torch.set_num_threads(threads_used())
    rows = []
    for d in args.head_dims:
        for dtype_name in args.dtypes:
            dtype = DTYPES[dtype_name]
            for causal in (False, True):
                for t in args.lengths:
                    rng = np.random.default_rng(0)
                    q, k, v = (
                        mx.array(rng.standard_normal((1, args.heads, t, d)).astype(np.float32)).astype(dtype)
                        for _ in range(3)
                    )
                    mx.eval(q, k, v)
                    flops = attention_flops(1, args.heads, t, t, d, d, causal)
                    row = {"D": d, "dtype": dtype_name, "causal": causal, "T": t}
                    impls = ["fused"]
                    if t <= args.max_baseline_len:
                        impls += ["mx.fast", "reference"]
                    for impl in impls:
                        fn = mlx_runner(impl, q, k, v, causal)
                        repeats = args.repeats if impl == "fused" else 1
                        seconds = time_call(fn, repeats)
                        row[impl] = {
                            "ms": seconds * 1e3,
                            "gflops": flops / seconds / 1e9,
                            "extra_peak_mib": extra_peak_memory(fn) / 2**20,
                        }
                    if torch is not None:
                        seconds = run_torch(1, args.heads, t, d, dtype_name, causal, args.repeats)
                        row["torch"] = {"ms": seconds * 1e3, "gflops": flops / seconds / 1e9}
                    rows.append(row)
                    print_row(row, flush=True)
    return rows


IMPLS = ["fused", "mx.fast", "reference", "torch"]


def header():
    cols = ["D", "dtype", "causal", "T"]
    for impl in IMPLS:
        cols += [f"{impl} ms", f"{impl} GFLOP/s"]
    cols += ["fused MiB", "unfused MiB", "vs mx.fast", "vs torch"]
    return "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols)


def print_row(row, flush=False):
    cells = [str(row["D"]), row["dtype"], "yes" if row["causal"] else "no", str(row["T"])]
    for impl in IMPLS:
        r = row.get(impl)
        cells += [f"{r['ms']:.1f}", f"{r['gflops']:.1f}"] if r else ["-", "-"]
    cells.append(f"{row['fused']['extra_peak_mib']:.1f}")
    cells.append(f"{row['mx.fast']['extra_peak_mib']:.0f}" if "mx.fast" in row else "-")
    for base in ("mx.fast", "torch"):
        cells.append(f"{row[base]['ms'] / row['fused']['ms']:.1f}x" if base in row else "-")
    print("| " + " | ".join(cells) + " |", flush=flush)


def summary_table(rows) -> str:
    """The compact Markdown table quoted in the README."""
    lines = [
        "| D | dtype | causal | T | fused ms | fused GFLOP/s | mx.fast GFLOP/s | torch GFLOP/s | fused vs mx.fast | fused vs torch | fused extra MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        f = r["fused"]
        cells = [str(r["D"]), r["dtype"], "yes" if r["causal"] else "no", str(r["T"]), f"{f['ms']:.1f}", f"{f['gflops']:.0f}"]
        cells.append(f"{r['mx.fast']['gflops']:.1f}" if "mx.fast" in r else "-")
        cells.append(f"{r['torch']['gflops']:.0f}" if "torch" in r else "-")
        cells.append(f"{r['mx.fast']['ms'] / f['ms']:.0f}x" if "mx.fast" in r else "-")
        cells.append(f"{r['torch']['ms'] / f['ms']:.2f}x" if "torch" in r else "-")
        cells.append(f"{f['extra_peak_mib']:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def long_context_memory(heads, t, d):
    """Extra peak memory of the fused kernel at a long context, next to the
    score matrix an unfused implementation has to hold (B*H*T*T float32)."""
    rng = np.random.default_rng(0)
    q, k, v = (mx.array(rng.standard_normal((1, heads, t, d)).astype(np.float32)) for _ in range(3))
    mx.eval(q, k, v)
    fn = mlx_runner("fused", q, k, v, True)
    extra = extra_peak_memory(fn)
    output = heads * t * d * 4
    return {
        "T": t,
        "heads": heads,
        "fused_extra_peak_mib": extra / 2**20,
        "fused_extra_beyond_output_mib": (extra - output) / 2**20,
        "unfused_scores_mib": heads * t * t * 4 / 2**20,
    }


def plot(rows, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    combos = sorted({(r["D"], r["dtype"], r["causal"]) for r in rows})
    cols = 4
    fig, axes = plt.subplots(
        (len(combos) + cols - 1) // cols, cols, figsize=(4.2 * cols, 3.4 * ((len(combos) + cols - 1) // cols)),
        squeeze=False,
    )
    for ax, (d, dtype, causal) in zip(axes.flat, combos):
        sel = [r for r in rows if (r["D"], r["dtype"], r["causal"]) == (d, dtype, causal)]
        for impl, style in zip(IMPLS, ["o-", "s--", "^:", "d-."]):
            pts = [(r["T"], r[impl]["gflops"]) for r in sel if impl in r]
            if pts:
                ax.plot(*zip(*pts), style, label=impl)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"D={d} {dtype} {'causal' if causal else 'full'}", fontsize=10)
        ax.set_xlabel("sequence length T")
        ax.set_ylabel("GFLOP/s")
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(combos):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"Attention on the CPU (B=1, H={rows[0].get('H', 8)}, {threads_used()} threads, kernel {_ext.cpu_isa()})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--dtypes", nargs="+", default=["float32", "float16"], choices=list(DTYPES))
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-baseline-len", type=int, default=4096)
    p.add_argument("--long-context", type=int, default=16384, help="T of the memory check (0: skip)")
    p.add_argument("--quick", action="store_true", help="tiny grid, for a smoke test")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args(argv)
    if args.quick:
        args.lengths, args.head_dims, args.dtypes = [128, 256], [64], ["float32"]
        args.repeats, args.long_context = 1, 1024

    args.out.mkdir(parents=True, exist_ok=True)
    print(
        f"mlx {mx.__version__}, mlx_attn kernel {_ext.cpu_isa()}, {threads_used()} threads, "
        f"torch {torch.__version__ if torch else 'not installed'}"
    )
    print(header())
    rows = benchmark(args)
    for r in rows:
        r["H"] = args.heads
    result = {"rows": rows, "isa": _ext.cpu_isa(), "threads": threads_used(), "mlx": mx.__version__}
    if args.long_context:
        mem = long_context_memory(args.heads, args.long_context, 64)
        result["long_context_memory"] = mem
        print(
            f"\nT={mem['T']}, H={mem['heads']}, D=64 causal fp32: fused extra peak {mem['fused_extra_peak_mib']:.1f} MiB "
            f"({mem['fused_extra_beyond_output_mib']:.2f} MiB beyond the output); an unfused score matrix "
            f"alone is {mem['unfused_scores_mib']:.0f} MiB"
        )
    (args.out / "bench_sdpa_cpu.json").write_text(json.dumps(result, indent=1))
    (args.out / "bench_sdpa_cpu.md").write_text(summary_table(rows) + "\n")
    plot(rows, args.out / "bench_sdpa_cpu.png")
    print(f"\nsaved {args.out / 'bench_sdpa_cpu.json'}, .md and .png")
    return result


if __name__ == "__main__":
    main()
