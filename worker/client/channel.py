"""One shard as the client sees it: its gRPC stub, its data-plane connections, and the retries of
every call to it (the one place a ``grpc.RpcError`` becomes a ``TetherError``).

Every RPC has a deadline; what ``tether.protos.errors.retryable`` calls transient (UNAVAILABLE,
DEADLINE_EXCEEDED, a CANCELLED the shard sent while draining, a shard shedding load past its
concurrent-call limit, a data-plane connection that failed) is retried with exponential backoff,
capped at ``max_backoff_s``, until the call's deadline, and a retried push keeps its sequence
number so the shard applies it once. A call as a whole, retries and data-plane fallback
included, ends within ``ClientConfig.call_deadline_s``: each attempt's deadline is what is left
of it, at most ``timeout_s``, and once it is spent the call raises ``Unavailable``. Only a
``ClientConfig.retries`` set explicitly ends it sooner, after that many retries.

A shard applies one client's pushes in the order they were started (``push_in_order``): the
next push to a shard is sent once the previous one is over, retries included.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import grpc

from tether.protos import framing as dp
from tether.protos import tether_pb2 as pb
from tether.protos import tether_pb2_grpc as pb_grpc
from tether.protos.errors import Unavailable, error_from_status, retryable
from tether.worker.client.config import ClientConfig
from tether.worker.client.data_channel import DataConnection, DataPlane, DataPlaneStatus
from tether.worker.client.results import Pending
from tether.worker.metrics import WorkerRecorder

__all__ = ["Answer", "Call", "DataCall", "ShardChannel", "channel_options", "time_left"]

log = logging.getLogger(__name__)

_DATA_METHODS = {"Push": dp.PUSH, "Pull": dp.PULL, "PushPull": dp.PUSH_PULL}
_RESPONSES = {"Push": pb.PushResponse, "Pull": pb.PullResponse, "PushPull": pb.PushPullResponse}
# ``answer(response, payload)`` turns a response into the call's result while its payload is
# valid (a data-plane payload lives in a buffer the next call reuses).
Answer = Callable[[Any, "memoryview | None"], Any]
# The least time a last try before the call's deadline is given (a refused connection takes
# microseconds; a shard that comes back is reached within this).
_LAST_TRY_S = 0.2
# Codes that say the shard was not reached (or went away mid-call): given up on, they are Unavailable.
_GONE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


class _Failed(Exception):
    """One attempt of a call failed with ``code``."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


@dataclass(frozen=True)
class Call:
    """One call to one shard: what to send and what to make of the answer."""

    method: str
    request: Any
    # Tensors of a Push/Pull/PushPull, laid out for the data plane (inlined for gRPC).
    payload: dp.PayloadWriter | None = None
    # Bytes of payload the answer will carry (the receive buffer is sized up front).
    response_bytes: int = 0
    answer: Answer | None = None
    # ``direct(meta, payload_len)``: where blocks of a data-plane answer can be received in
    # place, as (payload offset, buffer) pairs (``DataConnection.receive``'s ``place``).
    direct: Callable[[bytes, int], list[tuple[int, memoryview]]] | None = None


def _one_line(details: str) -> str:
    """A status's details on one line (gRPC's may carry a newline)."""
    return " ".join(details.split())


def time_left(deadline: float, limit: float) -> float:
    """Seconds an attempt may take: ``limit``, or what is left until ``deadline`` if less
    (never 0, which sockets take for non-blocking)."""
    return max(min(limit, deadline - time.monotonic()), 0.001)


