"""Flags of ``tether worker`` and of training jobs, each with a ``TETHER_*`` environment fallback,
parsed into the worker's configs (``tether.worker.config``)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from tether.protos.codec import WIRE_DTYPES
from tether.protos.dataplane import TRANSPORTS
from tether.protos.flags import HelpFormatter, env
from tether.protos.security import TOKEN_ENV, resolve_token
from tether.protos.specs import OPTIMIZERS
from tether.worker.config import MODEL_PRESETS, WorkerConfig

__all__ = [
    "add_connection_flags",
    "add_job_flags",
    "add_model_flags",
    "add_training_flags",
    "build_parser",
    "config_from_args",
    "load_config",
    "training_values",
]


def _optional_int(value: str | int | None) -> int | None:
    return None if value is None or value == "" else int(value)


def add_job_flags(p: argparse.ArgumentParser, default_steps: int | None = 2000, mode: bool = True) -> None:
    """Flags of any training job (``TrainingConfig``), each with a ``TETHER_*`` fallback.

    Args:
        mode: add ``--mode`` (commands that run several modes leave it out).
    """
    p.add_argument("--steps", type=_optional_int, default=env("TETHER_STEPS", default_steps),
                   help="training steps per worker" + ("" if default_steps else "; empty: until the data ends") + " (env TETHER_STEPS)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=env("TETHER_OPTIMIZER", "adagrad"), help="server-side update rule (env TETHER_OPTIMIZER)")
    p.add_argument("--lr", type=float, default=env("TETHER_LR", 0.05), help="learning rate (env TETHER_LR)")
    p.add_argument("--init-scale", type=float, default=env("TETHER_INIT_SCALE", 0.05), help="new rows start uniform in [-S, S] (env TETHER_INIT_SCALE)")
    p.add_argument("--seed", type=int, default=env("TETHER_SEED", 0), help="seed of the model, the rows and the data (env TETHER_SEED)")
    p.add_argument("--eval-every", type=int, default=env("TETHER_EVAL_EVERY", 0), help="worker 0 evaluates every N steps (0: only at the end) (env TETHER_EVAL_EVERY)")
    p.add_argument("--checkpoint-every-steps", type=int, default=env("TETHER_CHECKPOINT_EVERY_STEPS", 0),
                   help="worker 0 asks every shard for a checkpoint every N steps (0: never) (env TETHER_CHECKPOINT_EVERY_STEPS)")
    p.add_argument("--device", default=env("TETHER_DEVICE", "auto"), help="auto (CUDA when present), cpu, cuda[:N] (env TETHER_DEVICE)")
    p.add_argument("--no-prefetch", action="store_true", default=env("TETHER_NO_PREFETCH", "") not in ("", "0"),
                   help="pull each batch after the previous push has landed instead of during compute (env TETHER_NO_PREFETCH=1)")
    p.add_argument("--log-every", type=int, default=env("TETHER_LOG_EVERY", 50), help="print progress every N steps (env TETHER_LOG_EVERY)")
    p.add_argument("--timeout", type=float, metavar="SECONDS", default=env("TETHER_TIMEOUT", 30.0), help="deadline of each RPC attempt, seconds (env TETHER_TIMEOUT)")
    p.add_argument(
        "--call-deadline", type=float, metavar="SECONDS", default=env("TETHER_CALL_DEADLINE", 60.0),
        help="longest one push, pull or declare takes, every retry included: each attempt gets at most what is left of it, "
        "and when it is spent (a shard that is down or stopped) the worker fails with Unavailable; seconds "
        "(env TETHER_CALL_DEADLINE). SSP waits are bounded by --ssp-timeout instead",
    )
    if mode:
        p.add_argument("--mode", default=env("TETHER_MODE", "async"), help="consistency: async, ssp:S (at most S steps ahead of the slowest live worker) or sync (all-reduce; start with torchrun) (env TETHER_MODE)")
    p.add_argument("--staleness-aware", action="store_true", default=env("TETHER_STALENESS_AWARE", "") not in ("", "0"),
                   help="divide each update's learning rate by its staleness (Zhang et al. 2016) (env TETHER_STALENESS_AWARE=1)")
    p.add_argument("--straggler", default=env("TETHER_STRAGGLER", ""),
                   help="straggler experiments: persistent:K[:WORKER] (the last worker, or WORKER, K times slower), transient:P:K "
                   "(each step, each worker K times slower with probability P), pareto:A[:CAP] (heavy-tailed factors) or none; "
                   "seeded by --seed, so every mode sees the same delays (env TETHER_STRAGGLER)")
    p.add_argument("--ssp-timeout", type=float, metavar="SECONDS", default=env("TETHER_SSP_TIMEOUT", 300.0), help="longest wait on the staleness bound before failing, seconds (env TETHER_SSP_TIMEOUT)")
    p.add_argument("--transport", choices=TRANSPORTS, default=env("TETHER_TRANSPORT", "auto"), help="push/pull over the shards' data plane (auto: shared memory on the same machine, else TCP; tcp: never shared memory) or grpc only (env TETHER_TRANSPORT)")
    p.add_argument("--wire-dtype", choices=tuple(WIRE_DTYPES), default=env("TETHER_WIRE_DTYPE", "float32"), help="element type of parameters and gradients on the wire (env TETHER_WIRE_DTYPE)")
    p.add_argument("--tensorboard", metavar="DIR", default=env("TETHER_TENSORBOARD", None),
                   help="write TensorBoard scalars (train loss, eval metrics, samples/s, clock staleness) per logged step to DIR/worker-<index>; "
                   "needs the tensorboard package: pip install 'tether[tensorboard]' (env TETHER_TENSORBOARD)")


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """Flags of the built-in CTR model and its data (``WorkerConfig``)."""
    p.add_argument("--preset", choices=tuple(MODEL_PRESETS), default=env("TETHER_PRESET", "default"),
                   help="model and batch size: default (batch 256, 8 fields, 16-wide rows: CPU-sized) or gpu (batch 8,192, "
                   "26 fields as in Criteo, 128-wide rows: a CUDA step not bound by kernel launches); --batch-size, "
                   "--num-sparse and --embedding-dim override it (env TETHER_PRESET)")
    p.add_argument("--batch-size", type=int, default=env("TETHER_BATCH_SIZE", None), help="samples per step (default: the preset's) (env TETHER_BATCH_SIZE)")
    p.add_argument("--data", default=env("TETHER_DATA", "synthetic"), help="'synthetic'; 'criteo:PATH' for Criteo TSV files (plain or gzip; a path, glob or comma list); "
                   "or 'parquet:PATH' for a Criteo-shaped Parquet table (a file, folder, glob or comma list: a 'label' column, float dense "
                   "columns, integer or string id columns; row groups dealt to the workers; needs pip install 'tether[parquet]'; "
                   "tether convert writes Criteo TSV as one; docs/data.md) (env TETHER_DATA)")
    p.add_argument("--vocab-size", type=int, default=env("TETHER_VOCAB_SIZE", 100_000), help="synthetic data: ids per field (env TETHER_VOCAB_SIZE)")
    p.add_argument("--num-sparse", type=int, default=env("TETHER_NUM_SPARSE", None), help="synthetic data: categorical fields (default: the preset's) (env TETHER_NUM_SPARSE)")
    p.add_argument("--embedding-dim", type=int, default=env("TETHER_EMBEDDING_DIM", None), help="width of every embedding row (default: the preset's) (env TETHER_EMBEDDING_DIM)")
    p.add_argument("--eval-samples", type=int, default=env("TETHER_EVAL_SAMPLES", 20_000), help="held-out samples (env TETHER_EVAL_SAMPLES)")
    p.add_argument("--data-seed", type=int, default=env("TETHER_DATA_SEED", 0), help="synthetic data: order of the training batches (0: the seed's own) (env TETHER_DATA_SEED)")


def add_training_flags(p: argparse.ArgumentParser, mode: bool = True) -> None:
    """Flags that describe a job of the built-in model (shared by ``tether worker``, ``launch``,
    ``compare`` and ``sweep``; ``mode=False`` leaves ``--mode`` out)."""
    add_job_flags(p, mode=mode)
    add_model_flags(p)


def add_connection_flags(p: argparse.ArgumentParser) -> None:
    """Flags that place one worker in a job: the shards, its index, security, output."""
    p.add_argument("--shards", default=env("TETHER_SHARDS", ""), help="comma-separated host:port of every shard, in shard order (env TETHER_SHARDS)")
    p.add_argument("--local", action="store_true", default=env("TETHER_LOCAL", "") not in ("", "0"),
                   help="no shards: keep the tables in this process, with the shards' update rules (env TETHER_LOCAL=1)")
    p.add_argument("--worker-index", type=int, default=env("TETHER_WORKER_INDEX", env("JOB_COMPLETION_INDEX", 0)), help="this worker's index in [0, --num-workers) (env TETHER_WORKER_INDEX, else JOB_COMPLETION_INDEX)")
    p.add_argument("--num-workers", type=int, default=env("TETHER_NUM_WORKERS", 1), help="workers in the job (env TETHER_NUM_WORKERS)")
    p.add_argument("--worker-id", default=env("TETHER_WORKER_ID", None), help="name this worker gives the shards (default worker-<index>) (env TETHER_WORKER_ID)")
    p.add_argument("--out", default=env("TETHER_OUT", None), help="write worker-<index>.json with the loss history here (env TETHER_OUT)")
    p.add_argument("--slowdown", type=float, default=env("TETHER_SLOWDOWN", 1.0), help="make compute this many times slower (straggler experiments) (env TETHER_SLOWDOWN)")
    p.add_argument("--slow-worker", type=_optional_int, default=env("TETHER_SLOW_WORKER", None), help="only the worker with this index is slowed (default: this worker) (env TETHER_SLOW_WORKER)")
    p.add_argument("--tls-ca", default=env("TETHER_TLS_CA", None), help="connect with TLS; the shards' certificates are signed by this PEM CA (env TETHER_TLS_CA)")
    p.add_argument("--tls-cert", default=env("TETHER_TLS_CERT", None), help="client certificate (PEM) for shards that require mutual TLS (env TETHER_TLS_CERT)")
    p.add_argument("--tls-key", default=env("TETHER_TLS_KEY", None), help="PEM private key of --tls-cert (env TETHER_TLS_KEY)")
    p.add_argument("--auth-token-file", default=env("TETHER_AUTH_TOKEN_FILE", None), help=f"send 'authorization: Bearer <token>' with the token in this file (env TETHER_AUTH_TOKEN_FILE, or the token itself in ${TOKEN_ENV})")


def build_parser() -> argparse.ArgumentParser:
    """Flags of ``tether worker``; each falls back to a ``TETHER_*`` environment variable."""
    p = argparse.ArgumentParser(
        prog="tether worker",
        description="Train with parameters held on tether shards. Every flag falls back to the TETHER_* environment variable its help names.",
        formatter_class=HelpFormatter,
    )
    add_connection_flags(p)
    p.add_argument("--metrics-port", type=_optional_int, default=env("TETHER_METRICS_PORT", None), help="serve Prometheus /metrics on this port (env TETHER_METRICS_PORT)")
    add_training_flags(p)
    return p


def training_values(a: argparse.Namespace) -> dict[str, Any]:
    """``TrainingConfig`` fields from parsed connection and job flags."""
    steps = getattr(a, "steps", None)
    return dict(
        shards=tuple(s.strip() for s in str(getattr(a, "shards", "") or "").split(",") if s.strip()),
        local=bool(getattr(a, "local", False)),
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
