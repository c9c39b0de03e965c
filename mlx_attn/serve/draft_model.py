"""A draft model inside the batched engine (``Engine(speculative="draft",
draft_model=...)``, ``mlx-attn serve --speculative draft --draft-model``).

The draft model keeps its K/V in a second paged store with the target's
page numbers and slots: every step it writes exactly the positions the
target's step writes (prompt chunks, decode rows, drafts), so its pages
fill, share through the prefix cache, copy on write, roll back and are
freed with the target's, by the scheduler's one page table. Rejected
drafts leave K/V in slots nobody reads, as in the target's store.

Each step, after the scheduler reserved ``k`` draft rows for a request
(placeholders, :class:`DraftRows`), :meth:`DraftModel.fill`:

1. runs ``k`` batched draft forwards, forward ``j`` one row per request
   with more than ``j`` drafts (its pending token, then its drafts), and
   draws each draft from the draft's distribution ``q``: the request's
   penalties, bias, temperature and filters on the draft's logits (greedy:
   their argmax);
2. runs one more forward over the step's other rows and each drafting
   request's last draft, so the draft store holds what the target's will.
   Its last row gives ``q`` of the token after the step's drafts.

Sampled requests then take every token by one rule at its index ``n``
(:meth:`DraftModel.verify`): a draft ``t ~ q_n`` (the drafted one, or drawn
from the last ``q`` when all were kept), kept with ``min(1, p_n(t) /
q_n(t))``, else a draw from ``max(0, p_n - q_n)``
(:func:`mlx_attn.lm.speculative.draft_acceptance`, the rule ``verify_drafts``
uses), each draw keyed by the request's seed and ``n`` only: every token
follows ``p``, and a seeded request gives the same tokens whatever number
of drafts the timed back-off allowed. Greedy requests keep drafts while
they are the target's argmax (the engine's verification): token for token
decoding without drafts."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Hashable, Sequence

import mlx.core as mx
import numpy as np

from mlx_attn.lm.sampling import filtered_logprobs
from mlx_attn.lm.speculative import check_draft_model, draft_acceptance, normalized_logprobs
from mlx_attn.lm.validate import FieldError
from mlx_attn.serve.kv_store import PagedKVStore
from mlx_attn.serve.paged_forward import PagedAttention, paged_model, prepare_weights
from mlx_attn.serve.sampling import SamplingParams, Sampled, kept_with_logprobs, shaped_logits
from mlx_attn.serve.scheduler import ScheduledRow, StepPlan

__all__ = ["DraftModel", "DraftRows", "keyed_draft_rule", "draft_key"]

_SEED_LIMIT = 2**63


class DraftRows:
    """The scheduler's drafter under a draft model: it only reserves rows
    (placeholder tokens); :meth:`DraftModel.fill` draws the drafts for all
    requests at once before the step's forward."""

    def propose(self, tokens: Sequence[int], count: int) -> list[int]:
        return [0] * count


@dataclasses.dataclass
class _Proposal:
    """What a request's verification needs from the draft model."""

    drafts: list[int]
    q: list[mx.array]  # the distributions the drafts were drawn from (sampled requests only)
    next_token: int | None = None  # drawn from the q after the drafts (sampled requests)
    next_q: mx.array | None = None


