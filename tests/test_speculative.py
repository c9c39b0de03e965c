"""Lossless speculative decoding (mlx_attn.lm.speculative) in generation:
greedy outputs token for token those without drafts, sampled outputs
distributed exactly as the plain sampler's (chi-square), rejected drafts'
K/V trimmed."""

import math

import mlx.core as mx
import numpy as np
import pytest

from mlx_attn.lm.generate import GenerationConfig, generate_tokens, speculative_steps
from mlx_attn.lm.sampling import apply_repetition_penalty, filtered_logprobs
from mlx_attn.lm.speculative import DraftLength, penalized_rows, verify_drafts
from model_fixtures import tiny_llama

REPETITIVE = [5, 6, 7, 8, 9, 10, 11, 12] * 4 + [5, 6, 7]


def _speculative_run(model, prompt, config):
    length = DraftLength(config.num_draft_tokens)
    cache = model.make_cache()
    tokens = [t for t, _ in speculative_steps(model, prompt, config, cache, length)]
    return tokens, length, cache


@pytest.mark.parametrize("prompt", [REPETITIVE, [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]], ids=["repetitive", "random"])
@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.usefixtures("always_draft")
def test_greedy_tokens_identical_with_and_without_drafts(prompt, k):
    model = tiny_llama(seed=3)
    plain = list(generate_tokens(model, prompt, GenerationConfig(max_tokens=40, stop_at_eos=False)))
    config = GenerationConfig(max_tokens=40, stop_at_eos=False, speculative="ngram", num_draft_tokens=k)
    drafted, length, cache = _speculative_run(model, prompt, config)
    assert drafted == plain
    assert length.accepted > 0, "no draft was ever accepted: the test would not exercise verification"
    # the cache holds the prompt and every generated token but the last (never fed back)
    assert cache[0].offset == len(prompt) + len(plain) - 1
    via_config = list(generate_tokens(model, prompt, config))
    assert via_config == plain


@pytest.mark.usefixtures("always_draft")
def test_drafts_that_are_rejected_leave_the_cache_exact():
    # a random model rejects most drafts of a repetitive prompt it does not continue
    model = tiny_llama(seed=11)
    config = GenerationConfig(max_tokens=24, stop_at_eos=False, speculative="ngram", num_draft_tokens=6)
    tokens, length, cache = _speculative_run(model, REPETITIVE, config)
    assert length.proposed > length.accepted, "no draft was rejected"
    seq = REPETITIVE + tokens
    full = model(mx.array([seq[:-1]]))[0]
    # the next token from the trimmed cache equals recomputing the whole sequence
    nxt = model(mx.array([[seq[-1]]]), cache=cache)[0, -1]
    ref = model(mx.array([seq]))[0, -1]
    np.testing.assert_allclose(np.array(nxt), np.array(ref), atol=1e-4)
    assert tokens == [int(t) for t in mx.argmax(full[len(REPETITIVE) - 1:], axis=-1).tolist()]


def test_greedy_with_repetition_penalty_identical():
    model = tiny_llama(seed=5)
    base = dict(max_tokens=30, stop_at_eos=False, repetition_penalty=1.3, repetition_context=8)
    plain = list(generate_tokens(model, REPETITIVE, GenerationConfig(**base)))
    drafted = list(generate_tokens(model, REPETITIVE, GenerationConfig(**base, speculative="ngram")))
    assert drafted == plain


@pytest.mark.usefixtures("always_draft")
def test_a_rotating_cache_drafts_until_its_window_slides():
    model = tiny_llama(seed=3)
    base = dict(max_tokens=30, stop_at_eos=False, max_kv_size=48)
    plain = list(generate_tokens(model, REPETITIVE, GenerationConfig(**base)))
    config = GenerationConfig(**base, speculative="ngram")
    cache = model.make_cache(48)
    length = DraftLength(config.num_draft_tokens)
    drafted = [t for t, _ in speculative_steps(model, REPETITIVE, config, cache, length)]
    assert drafted == plain
    assert length.accepted > 0 and cache[0].offset > 48  # drafted early, then slid past the window


