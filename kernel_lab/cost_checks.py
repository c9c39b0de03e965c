"""The cost model (kernel_lab/metal_cost_model.py) applied to our launch
plans: the plans' kernels and decode shapes read back through the extension,
each kernel's registers, the decode and quantized split rules against the
best shape and split count, the prefill tiles against MLX's own tuning and
against a public throughput figure. Each function returns rows or a
summary; cost_report.py makes the tables of them, tests/test_cost_model.py
holds them to their bounds, benchmarks/bench_metal.py prints them."""

from __future__ import annotations

import functools
import itertools

import mlx.core as mx
import numpy as np

from kernel_lab import metal_cost_model as cm

MODEL_GPU = cm.M2_MAX  # the model's GPU for our kernels and MLX's; the throughput check uses M3 Max
# The public figure the model is checked against: MLX's fused prefill, D = 64,
# float16, on an M3 Max (~11.7 TFLOP/s, a public benchmark of mx.fast sdpa).
PUBLIC_PREFILL_TFLOPS = 11.7
PUBLIC_FACTOR = 1.5  # the model must land within this factor of it


def previous_decode_splits(rows: int, kv_len: int, threadgroups: int, cores: int) -> int:
    """The split rule before issue #23 (at least 64 keys per row per split),
    kept only as the 'before' column of the model's table."""
    for_occupancy = -(-cores * 8 // max(1, threadgroups))
    for_traffic = -(-kv_len // max(64, 64 * rows))
    return max(1, min(for_occupancy, for_traffic))


def group_only_rows(d: int) -> int:
    """The group shape's rows before the 8-row cap (the register budget's
    32 / (D / 32)): the 'before' columns' kernel."""
    return 32 // (d // 32)


def group_only_splits(rows: int, kv_len: int, kv_heads: int, d: int, cores: int) -> int:
    """The split rule when the group shape was the only one (16 keys per row,
    64 per split, cores x 8 threadgroups), kept as a 'before' column."""
    threadgroups = max(1, kv_heads * -(-rows // group_only_rows(d)))
    for_occupancy = -(-cores * 8 // threadgroups)
    for_traffic = -(-kv_len // max(64, 16 * rows))
    return max(1, min(for_occupancy, for_traffic))


def planned(q_len: int, kv_len: int, d: int, heads: int, kv_heads: int, causal: bool, gpu=MODEL_GPU) -> dict:
    """Our launch plan for the problem (csrc/metal/launch_plan.cpp, through the extension)."""
    from mlx_attn.metal_support import launch_plan

    q = mx.zeros((1, heads, q_len, d), mx.float16)
    k = mx.zeros((1, kv_heads, kv_len, d), mx.float16)
    return launch_plan(q, k, k, scale=d**-0.5, mask="causal" if causal else None,
                       gpu_family=gpu.family, gpu_cores=gpu.cores)


def _plan_field(plan, tag: str, family: str | None = None) -> int:
    """A field (``bk``, ``d``...) of the first dispatch whose kernel id has it
    (of ``family`` when given): read from the typed id, never the name."""
    for dispatch in plan.dispatches:
        if tag in dispatch.id.fields and family in (None, dispatch.id.family):
            return dispatch.id.fields[tag]
    raise ValueError(f"no dispatch has a {tag!r} field: {[d.kernel for d in plan.dispatches]}")


def model_problem(phase: str, d: int, causal: bool, t: int, heads: int, kv_heads: int, gpu=MODEL_GPU) -> dict:
    """Predictions for one problem: ours (before / after the fixes) and MLX's."""
    if phase == "prefill":
        plan = planned(t, t, d, heads, kv_heads, causal, gpu)
        bk = _plan_field(plan, "bk")
        variants = {
            "mlx": [cm.prefill_kernel("steel_attention", cm.mlx_steel_tile(d), 1, heads, kv_heads, t, t, causal, gpu)],
        }
        ours = {"ours, precise exp2 (before)": ("precise", False), "ours, fast::exp2 (before)": ("fast", False),
                "ours, fast::exp2, lazy max (now)": ("fast", True)}
        for name, (exp_kind, lazy_max) in ours.items():
            tile = cm.our_prefill_tile(d, bk, exp_kind, lazy_max=lazy_max)
            variants[name] = [cm.prefill_kernel("attention_prefill", tile, 1, heads, kv_heads, t, t, causal, gpu)]
        exp_kinds = {"mlx": "fast", **{name: exp_kind for name, (exp_kind, _) in ours.items()}}
    else:
        plan = planned(1, t, d, heads, kv_heads, False, gpu)
        group = heads // kv_heads
        now = plan_decode_shape(plan)
        rows_per_tg = group_only_rows(d)
        chunks = -(-group // rows_per_tg)
        before = previous_decode_splits(group, t, kv_heads * chunks, gpu.cores)
        group_splits = group_only_splits(group, t, kv_heads, d, gpu.cores)
        shape_name = "row shape" if now["rows"] == 1 else "group shape"
        variants = {
            "mlx": mlx_decode_kernels(1, heads, kv_heads, t, d, gpu),
            f"ours, {before} splits (before #23: 64 keys per row, merge always, no prefetch)": cm.our_decode_kernels(
                1, heads, kv_heads, t, d, gpu, before, rows_per_tg),
            f"ours, group shape ({rows_per_tg} rows, 4 simdgroups), {group_splits} splits, prefetch, "
            f"{cm.MERGE_SIMDGROUPS}-simdgroup merge (before)": cm.our_decode_kernels(
                1, heads, kv_heads, t, d, gpu, group_splits, rows_per_tg, prefetch=decode_prefetch(d, rows_per_tg),
                single_dispatch=True,
                lane_merge=True),
            f"ours, {shape_name} ({rows_text(now['rows'])}, {now['simdgroups']} simdgroups), {now['splits']} splits "
            "(now)": cm.our_decode_kernels(
                1, heads, kv_heads, t, d, gpu, now["splits"], now["rows"], simdgroups=now["simdgroups"],
                prefetch=decode_prefetch(d, now["rows"], now["simdgroups"]), single_dispatch=True, lane_merge=True),
        }
        exp_kinds = {name: "fast" for name in variants}  # decode_key and the merges call fast::exp2
    out = {}
    for name, kernels in variants.items():
        p = cm.predict_all(kernels, gpu, exp_kinds[name])
        out[name] = {"seconds": p["seconds"], "registers": p["registers"], "spills": p["spills"],
                     "occupancy": p["occupancy"], "bound": p["bound"], "dispatches": p["dispatches"],
                     "resident": p["resident_threadgroups"], "limit": p["occupancy_limit"]}
    return out


def decode_prefetch(d: int, rows: int, simdgroups: int = 4, bits: int | None = None, paged: bool = False) -> int:
    """Keys in flight per simdgroup in our decode kernel of this shape (rows,
    simdgroups) over float or `bits`-bit K/V, paged or not: 2 (DecodePrefetch
    in metal/attention_decode.h: the next key's K/V while the current key's
    math runs) where the registers allow it (metal_cost_model.decode_prefetch)."""
    loader = (cm.QUANTIZED_LOADER_REGISTERS if bits else 0) + (cm.paged_window_registers(rows) if paged else 0)
    return cm.decode_prefetch(rows, simdgroups, d, loader, MODEL_GPU)


def mlx_decode_kernels(batch: int, heads: int, kv_heads: int, t: int, d: int, gpu) -> list:
    """MLX's sdpa_vector for a decode problem as MLX's host code picks it on
    a base Apple GPU (kernel_lab/mlx_kernel_runner.py): two passes from 4096 keys
    when a KV head serves several query heads, 64 blocks from GQA 4, else 32."""
    group = heads // kv_heads
    return cm.sdpa_vector_kernels(batch, heads, kv_heads, t, d, gpu, kv_heads < heads and t >= 4096,
                                  64 if group >= 4 else 32)


def rows_text(rows: int) -> str:
    return "1 row" if rows == 1 else f"{rows} rows"


# A decode partial kernel's host name (dense, quantized, paged, paged
# quantized): ..._decode_partial_<dtype>_d<D>[_b<bits>]_r<R>_sg<NSG>[_mask_*].
DECODE_PARTIALS = ("decode_partial", "quantized_decode_partial", "paged_decode_partial",
                   "paged_quantized_decode_partial")


def kernel_decode_shape(dispatch) -> tuple[int, int]:
    """(rows, simdgroups) of a decode partial dispatch, from its kernel id."""
    if dispatch.id.family not in DECODE_PARTIALS:
        raise ValueError(f"not a decode partial kernel: {dispatch.kernel}")
    return dispatch.id.fields["r"], dispatch.id.fields["sg"]


def plan_decode_shape(plan) -> dict:
    """A decode plan's shape (rows, simdgroups), splits (the partial
    dispatch's grid x) and dispatch count."""
    for dispatch in plan.dispatches:
        if dispatch.id.family in DECODE_PARTIALS:
            rows, simdgroups = kernel_decode_shape(dispatch)
            return {"rows": rows, "simdgroups": simdgroups, "splits": int(dispatch.grid[0]),
                    "dispatches": len(plan.dispatches)}
    raise ValueError("no decode partial dispatch in the plan")


def decode_shapes(batch: int, kv_heads: int, rows: int, kv_len: int, d: int, gpu=MODEL_GPU,
                  dequantized: bool = False) -> dict:
    """The plan's two decode shapes for a problem, each with its split count,
    and which one it chooses (csrc/metal/launch_plan.cpp decode_shape; over
    dequantized keys: the quantized plan's choice)."""
    from mlx_attn import _ext

    return _ext.metal_decode_shapes(batch, kv_heads, rows, kv_len, d, gpu_family=gpu.family, gpu_cores=gpu.cores,
                                    dequantized=dequantized)


def chosen_shape(shapes: dict) -> dict:
    """The shape the plan takes of decode_shapes' two."""
    return shapes["row"] if shapes["row"]["chosen"] else shapes["group"]


# Every head-dim pair the forward plans take (key = value, then the D-split pairs).
PLANNED_HEAD_DIMS = ((64, 64), (80, 80), (96, 96), (128, 128), (192, 128), (256, 256), (512, 512), (576, 512))


def decode_partial_registers(d: int, bits: int | None = None, rows: int | None = None,
                             simdgroups: int = 4, paged: bool = False) -> tuple[str, int]:
    """(tile, estimated registers) of the decode partial kernel at head dim d
    and shape (rows, simdgroups; the group shape by default), over float K/V
    or, with `bits`, quantized K/V (the same body with the QuantizedKV
    loader); `paged`: the paged decode's (the same body, plus its page
    window): the registers are the compiled R rows', whatever the problem.
    A shape whose threads do not fit a core's registers is an error
    (metal_cost_model.residency)."""
    rows = rows or decode_shapes(1, 1, 1, 1024, d)["group"]["rows"]
    problem = (1, rows, 1, 1024, d, MODEL_GPU, 2, rows)
    prefetch = decode_prefetch(d, rows, simdgroups, bits, paged)
    if bits is None:
        kernels = cm.our_decode_kernels(*problem, simdgroups=simdgroups, prefetch=prefetch, paged=paged)
    else:
        kernels = cm.our_quantized_decode_kernels(*problem, bits, 64, prefetch=prefetch, simdgroups=simdgroups,
                                                  paged=paged)
    tile = f"{rows_text(rows)}, {simdgroups} simdgroups{', prefetch' if prefetch > 1 else ''}"
    return tile, kernels[0].registers


def kernel_registers(kernel: str) -> tuple[str, str, int]:
    """(family, tile, estimated registers) of a kernel a launch plan names,
    read from its identity (_ext.parse_kernel_id: the one reader of names);
    a kernel the cost model does not describe is an error, so a new kernel
    cannot slip past the register check."""
    from mlx_attn import _ext

    kernel_id = _ext.parse_kernel_id(kernel)
    if kernel_id is None:
        raise ValueError(f"the cost model has no register estimate for {kernel} (it spells no kernel)")
    family, f = kernel_id.family, kernel_id.fields
    d, bits, bk = f.get("d"), f.get("b"), f.get("bk")
    if family == "prefill_split":
        return "prefill (D-split)", f"BK {bk}", cm.split_prefill_registers(d, f["dv"], bk)
    if family == "prefill":
        return "prefill", f"BK {bk}", cm.steel_registers(cm.our_prefill_tile(d, bk, "fast"))
    if family == "quantized_prefill":
        return f"quantized prefill ({bits}-bit)", f"BK {bk}", cm.steel_registers(
            cm.our_prefill_tile(d, bk, "fast"), staging_registers=bits + 4)
    decode_names = {"decode_partial": "decode", "paged_decode_partial": "paged decode",
                    "quantized_decode_partial": f"quantized decode ({bits}-bit)",
                    "paged_quantized_decode_partial": f"paged quantized decode ({bits}-bit)"}
    if family in decode_names:
        return (decode_names[family],) + decode_partial_registers(
            d, bits, f["r"], f["sg"], paged=family.startswith("paged"))
    if family == "paged_prefill":
        # the prefill's tiles; its key rows are located between blocks (threadgroup memory), not in the MMA phases
        return "paged prefill", f"BK {bk}", cm.steel_registers(cm.our_prefill_tile(d, bk, "fast"))
    if family in ("backward_split_dkdv", "backward_split_dq"):
        pass_name = family.removeprefix("backward_split_")
        return f"backward {pass_name} (D-split)", "C 64", cm.backward_split_registers(pass_name)
    if family in ("backward_dkdv", "backward_dq"):
        pass_name = family.removeprefix("backward_")
        regs = cm.backward_dkdv_registers(d) if pass_name == "dkdv" else cm.backward_dq_registers(d)
        return f"backward {pass_name}", "rows in registers", regs
    if family in ("decode_merge", "paged_decode_merge"):
        (_, merge) = cm.our_decode_kernels(1, 1, 1, 1024, d, MODEL_GPU, 2, 1, lane_merge=True)
        return "decode_merge", f"{cm.MERGE_SIMDGROUPS} simdgroups", merge.registers
    if family in ("backward_delta", "backward_sinks"):
        return family, "-", 24
    raise ValueError(f"the cost model has no register estimate for {kernel}")


@functools.lru_cache(maxsize=None)
def _zero_quantized_kv(d: int, bits: int) -> tuple:
    """512 zero keys of head dim d as mx.quantize's triple (groups of 64):
    the plans only read their shapes and dtypes."""
    return tuple(mx.quantize(mx.zeros((1, 1, 512, d), mx.float32), group_size=64, bits=bits))


def planned_kernels(d: int, dv: int, dtype, family: str) -> list:
    """The kernels our plans pick for one head-dim pair and dtype: decode
    (Tq = 1), prefill (Tq = 512, causal), the backward of the prefill, and
    both over quantized K/V; the paged kernels (paged_planned_kernels)."""
    from mlx_attn import _ext

    names = []
    for q_len, kv_len in ((1, 512), (1, 16384), (512, 512)):  # decode: the row shape, then the group shape
        q = mx.zeros((1, 4, q_len, d), dtype)
        k = mx.zeros((1, 1, kv_len, d), dtype)
        v = mx.zeros((1, 1, kv_len, dv), dtype)
        problem = _ext.describe_attention(q, k, v, scale=d**-0.5, causal=True, window_size=0, mask=None, sinks=None,
                                          output_lse=False, softcap=0.0)
        plan = _ext.metal_launch_plan(problem, gpu_family=family, gpu_cores=0)
        names += [dispatch.kernel for dispatch in plan.dispatches]
        if q_len > 1:
            backward = _ext.metal_backward_launch_plan(problem)
            names += [dispatch.kernel for dispatch in backward.dispatches]
        if kv_len == 512 and d == dv and d % 64 == 0 and d <= 512:  # over 4- and 8-bit K/V (mx.quantize triples, groups of 64)
            from mlx_attn.quantized import quantized_launch_plan

            for bits, shape in itertools.product((4, 8), ("group", "row")):
                codes, scales, biases = _zero_quantized_kv(d, bits)
                kq = (codes, scales.astype(dtype), biases.astype(dtype))
                plan = quantized_launch_plan(q, kq, kq, scale=d**-0.5, mask="causal", bits=bits, group_size=64,
                                             gpu_family=family, decode_shape=shape)
                if plan.supported:
                    names += [dispatch.kernel for dispatch in plan.dispatches]
    return names + paged_planned_kernels(d, dv, dtype, family)


def paged_planned_kernels(d: int, dv: int, dtype, family: str) -> list:
    """The paged plans' kernels (decode partial in both shapes and the merge,
    the prefill; over 4- and 8-bit pages too) for a head-dim pair and dtype,
    where the paged kernels support it: a decode row over 5000 keys beside
    a 40-row chunk."""
    from mlx_attn import _ext

    page = 16
    q = mx.zeros((41, 4, d), dtype)
    table = mx.zeros((2, 5000 // page + 1), mx.int32)
    pages = 2 * (5000 // page + 1)
    options = dict(scale=d**-0.5, gpu_family=family, gpu_cores=0)
    names = []
    if d != dv:
        return names
    k = mx.zeros((pages, 1, page, d), dtype)
    for shape in ("group", "row"):
        plan = _ext.paged_metal_launch_plan([q, k, k, table], [1, 40], [5000, 100], decode_shape=shape, **options)
        names += [dispatch.kernel for dispatch in plan.dispatches] if plan.supported else []
    for bits, shape in itertools.product((4, 8), ("group", "row")):
        if d % 64:
            continue
        scales = mx.zeros((pages, 1, page, d // 64), dtype)
        triple = [mx.zeros((pages, 1, page, d * bits // 32), mx.uint32), scales, scales]
        plan = _ext.paged_metal_launch_plan([q, *triple, *triple, table], [1, 40], [5000, 100], bits=bits,
                                            group_size=64, decode_shape=shape, **options)
        names += [dispatch.kernel for dispatch in plan.dispatches] if plan.supported else []
    return names


def register_table() -> list:
    """Estimated registers of every kernel the plans pick (forward decode
    and prefill, backward) at every head-dim pair, fp16 and fp32, on apple8
    and apple9 (their key blocks differ), against the budget."""
    rows = {}
    for d, dv in PLANNED_HEAD_DIMS:
        for dtype in (mx.float16, mx.float32):
            for family in ("apple8", "apple9"):
                for kernel in planned_kernels(d, dv, dtype, family):
                    kind, tile, regs = kernel_registers(kernel)
                    rows[(kind, f"{d}/{dv}" if dv != d else str(d), tile)] = regs
    return [(kind, dims, tile, regs) for (kind, dims, tile), regs in rows.items()]


def backward_model_rows(gpu=MODEL_GPU, t: int = 2048, heads: int = 32) -> list:
    """The backward's dispatches by the model (T = Tq = Tkv, H = Hkv, fp16):
    the plan's routing (now); at D = 128 also the register-resident dK/dV
    it replaced and a D-split dQ (the model's alternative, not built)."""
    from mlx_attn import _ext

    rows = []
    for d in (64, 128, 256):
        for causal in (False, True):
            q = mx.zeros((1, heads, t, d), mx.float16)
            problem = _ext.describe_attention(q, q, q, scale=d**-0.5, causal=causal, window_size=0, mask=None,
                                              sinks=None, output_lse=False, softcap=0.0)
            kernels = [k.kernel for k in _ext.metal_backward_launch_plan(problem).dispatches]
            split_keys = any("split_dkdv" in k for k in kernels)
            split_queries = any("split_dq" in k for k in kernels)
            variants = {"plan (now)": (split_keys, split_queries)}
            if d == 128:  # the routing before the D-split dK/dV, and a D-split dQ (modelled, not instantiated)
                variants["dK/dV in registers (before)"] = (False, split_queries)
                variants["dQ D-split (model only)"] = (split_keys, True)
            for name, (sk, sq) in variants.items():
                dispatches = cm.backward_kernels(d, d, t, t, heads, heads, causal, gpu, sk, sq)
                parts = [cm.predict(k, gpu) for k in dispatches]
                rows.append({"D": d, "causal": causal, "variant": name,
                             "dkdv": "D-split" if sk else "registers", "dq": "D-split" if sq else "registers",
                             "registers": [k.registers for k in dispatches[1:]],
                             "us": [p["seconds"] * 1e6 for p in parts[1:]],
                             "total_us": sum(p["seconds"] for p in parts) * 1e6})
    return rows


# The decode rule checks' grid of problems (batch 1): GPU, head dim, KV
# heads, GQA group, keys; and the split counts a problem's best is sought over.
DECODE_RULE_GRID = ((cm.M2, cm.M2_MAX), (64, 128), (1, 2, 8, 32), (1, 4, 8), (256, 1024, 4096, 16384))
SPLIT_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def ratio_summary(ratios: dict) -> dict:
    """Per rule: geometric mean and worst of its times over the best and over
    MLX's, and the problem count."""
    return {name: {"geomean": float(np.exp(np.mean(np.log(r["best"])))), "max": max(r["best"]),
                   "mlx_geomean": float(np.exp(np.mean(np.log(r["mlx"])))), "mlx_max": max(r["mlx"]),
                   "problems": len(r["best"])} for name, r in ratios.items()}


def decode_rule_check() -> dict:
    """The plan's decode rule (shape and split count, now), the group shape
    alone as it was (its rows uncapped) with its split rule (before the row
    shape) and the rule before issue #23 (64 keys per row), by the model over
    a grid of problems on M2 and M2 Max: geometric means of predicted time
    over the best shape and split count per problem (either shape now, or
    the uncapped group shape), and over MLX's sdpa_vector."""
    ratios = {name: {"best": [], "mlx": []} for name in ("now", "group", "before")}
    for gpu, d, kv_heads, group, t in itertools.product(*DECODE_RULE_GRID):
        heads = kv_heads * group
        shapes = decode_shapes(1, kv_heads, group, t, d, gpu)

        def seconds(splits, shape):
            kernels = cm.our_decode_kernels(1, heads, kv_heads, t, d, gpu, splits, shape["rows"],
                                            simdgroups=shape["simdgroups"],
                                            prefetch=decode_prefetch(d, shape["rows"], shape["simdgroups"]),
                                            single_dispatch=True, lane_merge=True)
            return cm.predict_all(kernels, gpu)["seconds"]

        former = {"rows": group_only_rows(d), "simdgroups": 4}  # the group shape before the cap
        best = min(seconds(s, shape) for shape in (*shapes.values(), former) for s in SPLIT_COUNTS)
        chosen = chosen_shape(shapes)
        chunks = -(-group // former["rows"])
        old = previous_decode_splits(group, t, kv_heads * chunks, gpu.cores)
        mlx = cm.predict_all(mlx_decode_kernels(1, heads, kv_heads, t, d, gpu), gpu)["seconds"]
        for name, value in (("now", seconds(chosen["splits"], chosen)),
                            ("group", seconds(group_only_splits(group, t, kv_heads, d, gpu.cores), former)),
                            ("before", seconds(old, former))):
            ratios[name]["best"].append(value / best)
            ratios[name]["mlx"].append(value / mlx)
    return ratio_summary(ratios)


def quantized_decode_prediction(batch: int, heads: int, kv_heads: int, t: int, d: int, gpu, splits: int, shape: dict,
                             bits: int, group_size: int) -> dict:
    """The model's prediction for our quantized decode on `shape` (rows,
    simdgroups) with `splits` splits, one dispatch at one split."""
    return cm.predict_all(cm.our_quantized_decode_kernels(
        batch, heads, kv_heads, t, d, gpu, splits, shape["rows"], bits, group_size,
        prefetch=decode_prefetch(d, shape["rows"], shape["simdgroups"], bits=bits), single_dispatch=True,
        simdgroups=shape["simdgroups"]), gpu)


def previous_quantized_shape(float_shapes: dict, rows: int) -> dict:
    """The quantized plan's shape and splits before their split rule over
    dequantized keys, from the float rule's decode_shapes: its splits, and
    its shape but the row shape at one row per KV head."""
    return float_shapes["row"] if rows == 1 else chosen_shape(float_shapes)


def quantized_rule_check(bits: int = 4, group_size: int = 64) -> dict:
    """The quantized plan's rule (the float rule over dequantized keys: a
    quarter of the keys per split, at most one wave of row-shape splits, one
    row per KV head on the row shape, "now") against the same with the float rule's
    splits ("float splits", the rule before) and the float rule as it stands
    ("float rule"), by the model over decode_rule_check's grid of problems
    on 4-bit K/V: geometric means (and worst) of predicted time over the
    best shape and split count per problem, and over sdpa_vector on the
    dequantized fp16 K/V."""
    ratios = {name: {"best": [], "mlx": []} for name in ("now", "float splits", "float rule")}
    for gpu, d, kv_heads, group, t in itertools.product(*DECODE_RULE_GRID):
        heads = kv_heads * group

        def seconds(splits, shape):
            return quantized_decode_prediction(1, heads, kv_heads, t, d, gpu, splits, shape, bits, group_size)["seconds"]

        float_shapes = decode_shapes(1, kv_heads, group, t, d, gpu)
        best = min(seconds(s, shape) for shape in float_shapes.values() for s in SPLIT_COUNTS)
        mlx = cm.predict_all(mlx_decode_kernels(1, heads, kv_heads, t, d, gpu), gpu)["seconds"]
        for name, chosen in (
                ("now", chosen_shape(decode_shapes(1, kv_heads, group, t, d, gpu, dequantized=True))),
                ("float splits", previous_quantized_shape(float_shapes, group)),
                ("float rule", chosen_shape(float_shapes))):
            value = seconds(chosen["splits"], chosen)
            ratios[name]["best"].append(value / best)
            ratios[name]["mlx"].append(value / mlx)
    return ratio_summary(ratios)


def tile_validation(gpu=MODEL_GPU, t: int = 2048, heads: int = 32) -> list:
    """Every steel tile MLX's kernel compiles for (that fits 32 KB), ranked
    by the model, with MLX's own choice marked."""
    rows = []
    for d in (64, 128):
        mlx_tile = cm.mlx_steel_tile(d)
        ranked = []
        for tile in cm.steel_alternatives(d, gpu=gpu):
            kernel = cm.prefill_kernel("steel", tile, 1, heads, heads, t, t, False, gpu)
            ranked.append((cm.predict(kernel, gpu)["seconds"], tile, kernel))
        ranked.sort(key=lambda r: r[0])
        best = ranked[0][0]
        rank = next(i for i, r in enumerate(ranked) if (r[1].bq, r[1].bk, r[1].wm, r[1].wn) ==
                    (mlx_tile.bq, mlx_tile.bk, mlx_tile.wm, mlx_tile.wn))
        rows.append({"D": d, "mlx_tile": f"bq{mlx_tile.bq} bk{mlx_tile.bk} wm{mlx_tile.wm} wn{mlx_tile.wn}",
                     "mlx_rank": rank + 1, "tiles": len(ranked), "mlx_over_best": ranked[rank][0] / best,
                     "best": f"bq{ranked[0][1].bq} bk{ranked[0][1].bk} wm{ranked[0][1].wm} wn{ranked[0][1].wn}",
                     "worst_over_best": ranked[-1][0] / best})
    return rows


def prefill_structure_floor(gpu=MODEL_GPU, t: int = 2048, heads: int = 32) -> list:
    """Issue #23's prefill target (predicted time <= 0.9x steel's, D 64 and
    128, fp16, T = 2048, causal and not) against the best time the model
    predicts for any tile of our prefill kernel's structure that fits the
    register budget and 32 KB of threadgroup memory: BQ 32/64/128 rows on
    2/4/8 simdgroups (one to four 8-row tiles per simdgroup, each K and V
    fragment read once for all of them, which today's kernel, one tile per
    simdgroup, cannot use), BK 8-64, Q in registers or in threadgroup
    memory, K and V staged together or in turn; the lazy max and fast exp2
    of today's kernel. Optimistic where the model is (it charges none of the
    larger tiles' bank conflicts or scheduling), so a floor."""
    rows = []
    for d in (64, 128):
        for causal in (False, True):
            def seconds(tile: cm.PrefillTile) -> float:
                return cm.predict(cm.prefill_kernel("x", tile, 1, heads, heads, t, t, causal, gpu), gpu)["seconds"]

            steel = seconds(cm.mlx_steel_tile(d))
            bk_now = _plan_field(planned(t, t, d, heads, heads, causal, gpu), "bk")
            now = seconds(cm.our_prefill_tile(d, bk_now, "fast"))
            best = None
            for bq, wm, bk, q_in_registers, together in itertools.product(
                    (32, 64, 128), (2, 4, 8), (8, 16, 32, 64), (True, False), (True, False)):
                if bq % (8 * wm) or bq // (8 * wm) > 4:
                    continue
                tile = cm.PrefillTile(bq, bk, d, wm, 1, q_in_registers=q_in_registers, stage_kv_together=together,
                                      reduce_per_fragment=False, lazy_max=True, shared_value_fragments=True)
                if (cm.steel_registers(tile) > gpu.register_budget
                        or cm.steel_threadgroup_memory(tile) > gpu.max_threadgroup_memory):
                    continue
                candidate = (seconds(tile), tile)
                if best is None or candidate[0] < best[0]:
                    best = candidate
            tile = best[1]
            row_tiles = tile.bq // (8 * tile.wm)
            rows.append({"D": d, "causal": causal, "steel_us": steel * 1e6, "now": now / steel,
                         "floor": best[0] / steel, "registers": cm.steel_registers(tile),
                         "tile": f"BQ {tile.bq}, {tile.wm} simdgroups ({row_tiles} row tile{'s' if row_tiles > 1 else ''} "
                                 "each), "
                                 f"BK {tile.bk}, Q in {'registers' if tile.q_in_registers else 'threadgroup memory'}, "
                                 f"K/V {'together' if tile.stage_kv_together else 'in turn'}"})
    return rows


def decode_validation(gpu=MODEL_GPU) -> list:
    """sdpa_vector's one pass against MLX's alternative, its two passes, on
    the problems where MLX's host code picks the one pass (< 4096 keys)."""
    rows = []
    for kv_heads, group, t in ((8, 4, 1024), (8, 4, 2048), (32, 1, 2048)):
        heads = kv_heads * group
        one = cm.predict_all(cm.sdpa_vector_kernels(1, heads, kv_heads, t, 128, gpu, False), gpu)["seconds"]
        two = cm.predict_all(cm.sdpa_vector_kernels(1, heads, kv_heads, t, 128, gpu, True,
                                                    64 if group >= 4 else 32), gpu)["seconds"]
        rows.append({"Hkv": kv_heads, "group": group, "T": t, "one_pass_us": one * 1e6, "two_pass_us": two * 1e6})
    return rows


def throughput_check(gpu=cm.M3_MAX, t: int = 4096, heads: int = 32) -> dict:
    kernel = cm.prefill_kernel("steel", cm.mlx_steel_tile(64), 1, heads, heads, t, t, False, gpu)
    seconds = cm.predict(kernel, gpu)["seconds"]
    tflops = 4.0 * heads * t * t * 64 / seconds / 1e12
    return {"gpu": gpu.name, "T": t, "heads": heads, "predicted_tflops": tflops, "public_tflops": PUBLIC_PREFILL_TFLOPS,
            "ratio": tflops / PUBLIC_PREFILL_TFLOPS, "peak_tflops": gpu.peak_flops / 1e12}


QUANTIZED_PREFILL_TARGET = 1.2  # issue #23: quantized prefill <= 1.2x dequantize-then-steel (modelled)


def quantized_prefill_key_block(d: int, bits: int, group_size: int, gpu=MODEL_GPU, t: int = 2048) -> int:
    """BK of the quantized prefill kernel our plan picks for the GPU
    (csrc/metal/quantized_launch_plan.cpp, through the extension)."""
    from mlx_attn import _ext

    q = mx.zeros((1, 1, t, d), mx.float16)
    k = mx.zeros((1, 1, t, d), mx.float16)
    kq = [a.astype(mx.float16) if a.dtype != mx.uint32 else a for a in mx.quantize(k, group_size=group_size, bits=bits)]
    plan = _ext.quantized_metal_launch_plan(q, kq, kq, bits=bits, group_size=group_size, gpu_family=gpu.family)
    return _plan_field(plan, "bk", "quantized_prefill")


def quantized_prefill_rows(gpu=MODEL_GPU, t: int = 2048, heads: int = 32, kv_heads: int = 8,
                           group_size: int = 64) -> list:
    """Quantized K/V prefill, predicted: our quantized prefill kernel (now),
    the quantized decode structure it replaces on prefill rows (before), and
    MLX's dequantize-then-steel (two mx.dequantize dispatches writing fp16
    K/V, then steel_attention), fp16, D 64/128, 4 and 8 bits."""
    rows = []
    for d in (64, 128):
        for bits in (4, 8):
            bk = quantized_prefill_key_block(d, bits, group_size, gpu, t)
            for causal in (False, True):
                problem = (1, heads, kv_heads, t, t, causal, gpu)
                base = cm.predict_all(cm.dequantize_then_steel_kernels(d, bits, group_size, *problem), gpu)
                variants = {
                    "dequantize-then-steel (MLX)": base,
                    "quantized decode structure (before)": cm.predict_all(cm.quantized_decode_structure_kernels(
                        1, heads, kv_heads, t, t, d, bits, group_size, causal, gpu), gpu),
                    f"quantized prefill, BK {bk} (now)": cm.predict_all([cm.quantized_prefill_kernel(
                        "attention_quantized_prefill", d, bk, bits, group_size, *problem)], gpu),
                }
                for name, r in variants.items():
                    rows.append({"D": d, "bits": bits, "causal": causal, "T": t, "kernels": name,
                                 "seconds": r["seconds"], "ratio": r["seconds"] / base["seconds"],
                                 "registers": r["registers"], "spills": r["spills"], "dispatches": r["dispatches"],
                                 "bound": r["bound"]})
    return rows


# Decode problems where the split rule gives one split on the model's GPU:
# (batch, KV heads, GQA group, T) at D = 128; short T, or a batch that fills
# the GPU by itself.
QUANTIZED_ONE_SPLIT_PROBLEMS = ((1, 8, 4, 64), (1, 8, 8, 128), (1, 32, 1, 64), (64, 8, 4, 1024))


def quantized_decode_rows(gpu=MODEL_GPU, d: int = 128, group_size: int = 64) -> list:
    """Our quantized decode (metal/attention_quantized.h) before (partial +
    merge, always) and now (one dispatch at one split), by the model, next to
    MLX's sdpa_vector on the dequantized fp16 K/V, on the group shape with
    the float rule's split count (one split; the plan's shape and splits for
    these problems today: quantized_shape_rows)."""
    rows = []
    for batch, kv_heads, group, t in QUANTIZED_ONE_SPLIT_PROBLEMS:
        heads = kv_heads * group
        group_shape = decode_shapes(batch, kv_heads, group, t, d, gpu)["group"]
        splits, rows_per_tg = group_shape["splits"], group_shape["rows"]
        mlx = cm.predict_all(mlx_decode_kernels(batch, heads, kv_heads, t, d, gpu), gpu)["seconds"]
        for bits in (4, 8):
            ours = {when: cm.predict_all(cm.our_quantized_decode_kernels(
                batch, heads, kv_heads, t, d, gpu, splits, rows_per_tg, bits, group_size,
                prefetch=decode_prefetch(d, rows_per_tg, bits=bits),
                single_dispatch=single), gpu) for when, single in (("before", False), ("now", True))}
            rows.append({"B": batch, "Hkv": kv_heads, "group": group, "T": t, "D": d, "bits": bits,
                         "group_size": group_size, "splits": splits, "mlx_us": mlx * 1e6,
                         **{f"{when}_{key}": value for when, p in ours.items()
                            for key, value in (("us", p["seconds"] * 1e6), ("dispatches", p["dispatches"]),
                                               ("registers", p["registers"]), ("bound", p["bound"]))}})
    return rows


# Quantized decode problems at D = 128 (batch, KV heads, GQA group, T):
# short and mid contexts of one sequence, where the shape decides.
QUANTIZED_SHAPE_PROBLEMS = ((1, 8, 4, 128), (1, 8, 4, 1024), (1, 8, 1, 1024), (1, 32, 1, 2048), (1, 8, 4, 4096),
                            (4, 8, 4, 1024), (1, 8, 1, 4096), (1, 8, 1, 16384))


def quantized_shape_rows(gpu=MODEL_GPU, d: int = 128, bits: int = 4, group_size: int = 64) -> list:
    """The quantized decode by the model: before, the plan's shape with the
    float rule's splits (previous_quantized_shape); now, the plan's shape and
    splits (decode_shape and decode_splits over dequantized keys); next to
    sdpa_vector on the dequantized fp16 K/V."""
    rows = []
    for batch, kv_heads, group, t in QUANTIZED_SHAPE_PROBLEMS:
        heads = kv_heads * group
        mlx = cm.predict_all(mlx_decode_kernels(batch, heads, kv_heads, t, d, gpu), gpu)["seconds"]
        row = {"B": batch, "Hkv": kv_heads, "group": group, "T": t, "mlx_us": mlx * 1e6}
        float_shapes = decode_shapes(batch, kv_heads, group, t, d, gpu)
        for when, shape in (("before", previous_quantized_shape(float_shapes, group)),
                            ("now", chosen_shape(decode_shapes(batch, kv_heads, group, t, d, gpu, dequantized=True)))):
            p = quantized_decode_prediction(batch, heads, kv_heads, t, d, gpu, shape["splits"], shape, bits, group_size)
            row[when] = {**shape, "us": p["seconds"] * 1e6, "registers": p["registers"], "bound": p["bound"]}
        rows.append(row)
    return rows


# Paged decode batches at D = 128, pages of 16 keys: (sequences, KV heads,
# GQA group, keys per sequence); every sequence one decode row.
PAGED_DECODE_PROBLEMS = ((1, 8, 4, 128), (1, 8, 4, 1024), (1, 8, 4, 4096), (1, 8, 1, 1024), (1, 32, 1, 2048),
                         (4, 8, 4, 1024), (16, 8, 4, 1024))
PAGED_PAGE_SIZE = 16


def paged_decode_plan(sequences: int, kv_heads: int, group: int, t: int, d: int, decode_shape: str,
                      gpu=MODEL_GPU) -> dict:
    """The paged plan's decode shape (rows, simdgroups) and splits for a
    uniform decode batch (csrc/metal/paged_launch_plan.cpp, through the extension)."""
    from mlx_attn import _ext

    pages = sequences * -(-t // PAGED_PAGE_SIZE)
    q = mx.zeros((sequences, kv_heads * group, d), mx.float16)
    k = mx.zeros((pages, kv_heads, PAGED_PAGE_SIZE, d), mx.float16)
    table = mx.zeros((sequences, pages // sequences), mx.int32)
    plan = _ext.paged_metal_launch_plan([q, k, k, table], [1] * sequences, [t] * sequences, scale=0.1,
                                        gpu_family=gpu.family, gpu_cores=gpu.cores, decode_shape=decode_shape)
    return plan_decode_shape(plan)


def paged_decode_rows(gpu=MODEL_GPU, d: int = 128) -> list:
    """The paged decode on float pages by the model: before, the group shape
    alone; now, the plan's shape (the dense rule under the page window's cap);
    next to sdpa_vector on the same keys contiguous."""
    rows = []
    for sequences, kv_heads, group, t in PAGED_DECODE_PROBLEMS:
        heads = kv_heads * group
        mlx = cm.predict_all(mlx_decode_kernels(sequences, heads, kv_heads, t, d, gpu), gpu)["seconds"]
        row = {"B": sequences, "Hkv": kv_heads, "group": group, "T": t, "mlx_us": mlx * 1e6}
        for when, shape in (("before", "group"), ("now", "auto")):
            plan = paged_decode_plan(sequences, kv_heads, group, t, d, shape, gpu)
            p = cm.predict_all(cm.our_decode_kernels(
                sequences, heads, kv_heads, t, d, gpu, plan["splits"], plan["rows"], simdgroups=plan["simdgroups"],
                prefetch=decode_prefetch(d, plan["rows"], plan["simdgroups"], paged=True), single_dispatch=True,
                lane_merge=True, paged=True), gpu)
            row[when] = {**plan, "us": p["seconds"] * 1e6, "registers": p["registers"], "bound": p["bound"]}
        rows.append(row)
    return rows
