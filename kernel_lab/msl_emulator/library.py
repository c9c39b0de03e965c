"""Loaded kernel libraries and dispatches (ctypes over msl_launch.h's C API)."""

from __future__ import annotations

import ctypes
import json
import math
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import build
from .counters import RUNTIME_FIELDS, Counters
from .errors import DeadlockError, EmulatorError
from .translate import BUFFER, NO_CONDITION, THREADGROUP_MEMORY

MAX_THREADS_PER_THREADGROUP = 1024
DEFAULT_TIMEOUT_S = float(os.environ.get("MSL_EMULATOR_TIMEOUT", 120))

# Fault handlers are process-wide while a dispatch runs: one at a time.
_DISPATCH_LOCK = threading.Lock()


class _ParamInfo(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int),
        ("index", ctypes.c_int),
        ("bytes", ctypes.c_uint32),
        ("align", ctypes.c_uint32),
        ("is_pointer", ctypes.c_int),
        ("writable", ctypes.c_int),
        ("type", ctypes.c_char_p),
        ("condition", ctypes.c_int),
    ]


@dataclass(frozen=True)
class Param:
    kind: int
    index: int
    bytes: int
    align: int
    is_pointer: bool
    writable: bool
    type: str  # as MSL spells it, e.g. "const device float*"
    condition: int = NO_CONDITION  # id of the bool function constant the parameter exists under


# Function constant types -> how their values are packed.
_CONSTANT_DTYPES = {
    "bool": np.bool_, "char": np.int8, "uchar": np.uint8, "short": np.int16, "ushort": np.uint16,
    "int": np.int32, "uint": np.uint32, "long": np.int64, "ulong": np.uint64,
    "half": np.float16, "float": np.float32,
}


@dataclass(frozen=True)
class FunctionConstant:
    id: int
    name: str
    type: str  # as MSL spells it, e.g. "bool"


def _msl_type(pretty_function: str) -> str:
    """`... [T = const __attribute__((address_space(1))) float *]` -> `const device float*`."""
    match = re.search(r"\[T = (.*)\]$", pretty_function)
    text = match.group(1) if match else pretty_function
    for number, space in (("1", "device"), ("2", "constant"), ("3", "threadgroup")):
        text = text.replace(f"__attribute__((address_space({number})))", space)
    text = text.replace("const constant", "constant").replace("_Float16", "half").replace("__bf16", "bfloat")
    text = text.replace("unsigned int", "uint").replace(" *", "*").replace(" &", "&")
    return text


class _Library:
    """One compiled `.metal` source."""

    def __init__(self, path: Path):
        self.path = path
        self.handle = ctypes.CDLL(str(path))
        counted = build.static_counters_path(path)
        self.thread_array_bytes: dict[str, int] | None = json.loads(counted.read_text()) if counted.exists() else None
        self.handle.msl_last_counters.argtypes = [ctypes.POINTER(ctypes.c_uint64)]
        self.handle.msl_kernel_count.restype = ctypes.c_int
        self.handle.msl_kernel_name.restype = ctypes.c_char_p
        self.handle.msl_kernel_name.argtypes = [ctypes.c_int]
        self.handle.msl_kernel_params.restype = ctypes.c_int
        self.handle.msl_kernel_params.argtypes = [ctypes.c_int, ctypes.POINTER(_ParamInfo), ctypes.c_int]
        u32p = ctypes.POINTER(ctypes.c_uint32)
        self.handle.msl_dispatch.restype = ctypes.c_int
        self.handle.msl_dispatch.argtypes = [
            ctypes.c_char_p, u32p, u32p, u32p,                       # name, threadgroups, size, grid threads
            ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_uint64), u32p, ctypes.POINTER(ctypes.c_int),
            ctypes.c_int,                                            # buffers, bytes, align, writable, count
            u32p, ctypes.c_int,                                      # threadgroup argument lengths, count
            ctypes.c_int, ctypes.c_double,                           # workers, timeout
            ctypes.c_char_p, ctypes.c_int, ctypes.POINTER(ctypes.c_uint64),  # error, capacity, fault pc
        ]
        self.params: dict[str, list[Param]] = {}
        for i in range(self.handle.msl_kernel_count()):
            name = self.handle.msl_kernel_name(i).decode()
            count = self.handle.msl_kernel_params(i, None, 0)
            infos = (_ParamInfo * max(count, 1))()
            self.handle.msl_kernel_params(i, infos, count)
            self.params[name] = [
                Param(p.kind, p.index, p.bytes, p.align, bool(p.is_pointer), bool(p.writable),
                      _msl_type(p.type.decode()), p.condition)
                for p in infos[:count]
            ]
        self.handle.msl_function_constant_count.restype = ctypes.c_int
        self.handle.msl_function_constant_info.argtypes = [
            ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_char_p)]
        self.handle.msl_set_function_constants.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        self.constants: list[FunctionConstant] = []
        for i in range(self.handle.msl_function_constant_count()):
            id_, name, type_ = ctypes.c_int(), ctypes.c_char_p(), ctypes.c_char_p()
            self.handle.msl_function_constant_info(i, id_, name, type_)
            self.constants.append(FunctionConstant(id_.value, name.value.decode(), _msl_type(type_.value.decode())))

    def set_function_constants(self, kernel: str, values: dict) -> set[int]:
        """Give the library's function constants `values` (by id or name; the
        others become unset). Returns the ids of the true bool constants."""
        by_key = {c.id: c for c in self.constants} | {c.name: c for c in self.constants}
        unknown = sorted(str(k) for k in values if k not in by_key)
        if unknown:
            known = ", ".join(f"{c.name} ({c.id})" for c in self.constants) or "none"
            raise EmulatorError(f"{kernel}: no function constant {', '.join(unknown)}; the source declares {known}")
        packed: dict[int, np.ndarray] = {}
        for key, value in values.items():
            constant = by_key[key]
            dtype = _CONSTANT_DTYPES.get(constant.type)
            if dtype is None:
                raise EmulatorError(f"{kernel}: function constant {constant.name} has type {constant.type}, "
                                    "which the emulator cannot set")
            packed[constant.id] = np.array([value], dtype=dtype)
        pointers = (ctypes.c_void_p * max(len(self.constants), 1))()
        for i, constant in enumerate(self.constants):
            if constant.id in packed:
                pointers[i] = packed[constant.id].ctypes.data
        self.handle.msl_set_function_constants(pointers)
        return {i for i, v in packed.items() if v.dtype == np.bool_ and bool(v[0])}


