"""mlx_attn.serve: the page pool, the K/V store and the scheduler.

The scheduler is driven by a fake model whose key for the token at position p
encodes (token, p, a hash of every token up to p): after every step each
running request's pages, read through its block table, must hold exactly the
keys of its own tokens. Prefix sharing, copy-on-write, eviction and
preemption cannot put a wrong page in a table without failing that check.
Invariants are checked after every operation."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mlx_attn.paged import gather_pages, paged_attention
from mlx_attn.reference import reference_attention
from mlx_attn.serve import PagedKVStore, PagePool, PoolExhausted, Request, Scheduler, chain_hash
from mlx_attn.serve.pages import ROOT_HASH

from fake_model import DIM, VOCAB, fake_keys, fake_sample


class Harness:
    """A scheduler, a one-layer store and the fake model."""

    def __init__(self, num_pages, page_size, max_batch_tokens, max_running=None, prefill_group_tokens=None):
        self.pool = PagePool(num_pages, page_size)
        self.scheduler = Scheduler(self.pool, max_batch_tokens, max_running, prefill_group_tokens=prefill_group_tokens)
        self.store = PagedKVStore(num_pages, page_size, n_layers=1, n_kv_heads=1, head_dim=DIM, dtype=mx.float32)
        self.outputs: dict = {}
        self.finished: dict = {}

    def submit(self, rid, prompt, max_tokens):
        self.scheduler.submit(Request(rid, tuple(prompt), max_tokens))
        self.outputs[rid] = []

    def step(self):
        plan = self.scheduler.schedule()
        arrays = plan.arrays()
        self.store.copy(plan.copies)
        if plan.rows:
            keys = np.concatenate([fake_keys(self.scheduler.tokens(r.request_id), range(r.start, r.kv_len))
                                   for r in plan.rows])
            self.store.write(0, mx.array(arrays["write_pages"]), mx.array(arrays["write_slots"]),
                             mx.array(keys), mx.array(keys))
        sampled = {}
        for row in plan.rows:  # every row reads exactly its own tokens' keys
            got = np.asarray(gather_pages(self.store.keys[0], list(row.block_table), row.kv_len))
            tokens = self.scheduler.tokens(row.request_id)
            np.testing.assert_array_equal(got.swapaxes(0, 1), fake_keys(tokens, range(row.kv_len)))
            if row.sample:
                sampled[row.request_id] = fake_sample(tokens)
        for result in self.scheduler.commit(plan, sampled):
            self.outputs[result.request_id].append(result.token)
            if result.finished:
                self.finished[result.request_id] = True
        self.scheduler.check_invariants()
        return plan

    def drain(self, limit=2000):
        for _ in range(limit):
            if self.scheduler.idle:
                return
            self.step()
        raise AssertionError("the scheduler did not finish its requests")


def alone(prompt, max_tokens):
    """The tokens a request gets served alone on a large pool."""
    out, tokens = [], list(prompt)
    for _ in range(max_tokens):
        out.append(fake_sample(tokens))
        tokens.append(out[-1])
    return out


# ---------------------------------------------------------------- the pool
def test_pool_reference_counts_sharing_and_release():
    pool = PagePool(6, 2)
    a = pool.allocate("a", 3)
    keys, parent = [], ROOT_HASH
    for i, page in enumerate(a[:2]):
        parent = pool.register(page, parent, [i, i])
        keys.append(parent)
    pool.check_invariants()
    assert pool.lookup([0, 0, 1, 1, 2]) == a[:2]
    assert pool.lookup([0, 0, 2, 2]) == a[:1]  # the second page differs
    assert pool.lookup([1, 1, 1, 1]) == []  # same second page, other parent: no match
    pool.acquire("b", a[:2])
    assert pool.refcount[a[0]] == 2
    pool.check_invariants()
    pool.release("a")
    assert pool.free_pages == 4 and pool.held_pages == 2
    pool.release("b")
    assert pool.cached_pages == 2 and pool.free_pages == 4
    pool.check_invariants()


def test_pool_copy_on_write_and_lru_eviction():
    pool = PagePool(3, 2)
    (page,) = pool.allocate("a", 1)
    key = pool.register(page, ROOT_HASH, [5, 6])
    pool.acquire("b", [page])
    source, destination = pool.make_private("b", 0)
    assert source == page and destination != page and pool.refcount[page] == 1
    assert pool.make_private("b", 0) is None  # already private
    pool.check_invariants()
    pool.release("a")
    pool.release("b")
    assert pool.is_cached(page)
    pool.allocate("c", 3)  # needs the cached page: evicts it
    assert pool.evictions == 1 and pool.lookup([5, 6]) == []
    assert key not in pool._index
    with pytest.raises(PoolExhausted):
        pool.allocate("d", 1)
    pool.check_invariants()


def test_pool_lookup_partial_finds_the_longest_run_of_first_tokens():
    pool = PagePool(6, 4)
    first, second, third = pool.allocate("a", 3)
    parent = pool.register(first, ROOT_HASH, [1, 2, 3, 4])
    pool.register(second, parent, [5, 6, 7, 8])
    other = pool.allocate("c", 1)[0]
    pool.register(other, parent, [5, 6, 9, 9])  # a sibling: the same parent, another continuation
    assert pool.lookup_partial(parent, [5, 6, 7]) == (second, 3)
    assert pool.lookup_partial(parent, [5, 6, 9]) == (other, 3)
    assert pool.lookup_partial(ROOT_HASH, [1, 2]) == (first, 2)
    assert pool.lookup_partial(parent, [5, 7]) in ((second, 1), (other, 1))  # the run stops at a difference
    assert pool.lookup_partial(parent, [5, 6, 7, 8, 9, 1]) == (second, 4)  # at most a page
    assert pool.lookup_partial(parent, [6, 6]) is None  # no page begins with 6 there
    assert pool.lookup_partial(ROOT_HASH, [5, 6]) is None  # another parent
    with pytest.raises(ValueError, match="at least one token"):
        pool.lookup_partial(parent, [])
    pool.check_invariants()
    for holder in ("a", "c"):
        pool.release(holder)
    pool.allocate("d", 6)  # evicts every cached page
    assert pool.lookup_partial(parent, [5, 6]) is None and pool.lookup_partial(ROOT_HASH, [1]) is None
    pool.check_invariants()


def test_chain_hash_depends_on_parent():
    assert chain_hash(ROOT_HASH, [1, 2]) != chain_hash(chain_hash(ROOT_HASH, [0, 0]), [1, 2])
    assert chain_hash(ROOT_HASH, [1, 2]) == chain_hash(ROOT_HASH, (1, 2))


def test_pool_bad_arguments():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="num_pages"):
            PagePool(bad, 4)
        with pytest.raises(ValueError, match="page_size"):
            PagePool(4, bad)


# ---------------------------------------------------------------- the store
@pytest.mark.parametrize("bits", [None, 8, 4])
def test_store_write_copy_and_attend(bits):
    rng = np.random.default_rng(0)
    store = PagedKVStore(5, 4, n_layers=2, n_kv_heads=2, head_dim=32, dtype=mx.float32, bits=bits, group_size=32)
    keys = rng.standard_normal((6, 2, 32)).astype(np.float32)
    values = rng.standard_normal((6, 2, 32)).astype(np.float32)
    pages, slots = mx.array([3, 3, 3, 3, 1, 1]), mx.array([0, 1, 2, 3, 0, 1])
    store.write(1, pages, slots, mx.array(keys), mx.array(values))
    store.copy([(3, 0)])
    table = mx.array([[0, 1]], dtype=mx.int32)
    q = mx.array(rng.standard_normal((2, 4, 32)).astype(np.float32))
    out = store.attend(1, q, table, mx.array([6], dtype=mx.int32), mx.array([2], dtype=mx.int32), scale=0.2)
    dense_k = mx.array(keys.swapaxes(0, 1)[None])
    dense_v = mx.array(values.swapaxes(0, 1)[None])
    want = reference_attention(q.swapaxes(0, 1)[None], dense_k, dense_v, scale=0.2, mask="causal")[0].swapaxes(0, 1)
    tolerance = {None: 1e-5, 8: 0.05, 4: 0.5}[bits]
    assert np.abs(np.asarray(out) - np.asarray(want)).max() < tolerance
    if bits is not None:
        assert store.nbytes < PagedKVStore(5, 4, 2, 2, 32, dtype=mx.float32).nbytes * (0.35 if bits == 4 else 0.6)


@pytest.mark.parametrize("bits", [None, 8])
def test_store_layers_of_their_own_shapes(bits):
    """``layer_shapes``: each layer's pages have its KV heads and dims
    (Gemma 4's wider full-attention layers); a write and attend on the wide
    layer leaves the narrow one as it was; the count of shapes must match."""
    shapes = [(2, 32, 32), (1, 64, 64)]
    store = PagedKVStore(3, 4, 2, 0, 0, dtype=mx.float32, bits=bits, group_size=32, layer_shapes=shapes)
    first = lambda x: x[0] if isinstance(x, tuple) else x  # noqa: E731 (packed words of a quantized triple)
    assert [(first(k).shape[1], first(v).shape[1]) for k, v in zip(store.keys, store.values)] == [(2, 2), (1, 1)]
    if bits is None:
        assert [k.shape[3] for k in store.keys] == [32, 64]
    narrow_before = np.asarray(first(store.keys[0])).copy()
    rng = np.random.default_rng(1)
    keys, values = (mx.array(rng.standard_normal((3, 1, 64)).astype(np.float32)) for _ in range(2))
    store.write(1, mx.array([2, 2, 2]), mx.array([0, 1, 2]), keys, values)
    q = mx.array(rng.standard_normal((1, 2, 64)).astype(np.float32))
    out = store.attend(1, q, mx.array([[2]], dtype=mx.int32), mx.array([3], dtype=mx.int32),
                       mx.array([1], dtype=mx.int32), scale=0.125)
    want = reference_attention(q.swapaxes(0, 1)[None], keys.swapaxes(0, 1)[None], values.swapaxes(0, 1)[None],
                               scale=0.125)[0].swapaxes(0, 1)
    assert out.shape == (1, 2, 64)
    assert np.abs(np.asarray(out) - np.asarray(want)).max() < (1e-5 if bits is None else 0.05)
    assert np.array_equal(np.asarray(first(store.keys[0])), narrow_before)
    with pytest.raises(ValueError, match="layer_shapes has 2 entries for 3 layers"):
        PagedKVStore(3, 4, 3, 0, 0, layer_shapes=shapes)


# ---------------------------------------------------------------- the scheduler
def test_batch_equals_alone_with_shared_prefixes_and_preemption():
    harness = Harness(num_pages=12, page_size=4, max_batch_tokens=10)
    prompts = {f"r{i}": [0, 1, 2, 0, 1, 2, 0] + [i % VOCAB] * (i % 5) for i in range(8)}
    prompts["whole"] = [0, 1, 2, 0, 1, 2, 0, 1]  # page-aligned: shares everything, copies the last page
    for rid, prompt in prompts.items():
        harness.submit(rid, prompt, max_tokens=9)
        harness.scheduler.check_invariants()
    harness.drain()
    for rid, prompt in prompts.items():
        assert harness.outputs[rid] == alone(prompt, 9), rid
    assert harness.scheduler.preemptions > 0  # the small pool forced some
    pool = harness.pool
    assert pool.held_pages == 0 and pool.free_pages + pool.cached_pages == pool.num_pages


def test_prefix_cache_hit_and_copy_on_write():
    harness = Harness(num_pages=16, page_size=4, max_batch_tokens=64)
    prompt = [1, 2, 0, 1, 2, 0, 1, 2]
    harness.submit("first", prompt, max_tokens=2)
    harness.drain()
    harness.submit("again", prompt, max_tokens=2)
    plan = harness.step()
    assert harness.scheduler.cached_tokens("again") == 7  # the last token is recomputed
    assert len(plan.copies) == 1 and plan.rows[0].start == 7 and plan.rows[0].tokens == (2,)
    harness.drain()
    assert harness.outputs["again"] == harness.outputs["first"] == alone(prompt, 2)
    stats = harness.scheduler.stats()
    assert stats["prompt_tokens"] == 16 and stats["cached_prompt_tokens"] == 7 and stats["copies"] == 1
    assert stats["pages_held"] == 0 and stats["pages_cached"] + stats["pages_free"] == 16


def test_prompt_reuses_a_cached_page_that_begins_with_its_last_tokens():
    """A prompt ending inside a page whose cached page (same prefix) begins
    with its last tokens copies that page and computes only its last token;
    a prompt that differs inside the page computes from the page start.
    The harness checks every row reads its own tokens' keys."""
    harness = Harness(num_pages=16, page_size=4, max_batch_tokens=64)
    prompt = [1, 2, 0, 1, 2, 0]
    harness.submit("first", prompt, max_tokens=3)  # its tokens fill the second page
    harness.drain()
    harness.submit("again", prompt, max_tokens=3)
    plan = harness.step()
    assert harness.scheduler.cached_tokens("again") == 5
    assert len(plan.copies) == 1 and plan.rows[0].start == 5 and plan.rows[0].tokens == (0,)
    harness.drain()
    assert harness.outputs["again"] == harness.outputs["first"] == alone(prompt, 3)
    harness.submit("differs", [1, 2, 0, 1, 9, 9], max_tokens=2)
    plan = harness.step()
    assert harness.scheduler.cached_tokens("differs") == 4 and not plan.copies
    harness.drain()
    assert harness.outputs["differs"] == alone([1, 2, 0, 1, 9, 9], 2)
    assert harness.pool.held_pages == 0


def test_refusal_waiting_cancel_and_budget():
    harness = Harness(num_pages=4, page_size=4, max_batch_tokens=5)
    with pytest.raises(ValueError, match="can never fit"):
        harness.submit("huge", [0] * 14, max_tokens=4)  # 17 keys > 16 slots
    harness.submit("edge", [0] * 14, max_tokens=3)  # 16 keys: fits exactly
    with pytest.raises(ValueError, match="already queued"):
        harness.submit("edge", [1], max_tokens=1)
    with pytest.raises(ValueError, match="prompt"):
        harness.submit("empty", [], max_tokens=1)
    with pytest.raises(ValueError, match="max_tokens"):
        harness.submit("zero", [1], max_tokens=0)
    harness.submit("next", [2, 2], max_tokens=2)
    plan = harness.step()
    assert plan.num_tokens == 5 and [r.request_id for r in plan.rows] == ["edge"]  # chunked, budget 5
    assert harness.scheduler.waiting[0].request.request_id == "next"  # no page for it yet
    assert harness.scheduler.cancel("edge") and not harness.scheduler.cancel("edge")
    harness.scheduler.check_invariants()
    assert harness.pool.held_pages == 0
    harness.drain()
    assert harness.outputs["next"] == alone([2, 2], 2)


def test_prefill_groups_first_come_first_served():
    harness = Harness(num_pages=64, page_size=4, max_batch_tokens=64, prefill_group_tokens=6)
    prompts = {f"r{i}": [i % VOCAB, 1, 2] for i in range(6)}
    for rid, prompt in prompts.items():
        harness.submit(rid, prompt, max_tokens=4)
    started = []  # the requests that got their first token, step by step
    for _ in range(3):
        harness.step()
        started.append(sorted(rid for rid, out in harness.outputs.items() if out))
    # two 3-token prompts fill a group of 6 rows; the started ones decode beside the next group
    assert started == [["r0", "r1"], ["r0", "r1", "r2", "r3"], [f"r{i}" for i in range(6)]]
    harness.drain()
    for rid, prompt in prompts.items():
        assert harness.outputs[rid] == alone(prompt, 4), rid
    # a prompt longer than the group still runs in chunks of the whole budget, and nothing joins it
    harness = Harness(num_pages=64, page_size=4, max_batch_tokens=10, prefill_group_tokens=4)
    harness.submit("long", list(range(VOCAB)) * 5, max_tokens=2)  # 15 tokens
    harness.submit("short", [1, 2], max_tokens=2)
    plan = harness.step()
    assert [(r.request_id, len(r.tokens)) for r in plan.rows] == [("long", 10)]
    harness.drain()
    assert harness.outputs["short"] == alone([1, 2], 2)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="prefill_group_tokens"):
            Scheduler(PagePool(4, 4), 8, prefill_group_tokens=bad)


