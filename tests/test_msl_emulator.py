"""The MSL emulator itself (kernel_lab/msl_emulator/): Metal kernels type-checked by
clang-19 and run on the CPU must compute what NumPy computes, in precise and
in fast-math builds, and programming errors (missing or divergent barriers,
uninitialised threadgroup memory, address-space mistakes, out-of-bounds
accesses, endless loops) must be reported, not silently pass."""

from __future__ import annotations

import os
import struct
import time
from pathlib import Path

import numpy as np
import pytest

from kernel_lab import msl_emulator as me
from kernel_lab.msl_emulator.translate import translate

KERNELS = Path(me.__file__).parent / "test_kernels"  # the emulator's own test kernels
KERNEL_INCLUDES = [KERNELS / "include"]
SOFTMAX, SIMD, MATRIX, TYPES, FAULTS, COUNTERS = (
    KERNELS / f"{n}.metal" for n in ("softmax", "simd", "matrix", "types", "faults", "counters"))
REDUCE = KERNELS / "reduce.metal"

if not me.clang_available() and os.environ.get("CI"):
    pytest.fail("clang-19 is required on CI to run the MSL emulator", pytrace=False)
needs_clang = pytest.mark.skipif(not me.clang_available(), reason="clang-19 is not installed (apt-get install clang-19)")


def build(source: Path, fast_math: bool = False, **kw) -> me.MetalLibrary:
    return me.compile_library([source], include_dirs=KERNEL_INCLUDES, fast_math=fast_math, **kw)


@pytest.fixture(scope="module", params=[False, True], ids=["precise", "fast-math"])
def fast_math(request) -> bool:
    return request.param


@pytest.fixture(scope="module")
def softmax_lib(fast_math):
    return build(SOFTMAX, fast_math)


@pytest.fixture(scope="module")
def reduce_lib(fast_math):
    return build(REDUCE, fast_math)


@pytest.fixture(scope="module")
def simd_lib(fast_math):
    return build(SIMD, fast_math)


@pytest.fixture(scope="module")
def matrix_lib(fast_math):
    return build(MATRIX, fast_math)


@pytest.fixture(scope="module")
def types_lib(fast_math):
    return build(TYPES, fast_math)


@pytest.fixture(scope="module")
def faults_lib():
    return build(FAULTS)


