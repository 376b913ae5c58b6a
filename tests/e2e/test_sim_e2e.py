"""End-to-end tests of diloco-sim: real processes, real gRPC, real files in the run dir.

Every run uses the tiny model and a handful of small steps, so each one takes seconds. Runs
that several tests look at are module-scoped fixtures. Every CLI call goes through a
subprocess with a timeout; on timeout the whole process group (diloco-sim and the processes
it started) is killed, so a hung run never outlives its test.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import Run, kill_group, processes_of, run_ok, run_sim, sim_command

CONTEXT = 128  # the tiny model's sequence length (conf/model/tiny.yaml -> diloco/model.py)
FP32 = 4  # bytes per parameter of an fp32 payload
UNIFORM_BPB = 8.0  # bits per byte of a uniform guess over 256 byte values

# Small runs: a DiLoCo round of 3 sites x 3 inner steps x 4 sequences.
SITES, H, ROUNDS, BATCH = 3, 3, 3, 4
# Every round waits for every site: under the default quorum (a majority) a site whose process
# starts a second late on a loaded machine misses round 0, and these runs compare every round.
EVERY_SITE = [f"quorum.min_sites={SITES}"]
SMALL = [f"sync.every={H}", f"rounds={ROUNDS}", f"data.batch_size={BATCH}", "eval_every=1", "sim.timeout_s=240"]

METRIC_KEYS = {"round", "participants", "tokens", "bytes_up", "bytes_down", "train_loss", "eval_bpb", "global_sha256", "wall_s"}
SUMMARY_KEYS = {
    "mode", "sites", "sync_every", "rounds", "params", "tokens", "final_eval_bpb", "bytes_up", "bytes_down",
    "wall_s", "global_sha256", "site_global_sha256", "hashes_equal", "peak_rss_mb",
}  # fmt: skip


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# ---- shared runs -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def diloco_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return run_ok(tmp_path_factory.mktemp("diloco") / "run", "mode=diloco", f"sites={SITES}", *EVERY_SITE, *SMALL)


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return run_ok(tmp_path_factory.mktemp("ddp") / "run", "mode=ddp", "sites=2", *SMALL)


@pytest.fixture(scope="module")
def single_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    # sites=3 on purpose: mode=single ignores it and runs one worker.
    return run_ok(tmp_path_factory.mktemp("single") / "run", "mode=single", "sites=3", "seed=0", *SMALL)


def _check_common(run: Run, mode: str, workers: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Checks shared by every mode; returns (summary, metrics)."""
    summary, metrics = run.summary, run.metrics
    assert SUMMARY_KEYS <= summary.keys(), sorted(SUMMARY_KEYS - summary.keys())
    assert summary["mode"] == mode
    assert summary["sites"] == workers
    assert summary["rounds"] == ROUNDS and summary["sync_every"] == H
    assert summary["rounds_committed"] == ROUNDS
    assert isinstance(summary["params"], int) and summary["params"] > 0
    assert _finite(summary["final_eval_bpb"]) and 0 < summary["final_eval_bpb"] < UNIFORM_BPB
    assert summary["wall_s"] > 0

    assert len(metrics) == ROUNDS, metrics
    assert [m["round"] for m in metrics] == list(range(ROUNDS))
    ids = [str(i) for i in range(workers)]
    for m in metrics:
        assert METRIC_KEYS <= m.keys(), sorted(METRIC_KEYS - m.keys())
        assert m["participants"] == ids
        assert m["tokens"] == workers * H * BATCH * CONTEXT
        assert _finite(m["train_loss"]) and m["train_loss"] > 0
        assert _finite(m["eval_bpb"]) and 0 < m["eval_bpb"] < UNIFORM_BPB  # eval_every=1
        assert len(m["global_sha256"]) == 64
    assert summary["tokens"] == sum(m["tokens"] for m in metrics) == ROUNDS * workers * H * BATCH * CONTEXT
    assert summary["bytes_up"] == sum(m["bytes_up"] for m in metrics)
    assert summary["bytes_down"] == sum(m["bytes_down"] for m in metrics)
    assert metrics[-1]["eval_bpb"] == summary["final_eval_bpb"]
    assert metrics[-1]["global_sha256"] == summary["global_sha256"]
    # Training moves the parameters every round, and (even in a few steps) lowers the loss.
    assert len({m["global_sha256"] for m in metrics}) == ROUNDS
    assert metrics[-1]["eval_bpb"] < metrics[0]["eval_bpb"]

    site_hashes = summary["site_global_sha256"]
    assert sorted(site_hashes) == ids
    assert all(h == summary["global_sha256"] for h in site_hashes.values()), site_hashes
    assert summary["hashes_equal"] is True
    assert sorted(run.workers()) == ids
    assert (run.run_dir / "logs").is_dir()
    return summary, metrics


