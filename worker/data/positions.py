"""Where a worker's data stream is, on disk: the files a worker writes its stream position to and
a restarted worker reads it back from (``--resume-data DIR`` reads ``DIR/worker-<i>.json``).

``OUT/positions/latest/worker-<i>.json`` holds worker ``i``'s newest position, rewritten whole
(a temporary file renamed, so a SIGKILL never leaves half a file) at every progress line;
``OUT/positions/step-<n>/`` holds every worker's position after n steps, beside the shards'
checkpoint ``step-<clock>`` (``--checkpoint-every-steps``). Each file is
``{"step": n, "clock": c, "position": {...}}``: ``position`` is the stream's ``state_dict``,
``step`` the steps of the incarnation that wrote it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["LATEST", "RESUME", "latest_position", "position_file", "read_position", "write_position"]

# Folders under OUT/positions: each worker's newest position, and (the launcher's) the newest an
# earlier incarnation of a restarted worker left, which the restart resumes from.
LATEST = "latest"
RESUME = "resume"


def position_file(out: str | Path, folder: str, worker_index: int) -> Path:
    """``OUT/positions/<folder>/worker-<i>.json``."""
    return Path(out) / "positions" / folder / f"worker-{worker_index}.json"


def latest_position(out: str | Path, worker_index: int) -> Path:
    """Where worker ``worker_index`` keeps its newest position."""
    return position_file(out, LATEST, worker_index)


def write_position(path: Path, step: int, clock: int, position: dict[str, Any]) -> None:
    """Write ``path`` whole: a temporary file beside it, then renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"step": step, "clock": clock, "position": position}))
    os.replace(tmp, path)


def read_position(path: Path) -> dict[str, Any]:
    """The saved document at ``path`` (``{"step", "clock", "position"}``, or a position alone
    as ``{"position": ...}``).

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not JSON, or holds no position (a JSON object).
    """
    saved = json.loads(path.read_text())
    position = saved.get("position", saved) if isinstance(saved, dict) else None
    if not isinstance(position, dict):
        raise ValueError("it holds no stream position (a JSON object, alone or under \"position\")")
    return {**saved, "position": position} if "position" in saved else {"position": position}
