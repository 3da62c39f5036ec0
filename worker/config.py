"""Configuration of one worker process: the training job's, the built-in model's and the client's
(frozen dataclasses, validated in ``__post_init__``; ``tether.worker.flags`` loads them)."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from tether.protos.codec import WIRE_DTYPES
from tether.protos.dataplane import TRANSPORTS
from tether.protos.security import ClientSecurity
from tether.protos.specs import OPTIMIZERS
from tether.worker.stragglers import StragglerSpec, parse_straggler

__all__ = ["MODEL_PRESETS", "ClientConfig", "TrainingConfig", "WorkerConfig", "parse_mode"]


def _names(names: Iterable[str]) -> str:
    """``a, b or c``."""
    *first, last = list(names)
    return f"{', '.join(first)} or {last}"


def parse_mode(mode: str) -> tuple[str, int | None]:
    """Split a consistency mode into its kind and bound: ``async``, ``ssp:S`` or ``sync``.

    Raises:
        ValueError: anything else, or a negative S.
    """
    if mode in ("async", "sync"):
        return mode, None
    kind, _, bound = mode.partition(":")
    if kind == "ssp" and bound.isdigit():
        return "ssp", int(bound)
    raise ValueError(f"mode must be 'async', 'ssp:S' (S >= 0) or 'sync', got {mode!r}")


def _check_address(address: str) -> None:
    """A shard address is ``host:port`` (``[v6]:port`` too) with a port in [0, 65535].

    Raises:
        ValueError: anything else, naming the address.
    """
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"--shards: shard address must be host:port (port in [0, 65535]), got {address!r}")


def _check_data_file(data: str) -> None:
    """``criteo:PATH|GLOB|A,B`` names readable files (checked here, before any process starts).

    Raises:
        ValueError: no path, nothing matches, not a file, or not readable.
    """
    from tether.worker.criteo import criteo_files

    path = data.split(":", 1)[1]
    if not path:
        raise ValueError(f"--data {data}: no path after 'criteo:'")
    try:
        files = criteo_files(path)
    except ValueError as exc:
        raise ValueError(f"--data {data}: {exc}") from None
    for f in files:
        if not os.access(f, os.R_OK):
            raise ValueError(f"--data {data}: {f} is not readable")


def _check_parquet_data(data: str, num_workers: int) -> None:
    """``parquet:PATH|GLOB|DIR|A,B`` names Parquet files the built-in CTR job can read: every
    file's schema is read here, before any process starts (a ``label``, float dense columns,
    integer or string id columns, the same in every file), and there are row groups enough for
    ``num_workers`` workers.

    Raises:
        ValueError: one line naming the file and the column (or what else is wrong).
    """
    from tether.worker.parquet import check_parquet

    path = data.split(":", 1)[1]
    if not path:
        raise ValueError(f"--data {data}: no path after 'parquet:'")
    try:
        check_parquet(path, world_size=num_workers)
    except ValueError as exc:
        raise ValueError(f"--data {data}: {exc}") from None


@dataclass(frozen=True)
class TrainingConfig:
    """One worker of a training job, whatever the model: where the shards are, which worker
    this is, the consistency mode, the schedule and the connection. ``Trainer`` takes it;
    ``WorkerConfig`` adds the built-in CTR model and its data."""

    shards: tuple[str, ...]
    worker_index: int = 0
    num_workers: int = 1
    # async, ssp:S or sync (see parse_mode).
    mode: str = "async"
    # Stop after this many steps (None: when the data ends).
    steps: int | None = None
    # The shards' update rule for rows and (outside sync) dense parameters; sync steps dense
    # parameters with the matching torch optimizer.
    optimizer: str = "adagrad"
    lr: float = 0.05
    # New rows start uniform in [-init_scale, init_scale] (seeded by id and seed).
    init_scale: float = 0.05
    seed: int = 0
    # Worker 0 evaluates every N steps (0: only after the last step).
    eval_every: int = 0
    log_every: int = 50
    # Worker 0 asks every shard for a checkpoint every N steps (0: never; shards also
    # checkpoint on their own with --checkpoint-every seconds).
    checkpoint_every_steps: int = 0
    device: str = "auto"
    prefetch: bool = True
    staleness_aware: bool = False
    out: str | None = None
    # Write TensorBoard scalars (loss, eval metrics, samples/s, staleness) to <tensorboard>/worker-<index>.
    tensorboard: str | None = None
    # How this worker names itself to the shards (default worker-<index>).
    worker_id: str | None = None
    timeout_s: float = 30.0
    # The longest one push, pull or declare takes, retries included (ClientConfig.call_deadline_s).
    call_deadline_s: float = 60.0
    ssp_timeout_s: float = 300.0
    wire_dtype: str = "float32"
    # Push/pull transport (tether.worker.client.ClientConfig.transport): auto, tcp or grpc.
    transport: str = "auto"
    slowdown: float = 1.0
    slow_worker: int | None = None
    # Straggler experiments (tether.worker.stragglers): persistent:K[:W], transient:P:K,
    # pareto:A[:CAP] or none; empty: ``slowdown`` / ``slow_worker`` decide.
    straggler: str = ""
    # Transport security (see tether.protos.security): TLS files, and the bearer token with
    # the file it came from (None: from $TETHER_AUTH_TOKEN, which child processes inherit).
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    auth_token_file: str | None = None
    auth_token: str | None = field(default=None, repr=False)
    # Local mode: no shards; the tables live in this process with the shards' update rules
    # (the one-process baseline, and unit tests of a model without a cluster).
    local: bool = False

    @classmethod
    def from_env(cls, **overrides: object) -> TrainingConfig:
        """The config the ``TETHER_*`` environment describes (what ``tether launch`` and the
        Kubernetes manifests give a worker; ``tether worker --help`` lists the variables),
        with ``overrides`` winning. Under torchrun in sync mode the rank and world size come
        from ``RANK`` and ``WORLD_SIZE``.

        Raises:
            ValueError: a bad value, named.
        """
        # flags builds configs from parsed flags, so it is imported here, not at the top.
        from tether.worker.flags import add_connection_flags, add_job_flags, training_values

        p = argparse.ArgumentParser(add_help=False)
        add_connection_flags(p)
        add_job_flags(p, default_steps=None)
        values = training_values(p.parse_args([]))
        values.update(overrides)
        if parse_mode(str(values["mode"]))[0] == "sync" and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            # A torchrun rank knows its place from torchrun before any process group exists, so
            # code that runs before the Trainer (picking its slice of the data) sees it too.
            if "worker_index" not in overrides:
                values["worker_index"] = int(os.environ["RANK"])
            if "num_workers" not in overrides:
                values["num_workers"] = int(os.environ["WORLD_SIZE"])
        return cls(**values)

    @property
    def security(self) -> ClientSecurity:
        """How this worker's client authenticates to the shards."""
        return ClientSecurity(tls_ca=self.tls_ca, tls_cert=self.tls_cert, tls_key=self.tls_key, token=self.auth_token)

    @property
    def my_slowdown(self) -> float:
        """This worker's slowdown factor (1 unless it is the straggler)."""
        if self.slow_worker is None or self.slow_worker == self.worker_index:
            return self.slowdown
        return 1.0

    @property
    def straggler_spec(self) -> StragglerSpec:
        """Who computes slower when (``straggler``, or else ``slowdown`` on ``slow_worker``,
        every worker given it when ``slow_worker`` is None)."""
        if self.straggler:
            return parse_straggler(self.straggler)
        if self.slowdown > 1.0:
            return StragglerSpec("persistent", factor=self.slowdown, worker=self.worker_index if self.slow_worker is None else self.slow_worker)
        return StragglerSpec()

    @property
    def wait_s(self) -> float:
        """Longest a step waits on a push or pull: the client ends each call by its deadline,
        this only bounds the wait should it not."""
        return self.call_deadline_s + self.timeout_s

    @property
    def consistency(self) -> tuple[str, int | None]:
        """``(kind, bound)`` of ``mode``."""
        return parse_mode(self.mode)

    def __post_init__(self) -> None:
        parse_mode(self.mode)
        if not self.slowdown >= 1.0:
            raise ValueError(f"slowdown must be >= 1 (1 = full speed), got {self.slowdown!r}")
        parse_straggler(self.straggler)
        if not self.ssp_timeout_s > 0:
            raise ValueError(f"ssp_timeout_s must be > 0, got {self.ssp_timeout_s!r}")
        if self.local and self.shards:
            raise ValueError(f"local mode trains in this process: give no shards (got {','.join(self.shards)})")
        if not self.shards and not self.local:
            raise ValueError(
                "no shards: set TETHER_SHARDS=host:port,... (flag --shards), or TETHER_LOCAL=1 (flag --local, "
                "TrainingConfig(local=True)) to train in this process without shards"
            )
        for address in self.shards:
            _check_address(address)
        if self.num_workers < 1 or not 0 <= self.worker_index < self.num_workers:
            raise ValueError(f"worker_index must be in [0, num_workers={self.num_workers}), got {self.worker_index!r}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be >= 1 (or None: until the data ends), got {self.steps!r}")
        if self.log_every < 1:
            raise ValueError(f"log_every must be >= 1, got {self.log_every!r}")
        if self.eval_every < 0 or self.checkpoint_every_steps < 0:
            raise ValueError(f"eval_every and checkpoint_every_steps must be >= 0, got {self.eval_every!r}, {self.checkpoint_every_steps!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr!r}")
        if not 0 <= self.init_scale < math.inf:
            raise ValueError(f"init_scale must be a finite number >= 0, got {self.init_scale!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.tensorboard is not None and not self.tensorboard:
            raise ValueError("tensorboard must name a directory (None: no TensorBoard), got ''")
        if self.worker_id is not None and not self.worker_id:
            raise ValueError("worker_id must not be empty (None: worker-<index>)")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")
        if not 0 < self.call_deadline_s < math.inf:
            raise ValueError(f"call_deadline_s (--call-deadline) must be a finite number of seconds > 0, got {self.call_deadline_s!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be {_names(TRANSPORTS)}, got {self.transport!r}")
        if self.wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"wire_dtype must be {_names(WIRE_DTYPES)}, got {self.wire_dtype!r}")
        self.security  # noqa: B018 - validates the TLS and token fields together


