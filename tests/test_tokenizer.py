"""Tokenizers (mlx_attn.lm.tokenizer): streaming detokenization, chat
templates, and tokenizers built from bad metadata or configs. Loading whole
files with broken tokenizers is in test_loading.py."""

import json

import pytest

from mlx_attn.lm.tokenizer import StreamingDetokenizer, Tokenizer, tokenizer_from_file, tokenizer_from_gguf_metadata
from model_fixtures import CHAT_TEMPLATE, llama_gguf_metadata, smollm2, tiny_hf_tokenizer, TINY_CONFIG

METADATA = llama_gguf_metadata(TINY_CONFIG)


def tiny(**changes) -> Tokenizer:
    return tokenizer_from_gguf_metadata({**METADATA, **changes})


def test_streaming_detokenizer_handles_multibyte_characters():
    _, tokenizer = smollm2()
    text = "naïve café 日本語 🙂 done"
    ids = tokenizer.encode(text)
    detok = StreamingDetokenizer(tokenizer)
    pieces = [detok.add(t) for t in ids] + [detok.finish()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_tiny_tokenizer_from_metadata():
    tokenizer = tiny()
    assert tokenizer.vocab_size == 263 and tokenizer.eos_token_ids == {2} and tokenizer.bos_token_id == 1
    ids = tokenizer.encode("the <|im_end|>")
    assert ids[-1] == 2 and tokenizer.decode(ids) == "the <|im_end|>"  # special tokens stay whole
    assert tokenizer.encode("") == []


def test_chat_template_renders():
    text = tiny().apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert CHAT_TEMPLATE in METADATA.values()


# ---------------------------------------------------------------- hostile input
@pytest.mark.parametrize("template, message", [
    ("{% for m in messages %}", "TemplateSyntaxError"),
    ("{{ raise_exception('no system role') }}", "no system role"),
    ("{{ messages[5]['content'] }}", "UndefinedError"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{{ ''.__class__.__mro__ }}", "SecurityError|UndefinedError"),
    ("{{ messages.append(1) }}", "SecurityError"),
])
def test_broken_chat_templates_give_value_errors(template, message):
    with pytest.raises(ValueError, match=f"chat template failed: .*({message})"):
        tiny(**{"tokenizer.chat_template": template}).apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("messages", [
    "hi", [{"role": "user"}], [{"role": "user", "content": 3}], [("user", "hi")], None,
])
def test_malformed_chat_messages(messages):
    with pytest.raises(ValueError, match="messages must be a list of"):
        tiny().apply_chat_template(messages)


def test_no_chat_template():
    with pytest.raises(ValueError, match="no chat template"):
        tiny(**{"tokenizer.chat_template": None}).apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("text, message", [
    ("caf\udce9", "text is not valid UTF-8"), (b"bytes", "text must be a string, got bytes"),
    (None, "text must be a string, got NoneType"), (["a"], "got list"),
])
def test_encode_refuses_non_text(text, message):
    with pytest.raises(ValueError, match=message):
        tiny().encode(text)


def test_gguf_merges_that_split_into_three_parts():
    with pytest.raises(ValueError, match=r"tokenizer.ggml.merges\[0\] must be two known tokens"):
        tiny(**{"tokenizer.ggml.merges": ["Ġ t h"]})
    with pytest.raises(ValueError, match=r"merges\[0\]"):
        tiny(**{"tokenizer.ggml.merges": [5]})


@pytest.mark.parametrize("config, message", [
    ({"eos_token": "<|nope|>"}, "eos_token '<|nope|>' is not in the vocabulary"),
    ({"bos_token": {"content": 5}}, "bos_token must be a string, got int"),
    ({"add_bos_token": "true"}, "add_bos_token must be true or false"),
    ({"chat_template": [{"name": "tool_use", "template": "x"}]}, "chat_template must be a string or a list"),
    ({"chat_template": {"template": "x"}}, "chat_template must be a string or a list"),
    ([1], "tokenizer_config must be a JSON object"),
])
def test_bad_tokenizer_configs(tmp_path, config, message):
    path = tmp_path / "tokenizer.json"
    tiny_hf_tokenizer().save(str(path))
    with pytest.raises(ValueError, match=message):
        tokenizer_from_file(path, config)


def test_named_chat_templates_and_broken_tokenizer_files(tmp_path):
    path = tmp_path / "tokenizer.json"
    tiny_hf_tokenizer().save(str(path))
    tokenizer = tokenizer_from_file(path, {"chat_template": [{"name": "default", "template": "T"}],
                                           "eos_token": {"content": "<|im_end|>"}})
    assert tokenizer.chat_template == "T" and tokenizer.eos_token_ids == {2}
    path.write_text(json.dumps({"model": {"type": "BPE", "vocab": "not a dict"}}))
    with pytest.raises(ValueError, match="is not a valid tokenizer.json"):
        tokenizer_from_file(path)
    path.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="is not a valid tokenizer.json"):
        tokenizer_from_file(path)


@pytest.mark.parametrize("ids, message", [
    ([5, 10**6], "token id at position 1 must be <= 262"),
    ([-1], "token id at position 0 must be >= 0"),
    (["a"], "must be an integer, got str"),
    ([2**70], "must be <= 262"),
    ([1.0], "must be an integer, got float"),
])
def test_decode_refuses_ids_outside_the_vocabulary(ids, message):
    with pytest.raises(ValueError, match=message):
        tiny().decode(ids)


def test_bpe_metadata_without_merges_is_refused():
    # without merges a byte-level BPE tokenizes byte by byte: silently wrong
    metadata = {k: v for k, v in METADATA.items() if k != "tokenizer.ggml.merges"}
    with pytest.raises(ValueError, match="tokenizer.ggml.merges"):
        tokenizer_from_gguf_metadata(metadata)
