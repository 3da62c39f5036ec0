"""Checkpoints of one shard: atomic files, a manifest as the commit marker, restore at start.

Layout under the checkpoint directory, one folder per checkpoint id::

    <dir>/<id>/shard-<i>-of-<n>.pt              every table, dense chunk and dedup window
    <dir>/<id>/shard-<i>-of-<n>.manifest.json   written last: this shard's part is complete

Each file is written to a temporary name, fsynced and renamed, and the manifest goes last, so a
crash at any point leaves either a whole part or one that restore ignores. The manifest records
the data file's size and sha256 (hashed as it is written) and a sha256 of its own fields: a
manifest that does not match itself is ignored, and a data file that does not match its manifest
is not loaded (restore says which file, with both digests, and tries the next older checkpoint).
The data file holds
rows keyed by id and dense chunks keyed by (name, index) with their full values, so it does not
depend on the shard count: a shard of a job with another shard count loads every part of a
checkpoint and keeps what the partition function gives it (vectorised masks, no loop over ids).
Files are read with ``torch.load(weights_only=True)``: plain containers and tensors, never
arbitrary pickled objects.

Which checkpoint a starting shard ``i`` of ``M`` restores: the newest (by manifest time) of

* complete checkpoints: every shard ``0..n-1`` of the writing job wrote its manifest, and
* this shard's own part of a checkpoint written by a job with the same shard count ``M``:
  with the same partition a shard's part holds every row it owns, so it is enough alone. This
  is what lets one shard restarted after SIGTERM or a crash (and shards on Kubernetes, whose
  volumes each hold one shard's parts) resume from their latest part even when the other
  shards did not write that id.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import re
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from tether.protos.errors import FailedPrecondition, InvalidArgument, TetherError, Unavailable
from tether.protos.partition import dense_shard, shard_of_ids
from tether.protos.specs import OptimizerConfig, TableConfig
from tether.server.metrics import NullShardMetrics, ShardRecorder
from tether.server.shard import DenseState, Shard, ShardState, TableState

__all__ = [
    "FORMAT",
    "CheckpointInfo",
    "Checkpointer",
    "ChecksumMismatch",
    "Manifest",
    "RestorePlan",
    "choose_restore",
    "complete_checkpoints",
    "file_checksum",
    "list_manifests",
    "load_state",
    "manifest_checksum",
    "validate_id",
    "write_checkpoint",
]

log = logging.getLogger(__name__)

FORMAT = "tether-checkpoint/1"
# Test hook: a writer with this set to 1 exits between its data file and its manifest.
_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")
_PART = re.compile(r"shard-(\d+)-of-(\d+)\.manifest\.json")
# Longest a checkpoint call waits for the one before it to finish.
_LOCK_WAIT_S = 600.0
# Checksums are "sha256:<hex>": the hex is what `sha256sum` prints for the file, and the prefix
# lets a later format change the algorithm. 1 GB/s with SHA-NI; files are hashed in chunks.
_CHECKSUM = "sha256"
_CHUNK = 8 << 20


class ChecksumMismatch(ValueError):
    """A checkpoint file's bytes do not match the checksum its manifest records."""

    def __init__(self, path: Path, expected: str, actual: str) -> None:
        super().__init__(f"{path}: checksum mismatch: the manifest records {expected}, the file has {actual}")
        self.path = path
        self.expected = expected
        self.actual = actual


def file_checksum(path: str | Path) -> str:
    """``"sha256:<hex>"`` of the bytes of ``path``, read in chunks (never the whole file at once).

    Raises:
        OSError: the file cannot be read.
    """
    h = hashlib.new(_CHECKSUM)
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return f"{_CHECKSUM}:{h.hexdigest()}"


