"""Request bodies -> typed requests: the JSON body decoded within bounds, then
every field of a completion request checked (a 400 naming it) and its prompt
tokenized. Nothing here writes a response.

The parsers read the served model through a ``state`` with ``model_name``,
``tokenizer``, ``context``, ``default_max_tokens``, ``default_temperature``
and ``engine.model.config.vocab_size`` (a :class:`ServerState`)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
import json
import re

from mlx_attn.serve.api_error import APIError
from mlx_attn.serve.request_fields import check_fields
from mlx_attn.serve.sampling import MAX_LOGIT_BIAS, MAX_PENALTY, MAX_TOP_LOGPROBS, SamplingParams
from mlx_attn.serve.structured_output import response_format_constraint, tool_choice_constraint
from mlx_attn.serve.tool_calls import ToolUse, assistant_tool_calls, parse_tool_use, render_chat

__all__ = ["CompletionRequest", "parse_completion_request", "completion_request", "chat_messages", "chat_prompt",
           "check_model", "check_prompt_length", "decode_json_object", "MAX_JSON_DEPTH", "CHAT_ROLES"]

MAX_JSON_DEPTH = 64  # arrays and objects inside each other, the body itself included
MAX_STOP_STRINGS = 4  # as OpenAI
MAX_CHOICES = 16  # n: choices of one request, each an engine request
MAX_LOGIT_BIAS_TOKENS = 1024
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")  # tool: a call's result

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


def check_model(state, body: dict) -> None:
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
    raise APIError(400, f"messages[{index}].content must be a string or a list of text parts",
                   f"messages[{index}].content")


def _chat_message(message, index: int, call_names: dict[str, str]) -> dict:
    """One message as chat templates read it (``content`` a string; an
    assistant's ``tool_calls`` with arguments as objects; a tool result with
    its call's id and name). ``call_names``: the ids of the calls made so
    far, to their tools' names (a tool message answers one of them)."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise APIError(400, f"messages[{index}] must be an object with a string role", "messages")
    role = message["role"]
    if role not in CHAT_ROLES:
        hint = " (function messages are the deprecated form of tool messages)" if role == "function" else ""
        raise APIError(400, f"messages[{index}].role must be one of {', '.join(CHAT_ROLES)}, got "
                            f"{role!r}{hint}", f"messages[{index}].role")
    if role == "assistant" and message.get("tool_calls") is not None:
        calls = assistant_tool_calls(message["tool_calls"], index)
        call_names.update((call["id"], call["function"]["name"]) for call in calls)
        content = message.get("content")
        text = "" if content is None else _message_text(content, index)
        return {"role": role, "content": text, "tool_calls": calls}
    text = _message_text(message.get("content"), index)
    if role != "tool":
        return {"role": role, "content": text}
    call_id = message.get("tool_call_id")
    if not isinstance(call_id, str) or call_id not in call_names:
        raise APIError(400, f"messages[{index}].tool_call_id must name a tool call of an earlier assistant "
                            f"message, got {call_id!r}", f"messages[{index}].tool_call_id")
    return {"role": role, "content": text, "tool_call_id": call_id, "name": call_names[call_id]}


def chat_messages(body: dict) -> list[dict]:
    """``messages`` checked and shaped as chat templates read them."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list", "messages")
    call_names: dict[str, str] = {}
    return [_chat_message(message, i, call_names) for i, message in enumerate(messages)]


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")  # OpenAI's values


def _reasoning_effort(body: dict) -> str | None:
    """``reasoning_effort``: gpt-oss's ``Reasoning:`` (other models have none to set)."""
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise APIError(400, f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}",
                       "reasoning_effort")
    return effort


def chat_prompt(state, messages: list[dict], tool_use: ToolUse | None, reasoning_effort: str | None = None
                ) -> list[int]:
    """The tokens of ``messages`` (and the tools) through the model's chat template."""
    try:
        text = render_chat(state.tokenizer, messages, tool_use, reasoning_effort)
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


def _prompt(state, body: dict, chat: bool, tool_use: ToolUse | None) -> list[int]:
    prompt = chat_prompt(state, chat_messages(body), tool_use, _reasoning_effort(body)) if chat \
        else _completion_prompt(state, body)
    return check_prompt_length(state, prompt, "messages" if chat else "prompt")