# ---- 1. DiLoCo through gRPC ------------------------------------------------------------


@pytest.mark.timeout(150)
def test_diloco_three_sites_end_to_end(diloco_run: Run) -> None:
    run = diloco_run
    assert json.loads((run.run_dir / "config.json").read_text())["model"]["context"] == CONTEXT
    summary, metrics = _check_common(run, "diloco", SITES)
    params = summary["params"]
    payload = SITES * params * FP32  # one fp32 copy of the parameters per site

    for m in metrics:
        assert m["bytes_up"] == payload, m
        assert m["inner_steps"] == SITES * H
    # Round 0 also carries each site's initial pull of θ_0; later rounds only the update.
    assert metrics[0]["bytes_down"] >= payload
    for m in metrics[1:]:
        assert m["bytes_down"] == payload, m

    # Each site's copy of θ is bit-identical to the coordinator's after EVERY round.
    for site_id, w in run.workers().items():
        assert w["global_sha256"] == summary["global_sha256"]
        assert sorted(w["round_sha256"], key=int) == [str(r) for r in range(ROUNDS)], (site_id, w["round_sha256"])
        for m in metrics:
            assert w["round_sha256"][str(m["round"])] == m["global_sha256"], (site_id, m["round"])
        assert w["tokens"] == ROUNDS * H * BATCH * CONTEXT
        assert w["bytes_up"] == ROUNDS * params * FP32

    logs = {p.name for p in (run.run_dir / "logs").iterdir()}
    assert {"coordinator.log", "site0.log", "site1.log", "site2.log"} <= logs
    assert run.json("global.json")["rounds_committed"] == ROUNDS  # the coordinator's own report, written when it stopped
    assert '"hashes_equal": true' in run.stdout


# ---- 2. the baselines --------------------------------------------------------------------


@pytest.mark.timeout(150)
def test_ddp_and_single_same_format(ddp_run: Run, single_run: Run, diloco_run: Run) -> None:
    ddp_summary, ddp_metrics = _check_common(ddp_run, "ddp", 2)
    single_summary, single_metrics = _check_common(single_run, "single", 1)

    # Same summary.json format in every mode.
    # DiLoCo's summary also says how much of each site's time went into inner steps (optional fields)
    overlap = {"compute_utilization", "utilization_until_last_step", "stall_s"}
    assert ddp_summary.keys() == single_summary.keys() == diloco_run.summary.keys() - overlap
    # ddp and single write the same metrics.jsonl format.
    for m in ddp_metrics + single_metrics:
        assert m.keys() == ddp_metrics[0].keys()

    assert len(set(ddp_summary["site_global_sha256"].values())) == 1
    assert single_summary["site_global_sha256"] == {"0": single_summary["global_sha256"]}
    assert ddp_summary["params"] == single_summary["params"] == diloco_run.summary["params"]
    for d, s in zip(ddp_metrics, single_metrics, strict=True):
        assert d["tokens"] == 2 * s["tokens"]
    assert ddp_summary["tokens"] == 2 * single_summary["tokens"]
    # Two ranks on different shards do not end where one worker does.
    assert ddp_summary["global_sha256"] != single_summary["global_sha256"]


@pytest.mark.timeout(150)
def test_baseline_metrics_keys_match_diloco(ddp_run: Run, single_run: Run, diloco_run: Run) -> None:
    diloco_keys = diloco_run.metrics[0].keys()
    assert ddp_run.metrics[0].keys() == diloco_keys
    assert single_run.metrics[0].keys() == diloco_keys


# ---- 3. seeds and determinism ------------------------------------------------------------


