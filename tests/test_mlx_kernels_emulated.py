"""The MSL emulator validated on kernels known to be correct on Apple GPUs:
MLX's own attention kernels (steel_attention for prefill, sdpa_vector one-
and two-pass for decode, from the mlx-metal 0.32.4 wheel), launched as MLX's
host code launches them (mlx_kernel_runner.py), must agree with
mlx_attn.reference_attention. A mismatch is an emulator bug, unless it is a
documented MLX semantic (docs/msl_emulator.md): the grid avoids fully masked
rows, where MLX's prefill kernel averages the values instead of returning
zeros.

The default grid compiles every instantiation and runs a covering subset of
the cases; MLX_ATTN_FULL_EMULATOR_GRID=1 runs them all.
"""

from __future__ import annotations

import itertools
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlx_attn
from kernel_lab import mlx_kernel_runner as mlx_kernels, msl_emulator as me

FULL_GRID = os.environ.get("MLX_ATTN_FULL_EMULATOR_GRID") == "1"

if not me.clang_available():
    if os.environ.get("CI"):
        pytest.fail("clang-19 is required on CI to run MLX's kernels in the MSL emulator", pytrace=False)
    pytest.skip("clang-19 is not installed (apt-get install clang-19)", allow_module_level=True)

DTYPES = {"float16": np.float16, "bfloat16": np.uint16, "float32": np.float32}  # bfloat16 as its bits
MX_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
TOLERANCE = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1.6e-2}  # absolute, outputs are O(1)
MASKS = ("none", "causal", "bool", "additive")


@dataclass(frozen=True)
class Case:
    kind: str          # "prefill" or "decode"
    dtype: str
    head_dim: int
    mask: str          # one of MASKS
    gqa: int           # query heads per KV head
    q_len: int
    kv_len: int
    two_pass: bool = False

    @property
    def id(self) -> str:
        passes = "-2pass" if self.two_pass else ""
        return f"{self.kind}-{self.dtype}-d{self.head_dim}-{self.mask}-gqa{self.gqa}-q{self.q_len}-kv{self.kv_len}{passes}"


def full_grid() -> list[Case]:
    cases = []
    for dtype, head_dim, mask, gqa, (q_len, kv_len) in itertools.product(
            DTYPES, (64, 80, 128), MASKS, (1, 2), ((40, 70), (64, 64))):
        cases.append(Case("prefill", dtype, head_dim, mask, gqa, q_len, kv_len))
    for dtype, head_dim, mask, gqa, q_len, two_pass in itertools.product(
            DTYPES, (64, 128), MASKS, (1, 4), (1, 3), (False, True)):
        if mask == "causal" and q_len == 1:
            continue  # MLX drops causal for one query (it sees every key)
        cases.append(Case("decode", dtype, head_dim, mask, gqa, q_len, 300, two_pass))
    return cases


def default_grid(cases: list[Case]) -> list[Case]:
    """One case per (kind, dtype, head dim, mask): every instantiation with
    every mask kind; GQA, lengths and the decode pass count rotate."""
    by_key: dict[tuple, list[Case]] = {}
    for case in cases:
        by_key.setdefault((case.kind, case.dtype, case.head_dim, case.mask), []).append(case)
    return [options[(5 * i) % len(options)] for i, options in enumerate(by_key.values())]


ALL_CASES = full_grid()
CASES = ALL_CASES if FULL_GRID else default_grid(ALL_CASES)


def test_the_grid_covers_every_instantiation_and_mask(capsys):
    libraries = {(c.kind, c.dtype, c.head_dim) for c in ALL_CASES}
    assert {(c.kind, c.dtype, c.head_dim) for c in CASES} == libraries
    for kind in ("prefill", "decode"):
        assert {c.mask for c in CASES if c.kind == kind} == set(MASKS)
        assert {c.gqa > 1 for c in CASES if c.kind == kind} == {False, True}
    assert {c.two_pass for c in CASES if c.kind == "decode"} == {False, True}
    with capsys.disabled():
        print(f"\nMLX kernels in the emulator: {len(CASES)} of the full grid's {len(ALL_CASES)} cases"
              + ("" if FULL_GRID else " (MLX_ATTN_FULL_EMULATOR_GRID=1 runs all)"))


_LIBRARIES: dict[tuple[str, str, int], me.MetalLibrary] = {}


def library(case: Case) -> me.MetalLibrary:
    key = (case.kind, case.dtype, case.head_dim)
    if key not in _LIBRARIES:
        _LIBRARIES[key] = mlx_kernels.compile_mlx_library(case.kind, DTYPES[case.dtype], case.head_dim)
    return _LIBRARIES[key]