def mutant(tmp_path: Path, source: Path, old: str, new: str) -> Path:
    """A copy of `source` with `old` (which must occur) replaced by `new`."""
    text = source.read_text()
    assert old in text, f"mutation target {old!r} not found"  # never test nothing
    path = tmp_path / source.name
    path.write_text(text.replace(old, new))
    return path


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_value(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def softmax_ref(x: np.ndarray, scale: float) -> np.ndarray:
    z = x.astype(np.float64) * scale
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def run_softmax(lib, name, x, scale=0.5):
    out = np.full_like(x, 0x7FFF if x.dtype == np.uint16 else np.nan)
    rows, cols = x.shape
    lib.dispatch(name, grid=(rows, 1, 1), threadgroup=(int(name.rsplit("_", 1)[1]), 1, 1),
                 buffers={0: x, 1: out, 2: struct.pack("IIf", rows, cols, scale)})
    return out


# ---------------------------------------------------------------- translation (no clang needed)
def test_translation_of_instantiations_and_threadgroup_declarations():
    source = '''# 1 "k.metal"
template <typename T, int N>
[[kernel, max_total_threads_per_threadgroup(256)]] void f(device T* o [[buffer(1)]], uint i [[thread_position_in_grid]]) {
  threadgroup T tile[N][4];
  threadgroup float* p = nullptr;
  o[i] = T(float2(1.0h, 2).y);
}
template [[host_name("f_" "float")]] [[kernel]] decltype(f<float, 8>) f<float, 8>;
template [[host_name("f_half")]] kernel void f<half, 4>(device half* o [[buffer(1)]], uint i [[thread_position_in_grid]]);
kernel void g(constant float& x [[buffer(0)]]) {}
'''
    translation = translate(source)
    kernels = {k.host_name: (k.function, k.params) for k in translation.kernels}
    assert kernels == {"f_float": ("f<float, 8>", [(0, 1, -1), (1, 0, -1)]),
                       "f_half": ("f<half, 4>", [(0, 1, -1), (1, 0, -1)]), "g": ("g", [(0, 0, -1)])}
    assert "threadgroup T (&tile)[N][4] = " in translation.cpp
    assert '"tile (k.metal:3)"' in translation.cpp  # errors name the declaration's line
    assert "threadgroup float* p = nullptr;" in translation.cpp  # pointers stay pointers
    assert "msl_make<float2>(half(1.0), 2)" in translation.cpp
    assert "template decltype(f<half, 4>) f<half, 4>;" in translation.cpp


def test_translation_of_function_constants_and_address_space_members():
    source = '''# 1 "k.metal"
constant bool has_mask [[function_constant(20)]];
constant int blocks [[function_constant(26)]];
struct S {
  float x;
  S() thread : x(0) {}
  S() threadgroup : x(0) {}
  float get() const device { return x; }
};
float first(constant const float v[3]) { return v[0]; }
kernel void f(device float* o [[buffer(0)]], const device bool* m [[buffer(1), function_constant(has_mask)]]) {}
template <typename T> [[kernel]] void unused(device T* o [[buffer(0)]]) {}
'''
    translation = translate(source)
    assert translation.function_constants == {"has_mask": 20, "blocks": 26}
    assert 'static msl_rt::FunctionConstant<bool> has_mask{20, "has_mask"};' in translation.cpp
    assert [(k.host_name, k.params) for k in translation.kernels] == [("f", [(0, 0, -1), (0, 1, 20)])]
    assert "S() : x(0) {}" in translation.cpp and "threadgroup : x(0)" not in translation.cpp
    assert "get()" not in translation.cpp  # only a device overload: dropped
    assert "float first(constant const float* v)" in translation.cpp
    with pytest.raises(me.MetalCompileError, match=r"function_constant\(nothing\)\]\] names no declared"):
        translate("kernel void g(device float* o [[buffer(0), function_constant(nothing)]]) {}\n")


def test_translation_rejects_parameters_without_bindings():
    with pytest.raises(me.MetalCompileError, match=r"k.metal:1: kernel f: parameter 'device float\* o' has no"):
        translate('# 1 "k.metal"\nkernel void f(device float* o) {}\n')
    with pytest.raises(me.MetalCompileError, match=r"\[\[stage_in\]\] is not supported"):
        translate('kernel void f(float4 v [[stage_in]]) {}\n')


# ---------------------------------------------------------------- results vs NumPy
@needs_clang
def test_kernel_names_of_template_and_plain_kernels(softmax_lib, matrix_lib):
    assert softmax_lib.kernel_names == ["softmax_bfloat16_96", "softmax_float16_64", "softmax_float32_128"]
    assert matrix_lib.kernel_names == ["gemm_bt", "gemm_tg_float", "gemm_tg_half", "lane_elements"]
    params = softmax_lib.params("softmax_float32_128")
    assert [p.type for p in params[:3]] == ["const device float*", "device float*", "constant SoftmaxParams&"]


@needs_clang
@pytest.mark.parametrize("columns", [1, 31, 200, 1024])
def test_tiled_softmax_float32(softmax_lib, columns):
    x = np.random.default_rng(columns).standard_normal((5, columns)).astype(np.float32) * 4
    out = run_softmax(softmax_lib, "softmax_float32_128", x)
    np.testing.assert_allclose(out, softmax_ref(x, 0.5), rtol=2e-6, atol=1e-7)


@needs_clang
def test_tiled_softmax_half_and_bfloat(softmax_lib):
    x = np.random.default_rng(7).standard_normal((4, 150)).astype(np.float32)
    half = run_softmax(softmax_lib, "softmax_float16_64", x.astype(np.float16))
    np.testing.assert_allclose(half.astype(np.float32), softmax_ref(x.astype(np.float16), 0.5), rtol=2e-3, atol=1e-5)
    bits = bf16_bits(x)
    bf = run_softmax(softmax_lib, "softmax_bfloat16_96", bits)
    np.testing.assert_allclose(bf16_value(bf), softmax_ref(bf16_value(bits), 0.5), rtol=1e-2, atol=1e-4)


@needs_clang
@pytest.mark.parametrize("name,dtype,threads", [("row_sum_float", np.float32, 128), ("row_sum_half", np.float16, 64)])
def test_threadgroup_reduction(reduce_lib, name, dtype, threads):
    x = np.random.default_rng(3).standard_normal((3, 300)).astype(dtype)
    out = np.full(3, np.nan, np.float32)
    reduce_lib.dispatch(name, grid=(3, 1, 1), threadgroup=(threads, 1, 1), buffers={0: x, 1: out, 2: struct.pack("If", 300, 0.5)})
    np.testing.assert_allclose(out, 0.5 * x.astype(np.float64).sum(1), rtol=1e-5, atol=1e-5)


@needs_clang
@pytest.mark.parametrize("threads", [96, 48])  # 48: a partial second simdgroup of 16 lanes
def test_simd_functions_match_numpy(simd_lib, threads):
    x = np.random.default_rng(threads).standard_normal(threads).astype(np.float32)
    out = np.full((threads, 16), np.nan, np.float32)
    simd_lib.dispatch("simd_float_ops", grid=(1, 1, 1), threadgroup=(threads, 1, 1), buffers={0: x, 1: out})
    for start in range(0, threads, 32):
        v = x[start:start + 32]
        n, lane = len(v), np.arange(len(v))
        got = out[start:start + n]
        expected = {
            0: np.full(n, v.sum()), 1: np.full(n, v.max()), 2: np.full(n, v.min()),
            3: np.cumsum(v), 4: np.cumsum(v) - v,
            7: np.where(lane + 3 < n, v[np.minimum(lane + 3, n - 1)], v),  # no wrap: upper lanes keep theirs
            8: np.where(lane >= 3, v[np.maximum(lane - 3, 0)], v),
            9: v[(lane + 5) % n], 10: v[(lane - 5) % n],
            11: np.full(n, v[7]), 12: np.full(n, v[0]),
            13: np.full(n, float((v > -3).all())), 14: np.full(n, float((v > 2).any())),
            15: np.full(n, np.prod(1 + v.astype(np.float64) * 0.01)),
            5: v[(lane * 7 + 3) % n], 6: v[lane ^ (5 if n == 32 else 1)],
        }
        for column, want in expected.items():
            np.testing.assert_allclose(got[:, column], want, rtol=1e-5, atol=1e-5, err_msg=f"column {column}")


@needs_clang
def test_simd_bitwise_and_vector_shuffles(simd_lib):
    x = np.random.default_rng(5).integers(0, 2**32, 64, dtype=np.uint64).astype(np.uint32)
    out = np.zeros((64, 4), np.uint32)
    simd_lib.dispatch("simd_int_ops", grid=(2, 1, 1), threadgroup=(32, 1, 1), buffers={0: x, 1: out})
    for g in range(2):
        v = x[g * 32:(g + 1) * 32]
        got = out[g * 32:(g + 1) * 32]
        assert (got[:, 0] == np.bitwise_and.reduce(v)).all()
        assert (got[:, 1] == np.bitwise_or.reduce(v)).all()
        assert (got[:, 2] == np.bitwise_xor.reduce(v)).all()
        np.testing.assert_array_equal(got[:, 3], v[np.arange(32) ^ 1] + np.uint32(1))


@needs_clang
@pytest.mark.parametrize("name,dtype", [("gemm_tg_float", np.float32), ("gemm_tg_half", np.float16)])
def test_simdgroup_matrix_gemm_through_threadgroup_memory(matrix_lib, name, dtype):
    m, n, k = 16, 32, 24
    rng = np.random.default_rng(11)
    a, b = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)
    c = np.full((m, n), np.nan, np.float32)
    matrix_lib.dispatch(name, grid=(n // 16, m // 8, 1), threadgroup=(64, 1, 1),
                        buffers={0: a, 1: b, 2: c, 3: struct.pack("III", m, n, k)})
    np.testing.assert_allclose(c, a.astype(np.float64) @ b.astype(np.float64), rtol=1e-4, atol=1e-4)


@needs_clang
def test_simdgroup_matrix_transposed_load_from_device(matrix_lib):
    m, n, k = 16, 24, 32
    rng = np.random.default_rng(12)
    a, bt = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((n, k)).astype(np.float32)
    c = np.full((m, n), np.nan, np.float32)
    matrix_lib.dispatch("gemm_bt", grid=(n // 8, m // 8, 1), threadgroup=(32, 1, 1),
                        buffers={0: a, 1: bt, 2: c, 3: struct.pack("III", m, n, k)})
    np.testing.assert_allclose(c, a @ bt.T, rtol=1e-4, atol=1e-4)


@needs_clang
def test_thread_elements_follow_the_apple_lane_layout(matrix_lib):
    layout = np.full((8, 8), np.nan, np.float32)
    product = np.full((8, 8), np.nan, np.float32)
    matrix_lib.dispatch("lane_elements", grid=(1, 1, 1), threadgroup=(32, 1, 1), buffers={0: layout, 1: product})
    lane = np.arange(32)
    rows = (lane // 16) * 4 + (lane // 2) % 4
    cols = ((lane // 8) % 2) * 4 + (lane % 2) * 2
    expected = np.empty((8, 8), np.float32)
    expected[rows, cols], expected[rows, cols + 1] = 2 * lane, 2 * lane + 1
    np.testing.assert_array_equal(layout, expected)
    np.testing.assert_array_equal(product, expected * 3)  # the product sees every lane's changes


@needs_clang
def test_builtins_in_a_three_dimensional_dispatch(types_lib):
    grid, size = (2, 3, 2), (4, 2, 5)  # 40 threads per group: two simdgroups, the second partial
    gx, gy, gz = (g * s for g, s in zip(grid, size))
    out = np.zeros((gz, gy, gx, 20), np.uint32)
    types_lib.dispatch("builtins", grid=grid, threadgroup=size, buffers={0: out})
    assert (out[..., 19] == 1).all()  # every thread ran
    z, y, x = np.meshgrid(np.arange(gz), np.arange(gy), np.arange(gx), indexing="ij")
    local = np.stack([x % 4, y % 2, z % 5], -1)
    index = (local[..., 2] * 2 + local[..., 1]) * 4 + local[..., 0]
    np.testing.assert_array_equal(out[..., 0:3], np.stack([x, y, z], -1))
    np.testing.assert_array_equal(out[..., 3:6], np.stack([x // 4, y // 2, z // 5], -1))
    np.testing.assert_array_equal(out[..., 6:9], local)
    np.testing.assert_array_equal(out[..., 9], index)
    assert (out[..., 10:13] == size).all()
    assert (out[..., 13] == 232).all() and (out[..., 14] == 8 * 10000 + 6 * 100 + 10).all()
    np.testing.assert_array_equal(out[..., 15], index // 32)
    np.testing.assert_array_equal(out[..., 16], index % 32)
    assert (out[..., 17] == 32).all() and (out[..., 18] == 2).all()


@needs_clang
def test_half_and_bfloat_round_trips(types_lib):
    rng = np.random.default_rng(2)
    wide = np.concatenate([rng.standard_normal(60).astype(np.float32) * 100,
                           np.array([1 + 2**-9, 65504, 1e-8, -0.0], np.float32)])
    n = len(wide)
    halves = wide.astype(np.float16)
    same, narrowed, bits = np.zeros(n, np.float16), np.zeros(n, np.float32), np.zeros(n, np.uint16)
    types_lib.dispatch("round_trip_half", grid=(1, 1, 1), threadgroup=(n, 1, 1),
                       buffers={0: halves, 1: same, 2: wide, 3: narrowed, 4: bits})
    np.testing.assert_array_equal(same.view(np.uint16), halves.view(np.uint16))
    np.testing.assert_array_equal(narrowed, wide.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(bits, wide.astype(np.float16).view(np.uint16))

    bf_in = bf16_bits(wide)
    same = np.zeros(n, np.uint16)
    types_lib.dispatch("round_trip_bfloat", grid=(1, 1, 1), threadgroup=(n, 1, 1),
                       buffers={0: bf_in, 1: same, 2: wide, 3: narrowed, 4: bits})
    np.testing.assert_array_equal(same, bf_in)
    np.testing.assert_array_equal(bits, bf_in)
    np.testing.assert_array_equal(narrowed, bf16_value(bf_in))


@needs_clang
def test_math_functions_match_numpy(types_lib, fast_math):
    x = np.linspace(0.25, 3.0, 32, dtype=np.float32)
    out = np.full((32, 16), np.nan, np.float32)
    types_lib.dispatch("math_ops", grid=(1, 1, 1), threadgroup=(32, 1, 1), buffers={0: x, 1: out})
    v = x.astype(np.float64)
    q = np.stack([v, 2 * v, 3 * v, -v], -1)
    e = np.exp(q)
    expected = {
        0: np.exp(v), 1: np.exp2(v), 2: np.log(v), 3: np.log2(v), 4: np.sqrt(v), 5: 1 / np.sqrt(v),
        6: 2 * v - 1, 7: np.clip(v, 0.5, 1.5), 8: np.where(v > 1, v, -v),
        9: np.floor(x * np.float32(3)) + np.ceil(x * np.float32(5)),
        10: q[:, 2] + e[:, 0], 11: q[:, 1] + e[:, 3], 12: v + 7,
        13: np.maximum(q[:, 0], 1) + np.minimum(2 * x.astype(np.float16), 1).astype(np.float64),
        15: np.full(32, 65504.0 + 1),
    }
    if not fast_math:  # -ffast-math assumes there are no infinities, like Metal's fast math
        expected[14] = np.ones(32)
    for column, want in expected.items():
        np.testing.assert_allclose(out[:, column], want, rtol=2e-6, atol=1e-6, err_msg=f"column {column}")


@needs_clang
def test_defines_and_include_dirs_reach_the_kernel(tmp_path):
    lib = me.compile_library([SOFTMAX], include_dirs=KERNEL_INCLUDES, defines={"SOFTMAX_EXP": "exp2"})
    x = np.random.default_rng(1).standard_normal((2, 40)).astype(np.float32)
    out = run_softmax(lib, "softmax_float32_128", x, scale=1.0)
    z = x.astype(np.float64)
    e = np.exp2(z - z.max(1, keepdims=True))
    np.testing.assert_allclose(out, e / e.sum(1, keepdims=True), rtol=1e-6)
    with pytest.raises(me.MetalCompileError, match="softmax_params.h"):
        me.compile_library([SOFTMAX])  # without the include dir


@needs_clang
def test_compiles_are_cached_by_content(tmp_path, monkeypatch):
    monkeypatch.setenv("MSL_EMULATOR_CACHE", str(tmp_path))
    me.compile_library([REDUCE])
    built = sorted(tmp_path.glob("*.so"))
    start = time.perf_counter()
    me.compile_library([REDUCE])
    assert time.perf_counter() - start < 0.5  # no second clang compile
    assert sorted(tmp_path.glob("*.so")) == built
    me.compile_library([REDUCE], fast_math=True)
    assert len(list(tmp_path.glob("*.so"))) == len(built) + 1  # flags are part of the key


@needs_clang
def test_non_uniform_grid_and_threadgroup_argument(faults_lib):
    out = np.full(70, np.nan, np.float32)
    faults_lib.dispatch("threadgroup_argument", grid=None, threads=(70, 1, 1), threadgroup=(32, 1, 1),
                        buffers={0: out}, threadgroup_memory={0: 32 * 4})
    gid = np.arange(70)
    size = np.where(gid < 64, 32, 6)  # the edge threadgroup has 6 threads
    first = gid - gid % 32
    np.testing.assert_array_equal(out, first + size - 1 - gid % 32 + 1000.0 * size)
    with pytest.raises(me.EmulatorError, match=r"threadgroup_memory=\{0: bytes\}"):
        faults_lib.dispatch("threadgroup_argument", grid=None, threads=(70, 1, 1), threadgroup=(32, 1, 1), buffers={0: out})


@needs_clang
def test_speed_of_barrier_heavy_kernels(softmax_lib):
    """16 threadgroups x 128 threads with several hundred barriers: well under
    a second (the runtime's budget for the attention tests)."""
    x = np.random.default_rng(0).standard_normal((16, 1024)).astype(np.float32)
    lib = softmax_lib
    start = time.perf_counter()
    for _ in range(60):  # 60 dispatches x 4 barriers x 16 groups = 3840 threadgroup barriers
        run_softmax(lib, "softmax_float32_128", x)
    elapsed = time.perf_counter() - start
    assert elapsed < 3.0, f"{elapsed:.2f} s"


# ---------------------------------------------------------------- errors that must be caught
@needs_clang
def test_missing_barrier_gives_wrong_results(tmp_path):
    """Without the barrier after the simdgroup maxima are written, simdgroup 0
    reads the others' before they exist (poisoned NaN)."""
    lib = build(mutant(tmp_path, SOFTMAX, "threadgroup_barrier(mem_flags::mem_threadgroup);  // MAX WRITTEN", ""))
    x = np.random.default_rng(0).standard_normal((2, 256)).astype(np.float32)
    out = run_softmax(lib, "softmax_float32_128", x)
    assert not np.allclose(out, softmax_ref(x, 0.5), rtol=1e-3)


@needs_clang
def test_missing_write_after_read_barrier_gives_wrong_results(tmp_path):
    """Without the barrier between reading the maxima and writing the sums,
    simdgroup 0 overwrites partial[] while others still read the maxima (with
    very negative logits the wrong maximum makes their exponentials vanish)."""
    lib = build(mutant(tmp_path, SOFTMAX, "threadgroup_barrier(mem_flags::mem_threadgroup);  // MAX READ", ""))
    x = np.random.default_rng(0).standard_normal((2, 256)).astype(np.float32) - 1000
    np.testing.assert_allclose(run_softmax(build(SOFTMAX), "softmax_float32_128", x), softmax_ref(x, 0.5), rtol=1e-5)
    out = run_softmax(lib, "softmax_float32_128", x)
    assert not np.allclose(out, softmax_ref(x, 0.5), rtol=1e-3)


@needs_clang
def test_divergent_barrier_is_a_deadlock_naming_the_line(tmp_path):
    source = mutant(tmp_path, SOFTMAX, "  threadgroup_barrier(mem_flags::mem_threadgroup);  // SUM WRITTEN",
                    "  if (tid < 64) threadgroup_barrier(mem_flags::mem_threadgroup);  // SUM WRITTEN")
    line = next(i for i, text in enumerate(source.read_text().splitlines(), 1) if "// SUM WRITTEN" in text)
    lib = build(source)
    with pytest.raises(me.DeadlockError, match=rf"thread 64 .* returned while thread 0 .* waits in threadgroup_barrier at .*softmax.metal:{line}\b"):
        run_softmax(lib, "softmax_float32_128", np.ones((1, 64), np.float32))


@needs_clang
def test_barriers_at_different_lines_are_a_deadlock(tmp_path):
    source = mutant(tmp_path, SOFTMAX, "  threadgroup_barrier(mem_flags::mem_threadgroup);  // SUM WRITTEN",
                    "  if (tid < 64) { threadgroup_barrier(mem_flags::mem_threadgroup); }\n"
                    "  else { threadgroup_barrier(mem_flags::mem_threadgroup); }")
    with pytest.raises(me.DeadlockError, match=r"different barriers: thread 0 .* at .*softmax.metal:\d+, thread 64 .*softmax.metal:\d+"):
        run_softmax(build(source), "softmax_float32_128", np.ones((1, 64), np.float32))


@needs_clang
def test_divergent_simd_function_is_a_deadlock(tmp_path):
    source = mutant(tmp_path, SOFTMAX, "local_sum = simd_sum(local_sum);", "if (lane < 16) local_sum = simd_sum(local_sum);")
    with pytest.raises(me.DeadlockError, match=r"simd_sum at .*softmax.metal:\d+ while thread 16 \(simdgroup 0, lane 16\)"):
        run_softmax(build(source), "softmax_float32_128", np.ones((1, 64), np.float32))


@needs_clang
def test_uninitialised_threadgroup_read_is_poisoned(tmp_path):
    source = mutant(tmp_path, SOFTMAX, "    partial[simd] = local_max;", "    (void)local_max;")
    out = run_softmax(build(source), "softmax_float32_128", np.ones((1, 64), np.float32))
    assert np.isnan(out).all()


@needs_clang
@pytest.mark.parametrize("old,new,message", [
    ("device T* out [[buffer(1)]]", "constant T* out [[buffer(1)]]", "read-only|const-qualified"),
    ("  threadgroup float partial[SIMDGROUPS];", "  threadgroup float partial[SIMDGROUPS];\n  device float* alias = partial;",
     r"cannot initialize a variable of type 'device float \*' with an lvalue of type 'threadgroup float\["),
    ("const device T* in [[buffer(0)]]", "const device T* in [[buffer(0)]], threadgroup float* wrong = nullptr",
     "has no \\[\\[...\\]\\] attribute"),
    ("float local_sum = 0.0f;", "float local_sum = 0.0f; half4 h = float4(1.0f);", "cannot initialize|no viable conversion"),
])
def test_metal_mistakes_do_not_compile(tmp_path, old, new, message):
    with pytest.raises(me.MetalCompileError, match=message):
        me.typecheck(mutant(tmp_path, SOFTMAX, old, new), include_dirs=KERNEL_INCLUDES)


@needs_clang
def test_typecheck_accepts_the_kernels():
    for source in (SOFTMAX, SIMD, MATRIX, TYPES, FAULTS, REDUCE):
        me.typecheck(source, include_dirs=KERNEL_INCLUDES)


@needs_clang
def test_out_of_bounds_device_read_is_reported(faults_lib):
    x, out = np.ones(64, np.float32), np.zeros(64, np.float32)
    faults_lib.dispatch("read_past_end", grid=(2, 1, 1), threadgroup=(32, 1, 1), buffers={0: x, 1: out, 2: struct.pack("I", 0)})
    assert (out == 1).all()
    with pytest.raises(me.EmulatorError, match=r"invalid memory access at \d+ bytes past the end of buffer\(0\) \(256 bytes\)"):
        faults_lib.dispatch("read_past_end", grid=(2, 1, 1), threadgroup=(32, 1, 1), buffers={0: x, 1: out, 2: struct.pack("I", 1)})


@needs_clang
def test_threadgroup_overrun_is_reported(faults_lib):
    with pytest.raises(me.EmulatorError, match=r"past the end of threadgroup array tile \(.*faults.metal:\d+\)"):
        faults_lib.dispatch("threadgroup_overrun", grid=(1, 1, 1), threadgroup=(64, 1, 1),
                            buffers={0: np.zeros(64, np.float32), 1: struct.pack("I", 1)})


@needs_clang
def test_write_to_const_buffer_is_reported(faults_lib):
    x = np.zeros(32, np.float32)
    with pytest.raises(me.EmulatorError, match=r"read-only \(const\) memory of buffer\(0\)"):
        faults_lib.dispatch("write_const_input", grid=(1, 1, 1), threadgroup=(32, 1, 1), buffers={0: x})
    assert (x == 0).all()


@needs_clang
def test_integer_division_by_zero_is_reported(faults_lib):
    with pytest.raises(me.EmulatorError, match="division by zero"):
        faults_lib.dispatch("integer_divide", grid=(1, 1, 1), threadgroup=(32, 1, 1),
                            buffers={0: np.zeros(32, np.uint32), 1: struct.pack("I", 0)})


@needs_clang
def test_endless_kernel_times_out(faults_lib):
    out = np.zeros(32, np.uint32)
    with pytest.raises(me.DeadlockError, match="did not finish in time"):
        faults_lib.dispatch("endless", grid=(1, 1, 1), threadgroup=(32, 1, 1), buffers={0: out, 1: struct.pack("I", 3)},
                            timeout=0.5)
    faults_lib.dispatch("endless", grid=(1, 1, 1), threadgroup=(32, 1, 1), buffers={0: out, 1: struct.pack("I", 0)})


@needs_clang
def test_threadgroup_memory_limit(faults_lib):
    with pytest.raises(me.EmulatorError, match="40960 bytes of threadgroup memory; Metal allows 32768"):
        faults_lib.dispatch("too_much_threadgroup_memory", grid=(1, 1, 1), threadgroup=(32, 1, 1),
                            buffers={0: np.zeros(32, np.float32)})


@needs_clang
def test_bad_launches_and_buffers(softmax_lib, faults_lib):
    x, out = np.ones((1, 8), np.float32), np.zeros((1, 8), np.float32)
    params = struct.pack("IIf", 1, 8, 1.0)
    with pytest.raises(me.EmulatorError, match="no kernel named 'nope'"):
        softmax_lib.dispatch("nope", grid=(1, 1, 1), threadgroup=(32, 1, 1), buffers={})
    with pytest.raises(me.EmulatorError, match="more than 1024 threads"):
        softmax_lib.dispatch("softmax_float32_128", grid=(1, 1, 1), threadgroup=(2048, 1, 1), buffers={0: x, 1: out, 2: params})
    with pytest.raises(me.EmulatorError, match=r"`device float\*` \[\[buffer\(1\)\]\] has no buffer bound \(buffers given: \[0, 2\]\)"):
        softmax_lib.dispatch("softmax_float32_128", grid=(1, 1, 1), threadgroup=(128, 1, 1), buffers={0: x, 2: params})
    with pytest.raises(me.EmulatorError, match=r"buffer 2 has 4 bytes but parameter `constant SoftmaxParams&` needs 12"):
        softmax_lib.dispatch("softmax_float32_128", grid=(1, 1, 1), threadgroup=(128, 1, 1), buffers={0: x, 1: out, 2: b"\0" * 4})
    with pytest.raises(me.EmulatorError, match="C-contiguous"):
        softmax_lib.dispatch("softmax_float32_128", grid=(1, 1, 1), threadgroup=(128, 1, 1),
                             buffers={0: np.ones((8, 2), np.float32)[:, 0], 1: out, 2: params})
    with pytest.raises(me.EmulatorError, match="read-only array"):
        softmax_lib.dispatch("softmax_float32_128", grid=(1, 1, 1), threadgroup=(128, 1, 1),
                             buffers={0: x, 1: np.broadcast_to(np.zeros(8, np.float32), (1, 8)), 2: params})
    with pytest.raises(me.EmulatorError, match="numpy array or bytes"):
        softmax_lib.dispatch("softmax_float32_128", grid=(1, 1, 1), threadgroup=(128, 1, 1), buffers={0: x, 1: out, 2: 5})
    # a structured array works as a constant struct
    struct_params = np.array([(1, 8, 1.0)], dtype=[("rows", "<u4"), ("columns", "<u4"), ("scale", "<f4")])
    softmax_lib.dispatch("softmax_float32_128", grid=(1, 1, 1), threadgroup=(128, 1, 1), buffers={0: x, 1: out, 2: struct_params})
    np.testing.assert_allclose(out, np.full((1, 8), 1 / 8), rtol=1e-6)


# ---------------------------------------------------------------- cost counters
@pytest.fixture(scope="module")
def counting_lib():
    return build(COUNTERS, fast_math=True, counters=True)


@needs_clang
def test_uncounted_libraries_return_no_counters(softmax_lib):
    x = np.ones((2, 64), np.float32)
    assert softmax_lib.dispatch("softmax_float32_128", (2, 1, 1), (128, 1, 1),
                                {0: x, 1: np.zeros_like(x), 2: struct.pack("IIf", 2, 64, 1.0)}) is None
    assert softmax_lib.last_counters is None


@needs_clang
def test_counters_of_a_copy_kernel(counting_lib):
    n = 100  # 2 threadgroups of 64: 28 threads do nothing but read n
    x, y = np.arange(n, dtype=np.float32), np.zeros(n, np.float32)
    counters = counting_lib.dispatch("scale_copy", (2, 1, 1), (64, 1, 1), {0: x, 1: y, 2: struct.pack("I", n)})
    np.testing.assert_array_equal(y, 2 * x)
    assert counters == counting_lib.last_counters
    assert (counters.device_bytes_read, counters.device_bytes_written) == (4 * n, 4 * n)
    assert counters.constant_bytes_read == 4 * 128
    assert counters.threadgroup_bytes_read == counters.threadgroup_bytes_written == 0
    assert counters.threadgroup_barriers == counters.simd_ops == counters.exp_calls == 0
    assert counters.threadgroup_memory_bytes == counters.thread_array_bytes == 0


@needs_clang
def test_counters_of_barriers_threadgroup_memory_simd_and_exp(counting_lib):
    groups, threads = 3, 64
    x = np.linspace(-1, 1, groups * threads, dtype=np.float32)
    y = np.zeros_like(x)
    counters = counting_lib.dispatch("staged_exp", (groups, 1, 1), (threads, 1, 1), {0: x, 1: y})
    per_group = x.reshape(groups, 2, 32)
    reversed_in_group = x.reshape(groups, threads)[:, ::-1].reshape(-1)
    expected = np.repeat(np.exp(per_group).sum(axis=2), 32, axis=1).reshape(-1) + reversed_in_group
    np.testing.assert_allclose(y, expected, rtol=1e-5)
    n = groups * threads
    assert counters.threadgroup_barriers == 3 * groups
    assert counters.threadgroup_bytes_written == 4 * n and counters.threadgroup_bytes_read == 2 * 4 * n
    assert counters.device_bytes_read == counters.device_bytes_written == 4 * n
    assert counters.simd_ops == groups * 2  # one simd_sum per simdgroup
    assert counters.exp_calls == n
    assert counters.threadgroup_memory_bytes == 4 * threads


@needs_clang
def test_counters_of_a_simdgroup_product(counting_lib):
    a = np.arange(64, dtype=np.float16).reshape(8, 8) / 64
    b = np.eye(8, dtype=np.float16)
    c = np.zeros((8, 8), np.float32)
    counters = counting_lib.dispatch("one_product", (1, 1, 1), (32, 1, 1), {0: a, 1: b, 2: c})
    np.testing.assert_allclose(c, a.astype(np.float32))
    assert counters.simdgroup_matrix_mmas == 1
    assert counters.device_bytes_read == 2 * 64 * 2 and counters.device_bytes_written == 64 * 4
    assert counters.simd_ops == 0  # the loads' lane exchange is no simd function


@needs_clang
def test_thread_array_bytes_count_arrays_kept_in_memory(counting_lib):
    x, y = np.arange(32 * 64, dtype=np.float32), np.zeros(32, np.float32)
    counters = counting_lib.dispatch("thread_array", (1, 1, 1), (32, 1, 1), {0: x, 1: y, 2: struct.pack("I", 1)})
    np.testing.assert_array_equal(y, x.reshape(32, 64)[np.arange(32), (np.arange(32) + 1) % 64])
    assert counters.thread_array_bytes == 64 * 4
    assert counters.device_bytes_read == 32 * 64 * 4


@needs_clang
def test_device_load_operations_count_instructions_whatever_their_width(counting_lib):
    threads = 32
    x = np.arange(8 * threads, dtype=np.float16) / 64
    y = np.zeros(threads, np.float32)
    counters = counting_lib.dispatch("vector_and_scalar_loads", (1, 1, 1), (threads, 1, 1), {0: x, 1: y})
    np.testing.assert_allclose(y, x.reshape(threads, 8)[:, :6].astype(np.float32).sum(axis=1), rtol=1e-3)
    assert counters.device_load_operations == 3 * threads  # one half4 and two halves per thread
    assert counters.device_bytes_read == (8 + 2 + 2) * threads


@needs_clang
def test_counting_builds_fail_a_misaligned_device_load(counting_lib):
    """A buffer bound 2 bytes into an allocation stays 2 bytes off in the
    emulator's staged copy, as a Metal buffer bound at that byte offset: the
    half4 load (8-byte aligned on the GPU) fails the dispatch."""
    x = np.zeros(8 * 32 + 1, np.float16)
    y = np.zeros(32, np.float32)
    with pytest.raises(me.EmulatorError, match="misaligned device load"):
        counting_lib.dispatch("vector_and_scalar_loads", (1, 1, 1), (32, 1, 1), {0: x[1:], 1: y})
    assert counting_lib.dispatch("vector_and_scalar_loads", (1, 1, 1), (32, 1, 1), {0: x[:-1], 1: y}) is not None


def test_ir_instrumentation_counts_loads_stores_and_copies():
    from kernel_lab.msl_emulator import counters as c

    ir = """define void @k(ptr addrspace(1) %d, ptr addrspace(3) %t, ptr %p) {
  %a = load <2 x half>, ptr addrspace(1) %d, align 4
  store float 1.0, ptr addrspace(3) %t, align 4
  store ptr addrspace(1) %d, ptr %p, align 8
  %b = load i32, ptr %p, align 4
  call void @llvm.memcpy.p3.p1.i64(ptr addrspace(3) align 4 %t, ptr addrspace(1) align 4 %d, i64 16, i1 false)
  ret void
}
define void @msl_count_access(i32 %0, i64 %1, i32 %2, i64 %3, i64 %4) {
  ret void
}
"""
    out = c.instrument(ir)
    calls = [line.strip() for line in out.splitlines() if "call void @msl_count_access(" in line or "ptrtoint ptr" in line]
    assert calls == [
        "%msl_address_1 = ptrtoint ptr addrspace(1) %d to i64",
        "call void @msl_count_access(i32 1, i64 ptrtoint (ptr getelementptr (<2 x half>, ptr null, i32 1) to i64), "
        "i32 0, i64 %msl_address_1, i64 4)",
        "%msl_address_2 = ptrtoint ptr addrspace(3) %t to i64",
        "call void @msl_count_access(i32 3, i64 ptrtoint (ptr getelementptr (float, ptr null, i32 1) to i64), "
        "i32 1, i64 %msl_address_2, i64 4)",
        # copies: no address, no alignment check
        "call void @msl_count_access(i32 3, i64 16, i32 1, i64 0, i64 1)",
        "call void @msl_count_access(i32 1, i64 16, i32 0, i64 0, i64 1)",
    ]
    with pytest.raises(ValueError, match="msl_count_access"):
        c.instrument("define void @k() {\n  ret void\n}\n")
