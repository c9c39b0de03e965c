"""mlx-lm's architectures on mlx_attn against mlx-lm itself, on the same
checkpoints, in one run on this machine (issue #32, item 6).

The checkpoints are random-weight, 4-bit models written (seeded, once, into a
cache dir) with mlx-lm's own model classes and its quantize / save helpers,
with a word-level tokenizer and a small chat template written here:

- ``qwen3``: Qwen3-shaped (head_dim 128, GQA 2:1, q/k norms, tied
  embeddings), ~40M parameters;
- ``gpt_oss``: gpt-oss-shaped (attention sinks, 128-token sliding window on
  every other layer, 8 experts, 2 active), for the sinks + window paths;
- ``gemma3_text``: Gemma-3-shaped (270M's layer shape, 512-token sliding
  window on 5 of every 6 layers), for the window path.

They are smaller than the models users run because a shared 2-core CPU
prefills 4-bit weights slowly on both sides: ``--large`` takes a ~160M
Qwen3 shape (hidden 1024) instead, which prefilled 128 tokens at 4-6 tok/s
here under load (a 2k prompt: ~7 minutes a run).

The output row of the end-of-text token is zeroed so that greedy decoding
of random weights never stops early (every run decodes its full count).
The float weights (scales, norms, embeddings) are float32: on MLX's CPU
device a 4-bit matmul with bfloat16 scales runs ~12x slower than with
float32 ones and with float16 ~70x (a Mac checkpoint's bfloat16 would
measure MLX's CPU fallbacks here, not the attention paths; ``--dtype``).

Measured:

- ``mlx-attn generate --engine mlx-lm`` against ``mlx_lm.generate`` (each a
  fresh process, the CLI's own statistics lines): prompt and decode tokens/s
  at 128 and 2k prompt tokens on qwen3, at 128 and 1k (past both windows) on
  the others;
- ``mlx-attn serve --engine mlx-lm`` against ``mlx_lm.server`` on the qwen3
  model at concurrency 1, 4 and 16 (streamed greedy chat requests):
  aggregate generated tokens/s, time to first token p50 / p95;
- K/V memory per request (a 2k-prompt request's pages) with ``--kv-bits 4``
  against float16 pages, from the serving page store's sizes, every model.

The machine is shared, so the sides alternate within each phase (generate:
one side then the other, the order flipped every repeat; serve: both
servers up, each load level on one then the other) and the table reports
ratios of the same run. Needs mlx-lm in this Python (the ``mlx-lm``
extra), which is also the peer unless ``--mlx-lm-python`` names another::

    python benchmarks/bench_mlx_lm_models.py            # ~15-20 min on 2 CPU cores
    python benchmarks/bench_mlx_lm_models.py --quick    # smoke run, tiny models

Every subprocess, server start and request is bounded in time, every loop
in count; servers bind 127.0.0.1. Writes OUT/bench_mlx_lm_models.json and
.png (``--out``, default docs/).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kernel_lab.host import cpu_description
from kernel_lab.serving_load import QUESTIONS, Server, free_port, load_phase

ROOT = Path(__file__).resolve().parent.parent
WRITER_VERSION = 1  # part of a checkpoint's cache key: bump when the writer changes what it writes
GENERATE_LIMIT_S = 900.0  # one generate process, at most
SPECIALS = ["<unk>", "<s>", "</s>"]
EOS = "</s>"
CHAT_WORDS = ["user", "system", "assistant", ":"]
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }} : {{ message['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant : {% endif %}")
PROSE = ("Attention lets every token look at every other token . A query is compared with all keys , the scores "
         "are turned into weights by a softmax , and the weights average the values . Long contexts make this "
         "quadratic , which is why fused kernels never store the whole score matrix . ")

# name -> mlx-lm config (the full run); LARGE_SHAPES and QUICK_SHAPES for --large and --quick
SHAPES = {
    "qwen3": dict(model_type="qwen3", hidden_size=512, num_hidden_layers=8, intermediate_size=1536,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6,
                  vocab_size=16384, max_position_embeddings=40960, rope_theta=1000000.0, tie_word_embeddings=True),
    "gpt_oss": dict(model_type="gpt_oss", hidden_size=512, num_hidden_layers=8, intermediate_size=512,
                    num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_local_experts=8,
                    num_experts_per_tok=2, sliding_window=128, rope_theta=150000.0, rms_norm_eps=1e-5,
                    vocab_size=16384, max_position_embeddings=131072,
                    layer_types=["sliding_attention", "full_attention"] * 4),
    "gemma3_text": dict(model_type="gemma3_text", hidden_size=640, num_hidden_layers=12, intermediate_size=2048,
                        num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                        rms_norm_eps=1e-6, vocab_size=16384, max_position_embeddings=32768, sliding_window=512,
                        sliding_window_pattern=6, rope_theta=1000000.0, rope_local_base_freq=10000.0),
}
LARGE_SHAPES = dict(SHAPES, qwen3=dict(SHAPES["qwen3"], hidden_size=1024, intermediate_size=3072,
                                       num_attention_heads=16, num_key_value_heads=8, vocab_size=32768))
QUICK_SHAPES = {
    "qwen3": dict(SHAPES["qwen3"], hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=512),
    "gpt_oss": dict(SHAPES["gpt_oss"], hidden_size=128, num_hidden_layers=2, intermediate_size=128,
                    num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, sliding_window=16,
                    vocab_size=512, layer_types=["sliding_attention", "full_attention"]),
    "gemma3_text": dict(SHAPES["gemma3_text"], hidden_size=128, num_hidden_layers=3, intermediate_size=256,
                        num_attention_heads=2, head_dim=64, query_pre_attn_scalar=64, sliding_window=16,
                        sliding_window_pattern=3, vocab_size=512),
}


# ---------------------------------------------------------------- checkpoints
def vocabulary(size: int) -> list[str]:
    """Special tokens, every word of the prompts this benchmark sends (so none
    is unknown), then filler words up to ``size``."""
    words = list(SPECIALS)
    for text in [PROSE, *QUESTIONS, " ".join(CHAT_WORDS)]:
        for word in re.findall(r"\w+|[^\w\s]+", text):
            if word not in words:
                words.append(word)
    if len(words) > size:
        raise ValueError(f"vocab_size {size} is smaller than the {len(words)} words the prompts use")
    return words + [f"w{i}" for i in range(size - len(words))]


def write_tokenizer(directory: Path, size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocabulary(size))}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": EOS, "unk_token": "<unk>",
        "model_max_length": 131072, "chat_template": CHAT_TEMPLATE}))


def write_checkpoint(directory: Path, config: dict, *, seed: int = 0, dtype: str = "float32", bits: int = 4,
                     group_size: int = 64) -> Path:
    """A random-weight checkpoint of mlx-lm's class for ``config``: cast to
    ``dtype`` and quantized to ``bits`` with mlx-lm's helpers (as
    ``mlx_lm.convert -q`` writes mlx-community's checkpoints)."""
    import mlx.core as mx
    import mlx.utils
    import mlx_lm.utils

    mx.random.seed(seed)
    model_type = config["model_type"]
    module = importlib.import_module(f"mlx_lm.models.{mlx_lm.utils.MODEL_REMAPPING.get(model_type, model_type)}")
    model = module.Model(module.ModelArgs.from_dict(config))
    if model_type == "gpt_oss":  # sinks that matter: mlx-lm initialises them to 0
        for layer in model.layers:
            layer.self_attn.sinks = mx.random.normal(layer.self_attn.sinks.shape)
    if model_type == "gemma3_text":  # Gemma 3 ties its output to the embedding
        model.pop("lm_head")
    head = model.lm_head if "lm_head" in model else model.model.embed_tokens
    eos = SPECIALS.index(EOS)
    head.weight = head.weight * (mx.arange(head.weight.shape[0]) != eos)[:, None]  # logit 0: never the greedy pick
    model.update(mlx.utils.tree_map(lambda a: a.astype(getattr(mx, dtype)), model.parameters()))
    mx.eval(model.parameters())
    config = dict(config, eos_token_id=eos, torch_dtype=dtype)
    model, config = mlx_lm.utils.quantize_model(model, config, group_size=group_size, bits=bits)
    directory.mkdir(parents=True, exist_ok=True)
    mlx_lm.utils.save_model(directory, model)
    mlx_lm.utils.save_config(config, directory / "config.json")
    write_tokenizer(directory, config["vocab_size"])
    return directory