def _dims(value, what: str) -> tuple[int, int, int]:
    values = tuple(int(v) for v in (value if isinstance(value, (tuple, list)) else (value,)))
    if not 1 <= len(values) <= 3 or min(values) < 1:
        raise EmulatorError(f"invalid launch: {what} {value!r} (1 to 3 positive sizes)")
    return values + (1,) * (3 - len(values))


class _Buffer:
    """One bound buffer as the C side wants it: pointer and size."""

    def __init__(self, index: int, value):
        self.index = index
        self.keep = value
        self.read_only = False
        if isinstance(value, np.ndarray):
            if not value.flags["C_CONTIGUOUS"]:
                raise EmulatorError(f"buffer {index} must be C-contiguous (use np.ascontiguousarray)")
            if value.dtype.hasobject:
                raise EmulatorError(f"buffer {index} holds Python objects ({value.dtype})")
            self.pointer, self.bytes = value.ctypes.data, value.nbytes
            self.read_only = not value.flags["WRITEABLE"]
        elif isinstance(value, (bytes, bytearray, memoryview, np.generic)) or hasattr(value, "__buffer__") or isinstance(value, ctypes.Structure):
            data = bytes(memoryview(value).cast("B")) if not isinstance(value, np.generic) else value.tobytes()
            self.keep = ctypes.create_string_buffer(data, max(len(data), 1))
            self.pointer, self.bytes = ctypes.addressof(self.keep), len(data)
            self.read_only = True  # a copy: the kernel's writes would be lost
        else:
            raise EmulatorError(
                f"buffer {index}: pass a numpy array or bytes (struct.pack / np.uint32(...)), not {type(value).__name__}"
            )


