"""The scheduler: each step, which request runs which token positions in
which pages, as pure data (:class:`StepPlan`); no model, no arrays of K/V.

A step holds, under a token budget (``max_batch_tokens``):

1. the decode row of every running request (one token each, oldest first);
2. the next prefill chunk of every admitted request still prefilling;
3. chunks of waiting requests, admitted first come first served while the
   pool has pages for their whole prompt (less the pages found in the prefix
   cache); a request that does not fit waits, and so do those behind it; no
   request is admitted in a step that had to preempt. With
   ``prefill_group_tokens``, a waiting request joins a step only while the
   step's prefill rows are fewer than that: prompts that arrive together
   are prefilled in groups, first come first served, rather than all in one
   step (see :class:`Scheduler`).

A request that can never fit (its prompt plus ``max_tokens`` need more pages
than the pool has) is refused at :meth:`Scheduler.submit` with a
``ValueError``. When a decode row needs a page and none is free or cached,
the most recently admitted request not yet in this step is preempted: its
pages are released (its full pages stay in the prefix cache) and it goes
back to the front of the queue, to be recomputed from its prompt and the
tokens it generated. The oldest request is never preempted by a younger one,
so it always progresses and, fitting the pool alone, finishes.

After the model ran a plan, :meth:`Scheduler.commit` records the computed
positions, indexes the pages that became full and appends the sampled tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np

from mlx_attn.core.checks import check_int, check_optional_int
from mlx_attn.lm.speculative import DEFAULT_NUM_DRAFT_TOKENS, DraftLength, StepCost
from mlx_attn.serve.pages import ROOT_HASH, PagePool, PoolExhausted, chain_hash

__all__ = ["Request", "ScheduledRow", "StepPlan", "Scheduler", "StepResult", "Speculation"]


@dataclass(frozen=True)
class Request:
    request_id: Hashable
    prompt: tuple[int, ...]
    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    speculate: bool = True  # False: never draft for this request (when the scheduler drafts)


@dataclass(frozen=True)
class ScheduledRow:
    """One request's rows in a step: the tokens at positions
    ``start .. start + len(tokens) - 1``, attending to keys ``0 .. kv_len - 1``
    in the pages of ``block_table``; ``sample``: the last row's logits give
    the request's next token (with ``drafts``, the logits of the last
    ``drafts + 1`` rows verify the drafts and give one token more)."""

    request_id: Hashable
    start: int
    tokens: tuple[int, ...]
    block_table: tuple[int, ...]
    sample: bool
    drafts: int = 0  # the last ``drafts`` tokens are proposed, to be verified by their logits

    @property
    def kv_len(self) -> int:
        return self.start + len(self.tokens)


@dataclass(frozen=True)
class StepPlan:
    rows: tuple[ScheduledRow, ...]
    copies: tuple[tuple[int, int], ...]  # copy-on-write (source, destination) pages, before the forward
    preempted: tuple[Hashable, ...]
    page_size: int

    @property
    def num_tokens(self) -> int:
        return sum(len(r.tokens) for r in self.rows)

    def arrays(self) -> dict[str, np.ndarray]:
        """The step as int32 arrays: ``tokens``, ``positions``, ``write_pages``
        and ``write_slots`` (``[total]``, where each token's K/V goes),
        ``q_lens``, ``kv_lens`` (``[B]``) and ``block_table`` (``[B, max_pages]``,
        padded with -1), the arguments of :func:`mlx_attn.paged.paged_attention`."""
        size = self.page_size
        positions = [np.arange(r.start, r.kv_len) for r in self.rows]
        pages = [np.asarray(r.block_table, np.int32)[p // size] for r, p in zip(self.rows, positions)]
        width = max([len(r.block_table) for r in self.rows] + [1])
        table = np.full((len(self.rows), width), -1, np.int32)
        for b, r in enumerate(self.rows):
            table[b, : len(r.block_table)] = r.block_table
        join = lambda parts: np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32)  # noqa: E731
        return {
            "tokens": join([np.asarray(r.tokens) for r in self.rows]),
            "positions": join(positions),
            "write_pages": join(pages),
            "write_slots": join([p % size for p in positions]),
            "q_lens": np.array([len(r.tokens) for r in self.rows], np.int32),
            "kv_lens": np.array([r.kv_len for r in self.rows], np.int32),
            "block_table": table,
        }


@dataclass(frozen=True)
class StepResult:
    request_id: Hashable
    token: int
    finished: bool  # max_tokens reached or a stop token


@dataclass
class _Sequence:
    request: Request
    tokens: list[int]
    arrival: int
    num_computed: int = 0  # positions whose K/V is in the pages
    keys: list[bytes] = field(default_factory=list)  # chain keys of its full computed pages
    generated: int = 0
    cached_tokens: int | None = None  # prompt tokens found in the prefix cache at first admission
    admitted: int = -1  # admission clock, for the preemption order
    preempted: bool = False  # waiting again after a preemption
    draft_length: DraftLength | None = None  # None: this request does not draft

    @property
    def pending(self) -> int:
        return len(self.tokens) - self.num_computed


def pages_needed(length: int, page_size: int) -> int:
    return math.ceil(length / page_size)


@dataclass(frozen=True)
class Speculation:
    """Drafting in the batched step. ``num_draft_tokens``: the most drafts
    per request and step (each request adapts its own, :class:`DraftLength`).
    The back-off rule: a request's ``j``-th draft goes into the step only
    if, kept with probability ``rate ** j`` (its acceptance rate), it raises
    the step's tokens per second under the measured cost of a step
    (:class:`StepCost`: ``fixed + per_row * rows``, fitted to the engine's
    steps), so drafts stop as the step turns compute-bound; and never past
    ``step_rows`` rows in all (decode rows, prefill continuations, drafts).
    Oldest requests draft first."""

    drafter: object  # propose(tokens, count) -> list[int]
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS
    step_rows: int = 48
    cost: StepCost = field(default_factory=StepCost)
    # decode steps that ran without drafts (the engine's compiled one-token
    # rows); steps with drafts are timed apart in ``cost``
    plain: StepCost = field(default_factory=StepCost)


class Scheduler:
    """``prefill_group_tokens``: admit a waiting request into a step only
    while the step holds fewer prefill rows (admitted chunks and prefill
    continuations) than this; ``None``: while the budget lasts. Where a
    step's cost grows with its rows (a CPU: no batching gain past the
    step's fixed cost), a step that prefills every waiting prompt gives all
    of them their first token only when the last is computed; groups of
    about this many rows give the first arrivals theirs a group's time
    after they came, for one step's fixed cost more per group. A prompt
    longer than the group still runs in chunks of the whole budget."""

    def __init__(self, pool: PagePool, max_batch_tokens: int, max_running: int | None = None,
                 prefix_reuse: bool = True, reusable_pages: Callable[[list[bytes]], int] | None = None,
                 speculation: Speculation | None = None, prefill_group_tokens: int | None = None):
        max_batch_tokens = check_int("max_batch_tokens", max_batch_tokens, minimum=1)
        self.prefill_group_tokens = check_optional_int("prefill_group_tokens", prefill_group_tokens, minimum=1)
        max_running = check_optional_int("max_running", max_running, minimum=1)
        self.pool, self.max_batch_tokens, self.max_running = pool, max_batch_tokens, max_running
        # False for models whose output at a position depends on more than the
        # cached pages (a recurrent state): every prompt is then computed whole
        self.prefix_reuse = bool(prefix_reuse)
        # for models that resume a found prefix from more than its pages (a
        # recurrent state saved at a page boundary): given the keys of the
        # pages a lookup found, how many leading ones may be reused
        self.reusable_pages = reusable_pages
        self.waiting: list[_Sequence] = []
        self.running: list[_Sequence] = []  # admission order
        self._all: dict[Hashable, _Sequence] = {}
        self._clock = 0
        self.preemptions = 0  # counters, for tests and metrics
        self.copies = 0
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.speculation = speculation
        self.draft_tokens = 0  # proposed and verified
        self.accepted_draft_tokens = 0

    # ------------------------------------------------------------ requests
    def submit(self, request: Request) -> None:
        """Queue a request; ``ValueError`` when it is malformed or can never
        fit the pool."""
        if request.request_id in self._all:
            raise ValueError(f"request_id {request.request_id!r} is already queued or running")
        if len(request.prompt) == 0:
            raise ValueError("prompt must hold at least one token")
        check_int("max_tokens", request.max_tokens, minimum=1)
        # the last generated token is never fed back: its K/V is never stored
        most = pages_needed(len(request.prompt) + request.max_tokens - 1, self.pool.page_size)
        if most > self.pool.num_pages:
            raise ValueError(
                f"request {request.request_id!r} can never fit: {len(request.prompt)} prompt tokens + max_tokens "
                f"{request.max_tokens} need {most} pages of {self.pool.page_size} tokens, the pool has "
                f"{self.pool.num_pages}"
            )
        self._clock += 1
        sequence = _Sequence(request, list(request.prompt), arrival=self._clock)
        if self.speculation is not None and request.speculate:
            sequence.draft_length = DraftLength(self.speculation.num_draft_tokens)
        self._all[request.request_id] = sequence
        self.waiting.append(sequence)

    def cancel(self, request_id: Hashable) -> bool:
        """Forget a request and free its pages at once; False if unknown."""
        sequence = self._all.pop(request_id, None)
        if sequence is None:
            return False
        if sequence in self.running:
            self.running.remove(sequence)
            self.pool.release(request_id)
        else:
            self.waiting.remove(sequence)
        return True

    def tokens(self, request_id: Hashable) -> list[int]:
        return list(self._all[request_id].tokens)

    def cached_tokens(self, request_id: Hashable) -> int:
        return self._all[request_id].cached_tokens or 0

    def page_key(self, request_id: Hashable, index: int) -> bytes:
        """The prefix-cache key full page ``index`` of a request's tokens has
        (or gets when it is computed)."""
        sequence, size = self._all[request_id], self.pool.page_size
        if (index + 1) * size > len(sequence.tokens):
            raise ValueError(f"request {request_id!r} has no full page {index}")
        keys = sequence.keys
        if index < len(keys):
            return keys[index]
        key = keys[-1] if keys else ROOT_HASH
        for i in range(len(keys), index + 1):
            key = chain_hash(key, sequence.tokens[i * size : (i + 1) * size])
        return key

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    # ------------------------------------------------------------ a step
    def schedule(self) -> StepPlan:
        budget = self.max_batch_tokens
        rows: list[ScheduledRow] = []
        copies: list[tuple[int, int]] = []
        preempted: list[Hashable] = []
        planned: set[Hashable] = set()
        ordered = sorted(self.running, key=lambda s: (s.pending > 1, s.admitted))
        draft_room, decode_rows, rows_planned = self._draft_room(ordered, budget)
        if not self._drafting_pays(ordered, draft_room, decode_rows, rows_planned):
            draft_room = 0
        prefill_rows = 0  # rows of prompts (continuations and admissions), for prefill_group_tokens
        # decode rows first, then prefill continuations, each oldest first
        for sequence in ordered:
            if budget == 0:
                break
            if sequence not in self.running:  # preempted earlier in this step
                continue
            count = min(sequence.pending, budget)
            drafts = (self._drafts(sequence, min(draft_room, budget - count), decode_rows, rows_planned)
                      if sequence.pending == 1 else [])
            if not self._reserve(sequence, count + len(drafts), copies, planned, preempted):
                continue
            draft_room -= len(drafts)
            rows_planned += len(drafts)
            budget -= len(drafts)
            rows.append(self._row(sequence, count, drafts))
            planned.add(sequence.request.request_id)
            budget -= count
            prefill_rows += count if sequence.pending > 1 else 0
        # no admission in a step that preempted: the pool is short (and the
        # preempted request would only be readmitted to be preempted again)
        group = self.prefill_group_tokens
        while (budget > 0 and self.waiting and not preempted and (group is None or prefill_rows < group)
               and (self.max_running is None or len(self.running) < self.max_running)):
            sequence = self.waiting[0]
            if not self._admit(sequence, copies):
                break
            count = min(sequence.pending, budget)
            rows.append(self._row(sequence, count))
            planned.add(sequence.request.request_id)
            budget -= count
            prefill_rows += count
        self.copies += len(copies)
        return StepPlan(tuple(rows), tuple(copies), tuple(preempted), self.pool.page_size)

    def _draft_room(self, ordered: list[_Sequence], budget: int) -> tuple[int, int, int]:
        """(draft rows this step may hold at most, its decode rows, its rows
        without drafts) for the rule of :class:`Speculation`."""
        if self.speculation is None:
            return 0, 0, 0
        planned = decoding = 0
        for sequence in ordered:
            rows = min(sequence.pending, budget - planned)
            planned += rows
            decoding += sequence.pending == 1 and rows == 1
        return max(0, min(self.speculation.step_rows, budget) - planned), decoding, planned

    def _drafting_pays(self, ordered: list[_Sequence], room: int, decode_rows: int, rows: int) -> bool:
        """Whether the drafts this step would hold (each request's as the rule
        of :class:`Speculation` places them) yield more tokens per second
        than the step without any, which for decode rows alone runs on the
        plain path (``Speculation.plain``'s cost); a step holding prompt rows
        runs the drafting path either way."""
        if self.speculation is None or room <= 0 or rows != decode_rows:
            return True
        cost, expected, drafts = self.speculation.cost, float(decode_rows), 0
        for sequence in ordered:
            if sequence.pending != 1 or sequence.draft_length is None or drafts >= room:
                continue
            worth = self._worth_drafting(sequence, room - drafts, decode_rows, rows + drafts)
            expected += sum(sequence.draft_length.rate ** j for j in range(1, worth + 1))
            drafts += worth
        return drafts == 0 or cost.drafting_beats(self.speculation.plain, expected, decode_rows, rows, drafts)

    def _worth_drafting(self, sequence: _Sequence, room: int, decode_rows: int, rows: int) -> int:
        """How many drafts of a decoding request pay for their rows in a step
        of ``rows`` rows: at most ``room`` and one fewer than it may still
        generate (the step adds a token of its own)."""
        count = min(sequence.draft_length.next(), room, sequence.request.max_tokens - sequence.generated - 1)
        rate, cost = sequence.draft_length.rate, self.speculation.cost
        worth = 0
        while worth < count and cost.worth(rate ** (worth + 1), decode_rows, rows + worth):
            worth += 1
        return worth

    def _drafts(self, sequence: _Sequence, room: int, decode_rows: int, rows: int) -> list[int]:
        """Tokens proposed to follow a decoding request, as many as
        :meth:`_worth_drafting` allows."""
        if sequence.draft_length is None or room <= 0:
            return []
        count = self._worth_drafting(sequence, room, decode_rows, rows)
        if count <= 0:
            return []
        return [int(t) for t in self.speculation.drafter.propose(sequence.tokens, count)][:count]

    def _row(self, sequence: _Sequence, count: int, drafts: Sequence[int] = ()) -> ScheduledRow:
        start = sequence.num_computed
        return ScheduledRow(
            sequence.request.request_id, start, tuple(sequence.tokens[start : start + count]) + tuple(drafts),
            tuple(self.pool.tables[sequence.request.request_id]), sample=start + count == len(sequence.tokens),
            drafts=len(drafts),
        )

    def _admit(self, sequence: _Sequence, copies: list) -> bool:
        """Give the head of the queue pages for its whole token list, sharing
        its cached prefix; False (nothing changed) when they are not there."""
        pool, size, rid = self.pool, self.pool.page_size, sequence.request.request_id
        matched = pool.lookup(sequence.tokens) if self.prefix_reuse else []
        if self.reusable_pages is not None and matched:
            # resumed at a page boundary, and never a whole prompt: its last token is computed
            matched = matched[: (len(sequence.tokens) - 1) // size]
            matched = matched[: self.reusable_pages([pool.key_of(page) for page in matched])]
        total = pages_needed(len(sequence.tokens), size)
        whole = len(matched) * size == len(sequence.tokens)  # the last token must still be computed
        rest = sequence.tokens[len(matched) * size:]
        # the next page from an indexed one that begins as the rest does, its
        # first tokens reused (copied: the request writes the rest there); the
        # prompt's last token is always computed
        partial, reused = None, 0
        if len(rest) >= 2 and self.reusable_pages is None and self.prefix_reuse:
            found = pool.lookup_partial(pool.key_of(matched[-1]) if matched else ROOT_HASH, rest)
            if found is not None:
                partial, reused = found[0], min(found[1], len(rest) - 1)
        shared = matched + ([partial] if partial is not None else [])
        fresh = total - len(matched) + (1 if whole else 0)
        if pool.available - sum(pool.is_cached(p) for p in shared) < fresh:
            return False
        pool.acquire(rid, shared)
        pool.allocate(rid, total - len(shared))
        sequence.num_computed = len(matched) * size + reused if partial is not None else \
            min(len(matched) * size, len(sequence.tokens) - 1)
        sequence.keys = []
        parent = ROOT_HASH
        for i in range(len(matched)):
            parent = pool.register(matched[i], parent, sequence.tokens[i * size : (i + 1) * size])
            sequence.keys.append(parent)
        if whole or partial is not None:  # copy-on-write: the shared last page gets the recomputed last token
            copies.append(pool.make_private(rid, len(shared) - 1))
        if sequence.cached_tokens is None:  # first admission: the prefix-cache hit of its prompt
            sequence.cached_tokens = sequence.num_computed
            self.prompt_tokens += len(sequence.tokens)
            self.cached_prompt_tokens += sequence.num_computed
        self.waiting.remove(sequence)
        self._clock += 1
        sequence.admitted, sequence.preempted = self._clock, False
        self.running.append(sequence)
        return True

    def _reserve(self, sequence: _Sequence, count: int, copies: list, planned: set, preempted: list) -> bool:
        """Pages for positions up to ``num_computed + count`` of a running
        request, private where it writes; preempts younger requests when the
        pool is dry. False when ``sequence`` itself was preempted."""
        pool, size, rid = self.pool, self.pool.page_size, sequence.request.request_id
        first, last = sequence.num_computed // size, (sequence.num_computed + count - 1) // size
        while True:
            try:
                missing = last + 1 - len(pool.tables[rid])
                if missing > 0:
                    pool.allocate(rid, missing)
                for position in range(first, last + 1):
                    copy = pool.make_private(rid, position)
                    if copy is not None:
                        copies.append(copy)
                return True
            except PoolExhausted:
                # the youngest request not yet in this step, maybe this one
                candidates = [s for s in self.running if s.request.request_id not in planned]
                victim = max(candidates, key=lambda s: s.admitted)
                self._preempt(victim, preempted)
                if victim is sequence:
                    return False

    def _preempt(self, sequence: _Sequence, preempted: list) -> None:
        rid = sequence.request.request_id
        self.pool.release(rid)
        self.running.remove(sequence)
        sequence.num_computed, sequence.keys, sequence.preempted = 0, [], True
        # in front of the queue, preempted requests first come first served
        position = 0
        while (position < len(self.waiting) and self.waiting[position].preempted
               and self.waiting[position].arrival < sequence.arrival):
            position += 1
        self.waiting.insert(position, sequence)
        preempted.append(rid)
        self.preemptions += 1

    # ------------------------------------------------------------ after the forward
    def commit(self, plan: StepPlan, sampled: dict[Hashable, int | Sequence[int]]) -> list[StepResult]:
        """Record a plan the model ran: ``sampled`` maps each row with
        ``sample=True`` to the token sampled from its last position, or for a
        row with drafts to the tokens its verification kept (the accepted
        drafts, then one token of the model's own). The K/V of rejected
        drafts is dropped: the computed positions stop after the accepted
        ones and the pages past the request's tokens are released, so no
        indexed page ever covers an unaccepted token. Requests cancelled
        since the plan are skipped."""
        results = []
        size = self.pool.page_size
        for row in plan.rows:
            sequence = self._all.get(row.request_id)
            if sequence is None or sequence not in self.running or sequence.num_computed != row.start:
                continue
            rid = row.request_id
            kept = [] if not row.sample else self._kept_tokens(row, sampled)
            accepted = max(0, len(kept) - 1)
            if row.drafts:
                self.draft_tokens += row.drafts
                self.accepted_draft_tokens += accepted
                sequence.draft_length.record(row.drafts, accepted)
            elif kept and len(row.tokens) == 1 and sequence.draft_length is not None:
                self._observe_first_draft(sequence, kept[0])
            sequence.num_computed = row.kv_len - row.drafts + accepted
            table = self.pool.tables[rid]
            computed = sequence.tokens + kept[:accepted]  # the accepted drafts' K/V is in the pages
            while (len(sequence.keys) + 1) * size <= sequence.num_computed:
                i = len(sequence.keys)
                parent = sequence.keys[-1] if sequence.keys else ROOT_HASH
                sequence.keys.append(self.pool.register(table[i], parent, computed[i * size : (i + 1) * size]))
            if not row.sample:
                continue
            for token in kept:
                sequence.tokens.append(token)
                sequence.generated += 1
                done = sequence.generated >= sequence.request.max_tokens or token in sequence.request.stop_token_ids
                results.append(StepResult(rid, token, done))
                if done:
                    self.pool.release(rid)
                    self.running.remove(sequence)
                    del self._all[rid]
                    break
            else:
                if row.drafts:  # pages that held only rejected drafts
                    self.pool.truncate(rid, pages_needed(len(sequence.tokens), size))
        return results

    def _observe_first_draft(self, sequence: _Sequence, token: int) -> None:
        """A decode row that held no draft: whether the drafter's first
        proposal (when it has one and finding it is free) is the token the
        step gave, one observation of the request's acceptance rate
        (:meth:`DraftLength.observe`); the back-off otherwise never learns
        that a refused request's drafts started to match again."""
        drafter = self.speculation.drafter
        if getattr(drafter, "costless", False):
            proposal = drafter.propose(sequence.tokens, 1)
            if proposal:
                sequence.draft_length.observe(int(proposal[0]) == token)

    def _kept_tokens(self, row: ScheduledRow, sampled: dict) -> list[int]:
        rid = row.request_id
        if rid not in sampled:
            raise ValueError(f"sampled has no token for request {rid!r}, whose row samples")
        value = sampled[rid]
        kept = [int(value)] if isinstance(value, (int, np.integer)) else [int(t) for t in value]
        drafts = row.tokens[len(row.tokens) - row.drafts:]
        if not 1 <= len(kept) <= row.drafts + 1 or tuple(kept[:-1]) != drafts[:len(kept) - 1]:
            raise ValueError(f"the tokens kept for request {rid!r} must be a prefix of its {row.drafts} drafts "
                             f"and one token more, got {kept}")
        return kept

    def stats(self) -> dict[str, int | float]:
        """Counts for metrics: requests, pages, prefix-cache hits, preemptions."""
        pool = self.pool
        return {
            "running": len(self.running), "waiting": len(self.waiting),
            "pages_total": pool.num_pages, "pages_held": pool.held_pages, "pages_cached": pool.cached_pages,
            "pages_free": pool.free_pages, "evictions": pool.evictions, "preemptions": self.preemptions,
            "copies": self.copies, "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "draft_tokens": self.draft_tokens, "accepted_draft_tokens": self.accepted_draft_tokens,
            "prefix_hit_rate": self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "prefix_reuse": int(self.prefix_reuse),
        }

    # ------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        pool, size = self.pool, self.pool.page_size
        pool.check_invariants()
        running_ids = {s.request.request_id for s in self.running}
        assert set(pool.tables) == running_ids, "page holders differ from the running requests"
        assert len(running_ids) == len(self.running), "a request runs twice"
        assert not ({s.request.request_id for s in self.waiting} & running_ids), "a request waits and runs"
        assert len(self.waiting) + len(self.running) == len(self._all), "requests lost or duplicated"
        for sequence in self.running:
            table = pool.tables[sequence.request.request_id]
            assert sequence.pending >= 1, "a running request has no token to compute"
            assert pages_needed(sequence.num_computed, size) <= len(table) <= pages_needed(len(sequence.tokens), size)
            assert len(sequence.keys) == sequence.num_computed // size, "chain keys differ from the full pages"
            for i, page in enumerate(table):
                if pool.is_indexed(page):
                    assert pool.indexed_tokens(page) == tuple(sequence.tokens[i * size : (i + 1) * size]), \
                        f"shared page {page} holds other tokens than request {sequence.request.request_id!r}"
        if self.max_running is not None:
            assert len(self.running) <= self.max_running
