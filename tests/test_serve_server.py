"""The OpenAI-compatible server (mlx_attn.serve.server), through the official
``openai`` client and raw HTTP, against a server started here on 127.0.0.1 on
a free port (uvicorn in a thread) over a tiny random Llama.

Oracles: a dense greedy decode written here (the model's full forward, argmax,
no cache) for the text; the same request served alone for batches; the
scheduler's invariants and held pages for the page accounting, checked after
every test."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import mlx.core as mx
import numpy as np
import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from mlx_attn.serve.server import ServerState, create_app, exposure_warning, make_state  # noqa: E402

from model_fixtures import random_llama, tiny_tokenizer, tiny_vocabulary, write_llama_gguf  # noqa: E402

CONTEXT = 512
MODEL_NAME = "tiny-test-model"
API_KEY = "sk-test-key"
DEADLINE = 60.0  # seconds any wait in these tests may take


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningServer:
    """uvicorn serving a fresh state in a thread, on 127.0.0.1."""

    def __init__(self, state, api_key=None, embeddings=None):
        self.state = state
        self.port = free_port()
        config = uvicorn.Config(create_app(self.state, api_key=api_key, embeddings=embeddings), host="127.0.0.1",
                                port=self.port,
                                log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        end = time.monotonic() + DEADLINE
        while not self.server.started:
            assert time.monotonic() < end and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        self.base = f"http://127.0.0.1:{self.port}"

    def client(self, api_key="unused"):
        return openai.OpenAI(base_url=self.base + "/v1", api_key=api_key, timeout=DEADLINE, max_retries=0)

    def wait_idle(self):
        end = time.monotonic() + DEADLINE
        while not self.state.idle:
            assert time.monotonic() < end, "the server did not become idle"
            time.sleep(0.02)

    def check_pages(self):
        """Nothing leaked: no page held once idle, the accounting consistent."""
        self.wait_idle()
        scheduler = self.state.engine.scheduler
        self.state.call_blocking(scheduler.check_invariants)
        assert self.state.call_blocking(lambda: scheduler.pool.held_pages) == 0

    def stop(self):
        self.server.should_exit = True
        self.thread.join(DEADLINE)
        assert not self.thread.is_alive()


def serve_model(model, tokenizer, api_key=None, embeddings=None, **state_options) -> RunningServer:
    return RunningServer(make_state(model, tokenizer, MODEL_NAME, **state_options), api_key, embeddings)


def raw(server, method, path, body=None, headers=None):
    """(status, parsed JSON or text) of one HTTP request."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=DEADLINE)
    try:
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        text = response.read().decode()
        try:
            return response.status, json.loads(text)
        except ValueError:
            return response.status, text
    finally:
        conn.close()


@pytest.fixture(scope="module")
def model_and_tokenizer():
    vocab = len(tiny_vocabulary()[0])
    model = random_llama(seed=3, vocab_size=vocab, max_position_embeddings=CONTEXT)
    return model, tiny_tokenizer(eos_token_ids=())  # no end token: every request runs to max_tokens


@pytest.fixture(scope="module")
def server(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    running = serve_model(model, tokenizer, kv_cache_tokens=1024, page_size=8, max_batch_tokens=64)
    yield running
    running.stop()


@pytest.fixture(autouse=True)
def pages_hold(request):
    yield
    if "server" in request.fixturenames:
        request.getfixturevalue("server").check_pages()


def dense_greedy(model, ids: list[int], n: int) -> list[int]:
    """The oracle: full forward over all tokens each step, argmax."""
    ids = list(ids)
    out = []
    for _ in range(n):
        logits = model(mx.array([ids]))[0, -1]
        out.append(int(mx.argmax(logits).item()))
        ids.append(out[-1])
    return out


# ---------------------------------------------------------------- endpoints
def test_health_and_models(server):
    assert raw(server, "GET", "/health") == (200, {"status": "ok"})
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]


