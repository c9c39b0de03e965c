"""A cost model of attention kernels on Apple GPUs: registers, occupancy,
instruction mix, a cache model and load latency -> predicted time.

The emulator (kernel_lab/msl_emulator) counts what the kernels do; it cannot say
how fast a GPU does it. This module predicts a time from each kernel's
structure (its tile sizes and loop, read from the kernel source, and checked
against the emulator's counters by benchmarks/bench_metal.py --emulate) and a
few published or stated figures of the GPU. Every number that is not
published is marked ASSUMED below and in docs/emulator_costs.md; nothing here
was measured on an Apple GPU (this project has none).

The model, per kernel (one dispatch):

* registers per thread: the live values of the kernel's inner loop, counted
  from its tiles (``*_registers`` below), in 32-bit registers; a 2-byte value
  takes half of one. Above ``Gpu.register_budget`` the kernel spills.
* occupancy: threadgroups resident per core = the smallest of what the
  register file, the threadgroup memory and the thread limit of a core allow.
* instruction classes per key block per simdgroup (``Block``): MMAs, FMA-class
  ALU, exp2 (fast or precise), simd shuffles/reductions, threadgroup loads,
  device load instructions; their pipe cycles (``CYCLES``) give a block's
  issue time on one SIMD pipe.
* latency: a block waits for its device loads (``Gpu.load_latency_cycles``,
  one round per ``Block.load_rounds``, overlapped ``prefetch`` deep) and its
  barriers. A core runs its resident threadgroups side by side: a block
  period is the longer of one threadgroup's chain (latency + issue) and the
  issue time of every resident simdgroup sharing the core's 4 pipes.
* cache model: threadgroups resident at the same time (a wave) that read the
  same K/V head read it from DRAM once (L2/SLC hits after the first); DRAM
  bytes = unique bytes per wave, summed over waves.
* time = max(per-core time, DRAM bytes / bandwidth, threadgroup bytes per core /
  threadgroup bandwidth) + a fixed cost per dispatch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace


# ---------------------------------------------------------------- the GPU
@dataclass(frozen=True)
class Gpu:
    name: str
    family: str                      # the launch plan's family for this GPU
    cores: int
    clock_hz: float
    dram_bytes_per_s: float
    pipes: int = 4                   # SIMD pipes (schedulers) per core, 32 lanes each (Turner: 128 ALUs per core)
    register_file_bytes: int = 208 * 1024   # per core: Turner's metal-benchmarks figure for Apple7/8
    register_budget: int = 128       # ASSUMED: 32-bit registers a thread may hold before the compiler spills
    threadgroup_memory_per_core: int = 64 * 1024  # Turner (Apple7/8): 64 KB shared memory per core
    max_threads_per_core: int = 3072  # Turner: 384-3072 resident threads per core
    max_threads_per_threadgroup: int = 1024  # Apple's Metal feature set tables
    max_threadgroup_memory: int = 32 * 1024  # per threadgroup, Apple's feature set tables
    threadgroup_bytes_per_cycle: int = 128   # ASSUMED per core (not published)
    load_latency_cycles: int = 300   # ASSUMED: a device load that hits L2/SLC (DRAM misses are bandwidth-bound)
    barrier_cycles: int = 30         # ASSUMED: a threadgroup barrier's release latency
    dispatch_seconds: float = 4e-6   # ASSUMED: one more dispatch (encode, launch, drain) in a command buffer

    @property
    def peak_flops(self) -> float:
        return self.cores * self.pipes * 32 * 2 * self.clock_hz  # FMA = 2 FLOP, FP16 at the FP32 rate


# Published figures: core counts and bandwidth (Apple); clock (Turner's
# metal-benchmarks GPU table: 1.398 GHz for M2 and M3 generation parts).
M2 = Gpu("Apple M2, 10-core GPU", "apple8", 10, 1.398e9, 100e9)
M2_MAX = Gpu("Apple M2 Max, 38-core GPU", "apple8", 38, 1.398e9, 400e9)
M3_MAX = Gpu("Apple M3 Max, 40-core GPU", "apple9", 40, 1.398e9, 400e9)
GPUS = {"m2": M2, "m2max": M2_MAX, "m3max": M3_MAX}

# Pipe cycles per simdgroup instruction (one SIMD pipe, 32 lanes).
CYCLES = {
    "mma": 16,            # an 8x8x8 multiply-accumulate: 512 FMAs over 32 lanes at one FMA per lane per cycle
    "fma": 1,             # FMA-class float/int op (Turner: 1 cycle throughput)
    "exp2_fast": 4,       # ASSUMED: fast::exp2, one transcendental at quarter rate
    "exp2_precise": 12,   # ASSUMED: precise exp2 (Safe math): range reduction + polynomial, ~8 more ALU ops
    "simd_shuffle": 2,    # ASSUMED
    "threadgroup_load": 2,  # ASSUMED: a lane's 8-16 B threadgroup read (an 8x8 fragment load)
    "device_load": 1,     # issue only; the latency is the load term
}


# ---------------------------------------------------------------- a kernel
@dataclass(frozen=True)
class Block:
    """One key block (or key) of one simdgroup's loop: instruction counts by
    class (simdgroup instructions), dependent device-load rounds, barriers."""

    counts: dict
    load_rounds: float = 1.0
    barriers: int = 0
    ilp: float = 2.0  # independent chains of its ALU instructions (dependent_issue_cycles)


@dataclass(frozen=True)
class Kernel:
    name: str
    threadgroups: int
    threads: int                    # per threadgroup
    registers: int                  # per thread, 32-bit
    threadgroup_memory: int         # per threadgroup, bytes
    blocks: int                     # loop iterations per simdgroup (the longest threadgroup's)
    block: Block
    threadgroup_bytes_per_block: float  # whole threadgroup, threadgroup memory read + written
    device_bytes: float             # as issued (every threadgroup's reads + writes)
    dram_bytes: float               # after the cache model
    prefetch: int = 1               # device loads in flight per simdgroup (1: none ahead)
    fixed: dict = field(default_factory=dict)  # per simdgroup, outside the loop (prologue / epilogue)
    fixed_load_rounds: int = 1      # dependent device-load rounds of `fixed`
    kv_reads: list = field(default_factory=list)  # (threadgroup index order -> KV head) for the cache model

    @property
    def simdgroups(self) -> int:
        return max(1, self.threads // 32)


def issue_cycles(counts: dict, exp_kind: str = "fast") -> float:
    total = 0.0
    for key, n in counts.items():
        cost = CYCLES["exp2_" + exp_kind] if key == "exp2" else CYCLES[key]
        total += cost * n
    return total


# A simdgroup alone on a scheduler cannot issue every cycle: an instruction
# waits for the one it depends on. Turner's metal-benchmarks (README, "ALU
# Bottlenecks", M1): FFMA32 at ILP 1 and one simdgroup per scheduler (4 per
# core) issues once per 11.34 cycles, at ILP 4 once per 2.75, and "ALU
# utilization maxes out at 24 simds/core" (6 per scheduler); an 8x8 simdgroup
# MMA has a throughput of ~17 cycles and a latency of ~34 ("Intra-simd
# communication", MATMUL<8x8xF16>). So one simdgroup's block takes its issue
# cycles times latency / (throughput x independent instruction chains,
# Block.ilp): the ALU classes' ~11 cycles over the block's chains (2 by
# default, ASSUMED: 11 / 2 ~ 24 simds/core / 4 schedulers; a decode
# threadgroup's rows are independent chains), the MMAs' 34 / 17 over the
# >= 2 independent accumulator tiles every attention MMA step has (S tiles
# along the keys, O tiles along D): no stall. Other simdgroups on the
# scheduler fill the gaps (predict's period: the longer of this chain and
# the shared issue).
ALU_DEPENDENT_LATENCY = 11.34
MMA_DEPENDENT_LATENCY = 1.0


def dependent_issue_cycles(block: "Block", exp_kind: str, block_issue: float) -> float:
    """Cycles one simdgroup alone needs for a block's instructions."""
    mma = CYCLES["mma"] * block.counts.get("mma", 0)
    return mma * MMA_DEPENDENT_LATENCY + (block_issue - mma) * max(1.0, ALU_DEPENDENT_LATENCY / block.ilp)


