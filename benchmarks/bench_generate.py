"""Text-generation benchmark: SmolLM2-135M-Instruct with mlx_attn's fused
attention and the pure-MLX reference path, each with pipelined decoding (the
default) and serial decoding (``pipelined=False``: each step is built only
after the previous token is read), and mlx-lm on the same weights when it is
importable.

For each context length all but the last prompt token are prefilled once
(fused path; prefill on this CPU runs at ~10 tokens/s, so one 4096-token
prefill per path would take an hour) and every path decodes --decode tokens
greedily from its own copy of that cache, feeding the last prompt token
first. The paths run alternately, --repeats times, and the median of each is
reported: generation tokens/s, peak memory and the ratios (same run); the
prompt tokens/s column is the shared prefill's. --full-prefill prefills per
run instead. --prefill-cache DIR keeps each context's shared prefill in
DIR (``save_cache``; reused by later runs with the same model, prompt and
chunk, its prompt tokens/s taken from the run that made it), so a quiet-machine
decode measurement need not wait for the prefill again. mlx-lm loads the same weights from a directory written by
``mlx_attn.lm.convert`` (GGUF -> mlx-lm layout) and decodes from an mlx-lm
KVCache holding the same keys and values.

    python benchmarks/bench_generate.py                    # contexts 128, 1024, 4096
    python benchmarks/bench_generate.py --quick            # smoke run
    python benchmarks/bench_generate.py --prefill-chunks 512 1024 2048 4096 --contexts 4096
    python benchmarks/bench_generate.py --contexts 4096 --prefill-cache ~/.cache/mlx_attn/bench-prefill
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from mlx_attn.cache import KVCache, load_cache, save_cache
from mlx_attn.lm import load_model
from mlx_attn.lm.convert import save_mlx_directory
from mlx_attn.lm.generate import DEFAULT_PREFILL_CHUNK, GenerationConfig, stream_generate

TEXT = (
    "Attention lets every token look at every other token. A query is compared with all keys, the scores "
    "are turned into weights by a softmax, and the weights average the values. Long contexts make this "
    "quadratic, which is why fused kernels never store the whole score matrix. "
)
# row name -> (attention backend, pipelined)
PATHS = {"fused": ("fused", True), "fused (serial)": ("fused", False),
         "reference": ("reference", True), "reference (serial)": ("reference", False)}
MLX_LM = "mlx-lm"


def prompt_of_length(tokenizer, length: int) -> list[int]:
    ids = tokenizer.encode(TEXT)
    repeats = length // len(ids) + 1
    return (ids * repeats)[:length]


def _result(last) -> dict:
    return {"prompt_tps": last.prompt_tps, "generation_tps": last.generation_tps,
            "peak_memory_gb": last.peak_memory, "generated": last.generation_tokens}


def run(model, tokenizer, prompt, decode, prefill_chunk, pipelined=True, cache=None) -> dict:
    config = GenerationConfig(max_tokens=decode, stop_at_eos=False, prefill_chunk=prefill_chunk, pipelined=pipelined)
    last = None
    for last in stream_generate(model, tokenizer, prompt, config, cache=cache):
        pass
    return _result(last)


def prefill(model, prompt, prefill_chunk) -> tuple[list, float]:
    """A fused-path cache holding ``prompt`` and the prompt tokens/s."""
    model.set_backend("fused")
    cache = model.make_cache()
    start = time.perf_counter()
    for begin in range(0, len(prompt), prefill_chunk):
        model(mx.array([prompt[begin:begin + prefill_chunk]]), cache=cache)
        mx.eval([c.state for c in cache])
    return cache, len(prompt) / (time.perf_counter() - start)


def cached_prefill(model, prompt, prefill_chunk, directory: Path | None) -> tuple[list, float]:
    """prefill(), through a cache file in ``directory`` when given: the file
    is keyed by the prompt's tokens and the chunk, and records the prompt
    tokens/s of the run that made it."""
    if directory is None:
        return prefill(model, prompt, prefill_chunk)
    key = hashlib.sha256(json.dumps([repr(model.config), prompt, prefill_chunk]).encode()).hexdigest()
    file = Path(directory).expanduser() / f"prefill-{len(prompt)}-{key[:16]}.safetensors"
    if file.exists():
        cache, metadata = load_cache(file)
        print(f"prefill of {len(prompt)} tokens loaded from {file} (prompt tok/s from the run that saved it)")
        return cache, float(metadata["prompt_tps"])
    cache, prompt_tps = prefill(model, prompt, prefill_chunk)
    file.parent.mkdir(parents=True, exist_ok=True)
    save_cache(file, cache, {"prompt_tps": repr(prompt_tps)})
    return cache, prompt_tps


def _kv_cache(keys, values) -> KVCache:
    cache = KVCache()
    cache.state = (keys, values)
    return cache


def copy_state(cache, make=_kv_cache) -> list:
    """Fresh caches (``make(keys, values)``) holding copies of ``cache``'s keys and values."""
    copies = [make(mx.array(layer.state[0]), mx.array(layer.state[1])) for layer in cache]
    mx.eval([[c.keys, c.values] for c in copies])
    return copies