@dataclass(frozen=True)
class WorkerConfig(TrainingConfig):
    """``tether worker``: a ``TrainingConfig`` for the built-in CTR model and its data."""

    steps: int = 2000
    batch_size: int = 256
    data: str = "synthetic"
    vocab_size: int = 100_000
    num_sparse: int = 8
    embedding_dim: int = 16
    eval_samples: int = 20_000
    metrics_port: int | None = None
    # Order of the synthetic training batches (0: the seed's own order; compare --repeats
    # varies it while the model, the data distribution and the held-out set stay the same).
    data_seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("batch_size", "vocab_size", "num_sparse", "embedding_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.eval_samples < 0:
            raise ValueError(f"eval_samples must be >= 0, got {self.eval_samples!r}")
        if self.data != "synthetic" and not self.data.startswith(("criteo:", "parquet:")):
            raise ValueError(f"data must be 'synthetic', 'criteo:PATH' or 'parquet:PATH', got {self.data!r}")
        if self.data.startswith("criteo:"):
            _check_data_file(self.data)
        if self.data.startswith("parquet:"):
            _check_parquet_data(self.data, self.num_workers)


# Sizes of the built-in model by name (``--preset``); a flag given for one of these fields wins.
MODEL_PRESETS: dict[str, dict[str, int]] = {
    "default": {"batch_size": WorkerConfig.batch_size, "num_sparse": WorkerConfig.num_sparse, "embedding_dim": WorkerConfig.embedding_dim},
    "gpu": {"batch_size": 8192, "num_sparse": 26, "embedding_dim": 128},
}


@dataclass(frozen=True)
class ClientConfig:
    """Where the shards are and how to call them."""

    addresses: tuple[str, ...]
    worker_id: str
    # Deadline of one attempt (one RPC or data-plane round trip).
    timeout_s: float = 30.0
    retries: int = 8
    backoff_s: float = 0.05
    max_backoff_s: float = 2.0
    max_message_bytes: int = 256 * 1024 * 1024
    chunk_elems: int = 1 << 20
    wire_dtype: torch.dtype = torch.float32
    threads: int = 8
    staleness_aware: bool = False
    security: ClientSecurity = field(default_factory=ClientSecurity)
    # HTTP/2 keepalive: a connection that stops answering pings this long plus a bit is
    # given up, so a partition or a dead shard is noticed without waiting for TCP.
    keepalive_s: float = 10.0
    # How Push/Pull/PushPull travel: "auto" uses the shard's data plane, with shared memory
    # when the shard is on this machine; "tcp" the data plane without shared memory; "grpc"
    # everything over gRPC. With TLS the data plane's TCP connections run inside TLS too.
    transport: str = "auto"
    # The longest one call takes, every attempt, backoff and data-plane fallback included; then
    # it raises Unavailable. Each attempt gets min(timeout_s, what is left). Checkpoint calls
    # and SSP waits have their own limits (see ``checkpoint`` and ``clock``).
    call_deadline_s: float = 60.0

    def __post_init__(self) -> None:
        if not self.addresses:
            raise ValueError("at least one shard address is needed")
        for a in self.addresses:
            if ":" not in a:
                raise ValueError(f"shard address must be host:port, got {a!r}")
        if not self.worker_id:
            raise ValueError("worker_id must not be empty")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries!r}")
        if self.chunk_elems < 1:
            raise ValueError(f"chunk_elems must be >= 1, got {self.chunk_elems!r}")
        if self.wire_dtype not in WIRE_DTYPES.values():
            raise ValueError(f"wire_dtype must be {_names(WIRE_DTYPES)}, got {self.wire_dtype}")
        if not isinstance(self.security, ClientSecurity):
            raise ValueError(f"security must be a ClientSecurity, got {type(self.security).__name__}")
        if not self.keepalive_s > 0:
            raise ValueError(f"keepalive_s must be > 0, got {self.keepalive_s!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}")
        if not 0 < self.backoff_s <= self.max_backoff_s:
            raise ValueError(f"need 0 < backoff_s <= max_backoff_s, got {self.backoff_s!r}, {self.max_backoff_s!r}")
        if not (isinstance(self.call_deadline_s, (int, float)) and 0 < self.call_deadline_s < math.inf):
            raise ValueError(f"call_deadline_s must be a finite number of seconds > 0, got {self.call_deadline_s!r}")