def manifest_checksum(doc: dict[str, object]) -> str:
    """``"sha256:<hex>"`` of a manifest's fields other than ``checksum`` (canonical JSON)."""
    body = {k: v for k, v in doc.items() if k != "checksum"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return f"{_CHECKSUM}:{hashlib.new(_CHECKSUM, canonical).hexdigest()}"


class _HashingWriter:
    """A file wrapper that hashes what goes through it (the data file is hashed as it is written)."""

    def __init__(self, f: object) -> None:
        self._f = f
        self._hash = hashlib.new(_CHECKSUM)

    def write(self, data: bytes) -> int:
        self._hash.update(data)
        return self._f.write(data)

    def flush(self) -> None:
        self._f.flush()

    @property
    def checksum(self) -> str:
        return f"{_CHECKSUM}:{self._hash.hexdigest()}"


def validate_id(ckpt_id: str) -> str:
    """``ckpt_id`` if it is a safe folder name (it becomes one under the checkpoint directory).

    Raises:
        InvalidArgument: empty, too long, or characters outside ``[A-Za-z0-9._-]``, or a
            leading dot (no ``..``, no hidden folders, no path separators).
    """
    if not isinstance(ckpt_id, str) or not _ID.fullmatch(ckpt_id):
        raise InvalidArgument(
            f"checkpoint id must be 1..128 characters of [A-Za-z0-9._-] not starting with '.', got {ckpt_id!r}"
        )
    return ckpt_id


def _part(shard_index: int, num_shards: int) -> str:
    return f"shard-{shard_index}-of-{num_shards}"


@dataclass(frozen=True)
class CheckpointInfo:
    """One shard's part of a checkpoint, as written."""

    id: str
    path: str  # the manifest
    bytes: int  # the data file
    seconds: float  # snapshot + write
    created: float  # unix time


@dataclass(frozen=True)
class Manifest:
    """A parsed manifest whose data file is present with the size it records."""

    id: str
    shard_index: int
    num_shards: int
    created: float
    path: Path
    data_path: Path
    data_bytes: int
    data_checksum: str  # "sha256:<hex>" of the data file, verified when it is loaded


@dataclass(frozen=True)
class RestorePlan:
    """The checkpoint a shard restores and the parts it reads."""

    id: str
    parts: tuple[Manifest, ...]
    complete: bool
    created: float


# -- writing ------------------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, write: object) -> int:
    """Write through ``write(file)`` to a temporary name, fsync, rename; returns the bytes."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        size = tmp.stat().st_size
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return size


def _table_record(t: TableState) -> dict[str, object]:
    return {
        "config": asdict(t.config),
        "ids": torch.from_numpy(np.ascontiguousarray(t.ids, dtype=np.int64)),
        "weights": t.weights.contiguous(),
        "state": {k: v.contiguous() for k, v in t.state.items()},
        "version": int(t.version),
    }


def _dense_record(d: DenseState) -> dict[str, object]:
    return {
        "name": d.name,
        "index": int(d.index),
        "optimizer": asdict(d.optimizer),
        "value": d.value.contiguous(),
        "state": {k: v.contiguous() for k, v in d.state.items()},
        "version": int(d.version),
    }


def write_checkpoint(
    state: ShardState, root: Path, ckpt_id: str, shard_index: int, num_shards: int, crash_before_manifest: bool = False
) -> CheckpointInfo:
    """Write one shard's part of checkpoint ``ckpt_id`` under ``root``: data file, then manifest.

    Writing an id this shard wrote before replaces its part (the old manifest goes first, so
    a crash midway leaves no manifest pointing at a half-written part). ``crash_before_manifest``
    (a test hook) ends the process between the two.

    Raises:
        InvalidArgument: an unsafe ``ckpt_id``.
        OSError: the files could not be written.
    """
    validate_id(ckpt_id)
    start = time.perf_counter()
    folder = Path(root) / ckpt_id
    folder.mkdir(parents=True, exist_ok=True)
    name = _part(shard_index, num_shards)
    manifest_path = folder / f"{name}.manifest.json"
    data_path = folder / f"{name}.pt"
    if manifest_path.exists():
        manifest_path.unlink()
        _fsync_dir(folder)
    payload = {
        "format": FORMAT,
        "id": ckpt_id,
        "shard_index": shard_index,
        "num_shards": num_shards,
        "tables": [_table_record(t) for t in state.tables],
        "dense": [_dense_record(d) for d in state.dense],
        # uint64 sequence numbers travel as int64 bits: torch has no uint64 tensors to save.
        "seqs": {w: torch.from_numpy(s.astype(np.uint64).view(np.int64)) for w, s in state.seqs.items()},
        "applied_pushes": int(state.applied_pushes),
    }
    writers: list[_HashingWriter] = []

    def write_data(f: object) -> None:
        writers.append(_HashingWriter(f))
        torch.save(payload, writers[-1])

    data_bytes = _atomic_write(data_path, write_data)
    _fsync_dir(folder)
    if crash_before_manifest:
        log.error("crash_before_manifest: exiting between the data file and the manifest of checkpoint %s", ckpt_id)
        os._exit(1)
    created = time.time()
    manifest = {
        "format": FORMAT,
        "id": ckpt_id,
        "shard_index": shard_index,
        "num_shards": num_shards,
        "created": created,
        "data": {"file": data_path.name, "bytes": data_bytes, "checksum": writers[-1].checksum},
        "tables": {t.config.name: int(len(t.ids)) for t in state.tables},
        "dense_chunks": len(state.dense),
        "seconds": time.perf_counter() - start,
    }
    # The manifest's own checksum: a damaged manifest that still parses (a digit of its time
    # or size changed) is not taken for the commit marker of a good part.
    manifest["checksum"] = manifest_checksum(manifest)
    _atomic_write(manifest_path, lambda f: f.write(json.dumps(manifest, indent=2).encode()))
    _fsync_dir(folder)
    return CheckpointInfo(ckpt_id, str(manifest_path), data_bytes, time.perf_counter() - start, created)


# -- choosing -----------------------------------------------------------------------------------


def _parse_manifest(path: Path) -> Manifest | None:
    m = _PART.fullmatch(path.name)
    if m is None:
        return None
    try:
        doc = json.loads(path.read_text())
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
        recorded, actual = doc.get("checksum"), manifest_checksum(doc)
        if recorded != actual:
            log.warning(
                "ignoring checkpoint manifest %s: checksum mismatch: it records %s, its contents have %s",
                path, recorded if recorded is not None else "no checksum", actual,
            )
            return None
        data_path = path.parent / str(doc["data"]["file"])
        data_checksum = str(doc["data"]["checksum"])
        if not data_checksum.startswith(f"{_CHECKSUM}:"):
            raise ValueError(f"data checksum {data_checksum!r} is not {_CHECKSUM}:<hex>")
        manifest = Manifest(
            id=str(doc["id"]),
            shard_index=int(doc["shard_index"]),
            num_shards=int(doc["num_shards"]),
            created=float(doc["created"]),
            path=path,
            data_path=data_path,
            data_bytes=int(doc["data"]["bytes"]),
            data_checksum=data_checksum,
        )
        ok = (
            doc.get("format") == FORMAT
            and manifest.id == path.parent.name
            and (manifest.shard_index, manifest.num_shards) == (int(m.group(1)), int(m.group(2)))
            and 0 <= manifest.shard_index < manifest.num_shards
            and data_path.parent == path.parent
            and data_path.stat().st_size == manifest.data_bytes
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring checkpoint manifest %s: %s", path, exc)
        return None
    if not ok:
        log.warning("ignoring checkpoint manifest %s: it does not match its folder, name or data file", path)
        return None
    return manifest


def list_manifests(root: Path) -> list[Manifest]:
    """Every valid manifest under ``root`` (a part whose data file is missing or short is left out)."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for folder in sorted(root.iterdir()):
        if not folder.is_dir() or not _ID.fullmatch(folder.name):
            continue
        for path in sorted(folder.glob("shard-*-of-*.manifest.json")):
            manifest = _parse_manifest(path)
            if manifest is not None:
                out.append(manifest)
    return out


def _candidates(manifests: list[Manifest], shard_index: int, num_shards: int) -> list[RestorePlan]:
    groups: dict[tuple[str, int], dict[int, Manifest]] = {}
    for m in manifests:
        groups.setdefault((m.id, m.num_shards), {})[m.shard_index] = m
    plans = []
    for (ckpt_id, n), parts in groups.items():
        own = parts.get(shard_index) if n == num_shards else None
        if set(parts) == set(range(n)):
            # With the same partition the own part alone holds every row this shard owns.
            chosen = (own,) if own is not None else tuple(parts[j] for j in range(n))
            plans.append(RestorePlan(ckpt_id, chosen, True, max(p.created for p in parts.values())))
        elif own is not None:
            plans.append(RestorePlan(ckpt_id, (own,), False, own.created))
    plans.sort(key=lambda p: (p.created, p.id), reverse=True)
    return plans


def complete_checkpoints(root: Path) -> list[RestorePlan]:
    """Checkpoints under ``root`` that every shard of their job wrote, newest first (what an
    export of the whole model reads)."""
    return _candidates(list_manifests(root), 0, 1)


def choose_restore(root: Path, shard_index: int, num_shards: int) -> RestorePlan | None:
    """The checkpoint shard ``shard_index`` of ``num_shards`` restores (see the module doc)."""
    plans = _candidates(list_manifests(root), shard_index, num_shards)
    return plans[0] if plans else None


# -- loading ------------------------------------------------------------------------------------


def _load_part(path: Path, checksum: str) -> dict[str, object]:
    actual = file_checksum(path)
    if actual != checksum:
        raise ChecksumMismatch(path, checksum, actual)
    # mmap: a part of another shard count is read only where its rows are kept.
    doc = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"{path} is not a {FORMAT} file")
    return doc


