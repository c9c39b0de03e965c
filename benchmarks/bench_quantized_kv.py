"""Decode attention over a quantized KV cache: time and KV bytes.

One query token (decode) attends to Tkv cached keys and values, for:

- ``quantized 8-bit`` / ``quantized 4-bit``:
  :func:`mlx_attn.quantized_scaled_dot_product_attention` (the path it takes
  is recorded: ``fused-cpu`` when the fused kernel handles it);
- ``float16 fused``: :func:`mlx_attn.scaled_dot_product_attention` over the
  float16 cache;
- ``mlx-lm unfused 8-bit``: mlx-lm's ``quantized_scaled_dot_product_attention``
  formula, re-implemented here from its public definition: queries scaled and
  grouped per KV head, scores by ``mx.quantized_matmul`` (the full
  ``Tq x Tkv`` matrix), a precise softmax, values by ``mx.quantized_matmul``.

KV bytes are the cache's (packed data, scales and biases for the quantized
ones). Prints a table, saves JSON and a PNG plot.

    python benchmarks/bench_quantized_kv.py            # Tkv 4k..32k, D 64/128, GQA 3 and 8
    python benchmarks/bench_quantized_kv.py --quick    # a small smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx

import mlx_attn
from mlx_attn.cache import kv_cache_bytes
from mlx_attn.quantized import quantize

KV_HEADS = 4  # GQA factor g: g * KV_HEADS query heads share KV_HEADS key/value heads
GROUP_SIZE = 64
METHODS = ("quantized 8-bit", "quantized 4-bit", "float16 fused", "mlx-lm unfused 8-bit")


def unfused_quantized_attention(q, k_quant, v_quant, *, scale, group_size, bits):
    """mlx-lm's formula (decode: no mask): two quantized matmuls with the
    whole score matrix in between."""
    b, hq, tq, d = q.shape
    hkv = k_quant[0].shape[1]
    queries = (q * scale).reshape(b, hkv, hq // hkv, tq, d)
    keys = [mx.expand_dims(a, axis=-3) for a in k_quant]
    values = [mx.expand_dims(a, axis=-3) for a in v_quant]
    scores = mx.quantized_matmul(queries, *keys, transpose=True, group_size=group_size, bits=bits)
    weights = mx.softmax(scores, axis=-1, precise=True)
    out = mx.quantized_matmul(weights, *values, transpose=False, group_size=group_size, bits=bits)
    return out.reshape(b, hq, tq, -1)


def median_seconds(fn, repeats: int) -> float:
    mx.eval(fn())  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(kv_len: int, head_dim: int, gqa: int, repeats: int) -> dict:
    mx.random.seed(kv_len + head_dim + gqa)
    shape = (1, KV_HEADS, kv_len, head_dim)
    k = mx.random.normal(shape).astype(mx.float16)
    v = mx.random.normal(shape).astype(mx.float16)
    q = mx.random.normal((1, KV_HEADS * gqa, 1, head_dim)).astype(mx.float16)
    scale = head_dim**-0.5
    quant = {bits: (quantize(k, GROUP_SIZE, bits), quantize(v, GROUP_SIZE, bits)) for bits in (8, 4)}
    mx.eval(k, v, q, quant)
    calls = {
        "quantized 8-bit": lambda: mlx_attn.quantized_scaled_dot_product_attention(
            q, *quant[8], scale=scale, group_size=GROUP_SIZE, bits=8),
        "quantized 4-bit": lambda: mlx_attn.quantized_scaled_dot_product_attention(
            q, *quant[4], scale=scale, group_size=GROUP_SIZE, bits=4),
        "float16 fused": lambda: mlx_attn.scaled_dot_product_attention(q, k, v, scale=scale),
        "mlx-lm unfused 8-bit": lambda: unfused_quantized_attention(
            q, *quant[8], scale=scale, group_size=GROUP_SIZE, bits=8),
    }
    kv_bytes = {
        "quantized 8-bit": kv_cache_bytes(1, KV_HEADS, head_dim, kv_len, mx.float16, bits=8, group_size=GROUP_SIZE),
        "quantized 4-bit": kv_cache_bytes(1, KV_HEADS, head_dim, kv_len, mx.float16, bits=4, group_size=GROUP_SIZE),
        "float16 fused": kv_cache_bytes(1, KV_HEADS, head_dim, kv_len, mx.float16),
    }
    kv_bytes["mlx-lm unfused 8-bit"] = kv_bytes["quantized 8-bit"]
    paths = {bits: mlx_attn.quantized_attention_path(q, *quant[bits], scale=scale, group_size=GROUP_SIZE, bits=bits)
             for bits in (8, 4)}
    row = {"kv_len": kv_len, "head_dim": head_dim, "gqa": gqa, "q_heads": KV_HEADS * gqa, "kv_heads": KV_HEADS,
           "paths": {"quantized 8-bit": paths[8], "quantized 4-bit": paths[4],
                     "float16 fused": mlx_attn.attention_path(q, k, v, scale=scale)}}
    for name in METHODS:
        row[name] = {"ms": 1e3 * median_seconds(calls[name], repeats), "kv_bytes": kv_bytes[name]}
    return row


def table(rows: list[dict]) -> list[str]:
    head = ["Tkv", "D", "GQA"] + [f"{m} ms" for m in METHODS] + [
        "q8 bytes / f16", "q4 bytes / f16", "unfused / q8", "q8 / f16 fused"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        f16 = r["float16 fused"]
        cells = [str(r["kv_len"]), str(r["head_dim"]), str(r["gqa"])]
        cells += [f"{r[m]['ms']:.3f}" for m in METHODS]
        cells += [f"{r['quantized 8-bit']['kv_bytes'] / f16['kv_bytes']:.3f}",
                  f"{r['quantized 4-bit']['kv_bytes'] / f16['kv_bytes']:.3f}",
                  f"{r['mlx-lm unfused 8-bit']['ms'] / r['quantized 8-bit']['ms']:.2f}x",
                  f"{r['quantized 8-bit']['ms'] / f16['ms']:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({(r["head_dim"], r["gqa"]) for r in rows})
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.5 * len(shapes), 4), squeeze=False)
    for ax, (head_dim, gqa) in zip(axes[0], shapes):
        subset = [r for r in rows if (r["head_dim"], r["gqa"]) == (head_dim, gqa)]
        lengths = [r["kv_len"] for r in subset]
        for name, style in zip(METHODS, ["o-", "s-", "^-", "x--"]):
            ax.plot(lengths, [r[name]["ms"] for r in subset], style, label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"decode, D={head_dim}, GQA {gqa} ({KV_HEADS} KV heads)")
        ax.set_xlabel("Tkv")
        ax.set_ylabel("ms per call (CPU)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="two small sizes, few repeats (smoke run)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", type=Path, default=Path("plots"))
    args = p.parse_args(argv)
    if args.quick:
        grid = [(kv_len, 64, 3) for kv_len in (256, 512)]
        repeats = 2
    else:
        grid = [(kv_len, d, g) for d in (64, 128) for g in (3, 8) for kv_len in (4096, 8192, 16384, 32768)]
        repeats = args.repeats
    with mx.stream(mx.cpu):
        rows = [measure(kv_len, d, g, repeats) for kv_len, d, g in grid]
    result = {"device": "cpu", "group_size": GROUP_SIZE, "kv_heads": KV_HEADS, "repeats": repeats, "rows": rows}
    print(f"decode attention on the CPU, batch 1, {KV_HEADS} KV heads, float16, group size {GROUP_SIZE}; "
          f"quantized path: {rows[0]['paths']['quantized 8-bit']}\n")
    print("\n".join(table(rows)))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_quantized_kv.json").write_text(json.dumps(result, indent=1))
    plot(rows, args.out / "bench_quantized_kv.png")
    print(f"\nsaved {args.out / 'bench_quantized_kv.json'} and {args.out / 'bench_quantized_kv.png'}")
    return result


if __name__ == "__main__":
    main()
