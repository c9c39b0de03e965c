"""Preprocessed Metal Shading Language -> C++ for the emulator's shim.

The shim (include/metal_shim.h) makes most of MSL valid clang C++ as it is;
this module does the few rewrites that a header cannot:

* explicit instantiations with a host name,
  ``template [[host_name("n")]] [[kernel]] decltype(f<T, D>) f<T, D>;`` (or the
  full-signature form ``... [[kernel]] void f<T, D>(params...);``), become
  plain explicit instantiations plus a launcher registered as ``n``;
  non-template ``[[kernel]]`` functions get a launcher under their own name;
* statement-level ``threadgroup T name[N];`` (and scalar) declarations become
  references to storage shared by the threadgroup;
* vector constructors ``float4(a, b, c, d)`` become ``msl_make<float4>(...)``;
* half literals ``1.5h`` become ``half(1.5)``;
* array parameters in an address space, ``constant int s[3]``, become the
  pointers they decay to (clang rejects the qualified array parameter);
* member functions qualified with the address space of ``this``
  (``T f() const threadgroup {...}``, which C++ lacks): the ``thread``
  overload stays, unqualified; the other overloads are dropped, since the
  emulator's objects all live in one address space;
* function constants, ``constant T name [[function_constant(n)]];``, become
  run-time values (``msl_rt::FunctionConstant<T>``) set by each dispatch, and
  a parameter attributed ``[[buffer(n), function_constant(name)]]`` is bound
  only when that constant is true (Metal compiles one pipeline per set of
  values; the emulator compiles once and reads them when the kernel runs).

Kernel parameters are bound by their attributes (``[[buffer(n)]]``,
``[[threadgroup(n)]]``, the builtins); their C++ types are never parsed here:
the launcher deduces them from the instantiated function.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .errors import MetalCompileError

# Builtin attributes -> parameter kind (msl_rt::ParamKind in msl_launch.h).
BUFFER, THREADGROUP_MEMORY = 0, 12
BUILTIN_KINDS = {
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
    "thread_execution_width": 10,  # the older name of threads_per_simdgroup
    "simdgroups_per_threadgroup": 11,
}

VECTOR_ELEMENTS = "float|half|bfloat|int|uint|short|ushort|char|uchar|long|ulong|bool"


NO_CONDITION = -1  # a parameter bound whatever the function constants say


@dataclass
class Kernel:
    host_name: str
    function: str            # the C++ function (template-id for templates)
    # (kind, index, id of the function constant that must be true for the
    # parameter to exist, or NO_CONDITION)
    params: list[tuple[int, int, int]] = field(default_factory=list)


@dataclass
class Translation:
    cpp: str
    kernels: list[Kernel]
    function_constants: dict[str, int] = field(default_factory=dict)  # name -> id


class _Locator:
    """Maps offsets in preprocessed text back to the original file:line."""

    _MARKER = re.compile(r'^#\s*(?:line\s+)?(\d+)\s+"([^"]*)"', re.M)

    def __init__(self, text: str):
        self.text = text
        self.markers = [(m.end(), int(m.group(1)), m.group(2)) for m in self._MARKER.finditer(text)]

    def __call__(self, offset: int) -> str:
        line, file, start = 1, "<source>", 0
        for end, marker_line, marker_file in self.markers:
            if end > offset:
                break
            line, file, start = marker_line, marker_file, end + 1  # the marked line starts after the marker's newline
        return f"{file}:{line + self.text.count(chr(10), start, offset)}"


def _matching(text: str, open_index: int, opening: str, closing: str) -> int:
    """Index of the bracket closing the one at `open_index`."""
    depth = 0
    for i in range(open_index, len(text)):
        if text[i] == opening:
            depth += 1
        elif text[i] == closing:
            depth -= 1
            if depth == 0:
                return i
    raise MetalCompileError(f"unbalanced {opening}{closing} in: {text[open_index:open_index + 80]!r}")


def _split_top_level(text: str) -> list[str]:
    """Split a parameter list at commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "(<[{":
            depth += 1
        elif ch in ")>]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if text[start:].strip():
        parts.append(text[start:])
    return parts


_INTEGER_EXPRESSION = re.compile(r"^[\d\s+\-*/()]+$")


