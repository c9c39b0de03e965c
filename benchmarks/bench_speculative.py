"""Speculative decoding benchmark: the batched engine with and without n-gram
drafting (``Engine(speculative="ngram")``, what ``mlx-attn serve
--speculative ngram`` runs), and ``mlx-attn generate``'s generation API with
and without ``--speculative ngram``, on the default model (SmolLM2-135M-
Instruct), greedy, in one process, in one run.

Workloads:

- **edit**: the prompt holds a 150-400-line source file of this repository
  and asks for it back whole with one small change (rename a function);
  every request of a phase carries the same file (its pages are shared
  through the prefix cache) and a different change;
- **chat**: the open questions ``bench_serve.py`` asks.

Each phase keeps ``concurrency`` requests in flight (1, 4, 16) until its
requests are done and reports generated tokens / wall time, the drafts
proposed and accepted, and whether the greedy outputs of both sides are
identical. Both sides run on one engine built with ``speculative="ngram"``;
the side without drafts submits its requests with ``speculative=False``
(the per-request opt-out), so both share the weights and the warm prefix
cache (a request before the timed phases puts the edited file's pages in
it). The two sides alternate phase by phase, so a drift of a shared
machine's load falls on both. A sweep of one forward's time by rows
(``--rows``) is the measurement behind the back-off rule
(:class:`mlx_attn.serve.scheduler.Speculation`).

    python benchmarks/bench_speculative.py            # docs/bench_speculative.{json,png}
    python benchmarks/bench_speculative.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import mlx_attn

mlx_attn.use_system_blas()  # before MLX loads: batched float32 matmuls through OpenBLAS, as mlx-attn serve runs

import numpy as np  # noqa: E402

from mlx_attn.lm import load_model  # noqa: E402
from mlx_attn.lm.generate import GenerationConfig, generate_step, speculative_steps  # noqa: E402
from mlx_attn.lm.speculative import DraftLength  # noqa: E402
from mlx_attn.serve import Engine  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EDIT_FILES = ["mlx_attn/serve/pages.py", "mlx_attn/lm/generate.py", "mlx_attn/serve/kv_store.py"]
QUESTIONS = [
    "Explain how a bicycle stays upright.", "Write a short poem about the sea.",
    "What is the capital of France and why is it famous?", "Give three tips for learning to cook.",
    "Describe the water cycle.", "Why is the sky blue?", "Tell a short story about a brave mouse.",
    "How do plants make food?", "What are the planets of the solar system?", "Explain what a computer does.",
    "Why do we need sleep?", "Describe a day at the beach.", "How does a rainbow form?",
    "What makes a good friend?", "Explain how bread rises.", "Why do leaves change colour in autumn?",
]  # bench_serve.py's open chat prompts


def source_file(min_lines: int, max_lines: int) -> tuple[str, str]:
    """(path, text) of the first of EDIT_FILES whose length is in range
    (cut to ``max_lines`` otherwise)."""
    for name in EDIT_FILES:
        lines = (ROOT / name).read_text().splitlines()
        if min_lines <= len(lines) <= max_lines:
            return name, "\n".join(lines)
    lines = (ROOT / EDIT_FILES[0]).read_text().splitlines()[:max_lines]
    return EDIT_FILES[0], "\n".join(lines)


def edit_prompts(tokenizer, text: str, count: int) -> list[list[int]]:
    functions = re.findall(r"^\s*def (\w+)\(", text, re.M) or ["main"]
    prompts = []
    for i in range(count):
        name = functions[i % len(functions)]
        ask = (f"Here is a Python file:\n\n```python\n{text}\n```\n\nRewrite the file with the function `{name}` "
               f"renamed to `{name}_v{i + 2}` (and its uses). Reply with the whole file only.")
        prompts.append(tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": ask}]),
                                        add_special_tokens=False))
    return prompts


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]),
                             add_special_tokens=False) for i in range(count)]


def engine_phase(engine, prompts, concurrency: int, max_tokens: int, speculative: bool, eos) -> dict:
    """Keep ``concurrency`` requests in flight until all are done."""
    before = engine.stats()
    outputs: dict = {}
    queue = list(enumerate(prompts))
    in_flight = 0
    start = time.perf_counter()
    steps = 0
    while queue or not engine.idle:
        while queue and in_flight < concurrency:
            i, prompt = queue.pop(0)
            engine.submit(i, prompt, max_tokens, stop_token_ids=eos, speculative=speculative)
            outputs[i] = []
            in_flight += 1
        for out in engine.step():
            outputs[out.request_id].append(out.token)
            in_flight -= out.finished
        steps += 1
        if steps > 100_000:
            raise RuntimeError("the engine did not finish")
    elapsed = time.perf_counter() - start
    stats = engine.stats()
    generated = sum(len(o) for o in outputs.values())
    return {"tokens_per_s": generated / elapsed, "generated": generated, "seconds": elapsed, "steps": steps,
            "draft_tokens": stats["draft_tokens"] - before["draft_tokens"],
            "accepted_draft_tokens": stats["accepted_draft_tokens"] - before["accepted_draft_tokens"],
            "outputs": [outputs[i] for i in range(len(prompts))]}


def generate_phase(model, prompt, max_tokens: int, speculative: str | None, eos) -> dict:
    config = GenerationConfig(max_tokens=max_tokens, speculative=speculative)
    length = DraftLength(config.num_draft_tokens)
    tokens = []
    start = time.perf_counter()
    if speculative:
        steps = speculative_steps(model, prompt, config, model.make_cache(), length)
    else:
        steps = generate_step(model, prompt, config)
    for token, _ in steps:
        tokens.append(token)
        if token in eos:
            break
    elapsed = time.perf_counter() - start
    return {"tokens_per_s": len(tokens) / elapsed, "generated": len(tokens), "seconds": elapsed,
            "draft_tokens": length.proposed, "accepted_draft_tokens": length.accepted, "outputs": [tokens]}


def rows_sweep(model, counts) -> list[dict]:
    """One engine forward of ``rows`` decode rows (separate requests, short
    contexts): the time of a step by how many rows it holds."""
    out = []
    for rows in counts:
        # the weights are already held as the first engine prepared them
        engine = Engine(model, kv_tokens=64 * rows + 64, page_size=16, max_batch_tokens=max(rows, 64),
                        weights="as-loaded")
        for r in range(rows):
            engine.submit(r, [1 + r % 50, 2, 3, 4], 8)
        engine.step()  # prefill
        engine.step()
        times = []
        for _ in range(3):
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        out.append({"rows": rows, "step_ms": 1000 * float(np.median(times))})
    return out


def table(results: dict) -> str:
    lines = ["| workload | concurrency | tok/s without | tok/s with | ratio | drafts accepted / proposed | "
             "greedy identical |", "|---|---|---|---|---|---|---|"]
    for key, pair in results["phases"].items():
        off, on = pair["off"], pair["on"]
        rate = on["accepted_draft_tokens"] / on["draft_tokens"] if on["draft_tokens"] else 0.0
        lines.append(f"| {pair['workload']} | {pair['concurrency']} | {off['tokens_per_s']:.1f} | "
                     f"{on['tokens_per_s']:.1f} | {on['tokens_per_s'] / off['tokens_per_s']:.2f}x | "
                     f"{on['accepted_draft_tokens']}/{on['draft_tokens']} ({rate:.0%}) | {pair['identical']} |")
    lines += ["", "| rows in a step | step ms |", "|---|---|"]
    lines += [f"| {r['rows']} | {r['step_ms']:.1f} |" for r in results["rows"]]
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"{p['workload']}\nc{p['concurrency']}" for p in results["phases"].values()]
    ratios = [p["on"]["tokens_per_s"] / p["off"]["tokens_per_s"] for p in results["phases"].values()]
    left.bar(labels, ratios, color="tab:blue")
    left.axhline(1.0, color="gray", lw=1)
    left.set_ylabel("tokens/s with drafts / without")
    left.set_title("n-gram speculative decoding")
    rows = results["rows"]
    right.plot([r["rows"] for r in rows], [r["step_ms"] for r in rows], marker="o")
    right.set_xscale("log", base=2)
    right.set_xlabel("rows in a step")
    right.set_ylabel("step ms")
    right.set_title("engine step time by rows (back-off rule)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None, loaded=None) -> dict:
    """``loaded``: ``(model, tokenizer)`` to run instead of ``--model`` (the tests' tiny model)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model mlx-attn loads (default: the registered default)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--requests", type=int, nargs=3, default=[1, 4, 16], metavar=("C1", "C4", "C16"),
                        help="requests per phase at concurrency 1, 4, 16")
    parser.add_argument("--file-lines", type=int, nargs=2, default=[150, 400], metavar=("MIN", "MAX"))
    parser.add_argument("--rows", type=int, nargs="*", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--out", default=str(ROOT / "docs" / "bench_speculative"), help="PATH.png and PATH.json")
    parser.add_argument("--quick", action="store_true", help="smoke run: few, short requests")
    args = parser.parse_args(argv)
    if args.quick:
        args.max_tokens, args.requests, args.rows, args.file_lines = 8, [1, 1, 2], [1, 2], [20, 60]
    model, tokenizer = loaded if loaded is not None else load_model(args.model)
    eos = sorted(tokenizer.eos_token_ids)
    name, text = source_file(*args.file_lines)
    concurrency = [1, 4, 16]
    results: dict = {"model": args.model or "default", "file": name, "file_lines": len(text.splitlines()),
                     "max_tokens": args.max_tokens, "phases": {}}
    longest = max(len(p) for p in edit_prompts(tokenizer, text, max(args.requests)))
    engine = Engine(model, kv_tokens=16 * (longest + args.max_tokens) + 4096, page_size=16,
                    max_batch_tokens=512, speculative="ngram")
    engine_phase(engine, edit_prompts(tokenizer, text, 1), 1, 1, False, eos)  # the file's pages, cached
    for workload in ("edit", "chat"):
        for c, count in zip(concurrency, args.requests):
            prompts = edit_prompts(tokenizer, text, count) if workload == "edit" else chat_prompts(tokenizer, count)
            pair = {"workload": workload, "concurrency": c}
            for side, speculative in (("off", False), ("on", True)):
                pair[side] = engine_phase(engine, prompts, c, args.max_tokens, speculative, eos)
            pair["identical"] = pair["off"]["outputs"] == pair["on"]["outputs"]
            results["phases"][f"{workload}-c{c}"] = pair
            print(f"{workload} c{c}: {pair['off']['tokens_per_s']:.1f} -> {pair['on']['tokens_per_s']:.1f} tok/s, "
                  f"accepted {pair['on']['accepted_draft_tokens']}/{pair['on']['draft_tokens']}, "
                  f"identical {pair['identical']}", flush=True)
    for workload in ("edit", "chat"):
        prompt = (edit_prompts(tokenizer, text, 1) if workload == "edit" else chat_prompts(tokenizer, 1))[0]
        pair = {"workload": f"generate {workload}", "concurrency": 1}
        for side, speculative in (("off", None), ("on", "ngram")):
            pair[side] = generate_phase(model, prompt, args.max_tokens, speculative, set(eos))
        pair["identical"] = pair["off"]["outputs"] == pair["on"]["outputs"]
        results["phases"][f"generate-{workload}"] = pair
        print(f"generate {workload}: {pair['off']['tokens_per_s']:.1f} -> {pair['on']['tokens_per_s']:.1f} tok/s, "
              f"identical {pair['identical']}", flush=True)
    results["rows"] = rows_sweep(model, args.rows)
    print(table(results))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for pair in results["phases"].values():
        for side in ("off", "on"):
            pair[side].pop("outputs")
    out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    plot(results, out.with_suffix(".png"))
    return results


if __name__ == "__main__":
    main()
