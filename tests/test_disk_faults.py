"""Checkpoints on a failing disk (issue 30 item 3): full, read-only, a directory that vanishes,
and a restore without memory to read into. The last good checkpoint stays intact and
restorable, the shard keeps serving, the failure is logged once (and again when checkpoints work
again) and counted in tether_shard_checkpoint_failures_total{reason}, and the next interval
tries again.

The full and read-only disks are real (a small tmpfs this test mounts, as root); where mounting
is not permitted those cases skip, and the same code paths run with the errors injected."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from tether.protos.errors import FailedPrecondition
from tether.protos.specs import OptimizerConfig, TableConfig
from tether.server.checkpoints import checkpoint as checkpoint_module
from tether.server.checkpoints import checkpoint_files
from tether.server.checkpoints.checkpoint import Checkpointer, RestoreError
from tether.server.checkpoints.restore import list_manifests
from tether.server.config import ShardConfig
from tether.server.metrics import ShardMetrics
from tether.server.serving.serve import RunningShard, start_shard
from tether.server.storage.shard import Shard
from tether.server.storage.shard_records import SparseUpdate
from tether.worker.client.config import ClientConfig
from tether.worker.client.ps_client import PSClient

TABLE = TableConfig("t", 64, OptimizerConfig("adagrad", 0.1), init_scale=0.0)
EVERY_S = 0.25
LOGGER = "tether.server.checkpoints.checkpoint"


def _wait(predicate: Callable[[], bool], what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _push(shard: Shard, seq: int, ids: np.ndarray) -> None:
    shard.push("w", seq, [SparseUpdate("t", ids, torch.ones(len(ids), 64))], [], incarnation=1)


def _failures(registry: CollectorRegistry, reason: str) -> float:
    return registry.get_sample_value("tether_shard_checkpoint_failures_total", {"reason": reason}) or 0.0


def _errors(caplog: pytest.LogCaptureFixture, word: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= logging.ERROR and word in r.getMessage()]


def _leftovers(root: Path) -> list[Path]:
    """Files a failed attempt left: temporaries, data files without a manifest, empty folders."""
    out = [p for p in root.rglob(".*.tmp-*")]
    out += [p for p in root.glob("*/*.pt") if not p.with_name(p.name[:-3] + ".manifest.json").exists()]
    return out + [d for d in root.iterdir() if d.is_dir() and not any(d.iterdir())]


def _restored_rows(root: Path) -> tuple[str, int]:
    fresh = Shard()
    plan = Checkpointer(fresh, root).restore()
    assert plan is not None
    return plan.id, fresh.tables["t"].rows


class _Serving:
    """A shard served in this process with periodic checkpoints and its own metrics registry."""

    def __init__(self, root: Path) -> None:
        self.registry = CollectorRegistry()
        self.running: RunningShard = start_shard(
            ShardConfig(host="127.0.0.1", port=0, checkpoint_dir=str(root), checkpoint_every_s=EVERY_S),
            metrics=ShardMetrics(self.registry),
        )
        self.shard = self.running.shard
        self.client = PSClient(ClientConfig(addresses=(f"127.0.0.1:{self.running.port}",), worker_id="probe", retries=0))
        self.client.declare([TABLE])  # over the wire, as a worker declares it
        self.seq = 0

    def push(self, ids: np.ndarray) -> None:
        self.seq += 1
        _push(self.shard, self.seq, ids)

    def serves(self) -> bool:
        """Whether a client's pull over gRPC is answered."""
        return self.client.pull({"t": torch.arange(3)}).result(10).rows["t"].shape == (3, 64)

    def checkpointed_after(self, mark: str) -> Callable[[], bool]:
        return lambda: self.shard.last_checkpoint not in ("", mark)

    def close(self) -> None:
        self.client.close()
        self.running.stop(0)


@pytest.fixture
def serving(tmp_path: Path) -> Iterator[Callable[[Path], _Serving]]:
    made: list[_Serving] = []

    def make(root: Path) -> _Serving:
        made.append(_Serving(root))
        return made[-1]

    yield make
    for s in made:
        s.close()


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """``mount(options)``: a tmpfs mounted for this test (skips where mounting is not permitted)."""
    mounted: list[Path] = []

    def mount(options: str) -> Path:
        where = tmp_path / f"disk{len(mounted)}"
        where.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {proc.stderr.strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _remount(where: Path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(where)], check=True)


