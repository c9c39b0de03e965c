"""Request bodies -> typed requests: the JSON body decoded within bounds, then
every field of a completion request checked (a 400 naming it) and its prompt
tokenized. Nothing here writes a response.

The parsers read the served model through a ``state`` with ``model_name``,
``tokenizer``, ``context``, ``default_max_tokens``, ``default_temperature``
and ``engine.model.config.vocab_size`` (a :class:`ServerState`)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re

from mlx_attn.serve.api_error import APIError
from mlx_attn.serve.sampling import MAX_TOP_LOGPROBS, SamplingParams

__all__ = ["CompletionRequest", "parse_completion_request", "decode_json_object", "MAX_JSON_DEPTH", "CHAT_ROLES"]

MAX_JSON_DEPTH = 64  # arrays and objects inside each other, the body itself included
MAX_STOP_STRINGS = 4  # as OpenAI
MAX_CHOICES = 16  # n: choices of one request, each an engine request
CHAT_ROLES = ("system", "developer", "user", "assistant")  # the roles whose messages are rendered as given

_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # escapes included
_NOT_A_BRACKET = re.compile(r"[^\[\]{}]+")
_BRACKET_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


# ---------------------------------------------------------------- the body
def decode_json_object(raw: bytes) -> dict:
    """The body as a JSON object; a 400 for anything else (bad encoding,
    bad JSON, nesting deeper than ``MAX_JSON_DEPTH``, not an object)."""
    try:
        text = raw.decode(json.detect_encoding(raw), "surrogatepass")  # as json.loads decodes bytes
    except UnicodeDecodeError as error:
        raise APIError(400, f"the request body is not valid JSON: {error}") from None
    if _nesting_exceeds(text, MAX_JSON_DEPTH):  # before parsing: the decoder recurses per level
        raise _too_deep()
    try:
        body = json.loads(text)
    except RecursionError:  # unreachable under the bound above; never a traceback
        raise _too_deep() from None
    except ValueError as error:  # huge integers too (past Python's digit limit)
        raise APIError(400, f"the request body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def _too_deep() -> APIError:
    return APIError(400, f"the request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels")


def _nesting_exceeds(text: str, limit: int) -> bool:
    """Whether brackets outside strings nest deeper than ``limit``. Exact on
    valid JSON; on a body that is not, the decoder stops at the first error,
    before any level this count has missed."""
    if text.count("[") + text.count("{") <= limit:
        return False
    brackets = _NOT_A_BRACKET.sub("", _JSON_STRING.sub("", text))  # strings go whole: their brackets are text
    return max(itertools.accumulate(map(_BRACKET_STEP.__getitem__, brackets)), default=0) > limit


# ---------------------------------------------------------------- fields
def _field(body: dict, name: str, kinds, default=None, check=None):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise APIError(400, f"{name} must be {_kind_names(kinds)}, got a boolean", name)
    if not isinstance(value, kinds):
        raise APIError(400, f"{name} must be {_kind_names(kinds)}, got {type(value).__name__}", name)
    if check is not None and not check(value):
        raise APIError(400, f"{name} is out of range: {value!r}", name)
    return value


def _number(body: dict, name: str, default: float, check) -> float:
    """A number field as a float; an integer too large for one is out of range."""
    value = _field(body, name, (int, float), default, check)
    try:
        return float(value)
    except OverflowError:
        raise APIError(400, f"{name} is out of range: {value!r}", name) from None


def _kind_names(kinds) -> str:
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean", list: "a list",
             dict: "an object"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def _stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise APIError(400, "stop must be a non-empty string or a list of them", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise APIError(400, f"stop holds at most {MAX_STOP_STRINGS} strings", "stop")
    return stops


def _check_model(state, body: dict) -> None:
    model = _field(body, "model", str, state.model_name)
    if model != state.model_name:
        raise APIError(404, f"model {model!r} does not exist; this server serves {state.model_name!r}",
                       "model", "model_not_found")


def _chat_logprobs(body: dict) -> tuple[bool, int]:
    """Chat: ``logprobs`` true|false, ``top_logprobs`` 0..20 (needs logprobs)."""
    logprobs = _field(body, "logprobs", bool, False)
    top = _field(body, "top_logprobs", int, None, lambda k: 0 <= k <= MAX_TOP_LOGPROBS)
    if top is not None and not logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    return logprobs, top or 0


def _completion_logprobs(body: dict) -> tuple[bool, int]:
    """Completions: ``logprobs`` null or 0..20, the number of most likely tokens listed at each position."""
    top = _field(body, "logprobs", int, None, lambda k: 0 <= k <= MAX_TOP_LOGPROBS)
    return top is not None, top or 0


# ---------------------------------------------------------------- prompts
def _message_text(content, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise APIError(400, f"messages[{index}].content must be a string or a list of text parts", "messages")


def _chat_message(message, index: int) -> dict:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise APIError(400, f"messages[{index}] must be an object with a string role", "messages")
    if message["role"] not in CHAT_ROLES:
        raise APIError(400, f"messages[{index}].role must be one of {', '.join(CHAT_ROLES)}, got "
                            f"{message['role']!r}", f"messages[{index}].role")
    return {"role": message["role"], "content": _message_text(message.get("content"), index)}


def _chat_prompt(state, body: dict) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list", "messages")
    rendered = [_chat_message(message, i) for i, message in enumerate(messages)]
    try:
        text = state.tokenizer.apply_chat_template(rendered, add_generation_prompt=True)
        return state.tokenizer.encode(text, add_special_tokens=False)
    except ValueError as error:
        raise APIError(400, str(error), "messages") from None


def _completion_prompt(state, body: dict) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        try:
            return state.tokenizer.encode(prompt)
        except ValueError as error:
            raise APIError(400, str(error), "prompt") from None
    vocab = state.engine.model.config.vocab_size
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                        for t in prompt):
        return list(prompt)
    raise APIError(400, f"prompt must be a string or a list of token ids in [0, {vocab})", "prompt")


def _prompt(state, body: dict, chat: bool) -> list[int]:
    """The prompt's tokens: not empty, shorter than the model's context."""
    prompt = _chat_prompt(state, body) if chat else _completion_prompt(state, body)
    field, context = "messages" if chat else "prompt", state.context
    if not prompt:
        raise APIError(400, "the prompt is empty", field)
    if context is not None and len(prompt) >= context:
        raise APIError(400, f"the prompt has {len(prompt)} tokens; this model's context is {context}",
                       field, "context_length_exceeded")
    return prompt


def _max_tokens(state, body: dict, chat: bool, prompt_tokens: int) -> int:
    """``max_tokens`` (chat: or ``max_completion_tokens``), by default as
    many as the server's default and the context allow."""
    context = state.context
    room = context - prompt_tokens if context is not None else state.default_max_tokens
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    requested = _field(body, name, int, None)
    if requested is None:
        requested = min(state.default_max_tokens, room)
    if requested < 1:
        raise APIError(400, f"{name} must be at least 1, got {requested}", name)
    if context is not None and requested > room:
        raise APIError(400, f"{name} ({requested}) + the prompt ({prompt_tokens} tokens) exceed this "
                            f"model's context of {context}", name, "context_length_exceeded")
    return requested


