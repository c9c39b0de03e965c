"""What every model shares: renaming checkpoint tensors to module paths and
checking a checkpoint against the shapes a config implies, before the model
is built (so no untrusted number sizes an allocation)."""

from __future__ import annotations

import re

import mlx.core as mx

__all__ = ["rename_weights", "layer_indices", "check_layer_count", "check_weights"]

QUANTIZED_BITS = (2, 3, 4, 5, 6, 8)  # what MLX's quantized matmul supports


def rename_weights(weights: dict, patterns: list[tuple[str, str]], skip=lambda name: False, source="checkpoint") -> dict:
    """Map checkpoint tensor names to module paths with the first matching
    (regex, replacement); names `skip` accepts are dropped, others are errors."""
    renamed = {}
    for name, value in weights.items():
        if skip(name):
            continue
        for pattern, replacement in patterns:
            new, count = re.subn(pattern, replacement, name)
            if count:
                renamed[new] = value
                break
        else:
            raise ValueError(f"{source}: unexpected tensor {name!r}")
    return renamed


_LAYER = re.compile(r"^layers\.(\d+)\.")


def layer_indices(weights: dict) -> set[int]:
    """Indices ``i`` of the ``layers.i.*`` tensors present."""
    return {int(match.group(1)) for name in weights if (match := _LAYER.match(name))}


def check_layer_count(weights: dict, n_layers: int, field: str, source: str) -> None:
    """The config's layer count must be what the checkpoint holds: checked
    before anything is built per layer."""
    present = layer_indices(weights)
    # n distinct non-negative indices whose largest is n - 1 are exactly 0..n-1
    # (and nothing here is sized by the untrusted n_layers)
    if len(present) != n_layers or max(present, default=-1) != n_layers - 1:
        holds = f"tensors for {len(present)} layers" + (f" (highest index {max(present)})" if present else "")
        raise ValueError(f"{source}: weights do not fit: {field} says a {n_layers}-layer model, "
                         f"the checkpoint holds {holds}")


def _quantized_problem(name: str, weights: dict, shape: tuple[int, int], group_size: int) -> str | None:
    """Why a packed ``name.weight`` / ``.scales`` / ``.biases`` triple cannot be
    the quantized form of a float ``shape`` matrix, or None if it can."""
    out_features, in_features = shape
    if f"{name}.weight" not in weights:
        return f"{name}.scales without {name}.weight"
    weight, scales = weights[f"{name}.weight"], weights[f"{name}.scales"]
    biases = weights.get(f"{name}.biases")
    if in_features % group_size:
        return f"{in_features} input features are not a multiple of the group size {group_size}"
    groups = in_features // group_size
    if weight.dtype != mx.uint32 or weight.ndim != 2 or weight.shape[0] != out_features:
        return f"packed weight is {weight.dtype} {tuple(weight.shape)}, expected uint32 ({out_features}, ...)"
    bits, remainder = divmod(weight.shape[1] * 32, in_features)
    if remainder or bits not in QUANTIZED_BITS:
        return f"packed width {weight.shape[1]} gives no supported bit width for {in_features} features"
    for part, tensor in (("scales", scales), ("biases", biases)):
        if tensor is None:
            return f"{name}.{part} is missing"
        if tuple(tensor.shape) != (out_features, groups) or not mx.issubdtype(tensor.dtype, mx.floating):
            return f"{part} are {tensor.dtype} {tuple(tensor.shape)}, expected float ({out_features}, {groups})"
    return None


def check_weights(weights: dict, expected: dict[str, tuple[int, ...]], group_size: int | None, source: str) -> None:
    """Every expected tensor is present with its shape (or as a consistent
    quantized triple when ``group_size`` is given and ``.scales`` exist), and
    nothing else is."""
    quantized = {name.removesuffix(".scales") for name in weights if name.endswith(".scales")}
    if quantized and group_size is None:
        raise ValueError(f"{source}: quantized tensors (e.g. {min(quantized)}.scales) but no quantization settings")
    allowed = set(expected)
    for name, shape in expected.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module in quantized:
            allowed |= {f"{module}.scales", f"{module}.biases"}
            problem = ("only matrices can be quantized" if len(shape) != 2
                       else _quantized_problem(module, weights, shape, group_size))
            if problem:
                raise ValueError(f"{source}: tensor {name!r}: {problem}")
            continue
        if name not in weights:
            raise ValueError(f"{source}: tensor {name!r} {shape} is missing")
        tensor = weights[name]
        if tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, the config implies {shape}")
        if not mx.issubdtype(tensor.dtype, mx.floating):
            raise ValueError(f"{source}: tensor {name!r} is {tensor.dtype}, expected a floating-point type")
    unexpected = sorted(set(weights) - allowed)
    if unexpected:
        raise ValueError(f"{source}: unexpected tensor {unexpected[0]!r}" +
                         (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))