# -- real disks ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["no_space", "read_only"])
def test_a_full_or_read_only_disk_keeps_the_last_checkpoint_and_the_shard_serving(
    fault: str, tmpfs, serving, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmpfs("size=1m")
    caplog.set_level(logging.INFO, logger=LOGGER)
    s = serving(root / "ckpt")
    s.push(np.arange(100, dtype=np.int64))  # 100 rows x 64 x 2 floats: ~60 KB, fits
    _wait(s.checkpointed_after(""), "the first checkpoint")
    good = s.shard.last_checkpoint
    if fault == "no_space":
        s.push(np.arange(100, 6000, dtype=np.int64))  # ~3 MB: does not fit in 1 MiB
    else:
        _remount(root, "ro")
        s.push(np.arange(100, 200, dtype=np.int64))
    _wait(lambda: _failures(s.registry, fault) >= 3, f"three failed {fault} attempts")
    # Said once, not once per interval; the shard serves on; nothing half-written is left.
    assert len(_errors(caplog, f"({fault})")) == 1, _errors(caplog, "")
    assert good in _errors(caplog, fault)[0] and "intact" in _errors(caplog, fault)[0]
    assert s.shard.last_checkpoint == good
    assert s.serves()
    assert _leftovers(root / "ckpt") == []
    assert [m.id for m in list_manifests(root / "ckpt")] == [good]
    assert _restored_rows(root / "ckpt") == (good, 100)
    # Room again: the next interval writes, and says so once.
    _remount(root, "size=64m" if fault == "no_space" else "rw")
    _wait(lambda: any("checkpoints work again" in r.getMessage() for r in caplog.records), "checkpoints to work again")
    assert s.shard.last_checkpoint != good
    _, rows_now = _restored_rows(root / "ckpt")
    assert rows_now == s.shard.tables["t"].rows


def test_a_vanished_directory_is_created_again_and_a_vanished_parent_is_a_failure(
    tmp_path: Path, serving, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    root = tmp_path / "volume" / "ckpt"
    s = serving(root)
    s.push(np.arange(10, dtype=np.int64))
    _wait(s.checkpointed_after(""), "the first checkpoint")
    first = s.shard.last_checkpoint

    shutil.rmtree(root)  # deleted while the shard runs
    s.push(np.arange(10, 20, dtype=np.int64))
    _wait(s.checkpointed_after(first), "a checkpoint in the directory created again")
    gone = [r.getMessage() for r in caplog.records if "is gone" in r.getMessage()]
    assert len(gone) == 1 and str(root) in gone[0]
    assert _restored_rows(root) == (s.shard.last_checkpoint, 20)

    second = s.shard.last_checkpoint
    shutil.rmtree(tmp_path / "volume")  # the parent too (a volume unmounted): not made up
    s.push(np.arange(20, 30, dtype=np.int64))
    _wait(lambda: _failures(s.registry, "missing_dir") >= 3, "three failed missing_dir attempts")
    assert len(_errors(caplog, "(missing_dir)")) == 1
    assert s.shard.last_checkpoint == second and not (tmp_path / "volume").exists()
    (tmp_path / "volume").mkdir()  # the volume is back
    _wait(s.checkpointed_after(second), "a checkpoint once the parent is back")
    assert _restored_rows(root) == (s.shard.last_checkpoint, 30)


# -- the same paths with injected errors (no mount needed) ---------------------------------------


def _failing_writes(monkeypatch: pytest.MonkeyPatch, err: int, after_bytes: int = 4096) -> None:
    """Data-file writes fail with ``err`` once ``after_bytes`` went through (inside torch.save)."""
    real = checkpoint_files._HashingWriter.write
    written = [0]

    def write(self: object, data: bytes) -> int:
        written[0] += len(data)
        if written[0] > after_bytes:
            raise OSError(err, os.strerror(err))
        return real(self, data)  # type: ignore[arg-type]

    monkeypatch.setattr(checkpoint_files._HashingWriter, "write", write)


@pytest.mark.parametrize("err, reason", [(errno.ENOSPC, "no_space"), (errno.EDQUOT, "no_space"), (errno.EROFS, "read_only"),
                                         (errno.ENOENT, "missing_dir"), (errno.EACCES, "permission"), (errno.EIO, "io_error")])
def test_an_injected_write_error_rewriting_an_id_keeps_its_old_part(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, err: int, reason: str
) -> None:
    """Rewriting an id (``PSClient.checkpoint("latest")`` twice) on a failing disk: the old part
    of that id is still there and restorable, and nothing of the attempt is left."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    registry = CollectorRegistry()
    shard = Shard()
    shard.declare([TABLE], [])
    _push(shard, 1, np.arange(50, dtype=np.int64))
    ckpt = Checkpointer(shard, tmp_path, metrics=ShardMetrics(registry))
    ckpt.checkpoint("latest")
    _push(shard, 2, np.arange(50, 500, dtype=np.int64))
    _failing_writes(monkeypatch, err)
    for _ in range(3):
        with pytest.raises(FailedPrecondition, match=rf"checkpoint latest: cannot write under .* \({reason}\): .*the last good "
                                                     r"checkpoint, latest, is intact"):
            ckpt.checkpoint("latest")
    assert _failures(registry, reason) == 3
    assert len(_errors(caplog, f"({reason})")) == 1
    assert _leftovers(tmp_path) == []
    assert _restored_rows(tmp_path) == ("latest", 50)
    monkeypatch.undo()
    ckpt.checkpoint("latest")
    assert _restored_rows(tmp_path) == ("latest", 500)
    assert any("checkpoints work again (after 3 failed attempt(s), the last " + reason in r.getMessage() for r in caplog.records)


def test_a_manifest_that_cannot_be_written_leaves_no_data_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shard = Shard()
    shard.declare([TABLE], [])
    _push(shard, 1, np.arange(50, dtype=np.int64))
    ckpt = Checkpointer(shard, tmp_path)
    ckpt.checkpoint("a")
    real = checkpoint_files._write_temporary

    def no_room_for_the_manifest(path: Path, write):  # type: ignore[no-untyped-def]
        if path.name.endswith(".manifest.json"):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, write)

    monkeypatch.setattr(checkpoint_files, "_write_temporary", no_room_for_the_manifest)
    with pytest.raises(FailedPrecondition, match=r"\(no_space\)"):
        ckpt.checkpoint("b")
    assert not (tmp_path / "b").exists()  # the data file went with the attempt: its space is free
    assert _leftovers(tmp_path) == []
    assert _restored_rows(tmp_path) == ("a", 50)


# -- restore without memory ----------------------------------------------------------------------


@pytest.mark.parametrize("error", [
    MemoryError(),
    RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried to allocate "
                 "268435456 bytes. Error code 12 (Cannot allocate memory)"),
    OSError(errno.ENOMEM, "Cannot allocate memory"),
])
def test_a_restore_with_no_memory_to_read_into_fails_with_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    error: BaseException) -> None:
    shard = Shard()
    shard.declare([TABLE], [])
    ckpt = Checkpointer(shard, tmp_path)
    _push(shard, 1, np.arange(50, dtype=np.int64))
    ckpt.checkpoint("old")
    _push(shard, 2, np.arange(50, 100, dtype=np.int64))
    ckpt.checkpoint("new")
    real = checkpoint_module.load_state

    def load_state(plan, shard_index, num_shards):  # type: ignore[no-untyped-def]
        if plan.id == "new":
            raise error
        return real(plan, shard_index, num_shards)

    monkeypatch.setattr(checkpoint_module, "load_state", load_state)
    with pytest.raises(RestoreError) as err:
        Checkpointer(Shard(), tmp_path).restore()
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("cannot restore checkpoint new (") and str(tmp_path) in message and "no memory to read it into" in message
    # Not "restored" from the older one: a shard that starts fails to start instead.
    with pytest.raises(RuntimeError, match="cannot restore checkpoint new"):
        start_shard(ShardConfig(host="127.0.0.1", port=0, checkpoint_dir=str(tmp_path)))
    # A checkpoint that is damaged (not a resource problem) still falls back to the older one.
    monkeypatch.setattr(checkpoint_module, "load_state", lambda plan, i, n: (_ for _ in ()).throw(ValueError("bad"))
                        if plan.id == "new" else real(plan, i, n))
    assert _restored_rows(tmp_path) == ("old", 50)


_LIMITED_SHARD = """
import resource, sys
import numpy, torch  # noqa: F401 - loaded before the limit, as a started shard has them
import tether.server.__main__ as server
vm = int(next(line for line in open("/proc/self/status") if line.startswith("VmSize")).split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (32 << 20), vm + (32 << 20)))
sys.exit(server.main(["--port", "0", "--checkpoint-dir", sys.argv[1]]))
"""


def test_a_shard_process_without_memory_for_its_checkpoint_exits_1_with_one_line(tmp_path: Path) -> None:
    """Real: a 52 MB checkpoint, and a shard process allowed 32 MiB of address space more than
    it has once started."""
    shard = Shard()
    shard.declare([TABLE], [])
    _push(shard, 1, np.arange(100_000, dtype=np.int64))
    Checkpointer(shard, tmp_path).checkpoint("big")
    proc = subprocess.run([sys.executable, "-c", _LIMITED_SHARD, str(tmp_path)], capture_output=True, text=True, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if "cannot start" in line]
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert len(lines) == 1 and "cannot restore checkpoint big (" in lines[0] and "no memory to read it into" in lines[0], lines
