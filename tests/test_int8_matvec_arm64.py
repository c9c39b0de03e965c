"""The per-ISA copies of the integer-dot quantized matrix-vector product
(csrc/cpu/int8_matvec_impl.h), built without MLX into the standalone driver
(tests/cpu_harness/int8_matvec_driver.cpp) and checked against its
double-precision oracle within the error bound int8_matvec_kernels.h states,
each row alone against the same row in a batch bit for bit: the arm64 copies
(baseline NEON, SDOT with FEAT_DotProd) cross-compiled with clang and run
under qemu-aarch64 on a CPU model with FEAT_DotProd (`max`) and one without
(`cortex-a57`, where the dispatch rule must not pick SDOT), and the x86 copies
natively. Compile flags are read from CMakeLists.txt. qemu checks correctness
only, never speed. A larger grid with MLX_ATTN_FULL_GRID=1 (and every mutant).

Needs clang (clang-19) and, for arm64 on x86-64, qemu-aarch64 and an aarch64
C library; missing tools skip with the reason, except on CI (CI set), where
they fail."""

import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from test_cpu_kernel_arm64 import AARCH64_LIBC, COMMON_FLAGS, ROOT, _clang, _missing, _mnemonics, full_grid, \
    kernel_flags, qemu

DRIVER = ROOT / "tests" / "cpu_harness" / "int8_matvec_driver.cpp"
IMPL = ROOT / "csrc" / "cpu" / "int8_matvec_impl.h"
# Cases per copy: 4/8 bits x groups 32/64/128 x 3 scale types x int8/int16
# activations x 10 row counts (x 4 n x 3 k in the full grid), plus 8 cases of
# rows longer than one scale chunk.
CASES = 2 * 3 * 3 * 2 * 10 + 8
FULL_CASES = 2 * 3 * 3 * 2 * 10 * 4 * 3 + 8
ARM64_COPIES = ["neondot", "neon", "generic"]
X86_COPIES = ["avx512vnni", "avx2", "generic"]


def build_driver(out_dir, target_args, copies, define, include_first=None, prebuilt=None):
    """Compiles the driver and the int8_matvec_<copy>.cpp units (in parallel,
    each with its CMakeLists.txt flags), links them; returns the binary.
    include_first: a folder searched before the tree (a mutated header);
    prebuilt: a folder whose driver.o and generic unit are linked as they are."""
    clang = _clang()
    common, per_unit = kernel_flags()
    arch_define = "MLX_ATTN_ARM64_KERNELS" if define == "HARNESS_ARM64" else "MLX_ATTN_X86_KERNELS"
    includes = ([f"-I{include_first}"] if include_first else [])
    compile_cxx = [clang, "-x", "c++", *target_args, *includes, *COMMON_FLAGS]
    objects = {name: (prebuilt or out_dir) / f"{name}.o" for name in ["driver", "int8_matvec_generic"]}
    objects.update({f"int8_matvec_{c}": out_dir / f"int8_matvec_{c}.o" for c in copies if c != "generic"})
    jobs = []
    if not prebuilt:
        jobs.append([*compile_cxx, "-O2", f"-D{define}", "-c", str(DRIVER), "-o", str(objects["driver"])])
    for unit, obj in objects.items():
        if unit != "driver" and obj.parent == out_dir:
            jobs.append([*compile_cxx, *common, *per_unit.get(unit, []), f"-D{arch_define}=1",
                         "-c", str(ROOT / "csrc" / "cpu" / f"{unit}.cpp"), "-o", str(obj)])
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for cmd in jobs]
    for cmd, proc in zip(jobs, procs):
        out, _ = proc.communicate()
        assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{out}"
    binary = out_dir / "int8_matvec_driver"
    link = subprocess.run([clang, *target_args, *map(str, objects.values()), "-lm", "-o", str(binary)],
                          capture_output=True, text=True)
    assert link.returncode == 0, f"linking the driver failed:\n{link.stdout}{link.stderr}"
    return binary


def arm64_target():
    """The target flags for an arm64 build and the command prefix that runs it
    natively or, elsewhere, under qemu-aarch64 (static: no aarch64 loader)."""
    if platform.machine().lower() in ("aarch64", "arm64"):
        return [], False
    if not shutil.which("qemu-aarch64"):
        _missing("qemu-aarch64 not found (Debian: qemu-user)")
    if not AARCH64_LIBC.exists():
        _missing(f"{AARCH64_LIBC} not found (Debian: libc6-dev-arm64-cross, gcc-aarch64-linux-gnu)")
    return ["--target=aarch64-linux-gnu", "-static"], True


@pytest.fixture(scope="module")
def arm64_driver(tmp_path_factory):
    target, emulated = arm64_target()
    return build_driver(tmp_path_factory.mktemp("int8_arm64"), target, ARM64_COPIES, "HARNESS_ARM64"), emulated


def run_driver(command, args):
    result = subprocess.run([*command, *args], capture_output=True, text=True, timeout=1800)
    return result.returncode, result.stdout + result.stderr


def grid_args(copies):
    return (["--full"] if full_grid() else []) + copies


def passed(report, copy):
    return f"{copy}: {FULL_CASES if full_grid() else CASES} cases, 0 failures" in report


