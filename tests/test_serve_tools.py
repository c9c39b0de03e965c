"""OpenAI tool calling on /v1/chat/completions, through the official
``openai`` client against a server on 127.0.0.1 over a tiny random Llama.

A random model writes no calls, so the answers here are scripted: the
engine's batched sampler is replaced (``engine.sample_rows``, the test seam)
by one that returns a fixed token sequence for requests with a given seed and
samples the rest as usual. Everything between the tokens and the client (the
detokenizer, the call parser, the streamed deltas, finish reasons) is the
server's own. SmolLM2, the default model, is served at the end: its template
knows no tools, so the server offers them in the system message."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

import mlx_attn.serve.engine as engine_module  # noqa: E402
from mlx_attn.serve.sampling import Sampled  # noqa: E402
from mlx_attn.serve.tool_calls import ToolCallStream, ToolUse, call_stream, render_chat, tool_call_format  # noqa: E402

from model_fixtures import random_llama, tiny_tokenizer, tiny_vocabulary  # noqa: E402
from test_serve_server import MODEL_NAME, raw, serve_model  # noqa: E402

CONTEXT = 2048  # the tiny tokenizer spells JSON byte by byte

END = 2  # <|im_end|>: the tiny tokenizer's end token here
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}

# a Qwen-like template that renders tools, calls and results itself
NATIVE_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

SCRIPTS: dict[int, list[int]] = {}  # seed -> the tokens a request with that seed generates
FORBIDDEN: list[tuple[int, int]] = []  # (seed, token): a scripted token the row's constraint forbade


@pytest.fixture(scope="module", autouse=True)
def scripted_sampler():
    real = engine_module.sample_rows

    def sample_rows(logits, params, previous, indices, bias=None):
        out = real(logits, params, previous, indices, bias)
        constrained = {} if bias is None else dict(zip(bias[0], np.array(bias[1])))
        for r, p in enumerate(params):
            script = SCRIPTS.get(p.seed)
            if script is not None:
                token = script[min(indices[r], len(script) - 1)]
                if r in constrained and not np.isfinite(constrained[r][token]):
                    FORBIDDEN.append((p.seed, token))
                out[r] = Sampled(token, 0.0)
        return out

    engine_module.sample_rows = sample_rows
    yield
    engine_module.sample_rows = real


def make_tokenizer(template=None):
    tokenizer = tiny_tokenizer(eos_token_ids=(END,))
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


@pytest.fixture(scope="module")
def model():
    return random_llama(seed=11, vocab_size=len(tiny_vocabulary()[0]), max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def server(model):
    running = serve_model(model, make_tokenizer(), kv_cache_tokens=8192, page_size=8, max_batch_tokens=64)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def native_server(model):
    running = serve_model(model, make_tokenizer(NATIVE_TEMPLATE), kv_cache_tokens=8192, page_size=8,
                          max_batch_tokens=64)
    yield running
    running.stop()


def script(seed: int, text: str) -> int:
    SCRIPTS[seed] = make_tokenizer().encode(text) + [END]
    return seed


def call_text(name, arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def streamed(client, **request):
    """(content, calls as (name, arguments), finish) of a streamed answer, its tool-call deltas joined."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **request):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = delta.id or entry["id"]
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert all(entry["id"] for entry in calls.values())
    return content, [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())], finish


def anthropic_weather_request(running, monkeypatch, seed: int, max_tokens: int = 100):
    """The Anthropic client's answer to "Weather in Lviv?" with get_weather offered,
    its rows sampled with ``seed`` (the script's key; Anthropic's API has no
    seed field, so it is set at the request seam)."""
    import anthropic

    from mlx_attn.serve import anthropic_api

    real = anthropic_api.completion_request
    monkeypatch.setattr(anthropic_api, "completion_request",
                        lambda state, body, prompt, **options: real(state, {**body, "seed": seed}, prompt, **options))
    claude = anthropic.Anthropic(base_url=running.base, api_key="unused", timeout=60, max_retries=0)
    tool = {"name": "get_weather", "description": "The weather in a city.",
            "input_schema": WEATHER["function"]["parameters"]}
    return claude.messages.create(model=MODEL_NAME, max_tokens=max_tokens, tools=[tool],
                                  messages=[{"role": "user", "content": "Weather in Lviv?"}])


