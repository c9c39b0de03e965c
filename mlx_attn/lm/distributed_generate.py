"""Generation with the prompt and the KV cache split across the ranks of an
``mx.distributed`` group (started by ``mlx.launch``).

Every rank holds the whole model and runs the same token loop; only the
sequence is split:

- **prefill**: the prompt (all but its last token, as in
  :func:`mlx_attn.lm.generate.generate_step`) is padded at its end to a
  multiple of ``2n`` and cut with the zigzag layout of
  :mod:`mlx_attn.distributed`. Each rank embeds its own tokens, applies the
  norms, projections, RoPE (at the tokens' global positions) and MLP to them
  alone, and computes attention with :func:`mlx_attn.distributed.ring_attention`
  (the model's own forward, with a ring-attention hook:
  :class:`mlx_attn.lm.models.base.AttentionHook`).
  Each layer's cache keeps only this rank's real tokens (the padding is
  dropped; it sits after every real token, so causally no real query saw it).
- **decode**: every rank runs the new token through the model. Its key and
  value go to the cache of rank ``position % n`` only (round-robin, so the
  caches grow evenly); at each layer every rank attends the query to the
  keys it holds and :func:`mlx_attn.distributed.decode_attention` merges the
  partials exactly (one ``all_gather`` of output and log-sum-exp per layer).
  The merge runs in rank order, so every rank computes the same logits;
  rank 0's token is broadcast anyway (an ``all_sum``) so sampling can never
  make the ranks diverge.

Greedy output equals the single-process run's, token for token, up to
float rounding in the merged attention (tested on SmolLM2).
"""

from __future__ import annotations

from typing import Iterator

import mlx.core as mx

from mlx_attn import distributed as dist
from mlx_attn.cache import KVCache
from mlx_attn.lm.generate import GenerationConfig, GenerationResponse, TokenSampling, check_prompt, response_stream
from mlx_attn.lm.models.base import AttentionHook, Decoder
from mlx_attn.lm.tokenizer import StreamingDetokenizer

__all__ = ["distributed_generate_step", "distributed_stream_generate", "check_distributed_config",
           "LAUNCH_HINT", "PADDING_TOKEN"]

LAUNCH_HINT = ("start the ranks with mlx.launch, e.g. "
               "'mlx.launch -n 2 --backend ring -- mlx-attn generate --distributed ...' "
               "(or --hostfile hosts.json across Macs)")
PADDING_TOKEN = 0  # fills the prompt's tail to a multiple of 2n; never attended to by a real token


def check_distributed_config(config: GenerationConfig) -> None:
    """Refuses the generation options the sharded cache does not support."""
    if config.max_kv_size is not None:
        raise ValueError("max_kv_size (--max-kv-size) cannot be combined with distributed generation: "
                         "the sharded KV cache is not a rotating window")
    if config.kv_bits is not None:
        raise ValueError("kv_bits (--kv-bits) cannot be combined with distributed generation: "
                         "the sharded KV cache is not quantized")
    if config.logprobs:
        raise ValueError("logprobs are not returned by distributed generation")
    if config.speculative is not None:
        raise ValueError("speculative (--speculative) cannot be combined with distributed generation: "
                         "the ranks decode one token a step")


def _check_group(group) -> mx.distributed.Group:
    if not isinstance(group, mx.distributed.Group):
        raise ValueError(f"group must be an mx.distributed.Group, got {type(group).__name__}")
    if group.size() < 2:
        raise ValueError(f"distributed generation needs a group of more than one rank, got {group.size()}: "
                         f"{LAUNCH_HINT}")
    return group


class _RingPrefill(AttentionHook):
    """Prefill of this rank's zigzag share: ring attention over the ranks,
    each layer's cache keeping this rank's real (unpadded) tokens."""

    def __init__(self, positions: list[int], real: mx.array, caches: list[KVCache], group, timeout):
        self._positions, self.real, self.caches, self.group, self.timeout = positions, real, caches, group, timeout

    def positions(self, length: int) -> mx.array:
        return mx.array(self._positions, dtype=mx.int32)

    def __call__(self, layer, queries, keys, values):
        out = dist.ring_attention(queries, keys, values, scale=layer.scale, mask="causal",
                                  window_size=layer.window_size, group=self.group, layout="zigzag",
                                  timeout=self.timeout)
        if self.real.size:
            self.caches[layer.index].update_and_fetch(keys[:, :, self.real], values[:, :, self.real])
        return out


class _ShardedDecode(AttentionHook):
    """One new token at ``position``: its K/V join the cache of rank
    ``position % n``; every rank attends to the keys it holds and the
    partials merge exactly across the ranks."""

    def __init__(self, position: int, caches: list[KVCache], group, backend: str, timeout):
        self.position, self.caches, self.group, self.backend, self.timeout = position, caches, group, backend, timeout
        self.owner = position % group.size() == group.rank()

    def positions(self, length: int) -> int:
        return self.position

    def __call__(self, layer, queries, keys, values):
        cache = self.caches[layer.index]
        keys, values = cache.update_and_fetch(keys, values) if self.owner else cache.state
        return dist.decode_attention_unchecked(queries, keys, values, scale=layer.scale, group=self.group,
                                               backend=self.backend, timeout=self.timeout)


