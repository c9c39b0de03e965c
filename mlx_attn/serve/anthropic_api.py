"""The Anthropic Messages API (``POST /v1/messages``,
``POST /v1/messages/count_tokens``) over the same engine: a request is
checked with Anthropic's field names, turned into the chat messages and
tools the OpenAI endpoint renders (:mod:`~mlx_attn.serve.tool_calls`), and
run as a :class:`~mlx_attn.serve.completion.Completion` of one choice; the
answer is written as Anthropic's message or its event stream."""

from __future__ import annotations

import json
import uuid

from mlx_attn.serve.api_error import APIError
from mlx_attn.serve.completion import Completion
from mlx_attn.serve.request_fields import check_fields
from mlx_attn.serve.request_parsing import CompletionRequest, chat_prompt, check_model, check_prompt_length, \
    completion_request
from mlx_attn.serve.tool_calls import ToolUse, TOOL_NAME

__all__ = ["parse_messages_request", "count_tokens", "message_body", "message_events", "error_body",
           "MAX_STOP_SEQUENCES"]

MAX_STOP_SEQUENCES = 16
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error"}
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def error_body(error: APIError) -> dict:
    """Anthropic's error shape (the field, when there is one, named in the message)."""
    kind = _ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    message = error.message.encode("utf-8", "backslashreplace").decode("utf-8")
    if error.param and error.param not in message:
        message = f"{error.param}: {message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


# ---------------------------------------------------------------- the request
def _text_of(blocks, field: str) -> str:
    """A string, or text blocks joined."""
    if isinstance(blocks, str):
        return blocks
    if isinstance(blocks, list):
        texts = []
        for j, block in enumerate(blocks):
            if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
                raise APIError(400, f"{field}[{j}] must be a text block", f"{field}[{j}]")
            texts.append(block["text"])
        return "".join(texts)
    raise APIError(400, f"{field} must be a string or a list of text blocks", field)


def _message(message, i: int, call_names: dict[str, str]) -> list[dict]:
    """One Anthropic message as chat messages: an assistant's text and
    ``tool_use`` blocks become one message with tool calls; a user's
    ``tool_result`` blocks become tool messages, then its text a user message."""
    field = f"messages[{i}]"
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        raise APIError(400, f"{field}.role must be user or assistant", f"{field}.role")
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise APIError(400, f"{field}.content must be a string or a list of content blocks", f"{field}.content")
    texts, calls, results = [], [], []
    for j, block in enumerate(content):
        where = f"{field}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # an earlier turn's reasoning: not part of what this model is shown
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not block["id"]:
                raise APIError(400, f"{where}.id must be a non-empty string", f"{where}.id")
            if not isinstance(block.get("name"), str) or not block["name"]:
                raise APIError(400, f"{where}.name must be a non-empty string", f"{where}.name")
            if not isinstance(block.get("input"), dict):
                raise APIError(400, f"{where}.input must be an object", f"{where}.input")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": block["input"]}})
            call_names[block["id"]] = block["name"]
        elif kind == "tool_result" and role == "user":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or call_id not in call_names:
                raise APIError(400, f"{where}.tool_use_id must name a tool_use block of an earlier assistant "
                                    f"message, got {call_id!r}", f"{where}.tool_use_id")
            text = _text_of(block.get("content", ""), f"{where}.content")
            if block.get("is_error"):
                text = f"Error: {text}"
            results.append({"role": "tool", "content": text, "tool_call_id": call_id, "name": call_names[call_id]})
        else:
            raise APIError(400, f"{where}: a {role} message cannot hold a block of type {kind!r} here "
                                f"(text, tool_use in assistant turns, tool_result in user turns)", f"{where}.type")
    out = results
    if role == "assistant":
        out.append({"role": role, "content": "".join(texts), **({"tool_calls": calls} if calls else {})})
    elif texts or not results:
        out.append({"role": role, "content": "".join(texts)})
    return out


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list", "messages")
    system = body.get("system")
    out = [] if system is None else [{"role": "system", "content": _text_of(system, "system")}]
    call_names: dict[str, str] = {}
    for i, message in enumerate(messages):
        out += _message(message, i, call_names)
    return out


def _tools(body: dict) -> ToolUse | None:
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is not None and not isinstance(tools, list):
        raise APIError(400, "tools must be a list", "tools")
    converted, names = [], []
    for i, tool in enumerate(tools or []):
        field = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise APIError(400, f"{field}: only custom tools (name, input_schema) are served, got type {kind!r}",
                           f"{field}.type")
        name = tool.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise APIError(400, f"{field}.name must be 1 to 64 letters, digits, _ or -, got {name!r}",
                           f"{field}.name")
        if name in names:
            raise APIError(400, f"tools names {name!r} twice", "tools")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict) or schema.get("type") != "object":
            raise APIError(400, f"{field}.input_schema must be a JSON schema of an object", f"{field}.input_schema")
        description = tool.get("description")
        if description is not None and not isinstance(description, str):
            raise APIError(400, f"{field}.description must be a string", f"{field}.description")
        function = {"name": name, "parameters": schema, **({"description": description} if description else {})}
        converted.append({"type": "function", "function": function})
        names.append(name)
    if choice is None:
        return ToolUse(tuple(converted), "auto") if converted else None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise APIError(400, "tool_choice.type must be auto, any, tool or none", "tool_choice")
    parallel = choice.get("disable_parallel_tool_use", False)
    if not isinstance(parallel, bool):
        raise APIError(400, "tool_choice.disable_parallel_tool_use must be a boolean",
                       "tool_choice.disable_parallel_tool_use")
    if kind == "tool":
        if choice.get("name") not in names:
            raise APIError(400, f"tool_choice names {choice.get('name')!r}, which is not among the tools",
                           "tool_choice.name")
        named = choice["name"]
    else:
        named = {"auto": "auto", "any": "required", "none": "none"}[kind]
        if kind == "any" and not names:
            raise APIError(400, "tool_choice any needs tools", "tool_choice")
    return ToolUse(tuple(converted), named, not parallel) if converted else None