def test_plan_arrays_feed_paged_attention():
    harness = Harness(num_pages=8, page_size=3, max_batch_tokens=6)
    harness.submit("a", [0, 1, 2, 0], max_tokens=3)
    harness.step()
    harness.submit("b", [0, 1, 2, 1, 1], max_tokens=3)
    plan = harness.scheduler.schedule()
    arrays = plan.arrays()
    # "b" shares "a"'s first page (0, 1, 2): only its last two tokens run
    assert arrays["q_lens"].tolist() == [1, 2] and arrays["kv_lens"].tolist() == [5, 5]
    assert arrays["block_table"][0, 0] == arrays["block_table"][1, 0]
    assert arrays["positions"].tolist() == [4, 3, 4]
    k = harness.store.keys[0]
    q = mx.ones((int(arrays["q_lens"].sum()), 1, DIM))
    out = paged_attention(q, k, k, mx.array(arrays["block_table"]), mx.array(arrays["kv_lens"]),
                          q_lens=mx.array(arrays["q_lens"]), scale=0.0)
    assert out.shape == (3, 1, DIM)


class SchedulerMachine(RuleBasedStateMachine):
    """Random submits, steps and cancels on a small pool."""

    @initialize(num_pages=st.integers(3, 10), page_size=st.sampled_from([1, 2, 3, 4]),
                budget=st.integers(1, 12), max_running=st.one_of(st.none(), st.integers(1, 4)),
                group=st.one_of(st.none(), st.integers(1, 8)))
    def setup(self, num_pages, page_size, budget, max_running, group):
        self.harness = Harness(num_pages, page_size, budget, max_running, prefill_group_tokens=group)
        self.count = 0
        self.expected = {}

    @rule(prefix=st.sampled_from([(), (0, 1, 2), (0, 1, 2, 0, 1, 2), (2, 2)]),
          suffix=st.lists(st.integers(0, VOCAB - 1), max_size=5), max_tokens=st.integers(1, 6))
    def submit(self, prefix, suffix, max_tokens):
        prompt = list(prefix) + suffix or [1]
        rid = f"r{self.count}"
        self.count += 1
        fits = math.ceil((len(prompt) + max_tokens - 1) / self.harness.pool.page_size) <= self.harness.pool.num_pages
        if fits:
            self.harness.submit(rid, prompt, max_tokens)
            self.expected[rid] = alone(prompt, max_tokens)
        else:
            with pytest.raises(ValueError, match="can never fit"):
                self.harness.submit(rid, prompt, max_tokens)

    @rule()
    def step(self):
        self.harness.step()

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def cancel(self, data):
        rid = data.draw(st.sampled_from(sorted(self.expected)))
        if rid not in self.harness.finished:
            self.harness.scheduler.cancel(rid)
        self.expected.pop(rid)

    @invariant()
    def consistent(self):
        if hasattr(self, "harness"):
            self.harness.scheduler.check_invariants()

    def teardown(self):
        if not hasattr(self, "harness"):
            return
        self.harness.drain()
        for rid, want in self.expected.items():
            assert self.harness.outputs[rid] == want, rid
        pool = self.harness.pool
        assert pool.held_pages == 0 and pool.free_pages + pool.cached_pages == pool.num_pages


SchedulerMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_scheduler_state_machine = SchedulerMachine.TestCase


# ---------------------------------------------------------------- the engine on a model
def tiny_llama(seed=0, head_dim=8):
    from mlx.utils import tree_map

    from mlx_attn.lm.models.llama import Llama, LlamaConfig

    mx.random.seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                         max_position_embeddings=256)
    model = Llama(config, backend="reference")
    # larger random weights than the default init: sharper, tie-free logits
    model.update(tree_map(lambda w: w * 4, model.parameters()))
    mx.eval(model.parameters())
    return model


def greedy_alone(model, prompt, max_tokens):
    """Dense KV caches, one request: the model's default attention path."""
    cache = model.make_cache()
    logits = model(mx.array([prompt]), cache=cache)
    out = []
    for _ in range(max_tokens):
        token = int(mx.argmax(logits[0, -1]).item())
        out.append(token)
        logits = model(mx.array([[token]]), cache=cache)
    return out


@pytest.mark.parametrize("kv_bits", [None, 8])
def test_engine_batch_greedy_equals_each_request_alone(kv_bits):
    from mlx_attn.serve import Engine

    model = tiny_llama(head_dim=8 if kv_bits is None else 32)
    rng = np.random.default_rng(1)
    system = rng.integers(0, 64, 11).tolist()
    prompts = {f"r{i}": (system if i % 2 else []) + rng.integers(0, 64, int(rng.integers(1, 9))).tolist()
               for i in range(6)}
    prompts["copy"] = list(prompts["r1"])  # a whole shared prompt
    max_tokens = {rid: 3 + i % 4 for i, rid in enumerate(prompts)}
    # 8 pages of 4 tokens: too few for all at once (preemption); budget 12: chunked prefill
    engine = Engine(model, kv_tokens=32, page_size=4, max_batch_tokens=12, dtype=mx.float32,
                    kv_bits=kv_bits, group_size=32)
    for rid, prompt in prompts.items():
        engine.submit(rid, prompt, max_tokens[rid])
    got = engine.run_until_idle(max_steps=400)
    engine.scheduler.check_invariants()
    # again on the warm prefix cache: a page-aligned prompt shares every page and copies its last
    for rid, prompt in (("aligned", prompts["r1"][:8]), ("again", prompts["r3"])):
        prompts[rid], max_tokens[rid] = prompt, 4
        engine.submit(rid, prompt, 4)
    cached_before = engine.scheduler.cached_prompt_tokens
    got.update(engine.run_until_idle(max_steps=400))
    assert engine.scheduler.copies >= 1 and engine.scheduler.cached_prompt_tokens - cached_before >= 7 + 8
    assert engine.pool.held_pages == 0
    if kv_bits is None:
        for rid, prompt in prompts.items():
            assert got[rid] == greedy_alone(model, prompt, max_tokens[rid]), rid
        assert engine.scheduler.preemptions > 0 and engine.pool.cached_pages > 0
    else:  # quantized pages: the batch equals each request alone on the same quantized pages
        for rid, prompt in prompts.items():
            solo = Engine(model, kv_tokens=64, page_size=4, max_batch_tokens=64, dtype=mx.float32,
                          kv_bits=kv_bits, group_size=32)
            solo.submit(rid, prompt, max_tokens[rid])
            assert got[rid] == solo.run_until_idle()[rid], rid


