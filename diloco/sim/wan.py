"""WAN link emulator: a shaping TCP proxy between the simulation's sites and its coordinator.

On 127.0.0.1 every byte arrives at once, so a local run says nothing about what a slow or far
link costs. Each site instead calls its own listening port here; each connection accepted
there is forwarded to the coordinator through an emulated link with a bandwidth per
direction, a round-trip time and jitter (and, optionally, through one more link shared by
every site: the coordinator's own). The training code never sleeps: the real gRPC byte
streams (TLS included: this is plain TCP, the bytes pass untouched) are what gets delayed.

The model, per link and direction, is a FIFO transmitter (the "wire") shared by every
connection of that link: a segment of n bytes read from a socket departs when the wire is
free, ``depart = max(ready, next_free)``, occupies it for ``n * 8 / bandwidth`` seconds, and
arrives ``rtt / 2`` (plus a jitter uniform in ``[0, jitter]``) after its last byte left, but
never before the previous segment of its connection and direction (byte order is kept). A hop
takes the next segment only once the current one has left (a socket is read at most ~50 ms
ahead), so what is in flight stays near bandwidth x delay and the sender feels back-pressure
from its socket buffer, as behind a real bottleneck. A new connection carries no byte before one round trip has passed (TCP's
handshake). docs/wan.md: the limits of this model and its measured accuracy. The path a byte
takes (wires, hops, sockets, the carrying tasks) is diloco.sim.wan_path; the event loop's
precise timers, diloco.sim.wan_clock; this module runs them per link and connection.

Command line (the simulation starts it as a process)::

    python -m diloco.sim.wan --spec SPEC.json --ports-out PORTS.json [--stats-out STATS.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import socket
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Self

from diloco.io import write_json_atomic
from diloco.sim.links import LinkSpec
from diloco.sim.wan_clock import ask_for_short_slices, new_loop
from diloco.sim.wan_path import MAX_READ_AHEAD, MIN_READ_AHEAD, Hop, Pipe, Side, Source, Window, Wire, carry, deliver, link_hops

Address = tuple[str, int]

# A segment is about this long on the wire: short enough that the rate is smooth at the scale
# of a few ms (and a small message never waits behind a long segment), long enough that the
# per-segment Python work stays small next to it (docs/wan.md: what was measured).
SEGMENT_S = 0.002
MIN_SEGMENT = 4 * 1024
MAX_SEGMENT = 256 * 1024
# What a socket may have received that no segment took yet: this long at the link's rate (and
# at least a few segments), so that when the emulator was kept off the CPU for up to that long
# the data it could have sent is there, stamped with when it came, and the wire catches up.
READ_AHEAD_S = 0.05
READ_AHEAD_SEGMENTS = 4
RECEIVE_BUFFER = 256 * 1024  # SO_RCVBUF of the emulator's sockets (Linux doubles it)
CONNECT_TIMEOUT_S = 10.0


class WanEmulator:
    """One listening port per named link on 127.0.0.1; every connection accepted there is
    forwarded to the upstream (the coordinator) through that link's shaping, and through the
    shared coordinator link if given. Runs an asyncio loop on a daemon thread of its own."""

    def __init__(
        self,
        upstream: Address | Callable[[], Address],
        links: Mapping[str, LinkSpec],
        coordinator: LinkSpec | None = None,
        *,
        seed: int = 0,
        host: str = "127.0.0.1",
    ) -> None:
        for name, spec in {**{f"links.{n}": s for n, s in links.items()}, "coordinator": coordinator}.items():
            if spec is not None and (msg := spec.problem(name)) is not None:
                raise ValueError(msg)
        if not links:
            raise ValueError("links: give at least one link")
        self._upstream = upstream if callable(upstream) else (lambda: upstream)
        self._specs, self._coordinator, self._seed, self._host = dict(links), coordinator, seed, host
        self._wires = {n: (Wire(s.up_mbit), Wire(s.down_mbit)) for n, s in links.items()}
        self._coord_wires = None if coordinator is None else (Wire(coordinator.up_mbit), Wire(coordinator.down_mbit))
        self._stats: dict[str, dict[str, Any]] = {
            n: {"bytes_up": 0, "bytes_down": 0, "connections": 0, "open": 0, "upstream_failures": 0, "errors": 0, "port": None, "spec": s.to_dict()}
            for n, s in links.items()
        }
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._servers: list[asyncio.AbstractServer] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._sides: set[Side] = set()
        self._stopped = False
        self.short_slices = False  # whether the kernel gave the loop's thread short time slices

    # --- the caller's thread ---------------------------------------------------------------

    def start(self) -> dict[str, int]:
        """Starts listening; returns link name -> port."""
        if self._thread is not None:
            raise RuntimeError("WanEmulator.start: already started")
        loop = self._loop = new_loop()
        opened: dict[str, Any] = {}
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)
            self.short_slices = ask_for_short_slices()
            try:
                opened["ports"] = loop.run_until_complete(self._open())
            except BaseException as e:  # noqa: BLE001 - handed to start()'s caller
                opened["error"] = e
            ready.set()
            if "error" not in opened:
                loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=run, name="wan-emulator", daemon=True)
        self._thread.start()
        ready.wait()
        if "error" in opened:
            self._thread.join()
            raise opened["error"]
        return dict(opened["ports"])

    def stop(self) -> None:
        """Closes the listeners and every connection, then the loop; idempotent."""
        if self._stopped or self._thread is None or self._loop is None:
            self._stopped = True
            return
        self._stopped = True
        if self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(timeout=10)
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=10)

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per link: bytes_up and bytes_down (delivered), connections (accepted), open, upstream
        failures (connections closed because the upstream could not be reached), errors, port and
        the spec."""
        return {n: dict(s) for n, s in self._stats.items()}

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    # --- the loop's thread -----------------------------------------------------------------

    async def _open(self) -> dict[str, int]:
        loop = asyncio.get_running_loop()
        ports = {}
        for name in self._specs:
            server = await loop.create_server(lambda name=name: self._new_side(name), self._host, 0)
            # Accepted sockets inherit it: a fixed buffer instead of loopback's autotuned
            # megabytes, so that the queue hidden in front of the link is about the sender's own.
            server.sockets[0].setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
            self._servers.append(server)
            ports[name] = self._stats[name]["port"] = server.sockets[0].getsockname()[1]
        return ports

    async def _close(self) -> None:
        for server in self._servers:
            server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for side in list(self._sides):
            side.close(abort=True)
        for _ in range(100):  # the aborted transports call connection_lost on the next turns
            if not self._sides:
                break
            await asyncio.sleep(0.01)
        for server in self._servers:
            try:
                await asyncio.wait_for(server.wait_closed(), 1.0)
            except TimeoutError:
                pass  # Python 3.12+ waits for connections here; they are aborted: nothing to lose

    def _new_side(self, link: str | None) -> Side:
        on_made = None if link is None else lambda side: self._accepted(link, side)
        return Side(asyncio.get_running_loop(), self._sides, on_made)

    def _accepted(self, link: str, client: Side) -> None:
        self._stats[link]["connections"] += 1
        task = asyncio.get_running_loop().create_task(self._serve(link, client, self._stats[link]["connections"]))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _connect(self, host: str, port: int) -> Side:
        loop = asyncio.get_running_loop()
        info = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        sock = socket.socket(info[0][0], socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
            await loop.sock_connect(sock, info[0][4])
            _, side = await loop.create_connection(lambda: self._new_side(None), sock=sock)
        except BaseException:
            sock.close()
            raise
        return side

    def _paths(self, link: str) -> tuple[list[Hop], list[Hop]]:
        """The hops of each direction: site -> coordinator, coordinator -> site."""
        up, down = link_hops(self._specs[link], *self._wires[link])
        if self._coordinator is None or self._coord_wires is None:
            return [up], [down]
        c_up, c_down = link_hops(self._coordinator, *self._coord_wires)
        return [up, c_down], [c_up, down]

    async def _serve(self, link: str, client: Side, number: int) -> None:
        loop = asyncio.get_running_loop()
        stats = self._stats[link]
        stats["open"] += 1
        accepted_at = loop.time()
        upstream: Side | None = None
        directions: list[list[asyncio.Task[None]]] = []
        try:
            try:
                upstream = await asyncio.wait_for(self._connect(*self._upstream()), CONNECT_TIMEOUT_S)
            except (OSError, ValueError, KeyError, TypeError, TimeoutError):
                stats["upstream_failures"] += 1
                return
            up_path, down_path = self._paths(link)
            rtt = sum(h.delay_s for h in up_path + down_path)
            up = self._direction(client, upstream, up_path, stats, "bytes_up", f"{self._seed}:{link}:{number}:up", not_before=accepted_at + rtt, rtt=rtt)
            down = self._direction(upstream, client, down_path, stats, "bytes_down", f"{self._seed}:{link}:{number}:down", not_before=0.0, rtt=rtt)
            directions = [up, down]
            # A socket that is gone stops the direction that writes into it (nothing can arrive
            # there); the other direction still delivers what is in flight.
            client.on_lost = lambda: [t.cancel() for t in down]
            upstream.on_lost = lambda: [t.cancel() for t in up]
            for side in (client, upstream):
                if side.lost:
                    side.on_lost()
            for result in await asyncio.gather(up[-1], down[-1], return_exceptions=True):
                if isinstance(result, Exception):
                    stats["errors"] += 1
        except Exception:  # noqa: BLE001 - one connection's failure must not stop the others
            stats["errors"] += 1
        finally:
            for task in (t for tasks in directions for t in tasks):
                task.cancel()
            for side in (client, upstream):
                if side is not None:
                    side.close()  # after what is still buffered for it was written
            stats["open"] -= 1

    def _direction(
        self, src: Side, dst: Side, hops: list[Hop], stats: dict[str, Any], counter: str, seed: str, not_before: float, rtt: float
    ) -> list[asyncio.Task[None]]:
        """The tasks that carry one direction: one per shaping hop, then the delivery; the last
        one ends when the EOF was delivered or the destination is gone. The connection's
        window (the smallest of its hops') is kept at the first hop, each segment
        acknowledged ``rtt`` (the whole path's) after it left that hop's wire."""
        loop = asyncio.get_running_loop()
        shaping = [h for h in hops if h.shapes]
        rates = [h.wire.bytes_per_s for h in shaping if h.wire.bytes_per_s is not None]
        segment = MAX_SEGMENT if not rates else max(MIN_SEGMENT, min(MAX_SEGMENT, int(min(rates) * SEGMENT_S)))
        wanted = max(READ_AHEAD_SEGMENTS * segment, int(min(rates, default=0) * READ_AHEAD_S))
        src.read_ahead = max(MIN_READ_AHEAD, min(MAX_READ_AHEAD, wanted))
        windows = [h.window for h in hops if h.window is not None]
        window = Window(min(windows), rtt) if windows else None
        source: Source = src.take
        tasks = []
        for i, hop in enumerate(shaping):
            pipe = Pipe(hop.pipe_bytes(segment))
            rng = random.Random(f"{seed}:{i}") if hop.jitter_s > 0 else None
            tasks.append(loop.create_task(carry(source, hop, pipe, segment, rng, not_before if i == 0 else 0.0, window if i == 0 else None)))
            source = pipe.get
        tasks.append(loop.create_task(deliver(source, dst, segment, stats, counter)))

        def failed(task: asyncio.Task[None]) -> None:
            # A stage that fails would leave the delivery waiting forever: end the direction.
            if not task.cancelled() and task.exception() is not None:
                stats["errors"] += 1
                for t in tasks:
                    t.cancel()

        for task in tasks[:-1]:
            task.add_done_callback(failed)
        return tasks


# --- the process ---------------------------------------------------------------------------

_SPEC_KEYS = ("upstream", "upstream_port_file", "links", "coordinator", "seed")


def emulator_from_spec(spec: Mapping[str, Any]) -> WanEmulator:
    """The emulator a SPEC.json describes (module docstring of main); ValueError names the field."""
    if not isinstance(spec, Mapping):
        raise ValueError(f"spec: must be a JSON object with keys {', '.join(_SPEC_KEYS)}")  # noqa: TRY004 - one error type for a bad config
    unknown = sorted(str(k) for k in spec if k not in _SPEC_KEYS)
    if unknown:
        raise ValueError(f"spec: unknown key(s) {', '.join(unknown)}; expected some of {', '.join(_SPEC_KEYS)}")
    if ("upstream" in spec) == ("upstream_port_file" in spec):
        raise ValueError("spec.upstream / spec.upstream_port_file: give exactly one of them")
    upstream: Address | Callable[[], Address]
    if "upstream" in spec:
        upstream = _address(spec["upstream"], "spec.upstream")
    else:
        path = spec["upstream_port_file"]
        if not isinstance(path, str) or not path:
            raise ValueError(f"spec.upstream_port_file={path!r}: must be a file path")
        upstream = _port_file_reader(Path(path))
    links = spec.get("links")
    if not isinstance(links, Mapping) or not links:
        raise ValueError(f"spec.links={links!r}: must map at least one link name to a link")
    for name in links:
        if not isinstance(name, str) or not name:
            raise ValueError(f"spec.links: link name {name!r} must be a non-empty string")
    coordinator = spec.get("coordinator")
    seed = spec.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"spec.seed={seed!r}: must be an integer")  # noqa: TRY004 - one error type for a bad config
    return WanEmulator(
        upstream,
        {name: LinkSpec.from_dict(d, f"spec.links.{name}") for name, d in links.items()},
        None if coordinator is None else LinkSpec.from_dict(coordinator, "spec.coordinator"),
        seed=seed,
    )