def _stop_sequences(body: dict) -> list[str]:
    stops = body.get("stop_sequences")
    if stops is None:
        return []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise APIError(400, "stop_sequences must be a list of non-empty strings", "stop_sequences")
    if len(stops) > MAX_STOP_SEQUENCES:
        raise APIError(400, f"stop_sequences holds at most {MAX_STOP_SEQUENCES} strings", "stop_sequences")
    return stops


def _prompt(state, body: dict) -> tuple[list[int], ToolUse | None]:
    check_model(state, body)
    tool_use = _tools(body)
    prompt = chat_prompt(state, _messages(body), tool_use)
    return check_prompt_length(state, prompt, "messages"), tool_use


def parse_messages_request(state, body: dict) -> CompletionRequest:
    """A Messages request; a 400 naming the first bad field (404: unknown model)."""
    check_fields(body, "messages")
    if body.get("max_tokens") is None:
        raise APIError(400, "max_tokens is required", "max_tokens")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, "stream must be a boolean", "stream")
    stops = _stop_sequences(body)
    prompt, tool_use = _prompt(state, body)
    return completion_request(state, body, prompt, chat=False, stream=stream, stops=stops, tool_use=tool_use)


def count_tokens(state, body: dict) -> dict:
    """``{"input_tokens": n}``: the prompt's tokens, as a Messages request would have them."""
    check_fields(body, "count_tokens")
    prompt, _ = _prompt(state, body)
    return {"input_tokens": len(prompt)}


# ---------------------------------------------------------------- the answer
def _tool_use_block(call) -> dict:
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": call.arguments}


def _stop(completion: Completion) -> tuple[str, str | None]:
    choice = completion.choices[0]
    reason = choice.finish_reason
    if reason == "stop" and choice.text.stop_string is not None:
        return "stop_sequence", choice.text.stop_string
    return _STOP_REASONS.get(reason, "end_turn"), None


def _usage(completion: Completion, output_tokens: int) -> dict:
    cached = completion.choices[0].text.cached_tokens
    return {"input_tokens": len(completion.request.prompt) - cached, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _message_start(completion: Completion, message_id: str) -> dict:
    return {"id": message_id, "type": "message", "role": "assistant", "model": completion.state.model_name,
            "content": [], "stop_reason": None, "stop_sequence": None}


def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def message_body(completion: Completion) -> dict:
    """The whole answer (after ``completion.collect()``)."""
    choice = completion.choices[0]
    content = ([{"type": "text", "text": choice.content}] if choice.content else [])
    content += [_tool_use_block(call) for call in choice.calls]
    reason, sequence = _stop(completion)
    return {**_message_start(completion, new_message_id()), "content": content, "stop_reason": reason,
            "stop_sequence": sequence, "usage": _usage(completion, choice.text.tokens)}


def _event(name: str, payload: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(payload)}\n\n"


async def message_events(completion: Completion):
    """Anthropic's event stream: ``message_start``, for each content block
    ``content_block_start`` / ``_delta`` / ``_stop``, ``message_delta``
    (stop reason, usage), ``message_stop``; an ``error`` event if the model fails."""
    choice = completion.choices[0]
    start = {**_message_start(completion, new_message_id()), "usage": {**_usage(completion, 0)}}
    try:
        yield _event("message_start", {"type": "message_start", "message": start})
        index, open_text = -1, False
        async for text, calls in choice.pieces(completion.state):
            if text:
                if not open_text:
                    index, open_text = index + 1, True
                    yield _event("content_block_start", {"type": "content_block_start", "index": index,
                                                         "content_block": {"type": "text", "text": ""}})
                yield _event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                     "delta": {"type": "text_delta", "text": text}})
            for call in calls:
                if open_text:
                    yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
                    open_text = False
                index += 1
                block = {**_tool_use_block(call), "input": {}}
                yield _event("content_block_start", {"type": "content_block_start", "index": index,
                                                     "content_block": block})
                yield _event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": {
                    "type": "input_json_delta", "partial_json": json.dumps(call.arguments)}})
                yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
        if open_text:
            yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
        reason, sequence = _stop(completion)
        yield _event("message_delta", {"type": "message_delta",
                                       "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                       "usage": {"output_tokens": choice.text.tokens}})
        yield _event("message_stop", {"type": "message_stop"})
    except APIError as error:
        yield _event("error", error_body(error))
    finally:
        completion.cancel_all()
