#!/usr/bin/env bash
# Creates .venv if it is missing and installs the project into it (editable).
# Usage: scripts/setup_venv.sh [EXTRAS]   e.g. scripts/setup_venv.sh dev
# torch is pinned here (a CPU build that pip finds locally); the package itself asks for a range.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
py=.venv/bin/python
stamp=".venv/.diloco-installed${extras:+-$extras}"
# setup.py compiles the int8 codec's C loops (optional: without a compiler the torch path runs).
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ setup.py -nt "$stamp" ] || [ diloco/codec/_int8_native.c -nt "$stamp" ]; then
    # torch first, pinned: the package asks for a range, which alone would take a CUDA build.
    "$py" -m pip install --quiet "torch==2.13.0"
    "$py" -m pip install --quiet -e ".${extras:+[$extras]}"
    touch "$stamp"
fi
