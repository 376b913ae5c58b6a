"""The WAN link emulator (diloco.sim.wan) measured on real sockets: its link specs, the bandwidth
within 5% of the configured rate both ways, the round-trip time within 2 ms, jitter that keeps
byte order, the coordinator's link shared by every site, windows and the handshake. A
measurement that misses is taken twice more and the median judged (the machine is shared);
the tolerances are the spec's and nothing else is timed."""

from __future__ import annotations

import statistics
import struct
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from wan_endpoints import RETRY_PAUSE_S, Upstream, connect, download, judged, ping_ms, rate_mbit, upload, wait_until, wan_process

from diloco.sim.links import LinkSpec
from diloco.sim.wan import WanEmulator, emulator_from_spec

pytestmark = pytest.mark.timeout(60)


# --- LinkSpec -----------------------------------------------------------------------------


def test_link_spec_from_dict_and_its_errors_name_the_field() -> None:
    spec = LinkSpec.from_dict({"bandwidth_mbit": 100, "down_mbit": 50, "rtt_ms": 40}, "wan")
    assert spec == LinkSpec(up_mbit=100.0, down_mbit=50.0, rtt_ms=40.0, jitter_ms=0.0)
    assert LinkSpec.from_dict(spec.to_dict(), "wan") == spec
    assert LinkSpec.from_dict({}, "wan") == LinkSpec()
    bad = {
        "wan.up_mbit=0": {"up_mbit": 0},
        "wan.bandwidth_mbit=-1": {"bandwidth_mbit": -1},
        "wan.rtt_ms=nan": {"rtt_ms": float("nan")},
        "wan.jitter_ms=-1": {"jitter_ms": -1},
        "wan.window_kb=0": {"window_kb": 0},
        "wan.down_mbit='fast'": {"down_mbit": "fast"},
        "wan.rtt_ms=True": {"rtt_ms": True},
        "unknown key(s) bandwidth, latency_ms": {"bandwidth": 1, "latency_ms": 2},
    }
    for message, d in bad.items():
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            LinkSpec.from_dict(d, "wan")
    assert LinkSpec(up_mbit=0).problem("sites.3") == "sites.3.up_mbit=0: must be a finite number > 0 (or null: unlimited)"
    with pytest.raises(ValueError, match="coordinator.rtt_ms=-5"):
        WanEmulator(("127.0.0.1", 1), {"a": LinkSpec()}, LinkSpec(rtt_ms=-5))
    with pytest.raises(ValueError, match="spec.upstream / spec.upstream_port_file"):
        emulator_from_spec({"links": {"a": {}}})
    with pytest.raises(ValueError, match="spec: unknown key"):
        emulator_from_spec({"upstream": {"host": "127.0.0.1", "port": 1}, "links": {"a": {}}, "link": {}})


# --- bandwidth, RTT, jitter -------------------------------------------------------------------

# (link, direction, configured Mbit/s, bytes: about 1.5 s at that rate)
BULK = [("slow", "up", 20.0, 3_750_000), ("slow", "down", 40.0, 7_500_000), ("fast", "up", 100.0, 18_750_000), ("fast", "down", 100.0, 18_750_000)]


@pytest.mark.parametrize(("link", "direction", "mbit", "nbytes"), BULK, ids=[f"{b[0]}-{b[1]}" for b in BULK])
def test_bandwidth_within_5_percent_both_ways(upstream: Upstream, emulate: Callable[..., Any], link: str, direction: str, mbit: float, nbytes: int) -> None:
    _, ports = emulate(("127.0.0.1", upstream.port), {"slow": LinkSpec(up_mbit=20, down_mbit=40), "fast": LinkSpec(up_mbit=100, down_mbit=100)})
    transfer = upload if direction == "up" else download
    measured, tries = judged(lambda: rate_mbit([transfer(ports[link], nbytes)]), mbit, 0.05 * mbit)
    assert abs(measured - mbit) <= 0.05 * mbit, f"{link} {direction}: {measured:.2f} Mbit/s measured (tries {tries}), {mbit} configured"


