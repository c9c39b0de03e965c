"""Prompt-lookup (n-gram) drafting: propose the next tokens of a sequence by
finding its last few tokens earlier in the sequence itself (prompt and
output) and copying what followed them there.

No second model: edits that repeat the file they change, JSON that repeats
its keys and quoted context are where the proposals are right. The drafter
is deterministic (its proposal is a point mass), which is what the
speculative verifier assumes (:mod:`mlx_attn.lm.speculative`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mlx_attn.lm.validate import require_int

__all__ = ["propose_ngram", "NgramDrafter", "DEFAULT_MAX_NGRAM", "DEFAULT_MIN_NGRAM"]

DEFAULT_MAX_NGRAM = 4  # longest suffix looked up: longer matches are more specific
DEFAULT_MIN_NGRAM = 1
SEARCH_WINDOW = 4096  # tokens searched back from the end: bounds the cost of a proposal


def propose_ngram(tokens: Sequence[int], count: int, max_ngram: int = DEFAULT_MAX_NGRAM,
                  min_ngram: int = DEFAULT_MIN_NGRAM, window: int = SEARCH_WINDOW) -> list[int]:
    """Up to ``count`` tokens proposed to follow ``tokens``: for the longest
    suffix of ``n`` tokens (``max_ngram`` down to ``min_ngram``) that also
    occurs earlier within the last ``window`` tokens, the tokens after its
    most recent earlier occurrence. Empty when no suffix recurs."""
    if count <= 0 or len(tokens) < 2:
        return []
    tail = np.asarray(tokens[-window:], dtype=np.int64)
    length = len(tail)
    # where the last token occurred before (candidate ends of an earlier match)
    ends = np.flatnonzero(tail[:-1] == tail[-1])
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = tail[-n:]
        # most recent earlier occurrence first: the nearest context is the likeliest to repeat
        for end in ends[::-1]:
            start = end - n + 1
            if start >= 0 and np.array_equal(tail[start:end + 1], suffix):
                return tail[end + 1:end + 1 + count].tolist()
    return []


class NgramDrafter:
    """``propose(tokens, count)``: :func:`propose_ngram` with this drafter's
    n-gram lengths. ``costless``: a proposal costs next to nothing, so the
    scheduler also looks up the first draft of a request that does not
    draft in a step, to keep measuring its acceptance rate."""

    costless = True

    def __init__(self, max_ngram: int = DEFAULT_MAX_NGRAM, min_ngram: int = DEFAULT_MIN_NGRAM):
        self.max_ngram = require_int("max_ngram", max_ngram, 1)
        self.min_ngram = require_int("min_ngram", min_ngram, 1, self.max_ngram)

    def propose(self, tokens: Sequence[int], count: int) -> list[int]:
        return propose_ngram(tokens, count, self.max_ngram, self.min_ngram)
