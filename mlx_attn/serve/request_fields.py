"""Which request fields each API honours, which it accepts and ignores, and
which values it refuses: no field is silently ignored unless listed here (and
in docs/serving.md). Any other field is a 400 naming it."""

from __future__ import annotations

from mlx_attn.serve.api_error import APIError

__all__ = ["HONOURED", "IGNORED", "check_fields"]

_SAMPLING = ("model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
             "presence_penalty", "frequency_penalty", "logit_bias", "seed", "n", "stop", "stream", "stream_options",
             "speculative")

HONOURED = {
    "chat": frozenset(_SAMPLING + ("messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools",
                                   "tool_choice", "parallel_tool_calls", "response_format", "modalities",
                                   "reasoning_effort")),
    "completions": frozenset(_SAMPLING + ("prompt", "logprobs", "echo", "suffix", "best_of", "response_format")),
    "messages": frozenset(("model", "messages", "system", "max_tokens", "temperature", "top_p", "top_k",
                           "stop_sequences", "stream", "tools", "tool_choice", "speculative")),
    "count_tokens": frozenset(("model", "messages", "system", "tools", "tool_choice")),
}

# accepted and ignored: they change nothing a local server computes (bookkeeping, billing, caching hints)
IGNORED = {
    "chat": frozenset(("user", "store", "metadata", "service_tier", "safety_identifier", "prompt_cache_key",
                       "prompt_cache_retention", "verbosity", "prediction")),
    "completions": frozenset(("user",)),
    "messages": frozenset(("metadata", "service_tier", "thinking")),
    "count_tokens": frozenset(("thinking",)),
}

# honoured fields whose other values this server cannot honour: (allowed value, why not the others)
_ONLY = {
    "modalities": (["text"], "this server answers text only"),
    "echo": (False, "echo is not supported"),
    "suffix": ("", "suffix (fill in the middle) is not supported"),
    "best_of": (1, "best_of is not supported; use n"),
}

# fields of the APIs this server refuses whatever their value, and why
_REFUSED = {
    "functions": "functions is the deprecated form of tools; send tools",
    "function_call": "function_call is the deprecated form of tool_choice; send tool_choice",
    "audio": "this server answers text only",
    "web_search_options": "this server has no web search",
}


def check_fields(body: dict, api: str) -> None:
    """A 400 naming the first field of ``body`` that ``api`` neither honours
    nor ignores, or that holds a value this server cannot honour."""
    honoured, ignored = HONOURED[api], IGNORED[api]
    for name, value in body.items():
        if value is None:  # as absent
            continue
        if name in _REFUSED and name not in honoured:
            raise APIError(400, _REFUSED[name], name)
        if name not in honoured and name not in ignored:
            raise APIError(400, f"unrecognized request field {name!r} (docs/serving.md lists the fields)", name)
        if name in _ONLY and name in honoured and value != _ONLY[name][0]:
            raise APIError(400, _ONLY[name][1], name)
