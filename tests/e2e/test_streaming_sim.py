"""Streaming fragments, overlap and eager outer steps through the real simulation (separate
processes, real gRPC, real SIGKILLs), and plain DiLoCo unchanged by them."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from helpers import Run, run_ok

from diloco.app.config import RunConfig, run_config_from_dict
from diloco.app.coordinator import CoordinatorOptions, coordinator_config, initial_params
from diloco.coordinator import Coordinator
from diloco.data import ShardSampler, load_corpus
from diloco.model import build_model
from diloco.sim.launcher import run_simulation
from diloco.site.inner import InnerTrainer
from diloco.site.outer_sync import OuterSync, SyncOptions
from diloco.transport import CoordinatorClient, serve

pytestmark = pytest.mark.timeout(300)


def _plain_diloco_sha256(cfg: RunConfig) -> str:
    """θ after ``cfg``'s run by plain blocking DiLoCo, computed here in one process: a real
    coordinator on 127.0.0.1:0 and one thread per site, each training exactly as a simulated site
    does (its shard, its seed, the run's lr schedule) and syncing with ``OuterSync.sync`` every H
    steps, with none of the streaming machinery (no RoundLoop, no schedule, no rounds in flight)."""
    theta0, source = initial_params(cfg)
    coord = Coordinator(theta0, cfg.outer_step, coordinator_config(cfg, CoordinatorOptions(port=0), source, evaluates=False))
    server, port = serve(coord, "127.0.0.1", 0)
    errors: list[BaseException] = []

    def site(shard: int) -> None:
        try:
            model = build_model(cfg.model, cfg.seed)
            trainer = InnerTrainer(model, cfg.inner, total_steps=cfg.total_steps)
            corpus = load_corpus(cfg.data, cfg.model.context, num_shards=cfg.sites)
            sampler = ShardSampler(corpus.train, shard=shard, num_shards=cfg.sites, batch_size=cfg.data.batch_size, context=cfg.model.context, seed=cfg.seed)
            options = SyncOptions(own=cfg.settings)
            with CoordinatorClient(f"127.0.0.1:{port}", timeout_s=60) as client:
                sync = OuterSync(model, client, str(shard), options)
                sync.join()
                while not sync.finished:
                    losses = [trainer.step(*sampler.next_batch()) for _ in range(cfg.sync.every)]
                    sync.sync(tokens=cfg.sync.every * sampler.tokens_per_batch, train_loss=sum(losses) / len(losses), inner_steps=cfg.sync.every)
                sync.leave()
        except BaseException as e:  # noqa: BLE001 - re-raised by the test
            errors.append(e)

    threads_before = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)  # as every simulated process: the same kernels' splits
    try:
        threads = [threading.Thread(target=site, args=(s,)) for s in range(cfg.sites)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=240)
    finally:
        torch.set_num_threads(threads_before)
        server.stop(grace=None).wait(5)
    assert not errors, errors
    assert coord.finished
    return coord.global_sha256()


@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_one_fragment_without_overlap_is_todays_diloco_bit_for_bit(tmp_path: Path, codec: str) -> None:
    # fragments=1 and overlap_steps=0 through the simulation's streaming-capable loop must give
    # θ bit for bit as plain blocking DiLoCo computed beside it, on this machine, in this run.
    # The subnormal flush off: it is a per-process (per-thread) setting the reference would
    # have to share with the test process.
    cfg = run_config_from_dict(
        {"sites": 2, "rounds": 3, "codec": codec, "eval_every": 100, "inner": {"flush_denormal": False}, "sync": {"every": 5, "fragments": 1, "overlap": 0}}
    )
    summary = run_simulation(cfg, tmp_path / "run", progress=None, plots=False)
    assert summary["hashes_equal"]
    assert summary["global_sha256"] == _plain_diloco_sha256(cfg)


def _events(*events: str) -> str:
    return "faults.events=[" + ",".join(events) + "]"


BASE = ["sites=3", "data.batch_size=4", "eval_every=100", "sim.timeout_s=240"]


@pytest.fixture(scope="module")
def streaming_kills(tmp_path_factory: pytest.TempPathFactory) -> Run:
    # H=4, F=2, τ=1: 8 coordinator rounds of 2 steps, each one fragment, pushed without waiting,
    # then a flush round for fragment 0 (no steps); merge=ahead, whose look-ahead a restarted
    # site takes up from the coordinator's momentum, pulled with θ when it joins again.
    events = _events(
        "{kind:kill_site,site:0,at_round:2,phase:inner,restart_after_s:0.5}",
        "{kind:kill_site,site:1,at_round:3,phase:push,restart_after_s:0.5}",
        "{kind:kill_coordinator,at_round:5,phase:mid,restart_after_s:0.5}",
    )
    return run_ok(
        tmp_path_factory.mktemp("streaming") / "run",
        *BASE,
        "sync.every=4",
        "rounds=4",
        "sync.fragments=2",
        "sync.overlap=1",
        "sync.merge=ahead",
        "codec=int8",
        events,
        timeout=280,
    )


def test_streaming_through_kills_keeps_the_fault_matrix_invariants(streaming_kills: Run) -> None:
    summary, metrics = streaming_kills.summary, streaming_kills.metrics
    assert [m["round"] for m in metrics] == list(range(9)), "rounds must be consecutive, each once"
    assert summary["rounds_committed"] == 9 and summary["rounds_rejected"] == 0
    assert summary["hashes_equal"], summary["site_global_sha256"]
    assert set(summary["site_global_sha256"]) == {"0", "1", "2"}  # every site finished (was started again)
    assert [e["kind"] for e in summary["faults_injected"]] == ["kill_site", "kill_site", "kill_coordinator"]
    assert 0 < summary["goodput"] <= 1
    # Site 0, killed in round 2 and started again, looks ahead from the coordinator's momentum.
    assert streaming_kills.json("workers/0.json")["momentum_pulled"], "site 0 took no momentum with its pull of θ"


def test_streaming_rounds_alternate_fragments_and_account_their_bytes(streaming_kills: Run) -> None:
    summary, metrics = streaming_kills.summary, streaming_kills.metrics
    assert [m["fragment"] for m in metrics] == [0, 1] * 4 + [0]
    assert metrics[-1]["inner_steps"] == 0 and metrics[-1]["train_loss"] is None  # the flush round
    assert set(summary["fragment_bytes"]) == {"0", "1"}
    assert all(b["up"] > 0 and b["down"] > 0 for b in summary["fragment_bytes"].values())
    assert set(summary["compute_utilization"]) == {"0", "1", "2", "run"}
    assert all(0 < u <= 1 for u in summary["compute_utilization"].values())
    workers = {s: streaming_kills.json(f"workers/{s}.json") for s in ("0", "1", "2")}
    assert all(w["sync_mode"] == "streaming" and w["stall_s"] >= 0 for w in workers.values())
    # The site that was never killed pushed into every round: its bytes per fragment add up to
    # its bytes up (θ pulled whole at join is bytes down, not a fragment's).
    w2 = workers["2"]
    assert sum(b["up"] for b in w2["fragment_bytes"].values()) == w2["bytes_up"]


def test_frozen_fragments_end_without_flush_rounds_through_a_restart_among_them(tmp_path: Path) -> None:
    # H=4, F=2, τ=1, 3 rounds: 6 coordinator rounds; fragment 0's last round is 4, so site 0,
    # killed while pushing it and started again, finds fragment 0 frozen and trains fragment 1.
    events = _events("{kind:kill_site,site:0,at_round:4,phase:push,restart_after_s:0.5}")
    run = run_ok(
        tmp_path / "run",
        *BASE,
        "sites=2",
        "sync.every=4",
        "rounds=3",
        "sync.fragments=2",
        "sync.overlap=1",
        "sync.merge=ahead",
        "sync.end=freeze",
        "codec=int8",
        events,
        timeout=280,
    )
    summary, metrics = run.summary, run.metrics
    assert [m["fragment"] for m in metrics] == [0, 1] * 3 and summary["rounds_committed"] == 6
    assert all(m["inner_steps"] > 0 for m in metrics)  # no flush round
    assert summary["hashes_equal"] and set(summary["site_global_sha256"]) == {"0", "1"}
    assert [e["kind"] for e in summary["faults_injected"]] == ["kill_site"]


@pytest.mark.parametrize("mode", ["eager", "delayed"])
def test_eager_and_delayed_runs_survive_a_coordinator_restart(tmp_path: Path, mode: str) -> None:
    events = _events("{kind:kill_coordinator,at_round:2,phase:mid,restart_after_s:0.5}")
    run = run_ok(tmp_path / "run", *BASE, "sites=2", "sync.every=3", "rounds=4", f"sync.mode={mode}", events, timeout=280)
    summary = run.summary
    assert [m["round"] for m in run.metrics] == list(range(4))
    assert summary["hashes_equal"] and set(summary["site_global_sha256"]) == {"0", "1"}
    assert run.json("workers/0.json")["sync_mode"] == mode


def test_streaming_with_striping_through_emulated_links(tmp_path: Path) -> None:
    """2 sites through the WAN emulator (50 Mbit/s, 20 ms each; a shared coordinator link),
    2 fragments of equal sizes with overlap, each push and pull over 2 connections, TLS on every one."""
    run = run_ok(
        tmp_path / "run", "sites=2", "sync.every=4", "rounds=2", "sync.fragments=2", "sync.split=balanced", "sync.overlap=1", "sync.streams=2", "eval_every=100",
        "wan.bandwidth_mbit=50", "wan.rtt_ms=20", "wan.coordinator={bandwidth_mbit:80}", timeout=200,
    )  # fmt: skip
    summary = run.summary
    assert summary["hashes_equal"] and summary["rounds_committed"] == 5  # 2 x 2 fragments, 1 flush round
    split = run.json("global.json")["fragments"]  # recorded: each fragment's names and size, within the largest tensor
    assert [f["fragment"] for f in split] == [0, 1] and abs(split[0]["numel"] - split[1]["numel"]) <= 256 * 64
    parts = run.json("global.json")["commit_s_median"]  # where a commit's time went, median over the run's
    assert {"receive_s", "commit_s", "encode_s", "checkpoint_s", "publish_s"} <= set(parts) and all(v >= 0 for v in parts.values())
    assert parts["checkpoint_s"] > 0  # the sim's coordinator makes every commit durable
    assert run.json("config.json")["sync"]["split"] == "balanced"  # the split the coordinator read, whose sizes global.json holds
    assert summary["wan"]["sites"]["0"] == {"up_mbit": 50.0, "down_mbit": 50.0, "rtt_ms": 20.0, "jitter_ms": 0.0, "window_kb": None}
    assert summary["wan"]["coordinator"]["down_mbit"] == 80.0
    stats = run.json("wan/stats.json")
    for site in ("0", "1"):
        # every byte of the site's pushes crossed its emulated link (plus TLS and HTTP/2 framing)
        assert stats[site]["bytes_up"] >= run.json(f"workers/{site}.json")["bytes_up"]
        assert stats[site]["connections"] >= 2  # the second stream is a connection of its own
    assert "WAN emulation: each site 50.0/50.0 Mbit/s up/down, RTT 20 ms" in run.stdout


@pytest.mark.timeout(200)
def test_the_hide_link_preset_chooses_for_the_stated_link_and_config_json_says_what(tmp_path: Path) -> None:
    # 2 sites of model=tiny (3 layers), H=10, at a stated 10 Mbit/s and 100 ms with a 0.4 s step:
    # blocking would compute about 60% of the time; the preset streams the sync behind training.
    run = run_ok(
        tmp_path / "run", "sites=2", "rounds=2", "sync.every=10", "data.batch_size=4", "eval_every=100", "sync.preset=hide_link", "sync.link_mbit=10",
        "sync.link_rtt_ms=100", "sync.step_s=0.4", timeout=180,
    )  # fmt: skip
    chosen = run.json("config.json")
    sync = chosen["sync"]
    assert sync["preset"] == "hide_link" and (sync["link_mbit"], sync["link_rtt_ms"], sync["step_s"]) == (10, 100, 0.4)
    assert sync["fragments"] > 1 or sync["overlap"] > 0, sync
    assert sync["merge"] == "ahead" and chosen["codec"]["name"] == "int8"
    assert run.summary["hashes_equal"] and run.summary["rounds_committed"] == run.json("global.json")["rounds_committed"]