def checkpoint(work: Path, name: str, config: dict, seed: int = 0, dtype: str = "float32") -> Path:
    """``write_checkpoint``'s directory for this config under ``work``,
    written once (keyed by the config, seed, dtype and the writer's version)."""
    key = hashlib.sha256(json.dumps([config, seed, dtype, WRITER_VERSION], sort_keys=True).encode()).hexdigest()[:12]
    directory = work / f"{name}-4bit-{key}"
    if not (directory / "config.json").exists():
        work.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=work))
        write_checkpoint(partial / "model", config, seed=seed, dtype=dtype)
        (partial / "model").rename(directory)
        partial.rmdir()
    return directory


def parameter_count(directory: Path) -> int:
    """Parameters of the checkpoint before quantization (packed weights unpacked)."""
    import mlx.core as mx

    config = json.loads((directory / "config.json").read_text())
    bits = config["quantization"]["bits"]
    total = 0
    for file in directory.glob("*.safetensors"):
        for name, array in mx.load(str(file)).items():
            if name.endswith((".scales", ".biases")):
                continue
            packed = array.dtype == mx.uint32 and name.replace(".weight", ".scales") != name
            total += array.size * (32 // bits) if packed else array.size
    return total


# ---------------------------------------------------------------- generate
STATISTICS = re.compile(r"Prompt: (\d+) tokens, ([\d.]+) tokens-per-sec\s+Generation: (\d+) tokens, ([\d.]+) "
                        r"tokens-per-sec\s+Peak memory: ([\d.]+) GB")


def prompt_text(tokens: int) -> str:
    """``tokens`` words of PROSE (each one token of the benchmark's vocabulary)."""
    words = PROSE.split()
    return " ".join(words[i % len(words)] for i in range(tokens))


def generate_command(side: str, python: str, model_dir: Path, prompt: str, max_tokens: int) -> list[str]:
    common = ["--model", str(model_dir), "--prompt", prompt, "--max-tokens", str(max_tokens),
              "--ignore-chat-template"]
    if side == "mlx_attn":
        return [python, "-m", "mlx_attn.lm", "generate", "--engine", "mlx-lm", "--verbose", *common]
    return [python, "-m", "mlx_lm", "generate", *common]


def parse_statistics(output: str) -> dict:
    """The three statistics lines both CLIs print (mlx-lm's format)."""
    found = STATISTICS.findall(output)
    if not found:
        raise RuntimeError(f"no statistics lines in the output:\n{output[-2000:]}")
    prompt, prompt_tps, generated, generation_tps, peak = found[-1]
    return {"prompt_tokens": int(prompt), "prompt_tps": float(prompt_tps), "generation_tokens": int(generated),
            "generation_tps": float(generation_tps), "peak_memory_gb": float(peak)}


def generate_once(side: str, python: str, model_dir: Path, prompt_tokens: int, max_tokens: int) -> dict:
    command = generate_command(side, python, model_dir, prompt_text(prompt_tokens), max_tokens)
    done = subprocess.run(command, capture_output=True, text=True, timeout=GENERATE_LIMIT_S,
                          cwd=tempfile.gettempdir())  # outside a checkout: the installed mlx_attn runs
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:6])} ... exited with {done.returncode}:\n{done.stderr[-2000:]}")
    result = parse_statistics(done.stdout + done.stderr)
    if result["prompt_tokens"] != prompt_tokens:
        raise RuntimeError(f"{side} saw {result['prompt_tokens']} prompt tokens, {prompt_tokens} were sent")
    return result


