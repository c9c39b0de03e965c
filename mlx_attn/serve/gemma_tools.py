"""Gemma's tool-call formats, which mlx-lm's parsers do not cover for the
models mlx_attn runs itself:

- Gemma 3 (its chat template knows no tools): Google's documented prompted
  format, a Python list of calls, ``[get_weather(city="Oslo"), get_time()]``,
  which the model may fence as a ```tool_code block; results go back in a
  user turn as a ```tool_output block. Parsed by mlx-lm's ``pythonic``
  parser where mlx-lm is installed, else by :func:`python_calls`.
- FunctionGemma (``<start_function_call>`` in its template): its template
  renders tools, calls and results; a call is
  ``<start_function_call>call:NAME{key:<escape>text<escape>,n:3}<end_function_call>``,
  read by :func:`function_gemma_call` (nested objects and lists included;
  mlx-lm's ``function_gemma`` parser reads one flat level)."""

from __future__ import annotations

import ast
import importlib
import json
import keyword
import re

__all__ = ["function_gemma_call", "python_calls", "gemma_python_calls", "gemma_messages", "python_call_grammar",
           "GEMMA_FENCES"]

ESCAPE = "<escape>"
GEMMA_FENCES = ("```tool_code", "```python", "```")


# ---------------------------------------------------------------- FunctionGemma
class _FunctionGemmaReader:
    """``call:NAME{...}``: keys bare, strings between ``<escape>`` marks,
    objects ``{}``, lists ``[]``, anything else a JSON literal (or kept as text)."""

    def __init__(self, text: str):
        self.text, self.at = text, 0

    def fail(self, what: str):
        raise ValueError(f"FunctionGemma call: {what} at {self.at}")

    def take(self, literal: str) -> bool:
        if self.text.startswith(literal, self.at):
            self.at += len(literal)
            return True
        return False

    def value(self):
        if self.take(ESCAPE):
            end = self.text.find(ESCAPE, self.at)
            if end < 0:
                self.fail("an unclosed <escape> string")
            value, self.at = self.text[self.at:end], end + len(ESCAPE)
            return value
        if self.take("{"):
            return self.members("}", keyed=True)
        if self.take("["):
            return self.members("]", keyed=False)
        match = re.compile(r"[^,}\]]*").match(self.text, self.at)
        raw, self.at = match.group(0).strip(), match.end()
        if not raw:
            self.fail("a missing value")
        try:
            return json.loads(raw)
        except ValueError:
            return raw

    def members(self, close: str, keyed: bool):
        out = {} if keyed else []
        if self.take(close):
            return out
        while True:
            if keyed:
                match = re.compile(r"\s*([^:{}\[\],]+?)\s*:").match(self.text, self.at)
                if match is None:
                    self.fail("a missing key")
                self.at = match.end()
                out[match.group(1)] = self.value()
            else:
                out.append(self.value())
            if self.take(close):
                return out
            if not self.take(","):
                self.fail(f"a missing ',' or '{close}'")


def function_gemma_call(text: str) -> dict:
    """One FunctionGemma call's text (between its markers) -> {"name", "arguments"}."""
    match = re.compile(r"\s*call:([\w.-]+)\{").match(text)
    if match is None:
        raise ValueError("FunctionGemma call: expected call:NAME{")
    reader = _FunctionGemmaReader(text)
    reader.at = match.end()
    arguments = reader.members("}", keyed=True)
    if text[reader.at:].strip():
        reader.fail("text after the call")
    return {"name": match.group(1), "arguments": arguments}


# ---------------------------------------------------------------- Gemma 3
_JSON_NAMES = {"true": True, "false": False, "null": None}


def _literal(node: ast.expr):
    """A keyword's value: a Python literal, with JSON's true/false/null."""
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
    return ast.literal_eval(node)


