"""tether's exception hierarchy and the one table between it and gRPC status codes."""

from __future__ import annotations

import sys

import grpc

__all__ = [
    "OVERLOADED",
    "REJECT_REASONS",
    "USAGE_EXIT_CODE",
    "DeadlineExceeded",
    "FailedPrecondition",
    "InvalidArgument",
    "NotFound",
    "ResourceExhausted",
    "TetherError",
    "TooStale",
    "Unauthenticated",
    "Unavailable",
    "UsageError",
    "error_from_status",
    "reject_reason",
    "report_usage_error",
    "retryable",
    "status_of",
]

# What grpc's server says when it sheds a call past maximum_concurrent_rpcs, and the shard's data
# plane says the same: load, not a bad request, so clients retry it with backoff (a message over
# the size limit, also RESOURCE_EXHAUSTED, is not retried).
OVERLOADED = "Concurrent RPC limit exceeded"
# Retried until the call's deadline: the shard is down, restarting or unreachable, or went away
# mid-call. A client never cancels its own calls, so a CANCELLED it receives was the shard's (a
# shard draining at SIGTERM cancels the calls it still holds, an SSP Clock wait among them) or the
# connection's; every call is safe to repeat (pushes are deduplicated by sequence number).
_TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)

# What a command exits with when the user asked for something it cannot do (argparse's code).
USAGE_EXIT_CODE = 2


class UsageError(ValueError):
    """A mistake in what the user asked for: a flag value, a missing or malformed data file, a
    port in use. Entry points report it as one line naming the bad value and exit
    ``USAGE_EXIT_CODE``; it is not a ``TetherError`` (no shard call failed)."""


def report_usage_error(prog: str, exc: BaseException) -> int:
    """Print ``prog: error: <exc>`` as one line on stderr; returns ``USAGE_EXIT_CODE``."""
    message = " ".join(str(exc).split()) or type(exc).__name__
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    return USAGE_EXIT_CODE


class TetherError(Exception):
    """Base of every error tether raises on purpose."""


class InvalidArgument(TetherError, ValueError):
    """The request is malformed: bad dtype, shape, ids or values."""


class NotFound(TetherError, KeyError):
    """An unknown table or dense tensor."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable.
        return str(self.args[0]) if self.args else ""


class FailedPrecondition(TetherError):
    """The request does not fit the shard's state (wrong shard, conflicting spec)."""


class ResourceExhausted(TetherError):
    """A size or concurrency limit was hit."""


class Unauthenticated(TetherError):
    """Missing or wrong credentials."""


class TooStale(TetherError):
    """A push was rejected because its gradients are staler than the hard limit."""


class Unavailable(TetherError):
    """A shard could not be reached, even after retries."""


class DeadlineExceeded(TetherError, TimeoutError):
    """A call or a wait ran past its deadline."""


# Each error's status code, and the reason a shard's metrics give for a push it refused so
# (``tether_shard_updates_rejected_total{reason}``; errors without one count as invalid_argument).
_TABLE: tuple[tuple[type[TetherError], grpc.StatusCode, str | None], ...] = (
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument"),
    (NotFound, grpc.StatusCode.NOT_FOUND, "not_found"),
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION, "failed_precondition"),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED, "resource_exhausted"),
    (TooStale, grpc.StatusCode.ABORTED, "too_stale"),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED, "unauthenticated"),
    (Unavailable, grpc.StatusCode.UNAVAILABLE, None),
    (DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED, None),
)
_BY_CODE = {code: cls for cls, code, _ in _TABLE}
_REASON = {code: reason for _, code, reason in _TABLE if reason is not None}
# Every reason ``reject_reason`` gives.
REJECT_REASONS: tuple[str, ...] = tuple(_REASON.values())


def status_of(exc: TetherError) -> grpc.StatusCode:
    """gRPC status code for a tether error."""
    for cls, code, _ in _TABLE:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


def error_from_status(code: grpc.StatusCode, details: str) -> TetherError:
    """tether error for a gRPC status code (``TetherError`` itself for codes not in the table)."""
    return _BY_CODE.get(code, TetherError)(f"{code.name}: {details}")


def retryable(code: grpc.StatusCode, details: str) -> bool:
    """Whether a call that failed with ``code`` and ``details`` is worth another try (until its
    deadline): a shard that is away or draining, or one shedding load. Any other status, a
    RESOURCE_EXHAUSTED that names a size limit among them, is the shard's answer: the call fails
    with it at once."""
    return code in _TRANSIENT or (code == grpc.StatusCode.RESOURCE_EXHAUSTED and OVERLOADED in details)


def reject_reason(code: grpc.StatusCode) -> str:
    """Why a push refused with ``code`` was not applied, as the shard's metrics say it."""
    return _REASON.get(code, "invalid_argument")