def whole(client, **request):
    reply = client.chat.completions.create(**request).choices[0]
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in reply.message.tool_calls or []]
    return reply.message.content or "", calls, reply.finish_reason


# ---------------------------------------------------------------- the tool loop
@pytest.mark.parametrize("which", ["server", "native_server"])
def test_a_whole_tool_loop_streamed_and_not(which, request):
    running = request.getfixturevalue(which)
    client = running.client()
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    seed = script(101, "Let me look. " + call_text("get_weather", {"city": "Paris"}))
    ask = dict(model=MODEL_NAME, messages=messages, tools=[WEATHER, TIME], seed=seed, max_tokens=200)
    reply = client.chat.completions.create(**ask)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls"
    assert message.content == "Let me look. "
    [call] = message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert streamed(client, **ask) == whole(client, **ask)
    # the call's result goes back as a tool message; the model answers in text
    answer = script(102, "It is sunny in Paris.")
    follow = messages + [message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny"}'}]
    again = dict(ask, messages=follow, seed=answer)
    final = client.chat.completions.create(**again).choices[0]
    assert final.message.content == "It is sunny in Paris." and final.finish_reason == "stop"
    assert not final.message.tool_calls
    assert streamed(client, **again) == ("It is sunny in Paris.", [], "stop")


def test_the_rendered_conversation_holds_the_tools_calls_and_results():
    fallback, native = make_tokenizer(), make_tokenizer(NATIVE_TEMPLATE)
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": {"city": "Oslo"}}}]},
                {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "rain"}]
    tools = ToolUse((WEATHER,), "auto")
    for tokenizer in (fallback, native):
        text = render_chat(tokenizer, messages, tools)
        assert '"name": "get_weather"' in text and "The weather in a city." in text, text
        assert '"city": "Oslo"' in text and "rain" in text, text
    # the template that knows no tools gets them in a system message, results as tool responses
    text = render_chat(fallback, messages, tools)
    assert text.startswith("<|im_start|>system\nYou may call functions")
    assert "<tool_response>\nrain\n</tool_response>" in text
    assert tool_call_format(native).native and not tool_call_format(fallback).native
    # tool_choice none: the tools are not offered
    assert "get_weather" not in render_chat(native, messages[:1], ToolUse((WEATHER,), "none"))


def test_parallel_calls_and_parallel_tool_calls_false(server):
    client = server.client()
    both = call_text("get_weather", {"city": "Rome"}) + "\n" + call_text("get_time", {})
    ask = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], tools=[WEATHER, TIME],
               seed=script(103, both), max_tokens=200)
    expected = ("", [("get_weather", {"city": "Rome"}), ("get_time", {})], "tool_calls")
    assert whole(client, **ask) == expected[:1] + expected[1:]
    assert streamed(client, **ask) == expected
    one = dict(ask, parallel_tool_calls=False)
    assert whole(client, **one) == ("", expected[1][:1], "tool_calls") == streamed(client, **one)


def test_n_choices_stream_their_own_calls_with_their_own_indices(server):
    both = call_text("get_weather", {"city": "Rome"}) + call_text("get_time", {})
    script(401, both)
    script(402, call_text("get_time", {}))
    calls = {}
    for chunk in server.client().chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], tools=[WEATHER, TIME], seed=401, n=2,
            max_tokens=200, stream=True):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                calls.setdefault(choice.index, []).append((delta.index, delta.function.name))
    assert calls == {0: [(0, "get_weather"), (1, "get_time")], 1: [(0, "get_time")]}


def test_text_that_is_not_a_call_stays_text(server):
    client = server.client()
    cases = {104: "a <tool_call> that is {not json</tool_call> end",  # does not parse: given back as written
             105: "almost <tool_ca",  # a marker's beginning, held back while it could open a call
             106: "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "}  # cut off: no call
    for seed, text in cases.items():
        ask = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], tools=[WEATHER],
                   seed=script(seed, text), max_tokens=200)
        assert whole(client, **ask) == (text, [], "stop") == streamed(client, **ask), text
    # no tools: the same text is plain content
    plain = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], seed=script(107, call_text("f", {})),
                 max_tokens=200)
    assert whole(client, **plain) == (call_text("f", {}), [], "stop")
    # tool_choice none: not parsed either
    assert whole(client, **dict(plain, tools=[WEATHER], tool_choice="none"))[1] == []


