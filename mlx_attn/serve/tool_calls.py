"""Tool calling: a request's ``tools`` and ``tool_choice`` checked, the
conversation rendered with them through the model's chat template, and the
model's own tool-call text parsed back into calls as it streams.

The model's format is found from its tokenizer (:func:`tool_call_format`):
an mlx-lm tokenizer's own parser (mlx-lm's ``tool_parsers``) where it has
one; else from the chat template: Hermes / Qwen ``<tool_call>{json}</tool_call>``,
Mistral ``[TOOL_CALLS]``, Llama 3 JSON, Gemma 3's Python list of calls and
FunctionGemma's ``call:NAME{...}`` (:mod:`mlx_attn.serve.gemma_tools`),
gpt-oss's harmony messages
(rendered and parsed by ``openai-harmony`` where it and its vocabulary can be
had offline, :mod:`mlx_attn.serve.harmony`; else the chat template and
:class:`HarmonyStream`). A template that does not render tools
gets them in a system message asking for the Hermes format, which is then
parsed.

``tool_choice`` ``required`` or a named function is met by starting the
answer with the format's call opening (for a named function, up to its
arguments): the model then writes the call, held by constrained decoding
(:func:`forced_call_grammar`) to one call of an offered tool whose
arguments match the tool's JSON schema."""

from __future__ import annotations

import dataclasses
import importlib
import json
import re
import uuid
from collections.abc import Callable

from mlx_attn.serve.api_error import APIError
from mlx_attn.serve.gemma_tools import function_gemma_call, gemma_messages, gemma_python_calls, python_call_grammar
from mlx_attn.serve.harmony import HarmonyLibraryStream, harmony_encoding, render_harmony

__all__ = ["ToolUse", "ToolCall", "ToolCallFormat", "ToolCallStream", "HarmonyStream", "call_stream",
           "harmony_call", "parse_tool_use", "tool_call_format", "forced_call_grammar", "prepare_tokenizer",
           "render_chat", "assistant_tool_calls", "new_call_id", "TOOL_NAME"]

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_TOOLS = 128
TOOL_CHOICES = ("none", "auto", "required")


def new_call_id(prefix: str = "call_") -> str:
    return prefix + uuid.uuid4().hex[:24]


# ---------------------------------------------------------------- the request's tools
@dataclasses.dataclass(frozen=True)
class ToolUse:
    """A request's tools (OpenAI's form), its ``tool_choice`` (``auto``,
    ``none``, ``required`` or a tool's name) and ``parallel_tool_calls``."""

    tools: tuple[dict, ...]
    choice: str
    parallel: bool = True

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(tool["function"]["name"] for tool in self.tools)

    @property
    def forced(self) -> str | None:
        """``""`` when a call of any tool is required, the tool's name when a
        named one is, None when the model may answer in text."""
        if self.choice in ("auto", "none"):
            return None
        return "" if self.choice == "required" else self.choice

    @property
    def constraint(self) -> dict | None:
        """What constrained decoding must hold the answer to (None: nothing):
        a call of one of ``tools`` (their ``parameters`` schemas), built into
        a grammar by :func:`forced_call_grammar`."""
        if self.forced is None:
            return None
        tools = [t for t in self.tools if self.forced in ("", t["function"]["name"])]
        return {"kind": "tool_call", "tools": tools, "parallel": self.parallel}


def _tool(tool, index: int) -> dict:
    field = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise APIError(400, f'{field} must be {{"type": "function", "function": {{...}}}}', field)
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise APIError(400, f"{field}.function.name must be 1 to 64 letters, digits, _ or -, got {name!r}",
                       f"{field}.function.name")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise APIError(400, f"{field}.function.description must be a string", f"{field}.function.description")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise APIError(400, f"{field}.function.parameters must be a JSON schema of an object",
                       f"{field}.function.parameters")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise APIError(400, f"{field}.function.strict must be a boolean", f"{field}.function.strict")
    unknown = set(function) - {"name", "description", "parameters", "strict"}
    if unknown:
        raise APIError(400, f"{field}.function has unknown field {sorted(unknown)[0]!r}", field)
    clean = {"name": name, "parameters": parameters}
    if description is not None:
        clean["description"] = description
    return {"type": "function", "function": clean}


