"""Compile the Mac build's C++ on Linux, so a change cannot break it unseen.

Every translation unit an Apple-silicon build of the extension compiles (the
Metal host, csrc/metal/eval_gpu.cpp, instead of its stub) is compiled by clang-19 for arm64-apple-macos14 against the
headers of the macOS MLX wheel (MLX + metal-cpp), and every MLX / metal-cpp
symbol the objects reference must be exported by that wheel's libmlx.dylib
(llvm-nm-19). Nothing is linked or run; the .metal kernels are not compiled
here (kernel_lab/msl_emulator does that).

Where the pieces come from (no Apple SDK here):
  - mlx-metal==<pin in pyproject.toml> for macosx_14_0_arm64 (MLX headers,
    metal-cpp, libmlx.dylib) and ziglang==0.17.0 (Darwin libc and libc++
    headers), fetched once with `pip download` into $MLX_ATTN_CACHE/mac-host
    (default ~/.cache/mlx_attn/mac-host) and unpacked there;
  - nanobind==<pin> for the binding units, Python.h of this interpreter;
  - stubs/ for the two CoreFoundation / IOSurface types metal-cpp names.
Differences from a real Mac build: clang-19 and zig's libc++ headers instead
of Apple clang and the SDK's, no availability annotations, a Linux pyconfig.h.

    python tests/mac_host/check_mac_host.py [REPO]    # exit 0 OK, 1 errors, 2 setup
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kernel_lab.wheel_cache import SetupError, cache_dir, unpacked, wheel  # the cache MLX's kernel runner shares

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
STUBS = HERE / "stubs"
TARGET = "arm64-apple-macos14"
WHEEL_PLATFORM = "macosx_14_0_arm64"  # the tag of the MLX wheel a Mac installs
ZIGLANG_VERSION = "0.17.0"
CLANG, NM, CXXFILT, CMAKE = "clang-19", "llvm-nm-19", "llvm-cxxfilt-19", "cmake"
# Compiled only on x86-64: the kernel copies CMakeLists.txt adds in its
# x86-64 branch, not part of an arm64 Mac build.
X86_ONLY_UNITS = set(re.findall(r"csrc/[\w/]+\.cpp", re.search(
    r'if\(CMAKE_SYSTEM_PROCESSOR MATCHES "x86_64\|AMD64\|amd64"\)\s+target_sources\(mlx_attn_cpu_kernels PRIVATE'
    r"([^)]*)\)", (REPO / "CMakeLists.txt").read_text()).group(1)))
# Per-unit compile options (the arm64 kernel copies' -march, e.g. +bf16):
# `set_source_files_properties(<units> PROPERTIES COMPILE_OPTIONS "<a;b>")`.
UNIT_OPTIONS = re.compile(r"set_source_files_properties\(([^)]*?) PROPERTIES\s+COMPILE_OPTIONS \"([^\"]*)\"")
# CMake options that change what a Mac unit compiles: such a unit is checked
# once more with the option's definition.
OPTION_DEFINES = {"csrc/metal/metal_library.cpp": "MLX_ATTN_PREBUILT_METALLIB"}
# Units that need nanobind and Python.h: the module's bindings, csrc/python/.
BINDING_FOLDER = "csrc/python"
# Compiled only where MLX has no Metal: the backend stub (a Mac builds
# csrc/metal/eval_gpu.cpp instead; CMakeLists.txt chooses).
NO_METAL_UNITS = {"csrc/metal/no_metal.cpp"}
# MLXConfig.cmake's MLX_CXX_FLAGS for a Metal build (the imported target `mlx`).
MLX_DEFINES = ["-D_METAL_", "-DACCELERATE_NEW_LAPACK"]
# Zig's libc++ headers take the configuration a vendor's __config_site holds
# as macros; these are those of Apple's libc++ (pthreads, filesystem, locale),
# minus availability annotations, which need the SDK's headers.
LIBCXX_CONFIG = {
    "_LIBCPP_ABI_VERSION": "1",
    "_LIBCPP_ABI_NAMESPACE": "__1",
    "_LIBCPP_HAS_THREADS": "1",
    "_LIBCPP_HAS_THREAD_API_PTHREAD": "1",
    "_LIBCPP_HAS_THREAD_API_EXTERNAL": "0",
    "_LIBCPP_HAS_THREAD_API_WIN32": "0",
    "_LIBCPP_HAS_MONOTONIC_CLOCK": "1",
    "_LIBCPP_HAS_TERMINAL": "1",
    "_LIBCPP_HAS_MUSL_LIBC": "0",
    "_LIBCPP_HAS_FILESYSTEM": "1",
    "_LIBCPP_HAS_RANDOM_DEVICE": "1",
    "_LIBCPP_HAS_LOCALIZATION": "1",
    "_LIBCPP_HAS_UNICODE": "1",
    "_LIBCPP_HAS_WIDE_CHARACTERS": "1",
    "_LIBCPP_HAS_TIME_ZONE_DATABASE": "1",
    "_LIBCPP_HAS_VENDOR_AVAILABILITY_ANNOTATIONS": "0",
    "_LIBCPP_PSTL_BACKEND_SERIAL": "1",
    "_LIBCPP_HARDENING_MODE_DEFAULT": "_LIBCPP_HARDENING_MODE_NONE",
    "_LIBCPP_ASSERTION_SEMANTIC_DEFAULT": "_LIBCPP_ASSERTION_SEMANTIC_HARDENING_DEPENDENT",
}
# Symbols this check owns: MLX's and metal-cpp's (libmlx.dylib defines
# metal-cpp's class and selector tables). Matched on the demangled name.
CHECKED_SYMBOL = re.compile(
    r"^(?:(?:vtable|typeinfo|typeinfo name|guard variable) for )?(?:[\w:<>*& ]+ )?(?:mlx::core|MTL4?|NS|CA)::"
)


@dataclass
class Report:
    units: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # project warnings: shown, not failures
    checked_symbols: set[str] = field(default_factory=set)  # demangled

    @property
    def ok(self) -> bool:
        return not self.errors

    def summary(self) -> str:
        lines = [f"mac host check ({TARGET}): {len(self.units)} units, "
                 f"{len(self.checked_symbols)} MLX/metal-cpp symbols resolved in libmlx.dylib"]
        lines += [f"warning: {w}" for w in self.warnings]
        lines += [f"error: {e}" for e in self.errors]
        lines.append("OK" if self.ok else f"FAILED ({len(self.errors)} errors)")
        return "\n".join(lines)


# ------------------------------------------------------------------ pieces
def pinned_version(repo: Path, package: str) -> str:
    """The `package==X` pin of pyproject.toml (the build requirements)."""
    match = re.search(rf'"{re.escape(package)}==([0-9][0-9.]*)"', (repo / "pyproject.toml").read_text())
    if not match:
        raise SetupError(f"pyproject.toml pins no {package}==VERSION")
    return match.group(1)


def tool(name: str) -> str:
    path = shutil.which(name)
    if not path:
        raise SetupError(f"{name} not found on PATH (Debian: apt-get install clang-19 llvm-19 cmake)")
    return path


@dataclass
class Toolchain:
    clang: str
    clang_version: str
    nm: str
    cxxfilt: str
    cmake: str
    mlx: Path  # unpacked mlx-metal wheel: mlx/include, mlx/lib/libmlx.dylib
    compile_flags: list[str]
    binding_flags: list[str]


def toolchain(repo: Path = REPO) -> Toolchain:
    """Everything the check needs; SetupError names what is missing."""
    clang, nm, cxxfilt, cmake = (tool(t) for t in (CLANG, NM, CXXFILT, CMAKE))
    mlx_version = pinned_version(repo, "mlx")
    mlx = unpacked(wheel("mlx-metal", mlx_version, WHEEL_PLATFORM),
                   ("mlx/include/", "mlx/lib/libmlx.dylib"))
    if not (mlx / "mlx/include/mlx/backend/metal/device.h").is_file():
        raise SetupError(f"mlx-metal {mlx_version} has no mlx/backend/metal/device.h")
    zig = unpacked(wheel("ziglang", ZIGLANG_VERSION, WHEEL_PLATFORM),
                   ("ziglang/lib/libc/include/any-darwin-any/", "ziglang/lib/libcxx/include/",
                    "ziglang/lib/libcxxabi/include/")) / "ziglang/lib"
    nanobind = unpacked(wheel("nanobind", pinned_version(repo, "nanobind"), None),
                        ("nanobind/include/", "nanobind/ext/robin_map/include/")) / "nanobind"
    python_include = Path(sysconfig.get_paths()["include"])
    if not (python_include / "Python.h").is_file():
        raise SetupError(f"no Python.h in {python_include} (install the Python development headers)")
    resource = subprocess.run([clang, "-print-resource-dir"], capture_output=True, text=True, check=True)
    version = subprocess.run([clang, "--version"], capture_output=True, text=True, check=True).stdout
    include = mlx / "mlx/include"
    # Include order as a Darwin C++ driver: libc++, compiler builtins, libc.
    # MLX as system headers, as CMake treats an imported target's includes.
    system = [zig / "libcxx/include", zig / "libcxxabi/include", Path(resource.stdout.strip()) / "include",
              zig / "libc/include/any-darwin-any", STUBS, include / "metal_cpp", include]
    flags = ["-target", TARGET, "-std=gnu++20", "-nostdinc", "-nostdinc++", "-fno-color-diagnostics"]
    flags += [arg for path in system for arg in ("-isystem", str(path))]
    flags += [f"-D{k}={v}" for k, v in LIBCXX_CONFIG.items()] + MLX_DEFINES
    binding = [arg for path in (nanobind / "include", nanobind / "ext/robin_map/include", python_include)
               for arg in ("-isystem", str(path))]
    return Toolchain(clang, version, nm, cxxfilt, cmake, mlx, flags, binding)


# ------------------------------------------------------------------- check
def mac_units(repo: Path) -> list[str]:
    """The C++ units of an arm64 Mac build, relative to repo: every csrc/ .cpp
    but the x86-only kernels and the no-Metal stub (test_mac_host.py checks
    CMakeLists.txt agrees)."""
    units = sorted(p.relative_to(repo).as_posix() for p in (repo / "csrc").rglob("*.cpp"))
    return [u for u in units if u not in X86_ONLY_UNITS | NO_METAL_UNITS]


def unit_compile_options(repo: Path) -> dict[str, list[str]]:
    """The extra compile options CMakeLists.txt gives single units, by
    repo-relative path (the same for x86-64 and arm64 unit lists)."""
    options = {}
    for units, joined in UNIT_OPTIONS.findall((repo / "CMakeLists.txt").read_text()):
        for unit in re.findall(r"csrc/[\w/]+\.cpp", units):
            options[unit] = joined.split(";")
    return options


def embed_metal_sources(tools: Toolchain, repo: Path, out_dir: Path) -> tuple[Path, str]:
    """The generated unit holding the Metal sources, made by the build's own
    script, and the script's error output (empty when it worked)."""
    output = out_dir / "embedded_metal_sources.cpp"
    sources = ";".join(str(p) for p in sorted((repo / "metal").glob("*.metal")))
    done = subprocess.run([tools.cmake, f"-DSOURCE_ROOT={repo}", f"-DSOURCES={sources}", f"-DOUTPUT={output}",
                           "-P", str(repo / "csrc/metal/embed_metal_sources.cmake")], capture_output=True, text=True)
    return output, "" if done.returncode == 0 else (done.stdout + done.stderr).strip()


