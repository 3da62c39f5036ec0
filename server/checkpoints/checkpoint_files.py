"""The files of one shard's checkpoint part: written atomically with checksums, a manifest as the
commit marker, and read back verified.

Layout under the checkpoint directory, one folder per checkpoint id::

    <dir>/<id>/shard-<i>-of-<n>.pt              every table, dense chunk and dedup window
    <dir>/<id>/shard-<i>-of-<n>.manifest.json   written last: this shard's part is complete

Each file is written to a temporary name, fsynced and renamed, and the manifest goes last, so a
crash at any point leaves either a whole part or one that restore ignores. The manifest records
the data file's size and sha256 (hashed as it is written) and a sha256 of its own fields: a
manifest that does not match itself is ignored, and a data file that does not match its manifest
is not loaded. The data file holds rows keyed by id and dense chunks keyed by (name, index) with
their full values, so it does not depend on the shard count: a shard of a job with another shard
count loads every part of a checkpoint and keeps what the partition function gives it
(vectorised masks, no loop over ids). Files are read with ``torch.load(weights_only=True)``:
plain containers and tensors, never arbitrary pickled objects.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any, cast

import numpy as np
import torch

from tether.protos.errors import InvalidArgument
from tether.protos.partition import dense_shard, shard_of_ids
from tether.protos.specs import OptimizerConfig, TableConfig
from tether.server.storage.shard_records import DenseState, ShardState, TableState

__all__ = [
    "CHECKSUM",
    "FAILURE_REASONS",
    "FORMAT",
    "ID_PATTERN",
    "CheckpointInfo",
    "ChecksumMismatch",
    "Manifest",
    "RestorePlan",
    "failure_reason",
    "file_checksum",
    "load_state",
    "manifest_checksum",
    "part_name",
    "validate_id",
    "write_checkpoint",
]

log = logging.getLogger(__name__)

FORMAT = "tether-checkpoint/1"
# What a checkpoint id (a folder name) may be.
ID_PATTERN = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")
# Checksums are "sha256:<hex>": the hex is what `sha256sum` prints for the file, and the prefix
# lets a later format change the algorithm. 1 GB/s with SHA-NI; files are hashed in chunks.
CHECKSUM = "sha256"
_CHUNK = 8 << 20


# Why a checkpoint could not be written, in a word (the label of
# tether_shard_checkpoint_failures_total{reason}): the errno of the OSError.
_REASONS = {
    errno.ENOSPC: "no_space",
    errno.EDQUOT: "no_space",
    errno.EFBIG: "no_space",
    errno.EROFS: "read_only",
    errno.ENOENT: "missing_dir",
    errno.ENOTDIR: "missing_dir",
    errno.ESTALE: "missing_dir",
    errno.EACCES: "permission",
    errno.EPERM: "permission",
}
FAILURE_REASONS: tuple[str, ...] = (*dict.fromkeys(_REASONS.values()), "io_error")


def failure_reason(exc: OSError) -> str:
    """The word for why writing a checkpoint failed with ``exc`` (``io_error``: any other errno)."""
    return _REASONS.get(exc.errno or 0, "io_error")


def _os_error(exc: BaseException) -> OSError | None:
    """The OSError behind ``exc`` (torch.save reports its writer's as a RuntimeError)."""
    seen: BaseException | None = exc
    while seen is not None and not isinstance(seen, OSError):
        seen = seen.__cause__ or seen.__context__
    return seen


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
    h = hashlib.new(CHECKSUM)
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return f"{CHECKSUM}:{h.hexdigest()}"


def manifest_checksum(doc: dict[str, Any]) -> str:
    """``"sha256:<hex>"`` of a manifest's fields other than ``checksum`` (canonical JSON)."""
    body = {k: v for k, v in doc.items() if k != "checksum"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return f"{CHECKSUM}:{hashlib.new(CHECKSUM, canonical).hexdigest()}"


class _HashingWriter:
    """A file wrapper that hashes what goes through it (the data file is hashed as it is written)."""

    def __init__(self, f: IO[bytes]) -> None:
        self._f = f
        self._hash = hashlib.new(CHECKSUM)

    def write(self, data: bytes) -> int:
        self._hash.update(data)
        return self._f.write(data)

    def flush(self) -> None:
        self._f.flush()

    @property
    def checksum(self) -> str:
        return f"{CHECKSUM}:{self._hash.hexdigest()}"


def validate_id(ckpt_id: str) -> str:
    """``ckpt_id`` if it is a safe folder name (it becomes one under the checkpoint directory).

    Raises:
        InvalidArgument: empty, too long, or characters outside ``[A-Za-z0-9._-]``, or a
            leading dot (no ``..``, no hidden folders, no path separators).
    """
    if not isinstance(ckpt_id, str) or not ID_PATTERN.fullmatch(ckpt_id):
        raise InvalidArgument(
            f"checkpoint id must be 1..128 characters of [A-Za-z0-9._-] not starting with '.', got {ckpt_id!r}"
        )
    return ckpt_id


def part_name(shard_index: int, num_shards: int) -> str:
    """The file name stem of shard ``shard_index`` of ``num_shards``'s part."""
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


def _write_temporary(path: Path, write: Callable[[IO[bytes]], object]) -> tuple[Path, int]:
    """Write through ``write(file)`` to a temporary name beside ``path`` and fsync it; returns
    the temporary path and its size (the caller renames it into place, or removes it)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        return tmp, tmp.stat().st_size
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _table_record(t: TableState) -> dict[str, Any]:
    return {
        "config": asdict(t.config),
        "ids": torch.from_numpy(np.ascontiguousarray(t.ids, dtype=np.int64)),
        "weights": t.weights.contiguous(),
        "state": {k: v.contiguous() for k, v in t.state.items()},
        "version": int(t.version),
    }


def _dense_record(d: DenseState) -> dict[str, Any]:
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
    """Write one shard's part of checkpoint ``ckpt_id`` under ``root`` (which must exist): data
    file, then manifest.

    Both files are written to temporary names first; only once both are on disk is the part put
    in place (renames, which need no space): a disk that fills up, turns read-only or vanishes
    midway leaves every checkpoint as it was, an older part of the same id included, and no
    file of this attempt behind. Writing an id this shard wrote before replaces its part (its
    old manifest goes first, so no manifest ever points at a half-replaced part).
    ``crash_before_manifest`` (a test hook) ends the process between the data file and the
    manifest.

    Raises:
        InvalidArgument: an unsafe ``ckpt_id``.
        OSError: the files could not be written (``failure_reason`` says why in a word).
    """
    validate_id(ckpt_id)
    start = time.perf_counter()
    folder = Path(root) / ckpt_id
    created_folder = not folder.is_dir()
    folder.mkdir(exist_ok=True)
    name = part_name(shard_index, num_shards)
    manifest_path = folder / f"{name}.manifest.json"
    data_path = folder / f"{name}.pt"
    temporaries: list[Path] = []
    try:
        data_tmp, data_bytes, checksum = _write_data(state, data_path, ckpt_id, shard_index, num_shards)
        temporaries.append(data_tmp)
        created = time.time()
        manifest = {
            "format": FORMAT,
            "id": ckpt_id,
            "shard_index": shard_index,
            "num_shards": num_shards,
            "created": created,
            "data": {"file": data_path.name, "bytes": data_bytes, "checksum": checksum},
            "tables": {t.config.name: len(t.ids) for t in state.tables},
            "dense_chunks": len(state.dense),
            "seconds": time.perf_counter() - start,
        }
        # The manifest's own checksum: a damaged manifest that still parses (a digit of its time
        # or size changed) is not taken for the commit marker of a good part.
        manifest["checksum"] = manifest_checksum(manifest)
        manifest_tmp, _ = _write_temporary(manifest_path, lambda f: f.write(json.dumps(manifest, indent=2).encode()))
        temporaries.append(manifest_tmp)
        if manifest_path.exists():
            manifest_path.unlink()
            _fsync_dir(folder)
        os.replace(data_tmp, data_path)
        _fsync_dir(folder)
        if crash_before_manifest:
            log.error("crash_before_manifest: exiting between the data file and the manifest of checkpoint %s", ckpt_id)
            os._exit(1)
        os.replace(manifest_tmp, manifest_path)
        _fsync_dir(folder)
    except BaseException:
        for tmp in temporaries:
            tmp.unlink(missing_ok=True)
        if created_folder:
            try:
                folder.rmdir()  # only if this attempt left it empty
            except OSError:
                pass
        raise
    return CheckpointInfo(ckpt_id, str(manifest_path), data_bytes, time.perf_counter() - start, created)


def _write_data(state: ShardState, data_path: Path, ckpt_id: str, shard_index: int, num_shards: int) -> tuple[Path, int, str]:
    """The part's data file, written to a temporary name: (its path, its size, its checksum)."""
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

    def write_data(f: IO[bytes]) -> None:
        writers.append(_HashingWriter(f))
        # torch.save needs only write and flush of a file object: the wrapper has both.
        try:
            torch.save(payload, cast(IO[bytes], writers[-1]))
        except RuntimeError as exc:
            # "unexpected pos ..." says nothing: the disk's own error does (no space, read-only).
            cause = _os_error(exc)
            if cause is None:
                raise
            raise cause from exc

    tmp, size = _write_temporary(data_path, write_data)
    return tmp, size, writers[-1].checksum


# -- loading ------------------------------------------------------------------------------------


def _load_part(path: Path, checksum: str) -> dict[str, Any]:
    actual = file_checksum(path)
    if actual != checksum:
        raise ChecksumMismatch(path, checksum, actual)
    # mmap: a part of another shard count is read only where its rows are kept.
    doc = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"{path} is not a {FORMAT} file")
    return doc


def _optimizer(d: dict[str, Any]) -> OptimizerConfig:
    return OptimizerConfig(**d)


def _table_config(d: dict[str, Any]) -> TableConfig:
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
