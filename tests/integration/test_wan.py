"""The WAN link emulator (diloco.sim.wan) measured on real sockets: the bandwidth within 5% of
the configured rate both ways, the round-trip time within 2 ms, jitter that keeps byte order,
the coordinator's link shared by every site, the process entry point, and a gRPC call through
it. A measurement that misses is taken twice more and the median judged (the machine is
shared); the tolerances are the spec's and nothing else is timed."""

from __future__ import annotations

import hashlib
import json
import random
import signal
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from diloco.sim.links import LinkSpec
from diloco.sim.wan import WanEmulator, emulator_from_spec

pytestmark = pytest.mark.timeout(60)
RETRY_PAUSE_S = 2.0
REPO = Path(__file__).resolve().parents[2]


class Upstream:
    """A TCP server on 127.0.0.1:0 standing in for the coordinator, one thread per connection.
    The first byte says what to do: ``E`` echo; ``S`` sink: read to EOF, answer with the bytes'
    sha256 and when they came (JSON); ``G`` + n + seed (two u64): send n seeded bytes and close;
    ``T``: read 16-byte records (u64 seq, f64 send time) and keep their arrival times; ``I``:
    answer with the server's name; ``R``: reset the connection after the first read."""

    def __init__(self, name: str = "up") -> None:
        self.name = name
        self.records: list[tuple[int, float, float]] = []
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._conns.append(conn)
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        try:
            with conn:
                first = conn.recv(65536)
                if not first:
                    return
                mode, rest = first[:1], first[1:]
                if mode == b"E":
                    while rest := rest or conn.recv(65536):
                        conn.sendall(rest)
                        rest = b""
                elif mode == b"S":
                    conn.sendall(json.dumps(_receive(conn, rest)).encode())
                elif mode == b"G":
                    while len(rest) < 16:
                        rest += conn.recv(16 - len(rest))
                    n, seed = struct.unpack("<QQ", rest[:16])
                    conn.sendall(random.Random(seed).randbytes(n))
                elif mode == b"T":
                    self._timestamps(conn, rest)
                elif mode == b"I":
                    conn.sendall(self.name.encode())
                elif mode == b"R":
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass

    def _timestamps(self, conn: socket.socket, buf: bytes) -> None:
        while True:
            while len(buf) >= 16:
                seq, sent = struct.unpack("<Qd", buf[:16])
                self.records.append((seq, sent, time.monotonic()))
                buf = buf[16:]
            more = conn.recv(65536)
            if not more:
                return
            buf += more

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept(); close() alone does not
        except OSError:
            pass
        self._sock.close()
        for conn in self._conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(5)


def _receive(sock: socket.socket, first: bytes = b"") -> dict[str, Any]:
    """Reads to EOF: sha256, size, and the rate from the first chunk's arrival to the last's."""
    h, n, after_first = hashlib.sha256(first), len(first), 0
    t_first = t_last = time.monotonic()
    if not first:
        first = sock.recv(1 << 20)
        t_first = t_last = time.monotonic()
        h.update(first)
        n = len(first)
    while chunk := sock.recv(1 << 20):
        t_last = time.monotonic()
        h.update(chunk)
        n += len(chunk)
        after_first += len(chunk)
    return {"sha256": h.hexdigest(), "n": n, "first": t_first, "last": t_last, "after_first": after_first}


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _upload(port: int, nbytes: int, seed: int = 1) -> dict[str, Any]:
    """Sends nbytes through ``port`` to the sink; its report, checked against what was sent."""
    data = random.Random(seed).randbytes(nbytes)
    with _connect(port) as s:
        s.sendall(b"S" + data)
        s.shutdown(socket.SHUT_WR)
        report = _read_json(s)
    assert report["n"] == nbytes and report["sha256"] == hashlib.sha256(data).hexdigest(), "the bytes that arrived are not the bytes sent"
    return report


def _read_json(s: socket.socket) -> dict[str, Any]:
    return json.loads(b"".join(iter(lambda: s.recv(65536), b"")))


def _download(port: int, nbytes: int, seed: int = 2) -> dict[str, Any]:
    with _connect(port) as s:
        s.sendall(b"G" + struct.pack("<QQ", nbytes, seed))
        report = _receive(s)
    assert report["n"] == nbytes and report["sha256"] == hashlib.sha256(random.Random(seed).randbytes(nbytes)).hexdigest()
    return report


def _mbit(reports: list[dict[str, Any]]) -> float:
    """The rate the receiver saw, Mbit/s: bytes after each first chunk over the whole window."""
    window = max(r["last"] for r in reports) - min(r["first"] for r in reports)
    return sum(r["after_first"] for r in reports) * 8 / window / 1e6


