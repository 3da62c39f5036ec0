"""Configuration of one shard process: one frozen dataclass, loaded in one place."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from tether.protos.flags import HelpFormatter, env
from tether.protos.security import TOKEN_ENV, check_token, resolve_token

# Set to 1, a shard process exits between a checkpoint's data file and its manifest (tests).
CRASH_BEFORE_MANIFEST_ENV = "TETHER_TEST_CRASH_BEFORE_MANIFEST"

__all__ = ["CRASH_BEFORE_MANIFEST_ENV", "ShardConfig", "load_config"]


@dataclass(frozen=True)
class ShardConfig:
    """Everything a shard process needs to start."""

    host: str = "127.0.0.1"
    port: int = 50051
    shard_index: int = 0
    num_shards: int = 1
    metrics_port: int | None = None
    threads: int = 8
    max_message_bytes: int = 256 * 1024 * 1024
    max_concurrent_rpcs: int = 64
    port_file: str | None = None
    grace_seconds: float = 5.0
    lease_seconds: float = 10.0
    max_staleness: int | None = None
    # Checkpoints: restore from here at start, write here on demand, periodically and at SIGTERM.
    checkpoint_dir: str | None = None
    checkpoint_every_s: float | None = None
    checkpoint_keep: int = 3
    # TLS from PEM files; with tls_client_ca, clients must present a certificate (mutual TLS).
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    # Bearer token every ParameterServer call must carry (kept out of repr and logs).
    auth_token: str | None = field(default=None, repr=False)
    # Plaintext port serving only gRPC health, for probes that cannot speak TLS (Kubernetes).
    health_port: int | None = None
    # Data plane for Push/Pull/PushPull (0: a free port, told to clients; None: off). A shard
    # that serves TLS serves it there too (same files); its unix socket only without a client CA.
    data_port: int | None = 0
    # Data plane bounds: receive buffers of all connections together (at least max_message_bytes),
    # seconds a new connection has to complete its HELLO, seconds a connection may stay silent.
    data_buffer_bytes: int = 1024 * 1024 * 1024
    data_handshake_timeout_s: float = 10.0
    data_idle_timeout_s: float = 120.0
    # Test hook (``CRASH_BEFORE_MANIFEST_ENV=1``): exit between a checkpoint's data file and its
    # manifest, as a crash there would.
    crash_before_manifest: bool = False

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
    """Flags of ``tether server``; each falls back to a ``TETHER_*`` environment variable."""
    p = parser or argparse.ArgumentParser(
        prog="tether server",
        description="Run one parameter-server shard. Every flag falls back to the TETHER_* environment variable its help names.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--host", default=env("TETHER_HOST", "127.0.0.1"), help="address to bind (env TETHER_HOST)")
    p.add_argument("--port", type=int, default=env("TETHER_PORT", 50051), help="gRPC port, 0 picks a free one (env TETHER_PORT)")
    p.add_argument("--shard-index", type=int, default=env("TETHER_SHARD_INDEX", 0), help="this shard's index (env TETHER_SHARD_INDEX)")
    p.add_argument("--num-shards", type=int, default=env("TETHER_NUM_SHARDS", 1), help="shards in the job (env TETHER_NUM_SHARDS)")
    p.add_argument("--metrics-port", type=int, default=env("TETHER_METRICS_PORT", None), help="serve Prometheus /metrics on this port (env TETHER_METRICS_PORT)")
    p.add_argument("--threads", type=int, default=env("TETHER_THREADS", 8), help="gRPC worker threads (env TETHER_THREADS)")
    p.add_argument("--max-message-mb", type=int, default=env("TETHER_MAX_MESSAGE_MB", 256), help="largest request or response, MiB (env TETHER_MAX_MESSAGE_MB)")
    p.add_argument("--max-concurrent-rpcs", type=int, default=env("TETHER_MAX_CONCURRENT_RPCS", 64), help="calls in flight beyond this get RESOURCE_EXHAUSTED (env TETHER_MAX_CONCURRENT_RPCS)")
    p.add_argument("--port-file", default=env("TETHER_PORT_FILE", None), help="write the bound port to this file once serving (env TETHER_PORT_FILE)")
    p.add_argument("--grace-seconds", type=float, metavar="SECONDS", default=env("TETHER_GRACE_SECONDS", 5.0), help="seconds in-flight calls get to finish on SIGTERM (env TETHER_GRACE_SECONDS)")
    p.add_argument("--lease-seconds", type=float, metavar="SECONDS", default=env("TETHER_LEASE_SECONDS", 10.0), help="seconds: a worker silent this long no longer holds SSP back (env TETHER_LEASE_SECONDS)")
    p.add_argument("--max-staleness", type=int, default=env("TETHER_MAX_STALENESS", None), help="reject pushes staler than this many updates (ABORTED); unset: no limit (env TETHER_MAX_STALENESS)")
    p.add_argument("--checkpoint-dir", default=env("TETHER_CHECKPOINT_DIR", None), help="restore from the newest checkpoint here at start; write checkpoints here (env TETHER_CHECKPOINT_DIR)")
    p.add_argument("--checkpoint-every", type=float, metavar="SECONDS", default=env("TETHER_CHECKPOINT_EVERY", None), help="checkpoint every this many seconds while the shard changes; unset: only on demand and at SIGTERM (env TETHER_CHECKPOINT_EVERY)")
    p.add_argument("--checkpoint-keep", type=int, default=env("TETHER_CHECKPOINT_KEEP", 3), help="checkpoints of this shard to keep (env TETHER_CHECKPOINT_KEEP)")
    p.add_argument("--tls-cert", default=env("TETHER_TLS_CERT", None), help="serve TLS with this PEM certificate (env TETHER_TLS_CERT)")
    p.add_argument("--tls-key", default=env("TETHER_TLS_KEY", None), help="PEM private key of --tls-cert (env TETHER_TLS_KEY)")
    p.add_argument("--tls-client-ca", default=env("TETHER_TLS_CLIENT_CA", None), help="require client certificates signed by this PEM CA: mutual TLS (env TETHER_TLS_CLIENT_CA)")
    p.add_argument("--auth-token-file", default=env("TETHER_AUTH_TOKEN_FILE", None), help=f"require 'authorization: Bearer <token>' on every call, token read from this file (env TETHER_AUTH_TOKEN_FILE, or the token itself in ${TOKEN_ENV})")
    p.add_argument("--health-port", type=int, default=env("TETHER_HEALTH_PORT", None), help="also serve gRPC health in plaintext on this port, for probes that cannot do TLS (env TETHER_HEALTH_PORT)")
    p.add_argument("--data-port", default=env("TETHER_DATA_PORT", "0"), help="TCP port of the data plane for push/pull (0: a free one, told to clients; 'off': gRPC only; with --tls-cert it serves TLS too) (env TETHER_DATA_PORT)")
    p.add_argument("--data-buffer-mb", type=int, default=env("TETHER_DATA_BUFFER_MB", 1024), help="receive buffers of all data connections together, MiB, at least --max-message-mb; beyond it RESOURCE_EXHAUSTED (env TETHER_DATA_BUFFER_MB)")
    p.add_argument("--data-handshake-timeout", type=float, metavar="SECONDS", default=env("TETHER_DATA_HANDSHAKE_TIMEOUT", 10.0), help="seconds a new data connection has to send its HELLO (env TETHER_DATA_HANDSHAKE_TIMEOUT)")
    p.add_argument("--data-idle-timeout", type=float, metavar="SECONDS", default=env("TETHER_DATA_IDLE_TIMEOUT", 120.0), help="close a data connection silent this many seconds (env TETHER_DATA_IDLE_TIMEOUT)")
    return p


def _data_port(value: str) -> int | None:
    if str(value).strip().lower() in ("off", "none", "-1"):
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"--data-port must be a port number or 'off', got {value!r}") from None


def _optional_int(value: str | int | None) -> int | None:
    return None if value is None or value == "" else int(value)


def _optional_float(value: str | float | None) -> float | None:
    return None if value is None or value == "" else float(value)


def load_config(argv: Sequence[str] | None = None) -> ShardConfig:
    """Parse flags (with env fallbacks) into a validated ``ShardConfig``."""
    a = build_parser().parse_args(argv)
    return ShardConfig(
        host=a.host,
        port=int(a.port),
        shard_index=int(a.shard_index),
        num_shards=int(a.num_shards),
        metrics_port=None if a.metrics_port in (None, "") else int(a.metrics_port),
        threads=int(a.threads),
        max_message_bytes=int(a.max_message_mb) * 1024 * 1024,
        max_concurrent_rpcs=int(a.max_concurrent_rpcs),
        port_file=a.port_file,
        grace_seconds=float(a.grace_seconds),
        lease_seconds=float(a.lease_seconds),
        max_staleness=_optional_int(a.max_staleness),
        checkpoint_dir=a.checkpoint_dir or None,
        checkpoint_every_s=_optional_float(a.checkpoint_every),
        checkpoint_keep=int(a.checkpoint_keep),
        tls_cert=a.tls_cert or None,
        tls_key=a.tls_key or None,
        tls_client_ca=a.tls_client_ca or None,
        auth_token=resolve_token(a.auth_token_file),
        health_port=_optional_int(a.health_port),
        data_port=_data_port(a.data_port),
        data_buffer_bytes=int(a.data_buffer_mb) * 1024 * 1024,
        data_handshake_timeout_s=float(a.data_handshake_timeout),
        data_idle_timeout_s=float(a.data_idle_timeout),
        crash_before_manifest=env(CRASH_BEFORE_MANIFEST_ENV, "") == "1",
    )
