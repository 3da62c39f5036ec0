"""A local cluster of shard and worker processes on this machine (what ``tether launch`` runs on).

Shards bind port 0 and report the port they got through a port file, so no port is ever
guessed. Every wait is bounded; on Ctrl-C, on an error or at the end of the job every child
is stopped (SIGTERM, then SIGKILL after a grace period). With ``restart=True`` a supervisor
thread starts a shard that crashed (any exit but 0) again on the same port with the same
flags, so it comes back from its last checkpoint where the workers' retries find it.

With ``max_worker_restarts=N`` an async or ssp worker that dies (any exit but 0, a usage error
or Ctrl-C) is started again, up to N times, as a new client incarnation (its pushes are
deduplicated apart from the dead one's), for the steps its earlier incarnations did not report
done; the others train on meanwhile. A sync rank is never restarted: torchrun stops the others
and the job ends naming the rank.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO

from tether.common.exits import USAGE, interrupted
from tether.protos.errors import UsageError
from tether.deploy.errors import ClusterError, Interrupted
from tether.deploy.worker_args import job_env, worker_argv
from tether.worker.config import WorkerConfig

__all__ = ["ClusterError", "Interrupted", "LocalCluster", "Program"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Program:
    """A user's training program run as the workers instead of ``tether worker``: what comes
    after ``python`` (``script.py args...`` or ``-m module args...``). Each worker learns its
    place in the job from the ``TETHER_*`` environment (``TrainingConfig.from_env``); in sync
    mode ``torchrun`` runs it and sets ``RANK``/``WORLD_SIZE`` as well."""

    argv: tuple[str, ...]

    @classmethod
    def script(cls, path: str, args: Sequence[str] = ()) -> Program:
        """A Python script.

        Raises:
            ValueError: no such file.
        """
        if not Path(path).is_file():
            raise ValueError(f"--script {path}: no such file")
        return cls((str(Path(path).resolve()), *args))

    @classmethod
    def entry(cls, target: str, args: Sequence[str] = ()) -> Program:
        """``module:function``, called with no arguments (``tether.worker.entry`` runs it).

        Raises:
            ValueError: not ``module:function``, or no such module.
        """
        import importlib.util

        module, _, function = target.partition(":")
        if not module or not function.isidentifier():
            raise ValueError(f"--entry {target}: expected module:function")
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise ValueError(f"--entry {target}: no module {module!r} on the Python path")
        return cls(("-m", "tether.worker.entry", target, *args))


# The one line a worker prints before exiting with USAGE (tether.protos.errors.report_usage_error).
_WORKER_USAGE_PREFIX = "tether worker: error: "


def _pump(stream: IO[str], prefix: str, sink: IO[str] | None, echo: bool) -> None:
    for line in stream:
        if sink is not None:
            sink.write(line)
            sink.flush()
        if echo:
            sys.stdout.write(f"{prefix}{line}")
            sys.stdout.flush()


@dataclass
class _Child:
    name: str
    proc: subprocess.Popen
    pump: threading.Thread
    log_path: Path
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] | None = None
    port_file: Path | None = None
    # Where this incarnation's output starts in its (appended) log.
    log_offset: int = 0
    # Workers: the job's steps per worker (None: until the data ends), and the steps earlier
    # incarnations reported done.
    steps: int | None = None
    steps_done: int = 0


class LocalCluster:
    """Shards and workers as separate processes on 127.0.0.1."""

    def __init__(
        self,
        log_dir: str | Path | None = None,
        host: str = "127.0.0.1",
        grace_s: float = 10.0,
        restart: bool = False,
        max_restarts: int = 5,
        max_worker_restarts: int = 0,
    ) -> None:
        """Set up (nothing starts until ``start_shards``).

        Args:
            log_dir: where logs and port files go (a temporary folder by default).
            host: the address every process binds.
            grace_s: how long ``stop`` waits after SIGTERM before SIGKILL.
            restart: restart shards that crash (exit code other than 0).
            max_restarts: give up on a shard after this many restarts.
            max_worker_restarts: restart an async or ssp worker that dies up to this many times
                (``wait_workers`` does); 0: the first worker failure ends the job.
        """
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {max_restarts!r}")
        if max_worker_restarts < 0:
            raise ValueError(f"max_worker_restarts must be >= 0, got {max_worker_restarts!r}")
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if log_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="tether-")
            log_dir = self._tmp.name
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.host = host
        self.grace_s = grace_s
        self.restart = restart
        self.max_restarts = max_restarts
        self.max_worker_restarts = max_worker_restarts
        self.shards: list[_Child] = []
        self.workers: list[_Child] = []
        self.addresses: list[str] = []
        self.metrics_ports: dict[str, int] = {}
        # Restarts per shard index, and per worker name (worker-<i>).
        self.restarts: dict[int, int] = {}
        self.worker_restarts: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None
        # Whether workers' output is echoed (start_workers sets it; restarts keep it).
        self._echo = True
        # How many processes the last ``stop`` stopped.
        self.stopped = 0

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(
        self, name: str, argv: list[str], echo: bool, env: dict[str, str] | None = None, append: bool = False
    ) -> _Child:
        log_path = self.log_dir / f"{name}.log"
        offset = log_path.stat().st_size if append and log_path.exists() else 0
        proc = subprocess.Popen(
            child_command(argv),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            # One intra-op thread per process unless the user says otherwise: several processes
            # share the cores, and OpenMP spin-waiting under oversubscription halves throughput.
            env={"OMP_NUM_THREADS": "1", **os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        sink = log_path.open("a" if append else "w")
        pump = threading.Thread(target=_pump, args=(proc.stdout, f"[{name}] ", sink, echo), daemon=True)
        pump.start()
        return _Child(name, proc, pump, log_path, list(argv), env, log_offset=offset)

    def start_shards(
        self,
        num_shards: int,
        extra_args: Sequence[str] = (),
        metrics: bool = False,
        timeout_s: float = 60.0,
        env: dict[str, str] | None = None,
    ) -> list[str]:
        """Start ``num_shards`` shard processes and wait until each serves.

        Args:
            env: extra environment variables of the shard processes.

        Raises:
            ClusterError: a shard exited or did not report its port within ``timeout_s``.
        """
        port_files = []
        started = []
        for i in range(num_shards):
            pf = self.log_dir / f"shard-{i}.port"
            pf.unlink(missing_ok=True)
            port_files.append(pf)
            argv = ["-m", "tether.server", "--host", self.host, "--port", "0", "--port-file", str(pf),
                    "--shard-index", str(i), "--num-shards", str(num_shards), *extra_args]
            if metrics:
                port = _free_port(self.host)
                self.metrics_ports[f"shard-{i}"] = port
                argv += ["--metrics-port", str(port)]
            child = self._spawn(f"shard-{i}", argv, echo=False, env=env)
            child.port_file = pf
            started.append(child)
        with self._lock:
            self.shards.extend(started)
        deadline = time.monotonic() + timeout_s
        self.addresses = []
        for child, pf in zip(started, port_files):
            port = self._await_port(child, deadline, timeout_s)
            # A restart must come back where the workers look for it.
            port_at = child.argv.index("--port") + 1
            child.argv[port_at] = str(port)
            self.addresses.append(f"{self.host}:{port}")
        if self.restart and self._supervisor is None:
            self._supervisor = threading.Thread(target=self._supervise, name="tether-supervisor", daemon=True)
            self._supervisor.start()
        return self.addresses

    def _await_port(self, child: _Child, deadline: float, timeout_s: float) -> int:
        pf = child.port_file
        if pf is None:
            raise ClusterError(f"{child.name} reports no port")
        while not pf.exists():
            if child.proc.poll() is not None:
                raise ClusterError(f"{child.name} exited with code {child.proc.returncode}; see {child.log_path}:\n{_tail(child.log_path)}")
            if time.monotonic() > deadline:
                raise ClusterError(f"{child.name} did not start within {timeout_s:.0f}s; see {child.log_path}")
            time.sleep(0.05)
        return int(pf.read_text())

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
                    fresh = self._spawn(child.name, child.argv, echo=False, env=child.env, append=True)
                    fresh.port_file = child.port_file
                    self.shards[i] = fresh

    def wait_shard(self, index: int, timeout_s: float = 60.0) -> str:
        """Wait until shard ``index`` (restarted or not) serves; returns its address.

        Raises:
            ClusterError: it exited or did not report its port within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                child = self.shards[index]
            pf = child.port_file
            if pf is not None and pf.exists() and child.proc.poll() is None:
                return f"{self.host}:{int(pf.read_text())}"
            if time.monotonic() > deadline:
                raise ClusterError(f"{child.name} is not serving after {timeout_s:.0f}s; see {child.log_path}:\n{_tail(child.log_path)}")
            time.sleep(0.05)

    def signal_shard(self, index: int, signum: int = signal.SIGKILL) -> int:
        """Send ``signum`` to shard ``index``; returns the pid it went to."""
        with self._lock:
            proc = self.shards[index].proc
        proc.send_signal(signum)
        return proc.pid

    def shard_process(self, index: int) -> subprocess.Popen:
        """The current process of shard ``index``."""
        with self._lock:
            return self.shards[index].proc

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
            fresh = self._spawn(child.name, child.argv, echo=False, env=child.env, append=True)
            fresh.port_file = child.port_file
            self.shards[index] = fresh
            self.restarts[index] = self.restarts.get(index, 0) + 1
        if late:
            raise ClusterError(f"{child.name} did not stop within {timeout_s:.0f}s of SIGTERM; killed and restarted")
        return fresh.proc.pid

    def processes(self) -> dict[str, subprocess.Popen]:
        """The current process of every shard and worker, by name (shard-<i>, worker-<i>, torchrun)."""
        with self._lock:
            return {c.name: c.proc for c in self.shards + self.workers}

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

    def start_workers(
        self,
        template: WorkerConfig,
        extra_args: Sequence[str] = (),
        echo: bool = True,
        metrics: bool = False,
        program: Program | None = None,
    ) -> None:
        """Start ``template.num_workers`` worker processes against the running shards:
        ``tether worker``, or the user's ``program`` configured through the environment.

        In sync mode the workers are the ranks of one ``torchrun``.
        """
        self._echo = echo
        if template.consistency[0] == "sync":
            cfg = replace(template, shards=tuple(self.addresses), worker_index=0)
            # Each rank's stderr is also kept in its own file, so a failed rank's error can be shown
            # last, after torchrun's summary (see _worker_failed).
            argv = ["-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(template.num_workers),
                    "--master-addr", self.host, "--master-port", str(_free_port(self.host)),
                    "--log-dir", str(self.log_dir / _RANK_LOGS), "--tee", "2"]
            if program is not None:
                self.workers.append(self._spawn("torchrun", [*argv, *program.argv], echo=echo, env=job_env(cfg)))
                return
            argv += ["-m", "tether.worker", *worker_argv(cfg), *extra_args]
            if metrics:
                # Each rank serves on the base port plus its local rank.
                base = _free_port(self.host)
                self.metrics_ports.update({f"worker-{i}": base + i for i in range(template.num_workers)})
                argv += ["--metrics-port", str(base)]
            self.workers.append(self._spawn("torchrun", argv, echo=echo))
            return
        gpus = gpu_count()
        for i in range(template.num_workers):
            cfg = replace(template, shards=tuple(self.addresses), worker_index=i, device=worker_device(template.device, i, gpus))
            if program is not None:
                child = self._spawn(f"worker-{i}", list(program.argv), echo=echo, env=job_env(cfg))
            else:
                argv = ["-m", "tether.worker", *worker_argv(cfg), *extra_args]
                if metrics:
                    port = _free_port(self.host)
                    self.metrics_ports[f"worker-{i}"] = port
                    argv += ["--metrics-port", str(port)]
                child = self._spawn(f"worker-{i}", argv, echo=echo)
            child.steps = template.steps
            with self._lock:
                self.workers.append(child)

    def wait_workers(self, timeout_s: float) -> None:
        """Wait for every worker to exit; one that fails is restarted (``max_worker_restarts``)
        or ends the wait at once (checked every 50 ms), so the others are not waited for.

        Raises:
            UsageError: a worker exited with ``USAGE``; the message is its one line.
            KeyboardInterrupt: a worker was interrupted (``tether.common.exits.interrupted``).
            ClusterError: a worker failed otherwise (and had no restart left), or the job ran
                past ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        finished: list[str] = []
        while True:
            with self._lock:
                running = [c for c in self.workers if c.name not in finished]
            if not running:
                return
            for child in running:
                code = child.proc.poll()
                if code is None:
                    continue
                child.pump.join(timeout=5)
                if code == 0:
                    finished.append(child.name)
                elif self._may_restart(child, code, finished):
                    self._restart_worker(child, code)
                else:
                    _worker_failed(child, code, self.worker_restarts.get(child.name, 0), self.max_worker_restarts)
            if time.monotonic() > deadline:
                raise ClusterError(f"job did not finish within {timeout_s:.0f}s ({running[0].name} still running)")
            time.sleep(0.05)

    def _may_restart(self, child: _Child, code: int, finished: Sequence[str]) -> bool:
        """Whether a worker that exited with ``code`` is started again.

        Raises:
            ClusterError: it would be, but a worker of the job has finished already: a restarted
                worker waits for all of them to join (``AsyncPolicy.start``), so it would wait in vain.
        """
        if child.name == "torchrun" or code == USAGE or interrupted(code):
            return False
        if self.worker_restarts.get(child.name, 0) >= self.max_worker_restarts:
            return False
        if finished:
            raise ClusterError(
                f"{child.name} exited with code {code} after {', '.join(finished)} finished; not restarted: a restarted worker "
                f"waits for all {len(self.workers)} workers to join, and a finished one does not; "
                f"see {child.log_path}:\n{_tail(child.log_path)}"
            )
        return True

    def _restart_worker(self, child: _Child, code: int) -> None:
        """Start a dead worker again (a new client incarnation) for the steps its incarnations
        did not report done; it reads its share of the data from the start again."""
        done = child.steps_done + _steps_reported(child.log_path, child.log_offset)
        argv, env = list(child.argv), dict(child.env or {})
        remaining = None
        if child.steps is not None:
            # A worker that reported every step died after them (its evaluation, its record): one step redoes those.
            remaining = max(child.steps - done, 1)
            if "--steps" in argv:
                argv[argv.index("--steps") + 1] = str(remaining)
            elif "TETHER_STEPS" in env:
                env["TETHER_STEPS"] = str(remaining)
        count = self.worker_restarts.get(child.name, 0) + 1
        env["TETHER_RESTART_COUNT"] = str(count)
        log.warning("%s exited with code %s; restart %d of %d%s", child.name, code, count, self.max_worker_restarts,
                    f", for the {remaining} of its {child.steps} steps not reported done" if remaining is not None else "")
        fresh = self._spawn(child.name, argv, echo=self._echo, env=env, append=True)
        fresh.steps, fresh.steps_done = child.steps, done
        with self._lock:
            self.worker_restarts[child.name] = count
            self.workers[self.workers.index(child)] = fresh

    def signal_worker(self, index: int, signum: int = signal.SIGKILL) -> int:
        """Send ``signum`` to worker ``index`` (its current incarnation); returns the pid it went to."""
        with self._lock:
            proc = self.workers[index].proc
        proc.send_signal(signum)
        return proc.pid

    def stop(self) -> int:
        """Stop every child: SIGTERM, then SIGKILL after the grace period. A second Ctrl-C
        meanwhile is ignored, so the children are still stopped.

        Returns:
            How many processes were stopped (also in ``self.stopped``).
        """
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        try:
            return self._stop()
        finally:
            if main and previous is not None:
                signal.signal(signal.SIGINT, previous)

    def _stop(self) -> int:
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout=10)
            self._supervisor = None
        with self._lock:
            children = self.workers + self.shards
        for child in children:
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for child in children:
            try:
                child.proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait(timeout=5)
            child.pump.join(timeout=2)
        with self._lock:
            self.workers, self.shards = [], []
        self._stopping.clear()
        self.stopped = len(children)
        return self.stopped


# A child of the launcher asks Linux to SIGTERM it when the launcher dies (so a killed launcher
# never leaves shards running), then becomes the program: a few lines of Python run first in the
# child, which then execs. Not a ``preexec_fn``: with one, Python forks instead of vforking, gRPC's
# fork handlers restart its poller in the child, and closing the inherited descriptors before exec
# then aborts the child ("epoll_wait error: Bad file descriptor", grpc/grpc#43055) whenever the
# launcher has gRPC calls in flight: 22 of 300 children so started died that way here.
_ORPHAN_GUARD = (
    "import ctypes, os, signal, sys\n"
    "if sys.platform.startswith('linux'):\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit('tether: the launcher exited before this process started')\n"
    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])\n"
)


def child_command(argv: Sequence[str]) -> list[str]:
    """The command line that runs ``python argv...`` as a child that dies with this process."""
    return [sys.executable, "-c", _ORPHAN_GUARD, str(os.getpid()), *argv]


def _worker_failed(child: _Child, code: int, restarts: int = 0, limit: int = 0) -> None:
    """Raise what a worker's non-zero exit ``code`` means (see ``LocalCluster.wait_workers``).
    For torchrun, what the rank that failed first said: torchrun's own summary names it, and
    its stderr file holds its error."""
    if interrupted(code):
        raise KeyboardInterrupt
    name, log_path = child.name, child.log_path
    if child.name == "torchrun":
        found = _root_cause(log_path)
        if found is not None:
            name, code, log_path = found
    if code == USAGE:
        _raise_usage_line(name, log_path)
    if name != child.name:
        raise ClusterError(
            f"{name} failed first (exit code {code}; torchrun stopped the other ranks); its error, from {log_path}:\n{_tail(log_path)}"
        )
    after = f" (restarted {restarts} time{'' if restarts == 1 else 's'}, --max-restarts {limit})" if limit else ""
    raise ClusterError(f"{child.name} exited with code {code}{after}; see {child.log_path}:\n{_tail(child.log_path)}")


# A progress line of the training loop: "worker 1/3 step 450/600 loss ...".
_STEP_LINE = re.compile(r"\bstep (\d+)(?:/\d+)? loss ")


def _steps_reported(log_path: Path, offset: int) -> int:
    """The last step a worker incarnation reported in its log (from byte ``offset``); 0 if none."""
    try:
        with log_path.open("rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
    except OSError:
        return 0
    found = _STEP_LINE.findall(text)
    return int(found[-1]) if found else 0


def _raise_usage_line(name: str, log_path: Path) -> None:
    """Raise the one line a worker printed before exiting with ``USAGE``, if it did."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    for line in reversed(lines):
        if _WORKER_USAGE_PREFIX in line:
            raise UsageError(f"{name}: {line.split(_WORKER_USAGE_PREFIX, 1)[1].strip()}")