def test_completion_is_the_dense_greedy_text(server, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    prompt = "the then in the"
    result = server.client().completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=7, temperature=0)
    expected = tokenizer.decode(dense_greedy(model, tokenizer.encode(prompt), 7))
    assert result.choices[0].text == expected
    assert result.choices[0].finish_reason == "length"
    assert result.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert result.usage.completion_tokens == 7


def test_chat_streaming_equals_non_streaming_and_the_dense_text(server, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    messages = [{"role": "user", "content": "in the then"}]
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    expected = tokenizer.decode(dense_greedy(model, ids, 6))
    client = server.client()
    whole = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6)
    assert whole.choices[0].message.content == expected
    assert whole.choices[0].message.role == "assistant"
    pieces, usage, finish = [], None, None
    for chunk in client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == expected
    assert finish == "length"
    assert usage.completion_tokens == 6 and usage.prompt_tokens == len(ids)


def test_concurrent_requests_each_equal_the_request_alone(server):
    """16 mixed-length requests at once (shared prefixes, chat and plain,
    greedy and seeded sampling): each gets the text it gets alone."""
    client = server.client()
    shared = "the then in the then in "
    words = ["the", "in in", "then", "in the " * 6, "", "the then the then then", "in", "then the in "]
    requests = []
    for i in range(16):
        prompt = (shared if i % 2 else "") + words[i % len(words)] + " in" * (i % 3)
        sampling = {"temperature": 0.9, "seed": 100 + i} if i % 4 == 3 else {}
        requests.append((i % 5 == 0, prompt or "the", 2 + (i * 5) % 13, sampling))

    def complete(i):
        chat, prompt, n, sampling = requests[i]
        if chat:
            return client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": prompt}],
                                                  max_tokens=n, **sampling).choices[0].message.content
        return client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=n, **sampling).choices[0].text

    alone = [complete(i) for i in range(len(requests))]
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(complete, range(len(requests)), timeout=DEADLINE))
    assert together == alone


def test_usage_reports_prefix_cache_hits(server):
    client = server.client()
    prompt = "in then the " * 8  # > 2 pages of 8 tokens
    first = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2)
    second = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2)
    assert second.choices[0].text == first.choices[0].text
    cached = second.usage.prompt_tokens_details.cached_tokens
    page, n = 8, second.usage.prompt_tokens
    # every full page of the prompt; the last prompt token always runs (its logits give the first new token)
    assert cached == min(n // page * page, n - 1)
    assert cached >= 2 * page


def test_stop_string_ends_the_text_before_it(server):
    client = server.client()
    full = client.completions.create(model=MODEL_NAME, prompt="the in", max_tokens=10).choices[0].text
    stop = full[3:5]
    assert stop
    result = client.completions.create(model=MODEL_NAME, prompt="the in", max_tokens=10, stop=[stop])
    assert result.choices[0].text == full[: full.find(stop)]
    assert result.choices[0].finish_reason == "stop"


# ---------------------------------------------------------------- logprobs and n
def dense_logprobs(model, ids: list[int], generated: list[int]) -> np.ndarray:
    """The oracle: float64 log-softmax of one full forward over the prompt
    and the generated tokens; row i is the distribution of generated[i]."""
    logits = model(mx.array([ids + generated[:-1]]))[0].astype(mx.float32)
    rows = np.array(logits, dtype=np.float64)[len(ids) - 1:]
    return rows - np.log(np.exp(rows - rows.max(-1, keepdims=True)).sum(-1, keepdims=True)) - rows.max(-1, keepdims=True)


def test_completion_logprobs_are_the_models(server, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    prompt = "then the in"
    ids = tokenizer.encode(prompt)
    result = server.client().completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=5, logprobs=3)
    logprobs = result.choices[0].logprobs
    generated = dense_greedy(model, ids, 5)
    oracle = dense_logprobs(model, ids, generated)
    assert logprobs.tokens == [tokenizer.decode([t]) for t in generated]
    np.testing.assert_allclose(logprobs.token_logprobs, [oracle[i, t] for i, t in enumerate(generated)], atol=2e-3)
    for i, top in enumerate(logprobs.top_logprobs):
        # OpenAI's format maps text to logprob: tokens decoding alike (byte pieces) keep the last, as here
        want = {tokenizer.decode([int(t)]): oracle[i, t] for t in np.argsort(-oracle[i])[:3]}
        assert set(top) == set(want)
        np.testing.assert_allclose([top[k] for k in want], list(want.values()), atol=2e-3)
    assert logprobs.text_offset[0] == 0 and "".join(logprobs.tokens) == result.choices[0].text


def test_chat_logprobs_streamed_and_whole(server, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    messages = [{"role": "user", "content": "in then"}]
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    generated = dense_greedy(model, ids, 4)
    oracle = dense_logprobs(model, ids, generated)
    client = server.client()
    whole = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4, logprobs=True,
                                           top_logprobs=2).choices[0].logprobs.content
    streamed = [entry for chunk in client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=4, logprobs=True, top_logprobs=2, stream=True)
        for choice in chunk.choices if choice.logprobs for entry in choice.logprobs.content]
    plain = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4)
    assert plain.choices[0].logprobs is None
    for entries in (whole, streamed):
        assert [e.token for e in entries] == [tokenizer.decode([t]) for t in generated]
        np.testing.assert_allclose([e.logprob for e in entries], [oracle[i, t] for i, t in enumerate(generated)],
                                   atol=2e-3)
        for i, entry in enumerate(entries):
            best = np.argsort(-oracle[i])[:2]
            assert [t.token for t in entry.top_logprobs] == [tokenizer.decode([int(t)]) for t in best]
            assert entry.bytes == list(entry.token.encode())


