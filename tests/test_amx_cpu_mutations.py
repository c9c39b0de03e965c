"""Mutation battery of the avx512amx copy's tile products: seed one fault
into csrc/cpu/amx_tiles.h (the AMX score and value products, the in-place
bf16 pair panel of P), build the avx512amx copy of the kernel with it into
the standalone driver (tests/cpu_harness/amx_driver.cpp: dense bf16 problems
against a double-precision attention), and require the driver to fail
(tests/cpu_mutation_battery.py). Needs a CPU whose Linux grants AMX tiles
(cpuinfo flag amx_bf16), else skips with the reason."""

import pytest

from cpu_mutation_battery import CpuMutationBattery, cpu_has_amx_bf16, selected

AMX_UNIT = ('#define MLX_ATTN_ISA avx512amx\n#define MLX_ATTN_NATIVE_BF16 1\n#define MLX_ATTN_AMX_BF16 1\n'
            '#include "csrc/cpu/isa_avx512.h"\n#include "csrc/cpu/kernel_impl.h"\n')
BATTERY = CpuMutationBattery(
    header="amx_tiles.h", unit="kernel", driver="amx_driver.cpp", name="AMX", unit_source=AMX_UNIT,
    isa_flags=("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512bf16", "-mamx-tile", "-mamx-bf16",
               "-mavx2", "-mfma", "-mf16c"))

# (name, target text, replacement): each target occurs exactly once.
MUTANTS = [
    ("the value product overwrites the accumulator", "_tile_loadd(0, c, c_bytes);", "_tile_zero(0);"),
    ("P's pairs not interleaved", "_mm512_permutexvar_epi16(interleave, both)", "both"),
    ("the second column tile not multiplied", "_tile_dpbf16ps(1, 4, 7);", ""),
    ("the odd key of a pair dropped", "const __m512 o = 2 * j + 1 < n ? _mm512_loadu_ps(odd + c) : zero;",
     "const __m512 o = zero;"),
    ("every other depth step skipped", "k += kAmxDepth", "k += 2 * kAmxDepth"),
    ("V^T words left untransposed", "amx_transpose_words(r);", ""),
    ("the odd key of V^T's pairs dropped", "const __m256i odd = j + 1 < n ?", "const __m256i odd = false ?"),
    ("V^T's 32-feature pairs stored in lane order", "const int e = e0 + 8 * (x / 4) + x % 4;", "const int e = e0 + x;"),
    ("Q^T's pair panel built from row 0 only", "row_words[i] = j0 + i < n ? _mm512_loadu_si512(rows[j0 + i]",
     "row_words[i] = j0 + i < n ? _mm512_loadu_si512(rows[j0]"),
]
DEFAULT_MUTANTS = [MUTANTS[0], MUTANTS[1]]

SELECTED = selected(MUTANTS, DEFAULT_MUTANTS)


@pytest.mark.skipif(not cpu_has_amx_bf16(), reason="the avx512amx copy needs a CPU with AMX-BF16 (cpuinfo flag amx_bf16)")
@pytest.mark.parametrize("name,target,replacement", SELECTED, ids=[m[0] for m in SELECTED])
def test_amx_tile_mutants_are_caught(tmp_path, name, target, replacement):
    BATTERY.assert_caught(tmp_path, name, target, replacement)


def test_every_mutation_target_exists():
    BATTERY.assert_targets_exist(MUTANTS)
