"""Client over all shards: ``push``, ``pull``, ``push_pull`` and ``wait`` (the ps-lite API).

Each call splits its ids and dense chunks by owning shard (one request per shard, every table
in it), sends the requests in parallel and returns a ``Handle`` at once; ``wait`` (or
``Handle.result``) gathers the answers. Every RPC has a deadline; UNAVAILABLE and
DEADLINE_EXCEEDED (and a shard shedding load past its concurrent-call limit) are retried with
exponential backoff, and a retried push keeps its sequence number so the shard applies it once.
A call as a whole, retries and data-plane fallback included, ends within
``ClientConfig.call_deadline_s``: each attempt's deadline is what is left of it, at most
``timeout_s``, and once it is spent the call raises ``Unavailable``.
Channels use TLS and send a bearer token when ``ClientConfig.security`` says so.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import os
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import numpy as np
import torch

from tether.protos import tether_pb2 as pb
from tether.protos import tether_pb2_grpc as pb_grpc
from tether.protos import dataplane as dp
from tether.protos.allocator import tune_malloc
from tether.protos.codec import decode_tensor, encode_ids, encode_tensor, wire_dtype
from tether.protos.errors import InvalidArgument, TetherError, Unavailable, error_from_status
from tether.protos.partition import dense_shard, split_ids
from tether.protos.security import ClientSecurity
from tether.protos.specs import OptimizerConfig, TableConfig
from tether.worker.dataplane import DataConnection, DataPlane, DataPlaneStatus

__all__ = ["CheckpointResult", "ClientConfig", "ClientSecurity", "ClockReply", "Handle", "PSClient", "PushAck", "PullResult"]

log = logging.getLogger(__name__)

_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# What grpc's server says when it sheds a call past maximum_concurrent_rpcs: load, not a bad
# request, so it is retried with backoff (a message over the size limit is not).
_OVERLOADED = "Concurrent RPC limit exceeded"


_TRANSPORTS = ("auto", "tcp", "grpc")
# Longest a Clock call asks the coordinator to hold it (shards cap it at 5 s themselves): a
# longer hold would only delay noticing a coordinator that stopped answering.
_CLOCK_HOLD_S = 5.0
_DATA_METHODS = {"Push": dp.PUSH, "Pull": dp.PULL, "PushPull": dp.PUSH_PULL}
_RESPONSES = {"Push": pb.PushResponse, "Pull": pb.PullResponse, "PushPull": pb.PushPullResponse}


def _retryable(code: grpc.StatusCode, details: str) -> bool:
    return code in _RETRYABLE or (code == grpc.StatusCode.RESOURCE_EXHAUSTED and _OVERLOADED in details)


class _Failed(Exception):
    """One attempt of a call failed with ``code``."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


@dataclass(frozen=True)
class ClientConfig:
    """Where the shards are and how to call them."""

    addresses: tuple[str, ...]
    worker_id: str
    # Deadline of one attempt (one RPC or data-plane round trip).
    timeout_s: float = 30.0
    retries: int = 8
    backoff_s: float = 0.05
    max_backoff_s: float = 2.0
    max_message_bytes: int = 256 * 1024 * 1024
    chunk_elems: int = 1 << 20
    wire_dtype: torch.dtype = torch.float32
    threads: int = 8
    staleness_aware: bool = False
    security: ClientSecurity = field(default_factory=ClientSecurity)
    # HTTP/2 keepalive: a connection that stops answering pings this long plus a bit is
    # given up, so a partition or a dead shard is noticed without waiting for TCP.
    keepalive_s: float = 10.0
    # How Push/Pull/PushPull travel: "auto" uses the shard's data plane, with shared memory
    # when the shard is on this machine; "tcp" the data plane without shared memory; "grpc"
    # everything over gRPC. With TLS the data plane's TCP connections run inside TLS too.
    transport: str = "auto"
    # The longest one call takes, every attempt, backoff and data-plane fallback included; then
    # it raises Unavailable. Each attempt gets min(timeout_s, what is left). Checkpoint calls
    # and SSP waits have their own limits (see ``checkpoint`` and ``clock``).
    call_deadline_s: float = 60.0

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
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries!r}")
        if self.chunk_elems < 1:
            raise ValueError(f"chunk_elems must be >= 1, got {self.chunk_elems!r}")
        if self.wire_dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"wire_dtype must be float32, float16 or bfloat16, got {self.wire_dtype}")
        if not isinstance(self.security, ClientSecurity):
            raise ValueError(f"security must be a ClientSecurity, got {type(self.security).__name__}")
        if not self.keepalive_s > 0:
            raise ValueError(f"keepalive_s must be > 0, got {self.keepalive_s!r}")
        if self.transport not in _TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(_TRANSPORTS)}, got {self.transport!r}")
        if not 0 < self.backoff_s <= self.max_backoff_s:
            raise ValueError(f"need 0 < backoff_s <= max_backoff_s, got {self.backoff_s!r}, {self.max_backoff_s!r}")
        if not (isinstance(self.call_deadline_s, (int, float)) and 0 < self.call_deadline_s < math.inf):
            raise ValueError(f"call_deadline_s must be a finite number of seconds > 0, got {self.call_deadline_s!r}")