@pytest.mark.usefixtures("always_draft")
def test_seeded_speculative_sampling_is_reproducible():
    """Each kept token is drawn as without drafts: the seeded tokens are
    those of plain sampling, whatever the (timing-dependent) drafts were."""
    model = tiny_llama()
    config = GenerationConfig(max_tokens=20, temperature=1.0, seed=7, speculative="ngram", stop_at_eos=False)
    length = DraftLength(config.num_draft_tokens)
    drafted = [t for t, _ in speculative_steps(model, REPETITIVE, config, model.make_cache(), length)]
    assert length.proposed > 0
    assert drafted == list(generate_tokens(model, REPETITIVE, config))
    plain = GenerationConfig(max_tokens=20, temperature=1.0, seed=7, stop_at_eos=False)
    assert drafted == list(generate_tokens(model, REPETITIVE, plain))


def test_refused_settings_name_the_field():
    with pytest.raises(ValueError, match="speculative"):
        GenerationConfig(speculative="medusa")
    with pytest.raises(ValueError, match="num_draft_tokens"):
        GenerationConfig(speculative="ngram", num_draft_tokens=0)
    from mlx_attn.lm.distributed_generate import check_distributed_config

    with pytest.raises(ValueError, match="speculative"):
        check_distributed_config(GenerationConfig(speculative="ngram"))


# ---------------------------------------------------------------- the distribution
VOCAB = 8


def _chi_square_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's chi-square goodness of fit (categories with expected count
    >= 5), its p-value by the Wilson-Hilferty normal approximation."""
    expected = probs * counts.sum()
    keep = expected >= 5
    statistic = float((((counts - expected) ** 2)[keep] / expected[keep]).sum()) + 0.0
    dof = int(keep.sum()) - 1
    z = ((statistic / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def shifted_by_two_percent(probs: np.ndarray) -> np.ndarray:
    """``probs`` with 2 % of probability moved from the likeliest token to the next."""
    shifted = probs.copy()
    shifted[np.argmax(shifted)] -= 0.02
    shifted[np.argsort(shifted)[-2]] += 0.02
    return shifted


def assert_draft_rule_keeps_p(first, second, first_kept: int, draws: int, p: np.ndarray, q: np.ndarray) -> None:
    """Tokens kept by the min(1, p/q) rule at the first and second draft
    position follow the target's p (and a 2 % shift of p is told apart);
    the first draft is kept with probability sum min(p, q)."""
    assert _chi_square_p_value(first, p[0]) > 1e-3
    assert _chi_square_p_value(second, p[1]) > 1e-3
    assert _chi_square_p_value(first, shifted_by_two_percent(p[0])) < 1e-3
    overlap = np.minimum(p[0], q[0]).sum()
    assert abs(first_kept / draws - overlap) < 4 * np.sqrt(overlap * (1 - overlap) / draws)


def _target_probabilities(rows, params):
    """Each row's distribution as the plain sampler draws from it."""
    p = np.exp(np.array(filtered_logprobs(rows, **params)))
    return p / p.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_verification_keeps_the_target_distribution(temperature):
    """Many verifications of fixed logits: the first kept token follows row
    0's filtered distribution and, when it was the draft, the second follows
    row 1's; with top-k, top-p, min-p and a repetition penalty on. Enough
    draws that a 2 % shift of probability would fail (see the power check)."""
    rng = np.random.default_rng(0)
    logits = mx.array(rng.normal(0, 1.5, size=(3, VOCAB)).astype(np.float32))
    history, drafts = [1, 2, 2], [2, 5]
    params = dict(temperature=temperature, top_k=6, top_p=0.95, min_p=0.02)
    rows = penalized_rows(logits, history, drafts, 1.2, None)
    p = _target_probabilities(rows, params)
    mx.random.seed(1)
    draws = 6000
    first = np.zeros(VOCAB)
    second = np.zeros(VOCAB)
    for _ in range(draws):
        kept = verify_drafts(rows, drafts, **params)
        first[kept[0]] += 1
        if kept[0] == drafts[0]:
            second[kept[1]] += 1
    assert _chi_square_p_value(first, p[0]) > 1e-3
    assert _chi_square_p_value(second, p[1]) > 1e-3
    # power: a distribution moved by 2 % of probability mass is refused with these counts
    assert _chi_square_p_value(first, shifted_by_two_percent(p[0])) < 1e-3
    assert second.sum() > draws * p[0][drafts[0]] * 0.9  # acceptance happens at the draft's probability


