"""Modelled device bytes of the paged and cascade Metal plans (modelled, not
measured: no Mac here): every dispatch's device reads and writes counted from
the C++ plan (its PagedSequence / CascadeGroup records, kernel ids, grids) the
way the kernels access memory: each key a decode threadgroup sees read once
per row chunk (K and V rows), each key a cascade prefix tile sees staged once
per tile, block-table entries, query rows, partials written and merged,
outputs. ``tests/test_paged_cascade_metal.py`` holds this model against the MSL
emulator's counting build on small problems; at sizes the emulator takes tens
of minutes to run (16 sequences sharing 4k keys) the model gives the row of
``benchmarks/bench_cascade.py --metal`` and docs/paged.md.

    python -m kernel_lab.cascade_bytes      # 16 x (4096 shared + 64 own), D 64, float16
"""

from __future__ import annotations

import argparse
import struct

import numpy as np

ATTENTION_PARAMS_BYTES = 17 * 8 + 14 * 4  # metal/attention_params.h
Q_LEN_AT, KV_LEN_AT, CAUSAL_AT, WINDOW_AT = 136 + 16, 136 + 20, 136 + 24, 136 + 28


def _params(data: bytes, at: int) -> dict:
    q_len, kv_len, causal, window = struct.unpack_from("<4i", data, at + Q_LEN_AT)
    return {"q_len": q_len, "kv_len": kv_len, "causal": causal, "window": window}


def sequences_of(plan) -> list[dict]:
    """The plan's PagedSequence records (metal/attention_paged_params.h)."""
    data, size = bytes(plan.sequences), ATTENTION_PARAMS_BYTES + 3 * 8 + 6 * 4
    out = []
    for at in range(0, len(data), size):
        record = _params(data, at)
        record.update(zip(("splits", "page_size", "query_block_start", "query_blocks", "prefix_splits",
                           "prefix_group"), struct.unpack_from("<6i", data, at + ATTENTION_PARAMS_BYTES + 24)))
        out.append(record)
    return out


def groups_of(plan) -> list[dict]:
    """The plan's CascadeGroup records."""
    data, size = bytes(plan.cascade_groups), ATTENTION_PARAMS_BYTES + 8 + 6 * 4
    out = []
    for at in range(0, len(data), size):
        record = _params(data, at)
        record.update(zip(("row_start", "rows", "splits", "keys_per_split", "page_size", "tiles"),
                          struct.unpack_from("<6i", data, at + ATTENTION_PARAMS_BYTES + 8)))
        out.append(record)
    return out


def cascade_rows_of(plan) -> list[tuple[int, int]]:
    data = bytes(plan.cascade_rows)
    return [struct.unpack_from("<2i", data, at) for at in range(0, len(data), 8)]


def _visible_range(causal: int, window: int, first_pos: int, last_pos: int, begin: int, end: int) -> tuple:
    """The keys of [begin, end) some query at [first_pos, last_pos] sees
    (attention_rules.h block_key_range), as (begin, end)."""
    if causal:
        end = min(end, last_pos + 1)
        if window > 0:
            begin = max(begin, first_pos - window + 1)
    return begin, max(begin, end)


def _visible(*args) -> int:
    begin, end = _visible_range(*args)
    return end - begin


