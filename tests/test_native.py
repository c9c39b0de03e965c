"""The native extension: one module owns it (mlx_attn/_native.py), a missing
build is loud, the C++ op validates its own inputs, and the Python modules
import each other in one direction only."""

import ast
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlx_attn
from mlx_attn import _ext
from mlx_attn.reference import LOGIT_LIMIT, MASKED_LOGIT

PACKAGE = Path(mlx_attn.__file__).resolve().parent

WITHOUT_EXTENSION = textwrap.dedent(
    """
    import sys, warnings
    # Run from the copy (python -c puts the working directory first on the
    # path), so `import mlx_attn` finds the copied tree. An editable install
    # redirects `import mlx_attn` to its checkout: drop every finder other
    # than the path-based one that would answer for it.
    sys.meta_path[:] = [f for f in sys.meta_path
                        if getattr(f, "__name__", type(f).__name__) in ("BuiltinImporter", "FrozenImporter", "PathFinder")
                        or not hasattr(f, "find_spec") or f.find_spec("mlx_attn", None) is None]
    import mlx.core as mx
    import mlx_attn
    assert mlx_attn.__file__.startswith(sys.argv[1]), mlx_attn.__file__
    q = mx.zeros((1, 2, 4, 8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            out = mlx_attn.scaled_dot_product_attention(q, q, q, scale=0.5, mask="causal")
        path = mlx_attn.attention_path(q, q, q, scale=0.5)
    try:
        mlx_attn.attention_path(q, q, q, scale=0.5, backend="fused")
        fused_error = ""
    except ValueError as error:
        fused_error = str(error)
    print(repr([str(w.message) for w in caught if issubclass(w.category, UserWarning)]))
    print(path)
    print(fused_error)
    print(out.shape)
    """
)


def test_source_tree_without_a_build_warns_once_and_says_why(tmp_path):
    shutil.copytree(PACKAGE, tmp_path / "mlx_attn", ignore=shutil.ignore_patterns("_ext*", "*.metallib", "__pycache__"))
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_EXTENSION, str(tmp_path.resolve())], capture_output=True, text=True, timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    warnings_line, path, fused_error, shape = result.stdout.strip().splitlines()
    warnings = ast.literal_eval(warnings_line)
    assert len(warnings) == 1, warnings
    assert "pip install ." in warnings[0] and "pip install -e ." in warnings[0]
    assert path == "reference"
    assert "not built" in fused_error and "pip install" in fused_error
    assert shape == "(1, 2, 4, 8)"


def test_reference_constants_are_the_kernels():
    assert LOGIT_LIMIT == _ext.LOGIT_LIMIT == 2.0**125
    assert MASKED_LOGIT == _ext.MASKED_LOGIT == -(2.0**127)


def imports_of(module: Path) -> tuple[set[str], list[int]]:
    """mlx_attn modules imported at module level, and lines of imports
    inside functions."""
    tree = ast.parse(module.read_text())
    top, nested = set(), []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            if isinstance(node, ast.ImportFrom) and node.module == "mlx_attn":
                names = [f"mlx_attn.{a.name}" for a in node.names]
            if node.col_offset > 0:  # inside a function, class or try block
                nested.append(node.lineno)
            top |= {n for n in names if n.startswith("mlx_attn")}
    return top, nested


def test_ops_metal_support_and_native_import_in_one_direction():
    graph = {}
    for name in ("ops", "metal_support", "_native"):
        top, nested = imports_of(PACKAGE / f"{name}.py")
        graph[name] = top
        # _native's `from mlx_attn import _ext` sits in a try block at module level
        assert name == "_native" or not nested, f"{name}.py imports inside a function (lines {nested})"
    assert "mlx_attn._native" in graph["ops"]
    assert "mlx_attn._native" in graph["metal_support"]
    assert not {"mlx_attn.ops", "mlx_attn.metal_support"} & graph["_native"]
    assert "mlx_attn.ops" not in graph["metal_support"]
    assert "mlx_attn.metal_support" not in graph["ops"]


def arrays(b=1, hq=4, hkv=2, tq=3, tkv=5, d=8, dv=None, dtype=mx.float32):
    return (mx.zeros((b, hq, tq, d), dtype), mx.zeros((b, hkv, tkv, d), dtype), mx.zeros((b, hkv, tkv, dv or d), dtype))


def with_(index, replacement):
    qkv = list(arrays())
    qkv[index] = replacement
    return qkv