def test_length_mid_call_is_length_and_text(server):
    client = server.client()
    text = call_text("get_weather", {"city": "Paris"})
    ask = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], tools=[WEATHER],
               seed=script(108, text), max_tokens=6)
    content, calls, finish = whole(client, **ask)
    assert finish == "length" and calls == [] and text.startswith(content) and content
    assert streamed(client, **ask) == (content, [], "length")


def test_named_and_required_tool_choice_open_the_call_in_the_prompt(native_server):
    client = native_server.client()
    # named: the prompt ends with the call's opening up to its arguments; the model writes the arguments
    ask = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], tools=[WEATHER, TIME],
               tool_choice={"type": "function", "function": {"name": "get_weather"}},
               seed=script(109, '{"city": "Lima"}}\n</tool_call>'), max_tokens=100)
    assert whole(client, **ask) == ("", [("get_weather", {"city": "Lima"})], "tool_calls") == streamed(client, **ask)
    tokenizer = make_tokenizer()
    opening = len(tokenizer.encode('<tool_call>\n{"name": "get_weather", "arguments": '))
    auto = client.chat.completions.create(**dict(ask, tool_choice="auto", max_tokens=1)).usage.prompt_tokens
    assert client.chat.completions.create(**dict(ask, max_tokens=1)).usage.prompt_tokens == auto + opening
    # required: the prompt ends with the opening marker; the model picks the tool
    req = dict(ask, tool_choice="required", seed=script(110, '{"name": "get_time", "arguments": {}}\n</tool_call>'))
    assert whole(client, **req) == ("", [("get_time", {})], "tool_calls") == streamed(client, **req)
    # both scripts are calls the constraint lets through; one outside the schema is not
    assert not [seed for seed, _ in FORBIDDEN if seed in (109, 110)]
    whole(client, **dict(ask, seed=script(111, '{"town": "Lima"}}\n</tool_call>')))
    whole(client, **dict(req, seed=script(112, '{"name": "get_date", "arguments": {}}\n</tool_call>')))
    assert {seed for seed, _ in FORBIDDEN} >= {111, 112}


def test_the_stream_parser_on_every_split_of_a_text():
    """Every way of cutting one answer into two pieces gives the same content and calls."""
    fmt = tool_call_format(make_tokenizer())
    text = "Hi <tool_c " + call_text("get_time", {}) + " bye <tool_call>{bad}</tool_call>"
    reference = None
    for cut in range(len(text) + 1):
        stream = ToolCallStream(fmt, ToolUse((WEATHER, TIME), "auto"))
        content, calls = "", []
        for piece in (text[:cut], text[cut:]):
            c, k = stream.add(piece)
            content, calls = content + c, calls + k
        c, k = stream.finish()
        content, calls = content + c, calls + k
        got = (content, [(call.name, call.arguments) for call in calls])
        reference = reference or got
        assert got == reference, cut
    assert reference == ("Hi <tool_c  bye <tool_call>{bad}</tool_call>", [("get_time", {})])


def run_stream(fmt, text, pieces=3, choice="auto"):
    stream = call_stream(fmt, ToolUse((WEATHER, TIME), choice))
    size = max(1, len(text) // pieces)
    content, calls = "", []
    for at in range(0, len(text), size):
        c, k = stream.add(text[at:at + size])
        content, calls = content + c, calls + k
    c, k = stream.finish()
    return content + c, [(call.name, call.arguments) for call in calls + k]


@pytest.mark.parametrize("template, text, expected", [
    ("{{ '[TOOL_CALLS]' }}", 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}, '
                             '{"name": "get_time", "arguments": {}}]',
     ("Sure.", [("get_weather", {"city": "Rome"}), ("get_time", {})])),
    ("{{ '<|python_tag|>' }}{{ tools }}", '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
     ("", [("get_weather", {"city": "Oslo"})])),
    ("{{ '<|python_tag|>' }}{{ tools }}", 'Hello {"name": "x"}', ('Hello {"name": "x"}', [])),
    ("{{ '<|python_tag|>' }}{{ tools }}", ' {"name": "get_time", "parameters": {', (' {"name": "get_time", '
                                                                                  '"parameters": {', [])),
])
def test_mistral_and_llama3_formats(template, text, expected):
    fmt = tool_call_format(make_tokenizer(template))
    assert fmt.native
    for pieces in (1, 3, len(text)):
        assert run_stream(fmt, text, pieces) == expected, pieces


