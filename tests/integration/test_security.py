"""Credentials through real gRPC on 127.0.0.1: TLS with the run CA, client certificates that
name a site, bearer tokens; a call whose credentials do not prove the site id it names is
refused and changes nothing."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import torch
from helpers import expect_refused, filled, join, push

from diloco.coordinator import Coordinator, CoordinatorConfig
from diloco.outer import OuterConfig
from diloco.security.certs import Pem, issue_site, make_ca
from diloco.security.config import SecurityConfig, is_loopback
from diloco.security.store import RunCredentials, add_sites, write_run_credentials
from diloco.security.tokens import new_token
from diloco.transport import CoordinatorClient, serve

pytestmark = pytest.mark.timeout(60)
THETA = {"w": torch.arange(12, dtype=torch.float32).reshape(4, 3) / 10}
DELTA = filled(THETA, 0.1)


@pytest.fixture(scope="module")
def creds_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("creds")
    write_run_credentials(d, ["0", "1"], hosts=["localhost", "127.0.0.1"], days=1, force=True)
    return d


class Secured:
    def __init__(self, creds: Path, auth: str) -> None:
        self.creds, self.auth = creds, auth
        sites = tuple(sorted(RunCredentials.at(creds).token_table().sites))
        self.coord = Coordinator(THETA, OuterConfig(), CoordinatorConfig(total_rounds=2, min_sites=2, sites=sites))
        self.server, port = serve(self.coord, "127.0.0.1", 0, security=SecurityConfig(dir=str(creds), auth=auth))
        self.address = f"127.0.0.1:{port}"
        self.clients: list[CoordinatorClient] = []

    def client(self, as_site: str, creds: Path | None = None, connect_timeout_s: float = 3.0, **security: object) -> CoordinatorClient:
        cfg = SecurityConfig(**{"dir": str(creds or self.creds), "auth": self.auth, **security})  # type: ignore[arg-type]
        c = CoordinatorClient(self.address, timeout_s=10, connect_timeout_s=connect_timeout_s, security=cfg, site_id=as_site)
        self.clients.append(c)
        return c

    def close(self) -> None:
        for c in self.clients:
            c.close()
        self.server.stop(grace=None).wait(5)


@pytest.fixture(params=["mtls", "token", "both"])
def secured(request: pytest.FixtureRequest, creds_dir: Path) -> Iterator[Secured]:
    s = Secured(creds_dir, request.param)
    try:
        yield s
    finally:
        s.close()


_refused = expect_refused


def test_sites_with_their_own_credentials_run_a_round(secured: Secured) -> None:
    a, b = secured.client("0"), secured.client("1")
    join(a, THETA, "0")
    join(b, THETA, "1")
    assert push(a, "0", 0, DELTA).accepted and push(b, "1", 0, DELTA).accepted
    assert a.wait_round("0", 0, timeout_s=5).committed_rounds == 1
    status, chunks = b.pull_global("1")
    assert status.global_sha256 == secured.coord.global_sha256() and chunks
    a.leave("0", status.global_sha256)


def test_credentials_of_one_site_cannot_act_for_another(secured: Secured) -> None:
    """A client could join under a real site's id, push in its name (the real site's push was
    then a "duplicate"), or make it leave."""
    real, other = secured.client("0"), secured.client("1")
    join(real, THETA, "0")
    before = secured.coord.global_sha256()
    err = _refused(lambda: join(other, THETA, "0"), "permission_denied")
    assert "cannot act for site '0'" in err.message
    _refused(lambda: push(other, "0", 0, DELTA), "permission_denied")
    _refused(lambda: other.leave("0", ""), "permission_denied")
    _refused(lambda: other.heartbeat("0"), "permission_denied")
    _refused(lambda: other.wait_round("0", 0, timeout_s=0.1), "permission_denied")
    assert secured.coord.active_sites == frozenset({"0"}) and secured.coord.global_sha256() == before
    assert push(real, "0", 0, DELTA).accepted and not push(real, "0", 0, DELTA).accepted  # the real push counted; a repeat is the duplicate


def _copy_with_site_cert(creds: Path, tmp: Path, pem: Pem, site: str = "0") -> Path:
    bad = tmp / "bad"
    shutil.copytree(creds, bad)
    files = RunCredentials.at(bad).site_files(site)
    files.cert.write_bytes(pem.cert)
    files.key.write_bytes(pem.key)
    return bad


def _run_ca(creds: Path) -> Pem:
    rc = RunCredentials.at(creds)
    return Pem(rc.ca_cert.read_bytes(), rc.ca_key.read_bytes())


@pytest.mark.parametrize("case", ["another CA", "expired", "no certificate", "plaintext"])
def test_mtls_refuses_a_client_without_a_valid_certificate_of_the_run(creds_dir: Path, tmp_path: Path, case: str) -> None:
    s = Secured(creds_dir, "mtls")
    wait = 1.0  # a refused handshake is retried until the connect timeout: the refusal comes then
    try:
        if case == "another CA":
            client = s.client("0", _copy_with_site_cert(creds_dir, tmp_path, issue_site(make_ca("other", 1), "0", 1)), connect_timeout_s=wait)
        elif case == "expired":
            old = issue_site(_run_ca(creds_dir), "0", days=1, not_before=datetime.now(UTC) - timedelta(days=3))
            client = s.client("0", _copy_with_site_cert(creds_dir, tmp_path, old), connect_timeout_s=wait)
        elif case == "no certificate":
            client = s.client("0", auth="token", connect_timeout_s=wait)  # TLS with the run CA, but no client certificate
        else:
            client = CoordinatorClient(s.address, timeout_s=5, connect_timeout_s=wait)
            s.clients.append(client)
        _refused(lambda: join(client, THETA, "0"), "unavailable", "internal")
        assert s.coord.active_sites == frozenset()
    finally:
        s.close()


@pytest.mark.parametrize("token", ["never issued", "garbage"])
def test_token_auth_refuses_an_unknown_token(creds_dir: Path, tmp_path: Path, token: str) -> None:
    s = Secured(creds_dir, "token")
    try:
        bad = tmp_path / "bad"
        shutil.copytree(creds_dir, bad)
        RunCredentials.at(bad).site_files("0").token.write_text(new_token() if token == "never issued" else "x")
        client = s.client("0", bad)
        err = _refused(lambda: join(client, THETA, "0"), "unauthenticated")
        assert "token" in err.message
        assert s.coord.active_sites == frozenset()
    finally:
        s.close()


def test_a_site_that_was_not_issued_credentials_cannot_join(creds_dir: Path, tmp_path: Path) -> None:
    """Only the configured site ids may join: a third site's token is not in the coordinator's table."""
    s = Secured(creds_dir, "token")
    try:
        extra = tmp_path / "extra"
        shutil.copytree(creds_dir, extra)
        add_sites(extra, ["2"], days=1)
        client = s.client("2", extra)
        _refused(lambda: join(client, THETA, "2"), "unauthenticated")
    finally:
        s.close()


def test_plaintext_is_refused_off_loopback_unless_insecure() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and not is_loopback("10.0.0.1")
    with pytest.raises(ValueError, match="plaintext is refused off loopback"):
        SecurityConfig().check_address("0.0.0.0", "the coordinator")
    with pytest.raises(ValueError, match="plaintext is refused off loopback"):
        CoordinatorClient("coord.example.com:50051", site_id="0")
    SecurityConfig(insecure=True).check_address("0.0.0.0", "the coordinator")  # said explicitly
    coord = Coordinator(THETA, OuterConfig(), CoordinatorConfig(total_rounds=1))
    with pytest.raises(ValueError, match="security.dir"):
        serve(coord, "0.0.0.0", 0)  # refused before anything binds


def test_security_config_names_what_cannot_work() -> None:
    with pytest.raises(ValueError, match="security.auth='password'"):
        SecurityConfig(dir="x", auth="password")
    with pytest.raises(ValueError, match="needs security.tls=true"):
        SecurityConfig(dir="x", tls=False, auth="mtls")
    with pytest.raises(FileNotFoundError, match="diloco-certs"):
        serve(Coordinator(THETA, OuterConfig(), CoordinatorConfig(total_rounds=1)), "127.0.0.1", 0, security=SecurityConfig(dir="/nonexistent/creds"))


def test_token_auth_refuses_a_call_without_a_token(creds_dir: Path) -> None:
    s = Secured(creds_dir, "token")
    try:
        client = s.client("0", auth="mtls")  # TLS, a certificate the server does not ask for, no token
        err = _refused(lambda: join(client, THETA, "0"), "unauthenticated")
        assert "no bearer token" in err.message
    finally:
        s.close()
