"""Per-request sampling in a batch: each request's parameters and its own
random stream, so a seeded request samples the same tokens alone or in any
batch (the draw for its n-th token depends only on its seed and n).

The draw reseeds MLX's global random state (``mx.random.seed``) before each
sampled token (the filters come from :func:`mlx_attn.lm.sampling.make_sampler`,
which draws from that state): code sharing the process with an engine should
not rely on the global state between steps.

:func:`sample_rows` samples every row of a step at once: one ``argmax`` for
all greedy rows, one log-softmax for the log-probabilities, one evaluation;
only rows that draw (temperature > 0) or apply a repetition penalty build
their own small graph."""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Sequence

import mlx.core as mx

from mlx_attn.lm.sampling import apply_repetition_penalty, check_repetition_penalty, check_sampling_parameters, \
    make_sampler
from mlx_attn.lm.speculative import penalized_rows, verify_drafts
from mlx_attn.lm.validate import require_int

__all__ = ["SamplingParams", "Sampled", "sample_rows", "sample_token", "MAX_TOP_LOGPROBS", "verify_draft_rows",
           "verify_greedy_drafts"]

_SEED_LIMIT = 2**63
MAX_TOP_LOGPROBS = 20  # as OpenAI's chat API


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Temperature 0 is greedy. ``seed`` None: a random seed chosen at
    construction (the request is still reproducible from :attr:`seed`).
    ``top_logprobs``: how many of the most likely tokens (and their
    log-probabilities) to report with each generated token, 0 to 20."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self):
        temperature, top_k, top_p, min_p = check_sampling_parameters(self.temperature, self.top_k, self.top_p,
                                                                     self.min_p)
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "top_k", top_k)
        object.__setattr__(self, "top_p", top_p)
        object.__setattr__(self, "min_p", min_p)
        object.__setattr__(self, "repetition_penalty", check_repetition_penalty(self.repetition_penalty))
        seed = secrets.randbelow(_SEED_LIMIT) if self.seed is None else require_int("seed", self.seed, 0,
                                                                                     _SEED_LIMIT - 1)
        object.__setattr__(self, "seed", seed)
        if not isinstance(self.logprobs, bool):
            raise ValueError(f"logprobs must be True or False, got {self.logprobs!r}")
        object.__setattr__(self, "top_logprobs", require_int("top_logprobs", self.top_logprobs, 0,
                                                             MAX_TOP_LOGPROBS))

    @property
    def greedy(self) -> bool:
        """The token is the argmax of the raw logits: nothing to draw, no penalty."""
        return self.temperature == 0 and self.repetition_penalty == 1.0


@dataclasses.dataclass(frozen=True)
class Sampled:
    token: int
    logprob: float  # under the model's distribution, before sampling filters
    top_logprobs: tuple[tuple[int, float], ...] = ()  # the most likely tokens, best first


def _draw(logits: mx.array, params: SamplingParams, previous: Sequence[int], index: int) -> mx.array:
    """The token of one row that does not simply take the argmax."""
    shaped = apply_repetition_penalty(logits, previous, params.repetition_penalty)
    if params.temperature == 0:
        return mx.argmax(shaped)
    # the draw's randomness: the request's seed and the token's index only
    # (MLX takes the key from the global state when the op is built)
    mx.random.seed((params.seed * 1_000_003 + index) % _SEED_LIMIT)
    return make_sampler(params.temperature, params.top_k, params.top_p, params.min_p)(shaped[None])[0]


def sample_rows(logits: mx.array, params: Sequence[SamplingParams], previous: Sequence[Sequence[int]],
                indices: Sequence[int]) -> list[Sampled]:
    """Row ``r`` of ``logits [R, vocab]`` gives the ``indices[r]``-th
    generated token of a request with ``params[r]`` and tokens so far
    ``previous[r]``; one evaluation for all rows."""
    logits = logits.astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    tokens = mx.argmax(logits, axis=-1)
    drawn = [r for r, p in enumerate(params) if not p.greedy]
    if drawn:
        chosen = [_draw(logits[r], params[r], previous[r], indices[r]) for r in drawn]
        tokens = mx.array(tokens)
        tokens[mx.array(drawn)] = mx.stack(chosen).astype(tokens.dtype)
    chosen_logprobs = mx.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    top = max((p.top_logprobs for p in params), default=0)
    if top:
        # the top k of every row at once; each row keeps as many as it asked for
        best = mx.argpartition(-logprobs, kth=top - 1, axis=-1)[:, :top]
        best_logprobs = mx.take_along_axis(logprobs, best, axis=-1)
        mx.eval(tokens, chosen_logprobs, best, best_logprobs)
        best, best_logprobs = best.tolist(), best_logprobs.tolist()
    else:
        mx.eval(tokens, chosen_logprobs)
    out = []
    for r, (token, logprob) in enumerate(zip(tokens.tolist(), chosen_logprobs.tolist())):
        ranked = ()
        if params[r].top_logprobs:
            pairs = sorted(zip(best_logprobs[r], best[r]), key=lambda pair: (-pair[0], pair[1]))
            ranked = tuple((int(t), float(lp)) for lp, t in pairs[: params[r].top_logprobs])
        out.append(Sampled(int(token), float(logprob), ranked))
    return out


