"""Text generation: prefill the prompt in chunks into the KV cache, then
decode token by token, streaming text as it is produced.

Decoding is pipelined: the graph of step n+1 is built and queued
(``mx.async_eval``) before token n is read, so building it in Python overlaps
the evaluation of step n. Results have mlx-lm's shape: :func:`stream_generate`
yields a :class:`GenerationResponse` per token, with the counts defined as
mlx-lm defines them (the end token counts as generated but adds no text)."""

from __future__ import annotations

import dataclasses
import time
from typing import Iterator

import mlx.core as mx

from mlx_attn.cache import QuantizedKVCache, RotatingKVCache
from mlx_attn.lm.compiled_decode import CompiledDecodeStep, compilable
from mlx_attn.lm.models.base import check_cache_list, check_max_kv_size
from mlx_attn.lm.sampling import (
    apply_repetition_penalty,
    check_repetition_penalty,
    check_sampling_parameters,
    filtered_logprobs,
    make_sampler,
)
from mlx_attn.lm.ngram_draft import NgramDrafter
from mlx_attn.lm.speculative import (
    DEFAULT_NUM_DRAFT_TOKENS,
    SPECULATIVE_CHOICES,
    DraftLength,
    StepCost,
    check_draft_model,
    check_num_draft_tokens,
    penalized_rows,
    verify_by_drawing,
    verify_drafts,
)
from mlx_attn.lm.tokenizer import StreamingDetokenizer
from mlx_attn.lm.validate import FieldError, require_bool, require_int
from mlx_attn.quantized import check_quantization

__all__ = ["GenerationConfig", "GenerationResponse", "generate_step", "generate_tokens", "stream_generate",
           "generate", "format_statistics", "check_kv_quantization", "prefill", "DEFAULT_PREFILL_CHUNK",
           "check_prompt", "response_stream", "speculative_steps", "draft_model_steps"]

# prompt tokens per prefill step: mlx-lm's prefill_step_size (compare sizes with
# benchmarks/bench_generate.py --prefill-chunks; results never depend on it)
DEFAULT_PREFILL_CHUNK = 2048
BYTES_PER_GB = 1e9  # mlx-lm reports peak memory in decimal gigabytes


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
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK  # mlx-lm's prefill_step_size
    stop_at_eos: bool = True
    logprobs: bool = False  # put each step's log-probabilities over the vocabulary in the response
    max_kv_size: int | None = None  # a rotating cache of this many tokens (when no cache is passed)
    pipelined: bool = True  # False: build each step only after reading the previous token (for comparison)
    # replay one traced decode step (mx.compile) where the caches allow it;
    # False: build every step's graph in Python (for comparison)
    compiled: bool = True
    # quantized KV cache (mlx-lm's options): with kv_bits (4 or 8) the float
    # caches become QuantizedKVCache once they hold quantized_kv_start tokens
    kv_bits: int | None = None
    kv_group_size: int = 64
    quantized_kv_start: int = 0
    # "ngram": propose tokens from the prompt and output (prompt lookup), or
    # "draft": from draft_model, and verify them several per forward
    # (lossless, mlx_attn.lm.speculative)
    speculative: str | None = None
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS  # the most drafted per step
    draft_model: object | None = None  # a loaded model with the same vocabulary, for speculative="draft"

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
        if self.max_kv_size is not None:
            self.max_kv_size = check_max_kv_size(self.max_kv_size)
        for field in ("stop_at_eos", "logprobs", "pipelined", "compiled"):
            require_bool(field, getattr(self, field))
        if self.kv_bits is not None:
            self.kv_group_size, self.kv_bits = check_quantization(self.kv_group_size, self.kv_bits)
        self.quantized_kv_start = require_int("quantized_kv_start", self.quantized_kv_start, 0)
        if self.speculative is not None and self.speculative not in SPECULATIVE_CHOICES:
            raise FieldError("speculative", f"must be one of {', '.join(SPECULATIVE_CHOICES)} or None, "
                             f"got {self.speculative!r}")
        self.num_draft_tokens = check_num_draft_tokens(self.num_draft_tokens)
        if self.speculative == "draft" and self.draft_model is None:
            raise FieldError("draft_model", "is needed by speculative='draft': a model with the same tokenizer")
        if self.draft_model is not None and self.speculative != "draft":
            raise FieldError("draft_model", f"is used only with speculative='draft', got speculative="
                             f"{self.speculative!r}")
        if self.kv_bits is not None and self.max_kv_size is not None:
            raise ValueError("kv_bits and max_kv_size cannot be combined: a rotating KV cache is not quantized")