RAW_BAD_CALLS = [  # the C++ states the invariant (the public messages are ops.AttentionCall's)
    ("head dims 1..1024", arrays(d=1030), {}),
    ("head dims 1..1024", arrays(dv=1030), {}),
    ("q.ndim == 4", with_(0, mx.zeros((4, 3, 8))), {}),
    ("v.ndim == 4", with_(2, mx.zeros((1, 1, 2, 5, 8))), {}),
    ("one batch size", with_(1, mx.zeros((2, 2, 5, 8))), {}),
    ("same heads and length", with_(2, mx.zeros((1, 2, 6, 8))), {}),
    ("same head dim", with_(1, mx.zeros((1, 2, 5, 4))), {}),
    ("multiple", [mx.zeros((1, 4, 3, 8)), mx.zeros((1, 3, 5, 8)), mx.zeros((1, 3, 5, 8))], {}),
    ("multiple", [mx.zeros((1, 4, 3, 8)), mx.zeros((1, 0, 5, 8)), mx.zeros((1, 0, 5, 8))], {}),
    ("q.dtype in", arrays(dtype=mx.int32), {}),
    ("k.dtype == v.dtype == q.dtype", with_(1, mx.zeros((1, 2, 5, 8), mx.float16)), {}),
    ("mask broadcasts", arrays(), dict(mask=mx.zeros((3, 4), mx.bool_))),
    ("mask broadcasts", arrays(), dict(mask=mx.zeros((2, 1, 3, 5), mx.bool_))),
    ("mask.ndim <= 4", arrays(), dict(mask=mx.zeros((1, 1, 1, 3, 5), mx.bool_))),
    ("mask.dtype is bool or q.dtype", arrays(), dict(mask=mx.zeros((3, 5), mx.float16))),
    ("mask.dtype is bool or q.dtype", arrays(), dict(mask=mx.zeros((3, 5), mx.int32))),
    (re.escape("sinks.shape == [q_heads]"), arrays(), dict(sinks=mx.zeros((2,)))),
    (re.escape("sinks.shape == [q_heads]"), arrays(), dict(sinks=mx.zeros((1, 4)))),
    ("sinks.dtype == q.dtype", arrays(), dict(sinks=mx.zeros((4,), mx.float16))),
    ("scale", arrays(), dict(scale=float("inf"))),
    ("scale", arrays(), dict(scale=float("nan"))),
    ("scale", arrays(), dict(scale=1e39)),
    ("window_size", arrays(), dict(window_size=-1)),
    ("only with causal", arrays(), dict(window_size=2)),  # the caller normalises "a window implies causal"
]


@pytest.mark.parametrize("message,qkv,kwargs", RAW_BAD_CALLS, ids=[f"{i}-{c[0]}" for i, c in enumerate(RAW_BAD_CALLS)])
def test_raw_extension_validates_its_own_inputs(message, qkv, kwargs):
    """_ext.fused_attention, called directly (no Python validation), raises
    ValueError instead of crashing (D=300 used to overflow a stack buffer)."""
    kwargs = {"scale": 0.5, **kwargs}
    with pytest.raises(ValueError, match=message):
        mx.eval(_ext.fused_attention(*qkv, **kwargs, stream=mx.cpu))


def test_raw_extension_runs_empty_problems():
    for shape in (dict(b=0), dict(tq=0), dict(tkv=0), dict(hq=0, hkv=1)):
        q, k, v = arrays(**shape)
        (out,) = _ext.fused_attention(q, k, v, scale=0.5, stream=mx.cpu)
        assert out.shape == q.shape[:3] + v.shape[3:]
        assert np.all(np.array(out) == 0)


def test_cpu_support_rule_comes_from_cpp():
    for d, expected in ((1024, None), (1, None), (1025, "head dims 1..1024"), (0, "head dims 1..1024")):
        problem = _ext.describe_attention(*arrays(d=d, hq=2, hkv=2))
        reason = _ext.unsupported_reason(problem, device=mx.cpu)
        assert reason == expected if expected is None else expected in reason
    assert not hasattr(mlx_attn.ops, "MAX_FUSED_CPU_HEAD_DIM")


def test_problem_description_reads_strides_and_broadcasts():
    q = mx.zeros((2, 5, 4, 8)).transpose(0, 2, 1, 3)
    sinks = mx.zeros((8,))[::2]
    mask = mx.zeros((5, 1), mx.bool_)
    mx.eval(q, sinks)
    k = v = mx.zeros((2, 2, 7, 8))
    p = _ext.describe_attention(q, k, v, scale=0.25, causal=True, mask=mask, sinks=sinks, window_size=3)
    assert (p.batch, p.q_heads, p.kv_heads, p.q_len, p.kv_len, p.head_dim, p.value_dim) == (2, 4, 2, 5, 7, 8, 8)
    assert p.q_strides == [160, 8, 32, 1]
    assert p.mask_strides == [0, 0, 1, 0]
    assert p.sinks_stride == 2
    assert p.causal and p.window_size == 3 and p.scale == 0.25 and p.mask_kind == _ext.MASK_BOOL