def test_arm64_copies_match_the_oracle_under_qemu(arm64_driver):
    """On a CPU with FEAT_DotProd (qemu's `max`) the rule picks the SDOT copy
    (and plain C++ when the generic ISA is chosen); every copy matches the
    oracle and is batch invariant."""
    binary, emulated = arm64_driver
    command = (qemu("max") if emulated else []) + [str(binary)]
    if emulated:
        assert run_driver(command, ["--rule", "neon"])[1].split() == ["picked:", "neondot"]
    assert run_driver(command, ["--rule", "generic"])[1].split() == ["picked:", "generic"]
    rc, report = run_driver(command, grid_args(ARM64_COPIES))
    assert rc == 0, report
    for copy in ARM64_COPIES:
        assert passed(report, copy) or (not emulated and f"{copy}: not supported by this CPU" in report), report


def test_a_cpu_without_dotprod_gets_the_neon_copy(arm64_driver):
    """A Cortex-A57 (ARMv8.0, no FEAT_DotProd): the rule picks baseline NEON,
    the SDOT copy reports itself unsupported, and NEON is right there."""
    binary, _ = arm64_driver
    command = qemu("cortex-a57") + [str(binary)]
    assert run_driver(command, ["--rule", "neon"])[1].split() == ["picked:", "neon"]
    rc, report = run_driver(command, grid_args(["neondot", "neon"]))
    assert rc == 0, report
    assert "neondot: not supported by this CPU" in report, report
    assert passed(report, "neon"), report


def test_dotprod_copy_multiplies_with_sdot(arm64_driver):
    """The SDOT copy really uses SDOT; the baseline NEON copy (which must run
    on any ARMv8.0 core) does not, and widens with SMULL / SMLAL instead."""
    binary, _ = arm64_driver
    found = {copy: _mnemonics(binary.parent / f"int8_matvec_{copy}.o") for copy in ARM64_COPIES}
    assert "sdot" in found["neondot"]
    for baseline in ("neon", "generic"):
        assert "sdot" not in found[baseline], baseline
    assert {"smull", "smlal", "smlal2"} <= found["neon"]


# (name, target text in int8_matvec_impl.h, replacement): each target occurs
# exactly once and must make the NEON copies fail the driver.
MUTANTS = [
    ("4-bit even and odd columns swapped",
     "first = vandq_u8(raw, vdupq_n_u8(15));  // low nibbles: the even columns\n"
     "      last = vshrq_n_u8(raw, 4);              // high nibbles: the odd columns",
     "last = vandq_u8(raw, vdupq_n_u8(15));\n      first = vshrq_n_u8(raw, 4);"),
    ("the bias term skipped", "c.out[r * c.n + n0 + f] = vaddvq_f32(acc[r][f]) + bias_term[r];",
     "c.out[r * c.n + n0 + f] = vaddvq_f32(acc[r][f]);"),
    ("8-bit high nibbles weighted 8, not 16", "vaddq_s32(low, vshlq_n_s32(high, 4))",
     "vaddq_s32(low, vshlq_n_s32(high, 3))"),
    ("multi-row tiles summing lanes in another order",
     "c.out[r * c.n + n0 + f] = vaddvq_f32(acc[r][f]) + bias_term[r];",
     "c.out[r * c.n + n0 + f] = (Rows == 1 ? vaddvq_f32(acc[r][f]) : ((vgetq_lane_f32(acc[r][f], 0) + "
     "vgetq_lane_f32(acc[r][f], 1)) + vgetq_lane_f32(acc[r][f], 2)) + vgetq_lane_f32(acc[r][f], 3)) + bias_term[r];"),
]
SELECTED = MUTANTS if full_grid() else MUTANTS[:1]


def test_every_mutation_target_exists():
    text = IMPL.read_text()
    for name, target, _ in MUTANTS:
        assert text.count(target) == 1, name


@pytest.mark.parametrize("name,target,replacement", SELECTED, ids=[m[0] for m in SELECTED])
def test_neon_mutant_is_caught(tmp_path, arm64_driver, name, target, replacement):
    """The unchanged copies pass (the test above); the mutated NEON copies
    (the driver and the plain C++ copy reused as built) must not."""
    _, emulated = arm64_driver
    include = tmp_path / "include"
    (include / "csrc" / "cpu").mkdir(parents=True)
    text = IMPL.read_text()
    assert text.count(target) == 1, name
    (include / "csrc" / "cpu" / "int8_matvec_impl.h").write_text(text.replace(target, replacement))
    target_args, _ = arm64_target()
    binary = build_driver(tmp_path, target_args, ARM64_COPIES, "HARNESS_ARM64", include_first=include,
                          prebuilt=arm64_driver[0].parent)
    command = (qemu("max") if emulated else []) + [str(binary)]
    rc, report = run_driver(command, ["neondot", "neon"])
    assert rc == 1 and re.search(r": \d+ cases, [1-9]\d* failures", report), report


def test_x86_copies_match_the_oracle(tmp_path):
    """The x86 copies natively on the same grid (AVX512-VNNI where the CPU has it)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the x86-64 copies are built on x86-64 hosts only")
    binary = build_driver(tmp_path, [], X86_COPIES, "HARNESS_X86")
    rc, report = run_driver([str(binary)], grid_args(X86_COPIES))
    assert rc == 0, report
    assert passed(report, "avx2") and passed(report, "generic"), report
    assert passed(report, "avx512vnni") or "avx512vnni: not supported by this CPU" in report, report
