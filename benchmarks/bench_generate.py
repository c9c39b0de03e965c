"""Text-generation benchmark: SmolLM2-135M-Instruct with mlx_attn's fused
attention vs the pure-MLX reference path, at several context lengths.

For each context length the prompt is prefilled into the KV cache (in chunks),
then --decode tokens are generated greedily. Prints prompt and generation
tokens/s and peak memory, the fused/reference ratios (same run), saves a JSON
file and a plot.

    python benchmarks/bench_generate.py                  # contexts 256, 1024, 4096
    python benchmarks/bench_generate.py --quick          # smoke run

mlx-lm, when installed, loads Hugging Face directories but not this GGUF
file, so it is reported as not comparable here unless --mlx-lm-model points to
an MLX/HF directory of the same model.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx

from mlx_attn.lm.generate import GenerationConfig, GenerationStats, generate_tokens
from mlx_attn.lm import load_model

TEXT = (
    "Attention lets every token look at every other token. A query is compared with all keys, the scores "
    "are turned into weights by a softmax, and the weights average the values. Long contexts make this "
    "quadratic, which is why fused kernels never store the whole score matrix. "
)


def prompt_of_length(tokenizer, length: int) -> list[int]:
    ids = tokenizer.encode(TEXT)
    repeats = length // len(ids) + 1
    return (ids * repeats)[:length]


def run(model, prompt, decode, prefill_chunk) -> dict:
    stats = GenerationStats()
    config = GenerationConfig(max_tokens=decode, stop_at_eos=False, prefill_chunk=prefill_chunk)
    for _ in generate_tokens(model, prompt, config, stats=stats):
        pass
    return {
        "prompt_tps": stats.prompt_tps,
        "generation_tps": stats.generation_tps,
        "peak_memory_mib": stats.peak_memory_bytes / 2**20,
        "generated": stats.generated_tokens,
    }


def mlx_lm_run(model_dir, prompt, decode):
    try:
        from mlx_lm import load, stream_generate
    except ImportError:
        return None, "mlx-lm not installed"
    if not model_dir:
        return None, "mlx-lm loads Hugging Face directories, not the GGUF file (pass --mlx-lm-model)"
    model, tokenizer = load(model_dir)
    last = None
    for last in stream_generate(model, tokenizer, prompt, max_tokens=decode):
        pass
    return {"prompt_tps": last.prompt_tps, "generation_tps": last.generation_tps,
            "peak_memory_mib": last.peak_memory * 1024}, None


def plot(rows, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for key, ax, label in (("prompt_tps", axes[0], "prompt tokens/s"), ("generation_tps", axes[1], "generation tokens/s"),
                           ("peak_memory_mib", axes[2], "peak memory (MiB)")):
        for backend, style in (("fused", "o-"), ("reference", "s--"), ("mlx-lm", "^:")):
            pts = [(r["context"], r[backend][key]) for r in rows if r.get(backend)]
            if pts:
                ax.plot(*zip(*pts), style, label=backend)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle("SmolLM2-135M-Instruct (Q4_1) generation, mlx_attn attention paths")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--decode", type=int, default=32)
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--mlx-lm-model", default=None)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args(argv)
    if args.quick:
        args.contexts, args.decode = [16, 32], 3
    args.out.mkdir(parents=True, exist_ok=True)

    model, tokenizer = load_model(args.model)
    print(f"mlx {mx.__version__}, device {mx.default_device()}")
    header = ("| context | path | prompt tok/s | generation tok/s | peak MiB |", "|---|---|---|---|---|")
    print("\n".join(header))
    rows = []
    mlx_lm_note = None
    for context in args.contexts:
        prompt = prompt_of_length(tokenizer, context)
        row = {"context": context}
        for backend in ("fused", "reference"):
            model.set_backend(backend)
            run(model, prompt[:16], 2, args.prefill_chunk)  # warm up
            row[backend] = run(model, prompt, args.decode, args.prefill_chunk)
        row["mlx-lm"], mlx_lm_note = mlx_lm_run(args.mlx_lm_model, tokenizer.decode(prompt), args.decode)
        for backend in ("fused", "reference", "mlx-lm"):
            r = row.get(backend)
            if r:
                print(f"| {context} | {backend} | {r['prompt_tps']:.1f} | {r['generation_tps']:.1f} | {r['peak_memory_mib']:.0f} |",
                      flush=True)
        rows.append(row)
    print("\nfused / reference (same run):")
    for r in rows:
        f, ref = r["fused"], r["reference"]
        print(f"  context {r['context']}: prompt {f['prompt_tps'] / ref['prompt_tps']:.2f}x, "
              f"generation {f['generation_tps'] / ref['generation_tps']:.2f}x, "
              f"peak memory {f['peak_memory_mib'] / ref['peak_memory_mib']:.2f}x")
    if mlx_lm_note:
        print(f"mlx-lm: {mlx_lm_note}")
    model.set_backend("auto")
    (args.out / "bench_generate.json").write_text(json.dumps(rows, indent=1))
    plot(rows, args.out / "bench_generate.png")
    print(f"saved {args.out / 'bench_generate.json'} and .png")
    return rows


if __name__ == "__main__":
    main()
