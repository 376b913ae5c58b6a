"""Hundreds of hostile connections against a coordinator with the default security (TLS, client
certificates and tokens), while a legitimate 2-site run goes on: the run completes, the
coordinator's worker threads stay within their cap, and nothing the hostile clients send is
taken, not even from a client that holds a real site's leaked credentials."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from hostile import HostileLoad, Leaked, legit_site

from diloco.coordinator import Coordinator, CoordinatorConfig
from diloco.coordinator.round_policy import QuorumConfig
from diloco.outer import OuterConfig
from diloco.security.certs import issue_site, make_ca
from diloco.security.config import SecurityConfig
from diloco.security.store import write_run_credentials
from diloco.transport import ServerLimits, serve
from diloco.types import JoinRequest
from diloco.wire.fingerprint import fingerprint

pytestmark = pytest.mark.timeout(180)
ROUNDS = 3
CONNECTIONS = 200
MAX_RPCS = 32


def test_hostile_connections_neither_starve_nor_wedge_a_tls_run(tmp_path: Path) -> None:
    creds = write_run_credentials(tmp_path / "creds", ["a", "b", "x"], hosts=["localhost", "127.0.0.1"], days=1)
    theta = {"w": torch.randn(32, 16, generator=torch.Generator().manual_seed(0))}
    security = SecurityConfig(dir=str(creds.dir))  # TLS, client certificates and tokens: the default
    cfg = CoordinatorConfig(
        total_rounds=ROUNDS, min_sites=2, sites=("a", "b", "x"), quorum=QuorumConfig(deadline="fixed", deadline_s=2.0), staging_timeout_s=10.0,
    )  # fmt: skip
    coord = Coordinator(theta, OuterConfig(), cfg)
    server, port = serve(coord, "127.0.0.1", 0, security=security, limits=ServerLimits(max_rpcs=MAX_RPCS, max_rpcs_per_site=8, stream_idle_s=1.0))
    stop_ticker = coord.start_ticker(0.05)
    address = f"127.0.0.1:{port}"
    coord.join(JoinRequest("x", tuple(fingerprint(theta).values())))  # the site whose credentials leaked is a member
    x = creds.site_pem("x")
    foreign = issue_site(make_ca("not the run's CA", 1), "a", 1)
    load = HostileLoad(address, creds.ca_pem(), Leaked("x", x.cert, x.key, creds.site_token("x")), (foreign.key, foreign.cert), theta, CONNECTIONS)
    hashes: dict[str, str] = {}
    try:
        load.start()
        legit = [threading.Thread(target=legit_site, args=(address, s, theta, ROUNDS, hashes, security)) for s in ("a", "b")]
        for t in legit:
            t.start()
        for t in legit:
            t.join(150)
        report = load.finish()
        print(
            f"hostile load: {report.connections} connections, {report.counts.sent} calls, refused by code {dict(sorted(report.counts.codes.items()))}, "
            f"idle streams cancelled {server.watch.cancelled}, peak rpc threads {report.peak_rpc_threads}/{MAX_RPCS}, peak threads {report.peak_threads}"
        )
        assert coord.finished and hashes["a"] == hashes["b"] == coord.global_sha256()
        assert report.counts.crashes == [] and report.counts.codes.get("OK", 0) == 0  # nothing hostile was taken
        # Without the run's client certificate no call gets past the TLS handshake; the leaked
        # site may act only as itself, and only within its share of the calls.
        assert report.counts.codes["UNAVAILABLE"] > 0 and report.counts.codes["PERMISSION_DENIED"] > 0
        assert report.peak_rpc_threads <= MAX_RPCS
        assert server.watch.cancelled > 0  # the leaked site's idle pushes were cut off
        assert all("x" not in r["participants"] for r in coord.recent_records().values())
    finally:
        load.stop.set()
        stop_ticker()
        server.stop(grace=None).wait(5)
