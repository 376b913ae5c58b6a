"""The simulation's zygote (diloco/sim/zygote.py) as the launcher uses it: a forked child runs
``diloco.sim.child`` with its own log, session and niceness; its exit code is
reported as subprocess reports one (negative for a signal); closing the zygote takes its
remaining children with it. (That a forked run computes the same bits as fresh interpreters:
tests/e2e/test_sim_e2e.py, the seed-determinism tests.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from diloco.app.config import RunConfig, run_config_to_dict
from diloco.sim.zygote import Forked, Zygote

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Zygote]:
    z = Zygote(tmp_path_factory.mktemp("zygote"), dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        yield z
    finally:
        z.close()


def _spawn_waiting_coordinator(tmp_path: Path, zygote: Zygote, nice: int = 0) -> tuple[Forked, Path]:
    """A coordinator child that listens and waits for sites that never come."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(run_config_to_dict(RunConfig(sites=2))))
    log = tmp_path / "coordinator.log"
    argv = ["coordinator", "--config", str(config), "--run-dir", str(tmp_path), "--port-file", str(tmp_path / "port.json")]
    child = zygote.spawn(argv, log, dict(os.environ), nice=nice)
    deadline = time.monotonic() + 60
    while not (tmp_path / "port.json").exists():
        assert child.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    return child, log


def test_a_child_exits_with_its_code_and_writes_its_log(zygote: Zygote, tmp_path: Path) -> None:
    usage = zygote.spawn(["no-such-role"], tmp_path / "usage.log", dict(os.environ))
    assert usage.wait(timeout=30) == 2  # argparse's status
    assert "invalid choice: 'no-such-role'" in (tmp_path / "usage.log").read_text()
    missing = zygote.spawn(["site", "--config", str(tmp_path / "nope.json"), "--run-dir", str(tmp_path)], tmp_path / "missing.log", dict(os.environ))
    assert missing.wait(timeout=30) == 1
    text = (tmp_path / "missing.log").read_text()
    assert "Traceback" in text and "nope.json" in text


def test_a_child_is_a_process_of_its_own_until_it_is_killed(zygote: Zygote, tmp_path: Path) -> None:
    child, log = _spawn_waiting_coordinator(tmp_path, zygote, nice=3)
    assert os.getsid(child.pid) == child.pid  # its own session: killpg(pid) stops it and what it started
    assert os.getpriority(os.PRIO_PROCESS, child.pid) == os.getpriority(os.PRIO_PROCESS, os.getpid()) + 3
    assert "coordinator listening on 127.0.0.1" in log.read_text()
    assert child.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.2)
    child.kill()
    assert child.wait(timeout=30) == -signal.SIGKILL and child.returncode == -signal.SIGKILL


def test_closing_the_zygote_takes_its_children_with_it(tmp_path: Path) -> None:
    z = Zygote(tmp_path, dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        child, _ = _spawn_waiting_coordinator(tmp_path, z)
        z.close()
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child.pid}").exists() and _state(child.pid) != "Z":
            assert time.monotonic() < deadline, "the child outlived its zygote"
            time.sleep(0.05)
        assert child.wait(timeout=1) == -signal.SIGKILL
        with pytest.raises(RuntimeError, match="did not start a child"):  # the launcher makes it a SimError naming the process
            z.spawn(["coordinator"], tmp_path / "late.log", dict(os.environ))
    finally:
        z.close()


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
