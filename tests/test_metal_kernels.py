"""The fused Metal kernels against the reference path. On Linux the real
.metal sources run in the MSL emulator (precise and fast math), launched from
the same C++ launch plan as on a Mac; on a Mac with Metal the real kernels run.
Tolerances: tests/sdpa_cases.py (shared with the CPU kernel tests)."""

import itertools
import os
import re
import struct

import mlx.core as mx
import numpy as np
import pytest

from kernel_lab import decode_rule, msl_emulator
from kernel_lab.metal_runner import REAL_METAL, REPO, EmulatedMetal, RealMetal, View, decode_instantiation, reference_lse
from mlx_attn.metal_support import launch_plan
from mlx_attn.reference import reference_attention
from sdpa_cases import DTYPES, TOLERANCE, make_qkv


pytestmark = pytest.mark.skipif(
    not REAL_METAL and not msl_emulator.clang_available(), reason="needs Metal or clang-19 for the MSL emulator"
)
FULL_GRID = os.environ.get("MLX_ATTN_FULL_GRID") == "1"


@pytest.fixture(scope="module", params=[False, True], ids=["precise", "fast-math"])
def run(request):
    if REAL_METAL:
        if not request.param:
            pytest.skip("the real Metal compiler always uses fast math")
        return RealMetal()
    return EmulatedMetal(fast_math=request.param)


def make(b, hq, hkv, tq, tkv, d, dtype, seed=0):
    return make_qkv(b, hq, hkv, tq, tkv, d, dtype=dtype, seed=seed)


def check(run, q, k, v, layout=None, gpu_target=None, **kw):
    kw.setdefault("scale", q.shape[-1] ** -0.5)
    extra = {**({"layout": layout} if layout else {}), **({"gpu_target": gpu_target} if gpu_target else {})}
    got = np.array(run(q, k, v, **kw, **extra).astype(mx.float32))
    want = np.array(reference_attention(q, k, v, **kw).astype(mx.float32))
    assert np.isfinite(got).all()
    err = np.abs(got - want).max()
    assert err <= TOLERANCE[q.dtype], f"max error {err} ({q.dtype})"
    return got


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [64, 80, 96, 128, 256])
def test_head_dims_and_dtypes(run, dtype, d):
    for i, (tq, tkv, mask) in enumerate([(37, 50, None), (33, 70, "causal"), (1, 19, None)]):
        check(run, *make(1, 2, 1, tq, tkv, d, dtype, seed=i), mask=mask)


@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 2), (8, 2), (4, 1)])
def test_gqa_and_mqa(run, hq, hkv):
    check(run, *make(2, hq, hkv, 40, 45, 64, mx.float32), mask="causal")


@pytest.mark.parametrize("shape", [(40, 70), (1, 70), (2, 1, 1, 70), (1, 2, 40, 70)], ids=str)
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_array_masks_through_strides(run, shape, kind):
    q, k, v = make(2, 2, 1, 40, 70, 64, mx.float16)
    rng = np.random.default_rng(3)
    mask = mx.array(rng.random(shape) > 0.3) if kind == "bool" else mx.array(rng.standard_normal(shape).astype(np.float32)).astype(mx.float16)
    check(run, q, k, v, mask=mask)


def test_sinks_windows_and_fully_masked_rows(run):
    q, k, v = make(1, 4, 2, 35, 60, 64, mx.float32)
    sinks = mx.array([0.5, -1.0, 3.0, 0.0])
    check(run, q, k, v, mask="causal", sinks=sinks)
    for window in (1, 7, 40):
        check(run, q, k, v, window_size=window)
    visible = np.random.default_rng(0).random((35, 60)) > 0.5
    visible[[0, 9, 34]] = False
    got = check(run, q, k, v, mask=mx.array(visible), sinks=sinks)
    assert np.all(got[:, :, [0, 9, 34]] == 0)
    additive = np.zeros((35, 60), np.float32)
    additive[5] = -np.inf
    got = check(run, q, k, v, mask=mx.array(additive))
    assert np.all(got[:, :, 5] == 0)
    # more queries than keys under a causal mask: the first rows see nothing
    q, k, v = make(1, 2, 2, 40, 8, 64, mx.float32)
    got = check(run, q, k, v, mask="causal")
    assert np.all(got[:, :, :32] == 0)


def test_large_logits(run):
    q, k, v = make(1, 2, 1, 20, 40, 64, mx.float16)
    check(run, q * 40, k, v, scale=1.0, mask="causal")