def residency(kernel: Kernel, gpu: Gpu) -> dict:
    """Threadgroups resident per core and what limits them."""
    regs = min(kernel.registers, gpu.register_budget)  # a spilling kernel holds the budget
    if regs * 4 * kernel.threads > gpu.register_file_bytes:
        # Metal lowers such a pipeline's maxTotalThreadsPerThreadgroup: the dispatch would fail
        raise ValueError(f"{kernel.name}: {kernel.threads} threads x {regs} registers do not fit a core's "
                         f"{gpu.register_file_bytes // 1024} KiB register file")
    limits = {
        "registers": gpu.register_file_bytes // max(1, regs * 4 * kernel.threads),
        "threadgroup memory": (gpu.threadgroup_memory_per_core // kernel.threadgroup_memory
                               if kernel.threadgroup_memory else 10**9),
        "threads": gpu.max_threads_per_core // kernel.threads,
    }
    bound = min(limits, key=limits.get)
    return {"threadgroups": max(1, limits[bound]), "limit": bound}


def predict(kernel: Kernel, gpu: Gpu, exp_kind: str = "fast") -> dict:
    """Predicted seconds for one dispatch, with its parts."""
    res = residency(kernel, gpu)
    per_core = math.ceil(kernel.threadgroups / gpu.cores)
    resident = min(res["threadgroups"], per_core)
    block_issue = issue_cycles(kernel.block.counts, exp_kind)
    spill = max(0, kernel.registers - gpu.register_budget)
    if spill:  # each spilled register is stored and reloaded once per block (threadgroup-memory speed)
        block_issue += 2 * spill * CYCLES["threadgroup_load"]
    latency = kernel.block.load_rounds * gpu.load_latency_cycles / max(1, kernel.prefetch)
    chain = latency + kernel.block.barriers * gpu.barrier_cycles + dependent_issue_cycles(kernel.block, exp_kind,
                                                                                        block_issue)

    def period(together: int) -> tuple[float, str]:
        """Cycles per key block with `together` threadgroups on the core."""
        pipe = max(1.0, together * kernel.simdgroups / gpu.pipes) * block_issue  # simdgroups share the pipes
        tg_memory = together * kernel.threadgroup_bytes_per_block / gpu.threadgroup_bytes_per_cycle
        parts = {"latency": chain, "issue": pipe, "threadgroup memory": tg_memory}
        bound = max(parts, key=parts.get)
        return parts[bound], bound

    # full rounds of `resident` threadgroups, then the rest together
    full, rest = divmod(per_core, resident)
    full_period, bound = period(resident)
    cycles = full * kernel.blocks * full_period + (kernel.blocks * period(rest)[0] if rest else 0.0)
    fixed = issue_cycles(kernel.fixed, exp_kind) + (kernel.fixed_load_rounds * gpu.load_latency_cycles if kernel.fixed else 0)
    core_seconds = (cycles + (full + (1 if rest else 0)) * fixed) / gpu.clock_hz
    dram_seconds = kernel.dram_bytes / gpu.dram_bytes_per_s
    seconds = max(core_seconds, dram_seconds)
    if dram_seconds > core_seconds:
        bound = "DRAM"
    return {"seconds": seconds + gpu.dispatch_seconds, "bound": bound, "registers": kernel.registers,
            "spills": spill > 0, "resident_threadgroups": resident, "occupancy_limit": res["limit"],
            "occupancy": resident * kernel.threads / gpu.max_threads_per_core,
            "core_seconds": core_seconds, "dram_seconds": dram_seconds, "dram_bytes": kernel.dram_bytes}


def predict_all(kernels: list, gpu: Gpu, exp_kind: str = "fast") -> dict:
    """A problem's dispatches run one after another."""
    parts = [predict(k, gpu, exp_kind) for k in kernels]
    first = max(parts, key=lambda p: p["seconds"])
    return {**first, "seconds": sum(p["seconds"] for p in parts), "dispatches": len(parts),
            "registers": max(p["registers"] for p in parts), "spills": any(p["spills"] for p in parts)}


# ---------------------------------------------------------------- the cache model
def unique_bytes_per_wave(order: list, bytes_per_head: float, resident_per_core: int, gpu: Gpu) -> float:
    """K/V bytes from DRAM when threadgroups run in `order` (each entry the
    K/V head, or any key, that threadgroup reads in full) and a wave of
    cores x resident threadgroups runs together: a head read by several
    threadgroups of one wave comes from DRAM once (the others hit L2/SLC)."""
    wave = max(1, gpu.cores * resident_per_core)
    total = 0
    for start in range(0, len(order), wave):
        total += len(set(order[start:start + wave]))
    return total * bytes_per_head


def _with_cache(kernel: Kernel, gpu: Gpu, bytes_per_head: float, other_bytes: float) -> Kernel:
    resident = min(residency(kernel, gpu)["threadgroups"], math.ceil(kernel.threadgroups / gpu.cores))
    dram = unique_bytes_per_wave(kernel.kv_reads, bytes_per_head, resident, gpu) + other_bytes
    return replace(kernel, dram_bytes=dram)


