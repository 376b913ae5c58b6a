"""A run's credentials directory, as diloco-certs writes it, and loading it back::

    DIR/ca.pem  DIR/ca.key                   the run CA (its key stays to add sites later)
    DIR/coordinator.pem  DIR/coordinator.key the coordinator's server certificate
    DIR/tokens.json                          the coordinator's table of token hashes
    DIR/sites/<id>.pem .key .token           what site <id> gets

Keys and tokens are written 0600, every file atomically."""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from diloco.security.certs import Pem, check_pem, issue_server, issue_site, make_ca, not_valid_after, site_id_of_cert
from diloco.security.ids import check_site_id, site_id_problem
from diloco.security.tokens import TokenTable, new_token, write_atomic

DEFAULT_DAYS = 365
_HINT = "create a run's credentials with diloco-certs --out DIR --sites ... --hosts ..."
_SECRET = 0o600
_PUBLIC = 0o644


@dataclass(frozen=True)
class SiteFiles:
    """The files of one site: its certificate, key and token."""

    cert: Path
    key: Path
    token: Path


@dataclass(frozen=True)
class RunCredentials:
    """The paths of a run's credentials directory, with loaders that name the missing or bad
    file. Build it with ``RunCredentials.at(dir)``."""

    dir: Path
    ca_cert: Path
    ca_key: Path
    coordinator_cert: Path
    coordinator_key: Path
    tokens: Path
    sites_dir: Path

    @classmethod
    def at(cls, dir: Path | str) -> RunCredentials:
        d = Path(dir)
        return cls(d, d / "ca.pem", d / "ca.key", d / "coordinator.pem", d / "coordinator.key", d / "tokens.json", d / "sites")

    def site_files(self, site_id: str) -> SiteFiles:
        check_site_id(site_id)
        return SiteFiles(*(self.sites_dir / f"{site_id}.{ext}" for ext in ("pem", "key", "token")))

    def files_for_coordinator(self) -> tuple[Path, ...]:
        """What the coordinator's machine needs."""
        return (self.ca_cert, self.coordinator_cert, self.coordinator_key, self.tokens)

    def files_for_site(self, site_id: str) -> tuple[Path, ...]:
        """What site ``site_id``'s machine needs."""
        f = self.site_files(site_id)
        return (self.ca_cert, f.cert, f.key, f.token)

    def ca_pem(self) -> bytes:
        """The run CA's certificate (the root both ends verify the other against)."""
        return _read(self.ca_cert)

    def coordinator_pem(self) -> Pem:
        return check_pem(Pem(_read(self.coordinator_cert), _read(self.coordinator_key)), str(self.coordinator_key))

    def site_pem(self, site_id: str) -> Pem:
        """Site ``site_id``'s certificate and key; ValueError if the certificate names another site."""
        f = self.site_files(site_id)
        pem = check_pem(Pem(_read(f.cert), _read(f.key)), str(f.key))
        named = site_id_of_cert(pem.cert)
        if named != site_id:
            raise ValueError(f"{f.cert}: the certificate names site {named!r}, not {site_id!r}")
        return pem

    def site_token(self, site_id: str) -> str:
        path = self.site_files(site_id).token
        token = _read(path).decode().strip()
        if not token:
            raise ValueError(f"{path}: empty token file ({_HINT})")
        return token

    def token_table(self) -> TokenTable:
        try:
            return TokenTable.load(self.tokens)
        except FileNotFoundError:
            raise _not_found(self.tokens) from None

    def site_ids(self) -> tuple[str, ...]:
        """The sites this directory holds a certificate for, sorted. (The coordinator's machine
        has no sites/ folder: it knows its sites from ``token_table().sites``.)"""
        names = (p.name[: -len(".pem")] for p in self.sites_dir.glob("*.pem"))
        return tuple(sorted(n for n in names if site_id_problem(n) is None))


