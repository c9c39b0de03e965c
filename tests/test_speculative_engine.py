"""Speculative decoding in the batched engine (mlx_attn.serve): drafts
verified in the same step as other rows, rejected drafts' K/V rolled back.

A fake model (as in test_serve_engine) whose key for position p encodes the
tokens up to p checks that after every step each row reads exactly its own
accepted tokens' keys, with drafts that are sometimes right and sometimes
wrong; then the real engine's greedy outputs with and without drafts."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_attn.paged import gather_pages
from mlx_attn.serve import PagedKVStore, PagePool, Request, Scheduler
from mlx_attn.serve.pages import ROOT_HASH, chain_hash
from mlx_attn.serve.scheduler import Speculation

from fake_model import DIM, VOCAB, fake_keys, fake_sample
from model_fixtures import assert_same_logprobs


class OracleDrafter:
    """Proposes the fake model's true continuation, with a wrong token at a
    pseudo-random place (or none): some drafts accepted, some rejected."""

    def __init__(self):
        self.calls = 0

    def propose(self, tokens, count):
        self.calls += 1
        out, seq = [], list(tokens)
        wrong_at = (len(tokens) * 3 + self.calls) % (count + 2)
        for i in range(count):
            token = fake_sample(seq)
            if i == wrong_at:
                token = (token + 1) % VOCAB
            out.append(token)
            seq.append(token)
        return out


def alone(prompt, max_tokens):
    seq = list(prompt)
    for _ in range(max_tokens):
        seq.append(fake_sample(seq))
    return seq[len(prompt):]


class SpeculativeHarness:
    def __init__(self, num_pages, page_size, max_batch_tokens, step_rows=64, num_draft_tokens=4):
        self.pool = PagePool(num_pages, page_size)
        self.drafter = OracleDrafter()
        self.scheduler = Scheduler(self.pool, max_batch_tokens,
                                   speculation=Speculation(self.drafter, num_draft_tokens, step_rows))
        self.store = PagedKVStore(num_pages, page_size, n_layers=1, n_kv_heads=1, head_dim=DIM, dtype=mx.float32)
        self.outputs: dict = {}

    def submit(self, rid, prompt, max_tokens, speculate=True):
        self.scheduler.submit(Request(rid, tuple(prompt), max_tokens, speculate=speculate))
        self.outputs[rid] = []

    def step(self):
        plan = self.scheduler.schedule()
        arrays = plan.arrays()
        self.store.copy(plan.copies)
        if plan.rows:  # what the row feeds: its tokens so far, then its drafts
            fed = {r.request_id: self.scheduler.tokens(r.request_id) + list(r.tokens[len(r.tokens) - r.drafts:])
                   for r in plan.rows}
            keys = np.concatenate([fake_keys(fed[r.request_id], range(r.start, r.kv_len)) for r in plan.rows])
            self.store.write(0, mx.array(arrays["write_pages"]), mx.array(arrays["write_slots"]),
                             mx.array(keys), mx.array(keys))
        sampled = {}
        for row in plan.rows:
            seq = fed[row.request_id]
            got = np.asarray(gather_pages(self.store.keys[0], list(row.block_table), row.kv_len))
            np.testing.assert_array_equal(got.swapaxes(0, 1), fake_keys(seq, range(row.kv_len)))
            if row.sample:  # verify: keep drafts while they are what the model gives
                base = len(seq) - row.drafts
                kept = []
                for i in range(row.drafts + 1):
                    token = fake_sample(seq[: base + i])
                    kept.append(token)
                    if i == row.drafts or token != seq[base + i]:
                        break
                sampled[row.request_id] = kept
        for result in self.scheduler.commit(plan, sampled):
            self.outputs[result.request_id].append(result.token)
        self.check_pages()
        return plan

    def check_pages(self):
        """Invariants, and no indexed page covers a token that was not accepted:
        every running request's computed positions hold its own tokens' keys."""
        self.scheduler.check_invariants()
        size = self.pool.page_size
        for sequence in self.scheduler.running:
            rid = sequence.request.request_id
            table = self.pool.tables[rid]
            parent = ROOT_HASH
            for i in range(sequence.num_computed // size):
                tokens = sequence.tokens[i * size:(i + 1) * size]
                parent = chain_hash(parent, tokens)
                assert sequence.keys[i] == parent
            if sequence.num_computed:
                got = np.asarray(gather_pages(self.store.keys[0], table, sequence.num_computed))
                np.testing.assert_array_equal(got.swapaxes(0, 1),
                                              fake_keys(sequence.tokens, range(sequence.num_computed)))

    def drain(self, max_steps=500):
        for _ in range(max_steps):
            if self.scheduler.idle:
                return
            self.step()
        raise AssertionError("not idle")


def test_drafts_verified_and_rolled_back_with_sharing_and_preemption():
    harness = SpeculativeHarness(num_pages=14, page_size=4, max_batch_tokens=16)
    prompts = {f"r{i}": [0, 1, 2, 0, 1, 2, 0] + [i % VOCAB] * (i % 5) for i in range(8)}
    prompts["whole"] = [0, 1, 2, 0, 1, 2, 0, 1]
    for i, (rid, prompt) in enumerate(prompts.items()):
        harness.submit(rid, prompt, max_tokens=13, speculate=i != 3)
    harness.drain()
    for rid, prompt in prompts.items():
        assert harness.outputs[rid] == alone(prompt, 13), rid
    s = harness.scheduler
    assert s.accepted_draft_tokens > 0 and s.draft_tokens > s.accepted_draft_tokens  # both outcomes happened
    assert s.preemptions > 0
    pool = harness.pool
    assert pool.held_pages == 0 and pool.free_pages + pool.cached_pages == pool.num_pages


def test_prefix_cache_after_drafting_holds_the_accepted_tokens():
    harness = SpeculativeHarness(num_pages=64, page_size=4, max_batch_tokens=32)
    prompt = [0, 1, 2, 0, 1, 2, 0, 1, 2]
    harness.submit("a", prompt, max_tokens=20)
    harness.drain()
    assert harness.scheduler.draft_tokens > harness.scheduler.accepted_draft_tokens > 0
    # a request continuing the output finds every full page of the computed tokens (the last is never fed)
    whole = prompt + harness.outputs["a"]
    before = harness.scheduler.cached_prompt_tokens
    harness.submit("continue", whole, max_tokens=3)
    harness.step()
    assert harness.scheduler.cached_prompt_tokens - before == (len(whole) - 1) // 4 * 4
    harness.drain()
    assert harness.outputs["continue"] == alone(whole, 3)


def test_opted_out_and_backed_off_requests_draft_nothing():
    harness = SpeculativeHarness(num_pages=64, page_size=4, max_batch_tokens=64, step_rows=5)
    for i in range(4):
        harness.submit(f"r{i}", [0, 1, 2, i % VOCAB], max_tokens=10, speculate=i != 0)
    for _ in range(30):
        if harness.scheduler.idle:
            break
        plan = harness.step()
        rows = {r.request_id: r for r in plan.rows}
        assert plan.num_tokens <= 5 or all(r.drafts == 0 for r in plan.rows)  # drafts never push past step_rows
        if "r0" in rows:
            assert rows["r0"].drafts == 0
    assert harness.scheduler.idle
    for i in range(4):
        assert harness.outputs[f"r{i}"] == alone([0, 1, 2, i % VOCAB], 10)
    assert harness.scheduler.draft_tokens > 0


def test_compute_bound_steps_draft_less():
    drafted = {}
    for label, fixed, per_row in (("memory", 0.100, 0.001), ("compute", 0.010, 0.050)):
        harness = SpeculativeHarness(num_pages=128, page_size=4, max_batch_tokens=128)
        for rows in [1, 2, 5, 9, 16, 3, 7, 12] * 2:
            harness.scheduler.speculation.cost.record(rows, fixed + per_row * rows)
        for i in range(8):
            harness.submit(f"r{i}", [0, 1, 2, i % VOCAB, 1], max_tokens=16)
        harness.drain()
        for i in range(8):
            assert harness.outputs[f"r{i}"] == alone([0, 1, 2, i % VOCAB, 1], 16)
        drafted[label] = harness.scheduler.draft_tokens
    assert drafted["compute"] < drafted["memory"] / 2


def test_drafts_stop_where_the_plain_path_is_cheaper():
    """Steps with drafts are timed apart from plain ones: where the plain
    path costs half the drafting one, drafts kept 30 % of the time do
    not pay and no step drafts; where it costs the same, they still do."""
    drafted = {}
    for label, plain_fixed in (("cheap plain path", 0.050), ("same cost", 0.100)):
        harness = SpeculativeHarness(num_pages=128, page_size=4, max_batch_tokens=128)
        speculation = harness.scheduler.speculation
        for rows in [1, 2, 5, 9, 16, 3, 7, 12] * 2:
            speculation.cost.record(rows, 0.100 + 0.001 * rows)
            speculation.plain.record(rows, plain_fixed + 0.001 * rows)
        for i in range(8):
            harness.submit(f"r{i}", [0, 1, 2, i % VOCAB, 1], max_tokens=16)
        for sequence in harness.scheduler._all.values():
            sequence.draft_length.rate = 0.3
        harness.drain()
        for i in range(8):
            assert harness.outputs[f"r{i}"] == alone([0, 1, 2, i % VOCAB, 1], 16)
        drafted[label] = harness.scheduler.draft_tokens
    assert drafted["cheap plain path"] == 0 < drafted["same cost"]


class CostlessTrueDrafter:
    """Proposes the fake model's true continuation; finding it is free, so
    the scheduler also looks up the first draft of rows that hold none."""

    costless = True

    def propose(self, tokens, count):
        seq = list(tokens)
        for _ in range(count):
            seq.append(fake_sample(seq))
        return seq[len(tokens):]


def test_refused_requests_keep_measuring_their_rate():
    """Requests whose rate fell to 0.3 are refused drafts while the plain
    path costs half the drafting one; with a costless drafter each plain
    step still checks its first proposal against the token it gave, so the
    rate climbs back (every proposal is right here) and drafting resumes;
    a drafter without ``costless`` is never looked up outside its drafts."""
    drafted, rates = {}, {}
    for label, drafter in (("costless", CostlessTrueDrafter()), ("not costless", OracleDrafter())):
        harness = SpeculativeHarness(num_pages=128, page_size=4, max_batch_tokens=128)
        speculation = harness.scheduler.speculation
        harness.scheduler.speculation = Speculation(drafter, speculation.num_draft_tokens, speculation.step_rows,
                                                    speculation.cost, speculation.plain)
        for rows in [1, 2, 5, 9, 16, 3, 7, 12] * 2:
            speculation.cost.record(rows, 0.100 + 0.001 * rows)
            speculation.plain.record(rows, 0.050 + 0.001 * rows)
        for i in range(4):
            harness.submit(f"r{i}", [0, 1, 2, i % VOCAB, 1], max_tokens=24)
        sequences = list(harness.scheduler._all.values())
        for sequence in sequences:
            sequence.draft_length.rate = 0.3
        harness.step()  # prefill: the first tokens
        harness.step()  # refused at rate 0.3: a plain step
        rates[label] = [s.draft_length.rate for s in sequences]
        harness.drain()
        for i in range(4):
            assert harness.outputs[f"r{i}"] == alone([0, 1, 2, i % VOCAB, 1], 24)
        drafted[label] = harness.scheduler.draft_tokens
    assert all(rate > 0.3 for rate in rates["costless"]) and rates["not costless"] == [0.3] * 4
    assert drafted["not costless"] == 0 < drafted["costless"]


def test_drafting_beats_is_true_until_both_paths_are_measured():
    from mlx_attn.lm.speculative import StepCost

    eager, plain = StepCost(), StepCost()
    assert eager.drafting_beats(plain, 1.0, 1, 1, 4)  # nothing measured
    for rows in [1, 2, 5, 9, 16, 3, 7, 12]:
        eager.record(rows, 0.100 + 0.001 * rows)
    assert eager.drafting_beats(plain, 1.0, 1, 1, 4)  # the plain path not yet measured
    for rows in [1, 2, 5, 9, 16, 3, 7, 12]:
        plain.record(rows, 0.010 + 0.001 * rows)
    assert not eager.drafting_beats(plain, 1.2, 1, 1, 4)  # 1.2 tokens in 0.105 s against 1 in 0.011 s
    assert eager.drafting_beats(plain, 12.0, 1, 1, 4)


def test_commit_refuses_kept_tokens_that_are_not_a_draft_prefix():
    harness = SpeculativeHarness(num_pages=16, page_size=4, max_batch_tokens=16)
    harness.submit("a", [0, 1, 2, 0, 1], max_tokens=8)
    harness.step()  # prefill, first token
    plan = harness.scheduler.schedule()
    row = plan.rows[0]
    assert row.drafts > 0
    wrong = (row.tokens[-row.drafts] + 1) % VOCAB
    with pytest.raises(ValueError, match="prefix of its"):
        harness.scheduler.commit(plan, {"a": [wrong, 0]})


# ---------------------------------------------------------------- the engine on a model
def tiny_llama(seed=0):
    from mlx.utils import tree_map

    from mlx_attn.lm.models.llama import Llama, LlamaConfig

    mx.random.seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
    model = Llama(config, backend="reference")
    model.update(tree_map(lambda w: w * 4, model.parameters()))  # sharp, tie-free logits
    mx.eval(model.parameters())
    return model


@pytest.mark.usefixtures("always_draft")
def test_engine_greedy_identical_with_and_without_drafts_in_a_mixed_batch():
    from mlx_attn.serve import Engine, SamplingParams

    model = tiny_llama()
    rng = np.random.default_rng(2)
    loop = rng.integers(0, 64, 6).tolist()
    prompts = {f"rep{i}": loop * 4 + loop[: i + 1] for i in range(4)}  # drafts find matches
    prompts.update({f"rand{i}": rng.integers(0, 64, int(rng.integers(3, 30))).tolist() for i in range(4)})
    prompts["long"] = rng.integers(0, 64, 60).tolist()  # chunked prefill beside drafting rows
    opted_out = {"rep1", "rand2"}
    seeded = {"rand3": SamplingParams(temperature=0.8, seed=5), "rep3": SamplingParams(temperature=0.8, seed=9)}
    asked = {"rep0": SamplingParams(top_logprobs=3), "rand0": SamplingParams(top_logprobs=2)}
    unreported = {"rand1", "long"}  # ask for no logprobs: None with and without drafts
    results = {}
    for speculative in (None, "ngram"):
        engine = Engine(model, kv_tokens=192, page_size=4, max_batch_tokens=24, dtype=mx.float32,
                        speculative=speculative, num_draft_tokens=5)
        for rid, prompt in prompts.items():
            default = None if rid in unreported else SamplingParams(logprobs=True)
            engine.submit(rid, prompt, 24, sampling=seeded.get(rid, asked.get(rid, default)),
                          speculative=rid not in opted_out)
        outputs = {}
        for _ in range(400):
            if engine.idle:
                break
            for out in engine.step():
                outputs.setdefault(out.request_id, []).append(out)
            engine.scheduler.check_invariants()
        assert engine.idle and engine.pool.held_pages == 0
        results[speculative] = (outputs, engine.stats(), engine.compiled_draft_steps)
    plain, drafted = results[None][0], results["ngram"][0]
    stats = results["ngram"][1]
    for rid in prompts:  # the seeded sampled request too: its draws are the plain sampler's
        assert [o.token for o in drafted[rid]] == [o.token for o in plain[rid]], rid
        assert_same_logprobs([o.logprob for o in drafted[rid]], [o.logprob for o in plain[rid]], atol=1e-4)
        for a, b in zip(drafted[rid], plain[rid]):
            assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
            np.testing.assert_allclose([lp for _, lp in a.top_logprobs], [lp for _, lp in b.top_logprobs], atol=1e-4)
    assert len(drafted["rep0"][0].top_logprobs) == 3 and len(drafted["rand0"][0].top_logprobs) == 2
    assert stats["accepted_draft_tokens"] > 0 and stats["draft_tokens"] >= stats["accepted_draft_tokens"]
    assert results[None][1]["draft_tokens"] == 0
    assert results["ngram"][2] > 0  # steps of decode rows and drafts ran compiled, tokens unchanged


@pytest.mark.usefixtures("always_draft")
def test_engine_seeded_drafting_request_is_reproducible():
    from mlx_attn.serve import Engine, SamplingParams

    model = tiny_llama(seed=1)
    prompt = list(range(10, 18)) * 4
    runs = []
    for speculative in ("ngram", "ngram", None):  # the same tokens whatever was drafted, or without drafts
        engine = Engine(model, kv_tokens=128, page_size=4, dtype=mx.float32, speculative=speculative)
        engine.submit("s", prompt, 20, sampling=SamplingParams(temperature=1.0, top_p=0.9, seed=3))
        runs.append(engine.run_until_idle()["s"])
        assert (engine.stats()["draft_tokens"] > 0) == (speculative is not None)
    assert runs[0] == runs[1] == runs[2] and len(runs[0]) == 20


def test_engine_refuses_bad_speculation_settings():
    from mlx_attn.serve import Engine

    model = tiny_llama()
    with pytest.raises(ValueError, match="speculative"):
        Engine(model, kv_tokens=64, speculative="eagle")
    with pytest.raises(ValueError, match="speculative='draft' needs a draft_model"):
        Engine(model, kv_tokens=64, speculative="draft")  # never an n-gram engine in its place
    with pytest.raises(ValueError, match="num_draft_tokens"):
        Engine(model, kv_tokens=64, speculative="ngram", num_draft_tokens=0)
    engine = Engine(model, kv_tokens=64, speculative="ngram")
    with pytest.raises(ValueError, match="speculative"):
        engine.submit("a", [1, 2], 4, speculative="no")


# ---------------------------------------------------------------- the server
@pytest.mark.usefixtures("always_draft")
def test_server_speculative_metrics_opt_out_and_field_check():
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    from model_fixtures import random_llama, tiny_tokenizer, tiny_vocabulary
    from test_serve_server import raw, serve_model

    vocab = len(tiny_vocabulary()[0])
    model = random_llama(seed=3, vocab_size=vocab, max_position_embeddings=512)
    tokenizer = tiny_tokenizer(eos_token_ids=())
    prompt = "the then the then the then the then the"
    texts = {}
    for speculative in (None, "ngram"):
        server = serve_model(model, tokenizer, kv_cache_tokens=1024, page_size=8, speculative=speculative)
        try:
            for opt_out in (False, True):
                body = {"model": "tiny-test-model", "prompt": prompt, "max_tokens": 24, "temperature": 0}
                if opt_out:
                    body["speculative"] = False
                status, reply = raw(server, "POST", "/v1/completions", body)
                assert status == 200, reply
                texts[speculative, opt_out] = reply["choices"][0]["text"]
            status, reply = raw(server, "POST", "/v1/completions", {"model": "tiny-test-model", "prompt": "x",
                                                                    "speculative": "yes"})
            assert status == 400 and reply["error"]["param"] == "speculative"
            status, text = raw(server, "GET", "/metrics")
            values = dict(line.split(" ") for line in text.splitlines() if not line.startswith("#"))
            server.check_pages()
            proposed = float(values["mlx_attn_draft_tokens_total"])
            accepted = float(values["mlx_attn_accepted_draft_tokens_total"])
            if speculative:
                assert proposed > 0 and 0 < accepted <= proposed
            else:
                assert proposed == accepted == 0
        finally:
            server.stop()
    assert len(set(texts.values())) == 1 and texts[None, False]


# ---------------------------------------------------------------- penalties, bias, who drafts
def _shaped_reference(row: np.ndarray, generated: list[int], presence: float, frequency: float,
                      bias: dict[int, float]) -> np.ndarray:
    """OpenAI's presence / frequency penalties and logit bias, written out
    apart from the engine's code."""
    out = row.astype(np.float64).copy()
    for token in set(generated):
        out[token] -= presence + frequency * generated.count(token)
    for token, value in bias.items():
        out[token] += value
    return out