HARMONY_TEMPLATE = ("{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
                    "{% if tools %}{{ tools | tojson }}{% endif %}{% if add_generation_prompt %}<|start|>assistant"
                    "{% endif %}{# a harmony template: <|channel|> #}")


def harmony(channel, body, to=None, end="<|end|><|start|>assistant"):
    return f"<|channel|>{channel}" + (f" to={to} <|constrain|>json" if to else "") + f"<|message|>{body}{end}"


@pytest.mark.parametrize("text, expected", [
    (harmony("analysis", "the user wants weather") + harmony("commentary", '{"city": "Oslo"}',
                                                               "functions.get_weather", end=""),
     ("", [("get_weather", {"city": "Oslo"})])),
    (harmony("analysis", "think") + harmony("final", "Hello there", end=""), ("Hello there", [])),
    (harmony("commentary", "Checking.") + harmony("commentary", "{}", "functions.get_time") +
     harmony("commentary", '{"city": "Rome"}', "functions.get_weather", end=""),
     ("Checking.", [("get_time", {}), ("get_weather", {"city": "Rome"})])),
    (harmony("commentary", "{oops", "functions.get_time", end=""), ("to=functions.get_time<|message|>{oops", [])),
])
def test_harmony_messages(text, expected):
    fmt = tool_call_format(make_tokenizer(HARMONY_TEMPLATE))
    assert fmt.name == "harmony" and fmt.native
    for pieces in (1, 4, len(text)):
        assert run_stream(fmt, text, pieces) == expected, pieces


def test_harmony_served_named_and_auto(model):
    running = serve_model(model, make_tokenizer(HARMONY_TEMPLATE), kv_cache_tokens=8192, page_size=8,
                          max_batch_tokens=64)
    try:
        client = running.client()
        ask = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], tools=[WEATHER, TIME],
                   tool_choice={"type": "function", "function": {"name": "get_weather"}},
                   seed=script(301, '{"city": "Kyiv"}'), max_tokens=100)
        assert whole(client, **ask) == ("", [("get_weather", {"city": "Kyiv"})], "tool_calls") == \
            streamed(client, **ask)
        auto = dict(ask, tool_choice="auto", seed=script(302, harmony("analysis", "hm") +
                                                          harmony("final", "Fine.", end="")))
        assert whole(client, **auto) == ("Fine.", [], "stop") == streamed(client, **auto)
    finally:
        running.stop()


def test_mistral_header_calls_through_mlx_lms_parser():
    pytest.importorskip("mlx_lm.tool_parsers.mistral")
    fmt = tool_call_format(make_tokenizer("{{ '[TOOL_CALLS]' }}"))
    assert run_stream(fmt, '[TOOL_CALLS]get_weather[ARGS]{"city": "Nice"}') == ("", [("get_weather",
                                                                                      {"city": "Nice"})])


# ---------------------------------------------------------------- errors
TOOL_MSGS = [{"role": "user", "content": "x"},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}]


@pytest.mark.parametrize("extra, param", [
    ({"tools": {"name": "f"}}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tools": [{"type": "code_interpreter", "function": {"name": "f"}}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": [{"role": "tool", "tool_call_id": "nope", "content": "r"}]}, "messages[0].tool_call_id"),
    ({"messages": TOOL_MSGS + [{"role": "tool", "tool_call_id": "c2", "content": "r"}]},
     "messages[2].tool_call_id"),
    ({"messages": TOOL_MSGS + [{"role": "tool", "content": "r"}]}, "messages[2].tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                         "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function",
                                                         "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages[0].tool_calls[0].id"),
    ({"messages": [{"role": "function", "name": "f", "content": "r"}]}, "messages[0].role"),
])
def test_bad_tools_and_tool_messages_are_400_naming_the_field(server, extra, param):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1, **extra}
    status, got = raw(server, "POST", "/v1/chat/completions", body)
    assert status == 400 and got["error"]["param"] == param, got


def test_a_matching_tool_message_is_answered(server):
    body = {"model": MODEL_NAME, "max_tokens": 1, "tools": [WEATHER],
            "messages": TOOL_MSGS + [{"role": "tool", "tool_call_id": "c1", "content": "rain"}]}
    status, got = raw(server, "POST", "/v1/chat/completions", body)
    assert status == 200 and got["usage"]["completion_tokens"] == 1, got