def test_rtt_within_2_ms(upstream: Upstream, emulate: Callable[..., Any]) -> None:
    links = {"r10": LinkSpec(rtt_ms=10), "r40": LinkSpec(rtt_ms=40), "r40_shaped": LinkSpec(up_mbit=20, down_mbit=40, rtt_ms=40), "none": LinkSpec()}
    _, ports = emulate(("127.0.0.1", upstream.port), links)
    for name, count in (("r10", 60), ("r40", 25), ("r40_shaped", 25), ("none", 100)):
        configured = links[name].rtt_ms

        def added(name: str = name, count: int = count) -> float:
            baseline = ping_ms(upstream.port, 100)
            return ping_ms(ports[name], count) - baseline

        measured, tries = judged(added, configured, 2.0)
        assert abs(measured - configured) <= 2.0, f"{name}: {measured:.2f} ms added (tries {tries}), {configured} configured"


def test_jitter_keeps_byte_order_and_adds_delay_within_its_range(upstream: Upstream, tmp_path: Path) -> None:
    """Records sent every 4 ms on two links at once, one with jitter, one without (the control:
    what the machine itself adds, several ms in the tail when it is busy). The emulator runs as
    its own process, as in the simulation: in this one its thread and the test's would take
    turns on the GIL, which is what a one-way timing sees."""
    links = {"jitter": {"rtt_ms": 20, "jitter_ms": 10}, "control": {"rtt_ms": 20}}
    spec = {"upstream": {"host": "127.0.0.1", "port": upstream.port}, "links": links, "seed": 7}
    first = {"jitter": 0, "control": 10_000}  # the records' sequence numbers tell the links apart
    with wan_process(tmp_path, spec) as (_, ports):

        def one_way_ms() -> dict[str, list[float]]:
            upstream.records.clear()
            socks = {name: connect(ports[name]) for name in links}
            try:
                for s in socks.values():
                    s.sendall(b"T")
                time.sleep(0.05)  # past the connections' handshake round trip
                for i in range(120):
                    for name, s in socks.items():
                        s.sendall(struct.pack("<Qd", first[name] + i, time.monotonic()))
                    time.sleep(0.004)
            finally:
                for s in socks.values():
                    s.close()
            assert wait_until(lambda: len(upstream.records) == 240)
            out = {}
            for name in links:
                mine = [r for r in upstream.records if first[name] <= r[0] < first[name] + 120]
                assert [r[0] - first[name] for r in mine] == list(range(120)), f"{name}: segments arrived out of order"
                out[name] = [(recv - sent) * 1e3 for _, sent, recv in mine]
            return out

        def beyond_control(run: dict[str, list[float]]) -> float:
            return _p95(run["jitter"]) - _p95(run["control"])

        # rtt/2 = 10 ms plus a jitter in [0, 10] ms; keeping the order can delay a segment only
        # up to the jitter of one sent before it, still within the range. 2 ms: the RTT tolerance.
        runs = [one_way_ms()]
        for _ in range(2 if beyond_control(runs[0]) > 10.0 + 2.0 else 0):
            time.sleep(RETRY_PAUSE_S)
            runs.append(one_way_ms())
    assert min(min(r["jitter"]) for r in runs) >= 10.0, "a segment arrived before rtt/2"
    added = statistics.median(beyond_control(r) for r in runs)
    assert added <= 10.0 + 2.0, f"jitter added {added:.2f} ms to the 95th percentile (runs: {[round(beyond_control(r), 2) for r in runs]}), [0, 10] configured"
    spread = statistics.median(statistics.median(r["jitter"]) - statistics.median(r["control"]) for r in runs)
    assert spread >= 2.0, f"no jitter was applied: the median one-way delay moved {spread:.2f} ms"


def _p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20)[-1]