def test_verification_with_penalties_and_bias_keeps_the_plain_sampler_s_tokens():
    """Greedy with presence / frequency / repetition penalties and a logit
    bias: the kept tokens are those the plain sampler picks one by one,
    each row penalized over the tokens generated so far plus the drafts
    before it, wherever the first wrong draft is."""
    from mlx_attn.serve.sampling import SamplingParams, sample_rows, verify_draft_rows

    rng = np.random.default_rng(4)
    logits = mx.array(rng.normal(0, 1, (4, 12)).astype(np.float32))
    params = SamplingParams(presence_penalty=0.8, frequency_penalty=1.5, repetition_penalty=1.1,
                            logit_bias=((3, 1.5),))
    assert not params.greedy
    previous, index = [1, 2, 5, 5, 7], 3  # a 2-token prompt, then 3 generated
    plain = []
    for i in range(4):
        plain.append(sample_rows(logits[i:i + 1], [params], [previous + plain], [index + i])[0].token)
    raw = np.argmax(np.array(logits), axis=-1).tolist()
    assert plain != raw  # the penalties and the bias change what is picked
    for wrong_at in range(4):
        drafts = [t if i != wrong_at else (t + 1) % 12 for i, t in enumerate(plain[:3])]
        kept = [s.token for s in verify_draft_rows(logits, params, previous, index, drafts)]
        assert kept == plain[:wrong_at + 1] if wrong_at < 3 else kept == plain, (wrong_at, kept, plain)


