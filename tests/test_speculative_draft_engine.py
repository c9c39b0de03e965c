"""A draft model inside the batched engine (``Engine(speculative="draft",
draft_model=...)``, ``mlx-attn serve --speculative draft --draft-model``):
greedy outputs token for token those without drafts in a mixed batch,
the draft model's paged K/V exactly its dense K/V of every request's
accepted tokens after every step (prefix sharing, preemption, cancel),
seeded sampling reproducible whatever the number of drafts, sampled tokens
distributed as the target's (chi-square), and the refusals."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map

from mlx_attn.lm.sampling import filtered_logprobs
from mlx_attn.paged import gather_pages
from test_speculative import _chi_square_p_value, assert_draft_rule_keeps_p
from test_speculative_engine import tiny_llama
from model_fixtures import assert_same_logprobs

VOCAB = 64  # tiny_llama's


def perturbed(model, scale: float, seed: int):
    """A copy of ``model`` with noise on every weight: a draft that agrees often, not always."""
    draft = tiny_llama()
    mx.random.seed(seed)
    draft.update(tree_map(lambda w: w + scale * mx.random.normal(w.shape), model.parameters()))
    mx.eval(draft.parameters())
    return draft


DRAFTS = {"same": lambda model: tiny_llama(), "close": lambda model: perturbed(model, 0.05, 1),
          "unrelated": lambda model: tiny_llama(seed=8)}


def check_draft_store(engine) -> None:
    """Every running request's computed positions in the draft store hold
    the draft model's own K/V of its tokens (computed densely), and the
    scheduler's page invariants hold."""
    engine.scheduler.check_invariants()
    draft = engine.draft
    for sequence in engine.scheduler.running:
        n = sequence.num_computed
        if not n:
            continue
        cache = draft.model.make_cache()
        draft.model(mx.array([sequence.tokens[:n]]), cache=cache)
        table = engine.pool.tables[sequence.request.request_id]
        for layer, dense in enumerate(cache):
            for paged, ref in ((draft.store.keys[layer], dense.keys), (draft.store.values[layer], dense.values)):
                np.testing.assert_allclose(np.asarray(gather_pages(paged, table, n)), np.asarray(ref[0, :, :n]),
                                           atol=2e-4, err_msg=f"{sequence.request.request_id}, layer {layer}")


def drive(engine, requests, check=None, max_steps=400, on_step=None):
    """Submit ``requests`` (rid -> (prompt, max_tokens, submit options)), step until idle."""
    for rid, (prompt, max_tokens, options) in requests.items():
        engine.submit(rid, prompt, max_tokens, **options)
    outputs = {}
    for step in range(max_steps):
        if engine.idle:
            break
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        if check is not None:
            check(engine)
        if on_step is not None:
            on_step(engine, step)
    assert engine.idle and engine.pool.held_pages == 0
    pool = engine.pool
    assert pool.free_pages + pool.cached_pages == pool.num_pages
    return outputs


def mixed_requests():
    from mlx_attn.serve import SamplingParams

    rng = np.random.default_rng(2)
    loop = rng.integers(0, VOCAB, 6).tolist()
    reported = {"sampling": SamplingParams(logprobs=True)}
    requests = {f"rep{i}": (loop * 3 + loop[: i + 1], 20, reported) for i in range(3)}  # shared prefix pages
    requests.update({f"rand{i}": (rng.integers(0, VOCAB, int(rng.integers(3, 20))).tolist(), 20,
                                  reported if i else {}) for i in range(3)})
    requests["long"] = (rng.integers(0, VOCAB, 50).tolist(), 12, {})  # chunked prefill beside drafting rows
    requests["out"] = (loop * 2, 16, {"speculative": False})
    requests["top"] = (loop + [1, 2, 3], 16, {"sampling": SamplingParams(top_logprobs=3)})
    requests["penalty"] = (loop * 2 + [4], 16, {"sampling": SamplingParams(repetition_penalty=1.3,
                                                                           presence_penalty=0.5)})
    return requests


def make_engine(model, draft=None, **options):
    from mlx_attn.serve import Engine

    settings = dict(kv_tokens=256, page_size=4, max_batch_tokens=24, dtype=mx.float32, num_draft_tokens=4)
    settings.update(options)
    return Engine(model, speculative="draft" if draft is not None else None, draft_model=draft, **settings)