def _tool_choice(choice, names: tuple[str, ...]) -> str:
    if choice is None:
        return "auto" if names else "none"
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise APIError(400, f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or a named function, "
                                f"got {choice!r}", "tool_choice")
        if choice == "required" and not names:
            raise APIError(400, "tool_choice required needs tools", "tool_choice")
        return choice
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise APIError(400, 'tool_choice must be a string or {"type": "function", "function": {"name": ...}}',
                       "tool_choice")
    if name not in names:
        raise APIError(400, f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    return name


def parse_tool_use(body: dict) -> ToolUse | None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat
    request (None without tools); a 400 naming the first bad one."""
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise APIError(400, "tools must be a list of functions", "tools")
    tools = [_tool(tool, i) for i, tool in enumerate(tools or [])]
    if len(tools) > MAX_TOOLS:
        raise APIError(400, f"tools holds at most {MAX_TOOLS} functions", "tools")
    names = tuple(t["function"]["name"] for t in tools)
    duplicate = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if duplicate is not None:
        raise APIError(400, f"tools names {duplicate!r} twice", "tools")
    choice = _tool_choice(body.get("tool_choice"), names)
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise APIError(400, "parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if not tools:
        return None
    return ToolUse(tuple(tools), choice, parallel)


# ---------------------------------------------------------------- messages
def _arguments(text, field: str) -> dict:
    if isinstance(text, dict):
        return text
    try:
        value = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise APIError(400, f"{field} must be a JSON object encoded as a string", field)
    return value


def assistant_tool_calls(calls, index: int) -> list[dict]:
    """An assistant message's ``tool_calls`` in the form chat templates read
    (arguments as an object); a 400 naming the first bad one."""
    field = f"messages[{index}].tool_calls"
    if not isinstance(calls, list) or not calls:
        raise APIError(400, f"{field} must be a non-empty list", field)
    out = []
    for j, call in enumerate(calls):
        where = f"{field}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise APIError(400, f'{where} must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}',
                           where)
        if not isinstance(call.get("id"), str) or not call["id"]:
            raise APIError(400, f"{where}.id must be a non-empty string", f"{where}.id")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise APIError(400, f"{where}.function.name must be a non-empty string", f"{where}.function.name")
        arguments = _arguments(function.get("arguments"), f"{where}.function.arguments")
        out.append({"id": call["id"], "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})
    return out


# ---------------------------------------------------------------- the model's format
def _mlx_lm_parser(name: str) -> Callable | None:
    """mlx-lm's parser ``name`` where mlx-lm is installed."""
    try:
        return importlib.import_module(f"mlx_lm.tool_parsers.{name}").parse_tool_call
    except Exception:  # noqa: BLE001  (mlx-lm absent or changed: our own parser)
        return None


def _json_calls(text: str) -> list[dict]:
    """One JSON call object, a list of them, or several objects one after
    another (``;`` or whitespace between)."""
    decoder, calls, at = json.JSONDecoder(), [], 0
    text = text.strip()
    while at < len(text):
        value, at = decoder.raw_decode(text, at)
        calls += value if isinstance(value, list) else [value]
        while at < len(text) and text[at] in " \t\r\n;,":
            at += 1
    return calls


@dataclasses.dataclass(frozen=True)
class ToolCallFormat:
    """How a model writes calls: ``start`` opens one (None: the whole answer
    is the call when it starts with ``{`` or ``[``), ``end`` closes it
    ("": the answer's end), ``parse`` reads the text between into calls;
    ``native``: the chat template renders tools itself."""

    name: str
    start: str | None
    end: str
    parse: Callable[[str], object]
    native: bool
    call_prefix: str = '{"name": '  # what a call's text starts with, up to the quoted name
    arguments_key: str = "arguments"
    harmony: object = None  # harmony: openai-harmony's encoding, None where it cannot be had
    openings: tuple[str, ...] = ("{", "[")  # without ``start``: how an answer that is a call begins

    def forced_opening(self, name: str) -> str:
        """The answer's opening that makes it a call (of ``name`` unless it is "")."""
        if self.name == "harmony":
            return "<|channel|>commentary to=functions." + (f"{name} <|constrain|>json<|message|>" if name else "")
        opening = self.start or ""
        if self.name == "hermes":
            opening += "\n"
        if name and self.name in ("hermes", "llama3"):
            opening += f'{self.call_prefix}{json.dumps(name)}, "{self.arguments_key}": '
        elif self.name == "gemma":
            opening = "[" + (f"{name}(" if name else "")
        elif name and self.name == "function-gemma":
            opening += f"call:{name}{{"
        return opening


def _lark_json(schema: dict, json_options: dict) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": json_options})


def forced_call_grammar(fmt: ToolCallFormat, tool_use: ToolUse, json_options: dict) -> str | None:
    """An llguidance (lark) grammar for what the model writes after
    :meth:`ToolCallFormat.forced_opening`: one call of a tool
    :attr:`ToolUse.constraint` allows, its arguments matching the tool's
    ``parameters`` (JSON written with ``json_options``), the call closed as
    the format closes it; then the answer may only end. None when nothing is
    forced or the format's call text is not JSON this grammar can spell
    (harmony's ``required``: the tool name sits among special tokens;
    FunctionGemma; Gemma 3 tools whose schemas are not plain properties;
    mlx-lm parsers other than its JSON one)."""
    wanted = tool_use.constraint
    if wanted is None:
        return None
    tools = wanted["tools"]
    named = tool_use.forced != ""
    rules = [f"args{i}: {_lark_json(tool['function']['parameters'], json_options)}" for i, tool in enumerate(tools)]
    key = fmt.arguments_key

    def calls() -> str:  # a whole call object, of any of the tools
        for i, tool in enumerate(tools):
            opening = f'{fmt.call_prefix}{json.dumps(tool["function"]["name"])}, "{key}": '
            rules.append(f"call{i}: {json.dumps(opening)} args{i} " + json.dumps("}"))
        return " | ".join(f"call{i}" for i in range(len(tools)))

    close = json.dumps("\n</tool_call>")
    if fmt.name == "hermes":  # the opening ends with "<tool_call>\n", named: with '"arguments": '
        start = "args0 " + json.dumps("}\n</tool_call>") if named else f"({calls()}) {close}"
    elif fmt.name == "llama3":
        start = 'args0 "}"' if named else calls()
    elif fmt.name == "mistral":
        start = '"[" (' + calls() + ') "]"'
    elif fmt.name == "harmony" and named:
        start = "args0"  # the model's <|call|> ends it: an end token
    elif fmt.name == "gemma":  # Python call syntax: keyword arguments, each a JSON value
        return python_call_grammar(tools, named, json_options)
    elif fmt.name == "mlx-lm" and fmt.start == "<tool_call>" and fmt.end == "</tool_call>" \
            and getattr(fmt.parse, "json_tools", False):
        start = f'{json.dumps(chr(10))} ({calls()}) {close}'  # the opening ends with "<tool_call>"
    else:
        return None
    return "\n".join([f"start: {start}", *rules]) + "\n"


def _hermes_parse(text: str):
    parser = _mlx_lm_parser("json_tools")
    return parser(text) if parser is not None else json.loads(text.strip())


def _mistral_parse(text: str):
    parser = _mlx_lm_parser("mistral")
    return parser(text) if parser is not None else _json_calls(text)


def tool_call_format(tokenizer) -> ToolCallFormat:
    """The tool-call format of the model behind ``tokenizer`` (a few
    substring tests of its template: cheap enough for every request)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    wrapper = getattr(tokenizer, "wrapper", None)  # an mlx-lm tokenizer: its own parser, as mlx_lm.server uses
    if wrapper is not None and getattr(wrapper, "has_tool_calling", False):
        def parse(text):
            return wrapper.tool_parser(text, None)

        # mlx-lm's JSON parser reads calls a grammar can spell (forced_call_grammar)
        parse.json_tools = getattr(wrapper.tool_parser, "__module__", "").endswith(".json_tools")
        return ToolCallFormat("mlx-lm", wrapper.tool_call_start, wrapper.tool_call_end or "", parse,
                              "tools" in template)
    if "<|channel|>" in template:  # gpt-oss
        return ToolCallFormat("harmony", "<|channel|>", "<|end|>", json.loads, True,
                              harmony=harmony_encoding(tokenizer))
    if "<start_function_call>" in template:  # FunctionGemma
        return ToolCallFormat("function-gemma", "<start_function_call>", "<end_function_call>",
                              function_gemma_call, True)
    if "<tool_call>" in template:
        return ToolCallFormat("hermes", "<tool_call>", "</tool_call>", _hermes_parse, True)
    if "[TOOL_CALLS]" in template:
        return ToolCallFormat("mistral", "[TOOL_CALLS]", "", _mistral_parse, True)
    if "<|python_tag|>" in template or ("ipython" in template and "tools" in template):
        return ToolCallFormat("llama3", None, "", _json_calls, True, arguments_key="parameters")
    if "<start_of_turn>" in template:  # Gemma 3: no tools in its template; Google's prompted format
        return ToolCallFormat("gemma", None, "", gemma_python_calls, False, openings=("[", "```"))
    return ToolCallFormat("hermes", "<tool_call>", "</tool_call>", _hermes_parse, False)


def prepare_tokenizer(tokenizer) -> ToolCallFormat:
    """Before serving: the model's format decided once (gpt-oss: openai-harmony's
    vocabulary had now, not in the first request), and the tokens that end
    a turn in its format made end tokens where the vocabulary has them:
    harmony's ``<|call|>`` (after a call) and ``<|return|>``; FunctionGemma's
    ``<start_function_response>`` (the model would go on to invent the result)."""
    fmt = tool_call_format(tokenizer)
    ends = {"harmony": ("<|return|>", "<|call|>"), "function-gemma": ("<start_function_response>",)}
    for token in ends.get(fmt.name, ()):
        try:
            tokenizer.add_eos_token(token)
        except (ValueError, AttributeError):  # not a token here: the parsers read its text
            pass
    return fmt


def _calls_of(parsed) -> list[tuple[str, dict]]:
    """A parser's result as (name, arguments) pairs; ValueError if it is not calls."""
    parsed = parsed if isinstance(parsed, list) else [parsed]
    calls = []
    for call in parsed:
        if not isinstance(call, dict):
            raise ValueError("not a call")
        if isinstance(call.get("function"), dict):  # OpenAI's own shape
            call = call["function"]
        arguments = call.get("arguments", call.get("parameters", {}))
        if isinstance(arguments, str):
            arguments = json.loads(arguments)
        if not isinstance(call.get("name"), str) or not isinstance(arguments, dict):
            raise ValueError("not a call")
        calls.append((call["name"], arguments))
    return calls