def sample_token(logits: mx.array, params: SamplingParams, previous: list[int], index: int) -> tuple[int, float]:
    """The request's ``index``-th generated token from its ``[vocab]`` logits,
    and its log-probability under the model (before any filter)."""
    sampled = sample_rows(logits[None], [params], [previous], [index])[0]
    return sampled.token, sampled.logprob


def verify_draft_rows(logits: mx.array, params: SamplingParams, previous: Sequence[int], index: int,
                      drafts: Sequence[int]) -> list[Sampled]:
    """The tokens a request keeps from one verification: ``logits [k + 1,
    vocab]`` of its rows fed ``[last token] + drafts``; ``index``: the
    generated-token index of the first of them. Greedy rows keep drafts
    while they are the argmax; drawn rows use speculative sampling
    (:func:`mlx_attn.lm.speculative.verify_drafts`) over the same filters
    and penalty as :func:`sample_rows`, from the request's seed and
    ``index``, so a seeded request is reproducible. Returns the accepted
    drafts and one token more, each with its log-probabilities."""
    logits = logits.astype(mx.float32)
    if params.greedy:
        kept = verify_drafts(logits, drafts, 0.0)
    else:
        # the plain sampler penalizes over every token before the drawn one
        shaped = penalized_rows(logits, previous, drafts, params.repetition_penalty, None)
        mx.random.seed((params.seed * 1_000_003 + index) % _SEED_LIMIT)
        kept = verify_drafts(shaped, drafts, params.temperature, params.top_k, params.top_p, params.min_p)
    rows = logits[: len(kept)]
    logprobs = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logprobs, mx.array(kept)[:, None], axis=-1)[:, 0]
    top = params.top_logprobs
    if top:
        best = mx.argpartition(-logprobs, kth=top - 1, axis=-1)[:, :top]
        best_logprobs = mx.take_along_axis(logprobs, best, axis=-1)
        mx.eval(chosen, best, best_logprobs)
        best, best_logprobs = best.tolist(), best_logprobs.tolist()
    else:
        mx.eval(chosen)
    out = []
    for r, (token, logprob) in enumerate(zip(kept, chosen.tolist())):
        ranked = ()
        if top:
            pairs = sorted(zip(best_logprobs[r], best[r]), key=lambda pair: (-pair[0], pair[1]))
            ranked = tuple((int(t), float(lp)) for lp, t in pairs[:top])
        out.append(Sampled(int(token), float(logprob), ranked))
    return out


def verify_greedy_drafts(logits: mx.array, groups: Sequence[tuple[int, Sequence[int], int]]) -> list[list[Sampled]]:
    """:func:`verify_draft_rows` for every greedy request of a step at once
    (one argmax, one gather, two evaluations in all, not two per request).
    ``groups``: ``(first row in logits, drafts, top_logprobs)`` per request;
    its rows are ``first .. first + len(drafts)``."""
    logits = logits.astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    best = mx.argmax(logits, axis=-1).tolist()
    kept_rows, kept_tokens, out_tokens = [], [], []
    for first, drafts, _ in groups:
        kept = 0
        while kept < len(drafts) and best[first + kept] == drafts[kept]:
            kept += 1
        tokens = list(drafts[:kept]) + [best[first + kept]]
        kept_rows += range(first, first + len(tokens))
        kept_tokens += tokens
        out_tokens.append(tokens)
    rows = mx.array(kept_rows, dtype=mx.int32)
    chosen = logprobs[rows, mx.array(kept_tokens, dtype=mx.int32)]
    top = max((t for _, _, t in groups), default=0)
    if top:
        ranked_ids = mx.argpartition(-logprobs[rows], kth=top - 1, axis=-1)[:, :top]
        ranked_logprobs = mx.take_along_axis(logprobs[rows], ranked_ids, axis=-1)
        mx.eval(chosen, ranked_ids, ranked_logprobs)
        ranked_ids, ranked_logprobs = ranked_ids.tolist(), ranked_logprobs.tolist()
    else:
        mx.eval(chosen)
    chosen = chosen.tolist()
    out, r = [], 0
    for (_, _, want), tokens in zip(groups, out_tokens):
        sampled = []
        for token in tokens:
            ranked = ()
            if want:
                pairs = sorted(zip(ranked_logprobs[r], ranked_ids[r]), key=lambda pair: (-pair[0], pair[1]))
                ranked = tuple((int(t), float(lp)) for lp, t in pairs[:want])
            sampled.append(Sampled(int(token), float(chosen[r]), ranked))
            r += 1
        out.append(sampled)
    return out
