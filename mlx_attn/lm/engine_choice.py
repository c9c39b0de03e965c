"""Which loader runs a model: mlx_attn's own models, or mlx-lm's classes on
mlx_attn's kernels (``--engine``). Below both the command line and the
server, which load through here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from mlx_attn.lm import mlx_lm_models
from mlx_attn.lm.loading import load_model
from mlx_attn.lm.model_store import MODELS
from mlx_attn.lm.models.registry import is_registered_hf_model_type

__all__ = ["choose_engine", "load_for_engine"]


def choose_engine(engine: str, model_name) -> str:
    """``"own"`` or ``"mlx-lm"``: ``engine`` as given, ``"auto"`` decided for
    this model (see ``--engine``'s help)."""
    if engine != "auto":
        return engine
    if model_name is None or str(model_name) in MODELS:
        return "own"
    path = Path(model_name)
    if path.is_dir():
        model_type = mlx_lm_models.model_type_of(path)
        return "mlx-lm" if model_type is not None and not is_registered_hf_model_type(model_type) else "own"
    hub_name = not path.exists() and len(str(model_name).split("/")) == 2 and not str(model_name).endswith(".gguf")
    return "mlx-lm" if hub_name and importlib.util.find_spec("mlx_lm") is not None else "own"


def load_for_engine(model_name, engine: str = "auto", backend: str = "auto"):
    """``(model, tokenizer)``: mlx_attn's own model or mlx-lm's classes on
    mlx_attn's kernels, as :func:`choose_engine` decides (`generate` and
    `serve` both load through here)."""
    if choose_engine(engine, model_name) == "mlx-lm":
        if model_name is None:
            raise ValueError("--engine mlx-lm needs --model (a model directory or a Hugging Face repo id)")
        try:
            return mlx_lm_models.load(model_name, backend=backend)
        except ImportError as error:
            raise ValueError(str(error)) from None
    return load_model(model_name, backend=backend)
