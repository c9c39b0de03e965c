"""The package's layers: mlx_attn/ is the attention library, mlx_attn/lm/ the
language-model application on top. Every module imports on its own (no import
cycles), the library never imports the application, and within the
application the models never import the loaders.

Inside the library: mlx_attn/core/ (argument checks and the path choice's
vocabulary) is the bottom layer and imports no implementation; the self-check
imports none of the calls it vouches for. The import statements of mlx_attn/,
those inside functions included, form no cycle, and no module imports
another's private (underscore) name."""

import ast
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import mlx_attn

PACKAGE = Path(mlx_attn.__file__).parent  # what is installed, for the import tests
REPOSITORY = Path(__file__).resolve().parent.parent
SOURCE = REPOSITORY / "mlx_attn"  # what is written, for the import-statement checks
MODULES = sorted(
    info.name for info in pkgutil.walk_packages([str(PACKAGE)], prefix="mlx_attn.")
    if not info.name.startswith("mlx_attn._")  # the compiled extension is covered by importing mlx_attn
)


def test_the_package_has_both_layers():
    assert {"mlx_attn.ops", "mlx_attn.attention", "mlx_attn.lm", "mlx_attn.lm.loading", "mlx_attn.lm.cli",
            "mlx_attn.lm.models.llama", "mlx_attn.lm.models.bert"} <= set(MODULES)


@pytest.mark.parametrize("module", ["mlx_attn", *MODULES])
def test_every_module_imports_alone_in_a_fresh_process(module):
    result = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]


def imported_modules(path: Path) -> set[str]:
    """Every module an import statement of the file names (at any depth)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            raise AssertionError(f"{path}: relative import; the layering check reads absolute imports only")
    return names


def test_the_library_never_imports_the_application():
    library = sorted(SOURCE.glob("*.py"))
    assert len(library) >= 8
    for path in library:
        offending = {name for name in imported_modules(path) if name == "mlx_attn.lm" or name.startswith("mlx_attn.lm.")}
        assert not offending, f"{path.name} imports {offending}"
    result = subprocess.run([sys.executable, "-c", "import sys, mlx_attn, mlx_attn.ops, mlx_attn.cache; "
                             "print(sorted(m for m in sys.modules if m.startswith('mlx_attn.lm')))"],
                            capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr


def test_models_never_import_loading_or_the_application_entry_points():
    forbidden = ("mlx_attn.lm.loading", "mlx_attn.lm.model_store", "mlx_attn.lm.generate", "mlx_attn.lm.cli")
    for path in sorted((SOURCE / "lm" / "models").glob("*.py")):
        offending = {name for name in imported_modules(path) if name.startswith(forbidden)}
        assert not offending, f"models/{path.name} imports {offending}"
        # `from mlx_attn.lm import loading` would hide behind the package name
        assert "mlx_attn.lm.loading" not in imported_modules(path)


def test_console_script_points_at_the_application():
    text = (REPOSITORY / "pyproject.toml").read_text()
    assert 'mlx-attn = "mlx_attn.lm.__main__:main"' in text


# -- the import graph, read from the source (function-level imports included) --

EXTENSION = "mlx_attn._ext"  # the compiled extension: a module without a .py file


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SOURCE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


SOURCE_MODULES = {module_name(path): path for path in sorted(SOURCE.rglob("*.py"))}


def is_module(name: str, modules=SOURCE_MODULES) -> bool:
    return name in modules or name == EXTENSION


def imported_package_modules(tree: ast.AST, modules=SOURCE_MODULES) -> set[str]:
    """The package's modules an import statement anywhere in ``tree`` loads:
    ``from pkg import mod`` names ``pkg.mod`` where that is a module, else
    ``pkg`` (a name the package or module defines). A package's
    ``__init__`` that Python runs on the way to a submodule is not counted:
    the package's own lazy exports would make every submodule a cycle."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "a relative import; the graph reads absolute imports only"
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                names.add(submodule if is_module(submodule, modules) else node.module)
    return {name for name in names if name in modules}


