"""The Mac build's C++ (the Metal host included) compiles for arm64 macOS 14
against the macOS MLX wheel, and every MLX / metal-cpp symbol it uses is
exported by that wheel's libmlx.dylib: checked here, on Linux, on every run
(tests/mac_host/check_mac_host.py). Seeded faults prove the check has teeth.

On CI (CI set) a missing piece (clang-19, llvm-19, cmake, a wheel PyPI could
not deliver) fails the tests; elsewhere it skips them, saying what is missing."""

import os
import re
import shutil
import subprocess
import sys

import mlx.core as mx
import pytest

from mac_host import check_mac_host as mac_host

REPO = mac_host.REPO


@pytest.fixture(scope="module")
def tools():
    if sys.platform == "darwin":
        pytest.skip("on a Mac, installing the package compiles and links the host code for real")
    try:
        return mac_host.toolchain(REPO)
    except mac_host.SetupError as error:
        if os.environ.get("CI"):
            pytest.fail(f"the Mac host check cannot run on CI: {error}")
        pytest.skip(f"Mac host check not set up here (on CI this fails): {error}")


@pytest.fixture
def repo_copy(tmp_path):
    """What the check reads of a checkout, copied so a test can break it."""
    for folder in ("csrc", "metal"):
        shutil.copytree(REPO / folder, tmp_path / folder)
    for name in ("pyproject.toml", "CMakeLists.txt"):  # CMakeLists.txt: per-unit compile options
        shutil.copy(REPO / name, tmp_path)
    return tmp_path


def test_the_mac_build_compiles_and_resolves_in_libmlx(tools):
    report = mac_host.check(REPO, tools)
    assert report.ok, report.summary()
    for unit in ("csrc/metal/attention_metal.cpp", "csrc/metal/metal_library.cpp",
                 "csrc/metal/metal_library.cpp with MLX_ATTN_PREBUILT_METALLIB",
                 "csrc/python/module.cpp", mac_host.GENERATED_UNIT, "csrc/cpu/kernel_neonfhm.cpp",
                 "csrc/cpu/kernel_neonbf16.cpp", "csrc/cpu/backward_neon.cpp"):
        assert unit in report.units
    # The Metal host's MLX calls were among the symbols resolved.
    resolved = "\n".join(report.checked_symbols)
    for call in ("mlx::core::metal::Device::get_library(", "mlx::core::metal::Device::get_kernel(",
                 "mlx::core::metal::CommandEncoder::dispatch_threadgroups(", "mlx::core::metal::device("):
        assert call in resolved, f"{call} not referenced: the check saw no Metal host code"


def test_a_wrong_mlx_call_fails_the_check(tools, repo_copy):
    unit = "csrc/metal/attention_metal.cpp"
    path = repo_copy / unit
    source = path.read_text()
    # set_bytes(value, index) with its index dropped: wrong arity for MLX's CommandEncoder.
    seeded, count = re.subn(r"\.set_bytes\(([^;()]+), *[^;()]+\);", r".set_bytes(\1);", source, count=1)
    assert count == 1, f"{unit} has no set_bytes(value, index) call to seed a fault into: update this test"
    path.write_text(seeded)
    report = mac_host.check(repo_copy, tools, only=[unit], cache=False)
    assert not report.ok
    assert any(e.startswith(f"[compile] {unit}") and "set_bytes" in e for e in report.errors), report.summary()


def test_a_symbol_libmlx_does_not_export_fails_the_check(tools, repo_copy):
    unit = "csrc/metal/metal_library.cpp"
    path = repo_copy / unit
    path.write_text(path.read_text() + (
        "\nnamespace mlx::core::metal { void not_exported_by_mlx(int); }\n"
        "void seeded_fault_use() { mlx::core::metal::not_exported_by_mlx(1); }\n"))
    report = mac_host.check(repo_copy, tools, only=[unit], cache=False)
    assert report.errors == [
        f"[link] {unit} needs mlx::core::metal::not_exported_by_mlx(int), which libmlx.dylib does not export"
    ]


def test_the_checked_units_are_the_units_cmake_builds_on_a_mac():
    cmake_units = set(re.findall(r"csrc/[\w/]+\.cpp", (REPO / "CMakeLists.txt").read_text()))
    checked = set(mac_host.mac_units(REPO))
    assert mac_host.X86_ONLY_UNITS <= cmake_units and mac_host.NO_METAL_UNITS <= cmake_units
    assert cmake_units - mac_host.X86_ONLY_UNITS - mac_host.NO_METAL_UNITS == checked


def test_one_macos_version_everywhere():
    # The metallib's deployment target, the type-check target and the wheel tag.
    cmake = re.search(r"set\(MLX_ATTN_MACOS_DEPLOYMENT_TARGET ([0-9.]+)\)", (REPO / "CMakeLists.txt").read_text())
    assert cmake, "CMakeLists.txt sets no MLX_ATTN_MACOS_DEPLOYMENT_TARGET"
    major, minor = cmake.group(1).split(".")
    assert mac_host.WHEEL_PLATFORM == f"macosx_{major}_{minor}_arm64"
    assert mac_host.TARGET == f"arm64-apple-macos{major}"


def test_setup_errors_name_the_missing_piece(monkeypatch, tmp_path):
    monkeypatch.setattr(mac_host, "CMAKE", "cmake-that-does-not-exist")
    with pytest.raises(mac_host.SetupError, match="cmake-that-does-not-exist not found"):
        mac_host.toolchain(REPO)
    (tmp_path / "pyproject.toml").write_text("[project]\n")
    with pytest.raises(mac_host.SetupError, match="pins no mlx=="):
        mac_host.pinned_version(tmp_path, "mlx")


@pytest.mark.skipif(mx.metal.is_available(), reason="a Metal device is here: the macOS workflow runs the probe for real")
@pytest.mark.parametrize("require_gpu", [False, True])
def test_the_metal_probe_says_when_the_kernels_did_not_run(tmp_path, require_gpu):
    summary, output = tmp_path / "summary.md", tmp_path / "output.txt"
    env = dict(os.environ, GITHUB_STEP_SUMMARY=str(summary), GITHUB_OUTPUT=str(output))
    done = subprocess.run([sys.executable, str(REPO / "tests/mac_host/metal_probe.py")]
                          + (["--require-gpu"] if require_gpu else []), env=env, capture_output=True, text=True)
    assert done.returncode == (1 if require_gpu else 0), done.stdout + done.stderr
    assert "Metal kernels NOT executed" in done.stdout
    assert f"::{'error' if require_gpu else 'warning'}::Metal kernels NOT executed" in done.stdout
    assert summary.read_text().startswith("## Metal kernels NOT executed")
    assert output.read_text() == "metal_kernels=not-executed\n"
