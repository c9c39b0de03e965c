"""The cost model (kernel_lab/metal_cost_model.py): its mechanics against
hand-computed values from the published limits it states, and the model
against outside truth: MLX's own tile tuning and a public throughput figure.
Pure Python: no emulator run (the model's counts are checked against the
emulator's counters by kernel_lab/emulated_costs.py, benchmarks/bench_metal.py --emulate)."""

import functools
import math
import tempfile
from pathlib import Path

import pytest

from kernel_lab import metal_cost_model as cm


def cost_checks():
    """kernel_lab.cost_checks, which reads our launch plans through the
    extension: the test skips where it is not built."""
    from mlx_attn import _native

    if _native.ext is None:
        pytest.skip("needs mlx_attn's extension (the launch plans)")
    from kernel_lab import cost_checks

    return cost_checks


def test_residency_follows_the_register_file_and_threadgroup_memory():
    gpu = cm.M2_MAX
    base = cm.Kernel("k", 1000, 128, 64, 4096, 10, cm.Block({"fma": 10}), 0.0, 0.0, 0.0)
    # 208 KiB / (64 registers x 4 B x 128 threads) = 6.5 -> 6 threadgroups
    assert cm.residency(base, gpu) == {"threadgroups": 6, "limit": "registers"}
    # 64 KiB / 20 KiB of threadgroup memory = 3.2 -> 3
    assert cm.residency(cm.replace(base, threadgroup_memory=20 * 1024), gpu) == {
        "threadgroups": 3, "limit": "threadgroup memory"}
    # 3072 threads / 1024 = 3
    assert cm.residency(cm.replace(base, threads=1024, registers=8), gpu) == {"threadgroups": 3, "limit": "threads"}


def test_spilling_is_reported_and_costs_time():
    gpu = cm.M2_MAX
    # at the budget and over it: the same residency (a spilling kernel holds the budget), so only
    # the spill traffic tells them apart
    kernel = cm.Kernel("k", 400, 128, gpu.register_budget, 4096, 100, cm.Block({"mma": 8, "fma": 40}), 0.0, 0.0, 0.0)
    fits = cm.predict(kernel, gpu)
    spills = cm.predict(cm.replace(kernel, registers=gpu.register_budget + 40), gpu)
    assert not fits["spills"] and spills["spills"]
    assert spills["seconds"] > fits["seconds"]


def test_cache_model_counts_a_head_once_per_wave():
    gpu = cm.Gpu("two cores", "apple8", 2, 1e9, 1e11)
    # 8 threadgroups, 2 per KV head, 2 resident per core: a wave of 4 holds 2 heads
    assert cm.unique_bytes_per_wave([0, 0, 1, 1, 2, 2, 3, 3], 100.0, 2, gpu) == 400.0
    # one resident per core: waves of 2, still one head each
    assert cm.unique_bytes_per_wave([0, 0, 1, 1, 2, 2, 3, 3], 100.0, 1, gpu) == 400.0
    # interleaved heads split across waves are read again
    assert cm.unique_bytes_per_wave([0, 1, 0, 1], 100.0, 1, gpu) == 400.0


def test_sdpa_vector_same_head_reads_hit_the_cache():
    """MLX's one-pass decode reads a KV head once per query head as issued;
    co-resident threadgroups of one GQA group read it from DRAM once."""
    gpu = cm.M2_MAX
    (kernel,) = cm.sdpa_vector_kernels(1, 32, 8, 1024, 128, gpu, two_pass=False)
    kv_bytes = 8 * 2 * 1024 * 128 * 2
    assert kernel.device_bytes == pytest.approx(4 * kv_bytes)
    assert kernel.dram_bytes == pytest.approx(kv_bytes + 32 * 128 * 2 * 2)