def test_logits_that_grow_block_by_block(run):
    """The prefill kernels' lazy max (prefill_online_softmax): keys whose
    logits grow along the sequence move the row max by more than the lazy
    threshold in some blocks and by less in others; the output and the row
    log-sum-exp must be the eager softmax's (float64 oracle, the reference)."""
    q, k, v = make(1, 2, 1, 40, 300, 64, mx.float32, seed=5)
    growth = mx.array(np.linspace(0.05, 6.0, 300, dtype=np.float32))[:, None]
    k = k * growth  # logit spread grows ~120x from the first key block to the last
    for kw in (dict(mask=None), dict(mask="causal"), dict(window_size=70)):
        check(run, q, k, v, **kw)
        _, lse = run(q, k, v, scale=0.125, return_lse=True, **kw)
        want = reference_lse(q, k, v, scale=0.125, **kw)
        assert np.all(np.abs(np.array(lse) - want) <= 1e-4 * np.maximum(1.0, np.abs(want)))


def sinks_views(hq, dtype):
    """Sinks as MLX may hand them to the kernel: a strided slice, a slice at an
    offset, and one value broadcast to every head (stride 0)."""
    base = mx.array(np.linspace(-2.0, 3.0, 3 * hq + 1).astype(np.float32)).astype(dtype)
    return {
        "every-other": View(base, lambda a: a[: 2 * hq : 2]),
        "offset-stride-3": View(base, lambda a: a[1::3][:hq], offset=1),
        "broadcast": View(base, lambda a: mx.broadcast_to(a[2:3], (hq,)), offset=2),
    }


@pytest.mark.parametrize("kind", ["every-other", "offset-stride-3", "broadcast"])
@pytest.mark.parametrize("tq", [35, 2], ids=["prefill", "decode"])
def test_strided_and_broadcast_sinks(run, kind, tq):
    """sinks[h] is read through the sinks stride (as the CPU kernel does), not
    assumed contiguous: the view is bound as MLX hands it over."""
    q, k, v = make(1, 4, 2, tq, 60, 64, mx.float32, seed=tq)
    view = sinks_views(4, mx.float32)[kind]
    got = np.array(run(q, k, v, scale=0.125, mask="causal", sinks=view))
    want = np.array(reference_attention(q, k, v, scale=0.125, mask="causal", sinks=view.array))
    assert np.abs(got - want).max() <= TOLERANCE[mx.float32]


FLT_MAX = float(np.finfo(np.float32).max)


@pytest.mark.parametrize("tq", [37, 2], ids=["prefill", "decode"])
def test_every_finite_scale(run, tq):
    """Scales from 0 and denormals up to FLT_MAX: the kernels saturate logits
    like the reference path (no overflowing exponent, no NaN)."""
    q, k, v = make(1, 4, 2, tq, 50, 64, mx.float32, seed=tq)
    additive = mx.array(np.random.default_rng(1).standard_normal((tq, 50)).astype(np.float32) * 3e37)
    sinks = mx.array([1e38, 0.5, -1e38, -2.0])
    for scale in (0.0, 1e-45, -0.3, 1e30, 3e38, FLT_MAX, -FLT_MAX):
        check(run, q, k, v, scale=scale, mask="causal", sinks=sinks)
        check(run, q, k, v, scale=scale, mask=additive)


@pytest.mark.parametrize("layout", ["seq_major", "cache"])
@pytest.mark.parametrize("tq", [37, 3], ids=["prefill", "decode"])
def test_strided_inputs(run, layout, tq):
    """q/k/v read through their batch/head/sequence strides: a [B, T, H, D]
    projection layout, or the first Tkv rows of a longer KV cache."""
    check(run, *make(2, 4, 2, tq, 50, 64, mx.float16, seed=tq), mask="causal", layout=layout)
    check(run, *make(1, 2, 2, tq, 45, 96, mx.bfloat16, seed=tq), layout=layout)