def test_n_choices_share_the_prompt_and_match_single_requests(server):
    client = server.client()
    prompt = "the in then " * 6  # several full pages of 8 tokens
    stats = lambda: server.state.call_blocking(server.state.engine.stats)  # noqa: E731
    before = stats()["cached_prompt_tokens"]
    result = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6, n=3, temperature=0.9, seed=7)
    cached = stats()["cached_prompt_tokens"] - before
    n_prompt = result.usage.prompt_tokens
    # choices 1 and 2 found every full page of the prompt that choice 0 computed
    assert cached >= 2 * min(n_prompt // 8 * 8, n_prompt - 1)
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert result.usage.completion_tokens == 18
    # choice i samples as a single request with seed + i
    single = [client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6, temperature=0.9,
                                        seed=7 + i).choices[0].text for i in range(3)]
    assert [c.text for c in result.choices] == single
    assert len(set(single)) > 1
    # streamed: the pieces of each index add up to that choice's text
    texts = {}
    for chunk in client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6, n=3, temperature=0.9,
                                           seed=7, stream=True):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert [texts[i] for i in range(3)] == single
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": prompt}],
                                          max_tokens=3, n=2)
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content  # greedy


# ---------------------------------------------------------------- errors
@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    ({"model": MODEL_NAME, "prompt": "the", "max_tokens": "5"}, 400, "max_tokens"),
    ({"model": MODEL_NAME, "prompt": 5}, 400, "prompt"),
    ({"model": MODEL_NAME, "prompt": "the", "temperature": "hot"}, 400, "temperature"),
    ({"model": MODEL_NAME, "prompt": "the", "stream": "yes"}, 400, "stream"),
    ({"model": "no-such-model", "prompt": "the"}, 404, "model"),
    ({"model": MODEL_NAME, "prompt": "the " * CONTEXT}, 400, "prompt"),
    ({"model": MODEL_NAME, "prompt": "the", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL_NAME, "prompt": "the", "max_tokens": 10**12}, 400, "max_tokens"),
    ({"model": MODEL_NAME, "prompt": "the", "max_tokens": True}, 400, "max_tokens"),
    ({"model": MODEL_NAME, "prompt": "the", "n": 0}, 400, "n"),
    ({"model": MODEL_NAME, "prompt": "the", "n": 17}, 400, "n"),
    ({"model": MODEL_NAME, "prompt": "the", "logprobs": True}, 400, "logprobs"),
    ({"model": MODEL_NAME, "prompt": "the", "logprobs": 21}, 400, "logprobs"),
    ({"model": MODEL_NAME, "prompt": "the", "stop": ["a", 3]}, 400, "stop"),
    ({"model": MODEL_NAME, "prompt": [1, 10**6]}, 400, "prompt"),
])
def test_bad_requests_get_openai_style_json_errors(server, body, status, param):
    got_status, got = raw(server, "POST", "/v1/completions", body)
    assert got_status == status
    assert isinstance(got["error"]["message"], str) and got["error"]["message"]
    assert got["error"]["param"] == param


