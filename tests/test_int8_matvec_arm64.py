"""The per-ISA copies of the integer-dot quantized matrix-vector product
(csrc/cpu/int8_matvec_impl.h), built without MLX into the standalone driver
(tests/cpu_harness/int8_matvec_driver.cpp) and checked against its
double-precision oracle within the error bound int8_matvec_kernels.h states,
each row alone against the same row in a batch bit for bit: the arm64 copies
(baseline NEON, SDOT with FEAT_DotProd, USMMLA with FEAT_I8MM)
cross-compiled with clang and run under qemu-aarch64 on a CPU model with
FEAT_I8MM (`max`), one with FEAT_DotProd only (`cortex-a76`, where the
dispatch rule must pick SDOT) and one with neither (`cortex-a57`: NEON), and
the x86 copies
natively; the AVX-VNNI copy, where the CPU lacks AVX-VNNI (no qemu emulates
it), built with its two instructions emulated by exact AVX2 sequences, the
emulation itself checked against scalar sums. Compile flags are read from
CMakeLists.txt. qemu checks correctness
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
ARM64_COPIES = ["neoni8mm", "neondot", "neon", "generic"]
X86_COPIES = ["avx512vnni", "avxvnni", "avxvnni_emulated", "avx2", "generic"]


def copy_unit(copy, per_unit):
    """The source (file stem under csrc/cpu) and extra flags of a driver copy:
    int8_matvec_<copy>.cpp with its CMakeLists.txt flags, except
    avxvnni_emulated, the avxvnni unit built for AVX2 with its two VNNI
    instructions emulated (tests/cpu_harness/avx_vnni_emulation.h)."""
    if copy == "avxvnni_emulated":
        flags = per_unit["int8_matvec_avxvnni"]
        assert "-mavxvnni" in flags, flags
        return "int8_matvec_avxvnni", [f for f in flags if f != "-mavxvnni"] + ["-DMLX_ATTN_EMULATE_AVX_VNNI"]
    return f"int8_matvec_{copy}", per_unit.get(f"int8_matvec_{copy}", [])


def build_driver(out_dir, target_args, copies, define, include_first=None, prebuilt=None, rebuild=(), extra=()):
    """Compiles the driver and the copies' units (in parallel, each with its
    CMakeLists.txt flags), links them; returns the binary (objects named
    driver.o and int8_matvec_<copy>.o beside it).
    include_first: a folder searched before the tree (a mutated header);
    prebuilt: a folder whose objects are linked as they are, except the
    copies in rebuild; extra: flags after the units' own."""
    clang = _clang()
    common, per_unit = kernel_flags()
    arch_define = "MLX_ATTN_ARM64_KERNELS" if define == "HARNESS_ARM64" else "MLX_ATTN_X86_KERNELS"
    includes = ([f"-I{include_first}"] if include_first else [])
    compile_cxx = [clang, "-x", "c++", *target_args, *includes, *COMMON_FLAGS]
    fresh = set(rebuild) if prebuilt else {"driver", *copies}
    objects = {name: (out_dir if name in fresh else prebuilt) / f"{'' if name == 'driver' else 'int8_matvec_'}{name}.o"
               for name in ["driver", *copies]}
    jobs = []
    if "driver" in fresh:
        jobs.append([*compile_cxx, "-O2", f"-D{define}", "-c", str(DRIVER), "-o", str(objects["driver"])])
    for copy in copies:
        if copy in fresh:
            unit, flags = copy_unit(copy, per_unit)
            jobs.append([*compile_cxx, *common, *flags, *extra, f"-D{arch_define}=1",
                         "-c", str(ROOT / "csrc" / "cpu" / f"{unit}.cpp"), "-o", str(objects[copy])])
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
    """On a CPU with FEAT_I8MM (qemu's `max`) the rule picks the USMMLA copy
    (and plain C++ when the generic ISA is chosen); every copy matches the
    oracle and is batch invariant."""
    binary, emulated = arm64_driver
    command = (qemu("max") if emulated else []) + [str(binary)]
    if emulated:
        assert run_driver(command, ["--rule", "neon"])[1].split() == ["picked:", "neoni8mm"]
    assert run_driver(command, ["--rule", "generic"])[1].split() == ["picked:", "generic"]
    rc, report = run_driver(command, grid_args(ARM64_COPIES))
    assert rc == 0, report
    for copy in ARM64_COPIES:
        assert passed(report, copy) or (not emulated and f"{copy}: not supported by this CPU" in report), report