@pytest.mark.parametrize("tq", [1, 3, 8])
@pytest.mark.parametrize("hq,hkv,tkv", [(4, 4, 600), (8, 2, 600), (9, 3, 600), (4, 1, 600), (8, 2, 3000)])
def test_decode_split_kv(run, tq, hq, hkv, tkv):
    """Each case as the plan's rule (kernel_lab/decode_rule.py) shapes it: the
    row shape (one row a threadgroup, 32 simdgroups) or the group shape (16
    rows, 4 simdgroups), in one split or several and the merge."""
    q, k, v = make(2, hq, hkv, tq, tkv, 64, mx.float32, seed=tq)
    got = check(run, q, k, v, mask="causal", sinks=mx.linspace(-1, 1, hq))
    if not REAL_METAL:
        rule = decode_rule.decode_plan(2, hkv, hq // hkv * tq, tkv, 64)  # the default target: 8 cores
        # both shapes are covered: the row shape in one split (no merge) with
        # one query of 4 KV heads over 600 keys, the group shape over several
        # splits at 3000 keys
        if (hq, hkv, tkv, tq) == (4, 4, 600, 1):
            assert (rule["shape"], rule["splits"]) == ("row", 1)
        if tkv == 3000:
            assert rule["shape"] == "group" and rule["splits"] > 1
        kernels = [step.kernel for step in run.last_plan.dispatches]
        merge = ["attention_decode_merge_float32_d64"] if rule["splits"] > 1 else []
        assert kernels == [f"attention_decode_partial_float32_d64{rule['fields']}", *merge]
        assert run.last_plan.splits == rule["splits"]
        partial = run.last_plan.dispatches[0]
        assert partial.threadgroup == [32 * rule["simdgroups"], 1, 1]
        rows = hq // hkv * tq
        assert partial.grid == [rule["splits"], hkv * -(-rows // rule["rows"]), 2]
    assert np.isfinite(got).all()


MASKED_LOGIT = -1.701411834604692317e38  # MLX_ATTN_MASKED_LOGIT: a split that saw nothing


def merged_rows(partial_out, partial_stats, sinks):
    """The float64 merge of split partials [B, Hkv, splits, rows, D] (max, sum
    in partial_stats) into rows [B, Hkv, rows, D] and their log-sum-exp, sinks
    [Hkv, rows] (or None) joining each row's sum."""
    m, l = partial_stats[..., 0].astype(np.float64), partial_stats[..., 1].astype(np.float64)
    top = m.max(axis=2)
    if sinks is not None:
        top = np.maximum(top, sinks)
    weight = np.exp(m - top[:, :, None])
    total = (l * weight).sum(axis=2) + (np.exp(sinks - top) if sinks is not None else 0.0)
    out = (partial_out * weight[..., None]).sum(axis=2)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(total[..., None] > 0, out / total[..., None], 0.0), np.where(total > 0, top + np.log(total), -np.inf)


@pytest.mark.skipif(REAL_METAL, reason="dispatches the emulated merge kernel on partials made up here")
@pytest.mark.parametrize("splits", [2, 13, 300] if not FULL_GRID else [2, 7, 8, 13, 64, 255, 300])
@pytest.mark.parametrize("with_sinks", [True, False], ids=["sinks", "no-sinks"])
def test_decode_merge_of_any_split_count(run, splits, with_sinks):
    """attention_decode_merge alone, on float32 partials made up here, against
    a float64 NumPy merge: split counts that are not a multiple of the
    merge's simdgroups (MLX_ATTN_DECODE_MERGE_SIMDGROUPS = 8), fewer than
    them (some simdgroups merge nothing), and more than 8 x 32 (a
    simdgroup's lanes read its splits' max and sum in two rounds); splits
    that saw nothing, a row none of whose splits saw anything (zeros, lse
    -inf or the sink), sinks and the row log-sum-exp. Launched with the
    plan's grid and threadgroup, so these must match the kernel's."""
    b, hq, hkv, d = 2, 6, 2, 64
    rows = hq // hkv
    q, k, _ = make(b, hq, hkv, 1, 4096, d, mx.float32)  # the group shape over 16 splits: a merge
    sinks = mx.array(np.linspace(-2.0, 6.0, hq).astype(np.float32)) if with_sinks else None
    plan = launch_plan(q, k, k, scale=1.0, sinks=sinks, output_lse=True)
    merge = plan.dispatches[-1]
    assert merge.kernel == "attention_decode_merge_float32_d64" and merge.threadgroup == [256, 1, 1]
    rng = np.random.default_rng(splits)
    shape = (b, hkv, splits, rows)
    stats = np.stack([rng.standard_normal(shape) * 3, rng.uniform(0.5, 3.0, shape)], axis=-1).astype(np.float32)
    partial_out = rng.standard_normal(shape + (d,)).astype(np.float32)
    empty = rng.random(shape) < 0.3
    empty[0, 1, :, 2] = True  # a row that saw nothing in any split
    stats[empty] = (MASKED_LOGIT, 0.0)
    partial_out[empty] = 0.0
    out = np.full((b, hq, 1, d), np.nan, np.float32)
    lse = np.full((b, hq, 1), np.nan, np.float32)
    sinks_buffer = np.array(sinks) if with_sinks else np.zeros(1, np.float32)
    buffers = {"partial_out": partial_out, "partial_stats": stats, "sinks": sinks_buffer, "out": out,
               "params": plan.params, "splits": struct.pack("i", splits), "lse": lse}
    run.library.dispatch(merge.kernel, merge.grid, merge.threadgroup,
                         {binding.index: buffers[binding.role] for binding in merge.bindings})
    want, want_lse = merged_rows(partial_out, stats, np.array(sinks).reshape(hkv, rows) if with_sinks else None)
    np.testing.assert_allclose(out.reshape(b, hkv, rows, d), want, rtol=1e-5, atol=1e-6)
    got_lse = lse.reshape(b, hkv, rows)
    assert np.array_equal(np.isneginf(got_lse), np.isneginf(want_lse))
    assert np.isneginf(want_lse).any() == (not with_sinks)  # the empty row: -inf without a sink
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(got_lse[finite], want_lse[finite], rtol=1e-5, atol=1e-5)
    assert np.all(out.reshape(b, hkv, rows, d)[0, 1, 2] == 0)


@pytest.mark.parametrize("hq,tq,tkv", [(8, 2, 4096), (32, 1, 4096), (8, 2, 300)],
                         ids=["group-four-row-chunks", "group-eight-row-chunks", "row-shape"])
def test_decode_row_chunks_at_d256(run, hq, tq, tkv):
    """At D = 256 a group-shape threadgroup holds 4 rows in registers: a
    larger GQA group is served by several row chunks of the same KV head; a
    row-shape threadgroup (16 simdgroups at D = 256) serves one row."""
    q, k, v = make(1, hq, 1, tq, tkv, 256, mx.float16, seed=hq)
    check(run, q, k, v, mask="causal", sinks=mx.linspace(-1, 1, hq).astype(mx.float16))
    if not REAL_METAL:
        rule = decode_rule.decode_plan(1, 1, hq * tq, tkv, 256)
        assert (rule["shape"], rule["rows"]) == (("group", 4) if tkv == 4096 else ("row", 1))
        partial = run.last_plan.dispatches[0]
        assert partial.grid[1] == -(-hq * tq // rule["rows"])
        assert partial.threadgroup == [32 * rule["simdgroups"], 1, 1]


@pytest.mark.parametrize("tq", [37, 1, 3], ids=["prefill", "decode-1", "decode-3"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_row_logsumexp(run, dtype, tq):
    """The float32 [B, Hq, Tq] log-sum-exp output of both kernels (sinks and
    masks included, -inf for a row that sees nothing), next to an unchanged output."""
    q, k, v = make(2, 4, 2, tq, 140, 64, dtype, seed=tq)
    visible = np.random.default_rng(tq).random((tq, 140)) > 0.3
    visible[0] = False
    sinks = mx.array([0.5, -1.0, 3.0, 0.0]).astype(dtype)
    for kw in (dict(mask="causal"), dict(mask=mx.array(visible)), dict(mask="causal", sinks=sinks),
               dict(window_size=9)):
        out, lse = run(q, k, v, scale=0.125, return_lse=True, **kw)
        want = reference_lse(q, k, v, scale=0.125, **kw)
        got = np.array(lse)
        assert lse.dtype == mx.float32 and got.shape == (2, 4, tq)
        assert np.array_equal(np.isneginf(got), np.isneginf(want)), "rows that see nothing: -inf"
        finite = np.isfinite(want)
        assert np.isfinite(got[finite]).all()
        assert np.all(np.abs(got[finite] - want[finite]) <= 1e-4 * np.maximum(1.0, np.abs(want[finite])))
        plain = run(q, k, v, scale=0.125, **kw)
        assert np.array_equal(np.array(out.astype(mx.float32)), np.array(plain.astype(mx.float32)))
    if not REAL_METAL:
        lse_bindings = [b for step in run.last_plan.dispatches for b in step.bindings if b.role == "lse"]
        assert lse_bindings[-1].source == "input"  # without return_lse: the placeholder


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [96, 128, 256])
def test_decode_head_dims_masks_and_windows(run, dtype, d):
    q, k, v = make(1, 4, 2, 2, 90, d, dtype)
    rng = np.random.default_rng(d)
    visible = rng.random((1, 4, 2, 90)) > 0.3
    visible[0, 1, 0] = False  # a fully masked row
    got = check(run, q, k, v, mask=mx.array(visible))
    assert np.all(got[0, 1, 0] == 0)
    check(run, q, k, v, window_size=20)
    additive = rng.standard_normal((2, 90)).astype(np.float32)
    additive[1] = -np.inf  # the second query position sees nothing
    got = check(run, q, k, v, mask=mx.array(additive).astype(dtype))
    assert np.all(got[:, :, 1] == 0)


HEAD_DIMS = [64, 80, 96, 128, 256]
SCALAR_LAYOUTS = ["unaligned", "odd_rows", "every_other"]  # kernel_lab/metal_runner.py physical_layout
# Each dtype x head dim with one of the scalar-load layouts (in turn) by
# default, with all three under MLX_ATTN_FULL_GRID=1.
LOAD_GRID = [(dtype, d, layout)
             for i, (dtype, d) in enumerate(itertools.product(DTYPES, HEAD_DIMS))
             for layout in (SCALAR_LAYOUTS if FULL_GRID else [SCALAR_LAYOUTS[i % len(SCALAR_LAYOUTS)]])]


@pytest.mark.parametrize("dtype,d,layout", LOAD_GRID, ids=lambda x: str(x).replace("mlx.core.", ""))
def test_vector_and_scalar_loads(run, dtype, d, layout):
    """Inputs whose rows all start on a 4-element boundary ([B, T, H, D]
    storage here) are read with vector loads, others (a start 2 elements into
    an aligned row, odd rows, a strided last dim) element by element: both
    compute the reference, prefill and decode."""
    for tq in (33, 2):
        q, k, v = make(1, 4, 2, tq, 45, d, dtype, seed=d + tq)
        for chosen, vector in (("seq_major", True), (layout, False)):
            check(run, q, k, v, mask="causal", layout=chosen)
            if not REAL_METAL:
                assert run.last_plan.vector_loads == vector, chosen


def trimmed(source, instances: list[str]) -> str:
    """A kernel source with only `instances` instantiated (quick counting builds)."""
    text = re.sub(r"^MLX_ATTN_(PREFILL|DECODE)_(2BYTE_)?TYPES\(.*\)$", "", source.read_text(), flags=re.M)
    return text + "\n" + "\n".join(instances) + "\n"


@pytest.mark.skipif(REAL_METAL, reason="counts the emulated kernels' device loads")
@pytest.mark.parametrize("dtype,d,key_block,vector_bytes", [
    (mx.float16, 128, 16, {"prefill": 8, "decode": 8}),   # half4; decode lanes read 4 elements
    (mx.float32, 64, 32, {"prefill": 16, "decode": 8}),   # float4; decode lanes read 2 elements (float2)
], ids=["float16-d128", "float32-d64"])
def test_vector_loads_are_aligned_and_fewer(tmp_path, dtype, d, key_block, vector_bytes):
    """In the counting build (which fails any misaligned device access):
    aligned inputs are read with vector loads, about one load per vector
    (Q by pairs in prefill), misaligned ones one element per load."""
    tname, type_ = {mx.float16: ("float16", "half"), mx.float32: ("float32", "float")}[dtype]
    sources = []
    for kind, instance in (("prefill", f"MLX_ATTN_PREFILL({tname}, {type_}, {d}, {key_block})"),
                           ("decode", decode_instantiation(f"{tname}, {type_}", d))):
        path = tmp_path / f"attention_{kind}.metal"
        path.write_text(trimmed(REPO / "metal" / f"attention_{kind}.metal", [instance]))
        sources.append(path)
    metal = EmulatedMetal(fast_math=True, sources=sources, counters=True)
    element = dtype.size
    for kind, tq in (("prefill", 40), ("decode", 1)):
        q, k, v = make(1, 4, 1 if tq == 1 else 4, tq, 96, d, dtype, seed=tq)
        for layout, bytes_per_load in ((None, vector_bytes[kind]), ("unaligned", element)):
            check(metal, q, k, v, mask="causal", layout=layout, gpu_target={"gpu_family": "apple8"})
            attention = metal.last_counters[0]  # prefill, or the decode partial (the merge reads float partials)
            per_load = attention.device_bytes_read / attention.device_load_operations
            if bytes_per_load == element:
                assert per_load == element, (tq, layout)
            else:  # vectors, and Q (prefill) in pairs
                assert 0.7 * bytes_per_load <= per_load <= bytes_per_load, (tq, layout, per_load)


FAMILIES = ["unknown", "apple7", "apple8", "apple9"]


@pytest.mark.parametrize("family,cores", [("unknown", 0), ("apple7", 8), ("apple8", 10), ("apple9", 40)])
def test_each_gpu_family_plan_runs_correctly(run, family, cores):
    """Each row of the plan's family table gives kernels that compute the
    reference: prefill and decode in float16, one with a mask."""
    target = dict(gpu_family=family, gpu_cores=cores)
    q, k, v = make(1, 4, 2, 40, 70, 128, mx.float16, seed=1)
    check(run, q, k, v, mask="causal", gpu_target=None if REAL_METAL else target)
    q, k, v = make(1, 4, 1, 1, 700, 128, mx.float16, seed=2)
    visible = np.random.default_rng(2).random((1, 700)) > 0.3
    check(run, q, k, v, mask=mx.array(visible), gpu_target=None if REAL_METAL else target)
    if not REAL_METAL:
        assert (run.last_plan.gpu_family, run.last_plan.gpu_cores) == (family, cores or 8)
        # the shape and splits of the rule for this target (kernel_lab/decode_rule.py)
        assert run.last_plan.splits == decode_rule.decode_plan(1, 1, 4, 700, 128, cores or 8)["splits"]
    q, k, v = make(1, 2, 2, 35, 50, 256, mx.float16, seed=3)
    check(run, q, k, v, window_size=9, gpu_target=None if REAL_METAL else target)


@pytest.mark.skipif(REAL_METAL, reason="the GPU target is MLX's device on a Mac; the emulator picks any family")
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=str)
@pytest.mark.parametrize("d", [80, 96, 128, 256])
def test_apple9_key_blocks(run, dtype, d):
    """apple9 plans 2-byte dtypes with twice MLX's BK at D >= 80: those
    kernels against the reference, with a partial last key block."""
    q, k, v = make(1, 2, 1, 33, 45, d, dtype, seed=d)
    check(run, q, k, v, mask="causal", gpu_target={"gpu_family": "apple9"})
    assert run.last_plan.dispatches[0].kernel.endswith("_bk32" if d < 256 else "_bk16")


@pytest.mark.skipif(REAL_METAL, reason="lists the emulated library's kernels")
def test_every_planned_kernel_is_compiled(run):
    """Whatever the family table picks names a kernel the .metal sources
    instantiate (for every family, dtype and head dim, prefill and decode)."""
    names = set()
    for family in FAMILIES:
        for dtype in DTYPES:
            for d in (64, 80, 96, 128, 256, 512):
                for tq in (40, 1):
                    q, k, v = make(1, 4, 2, tq, 50, d, dtype)
                    for mask in (None, mx.ones((tq, 50), dtype=mx.bool_), mx.zeros((tq, 50), dtype=dtype)):
                        plan = launch_plan(q, k, v, mask=mask, gpu_family=family)
                        assert plan.supported, plan.reason
                        names.update(step.kernel for step in plan.dispatches)
    assert len(names) > 90  # every mask kind has its own kernel
    assert names <= set(run.library.kernel_names), sorted(names - set(run.library.kernel_names))


def documented_kernel_families() -> dict:
    """docs/metal_kernels.md's "Kernel families" table: family ->
    (instantiation file, kernel header, host name prefixes)."""
    text = (REPO / "docs" / "metal_kernels.md").read_text()
    section = text.split("## Kernel families", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[1].startswith("`metal/"):
            rows[cells[0]] = (cells[1].strip("`"), cells[2].strip("`"), set(re.findall(r"`([a-z_]+)`", cells[3])))
    return rows


@pytest.mark.skipif(not msl_emulator.clang_available(), reason="clang-19 is not installed")
def test_kernel_family_table_matches_the_sources():
    """Every .metal file is a documented family that includes its kernel
    header, and the host names it instantiates start with exactly the
    documented prefixes (the dtype and what follows it stripped)."""
    rows = documented_kernel_families()
    assert sorted(source for source, _, _ in rows.values()) == sorted(
        f"metal/{p.name}" for p in (REPO / "metal").glob("*.metal"))
    for family, (source, header, prefixes) in rows.items():
        assert f'#include "{header}"' in (REPO / source).read_text(), family
        library = msl_emulator.compile_library(REPO / source, include_dirs=[REPO], fast_math=True)
        compiled = {re.split(r"_(?:float32|float16|bfloat16)(?=_|$)", name)[0] for name in library.kernel_names}
        assert compiled == prefixes, family
