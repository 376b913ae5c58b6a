#!/usr/bin/env bash
# Regenerates the gRPC stubs in diloco/transport/pb/ from proto/.
# Usage: scripts/gen_proto.sh [OUT_DIR]   (OUT_DIR defaults to the repository root)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-.}"
python="${PYTHON:-python}"
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && python=.venv/bin/python
"$python" -m grpc_tools.protoc -Iproto --python_out="$out" --grpc_python_out="$out" \
    proto/diloco/transport/pb/coordinator.proto
