"""Lossless speculative decoding: verify ``k`` proposed tokens with one
forward of ``k + 1`` rows and keep the longest prefix the target model
agrees with, plus one token of its own.

An n-gram draft is a point mass (the drafter is deterministic), so
speculative (rejection) sampling reduces to: with the target distribution
``p`` of a row (after the repetition penalty, temperature, top-k, top-p and
min-p exactly as the plain sampler applies them,
:func:`mlx_attn.lm.sampling.filtered_logprobs`), accept the draft ``t`` with
probability ``p(t)``; otherwise draw from ``p`` with ``t`` removed and
renormalised, and stop. A token then has probability
``p(t) + (1 - p(t)) * 0 = p(t)`` for ``t`` the draft and
``(1 - p(t)) * p(x) / (1 - p(t)) = p(x)`` for any other ``x``: exactly ``p``.
When every draft is accepted the last row draws one more token from its
``p``. Greedy (temperature 0) accepts while the draft is the row's argmax:
token for token what decoding without drafts gives. Decoding uses the
coupled form, :func:`verify_by_drawing`: each row's token drawn as plain
sampling draws it, a draft kept while it is that draw (the same law, and
a seeded generation's tokens whatever was drafted).

A draft model's tokens are drawn from its own distribution ``q`` (the
same filters on its logits): :func:`verify_drafts` with ``draft_logprobs``
accepts the draft ``t`` with probability ``min(1, p(t) / q(t))`` and
otherwise draws from ``max(0, p - q)`` renormalised. A token ``x`` then has
probability ``q(x) min(1, p(x)/q(x)) + (1 - sum_y min(p(y), q(y)))
max(0, p(x) - q(x)) / sum_y max(0, p(y) - q(y)) = min(p, q)(x) + max(0, p -
q)(x) = p(x)``, and a draft is kept with probability ``sum min(p, q)``,
more than the ``sum q p`` of keeping it only when a plain draw equals it.

:class:`DraftLength` adapts ``k`` to a sequence's acceptance rate."""

from __future__ import annotations

import math
from collections.abc import Sequence

import mlx.core as mx

from mlx_attn.lm.sampling import apply_repetition_penalty, filtered_logprobs
from mlx_attn.lm.validate import FieldError, require_int

__all__ = ["check_draft_model", "verify_drafts", "draft_acceptance", "normalized_logprobs", "verify_by_drawing",
           "penalized_rows", "DraftLength", "StepCost", "SPECULATIVE_CHOICES", "DEFAULT_NUM_DRAFT_TOKENS",
           "MAX_NUM_DRAFT_TOKENS", "check_num_draft_tokens"]

SPECULATIVE_CHOICES = ("ngram", "draft")  # prompt lookup, or a draft model with the same vocabulary
DEFAULT_NUM_DRAFT_TOKENS = 4
MAX_NUM_DRAFT_TOKENS = 32


def check_num_draft_tokens(count) -> int:
    return require_int("num_draft_tokens", count, 1, MAX_NUM_DRAFT_TOKENS)


def check_draft_model(target, draft) -> None:
    """A draft model must score the target's vocabulary: the same number of
    logits (a token id means the same token to both is the caller's part:
    the same tokenizer)."""
    if not callable(draft) or not hasattr(draft, "make_cache"):
        raise FieldError("draft_model", f"must be a loaded model (with make_cache), got {type(draft).__name__}")
    target_size = getattr(getattr(target, "config", None), "vocab_size", None)
    draft_size = getattr(getattr(draft, "config", None), "vocab_size", None)
    if target_size is None or draft_size is None or target_size != draft_size:
        raise FieldError("draft_model", f"has a vocabulary of {draft_size} tokens, the model {target_size}: a draft "
                         "model must share the model's tokenizer and vocabulary")


def check_draft_flags(speculative: str | None, draft_model) -> None:
    """``speculative="draft"`` and a draft model go together (a
    ``FieldError`` naming ``draft_model``, before any model loads)."""
    if speculative == "draft" and draft_model is None:
        raise FieldError("draft_model", "is needed by --speculative draft (a smaller model with the same tokenizer)")
    if draft_model is not None and speculative != "draft":
        raise FieldError("draft_model", "is used only with --speculative draft")


