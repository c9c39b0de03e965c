"""The serving engine on cascade attention: shared-prefix groups from the
step's block tables (page ids the prefix cache handed out), the rule, and
engine outputs with the cascade on equal to the cascade off (greedy tokens
identical, logits within float32 rounding) over shared system prompts, ``n``
> 1 choices, prefix-cache hits and preemption; the ``--cascade`` flag."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_attn import _native
from mlx_attn.serve import CascadeRule, Engine, SamplingParams
from mlx_attn.serve import engine as engine_module
from mlx_attn.serve.cascade_groups import DEFAULT_CASCADE_RULE, shared_prefix_groups
from model_fixtures import assert_same_logprobs

ANY_SHARED_PAGE = CascadeRule(min_saved_keys=1, max_query_rows=1000)  # any 2+ sequences over one full page


# ---------------------------------------------------------------- the groups
def test_groups_come_from_shared_page_ids():
    system = [7, 8, 9]  # three pages every sequence holds
    tables = [system + [20, 21], system + [30], system + [40, 41, 42], [50, 51], [60]]
    levels = shared_prefix_groups(tables, [4 * len(t) for t in tables], 4, ANY_SHARED_PAGE)
    assert levels.prefix_groups.tolist() == [0, 0, 0, -1, -1]
    assert levels.prefix_table.tolist() == [system] and levels.prefix_lens.tolist() == [12]
    assert levels.block_table.tolist() == [[20, 21, -1], [30, -1, -1], [40, 41, 42], [50, 51, -1], [60, -1, -1]]


def test_groups_take_the_partition_that_saves_most():
    # all share page 1; choices a, b, c of one request share 9 more pages; d, e one more
    question = list(range(100, 109))
    tables = [[1] + question + [200 + i] for i in range(3)] + [[1, 2, 300], [1, 2, 301]]
    kv = [4 * len(t) for t in tables]
    levels = shared_prefix_groups(tables, kv, 4, ANY_SHARED_PAGE)
    # (3 - 1) * 10 + (2 - 1) * 2 pages beat (5 - 1) * 1 page
    assert levels.prefix_groups.tolist() == [0, 0, 0, 1, 1]
    assert levels.prefix_lens.tolist() == [40, 8]
    assert levels.prefix_table[0].tolist() == [1] + question and levels.prefix_table[1, :2].tolist() == [1, 2]
    # one long shared page run for all beats the subgroups
    tables = [list(range(10)) + [50 + i] for i in range(4)]
    levels = shared_prefix_groups(tables, [44] * 4, 4, ANY_SHARED_PAGE)
    assert levels.prefix_groups.tolist() == [0, 0, 0, 0] and levels.prefix_lens.tolist() == [40]


def test_groups_share_only_pages_every_member_computed():
    # the second sequence has computed 5 keys: only its first page may be shared
    levels = shared_prefix_groups([[3, 4, 5], [3, 4]], [12, 5], 4, ANY_SHARED_PAGE)
    assert levels.prefix_lens.tolist() == [4] and levels.block_table.tolist() == [[4, 5], [4, -1]]
    assert shared_prefix_groups([[3, 4], [3, 4]], [3, 3], 4, ANY_SHARED_PAGE) is None  # no full page yet
    assert shared_prefix_groups([[3, 4]], [8], 4, ANY_SHARED_PAGE) is None  # one sequence
    assert shared_prefix_groups([[3, 4], [5, 4]], [8, 8], 4, ANY_SHARED_PAGE) is None  # page 4 is not leading


def test_the_rule_keeps_only_groups_that_pay():
    tables = [[1, 2, 3, 4, 10 + i] for i in range(4)]
    kv = [20] * 4
    assert shared_prefix_groups(tables, kv, 4, CascadeRule(min_saved_keys=3 * 16)) is not None
    assert shared_prefix_groups(tables, kv, 4, CascadeRule(min_saved_keys=3 * 16 + 1)) is None
    assert CascadeRule(1).pays(2, 1) and not CascadeRule(1).pays(1, 100) and not CascadeRule(1).pays(5, 0)
    # the default (docs/paged.md): 2 sequences over 256 keys and 16 over 64 pay, 2 over 64 and 16 over 16 do not
    assert DEFAULT_CASCADE_RULE.pays(2, 256) and DEFAULT_CASCADE_RULE.pays(16, 64)
    assert not DEFAULT_CASCADE_RULE.pays(2, 64) and not DEFAULT_CASCADE_RULE.pays(16, 16)
    for bad in (0, -3, 1.5, True):
        with pytest.raises(ValueError, match="min_saved_keys"):
            CascadeRule(min_saved_keys=bad)
        with pytest.raises(ValueError, match="max_query_rows"):
            CascadeRule(min_saved_keys=1, max_query_rows=bad)
    # a prefill chunk joins no group by default: its rows share each page read in the tile already
    q_lens = [1, 1, 1, 1, 7]
    levels = shared_prefix_groups(tables + [[1, 2, 3, 4, 99]], kv + [20], 4, CascadeRule(16), q_lens)
    assert levels.prefix_groups.tolist() == [0, 0, 0, 0, -1]


# ---------------------------------------------------------------- the engine, on against off
class RecordingModel:
    """The engine's model, keeping every step's logits (float32 NumPy)."""

    def __init__(self, model):
        self.model, self.logits = model, []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, tokens, *, attention):
        out = self.model(tokens, attention=attention)
        self.logits.append(np.array(out.astype(mx.float32)))
        return out


def serve_with_choices(model, cascade, *, kv_bits=None, kv_tokens=64, budget=12, seed=1):
    """A shared system prompt (4 pages of 4) under 5 questions, a prompt
    submitted again (a prefix-cache hit), and ``n`` = 3 choices submitted
    once the first has its first token (as the server does): greedy tokens,
    the logits of every step, each step's groups and the engine."""
    engine = Engine(model, kv_tokens=kv_tokens, page_size=4, max_batch_tokens=budget, dtype=mx.float32,
                    kv_bits=kv_bits, group_size=32, cascade=cascade, cascade_rule=ANY_SHARED_PAGE)
    engine.model = RecordingModel(engine.model)
    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    system = rng.integers(0, vocab, 16).tolist()
    prompts = {f"q{i}": system + rng.integers(0, vocab, int(rng.integers(1, 7))).tolist() for i in range(5)}
    choice_prompt = system + rng.integers(0, vocab, 9).tolist()
    top = SamplingParams(top_logprobs=3)
    for rid, prompt in prompts.items():
        engine.submit(rid, prompt, 6, sampling=top)
    engine.submit("n0", choice_prompt, 14, sampling=top)  # the choices outlive the questions
    out: dict = {}
    steps_groups = []
    real_schedule = engine.scheduler.schedule

    def schedule():
        plan = real_schedule()
        steps_groups.append([row.request_id for row in plan.rows])
        return plan

    engine.scheduler.schedule = schedule
    for step in range(400):
        if engine.idle:
            break
        for o in engine.step():
            out.setdefault(o.request_id, []).append((o.token, o.logprob, o.top_logprobs))
            if o.request_id == "n0" and len(out["n0"]) == 1:  # its prompt is in the pages: the other choices
                engine.submit("n1", choice_prompt, 14, sampling=top)
                engine.submit("n2", choice_prompt, 14, sampling=top)
            if o.request_id == "q0" and o.finished:
                engine.submit("q0-again", prompts["q0"], 4, sampling=top)
        engine.scheduler.check_invariants()
    assert engine.idle, "the engine did not finish"
    return out, engine


