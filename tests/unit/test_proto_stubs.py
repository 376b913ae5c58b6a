"""The checked-in gRPC stubs are exactly what scripts/gen_proto.sh makes from proto/."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STUBS = ["diloco/transport/pb/coordinator_pb2.py", "diloco/transport/pb/coordinator_pb2_grpc.py"]


@pytest.mark.timeout(60)
def test_stubs_match_regeneration(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHON=sys.executable)
    subprocess.run(["bash", str(ROOT / "scripts" / "gen_proto.sh"), str(tmp_path)], check=True, env=env, cwd=ROOT)
    for rel in STUBS:
        fresh = (tmp_path / rel).read_text()
        assert fresh == (ROOT / rel).read_text(), f"{rel} is stale: run scripts/gen_proto.sh and commit the result"
