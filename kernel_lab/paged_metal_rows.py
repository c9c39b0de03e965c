"""The Metal rows of benchmarks/bench_paged.py (--metal): modelled costs of the paged
Metal kernels (metal/attention_paged.h, metal/attention_paged_prefill.h) from
counting builds of the MSL emulator, not timings (no Mac here). Batches (GQA
4: 8 query heads over 2 key/value heads, pages of 16 keys scattered in the
pool, decode lengths log-uniform between 64 and 8192), float16, D 64 and 128
(--quick: 4 sequences of 64 to 512 keys, D 64):

- ``decode 16``: 16 decode rows;
- ``mixed``: those 16 decode rows plus one 512-row chunked prefill of a
  sequence with 1024 keys before the chunk, in one call (the decode kernel
  takes the decode rows, the paged prefill kernel the chunk; --quick: a
  32-row chunk after 64 keys).

Device bytes (read + written, every dispatch) per live K/V byte of:

- ``paged``: the paged kernels reading the pages through the block table;
- ``dense, same keys``: our dense kernels on each sequence's contiguous K/V,
  one launch per sequence (the same live keys, no padding; decode rows on the
  dense decode kernel, the chunk on the dense prefill kernel): what the page
  indirection is measured against (target: paged <= 1.05x);
- ``dense, padded``: our dense decode on the batch padded to a rectangle
  [B, Hkv, max length, D] (reads the padding too; decode batches only);
- ``MLX, padded``: MLX's sdpa_vector (one or two passes, as MLX picks on a
  base Apple GPU) on the same padded rectangle (kernel_lab/mlx_kernel_runner.py;
  decode batches only).

``paged scratch MiB`` is the device memory the paged call allocates beyond
its output (the split partials); gathering the pages into contiguous K/V
copies every live K/V byte (``gather copies MiB``) and padding stores
``padded MiB``.

    python -m kernel_lab.paged_metal_rows            # the full rows (tens of minutes in the emulator)
    python -m kernel_lab.paged_metal_rows --quick    # 4 short sequences
"""

from __future__ import annotations

import argparse
import math
import os
import time

import mlx.core as mx
import numpy as np

KV_HEADS, GQA, PAGE_SIZE = 2, 4, 16


def _setup():
    os.environ.setdefault("MSL_EMULATOR_TIMEOUT", "3600")


def ragged_decode(count: int, low: int, high: int, d: int, dtype, seed: int, chunk: tuple = ()):
    """q [total_q, Hq, D], scattered pages, block table and lengths of a decode
    batch; `chunk` (q_len, kv_len) adds one chunked-prefill sequence."""
    rng = np.random.default_rng(seed)
    kv_lens = np.exp(rng.uniform(math.log(low), math.log(high), count)).astype(int).tolist()
    q_lens = [1] * count
    if chunk:
        q_lens.append(chunk[0])
        kv_lens.append(chunk[1])
        count += 1
    needed = [(n + PAGE_SIZE - 1) // PAGE_SIZE for n in kv_lens]
    pool = rng.permutation(sum(needed))
    table = np.zeros((count, max(needed)), np.int32)
    at = 0
    for b, n in enumerate(needed):
        table[b, :n] = pool[at:at + n]
        at += n
    shape = (len(pool), KV_HEADS, PAGE_SIZE, d)
    q = mx.array(rng.standard_normal((sum(q_lens), KV_HEADS * GQA, d)).astype(np.float32)).astype(dtype)
    k, v = (mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype) for _ in range(2))
    return q, k, v, mx.array(table), q_lens, kv_lens


def _libraries(d: int):
    from kernel_lab import mlx_kernel_runner, msl_emulator
    from kernel_lab.paged_metal_runner import REPO, trimmed_sources

    directory = msl_emulator.cache_dir() / "paged_metal_rows"
    directory.mkdir(parents=True, exist_ok=True)
    bk = {64: 32, 128: 16}[d]  # the default target's prefill keys per block (csrc/metal/launch_plan.cpp)
    sources = trimmed_sources(directory, [f"float16, half, {d}"], prefill_instances=[f"float16, half, {d}, {bk}"])
    decode = directory / f"attention_decode_d{d}.metal"
    text = (REPO / "metal" / "attention_decode.metal").read_text()
    decode.write_text(text[: text.index("MLX_ATTN_DECODE_TYPES(64)")] + f"MLX_ATTN_DECODE(float16, half, {d})\n")
    prefill = directory / f"attention_prefill_d{d}.metal"
    text = (REPO / "metal" / "attention_prefill.metal").read_text()
    prefill.write_text(text[: text.index("MLX_ATTN_PREFILL_TYPES(64, 32)")] + f"MLX_ATTN_PREFILL(float16, half, {d}, {bk})\n")
    ours = msl_emulator.compile_library(sources + [decode, prefill], include_dirs=[REPO], fast_math=True,
                                        counters=True)
    return ours, mlx_kernel_runner.compile_mlx_library("decode", np.float16, d, counters=True)


