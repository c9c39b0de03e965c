"""Per-request sampling in a batch: each request's parameters and its own
random stream, so a seeded request samples the same tokens alone or in any
batch (the draw for its n-th token depends only on its seed and n).

The draw reseeds MLX's global random state (``mx.random.seed``) before each
sampled token (the filters come from :func:`mlx_attn.lm.sampling.make_sampler`,
which draws from that state): code sharing the process with an engine should
not rely on the global state between steps."""

from __future__ import annotations

import dataclasses
import secrets

import mlx.core as mx

from mlx_attn.lm.sampling import apply_repetition_penalty, check_repetition_penalty, check_sampling_parameters, \
    make_sampler
from mlx_attn.lm.validate import require_int

__all__ = ["SamplingParams", "sample_token"]

_SEED_LIMIT = 2**63


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Temperature 0 is greedy. ``seed`` None: a random seed chosen at
    construction (the request is still reproducible from :attr:`seed`)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    logprobs: bool = False

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


def sample_token(logits: mx.array, params: SamplingParams, previous: list[int], index: int) -> tuple[int, float]:
    """The request's ``index``-th generated token from its ``[vocab]`` logits,
    and its log-probability under the model (before any filter)."""
    logits = logits.astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits)
    shaped = apply_repetition_penalty(logits, previous, params.repetition_penalty)
    if params.temperature == 0:
        token = mx.argmax(shaped)
    else:
        # the draw's randomness: the request's seed and the token's index only
        mx.random.seed((params.seed * 1_000_003 + index) % _SEED_LIMIT)
        token = make_sampler(params.temperature, params.top_k, params.top_p, params.min_p)(shaped[None])[0]
    token = int(token.item())
    return token, float(logprobs[token].item())
