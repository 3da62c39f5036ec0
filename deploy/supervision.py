"""Restarts of a local cluster's processes (``LocalCluster`` inherits ``Supervision``): a shard
that crashed is started again on its port by a supervisor thread, or on demand
(``restart_shard``); a worker that died is started again as a new incarnation for the steps it
had not reported done (``wait_workers`` decides whether); and the counts of both."""

from __future__ import annotations

import logging
import signal
import subprocess
import threading
from pathlib import Path

from tether.deploy.children import Child, spawn
from tether.deploy.errors import ClusterError
from tether.deploy.worker_exits import steps_reported

__all__ = ["Supervision"]

log = logging.getLogger("tether.deploy.launch")


class Supervision:
    """The restart half of ``LocalCluster``: its state is the cluster's own (set in
    ``LocalCluster.__init__``)."""

    log_dir: Path
    shards: list[Child]
    workers: list[Child]
    # Restarts per shard index, and per worker name (worker-<i>), and their limits.
    restarts: dict[int, int]
    worker_restarts: dict[str, int]
    max_restarts: int
    max_worker_restarts: int
    _lock: threading.Lock
    _stopping: threading.Event
    _echo: bool

    def _supervise(self) -> None:
        """Restart crashed shards until ``stop``; checks every 100 ms."""
        while not self._stopping.wait(0.1):
            with self._lock:
                for i, child in enumerate(self.shards):
                    code = child.proc.poll()
                    # Exit 0 is a drained, deliberate stop (SIGTERM): not a crash.
                    if code is None or code == 0 or self._stopping.is_set():
                        continue
                    if self.restarts.get(i, 0) >= self.max_restarts:
                        continue
                    self.restarts[i] = self.restarts.get(i, 0) + 1
                    log.warning("%s exited with code %s; restart %d of %d on the same port",
                                child.name, code, self.restarts[i], self.max_restarts)
                    child.pump.join(timeout=1)
                    if child.port_file is not None:
                        child.port_file.unlink(missing_ok=True)
                    fresh = spawn(self.log_dir, child.name, child.argv, echo=False, env=child.env, append=True)
                    fresh.port_file = child.port_file
                    self.shards[i] = fresh

    def restart_shard(self, index: int, timeout_s: float = 60.0) -> int:
        """Stop shard ``index`` as an operator would (SIGTERM: it drains and writes its final
        checkpoint) and start it again on its port; counted in ``restarts``. Returns the new pid.

        Raises:
            ClusterError: it did not exit within ``timeout_s`` (it is then killed and restarted).
        """
        with self._lock:
            child = self.shards[index]
        child.proc.send_signal(signal.SIGTERM)
        late = False
        try:
            child.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            late = True
            child.proc.kill()
            child.proc.wait(timeout=10)
        child.pump.join(timeout=1)
        with self._lock:
            if self._stopping.is_set() or self.shards[index] is not child:
                return self.shards[index].proc.pid if self.shards else child.proc.pid
            if child.port_file is not None:
                child.port_file.unlink(missing_ok=True)
            fresh = spawn(self.log_dir, child.name, child.argv, echo=False, env=child.env, append=True)
            fresh.port_file = child.port_file
            self.shards[index] = fresh
            self.restarts[index] = self.restarts.get(index, 0) + 1
        if late:
            raise ClusterError(f"{child.name} did not stop within {timeout_s:.0f}s of SIGTERM; killed and restarted")
        return fresh.proc.pid

    def restart_counts(self) -> dict[str, int]:
        """Restarts of every shard and worker so far, by name (0 for those never restarted)."""
        with self._lock:
            counts = {c.name: self.restarts.get(i, 0) for i, c in enumerate(self.shards)}
            counts.update({c.name: self.worker_restarts.get(c.name, 0) for c in self.workers})
        return counts

    def steps_before_restarts(self) -> dict[str, int]:
        """Per restarted worker, the steps its earlier incarnations reported done."""
        with self._lock:
            return {c.name: c.steps_done for c in self.workers if c.name in self.worker_restarts}

    def _restart_worker(self, child: Child, code: int) -> None:
        """Start a dead worker again (a new client incarnation) for the steps its incarnations
        did not report done; it reads its share of the data from the start again."""
        done = child.steps_done + steps_reported(child.log_path, child.log_offset)
        argv, env = list(child.argv), dict(child.env or {})
        remaining = None
        if child.steps is not None:
            # A worker that reported every step died after them (its evaluation, its record): one step redoes those.
            remaining = max(child.steps - done, 1)
            if "--steps" in argv:
                argv[argv.index("--steps") + 1] = str(remaining)
            elif "TETHER_STEPS" in env:
                env["TETHER_STEPS"] = str(remaining)
            elif "--config" in argv:  # a flag beside the worker's config file wins over the file
                argv += ["--steps", str(remaining)]
        count = self.worker_restarts.get(child.name, 0) + 1
        env["TETHER_RESTART_COUNT"] = str(count)
        log.warning("%s exited with code %s; restart %d of %d%s", child.name, code, count, self.max_worker_restarts,
                    f", for the {remaining} of its {child.steps} steps not reported done" if remaining is not None else "")
        fresh = spawn(self.log_dir, child.name, argv, echo=self._echo, env=env, append=True)
        fresh.steps, fresh.steps_done = child.steps, done
        with self._lock:
            self.worker_restarts[child.name] = count
            self.workers[self.workers.index(child)] = fresh
