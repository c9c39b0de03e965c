"""mlx_attn/_blas.py: on Linux a system OpenBLAS is preloaded before MLX so
MLX's float32 matmuls use it instead of the bundled reference BLAS. Each
case runs in a fresh interpreter: the choice is made once, at import."""

import json
import os
import subprocess
import sys

import pytest

from mlx_attn import _blas

REPORT = """
import json, sys
{before}
import mlx_attn
from mlx_attn._blas import blas_choice
import mlx.core as mx
import numpy as np
rng = np.random.default_rng(0)
a = rng.standard_normal((67, 129)).astype(np.float32)
b = rng.standard_normal((129, 45)).astype(np.float32)
err = float(np.abs(np.array(mx.array(a) @ mx.array(b)) - a.astype(np.float64) @ b).max())
c = blas_choice()
print(json.dumps({{"library": c.library, "reason": c.reason, "err": err}}))
"""


def _run(before: str = "", **env) -> dict:
    full_env = {k: v for k, v in os.environ.items() if k != _blas.ENV}
    full_env.update(env)
    done = subprocess.run([sys.executable, "-c", REPORT.format(before=before)], capture_output=True, text=True,
                          env=full_env, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the preload is Linux-only")


@linux_only
def test_auto_uses_the_system_openblas_when_present_and_matmuls_stay_exact():
    found = _blas._find_openblas()
    report = _run()
    assert report["err"] < 1e-3
    if found is None:
        assert report["library"] is None and "no system OpenBLAS" in report["reason"]
        if os.environ.get("CI"):
            pytest.fail("CI installs libopenblas0-pthread (scripts/test.sh): the preload must be exercised")
    else:
        assert report["library"] == found
        assert "preloaded" in report["reason"]


@linux_only
def test_off_keeps_mlx_blas():
    report = _run(MLX_ATTN_BLAS="off")
    assert report["library"] is None and "off" in report["reason"]
    assert report["err"] < 1e-3


@linux_only
def test_mlx_imported_first_cannot_be_rebound_and_says_so():
    report = _run(before="import mlx.core")
    assert report["library"] is None
    assert "imported before mlx_attn" in report["reason"]


@linux_only
def test_an_explicit_bad_library_is_a_clear_error():
    done = subprocess.run([sys.executable, "-c", "import mlx_attn"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, _blas.ENV: "/nonexistent/libblas.so"})
    assert done.returncode != 0
    assert "MLX_ATTN_BLAS" in done.stderr and "/nonexistent/libblas.so" in done.stderr


def test_doctor_names_the_blas():
    from mlx_attn import doctor

    rows = dict(doctor._environment_rows(None))
    assert rows["BLAS for MLX matmuls"]
