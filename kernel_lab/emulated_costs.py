"""Modelled costs of our Metal kernels and MLX's on the same problems, from
counting builds of the MSL emulator (device and threadgroup bytes, MMAs,
simd ops, barriers, exps; docs/msl_emulator.md), a roofline time from them,
and a check of the cost model's own counts against the counters; with the
Markdown table of docs/emulator_costs.md (benchmarks/bench_metal.py
--emulate writes it). Modelled costs, not timings."""

from __future__ import annotations

import os
import time

import mlx.core as mx
import numpy as np

import mlx_attn

from kernel_lab import metal_cost_model as cm
from kernel_lab.cost_checks import MODEL_GPU, decode_prefetch, kernel_decode_shape, mlx_decode_kernels

COST_COLUMNS = {  # counter -> column title; per useful FLOP (prefill) or per K/V byte (decode)
    "device_bytes": "device bytes",
    "threadgroup_bytes": "threadgroup bytes",
    "simdgroup_matrix_mmas": "simdgroup MMAs",
    "simd_ops": "simd ops",
    "threadgroup_barriers": "barriers",
    "exp_calls": "exp/exp2",
}
# Not per work: how wide the device reads are (0.5 = one 2-byte element per
# load instruction, 0.125 = a half4 per load).
LOAD_WIDTH_COLUMN = "device loads / byte read"
STATIC_COLUMNS = {"threadgroup_memory_bytes": "threadgroup memory (B)", "thread_array_bytes": "thread arrays (B)"}

# Published figures of the GPU the modelled time is computed for: Apple M2
# (Apple8 family), 10-core GPU: 3.6 TFLOP/s FP32 (Apple; FP16 runs at the
# same rate on Apple7-9 per Philip Turner's metal-benchmarks), 100 GB/s
# LPDDR5 (Apple). Threadgroup-memory bandwidth is not published: 128 B per
# clock per core at 1.398 GHz is an UNMEASURED assumption, as is the cost of
# an exp2 (4 FMA slots per lane). docs/metal_kernels.md has the formula.
GPU_MODEL = {
    "name": "Apple M2, 10-core GPU",
    "plan_target": {"gpu_family": "apple8", "gpu_cores": 10},  # our kernels are planned for the same GPU
    "flops": 3.6e12,
    "device_bytes_per_s": 100e9,
    "threadgroup_bytes_per_s": 10 * 128 * 1.398e9,  # unmeasured
    "flops_per_mma": 2 * 8 * 8 * 8,  # one 8x8x8 simdgroup multiply-accumulate
    "flops_per_exp": 2 * 4,  # unmeasured: an exp2 costs about 4 FMAs
}


def modelled_seconds(counters: dict, gpu: dict = GPU_MODEL) -> dict[str, float]:
    """A roofline from the counters: the slowest of device traffic,
    threadgroup traffic and arithmetic (MMAs and exps) bounds the time.
    Ignores occupancy, latency and scalar ALU work."""
    parts = {
        "device": counters["device_bytes"] / gpu["device_bytes_per_s"],
        "threadgroup": counters["threadgroup_bytes"] / gpu["threadgroup_bytes_per_s"],
        "math": (counters["simdgroup_matrix_mmas"] * gpu["flops_per_mma"]
                 + counters["exp_calls"] * gpu["flops_per_exp"]) / gpu["flops"],
    }
    bound = max(parts, key=parts.get)
    return {"seconds": parts[bound], "bound": bound, **{f"{k}_seconds": v for k, v in parts.items()}}


def visible_pairs(q_len: int, kv_len: int, causal: bool) -> int:
    """Query-key pairs attention must compute (causal: bottom-right aligned, as MLX)."""
    if not causal:
        return q_len * kv_len
    offset = kv_len - q_len
    return sum(min(kv_len, offset + i + 1) for i in range(q_len))


def summed(counters: list) -> dict[str, int]:
    """Counters of a problem's dispatches: costs add, allocations take the largest."""
    total = {key: 0 for key in [*COST_COLUMNS, *STATIC_COLUMNS, "device_bytes_read", "device_load_operations"]}
    for c in counters:
        d = c.as_dict()
        total["device_bytes"] += d["device_bytes_read"] + d["device_bytes_written"]
        total["device_bytes_read"] += d["device_bytes_read"]
        total["device_load_operations"] += d["device_load_operations"]
        total["threadgroup_bytes"] += d["threadgroup_bytes_read"] + d["threadgroup_bytes_written"]
        for key in ("simdgroup_matrix_mmas", "simd_ops", "threadgroup_barriers", "exp_calls"):
            total[key] += d[key]
        for key in STATIC_COLUMNS:
            total[key] = max(total[key], d[key])
    return total


