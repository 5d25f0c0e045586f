#!/usr/bin/env bash
# Builds and tests this checkout's last commit against another torch (and transformers) release, in a venv and a
# clone of their own under ${COMPAT_DIR:-/tmp/nf4-ops-compat}, leaving .venv alone:
#   bash scripts/compat_check.sh TORCH_VERSION [TRANSFORMERS_VERSION]     e.g.  bash scripts/compat_check.sh 2.15.0 5.24.0
# The other packages are requirements-dev.txt's pins; PYTHON picks the interpreter (each its own venv). setup.py
# decides whether the CUDA code is compiled (an nvcc of torch's major CUDA version); where it is not, the GPU is
# hidden from the tests (CUDA_VISIBLE_DEVICES=""), which would otherwise call kernels the build lacks. Then pytest
# and the scalar CPU run, as scripts/test.sh runs them.
# A pip constraint that caps torch (this workplace's /etc/xdg/pip) refuses newer releases: run with
# PIP_CONFIG_FILE=/dev/null there.
# Each venv takes about 6 GB (torch's CUDA build), so the work folder is removed at the end, pass or fail;
# COMPAT_KEEP=1 keeps it (a rerun then reuses the venv). Left behind, a few of them once filled the disk that CI
# shares with the developer.
set -euo pipefail
torch_version="${1:?usage: compat_check.sh TORCH_VERSION [TRANSFORMERS_VERSION]}"
transformers_version="${2:-}"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
python_version="$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
work="${COMPAT_DIR:-/tmp/nf4-ops-compat}/py$python_version-torch-$torch_version${transformers_version:+-transformers-$transformers_version}"
mkdir -p "$work"
remove_work_folder() {
  if [ "${COMPAT_KEEP:-0}" = 1 ]; then
    echo "== kept $work ($(du -sh "$work" | cut -f1))"
  else
    rm -rf "$work"
    echo "== removed $work (COMPAT_KEEP=1 keeps it)"
  fi
}
trap remove_work_folder EXIT

pins=("torch==$torch_version")
[ -n "$transformers_version" ] && pins+=("transformers==$transformers_version")
while read -r line; do
  case "$line" in torch==*) ;; transformers==*) [ -n "$transformers_version" ] || pins+=("$line") ;; *) pins+=("$line") ;; esac
done < <(grep -v -E '^[[:space:]]*(#|$)' "$repo/requirements-dev.txt")  # grep ends a last line that has no newline

[ -x "$work/venv/bin/python" ] || "$python" -m venv "$work/venv"
echo "== installing ${pins[*]}"
"$work/venv/bin/python" -m pip install -q --upgrade pip
"$work/venv/bin/python" -m pip install -q "${pins[@]}"

rm -rf "$work/src"
git clone -q "$repo" "$work/src"
cd "$work/src"
echo "== building $(git rev-parse --short HEAD) with Python $python_version"
MAX_JOBS="${MAX_JOBS:-$(nproc)}" "$work/venv/bin/python" setup.py build_ext --inplace >"$work/build.log" 2>&1 \
  || { tail -n 40 "$work/build.log"; echo "== build failed (the log's last 40 lines above)"; exit 1; }
grep "^nf4_ops: CPU-only build" "$work/build.log" || true
has_cuda_kernels="$("$work/venv/bin/python" -c "import torch, nf4_ops; \
print(torch._C._dispatch_has_kernel_for_dispatch_key('nf4::gemv', 'CUDA'))")"
"$work/venv/bin/python" -c "import torch, transformers; print('== torch', torch.__version__, \
'| transformers', transformers.__version__, '| CUDA kernels: $has_cuda_kernels')"
[ "$has_cuda_kernels" = True ] || export CUDA_VISIBLE_DEVICES=""

export PYTHONPATH="$work/src"  # the tests' subprocesses (benchmarks, the demo) import the in-place build
echo "== Python tests (pytest)"
"$work/venv/bin/python" -m pytest tests -q -p no:cacheprovider
echo "== CPU kernels without AVX-512 (NF4_OPS_AVX512=0: the scalar path)"
NF4_OPS_AVX512=0 "$work/venv/bin/python" -m pytest tests -q -p no:cacheprovider -k cpu
