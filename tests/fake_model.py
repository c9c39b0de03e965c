"""The serving tests' fake model: keys that encode (token, position, a hash
of the prefix), and a next token that is a function of the whole sequence,
so that any K/V or token mix-up between requests shows."""

import numpy as np

VOCAB = 3  # a small alphabet: prompts share prefixes often
DIM = 4


def fake_keys(tokens, positions) -> np.ndarray:
    """``[T, 1, DIM]`` float32 keys: (token, position, prefix hash, 1)."""
    rows = []
    for p in positions:
        prefix = 0
        for t in tokens[: p + 1]:
            prefix = (prefix * 7 + int(t) + 1) % 997
        rows.append([tokens[p], p, prefix, 1.0])
    return np.asarray(rows, np.float32)[:, None, :]


def fake_sample(tokens) -> int:
    return (sum(tokens) * 5 + len(tokens)) % VOCAB
