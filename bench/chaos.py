"""Chaos while training: a real job (``run_job``, as ``tether launch`` runs it) while a seeded
schedule SIGKILLs, SIGSTOPs (then SIGCONTs) and restarts random shards and workers; the same
job undisturbed beside it.

    python bench/chaos.py [--seconds 60] [--modes ssp:2,async] [--seed 1] [--workers 4] [--shards 3]
                          [--steps N] [--checkpoint-every 3] [--data synthetic|parquet] [--no-resume-data]
                          [--no-baseline] [--out DIR] [--json FILE]

What it reports, per mode, chaos and undisturbed side by side:

* per fault: when, what, and the time to recover: ``back`` (the process, or the one that
  replaced it, serves again: a shard answers Info, a worker steps, a ledger writer has a push
  acknowledged) and ``progress`` (every running worker has stepped since);
* exactly once: two *ledger writers* (``PSClient`` processes beside the workers, faulted like
  them) push a gradient of 1 to a fresh row of an SGD table (lr 1, rows start at 0) per push,
  and journal each push before it is sent and once acknowledged; at the end every journaled row
  is pulled: -1 is one application, 0 none, -2 two. A push acknowledged and not applied is
  *lost by design* when its shard was SIGKILLed after the acknowledgement and came back from a
  checkpoint begun before it (updates after a shard's last checkpoint die with it), else *lost*;
  applied twice is *duplicated*. The training workers' own pushes are counted from the shards'
  Info (applied in the state, retries recognised as duplicates) and the workers' metrics
  (duplicates a shard reported for a push sent once);
* the final held-out loss against the undisturbed job's;
* leaks once the job is over: processes, the launcher's file descriptors, each shard's file
  descriptors and memfd regions (fds and mappings) with every client gone, against the shard's
  own count before the workers connected, and files left in /dev/shm;
* the largest RSS of each process (VmHWM, sampled every 0.5 s; the maximum over incarnations).

``--data parquet`` trains on a Parquet file instead of the endless synthetic stream: the same
synthetic click log (the job's seed, vocabulary and fields) written once per invocation to
``OUT/data/``, one epoch with every worker's steps (every 10th row held out, as the job holds out
Parquet rows), and every worker saves its stream position every ``log_every`` steps
(``--checkpoint-every-steps``, so worker 0 also asks the shards for a checkpoint ``step-<clock>``
that often, in both jobs). A restarted worker reads on from its newest saved position, as
``tether launch --max-restarts`` restarts it (``LocalCluster.resume_workers``: the synthetic
stream and Parquet alike), so the chaos job sees as many distinct samples as the undisturbed one;
``--no-resume-data`` has it read its share from the start instead.

Worker faults stop once a worker is 80% through its steps: a worker restarted after another
finished would wait for every worker to join (``AsyncPolicy.start``) and is not restarted.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from _common import markdown_table

LEDGER = "chaos_ledger"
# Ledger row ids: writer index, life (incarnation count) and sequence number in separate bits.
_WRITER_BITS, _LIFE_BITS = 40, 28
KINDS = ("kill", "stop", "restart")
TARGETS = ("shard", "worker", "ledger")


# -- the ledger writer (a child process) ----------------------------------------------------------


def ledger_main(argv: list[str]) -> int:
    """``chaos.py _ledger ADDRESSES JOURNAL INDEX LIFE RATE STOPFILE``: push one fresh row per push
    until STOPFILE exists, journaling each push (S: about to send, A: acknowledged, F: failed)."""
    import logging

    import torch

    from tether.protos.errors import TetherError
    from tether.protos.specs import OptimizerConfig, TableConfig
    from tether.worker.client.config import ClientConfig
    from tether.worker.client.ps_client import PSClient
    from tether.worker.metrics import NullWorkerMetrics

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    addresses, journal, index, life, rate, stop_file = argv[0].split(","), Path(argv[1]), int(argv[2]), int(argv[3]), float(argv[4]), Path(argv[5])

    class Attempts(NullWorkerMetrics):
        """Failed attempts (each followed by a retry or the call's failure), and when the last was."""

        def __init__(self) -> None:
            self.failed, self.last = 0, 0.0

        def rpc_failed(self, rpc: str, code: str) -> None:
            self.failed, self.last = self.failed + 1, time.time()

    attempts = Attempts()
    table = TableConfig(LEDGER, 1, OptimizerConfig("sgd", 1.0), init_scale=0.0)
    client = PSClient(ClientConfig(addresses=tuple(addresses), worker_id=f"ledger-{index}", timeout_s=5.0, retries=100,
                                   backoff_s=0.05, max_backoff_s=0.5, call_deadline_s=30.0), metrics=attempts)
    client.declare([table])
    ones = torch.ones(1, 1)
    with journal.open("a", buffering=1) as out:
        out.write(f"L {life} {client.incarnation} {time.time():.6f}\n")
        seq = 0
        while not stop_file.exists():
            seq += 1
            rid = (index << _WRITER_BITS) | (life << _LIFE_BITS) | seq
            ids = torch.tensor([rid], dtype=torch.int64)
            out.write(f"S {rid} {time.time():.6f}\n")
            failed = attempts.failed
            try:
                if seq % 2:
                    client.push({LEDGER: (ids, ones)}).result(60)
                else:  # the async workers' round trip: a push carrying a pull
                    client.push_pull({LEDGER: (ids, ones)}, pull_sparse={LEDGER: ids}).result(60)
                # With its failed attempts and when the last one failed: the attempt that was
                # answered started after that (before it, the shard it was first sent to had it).
                retried = attempts.failed - failed
                out.write(f"A {rid} {time.time():.6f} {retried} {attempts.last if retried else 0.0:.6f}\n")
            except TetherError as exc:
                out.write(f"F {rid} {time.time():.6f} {type(exc).__name__}\n")
            time.sleep(1.0 / rate)
    client.close()
    return 0


# -- /proc ------------------------------------------------------------------------------------------


def _start_time(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _hwm_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _fds(pid: int) -> tuple[int, int]:
    """(open file descriptors, of which memfd regions) of ``pid``."""
    total = memfd = 0
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return 0, 0
    for name in names:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        total += 1
        memfd += target.startswith("/memfd:")
    return total, memfd


def _fd_targets(pid: int) -> dict[str, str]:
    out = {}
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            out[name] = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
    return out


def _memfd_maps(pid: int) -> int:
    try:
        return sum("/memfd:" in line for line in Path(f"/proc/{pid}/maps").read_text().splitlines())
    except OSError:
        return 0


def _processes_naming(marker: str) -> list[int]:
    """Live processes (not zombies) whose command line holds ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            if marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                found.append(int(entry))
        except OSError:
            continue
    return found


def _scrape(port: int) -> dict[str, float]:
    """The unlabelled samples of a process's /metrics, plus labelled ones summed by name."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1.0) as r:
        text = r.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        name, _, value = line.rpartition(" ")
        name = name.split("{", 1)[0]
        try:
            values[name] = values.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return values


# -- faults -----------------------------------------------------------------------------------------


@dataclass
class Fault:
    """One fault of the schedule and what became of it."""

    at_s: float  # planned, seconds after every worker made its first step
    target: str  # shard-<i>, worker-<i>, ledger-<i>
    kind: str  # kill (SIGKILL), stop (SIGSTOP for stop_s, then SIGCONT), restart (SIGTERM, started again)
    stop_s: float = 0.0
    status: str = "planned"  # done, or skipped (why)
    pid: int = 0
    started: float = 0.0  # unix time
    ended: float = 0.0  # unix time the fault itself was over (SIGCONT sent; the signal sent)
    back_s: float | None = None
    progress_s: float | None = None

    def label(self) -> str:
        return f"{self.kind} {self.stop_s:.1f}s" if self.kind == "stop" else self.kind


def schedule(seed: int, seconds: float, warmup_s: float, mean_gap_s: float, shards: int, workers: int, ledgers: int) -> list[Fault]:
    """The seeded fault schedule: every (shard|worker) x kind first, in a random order, then
    random targets and kinds at exponential gaps, until ``seconds``."""
    rng = random.Random(seed)
    counts = {"shard": shards, "worker": workers, "ledger": ledgers}
    combos = [(t, k) for t in ("shard", "worker") for k in KINDS]
    rng.shuffle(combos)
    faults: list[Fault] = []
    t = warmup_s
    while t < seconds:
        if len(faults) < len(combos):
            kind_of_target, kind = combos[len(faults)]
        else:
            kind_of_target = rng.choices(TARGETS, weights=(0.4, 0.45, 0.15))[0]
            kind = rng.choices(KINDS, weights=(0.45, 0.35, 0.2))[0]
        stop_s = round(rng.uniform(0.5, 6.0), 1) if kind == "stop" else 0.0
        faults.append(Fault(round(t, 2), f"{kind_of_target}-{rng.randrange(counts[kind_of_target])}", kind, stop_s))
        t += rng.expovariate(1.0 / mean_gap_s)
    return faults


# -- the harness around one job -----------------------------------------------------------------------


@dataclass
class _Ledger:
    index: int
    journal: Path
    life: int = 0
    proc: subprocess.Popen | None = None
    restarts: int = 0


@dataclass
class Observed:
    """What the sampler saw of one job."""

    peak_rss_kib: dict[str, int] = field(default_factory=dict)
    incarnations: dict[str, set[int]] = field(default_factory=dict)
    seen: dict[int, int | None] = field(default_factory=dict)  # pid -> start time
    shard_info: dict[str, dict[int, dict[str, Any]]] = field(default_factory=dict)  # shard -> pid -> last Info
    worker_metrics: dict[str, dict[int, dict[str, float]]] = field(default_factory=dict)  # worker -> pid -> last scrape
    last_step: dict[str, float] = field(default_factory=dict)  # worker -> unix time of its last step
    ledger_ack: dict[str, tuple[int, float]] = field(default_factory=dict)  # ledger-i -> (life, unix time of last ack)
    shard_fds_idle: dict[str, tuple[int, int]] = field(default_factory=dict)
    shard_memfd_peak: dict[str, int] = field(default_factory=dict)


class Chaos:
    """The ``during`` context of ``run_job``: ledger writers, a sampler, and (unless ``faults`` is
    empty) the fault schedule, from the workers' start until they have all finished."""

    def __init__(self, work: Path, faults: list[Fault], ledgers: int = 2, ledger_rate: float = 20.0, steps: int = 0) -> None:
        self.work = work
        self.faults = faults
        self.steps = steps
        self.ledgers = [_Ledger(i, work / f"ledger-{i}.journal") for i in range(ledgers)]
        self.ledger_rate = ledger_rate
        self.stop_file = work / "ledger.stop"
        self.observed = Observed()
        self.ledger_report: dict[str, Any] = {}
        self.end_state: dict[str, Any] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._stopped: dict[int, float] = {}  # pids SIGSTOPped now -> when
        self._pool = ThreadPoolExecutor(8, thread_name_prefix="chaos-probe")
        self.t0 = 0.0
        self.t_faults = 0.0
        self.cluster: Any = None
        self.shard_kills: list[tuple[int, float]] = []  # (shard index, unix time)
        self.workers_near_end = False

    # -- context --------------------------------------------------------------------------------

    @contextmanager
    def __call__(self, cluster: Any) -> Iterator[None]:
        self.cluster = cluster
        self.t0 = time.time()
        self.work.mkdir(parents=True, exist_ok=True)
        self.stop_file.unlink(missing_ok=True)
        for name, proc in cluster.processes().items():
            if name.startswith("shard-"):
                self.observed.shard_fds_idle[name] = _fds(proc.pid)
        for ledger in self.ledgers:
            ledger.journal.unlink(missing_ok=True)
            self._start_ledger(ledger)
        self._spawn(self._sample_loop, "chaos-sampler")
        if self.faults:
            self._spawn(self._nemesis, "chaos-nemesis")
        try:
            yield
        finally:
            self._finish()

    def _spawn(self, target: Any, name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def _start_ledger(self, ledger: _Ledger) -> None:
        from tether.deploy.children import child_command

        argv = [str(Path(__file__).resolve()), "_ledger", ",".join(self.cluster.addresses), str(ledger.journal), str(ledger.index),
                str(ledger.life), repr(self.ledger_rate), str(self.stop_file)]
        log = (self.work / f"ledger-{ledger.index}.log").open("a")
        ledger.proc = subprocess.Popen(child_command(argv), stdout=log, stderr=subprocess.STDOUT, env={"OMP_NUM_THREADS": "1", **os.environ})
        log.close()

    def processes(self) -> dict[str, subprocess.Popen]:
        procs = dict(self.cluster.processes())
        for ledger in self.ledgers:
            if ledger.proc is not None:
                procs[f"ledger-{ledger.index}"] = ledger.proc
        return procs

    # -- sampling -------------------------------------------------------------------------------

    def _sample_loop(self) -> None:
        import grpc

        from tether.protos import tether_pb2 as pb
        from tether.protos import tether_pb2_grpc as pb_grpc

        channels = [grpc.insecure_channel(a) for a in self.cluster.addresses]
        stubs = [pb_grpc.ParameterServerStub(c) for c in channels]
        try:
            while not self._stop.wait(0.25):
                self._sample(stubs, pb)
        finally:
            for c in channels:
                c.close()

    def _sample(self, stubs: list[Any], pb: Any) -> None:
        obs = self.observed
        procs = self.processes()
        for name, proc in procs.items():
            pid = proc.pid
            if pid not in obs.seen:
                obs.seen[pid] = _start_time(pid)
            obs.incarnations.setdefault(name, set()).add(pid)
            if proc.poll() is None:
                obs.peak_rss_kib[name] = max(obs.peak_rss_kib.get(name, 0), _hwm_kib(pid))
                if name.startswith("shard-"):
                    obs.shard_memfd_peak[name] = max(obs.shard_memfd_peak.get(name, 0), _fds(pid)[1])
        # Shards' Info and workers' metrics in parallel, each bounded (a stopped process answers nothing).
        futures = {}
        for i, stub in enumerate(stubs):
            name = f"shard-{i}"
            if name in procs and procs[name].poll() is None and procs[name].pid not in self._stopped:
                futures[name] = (procs[name].pid, stub.Info.future(pb.InfoRequest(), timeout=1.0))
        ports = {name: port for name, port in self.cluster.metrics_ports.items() if name.startswith("worker-")}
        scrapes = {}
        for name, port in ports.items():
            if name in procs and procs[name].poll() is None and procs[name].pid not in self._stopped:
                scrapes[name] = (procs[name].pid, self._pool.submit(_scrape, port))
        now = time.time()
        for name, (pid, fut) in futures.items():
            try:
                info = fut.result(timeout=2.0)
            except Exception:
                continue
            obs.shard_info.setdefault(name, {})[pid] = {
                "applied_pushes": int(info.applied_pushes), "duplicate_pushes": int(info.duplicate_pushes),
                "restored_checkpoint": info.restored_checkpoint, "at": now,
            }
        for name, (pid, sfut) in scrapes.items():
            try:
                values = sfut.result(timeout=2.0)
            except Exception:
                continue
            obs.worker_metrics.setdefault(name, {})[pid] = values
            last = values.get("tether_worker_last_step_timestamp_seconds", 0.0)
            if last:
                obs.last_step[name] = max(obs.last_step.get(name, 0.0), last)
        for ledger in self.ledgers:
            life, acked = _last_ack(ledger.journal)
            if acked:
                obs.ledger_ack[f"ledger-{ledger.index}"] = (life, acked)
            # A ledger writer that died is started again, as the launcher starts a worker.
            if ledger.proc is not None and ledger.proc.poll() is not None and not self._stop.is_set() and not self.stop_file.exists():
                ledger.life += 1
                ledger.restarts += 1
                self._start_ledger(ledger)
        steps = self.steps
        if steps:
            before = self.cluster.steps_before_restarts()
            for name, proc in procs.items():
                if not name.startswith("worker-"):
                    continue
                done = before.get(name, 0) + obs.worker_metrics.get(name, {}).get(proc.pid, {}).get("tether_worker_steps_total", 0.0)
                if done >= 0.8 * steps or proc.poll() == 0:
                    self.workers_near_end = True
        self._recoveries(procs, now)

    def _recoveries(self, procs: dict[str, subprocess.Popen], now: float) -> None:
        obs = self.observed
        running = [n for n, p in procs.items() if n.startswith("worker-") and p.poll() is None and p.pid not in self._stopped]
        for f in self.faults:
            if f.status != "done" or not f.ended:
                continue
            proc = procs.get(f.target)
            if f.back_s is None and proc is not None and proc.poll() == 0 and f.target.startswith("worker-") and (f.kind == "stop" or proc.pid != f.pid):
                f.back_s = round(now - f.started, 2)  # it finished its steps between two samples
            if f.back_s is None and proc is not None and proc.poll() is None and proc.pid not in self._stopped:
                replaced = f.kind == "stop" or proc.pid != f.pid
                if replaced:
                    if f.target.startswith("shard-"):
                        info = obs.shard_info.get(f.target, {}).get(proc.pid)
                        ok = info is not None and info["at"] > f.ended
                    elif f.target.startswith("worker-"):
                        ok = obs.last_step.get(f.target, 0.0) > f.ended
                    else:
                        ack = obs.ledger_ack.get(f.target)
                        ok = ack is not None and ack[1] > f.ended
                    if ok:
                        f.back_s = round(now - f.started, 2)
            if f.back_s is not None and f.progress_s is None:
                back_at = f.started + f.back_s
                if all(obs.last_step.get(n, 0.0) > back_at for n in running):
                    f.progress_s = round(now - f.started, 2)

    # -- faults ---------------------------------------------------------------------------------

    def _busy(self, target: str) -> bool:
        return any(f.target == target and f.status == "done" and (f.back_s is None or not f.ended) for f in self.faults)

    def _nemesis(self) -> None:
        # The schedule's clock starts once every worker has made a step (starting a job's
        # processes on two shared cores takes 10-20 s, and a fault then tests start-up only).
        deadline = time.time() + 300
        while not self._stop.wait(0.25) and time.time() < deadline:
            workers = [n for n in self.cluster.processes() if n.startswith("worker-")]
            if workers and all(n in self.observed.last_step for n in workers):
                break
        self.t_faults = time.time()
        for f in self.faults:
            if self._stop.wait(max(self.t_faults + f.at_s - time.time(), 0.0)):
                f.status = "skipped (job over)"
                continue
            if f.target.startswith("worker-") and self.workers_near_end:
                f.status = "skipped (workers near the end)"
                continue
            if self._busy(f.target):
                f.status = "skipped (not recovered from the last fault)"
                continue
            proc = self.processes().get(f.target)
            if proc is None or proc.poll() is not None:
                f.status = "skipped (not running)"
                continue
            self._apply(f, proc)

    def _apply(self, f: Fault, proc: subprocess.Popen) -> None:
        f.pid, f.started, f.status = proc.pid, time.time(), "done"
        if f.kind == "kill":
            os.kill(proc.pid, signal.SIGKILL)
            if f.target.startswith("shard-"):
                self.shard_kills.append((int(f.target.rpartition("-")[2]), f.started))
            f.ended = time.time()
        elif f.kind == "stop":
            os.kill(proc.pid, signal.SIGSTOP)
            with self._lock:
                self._stopped[proc.pid] = f.started
            self._spawn(lambda: self._resume(f), "chaos-cont")
        elif f.target.startswith("shard-"):
            self._spawn(lambda: self._restart_shard(f), "chaos-restart")
        else:
            os.kill(proc.pid, signal.SIGTERM)  # a worker or ledger writer: the launcher (or this harness) starts it again
            f.ended = time.time()

    def _resume(self, f: Fault) -> None:
        time.sleep(f.stop_s)
        try:
            os.kill(f.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        with self._lock:
            self._stopped.pop(f.pid, None)
        f.ended = time.time()

    def _restart_shard(self, f: Fault) -> None:
        from tether.deploy.errors import ClusterError

        try:
            self.cluster.restart_shard(int(f.target.rpartition("-")[2]))
        except ClusterError as exc:
            f.status = f"done ({exc})"
        f.ended = time.time()

    # -- the end ----------------------------------------------------------------------------------

    def _finish(self) -> None:
        """Stop faulting, let every fault recover (bounded), stop the ledger writers, check the
        ledger and what the shards hold with every client gone."""
        nemesis_over = time.time()
        self._stop.set()
        for t in self._threads:
            t.join(timeout=90)
        with self._lock:
            for pid in list(self._stopped):
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            self._stopped.clear()
        # Faults still recovering (a shard restart under way) get up to 60 s, sampled as before.
        deadline = time.time() + 60
        self._stop.clear()
        sampler = threading.Thread(target=self._sample_loop, daemon=True)
        sampler.start()
        while any(f.status.startswith("done") and f.back_s is None for f in self.faults) and time.time() < deadline:
            time.sleep(0.25)
        self.stop_file.touch()
        for ledger in self.ledgers:
            if ledger.proc is not None:
                try:
                    ledger.proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    ledger.proc.kill()
                    ledger.proc.wait(timeout=10)
        time.sleep(0.5)
        self._stop.set()
        sampler.join(timeout=30)
        self._pool.shutdown(wait=True)
        self.ledger_report = self._check_ledger()
        self.end_state = self._shards_at_rest()
        self.end_state["chaos_s"] = round(nemesis_over - self.t_faults, 1) if self.t_faults else 0.0

    def _check_ledger(self) -> dict[str, Any]:
        import torch

        from tether.protos.partition import shard_of_ids
        from tether.protos.specs import OptimizerConfig, TableConfig
        from tether.worker.client.config import ClientConfig
        from tether.worker.client.ps_client import PSClient

        sent: dict[int, float] = {}
        acked: dict[int, float] = {}
        failed: dict[int, float] = {}
        retried_at: dict[int, float] = {}
        for ledger in self.ledgers:
            for kind, rid, t, last_failure in _journal(ledger.journal):
                {"S": sent, "A": acked, "F": failed}[kind][rid] = t
                if last_failure:
                    retried_at[rid] = last_failure
        ids = sorted(sent)
        num_shards = len(self.cluster.addresses)
        values: dict[int, float] = {}
        client = PSClient(ClientConfig(addresses=tuple(self.cluster.addresses), worker_id="chaos-check", transport="grpc", retries=30,
                                       max_backoff_s=0.5))
        try:
            client.declare([TableConfig(LEDGER, 1, OptimizerConfig("sgd", 1.0), init_scale=0.0)])
            for at in range(0, len(ids), 20_000):
                chunk = torch.tensor(ids[at : at + 20_000], dtype=torch.int64)
                rows = client.pull({LEDGER: chunk}).result(120).rows[LEDGER]
                values.update(zip(chunk.tolist(), (-rows[:, 0]).tolist(), strict=False))
        finally:
            client.close()
        restores = {s: _restores(self.cluster.log_dir / f"shard-{s}.log") for s in range(num_shards)}
        kills = sorted(self.shard_kills)
        per_shard = [dict(acked=0, applied=0, lost_by_design=0, lost=0, duplicated=0, applied_unacknowledged=0, never_applied_unacknowledged=0)
                     for _ in range(num_shards)]
        owners = shard_of_ids(torch.tensor(ids, dtype=torch.int64).numpy(), num_shards) if ids else []
        bad: list[dict[str, Any]] = []
        for rid, shard in zip(ids, owners, strict=False):
            row = per_shard[int(shard)]
            v = values.get(rid, 0.0)
            times = round(v)
            if abs(v - times) > 1e-4 or times < 0:
                row["duplicated"] += 1
                bad.append({"id": rid, "value": v, "verdict": "corrupt"})
                continue
            if rid in acked:
                row["acked"] += 1
            if times >= 2:
                row["duplicated"] += 1
                bad.append({"id": rid, "applied": times, "verdict": "duplicated"})
            elif times == 1:
                row["applied" if rid in acked else "applied_unacknowledged"] += 1
            elif rid not in acked:
                row["never_applied_unacknowledged"] += 1
            elif _lost_by_design(int(shard), retried_at.get(rid, sent[rid]), acked[rid], kills, restores):
                row["lost_by_design"] += 1
            else:
                row["lost"] += 1
                bad.append({"id": rid, "acked": acked[rid], "verdict": "lost"})
        totals = {k: sum(r[k] for r in per_shard) for k in per_shard[0]} if per_shard else {}
        return {"pushes": len(ids), "failed_calls": len(failed), "per_shard": per_shard, "total": totals, "violations": bad[:20],
                "writer_restarts": {f"ledger-{w.index}": w.restarts for w in self.ledgers}}

    def _shards_at_rest(self) -> dict[str, Any]:
        """Each shard's file descriptors and memfd regions with every client gone (waited for, up
        to 15 s: a shard closes a connection once it reads its end), against its own idle count."""
        out: dict[str, Any] = {}
        deadline = time.time() + 15
        for name, proc in self.cluster.processes().items():
            if not name.startswith("shard-") or proc.poll() is not None:
                continue
            idle_fds, _ = self.observed.shard_fds_idle.get(name, (0, 0))
            while True:
                fds, memfd = _fds(proc.pid)
                maps = _memfd_maps(proc.pid)
                if (fds <= idle_fds and memfd == 0 and maps == 0) or time.time() > deadline:
                    break
                time.sleep(0.25)
            out[name] = {"fds": fds, "fds_idle_at_start": idle_fds, "memfd_fds": memfd, "memfd_maps": maps,
                         "memfd_fds_peak": self.observed.shard_memfd_peak.get(name, 0)}
        return out


def _journal(path: Path) -> Iterator[tuple[str, int, float, float]]:
    """(kind, row id, unix time, when its last failed attempt was: 0.0 for none) of each line."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return
    for line in lines:
        parts = line.split()
        if len(parts) >= 3 and parts[0] in ("S", "A", "F"):
            try:
                last_failure = float(parts[4]) if parts[0] == "A" and len(parts) >= 5 and int(parts[3]) else 0.0
                yield parts[0], int(parts[1]), float(parts[2]), last_failure
            except ValueError:
                continue  # a line cut short by a SIGKILL


def _last_ack(path: Path) -> tuple[int, float]:
    """(life, unix time) of a journal's last acknowledged push; (0, 0.0) when none."""
    try:
        with path.open("rb") as f:
            f.seek(max(f.seek(0, 2) - 4096, 0))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return 0, 0.0
    for line in reversed(lines):
        parts = line.split()
        if len(parts) >= 3 and parts[0] == "A":
            try:
                rid, t = int(parts[1]), float(parts[2])
            except ValueError:
                continue
            return (rid >> _LIFE_BITS) & ((1 << (_WRITER_BITS - _LIFE_BITS)) - 1), t
    return 0, 0.0


_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ")
_CHECKPOINT_WRITTEN = re.compile(r" checkpoint (\S+): \d+ bytes in ([0-9.]+)s ")


def _restores(log: Path) -> list[tuple[float, float | None]]:
    """Each incarnation of a shard, from its log: (unix time it served, the time its restored
    checkpoint was begun; None when it restored nothing)."""
    out: list[tuple[float, float | None]] = []
    restored: float | None = None
    # Checkpoints named by the workers (step-<clock>, from --checkpoint-every-steps) carry no
    # time: when they were begun is the time of the shard's line "checkpoint ID: N bytes in S s"
    # less S (and 0.01 s for the rounding of S and of the log's milliseconds).
    written: dict[str, float] = {}
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return out
    for line in lines:
        m = _LOG_TIME.match(line)
        if m is None:
            continue
        t = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000
        done = _CHECKPOINT_WRITTEN.search(line)
        if done:
            written[done.group(1)] = t - float(done.group(2)) - 0.01
        elif " restored checkpoint " in line:
            ckpt = line.split(" restored checkpoint ", 1)[1].split()[0]
            begun = re.fullmatch(r"(?:auto|final)-(\d+)", ckpt)
            # A checkpoint of unknown begin counts as begun when it was restored: every push
            # acknowledged before then and missing is called lost.
            restored = int(begun.group(1)) / 1000 if begun else written.get(ckpt, t)
        elif " serving on " in line:
            out.append((t, restored))
            restored = None
    return out


def _lost_by_design(shard: int, applied_from: float, acked_at: float, kills: list[tuple[int, float]],
                    restores: dict[int, list[tuple[float, float | None]]]) -> bool:
    """Whether a push that is not in its shard's final state may be missing by design: the shard
    applied it between ``applied_from`` (when it was sent, or when its last failed attempt failed)
    and ``acked_at``, and a SIGKILL after ``applied_from`` was followed by a restore of a
    checkpoint begun before ``acked_at`` (or of none). A checkpoint begun after the push was
    applied holds it: pushes pause while a shard copies its tables.

    The acknowledgement may be read after the kill (a client SIGSTOPped with the answer in its
    socket): what bounds the application is when the answered attempt was sent, not when its
    answer was read."""
    for s, killed in kills:
        if s != shard or killed <= applied_from:
            continue
        after = [begun for served, begun in restores.get(shard, []) if served > killed]
        if after and (after[0] is None or after[0] < acked_at):
            return True
    return False


# -- one mode: undisturbed and under chaos --------------------------------------------------------------


def run_once(template: Any, shards: int, work: Path, faults: list[Fault], checkpoint_every: float, lease_s: float,
             timeout_s: float, resume: bool = True) -> dict[str, Any]:
    """One job with the harness around it; what it printed goes to work/launch.log. ``resume``:
    restarted workers read on from their newest saved stream position (``LocalCluster.resume_workers``)."""
    from tether.deploy.job import run_job
    from tether.server.config import ShardConfig

    chaos = Chaos(work / "chaos", faults, steps=template.steps)
    marker = str(work.resolve())
    fds_before = _fds(os.getpid())
    targets_before = _fd_targets(os.getpid())
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    started = time.time()
    summary = run_job(template, shards, out=work, timeout_s=timeout_s, echo=False, metrics=True, checkpoint_every=checkpoint_every,
                      shard=ShardConfig(lease_seconds=lease_s), max_restarts=10_000, shard_restarts=10_000, during=chaos,
                      resume_workers=resume)
    wall = time.time() - started
    # Processes of the job still alive once run_job returned: every pid seen (same start time),
    # and anything naming the job's folder.
    time.sleep(0.5)
    leaked = sorted({pid for pid, st in chaos.observed.seen.items() if st is not None and _start_time(pid) == st}
                    | set(_processes_naming(marker)))
    # A failed probe's exception holds its frame, and with it the Popen objects (their pipes)
    # of the processes it looked at, in a reference cycle: collect those before counting.
    gc.collect()
    fds_after = _fds(os.getpid())
    targets_after = _fd_targets(os.getpid())
    new_fds = sorted(f"{fd} -> {t}" for fd, t in targets_after.items() if targets_before.get(fd) != t)
    shm_after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    obs = chaos.observed
    unexpected_dups = sum(m.get("tether_worker_unexpected_duplicate_pushes_total", 0.0) for per in obs.worker_metrics.values() for m in per.values())
    retries = sum(m.get("tether_worker_retries_total", 0.0) for per in obs.worker_metrics.values() for m in per.values())
    training = {}
    for name, per_pid in sorted(obs.shard_info.items()):
        incarnations = sorted(per_pid.values(), key=lambda i: i["at"])
        training[name] = {
            "incarnations_seen": len(incarnations),
            "applied_in_state_at_end": incarnations[-1]["applied_pushes"] if incarnations else 0,
            "retries_recognised_as_duplicates": sum(i["duplicate_pushes"] for i in incarnations),
            "restored": [i["restored_checkpoint"] for i in incarnations if i["restored_checkpoint"]],
        }
    return {
        "summary": {k: summary[k] for k in ("eval_loss", "eval_auc", "baseline_loss", "bayes_loss", "total_samples", "job_wall_s", "restarts")
                    if k in summary},
        "wall_s": round(wall, 1),
        "chaos_s": chaos.end_state.pop("chaos_s", 0.0),
        "faults": [asdict(f) for f in faults],
        "ledger": chaos.ledger_report,
        "training_pushes": training,
        "worker_unexpected_duplicates": unexpected_dups,
        "worker_retries": retries,
        "leaks": {
            "processes": leaked,
            "launcher_fds": fds_after[0] - fds_before[0],
            "launcher_memfd": fds_after[1],
            "launcher_new_fds": new_fds,
            "dev_shm_files": sorted(shm_after - shm_before),
            "shards_at_rest": chaos.end_state,
        },
        "peak_rss_mib": {name: round(kib / 1024, 1) for name, kib in sorted(obs.peak_rss_kib.items())},
        "launcher_peak_rss_mib": round(_hwm_kib(os.getpid()) / 1024, 1),
        "incarnations": {name: len(pids) for name, pids in sorted(obs.incarnations.items())},
        "resumed": chaos.cluster.worker_resumes if chaos.cluster is not None else [],
    }


# Steps between a worker's progress lines, and (--data parquet) between its saved stream positions.
LOG_EVERY = 25
PARQUET_ROW_GROUP_ROWS = 65_536
HOLDOUT_EVERY = 10  # the job holds out Parquet row i when i % 10 == 9


def parquet_rows(a: argparse.Namespace) -> int:
    """Rows of the ``--data parquet`` table: whole row groups, enough that each worker's share
    (row groups dealt round the workers, every 10th row held out) holds its steps' samples
    with 3% to spare, in one epoch."""
    train_per_worker = a.steps * a.batch_size * 1.03
    groups_per_worker = math.ceil(train_per_worker / (PARQUET_ROW_GROUP_ROWS * (1 - 1 / HOLDOUT_EVERY)))
    return groups_per_worker * a.workers * PARQUET_ROW_GROUP_ROWS


def write_parquet(path: Path, rows: int, num_sparse: int, vocab_size: int, seed: int) -> None:
    """The built-in job's synthetic click log (``SyntheticClickLog``: the job's seed, fields and
    vocabulary) as a Criteo-shaped table: ``label``, dense ``I1..`` (float32) and id ``C1..``
    (int64) columns, row groups of ``PARQUET_ROW_GROUP_ROWS``. Written to a temporary name and
    renamed, so a file at ``path`` is whole."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tether.worker.data.synthetic import SyntheticClickLog, SyntheticConfig

    gen = SyntheticClickLog(SyntheticConfig(num_sparse=num_sparse, vocab_size=vocab_size, seed=seed))
    num_dense = gen.config.num_dense
    schema = pa.schema([("label", pa.float32())] + [(f"I{j + 1}", pa.float32()) for j in range(num_dense)]
                       + [(f"C{j + 1}", pa.int64()) for j in range(num_sparse)])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with pq.ParquetWriter(tmp, schema) as w:
        for b in gen.batches(PARQUET_ROW_GROUP_ROWS, rows // PARQUET_ROW_GROUP_ROWS):
            dense, sparse = b.dense.numpy(), b.sparse.numpy()
            arrays = ([pa.array(b.labels.numpy())] + [pa.array(dense[:, j]) for j in range(num_dense)]
                      + [pa.array(sparse[:, j]) for j in range(num_sparse)])
            w.write_batch(pa.record_batch(arrays, schema=schema), row_group_size=PARQUET_ROW_GROUP_ROWS)
    os.replace(tmp, path)


def job_data(a: argparse.Namespace, out: Path) -> str:
    """The jobs' ``--data``: ``synthetic``, or ``parquet:PATH`` of the table ``write_parquet``
    writes (once per invocation, shared by every mode and job)."""
    if a.data == "synthetic":
        return "synthetic"
    rows = parquet_rows(a)
    path = out / "data" / f"ctr-seed{a.seed}-vocab{a.vocab_size}-{rows}.parquet"
    if not path.exists():
        started = time.time()
        print(f"writing {rows:,} rows of the synthetic click log to {path} ...", flush=True)
        write_parquet(path, rows, num_sparse=8, vocab_size=a.vocab_size, seed=a.seed)
        print(f"  {path.stat().st_size / 2**20:,.0f} MiB in {time.time() - started:.0f}s", flush=True)
    return f"parquet:{path}"


def run_mode(mode: str, a: argparse.Namespace, out: Path, data: str = "synthetic") -> dict[str, Any]:
    from tether.worker.config import WorkerConfig

    # A Parquet stream has a position: every worker saves it at its progress lines' steps
    # (worker 0 then also asks the shards for a checkpoint), in both jobs alike.
    positions = LOG_EVERY if data != "synthetic" else 0
    template = WorkerConfig(shards=("pending:0",), num_workers=a.workers, steps=a.steps, batch_size=a.batch_size, vocab_size=a.vocab_size,
                            eval_samples=a.eval_samples, log_every=LOG_EVERY, mode=mode, seed=a.seed, data=data,
                            checkpoint_every_steps=positions)
    faults = schedule(a.seed, a.seconds, a.warmup, a.mean_gap, a.shards, a.workers, 2)
    result: dict[str, Any] = {"mode": mode, "planned_faults": len(faults), "data": data, "resume_data": a.resume_data}
    if a.baseline:
        print(f"[{mode}] undisturbed job ...", flush=True)
        result["undisturbed"] = run_once(template, a.shards, out / mode.replace(":", "") / "undisturbed", [], a.checkpoint_every, a.lease,
                                         a.job_timeout)
    print(f"[{mode}] chaos job: {len(faults)} faults planned over {a.seconds:.0f}s ...", flush=True)
    result["chaos"] = run_once(template, a.shards, out / mode.replace(":", "") / "chaos", faults, a.checkpoint_every, a.lease, a.job_timeout,
                               resume=a.resume_data)
    return result


# -- report -----------------------------------------------------------------------------------------


def report(results: list[dict[str, Any]], a: argparse.Namespace) -> str:
    data = (f"a Parquet table of the synthetic click log ({parquet_rows(a):,} rows, one epoch), positions saved every {LOG_EVERY} steps"
            if a.data == "parquet" else "the synthetic stream") + (
            "; restarted workers resume their newest saved position" if a.resume_data else "; restarted workers read their share from its start")
    lines = [f"chaos: seed {a.seed}, {a.workers} workers x {a.shards} shards, {a.steps} steps x batch {a.batch_size} per worker, "
             f"faults over {a.seconds:.0f}s (mean gap {a.mean_gap:g}s), checkpoints every {a.checkpoint_every:g}s, lease {a.lease:g}s, "
             f"{os.cpu_count()} CPU(s); data: {data}"]
    for r in results:
        c = r["chaos"]
        u = r.get("undisturbed")
        lines += ["", f"### {r['mode']}", ""]
        done = [f for f in c["faults"] if f["status"].startswith("done")]
        lines.append(f"faults: {len(done)} of {len(c['faults'])} planned applied over {c['chaos_s']:.0f}s of chaos "
                     f"(skipped: {', '.join(sorted({f['status'] for f in c['faults'] if not f['status'].startswith('done')})) or 'none'})")
        rows = [[f"{f['at_s']:.1f}", f["target"], f"stop {f['stop_s']:.1f}s" if f["kind"] == "stop" else f["kind"],
                 f["back_s"] if f["back_s"] is not None else "never", f["progress_s"] if f["progress_s"] is not None else "-"] for f in done]
        lines += ["", markdown_table(["t (s)", "target", "fault", "back (s)", "all workers stepped (s)"], rows)]
        groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for f in done:
            groups.setdefault((f["target"].split("-")[0], f["kind"]), []).append(f)
        summary_rows = []
        for (target, kind), fs in sorted(groups.items()):
            back = [f["back_s"] for f in fs if f["back_s"] is not None]
            prog = [f["progress_s"] for f in fs if f["progress_s"] is not None]
            summary_rows.append([target, kind, len(fs), len(fs) - len(back), _med(back), max(back, default=math.nan), _med(prog), max(prog, default=math.nan)])
        lines += ["", markdown_table(["target", "fault", "n", "not back", "back median (s)", "back max (s)", "stepped median (s)", "stepped max (s)"], summary_rows)]
        ledger = c["ledger"]["total"]
        lines += ["", f"exactly once (ledger writers, {c['ledger']['pushes']:,} pushes, {c['ledger']['failed_calls']} calls failed after retries, "
                      f"writer restarts {c['ledger']['writer_restarts']}):", ""]
        lines.append(markdown_table(
            ["shard", "acked", "acked + applied once", "lost by design", "LOST", "DUPLICATED", "applied, never acked", "never applied, never acked"],
            [[f"shard-{i}", s["acked"], s["applied"], s["lost_by_design"], s["lost"], s["duplicated"], s["applied_unacknowledged"],
              s["never_applied_unacknowledged"]] for i, s in enumerate(c["ledger"]["per_shard"])]
            + [["all", ledger["acked"], ledger["applied"], ledger["lost_by_design"], ledger["lost"], ledger["duplicated"],
                ledger["applied_unacknowledged"], ledger["never_applied_unacknowledged"]]]))
        lines += ["", "training pushes: " + "; ".join(
            f"{n}: {t['applied_in_state_at_end']:,} in its state at the end, {t['retries_recognised_as_duplicates']} retries recognised, "
            f"{t['incarnations_seen']} incarnation(s) seen" for n, t in c["training_pushes"].items())
            + f"; workers: {c['worker_unexpected_duplicates']:.0f} pushes sent once but called duplicates, {c['worker_retries']:.0f} retried calls"]
        injected = {}
        for f in done:
            if f["kind"] in ("kill", "restart"):
                injected[f["target"]] = injected.get(f["target"], 0) + 1
        if a.resume_data:
            resumed = c.get("resumed", [])
            lines += ["", f"worker restarts: {len(resumed)}, {sum(r['position_step'] is not None for r in resumed)} resumed from a saved "
                          f"position (the rest died before saving one and read from the start)"]
        restarts = {**c["summary"]["restarts"], **c["ledger"]["writer_restarts"]}
        lines += ["", "restarts (of which injected): " + ", ".join(
            f"{n} {k} ({injected.get(n, 0)})" for n, k in sorted(restarts.items()) if k or injected.get(n))
            + "; a restart beyond the injected ones is a process that died of another's fault (a worker whose shard stayed "
              "away longer than its retries)"]
        both = [("undisturbed", u), ("chaos", c)] if u else [("chaos", c)]
        lines += ["", markdown_table(
            ["job", "held-out loss", "AUC", "samples", "job wall (s)", "restarts", "leaked processes", "launcher fds", "shard fds over idle",
             "shard memfd fds / maps", "/dev/shm"],
            [[name, round(j["summary"]["eval_loss"], 4), round(j["summary"]["eval_auc"], 4), j["summary"]["total_samples"],
              j["summary"]["job_wall_s"], sum(j["summary"]["restarts"].values()), len(j["leaks"]["processes"]), j["leaks"]["launcher_fds"],
              sum(max(s["fds"] - s["fds_idle_at_start"], 0) for s in j["leaks"]["shards_at_rest"].values()),
              f"{sum(s['memfd_fds'] for s in j['leaks']['shards_at_rest'].values())} / {sum(s['memfd_maps'] for s in j['leaks']['shards_at_rest'].values())}",
              len(j["leaks"]["dev_shm_files"])] for name, j in both])]
        if u:
            lines.append(f"\nheld-out loss under chaos - undisturbed: {c['summary']['eval_loss'] - u['summary']['eval_loss']:+.4f} "
                         f"(constant predictor {c['summary']['baseline_loss']:.4f}, best possible {c['summary'].get('bayes_loss', math.nan):.4f})")
        names = sorted(set(c["peak_rss_mib"]) | set(u["peak_rss_mib"] if u else {}))
        lines += ["", markdown_table(["process", "peak RSS undisturbed (MiB)", "peak RSS chaos (MiB)", "incarnations (chaos)"],
                                     [[n, (u["peak_rss_mib"].get(n, math.nan) if u else math.nan), c["peak_rss_mib"].get(n, math.nan),
                                       c["incarnations"].get(n, 0)] for n in names]
                                     + [["launcher (this process)", u["launcher_peak_rss_mib"] if u else math.nan, c["launcher_peak_rss_mib"], 1]])]
    return "\n".join(lines)


def _med(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def verdict(results: list[dict[str, Any]]) -> list[str]:
    """What broke: lost or duplicated pushes, faults never recovered from, leaks."""
    problems = []
    for r in results:
        for name in ("undisturbed", "chaos"):
            j = r.get(name)
            if j is None:
                continue
            where = f"{r['mode']} {name}"
            total = j["ledger"]["total"]
            if total["lost"] or total["duplicated"]:
                problems.append(f"{where}: {total['lost']} pushes lost, {total['duplicated']} duplicated: {j['ledger']['violations'][:3]}")
            if j["worker_unexpected_duplicates"]:
                problems.append(f"{where}: workers were told {j['worker_unexpected_duplicates']:.0f} pushes sent once were duplicates")
            never = [f"{f['target']} {f['kind']} at {f['at_s']}s" for f in j["faults"] if f["status"].startswith("done") and f["back_s"] is None]
            if never:
                problems.append(f"{where}: never recovered from {never}")
            leaks = j["leaks"]
            if leaks["processes"] or leaks["launcher_fds"] > 0 or leaks["launcher_memfd"] or leaks["dev_shm_files"]:
                problems.append(f"{where}: leaked processes {leaks['processes']}, launcher fds {leaks['launcher_fds']:+d}, "
                                f"launcher memfd {leaks['launcher_memfd']}, /dev/shm {leaks['dev_shm_files']}")
            for shard, s in leaks["shards_at_rest"].items():
                if s["memfd_fds"] or s["memfd_maps"] or s["fds"] > s["fds_idle_at_start"]:
                    problems.append(f"{where}: {shard} at rest holds {s['fds']} fds ({s['fds_idle_at_start']} idle at start), "
                                    f"{s['memfd_fds']} memfd fds, {s['memfd_maps']} memfd mappings")
    return problems


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "_ledger":
        return ledger_main(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--seconds", type=float, default=60.0, help="inject faults for this long once every worker has made a step")
    p.add_argument("--modes", default="ssp:2,async", help="comma-separated consistency modes (async, ssp:S)")
    p.add_argument("--seed", type=int, default=1, help="seed of the fault schedule (and of the job)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--shards", type=int, default=3)
    p.add_argument("--steps", type=int, default=None, help="steps per worker (default: about what 1.3x --seconds of undisturbed training takes here)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--vocab-size", type=int, default=20_000)
    p.add_argument("--eval-samples", type=int, default=10_000)
    p.add_argument("--checkpoint-every", type=float, default=3.0, help="shards checkpoint this often (seconds)")
    p.add_argument("--lease", type=float, default=4.0, help="shards' --lease-seconds: a stopped ssp worker stops holding the others back after this")
    p.add_argument("--warmup", type=float, default=3.0, help="the first fault comes this many seconds after every worker has made a step")
    p.add_argument("--mean-gap", type=float, default=4.0, help="mean seconds between faults")
    p.add_argument("--data", choices=("synthetic", "parquet"), default="synthetic",
                   help="the endless synthetic stream, or the same click log written to a Parquet file first (one epoch; "
                   "workers save their stream positions)")
    p.add_argument("--resume-data", action=argparse.BooleanOptionalAction, default=True,
                   help="a restarted worker reads on from its newest saved position (tether launch does), not from the start of its share")
    p.add_argument("--no-baseline", dest="baseline", action="store_false", help="skip the undisturbed job")
    p.add_argument("--job-timeout", type=float, default=3600.0)
    p.add_argument("--out", default=None, help="keep every job's logs, checkpoints and journals here (default: a temporary folder)")
    p.add_argument("--json", default=None, help="write the results here")
    a = p.parse_args(argv)
    if a.steps is None:
        # ~12 steps/s per worker for 4 workers x 3 shards on 2 shared cores (batch 256).
        a.steps = max(int(1.3 * a.seconds * 12 * 4 / a.workers), 50)
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if any(m == "sync" for m in modes):
        p.error("--modes: sync ranks are not restarted (a rank that dies ends the job); use async or ssp:S")
    with tempfile.TemporaryDirectory(prefix="tether-chaos-") as tmp:
        out = Path(a.out) if a.out else Path(tmp)
        data = job_data(a, out)
        results = [run_mode(mode, a, out, data) for mode in modes]
    text = report(results, a)
    print(text)
    problems = verdict(results)
    for line in problems:
        print(f"PROBLEM: {line}")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "results": results, "problems": problems}, indent=2, default=str))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