# ---------------------------------------------------------------- prefill (steel structure)
@dataclass(frozen=True)
class PrefillTile:
    """A steel-structured prefill tile: BQ query rows over WM simdgroups (8
    rows each), BK keys per block, head dim D (WN = 2 splits D over 2
    simdgroups per row group, as MLX's steel allows)."""

    bq: int
    bk: int
    d: int
    wm: int
    wn: int = 1
    q_in_registers: bool = False   # ours: Q fragments stay in registers; MLX: in threadgroup memory
    stage_kv_together: bool = False  # ours: K and V blocks both staged (2 barriers a block); MLX: one buffer
    # the row max and sum: MLX's row_reduce (steel/attn/mma.h) shuffles each
    # 8x8 fragment's row (2 shuffles a fragment); ours reduces a lane's
    # fragments first, then shuffles once a row
    reduce_per_fragment: bool = True
    # ours: the lazy max (prefill_online_softmax) rescales O only in blocks
    # that move some row's max by more than 8 in log2 units, and tests that
    # with one simd_any a block. ASSUMED: a row's logits stay within that of
    # its first key block's max, so only the first block rescales (logits of
    # scaled attention spread a few units; the emulator tests cover rows
    # whose max keeps moving, which cost what the eager max costs)
    lazy_max: bool = False
    exp_kind: str = "fast"
    # a simdgroup's row tiles (TQ > 1) share each V fragment it reads; steel
    # (steel_attention.h, MLX 0.32.4) reads one per row tile, ours has one
    # row tile (a structure search's option: cost_checks.prefill_structure_floor)
    shared_value_fragments: bool = False


# A loader loop copies device memory to threadgroup memory one vector (16
# bytes, 4 registers) per staged operand and iteration: its loop bound
# depends on the thread's index and each value is stored as soon as it
# arrives, so one iteration's values are live at a time (more loads in
# flight are the scheduler's choice where registers are free; the latency
# term, not the register count, charges for them).
LOADER_REGISTERS_PER_OPERAND = 4
FIXED_REGISTERS = 20  # ASSUMED: addresses, strides, indices and loop state


