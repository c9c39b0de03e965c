"""mlx-lm's model classes on the serving engine's paged path
(mlx_attn/serve/mlx_lm_paged.py).

Tiny random-weight checkpoints written with mlx-lm's own classes (the
helpers of test_mlx_lm_models.py). Through the engine, every request of a
mixed batch (different prompt lengths, shared prefixes, a duplicate prompt,
chunked prefill) gives mlx-lm's own ``generate_step`` greedy tokens for that
prompt alone; a prefix-cache hit gives the tokens of a miss; the page
accounting holds after every step. Without mlx-lm these tests skip, except
on CI, where they fail."""

import re

import mlx.core as mx
import numpy as np
import pytest

from test_mlx_lm_models import ARCHITECTURES, _require_mlx_lm, write_checkpoint

_require_mlx_lm()

from mlx_lm.generate import generate_step as mlx_lm_generate_step  # noqa: E402
import mlx_lm.models.cache as mlx_lm_cache  # noqa: E402
import mlx_lm.utils  # noqa: E402

from mlx_attn.lm import mlx_lm_models  # noqa: E402
from mlx_attn.serve import Engine  # noqa: E402
from mlx_attn.serve.mlx_lm_paged import UnsupportedForServing  # noqa: E402

# gpt_oss: sinks and a window; mistral, gemma3_text and others: windows; qwen3_moe and others: experts;
# gemma3, mistral3: a text_config wrapper
SERVED = ["llama3", "qwen3", "gpt_oss", "mistral_sliding", "gemma3_text", "qwen2", "phi3", "qwen3_moe", "olmo2",
          "smollm3", "granite", "granitemoe", "ministral3", "mistral3", "gemma3", "llama4_text", "glm4", "glm4_moe",
          "exaone4", "cohere2", "olmo3", "gpt_neox", "starcoder2", "mixtral", "phimoe", "gemma4_text",
          "gemma3n", "qwen3_vl", "minimax", "hunyuan_v1_dense", "bailing_moe", "ernie4_5", "seed_oss", "apertus", "cohere", "phi", "olmoe",
          "qwen2_moe"]
WINDOWS = {"gpt_oss": [8, None], "mistral_sliding": [8, None], "gemma3_text": [8, 8, None], "gemma3": [8, 8, None],
           "ministral3": [8, None], "olmo3": [8, None], "exaone4": [8, 8, 8, None], "cohere2": [8, 8, 8, None],
           "gemma4_text": [8, None], "gemma3n": [8, None]}  # two more layers read these two layers' pages
# pages of each layer's own (KV heads, head dim), where the layers differ
PAGE_SHAPES = {"gemma4_text": [(2, 16), (1, 32)]}
NEW_TOKENS = 6


@pytest.fixture(autouse=True)
def _mlx_lm_attention_between_tests():
    mlx_lm_models.restore_attention()
    yield
    mlx_lm_models.restore_attention()


def mixed_prompts(seed: int = 0) -> dict[str, list[int]]:
    """8 prompts of 1 to 23 tokens (the windows are 8): four share an
    11-token system prefix, one repeats another whole (as n > 1 does)."""
    rng = np.random.default_rng(seed)
    system = rng.integers(3, 64, 11).tolist()
    prompts = {f"r{i}": (system if i % 2 else []) + rng.integers(3, 64, int(rng.integers(1, 13))).tolist()
               for i in range(7)}
    prompts["copy"] = list(prompts["r1"])
    return prompts


def mlx_lm_alone(directory, prompts: dict, max_tokens: int) -> dict[str, list[int]]:
    """mlx-lm's own generate_step (its attention, its caches), one prompt at a time."""
    mlx_lm_models.restore_attention()
    model, _ = mlx_lm.utils.load(str(directory))
    return {rid: [int(t) for t, _ in mlx_lm_generate_step(mx.array(p), model, max_tokens=max_tokens)]
            for rid, p in prompts.items()}


