"""Generation mechanics (mlx_attn.lm.generate): cached decoding, prefill
chunks, both attention paths, pipelining, mlx-lm-shaped responses, stopping,
seeding, and refused arguments."""

import math

import mlx.core as mx
import numpy as np
import pytest

from mlx_attn.cache import ConcatKVCache, KVCache, RotatingKVCache
from mlx_attn.lm.generate import GenerationConfig, generate, generate_step, generate_tokens, stream_generate
from model_fixtures import random_llama, smollm2, tiny_llama, tiny_tokenizer


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


def test_stops_at_end_of_sequence():
    model = tiny_llama()
    prompt = [1, 2, 3]
    free = list(generate_tokens(model, prompt, GenerationConfig(max_tokens=8, stop_at_eos=False)))
    stopped = list(generate_tokens(model, prompt, GenerationConfig(max_tokens=8), eos_token_ids={free[3]}))
    assert stopped == free[: free.index(free[3])]
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
    ("logprobs", 1, "logprobs must be true or false"),
    ("pipelined", None, "pipelined must be true or false"),
    ("max_kv_size", 4,
     r"max_kv_size must be at least 5, got 4: the rotating KV cache always keeps the first 4 tokens \(attention sinks\)"),
    ("max_kv_size", 8.0, "max_kv_size must be an integer"),
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


# ---------------------------------------------------------------- pipelining
class CallCounter:
    """A model wrapper that counts forward calls."""

    def __init__(self, model):
        self.model, self.config, self.calls = model, model.config, 0

    def make_cache(self, max_kv_size=None):
        return self.model.make_cache(max_kv_size)

    def __call__(self, tokens, cache=None):
        self.calls += 1
        return self.model(tokens, cache=cache)


@pytest.mark.parametrize("pipelined, queued_ahead", [(True, 1), (False, 0)])
def test_the_next_step_is_queued_before_a_token_is_handed_out(pipelined, queued_ahead):
    counter = CallCounter(tiny_llama())
    config = GenerationConfig(max_tokens=5, prefill_chunk=512, pipelined=pipelined)
    for n, _ in enumerate(generate_step(counter, [1, 2, 3, 4], config)):
        # one prefill call, one call per token up to n, and the queued one
        last = n + 1 == config.max_tokens
        assert counter.calls == 1 + (n + 1) + (0 if last else queued_ahead)
    assert counter.calls == 1 + config.max_tokens


CACHES = {"kv": lambda m: None, "rotating": lambda m: [RotatingKVCache(12, keep=4) for _ in m.layers],
          "concat": lambda m: [ConcatKVCache() for _ in m.layers]}


@pytest.mark.parametrize("backend", ["fused", "reference"])
@pytest.mark.parametrize("cache_kind", sorted(CACHES))
def test_pipelined_and_serial_decoding_agree(backend, cache_kind):
    model = tiny_llama(seed=2)
    model.set_backend(backend)
    prompt = list(range(3, 30, 2))
    out = {}
    for pipelined in (True, False):
        config = GenerationConfig(max_tokens=12, temperature=0.8, top_k=20, seed=3, repetition_penalty=1.3,
                                  repetition_context=5, prefill_chunk=4, pipelined=pipelined)
        out[pipelined] = list(generate_tokens(model, prompt, config, cache=CACHES[cache_kind](model)))
    assert out[True] == out[False] and len(out[True]) == 12


def test_repetition_penalty_sees_generated_tokens():
    model = tiny_llama(seed=5)
    prompt = [7, 8, 9]
    plain = list(generate_tokens(model, prompt, GenerationConfig(max_tokens=12, stop_at_eos=False)))
    penalized = list(generate_tokens(model, prompt, GenerationConfig(max_tokens=12, repetition_penalty=50.0)))
    # greedy decoding of a random model repeats itself; a heavy penalty on the
    # last 64 tokens forbids every repeat
    assert len(set(plain)) < len(plain)
    assert len(set(penalized)) == len(penalized)


def test_rotating_cache_generation_is_consistent_across_prefill_chunks():
    model = tiny_llama(seed=1)
    prompt = list(range(1, 40))
    runs = [list(generate_tokens(model, prompt, GenerationConfig(max_tokens=10, max_kv_size=9, prefill_chunk=c)))
            for c in (1, 5, 512)]
    assert runs[0] == runs[1] == runs[2]
    cache = model.make_cache(9)
    list(generate_tokens(model, prompt, GenerationConfig(max_tokens=3), cache=cache))
    assert isinstance(cache[0], RotatingKVCache) and cache[0].state[0].shape[2] <= 9
    # a window larger than everything generated is the full cache
    assert (list(generate_tokens(model, prompt, GenerationConfig(max_tokens=10, max_kv_size=64)))
            == list(generate_tokens(model, prompt, GenerationConfig(max_tokens=10))))


def test_a_prefilled_cache_continues_the_prompt():
    model = tiny_llama(seed=3)
    prompt = list(range(2, 26))
    whole = list(generate_tokens(model, prompt, GenerationConfig(max_tokens=8)))
    cache = [KVCache() for _ in model.layers]
    model(mx.array([prompt[:15]]), cache=cache)
    assert list(generate_tokens(model, prompt[15:], GenerationConfig(max_tokens=8), cache=cache)) == whole
    small = tiny_llama(max_position_embeddings=20)
    cache = [KVCache() for _ in small.layers]
    small(mx.array([list(range(1, 15))]), cache=cache)
    with pytest.raises(ValueError, match=r"max_tokens \(5\) plus the prompt's 2 tokens after the 14 cached"):
        list(generate_tokens(small, [1, 2], GenerationConfig(max_tokens=5), cache=cache))


