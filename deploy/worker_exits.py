"""Why a worker of a local cluster ended, read from what it left: its exit code, the one line a
usage error printed, the progress lines it logged, and for ``torchrun`` the rank its summary
names as the root cause and that rank's own stderr file."""

from __future__ import annotations

import re
from pathlib import Path

from tether.common.exits import USAGE, interrupted
from tether.deploy.children import Child, tail
from tether.deploy.errors import ClusterError
from tether.protos.errors import UsageError

__all__ = ["RANK_LOGS", "raise_worker_failure", "root_cause", "steps_reported"]


# The one line a worker prints before exiting with USAGE (tether.protos.errors.report_usage_error).
_WORKER_USAGE_PREFIX = "tether worker: error: "


def raise_worker_failure(child: Child, code: int, restarts: int = 0, limit: int = 0) -> None:
    """Raise what a worker's non-zero exit ``code`` means (see ``LocalCluster.wait_workers``).
    For torchrun, what the rank that failed first said: torchrun's own summary names it, and
    its stderr file holds its error."""
    if interrupted(code):
        raise KeyboardInterrupt
    name, log_path = child.name, child.log_path
    if child.name == "torchrun":
        found = root_cause(log_path)
        if found is not None:
            name, code, log_path = found
    if code == USAGE:
        _raise_usage_line(name, log_path)
    if name != child.name:
        raise ClusterError(
            f"{name} failed first (exit code {code}; torchrun stopped the other ranks); its error, from {log_path}:\n{tail(log_path)}"
        )
    after = f" (restarted {restarts} time{'' if restarts == 1 else 's'}, --max-restarts {limit})" if limit else ""
    raise ClusterError(f"{child.name} exited with code {code}{after}; see {child.log_path}:\n{tail(child.log_path)}")


# A progress line of the training loop: "worker 1/3 step 450/600 loss ...".
_STEP_LINE = re.compile(r"\bstep (\d+)(?:/\d+)? loss ")


def steps_reported(log_path: Path, offset: int) -> int:
    """The last step a worker incarnation reported in its log (from byte ``offset``); 0 if none."""
    try:
        with log_path.open("rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
    except OSError:
        return 0
    found = _STEP_LINE.findall(text)
    return int(found[-1]) if found else 0


def _raise_usage_line(name: str, log_path: Path) -> None:
    """Raise the one line a worker printed before exiting with ``USAGE``, if it did."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    for line in reversed(lines):
        if _WORKER_USAGE_PREFIX in line:
            raise UsageError(f"{name}: {line.split(_WORKER_USAGE_PREFIX, 1)[1].strip()}")


# Where torchrun keeps each rank's stderr: <log dir>/ranks/<run id>/attempt_<n>/<local rank>/stderr.log.
RANK_LOGS = "ranks"


# A rank's last line that says only that another rank went away (gloo's and NCCL's words for it):
# a consequence of the failure, never its cause.
_PEER_GONE = re.compile(r"Connection closed by peer|Connection reset by peer|remote (worker|process) (crashing|exited)|"
                        r"NCCL communicator was aborted")
_RANK_ENTRY = re.compile(r"rank\s*:\s*(\d+) \(local_rank: (\d+)\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


def root_cause(torchrun_log: Path) -> tuple[str, int, Path] | None:
    """``(rank N, its exit code, its stderr file)`` of the rank whose failure caused the others,
    or None when the log or the files do not say.

    torchrun names the first failure it observed (its "Root Cause"), which is not always the
    cause: a rank that raised can be slower to exit than the ranks whose collective then failed
    with "connection closed by peer" (torchrun then stops it with SIGTERM). So where the rank
    torchrun names ended on such a line, the first other failed rank (in torchrun's list) whose
    error is its own is the cause."""
    try:
        text = torchrun_log.read_text(errors="replace")
    except OSError:
        return None
    before, _, cause = text.rpartition("Root Cause")
    named = _RANK_ENTRY.search(cause)
    if named is None:
        return None
    _, _, failures = before.rpartition("Failures:")
    entries = [named, *_RANK_ENTRY.finditer(failures)]
    found: list[tuple[str, int, Path]] = []
    for entry in entries:
        rank, local_rank, code = (int(g) for g in entry.groups())
        files = sorted(torchrun_log.parent.glob(f"{RANK_LOGS}/*/attempt_*/{local_rank}/stderr.log"), key=lambda f: f.stat().st_mtime)
        if files:
            found.append((f"rank {rank}", code, files[-1]))
    for candidate in found:
        if not _PEER_GONE.search(_last_line(candidate[2])):
            return candidate
    return found[0] if found else None


def _last_line(path: Path) -> str:
    """The last non-empty line of ``path`` ("" when it cannot be read)."""
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1] if lines else ""
