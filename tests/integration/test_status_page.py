"""The coordinator's status page (diloco/observe/status_page.py), through real servers on
127.0.0.1:0: in headless Chromium (Debian's package, started by the test and driven over the
DevTools protocol on a pipe) the page loads, shows the sites and the round, and updates itself
as rounds commit; over HTTPS with the run's certificate it asks for a site's token, which it
takes from the URL's fragment. Without a browser: GET only (405 otherwise), the run's TLS,
client-certificate and token rules, loopback only in plaintext, a port in use named, idle and
garbage connections that wedge nothing, and metrics.jsonl read as it grows."""

from __future__ import annotations

import fcntl
import http.client
import json
import math
import os
import re
import shutil
import socket
import ssl
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import coordinator, filled, push, theta
from observe_helpers import HandSite

from diloco.app.config import ConfigError, run_config_from_dict
from diloco.app.coordinator import CoordinatorOptions, run_coordinator
from diloco.coordinator import Coordinator, CoordinatorConfig
from diloco.observe.status_page import MAX_CONNECTIONS, StatusConfig, StatusPage, StatusPageError, serve_status_page, status_config
from diloco.observe.status_state import MetricsTail, curves
from diloco.security.config import SecurityConfig
from diloco.security.store import RunCredentials, write_run_credentials
from diloco.sim.sections import sim_status

pytestmark = pytest.mark.timeout(120)
THETA = theta({"w": (2, 3)})
CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium binary on PATH: the status page's browser tests need it (apt-get install chromium; scripts/setup_browser.sh)"
)


# ---- a headless browser, driven over the DevTools protocol ---------------------------------


class Chromium:
    """Headless Chromium with the DevTools protocol on a pipe (--remote-debugging-pipe: JSON
    messages ending in NUL, read from its fd 3, written to its fd 4): no port, no extra library."""

    def __init__(self, profile: Path, *flags: str) -> None:
        to_r, self._w = os.pipe()
        self._r, from_w = os.pipe()

        def child_fds() -> None:  # in the child, before exec: the pipe's ends as fds 3 and 4
            r, w = fcntl.fcntl(to_r, fcntl.F_DUPFD_CLOEXEC, 10), fcntl.fcntl(from_w, fcntl.F_DUPFD_CLOEXEC, 10)
            os.dup2(r, 3)
            os.dup2(w, 4)

        self.log = profile / "chromium.log"
        profile.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as log:
            argv = [str(CHROMIUM), "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run", "--no-default-browser-check",
                    "--disable-extensions", "--disable-background-networking", f"--user-data-dir={profile}", "--remote-debugging-pipe", *flags, "about:blank"]  # fmt: skip
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, close_fds=False, preexec_fn=child_fds, start_new_session=True
            )
        os.close(to_r)
        os.close(from_w)
        self._cv = threading.Condition()
        self._replies: dict[int, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self._next, self._closed = 0, False
        threading.Thread(target=self._read, name="cdp-reader", daemon=True).start()

    def _read(self) -> None:
        buf = b""
        while chunk := os.read(self._r, 1 << 16):
            buf += chunk
            *messages, buf = buf.split(b"\0")
            with self._cv:
                for raw in messages:
                    m = json.loads(raw)
                    if "id" in m:
                        self._replies[m["id"]] = m
                    else:
                        self.events.append(m)
                self._cv.notify_all()
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def call(self, method: str, params: dict[str, Any] | None = None, session: str | None = None) -> dict[str, Any]:
        with self._cv:
            self._next += 1
            i = self._next
        msg = {"id": i, "method": method, "params": params or {}, **({"sessionId": session} if session else {})}
        data = json.dumps(msg).encode() + b"\0"
        while data:
            data = data[os.write(self._w, data) :]
        with self._cv:
            self._cv.wait_for(lambda: i in self._replies or self._closed)  # the test's timeout bounds it
            if i not in self._replies:
                raise RuntimeError(f"chromium closed its pipe; see {self.log}: {self.log.read_text(errors='replace')[-2000:]}")
            reply = self._replies.pop(i)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def open(self, url: str) -> str:
        """A new tab at ``url``; returns its session."""
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Runtime", "Log", "Page"):
            self.call(f"{domain}.enable", session=session)
        self.call("Page.navigate", {"url": url}, session=session)
        return session

    def eval(self, session: str, expression: str) -> Any:
        r = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True}, session=session)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression[:60]}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def errors(self, session: str) -> list[str]:
        """What the page's console got as errors: exceptions, CSP refusals, failed loads."""
        with self._cv:
            events = [e for e in self.events if e.get("sessionId") == session]
        out = [json.dumps(e["params"]["exceptionDetails"])[:300] for e in events if e["method"] == "Runtime.exceptionThrown"]
        out += [
            f"{e['params']['entry'].get('source')}: {e['params']['entry'].get('text')} {e['params']['entry'].get('url', '')}"
            for e in events
            if e["method"] == "Log.entryAdded" and e["params"]["entry"]["level"] == "error"
        ]
        return out

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.call("Browser.close")
            self.proc.wait(timeout=15)
        except (RuntimeError, OSError, subprocess.TimeoutExpired):
            pass
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
            for fd in (self._w, self._r):
                try:
                    os.close(fd)
                except OSError:
                    pass


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Callable[..., Chromium]]:
    started: list[Chromium] = []

    def start(*flags: str) -> Chromium:
        started.append(Chromium(tmp_path / f"chromium-{len(started)}", *flags))
        return started[-1]

    try:
        yield start
    finally:
        for b in started:
            b.close()