def recorded_groups(monkeypatch):
    """Each call of the engine's grouping: its block tables and result."""
    calls = []
    real = engine_module.shared_prefix_groups

    def recording(tables, kv_lens, page_size, rule, q_lens=None):
        levels = real(tables, kv_lens, page_size, rule, q_lens)
        calls.append((list(tables), levels))
        return levels

    monkeypatch.setattr(engine_module, "shared_prefix_groups", recording)
    return calls


def assert_same_outputs(on, off, engine_on, engine_off, logit_rtol=2e-6):
    assert set(on) == set(off)
    for rid in off:
        assert [t for t, _, _ in on[rid]] == [t for t, _, _ in off[rid]], rid  # greedy tokens identical
        assert_same_logprobs([lp for _, lp, _ in on[rid]], [lp for _, lp, _ in off[rid]], atol=1e-5)
        assert [[t for t, _ in top] for _, _, top in on[rid]] == [[t for t, _ in top] for _, _, top in off[rid]]
    logits_on, logits_off = engine_on.model.logits, engine_off.model.logits
    assert len(logits_on) == len(logits_off)  # the same steps
    for a, b in zip(logits_on, logits_off):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=0, atol=logit_rtol * max(1.0, float(np.abs(b).max(initial=0.0))))
    # the cascade changes no page: the same schedule, hits, copies, preemptions, nothing held at the end
    assert engine_on.stats() == engine_off.stats()
    assert engine_on.pool.held_pages == 0 and engine_off.pool.held_pages == 0