def test_prefetch_shortens_a_latency_bound_decode():
    gpu = cm.M2_MAX
    one = cm.predict_all(cm.our_decode_kernels(1, 4, 1, 4096, 128, gpu, 2, 8), gpu)
    two = cm.predict_all(cm.our_decode_kernels(1, 4, 1, 4096, 128, gpu, 2, 8, prefetch=2), gpu)
    assert one["bound"] == "latency"
    assert two["seconds"] < one["seconds"]


def test_one_dispatch_at_one_split_saves_the_merge():
    gpu = cm.M2
    two = cm.our_decode_kernels(1, 32, 8, 256, 128, gpu, 1, 8)
    one = cm.our_decode_kernels(1, 32, 8, 256, 128, gpu, 1, 8, single_dispatch=True)
    assert (len(two), len(one)) == (2, 1)
    assert cm.predict_all(one, gpu)["seconds"] < cm.predict_all(two, gpu)["seconds"]


def test_fast_exp2_is_cheaper_than_precise():
    gpu = cm.M2_MAX
    kernel = cm.prefill_kernel("ours", cm.our_prefill_tile(64, 32, "fast"), 1, 8, 8, 1024, 1024, False, gpu)
    assert cm.predict(kernel, gpu, "fast")["seconds"] < cm.predict(kernel, gpu, "precise")["seconds"]


@pytest.mark.parametrize("d", [64, 128])
def test_mlx_steel_tiles_are_near_the_models_best(d):
    """Truth from outside: MLX tuned steel's tiles on hardware. The model
    must not call them bad: within 10% of the best tile it finds among every
    tile steel compiles for. (It does not rank them first at D = 128, where
    it prefers larger key blocks by a few percent: docs/emulator_costs.md
    gives the ranks and what the model lacks to tell them apart.)"""
    gpu = cm.M2_MAX
    times = {}
    for tile in cm.steel_alternatives(d, gpu=gpu):
        kernel = cm.prefill_kernel("steel", tile, 1, 32, 32, 2048, 2048, False, gpu)
        times[(tile.bq, tile.bk, tile.wm, tile.wn)] = cm.predict(kernel, gpu)["seconds"]
    mlx = cm.mlx_steel_tile(d)
    mlx_time = times[(mlx.bq, mlx.bk, mlx.wm, mlx.wn)]
    assert mlx_time <= 1.10 * min(times.values())
    # and the model does tell tiles apart: the worst is clearly slower
    assert max(times.values()) >= 1.1 * min(times.values())


def test_steel_throughput_lands_near_the_public_figure():
    """MLX's fused prefill, D = 64, fp16, M3 Max: ~11.7 TFLOP/s by a public
    benchmark. The model must land within 1.5x of it and below the peak."""
    gpu = cm.M3_MAX
    t, heads = 4096, 32
    kernel = cm.prefill_kernel("steel", cm.mlx_steel_tile(64), 1, heads, heads, t, t, False, gpu)
    tflops = 4.0 * heads * t * t * 64 / cm.predict(kernel, gpu)["seconds"] / 1e12
    assert 11.7 / 1.5 <= tflops <= 11.7 * 1.5
    assert tflops < gpu.peak_flops / 1e12


def test_register_estimate_follows_the_tiles():
    """Peak live values: O and Q (held in registers) grow with D, S and the
    step's K fragments with BK; the phases' values are not summed."""
    small = cm.steel_registers(cm.our_prefill_tile(64, 32, "fast"))
    wide = cm.steel_registers(cm.our_prefill_tile(128, 32, "fast"))
    assert wide - small == 2 * 2 * (128 - 64) // 8  # O and Q: 8 more float fragments of 2
    deep = cm.steel_registers(cm.our_prefill_tile(64, 64, "fast"))
    # BK 32 -> 64: S and the K fragments of the score phase, 8 more of each (the largest phase)
    assert deep - small == 8 + 8
    # hand count, ours at D = 64, BK = 32: O 16 + Q 16 + rows 3 + 20 fixed + score phase (S 8 + K 8)
    assert small == 16 + 16 + 3 + cm.FIXED_REGISTERS + 16
    # the D = 256 case: Q and O alone are 128 floats per lane, over the budget
    assert cm.steel_registers(cm.our_prefill_tile(256, 8, "fast")) > cm.M2_MAX.register_budget


