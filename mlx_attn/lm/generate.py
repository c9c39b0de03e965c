"""Text generation: prefill the prompt in chunks into the KV cache, then
decode token by token, streaming text as it is produced."""

from __future__ import annotations

import dataclasses
import time
from typing import Iterator

import mlx.core as mx

from mlx_attn.cache import QuantizedKVCache
from mlx_attn.lm.sampling import (
    apply_repetition_penalty,
    check_repetition_penalty,
    check_sampling_parameters,
    make_sampler,
)
from mlx_attn.lm.tokenizer import StreamingDetokenizer
from mlx_attn.lm.validate import require_bool, require_int
from mlx_attn.quantized import check_quantization

__all__ = ["GenerationConfig", "GenerationStats", "generate_tokens", "stream_generate", "generate"]


@dataclasses.dataclass
class GenerationConfig:
    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context: int = 64  # how many recent tokens the penalty looks at
    seed: int | None = None
    prefill_chunk: int = 512
    stop_at_eos: bool = True
    # quantized KV cache (mlx-lm's options): with kv_bits (4 or 8) the float
    # caches become QuantizedKVCache once they hold quantized_kv_start tokens
    kv_bits: int | None = None
    kv_group_size: int = 64
    quantized_kv_start: int = 0

    def __post_init__(self):
        self.max_tokens = require_int("max_tokens", self.max_tokens, 0)
        self.temperature, self.top_k, self.top_p, self.min_p = check_sampling_parameters(
            self.temperature, self.top_k, self.top_p, self.min_p
        )
        self.repetition_penalty = check_repetition_penalty(self.repetition_penalty)
        self.repetition_context = require_int("repetition_context", self.repetition_context, 1)
        if self.seed is not None:
            self.seed = require_int("seed", self.seed, 0, 2**64 - 1)  # MLX seeds are uint64
        self.prefill_chunk = require_int("prefill_chunk", self.prefill_chunk, 1)
        require_bool("stop_at_eos", self.stop_at_eos)
        if self.kv_bits is not None:
            self.kv_group_size, self.kv_bits = check_quantization(self.kv_group_size, self.kv_bits)
        self.quantized_kv_start = require_int("quantized_kv_start", self.quantized_kv_start, 0)


@dataclasses.dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prompt_seconds: float = 0.0
    generation_seconds: float = 0.0
    peak_memory_bytes: int = 0

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds else 0.0

    @property
    def generation_tps(self) -> float:
        return self.generated_tokens / self.generation_seconds if self.generation_seconds else 0.0

    def summary(self) -> str:
        return (
            f"prompt: {self.prompt_tokens} tokens, {self.prompt_tps:.1f} tokens/s | "
            f"generation: {self.generated_tokens} tokens, {self.generation_tps:.1f} tokens/s | "
            f"peak memory: {self.peak_memory_bytes / 2**20:.1f} MiB"
        )


def _check_prompt(model, prompt, max_tokens: int) -> list[int]:
    if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__len__"):
        raise ValueError(f"prompt must be a list of token ids, got {type(prompt).__name__}")
    if len(prompt) == 0:
        raise ValueError("the prompt must contain at least one token")
    config = getattr(model, "config", None)
    vocab_size = getattr(config, "vocab_size", None)
    ids = [require_int(f"prompt[{i}]", t, 0, vocab_size - 1 if vocab_size else None) for i, t in enumerate(prompt)]
    context = getattr(config, "max_position_embeddings", None)
    if context is not None and len(ids) + max_tokens > context:
        raise ValueError(f"max_tokens ({max_tokens}) plus the prompt's {len(ids)} tokens exceed the model's "
                         f"context length of {context}")
    return ids


def _maybe_quantize(cache: list, config: GenerationConfig) -> None:
    """Swap the float caches (in place) for quantized ones once they hold
    ``config.quantized_kv_start`` tokens, when ``config.kv_bits`` asks."""
    if config.kv_bits is None or not cache or isinstance(cache[0], QuantizedKVCache):
        return
    if cache[0].offset >= config.quantized_kv_start:
        cache[:] = [c.to_quantized(config.kv_group_size, config.kv_bits) for c in cache]