# ---------------------------------------------------------------- rendering
_FALLBACK_PROMPT = (
    "You may call functions to answer. The functions, as JSON schemas:\n<tools>\n{tools}\n</tools>\n"
    "To call functions, answer only with one block per call:\n<tool_call>\n"
    '{{"name": <function name>, "arguments": <arguments as a JSON object>}}\n</tool_call>')


def _hermes_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """The conversation for a template that knows no tools: calls and
    results written in the Hermes format, the tools in the system message."""
    out = []
    for message in messages:
        content = message.get("content") or ""
        if message["role"] == "assistant" and message.get("tool_calls"):
            calls = "\n".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                            "arguments": c["function"]["arguments"]})
                              + "\n</tool_call>" for c in message["tool_calls"])
            out.append({"role": "assistant", "content": (content + "\n" if content else "") + calls})
        elif message["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({"role": message["role"], "content": content})
    if tools:
        listed = _FALLBACK_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + listed}
        else:
            out.insert(0, {"role": "system", "content": listed})
    return out


def render_chat(tokenizer, messages: list[dict], tool_use: ToolUse | None, reasoning_effort: str | None = None
                ) -> str:
    """The prompt text: ``messages`` (assistant ``tool_calls`` with arguments
    as objects, ``tool`` messages) through the chat template with the
    request's tools, and the forced opening of a required call.
    ``reasoning_effort``: gpt-oss's, set where openai-harmony renders."""
    fmt = tool_call_format(tokenizer)
    offered = list(tool_use.tools) if tool_use is not None and tool_use.choice != "none" else None
    uses_tools = offered or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if fmt.harmony is not None:  # gpt-oss: every conversation through the library
        text = render_harmony(fmt.harmony, messages, offered, reasoning_effort)
    elif not uses_tools:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    elif fmt.native:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=offered)
    elif fmt.name == "gemma":
        text = tokenizer.apply_chat_template(gemma_messages(messages, offered), add_generation_prompt=True)
    else:
        text = tokenizer.apply_chat_template(_hermes_messages(messages, offered), add_generation_prompt=True)
    if tool_use is not None and tool_use.forced is not None:
        text += fmt.forced_opening(tool_use.forced)
    return text