@dataclass
class Compiled:
    """What compiling one unit yields (cached: see compile_cached)."""
    returncode: int
    diagnostics: str
    undefined: list[str]  # symbols the object needs (mangled)


@dataclass(frozen=True)
class Unit:
    path: Path
    label: str  # repo-relative path, and the option it is compiled with
    defines: tuple[str, ...] = ()
    options: tuple[str, ...] = ()  # CMakeLists.txt's options for this unit


def compile_unit(tools: Toolchain, repo: Path, unit: Unit, obj: Path) -> Compiled:
    flags = tools.compile_flags + (tools.binding_flags if unit.path.parent == repo / BINDING_FOLDER else [])
    flags += [f"-D{name}=1" for name in unit.defines] + list(unit.options)
    # -O1: inline functions of the headers resolve as in an optimized build.
    done = subprocess.run([tools.clang, *flags, f"-I{repo}", "-O1", "-Wall", "-Wextra", "-c", str(unit.path),
                           "-o", str(obj)], capture_output=True, text=True)
    undefined = symbols(tools, ["--undefined-only", str(obj)]) if done.returncode == 0 else []
    return Compiled(done.returncode, done.stderr, undefined)


def inputs_digest(tools: Toolchain, repo: Path) -> str:
    """Everything a unit's compile depends on: the project's C++ and Metal
    trees, the stubs, the flags (which name the wheels) and the compiler."""
    digest = hashlib.sha256(str(repo).encode())
    for root in (repo / "csrc", repo / "metal", STUBS):
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            digest.update(path.relative_to(root.parent).as_posix().encode() + b"\0" + path.read_bytes())
    for arg in tools.compile_flags + tools.binding_flags + [tools.clang_version]:
        digest.update(arg.encode() + b"\0")
    return digest.hexdigest()


