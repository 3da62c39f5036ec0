"""Train your own PyTorch model through tether: one loop, a small policy per consistency mode.

A model is an ordinary ``torch.nn.Module`` whose sparse features go through
``ShardedEmbeddingBag`` modules (their rows live on the shards) and whose other parameters are
ordinary layers (they live on the shards too, or on the workers in ``sync`` mode). A
``Trainer`` is one worker of a job::

    config = TrainingConfig.from_env(mode="ssp:2")        # shards, index, mode: flags, env or code
    trainer = Trainer(model, config, loss=lambda m, b: ..., sparse=lambda b: {"items": b["item"]})
    record = trainer.fit(batches, eval_data=held_out)      # any iterable of batches

``sparse(batch)`` names the ids a batch looks up, per table (a tensor, or a list of tensors for
features that share a table), so the rows can be pulled before the forward pass, while the
previous step computes. ``loss(model, batch)`` returns the scalar to minimise. The built-in CTR
model and ``tether worker`` train through this class too.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch
from prometheus_client import CollectorRegistry
from torch import nn

from tether.common.metrics_http import serve_metrics
from tether.common.moved import old_names
from tether.protos.errors import FailedPrecondition, UsageError
from tether.protos.specs import TableConfig
from tether.worker.client.local import LocalClient
from tether.worker.client.ps_client import PSClient
from tether.worker.data.positions import latest_position, position_file, read_position, write_position
from tether.worker.data.synthetic import in_background
from tether.worker.metrics import NullWorkerMetrics, WorkerMetrics, WorkerRecorder
from tether.worker.training.batches import count_samples, pick_device, to_device
from tether.worker.training.embedding import PSModel
from tether.worker.training.policies import policy_for
from tether.worker.training.run_record import POINT_KEYS, Point, RunRecord
from tether.worker.training.step import PHASES, Step, StepContext
from tether.worker.training.table_rules import apply_rules
from tether.worker.training.tensorboard_writer import TensorBoardRecorder

if TYPE_CHECKING:
    from tether.worker.config import TrainingConfig

__all__ = ["Trainer"]

# tether.worker.training.TrainingConfig, as the old module gave it, until tether 0.2 (with a DeprecationWarning).
__getattr__ = old_names(__name__)

log = logging.getLogger(__name__)

B = TypeVar("B")
_UNKNOWN = object()


def print_line(line: str) -> None:
    """Print ``line`` to stdout in one write and flush: the ranks of one ``torchrun`` share its
    stdout, and ``print``'s two writes (the text, then the newline; unbuffered under ``tether
    launch``) let another rank's line land between them, gluing two lines and leaving an empty one."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


# -- the trainer ------------------------------------------------------------------------------------


