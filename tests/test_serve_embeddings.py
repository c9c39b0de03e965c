"""``POST /v1/embeddings`` (mlx_attn.serve.embeddings) through the official
``openai`` client and raw HTTP, against a server started here on 127.0.0.1
with all-MiniLM-L6-v2 beside a tiny random chat model.

Oracle: the sentence encoder run directly (``SentenceEncoder.encode``) on
each input alone: the server's batched vectors equal it to float tolerance,
in both encodings."""

from __future__ import annotations

import base64

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from mlx_attn.lm.models.bert import SentenceEncoder  # noqa: E402
from mlx_attn.serve.embeddings import EmbeddingModel  # noqa: E402

from model_fixtures import minilm, random_llama, tiny_tokenizer, tiny_vocabulary  # noqa: E402
from test_serve_server import raw, serve_model  # noqa: E402

NAME = "all-minilm-l6-v2"
SERVED_CONTEXT = 48  # the served encoder's context: short, so the boundary test encodes little
TEXTS = ["The cat sat on the mat.", "A quick brown fox", "embeddings, batched", "ok"]


@pytest.fixture(scope="module")
def encoder():
    return minilm()


@pytest.fixture(scope="module")
def server(encoder):
    vocab = len(tiny_vocabulary()[0])
    model = random_llama(seed=1, vocab_size=vocab, max_position_embeddings=256)
    served = SentenceEncoder(encoder.model, encoder.tokenizer, max_length=SERVED_CONTEXT)
    running = serve_model(model, tiny_tokenizer(), embeddings=EmbeddingModel(served, NAME), kv_cache_tokens=512)
    yield running
    running.stop()


def direct(encoder, text):
    return np.array(encoder.encode(text)[0])


def test_strings_match_the_encoder_run_directly(server, encoder):
    client = server.client()
    reply = client.embeddings.create(model=NAME, input=TEXTS)  # the client asks for base64 and decodes it
    assert [d.index for d in reply.data] == list(range(len(TEXTS))) and reply.model == NAME
    for text, item in zip(TEXTS, reply.data):
        np.testing.assert_allclose(item.embedding, direct(encoder, text), atol=2e-5)
    tokens = sum(len(encoder.tokenize([t])[0]) for t in TEXTS)
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == tokens
    single = client.embeddings.create(model=NAME, input=TEXTS[0], encoding_format="float")
    np.testing.assert_allclose(single.data[0].embedding, direct(encoder, TEXTS[0]), atol=2e-5)


def test_float_and_base64_encodings_carry_the_same_vectors(server):
    status, floats = raw(server, "POST", "/v1/embeddings", {"model": NAME, "input": TEXTS[:2],
                                                           "encoding_format": "float"})
    status2, packed = raw(server, "POST", "/v1/embeddings", {"model": NAME, "input": TEXTS[:2],
                                                            "encoding_format": "base64"})
    assert status == status2 == 200
    for a, b in zip(floats["data"], packed["data"]):
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        assert len(a["embedding"]) == 384 and np.array_equal(decoded, np.array(a["embedding"], np.float32))


def test_token_arrays_embed_as_their_text(server, encoder):
    """Token ids (without the encoder's start/end tokens) give the text's vector."""
    ids = [encoder.tokenizer.encode(t, add_special_tokens=False).ids for t in TEXTS[:2]]
    client = server.client()
    one = client.embeddings.create(model=NAME, input=ids[0], encoding_format="float")
    many = client.embeddings.create(model=NAME, input=ids, encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, direct(encoder, TEXTS[0]), atol=2e-5)
    for text, item in zip(TEXTS, many.data):
        np.testing.assert_allclose(item.embedding, direct(encoder, text), atol=2e-5)


def test_past_the_encoder_context_is_a_400(server):
    context = SERVED_CONTEXT
    long_text = "word " * (context + 10)
    for body in ({"input": long_text}, {"input": [TEXTS[0], long_text]}, {"input": [5] * (context - 1)}):
        status, reply = raw(server, "POST", "/v1/embeddings", {"model": NAME, **body})
        assert status == 400 and reply["error"]["param"] == "input" and str(context) in reply["error"]["message"]
    status, _ = raw(server, "POST", "/v1/embeddings", {"model": NAME, "input": [5] * (context - 2)})
    assert status == 200  # with its start and end tokens exactly the context


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"), ({"input": [""] * 3000}, "input"), ({"input": 5}, "input"),
    ({"input": [[1, 2], "x"], "encoding_format": "int8"}, "encoding_format"), ({"input": [[]]}, "input"),
    ({"input": [[10**9]]}, "input"), ({"input": [True]}, "input"), ({"input": "x", "dimensions": 8}, "dimensions"),
    ({"input": "x", "model": "other"}, "model"), ({"input": ["ok", "\ud800"]}, "input"),
])
def test_bad_embedding_requests_name_the_field(server, body, param):
    status, reply = raw(server, "POST", "/v1/embeddings", {"model": NAME, **body})
    assert status in (400, 404) and reply["error"]["param"] == param, reply


def test_without_an_embedding_model_the_endpoint_is_a_400():
    vocab = len(tiny_vocabulary()[0])
    running = serve_model(random_llama(seed=1, vocab_size=vocab, max_position_embeddings=64), tiny_tokenizer(),
                          kv_cache_tokens=256)
    try:
        with pytest.raises(openai.BadRequestError) as caught:
            running.client().embeddings.create(model=NAME, input="hello")
        assert "--embedding-model" in caught.value.body["message"]
    finally:
        running.stop()


def test_the_embedding_model_flag_loads_the_encoder():
    from mlx_attn.serve.server import build_parser, load_embedding_model

    assert build_parser().parse_args([]).embedding_model is None and load_embedding_model(None) is None
    args = build_parser().parse_args(["--embedding-model", NAME])
    served = load_embedding_model(args.embedding_model)
    assert served.name == NAME and served.context == 256
    assert served.prefix == [101] and served.suffix == [102]  # [CLS] ... [SEP]
    with pytest.raises(ValueError, match="--embedding-model /nonexistent/encoder: config.json not found"):
        load_embedding_model("/nonexistent/encoder")
