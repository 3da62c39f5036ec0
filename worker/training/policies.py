"""What each consistency mode adds to the training loop: a small policy per mode (async, ssp:S,
sync), and for sync the torchrun process group and the dense step on every rank."""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from tether.protos.errors import DeadlineExceeded, UsageError
from tether.protos.specs import OptimizerConfig
from tether.worker.client.api import ShardClient
from tether.worker.config import TrainingConfig
from tether.worker.training.embedding import PSModel
from tether.worker.training.run_record import RunRecord
from tether.worker.training.table_rules import dense_torch_optimizer
from tether.worker.training.transfer import flat_grads, split_flat

__all__ = [
    "RESTART_FILE_ENV", "AsyncPolicy", "RowCombiner", "SSPPolicy", "SyncPolicy", "TrainerView", "init_sync", "note_started", "policy_class",
    "policy_for", "restart_count", "sync_device",
]

log = logging.getLogger(__name__)

# A step's row gradients (table -> (ids, grads)) -> those this worker pushes.
RowCombiner = Callable[[dict[str, tuple[torch.Tensor, torch.Tensor]]], dict[str, tuple[torch.Tensor, torch.Tensor]]]


class TrainerView(Protocol):
    """What a policy sees of the trainer it runs in."""

    @property
    def config(self) -> TrainingConfig: ...

    @property
    def client(self) -> ShardClient: ...

    @property
    def name(self) -> str: ...


class AsyncPolicy:
    """Asynchronous (ASP): no staleness bound. Once every worker has joined (``start``) a step
    never waits for the others; one push_pull per step once the loop is under way. The other
    policies build on this one."""

    prefetch = True  # the next batch's rows may be pulled before this step's push lands
    settle_every_step = False
    dense_on_shards = True
    # The staleness bound: before a step pulls, ``before_step`` waits (the client's clock, asked
    # with it) until the slowest live worker is at most this many clocks behind. None: no wait.
    bound: int | None = None
    # The phases a progress line shows the share of (ssp's adds its staleness wait).
    phases_shown: tuple[str, ...] = ("pull_wait", "compute", "push")

    def start(self, trainer: TrainerView) -> int:
        """Join, then wait (bounded by ``wait_timeout_s``) until every worker of the job has (the
        live workers and those that left since this one joined: a fast worker may train and
        leave between two of this one's polls):
        the workers of a run start training together, in every mode, so that start-up is not
        counted as staleness and no one runs ahead of a worker that has not started yet. A
        worker restarted into a running job (``restart_count`` > 0: ``TETHER_RESTART_COUNT``, set
        by ``tether launch --max-restarts``, or ``TETHER_RESTART_FILE``'s count of the starts
        before, set in a Kubernetes pod) only joins and goes on: the others are under way, or done
        and gone. So does a worker that finds another live worker's clock above 0 (the reply's
        ``max_clock``; a pod replaced on another node has neither): no worker
        passes this barrier before all have joined, so a clock above 0 means the job is under
        way, while in a fresh job every joined worker waits here at clock 0. Either starts at the
        slowest other live worker's clock rather than at 0. Returns the clock this worker starts
        from.

        Raises:
            DeadlineExceeded: not every worker joined within ``wait_timeout_s``.
            UsageError: ``TETHER_RESTART_COUNT`` is not an integer.
        """
        cfg = trainer.config
        restarted = restart_count() > 0
        deadline = time.monotonic() + cfg.wait_timeout_s
        while True:
            reply = trainer.client.clock(0)
            # A clock above 0: a job under way (restarted by Kubernetes, not by tether launch).
            # Those that left since this worker joined count: they trained and finished between two polls.
            if restarted or reply.max_clock > 0 or reply.live_workers + reply.finished_workers >= cfg.num_workers:
                note_started()
                return reply.min_other_clock
            if time.monotonic() > deadline:
                raise DeadlineExceeded(f"only {reply.live_workers} of {cfg.num_workers} workers joined within {cfg.wait_timeout_s:.0f}s")
            time.sleep(0.05)

    def before_step(self, trainer: TrainerView, clock: int) -> None:
        """Called before the step that ends at ``clock`` pulls: with a ``bound``, wait (bounded by
        ``wait_timeout_s``) until the slowest live worker is at most ``bound`` clocks behind.

        Raises:
            DeadlineExceeded: the slowest live worker stayed too far behind for ``wait_timeout_s``.
        """
        if self.bound is None:
            return
        cfg = trainer.config
        reply = trainer.client.clock(clock, wait_bound=self.bound, timeout_s=cfg.wait_timeout_s)
        if not reply.ready:
            raise DeadlineExceeded(f"{trainer.name} waited {cfg.wait_timeout_s:.0f}s at clock {clock} for the slowest "
                                   f"live worker (clock {reply.min_clock}, bound {self.bound})")

    def attach(self, ps: PSModel, optimizer: OptimizerConfig) -> None:
        """Called once the model is bound to the shards (``ps``) and declared, the dense
        parameters' rule ``optimizer``."""

    def after_backward(self, more: bool) -> bool:
        """Called once the gradients are in; ``more``: this worker has another batch. Returns
        False when the job's workers must stop after this step together (sync)."""
        return True

    def row_combiner(self) -> RowCombiner | None:
        """What turns a step's row gradients (table -> (ids, grads), in float32) into those this
        worker pushes, or None: push them as they are (every mode but sync)."""
        return None

    def after_push(self) -> None:
        """Called once a step's push landed (``settle_every_step`` policies)."""

    def finish(self, trainer: TrainerView, clock: int, record: RunRecord) -> None:
        """Called after the last step: leave, so the others' staleness is not measured against
        a worker that is done."""
        trainer.client.clock(clock, leave=True)

    def leave(self, failed: bool) -> None:
        """Called when the trainer closes; ``failed``: it is closing on an error."""


