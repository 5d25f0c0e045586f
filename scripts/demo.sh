#!/usr/bin/env bash
# Runs the demo: sets up the machine, then examples/demo.py on its embedded default layer.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup_env.sh >&2
.venv/bin/python examples/demo.py "$@"
