"""Next-token sampling: greedy, temperature, top-k, top-p (nucleus), min-p,
and a repetition penalty."""

from __future__ import annotations

from typing import Callable, Iterable

import mlx.core as mx

__all__ = ["make_sampler", "apply_repetition_penalty"]

Sampler = Callable[[mx.array], mx.array]


def apply_repetition_penalty(logits: mx.array, previous: Iterable[int], penalty: float) -> mx.array:
    """Make tokens that already occurred less likely (CTRL-style): positive
    logits are divided by ``penalty``, negative ones multiplied. ``logits``
    is ``[vocab]`` or ``[1, vocab]``."""
    if penalty <= 0:
        raise ValueError(f"repetition penalty must be > 0, got {penalty}")
    ids = sorted(set(int(t) for t in previous))
    if penalty == 1.0 or not ids:
        return logits
    index = mx.array(ids)
    chosen = logits[..., index]
    chosen = mx.where(chosen > 0, chosen / penalty, chosen * penalty)
    logits = mx.array(logits)
    logits[..., index] = chosen
    return logits


def make_sampler(
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> Sampler:
    """``sampler(logits [B, vocab]) -> tokens [B]``. Temperature 0 is greedy;
    otherwise the filters (top-k, then top-p, then min-p) remove unlikely
    tokens and one is drawn from the rest with MLX's global random state
    (seed it with ``mx.random.seed``)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if not 0.0 <= min_p < 1.0:
        raise ValueError(f"min_p must be in [0, 1), got {min_p}")
    if temperature == 0:
        return lambda logits: mx.argmax(logits, axis=-1)

    def sample(logits: mx.array) -> mx.array:
        logits = logits.astype(mx.float32) / temperature
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if top_k and top_k < logits.shape[-1]:
            kth = mx.sort(logprobs, axis=-1)[..., -top_k][..., None]
            logprobs = mx.where(logprobs >= kth, logprobs, -mx.inf)
        if top_p < 1.0:
            order = mx.argsort(-logprobs, axis=-1)
            sorted_probs = mx.exp(mx.take_along_axis(logprobs, order, axis=-1))
            before = mx.cumsum(sorted_probs, axis=-1) - sorted_probs  # mass of strictly better tokens
            keep_sorted = before < top_p  # always keeps the best token
            keep = mx.zeros_like(keep_sorted)
            keep = mx.put_along_axis(keep, order, keep_sorted, axis=-1)
            logprobs = mx.where(keep, logprobs, -mx.inf)
        if min_p > 0.0:
            best = logprobs.max(axis=-1, keepdims=True)
            logprobs = mx.where(logprobs >= best + mx.log(mx.array(min_p)), logprobs, -mx.inf)
        return mx.random.categorical(logprobs, axis=-1)

    return sample
