"""The MSL emulator itself: Metal kernels type-checked by clang-19 and run on
the CPU must compute what NumPy computes, and programming errors (missing
barriers, divergent barriers, uninitialised threadgroup memory, address-space
mistakes) must be caught."""

import struct
from pathlib import Path

import numpy as np
import pytest

import msl_emulator as me

pytestmark = pytest.mark.skipif(not me.clang_available(), reason="clang-19 is not installed (apt-get install clang-19)")

KERNELS = Path(__file__).parent / "msl_emulator" / "test_kernels"
REDUCE = KERNELS / "reduce.metal"


@pytest.fixture(scope="module", params=[False, True], ids=["precise", "fast-math"])
def library(request):
    return me.compile_library([REDUCE], fast_math=request.param)


def mutant(tmp_path, source: Path, old: str, new: str) -> Path:
    text = source.read_text()
    assert text.count(old) >= 1, f"mutation target {old!r} not found"  # never test nothing
    path = tmp_path / source.name
    path.write_text(text.replace(old, new))
    return path


def test_kernel_names(library):
    assert library.kernel_names == ["row_sum_float", "row_sum_half", "simd_ops", "tile_matmul"]


@pytest.mark.parametrize("name,dtype,threads", [("row_sum_float", np.float32, 128), ("row_sum_half", np.float16, 64)])
@pytest.mark.parametrize("columns", [1, 31, 300])
def test_threadgroup_reduction(library, name, dtype, threads, columns):
    x = np.random.default_rng(columns).standard_normal((3, columns)).astype(dtype)
    out = np.full(3, np.nan, np.float32)
    library.dispatch(name, grid=(3, 1, 1), threadgroup=(threads, 1, 1), buffers={0: x, 1: out, 2: struct.pack("If", columns, 0.5)})
    np.testing.assert_allclose(out, 0.5 * x.astype(np.float64).sum(1), rtol=1e-5, atol=1e-5)


def test_simd_collectives(library):
    x = np.random.default_rng(0).standard_normal(96).astype(np.float32)
    out = np.zeros((96, 4), np.float32)
    library.dispatch("simd_ops", grid=(1, 1, 1), threadgroup=(96, 1, 1), buffers={0: x, 1: out})
    for group in range(3):
        lanes = x[group * 32 : (group + 1) * 32]
        got = out[group * 32 : (group + 1) * 32]
        np.testing.assert_allclose(got[:, 0], np.cumsum(lanes), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(got[:, 1], lanes[np.arange(32) ^ 1])
        np.testing.assert_array_equal(got[:, 2], np.full(32, lanes.max()))
        np.testing.assert_array_equal(got[:, 3], np.full(32, lanes[3]))


def test_simdgroup_matrix_product(library):
    n = 24
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((n, n)).astype(np.float32), rng.standard_normal((n, n)).astype(np.float32)
    c = np.zeros((n, n), np.float32)
    library.dispatch("tile_matmul", grid=(3, 3, 1), threadgroup=(32, 1, 1), buffers={0: a, 1: b, 2: c, 3: struct.pack("I", n)})
    np.testing.assert_allclose(c, a @ b, rtol=1e-4, atol=1e-4)


def test_missing_barrier_is_visible(tmp_path):
    """Without the barrier, thread 0 reads the partial sums before the other
    simdgroups wrote them: poisoned (NaN) threadgroup memory."""
    lib = me.compile_library([mutant(tmp_path, REDUCE, "threadgroup_barrier(mem_flags::mem_threadgroup);  // BARRIER", "")])
    x = np.ones((1, 256), np.float32)
    out = np.zeros(1, np.float32)
    lib.dispatch("row_sum_float", grid=(1, 1, 1), threadgroup=(128, 1, 1), buffers={0: x, 1: out, 2: struct.pack("If", 256, 1.0)})
    assert not out[0] == 256.0


def test_divergent_barrier_deadlocks_with_location(tmp_path):
    source = mutant(tmp_path, REDUCE, "  threadgroup_barrier(mem_flags::mem_threadgroup);  // BARRIER",
                    "  if (tid < 64) { threadgroup_barrier(mem_flags::mem_threadgroup); }  // BARRIER")
    lib = me.compile_library([source])
    x = np.ones((1, 8), np.float32)
    with pytest.raises(me.DeadlockError, match=r"threads returned, thread \d+ waits in threadgroup_barrier at .*reduce.metal:\d+"):
        lib.dispatch("row_sum_float", grid=(1, 1, 1), threadgroup=(128, 1, 1), buffers={0: x, 1: np.zeros(1, np.float32), 2: struct.pack("If", 8, 1.0)})


def test_divergent_simd_call_is_reported(tmp_path):
    source = mutant(tmp_path, REDUCE, "  acc = simd_sum(acc);", "  if (lane < 16) { acc = simd_sum(acc); }")
    lib = me.compile_library([source])
    with pytest.raises(me.DeadlockError, match="simd"):
        lib.dispatch("row_sum_float", grid=(1, 1, 1), threadgroup=(128, 1, 1),
                     buffers={0: np.ones((1, 8), np.float32), 1: np.zeros(1, np.float32), 2: struct.pack("If", 8, 1.0)})


def test_uninitialised_threadgroup_read_is_poisoned(tmp_path):
    source = mutant(tmp_path, REDUCE, "    partial[simd] = acc;", "    (void)acc;")
    lib = me.compile_library([source])
    out = np.zeros(1, np.float32)
    lib.dispatch("row_sum_float", grid=(1, 1, 1), threadgroup=(128, 1, 1),
                 buffers={0: np.ones((1, 8), np.float32), 1: out, 2: struct.pack("If", 8, 1.0)})
    assert np.isnan(out[0])


@pytest.mark.parametrize("old,new,message", [
    ("device float* out [[buffer(1)]]", "constant float* out [[buffer(1)]]", "constant|read-only|const"),
    ("    partial[simd] = acc;", "    device float* p = partial; p[simd] = acc;",
     r"'device float \*' with an lvalue of type 'threadgroup float"),
])
def test_address_space_mistakes_do_not_compile(tmp_path, old, new, message):
    with pytest.raises(me.MetalCompileError, match=message):
        me.typecheck(mutant(tmp_path, REDUCE, old, new))


def test_bad_launches(library):
    with pytest.raises(me.EmulatorError, match="no kernel"):
        library.dispatch("nope", grid=(1, 1, 1), threadgroup=(32, 1, 1), buffers={})
    with pytest.raises(me.EmulatorError, match="invalid launch"):
        library.dispatch("simd_ops", grid=(1, 1, 1), threadgroup=(2048, 1, 1), buffers={})
    with pytest.raises(me.EmulatorError, match="C-contiguous"):
        library.dispatch("simd_ops", grid=(1, 1, 1), threadgroup=(32, 1, 1),
                         buffers={0: np.zeros((64, 2), np.float32)[:, 0], 1: np.zeros((32, 4), np.float32)})
