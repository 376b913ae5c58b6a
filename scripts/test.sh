#!/usr/bin/env bash
# Sets up .venv (with the dev extras) if needed and runs the tests.
#   scripts/test.sh          every tier: tests/unit, tests/integration, tests/e2e (CI's command)
#   scripts/test.sh --quick  the unit and integration tiers (under 3 minutes on 2 cores)
# Any other arguments go to pytest.
# DILOCO_TEST_EXTRAS=dev,hf,lightning,torchtitan adds the torchtitan extra, whose tests skip
# without it (not by default: it adds about 1.4 GB to .venv; docs/torchtitan.md).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh "${DILOCO_TEST_EXTRAS:-dev,hf,lightning}"  # the plug-ins' tests need both trainers
bash scripts/setup_browser.sh || true  # chromium for the status page's browser tests (best effort; they skip without it)
.venv/bin/ruff check diloco tests scripts
.venv/bin/ruff format --check diloco tests scripts
if [ "${1:-}" = "--quick" ]; then
    shift
    exec .venv/bin/python -m pytest -q -p no:cacheprovider tests/unit tests/integration "$@"
fi
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
