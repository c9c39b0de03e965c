"""The decoder architectures this package loads, keyed by the names the
checkpoint formats use: GGUF's ``general.architecture`` and Hugging Face's
``config.json`` ``model_type``.

A model module registers itself when imported::

    ARCHITECTURE = register(Architecture(name="llama", gguf_architectures=("llama",), ...))

and the first lookup imports every module of the ``mlx_attn.lm.models``
package, so adding an architecture is one new file (plus its test): the
loaders, conversion, generation and the CLI reach a model only through its
:class:`Architecture` and the :class:`mlx_attn.lm.models.base.Decoder`
interface. Code outside the package (a test, a plugin) calls
:func:`register` itself."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import threading
from typing import Any, Callable

__all__ = ["Architecture", "register", "architecture_for_gguf", "architecture_for_hf", "architectures",
           "is_registered_hf_model_type", "GGUF_TENSOR_NAMES"]

# The key under which the GGUF loader adds the file's tensor names to the
# metadata given to ``config_from_gguf`` (e.g. Llama ties its embeddings
# when the file has no ``output.weight``); no GGUF writer uses this namespace.
GGUF_TENSOR_NAMES = "mlx_attn.tensor_names"


def _layer_count(config) -> int:
    return config.num_hidden_layers


def _mlx_lm_name(path: str) -> str:
    """mlx-lm's name of a parameter or module path of most decoders: the
    body under ``model.``, the output head at the top."""
    return path if path.startswith("lm_head") else f"model.{path}"


@dataclasses.dataclass(frozen=True)
class Architecture:
    """Everything the loaders and tools need to know about one decoder family.

    ``config_from_gguf`` / ``config_from_hf`` raise
    :class:`mlx_attn.lm.validate.FieldError` naming the metadata key or
    config field at fault. ``sanitize_*`` rename checkpoint tensors to the
    model's parameter paths (``layers.0.self_attn.q_proj.weight``) and drop
    what the model recomputes. ``weight_shapes`` lists every parameter's
    (unquantized) shape; it is called only once ``layer_count(config)``
    matches the layers the checkpoint holds (its ``{layers_prefix}.{i}.*``
    tensors), so no untrusted number sizes it. ``hf_config``
    is the ``config.json`` mlx-lm loads for this model (``convert``), with
    ``mlx_lm_name`` mapping a parameter or module path to mlx-lm's."""

    name: str
    gguf_architectures: tuple[str, ...]
    hf_model_types: tuple[str, ...]
    model_class: type
    config_from_gguf: Callable[[dict], Any]
    config_from_hf: Callable[[dict], Any]
    sanitize_gguf: Callable[[dict, Any], dict]
    sanitize_hf: Callable[[dict, Any], dict]
    weight_shapes: Callable[[Any], dict]
    hf_config: Callable[[Any], dict]
    layer_count: Callable[[Any], int] = _layer_count
    layers_prefix: str = "layers"  # the model's per-layer parameters are {layers_prefix}.{i}.*
    mlx_lm_name: Callable[[str], str] = _mlx_lm_name

    def __post_init__(self):
        if not isinstance(self.layers_prefix, str) or not self.layers_prefix:
            raise ValueError(f"Architecture.layers_prefix must be a non-empty string, got {self.layers_prefix!r}")
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Architecture.name must be a non-empty string, got {self.name!r}")
        for field in ("gguf_architectures", "hf_model_types"):
            value = getattr(self, field)
            if not isinstance(value, tuple) or not all(isinstance(v, str) and v for v in value):
                raise ValueError(f"Architecture {self.name!r}: {field} must be a tuple of names, got {value!r}")
        if not isinstance(self.model_class, type):
            raise ValueError(f"Architecture {self.name!r}: model_class must be a class")
        for field in ("config_from_gguf", "config_from_hf", "sanitize_gguf", "sanitize_hf", "weight_shapes",
                      "hf_config", "layer_count", "mlx_lm_name"):
            if not callable(getattr(self, field)):
                raise ValueError(f"Architecture {self.name!r}: {field} must be callable")


_registered: dict[str, Architecture] = {}
_lock = threading.Lock()
_discovered = False


def register(arch: Architecture) -> Architecture:
    """Adds ``arch`` (replacing an architecture of the same name, e.g. a
    module imported again); another architecture claiming one of its GGUF or
    HF names is a ValueError. Returns ``arch``."""
    if not isinstance(arch, Architecture):
        raise ValueError(f"register takes an Architecture, got {type(arch).__name__}")
    with _lock:
        for other in _registered.values():
            if other.name == arch.name:
                continue
            for field in ("gguf_architectures", "hf_model_types"):
                shared = set(getattr(other, field)) & set(getattr(arch, field))
                if shared:
                    raise ValueError(f"architecture {arch.name!r} claims {field} {sorted(shared)}, "
                                     f"already those of {other.name!r}")
        _registered[arch.name] = arch
    return arch


def _discover() -> None:
    """Imports every module of ``mlx_attn.lm.models`` once (each registers
    its architecture)."""
    global _discovered
    if _discovered:
        return
    package = importlib.import_module("mlx_attn.lm.models")
    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{module.name}")
    _discovered = True


def architectures() -> list[Architecture]:
    """Every registered architecture, by name."""
    _discover()
    return [_registered[name] for name in sorted(_registered)]


def _lookup(field: str, value, what: str) -> Architecture:
    known = architectures()
    for arch in known:
        if value in getattr(arch, field):
            return arch
    names = sorted(n for arch in known for n in getattr(arch, field))
    raise ValueError(f"{what} {value!r} is not supported (supported: {', '.join(names) or 'none'})")


def is_registered_hf_model_type(model_type: str) -> bool:
    """Whether an architecture of mlx_attn's own reads this ``model_type``."""
    return any(model_type in arch.hf_model_types for arch in architectures())


def architecture_for_gguf(name: str) -> Architecture:
    """The architecture of a GGUF ``general.architecture`` value."""
    return _lookup("gguf_architectures", name, "general.architecture")


def architecture_for_hf(model_type: str) -> Architecture:
    """The architecture of a Hugging Face ``config.json`` ``model_type``."""
    return _lookup("hf_model_types", model_type, "model_type")