def load_mlx_lm(model, tokenizer, workdir: Path):
    """mlx-lm's (model, tokenizer, stream_generate) on the same weights, or
    (None, why)."""
    try:
        from mlx_lm import load, stream_generate as mlx_lm_stream_generate
    except ImportError:
        return None, "mlx-lm is not installed (pip install mlx-lm to add its column)"
    directory = save_mlx_directory(model, tokenizer, workdir / "mlx-lm-model")
    mlx_lm_model, mlx_lm_tokenizer = load(str(directory))
    return (mlx_lm_model, mlx_lm_tokenizer, mlx_lm_stream_generate), None


def mlx_lm_run(loaded, prompt, decode, prefill_chunk, cache=None) -> dict:
    model, tokenizer, mlx_lm_stream_generate = loaded
    if cache is not None:
        from mlx_lm.models.cache import KVCache as MlxLmKVCache

        def make(keys, values):  # set directly: the state setter's tuple differs between mlx-lm versions
            their = MlxLmKVCache()
            their.keys, their.values, their.offset = keys, values, keys.shape[2]
            return their

        cache = copy_state(cache, make)
    last = None
    for last in mlx_lm_stream_generate(model, tokenizer, prompt, max_tokens=decode, prefill_step_size=prefill_chunk,
                                       prompt_cache=cache):
        pass
    return _result(last)