def serve(engine: Engine, prompts: dict, max_tokens: int, max_steps: int = 500) -> dict[str, list[int]]:
    """Submit all, step until idle checking the page accounting after every step."""
    for rid, prompt in prompts.items():
        engine.submit(rid, prompt, max_tokens)
    out: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if engine.idle:
            engine.scheduler.check_invariants()
            assert engine.pool.held_pages == 0
            return out
        for result in engine.step():
            out.setdefault(result.request_id, []).append(result.token)
        engine.scheduler.check_invariants()
    raise AssertionError("the engine did not finish")


@pytest.mark.parametrize("name,bits", [(name, None) for name in SERVED] + [("qwen3", 4), ("qwen3_moe", 4)])
def test_each_request_of_a_mixed_batch_gives_mlx_lm_s_tokens_alone(tmp_path, name, bits):
    directory = write_checkpoint(tmp_path / name, ARCHITECTURES[name], quantize_bits=bits)
    prompts = mixed_prompts()
    expected = mlx_lm_alone(directory, prompts, NEW_TOKENS)
    model, _ = mlx_lm_models.load(directory)
    # 12 pages of 4 tokens for 8 requests of up to 29 tokens: preemption;
    # 10 tokens a step: chunked prefill beside decode rows
    engine = Engine(model, kv_tokens=48, page_size=4, max_batch_tokens=10)
    mlx_lm_models.attention_calls.clear()
    got = serve(engine, prompts, NEW_TOKENS)
    assert got == expected
    assert mlx_lm_models.attention_calls["self-attending"] > 0
    assert set(mlx_lm_models.attention_calls) == {"self-attending"}  # the engine never ran dense attention
    assert engine.scheduler.cached_prompt_tokens > 0  # the shared system prefix and the copy were hits
    assert engine.scheduler.preemptions > 0
    windows = [layer.window_size for layer in engine.model.attention_layers()]
    assert windows == WINDOWS.get(name, [None, None])
    if name in PAGE_SHAPES:
        assert [(k.shape[1], k.shape[3]) for k in engine.store.keys] == PAGE_SHAPES[name]

    # a prefix-cache hit (every whole page of r3 is cached now) gives the miss's tokens
    cached_before = engine.scheduler.cached_prompt_tokens
    again = serve(engine, {"again": prompts["r3"]}, NEW_TOKENS)
    assert engine.scheduler.cached_prompt_tokens - cached_before >= 4 * (len(prompts["r3"]) // 4) - 4
    assert again["again"] == expected["r3"]


def test_quantized_pages_with_sinks_and_a_window_batch_equals_alone(tmp_path):
    """gpt-oss on 8-bit pages: each request of the batch equals it served
    alone on the same quantized pages, and stays near float pages' tokens."""
    directory = write_checkpoint(tmp_path / "oss", ARCHITECTURES["gpt_oss"])
    model, _ = mlx_lm_models.load(directory)
    prompts = mixed_prompts(seed=1)
    options = dict(kv_bits=8, group_size=64)
    engine = Engine(model, kv_tokens=96, page_size=4, max_batch_tokens=10, **options)
    assert engine.store.bits == 8
    got = serve(engine, prompts, NEW_TOKENS)
    for rid, prompt in prompts.items():
        alone = Engine(model, kv_tokens=64, page_size=4, max_batch_tokens=64, **options)
        assert serve(alone, {rid: prompt}, NEW_TOKENS)[rid] == got[rid], rid
    expected = mlx_lm_alone(directory, prompts, NEW_TOKENS)
    agreeing = sum(got[rid][0] == expected[rid][0] for rid in prompts)
    assert agreeing >= 6  # 8-bit K/V barely moves the logits: first tokens (nearly) all agree


def test_gemma_4_on_8_bit_pages_of_two_widths_batch_equals_alone(tmp_path):
    """Gemma 4's layout (KV-shared layers, full-attention layers twice as
    wide) on 8-bit pages: requests of the batch equal them served alone on
    the same pages, and 8-bit K/V keeps mlx-lm's first tokens."""
    config = dict(ARCHITECTURES["gemma4_text"], num_attention_heads=2, head_dim=32, global_head_dim=64)
    directory = write_checkpoint(tmp_path / "g4", config, seed=1)
    model, _ = mlx_lm_models.load(directory)
    prompts = mixed_prompts(seed=1)
    options = dict(kv_bits=8, group_size=32)
    engine = Engine(model, kv_tokens=96, page_size=4, max_batch_tokens=10, **options)
    assert [k[0].shape[3] * 32 // 8 for k in engine.store.keys] == [32, 64]  # packed words back to dims
    got = serve(engine, prompts, NEW_TOKENS)
    for rid in ("r1", "r4"):
        alone = Engine(model, kv_tokens=64, page_size=4, max_batch_tokens=64, **options)
        assert serve(alone, {rid: prompts[rid]}, NEW_TOKENS)[rid] == got[rid], rid
    expected = mlx_lm_alone(directory, prompts, NEW_TOKENS)
    assert sum(got[rid][0] == expected[rid][0] for rid in prompts) >= 6


def test_cascade_attention_gives_mlx_lm_s_tokens_alone(tmp_path):
    """gpt-oss (sinks, a sliding window) with every shared page grouped
    (cascade attention through the mlx-lm seam): mlx-lm's tokens alone."""
    from mlx_attn.serve import CascadeRule

    directory = write_checkpoint(tmp_path / "oss", ARCHITECTURES["gpt_oss"])
    prompts = mixed_prompts(seed=2)
    expected = mlx_lm_alone(directory, prompts, NEW_TOKENS)
    model, _ = mlx_lm_models.load(directory)
    engine = Engine(model, kv_tokens=128, page_size=4, max_batch_tokens=10, cascade_rule=CascadeRule(1))
    assert serve(engine, prompts, NEW_TOKENS) == expected
    assert engine.cascade_steps > 0


def serve_cancelling(engine, prompts, cancelled, at_step=3, check_cancelled=None):
    """Serve `prompts`, cancel `cancelled` at step `at_step`, check the page
    invariants every step; `check_cancelled(cancelled, before_cancel)` runs
    just before and after the cancel. Returns each request's tokens."""
    for rid, prompt in prompts.items():
        engine.submit(rid, prompt, NEW_TOKENS)
    out: dict[str, list[int]] = {}
    for step in range(500):
        if engine.idle:
            break
        if step == at_step:
            if check_cancelled:
                check_cancelled(cancelled, True)
            assert all(engine.cancel(rid) for rid in cancelled)
            if check_cancelled:
                check_cancelled(cancelled, False)
            engine.scheduler.check_invariants()
        for result in engine.step():
            out.setdefault(result.request_id, []).append(result.token)
        engine.scheduler.check_invariants()
    assert engine.idle and engine.pool.held_pages == 0
    return out


def test_cancelling_a_request_frees_its_pages_and_leaves_the_others_exact(tmp_path):
    directory = write_checkpoint(tmp_path / "q", ARCHITECTURES["qwen3"])
    prompts = mixed_prompts(seed=2)
    expected = mlx_lm_alone(directory, prompts, NEW_TOKENS)
    model, _ = mlx_lm_models.load(directory)
    engine = Engine(model, kv_tokens=128, page_size=4, max_batch_tokens=16)
    out = serve_cancelling(engine, prompts, ("r2", "r5"))
    for rid in prompts:
        if rid not in ("r2", "r5"):
            assert out[rid] == expected[rid], rid


# each hybrid's attention layers and how many cache slots it has (a state in each other slot; Falcon-H1's
# layers each hold a state and attention, two slots)
HYBRIDS = {"lfm2": ([1], 3), "qwen3_next": ([1, 3], 4), "qwen3_5": ([1, 3], 4), "qwen3_5_moe": ([1, 3], 4),
           "granitemoehybrid": ([1], 3), "nemotron_h": ([1], 3), "jamba": ([1, 3], 4), "falcon_h1": ([1, 3], 4),
           "lfm2_moe": ([1], 3), "olmo_hybrid": ([3], 4)}


@pytest.mark.parametrize("name", sorted(HYBRIDS))
def test_a_hybrid_model_keeps_a_state_per_request_and_no_prefix_reuse(tmp_path, name, monkeypatch, caplog):
    """Recurrent layers beside paged attention: each request of the mixed
    batch (preemptions, chunked prefill, a duplicate prompt) gives mlx-lm's
    tokens alone; decode rows ran batched (their states merged); no prompt
    token came from the prefix cache, and the engine said so; every state
    is dropped when its request ends."""
    directory = write_checkpoint(tmp_path / name, ARCHITECTURES[name])
    prompts = mixed_prompts()
    expected = mlx_lm_alone(directory, prompts, NEW_TOKENS)
    model, _ = mlx_lm_models.load(directory)
    merged_batches = []
    merge = mlx_lm_cache.ArraysCache.merge.__func__
    monkeypatch.setattr(mlx_lm_cache.ArraysCache, "merge",
                        classmethod(lambda cls, caches: merged_batches.append(len(caches)) or merge(cls, caches)))
    with caplog.at_level("WARNING", logger="mlx_attn.serve.engine"):
        engine = Engine(model, kv_tokens=48, page_size=4, max_batch_tokens=10)
    assert "prefix reuse is off" in caplog.text
    attention_slots, slots = HYBRIDS[name]
    assert engine.model.recurrent_layers == [i for i in range(slots) if i not in attention_slots]
    assert len(engine.model.attention_layers()) == len(attention_slots) == len(engine.store.keys)
    mlx_lm_models.attention_calls.clear()
    got = serve(engine, prompts, NEW_TOKENS)
    assert got == expected
    assert set(mlx_lm_models.attention_calls) == {"self-attending"}
    assert max(merged_batches) > 1  # several requests decoded in one call
    assert engine.scheduler.preemptions > 0
    stats = engine.stats()
    assert stats["prefix_reuse"] == 0 and stats["cached_prompt_tokens"] == 0
    assert len(engine.model.states) == 0


# gathered hybrids (each row alone, decode rows too): dynamic-NTK RoPE; Kimi-Linear's MLA
GATHERED_HYBRIDS = ["qwen3_next_dynamic_rope", "kimi_linear"]


@pytest.mark.parametrize("name", sorted(HYBRIDS) + GATHERED_HYBRIDS)
def test_a_hybrid_model_reuses_prefixes_from_states_saved_at_page_boundaries(tmp_path, name):
    """With ``state_snapshots``, a prompt that begins with cached pages
    resumes from the recurrent state saved at the last of them: the mixed
    batch (shared system prefix, a duplicate, preemption) still equals
    mlx-lm alone, and a later hit gives the miss's tokens."""
    directory = write_checkpoint(tmp_path / name, ARCHITECTURES[name])
    prompts = mixed_prompts()
    expected = mlx_lm_alone(directory, prompts, NEW_TOKENS)
    model, _ = mlx_lm_models.load(directory)
    with pytest.raises(ValueError, match="state_snapshots"):
        Engine(model, kv_tokens=48, page_size=4, state_snapshots=-1)
    engine = Engine(model, kv_tokens=48, page_size=4, max_batch_tokens=10, state_snapshots=64)
    assert bool(engine.model.gathering) == (name in GATHERED_HYBRIDS)
    got = serve(engine, prompts, NEW_TOKENS)
    assert got == expected
    stats = engine.stats()
    assert stats["prefix_reuse"] == 1 and stats["cached_prompt_tokens"] > 0 and stats["state_snapshots"] > 0
    assert engine.scheduler.preemptions > 0
    assert len(engine.model.states) == 0
    cached_before = engine.scheduler.cached_prompt_tokens
    again = serve(engine, {"again": prompts["r3"]}, NEW_TOKENS)
    # every whole page before the last token, resumed from the state saved at its end
    assert engine.scheduler.cached_prompt_tokens - cached_before == 4 * ((len(prompts["r3"]) - 1) // 4)
    assert again["again"] == expected["r3"]


def test_a_hybrid_model_on_8_bit_pages_with_saved_states_batch_equals_alone(tmp_path):
    """lfm2 with head_dim 32 (quantizable in groups of 32) on 8-bit pages,
    resuming prefixes from saved states: each request of the batch equals it
    served alone on the same pages, and 8-bit K/V keeps mlx-lm's first tokens."""
    config = dict(ARCHITECTURES["lfm2"], num_attention_heads=2, num_key_value_heads=1)
    directory = write_checkpoint(tmp_path / "lfm2-hd32", config)
    model, _ = mlx_lm_models.load(directory)
    prompts = mixed_prompts(seed=1)
    options = dict(kv_bits=8, group_size=32)
    engine = Engine(model, kv_tokens=96, page_size=4, max_batch_tokens=10, state_snapshots=16, **options)
    got = serve(engine, prompts, NEW_TOKENS)
    assert engine.stats()["cached_prompt_tokens"] > 0
    for rid, prompt in prompts.items():
        alone = Engine(model, kv_tokens=64, page_size=4, max_batch_tokens=64, **options)
        assert serve(alone, {rid: prompt}, NEW_TOKENS)[rid] == got[rid], rid
    expected = mlx_lm_alone(directory, prompts, NEW_TOKENS)
    assert sum(got[rid][0] == expected[rid][0] for rid in prompts) >= 6


def _repetitive_prompts(seed: int) -> dict[str, list[int]]:
    """Prompts that repeat a loop, so the n-gram drafter finds matches."""
    rng = np.random.default_rng(seed)
    loops = [rng.integers(3, 64, 4 + i).tolist() for i in range(3)]
    return {f"loop{i}": loop * 3 + loop[:2] for i, loop in enumerate(loops)}


def test_a_hybrid_model_does_not_draft_and_says_why(tmp_path, caplog):
    """A recurrent state cannot roll back rejected drafts: under
    ``speculative="ngram"`` a hybrid model's engine drafts nothing, says
    so, and gives mlx-lm's tokens."""
    directory = write_checkpoint(tmp_path / "lfm2", ARCHITECTURES["lfm2"])
    prompts = _repetitive_prompts(3)
    expected = mlx_lm_alone(directory, prompts, 10)
    model, _ = mlx_lm_models.load(directory)
    with caplog.at_level("WARNING", logger="mlx_attn.serve.engine"):
        engine = Engine(model, kv_tokens=128, page_size=4, max_batch_tokens=16, speculative="ngram")
    assert "speculative decoding is off" in caplog.text and "recurrent state" in caplog.text
    assert "roll back" in engine.speculation_refused and not engine.drafts_for()
    assert serve(engine, prompts, 10) == expected
    assert engine.stats()["draft_tokens"] == 0


@pytest.mark.usefixtures("always_draft")
def test_an_attention_only_mlx_lm_model_drafts_and_gives_mlx_lm_s_tokens(tmp_path):
    """The paged mlx-lm path with several logit rows per drafting request:
    greedy tokens still those of mlx-lm alone."""
    directory = write_checkpoint(tmp_path / "qwen3", ARCHITECTURES["qwen3"])
    prompts = _repetitive_prompts(4)
    expected = mlx_lm_alone(directory, prompts, 10)
    model, _ = mlx_lm_models.load(directory)
    engine = Engine(model, kv_tokens=128, page_size=4, max_batch_tokens=16, speculative="ngram")
    assert engine.speculation_refused is None and engine.drafts_for()
    assert serve(engine, prompts, 10) == expected
    assert engine.stats()["draft_tokens"] > 0


def test_serve_takes_state_snapshots_as_a_non_negative_count():
    from mlx_attn.serve.server import build_parser

    assert build_parser().parse_args(["--state-snapshots", "8"]).state_snapshots == 8
    assert build_parser().parse_args([]).state_snapshots == 0
    with pytest.raises(ValueError, match="--state-snapshots: must be a non-negative integer"):
        build_parser().parse_args(["--state-snapshots", "-1"])


def test_cancelling_a_hybrid_request_drops_its_state_and_leaves_the_others_exact(tmp_path):
    directory = write_checkpoint(tmp_path / "lfm2", ARCHITECTURES["lfm2"])
    prompts = mixed_prompts(seed=2)
    expected = mlx_lm_alone(directory, prompts, NEW_TOKENS)
    model, _ = mlx_lm_models.load(directory)
    engine = Engine(model, kv_tokens=128, page_size=4, max_batch_tokens=16)

    def states_held(cancelled, before_cancel):
        if before_cancel:  # r2 is running by step 3; r5 may still wait
            assert cancelled[0] in engine.model.states
        else:
            assert not any(rid in engine.model.states for rid in cancelled)

    out = serve_cancelling(engine, prompts, ("r2", "r5"), check_cancelled=states_held)
    assert len(engine.model.states) == 0
    for rid in prompts:
        if rid not in ("r2", "r5"):
            assert out[rid] == expected[rid], rid


def test_a_model_with_caches_the_engine_cannot_keep_is_refused_naming_why():
    """A cache that is neither attention K/V nor a recurrent state (a ring
    with kept first tokens, counted as cache slot 1 after a layer's
    CacheList is flattened) is refused, not served wrong."""
    import mlx.nn as nn

    class Nested(nn.Module):
        def __init__(self, attention):
            super().__init__()
            self.layers = [nn.Linear(4, 4), nn.Linear(4, 4)]
            self.attention = attention

        def make_cache(self):
            return [mlx_lm_cache.CacheList(mlx_lm_cache.ArraysCache(2), self.attention()), mlx_lm_cache.KVCache()]

    from mlx_attn.serve.server import check_servable

    wrapped = mlx_lm_models.MlxLmModel(Nested(lambda: mlx_lm_cache.RotatingKVCache(8, keep=4)),
                                       {"model_type": "nested", "vocab_size": 64}, "nested")
    with pytest.raises(ValueError, match=r"layer cache 1 is mlx-lm's RotatingKVCache"):
        Engine(wrapped, kv_tokens=64)
    with pytest.raises(UnsupportedForServing, match="RotatingKVCache"):
        check_servable(wrapped)


def test_a_layer_attending_to_keys_no_cache_returned_is_refused():
    """A layer that attends without a cache to keys no cache handed out
    (neither KV sharing nor anything a gathering cache could give it): the
    pages would hold nothing it reads, so the engine refuses it."""
    import mlx.nn as nn

    class Uncached(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(64, 8)
            self.layers = [nn.Linear(8, 64)]

        def make_cache(self):
            return [mlx_lm_cache.KVCache()]

        def __call__(self, inputs, cache=None):
            h = self.embed(inputs)[:, None]  # [B, 1 head, L, 8]
            keys, values = cache[0].update_and_fetch(h, h)
            mask = cache[0].make_mask(h.shape[2])
            out = mlx_lm_models.attention(h, keys, values, cache=cache[0], scale=1.0, mask=mask)
            out = mlx_lm_models.attention(out, out * 2, out, cache=None, scale=1.0, mask=mask)
            return self.layers[0](out[:, 0])

    from mlx_attn.serve.server import check_servable

    wrapped = mlx_lm_models.MlxLmModel(Uncached(), {"model_type": "uncached", "vocab_size": 64}, "uncached")
    with pytest.raises(UnsupportedForServing, match=r"uncached cannot be served on pages: a layer attends without a "
                                                     r"cache of its own, to keys and values no cache returned"):
        Engine(wrapped, kv_tokens=64)
    with pytest.raises(UnsupportedForServing, match="no cache returned"):
        check_servable(wrapped)


# architectures the engine cannot serve, and what the refusal names
REFUSED = {
    "mamba2": r"no attention layer",
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_an_architecture_pages_cannot_serve_is_refused_naming_the_layer(tmp_path, name):
    """A model without attention layers: the engine and the server's start
    refuse it, pointing at `mlx-attn generate` (whose tokens equal mlx-lm's:
    test_mlx_lm_models.py)."""
    from mlx_attn.serve.server import check_servable

    directory = write_checkpoint(tmp_path / name, ARCHITECTURES[name])
    model, _ = mlx_lm_models.load(directory)
    with pytest.raises(UnsupportedForServing, match=REFUSED[name]) as refused:
        Engine(model, kv_tokens=64, page_size=4)
    assert "mlx-attn generate" in str(refused.value)
    with pytest.raises(UnsupportedForServing, match=REFUSED[name]):
        check_servable(model)


def test_mlx_attn_serve_refuses_such_a_model_before_it_starts(tmp_path, capsys):
    """`mlx-attn serve --model DIR` (``--engine auto`` takes mlx-lm's class:
    mlx_attn has no Mamba-2 of its own) exits with the refusal on one line,
    and no server starts."""
    pytest.importorskip("uvicorn")
    from mlx_attn.lm.cli import USAGE_ERROR, main

    directory = write_checkpoint(tmp_path / "mamba2", ARCHITECTURES["mamba2"])
    assert main(["serve", "--model", str(directory), "--port", "1"]) == USAGE_ERROR
    error = capsys.readouterr().err
    assert error.startswith("mlx-attn: error: the model has no attention layer")
    assert "`mlx-attn generate`" in error and error.count("\n") == 1


# architectures the batched paged step cannot run, served one request a call over K/V gathered
# from the pages, and why
GATHERED = {
    "gemma2": r"layer caches 0, 1: its layer computes attention itself",
    "deepseek_v3": r"layer caches 0, 1: its layer attends to keys/values other than those the cache returned",
    "llama_dynamic_rope": r"it cannot run sequences at different positions in one call",
    "llama4": r"layer caches 0, 1, 2: chunked attention",
}


@pytest.mark.parametrize("name", sorted(GATHERED))
def test_a_model_the_paged_step_cannot_run_is_served_over_gathered_kv(tmp_path, name, caplog):
    """Softcapped attention computed by the model (gemma2), multi-head
    latent attention (deepseek_v3), dynamic-NTK RoPE and chunked attention
    with its mask made by the model (llama4): each request of
    the mixed batch (shared prefixes, preemption, chunked prefill) gives
    mlx-lm's tokens alone, a prefix-cache hit the miss's, the pages add up;
    the engine says why it gathers."""
    directory = write_checkpoint(tmp_path / name, ARCHITECTURES[name])
    prompts = mixed_prompts()
    expected = mlx_lm_alone(directory, prompts, NEW_TOKENS)
    model, _ = mlx_lm_models.load(directory)
    with caplog.at_level("WARNING", logger="mlx_attn.serve.mlx_lm_paged"):
        engine = Engine(model, kv_tokens=48, page_size=4, max_batch_tokens=10)
    assert re.search(GATHERED[name], engine.model.gathering)
    assert "over K/V gathered from its pages" in caplog.text
    mlx_lm_models.attention_calls.clear()
    assert serve(engine, prompts, NEW_TOKENS) == expected
    assert "self-attending" not in mlx_lm_models.attention_calls
    assert engine.scheduler.cached_prompt_tokens > 0 and engine.scheduler.preemptions > 0
    cached_before = engine.scheduler.cached_prompt_tokens
    assert serve(engine, {"again": prompts["r3"]}, NEW_TOKENS)["again"] == expected["r3"]
    assert engine.scheduler.cached_prompt_tokens - cached_before >= 4 * (len(prompts["r3"]) // 4) - 4


@pytest.mark.usefixtures("always_draft")
def test_gathered_kv_from_8_bit_pages_with_drafts_batch_equals_alone(tmp_path):
    """gemma2 (head dim 32) on 8-bit pages with n-gram drafts: each request
    of the batch equals it served alone on the same pages (drafted rows'
    logits included), and 8-bit K/V keeps mlx-lm's first tokens."""
    config = dict(ARCHITECTURES["gemma2"], num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    directory = write_checkpoint(tmp_path / "gemma2-hd32", config)
    model, _ = mlx_lm_models.load(directory)
    prompts = _repetitive_prompts(5)
    options = dict(kv_bits=8, group_size=32, speculative="ngram")
    engine = Engine(model, kv_tokens=128, page_size=4, max_batch_tokens=16, **options)
    assert engine.model.gathering and engine.speculation_refused is None
    got = serve(engine, prompts, 10)
    assert engine.stats()["draft_tokens"] > 0
    for rid, prompt in prompts.items():
        alone = Engine(model, kv_tokens=64, page_size=4, max_batch_tokens=64, **options)
        assert serve(alone, {rid: prompt}, 10)[rid] == got[rid], rid
    expected = mlx_lm_alone(directory, prompts, 10)
    assert all(got[rid][0] == expected[rid][0] for rid in prompts)


def test_serve_loads_an_mlx_lm_directory_with_engine_auto_and_mlx_lm(tmp_path):
    from mlx_attn.lm.engine_choice import choose_engine, load_for_engine
    from mlx_attn.serve.server import build_parser

    directory = write_checkpoint(tmp_path / "q", ARCHITECTURES["qwen3"])
    assert build_parser().parse_args(["--model", str(directory), "--engine", "mlx-lm"]).engine == "mlx-lm"
    assert choose_engine("auto", str(directory)) == "mlx-lm"
    model, tokenizer = load_for_engine(str(directory), "auto")
    assert isinstance(model, mlx_lm_models.MlxLmModel)
    engine = Engine(model, kv_tokens=64, page_size=4)
    prompt = tokenizer.encode("w1 w2 w3", add_special_tokens=False)
    assert serve(engine, {"a": prompt}, 4)["a"] == mlx_lm_alone(directory, {"a": prompt}, 4)["a"]


def test_the_server_serves_an_mlx_lm_model_with_n_choices(tmp_path):
    """Through HTTP: a greedy completion is mlx-lm's own greedy text; ``n``
    seeded choices share the prompt's pages and each equals a single
    request; nothing leaks."""
    pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from test_serve_server import MODEL_NAME, serve_model

    directory = write_checkpoint(tmp_path / "q", ARCHITECTURES["qwen3"])
    model, tokenizer = mlx_lm_models.load(directory)
    server = serve_model(model, tokenizer, page_size=4, kv_cache_tokens=256)
    try:
        client = server.client()
        prompt = "w5 w9 w12 w40 w33 w7 w8 w21 w60"
        ids = tokenizer.encode(prompt)
        want = mlx_lm_alone(directory, {"p": ids}, 5)["p"]
        eos = tokenizer.eos_token_ids
        want = want[:next((i + 1 for i, t in enumerate(want) if t in eos), len(want))]
        assert not mlx_lm_models.attention_installed()  # mlx_lm_alone restored mlx-lm's: the engine reinstalls
        greedy = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=5, temperature=0)
        # the word-level test tokenizer decodes one token at a time without spaces, as the server streams
        assert greedy.choices[0].text == "".join(tokenizer.decode([t]) for t in want if t not in eos)
        stats = lambda: server.state.call_blocking(server.state.engine.stats)  # noqa: E731
        before = stats()["cached_prompt_tokens"]
        result = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=5, n=3, temperature=0.9,
                                           seed=11)
        assert stats()["cached_prompt_tokens"] - before >= 3 * 4  # choices found the computed full pages
        single = [client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=5, temperature=0.9,
                                            seed=11 + i).choices[0].text for i in range(3)]
        assert [c.text for c in result.choices] == single
        server.check_pages()
    finally:
        server.stop()


def test_the_server_serves_a_hybrid_model_and_says_prefix_reuse_is_off(tmp_path):
    """lfm2 over HTTP: greedy text is mlx-lm's; ``n`` seeded choices each
    equal a single request (every choice computes the prompt: no shared
    pages); ``/metrics`` reports prefix reuse off."""
    pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from test_serve_server import MODEL_NAME, raw, serve_model

    directory = write_checkpoint(tmp_path / "lfm2", ARCHITECTURES["lfm2"])
    model, tokenizer = mlx_lm_models.load(directory)
    server = serve_model(model, tokenizer, page_size=4, kv_cache_tokens=256)
    try:
        client = server.client()
        prompt = "w5 w9 w12 w40 w33 w7 w8 w21 w60"
        want = mlx_lm_alone(directory, {"p": tokenizer.encode(prompt)}, 5)["p"]
        eos = tokenizer.eos_token_ids
        want = want[:next((i + 1 for i, t in enumerate(want) if t in eos), len(want))]
        greedy = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=5, temperature=0)
        assert greedy.choices[0].text == "".join(tokenizer.decode([t]) for t in want if t not in eos)
        result = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=5, n=2, temperature=0.9,
                                           seed=5)
        single = [client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=5, temperature=0.9,
                                            seed=5 + i).choices[0].text for i in range(2)]
        assert [c.text for c in result.choices] == single
        status, metrics = raw(server, "GET", "/metrics")
        assert status == 200
        assert "\nmlx_attn_prefix_reuse_enabled 0\n" in metrics
        assert "\nmlx_attn_prefix_cache_hit_rate 0.0\n" in metrics
        server.check_pages()
        assert server.state.call_blocking(lambda: len(server.state.engine.model.states)) == 0
    finally:
        server.stop()
