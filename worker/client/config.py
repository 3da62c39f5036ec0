"""How a worker calls its shards: ``ClientConfig``, ``PSClient``'s config (a ``Trainer`` makes it
from its training config with ``TrainingConfig.client_config``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from tether.common.choices import (
    CLIENT_CALL_DEADLINE_S,
    CLIENT_STALENESS_AWARE,
    CLIENT_TIMEOUT_S,
    CLIENT_TRANSPORT,
    CLIENT_WIRE_DTYPE,
    or_names,
)
from tether.common.security import ClientSecurity
from tether.protos.codec import WIRE_DTYPES
from tether.protos.names import REMEDY_DECAY, TRANSPORTS, check_remedies

__all__ = ["ClientConfig"]


@dataclass(frozen=True)
class ClientConfig:
    """Where the shards are and how to call them (``PSClient``'s config; a ``Trainer`` makes it
    with ``TrainingConfig.client_config``)."""

    addresses: tuple[str, ...]
    worker_id: str
    # Deadline of one attempt (one RPC or data-plane round trip).
    timeout_s: float = CLIENT_TIMEOUT_S
    # Retries of a transient failure: None retries until ``call_deadline_s``; a number stops after
    # that many retries (or at the deadline, if sooner).
    retries: int | None = None
    backoff_s: float = 0.05
    max_backoff_s: float = 2.0
    max_message_bytes: int = 256 * 1024 * 1024
    chunk_elems: int = 1 << 20
    wire_dtype: torch.dtype = WIRE_DTYPES[CLIENT_WIRE_DTYPE]
    threads: int = 8
    staleness_aware: bool = CLIENT_STALENESS_AWARE
    # DC-ASGD's lambda (0: off): pushes carry the values they were computed on.
    delay_compensation: float = 0.0
    # DC-ASGD-a (delay_compensation its lambda0) and gap-aware (pushes carry the values read, as
    # for DC-ASGD); the decay of the running means the shard keeps for them.
    dc_adaptive: bool = False
    gap_aware: bool = False
    remedy_decay: float = REMEDY_DECAY
    security: ClientSecurity = field(default_factory=ClientSecurity)
    # HTTP/2 keepalive: a connection that stops answering pings this long plus a bit is
    # given up, so a partition or a dead shard is noticed without waiting for TCP.
    keepalive_s: float = 10.0
    # How Push/Pull/PushPull travel: "auto" uses the shard's data plane, with shared memory
    # when the shard is on this machine; "tcp" the data plane without shared memory; "grpc"
    # everything over gRPC. With TLS the data plane's TCP connections run inside TLS too.
    transport: str = CLIENT_TRANSPORT
    # The longest one call takes, every attempt, backoff and data-plane fallback included; then
    # it raises Unavailable. Each attempt gets min(timeout_s, what is left). Checkpoint calls
    # and SSP waits have their own limits (see ``checkpoint`` and ``clock``).
    call_deadline_s: float = CLIENT_CALL_DEADLINE_S

    def __post_init__(self) -> None:
        if not self.addresses:
            raise ValueError("at least one shard address is needed")
        for a in self.addresses:
            if ":" not in a:
                raise ValueError(f"shard address must be host:port, got {a!r}")
        if not self.worker_id:
            raise ValueError("worker_id must not be empty")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")
        if self.retries is not None and self.retries < 0:
            raise ValueError(f"retries must be >= 0 or None (until the call's deadline), got {self.retries!r}")
        if self.chunk_elems < 1:
            raise ValueError(f"chunk_elems must be >= 1, got {self.chunk_elems!r}")
        if self.wire_dtype not in WIRE_DTYPES.values():
            raise ValueError(f"wire_dtype must be {or_names(WIRE_DTYPES)}, got {self.wire_dtype}")
        if not isinstance(self.security, ClientSecurity):
            raise ValueError(f"security must be a ClientSecurity, got {type(self.security).__name__}")
        if not self.keepalive_s > 0:
            raise ValueError(f"keepalive_s must be > 0, got {self.keepalive_s!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}")
        if not 0 < self.backoff_s <= self.max_backoff_s:
            raise ValueError(f"need 0 < backoff_s <= max_backoff_s, got {self.backoff_s!r}, {self.max_backoff_s!r}")
        if not (isinstance(self.call_deadline_s, (int, float)) and 0 < self.call_deadline_s < math.inf):
            raise ValueError(f"call_deadline_s must be a finite number of seconds > 0, got {self.call_deadline_s!r}")
        check_remedies(self.delay_compensation, self.dc_adaptive, self.remedy_decay)

    @property
    def sends_read_values(self) -> bool:
        """Whether pushes carry the values their gradients were computed on (a remedy needs them)."""
        return self.delay_compensation > 0 or self.gap_aware
