"""One RunDir owns every path of a run directory: no other module of the package spells a
run-directory name, and every entry RunDir makes is one docs/outputs.md lists."""

from __future__ import annotations

import re
from pathlib import Path

from diloco.app.records import RUN_FILES, TYPED
from diloco.run_dir import ENTRIES, RunDir

ROOT = Path(__file__).resolve().parents[2]
FILE_NAMES = (
    "metrics.jsonl",
    "summary.json",
    "global.json",
    "config.json",
    "faults.json",
    "faults.jsonl",
    "pids.json",
    "status_page.json",
    "coordinator.port.json",
    "sites_done",
    "pg_init",
)
DIR_NAMES = ("workers", "progress", "checkpoints", "logs", "tb", "prometheus", "plots", "credentials", "wan")
SPELLED = re.compile(r"""(["'])(?:""" + "|".join(map(re.escape, FILE_NAMES)) + r""")\1|/\s*(["'])(?:""" + "|".join(DIR_NAMES) + r""")\2""")


def test_no_module_but_run_dir_spells_a_run_directory_name() -> None:
    found = []
    for f in sorted((ROOT / "diloco").rglob("*.py")):
        if f.name == "run_dir.py" or "pb" in f.parts:
            continue
        for i, line in enumerate(f.read_text().splitlines(), 1):
            if SPELLED.search(line) and not line.lstrip().startswith("#"):
                found.append(f"{f.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not found, "run-directory names outside diloco/run_dir.py (use RunDir):\n" + "\n".join(found)


def test_every_path_run_dir_makes_is_a_documented_entry() -> None:
    rd = RunDir(Path("/run"))
    made = [
        rd.config, rd.metrics, rd.global_record, rd.summary, rd.sites_done, rd.status_page, rd.faults, rd.faults_fired, rd.pids, rd.coordinator_port,
        rd.pg_init, rd.worker("0"), rd.progress("0", 1), rd.prometheus("site-0"), rd.log("site0", ".1"), rd.tensorboard("coordinator"),
        rd.coordinator_checkpoints, rd.site_checkpoints(0), rd.plots_dir, rd.credentials_dir, rd.wan_dir,
    ]  # fmt: skip
    tops = {p.relative_to(rd.root).parts[0] for p in made}
    documented = {re.split(r"[/,]", name)[0] for name in ENTRIES}
    assert tops <= documented, f"not in diloco.run_dir.ENTRIES (docs/outputs.md): {sorted(tops - documented)}"
    assert {p.name for p in (*rd.stale_files, *rd.stale_dirs)} <= documented


def test_the_typed_files_are_entries_and_every_entry_is_in_the_outputs_doc() -> None:
    assert set(TYPED) <= set(ENTRIES)
    assert [f.path for f in RUN_FILES] == list(ENTRIES)
    outputs = (ROOT / "docs" / "outputs.md").read_text()
    for name in ENTRIES:
        assert f"`{name}`" in outputs
