"""The package's layers: mlx_attn/ is the attention library, mlx_attn/lm/ the
language-model application on top. Every module imports on its own (no import
cycles), the library never imports the application, and within the
application the models never import the loaders."""

import ast
import pkgutil
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