def test_sampled_verification_with_penalties_and_bias_keeps_the_target_distribution():
    """Temperature 0.8 with presence and frequency penalties and a bias:
    the first kept token follows row 0's penalized distribution and, after
    an accepted draft, the second follows row 1's, whose penalty counts
    that draft; the distribution without it is refused by the same counts."""
    from test_speculative import _chi_square_p_value

    from mlx_attn.serve.sampling import SamplingParams, verify_draft_rows

    rng = np.random.default_rng(5)
    logits = rng.normal(0, 1, (3, 8)).astype(np.float32)
    logits[0, 6], logits[1, 6] = 2.5, 2.0  # the first draft is likely, and its penalty matters in row 1
    presence, frequency, bias, temperature = 0.5, 1.0, {2: 1.0}, 0.8
    previous, index, drafts = [4, 1, 2, 2], 2, [6, 5]
    generated = previous[-index:]

    def target(row, generated_before):
        z = _shaped_reference(logits[row], generated_before, presence, frequency, bias) / temperature
        p = np.exp(z - z.max())
        return p / p.sum()

    first_p, second_p = target(0, generated), target(1, generated + [6])
    draws = 2500
    first, second = np.zeros(8), np.zeros(8)
    for seed in range(draws):
        params = SamplingParams(temperature=temperature, presence_penalty=presence, frequency_penalty=frequency,
                                logit_bias=tuple(bias.items()), seed=seed)
        kept = [s.token for s in verify_draft_rows(mx.array(logits), params, previous, index, drafts)]
        first[kept[0]] += 1
        if kept[0] == drafts[0]:
            second[kept[1]] += 1
    assert _chi_square_p_value(first, first_p) > 1e-3
    assert _chi_square_p_value(second, second_p) > 1e-3
    assert _chi_square_p_value(second, target(1, generated)) < 1e-3  # the draft not counted: caught


