"""Checkpoints of one shard over its life: on demand, periodically and at shutdown, pruned to the
newest few, and the newest usable one restored at start (files: ``tether.server.checkpoints.checkpoint_files``;
which one: ``tether.server.checkpoints.restore``)."""

from __future__ import annotations

import errno
import logging
import pickle
import threading
import time
from pathlib import Path

from tether.protos.errors import FailedPrecondition, TetherError, Unavailable
from tether.server.checkpoints.checkpoint_files import (
    ID_PATTERN,
    CheckpointInfo,
    ChecksumMismatch,
    RestorePlan,
    failure_reason,
    load_state,
    part_name,
    validate_id,
    write_checkpoint,
)
from tether.server.checkpoints.restore import layout_drift, list_manifests, restore_candidates
from tether.server.metrics import NullShardMetrics, ShardRecorder
from tether.server.storage.shard import Shard

__all__ = ["Checkpointer", "RestoreError"]

log = logging.getLogger(__name__)

# Longest a checkpoint call waits for the one before it to finish.
_LOCK_WAIT_S = 600.0


class RestoreError(RuntimeError):
    """The newest checkpoint is there and sound but cannot be restored: written by another shard
    count without a complete set of parts, or no memory to read it into. The shard does not
    start, rather than come back older or empty and serve that."""


