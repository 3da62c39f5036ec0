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
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from tether.common.config_file import CONFIG_ENV, json_values, to_json
from tether.common.exits import USAGE, interrupted
from tether.common.moved import old_names
from tether.common.settings import declared, to_env, variables
from tether.deploy import errors
from tether.deploy.children import SPREAD_DEVICES, Child, Notices, free_port, free_ports, gpu_count, spawn, tail, worker_device
from tether.deploy.run_program import program_env
from tether.deploy.worker_exits import RANK_LOGS, raise_worker_failure, steps_reported
from tether.server.config import ShardConfig
from tether.worker.config import TrainingConfig, WorkerConfig
from tether.worker.data.positions import latest_position, read_position

__all__ = ["LocalCluster", "Program"]

# tether.deploy.launch.ClusterError and .Interrupted (what a LocalCluster raises, tether.deploy.errors'),
# as this module gave them, until tether 0.2 (with a DeprecationWarning).
__getattr__ = old_names(__name__)

log = logging.getLogger(__name__)
# The variable a restarted program's TrainingConfig.from_env reads its resume_data from (TETHER_RESUME_DATA).
RESUME_DATA_ENV = next(decl.env for f, decl in declared(TrainingConfig) if f.name == "resume_data")


@dataclass(frozen=True)
class Program:
    """A user's training program run as the workers instead of ``tether worker``: what comes
    after ``python`` (``script.py args...`` or ``-m module args...``). Each worker learns its
    place in the job from its config file, which ``TETHER_CONFIG`` names (``TrainingConfig.from_env``);
    in sync mode ``torchrun`` runs it and sets ``RANK``/``WORLD_SIZE`` as well."""

    argv: tuple[str, ...]
    # Whether the job's step count (``--steps``, its default too) is the program's: without it the
    # program's workers are told no step count and train until their data ends, or as their code says.
    steps_from_job: bool = True

    def hand_over(self, cfg: WorkerConfig, path: Path) -> tuple[dict[str, str], list[str]]:
        """Write ``cfg`` for a worker of this program to ``path``: the ``TrainingConfig`` fields
        the program reads (``TrainingConfig.from_env``), as ``tether worker``'s file holds them.
        Returns the environment that names the file (``TETHER_CONFIG``) and also holds the job's
        other flags (the built-in model's: ``TETHER_BATCH_SIZE``, ..., for a program that takes
        its own defaults from them), and the variables to take out of what the worker inherits:
        those of the fields the file holds, which the launcher has read already (``from_env``
        lets a ``TETHER_*`` variable win over the file, for one set by hand)."""
        changes = {} if self.steps_from_job else {"steps": None}  # null: no step limit
        path.write_text(to_json(cfg, TrainingConfig, changes))
        held = {*json_values(cfg, TrainingConfig), *changes}
        # The data seed is in the file (``config.data_seed``) and, as before it was there, in
        # ``TETHER_DATA_SEED`` for a script that reads the variable.
        training = {f.name for f, _ in declared(TrainingConfig)} - {"data_seed"}
        return {**to_env(cfg, exclude=training), CONFIG_ENV: str(path)}, variables(TrainingConfig, held)

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
        """``module:function``, called with no arguments (``tether.worker.entry`` runs it). The
        module is imported here, before anything starts, with the current folder first on
        ``sys.path`` as ``python -m`` (and so each worker) has it.

        Raises:
            ValueError: not ``module:function``, no such module or function, or its import failed.
        """
        # Start-up cost: the worker side (torch) only where an --entry is given.
        from tether.protos.errors import UsageError
        from tether.worker.entry import on_path, resolve

        on_path()
        try:
            resolve(target)
        except UsageError as exc:
            raise ValueError(f"--entry {exc}") from None
        except Exception as exc:  # noqa: BLE001 - the user's module failed as it was imported: its error, one line
            raise ValueError(f"--entry {target}: importing it failed: {type(exc).__name__}: {exc}") from None
        return cls(("-m", "tether.worker.entry", target, *args))