def compile_cached(tools: Toolchain, repo: Path, unit: Unit, obj: Path, digest: str | None) -> Compiled:
    """compile_unit, remembered in the cache under the inputs' digest, so an
    unchanged tree is not compiled again (digest None: always compile)."""
    if digest is None:
        return compile_unit(tools, repo, unit, obj)
    key = "\0".join([digest, unit.label, *unit.options])
    path = cache_dir() / "results" / f"{hashlib.sha256(key.encode()).hexdigest()}.json"
    if path.is_file():
        return Compiled(**json.loads(path.read_text()))
    compiled = compile_unit(tools, repo, unit, obj)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.partial")
    partial.write_text(json.dumps(asdict(compiled)))
    os.replace(partial, path)
    return compiled


def symbols(tools: Toolchain, args: list[str]) -> list[str]:
    done = subprocess.run([tools.nm, *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise SetupError(f"{tools.nm} {' '.join(args)} failed: {done.stderr.strip()}")
    return sorted({line.split()[-1] for line in done.stdout.splitlines() if line.strip()})


def demangle(tools: Toolchain, mangled: list[str]) -> list[str]:
    if not mangled:
        return []
    # Mach-O prefixes C symbols with "_": strip it first (-_).
    done = subprocess.run([tools.cxxfilt, "-_"], input="\n".join(mangled), capture_output=True, text=True)
    names = done.stdout.splitlines()
    if done.returncode != 0 or len(names) != len(mangled):
        raise SetupError(f"{tools.cxxfilt} failed: {done.stderr.strip()}")
    return names


def libmlx_exports(tools: Toolchain) -> set[str]:
    listing = tools.mlx / "libmlx.exports"  # beside the unpacked wheel, made once
    if not listing.is_file():
        names = symbols(tools, ["--extern-only", "--defined-only", str(tools.mlx / "mlx/lib/libmlx.dylib")])
        if len(names) < 1000:
            raise SetupError(f"{tools.nm} read only {len(names)} exports from libmlx.dylib")
        partial = listing.with_suffix(f".{os.getpid()}.partial")
        partial.write_text("\n".join(names))
        os.replace(partial, listing)
    return set(listing.read_text().split("\n"))


def report_compile(report: Report, repo: Path, label: str, compiled: Compiled) -> None:
    for line in compiled.diagnostics.splitlines():
        if re.search(r": (fatal )?error: ", line):
            report.errors.append(f"[compile] {label}: {line.replace(str(repo) + '/', '')}")
        elif ": warning: " in line and line.startswith(str(repo)):
            report.warnings.append(line.replace(str(repo) + "/", ""))
    if compiled.returncode != 0 and not any(e.startswith(f"[compile] {label}:") for e in report.errors):
        report.errors.append(f"[compile] {label}: clang failed\n{compiled.diagnostics[-3000:]}")


GENERATED_UNIT = "<generated> embedded_metal_sources.cpp"


def check(repo: Path = REPO, tools: Toolchain | None = None, only: list[str] | None = None,
          cache: bool = True) -> Report:
    """Compile every Mac unit of `repo` (or the `only` ones) and resolve their
    MLX symbols in libmlx.dylib. cache: reuse results of an unchanged tree."""
    repo = Path(repo).resolve()
    tools = tools or toolchain(repo)
    report = Report()
    digest = inputs_digest(tools, repo) if cache else None
    with tempfile.TemporaryDirectory(prefix="mac_host_") as tmp:
        tmp = Path(tmp)
        units = []
        options = unit_compile_options(repo)
        for name in mac_units(repo):
            units.append(Unit(repo / name, name, (), tuple(options.get(name, []))))
            if name in OPTION_DEFINES:
                units.append(Unit(repo / name, f"{name} with {OPTION_DEFINES[name]}", (OPTION_DEFINES[name],)))
        if only is None or GENERATED_UNIT in only:
            generated, failure = embed_metal_sources(tools, repo, tmp)
            if failure:
                report.errors.append(f"[embed] csrc/metal/embed_metal_sources.cmake failed: {failure}")
            else:
                units.append(Unit(generated, GENERATED_UNIT))
        if only is not None:
            missing = set(only) - {unit.label for unit in units} - {GENERATED_UNIT}
            if missing:
                raise ValueError(f"only: not units of {repo}: {sorted(missing)}")
            units = [unit for unit in units if unit.label in only]
        report.units = [unit.label for unit in units]
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
            results = list(pool.map(
                lambda i: compile_cached(tools, repo, units[i], tmp / f"unit{i}.o", digest), range(len(units))))
    exported = libmlx_exports(tools)
    for unit, compiled in zip(units, results):
        label = unit.label
        report_compile(report, repo, label, compiled)
        for mangled, name in zip(compiled.undefined, demangle(tools, compiled.undefined)):
            if not CHECKED_SYMBOL.match(name):
                continue
            if mangled in exported:
                report.checked_symbols.add(name)
            else:
                report.errors.append(f"[link] {label} needs {name}, which libmlx.dylib does not export")
    return report


def main(argv: list[str]) -> int:
    repo = Path(argv[1]) if len(argv) > 1 else REPO
    try:
        report = check(repo)
    except SetupError as error:
        print(f"mac host check: setup: {error}", file=sys.stderr)
        return 2
    print(report.summary())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
