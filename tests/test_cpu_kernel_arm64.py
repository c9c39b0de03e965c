"""The per-ISA copies of the fused CPU kernel, forward and backward, built
without MLX into the standalone harness (tests/cpu_harness/harness.cpp) and
compared with its scalar double-precision reference: the arm64 copies (neon,
and the native fp16/bf16 neonfhm and neonbf16) cross-compiled with clang and
run under qemu-aarch64 on a CPU model with FEAT_FHM and FEAT_BF16 (`max`) and
one without (`cortex-a57`, where the hwcaps rule must offer neither), and the
copies this host runs natively. Compile flags are read from CMakeLists.txt,
their one home. Under qemu the forward copies run every third grid case by
default, the whole grid with MLX_ATTN_FULL_GRID=1.

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
# The number of grid cases the harness runs per forward copy (two query
# blocks each; every third with --sample) and per backward copy (6 problems
# x 3 dtypes, each through both schemes).
CASES_PER_COPY = 680
SAMPLED_CASES_PER_COPY = 228
BACKWARD_CASES_PER_COPY = 36


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
    """MLX_ATTN_KERNEL_FLAGS and each unit's extra options (by file stem, e.g.
    "kernel_avx2"), as CMakeLists.txt sets them."""
    text = CMAKE.read_text()
    common = re.search(r"set\(MLX_ATTN_KERNEL_FLAGS ([^)]*)\)", text)
    assert common, "CMakeLists.txt no longer sets MLX_ATTN_KERNEL_FLAGS"
    per_unit = {}
    for files, options in re.findall(r"set_source_files_properties\(([^)]*?) PROPERTIES\s+COMPILE_OPTIONS \"([^\"]*)\"",
                                     text):
        for stem in re.findall(r"csrc/cpu/(\w+)\.cpp", files):
            per_unit[stem] = options.split(";")
    return common.group(1).split(), per_unit


def build_harness(out_dir, target_args, units, define):
    """Compiles the harness and the kernel units (file stems under csrc/cpu, in
    parallel), links them; returns the binary."""
    clang = _clang()
    common, per_unit = kernel_flags()
    compile_cxx = [clang, "-x", "c++", *target_args, *COMMON_FLAGS]
    jobs = [[*compile_cxx, "-O2", f"-D{define}", "-c", str(HARNESS), "-o", str(out_dir / "harness.o")]]
    for unit in units:
        jobs.append([*compile_cxx, *common, *per_unit.get(unit, []),
                     "-c", str(ROOT / "csrc" / "cpu" / f"{unit}.cpp"), "-o", str(out_dir / f"{unit}.o")])
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for cmd in jobs]
    for cmd, proc in zip(jobs, procs):
        out, _ = proc.communicate()
        assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{out}"
    binary = out_dir / "harness"
    objects = [str(out_dir / "harness.o")] + [str(out_dir / f"{u}.o") for u in units]
    link = subprocess.run([clang, *target_args, *objects, "-lm", "-o", str(binary)],
                          capture_output=True, text=True)
    assert link.returncode == 0, f"linking the harness failed:\n{link.stdout}{link.stderr}"
    return binary


def passed(report, copy, cases):
    return f"{copy}: {cases} cases, 0 failures" in report


def run_harness(command, args, forward=(), backward=(), sample=False):
    """Runs the harness with `args`; each copy of `forward` / `backward` must
    pass its whole grid (the forward's every third case with `sample`)."""
    result = subprocess.run([*command, *(["--sample"] if sample else []), *args],
                            capture_output=True, text=True, timeout=1800)
    report = result.stdout + result.stderr
    assert result.returncode == 0, report
    for copy in forward:
        assert passed(report, copy, SAMPLED_CASES_PER_COPY if sample else CASES_PER_COPY), report
    for copy in backward:
        assert passed(report, copy, BACKWARD_CASES_PER_COPY), report
    return report


# The harness's forward copies (widest first, as the dispatcher orders them,
# csrc/cpu/kernel_<copy>.cpp) and backward copies (backward_<isa>.cpp).
ARM64_FORWARD = ["neonbf16", "neonfhm", "neon", "generic"]
ARM64_BACKWARD = ["neon_backward", "generic_backward"]
X86_FORWARD = ["avx512amx", "avx512bf16", "avx512", "avx2", "generic"]
X86_BACKWARD = ["avx512amx_backward", "avx512_backward", "avx2_backward", "generic_backward"]


def units(forward, backward):
    return [f"kernel_{c}" for c in forward] + [f"backward_{c.removesuffix('_backward')}" for c in backward]


def full_grid():
    return os.environ.get("MLX_ATTN_FULL_GRID") == "1"


@pytest.fixture(scope="module")
def arm64_harness(tmp_path_factory):
    """The arm64 harness and the command prefix that runs it (qemu-aarch64 on
    other hosts: static, so qemu needs no aarch64 loader or library path)."""
    out = tmp_path_factory.mktemp("arm64_harness")
    if platform.machine().lower() in ("aarch64", "arm64"):
        return build_harness(out, [], units(ARM64_FORWARD, ARM64_BACKWARD), "HARNESS_ARM64"), []
    if not shutil.which("qemu-aarch64"):
        _missing("qemu-aarch64 not found (Debian: qemu-user)")
    if not AARCH64_LIBC.exists():
        _missing(f"{AARCH64_LIBC} not found (Debian: libc6-dev-arm64-cross, gcc-aarch64-linux-gnu)")
    binary = build_harness(out, ["--target=aarch64-linux-gnu", "-static"], units(ARM64_FORWARD, ARM64_BACKWARD),
                           "HARNESS_ARM64")
    return binary, ["qemu-aarch64"]


def qemu(cpu):
    """qemu-aarch64 emulating CPU model `cpu`."""
    if platform.machine().lower() in ("aarch64", "arm64"):
        pytest.skip("runs natively on this arm64 host: the CPU model cannot be chosen")
    return ["qemu-aarch64", "-cpu", cpu]


def test_arm64_copies_match_the_reference_under_qemu(arm64_harness):
    """Every arm64 copy on a CPU with FEAT_FHM and FEAT_BF16 (qemu's `max`):
    the native fp16 (FMLAL) and bf16 (BFDOT) score products, baseline NEON,
    and the NEON backward. By default the forward copies run every third grid
    case (emulation is slow), the full grid with MLX_ATTN_FULL_GRID=1; arm64's
    generic copies are the x86 generic source with the same tile, which the
    x86 test covers."""
    binary, runner = arm64_harness
    if runner:
        command = qemu("max") + [str(binary)]
        assert run_harness(command, ["--cpu"]).split() == ["supported:", *ARM64_FORWARD]
    else:  # natively: the copies this CPU runs (test_fused_cpu.py checks which)
        command = [str(binary)]
    forward = [c for c in run_harness(command, ["--cpu"]).split()[1:] if c != "generic"]
    run_harness(command, [*forward, "neon_backward"], forward, ["neon_backward"], sample=not full_grid())


def _mnemonics(obj):
    objdump = next((t for t in ("llvm-objdump-19", "llvm-objdump") if shutil.which(t)), None)
    if objdump is None:
        _missing("llvm-objdump (llvm-19) not found")
    listing = subprocess.run([objdump, "-d", str(obj)], capture_output=True, text=True, check=True).stdout
    # Instruction lines: "  addr: bytes\tmnemonic\toperands".
    return {fields[1] for line in listing.splitlines() if len(fields := line.split("\t")) > 1}


def test_native_copies_multiply_with_the_native_instructions(arm64_harness):
    """The reduced-precision products are really FMLAL/FMLAL2 and BFDOT (and
    not in the baseline copies, which must run on any ARMv8.0 core)."""
    binary, _ = arm64_harness
    found = {unit: _mnemonics(binary.parent / f"{unit}.o")
             for unit in ("kernel_neonfhm", "kernel_neonbf16", "kernel_neon", "backward_neon", "kernel_generic")}
    assert {"fmlal", "fmlal2"} <= found["kernel_neonfhm"] and "bfdot" not in found["kernel_neonfhm"]
    assert {"fmlal", "fmlal2", "bfdot"} <= found["kernel_neonbf16"]
    for baseline in ("kernel_neon", "backward_neon", "kernel_generic"):
        assert not {"fmlal", "fmlal2", "bfdot"} & found[baseline], baseline
        assert "fmla" in found[baseline], baseline  # float32 FMAs: the listing was read


def test_a_cpu_without_fhm_and_bf16_gets_the_baseline_copy(arm64_harness):
    """A Cortex-A57 (ARMv8.0: neither FEAT_FHM nor FEAT_BF16): the hwcaps rule
    offers neither native copy, and the baseline NEON copy is right there."""
    binary, runner = arm64_harness
    command = qemu("cortex-a57") + [str(binary)]
    assert run_harness(command, ["--cpu"]).split() == ["supported:", "neon", "generic"]
    report = run_harness(command, ["neonbf16", "neonfhm", "neon"], ["neon"], sample=True)
    assert "neonbf16: not supported by this CPU" in report, report
    assert "neonfhm: not supported by this CPU" in report, report


def test_x86_copies_match_the_reference_on_the_same_grid(tmp_path):
    """The x86 copies natively, forward over the whole grid (seconds, not
    emulated) and the backward copies."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the x86-64 copies are built on x86-64 hosts only")
    binary = build_harness(tmp_path, [], units(X86_FORWARD, X86_BACKWARD), "HARNESS_X86")
    report = run_harness([str(binary)], [], ["generic"], ["generic_backward"])
    for copy, cases in [(c, CASES_PER_COPY) for c in X86_FORWARD] + [(c, BACKWARD_CASES_PER_COPY) for c in X86_BACKWARD]:
        assert passed(report, copy, cases) or f"{copy}: not supported by this CPU" in report, report
