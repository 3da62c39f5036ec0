"""What each consistency mode adds to the training loop: a small policy per mode (async, ssp:S,
sync), and for sync the torchrun process group and the dense step on every rank."""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import replace
from datetime import timedelta
from typing import Protocol

import torch
from torch import nn

from tether.protos.errors import DeadlineExceeded, UsageError
from tether.worker.client import PSClient
from tether.worker.config import TrainingConfig
from tether.worker.embedding import flat_grads, split_flat

__all__ = ["Policy", "SSPPolicy", "SyncPolicy", "TrainerView", "init_sync", "policy_for"]


class TrainerView(Protocol):
    """What a policy sees of the trainer it runs in."""

    @property
    def config(self) -> TrainingConfig: ...

    @property
    def client(self) -> PSClient: ...

    @property
    def name(self) -> str: ...


class Policy:
    """Asynchronous (ASP): never wait; one push_pull per step once the loop is under way."""

    prefetch = True  # the next batch's rows may be pulled before this step's push lands
    settle_every_step = False
    sparse_scale = 1.0
    dense_on_shards = True

    def start(self, trainer: TrainerView) -> int:
        """Join, then wait (bounded) until every worker of the job has: the workers of a run
        start training together, in every mode, so that start-up is not counted as staleness
        and no one runs ahead of a worker that has not started yet. A worker restarted into a
        running job starts at the slowest other worker's clock rather than at 0. Returns the
        clock this worker starts from."""
        cfg = trainer.config
        deadline = time.monotonic() + cfg.ssp_timeout_s
        while True:
            reply = trainer.client.clock(0)
            if reply.live_workers >= cfg.num_workers:
                return reply.min_other_clock
            if time.monotonic() > deadline:
                raise DeadlineExceeded(f"only {reply.live_workers} of {cfg.num_workers} workers joined within {cfg.ssp_timeout_s:.0f}s")
            time.sleep(0.05)

    def before_step(self, trainer: TrainerView, clock: int) -> None:
        """Called before a step pulls its rows."""

    def after_backward(self) -> None:
        """Called once the gradients are in."""

    def after_push(self) -> None:
        """Called once a step's push landed (``settle_every_step`` policies)."""

    def finish(self, trainer: TrainerView, clock: int, record: dict[str, object]) -> None:
        """Called after the last step: leave, so the others' staleness is not measured against
        a worker that is done."""
        trainer.client.clock(clock, leave=True)


class SSPPolicy(Policy):
    """Stale synchronous parallel: wait while more than ``bound`` steps ahead of the slowest
    live worker; pull only once the wait is over; a step's push lands before the next step."""

    prefetch = False
    settle_every_step = True

    def __init__(self, bound: int) -> None:
        self.bound = bound

    def before_step(self, trainer: TrainerView, clock: int) -> None:
        cfg = trainer.config
        reply = trainer.client.clock(clock, wait_bound=self.bound, timeout_s=cfg.ssp_timeout_s)
        if not reply.ready:
            raise DeadlineExceeded(
                f"{trainer.name} waited {cfg.ssp_timeout_s:.0f}s at clock {clock} for the slowest live worker "
                f"(clock {reply.min_clock}, bound {self.bound})"
            )


class SyncPolicy(Policy):
    """Synchronous: dense gradients averaged by all-reduce and stepped on every rank; row
    gradients pushed in lock step (averaged over the ranks), a barrier after each step."""

    prefetch = False
    settle_every_step = True
    dense_on_shards = False

    def __init__(self, world: int) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.world = world
        self.sparse_scale = 1.0 / world
        self.params: list[nn.Parameter] = []
        self.optimizer: torch.optim.Optimizer | None = None
        self.digests: list[str] = []

    def bind(self, params: list[nn.Parameter], optimizer: torch.optim.Optimizer | None) -> None:
        """The dense parameters this rank all-reduces and steps."""
        self.params, self.optimizer = params, optimizer

    def after_backward(self) -> None:
        if not self.params or self.optimizer is None:
            return
        flat = flat_grads(self.params)
        self.dist.all_reduce(flat)
        flat /= self.world
        for p, grad in zip(self.params, split_flat(flat, self.params)):
            p.grad = grad
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def after_push(self) -> None:
        self.dist.barrier()
        self.digests.append(self.digest())

    def digest(self) -> str:
        """Short hash of the dense parameters (identical on every rank after every step)."""
        if not self.params:
            return ""
        data = torch.cat([p.detach().reshape(-1).cpu() for p in self.params]).numpy().tobytes()
        return hashlib.sha1(data).hexdigest()[:16]

    def finish(self, trainer: TrainerView, clock: int, record: dict[str, object]) -> None:
        super().finish(trainer, clock, record)
        record["dense_digests"] = self.digests
        record["backend"] = self.dist.get_backend()


def init_sync(cfg: TrainingConfig, device: torch.device) -> TrainingConfig:
    """Join the torchrun process group (NCCL when every rank has CUDA, else gloo), unless the
    caller already did; the config takes its rank and world size."""
    import torch.distributed as dist

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


def policy_for(config: TrainingConfig, device: torch.device) -> tuple[TrainingConfig, torch.device, Policy]:
    """The policy of ``config``'s consistency mode; in sync mode, after joining the process group
    (the config then takes its rank and world size, a CUDA device its local rank)."""
    kind, bound = config.consistency
    if kind == "sync":
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        config = init_sync(config, device)
        return config, device, SyncPolicy(config.num_workers)
    if kind == "ssp":
        return config, device, SSPPolicy(int(bound or 0))
    return config, device, Policy()
