#!/usr/bin/env bash
# Builds and tests this checkout's last commit against another torch (and transformers) release, in a venv and a
# clone of their own under ${COMPAT_DIR:-/tmp/nf4-ops-compat}, leaving .venv alone:
#   bash scripts/compat_check.sh TORCH_VERSION [TRANSFORMERS_VERSION]     e.g.  bash scripts/compat_check.sh 2.15.0 5.24.0
# The other packages are requirements-dev.txt's pins. The CUDA code is compiled where nvcc and torch's CUDA share a
# major version (torch's build refuses another), else the build is CPU-only (NF4_OPS_CPU_ONLY=1) and says so. Then
# pytest and the scalar CPU run, as scripts/test.sh runs them (CUDA tests only where a GPU is present).
# A pip constraint that caps torch (this workplace's /etc/xdg/pip) refuses newer releases: run with
# PIP_CONFIG_FILE=/dev/null there.
set -euo pipefail
torch_version="${1:?usage: compat_check.sh TORCH_VERSION [TRANSFORMERS_VERSION]}"
transformers_version="${2:-}"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
work="${COMPAT_DIR:-/tmp/nf4-ops-compat}/torch-$torch_version${transformers_version:+-transformers-$transformers_version}"
mkdir -p "$work"

pins=("torch==$torch_version")
[ -n "$transformers_version" ] && pins+=("transformers==$transformers_version")
while read -r line; do
  case "$line" in ''|'#'*|torch==*) ;; transformers==*) [ -n "$transformers_version" ] || pins+=("$line") ;; *) pins+=("$line") ;; esac
done < "$repo/requirements-dev.txt"

[ -x "$work/venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$work/venv"
echo "== installing ${pins[*]}"
"$work/venv/bin/python" -m pip install -q --upgrade pip
"$work/venv/bin/python" -m pip install -q "${pins[@]}"

rm -rf "$work/src"
git clone -q "$repo" "$work/src"
cd "$work/src"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
torch_cuda="$("$work/venv/bin/python" -c 'import torch; print(torch.version.cuda or "")')"
nvcc_cuda="$("$CUDA_HOME/bin/nvcc" --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\),.*/\1/p' || true)"
if [ -n "$torch_cuda" ] && [ -n "$nvcc_cuda" ] && [ "${torch_cuda%%.*}" = "${nvcc_cuda%%.*}" ]; then
  cpu_only=0
else
  cpu_only=1
fi
echo "== building $(git rev-parse --short HEAD) (torch's CUDA ${torch_cuda:-none}, nvcc ${nvcc_cuda:-none}; CPU-only: $cpu_only)"
NF4_OPS_CPU_ONLY=$cpu_only MAX_JOBS="${MAX_JOBS:-$(nproc)}" "$work/venv/bin/python" setup.py build_ext --inplace >"$work/build.log" 2>&1 \
  || { tail -n 40 "$work/build.log"; echo "== build failed: $work/build.log"; exit 1; }
"$work/venv/bin/python" -c "import torch, transformers, nf4_ops; print('== torch', torch.__version__, \
'| transformers', transformers.__version__, '| CUDA kernels:', \
torch._C._dispatch_has_kernel_for_dispatch_key('nf4::gemv', 'CUDA'))"

export PYTHONPATH="$work/src"  # the tests' subprocesses (benchmarks, the demo) import the in-place build
echo "== Python tests (pytest)"
"$work/venv/bin/python" -m pytest tests -q -p no:cacheprovider
echo "== CPU kernels without AVX-512 (NF4_OPS_AVX512=0: the scalar path)"
NF4_OPS_AVX512=0 "$work/venv/bin/python" -m pytest tests -q -p no:cacheprovider -k cpu