# ---------------------------------------------------------------- responses (mlx-lm's shape)
def _greedy(model, prompt, n):
    return list(generate_tokens(model, prompt, GenerationConfig(max_tokens=n, stop_at_eos=False)))


def test_responses_when_the_length_limit_ends_generation():
    model, tokenizer = random_llama(seed=1), tiny_tokenizer(eos_token_ids=())
    prompt = tokenizer.encode("the then in")
    expected = _greedy(model, prompt, 6)
    # MLX's peak counter is process-wide: memory that earlier tests still hold counts in it, so the
    # bound is on what generation adds to the memory already in use.
    in_use_before = mx.get_active_memory() / 1e9
    responses = list(stream_generate(model, tokenizer, prompt, max_tokens=6))
    assert len(responses) == 6 and [r.token for r in responses] == expected
    assert [r.generation_tokens for r in responses] == [1, 2, 3, 4, 5, 6]
    assert [r.finish_reason for r in responses] == [None] * 5 + ["length"]
    assert "".join(r.text for r in responses) == tokenizer.decode(expected)
    last = responses[-1]
    assert last.prompt_tokens == len(prompt) and last.prompt_tps > 0 and last.generation_tps > 0
    assert in_use_before < last.peak_memory < in_use_before + 1  # GB, for a tiny model
    assert all(r.logprobs is None for r in responses)


def test_responses_when_an_end_token_stops_generation():
    model = random_llama(seed=1)
    prompt = tiny_tokenizer().encode("the then in")
    expected = _greedy(model, prompt, 6)
    eos = expected[3]
    stop = expected.index(eos)
    tokenizer = tiny_tokenizer(eos_token_ids=(eos,))
    responses = list(stream_generate(model, tokenizer, prompt, max_tokens=6))
    # as mlx-lm: the end token is counted and reported in the final response, without text
    assert len(responses) == stop + 1
    final = responses[-1]
    assert final.finish_reason == "stop" and final.token == eos and final.generation_tokens == stop + 1
    assert [r.token for r in responses[:-1]] == expected[:stop]
    assert "".join(r.text for r in responses) == tokenizer.decode(expected[:stop])
    stopped_at_once = list(stream_generate(model, tiny_tokenizer(eos_token_ids=(expected[0],)), prompt))
    assert len(stopped_at_once) == 1 and stopped_at_once[0].generation_tokens == 1
    assert stopped_at_once[0].text == ""


def test_zero_max_tokens_gives_one_final_response():
    model, tokenizer = random_llama(), tiny_tokenizer()
    (only,) = stream_generate(model, tokenizer, [5, 6], max_tokens=0)
    assert only.token is None and only.text == "" and only.finish_reason == "length"
    assert only.generation_tokens == 0


def test_logprobs_on_request_are_the_log_softmax_of_the_logits():
    model, tokenizer = random_llama(seed=2), tiny_tokenizer(eos_token_ids=())
    prompt = [40, 41, 42, 43]
    responses = list(stream_generate(model, tokenizer, prompt, max_tokens=3, logprobs=True))
    sequence = prompt + [r.token for r in responses]
    logits = np.array(model(mx.array([sequence]))[0].astype(mx.float32), dtype=np.float64)
    for i, r in enumerate(responses):
        row = logits[len(prompt) - 1 + i]
        expected = row - row.max() - np.log(np.exp(row - row.max()).sum())
        assert r.logprobs.shape == (300,)
        np.testing.assert_allclose(np.array(r.logprobs), expected, atol=1e-4)
        assert int(np.argmax(np.array(r.logprobs))) == r.token  # greedy picks the most likely


def test_generate_verbose_prints_as_mlx_lm(capsys):
    model, tokenizer = random_llama(seed=1), tiny_tokenizer(eos_token_ids=())
    text = generate(model, tokenizer, "the", max_tokens=4, verbose=True)
    lines = capsys.readouterr().out.split("\n")
    assert lines[0] == "==========" and lines[1] == text and lines[2] == "=========="
    assert lines[3].startswith(f"Prompt: {len(tokenizer.encode('the'))} tokens, ") and lines[3].endswith(" tokens-per-sec")
    assert lines[4].startswith("Generation: 4 tokens, ")
    assert lines[5].startswith("Peak memory: ") and lines[5].endswith(" GB")
    with pytest.raises(ValueError, match="verbose must be true or false"):
        generate(model, tokenizer, "the", verbose="yes")


def test_a_cache_that_is_not_a_list_of_layer_caches_is_a_clear_error():
    model, tokenizer = random_llama(seed=1), tiny_tokenizer()
    for cache, message in ((KVCache(), r"cache must be a list of 2 per-layer KV caches .*got KVCache"),
                           ([KVCache()], "cache has 1 layers, the model 2"),
                           ([KVCache(), "x"], r"cache\[1\] must be a KV cache")):
        with pytest.raises(ValueError, match=message):
            generate(model, tokenizer, "the then", cache=cache, max_tokens=2)