def steel_registers(tile: PrefillTile, elem_bytes: int = 2, staging_registers: int | None = None) -> int:
    """Peak live 32-bit registers per thread in the key-block loop: the
    values held across the loop (O, BQ/8/WM x D/8/WN float fragments of 2
    elements per lane; Q's D/8/WN fragments when Q stays in registers; row
    max/sum/factor; FIXED_REGISTERS) plus the largest of its phases: staging
    (one loader iteration per staged operand; steel stages V while P is
    live), S = Q K^T (S, BK/8 tiles, and the step's K fragments, + one Q
    fragment read from threadgroup memory) and O += P V (S and a V
    fragment). `staging_registers`: another loader's staging phase (the
    quantized prefill's)."""
    tq = tile.bq // (8 * tile.wm)
    td = tile.d // 8 // tile.wn
    o = 2 * tq * td
    s = 2 * tq * (tile.bk // 8)
    k = 2 * (tile.bk // 8)
    q_held = 2 * td * tq if tile.q_in_registers else 0
    rows = 3 * tq
    staging = (LOADER_REGISTERS_PER_OPERAND * (2 if tile.stage_kv_together else 1)
               + (0 if tile.stage_kv_together else s)) if staging_registers is None else staging_registers
    scores = s + k + (0 if tile.q_in_registers else 2)
    values = s + 2
    return o + q_held + rows + FIXED_REGISTERS + max(staging, scores, values)


def steel_threadgroup_memory(tile: PrefillTile, elem_bytes: int = 2) -> int:
    pad = 16 // elem_bytes
    q = 0 if tile.q_in_registers else tile.bq * (tile.d + pad)
    if tile.stage_kv_together:  # ours: K and V blocks side by side, rows padded by 16 bytes
        return (q + 2 * tile.bk * (tile.d + pad)) * elem_bytes
    kv = max((tile.bk + pad) * tile.d, tile.bk * (tile.d + pad))
    return (q + kv) * elem_bytes


def prefill_kernel(name: str, tile: PrefillTile, batch: int, heads: int, kv_heads: int, q_len: int, kv_len: int,
                   causal: bool, gpu: Gpu, elem_bytes: int = 2, prefetch: int = 1) -> Kernel:
    nq = math.ceil(q_len / tile.bq)
    threads = 32 * tile.wm * tile.wn
    tq = tile.bq // (8 * tile.wm)
    tk, td = tile.bk // 8, tile.d // 8 // tile.wn
    # per simdgroup, one key block
    mma = tq * tk * td * 2                      # S = Q K^T and O += P V over this simdgroup's D share
    elems = 2 * tq * tk                         # S elements per lane
    loads_per_thread = math.ceil(2 * tile.bk * tile.d * elem_bytes / 16 / threads)  # 16-byte vector loads
    # key blocks per threadgroup (causal: the longest row block's; half on average)
    full_blocks = math.ceil(kv_len / tile.bk)
    avg_fraction = 1.0
    if causal:
        avg_fraction = sum(min(kv_len, kv_len - q_len + (i + 1) * tile.bq) for i in range(nq)) / (nq * kv_len)
    blocks = max(1, round(full_blocks * avg_fraction))
    rescale = 2 * tq * td / blocks if tile.lazy_max else 2 * tq * td  # O *= alpha, a block on average
    counts = {
        "mma": mma,
        # scale, max, sub, sum a score; the O rescale; row stats (+ the lazy max's test); stores
        "fma": elems * 4 + rescale + 6 * tq + (2 * tq if tile.lazy_max else 0) + loads_per_thread,
        # the scores' exponentials; the row factor's once a row (the lazy max: only
        # in a block that moves the max, the first on average)
        "exp2": elems + (tq / blocks if tile.lazy_max else tq),
        # row max and sum over a row's 4 lanes (+ the lazy max's simd_any)
        "simd_shuffle": 4 * tq * (tk if tile.reduce_per_fragment else 1) + (1 if tile.lazy_max else 0),
        # fragment reads a block (steel_attention.h, MLX 0.32.4): per D step one
        # Q fragment per row tile (unless Q stays in registers) and TK K
        # fragments shared by the row tiles; V: TK per D step and row tile
        # (shared by the row tiles: TK per D step)
        "threadgroup_load": ((0 if tile.q_in_registers else tq * td) + tk * td
                             + (1 if tile.shared_value_fragments else tq) * tk * td),
        "device_load": loads_per_thread,
    }
    barriers = 2 if tile.stage_kv_together else 4
    if tile.wn == 2:
        # Each of the two simdgroups of a row group holds S over half of D:
        # steel (steel_attention.h, MLX 0.32.4, `if constexpr (WN == 2)`)
        # stores its partial S to threadgroup memory, waits, adds its peer's:
        # S stored and read once per block (threadgroup accesses, priced as
        # loads), behind two more threadgroup barriers.
        counts["threadgroup_load"] += 2 * elems
        barriers += 2
    block = Block(counts, load_rounds=1 if tile.stage_kv_together else 2, barriers=barriers)
    tg_bytes = (2 * tile.bk * tile.d * elem_bytes                         # stores of K and V
                + tile.wm * tile.wn * counts["threadgroup_load"] * 32 * 2 * elem_bytes)  # fragment reads (2 elements a lane)
    threadgroups = nq * heads * batch
    kv_head_bytes = 2 * kv_len * tile.d * elem_bytes
    device = threadgroups * kv_head_bytes * avg_fraction + 2 * batch * heads * q_len * tile.d * elem_bytes
    # threadgroups in dispatch order: x = query block fastest, then heads
    order = [(b, h * kv_heads // heads) for b in range(batch) for h in range(heads) for _ in range(nq)]
    regs = steel_registers(tile, elem_bytes)
    kernel = Kernel(
        name, threadgroups, threads, regs, steel_threadgroup_memory(tile, elem_bytes),
        # causal: the average block count stands for the total work (threadgroups overlap on the cores)
        blocks, block, tg_bytes, device, device, prefetch,
        fixed={"device_load": 2 * tile.bq * tile.d * elem_bytes / 16 / threads, "fma": 4 * tq * td}, kv_reads=order)
    return _with_cache(kernel, gpu, kv_head_bytes * avg_fraction, 2 * batch * heads * q_len * tile.d * elem_bytes)


def mlx_steel_tile(d: int) -> PrefillTile:
    """MLX 0.32.4's choice (scaled_dot_product_attention.cpp, no NAX): BQ 32,
    BK 32 below D = 128 else 16, WM 4, WN 1."""
    return PrefillTile(32, 32 if d < 128 else 16, d, 4, 1)


def steel_alternatives(d: int, elem_bytes: int = 2, gpu: Gpu = M2_MAX) -> list:
    """The tiles MLX's steel kernel compiles for (TQ = 1: BQ = 8 WM; WN 1 or
    2) that fit a threadgroup's 32 KB."""
    tiles = []
    for wm in (2, 4, 8):
        for bk in (8, 16, 32, 64):
            for wn in (1, 2):
                tile = PrefillTile(8 * wm, bk, d, wm, wn, q_in_registers=(wn == 2 and (bk == 32 or elem_bytes == 4)))
                if steel_threadgroup_memory(tile, elem_bytes) <= gpu.max_threadgroup_memory:
                    tiles.append(tile)
    return tiles


def our_prefill_tile(d: int, bk: int, exp_kind: str, lazy_max: bool = True) -> PrefillTile:
    """metal/attention_prefill.h: BQ 32, 4 simdgroups, Q and O as float
    fragments in registers, K and V staged together (2 barriers a block),
    the lazy max (`lazy_max=False`: the eager one it replaced)."""
    return PrefillTile(32, bk, d, 4, 1, q_in_registers=True, stage_kv_together=True, reduce_per_fragment=False,
                       exp_kind=exp_kind, lazy_max=lazy_max)


# ---------------------------------------------------------------- decode
def sdpa_vector_kernels(batch: int, heads: int, kv_heads: int, kv_len: int, d: int, gpu: Gpu,
                        two_pass: bool, blocks: int = 32, elem_bytes: int = 2) -> list:
    """MLX's sdpa_vector: one pass = one threadgroup of 32 simdgroups per
    query head, simdgroup j takes keys j, j + 32, ...; two passes = a
    threadgroup of 32 x group lanes per (KV head, block), then a combine
    over the blocks. Lanes hold D/32 elements of q and o."""
    per_lane = d // 32
    group = heads // kv_heads
    key_counts = {"fma": 2 * per_lane + 6, "exp2": 2, "simd_shuffle": 5, "device_load": 2}
    kv_head_bytes = 2 * kv_len * d * elem_bytes
    regs = 2 * per_lane + 2 * per_lane + FIXED_REGISTERS  # q, o, k and v slices in float + state
    if not two_pass:
        threads, tgs = 1024, batch * heads
        keys = math.ceil(kv_len / 32)
        order = [(b, h // group) for b in range(batch) for h in range(heads)]
        kernel = Kernel("sdpa_vector", tgs, threads, regs, 32 * 2 * 4 + 32 * per_lane * 4 * 0 + 32 * 32 * 4,
                        keys, Block(key_counts, load_rounds=1), 0.0, tgs * kv_head_bytes, 0.0, prefetch=2,
                        fixed={"fma": 4 * per_lane, "simd_shuffle": 10, "threadgroup_load": 2 * per_lane},
                        kv_reads=order)
        return [_with_cache(kernel, gpu, kv_head_bytes, 2 * batch * heads * d * elem_bytes)]
    threads, tgs = 32 * group, batch * kv_heads * blocks
    keys = math.ceil(kv_len / blocks)
    order = list(range(tgs))  # each threadgroup its own slice
    # issued: each query head's simdgroup reads its block's keys (the group's
    # repeats are cache hits: DRAM once per threadgroup, below)
    first = Kernel("sdpa_vector_2pass_1", tgs, threads, regs, 0, keys, Block(key_counts, load_rounds=1),
                   0.0, batch * heads * kv_head_bytes, 0.0, prefetch=2, fixed={"fma": 4 * per_lane},
                   kv_reads=order)
    first = _with_cache(first, gpu, kv_head_bytes / blocks, batch * heads * blocks * (d * elem_bytes + 8))
    partial = batch * heads * blocks * (d * elem_bytes + 8)
    second = Kernel("sdpa_vector_2pass_2", batch * heads, 1024, 24, 32 * 32 * 4 * 2, 1,
                    Block({"fma": 4 * per_lane + 8, "exp2": 2, "simd_shuffle": 10, "device_load": 2}),
                    0.0, partial, partial, fixed={})
    return [first, second]


# Simdgroups per merge threadgroup (one row): MLX_ATTN_DECODE_MERGE_SIMDGROUPS
# in metal/attention_params.h.
MERGE_SIMDGROUPS = 8


# The paged decode's page window (PageWindow, metal/attention_paged.h): a
# lane's block-table entries, MLX_ATTN_PAGED_ROW_WINDOW_ROUNDS on the row
# shape and MLX_ATTN_PAGED_GROUP_WINDOW_ROUNDS on the group shape
# (metal/attention_paged_params.h). Its first page and page size are uniform
# across the simdgroup: uniform registers, as the loaders' bases
# (QUANTIZED_LOADER_REGISTERS), not counted.
PAGED_ROW_WINDOW_ROUNDS, PAGED_GROUP_WINDOW_ROUNDS = 4, 1


def paged_window_registers(rows_per_threadgroup: int) -> int:
    return PAGED_ROW_WINDOW_ROUNDS if rows_per_threadgroup == 1 else PAGED_GROUP_WINDOW_ROUNDS


def decode_loop_registers(rows_per_threadgroup: int, d: int, prefetch: bool, loader_registers: int = 0) -> int:
    """Registers per lane of the decode loop (metal/attention_decode.h
    decode_loop_registers, the same formula): allocated for the kernel's
    compile-time R rows (DecodeRows<R, SLICE>: q[R][D/32], o[R][D/32], m[R],
    l[R]), whatever the live rows: q and o, m and l, the key's k and v slices
    (twice with the prefetch), ~20 of addresses and loop state, and the
    loader's own (0 for float K/V, QUANTIZED_LOADER_REGISTERS, the page
    window's entries)."""
    per_lane = d // 32
    big_r = rows_per_threadgroup
    return (2 * big_r * per_lane + 2 * big_r + 2 * per_lane * (2 if prefetch else 1) + FIXED_REGISTERS
            + loader_registers)


def decode_prefetch(rows_per_threadgroup: int, simdgroups: int, d: int, loader_registers: int = 0,
                    gpu: Gpu | None = None) -> int:
    """Keys in flight per simdgroup (DecodePrefetch, metal/attention_decode.h):
    2 (the next key's K/V loaded while the current key's math runs) where
    the loop's registers with them stay within the per-thread budget and a
    core's register file holds the threadgroup's threads, else 1."""
    gpu = gpu or M2_MAX
    limit = min(gpu.register_budget, gpu.register_file_bytes // (4 * 32 * simdgroups))
    return 2 if decode_loop_registers(rows_per_threadgroup, d, True, loader_registers) <= limit else 1


def our_decode_kernels(batch: int, heads: int, kv_heads: int, kv_len: int, d: int, gpu: Gpu, splits: int,
                       rows_per_threadgroup: int, simdgroups: int = 4, elem_bytes: int = 2,
                       prefetch: int = 1, single_dispatch: bool = False, lane_merge: bool = False,
                       merge_simdgroups: int = MERGE_SIMDGROUPS, paged: bool = False) -> list:
    """metal/attention_decode.h: a threadgroup of `simdgroups` simdgroups per
    (split, KV head, row chunk) serves up to R rows of the GQA group; key j
    of the split on simdgroup j % NSG; then attention_decode_merge over the
    splits (none with `single_dispatch` and one split). `prefetch` 2: the
    kernel loads key j + NSG's K/V before key j's math (DecodePrefetch);
    `lane_merge`: merge_splits' lane-parallel max and sum and loads ahead,
    on `merge_simdgroups` simdgroups per row (now; 1: one simdgroup walking
    every split, before), else the merge before both. `paged`: the paged
    decode (metal/attention_paged.h, the same body): per key its page from a
    lane's block-table entry (a shuffle) and its slot and address (a divide,
    a modulo, a multiply-add), and per split a lane's block-table reads
    (its page window's entries: paged_window_registers)."""
    per_lane = d // 32
    rows = heads // kv_heads
    big_r = rows_per_threadgroup
    r = min(rows, big_r)  # live rows: the work per key
    chunks = math.ceil(rows / big_r)
    tgs = splits * batch * kv_heads * chunks
    keys = math.ceil(kv_len / splits / simdgroups)
    key_counts = {"fma": r * (2 * per_lane + 6) + 2 + (3 if paged else 0), "exp2": 2 * r,
                  "simd_shuffle": 5 * r + (1 if paged else 0), "device_load": 2 * math.ceil(per_lane / 4)}
    regs = decode_loop_registers(big_r, d, prefetch > 1, paged_window_registers(big_r) if paged else 0)
    kv_head_bytes = 2 * kv_len * d * elem_bytes
    partial_bytes = batch * heads * splits * (d * 4 + 8)
    tg_memory = (simdgroups - 1) * big_r * (per_lane * 32 + 2) * 4  # DecodeStates<D>, sized by R
    out_bytes = batch * heads * d * elem_bytes
    merged = single_dispatch and splits == 1
    q_bytes = simdgroups * splits * batch * heads * d * elem_bytes  # every simdgroup of a split reads its rows' queries
    issued = batch * kv_heads * chunks * kv_head_bytes + q_bytes + (out_bytes if merged else partial_bytes)
    # Threadgroups in dispatch order (x = split fastest, then KV head x row
    # chunk): the row chunks of one KV head read the same split of its K/V,
    # and every split the same query rows; resident together they read them
    # from DRAM once (the cache model, as for sdpa_vector's same-head reads).
    order = [(b, y // chunks, x) for b in range(batch) for y in range(kv_heads * chunks) for x in range(splits)]
    q_order = [(b, y) for b in range(batch) for y in range(kv_heads * chunks) for _ in range(splits)]
    partial = Kernel("attention_decode_partial", tgs, 32 * simdgroups, regs, tg_memory, keys,
                     Block(key_counts, load_rounds=1, ilp=max(2, r)), 0.0, issued, 0.0,  # r rows: r chains
                     prefetch=prefetch, fixed={"fma": 8 * r * per_lane, "threadgroup_load": 2 * r * per_lane,
                                               **({"device_load": paged_window_registers(big_r)} if paged else {})},
                     fixed_load_rounds=2 if paged else 1, kv_reads=order)
    resident = min(residency(partial, gpu)["threadgroups"], math.ceil(tgs / gpu.cores))
    q_dram = unique_bytes_per_wave(q_order, r * d * elem_bytes, resident, gpu)
    partial = _with_cache(partial, gpu, kv_head_bytes / splits, q_dram + (out_bytes if merged else partial_bytes))
    if merged:
        return [replace(partial, name="attention_decode_partial (writes out)")]
    if not lane_merge:
        # the merge before: every lane read every split's max and sum, and each
        # split's loads waited for the previous split's (one round per split)
        merge_bytes = batch * heads * splits * (d * 4 + 32 * 8) + out_bytes
        merge = Kernel("attention_decode_merge", batch * heads, 32, 24, 0, splits,
                       Block({"fma": 2 * per_lane + 4, "exp2": 1, "device_load": 2}), 0.0,
                       merge_bytes, batch * heads * splits * (d * 4 + 8) + out_bytes)
        return [partial, merge]
    # merge_splits: a threadgroup of NSG simdgroups per row; simdgroup g takes
    # splits g, g + NSG, ...: lane j reads its splits j, j + 32, ...'s max and
    # sum (one round per 32 of them, twice: max, then rescaled sums; simd_max /
    # simd_sum), then their output slices one by one, the next loaded ahead
    # (the first before the max and sum: in flight during them). Then
    # combine_simdgroup_states (NSG > 1): simdgroups 1.. write their (max, sum,
    # output slice) to threadgroup memory, one barrier (left out, as the
    # partial kernel's), simdgroup 0 reads them back: a max and a sum per lane,
    # two exp2, the reductions, a shuffle and a slice of FMAs per simdgroup.
    # Registers: the output slice and the next one, ~20 of state.
    nsg = merge_simdgroups
    own_splits = math.ceil(splits / nsg)  # the longest simdgroup's chain
    merge_bytes = batch * heads * splits * (d * 4 + 8) + out_bytes
    stat_rounds = 2 * math.ceil(own_splits / 32)
    fixed = {"fma": 4 * stat_rounds, "exp2": stat_rounds // 2, "simd_shuffle": 10, "device_load": 2 * stat_rounds}
    if nsg > 1:
        fixed = {"fma": fixed["fma"] + (nsg - 1) * per_lane + per_lane + 4, "exp2": fixed["exp2"] + 2,
                 "simd_shuffle": fixed["simd_shuffle"] + 10 + (nsg - 1), "device_load": fixed["device_load"],
                 "threadgroup_load": per_lane + 2 + (nsg - 1) * per_lane}  # its own writes, then the reads
    merge = Kernel("attention_decode_merge", batch * heads, 32 * nsg, 2 * per_lane + FIXED_REGISTERS,
                   (nsg - 1) * (d + 2) * 4, own_splits,
                   Block({"fma": 2 * per_lane + 4, "exp2": 1, "device_load": 2}), 0.0,
                   merge_bytes, merge_bytes, prefetch=2, fixed=fixed, fixed_load_rounds=stat_rounds)
    return [partial, merge]


# ---------------------------------------------------------------- prefill, D-split
def split_prefill_registers(d: int, dv: int, bk: int, query_chunk: int = 64, value_chunk: int = 128) -> int:
    """metal/attention_prefill_split.h (D > 128 or Dk != Dv), as
    steel_registers counts: held across a pass's key-block loop, the pass's
    O slice (VC/8 float fragments) and the row state; the largest phase is
    the score's (S, BK/8 fragments, one query chunk's QC/8 fragments and a K
    fragment; staging, one loader iteration, and O += P V, S and a V
    fragment, are smaller)."""
    vc = min(dv, value_chunk)
    s = bk // 4
    staging = LOADER_REGISTERS_PER_OPERAND
    scores = s + query_chunk // 4 + 2
    values = s + 2
    return vc // 4 + 3 + FIXED_REGISTERS + max(staging, scores, values)


# ---------------------------------------------------------------- backward
# metal/attention_backward.h (register-resident: K, V, dK, dV or Q, dO, dQ
# rows held as float fragments) and metal/attention_backward_split.h (one
# chunk of C = 64 gradient columns per threadgroup). 4 simdgroups, 32 owned
# rows (keys for dK/dV, queries for dQ) per threadgroup, 8 per simdgroup.
BACKWARD_CHUNK = 64
BACKWARD_THREADS = 128


def backward_dkdv_registers(d: int) -> int:
    """attention_backward_dkdv, as steel_registers counts: held, the K, V,
    dK and dV rows (4 x D/8 fragments of 2 floats = D floats); phases:
    staging Q and dO (one element each per iteration: 2), S^T and dP^T of an
    8x8 step with a Q and a dO fragment (8), the step's gradients (S^T, dP^T
    and the lse and delta pairs: 8), the products (S^T, dP^T, two
    fragments: 8)."""
    held = d  # K, V, dK, dV: 4 x D/8 fragments of 2 floats
    staging, scores, gradients, products = 2, 8, 8, 8
    return held + FIXED_REGISTERS + max(staging, scores, gradients, products)


def backward_dq_registers(d: int) -> int:
    """attention_backward_dq: held, the Q, dO and dQ rows (3 x D/8
    fragments = 3D/4) and the row's lse and delta (2); phases: staging K
    and V (scalar: 2), S and dP of an 8x8 step with a K and a V fragment (8),
    the gradients (S, dP: 4), dQ += dS K (dS and a K fragment: 4)."""
    held = 3 * d // 4 + 2  # Q, dO, dQ fragments; the row's lse and delta
    staging, scores, gradients, products = 2, 8, 4, 4
    return held + FIXED_REGISTERS + max(staging, scores, gradients, products)


def backward_split_registers(pass_name: str, streamed_rows: int = 32, chunk: int = BACKWARD_CHUNK) -> int:
    """attention_backward_split_{dkdv,dq}: held, the chunk's accumulators
    (dkdv: dK and dV, 2 x C/8 fragments; dq: dQ, C/8) and S and dP over the
    streamed block (2 x N/8 fragments: the header's 52 and 34 floats of
    tiles); the largest phase adds the own row's fragment read from device
    memory (2) and a streamed one (2), or the row statistics (dkdv: the
    lse and delta pairs, 4; dq: the row's 2)."""
    accumulators = (2 if pass_name == "dkdv" else 1) * chunk // 4
    scores = 2 * streamed_rows // 4
    fragment_reads, row_statistics = 4, (4 if pass_name == "dkdv" else 2)
    return accumulators + scores + FIXED_REGISTERS + max(fragment_reads, row_statistics)


def _backward_pass(name: str, owned: int, streamed: int, d: int, dv: int, heads: int, kv_heads: int, batch: int,
                   q_len: int, kv_len: int, causal: bool, gpu: Gpu, split: bool, elem_bytes: int,
                   streamed_rows: int) -> Kernel:
    """One gradient pass: `owned` rows per threadgroup (32), blocks of
    `streamed_rows` streamed rows; dkdv streams Q and dO of every query head
    of the group, dq streams K and V. Register-resident: S, dP and the two
    gradient products over D (dkdv: 4 MMA per 8x8 step and dim tile, dq: 3);
    split: S and dP over all of D and DV, the products over one chunk."""
    keys_pass = name == "dkdv"
    group = heads // kv_heads
    own_len, stream_len = (kv_len, q_len) if keys_pass else (q_len, kv_len)
    steps = streamed_rows // 8                 # 8x8 steps along the streamed block
    dt, dvt, ct = d // 8, dv // 8, BACKWARD_CHUNK // 8
    chunks = max(d, dv) // BACKWARD_CHUNK if split else 1
    if split:
        gradient_tiles = (ct + ct) if keys_pass else ct  # dkdv: a dK and a dV chunk; dq: a dQ chunk
        mma = steps * (dt + dvt + gradient_tiles)
        tg_fragments = steps * (dt + dvt + gradient_tiles)
        device_fragments = dt + dvt                  # the own rows' fragments, re-read per block (cached)
        registers = backward_split_registers(name, streamed_rows)
        staged_cols = d + dv                         # every chunk of the streamed rows, as float
        tg_memory = 2 * streamed_rows * (BACKWARD_CHUNK + 4) * 4 + 2 * streamed_rows * 4
        barriers = 2 * chunks
    else:
        mma = steps * dt * (4 if keys_pass else 3)
        tg_fragments = mma
        device_fragments = 0
        registers = backward_dkdv_registers(d) if keys_pass else backward_dq_registers(d)
        staged_cols = 2 * d
        tg_memory = (2 * streamed_rows * (d + 4) * 4 + 2 * streamed_rows * 4 if keys_pass
                     else 2 * streamed_rows * (d + 16 // elem_bytes) * elem_bytes)
        barriers = 2
    loads_per_thread = math.ceil(streamed_rows * staged_cols / BACKWARD_THREADS)  # element loads (scalar)
    counts = {
        "mma": mma,
        "fma": steps * 2 * 14 + 2 * loads_per_thread,  # per pair: logit, mask, exp, dS (~14); staging converts and stores
        "exp2": steps * 2,
        "threadgroup_load": tg_fragments + (2 * steps if keys_pass else 0),
        "device_load": loads_per_thread + device_fragments,
    }
    block = Block(counts, load_rounds=1 + (1 if device_fragments else 0), barriers=barriers)
    threadgroups = math.ceil(own_len / owned) * chunks * (kv_heads if keys_pass else heads) * batch
    visible = 1.0
    if causal:
        visible = sum(min(kv_len, kv_len - q_len + i + 1) for i in range(q_len)) / (q_len * kv_len)
    streamed_per_tg = math.ceil(stream_len * visible / streamed_rows) * (group if keys_pass else 1)
    stream_bytes = (d + dv) * elem_bytes          # one streamed row (Q and dO, or K and V)
    head_bytes = stream_len * stream_bytes * visible * (group if keys_pass else 1)
    own_bytes = (own_len * (d + dv) * elem_bytes * 2 * (kv_heads if keys_pass else heads) * batch)  # read + write
    device = threadgroups * head_bytes + own_bytes
    tg_bytes = 4 * tg_fragments * 32 * 8 + streamed_rows * staged_cols * 4
    order = [(b, h) for b in range(batch) for h in range(kv_heads if keys_pass else heads)
             for _ in range(math.ceil(own_len / owned) * chunks)]
    if not keys_pass:
        order = [(b, h * kv_heads // heads) for (b, h) in order]
    kernel = Kernel(f"attention_backward{'_split' if split else ''}_{name}", threadgroups, BACKWARD_THREADS, registers,
                    tg_memory, max(1, streamed_per_tg), block, tg_bytes, device, device,
                    fixed={"device_load": (0 if split else 2 * d // 8), "fma": 4 * dt}, kv_reads=order)
    return _with_cache(kernel, gpu, head_bytes, own_bytes)


def backward_kernels(d: int, dv: int, q_len: int, kv_len: int, heads: int, kv_heads: int, causal: bool, gpu: Gpu,
                     split_keys: bool, split_queries: bool, batch: int = 1, elem_bytes: int = 2) -> list:
    """The backward's dispatches (csrc/metal/backward_launch_plan.cpp): delta (a
    simdgroup per row: rowsum(dO * O), DRAM-bound), dK/dV, dQ."""
    rows = batch * heads * q_len
    delta_bytes = rows * (2 * dv * elem_bytes + 8)
    delta = Kernel("attention_backward_delta", math.ceil(rows / 4), 128, 24, 0, 1,
                   Block({"fma": 2 * dv // 32, "simd_shuffle": 5, "device_load": 2 * dv // 32}), 0.0,
                   delta_bytes, delta_bytes)
    dkdv = _backward_pass("dkdv", 32, 16 if d in (80, 96) else 32, d, dv, heads, kv_heads, batch, q_len, kv_len,
                          causal, gpu, split_keys, elem_bytes, 32 if split_keys else (16 if d in (80, 96) else 32))
    dq_block = 32 if split_queries else (32 if d == 64 else 16)
    dq = _backward_pass("dq", 32, dq_block, d, dv, heads, kv_heads, batch, q_len, kv_len, causal, gpu, split_queries,
                        elem_bytes, dq_block)
    return [delta, dkdv, dq]


# ---------------------------------------------------------------- quantized K/V prefill
# FMA-class instructions per element a loader dequantizes: shift, mask,
# int -> float, scale * code + bias, float -> the staged dtype (ASSUMED: one
# issue slot each, as "fma").
DEQUANTIZE_OPS_PER_ELEMENT = 5


def quantized_kv_bytes_per_element(bits: int, group_size: int, scale_bytes: int = 2) -> float:
    """Device bytes of one K or V element quantized by mx.quantize: its code
    and its share of the group's scale and bias (q's dtype)."""
    return bits / 8 + 2 * scale_bytes / group_size


def quantized_prefill_kernel(name: str, d: int, bk: int, bits: int, group_size: int, batch: int, heads: int,
                             kv_heads: int, q_len: int, kv_len: int, causal: bool, gpu: Gpu,
                             elem_bytes: int = 2) -> Kernel:
    """metal/attention_quantized_prefill.h: our prefill tile (our_prefill_tile,
    fast exp2) whose block loader reads packed codes and per-group scales and
    biases and stages scale * code + bias in q's dtype. Against the float
    loader: a thread stages runs of 32 features (BITS word loads, one scale
    and one bias each) instead of 16-byte vectors, DEQUANTIZE_OPS_PER_ELEMENT
    ALU per staged element, the words of one run, its scale, bias and two
    addresses live in the staging phase (steel_registers); device bytes are the packed K/V (the cache
    model: each group's scale and bias from DRAM once), issued as one scale
    and bias per run."""
    base = prefill_kernel(name, our_prefill_tile(d, bk, "fast"), batch, heads, kv_heads, q_len, kv_len, causal, gpu,
                          elem_bytes)
    threads = base.threads
    float_loads = math.ceil(2 * bk * d * elem_bytes / 16 / threads)  # the float loader's (prefill_kernel)
    runs = math.ceil(2 * bk * d / 32 / threads)                      # per thread per block
    elements = 2 * bk * d / threads
    counts = dict(base.block.counts)
    counts["fma"] += -float_loads + elements * DEQUANTIZE_OPS_PER_ELEMENT + 6 * runs  # + a run's addresses
    counts["device_load"] = runs * (bits + 2)
    registers = steel_registers(our_prefill_tile(d, bk, "fast"), elem_bytes, staging_registers=bits + 4)
    # the float kernel's K/V bytes per threadgroup -> the share of keys it reads (causal: about half)
    other = 2 * batch * heads * q_len * d * elem_bytes               # q read, out written
    float_head = 2 * kv_len * d * elem_bytes
    fraction = (base.device_bytes - other) / (base.threadgroups * float_head)
    issued_head = 2 * kv_len * d * (bits / 8 + 2 * elem_bytes / 32)  # one scale and bias per run of 32
    dram_head = 2 * kv_len * d * quantized_kv_bytes_per_element(bits, group_size, elem_bytes)
    kernel = replace(base, name=name, block=replace(base.block, counts=counts), registers=registers,
                     device_bytes=base.threadgroups * issued_head * fraction + other)
    return _with_cache(kernel, gpu, dram_head * fraction, other)


def quantized_decode_structure_kernels(batch: int, heads: int, kv_heads: int, q_len: int, kv_len: int, d: int,
                                       bits: int, group_size: int, causal: bool, gpu: Gpu,
                                       elem_bytes: int = 2) -> list:
    """The quantized decode kernel on prefill rows (metal/attention_quantized.h,
    what served them before the quantized prefill kernel): our_decode_kernels
    with group x q_len rows in chunks of R (csrc/metal/launch_plan.cpp
    decode_splits), each chunk re-reading and re-dequantizing its key range
    (dequantize_slice: per key and lane D / 32 features of K and of V, 3
    shuffles each for the shared word, scale and bias); causal: a chunk's
    range ends at its last position (about half the keys on average). Then
    the merge (one split included: the plan's merge dispatch)."""
    rows = heads // kv_heads * q_len
    r = 32 // (d // 32)
    chunks = math.ceil(rows / r)
    threadgroups = batch * kv_heads * chunks
    for_occupancy = math.ceil(gpu.cores * 8 / threadgroups)
    splits = max(1, min(for_occupancy, math.ceil(kv_len / max(64, 16 * rows))))
    prefetch = 2 if d // 32 <= 8 else 1
    partial, merge = our_decode_kernels(batch, kv_heads * rows, kv_heads, kv_len, d, gpu, splits, r,
                                        prefetch=prefetch, lane_merge=True, elem_bytes=elem_bytes)
    per_lane = d // 32
    counts = dict(partial.block.counts)
    counts["fma"] += 2 * per_lane * 3  # per key: shift, mask, scale * code + bias per feature of K and V
    counts["simd_shuffle"] += 2 * 3
    counts["device_load"] = 2 * 3                         # a word (or a share of one), a scale, a bias
    fraction = 1.0
    if causal:  # rows head-major, position fastest: a chunk's keys end after its last position
        ends = [min(kv_len, kv_len - q_len + max(i % q_len for i in range(c * r, min(rows, (c + 1) * r))) + 1)
                for c in range(chunks)]
        fraction = sum(ends) / (chunks * kv_len)
    scale = quantized_kv_bytes_per_element(bits, group_size, elem_bytes) / elem_bytes
    kv_issued = batch * kv_heads * chunks * 2 * kv_len * d * elem_bytes
    resident = min(residency(partial, gpu)["threadgroups"], math.ceil(partial.threadgroups / gpu.cores))
    kv_dram = unique_bytes_per_wave(partial.kv_reads, 2 * kv_len * d * elem_bytes / splits, resident, gpu)
    partial = replace(partial, name="attention_quantized_decode_partial", block=replace(partial.block, counts=counts),
                      blocks=max(1, round(partial.blocks * fraction)),
                      device_bytes=partial.device_bytes - kv_issued + kv_issued * scale * fraction,
                      dram_bytes=partial.dram_bytes - kv_dram + kv_dram * scale * fraction)
    return [partial, merge]


def mlx_dequantize_kernel(name: str, elements: int, bits: int, group_size: int, gpu: Gpu,
                          elem_bytes: int = 2) -> Kernel:
    """mx.dequantize's dispatch (MLX's affine_dequantize) over one quantized
    array, modelled as DRAM-bound: reads codes, scales and biases, writes the
    elements in q's dtype; a thread dequantizes one 32-bit word's codes."""
    per_thread = 32 // bits
    threads = 256
    threadgroups = math.ceil(elements / per_thread / threads)
    moved = elements * (quantized_kv_bytes_per_element(bits, group_size, elem_bytes) + elem_bytes)
    block = Block({"fma": per_thread * DEQUANTIZE_OPS_PER_ELEMENT + 4, "device_load": 3})
    return Kernel(name, threadgroups, threads, 24, 0, 1, block, 0.0, moved, moved)


def dequantize_then_steel_kernels(d: int, bits: int, group_size: int, batch: int, heads: int, kv_heads: int,
                                  q_len: int, kv_len: int, causal: bool, gpu: Gpu, elem_bytes: int = 2) -> list:
    """The unfused path MLX offers for quantized K/V prefill: mx.dequantize
    of K, then of V (each writing fp16 K/V to DRAM), then steel_attention
    (mlx_steel_tile) reading them."""
    elements = batch * kv_heads * kv_len * d
    return [mlx_dequantize_kernel("dequantize K", elements, bits, group_size, gpu, elem_bytes),
            mlx_dequantize_kernel("dequantize V", elements, bits, group_size, gpu, elem_bytes),
            prefill_kernel("steel_attention", mlx_steel_tile(d), batch, heads, kv_heads, q_len, kv_len, causal, gpu,
                           elem_bytes)]


# ---------------------------------------------------------------- decode over quantized K/V
# Per-thread registers the quantized loader holds beyond the float one:
# ASSUMED 3: while it loads, a lane's packed word, scale and bias of the
# triple it is dequantizing (transient; the dequantized values go into the
# float decode's k and v slices). Its pointers, strides and row bases are
# uniform across the simdgroup (from the threadgroup's indices and constant
# buffers), as ContiguousKV's are: Apple GPUs keep such values in uniform
# registers (Dougall Johnson's G13 architecture reference), not in the
# per-thread file counted here.
QUANTIZED_LOADER_REGISTERS = 3


def our_quantized_decode_kernels(batch: int, heads: int, kv_heads: int, kv_len: int, d: int, gpu: Gpu, splits: int,
                                 rows_per_threadgroup: int, bits: int, group_size: int, elem_bytes: int = 2,
                                 prefetch: int = 1, single_dispatch: bool = False, lane_merge: bool = True,
                                 simdgroups: int = 4, paged: bool = False) -> list:
    """metal/attention_quantized.h: our_decode_kernels' structure (the float
    decode's body with the QuantizedKV loader, and its merge) reading the
    triple instead of float K/V: per key and simdgroup, for K and for V,
    the row's packed words, scales and biases once (dequantize_slice: a
    lane reads its scale, bias and word(s); the lanes of a group, and of a
    shared word, take them by simd_shuffle), and DEQUANTIZE_OPS_PER_ELEMENT - 1
    ALU ops per feature (no store in a staged dtype: dequantized in registers). Device and DRAM bytes from
    quantized_kv_bytes_per_element; the queries, outputs and partials as the
    float decode's."""
    kernels = our_decode_kernels(batch, heads, kv_heads, kv_len, d, gpu, splits, rows_per_threadgroup,
                                 simdgroups=simdgroups, elem_bytes=elem_bytes, prefetch=prefetch,
                                 single_dispatch=single_dispatch, lane_merge=lane_merge, paged=paged)
    partial = kernels[0]
    per_lane = d // 32
    words = max(1, per_lane * bits // 32)  # per lane and row
    shared_word = 1 if per_lane * bits < 32 else 0
    counts = dict(partial.block.counts)
    counts["device_load"] = 2 * (2 + words)  # K and V: scale, bias, word(s)
    counts["simd_shuffle"] = counts.get("simd_shuffle", 0) + 2 * (2 + shared_word)
    # per feature of K and V: the prefill loader's ops but the store in the staged dtype; three row addresses each
    counts["fma"] = counts.get("fma", 0) + 2 * (DEQUANTIZE_OPS_PER_ELEMENT - 1) * per_lane + 6
    float_head = 2 * kv_len * d * elem_bytes
    quantized_head = 2 * kv_len * d * quantized_kv_bytes_per_element(bits, group_size, elem_bytes)
    chunks = math.ceil((heads // kv_heads) / rows_per_threadgroup)
    issued = partial.device_bytes - batch * kv_heads * chunks * (float_head - quantized_head)
    # the float model's DRAM bytes other than K/V (queries, outputs or partials)
    resident = min(residency(partial, gpu)["threadgroups"], math.ceil(partial.threadgroups / gpu.cores))
    other = partial.dram_bytes - unique_bytes_per_wave(partial.kv_reads, float_head / splits, resident, gpu)
    quantized = replace(partial, name=partial.name.replace("attention_decode", "attention_quantized_decode"),
                        registers=partial.registers + QUANTIZED_LOADER_REGISTERS,
                        block=replace(partial.block, counts=counts), device_bytes=issued)
    return [_with_cache(quantized, gpu, quantized_head / splits, other), *kernels[1:]]