@dataclass
class PullResult:
    """Pulled rows per table (in the order of the ids asked for) and dense tensors."""

    rows: dict[str, torch.Tensor]
    dense: dict[str, torch.Tensor]
    # Versions the values were read at, to be sent back with the gradients they produce.
    table_versions: dict[tuple[int, str], int]
    dense_versions: dict[tuple[str, int], int]
    # What the shards said of the push, for the result of a ``push_pull`` (None for a pull).
    ack: PushAck | None = None


@dataclass(frozen=True)
class PushAck:
    """What the shards said of a push."""

    staleness: int  # largest number of updates a block's values were behind
    clock_staleness: int  # ticks the slowest live worker was behind this step
    duplicates: int  # shards that had already applied it (a retried push)


@dataclass(frozen=True)
class CheckpointResult:
    """One shard's part of a checkpoint."""

    shard: int
    id: str
    path: str
    bytes: int
    seconds: float


@dataclass(frozen=True)
class ClockReply:
    """Clocks of the live workers as the coordinating shard sees them."""

    min_clock: int
    max_clock: int
    live_workers: int
    ready: bool
    min_other_clock: int = 0


class Handle:
    """An operation in flight on one or more shards."""

    def __init__(self, futures: Sequence[Future | _DataCall], combine: Callable[[list[object]], object]) -> None:
        self._futures = list(futures)
        self._combine = combine

    def done(self) -> bool:
        """Whether every shard has answered."""
        return all(f.done() for f in self._futures)

    def result(self, timeout: float | None = None) -> object:
        """Wait for every shard and return the combined answer.

        Raises:
            TetherError: the first shard error (after retries).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        answers = []
        for f in self._futures:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            answers.append(f.result(remaining))
        return self._combine(answers)


@dataclass
class _PullPlan:
    """Where a pull's answers go: result tensors allocated up front, filled shard by shard."""

    rows: dict[str, torch.Tensor]
    flats: dict[str, torch.Tensor]
    shapes: dict[str, tuple[int, ...]]
    # (shard, table) -> positions of that shard's ids in the table's request (None: all, in order).
    positions: dict[tuple[int, str], np.ndarray | None] = field(default_factory=dict)
    response_bytes: dict[int, int] = field(default_factory=dict)
    table_versions: dict[tuple[int, str], int] = field(default_factory=dict)
    dense_versions: dict[tuple[str, int], int] = field(default_factory=dict)

    def result(self) -> PullResult:
        dense = {name: flat.view(self.shapes[name]) for name, flat in self.flats.items()}
        return PullResult(self.rows, dense, self.table_versions, self.dense_versions)


@dataclass(frozen=True)
class _DenseLayout:
    shape: tuple[int, ...]
    numel: int
    chunks: tuple[tuple[int, int, int], ...]  # (index, start, stop) into the flat tensor


