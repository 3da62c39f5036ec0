"""Transport security shared by shards and clients: TLS from PEM files and a bearer token.

A shard started with ``--tls-cert/--tls-key`` serves TLS only; with ``--tls-client-ca`` it
also requires every client to present a certificate signed by that CA (mutual TLS; a client
without one fails the handshake and never gets a connection). With an auth token it answers
every call of ``tether.v1.ParameterServer`` that lacks ``authorization: Bearer <token>``
metadata with UNAUTHENTICATED; the gRPC health service stays open so that Kubernetes probes,
which carry no credentials, keep working.

The data plane's TCP port serves TLS with the same files (``server_ssl_context`` and
``ClientSecurity.ssl_context``, Python's ``ssl``): the client checks the shard's certificate
and host name as gRPC does, and under mutual TLS the shard checks the client's.
"""

from __future__ import annotations

import os
import re
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc

__all__ = [
    "AUTH_METADATA_KEY",
    "TOKEN_ENV",
    "ClientSecurity",
    "bearer",
    "check_token",
    "read_pem",
    "read_token",
    "resolve_token",
    "server_credentials",
    "server_ssl_context",
]

AUTH_METADATA_KEY = "authorization"
# Environment variable holding the token itself (the flags take a file).
TOKEN_ENV = "TETHER_AUTH_TOKEN"
# What an HTTP/2 header value may carry, minus spaces: no header injection, no surprises.
_TOKEN = re.compile(r"[\x21-\x7e]{1,4096}")


def check_token(token: str) -> str:
    """``token`` if it is 1..4096 printable ASCII characters without spaces.

    Raises:
        ValueError: anything else (the message never echoes the token).
    """
    if not isinstance(token, str) or not _TOKEN.fullmatch(token):
        raise ValueError("auth token must be 1..4096 printable ASCII characters without spaces or newlines")
    return token


def read_token(path: str | Path) -> str:
    """The token in ``path`` (surrounding whitespace stripped).

    Raises:
        ValueError: the file cannot be read or holds no valid token.
    """
    try:
        text = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read auth token file {str(path)!r}: {exc}") from exc
    try:
        return check_token(text)
    except ValueError as exc:
        raise ValueError(f"auth token file {str(path)!r}: {exc}") from None


def resolve_token(token_file: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The token from ``token_file`` if given, else from ``$TETHER_AUTH_TOKEN``, else None.

    Raises:
        ValueError: an unreadable file or an invalid token.
    """
    if token_file:
        return read_token(token_file)
    value = environ.get(TOKEN_ENV, "").strip()
    if not value:
        return None
    try:
        return check_token(value)
    except ValueError as exc:
        raise ValueError(f"${TOKEN_ENV}: {exc}") from None


def bearer(token: str) -> str:
    """The ``authorization`` metadata value for ``token``."""
    return f"Bearer {token}"


def read_pem(path: str | Path, what: str) -> bytes:
    """Bytes of a PEM file.

    Raises:
        ValueError: naming ``what`` and the path, when the file is missing, unreadable or not PEM.
    """
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {what} {str(path)!r}: {exc}") from exc
    if b"-----BEGIN " not in data:
        raise ValueError(f"{what} {str(path)!r} is not a PEM file")
    return data


def server_credentials(cert: str, key: str, client_ca: str | None = None) -> grpc.ServerCredentials:
    """TLS credentials of a shard; with ``client_ca`` clients must present a certificate it signed.

    Raises:
        ValueError: a file is missing or not PEM.
    """
    pair = (read_pem(key, "TLS key"), read_pem(cert, "TLS certificate"))
    ca = read_pem(client_ca, "TLS client CA") if client_ca else None
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


def _load_chain(ctx: ssl.SSLContext, cert: str, key: str) -> None:
    read_pem(cert, "TLS certificate")
    read_pem(key, "TLS key")
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"TLS certificate {cert!r} and key {key!r} cannot be loaded together: {exc}") from exc


def _load_ca(ctx: ssl.SSLContext, ca: str, what: str) -> None:
    read_pem(ca, what)
    try:
        ctx.load_verify_locations(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"{what} {ca!r} cannot be loaded: {exc}") from exc


def server_ssl_context(cert: str, key: str, client_ca: str | None = None) -> ssl.SSLContext:
    """The data plane's TLS context on a shard (TLS 1.2 or later); with ``client_ca`` clients
    must present a certificate it signed, as on the gRPC port.

    Raises:
        ValueError: a file is missing, not PEM, or the key does not match the certificate.
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    # No session tickets: nothing resumes, and a ticket arriving on an idle client connection
    # would look like the shard hanging up.
    ctx.num_tickets = 0
    _load_chain(ctx, cert, key)
    if client_ca:
        _load_ca(ctx, client_ca, "TLS client CA")
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


@dataclass(frozen=True)
class ClientSecurity:
    """How a client proves who it is and checks who the shards are."""

    # CA that signed the shards' certificates; set: connect with TLS.
    tls_ca: str | None = None
    # The client's own certificate and key, for shards that require mutual TLS.
    tls_cert: str | None = None
    tls_key: str | None = None
    # Bearer token sent with every call (kept out of repr so it never reaches a log).
    token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError(f"tls_cert and tls_key go together, got tls_cert={self.tls_cert!r}, tls_key={self.tls_key!r}")
        if self.tls_cert is not None and self.tls_ca is None:
            raise ValueError(f"a client certificate ({self.tls_cert!r}) needs tls_ca: mutual TLS runs over TLS")
        if self.token is not None:
            check_token(self.token)

    @property
    def tls(self) -> bool:
        """Whether calls go over TLS."""
        return self.tls_ca is not None

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """TLS channel credentials (None without TLS).

        Raises:
            ValueError: a file is missing or not PEM.
        """
        if self.tls_ca is None:
            return None
        ca = read_pem(self.tls_ca, "TLS CA")
        if self.tls_cert is None or self.tls_key is None:  # together or not at all (__post_init__)
            return grpc.ssl_channel_credentials(root_certificates=ca)
        return grpc.ssl_channel_credentials(
            root_certificates=ca,
            private_key=read_pem(self.tls_key, "TLS key"),
            certificate_chain=read_pem(self.tls_cert, "TLS certificate"),
        )

    def ssl_context(self) -> ssl.SSLContext | None:
        """The data plane's TLS context (None without TLS): verifies the shard's certificate
        against ``tls_ca`` and its host name, and presents the client certificate if there is one.

        Raises:
            ValueError: a file is missing, not PEM, or the key does not match the certificate.
        """
        if self.tls_ca is None:
            return None
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED and check_hostname
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        _load_ca(ctx, self.tls_ca, "TLS CA")
        if self.tls_cert is not None and self.tls_key is not None:
            _load_chain(ctx, self.tls_cert, self.tls_key)
        return ctx

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata: the bearer token, if any."""
        return ((AUTH_METADATA_KEY, bearer(self.token)),) if self.token else ()
