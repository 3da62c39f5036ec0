"""Client over all shards: ``push``, ``pull``, ``push_pull`` and ``wait`` (the ps-lite API).

Each call splits its ids and dense chunks by owning shard (``tether.worker.client.router``: one
request per shard, every table in it), sends the requests in parallel over each shard's
channel (``tether.worker.client.channel``: data plane or gRPC, deadlines, retries) and returns a
``Handle`` at once; ``wait`` (or ``Handle.result``) gathers the answers.
Channels use TLS and send a bearer token when ``ClientConfig.security`` says so.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from tether.protos import framing as dp
from tether.protos import tether_pb2 as pb
from tether.protos.specs import OptimizerConfig, TableConfig
from tether.protos.ssp import COORDINATOR_SHARD, MAX_CLOCK_HOLD_S
from tether.worker.client.channel import Call, DataCall, ShardChannel, time_left
from tether.worker.client.config import ClientConfig
from tether.worker.client.results import CheckpointResult, ClockReply, Handle, Pending, PullResult, PushAck, Splits
from tether.worker.client.router import PullAnswer, Router
from tether.worker.metrics import NullWorkerMetrics, WorkerRecorder

__all__ = ["PSClient"]

log = logging.getLogger(__name__)

T = TypeVar("T")
_PUSHES = ("Push", "PushPull")


class PSClient:
    """Push/pull over all shards of a job."""

    def __init__(self, config: ClientConfig, metrics: WorkerRecorder | None = None) -> None:
        self.metrics: WorkerRecorder = metrics if metrics is not None else NullWorkerMetrics()
        self.num_shards = len(config.addresses)
        # A random id of this client process: shards deduplicate its pushes by (worker id,
        # incarnation, seq), so a worker restarted under the same id is not taken for a retry.
        self.incarnation = int.from_bytes(os.urandom(8), "little") or 1
        self.router = Router(config, self.incarnation)
        self.channels: list[ShardChannel] = []
        self.config = config
        self._open_lock = threading.Lock()
        self._closed = True
        self._open()

    @property
    def config(self) -> ClientConfig:
        """How this client calls the shards."""
        return self._config

    @config.setter
    def config(self, config: ClientConfig) -> None:
        # The router and the channels read it on every call: a replaced config (a flag turned
        # on, a longer deadline) holds from the next call on. Channels and connections stay.
        self._config = self.router.config = config
        for c in self.channels:
            c.config = config

    def _open(self) -> None:
        """Open the channels and the fan-out pool: at the start, and again on the first call
        after ``close`` (the trained model read after the ``Trainer`` block: an eval forward
        pulls its rows), on every transport alike. Pushes stay numbered on from before."""
        if not self._closed:
            return
        with self._open_lock:
            if not self._closed:
                return
            config = self.config
            self.channels = [ShardChannel(s, config, self.metrics) for s in range(self.num_shards)]
            self._pool = ThreadPoolExecutor(max_workers=max(config.threads, self.num_shards), thread_name_prefix="tether-client")
            self._closed = False

    def close(self) -> None:
        """Close channels, data-plane connections and the fan-out pool (calls not yet started
        are cancelled). A later call opens them again, as the first call did."""
        with self._open_lock:
            if self._closed:
                return
            self._closed = True
            pool, channels = self._pool, self.channels
        pool.shutdown(wait=False, cancel_futures=True)
        for c in channels:
            c.close()

    def transports(self) -> list[str]:
        """How each shard is reached right now: "shm", "tcp", "tcp+tls" or "grpc"."""
        return [c.transport() for c in self.channels]

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _fan_out(self, calls: Mapping[int, Call], combine: Callable[[dict[int, Any]], T]) -> Handle[T]:
        """Start every shard's call: on the data plane the request is sent from this thread
        right away and the answer read by whoever waits (no thread hop); over gRPC a pool
        thread makes the call. Each shard's call ends within ``call_deadline_s`` from now,
        whichever way it goes."""
        self._open()
        shards = list(calls)
        pending: list[Pending] = []
        deadline = time.monotonic() + self.config.call_deadline_s
        for s in shards:
            channel, call = self.channels[s], calls[s]
            start = functools.partial(self._start, channel, call, deadline)
            # A shard applies one client's pushes in the order they were started (ShardChannel.push_in_order).
            pending.append(channel.push_in_order(start, call, deadline, self._pool) if call.method in _PUSHES else start())
        return Handle(pending, lambda answers: combine(dict(zip(shards, answers, strict=False))))

    def _start(self, channel: ShardChannel, call: Call, deadline: float) -> Pending:
        """Start ``call``: sent on a data connection from this thread, else made by a pool thread over gRPC."""
        conn = channel.data_connection(call, time_left(deadline, self.config.timeout_s))
        if conn is None:
            return self._pool.submit(channel.call, call, deadline=deadline)
        return DataCall(channel, conn, call, deadline)

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
        requests, layouts = self.router.declare_requests(tables, dense or {}, dense_optimizer)
        answers = self._fan_out({s: Call("Declare", r) for s, r in requests.items()}, lambda a: a).result()
        for s, a in answers.items():
            data = self.channels[s].data
            if data is not None:
                data.set_port(a.data_port, a.data_socket)
        self.router.declared(tables, layouts)

    def pull(self, sparse: Mapping[str, torch.Tensor] | None = None, dense: Sequence[str] = (),
             splits: Splits | None = None) -> Handle[PullResult]:
        """Start pulling rows of ``sparse`` (table -> unique ids, any int64 value; narrower integer
        tensors are widened) and dense tensors (``splits``: ``Router.pull_requests``').

        Returns:
            A handle whose result is a ``PullResult``.

        Raises:
            InvalidArgument: undeclared table or tensor, or ids that are not a 1-D integer tensor.
        """
        requests, plan = self.router.pull_requests(sparse or {}, dense, splits)
        answer = PullAnswer(self.router, plan)
        calls = {
            s: Call("Pull", r, dp.PayloadWriter(), plan.response_bytes.get(s, 0), functools.partial(answer, s),
                    functools.partial(answer.direct, s))
            for s, r in requests.items()
        }
        return self._fan_out(calls, lambda _: plan.result())

    def _ack(self, answers: dict[int, pb.PushResponse], requests: Mapping[int, pb.PushRequest]) -> PushAck:
        """One ``PushAck`` from every shard's answer; a duplicate this client did not resend is
        logged and counted (a shard that lost track of incarnations, or a copied client)."""
        values = list(answers.values())
        for s, a in answers.items():
            resent = self.channels[s].was_resent(requests[s].seq)
            if not a.applied and not resent:
                log.warning(
                    "shard %d called push %d of worker %r (incarnation %016x) a duplicate, but it was sent once",
                    s, requests[s].seq, self.config.worker_id, self.incarnation,
                )
                self.metrics.unexpected_duplicate()
        return PushAck(
            staleness=max((a.staleness for a in values), default=0),
            clock_staleness=max((a.clock_staleness for a in values), default=0),
            duplicates=sum(not a.applied for a in values),
        )

    def push(
        self,
        sparse: Mapping[str, tuple[torch.Tensor, ...]] | None = None,
        dense: Mapping[str, torch.Tensor] | None = None,
        clock: int = 0,
        versions: PullResult | None = None,
    ) -> Handle[PushAck]:
        """Start pushing row gradients (table -> (unique ids, grads)) and dense gradients.

        Args:
            sparse: per table, the ids and their gradients (rows x dim); a row cache's combined
                push adds the rule's statistics third (rows x ``UpdateRule.combined_stats``).
            dense: per dense parameter, its full gradient.
            clock: the worker's clock (steps completed) for these gradients.
            versions: the pull the gradients were computed from (staleness accounting).

        Returns:
            A handle whose result is a ``PushAck``.
        """
        requests, payloads = self.router.push_requests(sparse or {}, dense or {}, clock, versions)
        calls = {s: Call("Push", r, payloads[s]) for s, r in requests.items()}
        return self._fan_out(calls, lambda acks: self._ack(acks, requests))

    def push_pull(
        self,
        push_sparse: Mapping[str, tuple[torch.Tensor, ...]] | None = None,
        push_dense: Mapping[str, torch.Tensor] | None = None,
        pull_sparse: Mapping[str, torch.Tensor] | None = None,
        pull_dense: Sequence[str] = (),
        clock: int = 0,
        versions: PullResult | None = None,
        pull_splits: Splits | None = None,
    ) -> Handle[PullResult]:
        """Push gradients and pull parameters in one round trip per shard (``pull_splits``: the
        pull's ``Router.pull_requests`` splits).

        Returns:
            A handle whose result is a ``PullResult`` whose ``ack`` is the push's.
        """
        pushes, payloads = self.router.push_requests(push_sparse or {}, push_dense or {}, clock, versions)
        pulls, plan = self.router.pull_requests(pull_sparse or {}, pull_dense, pull_splits)
        requests = {}
        for s in set(pushes) | set(pulls):
            push = pushes.get(s) or pb.PushRequest(
                worker_id=self.config.worker_id, incarnation=self.incarnation, clock=clock, seq=self.router.next_seq(s)
            )
            pull = pulls.get(s) or pb.PullRequest(worker_id=self.config.worker_id)
            requests[s] = pb.PushPullRequest(push=push, pull=pull)
            payloads.setdefault(s, dp.PayloadWriter())

        # Its pull's blocks received in place over a data connection, as a plain pull's are.
        answer = PullAnswer(self.router, plan)

        def combine(acks: dict[int, pb.PushResponse]) -> PullResult:
            result = plan.result()
            result.ack = self._ack(acks, {s: r.push for s, r in requests.items()})
            return result

        calls = {
            s: Call("PushPull", r, payloads[s], plan.response_bytes.get(s, 0), functools.partial(answer.push_pull, s),
                    functools.partial(answer.direct_push_pull, s))
            for s, r in requests.items()
        }
        return self._fan_out(calls, combine)

    def clock(self, clock: int, wait_bound: int = -1, timeout_s: float = 60.0, leave: bool = False) -> ClockReply:
        """Report this worker's clock to every shard and, with ``wait_bound`` >= 0, wait on
        the coordinator (``COORDINATOR_SHARD``) until the slowest live worker is at most ``wait_bound``
        ticks behind ``clock``.

        Call it only once the pushes of the steps it reports are acknowledged.

        ``timeout_s`` bounds the wait for the other workers (the SSP wait); it is made of calls
        that each ask the coordinator to hold them for a few seconds at most, and each such
        call, like every report, ends within ``call_deadline_s`` plus the time it asked to be
        held. A coordinator that stops answering is so given up on after at most
        ``call_deadline_s`` + ``MAX_CLOCK_HOLD_S``, not after the whole SSP wait.

        Returns:
            The clocks; ``ready`` is False if ``timeout_s`` passed first.

        Raises:
            Unavailable: a shard did not answer within the retries or the call's deadline.
        """
        report = pb.ClockRequest(worker_id=self.config.worker_id, clock=clock, leave=leave, wait_bound=-1)
        others = self._fan_out({s: Call("Clock", report) for s in range(self.num_shards) if s != COORDINATOR_SHARD}, lambda _: None)
        try:
            return self._clock_wait(clock, wait_bound, timeout_s, leave)
        finally:
            others.result(self.config.call_deadline_s + self.config.timeout_s)

    def _clock_wait(self, clock: int, wait_bound: int, timeout_s: float, leave: bool) -> ClockReply:
        cfg = self.config
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            wait_ms = int(min(max(remaining, 0), cfg.timeout_s, MAX_CLOCK_HOLD_S) * 1000) if wait_bound >= 0 else 0
            request = pb.ClockRequest(
                worker_id=cfg.worker_id, clock=clock, leave=leave, wait_bound=wait_bound, wait_timeout_ms=wait_ms
            )
            # The coordinator may hold the call that long (it caps it at MAX_CLOCK_HOLD_S): the
            # time it is held is the SSP wait's, not lost to a slow or dead shard.
            held = wait_ms / 1000.0
            reply = self.channels[COORDINATOR_SHARD].call(
                Call("Clock", request), timeout=cfg.timeout_s + held, deadline=time.monotonic() + cfg.call_deadline_s + held
            )
            if reply.ready or remaining <= 0:
                return ClockReply(reply.min_clock, reply.max_clock, reply.live_workers, reply.ready, reply.min_other_clock,
                                  reply.finished_workers)

    @staticmethod
    def wait(handle: Handle[T], timeout: float | None = None) -> T:
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
        self._open()
        request = pb.CheckpointRequest(id=ckpt_id)
        deadline = time.monotonic() + timeout_s
        futures = [self._pool.submit(c.call, Call("Checkpoint", request), timeout_s, deadline=deadline) for c in self.channels]

        def combine(answers: list[pb.CheckpointResponse]) -> list[CheckpointResult]:
            return [CheckpointResult(s, a.id, a.path, a.bytes, a.seconds) for s, a in enumerate(answers)]

        return Handle(futures, combine).result(timeout_s + 10.0)

    def info(self) -> list[pb.InfoResponse]:
        """Every shard's ``Info``."""
        calls = {s: Call("Info", pb.InfoRequest()) for s in range(self.num_shards)}
        return self._fan_out(calls, lambda a: [a[s] for s in sorted(a)]).result()
