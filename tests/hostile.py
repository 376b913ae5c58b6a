"""Hostile clients for the fuzz and load tests (and scripts/bench_security.py): random valid and
invalid messages at the raw gRPC level, mutated pushes, bytes that are no protobuf at all, and
connections that hold what they can. Each call's outcome is counted by status code; UNKNOWN
(an exception that escaped the servicer) counts as a crash."""

from __future__ import annotations

import random
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc
import torch

from diloco.codec import get_codec, known_codecs
from diloco.outer import params_sha256
from diloco.security.config import SecurityConfig
from diloco.security.store import RunCredentials
from diloco.transport import CoordinatorClient, retrying
from diloco.transport.pb import coordinator_pb2 as pb
from diloco.transport.pb import coordinator_pb2_grpc as pb_grpc
from diloco.transport.serde import chunk_to_proto, spec_to_proto
from diloco.types import JoinRequest, PushHeader
from diloco.wire import ChunkAssembler, encode_chunks
from diloco.wire.fingerprint import fingerprint

SERVICE = "/diloco.v1.Coordinator/"
CRASH = grpc.StatusCode.UNKNOWN  # what grpc answers when a servicer raised something unexpected


@dataclass
class Counts:
    sent: int = 0
    codes: Counter = field(default_factory=Counter)
    crashes: list[str] = field(default_factory=list)
    internal: Counter = field(default_factory=Counter)  # INTERNAL answers by their details (grpc's own: a request that is no protobuf)

    def add(self, code: grpc.StatusCode, what: str, details: str = "") -> None:
        self.sent += 1
        self.codes[code.name] += 1
        if code == CRASH:
            self.crashes.append(f"{what}: {details[:300]}")
        if code == grpc.StatusCode.INTERNAL:
            self.internal[details[:80]] += 1

    def merge(self, other: Counts) -> None:
        self.sent += other.sent
        self.codes.update(other.codes)
        self.crashes += other.crashes
        self.internal.update(other.internal)

    @property
    def refusals(self) -> int:
        return self.sent - self.codes.get("OK", 0)


_INTS = [0, 1, -1, 2, 7, 2**31 - 1, -(2**31), 2**62, -(2**63), 2**63 - 1, 10**9]
_IDS = ["x", "y", "a", "b", "", "../etc", "a\nb", "a\x00b", "z" * 300, "é", "c", "site-9"]


