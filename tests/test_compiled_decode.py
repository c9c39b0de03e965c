"""The compiled decode step (``GenerationConfig.compiled``): same tokens and
same cache contents as the eager step, a trace replayed rather than rebuilt,
and the eager step wherever the caches are not plain KVCaches."""

import importlib

import mlx.core as mx
import pytest
from model_fixtures import random_llama, smollm2, tiny_llama

from mlx_attn.cache import ConcatKVCache, KVCache, RotatingKVCache
from mlx_attn.lm.compiled_decode import CompiledDecodeStep, compilable
from mlx_attn.lm.generate import GenerationConfig, generate_step, generate_tokens

generate_module = importlib.import_module("mlx_attn.lm.generate")  # mlx_attn.lm.generate is also a function


def _tokens(model, prompt, compiled, cache=None, **options):
    config = GenerationConfig(max_tokens=options.pop("max_tokens", 32), compiled=compiled, **options)
    return list(generate_tokens(model, prompt, config, cache=cache))


@pytest.mark.parametrize("backend", ["fused", "reference"])
def test_greedy_tokens_match_the_eager_step_on_a_tiny_model(backend):
    model = random_llama(seed=4)
    model.set_backend(backend)
    prompt = [5, 17, 99, 3, 250, 41]
    eager = _tokens(model, prompt, compiled=False)
    assert _tokens(model, prompt, compiled=True) == eager and len(eager) == 32


def test_greedy_tokens_match_the_eager_step_on_smollm2():
    model, tokenizer = smollm2()
    prompt = tokenizer.encode("The capital of France is")
    eager = _tokens(model, prompt, compiled=False, stop_at_eos=False)
    assert _tokens(model, prompt, compiled=True, stop_at_eos=False) == eager and len(eager) == 32


def test_decoding_across_a_buffer_growth_matches_and_fills_the_cache_alike():
    """A KVCache step of 8 grows its buffers every 8 tokens (a new trace per
    size); tokens, offsets and stored keys/values stay those of the eager step."""
    model = tiny_llama(seed=1)
    prompt = list(range(3, 14))
    caches = {}
    for compiled in (False, True):
        caches[compiled] = [KVCache(step=8) for _ in model.layers]
        caches[compiled] = (caches[compiled], _tokens(model, prompt, compiled, cache=caches[compiled],
                                                      max_tokens=30, temperature=0.7, seed=9))
    (eager_cache, eager), (compiled_cache, compiled) = caches[False], caches[True]
    assert compiled == eager
    for e, c in zip(eager_cache, compiled_cache):
        # the prompt and every generated token but the last went in
        assert c.offset == e.offset == len(prompt) + 30 - 1
        for ours, theirs in zip(c.state, e.state):
            assert mx.allclose(ours, theirs, atol=1e-5).item()


class _TraceCounter:
    """Counts the model's Python forward calls: the compiled step calls it
    only while tracing."""

    def __init__(self, model):
        self.model, self.calls = model, 0
        original = model.forward

        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        model.forward = counted


def test_the_step_is_traced_once_per_buffer_size_not_once_per_token():
    model = tiny_llama(seed=3)
    cache = [KVCache(step=256) for _ in model.layers]
    model(mx.array([[1, 2, 3]]), cache=cache)  # eager prefill allocates the buffers
    step = CompiledDecodeStep(model, cache)
    counter = _TraceCounter(model)
    for token in range(20):
        mx.eval(step(mx.array([[token + 4]])))
    assert counter.calls == 1 and cache[0].offset == 23


@pytest.mark.parametrize("make_cache", [lambda n: [ConcatKVCache() for _ in range(n)]], ids=["concat"])
def test_other_caches_keep_the_eager_step(make_cache, monkeypatch):
    model = tiny_llama()
    assert not compilable(model, make_cache(2))
    with pytest.raises(ValueError, match="plain KVCache"):
        CompiledDecodeStep(model, make_cache(2))
    prompt = list(range(2, 20))
    _forbid_compiled_step(monkeypatch)
    # same tokens either way (both run eagerly)
    assert _tokens(model, prompt, True, make_cache(2), max_tokens=16) == \
        _tokens(model, prompt, False, make_cache(2), max_tokens=16)


def _forbid_compiled_step(monkeypatch):
    def refuse(*args):
        raise AssertionError("the compiled step was built")

    monkeypatch.setattr(generate_module, "CompiledDecodeStep", refuse)


def test_a_quantized_kv_cache_keeps_the_eager_step(monkeypatch):
    model = random_llama(seed=2, num_attention_heads=2, num_key_value_heads=2)  # head_dim 32
    prompt = list(range(7, 40))
    _forbid_compiled_step(monkeypatch)
    options = dict(kv_bits=8, kv_group_size=32, max_tokens=12)
    assert _tokens(model, prompt, True, **options) == _tokens(model, prompt, False, **options)


def test_compiled_must_be_a_bool():
    with pytest.raises(ValueError, match="compiled"):
        GenerationConfig(compiled="yes")


