"""The bottom layer of the library: argument checks and the path choice's
vocabulary, shared by the dense (:mod:`mlx_attn.ops`), quantized
(:mod:`mlx_attn.quantized`) and paged (:mod:`mlx_attn.paged`) attention calls
and by masks, RoPE and caches.

- :mod:`~mlx_attn.core.checks`: generic checks (integers, reals, flags,
  arrays, sizes) and the float dtypes the kernels take.
- :mod:`~mlx_attn.core.attention_arguments`: the arguments every attention
  call parses alike (scale, softcap, window, sinks, the stream's device).
- :mod:`~mlx_attn.core.path_choice`: the ``backend`` argument and the names
  of the paths, with :class:`~mlx_attn.core.path_choice.PathChoice`.
- :mod:`~mlx_attn.core.quantization`: the ``mx.quantize`` triple format.
- :mod:`~mlx_attn.core.paged_layout`: the paged call's host-side layout.

Modules here import MLX, NumPy and each other only (never an attention
implementation), so everything above can use them.
"""
