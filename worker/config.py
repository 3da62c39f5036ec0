"""Configuration of one worker process: the training job's, the built-in model's and the client's
(frozen dataclasses, validated in ``__post_init__``). Each field a user can set declares its flag,
``TETHER_*`` variable, help and default once, here (``tether.common.settings``): the flags of
``tether worker`` and the launchers (``tether.worker.flags``), ``from_env`` and what a launcher
hands a worker (a JSON file of the values: ``tether worker --config FILE``, ``TETHER_CONFIG=FILE``
for a user's program; ``tether.common.config_file``) are made from those declarations."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

# Torch-free: the launcher's help, flag parsing and usage errors import this module, so what
# imports torch (the wire codec, the update rules, the row cache, the client) is imported where
# it is used.
from tether.common import choices
from tether.common import settings as fields
from tether.common.allocator import one_thread_unless_asked, tune_malloc
from tether.common.choices import or_names as _names
from tether.common.cli_args import optional_int, optional_str
from tether.common.config_file import CONFIG_ENV, read_values
from tether.common.exits import end_usage_errors_in_one_line, usage_checks
from tether.common.security import TOKEN_ENV, ClientSecurity, resolve_token
from tether.common.settings import default_of, derived, override, setting
from tether.protos.names import (
    INIT_SCALE,
    OPTIMIZER,
    OPTIMIZER_LR,
    OPTIMIZERS,
    REMEDY_DECAY,
    TRANSPORTS,
    WIRE_DTYPE_NAMES,
    check_optimizer,
    check_remedies,
)
from tether.worker.cache.config import RowCacheConfig
from tether.worker.data.checks import check_criteo_data, check_parquet_data
from tether.worker.training.mode import Mode, check_window
from tether.worker.training.stragglers import StragglerSpec, parse_straggler

if TYPE_CHECKING:
    from tether.worker.client.config import ClientConfig
    from tether.worker.training.table_rules import TableRules

T = TypeVar("T", bound="TrainingConfig")

# The row cache's fields (``TrainingConfig.row_cache``): cache_rows first, then the settings that
# mean something only with it.
CACHE_FIELDS = ("cache_rows", "cache_bound", "cache_write_bound", "cache_policy", "cache_hot", "cache_admission")

__all__ = ["CACHE_FIELDS", "JOB", "MODEL", "MODEL_PRESETS", "PLACE", "PROCESS", "TrainingConfig", "WorkerConfig"]


def parse_entries(text: str) -> tuple[str, ...]:
    """``tether.worker.training.table_rules.parse_entries`` (named as it is in argparse's message),
    imported with torch when a ``--table-optimizer`` is given."""
    # Start-up cost: torch with it; this module stays torch-free for the launcher's help and usage errors.
    from tether.worker.training.table_rules import parse_entries as parse

    return parse(text)


def _check_address(address: str) -> None:
    """A shard address is ``host:port`` (``[v6]:port`` too) with a port in [0, 65535].

    Raises:
        ValueError: anything else, naming the address.
    """
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"--shards: shard address must be host:port (port in [0, 65535]), got {address!r}")


# The groups of flags (``fields.add_flags(groups=...)``): where one worker stands in its job
# (``tether worker`` only), what the job is (``launch``, ``compare`` and ``sweep`` too), the
# worker process's own, and the built-in model's.
PLACE, JOB, PROCESS, MODEL = "place", "job", "process", "model"


def _auth_token(values: Mapping[str, Any], environ: Mapping[str, str]) -> str | None:
    return resolve_token(values["auth_token_file"], environ)


@dataclass(frozen=True)
class TrainingConfig:
    """One worker of a training job, whatever the model: where the shards are, which worker
    this is, the consistency mode, the schedule and the connection. ``Trainer`` takes it;
    ``WorkerConfig`` adds the built-in CTR model and its data. Each field that can be set from
    outside declares its flag, ``TETHER_*`` variable and help here (``tether.common.settings``)."""

    # Where this worker stands: ``tether worker`` and ``from_env`` only (a launcher sets them per worker).
    shards: tuple[str, ...] = setting((), flag="--shards", group=PLACE, help="comma-separated host:port of every shard, in shard order")
    # Local mode: no shards; the tables live in this process with the shards' update rules
    # (the one-process baseline, and unit tests of a model without a cluster).
    local: bool = setting(False, flag="--local", group=PLACE,
                          help="no shards: keep the tables in this process, with the shards' update rules")
    worker_index: int = setting(0, flag="--worker-index", group=PLACE, fallback_env=("JOB_COMPLETION_INDEX",),
                                help="this worker's index in [0, --num-workers)")
    num_workers: int = setting(1, flag="--num-workers", group=PLACE, help="workers in the job")
    worker_id: str | None = setting(None, flag="--worker-id", parse=optional_str, group=PLACE,
                                    help="name this worker gives the shards (default worker-<index>)")
    out: str | None = setting(None, flag="--out", parse=optional_str, group=PLACE,
                              help="write worker-<index>.json with the loss history here")
    # Where a restarted worker's data reads on from: Trainer.fit loads DIR/worker-<index>.json's
    # position into data that can take one (load_state_dict); tether launch sets it on a restart.
    resume_data: str | None = setting(None, flag="--resume-data", parse=optional_str, metavar="DIR", group=PLACE,
                                      help="resume this worker's data stream from DIR/worker-<index>.json (a position Trainer.fit "
                                      "wrote to OUT/positions/: data with state_dict(batches=n) and load_state_dict)")
    slowdown: float = setting(1.0, flag="--slowdown", group=PLACE, help="make compute this many times slower (straggler experiments)")
    slow_worker: int | None = setting(None, flag="--slow-worker", parse=optional_int, group=PLACE,
                                      help="only the worker with this index is slowed (default: this worker)")
    # Transport security (see tether.common.security): TLS files, and the bearer token with
    # the file it came from (None: from $TETHER_AUTH_TOKEN, which child processes inherit).
    tls_ca: str | None = setting(None, flag="--tls-ca", parse=optional_str, group=PLACE,
                                 help="connect with TLS; the shards' certificates are signed by this PEM CA")
    tls_cert: str | None = setting(None, flag="--tls-cert", parse=optional_str, group=PLACE,
                                   help="client certificate (PEM) for shards that require mutual TLS")
    tls_key: str | None = setting(None, flag="--tls-key", parse=optional_str, group=PLACE, help="PEM private key of --tls-cert")
    auth_token_file: str | None = setting(None, flag="--auth-token-file", parse=optional_str, group=PLACE,
                                          help="send 'authorization: Bearer <token>' with the token in this file "
                                          f"(or the token itself in ${TOKEN_ENV})")
    auth_token: str | None = derived(_auth_token, repr=False)
    # The worker process's own: the Trainer serves its WorkerMetrics there (tether launch --metrics gives each worker one).
    metrics_port: int | None = setting(None, flag="--metrics-port", parse=optional_int, group=PROCESS,
                                       help="serve Prometheus /metrics on this port")

    # The job: every worker of it alike.
    steps: int | None = setting(None, flag="--steps", parse=optional_int, group=JOB,
                                help="training steps per worker; empty: until the data ends")
    mode: Mode = setting("async", flag="--mode", group=JOB, help="consistency: async, ssp:S (at most S steps ahead of the slowest live "
                        "worker) or sync (all-reduce; start with torchrun)")
    # The shards' update rule for rows and (outside sync) dense parameters; sync steps dense
    # parameters with the matching torch optimizer.
    optimizer: str = setting(OPTIMIZER, flag="--optimizer", choices=OPTIMIZERS, group=JOB,
                             help="server-side update rule")
    lr: float = setting(OPTIMIZER_LR, flag="--lr", group=JOB, help="learning rate")
    # New rows start uniform in [-init_scale, init_scale] (seeded by id and seed).
    init_scale: float = setting(INIT_SCALE, flag="--init-scale", group=JOB,
                                help="new rows start uniform in [-S, S]")
    seed: int = setting(0, flag="--seed", group=JOB, help="seed of the model, the rows and the data")
    # Order of the training batches alone (0: the seed's own order): compare --repeats and sweep
    # --repeats vary it (+1 a repeat) while the initial model, the rows, the stragglers and the
    # held-out set stay the seed's. The built-in job's streams follow it; a script reads it as
    # ``config.data_seed`` and seeds its batch order with it.
    data_seed: int = setting(0, flag="--data-seed", group=JOB,
                             help="order of the training batches (0: the seed's own), the model staying the seed's: the built-in "
                             "job's synthetic and Parquet streams follow it, a script reads it as config.data_seed; "
                             "compare --repeats adds 1 a repeat")
    eval_every: int = setting(0, flag="--eval-every", group=JOB, help="worker 0 evaluates every N steps (0: only at the end)")
    # Worker 0 asks every shard for a checkpoint every N steps (shards also checkpoint on their
    # own with --checkpoint-every seconds).
    checkpoint_every_steps: int = setting(0, flag="--checkpoint-every-steps", group=JOB,
                                          help="worker 0 asks every shard for a checkpoint every N steps (0: never)")
    device: str = setting("auto", flag="--device", group=JOB, help="auto (CUDA when present), cpu, cuda[:N]")
    prefetch: bool = setting(True, flag="--no-prefetch", negated=True, group=JOB,
                             help="pull each batch after the previous push has landed instead of during compute")
    log_every: int = setting(50, flag="--log-every", group=JOB, help="print progress every N steps")
    timeout_s: float = setting(choices.CLIENT_TIMEOUT_S, flag="--timeout", metavar="SECONDS", group=JOB,
                               help="deadline of one attempt of a call, seconds; a failed attempt is retried until "
                               "--call-deadline is spent, so --call-deadline, not this, bounds how long a shard that is down "
                               "is waited for")
    call_deadline_s: float = setting(
        choices.CLIENT_CALL_DEADLINE_S, flag="--call-deadline", metavar="SECONDS", group=JOB,
        help="longest one push, pull or declare takes, every retry included, and so the whole wait for a shard that is down or "
        "stopped (whatever --timeout is): each attempt gets at most what is left of it, and when it is spent the worker "
        "fails with Unavailable in one line; seconds. "
        "SSP waits and the start-up join are bounded by --wait-timeout instead",
    )
    staleness_aware: bool = setting(choices.CLIENT_STALENESS_AWARE, flag="--staleness-aware", group=JOB,
                                    help="divide each update's learning rate by its staleness (Zhang et al. 2016)")
    # Per-table rules (tether.worker.training.table_rules): NAME=RULE[:key=value,...] entries, and a file of them.
    table_optimizers: tuple[str, ...] = setting(
        (), flag="--table-optimizer", parse=parse_entries, show=";".join, separator=";", metavar="NAME=RULE[:KEY=VALUE,...]", group=JOB,
        help="update rule, lr, weight decay and schedule of one table (NAME: a table, dense for the dense parameters, * for "
        "every other), e.g. user=rowwise_adagrad:lr=0.1,weight_decay=1e-5,warmup_steps=100,decay=cosine,decay_steps=2000; "
        "repeatable (the variable: entries separated by ;); wins over --optimizer-config, which wins over --optimizer/--lr",
    )
    optimizer_config: str | None = setting(None, flag="--optimizer-config", parse=optional_str, metavar="FILE", group=JOB,
                                           help="JSON or TOML (.toml) file of per-table rules: {NAME: {rule: RULE, KEY: VALUE}} "
                                           "(keys as --table-optimizer's)")
    delay_compensation: float = setting(0.0, flag="--delay-compensation", metavar="LAMBDA", group=JOB,
                                        help="DC-ASGD (Zheng et al. 2017): the shard steps with g + LAMBDA * g * g * (w_now - w_read); "
                                        "async and ssp only; pushes carry the values read (0: off)")
    dc_adaptive: bool = setting(False, flag="--dc-adaptive", group=JOB,
                                help="DC-ASGD-a (Zheng et al. 2017, the adaptive variant): --delay-compensation's LAMBDA becomes "
                                "LAMBDA / sqrt(ms), ms the shard's running mean of g * g per row and dense element (decay "
                                "--remedy-decay), so the correction keeps its size when gradients are small; needs --delay-compensation")
    gap_aware: bool = setting(False, flag="--gap-aware", group=JOB,
                              help="gap-aware (Barkai et al. 2020): the shard divides the step of each row (by its mean gap) and dense "
                              "element by max(1, |w_now - w_read| / C), C the running mean size of one update of it "
                              "(decay --remedy-decay); async and ssp only; pushes carry the values read")
    remedy_decay: float = setting(REMEDY_DECAY, flag="--remedy-decay", metavar="M", group=JOB,
                                  help="decay of the shard's running means behind --dc-adaptive and --gap-aware, in (0, 1)")
    # Straggler experiments (tether.worker.training.stragglers); empty: ``slowdown`` / ``slow_worker`` decide.
    straggler: str = setting("", flag="--straggler", group=JOB,
                             help="straggler experiments: persistent:K[:WORKER] (the last worker, or WORKER, K times slower), "
                             "transient:P:K (each step, each worker K times slower with probability P), "
                             "pareto:A[:CAP] (heavy-tailed factors) or none; seeded by --seed, so every mode sees the same delays")
    wait_timeout_s: float = setting(300.0, flag="--wait-timeout", metavar="SECONDS", group=JOB, fallback_env=("TETHER_SSP_TIMEOUT",),
                                    old_flag="--ssp-timeout",
                                    help="longest wait for the other workers before failing: the start-up join (every mode) and "
                                    "the staleness bound (ssp), seconds")
    transport: str = setting(choices.CLIENT_TRANSPORT, flag="--transport", choices=TRANSPORTS, group=JOB,
                             help="push/pull over the shards' data plane (auto: shared memory on the same machine, else TCP; tcp: never "
                             "shared memory) or grpc only")
    wire_dtype: str = setting(choices.CLIENT_WIRE_DTYPE, flag="--wire-dtype", choices=WIRE_DTYPE_NAMES, group=JOB,
                              help="element type of parameters and gradients on the wire")
    # TensorBoard scalars (loss, eval metrics, samples/s, staleness) go to <tensorboard>/worker-<index>.
    tensorboard: str | None = setting(None, flag="--tensorboard", parse=optional_str, metavar="DIR", group=JOB,
                                      help="write TensorBoard scalars (train loss, eval metrics, samples/s, clock staleness) "
                                      "per logged step to DIR/worker-<index>; "
                                      "needs the tensorboard package: pip install 'tether[tensorboard]'")

    # The row cache (docs/choosing-a-consistency-mode.md, "Worker row cache"); off in sync.
    cache_rows: int = setting(0, flag="--cache-rows", group=JOB,
                              help="cache up to N embedding rows per table on the worker (0: no cache; not in sync)")
    cache_bound: int | None = setting(None, flag="--cache-bound", parse=optional_int, group=JOB,
                                      help="read bound, which --cache-rows needs (or --cache-write-bound): a cached row read at "
                                      "most N of this worker's clocks ago is used without a pull (0: every row pulled every "
                                      "step, exactly as without a cache; docs/choosing-a-consistency-mode.md measures 5 and 20)")
    cache_write_bound: int | None = setting(None, flag="--cache-write-bound", parse=optional_int, group=JOB,
                                            help="write bound: a cached row's gradients are summed and pushed once the oldest is N "
                                            "clocks old, or the row is evicted (default: --cache-bound)")
    cache_policy: str = setting(choices.CACHE_POLICIES[0], flag="--cache-policy", choices=choices.CACHE_POLICIES, group=JOB,
                                help="which cached row goes when a table's cache is full: lru or lfu")
    cache_hot: int = setting(0, flag="--cache-hot", metavar="K", group=JOB,
                             help="push a held row before its write bound once it holds K of this worker's gradients, so the "
                             "rows every worker trains on reach the others sooner (0: off, the default; host cache only)")
    cache_admission: str = setting(choices.CACHE_ADMISSIONS[0], flag="--cache-admission", choices=choices.CACHE_ADMISSIONS, group=JOB,
                                   help="which missed rows the cache keeps: recurring (the default: those missed again within "
                                   "the bounds; the others are pulled and pushed in their step, as with no cache), or all")
    # Pushes in flight per worker (PERSIA's embedding_staleness; tether.worker.training.step): async only.
    push_window: int = setting(1, flag="--push-window", metavar="K", group=JOB,
                               help="async: up to K of this worker's pushes in flight, so a step's rows may miss its last K "
                               "updates (1: one, the default; not with ssp, sync or --no-prefetch)")

    @classmethod
    def from_env(cls: type[T], **overrides: object) -> T:
        """The config the environment describes: the JSON file ``TETHER_CONFIG`` names, if set
        (what ``tether launch`` gives each worker of a user's program: the worker's config, read
        as it is), then the ``TETHER_*`` variables over it (what the Kubernetes manifests give a
        worker, or a user sets by hand; ``tether worker --help`` lists them), with ``overrides``
        winning. Under torchrun in sync mode the rank and world size come from ``RANK`` and
        ``WORLD_SIZE``.

        Asking for the environment's config makes this process a tether worker, as ``tether
        worker`` is (``Trainer`` itself changes nothing process-wide): a ``UsageError`` or
        ``TetherError`` it leaves uncaught from here on ends it with one line (exit code 2 or 1,
        ``end_usage_errors_in_one_line``), its malloc keeps freed MiB-sized tensors in the heap
        (``tune_malloc``), and in local mode torch computes with one thread, as a launched worker
        does, unless ``OMP_NUM_THREADS`` says otherwise (torch's thread per core ran 20-60x slower
        on a busy 2-core machine).

        Raises:
            UsageError: a bad value, or a config file that cannot be read or holds no config, named.
        """
        end_usage_errors_in_one_line()
        tune_malloc()
        with usage_checks():
            config = cls._from_env(overrides)
        if config.local:
            one_thread_unless_asked()
        return config

    @classmethod
    def _from_env(cls: type[T], overrides: Mapping[str, object]) -> T:
        path = os.environ.get(CONFIG_ENV, "")
        base = read_values(cls, path, f"{CONFIG_ENV}={path}") if path else None
        values = fields.env_values(cls, overrides, base=base)
        # ``sync`` is the whole mode (no bound follows it), so this needs no parse_mode.
        if values.get("mode", default_of(cls, "mode")) == "sync" and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
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

    def client_config(self) -> ClientConfig:
        """The client of this worker (the rest at the client's defaults; the row cache is the
        model's, ``row_cache``, not the client's)."""
        # Torch with it (the wire dtypes): only where a worker runs, not in the launcher's help.
        from tether.protos.codec import WIRE_DTYPES
        from tether.worker.client.config import ClientConfig

        return ClientConfig(
            addresses=self.shards,
            worker_id=self.worker_name,
            timeout_s=self.timeout_s,
            call_deadline_s=self.call_deadline_s,
            wire_dtype=WIRE_DTYPES[self.wire_dtype],
            transport=self.transport,
            # In sync every rank's gradients of a step were computed on the same parameters
            # (those after the previous step's barrier): none is stale, though the shard sees
            # the other ranks' pushes of that step land first. So sync never asks for it.
            staleness_aware=self.staleness_aware and self.mode.kind != "sync",
            delay_compensation=self.delay_compensation,
            dc_adaptive=self.dc_adaptive,
            gap_aware=self.gap_aware,
            remedy_decay=self.remedy_decay,
            security=self.security,
        )

    @property
    def row_cache(self) -> RowCacheConfig:
        """The row cache the cache_* fields describe."""
        return RowCacheConfig(rows=self.cache_rows, bound=self.cache_bound or 0, write_bound=self.cache_write_bound,
                              policy=self.cache_policy, hot=self.cache_hot, admission=self.cache_admission)

    @property
    def worker_name(self) -> str:
        """How this worker names itself to the shards: ``worker_id``, else ``worker-<index>``."""
        return self.worker_id or f"worker-{self.worker_index}"

    @property
    def straggler_spec(self) -> StragglerSpec:
        """Who computes slower when (``straggler``, or else ``slowdown`` on ``slow_worker``,
        every worker given it when ``slow_worker`` is None)."""
        if self.straggler:
            return parse_straggler(self.straggler)
        if self.slowdown > 1.0:
            return StragglerSpec(
                "persistent", factor=self.slowdown, worker=self.worker_index if self.slow_worker is None else self.slow_worker
            )
        return StragglerSpec()

    @property
    def wait_s(self) -> float:
        """Longest a step waits on a push or pull: the client ends each call by its deadline,
        this only bounds the wait should it not."""
        return self.call_deadline_s + self.timeout_s

    def __post_init__(self) -> None:
        # Parsed here, once: a copy (dataclasses.replace) hands the Mode on as it is.
        object.__setattr__(self, "mode", Mode.of(self.mode))
        if not self.slowdown >= 1.0:
            raise ValueError(f"slowdown must be >= 1 (1 = full speed), got {self.slowdown!r}")
        parse_straggler(self.straggler)
        if not self.wait_timeout_s > 0:
            raise ValueError(f"wait_timeout_s must be > 0, got {self.wait_timeout_s!r}")
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
        if self.resume_data is not None and not self.resume_data:
            raise ValueError("resume_data must name a directory (None: start each stream at its beginning), got ''")
        if self.resume_data is not None and not os.path.isdir(self.resume_data):
            raise ValueError(f"--resume-data {self.resume_data}: no such directory")
        if self.log_every < 1:
            raise ValueError(f"log_every must be >= 1, got {self.log_every!r}")
        if self.eval_every < 0 or self.checkpoint_every_steps < 0:
            raise ValueError(
                f"eval_every and checkpoint_every_steps must be >= 0, got {self.eval_every!r}, {self.checkpoint_every_steps!r}"
            )
        check_optimizer(self.optimizer)
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
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535] (0: any free port), got {self.metrics_port!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")
        if not 0 < self.call_deadline_s < math.inf:
            raise ValueError(f"call_deadline_s (--call-deadline) must be a finite number of seconds > 0, got {self.call_deadline_s!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be {_names(TRANSPORTS)}, got {self.transport!r}")
        if self.wire_dtype not in WIRE_DTYPE_NAMES:
            raise ValueError(f"wire_dtype must be {_names(WIRE_DTYPE_NAMES)}, got {self.wire_dtype!r}")
        self.security  # noqa: B018 - validates the TLS and token fields together
        self.row_cache  # noqa: B018 - validates the cache_* fields together
        self._check_cache_flags()
        # Code may pass one text of entries ("a=adam;b=sgd", the variable's form), a list, or a Path: the
        # fields hold what the flags give (a tuple of entries, a str), so argv, env and hashing see one form.
        if not isinstance(self.table_optimizers, tuple):
            given = self.table_optimizers
            object.__setattr__(self, "table_optimizers", parse_entries(given) if isinstance(given, str) else tuple(given))
        if self.optimizer_config is not None and not isinstance(self.optimizer_config, str):
            object.__setattr__(self, "optimizer_config", os.fspath(self.optimizer_config))
        self.table_rules  # noqa: B018 - parses (and keeps) the per-table rules, reading the file
        if not 0 <= self.delay_compensation < math.inf:
            raise ValueError(f"delay_compensation must be a finite number >= 0, got {self.delay_compensation!r}")
        check_remedies(self.delay_compensation, self.dc_adaptive, self.remedy_decay)
        for flag, on, off in (("--delay-compensation", self.delay_compensation, "leave it at 0"),
                              ("--gap-aware", self.gap_aware, "leave it off")):
            if on and (self.local or self.mode.kind == "sync"):
                raise ValueError(
                    f"{flag} is for async and ssp:S: {'local mode' if self.local else 'sync'} has no stale gradient to "
                    f"compensate ({off})"
                )
        if self.push_window != 1:  # refused here, at launch, not when the workers have joined
            check_window(self.push_window, self.prefetch and self.mode.kind == "async", self.mode)

    @classmethod
    def without_cache(cls) -> dict[str, Any]:
        """Every row cache field (``CACHE_FIELDS``) at its default: no cache (what ``tether
        compare`` gives its sync baseline)."""
        return {name: default_of(cls, name) for name in CACHE_FIELDS}

    def _check_cache_flags(self) -> None:
        """The cache bounds and policy mean something only with a cache, and a cache only outside sync."""
        given = [name for name, default in self.without_cache().items() if name != "cache_rows" and getattr(self, name) != default]
        if given and not self.cache_rows:
            flags = {f.name: decl.flag or f.name for f, decl in fields.declared(type(self))}  # only for the message
            raise ValueError(f"{', '.join(flags[name] for name in given)} without --cache-rows (cache_rows=0: no row cache) would do "
                             "nothing: give --cache-rows N, or leave them out")
        if self.cache_rows and not self.local and self.mode.kind == "sync":
            raise ValueError("--cache-rows is for async and ssp:S: sync reads every row fresh each step, so it has no "
                             "row cache (leave it at 0)")
        if self.cache_rows and self.cache_bound is None and self.cache_write_bound is None:
            raise ValueError("--cache-rows without --cache-bound would cache nothing (both bounds 0: every row pulled and pushed "
                             "each step, as without a cache): give --cache-bound R (at 20 the cache saved 40-75% of the "
                             "bytes: docs/choosing-a-consistency-mode.md), or leave --cache-rows out")

    @functools.cached_property
    def table_rules(self) -> TableRules:
        """The per-table rules (``table_optimizers``, ``optimizer_config``, ``optimizer``, ``lr``)."""
        # Start-up cost: torch with it; this module stays torch-free for the launcher's help and usage errors.
        from tether.worker.training.table_rules import TableRules

        return TableRules.of(self.table_optimizers, self.optimizer_config, self.optimizer, self.lr)


# Sizes of the built-in model by name (``--preset``); a flag given for one of these fields wins.
# The default preset's are the fields' defaults.
MODEL_PRESETS: dict[str, dict[str, int]] = {
    "default": {"batch_size": 256, "num_sparse": 8, "embedding_dim": 16},
    "gpu": {"batch_size": 8192, "num_sparse": 26, "embedding_dim": 128},
}
_SIZES = MODEL_PRESETS["default"]


def gpu_push_window(values: Mapping[str, Any]) -> int:
    """``--preset gpu``'s push window: 2 where pushes in flight mean something (async with
    prefetching), else 1. A step's push carries the pull of the batch two steps on, so the
    round trip (the shards' apply and gather of ~68k 128-wide rows each way) has two steps of
    GPU compute to come back in instead of one; a step's rows may then miss this worker's last
    2 updates. ssp, sync and ``--no-prefetch`` land every push before the next pull (K > 1 is
    refused there), so the preset leaves them at 1. (``values``: the config's values so far.)"""
    prefetch_async = str(values.get("mode", "")).split(":")[0] == "async" and bool(values.get("prefetch", True))
    return GPU_PUSH_WINDOW if prefetch_async else 1


# Pushes in flight at --preset gpu (async with prefetching): two steps of compute hide a round trip.
GPU_PUSH_WINDOW = 2
# What --preset sets beyond the model's sizes: a value, or a function of the other values.
JOB_PRESETS: dict[str, dict[str, Any]] = {"default": {}, "gpu": {"push_window": gpu_push_window}}


@dataclass(frozen=True)
class WorkerConfig(TrainingConfig):
    """``tether worker``: a ``TrainingConfig`` for the built-in CTR model and its data."""

    # --preset (tether.common.settings.Presets): batch size, fields and width by name.
    PRESETS: ClassVar[fields.Presets] = fields.Presets(
        flag="--preset", group=MODEL, values={name: {**MODEL_PRESETS[name], **JOB_PRESETS[name]} for name in MODEL_PRESETS},
        help="model and batch size: default (batch 256, 8 fields, 16-wide rows: CPU-sized) or gpu (batch 8,192, 26 fields as in Criteo, "
        "128-wide rows: a CUDA step not bound by kernel launches; in async also --push-window 2, so a pull's round trip has two "
        "steps of compute to come back in); --batch-size, --num-sparse, --embedding-dim and --push-window override it",
    )
    push_window: int = override(TrainingConfig, "push_window", 1, unset=True,
                                help="async: up to K of this worker's pushes in flight, so a step's rows may miss its last K "
                                "updates (default: the preset's: 1, or 2 with --preset gpu in async; 1 with ssp, sync or "
                                "--no-prefetch, where K > 1 is refused)")

    steps: int = override(TrainingConfig, "steps", 2000, help="training steps per worker")
    # The built-in model and its data. Batch size, fields and width: unset flags take the
    # ``--preset``'s (``PRESETS``), so their flags have no default of their own.
    batch_size: int = setting(_SIZES["batch_size"], flag="--batch-size", unset=True, group=MODEL,
                              help="samples per step (default: the preset's)")
    data: str = setting("synthetic", flag="--data", group=MODEL,
                        help="'synthetic'; 'criteo:PATH' for Criteo TSV files (plain or gzip; a path, glob or comma list); "
                        "or 'parquet:PATH' for a Criteo-shaped Parquet table (a file, folder, glob or comma list: a 'label' column, "
                        "float dense columns, integer or string id columns; row groups dealt to the workers; "
                        "needs pip install 'tether[parquet]'; tether convert writes Criteo TSV as one; docs/data.md)")
    vocab_size: int = setting(100_000, flag="--vocab-size", group=MODEL, help="synthetic data: ids per field")
    num_sparse: int = setting(_SIZES["num_sparse"], flag="--num-sparse", unset=True, group=MODEL,
                              help="synthetic data: categorical fields (default: the preset's)")
    embedding_dim: int = setting(_SIZES["embedding_dim"], flag="--embedding-dim", unset=True, group=MODEL,
                                 help="width of every embedding row (default: the preset's)")
    eval_samples: int = setting(20_000, flag="--eval-samples", group=MODEL, help="held-out samples")
    resume_data: str | None = override(
        TrainingConfig, "resume_data", None, group=MODEL,
        help="resume each worker's stream (the synthetic one, or --data parquet:) from DIR/worker-<i>.json, "
        "as every worker writes its newest to OUT/positions/latest/ and, with --checkpoint-every-steps, "
        "OUT/positions/step-<n>/ (tether launch --max-restarts resumes a restarted worker so)")

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("batch_size", "vocab_size", "num_sparse", "embedding_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.eval_samples < 0:
            raise ValueError(f"eval_samples must be >= 0, got {self.eval_samples!r}")
        if self.resume_data is not None and self.data.startswith("criteo:"):
            raise ValueError(
                f"--resume-data {self.resume_data}: only the synthetic stream and a Parquet one (--data parquet:PATH) have a position "
                f"to resume, got --data {self.data} (tether convert writes Criteo files as Parquet)"
            )
        if self.data != "synthetic" and not self.data.startswith(("criteo:", "parquet:")):
            raise ValueError(f"data must be 'synthetic', 'criteo:PATH' or 'parquet:PATH', got {self.data!r}")

    def check_data(self) -> WorkerConfig:
        """This config, once its ``--data`` files are checked (readable Criteo files; Parquet
        schemas and row groups enough for ``num_workers``): at the entry point, once, not at every
        ``replace`` (``tether.worker.flags.config_from_args`` calls it).

        Raises:
            ValueError: one line naming the file and what is wrong with it.
        """
        if self.data.startswith("criteo:"):
            check_criteo_data(self.data)
        if self.data.startswith("parquet:"):
            check_parquet_data(self.data, self.num_workers)
        return self
