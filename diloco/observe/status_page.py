"""The coordinator's status page: a small read-only web page of the run, on its own port
(``status.port``), served by the standard library's ThreadingHTTPServer (and ``ssl``).

``GET /`` is the page (status_page.html: no external resource, the curves are inline SVG) and
``GET /status.json`` the run's state (status_state.py), which the page fetches every 2 s. Any
other method is answered 405, any other path 404: the page can change nothing.

It obeys the run's security settings (docs/observability.md):

- without credentials (plaintext) it listens on loopback only, unless ``security.insecure``
  (the gRPC service's rule), and refuses requests whose Host header is not a loopback name
  (so that a web page elsewhere cannot read it through DNS rebinding);
- with ``security.tls`` it serves HTTPS with the coordinator's certificate from the run CA;
- ``security.auth`` = mtls or both: the TLS handshake requires a client certificate of the run
  CA (a site's), as the gRPC service does;
- ``security.auth`` = token or both: ``/status.json`` requires ``Authorization: Bearer
  <token>`` with a site's token (checked against tokens.json, which holds only their hashes).
  The page itself holds no data and is served without it; it takes the token from the URL's
  fragment (``/#token=...``, which browsers never send to a server) and sends it with each fetch.

No input can stop it: at most MAX_CONNECTIONS connections at once (more are closed at once),
each with a socket timeout (the TLS handshake too, in the connection's own thread).
"""

from __future__ import annotations

import base64
import errno
import hashlib
import http.server
import json
import re
import socket
import ssl
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit

from diloco.fields import setting
from diloco.io import write_json_atomic
from diloco.observe.config import EndpointConfig, parse_section
from diloco.observe.status_state import RunState
from diloco.observe.watched import WatchedCoordinator
from diloco.security.config import SecurityConfig, is_loopback
from diloco.security.store import RunCredentials
from diloco.security.tokens import TokenTable

MAX_CONNECTIONS = 16  # connections served at once; more are closed without an answer
SOCKET_TIMEOUT_S = 10.0  # a connection that sends nothing for this long (TLS handshake included) is dropped
_BEARER = re.compile(r"Bearer ([A-Za-z0-9._~+/=-]{1,512})")


class StatusPageError(ValueError):
    """The page cannot listen where it was told to; the message names the field and port."""


@dataclass(frozen=True)
class StatusConfig(EndpointConfig):
    """The coordinator's ``status`` section: a read-only status page of the run (GET / and
    /status.json); port null (the default): no page."""

    SECTION: ClassVar[str] = "status"
    OFF: ClassVar[str] = "no status page"

    host: str = setting(
        "127.0.0.1",
        doc="the address it listens on; off loopback it needs the run's TLS (security.dir) or security.insecure; it asks for the credentials security.auth names",
    )
    port_file: str | None = setting(
        None, doc='where {"host", "port", "url", "tls", "client_certificate", "token"} is written as JSON (useful with port=0); null: nowhere'
    )


def status_config(values: Mapping[str, Any] | None, **extra: Any) -> StatusConfig:
    """The ``status`` section (plain data) as a StatusConfig; unknown keys are named."""
    return parse_section(StatusConfig, "status", values, **extra)


# ---- the run's security settings, for HTTP --------------------------------------------------


@dataclass(frozen=True)
class PageSecurity:
    """``context``: TLS (None: plaintext); ``tokens``: the bearer tokens /status.json takes
    (None: none needed); ``loopback``: only loopback Host headers are answered."""

    context: ssl.SSLContext | None = None
    tokens: TokenTable | None = None
    client_certificate: bool = False
    loopback: bool = False

    def describe(self) -> str:
        if self.context is None:
            return "plaintext" + (", loopback only" if self.loopback else "")
        needs = [
            w
            for w, on in (("a client certificate of the run CA", self.client_certificate), ("a site's bearer token for /status.json", self.tokens is not None))
            if on
        ]
        return "HTTPS with the run's certificate" + (f"; needs {' and '.join(needs)}" if needs else "")