class DraftModel:
    """The draft model, its paged K/V store (``num_pages`` pages of
    ``page_size``, the target's) and the requests that draft with it.
    ``ValueError`` naming ``draft_model`` when its vocabulary is not the
    target's or its K/V cannot roll back (recurrent layers)."""

    def __init__(self, draft, target, *, num_pages: int, page_size: int, dtype, kv_bits: int | None,
                 group_size: int, weights: str):
        check_draft_model(target, draft)
        model = paged_model(draft)
        if getattr(model, "states", None) is not None:
            layers = getattr(model, "recurrent_layers", "?")
            raise FieldError("draft_model", f"keeps a recurrent state in layers {layers}"
                             ", which cannot roll back refused drafts: a draft model must be attention-only")
        paged_mlx_lm = model is not draft
        prepare_weights(model.weights if paged_mlx_lm else model, weights)
        if paged_mlx_lm:
            model.refresh_kv_layout()
            dtype = model.kv_dtype
        layers = model.attention_layers()
        self.model, self.page_size = model, page_size
        self.store = PagedKVStore(num_pages, page_size, len(layers), model.config.num_key_value_heads,
                                  layers[0].head_dim, value_dim=getattr(model, "value_dim", None), dtype=dtype,
                                  bits=kv_bits, group_size=group_size,
                                  layer_shapes=getattr(model, "kv_layer_shapes", None))
        self.requests: set[Hashable] = set()  # requests that draft with this model
        self._proposals: dict[Hashable, _Proposal] = {}

    # ------------------------------------------------------------ requests
    def add(self, request_id: Hashable) -> None:
        self.requests.add(request_id)

    def forget(self, request_id: Hashable) -> None:
        self.requests.discard(request_id)
        self._proposals.pop(request_id, None)

    def draws(self, request_id: Hashable, params: SamplingParams) -> bool:
        """The request's tokens come from :meth:`verify` (it drafts with this
        model and samples at a temperature)."""
        return request_id in self.requests and params.temperature > 0

    # ------------------------------------------------------------ a step
    def fill(self, plan: StepPlan, engine) -> tuple[StepPlan, int, float]:
        """Draw the drafts of ``plan``'s drafting rows, write the step's K/V
        into the draft store; returns the plan with its drafts, how many
        and the seconds their forwards took."""
        self.store.copy(plan.copies)
        self._proposals.clear()
        started = time.perf_counter()
        drafting = [row for row in plan.rows if row.drafts]
        context = {row.request_id: self._context(row.request_id, engine) for row in plan.rows if row.sample}
        proposals = {row.request_id: _Proposal([], []) for row in drafting}
        for j in range(max((row.drafts for row in drafting), default=0)):
            rows = [row for row in drafting if row.drafts > j]
            fed = [ScheduledRow(row.request_id, row.start + j,
                                (row.tokens[-row.drafts - 1] if j == 0 else proposals[row.request_id].drafts[-1],),
                                row.block_table, True) for row in rows]
            logits = self._forward(fed, np.arange(len(fed)))
            for row, (token, q) in zip(rows, self._draw(logits, [context[row.request_id] for row in rows],
                                                        [proposals[row.request_id].drafts for row in rows])):
                proposals[row.request_id].drafts.append(token)
                if q is not None:
                    proposals[row.request_id].q.append(q)
        drafting_seconds = time.perf_counter() - started
        # the rest of the step, and each drafting row's last draft (never fed to a draft forward yet)
        fed = [ScheduledRow(row.request_id, row.kv_len - 1, (proposals[row.request_id].drafts[-1],),
                            row.block_table, row.sample) if row.drafts else row for row in plan.rows]
        ends = np.cumsum([len(row.tokens) for row in fed]) - 1
        wanted = [b for b, row in enumerate(fed) if row.sample and self.draws(row.request_id,
                                                                              context[row.request_id][0])]
        logits = self._forward(fed, ends[wanted].astype(np.int32))
        wanted = [fed[b] for b in wanted]
        if wanted:
            made = [proposals.setdefault(row.request_id, _Proposal([], [])) for row in wanted]
            drawn = self._draw(logits, [context[row.request_id] for row in wanted], [p.drafts for p in made])
            for proposal, (token, q) in zip(made, drawn):
                proposal.next_token, proposal.next_q = token, q
        self._proposals = proposals
        rows = tuple(dataclasses.replace(row, tokens=row.tokens[:len(row.tokens) - row.drafts]
                                         + tuple(proposals[row.request_id].drafts)) if row.drafts else row
                     for row in plan.rows)
        return dataclasses.replace(plan, rows=rows), sum(row.drafts for row in drafting), drafting_seconds

    def _context(self, request_id: Hashable, engine) -> tuple[SamplingParams, list[int], int]:
        params = engine.sampling[request_id]
        history = engine.scheduler.tokens(request_id) if params.reads_history else []
        return params, history, engine.generated[request_id]

    def _forward(self, rows: list[ScheduledRow], logit_rows: np.ndarray) -> mx.array:
        arrays = StepPlan(tuple(rows), (), (), self.page_size).arrays()
        hook = PagedAttention(self.store, arrays, logit_rows, [row.request_id for row in rows])
        logits = self.model(mx.array(arrays["tokens"])[None], attention=hook)[0]
        # no logit row: the K/V only (a quantized head's matvec must not run on zero rows)
        mx.eval(*([logits] if len(logit_rows) else []), self.store.keys, self.store.values)
        return logits

    def _draw(self, logits: mx.array, contexts: list, drafted: list[list[int]]) -> list[tuple[int, mx.array | None]]:
        """Row ``r``'s next draft and the ``q`` it was drawn from (None when
        greedy): the token after ``drafted[r]`` of a request in ``contexts[r]``."""
        logits = logits.astype(mx.float32)
        tokens, qs = [], []
        best = mx.argmax(logits, axis=-1)
        for r, ((params, history, index), drafts) in enumerate(zip(contexts, drafted)):
            if params.greedy:
                tokens.append(best[r])
                qs.append(None)
                continue
            shaped = shaped_logits(logits[r], params, [*history, *drafts], index + len(drafts))
            if params.temperature == 0:
                tokens.append(mx.argmax(shaped))
                qs.append(None)
                continue
            q = normalized_logprobs(filtered_logprobs(shaped[None], params.temperature, params.top_k, params.top_p,
                                                      params.min_p))[0]
            tokens.append(mx.random.categorical(q, key=draft_key(params.seed, index + len(drafts))))
            qs.append(q)
        tokens = mx.stack([t.astype(mx.int32) for t in tokens]) if tokens else mx.zeros(0, mx.int32)
        mx.eval(tokens, *[q for q in qs if q is not None])
        return [(int(t), q) for t, q in zip(tokens.tolist(), qs)]

    # ------------------------------------------------------------ after the forward
    def verify(self, logits: mx.array, request_id: Hashable, params: SamplingParams, history: Sequence[int],
               index: int) -> list[Sampled]:
        """The tokens a sampled request keeps: ``logits [k + 1, vocab]``, the
        target's rows fed its pending token and its ``k`` drafts; ``index``
        the generated-token index of the first. Token ``n`` is the proposal
        at ``n`` (the draft, or after the last draft the token drawn from the
        draft's next ``q``) if a uniform falls below ``min(1, p(t) / q(t))``,
        else a draw from ``max(0, p - q)``, which ends the step."""
        proposal = self._proposals[request_id]
        proposed = [*proposal.drafts, proposal.next_token]
        target = mx.stack([shaped_logits(logits[i].astype(mx.float32), params, [*history, *proposed[:i]], index + i)
                           for i in range(len(proposed))])
        p = normalized_logprobs(filtered_logprobs(target, params.temperature, params.top_k, params.top_p,
                                                  params.min_p))
        kept = keyed_draft_rule(p, mx.stack([*proposal.q, proposal.next_q]), proposed, params.seed, index)
        return kept_with_logprobs(logits, kept, params)


