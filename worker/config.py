"""Configuration of one worker process: one frozen dataclass, loaded in one place."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from tether.protos.flags import HelpFormatter
from tether.protos.security import TOKEN_ENV, ClientSecurity, resolve_token
from tether.protos.specs import OPTIMIZERS
from tether.worker.stragglers import StragglerSpec, parse_straggler

__all__ = [
    "TrainingConfig",
    "WorkerConfig",
    "add_connection_flags",
    "add_job_flags",
    "add_model_flags",
    "add_training_flags",
    "build_parser",
    "config_from_args",
    "load_config",
    "parse_mode",
    "training_values",
]


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
    from tether.worker.data import criteo_files

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

    @classmethod
    def from_env(cls, **overrides: object) -> TrainingConfig:
        """The config the ``TETHER_*`` environment describes (what ``tether launch`` and the
        Kubernetes manifests give a worker; ``tether worker --help`` lists the variables),
        with ``overrides`` winning.

        Raises:
            ValueError: a bad value, named.
        """
        p = argparse.ArgumentParser(add_help=False)
        add_connection_flags(p)
        add_job_flags(p, default_steps=None)
        values = training_values(p.parse_args([]))
        values.update(overrides)
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
        if not self.shards:
            raise ValueError("at least one shard address is needed (--shards host:port,...)")
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
        if self.transport not in ("auto", "tcp", "grpc"):
            raise ValueError(f"transport must be auto, tcp or grpc, got {self.transport!r}")
        if self.wire_dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"wire_dtype must be float32, float16 or bfloat16, got {self.wire_dtype!r}")
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
        if self.data != "synthetic" and not self.data.startswith("criteo:"):
            raise ValueError(f"data must be 'synthetic' or 'criteo:PATH', got {self.data!r}")
        if self.data.startswith("criteo:"):
            _check_data_file(self.data)


# Sizes of the built-in model by name (``--preset``); a flag given for one of these fields wins.
MODEL_PRESETS: dict[str, dict[str, int]] = {
    "default": {"batch_size": WorkerConfig.batch_size, "num_sparse": WorkerConfig.num_sparse, "embedding_dim": WorkerConfig.embedding_dim},
    "gpu": {"batch_size": 8192, "num_sparse": 26, "embedding_dim": 128},
}


def _env(name: str, default: object) -> object:
    return os.environ.get(name, default)


def _optional_int(value: object) -> int | None:
    return None if value in (None, "") else int(value)


def add_job_flags(p: argparse.ArgumentParser, default_steps: int | None = 2000, mode: bool = True) -> None:
    """Flags of any training job (``TrainingConfig``), each with a ``TETHER_*`` fallback.

    Args:
        mode: add ``--mode`` (commands that run several modes leave it out).
    """
    p.add_argument("--steps", type=_optional_int, default=_env("TETHER_STEPS", default_steps),
                   help="training steps per worker" + ("" if default_steps else "; empty: until the data ends") + " (env TETHER_STEPS)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=_env("TETHER_OPTIMIZER", "adagrad"), help="server-side update rule (env TETHER_OPTIMIZER)")
    p.add_argument("--lr", type=float, default=_env("TETHER_LR", 0.05), help="learning rate (env TETHER_LR)")
    p.add_argument("--init-scale", type=float, default=_env("TETHER_INIT_SCALE", 0.05), help="new rows start uniform in [-S, S] (env TETHER_INIT_SCALE)")
    p.add_argument("--seed", type=int, default=_env("TETHER_SEED", 0), help="seed of the model, the rows and the data (env TETHER_SEED)")
    p.add_argument("--eval-every", type=int, default=_env("TETHER_EVAL_EVERY", 0), help="worker 0 evaluates every N steps (0: only at the end) (env TETHER_EVAL_EVERY)")
    p.add_argument("--checkpoint-every-steps", type=int, default=_env("TETHER_CHECKPOINT_EVERY_STEPS", 0),
                   help="worker 0 asks every shard for a checkpoint every N steps (0: never) (env TETHER_CHECKPOINT_EVERY_STEPS)")
    p.add_argument("--device", default=_env("TETHER_DEVICE", "auto"), help="auto (CUDA when present), cpu, cuda[:N] (env TETHER_DEVICE)")
    p.add_argument("--no-prefetch", action="store_true", default=_env("TETHER_NO_PREFETCH", "") not in ("", "0"),
                   help="pull each batch after the previous push has landed instead of during compute (env TETHER_NO_PREFETCH=1)")
    p.add_argument("--log-every", type=int, default=_env("TETHER_LOG_EVERY", 50), help="print progress every N steps (env TETHER_LOG_EVERY)")
    p.add_argument("--timeout", type=float, metavar="SECONDS", default=_env("TETHER_TIMEOUT", 30.0), help="deadline of each RPC attempt, seconds (env TETHER_TIMEOUT)")
    p.add_argument(
        "--call-deadline", type=float, metavar="SECONDS", default=_env("TETHER_CALL_DEADLINE", 60.0),
        help="longest one push, pull or declare takes, every retry included: each attempt gets at most what is left of it, "
        "and when it is spent (a shard that is down or stopped) the worker fails with Unavailable; seconds "
        "(env TETHER_CALL_DEADLINE). SSP waits are bounded by --ssp-timeout instead",
    )
    if mode:
        p.add_argument("--mode", default=_env("TETHER_MODE", "async"), help="consistency: async, ssp:S (at most S steps ahead of the slowest live worker) or sync (all-reduce; start with torchrun) (env TETHER_MODE)")
    p.add_argument("--staleness-aware", action="store_true", default=_env("TETHER_STALENESS_AWARE", "") not in ("", "0"),
                   help="damp rows and dense chunks staler than usual: step x typical/staleness (Zhang et al. 2016, relative to the running mean) (env TETHER_STALENESS_AWARE=1)")
    p.add_argument("--straggler", default=_env("TETHER_STRAGGLER", ""),
                   help="straggler experiments: persistent:K[:WORKER] (the last worker, or WORKER, K times slower), transient:P:K "
                   "(each step, each worker K times slower with probability P), pareto:A[:CAP] (heavy-tailed factors) or none; "
                   "seeded by --seed, so every mode sees the same delays (env TETHER_STRAGGLER)")
    p.add_argument("--ssp-timeout", type=float, metavar="SECONDS", default=_env("TETHER_SSP_TIMEOUT", 300.0), help="longest wait on the staleness bound before failing, seconds (env TETHER_SSP_TIMEOUT)")
    p.add_argument("--transport", choices=("auto", "tcp", "grpc"), default=_env("TETHER_TRANSPORT", "auto"), help="push/pull over the shards' data plane (auto: shared memory on the same machine, else TCP; tcp: never shared memory) or grpc only (env TETHER_TRANSPORT)")
    p.add_argument("--wire-dtype", choices=("float32", "float16", "bfloat16"), default=_env("TETHER_WIRE_DTYPE", "float32"), help="element type of parameters and gradients on the wire (env TETHER_WIRE_DTYPE)")
    p.add_argument("--tensorboard", metavar="DIR", default=_env("TETHER_TENSORBOARD", None),
                   help="write TensorBoard scalars (train loss, eval metrics, samples/s, clock staleness) per logged step to DIR/worker-<index>; "
                   "needs the tensorboard package: pip install 'tether[tensorboard]' (env TETHER_TENSORBOARD)")


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """Flags of the built-in CTR model and its data (``WorkerConfig``)."""
    p.add_argument("--preset", choices=tuple(MODEL_PRESETS), default=_env("TETHER_PRESET", "default"),
                   help="model and batch size: default (batch 256, 8 fields, 16-wide rows: CPU-sized) or gpu (batch 8,192, "
                   "26 fields as in Criteo, 128-wide rows: a CUDA step not bound by kernel launches); --batch-size, "
                   "--num-sparse and --embedding-dim override it (env TETHER_PRESET)")
    p.add_argument("--batch-size", type=int, default=_env("TETHER_BATCH_SIZE", None), help="samples per step (default: the preset's) (env TETHER_BATCH_SIZE)")
    p.add_argument("--data", default=_env("TETHER_DATA", "synthetic"), help="'synthetic' or 'criteo:PATH' to a Criteo TSV file (env TETHER_DATA)")
    p.add_argument("--vocab-size", type=int, default=_env("TETHER_VOCAB_SIZE", 100_000), help="synthetic data: ids per field (env TETHER_VOCAB_SIZE)")
    p.add_argument("--num-sparse", type=int, default=_env("TETHER_NUM_SPARSE", None), help="synthetic data: categorical fields (default: the preset's) (env TETHER_NUM_SPARSE)")
    p.add_argument("--embedding-dim", type=int, default=_env("TETHER_EMBEDDING_DIM", None), help="width of every embedding row (default: the preset's) (env TETHER_EMBEDDING_DIM)")
    p.add_argument("--eval-samples", type=int, default=_env("TETHER_EVAL_SAMPLES", 20_000), help="held-out samples (env TETHER_EVAL_SAMPLES)")
    p.add_argument("--data-seed", type=int, default=_env("TETHER_DATA_SEED", 0), help="synthetic data: order of the training batches (0: the seed's own) (env TETHER_DATA_SEED)")


def add_training_flags(p: argparse.ArgumentParser, mode: bool = True) -> None:
    """Flags that describe a job of the built-in model (shared by ``tether worker``, ``launch``,
    ``compare`` and ``sweep``; ``mode=False`` leaves ``--mode`` out)."""
    add_job_flags(p, mode=mode)
    add_model_flags(p)


def add_connection_flags(p: argparse.ArgumentParser) -> None:
    """Flags that place one worker in a job: the shards, its index, security, output."""
    p.add_argument("--shards", default=_env("TETHER_SHARDS", ""), help="comma-separated host:port of every shard, in shard order (env TETHER_SHARDS)")
    p.add_argument("--worker-index", type=int, default=_env("TETHER_WORKER_INDEX", _env("JOB_COMPLETION_INDEX", 0)), help="this worker's index in [0, --num-workers) (env TETHER_WORKER_INDEX, else JOB_COMPLETION_INDEX)")
    p.add_argument("--num-workers", type=int, default=_env("TETHER_NUM_WORKERS", 1), help="workers in the job (env TETHER_NUM_WORKERS)")
    p.add_argument("--worker-id", default=_env("TETHER_WORKER_ID", None), help="name this worker gives the shards (default worker-<index>) (env TETHER_WORKER_ID)")
    p.add_argument("--out", default=_env("TETHER_OUT", None), help="write worker-<index>.json with the loss history here (env TETHER_OUT)")
    p.add_argument("--slowdown", type=float, default=_env("TETHER_SLOWDOWN", 1.0), help="make compute this many times slower (straggler experiments) (env TETHER_SLOWDOWN)")
    p.add_argument("--slow-worker", type=_optional_int, default=_env("TETHER_SLOW_WORKER", None), help="only the worker with this index is slowed (default: this worker) (env TETHER_SLOW_WORKER)")
    p.add_argument("--tls-ca", default=_env("TETHER_TLS_CA", None), help="connect with TLS; the shards' certificates are signed by this PEM CA (env TETHER_TLS_CA)")
    p.add_argument("--tls-cert", default=_env("TETHER_TLS_CERT", None), help="client certificate (PEM) for shards that require mutual TLS (env TETHER_TLS_CERT)")
    p.add_argument("--tls-key", default=_env("TETHER_TLS_KEY", None), help="PEM private key of --tls-cert (env TETHER_TLS_KEY)")
    p.add_argument("--auth-token-file", default=_env("TETHER_AUTH_TOKEN_FILE", None), help=f"send 'authorization: Bearer <token>' with the token in this file (env TETHER_AUTH_TOKEN_FILE, or the token itself in ${TOKEN_ENV})")


def build_parser() -> argparse.ArgumentParser:
    """Flags of ``tether worker``; each falls back to a ``TETHER_*`` environment variable."""
    p = argparse.ArgumentParser(
        prog="tether worker",
        description="Train with parameters held on tether shards. Every flag falls back to the TETHER_* environment variable its help names.",
        formatter_class=HelpFormatter,
    )
    add_connection_flags(p)
    p.add_argument("--metrics-port", type=_optional_int, default=_env("TETHER_METRICS_PORT", None), help="serve Prometheus /metrics on this port (env TETHER_METRICS_PORT)")
    add_training_flags(p)
    return p


def training_values(a: argparse.Namespace) -> dict[str, object]:
    """``TrainingConfig`` fields from parsed connection and job flags."""
    steps = getattr(a, "steps", None)
    return dict(
        shards=tuple(s.strip() for s in str(getattr(a, "shards", "") or "").split(",") if s.strip()),
        worker_index=int(getattr(a, "worker_index", 0)),
        num_workers=int(getattr(a, "num_workers", 1)),
        mode=getattr(a, "mode", "async"),
        steps=None if steps in (None, "") else int(steps),
        optimizer=a.optimizer,
        lr=float(a.lr),
        init_scale=float(a.init_scale),
        seed=int(a.seed),
        eval_every=int(a.eval_every),
        log_every=int(a.log_every),
        checkpoint_every_steps=int(a.checkpoint_every_steps),
        device=a.device,
        prefetch=not a.no_prefetch,
        staleness_aware=bool(a.staleness_aware),
        out=getattr(a, "out", None),
        tensorboard=getattr(a, "tensorboard", None) or None,
        worker_id=getattr(a, "worker_id", None) or None,
        timeout_s=float(a.timeout),
        call_deadline_s=float(a.call_deadline),
        ssp_timeout_s=float(a.ssp_timeout),
        wire_dtype=a.wire_dtype,
        transport=a.transport,
        slowdown=float(getattr(a, "slowdown", 1.0)),
        slow_worker=_optional_int(getattr(a, "slow_worker", None)),
        straggler=str(getattr(a, "straggler", "") or ""),
        tls_ca=getattr(a, "tls_ca", None) or None,
        tls_cert=getattr(a, "tls_cert", None) or None,
        tls_key=getattr(a, "tls_key", None) or None,
        auth_token_file=getattr(a, "auth_token_file", None) or None,
        auth_token=resolve_token(getattr(a, "auth_token_file", None)),
    )


def config_from_args(a: argparse.Namespace, **overrides: object) -> WorkerConfig:
    """``WorkerConfig`` from parsed flags (``overrides`` win)."""
    values = training_values(a)
    preset = MODEL_PRESETS[getattr(a, "preset", "default")]
    values.update({k: int(v) if (v := getattr(a, k, None)) not in (None, "") else preset[k] for k in preset})
    values.update(
        data=a.data,
        vocab_size=int(a.vocab_size),
        eval_samples=int(a.eval_samples),
        data_seed=int(getattr(a, "data_seed", 0)),
        metrics_port=_optional_int(getattr(a, "metrics_port", None)),
    )
    values.update(overrides)
    return WorkerConfig(**values)


def load_config(argv: Sequence[str] | None = None) -> WorkerConfig:
    """Parse ``tether worker`` flags into a validated ``WorkerConfig``."""
    return config_from_args(build_parser().parse_args(argv))