def page_security(security: SecurityConfig, host: str) -> PageSecurity:
    """How the page on ``host`` is protected, from the run's security settings; ValueError (naming
    the field or file) where they cannot work, as the gRPC service would refuse them."""
    security.check_address(host, "the status page")
    if security.dir is None:
        return PageSecurity(loopback=is_loopback(host))
    creds = RunCredentials.at(security.dir)
    context = None
    if security.tls:
        creds.coordinator_pem()  # a missing or bad file is named here
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(str(creds.coordinator_cert), str(creds.coordinator_key))
        if security.mtls:
            creds.ca_pem()
            context.verify_mode = ssl.CERT_REQUIRED
            context.load_verify_locations(cafile=str(creds.ca_cert))
    tokens = creds.token_table() if security.tokens else None
    return PageSecurity(context, tokens, client_certificate=security.mtls, loopback=context is None and is_loopback(host))


def access_hint(security: SecurityConfig) -> str:
    """What a browser needs to open the page of a run with these settings, naming the files of
    the credentials directory ("" for plaintext)."""
    if security.dir is None:
        return ""
    creds = RunCredentials.at(security.dir)
    needs = [f"trust {creds.ca_cert}" if security.uses_tls else "plaintext"]
    if security.mtls:
        needs.append(f"a site's client certificate ({creds.sites_dir}/<id>.pem and .key)")
    if security.tokens:
        needs.append(f"a site's token: open the page as URL#token=<the content of {creds.sites_dir}/<id>.token>")
    return " (" + "; ".join(needs) + ")"


# ---- the page -------------------------------------------------------------------------------


