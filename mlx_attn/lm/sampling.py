"""Next-token sampling: greedy, temperature, top-k, top-p (nucleus), min-p,
and a repetition penalty."""

from __future__ import annotations

from typing import Callable, Iterable

import mlx.core as mx

from mlx_attn.lm.validate import require_float, require_int

__all__ = ["make_sampler", "filtered_logprobs", "apply_repetition_penalty", "check_sampling_parameters", "check_repetition_penalty"]

Sampler = Callable[[mx.array], mx.array]


def apply_repetition_penalty(logits: mx.array, previous: Iterable[int] | mx.array, penalty: float) -> mx.array:
    """Make tokens that already occurred less likely (CTRL-style): positive
    logits are divided by ``penalty``, negative ones multiplied. ``logits``
    is ``[vocab]`` or ``[1, vocab]``. ``previous`` may be an unevaluated
    ``mx.array`` of ids (repeats allowed), so generation need not wait for it."""
    penalty = check_repetition_penalty(penalty)
    if isinstance(previous, mx.array):
        index = previous.reshape(-1)
        if penalty == 1.0 or index.size == 0:
            return logits
    else:
        ids = sorted(set(int(t) for t in previous))
        if penalty == 1.0 or not ids:
            return logits
        index = mx.array(ids)
    chosen = logits[..., index]
    chosen = mx.where(chosen > 0, chosen / penalty, chosen * penalty)
    logits = mx.array(logits)
    logits[..., index] = chosen
    return logits


def check_repetition_penalty(penalty) -> float:
    """A finite penalty > 0 (1 leaves the logits alone)."""
    return require_float("repetition_penalty", penalty, 0.0, min_inclusive=False)


def check_sampling_parameters(temperature, top_k, top_p, min_p) -> tuple[float, int, float, float]:
    """The sampling parameters as numbers in their ranges: temperature >= 0,
    top_k >= 0 (0: off), top_p in (0, 1], min_p in [0, 1); NaN, infinities,
    bools and strings are refused."""
    return (
        require_float("temperature", temperature, 0.0),
        require_int("top_k", top_k, 0),
        require_float("top_p", top_p, 0.0, 1.0, min_inclusive=False),
        require_float("min_p", min_p, 0.0, 1.0, max_inclusive=False),
    )


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
    temperature, top_k, top_p, min_p = check_sampling_parameters(temperature, top_k, top_p, min_p)
    if temperature == 0:
        return lambda logits: mx.argmax(logits, axis=-1)

    def sample(logits: mx.array) -> mx.array:
        return mx.random.categorical(filtered_logprobs(logits, temperature, top_k, top_p, min_p), axis=-1)

    return sample


def filtered_logprobs(logits: mx.array, temperature: float, top_k: int = 0, top_p: float = 1.0,
                      min_p: float = 0.0) -> mx.array:
    """The log-probabilities ``[..., vocab]`` the sampler draws from at
    ``temperature > 0``: scaled by the temperature, then top-k, top-p and
    min-p set the removed tokens to ``-inf`` (not renormalised: a
    categorical draw renormalises). Speculative verification reads the same
    distribution (:mod:`mlx_attn.lm.speculative`)."""
    # shifted so the best logit is 0: a tiny temperature then gives -inf
    # for the others, never inf - inf = NaN
    logits = logits.astype(mx.float32)
    scaled = (logits - logits.max(axis=-1, keepdims=True)) / temperature
    logprobs = scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)
    if top_k and top_k < logits.shape[-1]:
        # ranked on the logits as given: shifting and scaling can round
        # distinct logits to ties
        kth = mx.sort(logits, axis=-1)[..., -top_k][..., None]
        logprobs = mx.where(logits >= kth, logprobs, -mx.inf)
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
    return logprobs