# ---------------------------------------------------------------- the answer
@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A call the answer made: its ``index`` among the answer's calls."""

    id: str
    name: str
    arguments: dict
    index: int = 0

    def openai(self, delta: bool = False) -> dict:
        out = {"id": self.id, "type": "function",
               "function": {"name": self.name, "arguments": json.dumps(self.arguments)}}
        return {"index": self.index, **out} if delta else out


class ToolCallStream:
    """One choice's text -> (content, calls) as it streams: text that could
    still open a call is held back; a call is parsed once closed (or at the
    end), and text that does not parse is given back as content."""

    def __init__(self, fmt: ToolCallFormat, tool_use: ToolUse):
        self.fmt, self.tool_use = fmt, tool_use
        opening = fmt.forced_opening(tool_use.forced) if tool_use.forced is not None else None
        self.inside = opening is not None  # within a call's text
        self.buffer = ""
        self.call_text = "" if opening is None else opening[len(fmt.start or ""):]
        self.decided = fmt.start is not None or self.inside  # llama3: does the answer start with JSON?
        self.calls: list[ToolCall] = []
        self.space = ""  # blank text after a call, held: sent only if more text follows

    def _take_calls(self, text: str, closed: bool = True) -> tuple[str, list[ToolCall]]:
        """Parse a call's text: (content, calls); content is the text as
        written (markers included) when it does not parse."""
        as_written = (self.fmt.start or "") + text + (self.fmt.end if closed else "")
        try:
            calls = _calls_of(self.fmt.parse(text))
        except Exception:  # noqa: BLE001  (whatever the model wrote: given back as text)
            return as_written, []
        if not calls:
            return as_written, []
        if not self.tool_use.parallel:
            calls = calls[: max(0, 1 - len(self.calls))]
        made = [ToolCall(new_call_id(), name, arguments, len(self.calls) + i)
                for i, (name, arguments) in enumerate(calls)]
        self.calls += made
        return "", made

    def add(self, text: str) -> tuple[str, list[ToolCall]]:
        """Content now safe to send and the calls completed by ``text``."""
        content, made = self._add(text)
        if self.calls and not content.strip():  # blank text between or after calls is no answer
            self.space += content
            return "", made
        content, self.space = self.space + content, ""
        return content, made

    def _add(self, text: str) -> tuple[str, list[ToolCall]]:
        fmt, content, made = self.fmt, "", []
        self.buffer += text
        if not self.decided:
            stripped = self.buffer.lstrip()
            if not stripped:
                return "", []
            if not any(stripped.startswith(o) for o in self.fmt.openings) and \
                    any(o.startswith(stripped) for o in self.fmt.openings):
                return "", []  # may still open a call
            self.decided = True
            self.inside = any(stripped.startswith(o) for o in self.fmt.openings)
        while True:
            if self.inside:
                if fmt.end and fmt.end in self.buffer:
                    at = self.buffer.index(fmt.end)
                    self.call_text += self.buffer[:at]
                    self.buffer = self.buffer[at + len(fmt.end):]
                    self.inside = False
                    text_back, calls = self._take_calls(self.call_text)
                    self.call_text = ""
                    content += text_back
                    made += calls
                    continue
                keep = len(fmt.end) - 1 if fmt.end else 0  # the closing marker may be arriving
                cut = max(len(self.buffer) - keep, 0)
                self.call_text += self.buffer[:cut]
                self.buffer = self.buffer[cut:]
                return content, made
            if fmt.start is None:
                content += self.buffer
                self.buffer = ""
                return content, made
            at = self.buffer.find(fmt.start)
            if at >= 0:
                content += self.buffer[:at]
                self.buffer = self.buffer[at + len(fmt.start):]
                self.inside = True
                continue
            held = _partial_suffix(self.buffer, fmt.start)
            cut = len(self.buffer) - held
            content += self.buffer[:cut]
            self.buffer = self.buffer[cut:]
            return content, made

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the answer's end: the rest as content, or the open call parsed."""
        if self.inside:
            text, self.call_text, self.buffer = self.call_text + self.buffer, "", ""
            self.inside = False
            content, made = self._take_calls(text, closed=False)  # never closed: a call if it parses whole
        else:
            content, made, self.buffer = self.buffer, [], ""
        if self.calls and not content.strip():
            return "", made
        content, self.space = self.space + content, ""
        return content, made