def test_every_kernel_the_plans_pick_is_within_the_register_budget():
    """Issue #23: no supported variant above the budget. The table walks the
    launch plans (forward decode and prefill, backward, quantized, paged) of
    every head-dim pair, so a routing change that picks a spilling kernel
    fails here."""
    checks = cost_checks()
    rows = checks.register_table()
    kinds = {kind for kind, _, _, _ in rows}
    assert {"prefill", "prefill (D-split)", "decode", "backward dkdv", "backward dq", "backward dkdv (D-split)",
            "backward dq (D-split)", "quantized prefill (4-bit)", "quantized decode (8-bit)", "paged decode",
            "paged quantized decode (4-bit)", "paged prefill", "decode_merge"} <= kinds
    over = [row for row in rows if row[3] > cm.M2_MAX.register_budget]
    assert over == []
    # the register-resident kernels the plans route away from are over it
    assert cm.steel_registers(cm.our_prefill_tile(256, 8, "fast")) > cm.M2_MAX.register_budget
    assert cm.backward_dkdv_registers(128) > cm.M2_MAX.register_budget


def test_a_kernel_without_a_register_estimate_is_an_error():
    checks = cost_checks()
    with pytest.raises(ValueError, match="no register estimate"):
        checks.kernel_registers("attention_brand_new_float16_d64")


def test_the_backward_routing_at_d128_is_the_models_choice():
    """D = 128: the D-split dK/dV (72 registers) is predicted faster than the
    register-resident one it replaced (156: spills); the register-resident
    dQ (126) faster than a D-split dQ, which recomputes S and dP per chunk."""
    gpu = cm.M2_MAX

    def seconds(split_keys, split_queries):
        kernels = cm.backward_kernels(128, 128, 2048, 2048, 32, 32, False, gpu, split_keys, split_queries)
        return [cm.predict(k, gpu)["seconds"] for k in kernels[1:]]

    (split_dkdv, resident_dq), (resident_dkdv, _), (_, split_dq) = seconds(True, False), seconds(False, False), \
        seconds(True, True)
    assert split_dkdv < resident_dkdv
    assert resident_dq < split_dq
    assert cm.backward_dq_registers(128) <= gpu.register_budget < cm.backward_dkdv_registers(128)


def test_a_lone_simdgroup_waits_for_its_dependent_instructions():
    """Turner's measurements: one simdgroup per scheduler issues FFMA32 once
    per ~11 cycles at ILP 1, so an ALU block of few simdgroups is bound by
    its dependency chains; independent chains (ILP) or more simdgroups on
    the core hide them. MMA steps have independent accumulators: no stall."""
    gpu = cm.M2_MAX
    alu = cm.Kernel("k", gpu.cores, 128, 32, 0, 100, cm.Block({"fma": 100}, load_rounds=0), 0.0, 0.0, 0.0)
    lone = cm.predict(alu, gpu)
    assert lone["bound"] == "latency"
    # 100 blocks of 100 FMAs, each 11.34 / 2 cycles apart (ILP 2), against 100 cycles of issue a block
    assert lone["core_seconds"] * gpu.clock_hz == pytest.approx(100 * 100 * 11.34 / 2, rel=0.01)
    wide = cm.predict(cm.replace(alu, block=cm.Block({"fma": 100}, load_rounds=0, ilp=8)), gpu)
    assert wide["seconds"] < lone["seconds"]
    crowded = cm.predict(cm.replace(alu, threads=1024, threadgroups=3 * gpu.cores), gpu)  # 96 simdgroups per core
    assert crowded["bound"] == "issue"
    mma = cm.predict(cm.replace(alu, block=cm.Block({"mma": 100}, load_rounds=0)), gpu)
    assert mma["core_seconds"] * gpu.clock_hz == pytest.approx(100 * 100 * cm.CYCLES["mma"], rel=0.01)