def test_a_cpu_without_i8mm_gets_the_sdot_copy(arm64_driver):
    """A Cortex-A76 (FEAT_DotProd, no FEAT_I8MM): the rule picks SDOT, the
    USMMLA copy reports itself unsupported, and SDOT is right there."""
    binary, _ = arm64_driver
    command = qemu("cortex-a76") + [str(binary)]
    assert run_driver(command, ["--rule", "neon"])[1].split() == ["picked:", "neondot"]
    rc, report = run_driver(command, grid_args(["neoni8mm", "neondot"]))
    assert rc == 0, report
    assert "neoni8mm: not supported by this CPU" in report, report
    assert passed(report, "neondot"), report


def test_a_cpu_without_dotprod_gets_the_neon_copy(arm64_driver):
    """A Cortex-A57 (ARMv8.0, neither FEAT_DotProd nor FEAT_I8MM): the rule
    picks baseline NEON, the SDOT and USMMLA copies report themselves
    unsupported, and NEON is right there."""
    binary, _ = arm64_driver
    command = qemu("cortex-a57") + [str(binary)]
    assert run_driver(command, ["--rule", "neon"])[1].split() == ["picked:", "neon"]
    rc, report = run_driver(command, grid_args(["neoni8mm", "neondot", "neon"]))
    assert rc == 0, report
    assert "neoni8mm: not supported by this CPU" in report, report
    assert "neondot: not supported by this CPU" in report, report
    assert passed(report, "neon"), report


def test_dotprod_and_i8mm_copies_multiply_with_sdot_and_usmmla(arm64_driver):
    """The SDOT copy really uses SDOT and the i8mm copy USMMLA (FEAT_I8MM's
    unsigned x signed SMMLA); the baseline NEON copy (which must run on any
    ARMv8.0 core) uses neither, and widens with SMULL / SMLAL instead."""
    binary, _ = arm64_driver
    found = {copy: _mnemonics(binary.parent / f"int8_matvec_{copy}.o") for copy in ARM64_COPIES}
    assert "sdot" in found["neondot"] and "usmmla" not in found["neondot"]
    assert "usmmla" in found["neoni8mm"]
    for baseline in ("neon", "generic"):
        assert not {"sdot", "usmmla", "smmla"} & found[baseline], baseline
    assert {"smull", "smlal", "smlal2"} <= found["neon"] and "smlal2" in found["neoni8mm"]


# (name, target text in int8_matvec_impl.h, replacement): each target occurs
# exactly once and must make the NEON copies fail the driver.
MUTANTS = [
    ("4-bit even and odd columns swapped",
     "first = vandq_u8(raw, vdupq_n_u8(15));  // low nibbles: the even columns\n"
     "      last = vshrq_n_u8(raw, 4);              // high nibbles: the odd columns",
     "last = vandq_u8(raw, vdupq_n_u8(15));\n      first = vshrq_n_u8(raw, 4);"),
    ("the bias term skipped", "c.out[r * c.n + n0 + f] = sums.total(r, f) + bias_term[r];",
     "c.out[r * c.n + n0 + f] = sums.total(r, f);"),
    ("8-bit high nibbles weighted 8, not 16", "vaddq_s32(low, vshlq_n_s32(high, 4))",
     "vaddq_s32(low, vshlq_n_s32(high, 3))"),
    ("multi-row tiles summing lanes in another order",
     "float total(int r, int f) const { return vaddvq_f32(acc[r][f]); }",
     "float total(int r, int f) const { return Rows == 1 ? vaddvq_f32(acc[r][f]) : ((vgetq_lane_f32(acc[r][f], 0) + "
     "vgetq_lane_f32(acc[r][f], 1)) + vgetq_lane_f32(acc[r][f], 2)) + vgetq_lane_f32(acc[r][f], 3); }"),
]
SELECTED = MUTANTS if full_grid() else MUTANTS[:1]
# Likewise for the i8mm copy.
I8MM_MUTANTS = [
    ("pair lanes read with rows and outputs swapped", "return lanes[2 * (f % 2) + r % 2];",
     "return lanes[2 * (r % 2) + f % 2];"),
    ("an output pair's columns 8-15 taken from columns 0-7", "last_halves(first[0], first[1])",
     "first_halves(first[0], first[1])"),
    ("a lone last row read from its zero partner's lane", "return lanes[2 * (f % 2) + r % 2];",
     "return lanes[2 * (f % 2) + (Rows % 2 == 1 && r == Rows - 1 ? 1 : r % 2)];"),
]
SELECTED_I8MM = I8MM_MUTANTS if full_grid() else I8MM_MUTANTS[:1]


