"""The run config's ``security`` section: where the run's credentials are and how they are used."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from diloco.fields import setting

AUTHS = ("mtls", "token", "both")


@dataclass(frozen=True)
class SecurityConfig:
    """The run config's ``security`` section. Without ``dir`` there are no credentials: any
    client may claim any site id, which is allowed on loopback only, unless ``insecure``."""

    dir: str | None = setting(
        None,
        doc="the credentials directory diloco-certs wrote (each machine needs only its own part); null: plaintext without credentials (loopback only, unless insecure)",
    )
    tls: bool = setting(True, doc="with dir: TLS on every channel, the coordinator's certificate from the run CA")
    auth: str = setting("both", doc="with dir: how a site proves its id: mtls (its certificate) | token (bearer token) | both")
    insecure: bool = setting(False, doc="allow plaintext, or calls without credentials, on an address other than loopback")
    server_name: str | None = setting(None, doc="the name sites check in the coordinator's certificate; null: the host they dial")

    def __post_init__(self) -> None:
        if self.auth not in AUTHS:
            raise ValueError(f"security.auth={self.auth!r}: must be one of {', '.join(AUTHS)}")
        for name in ("tls", "insecure"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"security.{name}={getattr(self, name)!r}: must be true or false")
        if self.dir is not None and not self.tls and self.auth != "token":
            raise ValueError(f"security.auth={self.auth} needs security.tls=true (a client certificate is presented in the TLS handshake)")

    @property
    def mtls(self) -> bool:
        return self.dir is not None and self.tls and self.auth in ("mtls", "both")

    @property
    def tokens(self) -> bool:
        return self.dir is not None and self.auth in ("token", "both")

    @property
    def uses_tls(self) -> bool:
        return self.dir is not None and self.tls

    def describe(self) -> str:
        """One line for a log: what protects the channels."""
        if self.dir is None:
            return "plaintext, no credentials" + (" (security.insecure)" if self.insecure else " (loopback only)")
        how = {"mtls": "client certificates", "token": "tokens", "both": "client certificates and tokens"}[self.auth]
        return f"{'TLS' if self.tls else 'plaintext'} with {how} from {self.dir}"

    def check_address(self, host: str, role: str) -> None:
        """Refuses plaintext or unauthenticated calls off loopback unless ``insecure`` is set."""
        if self.insecure or is_loopback(host):
            return
        if not self.uses_tls:
            raise ValueError(f"{role} on {host}: plaintext is refused off loopback; give security.dir (diloco-certs writes it) or set security.insecure=true")


def is_loopback(host: str) -> bool:
    """``host`` names this machine only: localhost, 127.0.0.0/8 or ::1."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_of(address: str) -> str:
    """The host part of "host:port" (IPv6 in brackets allowed)."""
    return address.rsplit(":", 1)[0].strip("[]") if ":" in address else address
