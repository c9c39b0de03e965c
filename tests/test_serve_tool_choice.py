"""A ``required`` or named tool choice by constrained decoding: the model
writes one call of an offered tool whose arguments match the tool's JSON
schema (mlx_attn.serve.tool_calls.forced_call_grammar), through the
official ``openai`` and ``anthropic`` clients against a server on 127.0.0.1.

Oracles: every answer is a parsed tool call (``finish_reason`` /
``stop_reason`` of a call) of an offered tool and ``jsonschema`` validates
its arguments; a random-weight model sampling at temperature 1 writes
whatever the mask lets through, so the grammar alone keeps it valid. The
schemas are test_serve_structured.py's generated ones; a sample runs by
default, MLX_ATTN_FULL_GRID=1 runs more."""

from __future__ import annotations

import concurrent.futures
import json
import os

import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
pytest.importorskip("uvicorn")

from mlx_attn.serve.constraints import JSON_OPTIONS  # noqa: E402
from mlx_attn.serve.tool_calls import ToolUse, forced_call_grammar, tool_call_format  # noqa: E402

from model_fixtures import random_llama, smollm2, tiny_tokenizer, tiny_vocabulary  # noqa: E402
from test_serve_server import MODEL_NAME, raw, serve_model  # noqa: E402
from test_serve_structured import generated_schemas  # noqa: E402

FULL_GRID = os.environ.get("MLX_ATTN_FULL_GRID") == "1"
END = 2  # <|im_end|>: the tiny tokenizer's end token here
CONTEXT = 4096  # the tiny tokenizer spells JSON byte by byte; the tools' schemas sit in the prompt
MAX_TOKENS = 400  # every generated schema bounds its arguments well below this
DEADLINE = 120.0
HOT = {"temperature": 1.0}  # the anthropic client's create() takes no temperature (deprecated): in the body
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}


def function(name: str, schema: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": schema}}


def anthropic_tool(tool: dict) -> dict:
    return {"name": tool["function"]["name"], "input_schema": tool["function"]["parameters"]}


@pytest.fixture(scope="module")
def server():
    model = random_llama(seed=13, vocab_size=len(tiny_vocabulary()[0]), max_position_embeddings=CONTEXT)
    running = serve_model(model, tiny_tokenizer(eos_token_ids=(END,)), kv_cache_tokens=32768, page_size=16,
                          max_batch_tokens=512)
    yield running
    running.stop()


def anthropic_client(running):
    return anthropic.Anthropic(base_url=running.base, api_key="none", timeout=DEADLINE, max_retries=0)


def openai_call(running, tools, tool_choice, seed, messages=None, temperature=1.0, **extra):
    """(finish_reason, [(name, arguments)]) of one chat request."""
    choice = running.client().chat.completions.create(
        model=MODEL_NAME, messages=messages or [{"role": "user", "content": "call it"}], tools=tools,
        tool_choice=tool_choice, temperature=temperature, seed=seed, max_tokens=MAX_TOKENS, **extra).choices[0]
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]
    return choice.finish_reason, calls, choice.message


def test_the_grammar_spells_each_formats_call():
    """The grammar's text for each format: what follows the forced opening."""
    tools = (WEATHER, function("get_time", {"type": "object", "properties": {}}))
    named, required = ToolUse(tools, "get_weather"), ToolUse(tools, "required")
    hermes = tool_call_format(tiny_tokenizer())
    grammar = forced_call_grammar(hermes, named, JSON_OPTIONS)
    assert grammar.startswith('start: args0 "}\\n</tool_call>"') and "get_time" not in grammar
    grammar = forced_call_grammar(hermes, required, JSON_OPTIONS)
    assert '"{\\"name\\": \\"get_time\\", \\"arguments\\": " args1 "}"' in grammar
    assert forced_call_grammar(hermes, ToolUse(tools, "auto"), JSON_OPTIONS) is None


def grammar_takes(tokenizer, grammar: str, text: str) -> bool:
    """Whether ``grammar`` lets the tokens of ``text`` through and accepts them as a whole answer."""
    from mlx_attn.serve.constraints import json_grammars

    constraint = json_grammars(tokenizer, len(tiny_vocabulary()[0])).lark_factory(grammar)()
    for token in tokenizer.encode(text, add_special_tokens=False):
        constraint.advance(token)
        if constraint.matcher.is_error():
            return False
    return constraint.accepting


