"""The per-ISA copies of the fused CPU kernel, built without MLX into the
standalone harness (tests/cpu_harness/harness.cpp) and compared with its
scalar double-precision reference over one grid: the arm64 NEON copy cross-
compiled with clang and run under qemu-aarch64, and the copies this host runs
natively. Compile flags are read from CMakeLists.txt, their one home.

Needs clang (clang-19) and, for arm64 on x86-64, qemu-aarch64 and an aarch64
C library (Debian: qemu-user, libc6-dev-arm64-cross, gcc-aarch64-linux-gnu;
scripts/test.sh installs them). Missing tools skip these tests with the reason,
except on CI (CI set), where they fail."""

import os
import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "tests" / "cpu_harness" / "harness.cpp"
CMAKE = ROOT / "CMakeLists.txt"
AARCH64_LIBC = Path("/usr/aarch64-linux-gnu/lib/libc.a")
# The harness uses no STL; leaving out the C++ library headers lets a cross
# build work with only a C library installed.
COMMON_FLAGS = ["-std=c++20", "-nostdinc++", "-fno-exceptions", "-fno-rtti", f"-I{ROOT}"]
# The number of grid cases the harness runs per copy (two query blocks each).
CASES_PER_COPY = 668


def _missing(reason):
    if os.environ.get("CI"):
        pytest.fail(f"the CPU kernel harness cannot run on CI: {reason}")
    pytest.skip(f"CPU kernel harness not set up here (on CI this fails): {reason}")


def _clang():
    for name in ("clang-19", "clang"):
        if shutil.which(name):
            return name
    _missing("clang (clang-19) not found")


def kernel_flags():
    """MLX_ATTN_KERNEL_FLAGS and each unit's extra options, as CMakeLists.txt sets them."""
    text = CMAKE.read_text()
    common = re.search(r"set\(MLX_ATTN_KERNEL_FLAGS ([^)]*)\)", text)
    assert common, "CMakeLists.txt no longer sets MLX_ATTN_KERNEL_FLAGS"
    per_unit = {
        m.group(1): m.group(2).split(";")
        for m in re.finditer(r"csrc/cpu/kernel_(\w+)\.cpp PROPERTIES\s+COMPILE_OPTIONS \"([^\"]*)\"", text)
    }
    return common.group(1).split(), per_unit


def build_harness(out_dir, target_args, units, define):
    """Compiles the harness and the kernel units (in parallel), links them; returns the binary."""
    clang = _clang()
    common, per_unit = kernel_flags()
    compile_cxx = [clang, "-x", "c++", *target_args, *COMMON_FLAGS]
    jobs = [[*compile_cxx, "-O2", f"-D{define}", "-c", str(HARNESS), "-o", str(out_dir / "harness.o")]]
    for unit in units:
        jobs.append([*compile_cxx, *common, *per_unit.get(unit, []),
                     "-c", str(ROOT / "csrc" / "cpu" / f"kernel_{unit}.cpp"),
                     "-o", str(out_dir / f"kernel_{unit}.o")])
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for cmd in jobs]
    for cmd, proc in zip(jobs, procs):
        out, _ = proc.communicate()
        assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{out}"
    binary = out_dir / "harness"
    objects = [str(out_dir / "harness.o")] + [str(out_dir / f"kernel_{u}.o") for u in units]
    link = subprocess.run([clang, *target_args, *objects, "-lm", "-o", str(binary)],
                          capture_output=True, text=True)
    assert link.returncode == 0, f"linking the harness failed:\n{link.stdout}{link.stderr}"
    return binary


def run_harness(command, copies, expected):
    """Runs the harness on `copies` (all when empty); each of `expected` must pass the whole grid."""
    result = subprocess.run([*command, *copies], capture_output=True, text=True, timeout=1800)
    report = result.stdout + result.stderr
    assert result.returncode == 0, report
    for copy in expected:
        assert f"{copy}: {CASES_PER_COPY} cases, 0 failures" in report, report
    return report


ARM64_UNITS = ["neon", "generic"]


def test_arm64_neon_copy_matches_the_reference_under_qemu(tmp_path):
    if platform.machine().lower() in ("aarch64", "arm64"):
        binary = build_harness(tmp_path, [], ARM64_UNITS, "HARNESS_ARM64")
        run_harness([str(binary)], [], ARM64_UNITS)
        return
    if not shutil.which("qemu-aarch64"):
        _missing("qemu-aarch64 not found (Debian: qemu-user)")
    if not AARCH64_LIBC.exists():
        _missing(f"{AARCH64_LIBC} not found (Debian: libc6-dev-arm64-cross, gcc-aarch64-linux-gnu)")
    # Static, so qemu needs no aarch64 loader or library path. Only the NEON
    # copy runs (emulation is slow); arm64's generic copy is the same source
    # with a smaller register tile, which the x86 generic copy covers.
    binary = build_harness(tmp_path, ["--target=aarch64-linux-gnu", "-static"], ARM64_UNITS, "HARNESS_ARM64")
    run_harness(["qemu-aarch64", str(binary)], ["neon"], ["neon"])


def test_x86_copies_match_the_reference_on_the_same_grid(tmp_path):
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the x86-64 copies are built on x86-64 hosts only")
    binary = build_harness(tmp_path, [], ["avx512bf16", "avx512", "avx2", "generic"], "HARNESS_X86")
    report = run_harness([str(binary)], [], ["generic"])
    for copy in ("avx512bf16", "avx512", "avx2"):
        assert f"{copy}: {CASES_PER_COPY} cases, 0 failures" in report or \
            f"{copy}: not supported by this CPU" in report, report