def _out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says there was no memory (or space) to read a checkpoint into."""
    if isinstance(exc, MemoryError):
        return True
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOMEM, errno.ENOSPC)
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in text or "cannot allocate memory" in text)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


class Checkpointer:
    """Writes one shard's checkpoints (on demand, periodically, at shutdown) and restores it."""

    def __init__(
        self,
        shard: Shard,
        root: str | Path,
        every_s: float | None = None,
        keep: int = 3,
        metrics: ShardRecorder | None = None,
        crash_before_manifest: bool = False,
    ) -> None:
        if every_s is not None and not every_s > 0:
            raise ValueError(f"every_s must be > 0 or None, got {every_s!r}")
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep!r}")
        self.shard = shard
        # Absolute: the paths it reports must mean the same thing to whoever reads them.
        self.root = Path(root).absolute()
        self.every_s = every_s
        self.keep = keep
        self.metrics: ShardRecorder = metrics if metrics is not None else NullShardMetrics()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._mutations_saved = 0
        self._crash_before_manifest = crash_before_manifest
        # Why checkpoints are failing (None: they are not) and how many attempts failed so: a
        # failure is logged when it starts or its reason changes, and again when one succeeds.
        self._failure: str | None = None
        self._failed_attempts = 0
        # Whether the directory was there once: if it then vanishes, it is created again (only
        # the last folder: a parent that vanished too is a failure, missing_dir).
        self._root_seen = False

    # -- restore ---------------------------------------------------------------------------------

    def restore(self) -> RestorePlan | None:
        """Load the newest usable checkpoint into the shard; None when there is none.

        A checkpoint that fails to load, or one of whose files does not match its checksum, is
        logged and the next older one is tried.

        Raises:
            RestoreError: the newest checkpoint was written by another shard count and cannot be
                restored onto this one (``layout_drift``), or there is no memory to read it into.
        """
        s = self.shard
        self._clean_temporaries()
        manifests = list_manifests(self.root)
        plans = restore_candidates(manifests, s.shard_index, s.num_shards)
        drift, refuse = layout_drift(manifests, plans, self.root, s.shard_index, s.num_shards)
        if refuse:
            raise RestoreError(drift)
        if drift:
            log.warning("%s", drift)
        for plan in plans:
            start = time.perf_counter()
            try:
                state = load_state(plan, s.shard_index, s.num_shards)
                s.import_state(state)
            except ChecksumMismatch as exc:
                log.warning(
                    "not restoring checkpoint %s: %s has checksum %s but its manifest records %s; trying an older one",
                    plan.id, exc.path, exc.actual, exc.expected,
                )
                continue
            except (OSError, ValueError, RuntimeError, MemoryError, pickle.UnpicklingError, TetherError) as exc:
                if _out_of_memory(exc):
                    # The checkpoint is sound; an older one would bring the shard back without
                    # the updates since (and most likely not fit either).
                    size = sum(p.data_bytes for p in plan.parts)
                    raise RestoreError(
                        f"cannot restore checkpoint {plan.id} ({size} bytes in {len(plan.parts)} part(s) under {self.root}): "
                        f"no memory to read it into ({_one_line(exc)}); not falling back to an older checkpoint: "
                        "give the shard more memory"
                    ) from exc
                log.error("cannot restore checkpoint %s (%s); trying an older one", plan.id, exc)
                continue
            s.restored_checkpoint = plan.id
            self._mutations_saved = s.mutations
            layout = plan.parts[0].num_shards
            # The state served now is that checkpoint's: it is the last one that holds it.
            self.metrics.restored(plan.created)
            rows = sum(len(t.ids) for t in state.tables)
            log.info(
                "restored checkpoint %s (%s, %d part(s)%s): %d rows in %d table(s), %d dense chunk(s) in %.2fs",
                plan.id, "complete" if plan.complete else "this shard's part", len(plan.parts),
                f" of {layout} shards, onto {s.num_shards}" if layout != s.num_shards else "", rows,
                len(state.tables), len(state.dense), time.perf_counter() - start,
            )
            return plan
        return None

    def _clean_temporaries(self) -> None:
        if not self.root.is_dir():
            return
        self._root_seen = True
        mine = f".{part_name(self.shard.shard_index, self.shard.num_shards)}."
        for tmp in self.root.glob(f"*/{mine}*.tmp-*"):
            tmp.unlink(missing_ok=True)

    # -- write -----------------------------------------------------------------------------------

    def checkpoint(self, ckpt_id: str) -> CheckpointInfo:
        """Snapshot the shard and write its part of ``ckpt_id``.

        Raises:
            InvalidArgument: an unsafe id.
            Unavailable: another checkpoint held the writer for too long.
            FailedPrecondition: the files could not be written (disk full, permissions).
        """
        validate_id(ckpt_id)
        if not self._lock.acquire(timeout=_LOCK_WAIT_S):
            raise Unavailable(f"checkpoint {ckpt_id}: another checkpoint is still being written")
        try:
            s = self.shard
            start = time.perf_counter()
            mutations = s.mutations
            state = s.export_state()
            try:
                self._ensure_root()
                written = write_checkpoint(state, self.root, ckpt_id, s.shard_index, s.num_shards, self._crash_before_manifest)
            except OSError as exc:
                raise self._failed(ckpt_id, exc) from exc
            info = CheckpointInfo(written.id, written.path, written.bytes, time.perf_counter() - start, written.created)
            self._mutations_saved = mutations
            s.last_checkpoint = ckpt_id
            self.metrics.checkpointed(info.created, info.seconds)
            log.info("checkpoint %s: %d bytes in %.2fs (%s)", ckpt_id, info.bytes, info.seconds, info.path)
            if self._failure is not None:
                log.info("checkpoints work again (after %d failed attempt(s), the last %s)", self._failed_attempts, self._failure)
                self._failure, self._failed_attempts = None, 0
            try:
                self._prune()
            except OSError as exc:  # the part is written; older ones stay until the next prune
                log.warning("checkpoint %s written, but older parts could not be pruned: %s", ckpt_id, _one_line(exc))
            return info
        finally:
            self._lock.release()

    def _ensure_root(self) -> None:
        """Create the checkpoint directory: at first with its parents, later (it vanished) only
        itself, and say so once."""
        if self.root.is_dir():
            self._root_seen = True
            return
        if self._root_seen:
            log.warning("checkpoint directory %s is gone (deleted or unmounted?); creating it again: the checkpoints in it are lost",
                        self.root)
        self.root.mkdir(parents=not self._root_seen, exist_ok=True)
        self._root_seen = True

    def _failed(self, ckpt_id: str, exc: OSError) -> FailedPrecondition:
        """Count a failed write, log it if its reason is new, and make the caller's error."""
        reason = failure_reason(exc)
        self.metrics.checkpoint_failed(reason)
        self._failed_attempts += 1
        last = self.shard.last_checkpoint or self.shard.restored_checkpoint
        message = (
            f"checkpoint {ckpt_id}: cannot write under {self.root} ({reason}): {_one_line(exc)}; "
            + (f"the last good checkpoint, {last}, is intact" if last else "no checkpoint was written yet")
        )
        if reason != self._failure:
            retry = f"; retrying every {self.every_s:g}s" if self.every_s is not None else ""
            log.error("%s%s (said once, until the reason changes or a checkpoint succeeds)", message, retry)
            self._failure = reason
        else:
            log.debug("%s (failed attempt %d)", message, self._failed_attempts)
        return FailedPrecondition(message)

    @property
    def dirty(self) -> bool:
        """Whether a push was applied or a spec declared since the last checkpoint or restore."""
        return self.shard.mutations != self._mutations_saved

    def final(self) -> CheckpointInfo | None:
        """The shutdown checkpoint (``final-<unix ms>``); None when nothing changed since the last one."""
        if not self.dirty:
            log.info(
                "no change since checkpoint %s; no final checkpoint needed",
                self.shard.last_checkpoint or self.shard.restored_checkpoint or "-",
            )
            return None
        return self.checkpoint(f"final-{int(time.time() * 1000)}")

    def _prune(self) -> None:
        """Delete this shard's parts beyond the newest ``keep`` (never the newest complete one)."""
        s = self.shard
        manifests = list_manifests(self.root)
        own = sorted(
            (m for m in manifests if (m.shard_index, m.num_shards) == (s.shard_index, s.num_shards)),
            key=lambda m: (m.created, m.id), reverse=True,
        )
        keep = {m.id for m in own[: self.keep]}
        complete = [p for p in restore_candidates(manifests, s.shard_index, s.num_shards) if p.complete]
        if complete:
            keep.add(complete[0].id)
        name = part_name(s.shard_index, s.num_shards)
        for folder in self.root.iterdir():
            if not folder.is_dir() or folder.name in keep or not ID_PATTERN.fullmatch(folder.name):
                continue
            # Own parts of older ids, and data files a crash left without a manifest.
            for path in (folder / f"{name}.manifest.json", folder / f"{name}.pt"):
                path.unlink(missing_ok=True)
            try:
                folder.rmdir()
            except OSError:
                pass  # other shards' parts are still there

    # -- periodic --------------------------------------------------------------------------------

    def start_periodic(self) -> None:
        """Checkpoint every ``every_s`` seconds (aligned to the wall clock) while the shard changes."""
        if self.every_s is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="tether-checkpoint", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        every = self.every_s
        if every is None:  # start_periodic starts no loop without a period
            return
        while True:
            # Shards of a job wake at the same multiples of the period and name the checkpoint
            # after it, so their parts share an id and the checkpoint becomes complete.
            boundary = (time.time() // every + 1) * every
            if self._stop.wait(max(boundary - time.time(), 0.0)):
                return
            if not self.dirty:
                continue
            try:
                self.checkpoint(f"auto-{round(boundary * 1000)}")
            except FailedPrecondition:
                pass  # a disk fault: logged by checkpoint() when it starts or changes; the shard is
                # still dirty, so the next interval tries again
            except TetherError as exc:
                log.error("periodic checkpoint failed: %s", exc)
            except Exception:
                log.exception("periodic checkpoint failed; trying again at the next interval")

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop periodic checkpoints, waiting up to ``timeout_s`` for one being written."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