def test_steel_wn2_pays_the_score_exchange():
    """steel_attention.h with WN = 2: each simdgroup stores its half-D
    partial S and reads its peer's, behind two more barriers a block."""
    gpu = cm.M2_MAX
    one = cm.prefill_kernel("s", cm.PrefillTile(32, 32, 128, 4, 1), 1, 8, 8, 1024, 1024, False, gpu)
    two = cm.prefill_kernel("s", cm.PrefillTile(64, 32, 128, 8, 2), 1, 8, 8, 1024, 1024, False, gpu)
    assert (one.block.barriers, two.block.barriers) == (4, 6)
    elems = 2 * 1 * 4  # S elements per lane: TQ = 1, BK / 8 = 4 tiles of 2
    # over its half of D (TD/2 = 8 steps): one Q fragment a step (TQ = 1), TK = 4 K fragments a step,
    # and TK V fragments a step
    q_reads, k_reads, v_reads = 1 * 8, 4 * 8, 4 * 8
    assert two.block.counts["threadgroup_load"] == q_reads + k_reads + v_reads + 2 * elems


def test_decode_registers_are_the_compiled_rows_and_prefetch_adds_a_key():
    """DecodeRows<R, SLICE> holds R rows whatever the GQA group: D = 128,
    R = 8, a group of 4 takes the registers of 8 rows; the prefetch holds a
    second key's K/V slices (2 x D/32)."""
    gpu = cm.M2_MAX
    (four, _) = cm.our_decode_kernels(1, 4, 1, 4096, 128, gpu, 4, 8)
    (eight, _) = cm.our_decode_kernels(1, 8, 1, 4096, 128, gpu, 4, 8)
    (ahead, _) = cm.our_decode_kernels(1, 8, 1, 4096, 128, gpu, 4, 8, prefetch=2)
    assert four.registers == eight.registers == 2 * 8 * 4 + 2 * 8 + 2 * 4 + 20
    assert ahead.registers == eight.registers + 2 * 4
    assert four.threadgroup_memory == eight.threadgroup_memory == 3 * 8 * (128 + 2) * 4


def test_decode_row_chunks_of_a_head_share_its_kv_in_the_cache():
    """GQA 32 at D = 128: 4 row chunks per KV head read the same split of
    its K/V, resident together: DRAM reads it about once."""
    gpu = cm.M2_MAX
    (partial, _) = cm.our_decode_kernels(1, 32, 1, 4096, 128, gpu, 8, 8)
    kv_bytes = 2 * 4096 * 128 * 2
    assert partial.device_bytes > 4 * kv_bytes
    assert kv_bytes <= partial.dram_bytes < 1.2 * kv_bytes


def test_the_lane_merge_reads_splits_in_parallel():
    """The lane merge on one simdgroup (before the multi-simdgroup merge)
    reads the splits' max and sum across the lanes and loads the next
    split's slice ahead: with many splits it is faster than the merge that
    waited for each split in turn."""
    gpu = cm.M2_MAX
    old = cm.our_decode_kernels(1, 32, 8, 8192, 128, gpu, 38, 8)[1]
    lanes = cm.our_decode_kernels(1, 32, 8, 8192, 128, gpu, 38, 8, lane_merge=True, merge_simdgroups=1)[1]
    assert lanes.prefetch == 2 and lanes.fixed_load_rounds == 2 * 2  # max and sum, 2 rounds of 32 splits
    assert (lanes.threads, lanes.blocks, lanes.threadgroup_memory) == (32, 38, 0)
    assert cm.predict(lanes, gpu)["seconds"] < cm.predict(old, gpu)["seconds"]


