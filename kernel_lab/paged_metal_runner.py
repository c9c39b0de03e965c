"""Run the fused Metal paged attention the way the Mac host does: from the C++
launch plan (csrc/metal/paged_launch_plan.cpp, _ext.paged_metal_launch_plan), every
dispatch in the MSL emulator with the bindings the plan names; and a float64
NumPy oracle of paged attention that shares no code with mlx_attn."""

from __future__ import annotations

import re

import mlx.core as mx
import numpy as np

from mlx_attn import _native

from kernel_lab.metal_runner import REPO, from_numpy, nan_filled, run_plan, to_numpy

# the decode kernels (and their merge), the prefill kernel, the quantized decode
FLOAT_SOURCES = [REPO / "metal" / "attention_paged.metal", REPO / "metal" / "attention_paged_prefill.metal"]
QUANTIZED_SOURCES = FLOAT_SOURCES + [REPO / "metal" / "attention_paged_quantized.metal"]
# cascade attention's prefix pass (its suffix pass and merge are the paged decode's)
CASCADE_SOURCE = REPO / "metal" / "attention_paged_cascade.metal"


def paged_shape_numbers(d: int) -> tuple[int, int]:
    """(the group shape's rows, the row shape's simdgroups) at head dim d, as
    d's MLX_ATTN_PAGED_TYPES line in metal/attention_paged.metal names them
    (the float and quantized paged decodes instantiate the same shapes)."""
    match = re.search(rf"^MLX_ATTN_PAGED_TYPES\({d}, (\d+), (\d+)\)$", FLOAT_SOURCES[0].read_text(), flags=re.M)
    if match is None:
        raise ValueError(f"metal/attention_paged.metal does not instantiate the paged decode at D = {d}")
    return int(match.group(1)), int(match.group(2))


def paged_instantiation(dtype_args: str, d: int) -> str:
    """The float paged decode's instantiation line (the partial kernel in both
    threadgroup shapes, and the merge) for one dtype ("float32, float") at
    head dim d: for builds trimmed to what a test uses."""
    rows, simdgroups = paged_shape_numbers(d)
    return f"MLX_ATTN_PAGED({dtype_args}, {d}, {rows}, {simdgroups})"


def trimmed_sources(directory, float_instances, quantized_instances=(), prefill_instances=(),
                    cascade_instances=()) -> list:
    """The paged .metal sources with only these instantiations (quick builds):
    float_instances "tname, type, d" (MLX_ATTN_PAGED, both shapes:
    paged_instantiation), quantized_instances "tname, type, d, bits"
    (MLX_ATTN_PAGED_QUANTIZED), prefill_instances "tname, type, d, bk"
    (MLX_ATTN_PAGED_PREFILL), cascade_instances "tname, type, d, bk" (float
    pages) or "tname, type, d, bits, bk" (the cascade prefix kernels)."""
    float_lines, quantized_lines = [], []
    for instance in float_instances:
        tname, type_, d = (part.strip() for part in instance.split(","))
        float_lines.append(paged_instantiation(f"{tname}, {type_}", int(d)))
    for instance in quantized_instances:
        tname, type_, d, bits = (part.strip() for part in instance.split(","))
        rows, simdgroups = paged_shape_numbers(int(d))
        quantized_lines.append(f"MLX_ATTN_PAGED_QUANTIZED({tname}, {type_}, {d}, {bits}, {rows}, {simdgroups})")
    paths = []
    cascade_lines = [f"MLX_ATTN_PAGED_CASCADE_{'QUANTIZED_' if i.count(',') == 4 else ''}PREFIX({i})"
                     for i in cascade_instances]
    for source, lines in ((FLOAT_SOURCES[0], float_lines),
                          (FLOAT_SOURCES[1], [f"MLX_ATTN_PAGED_PREFILL({i})" for i in prefill_instances]),
                          (QUANTIZED_SOURCES[2], quantized_lines), (CASCADE_SOURCE, cascade_lines)):
        if not lines:
            continue
        text = re.sub(r"^MLX_ATTN_PAGED(_QUANTIZED|_PREFILL|_CASCADE)?_(TYPES|BITS|2BYTE_TYPES)\(.*\)$", "",
                      source.read_text(), flags=re.M)
        path = directory / source.name
        path.write_text(text + "\n" + "\n".join(lines) + "\n")
        paths.append(path)
    return paths