class Fuzzer:
    """One hostile client. ``members``: ids it joins as first (legitimate-looking), so its
    messages reach past membership; ``theta``: the run's parameters (to mutate valid pushes)."""

    def __init__(self, channel: grpc.Channel, seed: int, members: list[str], theta: dict[str, torch.Tensor], total_rounds: int) -> None:
        self.channel = channel
        self.stub = pb_grpc.CoordinatorStub(channel)
        self.rng = random.Random(seed)
        self.members = members
        self.theta = theta
        self.total_rounds = total_rounds
        self.counts = Counts()
        self.error: Exception | None = None
        self.codecs = known_codecs()
        self.actions: list[Callable[[], None]] = [
            self.join, self.push, self.push_mutated, self.push_garbage_framing, self.raw_bytes, self.wait, self.pull, self.heartbeat, self.leave,
        ]  # fmt: skip

    def run(self, messages: int, stop: threading.Event | None = None) -> Counts:
        """Sends at least ``messages`` calls (or until ``stop``); a failure of the fuzzer
        itself (not of a call) is kept in ``self.error``."""
        try:
            return self._run(messages, stop)
        except Exception as e:  # noqa: BLE001 - reported by the caller
            self.error = e
            raise

    def _run(self, messages: int, stop: threading.Event | None) -> Counts:
        for m in self.members:
            self._call(
                "Join", lambda m=m: self.stub.Join(pb.JoinRequest(site_id=m, params=[spec_to_proto(s) for s in fingerprint(self.theta).values()]), timeout=10)
            )
        while self.counts.sent < messages and not (stop and stop.is_set()):
            self.rng.choice(self.actions)()
        return self.counts

    # ---- helpers ---------------------------------------------------------------------
    def _call(self, what: str, fn: Callable[[], object]) -> None:
        try:
            result = fn()
            if isinstance(result, Iterator):
                for _ in result:
                    pass
            self.counts.add(grpc.StatusCode.OK, what)
        except grpc.RpcError as e:
            self.counts.add(e.code(), what, e.details() or "")

    def _id(self) -> str:
        return self.rng.choice(self.members + _IDS) if self.rng.random() < 0.6 else self.rng.choice(self.members or ["x"])

    def _int(self, lo: int = -3, hi: int = 12) -> int:
        return self.rng.choice(_INTS) if self.rng.random() < 0.3 else self.rng.randint(lo, hi)

    def _i32(self, lo: int, hi: int) -> int:
        return max(-(2**31), min(2**31 - 1, self._int(lo, hi)))

    def _header(self) -> pb.PushHeader:
        return pb.PushHeader(
            site_id=self._id(), round=self._int(-2, self.total_rounds + 1), tokens=self._int(1, 100), train_loss=self.rng.choice([1.0, float("nan"), float("inf"), -1e300]),
            inner_steps=self._int(0, 10), part=self._i32(0, 2) if self.rng.random() < 0.3 else 0, parts=self._i32(0, 3) if self.rng.random() < 0.3 else 1,
            eval_tokens=self._int(0, 5) if self.rng.random() < 0.2 else 0, eval_round=self._int(-1, 3), eval_loss=self.rng.choice([1.0, float("nan"), -2.0]),
            withheld=self.rng.choice(["lost", "x" * 600, "bad\x00reason"]) if self.rng.random() < 0.15 else "",
        )  # fmt: skip

    def _delta(self) -> dict[str, torch.Tensor]:
        scale = self.rng.choice([0.01, 1.0, 1e30, 3e38, float("nan")])
        return {n: torch.randn(t.shape, generator=torch.Generator().manual_seed(self.rng.randint(0, 2**31))) * scale for n, t in self.theta.items()}

    def _valid_chunks(self) -> list[pb.TensorChunk]:
        codec = get_codec(self.rng.choice(self.codecs))
        try:
            return [chunk_to_proto(c) for c in encode_chunks(self._delta(), codec=codec, chunk_bytes=self.rng.choice([64, 256, 1 << 20]))]
        except ValueError:  # a codec that refuses non-finite values to encode
            return [chunk_to_proto(c) for c in encode_chunks({n: torch.zeros_like(t) for n, t in self.theta.items()}, codec=codec)]

    def _stream(self, what: str, messages: list[pb.PushMessage]) -> None:
        rpc = self.stub.PushDelta if self.rng.random() < 0.9 else self.stub.UploadInit
        self._call(what, lambda: rpc(iter(messages), timeout=10))

    # ---- actions ---------------------------------------------------------------------
    def join(self) -> None:
        specs = [spec_to_proto(s) for s in fingerprint(self.theta).values()]
        if self.rng.random() < 0.5:
            self.rng.shuffle(specs)
            specs = specs[: self.rng.randint(0, len(specs))] + [
                pb.TensorSpec(name=self._id(), shape=[self._int()], dtype=self.rng.choice(["float32", "int8", "x"]))
            ]
        req = pb.JoinRequest(
            site_id=self._id(),
            params=specs,
            can_upload=self.rng.random() < 0.2,
            stated=self.rng.choice(["", '{"sync.every": 3}', '{"codec.name": "bogus"}', "{not json", "[1, 2]", '{"a": ' * 50, '{"x": 1}']),
        )
        self._call("Join", lambda: self.stub.Join(req, timeout=10))

    def push(self) -> None:
        h = pb.PushHeader(
            site_id=self.rng.choice(self.members or ["x"]),
            round=self.rng.randint(0, self.total_rounds),
            tokens=self.rng.randint(1, 100),
            train_loss=1.0,
            inner_steps=1,
        )
        self._stream("PushDelta valid", [pb.PushMessage(header=h)] + [pb.PushMessage(chunk=c) for c in self._valid_chunks()])

    def push_mutated(self) -> None:
        chunks = self._valid_chunks()
        for _ in range(self.rng.randint(1, 3)):
            c = self.rng.choice(chunks)
            field = self.rng.choice(["name", "shape", "dtype", "offset", "numel", "codec", "payload", "box_start", "box_shape", "drop", "dup"])
            if field == "name":
                c.name = self._id()
            elif field in ("shape", "box_start", "box_shape"):
                getattr(c, field)[:] = [self._int() for _ in range(self.rng.randint(0, 3))]
            elif field == "dtype":
                c.dtype = self.rng.choice(["float16", "int64", "", "float32"])
            elif field in ("offset", "numel"):
                setattr(c, field, self._int())
            elif field == "codec":
                c.codec = self.rng.choice(self.codecs + ["", "zstd", "fp32+zstd", "nope"])
            elif field == "payload":
                p = bytearray(c.payload)
                cut = self.rng.randint(0, len(p))
                c.payload = bytes(p[:cut]) if self.rng.random() < 0.5 else bytes(p) + self.rng.randbytes(self.rng.randint(1, 64))
            elif field == "drop" and len(chunks) > 1:
                chunks.remove(c)
            elif field == "dup":
                chunks.append(c)
        self._stream("PushDelta mutated", [pb.PushMessage(header=self._header())] + [pb.PushMessage(chunk=c) for c in chunks])

    def push_garbage_framing(self) -> None:
        chunks = self._valid_chunks()
        msgs = [pb.PushMessage(chunk=c) for c in chunks]
        if self.rng.random() < 0.5:
            msgs.insert(self.rng.randint(0, len(msgs)), pb.PushMessage(header=self._header()))
        if self.rng.random() < 0.3:
            msgs = []
        self._stream("PushDelta framing", msgs)

    def raw_bytes(self) -> None:
        method = self.rng.choice(["Join", "WaitRound", "Heartbeat", "Leave", "PullUpdate", "PullGlobal", "PushDelta", "UploadInit", "NoSuchMethod"])
        blob = self.rng.randbytes(self.rng.randint(0, 200))
        if method in ("PushDelta", "UploadInit"):
            call = self.channel.stream_unary(SERVICE + method)
            self._call(f"{method} raw", lambda: call(iter([blob, self.rng.randbytes(8)]), timeout=10))
        elif method.startswith("Pull"):
            stream = self.channel.unary_stream(SERVICE + method)
            self._call(f"{method} raw", lambda: stream(blob, timeout=10))
        else:
            call = self.channel.unary_unary(SERVICE + method)
            self._call(f"{method} raw", lambda: call(blob, timeout=10))

    def wait(self) -> None:
        req = pb.WaitRequest(site_id=self._id(), round=self._int(-2, self.total_rounds + 2), timeout_s=self.rng.choice([0.0, 0.05, -5.0, float("nan"), 1e300]))
        self._call("WaitRound", lambda: self.stub.WaitRound(req, timeout=10))

    def pull(self) -> None:
        want = [
            pb.TensorBox(name=self._id() if self.rng.random() < 0.5 else self.rng.choice(sorted(self.theta)), start=[self._int()], shape=[self._int()])
            for _ in range(self.rng.randint(0, 2))
        ]
        req = pb.PullRequest(site_id=self._id(), round=self._int(-2, self.total_rounds), want=want)
        rpc = self.stub.PullUpdate if self.rng.random() < 0.5 else self.stub.PullGlobal
        self._call("Pull", lambda: rpc(req, timeout=10))

    def heartbeat(self) -> None:
        self._call("Heartbeat", lambda: self.stub.Heartbeat(pb.HeartbeatRequest(site_id=self._id()), timeout=10))

    def leave(self) -> None:
        if self.rng.random() < 0.2:  # a member that leaves joins again on its next Join
            req = pb.LeaveRequest(
                site_id=self._id(),
                global_sha256=self.rng.choice(["", "0" * 64, "zz", "f" * 65]),
                eval_tokens=self._int(0, 3),
                eval_round=self._int(-1, 2),
                eval_loss=1.0,
            )
            self._call("Leave", lambda: self.stub.Leave(req, timeout=10))


