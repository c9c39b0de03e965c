"""Which MLX affine quantization to re-quantize a Gemma 3 GGUF into: the
last-position logits of a few prompts under each (bits, group size) against
the dequantized float32 model (the GGUF's own values, no re-quantization).
Prints a Markdown table (the one in docs/gemma3.md)."""

from __future__ import annotations

import argparse
import sys
import time

import mlx.core as mx
import numpy as np

from mlx_attn.lm import gguf_tensors, load_model
from mlx_attn.lm.gguf_tensors import QuantizationPolicy

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "Water boils at a temperature of",
    "Shall I compare thee to a summer's day? Thou art more lovely and more temperate:",
]
POLICIES = [("exact", 32), (4, 32), (4, 64), (5, 64), (6, 64), (8, 64), (8, 32)]


def load_with(path: str, policy: QuantizationPolicy):
    """The model as load_model builds it, with another re-quantization."""
    previous = gguf_tensors.DEFAULT_POLICY
    gguf_tensors.DEFAULT_POLICY = policy
    try:
        return load_model(path)
    finally:
        gguf_tensors.DEFAULT_POLICY = previous


def last_logits(model, tokenizer) -> list[np.ndarray]:
    return [np.array(model(mx.array([tokenizer.encode(p)]))[0, -1].astype(mx.float32)) for p in PROMPTS]


def log_softmax(x):
    x = x.astype(np.float64) - x.max()
    return x - np.log(np.exp(x).sum())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("gguf")
    parser.add_argument("--quick", action="store_true", help="only the default (exact) and 8-bit rows")
    args = parser.parse_args(argv)
    policies = [POLICIES[0], POLICIES[-1]] if args.quick else POLICIES
    model, tokenizer = load_with(args.gguf, QuantizationPolicy(bits=None))
    reference = last_logits(model, tokenizer)
    del model
    print("| bits | group | weights MiB | max abs logit error | mean abs error | max KL (nats) | top-1 agrees |")
    print("|---|---|---|---|---|---|---|")
    for bits, group in policies:
        start = time.perf_counter()
        model, _ = load_with(args.gguf, QuantizationPolicy(bits=bits, group_size=group))
        size = sum(v.nbytes for _, v in __import__("mlx.utils").utils.tree_flatten(model.parameters())) / 2**20
        got = last_logits(model, tokenizer)
        del model
        errors = [np.abs(g - r) for g, r in zip(got, reference)]
        kls = [float((np.exp(log_softmax(r)) * (log_softmax(r) - log_softmax(g))).sum()) for g, r in zip(got, reference)]
        agree = sum(int(g.argmax() == r.argmax()) for g, r in zip(got, reference))
        print(f"| {bits} | {group} | {size:.0f} | {max(e.max() for e in errors):.3f} | "
              f"{np.mean([e.mean() for e in errors]):.4f} | {max(kls):.5f} | {agree}/{len(PROMPTS)} |", flush=True)
        print(f"  ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
