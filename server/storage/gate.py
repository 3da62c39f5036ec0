"""The gate between pushes and a checkpoint's copy: pushes share it, the copy holds it alone, so
no push is half applied in a checkpoint."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from tether.protos.errors import Unavailable

__all__ = ["Gate"]

# Longest a push waits for a checkpoint's in-memory copy (normally well under a second).
_GATE_WAIT_S = 60.0


class Gate:
    """Pushes share it; a checkpoint's copy holds it alone, so no push is half applied in it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0
        self._closed = False

    @contextmanager
    def shared(self, timeout_s: float = _GATE_WAIT_S) -> Iterator[None]:
        with self._cond:
            if not self._cond.wait_for(lambda: not self._closed, timeout_s):
                raise Unavailable(f"a checkpoint held pushes back for over {timeout_s:.0f}s; retry")
            self._active += 1
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
                if self._active == 0:
                    self._cond.notify_all()

    @contextmanager
    def exclusive(self, timeout_s: float = _GATE_WAIT_S) -> Iterator[None]:
        with self._cond:
            # Close first: new pushes wait, so in-flight ones cannot starve the checkpoint.
            self._closed = True
            if not self._cond.wait_for(lambda: self._active == 0, timeout_s):
                self._closed = False
                self._cond.notify_all()
                raise Unavailable(f"pushes did not pause for a checkpoint within {timeout_s:.0f}s")
        try:
            yield
        finally:
            with self._cond:
                self._closed = False
                self._cond.notify_all()
