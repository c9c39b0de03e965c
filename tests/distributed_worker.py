"""One rank of the distributed tests (started by ``mlx.launch`` or by hand).

``python distributed_worker.py MODE OUT_DIR [CASES_JSON]`` writes
``OUT_DIR/rank<r>.json``. Modes:

- ``compare``: for every case in CASES_JSON, ring attention on the shards
  against the single-process ``scaled_dot_product_attention`` on the full
  sequence (every rank builds the same inputs from the case's seed), plus
  the rank's communication and work counters;
- ``mismatch``: ranks pass disagreeing shapes / layouts; records the errors;
- ``die``: rank 1 kills itself (SIGKILL) in the middle of the ring, the
  others record what happened;
- ``hang``: rank 1 stops answering (sleeps forever) before the exchange;
- ``connect``: only connects (used with a peer that never starts);
- ``decode``: :func:`decode_attention` of new queries to a cache split
  unevenly across the ranks (one rank may hold nothing), against
  ``scaled_dot_product_attention`` over the whole cache;
- ``generate``: greedy distributed generation with SmolLM2 from the prompt
  ids in CASES_JSON (``{"prompt": [...], "max_tokens": n}``);
- ``generate_mismatch``: ranks pass different prompts to distributed
  generation (a tiny random model); records the errors.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import mlx.core as mx

import mlx_attn
from mlx_attn import distributed as dist
from kernel_lab.local_ranks import write_result

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def make_inputs(case):
    key = mx.random.key(case["seed"])
    kq, kk, kv, ks = mx.random.split(key, 4)
    b, t, d = case.get("batch", 1), case["seq"], case["head_dim"]
    dtype = DTYPES[case["dtype"]]
    q = mx.random.normal((b, case["q_heads"], t, d), key=kq).astype(dtype)
    k = mx.random.normal((b, case["kv_heads"], t, d), key=kk).astype(dtype)
    v = mx.random.normal((b, case["kv_heads"], t, d), key=kv).astype(dtype)
    sinks = mx.random.normal((case["q_heads"],), key=ks).astype(dtype) if case.get("sinks") else None
    return q, k, v, sinks


def compare(group, cases):
    results = []
    default_min_piece = dist._MIN_PIECE
    for case in cases:
        dist._MIN_PIECE = case.get("min_piece", default_min_piece)  # smaller pieces: more ring rounds
        q, k, v, sinks = make_inputs(case)
        scale = case["head_dim"] ** -0.5
        mask, window, layout = case.get("mask"), case.get("window"), case["layout"]
        expected = mlx_attn.scaled_dot_product_attention(
            q, k, v, scale=scale, mask=mask, sinks=sinks, window_size=window
        )
        shard = lambda x: dist.shard_sequence(x, group=group, layout=layout)
        stats = dist.RingStats()
        out_shard = dist.ring_attention(
            shard(q), shard(k), shard(v), scale=scale, mask=mask, group=group, sinks=sinks,
            window_size=window, layout=layout, stats=stats,
        )
        out = dist.unshard_sequence(out_shard, group=group, layout=layout)
        error = mx.abs(out.astype(mx.float32) - expected.astype(mx.float32)).max().item()
        results.append({
            "case": case,
            "max_abs_error": error,
            "out_dtype": str(out.dtype),
            "finite": bool(mx.all(mx.isfinite(out)).item()),
            "shard_matches": bool(mx.array_equal(out_shard, shard(out)).item()),
            "bytes_sent": stats.bytes_sent,
            "bytes_received": stats.bytes_received,
            "visible_pairs": stats.visible_pairs,
            "shard_kv_bytes": shard(k).nbytes + shard(v).nbytes,
            "ring_steps": stats.ring_steps,
        })
    return results


def mismatch(group):
    rank, errors = group.rank(), {}
    q = mx.zeros((1, 2, 8 if rank == 0 else 16, 4))
    try:
        dist.ring_attention(q, q, q, scale=1.0, mask="causal", group=group)
        errors["shape"] = None
    except ValueError as e:
        errors["shape"] = str(e)
    q = mx.zeros((1, 2, 8, 4))
    try:
        dist.ring_attention(q, q, q, scale=1.0, mask="causal", group=group,
                            layout="zigzag" if rank == 0 else "contiguous")
        errors["layout"] = None
    except ValueError as e:
        errors["layout"] = str(e)
    return errors


def decode(group):
    """Per case: the merged attention's error against the single-process result."""
    rank, ranks, results = group.rank(), group.size(), []
    for seed, (kv_len, q_len, dtype) in enumerate([(37, 1, "float32"), (20, 1, "float16"), (9, 3, "bfloat16"),
                                                  (1, 1, "float32")]):
        case = {"seed": seed, "seq": kv_len, "head_dim": 16, "q_heads": 4, "kv_heads": 2, "dtype": dtype}
        q_full, k, v, _ = make_inputs(case)
        q = q_full[:, :, :q_len]
        expected = mlx_attn.scaled_dot_product_attention(q, k, v, scale=0.25)
        # uneven, interleaved split: rank r holds positions p with p % (ranks + 1) == r; the last rank
        # also gets the leftover residue class (and with kv_len=1 all but rank 0 hold nothing)
        owner = [min(p % (ranks + 1), ranks - 1) for p in range(kv_len)]
        mine = [p for p in range(kv_len) if owner[p] == rank]
        k_mine, v_mine = (k[:, :, mx.array(mine)], v[:, :, mx.array(mine)]) if mine else (None, None)
        out = dist.decode_attention(q, k_mine, v_mine, scale=0.25, group=group)
        results.append({
            "case": case, "held": len(mine), "out_dtype": str(out.dtype),
            "max_abs_error": mx.abs(out.astype(mx.float32) - expected.astype(mx.float32)).max().item(),
            "values": out.astype(mx.float32).flatten().tolist(),
        })
    return results