# text whose encoding a draft model's tokenizer must reproduce
TOKENIZER_PROBE = "Hello, world! def f(x):\n    return {'k': x * 2}  # 12345 ünïcødé"


def check_draft_tokenizer(tokenizer, draft_tokenizer, path: str) -> None:
    """The draft model's tokenizer must encode text to the model's ids."""
    if draft_tokenizer.encode(TOKENIZER_PROBE) != tokenizer.encode(TOKENIZER_PROBE):
        raise FieldError("draft_model", f"{path} has another tokenizer than the model: the same text encodes to "
                         "different token ids")


def penalized_rows(logits: mx.array, history: Sequence[int], drafts: Sequence[int], penalty: float,
                   context: int | None) -> mx.array:
    """``logits [k + 1, vocab]`` with the repetition penalty row ``i`` would
    get in plain decoding: over ``history`` plus the first ``i`` drafts (the
    last ``context`` of them, all when None)."""
    if penalty == 1.0:
        return logits
    rows = []
    for i in range(logits.shape[0]):
        seen = list(history) + list(drafts[:i])
        if context is not None:
            seen = seen[-context:]
        rows.append(apply_repetition_penalty(logits[i], seen, penalty))
    return mx.stack(rows)


def verify_drafts(logits: mx.array, drafts: Sequence[int], temperature: float, top_k: int = 0, top_p: float = 1.0,
                  min_p: float = 0.0, draft_logprobs: mx.array | None = None) -> list[int]:
    """The tokens decoding keeps from one verification: ``logits [k + 1,
    vocab]`` (already penalized) of the rows fed ``[last token] + drafts``;
    returns the accepted drafts followed by one token of the target's own
    (1 to k + 1 tokens). ``draft_logprobs [k, vocab]``: the distributions
    the drafts were drawn from (a draft model's ``q``, any normalisation;
    None: each draft a point mass). Draws from MLX's global random state;
    one evaluation."""
    k = len(drafts)
    if logits.shape[0] != k + 1:
        raise ValueError(f"logits must have one row more than the {k} drafts, got {logits.shape[0]}")
    if temperature == 0:
        best = mx.argmax(logits, axis=-1).tolist()
        kept = 0
        while kept < k and best[kept] == drafts[kept]:
            kept += 1
        return list(drafts[:kept]) + [best[kept]]
    logprobs = normalized_logprobs(filtered_logprobs(logits, temperature, top_k, top_p, min_p))
    if k == 0:
        return [int(mx.random.categorical(logprobs[0]).item())]
    if draft_logprobs is not None and draft_logprobs.shape != (k, logits.shape[-1]):
        raise ValueError(f"draft_logprobs must be [{k}, {logits.shape[-1]}] (one row per draft), "
                         f"got {list(draft_logprobs.shape)}")
    index = mx.array(drafts, dtype=mx.int32)
    target_of_draft = mx.take_along_axis(logprobs[:k], index[:, None], axis=-1)[:, 0]
    uniforms = mx.random.uniform(shape=(k,))
    if draft_logprobs is None:
        # the residual of row i: p with the draft removed (categorical renormalises)
        residual = mx.array(logprobs[:k])
        residual[mx.arange(k), index] = -mx.inf
        accept = uniforms < mx.exp(target_of_draft)
    else:
        accept_probability, residual = draft_acceptance(logprobs[:k], draft_logprobs, index)
        accept = uniforms < accept_probability
    replacements = mx.random.categorical(residual, axis=-1)
    bonus = mx.random.categorical(logprobs[k])
    mx.eval(accept, replacements, bonus)
    accept, replacements = accept.tolist(), replacements.tolist()
    for i in range(k):
        if not accept[i]:
            return list(drafts[:i]) + [replacements[i]]
    return list(drafts) + [int(bonus.item())]


