#!/usr/bin/env bash
# Runs every test: sets up the machine (scripts/setup_env.sh), then the Catch2 tests of the C++ core
# (CMake + ctest) and the pytest suite (CUDA tests run when a GPU is present, and skip without one), then the CPU
# kernels' tests again with NF4_OPS_AVX512=0: on a CPU with AVX-512 the suite takes the vector path only, and this
# run takes the path of a CPU without it (csrc/cpu_vector.h).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup_env.sh

echo "== C++ core tests (Catch2, ctest)"
cmake -S tests/cpp -B build/cpp -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build/cpp
ctest --test-dir build/cpp --output-on-failure

echo "== Python tests (pytest)"
.venv/bin/python -m pytest tests "$@"

echo "== CPU kernels without AVX-512 (NF4_OPS_AVX512=0: the scalar path)"
NF4_OPS_AVX512=0 .venv/bin/python -m pytest tests -q -k cpu  # the tests with a CPU case (~20 s)
