"""Paged, ragged attention on the CPU: the fused paged kernel against padding
and gathering, all measured in one run.

Batches (GQA 4: 8 query heads over 2 key/value heads, pages of 16 keys,
scattered in the pool):

- ``decode 16`` / ``decode 64``: 16 or 64 sequences, one query row each,
  key lengths log-uniform between 64 and 8192;
- ``mixed``: 16 decode rows (lengths as above) plus one 512-row chunked
  prefill of a sequence with 1024 keys before the chunk.

float16 and float32, head dim 64 and 128. Methods:

- ``fused paged``: :func:`mlx_attn.paged_attention` (path ``fused-cpu``),
  reading the pages through the block table;
- ``(a) padded``: K/V stored as a padded rectangle ``[B, Hkv, T_max, D]``
  (what a padded batched cache holds), queries padded to ``[B, Hq, Tq_max, D]``,
  lengths and causality as a boolean mask, :func:`mlx_attn.scaled_dot_product_attention`
  (fused CPU kernel);
- ``(b) gather``: the pages gathered into that padded rectangle
  (``k_pages[block_table]``), then (a)'s call;
- ``(c) per-seq mx.fast``: per sequence, its pages gathered into contiguous
  K/V and ``mx.fast.scaled_dot_product_attention`` (causal where it has
  more than one row).

Times are medians of ``--repeats`` runs; ``speedup`` is the best of (a), (b),
(c) over the fused paged time. ``extra MiB`` is the peak memory a call adds
on top of its inputs (MLX's allocator statistics): the padded rectangle of (a)
is its storage, reported beside it as ``padded storage``. Prints a table,
saves JSON and a PNG plot.

    python benchmarks/bench_paged.py --out docs     # the full grid (minutes)
    python benchmarks/bench_paged.py --quick        # a small smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

import mlx_attn
from mlx_attn import _native
from mlx_attn.paged import paged_attention, paged_attention_path

KV_HEADS = 2
GQA = 4
PAGE_SIZE = 16
METHODS = ("fused paged", "(a) padded", "(b) gather", "(c) per-seq mx.fast")
BASELINES = METHODS[1:]


def log_uniform_lengths(rng, count, low, high):
    return [int(round(math.exp(x))) for x in rng.uniform(math.log(low), math.log(high), count)]


def batch_shapes(case: str, rng, quick: bool) -> list[tuple[int, int]]:
    """``[(q_len, kv_len), ...]`` of a case."""
    low, high = (16, 256) if quick else (64, 8192)
    if case.startswith("decode"):
        count = int(case.split()[1])
        return [(1, n) for n in log_uniform_lengths(rng, count, low, high)]
    decode = [(1, n) for n in log_uniform_lengths(rng, 4 if quick else 16, low, high)]
    chunk, before = (32, 64) if quick else (512, 1024)
    return decode + [(chunk, before + chunk)]


def make_batch(seqs, head_dim, dtype, seed):
    """Packed q, pages scattered in a pool, the block table and lengths."""
    rng = np.random.default_rng(seed)
    needed = [-(-kv // PAGE_SIZE) for _, kv in seqs]
    num_pages = sum(needed)
    order = rng.permutation(num_pages)
    table = np.zeros((len(seqs), max(needed)), np.int32)
    at = 0
    for b, n in enumerate(needed):
        table[b, :n] = order[at : at + n]
        at += n
    heads = KV_HEADS * GQA
    total_q = sum(q for q, _ in seqs)
    k = mx.random.normal((num_pages, KV_HEADS, PAGE_SIZE, head_dim), key=mx.random.key(seed)).astype(dtype)
    v = mx.random.normal((num_pages, KV_HEADS, PAGE_SIZE, head_dim), key=mx.random.key(seed + 1)).astype(dtype)
    q = mx.random.normal((total_q, heads, head_dim), key=mx.random.key(seed + 2)).astype(dtype)
    return dict(q=q, k=k, v=v, table=mx.array(table), np_table=table, seqs=seqs,
                kv_lens=mx.array([kv for _, kv in seqs], dtype=mx.int32),
                q_lens=mx.array([ql for ql, _ in seqs], dtype=mx.int32))


def padded_queries_and_mask(batch):
    """q as ``[B, Hq, Tq_max, D]`` (sequence b's rows first) and the boolean
    mask ``[B, 1, Tq_max, T_max]``: row i of b sees keys j < kv_len with
    j <= kv_len - q_len + i (rows past q_len see their sequence's keys too,
    so no row is empty; their outputs are dropped)."""
    seqs, q = batch["seqs"], batch["q"]
    tq = max(ql for ql, _ in seqs)
    t_max = batch["np_table"].shape[1] * PAGE_SIZE
    rows = np.zeros((len(seqs), tq), np.int32)
    mask = np.zeros((len(seqs), 1, tq, t_max), bool)
    start = 0
    for b, (ql, kv) in enumerate(seqs):
        rows[b, :ql] = np.arange(start, start + ql)
        rows[b, ql:] = start + ql - 1
        position = np.minimum(kv - ql + np.arange(tq), kv - 1)
        mask[b, 0] = np.arange(t_max)[None, :] <= position[:, None]
        start += ql
    q_pad = q[mx.array(rows.reshape(-1))].reshape(len(seqs), tq, *q.shape[1:]).swapaxes(1, 2)
    return q_pad, mx.array(mask), rows


def gather_rectangle(pages, table):
    """``pages[table]`` as ``[B, Hkv, max_pages * P, D]``."""
    taken = pages[table]  # [B, max_pages, Hkv, P, D]
    b, n, h, p, d = taken.shape
    return taken.transpose(0, 2, 1, 3, 4).reshape(b, h, n * p, d)


def calls_of(batch, scale):
    q, k, v, table = batch["q"], batch["k"], batch["v"], batch["table"]
    seqs = batch["seqs"]
    q_pad, mask, rows = padded_queries_and_mask(batch)
    k_rect, v_rect = gather_rectangle(k, table), gather_rectangle(v, table)
    mx.eval(q_pad, mask, k_rect, v_rect)

    def unpad(out):  # [B, Hq, Tq_max, Dv] -> packed rows
        return mx.concatenate([out[b, :, :ql].swapaxes(0, 1) for b, (ql, _) in enumerate(seqs) if ql])

    def fused():
        return paged_attention(q, k, v, table, batch["kv_lens"], q_lens=batch["q_lens"], scale=scale,
                               backend="fused")

    def padded():
        return mlx_attn.scaled_dot_product_attention(q_pad, k_rect, v_rect, scale=scale, mask=mask)

    def gather():
        return mlx_attn.scaled_dot_product_attention(q_pad, gather_rectangle(k, table), gather_rectangle(v, table),
                                                     scale=scale, mask=mask)

    np_table = batch["np_table"]

    def per_sequence():
        outs, start = [], 0
        for b, (ql, kv) in enumerate(seqs):
            ids = mx.array(np_table[b, : -(-kv // PAGE_SIZE)])
            kb = k[ids].swapaxes(0, 1).reshape(KV_HEADS, -1, k.shape[3])[None, :, :kv]
            vb = v[ids].swapaxes(0, 1).reshape(KV_HEADS, -1, v.shape[3])[None, :, :kv]
            qb = q[start : start + ql].swapaxes(0, 1)[None]
            out = mx.fast.scaled_dot_product_attention(qb, kb, vb, scale=scale, mask="causal" if ql > 1 else None)
            outs.append(out[0].swapaxes(0, 1))
            start += ql
        return mx.concatenate(outs)

    calls = {"fused paged": fused, "(a) padded": padded, "(b) gather": gather, "(c) per-seq mx.fast": per_sequence}
    same = lambda out: out  # noqa: E731
    unpadders = {"fused paged": same, "(a) padded": unpad, "(b) gather": unpad, "(c) per-seq mx.fast": same}
    storage = {"padded storage": (k_rect.nbytes + v_rect.nbytes) / 2**20}
    return calls, unpadders, storage


def timed(fn, repeats):
    """(median seconds, extra MiB, the result): one untimed warm-up run (its
    result is returned for the accuracy check), then ``repeats`` timed runs,
    the first of which also records the peak memory the call adds over what
    is live before it. A call slower than 2 s is timed once."""
    result = fn()
    mx.eval(result)
    start = time.perf_counter()
    mx.synchronize()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(fn())
    times = [time.perf_counter() - start]
    extra = max(0, mx.get_peak_memory() - before) / 2**20
    for _ in range(repeats - 1 if times[0] < 2.0 else 0):
        start = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times), extra, result


def measure(case, dtype, head_dim, repeats, quick, seed):
    rng = np.random.default_rng(seed)
    seqs = batch_shapes(case, rng, quick)
    batch = make_batch(seqs, head_dim, dtype, seed)
    mx.eval(batch["q"], batch["k"], batch["v"])
    scale = head_dim**-0.5
    calls, unpad, storage = calls_of(batch, scale)
    path = paged_attention_path(batch["q"], batch["k"], batch["v"], batch["table"], batch["kv_lens"],
                                q_lens=batch["q_lens"])
    row = {"case": case, "dtype": str(dtype).split(".")[-1], "D": head_dim, "sequences": len(seqs),
           "query_rows": sum(q for q, _ in seqs), "live_keys": sum(kv for _, kv in seqs),
           "kv_live_mib": 2 * sum(kv for _, kv in seqs) * KV_HEADS * head_dim * batch["k"].itemsize / 2**20,
           "path": path, **storage}
    results = {}
    for m in METHODS:
        seconds, extra, results[m] = timed(calls[m], repeats)
        row[m] = {"ms": 1e3 * seconds, "extra_mib": extra}
    reference = unpad["(c) per-seq mx.fast"](results["(c) per-seq mx.fast"]).astype(mx.float32)
    for m in METHODS:  # every method computes the same rows (up to rounding)
        row[m]["max_abs_diff_vs_c"] = float(mx.abs(unpad[m](results[m]).astype(mx.float32) - reference).max())
    best = min(BASELINES, key=lambda m: row[m]["ms"])
    row["best_baseline"] = best
    row["speedup"] = row[best]["ms"] / row["fused paged"]["ms"]
    return row


# ---------------------------------------------------------------- Metal rows
# Hook for the Metal paged kernels (filled in by the Metal work): rows of the
# same shape as measure()'s, from the MSL emulator's counters next to MLX's
# kernels on the padded problem. The CPU run leaves it empty.
def metal_rows(quick: bool = False, metal: bool = False) -> list[dict]:
    """With ``metal``, the Metal rows (kernel_lab/paged_metal_rows.py: modelled
    device bytes per live K/V byte of the paged kernels in the MSL emulator's
    counting builds, against our dense kernels on the same keys and MLX's on
    the padded problem: the ragged decode batch, and the mixed batch, whose
    decode rows take the paged decode kernel and whose 512-row chunk the paged
    prefill kernel, in one call; needs clang-19 and the mlx-metal wheel,
    minutes per row); none without."""
    if not metal:
        return []
    from kernel_lab import paged_metal_rows

    rows = paged_metal_rows.metal_rows(quick)
    print()
    print("Metal, device bytes per live K/V byte (modelled, MSL emulator counting builds):")
    print(paged_metal_rows.metal_table(rows))
    return rows


def summary_table(rows) -> str:
    head = ("| batch | dtype | D | live KV MiB | fused paged ms | (a) padded ms | (b) gather ms | (c) per-seq ms "
            "| speedup vs best | fused extra MiB | (b) extra MiB | padded storage MiB |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['dtype']} | {r['D']} | {r['kv_live_mib']:.1f} | {r['fused paged']['ms']:.2f} "
            f"| {r['(a) padded']['ms']:.2f} | {r['(b) gather']['ms']:.2f} | {r['(c) per-seq mx.fast']['ms']:.2f} "
            f"| {r['speedup']:.2f}x ({r['best_baseline'].split()[0]}) | {r['fused paged']['extra_mib']:.2f} "
            f"| {r['(b) gather']['extra_mib']:.1f} | {r['padded storage']:.1f} |")
    return "\n".join(lines)


def plot(rows, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['case']}\n{r['dtype']} D{r['D']}" for r in rows]
    x = np.arange(len(rows))
    width = 0.2
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(rows)), 4.8))
    for i, m in enumerate(METHODS):
        ax.bar(x + (i - 1.5) * width, [r[m]["ms"] for r in rows], width, label=m)
    ax.set_yscale("log")
    ax.set_ylabel("ms per call (log)")
    ax.set_xticks(x)
    ax.set_xticklabels(labels, fontsize=7)
    for xi, r in zip(x, rows):
        ax.annotate(f"{r['speedup']:.1f}x", (xi - 1.5 * width, r["fused paged"]["ms"]), textcoords="offset points",
                    xytext=(0, 3), ha="center", fontsize=7)
    ax.set_title("Paged attention on the CPU (GQA 4, pages of 16): fused paged vs padding / gathering")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "docs")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    p.add_argument("--metal", action="store_true", help="also the Metal rows (MSL emulator; slow)")
    args = p.parse_args(argv)
    if _native.ext is None:
        raise SystemExit("bench_paged needs the native extension mlx_attn._ext")
    mx.set_default_device(mx.cpu)
    cases = ["decode 16", "decode 64", "mixed"]
    grid = [(c, mx.float32, 64) for c in cases] if args.quick else [
        (c, dtype, d) for c in cases for dtype in (mx.float16, mx.float32) for d in (64, 128)]
    repeats = 2 if args.quick else args.repeats
    rows = []
    for i, (case, dtype, d) in enumerate(grid):
        row = measure(case, dtype, d, repeats, args.quick, seed=100 + cases.index(case))
        rows.append(row)
        print(f"{case:10s} {row['dtype']:8s} D={d:3d}: fused {row['fused paged']['ms']:.2f} ms, "
              f"best baseline {row['best_baseline']} {row[row['best_baseline']]['ms']:.2f} ms "
              f"({row['speedup']:.2f}x)", flush=True)
    table = summary_table(rows)
    print()
    print(table)
    metal = metal_rows(args.quick, args.metal)
    result = {"command": "python benchmarks/bench_paged.py" + (" --quick" if args.quick else "")
              + (" --metal" if args.metal else ""),
              "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
              "cpu_isa": _native.ext.cpu_isa(), "kv_heads": KV_HEADS, "gqa": GQA, "page_size": PAGE_SIZE,
              "repeats": repeats, "rows": rows, "metal_rows": metal}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_paged.json").write_text(json.dumps(result, indent=1))
    plot(rows, args.out / "bench_paged.png")
    print(f"\nsaved {args.out / 'bench_paged.json'} and .png")
    return result


if __name__ == "__main__":
    main()
