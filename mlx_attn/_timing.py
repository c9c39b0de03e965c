"""The one wall-clock timer of the package (doctor, benchmarks)."""

from __future__ import annotations

import time
from typing import Callable

import mlx.core as mx
import numpy as np


def median_seconds(fn: Callable[[], object], repeats: int = 5) -> float:
    """Median wall time of ``mx.eval(fn())`` over ``repeats`` runs, after one
    untimed warm-up run (kernel compilation, allocation)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    mx.eval(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times))
