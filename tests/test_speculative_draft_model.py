"""Speculative decoding with a draft model (``speculative="draft"``,
``mlx-attn generate --speculative draft --draft-model``): greedy outputs
token for token those without drafts, both KV caches exact after
rejections, and verification against the draft's own distribution ``q``
(accept with ``min(1, p/q)``) keeps the target distribution (chi-square)."""

import numpy as np
import pytest

import mlx.core as mx
from mlx.utils import tree_map

from mlx_attn.lm.generate import GenerationConfig, _DraftModelState, draft_model_steps, generate_tokens
from mlx_attn.lm.sampling import filtered_logprobs
from mlx_attn.lm.speculative import DraftLength, verify_drafts
from model_fixtures import tiny_llama
from test_speculative import REPETITIVE, VOCAB, _target_probabilities, assert_draft_rule_keeps_p

RANDOM_PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]


def _perturbed(model, scale: float, seed: int):
    """A copy of ``model`` with noise on every weight: a draft that agrees
    with it often, not always."""
    draft = tiny_llama(seed=3)
    mx.random.seed(seed)
    draft.update(tree_map(lambda w: w + scale * mx.random.normal(w.shape), model.parameters()))
    mx.eval(draft.parameters())
    return draft


def _run_with_cache(model, prompt, config, cache):
    length = DraftLength(config.num_draft_tokens)
    tokens = [t for t, _ in draft_model_steps(model, prompt, config, cache, length)]
    return tokens, length, cache


def _run(model, prompt, config):
    return _run_with_cache(model, prompt, config, model.make_cache())


@pytest.mark.parametrize("draft_kind", ["same", "close", "unrelated"])
@pytest.mark.parametrize("prompt", [REPETITIVE, RANDOM_PROMPT], ids=["repetitive", "random"])
def test_greedy_tokens_identical_with_and_without_a_draft_model(draft_kind, prompt):
    model = tiny_llama(seed=3)
    draft = {"same": lambda: tiny_llama(seed=3), "close": lambda: _perturbed(model, 0.02, 1),
             "unrelated": lambda: tiny_llama(seed=8)}[draft_kind]()
    plain = list(generate_tokens(model, prompt, GenerationConfig(max_tokens=40, stop_at_eos=False)))
    config = GenerationConfig(max_tokens=40, stop_at_eos=False, speculative="draft", draft_model=draft,
                              num_draft_tokens=4)
    drafted, length, cache = _run(model, prompt, config)
    assert drafted == plain
    assert cache[0].offset == len(prompt) + len(plain) - 1  # the last token is never fed back
    if draft_kind == "same":  # the draft model's cache tracks the sequence: it proposes the target's argmax
        assert length.accepted == length.proposed > 0
    else:
        assert length.proposed > length.accepted
    assert list(generate_tokens(model, prompt, config)) == plain


def test_greedy_with_repetition_penalty_identical():
    model = tiny_llama(seed=5)
    base = dict(max_tokens=30, stop_at_eos=False, repetition_penalty=1.3, repetition_context=8)
    plain = list(generate_tokens(model, REPETITIVE, GenerationConfig(**base)))
    config = GenerationConfig(**base, speculative="draft", draft_model=_perturbed(model, 0.02, 2))
    assert list(generate_tokens(model, REPETITIVE, config)) == plain


def test_log_probabilities_are_those_of_decoding_without_drafts():
    from mlx_attn.lm.generate import generate_step

    model = tiny_llama(seed=3)
    base = dict(max_tokens=12, stop_at_eos=False, logprobs=True)
    plain = list(generate_step(model, RANDOM_PROMPT, GenerationConfig(**base)))
    config = GenerationConfig(**base, speculative="draft", draft_model=_perturbed(model, 0.02, 4))
    drafted = list(generate_step(model, RANDOM_PROMPT, config))
    assert [t for t, _ in drafted] == [t for t, _ in plain]
    for (_, ours), (_, theirs) in zip(drafted, plain):
        np.testing.assert_allclose(np.array(ours), np.array(theirs), atol=1e-4)


def test_rotating_caches_draft_until_their_window_slides():
    model = tiny_llama(seed=3)
    base = dict(max_tokens=30, stop_at_eos=False, max_kv_size=48)
    plain = list(generate_tokens(model, REPETITIVE, GenerationConfig(**base)))
    config = GenerationConfig(**base, speculative="draft", draft_model=tiny_llama(seed=3))
    drafted, length, cache = _run_with_cache(model, REPETITIVE, config, model.make_cache(48))
    assert drafted == plain
    assert length.accepted > 0 and cache[0].offset > 48  # drafted early, then slid past the window


@pytest.mark.parametrize("kept", [0, 1, 3])
def test_the_draft_cache_drops_refused_drafts(kept):
    """After proposing 3 drafts of which ``kept`` are accepted, the draft
    model's cache plus its unread tokens are exactly the kept sequence:
    its next logits equal recomputing the whole sequence."""
    draft = tiny_llama(seed=8)
    config = GenerationConfig(max_tokens=10, speculative="draft", draft_model=draft, compiled=False)
    state = _DraftModelState(draft, RANDOM_PROMPT, config)
    drafts, q = state.propose(3, list(RANDOM_PROMPT))
    assert len(drafts) == 3 and q is None  # greedy: no distribution needed
    own = (drafts[kept] + 1) % 97 if kept < 3 else 11  # the target's own token (differs from a refused draft)
    state.accept(drafts, drafts[:kept] + [own])
    sequence = RANDOM_PROMPT + drafts[:kept] + [own]
    assert state.cache[0].offset + len(state.unread) == len(sequence)
    assert state.unread == sequence[state.cache[0].offset:]
    nxt = draft(mx.array([state.unread]), cache=state.cache)[0, -1]
    ref = draft(mx.array([sequence]))[0, -1]
    np.testing.assert_allclose(np.array(nxt), np.array(ref), atol=1e-4)