def _judged(measure: Callable[[], float], expected: float, tolerance: float) -> tuple[float, list[float]]:
    """One measurement, or the median of three if the first misses (a busy machine: other
    processes' bursts last seconds, hence the pause before each retry)."""
    got = [measure()]
    for _ in range(2 if abs(got[0] - expected) > tolerance else 0):
        time.sleep(RETRY_PAUSE_S)
        got.append(measure())
    return statistics.median(got), got


def _ping_ms(port: int, count: int, warmup: int = 3) -> float:
    """Median round trip of a 32-byte message to the echo server, ms."""
    msg, times = b"x" * 32, []
    with _connect(port) as s:
        s.sendall(b"E")
        for i in range(warmup + count):
            t0 = time.perf_counter()
            s.sendall(msg)
            got = b""
            while len(got) < len(msg):
                more = s.recv(len(msg) - len(got))
                assert more, "the connection closed"
                got += more
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    server = Upstream()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def emulate() -> Iterator[Callable[..., tuple[WanEmulator, dict[str, int]]]]:
    """Starts emulators; every one is stopped when the test ends, however it ends."""
    started: list[WanEmulator] = []

    def start(*args: Any, **kwargs: Any) -> tuple[WanEmulator, dict[str, int]]:
        em = WanEmulator(*args, **kwargs)
        started.append(em)
        return em, em.start()

    try:
        yield start
    finally:
        for em in started:
            em.stop()