class Trainer(Generic[B]):
    """One worker of a job: binds ``model`` to the shards and trains it on batches. Making one
    changes nothing process-wide: no hook, malloc setting or thread count (``TrainingConfig.from_env``
    is what makes a process a tether worker).

    Args:
        model: any module; its ``ShardedEmbeddingBag`` modules' rows and (outside ``sync``) its
            parameters live on the shards. Build it after ``torch.manual_seed(config.seed)`` on
            every worker so that the first to declare gives every worker the same start.
        config: shards, this worker's index, the mode and the schedule (``TrainingConfig``).
        loss: ``loss(model, batch)`` -> scalar tensor; the batch is already on the device.
        sparse: ``sparse(batch)`` -> {table: ids} (a tensor of any shape, or a list of tensors
            for features sharing a table) for every table the batch looks up.
        tables: table specs to declare; a table of the model that they do not name (all of
            them, by default) gets one with the config's optimizer, learning rate,
            ``init_scale`` and seed. The config's per-table
            entries (``table_optimizers``, ``optimizer_config``) win over these specs' optimizers,
            which win over ``optimizer`` and ``lr`` (``tether.worker.training.table_rules``).
        metrics: where to record steps and calls (``WorkerMetrics`` for Prometheus), or None:
            with ``config.metrics_port`` set the Trainer serves a ``WorkerMetrics`` of its own at
            ``/metrics`` on that port (``metrics_port`` says which it got) until it closes.
        printer: where progress lines go (default: stdout, a line in one write; ``print_line``).
        batch_size: ``batch_size(batch)`` -> samples, for the counts and samples/s (default: the
            leading length most of the batch's tensors share, with one warning if they differ;
            see ``tether.worker.training.batches.count_samples``).

    In a process whose config came from ``TrainingConfig.from_env`` (every program ``tether
    launch`` runs), a ``UsageError`` of tether's left uncaught ends it with one line and exit code
    2, a ``TetherError`` (shards that cannot be reached: ``Unavailable`` once ``call_deadline_s``
    is spent) with one line and exit code 1; other exceptions are untouched.

    Raises:
        UsageError: ``sync`` outside torchrun, or CUDA asked for and missing.
        TetherError: the shards refused the declaration or could not be reached.
    """

    def __init__(
        self,
        model: nn.Module,
        config: TrainingConfig,
        *,
        loss: Callable[[nn.Module, B], torch.Tensor],
        sparse: Callable[[B], Mapping[str, torch.Tensor | Sequence[torch.Tensor]]],
        tables: Sequence[TableConfig] | None = None,
        metrics: WorkerRecorder | None = None,
        printer: Callable[[str], None] = print_line,
        batch_size: Callable[[B], int] | None = None,
    ) -> None:
        config, device, policy = policy_for(config, pick_device(config.device))
        if device.type == "cuda" and device.index is not None:
            # Streams, events and device="cuda" allocations (the user's too) land on this worker's GPU, not cuda:0.
            torch.cuda.set_device(device)
        # Local mode (one process, the baseline): say how many threads torch computes with. A
        # launched worker has one (OMP_NUM_THREADS=1, or TrainingConfig.from_env in local mode);
        # torch's default of a thread per core ran 20-60x slower on a busy 2-core machine.
        threads = torch.get_num_threads()
        self._threads_note = f", {threads} torch thread{'s' if threads > 1 else ''}" + (
            " (OMP_NUM_THREADS=1 is often much faster on a busy machine)" if threads > 1 else "")
        self.config = config
        self.device = device
        self.policy = policy
        self.loss_fn = loss
        self.sparse_fn = sparse
        self.batch_size_fn: Callable[[B], int] = batch_size if batch_size is not None else self._count_samples
        self._count_noted = False
        # Where the data stream is after n batches, when it can say (set by fit).
        self._position_of: Callable[[int], dict[str, Any]] | None = None
        # With config.metrics_port and no metrics given, the Trainer serves a WorkerMetrics of its own (below).
        self.metrics, registry = _recorder(config, metrics)
        self._metrics_server: Any = None
        self.metrics_port: int | None = None  # the port it serves on, when it does
        self.printer = printer
        self.name = f"worker {config.worker_index}/{config.num_workers}"
        # TensorBoard curves (--tensorboard): a missing package is a UsageError before any connection.
        self.board = TensorBoardRecorder(Path(config.tensorboard) / f"worker-{config.worker_index}") if config.tensorboard else None
        # Local mode (config.local): no shards, the tables live in this process with the shards'
        # rules and initial rows; sync and several workers are refused there (tether.worker.client.local).
        self.client = LocalClient.for_training(config, self.metrics) if config.local else PSClient(config.client_config(), self.metrics)
        try:
            if registry is not None and config.metrics_port is not None:
                self._metrics_server, self.metrics_port = _serve(registry, config.metrics_port)
            self.ps = PSModel(model.to(device), self.client, device, dense_on_shards=policy.dense_on_shards, cache=config.row_cache)
            # Each table's rule and the dense one: --table-optimizer/--optimizer-config, else the code's
            # specs, else --optimizer/--lr (tether.worker.training.table_rules).
            tables, opt = apply_rules(
                config.table_rules, tables, {t: bags[0].dim for t, bags in self.ps.bags.items()}, config.init_scale, config.seed
            )
            self.client.declare(list(tables), self.ps.dense_tensors() if policy.dense_on_shards and self.ps.dense else None, opt)
            self.ps.rows.use_tables(tables)  # the row cache applies the worker's own updates by these rules
            policy.attach(self.ps, opt)
        except BaseException:
            self.client.close()
            if self.board is not None:
                self.board.close()
            self._stop_metrics()
            raise
        self.model = model

    # -- evaluation -----------------------------------------------------------------------------

    def evaluate(self, data: Iterable[B], metric: Callable[[nn.Module, B], Mapping[str, float]] | None = None) -> dict[str, float]:
        """Metrics of the model with the shards' current parameters, averaged over ``data``
        (weighted by batch size). ``metric(model, batch)`` gives a batch's metrics; by default
        ``{"eval_loss": loss(model, batch)}``.
        """
        totals: dict[str, float] = {}
        n = 0
        was_training = self.model.training
        self.model.train(False)
        try:
            for batch in data:
                self.ps.install(self.ps.prefetch(self.sparse_fn(batch)), train=False, timeout=self.config.wait_s)
                on_device = to_device(batch, self.device)
                with torch.no_grad():
                    values = metric(self.model, on_device) if metric else {"eval_loss": float(self.loss_fn(self.model, on_device))}
                k = self.batch_size_fn(batch)
                reserved = sorted(set(values) & POINT_KEYS)
                if reserved:
                    raise UsageError(
                        f"evaluate returned {reserved}, which the record uses for itself ({', '.join(sorted(POINT_KEYS))}): rename them"
                    )
                for key, value in values.items():
                    totals[key] = totals.get(key, 0.0) + float(value) * k
                n += k
        finally:
            self.model.train(was_training)
        return {key: value / max(n, 1) for key, value in totals.items()}

    def _count_samples(self, batch: B) -> int:
        """The default sample count; says once when the batch's tensors disagree on it."""
        n, note = count_samples(batch)
        if note is not None and not self._count_noted:
            self._count_noted = True
            log.warning("%s: %s", self.name, note)
        return n

    # -- training -------------------------------------------------------------------------------

    def fit(
        self,
        data: Iterable[B],
        eval_data: Iterable[B] | None = None,
        evaluate: Callable[[nn.Module, B], Mapping[str, float]] | None = None,
        background: bool = True,
    ) -> RunRecord:
        """Train on ``data`` until it ends or ``config.steps`` steps are done; returns this
        worker's record (``RunRecord``; also written to ``config.out/worker-<i>.json``).

        Worker 0 evaluates ``eval_data`` (re-iterated each time: pass a list or a re-iterable
        dataset) every ``config.eval_every`` steps and after the last step; the record's
        ``final_eval`` holds the last evaluation's metrics under the names ``evaluate`` gave them.

        Args:
            background: prepare batches on a background thread, up to 4 ahead.

        Raises:
            UsageError: ``eval_data`` is a one-shot iterator (a generator): the first evaluation
                would use it up and leave every later one empty.
            DeadlineExceeded: not every worker joined within ``config.wait_timeout_s`` (the
                start-up join, every mode), or an ``ssp`` wait on the bound ran past it.
            TetherError: a shard call failed after retries.
        """
        if eval_data is not None and iter(eval_data) is eval_data:
            raise UsageError(
                f"eval_data is a one-shot {type(eval_data).__name__}: it would be used up by the first evaluation; "
                "pass a list or a re-iterable dataset (an object whose __iter__ starts over)"
            )
        if self.config.steps is None and not hasattr(data, "__len__"):
            # A stream that says how many epochs it runs (ParquetStream, CriteoStream) is finite
            # unless that is None; of other data without a length nothing is known.
            epochs = getattr(data, "epochs", _UNKNOWN)
            if epochs is None:
                self.printer(f"{self.name}: no step limit (TrainingConfig.steps, env TETHER_STEPS) and the data is endless "
                             "(epochs=None): training runs until it is stopped")
            elif epochs is _UNKNOWN:
                self.printer(f"{self.name}: no step limit (TrainingConfig.steps, env TETHER_STEPS) and the data has no length: "
                             "training runs until the data ends (forever, if it never does)")
        self._resume(data)
        self._position_of = _position_of(data)
        producer = in_background(iter(data)) if background else None
        try:
            return self._fit(iter(data) if producer is None else producer, eval_data, evaluate)
        finally:
            if producer is not None:
                producer.close()  # stops the producer thread (the data may go on forever)
            # Forwards after training (the user's own evaluation) pull the rows they look up.
            self.ps.release()

    def _resume(self, data: object) -> None:
        """Start ``data`` where this worker's saved position says, with ``config.resume_data``
        set: ``DIR/worker-<i>.json``, as an earlier run or incarnation of this worker wrote it to
        ``OUT/positions/`` (``tether launch --max-restarts`` sets it on a restarted worker), loaded
        with the data's ``load_state_dict`` (a stream the built-in job opened at the position
        already takes it again unchanged).

        Raises:
            UsageError: the file cannot be read or holds no position, the data has no
                ``load_state_dict``, or it refuses the position (``DataError``: another setup's).
        """
        where = self.config.resume_data
        if where is None:
            return
        path = Path(where) / f"worker-{self.config.worker_index}.json"
        load = getattr(data, "load_state_dict", None)
        if not callable(load):
            raise UsageError(
                f"resume_data {where}: the training data ({type(data).__name__}) has no load_state_dict to resume a position with "
                "(ParquetStream has; an iterable of your own resumes given state_dict(batches=n) and load_state_dict(state))"
            )
        try:
            saved = read_position(path)
        except OSError as exc:
            raise UsageError(f"resume_data {where}: cannot read worker {self.config.worker_index}'s position {path}: "
                             f"{exc.strerror or exc}") from None
        except ValueError as exc:
            raise UsageError(f"resume_data {where}: {path}: {exc}") from None
        load(saved["position"])
        step = saved.get("step")
        self.printer(f"{self.name}: data resumed from {path}" + (f", after the {step} steps of the run that saved it" if
                                                                 isinstance(step, int) else ""))

    def _fit(
        self, stream: Iterator[B], eval_data: Iterable[B] | None, evaluate: Callable[[nn.Module, B], Mapping[str, float]] | None
    ) -> RunRecord:
        cfg, policy = self.config, self.policy
        evaluating = eval_data is not None and cfg.worker_index == 0
        held_out: Iterable[B] = eval_data if eval_data is not None else ()
        where = f"local (in-process tables{self._threads_note})" if cfg.local else f"{len(cfg.shards)} shard(s)"
        self.printer(f"{self.name}: mode {cfg.mode}, {where}, device {self.device}"
                     + (f", {cfg.steps} steps" if cfg.steps else ", until the data ends"))
        history: list[dict[str, Any]] = []
        last_eval: dict[str, float] = {}
        if evaluating and cfg.eval_every > 0:
            # The curve's first point: the initial model, evaluated before the others may start.
            last_eval = self.evaluate(held_out, evaluate)
            history.append(Point(step=0, samples=0, wall_s=0.0, time=time.time()).to_json(last_eval))
            if self.board is not None:
                self.board.write(history[-1])
        start_clock = policy.start(self)
        steps = Step(StepContext(config=cfg, client=self.client, name=self.name, policy=policy, ps=self.ps, model=self.model,
                                 device=self.device, loss_fn=self.loss_fn, sparse_fn=self.sparse_fn, printer=self.printer),
                     stream, start_clock)
        phase = dict.fromkeys(PHASES, 0.0)
        samples, eval_time, step = 0, 0.0, 0
        t_start, start_time = time.perf_counter(), time.time()
        for step in itertools.count():
            durations = steps.run(step)
            clock = start_clock + step + 1  # this worker's clock once the step is done
            n = self.batch_size_fn(steps.batch)
            samples += n
            for key, value in durations.items():
                phase[key] += value
            self.metrics.record_step(durations, sum(durations.values()), n, steps.loss_value, clock)
            # self.config: _checkpoint turns checkpoints off for the run when the shards cannot take them.
            if self.config.checkpoint_every_steps and (step + 1) % self.config.checkpoint_every_steps == 0:
                if cfg.worker_index == 0:
                    self._checkpoint(clock)
                self._save_position(clock, step + 1)
            evaluate_now = evaluating and ((cfg.eval_every > 0 and (step + 1) % cfg.eval_every == 0) or steps.last)
            if (step + 1) % cfg.log_every == 0 or steps.last or evaluate_now:
                # Before the progress line: a restart (tether launch) counts the steps done from
                # the position it resumes, so the line never reports steps beyond the position.
                self._save_latest_position(clock, step + 1)
                wall = time.perf_counter() - t_start - eval_time
                evals = (lambda: self.evaluate(held_out, evaluate)) if evaluate_now else None
                point, metrics, spent = self._log(steps, Point(step + 1, samples, round(wall, 4), time.time()), evals, phase, wall)
                history.append(point)
                last_eval = metrics if evaluate_now else last_eval
                eval_time += spent  # evaluations are left out of the wall clock so curves compare training
            if steps.last:
                break
            steps.advance()
        if steps.data_ended and cfg.steps is not None and step + 1 < cfg.steps:
            self.printer(f"{self.name}: stopping at step {step + 1} of {cfg.steps}: the training data ended")
        steps.finish()
        self._load_final_dense()
        wall = time.perf_counter() - t_start - eval_time
        record = RunRecord(
            worker_index=cfg.worker_index, mode=cfg.mode, device=str(self.device), steps=step + 1, samples=samples, wall_s=wall,
            samples_per_sec=samples / wall if wall > 0 else math.nan, phase_seconds=phase,
            clock_staleness=steps.acks.clock_staleness, update_staleness=steps.acks.update_staleness, start_time=start_time,
            rejected_too_stale=steps.acks.too_stale, history=history,
            config={k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items() if k != "auth_token"},
            final_eval=last_eval if evaluating else None,
            data_position=self._position_of(step + 1) if self._position_of is not None else None,
            traffic=self.ps.meter.moved(),
            cache_seconds=self._cache_seconds(),
        )
        policy.finish(self, start_clock + step + 1, record)
        if self.board is not None:
            self.board.flush()
        if cfg.out:
            record.write(cfg.out)
        return record

    def _load_final_dense(self) -> None:
        """Load the shards' dense values into the model once the last push has landed: the last
        steps computed on values pulled before the pushes in flight were applied, so without this
        a model saved after ``fit`` would miss its last updates. (In sync the dense parameters
        live on the ranks and are current already.)"""
        if not (self.ps.dense_on_shards and self.ps.dense):
            return
        was_training = self.model.training
        self.model.train(False)  # a fresh read: the row cache pushes what it holds first
        try:
            self.ps.install(self.ps.prefetch({}), train=False, timeout=self.config.wait_s)
        finally:
            self.model.train(was_training)

    def _log(
        self, steps: Step[B], point: Point, evals: Callable[[], dict[str, float]] | None, phase: dict[str, float], wall: float
    ) -> tuple[dict[str, Any], dict[str, float], float]:
        """A logged step's history point: ``point`` with the loss and clock staleness since the
        last one and, when ``evals`` is given, the held-out metrics it returns; written to
        TensorBoard and printed as a progress line. Returns the point, the metrics and the
        seconds spent evaluating."""
        window = steps.acks.window()
        point = replace(point, train_loss=steps.window_loss(), staleness_mean=round(sum(window) / len(window), 3) if window else None,
                        staleness_max=max(window) if window else None)
        metrics: dict[str, float] = {}
        spent = 0.0
        if evals is not None:
            te = time.perf_counter()
            metrics = evals()
            spent = time.perf_counter() - te
        record = point.to_json(metrics)
        if self.board is not None:
            self.board.write(record, steps.acks.clock_staleness[-1] if steps.acks.clock_staleness else None)
        self.printer(self._progress(record, metrics, phase, wall))
        return record, metrics, spent

    def _cache_seconds(self) -> float | None:
        """Seconds the row cache's own calls took so far (None: no cache)."""
        return self.ps.meter.cache_seconds if self.ps.rows.cache is not None else None

    def _progress(self, record: dict[str, Any], evals: Mapping[str, float], phase: dict[str, float], wall: float) -> str:
        """One progress line: step, loss, throughput, where the time went (with a row cache, the
        share of its own calls, which lie within pull_wait and push), elapsed and ETA, and the
        held-out metrics when this step evaluated."""
        busy = sum(phase.values()) or 1.0
        split = " ".join(f"{k} {phase[k] / busy:.0%}" for k in self.policy.phases_shown)
        cache = self._cache_seconds()
        if cache is not None:
            split += f"; row cache {cache / busy:.0%}"
        done, steps = int(record["step"]), self.config.steps
        total = f"/{steps}" if steps else ""
        eta = f" eta {_clock(wall / done * (steps - done))}" if steps and done < steps else ""
        extra = "".join(f" {k} {v:.4f}" for k, v in evals.items())
        return (f"{self.name} step {done}{total} loss {record['train_loss']:.4f} "
                f"{int(record['samples']) / max(wall, 1e-9):,.0f} samples/s ({split}) elapsed {_clock(wall)}{eta}{extra}")

    def _save_position(self, clock: int, steps: int) -> None:
        """Write where this worker's data stream is after ``steps`` batches of its own to
        ``out/positions/step-<steps>/worker-<i>.json``, when the data can say. The folder is named
        by the workers' own step counts, so one folder holds every worker's position after the
        same number of batches (their clocks may differ: a worker can start at another's clock);
        ``clock`` in the file is the clock of worker 0's checkpoint request ``step-<clock>`` for
        worker 0, this worker's own clock for the others (under ``ssp:S`` up to S off it)."""
        if self._position_of is None or not self.config.out:
            return
        write_position(position_file(self.config.out, f"step-{steps}", self.config.worker_index), steps, clock, self._position_of(steps))

    def _save_latest_position(self, clock: int, steps: int) -> None:
        """Write where this worker's data stream is after ``steps`` batches to
        ``out/positions/latest/worker-<i>.json`` (replaced whole), when the data can say: what
        ``tether launch --max-restarts`` resumes a restarted worker from."""
        if self._position_of is None or not self.config.out:
            return
        write_position(latest_position(self.config.out, self.config.worker_index), steps, clock, self._position_of(steps))

    def _checkpoint(self, clock: int) -> None:
        """Ask every shard for a checkpoint ``step-<clock>`` (worker 0); a shard without a
        checkpoint directory turns this off with one log line."""
        try:
            self.client.checkpoint(f"step-{clock}")
        except FailedPrecondition as exc:
            log.warning("checkpoint_every_steps is set but the shards cannot checkpoint (%s); not asking again", exc)
            self.config = replace(self.config, checkpoint_every_steps=0)

    def close(self, failed: bool = False) -> None:
        """Leave the process group (sync), close the client and the TensorBoard writer.

        Args:
            failed: this rank is ending on an error: leave the process group without the final
                barrier, which the other ranks (inside a step) would never meet, so this rank
                exits at once and torchrun stops the others with its error as the cause.
        """
        if self.board is not None:
            self.board.close()
        self.policy.leave(failed)
        self.client.close()
        self._stop_metrics()

    def _stop_metrics(self) -> None:
        if self._metrics_server is not None:  # it served config.metrics_port
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
            self._metrics_server = None

    def __enter__(self) -> Trainer[B]:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        self.close(failed=kind is not None)