class _Retrying:
    """A client whose calls are retried while they fail retryably (a busy coordinator), as a
    real site's are."""

    def __init__(self, client: CoordinatorClient) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Callable[..., object]:
        method = getattr(self._client, name)
        return lambda *args, **kwargs: retrying(lambda: method(*args, **kwargs), limit_s=60, what=name)


def legit_site(address: str, site: str, theta: dict[str, torch.Tensor], rounds: int, out: dict[str, str], security: SecurityConfig | None = None) -> None:
    """Pushes a small Δ every round, waits, pulls the update and applies it: its θ must end equal
    to the coordinator's."""
    fp32 = get_codec("fp32")
    with CoordinatorClient(address, timeout_s=30, connect_timeout_s=10, security=security, site_id=site) as client:
        c = _Retrying(client)
        c.join(JoinRequest(site, tuple(fingerprint(theta).values())))
        local = {n: t.clone() for n, t in theta.items()}
        for r in range(rounds):
            delta = {n: torch.full_like(t, 0.01 * (r + 1)) for n, t in local.items()}
            c.push(PushHeader(site_id=site, round=r, tokens=100, train_loss=1.0, inner_steps=5), list(encode_chunks(delta, codec=fp32)))
            while c.wait_round(site, r, timeout_s=5).committed_rounds <= r:
                c.heartbeat(site)
            assembler = ChunkAssembler(fingerprint(local))
            for chunk in c.pull_update(site, r):
                assembler.add(chunk)
            for n, u in assembler.finish().items():
                local[n].add_(u)
        out[site] = params_sha256(local)
        c.leave(site, out[site])


