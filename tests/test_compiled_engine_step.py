"""The engine's compiled decode-only step (mlx_attn/serve/compiled_step.py)
against its eager step, and the K/V store's in-place page copies."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_attn import _native
from mlx_attn.serve import Engine, PagedKVStore, SamplingParams

from test_serve_engine import greedy_alone, tiny_llama
from model_fixtures import assert_same_logprobs

pytestmark = pytest.mark.skipif(_native.ext is None, reason="the compiled step calls the fused CPU paged kernel")


def serve(engine, requests):
    """Every request's (token, logprob, top ids) per step, until idle."""
    for rid, (prompt, max_tokens, params) in requests.items():
        engine.submit(rid, prompt, max_tokens, sampling=params)
    out: dict = {}
    for _ in range(400):
        if engine.idle:
            return out
        for o in engine.step():
            out.setdefault(o.request_id, []).append((o.token, o.logprob, [t for t, _ in o.top_logprobs]))
        engine.scheduler.check_invariants()
    raise AssertionError("the engine did not finish")


@pytest.mark.parametrize("kv_bits", [None, 8])
def test_compiled_decode_steps_equal_the_eager_step(kv_bits):
    """Greedy, seeded, penalised and top-logprob requests, chunked prefill
    and preemption on a small pool: the compiled engine gives the eager
    engine's tokens and log-probabilities, and its decode steps did run compiled."""
    model = tiny_llama(seed=6, head_dim=8 if kv_bits is None else 32)
    rng = np.random.default_rng(7)
    kinds = [SamplingParams(), SamplingParams(temperature=1.3, top_p=0.9, seed=11, logprobs=True),
             SamplingParams(top_logprobs=3), SamplingParams(temperature=0.8, repetition_penalty=1.3, seed=12)]
    requests = {f"r{i}": (rng.integers(0, 64, int(rng.integers(2, 10))).tolist(), 5 + i % 3, kinds[i % 4])
                for i in range(7)}

    def engine(compiled):
        made = Engine(model, kv_tokens=48, page_size=4, max_batch_tokens=10, dtype=mx.float32, kv_bits=kv_bits,
                      group_size=32)
        if not compiled:
            made.decode_steps = None
        return made

    eager_engine, compiled_engine = engine(False), engine(True)
    eager, compiled = serve(eager_engine, requests), serve(compiled_engine, requests)
    assert compiled_engine.decode_steps.steps > 0 and compiled_engine.decode_steps.disabled_reason is None
    assert compiled_engine.stats()["preemptions"] > 0  # the small pool made requests yield their pages
    assert set(compiled) == set(requests)
    for rid in requests:
        assert [t for t, _, _ in compiled[rid]] == [t for t, _, _ in eager[rid]], rid
        assert_same_logprobs([lp for _, lp, _ in compiled[rid]], [lp for _, lp, _ in eager[rid]], atol=1e-5)
        assert [top for _, _, top in compiled[rid]] == [top for _, _, top in eager[rid]], rid
    assert compiled_engine.pool.held_pages == 0


def test_one_trace_per_rows_and_table_width():
    """A request growing token by token replays one trace until its block
    table outgrows the padded width; its tokens are the dense model's."""
    from mlx_attn.serve.compiled_step import MIN_TABLE_WIDTH

    model = tiny_llama(seed=8)
    engine = Engine(model, kv_tokens=256, page_size=2, dtype=mx.float32)
    prompt = [5, 9, 13]
    max_tokens = 2 * MIN_TABLE_WIDTH + 4  # past MIN_TABLE_WIDTH pages of 2 tokens
    engine.submit("long", prompt, max_tokens)
    assert engine.run_until_idle()["long"] == greedy_alone(model, prompt, max_tokens)
    assert engine.decode_steps.traced_shapes == {(1, MIN_TABLE_WIDTH), (1, 2 * MIN_TABLE_WIDTH)}
    assert engine.decode_steps.steps == max_tokens - 1  # every token after the prompt's first