@dataclasses.dataclass
class GenerationResponse:
    """One step of :func:`stream_generate`, as mlx-lm's response object.

    ``text``: the text this step completes (may be empty while a character
    spans several tokens). ``token``: the token id (None only when
    ``max_tokens`` is 0). ``logprobs``: ``[vocab]`` log-probabilities the
    token was drawn from (after the repetition penalty), when requested.
    ``generation_tokens`` counts every generated token, the end token
    included; ``generation_tps`` is that count over the time since the first
    token was produced; ``prompt_tps`` is prompt tokens over the time to the
    first token. ``peak_memory`` in GB (1e9 bytes) since generation began.
    ``finish_reason`` is None until the last response: ``"stop"`` (end
    token) or ``"length"`` (``max_tokens`` reached)."""

    text: str
    token: int | None
    logprobs: mx.array | None
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    finish_reason: str | None = None


def _config(config: GenerationConfig | None, options: dict) -> GenerationConfig:
    """``config`` with ``options`` overriding its fields; an unknown option
    is a TypeError, as for any function."""
    if config is not None and not isinstance(config, GenerationConfig):
        raise ValueError(f"config must be a GenerationConfig, got {type(config).__name__}")
    unknown = sorted(set(options) - set(GenerationConfig.__dataclass_fields__))
    if unknown:
        raise TypeError(f"unknown generation option {unknown[0]!r}; GenerationConfig has "
                        f"{', '.join(GenerationConfig.__dataclass_fields__)}")
    return dataclasses.replace(config or GenerationConfig(), **options)


def _cache_offset(cache: list) -> int:
    """Tokens the caches hold: the first attention cache's offset (a hybrid
    model's recurrent-state caches have none)."""
    return next((c.offset for c in _flat(cache) if hasattr(c, "offset")), 0)


def _is_cache_list(cache) -> bool:
    """mlx-lm's ``CacheList``: one layer's caches side by side (Falcon-H1's
    attention and Mamba state), told by its ``caches`` and no ``offset``."""
    return hasattr(cache, "caches") and not hasattr(cache, "offset")


def _flat(cache: list):
    for c in cache:
        if _is_cache_list(c):
            yield from _flat(c.caches)
        else:
            yield c


def _quantizable(cache) -> bool:
    """A float KV cache that keeps every token (a window's rotating cache
    stays float: it holds only the window; a recurrent state is no KV)."""
    return hasattr(cache, "to_quantized") and not isinstance(cache, (RotatingKVCache, QuantizedKVCache))


def check_prompt(model, prompt, max_tokens: int, cached: int) -> list[int]:
    """The prompt's token ids, each in the model's vocabulary, with room for
    ``max_tokens`` more after ``cached`` tokens in its context length."""
    if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__len__"):
        raise ValueError(f"prompt must be a list of token ids, got {type(prompt).__name__}")
    if len(prompt) == 0:
        raise ValueError("the prompt must contain at least one token")
    config = getattr(model, "config", None)
    vocab_size = getattr(config, "vocab_size", None)
    ids = [require_int(f"prompt[{i}]", t, 0, vocab_size - 1 if vocab_size else None) for i, t in enumerate(prompt)]
    context = getattr(config, "max_position_embeddings", None)
    if context is not None and cached + len(ids) + max_tokens > context:
        held = f" after the {cached} cached ones" if cached else ""
        raise ValueError(f"max_tokens ({max_tokens}) plus the prompt's {len(ids)} tokens{held} exceed the model's "
                         f"context length of {context}")
    return ids


def _maybe_quantize(cache: list, config: GenerationConfig) -> None:
    """Swap the float caches (in place) for quantized ones once they hold
    ``config.quantized_kv_start`` tokens, when ``config.kv_bits`` asks (a
    windowed layer's rotating cache stays float: it holds only the window)."""
    if config.kv_bits is None or not cache or any(isinstance(c, QuantizedKVCache) for c in _flat(cache)):
        return

    def quantized(c):
        if _is_cache_list(c):  # its attention caches quantized in place: the list is the model's
            c.caches = tuple(quantized(inner) for inner in c.caches)
            return c
        return c.to_quantized(config.kv_group_size, config.kv_bits) if _quantizable(c) else c

    if _cache_offset(cache) >= config.quantized_kv_start:
        cache[:] = [quantized(c) for c in cache]