@pytest.mark.usefixtures("always_draft")
@pytest.mark.parametrize("kind", list(DRAFTS))
def test_greedy_identical_in_a_mixed_batch_and_both_stores_exact(kind):
    model = tiny_llama()
    requests = mixed_requests()
    plain = drive(make_engine(model), requests)
    engine = make_engine(model, DRAFTS[kind](model))
    drafted = drive(engine, requests, check=check_draft_store)
    for rid in requests:
        assert [o.token for o in drafted[rid]] == [o.token for o in plain[rid]], rid
        assert_same_logprobs([o.logprob for o in drafted[rid]], [o.logprob for o in plain[rid]], atol=1e-4)
    assert [t for t, _ in drafted["top"][0].top_logprobs] == [t for t, _ in plain["top"][0].top_logprobs]
    stats = engine.stats()
    assert stats["draft_tokens"] > 0
    if kind == "same":  # the draft is the target: every greedy draft kept
        assert stats["accepted_draft_tokens"] == stats["draft_tokens"]
    else:
        assert stats["draft_tokens"] > stats["accepted_draft_tokens"]
    assert engine.stats()["copies"] >= 0 and engine.scheduler.cached_prompt_tokens > 0  # prefix pages shared


@pytest.mark.usefixtures("always_draft")
def test_preemption_and_cancel_mid_speculation_free_both_stores():
    """A pool too small for every request: younger ones are preempted while
    drafting and recomputed (their draft K/V too); one is cancelled
    mid-speculation; the rest give the tokens of decoding without drafts."""
    model = tiny_llama()
    rng = np.random.default_rng(5)
    requests = {f"r{i}": (rng.integers(0, VOCAB, 10).tolist(), 24, {}) for i in range(5)}
    plain = drive(make_engine(model, kv_tokens=64, page_size=4), requests)
    engine = make_engine(model, perturbed(model, 0.05, 2), kv_tokens=64, page_size=4)
    cancelled = []

    def cancel_one(engine, step):
        running = [s.request.request_id for s in engine.scheduler.running if s.draft_length.proposed]
        if not cancelled and running:
            cancelled.append(running[-1])
            assert engine.cancel(running[-1])
            assert running[-1] not in engine.draft.requests

    drafted = drive(engine, requests, check=check_draft_store, on_step=cancel_one)
    assert engine.scheduler.preemptions > 0 and cancelled
    for rid in requests:
        if rid not in cancelled:
            assert [o.token for o in drafted[rid]] == [o.token for o in plain[rid]], rid
    assert not engine.draft.requests


@pytest.mark.usefixtures("always_draft")
def test_seeded_sampling_is_reproducible_whatever_the_number_of_drafts():
    """A seeded sampled request's tokens are keyed by its seed and their
    index only: the same with 1 or 4 drafts a step, alone or beside others."""
    from mlx_attn.serve import SamplingParams

    model = tiny_llama(seed=1)
    draft = perturbed(model, 0.05, 3)
    prompt = list(range(10, 18)) * 3
    sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=3)
    runs = []
    for drafts, others in ((4, 0), (4, 0), (1, 2), (3, 3)):
        engine = make_engine(model, draft, num_draft_tokens=drafts)
        requests = {"s": (prompt, 20, {"sampling": sampling})}
        requests.update({f"o{i}": (prompt[i:], 10, {"sampling": SamplingParams(temperature=1.0)})
                         for i in range(others)})
        runs.append([o.token for o in drive(engine, requests)["s"]])
        assert engine.stats()["accepted_draft_tokens"] > 0
    assert all(run == runs[0] for run in runs) and len(runs[0]) == 20


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_the_keyed_rule_keeps_the_target_distribution(temperature):
    """The engine's rule for sampled requests, seed by seed: proposals drawn
    from q with each seed's draft keys, kept with min(1, p/q) or replaced
    from max(0, p - q) with its other keys. The first token follows p, the
    second (after a kept first) follows row 1's p, a proposal is kept with
    probability sum min(p, q), and a 2 % shift would be caught."""
    from mlx_attn.lm.speculative import normalized_logprobs
    from mlx_attn.serve.draft_model import draft_key, keyed_draft_rule
    from test_speculative import VOCAB as SMALL, _target_probabilities

    rng = np.random.default_rng(2)
    logits = mx.array(rng.normal(0, 1.5, size=(2, SMALL)).astype(np.float32))
    draft_logits = logits + mx.array(rng.normal(0, 1.0, size=(2, SMALL)).astype(np.float32))
    params = dict(temperature=temperature, top_k=6, top_p=0.95, min_p=0.02)
    p = _target_probabilities(logits, params)
    target = normalized_logprobs(filtered_logprobs(logits, **params))
    q_logprobs = normalized_logprobs(filtered_logprobs(draft_logits, temperature, top_p=0.9))
    q = np.exp(np.asarray(q_logprobs))
    draws = 10000  # a 2 % shift of the likeliest token is then about 4 standard deviations
    first, second = np.zeros(SMALL), np.zeros(SMALL)
    first_kept = 0
    for seed in range(draws):
        proposed = mx.stack([mx.random.categorical(q_logprobs[i], key=draft_key(seed, i)) for i in range(2)])
        proposed = proposed.tolist()
        kept = keyed_draft_rule(target, q_logprobs, proposed, seed, 0)
        first[kept[0]] += 1
        if len(kept) > 1:
            first_kept += 1
            second[kept[1]] += 1
    assert_draft_rule_keeps_p(first, second, first_kept, draws, p, q)