def test_the_merge_shares_a_rows_splits_among_simdgroups():
    """merge_splits on MERGE_SIMDGROUPS simdgroups per row: simdgroup g takes
    splits g, g + 8, ..., so 38 splits are a chain of 5 slice loads (not 38)
    and one round of max and sum; the states meet in threadgroup memory
    (7 simdgroups' output slice, max and sum). Faster than one simdgroup
    walking every split wherever there are more splits than one simdgroup's
    latency hides (issue #23's M2 Max problems), and within MLX's second
    pass (sdpa_vector_2pass_2, 1024 threads per head) x 1.1."""
    gpu = cm.M2_MAX
    assert cm.MERGE_SIMDGROUPS == 8  # MLX_ATTN_DECODE_MERGE_SIMDGROUPS
    merge = cm.our_decode_kernels(1, 32, 8, 8192, 128, gpu, 38, 8, lane_merge=True)[1]
    assert (merge.threads, merge.blocks, merge.fixed_load_rounds) == (256, 5, 2)
    assert merge.threadgroup_memory == 7 * (128 + 2) * 4
    for kv_len, group, splits in ((4096, 4, 38), (1024, 4, 16), (1024, 8, 8), (8192, 8, 38)):
        args = (1, 8 * group, 8, kv_len, 128, gpu, splits, 8)
        now = cm.predict(cm.our_decode_kernels(*args, lane_merge=True)[1], gpu)["seconds"]
        before = cm.predict(cm.our_decode_kernels(*args, lane_merge=True, merge_simdgroups=1)[1], gpu)["seconds"]
        mlx = cm.predict(cm.sdpa_vector_kernels(1, 8 * group, 8, kv_len, 128, gpu, True, 64)[1], gpu)["seconds"]
        assert now < before and now <= 1.1 * mlx, (kv_len, group, now, before, mlx)


def test_quantized_decode_reads_the_triples_bytes_and_merges_only_with_splits():
    """The quantized decode's K/V bytes: bits / 8 plus a 2-byte scale and bias
    per group of 64 per element (what the emulator's counting build measures,
    docs/metal_kernels.md: 0.5625 at 4 bits, 1.0625 at 8), everything else as
    the float decode's; one dispatch at one split, partial + merge otherwise."""
    gpu = cm.M2_MAX
    args = (1, 32, 8, 1024, 128, gpu, 4, 8)  # 4 splits, 8 rows per threadgroup
    (fp16, _) = cm.our_decode_kernels(*args, prefetch=2, lane_merge=True)
    for bits, per_element in ((4, 0.5625), (8, 1.0625)):
        (quantized, _) = cm.our_quantized_decode_kernels(*args, bits, 64, prefetch=2)
        kv_fp16, kv_quantized = 8 * 2 * 1024 * 128 * 2, 8 * 2 * 1024 * 128 * per_element
        assert quantized.device_bytes == pytest.approx(fp16.device_bytes - kv_fp16 + kv_quantized)
        assert quantized.dram_bytes == pytest.approx(fp16.dram_bytes - kv_fp16 + kv_quantized)
    one = cm.our_quantized_decode_kernels(1, 32, 8, 64, 128, gpu, 1, 8, 4, 64, single_dispatch=True)
    two = cm.our_quantized_decode_kernels(1, 32, 8, 64, 128, gpu, 1, 8, 4, 64, single_dispatch=False)
    assert [len(one), len(two)] == [1, 2]
    assert cm.predict_all(one, gpu)["seconds"] < cm.predict_all(two, gpu)["seconds"]
    several = cm.our_quantized_decode_kernels(1, 32, 8, 1024, 128, gpu, 4, 8, 4, 64, single_dispatch=True)
    assert len(several) == 2  # the merge stays with several splits