def check_kv_quantization(model, config: GenerationConfig) -> None:
    """Before anything runs: ``kv_group_size`` must divide every layer's
    head dimension (a quantization group never spans two heads)."""
    if config.kv_bits is None or not hasattr(model, "attention_layers"):
        return
    for layer in model.attention_layers():
        if layer.head_dim is not None and layer.head_dim % config.kv_group_size:
            raise FieldError("kv_group_size", f"({config.kv_group_size}) must divide the model's head dimension "
                             f"({layer.head_dim}): the KV cache is quantized in groups of that many features "
                             "within each head")


def _check_cache(model, cache) -> list:
    layers = len(model.attention_layers()) if hasattr(model, "attention_layers") else None
    if layers is None:
        if not isinstance(cache, list):
            raise ValueError(f"cache must be a list of per-layer KV caches (e.g. model.make_cache()), "
                             f"got {type(cache).__name__}")
        return cache
    return check_cache_list(cache, layers)


class TokenSampling:
    """The sampler (seeded from ``config.seed``) and the repetition-penalty
    window of one generation: ``penalized(logits)``, ``sample(logits)``, then
    ``remember(token)``."""

    def __init__(self, config: GenerationConfig, prompt: list[int]):
        self.sample = make_sampler(config.temperature, config.top_k, config.top_p, config.min_p)
        if config.seed is not None:
            mx.random.seed(config.seed)
        self.penalty, self.context = config.repetition_penalty, config.repetition_context
        # kept as an array so the penalty of step n+1 never waits for token n
        self.recent = mx.array(prompt[-self.context:], dtype=mx.uint32)

    def penalized(self, logits: mx.array) -> mx.array:
        return logits if self.penalty == 1.0 else apply_repetition_penalty(logits, self.recent, self.penalty)

    def remember(self, token: mx.array) -> None:
        if self.penalty != 1.0:
            self.recent = mx.concatenate([self.recent, token.astype(mx.uint32)])[-self.context:]


def prefill(model, tokens: list[int], cache: list, config: GenerationConfig) -> None:
    """Runs ``tokens`` into ``cache`` in chunks of ``config.prefill_chunk``,
    switching to a quantized cache as ``config`` asks (in place); the
    logits are never computed."""
    ids = mx.array(tokens)[None]
    for begin in range(0, len(tokens), config.prefill_chunk):
        _maybe_quantize(cache, config)
        model(ids[:, begin:begin + config.prefill_chunk], cache=cache)
        mx.eval([c.state for c in cache])
    _maybe_quantize(cache, config)


def generate_step(model, prompt: list[int], config: GenerationConfig, cache: list | None = None
                  ) -> Iterator[tuple[int, mx.array | None]]:
    """Yields ``(token id, log-probabilities or None)`` for up to
    ``config.max_tokens`` tokens; never stops at an end token (the caller
    decides). ``cache``: per-layer KV caches that may already hold earlier
    tokens (``prompt`` then continues them); made fresh when None. When the
    caller stops early the cache holds one queued step beyond the last token
    read, as with mlx-lm."""
    if not isinstance(config, GenerationConfig):
        raise ValueError(f"config must be a GenerationConfig, got {type(config).__name__}")
    cache = _check_cache(model, cache) if cache is not None else model.make_cache(config.max_kv_size)
    check_kv_quantization(model, config)
    prompt = check_prompt(model, prompt, config.max_tokens, _cache_offset(cache))
    if config.max_tokens == 0:
        return
    if config.speculative == "draft":
        yield from draft_model_steps(model, prompt, config, cache)
        return
    if config.speculative is not None:
        yield from speculative_steps(model, prompt, config, cache)
        return
    sampling = TokenSampling(config, prompt)
    # a quantized cache changes type mid-generation: that path stays eager
    compiled = config.compiled and config.kv_bits is None and compilable(model, cache)
    forward = CompiledDecodeStep(model, cache) if compiled else (lambda inputs: model(inputs, cache=cache)[:, -1])

    def step(inputs: mx.array) -> tuple[mx.array, mx.array | None]:
        _maybe_quantize(cache, config)
        logits = sampling.penalized(forward(inputs))
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True) if config.logprobs else None
        token = sampling.sample(logits)
        sampling.remember(token)
        return token, (logprobs[0] if logprobs is not None else None)

    # prefill all but the last prompt token in chunks; the last one produces
    # the first logits
    tokens = mx.array(prompt)[None]
    prefill(model, prompt[:-1], cache, config)

    def queue(inputs: mx.array) -> tuple[mx.array, mx.array | None]:
        queued = step(inputs)
        mx.async_eval(*(a for a in queued if a is not None))
        return queued

    token, logprobs = queue(tokens[:, -1:])
    for n in range(config.max_tokens):
        more = n + 1 < config.max_tokens
        queued = queue(token.reshape(1, 1)) if more and config.pipelined else None
        yield int(token.item()), logprobs
        if more and not config.pipelined:
            queued = queue(token.reshape(1, 1))
        if queued is not None:
            token, logprobs = queued


