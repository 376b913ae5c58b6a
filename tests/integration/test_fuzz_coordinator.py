"""A bounded fuzz test: several hostile clients, each holding the credentials of a site of its
own (x, y), send random sequences of valid and invalid messages (tests/hostile.py) to a real
coordinator with the default security on 127.0.0.1 while a legitimate 2-site run goes on. No call may crash the servicer, no thread may die, θ changes only through committed
rounds (the legitimate sites, applying only the updates they pull, end bit-identical to it),
and every round of the legitimate run commits."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from helpers import theta
from hostile import Counts, Fuzzer, legit_site, site_channel

from diloco.coordinator import Coordinator, CoordinatorConfig
from diloco.coordinator.round_policy import QuorumConfig
from diloco.outer import OuterConfig
from diloco.security.config import SecurityConfig
from diloco.security.store import write_run_credentials
from diloco.transport import ServerLimits, serve

pytestmark = pytest.mark.timeout(120)
ROUNDS = 6
FUZZERS = 4
MESSAGES = 400  # per fuzzer
THETA = theta({"emb.w": (16, 8), "head.b": (8,)}, seed=3)


def test_hostile_clients_never_crash_the_coordinator_and_a_legitimate_run_completes(tmp_path: Path) -> None:
    creds = write_run_credentials(tmp_path / "creds", ["a", "b", "x", "y"], hosts=["127.0.0.1"], days=1)
    security = SecurityConfig(dir=str(creds.dir))
    cfg = CoordinatorConfig(
        total_rounds=ROUNDS, min_sites=2, sites=("a", "b", "x", "y"), quorum=QuorumConfig(lease_s=30, deadline="fixed", deadline_s=1.0, late="merge"),
        staging_timeout_s=5.0,
    )  # fmt: skip
    coord = Coordinator(THETA, OuterConfig(), cfg)
    commits = []
    coord.on_commit.append(commits.append)
    server, port = serve(coord, "127.0.0.1", 0, security=security, limits=ServerLimits(stream_idle_s=5.0))
    stop_ticker = coord.start_ticker(0.05)
    address = f"127.0.0.1:{port}"
    hashes: dict[str, str] = {}
    counts = Counts()
    try:
        legit = [threading.Thread(target=legit_site, args=(address, s, THETA, ROUNDS, hashes, security)) for s in ("a", "b")]
        for t in legit:
            t.start()
        own = ["x", "y"]
        channels = [site_channel(address, creds, own[i % 2]) for i in range(FUZZERS)]
        fuzzers = [Fuzzer(ch, seed=i, members=[own[i % 2]], theta=THETA, total_rounds=ROUNDS) for i, ch in enumerate(channels)]
        threads = [threading.Thread(target=f.run, args=(MESSAGES,)) for f in fuzzers]
        for t in threads:
            t.start()
        for t in threads + legit:
            t.join(100)
        for f in fuzzers:
            counts.merge(f.counts)
        for ch in channels:
            ch.close()
        print(f"fuzz: {counts.sent} messages, {counts.refusals} refused, {len(counts.crashes)} crashes; by code: {dict(sorted(counts.codes.items()))}")
        assert [f.error for f in fuzzers] == [None] * FUZZERS
        assert counts.crashes == []
        # INTERNAL comes only from grpc itself, for bytes that do not parse as the request.
        assert set(counts.internal) <= {"Exception deserializing request!", "Exception iterating requests!"}, counts.internal
        assert counts.sent >= FUZZERS * MESSAGES and counts.refusals > counts.sent // 2
        assert coord.failed is None and any(t.name == "coordinator-ticker" for t in threading.enumerate())
        assert coord.finished and [c.round for c in commits] == list(range(ROUNDS))
        assert hashes["a"] == hashes["b"] == coord.global_sha256()
    finally:
        stop_ticker()
        server.stop(grace=None).wait(5)
