#!/usr/bin/env bash
# Sets up .venv if needed and runs the default local simulation: a coordinator and 4 sites
# as separate processes on 127.0.0.1, model=tiny, H=50, 10 rounds, on the shipped corpus.
# Extra arguments are hydra overrides, e.g. scripts/demo.sh sites=2 rounds=5
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
run_dir="runs/demo_$(date +%Y%m%d_%H%M%S)"
.venv/bin/diloco-sim hydra.run.dir="$run_dir" "$@"
echo "run directory: $run_dir (summary.json, metrics.jsonl, plots/, logs/)"