# ---- hostile connections ---------------------------------------------------------------
LOAD_KINDS = ("plaintext", "no_cert", "foreign_cert", "leaked_idle_push", "leaked_impersonation")


@dataclass
class LoadReport:
    connections: int
    counts: Counts
    peak_rpc_threads: int  # the coordinator's gRPC worker threads ever started (sampled; in-process coordinators only)
    peak_threads: int  # every thread of this process at the peak (sampled)


@dataclass(frozen=True)
class Leaked:
    """The credentials of one real site that a hostile client holds."""

    site: str
    cert: bytes
    key: bytes
    token: str


def _channel(address: str, ca: bytes | None, cert: tuple[bytes, bytes] | None = None, token: str | None = None) -> grpc.Channel:
    # Its own subchannel pool: one TCP connection per channel, as separate clients would have.
    options = [("grpc.use_local_subchannel_pool", 1)]
    if ca is None:
        return grpc.insecure_channel(address, options=options)
    creds = grpc.ssl_channel_credentials(ca, *(cert or (None, None)))
    if token is not None:
        creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(token))
    return grpc.secure_channel(address, creds, options=options)


def site_channel(address: str, creds: RunCredentials, site: str) -> grpc.Channel:
    """A raw channel with ``site``'s certificate and token (a client that holds them)."""
    pem = creds.site_pem(site)
    return _channel(address, creds.ca_pem(), (pem.key, pem.cert), creds.site_token(site))