def keyed_draft_rule(target_logprobs: mx.array, draft_logprobs: mx.array, proposed: Sequence[int], seed: int,
                     index: int) -> list[int]:
    """The tokens kept from ``proposed`` (token ``index + i`` drawn from row
    ``i`` of ``draft_logprobs`` with :func:`draft_key`) against the target's
    normalised ``target_logprobs`` (rows as many): each kept while a uniform
    falls below ``min(1, p(t) / q(t))``, the first refused one replaced by a
    draw from ``max(0, p - q)``, every draw keyed by ``seed`` and the
    token's index only."""
    accept, residual = draft_acceptance(target_logprobs, draft_logprobs, mx.array(proposed))
    uniforms, replacements = [], []
    for i in range(len(proposed)):
        _, accept_key, residual_key = _keys(seed, index + i)
        uniforms.append(mx.random.uniform(key=accept_key))
        replacements.append(mx.random.categorical(residual[i], key=residual_key))
    kept_mask = mx.stack(uniforms) < accept
    mx.eval(kept_mask, *replacements)
    kept = []
    for token, keep, replacement in zip(proposed, kept_mask.tolist(), replacements):
        kept.append(int(token) if keep else int(replacement.item()))
        if not keep:
            break
    return kept


def draft_key(seed: int, index: int) -> mx.array:
    """The key a request's ``index``-th proposal is drawn from ``q`` with."""
    return _keys(seed, index)[0]


def _keys(seed: int, index: int) -> mx.array:
    """The draft, acceptance and replacement keys of a request's
    ``index``-th token: its seed and that index only."""
    return mx.random.split(mx.random.key((seed * 1_000_003 + index) % _SEED_LIMIT), 3)