def test_penalized_rows_apply_the_penalty_over_history_and_earlier_drafts():
    logits = mx.array(np.linspace(-2, 2, 3 * VOCAB, dtype=np.float32).reshape(3, VOCAB))
    rows = penalized_rows(logits, [1], [4, 6], 1.5, context=2)
    for i, seen in enumerate([[1], [1, 4], [4, 6]]):
        np.testing.assert_allclose(np.array(rows[i]), np.array(apply_repetition_penalty(logits[i], seen, 1.5)))


@pytest.mark.usefixtures("always_draft")
def test_draft_length_adapts_to_acceptance():
    length = DraftLength(8)
    assert length.next() == 8
    for _ in range(10):
        length.record(8, 0)
    assert length.next() == 1
    for _ in range(30):
        length.record(length.next(), length.next())
    assert length.next() == 8
    assert length.proposed > length.accepted > 0


def test_draft_length_observes_drafts_it_did_not_propose():
    length = DraftLength(8, min_keep=0.25, memory=0.8)
    length.rate = 0.3
    assert length.next() == 1
    length.observe(True)  # one observation weighs 1 - memory, as one tested draft does in record
    assert length.rate == pytest.approx(0.8 * 0.3 + 0.2)
    for _ in range(20):
        length.observe(True)
    assert length.next() == 8 and length.rate > 0.98
    for _ in range(20):
        length.observe(False)
    assert length.next() == 1 and length.rate < 0.02
    assert length.proposed == length.accepted == 0  # nothing was proposed


