"""KV-cache memory: MHA vs GQA vs MQA, and quantized caches.

Prints bytes per token and at several context lengths for a few model shapes
(every layout of one model keeps the number of query heads and the head dim,
only the key/value heads change), then what a ``QuantizedKVCache`` (8 and 4
bits, ``--kv-group-size`` features per scale and bias) costs for the actual
layout, and saves a plot.

    python examples/kv_cache_memory.py [--out plots/kv_cache_memory.png]
"""

import argparse
from pathlib import Path

import mlx_attn

mlx_attn.use_system_blas()  # before MLX is imported (Linux: MLX's float32 matmuls on a system OpenBLAS)

import mlx.core as mx  # noqa: E402

from mlx_attn.cache import kv_cache_bytes, kv_cache_bytes_per_token

# (name, layers, query heads, head dim, [(layout, kv heads)])
MODELS = [
    ("SmolLM2-135M", 30, 9, 64, [("MHA", 9), ("GQA (actual)", 3), ("MQA", 1)]),
    ("Llama-3-8B", 32, 32, 128, [("MHA", 32), ("GQA (actual)", 8), ("MQA", 1)]),
    ("Llama-2-70B", 80, 64, 128, [("MHA", 64), ("GQA (actual)", 8), ("MQA", 1)]),
]
CONTEXTS = [2048, 8192, 32768, 131072]
DTYPES = {"float16": mx.float16, "float32": mx.float32}
KV_BITS = (8, 4)  # the QuantizedKVCache widths compared with the float cache


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024


def table(dtype_name: str) -> list[str]:
    dtype = DTYPES[dtype_name]
    head = ["model", "layout", "kv heads", "per token"] + [f"{c // 1024}K ctx" for c in CONTEXTS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, layers, _, head_dim, layouts in MODELS:
        for layout, kv_heads in layouts:
            cells = [name, layout, str(kv_heads), human(kv_cache_bytes_per_token(layers, kv_heads, head_dim, dtype))]
            cells += [human(kv_cache_bytes(layers, kv_heads, head_dim, c, dtype)) for c in CONTEXTS]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def actual_layout(layouts) -> int:
    """The kv heads of the layout the model really uses."""
    return next(kv_heads for layout, kv_heads in layouts if "actual" in layout)


def quantized_table(dtype_name: str, group_size: int) -> list[str]:
    """Bytes of the actual layout with float and quantized caches (the
    quantized scales and biases are in ``dtype_name``)."""
    dtype = DTYPES[dtype_name]
    head = ["model", "cache", "per token", "vs float"] + [f"{c // 1024}K ctx" for c in CONTEXTS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, layers, _, head_dim, layouts in MODELS:
        kv_heads = actual_layout(layouts)
        float_bytes = kv_cache_bytes_per_token(layers, kv_heads, head_dim, dtype)
        for bits in (None, *KV_BITS):
            per_token = kv_cache_bytes_per_token(layers, kv_heads, head_dim, dtype, bits=bits, group_size=group_size)
            label = dtype_name if bits is None else f"{bits}-bit, group {group_size}"
            cells = [name, label, human(per_token), f"{per_token / float_bytes:.3f}x"]
            cells += [human(per_token * c) for c in CONTEXTS]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def plot(path: Path, dtype_name: str, group_size: int):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtype = DTYPES[dtype_name]
    contexts = [2**k for k in range(9, 18)]
    fig, axes = plt.subplots(1, len(MODELS), figsize=(5 * len(MODELS), 4))
    for ax, (name, layers, _, head_dim, layouts) in zip(axes, MODELS):
        for (layout, kv_heads), style in zip(layouts, ["o-", "s-", "^-"]):
            gib = [kv_cache_bytes(layers, kv_heads, head_dim, c, dtype) / 2**30 for c in contexts]
            ax.plot(contexts, gib, style, label=f"{layout}: {kv_heads} KV heads")
        kv_heads = actual_layout(layouts)
        for bits, style in zip(KV_BITS, ["s--", "s:"]):
            gib = [kv_cache_bytes(layers, kv_heads, head_dim, c, dtype, bits=bits, group_size=group_size) / 2**30
                   for c in contexts]
            ax.plot(contexts, gib, style, label=f"GQA, {bits}-bit quantized")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{name} ({layers} layers, head dim {head_dim})")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(f"KV cache, GiB ({dtype_name}, batch 1)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=list(DTYPES), default="float16")
    p.add_argument("--kv-group-size", type=int, choices=[32, 64, 128], default=64,
                   help="features per scale and bias of the quantized caches")
    p.add_argument("--out", type=Path, default=Path("plots/kv_cache_memory.png"))
    args = p.parse_args(argv)
    print(f"KV-cache size ({args.dtype}, batch 1): 2 x layers x kv_heads x head_dim x bytes per token\n")
    print("\n".join(table(args.dtype)))
    print(f"\nQuantized KV cache (actual layout): bits/8 bytes per feature + a {args.dtype} scale and bias "
          f"per {args.kv_group_size} features\n")
    print("\n".join(quantized_table(args.dtype, args.kv_group_size)))
    plot(args.out, args.dtype, args.kv_group_size)
    print(f"\nsaved {args.out}")


if __name__ == "__main__":
    main()