def _greedy_token(forward, inputs: mx.array) -> mx.array:
    """The argmax of a compiled one-token step's logits, lazily (the token
    ``verify_drafts`` keeps from a step without drafts)."""
    return mx.argmax(forward.rows(inputs)[0, -1].astype(mx.float32), axis=-1)


def _draft_room(cache: list, rows: int) -> bool:
    """Whether every cache can take ``rows`` tokens and trim those rejected
    (a rotating cache only before its window slides; a recurrent state never)."""
    for c in cache:
        if not hasattr(c, "trim") or not c.is_trimmable():
            return False
        if getattr(c, "max_size", None) is not None and c.offset + rows >= c.max_size:  # a window (ours or mlx-lm's)
            return False
    return True


class PlainStepCost:
    """The compiled step of a speculating generation (``forward``; None
    where it does not apply) and the measured time of its one-token steps:
    a drafting step costs more than its rows' share (its own trace per row
    count, and no step is queued ahead while drafts wait for verification),
    so its drafts must also beat the plain step (measured on SmolLM2, chat
    prompts where few drafts are kept: every step eager made speculation
    0.58x of plain decoding; drafting steps compiled, edit 33.3 -> 35.8
    tokens/s after the prompt)."""

    def __init__(self, forward, memory: float = 0.9):
        self.forward, self.memory, self.seconds = forward, memory, None

    def record(self, seconds: float) -> None:
        self.seconds = seconds if self.seconds is None else self.memory * self.seconds + (1 - self.memory) * seconds

    def beaten_by(self, cost: StepCost, rate: float, drafts: int) -> bool:
        """Whether a step of ``drafts`` drafts kept at ``rate`` each yields
        more tokens per second than plain steps (True until both are measured)."""
        if self.forward is None or self.seconds is None or cost.steps == 0:
            return True
        fixed, per_row = cost.fit()
        expected_tokens = 1 + sum(rate ** j for j in range(1, drafts + 1))
        return expected_tokens / (fixed + per_row * (drafts + 1)) > 1 / self.seconds


def _settle(cache: list, length: DraftLength, drafts: list[int], tokens: list[int], logits: mx.array,
            with_logprobs: bool) -> list[tuple[int, mx.array | None]]:
    """After a verification: count the kept drafts, trim the refused ones'
    K/V from ``cache``; the ``(token, log-probabilities or None)`` to yield."""
    refused = len(drafts) - (len(tokens) - 1)
    length.record(len(drafts), len(tokens) - 1)
    if refused:
        for c in cache:
            c.trim(refused)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True) if with_logprobs else None
    return [(token, logprobs[i] if logprobs is not None else None) for i, token in enumerate(tokens)]


