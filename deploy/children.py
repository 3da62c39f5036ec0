"""The launcher's child processes: how one is started (``spawn``: a ``python`` that dies with the
launcher, its output pumped to its log and, echoed, to stdout), the record kept of it
(``Child``), and the free ports and devices children get."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from tether.common.kernel_notice import COMPILE_NOTICE
from tether.deploy.errors import ClusterError

__all__ = ["SPREAD_DEVICES", "Child", "Notices", "child_command", "free_port", "free_ports", "gpu_count", "spawn", "tail", "worker_device"]


class Notices:
    """The lines of a job's children that say they compile tether's kernels (``COMPILE_NOTICE``):
    each distinct one is shown on the launcher's console once, whichever child says it first
    (a shard's too, whose output is not echoed), so a first run on a machine says what it
    compiles and how long that usually takes, once."""

    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def first(self, line: str) -> str | None:
        """The notice in ``line`` (from ``COMPILE_NOTICE`` on) the first time it is seen, else None."""
        at = line.find(COMPILE_NOTICE)
        if at < 0:
            return None
        text = line[at:].rstrip("\n")
        with self._lock:
            if text in self._seen:
                return None
            self._seen.add(text)
        return text


def _pump(stream: IO[str], prefix: str, sink: IO[str] | None, echo: bool, notices: Notices | None = None) -> None:
    """Copy a child's output to its log (and the launcher's stdout) until the child closes it,
    then close the log and the pipe. With ``notices``, a compile notice goes to stdout the first
    time the job's children say it, echoed or not, and never again."""
    try:
        for line in stream:
            if sink is not None:
                sink.write(line)
                sink.flush()
            if notices is not None and COMPILE_NOTICE in line:
                text = notices.first(line)
                if text is not None:
                    sys.stdout.write(f"{prefix}{text}\n")
                    sys.stdout.flush()
                continue
            if echo and line.strip():  # a blank line echoed would be a bare "[name] "
                sys.stdout.write(f"{prefix}{line}")
                sys.stdout.flush()
    finally:
        stream.close()
        if sink is not None:
            sink.close()


@dataclass
class Child:
    """One process the launcher started (one incarnation of it) and what a restart needs to
    start it again."""

    name: str
    proc: subprocess.Popen
    pump: threading.Thread
    log_path: Path
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] | None = None
    # Variables taken out of what it inherits (those its config file holds).
    unset: tuple[str, ...] = ()
    port_file: Path | None = None
    # Where this incarnation's output starts in its (appended) log.
    log_offset: int = 0
    # Workers: the job's steps per worker (None: until the data ends), and the steps earlier
    # incarnations reported done.
    steps: int | None = None
    steps_done: int = 0
    # When this incarnation was started, and the first incarnation of it (time.time(); 0: this
    # is the first): a file an incarnation wrote is no older than its start.
    started: float = 0.0
    first_started: float = 0.0


def spawn(
    log_dir: Path, name: str, argv: list[str], echo: bool, env: dict[str, str] | None = None, append: bool = False,
    unset: Sequence[str] = (), notices: Notices | None = None,
) -> Child:
    """Start ``python argv...`` as child ``name``: its output goes to ``log_dir/<name>.log``
    (appended to, for a restart), and to stdout with a ``[name]`` prefix when ``echo`` (its
    compile notices, echoed or not, once per job: ``notices``). It inherits this process's
    environment but the variables ``unset``, with ``env`` over it."""
    log_path = log_dir / f"{name}.log"
    started = time.time()
    offset = log_path.stat().st_size if append and log_path.exists() else 0
    inherited = {k: v for k, v in os.environ.items() if k not in unset} if unset else os.environ
    proc = subprocess.Popen(
        child_command(argv),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # One intra-op thread per process unless the user says otherwise: several processes
        # share the cores, and OpenMP spin-waiting under oversubscription halves throughput.
        env={"OMP_NUM_THREADS": "1", **inherited, "PYTHONUNBUFFERED": "1", **(env or {})},
    )
    sink = log_path.open("a" if append else "w")
    pump = threading.Thread(target=_pump, args=(proc.stdout, f"[{name}] ", sink, echo, notices), daemon=True)
    pump.start()
    return Child(name, proc, pump, log_path, list(argv), env, tuple(unset), log_offset=offset, started=started)


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


def gpu_count() -> int:
    """CUDA devices torch sees on this host (0 without CUDA)."""
    # Start-up cost: the launcher imports torch only where a job may spread workers over GPUs.
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# The --device values worker_device spreads over the host's GPUs (only they need gpu_count, and torch).
SPREAD_DEVICES = ("auto", "cuda")


def worker_device(device: str, index: int, gpus: int) -> str:
    """The device of async/ssp worker ``index`` on a host with ``gpus`` GPUs: ``cuda:(index mod
    gpus)`` for ``auto`` or ``cuda`` when there are GPUs (one worker per GPU, round robin), else
    ``device`` as given (``cpu``, an explicit ``cuda:N``, or ``auto`` without a GPU)."""
    if device in SPREAD_DEVICES and gpus > 0:
        return f"cuda:{index % gpus}"
    return device


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_ports(host: str, count: int, tries: int = 100) -> int:
    """A port P with P .. P+count-1 all free now: torchrun's ranks on one host serve their metrics
    on one base port plus their local rank. A free P alone is not enough: on a busy host the
    ports beside an ephemeral one are often held by connections.

    Raises:
        ClusterError: no such run of ports found in ``tries`` tries.
    """
    for _ in range(tries):
        base = free_port(host)
        if base + count - 1 > 65535:
            continue
        try:
            for port in range(base + 1, base + count):
                with socket.socket() as s:
                    s.bind((host, port))
        except OSError:
            continue
        return base
    raise ClusterError(f"no {count} free consecutive ports on {host} in {tries} tries")