def test_bad_chat_requests_through_the_client(server):
    client = server.client()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="context"):
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "the " * CONTEXT}])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, messages=[])
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], logprobs=True,
                                       top_logprobs=21)
    assert raw(server, "GET", "/v1/nothing")[0] == 404


def test_a_chat_message_with_an_unknown_role_is_refused_naming_it(server):
    messages = [{"role": "system", "content": "the"}, {"role": "user", "content": "in"},
                {"role": "wizard", "content": "then"}]
    status, body = raw(server, "POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert status == 400 and body["error"]["param"] == "messages[2].role"
    assert body["error"]["type"] == "invalid_request_error" and "wizard" in body["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="role"):
        server.client().chat.completions.create(model=MODEL_NAME, messages=[{"role": "", "content": "x"}])
    # every role the server renders is still answered
    known = [{"role": role, "content": "the"} for role in ("system", "developer", "user", "assistant", "user")]
    status, body = raw(server, "POST", "/v1/chat/completions", {"messages": known, "max_tokens": 1})
    assert status == 200 and body["usage"]["completion_tokens"] == 1


def nested(depth: int, inner="1") -> str:
    """JSON arrays ``depth`` deep around ``inner``."""
    return "[" * depth + inner + "]" * depth


def test_a_deeply_nested_body_is_refused_before_parsing(server):
    from mlx_attn.serve.request_parsing import MAX_JSON_DEPTH

    deep_bodies = [nested(100_000).encode(),  # the decoder would recurse 100,000 times
                   ('{"prompt": "the", "user": ' + nested(10_000) + "}").encode(),
                   ("{" * 300_000).encode()]  # not JSON either: the depth is found first
    for body in deep_bodies:
        status, got = raw(server, "POST", "/v1/completions", body)
        assert status == 400 and "deeper than" in got["error"]["message"], (status, got)
    # the body itself is level 1: a field MAX_JSON_DEPTH - 1 deep is at the bound, one more is past it
    for depth, expected in ((MAX_JSON_DEPTH - 1, 200), (MAX_JSON_DEPTH, 400)):
        body = f'{{"prompt": "the", "max_tokens": 1, "user": {nested(depth)}}}'.encode()
        assert raw(server, "POST", "/v1/completions", body)[0] == expected, depth
    # brackets inside strings (escaped quotes included) are text, not nesting
    text = '[{"\\"[' * 4000
    status, got = raw(server, "POST", "/v1/completions", {"prompt": "the", "max_tokens": 1, "user": text,
                                                           "stop": ["[[[["]})
    assert status == 200 and got["usage"]["completion_tokens"] == 1


class LoggedErrors:
    """Records the uvicorn server's log at ERROR and above (where it writes
    a handler's traceback)."""

    def __init__(self):
        import logging

        self.records = []
        self.handler = logging.Handler(logging.ERROR)
        self.handler.emit = self.records.append
        self.logger = logging.getLogger("uvicorn.error")

    def __enter__(self):
        self.logger.addHandler(self.handler)
        return self.records

    def __exit__(self, *exc):
        self.logger.removeHandler(self.handler)


HOSTILE_BODIES = [
    b"", b"{", b"]]]]", b"null", b"123", b'"a string"', b"[]", b"\xff\xfe\xfd", b'{"prompt": "\xff the"}',
    b'{"prompt": "\xed\xa0\x80"}',  # an encoded lone surrogate is not UTF-8
    '{"prompt": "the", "max_tokens": 1}'.encode("utf-16"),  # JSON in UTF-16 (as json.loads reads bytes): answered
    b'{"prompt": "the", "max_tokens": ' + b"9" * 5000 + b"}",  # past Python's integer digit limit
    b'{"prompt": "the", "max_tokens": 1, "repetition_penalty": ' + b"9" * 400 + b"}",  # no float holds it
    b'{"prompt": "the", "max_tokens": 1, "temperature": ' + b"9" * 400 + b"}",
    b'{"prompt": "the", "max_tokens": 1, "top_k": ' + b"9" * 400 + b"}",
    b'{"prompt": "the", "max_tokens": 1, "seed": ' + b"9" * 400 + b"}",
    b'{"prompt": "the", "max_tokens": 1, "n": ' + b"9" * 400 + b"}",
    b'{"prompt": "the", "max_tokens": 1, "repetition_penalty": 1e400}',
    b'{"prompt": "the", "max_tokens": 1, "top_p": NaN}',
    b'{"prompt": "the", "max_tokens": 1, "temperature": -Infinity}',
    b'{"prompt": "the", "max_tokens": 1, "min_p": Infinity}',
    b'{"prompt": [1e400], "max_tokens": 1}',
    b'{"prompt": "\\ud800", "max_tokens": 1}',  # a lone surrogate, escaped
    b'{"model": "\\udfff", "prompt": "the"}',
    b'{"prompt": "the", "max_tokens": 1, "stop": ["\\ud800"]}',
    b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 1}',
    b'{"messages": [{"role": "\\ud800", "content": "the"}], "max_tokens": 1}',
    b'{"messages": [{"role": "user", "content": [{"type": "text", "text": ["x"]}]}]}',
    b'{"messages": {"role": "user"}}', b'{"messages": [null]}', b'{"stream_options": [1]}',
    b'{"prompt": "the", "max_tokens": 1, "logprobs": 5, "stream": true, "stream_options": {"include_usage": 2}}',
]


def test_no_request_body_makes_a_traceback_or_a_500(server):
    """Bodies that are not JSON, not objects, hold numbers no field can
    take, NaN, infinities or lone surrogates: each answered (a 400 or 404
    naming the problem in the usual format, or an answer), nothing logged."""
    with LoggedErrors() as logged:
        for path in ("/v1/completions", "/v1/chat/completions"):
            for body in HOSTILE_BODIES:
                status, got = raw(server, "POST", path, body)
                assert status in (200, 400, 404), (path, body[:80], status, got)
                if status == 200 and isinstance(got, dict):
                    assert "choices" in got
                elif status != 200:
                    assert got["error"]["type"] == "invalid_request_error" and got["error"]["message"], got
    assert not logged, [record.getMessage() for record in logged]
    assert raw(server, "POST", "/v1/completions", {"prompt": "the", "max_tokens": 1})[0] == 200


# ---------------------------------------------------------------- disconnects
def test_an_abandoned_stream_frees_its_pages(server):
    cancelled = server.state.cancelled_requests
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=DEADLINE)
    body = {"model": MODEL_NAME, "prompt": "the then " * 10, "max_tokens": CONTEXT - 60, "stream": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    first = response.readline()
    assert first.startswith(b"data: ")
    conn.sock.shutdown(socket.SHUT_RDWR)  # the client goes away mid-stream
    conn.close()
    server.wait_idle()
    assert server.state.cancelled_requests == cancelled + 1  # cancelled, not run to max_tokens
    assert server.state.call_blocking(lambda: server.state.engine.scheduler.pool.held_pages) == 0


def test_an_abandoned_non_streaming_request_is_cancelled(server):
    before, cancelled = server.state.generated_tokens, server.state.cancelled_requests
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=DEADLINE)
    body = {"model": MODEL_NAME, "prompt": "in the " * 10, "max_tokens": CONTEXT - 60}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    end = time.monotonic() + DEADLINE
    while server.state.generated_tokens == before:
        assert time.monotonic() < end
        time.sleep(0.005)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    server.wait_idle()
    assert server.state.cancelled_requests == cancelled + 1
    assert server.state.generated_tokens - before < CONTEXT - 60