def speculative_steps(model, prompt: list[int], config: GenerationConfig, cache: list,
                      length: DraftLength | None = None) -> Iterator[tuple[int, mx.array | None]]:
    """:func:`generate_step` with n-gram drafts (``config.speculative``;
    ``prompt`` and ``cache`` as checked there): each forward feeds the last
    token and up to ``num_draft_tokens`` proposed ones, keeps what the
    verification accepts (greedy: :func:`verify_drafts`; sampled: each
    token drawn as without drafts, :func:`verify_by_drawing`) and trims the
    K/V of the rest. A step
    yields its tokens one by one; stopping early leaves the cache holding
    the last step's accepted tokens (greedy plain steps: and one step queued
    beyond, as :func:`generate_step`). ``length``: the draft-length policy,
    whose counters then tell how many drafts were proposed and accepted."""
    if config.seed is not None:
        mx.random.seed(config.seed)
    drafter, cost = NgramDrafter(), StepCost()  # drafts only where they pay for their rows (StepCost)
    sampler = make_sampler(config.temperature, config.top_k, config.top_p, config.min_p)
    length = length if length is not None else DraftLength(config.num_draft_tokens)
    history = list(prompt)  # prompt and accepted tokens: what the drafter searches
    # a step without drafts replays the compiled one-token step, as generate_step does
    compiled = config.compiled and config.kv_bits is None and compilable(model, cache)
    plain = PlainStepCost(CompiledDecodeStep(model, cache) if compiled else None)
    prefill(model, prompt[:-1], cache, config)
    produced, pending = 0, prompt[-1]  # pending: the newest token, not yet in the cache

    def proposal() -> list[int]:
        # the step's last token is the target's own: at most max_tokens - produced - 1 drafts
        count = min(length.next(), config.max_tokens - produced - 1)
        while count > 0 and not (cost.worth(length.rate ** count, 1, count) and plain.beaten_by(cost, length.rate,
                                                                                               count)):
            count -= 1
        return drafter.propose(history, count) if count > 0 and _draft_room(cache, count + 1) else []

    # greedy plain steps queue the next plain step before reading their token, as generate_step does
    # (a synchronous step lost ~1 ms a token: chat 0.87x of plain decoding); the drafter's proposal then
    # waits for the queued step, one token late. Sampled or penalized tokens are drawn on the host's
    # history, one step at a time.
    queue_ahead = (plain.forward is not None and config.temperature == 0 and config.repetition_penalty == 1.0
                   and not config.logprobs and config.kv_bits is None)
    ahead, hold = None, False  # a plain step queued on the newest token (lazy); hold: queue no further one
    while produced < config.max_tokens:
        drafts = [] if ahead is not None else proposal()
        if queue_ahead and not drafts:
            started = time.perf_counter()
            token = ahead if ahead is not None else _greedy_token(plain.forward, mx.array([[pending]]))
            ahead = None
            if not hold and produced + 1 < config.max_tokens:
                ahead = _greedy_token(plain.forward, token.reshape(1, 1).astype(mx.int32))
                mx.async_eval(ahead)
            hold = False
            pending = int(token.item())
            plain.record(time.perf_counter() - started)
            history.append(pending)
            produced += 1
            yield pending, None
            hold = ahead is not None and produced < config.max_tokens and bool(proposal())
            continue
        started = time.perf_counter()
        _maybe_quantize(cache, config)
        if plain.forward is None:
            logits = model(mx.array([[pending] + drafts]), cache=cache)[0].astype(mx.float32)
        else:  # the compiled step, its drafts too: one trace per row count (an eager step cost ~3x)
            logits = plain.forward.rows(mx.array([[pending] + drafts]))[0].astype(mx.float32)
        logits = penalized_rows(logits, history, drafts, config.repetition_penalty, config.repetition_context)
        if config.temperature == 0:
            tokens = verify_drafts(logits, drafts, 0.0)
        else:  # each token drawn as without drafts: a seeded generation is the same whatever was drafted
            tokens = verify_by_drawing(logits, drafts, sampler)
        mx.eval(logits)
        (cost.record(len(drafts) + 1, time.perf_counter() - started) if drafts or plain.forward is None
         else plain.record(time.perf_counter() - started))
        for token, logprobs in _settle(cache, length, drafts, tokens, logits, config.logprobs):
            history.append(token)
            produced += 1
            yield token, logprobs
        pending = tokens[-1]