class PSClient:
    """Push/pull over all shards of a job."""

    def __init__(self, config: ClientConfig, metrics: object | None = None) -> None:
        # Steps free and allocate tensors of MiBs: keep them in the heap (tether.protos.allocator).
        tune_malloc()
        self.config = config
        self.metrics = metrics
        self.num_shards = len(config.addresses)
        keepalive_ms = int(config.keepalive_s * 1000)
        options = [
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
        credentials = config.security.channel_credentials()
        if credentials is None:
            self._channels = [grpc.insecure_channel(a, options=options) for a in config.addresses]
        else:
            self._channels = [grpc.secure_channel(a, credentials, options=options) for a in config.addresses]
        self._metadata = config.security.metadata() or None
        self._stubs = [pb_grpc.ParameterServerStub(c) for c in self._channels]
        self._pool = ThreadPoolExecutor(max_workers=max(config.threads, self.num_shards), thread_name_prefix="tether-client")
        # A random id of this client process: shards deduplicate its pushes by (worker id,
        # incarnation, seq), so a worker restarted under the same id is not taken for a retry.
        self.incarnation = int.from_bytes(os.urandom(8), "little") or 1
        self._seq = [itertools.count(1) for _ in range(self.num_shards)]
        self._seq_lock = threading.Lock()
        # (shard, seq) of pushes that may have reached a shard more than once (retried).
        self._resent: set[tuple[int, int]] = set()
        self._dims: dict[str, int] = {}
        self._dense: dict[str, _DenseLayout] = {}
        self._splits: dict[str, list[tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]]] = {}
        self._split_lock = threading.Lock()
        self._data: list[DataPlane] | None = None
        if config.transport != "grpc":
            ssl_context = config.security.ssl_context()
            self._data = [
                DataPlane(a.rsplit(":", 1)[0].strip("[]"), config.security.token, config.timeout_s, config.transport == "auto",
                          config.max_backoff_s, ssl_context)
                for a in config.addresses
            ]

    def close(self) -> None:
        """Close channels, data-plane connections and the fan-out pool."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        for d in self._data or ():
            d.close()
        for c in self._channels:
            c.close()

    def transports(self) -> list[str]:
        """How each shard is reached right now: "shm", "tcp", "tcp+tls" or "grpc"."""
        out = []
        for d in self._data or [None] * self.num_shards:
            conn = None if d is None or not d.port else d.acquire(lambda: (0, ""))
            out.append("grpc" if conn is None else "shm" if conn.region is not None else "tcp+tls" if conn.tls else "tcp")
            if conn is not None:
                d.release(conn)
        return out

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the one place RpcError is caught -----------------------------------------------------

    def _call(
        self,
        shard: int,
        method: str,
        request: object,
        timeout: float | None = None,
        payload: dp.PayloadWriter | None = None,
        response_bytes: int = 0,
        answer: Callable[[object, memoryview | None], object] | None = None,
        failed: _Failed | None = None,
        deadline: float | None = None,
    ) -> object:
        """Call ``method`` on ``shard`` with retries; the data plane when the request has a
        ``payload`` and the shard offers one, else gRPC.

        Args:
            timeout: one attempt's deadline (default ``timeout_s``).
            answer: ``answer(response, payload)`` turns the response into the result while its
                payload is valid (a data-plane payload lives in a buffer the next call reuses).
            failed: the first attempt, made elsewhere, failed so.
            deadline: ``time.monotonic()`` by which the whole call ends (default: now plus
                ``call_deadline_s``); each attempt gets at most what is left of it.

        Raises:
            Unavailable: the shard did not answer within the retries or the call's deadline.
        """
        cfg = self.config
        if deadline is None:
            deadline = time.monotonic() + cfg.call_deadline_s
        backoff = cfg.backoff_s
        for attempt in range(cfg.retries + 1):
            if failed is None:
                left = deadline - time.monotonic()
                try:
                    if left <= 0:
                        raise _Failed(grpc.StatusCode.DEADLINE_EXCEEDED, "no time left for another try")
                    return self._attempt(shard, method, request, min(timeout or cfg.timeout_s, left), payload, response_bytes, answer)
                except grpc.RpcError as exc:
                    failed = _Failed(exc.code(), exc.details() or "")
                    failed.__cause__ = exc
                except _Failed as exc:
                    failed = exc
            code, details = failed.code, failed.details
            self._note_resend(shard, request)
            if self.metrics is not None:
                self.metrics.rpc_errors.labels(rpc=method, code=code.name).inc()
            pause = backoff * (0.5 + random.random())
            # No retry that could not start before the deadline: give up now, not after the pause.
            spent = time.monotonic() + pause >= deadline
            if not _retryable(code, details) or attempt == cfg.retries or spent:
                if code in _RETRYABLE:
                    # A refused TLS handshake looks like a shard that is down: say so.
                    hint = " (if the shard is up, check the TLS CA and client certificate)" if cfg.security.tls else ""
                    why = " and the call's deadline is spent" if spent and attempt < cfg.retries else ""
                    raise Unavailable(
                        f"shard {shard} ({cfg.addresses[shard]}) {method} failed after {attempt + 1} tries{why}: "
                        f"{code.name}: {details}{hint}"
                    ) from failed.__cause__
                raise error_from_status(code, f"shard {shard} {method}: {details}") from failed.__cause__
            if self.metrics is not None:
                self.metrics.retries.labels(rpc=method).inc()
            log.warning("shard %d %s: %s, retry %d in %.2fs", shard, method, code.name, attempt + 1, pause)
            time.sleep(pause)
            backoff = min(backoff * 2, cfg.max_backoff_s)
            failed = None
        raise AssertionError("unreachable")

    def _note_resend(self, shard: int, request: object) -> None:
        """Remember that a push may reach ``shard`` twice (its first try failed somewhere)."""
        push = request.push if isinstance(request, pb.PushPullRequest) else request
        if isinstance(push, pb.PushRequest):
            with self._seq_lock:
                self._resent.add((shard, push.seq))

    def _attempt(
        self,
        shard: int,
        method: str,
        request: object,
        timeout: float,
        payload: dp.PayloadWriter | None,
        response_bytes: int,
        answer: Callable[[object, memoryview | None], object] | None,
    ) -> object:
        started = time.monotonic()
        conn = self._data_connection(shard, method, payload, timeout)
        # Finding and opening a data connection counts against this attempt's deadline.
        timeout = max(timeout - (time.monotonic() - started), 0.001)
        if conn is None:
            if payload is not None:
                payload.inline(request)
            response = getattr(self._stubs[shard], method)(request, timeout=timeout, metadata=self._metadata)
            return answer(response, None) if answer else response
        self._data_send(shard, conn, method, request, payload, response_bytes, timeout)
        return self._data_receive(shard, conn, method, timeout, answer)

    def _data_connection(
        self, shard: int, method: str, payload: dp.PayloadWriter | None, timeout: float | None = None
    ) -> DataConnection | None:
        if payload is None or self._data is None or method not in _DATA_METHODS:
            return None
        return self._data[shard].acquire(lambda: self._discover(shard, timeout), timeout)

    def _data_send(
        self, shard: int, conn: DataConnection, method: str, request: object, payload: dp.PayloadWriter, response_bytes: int, timeout: float
    ) -> None:
        try:
            conn.send(_DATA_METHODS[method], request, payload, response_bytes, timeout)
        except BaseException as exc:
            raise self._data_failure(shard, conn, exc) from exc

    def _data_receive(
        self, shard: int, conn: DataConnection, method: str, timeout: float, answer: Callable[[object, memoryview | None], object] | None
    ) -> object:
        direct = getattr(getattr(answer, "func", None), "direct", None)
        place = None if direct is None else functools.partial(direct, shard)
        try:
            meta, data = conn.receive(timeout) if place is None else conn.receive(timeout, place)
            response = _RESPONSES[method].FromString(meta)
            result = answer(response, data) if answer else response
        except BaseException as exc:
            raise self._data_failure(shard, conn, exc) from exc
        self._data[shard].release(conn)
        return result

    def _data_failure(self, shard: int, conn: DataConnection, exc: BaseException) -> BaseException:
        """What a data-plane failure becomes, with the connection dropped or kept."""
        plane = self._data[shard]
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

    def _discover(self, shard: int, timeout: float | None = None) -> tuple[int, str]:
        """The shard's data port and unix socket, asked over gRPC (one try: a failure means gRPC for a while)."""
        info = self._stubs[shard].Info(pb.InfoRequest(), timeout=timeout or self.config.timeout_s, metadata=self._metadata)
        return info.data_port, info.data_socket

    def _fan_out(
        self,
        method: str,
        requests: Mapping[int, object],
        combine: Callable[[dict[int, object]], object],
        payloads: Mapping[int, dp.PayloadWriter] | None = None,
        response_bytes: Mapping[int, int] | None = None,
        answer: Callable[[int, object, memoryview | None], object] | None = None,
    ) -> Handle:
        """Start ``method`` on every shard of ``requests``: on the data plane the request is sent
        from this thread right away and the answer read by whoever waits (no thread hop);
        over gRPC a pool thread makes the call. Each shard's call ends within ``call_deadline_s``
        from now, whichever way it goes."""
        shards = list(requests)
        calls = []
        deadline = time.monotonic() + self.config.call_deadline_s
        for s in shards:
            payload = None if payloads is None else payloads.get(s)
            args = (s, method, requests[s], None, payload, 0 if response_bytes is None else response_bytes.get(s, 0),
                    None if answer is None else functools.partial(answer, s))
            conn = self._data_connection(s, method, payload, _left(deadline, self.config.timeout_s))
            if conn is None:
                calls.append(self._pool.submit(self._call, *args, deadline=deadline))
            else:
                calls.append(_DataCall(self, conn, args, deadline))
        return Handle(calls, lambda answers: combine(dict(zip(shards, answers))))

    # -- declare -----------------------------------------------------------------------------

    def declare(
        self,
        tables: Sequence[TableConfig] = (),
        dense: Mapping[str, torch.Tensor] | None = None,
        dense_optimizer: OptimizerConfig | None = None,
    ) -> None:
        """Create tables on every shard and dense parameters (split into chunks) on their owners.

        Idempotent: every worker of a job may declare the same model. The first declaration of
        a dense chunk sets its initial value.

        Raises:
            FailedPrecondition: a table or chunk exists with another spec.
        """
        opt = (dense_optimizer or OptimizerConfig()).to_proto()
        requests = {s: pb.DeclareRequest() for s in range(self.num_shards)}
        for t in tables:
            spec = t.to_proto()
            for r in requests.values():
                r.tables.append(spec)
        layouts = {}
        for name, tensor in (dense or {}).items():
            flat = tensor.detach().reshape(-1).to("cpu", torch.float32)
            step = self.config.chunk_elems
            chunks = tuple((i, a, min(a + step, flat.numel())) for i, a in enumerate(range(0, flat.numel(), step)))
            layouts[name] = _DenseLayout(tuple(tensor.shape), flat.numel(), chunks)
            for index, a, b in chunks:
                d = requests[dense_shard(name, index, self.num_shards)].dense.add(name=name, index=index, optimizer=opt)
                encode_tensor(flat[a:b], d.init)
        answers = self._fan_out("Declare", requests, lambda a: a).result()
        for s, a in answers.items():
            if self._data is not None:
                self._data[s].set_port(a.data_port, a.data_socket)
        for t in tables:
            self._dims[t.name] = t.dim
        self._dense.update(layouts)

    # -- pull --------------------------------------------------------------------------------

    def _check_ids(self, table: str, ids: torch.Tensor) -> np.ndarray:
        if table not in self._dims:
            raise InvalidArgument(f"table {table!r} was not declared by this client")
        if ids.dtype != torch.int64 or ids.dim() != 1:
            raise InvalidArgument(f"table {table!r}: ids must be a 1-D int64 tensor, got {ids.dtype} {tuple(ids.shape)}")
        return ids.detach().cpu().numpy()

    def _pull_requests(self, sparse: Mapping[str, torch.Tensor], dense: Sequence[str]) -> tuple[dict[int, pb.PullRequest], _PullPlan]:
        requests: dict[int, pb.PullRequest] = {}
        plan = _PullPlan(
            rows={},
            flats={name: torch.empty(self._dense_layout(name).numel) for name in dense},
            shapes={name: self._dense[name].shape for name in dense},
        )
        itemsize = torch.empty(0, dtype=self.config.wire_dtype).element_size()

        def req(s: int) -> pb.PullRequest:
            if s not in requests:
                requests[s] = pb.PullRequest(worker_id=self.config.worker_id, wire_dtype=wire_dtype(self.config.wire_dtype))
            return requests[s]

        for table, ids in sparse.items():
            arr = self._check_ids(table, ids)
            plan.rows[table] = torch.empty(arr.size, self._dims[table])
            for s, (pos, part) in enumerate(self._split(table, arr)):
                if part.size:
                    req(s).sparse.add(table=table, ids=encode_ids(part))
                    plan.positions[(s, table)] = None if part.size == arr.size else pos
                    plan.response_bytes[s] = plan.response_bytes.get(s, 0) + dp.align(part.size * self._dims[table] * itemsize)
        for name in dense:
            for index, a, b in self._dense[name].chunks:
                s = dense_shard(name, index, self.num_shards)
                req(s).dense.add(name=name, index=index)
                plan.response_bytes[s] = plan.response_bytes.get(s, 0) + dp.align((b - a) * itemsize)
        return requests, plan

    def _split(self, table: str, arr: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """``split_ids``, remembered for the last two id sets of each table: a step pushes the
        very ids it pulled (compared, not trusted, before reuse)."""
        with self._split_lock:
            recent = self._splits.setdefault(table, [])
            for ids, parts in recent:
                if ids.shape == arr.shape and np.array_equal(ids, arr):
                    return parts
        parts = split_ids(arr, self.num_shards)
        with self._split_lock:
            recent.insert(0, (arr.copy(), parts))
            del recent[2:]
        return parts

    def _dense_layout(self, name: str) -> _DenseLayout:
        try:
            return self._dense[name]
        except KeyError:
            raise InvalidArgument(f"dense parameter {name!r} was not declared by this client") from None

    def _place_pull(
        self, plan: _PullPlan, shard: int, response: pb.PullResponse, payload: memoryview | None, placed: frozenset = frozenset()
    ) -> None:
        """Copy one shard's pulled rows and chunks into the result (while ``payload`` is valid),
        but for the blocks in ``placed``, received there already (``_PullAnswer.direct``)."""
        for block in response.sparse:
            pos = plan.positions[(shard, block.table)]
            if ("sparse", block.table) in placed:
                pass
            elif pos is None:
                plan.rows[block.table].copy_(decode_tensor(block.values, torch.float32, payload))
            else:
                # NumPy's row scatter is 2-3x torch's index_copy_ here (a memcpy per row).
                plan.rows[block.table].numpy()[pos] = decode_tensor(block.values, torch.float32, payload).numpy()
            plan.table_versions[(shard, block.table)] = block.read_version
        for b in response.dense:
            _, a, stop = self._dense[b.name].chunks[b.index]
            if ("dense", b.name, b.index) not in placed:
                plan.flats[b.name][a:stop] = decode_tensor(b.value, torch.float32, payload)
            plan.dense_versions[(b.name, b.index)] = b.read_version

    def pull(self, sparse: Mapping[str, torch.Tensor] | None = None, dense: Sequence[str] = ()) -> Handle:
        """Start pulling rows of ``sparse`` (table -> unique int64 ids) and dense tensors.

        Returns:
            A handle whose result is a ``PullResult``.

        Raises:
            InvalidArgument: undeclared table or tensor, or ids that are not 1-D int64.
        """
        requests, plan = self._pull_requests(sparse or {}, dense)
        return self._fan_out(
            "Pull", requests, lambda _: plan.result(), payloads={s: dp.PayloadWriter() for s in requests},
            response_bytes=plan.response_bytes, answer=_PullAnswer(self, plan),
        )

    # -- push --------------------------------------------------------------------------------

    def _next_seq(self, shard: int) -> int:
        with self._seq_lock:
            return next(self._seq[shard])

    def _push_requests(
        self,
        sparse: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
        dense: Mapping[str, torch.Tensor],
        clock: int,
        versions: PullResult | None,
    ) -> tuple[dict[int, pb.PushRequest], dict[int, dp.PayloadWriter]]:
        requests: dict[int, pb.PushRequest] = {}
        payloads: dict[int, dp.PayloadWriter] = {}
        wire = self.config.wire_dtype

        def req(s: int) -> pb.PushRequest:
            if s not in requests:
                requests[s] = pb.PushRequest(worker_id=self.config.worker_id, incarnation=self.incarnation, clock=clock)
                payloads[s] = dp.PayloadWriter()
            return requests[s]

        for table, (ids, grads) in sparse.items():
            arr = self._check_ids(table, ids)
            if tuple(grads.shape) != (arr.size, self._dims[table]):
                raise InvalidArgument(f"table {table!r}: gradient shape {tuple(grads.shape)} != ({arr.size}, {self._dims[table]})")
            grads = grads.detach().to("cpu")
            for s, (pos, part) in enumerate(self._split(table, arr)):
                if part.size:
                    rv = versions.table_versions.get((s, table), 0) if versions else 0
                    b = req(s).sparse.add(table=table, ids=encode_ids(part), read_version=rv)
                    payloads[s].add(grads, b.values, wire, rows=None if part.size == arr.size else torch.from_numpy(pos))
        for name, grad in dense.items():
            layout = self._dense_layout(name)
            if tuple(grad.shape) != layout.shape:
                raise InvalidArgument(f"dense {name!r}: gradient shape {tuple(grad.shape)} != {layout.shape}")
            flat = grad.detach().reshape(-1).to("cpu")
            for index, a, b in layout.chunks:
                rv = versions.dense_versions.get((name, index), 0) if versions else 0
                s = dense_shard(name, index, self.num_shards)
                d = req(s).dense.add(name=name, index=index, read_version=rv)
                payloads[s].add(flat[a:b], d.value, wire)
        if clock:
            # Every shard tracks every worker's clock, so each gets the push, empty or not.
            for s in range(self.num_shards):
                req(s)
        for s, r in requests.items():
            r.seq = self._next_seq(s)
            r.staleness_aware = self.config.staleness_aware
        return requests, payloads

    def _ack(self, answers: dict[int, pb.PushResponse], requests: Mapping[int, pb.PushRequest]) -> PushAck:
        """One ``PushAck`` from every shard's answer; a duplicate this client did not resend is
        logged and counted (a shard that lost track of incarnations, or a copied client)."""
        values = list(answers.values())
        for s, a in answers.items():
            key = (s, requests[s].seq)
            with self._seq_lock:
                resent = key in self._resent
                self._resent.discard(key)
            if not a.applied and not resent:
                log.warning(
                    "shard %d called push %d of worker %r (incarnation %016x) a duplicate, but it was sent once",
                    s, requests[s].seq, self.config.worker_id, self.incarnation,
                )
                if self.metrics is not None:
                    self.metrics.unexpected_duplicates.inc()
        return PushAck(
            staleness=max((a.max_staleness for a in values), default=0),
            clock_staleness=max((a.clock_staleness for a in values), default=0),
            duplicates=sum(not a.applied for a in values),
        )

    def push(
        self,
        sparse: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
        dense: Mapping[str, torch.Tensor] | None = None,
        clock: int = 0,
        versions: PullResult | None = None,
    ) -> Handle:
        """Start pushing row gradients (table -> (unique ids, grads)) and dense gradients.

        Args:
            sparse: per table, the ids and their gradients (rows x dim).
            dense: per dense parameter, its full gradient.
            clock: the worker's clock (steps completed) for these gradients.
            versions: the pull the gradients were computed from (staleness accounting).

        Returns:
            A handle whose result is a ``PushAck``.
        """
        requests, payloads = self._push_requests(sparse or {}, dense or {}, clock, versions)
        return self._fan_out("Push", requests, lambda acks: self._ack(acks, requests), payloads=payloads)

    def push_pull(
        self,
        push_sparse: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
        push_dense: Mapping[str, torch.Tensor] | None = None,
        pull_sparse: Mapping[str, torch.Tensor] | None = None,
        pull_dense: Sequence[str] = (),
        clock: int = 0,
        versions: PullResult | None = None,
    ) -> Handle:
        """Push gradients and pull parameters in one round trip per shard.

        Returns:
            A handle whose result is a ``PullResult`` whose ``ack`` is the push's.
        """
        pushes, payloads = self._push_requests(push_sparse or {}, push_dense or {}, clock, versions)
        pulls, plan = self._pull_requests(pull_sparse or {}, pull_dense)
        requests = {}
        for s in set(pushes) | set(pulls):
            push = pushes.get(s) or pb.PushRequest(
                worker_id=self.config.worker_id, incarnation=self.incarnation, clock=clock, seq=self._next_seq(s)
            )
            pull = pulls.get(s) or pb.PullRequest(worker_id=self.config.worker_id)
            requests[s] = pb.PushPullRequest(push=push, pull=pull)
            payloads.setdefault(s, dp.PayloadWriter())

        def place(shard: int, response: pb.PushPullResponse, payload: memoryview | None) -> pb.PushResponse:
            self._place_pull(plan, shard, response.pull, payload)
            return response.push

        def combine(acks: dict[int, pb.PushResponse]) -> PullResult:
            result = plan.result()
            result.ack = self._ack(acks, {s: r.push for s, r in requests.items()})
            return result

        return self._fan_out(
            "PushPull", requests, combine, payloads=payloads, response_bytes=plan.response_bytes, answer=place
        )

    def clock(self, clock: int, wait_bound: int = -1, timeout_s: float = 60.0, leave: bool = False) -> ClockReply:
        """Report this worker's clock to every shard and, with ``wait_bound`` >= 0, wait on
        shard 0 (the coordinator) until the slowest live worker is at most ``wait_bound``
        ticks behind ``clock``.

        Call it only once the pushes of the steps it reports are acknowledged.

        ``timeout_s`` bounds the wait for the other workers (the SSP wait); it is made of calls
        that each ask the coordinator to hold them for a few seconds at most, and each such
        call, like every report, ends within ``call_deadline_s`` plus the time it asked to be
        held. A coordinator that stops answering is so given up on after at most
        ``call_deadline_s`` + 5 s, not after the whole SSP wait.

        Returns:
            The clocks; ``ready`` is False if ``timeout_s`` passed first.

        Raises:
            Unavailable: a shard did not answer within the retries or the call's deadline.
        """
        report = pb.ClockRequest(worker_id=self.config.worker_id, clock=clock, leave=leave, wait_bound=-1)
        others = self._fan_out("Clock", {s: report for s in range(1, self.num_shards)}, lambda _: None)
        try:
            return self._clock_wait(clock, wait_bound, timeout_s, leave)
        finally:
            others.result(self.config.call_deadline_s + self.config.timeout_s)

    def _clock_wait(self, clock: int, wait_bound: int, timeout_s: float, leave: bool) -> ClockReply:
        cfg = self.config
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            wait_ms = int(min(max(remaining, 0), cfg.timeout_s, _CLOCK_HOLD_S) * 1000) if wait_bound >= 0 else 0
            request = pb.ClockRequest(
                worker_id=cfg.worker_id, clock=clock, leave=leave, wait_bound=wait_bound, wait_timeout_ms=wait_ms
            )
            # The shard may hold the call that long (it caps it at a few seconds): the time it
            # is held is the SSP wait's, not lost to a slow or dead shard.
            held = wait_ms / 1000.0
            reply = self._call(
                0, "Clock", request, timeout=cfg.timeout_s + held, deadline=time.monotonic() + cfg.call_deadline_s + held
            )
            if reply.ready or remaining <= 0:
                return ClockReply(reply.min_clock, reply.max_clock, reply.live_workers, reply.ready, reply.min_other_clock)

    @staticmethod
    def wait(handle: Handle, timeout: float | None = None) -> object:
        """Wait for ``handle`` (ps-lite's ``Wait``)."""
        return handle.result(timeout)

    def checkpoint(self, ckpt_id: str, timeout_s: float = 600.0) -> list[CheckpointResult]:
        """Have every shard write its part of checkpoint ``ckpt_id`` (a step, an epoch, a time).

        The checkpoint is complete once every shard answered. Calling it between steps (no
        push in flight) makes the parts one consistent point of the whole model.

        Args:
            timeout_s: the longest the call takes, retries included (writing a large table takes
                seconds, so this, not ``call_deadline_s``, bounds it).

        Raises:
            InvalidArgument: an id that is not 1..128 characters of [A-Za-z0-9._-].
            FailedPrecondition: a shard without a checkpoint directory, or one that cannot write.
            Unavailable: a shard did not answer within ``timeout_s``.
        """
        request = pb.CheckpointRequest(id=ckpt_id)
        deadline = time.monotonic() + timeout_s
        futures = [
            self._pool.submit(self._call, s, "Checkpoint", request, timeout_s, deadline=deadline) for s in range(self.num_shards)
        ]

        def combine(answers: list[pb.CheckpointResponse]) -> list[CheckpointResult]:
            return [CheckpointResult(s, a.id, a.path, a.bytes, a.seconds) for s, a in enumerate(answers)]

        return Handle(futures, combine).result(timeout_s + 10.0)

    def info(self) -> list[pb.InfoResponse]:
        """Every shard's ``Info``."""
        return list(self._fan_out("Info", {s: pb.InfoRequest() for s in range(self.num_shards)}, lambda a: [a[s] for s in sorted(a)]).result())


def _left(deadline: float, limit: float) -> float:
    """Seconds an attempt may take: ``limit``, or what is left until ``deadline`` if less
    (never 0, which sockets take for non-blocking)."""
    return max(min(limit, deadline - time.monotonic()), 0.001)


class _PullAnswer:
    """A pull's answer: each shard's values copied into the plan's result tensors; over a TCP data
    connection, whole fp32 blocks (a dense chunk, a table's rows in request order) are received
    straight into them instead (``direct``), which saves a copy of every byte pulled."""

    def __init__(self, client: PSClient, plan: _PullPlan) -> None:
        self._client = client
        self._plan = plan
        # shard -> blocks the last data-plane answer received in place (keys of ``_place_pull``).
        self._placed: dict[int, frozenset] = {}

    def __call__(self, shard: int, response: pb.PullResponse, payload: memoryview | None) -> None:
        # Over gRPC (no payload) nothing was received in place, whatever an earlier try named.
        placed = self._placed.pop(shard, frozenset()) if payload is not None else frozenset()
        self._client._place_pull(self._plan, shard, response, payload, placed)

    def direct(self, shard: int, meta: bytes, payload_len: int) -> list[tuple[int, memoryview]]:
        """Where the blocks of this answer can be received in place: (payload offset, bytes),
        ascending and disjoint inside ``payload_len`` (else none: all go through the buffer)."""
        plan = self._plan
        response = pb.PullResponse.FromString(meta)
        fp32 = wire_dtype(torch.float32)
        out, keys = [], []
        for block in response.sparse:
            rows = plan.rows.get(block.table)
            v = block.values
            if (rows is not None and plan.positions.get((shard, block.table), 0) is None and v.dtype == fp32
                    and not v.data and v.payload_bytes == rows.numel() * 4 and tuple(v.shape) == tuple(rows.shape)):
                out.append((v.payload_offset, memoryview(rows.numpy()).cast("B")))
                keys.append(("sparse", block.table))
        for b in response.dense:
            layout = self._client._dense.get(b.name)
            flat = plan.flats.get(b.name)
            if layout is None or flat is None or not 0 <= b.index < len(layout.chunks):
                continue
            _, a, stop = layout.chunks[b.index]
            v = b.value
            if v.dtype == fp32 and not v.data and v.payload_bytes == (stop - a) * 4 and list(v.shape) == [stop - a]:
                out.append((v.payload_offset, memoryview(flat[a:stop].numpy()).cast("B")))
                keys.append(("dense", b.name, b.index))
        order = sorted(range(len(out)), key=lambda i: out[i][0])
        end = 0
        for i in order:
            offset, dest = out[i]
            if offset < end or offset + dest.nbytes > payload_len:
                self._placed[shard] = frozenset()
                return []
            end = offset + dest.nbytes
        self._placed[shard] = frozenset(keys)
        return [out[i] for i in order]


class _DataCall:
    """A data-plane call whose request is on its way; ``result`` reads the answer.

    If sending or receiving fails, the waiting thread falls back to ``PSClient._call`` (retries,
    gRPC) for this call.
    """

    def __init__(self, client: PSClient, conn: DataConnection, args: tuple, deadline: float) -> None:
        self._client = client
        self._args = args
        # When the whole call ends (``time.monotonic()``), the gRPC fallback's retries included.
        self._deadline = deadline
        self._lock = threading.Lock()
        self._outcome: tuple[bool, object] | None = None
        self._conn: DataConnection | None = conn
        self._failed: _Failed | None = None
        shard, method, request, _, payload, response_bytes, _ = args
        try:
            client._data_send(shard, conn, method, request, payload, response_bytes, _left(deadline, client.config.timeout_s))
        except _Failed as exc:
            self._conn, self._failed = None, exc

    def done(self) -> bool:
        """Whether the answer is in (or has started to arrive)."""
        return self._outcome is not None or (self._conn is not None and self._conn.readable())

    def result(self, timeout: float | None = None) -> object:
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

    def _finish(self, timeout: float | None) -> tuple[bool, object]:
        client = self._client
        shard, method, request, _, payload, response_bytes, answer = self._args
        limit = _left(self._deadline, client.config.timeout_s if timeout is None else min(timeout, client.config.timeout_s))
        try:
            if self._conn is not None:
                try:
                    return True, client._data_receive(shard, self._conn, method, limit, answer)
                except _Failed as exc:
                    self._failed = exc
            return True, client._call(
                shard, method, request, None, payload, response_bytes, answer, failed=self._failed, deadline=self._deadline
            )
        except Exception as exc:  # noqa: BLE001 - handed to every waiter, like a Future does
            return False, exc



