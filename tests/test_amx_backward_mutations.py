"""Mutation batteries of the avx512amx backward copy: seed one fault into
csrc/cpu/amx_tiles.h (the tile products and the backward's panels) or into
the AMX tile policy of csrc/cpu/backward_impl.h (AmxTiles), build the
avx512amx backward copy with it into the standalone driver
(tests/cpu_harness/amx_backward_driver.cpp: bf16 backward problems through
both schemes against a double-precision backward), and require the driver
to fail (tests/cpu_mutation_battery.py). A few mutants by default, all with
MLX_ATTN_FULL_GRID=1. Needs a CPU whose Linux grants AMX tiles (cpuinfo flag
amx_bf16), else skips with the reason."""

import pytest

from cpu_mutation_battery import CpuMutationBattery, cpu_has_amx_bf16, selected

AMX_BACKWARD_UNIT = ('#define MLX_ATTN_ISA avx512amx_backward\n#define MLX_ATTN_AMX_BF16 1\n'
                     '#include "csrc/cpu/isa_avx512.h"\n#include "csrc/cpu/backward_impl.h"\n')
ISA_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512bf16", "-mamx-tile", "-mamx-bf16",
             "-mavx2", "-mfma", "-mf16c")
TILES = CpuMutationBattery(header="amx_tiles.h", unit="backward", driver="amx_backward_driver.cpp",
                           name="AMX backward tiles", unit_source=AMX_BACKWARD_UNIT, isa_flags=ISA_FLAGS)
POLICY = CpuMutationBattery(header="backward_impl.h", unit="backward", driver="amx_backward_driver.cpp",
                            name="AMX backward policy", unit_source=AMX_BACKWARD_UNIT, isa_flags=ISA_FLAGS)

# (battery, name, target text, replacement): each target occurs exactly once
# in its battery's header.
MUTANTS = [
    (TILES, "K and V feature pairs left untransposed",
     "amx_transpose_words(row_words);", ""),
    (TILES, "the odd row of K's key pairs dropped", "const __m256i hi = odd ?", "const __m256i hi = false ?"),
    (TILES, "dK and dV overwritten by each query tile", "_tile_loadd(0, c, c_bytes);", "_tile_zero(0);"),
    (TILES, "P's and dS's row pairs not interleaved", "_mm512_permutexvar_epi16(interleave, both)", "both"),
    (TILES, "Q^T and dO^T words left untransposed", "amx_transpose_words(r);", ""),
    (POLICY, "dK stored without the scale", "buf.dk_acc[d * kKeyBlock + j] * p.scale", "buf.dk_acc[d * kKeyBlock + j]"),
    (POLICY, "dQ added to the rows of the wrong head", "((r / t.qb) * head_stride + r % t.qb)", "r"),
    (POLICY, "dK's product reads P for dS", "reinterpret_cast<const uint16_t*>(buf.d_scores)",
     "reinterpret_cast<const uint16_t*>(buf.probs)"),
    (POLICY, "the score guard's scale ignored", "float logit_scale = pair.scale;",
     "float logit_scale = call.problem.scale;"),
    (POLICY, "dS rows for dQ left from the previous tile",
     "_mm256_storeu_si256(reinterpret_cast<__m256i*>(even_row + c), (__m256i)_mm512_cvtneps_pbh(e));", ""),
    (POLICY, "kept query tiles cut at a key block's query range",
     "const int end = Tiles::kGridTiles ? call.problem.q_len : range.end;", "const int end = range.end;"),
    (POLICY, "an item reads the previous item's packed query tiles",
     "query_panels[qt * panel_record_floats(c) + 3] = 0.0f;", ""),
    (POLICY, "dQ accumulated in place into the first head's rows", "dq + g * head_stride * w.Dp, w.Dp, t.qb / kAmxTile",
     "dq, w.Dp, t.qb / kAmxTile"),
]
DEFAULT_MUTANTS = [MUTANTS[0], MUTANTS[6], MUTANTS[8], MUTANTS[10]]

SELECTED = selected(MUTANTS, DEFAULT_MUTANTS)


@pytest.mark.skipif(not cpu_has_amx_bf16(), reason="the avx512amx copy needs a CPU with AMX-BF16 (cpuinfo flag amx_bf16)")
@pytest.mark.parametrize("battery,name,target,replacement", SELECTED, ids=[m[1] for m in SELECTED])
def test_amx_backward_mutants_are_caught(tmp_path, battery, name, target, replacement):
    battery.assert_caught(tmp_path, name, target, replacement)


def test_every_mutation_target_exists():
    for battery in (TILES, POLICY):
        battery.assert_targets_exist([m[1:] for m in MUTANTS if m[0] is battery])