def test_every_mutation_target_exists():
    text = IMPL.read_text()
    for name, target, _ in MUTANTS + I8MM_MUTANTS + AVX_VNNI_MUTANTS:
        assert text.count(target) == 1, name


def mutated_impl(tmp_path, name, target, replacement):
    """A folder to search before the tree, holding int8_matvec_impl.h with
    ``target`` (found exactly once) replaced."""
    include = tmp_path / "include"
    (include / "csrc" / "cpu").mkdir(parents=True)
    text = IMPL.read_text()
    assert text.count(target) == 1, name
    (include / "csrc" / "cpu" / "int8_matvec_impl.h").write_text(text.replace(target, replacement))
    return include


def run_arm64_mutant(tmp_path, arm64_driver, name, target, replacement, copies, extra=()):
    """The driver with ``copies`` rebuilt from int8_matvec_impl.h with
    ``target`` replaced (the rest reused as built), run on qemu's `max` or
    natively; returns (exit code, report)."""
    _, emulated = arm64_driver
    include = mutated_impl(tmp_path, name, target, replacement)
    target_args, _ = arm64_target()
    binary = build_driver(tmp_path, target_args, ARM64_COPIES, "HARNESS_ARM64", include_first=include,
                          prebuilt=arm64_driver[0].parent, rebuild=copies, extra=list(extra))
    command = (qemu("max") if emulated else []) + [str(binary)]
    return run_driver(command, copies)


@pytest.mark.parametrize("name,target,replacement", SELECTED, ids=[m[0] for m in SELECTED])
def test_neon_mutant_is_caught(tmp_path, arm64_driver, name, target, replacement):
    """The unchanged copies pass (the test above); the mutated NEON copies
    (the driver and the plain C++ copy reused as built) must not."""
    rc, report = run_arm64_mutant(tmp_path, arm64_driver, name, target, replacement, ["neondot", "neon"])
    assert rc == 1 and re.search(r": \d+ cases, [1-9]\d* failures", report), report


@pytest.mark.parametrize("name,target,replacement", SELECTED_I8MM, ids=[m[0] for m in SELECTED_I8MM])
def test_i8mm_mutant_is_caught(tmp_path, arm64_driver, name, target, replacement):
    """The unchanged i8mm copy passes; the mutated one must not (run on qemu's
    `max`, or natively where the CPU has FEAT_I8MM). Built at -O1, as the
    avxvnni mutants are."""
    rc, report = run_arm64_mutant(tmp_path, arm64_driver, name, target, replacement, ["neoni8mm"], extra=["-O1"])
    if "neoni8mm: not supported by this CPU" in report:
        pytest.skip("this arm64 CPU lacks FEAT_I8MM")
    assert rc == 1 and re.search(r"neoni8mm: \d+ cases, [1-9]\d* failures", report), report


@pytest.fixture(scope="module")
def x86_driver(tmp_path_factory):
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the x86-64 copies are built on x86-64 hosts only")
    return build_driver(tmp_path_factory.mktemp("int8_x86"), [], X86_COPIES, "HARNESS_X86")


