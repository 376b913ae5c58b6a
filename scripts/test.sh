#!/usr/bin/env bash
# Sets up .venv (with the dev extras) if needed and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh dev,hf,lightning  # the plug-ins' tests need both trainers
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
