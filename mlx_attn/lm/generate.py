"""Text generation: prefill the prompt in chunks into the KV cache, then
decode token by token, streaming text as it is produced."""

from __future__ import annotations

import dataclasses
import time
from typing import Iterator

import mlx.core as mx

from mlx_attn.lm.sampling import apply_repetition_penalty, make_sampler
from mlx_attn.lm.tokenizer import StreamingDetokenizer

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

    def __post_init__(self):
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")


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


def generate_tokens(
    model, prompt: list[int], config: GenerationConfig, eos_token_ids=(), stats: GenerationStats | None = None,
    cache: list | None = None,
) -> Iterator[int]:
    """Yields generated token ids. Fills ``stats`` (if given) as it goes."""
    if not prompt:
        raise ValueError("the prompt must contain at least one token")
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
        model(tokens[:, begin:end], cache=cache)
        mx.eval([c.state for c in cache])
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
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    detokenizer = StreamingDetokenizer(tokenizer)
    for token in generate_tokens(model, ids, config, tokenizer.eos_token_ids, stats):
        piece = detokenizer.add(token)
        if piece:
            yield piece
    tail = detokenizer.finish()
    if tail:
        yield tail


def generate(model, tokenizer, prompt: str | list[int], config: GenerationConfig | None = None, **kwargs) -> str:
    """The whole completion as one string (kwargs override GenerationConfig fields)."""
    config = dataclasses.replace(config or GenerationConfig(), **kwargs)
    return "".join(stream_generate(model, tokenizer, prompt, config))
