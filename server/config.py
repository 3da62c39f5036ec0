"""Configuration of one shard process: one frozen dataclass, loaded in one place."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tether.common import settings as fields
from tether.common.cli_args import HelpFormatter, env, optional_float, optional_int, optional_str
from tether.common.config_file import parse_with_config
from tether.common.security import TOKEN_ENV, check_token, resolve_token
from tether.common.settings import derived, setting

# The variable ``tether server --config`` falls back to: a file of the shard's config.
SHARD_CONFIG_ENV = "TETHER_SHARD_CONFIG"

# Set to 1, a shard process exits between a checkpoint's data file and its manifest (tests).
CRASH_BEFORE_MANIFEST_ENV = "TETHER_TEST_CRASH_BEFORE_MANIFEST"

__all__ = ["CRASH_BEFORE_MANIFEST_ENV", "SHARD_CONFIG_ENV", "ShardConfig", "load_config"]


MIB = 1024 * 1024


def _mib(text: str) -> int:
    """A size flag given in MiB, as bytes."""
    try:
        return int(text) * MIB
    except ValueError:
        raise ValueError(f"expected a whole number of MiB, got {text!r}") from None


def _in_mib(size: int) -> str:
    return str(size // MIB)


def _data_port(text: str) -> int | None:
    """``--data-port``: a port, or ``off`` (also ``none``, ``-1``) for no data plane."""
    if text.strip().lower() in ("off", "none", "-1"):
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"must be a port number or 'off', got {text!r}") from None


def _show_data_port(port: int | None) -> str:
    return "off" if port is None else str(port)


def _auth_token(values: Mapping[str, Any], environ: Mapping[str, str]) -> str | None:
    return resolve_token(values["auth_token_file"], environ)


@dataclass(frozen=True)
class ShardConfig:
    """Everything a shard process needs to start. Each field that can be set from outside
    declares its flag, ``TETHER_*`` variable and help here (``tether.common.settings``)."""

    host: str = setting("127.0.0.1", flag="--host", help="address to bind")
    port: int = setting(50051, flag="--port", help="gRPC port, 0 picks a free one")
    shard_index: int = setting(0, flag="--shard-index", help="this shard's index")
    num_shards: int = setting(1, flag="--num-shards", help="shards in the job")
    metrics_port: int | None = setting(None, flag="--metrics-port", parse=optional_int, help="serve Prometheus /metrics on this port")
    threads: int = setting(8, flag="--threads", help="gRPC worker threads")
    max_message_bytes: int = setting(256 * MIB, flag="--max-message-mb", parse=_mib, show=_in_mib, help="largest request or response, MiB")
    max_concurrent_rpcs: int = setting(64, flag="--max-concurrent-rpcs", help="calls in flight beyond this get RESOURCE_EXHAUSTED")
    port_file: str | None = setting(None, flag="--port-file", parse=optional_str, help="write the bound port to this file once serving")
    grace_seconds: float = setting(5.0, flag="--grace-seconds", metavar="SECONDS", help="seconds in-flight calls get to finish on SIGTERM")
    lease_seconds: float = setting(10.0, flag="--lease-seconds", metavar="SECONDS",
                                   help="seconds: a worker silent this long no longer holds SSP back")
    max_staleness: int | None = setting(None, flag="--max-staleness", parse=optional_int,
                                        help="reject pushes staler than this many updates (ABORTED); unset: no limit")
    # Checkpoints: restore from here at start, write here on demand, periodically and at SIGTERM.
    checkpoint_dir: str | None = setting(None, flag="--checkpoint-dir", parse=optional_str,
                                         help="restore from the newest checkpoint here at start; write checkpoints here")
    checkpoint_every_s: float | None = setting(None, flag="--checkpoint-every", parse=optional_float, metavar="SECONDS",
                                               help="checkpoint every this many seconds while the shard changes; "
                                               "unset: only on demand and at SIGTERM")
    checkpoint_keep: int = setting(3, flag="--checkpoint-keep", help="checkpoints of this shard to keep")
    # TLS from PEM files; with tls_client_ca, clients must present a certificate (mutual TLS).
    tls_cert: str | None = setting(None, flag="--tls-cert", parse=optional_str, help="serve TLS with this PEM certificate")
    tls_key: str | None = setting(None, flag="--tls-key", parse=optional_str, help="PEM private key of --tls-cert")
    tls_client_ca: str | None = setting(None, flag="--tls-client-ca", parse=optional_str,
                                        help="require client certificates signed by this PEM CA: mutual TLS")
    # Bearer token every ParameterServer call must carry (kept out of repr and logs), read from
    # auth_token_file, else from $TETHER_AUTH_TOKEN.
    auth_token_file: str | None = setting(None, flag="--auth-token-file", parse=optional_str,
                                          help=f"require 'authorization: Bearer <token>' on every call, token read from this file "
                                          f"(or the token itself in ${TOKEN_ENV})")
    auth_token: str | None = derived(_auth_token, repr=False)
    # Plaintext port serving only gRPC health, for probes that cannot speak TLS (Kubernetes).
    health_port: int | None = setting(None, flag="--health-port", parse=optional_int,
                                      help="also serve gRPC health in plaintext on this port, for probes that cannot do TLS")
    # Data plane for Push/Pull/PushPull (0: a free port, told to clients; None: off). A shard
    # that serves TLS serves it there too (same files); its unix socket only without a client CA.
    data_port: int | None = setting(0, flag="--data-port", parse=_data_port, show=_show_data_port,
                                    help="TCP port of the data plane for push/pull (0: a free one, told to clients; 'off': gRPC only; "
                                    "with --tls-cert it serves TLS too)")
    # Data plane bounds: receive buffers of all connections together (at least max_message_bytes),
    # seconds a new connection has to complete its HELLO, seconds a connection may stay silent.
    data_buffer_bytes: int = setting(1024 * MIB, flag="--data-buffer-mb", parse=_mib, show=_in_mib,
                                     help="receive buffers of all data connections together, MiB, at least --max-message-mb; "
                                     "beyond it RESOURCE_EXHAUSTED")
    data_handshake_timeout_s: float = setting(10.0, flag="--data-handshake-timeout", metavar="SECONDS",
                                              help="seconds a new data connection has to send its HELLO")
    data_idle_timeout_s: float = setting(120.0, flag="--data-idle-timeout", metavar="SECONDS",
                                         help="close a data connection silent this many seconds")
    # Test hook: exit between a checkpoint's data file and its manifest, as a crash there would.
    crash_before_manifest: bool = setting(False, flag=None, env=CRASH_BEFORE_MANIFEST_ENV,
                                          help="exit between a checkpoint's data file and its manifest (tests)")

    @classmethod
    def from_env(cls, **overrides: object) -> ShardConfig:
        """The config the ``TETHER_*`` environment describes, ``overrides`` winning.

        Raises:
            ValueError: a bad value, named.
        """
        return fields.from_env(cls, overrides)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port!r}")
        if self.num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {self.num_shards!r}")
        if not 0 <= self.shard_index < self.num_shards:
            raise ValueError(f"shard_index must be in [0, {self.num_shards}), got {self.shard_index!r}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port!r}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads!r}")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {self.max_message_bytes!r}")
        if self.max_concurrent_rpcs < 1:
            raise ValueError(f"max_concurrent_rpcs must be >= 1, got {self.max_concurrent_rpcs!r}")
        if not self.lease_seconds > 0:
            raise ValueError(f"lease_seconds must be > 0, got {self.lease_seconds!r}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness!r}")
        if self.grace_seconds < 0:
            raise ValueError(f"grace_seconds must be >= 0, got {self.grace_seconds!r}")
        if self.checkpoint_every_s is not None and not self.checkpoint_every_s > 0:
            raise ValueError(f"checkpoint_every_s must be > 0, got {self.checkpoint_every_s!r}")
        if self.checkpoint_every_s is not None and self.checkpoint_dir is None:
            raise ValueError(f"checkpoint_every_s={self.checkpoint_every_s!r} needs a checkpoint_dir")
        if self.checkpoint_keep < 1:
            raise ValueError(f"checkpoint_keep must be >= 1, got {self.checkpoint_keep!r}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError(f"tls_cert and tls_key go together, got tls_cert={self.tls_cert!r}, tls_key={self.tls_key!r}")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError(f"tls_client_ca={self.tls_client_ca!r} needs tls_cert and tls_key: mutual TLS runs over TLS")
        for name in ("tls_cert", "tls_key", "tls_client_ca"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{name} {path!r} is not a file")
        if self.auth_token is not None:
            check_token(self.auth_token)
        if self.health_port is not None and not 0 <= self.health_port <= 65535:
            raise ValueError(f"health_port must be in [0, 65535], got {self.health_port!r}")
        if self.data_port is not None and not 0 <= self.data_port <= 65535:
            raise ValueError(f"data_port must be in [0, 65535] (or off), got {self.data_port!r}")
        if self.data_buffer_bytes < self.max_message_bytes:
            raise ValueError(
                f"data_buffer_bytes must be >= max_message_bytes ({self.max_message_bytes}), got {self.data_buffer_bytes!r}"
            )
        if not self.data_handshake_timeout_s > 0:
            raise ValueError(f"data_handshake_timeout_s must be > 0, got {self.data_handshake_timeout_s!r}")
        if not self.data_idle_timeout_s > 0:
            raise ValueError(f"data_idle_timeout_s must be > 0, got {self.data_idle_timeout_s!r}")

    @property
    def tls(self) -> bool:
        """Whether the shard serves TLS."""
        return self.tls_cert is not None


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Flags of ``tether server``; each falls back to a ``TETHER_*`` environment variable, and
    ``--config FILE`` (what ``tether launch`` hands each shard) stands in for them all."""
    p = parser or argparse.ArgumentParser(
        prog="tether server",
        description="Run one parameter-server shard. Every flag falls back to the TETHER_* environment variable its help names.",
        formatter_class=HelpFormatter,
    )
    fields.add_flags(p, ShardConfig)
    # Not TETHER_CONFIG: that variable names a worker's file (a user's program's), and a shard
    # inherits the same shell as the workers beside it.
    p.add_argument("--config", metavar="FILE", default=env(SHARD_CONFIG_ENV, None),
                   help="the shard as a JSON object of field values, as tether launch writes each shard's "
                   "(OUT/logs/shard-<i>.config.json): they replace the flags' defaults and TETHER_* variables; "
                   f"a flag given beside it wins (env {SHARD_CONFIG_ENV})")
    return p


def load_config(argv: Sequence[str] | None = None) -> ShardConfig:
    """Parse flags (with env fallbacks), or ``--config FILE`` and the flags beside it, into a
    validated ``ShardConfig``: the shard's one parse.

    Raises:
        ValueError: a bad value, or a file that cannot be read or holds no shard config, named.
    """
    return ShardConfig(**fields.values_from_args(ShardConfig, parse_with_config(build_parser(), argv, ShardConfig)))