def test_engine_reused_partial_page_gives_the_dense_models_tokens():
    """The second of two equal prompts (ending inside a page) reuses the
    first's cached page but its last token: the dense model's tokens."""
    from mlx_attn.serve import Engine

    model = tiny_llama(seed=4)
    prompt = [5, 1, 7, 3, 2, 6, 4, 1, 9, 3]  # 2 full pages of 4 and 2 tokens
    engine = Engine(model, kv_tokens=64, page_size=4, dtype=mx.float32)
    engine.submit("first", prompt, 5)
    first = engine.run_until_idle()["first"]
    engine.submit("again", prompt, 5)
    again = [o.token for o in engine.step()]  # the reused page's copy, then the last prompt token's row
    assert engine.cached_tokens("again") == len(prompt) - 1
    again += engine.run_until_idle()["again"]
    want = greedy_alone(model, prompt, 5)
    assert first == want and again == want


def test_engine_reuses_the_first_tokens_of_a_page_a_prompt_diverges_in():
    """A prompt that leaves a cached prompt inside a page reuses that page's
    K/V up to where they differ (copied: it writes its own tokens after), and
    computes the rest: the dense model's tokens, with and without chunks."""
    from mlx_attn.serve import Engine

    model = tiny_llama(seed=5)
    first = [5, 1, 7, 3, 2, 6, 4, 1, 9, 3, 8, 8]  # 3 full pages of 4
    diverging = first[:6] + [11, 12, 13, 14, 15]  # page 2 shared up to its 2nd token, then 5 own tokens
    for budget in (64, 3):
        engine = Engine(model, kv_tokens=64, page_size=4, max_batch_tokens=budget, dtype=mx.float32)
        engine.submit("first", first, 4)
        engine.run_until_idle()
        engine.submit("diverging", diverging, 6)
        got = [o.token for o in engine.step()]  # admitted: the shared page copied, the rest computed
        assert engine.cached_tokens("diverging") == 6  # one full page and 2 tokens of the next
        engine.scheduler.check_invariants()
        got += engine.run_until_idle()["diverging"]
        assert got == greedy_alone(model, diverging, 6), budget
        engine.submit("first again", first, 4)  # the first prompt's cached pages were not written to
        again = [o.token for o in engine.step()]
        assert engine.cached_tokens("first again") == len(first) - 1
        again += engine.run_until_idle()["first again"]
        assert again == greedy_alone(model, first, 4), budget