class HarmonyStream:
    """gpt-oss's harmony messages -> (content, calls), the interface of
    :class:`ToolCallStream`. The answer is a run of messages, each a header
    (``<|channel|>`` name, ``to=`` recipient, ``<|constrain|>``) then
    ``<|message|>`` and a body up to ``<|end|>`` (or the answer's end: the
    ``<|call|>`` and ``<|return|>`` tokens end it). A body addressed
    ``to=functions.NAME`` is a call of NAME with the body as its JSON
    arguments; ``final`` and addressed-to-no-one ``commentary`` bodies are
    the content, streamed; ``analysis`` (the model's reasoning) is left out."""

    def __init__(self, fmt: ToolCallFormat, tool_use: ToolUse):
        self.tool_use = tool_use
        self.buffer = fmt.forced_opening(tool_use.forced) if tool_use.forced is not None else ""
        self.header: tuple[str, str | None] | None = None  # (channel, recipient) of the message being read
        self.calls: list[ToolCall] = []

    def _visible(self) -> bool:
        channel, recipient = self.header
        return recipient is None and channel in ("final", "commentary")

    def _close(self, body: str) -> tuple[str, list[ToolCall]]:
        visible, (_, recipient), self.header = self._visible(), self.header, None
        if recipient is not None and recipient.startswith("functions."):
            return harmony_call(recipient, body, self.tool_use, self.calls)
        return (body if visible else ""), []

    def add(self, text: str) -> tuple[str, list[ToolCall]]:
        self.buffer += text
        content, made = "", []
        while True:
            if self.header is None:
                at = self.buffer.find(_HARMONY_MESSAGE)
                if at < 0:
                    return content, made
                head, self.buffer = self.buffer[:at], self.buffer[at + len(_HARMONY_MESSAGE):]
                channel = re.search(r"<\|channel\|>\s*(\w+)", head)
                recipient = re.search(r"to=([^\s<]+)", head)
                self.header = (channel.group(1) if channel else "", recipient.group(1) if recipient else None)
                continue
            at = self.buffer.find(_HARMONY_END)
            if at < 0:
                if self._visible():  # send what cannot be the end marker's beginning
                    cut = len(self.buffer) - _partial_suffix(self.buffer, _HARMONY_END)
                    content, self.buffer = content + self.buffer[:cut], self.buffer[cut:]
                return content, made
            body, self.buffer = self.buffer[:at], self.buffer[at + len(_HARMONY_END):]
            text_back, calls = self._close(body)
            content, made = content + text_back, made + calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        if self.header is None:  # no message begun (or only a header): nothing to show
            self.buffer = ""
            return "", []
        body, self.buffer = self.buffer, ""
        return self._close(body)


