"""The WAN link emulator (diloco.sim.wan) as a proxy and a process: every byte passed through,
resets, refusals and stops that leave nothing open, half-closed connections, the process
entry point (its port file, SIGTERM, stats, bad specs named) and a gRPC call through it."""

from __future__ import annotations

import json
import random
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from wan_endpoints import Upstream, connect, download, upload, wait_until, wan_process, write_json

from diloco.sim.links import LinkSpec

pytestmark = pytest.mark.timeout(60)
REPO = Path(__file__).resolve().parents[2]


def test_pass_through_keeps_every_byte(upstream: Upstream, emulate: Callable[..., Any]) -> None:
    _, ports = emulate(("127.0.0.1", upstream.port), {"free": LinkSpec()})
    upload(ports["free"], 8_000_000)
    download(ports["free"], 8_000_000)


# --- closing and failures ---------------------------------------------------------------------


def test_resets_refusals_and_stop_leave_nothing_open(upstream: Upstream, emulate: Callable[..., Any]) -> None:
    dead = socket.create_server(("127.0.0.1", 0))
    dead_port = dead.getsockname()[1]
    dead.close()
    target = {"port": dead_port}
    em, ports = emulate(lambda: ("127.0.0.1", target["port"]), {"a": LinkSpec(up_mbit=20, rtt_ms=10)})
    # An upstream that refuses: the accepted connection is closed.
    with connect(ports["a"]) as s:
        s.sendall(b"E")
        assert _recv_or_reset(s) == b""
    target["port"] = upstream.port
    # A client that resets mid-transfer, and an upstream that resets.
    s = connect(ports["a"])
    s.sendall(b"E" + b"x" * 200_000)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()
    with connect(ports["a"]) as s:
        s.sendall(b"R" + b"y" * 1000)
        assert _recv_or_reset(s) == b""
    assert wait_until(lambda: em.stats()["a"]["open"] == 0), em.stats()
    stats = em.stats()["a"]
    assert stats["connections"] == 3 and stats["upstream_failures"] == 1 and stats["errors"] == 0
    # Still forwarding, and stop() closes a connection still open.
    s = connect(ports["a"])
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
    report = upload(ports["a"], 300_000)  # the sink answers only after it saw our EOF
    assert report["n"] == 300_000


# --- the process ------------------------------------------------------------------------------


def test_main_follows_the_port_file_stops_on_sigterm_and_writes_stats(tmp_path: Path) -> None:
    one, two = Upstream("one"), Upstream("two")
    port_file = tmp_path / "coordinator.port.json"
    write_json(port_file, {"host": "127.0.0.1", "port": one.port})
    spec = {"upstream_port_file": str(port_file), "links": {"site0": {"bandwidth_mbit": 50, "rtt_ms": 10}}, "coordinator": None, "seed": 3}
    try:
        with wan_process(tmp_path, spec) as (proc, ports):
            assert _ask_name(ports["site0"]) == "one"
            one.close()  # the coordinator restarts elsewhere: first gone, then its new port written
            assert _ask_name(ports["site0"]) == ""
            write_json(port_file, {"host": "127.0.0.1", "port": two.port})
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
    with connect(port) as s:
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
