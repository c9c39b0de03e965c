"""mlx_attn.scaled_dot_product_attention as a drop-in for mx.fast's.

    python examples/sdpa_quickstart.py
"""

import time

import mlx_attn

mlx_attn.use_system_blas()  # before MLX is imported (Linux: MLX's float32 matmuls on a system OpenBLAS)

import mlx.core as mx  # noqa: E402

batch, q_heads, kv_heads, length, head_dim = 1, 8, 2, 2048, 64  # GQA: 4 query heads per K/V head
q = mx.random.normal((batch, q_heads, length, head_dim))
k = mx.random.normal((batch, kv_heads, length, head_dim))
v = mx.random.normal((batch, kv_heads, length, head_dim))
mx.eval(q, k, v)
scale = head_dim**-0.5

print("path:", mlx_attn.attention_path(q, k, v, mask="causal"))
for name, fn in [
    ("mlx_attn (fused)", lambda: mlx_attn.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")),
    ("mlx_attn (reference)", lambda: mlx_attn.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal", backend="reference")),
    ("mx.fast", lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")),
]:
    mx.eval(fn())
    start = time.perf_counter()
    out = fn()
    mx.eval(out)
    print(f"{name:22s} {1e3 * (time.perf_counter() - start):8.1f} ms")

fused = mlx_attn.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")
theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")
print("max |fused - mx.fast| =", mx.abs(fused - theirs).max().item())

# Extensions: sliding-window attention and attention sinks
windowed = mlx_attn.scaled_dot_product_attention(q, k, v, scale=scale, window_size=256)
with_sinks = mlx_attn.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal", sinks=mx.zeros((q_heads,)))
print("window/sinks outputs:", windowed.shape, with_sinks.shape)