def paged_plan(arrays: list, q_lens, kv_lens, *, scale, causal=True, window_size=None, has_sinks=False,
               return_lse=False, bits=0, group_size=0, gpu_target: dict | None = None, softcap=None,
               decode_shape: str = "auto"):
    return _native.ext.paged_metal_launch_plan(
        arrays, [int(x) for x in q_lens], [int(x) for x in kv_lens], scale=scale, causal=causal,
        window_size=window_size or 0, has_sinks=has_sinks, output_lse=return_lse, bits=bits, group_size=group_size,
        softcap=softcap or 0.0, decode_shape=decode_shape, **(gpu_target or {}))


# byte offset of AttentionParams::vector_loads (metal/attention_params.h: 17
# int64 fields, then int32 fields; vector_loads is the 13th)
VECTOR_LOADS_OFFSET = 17 * 8 + 12 * 4


class _WithSequences:
    """A launch plan (read-only) seen with other PagedSequence bytes."""

    def __init__(self, plan, sequences: bytes):
        self._plan, self.sequences = plan, sequences

    def __getattr__(self, name):
        return getattr(self._plan, name)


def scalar_loads(plan):
    """The plan with every sequence's vector_loads cleared: the kernels' element
    by element path (what unaligned or strided pages take) on the same arrays."""
    data = bytearray(plan.sequences)
    size = _native.ext.PAGED_SEQUENCE_BYTES
    for at in range(0, len(data), size):
        data[at + VECTOR_LOADS_OFFSET:at + VECTOR_LOADS_OFFSET + 4] = (0).to_bytes(4, "little")
    return _WithSequences(plan, bytes(data))


def run_paged(library, q, k_parts, v_parts, block_table, q_lens, kv_lens, *, scale, causal=True, window_size=None,
              sinks=None, return_lse=False, bits=0, group_size=0, gpu_target=None, softcap=None, vector_loads=True,
              decode_shape="auto"):
    """Launches the plan of these (contiguous) arrays in `library`: k_parts /
    v_parts are [pages] or the (packed, scales, biases) triples;
    vector_loads=False takes the element by element path; decode_shape
    "group" / "row" names the decode kernel's shape (float pages). Returns
    (out, lse or None, plan, per-dispatch results); out and lse are NumPy
    (bfloat16 as uint16 bits), NaN wherever no kernel wrote."""
    arrays = [q, *k_parts, *v_parts, block_table] + ([sinks] if sinks is not None else [])
    plan = paged_plan(arrays, q_lens, kv_lens, scale=scale, causal=causal, window_size=window_size,
                      has_sinks=sinks is not None, return_lse=return_lse, bits=bits, group_size=group_size,
                      gpu_target=gpu_target, softcap=softcap, decode_shape=decode_shape)
    assert plan.supported, plan.reason
    if not vector_loads:
        plan = scalar_loads(plan)
    memory = [np.ascontiguousarray(to_numpy(a)).reshape(-1) for a in arrays]
    total_q, heads, d = q.shape
    out = nan_filled((total_q, heads, d), memory[0].dtype)
    lse = np.full((total_q, heads), np.nan, np.float32)
    results = run_plan(library, plan, memory, [out, lse] if return_lse else [out])
    return out, (lse if return_lse else None), plan, results


def cascade_plan(arrays: list, q_lens, own_kv_lens, prefix_lens, prefix_groups, *, scale, causal=True,
                 window_size=None, has_sinks=False, return_lse=False, bits=0, group_size=0,
                 gpu_target: dict | None = None, softcap=None):
    """The C++ cascade plan (csrc/metal/paged_launch_plan.cpp
    plan_cascade_paged_attention) of the primitive's inputs: the paged inputs
    with the own pages' block table, then the prefix table."""
    return _native.ext.cascade_metal_launch_plan(
        arrays, [int(x) for x in q_lens], [int(x) for x in own_kv_lens], [int(x) for x in prefix_lens],
        [int(x) for x in prefix_groups], scale=scale, causal=causal, window_size=window_size or 0,
        has_sinks=has_sinks, output_lse=return_lse, bits=bits, group_size=group_size, softcap=softcap or 0.0,
        **(gpu_target or {}))


