"""Exactly-once pushes: the sequence numbers applied per client incarnation, bounded, kept in
checkpoints under ``dedup_key``."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

import numpy as np

__all__ = ["AppliedPushes", "dedup_key", "parse_dedup_key"]

log = logging.getLogger(__name__)

_SEQ_WINDOW = 4096
# Dedup windows kept per worker id (one per client incarnation, least recently used dropped):
# a worker restarted more often than this cannot have a push of its eighth-oldest life in flight.
_INCARNATIONS = 8


def dedup_key(worker_id: str, incarnation: int) -> str:
    """The checkpoint key of one client incarnation's dedup window."""
    return f"{incarnation:016x}:{worker_id}"


def parse_dedup_key(key: str) -> tuple[str, int] | None:
    """``(worker_id, incarnation)`` of a ``dedup_key``; None for a key of another format (such
    as a window saved per worker id only, which no incarnation can match)."""
    head, sep, worker = key.partition(":")
    if not sep or len(head) != 16 or not worker:
        return None
    try:
        return worker, int(head, 16)
    except ValueError:
        return None


class _SeqWindow:
    """Recently applied sequence numbers of one worker (bounded)."""

    def __init__(self, seqs: np.ndarray | None = None) -> None:
        self.seen: OrderedDict[int, None] = OrderedDict()
        if seqs is not None:
            for seq in seqs[-_SEQ_WINDOW:].tolist():
                self.seen[int(seq)] = None

    def add(self, seq: int) -> bool:
        """Record ``seq``; False if it was already there."""
        if seq in self.seen:
            return False
        self.seen[seq] = None
        if len(self.seen) > _SEQ_WINDOW:
            self.seen.popitem(last=False)
        return True


class AppliedPushes:
    """The pushes a shard applied: a bounded window of sequence numbers per client incarnation."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # worker id -> incarnation -> window, least recently used incarnation first.
        self._seqs: dict[str, OrderedDict[int, _SeqWindow]] = {}

    def add(self, worker_id: str, incarnation: int, seq: int) -> bool:
        """Record push ``seq``; False if it was applied before (a retry)."""
        with self._lock:
            return self._window(worker_id, incarnation).add(seq)

    def export(self) -> dict[str, np.ndarray]:
        """Every window, oldest first (uint64), keyed by ``dedup_key``."""
        with self._lock:
            return {
                dedup_key(w, inc): np.fromiter(win.seen, dtype=np.uint64, count=len(win.seen))
                for w, lives in self._seqs.items()
                for inc, win in lives.items()
            }

    def load(self, windows: dict[str, np.ndarray]) -> None:
        """Add restored windows (as ``export`` gives them)."""
        with self._lock:
            for key, seqs in windows.items():
                parsed = parse_dedup_key(key)
                if parsed is None:
                    log.info("ignoring dedup window %r of an older checkpoint format", key)
                    continue
                self._window(*parsed, seqs)

    def _window(self, worker_id: str, incarnation: int, seqs: np.ndarray | None = None) -> _SeqWindow:
        """The dedup window of one client incarnation (created if new); hold ``_lock``."""
        lives = self._seqs.setdefault(worker_id, OrderedDict())
        win = lives.get(incarnation)
        if win is None:
            win = lives[incarnation] = _SeqWindow(seqs)
            if len(lives) > _INCARNATIONS:
                lives.popitem(last=False)
        else:
            lives.move_to_end(incarnation)
        return win