def generate_tokens(
    model, prompt: list[int], config: GenerationConfig, eos_token_ids=(), stats: GenerationStats | None = None,
    cache: list | None = None,
) -> Iterator[int]:
    """Yields generated token ids. Fills ``stats`` (if given) as it goes.
    The prompt's ids must lie in the model's vocabulary and the prompt plus
    ``max_tokens`` within its context length."""
    if not isinstance(config, GenerationConfig):
        raise ValueError(f"config must be a GenerationConfig, got {type(config).__name__}")
    prompt = _check_prompt(model, prompt, config.max_tokens)
    stats = stats if stats is not None else GenerationStats()
    sampler = make_sampler(config.temperature, config.top_k, config.top_p, config.min_p)
    if config.seed is not None:
        mx.random.seed(config.seed)
    cache = cache if cache is not None else model.make_cache()
    mx.reset_peak_memory()

    start = time.perf_counter()
    # prefill all but the last prompt token in chunks, then the last one
    # produces the first logits
    tokens = mx.array(prompt)[None]
    for begin in range(0, len(prompt) - 1, config.prefill_chunk):
        end = min(begin + config.prefill_chunk, len(prompt) - 1)
        _maybe_quantize(cache, config)
        model(tokens[:, begin:end], cache=cache)
        mx.eval([c.state for c in cache])
    _maybe_quantize(cache, config)
    logits = model(tokens[:, -1:], cache=cache)[:, -1]
    history = list(prompt)

    def pick(logits):
        if config.repetition_penalty != 1.0:
            logits = apply_repetition_penalty(logits, history[-config.repetition_context :], config.repetition_penalty)
        return sampler(logits)

    token = pick(logits)
    mx.eval(token)
    stats.prompt_tokens = len(prompt)
    stats.prompt_seconds = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(config.max_tokens):
        value = int(token.item())
        if config.stop_at_eos and value in eos_token_ids:
            break
        history.append(value)
        stats.generated_tokens += 1
        if stats.generated_tokens < config.max_tokens:
            # queue the next step before handing this token out
            _maybe_quantize(cache, config)
            logits = model(token.reshape(1, 1), cache=cache)[:, -1]
            token = pick(logits)
            mx.async_eval(token)
        stats.generation_seconds = time.perf_counter() - start
        stats.peak_memory_bytes = mx.get_peak_memory()
        yield value
    stats.generation_seconds = time.perf_counter() - start
    stats.peak_memory_bytes = mx.get_peak_memory()


def stream_generate(model, tokenizer, prompt: str | list[int], config: GenerationConfig,
                    stats: GenerationStats | None = None) -> Iterator[str]:
    """Yields text pieces as soon as they are complete."""
    ids = tokenizer.encode(prompt) if isinstance(prompt, (str, bytes)) else prompt  # encode refuses bytes
    detokenizer = StreamingDetokenizer(tokenizer)
    for token in generate_tokens(model, ids, config, tokenizer.eos_token_ids, stats):
        piece = detokenizer.add(token)
        if piece:
            yield piece
    tail = detokenizer.finish()
    if tail:
        yield tail


def generate(model, tokenizer, prompt: str | list[int], config: GenerationConfig | None = None, **kwargs) -> str:
    """The whole completion as one string (kwargs override GenerationConfig
    fields; an unknown one is a TypeError, as for any function)."""
    unknown = sorted(set(kwargs) - set(GenerationConfig.__dataclass_fields__))
    if unknown:
        raise TypeError(f"unknown generation option {unknown[0]!r}; GenerationConfig has "
                        f"{', '.join(GenerationConfig.__dataclass_fields__)}")
    config = dataclasses.replace(config or GenerationConfig(), **kwargs)
    return "".join(stream_generate(model, tokenizer, prompt, config))
