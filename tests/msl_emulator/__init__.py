"""An emulator for Metal Shading Language compute kernels, for tests on
machines without a Mac.

    from msl_emulator import compile_library, clang_available
    lib = compile_library(["metal/attention.metal"], include_dirs=[repo_root], fast_math=True)
    lib.dispatch("kernel_host_name", grid=(gx, gy, gz), threadgroup=(tx, ty, tz),
                 buffers={0: numpy_array, 1: numpy_array, 5: params_bytes})

The ``.metal`` source is preprocessed, lightly rewritten (explicit template
instantiations with ``[[host_name]]`` become plain instantiations plus a
launcher; statement-level ``threadgroup`` arrays become storage shared by the
threadgroup) and compiled by clang-19 as C++ against ``include/metal_shim.h``,
in which Metal's address spaces are real clang address spaces. Kernels then
run on the CPU (``include/msl_runtime.h``): each threadgroup's threads are
fibers; barriers and simd collectives synchronise them; deadlocks raise
:class:`DeadlockError` naming where threads wait. See docs/msl_emulator.md.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

__all__ = [
    "clang_available",
    "typecheck",
    "compile_library",
    "MetalLibrary",
    "MetalCompileError",
    "DeadlockError",
    "EmulatorError",
]

HERE = Path(__file__).resolve().parent
INCLUDE = HERE / "include"
FAKE_METAL = INCLUDE / "fake_metal"
CLANG = shutil.which("clang++-19") or shutil.which("clang-19")

BUILTINS = {
    "thread_position_in_grid": 1,
    "threadgroup_position_in_grid": 2,
    "thread_position_in_threadgroup": 3,
    "thread_index_in_threadgroup": 4,
    "threads_per_threadgroup": 5,
    "threadgroups_per_grid": 6,
    "threads_per_grid": 7,
    "simdgroup_index_in_threadgroup": 8,
    "thread_index_in_simdgroup": 9,
    "threads_per_simdgroup": 10,
    "simdgroups_per_threadgroup": 11,
}


class MetalCompileError(Exception):
    """clang rejected the kernel source (diagnostics in the message)."""


class EmulatorError(Exception):
    """The emulator cannot run this (bad launch, unsupported construct)."""


class DeadlockError(EmulatorError):
    """Threads wait at a barrier or simd function that others never reach."""


def clang_available() -> bool:
    return CLANG is not None


def _cache_dir() -> Path:
    path = Path(os.environ.get("MSL_EMULATOR_CACHE", Path(tempfile.gettempdir()) / "msl_emulator_cache"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True)


def _preprocess(source: Path, include_dirs, defines) -> str:
    cmd = [CLANG, "-E", "-x", "c++", "-std=c++20", f"-I{FAKE_METAL}", "-D__METAL_VERSION__=310"]
    cmd += [f"-I{d}" for d in include_dirs]
    cmd += [f"-D{k}={v}" for k, v in (defines or {}).items()]
    result = _run(cmd + [str(source)])
    if result.returncode != 0:
        raise MetalCompileError(f"preprocessing {source} failed:\n{result.stderr}")
    return result.stdout


def _split_top_level(text: str) -> list[str]:
    parts, depth, start, i = [], 0, 0, 0
    while i < len(text):
        ch = text[i]
        if ch in "(<[":
            depth += 1
        elif ch in ")>]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
        i += 1
    if text[start:].strip():
        parts.append(text[start:])
    return parts


def _matching_paren(text: str, open_index: int) -> int:
    depth = 0
    for i in range(open_index, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return i
    raise MetalCompileError("unbalanced parentheses in a kernel signature")


_KERNEL_DEF = re.compile(r"(\[\[\s*kernel\s*\]\]|\bkernel\b)\s+void\s+(\w+)\s*\(")
_INSTANTIATION = re.compile(
    r"template\s*\[\[\s*host_name\s*\(\s*((?:\"[^\"]*\"\s*)+)\)\s*\]\]\s*\[\[\s*kernel\s*\]\]\s*([^;]+);"
)
_ATTRIBUTE = re.compile(r"\[\[\s*(\w+)\s*(?:\(\s*(\d+)\s*\))?\s*\]\]")
_VECTOR_CONSTRUCTOR = re.compile(r"\b((?:float|half|bfloat|int|uint|short|ushort|ulong)[234])\s*\(")
_TG_ARRAY = re.compile(r"^(\s*)threadgroup\s+([\w:<>, ]+?)\s+(\w+)((?:\s*\[[^\]]+\])+)\s*;", re.M)


def _parameter_specs(params: str, kernel: str) -> list[tuple[int, int]]:
    specs = []
    for param in _split_top_level(params):
        match = _ATTRIBUTE.search(param)
        if not match:
            raise MetalCompileError(f"kernel {kernel}: parameter {param.strip()!r} has no [[...]] binding")
        name, index = match.group(1), match.group(2)
        if name == "buffer":
            specs.append((0, int(index)))
        elif name in BUILTINS:
            specs.append((BUILTINS[name], 0))
        else:
            raise MetalCompileError(f"kernel {kernel}: attribute [[{name}]] is not supported by the emulator")
    return specs


def translate(text: str) -> tuple[str, list[str]]:
    """Preprocessed MSL -> C++ for the shim, plus the kernel host names."""
    instantiations = []

    def instantiate(match):
        host = "".join(re.findall(r'"([^"]*)"', match.group(1)))  # adjacent literals concatenate
        decl = match.group(2)
        inner = re.match(r"decltype\s*\((.*)\)\s*(.*)$", decl.strip(), re.S)
        if not inner:
            raise MetalCompileError(f"cannot read the instantiation of {host!r}: {decl.strip()}")
        function = inner.group(2).strip()
        instantiations.append((host, function, function.split("<")[0].strip()))
        return f"template decltype({function}) {function};"

    text = _INSTANTIATION.sub(instantiate, text)

    kernels = {}  # function name -> parameter specs
    for match in _KERNEL_DEF.finditer(text):
        name = match.group(2)
        close = _matching_paren(text, match.end() - 1)
        kernels[name] = _parameter_specs(text[match.end() : close], name)
    text = _KERNEL_DEF.sub(lambda m: f"void {m.group(2)}(", text)

    counter = iter(range(1, 1 << 30))

    def shared(match):
        indent, type_, name, dims = match.groups()
        dims = re.sub(r"\s+", "", dims)
        return (
            f"{indent}threadgroup {type_} (&{name}){dims} = *(threadgroup {type_} (*){dims})"
            f"msl_rt::threadgroup_alloc({next(counter)}, sizeof({type_}{dims}));"
        )

    text = _TG_ARRAY.sub(shared, text)
    text = _VECTOR_CONSTRUCTOR.sub(lambda m: f"msl_make<{m.group(1)}>(", text)

    launchers = []
    names = []
    targets = [(host, fn, base) for host, fn, base in instantiations]
    templated = {base for _, _, base in instantiations}
    targets += [(name, name, name) for name in kernels if name not in templated]
    for i, (host, function, base) in enumerate(targets):
        if base not in kernels:
            raise MetalCompileError(f"{host!r} instantiates {base}, which is not a [[kernel]] function")
        specs = ", ".join(f"{{{k}, {idx}}}" for k, idx in kernels[base]) or "{0, -1}"
        launchers.append(
            f"static const msl_rt::Param msl_params_{i}[] = {{{specs}}};\n"
            f"static void msl_body_{i}() {{ msl_rt::invoke({'&' + function}, msl_params_{i}); }}"
        )
        names.append(host)
    table = ",\n".join(f'  {{"{h}", msl_body_{i}}}' for i, h in enumerate(names))
    text += "\n// ---- generated by msl_emulator ----\n" + "\n".join(launchers)
    text += f"\nstatic const msl_rt::Entry msl_entries[] = {{\n{table}\n}};\n"
    text += f"MSL_EMULATOR_EXPORTS({len(names)})\n"
    return text, names


def _compile_flags(fast_math: bool) -> list[str]:
    flags = ["-std=c++20", "-O1", "-g0", "-fPIC", "-Wno-unknown-attributes", "-Wno-ignored-attributes",
             "-Wno-macro-redefined", "-Wno-duplicate-decl-specifier", f"-I{INCLUDE}", "-include", str(INCLUDE / "metal_shim.h"),
             "-include", str(INCLUDE / "msl_launch.h")]
    return flags + (["-ffast-math"] if fast_math else ["-fno-fast-math"])


def typecheck(source, include_dirs=(), defines=None) -> None:
    """Raise MetalCompileError unless clang accepts the kernel source."""
    _build(Path(source), include_dirs, defines, fast_math=False, syntax_only=True)


def _build(source: Path, include_dirs, defines, fast_math: bool, syntax_only=False):
    if CLANG is None:
        raise EmulatorError("clang-19 is not installed (apt-get install clang-19)")
    translated, names = translate(_preprocess(source, include_dirs, defines))
    flags = _compile_flags(fast_math)
    digest = hashlib.sha256((translated + " ".join(flags) + str(syntax_only)).encode()).hexdigest()[:20]
    for header in INCLUDE.glob("*.h"):
        digest = hashlib.sha256((digest + header.read_text()).encode()).hexdigest()[:20]
    cache = _cache_dir()
    cpp = cache / f"{source.stem}-{digest}.cpp"
    lib = cache / f"{source.stem}-{digest}.so"
    if syntax_only:
        cpp.write_text(translated)
        result = _run([CLANG, *flags, "-fsyntax-only", str(cpp)])
        if result.returncode != 0:
            raise MetalCompileError(f"{source}:\n{result.stderr}")
        return None, names
    if not lib.exists():
        cpp.write_text(translated)
        partial = lib.with_suffix(".so.partial")
        result = _run([CLANG, *flags, "-shared", str(cpp), "-o", str(partial)])
        if result.returncode != 0:
            raise MetalCompileError(f"{source}:\n{result.stderr}")
        partial.replace(lib)
    return lib, names


class MetalLibrary:
    """Compiled kernels of one or more ``.metal`` sources."""

    def __init__(self, libraries: list[tuple[Path, list[str]]], fast_math: bool):
        self.fast_math = fast_math
        self._kernels = {}
        self._handles = []
        for path, names in libraries:
            handle = ctypes.CDLL(str(path))
            handle.msl_dispatch.restype = ctypes.c_int
            handle.msl_dispatch.argtypes = [
                ctypes.c_char_p, ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_char_p, ctypes.c_int,
            ]
            self._handles.append(handle)
            for name in names:
                self._kernels[name] = handle

    @property
    def kernel_names(self) -> list[str]:
        return sorted(self._kernels)

    def dispatch(self, name: str, grid, threadgroup, buffers: dict, threads=None) -> None:
        """Run kernel `name` on `grid` threadgroups of `threadgroup` threads.
        Numpy buffers are passed by pointer and written in place."""
        if name not in self._kernels:
            raise EmulatorError(f"no kernel named {name!r}; the library has {self.kernel_names}")
        grid = tuple(int(x) for x in grid) + (1,) * (3 - len(grid))
        threadgroup = tuple(int(x) for x in threadgroup) + (1,) * (3 - len(threadgroup))
        if min(grid) < 1 or min(threadgroup) < 1 or np.prod(threadgroup) > 1024:
            raise EmulatorError(f"invalid launch: grid {grid}, threadgroup {threadgroup}")
        count = max(buffers) + 1 if buffers else 0
        pointers = (ctypes.c_void_p * max(count, 1))()
        keep = []
        for index, value in buffers.items():
            if isinstance(value, np.ndarray):
                if not value.flags["C_CONTIGUOUS"]:
                    raise EmulatorError(f"buffer {index} must be C-contiguous")
                pointers[index] = value.ctypes.data
            else:
                data = ctypes.create_string_buffer(bytes(value), len(bytes(value)) + 16)
                keep.append(data)
                pointers[index] = ctypes.addressof(data)
        error = ctypes.create_string_buffer(2048)
        code = self._kernels[name].msl_dispatch(
            name.encode(), (ctypes.c_uint32 * 3)(*grid), (ctypes.c_uint32 * 3)(*threadgroup),
            pointers, count, error, len(error),
        )
        if code == 1:
            raise DeadlockError(f"{name}: {error.value.decode()}")
        if code != 0:
            raise EmulatorError(f"{name}: {error.value.decode()}")


def compile_library(sources, include_dirs=(), fast_math: bool = False, defines=None) -> MetalLibrary:
    """Type-check and build the kernels of `sources` (cached by content)."""
    if isinstance(sources, (str, Path)):
        sources = [sources]
    built = [_build(Path(s), include_dirs, defines, fast_math) for s in sources]
    return MetalLibrary(built, fast_math)