@pytest.mark.parametrize("template, opening, between, close", [
    (None, "", "\n<tool_call>\n", "\n</tool_call>"),  # Hermes (offered in the system message)
    ("{{ '[TOOL_CALLS]' }}", "[", ", ", "]"),  # Mistral
])
def test_a_forced_answer_is_one_constrained_call_even_with_parallel_calls(template, opening, between, close):
    """``required`` with ``parallel_tool_calls`` too: the grammar takes one
    call of an offered tool and then only the end (a grammar that took more
    let SmolLM2, greedy, write calls until ``max_tokens``: docs/serving.md)."""
    tokenizer = tiny_tokenizer()
    if template is not None:
        tokenizer.chat_template = template
    fmt = tool_call_format(tokenizer)
    tools = (WEATHER, function("get_time", {"type": "object", "properties": {}}))
    weather = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    clock = '{"name": "get_time", "arguments": {}}'
    if fmt.name == "hermes":
        one, two = weather + close, weather + close + between + clock + close
    else:
        one, two = opening + weather + close, opening + weather + between + clock + close
    for parallel in (True, False):
        grammar = forced_call_grammar(fmt, ToolUse(tools, "required", parallel=parallel), JSON_OPTIONS)
        assert grammar_takes(tokenizer, grammar, one)
        assert not grammar_takes(tokenizer, grammar, one.replace('"Oslo"', "5"))  # arguments in the schema
        assert not grammar_takes(tokenizer, grammar, two)


@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_a_named_tool_choice_gives_arguments_in_the_schema_every_time(server, api):
    count = 48 if FULL_GRID else 6
    schemas = generated_schemas(count, seed=7 if api == "openai" else 8)

    def ask(i):
        tool = function(f"tool_{i}", schemas[i])
        if api == "openai":
            finish, calls, _ = openai_call(server, [WEATHER, tool], {"type": "function", "function": {
                "name": tool["function"]["name"]}}, seed=i)
            return finish, calls
        message = anthropic_client(server).messages.create(
            model=MODEL_NAME, max_tokens=MAX_TOKENS, extra_body=HOT, messages=[{"role": "user", "content": "go"}],
            tools=[anthropic_tool(WEATHER), anthropic_tool(tool)], tool_choice={"type": "tool", "name": f"tool_{i}"})
        return message.stop_reason, [(b.name, b.input) for b in message.content if b.type == "tool_use"]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, range(count)))
    for i, (finish, calls) in enumerate(answers):
        assert finish == ("tool_calls" if api == "openai" else "tool_use"), (i, finish, calls)
        [(name, arguments)] = calls
        assert name == f"tool_{i}"
        jsonschema.validate(arguments, schemas[i])


def test_required_picks_an_offered_tool_with_its_arguments(server):
    schemas = generated_schemas(3, seed=11)
    tools = [function(f"pick_{i}", schema) for i, schema in enumerate(schemas)]
    seen = set()
    for seed in range(4):
        finish, calls, _ = openai_call(server, tools, "required", seed=seed, parallel_tool_calls=False)
        assert finish == "tool_calls" and len(calls) == 1, calls
        name, arguments = calls[0]
        jsonschema.validate(arguments, schemas[int(name.removeprefix("pick_"))])
        seen.add(name)
    message = anthropic_client(server).messages.create(
        model=MODEL_NAME, max_tokens=MAX_TOKENS, extra_body=HOT, messages=[{"role": "user", "content": "go"}],
        tools=[anthropic_tool(t) for t in tools], tool_choice={"type": "any", "disable_parallel_tool_use": True})
    [block] = [b for b in message.content if b.type == "tool_use"]
    assert message.stop_reason == "tool_use"
    jsonschema.validate(block.input, schemas[int(block.name.removeprefix("pick_"))])


def test_streamed_and_whole_named_calls_agree(server):
    ask = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], tools=[WEATHER], seed=3,
               temperature=1.0, max_tokens=MAX_TOKENS, tool_choice={"type": "function",
                                                                    "function": {"name": "get_weather"}})
    client = server.client()
    whole = client.chat.completions.create(**ask).choices[0].message.tool_calls[0].function
    arguments, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **ask):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                arguments += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and json.loads(arguments) == json.loads(whole.arguments)
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])


