"""Did this machine run mlx_attn's Metal kernels on a real GPU? (macOS workflow)

Prints the device, mx.metal.is_available(), and runs one prefill and one
decode call on the GPU with backend="fused" (the Metal kernels, compiled at
run time on the first call) against the reference path on the CPU. The
verdict goes to the log, to $GITHUB_STEP_SUMMARY and to $GITHUB_OUTPUT
(metal_kernels=executed|failed|not-executed).

Exit status: 0 when the kernels ran and matched; 1 when they ran and did not
match or failed to run on a GPU MLX says is there; when Metal is not there
at all, 1 with --require-gpu, else 0 with a loud "Metal kernels NOT executed"
(a hosted runner's paravirtual GPU may expose no usable Metal device).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

import mlx_attn
from mlx_attn import _ext
from mlx_attn.reference import reference_attention

# (name, [B, Hq, Hkv, Tq, Tkv, D], dtype, mask, tolerance): as tests/test_metal_kernels.py.
CASES = [
    ("prefill", (1, 4, 2, 77, 130, 64), mx.float16, "causal", 4e-3),
    ("decode", (1, 8, 2, 1, 300, 128), mx.float32, None, 2e-5),
]


def device_description() -> str:
    try:
        info = mx.metal.device_info() if mx.metal.is_available() else mx.device_info()
    except Exception as error:  # no Metal device: say why
        return f"unknown ({error})"
    return ", ".join(f"{k}={info[k]}" for k in ("device_name", "architecture", "memory_size") if k in info)


def run_case(shape, dtype, mask, seed=0):
    """(max error vs the reference, first-call seconds, second-call seconds)."""
    b, hq, hkv, tq, tkv, d = shape
    rng = np.random.default_rng(seed)
    q, k, v = (mx.array(rng.standard_normal(s).astype(np.float32)).astype(dtype)
               for s in ((b, hq, tq, d), (b, hkv, tkv, d), (b, hkv, tkv, d)))
    timings = []
    for _ in range(2):
        start = time.perf_counter()
        out = mlx_attn.scaled_dot_product_attention(q, k, v, scale=d**-0.5, mask=mask, backend="fused",
                                                   stream=mx.gpu)
        mx.eval(out)
        timings.append(time.perf_counter() - start)
    want = reference_attention(q, k, v, scale=d**-0.5, mask=mask, stream=mx.cpu)
    got = np.array(out.astype(mx.float32))
    error = float(np.abs(got - np.array(want.astype(mx.float32))).max()) if np.isfinite(got).all() else float("inf")
    return error, timings[0], timings[1]


def probe() -> tuple[str, str, list[str]]:
    """(outcome: executed|failed|not-executed, verdict, report lines)."""
    lines = [f"- machine: {platform.platform()} ({platform.machine()})",
             f"- mlx {mx.__version__}, mlx_attn built with MLX {_ext.built_with_mlx}, "
             f"extension has Metal: {_ext.has_metal()}",
             f"- mx.metal.is_available(): {mx.metal.is_available()}",
             f"- device: {device_description()}",
             f"- prebuilt mlx_attn.metallib installed: "
             f"{(Path(_ext.__file__).parent / 'mlx_attn.metallib').exists()} (else: run-time compile)"]
    if not (mx.metal.is_available() and _ext.has_metal()):
        return "not-executed", "Metal kernels NOT executed: no Metal device/build here", lines
    failed = False
    for name, shape, dtype, mask, tolerance in CASES:
        try:
            error, first, second = run_case(shape, dtype, mask)
        except Exception as exc:  # a GPU that cannot run custom kernels
            lines.append(f"- {name}: FAILED to run on the GPU: {type(exc).__name__}: {exc}")
            failed = True
            continue
        ok = error <= tolerance
        failed |= not ok
        lines.append(f"- {name} {shape} {dtype}: max error {error:.3g} (tolerance {tolerance:g}) "
                     f"{'ok' if ok else 'WRONG'}; first call {first * 1e3:.1f} ms "
                     f"(includes the run-time compile), second {second * 1e3:.2f} ms")
    if failed:
        return "failed", "Metal kernels FAILED on this GPU", lines
    return "executed", "Metal kernels EXECUTED on a real GPU and match the reference", lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--require-gpu", action="store_true", help="fail when the kernels could not be executed")
    args = parser.parse_args()
    outcome, verdict, lines = probe()
    failed = outcome == "failed" or (outcome == "not-executed" and args.require_gpu)
    if outcome == "not-executed" and args.require_gpu:
        verdict += " (a GPU was required)"
    report = "\n".join([f"## {verdict}", *lines]) + "\n"
    print(report)
    if outcome != "executed":
        print(f"::{'error' if failed else 'warning'}::{verdict}")
    if os.environ.get("GITHUB_STEP_SUMMARY"):
        with open(os.environ["GITHUB_STEP_SUMMARY"], "a") as summary:
            summary.write(report)
    if os.environ.get("GITHUB_OUTPUT"):
        with open(os.environ["GITHUB_OUTPUT"], "a") as output:
            output.write(f"metal_kernels={outcome}\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
