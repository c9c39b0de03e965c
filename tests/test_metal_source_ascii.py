"""The Metal sources are ASCII: the host hands the embedded text to Metal's
run-time compiler as an ASCII string (MLX's get_library builds an NSString
from it), so a non-ASCII byte (a typographic quote or a µ in a comment) could
break the first fused call on a Mac, which no Linux test would see."""

from pathlib import Path

import pytest

from mlx_attn import _ext

REPO = Path(__file__).resolve().parent.parent
METAL_DIR_FILES = sorted([*(REPO / "metal").glob("*.metal"), *(REPO / "metal").glob("*.h")])


def first_non_ascii(text: str) -> str | None:
    """'line N: ...' of the first non-ASCII character, or None."""
    for number, line in enumerate(text.splitlines(), 1):
        for column, ch in enumerate(line, 1):
            if ord(ch) > 127:
                return f"line {number}, column {column}: {ch!r} in {line.strip()[:80]!r}"
    return None


def test_the_check_finds_a_non_ascii_character():
    assert first_non_ascii("// ok\n// 10 \u00b5s\n") == "line 2, column 7: '\u00b5' in '// 10 \u00b5s'"
    assert first_non_ascii("// plain\n") is None


EMBEDDED = sorted(_ext.metal_source_names()) if _ext is not None else ["(extension not built)"]


@pytest.mark.parametrize("name", EMBEDDED)
def test_embedded_source_is_ascii(name):
    if _ext is None:
        pytest.skip("mlx_attn's extension is not built: no embedded sources to read")
    found = first_non_ascii(_ext.metal_kernel_source(name))
    assert found is None, f"embedded Metal source {name} is not ASCII at {found}"


@pytest.mark.parametrize("path", METAL_DIR_FILES, ids=lambda p: p.name)
def test_metal_directory_is_ascii(path):
    # raw bytes: the check must not depend on a decoder's error handling
    found = first_non_ascii(path.read_bytes().decode("latin-1"))
    assert found is None, f"{path.relative_to(REPO)} is not ASCII at {found}"
