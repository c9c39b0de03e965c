"""MSL emulator: type-check Metal kernels with clang-19 and run them on the CPU.

Usage::

    from kernel_lab import msl_emulator as me

    if not me.clang_available(): pytest.skip("clang-19 is not installed")
    me.typecheck("metal/attention_prefill.metal", include_dirs=[repo_root])    # MetalCompileError
    lib = me.compile_library(["metal/a.metal", "metal/b.metal"], include_dirs=[repo_root],
                             fast_math=True)           # cached in $MSL_EMULATOR_CACHE
    lib.kernel_names                                   # host names, e.g. ["attn_float_64", ...]
    lib.dispatch("attn_float_64", grid=(gx, gy, gz), threadgroup=(128, 1, 1),
                 buffers={0: q, 1: k, 2: v, 3: out, 5: params_bytes})

* ``grid`` counts threadgroups (dispatchThreadgroups); ``threads=(x, y, z)``
  instead gives total threads (dispatchThreads, smaller edge threadgroups).
* Buffers: C-contiguous NumPy arrays, passed by pointer and written in place
  (float16 -> ``half``; bfloat16 as ``np.uint16`` bits -> ``bfloat``), or
  bytes / NumPy scalars / structured arrays for ``constant`` structs.
* ``DeadlockError``: a barrier or simd function not reached by every thread
  (the message names file:line), or a kernel that never finishes.
  ``EmulatorError``: missing or too small buffers, out-of-bounds accesses
  (buffers and threadgroup arrays have guard pages), writes to const
  buffers, more than 32 KiB of threadgroup memory.
  ``MetalCompileError``: clang's diagnostics (address-space mistakes, ...).
* Threadgroup memory starts as 0xFF bytes (NaN), so uninitialised reads show.
* ``function_constants={20: True, "blocks": 32}`` sets [[function_constant(n)]]
  values for one dispatch; ``compile_library(..., counters=True)`` makes every
  dispatch return modelled costs (``Counters``; also ``lib.last_counters``).

How it works and what is not modelled: docs/msl_emulator.md.
"""

from __future__ import annotations

from pathlib import Path

from .build import cache_dir, clang_available
from .build import typecheck as _typecheck
from .counters import Counters
from .errors import DeadlockError, EmulatorError, MetalCompileError
from .library import FunctionConstant, MetalLibrary, Param
from .translate import translate

__all__ = [
    "clang_available",
    "typecheck",
    "compile_library",
    "MetalLibrary",
    "Param",
    "FunctionConstant",
    "Counters",
    "MetalCompileError",
    "DeadlockError",
    "EmulatorError",
    "cache_dir",
    "translate",
]


def typecheck(source_path, include_dirs=(), defines=None) -> None:
    """Raise MetalCompileError (with clang's diagnostics) unless the `.metal`
    source compiles with Metal's address-space rules."""
    _typecheck(Path(source_path), tuple(include_dirs), defines)


def compile_library(sources, include_dirs=(), fast_math: bool = False, defines=None,
                    counters: bool = False) -> MetalLibrary:
    """Type-check, translate and build `sources` (one path or several) into a
    MetalLibrary; `fast_math=True` compiles with -ffast-math (Metal's default),
    False precisely. `counters=True` builds a separately cached, slower
    library whose dispatches return cost Counters. Builds are cached by the
    content of the preprocessed source, the flags and the emulator's headers."""
    from .build import build

    if isinstance(sources, (str, Path)):
        sources = [sources]
    libraries = [build(Path(s), tuple(include_dirs), defines, fast_math, counters)[0] for s in sources]
    return MetalLibrary(libraries, fast_math)
