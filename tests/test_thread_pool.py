"""The CPU kernels' thread pool (csrc/cpu/thread_pool.cpp) hands each call's
indices out exactly once, in contiguous runs per thread (the quantized
products) or from one counter, however its workers wait between calls
(spinning for MLX_ATTN_SPIN_US microseconds, or sleeping at once): many
small back-to-back products on two or three threads equal the same products
on one."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

PRODUCTS = r"""
import sys
import mlx.core as mx
import numpy as np
from mlx_attn import _ext

mx.random.seed(0)
outs = []
weights = []
for n, k in ((192, 576), (64, 256), (1536, 576)):
    w = mx.random.normal((n, k))
    weights.append((mx.quantize(w, group_size=32, bits=4), k))
for call in range(int(sys.argv[2])):
    (codes, scales, biases), k = weights[call % len(weights)]
    x = mx.random.normal((1 + call % 3, k), key=mx.random.key(call))
    y = _ext.quantized_matvec_int8(x, codes, scales, biases, 32, 4, 16)
    mx.eval(y)  # one pool call at a time, back to back, as a decode step makes them
    outs.append(np.array(y).ravel())
np.save(sys.argv[1], np.concatenate(outs))
"""


def products(tmp_path, threads: int, spin: str | None, calls: int = 300) -> np.ndarray:
    env = dict(os.environ, MLX_ATTN_NUM_THREADS=str(threads))
    env.pop("MLX_ATTN_SPIN_US", None)
    if spin is not None:
        env["MLX_ATTN_SPIN_US"] = spin
    out = tmp_path / f"out_{threads}_{spin}.npy"
    done = subprocess.run([sys.executable, "-c", PRODUCTS, str(out), str(calls)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return np.load(out)


@pytest.mark.parametrize("threads, spin", [(2, None), (2, "0"), (2, "50"), (2, "not a number"), (3, None), (3, "-1")])
def test_more_threads_equal_one_thread_call_after_call(tmp_path, threads, spin):
    # each output is one task's sums (the same on any thread): equal bit for bit;
    # three threads split 6- and 18-task calls into uneven contiguous runs
    one = products(tmp_path, 1, "0")
    assert np.isfinite(one).all() and np.abs(one).max() > 0
    np.testing.assert_array_equal(products(tmp_path, threads, spin), one)
