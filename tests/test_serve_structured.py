"""Structured output (``response_format``) by constrained decoding: the
engine's per-row token masks (mlx_attn.serve.constraints) and the server's
``json_object`` / ``json_schema`` through the official ``openai`` client.

Oracles: ``jsonschema`` validates every answer that ends with ``stop``
against its schema; a request served in a mixed batch gives the tokens it
gives alone. The schemas are generated (seeded) in the shapes agents send:
nested objects, enums, arrays with bounds, required and optional fields,
string patterns, bounded integers. A sample runs by default,
MLX_ATTN_FULL_GRID=1 runs a few hundred."""

from __future__ import annotations

import concurrent.futures
import json
import os
import random

import numpy as np
import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from mlx_attn.serve.constraints import Constraint, json_grammars, masks_to_bias  # noqa: E402
from mlx_attn.serve.engine import Engine  # noqa: E402
from mlx_attn.serve.sampling import SamplingParams  # noqa: E402

from model_fixtures import random_llama, smollm2, tiny_tokenizer, tiny_vocabulary  # noqa: E402
from test_serve_server import raw, serve_model  # noqa: E402

FULL_GRID = os.environ.get("MLX_ATTN_FULL_GRID") == "1"
EOS = 2  # <|im_end|> of the tiny tokenizer
MAX_TOKENS = 400  # every generated schema bounds its answer well below this


# ---------------------------------------------------------------- schemas
PATTERNS = ["^[a-z]{1,4}$", "^[0-9]{3}-[0-9]{2}$", "^(yes|no)$", "^[A-Z][a-z]{0,3}$"]


def leaf_schema(rng: random.Random) -> dict:
    kind = rng.choice(["string", "pattern", "enum", "integer", "boolean", "null", "const"])
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(0, 6)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(PATTERNS)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "a b", "x\"y", "é"], rng.randint(1, 4))}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 300)}
    if kind == "const":
        return {"const": rng.choice(["v1", 3, True])}
    return {"type": kind}


def value_schema(rng: random.Random, depth: int) -> dict:
    roll = rng.random()
    if depth > 0 and roll < 0.25:
        return object_schema(rng, depth - 1)
    if depth > 0 and roll < 0.45:
        low = rng.randint(0, 2)
        return {"type": "array", "items": value_schema(rng, depth - 1), "minItems": low,
                "maxItems": low + rng.randint(0, 2)}
    if roll < 0.5:
        return {"anyOf": [leaf_schema(rng), leaf_schema(rng)]}
    return leaf_schema(rng)


