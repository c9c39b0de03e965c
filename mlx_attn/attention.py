"""Multi-head attention (MHA), grouped-query (GQA) and multi-query (MQA).

``MultiHeadAttention(d_model, n_heads, n_kv_heads)`` is MHA when
``n_kv_heads == n_heads``, GQA when it divides ``n_heads`` and MQA when it is
1. Keys and values are projected to ``n_kv_heads`` heads only and are never
repeated: :func:`mlx_attn.scaled_dot_product_attention` maps each group of
query heads onto its shared key/value head.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlx_attn.cache import RotatingKVCache
from mlx_attn.core.attention_arguments import as_softcap
from mlx_attn.core.checks import (
    MAX_DIM,
    check_array,
    check_bool,
    check_elements,
    check_int,
    check_optional_int,
    check_real,
)
from mlx_attn.core.path_choice import Backend
from mlx_attn.ops import AttentionCall, attention_path
from mlx_attn.quantized import dequantize, quantized_scaled_dot_product_attention
from mlx_attn.reference import reference_attention
from mlx_attn.rope import RoPE

__all__ = ["MultiHeadAttention", "RoPE"]


def _restrict(mask, visible):
    """``mask`` (None, "causal" or an array) seeing only where the boolean
    ``visible`` (causal already) says: a boolean or additive array, or None."""
    if visible is None:
        return mask
    if mask is None or isinstance(mask, str):
        return visible
    if mask.dtype == mx.bool_:
        return mask & visible
    return mx.where(visible, mask, mx.array(-mx.inf, mask.dtype))


class MultiHeadAttention(nn.Module):
    """Multi-head attention with optional GQA/MQA, RoPE and KV cache.

    Args:
        d_model: model (embedding) width.
        n_heads: query heads.
        n_kv_heads: key/value heads (default ``n_heads``); must divide ``n_heads``.
        head_dim: per-head width (default ``d_model // n_heads``).
        bias: biases on the q/k/v projections.
        out_bias: bias on the output projection (default: ``bias``).
        fused_qkv: one ``qkv_proj`` instead of ``q_proj``/``k_proj``/``v_proj``
            (self-attention only).
        dropout: attention-weight dropout while training (uses the reference path).
        rope: a :class:`RoPE` applied to queries and keys in self-attention.
        backend: ``"auto"``, ``"fused"`` or ``"reference"`` (see
            :func:`mlx_attn.scaled_dot_product_attention`).
        window_size: sliding-window attention (each query sees at most this
            many most recent keys). Through a ``RotatingKVCache`` the window
            goes by key position (the cache's band mask), so a wrapped ring
            gives the full pass's answer.
        softcap: cap the attention logits, ``softcap * tanh(logit /
            softcap)`` before the mask (Gemma 2's ``attn_logit_softcapping``);
            None: no cap.

    Every bad argument, at construction or call, raises ``ValueError``
    naming it; a call with a bad mask leaves an ``mlx_attn.cache`` cache
    untouched (it says how many keys it will return; other caches are
    checked after their update).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        *,
        head_dim: int | None = None,
        bias: bool = False,
        out_bias: bool | None = None,
        fused_qkv: bool = False,
        dropout: float = 0.0,
        rope: RoPE | None = None,
        backend: Backend = "auto",
        window_size: int | None = None,
        softcap: float | None = None,
    ):
        super().__init__()
        d_model = check_int("d_model", d_model, minimum=1)
        n_heads = check_int("n_heads", n_heads, minimum=1)
        n_kv_heads = n_heads if n_kv_heads is None else check_int("n_kv_heads", n_kv_heads, minimum=1)
        head_dim = check_optional_int("head_dim", head_dim, minimum=1)
        if head_dim is None:
            if d_model % n_heads:
                raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
            head_dim = d_model // n_heads
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
        check_bool("bias", bias)
        if out_bias is not None:
            check_bool("out_bias", out_bias)
        check_bool("fused_qkv", fused_qkv)
        dropout = check_real("dropout", dropout)
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        if backend not in ("auto", "fused", "reference"):
            raise ValueError(f"backend must be 'auto', 'fused' or 'reference', got {backend!r}")
        if rope is not None and not isinstance(rope, RoPE):
            raise ValueError(f"rope must be a mlx_attn.RoPE or None, got {type(rope).__name__}")
        if rope is not None and rope.dims > head_dim:
            raise ValueError(f"RoPE over {rope.dims} dims does not fit head_dim {head_dim}")
        window_size = check_optional_int("window_size", window_size, minimum=1)
        softcap = as_softcap(softcap)
        # the projection weights, checked before nn.Linear creates them
        q_width = check_int("n_heads * head_dim", n_heads * head_dim, maximum=MAX_DIM)
        kv_width = n_kv_heads * head_dim
        in_width = check_int("the fused qkv width", q_width + 2 * kv_width) if fused_qkv else q_width
        check_elements("the q/qkv projection weight", (in_width, d_model))
        check_elements("the o_proj weight", (d_model, q_width))
        self.d_model = d_model
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.dropout = dropout
        self.rope = rope
        self.backend = backend
        self.window_size = window_size
        self.softcap = softcap
        self.fused_qkv = fused_qkv
        if fused_qkv:
            self.qkv_proj = nn.Linear(d_model, q_width + 2 * kv_width, bias=bias)
        else:
            self.q_proj = nn.Linear(d_model, q_width, bias=bias)
            self.k_proj = nn.Linear(d_model, kv_width, bias=bias)
            self.v_proj = nn.Linear(d_model, kv_width, bias=bias)
        self.o_proj = nn.Linear(q_width, d_model, bias=bias if out_bias is None else out_bias)

    def _split_heads(self, x: mx.array, heads: int) -> mx.array:
        b, t, _ = x.shape
        return x.reshape(b, t, heads, self.head_dim).transpose(0, 2, 1, 3)

    def _project(self, x: mx.array, kv: mx.array | None):
        if self.fused_qkv:
            if kv is not None:
                raise ValueError("fused_qkv projections serve self-attention only; pass kv=None")
            q_width = self.n_heads * self.head_dim
            kv_width = self.n_kv_heads * self.head_dim
            qkv = self.qkv_proj(x)
            return mx.split(qkv, [q_width, q_width + kv_width], axis=-1)
        source = x if kv is None else kv
        return self.q_proj(x), self.k_proj(source), self.v_proj(source)

    def _check_inputs(self, x: mx.array, kv: mx.array | None, cache):
        check_array("x", x, floating=True)
        if x.ndim != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must be [batch, length, {self.d_model}], got shape {x.shape}")
        if kv is not None:
            check_array("kv", kv, floating=True)
            if kv.ndim != 3 or kv.shape[-1] != self.d_model:
                raise ValueError(f"kv must be [batch, length, {self.d_model}], got shape {kv.shape}")
            if kv.shape[0] != x.shape[0]:
                raise ValueError(f"x and kv batch sizes differ: {x.shape[0]} vs {kv.shape[0]}")
        if cache is not None and not (hasattr(cache, "update_and_fetch") and hasattr(cache, "offset")):
            raise ValueError(f"cache must be a KV cache (update_and_fetch, offset), got {type(cache).__name__}")

    def _check_attention(self, q, k, v, mask, backend: Backend, kv_len: int | None = None):
        """The SDPA contract for these arguments; with ``kv_len``, for keys of
        that length (what a cache will return). Additive mask values are not
        read: that would synchronize every call and break ``mx.compile``
        (NaN in a mask gives NaN in its rows, as with ``mx.fast``)."""
        if kv_len is not None:
            # lazy placeholders of the right shape: never evaluated, nothing allocated
            k = mx.zeros((*k.shape[:2], kv_len, k.shape[3]), k.dtype)
            v = mx.zeros((*v.shape[:2], kv_len, v.shape[3]), v.dtype)
        attention_path(q, k, v, scale=self.scale, mask=mask, window_size=self.window_size, backend=backend,
                       softcap=self.softcap)

    def __call__(
        self,
        x: mx.array,
        kv: mx.array | None = None,
        *,
        mask: mx.array | str | None = None,
        cache=None,
        return_weights: bool = False,
    ):
        """Attend from ``x [B, T, d_model]`` to itself, or to ``kv [B, S,
        d_model]`` (cross-attention). ``mask``: None, ``"causal"`` or an array
        broadcastable to ``[B, n_heads, T, S]``. ``cache``: a KV cache
        (``mlx_attn.cache``); RoPE then starts at ``cache.offset``. Returns
        ``y [B, T, d_model]``, and the attention weights ``[B, n_heads, T, S]``
        too when ``return_weights`` (computed by the reference path)."""
        self._check_inputs(x, kv, cache)
        check_bool("return_weights", return_weights)
        dropout = self.dropout if self.training else 0.0
        # weights and dropout exist only on the reference path
        needs_weights = return_weights or dropout > 0.0
        backend = "reference" if needs_weights else self.backend
        q, k, v = self._project(x, kv)
        q = self._split_heads(q, self.n_heads)
        k = self._split_heads(k, self.n_kv_heads)
        v = self._split_heads(v, self.n_kv_heads)

        if self.rope is not None and kv is None:
            offset = cache.offset if cache is not None else 0
            q = self.rope(q, offset=offset)
            k = self.rope(k, offset=offset)
        checked = False
        window = self.window_size
        if cache is not None:
            if hasattr(cache, "keys_after_update") and k.shape[2] > 0:
                # before the update, so that a bad mask leaves the cache as it was
                self._check_attention(q, k, v, mask, backend, cache.keys_after_update(k.shape[2]))
                checked = True
            k, v = cache.update_and_fetch(k, v)
            if isinstance(cache, RotatingKVCache) and window is not None:
                # its keys are not in time order (a wrapped ring, kept first
                # tokens): the window goes by key position, in its band mask
                mask = _restrict(mask, cache.make_mask(q.shape[2], window_size=window))
                window = None
            elif isinstance(mask, str) and mask == "causal":
                # a rotating cache needs its band mask, others plain causal
                mask = cache.make_mask(q.shape[2]) if q.shape[2] > 1 else None
        # a quantized cache returns mx.quantize triples (checked by quantized SDPA)
        quantization = dict(group_size=cache.group_size, bits=cache.bits) if isinstance(k, tuple) else None
        if quantization is not None and needs_weights:
            k, v = (dequantize(x, **quantization) for x in (k, v))
            quantization = None
        if not checked and needs_weights:
            self._check_attention(q, k, v, mask, backend)

        if quantization is not None:
            out = quantized_scaled_dot_product_attention(
                q, k, v, scale=self.scale, mask=mask, window_size=window, backend=self.backend,
                softcap=self.softcap, **quantization,
            )
            weights = None
        elif needs_weights:
            out, weights = reference_attention(
                q, k, v, scale=self.scale, mask=mask, window_size=window,
                return_weights=True, dropout_p=dropout, softcap=self.softcap,
            )
        else:  # one validated call, built once (ValueError naming a bad argument)
            out = AttentionCall.build(q, k, v, scale=self.scale, mask=mask, window_size=window,
                                      backend=self.backend, softcap=self.softcap).run()
            weights = None
        b, h, t, dv = out.shape
        y = self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, t, h * dv))
        return (y, weights) if return_weights else y