class SSPPolicy(AsyncPolicy):
    """Stale synchronous parallel: a step waits while more than ``bound`` steps ahead of the
    slowest live worker (``before_step`` asks the client's clock with the bound) and pulls only once
    the wait is over; its push lands before the next step."""

    prefetch = False
    settle_every_step = True
    phases_shown = ("staleness_wait", "pull_wait", "compute", "push")

    def __init__(self, bound: int) -> None:
        self.bound: int | None = bound


class SyncPolicy(AsyncPolicy):
    """Synchronous: dense gradients averaged by all-reduce and stepped on every rank; row
    gradients pushed in lock step (averaged over the ranks), a barrier after each step."""

    prefetch = False
    settle_every_step = True
    dense_on_shards = False

    def __init__(self, world: int, rank: int, device: torch.device) -> None:
        self.dist = dist
        self.world = world
        self.rank = rank
        # Where collectives' tensors live: NCCL's on this rank's GPU, gloo's on the CPU.
        self.device = device
        self.params: list[nn.Parameter] = []
        self.optimizer: torch.optim.Optimizer | None = None
        self.tables: dict[str, int] = {}
        self.digests: list[str] = []
        self._prints: list[torch.Tensor] = []  # fingerprints not read yet, on the device
        # The row gradients are on the host: with NCCL they are gathered over a gloo group of the
        # same ranks instead, so no copy to the GPU and back (and no wait on it) is needed.
        self.host_group = dist.new_group(backend="gloo") if device.type == "cuda" and dist.is_initialized() else None

    @classmethod
    def join(cls, config: TrainingConfig, device: torch.device) -> tuple[TrainingConfig, torch.device, SyncPolicy]:
        """After joining the process group: the config takes its rank and world size, a CUDA
        device its local rank.

        Raises:
            UsageError: local mode, or outside torchrun (see ``init_sync``, ``sync_device``).
        """
        if config.local:
            raise UsageError("--mode sync runs ranks under torchrun against shards; local mode (no shards) trains one process: use async")
        if device.type == "cuda":
            device = sync_device(
                device, int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1)), torch.cuda.device_count()
            )
        config = init_sync(config, device)
        return config, device, cls(config.num_workers, config.worker_index, device)

    def attach(self, ps: PSModel, optimizer: OptimizerConfig) -> None:
        """The model's dense parameters, stepped on every rank by the torch form of the shards'
        rule (each rank its own copy), and its tables."""
        params = list(ps.parameters())
        self.bind(params, dense_torch_optimizer(optimizer, params) if params else None,
                  {t: bags[0].dim for t, bags in ps.bags.items()})

    def bind(self, params: list[nn.Parameter], optimizer: torch.optim.Optimizer | None, tables: dict[str, int]) -> None:
        """The dense parameters this rank all-reduces and steps, and the model's tables (name
        -> row width) whose row gradients the ranks combine."""
        self.params, self.optimizer, self.tables = params, optimizer, dict(sorted(tables.items()))

    def after_backward(self, more: bool) -> bool:
        """Average the dense gradients over the ranks and step them; the same all-reduce sums
        each rank's "I have another batch", so the ranks learn together whether all go on."""
        flag = torch.ones(1, device=self.device) if more else torch.zeros(1, device=self.device)
        if not self.params or self.optimizer is None:
            self.dist.all_reduce(flag)
            return int(flag.item()) == self.world
        flat = torch.cat([flat_grads(self.params), flag.to(self.params[0].device)])
        self.dist.all_reduce(flat)
        go_on = int(flat[-1].item()) == self.world
        flat = flat[:-1].div_(self.world)
        for p, grad in zip(self.params, split_flat(flat, self.params), strict=False):
            p.grad = grad
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return go_on

    def row_combiner(self) -> RowCombiner:
        """``row_gradients``: the ranks' row gradients combined."""
        return self.row_gradients

    def row_gradients(self, sparse: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Every rank's row gradients of the step, summed per id in rank order and averaged over
        the ranks; this rank keeps the ids it pushes (id mod world == rank). Each row then gets
        one update a step, made of the same sums in the same order on every run, whatever order
        the ranks' pushes reach the shards in: sync is reproducible run to run."""
        tables = list(self.tables)
        counts = torch.tensor([len(sparse[t][0]) if t in sparse else 0 for t in tables], dtype=torch.int64)
        every = self._gather(counts, len(tables))
        ids = torch.cat([sparse[t][0].reshape(-1) for t in tables if t in sparse] or [torch.zeros(0, dtype=torch.int64)])
        grads = torch.cat([sparse[t][1].reshape(-1).float() for t in tables if t in sparse] or [torch.zeros(0)])
        all_ids = self._gather(ids, int(every.sum(1).max()))
        widths = torch.tensor([self.tables[t] for t in tables], dtype=torch.int64)
        all_grads = self._gather(grads, int((every * widths).sum(1).max()))
        parts: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {t: ([], []) for t in tables}
        for r in range(self.world):
            id_at = grad_at = 0
            for t, n, width in zip(tables, every[r].tolist(), widths.tolist(), strict=False):
                parts[t][0].append(all_ids[r, id_at:id_at + n])
                parts[t][1].append(all_grads[r, grad_at:grad_at + n * width].view(n, width))
                id_at, grad_at = id_at + n, grad_at + n * width
        mine = {}
        for t, (id_parts, grad_parts) in parts.items():
            unique, inverse = torch.unique(torch.cat(id_parts), return_inverse=True)
            if not len(unique):
                continue
            # index_add_ on the CPU adds in index order: the same sum on every run.
            summed = torch.zeros(len(unique), self.tables[t]).index_add_(0, inverse, torch.cat(grad_parts)).div_(self.world)
            keep = torch.remainder(unique, self.world) == self.rank
            mine[t] = (unique[keep], summed[keep])
        return mine

    def _gather(self, t: torch.Tensor, length: int) -> torch.Tensor:
        """Every rank's ``t`` (1-D, at most ``length`` long), zero-padded to ``length``: [world, length] on the CPU."""
        padded = torch.zeros(length, dtype=t.dtype)
        padded[: len(t)] = t.cpu()
        out = [torch.empty_like(padded) for _ in range(self.world)]
        if self.host_group is not None:
            self.dist.all_gather(out, padded, group=self.host_group)
        else:
            self.dist.all_gather(out, padded)
        return torch.stack(out)

    def after_push(self) -> None:
        """The barrier, and this step's digest of the dense parameters: on a GPU a fingerprint
        computed there and read only at the end (reading it every step would wait for the GPU)."""
        self.dist.barrier()
        if not self.params or self.params[0].device.type == "cpu":
            self.digests.append(self.digest())
            return
        self._prints.append(_fingerprint(self.params))
        if len(self._prints) >= 1024:
            self._prints = [torch.cat([t.reshape(-1) for t in self._prints])]

    def digest(self) -> str:
        """Short hash of the dense parameters (identical on every rank after every step), 16 hex
        digits: SHA-1 of their bytes on the CPU, ``_fingerprint`` on a GPU (reading it there
        waits for the device)."""
        if not self.params:
            return ""
        if self.params[0].device.type != "cpu":
            return _hex(_fingerprint(self.params))[0]
        data = torch.cat([p.detach().reshape(-1).cpu() for p in self.params]).numpy().tobytes()
        return hashlib.sha1(data).hexdigest()[:16]

    def _read_digests(self) -> list[str]:
        """Every step's fingerprint so far, as ``digest`` writes it (one read of the device)."""
        if self._prints:
            self.digests.extend(_hex(torch.cat([t.reshape(-1) for t in self._prints])))
            self._prints = []
        return self.digests

    def finish(self, trainer: TrainerView, clock: int, record: RunRecord) -> None:
        super().finish(trainer, clock, record)
        record.dense_digests = self._read_digests()
        record.backend = str(self.dist.get_backend())

    def leave(self, failed: bool) -> None:
        """Leave the process group: after a barrier when the job ends well; at once when this
        rank failed (the others, inside a step, would never meet the barrier: torchrun stops
        them once this process exits)."""
        if not self.dist.is_initialized():
            return
        if failed:
            return
        self.dist.barrier()
        self.dist.destroy_process_group()


def restart_count(environ: Mapping[str, str] = os.environ) -> int:
    """How many times this worker was restarted into its job: ``TETHER_RESTART_COUNT``, which
    ``tether launch --max-restarts`` sets; else, with ``TETHER_RESTART_FILE`` (the Kubernetes
    manifests set it to a file on the pod's ``emptyDir``, which outlives a container that
    Kubernetes restarts in place), how many earlier incarnations got past the start barrier, as
    that file counts them (``note_started``); else 0.

    Raises:
        UsageError: a variable, or the file, that does not hold an integer >= 0.
    """
    text = environ.get("TETHER_RESTART_COUNT", "").strip()
    if text:
        if not text.isdigit():
            raise UsageError(f"TETHER_RESTART_COUNT={text!r}: expected an integer >= 0 (the launcher's count of this worker's restarts)")
        return int(text)
    path = environ.get(RESTART_FILE_ENV, "").strip()
    return _started_before(Path(path)) if path else 0


# The variable naming the file that counts a worker's incarnations that got past the start barrier.
RESTART_FILE_ENV = "TETHER_RESTART_FILE"


def _started_before(path: Path) -> int:
    """The count in ``path`` (0 when there is no file yet).

    Raises:
        UsageError: the file holds something else.
    """
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return 0
    except OSError as exc:
        raise UsageError(f"{RESTART_FILE_ENV}={path}: cannot be read ({exc.strerror or exc})") from None
    if not text.isdigit():
        raise UsageError(f"{RESTART_FILE_ENV}={path}: holds {text[:40]!r}, expected the count of this worker's earlier starts")
    return int(text)


def note_started(environ: Mapping[str, str] = os.environ) -> None:
    """Count this incarnation in ``TETHER_RESTART_FILE``, when set (and ``TETHER_RESTART_COUNT``
    is not): it got past the start barrier, so the next incarnation in this pod joins a job under
    way and does not wait for every worker again. Written whole (a temporary file renamed); a
    file that cannot be written is said once in the log and the worker goes on (a restart then
    relies on the other workers' clocks, as without the file)."""
    if environ.get("TETHER_RESTART_COUNT", "").strip():
        return
    text = environ.get(RESTART_FILE_ENV, "").strip()
    if not text:
        return
    path = Path(text)
    try:
        count = _started_before(path) + 1
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(f"{count}\n")
        os.replace(tmp, path)
    except (OSError, UsageError) as exc:
        log.warning("%s=%s: cannot count this start (%s); a restart will wait for the other workers unless their clocks show "
                    "the job under way", RESTART_FILE_ENV, path, exc)


def _fingerprint(params: list[nn.Parameter]) -> torch.Tensor:
    """A 0-dim int64 of the parameters' bits, computed on their device without reading them.

    The sum over every element of (its bit pattern as 32-, 16- or 8-bit integers) x (an odd
    weight, 2i + 1 for position i), each product taken mod 2^32: one changed or two swapped
    elements always change it, and integer sums are exact, so it is the same on every rank
    and run, whatever order the device adds in.
    """
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    size = flat.element_size()
    bits = flat.view(torch.uint8 if size == 1 else torch.int16 if size == 2 else torch.int32)
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    step = 1 << 22  # elements at a time: the int64 temporaries stay small beside the model
    for at in range(0, bits.numel(), step):
        part = bits[at : at + step].to(torch.int64)
        weights = torch.arange(2 * at + 1, 2 * (at + part.numel()) + 1, 2, dtype=torch.int64, device=flat.device)
        total += part.mul_(weights).bitwise_and_(0xFFFFFFFF).sum()
    return total


def _hex(prints: torch.Tensor) -> list[str]:
    """Fingerprints as 16 hex digits each."""
    return [f"{v & 0xFFFFFFFFFFFFFFFF:016x}" for v in prints.reshape(-1).tolist()]


def init_sync(cfg: TrainingConfig, device: torch.device) -> TrainingConfig:
    """Join the torchrun process group (NCCL when every rank has CUDA, else gloo), unless the
    caller already did; the config takes its rank and world size."""
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            raise UsageError(
                "--mode sync: the ranks run under torchrun, which sets RANK and WORLD_SIZE: start them with "
                "'torchrun --nproc-per-node N -m tether.worker --mode sync ...', or use 'tether launch --mode sync'"
            )
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=max(cfg.timeout_s * 4, 60)))
    return replace(cfg, worker_index=dist.get_rank(), num_workers=dist.get_world_size())


