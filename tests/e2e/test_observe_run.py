"""diloco-sim with what it shows by default: every process's Prometheus /metrics scraped while a
real 2-site run is held still (one site stopped with SIGSTOP, so the open round cannot close)
and parsed with prometheus_client's parser; the coordinator's health service asked through
grpc_health's stub with a site's TLS credentials; the TensorBoard event files read back with
tensorboard's EventAccumulator and compared with metrics.jsonl and the sites' records; and a
metrics port in use refused before any process starts, naming the port.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import grpc
import pytest
from helpers import kill_group, processes_of, run_sim, sim_command
from observe_helpers import health_status, sample, scrape, tb_scalars

pytestmark = pytest.mark.timeout(180)

CONTEXT = 128  # the tiny model's sequence length
SITES, H, ROUNDS, BATCH = 2, 3, 6, 4
ARGS = [
    "mode=diloco",
    f"sites={SITES}",
    f"sync.every={H}",
    f"rounds={ROUNDS}",
    f"data.batch_size={BATCH}",
    "eval_every=2",
    "sim.timeout_s=150",
    "sim.plots=false",
]


def _site_pids(run_dir: Path, site: str) -> list[int]:
    """The site's process (forked from the run's zygote: pids.json names it), if alive."""
    pid = json.loads((run_dir / "pids.json").read_text()).get(f"site {site}")
    return [pid] if pid in processes_of(run_dir) else []


def _wait(popen: subprocess.Popen[str], ready) -> None:  # type: ignore[no-untyped-def]
    """Until ``ready()`` (the test's timeout bounds it); fails at once if diloco-sim ended."""
    while not ready():
        assert popen.poll() is None, f"diloco-sim ended early (rc {popen.returncode}): {popen.stderr.read() if popen.stderr else ''}"
        time.sleep(0.02)


def _consistent(url: str) -> dict:
    """A scrape taken between commits: a commit that was on its way when site 1 stopped (its
    push had arrived) has been counted everywhere (its listeners run after it is published)."""
    while True:
        s = scrape(url)
        counts = {
            sample(s, n)
            for n in (
                "diloco_coordinator_open_round",
                "diloco_coordinator_rounds_committed_total",
                "diloco_coordinator_commit_duration_seconds_count",
                "diloco_coordinator_checkpoint_duration_seconds_count",
            )
        }
        if len(counts) == 1:
            return s
        time.sleep(0.05)


def _lines(path: Path) -> list[dict]:
    """The complete lines of a metrics.jsonl being written (a line being appended is left out)."""
    return [json.loads(x) for x in path.read_text().split("\n")[:-1] if x.strip()] if path.exists() else []


def test_a_real_run_shows_in_prometheus_health_and_tensorboard(tmp_path: Path) -> None:
    run_dir = (tmp_path / "run").resolve()
    cmd = [*sim_command(), *ARGS, f"hydra.run.dir={run_dir}"]
    popen = subprocess.Popen(cmd, cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    stopped: list[int] = []
    try:
        prom = run_dir / "prometheus"
        _wait(popen, lambda: (prom / "coordinator.json").exists())
        url = json.loads((prom / "coordinator.json").read_text())["url"]
        first = scrape(url)
        _wait(popen, lambda: len(_lines(run_dir / "metrics.jsonl")) >= 1 and (prom / "site-0.json").exists())
        # Site 1 stopped: the open round waits for it (its lease is 60 s), so what is scraped
        # now is a run in the middle, not one that has ended.
        stopped = _site_pids(run_dir, "1")
        assert stopped
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        during = _consistent(url)
        site0 = scrape(json.loads((prom / "site-0.json").read_text())["url"])
        creds = run_dir / "credentials"
        tls = grpc.ssl_channel_credentials((creds / "ca.pem").read_bytes(), (creds / "sites" / "0.key").read_bytes(), (creds / "sites" / "0.pem").read_bytes())
        port = json.loads((run_dir / "coordinator.port.json").read_text())["port"]
        with grpc.secure_channel(f"127.0.0.1:{port}", tls) as channel:
            assert health_status(channel) == "SERVING"
            assert health_status(channel, "diloco.v1.Coordinator") == "SERVING"
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        stopped = []
        stdout, stderr = popen.communicate(timeout=150)
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        kill_group(popen)
    assert popen.returncode == 0, f"{stdout[-3000:]}\n{stderr[-3000:]}"
    assert f"Prometheus metrics: coordinator {url}" in stdout + stderr

    # ---- the scrape during the run: counters moved, labels there -----------------------
    rounds = sample(during, "diloco_coordinator_rounds_committed_total")
    assert rounds >= 2  # metrics.jsonl's first line is written once round 1 is committed
    assert rounds >= sample(first, "diloco_coordinator_rounds_committed_total")
    assert sample(during, "diloco_coordinator_open_round") == rounds
    assert sample(during, "diloco_coordinator_rounds_planned") == ROUNDS
    assert sample(during, "diloco_coordinator_finished") == 0
    assert sample(during, "diloco_coordinator_sites", state="active") == SITES
    assert sample(during, "diloco_coordinator_pushes_accepted_total") >= SITES * rounds
    assert sample(during, "diloco_coordinator_rpcs_total", method="Join", outcome="ok") >= SITES
    assert sample(during, "diloco_coordinator_received_bytes_total", method="PushDelta") > 0
    assert sample(during, "diloco_coordinator_sent_bytes_total", method="PullUpdate") > 0
    assert sample(during, "diloco_coordinator_push_duration_seconds_count") >= SITES * rounds
    assert sample(during, "diloco_coordinator_pull_duration_seconds_count", what="update") >= SITES * (rounds - 1)
    assert sample(during, "diloco_coordinator_commit_duration_seconds_count") == rounds
    assert sample(during, "diloco_coordinator_checkpoint_duration_seconds_count") == rounds  # the simulation checkpoints every round
    assert {"late", "duplicate", "norm_bound"} <= {dict(k)["reason"] for k in during["diloco_coordinator_pushes_refused_total"]}
    assert sample(site0, "diloco_site_info", site_id="0") == 1
    assert sample(site0, "diloco_site_inner_step_duration_seconds_count") >= H * rounds
    assert sample(site0, "diloco_site_tokens_total") >= H * rounds * BATCH * CONTEXT
    assert sample(site0, "diloco_site_tokens_per_second") > 0
    # Site 0 pushed round rounds-1 (it closed with both pushes); it may still be pulling it.
    assert sample(site0, "diloco_site_rounds_total") >= rounds - 1
    assert sample(site0, "diloco_site_outer_sync_duration_seconds_count", part="push") >= rounds - 1
    assert sample(site0, "diloco_site_sent_bytes_total") > 0
    assert sample(site0, "diloco_site_reconnects_total") >= 0 and sample(site0, "diloco_site_sync_stall_seconds_total") > 0

    # ---- TensorBoard: the coordinator's board is metrics.jsonl, the sites' boards add up --
    lines = _lines(run_dir / "metrics.jsonl")
    assert [m["round"] for m in lines] == list(range(ROUNDS))
    tb = tb_scalars(run_dir / "tb" / "coordinator")
    totals = [sum(m["tokens"] for m in lines[: r + 1]) for r in range(ROUNDS)]
    for tag, key in (
        ("loss/train", "train_loss"),
        ("bytes/up", "bytes_up"),
        ("bytes/down", "bytes_down"),
        ("norm/delta", "delta_norm"),
        ("sites/participants", None),
    ):
        want = [float(len(m["participants"])) if key is None else m[key] for m in lines]
        assert tb[tag] == [(r, pytest.approx(v, rel=1e-6)) for r, v in enumerate(want)], tag
        assert tb["by_tokens/" + tag] == [(t, pytest.approx(v, rel=1e-6)) for t, v in zip(totals, want)], tag
    evaluated = [(r, m["eval_bpb"]) for r, m in enumerate(lines) if m.get("eval_bpb") is not None]
    assert len(evaluated) >= ROUNDS // 2 and tb["loss/eval_bpb"] == [(r, pytest.approx(v, rel=1e-6)) for r, v in evaluated]
    assert [v for _, v in tb["tokens/total"]] == totals

    workers = {p.stem: json.loads(p.read_text()) for p in (run_dir / "workers").glob("*.json")}
    boards = {s: tb_scalars(run_dir / "tb" / f"site-{s}") for s in workers}
    for s, w in workers.items():
        steps = [step for step, _ in boards[s]["inner/loss"]]
        assert steps == list(range(w["inner_steps"])) == list(range(ROUNDS * H)), s
        assert all(v > 0 for _, v in boards[s]["inner/lr"])
        assert [r for r, _ in boards[s]["sync/push_s"]] == list(range(ROUNDS))
        assert all(0 < v <= 1 for _, v in boards[s]["site/compute_utilization"])
    # A round's train_loss is the token-weighted mean of its sites' inner losses (equal weights here).
    for r, m in enumerate(lines):
        per_site = [sum(v for step, v in boards[s]["inner/loss"] if r * H <= step < (r + 1) * H) / H for s in workers]
        assert sum(per_site) / len(per_site) == pytest.approx(m["train_loss"], rel=1e-5), r


@pytest.mark.timeout(90)
def test_a_metrics_port_in_use_stops_diloco_sim_before_any_process_starts(tmp_path: Path, busy_port: int) -> None:
    run = run_sim(tmp_path / "run", *ARGS, f"metrics.port={busy_port}", timeout=60)
    assert run.returncode == 2, run.describe()
    assert f"metrics.port={busy_port}: 127.0.0.1:{busy_port} is already in use" in run.stderr
    assert not (tmp_path / "run" / "logs").exists()  # no process was started
