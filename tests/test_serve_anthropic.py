"""The Anthropic Messages API (/v1/messages, /v1/messages/count_tokens)
through the official ``anthropic`` client against a server on 127.0.0.1
over a tiny random Llama; answers with tool calls are scripted as in
test_serve_tools.py (the same sampler seam)."""

from __future__ import annotations

import json

import pytest

anthropic = pytest.importorskip("anthropic")
pytest.importorskip("uvicorn")

from test_serve_server import API_KEY, MODEL_NAME, raw, serve_model  # noqa: E402
from test_serve_tools import CONTEXT, call_text, make_tokenizer, script, scripted_sampler  # noqa: E402,F401

from model_fixtures import random_llama, tiny_vocabulary  # noqa: E402

DEADLINE = 60.0
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def server():
    model = random_llama(seed=11, vocab_size=len(tiny_vocabulary()[0]), max_position_embeddings=CONTEXT)
    running = serve_model(model, make_tokenizer(), api_key=API_KEY, kv_cache_tokens=8192, page_size=8,
                          max_batch_tokens=64)
    yield running
    running.stop()


def client(server, key=API_KEY):
    return anthropic.Anthropic(base_url=server.base, api_key=key, timeout=DEADLINE, max_retries=0)


def streamed(server, **request):
    """(the final message, the event types in order) of a streamed request."""
    with client(server).messages.stream(**request) as stream:
        kinds = [event.type for event in stream]
        return stream.get_final_message(), kinds


def blocks(message):
    return [(b.type, b.text if b.type == "text" else (b.name, b.input)) for b in message.content]


def test_text_answer_whole_and_streamed_agree_and_match_the_openai_endpoint(server):
    ask = dict(model=MODEL_NAME, max_tokens=6, system="Be brief.", messages=[{"role": "user", "content": "the in"}])
    message = client(server).messages.create(**ask)
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL_NAME
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 6
    final, kinds = streamed(server, **ask)
    assert blocks(final) == blocks(message) and final.stop_reason == "max_tokens"
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert final.usage.output_tokens == 6
    # the same prompt through the OpenAI endpoint gives the same text (same template, same engine)
    import openai

    chat = openai.OpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0).chat.completions.create(
        model=MODEL_NAME, max_tokens=6, messages=[{"role": "system", "content": "Be brief."},
                                                  {"role": "user", "content": "the in"}])
    assert chat.choices[0].message.content == message.content[0].text
    assert chat.usage.prompt_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens


def test_a_whole_tool_loop(server):
    ask = dict(model=MODEL_NAME, max_tokens=200, tools=[WEATHER],
               messages=[{"role": "user", "content": "Weather in Oslo?"}])
    seed_call = script(201, "Checking. " + call_text("get_weather", {"city": "Oslo"}))
    # no seed in Anthropic's API: the script is keyed by the seed the engine drew; pin it through the sampler seam
    message = _scripted(server, seed_call, ask)
    assert message.stop_reason == "tool_use"
    assert blocks(message) == [("text", "Checking. "), ("tool_use", ("get_weather", {"city": "Oslo"}))]
    call = message.content[1]
    assert call.id.startswith("toolu_")
    final, kinds = _scripted(server, seed_call, ask, stream=True)
    assert blocks(final) == blocks(message) and final.stop_reason == "tool_use"
    assert kinds.count("content_block_start") == 2 and kinds.count("content_block_stop") == 2
    follow = ask["messages"] + [
        {"role": "assistant", "content": [b.model_dump() for b in message.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "rain"},
                                     {"type": "text", "text": "And so?"}]}]
    answer = script(202, "Take an umbrella.")
    done = _scripted(server, answer, dict(ask, messages=follow))
    assert blocks(done) == [("text", "Take an umbrella.")] and done.stop_reason == "end_turn"


def _scripted(server, seed, ask, stream=False):
    """A request whose engine rows sample with ``seed`` (the script's key)."""
    from mlx_attn.serve import anthropic_api

    real = anthropic_api.completion_request

    def with_seed(state, body, prompt, **options):
        return real(state, {**body, "seed": seed}, prompt, **options)

    anthropic_api.completion_request = with_seed
    try:
        return streamed(server, **ask) if stream else client(server).messages.create(**ask)
    finally:
        anthropic_api.completion_request = real


