"""Which loader runs a model: mlx_attn's own models, or mlx-lm's classes on
mlx_attn's kernels (``--engine``). Below both the command line and the
server, which load through here."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from mlx_attn.lm import mlx_lm_models
from mlx_attn.lm.loading import load_model
from mlx_attn.lm.model_store import MODELS
from mlx_attn.lm.models.registry import architecture_for_hf, is_registered_hf_model_type
from mlx_attn.lm.validate import FieldError

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
        if model_type is None:
            return "own"
        if not is_registered_hf_model_type(model_type):
            return "mlx-lm"
        return "mlx-lm" if _own_model_refuses(path, model_type) and _mlx_lm_installed() else "own"
    hub_name = not path.exists() and len(str(model_name).split("/")) == 2 and not str(model_name).endswith(".gguf")
    return "mlx-lm" if hub_name and _mlx_lm_installed() else "own"


def _mlx_lm_installed() -> bool:
    return importlib.util.find_spec("mlx_lm") is not None


def _own_model_refuses(directory: Path, model_type: str) -> bool:
    """Whether mlx_attn's own model of ``model_type`` refuses this
    config.json (a field it does not implement, e.g. Llama 3's RoPE
    scaling), which mlx-lm's class may take."""
    try:
        architecture_for_hf(model_type).config_from_hf(json.loads((directory / "config.json").read_text()))
    except FieldError:
        return True
    except (OSError, ValueError):
        return False  # unreadable: the own loader says what is wrong
    return False


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
