"""One training step in pieces: pull the batch's rows, compute, push the gradients, settle the
push, as ``Trainer.fit`` runs them (``tether.worker.training``).

The pieces overlap the parameter server's work with compute. Prefetching the next batch during
compute reads before this step's push lands: fine without a bound, but ssp and sync pull only
once the bound (or the barrier) allows (their policy says ``prefetch = False``). An async step
makes one round trip in steady state: its push carries the pull of the batch after next
(push_pull, whose answer holds the push's ack), which then has a whole step of compute to come
back in. The rows of a step miss one step's update either way (the previous step's), as with a
plain prefetch issued before the push.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Generic, TypeVar

import torch

from tether.protos.errors import TooStale, UsageError
from tether.worker.batches import to_device
from tether.worker.client import Handle, PullResult
from tether.worker.results import PushAck
from tether.worker.embedding import Prefetch
from tether.worker.stragglers import delay_factor

if TYPE_CHECKING:
    from tether.worker.training import Trainer

__all__ = ["PHASES", "Acks", "Step"]

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


class Step(Generic[B]):
    """The steps of one ``fit``: which batch is next, the pulls and pushes under way, the
    pushes' acks and the loss since the last record.

    ``run(i)`` takes step ``i`` on ``batch``; ``last`` says whether it was the last; ``advance()``
    moves on to the next batch; ``finish()`` settles the last push.

    Raises:
        UsageError: the stream holds no batch.
    """

    def __init__(self, trainer: Trainer[B], stream: Iterator[B], start_clock: int) -> None:
        cfg = trainer.config
        self.trainer = trainer
        self.stream = stream
        self.start_clock = start_clock
        self.steps = cfg.steps
        self.wait_s = cfg.wait_s
        self.prefetch = cfg.prefetch and trainer.policy.prefetch
        # Without prefetching a step's push lands before the next step pulls (sequential SGD).
        self.settle_every_step = trainer.policy.settle_every_step or not cfg.prefetch
        # Sync's combiner of the ranks' row gradients (which wants them in float32), else none.
        self.combine = trainer.policy.row_combiner()
        self.straggler = cfg.straggler_spec
        self.acks = Acks()
        batch = next(stream, None)
        if batch is None:
            raise UsageError("the training data holds no batch")
        self.batch: B = batch
        self.upcoming: B | None = next(stream, None) if self.steps is None or self.steps > 1 else None
        self.after: B | None = None  # the batch after ``upcoming``, read during a step
        self.pending: Prefetch | None = None  # the pull of this step's batch, if already under way
        self.ahead: Prefetch | None = None  # the push_pull carrying the next step's pull
        self.push: Handle | None = None  # a push not settled yet
        # This window's summed loss, where the loss is (a GPU's: reading it there waits for the
        # device, so it is read when a record is written, not every step); the last value read.
        self._loss_sum: torch.Tensor | None = None
        self._loss_n = 0
        self.on_host = trainer.device.type == "cpu"
        self.loss_value = math.nan

    @property
    def last(self) -> bool:
        """Whether the step just run was the last (the data, ``steps`` or another sync rank ended)."""
        return self.upcoming is None

    def run(self, step: int) -> dict[str, float]:
        """Step ``step`` (counted from 0 in this ``fit``) on ``batch``: wait for the bound, pull,
        compute, push (and settle, where the policy says so). Returns each phase's seconds."""
        clock = self.start_clock + step
        t0 = time.perf_counter()
        self.trainer.policy.before_step(self.trainer, clock)
        tw = time.perf_counter()
        pulled = self._pull()
        t1 = time.perf_counter()
        self._compute(step, t1)
        t2 = time.perf_counter()
        self._push(clock, pulled)
        t3 = time.perf_counter()
        return dict(zip(PHASES, (tw - t0, t1 - tw, t2 - t1, t3 - t2)))

    def advance(self) -> None:
        """Move on to the next batch."""
        self.batch, self.upcoming = self.upcoming, self.after  # type: ignore[assignment]

    def finish(self) -> None:
        """Settle the last push."""
        if self.push is not None:
            self.settle(self.push)
            self.push = None

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

    def _pull(self) -> PullResult:
        """This step's rows: the pull already under way, or one made now. A push_pull whose push
        was rejected as too stale is counted and its pull made again on its own."""
        ps, wait_s = self.trainer.ps, self.wait_s
        pending = self.pending if self.pending is not None else ps.prefetch(self.trainer.sparse_fn(self.batch))
        self.pending, self.ahead = self.ahead, None
        try:
            pulled = ps.install(pending, train=True, timeout=wait_s)
        except TooStale as exc:
            self.acks.rejected(exc)
            return ps.install(ps.prefetch(pending.ids), train=True, timeout=wait_s)
        if pending.ack is not None:
            self.acks.note(pending.ack)
        return pulled

    def _compute(self, step: int, t1: float) -> None:
        """Read the batch after next, start the next batch's pull (prefetch), forward and
        backward, the gradients to the host, the policy's step (sync's all-reduce)."""
        trainer, ps, upcoming = self.trainer, self.trainer.ps, self.upcoming
        self.after = next(self.stream, None) if upcoming is not None and (self.steps is None or step + 2 < self.steps) else None
        if self.prefetch and upcoming is not None and self.pending is None:
            self.pending = ps.prefetch(trainer.sparse_fn(upcoming))
        loss = trainer.loss_fn(trainer.model, to_device(self.batch, trainer.device))
        loss.backward()
        exact = self.combine is not None
        # The gradients' copies to the host, queued now: sync's wait in after_backward covers them.
        ps.collect(exact=exact, wait=False)
        if not trainer.policy.after_backward(more=upcoming is not None) and upcoming is not None:
            # sync: another rank's data ended, so every rank stops after this step.
            trainer.printer(f"{trainer.name}: stopping at step {step + 1} with data left: another rank's data ended there "
                            "(sync steps every rank together: give the ranks equal numbers of batches, or set steps)")
            self.upcoming = self.after = None
        held = loss.detach()
        self._loss_sum = held.double() if self._loss_sum is None else self._loss_sum + held
        self._loss_n += 1
        if self.on_host:
            self.loss_value = float(held)  # free on the CPU: the loss gauge gets every step's
        # The step's gradients on the host: on CUDA the host's one wait for the GPU this step.
        ps.collect(exact=exact)
        # Straggler experiments: this step computes ``factor`` times slower (same schedule per
        # worker and step in every mode: see tether.worker.stragglers).
        cfg = trainer.config
        factor = delay_factor(self.straggler, cfg.seed, cfg.worker_index, self.start_clock + step, cfg.num_workers) \
            if self.straggler.active else 1.0
        if factor > 1.0:
            time.sleep((factor - 1.0) * (time.perf_counter() - t1))

    def _push(self, clock: int, pulled: PullResult) -> None:
        """Settle the previous push, push this step's gradients (with the pull of the batch
        after next, when prefetching), and settle it at once where the policy says so."""
        ps = self.trainer.ps
        if self.push is not None:
            self.settle(self.push)
            self.push = None
        if self.prefetch and self.after is not None:
            self.ahead = ps.push_pull(clock=clock + 1, versions=pulled, sparse=self.trainer.sparse_fn(self.after))
        else:
            self.push = ps.push(clock=clock + 1, versions=pulled, rows=self.combine)
        if self.settle_every_step:
            # The step's updates must land before this worker's clock (or the barrier) lets
            # anyone read past them (such policies never prefetch: the push was just made).
            self.finish()
            self.trainer.policy.after_push()
