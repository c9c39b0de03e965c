"""clang-19: preprocess, type-check and compile translated kernels (cached)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

from .errors import EmulatorError, MetalCompileError
from . import counters
from .translate import Translation, translate

HERE = Path(__file__).resolve().parent
INCLUDE = HERE / "include"
FAKE_METAL = INCLUDE / "fake_metal"  # empty <metal_stdlib> & co.
COUNTING_FLAG = "-DMSL_COUNTERS"  # the shim's counters (counters.py)
METAL_VERSION = 310  # __METAL_VERSION__ as Metal 3.1's compiler defines it

CLANG = shutil.which("clang++-19") or shutil.which("clang-19")
SYMBOLIZER = shutil.which("llvm-symbolizer-19") or shutil.which("llvm-symbolizer")

WARNINGS_OFF = [
    "-Wno-unknown-attributes",  # [[buffer(0)]] and other Metal attributes
    "-Wno-ignored-attributes",
    "-Wno-macro-redefined",
    "-Wno-duplicate-decl-specifier",  # `constant` is `const ...`; `const constant T` repeats it
    "-Wno-unused-value",
]


def clang_available() -> bool:
    return CLANG is not None


def cache_dir() -> Path:
    path = Path(os.environ.get("MSL_EMULATOR_CACHE") or Path(tempfile.gettempdir()) / "msl_emulator_cache")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _require_clang() -> str:
    if CLANG is None:
        raise EmulatorError("clang-19 is not installed (apt-get install clang-19)")
    return CLANG


def _defines(defines) -> list[str]:
    flags = []
    for key, value in (defines or {}).items():
        flags.append(f"-D{key}" if value is None else f"-D{key}={value}")
    return flags


def preprocess(source: Path, include_dirs=(), defines=None) -> str:
    """The source with includes and macros expanded (line markers kept)."""
    if not source.is_file():
        raise EmulatorError(f"no such kernel source: {source}")
    cmd = [_require_clang(), "-E", "-x", "c++", "-std=c++20", f"-I{FAKE_METAL}", f"-D__METAL_VERSION__={METAL_VERSION}"]
    cmd += [f"-I{d}" for d in include_dirs] + _defines(defines) + [str(source)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise MetalCompileError(f"preprocessing {source} failed:\n{result.stderr}")
    return result.stdout


def compile_flags(fast_math: bool, counters: bool = False) -> list[str]:
    flags = [
        "-std=c++20", "-fPIC", "-O1", "-fvisibility=hidden",
        # Counting builds go through textual IR: no debug info to keep in step.
        *(["-g0", COUNTING_FLAG] if counters else ["-gline-tables-only"]),
        # half/bfloat arithmetic rounds after every operation, as on the GPU
        # (clang would otherwise keep float intermediates).
        "-Xclang", "-ffloat16-excess-precision=none", "-Xclang", "-fbfloat16-excess-precision=none",
        "-Werror=return-type",
        f"-I{INCLUDE}", "-include", str(INCLUDE / "msl_launch.h"),
        *WARNINGS_OFF,
    ]
    return flags + (["-ffast-math"] if fast_math else ["-fno-fast-math"])


@lru_cache(maxsize=1)
def _runtime_fingerprint() -> str:
    """Everything besides the source that changes a built library."""
    digest = hashlib.sha256()
    version = subprocess.run([_require_clang(), "--version"], capture_output=True, text=True).stdout
    digest.update(version.encode())
    for header in sorted(INCLUDE.glob("*.h")):
        digest.update(header.name.encode() + header.read_bytes())
    return digest.hexdigest()


def _fingerprint(translation: Translation, flags: list[str]) -> str:
    digest = hashlib.sha256(translation.cpp.encode())
    digest.update(" ".join(flags).encode())
    digest.update(_runtime_fingerprint().encode())
    if COUNTING_FLAG in flags:
        digest.update((HERE / "counters.py").read_bytes())  # the IR instrumentation
    return digest.hexdigest()[:24]


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    partial.write_text(text)
    partial.replace(path)


def _clang(args: list[str], source: Path) -> None:
    result = subprocess.run([_require_clang(), *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise MetalCompileError(f"{source}:\n{result.stderr}")


def typecheck(source, include_dirs=(), defines=None) -> None:
    """Raise MetalCompileError unless clang accepts the kernel source."""
    source = Path(source)
    translation = translate(preprocess(source, include_dirs, defines))
    flags = compile_flags(fast_math=False)
    key = _fingerprint(translation, flags)
    checked = cache_dir() / f"{source.stem}-{key}.checked"
    if checked.exists():
        return
    cpp = cache_dir() / f"{source.stem}-{key}.cpp"
    _write_atomically(cpp, translation.cpp)
    _clang([*flags, "-fsyntax-only", str(cpp)], source)
    checked.touch()


def build(source, include_dirs=(), defines=None, fast_math=False, counters=False) -> tuple[Path, Translation]:
    """Translate and compile `source` into a shared library (cached by
    content). With `counters`, the library counts costs (counters.py) and a
    `.counters.json` beside it holds each kernel's per-thread array bytes."""
    source = Path(source)
    translation = translate(preprocess(source, include_dirs, defines))
    flags = compile_flags(fast_math, counters)
    key = _fingerprint(translation, flags)
    library = cache_dir() / f"{source.stem}-{key}.so"
    if not library.exists():
        cpp = cache_dir() / f"{source.stem}-{key}.cpp"
        _write_atomically(cpp, translation.cpp)
        partial = library.with_name(f"{library.name}.{os.getpid()}.partial")
        if counters:
            _build_counting(cpp, translation, flags, partial, source, static_counters_path(library))
        else:
            _clang([*flags, "-shared", str(cpp), "-o", str(partial)], source)
        partial.replace(library)
    return library, translation


def static_counters_path(library: Path) -> Path:
    return library.with_suffix(".counters.json")


def _build_counting(cpp: Path, translation: Translation, flags: list[str], output: Path, source: Path,
                    static_output: Path) -> None:
    ir = cpp.with_suffix(f".{os.getpid()}.ll")
    _clang([*flags, "-S", "-emit-llvm", str(cpp), "-o", str(ir)], source)
    text = ir.read_text()
    arrays = {
        kernel.host_name: counters.thread_array_bytes(text, f"_ZL{len(f'msl_body_{i}')}msl_body_{i}v")
        for i, kernel in enumerate(translation.kernels)
    }
    ir.write_text(counters.instrument(text))
    _clang(["-fPIC", "-O1", "-shared", "-x", "ir", str(ir), "-o", str(output)], source)
    ir.unlink()
    _write_atomically(static_output, json.dumps(arrays))


def symbolize(library: Path, offset: int) -> str | None:
    """file:line of the kernel code at `offset` in `library`, if it can be told."""
    if not SYMBOLIZER or not offset:
        return None
    result = subprocess.run([SYMBOLIZER, f"--obj={library}", hex(offset)], capture_output=True, text=True)
    frames = [line for line in result.stdout.splitlines()[1::2] if line and not line.startswith("??")]
    # Innermost first; skip frames inside the emulator's own headers.
    for frame in frames:
        if str(INCLUDE) not in frame:
            return frame.rsplit(":", 1)[0] if frame.count(":") >= 2 else frame
    return frames[0] if frames else None