class CountingLibrary:
    """Stands in for EmulatedMetal's library and keeps every dispatch's counters."""

    def __init__(self, library):
        self.library, self.counters = library, []

    def dispatch(self, *args, **kwargs):
        counters = self.library.dispatch(*args, **kwargs)
        self.counters.append(counters)
        return counters


def emulated_rows(problems, prefill_heads: int = 1, decode_kv_heads: int = 1, on_row=None):
    """Our kernels (from the launch plan, as kernel_lab/metal_runner.py runs
    them) and MLX's (kernel_lab/mlx_kernel_runner.py) on the same problems,
    in counting builds of the MSL emulator: modelled costs, not timings.
    `problems`: (phase, D, causal, T, GQA group) tuples; prefill runs
    `prefill_heads` heads (as many KV heads), decode `decode_kv_heads` KV
    heads times the group. `on_row(row)` sees each row as it is done."""
    os.environ.setdefault("MSL_EMULATOR_TIMEOUT", "3600")  # one long prefill dispatch runs for minutes
    from kernel_lab import mlx_kernel_runner, msl_emulator
    from kernel_lab.metal_runner import METAL_SOURCES, REPO, EmulatedMetal

    ours = EmulatedMetal(fast_math=True)
    ours.library = CountingLibrary(msl_emulator.compile_library(
        METAL_SOURCES, include_dirs=[REPO], fast_math=True, counters=True))
    rows = []
    for phase, d, causal, t, group in problems:
        kv_heads = prefill_heads if phase == "prefill" else decode_kv_heads
        heads = kv_heads * (1 if phase == "prefill" else group)
        q_len = t if phase == "prefill" else 1
        key = mx.random.key(t * 1000 + d)
        q, k, v = (mx.random.normal(shape, key=mx.random.split(key, 3)[i]).astype(mx.float16)
                   for i, shape in enumerate([(1, heads, q_len, d), (1, kv_heads, t, d), (1, kv_heads, t, d)]))
        mask = "causal" if causal else None
        expected = np.array(mlx_attn.reference_attention(q, k, v, scale=d**-0.5, mask=mask).astype(mx.float32))

        ours.library.counters = []
        start = time.perf_counter()
        out_ours = np.array(ours(q, k, v, scale=d**-0.5, mask=mask, gpu_target=GPU_MODEL["plan_target"]).astype(mx.float32))
        ours_seconds = time.perf_counter() - start
        ours_dispatches = list(ours.last_plan.dispatches)

        library = mlx_kernel_runner.compile_mlx_library(phase, np.float16, d, counters=True)
        inputs = [np.array(x) for x in (q, k, v)]
        start = time.perf_counter()
        if phase == "prefill":
            out_mlx, launch = mlx_kernel_runner.prefill(library, *inputs, scale=d**-0.5, causal=causal)
        else:
            out_mlx, launch = mlx_kernel_runner.decode(library, *inputs, scale=d**-0.5, causal=causal)
        mlx_seconds = time.perf_counter() - start

        if phase == "prefill":
            work, unit = 4.0 * heads * d * visible_pairs(q_len, t, causal), "useful FLOP"
        else:
            work, unit = 2.0 * kv_heads * t * d * 2, "K/V byte"
        row = {"phase": phase, "D": d, "dtype": "float16", "causal": causal, "T": t, "heads": heads,
               "kv_heads": kv_heads, "group": heads // kv_heads, "per": unit, "work": work}
        for name, counters, out, kernels, seconds in (
                ("ours", ours.library.counters, out_ours, [d.kernel for d in ours_dispatches], ours_seconds),
                ("mlx", launch.counters, out_mlx.astype(np.float32), launch.kernels, mlx_seconds)):
            total = summed(counters)
            row[name] = {"kernels": kernels, "counters": total,
                         "per_work": {k: total[k] / work for k in COST_COLUMNS},
                         "modelled": modelled_seconds(total),
                         "max_abs_error": float(np.abs(out - expected).max()), "emulated_seconds": seconds}
        row["ours_splits"] = ours.last_plan.splits
        row["model_check"] = model_count_check(row, ours_dispatches)
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


# The counts model_count_check compares, with their table headings.
CHECKED_COUNTS = {"mmas": "MMAs", "device_bytes": "device bytes", "threadgroup_bytes": "threadgroup bytes",
                  "simd_ops": "simd ops", "exp_calls": "exp2"}


def model_count_check(row: dict, ours_dispatches: list) -> dict:
    """The cost model's own counts (from the tiles) over the emulator's
    counters for the same problem: MMAs (prefill) and device bytes as issued."""
    d, t, heads, kv_heads, causal = row["D"], row["T"], row["heads"], row["kv_heads"], row["causal"]
    gpu = MODEL_GPU
    if row["phase"] == "prefill":
        bk = ours_dispatches[0].id.fields["bk"]
        models = {"ours": [cm.prefill_kernel("ours", cm.our_prefill_tile(d, bk, "fast"), 1, heads, kv_heads, t, t,
                                              causal, gpu)],
                  "mlx": [cm.prefill_kernel("steel", cm.mlx_steel_tile(d), 1, heads, kv_heads, t, t, causal, gpu)]}
    else:
        shape_rows, simdgroups = kernel_decode_shape(ours_dispatches[0])
        models = {"ours": cm.our_decode_kernels(1, heads, kv_heads, t, d, gpu, row["ours_splits"], shape_rows,
                                                simdgroups=simdgroups,
                                                prefetch=decode_prefetch(d, shape_rows, simdgroups),
                                                single_dispatch=True, lane_merge=True),
                  "mlx": mlx_decode_kernels(1, heads, kv_heads, t, d, gpu)}
    out = {}
    for name, kernels in models.items():
        counted = row[name]["counters"]
        modelled_bytes = sum(k.device_bytes for k in kernels)
        check = {"device_bytes": modelled_bytes / max(1, counted["device_bytes"])}
        if row["phase"] == "prefill":
            k = kernels[0]
            modelled_mmas = k.block.counts["mma"] * k.blocks * k.simdgroups * k.threadgroups
            check["mmas"] = modelled_mmas / max(1, counted["simdgroup_matrix_mmas"])
            # threadgroup memory traffic: K/V stores and fragment reads a block, Q staged once (steel)
            staged_q = 0 if name == "ours" else k.threadgroups * cm.mlx_steel_tile(d).bq * d * 2
            modelled_tg = k.threadgroup_bytes_per_block * k.blocks * k.threadgroups + staged_q
            check["threadgroup_bytes"] = modelled_tg / max(1, counted["threadgroup_bytes"])
            # the row max and sum's shuffles (per simdgroup) and the exp2s (per lane)
            per_block = k.blocks * k.simdgroups * k.threadgroups
            check["simd_ops"] = k.block.counts["simd_shuffle"] * per_block / max(1, counted["simd_ops"])
            check["exp_calls"] = k.block.counts["exp2"] * 32 * per_block / max(1, counted["exp_calls"])
        out[name] = check
    return out


def _cell(ours: float, theirs: float, scale: float = 1.0) -> str:
    ratio = f"{ours / theirs:.2f}" if theirs else ("=" if ours == theirs else "inf")
    return f"{ours * scale:.3g} / {theirs * scale:.3g} ({ratio})"


def loads_per_byte(counters: dict) -> float:
    return counters["device_load_operations"] / max(1, counters["device_bytes_read"])


def markdown_header() -> str:
    titles = [*COST_COLUMNS.values(), LOAD_WIDTH_COLUMN, *STATIC_COLUMNS.values()]
    return ("| phase | D | GQA | causal | T | per | " + " | ".join(titles) + " | modelled µs (bound) |\n"
            + "|---" * (7 + len(titles)) + "|")


def markdown_row(row) -> str:
    scale = 1000.0 if row["phase"] == "prefill" else 1.0  # prefill per 1000 useful FLOP
    per = "1k FLOP" if row["phase"] == "prefill" else "K/V byte"
    cells = [_cell(row["ours"]["per_work"][k], row["mlx"]["per_work"][k], scale) for k in COST_COLUMNS]
    cells.append(_cell(loads_per_byte(row["ours"]["counters"]), loads_per_byte(row["mlx"]["counters"])))
    cells += [_cell(row["ours"]["counters"][k], row["mlx"]["counters"][k]) for k in STATIC_COLUMNS]
    ours, theirs = row["ours"]["modelled"], row["mlx"]["modelled"]
    cells.append(f"{_cell(ours['seconds'], theirs['seconds'], 1e6)} ({ours['bound']} / {theirs['bound']})")
    return (f"| {row['phase']} | {row['D']} | {row.get('group', 1)} | {'yes' if row['causal'] else 'no'} | {row['T']} | {per} | "
            + " | ".join(cells) + " |")


def costs_markdown(rows, command: str) -> str:
    from kernel_lab.mlx_kernel_runner import MLX_METAL_VERSION

    prefill = next((r for r in rows if r["phase"] == "prefill"), None)
    decode = next((r for r in rows if r["phase"] == "decode"), None)
    shapes = []
    if prefill:
        shapes.append(f"prefill B=1, H={prefill['heads']}, Hkv={prefill['kv_heads']}")
    if decode:
        shapes.append(f"decode B=1, Hkv={decode['kv_heads']}, H = Hkv x the GQA group (one query)")
    lines = [
        "# Modelled kernel costs: our Metal kernels and MLX's (MSL emulator counters)",
        "",
        "**These are modelled costs counted by the MSL emulator on the CPU, not GPU timings.**",
        "Each cell is `ours / MLX (ours/MLX)`. Counters are summed over every thread and every",
        "dispatch of a problem, divided by the useful work: per 1000 useful FLOP for prefill",
        "(4·H·D·visible query-key pairs), per K/V byte for decode (2·Hkv·T·D·2 bytes).",
        "Threadgroup memory (per threadgroup) and thread arrays (per thread, what stays in",
        "memory after clang -O1) are the largest of the problem's kernels, not normalised;",
        "device loads / byte read is the number of device load instructions per byte they read",
        "(0.5: one 2-byte element per load; 0.125: a half4 per load).",
        "What each counter means and how it is counted: docs/msl_emulator.md.",
        "",
        "Kernels: ours from the launch plan for the modelled GPU "
        f"({GPU_MODEL['plan_target']['gpu_family']}, {GPU_MODEL['plan_target']['gpu_cores']} cores; kernel_lab/metal_runner.py); MLX's steel_attention and",
        f"sdpa_vector from mlx-metal {MLX_METAL_VERSION} launched as MLX's host code does",
        "(kernel_lab/mlx_kernel_runner.py; decode as on a base Apple GPU). float16, "
        + "; ".join(shapes) + ". Heads are few to keep the emulated run short: costs per",
        "useful FLOP or K/V byte do not depend on the head count (the modelled time, a roofline,",
        "scales with the work, so its ratio does not either; occupancy is not modelled), except",
        "our decode's split count, which the plan lowers as KV heads fill the GPU: fewer",
        "splits, fewer partials and simdgroup combines per K/V byte (--decode-kv-heads).",
        "",
        f"Modelled time (µs, for the emulated problem): the roofline of docs/metal_kernels.md on "
        f"{GPU_MODEL['name']}: max(device bytes / {GPU_MODEL['device_bytes_per_s'] / 1e9:.0f} GB/s, "
        f"threadgroup bytes / {GPU_MODEL['threadgroup_bytes_per_s'] / 1e9:.0f} GB/s (unmeasured), "
        f"({GPU_MODEL['flops_per_mma']}·MMAs + {GPU_MODEL['flops_per_exp']}·exps) / "
        f"{GPU_MODEL['flops'] / 1e12:.1f} TFLOP/s); the bound that decides is in parentheses.",
        "This roofline cannot tell kernels with equal counts apart; the cost model after the tables",
        "(\"Cost model\": registers, occupancy, latency, a cache model) predicts times that can.",
        "",
        f"Command: `{command}`",
        "",
        markdown_header(),
        *(markdown_row(r) for r in rows),
    ]
    lines += ["", "The cost model's own counts (from the kernels' tiles) over these counters: a check that the",
              "model describes the kernels the emulator ran (MMAs, device bytes as issued, threadgroup bytes",
              "read and written, simd ops, exp2 calls; decode rows: device bytes only; 1.00 = equal):", "",
              "| phase | D | GQA | causal | T | " + " | ".join(f"{impl} {what}" for impl in ("ours", "MLX")
                                                  for what in CHECKED_COUNTS.values()) + " |",
              "|---|---|---|---|---|" + "---|" * (2 * len(CHECKED_COUNTS))]
    for r in rows:
        c = r.get("model_check", {})
        cells = [f"{c.get(n, {}).get(key, float('nan')):.2f}" for n in ("ours", "mlx") for key in CHECKED_COUNTS]
        lines.append(f"| {r['phase']} | {r['D']} | {r.get('group', 1)} | {'yes' if r['causal'] else 'no'} | {r['T']} | "
                     + " | ".join(cells) + " |")
    lines += ["", "Kernels and accuracy (max |out - reference_attention|):", "",
              "| phase | D | GQA | causal | T | ours | MLX |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        ours = f"{', '.join(r['ours']['kernels'])} ({r['ours']['max_abs_error']:.1e})"
        theirs = f"{', '.join(r['mlx']['kernels'])} ({r['mlx']['max_abs_error']:.1e})"
        lines.append(f"| {r['phase']} | {r['D']} | {r.get('group', 1)} | {'yes' if r['causal'] else 'no'} | {r['T']} | {ours} | {theirs} |")
    return "\n".join(lines) + "\n"