def test_a_threadgroup_that_does_not_fit_the_register_file_is_an_error():
    """16 decode simdgroups at 116 registers (512 x 116 x 4 B = 232 KiB)
    exceed a core's 208 KiB: Metal would not launch them, so the model must
    not predict a time for them (it once counted one resident threadgroup)."""
    gpu = cm.M2_MAX
    fits = cm.our_decode_kernels(1, 32, 8, 1024, 128, gpu, 4, 8, simdgroups=8, prefetch=2)
    assert cm.predict_all(fits, gpu)["seconds"] > 0
    assert fits[0].registers == 116 and 116 * 4 * 16 * 32 > gpu.register_file_bytes
    with pytest.raises(ValueError, match="512 threads x 116 registers do not fit a core's 208 KiB register file"):
        cm.predict_all(cm.our_decode_kernels(1, 32, 8, 1024, 128, gpu, 4, 8, simdgroups=16, prefetch=2), gpu)


def test_the_row_shape_fits_its_threads_and_keeps_a_short_chain():
    """The row shape (one row, 32 simdgroups at D = 128): q, o, m, l of one
    row, the current and next key's slices and ~20 of state fit 1024
    threads in a core's 208 KB; its combine hands 31 simdgroups' states over.
    On issue #23's case (M2 Max, Hkv 8, GQA 4, 1024 keys) it runs each
    simdgroup's 32 keys in one dispatch where the group shape needs 16
    splits and a merge: faster, and at sdpa_vector's one pass (the same
    structure)."""
    gpu = cm.M2_MAX
    kernels = cm.our_decode_kernels(1, 32, 8, 1024, 128, gpu, 1, 1, simdgroups=32, prefetch=2,
                                    single_dispatch=True, lane_merge=True)
    assert len(kernels) == 1  # one split: no merge dispatch
    row = kernels[0]
    assert row.registers == 2 * 4 + 2 + 2 * 2 * 4 + cm.FIXED_REGISTERS
    assert row.registers * 4 * 1024 <= gpu.register_file_bytes
    assert (row.threads, row.threadgroups, row.blocks) == (1024, 32, 1024 // 32)
    assert row.threadgroup_memory == 31 * (128 + 2) * 4
    group = cm.our_decode_kernels(1, 32, 8, 1024, 128, gpu, 16, 8, prefetch=2, single_dispatch=True,
                                  lane_merge=True)
    assert len(group) == 2
    row_seconds = cm.predict_all(kernels, gpu)["seconds"]
    mlx = cm.predict_all(cm.sdpa_vector_kernels(1, 32, 8, 1024, 128, gpu, False), gpu)["seconds"]
    assert row_seconds < 0.8 * cm.predict_all(group, gpu)["seconds"]
    assert row_seconds <= 1.01 * mlx
    # at D = 256 the row shape's 70 registers do not fit 1024 threads: 16 simdgroups
    with pytest.raises(ValueError, match="do not fit"):
        cm.our_decode_kernels(1, 4, 1, 1024, 256, gpu, 1, 1, simdgroups=32, prefetch=2)
    cm.our_decode_kernels(1, 4, 1, 1024, 256, gpu, 1, 1, simdgroups=16, prefetch=2)


def test_the_decode_rule_is_near_the_models_best_and_at_sdpa_vector():
    """Issue #23's decode target by the model: over the rule's grid (D 64 /
    128, Hkv 1-32, GQA 1-8, 256-16384 keys, M2 and M2 Max) the plan's shape
    and split count are within 1.1x the best per problem (geometric mean)
    and at most sdpa_vector's time; the group shape alone was over both."""
    checks = cost_checks()
    check = checks.decode_rule_check()
    assert check["now"]["problems"] == 192
    assert check["now"]["geomean"] <= 1.1 and check["now"]["mlx_geomean"] <= 1.0
    assert check["group"]["geomean"] > 1.2 and check["group"]["mlx_geomean"] > 1.1
    assert check["now"]["max"] < check["group"]["max"] < check["before"]["max"]


def test_the_paged_row_shape_reaches_sdpa_vector_where_the_group_shape_did_not():
    """The paged decode on float pages (the dense decode's body plus a page
    lookup per key and a 4-entry page window a lane): with the plan's shape
    choice (the dense rule, splits capped at 127 pages) small batches take
    the row shape in one split and reach sdpa_vector on the same keys
    contiguous (within 5%), where the group shape alone was 1.35-2.9x; no
    problem gets slower than before."""
    assert cm.paged_window_registers(1) == 4 and cm.paged_window_registers(8) == 1
    checks = cost_checks()
    rows = checks.paged_decode_rows()
    for r in rows:
        assert r["now"]["us"] <= r["before"]["us"] * 1.001, r
    small = [r for r in rows if (r["B"], r["Hkv"], r["T"]) in ((1, 8, 128), (1, 8, 1024))]
    assert len(small) == 3
    for r in small:
        assert (r["now"]["rows"], r["now"]["simdgroups"], r["now"]["splits"]) == (1, 32, 1), r
        assert r["before"]["us"] > 1.3 * r["mlx_us"] and r["now"]["us"] <= 1.05 * r["mlx_us"], r
    # the page lookup is counted: per key PageWindow::page_of's simd_shuffle and
    # the slot's divide, modulo and multiply-add; the paged kernel is no
    # faster than the dense one on the same split
    gpu = cm.M2_MAX
    kernels = {flag: cm.our_decode_kernels(1, 32, 8, 128, 128, gpu, 1, 1, simdgroups=32, prefetch=2,
                                           single_dispatch=True, lane_merge=True, paged=flag) for flag in (False, True)}
    dense_key, paged_key = (kernels[flag][0].block.counts for flag in (False, True))
    assert paged_key["simd_shuffle"] == dense_key["simd_shuffle"] + 1 and paged_key["fma"] == dense_key["fma"] + 3
    dense, paged = (cm.predict_all(kernels[flag], gpu) for flag in (False, True))
    assert paged["seconds"] > dense["seconds"] and paged["registers"] == dense["registers"] + 4  # 4 entries a lane


SHAPES = {64: ((8, 4), (1, 32)), 96: ((8, 4), (1, 32)), 128: ((8, 4), (1, 32)), 256: ((4, 4), (1, 16)),
          512: ((2, 4), (1, 16))}


def test_the_kernels_prefetch_rule_is_the_models():
    """DecodePrefetch (metal/attention_decode.h) and the model's
    decode_prefetch are one rule written in two languages: for every decode
    kernel (shapes x float, quantized, paged, paged quantized loaders) the
    Metal side's compile-time answer equals the model's, checked by
    static_asserts the emulator's compiler evaluates. (A prefetch changes
    no result, so only this ties the kernel to the model.)"""
    from kernel_lab import msl_emulator

    if not msl_emulator.clang_available():
        pytest.skip("clang-19 is not installed")
    repo = Path(__file__).resolve().parent.parent
    lines = ['#include "metal/attention_paged.h"', '#include "metal/attention_quantized.h"', ""]
    answers = set()
    for d, shapes in SHAPES.items():
        for rows, simdgroups in shapes:
            rounds = cm.paged_window_registers(rows)
            loaders = {"ContiguousKV<half, %d>" % d: 0, f"PagedKV<ContiguousKV<half, {d}>, {rounds}>": rounds}
            if d % 64 == 0:
                loaders[f"QuantizedKV<half, {d}, 4>"] = cm.QUANTIZED_LOADER_REGISTERS
                loaders[f"PagedKV<QuantizedKV<half, {d}, 4>, {rounds}>"] = cm.QUANTIZED_LOADER_REGISTERS + rounds
            for loader, registers in loaders.items():
                model = cm.decode_prefetch(rows, simdgroups, d, registers) > 1
                answers.add(model)
                lines.append(f"static_assert(DecodePrefetch<{rows}, {simdgroups}, {loader}>::ENABLED == "
                             f"{'true' if model else 'false'}, \"D {d} R {rows} NSG {simdgroups} {loader}\");")
    assert answers == {True, False}  # both answers occur (D = 512 and the paged quantized row shape: no prefetch)
    lines.append("[[kernel]] void prefetch_rule_probe(device float* out [[buffer(0)]]) { out[0] = 1.0f; }")
    error = _compile_error("\n".join(lines) + "\n", repo)
    assert error is None, f"the Metal prefetch rule differs from the model's: {error}"


@functools.lru_cache(maxsize=None)
def _compile_error(text: str, repo: Path) -> str | None:
    """The emulator's compile error for a Metal source, None when it builds;
    once per text (test_cost_model_mutations runs the checks per mutant, and
    calls them bare: no fixtures)."""
    from kernel_lab import msl_emulator

    with tempfile.TemporaryDirectory() as directory:
        source = Path(directory) / "prefetch_rule.metal"
        source.write_text(text)
        try:
            msl_emulator.compile_library([source], include_dirs=[repo])
        except Exception as error:  # a static_assert that fails is a compile error
            return str(error)
    return None


def test_the_quantized_rule_beats_the_float_rule_over_dequantized_keys():
    """The quantized decodes take the float rule over dequantized keys: a
    quarter of the keys per split and at most one wave of row-shape splits
    (issue-bound on them), and one row per KV head on the row shape (the group
    shape would share no dequantization). By the model over the rule's grid
    on 4-bit K/V it is nearer the best shape and split count than the same
    rule with the float splits, and that nearer than the float rule, on
    average and in the worst case; within 1.1x of the best on average, and
    below sdpa_vector on the dequantized fp16 K/V on average."""
    checks = cost_checks()
    check = checks.quantized_rule_check()
    now, float_splits, float_rule = check["now"], check["float splits"], check["float rule"]
    assert now["problems"] == 192
    assert now["geomean"] < float_splits["geomean"] < float_rule["geomean"]
    assert now["max"] < float_splits["max"] < float_rule["max"]
    assert now["geomean"] < 1.1 and now["mlx_geomean"] < 1.0


def test_the_prefill_structure_search_holds_todays_kernel():
    """cost_checks.prefill_structure_floor searches the tiles of our prefill
    structure within the budget for issue #23's prefill problems; today's
    tile is one of them, so the search's best is at or below it, and the
    best tile is within the register budget."""
    checks = cost_checks()
    rows = checks.prefill_structure_floor()
    assert [(r["D"], r["causal"]) for r in rows] == [(64, False), (64, True), (128, False), (128, True)]
    for r in rows:
        assert 0.79 < r["floor"] <= r["now"] < 1.0, r  # the MMAs alone are 0.79-0.80x steel's block
        assert r["registers"] <= cm.M2_MAX.register_budget


def test_row_tiles_share_value_fragments_and_staged_queries_take_memory():
    """Two 8-row tiles per simdgroup (BQ 64 on 4 simdgroups, D 64, BK 16,
    Q in threadgroup memory): per block a simdgroup reads TQ x TD = 16 Q
    fragments and TK x TD = 16 K fragments; its V fragments are 16 when the
    row tiles share them, 32 when each reads its own (steel's loop). Q staged
    beside K and V: (64 + 2 x 16) rows of 64 + 8 halves."""
    shared = cm.PrefillTile(64, 16, 64, 4, q_in_registers=False, stage_kv_together=True, shared_value_fragments=True)
    own = cm.PrefillTile(64, 16, 64, 4, q_in_registers=False, stage_kv_together=True)

    def fragment_reads(tile):
        return cm.prefill_kernel("x", tile, 1, 1, 1, 64, 64, False, cm.M2_MAX).block.counts["threadgroup_load"]

    assert (fragment_reads(shared), fragment_reads(own)) == (48, 64)
    assert cm.steel_threadgroup_memory(shared) == (64 + 2 * 16) * (64 + 8) * 2
