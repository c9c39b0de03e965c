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

Draft-model speculation (``--speculative draft``) runs in the engine
(``Engine(speculative="draft")``, what ``mlx-attn serve --speculative draft``
runs; its rows alternate with the two above, against the same side without
drafts; ``--draft-back-off`` with or without the timed back-off,
``--no-engine-draft`` leaves them out) and in the generate phases. The
draft (``--draft``) is the target's own weights dequantized and
quantized again to 4 bits in groups of 64
(:func:`requantized_draft`), or its first ``--draft-layers`` layers with
its final norm and head (:func:`truncated_draft`): both share the
tokenizer and vocabulary by construction (docs/serving.md says why the
first, and what the others measured). With ``--mlx-lm-python`` (a Python
with mlx-lm, e.g. the ``mlx-lm`` extra's venv), ``mlx-attn generate`` and
``mlx_lm.generate`` each run as a command, without and with
``--draft-model``, on the same two checkpoints (the default GGUF and its
draft, written by ``mlx-attn convert``'s writer), alternating run by run.

    python benchmarks/bench_speculative.py            # docs/bench_speculative.{json,png}
    python benchmarks/bench_speculative.py --quick    # smoke run
    python benchmarks/bench_speculative.py --only-generate --mlx-lm-python /path/to/mlx-lm-venv/bin/python
    python benchmarks/bench_speculative.py --only-engine --engine-workloads chat --draft-back-off both
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx_attn

mlx_attn.use_system_blas()  # before MLX loads: batched float32 matmuls through OpenBLAS, as mlx-attn serve runs

import numpy as np  # noqa: E402

from mlx_attn.lm import load_model  # noqa: E402
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from kernel_lab.serving_load import QUESTIONS  # noqa: E402  (bench_serve.py's open chat prompts)
from mlx_attn.lm.convert import save_mlx_directory  # noqa: E402
from mlx_attn.lm.quantized_matmul import use_row_adaptive_matmuls  # noqa: E402
from mlx_attn.lm.generate import GenerationConfig, draft_model_steps, generate_step, speculative_steps  # noqa: E402
from mlx_attn.lm.speculative import DraftLength  # noqa: E402
from mlx_attn.serve import Engine  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# the draft model of the generate phases: the target's weights requantized to
# 4 bits in groups of 64 (why, and what else was measured: docs/serving.md)
DEFAULT_DRAFT = "requantized"
DEFAULT_DRAFT_LAYERS = 8
EDIT_FILES = ["mlx_attn/serve/pages.py", "mlx_attn/lm/generate.py", "mlx_attn/serve/kv_store.py"]


def source_file(min_lines: int, max_lines: int) -> tuple[str, str]:
    """(path, text) of the first of EDIT_FILES whose length is in range
    (cut to ``max_lines`` otherwise)."""
    for name in EDIT_FILES:
        lines = (ROOT / name).read_text().splitlines()
        if min_lines <= len(lines) <= max_lines:
            return name, "\n".join(lines)
    lines = (ROOT / EDIT_FILES[0]).read_text().splitlines()[:max_lines]
    return EDIT_FILES[0], "\n".join(lines)


def _renamed(text: str, i: int) -> tuple[str, str]:
    functions = re.findall(r"^\s*def (\w+)\(", text, re.M) or ["main"]
    name = functions[i % len(functions)]
    return name, f"{name}_v{i + 2}"


def edit_request(text: str, i: int) -> str:
    name, new_name = _renamed(text, i)
    return (f"Here is a Python file:\n\n```python\n{text}\n```\n\nRewrite the file with the function `{name}` "
            f"renamed to `{new_name}` (and its uses). Reply with the whole file only.")


def plain_edit_request(text: str, i: int) -> str:
    """The edit as a completion, for a base model (no chat template): the
    file, the change, then the opening of the changed file."""
    name, new_name = _renamed(text, i)
    return (f"Here is a Python file:\n\n```python\n{text}\n```\n\nThe same file with the function `{name}` "
            f"renamed to `{new_name}` (and its uses):\n\n```python\n")


def prompt_tokens(tokenizer, ask: str, completion: str) -> list[int]:
    """``ask`` as a user turn of the model's chat template, or ``completion``
    as plain text where the model has none (a base model)."""
    if not tokenizer.chat_template:
        return tokenizer.encode(completion)
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": ask}]), add_special_tokens=False)


def edit_prompts(tokenizer, text: str, count: int) -> list[list[int]]:
    return [prompt_tokens(tokenizer, edit_request(text, i), plain_edit_request(text, i)) for i in range(count)]


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(count)]
    return [prompt_tokens(tokenizer, q, f"Question: {q}\nAnswer:") for q in questions]


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


def truncated_draft(model, layers: int):
    """A draft model sharing ``model``'s weights: its first ``layers``
    decoder blocks, then its final norm and output head (the same
    tokenizer and vocabulary by construction; no extra memory)."""
    if not 1 <= layers <= len(model.layers):
        raise ValueError(f"--draft-layers must be in 1..{len(model.layers)}, got {layers}")
    config = dataclasses.replace(model.config, num_hidden_layers=layers)
    draft = type(model)(config, backend=model.backend)  # then every module replaced by the model's own
    draft.embed_tokens, draft.layers, draft.norm = model.embed_tokens, model.layers[:layers], model.norm
    if "lm_head" in model:
        draft.lm_head = model.lm_head
    return draft


def requantized_draft(model, bits: int = 4, group_size: int = 64):
    """A draft model of ``model``'s own weights, dequantized and quantized
    again with ``bits`` and ``group_size`` (a float model: quantized so)."""
    weights = {}
    for name, module in model.named_modules():
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            weights[f"{name}.weight"] = mx.dequantize(module.weight, module.scales, module.biases,
                                                      module.group_size, module.bits)
    for name, value in tree_flatten(model.parameters()):
        owner, _, leaf = name.rpartition(".")
        if f"{owner}.weight" not in weights or leaf not in ("weight", "scales", "biases"):
            weights[name] = value
    draft = type(model)(model.config, backend=model.backend)
    draft.load_weights(list(weights.items()))
    # a layer whose rows do not split into whole groups stays float (the tests' tiny model)
    nn.quantize(draft, group_size=group_size, bits=bits,
                class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % group_size == 0)
    use_row_adaptive_matmuls(draft)  # the extension's CPU matvec, as loading gives the model
    mx.eval(draft.parameters())
    return draft


def make_draft(model, kind: str, layers: int):
    """``--draft``: ``requantized`` (the default: see DEFAULT_DRAFT) or ``truncated``."""
    return requantized_draft(model) if kind == "requantized" else truncated_draft(model, min(layers, len(model.layers)))


def generate_phase(model, prompt, max_tokens: int, speculative: str | None, eos, draft=None) -> dict:
    config = GenerationConfig(max_tokens=max_tokens, speculative=speculative, draft_model=draft)
    length = DraftLength(config.num_draft_tokens)
    tokens = []
    start = time.perf_counter()
    if speculative == "draft":
        steps = draft_model_steps(model, prompt, config, model.make_cache(), length)
    elif speculative:
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


# ---------------------------------------------------------------- the commands, against mlx_lm.generate
STATISTICS = re.compile(r"Prompt: (\d+) tokens, ([\d.]+) tokens-per-sec\s+Generation: (\d+) tokens, ([\d.]+) "
                        r"tokens-per-sec")
COMMAND_LIMIT_S = 600


def command_side(side: str, python: str, target: Path, draft: Path, prompt: str, max_tokens: int) -> list[str]:
    """``side``: ``mlx_attn`` / ``mlx_lm``, ``+draft`` for --draft-model."""
    tool, _, drafted = side.partition("+")
    common = ["--model", str(target), "--prompt", prompt, "--max-tokens", str(max_tokens)]
    if tool == "mlx_attn":
        command = [python, "-m", "mlx_attn.lm", "generate", "--verbose", *common]
        return command + (["--speculative", "draft", "--draft-model", str(draft)] if drafted else [])
    return [python, "-m", "mlx_lm", "generate", *common] + (["--draft-model", str(draft)] if drafted else [])


def run_command(command: list[str]) -> dict | None:
    """The statistics of one run; None when it ran past COMMAND_LIMIT_S
    (mlx-lm's CPU prefill of the edit prompt does on a loaded 2-core machine)."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=COMMAND_LIMIT_S,
                              cwd=tempfile.gettempdir())  # outside a checkout: the installed mlx_attn runs
    except subprocess.TimeoutExpired:
        return None
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:5])} ... exited with {done.returncode}:\n{done.stderr[-2000:]}")
    found = STATISTICS.findall(done.stdout + done.stderr)
    if not found:
        raise RuntimeError(f"no statistics lines in the output of {' '.join(command[:5])}:\n{done.stdout[-2000:]}")
    prompt, _, generated, tps = found[-1]
    text = done.stdout.split("=" * 10)[1] if done.stdout.count("=" * 10) >= 2 else ""
    return {"prompt_tokens": int(prompt), "generated": int(generated), "tokens_per_s": float(tps), "text": text}


def commands_phase(pythons: dict, target: Path, draft: Path, prompt: str, max_tokens: int, repeats: int) -> dict:
    """Each side ``repeats`` times, the order of the sides turned round every
    repeat; the median tokens/s per side."""
    sides = [s for s in ("mlx_attn", "mlx_attn+draft", "mlx_lm", "mlx_lm+draft") if s.split("+")[0] in pythons]
    runs = {side: [] for side in sides}
    for repeat in range(repeats):
        for side in (sides if repeat % 2 == 0 else sides[::-1]):
            python = pythons[side.split("+")[0]]
            runs[side].append(run_command(command_side(side, python, target, draft, prompt, max_tokens)))
    out = {}
    for side, rs in runs.items():
        done = [r for r in rs if r is not None]
        out[side] = ({"tokens_per_s": statistics.median(r["tokens_per_s"] for r in done),
                      "prompt_tokens": done[0]["prompt_tokens"], "generated": done[0]["generated"],
                      "text": done[0]["text"], "timed_out": len(rs) - len(done)} if done else
                     {"tokens_per_s": float("nan"), "prompt_tokens": 0, "generated": 0, "text": None,
                      "timed_out": len(rs)})
    return out


def write_pair(model, draft, tokenizer, name: str, work: Path) -> tuple[Path, Path]:
    """The target and its draft as mlx-lm directories (kept under ``work``
    between runs: the same weights for both tools)."""
    target_dir, draft_dir = work / "target", work / f"draft-{name}"
    for path, weights in ((target_dir, model), (draft_dir, draft)):
        if not (path / "config.json").exists():
            save_mlx_directory(weights, tokenizer, path)
    return target_dir, draft_dir


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
    if results.get("commands"):
        lines += ["", "| command workload | side | tok/s | vs mlx-attn generate | prompt / generated tokens | "
                  "text as mlx-attn generate's |", "|---|---|---|---|---|---|"]
        for workload, phase in results["commands"].items():
            base = phase["mlx_attn"]
            lines += [f"| {workload} | {side} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / base['tokens_per_s']:.2f}x | "
                      f"{r['prompt_tokens']} / {r['generated']} | {r['text'] == base['text']} |"
                      for side, r in phase.items()]
    if results.get("rows"):
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
    left.set_title("speculative decoding (n-gram; generate: also a draft model)")
    rows = results.get("rows") or []
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
    parser.add_argument("--draft", choices=["requantized", "truncated"], default=DEFAULT_DRAFT,
                        help="the draft model: the target's weights requantized to 4 bits in groups of 64, or its "
                             "first --draft-layers layers")
    parser.add_argument("--draft-layers", type=int, default=DEFAULT_DRAFT_LAYERS,
                        help="with --draft truncated: how many of the target's layers the draft keeps")
    parser.add_argument("--mlx-lm-python", default=None,
                        help="a Python with mlx-lm: also time the commands, mlx-attn generate and mlx_lm.generate, "
                             "each without and with --draft-model")
    parser.add_argument("--repeats", type=int, default=3, help="runs per side of each command phase")
    parser.add_argument("--command-workloads", nargs="+", choices=["edit", "chat"], default=["edit", "chat"],
                        help="the workloads of the command phases (mlx_lm.generate's CPU prefill of the edit "
                             f"prompt can run past {COMMAND_LIMIT_S} s on a loaded 2-core machine)")
    parser.add_argument("--work-dir", default=None,
                        help="where the command phases keep the two checkpoints (default: a temporary folder)")
    parser.add_argument("--only-generate", action="store_true", help="leave the engine phases out")
    parser.add_argument("--only-engine", action="store_true",
                        help="the engine phases only (no generate phases, no rows sweep)")
    parser.add_argument("--no-engine-draft", dest="engine_draft", action="store_false",
                        help="leave out the engine phases drafting with the draft model (mlx-attn serve "
                             "--speculative draft)")
    parser.add_argument("--draft-back-off", choices=["on", "off", "both"], default="on",
                        help="the engine drafting with the draft model follows the timed back-off rule (on), "
                             "proposes drafts whatever it says (off: how verification and both rollbacks cost "
                             "at the pair's acceptance rate), or both engines run")
    parser.add_argument("--engine-workloads", nargs="+", choices=["edit", "chat"], default=["edit", "chat"],
                        help="the workloads of the engine phases")
    args = parser.parse_args(argv)
    if args.quick:
        args.max_tokens, args.requests, args.rows, args.file_lines = 8, [1, 1, 2], [1, 2], [20, 60]
        args.repeats = 1
    model, tokenizer = loaded if loaded is not None else load_model(args.model)
    draft = make_draft(model, args.draft, args.draft_layers)
    eos = sorted(tokenizer.eos_token_ids)
    name, text = source_file(*args.file_lines)
    results: dict = {"model": args.model or "default", "file": name, "file_lines": len(text.splitlines()),
                     "max_tokens": args.max_tokens, "draft": args.draft, "draft_layers": len(draft.layers),
                     "target_layers": len(model.layers), "phases": {}}
    if not args.only_generate:
        engine_phases(args, model, tokenizer, text, eos, results, draft if args.engine_draft else None)
    for workload in () if args.only_engine else ("edit", "chat"):
        prompt = (edit_prompts(tokenizer, text, 1) if workload == "edit" else chat_prompts(tokenizer, 1))[0]
        pair = {"workload": f"generate {workload}", "concurrency": 1}
        off = pair["off"] = generate_phase(model, prompt, args.max_tokens, None, set(eos))
        pair["on"] = generate_phase(model, prompt, args.max_tokens, "ngram", set(eos))
        drafted = {"workload": f"generate {workload} draft model", "concurrency": 1, "off": off,
                   "on": generate_phase(model, prompt, args.max_tokens, "draft", set(eos), draft)}
        for key, p in ((f"generate-{workload}", pair), (f"generate-{workload}-draft", drafted)):
            p["identical"] = p["off"]["outputs"] == p["on"]["outputs"]
            results["phases"][key] = p
            print(f"{p['workload']}: {p['off']['tokens_per_s']:.1f} -> {p['on']['tokens_per_s']:.1f} tok/s, "
                  f"accepted {p['on']['accepted_draft_tokens']}/{p['on']['draft_tokens']}, "
                  f"identical {p['identical']}", flush=True)
    if args.mlx_lm_python:
        pythons = {"mlx_attn": sys.executable, "mlx_lm": args.mlx_lm_python}
        work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="bench_speculative_"))
        name = "requantized-4bit-g64" if args.draft == "requantized" else f"{len(draft.layers)}-layers"
        target_dir, draft_dir = write_pair(model, draft, tokenizer, name, work)
        results["commands"] = {}
        for workload in args.command_workloads:
            ask = (edit_request(text, 0) if workload == "edit" else QUESTIONS[0])
            phase = commands_phase(pythons, target_dir, draft_dir, ask, args.max_tokens, args.repeats)
            results["commands"][workload] = phase
            print(f"commands {workload}: " + ", ".join(f"{side} {r['tokens_per_s']:.1f} tok/s"
                                                     for side, r in phase.items()), flush=True)
    if not args.only_generate and not args.only_engine:
        results["rows"] = rows_sweep(model, args.rows)
    print(table(results))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for pair in results["phases"].values():
        for side in ("off", "on"):
            pair[side].pop("outputs", None)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    plot(results, out.with_suffix(".png"))
    return results


def engine_phases(args, model, tokenizer, text: str, eos, results: dict, draft=None) -> None:
    """The engine without and with drafting (n-gram; with ``draft``, also
    an engine drafting with that model), each workload and concurrency.
    The side without drafts is the n-gram engine's requests opted out
    (an n-gram engine pays nothing for them; a draft-model engine still
    runs its draft over every request's rows)."""
    concurrency = [1, 4, 16]
    longest = max(len(p) for workload in args.engine_workloads for p in (
        edit_prompts(tokenizer, text, max(args.requests)) if workload == "edit"
        else chat_prompts(tokenizer, max(args.requests))))
    options = dict(kv_tokens=16 * (longest + args.max_tokens) + 4096, page_size=16, max_batch_tokens=512)
    engines = {"ngram": Engine(model, **options, speculative="ngram")}
    for name, back_off in (("draft", True), ("draft-always", False)):
        if draft is not None and args.draft_back_off in ("both", "on" if back_off else "off"):
            engines[name] = Engine(model, **options, speculative="draft", draft_model=draft)
            if not back_off:  # verification and both rollbacks at the pair's acceptance rate, whatever they cost
                engines[name].scheduler.speculation.cost.worth = lambda *rule: True
    for engine in engines.values():  # first calls' costs out of the timed phases; every engine's cache as warm
        engine_phase(engine, chat_prompts(tokenizer, max(args.requests)), 16, 1, False, eos)
        if "edit" in args.engine_workloads:
            engine_phase(engine, edit_prompts(tokenizer, text, 1), 1, 1, False, eos)
    for workload in args.engine_workloads:
        for c, count in zip(concurrency, args.requests):
            prompts = edit_prompts(tokenizer, text, count) if workload == "edit" else chat_prompts(tokenizer, count)
            labels = {"ngram": workload, "draft": f"{workload} draft model",
                      "draft-always": f"{workload} draft model, no back-off"}
            pairs = {name: {"workload": labels[name], "concurrency": c} for name in engines}
            off = engine_phase(engines["ngram"], prompts, c, args.max_tokens, False, eos)
            for name, engine in engines.items():  # sides alternate: off, n-gram, draft model
                pairs[name].update(off=off, on=engine_phase(engine, prompts, c, args.max_tokens, True, eos))
            for name, pair in pairs.items():
                pair["identical"] = pair["off"]["outputs"] == pair["on"]["outputs"]
                results["phases"][f"{workload}-c{c}" + ("" if name == "ngram" else f"-{name}")] = pair
                print(f"{pair['workload']} c{c}: {pair['off']['tokens_per_s']:.1f} -> "
                      f"{pair['on']['tokens_per_s']:.1f} tok/s, accepted {pair['on']['accepted_draft_tokens']}/"
                      f"{pair['on']['draft_tokens']}, identical {pair['identical']}", flush=True)


if __name__ == "__main__":
    main()