def sync_device(device: torch.device, local_rank: int, local_world: int, gpus: int) -> torch.device:
    """The GPU of sync rank ``local_rank`` of ``local_world`` on a host with ``gpus``: its own,
    ``cuda:<local_rank>`` (NCCL allows one rank per GPU).

    Raises:
        UsageError: more ranks on the host than GPUs, or one ``cuda:N`` for several ranks.
    """
    if local_world > gpus:
        raise UsageError(
            f"--mode sync: {local_world} ranks on this host need {local_world} GPUs (NCCL takes one rank per GPU), torch sees {gpus}: "
            f"run at most {gpus} ranks per host, or --device cpu (gloo)"
        )
    if device.index is not None and local_world > 1:
        raise UsageError(
            f"--device {device}: in sync every rank on this host would use that one GPU; use --device cuda (rank r gets cuda:r)"
        )
    return device if device.index is not None else torch.device("cuda", local_rank)


def policy_class(kind: str) -> type[AsyncPolicy]:
    """The policy of a mode's kind (``async``, ``ssp`` or ``sync``: ``Mode.kind``); its class
    attributes say what the mode does (``dense_on_shards``, ``prefetch``, ...)."""
    return _POLICIES[kind]


_POLICIES: dict[str, type[AsyncPolicy]] = {"async": AsyncPolicy, "ssp": SSPPolicy, "sync": SyncPolicy}


def policy_for(config: TrainingConfig, device: torch.device) -> tuple[TrainingConfig, torch.device, AsyncPolicy]:
    """The policy of ``config``'s mode, built from its parsed ``Mode``: ``SSPPolicy(bound)`` for
    ``ssp:S``; in sync after joining the process group (the config then takes its rank and world
    size, a CUDA device its local rank). Returns the config and device it trains with, and the policy."""
    mode = config.mode
    if mode.kind == "sync":
        return SyncPolicy.join(config, device)
    return config, device, AsyncPolicy() if mode.bound is None else SSPPolicy(mode.bound)