PROBE = """JSON.stringify({
  round: document.getElementById('round').textContent,
  state: document.getElementById('state').textContent,
  sites: Array.from(document.querySelectorAll('#sites tbody tr')).map(tr => [tr.dataset.site, tr.dataset.state, tr.lastChild.textContent]),
  rows: Array.from(document.querySelectorAll('#rounds tbody tr')).map(tr => Number(tr.dataset.round)),
  lines: Array.from(document.querySelectorAll('#loss-chart polyline, #bytes-chart polyline')).map(p => p.dataset.series),
  updates: Number(document.getElementById('updates').textContent),
  error: document.getElementById('error').textContent,
  probe: window.__probe === 1,
  hash: location.hash,
})"""


def _until(b: Chromium, session: str, ready: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The page's state once ``ready`` says so (the test's timeout bounds the wait)."""
    while True:
        try:
            seen = json.loads(b.eval(session, PROBE) or "null")
        except RuntimeError:  # the page is still loading (no document yet)
            seen = None
        if seen is not None and ready(seen):
            return seen
        time.sleep(0.1)


def _unexpected(errors: list[str]) -> list[str]:
    return [e for e in errors if "favicon.ico" not in e]  # the browser asks for one; there is none (404)


# ---- a coordinator process and two sites, the page in the browser ----------------------------


def _wait_for(path: Path, thread: threading.Thread) -> dict[str, Any]:
    while not path.exists():
        assert thread.is_alive(), f"the coordinator stopped before it wrote {path}"
        time.sleep(0.02)
    return json.loads(path.read_text())


@needs_chromium
def test_the_page_in_chromium_shows_the_sites_and_the_round_and_updates_itself(tmp_path: Path, browser: Callable[..., Chromium]) -> None:
    rounds = 3
    cfg = run_config_from_dict({"sites": 2, "rounds": rounds, "eval_every": 2, "tensorboard": {"enabled": False}, "sync": {"every": 1}})
    opts = CoordinatorOptions(port=0, port_file=str(tmp_path / "port.json"), linger_s=60, status=StatusConfig(port=0, port_file=str(tmp_path / "status.json")))
    result: dict[str, Any] = {}
    coordinators: list[Coordinator] = []

    def serve_run() -> None:
        try:
            result.update(run_coordinator(cfg, opts, tmp_path / "run", log=lambda _m: None, attach=coordinators.append))
        except BaseException as e:  # noqa: BLE001 - reported by the test
            result["error"] = e

    runner = threading.Thread(target=serve_run, name="coordinator", daemon=True)
    runner.start()
    sites: list[HandSite] = []
    try:
        page = _wait_for(tmp_path / "status.json", runner)
        assert page["url"] == f"http://127.0.0.1:{page['port']}/" and not page["tls"] and not page["token"]
        address = f"127.0.0.1:{_wait_for(tmp_path / 'port.json', runner)['port']}"
        b = browser()
        tab = b.open(page["url"])
        first = _until(b, tab, lambda s: s["updates"] >= 1 and s["round"] == f"0 / {rounds}")
        assert first["sites"] == [] and first["rows"] == [] and first["error"] == ""
        b.eval(tab, "window.__probe = 1")  # gone if the page were ever loaded again

        sites = [HandSite(str(i), address, cfg, rounds, loss0=3.0) for i in range(2)]
        joined = _until(b, tab, lambda s: len(s["sites"]) == 2)
        assert [s[:2] for s in joined["sites"]] == [["0", "active"], ["1", "active"]]
        assert all(s[2] == "none yet" for s in joined["sites"]) and joined["state"] == "running"

        for s in sites:
            s.round(0)
        for s in sites:
            s.wait(0)
        one = _until(b, tab, lambda s: s["round"] == f"1 / {rounds}")
        assert one["probe"] and one["updates"] > joined["updates"]  # the same page, refreshed by its own fetches
        one = _until(b, tab, lambda s: s["rows"] == [0])
        # Round 0's bytes down are known once round 1 is committed (metrics.jsonl's rule): no line yet.
        assert {"train_loss", "bytes_up"} <= set(one["lines"]) and "bytes_down" not in one["lines"]
        assert all(s[2] == "round 0" for s in one["sites"])

        for r in (1, 2):
            for s in sites:
                s.round(r)
            for s in sites:
                s.wait(r)
        last = _until(b, tab, lambda s: s["round"] == f"{rounds} / {rounds}" and s["rows"] == [2, 1, 0])
        assert last["probe"] and last["state"] == "finished"  # the sites have not left yet
        _until(b, tab, lambda s: "bytes_down" in s["lines"])  # rounds 0 and 1's bytes down are known
        _until(b, tab, lambda s: "eval" in s["lines"])  # the coordinator evaluated θ (rounds 1 and 2)
        assert _unexpected(b.errors(tab)) == []  # no script error, nothing the page's CSP refused

        for s in sites:
            s.leave.set()
        runner.join(60)
        assert not runner.is_alive() and "error" not in result, result.get("error")
        gone = _until(b, tab, lambda s: s["error"] != "")  # the coordinator has stopped, and the page says so
        assert gone["error"].startswith("cannot read the run's state") and gone["round"] == f"{rounds} / {rounds}"
    finally:
        for s in sites:
            s.release()
        runner.join(30)
        if runner.is_alive() and coordinators:
            for listener in list(coordinators[0].on_fatal):
                listener("the test's teardown", RuntimeError("stopped by the test"))
            runner.join(30)


# ---- TLS and tokens ---------------------------------------------------------------------------


@pytest.fixture
def creds(tmp_path: Path) -> RunCredentials:
    write_run_credentials(tmp_path / "creds", ["0", "1"], hosts=["localhost", "127.0.0.1"], days=1, force=True)
    return RunCredentials.at(tmp_path / "creds")


def _coordinator_of(*sites: str) -> Coordinator:
    """A coordinator of 3 rounds and at least 2 sites, with ``sites`` joined."""
    return coordinator(THETA, CoordinatorConfig(total_rounds=3, min_sites=2), sites=sites)


@pytest.fixture
def pages(tmp_path: Path) -> Iterator[Callable[..., StatusPage]]:
    started: list[StatusPage] = []

    def start(security: SecurityConfig | None = None, coordinator: Coordinator | None = None, metrics: Path | None = None) -> StatusPage:
        started.append(serve_status_page(StatusConfig(port=0), security or SecurityConfig(), metrics or tmp_path / "metrics.jsonl", {"sites": 2}))
        started[-1].attach(coordinator or _coordinator_of("0"))
        return started[-1]

    try:
        yield start
    finally:
        for p in started:
            p.close()


@needs_chromium
def test_over_https_the_page_takes_a_sites_token_from_its_fragment(creds: RunCredentials, pages, browser) -> None:  # type: ignore[no-untyped-def]
    page = pages(SecurityConfig(dir=str(creds.dir), auth="token"))
    assert page.url.startswith("https://")
    b = browser("--ignore-certificate-errors")  # the run's CA is not in the browser's store
    without = b.open(page.url)
    refused = _until(b, without, lambda s: s["error"] != "")
    assert "401" in refused["error"] and "token" in refused["error"] and refused["sites"] == []
    token = (creds.sites_dir / "1.token").read_text().strip()
    tab = b.open(page.url + "#token=" + token)
    shown = _until(b, tab, lambda s: len(s["sites"]) == 1 and s["updates"] >= 2)
    assert shown["sites"][0][:2] == ["0", "active"] and shown["round"] == "0 / 3" and shown["error"] == ""
    assert shown["hash"] == ""  # the token left the address bar (kept for this tab only)
    assert _unexpected(b.errors(tab)) == []


def _https(
    page: StatusPage, creds: RunCredentials, path: str, token: str | None = None, cert: str | None = None, method: str = "GET"
) -> tuple[int, dict[str, str], bytes]:
    ctx = ssl.create_default_context(cafile=str(creds.ca_cert))
    if cert is not None:
        files = creds.site_files(cert)
        ctx.load_cert_chain(str(files.cert), str(files.key))
    conn = http.client.HTTPSConnection("127.0.0.1", page.port, context=ctx, timeout=10)
    try:
        conn.request(method, path, headers={"Authorization": f"Bearer {token}"} if token else {})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


def test_the_runs_tls_client_certificates_and_tokens_are_required(creds: RunCredentials, pages) -> None:  # type: ignore[no-untyped-def]
    token = (creds.sites_dir / "0.token").read_text().strip()
    # auth=token: HTTPS, /status.json with a site's token; the page itself holds no data.
    page = pages(SecurityConfig(dir=str(creds.dir), auth="token"))
    assert page.address()["tls"] and page.address()["token"] and not page.address()["client_certificate"]
    status, headers, body = _https(page, creds, "/status.json")
    assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer") and b"token" in body
    assert _https(page, creds, "/status.json", token="x" * 43)[0] == 401
    status, _, body = _https(page, creds, "/status.json", token=token)
    assert status == 200 and json.loads(body)["sites"][0]["id"] == "0"
    assert _https(page, creds, "/")[0] == 200
    with pytest.raises((http.client.HTTPException, OSError)):  # plain HTTP to the TLS port
        urllib.request.urlopen(f"http://127.0.0.1:{page.port}/status.json", timeout=10).read()
    # auth=both (diloco-sim's default): the handshake needs a client certificate of the run CA too.
    both = pages(SecurityConfig(dir=str(creds.dir), auth="both"))
    with pytest.raises((ssl.SSLError, ConnectionError)):
        _https(both, creds, "/status.json", token=token)
    assert _https(both, creds, "/status.json", cert="1")[0] == 401
    assert _https(both, creds, "/status.json", token=token, cert="1")[0] == 200  # any site's credentials
    # auth=mtls: the certificate alone.
    mtls = pages(SecurityConfig(dir=str(creds.dir), auth="mtls"))
    assert _https(mtls, creds, "/status.json", cert="0")[0] == 200
    # A server certificate that is not the run's is refused by a client that trusts the run CA.
    with pytest.raises(ssl.SSLError):
        ssl.create_default_context().wrap_socket(socket.create_connection(("127.0.0.1", page.port), timeout=10), server_hostname="127.0.0.1")


def _plain(page: StatusPage, method: str, path: str, host: str | None = None) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", page.port, timeout=10)
    try:
        conn.putrequest(method, path, skip_host=host is not None)
        if host is not None:
            conn.putheader("Host", host)
        conn.endheaders()
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


def test_read_only_loopback_only_in_plaintext_and_json_for_the_page(tmp_path: Path, pages) -> None:  # type: ignore[no-untyped-def]
    coord = _coordinator_of("0", "1")
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"round": 0, "participants": ["0", "1"], "tokens": 10, "train_loss": float("nan"), "bytes_up": 5, "bytes_down": 7}) + "\n")
    assert push(coord, "1", 0, filled(THETA, 0.1)).accepted  # into the open round
    page = pages(coordinator=coord, metrics=metrics)
    status, headers, body = _plain(page, "GET", "/")
    assert status == 200 and headers["Content-Type"].startswith("text/html") and b'id="sites"' in body
    assert "default-src 'none'" in headers["Content-Security-Policy"] and headers["X-Frame-Options"] == "DENY"
    status, headers, body = _plain(page, "GET", "/status.json?x=1")
    state = json.loads(body)  # strict JSON: the NaN train loss is null
    assert status == 200 and headers["Content-Type"] == "application/json" and headers["Cache-Control"] == "no-store"
    assert state["run"]["state"] == "running" and state["run"]["round"] == 0 and state["run"]["rounds"] == 3
    assert [(s["id"], s["state"], s["rounds"], s["last_push_round"], s["pushed_open_round"]) for s in state["sites"]] == [
        ("0", "active", 1, 0, False),
        ("1", "active", 1, 0, True),
    ]
    assert state["sites"][0]["pushed_s_ago"] is None and state["sites"][1]["pushed_s_ago"] >= 0
    assert state["rounds"][0]["train_loss"] is None and state["curves"]["bytes_down"] == [7.0]
    for method in ("POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "TRACE", "BREW"):
        status, headers, _ = _plain(page, method, "/status.json")
        assert (status, headers.get("Allow")) == (405, "GET"), method
    assert _plain(page, "GET", "/admin")[0] == 404
    assert _plain(page, "GET", "/", host="localhost")[0] == 200
    status, _, body = _plain(page, "GET", "/status.json", host="attacker.example")  # DNS rebinding
    assert status == 403 and b"loopback" in body
    # Plaintext off loopback is refused as the gRPC service refuses it.
    with pytest.raises(StatusPageError, match="status page on 0.0.0.0: plaintext is refused off loopback"):
        serve_status_page(StatusConfig(port=0, host="0.0.0.0"), SecurityConfig(), metrics)


def test_idle_and_garbage_connections_wedge_nothing(creds: RunCredentials, pages) -> None:  # type: ignore[no-untyped-def]
    token = (creds.sites_dir / "0.token").read_text().strip()
    page = pages(SecurityConfig(dir=str(creds.dir), auth="token"))
    idle = [socket.create_connection(("127.0.0.1", page.port), timeout=10) for _ in range(3)]  # no handshake, ever
    try:
        with socket.create_connection(("127.0.0.1", page.port), timeout=10) as junk:
            junk.sendall(b"\x16\x03\x01\x00\x05garbage" * 50)
            try:
                junk.recv(100)  # answered with an alert or closed, not hung
            except ConnectionResetError:
                pass
        assert _https(page, creds, "/status.json", token=token)[0] == 200
        # At the limit, one more connection is closed at once instead of waiting behind the others.
        idle += [socket.create_connection(("127.0.0.1", page.port), timeout=10) for _ in range(MAX_CONNECTIONS - 3)]
        _until_served(page, len(idle))
        with socket.create_connection(("127.0.0.1", page.port), timeout=10) as extra:
            assert extra.recv(100) == b""
    finally:
        for s in idle:
            s.close()
    while True:  # the idle ones gone, the page answers again (their threads end as they see the close)
        try:
            if _https(page, creds, "/status.json", token=token)[0] == 200:
                break
        except (ssl.SSLError, ConnectionError):
            time.sleep(0.05)


def _until_served(page: StatusPage, n: int) -> None:
    """Until the server has taken ``n`` connections into their own threads."""
    while page._server._slots._value > MAX_CONNECTIONS - n:  # noqa: SLF001 - the server's own count
        time.sleep(0.02)


def test_bad_status_settings_and_a_port_in_use_are_named(tmp_path: Path, pages) -> None:  # type: ignore[no-untyped-def]
    assert status_config({"port": 0, "host": "localhost"}) == StatusConfig(port=0, host="localhost")
    for values, says in (
        ({"port": "80"}, "status.port='80'"),
        ({"port": 70000}, "status.port=70000"),
        ({"port": True}, "status.port=True"),
        ({"host": ""}, "status.host=''"),
        ({"colour": 1}, "status.colour"),
    ):
        with pytest.raises(ValueError, match=re.escape(says)):
            status_config(values)
    cfg = run_config_from_dict({"sites": 2})
    with pytest.raises(ConfigError, match="status.port=-1"):
        sim_status({"port": -1}, cfg)
    with pytest.raises(ConfigError, match="status.url"):
        sim_status({"url": "x"}, cfg)
    assert sim_status({"port": 0}, cfg) == 0 and sim_status({"port": None}, cfg) is None
    assert sim_status({"port": 0}, run_config_from_dict({"mode": "ddp", "sites": 2})) is None  # no coordinator
    taken = pages()
    with pytest.raises(StatusPageError, match=f"status.port={taken.port}: 127.0.0.1:{taken.port} is already in use"):
        serve_status_page(StatusConfig(port=taken.port), SecurityConfig(), tmp_path / "metrics.jsonl")
    with pytest.raises(ConfigError, match=f"status.port={taken.port}: 127.0.0.1:{taken.port} is already in use"):
        sim_status({"port": taken.port}, cfg)
    with pytest.raises(StatusPageError, match="tokens.json not found"):
        serve_status_page(StatusConfig(port=0), SecurityConfig(dir=str(tmp_path / "nothing"), auth="token", tls=False), tmp_path / "metrics.jsonl")


def test_metrics_jsonl_is_read_as_it_grows(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    assert tail.rounds() == []  # not written yet
    path.write_text('{"round": 0, "tokens": 1}\n{"round": 1, "tok')  # a line being appended
    assert [m["round"] for m in tail.rounds()] == [0]
    with open(path, "a") as f:
        f.write('ens": 2}\nnot json\n{"round": 2, "tokens": 3}\n')
    assert [m["round"] for m in tail.rounds()] == [0, 1, 2]
    path.write_text('{"round": 0, "tokens": 9}\n')  # repaired by a restarted coordinator: shorter
    assert tail.rounds() == [{"round": 0, "tokens": 9}]
    many = [{"round": r, "tokens": 1, "bytes_up": 2, "bytes_down": 3, "train_loss": 1.0, "eval_bpb": 2.0 if r in (3, 997) else None} for r in range(5000)]
    c = curves(many, points=100)
    assert c["eval_name"] == "eval_bpb" and 100 <= len(c["round"]) <= 103 and c["round"][-1] == 4999
    assert 3 in c["round"] and 997 in c["round"]  # evaluations are always kept
    assert c["tokens"][-1] == 5000 and c["bytes_down"][-1] == 15000 and not any(math.isnan(x) for x in c["bytes_up"])
