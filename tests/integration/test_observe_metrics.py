"""What the coordinator and its gRPC server show, through real servers on 127.0.0.1:0:
Prometheus /metrics scraped and parsed with prometheus_client's parser while rounds go on
(counters move as the rounds do, the labels are there), TensorBoard event files read back with
tensorboard's EventAccumulator and compared with metrics.jsonl, the standard health service
through grpc_health's stub (SERVING during the run, NOT_SERVING after its last round, callable
without a site token), reflection behind its switch, and a metrics port in use refused naming it.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from helpers import FakeClock, coordinator, expect_refused, filled, join, push, served_client, served_coordinator, theta
from observe_helpers import HandSite, health_status, sample, scrape, tb_scalars

from diloco.app.config import ConfigError, run_config_from_dict
from diloco.app.coordinator import CoordinatorOptions, run_coordinator
from diloco.coordinator import Coordinator, CoordinatorConfig
from diloco.coordinator.round_policy import QuorumConfig
from diloco.observe.config import MetricsConfig, TensorBoardConfig, metrics_config
from diloco.observe.coordinator_metrics import CoordinatorMetrics
from diloco.observe.coordinator_observer import CoordinatorObserver
from diloco.observe.prom import MetricsEndpointError, check_port_free, serve_metrics
from diloco.observe.site_observer import SiteObserver
from diloco.outer import OuterConfig
from diloco.security.config import SecurityConfig
from diloco.security.store import RunCredentials, write_run_credentials
from diloco.transport import CoordinatorClient, serve

pytestmark = pytest.mark.timeout(90)
THETA = theta({"w": (2, 3)})
DELTA = filled(THETA, 0.1)


def _wait_for(path: Path, thread: threading.Thread) -> dict[str, Any]:
    """The JSON a starting process writes at ``path`` (the test's timeout bounds the wait)."""
    while not path.exists():
        assert thread.is_alive(), f"the process stopped before it wrote {path}"
        time.sleep(0.02)
    return json.loads(path.read_text())


# ---- the server's calls and commits, counted ---------------------------------------------


@pytest.fixture
def counted() -> Iterator[tuple[Coordinator, CoordinatorClient, FakeClock, str]]:
    """A coordinator whose rounds close at a deadline on a fake clock, its gRPC server telling
    every call to CoordinatorMetrics, and the metrics' own endpoint."""
    clock = FakeClock()
    cfg = CoordinatorConfig(total_rounds=3, min_sites=2, quorum=QuorumConfig(lease_s=100, deadline="fixed", deadline_s=30))
    coord = coordinator(THETA, cfg, clock=clock)
    metrics = CoordinatorMetrics()
    metrics.attach(coord)
    endpoint = serve_metrics(metrics.registry, "127.0.0.1", 0)
    try:
        with served_client(coord, observer=metrics) as client:
            yield coord, client, clock, endpoint.url
    finally:
        endpoint.close()


def test_a_scrape_counts_rounds_pushes_bytes_and_refusals_by_reason(counted) -> None:
    coord, client, clock, url = counted
    before = scrape(url)
    assert sample(before, "diloco_coordinator_rounds_committed_total") == 0
    assert sample(before, "diloco_coordinator_rounds_planned") == 3
    assert sample(before, "diloco_coordinator_sites", state="active") == 0
    for reason in ("late", "duplicate", "norm_bound"):  # present before anything is refused
        assert sample(before, "diloco_coordinator_pushes_refused_total", reason=reason) == 0

    join(client, THETA, "a", "b", "c")
    assert push(client, "a", 0, DELTA).accepted and push(client, "b", 0, DELTA).accepted
    clock.t += 31  # round 0's deadline: it closes with a and b, c still active
    assert coord.tick() is not None
    client.pull_update("a", 0)
    after = scrape(url)

    # Counters moved with the round, the gauges read the coordinator.
    assert sample(after, "diloco_coordinator_rounds_committed_total") == 1 > sample(before, "diloco_coordinator_rounds_committed_total")
    assert sample(after, "diloco_coordinator_tokens_total") == 20
    assert sample(after, "diloco_coordinator_open_round") == 1
    assert sample(after, "diloco_coordinator_sites", state="active") == 3
    assert sample(after, "diloco_coordinator_pushes_accepted_total") == 2
    assert sample(after, "diloco_coordinator_push_duration_seconds_count") == 2
    assert sample(after, "diloco_coordinator_pull_duration_seconds_count", what="update") == 1
    assert sample(after, "diloco_coordinator_round_duration_seconds_count") == 1
    assert sample(after, "diloco_coordinator_commit_duration_seconds_count") == 1
    assert sample(after, "diloco_coordinator_rpcs_total", method="Join", outcome="ok") == 3
    pushed = sample(after, "diloco_coordinator_received_bytes_total", method="PushDelta")
    assert pushed >= 2 * THETA["w"].numel() * 4  # two fp32 payloads, and their framing
    assert sample(after, "diloco_coordinator_sent_bytes_total", method="PullUpdate") >= THETA["w"].numel() * 4

    # Refusals, by reason: a push for the closed round (late), a repeat (duplicate), a push
    # for a round not open yet (its gRPC status).
    expect_refused(lambda: push(client, "c", 0, DELTA), "aborted")
    assert push(client, "a", 0, DELTA).duplicate
    expect_refused(lambda: push(client, "a", 2, DELTA), "failed_precondition")
    refused = scrape(url)
    assert sample(refused, "diloco_coordinator_pushes_refused_total", reason="late") == 1
    assert sample(refused, "diloco_coordinator_pushes_refused_total", reason="duplicate") == 1
    assert sample(refused, "diloco_coordinator_rpcs_total", method="PushDelta", outcome="aborted") == 1
    assert sample(refused, "diloco_coordinator_pushes_accepted_total") == 2  # nothing refused was counted
    assert sample(refused, "diloco_coordinator_pushes_refused_total", reason="failed_precondition") == 1  # round 2 is not open
    assert sample(refused, "diloco_coordinator_pushes_refused_total", reason="norm_bound") == 0
    assert sample(refused, "diloco_coordinator_received_bytes_total", method="PushDelta") > pushed


# ---- the coordinator process: TensorBoard, /metrics, health, reflection ------------------


def _round(sites: list[HandSite], r: int) -> None:
    for s in sites:
        s.gates[r].set()
    for s in sites:
        s.done[r].wait()
        assert s.error is None, s.error


@pytest.mark.timeout(150)
def test_the_coordinator_process_shows_its_rounds_in_tensorboard_metrics_and_health(tmp_path: Path) -> None:
    rounds = 3
    cfg = run_config_from_dict({"sites": 2, "rounds": rounds, "eval_by": "sites", "sync": {"every": 1}})
    run_dir = tmp_path / "run"
    opts = CoordinatorOptions(
        port=0, port_file=str(tmp_path / "port.json"), linger_s=60, reflection=True, metrics=MetricsConfig(port=0, port_file=str(tmp_path / "prom.json"))
    )
    result: dict[str, Any] = {}
    coordinators: list[Coordinator] = []

    def serve_run() -> None:
        try:
            result.update(run_coordinator(cfg, opts, run_dir, log=lambda _m: None, attach=coordinators.append))
        except BaseException as e:  # noqa: BLE001 - reported by the test
            result["error"] = e

    runner = threading.Thread(target=serve_run, name="coordinator", daemon=True)
    runner.start()
    sites: list[HandSite] = []
    channel = None
    try:
        url = _wait_for(tmp_path / "prom.json", runner)["url"]
        address = f"127.0.0.1:{_wait_for(tmp_path / 'port.json', runner)['port']}"
        channel = grpc.insecure_channel(address)
        assert health_status(channel) == "SERVING"
        assert health_status(channel, "diloco.v1.Coordinator") == "SERVING"
        start = scrape(url)

        sites = [HandSite(str(i), address, cfg, rounds) for i in range(2)]
        _round(sites, 0)
        one = scrape(url)
        assert sample(one, "diloco_coordinator_rounds_committed_total") == 1 > sample(start, "diloco_coordinator_rounds_committed_total")
        assert sample(one, "diloco_coordinator_pushes_accepted_total") == 2
        assert sample(one, "diloco_coordinator_sites", state="active") == 2
        assert sample(one, "diloco_coordinator_checkpoint_duration_seconds_count") == 0  # no checkpoint_dir
        assert health_status(channel) == "SERVING"

        from grpc_health.v1 import health_pb2, health_pb2_grpc

        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=60)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        _round(sites, 1)
        _round(sites, 2)
        # Every round committed, the sites not gone yet: the coordinator still answers them,
        # and says it serves no more rounds.
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()
        assert health_status(channel) == "NOT_SERVING"
        assert health_status(channel, "diloco.v1.Coordinator") == "NOT_SERVING"
        last = scrape(url)
        assert sample(last, "diloco_coordinator_rounds_committed_total") == rounds
        assert sample(last, "diloco_coordinator_finished") == 1
        assert sample(last, "diloco_coordinator_pushes_accepted_total") == 2 * rounds
        assert sample(last, "diloco_coordinator_sent_bytes_total", method="PullUpdate") > sample(
            one, "diloco_coordinator_sent_bytes_total", method="PullUpdate"
        )

        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
        )
        names = {s.name for s in next(replies).list_services_response.service}
        assert {"diloco.v1.Coordinator", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names

        for s in sites:
            s.leave.set()
        runner.join(60)
        assert not runner.is_alive() and "error" not in result, result.get("error")
    finally:
        # Whatever failed, the sites run their rounds out and leave, and the coordinator ends.
        for s in sites:
            s.leave.set()
            for gate in s.gates:
                gate.set()
        if channel is not None:
            channel.close()
        runner.join(30)
        if runner.is_alive() and coordinators:  # a site broke: stop the coordinator as a failure does
            for listener in list(coordinators[0].on_fatal):
                listener("the test's teardown", RuntimeError("stopped by the test"))
            runner.join(30)
    assert result["rounds_committed"] == rounds
    with pytest.raises(urllib.error.URLError):  # the endpoint stopped with the process
        urllib.request.urlopen(url, timeout=5)

    # TensorBoard: the very lines of metrics.jsonl, by round and by tokens.
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["round"] for m in lines] == list(range(rounds))
    tb = tb_scalars(run_dir / "tb" / "coordinator")
    totals = [sum(m["tokens"] for m in lines[: i + 1]) for i in range(rounds)]
    for tag, key in (
        ("loss/train", "train_loss"),
        ("bytes/up", "bytes_up"),
        ("bytes/down", "bytes_down"),
        ("tokens/round", "tokens"),
        ("norm/update", "update_norm"),
        ("time/round_s", "wall_s"),
    ):
        assert [s for s, _ in tb[tag]] == list(range(rounds)), tag
        assert [v for _, v in tb[tag]] == pytest.approx([m[key] for m in lines], rel=1e-6), tag
        assert [s for s, _ in tb["by_tokens/" + tag]] == totals, tag
        assert [v for _, v in tb["by_tokens/" + tag]] == pytest.approx([m[key] for m in lines], rel=1e-6), tag
    assert [v for _, v in tb["tokens/total"]] == totals
    assert [v for _, v in tb["sites/participants"]] == [2.0] * rounds
    assert "loss/eval" not in tb and "loss/eval_bpb" not in tb  # no evaluation: left out, not zeros