def random_inputs(case: Case, seed: int):
    rng = np.random.default_rng(seed)
    heads, kv_heads = 2 * case.gqa, 2
    shapes = {"q": (1, heads, case.q_len, case.head_dim), "k": (1, kv_heads, case.kv_len, case.head_dim),
              "v": (1, kv_heads, case.kv_len, case.head_dim)}
    arrays = {name: mx.array(rng.standard_normal(shape).astype(np.float32)).astype(MX_DTYPES[case.dtype])
              for name, shape in shapes.items()}
    mask = None
    if case.mask == "bool":
        visible = rng.random((1, heads, case.q_len, case.kv_len)) < 0.6
        visible[..., 0] = True  # no fully masked row (see the module docstring)
        mask = mx.array(visible)
    elif case.mask == "additive":
        bias = rng.standard_normal((1, 1, case.q_len, case.kv_len)).astype(np.float32)
        bias[rng.random(bias.shape) < 0.2] = -np.inf
        bias[..., 0] = 0.0
        mask = mx.array(bias).astype(MX_DTYPES[case.dtype])
    return arrays["q"], arrays["k"], arrays["v"], mask


def to_numpy(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint16)) if a.dtype == mx.bfloat16 else np.array(a)


def as_float(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (x.astype(np.uint32) << 16).view(np.float32)
    return x.astype(np.float32)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_mlx_kernel_matches_the_reference(case: Case):
    q, k, v, mask = random_inputs(case, seed=len(case.id))
    scale = case.head_dim ** -0.5
    reference_mask = "causal" if case.mask == "causal" else mask
    expected = np.array(mlx_attn.reference_attention(q, k, v, scale=scale, mask=reference_mask).astype(mx.float32))
    arguments = dict(scale=scale, causal=case.mask == "causal",
                     mask=None if mask is None else to_numpy(mask))
    inputs = [np.ascontiguousarray(to_numpy(x)) for x in (q, k, v)]
    if case.kind == "prefill":
        out, launch = mlx_kernels.prefill(library(case), *inputs, **arguments)
    else:
        out, launch = mlx_kernels.decode(library(case), *inputs, two_pass=case.two_pass, **arguments)
    assert len(launch.kernels) == (2 if case.two_pass else 1)
    got = as_float(np.ascontiguousarray(out), case.dtype)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, expected, atol=TOLERANCE[case.dtype], rtol=0)


def test_two_pass_decode_is_what_mlx_picks_for_long_gqa_caches():
    q = np.zeros((1, 8, 1, 64), np.float16)
    assert mlx_kernels.uses_two_pass(q, np.zeros((1, 2, 4096, 64), np.float16))
    assert not mlx_kernels.uses_two_pass(q, np.zeros((1, 2, 4095, 64), np.float16))
    assert not mlx_kernels.uses_two_pass(q, np.zeros((1, 8, 8192, 64), np.float16))  # no GQA


def test_function_constants_must_be_set_and_declared():
    lib = library(Case("decode", "float32", 64, "none", 1, 1, 40))
    name = mlx_kernels.decode_kernel_names(np.float32, 64)["one_pass"]
    q, out = np.zeros((1, 1, 1, 64), np.float32), np.zeros((1, 1, 1, 64), np.float32)
    kv = np.zeros((1, 1, 40, 64), np.float32)
    buffers = {0: q, 1: kv, 2: kv, 3: out, 4: struct.pack("<i", 1), 5: struct.pack("<i", 40),
               6: struct.pack("<Q", 40 * 64), 7: struct.pack("<Q", 64), 8: struct.pack("<Q", 40 * 64),
               9: struct.pack("<Q", 64), 10: struct.pack("<f", 1.0)}
    everything_but_causal = {"has_mask": False, "query_transposed": False, "bool_mask": False,
                             "float_mask": False, "has_sinks": False}
    with pytest.raises(me.EmulatorError, match=r"function constant do_causal \[\[function_constant\(22\)\]\] is read"):
        lib.dispatch(name, (1, 1, 1), (1024, 1, 1), buffers, function_constants=everything_but_causal)
    with pytest.raises(me.EmulatorError, match="no function constant nonsense"):
        lib.dispatch(name, (1, 1, 1), (1024, 1, 1), buffers, function_constants={"nonsense": 1})
    # A parameter under a false constant needs no buffer; under a true one it does.
    lib.dispatch(name, (1, 1, 1), (1024, 1, 1), buffers, function_constants=everything_but_causal | {"do_causal": False})
    with pytest.raises(me.EmulatorError, match=r"\[\[buffer\(11\)\]\] has no buffer bound"):
        lib.dispatch(name, (1, 1, 1), (1024, 1, 1), buffers,
                     function_constants=everything_but_causal | {"do_causal": False, "has_mask": True, "bool_mask": True})


