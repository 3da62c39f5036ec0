"""How a ``WorkerConfig`` reaches a worker process: the ``tether worker`` flags that reproduce it,
or the ``TETHER_*`` environment a user's program reads it from."""

from __future__ import annotations

from tether.worker.config import WorkerConfig

__all__ = ["job_env", "worker_argv"]


def worker_argv(cfg: WorkerConfig) -> list[str]:
    """``tether worker`` flags that reproduce ``cfg``."""
    argv = [
        "--shards", ",".join(cfg.shards), "--worker-index", str(cfg.worker_index), "--num-workers", str(cfg.num_workers),
        "--steps", str(cfg.steps), "--batch-size", str(cfg.batch_size), "--data", cfg.data,
        "--vocab-size", str(cfg.vocab_size), "--num-sparse", str(cfg.num_sparse), "--embedding-dim", str(cfg.embedding_dim),
        "--optimizer", cfg.optimizer, "--lr", repr(cfg.lr), "--seed", str(cfg.seed),
        "--eval-samples", str(cfg.eval_samples), "--eval-every", str(cfg.eval_every), "--device", cfg.device,
        "--log-every", str(cfg.log_every), "--timeout", repr(cfg.timeout_s), "--call-deadline", repr(cfg.call_deadline_s),
        "--wire-dtype", cfg.wire_dtype,
        "--transport", cfg.transport, "--mode", cfg.mode, "--ssp-timeout", repr(cfg.ssp_timeout_s), "--slowdown", repr(cfg.slowdown),
        "--init-scale", repr(cfg.init_scale), "--checkpoint-every-steps", str(cfg.checkpoint_every_steps),
    ]
    if cfg.worker_id:
        argv += ["--worker-id", cfg.worker_id]
    if cfg.slow_worker is not None:
        argv += ["--slow-worker", str(cfg.slow_worker)]
    if cfg.straggler:
        argv += ["--straggler", cfg.straggler]
    if cfg.data_seed:
        argv += ["--data-seed", str(cfg.data_seed)]
    if cfg.staleness_aware:
        argv.append("--staleness-aware")
    if not cfg.prefetch:
        argv.append("--no-prefetch")
    if cfg.out:
        argv += ["--out", cfg.out]
    if cfg.tensorboard:
        argv += ["--tensorboard", cfg.tensorboard]
    for flag, value in (("--tls-ca", cfg.tls_ca), ("--tls-cert", cfg.tls_cert), ("--tls-key", cfg.tls_key),
                        ("--auth-token-file", cfg.auth_token_file)):
        if value:
            argv += [flag, value]
    # A token from $TETHER_AUTH_TOKEN is never put on a command line: the child inherits the variable.
    return argv


def job_env(cfg: WorkerConfig) -> dict[str, str]:
    """The ``TETHER_*`` variables that describe ``cfg`` to a worker (``TrainingConfig.from_env``
    reads them): the variable of each ``tether worker`` flag, ``1`` for a switch."""
    env: dict[str, str] = {}
    argv = worker_argv(cfg)
    i = 0
    while i < len(argv):
        name = "TETHER_" + argv[i].lstrip("-").upper().replace("-", "_")
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            env[name] = argv[i + 1]
            i += 2
        else:
            env[name] = "1"
            i += 1
    return env
