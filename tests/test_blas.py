"""mlx_attn/_blas.py: on Linux, mlx_attn.use_system_blas() (called before
MLX is imported) preloads a system OpenBLAS so MLX's float32 matmuls use it
instead of the bundled reference BLAS; importing mlx_attn alone changes
nothing. Each case runs in a fresh interpreter: the choice is made once."""

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
{call}
from mlx_attn._blas import blas_choice
import mlx.core as mx
import numpy as np
rng = np.random.default_rng(0)
a = rng.standard_normal((67, 129)).astype(np.float32)
b = rng.standard_normal((129, 45)).astype(np.float32)
err = float(np.abs(np.array(mx.array(a) @ mx.array(b)) - a.astype(np.float64) @ b).max())
c = blas_choice()
mapped = "libopenblas" in open("/proc/self/maps").read() if sys.platform.startswith("linux") else False
print(json.dumps({{"library": c.library, "reason": c.reason, "err": err, "mapped": mapped}}))
"""
CALL = "mlx_attn.use_system_blas()"


def _run(before: str = "", call: str = CALL, **env) -> dict:
    full_env = {k: v for k, v in os.environ.items() if k != _blas.ENV}
    full_env.update(env)
    done = subprocess.run([sys.executable, "-c", REPORT.format(before=before, call=call)], capture_output=True,
                          text=True, env=full_env, timeout=120)
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
        assert report["mapped"] == ("openblas" in found)


@linux_only
def test_importing_and_using_mlx_attn_leaves_mlx_blas_as_shipped():
    report = _run(call="mlx_attn.scaled_dot_product_attention, mlx_attn.MultiHeadAttention")
    assert report["library"] is None and "not requested" in report["reason"]
    assert not report["mapped"]  # no libopenblas in /proc/self/maps
    assert report["err"] < 1e-3


@linux_only
def test_the_command_binds_the_system_openblas_when_present():
    probe = ("import sys\n"
             "from mlx_attn.lm.__main__ import main\n"
             "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
             "import mlx.core\n"
             "print('libopenblas' in open('/proc/self/maps').read())")
    env = {k: v for k, v in os.environ.items() if k != _blas.ENV}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    found = _blas._find_openblas()
    assert done.stdout.strip().splitlines()[-1] == str(found is not None and "openblas" in found)


@linux_only
def test_off_keeps_mlx_blas():
    report = _run(MLX_ATTN_BLAS="off")
    assert report["library"] is None and "off" in report["reason"]
    assert report["err"] < 1e-3


@linux_only
def test_mlx_imported_first_cannot_be_rebound_and_says_so():
    report = _run(before="import mlx.core")
    assert report["library"] is None
    assert "imported before use_system_blas()" in report["reason"]


@linux_only
def test_an_explicit_bad_library_is_a_clear_error():
    done = subprocess.run([sys.executable, "-c", "import mlx_attn; mlx_attn.use_system_blas()"], capture_output=True,
                          text=True, timeout=120, env={**os.environ, _blas.ENV: "/nonexistent/libblas.so"})
    assert done.returncode != 0
    assert "MLX_ATTN_BLAS" in done.stderr and "/nonexistent/libblas.so" in done.stderr


def test_doctor_names_the_blas():
    from mlx_attn import doctor

    rows = dict(doctor._environment_rows(None))
    # this process imported MLX before any request: the bundled BLAS, said so
    assert rows["BLAS for MLX matmuls"].startswith("MLX's bundled BLAS: ")