@pytest.mark.usefixtures("always_draft")
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_sampled_tokens_follow_the_target_distribution(temperature):
    """Many seeds of one prompt, three tokens each: the first is the draft's
    proposal kept with min(1, p/q) or a draw from max(0, p - q) (the draft
    runs beside the prompt's last chunk), the second verifies a drafted
    token. Both follow the target's filtered distribution (chi-square; the
    rule's power is checked above, on more draws than an engine run affords)."""
    from mlx_attn.serve import SamplingParams

    model = tiny_llama(seed=4)
    model.update(tree_map(lambda w: w / 4, model.parameters()))  # flatter than the fixture's: many tokens drawn
    draft = perturbed(model, 0.3, 5)
    prompt = [7, 3, 9, 1, 12, 5]
    filters = dict(temperature=temperature, top_k=40, top_p=0.95, min_p=0.01)
    engine = make_engine(model, draft, kv_tokens=8192, max_batch_tokens=2048, speculative_rows=2048)
    draws = 600
    requests = {i: (prompt, 3, {"sampling": SamplingParams(**filters, seed=i)}) for i in range(draws)}
    outputs = drive(engine, requests, max_steps=100)

    def target(tokens):
        logits = model(mx.array([tokens]))[0, -1:].astype(mx.float32)
        p = np.exp(np.asarray(filtered_logprobs(logits, **filters)))[0]
        return p / p.sum()

    firsts = [outputs[i][0].token for i in range(draws)]
    assert _chi_square_p_value(np.bincount(firsts, minlength=VOCAB), target(prompt)) > 1e-3
    # each second token follows the target after that request's first: their mixture
    after = {t: target(prompt + [t]) for t in set(firsts)}
    mixture = sum(after[t] for t in firsts) / draws
    assert _chi_square_p_value(np.bincount([outputs[i][1].token for i in range(draws)], minlength=VOCAB),
                               mixture) > 1e-3
    stats = engine.stats()
    assert 0 < stats["accepted_draft_tokens"] < stats["draft_tokens"]


def test_refusals_name_the_draft_model():
    from mlx_attn.serve import Engine

    model = tiny_llama()
    with pytest.raises(ValueError, match="speculative='draft' needs a draft_model"):
        Engine(model, kv_tokens=64, speculative="draft")
    with pytest.raises(ValueError, match="draft_model is used only with speculative='draft'"):
        Engine(model, kv_tokens=64, speculative="ngram", draft_model=tiny_llama())
    from model_fixtures import tiny_llama as other_llama

    with pytest.raises(ValueError, match="draft_model has a vocabulary of 97 tokens, the model 64"):
        Engine(model, kv_tokens=64, speculative="draft", draft_model=other_llama())


def test_serve_flags_name_the_draft_model():
    from mlx_attn.serve.server import build_parser, check_draft_flags

    parser = build_parser()
    for argv, message in ((["--speculative", "draft"], "--draft-model is needed by --speculative draft"),
                          (["--draft-model", "x"], "--draft-model is used only with --speculative draft"),
                          (["--speculative", "ngram", "--draft-model", "x"],
                           "--draft-model is used only with --speculative draft")):
        with pytest.raises(ValueError, match=message):
            check_draft_flags(parser.parse_args(argv))
    check_draft_flags(parser.parse_args(["--speculative", "draft", "--draft-model", "x"]))
    with pytest.raises(ValueError, match="--speculative: invalid choice: 'eagle'"):
        parser.parse_args(["--speculative", "eagle"])