# ---------------------------------------------------------------- metrics, keys
def test_metrics_are_prometheus_text(server):
    server.client().completions.create(model=MODEL_NAME, prompt="the", max_tokens=2)
    status, text = raw(server, "GET", "/metrics")
    assert status == 200
    values = dict(line.split(" ") for line in text.splitlines() if not line.startswith("#"))
    for name in ("requests_running", "requests_waiting", "pages_used", "pages_free", "prefix_cache_hit_rate",
                 "generated_tokens_per_second"):
        assert f"mlx_attn_{name}" in values
    assert float(values["mlx_attn_generated_tokens_total"]) >= 2
    assert float(values["mlx_attn_pages_used"]) == 0


def test_api_key_is_required_when_set(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    keyed = serve_model(model, tokenizer, api_key=API_KEY, kv_cache_tokens=256, page_size=8)
    try:
        with pytest.raises(openai.AuthenticationError):
            keyed.client("sk-wrong").models.list()
        assert raw(keyed, "POST", "/v1/completions", {"prompt": "the"})[0] == 401
        assert raw(keyed, "GET", "/health")[0] == 200  # liveness needs no key
        result = keyed.client(API_KEY).completions.create(model=MODEL_NAME, prompt="the", max_tokens=2)
        assert result.usage.completion_tokens == 2
        keyed.check_pages()
    finally:
        keyed.stop()


@pytest.mark.parametrize("flags, message", [
    (["--kv-bits", "3"], "--kv-bits"), (["--port", "x"], "--port"), (["--page-size", "0"], "--page-size"),
    (["--no-such-flag"], "unrecognized"), (["--prefill-group-tokens", "-1"], "--prefill-group-tokens"),
])
def test_bad_serve_flags_are_one_line_errors(capsys, flags, message):
    from mlx_attn.lm.cli import main as cli_main

    assert cli_main(["serve", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_binding_beyond_loopback_without_a_key_warns():
    assert exposure_warning("127.0.0.1", None) is None
    assert exposure_warning("::1", None) is None
    assert exposure_warning("0.0.0.0", "k") is None
    assert "without an API key" in exposure_warning("0.0.0.0", None)


# ---------------------------------------------------------------- the command, SIGTERM
def test_mlx_attn_serve_finishes_running_requests_on_sigterm_and_exits_0(tmp_path):
    vocab = len(tiny_vocabulary()[0])
    model = write_llama_gguf(tmp_path / "tiny.gguf", model=random_llama(rope_traditional=True, vocab_size=vocab),
                             llama__vocab_size=vocab)
    port = free_port()
    command = [sys.executable, "-m", "mlx_attn.lm", "serve", "--model", str(model), "--host", "127.0.0.1",
               "--port", str(port), "--kv-cache-tokens", "512", "--page-size", "8", "--log-level", "warning"]
    env = {k: v for k, v in os.environ.items() if k != "MLX_ATTN_API_KEY"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        probe = types.SimpleNamespace(port=port)
        end = time.monotonic() + DEADLINE
        while True:
            assert process.poll() is None, process.communicate()[1].decode()[-2000:]
            assert time.monotonic() < end, "the server did not start"
            try:
                if raw(probe, "GET", "/health")[0] == 200:
                    break
            except OSError:
                time.sleep(0.1)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=DEADLINE)
        body = {"model": str(model), "prompt": "the then", "max_tokens": 40, "stream": True}
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200
        assert response.readline().startswith(b"data: ")
        process.send_signal(signal.SIGTERM)  # mid-stream: the request still ends normally
        rest = response.read().decode()
        conn.close()
        events = [line[len("data: "):] for line in rest.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        code = process.wait(DEADLINE)
        assert code == 0, process.communicate()[1].decode()[-4000:]
        with pytest.raises(OSError):  # no longer accepting
            raw(probe, "GET", "/health")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(DEADLINE)


# A model whose forward runs an mx.compile'd function on the engine thread (as
# mlx.nn's activations are): MLX frees that thread's compile cache at its exit,
# taking the GIL from a C++ destructor; an interpreter already finalizing then
# aborts the process ("terminate called without an active exception").
STOPPED_STATE_SCRIPT = """
import asyncio
import mlx.core as mx
from mlx_attn.serve.server import ServerState

@mx.compile
def activation(x):
    return x * mx.sigmoid(x)

state = ServerState(lambda: mx.eval(activation(mx.ones(8))), None, "compiled-on-the-engine-thread")
asyncio.new_event_loop().run_until_complete(state.stop())  # and exit at once, as uvicorn does
"""


def test_a_stopped_state_lets_the_process_exit_cleanly():
    """Without the engine thread's compile cache emptied in ``stop()``, about
    one run in three aborted here; eight clean exits in a row."""
    for _ in range(8):
        result = subprocess.run([sys.executable, "-c", STOPPED_STATE_SCRIPT], capture_output=True, text=True,
                                timeout=DEADLINE)
        assert result.returncode == 0, result.stderr[-2000:]


def test_many_connections_on_a_small_pool_complete_or_get_429(model_and_tokenizer):
    """16 clients at once, a pool that fits 4 requests, at most 8 accepted at
    once: each gets its alone-served text or a clean 429."""
    model, tokenizer = model_and_tokenizer
    small = serve_model(model, tokenizer, kv_cache_tokens=64, page_size=8, max_batch_tokens=32, max_requests=8)
    try:
        prompts = [("the in then " * 3)[: 4 + i] for i in range(16)]
        client = small.client()
        alone = [client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=8).choices[0].text
                 for p in prompts]

        def complete(i):
            try:
                return client.completions.create(model=MODEL_NAME, prompt=prompts[i], max_tokens=8).choices[0].text
            except openai.RateLimitError as error:
                assert error.status_code == 429 and error.body["code"] == "rate_limit_exceeded"
                return None

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            results = list(pool.map(complete, range(16), timeout=DEADLINE))
        served = [i for i, text in enumerate(results) if text is not None]
        assert served, "no request was served"
        assert [results[i] for i in served] == [alone[i] for i in served]
        # a request the pool (64 tokens) can never hold is refused, not queued forever
        status, body = raw(small, "POST", "/v1/completions", {"prompt": "the " * 40, "max_tokens": 40})
        assert status == 400 and "never fit" in body["error"]["message"]
        small.check_pages()
    finally:
        small.stop()


def test_the_chat_page_and_its_files_are_served_with_a_strict_policy(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=DEADLINE)
    try:
        for path, kind in (("/", "text/html"), ("/static/chat.js", "text/javascript"),
                           ("/static/chat.css", "text/css")):
            conn.request("GET", path)
            response = conn.getresponse()
            body = response.read().decode()
            assert response.status == 200 and response.getheader("content-type").startswith(kind)
            policy = response.getheader("content-security-policy")
            assert "script-src 'self'" in policy and "unsafe-inline" not in policy
            if path == "/":
                assert '<script src="/static/chat.js"></script>' in body
            if path.endswith(".js"):  # output is set as text, never parsed as HTML
                assert "textContent" in body and "innerHTML" not in body and "insertAdjacentHTML" not in body
    finally:
        conn.close()
    assert raw(server, "GET", "/static/..%2Fserver.py")[0] == 404
    assert raw(server, "GET", "/static/server.py")[0] == 404


# ---------------------------------------------------------------- the chat page in a browser
HOSTILE = '<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script><b>bold?</b>'


class ScriptedEngine:
    """Stands in for the engine in the browser test: every request
    'generates' the tokens of a fixed text, one per step (``delay`` seconds
    each), so what the page receives is known."""

    def __init__(self, script: list[int], delay: float = 0.0):
        from mlx_attn.serve.engine import Output

        self.output, self.script, self.delay = Output, script, delay
        self.model = types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=CONTEXT,
                                                                        vocab_size=1000))
        self.requests: dict = {}
        self.scheduler = self  # the tests' page checks read the scheduler

    @property
    def idle(self):
        return not self.requests

    def submit(self, rid, prompt, max_tokens, stop_token_ids=(), sampling=None, speculative=True):
        self.requests[rid] = [0, max_tokens]

    def cancel(self, rid):
        return self.requests.pop(rid, None) is not None

    def step(self):
        time.sleep(self.delay)
        outputs = []
        for rid, progress in list(self.requests.items()):
            done = progress[0] + 1 >= min(progress[1], len(self.script))
            outputs.append(self.output(rid, self.script[progress[0] % len(self.script)], 0.0, done))
            progress[0] += 1
            if done:
                del self.requests[rid]
        return outputs

    def stats(self):
        return dict.fromkeys(["running", "waiting", "pages_total", "pages_held", "pages_cached", "pages_free",
                              "preemptions", "prefix_hit_rate"], 0)


def browser():
    """A headless Chromium through its driver, or a skip (a failure on CI)."""
    import shutil

    missing = [tool for tool in ("chromium", "chromedriver") if shutil.which(tool) is None]
    try:
        from selenium import webdriver
    except ImportError:
        missing.append("selenium (pip)")
    if missing:
        message = f"the chat page's browser test needs {', '.join(missing)} (Debian: chromium chromium-driver)"
        pytest.fail(message) if os.environ.get("CI") else pytest.skip(message)
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    service = webdriver.ChromeService(executable_path=shutil.which("chromedriver"))
    return webdriver.Chrome(options=options, service=service)


def test_the_chat_page_streams_model_output_as_text_and_stops(model_and_tokenizer):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    _, tokenizer = model_and_tokenizer
    script = tokenizer.encode(HOSTILE)
    assert tokenizer.decode(script) == HOSTILE
    driver = browser()
    state = ServerState(lambda: ScriptedEngine(script, delay=0.01), tokenizer, MODEL_NAME)
    page = RunningServer(state)
    try:
        driver.set_page_load_timeout(DEADLINE)
        driver.get(page.base + "/")
        driver.find_element(By.ID, "input").send_keys("hello")
        driver.find_element(By.ID, "send").click()
        wait = WebDriverWait(driver, DEADLINE)
        def reply(d):
            replies = d.find_elements(By.CSS_SELECTOR, "#log .assistant")
            return replies[-1].get_attribute("textContent") if replies else ""

        # the whole reply arrived (the stop button is disabled again) and is shown as text, tags and all
        wait.until(lambda d: reply(d) == HOSTILE and d.find_element(By.ID, "stop").get_attribute("disabled"))
        assert driver.execute_script("return window.__pwned === undefined")  # nothing ran
        assert not driver.find_elements(By.CSS_SELECTOR, "#log img, #log script, #log b")
        assert "tokens/s" in driver.find_element(By.ID, "speed").text
        # stop: a long reply, cut mid-way; the server cancels the request
        state.engine.delay = 0.05
        driver.find_element(By.ID, "max-tokens").clear()
        driver.find_element(By.ID, "max-tokens").send_keys("300")
        driver.find_element(By.ID, "input").send_keys("again")
        driver.find_element(By.ID, "send").click()
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#log .assistant")) == 2 and len(reply(d)) > 3)
        driver.find_element(By.ID, "stop").click()
        wait.until(lambda d: state.cancelled_requests == 1 and state.idle)
        assert 3 < len(reply(driver)) < len(HOSTILE)  # cut mid-way
        assert not driver.find_elements(By.CSS_SELECTOR, "#log .error")
    finally:
        driver.quit()
        page.stop()
