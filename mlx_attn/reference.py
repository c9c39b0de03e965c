"""The pure-MLX reference path: attention written step by step.

This is the ground truth the fused CPU and Metal kernels are tested against.
The steps carry the same names as in ``csrc/cpu/kernel_impl.h`` and
``metal/``: score, scale, softcap, mask, softmax (max, exp, sum), aggregate,
normalize. Everything is computed in float32 and the result is cast back to
the input dtype.

GQA/MQA are computed by grouping the query heads ``[B, Hkv, G, Tq, D]`` against
``[B, Hkv, 1, Tkv, D]`` keys, so keys and values are never repeated.

A query row that can see no key (every key masked) returns zeros.

Numbers: every logit (``scale * q.k``, the logit plus an additive mask value,
and each sink) saturates to ``[-LOGIT_LIMIT, LOGIT_LIMIT]`` (2^125); an
additive mask value at or below ``MASKED_LOGIT`` (-2^127, so ``-inf``
included) masks the key. Differences of saturated logits cannot
overflow, so any finite float32 scale gives finite outputs for finite inputs.
The fused kernels follow the same rule (``metal/attention_params.h``).
"""

from __future__ import annotations

import contextlib

import mlx.core as mx

__all__ = ["reference_attention", "causal_visibility", "softcap_logit", "LOGIT_LIMIT", "MASKED_LOGIT"]

# Same values as MLX_ATTN_LOGIT_LIMIT / MLX_ATTN_MASKED_LOGIT in
# metal/attention_params.h (tests/test_native.py checks).
LOGIT_LIMIT = 2.0**125
MASKED_LOGIT = -(2.0**127)


def _saturate(x: mx.array) -> mx.array:
    return mx.clip(x, -LOGIT_LIMIT, LOGIT_LIMIT)


def softcap_logit(scores: mx.array, cap: float) -> mx.array:
    """softcap: ``cap * tanh(scores / cap)``, every logit bounded by ``cap``
    (Gemma 2, Grok); the step of the same name in metal/attention_rules.h.
    Applied to the saturated scaled logits, before any mask."""
    return cap * mx.tanh(scores / cap)


def causal_visibility(q_len: int, kv_len: int, window_size: int | None = None) -> mx.array:
    """Boolean ``[Tq, Tkv]``: True where query i may see key j.

    Causal attention is lower-right aligned (the last query is at position
    ``kv_len - 1``); with ``window_size`` each query sees at most that many
    most recent keys, itself included.
    """
    positions = mx.arange(q_len)[:, None] + (kv_len - q_len)
    keys = mx.arange(kv_len)[None, :]
    visible = keys <= positions
    if window_size is not None:
        visible = visible & (keys > positions - window_size)
    return visible


def _visibility(qf: mx.array, kf: mx.array, window_size: int | None) -> mx.array:
    """:func:`causal_visibility` for grouped ``qf [B,Hkv,G,Tq,D]`` against
    ``kf [B,Hkv,1,Tkv,D]``, built from the arrays rather than from their
    lengths as Python ints: under ``mx.compile(shapeless=True)`` the
    positions follow the shapes of every later call (a mask built from
    ``arange(q_len)`` would keep the first call's)."""
    query_ones = mx.ones_like(qf.sum(axis=(0, 1, 2, 4)), dtype=mx.int32)  # [Tq]
    key_ones = mx.ones_like(kf.sum(axis=(0, 1, 2, 4)), dtype=mx.int32)  # [Tkv]
    query_index, key_index = mx.cumsum(query_ones) - 1, mx.cumsum(key_ones) - 1
    # lower-right aligned: the last query sits at the last key
    positions = query_index[:, None] + (key_ones.sum() - query_ones.sum())
    visible = key_index[None, :] <= positions
    if window_size is not None:
        visible = visible & (key_index[None, :] > positions - window_size)
    return visible


def _group_heads(x: mx.array, kv_heads: int) -> mx.array:
    """[B, Hq, ...] -> [B, Hkv, G, ...] (no copy of K/V). Shape-free ops
    (unflatten, expand_dims, flatten) here and below keep the path correct
    under mx.compile(shapeless=True) when the lengths change."""
    if x.shape[1] == 1:  # broadcast over every head
        return mx.expand_dims(x, 2)
    return mx.unflatten(x, 1, (kv_heads, -1))