def test_serve_loads_the_draft_model_and_refuses_another_vocabulary(monkeypatch):
    import mlx_attn.lm.cli  # noqa: F401  imported before the patch: it binds load_for_engine when first imported
    import mlx_attn.lm.engine_choice as engine_choice
    from mlx_attn.serve.server import build_parser, load_draft_model
    from model_fixtures import tiny_llama as other_llama, tiny_tokenizer

    loaded = {"small": (tiny_llama(seed=8), tiny_tokenizer()), "other": (other_llama(), tiny_tokenizer())}
    monkeypatch.setattr(engine_choice, "load_for_engine", lambda path, engine, backend: loaded[path])
    parser = build_parser()
    args = parser.parse_args(["--speculative", "draft", "--draft-model", "small"])
    assert load_draft_model(args, tiny_llama(), tiny_tokenizer()) is loaded["small"][0]
    assert load_draft_model(parser.parse_args([]), tiny_llama(), tiny_tokenizer()) is None
    args = parser.parse_args(["--speculative", "draft", "--draft-model", "other"])
    with pytest.raises(ValueError, match="--draft-model other: draft_model has a vocabulary of 97 tokens"):
        load_draft_model(args, tiny_llama(), tiny_tokenizer())


def test_serve_refuses_a_draft_with_another_tokenizer():
    from mlx_attn.lm.speculative import check_draft_tokenizer
    from model_fixtures import tiny_tokenizer

    class Shifted:
        def encode(self, text):
            return [t + 1 for t in tiny_tokenizer().encode(text)]

    check_draft_tokenizer(tiny_tokenizer(), tiny_tokenizer(), "same")
    with pytest.raises(ValueError, match="draft_model other has another tokenizer"):
        check_draft_tokenizer(tiny_tokenizer(), Shifted(), "other")


@pytest.mark.usefixtures("always_draft")
def test_server_drafts_with_a_model_and_counts_per_drafter():
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    from model_fixtures import random_llama, tiny_tokenizer, tiny_vocabulary
    from test_serve_server import raw, serve_model

    vocab = len(tiny_vocabulary()[0])
    model = random_llama(seed=3, vocab_size=vocab, max_position_embeddings=512)
    draft = random_llama(seed=3, vocab_size=vocab, max_position_embeddings=512)
    tokenizer = tiny_tokenizer(eos_token_ids=())
    prompt = "the then the then the then the"
    texts = {}
    for speculative in (None, "draft"):
        server = serve_model(model, tokenizer, kv_cache_tokens=1024, page_size=8, speculative=speculative,
                             draft_model=draft if speculative else None)
        try:
            for opt_out in (False, True):
                body = {"model": "tiny-test-model", "prompt": prompt, "max_tokens": 16, "temperature": 0,
                        "speculative": not opt_out}
                status, reply = raw(server, "POST", "/v1/completions", body)
                assert status == 200, reply
                texts[speculative, opt_out] = reply["choices"][0]["text"]
            status, text = raw(server, "GET", "/metrics")
            values = dict(line.split(" ") for line in text.splitlines() if not line.startswith("#"))
            server.check_pages()
            proposed = float(values.get('mlx_attn_drafter_tokens_total{drafter="draft"}', 0))
            accepted = float(values.get('mlx_attn_drafter_accepted_tokens_total{drafter="draft"}', 0))
            if speculative:
                assert accepted == proposed > 0  # the draft is the target
                assert float(values["mlx_attn_draft_tokens_total"]) == proposed
            else:
                assert proposed == accepted == 0
        finally:
            server.stop()
    assert len(set(texts.values())) == 1 and texts[None, False]


def test_the_draft_model_s_cost_enters_the_back_off_rule():
    """One request decoding in 100 ms steps of ~2 ms a row: a draft kept
    90 % of the time pays when finding it is free (n-gram), not when the
    draft model took 100 ms for it, and does again once drafts cost 5 ms."""
    from mlx_attn.lm.speculative import StepCost

    cost = StepCost()
    for step in range(40):
        rows = 1 + step % 8
        cost.record(rows, 0.100 + 0.002 * rows)
    assert cost.worth(0.9, 1, 1)
    cost.record_drafting(2, 0.200)
    assert cost.draft_row == pytest.approx(0.100)
    assert not cost.worth(0.9, 1, 1)
    for _ in range(200):  # the running mean follows a cheaper draft
        cost.record_drafting(4, 0.020)
    assert cost.draft_row == pytest.approx(0.005, rel=0.05)
    assert cost.worth(0.9, 1, 1)
    cost.record_drafting(0, 1.0)  # a step without drafts changes nothing
    assert cost.draft_row == pytest.approx(0.005, rel=0.05)