def generate_phase(pythons: dict, model_dir: Path, prompt_tokens: int, max_tokens: int, repeats: int,
                   turn: int = 0) -> dict:
    """Each side ``repeats`` times, alternating (the order flips every
    repeat); the median of each measure per side. The side that runs first
    takes the turn after an earlier phase's last: no side always starts."""
    runs = {side: [] for side in pythons}
    sides = list(pythons)
    for repeat in range(turn, turn + repeats):
        for side in (sides if repeat % 2 == 0 else sides[::-1]):
            runs[side].append(generate_once(side, pythons[side], model_dir, prompt_tokens, max_tokens))
    out = {side: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for side, rs in runs.items()}
    out["runs"] = runs
    return out


# ---------------------------------------------------------------- serve
def serve_phase(pythons: dict, model_dir: Path, levels: list[tuple[int, int]], max_tokens: int, logs: Path) -> dict:
    """Both servers up at once; each load level on one, then on the other."""
    commands = {
        "mlx_attn": [pythons["mlx_attn"], "-m", "mlx_attn.lm", "serve", "--model", str(model_dir), "--engine",
                     "mlx-lm", "--log-level", "warning", "--max-tokens", str(max_tokens)],
        "mlx_lm": [pythons["mlx_lm"], "-m", "mlx_lm", "server", "--model", str(model_dir), "--host", "127.0.0.1",
                   "--log-level", "WARNING", "--max-tokens", str(max_tokens)],
    }
    results = {side: [] for side in commands}
    running = {}
    try:
        for side, command in commands.items():
            port = free_port()
            running[side] = (port, Server(side, [*command, "--port", str(port)], port, logs / f"{side}.log", cwd=logs))
        for i, (concurrency, requests) in enumerate(levels):
            for side in (list(running) if i % 2 == 0 else list(running)[::-1]):
                phase = load_phase(running[side][0], concurrency, requests, max_tokens)
                results[side].append(phase)
                print(f"  serve {side} c{concurrency}: {phase['tokens_per_s']:.1f} tokens/s, TTFT p50 "
                      f"{phase['ttft_p50']:.2f} s", flush=True)
    finally:
        for _, server in running.values():
            server.stop()
    return results


