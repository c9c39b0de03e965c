"""Ring attention across ranks on this machine: per-rank peak memory, bytes
sent per rank, causal load balance and time, against the single-process
fused ``scaled_dot_product_attention`` on the whole sequence.

    python benchmarks/bench_distributed.py            # T = 8k..64k, 1, 2 and 4 ranks
    python benchmarks/bench_distributed.py --quick    # a small smoke run

Every configuration runs in fresh processes (``mlx.launch --backend ring``
on 127.0.0.1 for several ranks) so each peak is its own. All ranks share this
machine's cores, so times show the cost of the extra work and the messages,
not a speed-up: on n machines each rank has its own cores.

Prints a table and saves ``bench_distributed.json`` and ``bench_distributed.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

import mlx_attn
from mlx_attn import distributed as dist

from kernel_lab.local_ranks import run_ranks, write_result  # the local launch shared with the tests

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny smoke configuration")
    parser.add_argument("--lengths", default="8192,16384,32768,65536", help="comma-separated sequence lengths")
    parser.add_argument("--ranks", default="1,2,4", help="comma-separated rank counts (1 = single-process fused)")
    parser.add_argument("--q-heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--layout", default="zigzag", choices=dist.LAYOUTS)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "docs"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: the folder of the ranks' results
    args = parser.parse_args(argv)
    if args.quick:
        args.lengths, args.ranks = "512,1024", "1,2"
    args.lengths = [int(t) for t in args.lengths.split(",")]
    args.ranks = [int(n) for n in args.ranks.split(",")]
    return args


# ----------------------------------------------------------------- one rank


def measure(args, group):
    """Per length: this rank's peak memory during attention, time and counters."""
    ranks, dtype = group.size(), DTYPES[args.dtype]
    rows = []
    for seq_len in args.lengths:
        local = seq_len // ranks
        kq, kk, kv = mx.random.split(mx.random.key(seq_len + group.rank()), 3)
        q = mx.random.normal((1, args.q_heads, local, args.head_dim), key=kq).astype(dtype)
        k = mx.random.normal((1, args.kv_heads, local, args.head_dim), key=kk).astype(dtype)
        v = mx.random.normal((1, args.kv_heads, local, args.head_dim), key=kv).astype(dtype)
        mx.eval(q, k, v)
        scale = args.head_dim**-0.5
        stats = dist.RingStats()
        if ranks == 1:  # the single-process baseline
            attend = lambda: mlx_attn.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")
        else:
            attend = lambda: dist.ring_attention(
                q, k, v, scale=scale, mask="causal", group=group, layout=args.layout, stats=stats
            )
        mx.eval(attend())  # warm-up (also the counters of one call)
        counters = dataclasses.asdict(stats)
        mx.reset_peak_memory()
        start = time.perf_counter()
        out = attend()
        mx.eval(out)
        seconds = time.perf_counter() - start
        rows.append({
            "seq_len": seq_len,
            "ranks": ranks,
            "rank": group.rank(),
            "peak_bytes": mx.get_peak_memory(),
            "seconds": seconds,
            "bytes_sent": counters["bytes_sent"],
            "visible_pairs": counters["visible_pairs"],
            "shard_kv_bytes": k.nbytes + v.nbytes,
        })
        del q, k, v, out
    return rows


def worker(args):
    group = dist.init(backend="ring") if "MLX_RANK" in os.environ else mx.distributed.init()
    write_result(args.worker, group.rank(), measure(args, group))


# ----------------------------------------------------------------- driver


def run_config(ranks: int, forwarded: list[str]):
    """Every rank's rows of one configuration, from fresh processes."""
    with tempfile.TemporaryDirectory() as results:
        program = [sys.executable, str(Path(__file__).resolve()), *forwarded, "--worker", results]
        per_rank = run_ranks(ranks, program, results, timeout_s=1800)
    return [row for rows in per_rank for row in rows]