def _attribute_index(argument: str, where: str) -> int:
    argument = re.sub(r"(\d+)[uUlL]+\b", r"\1", argument.strip())
    if not _INTEGER_EXPRESSION.match(argument):
        raise MetalCompileError(f"{where}: the emulator needs a constant index, got {argument!r}")
    return int(eval(argument.replace("/", "//"), {"__builtins__": {}}))  # digits and + - * / ( ) only


_ATTRIBUTE_LIST = re.compile(r"\[\[(.*?)\]\]", re.S)
_ATTRIBUTE = re.compile(r"^\s*(\w+)\s*(?:\((.*)\))?\s*$", re.S)


def _parameter_specs(params: str, kernel: str, where: str, constants: dict[str, int]) -> list[tuple[int, int, int]]:
    specs = []
    for param in _split_top_level(params):
        if param.strip() in ("", "void"):
            continue
        listed = _ATTRIBUTE_LIST.search(param)
        if not listed:
            raise MetalCompileError(f"{where}: kernel {kernel}: parameter {param.strip()!r} has no [[...]] attribute")
        binding, condition = None, NO_CONDITION
        for attribute in _split_top_level(listed.group(1)):
            match = _ATTRIBUTE.match(attribute)
            if not match:
                raise MetalCompileError(f"{where}: kernel {kernel}: cannot read attribute [[{attribute.strip()}]]")
            name, argument = match.group(1), match.group(2)
            if name == "function_constant":
                if argument.strip() not in constants:
                    raise MetalCompileError(f"{where}: kernel {kernel}: [[function_constant({argument.strip()})]] "
                                            "names no declared function constant")
                condition = constants[argument.strip()]
            elif name == "buffer":
                binding = (BUFFER, _attribute_index(argument, where))
            elif name == "threadgroup":
                binding = (THREADGROUP_MEMORY, _attribute_index(argument, where))
            elif name in BUILTIN_KINDS:
                binding = (BUILTIN_KINDS[name], 0)
            else:
                raise MetalCompileError(f"{where}: kernel {kernel}: attribute [[{name}]] is not supported by the emulator")
        if binding is None:
            raise MetalCompileError(f"{where}: kernel {kernel}: parameter {param.strip()!r} has no binding attribute")
        specs.append((*binding, condition))
    return specs


_FUNCTION_CONSTANT = re.compile(
    r"\bconstant\s+(?P<type>[\w:]+)\s+(?P<name>\w+)\s*\[\[\s*function_constant\s*\((?P<id>[^()]*)\)\s*\]\]\s*;"
)


def _function_constants(text: str, locate) -> tuple[str, dict[str, int]]:
    """Replace function constant declarations by run-time values."""
    constants: dict[str, int] = {}

    def declare(match: re.Match) -> str:
        name, type_ = match.group("name"), match.group("type")
        where = locate(match.start())
        if name in constants:
            raise MetalCompileError(f"{where}: function constant {name} declared twice")
        constants[name] = _attribute_index(match.group("id"), where)
        newlines = "\n" * match.group(0).count("\n")  # keep later lines where they were
        return f'static msl_rt::FunctionConstant<{type_}> {name}{{{constants[name]}, "{name}"}};{newlines}'

    return _FUNCTION_CONSTANT.sub(declare, text), constants


_KERNEL_ATTRIBUTE = r"(?:\[\[\s*kernel\b[^\]]*\]\]|\bkernel\b)"
_KERNEL_DEFINITION = re.compile(_KERNEL_ATTRIBUTE + r"((?:\s*\[\[[^\]]*\]\])*)\s*void\s+(\w+)\s*\(")
_INSTANTIATION = re.compile(
    r"\btemplate\s*\[\[\s*host_name\s*\(\s*((?:\"(?:[^\"\\]|\\.)*\"\s*)+)\)\s*\]\]\s*"
    + r"(?:" + _KERNEL_ATTRIBUTE + r"\s*)?([^;]+);"
)
_THREADGROUP_DECLARATION = re.compile(
    r"(?P<indent>(?:^|[{;])[ \t]*)threadgroup\s+(?P<align>alignas\s*\([^)]*\)\s+)?(?P<type>[\w:]+(?:\s*<[^;{}()]*?>)?)"
    r"\s+(?P<name>\w+)(?P<dims>(?:\s*\[[^\]]+\])*)\s*;",
    re.M,
)
_VECTOR_CONSTRUCTOR = re.compile(rf"(?<![\w.:>])((?:{VECTOR_ELEMENTS})[234])\s*\(")
_HALF_LITERAL = re.compile(r"(?<![\w.])((?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?)[hH]\b")
_STRING_OR_CHAR = re.compile(r'"(?:[^"\\\n]|\\.)*"|\'(?:[^\'\\\n]|\\.)*\'')