def _address(d: object, where: str) -> Address:
    if not isinstance(d, Mapping) or not isinstance(d.get("host"), str) or not isinstance(d.get("port"), int) or not 0 < d["port"] < 65536:
        raise ValueError(f'{where}={d!r}: must be {{"host": str, "port": 1..65535}}')
    return d["host"], d["port"]


def _port_file_reader(path: Path) -> Callable[[], Address]:
    """Reads the file at every new connection: a restarted coordinator may listen elsewhere."""
    return lambda: _address(json.loads(path.read_text()), str(path))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m diloco.sim.wan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spec", required=True, help="JSON: upstream or upstream_port_file, links, coordinator, seed")
    p.add_argument("--ports-out", required=True, help="written (atomically) once listening: {link name: port}")
    p.add_argument("--stats-out", help="written on SIGTERM/SIGINT: per link bytes and connections")
    args = p.parse_args(argv)
    try:
        emulator = emulator_from_spec(json.loads(Path(args.spec).read_text()))
    except (OSError, ValueError) as e:
        print(f"diloco.sim.wan: {args.spec}: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda _signum, _frame: stop.set())
    try:
        ports = emulator.start()
        write_json_atomic(Path(args.ports_out), ports)
        print(f"diloco.sim.wan: listening on 127.0.0.1: {json.dumps(ports)}; short scheduler slices: {emulator.short_slices}", flush=True)
        while not stop.wait(0.2):
            pass
    finally:
        emulator.stop()
    if args.stats_out:
        write_json_atomic(Path(args.stats_out), emulator.stats())
    return 0


if __name__ == "__main__":
    sys.exit(main())