def test_stop_sequences_tool_choice_and_count_tokens(server):
    c = client(server)
    full = c.messages.create(model=MODEL_NAME, max_tokens=10, messages=[{"role": "user", "content": "then"}])
    text = full.content[0].text
    stop = text[3:5]
    cut = c.messages.create(model=MODEL_NAME, max_tokens=10, stop_sequences=[stop],
                            messages=[{"role": "user", "content": "then"}])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.find(stop)]
    # tool_choice tool: the call is opened in the prompt; the model writes the arguments
    named = _scripted(server, script(203, '{"city": "Lima"}}\n</tool_call>'), dict(
        model=MODEL_NAME, max_tokens=100, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "x"}]))
    assert blocks(named) == [("tool_use", ("get_weather", {"city": "Lima"}))]
    counted = c.messages.count_tokens(model=MODEL_NAME, messages=[{"role": "user", "content": "then"}])
    assert counted.input_tokens == full.usage.input_tokens + full.usage.cache_read_input_tokens


def test_keys_and_errors_in_anthropics_format(server):
    ok = {"model": MODEL_NAME, "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
    assert raw(server, "POST", "/v1/messages", ok, {"x-api-key": API_KEY})[0] == 200
    assert raw(server, "POST", "/v1/messages", ok, {"Authorization": f"Bearer {API_KEY}"})[0] == 200
    status, body = raw(server, "POST", "/v1/messages", ok, {"x-api-key": "wrong"})
    assert status == 401 and body["type"] == "error" and body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        client(server, "wrong").messages.create(**ok)
    with pytest.raises(anthropic.NotFoundError):
        client(server).messages.create(**dict(ok, model="claude-nope"))
    bad = [({"max_tokens": None}, "max_tokens"),
           ({"temperature": 5}, "temperature"),
           ({"top_k": -1}, "top_k"),
           ({"stop_sequences": "x"}, "stop_sequences"),
           ({"stream": "yes"}, "stream"),
           ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
           ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content[0].type"),
           ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t9"}]}]},
            "messages[0].content[0].tool_use_id"),
           ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
           ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
           ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
           ({"tool_choice": {"type": "any"}}, "tool_choice"),
           ({"presence_penalty": 1}, "presence_penalty"),
           ({"n": 2}, "n")]
    for extra, field in bad:
        status, body = raw(server, "POST", "/v1/messages", {**ok, **extra}, {"x-api-key": API_KEY})
        assert status == 400 and body["type"] == "error", (extra, body)
        assert body["error"]["type"] == "invalid_request_error" and field in body["error"]["message"], (extra, body)
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        client(server).messages.create(model=MODEL_NAME, max_tokens=10**9, messages=[{"role": "user", "content": "x"}])
    deep = b'{"messages": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
    status, body = raw(server, "POST", "/v1/messages", deep, {"x-api-key": API_KEY})
    assert status == 400 and body["type"] == "error" and "deeper than" in body["error"]["message"]
    assert json.dumps(body)  # a plain JSON body


TOOL_HOSTILE = [
    b'{"max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "tools": [null]}',
    b'{"max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "tools": [{"name": 5}]}',
    b'{"max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}',
    b'{"max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "tool"}}',
    b'{"max_tokens": 1, "messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": 1}]}]}',
    b'{"max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": []}]}]}',
    b'{"max_tokens": 1, "messages": [{"role": "user", "content": [null, 3, "x"]}]}',
    b'{"max_tokens": 1, "system": [{"type": "text", "text": "\\ud800"}], "messages": [{"role": "user", "content": "x"}]}',
    b'{"max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "stop_sequences": [""]}',
    b'{"max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f", "input_schema": '
    b'{"type": "object"}}], "tool_choice": {"type": "any", "disable_parallel_tool_use": "no"}}',
]


def test_no_body_makes_a_traceback_on_the_messages_endpoints(server):
    from test_serve_server import HOSTILE_BODIES, LoggedErrors

    with LoggedErrors() as logged:
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            for body in HOSTILE_BODIES + TOOL_HOSTILE:
                status, got = raw(server, "POST", path, body, {"x-api-key": API_KEY})
                assert status in (200, 400, 404), (path, body[:80], status, got)
                if status != 200:
                    assert got["type"] == "error" and got["error"]["message"], got
    assert not logged, [record.getMessage() for record in logged]
