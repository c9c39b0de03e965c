"""Checks for values that come from users and from model files: every rule
names the value it rejects, so the error points at the argument or field."""

from __future__ import annotations

import math
import numbers

__all__ = ["FieldError", "require_int", "require_float", "require_bool", "require_str", "require_utf8"]


class FieldError(ValueError):
    """A bad value of a named argument or field; ``field`` is that name so
    a loader can say where in which file it came from."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field} {problem}")
        self.field = field
        self.problem = problem


def _describe(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def require_int(field: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as an int (bools and floats are refused) within the bounds."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise FieldError(field, f"must be an integer, got {type(value).__name__} {_describe(value)}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise FieldError(field, f"must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise FieldError(field, f"must be <= {maximum}, got {value}")
    return value


def require_float(
    field: str,
    value,
    minimum: float | None = None,
    maximum: float | None = None,
    *,
    min_inclusive: bool = True,
    max_inclusive: bool = True,
) -> float:
    """``value`` as a finite float (ints welcome, bools refused) in range."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise FieldError(field, f"must be a number, got {type(value).__name__} {_describe(value)}")
    value = float(value)
    if not math.isfinite(value):
        raise FieldError(field, f"must be finite, got {value}")
    if minimum is not None and (value < minimum or (value == minimum and not min_inclusive)):
        raise FieldError(field, f"must be {'>=' if min_inclusive else '>'} {minimum}, got {value}")
    if maximum is not None and (value > maximum or (value == maximum and not max_inclusive)):
        raise FieldError(field, f"must be {'<=' if max_inclusive else '<'} {maximum}, got {value}")
    return value


def require_bool(field: str, value) -> bool:
    if not isinstance(value, bool):
        raise FieldError(field, f"must be true or false, got {type(value).__name__} {_describe(value)}")
    return value


def require_str(field: str, value) -> str:
    if not isinstance(value, str):
        raise FieldError(field, f"must be a string, got {type(value).__name__} {_describe(value)}")
    return value


def require_utf8(field: str, value) -> str:
    """A string that is valid Unicode text (Python keeps undecodable bytes of
    command-line arguments as lone surrogates, which cannot be encoded)."""
    require_str(field, value)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise FieldError(field, "is not valid UTF-8 text (it holds undecodable bytes)") from None
    return value