def draft_acceptance(target_logprobs: mx.array, draft_logprobs: mx.array, drafts: mx.array
                     ) -> tuple[mx.array, mx.array]:
    """The rule for tokens drawn from a draft model's ``q``: for rows ``[n,
    vocab]`` of the target's normalised log-probabilities ``p`` (after its
    filters) and the draft's ``q`` (any normalisation), and the ``n`` drafted
    tokens ``t``, the probability ``min(1, p(t) / q(t))`` of keeping each and
    the log-weights of ``max(0, p - q)`` to draw a replacement from when it
    is refused (``p`` itself where ``p == q`` to rounding leaves no excess: a
    refusal is then (almost) impossible)."""
    q = normalized_logprobs(draft_logprobs.astype(mx.float32))
    drafts = drafts.astype(mx.int32)[:, None]
    p_of_draft = mx.take_along_axis(target_logprobs, drafts, axis=-1)[:, 0]
    q_of_draft = mx.take_along_axis(q, drafts, axis=-1)[:, 0]
    accept = mx.minimum(mx.exp(p_of_draft - q_of_draft), 1.0)
    excess = mx.maximum(mx.exp(target_logprobs) - mx.exp(q), 0.0)
    residual = mx.where(excess.sum(axis=-1, keepdims=True) > 0, mx.log(excess), target_logprobs)
    return accept, residual


def normalized_logprobs(logprobs: mx.array) -> mx.array:
    """Log-probabilities summing to one per row (the filters leave the kept
    tokens' values as they were before removing the others)."""
    return logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)


def verify_by_drawing(logits: mx.array, drafts: Sequence[int], draw) -> list[int]:
    """The tokens kept when each row's token is drawn as decoding without
    drafts draws it: ``draw(logits [1, vocab]) -> [1]`` (the plain sampler,
    drawing from MLX's global random state), called for row ``i`` only when
    the drafts before it were kept, so the random state advances once per
    kept token, as without drafts. Drafts are kept while they are the drawn
    token, then the first other draw: a draft ``t`` is kept with probability
    ``p(t)``, otherwise the token is distributed as ``p`` without ``t``
    (speculative sampling for a point-mass draft), and a seeded generation
    gives the tokens it gives without drafts, whatever was drafted."""
    kept = []
    for i in range(len(drafts) + 1):
        token = int(draw(logits[i:i + 1]).item())
        kept.append(token)
        if i == len(drafts) or token != drafts[i]:
            break
    return kept