def _page() -> tuple[bytes, str]:
    """The page's bytes and its Content-Security-Policy: nothing but its own inline script and
    style (by hash), fetches to its own origin, no frames, forms or external resources."""
    html = resources.files("diloco.observe").joinpath("status_page.html").read_text(encoding="utf-8")

    def hashes(tag: str) -> str:
        found = re.findall(rf"<{tag}>(.*?)</{tag}>", html, flags=re.S)
        return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(body.encode()).digest()).decode()}'" for body in found)

    csp = (
        f"default-src 'none'; script-src {hashes('script')}; style-src {hashes('style')}; connect-src 'self'; img-src 'self' data:; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )
    return html.encode("utf-8"), csp


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server
    server_version = "diloco-status"
    sys_version = ""
    timeout = SOCKET_TIMEOUT_S
    protocol_version = "HTTP/1.0"  # one request per connection: no idle connection holds a slot

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.server.security.loopback and not _loopback_host(self.headers.get("Host", "")):
            self._reply(403, {"error": "this status page answers to a loopback host name only (localhost, 127.0.0.1, [::1])"})
            return
        path = urlsplit(self.path).path
        if path in ("/", "/index.html"):
            self._send(200, self.server.page, "text/html; charset=utf-8", {"Content-Security-Policy": self.server.csp})
        elif path == "/status.json":
            why = self._unauthorized()
            if why:
                self._reply(401, {"error": why}, {"WWW-Authenticate": 'Bearer realm="diloco status"'})
                return
            try:
                body = self.server.state.json_bytes()
            except Exception as e:  # noqa: BLE001 - the page reports it; the server goes on
                self._reply(500, {"error": f"the run's state could not be read: {type(e).__name__}: {e}"})
                return
            self._send(200, body, "application/json")
        else:
            self._reply(404, {"error": f"no such page: {path[:100]!r}; the page is / and its data /status.json"})

    def _unauthorized(self) -> str | None:
        tokens = self.server.security.tokens
        if tokens is None:
            return None
        m = _BEARER.fullmatch(self.headers.get("Authorization", "").strip())
        if m is None:
            return "this run's status needs a site's token: 'Authorization: Bearer <token>' (in a browser: open the page as /#token=<token>)"
        if tokens.site_of(m.group(1)) is None:
            return "the token is not one this run issued"
        return None

    def _not_allowed(self) -> None:
        self._reply(405, {"error": f"method {str(self.command)[:20]!r} not allowed: the status page is read-only (GET)"}, {"Allow": "GET"})

    def __getattr__(self, name: str) -> Any:
        # Every method but GET (HEAD, POST, PUT, DELETE, any other word) is answered 405, not 501.
        if name.startswith("do_"):
            return self._not_allowed
        raise AttributeError(name)

    def _reply(self, code: int, body: dict[str, Any], headers: Mapping[str, str] | None = None) -> None:
        self._send(code, json.dumps(body).encode(), "application/json", headers)

    def _send(self, code: int, body: bytes, content_type: str, headers: Mapping[str, str] | None = None) -> None:
        self.send_response(code)
        for k, v in {
            "Content-Type": content_type, "Content-Length": str(len(body)), "Cache-Control": "no-store", "X-Content-Type-Options": "nosniff",
            "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer", **(headers or {}),
        }.items():  # fmt: skip
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's name
        pass  # requests are not logged (a page polled every 2 s would fill the log)


def _loopback_host(host: str) -> bool:
    """A Host header naming this machine: localhost, 127.0.0.0/8 or [::1], any port."""
    name = host.strip()
    name = name[1 : name.index("]")] if name.startswith("[") and "]" in name else name.rsplit(":", 1)[0] if name.count(":") == 1 else name
    return bool(name) and is_loopback(name)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = MAX_CONNECTIONS

    def __init__(self, address: tuple[str, int], state: RunState, security: PageSecurity) -> None:
        self.state, self.security = state, security
        self.page, self.csp = _page()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # full: closed at once, never queued behind the others
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def finish_request(self, request: Any, client_address: Any) -> None:
        """In the connection's own thread: the TLS handshake (bounded by the socket timeout),
        then the request."""
        request.settimeout(SOCKET_TIMEOUT_S)
        if self.security.context is None:
            self.RequestHandlerClass(request, client_address, self)
            return
        tls = self.security.context.wrap_socket(request, server_side=True)
        try:
            self.RequestHandlerClass(tls, client_address, self)
        finally:
            self.shutdown_request(tls)

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that hung up, sent garbage or failed the handshake: its connection only


@dataclass
class StatusPage:
    """A running status page; ``attach`` the coordinator it shows, ``close`` to stop it."""

    host: str
    port: int
    security: PageSecurity
    state: RunState
    _server: _Server
    _thread: threading.Thread

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.security.context else 'http'}://{host}:{self.port}/"

    def attach(self, coordinator: WatchedCoordinator) -> None:
        """The diloco.coordinator.Coordinator the page shows (until then it says ``starting``)."""
        self.state.attach(coordinator)

    def chain(self, then: Callable[[Any], None] | None) -> Callable[[WatchedCoordinator], None]:
        """An ``attach`` callback that attaches the page, then calls ``then`` (if any)."""

        def attach(coordinator: WatchedCoordinator) -> None:
            self.attach(coordinator)
            if then is not None:
                then(coordinator)

        return attach

    def address(self) -> dict[str, Any]:
        """Where the page is and what it asks of a browser (the port file's content)."""
        return {
            "host": self.host, "port": self.port, "url": self.url, "tls": self.security.context is not None,
            "client_certificate": self.security.client_certificate, "token": self.security.tokens is not None,
        }  # fmt: skip

    def write(self, path: Path) -> None:
        write_json_atomic(Path(path), self.address())

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5.0)


def serve_status_page(cfg: StatusConfig, security: SecurityConfig, metrics_path: Path, about: Mapping[str, Any] | None = None) -> StatusPage:
    """Starts the page on ``cfg.host``:``cfg.port`` (0: any free port) with the run's security
    settings; StatusPageError naming the field when the port is taken or the host unusable,
    ValueError when the security settings do not allow it. Writes ``cfg.port_file`` if set."""
    if not cfg.enabled:
        raise ValueError("status.port is null: no status page to serve")
    try:
        protection = page_security(security, cfg.host)
    except (ValueError, FileNotFoundError, ssl.SSLError) as e:
        raise StatusPageError(f"status page: {e}") from None
    try:
        server = _Server((cfg.host, int(cfg.port or 0)), RunState(metrics_path, about), protection)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise StatusPageError(f"status.port={cfg.port}: {cfg.host}:{cfg.port} is already in use; choose another port, or 0 for any free one") from None
        raise StatusPageError(f"status.host={cfg.host}, status.port={cfg.port}: cannot listen there: {e.strerror or e}") from None
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="status-page", daemon=True)
    thread.start()
    page = StatusPage(cfg.host, int(server.server_address[1]), protection, server.state, server, thread)
    if cfg.port_file:
        page.write(Path(cfg.port_file))
    return page
