"""Measures the WAN link emulator (diloco.sim.wan) against what it was configured with: the
bandwidth a bulk transfer sees at the receiver, each direction, and the round-trip time a small
ping-pong adds over plain loopback; each the median of --repeats runs. docs/wan.md quotes it.

    .venv/bin/python scripts/bench_wan.py                       # the table in docs/wan.md
    .venv/bin/python scripts/bench_wan.py --mbit 10 100 --rtt-ms 40 --seconds 1
    .venv/bin/python scripts/bench_wan.py --segment-ms 1        # try another segment length
"""

from __future__ import annotations

import argparse
import socket
import statistics
import struct
import threading
import time

from diloco.sim import wan
from diloco.sim.links import LinkSpec
from diloco.sim.wan import WanEmulator


class _Server:
    """127.0.0.1:0, one thread per connection; first byte: E echo, S sink (answers the rate it
    received at, as a float Mbit/s), G + u64 n: send n bytes."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            mode = conn.recv(1)
            if mode == b"E":
                while data := conn.recv(65536):
                    conn.sendall(data)
            elif mode == b"S":
                conn.sendall(struct.pack("<d", _receive_mbit(conn)))
            elif mode == b"G":
                n = struct.unpack("<Q", _exactly(conn, 8))[0]
                conn.sendall(bytes(n))

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def _exactly(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        more = sock.recv(n - len(buf))
        if not more:
            raise ConnectionError("closed early")
        buf += more
    return buf


def _receive_mbit(sock: socket.socket) -> float:
    """Reads to EOF; the rate from the first chunk's arrival to the last's (the link's output)."""
    sock.recv(1 << 20)
    first = last = time.monotonic()
    n = 0
    while chunk := sock.recv(1 << 20):
        last = time.monotonic()
        n += len(chunk)
    return n * 8 / max(last - first, 1e-9) / 1e6


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def up_mbit(port: int, nbytes: int) -> float:
    with _connect(port) as s:
        s.sendall(b"S" + bytes(nbytes))
        s.shutdown(socket.SHUT_WR)
        return struct.unpack("<d", _exactly(s, 8))[0]


def down_mbit(port: int, nbytes: int) -> float:
    with _connect(port) as s:
        s.sendall(b"G" + struct.pack("<Q", nbytes))
        return _receive_mbit(s)


def ping_ms(port: int, count: int) -> float:
    with _connect(port) as s:
        s.sendall(b"E")
        times = []
        for i in range(count + 3):
            t0 = time.perf_counter()
            s.sendall(b"x" * 32)
            _exactly(s, 32)
            if i >= 3:  # the first ones pay the connection's handshake round trip
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mbit", type=float, nargs="*", default=[1, 10, 20, 40, 100, 200, 500, 1000])
    p.add_argument("--rtt-ms", type=float, nargs="*", default=[1, 5, 10, 40, 100])
    p.add_argument("--seconds", type=float, default=1.5, help="length of each bulk transfer")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--segment-ms", type=float, default=wan.SEGMENT_S * 1e3, help="wan.SEGMENT_S, ms")
    args = p.parse_args()
    wan.SEGMENT_S = args.segment_ms / 1e3
    server = _Server()
    links = {f"bw{m:g}": LinkSpec(up_mbit=m, down_mbit=m) for m in args.mbit}
    links |= {f"rtt{r:g}": LinkSpec(rtt_ms=r) for r in args.rtt_ms}
    links |= {"none": LinkSpec()}
    print(f"segment {args.segment_ms:g} ms; medians of {args.repeats} runs")
    try:
        with WanEmulator(("127.0.0.1", server.port), links) as em:
            ports = em.stats()
            print(f"{'configured':>12} {'up Mbit/s':>10} {'err':>7} {'down Mbit/s':>11} {'err':>7}")
            for m in args.mbit:
                port, nbytes = ports[f"bw{m:g}"]["port"], int(m * 1e6 / 8 * args.seconds)
                up = statistics.median(up_mbit(port, nbytes) for _ in range(args.repeats))
                down = statistics.median(down_mbit(port, nbytes) for _ in range(args.repeats))
                print(f"{m:>7g} Mbit {up:>10.2f} {100 * (up / m - 1):>+6.2f}% {down:>11.2f} {100 * (down / m - 1):>+6.2f}%")
            none = ports["none"]["port"]
            nbytes = int(125e6 * args.seconds)
            free_up = statistics.median(up_mbit(none, nbytes) for _ in range(args.repeats))
            free_down = statistics.median(down_mbit(none, nbytes) for _ in range(args.repeats))
            print(f"{'unlimited':>12} {free_up:>10.0f} {'':>7} {free_down:>11.0f}")
            print(f"\n{'configured':>12} {'added RTT ms':>12} {'err ms':>7}   (loopback baseline subtracted)")
            for r in [0.0, *args.rtt_ms]:
                port = ports["none" if r == 0 else f"rtt{r:g}"]["port"]
                count = max(20, min(200, int(2000 / max(r, 1))))
                added = []
                for _ in range(args.repeats):
                    base = ping_ms(server.port, 200)
                    added.append(ping_ms(port, count) - base)
                m = statistics.median(added)
                print(f"{r:>9g} ms {m:>12.3f} {m - r:>+7.3f}")
    finally:
        server.close()


if __name__ == "__main__":
    main()
