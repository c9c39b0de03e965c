"""Host time per decode step: the eager step (every token's graph built in
Python) against the compiled one (``GenerationConfig(compiled=True)``: one
``mx.compile`` trace replayed), in one run.

Two models, each decoding greedily through ``generate_step`` after a short
prompt:

- ``tiny``: a random-weight 2-layer, 64-wide Llama of this package (vocabulary
  256), so the compute is negligible and ms/step is the per-step host cost;
- ``smollm2``: the default model, SmolLM2-135M (4-bit), where the matrix
  products take part of the step (skipped with ``--models tiny``).

The modes alternate ``--repeats`` times and the median is reported: ms per
step (first token to last, over the steps between them, so the prompt and the
trace are not counted), tokens/s, and whether both modes gave the same
tokens. ``--out`` writes OUT.json and OUT.png.

    python benchmarks/bench_decode_step.py --out docs/bench_decode_step
    python benchmarks/bench_decode_step.py --models tiny --tokens 512 --compiled on off
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

import mlx.core as mx

from mlx_attn.lm.generate import GenerationConfig, generate_step
from mlx_attn.lm.models.llama import Llama, LlamaConfig

MODES = {"off": False, "on": True}
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)


def tiny_model() -> Llama:
    mx.random.seed(0)
    model = Llama(LlamaConfig(**TINY))
    mx.eval(model.parameters())
    return model


def load(name: str):
    if name == "tiny":
        return tiny_model(), list(range(1, 17))
    from mlx_attn.lm import load_model

    model, tokenizer = load_model()
    return model, tokenizer.encode("The quick brown fox jumps over the lazy dog. Attention is")


def decode(model, prompt: list[int], tokens: int, compiled: bool) -> tuple[float, list[int]]:
    """(ms per step after the first token, the greedy tokens)."""
    config = GenerationConfig(max_tokens=tokens, compiled=compiled)
    out, first = [], None
    for token, _ in generate_step(model, prompt, config):
        out.append(token)
        if first is None:
            first = time.perf_counter()
    return (time.perf_counter() - first) * 1e3 / (tokens - 1), out


def cpu_name() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or platform.machine()


def measure(name: str, tokens: int, repeats: int, modes: list[str]) -> dict:
    model, prompt = load(name)
    times = {mode: [] for mode in modes}
    outputs = {}
    for _ in range(repeats):
        for mode in modes:
            ms, outputs[mode] = decode(model, prompt, tokens, MODES[mode])
            times[mode].append(ms)
    row = {"model": name, "tokens": tokens, "repeats": repeats}
    for mode in modes:
        ms = statistics.median(times[mode])
        row[mode] = {"ms_per_step": ms, "tokens_per_s": 1e3 / ms, "runs_ms": times[mode]}
    if "on" in modes and "off" in modes:
        row["speedup"] = row["off"]["ms_per_step"] / row["on"]["ms_per_step"]
        row["same_tokens"] = outputs["on"] == outputs["off"]
    return row


def plot(rows: list[dict], path: Path, modes: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        xs = [j + i * width for j in range(len(rows))]
        ax.bar(xs, [r[mode]["ms_per_step"] for r in rows], width, label=f"compiled {mode}")
    ax.set_xticks([j + width * (len(modes) - 1) / 2 for j in range(len(rows))], [r["model"] for r in rows])
    ax.set_ylabel("ms per decode step")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title("Decode step, eager vs compiled")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=["tiny", "smollm2"], default=["tiny", "smollm2"])
    parser.add_argument("--compiled", nargs="+", choices=sorted(MODES), default=["off", "on"])
    parser.add_argument("--tokens", type=int, default=None, help="tokens per run (default: 200 tiny, 24 smollm2)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, help="write OUT.json and OUT.png")
    args = parser.parse_args(argv)
    modes = list(dict.fromkeys(args.compiled))
    result = {"cpu": cpu_name(), "mlx": mx.__version__, "rows": []}
    print(f"CPU: {result['cpu']}, MLX {result['mlx']}")
    header = "| model | tokens |" + "".join(f" compiled {m}: ms/step | tokens/s |" for m in modes)
    both = len(modes) == 2
    print(header + (" eager / compiled | same tokens |" if both else ""))
    print("|---|---|" + "---|---|" * len(modes) + ("---|---|" if both else ""))
    for name in args.models:
        tokens = args.tokens or (200 if name == "tiny" else 24)
        row = measure(name, tokens, args.repeats, modes)
        result["rows"].append(row)
        cells = [f"{row[m]['ms_per_step']:.2f} | {row[m]['tokens_per_s']:.1f}" for m in modes]
        if both:
            cells.append(f"{row['speedup']:.2f}x | {'yes' if row['same_tokens'] else 'NO'}")
        print(f"| {name} | {tokens} | " + " | ".join(cells) + " |", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        plot(result["rows"], args.out.with_suffix(".png"), modes)
    return result


if __name__ == "__main__":
    main()