def test_warm_up_traces_the_one_request_step_and_leaves_outputs_alone():
    model = tiny_llama(seed=9)
    engine = Engine(model, kv_tokens=64, page_size=4, dtype=mx.float32)
    with pytest.raises(ValueError, match="max_rows"):
        engine.warm_up(0)
    engine.warm_up(3)
    assert engine.decode_steps.traced_shapes == {(1, 16), (2, 16), (3, 16)}
    engine.submit("a", [1, 2, 3, 4, 5], 6)
    engine.step()
    with pytest.raises(RuntimeError, match="idle"):
        engine.warm_up()
    assert engine.run_until_idle()["a"] == greedy_alone(model, [1, 2, 3, 4, 5], 6)[1:]


def test_pages_of_another_dtype_keep_the_eager_step():
    """float16 pages under float32 queries: the eager call converts the pool,
    the compiled step declines (its reason kept) and the engine runs eagerly."""
    model = tiny_llama(seed=10)
    outputs = {}
    for compiled in (True, False):
        engine = Engine(model, kv_tokens=64, page_size=4, dtype=mx.float16)
        if not compiled:
            engine.decode_steps = None
        engine.submit("a", [3, 1, 4, 1, 5], 5)
        outputs[compiled] = engine.run_until_idle()["a"]
        if compiled:
            assert "float16" in engine.decode_steps.disabled_reason and engine.decode_steps.steps == 0
    assert outputs[True] == outputs[False]


@pytest.mark.parametrize("traditional", [False, True])
def test_the_fused_attention_block_gives_the_eager_steps_outputs(traditional, monkeypatch):
    """The compiled step's attention block as paged row writes, rotated
    queries and the fused kernel (``attend_projected``), in both RoPE
    layouts and over several requests at once: the eager step's tokens and
    log-probabilities."""
    from mlx_attn.serve.compiled_step import _PagedDecodeAttention

    fused = []
    attend = _PagedDecodeAttention.attend_projected

    def counted(self, *args):
        out = attend(self, *args)
        fused.append(out is not None)
        return out

    monkeypatch.setattr(_PagedDecodeAttention, "attend_projected", counted)
    model = tiny_llama(seed=11)
    for layer in model.layers:
        layer.self_attn.rope.traditional = traditional
    rng = np.random.default_rng(12)
    requests = {f"r{i}": (rng.integers(0, 64, int(rng.integers(2, 12))).tolist(), 9, SamplingParams(top_logprobs=2))
                for i in range(4)}

    def engine(compiled):
        made = Engine(model, kv_tokens=96, page_size=4, dtype=mx.float32)
        if not compiled:
            made.decode_steps = None
        return made

    eager, compiled_engine = serve(engine(False), requests), engine(True)
    compiled = serve(compiled_engine, requests)
    assert compiled_engine.decode_steps.steps > 0 and fused and all(fused)
    for rid in requests:
        assert [t for t, _, _ in compiled[rid]] == [t for t, _, _ in eager[rid]], rid
        assert_same_logprobs([lp for _, lp, _ in compiled[rid]], [lp for _, lp, _ in eager[rid]], atol=1e-5)


def test_copy_on_write_updates_the_pool_in_place():
    """Copying a page holds one page's rows more, never a second pool."""
    store = PagedKVStore(256, 16, n_layers=4, n_kv_heads=2, head_dim=64, dtype=mx.float32)
    store.keys = [mx.random.normal(k.shape) for k in store.keys]
    mx.eval(store.keys, store.values)
    before = [np.array(k[3]) for k in store.keys]
    layer_bytes = store.keys[0].nbytes
    mx.reset_peak_memory()
    active = mx.get_active_memory()
    store.copy([(3, 7), (3, 9)])
    mx.eval(store.keys, store.values)
    assert mx.get_peak_memory() - active < layer_bytes // 4
    for k, page in zip(store.keys, before):
        np.testing.assert_array_equal(np.array(k[7]), page)
        np.testing.assert_array_equal(np.array(k[9]), page)
