#!/usr/bin/env bash
# Runs every test: sets up the machine (scripts/setup_env.sh), then the Catch2 tests of the C++ core
# (CMake + ctest) and the pytest suite (CUDA tests run when a GPU is present, and skip without one).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup_env.sh

echo "== C++ core tests (Catch2, ctest)"
cmake -S tests/cpp -B build/cpp -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build/cpp
ctest --test-dir build/cpp --output-on-failure

echo "== Python tests (pytest)"
.venv/bin/python -m pytest tests "$@"
