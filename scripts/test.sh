#!/usr/bin/env bash
# Installs mlx_attn with its test dependencies and runs the whole test suite.
#
# On Linux (Debian/Ubuntu) some test groups need system tools. Before
# installing anything this script prints each missing package and why; it
# installs them only when it runs as root with apt-get, with
# --no-install-recommends, and registers nothing system-wide: qemu-user comes
# without qemu-user-binfmt (the arm64 test calls qemu-aarch64 explicitly).
# Missing tools skip those tests, except on CI (CI set), where they then fail.
# MLX_ATTN_NO_APT=1: never install system packages (only say what is missing).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

if [ "$(uname -s)" = "Linux" ]; then
  packages=()
  reasons=()
  need() {  # need PACKAGE REASON: when the check before it failed
    packages+=("$1")
    reasons+=("  $1: $2")
  }
  command -v clang-19 >/dev/null 2>&1 ||
    need clang-19 "compiles the Metal kernels as C++ for the MSL emulator (kernel_lab/msl_emulator) and the Mac host check"
  { command -v llvm-nm-19 >/dev/null 2>&1 && command -v llvm-cxxfilt-19 >/dev/null 2>&1; } ||
    need llvm-19 "llvm-nm-19 and llvm-cxxfilt-19 read the Mac host check's object files (tests/test_mac_host.py)"
  command -v cmake >/dev/null 2>&1 || need cmake "builds the Mac host check (tests/test_mac_host.py)"
  command -v chromium >/dev/null 2>&1 ||
    need chromium "the headless browser the serving chat page is tested in (tests/test_serve_server.py)"
  command -v chromedriver >/dev/null 2>&1 ||
    need chromium-driver "drives that browser (selenium, tests/test_serve_server.py)"
  if [ "$(uname -m)" = "x86_64" ]; then
    # The arm64 NEON kernel copies are cross-built with clang-19 and run
    # under qemu-aarch64 (tests/test_cpu_kernel_arm64.py).
    command -v qemu-aarch64 >/dev/null 2>&1 ||
      need qemu-user "runs the arm64 kernel copies (called as qemu-aarch64; no binfmt registration)"
    if [ ! -e /usr/aarch64-linux-gnu/lib/libc.a ]; then
      need libc6-dev-arm64-cross "the aarch64 C library the arm64 test harness links statically"
      need gcc-aarch64-linux-gnu "the aarch64 libgcc and start files for that static link"
    fi
  fi
  # MLX's Linux wheel bundles the reference BLAS; mlx_attn.use_system_blas()
  # (the mlx-attn command, the examples) binds a system OpenBLAS instead
  # (mlx_attn/_blas.py, tests/test_blas.py).
  [ -e "/usr/lib/$(uname -m)-linux-gnu/libopenblas.so.0" ] ||
    need libopenblas0-pthread "the system OpenBLAS that mlx_attn.use_system_blas() binds (tests/test_blas.py)"
  if [ ${#packages[@]} -gt 0 ]; then
    echo "scripts/test.sh: test groups need these Debian/Ubuntu packages:" >&2
    printf '%s\n' "${reasons[@]}" >&2
    if [ "${MLX_ATTN_NO_APT:-0}" != "1" ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = "0" ]; then
      echo "scripts/test.sh: installing them: apt-get install --no-install-recommends ${packages[*]}" >&2
      { apt-get update -qq &&
        apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null; } ||
        echo "note: could not install them; the tests needing them will skip (fail on CI)" >&2
    else
      echo "note: not installing them (not root with apt-get, or MLX_ATTN_NO_APT=1); the tests needing them" \
           "will skip (fail on CI)" >&2
    fi
  fi
fi

echo "scripts/test.sh: pip install .[test,serve,mlx-lm] (mlx_attn, its test dependencies and the serve and" \
     "mlx-lm extras, pyproject.toml)" >&2
"$PYTHON" -m pip install --quiet ".[test,serve,mlx-lm]"
# kernel_lab/ (the MSL emulator, Metal runners and cost model the tests and
# benchmarks import; never in the mlx_attn wheel), editable so it runs this
# checkout's metal/ sources. It has no dependencies; where the installed
# setuptools can build a wheel by itself (setuptools >= 70.1, or the wheel
# package), without build isolation, so no index is needed.
isolation=""
if "$PYTHON" -c "import setuptools.command.bdist_wheel" >/dev/null 2>&1 ||
   "$PYTHON" -c "import setuptools, wheel" >/dev/null 2>&1; then
  isolation=--no-build-isolation
fi
echo "scripts/test.sh: pip install -e ./kernel_lab" >&2
"$PYTHON" -m pip install --quiet --no-deps $isolation -e ./kernel_lab
# Run from outside the source tree so the installed package is what is tested.
# pytest-xdist runs one worker per core (MLX_ATTN_TEST_WORKERS overrides;
# 0 runs in this process), a test file per worker at a time, so each Metal
# emulator library is compiled once; --durations names the slowest tests.
cd tests && exec "$PYTHON" -m pytest -q -n "${MLX_ATTN_TEST_WORKERS:-auto}" --dist loadfile --durations=25 "$@"
