"""The dense decode plan's rule, written apart from csrc/metal/launch_plan.cpp as
docs/metal_kernels.md ("Decode") states it: the oracle the plan tests hold
the launch plan to.

Two threadgroup shapes per head dim: the group shape (the register budget's
32 / (D / 32) rows, at most 8, on 4 simdgroups, at least 64 keys per split) and the row
shape (one row on ROW_SIMDGROUPS[D] simdgroups, at least 32 keys per
simdgroup per split). Splits of a shape: enough threadgroups for the target's
cores x 8 threadgroups of 4 simdgroups (counted in the shape's simdgroups, at
least one per core), but each split keeps max(the shape's floor, 16 x rows)
keys. The plan takes the row shape where its critical path, the waves of
threadgroups (as many at once as the split rule's busy figure) times the
keys per simdgroup (x 1.5 when a threadgroup serves several rows), plus 16
for a merge dispatch, is no longer than the group shape's; over dequantized
keys (the quantized decodes) each split keeps a quarter of those keys, the
row shape's splits fill at most one wave (the target's threadgroups at once,
rounded down), and one row per KV head always takes the row shape (the group shape
would share no dequantization). The paged decodes take
the same rule with each shape's splits capped by its
page window (127 pages on the row shape, 31 on the group shape): the cap
adds splits."""

from __future__ import annotations

import math

ROW_SIMDGROUPS = {64: 32, 96: 32, 128: 32, 256: 16, 512: 16}


def shapes(d: int) -> dict:
    """name -> (rows, simdgroups, the floor of keys per split)."""
    return {"group": (min(8, 32 // (d // 32)), 4, 64), "row": (1, ROW_SIMDGROUPS[d], 32 * ROW_SIMDGROUPS[d])}


def at_once(shape: tuple, cores: int) -> int:
    """Threadgroups of the shape the GPU runs at once: cores x 8 of 4 simdgroups."""
    return max(cores, cores * 8 * 4 // shape[1])


def splits(batch: int, kv_heads: int, rows: int, kv_len: int, shape: tuple, cores: int = 8,
           dequantized: bool = False) -> int:
    shape_rows, simdgroups, floor = shape
    threadgroups = max(1, batch * kv_heads * -(-rows // shape_rows))
    if dequantized and shape_rows == 1:  # the row shape: at most one wave
        for_occupancy = max(1, at_once(shape, cores) // threadgroups)
    else:
        for_occupancy = -(-at_once(shape, cores) // threadgroups)
    keys = max(1, max(floor, 16 * rows) // 4) if dequantized else max(floor, 16 * rows)
    return max(1, min(for_occupancy, -(-kv_len // keys)))


def path(batch: int, kv_heads: int, rows: int, kv_len: int, n_splits: int, shape: tuple, cores: int) -> float:
    threadgroups = batch * kv_heads * -(-rows // shape[0]) * n_splits
    waves = max(1, -(-threadgroups // at_once(shape, cores)))
    keys = math.ceil(kv_len / (n_splits * shape[1]))
    return waves * keys * (1.5 if min(rows, shape[0]) > 1 else 1.0) + (16 if n_splits > 1 else 0)


def decode_plan(batch: int, kv_heads: int, rows: int, kv_len: int, d: int, cores: int = 8,
                max_pages_per_split: tuple | None = None, page_size: int = 0, dequantized: bool = False) -> dict:
    """The shape the plan takes ("group" / "row"), its rows, simdgroups and
    split count (before any cap), and the partial kernel's host-name fields;
    `max_pages_per_split` (row shape, group shape) of `page_size` keys caps
    each shape's splits when choosing (the paged decode); `dequantized`
    (the quantized decodes): their split rule, and one row per KV head takes
    the row shape."""
    by_shape = {}
    for name, shape in shapes(d).items():
        n = splits(batch, kv_heads, rows, kv_len, shape, cores, dequantized)
        if max_pages_per_split:
            most = max_pages_per_split[0 if name == "row" else 1] * page_size
            n_capped = max(n, -(-kv_len // most))
            by_shape[name] = (path(batch, kv_heads, rows, kv_len, n_capped, shape, cores), n, shape)
            continue
        by_shape[name] = (path(batch, kv_heads, rows, kv_len, n, shape, cores), n, shape)
    name = "row" if by_shape["row"][0] <= by_shape["group"][0] or (dequantized and rows == 1) else "group"
    _, n, (shape_rows, simdgroups, _) = by_shape[name]
    return {"shape": name, "rows": shape_rows, "simdgroups": simdgroups, "splits": n,
            "fields": f"_r{shape_rows}_sg{simdgroups}"}