def measure(case: str, count: int, low: int, high: int, d: int, seed: int, chunk: tuple = ()) -> dict:
    from kernel_lab import mlx_kernel_runner
    from kernel_lab.paged_metal_runner import (dense_decode_bytes, device_bytes, live_kv_bytes, padded,
                                               padded_decode_bytes, paged_plan, paged_decode_bytes, to_numpy)

    ours, mlx_library = _libraries(d)
    q, k, v, table, q_lens, kv_lens = ragged_decode(count, low, high, d, mx.float16, seed, chunk)
    live = live_kv_bytes(k, kv_lens)
    start = time.perf_counter()
    plan = paged_plan([q, k, v, table], q_lens, kv_lens, scale=d**-0.5)
    row = {"case": case, "dtype": "float16", "D": d, "sequences": len(q_lens), "q_lens": q_lens, "kv_lens": kv_lens,
           "live_kv_mib": live / 2**20, "kernels": [s.kernel for s in plan.dispatches]}
    row["paged"] = paged_decode_bytes(ours, q, k, v, table, q_lens, kv_lens)
    row["dense, same keys"] = dense_decode_bytes(ours, q, k, v, table, q_lens, kv_lens)
    row["paged / dense, same keys"] = row["paged"] / row["dense, same keys"]
    if not chunk:  # padding is modelled for decode batches
        row["dense, padded"] = padded_decode_bytes(ours, q, k, v, table, q_lens, kv_lens)
        qp, kp, vp = padded(q, k, v, table, q_lens, kv_lens)
        _, launch = mlx_kernel_runner.decode(mlx_library, *(to_numpy(x) for x in (qp, kp, vp)), scale=d**-0.5)
        row["MLX, padded"] = device_bytes(launch.counters) / live
        row["padded MiB"] = 2 * kp.nbytes / 2**20
    row["paged scratch MiB"] = sum(4 * s.elements for s in plan.scratch) / 2**20
    row["gather copies MiB"] = live / 2**20
    row["emulated seconds"] = time.perf_counter() - start
    return row


def metal_rows(quick: bool = False, cases=None, head_dims=None) -> list[dict]:
    """The rows, one per (batch, D); `cases` / `head_dims` keep only those."""
    _setup()
    if quick:
        grid = [("decode 4", 4, 64, 512, 64, ()), ("mixed 4 + 32", 4, 64, 512, 64, (32, 96))]
    else:
        grid = [(case, 16, 64, 8192, d, chunk) for case, chunk in (("decode 16", ()), ("mixed", (512, 1536)))
                for d in (64, 128)]
    grid = [g for g in grid if (cases is None or g[0] in cases) and (head_dims is None or g[4] in head_dims)]
    rows = []
    for case, count, low, high, d, chunk in grid:
        row = measure(case, count, low, high, d, seed=100, chunk=chunk)  # one batch of decode lengths
        print(metal_table([row]).splitlines()[-1], flush=True)
        rows.append(row)
    return rows


def metal_table(rows) -> str:
    head = ("| batch | dtype | D | live KV MiB | paged | dense, same keys | paged / dense | dense, padded "
            "| MLX, padded | paged scratch MiB | gather copies MiB | padded MiB |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        def cell(key, digits):
            return f"{r[key]:.{digits}f}" if key in r else "-"

        lines.append(
            f"| {r['case']} | {r['dtype']} | {r['D']} | {r['live_kv_mib']:.2f} | {r['paged']:.4f} "
            f"| {r['dense, same keys']:.4f} | {r['paged / dense, same keys']:.4f}x | {cell('dense, padded', 3)} "
            f"| {cell('MLX, padded', 3)} | {r['paged scratch MiB']:.3f} | {r['gather copies MiB']:.2f} "
            f"| {cell('padded MiB', 2)} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="4 short sequences, for a smoke test")
    p.add_argument("--case", action="append", help="only this batch (repeatable): 'decode 16', 'mixed'")
    p.add_argument("--head-dim", type=int, action="append", help="only this D (repeatable)")
    args = p.parse_args(argv)
    rows = metal_rows(args.quick, args.case, args.head_dim)
    print()
    print("Device bytes per live K/V byte (modelled, MSL emulator counting builds):")
    print(metal_table(rows))
    return rows


if __name__ == "__main__":
    main()
