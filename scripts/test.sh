#!/usr/bin/env bash
# Installs mlx_attn with its test dependencies and runs the whole test suite.
# On Linux it also installs the tools two test groups need (Debian/Ubuntu):
# clang-19 for the MSL emulator (the Metal kernels type-checked and executed
# on the CPU) and for the Mac host check (tests/test_mac_host.py), which also
# needs llvm-19 (llvm-nm-19, llvm-cxxfilt-19) and cmake. Missing tools skip
# those tests, except on CI (CI set), where the Mac host check then fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

if [ "$(uname -s)" = "Linux" ]; then
  missing=()
  for pair in clang-19:clang-19 llvm-nm-19:llvm-19 llvm-cxxfilt-19:llvm-19 cmake:cmake; do
    command -v "${pair%%:*}" >/dev/null 2>&1 || missing+=("${pair#*:}")
  done
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
