"""Sampling, generation mechanics, streaming and the CLI."""


import mlx.core as mx
import numpy as np
import pytest

from mlx_attn.lm.cli import main as cli_main
from mlx_attn.lm.generate import GenerationConfig, GenerationStats, generate, generate_tokens
from mlx_attn.lm.models.llama import Llama, LlamaConfig
from mlx_attn.lm.sampling import apply_repetition_penalty, make_sampler
from mlx_attn.lm.tokenizer import StreamingDetokenizer
from model_fixtures import smollm2


def tiny_llama(seed=0, **overrides):
    mx.random.seed(seed)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, rope_theta=1000.0)
    for k, v in overrides.items():
        setattr(config, k, v)
    model = Llama(config)
    mx.eval(model.parameters())
    return model


# ---------------------------------------------------------------- sampling
LOGITS = mx.array([[2.0, 1.0, 0.5, -1.0, 0.0, 3.0]])


def frequencies(sampler, n=4000, seed=0):
    mx.random.seed(seed)
    draws = np.array(sampler(mx.broadcast_to(LOGITS, (n, LOGITS.shape[1]))))
    return np.bincount(draws, minlength=LOGITS.shape[1]) / n


def test_greedy_and_degenerate_filters_pick_the_argmax():
    assert make_sampler(0.0)(LOGITS).item() == 5
    for sampler in (make_sampler(1.0, top_k=1), make_sampler(1.0, top_p=1e-6), make_sampler(1.0, min_p=0.99)):
        assert set(np.unique(np.array(sampler(mx.broadcast_to(LOGITS, (200, 6)))))) == {5}


def test_temperature_sampling_follows_softmax():
    for temperature in (1.0, 0.5):
        expected = np.exp(np.array(LOGITS[0]) / temperature)
        expected /= expected.sum()
        got = frequencies(make_sampler(temperature))
        assert np.abs(got - expected).max() < 0.03, (got, expected)


def test_top_k_top_p_and_min_p_restrict_the_support():
    assert set(np.nonzero(frequencies(make_sampler(1.0, top_k=2)))[0]) == {0, 5}
    probs = np.exp(np.array(LOGITS[0]))
    probs /= probs.sum()  # sorted: 5 (0.56), 0 (0.21), 1 (0.08), ...
    assert set(np.nonzero(frequencies(make_sampler(1.0, top_p=0.7)))[0]) == {5, 0}
    assert set(np.nonzero(frequencies(make_sampler(1.0, min_p=0.3)))[0]) == {5, 0}
    # renormalised among the survivors
    got = frequencies(make_sampler(1.0, top_k=2))
    assert abs(got[5] - probs[5] / (probs[5] + probs[0])) < 0.03


def test_seeded_sampling_is_reproducible():
    sampler = make_sampler(1.0)
    assert np.array_equal(frequencies(sampler, seed=3), frequencies(sampler, seed=3))


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5), dict(min_p=1.0)])
def test_invalid_sampling_parameters(kwargs):
    with pytest.raises(ValueError):
        make_sampler(**kwargs)


def test_repetition_penalty():
    out = np.array(apply_repetition_penalty(mx.array([[2.0, -2.0, 1.0]]), [0, 1, 1], 2.0))
    np.testing.assert_allclose(out, [[1.0, -4.0, 1.0]])
    with pytest.raises(ValueError):
        apply_repetition_penalty(LOGITS, [0], 0.0)


# ---------------------------------------------------------------- generation
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


def test_streaming_detokenizer_handles_multibyte_characters():
    _, tokenizer = smollm2()
    text = "naïve café 日本語 🙂 done"
    ids = tokenizer.encode(text)
    detok = StreamingDetokenizer(tokenizer)
    pieces = [detok.add(t) for t in ids] + [detok.finish()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_generate_with_the_real_model():
    model, tokenizer = smollm2()
    text = generate(model, tokenizer, "The capital of France is", max_tokens=3)
    assert text.startswith(" Paris")


def test_cli_generates_and_reports(capsys):
    assert cli_main(["generate", "The capital of France is", "--max-tokens", "4", "--backend", "fused"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("The capital of France is Paris")
    assert "[fused attention]" in captured.err and "tokens/s" in captured.err and "peak memory" in captured.err
    assert cli_main(["generate", "--chat", "Hi", "--max-tokens", "2", "--quiet"]) == 0


def test_cli_reports_bad_model_paths(capsys, tmp_path):
    assert cli_main(["generate", "x", "--model", str(tmp_path / "missing.gguf")]) == 2
    assert "not found" in capsys.readouterr().err