class _DraftModelState:
    """A draft model's KV cache and the tokens of the sequence it has not
    read yet (``unread``: the newest token, and after a step whose drafts
    were all kept, the last draft too)."""

    def __init__(self, draft, prompt: list[int], config: GenerationConfig):
        self.model, self.config = draft, config
        self.cache = draft.make_cache(config.max_kv_size)
        # its one-token steps replay a compiled trace where the caches allow it
        self.forward = (CompiledDecodeStep(draft, self.cache) if config.compiled and compilable(draft, self.cache)
                        else (lambda inputs: draft(inputs, cache=self.cache)[:, -1]))
        prefill(draft, prompt[:-1], self.cache, dataclasses.replace(config, kv_bits=None, draft_model=None,
                                                                    speculative=None))
        self.unread = [prompt[-1]]

    def room(self, count: int) -> bool:
        return _draft_room(self.cache, len(self.unread) + count)

    def propose(self, count: int, history: list[int]) -> tuple[list[int], mx.array | None]:
        """``count`` tokens drawn one by one from the draft model (greedy:
        its argmax), with the target's sampling filters and penalty, and the
        ``[count, vocab]`` filtered log-probabilities they were drawn from
        (None when greedy). The cache then holds all but the last draft."""
        config = self.config
        inputs, tokens, rows = mx.array([self.unread]), [], []
        recent = mx.array(history[-config.repetition_context:], dtype=mx.uint32)
        for i in range(count):
            logits = self.forward(inputs)
            if config.repetition_penalty != 1.0:
                logits = apply_repetition_penalty(logits, recent, config.repetition_penalty)
            if config.temperature == 0:
                token = mx.argmax(logits, axis=-1)
            else:
                row = filtered_logprobs(logits, config.temperature, config.top_k, config.top_p, config.min_p)
                token = mx.random.categorical(row, axis=-1)
                rows.append(row[0])
            tokens.append(token)
            if config.repetition_penalty != 1.0:
                recent = mx.concatenate([recent, token.astype(mx.uint32)])[-config.repetition_context:]
            if i + 1 < count:
                inputs = token.reshape(1, 1)
                mx.async_eval(inputs)
        drafts = mx.concatenate(tokens)
        q = mx.stack(rows) if rows else None
        mx.eval(drafts, *([q] if q is not None else []))
        self.unread = []
        return drafts.tolist(), q

    def accept(self, drafts: list[int], tokens: list[int]) -> None:
        """After a verification: ``tokens`` (the kept drafts and the target's
        own token) follow; drafts the target refused leave the cache."""
        kept = len(tokens) - 1
        if not drafts:
            self.unread.extend(tokens)
        elif kept == len(drafts):  # the last draft was drawn, never read
            self.unread = [drafts[-1], tokens[-1]]
        else:
            if len(drafts) - 1 - kept:
                for c in self.cache:
                    c.trim(len(drafts) - 1 - kept)
            self.unread = [tokens[-1]]


def draft_model_steps(model, prompt: list[int], config: GenerationConfig, cache: list,
                      length: DraftLength | None = None) -> Iterator[tuple[int, mx.array | None]]:
    """:func:`generate_step` with drafts from ``config.draft_model`` (its own
    KV cache, prefilled with the prompt): each step the draft model proposes
    up to ``length.next()`` tokens, the target verifies them and its own
    next token in one forward of ``k + 1`` rows (:func:`verify_drafts`:
    greedy keeps the drafts while they are the argmax; sampled accepts with
    ``min(1, p/q)`` against the draft's actual distribution ``q``), and both
    caches drop the K/V of refused drafts. ``k`` follows the acceptance
    rate only (no timing), so a seeded generation is reproducible run to run
    (its tokens follow the target's law, but are not those of plain
    sampling: another coupling). ``length``: as for :func:`speculative_steps`."""
    check_draft_model(model, config.draft_model)
    if config.seed is not None:
        mx.random.seed(config.seed)
    length = length if length is not None else DraftLength(config.num_draft_tokens)
    draft = _DraftModelState(config.draft_model, prompt, config)
    prefill(model, prompt[:-1], cache, config)
    history = list(prompt)  # prompt and kept tokens: what the penalties look at
    produced, pending = 0, prompt[-1]
    while produced < config.max_tokens:
        count = min(length.next(), config.max_tokens - produced - 1)
        if count > 0 and not (_draft_room(cache, count + 1) and draft.room(count)):
            count = 0  # a window about to slide: plain steps from here
        drafts, q = draft.propose(count, history) if count > 0 else ([], None)
        _maybe_quantize(cache, config)
        logits = model(mx.array([[pending] + drafts]), cache=cache)[0].astype(mx.float32)
        logits = penalized_rows(logits, history, drafts, config.repetition_penalty, config.repetition_context)
        tokens = verify_drafts(logits, drafts, config.temperature, config.top_k, config.top_p, config.min_p,
                               draft_logprobs=q)
        draft.accept(drafts, tokens)
        for token, logprobs in _settle(cache, length, drafts, tokens, logits, config.logprobs):
            history.append(token)
            produced += 1
            yield token, logprobs
        pending = tokens[-1]