def _row_bytes(d: int, element: int, bits: int, group_size: int) -> int:
    """One key's K and V rows: float elements, or packed codes with their scales and biases."""
    if bits == 0:
        return 2 * d * element
    return 2 * (d * bits // 8 + 2 * (d // group_size) * element)


def modelled_bytes(plan, *, d: int, element: int, kv_heads: int, group: int, bits: int = 0,
                   group_size: int = 64) -> dict:
    """Device bytes per dispatch kind of a paged or cascade plan: {"suffix" /
    "decode", "prefix", "merge", "total"}."""
    key_bytes = _row_bytes(d, element, bits, group_size)
    sequences = sequences_of(plan)
    out = {"decode": 0, "prefix": 0, "merge": 0}
    for step in plan.dispatches:
        family = step.id.family
        if family in ("paged_decode_partial", "paged_quantized_decode_partial"):
            rows_per_chunk, simdgroups = step.id.fields["r"], step.id.fields["sg"]
            for s in sequences:
                rows = group * s["q_len"]
                if s["splits"] == 0 or rows == 0:
                    continue
                partials = s["splits"] + s["prefix_splits"]
                per_split = -(-s["kv_len"] // s["splits"])
                for r0 in range(0, rows, rows_per_chunk):
                    live = min(rows_per_chunk, rows - r0)
                    queries = [r % s["q_len"] for r in range(r0, r0 + live)]
                    first = s["kv_len"] - s["q_len"] + min(queries)
                    last = s["kv_len"] - s["q_len"] + max(queries)
                    for split in range(s["splits"]):
                        begin, end = split * per_split, min(s["kv_len"], (split + 1) * per_split)
                        keys = _visible(s["causal"], s["window"], first, last, begin, end)
                        pages = -(-(end - begin) // s["page_size"]) + 1
                        written = live * (d + 2) * 4 if partials > 1 else live * (d * element + 4)
                        out["decode"] += kv_heads * (keys * key_bytes + simdgroups * pages * 4
                                                     + simdgroups * live * d * element + written)
        elif family in ("paged_cascade_prefix", "paged_cascade_quantized_prefix"):
            block = step.id.fields["bk"]
            rows_of = cascade_rows_of(plan)
            for g in groups_of(plan):
                members = rows_of[g["row_start"]:g["row_start"] + g["rows"]]
                positions = [g["kv_len"] + sequences[b]["kv_len"] - sequences[b]["q_len"] + i for b, i in members]
                tile_rows, per_tile = g["rows"] * group, step.threadgroup[0] // 32 * 8  # 8 rows a simdgroup
                for tile in range(g["tiles"]):
                    lo, hi = tile * per_tile, min(tile_rows, (tile + 1) * per_tile)
                    tile_positions = [positions[r // group] for r in range(lo, hi)]
                    for split in range(g["splits"]):
                        split_begin = split * g["keys_per_split"]
                        split_end = min(g["kv_len"], split_begin + g["keys_per_split"])
                        begin, end = _visible_range(g["causal"], g["window"], min(tile_positions),
                                                    max(tile_positions), split_begin, split_end)
                        # whole blocks from the split's start: the keys before `begin` in the first are read
                        start = split_begin + (begin - split_begin) // block * block
                        staged = max(0, end - start)
                        pages = sum(-(-min(kb + block, end) // g["page_size"]) - kb // g["page_size"]
                                    for kb in range(start, end, block))
                        out["prefix"] += kv_heads * (staged * key_bytes + pages * 4
                                                     + (hi - lo) * (d * element + 8) + (hi - lo) * (d + 2) * 4)
        elif family == "paged_decode_merge":
            for s in sequences:
                partials = s["splits"] + s["prefix_splits"]
                rows = group * s["q_len"]
                if partials > 1:
                    out["merge"] += kv_heads * rows * (partials * (d + 4) * 4 + d * element + 4)
    out["total"] = sum(out.values())
    return out


def shared_prefix_case(sequences=16, prefix=4096, own=64, d=64, kv_heads=2, gqa=4, page_size=16, dtype="float16",
                       seed=0):
    """Arrays of a decode step of `sequences` sequences sharing `prefix` keys,
    each with `own` keys after it (its last the decode row): q, k, v pages,
    own table, prefix table, q_lens, kv_lens, prefix_lens, prefix_groups and
    the full table."""
    import mlx.core as mx

    rng = np.random.default_rng(seed)
    prefix_pages, own_pages = -(-prefix // page_size), -(-own // page_size)
    num_pages = prefix_pages + sequences * own_pages
    pool = rng.permutation(num_pages).astype(np.int32)
    prefix_table = pool[None, :prefix_pages]
    own_table = pool[prefix_pages:].reshape(sequences, own_pages)
    full = np.concatenate([np.repeat(prefix_table, sequences, 0), own_table], 1)
    cast = {"float16": mx.float16, "float32": mx.float32, "bfloat16": mx.bfloat16}[dtype]
    q = mx.array(rng.standard_normal((sequences, kv_heads * gqa, d)).astype(np.float32)).astype(cast)
    k, v = (mx.array(rng.standard_normal((num_pages, kv_heads, page_size, d)).astype(np.float32)).astype(cast)
            for _ in range(2))
    return dict(q=q, k=k, v=v, own_table=mx.array(own_table), prefix_table=mx.array(prefix_table),
                q_lens=[1] * sequences, kv_lens=[prefix + own] * sequences, prefix_lens=[prefix],
                prefix_groups=[0] * sequences, full_table=mx.array(full))


def cascade_vs_paged(sequences=16, prefix=4096, own=64, d=64, kv_heads=2, gqa=4, page_size=16, dtype="float16"):
    """The modelled bytes of the cascade plan and of today's paged plan on the
    full tables, for one decode step; returns a row dict."""
    from kernel_lab.paged_metal_runner import cascade_plan, own_lengths, paged_plan

    case = shared_prefix_case(sequences, prefix, own, d, kv_heads, gqa, page_size, dtype)
    q, k, v = case["q"], case["k"], case["v"]
    element = q.itemsize
    paged = paged_plan([q, k, v, case["full_table"]], case["q_lens"], case["kv_lens"], scale=d**-0.5)
    cascade = cascade_plan([q, k, v, case["own_table"], case["prefix_table"]], case["q_lens"],
                           own_lengths(case["kv_lens"], case["prefix_lens"], case["prefix_groups"]),
                           case["prefix_lens"], case["prefix_groups"], scale=d**-0.5)
    assert paged.supported and cascade.supported, (paged.reason, cascade.reason)
    shape = dict(d=d, element=element, kv_heads=kv_heads, group=gqa)
    before, after = modelled_bytes(paged, **shape), modelled_bytes(cascade, **shape)
    return {"sequences": sequences, "prefix": prefix, "own": own, "D": d, "dtype": dtype, "kv_heads": kv_heads,
            "gqa": gqa, "paged MiB": before["total"] / 2**20, "cascade MiB": after["total"] / 2**20,
            "cascade / paged": after["total"] / before["total"], "paged kernels": [s.kernel for s in paged.dispatches],
            "cascade kernels": [s.kernel for s in cascade.dispatches], "cascade parts": after}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sequences", type=int, default=16)
    p.add_argument("--prefix", type=int, default=4096)
    p.add_argument("--own", type=int, default=64)
    p.add_argument("--head-dim", type=int, default=64)
    args = p.parse_args(argv)
    row = cascade_vs_paged(args.sequences, args.prefix, args.own, args.head_dim)
    print(f"modelled device bytes, {row['sequences']} sequences x ({row['prefix']} shared + {row['own']} own keys), "
          f"D={row['D']} {row['dtype']}, {row['kv_heads']} KV heads x GQA {row['gqa']}: paged "
          f"{row['paged MiB']:.2f} MiB, cascade {row['cascade MiB']:.2f} MiB = {row['cascade / paged']:.3f}x")
    return row


if __name__ == "__main__":
    main()