def test_engine_refuses_bad_requests_and_stops_on_stop_tokens():
    from mlx_attn.serve import Engine

    model = tiny_llama()
    engine = Engine(model, kv_tokens=64, page_size=4, dtype=mx.float32)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.submit("a", [1, 64], 2)
    with pytest.raises(ValueError, match="token ids"):
        engine.submit("a", [1.5], 2)
    with pytest.raises(ValueError, match="context"):
        engine.submit("a", [1] * 250, 7)
    with pytest.raises(ValueError, match="can never fit"):
        engine.submit("a", [1] * 60, 6)
    want = greedy_alone(model, [3, 4, 5], 6)
    engine.submit("stop", [3, 4, 5], 6, stop_token_ids=[want[2]])
    got = engine.run_until_idle()
    assert got["stop"] == want[: want.index(want[2]) + 1]
    assert engine.pool.held_pages == 0


def test_sample_rows_reports_the_models_log_probabilities():
    """Greedy, biased and top-logprob rows of one draw: each token is the
    argmax of its (biased) row, its log-probability and its best tokens
    those of the unbiased row's log-softmax (a float64 oracle)."""
    from mlx_attn.serve.sampling import SamplingParams, sample_rows

    rng = np.random.default_rng(21)
    logits = rng.standard_normal((3, 500)).astype(np.float32) * 6
    logits[1, 7] = 50.0  # the biased row's own best, forbidden below
    bias = np.zeros((1, 500), np.float32)
    bias[0, 7] = -np.inf
    params = [SamplingParams(logprobs=True), SamplingParams(top_logprobs=4), SamplingParams(top_logprobs=2)]
    got = sample_rows(mx.array(logits), params, [(), (), ()], [0, 0, 0], ([1], mx.array(bias)))
    unreported = sample_rows(mx.array(logits), [SamplingParams()] * 3, [(), (), ()], [0, 0, 0], ([1], mx.array(bias)))
    x = logits.astype(np.float64)
    oracle = x - (x.max(-1, keepdims=True) + np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)))
    chosen = (logits + np.pad(bias, ((1, 1), (0, 0)))).argmax(-1)
    assert [s.token for s in got] == chosen.tolist() and chosen[1] != 7
    assert [s.token for s in unreported] == chosen.tolist()  # no logprobs asked for: the same tokens, None
    assert all(s.logprob is None and s.top_logprobs == () for s in unreported)
    np.testing.assert_allclose([s.logprob for s in got], oracle[np.arange(3), chosen], atol=2e-5, rtol=0)
    for row, sampled in enumerate(got):
        want = np.argsort(-oracle[row], kind="stable")[: params[row].top_logprobs]
        assert [t for t, _ in sampled.top_logprobs] == want.tolist()
        np.testing.assert_allclose([lp for _, lp in sampled.top_logprobs], oracle[row, want], atol=2e-5, rtol=0)