class MetalLibrary:
    """The kernels of one or more `.metal` sources, ready to dispatch."""

    def __init__(self, libraries: list[Path], fast_math: bool):
        self.fast_math = fast_math
        self.last_counters: Counters | None = None  # of the latest dispatch, in libraries built with counters
        self._kernels: dict[str, _Library] = {}
        for path in libraries:
            library = _Library(path)
            for name in library.params:
                if name in self._kernels:
                    raise EmulatorError(f"kernel {name!r} is defined by two sources")
                self._kernels[name] = library

    @property
    def kernel_names(self) -> list[str]:
        return sorted(self._kernels)

    def params(self, name: str) -> list[Param]:
        """The kernel's parameters: bindings, sizes, MSL types."""
        return list(self._library(name).params[name])

    def _library(self, name: str) -> _Library:
        if name not in self._kernels:
            raise EmulatorError(f"no kernel named {name!r}; the library has {self.kernel_names}")
        return self._kernels[name]

    def function_constants(self, name: str) -> list[FunctionConstant]:
        """The function constants declared by the source of kernel `name`."""
        return list(self._library(name).constants)

    def dispatch(self, name: str, grid, threadgroup, buffers: dict, threads=None, *,
                 threadgroup_memory: dict | None = None, timeout: float | None = None,
                 function_constants: dict | None = None) -> Counters | None:
        """Run kernel `name` on `grid` threadgroups of `threadgroup` threads
        (like dispatchThreadgroups). With `threads` (total threads per
        dimension, like dispatchThreads) the grid is derived from it and the
        threadgroups at the far edges are smaller. NumPy buffers are passed by
        pointer and written in place; bytes are read-only `constant` data.
        `threadgroup_memory` gives the byte lengths of [[threadgroup(n)]]
        arguments. `function_constants` gives values of [[function_constant(n)]]
        declarations by id or name (as a pipeline's MTLFunctionConstantValues);
        a parameter attributed with a false one needs no buffer, and reading a
        constant left unset is an error. In a library compiled with
        `counters=True` the dispatch returns its Counters (also kept in
        `last_counters`); otherwise None. Raises DeadlockError for a deadlock or
        a kernel that runs longer than `timeout` seconds, EmulatorError for
        anything else that stops a kernel (missing buffers, out-of-bounds
        accesses, ...)."""
        self.last_counters = None
        library = self._library(name)
        size = _dims(threadgroup, "threadgroup")
        if math.prod(size) > MAX_THREADS_PER_THREADGROUP:
            raise EmulatorError(f"invalid launch: threadgroup {size} has more than {MAX_THREADS_PER_THREADGROUP} threads")
        if threads is not None:
            total = _dims(threads, "threads")
            derived = tuple(-(-t // s) for t, s in zip(total, size))
            if grid is not None and _dims(grid, "grid") != derived:
                raise EmulatorError(f"invalid launch: grid {grid} does not match threads {total} / threadgroup {size}")
            groups = derived
        else:
            groups = _dims(grid, "grid")
            total = tuple(g * s for g, s in zip(groups, size))

        params = library.params[name]
        bound = {int(i): _Buffer(int(i), v) for i, v in buffers.items()}
        with _DISPATCH_LOCK:
            true_constants = library.set_function_constants(name, function_constants or {})
            return self._dispatch(library, name, params, bound, groups, size, total, true_constants,
                                  threadgroup_memory, timeout)

    def _dispatch(self, library, name, params, bound, groups, size, total, true_constants,
                  threadgroup_memory, timeout) -> Counters | None:
        count = max(bound, default=-1) + 1
        align = [16] * count
        writable = [0] * count
        params = [p for p in params if p.condition == NO_CONDITION or p.condition in true_constants]
        for p in params:
            if p.kind == BUFFER:
                self._check_buffer(name, p, bound)
                align[p.index] = max(align[p.index], p.align)
                writable[p.index] |= p.writable
        arg_lengths = [0] * (max((p.index for p in params if p.kind == THREADGROUP_MEMORY), default=-1) + 1)
        for p in params:
            if p.kind == THREADGROUP_MEMORY:
                length = (threadgroup_memory or {}).get(p.index)
                if not length:
                    raise EmulatorError(f"{name}: parameter `{p.type}` [[threadgroup({p.index})]] needs "
                                        f"threadgroup_memory={{{p.index}: bytes}}")
                arg_lengths[p.index] = int(length)

        pointers = (ctypes.c_void_p * max(count, 1))()
        sizes = (ctypes.c_uint64 * max(count, 1))()
        for i, b in bound.items():
            pointers[i], sizes[i] = b.pointer, b.bytes
        error = ctypes.create_string_buffer(4096)
        fault_pc = ctypes.c_uint64(0)
        workers = int(os.environ.get("MSL_EMULATOR_THREADS") or os.cpu_count() or 1)
        u32x3 = ctypes.c_uint32 * 3
        # The caller holds _DISPATCH_LOCK (fault handlers and function constants are process-wide).
        code = library.handle.msl_dispatch(
            name.encode(), u32x3(*groups), u32x3(*size), u32x3(*total),
            pointers, sizes, (ctypes.c_uint32 * max(count, 1))(*align), (ctypes.c_int * max(count, 1))(*writable),
            count, (ctypes.c_uint32 * max(len(arg_lengths), 1))(*arg_lengths), len(arg_lengths),
            workers, float(timeout or DEFAULT_TIMEOUT_S), error, len(error), ctypes.byref(fault_pc),
        )
        if code == 0:
            if library.thread_array_bytes is None:
                return None
            values = (ctypes.c_uint64 * RUNTIME_FIELDS)()
            library.handle.msl_last_counters(values)
            self.last_counters = Counters(*values, library.thread_array_bytes[name])
            return self.last_counters
        message = f"{name}: {error.value.decode(errors='replace')}"
        if code == 3:
            location = build.symbolize(library.path, fault_pc.value)
            if location:
                message += f" (faulting code at {location})"
        if code in (1, 4):
            raise DeadlockError(message)
        raise EmulatorError(message)

    @staticmethod
    def _check_buffer(name: str, p: Param, bound: dict) -> None:
        if p.index not in bound:
            raise EmulatorError(f"{name}: parameter `{p.type}` [[buffer({p.index})]] has no buffer bound "
                                f"(buffers given: {sorted(bound)})")
        b = bound[p.index]
        if not p.is_pointer and b.bytes < p.bytes:
            raise EmulatorError(f"{name}: buffer {p.index} has {b.bytes} bytes but parameter `{p.type}` needs {p.bytes}")
        if p.writable and b.read_only and isinstance(b.keep, np.ndarray):
            raise EmulatorError(f"{name}: buffer {p.index} is a read-only array but the kernel may write it (`{p.type}`)")


def load(libraries: list[Path], fast_math: bool) -> MetalLibrary:
    return MetalLibrary(libraries, fast_math)
