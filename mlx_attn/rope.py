"""Rotary position embeddings (RoPE).

Feature pairs are rotated by an angle proportional to the position:
``theta_i(p) = scale * p * base^(-2i/dims)``. Two layouts pair the features
differently:

- ``traditional=True``: interleaved pairs ``(x0, x1), (x2, x3), ...``
  (the original RoFormer layout, and GGUF/llama.cpp's);
- ``traditional=False``: split halves ``(x_i, x_{i + dims/2})`` (Hugging Face
  Llama's ``rotate_half``).

Only the first ``dims`` features are rotated; the rest pass through.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlx_attn.core.checks import MAX_DIM, check_array, check_bool, check_int, check_real

__all__ = ["RoPE", "rope_angles"]


FLOAT32_MAX = 3.4028234663852886e38


def _check_parameters(dims, base, scale) -> tuple[int, float, float]:
    """Checked ``dims, base, scale``: the angles are computed in float32 and
    must stay finite at every int32 position (else cos/sin give NaN)."""
    dims = check_int("RoPE dims", dims)
    if dims < 2 or dims % 2:
        raise ValueError(f"RoPE dims must be a positive even number, got {dims}")
    base, scale = check_real("RoPE base", base, positive=True), check_real("RoPE scale", scale)
    if base > FLOAT32_MAX:
        raise ValueError(f"RoPE base must be finite in float32, got {base}")
    largest_frequency = max(1.0, 1.0 / base)  # base ** (-2i / dims) over i
    if abs(scale) * MAX_DIM * largest_frequency >= FLOAT32_MAX:
        raise ValueError(
            f"RoPE base={base} and scale={scale} make the rotation angles overflow float32 "
            f"(|scale| / min(base, 1) must stay below {FLOAT32_MAX / MAX_DIM:.3g})"
        )
    return dims, base, scale


def rope_angles(positions: mx.array, dims: int, base: float, scale: float) -> mx.array:
    """``[len(positions), dims // 2]`` rotation angles (float32)."""
    check_array("positions", positions, ndim=1)
    dims, base, scale = _check_parameters(dims, base, scale)
    inv_freq = base ** (-mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    return (scale * positions.astype(mx.float32))[:, None] * inv_freq[None, :]


# (dims, base, scale, traditional) -> (positions array, cos, sin) of the last per-step
# positions rotated: one entry per parameter set, so it stays small
_LAST_ROTATION: dict[tuple, tuple[mx.array, mx.array, mx.array]] = {}


class RoPE(nn.Module):
    """``RoPE(dims, base=10000.0, traditional=False, scale=1.0)``; call with
    ``x [..., T, features]`` and the position ``offset`` of its first step
    (an int >= 0 or a scalar integer array; e.g. the KV cache's ``offset``),
    or an integer array ``[T]`` giving each step's position.

    ``dims`` is a positive even int, ``base`` a finite positive number,
    ``scale`` a finite number; ``x`` is floating point. Anything else raises
    ``ValueError`` naming the argument."""

    def __init__(self, dims: int, *, base: float = 10000.0, traditional: bool = False, scale: float = 1.0):
        super().__init__()
        self.dims, self.base, self.scale = _check_parameters(dims, base, scale)
        self.traditional = check_bool("traditional", traditional)

    def _extra_repr(self) -> str:
        return f"{self.dims}, base={self.base}, traditional={self.traditional}, scale={self.scale}"

    def _positions(self, length: int, offset) -> mx.array:
        if isinstance(offset, mx.array):
            if offset.ndim > 1 or (offset.ndim == 1 and offset.shape[0] != length) or not mx.issubdtype(
                offset.dtype, mx.integer
            ):
                raise ValueError(
                    f"RoPE offset must be an int, a scalar integer array or one integer position per step "
                    f"([{length}]), got shape {tuple(offset.shape)} and dtype {offset.dtype}"
                )
            if offset.ndim == 1:  # one position per step (e.g. a packed batch of sequences)
                return offset.astype(mx.int32)
            return mx.arange(length) + offset.astype(mx.int32)
        # positions are int32: the last one must fit
        offset = check_int("RoPE offset", offset, minimum=0, maximum=MAX_DIM - length)
        return mx.arange(length) + offset

    def _rotation(self, length: int, offset) -> tuple[mx.array, mx.array]:
        """cos and sin of the angles ``[T, dims/2]``; traditional: per pair
        ``[T, dims/2, 2]``, (cos, cos) and (-sin, sin). A position array met
        again (a step's packed positions, passed to every layer's queries and
        keys) reuses the graph of its last rotation with the same parameters."""
        key = (self.dims, self.base, self.scale, self.traditional)
        if isinstance(offset, mx.array) and offset.ndim == 1:
            last = _LAST_ROTATION.get(key)
            if last is not None and last[0] is offset and offset.shape[0] == length:
                return last[1], last[2]
        positions = self._positions(length, offset)
        angles = rope_angles(positions, self.dims, self.base, self.scale)
        cos, sin = mx.cos(angles), mx.sin(angles)
        if self.traditional:
            cos, sin = mx.stack([cos, cos], axis=-1), mx.stack([-sin, sin], axis=-1)
        if isinstance(offset, mx.array) and offset.ndim == 1:
            _LAST_ROTATION[key] = (offset, cos, sin)  # holds offset: its id cannot be reused meanwhile
        return cos, sin

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        check_array("RoPE input x", x, floating=True)
        if x.ndim < 2:
            raise ValueError(f"RoPE expects [..., T, features], got shape {x.shape}")
        if x.shape[-1] < self.dims:
            raise ValueError(f"RoPE over {self.dims} dims but x has only {x.shape[-1]} features")
        cos, sin = self._rotation(x.shape[-2], offset)

        rotated, rest = x[..., : self.dims], x[..., self.dims :]
        rotated = rotated.astype(mx.float32)
        if self.traditional:
            # each pair (a, b) -> (a cos - b sin, b cos + a sin) as one elementwise
            # expression over [..., dims/2, 2] (the pair read forwards and reversed):
            # compiled, one kernel per call instead of a stack of two
            pairs = rotated.reshape(*rotated.shape[:-1], self.dims // 2, 2)
            out = (pairs * cos + pairs[..., ::-1] * sin).reshape(rotated.shape)
        else:
            half = self.dims // 2
            first, second = rotated[..., :half], rotated[..., half:]
            out = mx.concatenate([first * cos - second * sin, first * sin + second * cos], axis=-1)
        out = out.astype(x.dtype)
        return mx.concatenate([out, rest], axis=-1) if rest.shape[-1] else out
