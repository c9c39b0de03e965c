"""The CPU's few-row quantized products on the default model: the integer-dot
products on int16 and int8 activations (``_ext.quantized_matvec_int8``)
against the float32 one (``_ext.quantized_matvec``), in one run.

- per layer: every distinct quantized layer shape of SmolLM2-135M (4-bit),
  ms per call at ``--rows`` rows (median of ``--calls`` calls each evaluated
  alone), both products, and the time one token's matvecs take summed over
  all layers;
- per token: greedy decode ms per step through ``generate_step`` with each
  product (``MATVEC_PRODUCT``), alternating ``--repeats`` times, the median;
  whether both gave the same tokens.

``--threads`` runs each in a child process per thread count
(``MLX_ATTN_NUM_THREADS``). ``--out`` writes OUT.json and OUT.png.

    python benchmarks/bench_int8_matvec.py --out docs/bench_int8_matvec
    python benchmarks/bench_int8_matvec.py --rows 1 8 16 --tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

PRODUCTS = ("float", "int16", "int8")


def product_fn(name: str):
    from mlx_attn import _ext

    if name == "float":
        return _ext.quantized_matvec
    return lambda *args: _ext.quantized_matvec_int8(*args, 16 if name == "int16" else 8)


def layer_shapes(model) -> dict:
    """{(kind, n, k): (a layer of that shape, how many layers have it)}."""
    shapes = {}
    for name, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            n, k = m["weight"].shape[0], m["weight"].shape[1] * 32 // m.bits
            key = (name.rsplit(".", 1)[-1], n, k)
            layer, count = shapes.get(key, (m, 0))
            shapes[key] = (layer, count + 1)
    return shapes


def time_call(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def per_layer(model, rows: int, calls: int) -> list[dict]:
    out = []
    for (kind, n, k), (layer, count) in layer_shapes(model).items():
        x = mx.random.normal((rows, k), key=mx.random.key(0))
        mx.eval(x)
        row = {"layer": kind, "n": n, "k": k, "count": count, "rows": rows}
        for product in PRODUCTS:
            fn = product_fn(product)
            args = (x, layer["weight"], layer["scales"], layer["biases"], layer.group_size, layer.bits)
            mx.eval(fn(*args))  # warm
            row[product] = time_call(lambda: fn(*args), calls)
        out.append(row)
    return out


def decode(model, prompt: list[int], tokens: int, product: str) -> tuple[float, list[int]]:
    from mlx_attn.lm import quantized_matmul
    from mlx_attn.lm.generate import GenerationConfig, generate_step

    quantized_matmul.MATVEC_PRODUCT = product
    config = GenerationConfig(max_tokens=tokens, stop_at_eos=False)
    out, first = [], None
    for token, _ in generate_step(model, prompt, config):
        out.append(token)
        if first is None:
            first = time.perf_counter()
    return (time.perf_counter() - first) * 1e3 / (tokens - 1), out


def measure(rows_list: list[int], calls: int, tokens: int, repeats: int) -> dict:
    from mlx_attn import _ext
    from mlx_attn.lm import load_model

    model, tokenizer = load_model()
    prompt = tokenizer.encode("The quick brown fox jumps over the lazy dog. Attention is")
    result = {"threads": os.environ.get("MLX_ATTN_NUM_THREADS", str(os.cpu_count())), "isa": _ext.cpu_isa(),
              "layers": [], "token": {}}
    for rows in rows_list:
        layers = per_layer(model, rows, calls)
        result["layers"].extend(layers)
        result.setdefault("matvec_ms_per_token", {})[rows] = {
            p: sum(r[p] * r["count"] for r in layers) for p in PRODUCTS}
    times = {p: [] for p in PRODUCTS}
    outputs = {}
    for _ in range(repeats):
        for product in PRODUCTS:
            ms, outputs[product] = decode(model, prompt, tokens, product)
            times[product].append(ms)
    for product in PRODUCTS:
        ms = statistics.median(times[product])
        result["token"][product] = {"ms_per_step": ms, "tokens_per_s": 1e3 / ms, "runs_ms": times[product]}
    result["token"]["same_tokens"] = {p: outputs[p] == outputs["float"] for p in PRODUCTS}
    return result


def report(result: dict) -> None:
    print(f"\nthreads {result['threads']}, CPU kernel ISA {result['isa']}")
    print("| layer | n x k | layers | rows | float ms | int16 ms | int8 ms | float / int16 | float / int8 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in result["layers"]:
        print(f"| {r['layer']} | {r['n']} x {r['k']} | {r['count']} | {r['rows']} | {r['float']:.3f} | "
              f"{r['int16']:.3f} | {r['int8']:.3f} | {r['float'] / r['int16']:.2f}x | {r['float'] / r['int8']:.2f}x |")
    for rows, ms in result["matvec_ms_per_token"].items():
        print(f"all layers' matvecs, {rows} row(s): " + ", ".join(f"{p} {ms[p]:.1f} ms" for p in PRODUCTS))
    t = result["token"]
    print("decode: " + ", ".join(f"{p} {t[p]['ms_per_step']:.1f} ms/step ({t[p]['tokens_per_s']:.1f} tok/s)"
                                 for p in PRODUCTS)
          + "; same tokens as float: " + ", ".join(f"{p} {'yes' if t['same_tokens'][p] else 'NO'}"
                                                  for p in PRODUCTS[1:]), flush=True)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for i, result in enumerate(results):
        one_row = [r for r in result["layers"] if r["rows"] == min(x["rows"] for x in result["layers"])]
        xs = [j + i * 0.4 for j in range(len(one_row))]
        axes[0].bar(xs, [r["float"] / r["int16"] for r in one_row], 0.4, label=f"{result['threads']} threads")
        axes[0].set_xticks(range(len(one_row)), [r["layer"] for r in one_row], rotation=45)
    axes[0].set_ylabel("float ms / int16 ms, one row")
    axes[0].legend()
    labels = [f"{p}, {r['threads']} thr" for r in results for p in PRODUCTS]
    axes[1].bar(range(len(labels)), [r["token"][p]["tokens_per_s"] for r in results for p in PRODUCTS])
    axes[1].set_xticks(range(len(labels)), labels, rotation=30)
    axes[1].set_ylabel("decode tokens/s (SmolLM2-135M 4-bit)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", nargs="+", type=int, help="thread counts, each in a child process")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # child: print the result as JSON
    parser.add_argument("--out", type=Path, help="write OUT.json and OUT.png")
    args = parser.parse_args(argv)
    if args.threads:
        results = []
        for threads in args.threads:
            child = [sys.executable, __file__, "--json", "--rows", *map(str, args.rows), "--calls", str(args.calls),
                     "--tokens", str(args.tokens), "--repeats", str(args.repeats)]
            env = dict(os.environ, MLX_ATTN_NUM_THREADS=str(threads))
            done = subprocess.run(child, env=env, capture_output=True, text=True, check=True)
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    else:
        results = [measure(args.rows, args.calls, args.tokens, args.repeats)]
    if args.json:
        print(json.dumps(results[0]))
        return results
    for result in results:
        report(result)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
        plot(results, args.out.with_suffix(".png"))
    return results


if __name__ == "__main__":
    main()
