"""Serving: many requests at once over paged, prefix-sharing K/V.

A layer above the application (``mlx_attn`` <- ``mlx_attn.lm`` <-
``mlx_attn.serve``): nothing in ``mlx_attn`` or ``mlx_attn.lm`` imports it.

- :mod:`mlx_attn.serve.pages`: the page pool's bookkeeping (reference
  counts, prefix index by chain hash, LRU eviction, copy-on-write);
- :mod:`mlx_attn.serve.kv_store`: the K/V pages of every layer (float,
  8- or 4-bit);
- :mod:`mlx_attn.serve.scheduler`: which request runs which positions in
  which pages each step, as pure data;
- :mod:`mlx_attn.serve.cascade_groups`: which sequences of a step share
  prefix pages, read once per group (cascade attention), and when it pays;
- :mod:`mlx_attn.serve.engine`: runs the plans through the model's own
  forward with a paged attention hook;
- :mod:`mlx_attn.serve.sampling`: per-request sampling, seeded per request.

See docs/serving.md.
"""

from mlx_attn.serve.cascade_groups import CascadeRule
from mlx_attn.serve.engine import Engine, Output, PagedAttention
from mlx_attn.serve.kv_store import PagedKVStore
from mlx_attn.serve.pages import PagePool, PoolExhausted, chain_hash
from mlx_attn.serve.sampling import SamplingParams
from mlx_attn.serve.scheduler import Request, ScheduledRow, Scheduler, StepPlan, StepResult

__all__ = ["CascadeRule", "Engine", "Output", "SamplingParams", "PagedAttention", "PagePool", "PoolExhausted", "chain_hash", "PagedKVStore", "Request", "ScheduledRow", "Scheduler",
           "StepPlan", "StepResult"]