def test_bench_metal_emulate_smoke_run(tmp_path):
    """`bench_metal.py --emulate` on one tiny problem per phase: both kernel
    sets run, agree with the reference, and the cost table is written."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_metal.py"
    spec = importlib.util.spec_from_file_location("bench_metal", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from kernel_lab.cost_report import MODEL_BEGIN
    from kernel_lab.emulated_costs import visible_pairs

    doc = tmp_path / "costs.md"
    rows = bench.main(["--emulate", "--lengths", "64", "--decode-lengths", "128", "--head-dims", "64",
                       "--decode-head-dims", "64", "--decode-groups", "4",
                       "--out", str(tmp_path), "--costs-doc", str(doc)])
    assert [(r["phase"], r["causal"]) for r in rows] == [("prefill", False), ("prefill", True), ("decode", False)]
    for row in rows:
        for impl in ("ours", "mlx"):
            assert row[impl]["max_abs_error"] < 2e-3
            assert row[impl]["counters"]["device_bytes"] > 0
            assert row[impl]["modelled"]["seconds"] >= row[impl]["modelled"]["device_seconds"] > 0
    # Both read all of K and V at least once; MLX's one-pass decode reads them once per query head.
    decode = rows[2]
    assert decode["ours"]["per_work"]["device_bytes"] >= 1.0
    assert decode["mlx"]["per_work"]["device_bytes"] >= decode["heads"] // decode["kv_heads"]
    assert rows[0]["mlx"]["counters"]["simdgroup_matrix_mmas"] > 0 and rows[0]["ours"]["counters"]["simdgroup_matrix_mmas"] > 0
    text = doc.read_text()
    assert "modelled costs" in text and "not GPU timings" in text
    counters, model = text.split(MODEL_BEGIN)
    # cost table, the cost model's count check and kernel table
    assert counters.count("| prefill |") == 6 and counters.count("| decode |") == 3
    # the cost model describes the kernels the emulator ran: its MMAs and bytes are the counted ones
    for impl in ("ours", "mlx"):
        assert rows[0]["model_check"][impl]["mmas"] == pytest.approx(1.0, rel=0.02)
        assert rows[0]["model_check"][impl]["device_bytes"] == pytest.approx(1.0, rel=0.05)
        # steel reads one Q fragment per D step, not one per key tile (its count was once 4/3 of this)
        assert rows[0]["model_check"][impl]["threadgroup_bytes"] == pytest.approx(1.0, rel=0.05)
        # steel shuffles per 8x8 fragment, ours once per row (the model once charged steel a quarter of this)
        assert rows[0]["model_check"][impl]["simd_ops"] == pytest.approx(1.0, rel=0.1)
    assert rows[2]["model_check"]["ours"]["device_bytes"] == pytest.approx(1.0, rel=0.1)
    assert "| registers |" in model and "predicted µs" in model and "Validation against MLX's own tuning" in model
    assert json.loads((tmp_path / "bench_metal_emulated.json").read_text()) == json.loads(json.dumps(rows))
    assert visible_pairs(4, 6, causal=True) == 3 + 4 + 5 + 6
    assert visible_pairs(4, 6, causal=False) == 24


def test_fully_masked_rows_follow_mlx_semantics_not_the_reference():
    """MLX's documented behaviour (docs/msl_emulator.md), which the grid
    avoids: steel attention gives a fully masked row the plain average of the
    values (every score is the same finite minimum); sdpa_vector skips every
    key and writes zeros, as reference_attention does."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in ((1, 1, 32, 64), (1, 1, 64, 64), (1, 1, 64, 64)))
    mask = np.ones((1, 1, 32, 64), bool)
    mask[0, 0, 5] = False
    out, _ = mlx_kernels.prefill(library(Case("prefill", "float32", 64, "bool", 1, 32, 64)), q, k, v, scale=0.125, mask=mask)
    np.testing.assert_allclose(out[0, 0, 5], v[0, 0].mean(axis=0), atol=1e-6)
    decode_library = library(Case("decode", "float32", 64, "bool", 1, 1, 64))
    for two_pass in (False, True):
        out, _ = mlx_kernels.decode(decode_library, q[:, :, :1], k, v, scale=0.125,
                                    mask=np.zeros((1, 1, 1, 64), bool), two_pass=two_pass)
        np.testing.assert_array_equal(out, 0.0)