def _optimizer(d: dict[str, object]) -> OptimizerConfig:
    return OptimizerConfig(**d)


def _table_config(d: dict[str, object]) -> TableConfig:
    fields = dict(d)
    fields["optimizer"] = _optimizer(fields["optimizer"])
    return TableConfig(**fields)


def load_state(plan: RestorePlan, shard_index: int, num_shards: int) -> ShardState:
    """Read the parts of ``plan`` and keep the rows and chunks shard ``shard_index`` owns.

    Every part's data file is checked against the checksum its manifest records before it is
    read, whichever shard count wrote it.

    Raises:
        ChecksumMismatch: a data file whose bytes are not those its manifest records.
        ValueError: a part that is not a tether checkpoint, or parts that disagree on a table.
        OSError, pickle.UnpicklingError, RuntimeError: unreadable files.
    """
    table_parts: dict[str, list[tuple[np.ndarray, torch.Tensor, dict[str, torch.Tensor]]]] = {}
    configs: dict[str, TableConfig] = {}
    versions: dict[str, int] = {}
    dense: list[DenseState] = []
    seqs: dict[str, np.ndarray] = {}
    applied = 0
    for part in plan.parts:
        doc = _load_part(part.data_path, part.data_checksum)
        for t in doc["tables"]:
            cfg = _table_config(t["config"])
            if configs.setdefault(cfg.name, cfg) != cfg:
                raise ValueError(f"checkpoint {plan.id}: parts disagree on table {cfg.name!r}")
            ids = t["ids"].numpy()
            mine = shard_of_ids(ids, num_shards) == shard_index
            if mine.all():  # the same partition: take the part as it is (no copy yet)
                table_parts.setdefault(cfg.name, []).append((ids, t["weights"], dict(t["state"])))
            else:
                sel = torch.from_numpy(np.flatnonzero(mine))
                table_parts.setdefault(cfg.name, []).append(
                    (ids[mine], t["weights"].index_select(0, sel), {k: v.index_select(0, sel) for k, v in t["state"].items()})
                )
            versions[cfg.name] = max(versions.get(cfg.name, 0), int(t["version"]))
        for d in doc["dense"]:
            if dense_shard(d["name"], int(d["index"]), num_shards) == shard_index:
                dense.append(DenseState(d["name"], int(d["index"]), _optimizer(d["optimizer"]), d["value"].clone(),
                                        {k: v.clone() for k, v in d["state"].items()}, int(d["version"])))
        # Sequence numbers count per (worker, shard): they only mean something to the same shard.
        if (part.shard_index, part.num_shards) == (shard_index, num_shards):
            seqs = {w: s.numpy().view(np.uint64).copy() for w, s in doc["seqs"].items()}
            applied = int(doc["applied_pushes"])
    tables = []
    for name, parts in table_parts.items():
        if len(parts) == 1 and (len(parts[0][0]) < 2 or bool(np.all(np.diff(parts[0][0]) > 0))):
            ids, weights, state = parts[0]  # one part, already sorted by id (as written)
        else:
            ids = np.concatenate([p[0] for p in parts])
            order = np.argsort(ids, kind="stable")
            sel = torch.from_numpy(order)
            ids = ids[order]
            weights = torch.cat([p[1] for p in parts]).index_select(0, sel)
            state = {k: torch.cat([p[2][k] for p in parts]).index_select(0, sel) for k in parts[0][2]}
        tables.append(TableState(configs[name], ids, weights, state, versions[name]))
    return ShardState(tables, dense, seqs, applied)


