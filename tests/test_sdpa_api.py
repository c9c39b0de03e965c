"""The public API: validation errors, path selection, gradients, streams."""

import mlx.core as mx
import numpy as np
import pytest

import mlx_attn
from sdpa_cases import assert_close, fused, make_qkv, reference

sdpa = mlx_attn.scaled_dot_product_attention


def good():
    return make_qkv(2, 4, 2, 5, 7, 8)


def with_(q=None, k=None, v=None):
    gq, gk, gv = good()
    return (gq if q is None else q), (gk if k is None else k), (gv if v is None else v)


BAD_INPUTS = [
    ("rank", dict(q=mx.zeros((4, 5, 8))), {}),
    ("rank", dict(k=mx.zeros((1, 2, 2, 7, 8))), {}),
    ("batch", dict(k=mx.zeros((3, 2, 7, 8))), {}),
    ("batch", dict(v=mx.zeros((1, 2, 7, 8))), {}),
    ("head dim", dict(k=mx.zeros((2, 2, 7, 4))), {}),
    ("same number of heads", dict(v=mx.zeros((2, 1, 7, 8))), {}),
    ("same length", dict(v=mx.zeros((2, 2, 6, 8))), {}),
    ("multiple", dict(k=mx.zeros((2, 3, 7, 8)), v=mx.zeros((2, 3, 7, 8))), {}),
    ("int32", dict(q=mx.zeros((2, 4, 5, 8), dtype=mx.int32)), {}),
    ("int8", dict(v=mx.zeros((2, 2, 7, 8), dtype=mx.int8)), {}),
    ("mlx.core.array", dict(q=np.zeros((2, 4, 5, 8), dtype=np.float32)), {}),
    ("broadcast", {}, dict(mask=mx.ones((5, 6), dtype=mx.bool_))),
    ("broadcast", {}, dict(mask=mx.ones((3, 1, 5, 7), dtype=mx.bool_))),
    ("at most 4", {}, dict(mask=mx.ones((1, 1, 1, 5, 7), dtype=mx.bool_))),
    ("boolean", {}, dict(mask=mx.ones((5, 7), dtype=mx.int32))),
    ("promote", {}, dict(mask=mx.ones((5, 7), dtype=mx.float32), _dtype=mx.float16)),
    ("'causal'", {}, dict(mask="upper")),
    ("mask must be", {}, dict(mask=[[True]])),
    ("sinks", {}, dict(sinks=mx.zeros((2,)))),
    ("sinks", {}, dict(sinks=mx.zeros((1, 4)))),
    ("sinks", {}, dict(sinks=mx.zeros((4,), dtype=mx.int32))),
    ("sinks dtype", {}, dict(sinks=mx.zeros((4,)), _dtype=mx.bfloat16)),
    ("window_size", {}, dict(window_size=0)),
    ("window_size", {}, dict(window_size=2.5)),
    ("scale", {}, dict(scale=float("nan"))),
    ("scale", {}, dict(scale="0.5")),
    ("backend", {}, dict(backend="gpu-please")),
]


@pytest.mark.parametrize("message,arrays,kwargs", BAD_INPUTS, ids=[b[0] + str(i) for i, b in enumerate(BAD_INPUTS)])
def test_bad_input_raises_value_error_naming_the_problem(message, arrays, kwargs):
    q, k, v = with_(**arrays)
    kwargs = dict(kwargs)
    dtype = kwargs.pop("_dtype", None)
    if dtype is not None:
        q, k, v = (a.astype(dtype) for a in (q, k, v))
    kwargs.setdefault("scale", 0.5)
    for backend in ("auto", "reference"):
        kw = dict(kwargs)
        kw.setdefault("backend", backend)
        with pytest.raises(ValueError, match=message):
            sdpa(q, k, v, **kw)


def test_scale_is_required_keyword():
    q, k, v = good()
    with pytest.raises(TypeError):
        sdpa(q, k, v)
    with pytest.raises(TypeError):
        sdpa(q, k, v, 0.5)


def test_attention_path_is_observable():
    q, k, v = good()
    assert mlx_attn.attention_path(q, k, v, mask="causal") == "fused-cpu"
    assert mlx_attn.attention_path(q, k, v, backend="reference") == "reference"
    assert mlx_attn.attention_path(q, k, v, stream=mx.cpu) == "fused-cpu"
    big = mx.zeros((1, 1, 3, 1100))  # past the CPU kernel's head dims (1..1024)
    assert mlx_attn.attention_path(big, big, big) == "reference"
    with pytest.raises(ValueError, match="head dims"):
        sdpa(big, big, big, scale=1.0, backend="fused")
    # the reference path still answers for such head dims
    out = sdpa(big, big, big, scale=1.0)
    assert out.shape == (1, 1, 3, 1100)


def test_stream_argument_runs_on_that_stream():
    q, k, v = good()
    s = mx.new_stream(mx.cpu)
    out = sdpa(q, k, v, scale=0.3, mask="causal", stream=s)
    assert_close(out, reference(q, k, v, scale=0.3, mask="causal"), mx.float32)


def test_works_under_compile():
    q, k, v = good()

    @mx.compile
    def f(q, k, v):
        return sdpa(q, k, v, scale=0.3, mask="causal") * 2

    assert_close(f(q, k, v), 2 * fused(q, k, v, scale=0.3, mask="causal"), mx.float32)


def test_drop_in_signature_matches_mlx_fast():
    q, k, v = make_qkv(1, 8, 4, 16, 16, 64)
    sinks = mx.zeros((8,))
    for mask in (None, "causal", mx.ones((16, 16), dtype=mx.bool_)):
        ours = sdpa(q, k, v, scale=0.125, mask=mask, sinks=sinks, stream=None)
        theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask, sinks=sinks, stream=None)
        assert_close(ours, theirs, mx.float32)