def _wait(pred: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


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
    transfer = _upload if direction == "up" else _download
    measured, tries = _judged(lambda: _mbit([transfer(ports[link], nbytes)]), mbit, 0.05 * mbit)
    assert abs(measured - mbit) <= 0.05 * mbit, f"{link} {direction}: {measured:.2f} Mbit/s measured (tries {tries}), {mbit} configured"


def test_rtt_within_2_ms(upstream: Upstream, emulate: Callable[..., Any]) -> None:
    links = {"r10": LinkSpec(rtt_ms=10), "r40": LinkSpec(rtt_ms=40), "r40_shaped": LinkSpec(up_mbit=20, down_mbit=40, rtt_ms=40), "none": LinkSpec()}
    _, ports = emulate(("127.0.0.1", upstream.port), links)
    for name, count in (("r10", 60), ("r40", 25), ("r40_shaped", 25), ("none", 100)):
        configured = links[name].rtt_ms

        def added(name: str = name, count: int = count) -> float:
            baseline = _ping_ms(upstream.port, 100)
            return _ping_ms(ports[name], count) - baseline

        measured, tries = _judged(added, configured, 2.0)
        assert abs(measured - configured) <= 2.0, f"{name}: {measured:.2f} ms added (tries {tries}), {configured} configured"


def test_jitter_keeps_byte_order_and_adds_delay_within_its_range(upstream: Upstream, tmp_path: Path) -> None:
    """Records sent every 4 ms on two links at once, one with jitter, one without (the control:
    what the machine itself adds, several ms in the tail when it is busy). The emulator runs as
    its own process, as in the simulation: in this one its thread and the test's would take
    turns on the GIL, which is what a one-way timing sees."""
    links = {"jitter": {"rtt_ms": 20, "jitter_ms": 10}, "control": {"rtt_ms": 20}}
    spec = {"upstream": {"host": "127.0.0.1", "port": upstream.port}, "links": links, "seed": 7}
    first = {"jitter": 0, "control": 10_000}  # the records' sequence numbers tell the links apart
    with _wan_process(tmp_path, spec) as (_, ports):

        def one_way_ms() -> dict[str, list[float]]:
            upstream.records.clear()
            socks = {name: _connect(ports[name]) for name in links}
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
            assert _wait(lambda: len(upstream.records) == 240)
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
        return _mbit(reports)

    up, up_tries = _judged(lambda: together(_upload, 2_000_000), 20.0, 1.0)
    down, down_tries = _judged(lambda: together(_download, 3_000_000), 30.0, 1.5)
    assert abs(up - 20.0) <= 1.0, f"sites -> coordinator together: {up:.2f} Mbit/s (tries {up_tries}), 20 configured"
    assert abs(down - 30.0) <= 1.5, f"coordinator -> sites together: {down:.2f} Mbit/s (tries {down_tries}), 30 configured"


def test_connections_of_one_link_share_its_bandwidth(upstream: Upstream, emulate: Callable[..., Any]) -> None:
    """A site's striped streams are several connections: together they get the link's rate."""
    _, ports = emulate(("127.0.0.1", upstream.port), {"a": LinkSpec(up_mbit=20, down_mbit=20)})

    def together() -> float:
        with ThreadPoolExecutor(2) as pool:
            return _mbit(list(pool.map(lambda seed: _upload(ports["a"], 1_900_000, seed), [1, 2])))

    measured, tries = _judged(together, 20.0, 1.0)
    assert abs(measured - 20.0) <= 1.0, f"two connections of one link together: {measured:.2f} Mbit/s (tries {tries}), 20 configured"


def test_a_window_limits_each_connection_and_not_the_link(upstream: Upstream, emulate: Callable[..., Any]) -> None:
    """window_kb: one connection carries at most window / RTT (here 256 KiB per 100 ms: 21.0
    Mbit/s of a 100 Mbit/s link); four connections carry four windows."""
    link = LinkSpec(up_mbit=100, down_mbit=100, rtt_ms=100, window_kb=256)
    _, ports = emulate(("127.0.0.1", upstream.port), {"a": link})
    per_connection = 256 * 1024 * 8 / 0.100 / 1e6

    def streams(k: int) -> float:
        with ThreadPoolExecutor(k) as pool:
            return _mbit(list(pool.map(lambda seed: _upload(ports["a"], 2_000_000, seed), range(1, k + 1))))

    one, one_tries = _judged(lambda: streams(1), per_connection, 0.05 * per_connection)
    assert abs(one - per_connection) <= 0.05 * per_connection, f"one connection: {one:.2f} Mbit/s (tries {one_tries}), window/RTT {per_connection:.2f}"
    four, four_tries = _judged(lambda: streams(4), 4 * per_connection, 0.05 * 4 * per_connection)
    assert abs(four - 4 * per_connection) <= 0.05 * 4 * per_connection, f"four connections: {four:.2f} Mbit/s (tries {four_tries}), 4 windows/RTT {4 * per_connection:.2f}"


def test_a_new_connection_pays_the_handshake_round_trip(upstream: Upstream, emulate: Callable[..., Any]) -> None:
    _, ports = emulate(("127.0.0.1", upstream.port), {"a": LinkSpec(rtt_ms=40)})
    t0 = time.monotonic()
    with _connect(ports["a"]) as s:
        s.sendall(b"Ex")
        assert s.recv(1) == b"x"
    # TCP's handshake (one round trip) before the first byte leaves, then its own round trip.
    assert time.monotonic() - t0 >= 2 * 0.040


def test_pass_through_keeps_every_byte(upstream: Upstream, emulate: Callable[..., Any]) -> None:
    _, ports = emulate(("127.0.0.1", upstream.port), {"free": LinkSpec()})
    _upload(ports["free"], 8_000_000)
    _download(ports["free"], 8_000_000)


# --- closing and failures ---------------------------------------------------------------------


def test_resets_refusals_and_stop_leave_nothing_open(upstream: Upstream, emulate: Callable[..., Any]) -> None:
    dead = socket.create_server(("127.0.0.1", 0))
    dead_port = dead.getsockname()[1]
    dead.close()
    target = {"port": dead_port}
    em, ports = emulate(lambda: ("127.0.0.1", target["port"]), {"a": LinkSpec(up_mbit=20, rtt_ms=10)})
    # An upstream that refuses: the accepted connection is closed.
    with _connect(ports["a"]) as s:
        s.sendall(b"E")
        assert _recv_or_reset(s) == b""
    target["port"] = upstream.port
    # A client that resets mid-transfer, and an upstream that resets.
    s = _connect(ports["a"])
    s.sendall(b"E" + b"x" * 200_000)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()
    with _connect(ports["a"]) as s:
        s.sendall(b"R" + b"y" * 1000)
        assert _recv_or_reset(s) == b""
    assert _wait(lambda: em.stats()["a"]["open"] == 0), em.stats()
    stats = em.stats()["a"]
    assert stats["connections"] == 3 and stats["upstream_failures"] == 1 and stats["errors"] == 0
    # Still forwarding, and stop() closes a connection still open.
    s = _connect(ports["a"])
    s.sendall(b"Ehello")
    assert s.recv(5) == b"hello"
    em.stop()
    em.stop()
    assert _recv_or_reset(s) == b""
    s.close()
    assert em.stats()["a"]["open"] == 0


def _recv_or_reset(s: socket.socket) -> bytes:
    try:
        return b"".join(iter(lambda: s.recv(65536), b""))
    except ConnectionResetError:
        return b""


def test_half_close_delivers_the_answer_after_the_request_ends(upstream: Upstream, emulate: Callable[..., Any]) -> None:
    _, ports = emulate(("127.0.0.1", upstream.port), {"a": LinkSpec(up_mbit=50, down_mbit=50, rtt_ms=10, jitter_ms=2)})
    report = _upload(ports["a"], 300_000)  # the sink answers only after it saw our EOF
    assert report["n"] == 300_000


# --- the process ------------------------------------------------------------------------------


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


@contextmanager
def _wan_process(tmp_path: Path, spec: dict[str, Any]) -> Iterator[tuple[subprocess.Popen[str], dict[str, int]]]:
    """``python -m diloco.sim.wan`` with this spec, once listening (stats to tmp_path/stats.json);
    killed at the end if it still runs."""
    spec_file, ports_out = tmp_path / "spec.json", tmp_path / "ports.json"
    ports_out.unlink(missing_ok=True)
    _write_json(spec_file, spec)
    cmd = [sys.executable, "-m", "diloco.sim.wan", "--spec", str(spec_file), "--ports-out", str(ports_out), "--stats-out", str(tmp_path / "stats.json")]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while not ports_out.exists():
            assert proc.poll() is None, proc.communicate()[1]
            time.sleep(0.02)
        yield proc, json.loads(ports_out.read_text())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_main_follows_the_port_file_stops_on_sigterm_and_writes_stats(tmp_path: Path) -> None:
    one, two = Upstream("one"), Upstream("two")
    port_file = tmp_path / "coordinator.port.json"
    _write_json(port_file, {"host": "127.0.0.1", "port": one.port})
    spec = {"upstream_port_file": str(port_file), "links": {"site0": {"bandwidth_mbit": 50, "rtt_ms": 10}}, "coordinator": None, "seed": 3}
    try:
        with _wan_process(tmp_path, spec) as (proc, ports):
            assert _ask_name(ports["site0"]) == "one"
            one.close()  # the coordinator restarts elsewhere: first gone, then its new port written
            assert _ask_name(ports["site0"]) == ""
            _write_json(port_file, {"host": "127.0.0.1", "port": two.port})
            assert _ask_name(ports["site0"]) == "two"
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=20)
            assert proc.returncode == 0, err
    finally:
        one.close()
        two.close()
    stats = json.loads((tmp_path / "stats.json").read_text())["site0"]
    assert stats["connections"] == 3 and stats["upstream_failures"] == 1 and stats["bytes_down"] == 6 and stats["open"] == 0