def summarize(rows, args):
    """One line per (ranks, length) from the per-rank rows."""
    baseline = {r["seq_len"]: r["peak_bytes"] for r in rows if r["ranks"] == 1}
    table = []
    for ranks in args.ranks:
        for seq_len in args.lengths:
            mine = [r for r in rows if r["ranks"] == ranks and r["seq_len"] == seq_len]
            pairs = [r["visible_pairs"] for r in mine]
            lower_bound = (ranks - 1) * mine[0]["shard_kv_bytes"]
            table.append({
                "ranks": ranks,
                "seq_len": seq_len,
                "peak_mib_per_rank": max(r["peak_bytes"] for r in mine) / 2**20,
                "peak_vs_single": max(r["peak_bytes"] for r in mine) / baseline[seq_len] if seq_len in baseline else None,
                "max_bytes_sent_mib": max(r["bytes_sent"] for r in mine) / 2**20,
                "sent_vs_lower_bound": (max(r["bytes_sent"] for r in mine) / lower_bound) if ranks > 1 else None,
                "work_max_vs_mean": (max(pairs) / (sum(pairs) / ranks)) if ranks > 1 else None,
                "seconds_slowest_rank": max(r["seconds"] for r in mine),
            })
    return table


def format_table(table, args) -> str:
    lines = [
        f"causal ring attention, layout={args.layout}, Hq={args.q_heads}, Hkv={args.kv_heads}, "
        f"D={args.head_dim}, {args.dtype}; ranks=1 is the single-process fused kernel",
        f"(all ranks share this machine's {os.cpu_count()} cores: times are not a multi-machine speed-up)",
        f"{'ranks':>5} {'T':>7} {'peak MiB/rank':>14} {'vs single':>10} {'sent MiB/rank':>14} "
        f"{'vs ring bound':>14} {'work max/mean':>14} {'seconds':>9}",
    ]
    fmt = lambda x, spec: "-" if x is None else format(x, spec)
    for row in table:
        lines.append(
            f"{row['ranks']:>5} {row['seq_len']:>7} {row['peak_mib_per_rank']:>14.1f} "
            f"{fmt(row['peak_vs_single'], '>10.3f')} {row['max_bytes_sent_mib']:>14.1f} "
            f"{fmt(row['sent_vs_lower_bound'], '>14.3f')} {fmt(row['work_max_vs_mean'], '>14.3f')} "
            f"{row['seconds_slowest_rank']:>9.3f}"
        )
    return "\n".join(lines)


def plot(table, args, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ranks in args.ranks:
        rows = [r for r in table if r["ranks"] == ranks]
        lengths = [r["seq_len"] for r in rows]
        label = "1 (single-process fused)" if ranks == 1 else f"{ranks} ranks"
        axes[0].plot(lengths, [r["peak_mib_per_rank"] for r in rows], marker="o", label=label)
        axes[1].plot(lengths, [r["max_bytes_sent_mib"] for r in rows], marker="o", label=label)
        axes[2].plot(lengths, [r["seconds_slowest_rank"] for r in rows], marker="o", label=label)
    titles = ["peak memory per rank (MiB)", "bytes sent per rank (MiB)",
              f"seconds, slowest rank (ranks share {os.cpu_count()} cores)"]
    for axis, title in zip(axes, titles):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("sequence length T")
        axis.set_title(title)
        axis.grid(True, alpha=0.3)
        axis.legend()
    fig.suptitle(f"ring attention (causal, {args.layout}, Hq={args.q_heads}, D={args.head_dim}, {args.dtype})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    for seq_len in args.lengths:
        for ranks in args.ranks:
            if seq_len % (2 * ranks):
                raise ValueError(f"--lengths: {seq_len} is not divisible by 2 x {ranks} ranks")
    if args.worker:
        return worker(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    forwarded = [a for a in argv if a != "--quick"] + (["--lengths", ",".join(map(str, args.lengths)),
                                                         "--ranks", ",".join(map(str, args.ranks))])
    rows = []
    for ranks in args.ranks:
        rows += run_config(ranks, forwarded)
    table = summarize(rows, args)
    print(format_table(table, args))
    config = {k: getattr(args, k) for k in ("q_heads", "kv_heads", "head_dim", "dtype", "layout", "lengths", "ranks")}
    (out / "bench_distributed.json").write_text(json.dumps({"config": config, "table": table, "per_rank": rows}, indent=1))
    plot(table, args, out / "bench_distributed.png")
    return table


if __name__ == "__main__":
    main()