def median_result(runs: list[dict]) -> dict:
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def plot(rows, names, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for key, ax, label in (("prompt_tps", axes[0], "prompt tokens/s"), ("generation_tps", axes[1],
                           "generation tokens/s"), ("peak_memory_gb", axes[2], "peak memory (GB)")):
        for name in names:
            pts = [(r["context"], r[name][key]) for r in rows if r.get(name)]
            if pts:
                ax.plot(*zip(*pts), "o-" if "serial" not in name else "s--", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle("SmolLM2-135M-Instruct (Q4_1) generation: mlx_attn paths, pipelined and serial decoding")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def prefill_chunk_table(model, tokenizer, contexts, chunks, repeats):
    """Prompt tokens/s of the fused path per prefill chunk (how the default was chosen)."""
    model.set_backend("fused")
    print("\n| context | prefill chunk | prompt tok/s | peak GB |\n|---|---|---|---|")
    table = []
    for context in contexts:
        prompt = prompt_of_length(tokenizer, context)
        for chunk in chunks:
            r = median_result([run(model, tokenizer, prompt, 1, chunk) for _ in range(repeats)])
            table.append({"context": context, "chunk": chunk, **r})
            print(f"| {context} | {chunk} | {r['prompt_tps']:.1f} | {r['peak_memory_gb']:.3f} |", flush=True)
    model.set_backend("auto")
    return table


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 4096])
    p.add_argument("--decode", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="alternating runs per path (median reported)")
    p.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK)
    p.add_argument("--prefill-chunks", type=int, nargs="+", default=None,
                   help="instead: measure prompt tokens/s per prefill chunk size")
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--no-mlx-lm", action="store_true", help="leave mlx-lm out even if it is installed")
    p.add_argument("--full-prefill", action="store_true", help="every run prefills its own prompt")
    p.add_argument("--prefill-cache", type=Path, default=None,
                   help="directory keeping each context's shared prefill for later runs")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args(argv)
    if args.quick:
        args.contexts, args.decode, args.repeats = [16, 32], 3, 1
    args.out.mkdir(parents=True, exist_ok=True)

    model, tokenizer = load_model(args.model)
    print(f"mlx {mx.__version__}, device {mx.default_device()}")
    if args.prefill_chunks:
        table = prefill_chunk_table(model, tokenizer, args.contexts, args.prefill_chunks, args.repeats)
        (args.out / "bench_prefill_chunks.json").write_text(json.dumps(table, indent=1))
        return table
    with tempfile.TemporaryDirectory() as workdir:
        mlx_lm, mlx_lm_note = (None, "left out (--no-mlx-lm)") if args.no_mlx_lm else load_mlx_lm(
            model, tokenizer, Path(workdir))
        names = list(PATHS) + ([MLX_LM] if mlx_lm else [])
        print("| context | path | prompt tok/s | generation tok/s | peak GB |\n|---|---|---|---|---|")
        rows = []
        for context in args.contexts:
            prompt = prompt_of_length(tokenizer, context)
            runs = {name: [] for name in names}
            for name in names:  # warm up every path
                _run_path(name, model, tokenizer, mlx_lm, prompt[:16], 2, args.prefill_chunk)
            shared, prompt_tps = (None, None) if args.full_prefill else cached_prefill(
                model, prompt[:-1], args.prefill_chunk, args.prefill_cache)
            decoded = prompt if args.full_prefill else prompt[-1:]
            for repeat in range(args.repeats):
                order = names[repeat % len(names):] + names[:repeat % len(names)]  # alternate who goes first
                for name in order:
                    runs[name].append(_run_path(name, model, tokenizer, mlx_lm, decoded, args.decode,
                                                args.prefill_chunk, shared))
            row = {"context": context, **{name: median_result(runs[name]) for name in names}}
            if shared is not None:
                for name in names:
                    row[name]["prompt_tps"] = prompt_tps
            for name in names:
                r = row[name]
                print(f"| {context} | {name} | {r['prompt_tps']:.1f} | {r['generation_tps']:.1f} | "
                      f"{r['peak_memory_gb']:.3f} |", flush=True)
            rows.append(row)
    model.set_backend("auto")
    print("\ngeneration tokens/s ratios (same run):")
    for r in rows:
        parts = [f"{backend} pipelined/serial {r[backend]['generation_tps'] / r[backend + ' (serial)']['generation_tps']:.2f}x"
                 for backend in ("fused", "reference")]
        if MLX_LM in r:
            parts += [f"{name}/mlx-lm {r[name]['generation_tps'] / r[MLX_LM]['generation_tps']:.2f}x"
                      for name in ("fused", "reference")]
        print(f"  context {r['context']}: " + ", ".join(parts))
    if mlx_lm_note:
        print(f"mlx-lm: {mlx_lm_note}")
    (args.out / "bench_generate.json").write_text(json.dumps(rows, indent=1))
    plot(rows, names, args.out / "bench_generate.png")
    print(f"saved {args.out / 'bench_generate.json'} and .png")
    return rows


def _run_path(name, model, tokenizer, mlx_lm, prompt, decode, prefill_chunk, shared=None) -> dict:
    if name == MLX_LM:
        return mlx_lm_run(mlx_lm, prompt, decode, prefill_chunk, shared)
    backend, pipelined = PATHS[name]
    model.set_backend(backend)
    return run(model, tokenizer, prompt, decode, prefill_chunk, pipelined,
               copy_state(shared) if shared is not None else None)


if __name__ == "__main__":
    main()