def _ask_name(port: int) -> str:
    with _connect(port) as s:
        s.sendall(b"I")
        return _recv_or_reset(s).decode()


def test_main_refuses_a_bad_spec_naming_the_field(tmp_path: Path) -> None:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"upstream": {"host": "127.0.0.1", "port": 1}, "links": {"site0": {"up_mbit": 0}}}))
    cmd = [sys.executable, "-m", "diloco.sim.wan", "--spec", str(spec), "--ports-out", str(tmp_path / "ports.json")]
    done = subprocess.run(cmd, check=False, cwd=REPO, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "spec.links.site0.up_mbit=0" in done.stderr, done.stderr
    assert not (tmp_path / "ports.json").exists()


# --- gRPC -------------------------------------------------------------------------------------


def test_a_grpc_call_goes_through_the_link(emulate: Callable[..., Any]) -> None:
    grpc = pytest.importorskip("grpc")
    server = grpc.server(ThreadPoolExecutor(2), options=[("grpc.max_receive_message_length", 8 << 20)])
    echo = grpc.unary_unary_rpc_method_handler(lambda request, _context: request)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("wan.Echo", {"Echo": echo})])
    upstream_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = None
    try:
        em, ports = emulate(("127.0.0.1", upstream_port), {"site0": LinkSpec(up_mbit=50, down_mbit=50, rtt_ms=20)})
        channel = grpc.insecure_channel(f"127.0.0.1:{ports['site0']}", options=[("grpc.max_receive_message_length", 8 << 20)])
        call = channel.unary_unary("/wan.Echo/Echo")
        payload = random.Random(5).randbytes(1_000_000)
        assert call(b"ping", timeout=20) == b"ping"
        t0 = time.monotonic()
        assert call(payload, timeout=20) == payload
        # 1 MB each way at 50 Mbit/s cannot take less than 0.32 s: the link really shaped it.
        assert time.monotonic() - t0 >= 2 * len(payload) * 8 / 50e6
        stats = em.stats()["site0"]
        assert stats["bytes_up"] > len(payload) and stats["bytes_down"] > len(payload)
    finally:
        if channel is not None:
            channel.close()
        server.stop(grace=None).wait(5)