def import_graph(modules=SOURCE_MODULES) -> dict[str, set[str]]:
    return {name: imported_package_modules(ast.parse(path.read_text(), str(path)), modules) - {name}
            for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules, the first repeated at the end), or None."""
    finished, path = set(), []

    def visit(name):
        if name in path:
            return path[path.index(name):] + [name]
        if name in finished:
            return None
        path.append(name)
        for target in sorted(graph.get(name, ())):
            cycle = visit(target)
            if cycle:
                return cycle
        path.pop()
        finished.add(name)
        return None

    for name in sorted(graph):
        cycle = visit(name)
        if cycle:
            return cycle
    return None


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for target in graph[todo.pop()] - seen:
            seen.add(target)
            todo.append(target)
    return seen


def test_the_import_graph_reads_function_level_imports():
    graph = import_graph()
    assert {"mlx_attn.core.checks", "mlx_attn.ops", "mlx_attn.lm.loading", "mlx_attn.serve.server"} <= set(graph)
    assert "mlx_attn.self_check" in graph["mlx_attn.ops"]
    assert "mlx_attn.lm.convert" in graph["mlx_attn.lm.cli"]  # imported inside a function


def test_find_cycle_finds_a_cycle_held_by_a_function_level_import(tmp_path):
    (tmp_path / "mlx_attn").mkdir()
    files = {"mlx_attn.a": "import mlx_attn.b\n", "mlx_attn.b": "from mlx_attn import c\n",
             "mlx_attn.c": "def f():\n    from mlx_attn.a import x\n"}
    modules = {}
    for name, text in files.items():
        modules[name] = tmp_path / (name.replace(".", "/") + ".py")
        modules[name].write_text(text)
    graph = import_graph(modules)
    assert graph == {"mlx_attn.a": {"mlx_attn.b"}, "mlx_attn.b": {"mlx_attn.c"}, "mlx_attn.c": {"mlx_attn.a"}}
    assert find_cycle(graph) == ["mlx_attn.a", "mlx_attn.b", "mlx_attn.c", "mlx_attn.a"]
    modules["mlx_attn.c"].write_text("def f():\n    return 1\n")
    assert find_cycle(import_graph(modules)) is None


def test_the_package_imports_form_no_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_validation_layer_imports_no_implementation():
    graph = import_graph()
    core = {name for name in graph if name == "mlx_attn.core" or name.startswith("mlx_attn.core.")}
    assert {"mlx_attn.core.checks", "mlx_attn.core.attention_arguments", "mlx_attn.core.path_choice"} <= core
    for name in sorted(core):
        assert graph[name] <= core, f"{name} imports {graph[name] - core}"
    for implementation in ("mlx_attn.ops", "mlx_attn.paged", "mlx_attn.quantized"):
        assert graph[implementation] & core, f"{implementation} does not use mlx_attn.core"


def test_the_self_check_imports_none_of_the_calls_it_checks():
    below = reachable(import_graph(), "mlx_attn.self_check")
    assert not below & {"mlx_attn.ops", "mlx_attn.paged", "mlx_attn.quantized", "mlx_attn.distributed"}, below


# -- private names stay in their module --

def private_names_taken(tree: ast.AST, modules=SOURCE_MODULES) -> list[str]:
    """``from X import _name`` and ``module._name`` where X / module is one of
    the package's modules and ``_name`` is not a module itself (a private
    module such as ``mlx_attn._native`` is the package's own business)."""
    taken, module_aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in modules:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                if is_module(submodule, modules):
                    module_aliases[alias.asname or alias.name] = submodule
                elif alias.name.startswith("_"):
                    taken.append(f"from {node.module} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name in modules:
                    module_aliases[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in module_aliases
                and node.attr.startswith("_") and not node.attr.startswith("__")
                and not is_module(f"{module_aliases[node.value.id]}.{node.attr}", modules)):
            taken.append(f"{node.value.id}.{node.attr}")
    return taken


def test_private_names_taken_sees_both_forms():
    tree = ast.parse("from mlx_attn.ops import _as_scale, AttentionCall\nfrom mlx_attn import _native, quantized\n"
                     "quantized._check_triple(1)\n_native.ext\nfrom mlx_attn import _ext\n")
    assert private_names_taken(tree) == ["from mlx_attn.ops import _as_scale", "quantized._check_triple"]


def test_no_private_name_is_imported_across_modules():
    offending = {}
    for name, path in SOURCE_MODULES.items():
        taken = private_names_taken(ast.parse(path.read_text(), str(path)))
        if taken:
            offending[name] = taken
    assert not offending, offending


# ------------------------------------------------------------------- csrc/
# The C++ tree in layers, lowest first: an include may only point at its own
# layer or one below. csrc/metal/ holds two: the portable launch plans (below
# the primitives, which ask them for support reasons) and the Mac host (above
# them: the primitives' eval_gpu bodies).
METAL_HOST = ("csrc/metal/attention_metal.", "csrc/metal/eval_gpu.", "csrc/metal/no_metal.",
              "csrc/metal/metal_library.")
CSRC_LAYERS = ["metal/ (kernel sources and their shared headers)", "csrc/core", "csrc/cpu",
               "csrc/metal (plans, sources)", "csrc/ops", "csrc/metal (host)", "csrc/python"]


def csrc_layer(path: str) -> int:
    if path.startswith("metal/"):
        return 0
    if path.startswith(METAL_HOST):
        return 5
    folder = path.split("/")[1]
    return {"core": 1, "cpu": 2, "metal": 3, "ops": 4, "python": 6}[folder]


def csrc_includes() -> dict[str, set[str]]:
    """Each C++ file of csrc/ and metal/ -> the project files it includes."""
    files = [p for folder in ("csrc", "metal") for p in (REPOSITORY / folder).rglob("*")
             if p.suffix in (".h", ".cpp", ".metal")]
    graph = {}
    for path in files:
        name = path.relative_to(REPOSITORY).as_posix()
        graph[name] = set(re.findall(r'^#include "((?:csrc|metal)/[\w/]+\.(?:h|cpp))"', path.read_text(), re.M))
    return graph


def test_csrc_has_the_folders_of_its_layers():
    top = {p.name for p in (REPOSITORY / "csrc").iterdir() if p.is_dir()}
    assert top == {"core", "cpu", "metal", "ops", "python"}
    assert not [p.name for p in (REPOSITORY / "csrc").iterdir() if p.is_file()], "csrc/ keeps its files in its layers"


def test_no_csrc_include_runs_back_up_a_layer():
    graph = csrc_includes()
    assert len(graph) > 60
    upward = [f"{a} ({CSRC_LAYERS[csrc_layer(a)]}) -> {b} ({CSRC_LAYERS[csrc_layer(b)]})"
              for a, targets in graph.items() for b in targets if csrc_layer(b) > csrc_layer(a)]
    assert not upward, "\n".join(upward)


def test_csrc_includes_form_no_circle():
    graph = csrc_includes()
    missing = {b for targets in graph.values() for b in targets} - set(graph)
    assert not missing, f"includes of files that do not exist: {missing}"
    assert find_cycle(graph) is None, f"include circle: {find_cycle(graph)}"


def test_only_the_backend_files_know_whether_metal_is_built():
    mentions = sorted(name for name in csrc_includes()
                      if "MLX_ATTN_METAL" in (REPOSITORY / name).read_text().replace("MLX_ATTN_METAL_", ""))
    assert mentions == [], f"#ifdef MLX_ATTN_METAL outside the backend split: {mentions}"



# --- unit length: a function a reader takes in at once ---

LONGEST_UNIT = 80  # lines, signature to closing line


def long_python_functions(root: Path) -> list[str]:
    """'path:line name (N lines)' for every function of the tree over the bound."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > LONGEST_UNIT:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def _without_comments_and_strings(text: str) -> str:
    """C++ source with comments and string/char literals blanked, line breaks kept."""
    keep_lines = lambda m: "\n" * m.group(0).count("\n")
    text = re.sub(r"/\*.*?\*/", keep_lines, text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    return re.sub(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', '""', text)


def long_cpp_functions(text: str) -> list[tuple[int, int]]:
    """(first line, lines) of every outermost function body over the bound: a
    brace block whose header ends in a parameter list (a lambda inside a
    function counts with its function)."""
    text = _without_comments_and_strings(text)
    open_blocks, found, line = [], [], 1
    control = re.compile(r"\b(if|for|while|switch|catch)\s*\(")
    for at, char in enumerate(text):
        if char == "\n":
            line += 1
        elif char == "{":
            start = max(text.rfind(c, 0, at) for c in ";{}")
            header = text[start + 1:at].strip()
            last = header.splitlines()[-1] if header else ""
            is_function = bool(re.search(r"\)\s*(const|noexcept|override|final|->[^{]*|\s)*$", header)) and (
                not control.search(last) and not last.startswith(("else", "do")))
            open_blocks.append((is_function, line))
        elif char == "}" and open_blocks:
            is_function, first = open_blocks.pop()
            inside_function = any(f for f, _ in open_blocks)
            if is_function and not inside_function and line - first + 1 > LONGEST_UNIT:
                found.append((first, line - first + 1))
    return found


def test_long_cpp_functions_finds_a_long_function_and_not_a_long_namespace():
    def source(body_lines):  # a function of body_lines + 3 lines in a namespace
        body = "\n".join(f"  x += {i};" for i in range(body_lines))
        return f"namespace a {{\nint f(int x) {{\n{body}\n  return x;\n}}\n}}\n"

    assert long_cpp_functions(source(LONGEST_UNIT - 2)) == [(2, LONGEST_UNIT + 1)]
    assert long_cpp_functions(source(LONGEST_UNIT - 3)) == []
    assert long_cpp_functions(source(LONGEST_UNIT - 2).replace("int f(int x) {", "if (x) {")) == []
    assert long_cpp_functions("struct S {\n" + "  int x;\n" * LONGEST_UNIT + "};\n") == []


def test_long_python_functions_finds_one(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "m.py").write_text("def f():\n" + "    x = 1\n" * LONGEST_UNIT)
    assert long_python_functions(package) == [f"pkg/m.py:1 f ({LONGEST_UNIT + 1} lines)"]


def test_no_function_in_the_library_is_over_the_bound():
    assert long_python_functions(SOURCE) == []


def test_no_csrc_function_is_over_the_bound():
    found = [f"{path.relative_to(REPOSITORY)}:{first} ({lines} lines)"
             for path in sorted((REPOSITORY / "csrc").rglob("*")) if path.suffix in (".h", ".cpp")
             for first, lines in long_cpp_functions(path.read_text())]
    assert found == []


# ------------------------------------------------------------------- kernel_lab/
# The kernel tooling (emulator, runners, cost model) is one installed package,
# kernel_lab; tests/ and benchmarks/ import it, never each other's folders,
# and nothing in the tree puts a folder on the import path by hand.
LAB = REPOSITORY / "kernel_lab"
SKIPPED_FOLDERS = {".git", "build", "dist", "__pycache__", ".venv", "venv", ".pytest_cache", ".hypothesis",
                   "node_modules"}
SYS_PATH_EDIT = re.compile(
    r"\bsys\s*\.\s*path\s*(?:\.\s*(?:insert|append|extend|remove|pop|clear)\s*\(|\[[^\]]*\]\s*=(?!=)|\+=|=(?!=))")


def repository_python_files(root: Path = REPOSITORY) -> list[Path]:
    """Every .py file of the checkout (or of a folder of it), outside build
    output, caches, egg-info and virtual environments (a folder holding
    pyvenv.cfg)."""
    found = []

    def walk(folder: Path):
        for entry in sorted(folder.iterdir()):
            if entry.is_dir():
                if (entry.name in SKIPPED_FOLDERS or entry.name.endswith(".egg-info")
                        or (entry / "pyvenv.cfg").exists()):
                    continue
                walk(entry)
            elif entry.suffix == ".py":
                found.append(entry)

    walk(root)
    return found


def test_the_sys_path_pattern_sees_every_edit():
    # Written with {sys} for the module's name, so this file holds no edit
    # the repository-wide check below would find.
    edits = ["{sys}.path.insert(0, here)", "{sys}.path.append(str(ROOT))", "{sys} .path.extend([a])",
             "{sys}.path[:0] = [a]", "{sys}.path = [a] + {sys}.path", "{sys}.path += [a]", "{sys}.path.remove(a)"]
    reads = ["print({sys}.path)", "if {sys}.path == before:", "{sys}.meta_path[:] = finders", "os.{sys}_path = 1"]
    assert all(SYS_PATH_EDIT.search(e.format(sys="sys")) for e in edits)
    assert not any(SYS_PATH_EDIT.search(r.format(sys="sys")) for r in reads)


def test_nothing_in_the_tree_edits_sys_path():
    files = repository_python_files()
    names = {p.relative_to(REPOSITORY).as_posix() for p in files}
    assert {"kernel_lab/metal_runner.py", "tests/conftest.py", "benchmarks/bench_metal.py",
            "mlx_attn/ops.py"} <= names, "the walk missed the checkout's folders"
    edits = [f"{p.relative_to(REPOSITORY)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
             for p in files for text in [p.read_text(errors="replace")] for m in SYS_PATH_EDIT.finditer(text)]
    assert not edits, "import kernel_lab (or a test helper beside the tests) instead:\n" + "\n".join(edits)


def test_benchmarks_import_neither_the_tests_nor_each_other():
    test_modules = {p.stem for p in (REPOSITORY / "tests").glob("*.py")} | {"mac_host"}
    benchmarks = sorted((REPOSITORY / "benchmarks").glob("*.py"))
    scripts = {p.stem for p in benchmarks}
    assert {"bench_metal", "bench_paged"} <= scripts
    reaching = {p.name: sorted({name.split(".")[0] for name in imported_modules(p)} & (test_modules | scripts))
                for p in benchmarks}
    assert not any(reaching.values()), {k: v for k, v in reaching.items() if v}


def test_kernel_lab_is_its_own_package_outside_the_mlx_attn_wheel():
    import tomllib

    project = tomllib.loads((REPOSITORY / "pyproject.toml").read_text())
    assert project["tool"]["scikit-build"]["wheel"]["packages"] == ["mlx_attn"]
    lab = tomllib.loads((REPOSITORY / "kernel_lab" / "pyproject.toml").read_text())
    assert lab["project"]["name"] == "kernel_lab"
    # every package folder is listed, so a regular (not editable) install has them all
    folders = {".".join(("kernel_lab", *p.parent.relative_to(LAB).parts))
               for p in repository_python_files(LAB) if p.name == "__init__.py"}
    assert set(lab["tool"]["setuptools"]["packages"]) == folders
    assert not (PACKAGE / "kernel_lab").exists() and not (PACKAGE / "msl_emulator").exists()


KERNEL_LAB_MODULES = sorted(".".join(("kernel_lab", *p.relative_to(LAB).with_suffix("").parts))
                            for p in repository_python_files(LAB) if p.name != "__init__.py")


@pytest.mark.parametrize("module", ["kernel_lab", *KERNEL_LAB_MODULES])
def test_every_kernel_lab_module_imports_alone_in_a_fresh_process(module):
    # from tests/, as the suite runs: from the checkout's root, `import
    # mlx_attn` would find the unbuilt source tree first
    result = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True,
                            cwd=Path(__file__).parent)
    assert result.returncode == 0, result.stderr[-3000:]