def test_the_coordinator_link_is_shared_by_every_site(upstream: Upstream, emulate: Callable[..., Any]) -> None:
    """Two sites at 100 Mbit/s behind a coordinator that receives at 20 and sends at 30 Mbit/s
    move 20 and 30 Mbit/s together (the naming: the coordinator's up is what it sends)."""
    sites = {"a": LinkSpec(up_mbit=100, down_mbit=100), "b": LinkSpec(up_mbit=100, down_mbit=100)}
    _, ports = emulate(("127.0.0.1", upstream.port), sites, LinkSpec(up_mbit=30, down_mbit=20))

    def together(transfer: Callable[[int, int], dict[str, Any]], nbytes: int) -> float:
        with ThreadPoolExecutor(2) as pool:
            reports = list(pool.map(lambda port: transfer(port, nbytes), [ports["a"], ports["b"]]))
        return rate_mbit(reports)

    up, up_tries = judged(lambda: together(upload, 2_000_000), 20.0, 1.0)
    down, down_tries = judged(lambda: together(download, 3_000_000), 30.0, 1.5)
    assert abs(up - 20.0) <= 1.0, f"sites -> coordinator together: {up:.2f} Mbit/s (tries {up_tries}), 20 configured"
    assert abs(down - 30.0) <= 1.5, f"coordinator -> sites together: {down:.2f} Mbit/s (tries {down_tries}), 30 configured"


def test_connections_of_one_link_share_its_bandwidth(upstream: Upstream, emulate: Callable[..., Any]) -> None:
    """A site's striped streams are several connections: together they get the link's rate."""
    _, ports = emulate(("127.0.0.1", upstream.port), {"a": LinkSpec(up_mbit=20, down_mbit=20)})

    def together() -> float:
        with ThreadPoolExecutor(2) as pool:
            return rate_mbit(list(pool.map(lambda seed: upload(ports["a"], 1_900_000, seed), [1, 2])))

    measured, tries = judged(together, 20.0, 1.0)
    assert abs(measured - 20.0) <= 1.0, f"two connections of one link together: {measured:.2f} Mbit/s (tries {tries}), 20 configured"


def test_a_window_limits_each_connection_and_not_the_link(upstream: Upstream, emulate: Callable[..., Any]) -> None:
    """window_kb: one connection carries at most window / RTT (here 256 KiB per 100 ms: 21.0
    Mbit/s of a 100 Mbit/s link); four connections carry four windows."""
    link = LinkSpec(up_mbit=100, down_mbit=100, rtt_ms=100, window_kb=256)
    _, ports = emulate(("127.0.0.1", upstream.port), {"a": link})
    per_connection = 256 * 1024 * 8 / 0.100 / 1e6

    def streams(k: int) -> float:
        with ThreadPoolExecutor(k) as pool:
            return rate_mbit(list(pool.map(lambda seed: upload(ports["a"], 2_000_000, seed), range(1, k + 1))))

    one, one_tries = judged(lambda: streams(1), per_connection, 0.05 * per_connection)
    assert abs(one - per_connection) <= 0.05 * per_connection, f"one connection: {one:.2f} Mbit/s (tries {one_tries}), window/RTT {per_connection:.2f}"
    four, four_tries = judged(lambda: streams(4), 4 * per_connection, 0.05 * 4 * per_connection)
    assert abs(four - 4 * per_connection) <= 0.05 * 4 * per_connection, (
        f"four connections: {four:.2f} Mbit/s (tries {four_tries}), 4 windows/RTT {4 * per_connection:.2f}"
    )


def test_a_new_connection_pays_the_handshake_round_trip(upstream: Upstream, emulate: Callable[..., Any]) -> None:
    _, ports = emulate(("127.0.0.1", upstream.port), {"a": LinkSpec(rtt_ms=40)})
    t0 = time.monotonic()
    with connect(ports["a"]) as s:
        s.sendall(b"Ex")
        assert s.recv(1) == b"x"
    # TCP's handshake (one round trip) before the first byte leaves, then its own round trip.
    assert time.monotonic() - t0 >= 2 * 0.040