def _sampling(state, body: dict, n: int, logprobs: bool, top_logprobs: int) -> list[SamplingParams]:
    """One ``SamplingParams`` per choice: choice i of n draws with seed + i,
    so a seeded request is reproducible and its choices differ."""
    temperature = _number(body, "temperature", state.default_temperature, lambda t: 0 <= t <= 2)
    top_p = _number(body, "top_p", 1.0, lambda p: 0 < p <= 1)
    top_k = _field(body, "top_k", int, 0, lambda k: k >= 0)
    min_p = _number(body, "min_p", 0.0, lambda p: 0 <= p <= 1)
    penalty = _number(body, "repetition_penalty", 1.0, lambda p: p > 0)
    seed = _field(body, "seed", int, None, lambda s: 0 <= s < 2**63)
    try:
        return [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                               repetition_penalty=penalty, seed=None if seed is None else (seed + i) % 2**63,
                               logprobs=logprobs, top_logprobs=top_logprobs)
                for i in range(n)]
    except ValueError as error:
        raise APIError(400, str(error)) from None


# ---------------------------------------------------------------- the request
@dataclasses.dataclass(frozen=True)
class CompletionRequest:
    """What both completion endpoints need from a request body."""

    n: int  # choices, each its own engine request
    logprobs: bool
    top_logprobs: int
    stream: bool
    include_usage: bool  # stream_options.include_usage
    stops: list[str]
    prompt: list[int]
    max_tokens: int
    sampling: list[SamplingParams]  # one per choice
    speculative: bool = True  # False: this request never drafts (when the server drafts)


def parse_completion_request(state, body: dict, chat: bool) -> CompletionRequest:
    """A chat (``chat``) or plain completion request; its fields are checked
    in this order, the first bad one answered (a 400 naming it, 404 for an
    unknown model)."""
    _check_model(state, body)
    n = _field(body, "n", int, 1, lambda count: 1 <= count <= MAX_CHOICES)
    logprobs, top_logprobs = _chat_logprobs(body) if chat else _completion_logprobs(body)
    stream = _field(body, "stream", bool, False)
    include_usage = bool(_field(body, "stream_options", dict, {}).get("include_usage", False))
    stops = _stop_strings(body)
    prompt = _prompt(state, body, chat)
    max_tokens = _max_tokens(state, body, chat, len(prompt))
    sampling = _sampling(state, body, n, logprobs, top_logprobs)
    speculative = _field(body, "speculative", bool, True)
    return CompletionRequest(n=n, logprobs=logprobs, top_logprobs=top_logprobs, stream=stream,
                             include_usage=include_usage, stops=stops, prompt=prompt, max_tokens=max_tokens,
                             sampling=sampling, speculative=speculative)
