"""Cascade (shared-prefix) paged attention on the CPU against today's paged
op, one run side by side.

A decode step of ``S`` sequences sharing a ``P``-token prefix (a system
prompt), each with its own suffix of ``own`` tokens (the decode row's own
token last): one query row per sequence, GQA 4 (8 query heads over 2 K/V
heads), pages of 16 keys scattered in the pool. Methods:

- ``paged``: :func:`mlx_attn.paged_attention` over the full block tables
  (prefix pages then own pages): every sequence reads the prefix itself;
- ``cascade``: :func:`mlx_attn.paged.cascade_paged_attention` with the
  prefix as the shared level: the prefix pages read once per group;
- ``layer``: the same through a :class:`mlx_attn.paged.CascadeTables` made
  once (what the serving engine calls for each layer of a step: the tables
  read, checked and planned once per step, not per layer).

``paged`` and ``cascade`` include their host-side checks (the block tables
read on the host).
The two alternate, ``--repeats`` times each after a warm-up; ``speedup``
is paged / cascade of the medians (and of the best times, less exposed to
other jobs on a shared machine). Prints a table, saves JSON and a PNG plot.

    python benchmarks/bench_cascade.py --out docs          # default grid (< 2 min)
    python benchmarks/bench_cascade.py --full --out docs   # 4/16/64 x 1k/4k/16k, suffixes 16..256, 4-bit
    python benchmarks/bench_cascade.py --rule --out /tmp    # 2..16 sequences x 256..4k: the engine's rule
    python benchmarks/bench_cascade.py --metal               # Metal: MODELLED device bytes, no timing

``--metal`` prints the Metal kernels' modelled device bytes of one decode
step (kernel_lab/cascade_bytes.py: counted from the C++ plans the way the
kernels read and write, held to the MSL emulator's counting build by
tests/test_paged_cascade_metal.py), cascade against today's paged decode:
modelled, not measured (no Mac here).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_attn import _native
from mlx_attn.paged import (CascadeTables, cascade_paged_attention, cascade_paged_attention_path, paged_attention,
                            quantized_cascade_paged_attention, quantized_paged_attention)

KV_HEADS = 2
GQA = 4
PAGE_SIZE = 16
QUANT_GROUP = 64


def make_batch(sequences, prefix, own, head_dim, dtype, seed):
    """q, pages scattered in a pool, the two-level tables and the full tables."""
    rng = np.random.default_rng(seed)
    prefix_pages, own_pages = -(-prefix // PAGE_SIZE), -(-own // PAGE_SIZE)
    num_pages = prefix_pages + sequences * own_pages
    pool = rng.permutation(num_pages)
    shared = pool[:prefix_pages]
    own_table = pool[prefix_pages:].reshape(sequences, own_pages).astype(np.int32)
    full_table = np.concatenate([np.broadcast_to(shared, (sequences, prefix_pages)), own_table], axis=1)
    as_dtype = lambda a: mx.array(a.astype(np.float32)).astype(dtype)  # noqa: E731
    ints = lambda a: mx.array(np.ascontiguousarray(a, np.int32))  # noqa: E731
    return {
        "q": as_dtype(rng.standard_normal((sequences, KV_HEADS * GQA, head_dim))),
        "k": as_dtype(rng.standard_normal((num_pages, KV_HEADS, PAGE_SIZE, head_dim))),
        "v": as_dtype(rng.standard_normal((num_pages, KV_HEADS, PAGE_SIZE, head_dim))),
        "prefix_table": ints(shared[None]), "prefix_lens": ints([prefix]),
        "prefix_groups": ints(np.zeros(sequences)), "block_table": ints(own_table),
        "full_table": ints(full_table), "kv_lens": ints(np.full(sequences, prefix + own)),
    }


def calls_of(batch, scale, bits):
    b = batch
    tables = CascadeTables(b["prefix_table"], b["prefix_lens"], b["prefix_groups"], b["block_table"], b["kv_lens"])
    if bits:
        k, v = (mx.quantize(b[n], group_size=QUANT_GROUP, bits=bits) for n in ("k", "v"))
        mx.eval(k, v)
        quant = dict(group_size=QUANT_GROUP, bits=bits)
        paged = lambda: quantized_paged_attention(b["q"], k, v, b["full_table"], b["kv_lens"], scale=scale,  # noqa
                                                  **quant)
        cascade = lambda: quantized_cascade_paged_attention(  # noqa: E731
            b["q"], k, v, b["prefix_table"], b["prefix_lens"], b["prefix_groups"], b["block_table"], b["kv_lens"],
            scale=scale, **quant)
        layer = lambda: tables.quantized_attention(b["q"], k, v, scale=scale, **quant)  # noqa: E731
        path = cascade_paged_attention_path(b["q"], k, v, b["prefix_table"], b["prefix_lens"], b["prefix_groups"],
                                            b["block_table"], b["kv_lens"], **quant)
    else:
        paged = lambda: paged_attention(b["q"], b["k"], b["v"], b["full_table"], b["kv_lens"], scale=scale)  # noqa
        cascade = lambda: cascade_paged_attention(  # noqa: E731
            b["q"], b["k"], b["v"], b["prefix_table"], b["prefix_lens"], b["prefix_groups"], b["block_table"],
            b["kv_lens"], scale=scale)
        layer = lambda: tables.attention(b["q"], b["k"], b["v"], scale=scale)  # noqa: E731
        path = cascade_paged_attention_path(b["q"], b["k"], b["v"], b["prefix_table"], b["prefix_lens"],
                                            b["prefix_groups"], b["block_table"], b["kv_lens"])
    layer()  # the tables read, checked and planned: once per serving step
    return {"paged": paged, "cascade": cascade, "layer": layer}, path


def timed_side_by_side(calls, repeats):
    """Median and best seconds of each call and its result: one warm-up run
    each, then the calls alternate (fewer times for slow calls), so a burst
    of load on a shared machine hits both."""
    start = time.perf_counter()
    results = {name: fn() for name, fn in calls.items()}
    mx.eval(*results.values())
    warm_up = time.perf_counter() - start
    repeats = max(3, min(repeats, int(5.0 / max(warm_up, 1e-6))))  # about 5 s a row at most
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            start = time.perf_counter()
            mx.eval(fn())
            times[name].append(time.perf_counter() - start)
    return {name: (statistics.median(t), min(t)) for name, t in times.items()}, results


def measure(sequences, prefix, own, head_dim, pages, repeats, seed):
    dtype = mx.float16
    bits = 4 if pages == "4-bit" else 0
    batch = make_batch(sequences, prefix, own, head_dim, dtype, seed)
    mx.eval(*batch.values())
    calls, path = calls_of(batch, head_dim**-0.5, bits)
    row = {"sequences": sequences, "prefix": prefix, "own": own, "D": head_dim, "pages": pages, "path": path}
    timings, results = timed_side_by_side(calls, repeats)
    for name, (median, best) in timings.items():
        row[f"{name}_ms"], row[f"{name}_best_ms"] = 1e3 * median, 1e3 * best
    row["speedup"] = row["paged_ms"] / row["cascade_ms"]
    row["speedup_best"] = row["paged_best_ms"] / row["cascade_best_ms"]
    row["layer_speedup"] = row["paged_ms"] / row["layer_ms"]
    row["layer_speedup_best"] = row["paged_best_ms"] / row["layer_best_ms"]
    row["max_abs_diff"] = float(mx.abs(results["paged"].astype(mx.float32)
                                       - results["cascade"].astype(mx.float32)).max())
    return row


def cpu_model() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def summary_table(rows) -> str:
    head = ("| sequences | prefix | own | D | pages | paged ms | cascade ms | speedup (medians) "
            "| speedup (best times) | layer ms (tables once) | layer speedup | max abs diff |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(f"| {r['sequences']} | {r['prefix']} | {r['own']} | {r['D']} | {r['pages']} "
                     f"| {r['paged_ms']:.2f} | {r['cascade_ms']:.2f} | {r['speedup']:.2f}x | {r['speedup_best']:.2f}x "
                     f"| {r['layer_ms']:.2f} | {r['layer_speedup']:.2f}x | {r['max_abs_diff']:.1e} |")
    return "\n".join(lines)


def plot(rows, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['sequences']}x{r['prefix'] // 1024}k+{r['own']}\nD{r['D']} {r['pages']}" for r in rows]
    x = np.arange(len(rows))
    width = 0.38
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(rows)), 4.8))
    ax.bar(x - width / 2, [r["paged_ms"] for r in rows], width, label="paged (full tables)")
    ax.bar(x + width / 2, [r["cascade_ms"] for r in rows], width, label="cascade (shared prefix)")
    for xi, r in zip(x, rows):
        ax.annotate(f"{r['speedup']:.1f}x", (xi + width / 2, r["cascade_ms"]), textcoords="offset points",
                    xytext=(0, 3), ha="center", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("ms per decode step (log)")
    ax.set_xticks(x)
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_title("Cascade vs paged attention on the CPU (fp16, GQA 4, pages of 16)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


METAL_GRID = [(s, p, 64, d) for d in (64, 128) for s, p in ((4, 1024), (16, 4096), (64, 16384))]


def metal_table(rows) -> str:
    head = ("| sequences | prefix | own | D | paged MiB (modelled) | cascade MiB (modelled) "
            "| cascade / paged (modelled) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(f"| {r['sequences']} | {r['prefix']} | {r['own']} | {r['D']} | {r['paged MiB']:.2f} "
                     f"| {r['cascade MiB']:.2f} | {r['cascade / paged']:.3f}x |")
    return "\n".join(lines)


def metal_rows(cases=METAL_GRID) -> list[dict]:
    """The Metal rows: modelled device bytes of one decode step (fp16, GQA 4,
    pages of 16), cascade plan against the paged plan over the full tables."""
    from kernel_lab.cascade_bytes import cascade_vs_paged

    rows = []
    for sequences, prefix, own, d in cases:
        row = cascade_vs_paged(sequences=sequences, prefix=prefix, own=own, d=d, kv_heads=KV_HEADS, gqa=GQA,
                               page_size=PAGE_SIZE)
        rows.append({k: v for k, v in row.items() if k != "cascade parts"})
    return rows


def grid(full: bool, rule: bool = False):
    if rule:  # where the cascade starts to pay: the engine's rule (serve/cascade_groups.py)
        return [(s, p, 64, 64, "fp16") for s in (2, 4, 8, 16) for p in (256, 1024, 4096)]
    if not full:
        return [(s, p, 64, d, "fp16") for d in (64, 128) for s in (4, 16) for p in (1024, 4096)]
    rows = [(s, p, 64, d, pages) for pages in ("fp16", "4-bit") for d in (64, 128) for s in (4, 16, 64)
            for p in (1024, 4096, 16384)]
    return rows + [(16, 4096, own, d, "fp16") for d in (64, 128) for own in (16, 256)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "docs")
    p.add_argument("--repeats", type=int, default=61)
    p.add_argument("--full", action="store_true", help="the whole grid (many minutes)")
    p.add_argument("--quick", action="store_true", help="two tiny rows, for a smoke test")
    p.add_argument("--rule", action="store_true", help="2..16 sequences x 256..4k prefixes (the engine's rule)")
    p.add_argument("--case", action="append", default=[], metavar="S,P,OWN,D,PAGES",
                   help="only this row (repeatable), e.g. 64,4096,64,64,4-bit")
    p.add_argument("--metal", action="store_true",
                   help="the Metal kernels' MODELLED device bytes, cascade vs paged decode (no timing)")
    args = p.parse_args(argv)
    if _native.ext is None:
        raise SystemExit("bench_cascade needs the native extension mlx_attn._ext")
    if args.metal:
        rows = metal_rows()
        print("Metal, one decode step, device bytes MODELLED from the launch plans (not measured: no Mac):")
        print(metal_table(rows))
        return {"command": "python benchmarks/bench_cascade.py --metal", "modelled": True, "rows": rows}
    mx.set_default_device(mx.cpu)
    cases = [(4, 64, 16, 64, "fp16"), (4, 64, 16, 64, "4-bit")] if args.quick else grid(args.full, args.rule)
    if args.case:
        cases = [tuple(int(x) for x in c.split(",")[:4]) + (c.split(",")[4],) for c in args.case]
    repeats = 2 if args.quick else args.repeats
    rows = []
    for i, (sequences, prefix, own, d, pages) in enumerate(cases):
        row = measure(sequences, prefix, own, d, pages, repeats, seed=200 + i)
        rows.append(row)
        print(f"{sequences:3d} seqs x {prefix:5d} prefix + {own:3d} own, D={d:3d} {pages:5s}: paged "
              f"{row['paged_ms']:8.2f} ms, cascade {row['cascade_ms']:8.2f} ms ({row['speedup']:.2f}x), layer "
              f"{row['layer_ms']:8.2f} ms ({row['layer_speedup']:.2f}x)", flush=True)
    table = summary_table(rows)
    print()
    print(table)
    command = "python benchmarks/bench_cascade.py" + (" --full" if args.full else "") + (
        " --rule" if args.rule else "") + (
        " --quick" if args.quick else "") + "".join(f" --case {c}" for c in args.case)
    result = {"command": command, "cpu": cpu_model(), "cpu_isa": _native.ext.cpu_isa(), "kv_heads": KV_HEADS,
              "gqa": GQA, "page_size": PAGE_SIZE, "repeats": repeats, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_cascade.json").write_text(json.dumps(result, indent=1))
    plot(rows, args.out / "bench_cascade.png")
    print(f"\nsaved {args.out / 'bench_cascade.json'} and .png")
    return result


if __name__ == "__main__":
    main()
