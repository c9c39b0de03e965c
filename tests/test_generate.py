"""Generation mechanics (mlx_attn.lm.generate): cached decoding, prefill
chunks, both attention paths, stopping, seeding, and refused arguments."""

import math

import mlx.core as mx
import pytest

from mlx_attn.lm.generate import GenerationConfig, GenerationStats, generate, generate_tokens, stream_generate
from model_fixtures import smollm2, tiny_llama


def test_cached_generation_equals_recomputing_the_whole_sequence():
    model = tiny_llama()
    prompt = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
    tokens = list(generate_tokens(model, prompt, GenerationConfig(max_tokens=12, prefill_chunk=3)))
    seq = list(prompt)
    for _ in range(12):
        seq.append(int(mx.argmax(model(mx.array([seq]))[0, -1]).item()))
    assert tokens == seq[len(prompt):]


@pytest.mark.parametrize("chunk", [1, 2, 7, 512])
def test_prefill_chunk_size_does_not_change_the_result(chunk):
    model = tiny_llama()
    prompt = list(range(1, 20))
    base = list(generate_tokens(model, prompt, GenerationConfig(max_tokens=6, prefill_chunk=512)))
    assert list(generate_tokens(model, prompt, GenerationConfig(max_tokens=6, prefill_chunk=chunk))) == base


def test_fused_and_reference_paths_generate_the_same_tokens():
    model = tiny_llama(seed=4)
    prompt = list(range(5, 40, 3))
    out = {}
    for backend in ("fused", "reference"):
        model.set_backend(backend)
        out[backend] = list(generate_tokens(model, prompt, GenerationConfig(max_tokens=10)))
    assert out["fused"] == out["reference"]


def test_stops_at_end_of_sequence_and_counts():
    model = tiny_llama()
    prompt = [1, 2, 3]
    free = list(generate_tokens(model, prompt, GenerationConfig(max_tokens=8, stop_at_eos=False)))
    stats = GenerationStats()
    stopped = list(generate_tokens(model, prompt, GenerationConfig(max_tokens=8), eos_token_ids={free[3]}, stats=stats))
    assert stopped == free[: free.index(free[3])]
    assert stats.generated_tokens == len(stopped) and stats.prompt_tokens == 3
    assert stats.prompt_tps > 0 and stats.peak_memory_bytes > 0
    with pytest.raises(ValueError, match="at least one"):
        list(generate_tokens(model, [], GenerationConfig()))


def test_seeded_sampling_generation_is_reproducible():
    model = tiny_llama()
    config = GenerationConfig(max_tokens=10, temperature=1.0, seed=7)
    a = list(generate_tokens(model, [1, 2, 3], config))
    b = list(generate_tokens(model, [1, 2, 3], config))
    c = list(generate_tokens(model, [1, 2, 3], GenerationConfig(max_tokens=10, temperature=1.0, seed=8)))
    assert a == b and a != c


def test_generate_with_the_real_model():
    model, tokenizer = smollm2()
    text = generate(model, tokenizer, "The capital of France is", max_tokens=3)
    assert text.startswith(" Paris")


def test_zero_max_tokens_generates_nothing():
    model = tiny_llama()
    assert list(generate_tokens(model, [1, 2, 3], GenerationConfig(max_tokens=0))) == []


# ---------------------------------------------------------------- hostile input
@pytest.mark.parametrize("field, value, message", [
    ("max_tokens", -1, "max_tokens must be >= 0"),
    ("max_tokens", 2.5, "max_tokens must be an integer, got float"),
    ("max_tokens", "10", "max_tokens must be an integer, got str"),
    ("temperature", math.nan, "temperature must be finite"),
    ("temperature", -0.5, "temperature must be >= 0"),
    ("top_p", math.inf, "top_p must be finite"),
    ("top_k", -2, "top_k must be >= 0"),
    ("min_p", math.nan, "min_p must be finite"),
    ("repetition_penalty", math.nan, "repetition_penalty must be finite"),
    ("repetition_penalty", 0, "repetition_penalty must be > 0"),
    ("repetition_context", 0, "repetition_context must be >= 1"),
    ("seed", -1, "seed must be >= 0"),
    ("seed", 2**64, "seed must be <= 18446744073709551615"),
    ("seed", 1.5, "seed must be an integer"),
    ("prefill_chunk", 0, "prefill_chunk must be >= 1"),
    ("stop_at_eos", "no", "stop_at_eos must be true or false"),
])
def test_invalid_generation_config(field, value, message):
    with pytest.raises(ValueError, match=message):
        GenerationConfig(**{field: value})


@pytest.mark.parametrize("prompt, message", [
    ([1, 97], r"prompt\[1\] must be <= 96"),
    ([-1], r"prompt\[0\] must be >= 0"),
    ([1, 2.0], r"prompt\[1\] must be an integer, got float"),
    ([True], r"prompt\[0\] must be an integer, got bool"),
    ("hello", "prompt must be a list of token ids, got str"),
    (5, "prompt must be a list of token ids, got int"),
    ([], "at least one token"),
])
def test_invalid_prompts(prompt, message):
    with pytest.raises(ValueError, match=message):
        list(generate_tokens(tiny_llama(), prompt, GenerationConfig(max_tokens=2)))


def test_context_length_and_config_type_are_checked():
    model = tiny_llama(max_position_embeddings=16)
    with pytest.raises(ValueError, match=r"max_tokens \(14\) plus the prompt's 3 tokens exceed .* 16"):
        list(generate_tokens(model, [1, 2, 3], GenerationConfig(max_tokens=14)))
    assert len(list(generate_tokens(model, [1, 2, 3], GenerationConfig(max_tokens=13, stop_at_eos=False)))) == 13
    with pytest.raises(ValueError, match="config must be a GenerationConfig, got dict"):
        list(generate_tokens(model, [1], {"max_tokens": 3}))


def test_text_prompts_are_checked():
    model, tokenizer = smollm2()
    with pytest.raises(ValueError, match="at least one token"):
        generate(model, tokenizer, "")
    with pytest.raises(ValueError, match="not valid UTF-8"):
        generate(model, tokenizer, "caf\udce9")  # an undecodable byte kept as a surrogate
    with pytest.raises(ValueError, match="temperature must be finite"):
        generate(model, tokenizer, "Hi", temperature=math.nan)
    with pytest.raises(TypeError, match="unknown generation option 'temp'"):
        generate(model, tokenizer, "Hi", temp=0.5)
    with pytest.raises(ValueError, match="text must be a string, got bytes"):
        list(stream_generate(model, tokenizer, b"Hi", GenerationConfig()))


def test_attention_weights_layer_is_checked():
    model = tiny_llama()
    tokens = mx.array([[1, 2, 3]])
    assert model.attention_weights(tokens, layer=1).shape == (1, 4, 3, 3)
    for layer, message in ((2, "layer must be <= 1"), (-1, "layer must be >= 0"), ("0", "must be an integer")):
        with pytest.raises(ValueError, match=message):
            model.attention_weights(tokens, layer=layer)