@pytest.mark.usefixtures("always_draft")
def test_engine_greedy_with_penalties_and_bias_identical_with_and_without_drafts():
    """Requests with presence / frequency penalties and logit bias draft, and
    give token for token (log-probability for log-probability) what they
    give without drafts, a seeded sampled one too; the penalties do change
    their tokens."""
    from mlx_attn.serve import Engine, SamplingParams

    model = tiny_llama(seed=2)
    rng = np.random.default_rng(3)
    loop = rng.integers(0, 64, 5).tolist()
    prompts = {f"rep{i}": loop * 4 + loop[: i + 1] for i in range(4)}
    shaped = {"rep0": SamplingParams(presence_penalty=2.0, frequency_penalty=2.0, logprobs=True),
              "rep1": SamplingParams(logit_bias=((loop[2], 8.0), (loop[3], -8.0)), logprobs=True),
              "rep2": SamplingParams(frequency_penalty=2.0, repetition_penalty=1.2, top_logprobs=2),
              "rep3": SamplingParams(presence_penalty=-1.0, logit_bias=((7, 1.0),)),
              "rep4": SamplingParams(temperature=0.9, seed=11, frequency_penalty=1.0, logit_bias=((7, 2.0),))}
    prompts["rep4"] = loop * 5
    results = {}
    for speculative, sampling in ((None, shaped), ("ngram", shaped), (None, {})):
        engine = Engine(model, kv_tokens=192, page_size=4, max_batch_tokens=24, dtype=mx.float32,
                        speculative=speculative, num_draft_tokens=4)
        for rid, prompt in prompts.items():
            engine.submit(rid, prompt, 20, sampling=sampling.get(rid))
        outputs = {}
        for _ in range(200):
            if engine.idle:
                break
            for out in engine.step():
                outputs.setdefault(out.request_id, []).append(out)
            engine.scheduler.check_invariants()
        assert engine.idle
        results[speculative, bool(sampling)] = (outputs, engine.stats())
    plain, drafted = results[None, True][0], results["ngram", True][0]
    unshaped = results[None, False][0]
    assert results["ngram", True][1]["draft_tokens"] > 0
    for rid in prompts:
        assert [o.token for o in drafted[rid]] == [o.token for o in plain[rid]], rid
        assert_same_logprobs([o.logprob for o in drafted[rid]], [o.logprob for o in plain[rid]], atol=1e-4)
        for a, b in zip(drafted[rid], plain[rid]):
            assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
    changed = [rid for rid in prompts if [o.token for o in plain[rid]] != [o.token for o in unshaped[rid]]]
    assert len(changed) >= 4, changed