def test_a_one_token_prompt_starts_from_empty_caches():
    model = random_llama(seed=5)
    assert _tokens(model, [7], True, max_tokens=10) == _tokens(model, [7], False, max_tokens=10)
    steps = list(generate_step(model, [7], GenerationConfig(max_tokens=3)))
    assert len(steps) == 3


@pytest.mark.parametrize("backend", ["fused", "reference"])
def test_several_rows_a_step_give_the_eager_logits_and_cache(backend):
    """rows(): a token and its drafts in one compiled step (causal among
    them) give the eager forward's logits for every
    position and the same cache, also after a trim of rejected rows and
    across a buffer growth; one trace per row count and buffer size."""
    model = tiny_llama(seed=5)
    model.set_backend(backend)
    caches = {c: [KVCache(step=16) for _ in model.layers] for c in ("eager", "compiled")}
    prompt = mx.array([[3, 9, 27, 81, 5, 7, 11]])
    for cache in caches.values():
        mx.eval(model(prompt, cache=cache))
    step = CompiledDecodeStep(model, caches["compiled"])
    counter, traced = _TraceCounter(model), []
    for i, rows in enumerate([4, 3, 4, 1, 5, 4]):  # 7 + ... crosses the 16-slot buffer once
        tokens = mx.array([[(13 * i + 7 * r) % 200 + 1 for r in range(rows)]])
        want = model(tokens, cache=caches["eager"])
        before = counter.calls
        got = step.rows(tokens)
        traced.append(counter.calls - before)
        assert got.shape == want.shape == (1, rows, want.shape[-1])
        assert mx.allclose(got, want, atol=1e-4).item(), i
        for cache in caches.values():  # the last row rejected: trimmed as speculative decoding trims it
            if rows > 1:
                for c in cache:
                    c.trim(1)
    for e, c in zip(caches["eager"], caches["compiled"]):
        assert c.offset == e.offset
        for ours, theirs in zip(c.state, e.state):
            assert mx.allclose(ours, theirs, atol=1e-5).item()
    # offsets 7 -> 10 -> 12 -> 15 -> 16: 4, 3 and 1 rows traced at 16 slots, 4 rows again replayed; 5
    # rows do not fit (eager: the buffer grows to 32), then 4 rows at 32 slots traced anew
    assert traced == [1, 1, 0, 1, 1, 1]


def _gemma(seed=0, **overrides):
    from test_gemma3 import tiny_gemma

    return tiny_gemma(seed=seed, **overrides)


@pytest.mark.parametrize("case", ["gemma windows", "llama max_kv_size", "gemma windows and max_kv_size"])
def test_rotating_caches_compile_and_match_the_eager_step(case):
    """Rotating caches (Gemma's windowed layers, a max_kv_size) run the
    compiled one-token step once their ring neither grows nor reorders:
    greedy and seeded sampled tokens, the caches' offsets, ring positions and
    stored keys are those of the eager step, over many wraps of the ring;
    the step is traced once per buffer layout, not per token."""
    model = _gemma(seed=2) if case.startswith("gemma") else tiny_llama(seed=2)
    max_kv_size = {"gemma windows": None, "llama max_kv_size": 12, "gemma windows and max_kv_size": 9}[case]
    prompt = [7, 3, 11, 5, 2, 9, 4]
    caches, tokens = {}, {}
    for compiled in (False, True):
        for options in ({}, {"temperature": 0.8, "seed": 5}):
            cache = model.make_cache(max_kv_size)
            assert compilable(model, cache) and any(type(c) is RotatingKVCache for c in cache)
            out = _tokens(model, prompt, compiled, cache=cache, max_tokens=40, stop_at_eos=False, **options)
            tokens[compiled, bool(options)] = out
            caches[compiled, bool(options)] = cache
    assert tokens[True, False] == tokens[False, False] and tokens[True, True] == tokens[False, True]
    for e, c in zip(caches[False, False], caches[True, False]):
        assert c.offset == e.offset == len(prompt) + 40 - 1
        if type(c) is RotatingKVCache:
            assert c._idx == e._idx and mx.array_equal(c.key_positions(), e.key_positions()).item()
        for ours, theirs in zip(c.state, e.state):
            assert mx.allclose(ours, theirs, atol=1e-5).item()


def test_the_rotating_step_is_traced_once_per_layout_and_refuses_rings_that_see_past_the_window():
    model = _gemma(seed=3)
    cache = model.make_cache()
    model(mx.array([[1, 2, 3]]), cache=cache)
    step = CompiledDecodeStep(model, cache)
    counter = _TraceCounter(model)
    for token in range(30):
        mx.eval(step(mx.array([[token % 50 + 4]])))
    # the first steps grow the rings (eager), the rest replay one trace
    assert counter.calls < 8 and cache[0].offset == 33
    wide = model.make_cache()
    window = model.attention_layers()[0].window_size
    wide[0] = RotatingKVCache(window + 1)
    assert not compilable(model, wide)
    sinks = model.make_cache()
    sinks[0] = RotatingKVCache(window, keep=2)  # its kept tokens fall out of the layer's window
    assert not compilable(model, sinks)
    assert compilable(tiny_llama(), [RotatingKVCache(12, keep=4) for _ in range(2)])  # no window: sinks are seen