class DraftLength:
    """How many tokens to draft next for one sequence, from its acceptance
    rate: the rate ``a`` is a running mean over proposed tokens (a draft is
    accepted only if those before it were, so the ``j``-th draft is kept
    with probability about ``a ** j``); ``k`` is the largest ``j <= limit``
    with ``a ** j >= min_keep`` (a draft row worth less than ``min_keep``
    of a token is not proposed), never below 1, so a sequence whose drafts
    start to match again is noticed."""

    def __init__(self, limit: int, min_keep: float = 0.25, memory: float = 0.8):
        self.limit, self.min_keep, self.memory = check_num_draft_tokens(limit), min_keep, memory
        self.rate = 1.0  # optimistic start: the first proposals go in whole
        self.proposed = self.accepted = 0

    def next(self) -> int:
        if self.rate >= 1.0:
            return self.limit
        if self.rate <= 0.0:
            return 1
        return max(1, min(self.limit, int(math.log(self.min_keep) / math.log(self.rate))))

    def observe(self, kept: bool) -> None:
        """A first draft that was found but not proposed (the step had no
        room for it, or the back-off refused it) turned out ``kept`` or not:
        one observation of the rate, no proposal counted. Without it a rate
        that fell under what a draft row costs would never be measured again."""
        self.rate = self.memory * self.rate + (1 - self.memory) * float(kept)

    def record(self, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        self.proposed += proposed
        self.accepted += accepted
        # drafts after the first rejected one were never tested
        tested = accepted + (1 if accepted < proposed else 0)
        weight = self.memory ** tested  # each tested draft is one observation
        self.rate = weight * self.rate + (1 - weight) * (accepted / tested)


class StepCost:
    """A batched step's time as ``fixed + per_row * rows``, fitted by least
    squares to the steps measured (each older step weighs ``memory`` times
    less), and the rule that decides whether one more draft row pays.

    Adding a draft row to a step of ``rows`` rows that yields about
    ``decode_rows`` tokens raises the tokens per second when the draft is
    kept with probability ``p`` and ``p * (fixed + per_row * rows) > per_row
    * decode_rows`` (``(n + p) / (T + b) > n / T``). While the step is
    memory-bound (``per_row`` small against ``fixed``) nearly every draft
    pays; once it is compute-bound (``per_row * rows`` dominates) only drafts
    almost sure to be kept do, so speculation backs off by itself. Until the
    measured steps differ enough in rows to fit a slope, ``per_row`` is
    ``prior_ratio`` times ``fixed``.

    A draft model's proposals cost more than their row: ``draft_row``, the
    seconds the draft model's forwards took per draft they proposed (a
    running mean, :meth:`record_drafting`), joins ``per_row`` on the right
    side (``(n + p) / (T + per_row + draft_row) > n / T``); 0 for n-gram
    drafts, which cost next to nothing to find."""

    def __init__(self, prior_ratio: float = 0.02, memory: float = 0.98, min_steps: int = 8):
        self.prior_ratio, self.memory, self.min_steps = prior_ratio, memory, min_steps
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self.steps = 0
        self.draft_row = 0.0

    def record_drafting(self, drafts: int, seconds: float) -> None:
        """A step's draft-model forwards took ``seconds`` for ``drafts`` proposals."""
        if drafts > 0:  # the first measurement stands alone, later ones weigh in with their drafts
            weight = self.memory ** drafts if self.draft_row > 0 else 0.0
            self.draft_row = weight * self.draft_row + (1 - weight) * seconds / drafts

    def record(self, rows: int, seconds: float) -> None:
        m = self.memory
        self._w, self._x, self._y = m * self._w + 1, m * self._x + rows, m * self._y + seconds
        self._xx, self._xy = m * self._xx + rows * rows, m * self._xy + rows * seconds
        self.steps += 1

    def has_slope(self) -> bool:
        """Whether the measured steps spread over enough row counts to fit ``per_row``."""
        if self._w == 0 or self.steps < self.min_steps:
            return False
        mean_x = self._x / self._w
        return self._xx / self._w - mean_x * mean_x > 0.25

    def fit(self) -> tuple[float, float]:
        """``(fixed, per_row)`` in seconds (``(1, prior_ratio)`` before any step)."""
        if self._w == 0:
            return 1.0, self.prior_ratio
        mean_x, mean_y = self._x / self._w, self._y / self._w
        if self.has_slope():
            per_row = max(0.0, (self._xy / self._w - mean_x * mean_y) / (self._xx / self._w - mean_x * mean_x))
            return self.through(per_row), per_row
        fixed = mean_y / (1 + self.prior_ratio * mean_x)
        return fixed, self.prior_ratio * fixed

    def through(self, per_row: float) -> float:
        """The fixed cost of the line of slope ``per_row`` through the
        measured steps' mean (kept positive: where rows dominate, a line
        through nearly the origin)."""
        mean_x, mean_y = self._x / self._w, self._y / self._w
        return max(mean_y - per_row * mean_x, 0.05 * mean_y)

    def worth(self, probability: float, decode_rows: int, rows: int) -> bool:
        fixed, per_row = self.fit()
        return probability * (fixed + per_row * rows) > (per_row + self.draft_row) * decode_rows

    def drafting_beats(self, plain: "StepCost", expected_tokens: float, decode_rows: int, rows: int,
                       drafts: int) -> bool:
        """Whether a step of ``rows`` rows plus ``drafts`` drafts, yielding
        ``expected_tokens``, at this cost beats the same step without drafts
        at ``plain``'s cost (steps that run another, cheaper way when they
        hold no draft: the engine's compiled decode steps). True until both
        are measured."""
        if self.steps == 0 or plain.steps < plain.min_steps:
            return True
        fixed, per_row = self.fit()
        plain_fixed, plain_per_row = plain.fit()
        if not plain.has_slope() and self.has_slope():
            # plain steps of one row count (one request, or others that ran this path: shared-prefix
            # steps do): a row costs what it costs here, the same products; only the fixed cost differs
            plain_fixed, plain_per_row = plain.through(per_row), per_row
        with_drafts = fixed + (per_row + self.draft_row) * (rows + drafts)
        return expected_tokens / with_drafts > decode_rows / (plain_fixed + plain_per_row * rows)