def _instantiated_function(declaration: str, host: str) -> str:
    """`decltype(f<T>) f<T>` or `void f<T>(params...)` -> `f<T>`."""
    declaration = declaration.strip()
    if declaration.startswith("decltype"):
        open_paren = declaration.index("(")
        close = _matching(declaration, open_paren, "(", ")")
        return declaration[close + 1:].strip()
    match = re.match(r"void\s+(\w+)\s*<", declaration)
    if match:
        close = _matching(declaration, match.end() - 1, "<", ">")
        return re.sub(r"\s+", " ", declaration[match.start(1):close + 1])
    raise MetalCompileError(f"cannot read the instantiation of {host!r}: {declaration[:120]}")


_QUALIFIED_MEMBER = re.compile(
    r"\)(\s*(?:const\s+)?)(thread|threadgroup|device|constant)\s*(?=[:{;])"
)
_ACCESS_LABEL = re.compile(r"^\s*(?:public|private|protected)\s*:")


def _declaration_start(text: str, index: int) -> int:
    """Start of the member declaration that contains `index`."""
    depth = 0
    for i in range(index, -1, -1):
        ch = text[i]
        if ch == ")":
            depth += 1
        elif ch == "(":
            depth -= 1
        elif depth == 0 and ch in ";{}":
            start = i + 1
            label = _ACCESS_LABEL.match(text, start)
            return label.end() if label else start
    return 0


def _declaration_end(text: str, index: int) -> int:
    """End (exclusive) of the declaration whose qualifier ends at `index`."""
    depth = 0
    for i in range(index, len(text)):
        ch = text[i]
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif depth == 0 and ch == ";":
            return i + 1
        elif depth == 0 and ch == "{":
            return _matching(text, i, "{", "}") + 1
    return len(text)


def _address_space_members(text: str) -> str:
    pieces, last = [], 0
    for match in _QUALIFIED_MEMBER.finditer(text):
        if match.start() < last:
            continue  # inside a declaration already dropped
        if match.group(2) == "thread":
            pieces += [text[last:match.start()], ")", match.group(1)]
            last = match.end()
        else:
            start = _declaration_start(text, match.start())
            if start < last:
                continue
            end = _declaration_end(text, match.end())
            pieces += [text[last:start], "\n" * text.count("\n", start, end)]  # keep line numbers
            last = end
    return "".join(pieces) + text[last:]


_ARRAY_PARAMETER = re.compile(
    r"\b(constant|device|threadgroup)\s+((?:const\s+)?[\w:]+)\s+(\w+)\s*\[[^\]]*\]\s*(?=[,)])"
)