# Where torchrun keeps each rank's stderr: <log dir>/ranks/<run id>/attempt_<n>/<local rank>/stderr.log.
_RANK_LOGS = "ranks"


def _root_cause(torchrun_log: Path) -> tuple[str, int, Path] | None:
    """``(rank N, its exit code, its stderr file)`` of the rank torchrun's summary names as the
    root cause, or None when the log or the file does not say."""
    try:
        text = torchrun_log.read_text(errors="replace")
    except OSError:
        return None
    _, _, cause = text.rpartition("Root Cause")
    found = re.search(r"rank\s*:\s*(\d+) \(local_rank: (\d+)\)\s*\n\s*exitcode\s*:\s*(-?\d+)", cause)
    if found is None:
        return None
    rank, local_rank, code = (int(g) for g in found.groups())
    files = sorted(torchrun_log.parent.glob(f"{_RANK_LOGS}/*/attempt_*/{local_rank}/stderr.log"), key=lambda f: f.stat().st_mtime)
    return (f"rank {rank}", code, files[-1]) if files else None


def gpu_count() -> int:
    """CUDA devices torch sees on this host (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def worker_device(device: str, index: int, gpus: int) -> str:
    """The device of async/ssp worker ``index`` on a host with ``gpus`` GPUs: ``cuda:(index mod
    gpus)`` for ``auto`` or ``cuda`` when there are GPUs (one worker per GPU, round robin), else
    ``device`` as given (``cpu``, an explicit ``cuda:N``, or ``auto`` without a GPU)."""
    if device in ("auto", "cuda") and gpus > 0:
        return f"cuda:{index % gpus}"
    return device


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