def _recorder(config: TrainingConfig, metrics: WorkerRecorder | None) -> tuple[WorkerRecorder, Any]:
    """A Trainer's recorder: ``metrics``, else the null one; with ``config.metrics_port`` and no
    ``metrics``, a ``WorkerMetrics`` and the registry for the Trainer to serve (else None)."""
    if config.metrics_port is None or metrics is not None:
        if config.metrics_port is not None:
            log.warning("metrics_port %d: not served: the Trainer was given metrics of the caller's, to serve", config.metrics_port)
        return metrics if metrics is not None else NullWorkerMetrics(), None
    registry = CollectorRegistry()
    return WorkerMetrics(registry), registry


def _serve(registry: Any, port: int) -> tuple[Any, int]:
    """Serve ``registry`` at ``/metrics`` on ``port`` (torchrun ranks on one machine share it: each
    takes ``port`` + its local rank); the server and its port. Raises ``UsageError``: port taken or out of range."""
    if port and "LOCAL_RANK" in os.environ:
        port += int(os.environ["LOCAL_RANK"])
    try:
        server, bound = serve_metrics(registry, port)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--metrics-port {port}: {getattr(exc, 'strerror', None) or exc}") from None
    log.info("metrics on port %d", bound)
    return server, bound


def _position_of(data: object) -> Callable[[int], dict[str, Any]] | None:
    """``data.state_dict(batches=n)`` (the stream's position after n batches: ``fit`` reads ahead
    of the step) when the data has one, as ``ParquetStream`` does; else None."""
    state_dict = getattr(data, "state_dict", None)
    try:
        takes_batches = callable(state_dict) and "batches" in inspect.signature(state_dict).parameters
    except (TypeError, ValueError):
        takes_batches = False
    return (lambda n: state_dict(batches=n)) if takes_batches and state_dict is not None else None


def _clock(seconds: float) -> str:
    """``seconds`` as m:ss (h:mm:ss past an hour)."""
    s = round(seconds)
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"