@pytest.mark.timeout(150)
def test_single_seed_determinism(single_run: Run, tmp_path: Path) -> None:
    again = run_ok(tmp_path / "again", "mode=single", "sites=3", "seed=0", *SMALL, "sim.fork=false")  # fresh interpreters
    one_round = [o for o in SMALL if not o.startswith("rounds=")] + ["rounds=1"]  # the first round tells the seeds apart
    other = run_ok(tmp_path / "other", "mode=single", "sites=3", "seed=1", *one_round)
    base = single_run.summary
    assert again.summary["global_sha256"] == base["global_sha256"]
    assert [m["global_sha256"] for m in again.metrics] == [m["global_sha256"] for m in single_run.metrics]
    assert [m["train_loss"] for m in again.metrics] == [m["train_loss"] for m in single_run.metrics]
    assert again.summary["final_eval_bpb"] == base["final_eval_bpb"]
    assert other.summary["seed"] == 1 and base["seed"] == 0
    assert other.metrics[0]["global_sha256"] != single_run.metrics[0]["global_sha256"]


@pytest.mark.timeout(150)
def test_diloco_seed_determinism(diloco_run: Run, tmp_path: Path) -> None:
    # The same config again: its three sites push in whatever order they finish, which differs
    # between the two runs, and the coordinator's sum must not depend on it. Its processes are
    # fresh interpreters (sim.fork=false), not forked from the zygote, and its coordinator cuts
    # θ into 3 shards (coordinator.shards): the same bits either way.
    again = run_ok(tmp_path / "again", "mode=diloco", f"sites={SITES}", *EVERY_SITE, *SMALL, "sim.fork=false", "coordinator.shards=3")
    assert "cut into 3 shards" in (again.run_dir / "logs" / "coordinator.log").read_text()
    assert again.summary["hashes_equal"], again.describe()
    assert [m["global_sha256"] for m in again.metrics] == [m["global_sha256"] for m in diloco_run.metrics]
    assert again.summary["global_sha256"] == diloco_run.summary["global_sha256"]


# ---- 4. config errors fail fast ----------------------------------------------------------


def _assert_failed_before_start(run: Run) -> None:
    assert run.returncode != 0, run.describe()
    assert not (run.run_dir / "metrics.jsonl").exists()
    assert not (run.run_dir / "logs").exists()
    assert not (run.run_dir / "config.json").exists()
    assert not (run.run_dir / "workers").exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("override", "expected"),
    [
        # one of each way a config can be wrong (the values' checks, each named, are
        # tests/unit/test_config.py's): a renamed key, before hydra; a config group's unknown
        # option; a bad value; an unknown key
        ("fragments=2", ["fragments: renamed, use sync.fragments"]),
        ("model=huge", ["huge", "tiny", "small"]),
        ("codec=bogus", ["codec", "bogus", "fp32", "int8", "int4", "e3m0", "topk2bit"]),
        ("+colour=blue", ["unknown config key", "colour"]),
    ],
)
def test_config_error_fails_fast(tmp_path: Path, override: str, expected: list[str]) -> None:
    key = override.split("=")[0]
    base = [o for o in ("sites=2", "sync.every=2", "rounds=2", "data.batch_size=4") if o.split("=")[0] != key]
    run = run_sim(tmp_path / "run", *base, override, timeout=60)
    _assert_failed_before_start(run)
    for word in expected:
        assert word in run.stderr, run.describe()
    assert "Traceback" not in run.stderr, run.describe()


# ---- 5. data.path ------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["missing", "too_small"])  # empty files and directories: tests/unit/test_data.py
def test_bad_data_path_fails_fast(tmp_path: Path, kind: str) -> None:
    data = tmp_path / "data"
    data.mkdir()
    if kind == "missing":
        path = data / "no-such-corpus.txt"
    else:
        path = data / "tiny.txt"
        path.write_text(("To be, or not to be, that is the question. " * 3)[:100])
        assert path.stat().st_size == 100
    run = run_sim(tmp_path / "run", "mode=diloco", "sites=2", "sync.every=2", "rounds=2", "data.batch_size=4", f"data.path={path}", timeout=60)
    _assert_failed_before_start(run)
    assert str(path) in run.stderr, run.describe()
    assert "Traceback" not in run.stderr, run.describe()