def test_health_needs_no_site_token_and_follows_the_tls_of_the_server(tmp_path: Path) -> None:
    """A probe holds no site token: health answers it; a coordinator call without one is refused."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    creds = tmp_path / "creds"
    write_run_credentials(creds, ["0"], hosts=["localhost", "127.0.0.1"], days=1, force=True)
    store = RunCredentials.at(creds)
    coord = Coordinator(THETA, OuterConfig(), CoordinatorConfig(total_rounds=1, min_sites=1, sites=("0",)))
    for auth in ("token", "both"):
        with served_coordinator(coord, security=SecurityConfig(dir=str(creds), auth=auth)) as address:
            mine = store.site_pem("0") if auth == "both" else None  # mutual TLS: the handshake needs a certificate of the run
            tls = grpc.ssl_channel_credentials(store.ca_pem(), mine.key if mine else None, mine.cert if mine else None)
            with grpc.secure_channel(address, tls) as channel:
                assert health_status(channel) == "SERVING"
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="diloco.v1.Coordinator"), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
                from diloco.transport.pb import coordinator_pb2 as pb
                from diloco.transport.pb import coordinator_pb2_grpc as pb_grpc

                with pytest.raises(grpc.RpcError) as info:
                    pb_grpc.CoordinatorStub(channel).Heartbeat(pb.HeartbeatRequest(site_id="0"), timeout=10)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                # Reflection is off unless switched on.
                from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

                with pytest.raises(grpc.RpcError) as off:
                    next(
                        reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
                        )
                    )
                assert off.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_a_stopping_server_says_not_serving_to_its_watchers() -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    coord = Coordinator(THETA, OuterConfig(), CoordinatorConfig(total_rounds=1, min_sites=1))
    server, port = serve(coord, "127.0.0.1", 0, serving=False)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            assert health_status(channel) == "NOT_SERVING"
            server.set_serving(True)
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=30)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            stopped = server.stop(grace=1.0)
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
            stopped.wait(5)
        finally:
            server.stop(grace=None).wait(5)


# ---- bad input -----------------------------------------------------------------------


def test_a_metrics_port_in_use_fails_the_start_naming_the_port(busy_port: int, tmp_path: Path) -> None:
    from diloco.observe.prom import new_registry
    from diloco.sim.sections import sim_metrics

    with pytest.raises(MetricsEndpointError, match=f"metrics.port={busy_port}: 127.0.0.1:{busy_port} is already in use"):
        serve_metrics(new_registry(), "127.0.0.1", busy_port)
    with pytest.raises(MetricsEndpointError, match=f"metrics.port={busy_port}"):
        check_port_free("127.0.0.1", busy_port)
    cfg = run_config_from_dict({"sites": 1, "rounds": 1, "eval_by": "sites", "sync": {"every": 1}})
    with pytest.raises(ConfigError, match=f"metrics.port={busy_port}: .* already in use"):
        sim_metrics({"port": busy_port}, cfg)
    # The coordinator and a site refuse it when they start, before anything else.
    opts = CoordinatorOptions(port=0, port_file=str(tmp_path / "port.json"), metrics=MetricsConfig(port=busy_port))
    with pytest.raises(MetricsEndpointError, match=f"metrics.port={busy_port}"):
        run_coordinator(cfg, opts, tmp_path / "run", log=lambda _m: None)
    assert not (tmp_path / "port.json").exists()
    with pytest.raises(MetricsEndpointError, match=f"metrics.port={busy_port}"):
        SiteObserver.start("0", TensorBoardConfig(), MetricsConfig(port=busy_port), tmp_path / "run", log=lambda _m: None)
    assert not (tmp_path / "run" / "tb" / "site-0").exists()


@pytest.mark.parametrize(
    ("values", "says"),
    [
        ({"port": -1}, "metrics.port=-1"),
        ({"port": 70000}, "metrics.port=70000"),
        ({"port": "9100"}, "metrics.port='9100'"),
        ({"port": True}, "metrics.port=True"),
        ({"host": ""}, "metrics.host=''"),
        ({"prot": 1}, "unknown config key(s) metrics.prot"),
    ],
)
def test_bad_metrics_settings_are_refused_naming_the_field(values: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError) as info:
        metrics_config(values)
    assert says in str(info.value)


def test_bad_observability_switches_are_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match="tensorboard.enabled='yes'"):
        run_config_from_dict({"tensorboard": {"enabled": "yes"}})
    with pytest.raises(ConfigError, match="unknown config key.*tensorboard.dir"):
        run_config_from_dict({"tensorboard": {"dir": "x"}})
    with pytest.raises(ConfigError, match="coordinator.reflection='no'"):
        CoordinatorOptions(reflection="no")  # type: ignore[arg-type]


def test_switched_off_nothing_is_written_or_served(tmp_path: Path) -> None:
    off = CoordinatorObserver.start(TensorBoardConfig(enabled=False), MetricsConfig(), tmp_path, log=lambda _m: None)
    site = SiteObserver.start("0", TensorBoardConfig(enabled=False), MetricsConfig(), tmp_path, log=lambda _m: None)
    try:
        assert (off.board, off.metrics, off.endpoint, off.line_listeners) == (None, None, None, [])
        assert (site.board, site.metrics, site.endpoint) == (None, None, None)
        site.step(0, 2.0, 1e-3, 0.01, 512)  # nothing on, nothing done
        site.landed(0, {"delta_s": 0.1})
    finally:
        off.close()
        site.close()
    assert not (tmp_path / "tb").exists()
    assert run_config_from_dict({"tensorboard": {"enabled": False}}).tensorboard.enabled is False


# ---- /metrics under the run's security settings -----------------------------------------


def test_metrics_off_loopback_follow_the_runs_security(tmp_path: Path) -> None:
    from diloco.observe.prom import MetricsTLS, metrics_tls

    write_run_credentials(tmp_path / "creds", ["0"], hosts=["localhost", "127.0.0.1"], days=1, force=True)
    store = RunCredentials.at(tmp_path / "creds")
    run = SecurityConfig(dir=str(tmp_path / "creds"))
    # On loopback: plain HTTP, whatever the run's settings.
    for security in (SecurityConfig(), run):
        assert metrics_tls(security, "127.0.0.1", "coordinator") is None and metrics_tls(security, "localhost", "site") is None
    # Off loopback, the coordinator with credentials: HTTPS, a client certificate of the run CA asked even with token auth.
    for auth in ("both", "mtls", "token"):
        tls = metrics_tls(SecurityConfig(dir=str(tmp_path / "creds"), auth=auth), "0.0.0.0", "coordinator")
        assert tls == MetricsTLS(str(store.coordinator_cert), str(store.coordinator_key), str(store.ca_cert))
    # Without credentials, or for a site (no server certificate): refused, unless insecure says plain HTTP is fine.
    for security, process in ((SecurityConfig(), "coordinator"), (run, "site"), (SecurityConfig(), "site")):
        with pytest.raises(MetricsEndpointError, match=r"metrics.host=0.0.0.0: /metrics off loopback would be plain HTTP .*security.insecure=true"):
            metrics_tls(security, "0.0.0.0", process)
        assert metrics_tls(dataclasses.replace(security, insecure=True), "0.0.0.0", process) is None
    missing = SecurityConfig(dir=str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="nowhere"):
        metrics_tls(missing, "0.0.0.0", "coordinator")


def test_metrics_over_https_need_a_client_certificate_of_the_run(tmp_path: Path) -> None:
    from prometheus_client import Counter
    from prometheus_client.parser import text_string_to_metric_families

    from diloco.observe.prom import MetricsTLS, new_registry

    write_run_credentials(tmp_path / "creds", ["0"], hosts=["localhost", "127.0.0.1"], days=1, force=True)
    write_run_credentials(tmp_path / "other", ["0"], hosts=["localhost", "127.0.0.1"], days=1, force=True)
    store, other = RunCredentials.at(tmp_path / "creds"), RunCredentials.at(tmp_path / "other")
    registry = new_registry()
    Counter("diloco_test_rounds", "rounds", registry=registry).inc(3)
    endpoint = serve_metrics(registry, "127.0.0.1", 0, MetricsTLS(str(store.coordinator_cert), str(store.coordinator_key), str(store.ca_cert)))
    try:
        assert endpoint.url == f"https://127.0.0.1:{endpoint.port}/metrics"

        def context(client: RunCredentials | None) -> ssl.SSLContext:
            ctx = ssl.create_default_context(cafile=str(store.ca_cert))
            if client is not None:
                files = client.site_files("0")
                ctx.load_cert_chain(str(files.cert), str(files.key))
            return ctx

        with urllib.request.urlopen(endpoint.url, timeout=10, context=context(store)) as reply:
            families = {f.name: f for f in text_string_to_metric_families(reply.read().decode())}
        assert families["diloco_test_rounds"].samples[0].value == 3
        for client in (None, other):  # no client certificate; one of another run's CA
            with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
                urllib.request.urlopen(endpoint.url, timeout=10, context=context(client)).read()
        with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
            urllib.request.urlopen(endpoint.url.replace("https", "http"), timeout=10).read()  # plain HTTP to a TLS port
    finally:
        endpoint.close()