def test_seeded_sampling_is_batch_independent_and_logprobs_are_the_models():
    from mlx_attn.serve import Engine, SamplingParams

    model = tiny_llama(seed=3)
    rng = np.random.default_rng(2)
    prompts = {f"s{i}": rng.integers(0, 64, int(rng.integers(2, 12))).tolist() for i in range(5)}
    params = {rid: SamplingParams(temperature=1.5, top_k=20 if i % 2 else 0, top_p=0.95, seed=100 + i,
                                  repetition_penalty=1.2 if i == 3 else 1.0, logprobs=True)
              for i, rid in enumerate(prompts)}

    def serve(rids, kv_tokens, budget):
        engine = Engine(model, kv_tokens=kv_tokens, page_size=4, max_batch_tokens=budget, dtype=mx.float32)
        for rid in rids:
            engine.submit(rid, prompts[rid], 6, sampling=params[rid])
        out = {}
        for _ in range(300):
            if engine.scheduler.idle:
                return out, engine
            for o in engine.step():
                out.setdefault(o.request_id, []).append((o.token, o.logprob))
        raise AssertionError("engine did not finish")

    batch, engine = serve(list(prompts), kv_tokens=40, budget=9)  # small pool, chunked prefill
    assert engine.sampling == {} and engine.generated == {}  # finished requests forgotten
    for rid in prompts:
        alone_out, _ = serve([rid], kv_tokens=64, budget=64)
        assert [t for t, _ in batch[rid]] == [t for t, _ in alone_out[rid]], rid
        np.testing.assert_allclose([lp for _, lp in batch[rid]], [lp for _, lp in alone_out[rid]], atol=1e-4)
    # the logprob is the model's: dense forward over the request's own tokens
    rid = "s0"
    tokens = prompts[rid] + [t for t, _ in batch[rid]]
    logits = model(mx.array([tokens[:-1]])).astype(mx.float32)[0]
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    n = len(prompts[rid])
    want = [logprobs[n - 1 + i, t].item() for i, (t, _) in enumerate(batch[rid])]
    np.testing.assert_allclose([lp for _, lp in batch[rid]], want, atol=1e-4)
    assert len({tuple(t for t, _ in v) for v in batch.values()}) > 1
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=-3)


def test_nothing_below_serve_imports_it():
    """At import time nothing below serve imports it; the one exception is
    the ``mlx-attn serve`` handler in the CLI, which imports it when run."""
    import ast
    import subprocess
    import sys
    from pathlib import Path

    import mlx_attn

    root = Path(mlx_attn.__file__).parent
    below = [p for p in root.rglob("*.py") if "serve" not in p.relative_to(root).parts]

    def imports_serve(node) -> bool:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] + [f"{node.module}.{a.name}" if node.module else a.name for a in node.names]
        else:
            return False
        return any(n == "mlx_attn.serve" or n.startswith("mlx_attn.serve.") or n == "serve" for n in names)

    def module_level(tree):  # statements run at import: not inside functions or classes' methods
        stack = list(tree.body)
        while stack:
            node = stack.pop()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            yield node
            stack.extend(ast.iter_child_nodes(node))

    offenders = [p for p in below if any(imports_serve(n) for n in module_level(ast.parse(p.read_text())))]
    assert below and not offenders
    lazy = [p.relative_to(root).as_posix() for p in below
            if any(imports_serve(n) for n in ast.walk(ast.parse(p.read_text())))]
    assert lazy in ([], ["lm/cli.py"])
    loaded = subprocess.run([sys.executable, "-c", "import sys, mlx_attn.lm.cli, mlx_attn.lm.__main__; "
                             "print(any(m.startswith('mlx_attn.serve') for m in sys.modules))"],
                            capture_output=True, text=True, timeout=120)
    assert loaded.stdout.strip() == "False", loaded.stderr


def test_quantized_model_batch_greedy_equals_each_request_alone():
    """4-bit weights (as the default model's): steps of one row and of many
    read the packed codes or the held float32 weights, with the same weight
    values; each request's greedy tokens in a batch equal it served alone."""
    import mlx.nn as nn

    from mlx_attn.serve import Engine

    model = tiny_llama(seed=9, head_dim=32)
    nn.quantize(model, group_size=32, bits=4, class_predicate=lambda _, m: hasattr(m, "to_quantized")
                and m.weight.shape[-1] % 32 == 0)
    rng = np.random.default_rng(4)
    prompts = {f"r{i}": rng.integers(0, 64, int(rng.integers(1, 30))).tolist() for i in range(6)}
    engine = Engine(model, kv_tokens=256, page_size=4, max_batch_tokens=64)
    for rid, prompt in prompts.items():
        engine.submit(rid, prompt, 6)
    got = engine.run_until_idle(max_steps=400)
    for rid, prompt in prompts.items():
        solo = Engine(model, kv_tokens=256, page_size=4, max_batch_tokens=64)
        solo.submit(rid, prompt, 6)
        assert got[rid] == solo.run_until_idle()[rid], rid


