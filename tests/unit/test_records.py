"""The run directory's format has one definition (diloco/app/records.py): its documentation
is generated from it, and the package's imports follow the layers (scripts/check_layers.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from diloco.app import records
from diloco.app.records import GlobalRecord, MetricsLine, outputs_markdown

ROOT = Path(__file__).resolve().parents[2]


def test_docs_outputs_md_is_generated_from_the_records() -> None:
    assert (ROOT / "docs" / "outputs.md").read_text() == outputs_markdown(), "stale: run .venv/bin/python scripts/gen_outputs_doc.py"


def test_records_round_trip_and_optional_fields_are_left_out(tmp_path: Path) -> None:
    g = GlobalRecord(params=3, rounds_committed=2, global_sha256="ab", final_eval_loss=None, final_eval_bpb=None, wall_s=1.0, peak_rss_mb=9.0)
    records.write(tmp_path / "global.json", g)
    d = records.to_dict(g)
    assert "port" not in d and "site_reported_sha256" not in d and d["init_from"] is None  # optional: absent; plain: null
    assert records.read(tmp_path / "global.json", GlobalRecord) == g
    line = MetricsLine(
        round=0, participants=["0"], absent=[], evicted=[], late=[], merged=[], rejected=False, guard=None, tokens=1, inner_steps=1, bytes_up=4,
        bytes_down=4, train_loss=1.0, eval_loss=None, eval_bpb=None, eval_by=None, update_norm=0.0, delta_norm=0.0, global_sha256="ab", wall_s=0.1, elapsed_s=0.1,
    )  # fmt: skip
    records.append_metrics(tmp_path / "metrics.jsonl", line)
    assert records.read_metrics(tmp_path / "metrics.jsonl") == [line]
    with pytest.raises(ValueError, match="MetricsLine: unknown field"):
        records.from_dict(MetricsLine, {**records.to_dict(line), "colour": 1})


def test_every_import_points_down_the_layers() -> None:
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_layers.py")], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip().endswith("0 import(s) against the layers"), run.stdout
