"""Cost counters: the instrumented build and the per-launch numbers.

A library compiled with ``counters=True`` is built in two steps: clang emits
optimised LLVM IR (``-O1``, as every build), :func:`instrument` inserts a call
``msl_count_access(space, bytes, is_store, address, alignment)`` before every load, store and
memory intrinsic on device (1), constant (2) and threadgroup (3) memory, and
clang compiles the IR (the call also gets the address and the alignment the
instruction assumes: a misaligned device access fails the dispatch, as a
misaligned vector load is undefined on the GPU). Counting after optimisation counts the accesses the
compiled kernel makes (values kept in registers are read once), not every
subscript in the source. The shim counts the rest (simd functions, barriers,
simdgroup products, exp/exp2) when ``MSL_COUNTERS`` is defined.

Per-thread array bytes are static: the bytes of the ``alloca``s (arrays and
aggregates that stay in per-thread memory after optimisation) of the kernel
and the functions it calls, emulator runtime excluded; a simdgroup matrix
counts as the two elements a lane holds on the GPU.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, fields

COUNTED_SPACES = ("1", "2", "3")


@dataclass(frozen=True)
class Counters:
    """Modelled costs of one dispatch, summed over its threads (see
    docs/msl_emulator.md). Field order matches msl_rt::Counters."""

    device_bytes_read: int
    device_load_operations: int  # load instructions (and copies) from device memory, whatever their width
    device_bytes_written: int
    constant_bytes_read: int
    threadgroup_bytes_read: int
    threadgroup_bytes_written: int
    simdgroup_matrix_mmas: int   # 8x8x8 multiply-accumulates, counted once per simdgroup
    simd_ops: int                # shuffles, broadcasts, reductions, scans, once per simdgroup
    threadgroup_barriers: int    # released threadgroup barriers, once per threadgroup
    simdgroup_barriers: int      # once per simdgroup
    exp_calls: int               # exp and exp2, per thread and vector element
    threadgroup_memory_bytes: int  # allocated by one threadgroup
    thread_array_bytes: int      # per thread, static (allocas of the kernel)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


RUNTIME_FIELDS = len(fields(Counters)) - 1  # all but thread_array_bytes come from the C side


def _split_operands(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([{<":
            depth += 1
        elif ch in ")]}>":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:].strip())
    return parts


_LOAD = re.compile(r"^(\s*)%[\w.]+ = load (?:atomic )?(?:volatile )?(.*)$")
_STORE = re.compile(r"^(\s*)store (?:atomic )?(?:volatile )?(.*)$")
_MEMORY_INTRINSIC = re.compile(r"^(\s*)(?:tail )?call void @llvm\.(memcpy|memmove|memset)(?:\.inline)?\.[\w.]+\((.*)\)(.*)$")
_POINTER_SPACE = re.compile(r"^ptr addrspace\((\d+)\)")


def _space(operand: str) -> str | None:
    match = _POINTER_SPACE.match(operand)
    return match.group(1) if match and match.group(1) in COUNTED_SPACES else None


def _size_of(type_: str) -> str:
    return f"i64 ptrtoint (ptr getelementptr ({type_}, ptr null, i32 1) to i64)"


def _alignment(operands: list[str]) -> int:
    for operand in operands[2:]:
        if operand.startswith("align "):
            return int(operand.split()[1])
    return 1


class _Instrumenter:
    """Counting calls with the accessed address (a ptrtoint before each)."""

    def __init__(self):
        self.addresses = 0

    def call(self, indent: str, space: str, pointer: str | None, size: str, is_store: bool,
             alignment: int = 1) -> list[str]:
        """pointer None (copies, whose operands carry attributes): no address, no alignment check."""
        lines, address = [], "0"
        if pointer is not None:
            self.addresses += 1
            address = f"%msl_address_{self.addresses}"
            lines.append(f"{indent}{address} = ptrtoint {pointer} to i64")
        return lines + [f"{indent}call void @msl_count_access(i32 {space}, {size}, i32 {int(is_store)}, i64 {address}, "
                        f"i64 {alignment})"]


def instrument(ir: str) -> str:
    """`ir` with a counting call before every access to counted memory."""
    if "@msl_count_access(" not in ir:
        raise ValueError("the module does not define msl_count_access (was it built with MSL_COUNTERS?)")
    out = []
    counting = _Instrumenter()
    for line in ir.splitlines():
        if (match := _LOAD.match(line)):
            operands = _split_operands(match.group(2))
            space = _space(operands[1]) if len(operands) > 1 else None
            if space:
                out += counting.call(match.group(1), space, operands[1], _size_of(operands[0]), False,
                                     _alignment(operands))
        elif (match := _STORE.match(line)):
            operands = _split_operands(match.group(2))
            space = _space(operands[1]) if len(operands) > 1 else None
            if space:
                type_ = operands[0].rsplit(" ", 1)[0]
                out += counting.call(match.group(1), space, operands[1], _size_of(type_), True, _alignment(operands))
        elif (match := _MEMORY_INTRINSIC.match(line)):
            indent, kind, operands = match.group(1), match.group(2), _split_operands(match.group(3))
            length = operands[2]
            destination = _space(operands[0])
            if destination:
                out += counting.call(indent, destination, None, length, True)
            if kind != "memset" and (source := _space(operands[1])):
                out += counting.call(indent, source, None, length, False)
        out.append(line)
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------- per-thread arrays
_STRUCT_TYPE = re.compile(r"^(%[\w.\"$:<>, ]+?) = type (<?\{.*\}>?|opaque)\s*$", re.M)
_DEFINE = re.compile(r"^define [^@]*@([\w.$]+)\(.*?\{\s*$(.*?)^\}", re.M | re.S)
_ALLOCA = re.compile(r"= alloca (.*?)(?:, align (\d+))?(?:, !.*)?$", re.M)
_REFERENCE = re.compile(r"@([\w.$]+)")  # calls and function pointers (launchers pass the kernel)
_SCALAR_BYTES = {"half": 2, "bfloat": 2, "float": 4, "double": 8, "ptr": 8, "i1": 1}
_RUNTIME_MANGLING = ("msl_rt", "N5metal", "msl_count_access", "msl_body_", "St", "llvm.")


def _type_size(type_: str, structs: dict[str, str]) -> tuple[int, int]:
    """(size, alignment) of an LLVM type under the x86-64 data layout."""
    type_ = type_.strip()
    if type_ in _SCALAR_BYTES:
        return _SCALAR_BYTES[type_], _SCALAR_BYTES[type_]
    if type_.startswith("ptr"):
        return 8, 8
    if re.fullmatch(r"i\d+", type_):
        size = 1 << (max(1, (int(type_[1:]) + 7) // 8) - 1).bit_length()
        return size, min(size, 16)
    if (match := re.fullmatch(r"\[(\d+) x (.*)\]", type_)):
        size, align = _type_size(match.group(2), structs)
        return int(match.group(1)) * size, align
    if (match := re.fullmatch(r"<(\d+) x (.*)>", type_)):
        element, _ = _type_size(match.group(2), structs)
        size = int(match.group(1)) * element
        size = 1 << (size - 1).bit_length()  # vectors round up to a power of two
        return size, size
    if type_.startswith("%"):
        if "msl_rt::" in type_:
            return 0, 1  # the emulator's own (call sites of simd functions)
        if "metal::simdgroup_matrix" in type_:
            # Each lane keeps a replica of the 64 elements; on the GPU it holds two.
            replica = _split_operands(structs[type_].strip("<>{} "))[0]
            size, align = _type_size(replica, structs)
            return size // 32, align
        return _type_size(structs.get(type_, "{}"), structs)
    packed = type_.startswith("<{")
    body = type_.strip("<>{} ")
    offset, alignment = 0, 1
    for member in _split_operands(body) if body else []:
        size, align = _type_size(member, structs)
        align = 1 if packed else align
        offset = (offset + align - 1) // align * align + size
        alignment = max(alignment, align)
    return (offset + alignment - 1) // alignment * alignment, alignment


def thread_array_bytes(ir: str, entry: str) -> int:
    """Bytes of the allocas of the functions reachable from `entry`, the
    emulator's own (runtime and shim) excluded."""
    structs = {m.group(1): m.group(2) for m in _STRUCT_TYPE.finditer(ir)}
    bodies = {m.group(1): m.group(2) for m in _DEFINE.finditer(ir)}
    seen, pending, total = set(), [entry], 0
    while pending:
        name = pending.pop()
        if name in seen or name not in bodies:
            continue
        seen.add(name)
        body = bodies[name]
        if not any(marker in name for marker in _RUNTIME_MANGLING):
            for alloca in _ALLOCA.finditer(body):
                total += _type_size(_split_operands(alloca.group(1))[0], structs)[0]
        pending += _REFERENCE.findall(body)
    return total