def test_seeded_sampling_with_a_draft_model_is_reproducible_and_drafts():
    model = tiny_llama(seed=3)
    config = GenerationConfig(max_tokens=24, temperature=0.8, top_p=0.9, seed=11, stop_at_eos=False,
                              speculative="draft", draft_model=_perturbed(model, 0.02, 3))
    first, length, _ = _run(model, REPETITIVE, config)
    second, _, _ = _run(model, REPETITIVE, config)
    assert first == second and len(first) == 24
    assert length.accepted > 0  # a close draft is often kept when sampling too


def test_refused_draft_models_name_the_field():
    with pytest.raises(ValueError, match="draft_model"):
        GenerationConfig(speculative="draft")
    with pytest.raises(ValueError, match="draft_model"):
        GenerationConfig(speculative="ngram", draft_model=tiny_llama())
    other_vocabulary = tiny_llama(seed=1, vocab_size=50)
    config = GenerationConfig(max_tokens=4, speculative="draft", draft_model=other_vocabulary)
    with pytest.raises(ValueError, match="draft_model has a vocabulary of 50 tokens, the model 97"):
        list(generate_tokens(tiny_llama(), [1, 2, 3], config))
    with pytest.raises(ValueError, match="draft_model must be a loaded model"):
        list(generate_tokens(tiny_llama(), [1, 2, 3], GenerationConfig(speculative="draft", draft_model="x.gguf")))


# ---------------------------------------------------------------- the distribution
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_verification_against_the_draft_distribution_keeps_the_target_distribution(temperature):
    """Drafts drawn from a draft distribution q unlike the target's p, then
    verified with min(1, p/q): the first kept token follows row 0's p and,
    when it was the draft, the second follows row 1's; a draft is kept with
    probability sum min(p, q) (the point-mass rule would keep it with sum
    p q, less). Enough draws that a 2 % shift would fail (power check)."""
    rng = np.random.default_rng(2)
    logits = mx.array(rng.normal(0, 1.5, size=(3, VOCAB)).astype(np.float32))
    # a draft close to the target, not equal: its distribution overlaps p's
    draft_logits = logits[:2] + mx.array(rng.normal(0, 1.0, size=(2, VOCAB)).astype(np.float32))
    params = dict(temperature=temperature, top_k=6, top_p=0.95, min_p=0.02)
    p = _target_probabilities(logits, params)
    q_logprobs = filtered_logprobs(draft_logits, temperature, top_p=0.9)  # the draft's own filters
    q = _target_probabilities(draft_logits, dict(temperature=temperature, top_p=0.9))
    mx.random.seed(4)
    draws = 10000  # a 2 % shift of the likeliest token is then about 4 standard deviations
    first, second = np.zeros(VOCAB), np.zeros(VOCAB)
    first_kept = 0
    for _ in range(draws):
        drafts = [int(rng.choice(VOCAB, p=q[0])), int(rng.choice(VOCAB, p=q[1]))]
        kept = verify_drafts(logits, drafts, **params, draft_logprobs=q_logprobs)
        first[kept[0]] += 1
        first_kept += kept[0] == drafts[0] and len(kept) > 1
        if kept[0] == drafts[0] and len(kept) > 1:
            second[kept[1]] += 1
    assert_draft_rule_keeps_p(first, second, first_kept, draws, p, q)
    overlap = np.minimum(p[0], q[0]).sum()
    assert overlap > (p[0] * q[0]).sum() + 0.05  # the test tells min(1, p/q) from the point-mass rule


def test_verification_with_the_target_as_draft_keeps_every_draft():
    logits = mx.array(np.random.default_rng(3).normal(0, 1.0, size=(3, VOCAB)).astype(np.float32))
    q = filtered_logprobs(logits[:2], 1.0)
    mx.random.seed(0)
    for drafts in ([0, 1], [5, 7], [3, 3]):
        assert verify_drafts(logits, drafts, 1.0, draft_logprobs=q)[:2] == drafts


def test_draft_logprobs_of_the_wrong_shape_are_refused():
    logits = mx.zeros((3, VOCAB))
    with pytest.raises(ValueError, match="draft_logprobs must be"):
        verify_drafts(logits, [1, 2], 1.0, draft_logprobs=mx.zeros((3, VOCAB)))


# ---------------------------------------------------------------- the command
def test_cli_speculative_draft_prints_the_same_text(capsys):
    """The default model drafting for itself: the text of plain decoding."""
    from mlx_attn.lm.cli import main as cli_main
    from mlx_attn.lm.model_store import DEFAULT_DECODER

    prompt = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n"
    outputs = []
    for flags in ([], ["--speculative", "draft", "--draft-model", DEFAULT_DECODER, "--num-draft-tokens", "3"]):
        assert cli_main(["generate", "--prompt", prompt, "-m", "16", "--quiet", "--ignore-chat-template",
                         *flags]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and outputs[0].strip()
    assert cli_main(["generate", "x", "--speculative", "draft"]) == 2
    err = capsys.readouterr().err
    assert "--draft-model is needed" in err and "Traceback" not in err
    assert cli_main(["generate", "x", "--speculative", "ngram", "--draft-model", DEFAULT_DECODER]) == 2
    err = capsys.readouterr().err
    assert "--draft-model is used only with --speculative draft" in err and "Traceback" not in err