def translate(text: str) -> Translation:
    """Translate one preprocessed `.metal` translation unit."""
    text = _address_space_members(text)
    text = _ARRAY_PARAMETER.sub(r"\1 \2* \3", text)
    text, constants = _function_constants(text, _Locator(text))
    locate = _Locator(text)

    # 1. Kernel definitions: remember their parameter bindings, drop [[kernel]].
    definitions: dict[str, list[tuple[int, int, int]]] = {}
    templates: set[str] = set()  # template kernels: launchers only for their instantiations
    for match in _KERNEL_DEFINITION.finditer(text):
        name = match.group(2)
        open_paren = match.end() - 1
        close = _matching(text, open_paren, "(", ")")
        if not re.match(r"\s*[{]", text[close + 1:]):
            continue  # a declaration, or an instantiation in the full-signature form
        definitions[name] = _parameter_specs(text[open_paren + 1:close], name, locate(match.start()), constants)
        if re.search(r">\s*$", text[:match.start()]):
            templates.add(name)  # `template <...> [[kernel]] void name(`

    # 2. Instantiations with host names.
    instantiations: list[tuple[str, str]] = []

    def instantiate(match: re.Match) -> str:
        host = "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', match.group(1)))
        function = _instantiated_function(match.group(2), host)
        instantiations.append((host, function))
        return f"template decltype({function}) {function};"

    text = _INSTANTIATION.sub(instantiate, text)
    text = _KERNEL_DEFINITION.sub(lambda m: f"void {m.group(2)}(", text)
    # `threadgroup` is a macro (an address space) in the shim: keep it out of attributes.
    text = re.sub(r"\[\[\s*threadgroup\s*\(", "[[msl_threadgroup_argument(", text)

    # 3. Statement-level threadgroup declarations -> shared storage.
    counter = iter(range(1, 1 << 30))
    located = _Locator(text)

    def shared(match: re.Match) -> str:
        type_, name = match.group("type"), match.group("name")
        dims = re.sub(r"\s+", "", match.group("dims") or "")
        label = f"{name} ({located(match.start('name'))})".replace("\\", "\\\\").replace('"', '\\"')
        alloc = f'msl_rt::threadgroup_alloc({next(counter)}, sizeof({type_}{dims}), alignof({type_}), "{label}")'
        if dims:
            declaration = f"threadgroup {type_} (&{name}){dims} = *(threadgroup {type_} (*){dims}){alloc};"
        else:
            declaration = f"threadgroup {type_}& {name} = *(threadgroup {type_}*){alloc};"
        return match.group("indent") + declaration

    text = _THREADGROUP_DECLARATION.sub(shared, text)

    # 4. Vector constructors and half literals (outside string literals).
    def rewrite_code(code: str) -> str:
        code = _VECTOR_CONSTRUCTOR.sub(lambda m: f"msl_make<{m.group(1)}>(", code)
        return _HALF_LITERAL.sub(lambda m: f"half({m.group(1)})", code)

    pieces, last = [], 0
    for literal in _STRING_OR_CHAR.finditer(text):
        pieces += [rewrite_code(text[last:literal.start()]), literal.group(0)]
        last = literal.end()
    text = "".join(pieces) + rewrite_code(text[last:])

    # 5. Launchers.
    kernels: list[Kernel] = []
    templated = set()
    for host, function in instantiations:
        base = function.split("<")[0].strip()
        if base not in definitions:
            raise MetalCompileError(f"{host!r} instantiates {base}, which is not a [[kernel]] function")
        templated.add(base)
        kernels.append(Kernel(host, function, definitions[base]))
    for name, params in definitions.items():
        if name not in templated and name not in templates:
            kernels.append(Kernel(name, name, params))
    hosts = [k.host_name for k in kernels]
    duplicates = sorted({h for h in hosts if hosts.count(h) > 1})
    if duplicates:
        raise MetalCompileError(f"kernel host names defined twice: {duplicates}")

    generated = ['\n# 1 "<msl_emulator launchers>"']
    for i, kernel in enumerate(kernels):
        specs = ", ".join(f"{{{kind}, {index}, {condition}}}" for kind, index, condition in kernel.params)
        specs = specs or f"{{0, -1, {NO_CONDITION}}}"
        generated.append(
            f"static const msl_rt::Param msl_params_{i}[] = {{{specs}}};\n"
            f"static_assert(msl_rt::arity(&{kernel.function}) == {len(kernel.params)}, "
            f"\"{kernel.host_name}: every kernel parameter needs an attribute\");\n"
            f"static void msl_body_{i}() {{ msl_rt::invoke(&{kernel.function}, msl_params_{i}); }}\n"
            f"static int msl_describe_{i}(msl_rt::ParamInfo* out, int capacity) {{\n"
            f"  return msl_rt::describe(&{kernel.function}, msl_params_{i}, out, capacity);\n}}"
        )
    table = ",\n".join(f'  {{"{k.host_name}", msl_body_{i}, msl_describe_{i}}}' for i, k in enumerate(kernels))
    generated.append(f"static const msl_rt::Entry msl_entries[] = {{\n{table or '  {nullptr, nullptr, nullptr}'}\n}};")
    generated.append(f"MSL_EMULATOR_EXPORTS({len(kernels)})\n")
    return Translation(text + "\n".join(generated), kernels, constants)