def generate(group, request):
    from model_fixtures import smollm2  # noqa: PLC0415 (only this mode loads a model)

    from mlx_attn.lm.distributed_generate import distributed_generate_step  # noqa: PLC0415
    from mlx_attn.lm.generate import GenerationConfig  # noqa: PLC0415

    model, _ = smollm2()
    config = GenerationConfig(max_tokens=request["max_tokens"])
    cache = model.make_cache()
    tokens = [token for token, _ in distributed_generate_step(model, request["prompt"], config, group, cache=cache)]
    return {"tokens": tokens, "held": [c.offset for c in cache]}


def generate_mismatch(group):
    from model_fixtures import tiny_llama  # noqa: PLC0415

    from mlx_attn.lm.distributed_generate import distributed_generate_step  # noqa: PLC0415
    from mlx_attn.lm.generate import GenerationConfig  # noqa: PLC0415

    prompt = [5, 6, 7, 8] if group.rank() == 0 else [5, 6, 7, 9]
    try:
        list(distributed_generate_step(tiny_llama(), prompt, GenerationConfig(max_tokens=2), group))
        return {"error": None}
    except ValueError as error:
        return {"error": str(error)}


def main():
    mode, out_dir = sys.argv[1], sys.argv[2]
    # Without mlx.launch (no MLX_RANK) this is a single process: a group of one.
    group = dist.init(backend="ring") if "MLX_RANK" in os.environ else mx.distributed.init()
    rank = group.rank()
    if mode == "compare":
        with open(sys.argv[3]) as f:
            cases = json.load(f)
        write_result(out_dir, rank, compare(group, cases))
    elif mode == "mismatch":
        write_result(out_dir, rank, mismatch(group))
    elif mode in ("die", "hang"):
        q = mx.random.normal((1, 2, 64 * group.size(), 8), key=mx.random.key(0))
        if rank == 1:
            if mode == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(3600)
        write_result(out_dir, rank, {"started": time.time()})
        dist.ring_attention(q, q, q, scale=1.0, mask="causal", group=group)
        write_result(out_dir, rank, {"finished": True})
    elif mode == "decode":
        write_result(out_dir, rank, decode(group))
    elif mode == "generate":
        with open(sys.argv[3]) as f:
            write_result(out_dir, rank, generate(group, json.load(f)))
    elif mode == "generate_mismatch":
        write_result(out_dir, rank, generate_mismatch(group))
    elif mode == "connect":
        write_result(out_dir, rank, {"connected": True})
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
