"""Gemma 3 270M generation: mlx_attn against mlx-lm on the same weights.

mlx_attn loads the GGUF (``load_model("gemma3-270m")``: Q4_K/Q5_0/Q8_0
carried over exactly, Q6_K at 8 bits, groups of 32) and writes it as an mlx-lm
directory (``mlx_attn.lm.convert``); mlx-lm (``gemma3_text``, run in its own
environment given by --mlx-lm-python, e.g. a venv with ``mlx-lm==0.32.2``)
loads that directory, so both run exactly the same weights. For each context
length both prefill the same random prompt in chunks (only the caches are
evaluated, as both generators do) and decode --decode tokens greedily; one
process per run, so peak memory is each run's own.

    python benchmarks/bench_gemma3.py --mlx-lm-python /tmp/mlxlm/bin/python
    python benchmarks/bench_gemma3.py --contexts 128 --decode 8      # smoke run

Writes a Markdown table to stdout and, with --out, JSON and a plot.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PREFILL_CHUNK = 512


def measure(model, cache, prompt: list[int], decode: int) -> dict:
    """Prefill all but the last prompt token, then decode greedily; only
    ``mlx.core`` is used here, so mlx-lm's process runs it too."""
    import mlx.core as mx

    mx.reset_peak_memory()
    tokens = mx.array(prompt)[None]
    start = time.perf_counter()
    for begin in range(0, len(prompt) - 1, PREFILL_CHUNK):
        model(tokens[:, begin:min(begin + PREFILL_CHUNK, len(prompt) - 1)], cache=cache)
        mx.eval([c.state for c in cache])
    prefill_s = time.perf_counter() - start
    token = tokens[:, -1:]
    start = time.perf_counter()
    for _ in range(decode):
        token = mx.argmax(model(token, cache=cache)[:, -1], axis=-1)[None]
        mx.eval(token)
    decode_s = time.perf_counter() - start
    return {"context": len(prompt), "prompt_tps": (len(prompt) - 1) / prefill_s, "decode_tps": decode / decode_s,
            "peak_gb": mx.get_peak_memory() / 1e9}


def prompt_of(length: int, vocab: int = 262144) -> list[int]:
    import random

    rng = random.Random(length)
    return [2] + [rng.randrange(300, vocab - 10000) for _ in range(length - 1)]


def worker(which: str, path: str, context: int, decode: int) -> dict:
    if which == "mlx-lm":
        from mlx_lm import load

        model, _ = load(path)
    else:
        import mlx_attn

        mlx_attn.use_system_blas()  # as the mlx-attn command does (before MLX is imported)
        from mlx_attn.lm import load_model

        model, _ = load_model(path)
    return measure(model, model.make_cache(), prompt_of(context), decode)


def run(python: str, which: str, path: str, context: int, decode: int) -> dict:
    command = [python, __file__, "--worker", which, "--path", path, "--contexts", str(context),
               "--decode", str(decode)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{which} at {context}: {result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name in ("mlx_attn", "mlx-lm"):
        got = [r for r in rows if name in r]
        axes[0].plot([r["context"] for r in got], [r[name]["decode_tps"] for r in got], "o-", label=name)
        axes[1].plot([r["context"] for r in got], [r[name]["peak_gb"] for r in got], "o-", label=name)
    for ax, label in zip(axes, ("decode tokens/s", "peak memory (GB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle("Gemma 3 270M generation (same weights)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 4096, 16384])
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--mlx-lm-python", help="a Python with mlx-lm installed (skipped when absent)")
    parser.add_argument("--out", type=Path, help="write OUT.json and OUT.png")
    parser.add_argument("--worker", choices=["mlx_attn", "mlx-lm"], help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.path, args.contexts[0], args.decode)))
        return 0

    from mlx_attn.lm import load_model
    from mlx_attn.lm.convert import save_mlx_directory

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "gemma3-mlx"
        if args.mlx_lm_python:
            model, tokenizer = load_model("gemma3-270m")
            save_mlx_directory(model, tokenizer, directory)
            del model
        print("| context | mlx_attn prompt tok/s | mlx_attn decode tok/s | mlx_attn peak GB "
              "| mlx-lm prompt tok/s | mlx-lm decode tok/s | mlx-lm peak GB | decode ratio | memory ratio |")
        print("|---|---|---|---|---|---|---|---|---|")
        for context in args.contexts:
            row = {"context": context, "mlx_attn": run(sys.executable, "mlx_attn", "gemma3-270m", context, args.decode)}
            if args.mlx_lm_python:
                row["mlx-lm"] = run(args.mlx_lm_python, "mlx-lm", str(directory), context, args.decode)
            rows.append(row)
            a, b = row["mlx_attn"], row.get("mlx-lm")
            cells = [f"{a['prompt_tps']:.1f}", f"{a['decode_tps']:.2f}", f"{a['peak_gb']:.3f}"]
            cells += ([f"{b['prompt_tps']:.1f}", f"{b['decode_tps']:.2f}", f"{b['peak_gb']:.3f}",
                       f"{a['decode_tps'] / b['decode_tps']:.2f}x", f"{a['peak_gb'] / b['peak_gb']:.2f}x"]
                      if b else ["-"] * 5)
            print(f"| {context} | " + " | ".join(cells) + " |", flush=True)
    if args.out:
        args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
        plot(rows, args.out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