class LocalCluster:
    """Shards and workers as separate processes on 127.0.0.1, and their restarts: a shard that
    crashed is started again on its port by a supervisor thread, or on demand (``restart_shard``);
    a worker that died is started again as a new incarnation for the steps it had not reported done
    (``wait_workers`` decides whether)."""

    def __init__(
        self,
        log_dir: str | Path | None = None,
        host: str = "127.0.0.1",
        grace_s: float = 10.0,
        restart: bool = False,
        max_restarts: int = 5,
        max_worker_restarts: int = 0,
        resume_workers: bool = True,
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
            resume_workers: a restarted worker (built-in, or a program whose ``Trainer.fit`` saved
                its data's positions) reads on from the newest stream position its earlier
                incarnations saved (``OUT/positions/latest``), not from the start of its share;
                False: from the start (as a job without positions does).
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
        self.shards: list[Child] = []
        self.workers: list[Child] = []
        self.addresses: list[str] = []
        self.metrics_ports: dict[str, int] = {}
        # Restarts per shard index, and per worker name (worker-<i>).
        self.restarts: dict[int, int] = {}
        self.worker_restarts: dict[str, int] = {}
        self.resume_workers = resume_workers
        # Per worker restart: the worker, when, and the step (of the incarnation that saved it) of
        # the position it resumed from, None when it read its share from the start.
        self.worker_resumes: list[dict[str, object]] = []
        # Workers' newest-position files (OUT/positions/latest/worker-<i>.json), by name.
        self._positions: dict[str, Path] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None
        # Whether workers' output is echoed (start_workers sets it; restarts keep it).
        self._echo = True
        # The compile notices the job's children said, each shown once.
        self._notices = Notices()
        # How many processes the last ``stop`` stopped.
        self.stopped = 0

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start_shards(
        self,
        num_shards: int,
        extra_args: Sequence[str] = (),
        metrics: bool = False,
        timeout_s: float = 60.0,
        env: dict[str, str] | None = None,
        config: ShardConfig | None = None,
    ) -> list[str]:
        """Start ``num_shards`` shard processes and wait until each serves: ``tether server
        --config FILE``, each shard's config as a JSON file in the log folder
        (``shard-<i>.config.json``: ``config`` with the shard's own address, port file, index and
        count), read as it is.

        Args:
            extra_args: ``tether server`` flags beside the file (a flag wins over the file).
            env: extra environment variables of the shard processes.
            config: every shard's settings (default: those the ``TETHER_*`` environment describes).

        Raises:
            ClusterError: a shard exited or did not report its port within ``timeout_s``.
            ValueError: a bad value in the environment, named.
        """
        template = config if config is not None else ShardConfig.from_env()
        started = []
        for i in range(num_shards):
            pf = self.log_dir / f"shard-{i}.port"
            pf.unlink(missing_ok=True)
            shard = replace(template, host=self.host, port=0, port_file=str(pf), shard_index=i, num_shards=num_shards)
            if metrics:
                port = free_port(self.host)
                self.metrics_ports[f"shard-{i}"] = port
                shard = replace(shard, metrics_port=port)
            file = self.log_dir / f"shard-{i}.config.json"
            file.write_text(to_json(shard))
            child = spawn(self.log_dir, f"shard-{i}", ["-m", "tether.server", "--config", str(file), *extra_args], echo=False, env=env,
                          notices=self._notices)
            child.port_file = pf
            started.append(child)
        with self._lock:
            self.shards.extend(started)
        deadline = time.monotonic() + timeout_s
        self.addresses = []
        for child in started:
            port = self._await_port(child, deadline, timeout_s)
            # A restart must come back where the workers look for it: it reads the same file, with
            # the port it got beside it (a flag wins over the file).
            child.argv += ["--port", str(port)]
            self.addresses.append(f"{self.host}:{port}")
        if self.restart and self._supervisor is None:
            self._supervisor = threading.Thread(target=self._supervise, name="tether-supervisor", daemon=True)
            self._supervisor.start()
        return self.addresses

    def _await_port(self, child: Child, deadline: float, timeout_s: float) -> int:
        pf = child.port_file
        if pf is None:
            raise errors.ClusterError(f"{child.name} reports no port")
        while not pf.exists():
            if child.proc.poll() is not None:
                raise errors.ClusterError(
                    f"{child.name} exited with code {child.proc.returncode}; see {child.log_path}:\n{tail(child.log_path)}")
            if time.monotonic() > deadline:
                raise errors.ClusterError(f"{child.name} did not start within {timeout_s:.0f}s; see {child.log_path}")
            time.sleep(0.05)
        return int(pf.read_text())

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
                raise errors.ClusterError(
                    f"{child.name} is not serving after {timeout_s:.0f}s; see {child.log_path}:\n{tail(child.log_path)}")
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

    def processes(self) -> dict[str, subprocess.Popen]:
        """The current process of every shard and worker, by name (shard-<i>, worker-<i>, torchrun)."""
        with self._lock:
            return {c.name: c.proc for c in self.shards + self.workers}

    def start_workers(
        self,
        template: WorkerConfig,
        extra_args: Sequence[str] = (),
        echo: bool = True,
        metrics: bool = False,
        program: Program | None = None,
    ) -> None:
        """Start ``template.num_workers`` worker processes against the running shards:
        ``tether worker --config FILE`` (each worker's config as a JSON file in the log folder,
        ``<name>.config.json``: read as it is, no flags rendered and parsed again), or the user's
        ``program`` with ``TETHER_CONFIG=FILE``, the same file (``TrainingConfig.from_env``).

        In sync mode the workers are the ranks of one ``torchrun``.
        """
        self._echo = echo
        # Only --metrics gives workers ports: a TETHER_METRICS_PORT in the launcher's shell would
        # give every worker the same one (the second then fails on a taken port).
        no_port = {} if metrics else {"TETHER_METRICS_PORT": ""}
        if template.mode.kind == "sync":
            cfg = replace(template, shards=tuple(self.addresses), worker_index=0)
            if metrics:
                # Each rank serves on the base port plus its local rank: every one of them free.
                base = free_ports(self.host, template.num_workers)
                self.metrics_ports.update({f"worker-{i}": base + i for i in range(template.num_workers)})
                cfg = replace(cfg, metrics_port=base)
            # Each rank's stderr is also kept in its own file, so a failed rank's error can be shown
            # last, after torchrun's summary (see raise_worker_failure).
            argv = ["-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(template.num_workers),
                    "--master-addr", self.host, "--master-port", str(free_port(self.host)),
                    "--log-dir", str(self.log_dir / RANK_LOGS), "--tee", "2"]
            if program is not None:
                # torchrun parses every argument after the program too (a script's --n would be its
                # --nnodes): the shim gets the program's argv in the environment instead.
                told, unset = program.hand_over(cfg, self.log_dir / "torchrun.config.json")
                env = {**no_port, **told, **program_env(program.argv)}
                self.workers.append(spawn(self.log_dir, "torchrun", [*argv, "-m", "tether.deploy.run_program"], echo=echo, env=env,
                                          unset=unset, notices=self._notices))
                return
            config = self.log_dir / "torchrun.config.json"
            config.write_text(to_json(cfg))
            argv += ["-m", "tether.worker", "--config", str(config), *extra_args]
            self.workers.append(spawn(self.log_dir, "torchrun", argv, echo=echo, env=no_port, notices=self._notices))
            return
        gpus = gpu_count() if template.device in SPREAD_DEVICES else 0
        for i in range(template.num_workers):
            cfg = replace(template, shards=tuple(self.addresses), worker_index=i, device=worker_device(template.device, i, gpus))
            if metrics:
                self.metrics_ports[f"worker-{i}"] = port = free_port(self.host)
                cfg = replace(cfg, metrics_port=port)
            # A restart reads the same file, with the steps left beside it (--steps, or TETHER_STEPS for a program).
            config = self.log_dir / f"worker-{i}.config.json"
            if program is not None:
                told, unset = program.hand_over(cfg, config)
                child = spawn(self.log_dir, f"worker-{i}", list(program.argv), echo=echo, env={**no_port, **told}, unset=unset,
                              notices=self._notices)
                if cfg.out:  # written by its Trainer when the data it fits on has a position
                    self._positions[child.name] = latest_position(cfg.out, i)
            else:
                config.write_text(to_json(cfg))
                child = spawn(self.log_dir, f"worker-{i}", ["-m", "tether.worker", "--config", str(config), *extra_args], echo=echo,
                              env=no_port, notices=self._notices)
                if cfg.out:
                    self._positions[child.name] = latest_position(cfg.out, i)
            child.steps = template.steps if program is None or program.steps_from_job else None
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
                    raise_worker_failure(child, code, self.worker_restarts.get(child.name, 0), self.max_worker_restarts)
            if time.monotonic() > deadline:
                raise errors.ClusterError(f"job did not finish within {timeout_s:.0f}s ({running[0].name} still running)")
            time.sleep(0.05)

    def _may_restart(self, child: Child, code: int, finished: Sequence[str]) -> bool:
        """Whether a worker that exited with ``code`` is started again (also after others
        ``finished``: a restarted worker only joins, it waits for none of them: ``AsyncPolicy.start``)."""
        if child.name == "torchrun" or code == USAGE or interrupted(code):
            return False
        return self.worker_restarts.get(child.name, 0) < self.max_worker_restarts

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

    # -- restarts ------------------------------------------------------------------------------------

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
                    fresh = spawn(self.log_dir, child.name, child.argv, echo=False, env=child.env, append=True, notices=self._notices)
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
            fresh = spawn(self.log_dir, child.name, child.argv, echo=False, env=child.env, append=True, notices=self._notices)
            fresh.port_file = child.port_file
            self.shards[index] = fresh
            self.restarts[index] = self.restarts.get(index, 0) + 1
        if late:
            raise errors.ClusterError(f"{child.name} did not stop within {timeout_s:.0f}s of SIGTERM; killed and restarted")
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
        did not report done. A worker whose data has a position (the built-in job's synthetic
        stream and Parquet; a program's data that ``Trainer.fit`` saved positions of, a
        ``ParquetStream`` say) reads on from the newest one saved (``_resume_from``: ``--resume-data``
        for ``tether worker``, ``TETHER_RESUME_DATA`` for a program); else it reads its share of
        the data from the start again. Either way ``TETHER_RESTART_COUNT`` says it was restarted."""
        argv, env = list(child.argv), dict(child.env or {})
        done, resume = self._resume_from(child)
        if resume is not None and CONFIG_ENV in env:
            # A program: its Trainer.fit reads resume_data, and a variable wins over its config file.
            env[RESUME_DATA_ENV] = str(resume.parent)
        elif resume is not None:
            if "--resume-data" in argv:  # a flag beside the worker's config file wins over the file
                del argv[argv.index("--resume-data") : argv.index("--resume-data") + 2]
            argv += ["--resume-data", str(resume.parent)]
        remaining = None
        if child.steps is not None:
            # A worker that reported every step died after them (its evaluation, its record): one step redoes those.
            remaining = max(child.steps - done, 1)
            if "--steps" in argv:
                argv[argv.index("--steps") + 1] = str(remaining)
            elif "--config" in argv:  # a flag beside the worker's config file wins over the file
                argv += ["--steps", str(remaining)]
            elif "TETHER_STEPS" in env or CONFIG_ENV in env:  # and a variable over a program's
                env["TETHER_STEPS"] = str(remaining)
        count = self.worker_restarts.get(child.name, 0) + 1
        env["TETHER_RESTART_COUNT"] = str(count)
        log.warning("%s exited with code %s; restart %d of %d%s", child.name, code, count, self.max_worker_restarts,
                    f", for the {remaining} of its {child.steps} steps not reported done" if remaining is not None else "")
        fresh = spawn(self.log_dir, child.name, argv, echo=self._echo, env=env, unset=child.unset, append=True,
                      notices=self._notices)
        fresh.steps, fresh.steps_done, fresh.first_started = child.steps, done, child.first_started or child.started
        with self._lock:
            self.worker_restarts[child.name] = count
            self.workers[self.workers.index(child)] = fresh

    def _resume_from(self, child: Child) -> tuple[int, Path | None]:
        """(the steps ``child``'s incarnations have done, the position file its restart resumes
        from or None). The newest position (``OUT/positions/latest/worker-<i>.json``, which the
        worker rewrites whole before each progress line) is resumed from when it was written in
        this job; when the incarnation that died wrote it, the steps done are those it says (at
        or past the last progress line), so the steps left and the data left agree. Without one,
        the steps are those the progress lines reported, and the share is read from its start
        (or from the job's own ``--resume-data``)."""
        path = self._positions.get(child.name) if self.resume_workers else None
        job_started = child.first_started or child.started
        try:
            written = path.stat().st_mtime if path is not None else None
        except OSError:
            written = None
        if path is None or written is None or written < job_started:
            done = child.steps_done + steps_reported(child.log_path, child.log_offset)
            self.worker_resumes.append({"worker": child.name, "at": time.time(), "position_step": None})
            return done, None
        try:
            step = read_position(path).get("step")
        except (OSError, ValueError):
            step = None
        if written >= child.started and isinstance(step, int):
            done = child.steps_done + step
        else:  # an earlier incarnation's position: this one saved none, so reported none either
            done = child.steps_done + steps_reported(child.log_path, child.log_offset)
        self.worker_resumes.append({"worker": child.name, "at": time.time(), "position_step": step})
        return done, path