def test_packed_weights_never_dequantize_a_model_made_row_adaptive_at_load(monkeypatch):
    """A GGUF model is row-adaptive from its loading (many rows dequantized);
    the engine's "packed" weights must still keep every step size on the
    integer product (a 228-token prefill dequantizing each layer took
    2.2-30 s against ~2 s)."""
    import mlx.nn as nn

    from mlx_attn.lm import quantized_matmul
    from mlx_attn.lm.quantized_matmul import matvec_rows_limit, use_row_adaptive_matmuls
    from mlx_attn.serve.engine import prepare_weights

    model = tiny_llama(seed=6, head_dim=32)
    nn.quantize(model, group_size=32, bits=4, class_predicate=lambda _, m: hasattr(m, "to_quantized")
                and m.weight.shape[-1] % 32 == 0)
    use_row_adaptive_matmuls(model)  # as mlx_attn.lm.loading does
    if mx.default_device() != mx.cpu or quantized_matmul.MATVEC_PRODUCT == "float":
        pytest.skip("the packed weights' integer product is the CPU's, with an integer MATVEC_PRODUCT")
    assert prepare_weights(model, "packed") == "packed"

    def dequantized(*_):
        raise AssertionError("a packed layer dequantized its weight")

    monkeypatch.setattr(quantized_matmul, "dequantized_matmul", dequantized)
    mx.eval(model(mx.array([[i % 50 + 1 for i in range(matvec_rows_limit() + 8)]])))


def test_prepare_weights_packed_holds_no_float32_weight(monkeypatch):
    """"packed" (auto on the CPU with an integer matvec product): float
    weights in float32, quantized layers row-adaptive with only their codes;
    the engine's greedy tokens are the dense decode's. With the float
    product, auto holds float32 weights as before."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from mlx_attn.lm import quantized_matmul
    from mlx_attn.lm.quantized_matmul import RowAdaptiveQuantizedEmbedding, RowAdaptiveQuantizedLinear, float32_weight
    from mlx_attn.serve import Engine
    from mlx_attn.serve.engine import prepare_weights

    model = tiny_llama(seed=6, head_dim=32)
    nn.quantize(model, group_size=32, bits=4, class_predicate=lambda _, m: hasattr(m, "to_quantized")
                and m.weight.shape[-1] % 32 == 0)
    prompt = mx.array([[3, 9, 27, 1, 44]])
    logits = np.array(model(prompt))
    assert prepare_weights(model, "packed") == "packed"
    quantized = [m for _, m in model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]
    assert quantized and all(isinstance(m, (RowAdaptiveQuantizedLinear, RowAdaptiveQuantizedEmbedding))
                             for m in quantized)
    assert all(float32_weight(m) is None for m in quantized)
    # (scales and biases as loaded: float32 here; test_packed_weights_keep_the_products_scales_as_loaded)
    assert all(a.dtype in (mx.float32, mx.uint32) for _, a in tree_flatten(model.parameters()))
    # int16 activations (5 rows: the integer product): measured within 0.1% of the logits' largest magnitude
    np.testing.assert_allclose(np.array(model(prompt)), logits, rtol=0, atol=2e-3 * np.abs(logits).max())
    engine = Engine(model, kv_tokens=64, page_size=4, weights="packed")
    engine.submit("a", [3, 9, 27, 1, 44], 5)
    assert engine.run_until_idle()["a"] == greedy_alone(model, [3, 9, 27, 1, 44], 5)
    if mx.default_device() == mx.cpu:
        assert prepare_weights(model, "auto") == "packed"
        monkeypatch.setattr(quantized_matmul, "MATVEC_PRODUCT", "float")
        assert prepare_weights(model, "auto") == "float32"
        assert all(float32_weight(m) is not None for m in quantized)


def test_packed_weights_keep_the_products_scales_as_loaded():
    """"packed" casts float weights to float32 but leaves the scales and
    biases of the linear layers the integer products read as loaded (float16
    here: half the bytes a step streams for them; the embedding's become
    float32); logits, embedding rows and greedy tokens equal those of the
    same model with every float cast to float32 first (the products convert
    float16 scales to float32 exactly), bit for bit."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten, tree_map

    from mlx_attn.lm import quantized_matmul
    from mlx_attn.lm.quantized_matmul import use_row_adaptive_matmuls
    from mlx_attn.serve import Engine
    from mlx_attn.serve.engine import prepare_weights

    if mx.default_device() != mx.cpu or quantized_matmul.MATVEC_PRODUCT == "float":
        pytest.skip("the packed weights' integer product is the CPU's, with an integer MATVEC_PRODUCT")

    def half_model():
        model = tiny_llama(seed=7, head_dim=32)
        model.update(tree_map(lambda a: a.astype(mx.float16), model.parameters()))
        nn.quantize(model, group_size=32, bits=4, class_predicate=lambda _, m: hasattr(m, "to_quantized")
                    and m.weight.shape[-1] % 32 == 0)
        return model

    packed, cast = half_model(), half_model()
    assert prepare_weights(packed, "packed") == "packed"
    # the rule before: every float parameter in float32, then the integer product at every row count
    cast.update(tree_map(lambda a: a.astype(mx.float32) if mx.issubdtype(a.dtype, mx.floating) else a,
                         cast.parameters()))
    use_row_adaptive_matmuls(cast, dequantize_many_rows=False)
    dtypes = dict(tree_flatten(tree_map(lambda a: a.dtype, packed.parameters())))
    scales = {p for p in dtypes if p.endswith((".scales", ".biases")) and not p.startswith("embed_tokens.")}
    assert "layers.0.self_attn.q_proj.biases" in scales and "embed_tokens.scales" in dtypes
    assert all(dtypes[p] == mx.float16 for p in scales)
    assert all(dtypes[p] in (mx.float32, mx.uint32) for p in dtypes if p not in scales)
    tokens = mx.array([[3, 9, 27, 1, 44]])
    got, want = packed.embed_tokens(tokens), cast.embed_tokens(tokens)
    assert got.dtype == mx.float32
    np.testing.assert_array_equal(np.array(got), np.array(want))
    for prompt in (tokens, tokens[:, :1]):
        np.testing.assert_array_equal(np.array(packed(prompt)), np.array(cast(prompt)))
    engines = [Engine(m, kv_tokens=64, page_size=4, weights="as-loaded") for m in (packed, cast)]
    for engine in engines:
        engine.submit("a", [3, 9, 27, 1, 44], 6)
    assert engines[0].run_until_idle()["a"] == engines[1].run_until_idle()["a"]