# ---------------------------------------------------------------- memory
def memory_per_request(model_dir: Path, tokens: int, page_size: int = 16) -> dict:
    """K/V bytes of one request's pages (``tokens`` rounded up to pages) in
    the serving engine's page store, float16 and 4-bit, for the layers the
    engine pages (every attention layer, windowed ones included)."""
    import mlx.core as mx

    from mlx_attn.lm import mlx_lm_models
    from mlx_attn.serve.kv_store import PagedKVStore
    from mlx_attn.serve.mlx_lm_paged import MlxLmPagedModel

    paged = MlxLmPagedModel(mlx_lm_models.load(model_dir)[0])
    layers = paged.attention_layers()
    head_dim = layers[0].head_dim
    pages = -(-tokens // page_size)
    sizes = {name: PagedKVStore(pages, page_size, len(layers), paged.config.num_key_value_heads, head_dim,
                                value_dim=paged.value_dim, dtype=mx.float16, bits=bits).nbytes
             for name, bits in (("float16", None), ("4-bit", 4))}
    windows = [layer.window_size for layer in layers]
    return {**sizes, "tokens": tokens, "layers": len(layers), "full_attention_layers": windows.count(None)}


# ---------------------------------------------------------------- report
def _met(value: float, target: str) -> str:
    if not target:
        return ""
    bound = float(target.split()[1].rstrip("x"))
    return "yes" if (value >= bound if target.startswith(">=") else value <= bound) else "NO"


def table(results: dict) -> str:
    """The Markdown table: mlx_attn, mlx-lm, their ratio, the issue's target."""
    rows = ["| model | workload | mlx_attn | mlx-lm | ratio | target | met |", "|---|---|---|---|---|---|---|"]

    def row(model, label, ours, theirs, fmt, target=""):
        ratio = ours / theirs if theirs else None
        rows.append(f"| {model} | {label} | {fmt.format(ours)} | {fmt.format(theirs) if theirs is not None else '-'} "
                    f"| {f'{ratio:.2f}x' if ratio is not None else '-'} | {target} | "
                    f"{_met(ratio, target) if ratio is not None else ''} |")

    decode_targets = {128: ">= 1.0x", 2048: ">= 1.2x"}
    for name, model in results["models"].items():
        for length, phase in model.get("generate", {}).items():
            length = int(length)
            ours, theirs = phase["mlx_attn"], phase["mlx_lm"]
            label = f"generate, {length}-token prompt"
            row(name, f"{label}: prompt tok/s", ours["prompt_tps"], theirs["prompt_tps"], "{:.1f}")
            target = decode_targets.get(length, "") if name == "qwen3" else ""
            row(name, f"{label}: decode tok/s ({ours['generation_tokens']:.0f} tokens)", ours["generation_tps"],
                theirs["generation_tps"], "{:.1f}", target)
    for name, model in results["models"].items():
        serve = model.get("serve")
        if not serve:
            continue
        for ours, theirs in zip(serve["mlx_attn"], serve["mlx_lm"]):
            c = ours["concurrency"]
            row(name, f"serve c{c}: aggregate tok/s ({ours['requests']} requests x {ours['max_tokens']} tokens)",
                ours["tokens_per_s"], theirs["tokens_per_s"], "{:.1f}", ">= 5.0x" if c == 16 else "")
            row(name, f"serve c{c}: TTFT p50 (s)", ours["ttft_p50"], theirs["ttft_p50"], "{:.2f}",
                "<= 0.3x" if c == 16 else "")
            row(name, f"serve c{c}: TTFT p95 (s)", ours["ttft_p95"], theirs["ttft_p95"], "{:.2f}")
    for name, model in results["models"].items():
        memory = model.get("memory")
        if not memory:
            continue
        ratio = memory["4-bit"] / memory["float16"]
        target = "<= 0.35x" if memory["full_attention_layers"] else ""
        rows.append(f"| {name} | K/V per {memory['tokens']}-token request, 4-bit / float16 pages (KiB; "
                    f"{memory['layers']} paged layers, {memory['full_attention_layers']} full) | "
                    f"{memory['4-bit'] / 1024:.0f} / {memory['float16'] / 1024:.0f} | - | {ratio:.2f}x | {target} | "
                    f"{_met(ratio, target)} |")
    return "\n".join(rows)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    width = 0.38
    labels, ours, theirs = [], [], []
    for name, model in results["models"].items():
        for length, phase in model.get("generate", {}).items():
            labels.append(f"{name}\n{length} prompt")
            ours.append(phase["mlx_attn"]["generation_tps"])
            theirs.append(phase["mlx_lm"]["generation_tps"])
    x = range(len(labels))
    axes[0].bar([i - width / 2 for i in x], ours, width, label="mlx-attn generate")
    axes[0].bar([i + width / 2 for i in x], theirs, width, label="mlx_lm.generate")
    axes[0].set_xticks(list(x), labels, fontsize=8)
    axes[0].set_title("decode tokens/s")
    axes[0].legend()
    serve = results["models"].get("qwen3", {}).get("serve")
    if serve:
        levels = [p["concurrency"] for p in serve["mlx_attn"]]
        x = range(len(levels))
        for ax, key, title in ((axes[1], "tokens_per_s", "qwen3 serve: aggregate tokens/s"),
                               (axes[2], "ttft_p50", "qwen3 serve: TTFT p50 (s)")):
            ax.bar([i - width / 2 for i in x], [p[key] for p in serve["mlx_attn"]], width, label="mlx-attn serve")
            ax.bar([i + width / 2 for i in x], [p[key] for p in serve["mlx_lm"]], width, label="mlx_lm.server")
            ax.set_xticks(list(x), [f"c{c}" for c in levels])
            ax.set_title(title)
            ax.legend()
    fig.suptitle(results["title"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- main
def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mlx-lm-python", default=sys.executable,
                        help="the Python that runs mlx_lm.generate / mlx_lm.server (default: this one)")
    parser.add_argument("--models", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--prompts", type=int, nargs="+", default=[128, 2048], help="qwen3's generate prompt tokens")
    parser.add_argument("--other-prompts", type=int, nargs="+", default=[128, 1024],
                        help="the other models' generate prompt tokens")
    parser.add_argument("--decode", type=int, default=32, help="tokens each generate run decodes")
    parser.add_argument("--repeats", type=int, default=2,
                        help="generate runs per side (alternating; median) of qwen3's prompts under 1024 tokens")
    parser.add_argument("--long-repeats", type=int, default=1, help="generate runs per side of the other phases")
    parser.add_argument("--large", action="store_true", help="a ~160M-parameter qwen3 (slow here: see above)")
    parser.add_argument("--requests", type=int, nargs=3, default=[2, 8, 16], metavar=("C1", "C4", "C16"),
                        help="requests of each serving concurrency")
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens of each serving request")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32",
                        help="the checkpoints' float weights and quantization scales")
    parser.add_argument("--no-serve", action="store_true", help="leave the serving phase out")
    parser.add_argument("--work-dir", default=None, help="where the checkpoints are kept (default: a cache dir)")
    parser.add_argument("--out", default=str(ROOT / "docs"), help="folder for the .json and .png")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny models, short prompts, few requests")
    args = parser.parse_args(argv)
    shapes = LARGE_SHAPES if args.large else SHAPES
    if args.quick:
        shapes = QUICK_SHAPES
        args.prompts, args.other_prompts, args.decode, args.repeats, args.long_repeats = [32, 96], [32, 96], 4, 1, 1
        args.requests, args.max_tokens = [1, 4, 16], 4

    from mlx_attn.lm.model_store import cache_dir

    work = Path(args.work_dir) if args.work_dir else cache_dir() / "bench_mlx_lm_models"
    work.mkdir(parents=True, exist_ok=True)
    pythons = {"mlx_attn": sys.executable, "mlx_lm": args.mlx_lm_python}
    cpu = cpu_description()
    results = {"title": "", "cpu": cpu, "config": vars(args), "models": {}}
    logs = Path(tempfile.mkdtemp(prefix="bench_mlx_lm_models_"))
    started = time.perf_counter()
    turn = 0  # generate phases continue one alternation: the side that ran last starts the next
    for name in args.models:
        model_dir = checkpoint(work, name, shapes[name], dtype=args.dtype)
        entry = results["models"][name] = {"directory": str(model_dir), "parameters": parameter_count(model_dir)}
        print(f"{name}: {entry['parameters'] / 1e6:.0f}M parameters, 4-bit, {model_dir}", flush=True)
        entry["generate"] = {}
        for length in (args.prompts if name == "qwen3" else args.other_prompts):
            repeats = args.repeats if name == "qwen3" and length < 1024 else args.long_repeats
            phase = generate_phase(pythons, model_dir, length, args.decode, repeats, turn)
            turn += repeats
            entry["generate"][length] = phase
            print(f"  generate {length}: decode {phase['mlx_attn']['generation_tps']:.1f} vs "
                  f"{phase['mlx_lm']['generation_tps']:.1f} tok/s, prompt {phase['mlx_attn']['prompt_tps']:.1f} vs "
                  f"{phase['mlx_lm']['prompt_tps']:.1f} tok/s", flush=True)
        if name == "qwen3" and not args.no_serve:
            levels = list(zip((1, 4, 16), args.requests))
            entry["serve"] = serve_phase(pythons, model_dir, levels, args.max_tokens, logs)
        entry["memory"] = memory_per_request(model_dir, max(args.prompts) + args.decode)
    results["seconds"] = time.perf_counter() - started
    results["title"] = (f"mlx-lm architectures, random-weight 4-bit checkpoints; mlx_attn vs mlx-lm, one run, "
                        f"{cpu['model']} ({os.cpu_count()} CPUs)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_mlx_lm_models.json").write_text(json.dumps(results, indent=1))
    plot(results, out / "bench_mlx_lm_models.png")
    print(results["title"])
    print(table(results))
    print(f"wrote {out / 'bench_mlx_lm_models.png'} and .json in {results['seconds']:.0f} s; server logs in {logs}")
    return results


if __name__ == "__main__":
    main()
    sys.exit(0)
