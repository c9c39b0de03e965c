"""Mutants of the cost model (kernel_lab/metal_cost_model.py): each seeds one
fault into a copy of the module, and test_cost_model.py's checks, run
against the copy, must fail. A mutant whose target text is missing fails,
so none can silently test nothing. Pure Python but the prefetch rule's
check, which compiles its static_asserts once per distinct text (about a
minute in all on 2 cores)."""

import importlib.util
import inspect
import sys
from pathlib import Path

import pytest

from kernel_lab import metal_cost_model

import test_cost_model

SOURCE = Path(metal_cost_model.__file__)

MUTANTS = {
    "cache model: every read from DRAM": (
        "total += len(set(order[start:start + wave]))", "total += len(order[start:start + wave])"),
    "latency: prefetch ignored": (
        "latency = kernel.block.load_rounds * gpu.load_latency_cycles / max(1, kernel.prefetch)",
        "latency = kernel.block.load_rounds * gpu.load_latency_cycles"),
    "occupancy: registers never limit": (
        '"registers": gpu.register_file_bytes // max(1, regs * 4 * kernel.threads)', '"registers": 10**9'),
    "spills cost nothing": ('block_issue += 2 * spill * CYCLES["threadgroup_load"]', "block_issue += 0"),
    "precise exp2 as cheap as fast": ('"exp2_precise": 12', '"exp2_precise": 4'),
    "decode: always a merge dispatch": ("merged = single_dispatch and splits == 1", "merged = False"),
    "prefill: P V MMAs not counted": ("mma = tq * tk * td * 2 ", "mma = tq * tk * td "),
    "prefill: row tiles never share a V fragment": (
        "+ (1 if tile.shared_value_fragments else tq) * tk * td", "+ tq * tk * td"),
    "prefill: Q staged beside K and V takes no threadgroup memory": (
        "return (q + 2 * tile.bk * (tile.d + pad)) * elem_bytes", "return 2 * tile.bk * (tile.d + pad) * elem_bytes"),
    "registers: O not counted": ("return o + q_held + rows + FIXED_REGISTERS + max(", "return q_held + rows + FIXED_REGISTERS + max("),
    "registers: the phases summed, not their peak": (
        "return o + q_held + rows + FIXED_REGISTERS + max(staging, scores, values)",
        "return o + q_held + rows + FIXED_REGISTERS + staging + scores + values"),
    "registers: backward dK/dV rows not counted": ("    held = d  # K, V, dK, dV", "    held = 0  # K, V, dK, dV"),
    "backward: D-split dQ without its recomputed scores": (
        "mma = steps * (dt + dvt + gradient_tiles)", "mma = steps * gradient_tiles"),
    "a lone simdgroup issues every cycle": (
        "return mma * MMA_DEPENDENT_LATENCY + (block_issue - mma) * max(1.0, ALU_DEPENDENT_LATENCY / block.ilp)",
        "return block_issue"),
    "independent chains ignored": ("max(1.0, ALU_DEPENDENT_LATENCY / block.ilp)", "ALU_DEPENDENT_LATENCY / 2"),
    "steel WN=2: exchange barriers not counted": ("        barriers += 2\n", "        barriers += 0\n"),
    "decode: registers of the live rows only": (
        "regs = decode_loop_registers(big_r, d,", "regs = decode_loop_registers(r, d,"),
    "decode: prefetch holds no second key": ("2 * per_lane * (2 if prefetch else 1)", "2 * per_lane"),
    "prefetch rule: a core's register file ignored": (
        "limit = min(gpu.register_budget, gpu.register_file_bytes // (4 * 32 * simdgroups))",
        "limit = gpu.register_budget"),
    "paged: the page window's registers not counted": (
        "paged_window_registers(big_r) if paged else 0)", "0)"),
    "paged: the row shape's window as small as the group shape's": (
        "return PAGED_ROW_WINDOW_ROUNDS if rows_per_threadgroup == 1 else PAGED_GROUP_WINDOW_ROUNDS",
        "return PAGED_GROUP_WINDOW_ROUNDS"),
    "paged: the page lookup costs nothing": (
        '+ (3 if paged else 0), "exp2": 2 * r,\n                  "simd_shuffle": 5 * r + (1 if paged else 0)',
        '+ 0, "exp2": 2 * r,\n                  "simd_shuffle": 5 * r + 0'),
    "decode: row chunks read K/V from DRAM each": ("order = [(b, y // chunks, x)", "order = [(b, y, x)"),
    "merge: split stats read one split at a time": (
        "stat_rounds = 2 * math.ceil(own_splits / 32)", "stat_rounds = 2 * own_splits"),
    "merge: every split on one simdgroup's chain": ("own_splits = math.ceil(splits / nsg)", "own_splits = splits"),
    "merge: one simdgroup per row": ('Kernel("attention_decode_merge", batch * heads, 32 * nsg,',
                                     'Kernel("attention_decode_merge", batch * heads, 32,'),
    "merge: the simdgroup combine's threadgroup memory not counted": ("(nsg - 1) * (d + 2) * 4, own_splits,",
                                                                      "0, own_splits,"),
}


def mutant_module(find: str, replace: str):
    text = SOURCE.read_text()
    assert text.count(find) == 1, f"mutation target not found exactly once: {find!r}"
    spec = importlib.util.spec_from_loader("metal_cost_model_mutant", loader=None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    exec(compile(text.replace(find, replace), str(SOURCE), "exec"), module.__dict__)
    return module


def checks():
    for name, fn in inspect.getmembers(test_cost_model, inspect.isfunction):
        if name.startswith("test_"):
            marks = getattr(fn, "pytestmark", [])
            params = [m for m in marks if m.name == "parametrize"]
            if params:
                argname, values = params[0].args
                for value in values:
                    yield name, (lambda fn=fn, argname=argname, value=value: fn(**{argname: value}))
            else:
                yield name, fn


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_cost_model_checks_kill_the_mutant(mutant, monkeypatch):
    monkeypatch.setattr(test_cost_model, "cm", mutant_module(*MUTANTS[mutant]))
    failed = []
    for name, check in checks():
        try:
            check()
        except AssertionError:
            failed.append(name)
    assert failed, f"mutant survived: {mutant}"