def own_lengths(kv_lens, prefix_lens, prefix_groups) -> list[int]:
    """Each sequence's keys after its group's prefix."""
    return [int(n) - (int(prefix_lens[g]) if g >= 0 else 0) for n, g in zip(kv_lens, prefix_groups)]


def full_table(own_table, prefix_table, prefix_lens, prefix_groups, kv_lens, page_size) -> np.ndarray:
    """The block table of the equivalent paged call: each sequence's group
    prefix pages, then its own pages (-1 past them)."""
    own_table, prefix_table = np.asarray(own_table), np.asarray(prefix_table)
    rows = []
    for b, g in enumerate(prefix_groups):
        shared = list(prefix_table[g, : -(-int(prefix_lens[g]) // page_size)]) if g >= 0 else []
        own = own_lengths(kv_lens, prefix_lens, prefix_groups)[b]
        rows.append(shared + list(own_table[b, : -(-own // page_size)]))
    width = max(1, max(len(r) for r in rows))
    return np.array([r + [-1] * (width - len(r)) for r in rows], np.int32)


def run_cascade(library, q, k_parts, v_parts, own_table, prefix_table, q_lens, kv_lens, prefix_lens, prefix_groups, *,
                scale, causal=True, window_size=None, sinks=None, return_lse=False, bits=0, group_size=0,
                gpu_target=None, softcap=None):
    """Launches the cascade plan in `library` (kv_lens: every key of each
    sequence, its group's prefix included). Returns (out, lse or None, plan,
    per-dispatch results) as run_paged."""
    arrays = ([q, *k_parts, *v_parts, own_table] + ([sinks] if sinks is not None else []) + [prefix_table])
    plan = cascade_plan(arrays, q_lens, own_lengths(kv_lens, prefix_lens, prefix_groups), prefix_lens, prefix_groups,
                        scale=scale, causal=causal, window_size=window_size, has_sinks=sinks is not None,
                        return_lse=return_lse, bits=bits, group_size=group_size, gpu_target=gpu_target,
                        softcap=softcap)
    assert plan.supported, plan.reason
    memory = [np.ascontiguousarray(to_numpy(a)).reshape(-1) for a in arrays]
    total_q, heads, d = q.shape
    out = nan_filled((total_q, heads, d), memory[0].dtype)
    lse = np.full((total_q, heads), np.nan, np.float32)
    results = run_plan(library, plan, memory, [out, lse] if return_lse else [out])
    return out, (lse if return_lse else None), plan, results


def as_float(x: np.ndarray, dtype) -> np.ndarray:
    """A kernel output in float64 (bfloat16 comes back as its uint16 bits)."""
    if dtype == mx.bfloat16:
        return np.array(mx.array(x).view(mx.bfloat16).astype(mx.float32), np.float64)
    return x.astype(np.float64)


def oracle(q, k_pages, v_pages, block_table, q_lens, kv_lens, *, scale, causal=True, window_size=None, sinks=None,
           softcap=None):
    """Paged attention in float64 NumPy, key by key from the block table
    (logits capped as softcap * tanh(logit / softcap) with a softcap):
    (out [total_q, Hq, Dv], lse [total_q, Hq]); rows that see no key give
    zeros (and -inf, or the sink's logit, as lse)."""
    q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
    table = np.asarray(block_table)
    total_q, heads, _ = q.shape
    kv_heads, page_size = k_pages.shape[1], k_pages.shape[2]
    group = heads // kv_heads
    out = np.zeros((total_q, heads, v_pages.shape[3]))
    lse = np.full((total_q, heads), -np.inf)
    start = 0
    for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        keys = np.arange(kv_len)
        pages = table[b, keys // page_size]
        for i in range(q_len):
            pos = kv_len - q_len + i
            visible = np.ones(kv_len, bool)
            if causal or window_size:
                visible &= keys <= pos
            if window_size:
                visible &= keys > pos - window_size
            for h in range(heads):
                k = k_pages[pages, h // group, keys % page_size]
                v = v_pages[pages, h // group, keys % page_size]
                logits = scale * (k @ q[start + i, h])
                if softcap is not None:
                    logits = softcap * np.tanh(logits / softcap)
                logits = np.where(visible, logits, -np.inf)
                if sinks is not None:
                    logits = np.append(logits, float(sinks[h]))
                top = logits.max(initial=-np.inf)
                if np.isneginf(top):
                    continue
                weights = np.exp(logits - top)
                total = weights.sum()
                lse[start + i, h] = top + np.log(total)
                out[start + i, h] = (weights[:kv_len] @ v) / total
        start += q_len
    return out, lse


def device_bytes(counters: list) -> int:
    """Device bytes read and written by a launch's dispatches."""
    return sum(c.device_bytes_read + c.device_bytes_written for c in counters)


def live_kv_bytes(k_pages, kv_lens, *, v_pages=None) -> int:
    """Bytes of the keys and values the sequences hold (each once, shared
    pages counted per sequence as a dense copy would hold them)."""
    _, kv_heads, _, d = k_pages.shape
    dv = d if v_pages is None else v_pages.shape[3]
    return sum(kv_lens) * kv_heads * (d + dv) * k_pages.itemsize


def paged_decode_bytes(library, q, k_pages, v_pages, block_table, q_lens, kv_lens) -> float:
    """Device bytes of the paged kernels (decode partial and merge, and the
    prefill kernel for chunks it takes) per live K/V byte, from a counting
    build."""
    *_, results = run_paged(library, q, [k_pages], [v_pages], block_table, q_lens, kv_lens, scale=0.1, causal=True)
    return device_bytes(results) / live_kv_bytes(k_pages, kv_lens)


def fresh(x: mx.array) -> mx.array:
    """A copy of x in its own contiguous buffer (offset 0), as the dense
    runner binds it."""
    return from_numpy(np.ascontiguousarray(to_numpy(x)), x.dtype)


def sequence_kv(pages: mx.array, table_row, length: int) -> mx.array:
    """One sequence's contiguous [1, Hkv, length, D] from its pages."""
    page_size = pages.shape[2]
    ids = mx.array(np.asarray(table_row)[: (length + page_size - 1) // page_size].astype(np.int32))
    return fresh(mx.flatten(pages[ids].swapaxes(0, 1), 1, 2)[None, :, :length])


def _dense_launch(library, q, k, v):
    """Our dense kernels from their launch plan (kernel_lab/metal_runner.py), counters per dispatch."""
    from kernel_lab.metal_runner import EmulatedMetal

    metal = EmulatedMetal.__new__(EmulatedMetal)
    metal.library, metal.fast_math = library, True
    metal(q, k, v, scale=0.1, mask="causal")
    return metal.last_counters


def dense_decode_bytes(library, q, k_pages, v_pages, block_table, q_lens, kv_lens) -> float:
    """Device bytes per live K/V byte of our dense kernels run on each
    sequence's contiguous K/V (the same live keys, no padding): one launch
    per sequence, decode rows on the dense decode kernel and long chunks on
    the dense prefill kernel, as the dense plan picks."""
    table = np.asarray(block_table)
    total, start = 0, 0
    for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        if q_len:
            rows = fresh(q[start:start + q_len].swapaxes(0, 1)[None])
            k, v = (sequence_kv(pages, table[b], kv_len) for pages in (k_pages, v_pages))
            total += device_bytes(_dense_launch(library, rows, k, v))
        start += q_len
    return total / live_kv_bytes(k_pages, kv_lens)


def padded(q, k_pages, v_pages, block_table, q_lens, kv_lens):
    """The batch padded to a rectangle (decode rows: q_lens all 1):
    q [B, Hq, 1, D], K/V [B, Hkv, max(kv_lens), D] (zeros past each length)."""
    assert all(n == 1 for n in q_lens), "padding is modelled for decode batches"
    longest = max(kv_lens)
    table = np.asarray(block_table)

    def rectangle(pages):
        rows = []
        for b, n in enumerate(kv_lens):
            x = sequence_kv(pages, table[b], n)
            rows.append(mx.pad(x, [(0, 0), (0, 0), (0, longest - n), (0, 0)]))
        return mx.concatenate(rows)

    return fresh(q[:, :, None, :]), rectangle(k_pages), rectangle(v_pages)


def padded_decode_bytes(library, q, k_pages, v_pages, block_table, q_lens, kv_lens) -> float:
    """Our dense decode on the padded rectangle, per live K/V byte."""
    qp, kp, vp = padded(q, k_pages, v_pages, block_table, q_lens, kv_lens)
    return device_bytes(_dense_launch(library, qp, kp, vp)) / live_kv_bytes(k_pages, kv_lens)
