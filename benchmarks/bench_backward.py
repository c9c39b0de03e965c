"""CPU benchmark of attention training steps: forward + backward (gradients
of q, k, v) through mlx_attn's fused kernels, through the reference path's
MLX autodiff, and through PyTorch's CPU scaled_dot_product_attention (when
importable, same thread count).

Prints a table (median time, extra peak memory, fused speed-up over each
baseline measured in the same run), saves it as JSON (with the CPU model and
the load average) and a PNG plot.

    python benchmarks/bench_backward.py                 # T = 512..8192
    python benchmarks/bench_backward.py --quick         # a small smoke run
    python benchmarks/bench_backward.py --lengths 4096 --dims 64 128   # one length

Columns: fused ms / ref ms / torch ms are the median forward + backward time;
peak MiB is the fused step's peak memory beyond its inputs, and work MiB the
part of it beyond the gradients and the forward output every implementation
holds (dq, dk, dv, out): delta, lse, cotangents and the kernels' scratch;
vs ref / vs torch are baseline time / fused time (> 1: fused is faster).

The reference path needs O(T^2) memory: it only runs up to
--max-reference-len. Timings on a shared machine are noisy; compare ratios
within one run.
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

from kernel_lab.host import cpu_description

try:
    import torch
except ImportError:  # optional, for comparison only
    torch = None

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def threads_used() -> int:
    env = os.environ.get("MLX_ATTN_NUM_THREADS")
    return int(env) if env else os.cpu_count() or 1


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved_medians(fns, repeats: int) -> list[float]:
    """Median seconds of each function over `repeats` rounds that call them in
    turn (after one warm-up round), so changing load hits all alike."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def mlx_step(backend, q, k, v, causal):
    mask = "causal" if causal else None

    def loss(q, k, v):
        out = mlx_attn.scaled_dot_product_attention(q, k, v, scale=q.shape[-1] ** -0.5, mask=mask, backend=backend)
        return out.astype(mx.float32).sum()

    grad = mx.grad(loss, argnums=(0, 1, 2))
    return lambda: mx.eval(grad(q, k, v))


def extra_peak_mib(fn) -> float:
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    fn()
    return (mx.get_peak_memory() - base) / 2**20


def torch_step(q, k, v, causal, dtype):
    tdtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    tq, tk, tv = (torch.tensor(np.array(a.astype(mx.float32)), dtype=tdtype, requires_grad=True) for a in (q, k, v))
    group = tq.shape[1] // tk.shape[1]

    def run():
        out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal, enable_gqa=group > 1)
        out.float().sum().backward()
        for t in (tq, tk, tv):
            t.grad = None

    return run


def run_grid(lengths, dims, dtypes, causals, heads, repeats, max_reference_len):
    rows = []
    if torch is not None:
        torch.set_num_threads(threads_used())
    rng = np.random.default_rng(0)
    for dtype in dtypes:
        for d in dims:
            for causal in causals:
                for t in lengths:
                    shape = (1, heads, t, d)
                    q, k, v = (mx.array(rng.standard_normal(shape).astype(np.float32)).astype(DTYPES[dtype]) for _ in range(3))
                    mx.eval(q, k, v)
                    row = dict(T=t, D=d, dtype=dtype, causal=causal, heads=heads)
                    fused = mlx_step("fused", q, k, v, causal)
                    if torch is not None:  # fused and torch interleaved
                        row["fused_s"], row["torch_s"] = interleaved_medians(
                            [fused, torch_step(q, k, v, causal, dtype)], repeats)
                    else:
                        row["fused_s"] = median_seconds(fused, repeats)
                    row["fused_peak_mib"] = extra_peak_mib(fused)
                    held = 4 * q.nbytes / 2**20  # dq, dk, dv and out, each the size of q here
                    row["fused_work_mib"] = row["fused_peak_mib"] - held
                    if t <= max_reference_len:
                        reference = mlx_step("reference", q, k, v, causal)
                        row["reference_s"] = median_seconds(reference, repeats)
                        row["reference_peak_mib"] = extra_peak_mib(reference)
                    rows.append(row)
                    print(format_row(row), flush=True)
    return rows