def test_who_drafts_opt_out_and_constraints_decide_in_one_place():
    """``Engine.drafts_for``: only an engine that speculates, only requests
    that did not opt out and carry no constraint (structured output's
    masks cannot verify drafts); the server's request says the same."""
    import dataclasses
    import types

    from mlx_attn.serve import Engine
    from mlx_attn.serve.request_parsing import CompletionRequest

    model = tiny_llama()
    engine = Engine(model, kv_tokens=64, speculative="ngram")
    assert engine.drafts_for() and engine.drafts_for(True)
    assert not engine.drafts_for(False)
    assert not engine.drafts_for(True, constraint=object())
    assert not Engine(model, kv_tokens=64).drafts_for()
    engine.submit("out", [1, 2, 3], 4, speculative=False)
    engine.submit("in", [1, 2, 3], 4)
    by_id = {s.request.request_id: s for s in engine.scheduler.waiting}
    assert by_id["out"].draft_length is None and by_id["in"].draft_length is not None
    request = CompletionRequest(n=1, logprobs=False, top_logprobs=0, stream=False, include_usage=False, stops=[],
                                prompt=[1], max_tokens=1, sampling=[])
    assert request.drafts and not dataclasses.replace(request, speculative=False).drafts
    # a request carrying structured output's constraint (the field that branch adds)
    assert not CompletionRequest.drafts.fget(types.SimpleNamespace(speculative=True, constraint=lambda: None))
