"""Request-field hygiene of the OpenAI endpoints: every field honoured,
accepted and ignored as docs/serving.md lists, or refused naming it; and
the sampler's presence / frequency penalties, logit bias and
max_completion_tokens against a dense oracle written here."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from model_fixtures import random_llama, tiny_tokenizer, tiny_vocabulary  # noqa: E402
from test_serve_server import CONTEXT, MODEL_NAME, raw, serve_model  # noqa: E402


@pytest.fixture(scope="module")
def model_and_tokenizer():
    vocab = len(tiny_vocabulary()[0])
    return random_llama(seed=5, vocab_size=vocab, max_position_embeddings=CONTEXT), tiny_tokenizer(eos_token_ids=())


@pytest.fixture(scope="module")
def server(model_and_tokenizer):
    running = serve_model(*model_and_tokenizer, kv_cache_tokens=512, page_size=8, max_batch_tokens=64)
    yield running
    running.stop()


def shaped_greedy(model, ids, n, presence=0.0, frequency=0.0, bias=None):
    """The oracle: full forward each step; OpenAI's penalties over the
    generated tokens (not the prompt) and the bias, then argmax."""
    ids, out = list(ids), []
    for _ in range(n):
        logits = np.array(model(mx.array([ids]))[0, -1].astype(mx.float32), dtype=np.float64)
        for token in set(out):
            logits[token] -= presence + frequency * out.count(token)
        for token, value in (bias or {}).items():
            logits[token] += value
        out.append(int(np.argmax(logits)))
        ids.append(out[-1])
    return out


def test_penalties_and_bias_shape_greedy_decoding_as_openai_defines_them(server, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    client = server.client()
    prompt = "the then in"
    ids = tokenizer.encode(prompt)
    plain = shaped_greedy(model, ids, 12)
    assert len(set(plain)) < len(plain), "the test needs a plain text that repeats tokens"
    for presence, frequency in ((2.0, 0.0), (0.0, 1.5), (0.5, 0.7), (-2.0, 0.0)):
        want = shaped_greedy(model, ids, 12, presence, frequency)
        got = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, presence_penalty=presence,
                                         frequency_penalty=frequency, logprobs=0)
        assert got.choices[0].logprobs.tokens == [tokenizer.decode([t]) for t in want], (presence, frequency)
    assert shaped_greedy(model, ids, 12, 2.0) != plain  # the penalty changed something
    bias = {7: 100.0, plain[0]: -100.0}
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": prompt}],
                                          max_completion_tokens=5, logit_bias={str(k): v for k, v in bias.items()},
                                          logprobs=True)
    assert [e.token for e in chat.choices[0].logprobs.content] == [tokenizer.decode([7])] * 5
    assert chat.usage.completion_tokens == 5 and chat.choices[0].finish_reason == "length"
    # sampled rows too: a bias of +100 on one token wins every draw
    drawn = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6, temperature=1.0, seed=3,
                                      logit_bias={"9": 100}, frequency_penalty=0.5)
    assert drawn.choices[0].text == tokenizer.decode([9] * 6)


@pytest.mark.parametrize("extra, param", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"frequency_penalty": "1"}, "frequency_penalty"),
    ({"logit_bias": {"the": 1}}, "logit_bias"),
    ({"logit_bias": {"100000": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": True}}, "logit_bias"),
    ({"logit_bias": [5]}, "logit_bias"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"temperatur": 0.5}, "temperatur"),  # a misspelt field is refused, not silently ignored
    ({"guided_json": {}}, "guided_json"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"audio": {"voice": "alloy"}}, "audio"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
])
def test_a_chat_field_not_honoured_is_refused_naming_it(server, extra, param):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "the"}], "max_tokens": 1, **extra}
    status, got = raw(server, "POST", "/v1/chat/completions", body)
    assert status == 400 and got["error"]["param"] == param, got


@pytest.mark.parametrize("extra, param", [
    ({"echo": True}, "echo"), ({"suffix": "the"}, "suffix"), ({"best_of": 3}, "best_of"),
    ({"messages": []}, "messages"), ({"top_logprobs": 2}, "top_logprobs"), ({"tools": []}, "tools"),
])
def test_a_completions_field_not_honoured_is_refused_naming_it(server, extra, param):
    status, got = raw(server, "POST", "/v1/completions", {"prompt": "the", "max_tokens": 1, **extra})
    assert status == 400 and got["error"]["param"] == param, got


def test_ignored_fields_and_defaults_are_accepted(server):
    chat = {"messages": [{"role": "user", "content": "the"}], "max_tokens": 1, "user": "u1", "store": False,
            "metadata": {"k": "v"}, "service_tier": "auto", "reasoning_effort": "low", "modalities": ["text"],
            "response_format": {"type": "text"}, "presence_penalty": 0, "logit_bias": {}, "audio": None}
    status, got = raw(server, "POST", "/v1/chat/completions", chat)
    assert status == 200 and got["usage"]["completion_tokens"] == 1, got
    plain = {"prompt": "the", "max_tokens": 1, "user": "u1", "echo": False, "best_of": 1, "suffix": None}
    status, got = raw(server, "POST", "/v1/completions", plain)
    assert status == 200 and got["usage"]["completion_tokens"] == 1, got


def test_docs_list_every_field_each_api_honours_or_ignores():
    """docs/serving.md names every field request_fields.py lets through, so
    none is silently ignored without being listed."""
    import pathlib
    import re

    from mlx_attn.serve.request_fields import HONOURED, IGNORED

    docs = pathlib.Path(__file__).resolve().parents[1] / "docs" / "serving.md"
    named = set(re.findall(r"`([a-z_]+)`", docs.read_text()))
    for api in HONOURED:
        missing = (HONOURED[api] | IGNORED[api]) - named
        assert not missing, (api, sorted(missing))


def test_rows_with_different_penalties_and_biases_in_one_batch_each_sample_as_alone():
    from mlx_attn.serve.sampling import SamplingParams, sample_rows

    logits = mx.random.normal((5, 263), key=mx.random.key(0))
    previous = [[1, 5, 5, 9], [5, 7, 7, 7, 7], [3, 3], [4], [8, 8, 8]]
    params = [SamplingParams(frequency_penalty=1.5), SamplingParams(presence_penalty=-2.0, repetition_penalty=1.3),
              SamplingParams(temperature=0.8, seed=4, logit_bias=((3, 5.0), (11, -1.0)), frequency_penalty=0.4),
              SamplingParams(), SamplingParams(temperature=1.2, seed=9, presence_penalty=2.0)]
    indices = [3, 4, 1, 0, 2]
    together = sample_rows(logits, params, previous, indices)
    alone = [sample_rows(logits[r:r + 1], params[r:r + 1], previous[r:r + 1], indices[r:r + 1])[0]
             for r in range(len(params))]
    assert together == alone
    # the greedy rows as the oracle computes them
    row = np.array(logits[0], dtype=np.float64)
    generated = previous[0][-indices[0]:]  # the prompt's token 1 does not count
    for token in set(generated):
        row[token] -= 1.5 * generated.count(token)
    assert together[0].token == int(np.argmax(row))
    assert not SamplingParams(logit_bias=((1, 0.5),)).greedy and SamplingParams().greedy
    with pytest.raises(ValueError, match="presence_penalty"):
        SamplingParams(presence_penalty=2.5)
