"""Worker clocks and leases: the shard side of stale synchronous parallel (SSP).

A worker's clock is the number of steps it has completed. A worker that has not been heard
from for ``lease_s`` seconds is not live and does not hold the others back; any later call
from it re-registers it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["ClockState", "WorkerClocks"]


@dataclass(frozen=True)
class ClockState:
    """Clocks of the live workers."""

    min_clock: int
    max_clock: int
    live_workers: int


class WorkerClocks:
    """Clocks and leases of the workers of a job, with a bounded wait on the slowest."""

    def __init__(self, lease_s: float = 10.0, now: Callable[[], float] = time.monotonic) -> None:
        if not lease_s > 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s!r}")
        self.lease_s = lease_s
        self._now = now
        self._cond = threading.Condition()
        self._clock: dict[str, int] = {}
        self._seen: dict[str, float] = {}
        # Workers that report clocks with Clock calls (ssp): only those calls move their
        # clocks, made once a step's push is applied on every shard. Pushes still renew leases.
        self._explicit: set[str] = set()
        # When each live worker joined, and when workers left (done): finished_since counts
        # those that left after a worker joined, for the start-up barrier.
        self._joined_at: dict[str, float] = {}
        self._left_at: dict[str, float] = {}

    def _expire(self) -> None:
        cutoff = self._now() - self.lease_s
        for worker in [w for w, t in self._seen.items() if t < cutoff]:
            del self._seen[worker], self._clock[worker]
            self._explicit.discard(worker)
            self._joined_at.pop(worker, None)

    def update(self, worker_id: str, clock: int, leave: bool = False, from_push: bool = False, join: bool = False) -> None:
        """Record that ``worker_id`` completed ``clock`` steps (clocks never go back).

        Args:
            worker_id, clock: who and how far.
            leave: the worker is done; forget it.
            from_push: the clock came with a push; for a worker that reports through Clock
                calls this only renews its lease.
            join: a start-up registration (every mode's workers join and wait for each other
                before training); it does not make the worker one that reports its clock
                through Clock calls, so an async worker's pushes go on moving its clock.
        """
        with self._cond:
            if leave:
                if self._clock.pop(worker_id, None) is not None:
                    self._left_at[worker_id] = self._now()
                self._seen.pop(worker_id, None)
                self._explicit.discard(worker_id)
                self._joined_at.pop(worker_id, None)
            elif from_push and worker_id in self._explicit and worker_id in self._clock:
                self._seen[worker_id] = self._now()
            else:
                if join and worker_id not in self._clock:
                    self._joined_at[worker_id] = self._now()
                    self._left_at.pop(worker_id, None)
                if not from_push and not join:
                    self._explicit.add(worker_id)
                self._clock[worker_id] = max(clock, self._clock.get(worker_id, 0))
                self._seen[worker_id] = self._now()
            self._cond.notify_all()

    def state(self) -> ClockState:
        """Clocks of the live workers (zeros when there are none)."""
        with self._cond:
            self._expire()
            return self._state()

    def _state(self) -> ClockState:
        if not self._clock:
            return ClockState(0, 0, 0)
        values = self._clock.values()
        return ClockState(min(values), max(values), len(self._clock))

    def finished_since(self, worker_id: str) -> int:
        """Workers other than ``worker_id`` that left (done) after ``worker_id`` joined: at
        start-up every worker waits until the live ones and these make the whole job, since the
        others may have trained and left between two of its polls. Workers of an earlier job on
        the same shards left before it joined, so they do not count."""
        with self._cond:
            since = self._joined_at.get(worker_id)
            if since is None:
                return 0
            oldest = min(self._joined_at.values())
            for w in [w for w, t in self._left_at.items() if t < oldest]:  # nobody waiting can count them
                del self._left_at[w]
            return sum(1 for w, t in self._left_at.items() if w != worker_id and t >= since)

    def min_other(self, worker_id: str) -> int:
        """Smallest clock among live workers other than ``worker_id`` (0 when none)."""
        with self._cond:
            self._expire()
            return min((c for w, c in self._clock.items() if w != worker_id), default=0)

    def lag(self, clock: int) -> int:
        """Clock ticks the slowest live worker is behind a step that ends at ``clock``."""
        s = self.state()
        return max(clock - 1 - s.min_clock, 0) if s.live_workers else 0

    def wait(self, clock: int, bound: int, timeout_s: float) -> tuple[bool, ClockState]:
        """Wait until ``clock - min live clock <= bound`` or ``timeout_s`` passes.

        Returns:
            Whether the bound holds, and the clocks at that moment.
        """
        deadline = self._now() + timeout_s
        with self._cond:
            while True:
                self._expire()
                s = self._state()
                if s.live_workers == 0 or clock - s.min_clock <= bound:
                    return True, s
                remaining = deadline - self._now()
                if remaining <= 0:
                    return False, s
                # Wake up at least every quarter lease so expired leases are noticed.
                self._cond.wait(min(remaining, self.lease_s / 4))