# -- the shard's checkpointer --------------------------------------------------------------------


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

    # -- restore ---------------------------------------------------------------------------------

    def restore(self) -> RestorePlan | None:
        """Load the newest usable checkpoint into the shard; None when there is none.

        A checkpoint that fails to load, or one of whose files does not match its checksum, is
        logged and the next older one is tried.
        """
        s = self.shard
        self._clean_temporaries()
        for plan in _candidates(list_manifests(self.root), s.shard_index, s.num_shards):
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
            except (OSError, ValueError, RuntimeError, pickle.UnpicklingError, TetherError) as exc:
                log.error("cannot restore checkpoint %s (%s); trying an older one", plan.id, exc)
                continue
            s.restored_checkpoint = plan.id
            self._mutations_saved = s.mutations
            # The state served now is that checkpoint's: it is the last one that holds it.
            self.metrics.restored(plan.created)
            rows = sum(len(t.ids) for t in state.tables)
            log.info(
                "restored checkpoint %s (%s, %d part(s)): %d rows in %d table(s), %d dense chunk(s) in %.2fs",
                plan.id, "complete" if plan.complete else "this shard's part", len(plan.parts), rows,
                len(state.tables), len(state.dense), time.perf_counter() - start,
            )
            return plan
        return None

    def _clean_temporaries(self) -> None:
        if not self.root.is_dir():
            return
        mine = f".{_part(self.shard.shard_index, self.shard.num_shards)}."
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
                written = write_checkpoint(state, self.root, ckpt_id, s.shard_index, s.num_shards, self._crash_before_manifest)
            except OSError as exc:
                raise FailedPrecondition(f"checkpoint {ckpt_id}: cannot write under {self.root}: {exc}") from exc
            info = CheckpointInfo(written.id, written.path, written.bytes, time.perf_counter() - start, written.created)
            self._mutations_saved = mutations
            s.last_checkpoint = ckpt_id
            self.metrics.checkpointed(info.created, info.seconds)
            log.info("checkpoint %s: %d bytes in %.2fs (%s)", ckpt_id, info.bytes, info.seconds, info.path)
            self._prune()
            return info
        finally:
            self._lock.release()

    @property
    def dirty(self) -> bool:
        """Whether a push was applied or a spec declared since the last checkpoint or restore."""
        return self.shard.mutations != self._mutations_saved

    def final(self) -> CheckpointInfo | None:
        """The shutdown checkpoint (``final-<unix ms>``); None when nothing changed since the last one."""
        if not self.dirty:
            log.info("no change since checkpoint %s; no final checkpoint needed", self.shard.last_checkpoint or self.shard.restored_checkpoint or "-")
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
        complete = [p for p in _candidates(manifests, s.shard_index, s.num_shards) if p.complete]
        if complete:
            keep.add(complete[0].id)
        name = _part(s.shard_index, s.num_shards)
        for folder in self.root.iterdir():
            if not folder.is_dir() or folder.name in keep or not _ID.fullmatch(folder.name):
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
        while True:
            # Shards of a job wake at the same multiples of the period and name the checkpoint
            # after it, so their parts share an id and the checkpoint becomes complete.
            boundary = (time.time() // every + 1) * every
            if self._stop.wait(max(boundary - time.time(), 0.0)):
                return
            if not self.dirty:
                continue
            try:
                self.checkpoint(f"auto-{int(round(boundary * 1000))}")
            except TetherError as exc:
                log.error("periodic checkpoint failed: %s", exc)

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop periodic checkpoints, waiting up to ``timeout_s`` for one being written."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