def object_schema(rng: random.Random, depth: int) -> dict:
    names = rng.sample(["id", "name", "kind", "tags", "args", "city", "count", "ok", "path", "meta"],
                       rng.randint(1, 4))
    properties = {name: value_schema(rng, depth) for name in names}
    required = names if rng.random() < 0.6 else rng.sample(names, rng.randint(0, len(names)))
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def generated_schemas(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [object_schema(rng, depth=rng.randint(0, 2)) for _ in range(count)]


# ---------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def tiny():
    vocab = len(tiny_vocabulary()[0])
    return random_llama(seed=5, vocab_size=vocab, max_position_embeddings=1024), tiny_tokenizer(eos_token_ids=(EOS,))


def run_engine(model, requests, max_tokens=MAX_TOKENS):
    """{id: tokens} of (id, prompt, sampling, constraint or None) served together."""
    engine = Engine(model, kv_tokens=32768, page_size=16, max_batch_tokens=512)
    for rid, prompt, sampling, constraint in requests:
        engine.submit(rid, prompt, max_tokens, stop_token_ids=[EOS], sampling=sampling, constraint=constraint)
    return engine.run_until_idle(max_steps=5 * max_tokens)


def answer_text(tokenizer, tokens):
    assert tokens[-1] == EOS, f"ran to max_tokens without closing the answer: {tokenizer.decode(tokens)!r}"
    return tokenizer.decode(tokens[:-1])


def test_masks_to_bias_unpacks_the_bits_in_token_order():
    masks = np.zeros((2, 2), np.int32)
    masks[0, 0] = 0b101  # tokens 0 and 2
    masks[1, 1] = np.int32(-2**31)  # token 63: the sign bit
    bias = masks_to_bias(masks, 40)
    assert bias.shape == (2, 40) and bias.dtype == np.float32
    assert np.flatnonzero(np.isfinite(bias[0])).tolist() == [0, 2]
    assert not np.isfinite(bias[1]).any()  # token 63 is past the vocabulary
    assert np.flatnonzero(np.isfinite(masks_to_bias(masks, 64)[1])).tolist() == [63]


def test_generated_schemas_always_give_valid_json(tiny):
    """Every request ends with the end token and its answer matches its schema."""
    model, tokenizer = tiny
    schemas = generated_schemas(300 if FULL_GRID else 32)
    grammars = json_grammars(tokenizer, model.config.vocab_size)
    prompt = tokenizer.encode("give me json")
    requests = [(i, prompt, SamplingParams(temperature=1.0, seed=i), grammars.factory(schema)())
                for i, schema in enumerate(schemas)]
    out = run_engine(model, requests)
    kinds = set()
    for i, schema in enumerate(schemas):
        answer = json.loads(answer_text(tokenizer, out[i]))
        jsonschema.validate(answer, schema)
        kinds |= {type(v).__name__ for v in answer.values()}
    assert {"str", "int", "list"} <= kinds  # the sample exercised the main shapes


def test_constrained_and_free_rows_in_one_batch_give_what_they_give_alone(tiny):
    model, tokenizer = tiny
    grammars = json_grammars(tokenizer, model.config.vocab_size)
    schema = {"type": "object", "properties": {"k": {"enum": ["a", "bb"]}, "n": {"type": "integer", "minimum": 0,
                                                                                "maximum": 99}},
              "required": ["k", "n"], "additionalProperties": False}
    prompts = [tokenizer.encode(text) for text in ("the first", "in the beginning", "then")]
    specs = [("free-greedy", prompts[0], SamplingParams(), None),
             ("json-greedy", prompts[1], SamplingParams(), schema),
             ("free-drawn", prompts[2], SamplingParams(temperature=0.8, seed=3), None),
             ("json-drawn", prompts[0], SamplingParams(temperature=0.8, seed=4), schema)]

    def requests(which):
        return [(rid, p, s, grammars.factory(c)() if c else None) for rid, p, s, c in specs if rid in which]

    together = run_engine(model, requests({rid for rid, *_ in specs}), max_tokens=40)
    for rid, *_ in specs:
        alone = run_engine(model, requests({rid}), max_tokens=40)
        assert together[rid] == alone[rid], rid
    for rid in ("json-greedy", "json-drawn"):
        jsonschema.validate(json.loads(answer_text(tokenizer, together[rid])), schema)


class EveryOtherToken(Constraint):
    """A hand-made constraint through the public seam: only even ids (and the end) after 3 tokens."""

    def __init__(self, vocab):
        self.vocab, self.count = vocab, 0

    def allowed_mask(self):
        allowed = np.zeros(self.vocab, bool)
        allowed[0::2] = True
        allowed[EOS] = self.count >= 3
        return np.packbits(np.pad(allowed, (0, -self.vocab % 32)), bitorder="little").view("<i4")

    def advance(self, token):
        self.count += 1


def test_any_constraint_plugs_into_the_engine(tiny):
    model, tokenizer = tiny
    constraint = EveryOtherToken(model.config.vocab_size)
    out = run_engine(model, [("r", tokenizer.encode("go"), SamplingParams(temperature=1.0, seed=1), constraint)])
    assert all(t % 2 == 0 for t in out["r"]) and constraint.count == len(out["r"])


class NothingAllowed(Constraint):
    def allowed_mask(self):
        return np.zeros(10, np.int32)

    def advance(self, token):
        pass


def test_a_constraint_that_allows_nothing_ends_its_request_at_once(tiny):
    """No way on: the request's end token, never a NaN draw; the other row is untouched."""
    model, tokenizer = tiny
    prompt = tokenizer.encode("go")
    free = run_engine(model, [("free", prompt, SamplingParams(), None)], max_tokens=8)
    both = run_engine(model, [("stuck", prompt, SamplingParams(temperature=1.0, seed=1), NothingAllowed()),
                              ("free", prompt, SamplingParams(), None)], max_tokens=8)
    assert both["stuck"] == [EOS] and both["free"] == free["free"]


def test_the_engine_refuses_a_constraint_of_the_wrong_type(tiny):
    engine = Engine(tiny[0], kv_tokens=256)
    with pytest.raises(ValueError, match="constraint"):
        engine.submit("r", [5, 6], 4, constraint=lambda: None)


def test_schemas_the_library_rejects_raise_schema_errors(tiny):
    from mlx_attn.serve.constraints import SchemaError

    grammars = json_grammars(tiny[1], tiny[0].config.vocab_size)
    for schema in ({"type": "nonsense"}, {"type": "string", "pattern": "(("},
                   {"type": "integer", "minimum": 5, "maximum": 1}, {"$ref": "#/nowhere"}):
        with pytest.raises(SchemaError):
            grammars.factory(schema)
    assert grammars.grammar({"type": "object"}) is grammars.grammar({"type": "object"})  # cached


# ---------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def server(tiny):
    model, tokenizer = tiny
    running = serve_model(model, tokenizer, kv_cache_tokens=8192, page_size=16, max_batch_tokens=256)
    yield running
    running.stop()


def json_schema_format(schema, name="answer"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def test_chat_json_schema_through_the_openai_client(server):
    """Concurrent requests (one batch in the engine), each with its own schema."""
    schemas = generated_schemas(4, seed=11)

    def ask(schema):
        return server.client().chat.completions.create(
            model="tiny-test-model", messages=[{"role": "user", "content": "hi"}], max_tokens=MAX_TOKENS,
            response_format=json_schema_format(schema), temperature=1.0, seed=2).choices[0]

    with concurrent.futures.ThreadPoolExecutor(len(schemas)) as pool:
        choices = list(pool.map(ask, schemas))
    for schema, choice in zip(schemas, choices):
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_streamed_and_whole_structured_answers_agree(server):
    client = server.client()
    schema = generated_schemas(1, seed=12)[0]
    options = dict(model="tiny-test-model", messages=[{"role": "user", "content": "hi"}], seed=9,
                   response_format=json_schema_format(schema), temperature=1.0, max_tokens=MAX_TOKENS)
    whole = client.chat.completions.create(**options).choices[0].message.content
    stream = client.chat.completions.create(stream=True, **options)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == whole
    jsonschema.validate(json.loads(whole), schema)


def test_json_object_and_n_choices_and_completions(server):
    client = server.client()
    reply = client.chat.completions.create(model="tiny-test-model", messages=[{"role": "user", "content": "hi"}],
                                           response_format={"type": "json_object"}, temperature=1.0, n=3,
                                           seed=5, max_tokens=MAX_TOKENS)
    finished = [c for c in reply.choices if c.finish_reason == "stop"]
    assert finished, "no choice closed its object"
    for choice in finished:
        assert isinstance(json.loads(choice.message.content), dict)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    status, body = raw(server, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 50,
                                                          "response_format": json_schema_format(schema)})
    assert status == 200 and json.loads(body["choices"][0]["text"]) in ({"ok": True}, {"ok": False})


def test_max_tokens_mid_object_says_length(server):
    client = server.client()
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30}}, "required": ["name"]}
    reply = client.chat.completions.create(model="tiny-test-model", messages=[{"role": "user", "content": "hi"}],
                                           response_format=json_schema_format(schema), max_tokens=4)
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and reply.usage.completion_tokens == 4
    assert choice.message.content.startswith("{")
    with pytest.raises(ValueError):
        json.loads(choice.message.content)


