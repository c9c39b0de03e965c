"""MLX's own Metal attention kernels, run in the MSL emulator.

The kernels come from MLX's macOS wheel (``mlx-metal``, fetched once with
``pip download`` into the cache the Mac host check shares,
``$MLX_ATTN_CACHE/mac-host`` or ``~/.cache/mlx_attn/mac-host``): the
headers ``steel_attention.h`` (prefill) and ``sdpa_vector.h`` (decode, one
and two passes). Nothing of MLX is kept in this repository: the
instantiation sources are generated here, and the launchers below follow
what MLX's host code (``scaled_dot_product_attention.cpp``) does: tile
sizes, function constants, buffer indices, grids and threadgroups.

Arrays are NumPy ``[B, H, T, D]``: float32, float16, or bfloat16 as its
``uint16`` bits (as in metal_runner.py).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kernel_lab import msl_emulator as me, wheel_cache

MLX_METAL_VERSION = "0.32.4"
KERNELS = "mlx/include/mlx/backend/metal/kernels"
HEADERS = {"prefill": f"{KERNELS}/steel/attn/kernels/steel_attention.h", "decode": f"{KERNELS}/sdpa_vector.h"}

# numpy dtype -> (MSL type, MLX's type name in kernel names)
TYPES = {np.dtype(np.float32): ("float", "float32"), np.dtype(np.float16): ("half", "float16"),
         np.dtype(np.uint16): ("bfloat16_t", "bfloat16")}
# Head dims MLX instantiates (0.32.4's mlx.metallib): prefill 64/72/80/96/128/...,
# decode 64/96/128/... (no 80).
PREFILL_HEAD_DIMS = (64, 72, 80, 96, 128)
DECODE_HEAD_DIMS = (64, 96, 128)


def kernel_headers() -> Path:
    """The include root holding MLX's kernel headers: the macOS wheel the Mac
    host check uses too, fetched and unpacked once into the shared cache."""
    wheel = wheel_cache.wheel("mlx-metal", MLX_METAL_VERSION, "macosx_14_0_arm64")
    return wheel_cache.unpacked(wheel, (KERNELS + "/",)) / "mlx" / "include"


# ---------------------------------------------------------------- instantiation
def _prefill_block_k(head_dim: int) -> int:
    return 32 if head_dim < 128 else 16  # MLX: bk = bd < 128 ? 32 : 16


def prefill_kernel_name(dtype, head_dim: int, mask_dtype) -> str:
    tname = TYPES[np.dtype(dtype)][1]
    mname = "bool_" if np.dtype(mask_dtype) == np.bool_ else tname
    bk = _prefill_block_k(head_dim)
    return f"steel_attention_{tname}_bq32_bk{bk}_bd{head_dim}_bv{head_dim}_wm4_wn1_mask{mname}"


def decode_kernel_names(dtype, head_dim: int) -> dict[str, str]:
    tname = TYPES[np.dtype(dtype)][1]
    return {"one_pass": f"sdpa_vector_{tname}_{head_dim}_{head_dim}",
            "pass_1": f"sdpa_vector_2pass_1_{tname}_{head_dim}_{head_dim}",
            "pass_2": f"sdpa_vector_2pass_2_{tname}_{head_dim}"}


def instantiation_source(kind: str, dtype, head_dim: int) -> str:
    """Our own `.metal` that instantiates MLX's kernels for one dtype and head dim."""
    msl = TYPES[np.dtype(dtype)][0]
    lines = ['#include "mlx/backend/metal/kernels/utils.h"', f'#include "{HEADERS[kind].removeprefix("mlx/include/")}"']

    def instantiate(host: str, function: str) -> None:
        lines.append(f'template [[host_name("{host}")]] [[kernel]] decltype({function}) {function};')

    if kind == "prefill":
        bk = _prefill_block_k(head_dim)
        for mask_dtype, mask_msl in ((np.bool_, "bool"), (dtype, msl)):
            instantiate(prefill_kernel_name(dtype, head_dim, mask_dtype),
                        f"attention<{msl}, 32, {bk}, {head_dim}, {head_dim}, 4, 1, {mask_msl}, float>")
    else:
        names = decode_kernel_names(dtype, head_dim)
        instantiate(names["one_pass"], f"sdpa_vector<{msl}, {head_dim}, {head_dim}>")
        instantiate(names["pass_1"], f"sdpa_vector_2pass_1<{msl}, {head_dim}, {head_dim}>")
        instantiate(names["pass_2"], f"sdpa_vector_2pass_2<{msl}, {head_dim}>")
    return "\n".join(lines) + "\n"


