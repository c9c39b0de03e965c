"""Heatmaps of attention weights for causal, bidirectional and sliding-window
masks.

Without --model, a small randomly initialised MultiHeadAttention over a
sequence with structure (repeated tokens) is used. With --model, the weights
of one layer of a real model on a real sentence are shown (needs the text
generation models, `mlx_attn.lm.load_model`).

    python examples/visualize_attention.py [--out plots/attention.png]
    python examples/visualize_attention.py --model default --layer 3 --text "The cat sat on the mat."
"""

from __future__ import annotations

import argparse
from pathlib import Path

import mlx_attn

mlx_attn.use_system_blas()  # before MLX is imported (Linux: MLX's float32 matmuls on a system OpenBLAS)

import mlx.core as mx  # noqa: E402
import numpy as np

from mlx_attn import MultiHeadAttention, RoPE
from mlx_attn.masks import causal_mask, sliding_window_mask


def small_module_weights(length: int, window: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Head-averaged weights of a small module for three masks."""
    mx.random.seed(seed)
    d_model = 64
    mha = MultiHeadAttention(d_model, 4, 2, rope=RoPE(16))
    # a sequence whose second half repeats the first, so attention has a pattern
    half = mx.random.normal((1, length // 2, d_model))
    x = mx.concatenate([half, half[:, : length - length // 2]], axis=1) * 3
    masks = {
        "bidirectional": None,
        "causal": causal_mask(length),
        f"sliding window ({window})": sliding_window_mask(length, window),
    }
    out = {}
    for name, mask in masks.items():
        _, weights = mha(x, mask=mask, return_weights=True)
        out[name] = np.array(weights[0].mean(axis=0))
    return out


def model_weights(model_name: str, text: str, layer: int, window: int):
    from mlx_attn.lm import load_model  # the text-generation models

    model, tokenizer = load_model(None if model_name == "default" else model_name)
    tokens = tokenizer.encode(text)
    labels = [tokenizer.decode([t]) for t in tokens]
    if not hasattr(model, "attention_weights"):
        raise SystemExit("this model does not expose attention_weights(tokens, layer, mask)")
    n = len(tokens)
    masks = {"causal (as trained)": causal_mask(n), f"sliding window ({window})": sliding_window_mask(n, window)}
    out = {}
    for name, mask in masks.items():
        weights = model.attention_weights(mx.array([tokens]), layer=layer, mask=mask)
        out[name] = np.array(weights[0].mean(axis=0))
    return out, labels


def plot(weights: dict[str, np.ndarray], path: Path, title: str, labels: list[str] | None = None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(weights), figsize=(5.2 * len(weights), 5))
    axes = np.atleast_1d(axes)
    for ax, (name, w) in zip(axes, weights.items()):
        image = ax.imshow(w, cmap="viridis", vmin=0.0, vmax=max(w.max(), 1e-6))
        ax.set_title(name)
        ax.set_xlabel("key position")
        ax.set_ylabel("query position")
        if labels is not None:
            ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=7)
            ax.set_yticks(range(len(labels)), labels, fontsize=7)
        fig.colorbar(image, ax=ax, fraction=0.046)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--length", type=int, default=24)
    p.add_argument("--window", type=int, default=6)
    p.add_argument("--model", default=None, help="'default' or a model path (text-generation models)")
    p.add_argument("--text", default="The quick brown fox jumps over the lazy dog because the dog is lazy.")
    p.add_argument("--layer", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("plots/attention.png"))
    args = p.parse_args(argv)
    if args.model:
        weights, labels = model_weights(args.model, args.text, args.layer, args.window)
        plot(weights, args.out, f"{args.model}: layer {args.layer}, mean over heads", labels)
    else:
        weights = small_module_weights(args.length, args.window)
        plot(weights, args.out, "MultiHeadAttention (4 heads, 2 KV heads, RoPE), mean over heads")
    for name, w in weights.items():
        rows = w.sum(axis=-1)
        print(f"{name:28s} rows sum to {rows.min():.6f}..{rows.max():.6f}, "
              f"weight above the diagonal {np.triu(w, 1).sum():.3g}")
    print(f"saved {args.out}")
    return weights


if __name__ == "__main__":
    main()