PARAGRAPHS = [
    "The river ran low that summer, and the mill stood silent for the first time in forty years. "
    "Children walked along the dry bed collecting smooth stones, while their parents argued in the "
    "square about whether the rain would ever come back.",
    "In the evenings the old keeper lit the lamps one by one, counting them under his breath. He had "
    "done it so long that he no longer needed the light to find the wicks, and he said the town "
    "would be darker the day he stopped.",
    "A letter arrived from the capital in late August. It was short and polite, and it promised "
    "engineers, money and a new canal before the winter. Nobody believed a word of it, yet everyone "
    "read it twice.",
    "When the storm finally broke, it broke all at once: thunder over the hills, water pouring from "
    "every roof, and the wheel of the mill turning again with a groan that could be heard from the "
    "far end of the valley.",
]


@pytest.mark.timeout(120)
def test_custom_data_directory(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    (corpus / "book2").mkdir(parents=True)
    for i in range(3):
        text = "\n\n".join(PARAGRAPHS[(i + k) % len(PARAGRAPHS)] + f" (Chapter {i}.{k}.)" for k in range(200))
        target = corpus / ("book2" if i == 2 else ".") / f"part{i}.txt"
        target.write_text(text + "\n", encoding="utf-8")
    (corpus / ".hidden.txt").write_bytes(b"\x00\xff not text")
    total = sum(p.stat().st_size for p in corpus.rglob("part*.txt"))
    assert 100_000 < total < 2_000_000

    sites, h, rounds = 2, 2, 2
    run = run_ok(
        tmp_path / "run", "mode=diloco", f"sites={sites}", f"sync.every={h}", f"rounds={rounds}", f"data.batch_size={BATCH}",
        "eval_every=1", f"data.path={corpus}",
    )  # fmt: skip
    summary = run.summary
    assert run.json("config.json")["data"]["path"] == str(corpus)
    assert summary["mode"] == "diloco" and summary["sites"] == sites and summary["rounds_committed"] == rounds
    assert summary["tokens"] == rounds * sites * h * BATCH * CONTEXT
    assert _finite(summary["final_eval_bpb"]) and 0 < summary["final_eval_bpb"] < UNIFORM_BPB
    assert summary["hashes_equal"] is True
    assert [m["round"] for m in run.metrics] == list(range(rounds))


# ---- 6. a site that dies -----------------------------------------------------------------


@pytest.mark.timeout(180)
def test_site_death_fails_run_and_cleans_up(tmp_path: Path) -> None:
    run_dir = (tmp_path / "run").resolve()
    out_path, err_path = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    # Rounds of 150 inner steps take several seconds each, so the run is mid-round when we kill.
    cmd = [
        *sim_command(), "mode=diloco", "sites=2", "sync.every=150", "rounds=3", f"data.batch_size={BATCH}",
        "eval_every=3", "sim.timeout_s=150", f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    with open(out_path, "w") as out, open(err_path, "w") as err:
        popen = subprocess.Popen(cmd, cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=out, stderr=err, text=True, start_new_session=True)
    try:
        progress = run_dir / "progress" / "1.0.json"  # written after each inner step: site 1 has joined and trains
        deadline = time.monotonic() + 90
        while not progress.exists():
            assert popen.poll() is None, f"diloco-sim exited early (rc={popen.returncode}): {err_path.read_text()}"
            assert time.monotonic() < deadline, "site 1 did not join within 90 s"
            time.sleep(0.1)

        # The processes are forked from the run's zygote: pids.json names them; each is alive.
        pids = json.loads((run_dir / "pids.json").read_text())
        assert sorted(pids) == ["coordinator", "site 0", "site 1"], pids
        alive = processes_of(run_dir)  # the zygote and its children share its command line
        assert all(pid in alive for pid in pids.values()), (pids, alive)
        os.kill(pids["site 1"], signal.SIGKILL)

        try:
            rc = popen.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("diloco-sim did not exit within 60 s of site 1 being killed")
        output = out_path.read_text() + err_path.read_text()
        assert rc != 0, output
        assert "site 1" in output, output
        assert "site 1" in err_path.read_text(), output
        assert not (run_dir / "summary.json").exists()
        leftovers = processes_of(run_dir)
        assert not leftovers, f"processes of the run still alive after diloco-sim exited: {leftovers}"
    finally:
        kill_group(popen)
        for pid in processes_of(run_dir):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if popen.poll() is None:
            popen.wait(timeout=10)