def cpu_info():
    """This CPU's model name and feature flags as Linux reads them from CPUID
    (/proc/cpuinfo), or None elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    name = re.search(r"^model name\s*: (.*)$", text, re.M)
    flags = re.search(r"^flags\s*: (.*)$", text, re.M)
    return (name.group(1) if name else "this CPU"), set(flags.group(1).split()) if flags else set()


def test_x86_copies_match_the_oracle(x86_driver):
    """The x86 copies natively on the same grid (AVX512-VNNI where the CPU
    has it), and the avxvnni copy with its two VNNI instructions emulated by
    exact AVX2 sequences (avxvnni_emulated) on every AVX2 CPU."""
    copies = [c for c in X86_COPIES if c != "avxvnni"]
    rc, report = run_driver([str(x86_driver)], grid_args(copies))
    assert rc == 0, report
    for copy in ("avxvnni_emulated", "avx2", "generic"):
        assert passed(report, copy), report
    assert passed(report, "avx512vnni") or "avx512vnni: not supported by this CPU" in report, report


def test_avxvnni_copy_matches_the_oracle_natively(x86_driver):
    """The avxvnni copy itself, where the CPU has AVX-VNNI (Intel Alder Lake
    and later, Sapphire Rapids, Sierra Forest, AMD Zen 5)."""
    rc, report = run_driver([str(x86_driver)], grid_args(["avxvnni"]))
    assert rc == 0, report
    if "avxvnni: not supported by this CPU" in report:
        info = cpu_info()
        pytest.skip(f"{info[0] if info else 'this CPU'} lacks AVX-VNNI (CPUID.(EAX=7,ECX=1):EAX bit 4): the avxvnni "
                    "copy cannot run here; its build with the instructions emulated is checked instead")
    assert passed(report, "avxvnni"), report


def test_the_x86_rule_follows_the_cpu_flags(x86_driver):
    """The dispatch rule against Linux's own reading of CPUID: an AVX-512
    choice gets avx512vnni on an AVX512-VNNI CPU; otherwise any choice but
    generic gets avxvnni on an AVX-VNNI CPU, else avx2."""
    info = cpu_info()
    if info is None:
        pytest.skip("no /proc/cpuinfo to compare the rule's CPUID reads with")
    flags = info[1]
    assert {"avx2", "fma", "f16c"} <= flags, "the x86 copies need an AVX2 CPU"
    ymm_choice = "avxvnni" if "avx_vnni" in flags else "avx2"
    has_avx512vnni = {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni"} <= flags
    expected = {"avx512": "avx512vnni" if has_avx512vnni else ymm_choice, "avx2": ymm_choice, "generic": "generic"}
    for isa, copy in expected.items():
        assert run_driver([str(x86_driver)], ["--rule", isa])[1].split() == ["picked:", copy], isa


def _dot_instructions(obj):
    """Each vpdpbusd / vpdpwssd in the object's listing as (encoding prefix
    or "", mnemonic, operands), and the whole listing."""
    objdump = next((t for t in ("llvm-objdump-19", "llvm-objdump") if shutil.which(t)), None)
    if objdump is None:
        _missing("llvm-objdump (llvm-19) not found")
    listing = subprocess.run([objdump, "-d", str(obj)], capture_output=True, text=True, check=True).stdout
    return re.findall(r"\t(?:(\{[a-z]+\})\t)?(vpdp[a-z]+)\t([^\n]*)", listing), listing


def test_avxvnni_copy_multiplies_with_vex_vpdpbusd(x86_driver):
    """The avxvnni object's dot products are VEX-encoded vpdpbusd and vpdpwssd
    on ymm (no EVEX: it must run on AVX-VNNI CPUs without AVX-512, and uses
    no zmm); the emulated and avx2 objects have none (they run on any AVX2
    CPU)."""
    found, listing = _dot_instructions(x86_driver.parent / "int8_matvec_avxvnni.o")
    assert {m for _, m, _ in found} == {"vpdpbusd", "vpdpwssd"}, found
    assert all(prefix == "{vex}" and "%ymm" in operands for prefix, _, operands in found), found
    assert "zmm" not in listing
    for baseline in ("avxvnni_emulated", "avx2"):
        found, listing = _dot_instructions(x86_driver.parent / f"int8_matvec_{baseline}.o")
        assert not found and "vpmaddwd" in listing, baseline


EMULATION = ROOT / "tests" / "cpu_harness" / "avx_vnni_emulation.h"
EMULATION_CHECK = ROOT / "tests" / "cpu_harness" / "avx_vnni_emulation_check.cpp"


def run_emulation_check(out_dir, include_first=None):
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the AVX2 emulation is built on x86-64 hosts only")
    includes = [f"-I{include_first}"] if include_first else []
    binary = out_dir / "avx_vnni_emulation_check"
    build = subprocess.run([_clang(), "-x", "c++", *includes, *COMMON_FLAGS, "-O2", "-mavx2", "-mfma", "-mf16c",
                            str(EMULATION_CHECK), "-o", str(binary)], capture_output=True, text=True)
    assert build.returncode == 0, build.stdout + build.stderr
    return run_driver([str(binary)], [])


def test_the_avx_vnni_emulation_is_exact(tmp_path):
    """The emulated vpdpbusd / vpdpwssd against 64-bit scalar sums (modulo
    2^32) on random and extreme inputs, and against the instructions where
    the CPU has AVX-VNNI."""
    rc, report = run_emulation_check(tmp_path)
    assert rc == 0 and re.search(r"avx_vnni_emulation: \d+ cases, 0 mismatching lanes", report), report
    info = cpu_info()
    if info is not None and "avx_vnni" in info[1]:
        assert "also against the AVX-VNNI instructions" in report, report


def test_a_saturating_emulation_is_caught(tmp_path):
    """vpmaddubsw in place of the widened products (its pair sums saturate at
    int16: 255 * -128 * 2) must fail the emulation check."""
    include = tmp_path / "include"
    (include / "tests" / "cpu_harness").mkdir(parents=True)
    target = "return _mm256_add_epi32(sum, _mm256_add_epi32(even, odd));"
    text = EMULATION.read_text()
    assert text.count(target) == 1
    (include / "tests" / "cpu_harness" / "avx_vnni_emulation.h").write_text(text.replace(
        target, "(void)even, (void)odd; return _mm256_add_epi32(sum, "
                "_mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));"))
    rc, report = run_emulation_check(tmp_path, include_first=include)
    assert rc == 1 and re.search(r"\d+ cases, [1-9]\d* mismatching lanes", report), report


# (name, target text in int8_matvec_impl.h, replacement): each must make the
# emulated avxvnni copy fail the driver.
AVX_VNNI_MUTANTS = [
    ("whole 8-bit codes cut to their low nibbles", "if constexpr (whole_byte_codes) return {raw, _mm256_setzero_si256()};",
     "if constexpr (whole_byte_codes) return {_mm256_and_si256(raw, nibble), _mm256_setzero_si256()};"),
    ("int16 dot product dropping the block's first half", "return word_dot(first, codes.last,",
     "return word_dot(_mm256_setzero_si256(), codes.last,"),
    ("int8 activations read as unsigned", "return dpbusd(_mm256_setzero_si256(), low, x);",
     "return dpbusd(_mm256_setzero_si256(), low, _mm256_abs_epi8(x));"),
]
SELECTED_AVX_VNNI = AVX_VNNI_MUTANTS if full_grid() else AVX_VNNI_MUTANTS[:1]


@pytest.mark.parametrize("name,target,replacement", SELECTED_AVX_VNNI, ids=[m[0] for m in SELECTED_AVX_VNNI])
def test_avxvnni_mutant_is_caught(tmp_path, x86_driver, name, target, replacement):
    """The unchanged emulated copy passes (test_x86_copies_match_the_oracle);
    the mutated one (the rest reused as built) must not. Built at -O1 (half
    the compile time of -O3; the faults are in the arithmetic, whatever the
    optimizer makes of it)."""
    include = mutated_impl(tmp_path, name, target, replacement)
    binary = build_driver(tmp_path, [], X86_COPIES, "HARNESS_X86", include_first=include, prebuilt=x86_driver.parent,
                          rebuild=["avxvnni_emulated"], extra=["-O1"])
    rc, report = run_driver([str(binary)], ["avxvnni_emulated"])
    assert rc == 1 and re.search(r"avxvnni_emulated: \d+ cases, [1-9]\d* failures", report), report