@pytest.mark.parametrize("response_format", [
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(("}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}},
    {"type": "json_schema", "json_schema": {"name": "x"}},
    {"type": "json_schema"},
    {"type": "xml"},
    "json",
])
def test_bad_response_formats_are_400_naming_the_field(server, response_format):
    status, body = raw(server, "POST", "/v1/chat/completions",
                       {"messages": [{"role": "user", "content": "hi"}], "response_format": response_format})
    assert status == 400 and body["error"]["param"] == "response_format", body


def test_a_bad_schema_through_the_client_is_a_bad_request(server):
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().chat.completions.create(
            model="tiny-test-model", messages=[{"role": "user", "content": "hi"}],
            response_format=json_schema_format({"type": "integer", "minimum": 3, "maximum": 1}))
    assert caught.value.body["param"] == "response_format" and "minimum" in caught.value.body["message"]


def test_text_format_is_unconstrained(server):
    status, plain = raw(server, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 6})
    status2, text = raw(server, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 6,
                                                            "response_format": {"type": "text"}})
    assert status == status2 == 200 and plain["choices"][0]["text"] == text["choices"][0]["text"]


# ---------------------------------------------------------------- the default model
def test_the_default_model_answers_in_the_schema():
    """Two requests served together on SmolLM2: each answer matches its schema."""
    model, tokenizer = smollm2()
    running = serve_model(model, tokenizer, kv_cache_tokens=4096, page_size=16, max_batch_tokens=256)
    schemas = [{"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                 "country": {"enum": ["France", "Italy", "Spain"]}},
                "required": ["city", "country"], "additionalProperties": False},
               {"type": "object", "properties": {"colors": {"type": "array", "items": {"enum": ["red", "green",
                                                                                          "blue", "yellow"]},
                                                            "minItems": 2, "maxItems": 3}},
                "required": ["colors"], "additionalProperties": False}]
    questions = ["What is the capital of France? Answer in JSON.", "Name two colors, in JSON."]

    def ask(schema, question):
        return running.client().chat.completions.create(
            model="tiny-test-model", max_tokens=40, messages=[{"role": "user", "content": question}],
            response_format=json_schema_format(schema)).choices[0]

    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            choices = list(pool.map(ask, schemas, questions))
    finally:
        running.stop()
    for schema, choice in zip(schemas, choices):
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)
    assert json.loads(choices[0].message.content)["city"] == "Paris"  # greedy: the model's own answer


def test_the_openai_clients_parse_helper_with_a_pydantic_model(server):
    """What agents' code sends: a pydantic model's schema ($defs, $ref, titles), parsed back by the client."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Step(BaseModel):
        tool: Literal["search", "read", "write"]
        retries: int = Field(ge=0, le=3)

    class Plan(BaseModel):
        steps: list[Step] = Field(min_length=1, max_length=3)
        done: bool

    reply = server.client().chat.completions.parse(
        model="tiny-test-model", messages=[{"role": "user", "content": "plan"}], response_format=Plan,
        temperature=1.0, seed=4, max_tokens=MAX_TOKENS)
    plan = reply.choices[0].message.parsed
    assert isinstance(plan, Plan) and 1 <= len(plan.steps) <= 3
