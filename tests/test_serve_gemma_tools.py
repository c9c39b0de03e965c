"""Gemma's tool-call formats (mlx_attn/serve/gemma_tools.py): Gemma 3's
prompted Python list of calls and FunctionGemma's ``call:NAME{...}``,
parsed back into OpenAI ``tool_calls`` and Anthropic ``tool_use`` blocks,
and a tool loop served over mlx_attn's own Gemma 3 (tiny, random weights,
answers scripted through test_serve_tools.py's sampler seam)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from mlx_attn.serve.gemma_tools import function_gemma_call, gemma_python_calls, python_calls  # noqa: E402
from mlx_attn.serve.tool_calls import ToolUse, render_chat, tool_call_format  # noqa: E402

from model_fixtures import tiny_vocabulary  # noqa: E402
from test_serve_server import MODEL_NAME  # noqa: E402
from test_serve_tools import (TIME, WEATHER, anthropic_weather_request, make_tokenizer, run_stream,  # noqa: E402,F401
                              script, scripted_sampler, serve_model, streamed, whole)

# Gemma 3's template as it behaves: the system text opens the first user turn, roles must alternate
GEMMA3_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + '\\n\\n' %}"
    "{% set rest = messages[1:] %}{% else %}{% set first = '' %}{% set rest = messages %}{% endif %}"
    "{% for m in rest %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ (first if loop.first else '') + m['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")

FUNCTION_GEMMA_TEMPLATE = (
    "{% if tools %}<start_of_turn>developer\n{% for t in tools %}<start_function_declaration>declaration:"
    "{{ t.function.name }}{description:<escape>{{ t.function.description }}<escape>}<end_function_declaration>"
    "{% endfor %}<end_of_turn>\n{% endif %}{% for m in messages %}<start_of_turn>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<start_function_call>call:{{ c.function.name }}{}<end_function_call>"
    "{% endfor %}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def test_function_gemma_calls_nested_values_and_refusals():
    text = ('call:plan{city:<escape>Oslo, "N"<escape>,days:3,opts:{units:<escape>C<escape>,'
            'flags:[true,<escape>a,b<escape>]},note:none}')
    assert function_gemma_call(text) == {"name": "plan", "arguments": {
        "city": 'Oslo, "N"', "days": 3, "opts": {"units": "C", "flags": [True, "a,b"]}, "note": "none"}}
    assert function_gemma_call("call:get_time{}") == {"name": "get_time", "arguments": {}}
    for bad in ("call:f{a:<escape>x}", "call:f{a:1", "f{a:1}", "call:f{a:1}tail", "call:f{:1}"):
        with pytest.raises(ValueError):
            function_gemma_call(bad)


def test_gemma_python_calls():
    assert python_calls('[get_weather(city="Oslo", opts={"a": [1, true, null]}), get_time()]') == [
        {"name": "get_weather", "arguments": {"city": "Oslo", "opts": {"a": [1, True, None]}}},
        {"name": "get_time", "arguments": {}}]
    rome = {"name": "get_weather", "arguments": {"city": "Rome"}}
    assert gemma_python_calls('```tool_code\n[get_weather(city="Rome")]\n```') in (rome, [rome])
    for bad in ("[1, 2]", "get_weather('Oslo')", "[f(**x)]", "hello"):
        with pytest.raises(ValueError):
            python_calls(bad)


@pytest.mark.parametrize("text, expected", [
    ('[get_weather(city="Rome"), get_time()]', ("", [("get_weather", {"city": "Rome"}), ("get_time", {})])),
    ('```tool_code\n[get_weather(city="Rome")]\n```', ("", [("get_weather", {"city": "Rome"})])),
    ("Hello [x]", ("Hello [x]", [])),
    ("[1] is a footnote", ("[1] is a footnote", [])),
    ("`ok`", ("`ok`", [])),
])
def test_gemma3_answers(text, expected):
    fmt = tool_call_format(make_tokenizer(GEMMA3_TEMPLATE))
    assert fmt.name == "gemma" and not fmt.native
    for pieces in (1, 3, len(text)):
        assert run_stream(fmt, text, pieces) == expected, pieces


@pytest.mark.parametrize("text, expected", [
    ("Sure.<start_function_call>call:get_weather{city:<escape>Rome<escape>}<end_function_call>"
     "<start_function_call>call:get_time{}<end_function_call>",
     ("Sure.", [("get_weather", {"city": "Rome"}), ("get_time", {})])),
    ("<start_function_call>call:get_weather{city:<escape>Rome}<end_function_call>",
     ("<start_function_call>call:get_weather{city:<escape>Rome}<end_function_call>", [])),
    ("No call here.", ("No call here.", [])),
])
def test_function_gemma_answers(text, expected):
    fmt = tool_call_format(make_tokenizer(FUNCTION_GEMMA_TEMPLATE))
    assert fmt.name == "function-gemma" and fmt.native
    for pieces in (1, 4, len(text)):
        assert run_stream(fmt, text, pieces) == expected, pieces
    named = render_chat(make_tokenizer(FUNCTION_GEMMA_TEMPLATE), [{"role": "user", "content": "x"}],
                        ToolUse((WEATHER, TIME), "get_weather"))
    assert "declaration:get_weather{description:<escape>The weather in a city.<escape>}" in named
    assert named.endswith("<start_of_turn>model\n<start_function_call>call:get_weather{")


def test_function_gemma_stops_where_a_function_response_would_begin():
    from mlx_attn.serve.tool_calls import prepare_tokenizer

    tokenizer = make_tokenizer(FUNCTION_GEMMA_TEMPLATE)
    tokenizer.backend.add_special_tokens(["<start_function_response>"])
    assert prepare_tokenizer(tokenizer).name == "function-gemma"
    assert tokenizer.eos_token_ids == {2, tokenizer.token_to_id("<start_function_response>")}


def test_gemma3_renders_the_tools_calls_and_results_in_alternating_turns():
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather and time in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
            {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": {}}}]},
        {"role": "tool", "content": '{"sky": "clear"}', "tool_call_id": "c1", "name": "get_weather"},
        {"role": "tool", "content": '"09:00"', "tool_call_id": "c2", "name": "get_time"},
    ]
    text = render_chat(make_tokenizer(GEMMA3_TEMPLATE), conversation, ToolUse((WEATHER, TIME), "auto"))
    turns = text.split("<start_of_turn>")[1:]
    assert [t.split("\n", 1)[0] for t in turns] == ["user", "model", "user", "model"]
    assert turns[0].startswith("user\nBe brief.\n\nYou can call functions.") and '"name": "get_weather"' in turns[0]
    assert turns[0].rstrip().endswith("Weather and time in Oslo?<end_of_turn>")
    assert turns[1] == 'model\n[get_weather(city="Oslo"), get_time()]<end_of_turn>\n'
    assert turns[2] == 'user\n```tool_output\n{"sky": "clear"}\n```\n```tool_output\n"09:00"\n```<end_of_turn>\n'
    named = render_chat(make_tokenizer(GEMMA3_TEMPLATE), conversation[:2], ToolUse((WEATHER, TIME), "get_weather"))
    assert named.endswith("<start_of_turn>model\n[get_weather(")


def test_gemma3_forced_calls_are_held_to_the_schema_by_a_grammar():
    from test_serve_tool_choice import JSON_OPTIONS, function, grammar_takes

    from mlx_attn.serve.tool_calls import forced_call_grammar

    tokenizer = make_tokenizer(GEMMA3_TEMPLATE)
    fmt = tool_call_format(tokenizer)
    plan = function("plan", {"type": "object", "required": ["days"], "properties": {
        "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}, "ok": {"type": "boolean"}}})
    tools = (WEATHER, plan, TIME)
    named = forced_call_grammar(fmt, ToolUse(tools, "plan"), JSON_OPTIONS)  # after the opening "[plan("
    for text, takes in [('days=3)]', True), ('city="Oslo", days=3, ok=true)]', True), ('days=3, ok=false)]', True),
                        ('city="Oslo")]', False), ('days=0)]', False), ('ok=true, days=3)]', False), ("days=3", False)]:
        assert grammar_takes(tokenizer, named, text) == takes, text
    required = forced_call_grammar(fmt, ToolUse(tools, "required"), JSON_OPTIONS)  # after the opening "["
    for text, takes in [("get_time()]", True), ('get_weather(city="Oslo")]', True), ("get_weather()]", False),
                        ("plan(days=2)]", True), ("get_time(), get_time()]", False), ("other()]", False)]:
        assert grammar_takes(tokenizer, required, text) == takes, text
    # keyword arguments Python cannot take, or a schema that is not plain properties: the opening only
    odd = function("odd", {"type": "object", "properties": {"class": {"type": "string"}}})
    assert forced_call_grammar(fmt, ToolUse((odd,), "odd"), JSON_OPTIONS) is None
    union = function("union", {"anyOf": [{"type": "object"}]})
    assert forced_call_grammar(fmt, ToolUse((union,), "union"), JSON_OPTIONS) is None


@pytest.fixture(scope="module")
def gemma_server():
    from test_gemma3 import tiny_gemma

    model = tiny_gemma(seed=5, vocab_size=len(tiny_vocabulary()[0]))
    running = serve_model(model, make_tokenizer(GEMMA3_TEMPLATE), kv_cache_tokens=8192, page_size=8,
                          max_batch_tokens=256)
    yield running
    running.stop()


def test_a_tool_loop_on_our_own_gemma3_over_both_apis(gemma_server, monkeypatch):
    client = gemma_server.client()
    messages = [{"role": "user", "content": "Weather in Kyiv?"}]
    named = dict(model=MODEL_NAME, messages=messages, tools=[WEATHER, TIME], max_tokens=100,
                 tool_choice={"type": "function", "function": {"name": "get_weather"}},
                 seed=script(501, 'city="Kyiv")]'))
    assert whole(client, **named) == ("", [("get_weather", {"city": "Kyiv"})], "tool_calls") == \
        streamed(client, **named)
    auto = dict(named, tool_choice="auto", seed=script(502, '[get_weather(city="Kyiv"), get_time()]'))
    reply = client.chat.completions.create(**auto).choices[0]
    assert reply.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in reply.message.tool_calls] == [
        ("get_weather", '{"city": "Kyiv"}'), ("get_time", "{}")]
    assert streamed(client, **auto) == whole(client, **auto)
    follow = messages + [reply.message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": call.id, "content": "clear" if i == 0 else "09:00"}
        for i, call in enumerate(reply.message.tool_calls)]
    answer = dict(auto, messages=follow, seed=script(503, "Clear, 9 am."))
    assert whole(client, **answer) == ("Clear, 9 am.", [], "stop") == streamed(client, **answer)

    pytest.importorskip("anthropic")
    message = anthropic_weather_request(gemma_server, monkeypatch, script(504, '[get_weather(city="Lviv")]'))
    assert message.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in message.content] == [("tool_use", "get_weather", {"city": "Lviv"})]


def test_gemma3_named_calls_keep_generated_schemas(gemma_server):
    """Sampling at temperature 1, the grammar alone keeps each call's arguments in its schema."""
    jsonschema = pytest.importorskip("jsonschema")
    from test_serve_structured import generated_schemas

    schemas = generated_schemas(4, seed=31)
    client = gemma_server.client()
    for i, schema in enumerate(schemas):
        tool = {"type": "function", "function": {"name": f"record_{i}", "parameters": schema}}
        reply = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "go"}], tools=[WEATHER, tool], seed=i,
            tool_choice={"type": "function", "function": {"name": f"record_{i}"}}, temperature=1.0, max_tokens=400)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", (i, choice)
        [call] = choice.message.tool_calls
        assert call.function.name == f"record_{i}"
        jsonschema.validate(json.loads(call.function.arguments), schema)
