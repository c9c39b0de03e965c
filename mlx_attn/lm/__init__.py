"""The language-model application built on the mlx_attn attention library."""