def check_prompt_length(state, prompt: list[int], field: str) -> list[int]:
    """The prompt's tokens: not empty, shorter than the model's context."""
    context = state.context
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
    presence = _number(body, "presence_penalty", 0.0, lambda p: -MAX_PENALTY <= p <= MAX_PENALTY)
    frequency = _number(body, "frequency_penalty", 0.0, lambda p: -MAX_PENALTY <= p <= MAX_PENALTY)
    bias = _logit_bias(state, body)
    try:
        return [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                               repetition_penalty=penalty, seed=None if seed is None else (seed + i) % 2**63,
                               logprobs=logprobs, top_logprobs=top_logprobs, presence_penalty=presence,
                               frequency_penalty=frequency, logit_bias=bias)
                for i in range(n)]
    except ValueError as error:
        raise APIError(400, str(error)) from None


def _logit_bias(state, body: dict) -> tuple[tuple[int, float], ...]:
    """``logit_bias``: an object from token ids (as strings, OpenAI's form)
    to biases in [-100, 100]."""
    bias = _field(body, "logit_bias", dict, {})
    if len(bias) > MAX_LOGIT_BIAS_TOKENS:
        raise APIError(400, f"logit_bias holds at most {MAX_LOGIT_BIAS_TOKENS} tokens", "logit_bias")
    vocab = state.engine.model.config.vocab_size
    pairs = []
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and int(key) < vocab):
            raise APIError(400, f"logit_bias keys must be token ids in [0, {vocab}), got {key!r}", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
            raise APIError(400, f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                                f"got {value!r} for token {key}", "logit_bias")
        pairs.append((int(key), float(value)))
    return tuple(pairs)


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
    tool_use: ToolUse | None = None  # chat: the tools, tool_choice and parallel_tool_calls
    constraint: Callable | None = None  # a fresh Constraint per call (one per choice), or None: unconstrained
    speculative: bool = True  # False: this request never drafts (when the server drafts)

    @property
    def drafts(self) -> bool:
        """Whether the request may draft (when the server drafts): not opted
        out and without a constraint (a grammar's mask cannot verify drafts;
        the engine's ``drafts_for`` says the same)."""
        return self.speculative and self.constraint is None


def parse_completion_request(state, body: dict, chat: bool) -> CompletionRequest:
    """A chat (``chat``) or plain completion request; its fields are checked
    in this order, the first bad one answered (a 400 naming it, 404 for an
    unknown model)."""
    check_fields(body, "chat" if chat else "completions")
    check_model(state, body)
    n = _field(body, "n", int, 1, lambda count: 1 <= count <= MAX_CHOICES)
    logprobs, top_logprobs = _chat_logprobs(body) if chat else _completion_logprobs(body)
    stream = _field(body, "stream", bool, False)
    include_usage = bool(_field(body, "stream_options", dict, {}).get("include_usage", False))
    stops = _stop_strings(body)
    tool_use = parse_tool_use(body) if chat else None
    prompt = _prompt(state, body, chat, tool_use)
    return completion_request(state, body, prompt, chat=chat, n=n, logprobs=logprobs, top_logprobs=top_logprobs,
                              stream=stream, include_usage=include_usage, stops=stops, tool_use=tool_use)


def completion_request(state, body: dict, prompt: list[int], *, stream: bool, stops: list[str],
                       tool_use: ToolUse | None = None, chat: bool = True, n: int = 1, logprobs: bool = False,
                       top_logprobs: int = 0, include_usage: bool = False) -> CompletionRequest:
    """The request for ``prompt`` (checked), its ``max_tokens`` and sampling
    fields read from ``body`` (also for the Anthropic API, whose names match)."""
    max_tokens = _max_tokens(state, body, chat, len(prompt))
    sampling = _sampling(state, body, n, logprobs, top_logprobs)
    # a forced tool call is the answer: its grammar, not response_format's (that shapes text answers)
    constraint = tool_choice_constraint(state, tool_use) or response_format_constraint(state, body)
    speculative = _field(body, "speculative", bool, True)
    return CompletionRequest(n=n, logprobs=logprobs, top_logprobs=top_logprobs, stream=stream,
                             include_usage=include_usage, stops=stops, prompt=prompt, max_tokens=max_tokens,
                             sampling=sampling, tool_use=tool_use, constraint=constraint, speculative=speculative)
