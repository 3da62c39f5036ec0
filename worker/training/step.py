"""One training step in pieces: pull the batch's rows, compute, push the gradients, settle the
push, as ``Trainer.fit`` runs them (``tether.worker.training.trainer``).

The pieces overlap the parameter server's work with compute. Prefetching the next batch during
compute reads before this step's push lands: fine without a bound, but ssp and sync pull only
once the bound (or the barrier) allows (their policy says ``prefetch = False``). An async step
makes one round trip in steady state: its push carries the pull of the batch after next
(push_pull, whose answer holds the push's ack), which then has a whole step of compute to come
back in. The rows of a step miss one step's update either way (the previous step's), as with a
plain prefetch issued before the push.

The push window K (``--push-window``, PERSIA's ``embedding_staleness``; async only) deepens this
pipeline: a step's push carries the pull of the batch K + 1 steps on, so up to K of this worker's
pushes are in flight while a step computes and its rows may miss this worker's last K updates
(K = 1: the above). Each shard gets them one at a time, applied in the order sent
(``ShardChannel.push_in_order``); the step does not wait for that. A push is settled (its ack or error read) when the pull it carries is
installed; one that carries none, once K pushes are unsettled at the next push. Before worker 0
evaluates and at the end every push is settled: an error a shard answered surfaces then at the
latest, never lost.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
from torch import nn

from tether.protos.errors import TooStale, UsageError
from tether.worker.client.api import ShardClient
from tether.worker.client.results import Handle, PullResult, PushAck
from tether.worker.config import TrainingConfig
from tether.worker.training.batches import to_device
from tether.worker.training.embedding import PSModel
from tether.worker.training.mode import check_window
from tether.worker.training.policies import AsyncPolicy
from tether.worker.training.stragglers import delay_factor
from tether.worker.training.transfer import Prefetch, first

__all__ = ["PHASES", "Acks", "Step", "StepContext"]

log = logging.getLogger(__name__)

B = TypeVar("B")

# Where a step's time goes, in order: the staleness bound's wait (ssp), waiting for the pull,
# forward and backward, the push.
PHASES = ("staleness_wait", "pull_wait", "compute", "push")


class Acks:
    """What the shards said of this worker's pushes: each one's clock staleness and update
    staleness, and how many were rejected as too stale (dropped and counted)."""

    def __init__(self) -> None:
        self.clock_staleness: list[int] = []
        self.update_staleness: list[int] = []
        self.too_stale = 0
        self._window_start = 0

    def note(self, ack: PushAck) -> None:
        self.clock_staleness.append(ack.clock_staleness)
        self.update_staleness.append(ack.staleness)

    def rejected(self, exc: TooStale) -> None:
        self.too_stale += 1
        log.info("%s", exc)

    def window(self) -> list[int]:
        """The clock staleness of the pushes acknowledged since the last call."""
        window = self.clock_staleness[self._window_start:]
        self._window_start = len(self.clock_staleness)
        return window


@dataclass(frozen=True)
class StepContext(Generic[B]):
    """What one ``fit``'s steps use of the ``Trainer`` that runs them (and what its policy's waits
    see of it: ``config``, ``client``, ``name``)."""

    config: TrainingConfig
    client: ShardClient
    name: str
    policy: AsyncPolicy
    ps: PSModel
    model: nn.Module
    device: torch.device
    loss_fn: Callable[[nn.Module, B], torch.Tensor]
    sparse_fn: Callable[[B], Mapping[str, torch.Tensor | Sequence[torch.Tensor]]]
    printer: Callable[[str], None]


class Step(Generic[B]):
    """The steps of one ``fit``: which batch is next, the pulls and pushes under way, the
    pushes' acks and the loss since the last record.

    ``run(i)`` takes step ``i`` on ``batch``; ``last`` says whether it was the last; ``advance()``
    moves on to the next batch; ``finish()`` settles every push still in flight.
    ``in_flight`` is the number of pushes not settled yet; ``peak_in_flight`` the most there
    were while a step computed (at most the push window).

    Raises:
        UsageError: the stream holds no batch; a push window that means nothing here.
    """

    def __init__(self, context: StepContext[B], stream: Iterator[B], start_clock: int) -> None:
        cfg = context.config
        self.trainer = trainer = context
        self.stream = stream
        self.start_clock = start_clock
        self.steps = cfg.steps
        self.wait_s = cfg.wait_s
        self.prefetch = cfg.prefetch and trainer.policy.prefetch
        self.window = check_window(getattr(cfg, "push_window", 1), self.prefetch, cfg.mode)
        # Without prefetching a step's push lands before the next step pulls (sequential SGD).
        self.settle_every_step = trainer.policy.settle_every_step or not cfg.prefetch
        # Sync's combiner of the ranks' row gradients (which wants them in float32), else none.
        self.combine = trainer.policy.row_combiner()
        self.straggler = cfg.straggler_spec
        # Worker 0 evaluates after these steps (and the last): every push settled first.
        self.eval_every = cfg.eval_every if cfg.worker_index == 0 else 0
        self.evaluates = cfg.worker_index == 0
        self.acks = Acks()
        batch = next(stream, None)
        if batch is None:
            raise UsageError("the training data holds no batch")
        self.batch: B = batch
        # The batches after ``batch`` read so far (up to window + 1 of them: the last is the one
        # the step's push_pull pulls for); ``ended``: the stream (or ``steps``) has no more.
        self.queue: deque[B] = deque()
        self.ended = False
        self.data_ended = False  # the stream itself ran out (not ``steps``, not another sync rank)
        self._read(0, 1)
        self.pulls: dict[int, Prefetch] = {}  # step -> the pull of its batch, under way
        self.unsettled: deque[Prefetch | Handle] = deque()  # pushes not settled, oldest first
        self.peak_in_flight = 0
        # This window's summed loss, where the loss is (a GPU's: reading it there waits for the
        # device, so it is read when a record is written, not every step); the last value read.
        self._loss_sum: torch.Tensor | None = None
        self._loss_n = 0
        self.on_host = trainer.device.type == "cpu"
        self.loss_value = math.nan

    @property
    def last(self) -> bool:
        """Whether the step just run was the last (the data, ``steps`` or another sync rank ended)."""
        return not self.queue

    @property
    def upcoming(self) -> B | None:
        """The next step's batch, or None after the last step."""
        return self.queue[0] if self.queue else None

    @property
    def in_flight(self) -> int:
        """This worker's pushes not settled yet."""
        return len(self.unsettled)

    def run(self, step: int) -> dict[str, float]:
        """Step ``step`` (counted from 0 in this ``fit``) on ``batch``: the policy's wait before a
        step (ssp's bound), pull, compute, push (and settle, where the policy says so). Returns
        each phase's seconds.

        Raises:
            DeadlineExceeded: the policy's wait for the slowest live worker ran past ``wait_timeout_s``.
        """
        clock = self.start_clock + step
        t0 = time.perf_counter()
        self.trainer.policy.before_step(self.trainer, clock)
        tw = time.perf_counter()
        pulled = self._pull(step)
        t1 = time.perf_counter()
        self._compute(step, t1)
        t2 = time.perf_counter()
        self._push(step, clock, pulled)
        if self.evaluates and (self.last or (self.eval_every > 0 and (step + 1) % self.eval_every == 0)):
            self.finish()  # worker 0 evaluates next: with every push of its own landed
        t3 = time.perf_counter()
        return dict(zip(PHASES, (tw - t0, t1 - tw, t2 - t1, t3 - t2), strict=False))

    def advance(self) -> None:
        """Move on to the next batch."""
        self.batch = self.queue.popleft()

    def finish(self) -> None:
        """Settle every push in flight, oldest first (raises the first error a shard answered)."""
        while self.unsettled:
            self._settle_oldest()

    def window_loss(self) -> float:
        """The mean loss of the steps since the last call (reads the device's loss: called when
        a record is written); on a GPU also the loss gauge's value until the next call."""
        value = round(float(self._loss_sum) / max(self._loss_n, 1), 6) if self._loss_sum is not None else math.nan
        if not self.on_host:
            self.loss_value = value
        self._loss_sum, self._loss_n = None, 0
        return value

    # -- the pieces ---------------------------------------------------------------------------------

    def settle(self, handle: Handle) -> None:
        """Wait for a push; one a shard rejected as too stale is dropped and counted."""
        try:
            self.acks.note(handle.result(self.wait_s))
        except TooStale as exc:
            self.acks.rejected(exc)

    def _settle_oldest(self) -> None:
        """Settle the oldest push in flight: a plain push's ack, or a push_pull's answer (kept for
        the ``install`` of its batch; one rejected as too stale is counted and its rows pulled again)."""
        entry = self.unsettled.popleft()
        if isinstance(entry, Handle):
            self.settle(entry)
            return
        try:
            pulled = _wait(entry, self.wait_s)
        except TooStale as exc:
            self.acks.rejected(exc)
            step = next(s for s, p in self.pulls.items() if p is entry)
            self.pulls[step] = self.trainer.ps.prefetch(entry.ids)
            return
        if pulled.ack is not None:
            self.acks.note(pulled.ack)

    def _unsettled(self, entry: Prefetch) -> bool:
        """Whether ``entry`` was in flight (and now is not)."""
        for i, e in enumerate(self.unsettled):
            if e is entry:
                del self.unsettled[i]
                return True
        return False

    def _read(self, step: int, ahead: int) -> None:
        """Read batches until ``ahead`` follow this step's (fewer where the data or ``steps`` ends)."""
        while not self.ended and len(self.queue) < ahead:
            if self.steps is not None and step + len(self.queue) + 1 >= self.steps:
                self.ended = True
                break
            batch = next(self.stream, None)
            if batch is None:
                self.ended = self.data_ended = True
                break
            self.queue.append(batch)

    def _pull(self, step: int) -> PullResult:
        """This step's rows: the pull already under way, or one made now. A push_pull whose push
        was rejected as too stale is counted and its pull made again on its own."""
        ps, wait_s = self.trainer.ps, self.wait_s
        pending = self.pulls.pop(step, None)
        if pending is None:
            pending = ps.prefetch(self.trainer.sparse_fn(self.batch))
        unsettled = pending.pushed and self._unsettled(pending)
        try:
            pulled = ps.install(pending, train=True, timeout=wait_s)
        except TooStale as exc:
            self.acks.rejected(exc)
            pulled = ps.install(ps.prefetch(pending.ids), train=True, timeout=wait_s)
        else:
            if unsettled and pending.ack is not None:
                self.acks.note(pending.ack)
        while len(self.unsettled) > self.window:
            self._settle_oldest()
        self.peak_in_flight = max(self.peak_in_flight, len(self.unsettled))
        return pulled

    def _compute(self, step: int, t1: float) -> None:
        """Read ahead, start the next batch's pull (prefetch), forward and backward, the
        gradients to the host, the policy's step (sync's all-reduce)."""
        trainer, ps = self.trainer, self.trainer.ps
        if self.queue:
            self._read(step, self.window + 1)
        upcoming = self.upcoming
        if self.prefetch and upcoming is not None and step + 1 not in self.pulls:
            self.pulls[step + 1] = ps.prefetch(trainer.sparse_fn(upcoming))
        loss = trainer.loss_fn(trainer.model, to_device(self.batch, trainer.device))
        loss.backward()
        exact = self.combine is not None
        # The gradients' copies to the host, queued now: sync's wait in after_backward covers them.
        ps.collect(exact=exact, wait=False)
        if not trainer.policy.after_backward(more=upcoming is not None) and upcoming is not None:
            # sync: another rank's data ended, so every rank stops after this step.
            trainer.printer(f"{trainer.name}: stopping at step {step + 1} with data left: another rank's data ended there "
                            "(sync steps every rank together: give the ranks equal numbers of batches, or set steps)")
            self.queue.clear()
            self.ended = True
        held = loss.detach()
        self._loss_sum = held.double() if self._loss_sum is None else self._loss_sum + held
        self._loss_n += 1
        if self.on_host:
            self.loss_value = float(held)  # free on the CPU: the loss gauge gets every step's
        # The step's gradients on the host: on CUDA the host's one wait for the GPU this step.
        ps.collect(exact=exact)
        # Straggler experiments: this step computes ``factor`` times slower (same schedule per
        # worker and step in every mode: see tether.worker.training.stragglers).
        cfg = trainer.config
        factor = delay_factor(self.straggler, cfg.seed, cfg.worker_index, self.start_clock + step, cfg.num_workers) \
            if self.straggler.active else 1.0
        if factor > 1.0:
            time.sleep((factor - 1.0) * (time.perf_counter() - t1))

    def _push(self, step: int, clock: int, pulled: PullResult) -> None:
        """Push this step's gradients: with the pull of the batch ``window + 1`` steps on when
        prefetching and there is one (settled when that batch is installed), else on their own,
        after settling the pushes that carry no pull while ``window`` are in flight; settle it at
        once where the policy says so."""
        ps = self.trainer.ps
        while len(self.unsettled) >= self.window and any(isinstance(e, Handle) for e in self.unsettled):
            plain = next(e for e in self.unsettled if isinstance(e, Handle))
            self.unsettled.remove(plain)
            self.settle(plain)
        if self.prefetch and len(self.queue) > self.window:
            target = step + self.window + 1
            self.pulls[target] = ps.push_pull(clock=clock + 1, versions=pulled, sparse=self.trainer.sparse_fn(self.queue[self.window]))
            self.unsettled.append(self.pulls[target])
        else:
            self.unsettled.append(ps.push(clock=clock + 1, versions=pulled, rows=self.combine))
        if self.settle_every_step:
            # The step's updates must land before this worker's clock (or the barrier) lets
            # anyone read past them (such policies never prefetch: the push was just made).
            self.finish()
            self.trainer.policy.after_push()


class _Done:
    """A ``Pending`` already answered (a push_pull waited for before its batch is installed)."""

    def __init__(self, value: PullResult) -> None:
        self.value = value

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> PullResult:
        return self.value


def _wait(prefetch: Prefetch, timeout: float) -> PullResult:
    """Wait for a pull's answer once; ``install`` later takes the same answer without waiting
    (on CUDA the transfer thread's future keeps it; on the CPU the handle is replaced)."""
    if prefetch.staged is not None:
        return prefetch.staged.result(timeout).pulled
    pulled = prefetch.handle.result(timeout)
    prefetch.handle = Handle([_Done(pulled)], first)
    return pulled