def compile_mlx_library(kind: str, dtype, head_dim: int, *, counters: bool = False) -> me.MetalLibrary:
    """MLX's kernels for one dtype and head dim, built with fast math as MLX
    builds them (cached by the emulator)."""
    tname = TYPES[np.dtype(dtype)][1]
    source = me.cache_dir() / f"mlx_{kind}_{tname}_{head_dim}.metal"
    text = instantiation_source(kind, dtype, head_dim)
    if not source.exists() or source.read_text() != text:
        partial = source.with_name(f"{source.name}.{os.getpid()}.partial")
        partial.write_text(text)
        partial.replace(source)
    return me.compile_library(source, include_dirs=[kernel_headers()], fast_math=True, counters=counters)


# ---------------------------------------------------------------- launchers
def _elements(x: np.ndarray) -> list[int]:
    return [s // x.itemsize for s in x.strides]


@dataclass
class Launch:
    """What ran, for callers that want the counters of every dispatch."""

    kernels: list[str]
    counters: list  # me.Counters per dispatch (libraries built with counters)


def prefill(library: me.MetalLibrary, q, k, v, *, scale: float, causal: bool = False, mask=None) -> tuple[np.ndarray, Launch]:
    """MLX's steel attention (sdpa_full_self_attention_metal without NAX):
    bq 32, bk 32 (16 for D >= 128), 4 simdgroups; the output is written in
    MLX's [B, T, H, D] layout and returned as a [B, H, T, D] view."""
    batch, heads, q_len, head_dim = q.shape
    kv_len = k.shape[2]
    bq, bk = 32, _prefill_block_k(head_dim)
    nq, nk = -(-q_len // bq), -(-kv_len // bk)
    nq_aligned, nk_aligned = q_len // bq, kv_len // bk
    out = np.zeros((batch, q_len, heads, head_dim), q.dtype)
    out_view = out.transpose(0, 2, 1, 3)
    params = struct.pack(
        "<6if7i12q", batch, heads, head_dim, q_len, kv_len, heads // k.shape[1], scale,
        nq, nk, nq_aligned, nk_aligned, q_len - nq_aligned * bq, kv_len - nk_aligned * bk, kv_len - q_len,
        *_elements(q)[:3], *_elements(k)[:3], *_elements(v)[:3], *_elements(out_view)[:3])
    buffers = {0: q, 1: k, 2: v, 3: out, 4: params}
    mask_dtype = q.dtype
    if mask is not None:
        mask = np.ascontiguousarray(mask if mask.dtype == np.bool_ else mask.astype(q.dtype))
        full = np.broadcast_to(mask.reshape((1,) * (4 - mask.ndim) + mask.shape), (batch, heads, q_len, kv_len))
        buffers[5] = struct.pack("<3q", *_elements(full)[:3])
        buffers[6] = mask
        mask_dtype = mask.dtype
    name = prefill_kernel_name(q.dtype, head_dim, mask_dtype)
    constants = {"align_Q": q_len % bq == 0, "align_K": kv_len % bk == 0, "has_mask": mask is not None,
                 "do_causal": causal, "has_sinks": False, "save_lse": False}
    counters = library.dispatch(name, (nq, heads, batch), (32, 4, 1), buffers, function_constants=constants)
    return out_view, Launch([name], [counters])


def decode_blocks(gqa_factor: int, q_len: int) -> int:
    """Two-pass blocks on a base Apple GPU (architecture ending in neither
    'd' nor 's' in MLX's sdpa_vector_2pass)."""
    return 64 if gqa_factor * q_len >= 4 else 32


def uses_two_pass(q, k) -> bool:
    """MLX's choice on a base Apple GPU: two passes for GQA with >= 4096 keys."""
    return k.shape[1] < q.shape[1] and k.shape[2] >= 4096


def _vector_constants(q, mask, causal: bool) -> dict:
    has_mask = mask is not None
    bool_mask = has_mask and mask.dtype == np.bool_
    return {"has_mask": has_mask, "query_transposed": False, "do_causal": causal and q.shape[2] > 1,
            "bool_mask": bool_mask, "float_mask": has_mask and not bool_mask, "has_sinks": False}


def _mask_strides(mask) -> list[bytes]:
    strides, shape = _elements(mask), mask.shape
    kv_seq = strides[3] if shape[3] > 1 else 0
    q_seq = strides[2] if shape[2] > 1 else 0
    head = strides[1] if shape[1] > 1 else (strides[0] if shape[0] > 1 else 0)
    return [struct.pack("<i", s) for s in (kv_seq, q_seq, head)]


def decode(library: me.MetalLibrary, q, k, v, *, scale: float, causal: bool = False, mask=None,
           two_pass: bool | None = None, blocks: int | None = None) -> tuple[np.ndarray, Launch]:
    """MLX's sdpa_vector (one pass) or sdpa_vector_2pass_1/2 for q_len <= 8;
    `two_pass=None` decides as MLX does on a base Apple GPU."""
    batch, heads, q_len, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    gqa_factor = heads // kv_heads
    names = decode_kernel_names(q.dtype, head_dim)
    k_strides, v_strides = _elements(k), _elements(v)
    k_head = k_strides[0] if kv_heads == 1 else k_strides[1]
    v_head = v_strides[0] if kv_heads == 1 else v_strides[1]
    if mask is not None:
        mask = mask if mask.dtype == np.bool_ else mask.astype(q.dtype)
        mask = np.ascontiguousarray(mask.reshape((1,) * (4 - mask.ndim) + mask.shape))
    constants = _vector_constants(q, mask, causal)
    out = np.zeros((batch, heads, q_len, head_dim), q.dtype)
    if two_pass is None:
        two_pass = uses_two_pass(q, k)
    if not two_pass:
        buffers = {0: q, 1: k, 2: v, 3: out, 4: struct.pack("<i", gqa_factor), 5: struct.pack("<i", kv_len),
                   6: struct.pack("<Q", k_head), 7: struct.pack("<Q", k_strides[2]),
                   8: struct.pack("<Q", v_head), 9: struct.pack("<Q", v_strides[2]), 10: struct.pack("<f", scale)}
        if mask is not None:
            buffers[11 + constants["float_mask"]] = mask
            buffers.update(zip((13, 14, 15), _mask_strides(mask)))
        counters = library.dispatch(names["one_pass"], (batch * heads, q_len, 1), (1024, 1, 1), buffers,
                                    function_constants=constants)
        return out, Launch([names["one_pass"]], [counters])

    blocks = blocks or decode_blocks(gqa_factor, q_len)
    nan = np.uint16(0x7FC0) if q.dtype == np.uint16 else np.nan  # unwritten partials would show
    partials = np.full((batch, heads, q_len, blocks, head_dim), nan, q.dtype)
    sums = np.full((batch, heads, q_len, blocks), np.nan, np.float32)
    maxs = np.full((batch, heads, q_len, blocks), np.nan, np.float32)
    buffers = {0: q, 1: k, 2: v, 3: partials, 4: sums, 5: maxs, 7: struct.pack("<i", kv_len),
               8: struct.pack("<Q", k_head), 9: struct.pack("<Q", k_strides[2]),
               10: struct.pack("<Q", v_head), 11: struct.pack("<Q", v_strides[2]), 12: struct.pack("<f", scale)}
    if mask is not None:
        buffers[13 + constants["float_mask"]] = mask
        buffers.update(zip((15, 16, 17), _mask_strides(mask)))
    first = library.dispatch(names["pass_1"], (kv_heads, batch, blocks), (32, gqa_factor, q_len), buffers,
                             function_constants=constants | {"blocks": blocks})
    second = library.dispatch(names["pass_2"], (batch * heads, q_len, 1), (1024, 1, 1),
                              {0: partials, 1: sums, 2: maxs, 3: out, 4: struct.pack("<i", blocks)})
    return out, Launch([names["pass_1"], names["pass_2"]], [first, second])