def _prefill(model, tokens: list[int], caches: list[KVCache], group, timeout) -> None:
    """Fills each rank's caches with its zigzag share of ``tokens``."""
    ranks, rank = group.size(), group.rank()
    chunks = 2 * ranks
    span = -(-len(tokens) // chunks)  # tokens per chunk, padding included
    padded = tokens + [PADDING_TOKEN] * (span * chunks - len(tokens))
    positions = [c * span + i for c in dist.chunk_ids("zigzag", rank, ranks) for i in range(span)]
    mine = mx.array([padded[p] for p in positions])[None]
    real = mx.array([i for i, p in enumerate(positions) if p < len(tokens)])  # this rank's unpadded tokens
    model(mine, attention=_RingPrefill(positions, real, caches, group, timeout))  # the logits are not needed
    mx.eval([c.state for c in caches if c.keys is not None])


def _decode(model, token: mx.array, position: int, caches: list[KVCache], group, timeout) -> mx.array:
    """Logits ``[1, vocab]`` of ``token`` at global ``position``."""
    hook = _ShardedDecode(position, caches, group, model.backend, timeout)
    return model(token.reshape(1, 1), attention=hook)[:, -1]


def _agree(token: mx.array, group, timeout) -> mx.array:
    """Rank 0's token on every rank (one small all_sum)."""
    mine = token.astype(mx.int64) if group.rank() == 0 else mx.zeros(token.shape, mx.int64)
    agreed = mx.distributed.all_sum(mine, group=group)
    dist.communicate("agreeing on the next token", [agreed], group, timeout)
    return agreed.astype(token.dtype)


def distributed_generate_step(model, prompt: list[int], config: GenerationConfig, group, *,
                              cache: list | None = None, timeout: float | None = None
                              ) -> Iterator[tuple[int, None]]:
    """Yields ``(token id, None)`` for up to ``config.max_tokens`` tokens on
    every rank (the same tokens), like :func:`generate_step` but with the
    prompt and the cache split across ``group``. Every rank must pass the
    same prompt and config (checked: a difference is a ValueError on all).
    ``cache``: empty per-layer ``KVCache`` objects to fill with this rank's
    share (to inspect it); made fresh when None. ``timeout``: see
    :mod:`mlx_attn.distributed`."""
    if not isinstance(config, GenerationConfig):
        raise ValueError(f"config must be a GenerationConfig, got {type(config).__name__}")
    if not isinstance(model, Decoder):
        raise ValueError(f"model must be a mlx_attn.lm decoder (a models.base.Decoder), got {type(model).__name__}")
    windowed = [layer.index for layer in model.attention_layers() if layer.window_size is not None]
    if windowed:
        raise ValueError(f"distributed generation does not support sliding-window layers yet (layer {windowed[0]} "
                         "has one): its decode step merges every rank's keys without a window")
    group = _check_group(group)
    check_distributed_config(config)
    layers = len(model.attention_layers())
    if cache is None:
        cache = [KVCache() for _ in range(layers)]
    elif (not isinstance(cache, list) or len(cache) != layers
          or not all(type(c) is KVCache and c.offset == 0 for c in cache)):
        raise ValueError(f"cache must be a list of {layers} empty KVCache objects (one per layer)")
    prompt = check_prompt(model, prompt, config.max_tokens, 0)
    options = [round(x * 1e6) for x in (config.temperature, config.top_p, config.min_p, config.repetition_penalty)]
    seed = -1 if config.seed is None else config.seed % 2**62  # fits the int64 signature
    agreement = [len(prompt), config.max_tokens, config.top_k, config.repetition_context, seed, *options,
                 *prompt[:64], *prompt[-64:]]
    dist.check_same_across_ranks("the prompt and generation options", agreement, group, timeout)
    if config.max_tokens == 0:
        return
    sampling = TokenSampling(config, prompt)
    if len(prompt) > 1:
        _prefill(model, prompt[:-1], cache, group, timeout)
    token, position = mx.array(prompt[-1:]), len(prompt) - 1
    for _ in range(config.max_tokens):
        logits = sampling.penalized(_decode(model, token, position, cache, group, timeout))
        token = _agree(sampling.sample(logits), group, timeout)
        sampling.remember(token)
        position += 1
        yield int(token.item()), None


def distributed_stream_generate(model, tokenizer, prompt: str | list[int], config: GenerationConfig, group,
                                timeout: float | None = None) -> Iterator[GenerationResponse]:
    """:func:`mlx_attn.lm.generate.stream_generate` across ``group``: the
    same responses on every rank (the caller prints rank 0's)."""
    ids = tokenizer.encode(prompt) if isinstance(prompt, (str, bytes)) else prompt
    steps = distributed_generate_step(model, ids, config, group, timeout=timeout)
    return response_stream(model, StreamingDetokenizer(tokenizer), ids, config, tokenizer.eos_token_ids, None,
                           steps=steps)