def python_calls(text: str) -> list[dict]:
    """``[f(a=1), g()]`` (or one bare call) -> calls; ValueError otherwise."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        raise ValueError("not Python calls") from None
    nodes = tree.elts if isinstance(tree, ast.List) else [tree]
    calls = []
    for node in nodes:
        if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, (ast.Name, ast.Attribute)):
            raise ValueError("not a call with keyword arguments")
        if any(k.arg is None for k in node.keywords):
            raise ValueError("not a call with keyword arguments")
        calls.append({"name": ast.unparse(node.func), "arguments": {k.arg: _literal(k.value) for k in node.keywords}})
    if not calls:
        raise ValueError("no calls")
    return calls


def _unfenced(text: str) -> str:
    text = text.strip()
    for fence in GEMMA_FENCES:
        if text.startswith(fence):
            text = text[len(fence):].strip()
            return text[:-3].strip() if text.endswith("```") else text
    return text


def gemma_python_calls(text: str):
    """A Gemma 3 answer that is calls: mlx-lm's ``pythonic`` parser where
    installed, else :func:`python_calls`."""
    text = _unfenced(text)
    try:
        parser = importlib.import_module("mlx_lm.tool_parsers.pythonic").parse_tool_call
    except Exception:  # noqa: BLE001  (mlx-lm absent or changed: our own parser)
        parser = None
    if parser is not None:
        try:
            return parser(text)
        except Exception:  # noqa: BLE001  (its refusal: ours decides)
            pass
    return python_calls(text)


def python_call_text(name: str, arguments: dict) -> str:
    """A call as Gemma 3 writes one: keyword values as JSON (read back by both parsers)."""
    return f"{name}(" + ", ".join(f"{key}={json.dumps(value)}" for key, value in arguments.items()) + ")"


def _keyword_arguments(rule: str, schema: dict, json_options: dict, rules: list[str]) -> bool:
    """Lark rules ``rule``: an object schema's properties as keyword
    arguments, in the schema's order, each value JSON in its own schema,
    the required ones present (False: a schema this cannot spell)."""
    if set(schema) - {"type", "properties", "required", "additionalProperties", "description", "title"}:
        return False
    properties, required = schema.get("properties") or {}, set(schema.get("required") or ())
    if schema.get("type", "object") != "object" or not isinstance(properties, dict) or \
            not all(isinstance(p, dict) for p in properties.values()) or required - set(properties):
        return False
    names = list(properties)
    if not all(n.isidentifier() and not keyword.iskeyword(n) for n in names):
        return False
    # {rule}_{k}_{s}: the arguments from the k-th on; s: one came before (a ", " first)
    for k in range(len(names), -1, -1):
        for sep in (0, 1):
            here = f"{rule}_{k}_{sep}"
            if k == len(names):
                rules.append(f'{here}: ""')
                continue
            value = f"{rule}_v{k}"
            if sep == 0:
                rules.append(f"{value}: %json " + json.dumps({**properties[names[k]], "x-guidance": json_options}))
            item = ('", " ' if sep else "") + json.dumps(names[k] + "=") + f" {value} {rule}_{k + 1}_1"
            rules.append(f"{here}: {item}" if names[k] in required else f"{here}: {item} | {rule}_{k + 1}_{sep}")
    rules.append(f"{rule}: {rule}_0_0")
    return True


def python_call_grammar(tools: list[dict], named: bool, json_options: dict) -> str | None:
    """An llguidance (lark) grammar for what follows Gemma 3's forced opening
    (``[NAME(`` for a named tool, else ``[``): one call of an offered tool,
    its keyword arguments as JSON values in their schemas, then ``)]`` and
    the end. None when a tool's schema is not plain properties with names
    Python takes as keywords (then only the opening holds the answer)."""
    rules: list[str] = []
    for i, tool in enumerate(tools):
        if not _keyword_arguments(f"kwargs{i}", tool["function"]["parameters"], json_options, rules):
            return None
    if named:
        start = 'kwargs0 ")]"'
    else:
        calls = " | ".join(json.dumps(tool["function"]["name"] + "(") + f' kwargs{i} ")"'
                           for i, tool in enumerate(tools))
        start = f'({calls}) "]"'
    return "\n".join([f"start: {start}", *rules]) + "\n"


_GEMMA_PROMPT = (
    "You can call functions. To call them, answer with nothing but a Python list of calls, each with keyword "
    "arguments written as JSON values: [function_name(parameter=value, ...), ...]. Function results come back "
    "in a ```tool_output block. The functions, as JSON schemas:\n{tools}")


def gemma_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """The conversation for Gemma 3's template (which knows no tools): the
    functions described in the system text (the template puts it in the
    first user turn), calls written as the model writes them, results as
    one user turn of ```tool_output blocks (the template wants turns to
    alternate)."""
    out: list[dict] = []
    for message in messages:
        content = message.get("content") or ""
        role = message["role"]
        if role == "assistant" and message.get("tool_calls"):
            calls = ", ".join(python_call_text(c["function"]["name"], c["function"]["arguments"])
                              for c in message["tool_calls"])
            content = (content + "\n" if content else "") + f"[{calls}]"
        elif role == "tool":
            role, content = "user", f"```tool_output\n{content}\n```"
        if role == "user" and out and out[-1]["role"] == "user":  # results and what follows: one turn
            out[-1]["content"] += "\n" + content
        else:
            out.append({"role": role, "content": content})
    if tools:
        listed = _GEMMA_PROMPT.format(tools="\n".join(json.dumps(t["function"]) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + listed}
        else:
            out.insert(0, {"role": "system", "content": listed})
    return out
