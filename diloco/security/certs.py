"""TLS certificates of a run: a run CA, the coordinator's server certificate and one client
certificate per site. EC P-256 keys, SHA-256 signatures, PEM bytes in and out.

A site certificate names its site in two places: the subject CN and a SAN URI
``urn:diloco:site:<id>`` (gRPC's peer identity: ``peer_identities()``). Its extended key usage is
clientAuth only, and that is what stops it serving: gRPC refuses it as a server's certificate
("unsupported certificate purpose"). Its names would not: with no DNS name in the SAN, gRPC's
hostname check falls back to the CN, so a site named "localhost" matches "localhost"."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from diloco.security.ids import check_site_id, quote

COORDINATOR_CN = "diloco-coordinator"
SITE_URI_PREFIX = "urn:diloco:site:"
# A default start a little in the past: a machine whose clock is slightly behind still
# accepts a certificate issued a moment ago.
CLOCK_SKEW = timedelta(minutes=5)
MAX_DAYS = 36525  # 100 years: far enough, and clear of the X.509 date limit (year 9999)
_HOST = re.compile(r"[A-Za-z0-9*_.-]{1,253}")


@dataclass(frozen=True)
class Pem:
    """A certificate and its private key, PEM-encoded (the key unencrypted PKCS8)."""

    cert: bytes
    key: bytes


def make_ca(name: str, days: float, not_before: datetime | None = None) -> Pem:
    """A self-signed run CA named ``name``, valid ``days`` days from ``not_before`` (default:
    now, less CLOCK_SKEW). It signs end-entity certificates only (path length 0)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    usage = _key_usage(key_cert_sign=True, crl_sign=True)
    builder = (
        _validity(x509.CertificateBuilder(), days, not_before, None)
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(usage, critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )
    return _pem(builder.sign(key, hashes.SHA256()), key)


def issue_server(ca: Pem, hosts: Sequence[str], days: float, not_before: datetime | None = None) -> Pem:
    """The coordinator's certificate: CN diloco-coordinator, a SAN entry per host (an IP
    address entry for what parses as one, a DNS name otherwise), serverAuth only."""
    if isinstance(hosts, str) or not hosts:
        raise ValueError("the coordinator's certificate needs at least one host name or IP address")
    names = [_host_name(h) for h in hosts]
    return _issue(ca, COORDINATOR_CN, names, ExtendedKeyUsageOID.SERVER_AUTH, days, not_before)


def issue_site(ca: Pem, site_id: str, days: float, not_before: datetime | None = None) -> Pem:
    """A site's client certificate: CN ``site_id``, SAN URI urn:diloco:site:<site_id>,
    clientAuth only."""
    check_site_id(site_id)
    uri = x509.UniformResourceIdentifier(SITE_URI_PREFIX + site_id)
    return _issue(ca, site_id, [uri], ExtendedKeyUsageOID.CLIENT_AUTH, days, not_before)


def site_id_of_cert(pem: bytes) -> str | None:
    """The site id a certificate names in its SAN URI, or None when it names none (or several,
    or an invalid one). Checks no signature: only use it on a certificate TLS verified."""
    cert = x509.load_pem_x509_certificate(pem)
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    uris = san.get_values_for_type(x509.UniformResourceIdentifier)
    ids = [u[len(SITE_URI_PREFIX) :] for u in uris if u.startswith(SITE_URI_PREFIX)]
    if len(ids) != 1:
        return None
    try:
        return check_site_id(ids[0])
    except ValueError:
        return None


def check_pem(pem: Pem, source: str) -> Pem:
    """``pem`` if its certificate and key parse and belong together; ValueError naming
    ``source`` otherwise."""
    try:
        cert = x509.load_pem_x509_certificate(pem.cert)
        key = serialization.load_pem_private_key(pem.key, password=None)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{source}: not a PEM certificate and unencrypted key ({e})") from None
    if cert.public_key() != key.public_key():
        raise ValueError(f"{source}: the key does not belong to the certificate")
    return pem


def not_valid_after(pem: bytes) -> datetime:
    """When a PEM certificate expires (UTC)."""
    return x509.load_pem_x509_certificate(pem).not_valid_after_utc


def _issue(ca: Pem, cn: str, names: list[x509.GeneralName], usage: x509.ObjectIdentifier, days: float, not_before: datetime | None) -> Pem:
    """An end-entity certificate signed by ``ca``; it expires no later than the CA."""
    ca_cert = x509.load_pem_x509_certificate(ca.cert)
    ca_key = serialization.load_pem_private_key(ca.key, password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (
        _validity(x509.CertificateBuilder(), days, not_before, ca_cert.not_valid_after_utc)
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(digital_signature=True), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)  # type: ignore[arg-type]
    )
    return _pem(builder.sign(ca_key, hashes.SHA256()), key)  # type: ignore[arg-type]


def _validity(builder: x509.CertificateBuilder, days: float, not_before: datetime | None, cap: datetime | None) -> x509.CertificateBuilder:
    if not 0 < days <= MAX_DAYS:
        raise ValueError(f"days={days!r}: a certificate's validity must be more than 0 and at most {MAX_DAYS} days")
    if not_before is not None and not_before.tzinfo is None:
        raise ValueError(f"not_before={not_before!r}: give a timezone-aware datetime")
    start = not_before if not_before is not None else datetime.now(UTC) - CLOCK_SKEW
    end = start + timedelta(days=days)
    return builder.not_valid_before(start).not_valid_after(end if cap is None else min(end, cap))


def _key_usage(**allowed: bool) -> x509.KeyUsage:
    names = ("digital_signature", "content_commitment", "key_encipherment", "data_encipherment", "key_agreement")
    names += ("key_cert_sign", "crl_sign", "encipher_only", "decipher_only")
    return x509.KeyUsage(**{n: allowed.get(n, False) for n in names})


def _host_name(host: str) -> x509.GeneralName:
    if isinstance(host, str):
        try:
            return x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            if _HOST.fullmatch(host):
                return x509.DNSName(host)
    raise ValueError(f"host {quote(host)} is neither an IP address nor a DNS name")


def _pem(cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Pem:
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return Pem(cert=cert.public_bytes(serialization.Encoding.PEM), key=key_pem)