def test_prepare_weights_float32_is_the_dequantized_model(monkeypatch):
    """With the float matrix-vector product (the int16 one rounds the
    activations: test_prepare_weights_packed_holds_no_float32_weight)."""
    import mlx.nn as nn

    from mlx_attn.lm import quantized_matmul

    monkeypatch.setattr(quantized_matmul, "MATVEC_PRODUCT", "float")

    from mlx_attn.lm.quantized_matmul import float32_weight
    from mlx_attn.serve import Engine
    from mlx_attn.serve.engine import prepare_weights

    model = tiny_llama(seed=5, head_dim=32)
    # the layers MLX can quantize in groups of 32 (input width 32), 4 bits; the embedding too
    nn.quantize(model, group_size=32, bits=4, class_predicate=lambda _, m: hasattr(m, "to_quantized")
                and m.weight.shape[-1] % 32 == 0)
    quantized = {path: m for path, m in model.named_modules() if isinstance(m, (nn.QuantizedLinear,
                                                                                 nn.QuantizedEmbedding))}
    assert "embed_tokens" in quantized and "layers.0.self_attn.q_proj" in quantized
    want = {path: mx.dequantize(m.weight, m.scales, m.biases, m.group_size, m.bits) for path, m in quantized.items()}
    prompt = mx.array([[3, 9, 27, 1, 44]])
    logits = model(prompt)
    assert prepare_weights(model, "as-loaded") == "as-loaded"
    assert isinstance(dict(model.named_modules())["embed_tokens"], nn.QuantizedEmbedding)
    with pytest.raises(ValueError, match="weights"):
        prepare_weights(model, "int3")
    assert prepare_weights(model, "float32") == "float32"
    modules = dict(model.named_modules())
    for path, weight in want.items():
        # still quantized (a one-row step reads the packed weight), holding the same weight in float32
        assert isinstance(modules[path], (nn.QuantizedLinear, nn.QuantizedEmbedding)), path
        # scale * code + bias as one fused multiply-add (the fused matvec's rounding): within one float32
        # rounding of mx.dequantize's separate multiply and add
        np.testing.assert_allclose(np.array(float32_weight(modules[path])), np.array(weight.astype(mx.float32)),
                                   rtol=2e-7, atol=1e-7)
    from mlx.utils import tree_flatten

    assert all(a.dtype in (mx.float32, mx.uint32) for _, a in tree_flatten(model.parameters()))
    np.testing.assert_allclose(np.array(model(prompt)), np.array(logits), rtol=1e-4, atol=1e-4)  # float32 sums in another order
    # the engine on it: pages in the activations' dtype, greedy tokens = the dense decode
    engine = Engine(model, kv_tokens=64, page_size=4, weights="float32")
    assert engine.store.dtype == mx.float32
    assert prepare_weights(model, "auto") == ("float32" if mx.default_device() == mx.cpu else "as-loaded")
    engine.submit("a", [3, 9, 27, 1, 44], 5)
    assert engine.cached_tokens("a") == 0
    assert engine.run_until_idle()["a"] == greedy_alone(model, [3, 9, 27, 1, 44], 5)
    with pytest.raises(ValueError, match="request_id"):
        engine.cached_tokens("a")  # finished: forgotten


def test_engine_serves_gemma3_sliding_window_layers():
    """A second architecture (sliding-window and global layers, the output
    projection tied to the embedding): batched greedy tokens = dense alone."""
    from test_gemma3 import tiny_gemma

    from mlx_attn.serve import Engine

    model = tiny_gemma(seed=4)
    rng = np.random.default_rng(5)
    prompts = {f"g{i}": rng.integers(0, 61, int(rng.integers(3, 14))).tolist() for i in range(4)}
    engine = Engine(model, kv_tokens=96, page_size=4, max_batch_tokens=10, dtype=mx.float32)
    for rid, prompt in prompts.items():
        engine.submit(rid, prompt, 6)
    got = engine.run_until_idle(max_steps=200)
    for rid, prompt in prompts.items():
        assert got[rid] == greedy_alone(model, prompt, 6), rid
