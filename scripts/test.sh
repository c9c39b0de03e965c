#!/usr/bin/env bash
# Installs mlx_attn with its test dependencies and runs the whole test suite.
# On Linux it also installs clang-19 (Debian/Ubuntu), which the MSL emulator
# tests use to type-check and execute the Metal kernels on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

if [ "$(uname -s)" = "Linux" ] && ! command -v clang-19 >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = "0" ]; then
    { apt-get update -qq && apt-get install -y -qq clang-19 >/dev/null; } ||
      echo "note: could not install clang-19; the Metal emulator tests will be skipped" >&2
  else
    echo "note: clang-19 not found; the Metal emulator tests will be skipped" >&2
  fi
fi

"$PYTHON" -m pip install --quiet ".[test]"
# Run from outside the source tree so the installed package is what is tested.
cd tests && exec "$PYTHON" -m pytest -q "$@"