def response_stream(model, detokenizer: StreamingDetokenizer, prompt: list[int], config: GenerationConfig,
                    eos_token_ids, cache, steps: Iterator[tuple[int, mx.array | None]] | None = None
                    ) -> Iterator[GenerationResponse]:
    """The response stream; the last one carries the finish reason. ``steps``:
    the (token, logprobs) source, :func:`generate_step` unless given (the
    distributed generator passes its own)."""
    mx.reset_peak_memory()
    start = time.perf_counter()
    prompt_tps, generated, token, logprobs, text = 0.0, 0, None, None, ""

    def response(finish_reason=None) -> GenerationResponse:
        elapsed = time.perf_counter() - start
        return GenerationResponse(text, token, logprobs, len(prompt), prompt_tps, generated,
                                  generated / elapsed if generated and elapsed > 0 else 0.0,
                                  mx.get_peak_memory() / BYTES_PER_GB, finish_reason)

    for token, logprobs in steps if steps is not None else generate_step(model, prompt, config, cache):
        if generated == 0:
            prompt_tps = len(prompt) / (time.perf_counter() - start)
            start = time.perf_counter()
        generated += 1
        if config.stop_at_eos and token in eos_token_ids:
            text = detokenizer.finish()
            yield response("stop")
            return
        text = detokenizer.add(token)
        if generated == config.max_tokens:
            text += detokenizer.finish()
            break
        yield response()
    yield response("length")


def stream_generate(model, tokenizer, prompt: str | list[int], config: GenerationConfig | None = None, *,
                    cache: list | None = None, **options) -> Iterator[GenerationResponse]:
    """Yields a :class:`GenerationResponse` per generated token, the last one
    with its ``finish_reason``. ``prompt``: text (encoded with the
    tokenizer's special tokens) or token ids. ``options`` override
    ``config``'s fields (``max_tokens=``, ``temperature=``, ...). ``cache``:
    per-layer KV caches already holding earlier tokens (a prompt cache)."""
    config = _config(config, options)
    ids = tokenizer.encode(prompt) if isinstance(prompt, (str, bytes)) else prompt  # encode refuses bytes
    return response_stream(model, StreamingDetokenizer(tokenizer), ids, config, tokenizer.eos_token_ids, cache)


def generate_tokens(model, prompt: list[int], config: GenerationConfig, eos_token_ids=(),
                    cache: list | None = None) -> Iterator[int]:
    """Yields generated token ids, without the end token. The prompt's ids
    must lie in the model's vocabulary and the prompt plus ``max_tokens``
    within its context length."""
    for token, _ in generate_step(model, prompt, config, cache):
        if config.stop_at_eos and token in eos_token_ids:
            return
        yield token


def generate(model, tokenizer, prompt: str | list[int], config: GenerationConfig | None = None, *,
             verbose: bool = False, cache: list | None = None, **options) -> str:
    """The whole completion as one string. ``verbose=True`` streams it to
    stdout between ``==========`` lines, then prints the prompt and
    generation statistics, as mlx-lm does."""
    require_bool("verbose", verbose)
    if verbose:
        print("=" * 10)
    text, last = "", None
    for last in stream_generate(model, tokenizer, prompt, config, cache=cache, **options):
        if verbose:
            print(last.text, end="", flush=True)
        text += last.text
    if verbose:
        print()
        print("=" * 10)
        if not text:
            print("No text generated for this prompt")
        else:
            print(format_statistics(last))
    return text


def format_statistics(response: GenerationResponse) -> str:
    """mlx-lm's three statistics lines."""
    return (f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec\n"
            f"Generation: {response.generation_tokens} tokens, {response.generation_tps:.3f} tokens-per-sec\n"
            f"Peak memory: {response.peak_memory:.3f} GB")