def reference_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    mask: mx.array | str | None = None,
    sinks: mx.array | None = None,
    window_size: int | None = None,
    return_weights: bool = False,
    return_lse: bool = False,
    dropout_p: float = 0.0,
    dropout_key: mx.array | None = None,
    stream: mx.Stream | mx.Device | None = None,
    softcap: float | None = None,
):
    """Scaled dot-product attention in plain MLX operations.

    Same arguments as :func:`mlx_attn.scaled_dot_product_attention` (inputs
    are assumed valid). ``return_weights=True`` also returns the attention
    weights ``[B, Hq, Tq, Tkv]`` (float32, after dropout); ``return_lse=True``
    also returns the row log-sum-exp ``[B, Hq, Tq]`` (float32, natural log of
    the softmax denominator, sinks included; ``-inf`` for a row that sees no
    key), last. ``dropout_p`` drops
    weights with that probability and rescales the rest by ``1/(1-p)``
    (training only); ``dropout_key`` makes it reproducible. ``softcap``
    caps the logits (:func:`softcap_logit`) before the mask.
    """
    with mx.stream(stream) if stream is not None else contextlib.nullcontext():
        out_dtype = q.dtype
        batch, q_heads, q_len, _ = q.shape
        kv_heads, kv_len = k.shape[1], k.shape[2]
        if kv_len == 0:  # no key to see: every row is fully masked
            out = mx.zeros((batch, q_heads, q_len, v.shape[-1]), dtype=out_dtype)
            weights = mx.zeros((batch, q_heads, q_len, 0), dtype=mx.float32)
            lse = mx.full((batch, q_heads, q_len), -mx.inf, dtype=mx.float32)
            return _results(out, weights if return_weights else None, lse if return_lse else None)

        qf = _group_heads(q.astype(mx.float32), kv_heads)  # [B,Hkv,G,Tq,D]
        kf = k.astype(mx.float32)[:, :, None]  # [B,Hkv,1,Tkv,D]
        vf = v.astype(mx.float32)[:, :, None]  # [B,Hkv,1,Tkv,Dv]

        # score, scale
        scores = _saturate((qf @ kf.swapaxes(-1, -2)) * scale)  # [B,Hkv,G,Tq,Tkv]
        # softcap (before the mask: an additive mask adds to the capped logit)
        if softcap is not None:
            scores = softcap_logit(scores, softcap)

        scores = _masked(scores, qf, kf, mask, window_size, kv_heads)
        weights, lse = _softmax(scores, sinks, kv_heads, return_lse)

        if dropout_p > 0.0:
            if not 0.0 <= dropout_p < 1.0:
                raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
            keep = mx.random.bernoulli(1.0 - dropout_p, weights.shape, key=dropout_key)
            weights = mx.where(keep, weights / (1.0 - dropout_p), 0.0)

        # aggregate
        out = weights @ vf  # [B,Hkv,G,Tq,Dv]
        out = mx.flatten(out, 1, 2).astype(out_dtype)
        return _results(out, mx.flatten(weights, 1, 2) if return_weights else None, lse)


def _masked(scores, qf, kf, mask, window_size, kv_heads):
    """The logits with the mask applied: ``-inf`` where a key may not be
    seen (causal / window, a boolean mask, an additive value at or below
    the masked sentinel), an additive mask's values added and saturated."""
    visible = None  # False where a key may not be seen
    if isinstance(mask, str) or window_size is not None:
        visible = _visibility(qf, kf, window_size)
    if isinstance(mask, mx.array):
        full = mask if mask.ndim == 4 else mx.expand_dims(mask, list(range(4 - mask.ndim)))
        full = _group_heads(full, kv_heads)  # broadcasts against [B,Hkv,G,Tq,Tkv]
        if full.dtype == mx.bool_:
            visible = full if visible is None else (visible & full)
        else:
            added = full.astype(mx.float32)
            scores = mx.where(added <= MASKED_LOGIT, -mx.inf, _saturate(scores + added))
    if visible is not None:
        scores = mx.where(visible, scores, -mx.inf)
    return scores


def _softmax(scores, sinks, kv_heads, return_lse):
    """The softmax along keys (max, exp, sum; sinks join max and sum) and,
    with ``return_lse``, the row log-sum-exp ``[B, Hq, Tq]`` (else None)."""
    row_max = scores.max(axis=-1, keepdims=True)
    if sinks is not None:
        sink_logits = _group_heads(
            mx.expand_dims(_saturate(sinks.astype(mx.float32)), (0, 2, 3)), kv_heads
        )
        row_max = mx.maximum(row_max, sink_logits)
    # A row that sees nothing has max -inf; any finite shift keeps exp = 0.
    row_max = mx.where(row_max == -mx.inf, 0.0, row_max)
    weights = mx.exp(scores - row_max)
    row_sum = weights.sum(axis=-1, keepdims=True)
    if sinks is not None:
        row_sum = row_sum + mx.exp(sink_logits - row_max)
    lse = None
    if return_lse:  # the softmax denominator in log space: what partial results merge by
        # log of a safe sum: where() passes a zero cotangent to the branch it
        # drops, and log's derivative at 0 would turn that zero into NaN
        safe_log = mx.log(mx.where(row_sum == 0, 1.0, row_sum))
        lse = mx.flatten(mx.where(row_sum == 0, -mx.inf, row_max + safe_log).squeeze(-1), 1, 2)
    # normalize (rows that see nothing get all-zero weights)
    return weights / mx.where(row_sum == 0, 1.0, row_sum), lse


def _results(out, weights, lse):
    """``out``, then the weights and the log-sum-exp where asked for."""
    extra = tuple(x for x in (weights, lse) if x is not None)
    return (out, *extra) if extra else out