def channel_options(config: ClientConfig) -> list[tuple[str, int]]:
    """gRPC channel options for every shard of a client."""
    keepalive_ms = int(config.keepalive_s * 1000)
    return [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.keepalive_time_ms", keepalive_ms),
        ("grpc.keepalive_timeout_ms", max(keepalive_ms // 2, 1000)),
        ("grpc.http2.max_pings_without_data", 0),
        # A restarted shard is found again within the client's own backoff, not grpc's
        # default of up to two minutes between reconnection attempts.
        ("grpc.initial_reconnect_backoff_ms", int(config.backoff_s * 1000)),
        ("grpc.max_reconnect_backoff_ms", int(config.max_backoff_s * 1000)),
        # grpc takes this as the connection attempt's timeout: one call's deadline.
        ("grpc.min_reconnect_backoff_ms", int(min(config.timeout_s, 20.0) * 1000)),
    ]


class ShardChannel:
    """Calls to one shard, with retries; the data plane when a call has a payload and the
    shard offers one, else gRPC."""

    def __init__(self, index: int, config: ClientConfig, metrics: WorkerRecorder) -> None:
        self.index = index
        self.address = config.addresses[index]
        self.config = config
        self.metrics = metrics
        options = channel_options(config)
        credentials = config.security.channel_credentials()
        if credentials is None:
            self._channel = grpc.insecure_channel(self.address, options=options)
        else:
            self._channel = grpc.secure_channel(self.address, credentials, options=options)
        self._metadata = config.security.metadata() or None
        self._stub = pb_grpc.ParameterServerStub(self._channel)
        self.data: DataPlane | None = None
        if config.transport != "grpc":
            self.data = DataPlane(
                self.address.rsplit(":", 1)[0].strip("[]"), config.security.token, config.timeout_s,
                config.transport == "auto", config.max_backoff_s, config.security.ssl_context(),
            )
        # Sequence numbers of pushes that may have reached the shard more than once (retried).
        self._resent: set[int] = set()
        self._resent_lock = threading.Lock()
        # The last push (or push_pull) started to this shard: the next is sent once it is over.
        self._last_push: Pending | None = None
        self._push_lock = threading.Lock()

    def close(self) -> None:
        """Close the data-plane connections and the gRPC channel."""
        if self.data is not None:
            self.data.close()
        self._channel.close()

    def transport(self) -> str:
        """How the shard is reached right now: "shm", "tcp", "tcp+tls" or "grpc"."""
        d = self.data
        conn = d.acquire(lambda: (0, "")) if d is not None and d.port else None
        if d is None or conn is None:
            return "grpc"
        d.release(conn)
        return "shm" if conn.region is not None else "tcp+tls" if conn.tls else "tcp"

    def was_resent(self, seq: int) -> bool:
        """Whether push ``seq`` was sent more than once (and forget it)."""
        with self._resent_lock:
            resent = seq in self._resent
            self._resent.discard(seq)
            return resent

    def push_in_order(self, start: Callable[[], Pending], call: Call, deadline: float, pool: Executor) -> Pending:
        """Start push ``call`` only once the previous push to this shard is over, so that the
        shard applies this client's pushes in the order they were started, on every transport.

        Over a pool of connections (or gRPC's threads) two pushes in flight at once may be
        applied in either order. So a push goes out only after the previous one was answered,
        retries included (which also keeps a retried push from overtaking the next): at once
        through ``start`` when the previous is over (or its answer has arrived: it is read
        here), else from a ``pool`` thread that waits for it. The caller never blocks on it.
        """
        with self._push_lock:
            prev = self._last_push
            if prev is None or prev.done():
                if prev is not None:
                    _settle(prev)
                pending = start()
            else:
                pending = pool.submit(self._push_after, prev, call, deadline)
            self._last_push = pending
            return pending

    def _push_after(self, prev: Pending, call: Call, deadline: float) -> Any:
        """Make push ``call`` once ``prev`` is over (a pool thread's part of ``push_in_order``)."""
        _settle(prev)
        return self.call(call, deadline=deadline)

    def call(self, call: Call, timeout: float | None = None, failed: _Failed | None = None, deadline: float | None = None) -> Any:
        """Make ``call`` with retries.

        Args:
            timeout: one attempt's deadline (default ``timeout_s``).
            failed: the first attempt, made elsewhere, failed so.
            deadline: ``time.monotonic()`` by which the whole call ends (default: now plus
                ``call_deadline_s``); each attempt gets at most what is left of it.

        Raises:
            Unavailable: the shard did not answer within the call's deadline (or the retries
                ``ClientConfig.retries`` allows, when it sets a number).
            TetherError: the shard refused the call (a status that is not transient).
        """
        cfg = self.config
        method = call.method
        # The error names the flag that bounds the wait (a checkpoint's is its own timeout_s).
        spent_what = ", the call's deadline spent" + ("" if method == "Checkpoint" else f" (--call-deadline {cfg.call_deadline_s:g} s)")
        if deadline is None:
            deadline = time.monotonic() + cfg.call_deadline_s
        backoff = cfg.backoff_s
        # No count of retries unless the config sets one: a shard restarting on a loaded machine
        # may take longer than any fixed count of backoffs, and the deadline bounds the call.
        cap = cfg.retries
        attempt = 0
        while True:
            if failed is None:
                left = deadline - time.monotonic()
                try:
                    if left <= 0:
                        raise _Failed(grpc.StatusCode.DEADLINE_EXCEEDED, "no time left for another try")
                    return self._attempt(call, min(timeout or cfg.timeout_s, left))
                except grpc.RpcError as exc:
                    failed = _Failed(exc.code(), exc.details() or "")
                    failed.__cause__ = exc
                except _Failed as exc:
                    failed = exc
            code, details = failed.code, failed.details
            self._note_resend(call.request)
            self.metrics.rpc_failed(method, code.name)
            # The pause before the next try: shortened to leave that try _LAST_TRY_S before the
            # deadline; with less than that left, the call gives up now, not after a pause.
            left = deadline - time.monotonic()
            pause = min(backoff * (0.5 + random.random()), left - _LAST_TRY_S)
            spent = pause < 0
            capped = cap is not None and attempt >= cap
            transient = retryable(code, details)
            if not transient or capped or spent:
                if code in _GONE:
                    # A refused TLS handshake looks like a shard that is down: say so.
                    hint = " (if the shard is up, check the TLS CA and client certificate)" if cfg.security.tls else ""
                    why = "" if capped else spent_what
                    raise Unavailable(
                        f"shard {self.index} ({self.address}) {method} failed after {attempt + 1} tries{why}: "
                        f"{code.name}: {_one_line(details)}{hint}"
                    ) from failed.__cause__
                raise error_from_status(code, f"shard {self.index} {method}: {_one_line(details)}") from failed.__cause__
            attempt += 1
            self.metrics.retried(method)
            # Retries go on until the deadline: the first, then every tenth, is worth a warning.
            log.log(logging.WARNING if attempt % 10 == 1 else logging.DEBUG,
                    "shard %d %s: %s, retry %d in %.2fs", self.index, method, code.name, attempt, pause)
            time.sleep(pause)
            backoff = min(backoff * 2, cfg.max_backoff_s)
            failed = None

    def _note_resend(self, request: object) -> None:
        """Remember that a push may reach the shard twice (its first try failed somewhere)."""
        push = request.push if isinstance(request, pb.PushPullRequest) else request
        if isinstance(push, pb.PushRequest):
            with self._resent_lock:
                self._resent.add(push.seq)

    def _attempt(self, call: Call, timeout: float) -> Any:
        started = time.monotonic()
        conn = self.data_connection(call, timeout)
        # Finding and opening a data connection counts against this attempt's deadline.
        timeout = max(timeout - (time.monotonic() - started), 0.001)
        if conn is None:
            if call.payload is not None:
                call.payload.inline(call.request)
            response = getattr(self._stub, call.method)(call.request, timeout=timeout, metadata=self._metadata)
            return call.answer(response, None) if call.answer else response
        self.data_send(conn, call, timeout)
        return self.data_receive(conn, call, timeout)

    def data_connection(self, call: Call, timeout: float | None = None) -> DataConnection | None:
        """A data-plane connection for ``call``, or None: it goes over gRPC."""
        if call.payload is None or self.data is None or call.method not in _DATA_METHODS:
            return None
        return self.data.acquire(lambda: self._discover(timeout), timeout)

    def data_send(self, conn: DataConnection, call: Call, timeout: float) -> None:
        """Send ``call`` on the data-plane connection ``conn`` (a failure drops or keeps it, see ``_data_failure``)."""
        assert call.payload is not None
        try:
            conn.send(_DATA_METHODS[call.method], call.request, call.payload, call.response_bytes, timeout)
        except BaseException as exc:
            raise self._data_failure(conn, exc) from exc

    def data_receive(self, conn: DataConnection, call: Call, timeout: float) -> Any:
        """The answer to ``call`` sent on ``conn``; the connection goes back to the pool (or is dropped on a failure)."""
        answer = call.answer
        try:
            meta, data = conn.receive(timeout) if call.direct is None else conn.receive(timeout, call.direct)
            response = _RESPONSES[call.method].FromString(meta)
            result = answer(response, data) if answer else response
        except BaseException as exc:
            raise self._data_failure(conn, exc) from exc
        assert self.data is not None
        self.data.release(conn)
        return result

    def _data_failure(self, conn: DataConnection, exc: BaseException) -> BaseException:
        """What a data-plane failure becomes, with the connection dropped or kept."""
        plane = self.data
        assert plane is not None
        if isinstance(exc, DataPlaneStatus):
            if exc.closed:
                plane.failed(conn)
            else:
                plane.release(conn)
            return _Failed(exc.code, exc.details)
        # The connection is gone or out of step (a shard that died, restarts or drains): calls
        # go over gRPC, whose retries wait for the shard, and its data port is asked again later.
        plane.failed(conn)
        if isinstance(exc, (OSError, dp.FrameError)):
            return _Failed(grpc.StatusCode.UNAVAILABLE, f"data plane: {exc}")
        return exc

    def _discover(self, timeout: float | None = None) -> tuple[int, str]:
        """The shard's data port and unix socket, asked over gRPC (one try: a failure means gRPC for a while)."""
        info = self._stub.Info(pb.InfoRequest(), timeout=timeout or self.config.timeout_s, metadata=self._metadata)
        return info.data_port, info.data_socket


def _settle(pending: Pending) -> None:
    """Wait until ``pending`` is over; its outcome, a failure included, is its owner's to read."""
    try:
        pending.result()
    except Exception:  # noqa: BLE001 - kept in ``pending`` and raised to whoever waits for it
        pass


class DataCall:
    """A data-plane call whose request is on its way; ``result`` reads the answer.

    If sending or receiving fails, the waiting thread falls back to ``ShardChannel.call``
    (retries, gRPC) for this call.
    """

    def __init__(self, channel: ShardChannel, conn: DataConnection, call: Call, deadline: float) -> None:
        self._channel = channel
        self._call = call
        # When the whole call ends (``time.monotonic()``), the gRPC fallback's retries included.
        self._deadline = deadline
        self._lock = threading.Lock()
        self._outcome: tuple[bool, Any] | None = None
        self._conn: DataConnection | None = conn
        self._failed: _Failed | None = None
        try:
            channel.data_send(conn, call, time_left(deadline, channel.config.timeout_s))
        except _Failed as exc:
            self._conn, self._failed = None, exc

    def done(self) -> bool:
        """Whether the answer is in (or has started to arrive)."""
        return self._outcome is not None or (self._conn is not None and self._conn.readable())

    def result(self, timeout: float | None = None) -> Any:
        """The call's result.

        Raises:
            TetherError: the call failed after retries.
            TimeoutError: no answer within ``timeout`` (the call goes on being retried by no one).
        """
        with self._lock:
            if self._outcome is None:
                self._outcome = self._finish(timeout)
        ok, value = self._outcome
        if not ok:
            raise value
        return value

    def _finish(self, timeout: float | None) -> tuple[bool, Any]:
        channel = self._channel
        limit = time_left(self._deadline, channel.config.timeout_s if timeout is None else min(timeout, channel.config.timeout_s))
        try:
            if self._conn is not None:
                try:
                    return True, channel.data_receive(self._conn, self._call, limit)
                except _Failed as exc:
                    self._failed = exc
            return True, channel.call(self._call, failed=self._failed, deadline=self._deadline)
        except Exception as exc:  # noqa: BLE001 - handed to every waiter, like a Future does
            return False, exc
