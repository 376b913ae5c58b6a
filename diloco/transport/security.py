"""grpc's own credentials for a run (TLS, mutual TLS with the run CA, bearer tokens as call
credentials) and who a call comes from. The site id a call names is bound to its credentials:
the coordinator never acts for a site whose credentials the caller does not hold."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from diloco.errors import CoordinatorError
from diloco.security.config import SecurityConfig, host_of
from diloco.security.ids import quote
from diloco.security.store import RunCredentials
from diloco.security.tokens import TokenTable

TOKEN_KEY = "authorization"  # the metadata key of a bearer token, as grpc's access_token_call_credentials sends it
_BEARER = "Bearer "


@dataclass(frozen=True)
class ServerAuth:
    """How the coordinator identifies a caller: by the common name of its client certificate
    (``mtls``), by its token (``tokens``), or both (they must name the same site)."""

    mtls: bool = False
    tokens: TokenTable | None = None

    @property
    def enabled(self) -> bool:
        return self.mtls or self.tokens is not None

    def identify(self, context: grpc.ServicerContext) -> str | None:
        """The site id the call's credentials prove; None when the run has no credentials.
        Raises CoordinatorError (unauthenticated) when they are missing or unknown."""
        ids: list[str] = []
        if self.mtls:
            names = context.auth_context().get("x509_common_name") or []
            if len(names) != 1:
                raise CoordinatorError("unauthenticated", "no client certificate of this run's CA")
            ids.append(names[0].decode(errors="replace"))
        if self.tokens is not None:
            value = dict(context.invocation_metadata()).get(TOKEN_KEY, "")
            if not isinstance(value, str) or not value.startswith(_BEARER):
                raise CoordinatorError("unauthenticated", f"no bearer token in the call's {TOKEN_KEY!r} metadata")
            site = self.tokens.site_of(value[len(_BEARER) :])
            if site is None:
                raise CoordinatorError("unauthenticated", "the call's token is not one this run issued")
            ids.append(site)
        if len(set(ids)) > 1:
            raise CoordinatorError("permission_denied", f"the client certificate names site {quote(ids[0])}, the token site {quote(ids[1])}")
        return ids[0] if ids else None


def bind(identity: str | None, site_id: str) -> None:
    """Refuses a call that names another site than its credentials prove (permission_denied)."""
    if identity is not None and identity != site_id:
        raise CoordinatorError("permission_denied", f"credentials of site {quote(identity)} cannot act for site {quote(site_id)}")


def server_side(cfg: SecurityConfig, host: str) -> tuple[grpc.ServerCredentials | None, ServerAuth]:
    """The server's credentials (None: plaintext) and how it identifies callers."""
    cfg.check_address(host, "the coordinator")
    if cfg.dir is None:
        return None, ServerAuth()
    creds = RunCredentials.at(cfg.dir)
    server_creds = None
    if cfg.tls:
        own = creds.coordinator_pem()
        server_creds = grpc.ssl_server_credentials([(own.key, own.cert)], root_certificates=creds.ca_pem() if cfg.mtls else None, require_client_auth=cfg.mtls)
    return server_creds, ServerAuth(mtls=cfg.mtls, tokens=creds.token_table() if cfg.tokens else None)


@dataclass(frozen=True)
class ClientSide:
    """A site's channel credentials (None: plaintext) and the metadata its calls carry (a
    token over plaintext, where grpc sends no call credentials)."""

    credentials: grpc.ChannelCredentials | None
    metadata: tuple[tuple[str, str], ...] | None
    options: tuple[tuple[str, str], ...]


def client_side(cfg: SecurityConfig, address: str, site_id: str) -> ClientSide:
    cfg.check_address(host_of(address), f"site {site_id}'s coordinator")
    if cfg.dir is None:
        return ClientSide(None, None, ())
    creds = RunCredentials.at(cfg.dir)
    token = creds.site_token(site_id) if cfg.tokens else None
    if not cfg.tls:
        return ClientSide(None, ((TOKEN_KEY, _BEARER + token),) if token else None, ())
    mine = creds.site_pem(site_id) if cfg.mtls else None
    channel = grpc.ssl_channel_credentials(creds.ca_pem(), mine.key if mine else None, mine.cert if mine else None)
    if token:
        channel = grpc.composite_channel_credentials(channel, grpc.access_token_call_credentials(token))
    options = (("grpc.ssl_target_name_override", cfg.server_name),) if cfg.server_name else ()
    return ClientSide(channel, None, options)
