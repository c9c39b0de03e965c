"""The Metal source text the extension embeds (what a Mac compiles at run time
through MLX's get_library) is the repository's .metal text with the project
headers inlined, byte for byte, and that very text compiles and runs in the
MSL emulator against the reference path.

The inlining rule is written here a second time, independently of
csrc/metal/embed_metal_sources.cmake, so the two must agree."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from kernel_lab import msl_emulator
from kernel_lab.metal_runner import EmulatedMetal
from mlx_attn import _ext
from mlx_attn.reference import reference_attention
from test_metal_kernels import TOLERANCE

REPO = Path(__file__).resolve().parent.parent
METAL_FILES = sorted((REPO / "metal").glob("*.metal"))
QUOTED_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"[^\n]*\n?', re.MULTILINE)
PRAGMA_ONCE = re.compile(r"^[ \t]*#[ \t]*pragma[ \t]+once[^\n]*\n?", re.MULTILINE)


def inline_project_includes(text: str, root: Path, inlined: set[str]) -> str:
    """`#include "p"` lines become root/p (recursively, `#pragma once` lines
    dropped, each file once); `#include <...>` stays."""

    def replace(match: re.Match) -> str:
        path = match.group(1)
        if path in inlined:
            return ""
        inlined.add(path)
        header = PRAGMA_ONCE.sub("", (root / path).read_bytes().decode())
        return inline_project_includes(header, root, inlined)

    return QUOTED_INCLUDE.sub(replace, text)


def jit_text_from_repository(metal_file: Path) -> str:
    return inline_project_includes(metal_file.read_bytes().decode(), REPO, set())


def test_every_metal_file_is_embedded():
    assert METAL_FILES, "no metal/*.metal in the repository"
    assert sorted(_ext.metal_source_names()) == [f.stem for f in METAL_FILES]


@pytest.mark.parametrize("metal_file", METAL_FILES, ids=lambda f: f.name)
def test_embedded_text_is_the_repository_text_with_headers_inlined(metal_file):
    embedded = _ext.metal_kernel_source(metal_file.stem)
    assert embedded.encode() == jit_text_from_repository(metal_file).encode()
    # Self-contained: a run-time compile has no include path into the project.
    assert not QUOTED_INCLUDE.search(embedded)
    assert "struct AttentionParams" in embedded


def test_inlining_rule_inlines_nested_headers_once(tmp_path):
    # The rule itself (this file's copy), on a nested include and a repeat.
    (tmp_path / "a.h").write_text('#pragma once\n#include "b.h"\nint a;\n')
    (tmp_path / "b.h").write_text("#pragma once\nint b;\n")
    text = '#include <metal_stdlib>\n#include "a.h"\n#include "b.h"\nkernel;\n'
    assert inline_project_includes(text, tmp_path, set()) == "#include <metal_stdlib>\nint b;\nint a;\nkernel;\n"


def run_embed_script(root: Path, sources: list[Path], output: Path) -> subprocess.CompletedProcess:
    cmake = shutil.which("cmake")
    if cmake is None:
        if os.environ.get("CI"):
            pytest.fail("cmake not on PATH on CI (scripts/test.sh installs it)")
        pytest.skip("cmake not on PATH (scripts/test.sh installs it; the build itself brings its own)")
    return subprocess.run(
        [cmake, f"-DSOURCE_ROOT={root}", f"-DSOURCES={';'.join(map(str, sources))}", f"-DOUTPUT={output}",
         "-P", str(REPO / "csrc/metal/embed_metal_sources.cmake")], capture_output=True, text=True)


def embedded_bytes(generated_cpp: str) -> dict[str, bytes]:
    arrays = re.findall(r"const unsigned char (\w+)_bytes\[\] = \{([^}]*)\}", generated_cpp)
    return {name: bytes(int(b, 16) for b in re.findall(r"0x([0-9a-f]{2})", body)) for name, body in arrays}


def test_the_build_script_applies_the_same_rule_to_edge_cases(tmp_path):
    # Nested and repeated includes, indented directives, non-ASCII text, CMake
    # list and regex characters, a file without a final newline.
    (tmp_path / "inc").mkdir()
    (tmp_path / "inc/a.h").write_text('#pragma once\n  #  include "inc/b.h"  // nested\nint a; // µ [x];\n')
    (tmp_path / "inc/b.h").write_text("#pragma once\nint b = 1; /* ${NOT_CMAKE} \\1 */")
    kernel = tmp_path / "k.metal"
    kernel.write_text('#include <metal_stdlib>\n#include "inc/a.h"\n#include "inc/b.h"\nkernel void f(); // "#include"\n')
    output = tmp_path / "out.cpp"
    done = run_embed_script(tmp_path, [kernel], output)
    assert done.returncode == 0, done.stderr
    want = inline_project_includes(kernel.read_text(), tmp_path, set()).encode()
    assert b"int b = 1;" in want and want.count(b"int b") == 1 and b"pragma once" not in want
    assert embedded_bytes(output.read_text()) == {"k": want}


def test_the_build_script_names_a_missing_include(tmp_path):
    kernel = tmp_path / "k.metal"
    kernel.write_text('#include "metal/not_there.h"\n')
    done = run_embed_script(tmp_path, [kernel], tmp_path / "out.cpp")
    assert done.returncode != 0
    assert '#include "metal/not_there.h" not found' in done.stderr


def test_unknown_kernel_name_is_a_value_error():
    with pytest.raises(ValueError, match="attention_nothing_float32_d64"):
        _ext.metal_kernel_source("attention_nothing_float32_d64")
    with pytest.raises(ValueError, match="no Metal source"):
        _ext.metal_kernel_source("")


@pytest.mark.skipif(not msl_emulator.clang_available(), reason="needs clang-19 for the MSL emulator")
class TestEmbeddedTextRunsInTheEmulator:
    @pytest.fixture(scope="class")
    def jit_files(self, tmp_path_factory) -> dict[str, Path]:
        """The embedded strings written to files (the emulator compiles files)."""
        folder = tmp_path_factory.mktemp("jit_sources")
        files = {}
        for name in _ext.metal_source_names():
            files[name] = folder / f"{name}.metal"
            files[name].write_bytes(_ext.metal_kernel_source(name).encode())
        return files

    @pytest.fixture(scope="class")
    def emulated(self, jit_files):
        return EmulatedMetal(fast_math=False, sources=list(jit_files.values()))

    def test_every_kernel_maps_to_the_source_that_defines_it(self, jit_files):
        for name, path in jit_files.items():
            # No include dirs: the text must stand alone, as in a run-time compile.
            kernels = msl_emulator.compile_library([path], include_dirs=[]).kernel_names
            assert kernels, f"{name} defines no kernel"
            for kernel in kernels:
                assert _ext.metal_kernel_source(kernel).encode() == path.read_bytes(), kernel

    @pytest.mark.parametrize(
        "shape, dtype, mask, family",
        [((1, 2, 1, 33, 50, 64), mx.float32, "causal", "attention_prefill"),
         ((1, 4, 2, 1, 70, 64), mx.float16, None, "attention_decode")],
        ids=["prefill", "decode"],
    )
    def test_against_the_reference(self, emulated, shape, dtype, mask, family):
        b, hq, hkv, tq, tkv, d = shape
        rng = np.random.default_rng(0)
        q, k, v = (
            mx.array(rng.standard_normal(s).astype(np.float32)).astype(dtype)
            for s in ((b, hq, tq, d), (b, hkv, tkv, d), (b, hkv, tkv, d))
        )
        got = np.array(emulated(q, k, v, scale=d**-0.5, mask=mask).astype(mx.float32))
        want = np.array(reference_attention(q, k, v, scale=d**-0.5, mask=mask).astype(mx.float32))
        assert np.isfinite(got).all()
        assert np.abs(got - want).max() <= TOLERANCE[dtype]
        # The plan's kernels come from the family this case is meant to test.
        for dispatch in emulated.last_plan.dispatches:
            assert _ext.metal_kernel_source(dispatch.kernel) == _ext.metal_kernel_source(family)