_HARMONY_MESSAGE, _HARMONY_END = "<|message|>", "<|end|>"


def harmony_call(recipient: str, body: str, tool_use: ToolUse, calls: list[ToolCall]) -> tuple[str, list[ToolCall]]:
    """A harmony message addressed ``to=functions.NAME``: (content, made
    calls), the call appended to ``calls``. A body that is not a JSON
    object, or a call where none may be made, is given back as written."""
    try:
        arguments = json.loads(body)
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict) or tool_use.choice == "none":
        return f"to={recipient}{_HARMONY_MESSAGE}{body}", []
    if not tool_use.parallel and calls:
        return "", []
    call = ToolCall(new_call_id(), recipient.removeprefix("functions."), arguments, len(calls))
    calls.append(call)
    return "", [call]


def call_stream(fmt: ToolCallFormat, tool_use: ToolUse):
    """The stream that reads calls in ``fmt`` out of an answer."""
    if fmt.name != "harmony":
        return ToolCallStream(fmt, tool_use)
    if fmt.harmony is not None:
        opening = fmt.forced_opening(tool_use.forced) if tool_use.forced is not None else ""
        return HarmonyLibraryStream(fmt.harmony, tool_use, harmony_call, opening)
    return HarmonyStream(fmt, tool_use)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
