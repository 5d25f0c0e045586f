#!/usr/bin/env bash
# Sets up a fresh machine, idempotently: system packages (compilers, CMake, Catch2), a virtual
# environment .venv with the pinned Python packages, and the compiled extension nf4_ops._C, with its
# CUDA code when nvcc and a CUDA build of torch are present (so CUDA compile errors show without a GPU).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

missing=()
command -v g++ >/dev/null || missing+=(g++)
command -v cmake >/dev/null || missing+=(cmake)
command -v ninja >/dev/null || missing+=(ninja-build)
[ -f /usr/include/catch2/catch.hpp ] || [ -f /usr/include/catch2/catch_test_macros.hpp ] || missing+=(catch2)
if [ ${#missing[@]} -gt 0 ]; then
  echo "== installing system packages: ${missing[*]}"
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo=sudo
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q "${missing[@]}"
fi

if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv"
  "${PYTHON:-python3}" -m venv .venv
fi
echo "== installing Python packages (requirements-dev.txt)"
# torch's CUDA build and its nvidia-* wheels take about 6 GB in .venv, plus their wheels while pip unpacks them;
# a full disk shows only as pip's OSError, so on a failure say how much room there was.
if ! { .venv/bin/python -m pip install -q --upgrade pip && .venv/bin/python -m pip install -q -r requirements-dev.txt; }; then
  echo "== pip install failed; .venv needs about 6 GB (more while pip unpacks). Free space where it writes:" >&2
  df -h .venv "${TMPDIR:-/tmp}" >&2
  exit 1
fi

# setup.py picks CUDA_HOME where it is unset (an nvcc wrapper on PATH included) and says when it builds CPU-only
echo "== building nf4_ops._C (CUDA_HOME=${CUDA_HOME:-unset, setup.py picks it}, archs ${TORCH_CUDA_ARCH_LIST:-default})"
MAX_JOBS="${MAX_JOBS:-$(nproc)}" .venv/bin/python -m pip install -q --no-build-isolation --no-deps -e .
.venv/bin/python -c "import nf4_ops, torch; print('== nf4_ops built; torch', torch.__version__, \
'| CUDA kernels:', torch._C._dispatch_has_kernel_for_dispatch_key('nf4::gemv', 'CUDA'))"
