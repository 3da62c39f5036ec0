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
import json
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch
from torch import nn

from tether.protos.errors import FailedPrecondition, TooStale, UsageError
from tether.protos.specs import TableConfig
from tether.worker.client import ClientConfig, Handle, PSClient, PullResult
from tether.worker.batches import count_samples, pick_device, to_device
from tether.worker.config import TrainingConfig
from tether.worker.data import in_background
from tether.worker.embedding import Prefetch, PSModel
from tether.worker.local import LocalClient
from tether.worker.table_rules import apply_rules, dense_torch_optimizer
from tether.worker.metrics import NullWorkerMetrics, WorkerRecorder
from tether.worker.policies import AsyncPolicy, SyncPolicy, policy_for
from tether.worker.stragglers import delay_factor
from tether.worker.tensorboard_writer import RECORD_KEYS, TensorBoardRecorder

__all__ = ["Trainer", "TrainingConfig"]

log = logging.getLogger(__name__)

B = TypeVar("B")


# -- the trainer ------------------------------------------------------------------------------------


class Trainer(Generic[B]):
    """One worker of a job: binds ``model`` to the shards and trains it on batches.

    Args:
        model: any module; its ``ShardedEmbeddingBag`` modules' rows and (outside ``sync``) its
            parameters live on the shards. Build it after ``torch.manual_seed(config.seed)`` on
            every worker so that the first to declare gives every worker the same start.
        config: shards, this worker's index, the mode and the schedule (``TrainingConfig``).
        loss: ``loss(model, batch)`` -> scalar tensor; the batch is already on the device.
        sparse: ``sparse(batch)`` -> {table: ids} (a tensor of any shape, or a list of tensors
            for features sharing a table) for every table the batch looks up.
        tables: table specs to declare; by default one per table of the model, with the
            config's optimizer, learning rate, ``init_scale`` and seed. The config's per-table
            entries (``table_optimizers``, ``optimizer_config``) win over these specs' optimizers,
            which win over ``optimizer`` and ``lr`` (``tether.worker.table_rules``).
        metrics: where to record steps and calls (``WorkerMetrics`` for Prometheus), or None.
        printer: where progress lines go.
        batch_size: ``batch_size(batch)`` -> samples, for the counts and samples/s (default: the
            leading length most of the batch's tensors share, with one warning if they differ;
            see ``tether.worker.batches.count_samples``).

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
        printer: Callable[[str], None] = print,
        batch_size: Callable[[B], int] | None = None,
    ) -> None:
        config, device, policy = policy_for(config, pick_device(config.device))
        if device.type == "cuda" and device.index is not None:
            # Streams, events and device="cuda" allocations (the user's too) land on this worker's GPU, not cuda:0.
            torch.cuda.set_device(device)
        self.config = config
        self.device = device
        self.policy = policy
        self.loss_fn = loss
        self.sparse_fn = sparse
        self.batch_size_fn: Callable[[B], int] = batch_size if batch_size is not None else self._count_samples
        self._count_noted = False
        # Where the data stream is after n batches, when it can say (set by fit).
        self._position_of: Callable[[int], dict[str, Any]] | None = None
        self.metrics: WorkerRecorder = metrics if metrics is not None else NullWorkerMetrics()
        self.printer = printer
        self.name = f"worker {config.worker_index}/{config.num_workers}"
        # TensorBoard curves (--tensorboard): a missing package is a UsageError before any connection.
        self.board = TensorBoardRecorder(Path(config.tensorboard) / f"worker-{config.worker_index}") if config.tensorboard else None
        # Local mode (config.local): no shards, the tables live in this process with the shards'
        # rules and initial rows; sync and several workers are refused there (tether.worker.local).
        self.client = LocalClient.for_training(config, self.metrics) if config.local else PSClient(
            ClientConfig.for_training(config), self.metrics
        )
        try:
            self.ps = PSModel(model.to(device), self.client, device, dense_on_shards=policy.dense_on_shards)
            # Each table's rule and the dense one: --table-optimizer/--optimizer-config, else the code's
            # specs, else --optimizer/--lr (tether.worker.table_rules).
            tables, opt = apply_rules(
                config.table_rules, tables, {t: bags[0].dim for t, bags in self.ps.bags.items()}, config.init_scale, config.seed
            )
            self.client.declare(list(tables), self.ps.dense_tensors() if policy.dense_on_shards and self.ps.dense else None, opt)
            if isinstance(policy, SyncPolicy):
                params = list(self.ps.parameters())
                # The torch optimizer that takes the shards' steps: every rank steps its own copy.
                policy.bind(params, dense_torch_optimizer(opt, params) if params else None,
                            {t: bags[0].dim for t, bags in self.ps.bags.items()})
        except BaseException:
            self.client.close()
            if self.board is not None:
                self.board.close()
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
                reserved = sorted(set(values) & RECORD_KEYS)
                if reserved:
                    raise UsageError(
                        f"evaluate returned {reserved}, which the record uses for itself ({', '.join(sorted(RECORD_KEYS))}): rename them"
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
    ) -> dict[str, Any]:
        """Train on ``data`` until it ends or ``config.steps`` steps are done; returns this
        worker's record (also written to ``config.out/worker-<i>.json``).

        Worker 0 evaluates ``eval_data`` (re-iterated each time: pass a list or a re-iterable
        dataset) every ``config.eval_every`` steps and after the last step; the record's
        ``final_eval`` holds the last evaluation's metrics under the names ``evaluate`` gave them.

        Args:
            background: prepare batches on a background thread, up to 4 ahead.

        Raises:
            UsageError: ``eval_data`` is a one-shot iterator (a generator): the first evaluation
                would use it up and leave every later one empty.
            DeadlineExceeded: an ``ssp`` wait ran past ``config.ssp_timeout_s``.
            TetherError: a shard call failed after retries.
        """
        if eval_data is not None and iter(eval_data) is eval_data:
            raise UsageError(
                f"eval_data is a one-shot {type(eval_data).__name__}: it would be used up by the first evaluation; "
                "pass a list or a re-iterable dataset (an object whose __iter__ starts over)"
            )
        if self.config.steps is None and not hasattr(data, "__len__"):
            self.printer(f"{self.name}: no step limit (TrainingConfig.steps, env TETHER_STEPS) and the data has no length: "
                         "training runs until the data ends, forever on an endless stream")
        self._position_of = _position_of(data)
        producer = in_background(iter(data)) if background else None
        try:
            return self._fit(iter(data) if producer is None else producer, eval_data, evaluate)
        finally:
            if producer is not None:
                producer.close()  # stops the producer thread (the data may go on forever)
            # Forwards after training (the user's own evaluation) pull the rows they look up.
            self.ps.release()

    def _fit(
        self, stream: Iterator[B], eval_data: Iterable[B] | None, evaluate: Callable[[nn.Module, B], Mapping[str, float]] | None
    ) -> dict[str, Any]:
        cfg, policy, ps = self.config, self.policy, self.ps
        evaluating = eval_data is not None and cfg.worker_index == 0
        held_out: Iterable[B] = eval_data if eval_data is not None else ()
        prefetch = cfg.prefetch and policy.prefetch
        # Without prefetching a step's push lands before the next step pulls (sequential SGD).
        settle_every_step = policy.settle_every_step or not cfg.prefetch
        history: list[dict[str, Any]] = []
        staleness: list[int] = []
        update_staleness: list[int] = []
        too_stale = 0
        wait_s = cfg.wait_s

        def settle(handle: Handle) -> None:
            """Wait for a push; one a shard rejected as too stale is dropped and counted."""
            nonlocal too_stale
            try:
                ack = handle.result(wait_s)
                staleness.append(ack.clock_staleness)
                update_staleness.append(ack.staleness)
            except TooStale as exc:
                too_stale += 1
                log.info("%s", exc)

        def install(pending: Prefetch) -> PullResult:
            """Wait for a pull; a push_pull whose push was rejected as too stale is counted and
            its pull made again on its own."""
            nonlocal too_stale
            try:
                pulled = ps.install(pending, train=True, timeout=wait_s)
            except TooStale as exc:
                too_stale += 1
                log.info("%s", exc)
                return ps.install(ps.prefetch(pending.ids), train=True, timeout=wait_s)
            if pending.ack is not None:
                staleness.append(pending.ack.clock_staleness)
                update_staleness.append(pending.ack.staleness)
            return pulled

        steps = cfg.steps
        total = f"/{steps}" if steps else ""
        where = "local (in-process tables)" if cfg.local else f"{len(cfg.shards)} shard(s)"
        self.printer(f"{self.name}: mode {cfg.mode}, {where}, device {self.device}"
                     + (f", {steps} steps" if steps else ", until the data ends"))
        last_eval: dict[str, float] = {}
        if evaluating and cfg.eval_every > 0:
            # The curve's first point: the initial model, evaluated before the others may start.
            last_eval = self.evaluate(held_out, evaluate)
            history.append({"step": 0, "samples": 0, "wall_s": 0.0, "time": time.time(), **last_eval})
            if self.board is not None:
                self.board.write(history[-1])
        start_clock = policy.start(self)
        batch = next(stream, None)
        if batch is None:
            raise UsageError("the training data holds no batch")
        upcoming = next(stream, None) if steps is None or steps > 1 else None
        # Prefetching the next batch during compute reads before this step's push lands: fine
        # without a bound, but ssp and sync pull only once the bound (or the barrier) allows.
        # An async step makes one round trip in steady state: its push carries the pull of the
        # batch after next (push_pull, whose answer holds the push's ack), which then has a
        # whole step of compute to come back in. The rows of a step miss one step's update
        # either way (the previous step's), as with a plain prefetch issued before the push.
        pending = None  # the pull of this step's batch, if already under way
        ahead = None  # the push_pull carrying the next step's pull
        push = None
        phase = {"staleness_wait": 0.0, "pull_wait": 0.0, "compute": 0.0, "push": 0.0}
        window_n, samples, eval_time = 0, 0, 0.0
        # This window's summed loss, where the loss is (a GPU's: reading it there waits for the
        # device, so it is read when a record is written, not every step); the last value read.
        window_loss: torch.Tensor | None = None
        loss_value = math.nan
        on_host = self.device.type == "cpu"
        # Sync's combiner of the ranks' row gradients (which wants them in float32), else none.
        combine = policy.row_gradients if type(policy).row_gradients is not AsyncPolicy.row_gradients else None
        straggler, delay_seed = cfg.straggler_spec, cfg.seed
        t_start = time.perf_counter()
        start_time = time.time()
        window_start = 0
        step = 0
        for step in itertools.count():
            clock = start_clock + step
            t0 = time.perf_counter()
            policy.before_step(self, clock)
            tw = time.perf_counter()
            if pending is None:
                pending = ps.prefetch(self.sparse_fn(batch))
            pulled = install(pending)
            pending, ahead = ahead, None
            t1 = time.perf_counter()
            after = next(stream, None) if upcoming is not None and (steps is None or step + 2 < steps) else None
            if prefetch and upcoming is not None and pending is None:
                pending = ps.prefetch(self.sparse_fn(upcoming))
            loss = self.loss_fn(self.model, to_device(batch, self.device))
            loss.backward()
            # The gradients' copies to the host, queued now: sync's wait in after_backward covers them.
            ps.collect(exact=combine is not None, wait=False)
            if not policy.after_backward(more=upcoming is not None) and upcoming is not None:
                # sync: another rank's data ended, so every rank stops after this step.
                self.printer(f"{self.name}: stopping at step {step + 1} with data left: another rank's data ended there "
                             "(sync steps every rank together: give the ranks equal numbers of batches, or set steps)")
                upcoming = after = None
            held = loss.detach()
            window_loss = held.double() if window_loss is None else window_loss + held
            if on_host:
                loss_value = float(held)  # free on the CPU: the loss gauge gets every step's
            # The step's gradients on the host: on CUDA the host's one wait for the GPU this step.
            ps.collect(exact=combine is not None)
            # Straggler experiments: this step computes ``factor`` times slower (same schedule
            # per worker and step in every mode: see tether.worker.stragglers).
            factor = delay_factor(straggler, delay_seed, cfg.worker_index, start_clock + step, cfg.num_workers) if straggler.active else 1.0
            if factor > 1.0:
                time.sleep((factor - 1.0) * (time.perf_counter() - t1))
            t2 = time.perf_counter()
            if push is not None:
                settle(push)
                push = None
            if prefetch and after is not None:
                ahead = ps.push_pull(clock=clock + 1, versions=pulled, sparse=self.sparse_fn(after))
            else:
                push = ps.push(clock=clock + 1, versions=pulled, rows=combine)
            if settle_every_step:
                # The step's updates must land before this worker's clock (or the barrier) lets
                # anyone read past them (such policies never prefetch: the push was just made).
                if push is not None:
                    settle(push)
                push = None
                policy.after_push()
            t3 = time.perf_counter()
            n = self.batch_size_fn(batch)
            samples += n
            window_n += 1
            durations = {"staleness_wait": tw - t0, "pull_wait": t1 - tw, "compute": t2 - t1, "push": t3 - t2}
            for key, value in durations.items():
                phase[key] += value
            self.metrics.record_step(durations, t3 - t0, n, loss_value, clock + 1)
            last = upcoming is None
            # self.config: _checkpoint turns checkpoints off for the run when the shards cannot take them.
            if self.config.checkpoint_every_steps and (step + 1) % self.config.checkpoint_every_steps == 0:
                if cfg.worker_index == 0:
                    self._checkpoint(clock + 1)
                self._save_position(clock + 1, step + 1)
            evaluate_now = evaluating and ((cfg.eval_every > 0 and (step + 1) % cfg.eval_every == 0) or last)
            if (step + 1) % cfg.log_every == 0 or last or evaluate_now:
                wall = time.perf_counter() - t_start - eval_time
                record: dict[str, Any] = {
                    "step": step + 1,
                    "samples": samples,
                    "wall_s": round(wall, 4),
                    "time": time.time(),
                    "train_loss": round(float(window_loss) / max(window_n, 1), 6) if window_loss is not None else math.nan,
                }
                window = staleness[window_start:]
                if window:
                    # Clock staleness of this window's pushes (for the staleness-over-time plot).
                    record["staleness_mean"] = round(sum(window) / len(window), 3)
                    record["staleness_max"] = max(window)
                window_start = len(staleness)
                if evaluate_now:
                    # Evaluation time is left out of the wall clock so curves compare training.
                    te = time.perf_counter()
                    last_eval = self.evaluate(held_out, evaluate)
                    record.update(last_eval)
                    eval_time += time.perf_counter() - te
                history.append(record)
                if self.board is not None:
                    self.board.write(record, staleness[-1] if staleness else None)
                self.printer(self._progress(record, last_eval if evaluate_now else {}, phase, wall, steps, total))
                if not on_host:
                    loss_value = record["train_loss"]  # the loss gauge's, until the next record
                window_loss, window_n = None, 0
            if upcoming is None:
                break
            batch, upcoming = upcoming, after
        if push is not None:
            settle(push)
        wall = time.perf_counter() - t_start - eval_time
        result: dict[str, Any] = {
            "worker_index": cfg.worker_index,
            "mode": cfg.mode,
            "device": str(self.device),
            "steps": step + 1,
            "samples": samples,
            "wall_s": wall,
            "samples_per_sec": samples / wall if wall > 0 else math.nan,
            "phase_seconds": phase,
            "clock_staleness": staleness,
            "update_staleness": update_staleness,
            "start_time": start_time,
            "rejected_too_stale": too_stale,
            "history": history,
            "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items() if k != "auth_token"},
        }
        if evaluating:
            result["final_eval"] = last_eval
        if self._position_of is not None:
            result["data_position"] = self._position_of(step + 1)
        policy.finish(self, start_clock + step + 1, result)
        if self.board is not None:
            self.board.flush()
        if cfg.out:
            out = Path(cfg.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / f"worker-{cfg.worker_index}.json").write_text(json.dumps(result, indent=2))
        return result

    def _progress(
        self, record: dict[str, Any], evals: Mapping[str, float], phase: dict[str, float], wall: float, steps: int | None, total: str
    ) -> str:
        """One progress line: step, loss, throughput, where the time went, elapsed and ETA, and
        the held-out metrics when this step evaluated."""
        busy = sum(phase.values()) or 1.0
        kind = self.config.consistency[0]
        split = " ".join(f"{k} {v / busy:.0%}" for k, v in phase.items() if k != "staleness_wait" or kind == "ssp")
        done = int(record["step"])
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
        path = Path(self.config.out) / "positions" / f"step-{steps}" / f"worker-{self.config.worker_index}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"step": steps, "clock": clock, "position": self._position_of(steps)}))

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
        if isinstance(self.policy, SyncPolicy):
            self.policy.leave(failed)
        self.client.close()

    def __enter__(self) -> Trainer[B]:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        self.close(failed=kind is not None)


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
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"