def format_row(row) -> str:
    def ratio(key):
        return f"{row[key] / row['fused_s']:.2f}x" if key in row else "-"

    ref = f"{row['reference_s'] * 1e3:9.1f}" if "reference_s" in row else "        -"
    torch_ms = f"{row['torch_s'] * 1e3:9.1f}" if "torch_s" in row else "        -"
    return (
        f"| {row['T']:5d} | {row['D']:3d} | {row['dtype']:7s} | {str(row['causal']):5s} | "
        f"{row['fused_s'] * 1e3:9.1f} | {row['fused_peak_mib']:8.1f} | {row['fused_work_mib']:8.1f} | {ref} | {torch_ms} | "
        f"{ratio('reference_s'):>8s} | {ratio('torch_s'):>8s} |"
    )


HEADER = (
    "|     T |   D | dtype   | causal | fused ms | peak MiB | work MiB |   ref ms | torch ms | vs ref | vs torch |\n"
    "|------:|----:|---------|--------|---------:|---------:|---------:|---------:|---------:|-------:|---------:|"
)


def plot(rows, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    groups = sorted({(r["D"], r["dtype"], r["causal"]) for r in rows})
    for i, key in enumerate(groups):
        sel = [r for r in rows if (r["D"], r["dtype"], r["causal"]) == key]
        label = f"D={key[0]} {key[1]}{' causal' if key[2] else ''}"
        ax.plot([r["T"] for r in sel], [r["fused_s"] * 1e3 for r in sel], "o-", color=f"C{i}", label=f"fused {label}")
        torch_rows = [r for r in sel if "torch_s" in r]
        if torch_rows:
            ax.plot([r["T"] for r in torch_rows], [r["torch_s"] * 1e3 for r in torch_rows], "x--", color=f"C{i}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length T")
    ax.set_ylabel("forward + backward (ms); dashed: PyTorch")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="T=256/512, D=64, float32 only")
    parser.add_argument("--lengths", type=int, nargs="+", help="sequence lengths (default 512..8192)")
    parser.add_argument("--dims", type=int, nargs="+", choices=[64, 128], help="head dims (default 64 128)")
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), help="default float32 float16")
    parser.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-reference-len", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args(argv)
    if args.heads < 1 or args.repeats < 1:
        parser.error("--heads and --repeats must be >= 1")
    if args.lengths and min(args.lengths) < 1:
        parser.error("--lengths must be >= 1")
    mx.set_default_device(mx.cpu)
    if args.quick:
        grid = dict(lengths=[256, 512], dims=[64], dtypes=["float32"], causals=[False, True])
    else:
        grid = dict(
            lengths=args.lengths or [512, 1024, 2048, 4096, 8192],
            dims=args.dims or [64, 128],
            dtypes=args.dtypes or ["float32", "float16"],
            causals={"both": [False, True], "yes": [True], "no": [False]}[args.causal],
        )
    cpu = cpu_description()["model"]
    load = os.getloadavg()[0]
    print(f"CPU: {cpu}, forward kernel {_ext.cpu_isa()}, threads: {threads_used()}, heads: {args.heads}, "
          f"load average {load:.1f}, "
          f"PyTorch: {torch.__version__ if torch else 'not installed'}")
    print(HEADER)
    rows = run_grid(**grid, heads=args.heads, repeats=args.repeats, max_reference_len=args.max_reference_len)
    load_end = os.getloadavg()[0]
    print(f"load average at the end: {load_end:.1f}")
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"threads": threads_used(), "cpu": cpu, "isa": _ext.cpu_isa(), "load_average": [load, load_end], "rows": rows}
    (args.out / "bench_backward.json").write_text(json.dumps(record, indent=1))
    plot(rows, args.out / "bench_backward.png")
    return rows


if __name__ == "__main__":
    main()
