#!/usr/bin/env bash
# Installs mlx_attn with its test dependencies and runs the whole test suite.
# On Linux it also installs the tools two test groups need (Debian/Ubuntu):
# clang-19 for the MSL emulator (the Metal kernels type-checked and executed
# on the CPU) and for the Mac host check (tests/test_mac_host.py), which also
# needs llvm-19 (llvm-nm-19, llvm-cxxfilt-19) and cmake, and on x86-64
# qemu-user plus an aarch64 C library for the arm64 kernel copy. Missing tools
# skip those tests, except on CI (CI set), where they then fail.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

if [ "$(uname -s)" = "Linux" ]; then
  missing=()
  for pair in clang-19:clang-19 llvm-nm-19:llvm-19 llvm-cxxfilt-19:llvm-19 cmake:cmake; do
    command -v "${pair%%:*}" >/dev/null 2>&1 || missing+=("${pair#*:}")
  done
  # The arm64 NEON kernel copy runs under qemu-aarch64 (tests/test_cpu_kernel_arm64.py),
  # cross-built with clang-19 against an aarch64 C library.
  if [ "$(uname -m)" = "x86_64" ]; then
    command -v qemu-aarch64 >/dev/null 2>&1 || missing+=(qemu-user)
    [ -e /usr/aarch64-linux-gnu/lib/libc.a ] || missing+=(libc6-dev-arm64-cross gcc-aarch64-linux-gnu)
  fi
  # MLX's Linux wheel bundles the reference BLAS; mlx_attn preloads a system
  # OpenBLAS for MLX's float32 matmuls (mlx_attn/_blas.py, tests/test_blas.py).
  [ -e "/usr/lib/$(uname -m)-linux-gnu/libopenblas.so.0" ] || missing+=(libopenblas0-pthread)
  if [ ${#missing[@]} -gt 0 ]; then
    packages=$(printf '%s\n' "${missing[@]}" | sort -u | tr '\n' ' ')
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = "0" ]; then
      # shellcheck disable=SC2086  # one word per package
      { apt-get update -qq && apt-get install -y -qq $packages >/dev/null; } ||
        echo "note: could not install $packages; tests needing them will skip (fail on CI)" >&2
    else
      echo "note: $packages not installed; tests needing them will skip (fail on CI)" >&2
    fi
  fi
fi

"$PYTHON" -m pip install --quiet ".[test]"
# Run from outside the source tree so the installed package is what is tested.
cd tests && exec "$PYTHON" -m pytest -q "$@"
