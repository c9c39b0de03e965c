"""The engine: runs the scheduler's plans through the model's own forward.

Each step packs the plan's rows into one row of tokens (``B = 1``, one
position per token) and runs ``model(tokens, attention=PagedAttention(...))``
(the decoder's attention hook, :class:`mlx_attn.lm.models.base.AttentionHook`):
for each layer the hook writes the new tokens' keys and values into their
pages and calls :func:`mlx_attn.paged.paged_attention` over every sequence's
block table, or, where sequences of the step share prefix pages (a system
prompt, ``n`` > 1 choices) and the :class:`~mlx_attn.serve.cascade_groups.CascadeRule`
says the shared read pays, cascade attention with those groups (one
:class:`mlx_attn.paged.CascadeTables` per step; ``cascade=False`` turns that
off). The logits of each sampling row's last token give its next token
(per-request sampling, :mod:`mlx_attn.serve.sampling`, all rows at once).
A step of decode rows only runs compiled, traced once per shape
(:mod:`mlx_attn.serve.compiled_step`), its sampling in the same evaluation;
so does a step of decode rows and their drafts (every row's logits verify).

The matmuls are the model's own; ``weights`` chooses how its weights are held
(:func:`prepare_weights`): on MLX's CPU device quantized layers keep only
their packed weight, which every step (decode rows, drafts, prompt chunks)
reads through mlx_attn's integer product (on AVX512-VNNI a weight block once
for up to 128 rows; :mod:`mlx_attn.lm.quantized_matmul`), where MLX's CPU
quantized matmul gains nothing from a batch; ``"float32"`` also holds each
layer's float32 weight for the BLAS (4x the 4-bit model's memory). On a GPU (a Mac's Metal device)
the weights stay as loaded: MLX's quantized GPU matmuls read 4 to 8 times
fewer bytes.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Hashable, Sequence

import mlx.core as mx
import numpy as np

from mlx_attn.core.checks import check_int
from mlx_attn.lm.models.base import Decoder
from mlx_attn.serve.cascade_groups import DEFAULT_CASCADE_RULE, CascadeRule, shared_prefix_groups
from mlx_attn.serve.compiled_step import CompiledDecodeSteps
from mlx_attn.serve.constraints import Constraint, masks_to_bias
from mlx_attn.serve.draft_model import DraftModel, DraftRows
from mlx_attn.serve.kv_store import PagedKVStore
from mlx_attn.serve.pages import PagePool
from mlx_attn.serve.paged_forward import WEIGHT_CHOICES, PagedAttention, paged_model, prepare_weights
from mlx_attn.lm.ngram_draft import NgramDrafter
from mlx_attn.lm.speculative import DEFAULT_NUM_DRAFT_TOKENS, SPECULATIVE_CHOICES, check_num_draft_tokens
from mlx_attn.serve.sampling import SamplingParams, sample_rows, verify_draft_rows, verify_greedy_drafts
from mlx_attn.serve.scheduler import Request, Scheduler, Speculation, StepPlan

__all__ = ["PagedAttention", "Engine", "Output", "prepare_weights", "WEIGHT_CHOICES", "DEFAULT_PREFILL_GROUP_TOKENS",
           "device_prefill_group_tokens"]

log = logging.getLogger(__name__)
# rows up to which a step may hold drafts (the back-off rule, Speculation)
DEFAULT_SPECULATIVE_ROWS = 48
# prefill rows per group of prompts that arrive together, on the CPU (Scheduler's
# prefill_group_tokens): a step there costs ~13 ms plus ~2-3 ms a row (Qwen3-shaped
# 40M 4-bit model, 2 cores), so a 64-row group pays ~10% more for its own step
DEFAULT_PREFILL_GROUP_TOKENS = 64


def device_prefill_group_tokens() -> int | None:
    """``prefill_group_tokens`` for the default device: grouped on MLX's
    CPU device, where a step's cost grows with its rows; None on a GPU,
    where rows up to hundreds cost little more than one and one step serves
    every waiting prompt sooner."""
    return DEFAULT_PREFILL_GROUP_TOKENS if mx.default_device() == mx.cpu else None


def _speculation(kind: str | None, num_draft_tokens: int, step_rows: int, draft_model=None) -> Speculation | None:
    if (kind == "draft") != (draft_model is not None):
        raise ValueError("speculative='draft' needs a draft_model (a smaller model with the model's tokenizer)"
                         if kind == "draft" else "draft_model is used only with speculative='draft'")
    if kind is None:
        return None
    if kind not in SPECULATIVE_CHOICES:
        raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE_CHOICES)} or None, got {kind!r}")
    step_rows = check_int("speculative_rows", step_rows, minimum=1)
    drafter = DraftRows() if kind == "draft" else NgramDrafter()
    return Speculation(drafter, check_num_draft_tokens(num_draft_tokens), step_rows)


@dataclasses.dataclass(frozen=True)
class Output:
    """One generated token of a request."""

    request_id: Hashable
    token: int
    logprob: float | None  # under the model's distribution, before sampling filters; None unless asked for
    finished: bool  # max_tokens reached or a stop token
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (token, logprob), best first, as the request asked
    cached_tokens: int = 0  # prompt tokens the request found in the prefix cache when first admitted


class Engine:
    """A model, its page pool and K/V pages, and the scheduler.

    ``model``: an mlx_attn :class:`Decoder`, or an mlx-lm model loaded by
    :func:`mlx_attn.lm.mlx_lm_models.load` (run on the same paged path
    through its attention and cache seams, :mod:`mlx_attn.serve.mlx_lm_paged`;
    hybrid models keep a recurrent state per request and are served without
    prefix reuse, logged and in :meth:`stats`, unless ``state_snapshots``
    > 0: then up to that many states saved at page boundaries let a request
    resume after cached pages; other caches are refused with a ``ValueError``).

    ``kv_tokens``: the pool's capacity in tokens, all requests together
    (rounded up to whole pages); ``kv_bits``: None (pages in ``dtype``), 8 or
    4 (``mx.quantize`` pages of ``group_size`` features); ``dtype``: the
    float pages' (and quantized pages' scales') dtype, default the model's
    activations' (float32 after ``weights="float32"``): paged attention
    computes in the promotion of the queries' and the pages' dtypes and would
    otherwise convert every page of the pool each layer; ``weights``: see
    :func:`prepare_weights` (it changes ``model`` in place).

    ``cascade``: attend sequences that share prefix pages as groups
    (cascade attention) where ``cascade_rule`` says it pays (default:
    :data:`~mlx_attn.serve.cascade_groups.DEFAULT_CASCADE_RULE`, measured on
    the CPU); ``False``: every step through the plain paged op. The outputs
    are the same either way, within float rounding.

    ``speculative="ngram"``: decoding requests propose up to
    ``num_draft_tokens`` tokens found after their last n-gram earlier in
    their own tokens and verify them in the same step, ``k + 1`` rows each
    (lossless: :mod:`mlx_attn.lm.speculative`); drafts fill a step only up
    to ``speculative_rows`` rows (:class:`Speculation` says why). A drafting
    request's rows join no cascade group (decode rows only).
    ``speculative="draft"`` with ``draft_model`` (a smaller model with the
    same vocabulary): the drafts come from it, its K/V in a second paged
    store with the same pages (:mod:`mlx_attn.serve.draft_model`).

    ``prefill_group_tokens``: prompts that arrive together are prefilled in
    groups of about this many rows, first come first served, so the first
    of them stream a token before the last are computed (:class:`Scheduler`);
    ``None``: every waiting prompt joins a step while ``max_batch_tokens`` lasts."""

    def __init__(self, model: Decoder, *, kv_tokens: int, page_size: int = 16, max_batch_tokens: int = 256,
                 max_running: int | None = None, kv_bits: int | None = None, group_size: int = 64,
                 dtype=None, weights: str = "auto", state_snapshots: int = 0, cascade: bool = True,
                 cascade_rule: CascadeRule | None = None, speculative: str | None = None,
                 num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS, speculative_rows: int = DEFAULT_SPECULATIVE_ROWS,
                 prefill_group_tokens: int | None = None, draft_model=None):
        kv_tokens = check_int("kv_tokens", kv_tokens, minimum=1)
        if not isinstance(cascade, (bool, np.bool_)):
            raise ValueError(f"cascade must be True or False, got {cascade!r}")
        if cascade_rule is not None and not isinstance(cascade_rule, CascadeRule):
            raise ValueError(f"cascade_rule must be a CascadeRule or None, got {type(cascade_rule).__name__}")
        self.cascade = bool(cascade)
        self.cascade_rule = cascade_rule or DEFAULT_CASCADE_RULE
        self.cascade_steps = 0  # steps that attended through shared-prefix groups (for tests and metrics)
        self.compiled_draft_steps = 0  # steps holding drafts that ran compiled (for tests and measurements)
        model = paged_model(model)
        self.model = model
        paged_mlx_lm = not isinstance(model, Decoder)
        self.weights = prepare_weights(model.weights if paged_mlx_lm else model, weights)
        if paged_mlx_lm:
            model.refresh_kv_layout()  # the K/V dtype follows the weights just prepared
        if dtype is None and paged_mlx_lm:
            dtype = model.kv_dtype
        elif dtype is None:  # the activations' dtype: attention then never converts the whole pool
            embedding = getattr(model, "embed_tokens", None)
            # a quantized embedding looks up rows in its scales' dtype
            dtype = None if embedding is None else embedding.get("scales", embedding.weight).dtype
            dtype = dtype if dtype is not None and mx.issubdtype(dtype, mx.floating) else mx.float16
        layers = model.attention_layers()
        config = model.config
        kv_heads = getattr(config, "num_key_value_heads", None)
        head_dim = layers[0].head_dim
        if kv_heads is None or head_dim is None:
            raise ValueError("model must declare num_key_value_heads (config) and head_dim (attention_layers)")
        self.pool = PagePool(-(-kv_tokens // page_size), page_size)
        self.store = PagedKVStore(self.pool.num_pages, page_size, len(layers), kv_heads, head_dim,
                                  value_dim=getattr(model, "value_dim", None), dtype=dtype, bits=kv_bits,
                                  group_size=group_size, layer_shapes=getattr(model, "kv_layer_shapes", None))
        if isinstance(state_snapshots, bool) or not isinstance(state_snapshots, int) or state_snapshots < 0:
            raise ValueError(f"state_snapshots must be a non-negative integer, got {state_snapshots!r}")
        self.prefix_reuse = getattr(model, "prefix_reuse", True)
        reusable_pages = None
        self._states = getattr(model, "states", None)  # hybrid models' recurrent states
        if self._states is not None and state_snapshots > 0:
            model.enable_state_snapshots(state_snapshots)
            self.prefix_reuse, reusable_pages = True, self._states.reusable_pages
            log.info("prefix reuse through recurrent states saved at page boundaries (layers %s; at most %d "
                     "states)", model.recurrent_layers, state_snapshots)
        elif not self.prefix_reuse:
            log.warning("prefix reuse is off: layers %s of this model keep a recurrent state per request, which "
                        "cached pages cannot stand in for; every prompt is computed whole (state_snapshots "
                        "turns on reuse from states saved at page boundaries)",
                        getattr(model, "recurrent_layers", "?"))
        speculation = _speculation(speculative, num_draft_tokens, speculative_rows, draft_model)
        # why this engine does not draft although asked to (None: it drafts, or was not asked)
        self.speculation_refused: str | None = None
        if speculation is not None and self._states is not None:
            # a recurrent state has no per-token K/V to drop: rejected drafts could not be rolled back
            self.speculation_refused = (f"speculative decoding is off: layers {getattr(model, 'recurrent_layers', '?')}"
                                        f" of this model keep a recurrent state per request, which cannot roll "
                                        f"back rejected drafts")
            log.warning("%s", self.speculation_refused)
            speculation = None
        # the draft model and its paged K/V (None: no draft model drafts)
        self.draft = None if speculation is None or draft_model is None else DraftModel(
            draft_model, model, num_pages=self.pool.num_pages, page_size=page_size, dtype=dtype, kv_bits=kv_bits,
            group_size=group_size, weights=self.weights)
        self.scheduler = Scheduler(self.pool, max_batch_tokens, max_running, prefix_reuse=self.prefix_reuse,
                                   reusable_pages=reusable_pages, speculation=speculation,
                                   prefill_group_tokens=prefill_group_tokens)
        # decode-only steps traced once per shape (None: every step eager, and why; see compiled_step)
        self.decode_steps_refused = CompiledDecodeSteps.available(model)
        self.decode_steps = CompiledDecodeSteps(model, self.store) if self.decode_steps_refused is None else None
        self.sampling: dict[Hashable, SamplingParams] = {}
        self.generated: dict[Hashable, int] = {}
        self.constraints: dict[Hashable, tuple[Constraint, list[int]]] = {}  # and the request's stop tokens

    def submit(self, request_id: Hashable, prompt: Sequence[int], max_tokens: int,
               stop_token_ids: Sequence[int] = (), sampling: SamplingParams | None = None,
               constraint: Constraint | None = None, speculative: bool = True) -> None:
        """Queue a request; ``ValueError`` naming ``prompt`` or ``max_tokens``
        when its tokens are not the model's or it outgrows the model's
        context, and the scheduler's errors (can never fit the pool).
        ``constraint``: the tokens it may sample, asked before each
        (:mod:`mlx_attn.serve.constraints`); ``speculative=False``: this
        request never drafts (when the engine does)."""
        if not isinstance(speculative, bool):
            raise ValueError(f"speculative must be True or False, got {speculative!r}")
        config = self.model.config
        vocab = config.vocab_size
        tokens = np.asarray(prompt)
        if tokens.ndim != 1 or (tokens.size and tokens.dtype.kind not in "iu"):
            raise ValueError(f"prompt must be a sequence of token ids, got {type(prompt).__name__}")
        if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
            raise ValueError(f"prompt holds token ids outside the model's vocabulary [0, {vocab})")
        context = getattr(config, "max_position_embeddings", None)
        if context is not None and isinstance(max_tokens, int) and len(tokens) + max_tokens > context:
            raise ValueError(f"prompt ({len(tokens)} tokens) + max_tokens ({max_tokens}) exceed the model's "
                             f"context of {context} positions")
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams or None, got {type(sampling).__name__}")
        if constraint is not None and not isinstance(constraint, Constraint):
            raise ValueError(f"constraint must be a Constraint or None, got {type(constraint).__name__}")
        drafts = self.drafts_for(speculative, constraint)
        self.scheduler.submit(Request(request_id, tuple(int(t) for t in tokens), max_tokens,
                                      frozenset(int(t) for t in stop_token_ids), drafts))
        if self.draft is not None and drafts:
            self.draft.add(request_id)
        self.sampling[request_id] = sampling or SamplingParams()
        self.generated[request_id] = 0
        if constraint is not None:
            self.constraints[request_id] = (constraint, sorted(int(t) for t in stop_token_ids))

    def drafts_for(self, speculative: bool = True, constraint=None) -> bool:
        """Whether a request drafts: the engine speculates and the request did
        not opt out. Never a request with a ``constraint`` (a grammar's mask
        follows each sampled token; verifying drafts would need the masks of
        tokens not yet accepted). Every reason a request does not draft is here."""
        return self.scheduler.speculation is not None and speculative and constraint is None

    def cancel(self, request_id: Hashable) -> bool:
        """Stop a request and free its pages at once; False if unknown."""
        self._forget(request_id)
        return self.scheduler.cancel(request_id)

    @property
    def idle(self) -> bool:
        """No request is queued or running."""
        return self.scheduler.idle

    def stats(self) -> dict[str, int | float]:
        """Requests, pages, prefix-cache hits, preemptions (see :meth:`Scheduler.stats`)."""
        stats = self.scheduler.stats()
        if self.scheduler.speculation is not None:  # whose drafts the draft counts are
            stats["drafter"] = "draft" if self.draft is not None else "ngram"
        if self._states is not None:
            stats["state_snapshots"] = self._states.snapshots
        return stats

    def cached_tokens(self, request_id: Hashable) -> int:
        """Prompt tokens a queued or running request found in the prefix
        cache when first admitted (0 before); each :class:`Output` carries it too."""
        try:
            return self.scheduler.cached_tokens(request_id)
        except KeyError:
            raise ValueError(f"request_id {request_id!r} is neither queued nor running") from None

    def _forget(self, request_id: Hashable) -> None:
        for table in (self.sampling, self.generated, self.constraints):
            table.pop(request_id, None)
        if self.draft is not None:
            self.draft.forget(request_id)
        self._drop_state(request_id)

    def _drop_state(self, request_id: Hashable) -> None:
        forget = getattr(self.model, "forget_request", None)
        if forget is not None:
            forget(request_id)

    def step(self) -> list[Output]:
        """Schedule, run the model on the plan, commit the sampled tokens."""
        plan = self.scheduler.schedule()
        for request_id in plan.preempted:  # recomputed from its first token when readmitted
            self._drop_state(request_id)
        if not plan.rows:
            return []
        if self.draft is not None:  # the drafts and the draft store's K/V; timed apart from the step
            plan, drafted, seconds = self.draft.fill(plan, self)
            self.scheduler.speculation.cost.record_drafting(drafted, seconds)
        started = time.perf_counter()
        compiled_steps = self.decode_steps.steps if self.decode_steps is not None else 0
        sampled = self._run(plan)  # request -> the tokens it keeps, in order
        speculation = self.scheduler.speculation
        if speculation is not None and all(len(row.tokens) == row.drafts + 1 for row in plan.rows):
            # what a decoding step of this many rows costs (the back-off rule), compiled steps without
            # drafts apart; prefill chunks cost otherwise
            compiled = self.decode_steps is not None and self.decode_steps.steps > compiled_steps
            plain = compiled and not any(row.drafts for row in plan.rows)
            (speculation.plain if plain else speculation.cost).record(plan.num_tokens,
                                                                     time.perf_counter() - started)
        cached = {rid: self.scheduler.cached_tokens(rid) for rid in sampled}
        results = self.scheduler.commit(plan, {rid: [s.token for s in kept] for rid, kept in sampled.items()})
        if self._states is not None:
            self._states.prune(self.pool.has_key)  # states of evicted pages
        outputs, seen = [], {}
        for result in results:
            rid = result.request_id
            if result.finished:
                self._forget(rid)
            s = sampled[rid][seen.get(rid, 0)]
            seen[rid] = seen.get(rid, 0) + 1
            outputs.append(Output(rid, result.token, s.logprob, result.finished, s.top_logprobs, cached[rid]))
        return outputs

    def _run(self, plan: StepPlan) -> dict:
        arrays = plan.arrays()
        self.store.copy(plan.copies)
        ends = np.cumsum(arrays["q_lens"]) - 1
        sampling = [row for row in plan.rows if row.sample]
        cascade = None
        if self.cascade:
            cascade = shared_prefix_groups([row.block_table for row in plan.rows], arrays["kv_lens"],
                                           plan.page_size, self.cascade_rule, arrays["q_lens"])
            self.cascade_steps += cascade is not None
        # the compiled step replays the model it traced: not once engine.model was replaced (wrapped);
        # a step of decode rows and their drafts needs every row's logits, which is what it returns
        if cascade is None and self._states is None and self.decode_steps is not None and \
                self.decode_steps.model is self.model and all(len(row.tokens) == row.drafts + 1 and row.sample
                                                              for row in plan.rows):
            if not any(row.drafts for row in plan.rows):
                kept = self._run_compiled_decode(plan, arrays)
                if kept is not None:
                    return kept
            else:
                logits = self.decode_steps.step(self.decode_steps.step_arrays(arrays))
                if logits is not None:
                    mx.eval(logits, self.store.keys, self.store.values)
                    self.compiled_draft_steps += 1
                    return self._keep_tokens(sampling, logits)
        # logits of the sampling rows only (a prefill chunk's other rows need
        # none): the last row, and a drafting row's rows that verify its drafts
        logit_rows = [np.arange(end - row.drafts, end + 1) for row, end in zip(plan.rows, ends) if row.sample]
        hook = PagedAttention(self.store, arrays, np.concatenate(logit_rows) if logit_rows else np.zeros(0, np.int32),
                              [row.request_id for row in plan.rows], cascade)
        if self._states is not None:
            for row in plan.rows:  # a request admitted after cached pages resumes from their saved state
                if row.start > 0 and row.request_id not in self._states:
                    self._states.restore(row.request_id,
                                         self.scheduler.page_key(row.request_id, row.start // self.pool.page_size - 1))
        rows = self.model(mx.array(arrays["tokens"])[None], attention=hook)[0]
        states = self._states.arrays() if self._states is not None else []
        if not sampling:
            mx.eval(self.store.keys, self.store.values, states)  # a step of prefill chunks only: no logit row
            self._save_states()
            return {}
        mx.eval(rows, self.store.keys, self.store.values, states)
        self._save_states()
        return self._keep_tokens(sampling, rows)

    def _keep_tokens(self, sampling: list, rows: mx.array) -> dict:
        """The tokens each sampling row keeps, from ``rows``: the logits of
        every sampling row's last ``drafts + 1`` positions, in plan order."""
        firsts = np.cumsum([0] + [row.drafts + 1 for row in sampling])
        params = [self.sampling[row.request_id] for row in sampling]
        # a request's tokens are only read by a penalty
        previous = [self.scheduler.tokens(row.request_id) if p.reads_history else ()
                    for row, p in zip(sampling, params)]
        kept: dict[Hashable, list] = {}
        # sampled requests drafting with a model take every token by its rule
        by_draft = set() if self.draft is None else {
            b for b, row in enumerate(sampling) if self.draft.draws(row.request_id, params[b])}
        for b in by_draft:
            rid = sampling[b].request_id
            kept[rid] = self.draft.verify(rows[int(firsts[b]):int(firsts[b + 1])], rid, params[b], previous[b],
                                          self.generated[rid])
        plain = [b for b, row in enumerate(sampling) if not row.drafts and b not in by_draft]
        if plain:  # one draw for every row without drafts (constrained rows never draft)
            kept.update(self._draw_rows(rows[mx.array(firsts[plain].astype(np.int32))],
                                        [sampling[b].request_id for b in plain], [params[b] for b in plain],
                                        [previous[b] for b in plain]))
        drafting = [b for b, row in enumerate(sampling) if row.drafts]
        greedy = [b for b in drafting if params[b].greedy]
        if greedy:  # every greedy drafting request verified at once
            groups = [(int(firsts[b]), sampling[b].tokens[len(sampling[b].tokens) - sampling[b].drafts:],
                       params[b]) for b in greedy]
            kept.update((sampling[b].request_id, v) for b, v in zip(greedy, verify_greedy_drafts(rows, groups)))
        for b in drafting:
            row = sampling[b]
            if not params[b].greedy and b not in by_draft:
                rid = row.request_id
                kept[rid] = verify_draft_rows(rows[int(firsts[b]):int(firsts[b + 1])], params[b], previous[b],
                                              self.generated[rid], row.tokens[len(row.tokens) - row.drafts:])
        for rid, tokens in kept.items():
            self.generated[rid] += len(tokens)
        return kept

    def _draw_rows(self, logits: mx.array, request_ids: list, params: list, previous: list) -> dict:
        """One token for each request from its row of ``logits`` (one draw for
        all rows); a constrained request's grammar follows its token."""
        drawn = sample_rows(logits, params, previous, [self.generated[rid] for rid in request_ids],
                            self._bias(request_ids))
        for rid, sampled in zip(request_ids, drawn):
            if rid in self.constraints:
                self.constraints[rid][0].advance(sampled.token)
        return {rid: [d] for rid, d in zip(request_ids, drawn)}

    def _run_compiled_decode(self, plan: StepPlan, arrays: dict) -> dict | None:
        """A decode-only step through the compiled step (None: it cannot run
        this model, the eager step runs). Sampling is built on the step's
        lazy logits, so the step and its sampling are one evaluation."""
        logits = self.decode_steps.step(self.decode_steps.step_arrays(arrays))
        if logits is None:
            return None
        ids = [row.request_id for row in plan.rows]
        params = [self.sampling[rid] for rid in ids]
        previous = [self.scheduler.tokens(rid) if p.reads_history else () for rid, p in zip(ids, params)]
        kept = self._draw_rows(logits, ids, params, previous)
        mx.eval(self.store.keys, self.store.values)  # already computed: each layer's pages feed its attention
        for rid in ids:
            self.generated[rid] += 1
        return kept

    def warm_up(self, max_rows: int = 1) -> None:
        """Trace the decode steps of 1 to ``max_rows`` requests now (a server
        calls this before serving, so no request waits for a trace). Writes
        one K/V row per row into the first pages, which an idle engine holds
        free (each row reads back its own)."""
        if self.decode_steps is None:
            return
        max_rows = check_int("max_rows", max_rows, minimum=1)
        if not self.idle or self.pool.free_pages != self.pool.num_pages:
            raise RuntimeError("warm_up needs an idle engine whose pages are all free")
        for rows in range(1, min(max_rows, self.pool.num_pages) + 1):
            pages = np.arange(rows, dtype=np.int32)
            zeros, ones = np.zeros(rows, np.int32), np.ones(rows, np.int32)
            arrays = {"tokens": zeros, "positions": zeros, "write_pages": pages, "write_slots": zeros,
                      "q_lens": ones, "kv_lens": ones, "block_table": pages[:, None]}
            logits = self.decode_steps.step(self.decode_steps.step_arrays(arrays))
            mx.eval(logits if logits is not None else [], self.store.keys, self.store.values)

    def _save_states(self) -> None:
        """File the states the step recorded at page boundaries under those
        pages' prefix-cache keys (before the commit forgets finished requests)."""
        if self._states is None:
            return
        for request_id, position, state in self._states.take_recorded():
            self._states.save(self.scheduler.page_key(request_id, position // self.pool.page_size - 1), state)

    def _bias(self, rids: list) -> tuple[list[int], mx.array] | None:
        """The constrained rows of a step and the ``-inf`` bias of their
        forbidden tokens (None when no row is constrained)."""
        constrained = [(r, *self.constraints[rid]) for r, rid in enumerate(rids) if rid in self.constraints]
        if not constrained:
            return None
        masks = np.stack([constraint.allowed_mask() for _, constraint, _ in constrained])
        vocab = self.model.config.vocab_size
        bias = masks_to_bias(masks, vocab)
        for row, (_, _, stops) in zip(bias, constrained):
            if not np.isfinite(row).any():  # a grammar with no way on: end the request rather than draw NaN
                row[[t for t in stops if t < vocab]] = 0
        return [r for r, _, _ in constrained], mx.array(bias)

    def run_until_idle(self, max_steps: int = 100_000) -> dict[Hashable, list[int]]:
        """Step until every request finished; the generated tokens of each."""
        out: dict[Hashable, list[int]] = {}
        for _ in range(max_steps):
            if self.scheduler.idle:
                return out
            for result in self.step():
                out.setdefault(result.request_id, []).append(result.token)
        raise RuntimeError(f"requests still running after {max_steps} steps")
