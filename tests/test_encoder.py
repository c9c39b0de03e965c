"""The BERT encoder: bidirectional attention, padding invariance, loading
errors. The comparison with transformers is in test_minilm_reference.py."""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

from mlx_attn.lm.model_store import fetch_model
from mlx_attn.lm import load_sentence_encoder
from model_fixtures import minilm


def test_similar_sentences_are_closer():
    e = np.array(minilm().encode(["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby."]))
    assert e[0] @ e[1] > e[0] @ e[2] + 0.2


def test_padding_does_not_change_an_embedding():
    encoder = minilm()
    short = "Paris"
    alone = np.array(encoder.encode([short]))[0]
    batched = np.array(encoder.encode([short, "a much longer sentence that forces plenty of padding onto the short one"]))[0]
    np.testing.assert_allclose(alone, batched, atol=1e-5)


def test_attention_is_bidirectional():
    encoder = minilm()
    tokens = mx.array([encoder.tokenize(["the bank of the river"])[0]])
    changed = mx.array(tokens)
    changed[0, -2] = encoder.tokenizer.token_to_id("money")
    a = np.array(encoder.model(tokens, [tokens.shape[1]]))
    b = np.array(encoder.model(changed, [tokens.shape[1]]))
    assert not np.allclose(a[0, 1], b[0, 1], atol=1e-4)  # an earlier token sees a later change


def test_loading_errors(tmp_path):
    source = fetch_model("all-minilm-l6-v2")
    copy = tmp_path / "model"
    shutil.copytree(source, copy)
    weights = copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match="truncated or corrupted"):
        load_sentence_encoder(copy)
    weights.unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_sentence_encoder(copy)
    shutil.copy(source / "model.safetensors", weights)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(dict(config, model_type="gpt2")))
    with pytest.raises(ValueError, match="not 'bert'"):
        load_sentence_encoder(copy)
    (copy / "config.json").write_text(json.dumps(dict(config, num_hidden_layers=7)))
    with pytest.raises(ValueError, match="do not fit"):
        load_sentence_encoder(copy)
    with pytest.raises(ValueError, match="no sentences"):
        minilm().encode([])


@pytest.mark.parametrize("changes, message", [
    (dict(num_attention_heads=0), "num_attention_heads must be >= 1"),
    (dict(num_attention_heads=5), r"hidden_size \(384\) is not a multiple of num_attention_heads \(5\)"),
    (dict(hidden_size="384"), "hidden_size must be an integer, got str"),
    (dict(layer_norm_eps=float("nan")), "layer_norm_eps must be finite"),
    (dict(max_position_embeddings=1024), r"position_embeddings.weight' has shape \(512, 384\)"),
    (dict(num_hidden_layers=2**31 - 1), "says a 2147483647-layer model, the checkpoint holds tensors for 6 layers"),
    (dict(position_embedding_type="relative_key"), "position_embedding_type 'relative_key' is not supported"),
    (dict(vocab_size=None), "vocab_size must be an integer, got NoneType"),
])
def test_wrong_bert_configs(tmp_path, changes, message):
    source = fetch_model("all-minilm-l6-v2")
    copy = tmp_path / "model"
    shutil.copytree(source, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(dict(config, **changes)))
    with pytest.raises(ValueError, match=message) as error:
        load_sentence_encoder(copy)
    assert str(copy) in str(error.value)


def test_sentences_must_be_text():
    with pytest.raises(ValueError, match="sentences must be strings"):
        minilm().encode(["fine", 3])