def test_a_whole_tool_loop_over_both_apis(server):
    """call (constrained) -> the tool's result -> an answer, OpenAI's and Anthropic's."""
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    finish, [(name, arguments)], message = openai_call(
        server, [WEATHER], {"type": "function", "function": {"name": "get_weather"}}, seed=1, messages=messages)
    assert finish == "tool_calls" and name == "get_weather"
    messages += [{"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in message.tool_calls]},
                 {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny, 21 C"}]
    reply = server.client().chat.completions.create(model=MODEL_NAME, messages=messages, tools=[WEATHER],
                                                    tool_choice="none", max_tokens=8, seed=2)
    assert reply.choices[0].finish_reason in ("stop", "length") and not reply.choices[0].message.tool_calls
    assert reply.choices[0].message.content

    client = anthropic_client(server)
    turns = [{"role": "user", "content": "Weather in Paris?"}]
    called = client.messages.create(model=MODEL_NAME, max_tokens=MAX_TOKENS, extra_body=HOT, messages=turns,
                                    tools=[anthropic_tool(WEATHER)],
                                    tool_choice={"type": "tool", "name": "get_weather"})
    [use] = [b for b in called.content if b.type == "tool_use"]
    assert called.stop_reason == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER["function"]["parameters"])
    turns += [{"role": "assistant", "content": [b.model_dump() for b in called.content]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}]
    answer = client.messages.create(model=MODEL_NAME, max_tokens=8, messages=turns, tools=[anthropic_tool(WEATHER)],
                                    tool_choice={"type": "none"})
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content[0].type == "text"


@pytest.mark.parametrize("parameters", [
    {"type": "object", "properties": {"x": {"type": "string", "pattern": "(("}}},
    {"type": "object", "properties": {"x": {"type": "integer", "minimum": 3, "maximum": 1}}, "required": ["x"]},
    {"type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}},
])
def test_a_tool_schema_the_library_rejects_is_a_400_naming_tools(server, parameters):
    bad = function("bad_tool", parameters)
    for choice in ("required", {"type": "function", "function": {"name": "bad_tool"}}):
        status, body = raw(server, "POST", "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER, bad],
                            "tool_choice": choice, "max_tokens": 4})
        assert status == 400 and body["error"]["param"] == "tools" and "tools[1]" in body["error"]["message"], body
    with pytest.raises(anthropic.BadRequestError) as caught:
        anthropic_client(server).messages.create(
            model=MODEL_NAME, max_tokens=4, messages=[{"role": "user", "content": "x"}],
            tools=[anthropic_tool(bad)], tool_choice={"type": "any"})
    assert "tools[0]" in caught.value.body["error"]["message"]


# ---------------------------------------------------------------- the default model
UNITS = {"type": "function", "function": {"name": "convert_units", "parameters": {
    "type": "object", "properties": {"value": {"type": "number"}, "unit": {"enum": ["km", "mile"]}},
    "required": ["value", "unit"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def default_model_server():
    model, tokenizer = smollm2()
    # prefill chunks under 128 rows: the packed weights' integer matvecs (a 256-row chunk of the
    # ~230-token tool prompt took 10x longer on the 2-core machine)
    running = serve_model(model, tokenizer, kv_cache_tokens=4096, page_size=16, max_batch_tokens=64)
    yield running
    running.stop()


def test_the_default_model_calls_a_named_tool_in_the_schema(default_model_server):
    """SmolLM2 (no tool template: the tools in its system message), greedy."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    finish, [(name, arguments)], _ = openai_call(default_model_server, [WEATHER, UNITS], {
        "type": "function", "function": {"name": "get_weather"}}, seed=0, messages=messages, temperature=0)
    assert finish == "tool_calls" and name == "get_weather"
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    assert arguments == {"city": "Paris"}  # greedy: the model's own answer, held to the schema


def test_the_default_model_calls_a_required_tool_through_anthropics_client(default_model_server):
    message = anthropic_client(default_model_server).messages.create(
        model=MODEL_NAME, max_tokens=60, messages=[{"role": "user", "content": "Convert 5 km to miles."}],
        tools=[anthropic_tool(WEATHER), anthropic_tool(UNITS)], tool_choice={"type": "any"})
    [use] = [b for b in message.content if b.type == "tool_use"]
    assert message.stop_reason == "tool_use"
    jsonschema.validate(use.input, (UNITS if use.name == "convert_units" else WEATHER)["function"]["parameters"])


@pytest.mark.skipif(not FULL_GRID, reason="SmolLM2 over generated schemas: MLX_ATTN_FULL_GRID=1")
def test_the_default_model_keeps_generated_schemas(default_model_server):
    schemas = generated_schemas(8, seed=21)
    for i, schema in enumerate(schemas):
        tool = function(f"record_{i}", schema)
        finish, calls, _ = openai_call(default_model_server, [tool], {"type": "function", "function": {
            "name": tool["function"]["name"]}}, seed=i, messages=[{"role": "user", "content": "Fill in a record."}])
        assert finish == "tool_calls", (i, calls)
        [(name, arguments)] = calls
        jsonschema.validate(arguments, schema)
