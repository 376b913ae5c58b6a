"""A run's credentials: certificates from a run CA, hashed per-site tokens, the credentials
directory, diloco-certs, and what real gRPC mutual TLS makes of them (a server on port 0)."""

from __future__ import annotations

import ipaddress
import json
import stat
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.cli.certs import main
from diloco.security import tokens as tokens_module
from diloco.security.certs import Pem, _issue, check_pem, issue_server, issue_site, make_ca, site_id_of_cert
from diloco.security.ids import MAX_SITE_ID
from diloco.security.store import RunCredentials, add_sites, write_run_credentials
from diloco.security.tokens import TokenTable, new_token, token_hash

pytestmark = pytest.mark.timeout(60)

NOW = datetime.now(UTC)


def cert_of(pem: bytes) -> x509.Certificate:
    return x509.load_pem_x509_certificate(pem)


def san(cert: x509.Certificate) -> list[x509.GeneralName]:
    return list(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value)


def eku(cert: x509.Certificate) -> list[x509.ObjectIdentifier]:
    return list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)


def is_ca(cert: x509.Certificate) -> bool:
    return cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


@pytest.fixture(scope="module")
def ca() -> Pem:
    return make_ca("test CA", days=2)


# ---- certificates ----------------------------------------------------------------------


def test_server_and_site_certificates_are_issued_by_the_ca_and_name_what_they_should(ca: Pem) -> None:
    ca_cert = cert_of(ca.cert)
    assert is_ca(ca_cert) and ca_cert.subject == ca_cert.issuer
    server = cert_of(issue_server(ca, ["localhost", "coord.example.org", "127.0.0.1", "::1"], days=1).cert)
    server.verify_directly_issued_by(ca_cert)
    assert server.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "diloco-coordinator"
    assert san(server) == [
        x509.DNSName("localhost"),
        x509.DNSName("coord.example.org"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.IPAddress(ipaddress.ip_address("::1")),
    ]
    assert eku(server) == [ExtendedKeyUsageOID.SERVER_AUTH] and not is_ca(server)
    site = cert_of(issue_site(ca, "site-7", days=1).cert)
    site.verify_directly_issued_by(ca_cert)
    assert site.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "site-7"
    assert san(site) == [x509.UniformResourceIdentifier("urn:diloco:site:site-7")]
    assert eku(site) == [ExtendedKeyUsageOID.CLIENT_AUTH] and not is_ca(site)


def test_site_id_of_cert_reads_the_site_back_and_none_from_other_certs(ca: Pem) -> None:
    longest = "x" * MAX_SITE_ID
    for site_id in ("0", "a.b_c-d", longest):
        assert site_id_of_cert(issue_site(ca, site_id, days=1).cert) == site_id
    assert site_id_of_cert(issue_server(ca, ["localhost"], days=1).cert) is None
    assert site_id_of_cert(ca.cert) is None  # no SAN at all


def test_validity_expired_certificates_and_the_ca_cap(ca: Pem) -> None:
    expired = cert_of(issue_site(ca, "old", days=1, not_before=NOW - timedelta(days=3)).cert)
    assert expired.not_valid_after_utc < NOW
    capped = cert_of(issue_site(ca, "long", days=30).cert)
    assert capped.not_valid_after_utc == cert_of(ca.cert).not_valid_after_utc
    now = datetime.now(UTC)  # not NOW: collection may be minutes before this test runs
    fresh = cert_of(make_ca("c", days=1).cert)
    assert fresh.not_valid_before_utc < now < fresh.not_valid_after_utc  # starts a little in the past: clock skew


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda ca: issue_site(ca, "a/b", 1), "site id 'a/b' is not valid"),
        (lambda ca: issue_site(ca, "", 1), "site id '' is not valid"),
        (lambda ca: issue_server(ca, [], 1), "at least one host"),
        (lambda ca: issue_server(ca, "localhost", 1), "at least one host"),
        (lambda ca: issue_server(ca, ["bad host"], 1), "host 'bad host' is neither"),
        (lambda ca: issue_site(ca, "s", 0), "days=0"),
        (lambda ca: issue_site(ca, "s", -1), "days=-1"),
        (lambda ca: issue_site(ca, "s", float("inf")), "days=inf"),
        (lambda ca: make_ca("c", 1, not_before=datetime(2020, 1, 1)), "timezone-aware"),
    ],
)
def test_bad_certificate_requests_are_refused(ca: Pem, make: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make(ca)


def test_check_pem_refuses_a_key_of_another_certificate(ca: Pem) -> None:
    a, b = issue_site(ca, "a", 1), issue_site(ca, "b", 1)
    assert check_pem(a, "a") == a
    with pytest.raises(ValueError, match="b.key: the key does not belong"):
        check_pem(Pem(a.cert, b.key), "b.key")
    with pytest.raises(ValueError, match="junk: not a PEM"):
        check_pem(Pem(b"junk", a.key), "junk")


# ---- tokens ----------------------------------------------------------------------------


def test_new_tokens_are_distinct_and_hashed_with_plain_sha256() -> None:
    made = {new_token() for _ in range(100)}
    assert len(made) == 100 and {len(t) for t in made} == {43}
    assert token_hash("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


def test_site_of_finds_the_site_and_compares_every_hash(monkeypatch: pytest.MonkeyPatch) -> None:
    toks = {s: new_token() for s in ("a", "b", "c")}
    table = TokenTable({s: token_hash(t) for s, t in toks.items()})
    assert table.sites == frozenset(toks)
    calls = []
    real = tokens_module.hmac.compare_digest
    monkeypatch.setattr(tokens_module.hmac, "compare_digest", lambda x, y: calls.append(1) or real(x, y))
    for site_id, token in toks.items():
        assert table.site_of(token) == site_id
    for stranger in ("", "x", toks["a"] + " ", token_hash(toks["a"])):
        assert table.site_of(stranger) is None
    assert len(calls) == 3 * 7  # every lookup compares against all three, a match stops nothing


def test_a_table_refuses_bad_entries_and_shared_tokens() -> None:
    with pytest.raises(ValueError, match="site id 'a b' is not valid"):
        TokenTable({"a b": token_hash("t")})
    with pytest.raises(ValueError, match="not 64 lowercase hex"):
        TokenTable({"a": token_hash("t").upper()})
    with pytest.raises(ValueError, match="same token hash"):
        TokenTable({"a": token_hash("t"), "b": token_hash("t")})
    table = TokenTable({"a": token_hash("t")})
    with pytest.raises(ValueError, match="a already have a token"):
        table.with_tokens({"a": "u"})
    assert table.with_tokens({"b": "u"}).site_of("u") == "b" and table.site_of("u") is None


@settings(max_examples=25, deadline=None)
@given(st.dictionaries(st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,10}", fullmatch=True), st.text(min_size=1), max_size=5))
def test_a_saved_table_loads_back_to_the_same_lookups(tmp_path_factory: pytest.TempPathFactory, toks: dict[str, str]) -> None:
    if len(set(toks.values())) != len(toks):
        return  # two sites with one token is refused above
    path = tmp_path_factory.mktemp("t") / "tokens.json"
    TokenTable({}).with_tokens(toks).save(path)
    loaded = TokenTable.load(path)
    assert loaded.sites == frozenset(toks)
    assert all(loaded.site_of(t) == s for s, t in toks.items())


def test_the_saved_table_format(tmp_path: Path) -> None:
    path = tmp_path / "tokens.json"
    TokenTable({"b": token_hash("y"), "a": token_hash("x")}).save(path)
    assert json.loads(path.read_text()) == {"version": 1, "hash": "sha256", "sites": {"a": token_hash("x"), "b": token_hash("y")}}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.parametrize(
    ("tamper", "message"),
    [
        (lambda d: d.update(version=2), "token table version 2 is not 1"),
        (lambda d: d.update(hash="md5"), "token hash 'md5' is not 'sha256'"),
        (lambda d: d["sites"].update({"../x": token_hash("z")}), "site id '../x' is not valid"),
        (lambda d: d["sites"].update(a="0" * 63), "hash '000"),
        (lambda d: d["sites"].update(b=d["sites"]["a"]), "same token hash"),
        (lambda d: d.pop("sites"), "not a token table"),
    ],
)
def test_a_tampered_table_is_refused_naming_the_file(tmp_path: Path, tamper: Any, message: str) -> None:
    path = tmp_path / "tokens.json"
    TokenTable({"a": token_hash("x")}).save(path)
    data = json.loads(path.read_text())
    tamper(data)
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"{path}: .*{message}"):
        TokenTable.load(path)


def test_a_table_that_is_not_json_is_refused_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "tokens.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match=f"{path}: not a JSON token table"):
        TokenTable.load(path)


# ---- the credentials directory ---------------------------------------------------------


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_write_run_credentials_lays_out_the_directory_and_loads_back(tmp_path: Path) -> None:
    creds = write_run_credentials(tmp_path / "run", ["0", "1"], ["localhost", "127.0.0.1"], days=10)
    assert creds == RunCredentials.at(tmp_path / "run")
    names = sorted(str(p.relative_to(creds.dir)) for p in creds.dir.rglob("*"))
    assert names == ["ca.key", "ca.pem", "coordinator.key", "coordinator.pem", "sites"] + [f"sites/{s}.{e}" for s in "01" for e in ("key", "pem", "token")] + [
        "tokens.json"
    ]
    secret = [creds.ca_key, creds.coordinator_key, creds.tokens]
    secret += [p for s in "01" for p in (creds.site_files(s).key, creds.site_files(s).token)]
    assert {p.name: mode(p) for p in secret} == {p.name: 0o600 for p in secret}
    assert mode(creds.ca_cert) == 0o644 and not list(creds.dir.rglob(".*"))  # no temp file left
    table = creds.token_table()
    assert creds.site_ids() == ("0", "1") and table.sites == {"0", "1"}
    assert [table.site_of(creds.site_token(s)) for s in "01"] == ["0", "1"]
    assert site_id_of_cert(creds.site_pem("1").cert) == "1"
    cert_of(creds.coordinator_pem().cert).verify_directly_issued_by(cert_of(creds.ca_pem()))
    one = creds.site_files("1")
    assert creds.files_for_site("1") == (creds.ca_cert, one.cert, one.key, one.token)


def test_an_existing_run_is_kept_unless_forced(tmp_path: Path) -> None:
    old = write_run_credentials(tmp_path, ["0", "1"], ["localhost"])
    old_ca, old_token = old.ca_pem(), old.site_token("0")
    with pytest.raises(FileExistsError, match="ca.pem exists: .* already holds a run's credentials"):
        write_run_credentials(tmp_path, ["0"], ["localhost"])
    assert old.ca_pem() == old_ca
    new = write_run_credentials(tmp_path, ["0"], ["localhost"], force=True)
    assert new.ca_pem() != old_ca and new.site_ids() == ("0",)  # site 1's old files are gone
    assert new.token_table().site_of(old_token) is None


def test_add_sites_uses_the_same_ca_and_keeps_the_old_tokens(tmp_path: Path) -> None:
    creds = write_run_credentials(tmp_path, ["0"], ["localhost"])
    token0, ca = creds.site_token("0"), creds.ca_pem()
    add_sites(tmp_path, ["1", "x"], days=5)
    table = creds.token_table()
    assert table.site_of(token0) == "0" and table.site_of(creds.site_token("x")) == "x"
    assert creds.ca_pem() == ca and creds.site_ids() == ("0", "1", "x")
    cert_of(creds.site_pem("x").cert).verify_directly_issued_by(cert_of(ca))
    assert mode(creds.site_files("x").key) == mode(creds.site_files("x").token) == 0o600
    with pytest.raises(ValueError, match="site\\(s\\) 0 already have credentials"):
        add_sites(tmp_path, ["2", "0"])
    assert creds.site_ids() == ("0", "1", "x")  # nothing of site 2 was written


def test_add_sites_refuses_an_expired_ca(tmp_path: Path) -> None:
    creds = write_run_credentials(tmp_path, ["0"], ["localhost"])
    old = make_ca("old", days=1, not_before=NOW - timedelta(days=3))
    creds.ca_cert.write_bytes(old.cert)
    creds.ca_key.write_bytes(old.key)
    with pytest.raises(ValueError, match="ca.pem: the run CA expired at .* UTC; create new credentials"):
        add_sites(tmp_path, ["1"])


def test_missing_and_mismatched_files_are_named(tmp_path: Path) -> None:
    creds = RunCredentials.at(tmp_path)
    for load in (creds.ca_pem, creds.coordinator_pem, creds.token_table, lambda: creds.site_token("0")):
        with pytest.raises(FileNotFoundError, match=f"{tmp_path}/.* not found: .*diloco-certs"):
            load()
    with pytest.raises(FileNotFoundError, match="ca.pem not found"):
        add_sites(tmp_path, ["0"])
    write_run_credentials(tmp_path, ["0", "1"], ["localhost"])
    one = creds.site_files("1")
    one.cert.write_bytes(creds.site_files("0").cert.read_bytes())
    with pytest.raises(ValueError, match="1.key: the key does not belong"):
        creds.site_pem("1")
    one.key.write_bytes(creds.site_files("0").key.read_bytes())
    with pytest.raises(ValueError, match="1.pem: the certificate names site '0', not '1'"):
        creds.site_pem("1")
    one.token.write_text("\n")
    with pytest.raises(ValueError, match="1.token: empty token file"):
        creds.site_token("1")
    with pytest.raises(ValueError, match="site id '../ca' is not valid"):
        creds.site_files("../ca")


@pytest.mark.parametrize(
    ("ids", "hosts", "days", "message"),
    [
        ([], ["localhost"], 1, "no site ids"),
        (["a", "a"], ["localhost"], 1, "site ids repeat"),
        (["a"], [], 1, "at least one host"),
        (["a"], ["localhost"], 0, "days=0"),
    ],
)
def test_bad_requests_write_nothing(tmp_path: Path, ids: list[str], hosts: list[str], days: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        write_run_credentials(tmp_path / "run", ids, hosts, days=days)
    assert not (tmp_path / "run").exists()


# ---- diloco-certs ----------------------------------------------------------------------


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        main(list(argv))
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_creates_a_run_and_says_which_file_goes_where(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = tmp_path / "creds"
    code, out, err = run_cli(capsys, "--out", str(out_dir), "--sites", "3", "--hosts", "localhost", "127.0.0.1", "--days", "30")
    assert code == 0 and err == ""
    creds = RunCredentials.at(out_dir)
    assert creds.site_ids() == ("0", "1", "2")
    lines = out.splitlines()
    assert lines[0].startswith(f"wrote credentials for site(s) 0 1 2 to {out_dir} (valid until ")
    assert f"coordinator machine: {out_dir}/ca.pem {out_dir}/coordinator.pem {out_dir}/coordinator.key {out_dir}/tokens.json" in lines
    assert f"site 2 machine: {out_dir}/ca.pem {out_dir}/sites/2.pem {out_dir}/sites/2.key {out_dir}/sites/2.token" in lines
    code, out, err = run_cli(capsys, "--out", str(out_dir), "--add-sites", "3", "4")
    assert code == 0 and creds.site_ids() == ("0", "1", "2", "3", "4")
    assert f"coordinator machine: {out_dir}/tokens.json (updated: copy it again)" in out.splitlines()
    code, out, err = run_cli(capsys, "--out", str(tmp_path / "named"), "--sites", "alpha", "7", "--hosts", "::1")
    assert code == 0 and RunCredentials.at(tmp_path / "named").site_ids() == ("7", "alpha")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--sites", "a/b", "--hosts", "localhost"], "site id 'a/b' is not valid"),
        (["--sites", "0", "--hosts", "localhost"], "no site ids"),
        (["--sites", "2"], "--hosts is required with --sites"),
        (["--sites", "2", "--hosts", "a host"], "host 'a host' is neither"),
        (["--sites", "2", "--hosts", "localhost", "--days", "0"], "days=0"),
        (["--sites", "2", "--hosts", "localhost", "--days", "-3"], "days=-3"),
        (["--add-sites", "9"], "ca.pem not found"),
        (["--add-sites", "9", "--hosts", "localhost"], "--hosts and --force apply to a new run"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    code, out, err = run_cli(capsys, "--out", str(tmp_path / "c"), *argv)
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and message in err


def test_cli_refuses_an_existing_run_without_force(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ("--out", str(tmp_path), "--sites", "1", "--hosts", "localhost")
    assert run_cli(capsys, *args)[0] == 0
    code, out, err = run_cli(capsys, *args)
    assert code == 2 and err == f"error: {tmp_path}/ca.pem exists: {tmp_path} already holds a run's credentials (--force replaces them)\n"
    assert run_cli(capsys, *args, "--force")[0] == 0


def test_cli_help_documents_the_count_form(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "--help")
    assert code == 0 and "a single integer N means 0..N-1" in out


# ---- real gRPC mutual TLS --------------------------------------------------------------


@dataclass
class Server:
    port: int
    calls: list[dict[str, Any]] = field(default_factory=list)


def _identity(b: bytes) -> bytes:
    return b


@contextmanager
def serving(pem: Pem, root: bytes) -> Iterator[Server]:
    """A gRPC server on 127.0.0.1:0 that requires a client certificate from ``root`` and
    records what each call's context says about its peer."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    state = Server(port=0)

    def echo(request: bytes, context: grpc.ServicerContext) -> bytes:
        state.calls.append({"auth": context.auth_context(), "identities": context.peer_identities(), "key": context.peer_identity_key()})
        return request

    handler = grpc.unary_unary_rpc_method_handler(echo, request_deserializer=_identity, response_serializer=_identity)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Echo", {"Echo": handler}),))
    try:
        creds = grpc.ssl_server_credentials([(pem.key, pem.cert)], root_certificates=root, require_client_auth=True)
        state.port = server.add_secure_port("127.0.0.1:0", creds)
        server.start()
        yield state
    finally:
        server.stop(grace=None)


def call(port: int, creds: grpc.ChannelCredentials, name_override: str | None = None) -> bytes:
    options = [("grpc.ssl_target_name_override", name_override)] if name_override else []
    with grpc.secure_channel(f"127.0.0.1:{port}", creds, options=options) as channel:
        return channel.unary_unary("/test.Echo/Echo", request_serializer=_identity, response_deserializer=_identity)(b"hi", timeout=10)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> RunCredentials:
    return write_run_credentials(tmp_path_factory.mktemp("run"), ["0", "1"], ["localhost", "127.0.0.1"], days=1)


def test_grpc_names_the_site_in_the_auth_context(run: RunCredentials) -> None:
    site = run.site_pem("1")
    with serving(run.coordinator_pem(), run.ca_pem()) as server:
        for override in (None, "localhost"):
            assert call(server.port, grpc.ssl_channel_credentials(run.ca_pem(), site.key, site.cert), override) == b"hi"
    seen = server.calls[0]
    auth = seen["auth"]
    assert auth["transport_security_type"] == [b"ssl"]
    assert auth["x509_common_name"] == [b"1"] and auth["x509_subject"] == [b"CN=1"]
    assert auth["x509_subject_alternative_name"] == [b"urn:diloco:site:1"] == auth["peer_uri"]
    assert seen["key"] == "x509_subject_alternative_name" and seen["identities"] == [b"urn:diloco:site:1"]
    assert site_id_of_cert(auth["x509_pem_cert"][0]) == "1"
    assert server.calls[1]["auth"]["ssl_requested_server_name"] == [b"localhost"]


def test_grpc_refuses_clients_without_a_valid_site_certificate(run: RunCredentials) -> None:
    other = make_ca("another run", days=1)
    foreign = issue_site(other, "1", days=1)
    expired = issue_site(Pem(run.ca_pem(), run.ca_key.read_bytes()), "1", days=1, not_before=NOW - timedelta(days=3))
    server_pem = run.coordinator_pem()
    clients = {
        "another CA's site": grpc.ssl_channel_credentials(run.ca_pem(), foreign.key, foreign.cert),
        "expired site cert": grpc.ssl_channel_credentials(run.ca_pem(), expired.key, expired.cert),
        "no client cert": grpc.ssl_channel_credentials(run.ca_pem()),
        "the server's cert (serverAuth only)": grpc.ssl_channel_credentials(run.ca_pem(), server_pem.key, server_pem.cert),
    }
    with serving(server_pem, run.ca_pem()) as server:
        for name, creds in clients.items():
            with pytest.raises(grpc.RpcError) as refused:
                call(server.port, creds)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, name
    assert server.calls == []  # no refused client reached the handler


@pytest.mark.parametrize(
    ("server_cert", "refusal"),
    [
        ("site", "CERTIFICATE_VERIFY_FAILED: unsupported certificate purpose"),  # clientAuth only
        ("other host", "Hostname Verification Check failed"),
    ],
)
def test_grpc_clients_refuse_a_site_certificate_or_another_host_as_the_server(run: RunCredentials, server_cert: str, refusal: str) -> None:
    ca = Pem(run.ca_pem(), run.ca_key.read_bytes())
    pem = run.site_pem("1") if server_cert == "site" else issue_server(ca, ["coord.example.org"], days=1)
    site = run.site_pem("0")
    client = grpc.ssl_channel_credentials(run.ca_pem(), site.key, site.cert)
    with serving(pem, run.ca_pem()) as server:
        for override in (None, "localhost", "1"):
            with pytest.raises(grpc.RpcError) as refused:
                call(server.port, client, override)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert refusal in (refused.value.details() or ""), override
    assert server.calls == []


def test_grpc_hostname_check_falls_back_to_the_cn_so_the_eku_is_what_stops_a_site_serving(run: RunCredentials) -> None:
    """Pins gRPC behaviour the design relies on: a URI SAN does not stop the hostname check from
    matching the CN (a site named 'localhost' would match 'localhost'); clientAuth-only does."""
    ca = Pem(run.ca_pem(), run.ca_key.read_bytes())
    uri = [x509.UniformResourceIdentifier("urn:diloco:site:localhost")]
    like_a_site_but_server_auth = _issue(ca, "localhost", uri, ExtendedKeyUsageOID.SERVER_AUTH, 1, None)
    site = run.site_pem("0")
    client = grpc.ssl_channel_credentials(run.ca_pem(), site.key, site.cert)
    with serving(like_a_site_but_server_auth, run.ca_pem()) as server:
        assert call(server.port, client, "localhost") == b"hi"
    with serving(issue_site(ca, "localhost", days=1), run.ca_pem()) as server:
        with pytest.raises(grpc.RpcError, match="unsupported certificate purpose"):
            call(server.port, client, "localhost")
