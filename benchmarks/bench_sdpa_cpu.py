"""CPU benchmark of scaled dot-product attention: mlx_attn's fused kernel vs
mx.fast.scaled_dot_product_attention on the CPU stream, the pure-MLX reference
path and (when installed) PyTorch's CPU scaled_dot_product_attention with the
same number of threads.

Prints a table (time, GFLOP/s, the fused kernel's fraction of the machine's
measured FMA peak, extra peak memory, speed-up of the fused kernel over each
baseline measured in the same run), saves it as JSON (with the CPU model and
its ISA features) and a PNG plot. The fused kernel and PyTorch are timed
interleaved (fused, torch, fused, torch, ...), best of --repeats each, so load
from other processes hits both alike; --busy adds such a load on purpose (one
process spinning) to see how the ratio holds up under contention.

--contention N measures that effect per row within one run: N rounds, each
timing fused and torch once on the machine as it is and once with a spinning
process started for the round; the row reports the median fused/torch ratio
of each state and its change under load (busy median / quiet median - 1),
so a single noisy round does not decide it.

The FMA peak of each kernel copy is measured, not looked up: a small C
program (an FMA loop on independent register-resident accumulators, one
thread per core) is compiled for the copy's vector width and run.

    python benchmarks/bench_sdpa_cpu.py                   # full grid
    python benchmarks/bench_sdpa_cpu.py --quick           # a small smoke run
    python benchmarks/bench_sdpa_cpu.py --lengths 4096 --dtypes float32 float16 bfloat16 \
        --max-baseline-len 0 --long-context 0 --contention 3   # the README table
    python benchmarks/bench_sdpa_cpu.py --isa avx512bf16 ...    # a named kernel copy

Every row names the kernel copy it ran (the doctor's "CPU kernel ISA": the
widest copy the CPU supports, or --isa / MLX_ATTN_CPU_ISA), and the header the
CPU model.

The slow unfused baselines are only run up to --max-baseline-len (they need
O(T^2) memory and minutes per call beyond it).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

import mlx_attn
from mlx_attn import _ext

from kernel_lab.host import cpu_description

try:
    import torch
except ImportError:  # optional, for comparison only
    torch = None

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}

# The FMA throughput probe: ACCUMULATORS independent vector FMA chains (enough
# to cover FMA latency x pipes on current cores) that stay in registers.
FMA_PEAK_SOURCE = r"""
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
typedef float vf __attribute__((vector_size(VEC_BYTES)));
enum { ACCUMULATORS = 12, LANES = VEC_BYTES / 4 };
static long iterations;
static void* spin(void* out) {
  vf acc[ACCUMULATORS], a = {0}, b = {0};
  for (int i = 0; i < ACCUMULATORS; ++i) acc[i] = a + (float)i;
  a += 0.999999f; b += 1e-7f;
  for (long n = 0; n < iterations; ++n) {
    for (int i = 0; i < ACCUMULATORS; ++i) acc[i] = acc[i] * a + b;
  }
  float sum = 0;
  for (int i = 0; i < ACCUMULATORS; ++i) sum += acc[i][0];
  *(float*)out = sum;
  return 0;
}
int main(int argc, char** argv) {
  int threads = atoi(argv[1]);
  iterations = atol(argv[2]);
  pthread_t t[256];
  float sink[256];
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (int i = 0; i < threads; ++i) pthread_create(&t[i], 0, spin, &sink[i]);
  for (int i = 0; i < threads; ++i) pthread_join(t[i], 0);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  double s = (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec);
  printf("%f %f\n", 2.0 * threads * iterations * ACCUMULATORS * LANES / s / 1e9, sink[0]);
  return 0;
}
"""
# Vector width and compiler flags of each kernel copy's FMA probe (the flags
# only need to enable the copy's vector FMA; "generic" is SSE2 mul + add).
# avx512bf16 is measured against the float32 FMA peak too: its float32 and
# fp16 work is float32 FMAs (vdpbf16ps, bf16 only, does twice the flops).
PEAK_PROBES = {
    "avx512amx": (64, ["-mavx512f", "-mfma"]),
    "avx512bf16": (64, ["-mavx512f", "-mfma"]),
    "avx512": (64, ["-mavx512f", "-mfma"]),
    "avx2": (32, ["-mavx2", "-mfma"]),
    "generic": (16, []),
    "neon": (16, []),
}


def fma_peak_gflops(isa: str, threads: int, repeats: int = 3) -> float | None:
    """Best of `repeats` runs of the FMA probe for `isa`, GFLOP/s over `threads` threads."""
    compiler = next((c for c in ("clang-19", "clang", "cc", "gcc") if shutil.which(c)), None)
    if compiler is None or isa not in PEAK_PROBES:
        return None
    vec_bytes, flags = PEAK_PROBES[isa]
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "fma_peak.c", Path(tmp) / "fma_peak"
        src.write_text(FMA_PEAK_SOURCE)
        build = subprocess.run(
            [compiler, "-O2", f"-DVEC_BYTES={vec_bytes}", *flags, str(src), "-o", str(exe), "-lpthread"],
            capture_output=True, text=True,
        )
        if build.returncode != 0:
            print(f"FMA probe for {isa} did not build: {build.stderr.strip()[:200]}")
            return None
        runs = [float(subprocess.run([str(exe), str(threads), "20000000"], capture_output=True,
                                     text=True, check=True).stdout.split()[0]) for _ in range(repeats)]
    return max(runs)


def _spin():
    while True:
        pass


class BusyProcess:
    """One process spinning on a core while the block runs."""

    def __enter__(self):
        self.process = multiprocessing.Process(target=_spin, daemon=True)
        self.process.start()
        return self

    def __exit__(self, *exc):
        self.process.terminate()
        self.process.join()


def attention_flops(batch, heads, q_len, kv_len, d, dv, causal):
    """Multiply-adds of Q.K^T and P.V, counted as 2 FLOPs each; causal counts
    only the visible half (what an ideal kernel computes)."""
    pairs = q_len * kv_len
    if causal:
        pairs = sum(min(kv_len, i + 1 + kv_len - q_len) for i in range(q_len))
    return 2.0 * batch * heads * pairs * (d + dv)


def threads_used() -> int:
    env = os.environ.get("MLX_ATTN_NUM_THREADS")
    return int(env) if env else os.cpu_count() or 1


def time_call(fn, repeats: int) -> float:
    """Best seconds of `repeats` calls after one warm-up call."""
    return time_interleaved([fn], repeats)[0]


def time_interleaved(fns, repeats: int) -> list[float]:
    """Best seconds of each function over `repeats` rounds that call them in
    turn (after one warm-up round), so changing load hits all alike."""
    best = [float("inf")] * len(fns)
    for round_index in range(repeats + 1):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            if round_index > 0:
                best[i] = min(best[i], time.perf_counter() - start)
    return best


def mlx_runner(impl, q, k, v, causal):
    mask = "causal" if causal else None
    scale = q.shape[-1] ** -0.5
    if impl == "fused":
        return lambda: mx.eval(
            mlx_attn.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, backend="fused")
        )
    if impl == "reference":
        return lambda: mx.eval(
            mlx_attn.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, backend="reference")
        )
    if impl == "mx.fast":
        return lambda: mx.eval(
            mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, stream=mx.cpu)
        )
    raise ValueError(impl)


def extra_peak_memory(fn) -> int:
    """Peak bytes MLX allocated during fn beyond what was live before."""
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    fn()
    mx.synchronize()
    return mx.get_peak_memory() - base


def torch_runner(batch, heads, t, d, dtype_name, causal):
    tdtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype_name]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, heads, t, d, generator=gen, dtype=tdtype) for _ in range(3))

    def run():
        with torch.inference_mode():
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def benchmark(args, peak):
    mx.set_default_device(mx.cpu)
    if torch is not None:
        torch.set_num_threads(threads_used())
    rows = []
    for d in args.head_dims:
        for dtype_name in args.dtypes:
            dtype = DTYPES[dtype_name]
            for causal in (False, True):
                for t in args.lengths:
                    rng = np.random.default_rng(0)
                    q, k, v = (
                        mx.array(rng.standard_normal((1, args.heads, t, d)).astype(np.float32)).astype(dtype)
                        for _ in range(3)
                    )
                    mx.eval(q, k, v)
                    flops = attention_flops(1, args.heads, t, t, d, d, causal)
                    row = {"D": d, "dtype": dtype_name, "causal": causal, "T": t, "isa": _ext.cpu_isa()}
                    # Fused and torch interleaved, best of --repeats each.
                    fused_fn = mlx_runner("fused", q, k, v, causal)
                    timed = {"fused": fused_fn}
                    if torch is not None:
                        timed["torch"] = torch_runner(1, args.heads, t, d, dtype_name, causal)
                    for impl, seconds in zip(timed, time_interleaved(list(timed.values()), args.repeats)):
                        row[impl] = {"ms": seconds * 1e3, "gflops": flops / seconds / 1e9}
                    if args.contention and "torch" in timed:
                        row["contention"] = contention_ratios(timed, args.contention, args.repeats)
                    row["fused"]["extra_peak_mib"] = extra_peak_memory(fused_fn) / 2**20
                    if peak:
                        row["fused"]["peak_fraction"] = row["fused"]["gflops"] / peak
                    if t <= args.max_baseline_len:
                        for impl in ("mx.fast", "reference"):
                            fn = mlx_runner(impl, q, k, v, causal)
                            seconds = time_call(fn, 1)
                            row[impl] = {
                                "ms": seconds * 1e3,
                                "gflops": flops / seconds / 1e9,
                                "extra_peak_mib": extra_peak_memory(fn) / 2**20,
                            }
                    row["load_average"] = os.getloadavg()[0]  # other processes' share of the run
                    rows.append(row)
                    print_row(row, flush=True)
    return rows


def contention_ratios(timed, rounds: int, repeats: int) -> dict:
    """fused/torch speed ratios over `rounds` rounds of (quiet, busy) pairs,
    and the change of the median under load."""
    ratios = {"quiet": [], "busy": []}
    fns = [timed["fused"], timed["torch"]]
    for _ in range(rounds):
        fused, torch_s = time_interleaved(fns, repeats)
        ratios["quiet"].append(torch_s / fused)
        with BusyProcess():
            fused, torch_s = time_interleaved(fns, repeats)
        ratios["busy"].append(torch_s / fused)
    quiet, busy = statistics.median(ratios["quiet"]), statistics.median(ratios["busy"])
    return {"quiet_ratios": ratios["quiet"], "busy_ratios": ratios["busy"],
            "quiet_median": quiet, "busy_median": busy, "change": busy / quiet - 1}


IMPLS = ["fused", "mx.fast", "reference", "torch"]


def header():
    cols = ["D", "dtype", "causal", "T", "kernel"]
    for impl in IMPLS:
        cols += [f"{impl} ms", f"{impl} GFLOP/s"]
    cols += ["fused % of FMA peak", "fused MiB", "unfused MiB", "vs mx.fast", "vs torch", "load average"]
    return "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols)


def print_row(row, flush=False):
    cells = [str(row["D"]), row["dtype"], "yes" if row["causal"] else "no", str(row["T"]), row.get("isa", "-")]
    for impl in IMPLS:
        r = row.get(impl)
        cells += [f"{r['ms']:.1f}", f"{r['gflops']:.1f}"] if r else ["-", "-"]
    fraction = row["fused"].get("peak_fraction")
    cells.append(f"{100 * fraction:.0f}%" if fraction is not None else "-")
    cells.append(f"{row['fused']['extra_peak_mib']:.1f}")
    cells.append(f"{row['mx.fast']['extra_peak_mib']:.0f}" if "mx.fast" in row else "-")
    for base in ("mx.fast", "torch"):
        cells.append(f"{row[base]['ms'] / row['fused']['ms']:.2f}x" if base in row else "-")
    cells.append(f"{row['load_average']:.1f}" if "load_average" in row else "-")
    print("| " + " | ".join(cells) + " |", flush=flush)


def summary_table(rows) -> str:
    """The compact Markdown table quoted in the README."""
    contention = any("contention" in r for r in rows)
    head = ["D", "dtype", "causal", "T", "kernel", "fused ms", "fused GFLOP/s", "% of FMA peak", "mx.fast GFLOP/s",
            "torch ms", "torch GFLOP/s", "fused vs mx.fast", "fused vs torch", "fused extra MiB", "load average"]
    if contention:
        head += ["vs torch, quiet (median)", "vs torch, busy (median)", "change under load"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        f = r["fused"]
        cells = [str(r["D"]), r["dtype"], "yes" if r["causal"] else "no", str(r["T"]), r.get("isa", "-"), f"{f['ms']:.1f}",
                 f"{f['gflops']:.0f}"]
        cells.append(f"{100 * f['peak_fraction']:.0f}%" if "peak_fraction" in f else "-")
        cells.append(f"{r['mx.fast']['gflops']:.1f}" if "mx.fast" in r else "-")
        cells += [f"{r['torch']['ms']:.1f}", f"{r['torch']['gflops']:.0f}"] if "torch" in r else ["-", "-"]
        cells.append(f"{r['mx.fast']['ms'] / f['ms']:.0f}x" if "mx.fast" in r else "-")
        cells.append(f"{r['torch']['ms'] / f['ms']:.2f}x" if "torch" in r else "-")
        cells.append(f"{f['extra_peak_mib']:.1f}")
        cells.append(f"{r['load_average']:.1f}" if "load_average" in r else "-")
        if contention:
            c = r.get("contention")
            cells += [f"{c['quiet_median']:.2f}x", f"{c['busy_median']:.2f}x", f"{100 * c['change']:+.0f}%"] if c else ["-"] * 3
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def long_context_memory(heads, t, d):
    """Extra peak memory of the fused kernel at a long context, next to the
    score matrix an unfused implementation has to hold (B*H*T*T float32)."""
    rng = np.random.default_rng(0)
    q, k, v = (mx.array(rng.standard_normal((1, heads, t, d)).astype(np.float32)) for _ in range(3))
    mx.eval(q, k, v)
    fn = mlx_runner("fused", q, k, v, True)
    extra = extra_peak_memory(fn)
    output = heads * t * d * 4
    return {
        "T": t,
        "heads": heads,
        "fused_extra_peak_mib": extra / 2**20,
        "fused_extra_beyond_output_mib": (extra - output) / 2**20,
        "unfused_scores_mib": heads * t * t * 4 / 2**20,
    }


def plot(rows, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    combos = sorted({(r["D"], r["dtype"], r["causal"]) for r in rows})
    cols = 4
    fig, axes = plt.subplots(
        (len(combos) + cols - 1) // cols, cols, figsize=(4.2 * cols, 3.4 * ((len(combos) + cols - 1) // cols)),
        squeeze=False,
    )
    for ax, (d, dtype, causal) in zip(axes.flat, combos):
        sel = [r for r in rows if (r["D"], r["dtype"], r["causal"]) == (d, dtype, causal)]
        for impl, style in zip(IMPLS, ["o-", "s--", "^:", "d-."]):
            pts = [(r["T"], r[impl]["gflops"]) for r in sel if impl in r]
            if pts:
                ax.plot(*zip(*pts), style, label=impl)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"D={d} {dtype} {'causal' if causal else 'full'}", fontsize=10)
        ax.set_xlabel("sequence length T")
        ax.set_ylabel("GFLOP/s")
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(combos):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"Attention on the CPU (B=1, H={rows[0].get('H', 8)}, {threads_used()} threads, kernel {_ext.cpu_isa()})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--dtypes", nargs="+", default=["float32", "float16", "bfloat16"], choices=list(DTYPES))
    p.add_argument("--isa", choices=list(_ext.supported_cpu_isas()),
                   help="the kernel copy to run (default: the widest this CPU supports)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-baseline-len", type=int, default=4096)
    p.add_argument("--long-context", type=int, default=16384, help="T of the memory check (0: skip)")
    p.add_argument("--busy", action="store_true", help="run one spinning process alongside (contention)")
    p.add_argument("--contention", type=int, default=0, metavar="ROUNDS",
                   help="per row, ROUNDS rounds of fused/torch timed quiet and with a spinning process (0: off)")
    p.add_argument("--quick", action="store_true", help="tiny grid, for a smoke test")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args(argv)
    if args.quick:
        args.lengths, args.head_dims, args.dtypes = [128, 256], [64], ["float32"]
        args.repeats, args.long_context = 1, 1024

    if args.isa:
        _ext.set_cpu_isa(args.isa)
    args.out.mkdir(parents=True, exist_ok=True)
    cpu = cpu_description()
    load_at_start = os.getloadavg()[0]
    peaks = {isa: fma_peak_gflops(isa, threads_used()) for isa in _ext.supported_cpu_isas()}
    print(
        f"mlx {mx.__version__}, mlx_attn kernel {_ext.cpu_isa()}, {threads_used()} threads, "
        f"torch {torch.__version__ if torch else 'not installed'}, CPU {cpu['model']} ({cpu.get('vendor_id', '?')} "
        f"family {cpu.get('cpu_family', '?')} model {cpu.get('model_number', '?')}), "
        f"load average {load_at_start:.1f}{', one busy process added' if args.busy else ''}"
    )
    print("measured FMA peak (GFLOP/s, all threads): "
          + ", ".join(f"{isa} {p:.0f}" if p else f"{isa} -" for isa, p in peaks.items()))
    print(header())
    if args.busy and args.contention:
        p.error("--busy and --contention exclude each other (--contention starts its own busy process per round)")
    if args.busy:
        with BusyProcess():
            rows = benchmark(args, peaks.get(_ext.cpu_isa()))
    else:
        rows = benchmark(args, peaks.get(_ext.cpu_isa()))
    for r in rows:
        r["H"] = args.heads
    result = {
        "rows": rows, "isa": _ext.cpu_isa(), "threads": threads_used(), "mlx": mx.__version__,
        "cpu": cpu, "fma_peak_gflops": peaks, "busy_process": args.busy,
        "load_average_at_start": load_at_start,
        "torch": torch.__version__ if torch else None,
    }
    if args.long_context:
        mem = long_context_memory(args.heads, args.long_context, 64)
        result["long_context_memory"] = mem
        print(
            f"\nT={mem['T']}, H={mem['heads']}, D=64 causal fp32: fused extra peak {mem['fused_extra_peak_mib']:.1f} MiB "
            f"({mem['fused_extra_beyond_output_mib']:.2f} MiB beyond the output); an unfused score matrix "
            f"alone is {mem['unfused_scores_mib']:.0f} MiB"
        )
    (args.out / "bench_sdpa_cpu.json").write_text(json.dumps(result, indent=1))
    table = summary_table(rows)
    print("\n" + table)
    (args.out / "bench_sdpa_cpu.md").write_text(table + "\n")
    plot(rows, args.out / "bench_sdpa_cpu.png")
    print(f"\nsaved {args.out / 'bench_sdpa_cpu.json'}, .md and .png")
    return result


if __name__ == "__main__":
    main()