class HostileLoad:
    """``connections`` hostile connections to a coordinator that uses TLS with client
    certificates and tokens, spread over LOAD_KINDS: plaintext to the TLS port, TLS without a
    client certificate, a certificate of another CA (each calling Heartbeat as a real site
    every ``pause_s``), and a client holding ``leaked`` credentials of a real site that opens
    pushes that stall after their first chunk, or calls as another site."""

    def __init__(
        self, address: str, ca: bytes, leaked: Leaked, foreign: tuple[bytes, bytes], theta: dict[str, torch.Tensor], connections: int, pause_s: float = 0.05
    ) -> None:
        self.address, self.ca, self.leaked, self.foreign, self.theta = address, ca, leaked, foreign, theta
        self.connections, self.pause_s = connections, pause_s
        self.stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._channels: list[grpc.Channel] = []
        self._counts: list[Counts] = []
        self._peak = (0, 0)
        self._earlier: set[threading.Thread] = set()  # another server's workers, not counted

    def start(self) -> None:
        self._earlier = {t for t in threading.enumerate() if t.name.startswith("coordinator-rpc")}
        leaked = (self.leaked.key, self.leaked.cert)
        for i in range(self.connections):
            kind = LOAD_KINDS[i % len(LOAD_KINDS)]
            ch = {
                "plaintext": lambda: _channel(self.address, None),
                "no_cert": lambda: _channel(self.address, self.ca),
                "foreign_cert": lambda: _channel(self.address, self.ca, self.foreign),
                "leaked_idle_push": lambda: _channel(self.address, self.ca, leaked, self.leaked.token),
                "leaked_impersonation": lambda: _channel(self.address, self.ca, leaked, self.leaked.token),
            }[kind]()
            counts = Counts()
            self._channels.append(ch)
            self._counts.append(counts)
            target = self._idle_pushes if kind == "leaked_idle_push" else self._calls
            self._threads.append(threading.Thread(target=target, args=(ch, counts), daemon=True))
        self._threads.append(threading.Thread(target=self._sample, daemon=True))
        for t in self._threads:
            t.start()

    def finish(self) -> LoadReport:
        self.stop.set()
        for t in self._threads:
            t.join(30)
        for ch in self._channels:
            ch.close()
        total = Counts()
        for c in self._counts:
            total.merge(c)
        return LoadReport(self.connections, total, *self._peak)

    def _calls(self, ch: grpc.Channel, counts: Counts) -> None:
        stub = pb_grpc.CoordinatorStub(ch)
        while not self.stop.wait(self.pause_s):
            try:
                stub.Heartbeat(pb.HeartbeatRequest(site_id="a"), timeout=5)
                counts.add(grpc.StatusCode.OK, "Heartbeat")
            except grpc.RpcError as e:
                counts.add(e.code(), "Heartbeat", e.details() or "")

    def _idle_pushes(self, ch: grpc.Channel, counts: Counts) -> None:
        stub = pb_grpc.CoordinatorStub(ch)
        chunk = chunk_to_proto(next(iter(encode_chunks({n: torch.zeros_like(t) for n, t in self.theta.items()}, codec=get_codec("fp32"), chunk_bytes=64))))

        def messages() -> Iterator[pb.PushMessage]:
            yield pb.PushMessage(header=pb.PushHeader(site_id=self.leaked.site, round=0, tokens=1, inner_steps=1, parts=1))
            yield pb.PushMessage(chunk=chunk)
            self.stop.wait()

        while not self.stop.is_set():
            try:
                stub.PushDelta(messages(), timeout=60)
                counts.add(grpc.StatusCode.OK, "PushDelta idle")
            except grpc.RpcError as e:
                counts.add(e.code(), "PushDelta idle", e.details() or "")
                self.stop.wait(self.pause_s)

    def _sample(self) -> None:
        while not self.stop.wait(0.1):
            threads = threading.enumerate()
            busy = sum(1 for t in threads if t.name.startswith("coordinator-rpc") and t not in self._earlier)
            self._peak = (max(self._peak[0], busy), max(self._peak[1], len(threads)))