# ---------------------------------------------------------------- the default model
def test_smollm2_gets_the_tools_in_its_system_message_and_a_named_call_opened():
    """SmolLM2's template renders no tools: they are offered in the Hermes
    format in a system message, and a named tool_choice opens the call in the
    prompt. (A 135M model writes no useful arguments unconstrained: what is
    checked is what the server sends it and that the answer is well formed.)"""
    from model_fixtures import smollm2

    model, tokenizer = smollm2()
    assert "tools" not in tokenizer.chat_template and not tool_call_format(tokenizer).native
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    text = render_chat(tokenizer, messages, ToolUse((WEATHER,), "get_weather"))
    assert text.startswith("<|im_start|>system\nYou may call functions") and '"name": "get_weather"' in text
    assert text.endswith('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": ')


@pytest.mark.skipif(os.environ.get("MLX_ATTN_FULL_GRID") != "1",
                    reason="serving SmolLM2 costs most of a minute on the 2-core CI machine: MLX_ATTN_FULL_GRID=1")
def test_smollm2_served_answers_a_named_tool_choice_well_formed():
    from model_fixtures import smollm2

    model, tokenizer = smollm2()
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    running = serve_model(model, tokenizer, kv_cache_tokens=2048, page_size=16, max_batch_tokens=256)
    try:
        reply = running.client().chat.completions.create(
            model=MODEL_NAME, messages=messages, tools=[WEATHER], max_tokens=3,
            tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0]
        assert reply.finish_reason == "length" and not reply.message.tool_calls
        # an unfinished call is given back as written, its opening (from the prompt) included
        assert reply.message.content.startswith('<tool_call>\n{"name": "get_weather", "arguments": ')
        assert reply.message.content != '<tool_call>\n{"name": "get_weather", "arguments": '
    finally:
        running.stop()


def test_an_mlx_lm_model_uses_mlx_lms_own_tool_parser(tmp_path):
    """A model served through mlx-lm (--engine mlx-lm) is parsed by the
    parser mlx-lm infers for its template, as mlx_lm.server does."""
    pytest.importorskip("mlx_lm")
    from mlx_attn.lm import mlx_lm_models
    from test_mlx_lm_models import ARCHITECTURES, write_checkpoint

    directory = write_checkpoint(tmp_path / "q", ARCHITECTURES["qwen3"])
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = NATIVE_TEMPLATE.replace("c.function.name", "tool_call.name")  # what mlx-lm looks for
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    _, tokenizer = mlx_lm_models.load(directory)
    fmt = tool_call_format(tokenizer)
    assert fmt.name == "mlx-lm" and fmt.start == "<tool_call>" and fmt.end == "</tool_call>" and fmt.native
    text = render_chat(tokenizer, [{"role": "user", "content": "x"}], ToolUse((WEATHER,), "get_weather"))
    assert '"name": "get_weather"' in text and text.endswith("<|im_start|>assistant\n<tool_call>")
    assert run_stream(fmt, "ok " + call_text("get_weather", {"city": "Bern"})) == (
        "ok ", [("get_weather", {"city": "Bern"})])


def test_no_tool_body_makes_a_traceback(server):
    from test_serve_server import LoggedErrors

    hostile = [{"tools": [None]}, {"tools": [{"type": "function", "function": None}]},
               {"tools": [{"type": "function", "function": {"name": "f", "description": 5}}]},
               {"tools": [{"type": "function", "function": {"name": "f", "extra": 1}}]},
               {"tools": [WEATHER], "tool_choice": {"type": "function"}}, {"tools": [WEATHER], "tool_choice": 3},
               {"messages": [{"role": "assistant", "tool_calls": "x"}]},
               {"messages": [{"role": "assistant", "tool_calls": [None]}]},
               {"messages": [{"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f",
                                                                                         "arguments": "[1]"}}]}]},
               {"messages": [{"role": "tool", "tool_call_id": ["x"], "content": "r"}]},
               {"messages": [{"role": "user", "content": "\ud800"}], "tools": [WEATHER], "tool_choice": "required"}]
    with LoggedErrors() as logged:
        for extra in hostile:
            body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1, **extra}
            status, got = raw(server, "POST", "/v1/chat/completions", body)
            assert status in (200, 400), (extra, got)
            if status == 400:
                assert got["error"]["param"] and got["error"]["message"], got
    assert not logged, [record.getMessage() for record in logged]