@pytest.mark.skipif(_native.ext is None, reason="the cascade runs the fused CPU paged kernel")
@pytest.mark.parametrize("kv_tokens", [64, 128])
def test_engine_with_cascade_equals_without(monkeypatch, kv_tokens):
    """16 pages: preemption and eviction; 32 pages: every request fits, the
    ``n`` = 3 choices keep their whole prompt shared."""
    from test_serve_engine import tiny_llama

    model = tiny_llama(seed=2)
    calls = recorded_groups(monkeypatch)
    on, engine_on = serve_with_choices(model, True, kv_tokens=kv_tokens)
    monkeypatch.undo()
    off, engine_off = serve_with_choices(model, False, kv_tokens=kv_tokens)
    assert engine_on.cascade_steps > 0 and engine_off.cascade_steps == 0
    assert_same_outputs(on, off, engine_on, engine_off)
    stats = engine_on.stats()
    assert stats["cached_prompt_tokens"] > 0
    grouped = [(tables, levels) for tables, levels in calls if levels is not None]
    # sequences sharing only the system prompt grouped over its 4 pages
    assert any((levels.prefix_lens == 16).any() for _, levels in grouped)
    if kv_tokens == 64:
        assert stats["preemptions"] > 0 and stats["evictions"] > 0
    else:
        # the choices, alone at the end, one group over their prompt's 6 full pages (past the system prompt)
        assert stats["preemptions"] == 0
        assert any(levels.prefix_lens.tolist() == [24] and (levels.prefix_groups == 0).sum() == 3
                   for _, levels in grouped), "the n = 3 choices were never one group over their whole prompt"
    for tables, levels in grouped:  # a group's prefix is its members' leading pages
        for b, g in enumerate(levels.prefix_groups):
            if g >= 0:
                pages = levels.prefix_lens[g] // 4
                assert list(tables[b][:pages]) == levels.prefix_table[g, :pages].tolist()
                own = [p for p in levels.block_table[b] if p >= 0]
                assert list(tables[b][pages:]) == own


@pytest.mark.skipif(_native.ext is None, reason="the cascade runs the fused CPU paged kernel")
def test_engine_with_cascade_equals_without_on_quantized_pages():
    from test_serve_engine import tiny_llama

    model = tiny_llama(seed=5, head_dim=32)
    on, engine_on = serve_with_choices(model, True, kv_bits=8, kv_tokens=96, seed=3)
    off, engine_off = serve_with_choices(model, False, kv_bits=8, kv_tokens=96, seed=3)
    assert engine_on.cascade_steps > 0
    assert_same_outputs(on, off, engine_on, engine_off)


@pytest.mark.skipif(_native.ext is None, reason="the cascade runs the fused CPU paged kernel")
def test_engine_with_cascade_on_sliding_window_layers():
    """Gemma 3's 5-key windows end inside and past the 16-key shared prompt:
    rows the window keeps from the prefix go direct, the rest cascade."""
    from test_gemma3 import tiny_gemma

    model = tiny_gemma(seed=4)
    on, engine_on = serve_with_choices(model, True, kv_tokens=96, seed=4)
    off, engine_off = serve_with_choices(model, False, kv_tokens=96, seed=4)
    assert engine_on.cascade_steps > 0
    assert_same_outputs(on, off, engine_on, engine_off)


def test_engine_cascade_arguments():
    from test_serve_engine import tiny_llama

    model = tiny_llama()
    with pytest.raises(ValueError, match="cascade must be"):
        Engine(model, kv_tokens=64, page_size=4, cascade="on")
    with pytest.raises(ValueError, match="cascade_rule"):
        Engine(model, kv_tokens=64, page_size=4, cascade_rule=5)
    engine = Engine(model, kv_tokens=64, page_size=4)
    assert engine.cascade is True and engine.cascade_rule == DEFAULT_CASCADE_RULE


# ---------------------------------------------------------------- the flag
@pytest.mark.parametrize("flags, on", [([], True), (["--cascade", "on"], True), (["--cascade", "off"], False)])
def test_serve_cascade_flag_reaches_the_engine(flags, on):
    from model_fixtures import tiny_tokenizer
    from test_serve_engine import tiny_llama

    from mlx_attn.serve.server import build_parser, state_from_args

    args = build_parser().parse_args(["--kv-cache-tokens", "64", "--page-size", "4", *flags])
    state = state_from_args(args, tiny_llama(), tiny_tokenizer())
    try:
        assert state.engine.cascade is on
    finally:
        state.close()


@pytest.mark.parametrize("flags, group", [([], "device"), (["--prefill-group-tokens", "0"], None),
                                          (["--prefill-group-tokens", "16"], 16)])
def test_serve_prefill_group_flag_reaches_the_scheduler(flags, group):
    from model_fixtures import tiny_tokenizer
    from test_serve_engine import tiny_llama

    from mlx_attn.serve.engine import DEFAULT_PREFILL_GROUP_TOKENS
    from mlx_attn.serve.server import build_parser, state_from_args

    if group == "device":  # grouped on the CPU, where a step's cost grows with its rows; one step on a GPU
        group = DEFAULT_PREFILL_GROUP_TOKENS if mx.default_device() == mx.cpu else None
    args = build_parser().parse_args(["--kv-cache-tokens", "64", "--page-size", "4", *flags])
    state = state_from_args(args, tiny_llama(), tiny_tokenizer())
    try:
        assert state.engine.scheduler.prefill_group_tokens == group
    finally:
        state.close()


def test_bad_cascade_flag_is_a_one_line_error(capsys):
    from mlx_attn.lm.cli import main as cli_main

    assert cli_main(["serve", "--cascade", "maybe"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--cascade" in err and len(err.splitlines()) == 1
