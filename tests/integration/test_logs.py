"""One log format for every process (diloco.observe.logs): time, process, level, message, as
text lines or, with logging.json=true, one JSON object per line; checked in a process of its
own (setup_logging takes over the process's logging) and in a real run's log files (the
text lines of real runs: tests/integration/test_report_cli.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from helpers import Run, run_ok

from diloco.observe.logs import FIELDS, LINE, parse_line

PROGRAM = textwrap.dedent(
    """
    import logging, sys, warnings
    from diloco.observe.logs import log_at, setup_logging
    log = setup_logging("site 7", json=sys.argv[1] == "json")
    log("hello from the site")
    logging.getLogger("grpc").warning("a library's record")
    warnings.warn("careful")
    log_at(log, logging.ERROR, "two\\nlines")
    raise RuntimeError("boom")
    """
)


def _program(mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


def test_every_record_of_a_process_has_time_process_level_and_message() -> None:
    done = _program("text")
    assert done.returncode == 1 and done.stderr == "", done.stderr  # the uncaught exception is a log record too
    records = [r for r in map(parse_line, done.stdout.splitlines()) if r is not None]
    assert [(r["process"], r["level"]) for r in records] == [
        ("site 7", "INFO"),
        ("site 7", "WARNING"),
        ("site 7", "WARNING"),
        ("site 7", "ERROR"),
        ("site 7", "CRITICAL"),
    ]
    assert [r["message"] for r in records[:2]] == ["hello from the site", "a library's record"]
    assert "UserWarning: careful" in records[2]["message"] and records[3]["message"] == "two"
    lines = done.stdout.splitlines()
    assert lines[lines.index(next(line for line in lines if line.endswith("ERROR two"))) + 1] == "lines"  # a message's next lines follow it
    assert records[4]["message"] == "uncaught exception" and done.stdout.rstrip().endswith("RuntimeError: boom")
    assert LINE.match(lines[0]) and lines[0][:2] == "20" and lines[0][23] == "Z"  # 2026-12-04T21:40:01.123Z


def test_json_mode_writes_one_object_per_line_and_nothing_else() -> None:
    done = _program("json")
    assert done.returncode == 1 and done.stderr == "", done.stderr
    objects = [json.loads(line) for line in done.stdout.splitlines()]
    assert all(sorted(o) == sorted(FIELDS) and o["process"] == "site 7" for o in objects)
    assert [o["level"] for o in objects] == ["INFO", "WARNING", "WARNING", "ERROR", "CRITICAL"]
    assert objects[3]["message"] == "two\nlines"
    assert objects[4]["message"].startswith("uncaught exception\nTraceback") and objects[4]["message"].endswith("RuntimeError: boom")
    assert [parse_line(line) for line in done.stdout.splitlines()] == [{k: o[k] for k in FIELDS} for o in objects]


@pytest.fixture(scope="module")
def json_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return run_ok(
        tmp_path_factory.mktemp("json") / "run",
        "sites=1",
        "sync.every=1",
        "rounds=1",
        "data.batch_size=2",
        "sim.plots=false",
        "logging.json=true",
        "sim.timeout_s=120",
    )


def test_a_json_run_logs_every_process_as_json_lines(json_run: Run) -> None:
    logs = {p.name: p.read_text().splitlines() for p in sorted((json_run.run_dir / "logs").glob("*.log"))}
    assert sorted(logs) == ["coordinator.log", "site0.log"], json_run.describe()
    processes = {"coordinator.log": "coordinator", "site0.log": "site 0"}
    for name, lines in logs.items():
        objects = [json.loads(line) for line in lines]  # every line: nothing but JSON
        assert objects and all(sorted(o) == sorted(FIELDS) and o["process"] == processes[name] for o in objects), name
    messages = {name: [json.loads(line)["message"] for line in lines] for name, lines in logs.items()}
    # The same messages as in text mode, without the prefix.
    assert any(m.startswith("coordinator listening on 127.0.0.1:") for m in messages["coordinator.log"])
    assert "coordinator done: 1 rounds" in "\n".join(messages["coordinator.log"])
    assert any(m.startswith("site 0 joined run ") for m in messages["site0.log"])
    # diloco-sim's own stdout: its records, and the summary, each one JSON line.
    out = [json.loads(line) for line in json_run.stdout.splitlines()]
    own = [o for o in out if set(o) == set(FIELDS)]
    assert {o["process"] for o in own} == {"diloco-sim"} and any(o["message"].startswith("round   1/1  workers 1") for o in own)
    assert [o["hashes_equal"] for o in out if "hashes_equal" in o] == [True]
