"""Endpoints for measuring the WAN emulator on real sockets (tests/integration/test_wan*.py): an
upstream server that answers uploads, downloads and pings with what it saw, the clients that
drive it, and the median-of-three judgement a missed measurement gets."""

from __future__ import annotations

import hashlib
import json
import random
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

RETRY_PAUSE_S = 2.0
REPO = Path(__file__).resolve().parents[1]


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
                    conn.sendall(json.dumps(receive_report(conn, rest)).encode())
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


def receive_report(sock: socket.socket, first: bytes = b"") -> dict[str, Any]:
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


def connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def upload(port: int, nbytes: int, seed: int = 1) -> dict[str, Any]:
    """Sends nbytes through ``port`` to the sink; its report, checked against what was sent."""
    data = random.Random(seed).randbytes(nbytes)
    with connect(port) as s:
        s.sendall(b"S" + data)
        s.shutdown(socket.SHUT_WR)
        report = read_json(s)
    assert report["n"] == nbytes and report["sha256"] == hashlib.sha256(data).hexdigest(), "the bytes that arrived are not the bytes sent"
    return report


def read_json(s: socket.socket) -> dict[str, Any]:
    return json.loads(b"".join(iter(lambda: s.recv(65536), b"")))


def download(port: int, nbytes: int, seed: int = 2) -> dict[str, Any]:
    with connect(port) as s:
        s.sendall(b"G" + struct.pack("<QQ", nbytes, seed))
        report = receive_report(s)
    assert report["n"] == nbytes and report["sha256"] == hashlib.sha256(random.Random(seed).randbytes(nbytes)).hexdigest()
    return report


def rate_mbit(reports: list[dict[str, Any]]) -> float:
    """The rate the receiver saw, Mbit/s: bytes after each first chunk over the whole window."""
    window = max(r["last"] for r in reports) - min(r["first"] for r in reports)
    return sum(r["after_first"] for r in reports) * 8 / window / 1e6


def judged(measure: Callable[[], float], expected: float, tolerance: float) -> tuple[float, list[float]]:
    """One measurement, or the median of three if the first misses (a busy machine: other
    processes' bursts last seconds, hence the pause before each retry)."""
    got = [measure()]
    for _ in range(2 if abs(got[0] - expected) > tolerance else 0):
        time.sleep(RETRY_PAUSE_S)
        got.append(measure())
    return statistics.median(got), got


def ping_ms(port: int, count: int, warmup: int = 3) -> float:
    """Median round trip of a 32-byte message to the echo server, ms."""
    msg, times = b"x" * 32, []
    with connect(port) as s:
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


def wait_until(pred: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


@contextmanager
def wan_process(tmp_path: Path, spec: dict[str, Any]) -> Iterator[tuple[subprocess.Popen[str], dict[str, int]]]:
    """``python -m diloco.sim.wan`` with this spec, once listening (stats to tmp_path/stats.json);
    killed at the end if it still runs."""
    spec_file, ports_out = tmp_path / "spec.json", tmp_path / "ports.json"
    ports_out.unlink(missing_ok=True)
    write_json(spec_file, spec)
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