# ---------------------------------------------------------------- the command
def test_cli_speculative_ngram_prints_the_same_text(capsys):
    from mlx_attn.lm.cli import main as cli_main

    prompt = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"
    outputs = []
    for flags in ([], ["--speculative", "ngram", "--num-draft-tokens", "5"]):
        assert cli_main(["generate", "--prompt", prompt, "-m", "24", "--quiet", "--ignore-chat-template",
                         *flags]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and outputs[0].strip()
    assert cli_main(["generate", "x", "--speculative", "ngram", "--num-draft-tokens", "0"]) == 2
    err = capsys.readouterr().err
    assert "--num-draft-tokens" in err and "Traceback" not in err


def test_step_cost_fits_the_measured_line_and_backs_off_when_compute_bound():
    from mlx_attn.lm.speculative import StepCost

    memory_bound, compute_bound = StepCost(), StepCost()
    assert memory_bound.fit() == (1.0, 0.02)  # the prior before any step
    for rows in [1, 2, 5, 9, 16, 3, 7, 12] * 3:
        memory_bound.record(rows, 0.100 + 0.001 * rows)
        compute_bound.record(rows, 0.010 + 0.050 * rows)
    fixed, per_row = memory_bound.fit()
    assert fixed == pytest.approx(0.100, rel=1e-6) and per_row == pytest.approx(0.001, rel=1e-6)
    # 16 decode rows: a draft kept one time in three pays on a memory-bound step, not on a compute-bound one
    assert memory_bound.worth(0.33, decode_rows=16, rows=16)
    assert not compute_bound.worth(0.33, decode_rows=16, rows=16)
    assert not compute_bound.worth(0.9, decode_rows=16, rows=16)
    assert compute_bound.worth(0.9, decode_rows=1, rows=1)  # one request: a likely draft still pays
    constant = StepCost()
    for _ in range(20):
        constant.record(4, 0.2)  # no spread of rows: the slope is the prior's
    assert constant.fit()[1] == pytest.approx(0.02 * constant.fit()[0])


def test_drafts_must_beat_the_compiled_plain_step():
    """PlainStepCost: a drafting step (eager, 20 ms + 1 ms a row here) pays
    only if its expected tokens per second beat the plain step's (10 ms)."""
    from mlx_attn.lm.generate import PlainStepCost
    from mlx_attn.lm.speculative import StepCost

    eager = StepCost()
    for rows in (1, 2, 3, 4, 5) * 4:
        eager.record(rows, 0.020 + 0.001 * rows)
    plain = PlainStepCost(forward=lambda tokens: None)
    assert plain.beaten_by(eager, 0.1, 1)  # the plain step not measured yet: draft and measure
    plain.record(0.010)
    assert not plain.beaten_by(eager, 0.1, 1)  # 1.1 tokens in 22 ms < 1 token in 10 ms
    assert not plain.beaten_by(eager, 0.5, 4)  # ~1.94 tokens in 25 ms
    assert plain.beaten_by(eager, 1.0, 4)  # 5 tokens in 25 ms
    assert PlainStepCost(forward=None).beaten_by(eager, 0.1, 1)  # no compiled step: the eager rule alone


def test_plain_steps_of_one_row_count_borrow_the_measured_slope():
    """Plain (compiled) steps measured at one row count only (a single
    request; shared-prefix batches run the eager path): a row costs what the
    eager steps measured (the same products), not the prior's 2 % of the
    fixed cost, so four requests' drafts are judged against a plain step of
    four rows at its real cost."""
    from mlx_attn.lm.speculative import StepCost

    eager, plain = StepCost(), StepCost()
    for rows in (1, 2, 4, 8, 5, 3) * 4:
        eager.record(rows, 0.020 + 0.010 * rows)
    for _ in range(20):
        plain.record(1, 0.025)
    assert not plain.has_slope() and eager.has_slope()
    # 12 drafts kept 9 times in 10: 14.8 tokens in 180 ms beat 4 tokens in a plain step of 15 + 4 * 10 ms
    assert eager.drafting_beats(plain, 4 + 12 * 0.9, decode_rows=4, rows=4, drafts=12)
    assert not eager.drafting_beats(plain, 4 + 12 * 0.3, decode_rows=4, rows=4, drafts=12)
    fitted_plain = StepCost()
    for rows in (1, 2, 4, 8, 5, 3) * 4:
        fitted_plain.record(rows, 0.005 + 0.002 * rows)
    # plain steps with a slope of their own keep it: 4 rows in 13 ms beat the drafts
    assert not eager.drafting_beats(fitted_plain, 4 + 12 * 0.9, decode_rows=4, rows=4, drafts=12)


@pytest.mark.usefixtures("always_draft")
def test_greedy_plain_steps_queued_ahead_hand_over_to_drafting_exactly(monkeypatch):
    """Greedy steps without drafts queue the next plain step before reading
    their token (as generate_step does); when the drafter has a proposal
    again the queued step runs first and drafting resumes one token late.
    A drafter right at some places and wrong at others: the tokens are
    those without drafts, the cache holds exactly them, and both the queued
    plain steps and the drafts ran."""
    import importlib

    generate_module = importlib.import_module("mlx_attn.lm.generate")
    model = tiny_llama(seed=3)
    prompt = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
    plain = list(generate_tokens(model, prompt, GenerationConfig(max_tokens=40, stop_at_eos=False)))

    class ScriptedDrafter:
        def propose(self, history, count):
            produced = len(history) - len(prompt)
            if 5 <= produced < 8 or 12 <= produced < 16 or 20 <= produced < 23:
                return plain[produced:produced + count]
            if 9 <= produced < 11:
                return [(t + 1) % 256 for t in plain[produced:produced + count]]
            return []

    queued = []
    greedy_token = generate_module._greedy_token
    monkeypatch.setattr(generate_module, "NgramDrafter", ScriptedDrafter)
    monkeypatch.setattr(generate_module, "_greedy_token", lambda *a: queued.append(1) or greedy_token(*a))
    config = GenerationConfig(max_tokens=40, stop_at_eos=False, speculative="ngram", num_draft_tokens=3)
    drafted, length, cache = _speculative_run(model, prompt, config)
    assert drafted == plain
    assert length.accepted > 0 and length.proposed > length.accepted  # kept and refused drafts both
    assert len(queued) > 10  # plain steps went through the queued path
    assert cache[0].offset == len(prompt) + len(plain) - 1
