"""SmolLM2-135M-Instruct through mlx_attn against Hugging Face transformers.

The reference numbers in tests/fixtures/smollm2.json come from transformers
(torch, CPU) loading the same GGUF file (scripts/make_fixtures.py), an
implementation independent of this package. transformers dequantizes the
4-bit weights to float32; MLX multiplies with them quantized, so logits agree
to a tolerance (measured max |diff| ~0.013 over the top 64 logits; allowed
0.05), while greedy tokens must agree exactly.
"""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_attn.lm.generate import GenerationConfig, generate_tokens
from model_fixtures import smollm2

FIXTURES = Path(__file__).parent / "fixtures"
DATA = json.loads((FIXTURES / "smollm2.json").read_text())
LOGIT_TOLERANCE = 0.05


@pytest.fixture(scope="module")
def model_and_tokenizer():
    model, tokenizer = smollm2()
    yield model, tokenizer
    model.set_backend("auto")


def test_fixture_is_for_the_same_file():
    from mlx_attn.lm.model_store import MODELS

    spec = MODELS["smollm2-135m-instruct"]
    assert DATA["gguf_sha256"] == spec.files[spec.main_file]
    assert len(DATA["prompts"]) >= 3
    assert all(len(p["greedy_ids"]) >= 32 for p in DATA["prompts"] if "greedy_ids" in p)


@pytest.mark.parametrize("index", range(len(DATA["prompts"])))
def test_tokenizer_matches_transformers(model_and_tokenizer, index):
    _, tokenizer = model_and_tokenizer
    entry = DATA["prompts"][index]
    assert tokenizer.encode(entry["prompt"]) == entry["ids"]
    assert tokenizer.decode(entry["ids"]) == entry["prompt"]


def test_chat_template_matches_transformers(model_and_tokenizer):
    _, tokenizer = model_and_tokenizer
    chat = DATA["chat_example"]
    rendered = tokenizer.apply_chat_template(chat["messages"], add_generation_prompt=True)
    assert rendered == chat["rendered"]
    assert tokenizer.encode(rendered) == chat["ids"]


@pytest.mark.parametrize("backend", ["fused", "reference"])
def test_next_token_logits_match_transformers(model_and_tokenizer, backend):
    model, _ = model_and_tokenizer
    model.set_backend(backend)
    for entry in DATA["prompts"]:
        logits = np.array(model(mx.array([entry["ids"]]))[0, -1])
        top = np.array(entry["top_ids"])
        assert int(logits.argmax()) == top[0]
        np.testing.assert_allclose(logits[top], entry["top_logits"], atol=LOGIT_TOLERANCE)
    full = np.load(FIXTURES / "smollm2_logits_prompt0.npy").astype(np.float32)
    logits = np.array(model(mx.array([DATA["prompts"][0]["ids"]]))[0, -1])
    assert logits.shape == full.shape
    # whole vocabulary: the reference is stored in float16 (step 0.0156 near 20)
    np.testing.assert_allclose(logits, full, atol=LOGIT_TOLERANCE + 0.02)


@pytest.mark.parametrize("backend", ["fused", "reference"])
def test_greedy_continuation_matches_transformers(model_and_tokenizer, backend):
    model, _ = model_and_tokenizer
    model.set_backend(backend)
    for entry in DATA["prompts"]:
        if "greedy_ids" not in entry:
            continue
        config = GenerationConfig(max_tokens=len(entry["greedy_ids"]), stop_at_eos=False, prefill_chunk=4)
        assert list(generate_tokens(model, entry["ids"], config)) == entry["greedy_ids"]