def write_run_credentials(dir: Path | str, site_ids: Sequence[str], hosts: Sequence[str], days: float = DEFAULT_DAYS, force: bool = False) -> RunCredentials:
    """Creates a run's credentials in ``dir``: a new CA, the coordinator's certificate for
    ``hosts``, and a certificate and token per site, all valid ``days`` days. Refuses
    (FileExistsError) a directory that already holds credentials unless ``force``;
    with ``force`` the old sites' files are removed (the old CA no longer vouches for them)."""
    creds = RunCredentials.at(dir)
    ids = _new_ids(site_ids)
    existing = [p for p in (creds.ca_cert, creds.ca_key, creds.tokens) if p.exists()] + _site_file_paths(creds)
    if existing and not force:
        raise FileExistsError(f"{existing[0]} exists: {creds.dir} already holds a run's credentials (--force replaces them)")
    # A random suffix tells two runs' CAs apart to whoever inspects a certificate.
    ca = make_ca(f"diloco run CA {secrets.token_hex(4)}", days)
    server = issue_server(ca, hosts, days)
    sites = _issue_sites(ca, ids, days)
    creds.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    for old in _site_file_paths(creds):
        old.unlink()
    _write_pem(creds.ca_cert, creds.ca_key, ca)
    _write_pem(creds.coordinator_cert, creds.coordinator_key, server)
    _write_sites(creds, sites)
    TokenTable({}).with_tokens({s: token for s, (_, token) in sites.items()}).save(creds.tokens)
    return creds


def add_sites(dir: Path | str, site_ids: Sequence[str], days: float = DEFAULT_DAYS) -> RunCredentials:
    """Issues certificates and tokens for more sites with ``dir``'s CA and adds them to its
    tokens.json (copy that to the coordinator again). ValueError for a site already there.
    A certificate expires no later than the CA."""
    creds = RunCredentials.at(dir)
    ids = _new_ids(site_ids)
    ca = check_pem(Pem(_read(creds.ca_cert), _read(creds.ca_key)), str(creds.ca_key))
    expiry = not_valid_after(ca.cert)
    if expiry <= datetime.now(UTC):
        raise ValueError(f"{creds.ca_cert}: the run CA expired at {expiry:%Y-%m-%d %H:%M} UTC; create new credentials")
    table = creds.token_table()
    taken = sorted(set(ids) & (table.sites | set(creds.site_ids())))
    if taken:
        raise ValueError(f"site(s) {', '.join(taken)} already have credentials in {creds.dir}")
    sites = _issue_sites(ca, ids, days)
    _write_sites(creds, sites)
    table.with_tokens({s: token for s, (_, token) in sites.items()}).save(creds.tokens)
    return creds


def _new_ids(site_ids: Iterable[str]) -> list[str]:
    ids = [check_site_id(s) for s in site_ids]
    if not ids:
        raise ValueError("no site ids: a run needs at least one site")
    if len(set(ids)) != len(ids):
        raise ValueError(f"site ids repeat: {' '.join(ids)}")
    return ids


def _issue_sites(ca: Pem, ids: list[str], days: float) -> dict[str, tuple[Pem, str]]:
    """Every site's certificate and token, made before any file is written."""
    return {s: (issue_site(ca, s, days), new_token()) for s in ids}


def _write_sites(creds: RunCredentials, sites: dict[str, tuple[Pem, str]]) -> None:
    creds.sites_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    for site_id, (pem, token) in sites.items():
        f = creds.site_files(site_id)
        _write_pem(f.cert, f.key, pem)
        write_atomic(f.token, (token + "\n").encode(), _SECRET)


def _write_pem(cert_path: Path, key_path: Path, pem: Pem) -> None:
    write_atomic(key_path, pem.key, _SECRET)
    write_atomic(cert_path, pem.cert, _PUBLIC)


def _site_file_paths(creds: RunCredentials) -> list[Path]:
    return [p for ext in ("pem", "key", "token") for p in creds.sites_dir.glob(f"*.{ext}")]


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise _not_found(path) from None


def _not_found(path: Path) -> FileNotFoundError:
    return FileNotFoundError(f"{path} not found: {_HINT}")
